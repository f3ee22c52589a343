"""What the server tells the management API and the metrics about its node: ``NodeStatus`` (facts the
server owns) and ``QueueRates`` (enqueue and acknowledge rates from successive samples)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from tridentmq_core.broker import Broker


class JournalStats(Protocol):
    synced: int  # records on disk (record numbers run from 1)
    syncs: int  # group commits (fdatasync calls)


@dataclass
class NodeStatus:
    """Mutable facts about the node that the server owns and the management API reports."""

    started_at: float  # unix seconds
    ready: bool = False
    failure: str | None = None  # a background task failed: the node stops (see tridentmq_shared.supervision)
    link_port: int = 0
    epoch: int = 0  # activation epoch (see store/identity.py)
    journal: JournalStats | None = None  # None: the journal is disabled
    recovered: dict[str, int] = field(default_factory=dict)  # queue -> messages recovered at start
    truncated: list[str] = field(default_factory=list)  # journal tails cut off at start, one line each
    cluster: Callable[[], dict[str, Any]] | None = None  # the cluster view, when the node clusters
    ha: Callable[[], dict[str, Any]] | None = None  # the pair's view, when the node is half of one
    links: Callable[[], int] = lambda: 0  # link connections (a gateway's shared link carries many sessions)
    #: Why a ready node serves no client now ("" when it does): cut off from its backup and a quorum, or from
    #: its network. Not ready then: a load balancer or a Kubernetes Service must send clients elsewhere.
    not_serving: Callable[[], str] = lambda: ""


_NONE: Final = (0, 0)


class QueueRates:
    """Per-queue enqueue and acknowledge rates (messages/s) from successive samples of the queue counters.

    The server calls ``sample`` about once a second; a rate covers the interval between the last two
    samples. A queue seen for the first time, or one whose counters went backwards (deleted and created
    again under the same name), reports 0.0 until the next sample.
    """

    def __init__(self) -> None:
        self._last_time: float | None = None
        self._last: dict[str, tuple[int, int]] = {}  # queue -> (added, acked) at the last sample
        self._rates: dict[str, tuple[float, float]] = {}

    def sample(self, broker: Broker, now: float) -> None:
        """Record the counters of every queue at ``now`` (seconds, any monotonic origin)."""
        # Most queues of a node with many clients never had a message: they share one (0, 0) and get no rate
        # entry (tens of thousands of them would otherwise cost a tuple, a rate and two floats each).
        current = {name: (q.added, q.acked) if q.added or q.acked else _NONE for name, q in broker.queues.items()}
        elapsed = None if self._last_time is None else now - self._last_time
        if elapsed is not None and elapsed <= 0:
            return  # same instant or a clock step back: keep the previous baseline and rates
        rates: dict[str, tuple[float, float]] = {}
        if elapsed is not None:
            for name, counts in current.items():
                previous = self._last.get(name)
                if previous is None or previous is counts:
                    continue
                added, acked = counts
                if added >= previous[0] and acked >= previous[1] and (added, acked) != previous:
                    rates[name] = ((added - previous[0]) / elapsed, (acked - previous[1]) / elapsed)
        self._rates = rates
        self._last = current
        self._last_time = now

    def rates(self, queue: str) -> tuple[float, float]:
        """(enqueued/s, acknowledged/s) of ``queue``; (0.0, 0.0) when unknown."""
        return self._rates.get(queue, (0.0, 0.0))
