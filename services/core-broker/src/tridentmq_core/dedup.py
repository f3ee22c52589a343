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
