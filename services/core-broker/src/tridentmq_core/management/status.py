"""What the server tells the management API and the metrics about its node: ``NodeStatus`` (facts the
server owns) and ``QueueRates`` (enqueue and acknowledge rates from successive samples)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from tridentmq_core.broker import Broker
from tridentmq_core.queues import Queue, QueueNotesReader


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
    samples. A sample looks only at the queues whose messages came or went since the one before (the broker
    notes them; a core with 100,000 MQTT sessions holds 200,000 queues, nearly all quiet), so its cost is the
    traffic's, not the number of queues. A queue made since the last sample counts from zero, one made again under
    a deleted one's name too.
    """

    def __init__(self) -> None:
        self._last_time: float | None = None
        self._last: dict[str, tuple[int, int]] = {}  # queue -> (added, acked) at its last sample; absent: (0, 0)
        self._rates: dict[str, tuple[float, float]] = {}
        self._changed: QueueNotesReader | None = None

    def sample(self, broker: Broker, now: float) -> None:
        """Record the counters of the queues that changed, at ``now`` (seconds, any monotonic origin)."""
        elapsed = None if self._last_time is None else now - self._last_time
        if elapsed is not None and elapsed <= 0:
            return  # same instant or a clock step back: keep the previous baseline and rates
        queues = broker.queues
        if self._changed is None:  # the first sample: every queue's counters (recovered messages count too)
            self._changed = broker.activity.changed.reader()
            changed: Iterable[Queue] = queues.values()
        else:
            changed = self._changed.take()
        last, rates = self._last, {}
        sampled, deleted = set(), []
        for queue in changed:
            name = queue.name
            if queues.get(name) is not queue:
                deleted.append(name)
                continue
            sampled.add(name)
            counts = (queue.added, queue.acked)
            previous = last.get(name, _NONE)
            last[name] = counts
            if elapsed is not None and counts[0] >= previous[0] and counts[1] >= previous[1] and counts != previous:
                rates[name] = ((counts[0] - previous[0]) / elapsed, (counts[1] - previous[1]) / elapsed)
        for name in deleted:
            if name not in sampled:  # not one made again under its name, which counts from zero
                last.pop(name, None)
        self._rates = rates
        self._last_time = now

    def rates(self, queue: str) -> tuple[float, float]:
        """(enqueued/s, acknowledged/s) of ``queue``; (0.0, 0.0) when unknown."""
        return self._rates.get(queue, (0.0, 0.0))
