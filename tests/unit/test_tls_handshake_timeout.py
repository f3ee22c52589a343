"""A TLS listener closes a connection whose handshake does not end in time: connections that sent a ClientHello
(or nothing) and then stalled stayed open 60 s, asyncio's default, and were not counted among those logging
in (1,100 of them held 58 MB in a gateway)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from aiohttp import web
from tests.tls_certs import Certificates

from tridentmq_shared import http_limits
from tridentmq_shared.http_limits import serve


async def test_a_stalled_tls_handshake_is_closed_after_the_handshake_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_limits, "HANDSHAKE_TIMEOUT_S", 0.5)
    certificates = Certificates.make(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificates.server.cert, certificates.server.key)
    runner = web.AppRunner(web.Application())
    await runner.setup()
    try:
        port = await serve(runner, "127.0.0.1", 0, max_connections=10, listener="test", tls=context)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01\x00\xc8\x01")  # the start of a ClientHello, and no more
        # Closed by the server (asyncio's own timeout, 60 s, would outlast the wait).
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await runner.cleanup()
