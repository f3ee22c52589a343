"""Records/s of the Spark audit jobs over generated audit files (a benchmark script, not a test).

    uv run python -m bench.audit_report --events 1000000

Writes ``--events`` schema-v1 events (3 nodes, 64k-line segments, a mix of msg.sent / msg.delivered /
msg.acked with heartbeats and connection events) into a temporary folder, then times, in one local Spark
session: the full batch report (session start included) and the streaming source alone (availableNow into
Spark's no-op sink).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import orjson

SEGMENT_LINES = 65_536
NODES = 3
T0_US = 1_795_000_000_000_000


def generate(audit: Path, events: int) -> None:
    per_node = events // NODES
    for n in range(NODES):
        node = f"{n:08d}-bench-node"
        folder = audit / node
        folder.mkdir(parents=True)
        lines: list[bytes] = []
        first = 0
        for seq in range(per_node):
            ts = T0_US + seq * 1000  # 1,000 events/s per node of event time
            kind = seq % 10
            record: dict[str, object] = {"v": 1, "node_id": node, "seq": seq, "ts_us": ts, "epoch": 1}
            if kind == 9:
                record["event"] = "node.heartbeat" if seq % 100 == 99 else "consumer.opened"
                record |= {"conn_id": f"c{seq % 7}", "consumer_id": f"k{seq}", "queue": f"q{seq % 5}"}
            else:
                msg = seq // 3
                record |= {
                    "event": ("msg.sent", "msg.delivered", "msg.acked")[kind % 3],
                    "address": f"q{msg % 5}",
                    "queue": f"q{msg % 5}",
                    "message_id": f"{n}-{msg}",
                    "size": 100,
                    "protocol": "stomp",
                    "sent_ts_us": T0_US + msg * 3000,
                }
            lines.append(orjson.dumps(record))
            if len(lines) == SEGMENT_LINES or seq == per_node - 1:
                (folder / f"{first:020d}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
                first = seq + 1
                lines = []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from pyspark.sql import SparkSession  # noqa: PLC0415  (after argument parsing: the import takes a while)

    from tridentmq_spark.report import build_report  # noqa: PLC0415
    from tridentmq_spark.session import get_session  # noqa: PLC0415
    from tridentmq_spark.source import FORMAT  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tridentmq-audit-bench-") as tmp:
        audit = Path(tmp) / "audit"
        started = time.perf_counter()
        generate(audit, args.events)
        generated = time.perf_counter() - started
        total = NODES * (args.events // NODES)

        started = time.perf_counter()
        spark = get_session("local[2]")
        spark.sparkContext.setLogLevel("ERROR")
        session_s = time.perf_counter() - started
        result = build_report(spark, audit, Path(tmp) / "report")
        report_s = time.perf_counter() - started
        assert result.events == total, result

        started = time.perf_counter()
        writer = spark.readStream.format(FORMAT).load(str(audit)).writeStream.format("noop")
        writer = writer.option("checkpointLocation", str(Path(tmp) / "checkpoint")).trigger(availableNow=True)
        query = writer.start()
        query.awaitTermination()
        stream_s = time.perf_counter() - started
        read = sum(p["numInputRows"] for p in query.recentProgress)
        assert read == total, read
        SparkSession.getActiveSession().stop()  # type: ignore[union-attr]
    figures = {
        "events": total,
        "generate_s": round(generated, 1),
        "session_start_s": round(session_s, 1),
        "report_s_including_session_start": round(report_s, 1),
        "report_records_per_s": round(total / report_s),
        "stream_source_s": round(stream_s, 1),
        "stream_source_records_per_s": round(total / stream_s),
    }
    print(json.dumps(figures, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
