"""The header a forwarded message carries between nodes. Pure.

A message moving to another node keeps its fields and gains one property holding, msgpack-encoded, the node
it is for, the queues there that get it, how many nodes it has crossed, a duplicate-detection id unique to
this transfer, and how often it was delivered before (so a redelivery stays flagged as one). The receiving
node removes the property before it stores the message, so no client sees it. The id is the sending node's
and the message's, not the producer's: a message that moves A → B → A must not look like a duplicate of
itself on A, and a transfer re-sent after a lost link must. The exception is a message written through
with a producer's duplicate-detection id: its id is ``p:`` and that id, because the sending node stored
nothing, so the producer's resend after that node died must look like a duplicate over there (a move back
later carries the other node's id, as any move does).
"""

from __future__ import annotations

from typing import Final, NamedTuple

import msgpack

#: The property; ``$``-prefixed names are the broker's own.
FORWARD_PROPERTY: Final = "$cluster.fwd"
DEDUP_PREFIX: Final = "$cluster:"


_PREFIXES: dict[tuple[str, tuple[str, ...], int], bytes] = {}
_MAX_PREFIXES: Final = 10_000


class ForwardHeader(NamedTuple):
    target: str  # node id of the node the message is for
    queues: tuple[str, ...]  # queues on that node; empty: route by address there
    hops: int  # nodes crossed so far
    dedup_id: str  # sending node id + its message id (or p: + the producer's id, see above)
    delivered: int = 0  # delivery attempts it already had (a message redistributed after a failed delivery)

    def encode(self) -> bytes:
        """The msgpack array, built from a cached prefix: every forwarded message needs one, and all but the
        transfer id repeat from message to message (this was a tenth of a forwarding node's time)."""
        key = (self.target, self.queues, self.hops)
        prefix = _PREFIXES.get(key)
        if prefix is None:
            prefix = b"\x95" + msgpack.packb(self.target) + msgpack.packb(list(self.queues)) + msgpack.packb(self.hops)
            if len(_PREFIXES) >= _MAX_PREFIXES:
                _PREFIXES.clear()
            _PREFIXES[key] = prefix
        raw = self.dedup_id.encode()
        size = len(raw)
        delivered = bytes((self.delivered,)) if 0 <= self.delivered < 128 else msgpack.packb(self.delivered)
        if size < 32:
            return b"".join((prefix, bytes((0xA0 | size,)), raw, delivered))  # msgpack fixstr
        if size < 256:
            return b"".join((prefix, bytes((0xD9, size)), raw, delivered))  # str 8: a node id and a message id
        return b"".join((prefix, msgpack.packb(self.dedup_id), delivered))

    @staticmethod
    def decode(value: object) -> ForwardHeader:
        """Raises ``ValueError`` when the property is not a header."""
        if type(value) is not bytes:
            raise ValueError("the forward header is bytes")
        try:
            fields = msgpack.unpackb(value)
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
            raise ValueError(f"undecodable forward header: {exc}") from None
        if type(fields) is not list or len(fields) != 5:
            raise ValueError("the forward header is [target, queues, hops, dedup_id, delivered]")
        target, queues, hops, dedup_id, delivered = fields
        if not (type(target) is str and type(queues) is list and all(type(q) is str for q in queues)
                and type(hops) is int and hops >= 0 and type(dedup_id) is str and dedup_id
                and type(delivered) is int and delivered >= 0):  # fmt: skip
            raise ValueError("malformed forward header")
        return ForwardHeader(target, tuple(queues), hops, dedup_id, delivered)
