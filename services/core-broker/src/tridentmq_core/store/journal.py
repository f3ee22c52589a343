"""The append-only journal: pre-allocated segment files, one writer thread, group commit.

``append`` only queues the encoded record (it runs on the event loop); the writer thread takes everything
queued so far, writes it, calls ``fdatasync`` once for the whole batch and reports the highest record
number now safe. Records queued while an fsync is running form the next batch, so the batch size grows
with the load by itself: that is the group commit.

A full disk (ENOSPC, EDQUOT) stops nothing for good: the writer keeps what it could not write and tries
again every ``RETRY_SECONDS``, and ``error`` says why meanwhile. A failed fsync, or any other write error,
is fatal (``fatal``): what the disk kept is unknown, so the writer confirms nothing more.

Recovery reads the segments in order. A torn or corrupt record with nothing valid behind it (a crash
mid-write) is cut off and reported. Damage with valid records behind it stops the node with the file and
offset, because truncating there could silently drop acknowledged data, unless no record behind it says it
was ever synced: the writer writes a SYNCED record after every ``fdatasync`` (and when it starts), so damage
that no later SYNCED record covers lies in the last write, which the disk never confirmed, and which a power
cut may have torn anywhere (pages reach the disk in any order). That is cut off with everything behind it.
Only in the last segment with records: the writer syncs a segment whole before it writes to the next one.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar, overload

import msgpack

from tridentmq_core.store.files import fsync_directory
from tridentmq_core.store.records import (
    HEADER,
    HEADER_SIZE,
    Record,
    RecordType,
    ScanEnd,
    dedup_id_chunks,
    encode,
    records_behind,
    scan,
)
from tridentmq_core.store.recovery import LOCATION_SHIFT, message_of, replay
from tridentmq_shared.message import WireMessage

log = logging.getLogger("tridentmq.core.journal")

T = TypeVar("T")

_ROLL: Final = b""  # queued like a record: the writer starts a new segment there (compaction's boundary)
_SYNCED: Final = encode(RecordType.SYNCED, [])
SEGMENT_PREFIX: Final = "journal-"
SEGMENT_SUFFIX: Final = ".tmq"
DEFAULT_SEGMENT_BYTES: Final = 64 * 1024 * 1024
#: Errors that mean "no room now": the writer keeps the records and tries again this often.
_NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
RETRY_SECONDS: Final = 1.0


COMPACT_SUFFIX: Final = ".compact"
OLD_SUFFIX: Final = ".old"
COMPLETE_MARKER: Final = "COMPLETE"


def _sibling(directory: Path, suffix: str) -> Path:
    return directory.with_name(directory.name + suffix)


def finish_offline_compaction(directory: Path) -> None:
    """Complete or undo an offline compaction that a crash interrupted (see ``compact_offline``)."""
    compact, old = _sibling(directory, COMPACT_SUFFIX), _sibling(directory, OLD_SUFFIX)
    if compact.exists():
        if (compact / COMPLETE_MARKER).exists() and not directory.exists():
            compact.rename(directory)  # crashed between the two renames: finish the swap
            fsync_directory(directory.parent)
        else:
            shutil.rmtree(compact)  # never completed, or completed but not swapped in: the old one is whole
    if old.exists():
        if directory.exists():
            shutil.rmtree(old)
        else:
            old.rename(directory)
    (directory / COMPLETE_MARKER).unlink(missing_ok=True)


def write_live_state(source: Path, target: Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> tuple[int, int]:
    """Write the live state of the journal in ``source`` as a fresh journal in ``target`` (synced, marked
    complete); returns (records read, records written)."""
    journal = Journal(source, segment_bytes=segment_bytes)
    try:
        state, report = journal.recover(replay)
    finally:
        journal.close()  # recovery opened its last segment for writing on
    shutil.rmtree(target, ignore_errors=True)
    fresh = Journal(target, segment_bytes=segment_bytes)
    fresh.recover()
    fresh.start()
    written = 0
    for name, (kinds, auto_created) in state.addresses.items():
        fresh.append(RecordType.ADD_ADDRESS, [name, kinds, auto_created])
        written += 1
    for spec in state.queues.values():
        fresh.append(RecordType.ADD_QUEUE, [spec])
        written += 1
    for chunk in dedup_id_chunks(state.dedup_ids.items(), segment_bytes):
        fresh.append(RecordType.DEDUP_IDS, chunk)
        written += 1
    through = [(dedup_id, node_id, arrived) for dedup_id, (node_id, arrived) in state.through_ids.items()]
    for entries in dedup_id_chunks(through, segment_bytes):
        fresh.append(RecordType.THROUGH_IDS, entries)
        written += 1
    owed: dict[int, tuple[list[str], list[int]]] = {}
    for queue, references in state.references.items():
        for message_id, count in references.items():
            entry = owed.setdefault(message_id, ([], []))
            entry[0].append(queue)
            entry[1].append(count)
    for message_id in sorted(owed):  # ids grow with publish order: each queue keeps its order
        queues, counts = owed[message_id]
        fresh.append(RecordType.MESSAGE, [state.messages[message_id], queues, counts])
        written += 1
    fresh.close()
    if fresh.error is not None:  # not whole: never marked complete, so never swapped in
        raise fresh.error
    (target / COMPLETE_MARKER).write_bytes(b"")
    fsync_directory(target)
    return report.records, written


def compact_offline(directory: Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> tuple[int, int]:
    """Rewrite a stopped node's journal with only its live state; returns (records before, after).

    Crash-safe: the new journal is written and synced beside the old one and marked complete, then swapped
    in by two renames; ``finish_offline_compaction`` (run by every recovery) completes or undoes a swap that
    a crash interrupted, so the node always finds exactly one whole journal.
    """
    target = _sibling(directory, COMPACT_SUFFIX)
    counts = write_live_state(directory, target, segment_bytes)
    old = _sibling(directory, OLD_SUFFIX)
    directory.rename(old)
    fsync_directory(directory.parent)
    target.rename(directory)
    fsync_directory(directory.parent)
    shutil.rmtree(old)
    (directory / COMPLETE_MARKER).unlink()
    return counts


def measure_fsync(directory: Path, seconds: float = 2.0, write_bytes: int = 4096) -> float:
    """fdatasync calls per second of small writes to a pre-allocated file in ``directory`` (what group commit
    is bound by)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".fsync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, 1024 * write_bytes)
        data = b"\xa5" * write_bytes
        count = 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            os.pwrite(fd, data, (count % 1024) * write_bytes)
            os.fdatasync(fd)
            count += 1
        return count / (time.monotonic() - started)
    finally:
        os.close(fd)
        path.unlink()


@dataclass(frozen=True, slots=True)
class Damage:
    """Damage with valid records behind it, where a segment's scan stopped."""

    reason: str
    #: No SYNCED record lies behind it, in a journal whose writer writes one after every sync (one came
    #: before it), nor any record in a later segment: it lies in the last write, never confirmed, which a
    #: power cut tore. Recovery cuts it off with everything behind it; any other damage stops the node.
    unsynced: bool


def damage_in(data: bytes, end: ScanEnd, later: list[Path], *, marked: bool) -> Damage | None:
    """The damage a segment whose scan stopped at ``end`` holds, or None when recovery may simply cut it there
    (a clean end, or a torn last write); ``later`` are the segments after it, ``marked`` whether a SYNCED
    record came before ``end``. Recovery and ``tridentmq data verify`` both decide by this, so verify never
    calls clean what recovery refuses."""
    here = records_behind(data, end.offset)
    further = _records_of(later)
    if end.reason is None:
        first = next(here, None)
        if first is None:
            return None  # the clean end (a later segment is where writing went on)
        # A zeroed header (a lost page) looks like the clean end, but valid records follow it.
        reason = f"zeros at offset {end.offset} with valid records behind them"
        behind = itertools.chain([first], here)
    else:
        first = next(here, None)
        after = first if first is not None else next(further, None)
        if after is None:
            return None
        reason = f"{end.reason}, and valid records follow it"
        if first is None:  # only in later segments: written after this one was synced whole
            return Damage(reason, unsynced=False)
        behind = itertools.chain([first], here)
    # The writer syncs a segment whole before it writes anything to the next one (``_open_segment``): damage
    # in a segment that a later one with records follows was synced, and may have been confirmed, even when
    # the SYNCED record that would say so did not reach the disk (one after the last sync: a power cut then).
    if not marked or any(r.type is RecordType.SYNCED for r in behind) or next(further, None) is not None:
        return Damage(reason, unsynced=False)
    return Damage(reason, unsynced=True)


def _records_of(segments: list[Path]) -> Iterator[Record]:
    for path in segments:
        yield from records_behind(path.read_bytes(), -1)


class JournalCorruptedError(Exception):
    """Damage with valid data behind it: the node must not start on this journal as it is."""


class SyncFailedError(Exception):
    """An fsync failed: what the page cache kept of the data is unknown, so no retry can make it safe."""

    def __init__(self, error: OSError) -> None:
        super().__init__(f"journal fsync failed: {error.strerror or error}")
        self.error = error


@dataclass
class RecoveryReport:
    segments: int = 0
    records: int = 0
    truncated: list[str] = field(default_factory=list)  # what was cut off, one line per damaged tail


def segment_name(number: int) -> str:
    return f"{SEGMENT_PREFIX}{number:08d}{SEGMENT_SUFFIX}"


def segment_number(path: Path) -> int | None:
    """The number of a segment file, None for a name the writer does not make (a copy left beside them)."""
    digits = path.name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]
    if not (path.name.startswith(SEGMENT_PREFIX) and path.name.endswith(SEGMENT_SUFFIX) and digits.isdigit()):
        return None
    number = int(digits)
    return number if path.name == segment_name(number) else None


def _numbered(directory: Path) -> tuple[list[tuple[int, Path]], list[str]]:
    """The segment files by number, and the names that look like segments but that the writer does not make."""
    numbered, strays = [], []
    for path in directory.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"):
        number = segment_number(path)
        if number is None:
            strays.append(path.name)
        else:
            numbered.append((number, path))
    return sorted(numbered), sorted(strays)


def list_segments(directory: Path) -> list[Path]:
    """The segment files, by number (names the writer does not make are left out: see ``segments_problem``)."""
    return [path for _, path in _numbered(directory)[0]]


def segments_problem(directory: Path) -> str | None:
    """What is wrong with the set of segment files as a whole, or None. The writer only adds a segment after the
    last and only deletes the oldest ones, and a segment it moved past was filled (pre-allocated) first: a
    number missing between two segments, an empty file before the last, or a file named like a segment that
    the writer did not name so (read in its place, a copy left beside them made the writer overwrite records of
    the real one) is damage, which recovery and ``tridentmq data verify`` refuse."""
    numbered, strays = _numbered(directory)
    if strays:
        return f"{', '.join(strays[:3])}: not a journal segment's name; move such files out of {directory}"
    for (before, _), (after, _) in itertools.pairwise(numbered):
        if after != before + 1:
            return f"{segment_name(before + 1)} is missing (between {segment_name(before)} and {segment_name(after)})"
    for _, path in numbered[:-1]:
        if path.stat().st_size == 0:
            return f"{path.name} is empty, and later segments follow it"
    return None


def read_segment(path: Path) -> Iterator[Record | ScanEnd]:
    yield from scan(path.read_bytes())


class MessageReader:
    """Reads back, by location, the messages recovery left in the journal's segments (``RecoveredState.located``):
    called before the journal writes again, while they are all still there."""

    #: Segment files kept open at most (a restore reads in id order, which is mostly segment order).
    MAX_OPEN: Final = 16
    READ_BYTES: Final = 4096

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fds: dict[int, int] = {}

    def __call__(self, where: int) -> WireMessage:
        segment, offset = where >> LOCATION_SHIFT, where & ((1 << LOCATION_SHIFT) - 1)
        fd = self._fds.get(segment)
        if fd is None:
            if len(self._fds) >= self.MAX_OPEN:
                self.close()
            fd = self._fds[segment] = os.open(self.directory / segment_name(segment), os.O_RDONLY)
        # The record alone, not the segment: a whole one read or mapped would count in the process's memory.
        # One read covers most records; a longer one takes a second.
        data = os.pread(fd, self.READ_BYTES, offset)
        if len(data) >= HEADER_SIZE:
            size = HEADER_SIZE + HEADER.unpack_from(data)[2]
            if size > len(data):
                data += os.pread(fd, size - len(data), offset + len(data))
        record = next(scan(data, 0, segment))  # checked again: the file is read twice, and must not have changed
        if not isinstance(record, Record):
            raise JournalCorruptedError(f"{segment_name(segment)}: {record.reason or 'no record'} at offset {offset}")
        return message_of(record)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class Journal:
    def __init__(self, directory: Path, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES, sync_delay_us: int = 0) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.sync_delay = sync_delay_us / 1_000_000
        self.on_synced: Callable[[int], None] = lambda _seq: None  # called from the writer thread
        #: Sees every record queued, with its number, on the appending thread (the replication feed).
        self.tap: Callable[[int, bytes], None] | None = None
        self._lock = threading.Lock()
        self._wakeup = threading.Event()  # set when records are queued; setting it only when clear is cheap
        self._pending: list[bytes] = []
        self._pack = msgpack.Packer().pack  # used by ``append`` only, on the event loop
        self._appended = 0  # number of the last record queued
        self.synced = 0  # number of the last record known to be on disk
        self.syncs = 0  # fdatasync calls made for records (group commits), read by the metrics
        self._closing = False
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._segment_number = 0
        self._position = 0
        #: Why the writer cannot write now (set and cleared by the writer thread); ``fatal`` once it gave up.
        self.error: OSError | None = None
        self.fatal: Exception | None = None
        #: Called from the writer thread when ``error`` is set or cleared, or ``fatal`` is set.
        self.on_error: Callable[[], None] = lambda: None
        #: Called from the writer thread when it opened a new segment (the disk's free space just fell by one).
        self.on_segment: Callable[[], None] = lambda: None
        self._retry = threading.Event()  # cuts a retry's wait short when closing
        self.rolled_to = 0  # the segment the last roll marker started (set by the writer thread)
        self._rolls = 0  # rolls queued, numbered from 1 (on the appending thread)
        self._rolls_written = 0  # rolls the writer thread reached
        #: (roll number, segment it started), appended by the writer thread, taken by ``retire_before_roll``.
        self._roll_segments: deque[tuple[int, int]] = deque()

    # ------------------------------------------------------------------ recovery
    @overload
    def recover(self) -> tuple[None, RecoveryReport]: ...
    @overload
    def recover(self, consume: Callable[[Iterator[Record]], T]) -> tuple[T, RecoveryReport]: ...
    def recover(self, consume: Callable[[Iterator[Record]], Any] | None = None) -> tuple[Any, RecoveryReport]:
        """Read every record in order, cut off a torn tail, and position the writer after the last record.

        ``consume`` gets the records as an iterator, read segment by segment as it asks for them (``replay``,
        or ``list`` to have them all), and its result is returned with the report: the history is never held
        whole, so a restart needs about the live state plus one segment. Damage that recovery refuses raises
        ``JournalCorruptedError`` from that iterator, before ``recover`` returns: the caller's partial result
        is dropped with the exception, and the node serves nothing.
        """
        finish_offline_compaction(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        report = RecoveryReport()
        problem = segments_problem(self.directory)
        if problem is not None:
            raise JournalCorruptedError(
                f"{problem}; refusing to start rather than lose records (inspect with `tridentmq data verify`)"
            )
        segments = list_segments(self.directory)
        records = self._read(segments, report)
        try:
            result = None if consume is None else consume(records)
            for _ in records:  # what ``consume`` left unread: the damage check and the position need it all
                pass
        finally:
            records.close()
        self._appended = self.synced = report.records
        if segments:
            self._fd = os.open(self.directory / segment_name(self._segment_number), os.O_RDWR)
        return result, report

    def _read(self, segments: list[Path], report: RecoveryReport) -> Generator[Record, None, None]:
        marked = False  # a SYNCED record was read: this journal's writer writes one after every sync
        for index, path in enumerate(segments):
            data = path.read_bytes()
            number = int(path.name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)])
            report.segments += 1
            end = ScanEnd(0, None)
            for item in scan(data, 0, number):
                if isinstance(item, Record):
                    if item.type is RecordType.SYNCED:
                        marked = True
                        continue
                    report.records += 1
                    yield item
                else:
                    end = item
            later = segments[index + 1 :]
            damage = damage_in(data, end, later, marked=marked)
            if damage is not None and not damage.unsynced:
                raise JournalCorruptedError(
                    f"{path.name}: {damage.reason}; refusing to start rather than drop them "
                    f"(inspect with `tridentmq data verify`)"
                )
            if end.reason is not None or damage is not None:
                self._zero_from(path, end.offset)
                why = end.reason or f"zeros at offset {end.offset}"
                unsynced = ", with the never synced records behind it" if damage is not None else ""
                report.truncated.append(f"{path.name}: {why}; cut at offset {end.offset}{unsynced}")
            self._segment_number = number
            self._position = end.offset
            del data  # before the next segment is read: one segment in memory at a time
            if damage is not None:  # the segments behind hold no records (created by a roll, then the power cut)
                for gone in later:
                    gone.unlink()
                    report.truncated.append(f"{gone.name}: removed, written after {path.name}'s cut")
                fsync_directory(self.directory)
                return

    @staticmethod
    def _zero_from(path: Path, offset: int) -> None:
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.seek(offset)
            remaining = size - offset
            chunk = bytes(min(remaining, 1024 * 1024))
            while remaining > 0:
                f.write(chunk[: min(remaining, len(chunk))])
                remaining -= len(chunk)
            f.flush()
            os.fdatasync(f.fileno())

    # ------------------------------------------------------------------ writing
    def start(self) -> None:
        if self._fd < 0:
            self._open_segment(self._segment_number + 1)
        # What recovery read may still be in the page cache only (after a crash of the process, not of the
        # machine): on disk before a SYNCED record says so, and that one on disk before the first batch.
        for path in list_segments(self.directory):
            if path.name != segment_name(self._segment_number):
                _sync_file(path)
        _sync(self._fd)  # before the SYNCED record is written behind it: the disk may take that one first
        self._mark()
        _sync(self._fd)
        self._thread = threading.Thread(target=self._write_loop, name="journal-writer", daemon=True)
        self._thread.start()

    def append(self, record_type: RecordType, payload: Any) -> int:
        """Queue a record; returns its number (``on_synced`` reports numbers once they are on disk)."""
        data = encode(record_type, payload, self._pack)
        if len(data) > self.segment_bytes:
            raise ValueError(f"a record of {len(data)} bytes does not fit a segment of {self.segment_bytes}")
        with self._lock:
            self._pending.append(data)
            self._appended += 1
            number = self._appended
        if not self._wakeup.is_set():
            self._wakeup.set()
        if self.tap is not None:
            self.tap(number, data)
        return number

    def append_encoded(self, records: list[bytes]) -> int:
        """Queue records encoded elsewhere (a backup writing its primary's stream; an empty one is a roll, as
        the primary's ``roll``); returns the number of the last record."""
        count = 0
        for data in records:
            if len(data) > self.segment_bytes:
                raise ValueError(f"a record of {len(data)} bytes does not fit a segment of {self.segment_bytes}")
            count += bool(data)
        with self._lock:
            self._pending.extend(data or _ROLL for data in records)
            self._appended += count
            self._rolls += len(records) - count
            number = self._appended
        if not self._wakeup.is_set():
            self._wakeup.set()
        return number

    def unwritten_bytes(self) -> int:
        """The bytes of the records queued and not yet written (they will take that much more of the disk)."""
        with self._lock:
            return sum(len(data) for data in self._pending)

    @property
    def appended(self) -> int:
        """The number of the last record queued."""
        return self._appended

    @property
    def rolls(self) -> int:
        """The number of the last roll queued (``roll`` and the empty records of ``append_encoded``)."""
        return self._rolls

    def roll(self) -> int:
        """Queue a switch to a fresh segment: records appended after this call land in it or later ones.
        Returns the roll's number (for ``retire_before_roll``)."""
        with self._lock:
            self._pending.append(_ROLL)
            self._rolls += 1
            number = self._rolls
        if not self._wakeup.is_set():
            self._wakeup.set()
        if self.tap is not None:
            self.tap(0, _ROLL)  # a roll takes no number
        return number

    def segments(self) -> list[Path]:
        return list_segments(self.directory)

    def retire_before(self, number: int) -> int:
        """Delete the segments numbered below ``number`` (their live records were copied forward and synced);
        returns how many were deleted. Safe while writing: the writer only touches the current segment."""
        retired = 0
        for path in list_segments(self.directory):
            if int(path.name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]) < number:
                path.unlink()
                retired += 1
        if retired:
            fsync_directory(self.directory)
        return retired

    def retire_before_roll(self, roll: int) -> int:
        """Delete the segments before the one roll number ``roll`` started, which the writer has reached (a
        record queued after the roll is synced); returns how many were deleted. Not ``rolled_to``: a later
        roll may be written already (a backup gets its primary's next compaction as fast as it comes), and
        the segments before it hold the only copy of what the compaction that ``roll`` started still needs."""
        segment = 0
        while self._roll_segments and self._roll_segments[0][0] <= roll:  # earlier rolls are done with too
            number, started = self._roll_segments.popleft()
            if number == roll:
                segment = started
        return self.retire_before(segment) if segment else 0

    def close(self) -> None:
        """Write and sync everything queued, then stop the writer."""
        with self._lock:
            self._closing = True
        self._wakeup.set()
        self._retry.set()
        if self._thread is not None:
            self._thread.join()
        if self._fd >= 0:
            if self._thread is not None and self.fatal is None:
                # The SYNCED record written after the last sync: on disk too, or a power cut after this stop
                # leaves the last batch with nothing to say it was synced (damage in it would be cut off).
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    log.warning("journal: the last SYNCED record could not be synced", extra={"reason": str(exc)})
            os.close(self._fd)
            self._fd = -1

    def _write_loop(self) -> None:
        while True:
            self._wakeup.wait()
            if self.sync_delay:
                time.sleep(self.sync_delay)  # let more records join this group commit
            self._wakeup.clear()  # before taking the batch: a record queued after this wakes us again
            with self._lock:
                batch, self._pending = self._pending, []
                last = self._appended
                closing = self._closing
            if batch:
                try:
                    self._write(batch)
                except (SyncFailedError, OSError) as exc:
                    if self._retry_after(exc, batch, closing):
                        continue
                    return
                if self.error is not None:
                    self.error = None
                    log.info("journal writes again: durable publishes are accepted again")
                    self.on_error()
                self.synced = last
                self.on_synced(last)
            if closing and not self._pending:
                return

    def _retry_after(self, exc: SyncFailedError | OSError, batch: list[bytes], closing: bool) -> bool:
        """Handle a failed batch: True when the disk is full and the writer tries again (what ``batch`` still
        holds is queued first again), False when it stops for good."""
        error = exc.error if isinstance(exc, SyncFailedError) else exc
        if error.errno in _NO_SPACE and not isinstance(exc, SyncFailedError):
            with self._lock:
                self._pending[:0] = batch
            if closing:  # stopping: waiting for space could take for ever
                self.error = error
                log.error("journal closed with records unwritten (never confirmed): no space on disk")
                return False
            if self.error is None:
                self.error = error
                log.error(
                    "journal cannot write: durable publishes are refused until space returns",
                    extra={"reason": error.strerror, "retry_seconds": RETRY_SECONDS},
                )
                self.on_error()
            self._retry.wait(RETRY_SECONDS)
            self._wakeup.set()
            return True
        self.error = error
        # After a failed fsync what the disk kept is unknown, and so it is after any other write error: a
        # retry could confirm lost data, so nothing more is written. Only the directory gone is not fatal: a
        # shared-store node whose epoch ended, which its lease check fences.
        if error.errno != errno.ENOENT or isinstance(exc, SyncFailedError):
            self.fatal = exc
        log.critical("journal write failed: nothing more is confirmed", extra={"reason": str(exc)})
        self.on_error()
        return False

    def _write(self, batch: list[bytes]) -> None:
        """Write and sync ``batch``. On a write error, what was written is removed from ``batch`` (segments
        left are synced; the current one is synced by the next batch) and the rest stays for a retry; a failed
        sync raises ``SyncFailedError``."""
        chunk: list[bytes] = []
        size = 0
        done = 0  # records of ``batch`` written (``_position`` is past them)
        try:
            for index, data in enumerate(batch):
                # Room is kept for the SYNCED record the sync writes behind the batch (unless the record is alone
                # in its segment): without it, nothing would say that the batch was synced.
                used = self._position + size
                if data is _ROLL or (used and used + len(data) + len(_SYNCED) > self.segment_bytes):
                    self._flush_chunk(chunk)
                    done = index
                    chunk, size = [], 0
                    self._open_segment(self._segment_number + 1)
                    self.on_segment()
                    if data is _ROLL:
                        self.rolled_to = self._segment_number
                        self._rolls_written += 1  # rolls are written in the order they were queued
                        self._roll_segments.append((self._rolls_written, self._segment_number))
                        done = index + 1
                        continue
                chunk.append(data)
                size += len(data)
            self._flush_chunk(chunk)
            done = len(batch)
        finally:
            del batch[:done]
        _sync(self._fd)
        self.syncs += 1
        if os.fstat(self._fd).st_nlink == 0:  # removed under the node (an operator's rm): it would vanish at exit
            name = segment_name(self._segment_number)
            raise OSError(
                errno.ENOENT, f"journal segment {name} was removed while in use: nothing written since is kept"
            )
        try:
            self._mark()
        except OSError as exc:  # the batch is on disk all the same, and confirmed: only its SYNCED record is not
            log.warning("journal: a SYNCED record could not be written", extra={"reason": str(exc)})

    def _mark(self) -> None:
        """Write a SYNCED record where the next batch starts (everything before it is on disk): unsynced, it
        reaches the disk with that batch's sync at the latest. ``_write`` keeps room for it; left out only
        behind a record that fills a segment alone, or in a segment an older writer filled (the next batch
        starts a new segment, and the roll syncs this one)."""
        if self._position + len(_SYNCED) <= self.segment_bytes:
            self._flush_chunk([_SYNCED])

    def _flush_chunk(self, chunk: list[bytes]) -> None:
        if not chunk:
            return
        data = b"".join(chunk)
        written = os.pwrite(self._fd, data, self._position)
        while written < len(data):
            written += os.pwrite(self._fd, data[written:], self._position + written)
        self._position += len(data)

    def _open_segment(self, number: int) -> None:
        # The new file first: when the disk is full it goes again and the current segment stays in use.
        path = self.directory / segment_name(number)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)  # zeros: the scan's clean end marker
        except OSError:
            os.close(fd)
            path.unlink()
            raise
        try:
            fsync_directory(self.directory)  # the new file's name is durable too
            if self._fd >= 0:
                os.fdatasync(self._fd)
        except OSError as exc:
            os.close(fd)
            raise SyncFailedError(exc) from exc
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._segment_number = number
        self._position = 0


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _sync(fd)
    finally:
        os.close(fd)


def _sync(fd: int) -> None:
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise SyncFailedError(exc) from exc
