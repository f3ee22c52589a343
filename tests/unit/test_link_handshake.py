"""A link client's handshake against a node that accepts the connection and never answers its HELLO."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.unit.gateway_harness import eventually

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.codec import LinkConnection, Role
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import new_message


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


class _Node(asyncio.Protocol):
    """A node's side of a link, as far as a handshake goes: WELCOME to a HELLO, and with ``stopping`` a CLOSE in
    the same write (a node that stops right as the client resumes on it), which then closes the connection."""

    def __init__(self, stopping: bool, accepted: list[_Node]) -> None:
        self.stopping = stopping
        self.accepted = accepted
        self.conn = LinkConnection(Role.SERVER, heartbeat_ms=0)  # (it sends none)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        for event in self.conn.receive_data(data, time.monotonic()):
            req_id = getattr(event, "req_id", None)
            if req_id is not None and self.conn.open:
                self.conn.reply(req_id, None)  # (a will set, say)
            elif type(event).__name__ == "HelloReceived":
                self.conn.accept("node-1", f"conn-{len(self.accepted)}", 100, time.monotonic())
                self.accepted.append(self)
                if self.stopping:
                    self.conn.close(ErrorCode.SHUTDOWN, "the node is stopping")
        self.transport.write(self.conn.data_to_send())
        if self.stopping:
            self.transport.close()


async def test_a_resume_on_a_node_that_closes_the_link_with_its_welcome_resumes_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every node of a cluster stopped at once: a gateway's link resumed on a node whose CLOSE came with its
    WELCOME, restored what it had set up (its will, its topology request) on the closed link, failed with a
    traceback ("link task failed") and was closed for good."""
    loop = asyncio.get_running_loop()
    accepted: list[_Node] = []
    server = await loop.create_server(lambda: _Node(len(accepted) == 1, accepted), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = LinkClient(
        "127.0.0.1",
        port,
        heartbeat_ms=0,
        reconnect=ReconnectPolicy(retry_interval=0.01, attempts=20),
    )
    try:
        await client.connect()
        await client.set_will("k", new_message("wills", b"bye"))
        first = accepted[0]
        assert first.transport is not None
        first.transport.close()  # lost: the client resumes, on the stopping node first
        await eventually(lambda: len(accepted) >= 3, "a third connection, after the stopping node's")
        await asyncio.sleep(0.1)
        assert len(accepted) == 3
        assert client._conn is not None
        assert client._conn.open
    finally:
        server.close()
        await client.close()
    assert "link task failed" not in caplog.text
