"""Spreading a burst of callbacks over turns of the event loop: what thousands of clients leaving at once set off
would otherwise run in one turn, while the loop answers nothing else."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tridentmq.gateway")


class TurnPacer:
    """Runs at most ``per_turn`` callbacks in one turn of the event loop, the rest in the turns after, in the
    order they came. The work between two turns stays bounded whatever the burst, so that the loop still
    answers heartbeats, probes and other clients while it lasts; the burst's work as a whole does not grow.

    A callback that raises is logged and the others still run: it stands for a protocol callback (a client's
    end), whose failure the event loop would have logged the same way."""

    __slots__ = ("_next_turn", "_queued", "_ran", "per_turn")

    def __init__(self, per_turn: int) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be at least 1")
        self.per_turn = per_turn
        self._ran = 0  # callbacks run since this turn began
        self._queued: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._next_turn: asyncio.Handle | None = None  # starts the count afresh, and runs what is queued

    @property
    def queued(self) -> int:
        return len(self._queued)

    def call(self, callback: Callable[..., object], *args: Any) -> None:
        """Run ``callback(*args)`` now if this turn has room and nothing waits before it, else in a later turn."""
        if self._next_turn is None:
            self._next_turn = asyncio.get_running_loop().call_soon(self._turn)
        if self._ran < self.per_turn and not self._queued:
            self._ran += 1
            _run(callback, args)
        else:
            self._queued.append((callback, args))

    def _turn(self) -> None:
        self._next_turn = None
        self._ran = 0
        queued = self._queued
        while queued and self._ran < self.per_turn:
            callback, args = queued.popleft()
            self._ran += 1
            _run(callback, args)
        if self._ran:  # the next turn counts afresh (and runs what is still queued)
            self._next_turn = asyncio.get_running_loop().call_soon(self._turn)


def _run(callback: Callable[..., object], args: tuple[Any, ...]) -> None:
    try:
        callback(*args)
    except Exception:
        log.exception("paced callback failed", extra={"callback": getattr(callback, "__qualname__", repr(callback))})
