"""``LinkClient.settle_answered``: an ACK or NACK whose outcome the caller learns (a gateway that owes its
client a receipt for it), against an in-process core node with its journal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.unit.gateway_harness import Core, core_settings, eventually, running_core

from tridentmq_shared.link.client import Consumer, LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.message import M_ID, new_message
from tridentmq_stomp.settings import CoreLinkSection


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        yield core


async def taken(client: LinkClient, queue: str, *bodies: bytes) -> tuple[Consumer, list[int]]:
    """A consumer that took one delivery of each of ``bodies``, published durable to ``queue``."""
    consumer = await client.subscribe(queue, credit=10, credit_on_settle=True, durable=True)
    for body in bodies:
        await client.publish(new_message(queue, body, durable=True))
    batch: list[int] = []
    while len(batch) < len(bodies):
        batch += [message[M_ID] for _, message in await consumer.get_batch(timeout=5)]
    return consumer, batch


async def nothing_left(client: LinkClient, queue: str) -> None:
    probe = await client.subscribe(queue, credit=1)
    assert await probe.get(timeout=0.3) is None
    await probe.close()


async def test_an_answered_ack_completes_once_the_commit_is_safe_and_applies_the_ack(core: Core) -> None:
    async with core.admin() as client:
        consumer, [first] = await taken(client, "answered", b"a")
        store = core.node.journal_store
        store.gate = lambda: False  # the journal confirms nothing: a slow disk
        answer = consumer.ack_answered([first])
        await asyncio.sleep(0.2)
        assert not answer.done()
        store.gate = lambda: True
        store.recheck()
        await asyncio.wait_for(answer, 5)
        await consumer.close()
        await nothing_left(client, "answered")


async def test_an_answered_nack_completes_once_the_node_gave_the_message_back(core: Core) -> None:
    async with core.admin() as client:
        consumer, [first] = await taken(client, "nacked", b"a")
        await asyncio.wait_for(consumer.nack_answered([first], NackMode.REDELIVER), 5)
        [(count, message)] = await consumer.get_batch(timeout=5)
        assert (count, message[M_ID]) == (2, first)


async def test_an_ack_sent_as_the_link_drops_fails_and_the_message_comes_again(core: Core) -> None:
    async with core.admin() as client:
        consumer, [first] = await taken(client, "lost", b"a")
        protocol = client._protocol
        assert protocol is not None
        assert protocol.transport is not None
        protocol.transport.abort()
        with pytest.raises(LinkClosedError):
            await asyncio.wait_for(consumer.ack_answered([first]), 5)
        await eventually(lambda: client.failovers == 1, "the link resumed")
        [(count, message)] = await consumer.get_batch(timeout=5)
        assert (count, message[M_ID]) == (2, first)  # delivered again, flagged


async def test_an_ack_whose_link_drops_before_the_answer_fails(core: Core) -> None:
    async with core.admin() as client:
        consumer, [first] = await taken(client, "dropped", b"a")
        core.node.journal_store.gate = lambda: False
        answer = consumer.ack_answered([first])
        await asyncio.sleep(0.1)
        protocol = client._protocol
        assert protocol is not None
        assert protocol.transport is not None
        protocol.transport.abort()
        with pytest.raises(LinkClosedError):
            await asyncio.wait_for(answer, 5)


async def test_an_ack_whose_commit_is_refused_fails_and_gives_the_message_back(core: Core) -> None:
    """A node that cannot write refuses the COMMIT and keeps its transaction open: the client rolls it back,
    so the message is delivered again rather than held until the link ends."""
    async with core.admin() as client:
        consumer, [first] = await taken(client, "refused", b"a")
        transactions = core.node.broker.transactions
        transactions.write_refusal = (ErrorCode.RESOURCE_LIMIT, "the disk is full")
        with pytest.raises(LinkRequestError) as refused:
            await asyncio.wait_for(consumer.ack_answered([first]), 5)
        assert refused.value.code == ErrorCode.RESOURCE_LIMIT
        transactions.write_refusal = None
        [(count, message)] = await consumer.get_batch(timeout=5)
        assert (count, message[M_ID]) == (2, first)
