"""One log line per window per key: a flood (refused connections, wrong passwords) is counted, not echoed.

The first event of a key is logged at once; the rest of its window only counts, and ``ended`` reports
the counts of the windows that are over (called from the node's timer), so nothing goes unsaid.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
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


class FloodLog:
    """One log line per window for a flood of alike events in an event loop (a gateway's link fails over with
    thousands of sessions, each with the same thing to say): the first is logged by the caller, the rest are
    counted and reported in one line once the window is over. A window per loop: a process runs one, tests
    many."""

    def __init__(self, seconds: float, logger: logging.Logger, level: int, summary: str) -> None:
        self.seconds = seconds
        self._window = LogWindow(seconds)
        self._logger = logger
        self._level = level
        self._summary = summary  # the line that reports the counted ones (their count: ``count``)
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, str] = weakref.WeakKeyDictionary()
        self._numbers = itertools.count()

    def first(self) -> bool:
        """Count an event; True when the caller is to log it (it opens a window)."""
        loop = asyncio.get_running_loop()
        key = self._loops.get(loop)
        if key is None:  # (not the loop's id: a later loop may get the id of one gone, inside its window)
            key = self._loops[loop] = f"loop {next(self._numbers)}"
        if not self._window.first(key, loop.time()):
            return False
        loop.call_later(self.seconds, self._report, loop)
        return True

    def _report(self, loop: asyncio.AbstractEventLoop) -> None:
        for _, count in self._window.ended(loop.time()):
            self._logger.log(self._level, self._summary, extra={"count": count})
