"""Sessions carried as channels of one shared link (a gateway's clients): a fault in one ends that one only."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from tests.unit.gateway_harness import core_settings, running_core

from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.errors import LinkRequestError


async def test_an_unexpected_error_in_one_channels_request_ends_that_channel_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug met by one session's request must not drop the link that carries every other client of the
    gateway (before, asyncio closed the whole connection: every session failed over at once)."""
    async with running_core(
        core_settings(tmp_path), lambda port: CoreLinkSettings(port=port, reconnect_attempts=0)
    ) as core:
        broker = core.node.broker
        handle_request = broker._request

        def with_a_bug(session: Any, event: ev.Event, now_ms: int) -> Any:
            if isinstance(event, ev.CreateAddress) and event.address == "poison":
                raise RuntimeError("a bug")
            return handle_request(session, event, now_ms)

        monkeypatch.setattr(broker, "_request", with_a_bug)
        links = core.links
        victim = links.client(user="a", password="a", client_name="victim")
        bystander = links.client(user="b", password="b", client_name="bystander")
        await victim.connect()
        await bystander.connect()
        carriers = len(core.node.links)
        with caplog.at_level(logging.ERROR, logger="tridentmq.core"), pytest.raises(LinkRequestError):
            await victim.create_address("poison")
        await bystander.create_address("fine")  # its channel, and the link under it, still serve
        assert len(core.node.links) == carriers
        assert "link channel ended on an unexpected error" in caplog.text  # with its traceback, once
        await victim.close()
        await bystander.close()
