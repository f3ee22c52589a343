"""Spreading a burst of callbacks over turns of the event loop: what thousands of clients (or a gateway's
thousands of sessions) ending at once set off would otherwise run in one turn, while the loop answers nothing
else."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any


class TurnPacer:
    """``call_soon`` as the event loop's, but at most ``per_turn`` of its callbacks run in one turn, the rest in
    the turns after, in the order they came. The work between two turns stays bounded whatever the burst, so that
    the loop still answers heartbeats, probes and other clients while it lasts; the burst's work as a whole does
    not grow.

    A callback that raises is logged on ``log`` and the others still run, as the loop itself would do."""

    __slots__ = ("_log", "_next_turn", "_queued", "per_turn")

    def __init__(self, per_turn: int, log: logging.Logger) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be at least 1")
        self.per_turn = per_turn
        self._log = log
        self._queued: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._next_turn: asyncio.Handle | None = None

    @property
    def queued(self) -> int:
        return len(self._queued)

    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        """Run ``callback(*args)`` in a later turn: the next one, unless ``per_turn`` came before it."""
        self._queued.append((callback, args))
        if self._next_turn is None:
            self._next_turn = asyncio.get_running_loop().call_soon(self._turn)

    def run_all(self) -> None:
        """Run what is queued, whatever its number, and what those queue in turn: the process is stopping, and
        what it closes next (its journal, say) is what these callbacks may still need."""
        while self._queued:
            self._run_next()

    def _turn(self) -> None:
        self._next_turn = None
        for _ in range(min(self.per_turn, len(self._queued))):
            self._run_next()
        if self._queued:
            self._next_turn = asyncio.get_running_loop().call_soon(self._turn)

    def _run_next(self) -> None:
        callback, args = self._queued.popleft()
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - logged with its traceback on the owner's log, as the loop would
            self._log.exception(
                "paced callback failed", extra={"callback": getattr(callback, "__qualname__", repr(callback))}
            )
