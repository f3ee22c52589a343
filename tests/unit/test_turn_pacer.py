"""The pacer of a burst: at most so many callbacks per turn of the event loop, the rest in order in the turns
after, none lost, and a failing one logged without stopping the others."""

from __future__ import annotations

import asyncio
import logging

import pytest
from tests.unit.loop_turns import LoopTurns

from tridentmq_shared.turn_pacer import TurnPacer


async def _turns_passing(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


LOG = logging.getLogger("tridentmq.test")


async def test_a_burst_runs_a_turn_s_worth_at_a_time_in_order() -> None:
    turns = LoopTurns()
    pacer = TurnPacer(per_turn=100, log=LOG)
    ran: list[tuple[int, int]] = []  # (callback, turn it ran in)
    for i in range(250):
        pacer.call_soon(lambda i=i: ran.append((i, turns.now)))
    assert not ran, "nothing runs in the caller's turn, as with the loop's call_soon"
    assert pacer.queued == 250
    await _turns_passing(5)
    turns.stop()
    assert [i for i, _ in ran] == list(range(250)), "every callback ran once, in the order they came"
    per_turn: dict[int, int] = {}
    for _, turn in ran:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert sorted(per_turn.values(), reverse=True) == [100, 100, 50]
    assert pacer.queued == 0


async def test_calls_while_a_burst_waits_run_after_it() -> None:
    pacer = TurnPacer(per_turn=1, log=LOG)
    ran: list[str] = []
    pacer.call_soon(ran.append, "first")
    pacer.call_soon(ran.append, "second")
    await asyncio.sleep(0)  # the next turn runs "first"...
    assert ran == ["first"]
    pacer.call_soon(ran.append, "third")  # ...and "third" waits behind "second"
    await _turns_passing(3)
    assert ran == ["first", "second", "third"]
    pacer.call_soon(ran.append, "fourth")  # the burst is over: the next turn runs it
    await asyncio.sleep(0)
    assert ran == ["first", "second", "third", "fourth"]


async def test_a_failing_callback_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    pacer = TurnPacer(per_turn=2, log=LOG)
    ran: list[int] = []

    def fail() -> None:
        raise RuntimeError("boom")

    pacer.call_soon(ran.append, 1)
    pacer.call_soon(fail)
    pacer.call_soon(ran.append, 2)
    with caplog.at_level(logging.ERROR, "tridentmq.test"):
        await _turns_passing(3)
    assert ran == [1, 2]
    [record] = [r for r in caplog.records if r.message == "paced callback failed"]
    assert record.exc_info is not None
    assert "boom" in str(record.exc_info[1])


def test_a_pacer_lets_at_least_one_through() -> None:
    with pytest.raises(ValueError, match="per_turn"):
        TurnPacer(per_turn=0, log=LOG)


async def test_run_all_runs_what_is_queued_at_once_when_the_process_stops() -> None:
    pacer = TurnPacer(per_turn=1, log=LOG)
    ran: list[int] = []

    def again(i: int) -> None:  # a callback that goes on in a later call (a session closed a slice at a time)
        ran.append(i)
        if i < 6:
            pacer.call_soon(again, i + 5)

    for i in range(5):
        pacer.call_soon(ran.append, i)
    pacer.call_soon(again, 5)
    pacer.run_all()
    assert ran == [0, 1, 2, 3, 4, 5, 10]
    await _turns_passing(2)  # the turn it had asked for finds nothing more to run
    assert ran == [0, 1, 2, 3, 4, 5, 10]
