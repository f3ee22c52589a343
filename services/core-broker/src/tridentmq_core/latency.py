"""Fixed-size latency histograms in milliseconds, cheap enough for every acknowledgement. Pure: no clock,
the caller passes the latency (its ``now_ms`` minus the message's timestamp).

Buckets are log-spaced, four to a power of two (each at most 25 % wider than the one below), exact below
8 ms, up to 2**20 ms (about 17.5 minutes); longer latencies fall in an overflow bucket. Recording one is a
few integer operations and no allocation; the memory is the same whatever the traffic. The counts are
cumulative since the node started (as Prometheus wants them): a reader takes the difference of two reads
for the percentiles of the interval between them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

#: Latencies below this (ms) have a bucket each.
EXACT: Final = 8
#: Latencies of this many bits or more (>= 2**MAX_BITS ms) are counted in the overflow bucket.
MAX_BITS: Final = 20
#: Finite buckets: ``EXACT`` exact ones, then four per power of two from 8 ms to 2**MAX_BITS ms.
FINITE: Final = EXACT + (MAX_BITS - 3) * 4
OVERFLOW: Final = FINITE  # the index of the overflow bucket (+Inf)


def bucket_of(latency_ms: int) -> int:
    """The index of the bucket counting ``latency_ms`` (a negative latency, from clock skew, counts as 0)."""
    if latency_ms < EXACT:
        return latency_ms if latency_ms > 0 else 0
    bits = latency_ms.bit_length()
    if bits > MAX_BITS:
        return OVERFLOW
    # The top three bits are 4..7: two bits of position within the power of two.
    return (bits - 3) * 4 + (latency_ms >> (bits - 3))


def upper_bound(index: int) -> float:
    """The largest latency (ms, inclusive) counted by bucket ``index``; +inf for the overflow bucket."""
    if index < EXACT:
        return index
    if index >= OVERFLOW:
        return math.inf
    return ((index % 4 + 5) << (index // 4 - 1)) - 1


#: Every finite bucket's inclusive upper bound (ms), in order.
BOUNDS_MS: Final[tuple[int, ...]] = tuple(int(upper_bound(i)) for i in range(FINITE))
#: Latencies below this (ms) find their bucket in ``SMALL_BUCKETS`` (an index, no arithmetic: the hot path).
SMALL_MS: Final = 4096
SMALL_BUCKETS: Final[tuple[int, ...]] = tuple(bucket_of(ms) for ms in range(SMALL_MS))


class LatencyHistogram:
    """Counts of latencies per bucket, their number and their sum (ms), since the node started."""

    __slots__ = ("counts", "sum_ms")

    def __init__(self) -> None:
        self.counts = [0] * (FINITE + 1)
        self.sum_ms = 0

    def record(self, latency_ms: int) -> None:
        if 0 <= latency_ms < SMALL_MS:
            self.counts[SMALL_BUCKETS[latency_ms]] += 1
            self.sum_ms += latency_ms
        else:
            self.add(bucket_of(latency_ms), latency_ms)

    def add(self, index: int, latency_ms: int) -> None:
        """Count ``latency_ms`` in bucket ``index`` (``bucket_of(latency_ms)``, known to the caller)."""
        self.counts[index] += 1
        if latency_ms > 0:
            self.sum_ms += latency_ms

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_json(self) -> dict[str, object]:
        """For the management API: the bucket bounds, the counts (the last is the overflow), sum and count."""
        return {"le_ms": BOUNDS_MS, "counts": list(self.counts), "sum_ms": self.sum_ms, "count": self.count}


def percentile(counts: Sequence[int], fraction: float) -> float | None:
    """The upper bound (ms) of the bucket holding the ``fraction`` (0 < fraction <= 1) percentile of the
    latencies counted in ``counts`` (per bucket, e.g. the difference of two reads); None when empty.
    The true value is at most this bound and above the bound of the bucket below."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = max(1, math.ceil(fraction * total))  # the rank-th smallest latency, counted from 1
    seen = 0
    for index, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return upper_bound(index)
    return math.inf  # unreachable: seen reaches total >= rank
