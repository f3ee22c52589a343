"""Duplicate detection: producer-stamped ids remembered for a time window, bounded in count."""

from __future__ import annotations

from collections import deque


class DuplicateIdCache:
    """``seen(id, now)`` answers whether ``id`` arrived within the window, and remembers it if not.

    The oldest ids are forgotten through a queue of arrivals, not from the front of the dict: every entry
    deleted there leaves a hole that the next look at the dict's first entry steps over, so a full cache
    (one forgotten per arrival) or a large expiry slowed down without bound (60 µs per message at 300,000
    arrivals into a cache of 100,000, and worse the fuller it was)."""

    def __init__(self, window_ms: int, max_entries: int) -> None:
        self._window_ms = window_ms
        self._max_entries = max_entries
        self._expiry: dict[str, int] = {}  # id → deadline; insertion order is arrival order
        # (deadline, id) in arrival order; an entry whose id was forgotten or seen again since is stale.
        self._order: deque[tuple[int, str]] = deque()

    def __len__(self) -> int:
        return len(self._expiry)

    def seen(self, dedup_id: str, now_ms: int) -> bool:
        expiry = self._expiry
        deadline = expiry.get(dedup_id)
        if deadline is not None:
            if deadline > now_ms:
                return True
            del expiry[dedup_id]  # re-inserted below, so it counts as the newest
        deadline = now_ms + self._window_ms
        expiry[dedup_id] = deadline
        self._order.append((deadline, dedup_id))
        if len(expiry) > self._max_entries:
            self._forget_oldest()
        return False

    def forget(self, dedup_id: str) -> None:
        """Undo ``seen`` for a message that was then refused, so a retry is not mistaken for a duplicate."""
        self._expiry.pop(dedup_id, None)

    def expire(self, now_ms: int) -> None:
        order, expiry = self._order, self._expiry
        while order and order[0][0] <= now_ms:
            deadline, dedup_id = order.popleft()
            if expiry.get(dedup_id) == deadline:
                del expiry[dedup_id]
        if len(order) > 2 * len(expiry) + 1024:  # mostly stale (ids forgotten or seen again): rebuild
            self._order = deque((deadline, dedup_id) for dedup_id, deadline in expiry.items())

    def _forget_oldest(self) -> None:
        order, expiry = self._order, self._expiry
        while order:
            deadline, dedup_id = order.popleft()
            if expiry.get(dedup_id) == deadline:
                del expiry[dedup_id]
                return

    def entries(self) -> list[tuple[str, int]]:
        """Every remembered id with its arrival time, oldest first (what a restart must remember)."""
        window = self._window_ms
        return [(dedup_id, deadline - window) for dedup_id, deadline in self._expiry.items()]


class TransferIds:
    """``seen(node, number, now)`` answers whether the transfer ``number`` from ``node`` arrived lately, and
    remembers it if not: ``DuplicateIdCache`` for the numbered transfers of non-durable messages between
    nodes, which need not survive a restart (the messages do not).

    The numbers are kept per node in two generations of sets, the older dropped whole: no id string to build
    and no queue entry per transfer, and a node's numbers grow, so they sit side by side in their sets (a
    look-up in a full ``DuplicateIdCache`` took a microsecond, mostly cache misses). A number is remembered
    for at least ``window_ms``, and the newest ``max_entries // 2`` at least, of at most ``max_entries``."""

    def __init__(self, window_ms: int, max_entries: int) -> None:
        self._window_ms = window_ms
        self._generation_size = max(1, max_entries // 2)
        self._current: dict[str, set[int]] = {}
        self._previous: dict[str, set[int]] = {}
        self._size = 0  # numbers in the current generation
        self._started_ms = 0  # when the current generation began

    def __len__(self) -> int:
        return self._size + sum(len(numbers) for numbers in self._previous.values())

    def seen(self, node: str, number: int, now_ms: int) -> bool:
        current = self._current.get(node)
        if current is None:
            current = self._current[node] = set()
        elif number in current:
            return True
        previous = self._previous.get(node)
        if previous is not None and number in previous:
            return True
        current.add(number)
        self._size += 1
        if self._size >= self._generation_size:
            self._next_generation(now_ms)
        return False

    def forget(self, node: str, number: int) -> None:
        """Undo ``seen`` for a transfer that was then refused, so that sending it again is no duplicate."""
        for generation in (self._current, self._previous):
            numbers = generation.get(node)
            if numbers is not None and number in numbers:
                numbers.discard(number)
                if generation is self._current:
                    self._size -= 1

    def expire(self, now_ms: int) -> None:
        if now_ms - self._started_ms >= self._window_ms:
            self._next_generation(now_ms)

    def _next_generation(self, now_ms: int) -> None:
        self._previous, self._current = self._current, {}
        self._size = 0
        self._started_ms = now_ms
