"""``LightEvent``: ``asyncio.Event`` for what a gateway holds per client connection.

An ``asyncio.Event`` makes a deque of waiters when it is made (about 700 bytes), and a connection had five of
them, mostly with nobody waiting. This one keeps its waiters in a list made by the first ``wait`` that blocks.
"""

from __future__ import annotations

import asyncio


class LightEvent:
    """Set, clear and wait as ``asyncio.Event``: ``wait`` returns at once while set, else when ``set`` is called
    (a waiter woken by a ``set`` returns even if the event is cleared again before it runs)."""

    __slots__ = ("_is_set", "_loop", "_waiters")

    def __init__(self, *, is_set: bool = False) -> None:
        self._is_set = is_set
        self._waiters: list[asyncio.Future[None]] | None = None
        # Kept once known: asyncio.get_running_loop() makes a getpid() system call each time.
        self._loop: asyncio.AbstractEventLoop | None = None

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        if self._is_set:
            return
        self._is_set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._is_set = False

    async def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after ``timeout`` seconds (None: no limit). The timeout is a timer on the
        waiter, not ``asyncio.wait_for``, which runs the wait in a task of its own (one per link a gateway's
        client closes)."""
        if self._is_set:
            return True
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        if self._waiters is None:
            self._waiters = [waiter]
        else:
            self._waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _time_out, waiter)
        try:
            await waiter
        except TimeoutError:
            return False
        finally:
            if timer is not None:
                timer.cancel()
            waiters = self._waiters
            if waiters is not None and waiter in waiters:  # cancelled or timed out: nobody set it
                waiters.remove(waiter)
        return True


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
