"""The latency histogram: its buckets, percentiles against a sorted-list reference, what the broker times,
and its Prometheus exposition."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.unit.broker_harness import BASE_MS, Client, Harness, ok
from tests.unit.test_management import parse_metrics

from tridentmq_core.latency import (
    BOUNDS_MS,
    EXACT,
    MAX_BITS,
    OVERFLOW,
    LatencyHistogram,
    bucket_of,
    percentile,
    upper_bound,
)
from tridentmq_core.management import NodeStatus, QueueRates, render_metrics


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def c(h: Harness) -> Client:
    return h.connect("app")


latencies = st.lists(st.integers(min_value=0, max_value=2 ** (MAX_BITS + 2)), min_size=1, max_size=300)
#: Also negative ones: a timestamp from a clock ahead of this node's.
skewed = st.lists(st.integers(min_value=-5000, max_value=2 ** (MAX_BITS + 2)), min_size=1, max_size=300)


def test_buckets_are_contiguous_log_spaced_and_exact_below_8_ms() -> None:
    assert BOUNDS_MS[:EXACT] == tuple(range(EXACT))
    assert BOUNDS_MS[-1] == 2**MAX_BITS - 1
    for lower, upper in zip(BOUNDS_MS[EXACT - 1 :], BOUNDS_MS[EXACT:], strict=False):
        assert lower < upper <= lower * 1.25 + 1  # at most 25 % wider than the bucket below
    for index, bound in enumerate(BOUNDS_MS):  # each bound is the largest latency of its bucket
        assert bucket_of(bound) == index
        assert bucket_of(bound + 1) == index + 1
    assert bucket_of(2**MAX_BITS) == OVERFLOW
    assert upper_bound(OVERFLOW) == math.inf
    assert bucket_of(-5) == 0  # clock skew: counted as no latency


@given(skewed)
def test_record_counts_each_latency_in_its_bucket(values: list[int]) -> None:
    histogram = LatencyHistogram()
    for value in values:
        histogram.record(value)
    expected = [0] * (OVERFLOW + 1)
    for value in values:
        expected[bucket_of(value)] += 1
    assert histogram.counts == expected
    assert histogram.count == len(values)
    assert histogram.sum_ms == sum(max(value, 0) for value in values)


@given(latencies, st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_percentile_is_the_bound_of_the_bucket_of_the_true_percentile(values: list[int], fraction: float) -> None:
    histogram = LatencyHistogram()
    for value in values:
        histogram.record(value)
    ordered = sorted(values)
    true = ordered[max(1, math.ceil(fraction * len(ordered))) - 1]  # nearest rank
    reported = percentile(histogram.counts, fraction)
    assert reported == upper_bound(bucket_of(true))
    assert reported is not None
    assert true <= reported


@given(latencies, latencies)
def test_differences_of_two_reads_give_the_interval_alone(before: list[int], during: list[int]) -> None:
    histogram = LatencyHistogram()
    for value in before:
        histogram.record(value)
    first = list(histogram.counts)
    for value in during:
        histogram.record(value)
    interval = [b - a for a, b in zip(first, histogram.counts, strict=True)]
    ordered = sorted(during)
    assert percentile(interval, 0.5) == upper_bound(bucket_of(ordered[math.ceil(0.5 * len(ordered)) - 1]))


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([0] * (OVERFLOW + 1), 0.99) is None


def test_broker_times_acks_auto_acks_and_deliveries(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    ok(c.create_queue("feed"))
    c.send_all("orders", [b"a", b"b"])  # stamped at BASE_MS by the core
    c.send_all("feed", [b"f"])
    h.now_ms = BASE_MS + 40
    cid = c.consumer("orders")
    got = c.take(cid)
    assert h.broker.time_in_queue.count == 2
    assert h.broker.latency.count == 0
    h.now_ms = BASE_MS + 5000  # beyond the looked-up small latencies
    c.ack(cid, [d.id for d in got])
    auto = c.consumer("feed", auto_ack=True)  # the delivery is the acknowledgement
    assert len(c.take(auto)) == 1
    latency, waited = h.broker.latency, h.broker.time_in_queue
    assert latency.count == 3
    assert latency.sum_ms == 15000
    assert latency.counts[bucket_of(5000)] == 3
    assert waited.counts[bucket_of(40)] == 2
    assert waited.counts[bucket_of(5000)] == 1


def test_metrics_expose_a_prometheus_histogram(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"a", b"b", b"c"])
    cid = c.consumer("orders")
    got = c.take(cid)
    h.now_ms = BASE_MS + 5
    c.ack(cid, [got[0].id])
    h.now_ms = BASE_MS + 100
    c.ack(cid, [d.id for d in got[1:]])
    families, samples = parse_metrics(render_metrics(h.broker, NodeStatus(started_at=0.0), QueueRates()))
    name = "tridentmq_message_latency_seconds"
    assert families[name][0] == "histogram"
    assert samples[(f"{name}_count", frozenset())] == 3
    assert samples[(f"{name}_sum", frozenset())] == 0.205
    assert samples[(f"{name}_bucket", frozenset({("le", "0.004")}))] == 0
    assert samples[(f"{name}_bucket", frozenset({("le", "0.005")}))] == 1
    assert samples[(f"{name}_bucket", frozenset({("le", "0.095")}))] == 1
    assert samples[(f"{name}_bucket", frozenset({("le", "0.111")}))] == 3
    assert samples[(f"{name}_bucket", frozenset({("le", "+Inf")}))] == 3
    buckets = [v for (metric, _), v in samples.items() if metric == f"{name}_bucket"]
    assert buckets == sorted(buckets)
    assert len(buckets) == OVERFLOW + 1
    assert samples[("tridentmq_message_time_in_queue_seconds_count", frozenset())] == 3
