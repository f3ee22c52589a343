"""`tridentmq audit stream` exactly once across a kill -9 of the Spark driver and a restart from the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tridentmq_spark.stream import StreamOptions, drop_torn_log_writes, run_stream

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

T0_US = 1_795_000_000_000_000
PER_SEGMENT = 300


def _seal(audit: Path, node: str, first_seq: int, *, torn: bool = False) -> None:
    """A segment as the core publishes it: written in .active, then renamed into the node folder."""
    active = audit / node / ".active"
    active.mkdir(parents=True, exist_ok=True)
    lines = []
    for seq in range(first_seq, first_seq + PER_SEGMENT):
        ts = T0_US + seq * 20_000  # 50 events per second of event time
        event = (
            "node.heartbeat"
            if seq % 50 == 0
            else "msg.sent"
            if seq % 2
            else "msg.delivered"
            if seq % 4 == 2
            else "msg.acked"
        )
        record = {"v": 1, "node_id": node, "seq": seq, "ts_us": ts, "event": event, "epoch": 1}
        if event != "node.heartbeat":  # 3 ms from sent to ack, 1 ms from sent to delivery
            record |= {
                "address": "orders",
                "message_id": f"{node[:2]}-{seq}",
                "size": 5,
                "protocol": "stomp",
                "sent_ts_us": ts - (1000 if event == "msg.delivered" else 3000),
                "queue": "orders",
            }
        lines.append(json.dumps(record))
    if torn:
        lines.append('{"v":1,"seq":')
    name = f"{first_seq:020d}.jsonl"
    (active / name).write_text("\n".join(lines) + "\n")
    os.rename(active / name, audit / node / name)


def _committed_batches(sink: Path) -> int:
    log = sink / "_spark_metadata"
    return len([p for p in log.iterdir() if p.name.split(".")[0].isdigit()]) if log.is_dir() else 0


def _stream(audit: Path, checkpoint: Path, out: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "tridentmq_shared.cli",
        "audit",
        "stream",
        "--audit-dir",
        str(audit),
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(out),
        "--window-seconds",
        "2",
        "--watermark-seconds",
        "1",
        "--stranded-seconds",
        "2",
        "--trigger-seconds",
        "1",
        *extra,
    ]
    with log.open("ab") as f:
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(predicate: object, process: subprocess.Popen[bytes], log: Path, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert process.poll() is None, f"stream exited with {process.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _kill_source_worker(group: int) -> int:
    """SIGKILL the Python process serving the audit source's offsets to the driver's JVM; its pid."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != group:
                continue
            if b"python_streaming_source_runner" in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
                return int(proc.name)
        except (ProcessLookupError, FileNotFoundError):
            continue
    raise AssertionError("no Python source worker in the stream's process group")


def test_the_stream_is_exactly_once_across_a_kill_of_the_driver(spark: SparkSession, tmp_path: Path) -> None:
    audit, checkpoint, out, log = tmp_path / "audit", tmp_path / "checkpoint", tmp_path / "out", tmp_path / "log"
    for first in range(0, 3 * PER_SEGMENT, PER_SEGMENT):
        _seal(audit, "node-a", first)
    _seal(audit, "node-b", 0, torn=True)
    first_run = _stream(audit, checkpoint, out, log)
    try:
        _wait(lambda: _committed_batches(out / "events") >= 1, first_run, log, "a first committed batch")
        # The query fails on its next trigger; the stream restarts it from its checkpoint instead of exiting
        # (`_wait` fails if the process ends).
        _kill_source_worker(first_run.pid)
        _wait(lambda: "query events failed" in log.read_text(), first_run, log, "the failed query to be seen")
        _seal(audit, "node-c", 0)  # a node folder that appears while the stream runs
        for first in range(3 * PER_SEGMENT, 6 * PER_SEGMENT, PER_SEGMENT):
            _seal(audit, "node-a", first)
        seen = _committed_batches(out / "events")
        _wait(lambda: _committed_batches(out / "events") > seen, first_run, log, "a later batch")
        _seal(audit, "node-b", PER_SEGMENT)  # likely read by a batch the kill interrupts
    finally:
        os.killpg(first_run.pid, signal.SIGKILL)  # the driver and its JVM, without any clean-up
        first_run.wait()
    _seal(audit, "node-c", PER_SEGMENT)
    # The restart from the checkpoint, as `--once` runs it, in the tests' Spark session (not a second JVM).
    run_stream(
        spark,
        StreamOptions(
            audit,
            checkpoint,
            out,
            window_seconds=2,
            watermark_seconds=1,
            stranded_seconds=2,
            trigger_seconds=1,
            once=True,
        ),
    )

    rows = spark.read.parquet(str(out / "events")).where("bad_reason IS NULL")
    events = [(r.node_id, r.seq) for r in rows.select("node_id", "seq").collect()]
    assert len(events) == len(set(events)), "duplicates in the sink"
    expected = {("node-a", s) for s in range(6 * PER_SEGMENT)}
    expected |= {(n, s) for n in ("node-b", "node-c") for s in range(2 * PER_SEGMENT)}
    assert set(events) == expected
    bad = spark.read.parquet(str(out / "bad_records")).collect()
    assert [(r.node_id, r.bad_reason) for r in bad] == [("node-b", "not_json")]
    rates = spark.read.parquet(str(out / "rates")).where("address = 'orders'").collect()
    assert rates, "no closed window"
    assert all(r.sent_per_s > 0 and r.p50_ms == 3.0 for r in rates), rates
    assert all(r.delivered_per_s > 0 and r.in_queue_p50_ms == r.in_queue_p99_ms == 1.0 for r in rates), rates


def test_a_log_entry_a_killed_driver_left_half_written_is_dropped_and_entries_are_kept(tmp_path: Path) -> None:
    """Seen in CI: the driver killed while its analysis queries wrote their first offsets left only
    ``.0.<uuid>.tmp`` in each ``offsets`` folder, and Spark then refused to restart them ("should be empty on
    batch 0")."""
    offsets, commits = tmp_path / "rates" / "offsets", tmp_path / "events" / "commits"
    offsets.mkdir(parents=True)
    commits.mkdir(parents=True)
    torn = [offsets / ".0.4a34ec8f.tmp", offsets / "..0.4a34ec8f.tmp.crc", commits / ".3.77aa.tmp"]
    kept = [offsets / "0", offsets / ".0.crc", commits / "2", tmp_path / "rates" / "metadata"]
    for path in [*torn, *kept]:
        path.write_text("{}")
    assert sorted(drop_torn_log_writes(tmp_path)) == sorted(torn)
    assert all(path.exists() for path in kept)
    assert not any(path.exists() for path in torn)


def test_heartbeats_close_the_windows_once_traffic_stops(spark: SparkSession, tmp_path: Path) -> None:
    """One message sent to a queue nobody reads, then only heartbeats. Spark moved the `address IS NOT NULL`
    that followed the aggregations below them, where it dropped the heartbeats before the watermark: the
    windows never closed, and neither the rates nor the stranded alert came."""
    audit, checkpoint, out = tmp_path / "audit", tmp_path / "checkpoint", tmp_path / "out"
    node = "node-q"
    events = [{"ts_us": T0_US, "event": "node.heartbeat"}]
    events.append(
        {"ts_us": T0_US + 1_000_000, "event": "msg.sent", "address": "q", "message_id": "q-1", "size": 3}
        | {"protocol": "link", "sent_ts_us": T0_US + 1_000_000}
    )
    events += [{"ts_us": T0_US + n * 10_000_000, "event": "node.heartbeat"} for n in range(1, 13)]
    (audit / node).mkdir(parents=True)
    lines = [json.dumps({"v": 1, "node_id": node, "seq": seq, "epoch": 1, **e}) for seq, e in enumerate(events)]
    (audit / node / f"{0:020d}.jsonl").write_text("\n".join(lines) + "\n")
    options = StreamOptions(
        audit, checkpoint, out, window_seconds=5, watermark_seconds=1, stranded_seconds=5, trigger_seconds=1, once=True
    )
    run_stream(spark, options)
    alerts = spark.read.parquet(str(out / "alerts")).collect()
    assert [(r.address, r.alert, r.detail) for r in alerts] == [("q", "stranded", "1 sent, none delivered within 5 s")]
    rates = spark.read.parquet(str(out / "rates")).collect()
    assert [(r.address, r.sent_per_s) for r in rates] == [("q", 0.2)]
