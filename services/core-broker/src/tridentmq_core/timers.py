"""Messages that wait for a time before they go into their queue: scheduled deliveries (at the tail, as
published), and delayed redeliveries (back to the head, as any redelivery)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from tridentmq_core.queues import Queue
from tridentmq_shared.message import WireMessage

#: (due, sequence, queue, message, delivery count, redelivery): the sequence keeps equal due times in their
#: order. A delivery count goes with a scheduled message too: one moved or recovered may have had attempts.
Timer = tuple[int, int, Queue | None, WireMessage, int, bool]


class Timers:
    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = itertools.count()

    def schedule(self, due_ms: int, queue: Queue | None, message: WireMessage, delivered: int = 0) -> None:
        """A scheduled message, with the delivery attempts it had already (``delivered``)."""
        heapq.heappush(self._heap, (due_ms, next(self._seq), queue, message, delivered, False))

    def delay(self, due_ms: int, queue: Queue, message: WireMessage, count: int) -> None:
        """A redelivery of a message delivered ``count`` times, out of its queue until then (its bytes are still
        the queue's)."""
        heapq.heappush(self._heap, (due_ms, next(self._seq), queue, message, count, True))

    def pop_due(self, now_ms: int) -> Iterator[tuple[Queue | None, WireMessage, int, bool]]:
        """(queue, message, delivery count, whether a redelivery) of each timer due by ``now_ms``."""
        heap = self._heap
        while heap and heap[0][0] <= now_ms:
            _, _, queue, message, count, redelivery = heapq.heappop(heap)
            yield queue, message, count, redelivery

    def take(self, queue: Queue, predicate: Callable[[WireMessage], bool]) -> list[tuple[WireMessage, bool]]:
        """Drop the messages of ``queue`` that ``predicate`` picks (a purge): (message, whether a redelivery)."""
        taken: list[tuple[WireMessage, bool]] = []
        kept: list[Timer] = []
        for timer in self._heap:
            if timer[2] is queue and predicate(timer[3]):
                taken.append((timer[3], timer[5]))
            else:
                kept.append(timer)
        if taken:
            heapq.heapify(kept)
            self._heap = kept
        return taken

    def holds(self, queue: Queue) -> bool:
        """A message of ``queue`` waits here (the queue is not empty, in a way)."""
        return any(timer[2] is queue for timer in self._heap)

    def __iter__(self) -> Iterator[tuple[Queue | None, WireMessage, int]]:
        return ((queue, message, count) for _, _, queue, message, count, _ in self._heap)
