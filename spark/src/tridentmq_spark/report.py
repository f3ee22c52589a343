"""``tridentmq audit report``: one batch pass over all nodes' sealed segments, written as Parquet tables and
one self-contained HTML report (plotly charts with the plotly library inlined: it opens offline)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from tridentmq_spark import jobs, segments

__all__ = ["ReportResult", "build_report"]

HTML_NAME = "report.html"
_LIFECYCLE = [
    "node.joined",
    "node.left",
    "node.forgotten",
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


_MSG_COUNTED = ("msg.sent", "msg.acked", "msg.nacked", "msg.dead_lettered", "msg.expired")
_CONN_EVENTS = ("conn.opened", "conn.closed", "consumer.opened", "consumer.closed")
_LATENCY_EVENTS = {"msg.acked": "latency", "msg.delivered": "time_in_queue"}
_BIN_RATIO = 1.005  # latency histogram bins 0.5 % wide: a percentile is the largest latency of its bin


def _facts(rows: DataFrame, bucket_s: int) -> DataFrame:
    """The ONE aggregation over the events that every table is cut from (plain counts, sums, min and max:
    Spark runs it as a code-generated hash aggregate).

    Grouped by everything a table splits by (time bucket, node, epoch, event, address, queue, reason, ...),
    so it is small; a lifecycle event or a bad record keeps its own row (its seq is part of the key). An
    event with a latency (msg.acked, msg.delivered) is counted a second time into a latency histogram:
    ``lat_bin`` set, by event and address only, with the smallest and largest latency of each bin.
    """
    ev = F.col("event")
    bad = F.col("bad_reason").isNotNull()
    single = bad | ev.isin(*_LIFECYCLE)  # rows the report lists one by one
    latency_ms = F.when(  # (a bad record has none: a repeated seq's line would be counted twice)
        ~bad & ev.isin(*_LATENCY_EVENTS) & F.col("sent_ts_us").isNotNull(),
        (F.col("ts_us") - F.col("sent_ts_us")) / 1000.0,
    )
    detail = F.concat_ws(" ", F.coalesce("peer_node", "to", "backup", "reason", "configured_role"), F.col("name"))
    # False: the event's own row; True: its histogram row (only events with a latency have one).
    own_row, histogram_row = F.lit(False), F.lit(True)  # noqa: FBT003
    as_histogram = F.explode(
        F.when(latency_ms.isNotNull(), F.array(own_row, histogram_row)).otherwise(F.array(own_row))
    )
    rows = rows.select("*", latency_ms.alias("latency_ms"), as_histogram.alias("hist"))
    hist = F.col("hist")

    def own(column: Column) -> Column:
        return F.when(~hist, column)

    lat = F.col("latency_ms")
    keyed = rows.select(
        own(F.timestamp_seconds(F.floor(F.col("ts_us") / (bucket_s * 1_000_000)) * bucket_s)).alias("bucket"),
        own(F.col("node_id")).alias("node_id"),
        own(F.col("epoch")).alias("epoch"),
        "event",
        "address",
        own(F.col("queue")).alias("queue"),
        own(F.col("reason")).alias("reason"),
        own(F.when(ev.isin(*_CONN_EVENTS), F.coalesce("protocol", "consumer_protocol"))).alias("protocol"),
        own((ev == "msg.delivered") & (F.col("delivery_count") > 1)).alias("redelivered"),
        "bad_reason",
        own(F.when(single, F.col("seq"))).alias("row_seq"),
        own(F.when(single, F.col("ts"))).alias("row_ts"),
        F.when(bad, F.col("v")).alias("row_v"),
        F.when(bad, F.col("raw")).alias("raw"),
        own(F.when(ev.isin(*_LIFECYCLE) & ~bad, detail)).alias("detail"),
        F.when(hist, F.when(lat > 0, F.floor(F.log(_BIN_RATIO, lat))).otherwise(F.lit(-(2**31)))).alias("lat_bin"),
        "ts",
        own(F.col("size")).alias("size"),
        F.when(hist, lat).alias("latency_ms"),
    )
    key = [c for c in keyed.columns if c not in {"ts", "size", "latency_ms"}]
    return keyed.groupBy(*key).agg(
        F.count("*").alias("n"),
        F.sum("size").alias("bytes"),
        F.min("ts").alias("first_ts"),
        F.min("latency_ms").alias("latency_min_ms"),
        F.max("latency_ms").alias("latency_max_ms"),
    )


def _percentiles(histogram: pd.DataFrame, event: str) -> pd.DataFrame:
    """p50/p90/p99/max per address from the latency histogram of one event: the largest latency of the bin
    the rank falls in (at most 0.5 % above the exact value)."""
    out = []
    for address, g in histogram[histogram["event"] == event].groupby("address", dropna=False):
        g = g.sort_values("lat_bin")
        total = int(g["n"].sum())
        cumulative = g["n"].cumsum().to_numpy()
        highs = g["latency_max_ms"].to_numpy()
        p = [float(highs[int(np.searchsorted(cumulative, np.ceil(q * total)))]) for q in (0.5, 0.9, 0.99)]
        out.append((address, total, *p, float(highs[-1])))
    columns = ["address", "messages", "p50_ms", "p90_ms", "p99_ms", "max_ms"]
    return pd.DataFrame(out, columns=columns).sort_values("address").reset_index(drop=True)


def _sum(df: pd.DataFrame, by: list[str], column: str = "n", name: str = "messages") -> pd.DataFrame:
    out = df.groupby(by, dropna=False, as_index=False)[column].sum().rename(columns={column: name})
    return out.sort_values(by, na_position="first", kind="stable").reset_index(drop=True)


def _tables(f: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Every table of the report, cut from the facts (pandas: they are small)."""
    histogram, f = f[f["lat_bin"].notna()], f[f["lat_bin"].isna()]
    good, bad = f[f["bad_reason"].isna()], f[f["bad_reason"].notna()]
    ev = good["event"]
    throughput = good[ev.isin(["msg.sent", "msg.acked"])]
    throughput = throughput.groupby(["bucket", "address", "event"], dropna=False, as_index=False)[["n", "bytes"]].sum()
    throughput = throughput.rename(columns={"n": "messages"}).sort_values(["bucket", "address", "event"])
    redelivered = good[ev.isin(["msg.nacked", "msg.dead_lettered", "msg.expired"]) | good["redelivered"]]
    lifecycle = good[ev.isin(_LIFECYCLE)][["row_ts", "node_id", "event", "epoch", "detail"]]
    epochs = good.groupby(["node_id", "epoch"], as_index=False)["first_ts"].min().rename(columns={"first_ts": "ts"})
    epochs["event"], epochs["detail"] = "epoch", None
    timeline = pd.concat(
        [lifecycle.rename(columns={"row_ts": "ts"}), epochs[["ts", "node_id", "event", "epoch", "detail"]]]
    )
    return {
        "throughput": throughput.reset_index(drop=True),
        "latency": _percentiles(histogram, "msg.acked"),
        "time_in_queue": _percentiles(histogram, "msg.delivered"),
        "redeliveries": _sum(redelivered, ["address", "queue", "event", "reason"]),
        "dead_letters": _sum(good[ev == "msg.dead_lettered"], ["bucket", "address", "reason"]),
        "connections": _sum(good[ev.isin(_CONN_EVENTS)], ["bucket", "node_id", "event", "protocol"], name="count"),
        "cluster_timeline": timeline.sort_values(["ts", "node_id"], kind="stable").reset_index(drop=True),
        "bad_records_by_reason": _sum(bad, ["node_id", "bad_reason"], name="records"),
    }


def build_report(spark: SparkSession, audit_dir: Path, out: Path, *, bucket_seconds: int = 0) -> ReportResult:
    """One read of the segments: a single aggregation (cached, small) that every table and chart comes from."""
    first, last = segments.time_span(audit_dir)
    bucket_s = bucket_seconds or _bucket_seconds((last - first) / 1e6 if first is not None and last is not None else 0)
    facts = _facts(jobs.load(spark, audit_dir), bucket_s).cache()
    try:
        f: pd.DataFrame = facts.drop("raw").toPandas()  # the one pass over the events
        out.mkdir(parents=True, exist_ok=True)
        facts.where(F.col("bad_reason").isNotNull()).select(
            "node_id",
            F.col("row_seq").alias("seq"),
            F.col("row_ts").alias("ts"),
            "event",
            F.col("row_v").alias("v"),
            "bad_reason",
            "raw",
            F.explode(F.array_repeat(F.lit(0), F.col("n").cast("int"))),  # identical bad lines: one row each
        ).drop("col").write.mode("overwrite").parquet(str(out / "bad_records"))
    finally:
        facts.unpersist()
    frames = _tables(f)
    for name, frame in frames.items():
        frame.to_parquet(out / f"{name}.parquet", index=False)
    own = f[f["lat_bin"].isna()]
    total = int(own["n"].sum())
    bad_count = int(own.loc[own["bad_reason"].notna(), "n"].sum())
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
            "msg.nacked, redeliveries (msg.delivered with delivery_count > 1), msg.dead_lettered, msg.expired.",
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
