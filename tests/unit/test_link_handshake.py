"""A link client's handshake against a node that accepts the connection and never answers its HELLO."""

from __future__ import annotations

import asyncio
import time

import pytest

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import ReconnectPolicy


class _Silent(asyncio.Protocol):
    """Reads the HELLO and says nothing; records when its connection ends."""

    def __init__(self, ended: asyncio.Future[None]) -> None:
        self.ended = ended
        self.received = b""

    def data_received(self, data: bytes) -> None:
        self.received += data

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


async def test_a_hello_without_an_answer_fails_the_connect_after_its_timeout_and_closes_the_connection() -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    peers: list[_Silent] = []

    def silent() -> _Silent:
        peers.append(_Silent(ended))
        return peers[-1]

    server = await loop.create_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = LinkClient("127.0.0.1", port, reconnect=ReconnectPolicy(attempts=0), connect_timeout=0.3)
    started = time.monotonic()
    try:
        with pytest.raises(LinkClosedError, match="cannot connect"):
            await client.connect()
        waited = time.monotonic() - started
        await asyncio.wait_for(ended, 5)  # the client gave the connection up
    finally:
        server.close()
        await client.close()
    assert 0.3 <= waited < 3
    assert len(peers) == 1
    assert peers[0].received  # its HELLO


async def test_a_connect_cancelled_while_its_hello_waits_closes_the_connection() -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    server = await loop.create_server(lambda: _Silent(ended), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = LinkClient("127.0.0.1", port, reconnect=ReconnectPolicy(attempts=0), connect_timeout=30)
    connecting = asyncio.create_task(client.connect())
    try:
        await asyncio.sleep(0.2)
        connecting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await connecting
        await asyncio.wait_for(ended, 5)
    finally:
        server.close()
        await client.close()
