"""Address trie that routes a concrete address to every binding whose pattern matches it.

Addresses are words separated by ``.``. In patterns ``*`` matches exactly one word and
``#`` matches zero or more words (Artemis semantics), so ``a.#`` matches ``a`` and
``a.b.c``, and ``a.#.c`` matches ``a.c``.

An address whose first word starts with ``$`` is the broker's own (``$sys.``, ``$mqtt.``): a pattern
reaches it only by naming that word, never through a leading wildcard (MQTT's rule for ``$`` topics, here
for every protocol), so a subscription to ``#`` does not see the broker's internal traffic.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Final, Generic, TypeVar

from tridentmq_shared.names import MAX_ADDRESS_WORDS, MAX_NAME_LENGTH, name_problem

__all__ = ["AddressIndex", "AddressTrie", "InvalidAddress", "is_wildcard", "pattern_matches", "validate_address"]

T = TypeVar("T", bound=Hashable)

DELIMITER = "."
ANY_WORD = "*"
ANY_WORDS = "#"
SYSTEM_MARK = "$"
MAX_ADDRESS_LENGTH = MAX_NAME_LENGTH
DEFAULT_CACHE_SIZE = 65536

_WILDCARD_WORDS = frozenset((ANY_WORD, ANY_WORDS))


class InvalidAddress(ValueError):  # noqa: N818 - the public name is part of the broker's API
    """An address or pattern that breaks the syntax rules."""


def validate_address(address: str, *, allow_wildcards: bool) -> str:
    """Return ``address`` unchanged, or raise :class:`InvalidAddress` saying what is wrong."""
    problem = name_problem(address, "address")  # empty, too long, control characters: the rules of any name
    if problem is not None:
        raise InvalidAddress(problem)
    words = address.split(DELIMITER)
    if len(words) > MAX_ADDRESS_WORDS:
        raise InvalidAddress(f"address {address!r} has {len(words)} words, the limit is {MAX_ADDRESS_WORDS}")
    for position, word in enumerate(words):
        if not word:
            raise InvalidAddress(
                f"address {address!r} has an empty word at position {position} (leading, trailing or doubled '.')"
            )
        if word in _WILDCARD_WORDS:
            if not allow_wildcards:
                raise InvalidAddress(f"address {address!r} contains wildcard {word!r} where none is allowed")
        elif ANY_WORD in word or ANY_WORDS in word:
            raise InvalidAddress(
                f"address {address!r} has word {word!r} mixing a wildcard with other characters; "
                "'*' and '#' must stand alone between dots"
            )
    return address


def is_wildcard(address: str) -> bool:
    """True if ``address`` has a word that is exactly ``*`` or ``#``."""
    # Cheap substring test first: most addresses contain neither character.
    if ANY_WORD not in address and ANY_WORDS not in address:
        return False
    return any(word in _WILDCARD_WORDS for word in address.split(DELIMITER))


def pattern_matches(pattern: str, address: str) -> bool:
    """True if ``pattern`` (which may hold wildcards) matches ``address``, without building a trie."""
    if pattern == address:
        return True
    pwords = pattern.split(DELIMITER)
    end = len(pwords)
    # Set of pattern positions reachable after consuming a prefix of the address: linear in
    # words x pattern length however many '#' there are, unlike naive backtracking.
    states = _pattern_closure(pwords, {0})
    for word in address.split(DELIMITER):
        advanced: set[int] = set()
        for i in states:
            if i == end:
                continue
            pword = pwords[i]
            if pword == ANY_WORDS:
                advanced.add(i)  # '#' swallows this word and stays put
            elif pword in (ANY_WORD, word):
                advanced.add(i + 1)
        if not advanced:
            return False
        states = _pattern_closure(pwords, advanced)
    return end in states


def _pattern_closure(pwords: list[str], states: set[int]) -> set[int]:
    """Add the positions reachable by letting each '#' match zero words."""
    stack = list(states)
    while stack:
        i = stack.pop()
        if i < len(pwords) and pwords[i] == ANY_WORDS and i + 1 not in states:
            states.add(i + 1)
            stack.append(i + 1)
    return states


class _IndexNode:
    __slots__ = ("children", "present")

    def __init__(self) -> None:
        self.children: dict[str, _IndexNode] | None = None  # made on the first child: most nodes are leaves
        self.present = False


class AddressIndex:
    """A set of addresses that finds the ones a pattern matches without looking at the others.

    A cache keyed by address keeps one beside it, so that a binding added or removed on a pattern drops only
    the entries that pattern matches (a word trie: ``devices.d42.#`` visits the entries under ``devices.d42``,
    not the 100,000 other devices). Matching follows :class:`AddressTrie`, ``$`` rule included.
    """

    __slots__ = ("_root", "_size")

    def __init__(self) -> None:
        self._root = _IndexNode()
        self._size = 0

    def add(self, address: str) -> None:
        node = self._root
        for word in address.split(DELIMITER):
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(word)
            if child is None:
                child = children[word] = _IndexNode()
            node = child
        if not node.present:
            node.present = True
            self._size += 1

    def discard(self, address: str) -> bool:
        """Remove ``address``; return whether it was there. Nodes left empty are pruned."""
        words = address.split(DELIMITER)
        path = [self._root]
        for word in words:
            children = path[-1].children
            child = None if children is None else children.get(word)
            if child is None:
                return False
            path.append(child)
        node = path[-1]
        if not node.present:
            return False
        node.present = False
        self._size -= 1
        for depth in range(len(words), 0, -1):
            node = path[depth]
            if node.present or node.children:
                break
            parent = path[depth - 1]
            assert parent.children is not None
            del parent.children[words[depth - 1]]
        return True

    def remove_matching(self, pattern: str) -> list[str]:
        """Remove and return every address that ``pattern`` matches."""
        if not is_wildcard(pattern):
            return [pattern] if self.discard(pattern) else []
        found = self._matching(pattern.split(DELIMITER))
        for address in found:
            self.discard(address)
        return found

    def clear(self) -> None:
        self._root = _IndexNode()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _matching(self, pwords: list[str]) -> list[str]:
        # Depth-first over (node, pattern position); the seen set keeps several '#' from walking a node twice.
        end = len(pwords)
        root = self._root
        found: list[str] = []
        seen: set[tuple[_IndexNode, int]] = set()
        stack: list[tuple[_IndexNode, int, str]] = [(root, 0, "")]
        while stack:
            node, i, prefix = stack.pop()
            if (node, i) in seen:
                continue
            seen.add((node, i))
            if i == end:
                if node.present and node is not root:
                    found.append(prefix)
                continue
            pword = pwords[i]
            if pword == ANY_WORDS:
                stack.append((node, i + 1, prefix))  # '#' matching no word
            children = node.children
            if not children:
                continue
            if pword in _WILDCARD_WORDS:
                step = i if pword == ANY_WORDS else i + 1
                for word, child in children.items():
                    if node is root and word.startswith(SYSTEM_MARK):
                        continue  # a wildcard never leads to the broker's own addresses
                    stack.append((child, step, f"{prefix}.{word}" if prefix else word))
            else:
                literal = children.get(pword)
                if literal is not None and not (node is root and i and pword.startswith(SYSTEM_MARK)):
                    stack.append((literal, i + 1, f"{prefix}.{pword}" if prefix else pword))
        return found


# What a node holds until its first child or binding: one shared empty dict, only ever read (most nodes are
# leaves or inner nodes, not both, and 100,000 device topics make 100,000 nodes; an empty dict is 64 bytes).
_NOTHING: Final[dict[Any, Any]] = {}


class _Node(Generic[T]):
    """One trie node; wildcard children live in their own slots so the walk needs no key lookups."""

    __slots__ = ("children", "hash", "is_hash", "star", "values")

    def __init__(self, *, is_hash: bool = False) -> None:
        self.children: dict[str, _Node[T]] = _NOTHING
        self.star: _Node[T] | None = None
        self.hash: _Node[T] | None = None
        # A node reached through '#' loops on itself: it may consume any number of further words.
        self.is_hash = is_hash
        # value -> binding sequence number; insertion order equals sequence order (see AddressTrie.add).
        self.values: dict[T, int] = _NOTHING

    def is_empty(self) -> bool:
        return not self.values and not self.children and self.star is None and self.hash is None


class AddressTrie(Generic[T]):
    """Bindings of patterns to values, with a bounded cache of address -> matching values.

    Only patterns with a wildcard are words in the trie: a literal one matches one address, found by a dict
    look-up (100,000 devices, each with a topic and an MQTT session lock of its own, made four trie nodes and
    three dicts each, and a walk of them for every cache miss)."""

    __slots__ = ("_cache", "_cache_size", "_cached", "_count", "_patterns", "_root", "_seq", "_wildcards")

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self._root: _Node[T] = _Node()
        # pattern -> its values (value -> binding sequence number), in the order patterns were first bound; a
        # wildcard pattern's terminal node holds the same dict. A literal pattern bound once (a device's topic,
        # an MQTT session's lock) holds the pair itself: 56 bytes, where a dict of one entry takes 232.
        self._patterns: dict[str, dict[T, int] | tuple[T, int]] = {}
        self._wildcards = 0  # patterns in the trie: with none, a match needs no walk
        self._cache: dict[str, tuple[T, ...]] = {}
        self._cached = AddressIndex()  # the addresses in ``_cache``: what a binding change drops (see _forget)
        self._cache_size = cache_size
        self._count = 0
        # Monotonic binding number: gives match() its insertion order across nodes.
        self._seq = 0

    def add(self, pattern: str, value: T) -> None:
        """Bind ``value`` to ``pattern``; binding the same pair again does nothing."""
        values = self._patterns.get(pattern)
        if values is None:
            validate_address(pattern, allow_wildcards=True)
            if not is_wildcard(pattern):
                self._patterns[pattern] = (value, self._seq)
                self._bound(pattern)
                return
            values = self._patterns[pattern] = {}
            node = self._root
            for word in pattern.split(DELIMITER):
                node = self._child(node, word)
            node.values = values
            self._wildcards += 1
        elif isinstance(values, tuple):
            if values[0] == value:
                return
            values = self._patterns[pattern] = dict((values,))
        elif value in values:
            return
        values[value] = self._seq
        self._bound(pattern)

    def _bound(self, pattern: str) -> None:
        self._seq += 1
        self._count += 1
        self._forget(pattern)

    def remove(self, pattern: str, value: T) -> bool:
        """Unbind ``value`` from ``pattern``; return whether it was bound. Empty nodes are pruned."""
        values = self._patterns.get(pattern)
        if values is None:
            return False
        if isinstance(values, tuple):
            if values[0] != value:
                return False
            del self._patterns[pattern]
        else:
            if value not in values:
                return False
            del values[value]
            if not values:
                del self._patterns[pattern]
                if is_wildcard(pattern):
                    self._wildcards -= 1
                    self._prune(pattern.split(DELIMITER))
        self._count -= 1
        self._forget(pattern)
        return True

    def match(self, address: str) -> tuple[T, ...]:
        """Every value bound to a pattern matching ``address``, each once, in binding order."""
        cached = self._cache.get(address)
        if cached is not None:
            return cached
        result = self._lookup(address)
        if self._cache_size:
            if len(self._cache) >= self._cache_size:
                # Clearing is O(1) amortised and needs no bookkeeping on the hit path, unlike LRU.
                self._cache.clear()
                self._cached.clear()
            self._cache[address] = result
            self._cached.add(address)
        return result

    def patterns(self) -> list[str]:
        """Patterns with at least one binding, in the order they were first bound."""
        return list(self._patterns)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"AddressTrie(patterns={len(self._patterns)}, bindings={self._count})"

    # ------------------------------------------------------------------ internals

    def _forget(self, pattern: str) -> None:
        """Drop the cached matches a binding on ``pattern`` changes: only addresses the pattern matches."""
        if self._cache:
            cache = self._cache
            for address in self._cached.remove_matching(pattern):
                del cache[address]

    @staticmethod
    def _child(node: _Node[T], word: str) -> _Node[T]:
        if word == ANY_WORD:
            if node.star is None:
                node.star = _Node()
            return node.star
        if word == ANY_WORDS:
            if node.hash is None:
                node.hash = _Node(is_hash=True)
            return node.hash
        child = node.children.get(word)
        if child is None:
            if node.children is _NOTHING:
                node.children = {}
            child = node.children[word] = _Node()
        return child

    def _prune(self, words: list[str]) -> None:
        path: list[_Node[T]] = [self._root]
        for word in words:
            if word == ANY_WORD:
                nxt = path[-1].star
            elif word == ANY_WORDS:
                nxt = path[-1].hash
            else:
                nxt = path[-1].children.get(word)
            assert nxt is not None, "a registered pattern's path must exist"
            path.append(nxt)
        path[-1].values = _NOTHING
        # Walk back up, detaching nodes that no longer carry a value or a child.
        for depth in range(len(words), 0, -1):
            node, parent, word = path[depth], path[depth - 1], words[depth - 1]
            if not node.is_empty():
                return
            if word == ANY_WORD:
                parent.star = None
            elif word == ANY_WORDS:
                parent.hash = None
            else:
                del parent.children[word]

    def _lookup(self, address: str) -> tuple[T, ...]:
        literal = self._patterns.get(address)  # (an address that is a wildcard pattern is found twice: no harm)
        if isinstance(literal, tuple):
            if not self._wildcards:
                return (literal[0],)
            literal = dict((literal,))
        matched = [literal] if literal else []
        if self._wildcards:
            matched += self._walk(address)
        return _collect(matched)

    def _walk(self, address: str) -> list[dict[T, int]]:
        """The values of the wildcard patterns that match ``address``."""
        # Simulate the trie as an NFA: the set of active nodes is bounded by the trie size, so
        # any number of '#' costs O(words x nodes) rather than exponential backtracking.
        words = address.split(DELIMITER)
        if address.startswith(SYSTEM_MARK):  # only a literal first word leads there (see the module docstring)
            first = self._root.children.get(words[0])
            if first is None:
                return []
            active = _closure([first])
            words = words[1:]
        else:
            active = _closure([self._root])
        for word in words:
            stepped: list[_Node[T]] = []
            for node in active:
                if node.is_hash:
                    stepped.append(node)
                child = node.children.get(word)
                if child is not None:
                    stepped.append(child)
                if node.star is not None:
                    stepped.append(node.star)
            if not stepped:
                return []
            active = _closure(stepped)
        return [node.values for node in active if node.values]


def _closure(nodes: list[_Node[T]]) -> list[_Node[T]]:
    """Deduplicate ``nodes`` and add, since '#' may match zero words, the '#' children chained below."""
    # Runs once per word on every cache miss. A single node without a '#' child (any walk along
    # literal words) needs neither dedup nor closure.
    if len(nodes) == 1 and nodes[0].hash is None:
        return nodes
    out: list[_Node[T]] = []
    seen: set[_Node[T]] = set()
    for node in nodes:
        current: _Node[T] | None = node
        while current is not None and current not in seen:
            seen.add(current)
            out.append(current)
            current = current.hash
    return out


def _collect(matched: list[dict[T, int]]) -> tuple[T, ...]:
    if not matched:
        return ()
    if len(matched) == 1:
        # A pattern's dict is already in binding order and holds each value once.
        return tuple(matched[0])
    # The same value may be bound under several matching patterns: keep its earliest binding.
    first: dict[T, int] = {}
    for values in matched:
        for value, seq in values.items():
            known = first.get(value)
            if known is None or seq < known:
                first[value] = seq
    return tuple(sorted(first, key=first.__getitem__))
