"""Background tasks that cannot die unnoticed.

A process starts its long-running tasks (timers, pumps, watchers) through the supervisor. An exception such
a task does not handle is a bug: it is logged with its traceback, then either the task starts again
(``restart=True``, at most ``max_restarts`` times within ``restart_window`` seconds, with a short back-off)
or the process fails: its readiness turns red and its entry point stops it and exits with
``EXIT_TASK_FAILED`` (crash-only). A process never runs on with one of its tasks dead.

One supervisor serves a process; ``install`` makes it the one ``current()`` returns, so library code
(the link client, the core-link registry) supervises its own tasks without being handed it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Final, NoReturn

log = logging.getLogger("tridentmq.supervision")

#: Exit status of a process stopped because one of its tasks failed (EX_SOFTWARE).
EXIT_TASK_FAILED: Final = 70
#: Exit status of a process that cannot start for a reason a restart would meet again (EX_CONFIG): invalid
#: settings, a port in use, a data directory another process holds or that is damaged.
EXIT_CANNOT_START: Final = 78
_BACKOFF_START: Final = 0.1
_BACKOFF_MAX: Final = 5.0


def cannot_start(prog: str, error: Exception) -> NoReturn:
    """Say why ``prog`` cannot start, on standard error, and exit with ``EXIT_CANNOT_START``."""
    sys.stderr.write(f"{prog}: {error}\n")
    raise SystemExit(EXIT_CANNOT_START)


class Supervisor:
    """Runs and watches the background tasks of one process."""

    def __init__(
        self, *, max_restarts: int = 5, restart_window: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self._clock = clock
        self.failure: str | None = None  # what failed, once something did
        self._failed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # strong references: the loop keeps only weak ones
        self.on_failure: list[Callable[[str], None]] = []  # told the reason at once (readiness turns red)

    @property
    def healthy(self) -> bool:
        return self.failure is None

    def spawn(
        self, name: str, factory: Callable[[], Coroutine[Any, Any, Any]], *, restart: bool = False
    ) -> asyncio.Task[None]:
        """Run ``factory()`` as a task; when it raises, start it again (``restart``) or fail the process.
        A task that returns or is cancelled simply ends."""
        task = asyncio.get_running_loop().create_task(self._run(name, factory, restart), name=name)
        self._keep(task)
        return task

    def watch(self, task: asyncio.Task[Any], name: str | None = None) -> asyncio.Task[Any]:
        """Fail the process when ``task`` (created elsewhere) ends with an exception."""
        label = name or task.get_name()
        self._keep(task)
        task.add_done_callback(lambda t: self._ended(label, t))
        return task

    def guard(self, name: str, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` as a loop callback (``call_soon``, a thread's report): what it raises fails the process
        instead of being printed by the loop and forgotten."""

        def guarded(*args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                log.exception("callback failed", extra={"task": name})
                self.fail(name, exc)

        return guarded

    def fail(self, name: str, exc: BaseException) -> None:
        """Mark the process failed (the first failure is the one reported) and wake ``wait_failed``."""
        if self.failure is not None:
            return
        self.failure = f"{name}: {type(exc).__name__}: {exc}"[:512]
        log.critical(
            "a background task failed: the process is no longer ready and stops",
            extra={"task": name, "reason": self.failure},
        )
        for report in self.on_failure:
            report(self.failure)
        if self._failed is not None:
            self._failed.set()

    async def wait_failed(self) -> str:
        """Return (the reason) once a task has failed the process."""
        if self._failed is None:
            self._failed = asyncio.Event()
            if self.failure is not None:
                self._failed.set()
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    # ------------------------------------------------------------------ internals
    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ended(self, name: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task failed", exc_info=(type(exc), exc, exc.__traceback__), extra={"task": name})
            self.fail(name, exc)

    async def _run(self, name: str, factory: Callable[[], Coroutine[Any, Any, Any]], restart: bool) -> None:
        restarts: deque[float] = deque()
        while True:
            try:
                await factory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("background task failed", extra={"task": name})
                now = self._clock()
                while restarts and now - restarts[0] > self.restart_window:
                    restarts.popleft()
                if not restart or len(restarts) >= self.max_restarts:
                    self.fail(name, exc)
                    return
                restarts.append(now)
                log.warning("background task restarted", extra={"task": name, "restarts": len(restarts)})
                await asyncio.sleep(min(_BACKOFF_START * 2 ** (len(restarts) - 1), _BACKOFF_MAX))
            else:
                return


_current = Supervisor()


def install(supervisor: Supervisor) -> Supervisor:
    """Make ``supervisor`` the process's (``current()``); returns the one it replaces."""
    global _current
    previous, _current = _current, supervisor
    return previous


def current() -> Supervisor:
    return _current


def spawn(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """``create_task`` under the process's supervisor: the task's unhandled exception fails the process."""
    return _current.watch(asyncio.get_running_loop().create_task(coro, name=name), name)


def end_on_failure(task: asyncio.Task[Any], end: Callable[[], None], peer: str) -> asyncio.Task[Any]:
    """A connection's own task (its worker, timers, a subscription's pump): one that fails is logged with its
    traceback and ends its connection with ``end``, so the client reconnects instead of keeping a session
    whose task is dead. The process goes on: one connection's bug is not the others'."""

    def ended(done: asyncio.Task[Any]) -> None:
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            log.error(
                "connection task failed: the connection is closed",
                exc_info=exc,
                extra={"task": done.get_name(), "peer": peer},
            )
            end()

    task.add_done_callback(ended)
    return task
