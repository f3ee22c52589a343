"""The header a forwarded message carries between nodes. Pure.

A message moving to another node keeps its fields and gains one property holding, msgpack-encoded, the node
it is for, the queues there that get it, how many nodes it has crossed, a duplicate-detection id unique to
this transfer, and how often it was delivered before (so a redelivery stays flagged as one). The receiving
node removes the property before it stores the message, so no client sees it. The id is the sending node's
and the message's, not the producer's: a message that moves A → B → A must not look like a duplicate of
itself on A, and a transfer re-sent after a lost link must. The exception is a message written through
with a producer's duplicate-detection id: its id is ``p:``, the sending node's id and that id, because the
sending node stored nothing, so the producer's resend after that node died and came back must look like a
duplicate over there (a move back later carries the other node's id, as any move does). A redistributed
message's id also names the queue it leaves: a topic's message sits in several subscription queues under one
id, and each queue's copy moving to the same node is a transfer of its own, not a duplicate of the first.

Usually the id is the sending node's id and the message's id as sent, which the message carries anyway: the
header is then *numbered* and holds only the node's part, so it is the same bytes for every message to one
node's queues, and both sides keep it ready (building and parsing an id per message was a tenth of each
node's time).
"""

from __future__ import annotations

from typing import Final, NamedTuple

import msgpack

from tridentmq_shared.message import M_PROPS, WireMessage

#: The property; ``$``-prefixed names are the broker's own.
FORWARD_PROPERTY: Final = "$cluster.fwd"
#: How often a redistributed message was redistributed, this move included (its residence grows with it).
MOVES_PROPERTY: Final = "$cluster.moves"
DEDUP_PREFIX: Final = "$cluster:"
#: A producer's publish taken in for the node it was first sent to (its ``$link.home``), queues left empty:
#: ``h:`` and the producer's id. That node routes it as its own publish under the producer's id, so a copy it
#: stored before its confirm was lost makes this one a duplicate.
HOME_PREFIX: Final = "h:"


# The header is the msgpack array [dedup_id, delivered, target, queues, hops]: the part that changes from
# message to message first, so that the rest, the same for every message to one node's queues, is a suffix
# both sides cache. A numbered header is [node part, delivered, target, queues, hops, true], cached whole.
_SUFFIXES: dict[tuple[str, tuple[str, ...], int], bytes] = {}
_DECODED: dict[bytes, tuple[str, tuple[str, ...], int]] = {}
_NUMBERED: dict[tuple[str, tuple[str, ...], int, str, int], bytes] = {}
_NUMBERED_DECODED: dict[bytes, ForwardHeader] = {}
_MAX_CACHED: Final = 10_000


class ForwardHeader(NamedTuple):
    target: str  # node id of the node the message is for
    queues: tuple[str, ...]  # queues on that node; empty: route by address there
    hops: int  # nodes crossed so far
    dedup_id: str  # sending node id + its message id (or p: + node id + the producer's id, see above)
    delivered: int = 0  # delivery attempts it already had (a message redistributed after a failed delivery)
    numbered: bool = False  # ``dedup_id`` is the sending node's id and a colon; the message's id completes it

    def encode(self) -> bytes:
        if self.numbered:
            return numbered_header(self.target, self.queues, self.hops, self.dedup_id, self.delivered)
        return encode_header(self.target, self.queues, self.hops, self.dedup_id, self.delivered)

    @property
    def producer_dedup(self) -> str | None:
        """The producer's duplicate id of a publish sent to its home node (``HOME_PREFIX``), else None."""
        home = not self.numbered and self.dedup_id.startswith(HOME_PREFIX)
        return self.dedup_id[len(HOME_PREFIX) :] if home else None

    def transfer_id(self, message_id: int) -> str:
        """The id of this transfer of the message whose id, as sent, is ``message_id``."""
        return f"{self.dedup_id}{message_id}" if self.numbered else self.dedup_id

    @staticmethod
    def decode(value: object) -> ForwardHeader:
        """Raises ``ValueError`` when the property is not a header."""
        if type(value) is not bytes:
            raise ValueError("the forward header is bytes")
        numbered = _NUMBERED_DECODED.get(value)
        if numbered is not None:
            return numbered
        # The usual shape: a short non-empty id (fixstr or str 8), a delivery count below 128 (one byte), then
        # a suffix; one seen before is a dict look-up away.
        kind = value[1] if len(value) > 3 and value[0] == 0x95 else 0
        start = 2 if 0xA1 <= kind <= 0xBF else 3 if kind == 0xD9 and value[2] else 0
        end = start + (kind - 0xA0 if start == 2 else value[2]) if start else 0
        suffix = value[end + 1 :] if start and end < len(value) and value[end] < 128 else None
        if suffix is not None and (fixed := _DECODED.get(suffix)) is not None:
            try:
                target, queues, hops = fixed  # tuple.__new__: the NamedTuple's own __new__ is a Python call
                dedup_id = value[start:end].decode()
                return tuple.__new__(ForwardHeader, (target, queues, hops, dedup_id, value[end], False))
            except UnicodeDecodeError as exc:
                raise ValueError(f"undecodable forward header: {exc}") from None
        header = ForwardHeader._decode_whole(value)
        if suffix is not None:  # the whole decoded, so the suffix is exactly [target, queues, hops]
            if len(_DECODED) >= _MAX_CACHED:
                _DECODED.clear()
            _DECODED[suffix] = (header.target, header.queues, header.hops)
        return header

    @staticmethod
    def _decode_whole(value: bytes) -> ForwardHeader:
        try:
            fields = msgpack.unpackb(value)
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
            raise ValueError(f"undecodable forward header: {exc}") from None
        numbered = type(fields) is list and len(fields) == 6 and fields[5] is True
        if numbered:
            fields.pop()
        if type(fields) is not list or len(fields) != 5:
            raise ValueError("the forward header is [dedup_id, delivered, target, queues, hops(, true)]")
        if type(fields[1]) is list:  # the first layout, [target, queues, hops, dedup_id, delivered]: journaled
            target, queues, hops, dedup_id, delivered = fields  # in forward queues before the change
        else:
            dedup_id, delivered, target, queues, hops = fields
        if not (
            type(target) is str
            and type(queues) is list
            and all(type(q) is str for q in queues)
            and type(hops) is int
            and hops >= 0
            and type(dedup_id) is str
            and dedup_id
            and type(delivered) is int
            and delivered >= 0
        ):
            raise ValueError("malformed forward header")
        header = ForwardHeader(target, tuple(queues), hops, dedup_id, delivered, numbered)
        if numbered:
            if len(_NUMBERED_DECODED) >= _MAX_CACHED:
                _NUMBERED_DECODED.clear()
            _NUMBERED_DECODED[value] = header
        return header


def marked_resent(message: WireMessage) -> WireMessage:
    """A store-and-forward queue's message sent again after its link dropped unconfirmed: the other node may
    have stored it, delivered even. Its transfer id makes the copy a duplicate there while the node remembers
    it (``dedup_window_ms``); the header now also counts an attempt, so that a node that forgot it by then
    stores the copy with its next delivery flagged, not as new."""
    try:
        header = ForwardHeader.decode(message[M_PROPS].get(FORWARD_PROPERTY))
    except ValueError:
        return message  # refused over there as malformed, as it would have been the first time
    if header.delivered:
        return message
    outgoing = list(message)
    outgoing[M_PROPS] = {**message[M_PROPS], FORWARD_PROPERTY: header._replace(delivered=1).encode()}
    return outgoing


def numbered_header(target: str, queues: tuple[str, ...], hops: int, node_part: str, delivered: int = 0) -> bytes:
    """A numbered header (``ForwardHeader(..., numbered=True).encode()``): the same bytes for every message to
    ``queues`` on ``target``, so made once."""
    key = (target, queues, hops, node_part, delivered)
    header = _NUMBERED.get(key)
    if header is None:
        header = msgpack.packb([node_part, delivered, target, list(queues), hops, True])
        if len(_NUMBERED) >= _MAX_CACHED:
            _NUMBERED.clear()
        _NUMBERED[key] = header
    return header


def encode_header(target: str, queues: tuple[str, ...], hops: int, dedup_id: str, delivered: int = 0) -> bytes:
    """``ForwardHeader(...).encode()`` without making the header first (a forwarding node's hot path)."""
    suffix = _SUFFIXES.get((target, queues, hops))
    if suffix is None:
        suffix = msgpack.packb(target) + msgpack.packb(list(queues)) + msgpack.packb(hops)
        if len(_SUFFIXES) >= _MAX_CACHED:
            _SUFFIXES.clear()
        _SUFFIXES[(target, queues, hops)] = suffix
    raw = dedup_id.encode()
    size = len(raw)
    count = bytes((delivered,)) if 0 <= delivered < 128 else msgpack.packb(delivered)
    if size < 32:
        return b"".join((b"\x95", bytes((0xA0 | size,)), raw, count, suffix))  # msgpack fixstr
    if size < 256:
        return b"".join((b"\x95\xd9", bytes((size,)), raw, count, suffix))  # str 8: a node id and a message id
    return b"".join((b"\x95", msgpack.packb(dedup_id), count, suffix))
