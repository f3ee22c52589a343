"""The STOMP gateway's asyncio shell: the TCP and WebSocket listeners, and health and metrics over HTTP.

Each listener wraps its transport as a ``Wire`` and hands bytes to a ``StompSession``; everything else
happens there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from pathlib import Path
from typing import cast

from aiohttp import WSMsgType, web

from tridentmq_shared.runtime import set_nodelay
from tridentmq_stomp.session import Counters, StompSession
from tridentmq_stomp.settings import StompSettings

log = logging.getLogger("tridentmq.stomp")

#: WebSocket subprotocols, best first; a client offering none of them is closed with 1002.
SUBPROTOCOLS = ("v12.stomp", "v11.stomp", "v10.stomp")


class _TcpWire(asyncio.Protocol):
    def __init__(self, gateway: StompGateway) -> None:
        self.gateway = gateway
        self.transport: asyncio.Transport | None = None
        self.session: StompSession | None = None
        self.peer = "?"
        self._writable = asyncio.Event()
        self._writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        if len(self.gateway.sessions) >= self.gateway.settings.listener.max_connections:
            log.warning("stomp connection refused: too many connections", extra={"peer": self.peer})
            self.transport.close()
            return
        set_nodelay(transport)
        self.session = StompSession(self.gateway.settings, self, self.gateway.counters)
        self.gateway.sessions.add(self.session)

    def data_received(self, data: bytes) -> None:
        if self.session is not None:
            self.session.feed(data)

    def eof_received(self) -> bool:
        """The client closed its side: the session answers what it sent (a DISCONNECT's receipt), then closes."""
        if self.session is not None:
            self.session.feed(b"")
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        if self.session is not None:
            self.session.connection_lost()
            self.gateway.sessions.discard(self.session)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # Wire
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    async def drained(self) -> None:
        await self._writable.wait()


class _WebSocketWire:
    """Frames out in order through one writer task; TEXT when the bytes are UTF-8, else BINARY."""

    def __init__(self, ws: web.WebSocketResponse, peer: str) -> None:
        self.ws = ws
        self.peer = peer
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._pending = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._reading = asyncio.Event()
        self._reading.set()
        self._lost = False
        self.writer = asyncio.get_running_loop().create_task(self._write_all())

    async def _write_all(self) -> None:
        try:
            while (data := await self._out.get()) is not None:
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    await self.ws.send_bytes(data)
                else:
                    await self.ws.send_str(text)
                self._pending -= len(data)
                if self._pending < 64 * 1024:
                    self._drained.set()
            await self.ws.close()
        except (ConnectionError, RuntimeError):  # the client went away while we wrote
            self.lost()

    def lost(self) -> None:
        """The WebSocket is gone: nothing more is written, and nobody waits for it to drain."""
        self._lost = True
        self._drained.set()

    def write(self, data: bytes) -> None:
        if self._lost:
            return
        self._pending += len(data)
        if self._pending >= 64 * 1024:
            self._drained.clear()
        self._out.put_nowait(data)

    def close(self) -> None:
        self._out.put_nowait(None)

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    async def drained(self) -> None:
        await self._drained.wait()

    async def reading(self) -> None:
        await self._reading.wait()


class StompGateway:
    def __init__(self, settings: StompSettings, ports_file: Path | None = None) -> None:
        self.settings = settings
        self.ports_file = ports_file
        self.counters = Counters()
        self.sessions: set[StompSession] = set()
        self.ready = False
        self.ports: dict[str, int] = {}
        self._server: asyncio.Server | None = None
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        listener = self.settings.listener
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _TcpWire(self), listener.host, listener.port)
        self.ports["stomp"] = self._server.sockets[0].getsockname()[1]
        if listener.websocket_port >= 0:
            app = web.Application()
            app.router.add_get("/{path:.*}", self._websocket)
            self.ports["websocket"] = await self._serve(app, listener.host, listener.websocket_port)
        http = self.settings.http
        if http.enabled:
            app = web.Application()
            app.router.add_get("/healthz", self._healthz)
            app.router.add_get("/readyz", self._readyz)
            app.router.add_get("/metrics", self._metrics)
            self.ports["http"] = await self._serve(app, http.host, http.port)
        self.ready = True
        if self.ports_file is not None:
            tmp = self.ports_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.ports))
            tmp.replace(self.ports_file)
        log.info("stomp gateway ready", extra={**self.ports, "core": f"{self.settings.core.host}:"
                                               f"{self.settings.core.port}"})  # fmt: skip

    async def _serve(self, app: web.Application, host: str, port: int) -> int:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.create_server((host, port))  # bound here: with port 0 that is the only way to learn it
        await web.SockSite(runner, sock).start()
        self._runners.append(runner)
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        self.ready = False
        if self._server is not None:
            self._server.close()
        sessions = list(self.sessions)
        for session in sessions:
            session.connection_lost()
        if sessions:  # let each close its link, so the core returns their messages at once
            await asyncio.wait([asyncio.ensure_future(s.wait_closed()) for s in sessions], timeout=5)
        for runner in self._runners:
            await runner.cleanup()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    # ------------------------------------------------------------------ WebSocket
    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        chosen = next((p for p in SUBPROTOCOLS if p in offered), None)
        limits = self.settings.stomp  # a message holds a frame: bigger ones are refused (close 1009) unread
        ws = web.WebSocketResponse(protocols=(chosen,) if chosen else (),
                                   max_msg_size=limits.max_frame_bytes + limits.max_header_bytes + 16)  # fmt: skip
        await ws.prepare(request)
        if offered and chosen is None:  # aiohttp would carry on without a subprotocol: refuse instead
            await ws.close(code=1002, message=b"no supported STOMP subprotocol")
            return ws
        peer = f"ws {request.remote}"
        if len(self.sessions) >= self.settings.listener.max_connections:
            await ws.close(code=1013, message=b"too many connections")
            return ws
        wire = _WebSocketWire(ws, peer)
        session = StompSession(self.settings, wire, self.counters)
        self.sessions.add(session)
        try:
            async for msg in ws:
                if msg.type is WSMsgType.TEXT:
                    session.feed(msg.data.encode("utf-8"))
                elif msg.type is WSMsgType.BINARY:
                    session.feed(msg.data)
                else:
                    break
                await wire.reading()
        finally:
            wire.lost()
            session.connection_lost()
            self.sessions.discard(session)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(wire.writer, 5)
        return ws

    # ------------------------------------------------------------------ HTTP
    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        if not self.ready:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ready", **self.ports})

    async def _metrics(self, _request: web.Request) -> web.Response:
        c = self.counters
        families = [
            ("stomp_connections", "gauge", "Open STOMP connections.", len(self.sessions)),
            ("stomp_connections_total", "counter", "STOMP connections accepted.", c.connections_total),
            ("stomp_frames_received_total", "counter", "Client frames received.", c.frames_received),
            ("stomp_messages_published_total", "counter", "SEND frames passed to the core.", c.messages_published),
            ("stomp_messages_delivered_total", "counter", "MESSAGE frames sent.", c.messages_delivered),
            ("stomp_errors_total", "counter", "ERROR frames sent (the connection closed after each).", c.errors),
        ]
        lines = []
        for name, kind, text, value in families:
            lines += [f"# HELP tridentmq_{name} {text}", f"# TYPE tridentmq_{name} {kind}", f"tridentmq_{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")
