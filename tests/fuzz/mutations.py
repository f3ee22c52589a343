"""Mutations of recorded sessions (bit flips, truncation, duplication, splicing) and Hypothesis strategies of
protocol-shaped frames, per protocol."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import msgpack
from hypothesis import strategies as st

from tridentmq_amqp.protocol.types import Described, ULong, encode

_INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF)


def mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One to three random mutations of a random seed (splices take a second seed)."""
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        if not data:
            data = bytearray(rng.choice(seeds))
        at = rng.randrange(len(data))
        if kind == 0:  # flip a few bits
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncate
            del data[at:]
        elif kind == 2:  # duplicate a slice in place
            end = min(len(data), at + rng.randint(1, 512))
            data[at:at] = data[at:end] * rng.randint(1, 4)
        elif kind == 3:  # splice: this seed's head, another's tail
            other = rng.choice(seeds)
            data = data[:at] + other[rng.randrange(len(other) or 1) :]
        elif kind == 4:  # an interesting byte (length fields, flags)
            data[at] = rng.choice(_INTERESTING)
        else:  # random bytes in the middle
            data[at:at] = rng.randbytes(rng.randint(1, 64))
    return bytes(data)


# ------------------------------------------------------------------------------------------ frame strategies
_TEXT = st.text(max_size=40)
_BODY = st.binary(max_size=300)


@st.composite
def stomp_frames(draw: st.DrawFn) -> bytes:
    command = draw(
        st.sampled_from(
            [
                "CONNECT",
                "STOMP",
                "SEND",
                "SUBSCRIBE",
                "UNSUBSCRIBE",
                "ACK",
                "NACK",
                "BEGIN",
                "COMMIT",
                "ABORT",
                "DISCONNECT",
            ]
        )
        | _TEXT
    )
    headers = draw(st.lists(st.tuples(_TEXT, _TEXT), max_size=8))
    head = command + "\n" + "".join(f"{k}:{v}\n" for k, v in headers) + "\n"
    return head.encode("utf-8", "surrogatepass") + draw(_BODY) + draw(st.sampled_from([b"\x00", b"\x00\n", b""]))


def _mqtt_length(n: int) -> bytes:
    out = b""
    while True:
        n, digit = divmod(n, 128)
        out += bytes([digit | (128 if n else 0)])
        if not n:
            return out


@st.composite
def mqtt_packets(draw: st.DrawFn) -> bytes:
    first = draw(st.integers(0, 255))
    body = draw(_BODY)
    length = _mqtt_length(len(body)) if draw(st.booleans()) else draw(st.binary(min_size=1, max_size=5))
    return bytes([first]) + length + body


Strategy = st.SearchStrategy[object]


def _nested(leaf: Strategy, containers: Callable[[Strategy], Strategy]) -> Strategy:
    """Values two containers deep (explicit levels: Hypothesis' own recursion warns on dictionaries)."""
    level = leaf | containers(leaf)
    return level | containers(level)


_AMQP_VALUES = _nested(
    st.none() | st.booleans() | _TEXT | st.binary(max_size=40), lambda inner: st.lists(inner, max_size=5)
)


@st.composite
def amqp_frames(draw: st.DrawFn) -> bytes:
    headers = st.sampled_from([b"AMQP\x00\x01\x00\x00", b"AMQP\x03\x01\x00\x00", b""])
    header = draw(headers | st.binary(min_size=8, max_size=8))
    frames = b""
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            code = draw(st.sampled_from([*range(0x10, 0x19), *range(0x40, 0x45)]) | st.integers(0, 2**64 - 1))
            body = encode(Described(ULong(code), draw(st.lists(_AMQP_VALUES, max_size=8))))
        else:
            body = draw(_BODY)
        size = 8 + len(body) if draw(st.booleans()) else draw(st.integers(0, 2**32 - 1))
        frames += (
            struct.pack(">IBBH", size, draw(st.integers(0, 255)), draw(st.integers(0, 2)), draw(st.integers(0, 65535)))
            + body
        )
    return header + frames


_MSGPACK = _nested(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | _TEXT | st.binary(max_size=60),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_TEXT | st.integers(0, 40), inner, max_size=6),
)


@st.composite
def link_frames(draw: st.DrawFn) -> bytes:
    payload = msgpack.packb(draw(_MSGPACK))
    size = len(payload) if draw(st.booleans()) else draw(st.integers(0, 2**32 - 1))
    return struct.pack(">I", size) + payload


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]) | _TEXT)
    path = draw(st.sampled_from(["/healthz", "/readyz", "/metrics", "/api/queues", "/stomp", "/"]) | _TEXT)
    headers = draw(st.lists(st.tuples(_TEXT, _TEXT), max_size=8))
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return head.encode("utf-8", "surrogatepass") + b"\r\n" + draw(_BODY)


STRATEGIES: dict[str, Callable[[], st.SearchStrategy[bytes]]] = {
    "stomp": stomp_frames,
    "mqtt": mqtt_packets,
    "amqp": amqp_frames,
    "link": link_frames,
    "http": http_requests,
}
