"""Sessions carried as channels of one shared link (a gateway's clients): a fault in one ends that one only."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from tests.unit.gateway_harness import core_settings, running_core

from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import new_message


async def test_an_unexpected_error_in_one_channels_request_ends_that_channel_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug met by one session's request must not drop the link that carries every other client of the
    gateway (before, asyncio closed the whole connection: every session failed over at once), nor come back:
    the session ends with ``internal`` and does not resume (it would send the same request again, for ever).
    What the session had done before the fault is answered first: its earlier publish is confirmed, once."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        broker = core.node.broker
        handle_request = broker._request
        poisoned = 0

        def with_a_bug(session: Any, event: ev.Event, now_ms: int) -> Any:
            nonlocal poisoned
            if isinstance(event, ev.CreateAddress) and event.address == "poison":
                poisoned += 1
                raise RuntimeError("a bug")
            return handle_request(session, event, now_ms)

        monkeypatch.setattr(broker, "_request", with_a_bug)
        links = core.links
        victim = links.client(user="a", password="a", client_name="victim")
        bystander = links.client(user="b", password="b", client_name="bystander")
        await victim.connect()
        await bystander.connect()
        await bystander.create_queue("kept", durable=False)
        carriers = len(core.node.links)
        confirmed = await victim.send(new_message("kept", b"before the fault"))  # in the same batch as the poison
        with caplog.at_level(logging.ERROR, logger="tridentmq.core"), pytest.raises(LinkClosedError) as ended:
            await victim.create_address("poison")
        await confirmed
        assert ended.value.code == ErrorCode.INTERNAL
        await bystander.create_address("fine")  # its channel, and the link under it, still serve
        assert len(core.node.links) == carriers
        await asyncio.sleep(0.5)  # a resume would have sent the poison again by now
        assert poisoned == 1
        assert not victim.connected
        assert len(core.node.broker.catalog.queues["kept"]) == 1
        assert caplog.text.count("link channel ended on an unexpected error") == 1  # with its traceback
        assert "expected HELLO" not in caplog.text  # no channel made anew of the failed one's input
        await victim.close()
        await bystander.close()
