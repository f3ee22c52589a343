"""Replaying journal records into the state a broker restarts from. Pure: records in, state out.

Replay streams: each record is applied as it is read, and a message leaves the state as soon as no queue
holds it any more, so a restart needs about the live state, not the journal's whole history (a journal of
many published and acknowledged messages used to be held whole, and a node that ran within its memory
could fail to come back).

Nor does a restart need a paged backlog whole: a message that only paging queues hold (``pages``) is kept as
where its record is (``located``), not decoded, and the restore reads it back as its queue takes it, so the
queue pages it as it would at run time (a node whose queues paged used to need its whole backlog in memory to
come back).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from tridentmq_core.store.records import Record, RecordType
from tridentmq_shared.message import M_DEDUP, M_ID, M_TIMESTAMP, WireMessage


@dataclass
class RecoveredState:
    addresses: dict[str, tuple[list[int], bool]] = field(default_factory=dict)  # name → routing types, auto-created
    queues: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → spec, in creation order
    messages: dict[int, WireMessage] = field(default_factory=dict)  # those some queue references, only
    # message id → ``location`` of its record, for those only paging queues reference (not in ``messages``)
    located: dict[int, int] = field(default_factory=dict)
    # queue → message id → delivery count so far, in publish order
    references: dict[str, dict[int, int]] = field(default_factory=dict)
    uncommitted: int = 0  # transactions whose records were written but whose commit was not
    # duplicate-detection id → arrival ms, oldest first, of every message the journal still shows
    dedup_ids: dict[str, int] = field(default_factory=dict)
    # producer's dedup id → (node it was written through to, arrival ms), oldest first
    through_ids: dict[str, tuple[str, int]] = field(default_factory=dict)

    def queue_counts(self) -> dict[str, int]:
        return {name: len(refs) for name, refs in self.references.items()}

    def live_messages(self) -> int:
        return len(self.messages) + len(self.located)  # replay keeps exactly the messages some queue references


#: Duplicate-detection ids kept by ``replay`` unless told otherwise (the broker's default limit).
DEDUP_LIMIT = 1_000_000
_ABSENT: Final = object()
#: A location is ``segment << LOCATION_SHIFT | offset``: one int per message (a tuple cost twice as much).
LOCATION_SHIFT: Final = 40


def location(record: Record) -> int:
    """Where ``record`` is in the journal, as ``RecoveredState.located`` keeps it."""
    return record.segment << LOCATION_SHIFT | record.offset


def message_of(record: Record) -> WireMessage:
    """The message a MESSAGE or TX_MESSAGE record holds (what a location is read back for)."""
    if record.type is RecordType.MESSAGE:
        return record.payload[0]  # type: ignore[no-any-return]
    if record.type is RecordType.TX_MESSAGE:
        return record.payload[1]  # type: ignore[no-any-return]
    raise ValueError(f"a {record.type.name} record holds no message")


def replay(
    records: Iterable[Record], dedup_limit: int = DEDUP_LIMIT, pages: Callable[[dict[str, Any]], bool] | None = None
) -> RecoveredState:
    """The state the records describe; of the duplicate-detection ids, the newest ``dedup_limit``. Takes the
    records one at a time: an iterator (a journal's ``recover``) is never held whole. ``pages`` tells by a
    queue's spec whether it pages: the messages only such queues hold are kept in ``located``."""
    replayer = Replayer(dedup_limit, pages)
    apply = replayer.apply
    for record in records:
        apply(record)
    return replayer.finish()


class Replayer:
    """Applies records one by one to ``state``; ``finish`` completes it once the last one was applied."""

    def __init__(self, dedup_limit: int = DEDUP_LIMIT, pages: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self.state = RecoveredState()
        self.dedup_limit = dedup_limit
        self._pages = pages
        #: The queues that page: a message only they hold is not kept, only where it is (``state.located``).
        self._paging: set[str] = set()
        self._locating = False  # once a queue pages (one flag: the plain path is per message)
        #: Message id → how many queues reference it, for those in more than one (a message of
        #: ``state.messages`` that is not here is in one): at 0 it leaves ``state.messages`` at once. Most are in
        #: one queue, and an entry for each cost 40 MB more per million live messages.
        self._holders: dict[int, int] = {}
        #: Transaction id → its records, applied at its commit (a transaction is written whole, then its
        #: commit: what stays here at the end lost its commit to a crash and is dropped).
        self._open_txs: dict[int, list[Record]] = {}

    def apply(self, record: Record) -> None:
        payload = record.payload
        state = self.state
        match record.type:
            case RecordType.MESSAGE:
                self._add_message(payload[0], payload[1], payload[2] if len(payload) > 2 else None, record)
                self._remember(payload[0])
            case RecordType.ACKS:
                for message_id in payload[1]:
                    self._ack(payload[0], message_id)
            case RecordType.DELIVERY_COUNTS:
                for message_id, count in zip(payload[1], payload[2], strict=True):
                    self._count(payload[0], message_id, count)
            case RecordType.TX_MESSAGE | RecordType.TX_ACK:
                self._open_txs.setdefault(payload[0], []).append(record)
            case RecordType.TX_COMMIT:
                for staged in self._open_txs.pop(payload[0], ()):
                    if staged.type is RecordType.TX_MESSAGE:
                        self._add_message(staged.payload[1], staged.payload[2], None, staged)
                        self._remember(staged.payload[1])
                    else:
                        self._ack(staged.payload[1], staged.payload[2])
            case RecordType.DEDUP_IDS:
                for dedup_id, arrived in payload:
                    self._remember_id(dedup_id, arrived)
            case RecordType.THROUGH_IDS:
                through = state.through_ids
                for dedup_id, node_id, arrived in payload:
                    through.pop(dedup_id, None)
                    through[dedup_id] = (node_id, arrived)
            case RecordType.ADD_ADDRESS:
                state.addresses[payload[0]] = (list(payload[1]), bool(payload[2]) if len(payload) > 2 else False)
            case RecordType.DELETE_ADDRESS:
                state.addresses.pop(payload[0], None)
            case RecordType.ADD_QUEUE:
                state.queues[payload[0]["name"]] = payload[0]
                state.references.setdefault(payload[0]["name"], {})
                if self._pages is not None and self._pages(payload[0]):
                    self._paging.add(payload[0]["name"])
                    self._locating = True
                else:  # recorded again with another spec: its located messages are still read back, as any
                    self._paging.discard(payload[0]["name"])
            case RecordType.DELETE_QUEUE:
                state.queues.pop(payload[0], None)
                self._paging.discard(payload[0])
                for message_id in state.references.pop(payload[0], {}):
                    self._release(message_id)
            case RecordType.ACK:
                self._ack(payload[0], payload[1])
            case RecordType.DELIVERY_COUNT:
                self._count(payload[0], payload[1], payload[2])
            case RecordType.COMPACTED | RecordType.SYNCED:
                pass  # markers for operators and tools (the records before it were copied forward, or synced)

    def finish(self) -> RecoveredState:
        """The state, once every record was applied (the duplicate-detection ids trimmed to the limit)."""
        state, limit = self.state, self.dedup_limit
        self._trim_ids()
        if len(state.through_ids) > limit:
            state.through_ids = dict(itertools.islice(state.through_ids.items(), len(state.through_ids) - limit, None))
        state.uncommitted = len(self._open_txs)
        self._open_txs.clear()
        return state

    def _add_message(self, message: WireMessage, queues: list[str], counts: list[int] | None, record: Record) -> None:
        if self._locating:
            self._add_or_locate(message, queues, counts, record)
            return
        # No queue pages (most journals): the plain path, without a look-up more per message.
        message_id = message[M_ID]
        messages = self.state.messages
        held = self._holders.get(message_id, 1) if message_id in messages else 0
        references = self.state.references
        for name, count in zip(queues, counts or itertools.repeat(0), strict=False):
            refs = references.get(name)
            if refs is not None:
                if message_id not in refs:
                    held += 1
                refs[message_id] = count
        if held:  # a message no queue takes is not kept (its dedup id still is)
            messages[message_id] = message
            if held > 1:
                self._holders[message_id] = held

    def _add_or_locate(self, message: WireMessage, queues: list[str], counts: list[int] | None, record: Record) -> None:
        """``_add_message`` where queues page: a message only they hold is kept as where ``record`` is."""
        message_id = message[M_ID]
        state = self.state
        messages, located = state.messages, state.located
        held = self._holders.get(message_id, 1) if message_id in messages or message_id in located else 0
        references = state.references
        paging = self._paging
        only_paging = bool(paging) and message_id not in messages  # a message kept decoded stays so
        for name, count in zip(queues, counts or itertools.repeat(0), strict=False):
            refs = references.get(name)
            if refs is not None:
                if message_id not in refs:
                    held += 1
                refs[message_id] = count
                if only_paging and name not in paging:
                    only_paging = False
        if held:
            if only_paging:  # its queues page: read back at restore, as they take it
                located[message_id] = location(record)
            else:
                messages[message_id] = message
                if located:
                    located.pop(message_id, None)
            if held > 1:
                self._holders[message_id] = held

    def _ack(self, queue: str, message_id: int) -> None:
        refs = self.state.references.get(queue)
        if refs is not None and refs.pop(message_id, _ABSENT) is not _ABSENT:
            self._release(message_id)

    def _release(self, message_id: int) -> None:
        """One queue let go of the message: the last one takes it out of the state."""
        held = self._holders.pop(message_id, 1) - 1
        if held > 1:
            self._holders[message_id] = held
        elif not held:
            try:
                del self.state.messages[message_id]
            except KeyError:
                del self.state.located[message_id]

    def _count(self, queue: str, message_id: int, count: int) -> None:
        refs = self.state.references.get(queue)
        if refs is not None and message_id in refs:
            refs[message_id] = count

    def _remember(self, message: WireMessage) -> None:
        if message[M_DEDUP] is not None:
            self._remember_id(message[M_DEDUP], message[M_TIMESTAMP])

    def _remember_id(self, dedup_id: str, arrived: int) -> None:
        ids = self.state.dedup_ids
        ids.pop(dedup_id, None)  # a re-publish after the window: it moves to the end
        ids[dedup_id] = arrived
        limit = self.dedup_limit
        if len(ids) > limit + max(limit // 4, 1024):
            self._trim_ids()

    def _trim_ids(self) -> None:
        """Keep the newest ``dedup_limit`` ids. In batches: deleting the oldest one per id left a hole at the
        front of the dict that every later look for the oldest stepped over, so a journal with more ids than
        the limit took quadratic time to replay."""
        state, limit = self.state, self.dedup_limit
        if len(state.dedup_ids) > limit:
            state.dedup_ids = dict(itertools.islice(state.dedup_ids.items(), len(state.dedup_ids) - limit, None))
