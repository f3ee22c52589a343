"""Paging: a queue over its address's size limit keeps further messages in a page file, in order."""

from __future__ import annotations

import errno
import os
import queue
import resource
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.disks import fill, tmpfs
from tests.unit.broker_harness import Harness, bodies, ids, ok

from tridentmq_core.queues import MESSAGE_OVERHEAD
from tridentmq_core.settings import AddressSettingsEntry, CoreSettings
from tridentmq_core.store.journal import Journal, MessageReader
from tridentmq_core.store.paging import (
    READ_AHEAD_BYTES,
    FilePager,
    InlineIO,
    OpenPageFiles,
    PagedBrowse,
    PageDirectory,
    ThreadIO,
)
from tridentmq_core.store.records import RecordType
from tridentmq_core.store.recovery import RecoveredState, replay
from tridentmq_shared.link import events as ev
from tridentmq_shared.message import M_BODY, M_ID, WireMessage, new_message

BODY = b"x" * 1000
PER_MESSAGE = len(BODY) + MESSAGE_OVERHEAD


def paging_harness(tmp_path: Path, limit: int) -> Harness:
    settings = CoreSettings(address_settings=[AddressSettingsEntry(match="#", max_size_bytes=limit)])
    return Harness(settings, pager_factory=PageDirectory(tmp_path / "paging").pager)


def test_pager_round_trip_peek_and_page_files_deleted_as_read(tmp_path: Path) -> None:
    pager = FilePager(
        tmp_path, "orders/eu", InlineIO(), on_ready=lambda: None, files=OpenPageFiles(), file_bytes=64 * 1024
    )
    messages = [new_message("q", str(n).encode() * (n % 7 + 1) + bytes(n % 3000)) for n in range(5000)]
    for message in messages:
        pager.append(message)
    assert pager.count == 5000
    assert [m[M_BODY] for m in pager.peek()] == [m[M_BODY] for m in messages]
    assert pager.count == 5000  # peeking takes nothing
    files = pager.files
    assert len(files) >= 5  # a file closes at the first write past file_bytes
    got = []
    while pager.count:
        got.extend(pager.read(700))
        assert all(not f.exists() for f in files[: len(files) - len(pager.files)])  # read ones are gone
    assert [m[M_BODY] for m in got] == [m[M_BODY] for m in messages]
    assert not list(tmp_path.iterdir())  # drained: every page file gave its space back
    pager.append(messages[0])
    assert [m[M_BODY] for m in pager.read(10)] == [messages[0][M_BODY]]
    pager.append(messages[1])
    pager.close()
    assert not list(tmp_path.iterdir())


def test_pager_reads_a_message_larger_than_its_read_chunk(tmp_path: Path) -> None:
    pager = FilePager(tmp_path, "big", InlineIO(), on_ready=lambda: None, files=OpenPageFiles())
    messages = [new_message("q", bytes([n]) * (3 << 20)) for n in range(3)] + [new_message("q", b"tail")]
    for message in messages:
        pager.append(message)
    first = pager.read(5)
    assert len(first) == 1  # one 3 MiB message is more than a read-ahead's budget: it comes alone
    got = first + pager.read(5) + pager.read(5) + pager.read(5)
    assert [m[M_BODY] for m in got] == [m[M_BODY] for m in messages]
    pager.close()


def test_a_backlog_is_read_back_as_it_is_consumed_not_all_at_once(tmp_path: Path) -> None:
    """Every read went on reading ahead while anything was paged, however much was read ahead already: a
    consumer taking 10 at a time had the whole 20 MiB backlog in memory (its page files deleted as read)
    after a tenth of it. The read-ahead now stays about a chunk ahead of what was taken."""
    pager = FilePager(tmp_path, "q", InlineIO(), on_ready=lambda: None, files=OpenPageFiles(), file_bytes=256 * 1024)
    messages = [new_message("q", n.to_bytes(4, "big") + bytes(2000)) for n in range(10_000)]
    for message in messages:
        pager.append(message)
    paged = sum(path.stat().st_size for path in pager.files)
    got: list[WireMessage] = []
    for _ in range(100):
        got += pager.read(10)
        left_on_disk = sum(path.stat().st_size for path in pager.files if path.exists())
        taken_bytes = len(got) * paged // len(messages)
        assert paged - left_on_disk <= taken_bytes + 3 * READ_AHEAD_BYTES
    while pager.count:
        got += pager.read(700)
    assert [m[M_BODY] for m in got] == [m[M_BODY] for m in messages]
    pager.close()
    assert not list(tmp_path.iterdir())


def read_all(
    pager: FilePager, loop: queue.SimpleQueue[Callable[[], None]], count: int, batch: int
) -> list[WireMessage]:
    """``count`` messages read ``batch`` at a time, running the read-ahead's callbacks as the loop would."""
    got: list[WireMessage] = []
    while len(got) < count:
        taken = pager.read(batch)
        got.extend(taken)
        if not taken:
            loop.get(timeout=10)()  # the read-ahead finished
    return got


def test_with_the_io_thread_reads_come_back_through_on_ready_in_order(tmp_path: Path) -> None:
    """The real thread: ``read`` never waits for the disk; what it could not return arrives via on_ready."""
    loop: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # stands in for call_soon_threadsafe
    ready: list[int] = []
    pager = FilePager(
        tmp_path,
        "q",
        ThreadIO(loop.put),
        on_ready=lambda: ready.append(1),
        files=OpenPageFiles(),
        file_bytes=256 * 1024,
    )
    messages = [new_message("q", n.to_bytes(4, "big") + bytes(2000)) for n in range(3000)]
    for message in messages:
        pager.append(message)
    got = read_all(pager, loop, len(messages), 500)
    assert ready  # reads had to wait at least once
    assert [m[M_BODY] for m in got] == [m[M_BODY] for m in messages]
    assert pager.count == 0
    pager.close()
    io_done = threading.Event()
    pager._io.submit(io_done.set)
    assert io_done.wait(10)
    assert not list(tmp_path.iterdir())


def test_a_browse_reads_its_own_copy_of_the_paged_messages_through_the_io_thread(tmp_path: Path) -> None:
    """While the queue reads its messages back (and deletes the files it read), a browse taken before reads every
    message paged then, in order, from files kept for it until it is done."""
    loop: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
    pager = FilePager(
        tmp_path, "q", ThreadIO(loop.put), on_ready=lambda: None, files=OpenPageFiles(), file_bytes=256 * 1024
    )
    messages = [new_message("q", n.to_bytes(4, "big") + bytes(2000)) for n in range(1000)]
    for message in messages:
        pager.append(message)
    browse = pager.browse()
    assert [m[M_BODY] for m in read_all(pager, loop, len(messages), 300)] == [m[M_BODY] for m in messages]
    browsed: list[WireMessage] = []
    while not browse.done:
        message = browse.take()
        if message is None:
            loop.get(timeout=10)()
        else:
            browsed.append(message)
    assert [m[M_BODY] for m in browsed] == [m[M_BODY] for m in messages]
    io_done = threading.Event()
    pager._io.submit(io_done.set)
    assert io_done.wait(10)
    assert not list(tmp_path.iterdir())  # read by both: deleted


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_paging_queues_keep_at_most_the_limit_of_page_files_open(tmp_path: Path) -> None:
    """Every page file kept a descriptor from its first write until it was read to its end: thousands of paging
    queues (offline persistent sessions, say) used up the process's descriptors, and the journal's next segment
    could then not be opened (which stops the node). Now at most ``limit`` are open, reopened as needed."""
    files = OpenPageFiles(limit=4)
    pagers = [
        FilePager(tmp_path, f"q{n}", InlineIO(), on_ready=lambda: None, files=files, file_bytes=16 * 1024)
        for n in range(30)
    ]
    before = open_descriptors()
    sent: list[list[bytes]] = [[] for _ in pagers]
    for round_ in range(40):  # interleaved, so that each write finds its file closed by the others
        for n, pager in enumerate(pagers):
            body = f"{n}:{round_}".encode() + bytes(1000)
            pager.append(new_message("q", body))
            sent[n].append(body)
            pager._flush()
            assert len(files) <= 4
            assert open_descriptors() <= before + 4
    assert all(len(pager.files) >= 2 for pager in pagers)  # several files each
    browses = [pager.browse() for pager in pagers[:5]]
    for n, pager in enumerate(pagers):
        assert [m[M_BODY] for m in pager.peek()] == sent[n]
        got: list[bytes] = []
        while pager.count:
            got += [m[M_BODY] for m in pager.read(7)]
            assert open_descriptors() <= before + 4
        assert got == sent[n]
    for n, browse in enumerate(browses):
        browsed: list[bytes] = []
        while not browse.done:
            message = browse.take()
            assert message is not None
            browsed.append(message[M_BODY])
        assert browsed == sent[n]
        assert open_descriptors() <= before + 4
    for pager in pagers:
        pager.close()
    assert not list(tmp_path.iterdir())
    assert len(files) == 0
    assert open_descriptors() == before


def test_with_the_io_thread_a_file_closed_for_another_queue_is_reopened_where_it_was(tmp_path: Path) -> None:
    loop: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
    io, files = ThreadIO(loop.put), OpenPageFiles(limit=1)
    pagers = [
        FilePager(tmp_path, f"q{n}", io, on_ready=lambda: None, files=files, file_bytes=64 * 1024) for n in range(3)
    ]
    messages = [[new_message("q", f"{n}:{i}".encode() + bytes(3000)) for i in range(300)] for n in range(3)]
    for i in range(300):
        for pager, own in zip(pagers, messages, strict=True):
            pager.append(own[i])
    for pager, own in zip(pagers, messages, strict=True):
        assert [m[M_BODY] for m in read_all(pager, loop, len(own), 64)] == [m[M_BODY] for m in own]
        pager.close()
    io_done = threading.Event()
    io.submit(io_done.set)
    assert io_done.wait(10)
    assert not list(tmp_path.iterdir())
    assert len(files) == 0


def test_the_limit_of_open_page_files_follows_the_process_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert OpenPageFiles().limit == min(1024, soft // 4)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "tiny", "1m") as mount:
        yield mount


def test_page_writes_that_find_the_disk_full_lose_nothing(tiny_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    """About 2 MB paged into 1 MiB: the writes that fail keep their bytes in memory, so the queue reads every
    message back in order (it used to stop reading for good, and ``peek`` raised on the loop); said once."""
    loop: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # stands in for call_soon_threadsafe
    pager = FilePager(
        tiny_disk, "q", ThreadIO(loop.put), on_ready=lambda: None, files=OpenPageFiles(), file_bytes=256 * 1024
    )
    messages = [new_message("q", n.to_bytes(4, "big") + bytes(1000)) for n in range(2000)]
    for message in messages:
        pager.append(message)
    assert [m[M_BODY] for m in pager.peek()] == [m[M_BODY] for m in messages]  # what compaction's snapshot reads
    got = read_all(pager, loop, len(messages), 256)
    assert [m[M_BODY] for m in got] == [m[M_BODY] for m in messages]
    assert pager.count == 0
    failures = [r for r in caplog.records if r.getMessage().startswith("page file write failed")]
    assert len(failures) == 1
    assert failures[0].__dict__["reason"] == os.strerror(errno.ENOSPC)
    pager.close()
    io_done = threading.Event()
    pager._io.submit(io_done.set)
    assert io_done.wait(10)
    assert not list(tiny_disk.iterdir())  # every page file gave its space back


class StepIO:
    """The page I/O thread, one job at a time at the test's word (``run``); ``notify`` goes to ``loop``."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []
        self.loop: list[Callable[[], None]] = []

    def submit(self, job: Callable[[], None], size: int = 0) -> None:
        self.jobs.append(job)

    def done(self, size: int) -> None:
        pass

    def barrier(self) -> None:
        self.run()

    def notify(self, callback: Callable[[], None]) -> None:
        self.loop.append(callback)

    def behind(self) -> bool:
        return False

    def run(self) -> None:
        while self.jobs:
            self.jobs.pop(0)()


class BrowseBeforeResult(deque[tuple[object, list[WireMessage], int]]):
    """A pager's read-ahead results: the loop starts a browse just before the I/O thread hands the first one in."""

    def __init__(self, pager: FilePager) -> None:
        super().__init__()
        self.pager = pager
        self.browse: PagedBrowse | None = None

    def append(self, result: tuple[object, list[WireMessage], int]) -> None:
        if self.browse is None:
            self.browse = self.pager.browse()
        super().append(result)


def test_a_browse_started_as_a_read_ahead_finishes_reads_the_messages_whose_write_failed(tiny_disk: Path) -> None:
    """A read-ahead on the I/O thread dropped the in-memory copy of the failed writes it had read unless a browse
    was counted on the page, and a browse is counted on the loop: one that started after that look and before the
    read-ahead's result was collected began where the queue's reading was before that read-ahead, and found
    neither the file's bytes (never written: the disk was full) nor the copy. It got none of those messages (the
    rest of the file neither). Now what is read and no longer needed is dropped after the loop collected it."""
    fill(tiny_disk)  # every page write fails: the messages are only in memory
    io = StepIO()
    pager = FilePager(tiny_disk, "q", io, on_ready=lambda: None, files=OpenPageFiles(), file_bytes=256 * 1024)
    results = BrowseBeforeResult(pager)
    pager._results = results
    messages = [new_message("q", n.to_bytes(4, "big") + bytes(1000)) for n in range(600)]  # two write buffers
    for message in messages:
        pager.append(message)
    assert pager.read(1) == []  # a read-ahead is submitted behind the writes
    io.run()  # the writes fail, the read-ahead reads from memory; the browse starts just before its result is in
    browse = results.browse
    assert browse is not None
    got = read_all_stepped(pager, io, len(messages))
    assert [m[M_BODY] for m in got] == [m[M_BODY] for m in messages]
    browsed: list[WireMessage] = []
    while not browse.done:
        message = browse.take()
        if message is None:
            assert io.jobs or io.loop, f"browse stalled after {len(browsed)}"
            io.run()
            io.loop.clear()
        else:
            browsed.append(message)
    assert [m[M_BODY] for m in browsed] == [m[M_BODY] for m in messages]
    browse.close()
    pager.close()
    io.run()
    assert not [p for p in tiny_disk.iterdir() if p.name != "filler"]


def read_all_stepped(pager: FilePager, io: StepIO, count: int) -> list[WireMessage]:
    got: list[WireMessage] = []
    while len(got) < count:
        taken = pager.read(100)
        got.extend(taken)
        if not taken:
            assert io.jobs or io.loop, f"read stalled after {len(got)}"
            io.run()
            io.loop.clear()  # on_ready: the next read() collects
    return got


def test_a_queue_pages_past_its_limit_with_bounded_memory_and_drains_in_order(tmp_path: Path) -> None:
    h = paging_harness(tmp_path, limit=20 * PER_MESSAGE)
    c = h.connect()
    c.create_queue("big")
    payloads = [f"{n:05d}".encode() + BODY[5:] for n in range(1000)]
    for start in range(0, 1000, 100):
        c.send_all("big", payloads[start : start + 100])
    queue = h.broker.queues["big"]
    assert len(queue) == 1000
    assert queue.paged >= 1000 - 20
    assert h.broker.memory.used <= 20 * PER_MESSAGE  # the rest is on disk
    cid = c.consumer("big", credit=50)
    received: list[bytes] = []
    while len(received) < 1000:
        got = c.take(cid)
        assert got, f"stalled after {len(received)}"
        received.extend(bodies(got))
        c.ack(cid, ids(got))
        c.flow(cid, len(got))
        assert h.broker.memory.used <= 20 * PER_MESSAGE + 50 * PER_MESSAGE  # limit plus what is in flight
    assert received == payloads
    assert len(queue) == 0
    assert h.broker.memory.used == 0


def test_acks_committed_in_a_transaction_read_pages_back(tmp_path: Path) -> None:
    """Only a plain ack batch read paged messages back: after a commit the consumer, its credit unused, got
    nothing until another event (at best the expiry scan) dispatched the queue."""
    h = paging_harness(tmp_path, limit=5 * PER_MESSAGE)
    c = h.connect()
    c.create_queue("big")
    payloads = [f"{n:03d}".encode() + BODY for n in range(20)]
    c.send_all("big", payloads)
    cid = c.consumer("big", credit=100)
    received: list[bytes] = []
    for tx in range(1, 10):
        got = c.take(cid)
        if not got:
            break
        received.extend(bodies(got))
        ok(c.tx_begin(tx))
        c.ack(cid, ids(got), tx=tx)
        ok(c.tx_commit(tx))
    assert received == payloads


def test_a_last_value_queue_keeps_every_key_in_memory_for_browsers_and_replacement(tmp_path: Path) -> None:
    """A last-value queue (an MQTT gateway's retained messages and session records) paged like any queue: a
    browser saw only the values held in memory, and a paged value was never replaced by a newer one."""
    h = paging_harness(tmp_path, limit=3 * PER_MESSAGE)
    c = h.connect()
    c.create_queue("retained", last_value_key="topic")
    for n in range(10):
        c.publish("retained", b"old" + BODY, properties={"topic": f"t{n}"}, sync=False)
    c.send_all("retained", [b"new" + BODY], properties={"topic": "t9"})
    queue = h.broker.queues["retained"]
    assert (len(queue), queue.paged) == (10, 0)
    cid = c.consumer("retained", browse=True, credit=100)
    seen = {d.props["topic"]: d.body[:3] for d in c.take(cid)}
    assert seen == {**{f"t{n}": b"old" for n in range(9)}, "t9": b"new"}
    assert bodies(c.take(c.consumer("retained", browse=True, selector="topic = 't9'")))[0][:3] == b"new"


def test_a_browser_sees_the_paged_messages_too(tmp_path: Path) -> None:
    """A browser was offered only the messages held in memory: those paged when it subscribed were missing."""
    h = paging_harness(tmp_path, limit=5 * PER_MESSAGE)
    c = h.connect()
    c.create_queue("big")
    payloads = [f"{n:04d}".encode() + BODY for n in range(1000)]
    for start in range(0, 1000, 250):
        c.send_all("big", payloads[start : start + 250])
    browser = c.consumer("big", browse=True, credit=100)
    consumer = c.consumer("big", credit=100)
    browsed: list[bytes] = []
    received: list[bytes] = []
    while len(received) < 1000 or c.events(ev.BrowseDone) == []:
        got = c.take(consumer)
        received.extend(bodies(got))
        c.ack(consumer, ids(got))
        c.flow(consumer, len(got))
        shown = c.take(browser)
        browsed.extend(bodies(shown))
        c.flow(browser, len(shown))
        assert got or shown or len(received) == 1000, (len(received), len(browsed))
    assert received == payloads
    assert browsed == payloads
    assert not list((tmp_path / "paging").iterdir())


def test_a_browser_that_leaves_early_lets_the_page_files_go(tmp_path: Path) -> None:
    h = paging_harness(tmp_path, limit=PER_MESSAGE)
    c = h.connect()
    c.create_queue("big")
    for _ in range(4):
        c.send_all("big", [BODY] * 500)  # past the page writer's buffer
    browser = c.consumer("big", browse=True, credit=10)
    assert len(c.take(browser)) == 10
    ok(c.unsubscribe(browser))
    consumer = c.consumer("big", credit=3000)
    while got := c.take(consumer):
        c.ack(consumer, ids(got))
    assert len(h.broker.queues["big"]) == 0
    assert not list((tmp_path / "paging").iterdir())


def test_a_multicast_address_pages_each_queue_on_its_own(tmp_path: Path) -> None:
    h = paging_harness(tmp_path, limit=5 * PER_MESSAGE)
    c = h.connect()
    c.create_queue("a", "news", 1, durable=False)
    c.create_queue("b", "news", 1, durable=False)
    c.send_all("news", [BODY] * 30, routing=1)
    assert [h.broker.queues[q].paged for q in ("a", "b")] == [25, 25]
    cid = c.consumer("b", credit=100)
    got: list[bytes] = []
    while len(got) < 30:
        batch = c.take(cid)
        assert batch
        got.extend(bodies(batch))
        c.ack(cid, ids(batch))
    assert h.broker.queues["a"].paged == 25  # untouched by the other queue's consumer


def test_compaction_snapshot_includes_paged_messages(tmp_path: Path) -> None:
    h = paging_harness(tmp_path, limit=3 * PER_MESSAGE)
    c = h.connect()
    c.create_queue("kept")
    c.send_all("kept", [f"{n}".encode() + BODY for n in range(10)], durable=True)
    assert h.broker.queues["kept"].paged == 7
    snapshot = h.broker.durable_snapshot()
    assert sorted(m[M_BODY][:1] for m, _, _ in snapshot.messages) == sorted(f"{n}".encode() for n in range(10))


def test_messages_restored_with_delivery_attempts_keep_them_when_paged(tmp_path: Path) -> None:
    """A message restored with delivery attempts (recovery, a move from another node) into a queue over its
    page limit is paged. A compaction's copy wrote it with none: after the next restart its redelivery was
    no longer flagged. An operator's browse showed none either."""
    h = paging_harness(tmp_path, limit=5 * PER_MESSAGE)
    state = RecoveredState()
    state.addresses["q"] = ([0], False)
    state.queues["q"] = {"name": "q", "address": "q", "routing_type": 0}
    state.references["q"] = {}
    for n in range(1, 21):
        message = new_message("q", BODY, durable=True)
        message[M_ID] = n
        state.messages[n] = message
        state.references["q"][n] = 2  # each was delivered twice before the crash
    h.broker.restore(state, h.now_ms)
    queue = h.broker.queues["q"]
    assert queue.paged == 15
    assert {m[M_ID]: counts for m, _, counts in h.broker.durable_snapshot().messages} == {n: [2] for n in range(1, 21)}
    assert [(count, state) for _, count, state in queue.browse_messages()] == [(2, "queued")] * 5 + [(2, "paged")] * 15
    c = h.connect()
    cid = c.consumer("q", credit=100)
    got: list[int] = []
    while len(got) < 20:
        batch = c.take(cid)
        assert batch
        got.extend(d.count for d in batch)
        c.ack(cid, ids(batch))
    assert got == [3] * 20


def test_deleting_a_paging_queue_removes_its_page_file(tmp_path: Path) -> None:
    h = paging_harness(tmp_path, limit=PER_MESSAGE)
    c = h.connect()
    c.create_queue("gone")
    for _ in range(4):
        c.send_all("gone", [BODY] * 500)  # past the page writer's buffer
    assert list((tmp_path / "paging").iterdir())
    c.delete_queue("gone")
    assert not list((tmp_path / "paging").iterdir())


def test_a_paging_queue_is_restored_from_messages_left_in_the_journal_in_order_with_their_counts(
    tmp_path: Path,
) -> None:
    """Replay keeps only where a paging queue's messages are; restore reads them back in id order as the queue
    takes them, and the queue pages those past its limit, as at run time."""
    h = paging_harness(tmp_path, limit=5 * PER_MESSAGE)
    journal = Journal(tmp_path / "journal", segment_bytes=16 * 1024)
    journal.recover()
    journal.start()
    spec = {"name": "q", "address": "q", "routing_type": 0}
    journal.append(RecordType.ADD_ADDRESS, ["q", [0]])
    journal.append(RecordType.ADD_QUEUE, [spec])
    for n in (*range(11, 21), *range(1, 11)):  # a compaction's copy: older ones after newer ones
        message = new_message("q", BODY, durable=True)
        message[M_ID] = n
        journal.append(RecordType.MESSAGE, [message, ["q"], [n % 3]])
    journal.append(RecordType.ACKS, ["q", [4]])
    journal.close()
    state, _ = Journal(tmp_path / "journal").recover(lambda records: replay(records, pages=h.broker.catalog.pages))
    assert state.messages == {}
    assert len(state.located) == 19
    with pytest.raises(ValueError, match="nothing to read them back with"):
        h.broker.restore(state, h.now_ms)
    reader = MessageReader(tmp_path / "journal")
    try:
        h.broker.restore(state, h.now_ms, reader)
    finally:
        reader.close()
    queue = h.broker.queues["q"]
    assert queue.paged == 14
    c = h.connect()
    cid = c.consumer("q", credit=100)
    got: list[tuple[int, int]] = []
    while len(got) < 19:
        batch = c.take(cid)
        assert batch
        got.extend((d.message[M_ID], d.count) for d in batch)
        c.ack(cid, ids(batch))
    assert got == [(n, n % 3 + 1) for n in range(1, 21) if n != 4]
    assert h.broker._next_id == 21  # ids go on after the highest, located ones too
