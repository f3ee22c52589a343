"""An attempt to open a link that fails (no answer to its HELLO in time, say) is reported by the attempt, and
its connection's loss is not taken for the loss of a link to resume: a gateway that had given up on a login
kept such a link reconnecting for ever with no client behind it (a storm of wrong passwords left hundreds of
them, which filled the node's handshakes and locked every new link out)."""

from __future__ import annotations

import asyncio

import pytest

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import ReconnectPolicy


async def test_a_handshake_without_an_answer_is_not_resumed_after_the_attempt_gave_up() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing: the HELLO goes unanswered

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = LinkClient(
        "127.0.0.1",
        port,
        user="guess",
        password="wrong",
        connect_timeout=0.2,
        reconnect=ReconnectPolicy(retry_interval=0.05, attempts=-1, initial_attempts=1),
    )
    try:
        with pytest.raises(LinkClosedError, match="no answer to the link's HELLO in time"):
            await client.connect()
        await asyncio.sleep(1.0)  # a resume would have connected again several times by now
        assert len(accepted) == 1
        assert not client.connected
    finally:
        await client.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
