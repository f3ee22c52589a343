"""Replaying journal records into the state a broker restarts from. Pure: records in, state out."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tridentmq_core.store.records import Record, RecordType
from tridentmq_shared.message import M_DEDUP, M_ID, M_TIMESTAMP, WireMessage


@dataclass
class RecoveredState:
    addresses: dict[str, tuple[list[int], bool]] = field(default_factory=dict)  # name → routing types, auto-created
    queues: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → spec, in creation order
    messages: dict[int, WireMessage] = field(default_factory=dict)
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
        return len({message_id for refs in self.references.values() for message_id in refs})


#: Duplicate-detection ids kept by ``replay`` unless told otherwise (the broker's default limit).
DEDUP_LIMIT = 1_000_000


def replay(records: Iterable[Record], dedup_limit: int = DEDUP_LIMIT) -> RecoveredState:
    """The state the records describe; of the duplicate-detection ids, the newest ``dedup_limit``."""
    state = RecoveredState()
    open_txs: dict[int, list[Record]] = {}  # tx id → its records, applied when its commit comes
    for record in records:
        payload = record.payload
        match record.type:
            case RecordType.TX_MESSAGE | RecordType.TX_ACK:
                open_txs.setdefault(payload[0], []).append(record)
            case RecordType.TX_COMMIT:
                for staged in open_txs.pop(payload[0], ()):
                    if staged.type is RecordType.TX_MESSAGE:
                        _add_message(state, staged.payload[1], staged.payload[2], None)
                        _remember(state, staged.payload[1], dedup_limit)
                    else:
                        _ack(state, staged.payload[1], staged.payload[2])
            case RecordType.DEDUP_IDS:
                for dedup_id, arrived in payload:
                    _remember_id(state, dedup_id, arrived, dedup_limit)
            case RecordType.THROUGH_IDS:
                through = state.through_ids
                for dedup_id, node_id, arrived in payload:
                    through.pop(dedup_id, None)
                    through[dedup_id] = (node_id, arrived)
            case RecordType.MESSAGE:
                _add_message(state, payload[0], payload[1], payload[2] if len(payload) > 2 else None)
                _remember(state, payload[0], dedup_limit)
            case _:
                _apply(state, record.type, payload)
    _trim_ids(state, dedup_limit)
    if len(state.through_ids) > dedup_limit:
        state.through_ids = dict(
            itertools.islice(state.through_ids.items(), len(state.through_ids) - dedup_limit, None)
        )
    state.uncommitted = len(open_txs)
    live = {message_id for refs in state.references.values() for message_id in refs}
    state.messages = {k: v for k, v in state.messages.items() if k in live}
    return state


def _apply(state: RecoveredState, record_type: RecordType, payload: Any) -> None:
    match record_type:
        case RecordType.ADD_ADDRESS:
            state.addresses[payload[0]] = (list(payload[1]), bool(payload[2]) if len(payload) > 2 else False)
        case RecordType.DELETE_ADDRESS:
            state.addresses.pop(payload[0], None)
        case RecordType.ADD_QUEUE:
            state.queues[payload[0]["name"]] = payload[0]
            state.references.setdefault(payload[0]["name"], {})
        case RecordType.DELETE_QUEUE:
            state.queues.pop(payload[0], None)
            state.references.pop(payload[0], None)
        case RecordType.ACK:
            _ack(state, payload[0], payload[1])
        case RecordType.ACKS:
            for message_id in payload[1]:
                _ack(state, payload[0], message_id)
        case RecordType.DELIVERY_COUNT:
            _count(state, payload[0], payload[1], payload[2])
        case RecordType.DELIVERY_COUNTS:
            for message_id, count in zip(payload[1], payload[2], strict=True):
                _count(state, payload[0], message_id, count)
        case RecordType.COMPACTED:
            pass  # a marker for operators and tools: the records before it were copied forward


def _add_message(state: RecoveredState, message: WireMessage, queues: list[str], counts: list[int] | None) -> None:
    state.messages[message[M_ID]] = message
    for name, count in zip(queues, counts or [0] * len(queues), strict=False):
        refs = state.references.get(name)
        if refs is not None:
            refs[message[M_ID]] = count


def _remember(state: RecoveredState, message: WireMessage, limit: int) -> None:
    if message[M_DEDUP] is not None:
        _remember_id(state, message[M_DEDUP], message[M_TIMESTAMP], limit)


def _remember_id(state: RecoveredState, dedup_id: str, arrived: int, limit: int) -> None:
    ids = state.dedup_ids
    ids.pop(dedup_id, None)  # a re-publish after the window: it moves to the end
    ids[dedup_id] = arrived
    if len(ids) > limit + max(limit // 4, 1024):
        _trim_ids(state, limit)


def _trim_ids(state: RecoveredState, limit: int) -> None:
    """Keep the newest ``limit`` ids. In batches: deleting the oldest one per id left a hole at the front of
    the dict that every later look for the oldest stepped over, so a journal with more ids than the limit
    took quadratic time to replay."""
    ids = state.dedup_ids
    if len(ids) > limit:
        state.dedup_ids = dict(itertools.islice(ids.items(), len(ids) - limit, None))


def _count(state: RecoveredState, queue: str, message_id: int, count: int) -> None:
    refs = state.references.get(queue)
    if refs is not None and message_id in refs:
        refs[message_id] = count


def _ack(state: RecoveredState, queue: str, message_id: int) -> None:
    refs = state.references.get(queue)
    if refs is not None:
        refs.pop(message_id, None)
