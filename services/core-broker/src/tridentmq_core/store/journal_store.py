"""The ``Store`` backed by the journal: every durable change becomes a record; a durable message's token
completes when the writer thread has synced its record.

Compaction keeps the journal from growing for ever. It rolls to a fresh segment, writes the addresses and
durable queues at once, copies the rest of the live durable state (remembered dedup ids, every message still
owed with its delivery counts) forward in chunks of ``COMPACTION_CHUNK`` records per call, and once all of
that is synced deletes the segments before the roll. It is safe at every step: until the old segments
are gone, replaying old and copied records yields the same state. Acknowledgements, deletions and delivery
counts that happen while it runs are honoured by the records still to be copied.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tridentmq_core.store.base import Completion, DurableSnapshot
from tridentmq_core.store.journal import Journal
from tridentmq_core.store.records import RecordType, dedup_id_chunks
from tridentmq_shared.message import M_ID, WireMessage

log = logging.getLogger("tridentmq.core.journal")

COMPACTION_CHUNK = 20_000
#: Message ids per ACKS or DELIVERY_COUNTS record (about 40 KiB), at most: a client's batch can be far larger,
#: and every record must fit a segment (a small segment takes fewer, see ``ids_per_record``).
IDS_PER_RECORD = 4096
_BYTES_PER_ID = 20  # an id and a count, msgpack-encoded, at most


def ids_per_record(segment_bytes: int) -> int:
    """Ids per batch record for a journal of ``segment_bytes`` segments: records of half a segment at most."""
    return max(1, min(IDS_PER_RECORD, segment_bytes // 2 // _BYTES_PER_ID))


class JournalStore:
    def __init__(
        self,
        journal: Journal,
        call_in_loop: Callable[[Callable[[], None]], object],
        *,
        compact_min_segments: int = 4,
        compact_live_ratio: float = 0.5,
    ) -> None:
        """``call_in_loop`` runs a callable on the event loop thread (``loop.call_soon_threadsafe``)."""
        self.journal = journal
        self.compact_min_segments = compact_min_segments
        self.compact_live_ratio = compact_live_ratio
        self.compactions = 0
        self._call_in_loop = call_in_loop
        self._ids_per_record = ids_per_record(journal.segment_bytes)
        self._waiting: deque[int] = deque()
        self._written = 0  # records appended since the last compaction began
        self._copying: Iterator[tuple[RecordType, Any]] | None = None
        self._retire_after = 0  # when the record with this number is synced, the old segments can go
        self._roll = 0  # the roll that started the running compaction: the segments before it go
        self._acked: set[tuple[str, int]] = set()  # changes made while copying, which the copy must honour
        self._deleted: set[str] = set()
        self._counts: dict[tuple[str, int], int] = {}
        self._on_durable: Completion = lambda _token: None
        self._synced = 0  # the last record known on disk here
        # With an in-sync backup, writes are confirmed only up to what it acknowledged; None: no such bound.
        self._limit: int | None = None
        #: Called with the number of the last record of a compaction's copy (the end of a backup's sync).
        self.on_copied: Callable[[int], None] = lambda _number: None
        #: Whether confirms may go out now (a shared-store node whose lease might have lapsed holds them).
        self.gate: Callable[[], bool] = lambda: True
        self._tx_id = 0  # the open transaction (0: none); random, so no id recurs across restarts
        self._tx_written = False
        journal.on_synced = self._synced_in_writer

    def attach(self, on_durable: Completion) -> None:
        self._on_durable = on_durable

    def _append(self, record_type: RecordType, payload: Any) -> int:
        self._written += 1
        return self.journal.append(record_type, payload)

    def add_address(self, name: str, routing_types: tuple[int, ...], *, auto_created: bool) -> int:
        token = self._append(RecordType.ADD_ADDRESS, [name, list(routing_types), auto_created])
        self._waiting.append(token)
        return token

    def delete_address(self, name: str) -> None:
        self._append(RecordType.DELETE_ADDRESS, [name])

    def add_queue(self, spec: dict[str, Any]) -> int:
        token = self._append(RecordType.ADD_QUEUE, [spec])
        self._waiting.append(token)
        return token

    def delete_queue(self, name: str) -> int:
        # A queue deleted while copying keeps its messages out of the copy even if a new one takes its name:
        # the new queue's own records follow in the journal, the old one's must not.
        if self._copying is not None:
            self._deleted.add(name)
        token = self._append(RecordType.DELETE_QUEUE, [name])
        self._waiting.append(token)
        return token

    def add_message(self, message: WireMessage, queues: tuple[str, ...], counts: list[int] | None = None) -> int:
        if self._tx_id:
            if counts:
                raise ValueError("a transaction's message has no delivery attempts to record")
            self._tx_written = True
            self._append(RecordType.TX_MESSAGE, [self._tx_id, message, list(queues)])
            return 0  # the commit's token is the one to wait for
        record = [message, list(queues)] if counts is None else [message, list(queues), list(counts)]
        token = self._append(RecordType.MESSAGE, record)
        self._waiting.append(token)
        return token

    def acknowledge(self, queue: str, message_ids: list[int]) -> None:
        if self._copying is not None:
            self._acked.update((queue, message_id) for message_id in message_ids)
        if self._tx_id:
            self._tx_written = True
            for message_id in message_ids:
                self._append(RecordType.TX_ACK, [self._tx_id, queue, message_id])
        else:
            step = self._ids_per_record
            for start in range(0, len(message_ids), step):
                self._append(RecordType.ACKS, [queue, message_ids[start : start + step]])

    def note_through(self, entries: list[tuple[str, str, int]]) -> int:
        token = 0
        for chunk in dedup_id_chunks(entries, self.journal.segment_bytes):  # each record fits a segment
            token = self._append(RecordType.THROUGH_IDS, [list(entry) for entry in chunk])
        if token:
            self._waiting.append(token)
        return token

    def begin_transaction(self) -> None:
        self._tx_id = random.getrandbits(63) or 1
        self._tx_written = False

    def commit_transaction(self) -> int:
        tx_id, self._tx_id = self._tx_id, 0
        if not self._tx_written:
            return 0
        token = self._append(RecordType.TX_COMMIT, [tx_id])
        self._waiting.append(token)
        return token

    def update_delivery_counts(self, queue: str, message_ids: list[int], counts: list[int]) -> int:
        if not message_ids:
            return 0
        if self._copying is not None:
            self._counts.update(zip(((queue, message_id) for message_id in message_ids), counts, strict=True))
        token = 0
        step = self._ids_per_record
        for start in range(0, len(message_ids), step):
            end = start + step
            token = self._append(RecordType.DELIVERY_COUNTS, [queue, message_ids[start:end], counts[start:end]])
        self._waiting.append(token)
        return token

    # ------------------------------------------------------------------ compaction
    @property
    def compacting(self) -> bool:
        return self._copying is not None or self._retire_after > 0

    def wants_compaction(self, live_messages: Callable[[], int]) -> bool:
        """Enough segments, and most of what was written since the last compaction is dead (the messages still
        live are counted only then: a count goes through every durable queue)."""
        if self.compacting or len(self.journal.segments()) < self.compact_min_segments:
            return False
        return live_messages() < self.compact_live_ratio * self._written

    def start_compaction(self, snapshot: DurableSnapshot) -> None:
        self._roll = self.journal.roll()
        self._written = 0
        self._acked.clear()
        self._deleted.clear()
        self._counts.clear()
        # Addresses and queues go at once, right after the roll: a message published from now on refers to
        # its queue, which must come before it in the journal, and a later change or deletion must follow.
        for name, kinds, auto_created in snapshot.addresses:
            self.journal.append(RecordType.ADD_ADDRESS, [name, kinds, auto_created])
        for spec in snapshot.queues:
            self.journal.append(RecordType.ADD_QUEUE, [spec])
        self._copying = self._copy(snapshot)

    def _copy(self, snapshot: DurableSnapshot) -> Iterator[tuple[RecordType, Any]]:
        """The rest, in chunks: dedup ids, then every message still owed (replay orders each queue by
        message id, so messages published meanwhile, written before the older ones copied later, keep
        their places)."""
        for chunk in dedup_id_chunks(snapshot.dedup_ids, self.journal.segment_bytes):
            yield RecordType.DEDUP_IDS, chunk
        for entries in dedup_id_chunks(snapshot.through_ids, self.journal.segment_bytes):
            yield RecordType.THROUGH_IDS, entries
        for message, queues, counts in snapshot.messages:
            message_id = message[M_ID]
            keep = [
                (q, max(c, self._counts.get((q, message_id), 0)))
                for q, c in zip(queues, counts, strict=True)
                if q not in self._deleted and (q, message_id) not in self._acked
            ]
            if keep:
                yield RecordType.MESSAGE, [message, [q for q, _ in keep], [c for _, c in keep]]

    def compaction_step(self) -> None:
        """Copy the next chunk; after the last one, wait for the sync, then retire the old segments."""
        if self._copying is None:
            return
        for _ in range(COMPACTION_CHUNK):
            record = next(self._copying, None)
            if record is None:
                self._copying = None
                self._retire_after = self.journal.append(RecordType.COMPACTED, [])
                self.on_copied(self._retire_after)
                return
            self.journal.append(*record)

    def _synced_in_writer(self, upto: int) -> None:
        self._call_in_loop(lambda: self._complete(upto))

    def limit_confirms(self, upto: int | None) -> None:
        """Confirm writes only up to record ``upto`` (what a backup holds), or, with None, once on disk here."""
        self._limit = upto
        self._release()

    def hold_confirms(self) -> None:
        """Confirm nothing more than is confirmed now (until ``limit_confirms`` says otherwise): not a record
        the backup held before this node stalled, nor one whose local sync completes only now."""
        self._limit = self._synced if self._limit is None else min(self._synced, self._limit)

    def recheck(self) -> None:
        """Release what the gate held, if it opens now."""
        self._release()

    def _release(self) -> None:
        if not self.gate():
            return
        upto = self._synced if self._limit is None else min(self._synced, self._limit)
        waiting = self._waiting
        while waiting and waiting[0] <= upto:
            self._on_durable(waiting.popleft())

    def _complete(self, upto: int) -> None:
        self._synced = upto
        self._release()
        if self._retire_after and upto >= self._retire_after:
            self._retire_after = 0
            retired = self.journal.retire_before_roll(self._roll)
            self.compactions += 1
            log.info("journal compacted", extra={"segments_deleted": retired})
