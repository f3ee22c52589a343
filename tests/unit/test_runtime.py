"""The asyncio helpers every process shares."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref

import pytest
import uvloop

from tridentmq_shared.runtime import EndedSessions, cancel_and_wait, tune_gc


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


class _Accepted(asyncio.Protocol):
    def __init__(self, accepted: asyncio.Future[asyncio.BaseTransport]) -> None:
        self.accepted = accepted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.accepted.set_result(transport)


def _nodelay(transport: asyncio.BaseTransport) -> int:
    sock = transport.get_extra_info("socket")
    return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_the_event_loops_disable_nagle_on_both_ends_of_a_tcp_connection(loop_kind: str) -> None:
    """Nothing of ours sets TCP_NODELAY: both event loops do, on the connections they accept and make. Without it
    small operations (credit, confirms, CONNACKs) would wait for the peer's delayed ACK, up to ~40 ms each."""

    async def connect() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[asyncio.BaseTransport] = loop.create_future()
        server = await loop.create_server(lambda: _Accepted(accepted), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        theirs = await accepted
        try:
            return _nodelay(theirs), _nodelay(client)
        finally:
            client.close()
            theirs.close()
            server.close()

    accepted, made = uvloop.run(connect()) if loop_kind == "uvloop" else asyncio.run(connect())
    assert (accepted, made) == (1, 1)


class Session:
    def __init__(self) -> None:
        self.wire = Wire(self)  # a session and its wire refer to each other


class Wire:
    def __init__(self, session: Session) -> None:
        self.session = session


class FreedSession:
    """A session that refers to nothing of its own: freed as its last reference goes."""


async def test_sessions_left_in_cycles_are_collected_once_as_many_ended_as_are_open() -> None:
    """A gateway whose clients came and went grew by 10-23 KB per connection it ever had: their objects formed
    cycles, and with a young generation of 100,000 and rare older collections nothing collected them."""
    thresholds = gc.get_threshold()
    tune_gc()
    gc.disable()  # only the backstop's collection may free them
    try:
        ended = EndedSessions(minimum=10, check_delay_s=0.05)
        left = []
        for n in range(12):
            session = Session()
            left.append(weakref.ref(session))
            ended.ended(session, still_open=5)
            del session
            if n == 8:  # 9 ended: no check yet
                await asyncio.sleep(0.1)
                assert ended.collections == 0
        await asyncio.sleep(0.2)
        assert ended.collections == 1
        assert all(ref() is None for ref in left)
        more_open = EndedSessions(minimum=10, check_delay_s=0.01)
        for _ in range(19):
            more_open.ended(Session(), still_open=20)
        await asyncio.sleep(0.1)
        assert more_open.collections == 0  # as many as are open: 20
    finally:
        gc.enable()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


async def test_sessions_that_free_themselves_cost_no_collection() -> None:
    """A full collection holds the loop as long as it takes to look at every object (0.9 s at 19,000
    connections): five in a row, as 19,000 clients left at once, cut the gateway's heartbeat to its core."""
    ended = EndedSessions(minimum=10, check_delay_s=0.01)
    for _ in range(50):
        ended.ended(FreedSession(), still_open=5)
    await asyncio.sleep(0.1)
    assert ended.collections == 0
