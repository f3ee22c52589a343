"""The book of durable publishes written through to another node: stored nowhere here, confirmed to their
producer once that node has them safe (see ``Forwarder.forward``).

A producer that misses its confirm sends the publish again, perhaps to this node's next life (restarted from
its journal, or its backup). That life must send it to the same node under the same transfer id, where it is
a duplicate if it arrived, whichever node its own balancing would pick. So the store notes, per producer's
id, the node each went to; the latest ``THROUGH_KEPT`` are kept, and copied by a compaction.

A noted publish leaves this node only once its note is safe (on disk here, and on the in-sync backup when
there is one). Sent first, a crash or a partition of this node right after could leave the other node with
the message and the next life without the note: its producer's resend then went where balancing sent it, and
was delivered twice as a first delivery (the last cause of such duplicates in the randomised runs). Later
direct sends over the same cluster connection wait behind held ones, so that order holds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final, Generic, TypeVar

from tridentmq_core.store.base import Store
from tridentmq_shared.message import WireMessage

P = TypeVar("P")  # a producer's session, opaque here

#: Producers' ids of publishes written through to another node kept here (and copied by a compaction): what
#: producers' publish windows can hold unconfirmed at once, with room to spare.
THROUGH_KEPT: Final = 100_000

#: A direct send waiting for a note: the connected node it goes through, the message, its producer's confirm
#: token (0: none), and the producer whose publish credit waits with it (None: none does).
Unsent = tuple[str, WireMessage, int, P | None]


class WriteThrough(Generic[P]):
    def __init__(self) -> None:
        # Producer's id → (the node it went to, arrival ms), oldest first. Ordered: forgetting the oldest of a
        # plain dict scans the holes deletions leave at its front, so each note cost more once it was full
        # (docs/benchmarks.md, Cluster).
        self.targets: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._notes: list[tuple[str, str, int]] = []  # this turn's, for the store
        self._unsent: list[Unsent[P]] = []  # this turn's held sends
        self._by_note: dict[int, list[Unsent[P]]] = {}  # store token of a note → the sends waiting for it, in order
        self._held_to: dict[str, int] = {}  # connected node → how many sends wait to go through it
        # Those not yet safe anywhere, by producer's id and confirm token (negative while on their way; a
        # positive store token while stored here and not yet synced, see ``Confirms.track``): a duplicate (its
        # producer sending it again) is confirmed only with the first, not at once.
        self._token_of: dict[str, int] = {}
        self._id_of: dict[int, str] = {}

    def note(self, dedup_id: str, target: str, now_ms: int) -> None:
        targets = self.targets
        targets[dedup_id] = (target, now_ms)
        targets.move_to_end(dedup_id)
        if len(targets) > THROUGH_KEPT:
            targets.popitem(last=False)
        self._notes.append((dedup_id, target, now_ms))

    def track(self, dedup_id: str, token: int) -> None:
        """The publish with this producer's id is safe once ``token`` completes."""
        self._token_of[dedup_id] = token
        self._id_of[token] = dedup_id

    def token_of(self, dedup_id: str) -> int | None:
        """The confirm token a duplicate of this producer's publish must wait for (None: safe, or unknown)."""
        return self._token_of.get(dedup_id) if self._token_of else None

    def forget(self, token: int) -> str | None:
        """``token`` completed, or its confirm passed to another: stop holding duplicates back for it;
        returns their producer's id."""
        dedup_id = self._id_of.pop(token, None) if self._id_of else None
        if dedup_id is not None and self._token_of.get(dedup_id) == token:
            del self._token_of[dedup_id]
        return dedup_id

    def to_remember(self, entries: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The duplicate ids (producer's id, arrival) a restart must remember: ``entries`` less the ids of
        publishes still on their way to the node they are written through to (if that node never stores one,
        its producer's resend must not be a duplicate)."""
        token_of = self._token_of
        if not token_of:
            return entries
        return [entry for entry in entries if token_of.get(entry[0], 0) >= 0]

    def target(self, dedup_id: str) -> str | None:
        """The node an earlier publish with this producer's id was written through to, if noted."""
        sent = self.targets.get(dedup_id)
        return None if sent is None else sent[0]

    def restore(self, through_ids: dict[str, tuple[str, int]]) -> None:
        for dedup_id, (node_id, arrived) in list(through_ids.items())[-THROUGH_KEPT:]:
            self.targets[dedup_id] = (node_id, arrived)

    def snapshot(self) -> list[tuple[str, str, int]]:
        return [(dedup_id, node_id, at) for dedup_id, (node_id, at) in self.targets.items()]

    def holds_for(self, via: str) -> bool:
        """Whether sends through ``via`` wait for a note: a later one must wait behind them."""
        return via in self._held_to

    def hold(self, via: str, message: WireMessage, token: int, publisher: P | None) -> None:
        self._unsent.append((via, message, token, publisher))
        self._held_to[via] = self._held_to.get(via, 0) + 1

    def end_turn(self, store: Store) -> list[Unsent[P]]:
        """Give the store this turn's notes; returns the held sends that may go now (their notes are safe)."""
        token = 0
        if self._notes:
            notes, self._notes = self._notes, []
            token = store.note_through(notes)
        unsent, self._unsent = self._unsent, []
        if not unsent:
            return []
        if token:
            self._by_note[token] = unsent
            return []
        if self._by_note:  # behind sends still waiting for their note (whose tokens complete in order)
            self._by_note[next(reversed(self._by_note))].extend(unsent)
            return []
        return self._released(unsent)

    def noted(self, token: int) -> list[Unsent[P]]:
        """The sends that waited for the note behind store ``token``, now safe."""
        unsent = self._by_note.pop(token, None) if self._by_note else None
        return self._released(unsent) if unsent else []

    def _released(self, unsent: list[Unsent[P]]) -> list[Unsent[P]]:
        held_to = self._held_to
        for via, _, _, _ in unsent:
            left = held_to[via] - 1
            if left:
                held_to[via] = left
            else:
                del held_to[via]
        return unsent
