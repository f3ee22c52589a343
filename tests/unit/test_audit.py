"""Unit tests for the audit stream writer (tridentmq_core.audit)."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from tridentmq_core import audit_writer
from tridentmq_core.audit import AuditSink, NullAuditSink
from tridentmq_core.audit_writer import FileAuditSink

NODE = "node-a"
T0 = 1_700_000_000_000_000  # µs
SECOND = 1_000_000


def sealed(root: Path, node: str = NODE) -> list[Path]:
    return sorted(p for p in (root / node).iterdir() if p.is_file())


def active(root: Path, node: str = NODE) -> list[Path]:
    return sorted((root / node / ".active").iterdir())


def read_lines(path: Path) -> list[dict[str, object]]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), f"{path.name} ends with a torn line"
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def all_records(root: Path, node: str = NODE) -> list[dict[str, object]]:
    return [rec for path in sealed(root, node) for rec in read_lines(path)]


def seqs(records: list[dict[str, object]]) -> list[object]:
    return [r["seq"] for r in records]


def crash(sink: FileAuditSink) -> None:
    """Simulate a kill after the segments rolled so far were published: the OS keeps what was written, the
    in-memory buffer is lost, the active segment is not published."""
    assert sink.wait_published(10)
    if sink._fd is not None:
        os.close(sink._fd)
        sink._fd = None
    sink._closed = True


def test_lines_and_fields(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, epoch=3)
    sink.emit(T0, "msg.sent", {"address": "orders", "message_id": "m1", "size": 12, "queue": None})
    sink.emit(T0 + 1, "msg.acked", {"seq": 999, "node_id": "forged", "sent_ts_us": T0, "client_id": "é"})
    sink.close()

    [path] = sealed(tmp_path)
    raw = path.read_bytes().split(b"\n")
    assert raw[0] == (
        b'{"v":1,"node_id":"node-a","seq":0,"ts_us":1700000000000000,"event":"msg.sent","epoch":3,'
        b'"address":"orders","message_id":"m1","size":12}'
    )
    first, second = read_lines(path)
    assert "queue" not in first  # None-valued fields are omitted
    assert second["seq"] == 1  # header fields cannot be overridden by the caller
    assert second["node_id"] == NODE
    assert second["client_id"] == "é"
    assert second["sent_ts_us"] == T0
    assert path.name == f"{0:020d}.jsonl"


def test_an_integer_beyond_64_bits_is_written_as_text(tmp_path: Path) -> None:
    """Such a value (a timestamp of 2**63-1 turned into microseconds) once stopped the core's timer task."""
    sink = FileAuditSink(tmp_path, NODE)
    sink.emit_message(T0, "msg.expired", "q", "a", "m1", 1, "link", (2**63 - 1) * 1000, {"reason": "ttl"})
    sink.emit(T0 + 1, "queue.expired", {"expires_ms": 2**64, "nested": {"n": [-(2**70), 5]}})
    sink.close()
    first, second = read_lines(sealed(tmp_path)[0])
    assert first["sent_ts_us"] == str((2**63 - 1) * 1000)
    assert (first["seq"], second["seq"]) == (0, 1)
    assert second["expires_ms"] == str(2**64)
    assert second["nested"] == {"n": [str(-(2**70)), 5]}


def test_a_message_event_is_the_event_with_its_fields(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, epoch=3)
    sink.emit_message(T0, "msg.sent", None, "orders", "n1-7", 12, "amqp", T0 - 5, {})
    sink.emit_message(
        T0 + 1,
        "msg.nacked",
        "q",
        "orders",
        "n1-7",
        12,
        "amqp",
        T0 - 5,
        {"delivery_count": 2, "seq": 999, "reason": None},
    )
    sink.close()

    [path] = sealed(tmp_path)
    assert path.read_bytes().split(b"\n")[0] == (
        b'{"v":1,"node_id":"node-a","seq":0,"ts_us":1700000000000000,"event":"msg.sent","epoch":3,'
        b'"address":"orders","message_id":"n1-7","size":12,"protocol":"amqp","sent_ts_us":1699999999999995}'
    )  # no queue: left out
    _, nacked = read_lines(path)
    assert nacked["queue"] == "q"
    assert nacked["delivery_count"] == 2
    assert nacked["seq"] == 1  # the header cannot be forged through the extra fields either
    assert "reason" not in nacked


@pytest.mark.parametrize(
    ("consumer", "origin"),
    [(("c-1", "7", "stomp 127.0.0.1:50412"), None), ((None, None, None), None), (("c-1", "7", None), "n0-3")],
)
def test_an_acked_event_is_the_message_event_with_its_consumer(
    tmp_path: Path, consumer: tuple[str | None, str | None, str | None], origin: str | None
) -> None:
    """``emit_acked`` (no dict of extra fields: one per acknowledged message) writes what ``emit_message`` with
    those fields would, byte for byte; the consumer's fields are left out without a consumer (auto-ack)."""
    conn_id, consumer_id, client_id = consumer
    extra = {"conn_id": conn_id, "consumer_id": consumer_id, "client_id": client_id, "origin_message_id": origin}
    lines = []
    for name, emit in (
        ("general", lambda s: s.emit_message(T0, "msg.acked", "q", "orders", "n1-7", 12, "mqtt", T0 - 5, extra)),
        ("acked", lambda s: s.emit_acked(T0, "q", "orders", "n1-7", 12, "mqtt", T0 - 5, *consumer, origin)),
    ):
        sink = FileAuditSink(tmp_path / name, NODE, epoch=2)
        emit(sink)
        sink.close()
        [path] = sealed(tmp_path / name)
        lines.append(path.read_bytes())
    assert lines[0] == lines[1]
    [record] = read_lines(path)
    assert record["event"] == "msg.acked"
    assert ("conn_id" in record, "origin_message_id" in record) == (conn_id is not None, origin is not None)


def test_epoch_can_change_at_runtime(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, epoch=1)
    sink.emit(T0, "conn.opened", {})
    sink.epoch = 2
    sink.emit(T0, "node.epoch", {})
    sink.close()
    assert [r["epoch"] for r in all_records(tmp_path)] == [1, 2]


def test_emit_buffers_until_tick_or_flush_threshold(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, flush_bytes=1000)
    for i in range(5):
        sink.emit(T0 + i, "msg.sent", {"size": i})
    assert active(tmp_path) == []  # nothing written yet: no syscall per event

    sink.tick(T0 + 10)
    [path] = active(tmp_path)
    assert seqs(read_lines(path)) == [0, 1, 2, 3, 4, 5]  # five events + the first heartbeat

    size = path.stat().st_size
    while path.stat().st_size == size:
        sink.emit(T0 + 20, "msg.sent", {"address": "x" * 50})
    assert path.stat().st_size - size > 1000  # written once the buffer exceeded flush_bytes
    assert sealed(tmp_path) == []


def test_roll_by_size_is_gap_free(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, roll_bytes=1000, flush_bytes=300)
    for i in range(200):
        sink.emit(T0 + i, "msg.delivered", {"queue": "q", "delivery_count": 1})
    sink.close()

    files = sealed(tmp_path)
    assert len(files) > 5
    for path in files[:-1]:
        assert path.stat().st_size >= 1000
    for path in files:  # each file is named after the first seq it holds
        assert path.name == f"{read_lines(path)[0]['seq']:020d}.jsonl"
    assert seqs(all_records(tmp_path)) == list(range(200))
    assert active(tmp_path) == []


def test_roll_by_time_is_gap_free(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, roll_seconds=60, heartbeat_seconds=1000)
    sink.emit(T0, "msg.sent", {})
    sink.emit(T0 + 30 * SECOND, "msg.sent", {})
    sink.emit(T0 + 60 * SECOND, "msg.sent", {})  # segment is 60 s old: rolled before this event
    assert sink.wait_published(10)
    assert [p.name for p in sealed(tmp_path)] == [f"{0:020d}.jsonl"]

    sink.tick(T0 + 100 * SECOND)  # heartbeat joins the young segment
    sink.tick(T0 + 130 * SECOND)  # segment started at +60 s: 70 s old, rolled by tick alone
    assert sink.wait_published(10)
    assert [p.name for p in sealed(tmp_path)] == [f"{0:020d}.jsonl", f"{2:020d}.jsonl"]
    assert active(tmp_path) == []

    sink.tick(T0 + 1100 * SECOND)  # the next heartbeat starts a new segment
    sink.emit(T0 + 1101 * SECOND, "msg.sent", {})
    sink.close()
    records = all_records(tmp_path)
    assert seqs(records) == list(range(6))
    assert [len(read_lines(p)) for p in sealed(tmp_path)] == [2, 2, 2]


_MESSAGE_EMITTERS = {
    "message": lambda s, ts: s.emit_message(ts, "msg.sent", None, "orders", "n1-7", 12, "link", ts, {}),
    "delivered": lambda s, ts: s.emit_delivered(ts, "q", "orders", "n1-7", 12, "link", ts, 1, "c-1", "7", None),
    "acked": lambda s, ts: s.emit_acked(ts, "q", "orders", "n1-7", 12, "link", ts, None, None, None),
}


@pytest.mark.parametrize("emitter", sorted(_MESSAGE_EMITTERS))
def test_message_events_roll_stop_and_drop_as_other_events_do(tmp_path: Path, emitter: str) -> None:
    """The per-message emitters (written apart from ``emit``, for speed) roll a segment that has grown old, write
    nothing once closed and count what a broken sink drops, as ``emit`` does."""
    emit = _MESSAGE_EMITTERS[emitter]
    sink = FileAuditSink(tmp_path, NODE, roll_seconds=60, heartbeat_seconds=1000)
    emit(sink, T0)
    emit(sink, T0 + 59 * SECOND)
    emit(sink, T0 + 60 * SECOND)  # the segment is 60 s old: rolled before this event
    assert sink.wait_published(10)
    assert [len(read_lines(p)) for p in sealed(tmp_path)] == [2]
    sink.close()
    emit(sink, T0 + 62 * SECOND)  # closed: ignored, not dropped
    sink.tick(T0 + 63 * SECOND)
    assert seqs(all_records(tmp_path)) == [0, 1, 2]
    assert sink.dropped == 0

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / NODE).write_text("not a directory")
    broken = FileAuditSink(tmp_path / "broken", NODE)
    for i in range(3):
        emit(broken, T0 + i)
    broken.close()
    assert broken.dropped == 3


def test_active_segment_is_hidden_and_sealed_files_are_complete(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, roll_bytes=2000, flush_bytes=100)
    for i in range(50):
        sink.emit(T0 + i, "msg.routed", {"peer_node": "node-b"})
    assert sink.wait_published(10)
    [current] = active(tmp_path)
    assert current.parent.name == ".active"
    assert not current.name.startswith(".")
    visible = sorted(p for p in (tmp_path / NODE).iterdir() if not p.name.startswith("."))
    assert visible
    assert visible == sealed(tmp_path)
    for path in visible:
        assert all(r["node_id"] == NODE for r in read_lines(path))
    sink.close()


def test_a_roll_does_not_wait_for_its_segment_to_be_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing (two fsyncs and a rename) runs on the publisher's thread, in roll order; the event that rolled
    the segment returns at once, and ``close`` waits for every publication."""
    released = threading.Event()
    threads: list[str] = []
    seal = audit_writer._seal

    def slow_seal(path: Path, folder: Path) -> None:
        threads.append(threading.current_thread().name)
        released.wait(10)
        seal(path, folder)

    monkeypatch.setattr(audit_writer, "_seal", slow_seal)
    sink = FileAuditSink(tmp_path, NODE, roll_bytes=1000, flush_bytes=100)
    for i in range(40):  # several rolls, none of them published while the publisher waits
        sink.emit(T0 + i, "msg.sent", {"message_id": f"m{i}"})
    assert sealed(tmp_path) == []
    assert len(active(tmp_path)) > 2
    assert not sink.wait_published(0.05)
    released.set()
    assert sink.wait_published(10)
    assert len(active(tmp_path)) <= 1  # at most the one being written
    sink.close()
    assert active(tmp_path) == []
    assert seqs(all_records(tmp_path)) == list(range(40))
    assert threads
    assert set(threads) == {"audit-publisher"}


def test_a_segment_not_published_is_reported_and_published_by_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = FileAuditSink(tmp_path, NODE)
    blocker = tmp_path / NODE / f"{0:020d}.jsonl"
    (blocker / "x").mkdir(parents=True)  # a directory where the first segment is to go: its rename fails
    for i in range(3):
        sink.emit(T0 + i, "msg.sent", {})
    with caplog.at_level(logging.ERROR, logger="tridentmq.audit"):
        sink.close()
    assert [r.getMessage() for r in caplog.records if "audit publish failed" in r.getMessage()]
    assert [p.name for p in active(tmp_path)] == [f"{0:020d}.jsonl"]  # kept for the next start

    (blocker / "x").rmdir()
    blocker.rmdir()
    restarted = FileAuditSink(tmp_path, NODE)
    assert restarted.next_seq == 3
    assert active(tmp_path) == []
    restarted.emit(T0 + 10, "msg.sent", {})
    restarted.close()
    assert seqs(all_records(tmp_path)) == [0, 1, 2, 3]


def test_heartbeat_cadence(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, heartbeat_seconds=10)
    for s in range(35):
        sink.tick(T0 + s * SECOND)
    sink.close()
    beats = [r for r in all_records(tmp_path) if r["event"] == "node.heartbeat"]
    assert [r["ts_us"] for r in beats] == [T0, T0 + 10 * SECOND, T0 + 20 * SECOND, T0 + 30 * SECOND]


def test_close_publishes_and_ignores_later_calls(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE)
    sink.emit(T0, "conn.opened", {"protocol": "stomp"})
    sink.close()
    assert seqs(all_records(tmp_path)) == [0]
    assert active(tmp_path) == []

    sink.emit(T0, "conn.closed", {})
    sink.tick(T0 + SECOND)
    sink.close()
    assert seqs(all_records(tmp_path)) == [0]
    assert sink.dropped == 0


def test_close_never_publishes_an_empty_segment(tmp_path: Path) -> None:
    FileAuditSink(tmp_path, NODE).close()
    assert sealed(tmp_path) == []
    assert active(tmp_path) == []


def test_restart_after_crash_with_torn_line(tmp_path: Path) -> None:
    sink = FileAuditSink(tmp_path, NODE, roll_bytes=1500)
    for i in range(30):
        sink.emit(T0 + i, "msg.sent", {"message_id": f"m{i}"})
    sink.tick(T0 + SECOND)  # flush: 30 events + heartbeat reach the disk
    sink.emit(T0 + 2 * SECOND, "msg.sent", {"message_id": "lost"})  # still buffered: lost in the crash
    crash(sink)
    [torn] = active(tmp_path)
    with torn.open("ab") as f:
        f.write(b'{"v":1,"node_id":"node-a","seq":31,"ts')  # a line cut by the crash

    restarted = FileAuditSink(tmp_path, NODE, roll_bytes=1500)
    assert restarted.next_seq == 31
    assert active(tmp_path) == []  # the recovered segment was published at once
    restarted.emit(T0 + 3 * SECOND, "msg.sent", {"message_id": "after"})
    restarted.close()

    records = all_records(tmp_path)
    assert seqs(records) == list(range(32))
    assert records[-1]["message_id"] == "after"
    assert not any(r.get("message_id") == "lost" for r in records)


def test_restart_with_only_a_torn_line_removes_the_active_segment(tmp_path: Path) -> None:
    first = FileAuditSink(tmp_path, NODE)
    first.emit(T0, "msg.sent", {})
    first.close()
    (tmp_path / NODE / ".active" / f"{1:020d}.jsonl").write_bytes(b'{"v":1,"se')

    sink = FileAuditSink(tmp_path, NODE)
    assert sink.next_seq == 1
    assert active(tmp_path) == []
    assert len(sealed(tmp_path)) == 1
    sink.close()


def test_restart_after_clean_close(tmp_path: Path) -> None:
    first = FileAuditSink(tmp_path, NODE, roll_bytes=500)
    for i in range(20):
        first.emit(T0 + i, "msg.acked", {"queue": "q"})
    first.close()

    second = FileAuditSink(tmp_path, NODE, roll_bytes=500)
    assert second.next_seq == 20
    second.emit(T0 + 100, "msg.acked", {"queue": "q"})
    second.close()
    assert seqs(all_records(tmp_path)) == list(range(21))


def test_fresh_directory_starts_at_zero_and_nodes_are_separate(tmp_path: Path) -> None:
    a = FileAuditSink(tmp_path, "a")
    b = FileAuditSink(tmp_path, "b")
    a.emit(T0, "msg.sent", {})
    a.emit(T0, "msg.sent", {})
    b.emit(T0, "msg.sent", {})
    a.close()
    b.close()
    assert a.next_seq == 2
    assert seqs(all_records(tmp_path, "a")) == [0, 1]
    assert seqs(all_records(tmp_path, "b")) == [0]


def test_unusable_node_directory_drops_without_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / NODE).write_text("not a directory")
    with caplog.at_level(logging.ERROR, logger="tridentmq.audit"):
        sink = FileAuditSink(tmp_path, NODE)
        for i in range(5):
            sink.emit(T0 + i, "msg.sent", {})
        sink.tick(T0 + SECOND)
        sink.close()
    assert sink.dropped == 5
    assert len(caplog.records) == 1


def test_write_failure_drops_logs_once_and_leaves_a_gap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = FileAuditSink(tmp_path, NODE, heartbeat_seconds=1000)
    sink.emit(T0, "msg.sent", {})
    sink.tick(T0)
    sink.close()  # seq 0 and the heartbeat (seq 1) are sealed

    sink = FileAuditSink(tmp_path, NODE, heartbeat_seconds=1000)
    active_dir = tmp_path / NODE / ".active"
    active_dir.rmdir()
    active_dir.write_text("")  # .active is now a regular file: opening a segment fails
    with caplog.at_level(logging.ERROR, logger="tridentmq.audit"):
        for i in range(3):
            sink.emit(T0 + i, "msg.sent", {})
            sink.tick(T0 + i)
    assert sink.dropped == 4  # three events + the heartbeat
    assert len(caplog.records) == 1  # logged once per distinct error

    active_dir.unlink()
    active_dir.mkdir()  # the operator fixes the disk: writing resumes
    sink.emit(T0 + 10, "msg.sent", {})
    sink.close()
    assert seqs(all_records(tmp_path)) == [0, 1, 6]  # the gap 2..5 reveals the loss
    assert sealed(tmp_path)[-1].name == f"{6:020d}.jsonl"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_disk_full_drops_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = FileAuditSink(tmp_path, NODE)
    # The first segment's file is a link to /dev/full: every write fails with ENOSPC.
    (tmp_path / NODE / ".active" / f"{0:020d}.jsonl").symlink_to("/dev/full")
    with caplog.at_level(logging.ERROR, logger="tridentmq.audit"):
        sink.emit(T0, "msg.sent", {})
        sink.emit(T0, "msg.sent", {})
        sink.tick(T0)
    assert sink.dropped == 3
    assert any("No space left" in r.getMessage() for r in caplog.records)

    sink.emit(T0 + 1, "msg.sent", {})  # the next segment is a real file again
    sink.close()
    assert seqs(all_records(tmp_path)) == [3]
    assert active(tmp_path) == []


def test_invalid_node_id_is_rejected(tmp_path: Path) -> None:
    for bad in ("", ".hidden", "a/b", ".."):
        with pytest.raises(ValueError, match="node id"):
            FileAuditSink(tmp_path, bad)


def test_null_sink_does_nothing(tmp_path: Path) -> None:
    sinks: list[AuditSink] = [NullAuditSink(), FileAuditSink(tmp_path, NODE)]
    for sink in sinks:
        sink.emit(T0, "msg.sent", {"size": 1})
        sink.tick(T0)
        sink.close()
    assert len(all_records(tmp_path)) == 2  # only the file sink wrote (event + heartbeat)
