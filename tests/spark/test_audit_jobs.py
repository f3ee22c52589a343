"""The audit analytics on a real local Spark session: the data source, the report in a real browser, trace."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from pyspark.sql import SparkSession
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from tests.spark.conftest import ClusterAudit

from tridentmq_spark import cli, jobs
from tridentmq_spark.report import build_report
from tridentmq_spark.segments import list_segments, read_range

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def _line(node: str, seq: int, event: str = "node.heartbeat", **fields: object) -> str:
    record = {
        "v": 1,
        "node_id": node,
        "seq": seq,
        "ts_us": 1_795_000_000_000_000 + seq * 1000,
        "event": event,
        "epoch": 1,
        **fields,
    }
    return json.dumps(record) + "\n"


def test_the_source_reads_sealed_segments_and_reports_every_bad_line(spark: SparkSession, tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    (audit / "n1" / ".active").mkdir(parents=True)
    (audit / "n1" / "00000000000000000000.jsonl").write_text(
        "".join(
            _line("n1", i, "msg.sent", address="q", message_id=f"m{i}", size=1, protocol="link", sent_ts_us=1)
            for i in range(4)
        )
        + '{"v":1,"node_id":"n1","seq":4,"ts_us":17950\n'  # torn
        + "not json at all\n"
    )
    (audit / "n1" / "00000000000000000006.jsonl").write_text(
        _line("n1", 8, "msg.teleported")  # seqs 6 and 7 missing
        + _line("n1", 9).replace('"v": 1', '"v": 2')
        + _line("n1", 10, "msg.sent", size="big")
        + _line("n1", 11)
    )
    (audit / "n1" / ".active" / "00000000000000000012.jsonl").write_text(_line("n1", 12))  # not sealed: unread
    (audit / "n2").mkdir()  # a node that has sealed nothing yet
    (audit / ".hidden").mkdir()
    rows = jobs.load(spark, audit)
    good = sorted((r.node_id, r.seq, r.event) for r in jobs.events(rows).collect())
    assert good == [
        ("n1", 0, "msg.sent"),
        ("n1", 1, "msg.sent"),
        ("n1", 2, "msg.sent"),
        ("n1", 3, "msg.sent"),
        ("n1", 11, "node.heartbeat"),
    ]
    bad = sorted((r.seq if r.seq is not None else -1, r.bad_reason) for r in jobs.bad_records(rows).collect())
    assert bad == [
        (-1, "not_json"),
        (-1, "not_json"),
        (4, "seq_gap"),
        (8, "unknown_event"),
        (9, "newer_version"),
        (10, "bad_field_type"),
    ], bad
    gap = jobs.bad_records(rows).where("bad_reason = 'seq_gap'").first()
    assert gap is not None
    assert gap.raw == "4 missing"  # seqs 4 (torn), 5 (garbled), 6, 7


def _browser() -> webdriver.Chrome:
    driver = shutil.which("chromedriver")
    chromium = shutil.which("chromium")
    if driver is None or chromium is None:
        pytest.skip("needs Debian's chromium and chromium-driver (installed by .ci/run)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1300,3800"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))


def test_the_report_of_a_real_cluster_run_opens_in_a_browser(
    spark: SparkSession, cluster_audit: ClusterAudit, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    result = build_report(spark, cluster_audit.audit_dir, out)
    sent = cluster_audit.stomp_sent + cluster_audit.link_sent
    assert result.bad_records == 0
    throughput = pd.read_parquet(out / "throughput.parquet")
    orders = throughput[throughput["address"] == "orders"].groupby("event")["messages"].sum().to_dict()
    # Every node that accepts a message writes msg.sent (forwarded arrivals and dead-letter copies too).
    assert orders == {
        "msg.sent": _count_lines(cluster_audit, "msg.sent", "orders"),
        "msg.acked": sent - cluster_audit.rejected,
    }, orders
    latency = pd.read_parquet(out / "latency.parquet").set_index("address")
    assert latency.loc["orders", "messages"] == sent - cluster_audit.rejected
    assert 0 <= latency.loc["orders", "p50_ms"] <= latency.loc["orders", "p99_ms"] <= latency.loc["orders", "max_ms"]
    # A percentile is the largest latency of its 0.5 % histogram bin: within 0.5 % above the exact one.
    exact = sorted(
        (r["ts_us"] - r["sent_ts_us"]) / 1000
        for r in _records(cluster_audit)  # type: ignore[operator]
        if r["event"] == "msg.acked" and r.get("address") == "orders"
    )
    for q in (50, 90, 99):
        nearest_rank = exact[math.ceil(q / 100 * len(exact)) - 1]
        assert nearest_rank <= latency.loc["orders", f"p{q}_ms"] <= nearest_rank * 1.005 + 1e-9, (q, exact)
    assert latency.loc["orders", "max_ms"] == exact[-1]
    in_queue = pd.read_parquet(out / "time_in_queue.parquet").set_index("address")
    assert in_queue.loc["orders", "messages"] == _count_lines(cluster_audit, "msg.delivered", "orders") >= sent
    assert 0 <= in_queue.loc["orders", "p50_ms"] <= in_queue.loc["orders", "max_ms"]
    dead = pd.read_parquet(out / "redeliveries.parquet")
    assert dead[dead["event"] == "msg.dead_lettered"]["messages"].sum() == cluster_audit.rejected
    timeline = pd.read_parquet(out / "cluster_timeline.parquet")
    assert set(timeline["event"]) >= {"node.joined", "node.left", "epoch"}
    assert set(timeline[timeline["event"] == "epoch"]["node_id"]) == set(cluster_audit.node_ids)
    connections = pd.read_parquet(out / "connections.parquet")
    assert {"conn.opened", "consumer.opened"} <= set(connections["event"])

    page = result.html_path.read_text()
    assert not re.search(r"<script[^>]*\bsrc=", page)  # self-contained: plotly.js is inlined, nothing loaded
    browser = _browser()
    try:
        browser.get(result.html_path.as_uri())
        charts = browser.find_elements(By.CSS_SELECTOR, "div.plotly-graph-div")
        assert len(charts) >= 5
        for chart in charts:
            assert chart.find_elements(By.CSS_SELECTOR, "svg.main-svg"), chart.get_attribute("id")
        bad_line = browser.find_element(By.ID, "bad-records").text
        assert bad_line == "Bad records: 0"
        # Kept with the test's files; docs/spark-report.png is a copy of one, looked at by a person.
        assert browser.save_screenshot(str(out / "report.png"))
    finally:
        browser.quit()


def _records(cluster_audit: ClusterAudit) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for node in cluster_audit.node_ids
        for segment in list_segments(cluster_audit.audit_dir / node)
        for line in segment.path.read_text().splitlines()
    ]


def _count_lines(cluster_audit: ClusterAudit, event: str, address: str) -> int:
    return sum(1 for r in _records(cluster_audit) if r["event"] == event and r.get("address") == address)


def test_trace_lists_the_events_of_a_message(
    spark: SparkSession, cluster_audit: ClusterAudit, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the command line of `tridentmq audit trace`, in the tests' Spark session (a process of its own
    would start a second JVM; the stream test runs the command through `tridentmq audit` in one): a message
    the consumer rejected."""
    dead = [r for r in _records(cluster_audit) if r["event"] == "msg.dead_lettered"]
    assert len(dead) == cluster_audit.rejected
    message_id, origin = str(dead[0]["message_id"]), str(dead[0]["node_id"])
    parser = argparse.ArgumentParser()
    cli.add_commands(parser)
    assert cli.run(parser.parse_args(["trace", message_id, "--audit-dir", str(cluster_audit.audit_dir)])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    events = [line.split()[7] for line in lines]
    # It was forwarded from the node that accepted it: the trace starts there, under its first id.
    assert events[:2] == ["msg.sent", "msg.forwarded"], lines
    assert {"msg.delivered", "msg.dead_lettered"} <= set(events), lines
    assert len({line.split()[2] for line in lines}) == 2, lines  # both nodes
    (dead_line,) = [line for line in lines if " msg.dead_lettered " in line]
    assert f"node {origin[:8]}  epoch 1" in dead_line, lines
    assert "reason=rejected" in dead_line, lines
    assert f"message_id={message_id}" in dead_line, lines


def test_clean_and_damaged_segments_give_the_same_events(tmp_path: Path) -> None:
    """A clean segment takes Arrow's JSON reader, one with a torn line the line-by-line road: same rows."""
    lines = [
        _line("n", 0, "conn.opened", conn_id="c1", client_id="stomp 127.0.0.1:4000", protocol="link"),
        _line("n", 1, "msg.sent", address="a", message_id="m1", size=3, protocol="mqtt", sent_ts_us=5),
        _line(
            "n",
            2,
            "msg.forwarded",
            address="a",
            message_id="m2",
            size=3,
            protocol="mqtt",
            sent_ts_us=5,
            target_node="x",
            target_queues=["q1", "q2"],
        ),
        _line(
            "n",
            3,
            "msg.acked",
            address="a",
            queue="q1",
            message_id="m1",
            size=3,
            protocol="mqtt",
            sent_ts_us=5,
            conn_id="c1",
            consumer_id="7",
            client_id="amqp 127.0.0.1:5",
        ),
        _line(
            "n",
            4,
            "msg.acked",
            address="a",
            queue="q1",
            message_id="m3",
            size=3,
            protocol="mqtt",
            sent_ts_us=5,
            conn_id="c2",
            consumer_id="8",
            client_id="my-app",
        ),
        _line("n", 5, "ha.activated", configured_role="backup", group="g"),
    ]
    for name, extra in (("clean", ""), ("damaged", '{"v":1,"seq":6,"ts\n')):
        (tmp_path / name / "n").mkdir(parents=True)
        (tmp_path / name / "n" / "00000000000000000000.jsonl").write_text("".join(lines) + extra)
    clean = [r for b in read_range(tmp_path / "clean" / "n", "n", 0, 6) for r in b.to_pylist()]
    damaged = [r for b in read_range(tmp_path / "damaged" / "n", "n", 0, 7) for r in b.to_pylist()]
    assert [r for r in damaged if r["bad_reason"] is None] == clean
    assert [r["bad_reason"] for r in damaged if r["bad_reason"]] == ["not_json", "seq_gap"]  # seq 6 torn
    by_seq = {r["seq"]: r for r in clean}
    assert by_seq[2]["target_queues"] == "q1,q2"
    assert (by_seq[3]["consumer_protocol"], by_seq[4]["consumer_protocol"]) == ("amqp", "link")
    assert by_seq[0]["consumer_protocol"] is None


def test_a_version_below_1_and_numbers_beyond_64_bits_are_bad_records(tmp_path: Path) -> None:
    """A number of 2**63 or more made the whole job fail (OverflowError building the batch), and a line of v 0
    was taken for a good v1 event."""
    (tmp_path / "n").mkdir()
    lines = [
        _line("n", 0),
        _line("n", 1).replace('"v": 1', '"v": 0'),
        _line("n", 2, "msg.sent", address="a", message_id="m", size=1 << 63, protocol="link", sent_ts_us=1),
        json.dumps({"v": 1, "node_id": "n", "seq": 3, "ts_us": 1 << 64, "event": "node.heartbeat", "epoch": 1}) + "\n",
        _line("n", 4),
    ]
    (tmp_path / "n" / "00000000000000000000.jsonl").write_text("".join(lines))
    rows = [r for b in read_range(tmp_path / "n", "n", 0, 5) for r in b.to_pylist()]
    assert [(r["seq"], r["bad_reason"]) for r in rows] == [
        (0, None),
        (1, "missing_header"),
        (2, "bad_field_type"),
        (3, "missing_header"),
        (4, None),
    ]


def test_an_audit_folder_with_nothing_sealed_yet_gives_no_rows(spark: SparkSession, tmp_path: Path) -> None:
    """A fresh node's folder holds only .active for its first minute: the jobs failed on it with a bare
    AssertionError (Spark reads one partition of its own when a source has none)."""
    (tmp_path / "audit" / "n1" / ".active").mkdir(parents=True)
    (tmp_path / "audit" / "n1" / ".active" / "00000000000000000000.jsonl").write_text(_line("n1", 0))
    assert jobs.load(spark, tmp_path / "audit").count() == 0
    parser = argparse.ArgumentParser()
    cli.add_commands(parser)
    assert cli.run(parser.parse_args(["trace", "m-1", "--audit-dir", str(tmp_path / "none")])) == 2


def test_the_report_counts_redeliveries_and_no_bad_record_in_its_latencies(spark: SparkSession, tmp_path: Path) -> None:
    """The redeliveries table looked for msg.acked with a delivery_count, which the core never writes: it counted
    none. A msg.acked line repeated under its seq (a duplicate_seq bad record) counted twice in the latencies."""
    message = {"address": "q", "queue": "q", "size": 1, "protocol": "link", "sent_ts_us": 1_795_000_000_000_000}
    lines = [
        _line("n", 0, "msg.delivered", message_id="m1", delivery_count=1, **message),
        _line("n", 1, "msg.delivered", message_id="m1", delivery_count=2, **message),
        _line("n", 2, "msg.acked", message_id="m1", **message),
    ]
    (tmp_path / "audit" / "n").mkdir(parents=True)
    (tmp_path / "audit" / "n" / "00000000000000000000.jsonl").write_text("".join([*lines, lines[2]]))
    build_report(spark, tmp_path / "audit", tmp_path / "out")
    redeliveries = pd.read_parquet(tmp_path / "out" / "redeliveries.parquet")
    assert redeliveries[["event", "messages"]].to_dict("records") == [{"event": "msg.delivered", "messages": 1}]
    latency = pd.read_parquet(tmp_path / "out" / "latency.parquet")
    assert latency["messages"].tolist() == [1]
