"""One log line per window per key: a flood (refused connections, wrong passwords) is counted, not echoed.

The first event of a key is logged at once; the rest of its window only counts, and ``ended`` reports
the counts of the windows that are over (called from the node's timer), so nothing goes unsaid.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Window:
    started: float
    suppressed: int = 0


class LogWindow:
    def __init__(self, seconds: float, *, max_keys: int = 10_000) -> None:
        self.seconds = seconds
        self.max_keys = max_keys  # many sources at once: forget the oldest windows rather than grow
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # forgetting the oldest of a dict is slow

    def first(self, key: str, now: float) -> bool:
        """Count an event of ``key``; True when it opens a window (log it), False when only counted."""
        window = self._windows.get(key)
        if window is not None and now - window.started < self.seconds:
            window.suppressed += 1
            return False
        if window is None and len(self._windows) >= self.max_keys:
            self._windows.popitem(last=False)
        self._windows[key] = _Window(now)
        return True

    def ended(self, now: float) -> list[tuple[str, int]]:
        """The keys whose window is over with events counted but not logged, and how many."""
        over = [key for key, window in self._windows.items() if now - window.started >= self.seconds]
        reported = []
        for key in over:
            window = self._windows.pop(key)
            if window.suppressed:
                reported.append((key, window.suppressed))
        return reported
