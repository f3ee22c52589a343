"""The asyncio helpers every process shares."""

from __future__ import annotations

import asyncio

from tridentmq_shared.runtime import cancel_and_wait


async def test_cancel_and_wait_ends_a_loop_whose_wait_for_swallowed_the_cancellation() -> None:
    ready = asyncio.Event()
    rounds = 0

    async def retry_forever() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await asyncio.wait_for(ready.wait(), 5)  # on 3.11 a cancel arriving as it completes is lost
            ready.clear()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(retry_forever())
    await asyncio.sleep(0.01)
    ready.set()
    task.cancel()  # in the same turn as the event: the first cancellation may be swallowed
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert task.cancelled()


async def test_cancel_and_wait_accepts_no_task_and_a_finished_one() -> None:
    await cancel_and_wait(None)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await cancel_and_wait(done)
