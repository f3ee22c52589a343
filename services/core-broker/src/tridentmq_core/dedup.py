"""Duplicate detection: producer-stamped ids remembered for a time window, bounded in count."""

from __future__ import annotations


class DuplicateIdCache:
    """``seen(id, now)`` answers whether ``id`` arrived within the window, and remembers it if not."""

    def __init__(self, window_ms: int, max_entries: int) -> None:
        self._window_ms = window_ms
        self._max_entries = max_entries
        self._expiry: dict[str, int] = {}  # insertion order is arrival order, so expiry order too

    def __len__(self) -> int:
        return len(self._expiry)

    def seen(self, dedup_id: str, now_ms: int) -> bool:
        expiry = self._expiry
        deadline = expiry.get(dedup_id)
        if deadline is not None and deadline > now_ms:
            return True
        if deadline is not None:
            del expiry[dedup_id]
        expiry[dedup_id] = now_ms + self._window_ms
        if len(expiry) > self._max_entries:
            del expiry[next(iter(expiry))]
        return False

    def forget(self, dedup_id: str) -> None:
        """Undo ``seen`` for a message that was then refused, so a retry is not mistaken for a duplicate."""
        self._expiry.pop(dedup_id, None)

    def expire(self, now_ms: int) -> None:
        expiry = self._expiry
        while expiry:
            oldest = next(iter(expiry))
            if expiry[oldest] > now_ms:
                return
            del expiry[oldest]

    def entries(self) -> list[tuple[str, int]]:
        """Every remembered id with its arrival time, oldest first (what a restart must remember)."""
        window = self._window_ms
        return [(dedup_id, deadline - window) for dedup_id, deadline in self._expiry.items()]
