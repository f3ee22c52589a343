"""Counting the turns of the running event loop, for tests of work spread over turns."""

from __future__ import annotations

import asyncio


class LoopTurns:
    """``now`` is the number of turns since the start: a callback that schedules itself again each turn, until
    ``stop``."""

    def __init__(self) -> None:
        self.now = 0
        self._handle = asyncio.get_running_loop().call_soon(self._next)

    def _next(self) -> None:
        self.now += 1
        self._handle = asyncio.get_running_loop().call_soon(self._next)

    def stop(self) -> None:
        self._handle.cancel()
