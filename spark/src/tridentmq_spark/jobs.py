"""Shared steps of the audit jobs: load the stream and split good events from bad records."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tridentmq_spark.source import FORMAT

__all__ = ["bad_records", "events", "load"]


def load(spark: SparkSession, audit_dir: Path) -> DataFrame:
    """Every row of every node's sealed segments (bad ones included), with an event-time column ``ts``."""
    return spark.read.format(FORMAT).load(str(audit_dir)).withColumn("ts", F.timestamp_micros("ts_us"))


def events(rows: DataFrame) -> DataFrame:
    """The rows that are v1 events."""
    return rows.where(F.col("bad_reason").isNull()).drop("bad_reason", "raw")


def bad_records(rows: DataFrame) -> DataFrame:
    """The rows that are not: torn lines, unknown events, newer versions, seq gaps (see schema.BAD_*)."""
    return rows.where(F.col("bad_reason").isNotNull()).select("node_id", "seq", "ts", "event", "v", "bad_reason", "raw")
