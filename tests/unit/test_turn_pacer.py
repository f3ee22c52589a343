"""The pacer of a burst: at most so many callbacks per turn of the event loop, the rest in order in the turns
after, none lost, and a failing one logged without stopping the others."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tridentmq_shared.turn_pacer import TurnPacer


class _Turns:
    """Counts the turns of the running loop: a callback that schedules itself again each turn."""

    def __init__(self) -> None:
        self.now = 0
        self._handle = asyncio.get_running_loop().call_soon(self._next)

    def _next(self) -> None:
        self.now += 1
        self._handle = asyncio.get_running_loop().call_soon(self._next)

    def stop(self) -> None:
        self._handle.cancel()


async def _turns_passing(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_burst_runs_a_turn_s_worth_at_a_time_in_order() -> None:
    turns = _Turns()
    pacer = TurnPacer(per_turn=100)
    ran: list[tuple[int, int]] = []  # (callback, turn it ran in)
    for i in range(250):
        pacer.call(lambda i=i: ran.append((i, turns.now)))
    assert len(ran) == 100, "the first turn's worth runs at once"
    assert pacer.queued == 150
    await _turns_passing(5)
    turns.stop()
    assert [i for i, _ in ran] == list(range(250)), "every callback ran once, in the order they came"
    per_turn: dict[int, int] = {}
    for _, turn in ran:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert sorted(per_turn.values(), reverse=True) == [100, 100, 50]
    assert pacer.queued == 0


async def test_a_call_after_the_burst_runs_at_once_in_a_later_turn() -> None:
    pacer = TurnPacer(per_turn=2)
    ran: list[str] = []
    for name in "abc":
        pacer.call(ran.append, name)
    assert ran == ["a", "b"]
    await _turns_passing(3)
    assert ran == ["a", "b", "c"]
    pacer.call(ran.append, "d")  # the count started afresh: room again
    assert ran == ["a", "b", "c", "d"]


async def test_calls_behind_a_queue_wait_their_turn_even_when_the_turn_has_room() -> None:
    pacer = TurnPacer(per_turn=1)
    ran: list[str] = []
    pacer.call(ran.append, "first")
    pacer.call(ran.append, "second")  # queued: the turn is full
    await asyncio.sleep(0)  # the next turn runs "second"...
    pacer.call(ran.append, "third")  # ...and its room is taken: "third" waits, after it
    assert ran == ["first", "second"]
    await _turns_passing(2)
    assert ran == ["first", "second", "third"]


async def test_a_failing_callback_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    pacer = TurnPacer(per_turn=1)
    ran: list[int] = []

    def fail() -> None:
        raise RuntimeError("boom")

    pacer.call(ran.append, 1)
    pacer.call(fail)  # queued: it fails in the pacer's own turn, where nobody else would log it
    pacer.call(ran.append, 2)
    with caplog.at_level(logging.ERROR, "tridentmq.gateway"):
        await _turns_passing(4)
    assert ran == [1, 2]
    [record] = [r for r in caplog.records if r.message == "paced callback failed"]
    assert record.exc_info is not None
    assert "boom" in str(record.exc_info[1])


def test_a_pacer_lets_at_least_one_through() -> None:
    with pytest.raises(ValueError, match="per_turn"):
        TurnPacer(per_turn=0)
