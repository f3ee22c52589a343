"""The application client's three publishing calls, against an in-process core over a real socket: the acknowledged
``publish``, the batch ``publish_batch`` and the fire-and-forget ``publish_unconfirmed``. A small publish window makes
each call wait for the core's credit on the way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.unit.gateway_harness import Core, core_settings, running_core

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import M_BODY, new_message
from tridentmq_stomp.settings import CoreLinkSection

WINDOW = 8
TOO_LARGE = b"x" * (17 * 1024 * 1024)  # past the link's 16 MiB frames


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    settings = core_settings(tmp_path, publish_window=WINDOW)
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        yield core


def application(core: Core) -> LinkClient:
    return LinkClient("127.0.0.1", core.port, reconnect=ReconnectPolicy(attempts=0), client_name="app")


async def received(client: LinkClient, queue: str, count: int) -> list[bytes]:
    consumer = await client.subscribe(queue, credit=count, auto_ack=True)
    bodies: list[bytes] = []
    while len(bodies) < count:
        batch = await consumer.get_batch(timeout=5)
        assert batch, f"only {len(bodies)} of {count} arrived"
        bodies.extend(bytes(message[M_BODY]) for _, message in batch)
    assert await consumer.get_batch(timeout=0.2) == []
    return bodies


async def test_publish_returns_once_confirmed_and_raises_on_a_refusal(core: Core) -> None:
    async with application(core) as client:
        await client.create_queue("acked", durable=True)
        for n in range(3 * WINDOW):  # past the window: each waits for its confirm, which brings the credit
            await client.publish(new_message("acked", b"%d" % n, durable=True))
        with pytest.raises(LinkRequestError) as refused:
            await client.publish(new_message("acked", TOO_LARGE))
        assert refused.value.code == ErrorCode.RESOURCE_LIMIT
        assert client.connected  # refused before it was sent: the link goes on
        assert await received(client, "acked", 3 * WINDOW) == [b"%d" % n for n in range(3 * WINDOW)]


async def test_a_batch_larger_than_the_window_goes_in_order_with_one_outcome_each(core: Core) -> None:
    async with application(core) as client:
        await client.create_queue("batch", durable=True)
        messages = [new_message("batch", b"%d" % n, durable=n % 2 == 0) for n in range(10 * WINDOW)]
        messages.insert(5, new_message("batch", TOO_LARGE))
        confirms = await client.publish_batch(iter(messages))
        outcomes = await asyncio.gather(*confirms, return_exceptions=True)
        assert len(outcomes) == len(messages)
        assert [n for n, outcome in enumerate(outcomes) if outcome is not None] == [5]
        assert isinstance(outcomes[5], LinkRequestError)
        assert outcomes[5].code == ErrorCode.RESOURCE_LIMIT
        assert await received(client, "batch", 10 * WINDOW) == [b"%d" % n for n in range(10 * WINDOW)]


async def test_an_unconfirmed_publish_waits_for_the_window_only(core: Core) -> None:
    async with application(core) as client:
        await client.create_queue("fire", durable=False)
        for n in range(20 * WINDOW):  # far past the window: the calls wait for credit, never for a confirm
            await client.publish_unconfirmed(new_message("fire", b"%d" % n))
        with pytest.raises(LinkRequestError) as refused:
            await client.publish_unconfirmed(new_message("fire", TOO_LARGE))
        assert refused.value.code == ErrorCode.RESOURCE_LIMIT
        assert await received(client, "fire", 20 * WINDOW) == [b"%d" % n for n in range(20 * WINDOW)]


def test_the_application_client_has_three_publishing_calls_and_the_relays_theirs() -> None:
    publishing = {
        name for name in dir(LinkClient) if not name.startswith("_") and ("publish" in name or "send" in name)
    }
    assert publishing == {"publish", "publish_batch", "publish_unconfirmed"}
    relays = {"send", "try_send", "send_if_open", "wait_for_credit", "can_send", "body_fits", "publish_credit"}
    assert relays <= set(dir(PipelinedLink))
    assert not relays & set(dir(LinkClient))


async def test_a_relay_sends_now_or_not_at_all_and_waits_for_the_window_itself(core: Core) -> None:
    async with PipelinedLink("127.0.0.1", core.port, reconnect=ReconnectPolicy(attempts=0)) as relay:
        await relay.create_queue("relayed", durable=False)
        assert relay.can_send
        assert relay.publish_credit == WINDOW
        # No await between them: the core's confirms, which bring credit back, cannot be read meanwhile.
        confirms = [relay.try_send(new_message("relayed", b"%d" % n)) for n in range(WINDOW - 1)]
        sequence = relay.send_if_open(new_message("relayed", b"%d" % (WINDOW - 1)))
        assert None not in confirms
        assert sequence >= 0
        assert (relay.can_send, relay.publish_credit) == (False, 0)
        assert relay.try_send(new_message("relayed", b"refused")) is None  # sent nothing
        assert relay.send_if_open(new_message("relayed", b"refused")) == -1
        await asyncio.wait_for(relay.wait_for_credit(), 5)
        assert relay.can_send
        last = relay.try_send(new_message("relayed", b"%d" % WINDOW))
        assert last is not None
        await asyncio.wait_for(asyncio.gather(*confirms, last), 5)
        assert not relay.body_fits(new_message("relayed", TOO_LARGE))
        assert relay.body_fits(new_message("relayed", b"x"))
        assert await received(relay, "relayed", WINDOW + 1) == [b"%d" % n for n in range(WINDOW + 1)]
