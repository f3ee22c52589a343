"""Messages that wait for a time before they go into their queue: scheduled deliveries, and delayed
redeliveries (those with a delivery count above 0)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from tridentmq_core.queues import Queue
from tridentmq_shared.message import WireMessage

#: (due, sequence, queue, message, delivery count): the sequence keeps equal due times in their order.
Timer = tuple[int, int, Queue | None, WireMessage, int]


class Timers:
    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = itertools.count()

    def schedule(self, due_ms: int, queue: Queue | None, message: WireMessage, count: int) -> None:
        heapq.heappush(self._heap, (due_ms, next(self._seq), queue, message, count))

    def pop_due(self, now_ms: int) -> Iterator[tuple[Queue | None, WireMessage, int]]:
        heap = self._heap
        while heap and heap[0][0] <= now_ms:
            _, _, queue, message, count = heapq.heappop(heap)
            yield queue, message, count

    def holds(self, queue: Queue) -> bool:
        """A message of ``queue`` waits here (the queue is not empty, in a way)."""
        return any(timer[2] is queue for timer in self._heap)

    def __iter__(self) -> Iterator[tuple[Queue | None, WireMessage, int]]:
        return ((queue, message, count) for _, _, queue, message, count in self._heap)
