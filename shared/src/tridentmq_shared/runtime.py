"""Running an asyncio entry point the same way in every TridentMQ process (uvloop when installed)."""

from __future__ import annotations

import asyncio
import gc
import random
import resource
import time
import weakref
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

T = TypeVar("T")


#: Young-generation threshold of the cyclic GC. Messages are acyclic lists that arrive by the hundred
#: thousand; at CPython's default (700) the collector rescans them thousands of times a second.
GC_THRESHOLD = 100_000
#: Connections a listener keeps waiting to be accepted. At asyncio's default of 100 a burst of connects (a
#: reconnect storm, a fleet of devices starting) overflows the queue: the kernel drops the rest, and each
#: dropped client tries again only 1, 3, 7 ... seconds later. The kernel caps it at ``net.core.somaxconn``.
LISTEN_BACKLOG: Final = 4096


def wall_ms() -> int:
    """The wall clock in milliseconds: what a node stamps on messages and audit events (the pure code is
    given it; shells read it here)."""
    return time.time_ns() // 1_000_000


def random_hex(digits: int) -> str:
    """``digits`` random hex digits for an identifier that must not repeat across processes and restarts (a
    connection, a session, a producer), not for a secret: ``uuid4`` asks the kernel each time, a thirtieth of
    the CPU of a connect. (The generator is seeded from the OS and re-seeded in a forked child.)"""
    return f"{random.getrandbits(digits * 4):0{digits}x}"


def tune_gc() -> None:
    """Collect rarely: our hot objects hold no reference cycles, so frequent collections are pure cost."""
    gc.set_threshold(GC_THRESHOLD, 50, 100)
    gc.freeze()  # what exists at start-up (modules, settings) lives for ever: never scan it again


class EndedSessions:
    """The backstop for what ended client sessions leave to the cyclic collector, which ``tune_gc`` runs rarely.
    A session's parts drop their references to one another as it ends, and refcounting frees them; but an
    unusual end (an error's traceback, say) may still leave a cycle, and a gateway whose clients came and went
    once grew by 10-23 KB for every connection it ever had.

    Each time as many sessions ended as are open (at least ``minimum``), the first few of them are looked at
    ``check_delay_s`` later, once their clean-up is done: if one still exists, sessions leave garbage, and one
    full collection runs. A needless one is not harmless: it holds the event loop for as long as it takes to look
    at every object, about 0.9 s at 19,000 connections here, and five in a row, as 19,000 clients left at once,
    stopped the gateway's heartbeat to its core for 4 s."""

    #: Ended sessions looked at per check.
    SAMPLE: Final = 16

    def __init__(self, minimum: int = 1000, check_delay_s: float = 10.0) -> None:
        self.minimum = minimum
        self.check_delay_s = check_delay_s
        self._ended = 0
        self._sample: list[weakref.ref[object]] = []
        self._check: asyncio.TimerHandle | None = None
        self.collections = 0

    def ended(self, session: object, still_open: int) -> None:
        self._ended += 1
        if len(self._sample) < self.SAMPLE:
            self._sample.append(weakref.ref(session))
        if self._ended >= max(self.minimum, still_open) and self._check is None:
            self._ended = 0
            sample, self._sample = self._sample, []
            self._check = asyncio.get_running_loop().call_later(self.check_delay_s, self._collect_if_left, sample)

    def _collect_if_left(self, sample: list[weakref.ref[object]]) -> None:
        self._check = None
        if any(ref() is not None for ref in sample):
            self.collections += 1
            gc.collect()


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit, as far as the OS lets it: a gateway
    holds a descriptor per client connection (plus a few for its links to the core), and the usual soft limit
    of 1,024 would refuse clients long before memory runs out. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an infinite hard limit the kernel caps lower (nr_open): keep the soft one
        return soft
    return hard


def run_main(main: Coroutine[Any, Any, T]) -> T:
    tune_gc()
    raise_open_file_limit()
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended. Cancelled again until it does: on Python 3.11
    ``asyncio.wait_for`` swallows a cancellation that arrives as the awaited thing completes, and a task
    that retries in a loop then goes on (a stopping backup hung in its search for a primary that way)."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    error = task.exception() if task is not None and not task.cancelled() else None
    if error is not None:
        raise error
