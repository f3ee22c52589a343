"""``tridentmq audit stream``: Structured Streaming over the audit source, continuously.

Queries, each with its own checkpoint under ``--checkpoint`` and its own sink under ``--out`` (Parquet, or the
console when no ``--out``):

- ``events``: every row of the audit source as Parquet (exactly once: file sink + checkpointed source offsets),
  bad ones with ``bad_reason`` set. The other queries read this sink back with Spark's file source.
- ``rates``: per address and event-time window: messages sent/delivered/acked per second, latency (sent to
  ack) and time-in-queue (sent to delivery) percentiles.
- ``alerts``: per node, address and window: ``stranded`` (messages sent, none delivered or acked within the
  window) and ``dead_letter_spike``; plus ``failover`` alerts straight from the lifecycle events.
- ``bad_records``: lines that are not v1 events, and seq gaps.

Event-time windows close on a watermark. It is set on the unfiltered stream and the aggregations pick their
events with conditional aggregates instead of a filter, so ``node.heartbeat`` (every 10 s per node) keeps the
watermark moving when traffic stops. A ``where`` before the aggregation could be pushed below the watermark,
and so can one after it on a grouping column (``address IS NOT NULL``): Spark moves such a filter below the
aggregation, where it drops the heartbeats before they reach the watermark and no window closes once traffic
stops. The rows without an address are dropped by a filter on an aggregate (``_ADDRESSED``), which stays put.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException, StreamingQueryException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import StructType

from tridentmq_spark.alert_sink import AlertTarget, publish_batch
from tridentmq_spark.options import StreamOptions
from tridentmq_spark.restarts import RESTART_WINDOW_S, RestartBudget
from tridentmq_spark.source import FORMAT

__all__ = ["alerts", "analyses", "rates", "run_stream", "start_ingest"]

_FAILOVER_EVENTS = ("ha.activated", "ha.failback", "ha.fenced", "node.left")
_ALERTS = ("alerts", "failover_alerts")
_log = logging.getLogger(__name__)


def _count(condition: Column) -> Column:
    return F.count(F.when(condition, 1))


#: Events of the group that have an address: a group of the events without one has none.
_ADDRESSED = "addressed"


def _addressed() -> Column:
    return F.count("address").alias(_ADDRESSED)


def rates(rows: DataFrame, window_seconds: int) -> DataFrame:
    ev = F.col("event")
    since_sent_ms = (F.col("ts_us") - F.col("sent_ts_us")) / 1000.0
    latency_ms = F.when(ev == "msg.acked", since_sent_ms)
    in_queue_ms = F.when(ev == "msg.delivered", since_sent_ms)
    pct = F.percentile_approx(latency_ms, [0.5, 0.9, 0.99], 1000)
    agg = rows.groupBy(F.window("ts", f"{window_seconds} seconds"), "address").agg(
        _count(ev == "msg.sent").alias("sent"),
        _count(ev == "msg.delivered").alias("delivered"),
        _count(ev == "msg.acked").alias("acked"),
        _count(ev == "msg.dead_lettered").alias("dead_lettered"),
        pct.alias("p"),
        F.percentile_approx(in_queue_ms, [0.5, 0.99], 1000).alias("q"),
        _addressed(),
    )
    return agg.where(F.col(_ADDRESSED) > 0).select(
        F.col("window.start").alias("window_start"),
        F.col("window.end").alias("window_end"),
        "address",
        (F.col("sent") / window_seconds).alias("sent_per_s"),
        (F.col("delivered") / window_seconds).alias("delivered_per_s"),
        (F.col("acked") / window_seconds).alias("acked_per_s"),
        "dead_lettered",
        F.col("p")[0].alias("p50_ms"),
        F.col("p")[1].alias("p90_ms"),
        F.col("p")[2].alias("p99_ms"),
        F.col("q")[0].alias("in_queue_p50_ms"),
        F.col("q")[1].alias("in_queue_p99_ms"),
    )


def alerts(rows: DataFrame, stranded_seconds: int, dead_letter_spike: int) -> DataFrame:
    ev = F.col("event")
    agg = rows.groupBy(F.window("ts", f"{stranded_seconds} seconds"), "node_id", "address").agg(
        _count(ev == "msg.sent").alias("sent"),
        _count(ev.isin("msg.delivered", "msg.acked", "msg.forwarded", "msg.redistributed")).alias("taken"),
        _count(ev == "msg.dead_lettered").alias("dead_lettered"),
        _addressed(),
    )
    kinds = F.filter(
        F.array(
            F.when((F.col("sent") > 0) & (F.col("taken") == 0), F.lit("stranded")),
            F.when(F.col("dead_lettered") >= dead_letter_spike, F.lit("dead_letter_spike")),
        ),
        lambda k: k.isNotNull(),
    )
    return (
        agg.where(F.col(_ADDRESSED) > 0)
        .select(
            F.col("window.start").alias("ts"),
            "node_id",
            "address",
            F.explode(kinds).alias("alert"),
            F.when(
                F.col("sent") > 0,
                F.format_string("%d sent, none delivered within %d s", "sent", F.lit(stranded_seconds)),
            ).alias("stranded_detail"),
            "dead_lettered",
        )
        .select(
            "ts",
            "node_id",
            "address",
            "alert",
            F.when(F.col("alert") == "stranded", F.col("stranded_detail"))
            .otherwise(F.format_string("%d dead letters in %d s", "dead_lettered", F.lit(stranded_seconds)))
            .alias("detail"),
        )
    )


def failover_alerts(rows: DataFrame) -> DataFrame:
    return rows.where(F.col("event").isin(*_FAILOVER_EVENTS)).select(
        "ts",
        "node_id",
        F.lit(None).cast("string").alias("address"),
        F.lit("failover").alias("alert"),
        F.concat_ws(
            " ",
            "event",
            F.concat(F.lit("epoch="), F.col("epoch").cast("string")),
            F.coalesce("peer_node", "to", "reason", "configured_role"),
        ).alias("detail"),
    )


def _start(df: DataFrame, name: str, opts: StreamOptions, path: Path | None) -> StreamingQuery:
    writer = df.writeStream.queryName(name).outputMode("append")
    writer = writer.option("checkpointLocation", str(opts.checkpoint / name))
    writer = writer.trigger(processingTime=f"{opts.trigger_seconds} seconds")
    if path is not None:
        writer = writer.format("parquet").option("path", str(path))
    else:
        writer = writer.format("console").option("truncate", "false")
    return writer.start()


def _events_path(opts: StreamOptions) -> Path:
    return (opts.out if opts.out is not None else opts.checkpoint / "data") / "events"


def start_ingest(spark: SparkSession, opts: StreamOptions) -> StreamingQuery:
    """Stage 1: the audit source into the ``events`` Parquet sink, every row (bad ones with ``bad_reason``)."""
    raw = spark.readStream.format(FORMAT).load(str(opts.audit_dir)).withColumn("ts", F.timestamp_micros("ts_us"))
    return _start(raw, "events", opts, _events_path(opts))


def analyses(spark: SparkSession, opts: StreamOptions, events_schema: StructType) -> list[Callable[[], StreamingQuery]]:
    """Stage 2: rates, alerts and bad records, read back from the ``events`` sink with Spark's file source;
    each as a function that starts its query (again, after a failure, from its checkpoint).

    Only one query runs Python (the audit source); these run in the JVM on Parquet, read exactly once from
    the sink's commit log, and a failure or restart of either stage never reads a segment twice.
    """
    rows = spark.readStream.schema(events_schema).parquet(str(_events_path(opts)))
    good = rows.where(F.col("bad_reason").isNull()).drop("bad_reason", "raw")
    timed = good.withWatermark("ts", f"{opts.watermark_seconds} seconds")
    outputs: dict[str, DataFrame] = {
        "rates": rates(timed, opts.window_seconds),
        "alerts": alerts(timed, opts.stranded_seconds, opts.dead_letter_spike),
        "failover_alerts": failover_alerts(good),
        "bad_records": rows.where(F.col("bad_reason").isNotNull()).select(
            "node_id", "seq", "ts", "event", "bad_reason", "raw"
        ),
    }
    starts: list[Callable[[], StreamingQuery]] = [
        partial(_start, df, name, opts, None if opts.out is None else opts.out / name) for name, df in outputs.items()
    ]
    if opts.alerts_to is not None:
        target = AlertTarget.parse(opts.alerts_to)
        starts += [partial(_start_alerts_to, outputs[name], f"{name}_to_tmq", target, opts) for name in _ALERTS]
    return starts


def _start_alerts_to(df: DataFrame, query: str, target: AlertTarget, opts: StreamOptions) -> StreamingQuery:
    writer = df.writeStream.queryName(query).outputMode("append")
    writer = writer.option("checkpointLocation", str(opts.checkpoint / query))
    writer = writer.trigger(processingTime=f"{opts.trigger_seconds} seconds")
    return writer.foreachBatch(partial(publish_batch, target, query)).start()


def events_schema(spark: SparkSession, opts: StreamOptions) -> StructType:
    return spark.read.format(FORMAT).load(str(opts.audit_dir)).withColumn("ts", F.timestamp_micros("ts_us")).schema


def drop_torn_log_writes(checkpoint: Path) -> list[Path]:
    """Remove what a killed driver left half-written in the checkpoint's offset and commit logs: Spark writes
    each entry as ``.<batch>.<uuid>.tmp`` and renames it, and a kill before the rename leaves the temp file
    (and its ``.crc``). Never an entry, but a query that had not finished its first entry then refuses to
    start (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY, "offsets should be empty on batch 0"). Returns what
    was removed."""
    removed = []
    for log in (*checkpoint.glob("*/offsets"), *checkpoint.glob("*/commits")):
        for leftover in log.glob(".*.tmp*"):
            if leftover.is_file() and leftover.name.endswith((".tmp", ".tmp.crc")):
                leftover.unlink()
                removed.append(leftover)
    return removed


@dataclass
class _Supervised:
    """A query and how to start it again from its checkpoint after it failed."""

    start: Callable[[], StreamingQuery]
    query: StreamingQuery
    budget: RestartBudget
    name: str = field(init=False)  # read once: asking a query is a call into the JVM, which may be gone

    def __post_init__(self) -> None:
        self.name = self.query.name

    def restart(self, error: BaseException) -> None:
        """Start the query again after a back-off, or raise ``error`` once its budget is spent. A restart
        resumes from the checkpoint, so it stays exactly once. A start that fails in the JVM (the source's
        Python worker not connecting back in time, say) is one more failure, not the end of the stream;
        anything else (the JVM gone) ends it at once, with the query's error as the cause."""
        failed = error
        while (delay := self.budget.failed(time.monotonic())) is not None:
            first_line = str(failed).strip().splitlines()[0] if str(failed).strip() else type(failed).__name__
            _log.warning(
                "query %s failed (%s); restart %d of %d within %d s, in %.0f s",
                self.name,
                first_line,
                self.budget.spent,
                self.budget.max_restarts,
                RESTART_WINDOW_S,
                delay,
            )
            time.sleep(delay)
            try:
                self.query = self.start()
            except (PySparkException, Py4JJavaError) as start_failed:
                failed = start_failed
            except BaseException as start_failed:
                raise start_failed from error
            else:
                return
        if failed is error:
            raise error
        raise error from failed


def _supervise(spark: SparkSession, queries: list[_Supervised]) -> None:
    """Wait until a query stops: restart each one that failed, return when one was stopped cleanly.

    Waiting on any query, not on each in turn: a query that failed while another was being waited on
    would otherwise leave the stream running on half of its queries."""
    while True:
        with contextlib.suppress(StreamingQueryException):  # found below, with the query it belongs to
            spark.streams.awaitAnyTermination()
        spark.streams.resetTerminated()
        for supervised in queries:
            if supervised.query.isActive:
                continue
            error = supervised.query.exception()
            if error is None:
                return
            supervised.restart(error)


def _process_available(supervised: _Supervised) -> None:
    """Process everything available now (``--once``), restarting the query when it fails."""
    while True:
        try:
            supervised.query.processAllAvailable()
        except StreamingQueryException as error:
            supervised.restart(error)
        else:
            supervised.query.stop()
            return


def run_stream(spark: SparkSession, opts: StreamOptions) -> None:
    """Run until stopped (Ctrl-C), or until everything sealed now is processed with ``once``."""
    drop_torn_log_writes(opts.checkpoint)
    schema = events_schema(spark, opts)
    queries = [
        _Supervised(partial(start_ingest, spark, opts), start_ingest(spark, opts), RestartBudget(opts.max_restarts))
    ]
    try:
        if opts.once:
            # Not Trigger.AvailableNow: Spark 4.3 runs a Python source that way as a single batch, which
            # after a restart only replays the batch the checkpoint left unfinished.
            _process_available(queries[0])  # stage 2 must see everything stage 1 wrote
        queries += [
            _Supervised(start, start(), RestartBudget(opts.max_restarts)) for start in analyses(spark, opts, schema)
        ]
        if opts.once:
            for supervised in queries[1:]:
                _process_available(supervised)
        else:
            _supervise(spark, queries)
    finally:
        for supervised in queries:
            supervised.query.stop()
