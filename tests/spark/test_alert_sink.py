"""`tridentmq audit stream --alerts-to tmq://...`: an alert arrives as a message at a STOMP subscriber of a real
core and gateway."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import stomp
from pyspark.sql import SparkSession
from tests.conftest import start_core, start_gateway
from tests.integration.test_stomp_gateway import Listener

from tridentmq_spark.options import StreamOptions
from tridentmq_spark.stream import run_stream

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(600)]

T0_US = 1_795_000_000_000_000


def _seal(audit: Path, node: str, records: list[dict[str, object]]) -> None:
    (audit / node / ".active").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"v": 1, "node_id": node, "seq": seq, "epoch": 3, **r}) for seq, r in enumerate(records)]
    (audit / node / ".active" / f"{0:020d}.jsonl").write_text("\n".join(lines) + "\n")
    os.rename(audit / node / ".active" / f"{0:020d}.jsonl", audit / node / f"{0:020d}.jsonl")


def test_alerts_become_messages_a_stomp_client_receives(spark: SparkSession, tmp_path: Path) -> None:
    core = start_core(tmp_path)
    gateway = start_gateway(tmp_path, core, "stomp")
    try:
        conn = stomp.Connection12([("127.0.0.1", gateway.port)])
        listener = Listener()
        conn.set_listener("alerts", listener)
        conn.connect(wait=True)
        conn.subscribe("/queue/audit.alerts", id="1", ack="auto", headers={"receipt": "sub"})
        listener.wait(lambda: "sub" in listener.receipts, "the subscription")

        # Five messages sent to "orders" on node-a and never taken (stranded), a node.left seen by node-a
        # (a failover alert), and a heartbeat 10 s later whose event time closes the 2 s windows.
        sent = [
            {
                "ts_us": T0_US + i * 1000,
                "event": "msg.sent",
                "address": "orders",
                "message_id": f"m{i}",
                "size": 1,
                "protocol": "stomp",
                "sent_ts_us": T0_US + i * 1000,
            }
            for i in range(5)
        ]
        left = {"ts_us": T0_US + 6000, "event": "node.left", "peer_node": "node-b"}
        heartbeat = {"ts_us": T0_US + 10_000_000, "event": "node.heartbeat"}
        _seal(tmp_path / "audit", "node-a", [*sent, left, heartbeat])
        options = StreamOptions(
            tmp_path / "audit",
            tmp_path / "ckpt",
            tmp_path / "out",
            window_seconds=2,
            watermark_seconds=1,
            stranded_seconds=2,
            trigger_seconds=1,
            once=True,
            alerts_to=f"tmq://127.0.0.1:{core.link_port}/audit.alerts",
        )
        run_stream(spark, options)

        # The failover alert is written as soon as its batch runs. (The stranded one closes with its window
        # only in a later micro-batch, which a single `--once` run does not reach: not checked here.)
        listener.wait(lambda: len(listener.messages) >= 1, "the failover alert")
        (frame,) = [f for f in listener.messages if f.headers["alert"] == "failover"]
        assert frame.headers["content-type"].startswith("application/json")
        assert frame.headers["node_id"] == "node-a"
        assert frame.headers["persistent"] == "true"
        body = json.loads(frame.body)
        assert (body["alert"], body["node_id"], body["detail"]) == ("failover", "node-a", "node.left epoch=3 node-b")
        conn.disconnect()
    finally:
        gateway.stop()
        core.stop()
