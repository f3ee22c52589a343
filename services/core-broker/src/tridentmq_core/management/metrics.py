"""Prometheus text exposition (format 0.0.4) of a core node's gauges and counters.

Each metric family is written as one block (HELP, TYPE, then all its samples), as the format requires.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tridentmq_core.broker import Broker
from tridentmq_core.latency import BOUNDS_MS, LatencyHistogram
from tridentmq_core.management.status import NodeStatus, QueueRates
from tridentmq_core.queues import Queue

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "tridentmq_"

Labels = dict[str, str]
Sample = tuple[Labels, float]

#: Per-queue families: name suffix, type, help text, how to read the value.
_QUEUE_FAMILIES: tuple[tuple[str, str, str, Callable[[Queue], int]], ...] = (
    ("queue_depth", "gauge", "Messages waiting in the queue (not in flight).", len),
    (
        "queue_consumers",
        "gauge",
        "Clients' consumers attached to the queue.",
        lambda q: sum(not c.forwarder for c in q.consumers),
    ),
    (
        "queue_forwarders",
        "gauge",
        "Cluster connections moving the queue's messages to other nodes.",
        lambda q: sum(c.forwarder for c in q.consumers),
    ),
    ("queue_in_flight", "gauge", "Messages delivered and not yet settled.", lambda q: q.in_flight),
    ("queue_messages_added_total", "counter", "Messages added to the queue.", lambda q: q.added),
    ("queue_messages_acked_total", "counter", "Messages acknowledged from the queue.", lambda q: q.acked),
    ("queue_messages_delivered_total", "counter", "Deliveries made from the queue.", lambda q: q.delivered),
    ("queue_messages_expired_total", "counter", "Messages that expired in the queue.", lambda q: q.expired),
    (
        "queue_messages_dead_lettered_total",
        "counter",
        "Messages dead-lettered from the queue.",
        lambda q: q.dead_lettered,
    ),
)

#: Broker-wide counters: name suffix, ``Counters`` field, help text.
_BROKER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("messages_routed_total", "routed", "Messages routed to at least one queue."),
    ("messages_unrouted_total", "unrouted", "Messages accepted that matched no queue."),
    ("messages_duplicates_total", "duplicates", "Messages dropped as duplicates."),
    ("messages_acked_total", "acked", "Messages acknowledged."),
    ("messages_expired_total", "expired", "Messages expired."),
    ("messages_dead_lettered_total", "dead_lettered", "Messages dead-lettered."),
    ("messages_rejected_total", "rejected", "Publishes rejected."),
    ("messages_dropped_total", "dropped", "Publishes confirmed and discarded by address-full-policy DROP."),
    ("messages_forwarded_total", "forwarded", "Messages put on their way to another cluster node."),
    ("messages_received_total", "received", "Messages that came from another cluster node."),
    ("messages_redistributed_total", "redistributed", "Messages moved to another node's queue (redistribution)."),
)


def escape_label(value: str) -> str:
    """A label value as the exposition format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != value:  # noqa: PLR0124 - NaN is the one value unequal to itself
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> None:
    metric = PREFIX + name
    lines.append(f"# HELP {metric} {_escape_help(help_text)}")
    lines.append(f"# TYPE {metric} {kind}")
    for labels, value in samples:
        if labels:
            rendered = ",".join(f'{key}="{escape_label(val)}"' for key, val in labels.items())
            lines.append(f"{metric}{{{rendered}}} {_number(value)}")
        else:
            lines.append(f"{metric} {_number(value)}")


def _histogram(lines: list[str], name: str, help_text: str, histogram: LatencyHistogram) -> None:
    """A histogram family in seconds: cumulative ``_bucket`` samples by ``le``, then ``_sum`` and ``_count``."""
    metric = PREFIX + name
    lines.append(f"# HELP {metric} {_escape_help(help_text)}")
    lines.append(f"# TYPE {metric} histogram")
    cumulative = 0
    for bound, n in zip(BOUNDS_MS, histogram.counts, strict=False):
        cumulative += n
        lines.append(f'{metric}_bucket{{le="{bound / 1000!r}"}} {cumulative}')
    count = cumulative + histogram.counts[-1]
    lines.append(f'{metric}_bucket{{le="+Inf"}} {count}')
    lines.append(f"{metric}_sum {histogram.sum_ms / 1000!r}")
    lines.append(f"{metric}_count {count}")


def render_metrics(broker: Broker, status: NodeStatus, rates: QueueRates) -> str:
    """The whole exposition, ending with a newline."""
    queues = [q for _, q in sorted(broker.queues.items())]
    labels = [{"queue": q.name, "address": q.address, "routing": q.routing_type.name.lower()} for q in queues]
    lines: list[str] = []
    _family(
        lines,
        "node_info",
        "gauge",
        "Identity of this node (always 1).",
        [({"node_id": broker.node_id, "name": broker.settings.node.name}, 1)],
    )
    _family(
        lines,
        "uptime_seconds",
        "gauge",
        "Seconds since the node started.",
        [({}, round(max(time.time() - status.started_at, 0.0), 3))],
    )
    ready = status.ready and not status.not_serving()
    _family(lines, "ready", "gauge", "1 when the node serves clients (as /readyz says), else 0.", [({}, int(ready))])
    _family(
        lines,
        "connections",
        "gauge",
        "Open link sessions (a gateway's clients share a few link connections).",
        [({}, len(broker.sessions))],
    )
    _family(lines, "addresses", "gauge", "Addresses defined.", [({}, len(broker.addresses))])
    _family(lines, "queues", "gauge", "Queues defined.", [({}, len(broker.queues))])
    for name, kind, help_text, read in _QUEUE_FAMILIES:
        _family(lines, name, kind, help_text, [(lab, read(q)) for lab, q in zip(labels, queues, strict=True)])
    queue_rates = [rates.rates(q.name) for q in queues]
    _family(
        lines,
        "queue_enqueue_rate",
        "gauge",
        "Messages added per second over the last sample interval.",
        [(lab, r[0]) for lab, r in zip(labels, queue_rates, strict=True)],
    )
    _family(
        lines,
        "queue_ack_rate",
        "gauge",
        "Messages acked per second over the last sample interval.",
        [(lab, r[1]) for lab, r in zip(labels, queue_rates, strict=True)],
    )
    counters = broker.counters
    for name, attr, help_text in _BROKER_COUNTERS:
        _family(lines, name, "counter", help_text, [({}, getattr(counters, attr))])
    _histogram(
        lines,
        "message_latency_seconds",
        "End-to-end latency: a message's publish timestamp to its acknowledgement by a consumer.",
        broker.latency,
    )
    _histogram(
        lines,
        "message_time_in_queue_seconds",
        "Time in queue: a message's publish timestamp to each of its deliveries to a consumer.",
        broker.time_in_queue,
    )
    cluster = status.cluster() if status.cluster is not None else None
    if cluster is not None:
        _family(
            lines,
            "cluster_members",
            "gauge",
            "Live cluster members this node sees, itself included.",
            [({}, len(cluster["members"]))],
        )
        _family(
            lines,
            "cluster_connection_up",
            "gauge",
            "1 while the cluster connection to a node is up.",
            [({"to": c["address"], "node_id": c["node_id"]}, int(c["state"] == "up")) for c in cluster["connections"]],
        )
        _family(
            lines,
            "cluster_pending_forward",
            "gauge",
            "Messages waiting to be confirmed by another node.",
            [({"to": c["address"], "node_id": c["node_id"]}, c["pending_forward"]) for c in cluster["connections"]],
        )
        _family(
            lines,
            "cluster_remote_bindings",
            "gauge",
            "Queues of other nodes known here.",
            [({}, cluster["remote_bindings"])],
        )
    journal = status.journal
    if journal is not None:
        _family(
            lines,
            "journal_records_synced_total",
            "counter",
            "Journal records known to be on disk.",
            [({}, journal.synced)],
        )
        _family(
            lines, "journal_syncs_total", "counter", "Journal group commits (fdatasync calls).", [({}, journal.syncs)]
        )
    return "\n".join(lines) + "\n"
