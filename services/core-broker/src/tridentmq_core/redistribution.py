"""Redistribution: moving a queue's backlog to other nodes that have consumers for it. Pure.

Artemis leaves redistribution off by default, which strands messages on a node whose consumers moved away;
here it is on. A queue qualifies when it holds messages, none of its own consumers is left, and another node
has a queue of the same name on the same address with a consumer; after the address's
``redistribution-delay`` a ``Redistributor`` per such node is attached to it. Each is an ordinary consumer of
the queue that takes only what a consumer on its node would take (their selectors): a message goes to a node
that wants it (red to the node selecting red or to one taking all, blue only to the latter), and the queue's
turn among its consumers spreads a backlog over every node with consumers. Order and message groups work as
for any consumer (a group's owner is one redistributor, so the group moves whole). A redistributor is paced
by the demand over there: it sends a window of messages per cluster tick, doubled while the other node's
consumers keep up, and none while they have full windows and messages wait (the binding's ``backlog``); so a
backlog stays here until consumers can take it, and a node whose consumer comes later gets its share instead
of finding everything already moved to the first one. A redistributor passes
over messages that arrived from another node less than the minimum residence time ago, so messages do not
bounce between nodes whose consumers come and go, and notes when the first of them may move (``retry_at``):
a queue offers its messages to its consumers only when something happens to it, so the cluster's tick offers
them again then, or they would wait for the next message or consumer.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from typing import Final

from tridentmq_core.balancer import SelectorCache, is_local_consumer
from tridentmq_core.queues import Consumer, LinkSession, Queue
from tridentmq_core.remote_bindings import Binding
from tridentmq_core.selector import compile_selector
from tridentmq_shared.message import M_ID, WireMessage

_EVERYTHING = compile_selector("TRUE")
PACE_START: Final = 20  # messages a redistributor sends in its first tick; doubles each tick they all went


class Arrivals:
    """When the messages that came from another node arrived, kept for the minimum residence time.

    Kept as runs of consecutive message ids that arrived in the same millisecond, oldest first: a node
    receiving a stream gives its messages consecutive ids, so a run stands for many messages and recording
    one is mostly a comparison, not a dict entry and a queue entry per message. Forgotten from the front by
    moving a start index (deleting from the front of a dict leaves holes that make every later look at its
    first entry slower, which once stalled the event loop for seconds under load)."""

    def __init__(self) -> None:
        self._firsts: list[int] = []  # each run's first message id, ascending
        self._lasts: list[int] = []
        self._times: list[int] = []
        self._moves: list[int] = []  # how often the run's messages were redistributed so far (0: forwarded)
        self._start = 0  # runs before it are forgotten
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, message_id: int, now_ms: int, moves: int = 0) -> None:
        self._count += 1
        times, lasts = self._times, self._lasts
        if (
            len(times) > self._start
            and times[-1] == now_ms
            and lasts[-1] == message_id - 1
            and self._moves[-1] == moves
        ):
            lasts[-1] = message_id
            return
        if self._firsts and message_id <= lasts[-1]:  # ids grow with arrival; anything else starts afresh
            self._clear()
            self._count = 1
        self._firsts.append(message_id)
        lasts.append(message_id)
        times.append(now_ms)
        self._moves.append(moves)

    def get(self, message_id: int) -> int | None:
        i = self._run(message_id)
        return self._times[i] if i >= 0 else None

    def moves(self, message_id: int) -> int:
        """How often the message was redistributed before it came here (0: not known as redistributed)."""
        i = self._run(message_id)
        return self._moves[i] if i >= 0 else 0

    def _run(self, message_id: int) -> int:
        i = bisect_right(self._firsts, message_id, self._start) - 1
        return i if i >= self._start and message_id <= self._lasts[i] else -1

    def forget_before(self, cutoff_ms: int) -> None:
        times, start = self._times, self._start
        while start < len(times) and times[start] <= cutoff_ms:
            self._count -= self._lasts[start] - self._firsts[start] + 1
            start += 1
        if start == len(times):
            self._clear()
        elif start > 1024 and start * 2 > len(times):  # mostly forgotten: drop them for good
            del self._firsts[:start], self._lasts[:start], self._times[:start], self._moves[:start]
            self._start = 0
        else:
            self._start = start

    def _clear(self) -> None:
        self._firsts.clear()
        self._lasts.clear()
        self._times.clear()
        self._moves.clear()
        self._start = 0
        self._count = 0


class Redistributor(Consumer):
    __slots__ = (
        "_arrivals",
        "_clock",
        "_min_residence_ms",
        "_selectors",
        "held_back",
        "max_window",
        "moved",
        "paced",
        "retry_at",
        "stopped",
        "target",
        "window",
    )

    def __init__(
        self,
        consumer_id: int,
        session: LinkSession,
        queue: Queue,
        credit: int,
        *,
        target: Binding,
        selectors: SelectorCache,
        arrivals: Arrivals,
        min_residence_ms: int,
        clock: Callable[[], int],
        paced: bool = True,
    ) -> None:
        # A selector that takes everything: its presence makes the queue offer each message to ``accepts``.
        window = min(credit, PACE_START) if paced else credit
        super().__init__(consumer_id, session, queue, window, selector=_EVERYTHING)
        self.forwarder = True
        self.paced = paced  # False: as fast as the window allows (a scale-down moves everything)
        self.window = window
        self.max_window = credit
        self.held_back = False  # the target's consumers are full: nothing moves until they take more
        self.stopped = False
        self.target = target
        self._selectors = selectors
        self._arrivals = arrivals
        self._min_residence_ms = min_residence_ms
        self._clock = clock
        self.retry_at = 0  # when a message passed over for its residence may move (0: none passed over)
        self.moved = 0  # messages handed to it so far (status tells a queue that moves from one that is stuck)

    def stop(self) -> None:
        """Take no more messages (credit alone would come back with the confirms of those in flight)."""
        self.stopped = True
        self.credit = 0

    def confirmed(self, count: int) -> None:
        """The other node took ``count`` of its messages. An unpaced one may send as many more; a paced one
        waits for the next look at the other node (``pace``)."""
        if not self.paced:
            self.credit += count

    def pace(self) -> bool:
        """At each cluster tick: no credit while the target has a backlog (its window halves), else a window
        less what is in flight, doubled when the last one was used up. True when it may take messages again
        after it could take none: the queue must offer them."""
        if not self.paced or self.stopped:
            return False
        if self.target.backlog:
            self.window = max(PACE_START, self.window // 2)
            self.credit = 0
            self.held_back = True
            return False
        self.held_back = False
        before = self.credit
        if before <= 0:
            self.window = min(self.window * 2, self.max_window)
        self.credit = max(0, self.window - len(self.in_flight))
        return before <= 0 < self.credit

    def accepts(self, message: WireMessage) -> bool:
        if self.stopped:
            return False
        arrived = self._arrivals.get(message[M_ID])
        if arrived is not None:
            movable_at = arrived + residence_ms(self._min_residence_ms, self._arrivals.moves(message[M_ID]))
            if self._clock() < movable_at:
                if not self.retry_at or movable_at < self.retry_at:
                    self.retry_at = movable_at
                return False
        target = self.target
        return target.selectors is None or any(self._selectors.matches(s, message) for s in target.selectors)


MAX_RESIDENCE_FACTOR: Final = 4


def residence_ms(min_residence_ms: int, moves: int) -> int:
    """How long a message that came from another node stays before it may move again: the minimum residence,
    doubled for each time it was already redistributed, up to four times it. A consumer that keeps moving
    between nodes would otherwise drag its backlog along at every move."""
    return min_residence_ms << min(max(moves - 1, 0), 2)


def due_again(redistributor: Redistributor, now_ms: int) -> bool:
    """Whether messages ``redistributor`` passed over for their residence may move now: the queue must offer
    them again (once; those still too young set the next time)."""
    if redistributor.stopped or not redistributor.retry_at or now_ms < redistributor.retry_at:
        return False
    redistributor.retry_at = 0
    return True


def saturated(queue: Queue) -> bool:
    """Messages wait and every consumer of this node's clients has a full window (a backlog here)."""
    if not len(queue):
        return False
    local = [c for c in queue.consumers if is_local_consumer(c)]
    return bool(local) and all(c.credit <= 0 for c in local)


def stranded(queue: Queue) -> bool:
    """Messages and no consumer of this node's clients to take them."""
    return len(queue) > 0 and not any(is_local_consumer(c) for c in queue.consumers)


def targets(queue: Queue, candidates: Iterable[Binding]) -> list[Binding]:
    """The reachable remote queues of the same name and address that have consumers, most consumers first
    (nearest first on a tie): one redistributor each, so the backlog goes to every node that can take it."""
    usable = [
        b
        for b in candidates
        if b.address == queue.address and b.routing == int(queue.routing_type) and b.consumers > 0 and b.reachable
    ]
    usable.sort(key=lambda b: (-b.consumers, b.distance, b.node_id))
    return usable


def best_target(queue: Queue, candidates: Iterable[Binding]) -> Binding | None:
    """The remote queue of the same name and address with the most consumers (nearest first on a tie)."""
    found = targets(queue, candidates)
    return found[0] if found else None
