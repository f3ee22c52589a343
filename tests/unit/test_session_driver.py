"""The session driver the gateways share: order, no idle task, reading paused and resumed, one clean-up."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tridentmq_shared import session_driver
from tridentmq_shared.log_window import FloodLog
from tridentmq_shared.session_driver import SessionDriver


def fresh_overdue_log(seconds: float = 60.0) -> FloodLog:
    """An overdue log of its own for a test (a loop's id may be an earlier test's, its window still open)."""
    return FloodLog(seconds, session_driver.log, logging.ERROR, "more session clean-ups overdue")


@pytest.fixture(autouse=True)
def _fresh_overdue_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_driver, "overdue_log", fresh_overdue_log())


class RecordingWire:
    """A client transport that records what the driver asks of it."""

    peer = "test"
    host = "127.0.0.1"
    certificate_name = None

    def __init__(self) -> None:
        self.reading = True
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    async def drained(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def buffered(self) -> int:
        return 0

    def logged_in(self) -> None:
        pass


class Session:
    """Events are strings: "now:x" is handled at once, "wait:x" after a turn of the loop, "fail" raises a
    handled error, "bug" an unexpected one, "block" waits until the test lets it go."""

    handled_errors: tuple[type[Exception], ...] = (ValueError,)

    def __init__(self) -> None:
        self.wire = RecordingWire()
        self.driver = SessionDriver(self, self.wire, "test", max_events=3, max_bytes=1000)
        self.handled: list[str] = []
        self.errors: list[str] = []
        self.clean_ups = 0
        self.batches = 0
        self.resumed = 0
        self.release = asyncio.Event()

    def handle_now(self, event: Any) -> bool:
        if event.startswith("now:"):
            self.handled.append(event)
            return True
        return False

    async def handle(self, event: Any) -> None:
        if event == "fail":
            raise ValueError("refused")
        if event == "bug":
            raise RuntimeError("a bug")
        if event == "block":
            await self.release.wait()
        await asyncio.sleep(0)
        self.handled.append(event)

    def handle_error(self, event: Any, error: Exception) -> None:
        self.errors.append(f"{event}: {error}")

    def before_handle(self) -> None:
        pass

    def after_batch(self) -> None:
        self.batches += 1

    def reading_paused(self) -> None:
        pass

    def reading_resumed(self) -> None:
        self.resumed += 1

    async def clean_up(self) -> None:
        self.clean_ups += 1
        self.wire.close()

    async def abort(self) -> None:
        raise AssertionError("a clean-up that finished is not aborted")


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_events_are_handled_in_order_and_an_idle_session_holds_no_task() -> None:
    session = Session()
    tasks_before = len(asyncio.all_tasks())
    session.driver.receive(["now:1", "wait:2", "now:3"], 30)
    session.driver.receive(["wait:4"], 10)
    await settle()
    assert session.handled == ["now:1", "wait:2", "now:3", "wait:4"]
    assert len(asyncio.all_tasks()) == tasks_before
    assert session.clean_ups == 0


async def test_reading_held_for_a_login_resumes_once_the_events_are_handled() -> None:
    session = Session()
    session.driver.receive(["wait:connect"], 10, hold=True)
    assert not session.wire.reading
    await settle()
    assert session.wire.reading
    assert session.resumed == 1


async def test_too_many_waiting_events_pause_reading() -> None:
    session = Session()
    session.driver.receive(["block", "now:1", "now:2"], 10)
    assert not session.wire.reading
    session.release.set()
    await settle()
    assert session.wire.reading
    assert session.handled == ["block", "now:1", "now:2"]


class UnreadWire(RecordingWire):
    """A client that does not read: ``unread`` bytes wait for it until ``read``."""

    def __init__(self, unread: int) -> None:
        super().__init__()
        self.unread = unread
        self._read = asyncio.Event()

    async def drained(self) -> None:
        await self._read.wait()

    def writable(self) -> bool:
        return self._read.is_set()

    def buffered(self) -> int:
        return 0 if self._read.is_set() else self.unread

    def read(self) -> None:
        self._read.set()


@pytest.mark.parametrize(
    ("max_unread", "unread", "handled_unread"), [(None, 10, False), (100, 10, True), (100, 100, False)]
)
async def test_events_are_handled_for_a_client_that_does_not_read_up_to_max_unread(
    max_unread: int | None, unread: int, handled_unread: bool
) -> None:
    session = Session()
    wire = session.wire = UnreadWire(unread)
    session.driver = SessionDriver(session, wire, "test", max_events=3, max_bytes=1000, max_unread=max_unread)
    session.driver.receive(["now:1", "wait:2"], 20)
    await settle()
    assert session.handled == (["now:1", "wait:2"] if handled_unread else [])
    wire.read()
    await settle()
    assert session.handled == ["now:1", "wait:2"]


async def test_a_handled_error_goes_to_the_session_and_the_worker_goes_on() -> None:
    session = Session()
    session.driver.receive(["fail", "now:after"], 10)
    await settle()
    assert session.errors == ["fail: refused"]
    assert session.handled == ["now:after"]
    assert not session.driver.closed


async def test_an_unexpected_error_ends_the_session_with_its_clean_up() -> None:
    session = Session()
    session.driver.receive(["bug", "now:never"], 10)
    await settle()
    assert session.driver.closed
    assert session.clean_ups == 1
    assert session.wire.closed
    assert session.handled == []


async def test_ending_an_idle_session_cleans_up_once() -> None:
    session = Session()
    session.driver.end()
    session.driver.end()
    await session.driver.wait_closed()
    assert session.clean_ups == 1
    session.driver.receive(["now:late"], 10)
    session.driver.connection_lost("lost")
    await settle()
    assert session.handled == []
    assert session.clean_ups == 1


async def test_ending_a_waiting_worker_cancels_it_and_cleans_up_once() -> None:
    session = Session()
    session.driver.receive(["block", "now:after"], 10)
    await settle()
    session.driver.end()
    await asyncio.wait_for(session.driver.wait_closed(), 1)
    assert session.clean_ups == 1
    assert session.handled == []


async def test_the_timer_fires_once_is_replaced_by_a_later_arm_and_is_cancelled_by_the_end() -> None:
    session = Session()
    fired: list[str] = []
    session.driver.arm_timer(0.01, lambda: fired.append("first"))
    session.driver.arm_timer(0.02, lambda: fired.append("second"))
    await asyncio.sleep(0.05)
    assert fired == ["second"]
    session.driver.arm_timer(0.01, lambda: fired.append("third"))
    session.driver.end()
    await session.driver.wait_closed()
    await asyncio.sleep(0.03)
    assert fired == ["second"]


async def test_a_timer_callback_that_fails_ends_the_session_with_its_clean_up() -> None:
    session = Session()

    def broken() -> None:
        raise RuntimeError("a bug in a deadline")

    session.driver.arm_timer(0.0, broken)
    await asyncio.sleep(0.01)
    await session.driver.wait_closed()
    assert session.driver.closed
    assert session.clean_ups == 1


class StuckSession(Session):
    """A session whose clean-up never finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = asyncio.Event()

    async def clean_up(self) -> None:
        self.clean_ups += 1
        await asyncio.Event().wait()

    async def abort(self) -> None:
        self.wire.close()
        self.aborted.set()


async def test_a_session_ended_before_its_worker_started_still_cleans_up() -> None:
    """A worker cancelled before its first step never runs its ``finally``: the clean-up never started and the
    session's core link stayed open. Found by the randomised run (an MQTT session taken over while a worker for
    its client's last packets waited to start)."""
    session = Session()
    session.driver.receive(["wait:x"], 10)  # a worker is made; it has not run yet
    session.driver.end()
    await asyncio.wait_for(session.driver.wait_closed(), 5)
    assert session.clean_ups == 1
    assert session.wire.closed


async def test_an_ended_session_whose_clean_up_hangs_is_aborted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen in randomised runs: MQTT sessions taken over whose links stayed open for minutes. Whatever the
    clean-up waits for, the session's link and socket close after ``CLEAN_UP_LIMIT_S``, logged with where it
    waited."""
    monkeypatch.setattr(session_driver, "CLEAN_UP_LIMIT_S", 0.05)
    session = StuckSession()
    session.driver.receive(["wait:x"], 10)
    session.driver.end()
    await asyncio.wait_for(session.aborted.wait(), 5)
    assert session.wire.closed
    assert session.clean_ups == 1
    (overdue,) = [r for r in caplog.records if "session clean-up overdue" in r.getMessage()]
    assert "clean_up" in overdue.waiting_in  # where it waited


async def test_overdue_clean_ups_are_logged_once_per_window_and_the_rest_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway whose core link fails may have thousands of sessions end at once, each clean-up waiting for the
    link: 100,000 clients leaving six gateways logged 84,000 ERROR lines. The first is logged with where it
    waited, the others in its window are counted and logged as one line when the window is over."""
    monkeypatch.setattr(session_driver, "CLEAN_UP_LIMIT_S", 0.05)
    monkeypatch.setattr(session_driver, "overdue_log", fresh_overdue_log(0.3))
    sessions = [StuckSession() for _ in range(5)]
    for session in sessions:
        session.driver.receive(["wait:x"], 10)
        session.driver.end()
    await asyncio.wait_for(asyncio.gather(*(session.aborted.wait() for session in sessions)), 5)
    assert all(session.wire.closed for session in sessions)  # each one aborted, logged or not
    assert [r.getMessage() for r in caplog.records].count(
        "session clean-up overdue: its link and connection are closed (further ones counted once a minute)"
    ) == 1
    await asyncio.sleep(0.5)
    (more,) = [r for r in caplog.records if r.getMessage().startswith("more session clean-ups overdue")]
    assert more.count == 4


async def test_a_session_that_cleans_up_in_time_is_not_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_driver, "CLEAN_UP_LIMIT_S", 0.05)
    session = Session()
    session.driver.end()
    await session.driver.wait_closed()
    assert session.driver.cleaned
    await asyncio.sleep(0.1)
    assert session.clean_ups == 1
