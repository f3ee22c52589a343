"""A link the node closes as malformed is not resumed: the resume sent the same input again, and a publish to
an empty address (``tridentmq produce ''``) reopened its link thousands of times a second, for ever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.unit.gateway_harness import Core, core_settings, running_core

from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import new_message
from tridentmq_stomp.settings import CoreLinkSection


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        yield core


async def test_a_publish_the_node_finds_malformed_fails_once_and_the_link_stays_closed(core: Core) -> None:
    async with core.admin() as client:
        first = set(core.node.links)
        (confirm,) = await client.publish_batch([new_message("", b"x")])
        with pytest.raises(LinkRequestError) as failed:
            await asyncio.wait_for(confirm, 5)
        assert failed.value.code == ErrorCode.MALFORMED
        await asyncio.sleep(0.3)
        assert set(core.node.links) <= first  # not opened again
