"""``tridentmq audit report``: one batch pass over all nodes' sealed segments, written as Parquet tables and
one self-contained HTML report (plotly charts with the plotly library inlined: it opens offline)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tridentmq_spark import jobs, segments

__all__ = ["ReportResult", "build_report"]

HTML_NAME = "report.html"
_LIFECYCLE = [
    "node.joined",
    "node.left",
    "ha.activated",
    "ha.backup_in_sync",
    "ha.backup_lost",
    "ha.failback",
    "ha.fenced",
]
_BUCKETS_S = (1, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400)


@dataclass
class ReportResult:
    html_path: Path
    events: int
    bad_records: int
    tables: dict[str, int]


def _bucket_seconds(span_s: float) -> int:
    """A bucket giving at most ~120 points over the span."""
    for size in _BUCKETS_S:
        if span_s / size <= 120:
            return size
    return _BUCKETS_S[-1]


def _tables(ev: DataFrame, bad: DataFrame, bucket_s: int) -> dict[str, DataFrame]:
    msg = ev.where(F.col("event").startswith("msg."))
    bucket = F.window("ts", f"{bucket_s} seconds").start.alias("bucket")
    latency_ms = (F.col("ts_us") - F.col("sent_ts_us")) / 1000.0
    acked = ev.where((F.col("event") == "msg.acked") & F.col("sent_ts_us").isNotNull())
    delivered = ev.where((F.col("event") == "msg.delivered") & F.col("sent_ts_us").isNotNull())
    pct = F.percentile_approx(latency_ms, [0.5, 0.9, 0.99], 10000)

    def percentiles(df: DataFrame) -> DataFrame:
        return (
            df.groupBy("address")
            .agg(F.count("*").alias("messages"), pct.alias("p"), F.max(latency_ms).alias("max_ms"))
            .select(
                "address",
                "messages",
                F.col("p")[0].alias("p50_ms"),
                F.col("p")[1].alias("p90_ms"),
                F.col("p")[2].alias("p99_ms"),
                "max_ms",
            )
            .orderBy("address")
        )

    conns = ev.where(F.col("event").isin("conn.opened", "conn.closed", "consumer.opened", "consumer.closed"))
    epochs = (
        ev.groupBy("node_id", "epoch")
        .agg(F.min("ts").alias("ts"))
        .select("ts", "node_id", F.lit("epoch").alias("event"), "epoch", F.lit(None).cast("string").alias("detail"))
    )
    lifecycle = ev.where(F.col("event").isin(_LIFECYCLE)).select(
        "ts",
        "node_id",
        "event",
        "epoch",
        F.concat_ws(" ", F.coalesce("peer_node", "to", "backup", "reason", "configured_role"), F.col("name")).alias(
            "detail"
        ),
    )
    return {
        "throughput": msg.where(F.col("event").isin("msg.sent", "msg.acked"))
        .groupBy(bucket, "address", "event")
        .agg(F.count("*").alias("messages"), F.sum("size").alias("bytes"))
        .orderBy("bucket", "address", "event"),
        "latency": percentiles(acked),
        "time_in_queue": percentiles(delivered),
        "redeliveries": msg.where(
            F.col("event").isin("msg.nacked", "msg.dead_lettered", "msg.expired")
            | ((F.col("event") == "msg.acked") & (F.col("delivery_count") > 1))
        )
        .groupBy("address", "queue", "event", "reason")
        .agg(F.count("*").alias("messages"))
        .orderBy("address", "event"),
        "dead_letters": msg.where(F.col("event") == "msg.dead_lettered")
        .groupBy(bucket, "address", "reason")
        .agg(F.count("*").alias("messages"))
        .orderBy("bucket"),
        "connections": conns.groupBy(
            bucket, "node_id", "event", F.coalesce("protocol", "consumer_protocol").alias("protocol")
        )
        .agg(F.count("*").alias("count"))
        .orderBy("bucket"),
        "cluster_timeline": lifecycle.unionByName(epochs).orderBy("ts", "node_id"),
        "bad_records_by_reason": bad.groupBy("node_id", "bad_reason")
        .agg(F.count("*").alias("records"))
        .orderBy("node_id", "bad_reason"),
    }


def build_report(spark: SparkSession, audit_dir: Path, out: Path, *, bucket_seconds: int = 0) -> ReportResult:
    rows = jobs.load(spark, audit_dir).cache()
    ev, bad = jobs.events(rows), jobs.bad_records(rows)
    counts = rows.agg(
        F.count("*").alias("rows"),
        F.count("bad_reason").alias("bad"),
        F.min("ts_us").alias("first"),
        F.max("ts_us").alias("last"),
    ).first()
    assert counts is not None
    total, bad_count = int(counts["rows"]), int(counts["bad"])
    first, last = counts["first"], counts["last"]
    span_s = (last - first) / 1e6 if first is not None and last is not None else 0.0
    bucket_s = bucket_seconds or _bucket_seconds(span_s)
    out.mkdir(parents=True, exist_ok=True)
    tables = _tables(ev, bad, bucket_s)
    frames: dict[str, pd.DataFrame] = {}
    for name, df in tables.items():
        frame: pd.DataFrame = df.toPandas()  # aggregates are small; one pass each, then written as Parquet from pandas
        frame.to_parquet(out / f"{name}.parquet", index=False)
        frames[name] = frame
    bad.write.mode("overwrite").parquet(str(out / "bad_records"))
    rows.unpersist()
    html_path = out / HTML_NAME
    html_path.write_text(_html(frames, audit_dir, total - bad_count, bad_count, bucket_s), encoding="utf-8")
    return ReportResult(html_path, total - bad_count, bad_count, {k: len(v) for k, v in frames.items()})


# ---------------------------------------------------------------------------------------------- HTML


def _figures(f: dict[str, pd.DataFrame], bucket_s: int) -> list[tuple[str, go.Figure | None, str]]:
    figs: list[tuple[str, go.Figure | None, str]] = []
    tp = f["throughput"]
    fig = go.Figure()
    for (address, event), g in tp.groupby(["address", "event"], dropna=False):
        fig.add_trace(
            go.Scatter(x=g["bucket"], y=g["messages"] / bucket_s, mode="lines+markers", name=f"{address} {event}")
        )
    fig.update_layout(yaxis_title="messages/s", xaxis_title=f"time (UTC, {bucket_s} s buckets)")
    figs.append(("Throughput per address", fig if len(tp) else None, "msg.sent and msg.acked per second."))
    for key, title, note in (
        ("latency", "End-to-end latency per address", "msg.acked time minus the message's sent time."),
        ("time_in_queue", "Time in queue per address", "msg.delivered time minus the message's sent time."),
    ):
        lat = f[key]
        fig = go.Figure()
        for col in ("p50_ms", "p90_ms", "p99_ms"):
            fig.add_trace(go.Bar(x=lat["address"], y=lat[col], name=col.removesuffix("_ms")))
        fig.update_layout(barmode="group", yaxis_title="ms")
        figs.append((title, fig if len(lat) else None, note))
    red = f["redeliveries"]
    fig = go.Figure()
    for event, g in red.groupby("event"):
        labels = (
            g["address"].astype(str)
            + " / "
            + g["queue"].astype(str)
            + g["reason"].map(lambda r: f" ({r})" if isinstance(r, str) else "")
        )
        fig.add_trace(go.Bar(x=labels, y=g["messages"], name=str(event)))
    fig.update_layout(barmode="group", yaxis_title="messages")
    figs.append(
        (
            "Redeliveries, dead letters and expiries",
            fig if len(red) else None,
            "msg.nacked, redelivered acks (delivery_count > 1), msg.dead_lettered, msg.expired.",
        )
    )
    conns = f["connections"]
    fig = go.Figure()
    for (event, proto), g in conns.groupby(["event", "protocol"], dropna=False):
        g = g.groupby("bucket", as_index=False)["count"].sum()
        label = f"{event} ({proto})" if isinstance(proto, str) else str(event)
        fig.add_trace(go.Bar(x=g["bucket"], y=g["count"], name=label))
    fig.update_layout(barmode="stack", yaxis_title="count", xaxis_title=f"time (UTC, {bucket_s} s buckets)")
    figs.append(
        (
            "Connections and consumers",
            fig if len(conns) else None,
            "Link connections opened/closed and consumers opened/closed on the core nodes.",
        )
    )
    tl = f["cluster_timeline"]
    fig = go.Figure()
    for event, g in tl.groupby("event"):
        detail = g["detail"].fillna("").astype(str)
        fig.add_trace(
            go.Scatter(
                x=g["ts"],
                y=g["node_id"].str[:8],
                mode="markers",
                name=str(event),
                marker={"size": 11, "symbol": "diamond" if event == "epoch" else "circle"},
                text=[f"{event} epoch {e} {d}" for e, d in zip(g["epoch"], detail, strict=True)],
            )
        )
    fig.update_layout(yaxis_title="node", xaxis_title="time (UTC)")
    figs.append(
        (
            "Cluster and HA timeline",
            fig if len(tl) else None,
            "Joins, leaves, HA activations, epochs (first event of each node epoch), failbacks, fencing.",
        )
    )
    return figs


def _html(f: dict[str, pd.DataFrame], audit_dir: Path, events: int, bad: int, bucket_s: int) -> str:
    nodes = len(segments.list_nodes(audit_dir))
    parts = []
    plotly_inlined = False
    for title, fig, note in _figures(f, bucket_s):
        parts.append(f"<h2>{html.escape(title)}</h2><p>{html.escape(note)}</p>")
        if fig is None:
            parts.append('<p class="empty">No events of this kind.</p>')
            continue
        fig.update_layout(height=380, margin={"l": 60, "r": 20, "t": 20, "b": 50})
        parts.append(fig.to_html(full_html=False, include_plotlyjs=not plotly_inlined))
        plotly_inlined = True
    by_reason = f["bad_records_by_reason"]
    reasons = ", ".join(f"{r}: {int(n)}" for r, n in by_reason.groupby("bad_reason")["records"].sum().items())
    bad_line = f"Bad records: {bad}" + (f" ({reasons})" if reasons else "")
    tables = "".join(
        f"<h3>{html.escape(k)}</h3>" + v.head(50).to_html(index=False, na_rep="", border=0)
        for k, v in f.items()
        if k in {"latency", "time_in_queue", "bad_records_by_reason"}
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>TridentMQ audit report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} table{{border-collapse:collapse}}
td,th{{padding:2px 8px;border-bottom:1px solid #ddd}} .bad{{font-weight:bold}}</style></head><body>
<h1>TridentMQ audit report</h1>
<p>Audit folder: {html.escape(audit_dir.name)} ({nodes} nodes). Events: {events}.</p>
<p class="bad" id="bad-records">{html.escape(bad_line)}</p>
{"".join(parts)}
<h2>Tables</h2>{tables}
</body></html>
"""
