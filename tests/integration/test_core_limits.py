"""Limits and recovery against a real core process: handshake timeout, memory-bounded floods, reconnects."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import msgpack
import pytest
from tests.conftest import start_core

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration


def test_silent_connection_is_closed_after_the_handshake_timeout(tmp_path: Path) -> None:
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_HANDSHAKE_TIMEOUT_MS="300")
    try:
        with socket.create_connection(("127.0.0.1", node.link_port), timeout=10) as sock:
            data = b""
            while chunk := sock.recv(4096):  # the core closes: recv returns b"" (a hang fails on the timeout)
                data += chunk
        (size,) = struct.unpack(">I", data[:4])
        [close] = msgpack.unpackb(data[4 : 4 + size])
        assert close[0] == 3
        assert close[1] == "unauthenticated"
    finally:
        assert node.stop() == 0


async def test_a_flood_is_held_at_the_memory_limit_and_resumes(tmp_path: Path) -> None:
    limit = 2 * 1024 * 1024
    body = b"x" * 1000  # ~1256 bytes accounted per message
    total = 8000  # ~10 MB: five times the limit
    node = start_core(
        tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MEMORY_BYTES=str(limit), TRIDENTMQ_CORE_LINK_PUBLISH_WINDOW="100"
    )
    try:
        async with (
            PipelinedLink("127.0.0.1", node.link_port) as producer,  # its credit is watched
            LinkClient("127.0.0.1", node.link_port) as consumer_link,
        ):
            await producer.create_queue("flood", durable=False)

            confirmed = 0

            def count(_: asyncio.Future[None]) -> None:
                nonlocal confirmed
                confirmed += 1

            async def flood() -> None:
                futures = []
                for _ in range(total):
                    future = await producer.send(new_message("flood", body))
                    future.add_done_callback(count)
                    futures.append(future)
                await asyncio.gather(*futures)

            task = asyncio.create_task(flood())
            # Wait until the producer is blocked: no credit left and nothing more being confirmed.
            previous = -1
            while not (producer.publish_credit == 0 and confirmed == previous):
                previous = confirmed
                await asyncio.sleep(0.3)
            assert not task.done()
            accepted = confirmed
            per_message = len(body) + 256
            assert accepted * per_message <= limit + 100 * per_message  # limit plus one publish window
            consumer = await consumer_link.subscribe("flood", credit=500, auto_ack=True)
            received = 0
            while received < total:
                batch = await consumer.get_batch(timeout=20)
                assert batch, f"stalled after {received} messages"
                received += len(batch)
            await asyncio.wait_for(task, 20)
            assert received == total
    finally:
        assert node.stop() == 0


async def test_client_reconnects_resubscribes_and_resends(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    port = node.link_port
    policy = ReconnectPolicy(retry_interval=0.05, max_interval=0.2, attempts=-1)
    client = LinkClient("127.0.0.1", port, reconnect=policy)
    await client.connect()
    try:
        await client.create_queue("resume", durable=False)
        consumer = await client.subscribe("resume", auto_ack=True)
        await client.publish(new_message("resume", b"before"))
        first = await consumer.get(timeout=5)
        assert first is not None
        assert first.body == b"before"
        assert node.stop() == 0
        node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
        # Published while the link is down or coming back: confirmed once the client has resumed.
        await asyncio.wait_for(client.publish(new_message("resume", b"after")), 20)
        second = await consumer.get(timeout=10)
        assert second is not None
        assert second.body == b"after"
    finally:
        await client.close()
        assert node.stop() == 0
