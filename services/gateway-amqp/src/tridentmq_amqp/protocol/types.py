"""The AMQP 1.0 type system (spec part 1): encode Python values, decode and skip encoded ones. Pure.

Decoding maps every integer width to a plain ``int`` (timestamps excepted) and keeps what Python has no type
for in the small classes below; encoding picks the smallest correct constructor, and the width subclasses
(``UInt``, ``ULong`` ...) say which integer type a field must have on the wire. Both directions dispatch on
tables (by constructor byte, by ``type(value)``) because the gateway decodes fields of every message.

Bad input raises ``RemoteProtocolError`` (``amqp:decode-error``) and nothing else; values that AMQP cannot
express raise ``LocalProtocolError``.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from tridentmq_amqp.protocol.errors import DECODE_ERROR, INTERNAL_ERROR, LocalProtocolError, RemoteProtocolError

__all__ = [
    "Array",
    "Byte",
    "Char",
    "Decimal",
    "Described",
    "Float",
    "Int",
    "Short",
    "Symbol",
    "Timestamp",
    "UByte",
    "UInt",
    "ULong",
    "UShort",
    "decode",
    "encode",
    "skip",
]

MAX_DEPTH: Final = 64  # nesting of compound and described values; hostile input must not exhaust the stack
# Zero-width elements (an array of nulls ...) take no bytes, so the size cannot bound their count.
MAX_EMPTY_ELEMENTS: Final = 65536

Buffer = bytes | memoryview


class Symbol(str):
    """An AMQP symbol (a name from a constrained domain, as opposed to text)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Symbol({str.__repr__(self)})"


class Char(str):
    """One Unicode character, encoded as UTF-32."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Char({str.__repr__(self)})"


class Timestamp(int):
    """Milliseconds since the Unix epoch."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Timestamp({int.__repr__(self)})"


class UByte(int):
    __slots__ = ()


class UShort(int):
    __slots__ = ()


class UInt(int):
    __slots__ = ()


class ULong(int):
    __slots__ = ()


class Byte(int):
    __slots__ = ()


class Short(int):
    __slots__ = ()


class Int(int):
    __slots__ = ()


class Float(float):
    """Encoded as single precision (a plain ``float`` is a double)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Described:
    descriptor: Any
    value: Any


@dataclass(frozen=True, slots=True)
class Array:
    """An AMQP array: every item has the same type, written once as the element constructor."""

    items: list[Any]


@dataclass(frozen=True, slots=True)
class Decimal:
    """decimal32/64/128 (constructor ``code`` 0x74/0x84/0x94), kept as the IEEE 754 bytes: nothing computes
    with them here."""

    code: int
    raw: bytes


# ---------------------------------------------------------------- decoding

_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_U64: Final = struct.Struct(">Q")
_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_I64: Final = struct.Struct(">q")
_F32: Final = struct.Struct(">f")
_F64: Final = struct.Struct(">d")
_U32X2: Final = struct.Struct(">II")

_Decoder = Callable[[Buffer, int, int], tuple[Any, int]]
_DECIMAL_WIDTHS: Final = {0x74: 4, 0x84: 8, 0x94: 16}


def _error(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(message, DECODE_ERROR)


def _truncated() -> RemoteProtocolError:
    return _error("truncated AMQP value")


# Each decoder takes the buffer, the offset just after the constructor byte and the nesting depth.


def _dec_unknown(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    raise _error(f"unknown AMQP constructor 0x{b[p - 1]:02x}")


def _dec_null(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return None, p


def _dec_true(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return True, p


def _dec_false(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return False, p


def _dec_zero(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return 0, p


def _dec_empty_list(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return [], p


def _dec_boolean(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    v = b[p]
    if v > 1:
        raise _error("boolean byte is neither 0 nor 1")
    return v == 1, p + 1


def _dec_ubyte(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return b[p], p + 1


def _dec_byte(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    v = b[p]
    return (v - 256 if v > 127 else v), p + 1


def _fixed(st: struct.Struct) -> _Decoder:
    unpack, size = st.unpack_from, st.size

    def dec(b: Buffer, p: int, d: int) -> tuple[Any, int]:
        return unpack(b, p)[0], p + size

    return dec


def _dec_timestamp(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return Timestamp(_I64.unpack_from(b, p)[0]), p + 8


def _dec_char(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    v = _U32.unpack_from(b, p)[0]
    if v > 0x10FFFF or 0xD800 <= v <= 0xDFFF:
        raise _error("char is not a Unicode scalar value")
    return Char(chr(v)), p + 4


def _dec_uuid(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    e = p + 16
    if e > len(b):
        raise _truncated()
    return uuid.UUID(bytes=bytes(b[p:e])), e


def _decimal(code: int) -> _Decoder:
    width = _DECIMAL_WIDTHS[code]

    def dec(b: Buffer, p: int, d: int) -> tuple[Any, int]:
        e = p + width
        if e > len(b):
            raise _truncated()
        return Decimal(code, bytes(b[p:e])), e

    return dec


def _sized(b: Buffer, p: int, width: int) -> tuple[int, int]:
    """(start, end) of the payload of a variable-width value whose size field (``width`` bytes) is at ``p``."""
    if width == 4:
        s = p + 4
        e = s + _U32.unpack_from(b, p)[0]
    else:
        s = p + 1
        e = s + b[p]
    if e > len(b):
        raise _truncated()
    return s, e


def _dec_vbin8(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    s, e = _sized(b, p, 1)
    return bytes(b[s:e]), e


def _dec_vbin32(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    s, e = _sized(b, p, 4)
    return bytes(b[s:e]), e


def _dec_str8(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    s, e = _sized(b, p, 1)
    return str(b[s:e], "utf-8"), e


def _dec_str32(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    s, e = _sized(b, p, 4)
    return str(b[s:e], "utf-8"), e


def _dec_sym8(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    s, e = _sized(b, p, 1)
    return Symbol(str(b[s:e], "utf-8")), e


def _dec_sym32(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    s, e = _sized(b, p, 4)
    return Symbol(str(b[s:e], "utf-8")), e


def _compound(b: Buffer, p: int, width: int, d: int) -> tuple[int, int, int]:
    """(count, start of the items, end) of a list, map or array whose size field is at ``p``."""
    if d >= MAX_DEPTH:
        raise _error("AMQP value nested too deeply")
    if width == 4:
        size, count = _U32X2.unpack_from(b, p)
        s = p + 8
        e = p + 4 + size
    else:
        size = b[p]
        count = b[p + 1]
        s = p + 2
        e = p + 1 + size
    if e > len(b):
        raise _truncated()
    if e < s:
        raise _error("compound size smaller than its count field")
    return count, s, e


def _items(b: Buffer, p: int, e: int, count: int, d: int) -> list[Any]:
    if count > e - p:
        raise _error("compound count exceeds its size")
    dec = _DECODERS
    out: list[Any] = []
    append = out.append
    for _ in range(count):
        v, p = dec[b[p]](b, p + 1, d)
        append(v)
    if p != e:
        raise _error("compound items do not fill its size")
    return out


def _dec_list8(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    count, s, e = _compound(b, p, 1, d)
    return _items(b, s, e, count, d + 1), e


def _dec_list32(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    count, s, e = _compound(b, p, 4, d)
    return _items(b, s, e, count, d + 1), e


def _to_map(items: list[Any]) -> dict[Any, Any]:
    if len(items) & 1:
        raise _error("map with an odd number of elements")
    try:
        out = dict(zip(items[::2], items[1::2], strict=True))
    except TypeError:
        raise _error("map key of an unhashable type") from None
    if len(out) * 2 != len(items):
        raise _error("map with a repeated key")
    return out


def _dec_map8(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    count, s, e = _compound(b, p, 1, d)
    return _to_map(_items(b, s, e, count, d + 1)), e


def _dec_map32(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    count, s, e = _compound(b, p, 4, d)
    return _to_map(_items(b, s, e, count, d + 1)), e


_ZERO_WIDTH: Final = frozenset({0x40, 0x41, 0x42, 0x43, 0x44, 0x45})
_NO_DESCRIPTOR: Final = object()


def _array(b: Buffer, p: int, width: int, d: int) -> tuple[Any, int]:
    count, p, e = _compound(b, p, width, d)
    d += 1
    descriptor: Any = _NO_DESCRIPTOR
    code = b[p]
    p += 1
    if code == 0x00:
        descriptor, p = _DECODERS[b[p]](b, p + 1, d)
        code = b[p]
        p += 1
        if code == 0x00:
            raise _error("array element constructor described twice")
    if p > e:
        raise _error("array size smaller than its constructor")
    if count > e - p and not (code in _ZERO_WIDTH and count <= MAX_EMPTY_ELEMENTS):
        raise _error("array count exceeds its size")
    dec = _DECODERS[code]
    if dec is _dec_unknown:
        raise _error(f"unknown AMQP constructor 0x{code:02x}")
    items: list[Any] = []
    append = items.append
    for _ in range(count):
        v, p = dec(b, p, d)
        append(v)
    if p != e:
        raise _error("array elements do not fill its size")
    if descriptor is not _NO_DESCRIPTOR:
        items = [Described(descriptor, v) for v in items]
    return Array(items), e


def _dec_array8(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return _array(b, p, 1, d)


def _dec_array32(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    return _array(b, p, 4, d)


def _dec_described(b: Buffer, p: int, d: int) -> tuple[Any, int]:
    if d >= MAX_DEPTH:
        raise _error("AMQP value nested too deeply")
    d += 1
    descriptor, p = _DECODERS[b[p]](b, p + 1, d)
    value, p = _DECODERS[b[p]](b, p + 1, d)
    return Described(descriptor, value), p


_DECODERS: Final[list[_Decoder]] = [_dec_unknown] * 256
for _code, _fn in {
    0x00: _dec_described,
    0x40: _dec_null,
    0x41: _dec_true,
    0x42: _dec_false,
    0x43: _dec_zero,
    0x44: _dec_zero,
    0x45: _dec_empty_list,
    0x50: _dec_ubyte,
    0x51: _dec_byte,
    0x52: _dec_ubyte,
    0x53: _dec_ubyte,
    0x54: _dec_byte,
    0x55: _dec_byte,
    0x56: _dec_boolean,
    0x60: _fixed(_U16),
    0x61: _fixed(_I16),
    0x70: _fixed(_U32),
    0x71: _fixed(_I32),
    0x72: _fixed(_F32),
    0x73: _dec_char,
    0x74: _decimal(0x74),
    0x80: _fixed(_U64),
    0x81: _fixed(_I64),
    0x82: _fixed(_F64),
    0x83: _dec_timestamp,
    0x84: _decimal(0x84),
    0x94: _decimal(0x94),
    0x98: _dec_uuid,
    0xA0: _dec_vbin8,
    0xA1: _dec_str8,
    0xA3: _dec_sym8,
    0xB0: _dec_vbin32,
    0xB1: _dec_str32,
    0xB3: _dec_sym32,
    0xC0: _dec_list8,
    0xC1: _dec_map8,
    0xD0: _dec_list32,
    0xD1: _dec_map32,
    0xE0: _dec_array8,
    0xF0: _dec_array32,
}.items():
    _DECODERS[_code] = _fn


def decode(buf: Buffer, offset: int = 0) -> tuple[Any, int]:
    """The value encoded at ``offset`` and the offset just after it."""
    try:
        if offset < 0:
            raise _truncated()
        return _DECODERS[buf[offset]](buf, offset + 1, 0)
    except (IndexError, struct.error):
        raise _truncated() from None
    except ValueError as e:  # UnicodeDecodeError: invalid UTF-8 in a string or symbol
        raise _error(f"invalid AMQP value: {e}") from None


# ---------------------------------------------------------------- skipping

# Per constructor: the width of a fixed-width value, or one of these markers.
_SIZE8: Final = -1
_SIZE32: Final = -4
_DESCRIBED: Final = -2
_UNKNOWN: Final = -99
_SKIP: Final[list[int]] = [_UNKNOWN] * 256
for _code in _ZERO_WIDTH:
    _SKIP[_code] = 0
for _code in (0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56):
    _SKIP[_code] = 1
for _code in (0x60, 0x61):
    _SKIP[_code] = 2
for _code in (0x70, 0x71, 0x72, 0x73, 0x74):
    _SKIP[_code] = 4
for _code in (0x80, 0x81, 0x82, 0x83, 0x84):
    _SKIP[_code] = 8
_SKIP[0x94] = 16
_SKIP[0x98] = 16
for _code in (0xA0, 0xA1, 0xA3, 0xC0, 0xC1, 0xE0):
    _SKIP[_code] = _SIZE8
for _code in (0xB0, 0xB1, 0xB3, 0xD0, 0xD1, 0xF0):
    _SKIP[_code] = _SIZE32
_SKIP[0x00] = _DESCRIBED


def _skip(b: Buffer, p: int, d: int) -> int:
    w = _SKIP[b[p]]
    if w >= 0:
        e = p + 1 + w
    elif w == _SIZE8:
        e = p + 2 + b[p + 1]
    elif w == _SIZE32:
        e = p + 5 + _U32.unpack_from(b, p + 1)[0]
    elif w == _DESCRIBED:
        if d >= MAX_DEPTH:
            raise _error("AMQP value nested too deeply")
        return _skip(b, _skip(b, p + 1, d + 1), d + 1)
    else:
        raise _error(f"unknown AMQP constructor 0x{b[p]:02x}")
    if e > len(b):
        raise _truncated()
    return e


def skip(buf: Buffer, offset: int = 0) -> int:
    """The offset just after the value at ``offset``, found without decoding it (sizes are checked against
    the buffer, the content is not)."""
    try:
        if offset < 0:
            raise _truncated()
        return _skip(buf, offset, 0)
    except (IndexError, struct.error):
        raise _truncated() from None


# ---------------------------------------------------------------- encoding

_Encoder = Callable[[Any], bytes]
_SMALLLONG: Final = [bytes((0x55, i & 0xFF)) for i in range(-128, 128)]
_SMALLINT: Final = [bytes((0x54, i & 0xFF)) for i in range(-128, 128)]
_SMALLULONG: Final = [b"\x44"] + [bytes((0x53, i)) for i in range(1, 256)]
_SMALLUINT: Final = [b"\x43"] + [bytes((0x52, i)) for i in range(1, 256)]


def _unencodable(message: str) -> LocalProtocolError:
    return LocalProtocolError(message, INTERNAL_ERROR)


def _enc_null(v: Any) -> bytes:
    return b"\x40"


def _enc_bool(v: Any) -> bytes:
    return b"\x41" if v else b"\x42"


def _enc_long(v: int) -> bytes:
    if -128 <= v <= 127:
        return _SMALLLONG[v + 128]
    return b"\x81" + _I64.pack(v)


def _enc_ulong(v: int) -> bytes:
    if 0 <= v <= 255:
        return _SMALLULONG[v]
    return b"\x80" + _U64.pack(v)


def _enc_uint(v: int) -> bytes:
    if 0 <= v <= 255:
        return _SMALLUINT[v]
    return b"\x70" + _U32.pack(v)


def _enc_int(v: int) -> bytes:
    if -128 <= v <= 127:
        return _SMALLINT[v + 128]
    return b"\x71" + _I32.pack(v)


def _enc_ubyte(v: int) -> bytes:
    if not 0 <= v <= 255:
        raise _unencodable(f"ubyte out of range: {int(v)}")
    return bytes((0x50, v))


def _enc_byte(v: int) -> bytes:
    if not -128 <= v <= 127:
        raise _unencodable(f"byte out of range: {int(v)}")
    return bytes((0x51, v & 0xFF))


def _enc_ushort(v: int) -> bytes:
    return b"\x60" + _U16.pack(v)


def _enc_short(v: int) -> bytes:
    return b"\x61" + _I16.pack(v)


def _enc_timestamp(v: int) -> bytes:
    return b"\x83" + _I64.pack(v)


def _enc_double(v: Any) -> bytes:
    return b"\x82" + _F64.pack(v)


def _enc_float(v: Any) -> bytes:
    return b"\x72" + _F32.pack(v)


def _enc_char(v: Any) -> bytes:
    if len(v) != 1:
        raise _unencodable("a char is exactly one character")
    return b"\x73" + _U32.pack(ord(v))


def _enc_uuid(v: uuid.UUID) -> bytes:
    return b"\x98" + v.bytes


def _enc_decimal(v: Decimal) -> bytes:
    if _DECIMAL_WIDTHS.get(v.code) != len(v.raw):
        raise _unencodable("decimal code and width disagree")
    return bytes((v.code,)) + v.raw


def _variable(small: int, large: int, raw: bytes) -> bytes:
    n = len(raw)
    if n < 256:
        return bytes((small, n)) + raw
    return bytes((large,)) + _U32.pack(n) + raw


def _enc_str(v: Any) -> bytes:
    return _variable(0xA1, 0xB1, v.encode())


def _enc_symbol(v: Any) -> bytes:
    return _variable(0xA3, 0xB3, v.encode())


def _enc_binary(v: Any) -> bytes:
    return _variable(0xA0, 0xB0, bytes(v))


def _sized_compound(small: int, large: int, count: int, body: bytes) -> bytes:
    size = len(body) + 1
    if size < 256 and count < 256:
        return bytes((small, size, count)) + body
    return bytes((large,)) + _U32X2.pack(size + 3, count) + body


def _enc_list(v: Any) -> bytes:
    if not v:
        return b"\x45"
    return _sized_compound(0xC0, 0xD0, len(v), b"".join([_encode(x) for x in v]))


def _enc_map(v: Any) -> bytes:
    parts = []
    for key, value in v.items():
        parts.append(_encode(key))
        parts.append(_encode(value))
    return _sized_compound(0xC1, 0xD1, len(parts), b"".join(parts))


def _enc_descriptor(descriptor: Any) -> bytes:
    # Descriptors are ulong codes or symbolic names, whatever Python type the caller used for them.
    if type(descriptor) is int:
        return _enc_ulong(descriptor)
    if type(descriptor) is str:
        return _enc_symbol(descriptor)
    return _encode(descriptor)


def _enc_described(v: Any) -> bytes:
    return b"\x00" + _enc_descriptor(v.descriptor) + _encode(v.value)


def _wide_list(v: Any) -> bytes:
    body = b"".join([_encode(x) for x in v])
    return b"\xd0" + _U32X2.pack(len(body) + 4, len(v)) + body


def _wide_map(v: Any) -> bytes:
    body = b"".join([_encode(x) for pair in v.items() for x in pair])
    return b"\xd1" + _U32X2.pack(len(body) + 4, 2 * len(v)) + body


# An array has one constructor for all its elements: when their natural encodings differ (small and large
# numbers, short and long strings), every element takes the wide form of its type.
_WIDE: Final[dict[type, _Encoder]] = {
    bool: lambda v: b"\x56\x01" if v else b"\x56\x00",
    int: lambda v: b"\x81" + _I64.pack(v),
    ULong: lambda v: b"\x80" + _U64.pack(v),
    UInt: lambda v: b"\x70" + _U32.pack(v),
    Int: lambda v: b"\x71" + _I32.pack(v),
    str: lambda v: b"\xb1" + _U32.pack(len(r := v.encode())) + r,
    Symbol: lambda v: b"\xb3" + _U32.pack(len(r := v.encode())) + r,
    bytes: lambda v: b"\xb0" + _U32.pack(len(v)) + v,
    list: _wide_list,
    dict: _wide_map,
}


def _array_body(values: list[Any]) -> bytes:
    """Element constructor and elements of an array of same-typed ``values``."""
    t = type(values[0])
    for x in values:
        if type(x) is not t:
            raise _unencodable("array items must all have the same type")
    if t is bool:  # true and false would otherwise need two constructors
        return b"\x56" + bytes([1 if x else 0 for x in values])
    encoded = [_encode(x) for x in values]
    first = encoded[0][0]
    if any(e[0] != first for e in encoded):
        wide = _WIDE.get(t)
        if wide is None:
            if t is Array:
                encoded = [_wide_array(x) for x in values]
            else:
                raise _unencodable(f"no array element constructor for {t.__name__}")
        else:
            encoded = [wide(x) for x in values]
    return encoded[0][:1] + b"".join([e[1:] for e in encoded])


def _array_payload(v: Array) -> bytes:
    items = v.items
    if not items:
        return b"\xa3"  # an element type is required even without elements: symbol, as in capability lists
    if type(items[0]) is Described:
        descriptor = items[0].descriptor
        for x in items:
            if type(x) is not Described or x.descriptor != descriptor:
                raise _unencodable("described array items must share their descriptor")
        return b"\x00" + _enc_descriptor(descriptor) + _array_body([x.value for x in items])
    return _array_body(items)


def _enc_array(v: Any) -> bytes:
    return _sized_compound(0xE0, 0xF0, len(v.items), _array_payload(v))


def _wide_array(v: Array) -> bytes:
    body = _array_payload(v)
    return b"\xf0" + _U32X2.pack(len(body) + 4, len(v.items)) + body


_ENCODERS: Final[dict[type, _Encoder]] = {
    type(None): _enc_null,
    bool: _enc_bool,
    int: _enc_long,
    str: _enc_str,
    bytes: _enc_binary,
    float: _enc_double,
    dict: _enc_map,
    list: _enc_list,
    Symbol: _enc_symbol,
    Described: _enc_described,
    ULong: _enc_ulong,
    UInt: _enc_uint,
    Timestamp: _enc_timestamp,
    Array: _enc_array,
    uuid.UUID: _enc_uuid,
    UByte: _enc_ubyte,
    UShort: _enc_ushort,
    Byte: _enc_byte,
    Short: _enc_short,
    Int: _enc_int,
    Float: _enc_float,
    Char: _enc_char,
    Decimal: _enc_decimal,
    bytearray: _enc_binary,
    memoryview: _enc_binary,
    tuple: _enc_list,
}


def _encoder_of(t: type) -> _Encoder:
    """The encoder of a subclass (an IntEnum, a str subclass ...): that of its nearest known base."""
    for base in t.__mro__:
        fn = _ENCODERS.get(base)
        if fn is not None:
            return fn
    raise _unencodable(f"cannot encode a {t.__name__} as AMQP")


def _encode(value: Any) -> bytes:
    fn = _ENCODERS.get(type(value))
    if fn is None:
        fn = _encoder_of(type(value))
    return fn(value)


def encode(value: Any) -> bytes:
    """The smallest AMQP encoding of ``value``."""
    try:
        return _encode(value)
    except (struct.error, OverflowError, UnicodeEncodeError) as e:
        raise _unencodable(f"value out of range for its AMQP type: {e}") from None
    except RecursionError:
        raise _unencodable("value nested too deeply (or contains itself)") from None
