"""Keys with a due time (idle queues, delayed wills): set, move and cancel in O(log n), and find the due
ones without looking at the others. Pure: the time is passed in."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: Stale heap entries tolerated beyond twice the live ones before the heap is rebuilt.
_SLACK = 1024


class Deadlines(Generic[K]):
    """A heap with lazy deletion: moving or cancelling a key leaves its old entry behind, skipped when it
    comes up, and the heap is rebuilt once stale entries outnumber live ones."""

    __slots__ = ("_due", "_heap", "_seq")

    def __init__(self) -> None:
        self._due: dict[K, int] = {}
        self._heap: list[tuple[int, int, K]] = []  # (due, tie-breaker, key): keys are never compared
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: K) -> bool:
        return key in self._due

    def get(self, key: K) -> int | None:
        return self._due.get(key)

    def set(self, key: K, due_ms: int) -> None:
        """Make ``key`` due at ``due_ms``, replacing its earlier due time."""
        self._due[key] = due_ms
        heapq.heappush(self._heap, (due_ms, next(self._seq), key))
        if len(self._heap) > 2 * len(self._due) + _SLACK:
            self._heap = [(due, next(self._seq), k) for k, due in self._due.items()]
            heapq.heapify(self._heap)

    def cancel(self, key: K) -> bool:
        return self._due.pop(key, None) is not None

    def pop_due(self, now_ms: int) -> list[K]:
        """Remove and return the keys due at or before ``now_ms``, earliest first."""
        heap, due = self._heap, self._due
        popped: list[K] = []
        while heap and heap[0][0] <= now_ms:
            at, _, key = heapq.heappop(heap)
            if due.get(key) == at:
                del due[key]
                popped.append(key)
        return popped
