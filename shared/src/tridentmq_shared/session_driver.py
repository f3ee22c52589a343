"""What every gateway's client session does the same way, whatever its protocol: handle the client's events in
order with a worker that runs only while there are events (an idle connection holds no task), stop reading the
client while too much waits, keep one timer for the protocol's next deadline, and end once: the protocol's
clean-up runs in a task of its own, or at the end of the worker that noticed the end.

The protocol session decodes the client's bytes, gives the driver the events and answers them through the hooks
below; its protocol's rules stay its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final, Protocol

from tridentmq_shared.gateway import Wire
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.log_window import FloodLog
from tridentmq_shared.supervision import end_on_failure

log = logging.getLogger("tridentmq.gateway")


#: How long an ended session's clean-up may take (a core request during a failover can take the link's
#: whole reconnect time, about 11 s) before ``abort`` closes what it holds anyway.
CLEAN_UP_LIMIT_S: Final = 30.0
#: Overdue clean-ups are logged once a minute, the rest counted: a gateway whose core link fails may have
#: thousands of sessions end at once (100,000 clients leaving six gateways logged 84,000 lines).
overdue_log = FloodLog(
    60.0, log, logging.ERROR, "more session clean-ups overdue: their links and connections were closed"
)
#: Clients refused because the core did not answer their login are logged once a minute, the rest counted:
#: with the core down, every device retrying said so (a storm of 120 clients: 720 lines in 30 s).
core_unavailable_log = FloodLog(60.0, log, logging.WARNING, "more clients refused: the core did not answer")

#: Errors of handling one event that are bugs of ours, not the client's: every protocol session counts them
#: among its ``handled_errors`` and ends that connection only, logged with the traceback.
HANDLING_BUGS: Final[tuple[type[Exception], ...]] = (AssertionError, LookupError, TypeError, ValueError)


class SessionHooks(Protocol):
    """What the driver asks of the protocol session."""

    #: Errors of handling one event that end neither the worker nor the connection by themselves: the
    #: session answers them with ``handle_error`` (any other is a bug: the connection ends, logged).
    handled_errors: tuple[type[Exception], ...]

    def handle_now(self, event: Any) -> bool:
        """Handle ``event`` if that needs no waiting (the common, fast case); False to have it ``handle``d."""

    async def handle(self, event: Any) -> None:
        """Handle an event that may wait (for the core, say)."""

    def handle_error(self, event: Any, error: Exception) -> None: ...

    def before_handle(self) -> None:
        """An event is about to wait: what the events before it produced goes out first."""

    def after_batch(self) -> None:
        """The events read so far are handled: write what they produced."""

    def reading_paused(self) -> None: ...
    def reading_resumed(self) -> None: ...

    async def clean_up(self) -> None:
        """The session has ended: release what it holds (links, queues) and close the client's transport."""

    async def abort(self) -> None:
        """The clean-up has not finished in ``CLEAN_UP_LIMIT_S``: close the session's core link and the client's
        transport now, without waiting for anything (an open link would keep consuming for a session that
        ended: its consumers come back with every failover)."""


class SessionDriver:
    # Slots: one per client connection.
    __slots__ = (
        "_cleaning",
        "_events",
        "_final",
        "_final_waiter",
        "_hooks",
        "_loop",
        "_max_bytes",
        "_max_events",
        "_max_unread",
        "_overdue",
        "_paused",
        "_read_ahead",
        "_timer",
        "_wire",
        "_worker",
        "cleaned",
        "closed",
        "name",
    )

    def __init__(
        self,
        hooks: SessionHooks,
        wire: Wire,
        name: str,
        *,
        max_events: int | None,
        max_bytes: int,
        max_unread: int | None = None,
    ) -> None:
        self._hooks: SessionHooks | None = hooks  # None once cleaned up (see ``_shut_down``)
        self._wire = wire
        self.name = name  # of its tasks: "mqtt", "stomp"
        self._max_events = max_events  # reading pauses while this many events wait (None: no bound)...
        self._max_bytes = max_bytes  # ...or this many bytes were read since the worker last caught up
        # Events are handled while the client does not read what it was written, as long as less than this many
        # bytes wait for it (None: only while its transport is below its high-water mark). A client that sends
        # a burst before it reads (one thread, blocking writes) while its subscriptions fill its socket would
        # otherwise wait for the gateway to read, and the gateway for it to read: a deadlock. What the session
        # writes unasked (deliveries) must then wait for ``wire.writable()`` itself.
        self._max_unread = max_unread
        self._loop = asyncio.get_running_loop()
        # A list, not a deque (600 bytes empty): the worker takes it whole.
        self._events: list[Any] = []
        self._worker: asyncio.Task[None] | None = None
        self._paused = False
        self._read_ahead = 0
        self._timer: asyncio.TimerHandle | None = None
        #: The session has ended (or is ending): no more events are handled.
        self.closed = False
        self._cleaning = False  # the clean-up has started
        self.cleaned = False  # the clean-up has finished
        self._overdue: asyncio.TimerHandle | None = None
        # The client has said all it will (its DISCONNECT, the end of its stream): what it sent is handled even
        # while it does not read, so that the session ends (and its close is bounded by the wire's timeout).
        self._final = False
        self._final_waiter: asyncio.Future[None] | None = None  # the worker's wait for a drain, woken by it

    # ------------------------------------------------------------------ input
    def receive(self, events: list[Any], nbytes: int, *, hold: bool = False, final: bool = False) -> None:
        """``events`` decoded from ``nbytes`` more bytes of the client. With ``hold`` (a client not logged in
        yet) nothing more is read until these are handled. With ``final`` the client has said all it will (the
        protocol's last frame, or the end of its stream): they are handled even while it does not read what it
        was written (what they answer is bounded by what was read), so that its session ends."""
        if self.closed:
            return
        self._read_ahead += nbytes
        if final and not self._final:
            self._final = True
            if self._final_waiter is not None and not self._final_waiter.done():
                self._final_waiter.set_result(None)
        if not events:
            return
        self._events.extend(events)
        self._run()
        max_events = self._max_events
        if not self._paused and (
            hold or self._read_ahead >= self._max_bytes or (max_events is not None and len(self._events) >= max_events)
        ):
            self._paused = True
            self._wire.pause_reading()
            assert self._hooks is not None
            self._hooks.reading_paused()

    @property
    def read_ahead(self) -> int:
        """Bytes received since the worker last caught up: an upper bound of what waits to be handled."""
        return self._read_ahead

    def connection_lost(self, event: Any) -> None:
        """The client's transport closed: ``event`` says so to the session, after what came before it."""
        if not self.closed:
            self._events.append(event)
            self._run()

    # ------------------------------------------------------------------ time
    def arm_timer(self, delay_s: float | None, callback: Callable[[], None]) -> None:
        """Call ``callback`` in ``delay_s`` seconds instead of what was armed before (None: nothing). A
        callback that raises ends the session, logged, as a failed task would."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if delay_s is not None and not self.closed:
            self._timer = self._loop.call_later(max(delay_s, 0.0), self._fire, callback)

    def _fire(self, callback: Callable[[], None]) -> None:
        self._timer = None
        try:
            callback()
        except Exception:
            log.exception("session timer failed: the connection is closed", extra={"peer": self._wire.peer})
            self.end()

    # ------------------------------------------------------------------ the end
    def end(self) -> None:
        """End the session: the worker stops (it may be waiting for the core or the client), and the
        protocol's ``clean_up`` runs once."""
        if self.closed:
            return
        self.closed = True
        self._overdue = self._loop.call_later(CLEAN_UP_LIMIT_S, self._clean_up_overdue)
        worker = self._worker
        if worker is None:
            self._worker = self._task(self._shut_down(), "shutdown")
        elif worker is not asyncio.current_task():
            worker.cancel()
            worker.add_done_callback(self._cancelled_before_start)

    def _cancelled_before_start(self, worker: asyncio.Task[None]) -> None:
        """A worker cancelled before its first step never ran, nor its ``finally``: the clean-up did not start,
        and the session's link stayed open for good (found by the randomised run: MQTT sessions taken over while
        a worker for their client's PUBACKs waited to start kept their links, and consumers, for minutes)."""
        if not self._cleaning:
            self._worker = self._task(self._shut_down(), "shutdown")

    async def wait_closed(self) -> None:
        """Wait for the worker (the clean-up after an end), however it ended: a cancelled worker cleaned up too."""
        while self._worker is not None:
            worker = self._worker
            await asyncio.wait([worker])
            await asyncio.sleep(0)  # its done callbacks first: one may start the clean-up in a task of its own
            if self._worker is worker:
                return

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        if self._worker is None:
            self._worker = self._task(self._work(), "worker")

    def _task(self, coroutine: Any, what: str) -> asyncio.Task[None]:
        task = self._loop.create_task(coroutine, name=f"{self.name} {what}")
        return end_on_failure(task, self.end, self._wire.peer)

    async def _work(self) -> None:
        hooks = self._hooks
        assert hooks is not None
        handled_errors = hooks.handled_errors
        ended = True
        try:
            while not self.closed and self._events:
                if not self._final and (self._max_unread is None or self._wire.buffered() >= self._max_unread):
                    await self._drained()  # a client that does not read is not read either
                batch, self._events = iter(self._events), []
                while not self.closed and (event := next(batch, None)) is not None:
                    try:
                        if not hooks.handle_now(event):
                            hooks.before_handle()
                            await hooks.handle(event)
                    except handled_errors as error:
                        hooks.handle_error(event, error)
                hooks.after_batch()
            if not self.closed:
                ended = False
                self._read_ahead = 0
                if self._paused:
                    self._paused = False
                    self._wire.resume_reading()
                    hooks.reading_resumed()
                self._worker = None
        except asyncio.CancelledError:
            if not self.closed:
                raise
            # ``end`` stopped the worker: the session ends here like any other way. Not re-raised, because the
            # task would keep the exception, whose traceback holds this frame and so the session.
        finally:
            if ended:
                await self._shut_down()

    async def _drained(self) -> None:
        """Until the client reads what was written, or says all it will (``receive``'s ``final``)."""
        if self._wire.writable():
            return
        waiter = self._final_waiter = self._loop.create_future()
        drained = self._loop.create_task(self._wire.drained(), name=f"{self.name} drained")
        try:
            await asyncio.wait((drained, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            drained.cancel()
            self._final_waiter = None

    async def _shut_down(self) -> None:
        self.closed = True
        self._cleaning = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        hooks = self._hooks
        assert hooks is not None
        try:
            await hooks.clean_up()
        finally:
            self.cleaned = True
            if self._overdue is not None:
                self._overdue.cancel()
                self._overdue = None
            # The session refers to its driver: without this reference back, an ended session is freed as its
            # last reference goes instead of by a full collection, which over 19,000 sessions held the loop for
            # seconds, and the shared link's heartbeat with it.
            self._hooks = None

    def _clean_up_overdue(self) -> None:
        """Seen in randomised runs: MQTT sessions taken over whose links stayed open for minutes, taking the
        session's messages at each failover and counting an attempt for each until they were dead-lettered.
        Whatever the clean-up waits for, the session's link and transport close now, and the log says where
        it waited."""
        if self.cleaned:
            return
        if overdue_log.first():
            worker = self._worker
            where = _awaiting(worker.get_coro()) if worker is not None and not worker.done() else ""
            log.error(
                "session clean-up overdue: its link and connection are closed (further ones counted once a minute)",
                extra={"peer": self._wire.peer, "waiting_in": where or "(no task)"},
            )
        assert self._hooks is not None
        self._task(self._hooks.abort(), "abort")


def _awaiting(coroutine: Any) -> str:
    """Where a suspended coroutine waits, outermost first: ``clean_up:1440 > close:627``."""
    names: list[str] = []
    while coroutine is not None and len(names) < 12:
        frame = getattr(coroutine, "cr_frame", None) or getattr(coroutine, "gi_frame", None)
        if frame is not None:
            names.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coroutine = getattr(coroutine, "cr_await", None) or getattr(coroutine, "gi_yieldfrom", None)
    return " > ".join(names)


async def close_now(link: LinkClient | None, wire: Wire) -> None:
    """A protocol session's ``abort``: its core link and its client's transport close, nothing else is done."""
    if link is not None:
        link.on_closed = link.on_settled = None
        await link.close()
    wire.close()
