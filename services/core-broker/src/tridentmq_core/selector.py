"""Message selectors: the SQL-92 conditional-expression subset of JMS / ActiveMQ Artemis.

:func:`compile_selector` parses a selector once into nested closures, so :meth:`Selector.matches`
on the hot path only calls functions: no AST walk and no ``eval``/``exec``.

Semantics follow JMS. NULL (a missing property, or ``None``) makes a comparison UNKNOWN, and
AND / OR / NOT use SQL three-valued logic; inside the closures UNKNOWN is ``None``. Comparing
values of incompatible types is UNKNOWN as well. ``matches`` is true only when the whole selector
is TRUE, and it never raises, whatever values the properties hold.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple, TypeAlias, cast

__all__ = ["MAX_DEPTH", "MAX_LENGTH", "Selector", "SelectorError", "compile_selector"]

MAX_LENGTH: Final = 4096
"""Longest selector accepted, in characters."""

MAX_DEPTH: Final = 64
"""Deepest parenthesis nesting accepted. Every recursion of the parser, and every level of nested
closures, goes through a parenthesis, so this bounds the stack that compiling and matching use."""

_Props: TypeAlias = Mapping[str, object]
_Eval: TypeAlias = Callable[[_Props], object]
# Operands are typed Any because each operator checks their exact runtime types before using them.
_BinOp: TypeAlias = Callable[[Any, Any], object]
_Kind: TypeAlias = Literal["bool", "num", "str", "any"]


class SelectorError(ValueError):
    """A selector that does not compile; ``position`` is the 0-based offset of the fault."""

    def __init__(self, reason: str, position: int) -> None:
        super().__init__(f"{reason} at position {position}")
        self.reason = reason
        self.position = position

    def __reduce__(self) -> tuple[type[SelectorError], tuple[str, int]]:
        # The default reduce would call __init__ with the formatted message only.
        return (type(self), (self.reason, self.position))


@dataclass(frozen=True, slots=True)
class Selector:
    """A compiled selector; build one with :func:`compile_selector`."""

    text: str
    _evaluate: _Eval = field(repr=False, compare=False)
    #: (property, value) when the whole selector is ``property = 'value'``: the only messages it can accept
    #: are those whose property has that string, so a queue keyed on that property finds them by key.
    equals: tuple[str, str] | None = field(default=None, compare=False)

    def matches(self, props: Mapping[str, object]) -> bool:
        """True only if the selector is TRUE for ``props``; FALSE and UNKNOWN both reject."""
        return self._evaluate(props) is True


def compile_selector(text: str) -> Selector:
    """Compile selector text, raising :class:`SelectorError` if it is not a valid selector."""
    simple = _EQUALS_STRING_RE.fullmatch(text) if len(text) <= MAX_LENGTH else None
    if simple is not None and simple["name"].upper() not in _KEYWORDS:
        # ``property = 'string'``, the whole selector: an MQTT SUBSCRIBE's look-up of its topic's retained
        # message has one of its own per topic. Parsed here in one step (the tokenizer and parser were a tenth
        # of a core's work per MQTT connect), and not cached, where it would push out texts that recur.
        name, literal = simple["name"], simple["literal"]
        node = _comparison("=", _identifier(name, 0), _const(literal[1:-1].replace("''", "'"), "str", len(name)))
        return Selector(text, node.fn, node.equals)
    return _compile_cached(text)


@functools.lru_cache(maxsize=4096)
def _compile_cached(text: str) -> Selector:
    """A compiled selector holds no state, so the same text shares one (every MQTT session's lock queue has its
    owner's filter: compiling it was a seventh of a core's work per connect)."""
    if len(text) > MAX_LENGTH:
        raise SelectorError(f"selector is longer than {MAX_LENGTH} characters", MAX_LENGTH)
    tokens = _tokenize(text)
    if tokens[0].kind == "eof":
        raise SelectorError("empty selector", 0)
    node = _Parser(tokens).parse()
    return Selector(text, node.fn, node.equals)


# ---------------------------------------------------------------------------------- values

_NUMBERS: Final = frozenset({int, float})
_EQUATABLE: Final = frozenset({str, int, float, bool, bytes})
_PLAIN: Final = frozenset({str, int, float, bool, bytes, type(None)})
_NO_PROPS: Final[_Props] = {}


def _normalise(value: object) -> object:
    """Reduce a subclass of a supported type (IntEnum, StrEnum, ...) to the plain value."""
    # The base-class methods copy the underlying value without running any override, so a
    # hostile __str__ or __eq__ never executes; type() and issubclass() cannot be intercepted
    # the way isinstance() can through a __class__ property.
    kind = type(value)
    if issubclass(kind, str):
        return str.__str__(cast(str, value))
    if issubclass(kind, int):
        return int.__int__(cast(int, value))
    if issubclass(kind, float):
        return float.__float__(cast(float, value))
    if issubclass(kind, bytes):
        return bytes.__bytes__(cast(bytes, value))
    # Any other type is left as is: every operator checks exact types, so it is simply UNKNOWN.
    return value


def _truth(value: object) -> bool | None:
    """The truth value of an operand of AND / OR / NOT: only a real bool has one."""
    return value if type(value) is bool else None


def _equal(a: object, b: object) -> bool | None:
    kind = type(a)
    if kind is type(b):
        return a == b if kind in _EQUATABLE else None
    if kind in _NUMBERS and type(b) in _NUMBERS:
        return a == b
    return None


def _not_equal(a: object, b: object) -> bool | None:
    equal = _equal(a, b)
    return None if equal is None else not equal


def _ordered(compare: Callable[[Any, Any], Any]) -> _BinOp:
    """A JMS ordering comparison: defined for numbers only (strings and booleans are UNKNOWN)."""

    def ordered(a: Any, b: Any) -> object:
        if type(a) in _NUMBERS and type(b) in _NUMBERS:
            return compare(a, b)
        return None

    return ordered


_ORDERINGS: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "<": operator.lt,
    ">": operator.gt,
    "<=": operator.le,
    ">=": operator.ge,
}
_COMPARATORS: Final[dict[str, _BinOp]] = {
    "=": _equal,
    "<>": _not_equal,
    **{op: _ordered(compare) for op, compare in _ORDERINGS.items()},
}
# ``1 < x`` is compiled as ``x > 1`` so that the constant-operand fast path sees it on the right.
_MIRRORED: Final = {"=": "=", "<>": "<>", "<": ">", ">": "<", "<=": ">=", ">=": "<="}
_LESS_EQUAL: Final = _COMPARATORS["<="]


def _arithmetic(apply: Callable[[Any, Any], Any]) -> _BinOp:
    """A numeric operator: NULL or a non-number operand makes the result NULL."""

    def arithmetic(a: Any, b: Any) -> object:
        if type(a) in _NUMBERS and type(b) in _NUMBERS:
            try:
                return apply(a, b)
            except OverflowError:  # an int too large to convert to float meets a float
                return None
        return None

    return arithmetic


def _divide(a: int | float, b: int | float) -> int | float | None:
    if b == 0:
        return None
    if type(a) is int and type(b) is int:
        # Integer division as in Java: truncate toward zero (Python's // floors).
        quotient = abs(a) // abs(b)
        return quotient if (a < 0) == (b < 0) else -quotient
    return a / b


_ARITHMETIC: Final[dict[str, _BinOp]] = {
    "+": _arithmetic(operator.add),
    "-": _arithmetic(operator.sub),
    "*": _arithmetic(operator.mul),
    "/": _arithmetic(_divide),
}


def _negative(a: Any) -> object:
    return -a if type(a) in _NUMBERS else None


def _positive(a: Any) -> object:
    return a if type(a) in _NUMBERS else None


# ---------------------------------------------------------------------------------- closures


@dataclass(frozen=True, slots=True)
class _Node:
    """A compiled subexpression: its closure, its static kind and where it starts."""

    fn: _Eval
    kind: _Kind
    pos: int
    is_const: bool = False
    value: object = None
    name: str | None = None  # an identifier's
    equals: tuple[str, str] | None = None  # an ``identifier = 'string'`` comparison's (see Selector.equals)


def _const(value: object, kind: _Kind, pos: int) -> _Node:
    def constant(_props: _Props) -> object:
        return value

    return _Node(constant, kind, pos, is_const=True, value=value)


def _fold(node: _Node, *operands: _Node) -> _Node:
    """Evaluate an operator whose operands are all constants once, at compile time."""
    if all(operand.is_const for operand in operands):
        return _const(node.fn(_NO_PROPS), node.kind, node.pos)
    return node


def _identifier(name: str, pos: int) -> _Node:
    def identifier(props: _Props) -> object:
        value = props.get(name)
        if type(value) in _PLAIN:
            return value
        return _normalise(value)

    return _Node(identifier, "any", pos, name=name)


def _logical(operands: list[_Node], *, is_and: bool) -> _Node:
    """AND / OR over any number of operands, flattened so long chains do not nest closures."""
    # FALSE decides an AND and TRUE decides an OR whatever the other operands are.
    decisive = not is_and
    if any(operand.is_const and operand.value is decisive for operand in operands):
        return _const(decisive, "bool", operands[0].pos)
    fns = tuple(operand.fn for operand in operands)
    neutral = not decisive

    def logical(props: _Props) -> object:
        result: bool | None = neutral
        for fn in fns:
            value = fn(props)
            if value is decisive:
                return decisive
            if value is not neutral:
                result = None
        return result

    return _fold(_Node(logical, "bool", operands[0].pos), *operands)


def _negation(operand: _Node) -> _Node:
    fn = operand.fn

    def negation(props: _Props) -> object:
        value = fn(props)
        if value is True:
            return False
        if value is False:
            return True
        return None

    return _fold(_Node(negation, "bool", operand.pos), operand)


def _comparison(op: str, left: _Node, right: _Node) -> _Node:
    pos = left.pos
    if left.is_const and not right.is_const:
        op, left, right = _MIRRORED[op], right, left
    if right.is_const and not left.is_const:
        equals = (left.name, right.value) if op == "=" and left.name is not None and type(right.value) is str else None
        return _Node(_compare_to_constant(op, left.fn, right.value), "bool", pos, equals=equals)
    compare, get_left, get_right = _COMPARATORS[op], left.fn, right.fn

    def comparison(props: _Props) -> object:
        return compare(get_left(props), get_right(props))

    return _fold(_Node(comparison, "bool", pos), left, right)


def _unknown(_props: _Props) -> object:
    return None


def _compare_to_constant(op: str, get: _Eval, constant: object) -> _Eval:
    """The common ``property <op> literal`` case, with the literal's type checked only once."""
    kind = type(constant)
    compare: Callable[[Any, Any], Any]
    if kind in _NUMBERS:
        compare = _ORDERINGS.get(op) or (operator.eq if op == "=" else operator.ne)

        def numeric(props: _Props) -> object:
            value = get(props)
            if type(value) in _NUMBERS:
                return compare(value, constant)
            return None

        return numeric
    if kind in _EQUATABLE and op in ("=", "<>"):
        compare = operator.eq if op == "=" else operator.ne

        def same_type(props: _Props) -> object:
            value = get(props)
            if type(value) is kind:
                return compare(value, constant)
            return None

        return same_type
    # NULL (a constant expression such as 1/0), or an ordering of strings or booleans.
    return _unknown


def _between(operand: _Node, low: _Node, high: _Node) -> _Node:
    get, get_low, get_high = operand.fn, low.fn, high.fn
    if (
        low.is_const
        and high.is_const
        and type(low.value) in _NUMBERS
        and type(high.value) in _NUMBERS
        and not operand.is_const
    ):
        lowest, highest = cast(float, low.value), cast(float, high.value)

        def between_constants(props: _Props) -> object:
            value: Any = get(props)
            if type(value) in _NUMBERS:
                return lowest <= value <= highest
            return None

        return _Node(between_constants, "bool", operand.pos)

    def between(props: _Props) -> object:
        value = get(props)
        above = _LESS_EQUAL(get_low(props), value)
        below = _LESS_EQUAL(value, get_high(props))
        # (low <= value) AND (value <= high), in three-valued logic.
        if above is False or below is False:
            return False
        if above is True and below is True:
            return True
        return None

    return _fold(_Node(between, "bool", operand.pos), operand, low, high)


def _in(operand: _Node, strings: frozenset[str], numbers: frozenset[int | float]) -> _Node:
    get = operand.fn

    def member(props: _Props) -> object:
        value = get(props)
        kind = type(value)
        # x IN (a, b) is x = a OR x = b: a miss is FALSE only if every item was comparable.
        if kind is str:
            return True if value in strings else (None if numbers else False)
        if kind in _NUMBERS:
            return True if value in numbers else (None if strings else False)
        return None

    return _fold(_Node(member, "bool", operand.pos), operand)


def _like(operand: _Node, match: Callable[[str], bool]) -> _Node:
    get = operand.fn

    def like(props: _Props) -> object:
        value: Any = get(props)
        if type(value) is str:
            return match(value)
        return None

    return _fold(_Node(like, "bool", operand.pos), operand)


def _like_matcher(pattern: str, escape: str | None, pos: int) -> Callable[[str], bool]:
    """Compile a LIKE pattern once into a string predicate."""
    # Split on unescaped '%'; each segment is a list of regex pieces and its literal text,
    # or None for the literal when the segment holds a '_'.
    segments: list[tuple[list[str], str | None]] = []
    pieces: list[str] = []
    literal: str | None = ""
    chars = iter(pattern)
    for ch in chars:
        if ch == escape:
            escaped = next(chars, None)
            if escaped is None:
                raise SelectorError("LIKE pattern ends with its escape character", pos)
            pieces.append(re.escape(escaped))
            literal = None if literal is None else literal + escaped
        elif ch == "%":
            segments.append((pieces, literal))
            pieces, literal = [], ""
        elif ch == "_":
            pieces.append(".")
            literal = None
        else:
            pieces.append(re.escape(ch))
            literal = None if literal is None else literal + ch
    segments.append((pieces, literal))

    # The common shapes need no regex at all.
    match [text for _, text in segments]:
        case [str(whole)]:
            return whole.__eq__
        case [str(prefix), ""]:
            return lambda value: value.startswith(prefix)
        case ["", str(suffix)]:
            return lambda value: value.endswith(suffix)
        case ["", str(infix), ""]:
            return lambda value: infix in value

    regexes = ["".join(segment) for segment, _ in segments]
    body = regexes[0]
    if len(regexes) > 1:
        # Each middle segment is matched at its leftmost place and the choice is made final by
        # an atomic group. Leftmost is always safe (it leaves the most room for what follows),
        # and forbidding backtracking bounds the work by value length times pattern length: a
        # plain '.*a.*a.*b' regex backtracks polynomially, so a hostile pattern could stall us.
        body += "".join(f"(?>.*?{middle})" for middle in regexes[1:-1] if middle)
        body += ".*" + regexes[-1]
    compiled = re.compile(body, re.DOTALL)

    def regex_match(value: str) -> bool:
        return compiled.fullmatch(value) is not None

    return regex_match


def _is_null(operand: _Node, negated: bool) -> _Node:
    get = operand.fn

    def is_null(props: _Props) -> object:
        return (get(props) is None) is not negated

    return _fold(_Node(is_null, "bool", operand.pos), operand)


def _arithmetic_chain(first: _Node, rest: list[tuple[_BinOp, _Node]]) -> _Node:
    """A left-associative run of + - or * / in one closure, so long chains do not nest."""
    get_first = first.fn
    if len(rest) == 1:
        apply, second = rest[0]
        get_second = second.fn

        def binary(props: _Props) -> object:
            return apply(get_first(props), get_second(props))

        return _fold(_Node(binary, "num", first.pos), first, second)

    steps = tuple((apply, operand.fn) for apply, operand in rest)

    def chain(props: _Props) -> object:
        result = get_first(props)
        for apply, get in steps:
            if result is None:
                return None
            result = apply(result, get(props))
        return result

    return _fold(_Node(chain, "num", first.pos), first, *(operand for _, operand in rest))


def _sign(operand: _Node, negative: bool, pos: int) -> _Node:
    apply, get = (_negative if negative else _positive), operand.fn

    def sign(props: _Props) -> object:
        return apply(get(props))

    return _fold(_Node(sign, "num", pos), operand)


# ---------------------------------------------------------------------------------- lexer


class _Token(NamedTuple):
    """A lexeme; ``text`` is the name, upper-cased keyword, operator or string contents."""

    kind: Literal["ident", "keyword", "string", "number", "op", "eof"]
    text: str
    pos: int
    number: int | float = 0


_KEYWORDS: Final = frozenset({"AND", "OR", "NOT", "BETWEEN", "LIKE", "ESCAPE", "IN", "IS", "NULL", "TRUE", "FALSE"})
# Longest first, so '<=' is not read as '<' then '='.
_OPERATORS: Final = ("<>", "<=", ">=", "=", "<", ">", "+", "-", "*", "/", "(", ")", ",")
_COMPARISON_OPS: Final = frozenset({"=", "<>", "<", ">", "<=", ">="})
_WHITESPACE: Final = frozenset(" \t\n\r\f")
# SQL comments, which ActiveMQ and Artemis accept too.
_COMMENT_RE: Final = re.compile(r"--[^\r\n]*|/\*.*?\*/", re.DOTALL)
_NUMBER_RE: Final = re.compile(
    r"0[xX](?P<hex>[0-9a-fA-F]+)[lL]?"
    r"|(?P<float>(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)"
    r"|(?P<int>[0-9]+)[lL]?"
)


#: ``identifier = 'string'`` and nothing else (no comments, no other whitespace than blanks around ``=``), in
#: ASCII identifiers: what the tokenizer would read as one identifier, ``=`` and one string literal.
_EQUALS_STRING_RE: Final = re.compile(r"(?P<name>[A-Za-z_$][A-Za-z0-9_$]*) ?= ?(?P<literal>'(?:[^']|'')*')")


def _is_identifier_part(ch: str) -> bool:
    # Python's identifier classes (XID) are close to Java's, plus '$' which Java allows.
    return ch == "$" or ("a" + ch).isidentifier()


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    i, end = 0, len(text)
    while i < end:
        ch = text[i]
        if ch in _WHITESPACE:
            i += 1
        elif text.startswith(("--", "/*"), i):
            comment = _COMMENT_RE.match(text, i)
            if comment is None:
                raise SelectorError("unterminated comment", i)
            i = comment.end()
        elif ch == "'":
            value, i_next = _lex_string(text, i)
            tokens.append(_Token("string", value, i))
            i = i_next
        elif "0" <= ch <= "9" or (ch == "." and "0" <= text[i + 1 : i + 2] <= "9"):
            token = _lex_number(text, i)
            tokens.append(token)
            i += len(token.text)
        elif ch == "$" or ch.isidentifier():
            start = i
            i += 1
            while i < end and _is_identifier_part(text[i]):
                i += 1
            word = text[start:i]
            # isascii: str.upper() maps some non-ASCII letters to ASCII (U+017F long s -> 'S').
            if word.isascii() and word.upper() in _KEYWORDS:
                tokens.append(_Token("keyword", word.upper(), start))
            else:
                tokens.append(_Token("ident", word, start))
        else:
            op = next((op for op in _OPERATORS if text.startswith(op, i)), None)
            if op is None:
                hint = " (strings use single quotes)" if ch == '"' else ""
                raise SelectorError(f"unexpected character {ch!r}{hint}", i)
            tokens.append(_Token("op", op, i))
            i += len(op)
    tokens.append(_Token("eof", "", end))
    return tokens


def _lex_string(text: str, start: int) -> tuple[str, int]:
    """Read a single-quoted literal ('' is a quote); return its value and the offset after it."""
    parts: list[str] = []
    i = start + 1
    while True:
        quote = text.find("'", i)
        if quote < 0:
            raise SelectorError("unterminated string literal", start)
        parts.append(text[i:quote])
        if not text.startswith("'", quote + 1):
            return "".join(parts), quote + 1
        parts.append("'")
        i = quote + 2


def _lex_number(text: str, start: int) -> _Token:
    match = _NUMBER_RE.match(text, start)
    if match is None:  # pragma: no cover - the caller saw a digit, or '.' and a digit
        raise SelectorError("malformed number", start)
    end = match.end()
    if end < len(text) and (text[end] == "." or _is_identifier_part(text[end])):
        raise SelectorError("malformed number", start)
    value: int | float
    if match["hex"] is not None:
        value = int(match["hex"], 16)
    elif match["float"] is not None:
        value = float(match["float"])
    elif len(digits := match["int"]) > 1 and digits[0] == "0":
        # A leading zero means octal, as in Java and Artemis.
        if not set(digits) <= set("01234567"):
            raise SelectorError("malformed octal number", start)
        value = int(digits, 8)
    else:
        try:
            value = int(digits)
        except ValueError as exc:  # more digits than sys.get_int_max_str_digits() allows
            raise SelectorError("integer literal has too many digits", start) from exc
    return _Token("number", text[start:end], start, value)


# ---------------------------------------------------------------------------------- parser

_KIND_NAMES: Final[dict[_Kind, str]] = {
    "bool": "a condition",
    "num": "a number",
    "str": "a string",
    "any": "a property",
}


def _describe(token: _Token) -> str:
    if token.kind == "eof":
        return "end of selector"
    if token.kind == "string":
        return "a string literal"
    return repr(token.text)


def _require(node: _Node, kind: _Kind, context: str) -> None:
    """Reject an operand that can never be of the kind its operator needs (properties can)."""
    if node.kind not in (kind, "any"):
        raise SelectorError(f"{context} needs {_KIND_NAMES[kind]}, not {_KIND_NAMES[node.kind]}", node.pos)


class _Parser:
    """Recursive descent, lowest precedence first: OR, AND, NOT, predicates, + -, * /, unary."""

    def __init__(self, tokens: list[_Token]) -> None:
        self._tokens = tokens
        self._index = 0
        self._depth = 0

    def parse(self) -> _Node:
        node = self._or()
        token = self._peek()
        if token.kind != "eof":
            raise SelectorError(f"unexpected {_describe(token)}", token.pos)
        _require(node, "bool", "a selector")
        return node

    # -- token helpers

    def _peek(self, ahead: int = 0) -> _Token:
        return self._tokens[min(self._index + ahead, len(self._tokens) - 1)]

    def _advance(self) -> _Token:
        token = self._tokens[self._index]
        if token.kind != "eof":
            self._index += 1
        return token

    def _at_keyword(self, *words: str, ahead: int = 0) -> bool:
        token = self._peek(ahead)
        return token.kind == "keyword" and token.text in words

    def _at_op(self, *ops: str) -> bool:
        token = self._peek()
        return token.kind == "op" and token.text in ops

    def _expect_op(self, op: str) -> _Token:
        if not self._at_op(op):
            token = self._peek()
            raise SelectorError(f"expected {op!r}, found {_describe(token)}", token.pos)
        return self._advance()

    def _expect_string(self, what: str) -> _Token:
        token = self._peek()
        if token.kind != "string":
            raise SelectorError(f"{what} must be a string literal, found {_describe(token)}", token.pos)
        return self._advance()

    # -- grammar

    def _or(self) -> _Node:
        operands = [self._and()]
        while self._at_keyword("OR"):
            self._advance()
            operands.append(self._and())
        if len(operands) == 1:
            return operands[0]
        for operand in operands:
            _require(operand, "bool", "OR")
        return _logical(operands, is_and=False)

    def _and(self) -> _Node:
        operands = [self._not()]
        while self._at_keyword("AND"):
            self._advance()
            operands.append(self._not())
        if len(operands) == 1:
            return operands[0]
        for operand in operands:
            _require(operand, "bool", "AND")
        return _logical(operands, is_and=True)

    def _not(self) -> _Node:
        count = 0
        while self._at_keyword("NOT"):
            self._advance()
            count += 1
        operand = self._predicate()
        if count == 0:
            return operand
        _require(operand, "bool", "NOT")
        if count % 2:
            return _negation(operand)
        # NOT NOT x is x as a truth value: a non-boolean property becomes UNKNOWN.
        get = operand.fn
        return _fold(_Node(lambda props: _truth(get(props)), "bool", operand.pos), operand)

    def _predicate(self) -> _Node:
        left = self._additive()
        token = self._peek()
        if token.kind == "op" and token.text in _COMPARISON_OPS:
            self._advance()
            node = _comparison(token.text, left, self._additive())
        elif self._at_keyword("IS"):
            self._advance()
            negated = self._at_keyword("NOT")
            if negated:
                self._advance()
            if not self._at_keyword("NULL"):
                found = self._peek()
                raise SelectorError(f"expected NULL, found {_describe(found)}", found.pos)
            self._advance()
            node = _is_null(left, negated)
        elif self._at_keyword("BETWEEN", "LIKE", "IN") or (
            self._at_keyword("NOT") and self._at_keyword("BETWEEN", "LIKE", "IN", ahead=1)
        ):
            negated = self._at_keyword("NOT")
            if negated:
                self._advance()
            node = self._keyword_predicate(left, self._advance().text)
            if negated:
                node = _negation(node)
        else:
            return left
        after = self._peek()
        if (after.kind == "op" and after.text in _COMPARISON_OPS) or self._at_keyword("IS", "BETWEEN", "LIKE", "IN"):
            raise SelectorError("comparisons do not chain; add parentheses", after.pos)
        return node

    def _keyword_predicate(self, left: _Node, keyword: str) -> _Node:
        if keyword == "BETWEEN":
            low = self._additive()
            if not self._at_keyword("AND"):
                token = self._peek()
                raise SelectorError(f"expected AND in BETWEEN, found {_describe(token)}", token.pos)
            self._advance()
            return _between(left, low, self._additive())
        if keyword == "LIKE":
            pattern = self._expect_string("a LIKE pattern")
            escape: str | None = None
            if self._at_keyword("ESCAPE"):
                self._advance()
                token = self._expect_string("an ESCAPE character")
                if len(token.text) != 1:
                    raise SelectorError("an ESCAPE string must be exactly one character", token.pos)
                escape = token.text
            return _like(left, _like_matcher(pattern.text, escape, pattern.pos))
        # IN: a list of constant strings and numbers.
        self._expect_op("(")
        strings: set[str] = set()
        numbers: set[int | float] = set()
        while True:
            item = self._additive()
            value = item.value
            if item.is_const and isinstance(value, str):
                strings.add(value)
            elif item.is_const and isinstance(value, int | float) and not isinstance(value, bool):
                numbers.add(value)
            else:
                raise SelectorError("an IN list holds only string and number literals", item.pos)
            if not self._at_op(","):
                break
            self._advance()
        self._expect_op(")")
        return _in(left, frozenset(strings), frozenset(numbers))

    def _additive(self) -> _Node:
        return self._binary_chain(self._multiplicative, ("+", "-"))

    def _multiplicative(self) -> _Node:
        return self._binary_chain(self._unary, ("*", "/"))

    def _binary_chain(self, operand: Callable[[], _Node], ops: tuple[str, str]) -> _Node:
        first = operand()
        rest: list[tuple[_BinOp, _Node]] = []
        while self._at_op(*ops):
            op = self._advance().text
            rest.append((_ARITHMETIC[op], operand()))
        if not rest:
            return first
        for node in (first, *(node for _, node in rest)):
            _require(node, "num", "arithmetic")
        return _arithmetic_chain(first, rest)

    def _unary(self) -> _Node:
        start = self._peek().pos
        signs = 0
        negative = False
        while self._at_op("+", "-"):
            negative ^= self._advance().text == "-"
            signs += 1
        operand = self._primary()
        if signs == 0:
            return operand
        _require(operand, "num", "a sign")
        return _sign(operand, negative, start)

    def _primary(self) -> _Node:
        token = self._advance()
        if token.kind == "op" and token.text == "(":
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise SelectorError(f"selector is nested deeper than {MAX_DEPTH} parentheses", token.pos)
            node = self._or()
            self._expect_op(")")
            self._depth -= 1
            return node
        if token.kind == "ident":
            return _identifier(token.text, token.pos)
        if token.kind == "string":
            return _const(token.text, "str", token.pos)
        if token.kind == "number":
            return _const(token.number, "num", token.pos)
        if token.kind == "keyword" and token.text in ("TRUE", "FALSE"):
            return _const(token.text == "TRUE", "bool", token.pos)
        if token.kind == "keyword" and token.text == "NULL":
            raise SelectorError("NULL is only allowed in IS [NOT] NULL", token.pos)
        raise SelectorError(f"expected an operand, found {_describe(token)}", token.pos)
