"""LightEvent behaves as asyncio.Event where the gateways use it."""

from __future__ import annotations

import asyncio

import pytest

from tridentmq_shared.light_event import LightEvent


async def test_set_wakes_every_waiter_and_a_set_event_does_not_block() -> None:
    event = LightEvent()
    waiters = [asyncio.create_task(event.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    event.set()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 1) == [True, True, True]
    assert event.is_set()
    assert await asyncio.wait_for(event.wait(), 1)


async def test_a_waiter_woken_by_set_returns_even_if_cleared_before_it_runs() -> None:
    event = LightEvent()
    waiter = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    event.set()
    event.clear()
    assert await asyncio.wait_for(waiter, 1)
    assert not event.is_set()


async def test_a_cancelled_waiter_leaves_the_others_waiting() -> None:
    event = LightEvent(is_set=False)
    cancelled = asyncio.create_task(event.wait())
    other = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not other.done()
    event.set()
    assert await asyncio.wait_for(other, 1)


async def test_wait_with_a_timeout_times_out_while_clear() -> None:
    event = LightEvent()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(event.wait(), 0.01)
    event.set()
    assert await asyncio.wait_for(event.wait(), 1)


async def test_wait_with_its_own_timeout_says_false_and_leaves_no_waiter_behind() -> None:
    event = LightEvent()
    assert await event.wait(0.01) is False
    assert event._waiters == []
    later = asyncio.create_task(event.wait(5))
    await asyncio.sleep(0)
    event.set()
    assert await asyncio.wait_for(later, 1) is True
    assert await event.wait(0) is True  # set: at once, whatever the timeout
