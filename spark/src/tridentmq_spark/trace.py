"""``tridentmq audit trace MESSAGE_ID``: every event of one message across all nodes, in time order."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F

from tridentmq_spark import jobs

__all__ = ["format_trace", "trace"]

_COLUMNS = (
    "ts",
    "node_id",
    "epoch",
    "seq",
    "event",
    "address",
    "queue",
    "delivery_count",
    "reason",
    "target_node",
    "consumer_id",
    "consumer_protocol",
    "protocol",
)


def trace(spark: SparkSession, audit_dir: Path, message_id: str) -> list[Row]:
    """Rows ordered by event time, then node and seq (seq orders events of one node written in the same ms)."""
    ev = jobs.events(jobs.load(spark, audit_dir)).where(F.col("message_id") == message_id)
    return ev.select(*_COLUMNS).orderBy("ts", "node_id", "seq").collect()


def format_trace(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        extra = " ".join(f"{k}={r[k]}" for k in _COLUMNS[5:] if r[k] is not None)
        lines.append(
            f"{r['ts'].isoformat(timespec='milliseconds')}  node {r['node_id'][:8]}  epoch {r['epoch']}  "
            f"seq {r['seq']:<8} {r['event']:<18} {extra}"
        )
    return "\n".join(lines)
