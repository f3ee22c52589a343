"""Page files: where a queue over its address's size limit keeps further messages until consumers catch up.

A paging queue writes a series of page files, each closed at ``PAGE_FILE_BYTES``: each message is a 4-byte
length and its msgpack encoding. Messages come back in the order they were paged, and a page file read to
its end is deleted at once, so disk space returns as consumers catch up.

Disk work never runs on the event loop: writes, read-ahead and deletions are jobs for one I/O thread,
taken in order (so a read-ahead sees every write submitted before it). Deleting a file, or reading one
that left the page cache, can block for seconds on a busy disk; on the loop that would stall every link
past its heartbeat timeout. The loop keeps a small read-ahead per queue and is told when more is ready.

A queue's page file is open only while the I/O thread uses it: the node keeps at most a bounded number of
them open (``OpenPageFiles``), closing the one used least recently, so thousands of paging queues cannot use
up the process's file descriptors (which the links and the journal need: a journal that cannot open its next
segment stops the node).

Page files only relieve memory: durable messages are in the journal as well, so the paging directory is
cleared at start and recovery pages again as needed. A write that fails (the disk full) keeps its bytes in
memory, where reading finds them in their place: nothing paged is lost, and the queue goes on.
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import shutil
import struct
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Final, Protocol

import msgpack

from tridentmq_shared.message import WireMessage

log = logging.getLogger("tridentmq.core.paging")

_LENGTH: Final = struct.Struct(">I")
#: A page file is closed once it holds this much (Artemis' page-size-bytes is 10 MiB).
PAGE_FILE_BYTES: Final = 16 * 1024 * 1024
#: Paged bytes a queue buffers before handing them to the I/O thread.
WRITE_BUFFER_BYTES: Final = 256 * 1024
#: Bytes a queue reads ahead of its consumers in one job.
READ_AHEAD_BYTES: Final = 1024 * 1024
#: Writes handed to the I/O thread and not yet done above which the broker withholds publish credit, so a
#: disk slower than the producers slows the producers instead of filling memory ...
BACKLOG_BYTES: Final = 8 * 1024 * 1024
#: ... and the hard cap, reached only by publishes already under way: the loop then waits for the disk.
MAX_BACKLOG_BYTES: Final = 4 * BACKLOG_BYTES
#: Page files a node keeps open at most (fewer under a low limit of open files: a quarter of it).
MAX_OPEN_PAGE_FILES: Final = 1024

Job = Callable[[], None]


class PageIO(Protocol):
    """Runs page file jobs in submission order."""

    def submit(self, job: Job, size: int = 0) -> None: ...
    def done(self, size: int) -> None: ...
    def barrier(self) -> None: ...
    def notify(self, callback: Job) -> None: ...
    def behind(self) -> bool: ...


class InlineIO:
    """Runs each job at once on the caller's thread (tests and tools: no loop to protect)."""

    def submit(self, job: Job, size: int = 0) -> None:
        job()

    def done(self, size: int) -> None:
        pass

    def barrier(self) -> None:
        pass

    def notify(self, callback: Job) -> None:
        pass  # the caller collects read-ahead results right after submitting

    def behind(self) -> bool:
        return False


class ThreadIO:
    """One daemon thread; ``call_in_loop`` hands a callable to the event loop (``call_soon_threadsafe``)."""

    def __init__(self, call_in_loop: Callable[[Job], None]) -> None:
        self._call_in_loop = call_in_loop
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._pending = 0  # bytes of submitted writes not yet done
        self._room = threading.Condition()
        threading.Thread(target=self._run, name="page-io", daemon=True).start()

    def submit(self, job: Job, size: int = 0) -> None:
        if size:
            with self._room:  # a disk far behind the producers: wait rather than buffer without bound
                self._room.wait_for(lambda: self._pending < MAX_BACKLOG_BYTES)
                self._pending += size
        self._jobs.put(job)

    def done(self, size: int) -> None:
        with self._room:
            was_behind = self._pending >= BACKLOG_BYTES
            self._pending -= size
            self._room.notify_all()
        if was_behind and self._pending < BACKLOG_BYTES:
            self._call_in_loop(_nothing)  # a flush on the loop gives blocked producers their credit back

    def barrier(self) -> None:
        finished = threading.Event()
        self._jobs.put(finished.set)
        finished.wait()

    def notify(self, callback: Job) -> None:
        self._call_in_loop(callback)

    def behind(self) -> bool:
        """Whether producers should wait for the disk (read from the loop thread: one int, no lock)."""
        return self._pending >= BACKLOG_BYTES

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a full or failing disk: say so and keep serving the other queues
                log.exception("page file job failed")


class OpenPageFiles:
    """The page files open now, least recently used first; opening one more than ``limit`` closes the first.
    Used by the I/O thread (and by the loop thread in ``peek``, once the I/O thread has nothing to do)."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is None:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            limit = MAX_OPEN_PAGE_FILES if soft == resource.RLIM_INFINITY else min(MAX_OPEN_PAGE_FILES, soft // 4)
        self.limit = max(1, limit)
        self._open: OrderedDict[_PageFile, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def fd(self, page: _PageFile) -> int:
        """``page``'s descriptor, opening it (made empty at its first opening) when it is closed."""
        with self._lock:
            if page.fd >= 0:
                self._open.move_to_end(page)
                return page.fd
            flags = os.O_RDWR if page.created else os.O_RDWR | os.O_CREAT | os.O_TRUNC
            page.fd = os.open(page.path, flags, 0o600)
            page.created = True
            self._open[page] = None
            while len(self._open) > self.limit:
                oldest, _ = self._open.popitem(last=False)
                os.close(oldest.fd)
                oldest.fd = -1
            return page.fd

    def close(self, page: _PageFile) -> None:
        with self._lock:
            if page.fd >= 0:
                del self._open[page]
                os.close(page.fd)
                page.fd = -1


class _PageFile:
    __slots__ = ("browsers", "created", "fd", "files", "path", "read_offset", "retired", "size", "unwritten")

    def __init__(self, path: Path, files: OpenPageFiles) -> None:
        self.path = path
        self.files = files
        self.fd = -1  # open while ``files`` keeps it open
        self.created = False  # by the I/O thread's first write
        self.size = 0  # bytes submitted for writing
        self.read_offset = 0  # bytes read back and collected
        #: Writes that failed, by offset: their bytes, until read and needed by no browse (the I/O thread's, or the
        #: loop's in ``peek``; whether they are still needed is decided on the loop, where browses start).
        self.unwritten: dict[int, bytes] = {}
        self.browsers = 0  # browses that still have to read it (see PagedBrowse)
        self.retired = False  # the queue is done with it: deleted once no browse needs it


def _retire(page: _PageFile, io: PageIO) -> None:
    """The queue is done with ``page``: delete it, or let the last browse that reads it do so."""
    page.retired = True
    if not page.browsers:
        io.submit(partial(_delete, page))


class FilePager:
    """The page files of one queue (implements the ``Pager`` protocol of ``queues.py``).

    All methods run on the loop thread; ``on_ready`` is called there when read-ahead arrives that ``read``
    could not return earlier.
    """

    def __init__(
        self,
        directory: Path,
        queue_name: str,
        io: PageIO,
        on_ready: Job,
        files: OpenPageFiles,
        file_bytes: int = PAGE_FILE_BYTES,
    ) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in queue_name)[:64]
        self._prefix = f"{safe}-{uuid.uuid4().hex[:8]}"
        self._directory = directory
        self._io = io
        self._on_ready = on_ready
        self._open_files = files
        self._file_bytes = file_bytes
        self._files: deque[_PageFile] = deque()  # oldest (being read) first, newest (being written) last
        self._serial = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._ready: deque[WireMessage] = deque()  # read ahead, in order
        # Per read-ahead chunk still in ``_ready``: [its messages left, their page bytes left]; read-ahead stops
        # while ``_ready_bytes`` (their sum) is a chunk or more, so a backlog is read back as it is consumed.
        self._chunks: deque[list[int]] = deque()
        self._ready_bytes = 0
        # (page, messages, offset after them) from the I/O thread; appended there, taken here
        self._results: deque[tuple[_PageFile, list[WireMessage], int]] = deque()
        self._reading = False  # a read-ahead job is submitted and not yet collected
        self._closed = False
        self._write_failed = False  # the last write failed (the I/O thread's): logged once until one succeeds
        self.count = 0  # messages paged and not yet returned by read()

    @property
    def files(self) -> list[Path]:
        return [page.path for page in self._files]

    # ------------------------------------------------------------------ writing
    def append(self, message: WireMessage) -> None:
        data: bytes = msgpack.packb(message)
        self._pending.append(_LENGTH.pack(len(data)))
        self._pending.append(data)
        self._pending_bytes += _LENGTH.size + len(data)
        self.count += 1
        if self._pending_bytes >= WRITE_BUFFER_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        if not self._files or self._files[-1].size >= self._file_bytes:
            self._serial += 1
            path = self._directory / f"{self._prefix}-{self._serial:06d}.page"
            self._files.append(_PageFile(path, self._open_files))
        page = self._files[-1]
        data = b"".join(self._pending)
        offset = page.size
        page.size += len(data)
        self._pending.clear()
        self._pending_bytes = 0
        io = self._io

        def write() -> None:
            try:
                error = _write(page, data, offset)
                if error is not None:
                    page.unwritten[offset] = data  # read back from memory in its place: nothing paged is lost
                self._report_write(page, error)
            finally:
                io.done(len(data))

        io.submit(write, len(data))

    def _report_write(self, page: _PageFile, error: OSError | None) -> None:
        """On the I/O thread: log the first failed write, and the first that succeeds after it."""
        if error is not None and not self._write_failed:
            log.error(
                "page file write failed: paged messages are kept in memory until writes succeed",
                extra={"page_file": page.path.name, "reason": error.strerror or str(error)},
            )
        elif error is None and self._write_failed:
            log.info("page file writes again", extra={"page_file": page.path.name})
        self._write_failed = error is not None

    # ------------------------------------------------------------------ reading
    def read(self, limit: int) -> list[WireMessage]:
        """Up to ``limit`` messages, oldest first, from the read-ahead; fewer (even none) while the I/O
        thread is still reading, in which case ``on_ready`` follows."""
        messages = self._take(limit)
        if len(messages) < limit or len(self._ready) < limit:
            self._read_ahead()
            if len(messages) < limit:
                messages += self._take(limit - len(messages))  # done already with inline I/O
        return messages

    def _take(self, limit: int) -> list[WireMessage]:
        self._collect()
        ready = self._ready
        taken = [ready.popleft() for _ in range(min(limit, len(ready)))]
        self.count -= len(taken)
        self._release(len(taken))
        return taken

    def _release(self, taken: int) -> None:
        """Count ``taken`` messages off the chunks they were read in (a chunk's bytes shrink pro rata)."""
        chunks = self._chunks
        while taken and chunks:
            chunk = chunks[0]
            used = min(taken, chunk[0])
            freed = chunk[1] * used // chunk[0]
            chunk[0] -= used
            chunk[1] -= freed
            self._ready_bytes -= freed
            taken -= used
            if not chunk[0]:
                self._ready_bytes -= chunk[1]
                chunks.popleft()

    def _read_ahead(self) -> None:
        if self._reading or self._closed or self.count <= len(self._ready) or self._ready_bytes >= READ_AHEAD_BYTES:
            return
        self._flush()  # what is still buffered must be on its way to the file before reading it back
        page = next((p for p in self._files if p.read_offset < p.size), None)
        if page is None:
            return
        self._reading = True
        start, end = page.read_offset, page.size
        results, io, on_ready = self._results, self._io, self._on_ready

        def read_ahead() -> None:
            try:
                messages, offset = _read(page, start, end, READ_AHEAD_BYTES)
            except Exception:  # a disk that fails reads: no progress, and the next read() tries again
                log.exception("page file read failed", extra={"page_file": page.path.name})
                messages, offset = [], start
            results.append((page, messages, offset))  # always: it ends ``_reading``
            io.notify(on_ready)

        io.submit(read_ahead)

    def _collect(self, *, more: bool = True) -> None:
        while self._results:
            page, messages, offset = self._results.popleft()
            self._reading = False
            if self._closed:
                continue
            if offset == page.read_offset and page.read_offset < page.size:
                more = False  # no progress (a failed read): not again at once, but at the next read()
            self._ready.extend(messages)
            if messages:
                self._chunks.append([len(messages), offset - page.read_offset])
                self._ready_bytes += offset - page.read_offset
            page.read_offset = offset
            if page.unwritten and not page.browsers:
                # What failed to write and is now read is no longer needed, unless a browse still reads it. Decided
                # here, on the loop, where browses start: a browse started from now on reads from ``offset`` on.
                # The I/O thread, which owns ``unwritten``, drops it after the jobs already given to it.
                self._io.submit(partial(_forget_read, page, offset))
            if offset == page.size:  # read to its end, and nothing more was written to it
                self._files.remove(page)
                _retire(page, self._io)
        if more:
            self._read_ahead()  # keep a chunk read ahead of the consumers while anything is paged

    def peek(self) -> Iterator[WireMessage]:
        """Every paged message, oldest first, without removing any (for compaction's snapshot). Reads the
        page files on the caller's thread, once the I/O thread has finished what it was given."""
        self._flush()
        self._io.barrier()
        self._collect(more=False)
        yield from list(self._ready)
        for page in list(self._files):
            if page.read_offset < page.size:
                messages, offset = _read(page, page.read_offset, page.size, page.size)
                if offset < page.size:  # a snapshot without them would drop them from the journal
                    raise OSError(f"page file {page.path.name} could not be read back whole")
                yield from messages

    def close(self) -> None:
        self._closed = True
        self._pending.clear()
        self._pending_bytes = 0
        self._ready.clear()
        self._chunks.clear()
        self._ready_bytes = 0
        self.count = 0
        while self._files:
            _retire(self._files.popleft(), self._io)

    def browse(self) -> PagedBrowse:
        """What is paged now, for a browser, read back for it alone: the queue's own reading takes nothing from
        it, and the page files it needs stay until it has read them."""
        self._flush()  # the buffered messages go to the file, ahead of the browse's reads
        self._collect(more=False)
        ranges = [(page, page.read_offset, page.size) for page in self._files if page.read_offset < page.size]
        for page, _, _ in ranges:
            page.browsers += 1
        return PagedBrowse(list(self._ready), ranges, self._io, self._on_ready)


class PagedBrowse:
    """A browser's copy of what a queue had paged when it subscribed, read a chunk at a time on the I/O thread
    (``on_ready`` follows each chunk that ``take`` could not return at once)."""

    def __init__(
        self, ready: list[WireMessage], ranges: list[tuple[_PageFile, int, int]], io: PageIO, on_ready: Job
    ) -> None:
        self._batch: deque[WireMessage] = deque(ready)
        self._ranges = deque(ranges)  # (page, next offset to read, end) of what is still to read
        self._io = io
        self._on_ready = on_ready
        self._results: deque[tuple[list[WireMessage], int]] = deque()  # appended by the I/O thread
        self._reading = False

    @property
    def done(self) -> bool:
        return not self._batch and not self._ranges

    def take(self) -> WireMessage | None:
        """The next message; None when there is none now (``done``, or still being read)."""
        self._collect()
        if not self._batch and self._ranges and not self._reading:
            self._read()
            self._collect()  # done already with inline I/O
        return self._batch.popleft() if self._batch else None

    def close(self) -> None:
        """The browser is gone: the page files it still needed may go."""
        self._batch.clear()
        while self._ranges:
            self._release(self._ranges.popleft()[0])

    def _read(self) -> None:
        page, start, end = self._ranges[0]
        self._reading = True
        results, on_ready = self._results, self._on_ready

        def read() -> None:
            try:
                messages, offset = _read(page, start, end, READ_AHEAD_BYTES)
            except Exception:  # a disk that fails reads: the browse ends this file here
                log.exception("page file read for a browser failed", extra={"page_file": page.path.name})
                messages, offset = [], start
            results.append((messages, offset))
            self._io.notify(on_ready)

        self._io.submit(read)

    def _collect(self) -> None:
        while self._results:
            messages, offset = self._results.popleft()
            self._reading = False
            if not self._ranges:
                continue  # closed meanwhile
            page, start, end = self._ranges[0]
            self._batch.extend(messages)
            if start < offset < end:
                self._ranges[0] = (page, offset, end)
            else:  # read to its end, or no progress (the file failed or is gone): done with it
                self._ranges.popleft()
                self._release(page)

    def _release(self, page: _PageFile) -> None:
        page.browsers -= 1
        if not page.browsers and page.retired:
            self._io.submit(partial(_delete, page))


def _write(page: _PageFile, data: bytes, offset: int) -> OSError | None:
    """Write ``data`` at ``offset`` of the page (opened at its first write); the error, if one stopped it."""
    try:
        fd = page.files.fd(page)
        written = 0
        while written < len(data):  # a short write (the disk filling up) goes on where it stopped
            written += os.pwrite(fd, data[written:], offset + written)
    except OSError as exc:
        return exc
    return None


def _read(page: _PageFile, start: int, end: int, budget: int) -> tuple[list[WireMessage], int]:
    """Whole messages from ``start``, about ``budget`` bytes of them (at least one), and where they end;
    short data (what was never written) ends them early rather than failing."""
    data = _fetch(page, start, min(end - start, budget))
    messages: list[WireMessage] = []
    pos = 0
    while len(data) - pos >= _LENGTH.size:  # a message's length cut by the budget waits for the next read
        (size,) = _LENGTH.unpack_from(data, pos)
        stop = pos + _LENGTH.size + size
        if stop > len(data):
            if messages or stop > end - start:
                break
            data += _fetch(page, start + len(data), stop - len(data))  # one message larger than the budget
            if stop > len(data):
                break
        messages.append(msgpack.unpackb(data[pos + _LENGTH.size : stop], raw=False, strict_map_key=False))
        pos = stop
    return messages, start + pos


def _fetch(page: _PageFile, offset: int, length: int) -> bytes:
    """``length`` bytes of the page from ``offset``: from the file, with the writes that failed in place."""
    data = os.pread(page.files.fd(page), length, offset) if page.created else b""
    if not page.unwritten:
        return data
    buffer = bytearray(data.ljust(length, b"\0"))
    covered = len(data)
    for at, chunk in list(page.unwritten.items()):
        low, high = max(at, offset), min(at + len(chunk), offset + length)
        if low < high:
            buffer[low - offset : high - offset] = chunk[low - at : high - at]
            covered = max(covered, high - offset)
    return bytes(buffer[:covered])


def _forget_read(page: _PageFile, offset: int) -> None:
    """Drop the failed writes of ``page`` that end at or before ``offset`` (read back, and no browse needs them)."""
    for at in [at for at, chunk in page.unwritten.items() if at + len(chunk) <= offset]:
        del page.unwritten[at]


def _nothing() -> None:
    pass


def _delete(page: _PageFile) -> None:
    page.unwritten.clear()
    page.files.close(page)
    page.path.unlink(missing_ok=True)


class PageDirectory:
    """Creates the pagers of a node; everything paged before a restart is discarded at start."""

    def __init__(self, directory: Path, io: PageIO | None = None, open_files: OpenPageFiles | None = None) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.directory = directory
        self.io: PageIO = io or InlineIO()
        self.open_files = open_files or OpenPageFiles()

    def pager(self, queue_name: str, on_ready: Job) -> FilePager:
        return FilePager(self.directory, queue_name, self.io, on_ready, self.open_files)
