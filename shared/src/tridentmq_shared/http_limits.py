"""HTTP listeners (health, metrics, management, WebSocket handshakes: all aiohttp) with the two limits aiohttp
does not set by itself: a time within which a connection must send a whole request head, and a cap on
connections open at once. Without them, connections that trickle their headers a byte at a time stay open
for ever (aiohttp's default keep-alive timeout is an hour) and take every file descriptor of the process:
20,000 of them on a gateway's health port and its STOMP clients were refused.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from typing import Final, cast

from aiohttp import ClientConnectionResetError, web
from aiohttp.typedefs import Handler, Middleware

from tridentmq_shared.runtime import LISTEN_BACKLOG
from tridentmq_shared.tls import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("tridentmq.http")

#: The answer of a connection over the cap, written before it is closed.
_BUSY: Final = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
#: Refusals at the cap are logged once per this many seconds, with the count since the last line.
REFUSAL_LOG_SECONDS: Final = 60.0


def http_runner(app: web.Application, *, request_timeout_ms: int) -> web.AppRunner:
    """The runner of ``app``: a connection that has not sent a whole request head ``request_timeout_ms`` after
    it opened, or after its last response, is closed, and so is one whose request body has not all come that
    long after its head. (aiohttp's keep-alive timer runs from the connection's start and closes it only while
    it waits for a request head: a request being handled, a WebSocket after its handshake, are not cut.)"""
    app.middlewares.append(_body_within(request_timeout_ms / 1000))
    # No lingering after an answer that left the body unread (aiohttp reads on for up to 10 s by default): the
    # stalled body's connection goes with its 408.
    return web.AppRunner(app, access_log=None, keepalive_timeout=request_timeout_ms / 1000, lingering_time=0)


def _body_within(timeout_s: float) -> Middleware:
    """Read a request's body before its handler, within ``timeout_s``: a body that stalled kept its connection,
    answered never, and 256 of them (the connection cap) took the port, health probes included. A client that
    leaves in the middle of its body is one log line, not aiohttp's traceback."""

    @web.middleware
    async def body_within(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), timeout_s)  # kept by aiohttp for the handler
            except TimeoutError:
                log.info("http request body not received in time: connection closed", extra=_who(request))
                refused = web.Response(status=408, text="the request body did not come in time")
                refused.force_close()
                return refused
            except (ConnectionError, ClientConnectionResetError):
                log.info("http client left in the middle of its request body", extra=_who(request))
                left = web.Response(status=400)
                left.force_close()
                return left
        return await handler(request)

    return body_within


def _who(request: web.Request) -> dict[str, str]:
    return {"peer": str(request.remote), "path": request.path[:200]}


class _Busy(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # uvloop's transports are not asyncio's classes
        writer.write(_BUSY)
        writer.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol of one connection, counted by its site while the connection is open (aiohttp registers
    a connection only once the event loop calls ``connection_made``, after a whole batch of accepts)."""

    def __init__(self, site: CappedSite, inner: asyncio.Protocol) -> None:
        self.site = site
        self.inner = inner
        site.open += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.open -= 1
        self.inner.connection_lost(exc)


class CappedSite(web.SockSite):
    """A listening socket of ``runner`` that accepts at most ``max_connections`` connections at once; more get
    503 and are closed, and the first refusal of each minute is logged."""

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        *,
        max_connections: int,
        listener: str,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context, backlog=LISTEN_BACKLOG)
        self.max_connections = max_connections
        self.listener = listener  # names the listener in the log line
        self.open = 0  # connections now
        self.refused = 0  # since the last log line
        self._logged_at: float | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (SockSite.start, but our factory)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Counted(self, server()) if self.open < self.max_connections else self._refuse(),
            sock=self._sock,
            ssl=self._ssl_context,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self._ssl_context is not None else None,
            backlog=self._backlog,
        )

    def _refuse(self) -> asyncio.Protocol:
        self.refused += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= REFUSAL_LOG_SECONDS:
            log.warning(
                "http connection refused: too many connections (further refusals counted once a minute)",
                extra={"listener": self.listener, "max_connections": self.max_connections, "refused": self.refused},
            )
            self._logged_at = now
            self.refused = 0
        return _Busy()


async def serve(
    runner: web.AppRunner,
    host: str,
    port: int,
    *,
    max_connections: int,
    listener: str,
    tls: ssl.SSLContext | None = None,
) -> int:
    """Listen on ``host:port`` for ``runner`` with the connection cap; returns the port (``port`` 0: the one the
    system chose)."""
    sock = socket.create_server((host, port))  # bound here: with port 0 that is the only way to learn it
    await CappedSite(runner, sock, max_connections=max_connections, listener=listener, ssl_context=tls).start()
    return int(sock.getsockname()[1])
