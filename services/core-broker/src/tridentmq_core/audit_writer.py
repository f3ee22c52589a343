"""Audit stream writer: one append-only, gap-free JSON-lines log per node.

Sealed segments live in ``<directory>/<node_id>/<first_seq:020d>.jsonl``; the segment being written lives in
``<directory>/<node_id>/.active/`` so Spark's file source (which reads each file once) only ever sees
complete files, which appear there by atomic rename.

The sink runs on the broker's event loop: it is not thread-safe, it reads no clock (time is passed in) and it
never raises on I/O errors after construction. Only the publishing of a rolled segment (its fsyncs and rename)
runs on a thread of its own, one segment after another in the order they rolled.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import orjson

from tridentmq_core.audit import SCHEMA_VERSION

__all__ = ["FileAuditSink"]

_log = logging.getLogger("tridentmq.audit")

_ACTIVE_DIR = ".active"
_SUFFIX = ".jsonl"
_SEQ_DIGITS = 20
_TAIL_CHUNK = 64 * 1024
_APPEND_NEWLINE = orjson.OPT_APPEND_NEWLINE


class FileAuditSink:
    """Writes the audit stream of one node into segment files (see the module docstring).

    Events are buffered in memory and written when the buffer exceeds ``flush_bytes``, on ``flush`` (the
    server calls it before it sends what an event-loop turn produced, confirms included), on ``tick``, on roll
    and on close; files are fsynced only when a segment is sealed. A killed process therefore loses no event
    that a client could have seen the outcome of (an OS crash can lose the unsynced tail), and the next start
    continues after the last seq that reached the file, so seqs stay gap-free and are never reused.

    A rolled segment is published (fsync, rename, fsync of the folder) by a thread of its own: on the event
    loop, each roll held every client of the node for the 20-35 ms of its fsyncs, and under a heavy message
    load a 64 MiB segment rolls about once a second. ``close`` waits for them all; a segment a kill left
    unpublished stays in ``.active/`` and the next start publishes it.
    """

    def __init__(
        self,
        directory: Path,
        node_id: str,
        *,
        epoch: int = 0,
        roll_bytes: int = 64 * 1024 * 1024,
        roll_seconds: float = 60.0,
        heartbeat_seconds: float = 10.0,
        flush_bytes: int = 256 * 1024,
    ) -> None:
        if not node_id or node_id.startswith(".") or "/" in node_id or os.sep in node_id:
            # A leading dot would hide the node's segments from Spark; a separator would nest directories.
            raise ValueError(f"invalid audit node id {node_id!r}")
        if roll_bytes <= 0 or roll_seconds <= 0 or heartbeat_seconds <= 0 or flush_bytes < 0:
            raise ValueError("audit roll/heartbeat/flush settings must be positive")
        self.node_id = node_id
        #: Activation epoch stamped on every event; the server updates it when the node's epoch changes.
        self.epoch = epoch
        #: Events that could not be written. The seq gap in the stream reveals the same loss to readers.
        self.dropped = 0
        self._node_dir = Path(directory) / node_id
        self._active_dir = self._node_dir / _ACTIVE_DIR
        self._roll_bytes = roll_bytes
        self._roll_us = int(roll_seconds * 1_000_000)
        self._heartbeat_us = int(heartbeat_seconds * 1_000_000)
        self._flush_bytes = flush_bytes
        # One growing buffer, not a list of lines: each line leaves orjson in a fresh bytes object that the
        # allocator can reuse at once only if nothing keeps it (kept in a list they cost 2 µs per event).
        self._buf = bytearray()
        self._buf_lines = 0
        self._buf_first_seq = 0
        # The active file is opened lazily at the first flush of a segment, named after the first seq it
        # holds, so an idle node never creates (or publishes) an empty segment.
        self._fd: int | None = None
        self._path: Path | None = None
        self._file_bytes = 0  # bytes known to be completely written to the active file
        self._seg_start_us: int | None = None  # event time of the segment's first line; None = empty segment
        self._last_heartbeat_us: int | None = None
        self._reported: set[tuple[str, str]] = set()
        self._report_lock = threading.Lock()  # reports come from the publisher's thread too
        self._publisher = _Publisher(self._node_dir, self._report)
        self._closed = False
        self._broken = False
        self._next_seq = 0
        try:
            self._next_seq = self._recover()
        except (OSError, ValueError) as exc:
            # Without a readable log we cannot know the next seq, and reusing one would break the
            # (node_id, seq) dedup key downstream, so this sink writes nothing and counts every event dropped.
            self._broken = True
            self._report("recover", exc)

    @property
    def next_seq(self) -> int:
        """The seq the next event will carry."""
        return self._next_seq

    # ------------------------------------------------------------------ AuditSink

    def emit(self, ts_us: int, event: str, fields: Mapping[str, object]) -> None:
        """Append one event to the in-memory buffer (no syscall unless a flush or roll is due)."""
        if not self._accepting(ts_us):
            return
        seq = self._next_seq
        record: dict[str, object] = {
            "v": SCHEMA_VERSION,
            "node_id": self.node_id,
            "seq": seq,
            "ts_us": ts_us,
            "event": event,
            "epoch": self.epoch,
        }
        _merge(record, fields)
        self._append(seq, ts_us, record)

    def emit_message(
        self,
        ts_us: int,
        event: str,
        queue: str | None,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        extra: Mapping[str, object],
    ) -> None:
        """``emit`` for a message event: the record in one go, without ``emit``'s checks of each field (a
        tenth of the core's work per durable message went to its audit events)."""
        if not self._accepting(ts_us):
            return
        seq = self._next_seq
        record: dict[str, object] = {
            "v": SCHEMA_VERSION,
            "node_id": self.node_id,
            "seq": seq,
            "ts_us": ts_us,
            "event": event,
            "epoch": self.epoch,
            "address": address,
            "message_id": message_id,
            "size": size,
            "protocol": protocol,
            "sent_ts_us": sent_ts_us,
        }
        if queue is not None:
            record["queue"] = queue
        if extra:
            _merge(record, extra)
        self._append(seq, ts_us, record)

    def emit_delivered(
        self,
        ts_us: int,
        queue: str,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        delivery_count: int,
        conn_id: str,
        consumer_id: str,
        client_id: str | None,
        origin_message_id: str | None = None,
    ) -> None:
        """``emit`` for ``msg.delivered``, the record built in one go like ``emit_message``'s."""
        if not self._accepting(ts_us):
            return
        seq = self._next_seq
        record: dict[str, object] = {
            "v": SCHEMA_VERSION,
            "node_id": self.node_id,
            "seq": seq,
            "ts_us": ts_us,
            "event": "msg.delivered",
            "epoch": self.epoch,
            "address": address,
            "queue": queue,
            "message_id": message_id,
            "size": size,
            "protocol": protocol,
            "sent_ts_us": sent_ts_us,
            "delivery_count": delivery_count,
            "conn_id": conn_id,
            "consumer_id": consumer_id,
        }
        if client_id is not None:
            record["client_id"] = client_id
        if origin_message_id is not None:
            record["origin_message_id"] = origin_message_id
        self._append(seq, ts_us, record)

    def emit_acked(
        self,
        ts_us: int,
        queue: str,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        conn_id: str | None,
        consumer_id: str | None,
        client_id: str | None,
        origin_message_id: str | None = None,
    ) -> None:
        """``emit`` for ``msg.acked``, the record built in one go like ``emit_delivered``'s."""
        if not self._accepting(ts_us):
            return
        seq = self._next_seq
        record: dict[str, object] = {
            "v": SCHEMA_VERSION,
            "node_id": self.node_id,
            "seq": seq,
            "ts_us": ts_us,
            "event": "msg.acked",
            "epoch": self.epoch,
            "address": address,
            "message_id": message_id,
            "size": size,
            "protocol": protocol,
            "sent_ts_us": sent_ts_us,
            "queue": queue,
        }
        if conn_id is not None:
            record["conn_id"] = conn_id
        if consumer_id is not None:
            record["consumer_id"] = consumer_id
        if client_id is not None:
            record["client_id"] = client_id
        if origin_message_id is not None:
            record["origin_message_id"] = origin_message_id
        self._append(seq, ts_us, record)

    def _accepting(self, ts_us: int) -> bool:
        """Whether an event at ``ts_us`` is written (a segment that has grown too old is rolled first)."""
        if self._closed:
            return False
        if self._broken:
            self.dropped += 1
            return False
        if self._seg_start_us is not None and ts_us - self._seg_start_us >= self._roll_us:
            self._roll()
        return True

    def _append(self, seq: int, ts_us: int, record: dict[str, object]) -> None:
        # default=str keeps an odd field value (an enum, a UUID) from failing on the hot path.
        buf = self._buf
        if not buf:
            self._buf_first_seq = seq
            if self._seg_start_us is None:
                self._seg_start_us = ts_us
        try:
            buf += orjson.dumps(record, default=str, option=_APPEND_NEWLINE)
        except TypeError:  # an integer beyond 64 bits: written as text, never a failure of the caller's timer
            buf += orjson.dumps(_wide_ints_as_text(record), default=str, option=_APPEND_NEWLINE)
        self._buf_lines += 1
        self._next_seq = seq + 1
        size = len(buf)
        if size > self._flush_bytes or self._file_bytes + size >= self._roll_bytes:
            if self._file_bytes + size >= self._roll_bytes:
                self._roll()
            else:
                self._flush()

    def tick(self, ts_us: int) -> None:
        """Emit a heartbeat when due, roll a segment that has grown too old, and flush the buffer."""
        if self._closed or self._broken:
            return
        if self._last_heartbeat_us is None or ts_us - self._last_heartbeat_us >= self._heartbeat_us:
            self._last_heartbeat_us = ts_us
            self.emit(ts_us, "node.heartbeat", {})
        if self._seg_start_us is not None and ts_us - self._seg_start_us >= self._roll_us:
            self._roll()
        else:
            self._flush()

    def flush(self) -> None:
        """Write the buffered events to the active file (no fsync)."""
        if self._buf and not self._closed:
            self._flush()

    def close(self) -> None:
        """Flush and publish the active segment, wait until every rolled segment is published; later calls are
        ignored."""
        if self._closed:
            return
        if not self._broken:
            self._roll()
        self._closed = True
        self._publisher.close()

    def wait_published(self, timeout: float | None = None) -> bool:
        """Wait until every segment rolled so far is published (or failed to be, reported); False on timeout."""
        return self._publisher.wait(timeout)

    # ------------------------------------------------------------------ writing

    def _flush(self) -> None:
        """Write the buffer to the active file; on failure drop it (the seq gap shows the loss)."""
        if not self._buf:
            return
        data, lines = bytes(self._buf), self._buf_lines
        self._buf.clear()
        self._buf_lines = 0
        try:
            if self._fd is None:
                path = self._active_dir / _segment_name(self._buf_first_seq)
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                self._path = path
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self._file_bytes += len(data)
        except OSError as exc:
            self.dropped += lines
            self._report("write", exc)
            self._rewind()

    def _rewind(self) -> None:
        """After a failed write, cut the file back to its last complete line so no torn line stays inside."""
        if self._fd is not None and self._file_bytes > 0:
            try:
                os.ftruncate(self._fd, self._file_bytes)
            except OSError as exc:
                # Stop appending to this file: its torn tail stays last, and the next start cuts it off and
                # publishes the complete lines before it.
                self._report("truncate", exc)
            else:
                return
        # An empty file is discarded so that the next flush names its file after the first seq it holds.
        self._abandon()

    def _abandon(self) -> None:
        """Stop using the active file; keep it in ``.active/`` for recovery unless it holds nothing."""
        fd, path, empty = self._fd, self._path, self._file_bytes == 0
        self._fd, self._path, self._file_bytes = None, None, 0
        if not self._buf:
            self._seg_start_us = None
        try:
            if fd is not None:
                os.close(fd)
            if empty and path is not None:
                path.unlink(missing_ok=True)
        except OSError as exc:
            self._report("close", exc)

    def _roll(self) -> None:
        """Seal the active segment: flush it and hand it to the publisher (fsync, rename into the visible folder,
        fsync the folder)."""
        self._flush()
        path, has_lines = self._path, self._file_bytes > 0
        self._abandon()
        self._seg_start_us = None
        if path is None or not has_lines:
            return
        self._publisher.publish(path)

    def _report(self, op: str, exc: BaseException) -> None:
        """Log each distinct failure once: a full disk must not flood the log at the event rate."""
        key = (op, f"{type(exc).__name__}:{getattr(exc, 'errno', None)}")
        with self._report_lock:
            if key in self._reported:
                return
            self._reported.add(key)
        _log.error(
            "audit %s failed for node %s: %s (events dropped so far: %d)",
            op,
            self.node_id,
            exc,
            self.dropped,
        )

    # ------------------------------------------------------------------ restart

    def _recover(self) -> int:
        """Publish what an earlier run left in ``.active/`` and return the seq to continue from."""
        self._active_dir.mkdir(parents=True, exist_ok=True)
        next_seq = 0
        for path in sorted(_segments(self._node_dir), reverse=True):
            line = _last_line(path, repair=False)
            if line is not None:  # sealed segments are never empty, but skip one rather than go back
                next_seq = _seq_of(line) + 1
                break
        # Normally at most one active segment; more remain only if publishing failed in an earlier run.
        for path in sorted(_segments(self._active_dir)):
            line = _last_line(path, repair=True)
            if line is None:
                path.unlink()
                continue
            next_seq = max(next_seq, _seq_of(line) + 1)
            _seal(path, self._node_dir)
        return next_seq


class _Publisher:
    """Publishes rolled segments on a thread of its own, in the order they rolled. A segment that fails to be
    published is reported and stays in ``.active/``, for the next start's recovery."""

    def __init__(self, folder: Path, report: Callable[[str, BaseException], None]) -> None:
        self._folder = folder
        self._report = report
        self._paths: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0  # handed over and not published (nor failed) yet
        self._thread: threading.Thread | None = None  # started by the first roll

    def publish(self, path: Path) -> None:
        with self._done:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="audit-publisher", daemon=True)
            self._thread.start()
        self._paths.put(path)

    def wait(self, timeout: float | None = None) -> bool:
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Publish what was handed over, then end the thread."""
        if self._thread is not None:
            self._paths.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (path := self._paths.get()) is not None:
            try:
                _seal(path, self._folder)
            except OSError as exc:
                self._report("publish", exc)
            except Exception:  # noqa: BLE001 - a bug: this segment waits for the next start, the next ones go on
                _log.exception("audit segment %s not published", path.name)
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()


def _wide_ints_as_text(value: object) -> object:
    """``value`` with integers JSON cannot carry as 64-bit numbers turned into their decimal text."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return str(value)
    if isinstance(value, dict):
        return {k: _wide_ints_as_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wide_ints_as_text(v) for v in value]
    return value


def _merge(record: dict[str, object], fields: Mapping[str, object]) -> None:
    for key, value in fields.items():
        # The header fields are owned by the sink: a caller must not be able to forge seq or node_id.
        if value is not None and key not in record:
            record[key] = value


def _segment_name(first_seq: int) -> str:
    return f"{first_seq:0{_SEQ_DIGITS}d}{_SUFFIX}"


def _segments(folder: Path) -> list[Path]:
    """Segment files in ``folder``, ignoring anything else (the hidden folder, stray files)."""
    return [
        p
        for p in folder.iterdir()
        if p.name.endswith(_SUFFIX)
        and len(p.name) == _SEQ_DIGITS + len(_SUFFIX)
        and p.name[:_SEQ_DIGITS].isdigit()
        and p.is_file()
    ]


def _seal(path: Path, folder: Path) -> None:
    """Make ``path`` durable, then move it atomically into ``folder`` and make the rename durable."""
    with path.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(path, folder / path.name)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _last_line(path: Path, *, repair: bool) -> bytes | None:
    """The last complete line of a segment (without its newline), or None if it has none.

    With ``repair``, bytes after the last newline (a line torn by a crash) are truncated away.
    """
    with path.open("r+b" if repair else "rb") as f:
        size = f.seek(0, os.SEEK_END)
        last_nl = _rfind_newline(f, size)
        if repair and last_nl + 1 < size:
            f.truncate(last_nl + 1)
            os.fsync(f.fileno())
        if last_nl < 0:
            return None
        start = _rfind_newline(f, last_nl) + 1
        f.seek(start)
        return f.read(last_nl - start)


def _rfind_newline(f: BinaryIO, end: int) -> int:
    """Offset of the last ``\\n`` before ``end``, or -1; reads backwards so a 64 MiB segment costs little."""
    pos = end
    while pos > 0:
        start = max(0, pos - _TAIL_CHUNK)
        f.seek(start)
        i = f.read(pos - start).rfind(b"\n")
        if i >= 0:
            return start + i
        pos = start
    return -1


def _seq_of(line: bytes) -> int:
    record = json.loads(line)
    seq = record.get("seq") if isinstance(record, dict) else None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValueError(f"audit line without a valid seq: {line[:200]!r}")
    return seq
