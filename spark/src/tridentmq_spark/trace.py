"""``tridentmq audit trace MESSAGE_ID``: every event of one message across all nodes, in time order."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F

from tridentmq_spark import jobs

__all__ = ["format_trace", "trace"]

_COLUMNS = (
    "ts",
    "node_id",
    "epoch",
    "seq",
    "event",
    "message_id",
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
    """Rows ordered by event time, then node and seq (seq orders events of one node written in the same ms).

    A message that moved to other nodes has other ids there; their events name the id it was first accepted
    under as ``origin_message_id``. Given either id, the trace covers the message on every node."""
    ev = jobs.events(jobs.load(spark, audit_dir)).cache()
    try:
        rows = _of(ev, message_id)
        roots = {r["origin_message_id"] for r in rows if r["message_id"] == message_id and r["origin_message_id"]}
        if len(roots) == 1 and message_id not in roots:  # an id given on another node: trace from the origin
            rows = _of(ev, roots.pop())
        return rows
    finally:
        ev.unpersist()


def _of(ev: DataFrame, message_id: str) -> list[Row]:
    found = ev.where((F.col("message_id") == message_id) | (F.col("origin_message_id") == message_id))
    return found.select(*_COLUMNS, "origin_message_id").orderBy("ts", "node_id", "seq").collect()


def format_trace(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        extra = " ".join(f"{k}={r[k]}" for k in _COLUMNS[5:] if r[k] is not None)
        lines.append(
            f"{r['ts'].isoformat(timespec='milliseconds')}  node {r['node_id'][:8]}  epoch {r['epoch']}  "
            f"seq {r['seq']:<8} {r['event']:<18} {extra}"
        )
    return "\n".join(lines)
