"""The journal stream to a backup, primary side: the ``ReplicaFeed`` (order, segment rolls, batching within the
window and the batch size, acknowledgements, when the backup is in sync), and an end-to-end check of the design
claim that the records from a compaction's roll on, copied and new ones interleaved, replay to the complete state."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.unit.test_journal import SMALL_SEGMENT, as_entries, queue_spec, recover, wait_until, wire_message

import tridentmq_core.store.journal as journal_module
import tridentmq_core.store.journal_store as journal_store_module
from tridentmq_core.audit import NullAuditSink
from tridentmq_core.broker import Broker
from tridentmq_core.ha.backup import BackupRunner
from tridentmq_core.ha.replication import MAX_BATCH_BYTES, ROLL, ReplicaFeed
from tridentmq_core.ha.source import stall_limit, takeover_time
from tridentmq_core.settings import CoreSettings, HaSection, LinkSection
from tridentmq_core.store.base import DurableSnapshot
from tridentmq_core.store.identity import NodeIdentity
from tridentmq_core.store.journal import Journal, list_segments, read_segment, segment_name
from tridentmq_core.store.journal_store import JournalStore
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.store.records import Record, RecordType, encode, flaw, scan
from tridentmq_core.store.recovery import RecoveredState, replay
from tridentmq_shared.link.events import ReplicaRecords
from tridentmq_shared.link.peer import PeerLink
from tridentmq_shared.message import M_DEDUP, M_ID, M_TIMESTAMP


def data(n: int, size: int = 10) -> bytes:
    """A distinct stand-in for an encoded record (the feed never looks inside)."""
    return n.to_bytes(4, "big") + bytes(size - 4)


def fed(first: int, count: int, *, window: int, max_batch_bytes: int = MAX_BATCH_BYTES, size: int = 10) -> ReplicaFeed:
    feed = ReplicaFeed(1, first, window=window, max_batch_bytes=max_batch_bytes)
    for n in range(first, first + count):
        feed.append(n, data(n, size))
    return feed


# ---------------------------------------------------------------------------------------------------- the feed
def test_a_new_feed_has_nothing_to_send_and_nothing_acknowledged() -> None:
    feed = ReplicaFeed(3, 42, window=8)
    assert (feed.epoch, feed.first, feed.window, feed.max_batch_bytes) == (3, 42, 8, MAX_BATCH_BYTES)
    assert feed.next_number == 42
    assert feed.pending == 0
    assert feed.acked == 41
    assert feed.sync_end == 0
    assert not feed.in_sync
    assert feed.take() is None


def test_append_accepts_only_the_next_number() -> None:
    feed = ReplicaFeed(1, 10, window=8)
    for wrong in (9, 11, 0, 1):
        with pytest.raises(ValueError, match=rf"journal record {wrong} out of order \(expected 10\)"):
            feed.append(wrong, b"x")
    feed.append(10, b"a")
    with pytest.raises(ValueError, match=r"out of order \(expected 11\)"):
        feed.append(10, b"again")  # a duplicate
    feed.append(11, b"b")
    assert feed.take() == (10, [b"a", b"b"])
    # what was sent still counts: the next record is 12
    with pytest.raises(ValueError, match=r"expected 12"):
        feed.append(11, b"b")
    feed.append(12, b"c")
    assert feed.take() == (12, [b"c"])


def test_take_sends_records_in_order_within_the_window() -> None:
    feed = fed(10, 5, window=3)
    assert feed.pending == 5
    assert feed.take() == (10, [data(10), data(11), data(12)])
    assert feed.next_number == 13
    assert feed.take() is None  # three in flight: the window is full
    assert not feed.ack(10)
    assert feed.take() == (13, [data(13)])  # one acknowledged: room for one
    assert feed.take() is None
    assert not feed.ack(13)
    assert feed.take() == (14, [data(14)])
    assert feed.take() is None  # nothing left to send
    assert feed.next_number == 15
    assert feed.pending == 1
    assert not feed.ack(14)
    assert feed.pending == 0


def test_a_window_of_one_sends_one_record_at_a_time() -> None:
    feed = fed(1, 3, window=1)
    for n in (1, 2, 3):
        assert feed.take() == (n, [data(n)])
        assert feed.take() is None
        feed.ack(n)
    assert feed.take() is None


def test_take_keeps_a_batch_within_max_batch_bytes() -> None:
    feed = fed(1, 10, window=100, max_batch_bytes=35, size=10)
    assert feed.take() == (1, [data(1), data(2), data(3)])  # 30 bytes; a fourth would make 40
    feed = fed(1, 10, window=100, max_batch_bytes=40, size=10)
    assert feed.take() == (1, [data(n) for n in range(1, 5)])  # exactly the limit still fits
    assert feed.take() == (5, [data(n) for n in range(5, 9)])
    assert feed.take() == (9, [data(9), data(10)])
    assert feed.take() is None


def test_a_record_bigger_than_max_batch_bytes_still_goes_alone() -> None:
    feed = ReplicaFeed(1, 1, window=100, max_batch_bytes=20)
    big = b"B" * 50
    feed.append(1, b"s" * 5)
    feed.append(2, big)
    feed.append(3, b"t" * 5)
    feed.append(4, big)
    feed.append(5, big)
    assert feed.take() == (1, [b"s" * 5])  # the big one does not join a batch that has something
    assert feed.take() == (2, [big])  # alone, although it is over the limit
    assert feed.take() == (3, [b"t" * 5])
    assert feed.take() == (4, [big])
    assert feed.take() == (5, [big])
    assert feed.take() is None
    assert feed.pending == 5


def test_the_window_bounds_a_batch_before_the_byte_limit_does() -> None:
    feed = fed(1, 10, window=4, max_batch_bytes=1000)
    assert feed.take() == (1, [data(n) for n in range(1, 5)])
    feed.ack(2)
    assert feed.take() == (5, [data(5), data(6)])


def test_ack_of_a_record_never_sent_is_refused() -> None:
    feed = fed(10, 5, window=2)
    with pytest.raises(ValueError, match=r"acknowledgement of record 10, never sent \(sent up to 9\)"):
        feed.ack(10)  # appended, but not sent yet
    assert feed.take() == (10, [data(10), data(11)])
    with pytest.raises(ValueError, match=r"record 12, never sent \(sent up to 11\)"):
        feed.ack(12)
    with pytest.raises(ValueError, match="never sent"):
        feed.ack(1_000)
    assert feed.acked == 9  # nothing changed
    assert feed.pending == 5
    assert not feed.ack(11)
    assert feed.acked == 11


def test_stale_and_repeated_acks_are_ignored() -> None:
    feed = fed(10, 6, window=10)
    feed.take()
    assert not feed.ack(13)
    assert feed.acked == 13
    for stale in (13, 12, 10, 9, 0, -5):
        assert not feed.ack(stale)
        assert feed.acked == 13
    assert feed.pending == 2
    assert not feed.ack(15)
    assert feed.pending == 0


def test_in_sync_only_once_sync_end_is_known_and_acknowledged() -> None:
    feed = fed(10, 6, window=10)
    feed.take()
    assert not feed.ack(14)  # beyond any sync_end to come, but the copy has not ended
    assert not feed.in_sync
    feed.copied(17)  # the copy ends with record 17 (the COMPACTED marker)
    assert feed.sync_end == 17
    assert not feed.in_sync
    feed.append(16, data(16))
    feed.append(17, data(17))
    feed.append(18, data(18))
    feed.take()
    assert not feed.ack(16)
    assert not feed.in_sync
    assert [feed.ack(17), feed.in_sync] == [True, True]  # this acknowledgement makes it in sync, reported once
    assert not feed.ack(17)
    assert not feed.ack(18)
    assert [feed.in_sync, feed.acked] == [True, 18]


def test_writes_after_the_copy_are_confirmable_only_once_the_backup_holds_them() -> None:
    """A write confirmed after the end of the copy but before the primary heard that the backup was in sync
    (it is once it holds the copy) could be missing from that backup when it took over: from the moment the
    copy's end is known, a later record waits for the backup."""
    feed = fed(10, 6, window=10)
    feed.take()
    assert feed.confirmable is None  # the copy runs: writes are confirmed once on disk here
    feed.copied(17)
    assert feed.confirmable == 17  # up to the copy's end: the backup holds it before it counts itself in sync
    for number in (16, 17, 18, 19):
        feed.append(number, data(number))
    feed.take()
    feed.ack(16)
    assert feed.confirmable == 17
    feed.ack(17)
    assert (feed.in_sync, feed.confirmable) == (True, 17)  # 18 waits although it may be on disk here
    feed.ack(19)
    assert feed.confirmable == 19


def test_an_ack_past_sync_end_makes_it_in_sync_too() -> None:
    feed = fed(1, 5, window=10)
    feed.copied(3)
    feed.take()
    assert feed.ack(5) is True
    assert feed.in_sync
    assert feed.pending == 0


def test_pending_counts_unsent_and_unacknowledged_records() -> None:
    feed = ReplicaFeed(1, 100, window=3)
    for n in range(100, 108):
        feed.append(n, data(n))
        assert feed.pending == n - 99
    assert feed.next_number == 100  # appending sends nothing
    feed.take()
    assert (feed.next_number, feed.pending) == (103, 8)
    feed.ack(101)
    assert (feed.next_number, feed.pending) == (103, 6)
    feed.take()
    assert (feed.next_number, feed.pending) == (105, 6)
    feed.ack(104)
    assert feed.pending == 3


def test_a_backlog_past_max_backlog_bytes_overflows_the_feed_and_it_holds_no_more() -> None:
    feed = ReplicaFeed(1, 1, window=2, max_backlog_bytes=35)
    for n in (1, 2, 3):
        feed.append(n, data(n))
    assert feed.take() == (1, [data(1), data(2)])  # sent: no longer held
    feed.append(4, data(4))
    feed.append(5, data(5))
    assert not feed.overflowed  # 30 bytes wait
    feed.append(6, data(6))
    assert feed.overflowed  # 40
    feed.append(0, ROLL)
    feed.append(7, data(7))
    assert feed.take() is None  # what it lacks makes the rest useless: the backup is to be dropped
    feed.ack(2)
    assert feed.take() is None
    assert feed.pending == 5  # still counted
    with pytest.raises(ValueError, match=r"expected 8"):
        feed.append(9, data(9))


def test_records_sent_make_room_in_the_backlog() -> None:
    feed = ReplicaFeed(1, 1, window=2, max_backlog_bytes=30)
    for n in range(1, 21):
        feed.append(n, data(n))
        if n % 2 == 0:
            assert feed.take() == (n - 1, [data(n - 1), data(n)])
            feed.ack(n)
    assert not feed.overflowed
    assert feed.pending == 0


def test_a_roll_takes_no_number_and_travels_in_order() -> None:
    feed = ReplicaFeed(1, 10, window=8)
    feed.append(0, ROLL)  # what Journal.roll taps
    feed.append(10, data(10))
    feed.append(123, b"")  # any empty record is a roll: its number is ignored
    with pytest.raises(ValueError, match=r"expected 11"):
        feed.append(12, data(12))  # the rolls did not advance the numbering
    feed.append(11, data(11))
    assert feed.pending == 2
    assert feed.next_number == 10
    assert feed.take() == (10, [ROLL, data(10), ROLL, data(11)])
    assert feed.next_number == 12
    assert feed.pending == 2
    assert not feed.ack(11)
    assert feed.pending == 0


def test_rolls_do_not_count_against_the_window() -> None:
    feed = ReplicaFeed(1, 1, window=2)
    for n in (1, 2, 3):
        feed.append(0, ROLL)
        feed.append(n, data(n))
    assert feed.take() == (1, [ROLL, data(1), ROLL, data(2)])  # two records, the window
    assert feed.take() is None  # the window is full: not even the roll goes
    feed.ack(2)
    assert feed.take() == (3, [ROLL, data(3)])
    feed.append(0, ROLL)
    assert feed.pending == 1
    assert feed.take() == (4, [ROLL])  # a batch of rolls only, numbered where the next record will be
    assert feed.next_number == 4
    assert feed.take() is None
    assert not feed.ack(3)
    assert feed.pending == 0


def test_a_roll_waits_behind_a_full_window_and_an_oversized_batch() -> None:
    feed = ReplicaFeed(1, 1, window=1, max_batch_bytes=5)
    feed.append(1, data(1, size=10))
    feed.append(0, ROLL)
    feed.append(2, data(2, size=10))
    assert feed.take() == (1, [data(1, size=10)])  # alone: over the byte limit, and the window holds one
    feed.ack(1)
    assert feed.take() == (2, [ROLL])  # the roll alone: the next record would pass the byte limit
    assert feed.take() == (2, [data(2, size=10)])


@dataclass
class FeedModel:
    """What a backup received, to check the feed against."""

    appended: list[bytes] = field(default_factory=list)
    received: list[bytes] = field(default_factory=list)
    acked: int = 0


@settings(max_examples=150, deadline=None)
@given(
    first=st.integers(min_value=1, max_value=1000),
    window=st.integers(min_value=1, max_value=6),
    max_batch_bytes=st.integers(min_value=1, max_value=60),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(min_value=1, max_value=40)),
            st.tuples(st.just("roll"), st.just(0)),
            st.tuples(st.just("take"), st.just(0)),
            st.tuples(st.just("ack"), st.integers(min_value=0, max_value=8)),
        ),
        max_size=60,
    ),
)
def test_the_feed_delivers_every_record_once_in_order_within_its_bounds(
    first: int, window: int, max_batch_bytes: int, steps: list[tuple[str, int]]
) -> None:
    feed = ReplicaFeed(1, first, window=window, max_batch_bytes=max_batch_bytes)
    model = FeedModel(acked=first - 1)

    def numbered(items: list[bytes]) -> int:
        return sum(1 for item in items if item)

    for action, value in steps:
        if action == "roll":
            feed.append(0, ROLL)
            model.appended.append(ROLL)
        elif action == "append":
            record = len(model.appended).to_bytes(2, "big") + bytes(value)
            feed.append(first + numbered(model.appended), record)
            model.appended.append(record)
        elif action == "take":
            batch = feed.take()
            in_flight = first + numbered(model.received) - 1 - model.acked
            if batch is None:
                assert in_flight >= window or len(model.received) == len(model.appended)
                continue
            number, records = batch
            assert number == first + numbered(model.received)
            assert records
            assert numbered(records) + in_flight <= window
            assert len(records) == 1 or sum(map(len, records)) <= max_batch_bytes
            model.received.extend(records)
        else:  # the backup acknowledges some of what it received (or repeats an old ack)
            upto = model.acked + value - 4
            sent_up_to = first + numbered(model.received) - 1
            if upto > sent_up_to:
                with pytest.raises(ValueError, match="never sent"):
                    feed.ack(upto)
            else:
                feed.ack(upto)
                model.acked = max(model.acked, upto)
        assert feed.acked == model.acked
        assert feed.next_number == first + numbered(model.received)
        assert feed.pending == numbered(model.appended) - (model.acked - first + 1)
        assert model.received == model.appended[: len(model.received)]
    # with the backup acknowledging everything, the rest comes out in order
    if numbered(model.received):
        feed.ack(first + numbered(model.received) - 1)
    while (batch := feed.take()) is not None:
        model.received.extend(batch[1])
        if numbered(batch[1]):
            feed.ack(batch[0] + numbered(batch[1]) - 1)
    assert model.received == model.appended


# ---------------------------------------------------------------------------------------------------- end to end
def records_of(encoded: Iterable[bytes]) -> list[Record]:
    return [item for one in encoded for item in scan(one) if isinstance(item, Record)]


def snapshot_of(state: RecoveredState) -> DurableSnapshot:
    """What ``Broker.durable_snapshot`` would give for this state (as ``compact_offline`` copies it)."""
    messages = []
    for message_id in sorted(state.messages):
        queues = [name for name, refs in state.references.items() if message_id in refs]
        messages.append((state.messages[message_id], queues, [state.references[q][message_id] for q in queues]))
    return DurableSnapshot(
        addresses=[(name, list(kinds), auto) for name, (kinds, auto) in state.addresses.items()],
        queues=list(state.queues.values()),
        messages=messages,
        dedup_ids=list(state.dedup_ids.items()),
    )


def segment_entries(directory: Path) -> list[list[tuple[RecordType, Any]]]:
    """The records of each segment file of a closed journal (without the SYNCED records its writer adds)."""
    return [
        as_entries([r for r in read_segment(path) if isinstance(r, Record) and r.type is not RecordType.SYNCED])
        for path in list_segments(directory)
    ]


def message(n: int) -> list[Any]:
    m = wire_message(n, bytes(n % 50))
    if n % 4 == 0:
        m[M_DEDUP], m[M_TIMESTAMP] = f"producer:{n}", 1_000 + n
    return m


class Pair:
    """A primary's JournalStore with every record it ever wrote, and once connected, its feed to a backup
    journal (the backup writes each batch and acknowledges it at once)."""

    def __init__(self, directory: Path) -> None:
        self.primary = Journal(directory / "primary", segment_bytes=SMALL_SEGMENT)
        self.primary.recover()
        self.store = JournalStore(self.primary, call_in_loop=lambda fn: fn())
        self.history: list[bytes] = []
        self.primary.tap = lambda _number, encoded: self.history.append(encoded)
        self.primary.start()
        self.backup = Journal(directory / "backup", segment_bytes=SMALL_SEGMENT)
        self.feed = ReplicaFeed(0, 1, window=1)
        self.connected_at = 0  # where in the history the feed starts
        self.copies: list[int] = []  # where in the history the compaction's copied records are
        self.became_in_sync: list[int] = []

    def connect(self, *, window: int = 6, max_batch_bytes: int = 512) -> ReplicaFeed:
        """What ``ReplicationSource.replicate`` does: a feed from the next record, then a compaction."""
        wait_until(lambda: self.primary.synced == self.primary.appended)
        snapshot = snapshot_of(replay(records_of(self.history)))  # the broker's live durable state
        feed = self.feed = ReplicaFeed(7, self.primary.appended + 1, window=window, max_batch_bytes=max_batch_bytes)

        def tap(number: int, encoded: bytes) -> None:
            self.history.append(encoded)
            feed.append(number, encoded)

        self.primary.tap = tap
        self.connected_at = len(self.history)
        self.store.on_copied = feed.copied
        self.store.start_compaction(snapshot)
        self.copies.extend(range(self.connected_at, len(self.history)))  # addresses and queues, at once
        self.backup.recover()
        self.backup.start()
        return feed

    def step(self) -> None:
        """One chunk of the compaction, noting which records are copies."""
        start = len(self.history)
        self.store.compaction_step()
        self.copies.extend(range(start, len(self.history)))

    def send_one(self) -> bool:
        batch = self.feed.take()
        if batch is None:
            return False
        first, records = batch
        assert first == self.feed.first + self.backup.appended  # the backup's numbers are offset by first - 1
        last = self.backup.append_encoded(records) + self.feed.first - 1
        if self.feed.ack(last):
            self.became_in_sync.append(last)
        return True

    def finish(self) -> None:
        """Copy to the end, send everything, let both journals sync and the compaction retire, close."""
        while self.store.compacting and not self.feed.sync_end:
            self.step()
        while self.send_one():
            pass
        wait_until(lambda: self.primary.synced == self.primary.appended)
        wait_until(lambda: self.store.compactions == 1)
        self.primary.close()
        self.backup.close()
        assert self.primary.error is None
        assert self.backup.error is None

    def stream(self) -> list[Record]:
        """The records the primary wrote from the roll on (what the backup was to receive)."""
        return records_of(self.history[self.connected_at :])

    def backup_state(self) -> RecoveredState:
        return replay(recover(self.backup.directory, SMALL_SEGMENT)[0])

    def full_state(self) -> RecoveredState:
        """Everything the primary ever wrote, copies included, replayed."""
        return replay(records_of(self.history))

    def live_state(self) -> RecoveredState:
        """What the broker did, without the compaction's copies: the state the backup must end up with."""
        copies = set(self.copies)
        return replay(records_of(encoded for i, encoded in enumerate(self.history) if i not in copies))


def replicate_during_compaction(tmp_path: Path) -> Pair:
    """Build a primary's durable state, connect a backup, and keep publishing and acknowledging while the
    compaction copies in small chunks and the feed drains."""
    pair = Pair(tmp_path)
    store = pair.store
    store.add_address("orders", (0,), auto_created=False)
    store.add_address("events", (1,), auto_created=True)
    store.add_address("gone", (0,), auto_created=True)
    for name in ("q1", "q2", "q3"):
        store.add_queue(queue_spec(name))
    for n in range(1, 61):
        store.add_message(message(n), ("q1", "q2") if n % 3 == 0 else ("q1",) if n % 5 else ("q1", "q3"))
    for n in range(1, 40, 2):
        store.acknowledge("q1", [n])
    store.acknowledge("q2", [6])
    store.update_delivery_counts("q1", [42], [2])
    store.delete_address("gone")
    feed = pair.connect()
    assert len(pair.primary.segments()) >= 2

    n, step = 61, 0
    while not feed.sync_end or step < 30:  # during the copy, and a while after it
        pair.step()
        store.add_message(message(n), ("q1", "q3") if n % 2 else ("q1",))
        store.acknowledge("q1", [100 - n])  # old messages, some already copied, some still to come
        if n % 3 == 0:
            store.acknowledge("q1", [n - 1])  # a new one
        if n % 4 == 0:
            store.update_delivery_counts("q1", [n - 20], [3])  # old ones at first, then new ones
        match step:
            case 2:
                store.delete_queue("q2")
            case 3:
                store.add_queue({**queue_spec("q1"), "expires_ms": 5_000})  # its spec recorded again
            case 4:
                store.begin_transaction()
                store.add_message(message(1_000), ("q1", "q3"))
                store.acknowledge("q3", [5])
                store.commit_transaction()
            case 5:
                store.add_address("late", (1,), auto_created=False)
                store.add_queue(queue_spec("q4", "late"))
                store.add_message(message(1_001), ("q4",))
            case 6:
                store.delete_address("events")
            case _:
                pass
        pair.send_one()
        n += 1
        step += 1
        assert step < 500, "the compaction never ended"
    pair.finish()
    return pair


# Compaction writes the addresses and queues at once; its chunks then copy 6 records each (the remembered ids,
# then the messages), interleaved with new records.
FIRST_CHUNK = 6


def test_a_backup_fed_from_the_compaction_roll_replays_to_the_primary_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_store_module, "COMPACTION_CHUNK", FIRST_CHUNK)
    pair = replicate_during_compaction(tmp_path)
    feed = pair.feed

    # the feed: everything sent and acknowledged; in sync once, at the COMPACTED record
    assert feed.pending == 0
    assert feed.in_sync
    assert feed.acked == pair.primary.appended
    stream = pair.stream()
    assert sum(1 for r in stream if r.type is RecordType.MESSAGE) > 60  # copied and new ones
    compacted = [feed.first + i for i, r in enumerate(stream) if r.type is RecordType.COMPACTED]
    assert compacted == [feed.sync_end]
    copied_at = compacted[0] - feed.first
    assert any(r.type is RecordType.ACKS for r in stream[:copied_at])  # new records came during the copy
    assert len(pair.became_in_sync) == 1
    assert pair.became_in_sync[0] >= feed.sync_end

    # the backup holds exactly the primary's journal after the compaction retired the segments before the roll
    assert min(int(p.name[8:16]) for p in list_segments(pair.primary.directory)) > 1
    backup_records = recover(pair.backup.directory, SMALL_SEGMENT)[0]
    primary_records = recover(pair.primary.directory, SMALL_SEGMENT)[0]
    assert as_entries(backup_records) == as_entries(primary_records) == as_entries(stream)
    # segment by segment too: the stream carried the roll, so the backup can retire as the primary did (where
    # a full segment rolls depends on the SYNCED records each writer adds after its own syncs)
    assert pair.backup.rolled_to == 2  # its first segment, opened by start(), stays empty
    backup_segments = segment_entries(pair.backup.directory)
    primary_segments = segment_entries(pair.primary.directory)
    assert backup_segments[0] == []
    assert backup_segments[1][0] == primary_segments[0][0]  # the segment the compaction's roll started
    assert [r for s in backup_segments[1:] for r in s] == [r for s in primary_segments for r in s]

    # and it replays to the complete state: what the broker did (and what replaying all the primary ever
    # wrote, copies included, gives)
    full_state = pair.live_state()
    assert pair.copies
    for state in (replay(backup_records), replay(primary_records), pair.full_state()):
        assert state.messages == full_state.messages
        assert state.references == full_state.references  # as maps: the broker restores them by id
        assert state.addresses == full_state.addresses
        assert state.queues == full_state.queues
        assert state.dedup_ids == full_state.dedup_ids
        assert state.uncommitted == full_state.uncommitted == 0
    # the scenario exercised what it meant to
    assert "q2" not in full_state.queues
    assert full_state.queues["q1"]["expires_ms"] == 5_000
    assert set(full_state.addresses) == {"orders", "late"}
    assert 1_000 in full_state.references["q1"]
    assert full_state.references["q4"] == {1_001: 0}
    assert 3 in full_state.references["q1"].values()
    assert len(full_state.references["q1"]) > 40
    assert len(full_state.dedup_ids) > 10


def test_a_backup_restores_each_queue_in_publish_order(tmp_path: Path) -> None:
    """A message published while the copy runs is written before the older ones the copy writes later; the
    broker restores each queue by message id (ids grow with publish order), so FIFO holds after a takeover."""
    pair = Pair(tmp_path)
    pair.store.add_address("orders", (0,), auto_created=False)
    pair.store.add_queue(queue_spec("q"))
    for n in range(1, 6):
        pair.store.add_message(message(n), ("q",))
    pair.connect()
    pair.store.add_message(message(6), ("q",))  # published before the copy reached the older messages
    pair.finish()
    state = pair.backup_state()
    assert list(state.references["q"]) == [6, 1, 2, 3, 4, 5]  # the journal's order
    broker = Broker("node", CoreSettings(), store=MemoryStore(), audit=NullAuditSink(), first_message_id=1)
    broker.restore(state, 0)
    assert [m[M_ID] for m in broker.queues["q"].messages()] == [1, 2, 3, 4, 5, 6]


def test_a_message_published_before_the_copy_reaches_its_queue_is_kept(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    pair.store.add_address("orders", (0,), auto_created=False)
    pair.store.add_queue(queue_spec("q"))
    pair.store.add_message(message(1), ("q",))
    pair.connect()
    pair.store.add_message(message(2), ("q",))  # the server publishes between start_compaction and a step
    pair.finish()
    assert pair.live_state().references == {"q": {1: 0, 2: 0}}
    assert pair.backup_state().references == {"q": {1: 0, 2: 0}}


def test_an_address_deleted_before_the_copy_reaches_it_stays_deleted(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    pair.store.add_address("orders", (0,), auto_created=False)
    pair.store.add_address("temporary", (1,), auto_created=True)
    pair.connect()
    pair.store.delete_address("temporary")
    pair.finish()
    assert set(pair.live_state().addresses) == {"orders"}
    assert set(pair.backup_state().addresses) == {"orders"}


def test_a_backup_connecting_to_an_idle_primary_is_in_sync_after_the_copy(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    pair.store.add_address("orders", (0,), auto_created=False)
    pair.store.add_queue(queue_spec("q"))
    for n in range(1, 6):
        pair.store.add_message(message(n), ("q",))
    pair.store.acknowledge("q", [2])
    before = pair.primary.appended
    feed = pair.connect(window=2, max_batch_bytes=64)
    assert feed.first == before + 1
    pair.finish()
    # address, queue, remembered ids, four messages, the COMPACTED marker: sent in batches of at most 2
    assert [r.type for r in pair.stream()] == [
        RecordType.ADD_ADDRESS,
        RecordType.ADD_QUEUE,
        RecordType.DEDUP_IDS,
        *[RecordType.MESSAGE] * 4,
        RecordType.COMPACTED,
    ]
    assert feed.sync_end == pair.primary.appended
    assert feed.in_sync
    assert pair.became_in_sync == [feed.sync_end]
    assert pair.backup_state().references == pair.live_state().references == {"q": {1: 0, 3: 0, 4: 0, 5: 0}}


def test_a_backup_keeps_a_compactions_copy_when_the_next_compaction_roll_is_written_first(tmp_path: Path) -> None:
    """The primary may start its next compaction as soon as its own disk holds the last one's end; a backup
    that lags gets both rolls before its loop handles the sync of the first COMPACTED record. It must retire
    only the segments before that compaction's roll: the next roll's copy is not there yet."""
    primary = Journal(tmp_path / "primary", segment_bytes=SMALL_SEGMENT)
    primary.recover()
    store = JournalStore(primary, call_in_loop=lambda fn: fn())
    primary.start()
    store.add_address("orders", (0,), auto_created=False)
    store.add_queue(queue_spec("q"))
    messages = [message(n) for n in range(1, 41)]
    for m in messages:
        store.add_message(m, ("q",))
    wait_until(lambda: primary.synced == primary.appended)
    feed = ReplicaFeed(1, primary.appended + 1, window=100_000)
    primary.tap = feed.append
    store.on_copied = feed.copied
    snapshot = DurableSnapshot(
        addresses=[("orders", [0], False)], queues=[queue_spec("q")], messages=[(m, ["q"], [0]) for m in messages]
    )
    store.start_compaction(snapshot)
    store.compaction_step()  # copies everything: its COMPACTED record follows
    wait_until(lambda: store.compactions == 1)
    store.start_compaction(snapshot)  # the next one: a roll, the addresses and queues; its copy still to come
    primary.close()
    batch = feed.take()
    assert batch is not None
    assert sum(1 for data in batch[1] if data == ROLL) == 2

    synced: list[Callable[[], None]] = []  # the backup's loop is busy: the sync callbacks wait
    runner, client, data_dir = copying_backup(tmp_path, small_segments(), call_in_loop=synced.append)
    runner._records(client, ReplicaRecords(1, batch[0], batch[1], feed.sync_end))
    journal = runner.journal
    assert journal is not None
    journal.close()  # everything written, both rolls included; then the loop runs the callbacks
    for callback in synced:
        callback()

    assert runner.state.in_sync
    assert segment_name(1) not in [p.name for p in list_segments(data_dir / "journal")]  # retired all the same
    state = replay(recover(data_dir / "journal", SMALL_SEGMENT)[0])
    assert sorted(state.references["q"]) == [m[M_ID] for m in messages]


def _corrupt(record: bytes, kind: str) -> bytes:
    if kind == "crc":
        return record[:-1] + bytes([record[-1] ^ 1])
    if kind == "length":
        return record + b"\0"
    return encode(RecordType.MESSAGE, [wire_message(2, b"x" * (2 * SMALL_SEGMENT)), ["q"]])  # a larger segment's


@pytest.mark.parametrize("kind", ["crc", "length", "larger than a segment"])
async def test_a_backup_refuses_a_streamed_record_that_is_not_whole_and_copies_again(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a review: a record with a bad CRC was written and acknowledged, and the in-sync copy could
    not recover when it took over; one larger than this node's segments raised out of the link's callback."""
    runner, client, _ = copying_backup(tmp_path, small_segments())
    good = encode(RecordType.ADD_QUEUE, [queue_spec("q")])
    bad = _corrupt(encode(RecordType.MESSAGE, [wire_message(1), ["q"]]), kind)
    runner._records(client, ReplicaRecords(1, 1, [good, bad], 0))
    journal = runner.journal
    assert journal is not None
    journal.close()
    assert journal.appended == 0  # nothing of the batch: the link closes and the copy starts again
    assert "replication stream record refused" in caplog.text


def test_a_record_is_whole_only_with_its_header_length_and_crc() -> None:
    record = encode(RecordType.ADD_QUEUE, [queue_spec("q")])
    assert flaw(record) is None
    assert flaw(record[:5]) == "shorter than a record header"
    assert flaw(b"\0" + record[1:]) == "bad record header"
    assert flaw(record[:-1]) == "its length is not the header's"
    assert flaw(_corrupt(record, "crc")) == "CRC mismatch"


def small_segments() -> CoreSettings:
    base = CoreSettings()
    return replace(base, journal=replace(base.journal, segment_bytes=SMALL_SEGMENT))


def copying_backup(
    tmp_path: Path,
    settings: CoreSettings,
    *,
    call_in_loop: Callable[[Callable[[], None]], None] | None = None,
    fail: Callable[[str, BaseException], None] | None = None,
) -> tuple[BackupRunner, PeerLink, Path]:
    """A backup in ``tmp_path/backup`` that has begun a copy from a primary, over a peer link never connected
    (what it sends goes nowhere); the test hands it the primary's records. ``call_in_loop``: runs the journal's
    callbacks (at once by default); ``fail``: what a failure does (by default the test fails)."""
    data_dir = tmp_path / "backup"
    data_dir.mkdir()
    runner = BackupRunner(
        settings,
        NodeIdentity(data_dir),
        "b",
        data_dir / "journal",
        ("127.0.0.1", 1),
        call_in_loop or _now,
        noop,
        _no,
        fail or _unfailing,
    )
    runner.client = client = PeerLink("127.0.0.1", 1)
    runner._start_copy({"node_id": "pair", "epoch": 1, "members": []})
    return runner, client, data_dir


def _now(callback: Callable[[], None]) -> None:
    callback()


def _unfailing(name: str, exc: BaseException) -> None:
    raise AssertionError(f"the backup failed: {name}: {exc}")


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
async def test_a_backup_whose_journal_cannot_write_acknowledges_nothing_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Found by a review: the backup went on with a dead journal, "in sync" until its primary dropped it,
    then copied again into a journal that failed again. Now it fails the node (exit 70), as a primary does."""
    failed: list[tuple[str, BaseException]] = []
    runner, client, _ = copying_backup(tmp_path, CoreSettings(), fail=lambda name, exc: failed.append((name, exc)))
    acks: list[int] = []
    monkeypatch.setattr(client, "replica_ack", acks.append)

    def fdatasync(fd: int) -> None:  # the disk fails the write-back (EIO), or the write itself (ENOSPC)
        raise OSError(error, os.strerror(error))

    target = "fdatasync" if error == errno.EIO else "pwrite"
    monkeypatch.setattr(journal_module.os, target, lambda *_: fdatasync(0))
    runner._records(client, ReplicaRecords(1, 1, [encode(RecordType.ADD_QUEUE, [queue_spec("q")])], 1))
    wait_until(lambda: bool(failed))
    [(name, exc)] = failed
    assert name == "backup journal"
    assert os.strerror(error) in str(exc)
    assert acks == []  # nothing acknowledged that is not on disk
    assert not runner.state.in_sync
    monkeypatch.undo()
    runner._close_journal()


def _no() -> bool:
    return False


async def noop() -> None:
    pass


# ---------------------------------------------------------------------------------------------- a primary's stall
def test_a_primary_may_stand_still_less_than_its_backup_may_need_to_take_over() -> None:
    """The backup counts from the last frame it got, which may be two heartbeat intervals older than the
    primary's last run: 4 x 250 ms less 500 ms, plus the 500 ms vote grace by default."""
    defaults = CoreSettings()
    assert stall_limit(defaults) == pytest.approx(1.0)
    assert takeover_time(defaults) == pytest.approx(1.5)  # counted from the backup's last frame
    alone = CoreSettings(ha=HaSection(activate_without_quorum=True))  # no voters to wait for
    assert stall_limit(alone) == pytest.approx(0.5)
    slower = CoreSettings(link=LinkSection(heartbeat_ms=1000), ha=HaSection(vote_grace_ms=2000))
    assert stall_limit(slower) == pytest.approx(4.0)
