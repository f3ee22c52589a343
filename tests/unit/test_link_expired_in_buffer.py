"""Messages that expire while a link client holds them (a gateway's prefetch, ahead of its client's credit) are
not handed on: a consumer's go back to the queue, where the node expires them; an auto-ack consumer's are
dropped, a browser's skipped. Against an in-process core node."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.unit.gateway_harness import Core, core_settings, eventually, running_core

from tridentmq_shared.link.client import Consumer, LinkClient
from tridentmq_shared.message import M_BODY, new_message
from tridentmq_stomp.settings import CoreLinkSection

SHORT_MS = 150


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        yield core


async def buffered_past_expiry(client: LinkClient, queue: str, **options: bool) -> Consumer:
    """A consumer (``options``) holding a message that expired while buffered and one that never expires."""
    await client.create_queue(queue)
    now_ms = int(time.time() * 1000)
    await client.publish(new_message(queue, b"short", expiration_ms=now_ms + SHORT_MS))
    await client.publish(new_message(queue, b"long"))
    consumer = await client.subscribe(queue, credit=10, **options)  # (a browser of an empty queue ends at once)
    await eventually(lambda: len(consumer.peek()) == 2, "both messages buffered")
    await asyncio.sleep(SHORT_MS * 2 / 1000)
    return consumer


async def test_an_expired_message_a_consumer_holds_goes_back_and_expires_to_the_expiry_address(core: Core) -> None:
    """A gateway took messages ahead of its client's credit: one that expired meanwhile reached the client
    all the same, with its ttl spent (the node expires only what it holds itself)."""
    async with core.admin() as client:
        consumer = await buffered_past_expiry(client, "ttl")
        batch = consumer.take_batch()
        assert [message[M_BODY] for _, message in batch] == [b"long"]
        expired = await client.subscribe("ExpiryQueue", credit=10)
        moved = await expired.get(timeout=5)
        assert moved is not None
        assert moved.body == b"short"
        queue = core.node.broker.queues["ttl"]
        assert (len(queue), queue.expired) == (0, 1)  # expired by the node, not redelivered


@pytest.mark.parametrize("kind", ["auto_ack", "browse"])
async def test_an_auto_ack_consumer_drops_it_and_a_browser_skips_it(core: Core, kind: str) -> None:
    async with core.admin() as client:
        consumer = await buffered_past_expiry(client, kind, **{kind: True})
        got = await consumer.get(timeout=1)
        assert got is not None
        assert got.body == b"long"
        assert await consumer.get(timeout=0.2) is None
