"""The durable journal: record encoding and scanning, write/recover, crash and corruption handling, replay,
and the JournalStore's group-commit completions.

Crash tests edit a single-segment journal in place: a cut "after record k" zeros everything from that
boundary (a clean stop), a torn write zeros from an offset inside the next record, a bit flip damages one
record. ``PowerLossDisk`` simulates a power cut: it wraps ``os.fdatasync`` so that it knows, per segment,
which bytes a completed sync made durable, and can stall the writer thread inside a sync so that a batch sits
written-but-unsynced while the test takes the image a power cut would leave.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import random
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.disks import fill, tmpfs
from tests.unit.broker_harness import Harness, ids

import tridentmq_core.store.journal as journal_module
import tridentmq_core.store.journal_store as journal_store_module
from tridentmq_core import data_tools
from tridentmq_core.settings import AddressSettingsEntry, CoreSettings
from tridentmq_core.store.base import DurableSnapshot
from tridentmq_core.store.data_lock import JournalLock, JournalLockedError
from tridentmq_core.store.journal import (
    COMPACT_SUFFIX,
    Journal,
    JournalCorruptedError,
    MessageReader,
    RecoveryReport,
    compact_offline,
    list_segments,
    segment_name,
    write_live_state,
)
from tridentmq_core.store.journal_store import IDS_PER_RECORD, JournalStore, ids_per_record
from tridentmq_core.store.records import (
    HEADER_SIZE,
    Record,
    RecordType,
    ScanEnd,
    damage_is_tail,
    encode,
    scan,
)
from tridentmq_core.store.recovery import Replayer, location, replay
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import M_DEDUP, M_ID, M_TIMESTAMP, WireMessage, new_message

Entry = tuple[RecordType, Any]
WAIT = 5.0  # seconds any wait for the writer thread may take before the test fails
SMALL_SEGMENT = 4096
ONE_SEGMENT = 64 * 1024  # large enough for every generated journal to fit one segment


# ---------------------------------------------------------------------------------------------------- helpers
def wire_message(message_id: int, body: bytes = b"body", address: str = "orders") -> list[Any]:
    message = new_message(address, body, durable=True, properties={"n": message_id})
    message[M_ID] = message_id
    return message


#: The kinds of record a journal's user appends (the writer adds SYNCED records of its own).
APPENDED_TYPES: Final = [t for t in RecordType if t is not RecordType.SYNCED]


def make_entry(index: int, rng: random.Random) -> Entry:
    """A plausible record of every kind in turn, with payloads of varied size."""
    kind = APPENDED_TYPES[index % len(APPENDED_TYPES)]
    match kind:
        case RecordType.ADD_ADDRESS:
            return kind, [f"address.{index}", [0, 1]]
        case RecordType.DELETE_ADDRESS:
            return kind, [f"address.{index}"]
        case RecordType.ADD_QUEUE:
            return kind, [{"name": f"queue.{index}", "address": f"address.{index}", "routing_type": 0}]
        case RecordType.DELETE_QUEUE:
            return kind, [f"queue.{index}"]
        case RecordType.MESSAGE:
            body = rng.randbytes(rng.randint(0, 400))
            return kind, [wire_message(index, body), ["queue.a", "queue.b"]]
        case RecordType.ACK:
            return kind, ["queue.a", index]
        case RecordType.DELIVERY_COUNT:
            return kind, ["queue.a", index, rng.randint(0, 3)]
        case RecordType.ACKS:
            return kind, ["queue.a", list(range(index, index + rng.randint(1, 300)))]
        case RecordType.DELIVERY_COUNTS:
            ids = list(range(index, index + rng.randint(1, 300)))
            return kind, ["queue.a", ids, [rng.randint(1, 3) for _ in ids]]
        case RecordType.TX_MESSAGE:
            return kind, [rng.getrandbits(63), wire_message(index, rng.randbytes(rng.randint(0, 400))), ["queue.a"]]
        case RecordType.TX_ACK:
            return kind, [rng.getrandbits(63), "queue.a", index]
        case _:  # COMPACTED and any kind added later: a short list payload
            return kind, [index]


def make_entries(count: int, seed: int = 7) -> list[Entry]:
    rng = random.Random(seed)
    return [make_entry(i, rng) for i in range(count)]


def as_entries(records: list[Record]) -> list[Entry]:
    return [(r.type, r.payload) for r in records]


def write_journal(
    directory: Path, entries: list[Entry], segment_bytes: int = ONE_SEGMENT, *, one_batch: bool = False
) -> list[int]:
    """Recover (the directory may hold a journal already), append ``entries`` (``one_batch``: written and
    synced at once, so no SYNCED record lies between them), close; the on_synced calls."""
    journal = Journal(directory, segment_bytes=segment_bytes)
    journal.recover()
    synced: list[int] = []
    journal.on_synced = synced.append
    journal.start()
    if one_batch:
        journal.append_encoded([encode(record_type, payload) for record_type, payload in entries])
    else:
        for record_type, payload in entries:
            journal.append(record_type, payload)
    journal.close()
    assert journal.error is None
    return synced


def recover(directory: Path, segment_bytes: int = ONE_SEGMENT) -> tuple[list[Record], RecoveryReport]:
    journal = Journal(directory, segment_bytes=segment_bytes)
    try:
        return journal.recover(list)
    finally:
        journal.close()


def boundaries(data: bytes) -> list[int]:
    """Offsets where each appended record starts, then where the last one ends (the SYNCED records the writer
    adds are left out: between records written in one batch there are none)."""
    items = list(scan(data))
    end = items[-1]
    assert isinstance(end, ScanEnd)
    assert end.reason is None
    records = [item for item in items[:-1] if isinstance(item, Record) and item.type is not RecordType.SYNCED]
    last = records[-1]
    return [r.offset for r in records] + [last.offset + len(encode(last.type, last.payload))]


@pytest.fixture
def no_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of recoveries each sync a zeroed tail; durability is not what those tests check."""
    monkeypatch.setattr(journal_module.os, "fdatasync", lambda _fd: None)


@dataclass
class OneSegment:
    """A closed single-segment journal of generated records, and a place to recover edited copies of it."""

    entries: list[Entry]
    data: bytes  # the whole segment file
    bounds: list[int]  # record k spans bounds[k]..bounds[k + 1]
    work: Path

    def recover_image(self, image: bytes) -> tuple[list[Record], RecoveryReport, bytes]:
        """Recover a journal whose only segment holds ``image``; also return the segment afterwards."""
        path = self.work / segment_name(1)
        path.write_bytes(image)
        records, report = recover(self.work)
        return records, report, path.read_bytes()


@pytest.fixture
def one_segment(tmp_path: Path) -> OneSegment:
    entries = make_entries(30)
    write_journal(tmp_path / "journal", entries, one_batch=True)  # [SYNCED] 30 records [SYNCED]
    [path] = list_segments(tmp_path / "journal")
    data = path.read_bytes()
    assert len(data) == ONE_SEGMENT
    work = tmp_path / "work"
    work.mkdir()
    return OneSegment(entries, data, boundaries(data), work)


def zeroed_from(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes(len(data) - offset)


def flipped(data: bytes, offset: int, bit: int) -> bytes:
    edited = bytearray(data)
    edited[offset] ^= 1 << bit
    return bytes(edited)


# ---------------------------------------------------------------------------------------------------- records
payloads = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.text(max_size=40)
    | st.binary(max_size=80),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=24,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(RecordType)), payloads), min_size=1, max_size=8))
def test_encode_then_scan_returns_every_record_for_every_type(entries: list[Entry]) -> None:
    buffer = b"".join(encode(record_type, payload) for record_type, payload in entries)
    items = list(scan(buffer))
    assert all(isinstance(item, Record) for item in items[:-1])
    assert as_entries(items[:-1]) == entries  # type: ignore[arg-type]
    assert items[-1] == ScanEnd(len(buffer), None)
    # every record starts where the previous one ended, and is exactly header + msgpack body long
    offsets = [item.offset for item in items]
    assert offsets[0] == 0
    for (record_type, payload), start, stop in zip(entries, offsets, offsets[1:], strict=False):
        assert stop - start == len(encode(record_type, payload)) >= HEADER_SIZE


@pytest.mark.parametrize("record_type", list(RecordType))
def test_each_record_type_round_trips_with_a_realistic_payload(record_type: RecordType) -> None:
    payload = make_entry(list(RecordType).index(record_type), random.Random(1))[1]
    record = encode(record_type, payload)
    assert record[0] == 0xA7
    assert record[1] == record_type
    assert int.from_bytes(record[2:6], "big") == len(record) - HEADER_SIZE
    assert list(scan(record + bytes(32))) == [Record(0, record_type, payload), ScanEnd(len(record), None)]


def test_scan_of_nothing_or_of_zeros_is_a_clean_end() -> None:
    assert list(scan(b"")) == [ScanEnd(0, None)]
    assert list(scan(bytes(4096))) == [ScanEnd(0, None)]
    record = encode(RecordType.ACK, ["q", 1])
    for padding in (0, 1, HEADER_SIZE - 1, HEADER_SIZE, 1000):
        assert list(scan(record + bytes(padding)))[-1] == ScanEnd(len(record), None)


def test_scan_starts_at_the_given_offset() -> None:
    first, second = encode(RecordType.ACK, ["q", 1]), encode(RecordType.ACK, ["q", 2])
    items = list(scan(first + second + bytes(20), len(first)))
    assert items == [Record(len(first), RecordType.ACK, ["q", 2]), ScanEnd(len(first) + len(second), None)]


def test_truncating_three_records_at_every_length() -> None:
    entries = [
        (RecordType.ADD_QUEUE, [{"name": "q", "address": "a"}]),
        (RecordType.MESSAGE, [wire_message(1, b"x" * 40), ["q"]]),
        (RecordType.ACK, ["q", 1]),
    ]
    encoded = [encode(record_type, payload) for record_type, payload in entries]
    buffer = b"".join(encoded)
    ends = [sum(len(e) for e in encoded[: i + 1]) for i in range(len(encoded))]
    record_starts = [0, *ends]  # a cut exactly here ends on a boundary
    for length in range(len(buffer) + 1):
        items = list(scan(buffer[:length]))
        complete = sum(1 for end in ends if end <= length)
        assert as_entries(items[:-1]) == entries[:complete], length  # type: ignore[arg-type]
        end = items[-1]
        assert isinstance(end, ScanEnd)
        assert end.offset == record_starts[complete], length
        if length in record_starts:
            assert end.reason is None, length
        else:
            assert end.reason is not None, length
            assert damage_is_tail(buffer[:length], end.offset), length
        # the same cut followed by a segment's zeros: a torn record is still damage, not a clean end
        padded = list(scan(buffer[:length] + bytes(256)))
        assert padded[:-1] == items[:-1], length
        assert isinstance(padded[-1], ScanEnd)
        assert padded[-1].offset == end.offset, length
        assert (padded[-1].reason is None) == (end.reason is None), length


def test_scan_reports_why_it_stopped() -> None:
    record = encode(RecordType.ACK, ["q", 1])
    cases = {
        "bad magic": bytes([0x55]) + record[1:],
        "unknown type": record[:1] + bytes([0xEE]) + record[2:],
        "crc": record[:-1] + bytes([record[-1] ^ 0x01]),
        "too long": record[:2] + (10_000).to_bytes(4, "big") + record[6:],
        "header fragment": record[:5],
    }
    for name, damaged in cases.items():
        items = list(scan(record + damaged + bytes(64)))
        assert items[0] == Record(0, RecordType.ACK, ["q", 1]), name
        assert isinstance(items[1], ScanEnd), name
        assert items[1].offset == len(record), name
        assert items[1].reason, name


def test_damage_is_tail_looks_for_valid_records_behind_the_damage() -> None:
    good = [encode(RecordType.ACK, ["q", n]) for n in range(3)]
    damaged = flipped(good[1], len(good[1]) - 1, 0)
    assert damage_is_tail(good[0] + damaged + bytes(100), len(good[0]))
    assert not damage_is_tail(good[0] + damaged + good[2] + bytes(100), len(good[0]))


# ------------------------------------------------------------------------------------ write, close, recover
def test_write_close_recover_returns_the_same_records_in_order(tmp_path: Path) -> None:
    entries = make_entries(50)
    journal = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    assert journal.recover(list) == ([], RecoveryReport())
    synced: list[int] = []
    journal.on_synced = synced.append
    journal.start()
    numbers = [journal.append(record_type, payload) for record_type, payload in entries]
    journal.close()
    assert numbers == list(range(1, len(entries) + 1))
    assert synced
    assert synced == sorted(set(synced))  # strictly increasing
    assert synced[-1] == len(entries)
    assert journal.synced == len(entries)

    records, report = recover(tmp_path)
    assert as_entries(records) == entries
    assert report.records == len(entries)
    assert report.segments == 1
    assert report.truncated == []


def test_segments_roll_and_recovery_reads_them_in_order(tmp_path: Path) -> None:
    entries = make_entries(250)  # about 13.8 KB: four segments of 4 KB
    synced = write_journal(tmp_path, entries, SMALL_SEGMENT)
    assert synced[-1] == len(entries)
    segments = list_segments(tmp_path)
    assert len(segments) >= 3
    assert [p.name for p in segments] == [segment_name(n) for n in range(1, len(segments) + 1)]
    assert all(p.stat().st_size == SMALL_SEGMENT for p in segments)

    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == entries
    assert report.segments == len(segments)
    assert report.truncated == []
    # each segment is scanned from its own offset 0, so offsets restart where a segment starts
    assert 1 + sum(b.offset < a.offset for a, b in itertools.pairwise(records)) == len(segments)


def test_a_record_larger_than_a_segment_is_refused(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    journal.start()
    with pytest.raises(ValueError, match="does not fit"):
        journal.append(RecordType.MESSAGE, [wire_message(1, bytes(SMALL_SEGMENT)), ["q"]])
    journal.close()
    assert recover(tmp_path, SMALL_SEGMENT)[0] == []


def test_recovery_reads_a_segment_only_when_its_records_are_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One segment in memory at a time: the records reach ``consume`` as each segment is read."""
    entries = make_entries(120)
    write_journal(tmp_path, entries, SMALL_SEGMENT)
    segments = len(list_segments(tmp_path))
    assert segments >= 3
    reads: list[str] = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: reads.append(path.name) or read_bytes(path))
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    seen, report = journal.recover(lambda records: [len(reads) for _ in records])  # segments read at each record
    journal.close()
    assert len(seen) == report.records == len(entries)
    assert seen[0] == 1
    assert seen[-1] == report.segments == segments


def test_a_consumer_that_stops_early_still_gets_the_writer_after_the_last_record(tmp_path: Path) -> None:
    """The damage check and the writer's position need every segment: what ``consume`` leaves is read too."""
    entries = make_entries(120)
    write_journal(tmp_path, entries, SMALL_SEGMENT)
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    first, report = journal.recover(next)
    assert as_entries([first]) == entries[:1]
    assert report.records == journal.appended == len(entries)
    journal.start()
    journal.append(RecordType.ACK, ["q", 1])
    journal.close()
    assert as_entries(recover(tmp_path, SMALL_SEGMENT)[0]) == [*entries, (RecordType.ACK, ["q", 1])]


def test_writing_continues_after_recovery(tmp_path: Path) -> None:
    first, second, third = make_entries(100, seed=1), make_entries(90, seed=2), make_entries(5, seed=3)
    write_journal(tmp_path, first, SMALL_SEGMENT)
    segments_before = len(list_segments(tmp_path))

    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    records, _ = journal.recover(list)
    assert as_entries(records) == first
    synced: list[int] = []
    journal.on_synced = synced.append
    journal.start()
    numbers = [journal.append(*entry) for entry in second]
    journal.close()
    assert numbers == list(range(len(first) + 1, len(first) + len(second) + 1))
    assert synced[-1] == len(first) + len(second)
    assert len(list_segments(tmp_path)) > segments_before  # the new records rolled on into fresh segments

    write_journal(tmp_path, third, SMALL_SEGMENT)
    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == first + second + third
    assert report.truncated == []


def test_roll_starts_a_new_segment_and_recovery_reads_across_it(tmp_path: Path) -> None:
    entries = make_entries(6)
    journal = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    journal.recover()
    journal.start()
    for entry in entries[:3]:
        journal.append(*entry)
    journal.roll()
    for entry in entries[3:]:
        journal.append(*entry)
    journal.close()
    assert journal.rolled_to == 2
    assert [p.name for p in list_segments(tmp_path)] == [segment_name(1), segment_name(2)]
    records, report = recover(tmp_path)
    assert as_entries(records) == entries
    assert report.segments == 2


def test_retire_before_roll_keeps_the_segments_from_that_roll_on_when_later_ones_are_written(tmp_path: Path) -> None:
    entries = make_entries(5)
    journal = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    journal.recover()
    journal.start()
    journal.append(*entries[0])
    first = journal.roll()
    journal.append(*entries[1])
    assert journal.append_encoded([encode(*entries[2]), b"", encode(*entries[3])]) == 4  # a roll in a stream
    assert journal.rolls == 2
    third = journal.roll()
    journal.append(*entries[4])
    wait_until(lambda: journal.synced == journal.appended)
    assert (first, third, journal.rolled_to) == (1, 3, 4)
    assert journal.retire_before_roll(first) == 1  # not before the last roll's segment
    assert [p.name for p in list_segments(tmp_path)] == [segment_name(n) for n in (2, 3, 4)]
    assert journal.retire_before_roll(first) == 0  # done with
    assert journal.retire_before_roll(third) == 2
    journal.close()
    assert as_entries(recover(tmp_path)[0]) == entries[4:]


# ---------------------------------------------------------------------------------------------------- crashes
@pytest.mark.usefixtures("no_sync")
def test_a_cut_at_every_record_boundary_recovers_exactly_the_records_before_it(one_segment: OneSegment) -> None:
    for k, offset in enumerate(one_segment.bounds):
        records, report, after = one_segment.recover_image(zeroed_from(one_segment.data, offset))
        assert as_entries(records) == one_segment.entries[:k], k
        assert report.truncated == [], k
        assert after == zeroed_from(one_segment.data, offset), k


@pytest.mark.usefixtures("no_sync")
def test_a_torn_write_at_every_offset_is_cut_off_and_reported(one_segment: OneSegment) -> None:
    data, bounds, entries = one_segment.data, one_segment.bounds, one_segment.entries
    for k in range(len(entries)):
        start, stop = bounds[k], bounds[k + 1]
        last_nonzero = max(i for i in range(start, stop) if data[i])
        # a cut at or after the record's last non-zero byte changes nothing: the record is still whole
        for offset in range(start + 1, last_nonzero + 1):
            records, report, after = one_segment.recover_image(zeroed_from(data, offset))
            assert as_entries(records) == entries[:k], (k, offset)
            assert len(report.truncated) == 1, (k, offset)
            assert f"cut at offset {start}" in report.truncated[0], (k, offset)
            assert after == zeroed_from(data, start), (k, offset)  # the torn part is gone from the file
            if offset % 16 == 0 or offset == start + 1:
                records, report = recover(one_segment.work)
                assert as_entries(records) == entries[:k], (k, offset)
                assert report.truncated == [], (k, offset)


def test_recovery_after_a_torn_tail_writes_over_it(tmp_path: Path) -> None:
    entries = make_entries(10)
    write_journal(tmp_path, entries)
    [path] = list_segments(tmp_path)
    data = path.read_bytes()
    bounds = boundaries(data)
    path.write_bytes(zeroed_from(data, bounds[8] + 5))  # record 9 of 10 torn, record 10 never written
    more = make_entries(4, seed=9)
    write_journal(tmp_path, more)
    records, report = recover(tmp_path)
    assert as_entries(records) == entries[:8] + more
    assert report.truncated == []


# ---------------------------------------------------------------------------------------------------- corruption
@pytest.mark.usefixtures("no_sync")
def test_a_bit_flip_in_any_synced_record_refuses_to_start(one_segment: OneSegment) -> None:
    """The SYNCED record the writer wrote after the batch's sync lies behind every record of it: a flipped bit
    there is not a torn write, even in the last record."""
    data, bounds, entries = one_segment.data, one_segment.bounds, one_segment.entries
    for j in range(len(entries)):
        for offset in range(bounds[j], bounds[j + 1]):
            image = flipped(data, offset, offset % 8)
            with pytest.raises(JournalCorruptedError, match=segment_name(1)):
                one_segment.recover_image(image)
            # refusing leaves the evidence alone
            assert (one_segment.work / segment_name(1)).read_bytes() == image, (j, offset)


@pytest.mark.usefixtures("no_sync")
def test_damage_in_a_write_never_synced_is_cut_off_with_what_lies_behind_it(one_segment: OneSegment) -> None:
    """The power failed before the batch's sync completed (no SYNCED record behind it): its pages may have
    reached the disk in any order, so damage anywhere in it, with valid records of it behind, is a torn write
    that nobody was told was safe. Recovery keeps what comes before the damage and clears the rest."""
    data, bounds, entries = one_segment.data, one_segment.bounds, one_segment.entries
    unsynced = zeroed_from(data, bounds[-1])  # the batch, without the SYNCED record its sync would have added
    for j in range(len(entries)):
        start, stop = bounds[j], bounds[j + 1]
        for offset in (start, start + 1, start + HEADER_SIZE, (start + stop) // 2, stop - 1):
            lost = unsynced[:start] + bytes(stop - start) + unsynced[stop:]  # a lost page, say
            for image in (flipped(unsynced, offset, offset % 8), lost):
                records, report, after = one_segment.recover_image(image)
                assert as_entries(records) == entries[:j], (j, offset)
                assert after == zeroed_from(data, start), (j, offset)  # nothing of the torn write is left
                if image is lost and j == len(entries) - 1:
                    assert report.truncated == []  # the last record lost whole: the clean end
                else:
                    assert len(report.truncated) == 1, (j, offset)
                    assert f"cut at offset {start}" in report.truncated[0], (j, offset)
    # the writer goes on where the cut was, and the next recovery is clean
    more = make_entries(3, seed=3)
    write_journal(one_segment.work, more)
    records, report = recover(one_segment.work)
    assert as_entries(records) == entries[: len(entries) - 1] + more
    assert report.truncated == []


@pytest.mark.usefixtures("no_sync")
def test_damage_with_records_behind_it_in_a_journal_without_synced_records_refuses_to_start(tmp_path: Path) -> None:
    """A journal an earlier version wrote says nothing of what was synced: damage with valid records behind
    it stops the node there, as it always did."""
    entries = make_entries(10)
    data = b"".join(encode(kind, payload) for kind, payload in entries)
    bounds = [r.offset for r in scan(data)]
    (tmp_path / segment_name(1)).write_bytes(data[: bounds[4]] + bytes(bounds[5] - bounds[4]) + data[bounds[5] :])
    with pytest.raises(JournalCorruptedError, match="zeros at offset"):
        recover(tmp_path)
    (tmp_path / segment_name(1)).write_bytes(flipped(data, bounds[8] + HEADER_SIZE, 1))
    with pytest.raises(JournalCorruptedError, match="CRC mismatch"):
        recover(tmp_path)
    # once this version has started on it, its writes are marked
    (tmp_path / segment_name(1)).write_bytes(data)
    write_journal(tmp_path, make_entries(2, seed=4), one_batch=True)
    assert [r.type for r in scan((tmp_path / segment_name(1)).read_bytes()) if isinstance(r, Record)][10:] == [
        RecordType.SYNCED,
        *[kind for kind, _ in make_entries(2, seed=4)],
        RecordType.SYNCED,
    ]


@pytest.mark.usefixtures("no_sync")
def test_damage_in_a_segment_followed_by_a_segment_with_records_refuses_to_start(tmp_path: Path) -> None:
    write_journal(tmp_path, make_entries(120), SMALL_SEGMENT)
    segments = list_segments(tmp_path)
    assert len(segments) >= 2
    first = segments[0].read_bytes()
    last_start = boundaries(first)[-2]  # the last record of the first segment: nothing follows it there
    segments[0].write_bytes(flipped(first, last_start + HEADER_SIZE + 1, 3))
    with pytest.raises(JournalCorruptedError, match=segments[0].name):
        recover(tmp_path, SMALL_SEGMENT)


@pytest.mark.usefixtures("no_sync")
@pytest.mark.parametrize("damage", ["deleted", "emptied"])
def test_a_middle_segment_deleted_or_emptied_refuses_to_start(tmp_path: Path, damage: str) -> None:
    """The node started on the rest, its confirmed records in that segment gone without a word, and `data verify`
    called the journal ok."""
    write_journal(tmp_path, make_entries(200), SMALL_SEGMENT)
    segments = list_segments(tmp_path)
    assert len(segments) >= 3
    middle = segments[1]
    if damage == "deleted":
        middle.unlink()
    else:
        middle.write_bytes(b"")
    with pytest.raises(JournalCorruptedError, match=middle.name):
        recover(tmp_path, SMALL_SEGMENT)
    assert data_tools.verify(tmp_path) == 1


@pytest.mark.usefixtures("no_sync")
@pytest.mark.parametrize("stray", ["journal-1.tmq", "journal-00000001 (copy).tmq"])
def test_a_file_named_like_a_segment_but_not_one_refuses_to_start(tmp_path: Path, stray: str) -> None:
    """A partial copy left as journal-1.tmq was read as segment 1 and cut as a torn tail, and the writer then went
    on in the real journal-00000001.tmq at that offset, over confirmed records; another name failed with a bare
    ValueError."""
    write_journal(tmp_path, make_entries(200), SMALL_SEGMENT)
    first = list_segments(tmp_path)[0]
    (tmp_path / stray).write_bytes(first.read_bytes()[:1000])
    before = first.read_bytes()
    with pytest.raises(JournalCorruptedError, match="not a journal segment's name"):
        recover(tmp_path, SMALL_SEGMENT)
    assert first.read_bytes() == before
    assert data_tools.verify(tmp_path) == 1
    (tmp_path / stray).unlink()
    assert len(recover(tmp_path, SMALL_SEGMENT)[0]) == 200


@pytest.mark.usefixtures("no_sync")
def test_damage_in_the_last_record_of_the_last_segment_is_cut_off_unless_it_was_synced(tmp_path: Path) -> None:
    entries = make_entries(120)
    write_journal(tmp_path, entries, SMALL_SEGMENT)
    assert len(list_segments(tmp_path)) >= 2
    last_segment = list_segments(tmp_path)[-1]
    data = last_segment.read_bytes()
    bounds = boundaries(data)
    damaged = flipped(data, bounds[-2] + HEADER_SIZE + 1, 3)
    last_segment.write_bytes(damaged)  # the SYNCED record behind it says it was on disk
    with pytest.raises(JournalCorruptedError, match=last_segment.name):
        recover(tmp_path, SMALL_SEGMENT)
    last_segment.write_bytes(zeroed_from(damaged, bounds[-1]))  # the power failed before its sync completed
    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == entries[:-1]
    assert len(report.truncated) == 1
    assert last_segment.name in report.truncated[0]


@pytest.mark.usefixtures("no_sync")
def test_a_torn_write_across_a_roll_is_cut_off_in_the_segment_it_went_on_in(tmp_path: Path) -> None:
    """A batch that filled one segment and went on in the next: the writer synced the first segment whole
    before it wrote to the next, so a power cut tears the batch only there; the cut keeps the first whole."""
    synced = make_entries(5)
    write_journal(tmp_path, synced, SMALL_SEGMENT, one_batch=True)
    batch = [(RecordType.MESSAGE, [wire_message(100 + i, random.Random(i).randbytes(900)), ["q"]]) for i in range(10)]
    write_journal(tmp_path, batch, SMALL_SEGMENT, one_batch=True)
    segments = list_segments(tmp_path)
    assert len(segments) >= 2
    kept = -len(synced)
    for path in segments[:-1]:
        kept += sum(1 for r in scan(path.read_bytes()) if isinstance(r, Record) and r.type is not RecordType.SYNCED)
    assert 0 < kept <= len(batch) - 2
    written = segments[-1].read_bytes()
    bounds = boundaries(written)
    # the power failed before the batch's sync: no SYNCED record behind it, and a lost page in its first record
    torn = zeroed_from(written, bounds[-1])
    segments[-1].write_bytes(torn[: bounds[0]] + bytes(200) + torn[bounds[0] + 200 :])
    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == synced + batch[:kept]
    assert [p.name for p in list_segments(tmp_path)] == [p.name for p in segments]
    assert len(report.truncated) == 1
    more = make_entries(12, seed=8)
    write_journal(tmp_path, more, SMALL_SEGMENT)
    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == synced + batch[:kept] + more
    assert report.truncated == []


def test_damage_in_a_segment_another_one_with_records_follows_refuses_to_start(tmp_path: Path) -> None:
    """The writer syncs a segment whole before it writes to the next one: damage in it is no torn write, but
    records that may have been confirmed, even when the SYNCED record the last sync wrote never reached the
    disk (a power cut right after the batch was confirmed)."""
    synced = make_entries(5)
    write_journal(tmp_path, synced, SMALL_SEGMENT, one_batch=True)
    batch = [(RecordType.MESSAGE, [wire_message(100 + i, random.Random(i).randbytes(900)), ["q"]]) for i in range(8)]
    confirmed = write_journal(tmp_path, batch, SMALL_SEGMENT, one_batch=True)
    assert confirmed[-1] == len(synced) + len(batch)  # every record of the batch was reported safe
    segments = list_segments(tmp_path)
    assert len(segments) >= 2
    for path in segments[-1:]:  # the SYNCED record written after the batch's sync was lost with the power
        written = path.read_bytes()
        path.write_bytes(zeroed_from(written, boundaries(written)[-1]))
    first = segments[0].read_bytes()
    bounds = boundaries(first)
    for damaged in (first[: bounds[6]] + bytes(200) + first[bounds[6] + 200 :], flipped(first, bounds[6] + 20, 3)):
        segments[0].write_bytes(damaged)
        with pytest.raises(JournalCorruptedError, match=segments[0].name):
            recover(tmp_path, SMALL_SEGMENT)
        assert [p.name for p in list_segments(tmp_path)] == [p.name for p in segments]  # the evidence stays
        assert segments[0].read_bytes() == damaged


@pytest.mark.usefixtures("no_sync")
def test_a_torn_tail_followed_only_by_an_empty_segment_is_cut_off(tmp_path: Path) -> None:
    """A crash right after a new segment was created: the newer segment holds only zeros."""
    entries = make_entries(12)
    write_journal(tmp_path, entries, SMALL_SEGMENT)
    [path] = list_segments(tmp_path)
    data = path.read_bytes()
    bounds = boundaries(data)
    path.write_bytes(zeroed_from(data, bounds[-2] + 3))
    (tmp_path / segment_name(2)).write_bytes(bytes(SMALL_SEGMENT))
    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == entries[:-1]
    assert len(report.truncated) == 1
    write_journal(tmp_path, entries[-1:], SMALL_SEGMENT)  # the writer continues in the newest segment
    assert as_entries(recover(tmp_path, SMALL_SEGMENT)[0]) == entries
    assert len(boundaries((tmp_path / segment_name(2)).read_bytes())) == 2  # one record, in segment 2


@pytest.mark.usefixtures("no_sync")
def test_zeroed_records_with_valid_records_behind_them_refuse_to_start(one_segment: OneSegment) -> None:
    """A zeroed record header with valid records behind it is damage, not the clean end of the segment.

    Zeroing record 10 (of 30) leaves records 11..30 valid behind it, and damage with valid records behind it
    stops the node. (A regression test: recovery used to take the zeros for the end, return records 1..9 and
    put the writer at record 10's offset, dropping 10..30 silently; after one more append and a clean close
    the next recovery then hit the remains of the old records and refused a cleanly shut down journal.)
    """
    data, bounds = one_segment.data, one_segment.bounds
    hole = data[: bounds[9]] + bytes(bounds[10] - bounds[9]) + data[bounds[10] :]
    try:
        records, report, _ = one_segment.recover_image(hole)
    except JournalCorruptedError:
        return
    pytest.fail(f"recovered {len(records)} of 30 records without error; truncated={report.truncated}")


def test_the_journal_lock_stays_with_the_journal_across_an_offline_compaction(tmp_path: Path) -> None:
    """`data compact` holds the journal lock while it swaps the directory by two renames: the lock belongs to
    the journal's path, not to the directory moved away, so a node starting meanwhile is still refused."""
    directory = tmp_path / "journal"
    journal = Journal(directory, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    journal.start()
    journal.append(RecordType.ADD_QUEUE, [queue_spec("q")])
    journal.close()
    lock = JournalLock(directory)
    try:
        compact_offline(directory, SMALL_SEGMENT)
        with pytest.raises(JournalLockedError):
            JournalLock(tmp_path / "." / "journal")  # named differently, as a node's setting may
    finally:
        lock.release()
    JournalLock(directory).release()


# ---------------------------------------------------------------------------------------------------- power loss
class PowerLossDisk:
    """A disk whose page cache is lost on power failure.

    Wraps ``os.fdatasync``: a completed sync of a segment makes that file's current bytes durable. After
    ``hold()`` the next sync stalls the writer thread before syncing (its batch written but not yet durable)
    until ``release()``; ``image()`` is then what a power cut would leave on disk.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self.directory = directory.resolve()
        self._real_fdatasync = os.fdatasync
        self._durable: dict[str, bytes] = {}
        self._gate = threading.Event()
        self._gate.set()
        self.stalled = threading.Event()
        self.stalled_on: str | None = None  # the segment whose sync is stalled
        monkeypatch.setattr(journal_module.os, "fdatasync", self._fdatasync)

    def _fdatasync(self, fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not self._gate.is_set():
            self.stalled_on = path.name
            self.stalled.set()
            if not self._gate.wait(WAIT):
                raise OSError("the test never released the stalled sync")
        self._real_fdatasync(fd)
        if path.parent == self.directory:
            self._durable[path.name] = path.read_bytes()

    def assume(self, image: dict[str, bytes]) -> None:
        """Start from ``image`` as what the disk holds (a restarted node's directory, as a power cut would find it)."""
        self._durable.update(image)

    def hold(self) -> None:
        self.stalled.clear()
        self.stalled_on = None
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def image(self) -> dict[str, bytes]:
        """Only synced bytes survive; a segment created but never synced comes back empty."""
        return {p.name: self._durable.get(p.name, b"") for p in list_segments(self.directory)}

    def torn_image(self, rng: random.Random) -> dict[str, bytes]:
        """As ``image``, but the stalled segment's unsynced writes reached the disk up to a random offset."""
        image = self.image()
        assert self.stalled_on is not None
        live = (self.directory / self.stalled_on).read_bytes()
        durable = image[self.stalled_on].ljust(len(live), b"\0")
        cut = rng.randint(0, len(live))
        image[self.stalled_on] = live[:cut] + durable[cut:]
        return image


def restore(image: dict[str, bytes], directory: Path) -> Path:
    directory.mkdir()
    for name, data in image.items():
        (directory / name).write_bytes(data)
    return directory


@dataclass
class PowerCut:
    image: dict[str, bytes]
    torn: dict[str, bytes]
    live: dict[str, bytes]  # the files as the page cache had them: includes the stalled, unsynced batch
    reported: int  # the highest number on_synced had reported
    appended: int


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the journal writer"
        time.sleep(0.001)


def test_power_loss_keeps_exactly_what_was_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "journal"
    disk = PowerLossDisk(monkeypatch, directory)
    journal = Journal(directory, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    reported: list[int] = []
    journal.on_synced = reported.append
    journal.start()
    rng = random.Random(5)
    appended: list[Entry] = []

    def append(count: int) -> None:
        for _ in range(count):
            entry = make_entry(len(appended), rng)
            assert journal.append(*entry) == len(appended) + 1
            appended.append(entry)

    cuts: list[PowerCut] = []
    for _ in range(8):
        append(rng.randint(0, 20))  # the writer runs freely
        wait_until(lambda: journal.synced == len(appended))
        disk.hold()
        append(rng.randint(1, 8))  # the writer takes (some of) these, writes them and stalls in the sync
        assert disk.stalled.wait(WAIT)
        append(rng.randint(0, 5))  # queued in memory only
        live = {p.name: p.read_bytes() for p in list_segments(directory)}
        cuts.append(PowerCut(disk.image(), disk.torn_image(rng), live, max(reported, default=0), len(appended)))
        disk.release()
    journal.close()
    assert journal.error is None
    assert reported == sorted(set(reported))
    assert reported[-1] == len(appended)

    page_cache_ahead = 0
    for n, cut in enumerate(cuts):
        # nothing but synced bytes: exactly the records on_synced reported, never one it had not
        records, report = recover(restore(cut.image, tmp_path / f"image-{n}"), SMALL_SEGMENT)
        assert as_entries(records) == appended[: cut.reported], n
        assert report.truncated == [], n
        # the unsynced batch partly on disk: a prefix, at least the reported records, maybe a torn tail
        records, _ = recover(restore(cut.torn, tmp_path / f"torn-{n}"), SMALL_SEGMENT)
        assert cut.reported <= len(records) <= cut.appended, n
        assert as_entries(records) == appended[: len(records)], n
        # the page cache holds at least as much as the disk image
        records, _ = recover(restore(cut.live, tmp_path / f"live-{n}"), SMALL_SEGMENT)
        assert cut.reported <= len(records) <= cut.appended, n
        assert as_entries(records) == appended[: len(records)], n
        page_cache_ahead += len(records) > cut.reported
    # and at most power cuts it held more: the simulation did drop written but unsynced records
    assert page_cache_ahead >= len(cuts) // 2

    # a node restarted on a power-cut image carries on writing after the synced prefix
    survivor = tmp_path / f"torn-{len(cuts) - 1}"
    kept = as_entries(recover(survivor, SMALL_SEGMENT)[0])
    more = make_entries(30, seed=11)
    write_journal(survivor, more, SMALL_SEGMENT)
    records, report = recover(survivor, SMALL_SEGMENT)
    assert as_entries(records) == kept + more
    assert report.truncated == []


@pytest.mark.usefixtures("no_sync")
def test_a_bit_flip_in_a_batch_that_filled_its_segment_refuses_to_start(tmp_path: Path) -> None:
    """A batch that ends where its segment ends leaves no room for the SYNCED record its sync writes: nothing
    then says it was synced (no later segment either, on a node that wrote nothing more), and a flipped bit in
    it would be taken for a torn write and cut off with the confirmed records behind it."""
    entries = make_entries(8)
    marker = len(encode(RecordType.SYNCED, []))
    segment_bytes = marker + sum(len(encode(kind, payload)) for kind, payload in entries)  # start's, then these
    confirmed = write_journal(tmp_path, entries, segment_bytes, one_batch=True)
    assert confirmed[-1] == len(entries)
    path = list_segments(tmp_path)[0]
    data = path.read_bytes()
    bounds = boundaries(data)
    path.write_bytes(flipped(data, bounds[2] + HEADER_SIZE, 1))
    with pytest.raises(JournalCorruptedError, match=path.name):
        recover(tmp_path, segment_bytes)


def test_a_bit_flip_in_the_last_batch_refuses_to_start_after_a_clean_close_and_a_power_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` confirmed the last batch: the SYNCED record written after its sync must reach the disk too, or a
    power cut after a clean stop leaves that batch with nothing behind it to say it was synced, and a flipped bit
    in it would be taken for a torn write and cut off with the confirmed records behind it."""
    directory = tmp_path / "journal"
    disk = PowerLossDisk(monkeypatch, directory)
    entries = make_entries(8)
    confirmed = write_journal(directory, entries, one_batch=True)
    assert confirmed[-1] == len(entries)
    [path] = list_segments(directory)
    image = disk.image()[path.name]  # what the disk holds when the power fails after the node stopped
    bounds = boundaries(image)
    restored = restore({path.name: flipped(image, bounds[2] + HEADER_SIZE, 1)}, tmp_path / "after-power-cut")
    with pytest.raises(JournalCorruptedError, match=path.name):
        recover(restored)


@dataclass
class HeldBatch:
    """Five records synced, then a batch written whose sync had not completed: what the page cache and what the
    disk held then."""

    synced: list[Entry]
    batch: list[Entry]  # a 6 KB message (its header alone on its first page), an ACK and a DELETE_QUEUE
    path: Path  # the segment
    page_cache: bytes
    on_disk: dict[str, bytes]


def crash_during_a_sync(directory: Path, monkeypatch: pytest.MonkeyPatch) -> HeldBatch:
    """Write five records and sync them, then a batch, and take the pictures while its sync stalls; the journal
    is closed afterwards (the pictures are what a crash at that moment leaves)."""
    disk = PowerLossDisk(monkeypatch, directory)
    synced = make_entries(5)
    journal = Journal(directory)
    journal.recover()
    journal.start()
    journal.append_encoded([encode(kind, payload) for kind, payload in synced])
    wait_until(lambda: journal.synced == 5)
    batch: list[Entry] = [
        (RecordType.MESSAGE, [wire_message(6, random.Random(6).randbytes(6000)), ["queue.a"]]),
        (RecordType.ACK, ["queue.a", 2]),
        (RecordType.DELETE_QUEUE, ["queue.b"]),
    ]
    disk.hold()
    journal.append_encoded([encode(kind, payload) for kind, payload in batch])
    assert disk.stalled.wait(WAIT)
    [path] = list_segments(directory)
    held = HeldBatch(synced, batch, path, path.read_bytes(), disk.image())
    disk.release()
    journal.close()
    return held


def test_a_power_cut_while_a_restarted_node_syncs_what_it_recovered_never_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process died with a batch written but not synced: the restarted node reads it from the page cache, and
    ``start`` syncs it before writing a SYNCED record behind it. Were the record written first, a power cut
    during that sync could leave it on disk with the batch's first page lost: damage a SYNCED record covers,
    and a node that refuses to start though it lost nothing it had confirmed."""
    held = crash_during_a_sync(tmp_path / "crashed", monkeypatch)  # the process dies, the machine runs on
    synced_entries, batch, path, page_cache, on_disk = held.synced, held.batch, held.path, held.page_cache, held.on_disk
    directory = restore({path.name: page_cache}, tmp_path / "journal")
    disk = PowerLossDisk(monkeypatch, directory)
    disk.assume(on_disk)
    restarted = Journal(directory)
    records, _ = restarted.recover(list)
    assert as_entries(records) == synced_entries + batch
    disk.hold()
    starting = threading.Thread(target=restarted.start)
    starting.start()
    try:
        assert disk.stalled.wait(WAIT)
        live = (directory / path.name).read_bytes()  # the power fails during this sync
    finally:
        disk.release()
        starting.join()
        restarted.close()
    bounds = boundaries(page_cache)
    page = 4096
    lost_page = bounds[5] // page * page  # the batch's first page did not reach the disk, later ones did
    assert lost_page + page <= bounds[6]
    image = bytearray(live)
    image[lost_page : lost_page + page] = on_disk[path.name][lost_page : lost_page + page]
    records, report = recover(restore({path.name: bytes(image)}, tmp_path / "after-power-cut"))
    assert as_entries(records) == synced_entries
    assert len(report.truncated) == 1


def test_power_loss_with_pages_written_back_out_of_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsynced pages reach the disk in any order: records the restarted node never wrote never come back.

    Records 1..5 are synced; the next batch R6 (a 6 KB message), R7, R8 is written but not synced when the
    power fails, and the page holding R6's header is lost while the later pages holding R7 and R8 survive.
    Recovery must start with 1..5 (nothing after 5 was confirmed), and must not leave R7 and R8 behind the
    zeros to be found later: after the producer resends R6 (the same bytes) and the node closes cleanly, the
    next recovery must not return them (an ACK or DELETE_QUEUE replayed out of nowhere). Refusing to start,
    as it did before the writer marked its syncs, would stop a node that lost nothing it had confirmed.
    """
    held = crash_during_a_sync(tmp_path / "journal", monkeypatch)
    synced_entries, batch, path, live = held.synced, held.batch, held.path, held.page_cache
    synced_image = held.on_disk[path.name]
    bounds = boundaries(live)
    r6, r7 = bounds[5], bounds[6]
    page = 4096
    assert r6 // page < r7 // page  # R6's header and R7 lie on different pages
    lost_page = r6 // page * page
    image = bytearray(live)
    image[lost_page : lost_page + page] = synced_image[lost_page : lost_page + page]  # its old, synced content
    restored = restore({path.name: bytes(image)}, tmp_path / "after-power-cut")

    records, report = recover(restored)
    assert as_entries(records) == synced_entries
    assert len(report.truncated) == 1
    write_journal(restored, batch[:1])  # the unconfirmed message is published again
    records, report = recover(restored)
    assert as_entries(records) == [*synced_entries, batch[0]]
    assert report.truncated == []


# ---------------------------------------------------------------------------------------------------- replay
def rec(record_type: RecordType, *payload: Any) -> Record:
    return Record(0, record_type, list(payload))


def queue_spec(name: str, address: str = "orders") -> dict[str, Any]:
    return {"name": name, "address": address, "routing_type": 0}


def test_replay_addresses_and_queues() -> None:
    state = replay(
        [
            rec(RecordType.ADD_ADDRESS, "orders", [0]),
            rec(RecordType.ADD_ADDRESS, "events", [1]),
            rec(RecordType.ADD_ADDRESS, "orders", [0, 1], 1),  # re-added: other routing types, auto-created
            rec(RecordType.DELETE_ADDRESS, "events"),
            rec(RecordType.DELETE_ADDRESS, "never-added"),
            rec(RecordType.ADD_QUEUE, queue_spec("q1")),
            rec(RecordType.ADD_QUEUE, queue_spec("q2")),
            rec(RecordType.ADD_QUEUE, queue_spec("q3")),
            rec(RecordType.DELETE_QUEUE, "q2"),
            rec(RecordType.DELETE_QUEUE, "never-added"),
        ]
    )
    # Records written before the auto-created flag existed read as not auto-created.
    assert state.addresses == {"orders": ([0, 1], True)}
    assert list(state.queues) == ["q1", "q3"]
    assert state.queues["q1"] == queue_spec("q1")
    assert state.queue_counts() == {"q1": 0, "q3": 0}
    assert state.live_messages() == 0
    assert state.messages == {}


def queues_a_and_b_with(*placed: tuple[WireMessage, list[str]]) -> list[Record]:
    """Records of queues "a" and "b" and of messages placed in them."""
    return [
        rec(RecordType.ADD_QUEUE, queue_spec("a")),
        rec(RecordType.ADD_QUEUE, queue_spec("b")),
        *(rec(RecordType.MESSAGE, message, queues) for message, queues in placed),
    ]


def test_replay_messages_acks_and_delivery_counts() -> None:
    m1, m2, m3, m4 = (wire_message(n) for n in (1, 2, 3, 4))
    state = replay(
        [
            *queues_a_and_b_with((m1, ["a", "b"]), (m2, ["a"]), (m3, ["b"]), (m4, ["a"])),
            rec(RecordType.ACK, "a", 1),  # m1 still referenced by b
            rec(RecordType.ACK, "b", 3),  # m3's only reference: dropped
            rec(RecordType.DELIVERY_COUNT, "a", 2, 1),
            rec(RecordType.DELIVERY_COUNT, "a", 2, 3),
            rec(RecordType.DELIVERY_COUNT, "b", 2, 5),  # m2 is not on b: ignored
            rec(RecordType.DELIVERY_COUNT, "a", 1, 9),  # m1 was acked on a: ignored
            rec(RecordType.ACK, "a", 99),  # unknown message: ignored
        ]
    )
    assert state.references == {"a": {2: 3, 4: 0}, "b": {1: 0}}
    assert list(state.references["a"]) == [2, 4]  # publish order
    assert state.messages == {1: m1, 2: m2, 4: m4}
    assert state.queue_counts() == {"a": 2, "b": 1}
    assert state.live_messages() == 3


def test_replay_batched_acks_and_delivery_counts_as_the_single_records() -> None:
    """A consumer's batch is one ACKS or DELIVERY_COUNTS record; older journals hold one record per message."""
    m1, m2, m3, m4 = (wire_message(n) for n in (1, 2, 3, 4))
    state = replay(
        [
            *queues_a_and_b_with((m1, ["a", "b"]), (m2, ["a"]), (m3, ["a"]), (m4, ["a"])),
            rec(RecordType.DELIVERY_COUNTS, "a", [1, 2, 3, 99], [1, 1, 2, 7]),  # 99: unknown, ignored
            rec(RecordType.DELIVERY_COUNTS, "b", [2], [5]),  # m2 is not on b: ignored
            rec(RecordType.ACKS, "a", [1, 3, 99]),  # m1 stays on b
            rec(RecordType.DELIVERY_COUNT, "a", 4, 2),  # an older journal's record, mixed in
            rec(RecordType.ACKS, "ghost", [2]),  # a queue that is gone: ignored
        ]
    )
    assert state.references == {"a": {2: 1, 4: 2}, "b": {1: 0}}
    assert state.messages == {1: m1, 2: m2, 4: m4}


def test_replay_applies_a_transaction_at_its_commit_and_drops_one_never_committed() -> None:
    m1, m2, m3, m4 = (wire_message(n) for n in (1, 2, 3, 4))
    state = replay(
        [
            rec(RecordType.ADD_QUEUE, queue_spec("a")),
            rec(RecordType.MESSAGE, m1, ["a"]),
            rec(RecordType.TX_MESSAGE, 7, m2, ["a"]),
            rec(RecordType.TX_ACK, 7, "a", 1),
            rec(RecordType.TX_MESSAGE, 8, m3, ["a"]),  # transaction 8: its commit never reached the disk
            rec(RecordType.TX_ACK, 8, "a", 2),
            rec(RecordType.TX_COMMIT, 7),
            rec(RecordType.MESSAGE, m4, ["a"]),
        ]
    )
    assert state.references == {"a": {2: 0, 4: 0}}
    assert state.messages == {2: m2, 4: m4}
    assert state.uncommitted == 1


def test_a_large_batch_of_acks_or_attempts_is_split_into_records_that_fit_a_segment(tmp_path: Path) -> None:
    """A consumer can acknowledge, or be sent, far more messages at once than one record should hold: the
    batch goes in records of at most IDS_PER_RECORD ids, and the attempts' token is the last one's."""
    journal = Journal(tmp_path, segment_bytes=256 * 1024)
    journal.recover()
    journal.start()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    count = 2 * IDS_PER_RECORD + 5
    store.add_queue(queue_spec("q"))
    for n in range(1, count + 1):
        store.add_message(wire_message(n), ("q",))
    ids = list(range(1, count + 1))
    token = store.update_delivery_counts("q", ids, [2] * count)
    assert token == journal.appended
    store.acknowledge("q", ids[: count - 1])
    assert store.update_delivery_counts("q", [], []) == 0
    journal.close()

    records, _ = recover(tmp_path, segment_bytes=256 * 1024)
    batches = [len(r.payload[1]) for r in records if r.type in (RecordType.ACKS, RecordType.DELIVERY_COUNTS)]
    assert batches == [IDS_PER_RECORD, IDS_PER_RECORD, 5, IDS_PER_RECORD, IDS_PER_RECORD, 4]
    assert replay(records).references == {"q": {count: 2}}


def test_batch_records_of_a_small_segment_hold_fewer_ids(tmp_path: Path) -> None:
    """Ids as large as they come (time-based, nine bytes in msgpack) and counts as well: every record still
    fits the segment, so a large batch never fails to be written."""
    segment = 32 * 1024
    journal = Journal(tmp_path, segment_bytes=segment)
    journal.recover()
    journal.start()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    ids = [(1 << 62) + n for n in range(IDS_PER_RECORD)]
    store.update_delivery_counts("q" * 200, ids, [1 << 40] * len(ids))
    store.acknowledge("q" * 200, ids)
    journal.close()
    records, _ = recover(tmp_path, segment_bytes=segment)
    assert sum(len(r.payload[1]) for r in records) == 2 * IDS_PER_RECORD
    assert len(records) > 2
    assert ids_per_record(segment) < IDS_PER_RECORD


def test_a_transaction_counts_only_once_its_commit_is_synced(tmp_path: Path) -> None:
    """The commit's token completes after the sync that covers the commit record, and a power cut before
    that sync leaves none of the transaction: replay never sees half of one."""
    journal = Journal(tmp_path)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    completed: list[int] = []
    done = threading.Event()

    def on_durable(token: int) -> None:
        completed.append(token)
        if token == commit_token:
            done.set()

    commit_token = -1
    store.attach(on_durable)
    store.add_queue(queue_spec("q"))
    store.add_message(wire_message(1), ("q",))
    store.begin_transaction()
    assert store.add_message(wire_message(2), ("q",)) == 0  # only the commit's token is worth waiting for
    store.add_message(wire_message(3), ("q",))
    store.acknowledge("q", [1])
    token = commit_token = store.commit_transaction()
    assert token > 0
    store.begin_transaction()
    assert store.commit_transaction() == 0  # an empty transaction writes nothing
    journal.start()
    assert done.wait(WAIT)
    journal.close()
    assert completed[-1] == token
    state = replay(recover(tmp_path)[0])
    assert state.references == {"q": {2: 0, 3: 0}}
    assert state.uncommitted == 0
    # Without the commit record (cut off as a power loss before its sync would), none of it counts.
    records = [r for r in recover(tmp_path)[0] if r.type is not RecordType.TX_COMMIT]
    assert replay(records).references == {"q": {1: 0}}


def test_publishes_written_through_elsewhere_are_known_after_a_restart_and_a_rewrite(tmp_path: Path) -> None:
    """A durable publish written through to another node leaves no message record here, only its producer's
    id and that node's: the next life of this node (restarted, or its backup, which copies these records)
    must know them, also after the journal is rewritten to its live state."""
    journal = Journal(tmp_path / "j")
    journal.recover()
    journal.start()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    store.note_through([("producer-7", "node-2", 1_700_000_000_000)])
    many = [(f"producer-{n:06d}", "node-3", 1_700_000_000_001) for n in range(20_000)]  # a turn of many
    before = journal.appended
    store.note_through(many)
    assert journal.appended > before + 1  # in records that each fit a segment
    journal.close()
    through = replay(recover(tmp_path / "j")[0]).through_ids
    assert through["producer-7"] == ("node-2", 1_700_000_000_000)
    assert len(through) == 1 + len(many)
    write_live_state(tmp_path / "j", tmp_path / "fresh")
    assert replay(recover(tmp_path / "fresh")[0]).through_ids == through


def test_replay_remembers_dedup_ids_of_acknowledged_messages_newest_within_the_limit() -> None:
    def stamped(n: int) -> list[Any]:
        message = wire_message(n)
        message[M_DEDUP], message[M_TIMESTAMP] = f"p:{n}", 100 * n
        return message

    records = [
        rec(RecordType.ADD_QUEUE, queue_spec("a")),
        rec(RecordType.DEDUP_IDS, ["old:1", 5], ["old:2", 6]),
        *(rec(RecordType.MESSAGE, stamped(n), ["a"]) for n in (1, 2, 3)),
        rec(RecordType.ACK, "a", 1),
        rec(RecordType.ACK, "a", 2),
        rec(RecordType.TX_MESSAGE, 9, stamped(4), ["a"]),  # never committed: its id was never accepted
    ]
    state = replay(records)
    assert state.dedup_ids == {"old:1": 5, "old:2": 6, "p:1": 100, "p:2": 200, "p:3": 300}
    assert list(state.messages) == [3]
    assert list(replay(records, dedup_limit=2).dedup_ids) == ["p:2", "p:3"]


def test_replay_keeps_the_newest_ids_when_the_journal_holds_far_more_than_the_limit() -> None:
    """Trimmed in batches: one deletion from the front of the dict per id made this quadratic."""
    records = [rec(RecordType.DEDUP_IDS, *([f"id:{n}", n] for n in range(i, i + 1000))) for i in range(0, 20_000, 1000)]
    state = replay(records, dedup_limit=1500)
    assert list(state.dedup_ids) == [f"id:{n}" for n in range(18_500, 20_000)]


def test_replay_delete_queue_drops_its_references_and_unreferenced_messages() -> None:
    m1, m2 = wire_message(1), wire_message(2)
    state = replay(
        [
            rec(RecordType.ADD_QUEUE, queue_spec("a")),
            rec(RecordType.ADD_QUEUE, queue_spec("b")),
            rec(RecordType.MESSAGE, m1, ["a", "b"]),
            rec(RecordType.MESSAGE, m2, ["a"]),
            rec(RecordType.DELETE_QUEUE, "a"),
        ]
    )
    assert state.references == {"b": {1: 0}}
    assert state.messages == {1: m1}
    assert state.queue_counts() == {"b": 1}
    assert state.live_messages() == 1

    # a queue re-created under the same name starts empty
    state = replay(
        [
            rec(RecordType.ADD_QUEUE, queue_spec("a")),
            rec(RecordType.MESSAGE, m1, ["a"]),
            rec(RecordType.DELETE_QUEUE, "a"),
            rec(RecordType.ADD_QUEUE, queue_spec("a", "other")),
        ]
    )
    assert state.queues == {"a": queue_spec("a", "other")}
    assert state.queue_counts() == {"a": 0}
    assert state.messages == {}


def test_replay_a_queue_spec_recorded_again_replaces_the_first_and_keeps_the_queue_in_place() -> None:
    m1 = wire_message(1)
    state = replay(
        [
            rec(RecordType.ADD_QUEUE, {**queue_spec("a"), "expires_ms": 1000}),
            rec(RecordType.ADD_QUEUE, queue_spec("b")),
            rec(RecordType.MESSAGE, m1, ["a"]),
            rec(RecordType.ADD_QUEUE, {**queue_spec("a"), "expires_ms": 5000}),  # its expiry changed
        ]
    )
    assert list(state.queues) == ["a", "b"]
    assert state.queues["a"]["expires_ms"] == 5000
    assert state.references == {"a": {1: 0}, "b": {}}


def test_replay_ignores_records_for_unknown_queues() -> None:
    m1, m2 = wire_message(1), wire_message(2)
    state = replay(
        [
            rec(RecordType.MESSAGE, m1, ["later"]),  # before its queue exists
            rec(RecordType.ADD_QUEUE, queue_spec("later")),
            rec(RecordType.MESSAGE, m2, ["ghost", "later"]),
            rec(RecordType.ACK, "ghost", 2),
            rec(RecordType.DELIVERY_COUNT, "ghost", 2, 4),
            rec(RecordType.DELETE_QUEUE, "ghost"),
        ]
    )
    assert state.queues == {"later": queue_spec("later")}
    assert state.references == {"later": {2: 0}}
    assert state.messages == {2: m2}
    assert state.live_messages() == 1


def test_replay_of_compacted_messages_restores_delivery_counts() -> None:
    m1 = wire_message(1)
    state = replay(
        [
            rec(RecordType.ADD_QUEUE, queue_spec("a")),
            rec(RecordType.ADD_QUEUE, queue_spec("b")),
            rec(RecordType.MESSAGE, m1, ["a", "b"], [2, 0]),
            rec(RecordType.COMPACTED, 3),
        ]
    )
    assert state.references == {"a": {1: 2}, "b": {1: 0}}


def test_replay_of_a_recovered_journal(tmp_path: Path) -> None:
    m1, m2 = wire_message(1, b"one"), wire_message(2, b"two")
    entries: list[Entry] = [
        (RecordType.ADD_ADDRESS, ["orders", [0]]),
        (RecordType.ADD_QUEUE, [queue_spec("q")]),
        (RecordType.MESSAGE, [m1, ["q"]]),
        (RecordType.MESSAGE, [m2, ["q"]]),
        (RecordType.DELIVERY_COUNT, ["q", 2, 1]),
        (RecordType.ACK, ["q", 1]),
    ]
    write_journal(tmp_path, entries)
    state = replay(recover(tmp_path)[0])
    assert state.addresses == {"orders": ([0], False)}
    assert state.references == {"q": {2: 1}}
    assert state.messages == {2: m2}  # msgpack gives back the same list, bytes body included


def test_replay_drops_an_acknowledged_message_at_its_ack_not_at_the_end() -> None:
    """Replay holds the live state, not the history: a message leaves it with its last reference."""
    replayer = Replayer()
    for record in queues_a_and_b_with((wire_message(1), ["a"]), (wire_message(2), ["a"])):
        replayer.apply(record)
    replayer.apply(rec(RecordType.ACKS, "a", [1]))
    assert list(replayer.state.messages) == [2]
    replayer.apply(rec(RecordType.ACK, "a", 2))  # an older journal's single record does the same
    assert replayer.state.messages == {}
    assert replayer.finish().references == {"a": {}, "b": {}}


def test_replay_keeps_a_message_of_two_queues_until_both_acknowledged_it() -> None:
    m1 = wire_message(1)
    replayer = Replayer()
    for record in queues_a_and_b_with((m1, ["a", "b", "a"])):  # a queue named twice is one reference
        replayer.apply(record)
    replayer.apply(rec(RecordType.ACKS, "a", [1]))
    replayer.apply(rec(RecordType.ACKS, "a", [1]))  # again: no second reference to let go of
    assert replayer.state.messages == {1: m1}
    replayer.apply(rec(RecordType.DELETE_QUEUE, "b"))  # a deleted queue lets go of its messages too
    assert replayer.state.messages == {}
    # Published again under the same id (a compaction's copy): it is back, held by the queue it names.
    replayer.apply(rec(RecordType.ADD_QUEUE, queue_spec("b")))
    replayer.apply(rec(RecordType.MESSAGE, m1, ["a", "b"], [1, 2]))
    replayer.apply(rec(RecordType.MESSAGE, m1, ["b", "ghost"], [3]))  # copied again: still two references
    replayer.apply(rec(RecordType.ACK, "b", 1))
    assert replayer.state.messages == {1: m1}
    state = replayer.finish()
    assert state.references == {"a": {1: 1}, "b": {}}
    assert state.live_messages() == 1

    m2 = wire_message(2)
    replayer = Replayer()
    for record in [*queues_a_and_b_with((m2, ["a", "b"])), rec(RecordType.ADD_QUEUE, queue_spec("c"))]:
        replayer.apply(record)
    replayer.apply(rec(RecordType.MESSAGE, m2, ["c"]))  # a third queue, added later
    for queue in ("b", "c"):
        replayer.apply(rec(RecordType.ACKS, queue, [2]))
        assert replayer.state.messages == {2: m2}
    replayer.apply(rec(RecordType.ACKS, "a", [2]))
    assert replayer.state.messages == {}


def test_replay_stages_a_transaction_until_its_commit_and_drops_an_uncommitted_one() -> None:
    m1, m2, m3 = (wire_message(n) for n in (1, 2, 3))
    replayer = Replayer()
    for record in queues_a_and_b_with((m1, ["a"])):
        replayer.apply(record)
    replayer.apply(rec(RecordType.TX_MESSAGE, 7, m2, ["a", "b"]))
    replayer.apply(rec(RecordType.TX_ACK, 7, "a", 1))
    assert replayer.state.messages == {1: m1}  # nothing of it counts before its commit
    replayer.apply(rec(RecordType.TX_MESSAGE, 8, m3, ["a"]))  # transaction 8 never commits
    replayer.apply(rec(RecordType.TX_ACK, 8, "a", 2))
    replayer.apply(rec(RecordType.TX_COMMIT, 7))
    assert replayer.state.messages == {2: m2}  # m1 acknowledged by it, m2 published by it
    replayer.apply(rec(RecordType.ACKS, "a", [2]))
    assert replayer.state.messages == {2: m2}  # still on b
    replayer.apply(rec(RecordType.ACKS, "b", [2]))
    state = replayer.finish()
    assert state.messages == {}
    assert state.references == {"a": {}, "b": {}}
    assert state.uncommitted == 1


def test_replay_counts_deliveries_of_live_messages_only() -> None:
    replayer = Replayer()
    for record in queues_a_and_b_with((wire_message(1), ["a", "b"]), (wire_message(2), ["a"])):
        replayer.apply(record)
    replayer.apply(rec(RecordType.DELIVERY_COUNTS, "a", [1, 2], [1, 1]))
    replayer.apply(rec(RecordType.ACKS, "a", [1]))
    replayer.apply(rec(RecordType.DELIVERY_COUNTS, "a", [1, 2], [2, 2]))  # 1 left a: not counted there again
    replayer.apply(rec(RecordType.DELIVERY_COUNT, "b", 1, 4))
    state = replayer.finish()
    assert state.references == {"a": {2: 2}, "b": {1: 4}}
    assert sorted(state.messages) == [1, 2]


def test_replay_remembers_the_dedup_ids_of_messages_it_already_dropped() -> None:
    def stamped(n: int) -> list[Any]:
        message = wire_message(n)
        message[M_DEDUP], message[M_TIMESTAMP] = f"p:{n}", 100 * n
        return message

    replayer = Replayer(dedup_limit=3)
    replayer.apply(rec(RecordType.ADD_QUEUE, queue_spec("a")))
    for n in range(1, 5):
        replayer.apply(rec(RecordType.MESSAGE, stamped(n), ["a"]))
        replayer.apply(rec(RecordType.ACKS, "a", [n]))
        assert replayer.state.messages == {}  # gone at once, its id stays
    replayer.apply(rec(RecordType.TX_MESSAGE, 9, stamped(5), ["a"]))  # never committed: never accepted
    state = replayer.finish()
    assert state.messages == {}
    assert state.dedup_ids == {"p:2": 200, "p:3": 300, "p:4": 400}  # the newest within the limit


def test_replay_of_a_long_history_holds_the_live_messages_only() -> None:
    """Memory, not time: replaying 2,000 messages of 50 kB, each acknowledged right after, keeps about one
    of them (plus the few left live) at a time; holding them all until the end took 100 MB."""
    size = 50_000

    def history() -> Iterator[Record]:
        yield rec(RecordType.ADD_QUEUE, queue_spec("a"))
        for n in range(1, 2001):
            yield rec(RecordType.MESSAGE, wire_message(n, n.to_bytes(4, "big") + bytes(size - 4)), ["a"])
            if n % 500:  # every 500th stays
                yield rec(RecordType.ACKS, "a", [n])

    tracemalloc.start()
    try:
        state = replay(history())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sorted(state.messages) == [500, 1000, 1500, 2000]
    assert peak < 20 * size, f"replay peaked at {peak / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------------- JournalStore
def test_journal_store_completes_every_token_in_order_after_the_sync(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())  # completions run on the writer thread
    completed: list[int] = []
    threads: set[str] = set()
    done = threading.Event()
    tokens: list[int] = []

    def on_durable(token: int) -> None:
        completed.append(token)
        threads.add(threading.current_thread().name)
        if token == tokens[-1]:
            done.set()

    store.attach(on_durable)
    tokens.append(store.add_address("orders", (0,), auto_created=False))
    tokens.append(store.add_queue(queue_spec("q")))
    journal.start()
    for n in range(1, 61):
        tokens.append(store.add_message(wire_message(n, bytes(n)), ("q",)))
        if n % 3 == 0:
            store.acknowledge("q", [n - 1])
        if n % 5 == 0:
            tokens.append(store.update_delivery_counts("q", [n], [1]))
    # A completion for a token is found by the sync that covers it once the token is in the store's
    # queue; with completions running directly on the writer thread (not on the loop that called
    # add_message), one more sync after the last token makes sure the last one is seen.
    store.delete_address("unused")
    assert done.wait(WAIT), f"completed {len(completed)} of {len(tokens)}"
    journal.close()
    assert tokens == sorted(set(tokens))
    assert tokens[:3] == [1, 2, 3]  # record numbers: the address and the queue came first
    assert completed == tokens
    assert threads == {"journal-writer"}
    assert journal.synced == len(records := recover(tmp_path, SMALL_SEGMENT)[0])
    assert replay(records).queue_counts() == {"q": 60 - 20}


async def test_journal_store_completes_tokens_on_the_event_loop(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    journal = Journal(tmp_path)
    journal.recover()
    store = JournalStore(journal, call_in_loop=loop.call_soon_threadsafe)
    futures: dict[int, asyncio.Future[None]] = {}
    order: list[int] = []

    def on_durable(token: int) -> None:
        assert threading.current_thread() is threading.main_thread()
        order.append(token)
        futures.pop(token).set_result(None)

    store.attach(on_durable)
    journal.start()
    futures[store.add_queue(queue_spec("q"))] = loop.create_future()
    for n in range(1, 201):
        token = store.add_message(wire_message(n), ("q",))
        futures[token] = loop.create_future()
    pending = list(futures.values())
    await asyncio.wait_for(asyncio.gather(*pending), WAIT)
    assert order == list(range(1, 202))
    journal.close()


# ---------------------------------------------------------------------------------------------------- compaction
def test_compaction_does_not_bring_back_messages_of_a_queue_deleted_and_recreated_meanwhile(tmp_path: Path) -> None:
    """A queue deleted and created again while compaction copies gets nothing of the old one back.

    The snapshot holds queue "q" (address "orders") with message 1. While compaction copies, the broker
    deletes "q" and creates a new "q" on address "other"; after a restart the new queue must have its own
    address and no message. (A regression test: ``add_queue`` used to forget the deletion, so the copy wrote
    the old ADD_QUEUE spec and message 1 for "q" after the new queue's record.)
    """
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    journal.start()
    old_spec, new_spec = queue_spec("q", "orders"), queue_spec("q", "other")
    message = wire_message(1)
    store.add_address("orders", (0,), auto_created=False)
    store.add_queue(old_spec)
    store.add_message(message, ("q",))
    store.start_compaction(
        DurableSnapshot(addresses=[("orders", [0], False)], queues=[old_spec], messages=[(message, ["q"], [0])])
    )
    store.delete_queue("q")
    store.add_queue(new_spec)
    for _ in range(5):  # one chunk per call; a no-op once everything is copied
        store.compaction_step()
    journal.close()

    state = replay(recover(tmp_path, SMALL_SEGMENT)[0])
    assert state.queues == {"q": new_spec}
    assert state.queue_counts() == {"q": 0}
    assert state.messages == {}


def test_compaction_keeps_a_queue_spec_recorded_again_while_it_copies(tmp_path: Path) -> None:
    """The snapshot holds the old spec; the copy writes it after the new one, which must still win."""
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    journal.start()
    old_spec, new_spec = {**queue_spec("q"), "expires_ms": 1000}, {**queue_spec("q"), "expires_ms": -1}
    message = wire_message(1)
    store.add_address("orders", (0,), auto_created=False)
    store.add_queue(old_spec)
    store.add_message(message, ("q",))
    store.start_compaction(
        DurableSnapshot(addresses=[("orders", [0], False)], queues=[old_spec], messages=[(message, ["q"], [0])])
    )
    store.add_queue(new_spec)
    for _ in range(5):
        store.compaction_step()
    journal.close()

    state = replay(recover(tmp_path, SMALL_SEGMENT)[0])
    assert state.queues == {"q": new_spec}
    assert state.queue_counts() == {"q": 1}


def test_compaction_copies_the_live_state_forward_and_retires_old_segments(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    journal.start()
    spec = queue_spec("q")
    store.add_address("orders", (0,), auto_created=False)
    store.add_queue(spec)
    messages = [wire_message(n, bytes(200)) for n in range(1, 61)]
    for message in messages:
        store.add_message(message, ("q",))
    for n in range(1, 51):
        store.acknowledge("q", [n])
    last = store.update_delivery_counts("q", [55], [2])
    wait_until(lambda: journal.synced == last)
    assert len(journal.segments()) >= 3
    live = [(m, ["q"], [2 if m[M_ID] == 55 else 0]) for m in messages[50:]]
    remembered = [(f"producer:{n}", 1000 + n) for n in range(2500)]  # ids of messages long acknowledged
    store.start_compaction(
        DurableSnapshot(addresses=[("orders", [0], False)], queues=[spec], messages=live, dedup_ids=remembered)
    )
    store.acknowledge("q", [51])  # while copying: the copy must leave 51 out
    for _ in range(5):
        store.compaction_step()
    wait_until(lambda: store.compactions == 1)
    journal.close()
    assert min(int(p.name[8:16]) for p in list_segments(tmp_path)) > 1  # the old segments are gone

    state = replay(recover(tmp_path, SMALL_SEGMENT)[0])
    assert state.queues == {"q": spec}
    assert state.references == {"q": {n: (2 if n == 55 else 0) for n in range(52, 61)}}
    assert list(state.messages) == list(range(52, 61))
    assert list(state.dedup_ids.items()) == remembered


def test_compaction_retires_exactly_the_segments_before_its_roll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The roll is only queued when compaction starts (the writer may be busy syncing): what is retired is
    decided after the copy is synced, from the segment the roll really started, and the COMPACTED marker
    carries no segment number that could be stale."""
    directory = tmp_path / "journal"
    disk = PowerLossDisk(monkeypatch, directory)
    journal = Journal(directory, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    journal.start()
    spec = queue_spec("q")
    store.add_queue(spec)
    wait_until(lambda: journal.synced == 1)
    disk.hold()
    store.add_address("orders", (0,), auto_created=False)
    assert disk.stalled.wait(WAIT)  # the writer is syncing: the roll below waits in its queue
    store.start_compaction(DurableSnapshot(addresses=[("orders", [0], False)], queues=[spec], messages=[]))
    store.compaction_step()
    disk.release()
    wait_until(lambda: store.compactions == 1)
    journal.close()
    assert journal.rolled_to == 2
    [marker] = [r for r in recover(directory, SMALL_SEGMENT)[0] if r.type is RecordType.COMPACTED]
    assert marker.payload == []
    assert [p.name for p in list_segments(directory)] == [segment_name(n) for n in range(2, journal.rolled_to + 1)]


# ---------------------------------------------------------------------------------------------------- HA hooks
def test_tap_sees_every_appended_record_with_its_number_and_the_rolls(tmp_path: Path) -> None:
    write_journal(tmp_path, make_entries(3, seed=4))
    journal = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    journal.recover()
    seen: list[tuple[int, bytes]] = []
    journal.tap = lambda number, data: seen.append((number, data))
    journal.start()
    entries = make_entries(12, seed=5)
    numbers = [journal.append(*entry) for entry in entries[:6]]
    journal.roll()
    numbers += [journal.append(*entry) for entry in entries[6:]]
    journal.tap = None
    journal.append(RecordType.ACK, ["q", 1])  # no tap: nothing seen
    journal.close()
    assert numbers == list(range(4, 16))  # numbering continues after the recovered records
    # the roll is seen as an empty record without a number, where it was queued
    assert seen[6] == (0, b"")
    taken = seen[:6] + seen[7:]
    assert [number for number, _ in taken] == numbers
    assert [data for _, data in taken] == [encode(*entry) for entry in entries]
    assert as_entries(recover(tmp_path)[0])[3:15] == entries


def test_appended_counts_every_record_queued(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    assert journal.appended == 0
    journal.recover()
    journal.start()
    assert journal.append(RecordType.ACK, ["q", 1]) == journal.appended == 1
    journal.roll()  # a roll is no record
    assert journal.appended == 1
    assert journal.append_encoded([encode(RecordType.ACK, ["q", 2]), b"", encode(RecordType.ACK, ["q", 3])]) == 3
    assert journal.appended == 3
    assert journal.append_encoded([]) == 3
    assert journal.append_encoded([b""]) == 3  # an empty record is a roll
    journal.close()
    assert journal.synced == 3
    again = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    records, report = again.recover(list)
    again.close()
    assert again.appended == len(records) == 3
    assert report.segments == 4  # the first one, and one per roll (three)


def test_append_encoded_of_another_journals_records_recovers_identically(tmp_path: Path) -> None:
    """A backup writes its primary's stream (rolls included) as it came; recovery reads the same records, and
    the segments follow the primary's."""
    source = Journal(tmp_path / "source", segment_bytes=SMALL_SEGMENT)
    source.recover()
    stream: list[bytes] = []
    source.tap = lambda _number, data: stream.append(data)
    source.start()
    entries = make_entries(180, seed=11)  # several segments of 4 KB
    for index, entry in enumerate(entries):
        source.append(*entry)
        if index == 90:
            source.roll()
    source.close()

    copy = Journal(tmp_path / "copy", segment_bytes=SMALL_SEGMENT)
    copy.recover()
    synced: list[int] = []
    copy.on_synced = synced.append
    copy.start()
    numbers = [copy.append_encoded(stream[i : i + 17]) for i in range(0, len(stream), 17)]
    copy.close()
    assert numbers[-1] == copy.appended == len(entries)
    assert synced[-1] == len(entries)
    assert numbers == sorted(numbers)

    copied, report = recover(tmp_path / "copy", SMALL_SEGMENT)
    original = recover(tmp_path / "source", SMALL_SEGMENT)[0]
    assert as_entries(copied) == as_entries(original) == entries
    assert [r.offset for r in copied] == [r.offset for r in original]  # the same segment boundaries
    assert report.truncated == []
    assert [p.read_bytes() for p in list_segments(tmp_path / "copy")] == [
        p.read_bytes() for p in list_segments(tmp_path / "source")
    ]


def test_append_encoded_refuses_a_record_larger_than_a_segment_and_queues_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    journal.start()
    small = encode(RecordType.ACK, ["q", 1])
    big = encode(RecordType.MESSAGE, [wire_message(1, bytes(SMALL_SEGMENT)), ["q"]])
    with pytest.raises(ValueError, match="does not fit"):
        journal.append_encoded([small, big])
    assert journal.appended == 0
    journal.close()
    assert recover(tmp_path, SMALL_SEGMENT)[0] == []


class ManualLoop:
    """``call_in_loop`` that holds the writer thread's completions until the test runs them."""

    def __init__(self) -> None:
        self.calls: list[Callable[[], None]] = []

    def __call__(self, fn: Callable[[], None]) -> None:
        self.calls.append(fn)

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn in calls:
            fn()


def synced_store(tmp_path: Path) -> tuple[Journal, JournalStore, ManualLoop, list[int]]:
    journal = Journal(tmp_path, segment_bytes=ONE_SEGMENT)
    journal.recover()
    loop = ManualLoop()
    store = JournalStore(journal, call_in_loop=loop)
    completed: list[int] = []
    store.attach(completed.append)
    journal.start()
    return journal, store, loop, completed


def sync_reported(journal: Journal, loop: ManualLoop) -> None:
    """Wait until the writer synced everything queued and handed its report to the loop (not run yet)."""
    wait_until(lambda: journal.synced == journal.appended)
    wait_until(lambda: bool(loop.calls))


@pytest.mark.parametrize("backup_limit", [None, 100])
def test_held_confirms_release_nothing_more_until_a_new_limit(tmp_path: Path, backup_limit: int | None) -> None:
    """A primary that stood still holds what it has not confirmed yet: a record the backup holds (under the
    limit) whose local sync completes only on waking is not confirmed, nor is a later one, until the quorum's
    answer sets a limit again."""
    journal, store, loop, completed = synced_store(tmp_path)
    store.add_queue(queue_spec("q"))  # record 1, completed with the first message
    store.limit_confirms(backup_limit)
    assert store.add_message(wire_message(1), ("q",)) == 2
    sync_reported(journal, loop)
    loop.run()
    assert completed == [1, 2]
    assert store.add_message(wire_message(2), ("q",)) == 3  # the backup may hold it already; not synced here
    sync_reported(journal, loop)  # its sync completes while the node stands still: reported, not yet run
    store.hold_confirms()
    loop.run()
    assert completed == [1, 2]
    assert store.add_message(wire_message(3), ("q",)) == 4  # read on waking
    sync_reported(journal, loop)
    loop.run()
    assert completed == [1, 2]
    store.limit_confirms(None)  # a quorum says this node goes on
    assert completed == [1, 2, 3, 4]


def test_limit_confirms_completes_tokens_up_to_min_of_local_sync_and_limit(tmp_path: Path) -> None:
    journal, store, loop, completed = synced_store(tmp_path)
    store.add_queue(queue_spec("q"))  # record 1
    assert [store.add_message(wire_message(n), ("q",)) for n in (1, 2)] == [2, 3]
    sync_reported(journal, loop)
    loop.run()
    assert completed == [1, 2, 3]  # no limit: local sync alone releases

    store.limit_confirms(3)  # a backup came in sync, holding up to record 3
    tokens = [store.add_message(wire_message(n), ("q",)) for n in (3, 4)]
    store.acknowledge("q", [1])  # no token
    tokens.append(store.update_delivery_counts("q", [2], [1]))
    assert tokens == [4, 5, 7]
    sync_reported(journal, loop)
    loop.run()
    assert completed == [1, 2, 3]  # on disk here, but the backup does not hold them yet
    store.limit_confirms(4)
    assert completed == [1, 2, 3, 4]
    store.limit_confirms(4)
    store.limit_confirms(3)  # a lower limit takes nothing back
    assert completed == [1, 2, 3, 4]
    store.limit_confirms(6)
    assert completed == [1, 2, 3, 4, 5]

    store.limit_confirms(100)  # the backup is ahead of the local sync: the local sync bounds
    assert completed == [1, 2, 3, 4, 5, 7]
    tokens = [store.add_message(wire_message(n), ("q",)) for n in (5, 6)]
    assert tokens == [8, 9]
    store.limit_confirms(200)
    assert completed == [1, 2, 3, 4, 5, 7]  # not known on disk here yet
    sync_reported(journal, loop)
    loop.run()
    assert completed == [1, 2, 3, 4, 5, 7, 8, 9]
    journal.close()


def test_limit_confirms_none_releases_by_local_sync_alone(tmp_path: Path) -> None:
    journal, store, loop, completed = synced_store(tmp_path)
    store.limit_confirms(0)  # an in-sync backup that holds nothing of these yet
    tokens = [store.add_queue(queue_spec("q"))]
    tokens += [store.add_message(wire_message(n), ("q",)) for n in range(1, 5)]
    sync_reported(journal, loop)
    loop.run()
    assert completed == []
    store.limit_confirms(None)  # the backup was lost and a quorum let the primary go on alone
    assert completed == tokens
    token = store.add_message(wire_message(9), ("q",))
    sync_reported(journal, loop)
    loop.run()
    assert completed == [*tokens, token]
    journal.close()


def test_a_closed_gate_holds_confirms_until_recheck(tmp_path: Path) -> None:
    journal, store, loop, completed = synced_store(tmp_path)
    is_open = False
    store.gate = lambda: is_open
    made = store.add_queue(queue_spec("q"))
    token = store.add_message(wire_message(1), ("q",))
    sync_reported(journal, loop)
    loop.run()
    store.recheck()
    assert completed == []
    is_open = True
    store.recheck()
    assert completed == [made, token]
    journal.close()


def test_on_copied_gets_the_number_of_the_compacted_record_at_the_end_of_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_store_module, "COMPACTION_CHUNK", 2)
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    journal.start()
    spec = queue_spec("q")
    store.add_address("orders", (0,), auto_created=False)
    store.add_queue(spec)
    messages = [wire_message(n) for n in range(1, 6)]
    for message in messages:
        store.add_message(message, ("q",))
    copied: list[int] = []
    store.on_copied = copied.append
    seen: dict[int, int] = {}  # record number → record type
    journal.tap = lambda number, data: seen.update({number: data[1]}) if data else None
    store.start_compaction(
        DurableSnapshot(addresses=[("orders", [0], False)], queues=[spec], messages=[(m, ["q"], [0]) for m in messages])
    )
    steps = 0
    while store.compacting and not copied:
        store.compaction_step()
        steps += 1
        store.acknowledge("q", [steps])  # records appended between the chunks
        assert steps < 20
    assert steps == 3  # the address and queue at once, then 5 messages in chunks of 2 and the marker
    [number] = copied
    assert seen[number] == RecordType.COMPACTED
    assert [n for n, kind in seen.items() if kind == RecordType.COMPACTED] == [number]
    assert number == max(n for n in seen if n < number + 1)
    assert journal.appended == number + 1  # the ack after the last step followed it
    store.compaction_step()  # nothing left: not called again
    wait_until(lambda: store.compactions == 1)
    journal.close()
    assert copied == [number]
    assert [r.type for r in recover(tmp_path, SMALL_SEGMENT)[0]].count(RecordType.COMPACTED) == 1


def test_a_note_of_written_through_publishes_completes_like_a_message_once_safe_here_and_on_the_backup(
    tmp_path: Path,
) -> None:
    """The publishes a note names leave this node only when its token completes: on disk here, and held by
    the in-sync backup (its next life must know where they went)."""
    journal, store, loop, completed = synced_store(tmp_path)
    store.limit_confirms(0)  # an in-sync backup that holds nothing yet
    token = store.note_through([("producer-7", "node-2", 1_700_000_000_000)])
    assert token == journal.appended
    sync_reported(journal, loop)
    loop.run()
    assert completed == []
    store.limit_confirms(token)
    assert completed == [token]
    assert store.note_through([]) == 0  # nothing to note: nothing to wait for
    journal.close()


def test_a_message_stored_with_its_attempts_elsewhere_gets_them_back_from_one_record(tmp_path: Path) -> None:
    """A message moved or routed again from another node is stored with the delivery attempts it had there,
    in its own record: no crash keeps the message without them, so its next delivery stays flagged."""
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    store = JournalStore(journal, call_in_loop=lambda fn: fn())
    journal.start()
    store.add_queue(queue_spec("q"))
    store.add_queue(queue_spec("r"))
    token = store.add_message(wire_message(7), ("q", "r"), [1, 1])
    wait_until(lambda: journal.synced == token)
    store.begin_transaction()
    with pytest.raises(ValueError, match="transaction"):
        store.add_message(wire_message(8), ("q",), [1])
    store.commit_transaction()
    journal.close()
    records = recover(tmp_path, SMALL_SEGMENT)[0]
    assert [r.type for r in records].count(RecordType.DELIVERY_COUNTS) == 0
    assert replay(records).references == {"q": {7: 1}, "r": {7: 1}}


# ---------------------------------------------------------------------------------------------------- broker records
@pytest.mark.parametrize("fate", ["expired", "rejected", "out of attempts"])
def test_a_message_moved_to_the_expiry_or_dead_letter_address_is_in_one_queue_or_both_at_every_record(
    tmp_path: Path, fate: str
) -> None:
    """Expiry and dead-lettering journaled the original's acknowledgement before its copy's record: a crash
    between the two (the last synced batch ending there, or a torn tail) lost the message."""
    h = Harness(CoreSettings(address_settings=[AddressSettingsEntry(match="#", max_delivery_attempts=1)]))
    journal, store, loop, _ = synced_store(tmp_path)
    h.broker.store = store
    store.attach(h.broker.on_durable)
    c = h.connect()
    made = c.conn.create_queue({"name": "orders", "durable": True})
    h.sync()
    sync_reported(journal, loop)  # the queue is on disk: the answer goes
    loop.run()
    h.sync()
    assert [e for e in c.inbox if isinstance(e, ev.Reply) and e.req_id == made]
    c.publish("orders", b"precious", durable=True, expiration_ms=h.now_ms + 500)
    if fate == "expired":
        h.tick(h.now_ms + 1000)
    else:
        cid = c.consumer("orders")
        sync_reported(journal, loop)  # the delivery attempt is on disk: the delivery goes
        loop.run()
        h.sync()
        c.nack(cid, ids(c.take(cid)), NackMode.REJECT if fate == "rejected" else NackMode.REDELIVER)
    journal.close()
    records = recover(tmp_path)[0]
    assert {queue for queue, count in replay(records).queue_counts().items() if count} == {
        "ExpiryQueue" if fate == "expired" else "DLQ"
    }
    original = next(i for i, r in enumerate(records) if r.type is RecordType.MESSAGE)
    for end in range(original + 1, len(records) + 1):  # a crash after any record from the original's on
        assert sum(replay(records[:end]).queue_counts().values()) >= 1, [r.type.name for r in records[:end]]


# ---------------------------------------------------------------------------------------------------- disk errors
@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "tiny", "1m") as mount:
        yield mount


def test_a_full_disk_keeps_the_records_and_writes_them_once_space_returns(
    tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No space for the next segment: the writer keeps what it could not write, says so, tries again, and
    writes all of it in order, once, when space returns (it used to stop for good)."""
    monkeypatch.setattr(journal_module, "RETRY_SECONDS", 0.01)
    directory = tiny_disk / "journal"
    journal = Journal(directory, segment_bytes=16 * SMALL_SEGMENT)
    journal.recover()
    reported: list[int] = []
    errors: list[int | None] = []
    journal.on_synced = reported.append
    journal.on_error = lambda: errors.append(journal.error.errno if journal.error else None)
    journal.start()
    entries = make_entries(400)
    for entry in entries[:10]:
        journal.append(*entry)
    wait_until(lambda: journal.synced == 10)
    filler = fill(tiny_disk)
    roll = journal.roll()
    for entry in entries[10:]:  # more than a segment: a second roll on the way
        journal.append(*entry)
    wait_until(lambda: journal.error is not None)
    assert errors == [errno.ENOSPC]
    assert journal.synced == 10  # nothing after the full disk is reported safe
    filler.unlink()
    wait_until(lambda: journal.synced == len(entries))
    assert journal.error is None
    assert errors == [errno.ENOSPC, None]
    assert reported[-1] == len(entries)
    assert journal.retire_before_roll(roll) == 1  # the roll was made once, where it was queued
    journal.close()
    records, report = recover(directory, 16 * SMALL_SEGMENT)
    assert as_entries(records) == entries[10:]
    assert report.truncated == []


def test_a_failed_fsync_stops_the_writer_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed fsync the page cache may have dropped the data: the writer confirms nothing more and
    reports the failure, fatal (a retry that succeeds would confirm records the disk may not have)."""
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    reported: list[int] = []
    failed = threading.Event()
    journal.on_synced = reported.append
    journal.on_error = failed.set
    journal.start()
    entries = make_entries(3)
    journal.append(*entries[0])
    wait_until(lambda: journal.synced == 1)

    def fdatasync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(journal_module.os, "fdatasync", fdatasync)
    journal.append(*entries[1])
    assert failed.wait(WAIT)
    assert "fsync failed" in str(journal.fatal)
    assert journal.error is not None
    assert journal.error.errno == errno.EIO
    monkeypatch.undo()  # the disk answers again: still nothing more is written or confirmed
    journal.append(*entries[2])
    journal.close()
    assert reported == [1]
    assert journal.synced == 1


def test_a_synced_batch_is_confirmed_even_when_its_synced_record_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch is on disk once its fdatasync returned: a write error of the SYNCED record after it (a full
    copy-on-write filesystem, say) stopped its confirms for good, the batch's records being gone from the
    writer's hands; it is logged, and the writer goes on."""
    journal = Journal(tmp_path, segment_bytes=SMALL_SEGMENT)
    journal.recover()
    reported: list[int] = []
    journal.on_synced = reported.append
    journal.start()
    real_pwrite = os.pwrite
    marker = encode(RecordType.SYNCED, [])

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if bytes(data) == marker:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(journal_module.os, "pwrite", pwrite)
    entries = make_entries(6)
    for entry in entries[:3]:
        journal.append(*entry)
    wait_until(lambda: journal.synced == 3)
    monkeypatch.undo()
    for entry in entries[3:]:
        journal.append(*entry)
    journal.close()
    assert journal.error is None
    assert reported[-1] == 6
    records, report = recover(tmp_path, SMALL_SEGMENT)
    assert as_entries(records) == entries
    assert report.truncated == []


def test_an_offline_rewrite_leaves_no_descriptor_of_the_old_journal_open(tmp_path: Path) -> None:
    entries: list[Entry] = [(RecordType.ADD_QUEUE, [queue_spec("q")])]
    entries += [(RecordType.MESSAGE, [wire_message(n), ["q"]]) for n in range(1, 40)]
    write_journal(tmp_path / "journal", entries, SMALL_SEGMENT)
    before = len(os.listdir("/proc/self/fd"))
    write_live_state(tmp_path / "journal", tmp_path / "fresh", SMALL_SEGMENT)
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_offline_compaction_that_finds_the_disk_full_keeps_the_old_journal(tiny_disk: Path) -> None:
    """The compacted copy could not be written whole: it is never marked complete nor swapped in (it used to
    be, without the records the full disk refused)."""
    directory = tiny_disk / "journal"
    entries = [(RecordType.ADD_QUEUE, [queue_spec("q")])]
    entries += [(RecordType.MESSAGE, [wire_message(n, bytes(2000)), ["q"]]) for n in range(1, 200)]
    write_journal(directory, entries, 16 * SMALL_SEGMENT)
    filler = tiny_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:  # room for the copy's first segment but not for all of it
        os.write(fd, bytes(os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize - 24 * SMALL_SEGMENT))
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="No space left on device"):
        compact_offline(directory, 16 * SMALL_SEGMENT)
    assert as_entries(recover(directory, 16 * SMALL_SEGMENT)[0]) == entries  # recovery undoes the partial copy
    assert not (tiny_disk / f"journal{COMPACT_SUFFIX}").exists()


# ------------------------------------------------------------------------------- paging queues left on disk
def at(segment: int, offset: int, record_type: RecordType, *payload: Any) -> Record:
    return Record(offset, record_type, list(payload), segment)


def pages_p(spec: dict[str, Any]) -> bool:
    return bool(spec["name"].startswith("p"))


def test_replay_keeps_only_where_the_messages_that_only_paging_queues_hold_are() -> None:
    m1, m2, m3, m4, m5 = (wire_message(n) for n in range(1, 6))
    records = [
        at(1, 0, RecordType.ADD_QUEUE, queue_spec("p1")),
        at(1, 10, RecordType.ADD_QUEUE, queue_spec("p2")),
        at(1, 20, RecordType.ADD_QUEUE, queue_spec("n")),
        at(1, 100, RecordType.MESSAGE, m1, ["p1"]),
        at(2, 200, RecordType.MESSAGE, m2, ["p1", "p2"], [0, 3]),
        at(2, 300, RecordType.MESSAGE, m3, ["p1", "n"]),  # a queue that does not page needs it decoded
        at(2, 400, RecordType.MESSAGE, m4, ["p2"]),
        at(3, 500, RecordType.TX_MESSAGE, 7, m5, ["p2"]),
        at(3, 600, RecordType.TX_COMMIT, 7),
        at(3, 700, RecordType.ACKS, "p1", [1, 2]),  # 1 gone, 2 still in p2
        at(3, 800, RecordType.DELETE_QUEUE, "p2"),  # 4 and 5 gone, 2 too
        at(3, 900, RecordType.DELIVERY_COUNT, "p1", 3, 4),
    ]
    state = replay(records, pages=pages_p)
    assert state.messages == {3: m3}
    assert state.located == {}
    assert state.references == {"p1": {3: 4}, "n": {3: 0}}
    assert state.live_messages() == 1

    state = replay(records[:-3], pages=pages_p)
    assert state.messages == {3: m3}
    assert state.located == {
        1: location(records[3]),
        2: location(records[4]),
        4: location(records[6]),
        5: 3 << 40 | 500,
    }
    assert state.references == {"p1": {1: 0, 2: 0, 3: 0}, "p2": {2: 3, 4: 0, 5: 0}, "n": {3: 0}}
    assert state.live_messages() == 5
    # Without ``pages`` (offline compaction, data tools) every message is decoded, as before.
    assert replay(records[:-3]).messages == {1: m1, 2: m2, 3: m3, 4: m4, 5: m5}


def test_replay_decodes_a_located_message_once_a_queue_that_does_not_page_takes_it() -> None:
    """Compaction writes a live message again: the copy decides, and a decoded one never goes back to disk."""
    m1, m2 = wire_message(1), wire_message(2)
    state = replay(
        [
            at(1, 0, RecordType.ADD_QUEUE, queue_spec("p")),
            at(1, 10, RecordType.ADD_QUEUE, queue_spec("n")),
            at(1, 20, RecordType.MESSAGE, m1, ["p"]),
            at(1, 30, RecordType.MESSAGE, m2, ["n"]),
            at(2, 0, RecordType.MESSAGE, m1, ["p", "n"], [2, 0]),
            at(2, 40, RecordType.MESSAGE, m2, ["p", "n"], [0, 1]),
            at(2, 80, RecordType.ACK, "n", 2),
        ],
        pages=pages_p,
    )
    assert state.messages == {1: m1, 2: m2}
    assert state.located == {}
    assert state.references == {"p": {1: 2, 2: 0}, "n": {1: 0}}


def test_replay_of_a_paging_queue_matches_the_decoded_replay_message_for_message(tmp_path: Path) -> None:
    """Over several segments: every located message read back is the one a plain replay keeps, and the rest
    of the state is the same."""
    rng = random.Random(7)
    entries: list[Entry] = [(RecordType.ADD_QUEUE, [queue_spec("p")]), (RecordType.ADD_QUEUE, [queue_spec("n")])]
    for n in range(1, 301):
        entries.append(
            (RecordType.MESSAGE, [wire_message(n, bytes(rng.randrange(300))), rng.choice([["p"], ["n"], ["p", "n"]])])
        )
        if n % 10 == 0:
            entries.append((RecordType.ACKS, ["p", rng.sample(range(1, n + 1), 5)]))
            entries.append((RecordType.DELIVERY_COUNTS, ["p", [n - 1], [3]]))
        if n % 50 == 0:
            entries.append((RecordType.TX_MESSAGE, [n, wire_message(1000 + n), ["p"]]))
            entries.append((RecordType.TX_COMMIT, [n]))
    entries.append((RecordType.TX_MESSAGE, [9999, wire_message(9999), ["p"]]))  # its commit lost to a crash
    write_journal(tmp_path, entries, SMALL_SEGMENT)
    plain, _ = Journal(tmp_path, segment_bytes=SMALL_SEGMENT).recover(replay)
    located, _ = Journal(tmp_path, segment_bytes=SMALL_SEGMENT).recover(lambda r: replay(r, pages=pages_p))
    assert len(list_segments(tmp_path)) > 10
    assert located.references == plain.references
    assert located.live_messages() == plain.live_messages() > 100
    assert located.uncommitted == plain.uncommitted == 1
    assert located.dedup_ids == plain.dedup_ids
    assert len(located.located) > 50
    assert set(located.located).isdisjoint(located.messages)
    reader = MessageReader(tmp_path)
    try:
        assert {**located.messages, **{i: reader(w) for i, w in located.located.items()}} == plain.messages
    finally:
        reader.close()


def test_a_located_message_whose_record_changed_is_refused(tmp_path: Path) -> None:
    write_journal(tmp_path, [(RecordType.ADD_QUEUE, [queue_spec("p")]), (RecordType.MESSAGE, [wire_message(1), ["p"]])])
    state, _ = Journal(tmp_path).recover(lambda r: replay(r, pages=pages_p))
    (where,) = state.located.values()
    path = list_segments(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[(where & 0xFFFF) + HEADER_SIZE + 5] ^= 1
    path.write_bytes(bytes(data))
    reader = MessageReader(tmp_path)
    with pytest.raises(JournalCorruptedError, match="CRC mismatch"):
        reader(where)
    reader.close()
