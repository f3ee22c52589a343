"""The asyncio shell every gateway shares: TCP and WebSocket listeners handing bytes to protocol sessions,
health and metrics over HTTP, and the ports file.

A listener wraps each client transport as a ``Wire`` and asks the gateway for a ``ClientSession`` on it;
from then on the session does everything (codec, link to the core) and the listener only feeds it bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast
from urllib.parse import urlsplit

from aiohttp import WSMsgType, web

from tridentmq_shared.http_hosts import HostCheck, host_check_middleware
from tridentmq_shared.http_limits import http_runner, serve
from tridentmq_shared.light_event import LightEvent
from tridentmq_shared.log_window import FloodLog
from tridentmq_shared.logs import setup_logging
from tridentmq_shared.loopback import is_loopback
from tridentmq_shared.runtime import LISTEN_BACKLOG, EndedSessions, run_main
from tridentmq_shared.settings import SettingsError, doc, load_settings
from tridentmq_shared.supervision import EXIT_TASK_FAILED, Supervisor, cannot_start, current, install
from tridentmq_shared.tls import HANDSHAKE_TIMEOUT_S, ServerTls, TlsSection, peer_common_name
from tridentmq_shared.turn_pacer import TurnPacer

log = logging.getLogger("tridentmq.gateway")

#: A WebSocket message written ahead of the client's reading above this many bytes makes writers wait.
_WS_HIGH_WATER = 64 * 1024
#: How long /readyz trusts its last look at the core (load balancers ask every few seconds, per replica).
CORE_CHECK_SECONDS = 1.0
#: Longest wait between two looks at the core while a gateway waits for it to open its client ports.
CORE_WAIT_MAX_SECONDS = 2.0
#: Clients' ends of stream a gateway handles per turn of its event loop; the rest wait for the turns after. Each
#: sets off its session's clean-up (about 100 µs of the gateway's CPU, with the core's answers); 15,000 clients that
#: left together once ended in one turn and held the loop, and the core link's heartbeat with it, for 0.6 s.
DEPARTURES_PER_TURN = 100


class Wire(Protocol):
    """The client's transport (TCP or WebSocket), as a session sees it."""

    peer: str  # for logs
    host: str  # the client's IP address, which the core checks ("?" when unknown: not loopback)
    #: The common name of the client certificate the TLS handshake verified (None: no TLS or no certificate).
    certificate_name: str | None

    def write(self, data: bytes) -> None: ...
    def close(self) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    async def drained(self) -> None: ...
    def writable(self) -> bool:
        """Whether the client reads what is written: false until ``drained`` returns."""

    def buffered(self) -> int:
        """Bytes written and not yet taken by the operating system."""

    def logged_in(self) -> None:
        """The client has logged in: it no longer counts against ``max_logging_in``."""


class ClientSession(Protocol):
    """One client connection's protocol session, as the listeners drive it."""

    def feed(self, data: bytes) -> None:
        """Bytes from the client; ``b""`` when it closed its side."""

    def connection_lost(self) -> None: ...
    async def wait_closed(self) -> None: ...


@dataclass(frozen=True)
class Metric:
    name: str  # without the ``tridentmq_`` prefix
    kind: str  # gauge or counter
    help: str
    value: int


#: A connection's end waits this long at most for the client to read what is left to write (``close_timeout_ms``).
CLOSE_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class ListenerSettings:
    """The fields every gateway's ``[listener]`` section has (each gateway's section derives from this one)."""

    close_timeout_ms: int = doc(
        CLOSE_TIMEOUT_MS,
        "When a connection ends (the client's DISCONNECT or close answered, its half-close answered, an error "
        "sent), what is left to write to the client must be written within this; a client that does not read "
        "it is cut off then (logged), so its connection and what the gateway holds for it go "
        "(0 = wait for ever).",
        least=0,
    )
    drain_ms: int = doc(
        0,
        "On a stop signal, how long the gateway keeps its clients' connections while it refuses new ones and "
        "/readyz answers 503, before it ends them: a load balancer that checks /readyz marks it down meanwhile, "
        "so its clients reconnect to the other replicas rather than to this one as it goes (or to its address "
        "once gone, where a connect waits for the balancer's timeout). 0: end them at once. The Compose files "
        "set 3000 (HAProxy checks every second and marks a replica down after two failures); in Kubernetes, "
        "more than the readiness probe's period times its failure threshold.",
        least=0,
    )


@dataclass(frozen=True)
class ShellConfig:
    """What the shell needs to know of a gateway's settings."""

    protocol: str  # "stomp", "mqtt", ...: the key of the client port in the ports file, and in logs
    host: str
    port: int  # -1: no cleartext TCP listener
    websocket_port: int  # -1: no WebSocket listener
    max_connections: int
    subprotocols: tuple[str, ...]  # WebSocket subprotocols, best first
    subprotocol_required: bool  # a client offering none of them is closed with 1002 (else only one offering others)
    max_websocket_message: int
    binary_frames: bool  # BINARY frames only: TEXT ones are refused (1003); else TEXT out when the bytes are UTF-8
    http_enabled: bool
    http_host: str
    http_port: int
    tls: ServerTls | None = None  # the TLS listeners' certificates (None: no TLS listener)
    tls_port: int = -1  # the protocol over TLS (-1: none)
    websocket_tls_port: int = -1  # the protocol over WebSocket over TLS (-1: none)
    http_tls: bool = False  # HTTPS instead of HTTP
    http_allowed_hosts: tuple[str, ...] = ()  # Host names allowed besides loopback ones (see http_hosts.py)
    http_request_timeout_ms: int = 10_000  # HTTP and WebSocket handshakes: a whole request head within this
    http_max_connections: int = 256  # HTTP connections at once (the WebSocket listeners take ``max_connections``)
    max_logging_in: int = 1000  # connections at once that have not logged in yet; more are refused
    close_timeout_ms: int = CLOSE_TIMEOUT_MS  # a closed connection's last bytes are written within this, or cut off
    drain_ms: int = 0  # on stop, sessions are kept this long, while new connections are refused and /readyz fails


def listener_tls(tls: TlsSection, *ports: int, http_tls: bool = False) -> ServerTls | None:
    """The TLS context of a gateway's listeners: made when certificates are configured and a TLS listener is
    wanted (a TLS port >= 0 or HTTPS); HTTPS without certificates is a SettingsError."""
    if http_tls and not tls.configured:
        raise SettingsError("http.tls needs a certificate: set tls.cert_file")
    if not tls.configured or (not http_tls and all(port < 0 for port in ports)):
        tls.check()
        return None
    return ServerTls(tls)


class _TcpWire(asyncio.Protocol):
    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = (
        "_close_timer",
        "_lost",
        "_writable",
        "certificate_name",
        "host",
        "peer",
        "session",
        "shell",
        "transport",
    )

    def __init__(self, shell: GatewayShell) -> None:
        self.shell = shell
        self.transport: asyncio.Transport | None = None
        self.session: ClientSession | None = None
        self.peer = "?"
        self.certificate_name: str | None = None
        self.host = "?"
        self._writable = LightEvent(is_set=True)
        self._close_timer: asyncio.TimerHandle | None = None
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.certificate_name = peer_common_name(transport)
        self.host = str(peer[0]) if peer else "?"
        if len(self.shell.sessions) >= self.shell.config.max_connections:
            log.warning(
                "connection refused: too many connections",
                extra={"peer": self.peer, "protocol": self.shell.config.protocol},
            )
            self.transport.close()
            return
        if not self.shell.admit_login(self, self.peer):
            self.transport.close()
            return
        self.session = self.shell.open_session(self)
        self.shell.sessions.add(self.session)

    def data_received(self, data: bytes) -> None:
        if self.session is not None:
            self.session.feed(data)

    def eof_received(self) -> bool:
        """The client closed its side: the session answers what it sent, then closes (over TLS, which has no
        half-close, the transport closes now)."""
        if self.session is not None:
            self.shell.departures.call_soon(self.session.feed, b"")
        return self.transport is None or self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        self._writable.set()
        self.shell.logging_in.discard(self)
        if self.session is not None:
            # At once, not paced as an end of stream is: the session must know before anything woken above runs
            # that nothing more reaches the client (what it wrote would count as delivered).
            self.session.connection_lost()
            self.shell.sessions.discard(self.session)
            self.shell.ended.ended(self.session, len(self.shell.sessions))
            # The session keeps this wire; a reference back would make a cycle that only the (rarely run)
            # cyclic collector frees, with everything the session holds.
            self.session = None

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # Wire
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        """Close once what was written is taken by the operating system; a client that does not read it within
        ``close_timeout_ms`` is cut off (asyncio alone would keep the connection, and its buffers, for ever)."""
        transport = self.transport
        if transport is None or self._lost:
            return
        transport.close()
        timeout = self.shell.config.close_timeout_ms
        if self._close_timer is None and timeout > 0 and transport.get_write_buffer_size():
            self._close_timer = asyncio.get_running_loop().call_later(timeout / 1000, self._close_overdue)

    def _close_overdue(self) -> None:
        self._close_timer = None
        transport = self.transport
        if transport is None or self._lost:
            return
        _log_cut_off(self.peer, self.shell.config, transport.get_write_buffer_size())
        transport.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    async def drained(self) -> None:
        await self._writable.wait()

    def writable(self) -> bool:
        return self._writable.is_set()

    def buffered(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def logged_in(self) -> None:
        self.shell.logging_in.discard(self)


def _log_cut_off(peer: str, config: ShellConfig, unwritten: int) -> None:
    log.warning(
        "connection cut off: the client did not read what was left to write within the close timeout",
        extra={
            "peer": peer,
            "protocol": config.protocol,
            "unwritten_bytes": unwritten,
            "close_timeout_ms": config.close_timeout_ms,
        },
    )


#: A client offering only subprotocols the gateway does not speak: one line a minute, with a count.
subprotocol_refused_log = FloodLog(60.0, log, logging.INFO, "more WebSocket clients refused: no supported subprotocol")


class _NoOverlapWarning(logging.Filter):
    """aiohttp's own WARNING for such a client, at every handshake: the line above says it, once a minute."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "overlap server-known ones" not in str(record.msg)


logging.getLogger("aiohttp.websocket").addFilter(_NoOverlapWarning())


class _WebSocketWire:
    """Frames out in order through one writer task."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        peer: str,
        host: str,
        *,
        binary: bool,
        certificate_name: str | None,
        logging_in: set[object],
        transport: asyncio.Transport | None = None,
        config: ShellConfig | None = None,
    ) -> None:
        self.ws = ws
        self._transport = transport  # the TCP (or TLS) connection under the WebSocket: cut off at a close overdue
        self._config = config
        self._close_timer: asyncio.TimerHandle | None = None
        self._logging_in = logging_in  # the shell's, which holds this wire until the client logged in
        self.peer = peer
        self.host = host
        self.certificate_name = certificate_name
        self.binary = binary
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._pending = 0
        self._drained = LightEvent(is_set=True)
        self._reading = LightEvent(is_set=True)
        self._lost = False
        self.writer = asyncio.get_running_loop().create_task(self._write_all())

    async def _write_all(self) -> None:
        try:
            while (data := await self._out.get()) is not None:
                await self._send(data)
                self._pending -= len(data)
                if self._pending < _WS_HIGH_WATER:
                    self._drained.set()
            await self.ws.close()
        except (ConnectionError, RuntimeError):  # the client went away while we wrote
            self.lost()

    async def _send(self, data: bytes) -> None:
        if self.binary:
            await self.ws.send_bytes(data)
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            await self.ws.send_bytes(data)
        else:
            await self.ws.send_str(text)

    def lost(self) -> None:
        """The WebSocket is gone: nothing more is written, and nobody waits for it to drain."""
        self._lost = True
        self._drained.set()
        self._writer_done()

    def _writer_done(self, _task: object = None) -> None:
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None

    def write(self, data: bytes) -> None:
        if self._lost:
            return
        self._pending += len(data)
        if self._pending >= _WS_HIGH_WATER:
            self._drained.clear()
        self._out.put_nowait(data)

    def close(self) -> None:
        """The writer sends what is queued, then the close frame; a client that does not read them within
        ``close_timeout_ms`` is cut off (the writer, waiting for it, would keep the connection for ever)."""
        self._out.put_nowait(None)
        self._reading.set()  # a session that paused reading and ended must not leave the reader waiting for ever
        config = self._config
        timeout = config.close_timeout_ms if config is not None else 0
        if self._close_timer is None and timeout > 0 and not self._lost and not self.writer.done():
            self._close_timer = asyncio.get_running_loop().call_later(timeout / 1000, self._close_overdue)
            self.writer.add_done_callback(self._writer_done)

    def _close_overdue(self) -> None:
        self._close_timer = None
        transport = self._transport
        if self._lost or self.writer.done() or self._config is None:
            return
        _log_cut_off(self.peer, self._config, self._pending)
        if transport is not None:
            transport.abort()  # the reader sees the end, and the writer's wait for the client fails
        self.writer.cancel()

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    async def drained(self) -> None:
        await self._drained.wait()

    def writable(self) -> bool:
        return self._drained.is_set()

    def buffered(self) -> int:
        return self._pending

    def logged_in(self) -> None:
        self._logging_in.discard(self)

    async def reading(self) -> None:
        await self._reading.wait()


async def _always() -> bool:
    return True


class GatewayShell:
    """Listeners, HTTP and the ports file of one gateway; ``open_session`` makes the protocol session of a
    new client connection, ``metrics`` lists what /metrics shows, ``core_ready`` says whether the core
    answers (the client ports open once it does, and /readyz is green only while it does)."""

    def __init__(
        self,
        config: ShellConfig,
        open_session: Callable[[Wire], ClientSession],
        metrics: Callable[[], list[Metric]],
        core_ready: Callable[[], Awaitable[bool]] = _always,
        ports_file: Path | None = None,
    ) -> None:
        self.config = config
        self.open_session = open_session
        self.metrics = metrics
        self.core_ready = core_ready
        self.ports_file = ports_file
        self.sessions: set[ClientSession] = set()
        self.ended = EndedSessions()  # collects the garbage of sessions that ended
        self.departures = TurnPacer(DEPARTURES_PER_TURN, log)  # clients' ends of stream
        self.logging_in: set[object] = set()  # the wires of connections that have not logged in yet
        self._login_refusal_logged: float | None = None
        self.started = False
        self.stopping = False
        self.ports: dict[str, int] = {}
        self._servers: list[asyncio.Server] = []
        self._runners: list[web.AppRunner] = []
        self._core_seen: tuple[float, bool] = (-CORE_CHECK_SECONDS, False)  # (when, answer) of the last look
        self._core_looking: asyncio.Task[bool] | None = None

    async def start(self) -> None:
        """HTTP first (/healthz answers, /readyz says "starting"), then, once the core answers, the client
        ports: a client connecting earlier would be refused for nothing it did."""
        config = self.config
        loop = asyncio.get_running_loop()
        tls = config.tls.context if config.tls is not None else None
        if config.http_enabled:
            hosts = HostCheck((*config.http_allowed_hosts, config.http_host))
            app = web.Application(middlewares=[host_check_middleware(hosts, "http.allowed_hosts")])
            app.router.add_get("/healthz", self._healthz)
            app.router.add_get("/readyz", self._readyz)
            app.router.add_get("/metrics", self._metrics)
            runner = http_runner(app, request_timeout_ms=config.http_request_timeout_ms)
            await runner.setup()
            self._runners.append(runner)
            self.ports["http"] = await serve(
                runner,
                config.http_host,
                config.http_port,
                tls=tls if config.http_tls else None,
                max_connections=config.http_max_connections,
                listener="http",
            )
        await self._wait_for_core()
        if config.port >= 0:
            server = await loop.create_server(lambda: _TcpWire(self), config.host, config.port, backlog=LISTEN_BACKLOG)
            self._servers.append(server)
            self.ports[config.protocol] = server.sockets[0].getsockname()[1]
        if tls is not None and config.tls_port >= 0:
            server = await loop.create_server(
                lambda: _TcpWire(self),
                config.host,
                config.tls_port,
                ssl=tls,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
                backlog=LISTEN_BACKLOG,
            )
            self._servers.append(server)
            self.ports[f"{config.protocol}_tls"] = server.sockets[0].getsockname()[1]
        if config.websocket_port >= 0 or (tls is not None and config.websocket_tls_port >= 0):
            self._websocket_hosts = HostCheck((*config.http_allowed_hosts, config.host))
            app = web.Application()
            app.router.add_get("/{path:.*}", self._websocket)
            runner = http_runner(app, request_timeout_ms=config.http_request_timeout_ms)
            await runner.setup()
            self._runners.append(runner)
            cap = config.max_connections
            if config.websocket_port >= 0:
                self.ports["websocket"] = await serve(
                    runner, config.host, config.websocket_port, max_connections=cap, listener="websocket"
                )
            if tls is not None and config.websocket_tls_port >= 0:
                self.ports["websocket_tls"] = await serve(
                    runner,
                    config.host,
                    config.websocket_tls_port,
                    tls=tls,
                    max_connections=cap,
                    listener="websocket_tls",
                )
        self.started = True
        if self.ports_file is not None:
            tmp = self.ports_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.ports))
            tmp.replace(self.ports_file)

    async def _wait_for_core(self) -> None:
        delay = 0.1
        warned = False
        while not await self.core_answers():
            if not warned:
                log.warning(
                    "waiting for the core before opening the client ports", extra={"protocol": self.config.protocol}
                )
                warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, CORE_WAIT_MAX_SECONDS)
        if warned:
            log.info("core reachable: opening the client ports", extra={"protocol": self.config.protocol})

    async def core_answers(self) -> bool:
        """``core_ready``, asked at most once per ``CORE_CHECK_SECONDS`` (concurrent askers share one look)."""
        when, answer = self._core_seen
        if time.monotonic() - when < CORE_CHECK_SECONDS:
            return answer
        if self._core_looking is None or self._core_looking.done():
            self._core_looking = asyncio.ensure_future(self.core_ready())
        answer = await asyncio.shield(self._core_looking)
        self._core_seen = (time.monotonic(), answer)
        return answer

    async def stop(self, end_session: Callable[[ClientSession], None]) -> None:
        """Stop listening, end every session with ``end_session`` (after ``drain_ms``) and wait (5 s at most)
        for them to close their links, so that the core returns their messages at once."""
        self.started = False  # /readyz: 503
        self.stopping = True  # WebSocket upgrades are refused
        for server in self._servers:
            server.close()
        drain_ms = self.config.drain_ms
        if drain_ms > 0 and self.sessions:
            log.info(
                "draining: new connections refused, the clients' connections end after the drain",
                extra={"protocol": self.config.protocol, "sessions": len(self.sessions), "drain_ms": drain_ms},
            )
            await asyncio.sleep(drain_ms / 1000)
        sessions = list(self.sessions)
        for session in sessions:
            end_session(session)
        if sessions:
            await asyncio.wait([asyncio.ensure_future(s.wait_closed()) for s in sessions], timeout=5)
        for runner in self._runners:
            await runner.cleanup()
        for server in self._servers:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5)

    def admit_login(self, wire: object, peer: str) -> bool:
        """Count ``wire`` among the connections logging in, or refuse it when there are ``max_logging_in``
        already (what each may send before login is bounded; their number is bounded here). The first
        refusal of each minute is logged."""
        if len(self.logging_in) >= self.config.max_logging_in:
            now = time.monotonic()
            if self._login_refusal_logged is None or now - self._login_refusal_logged >= 60:
                self._login_refusal_logged = now
                log.warning(
                    "connection refused: too many connections logging in (further refusals not logged for a minute)",
                    extra={
                        "peer": peer,
                        "protocol": self.config.protocol,
                        "max_logging_in": self.config.max_logging_in,
                    },
                )
            return False
        self.logging_in.add(wire)
        return True

    # ------------------------------------------------------------------ WebSocket
    def _page_refusal(self, request: web.Request) -> web.Response | None:
        """Why a WebSocket handshake from this host is refused, when it looks like a web page of another site: a
        browser here is a loopback client, trusted with every right while no users are configured, and lends
        that trust to any page it shows. A page of another site names it in ``Origin``; one that pointed its own
        name at 127.0.0.1 (DNS rebinding) names that in ``Host``. Clients of other hosts get no such trust."""
        if not is_loopback(request.remote):
            return None
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        local = sockname[0] if isinstance(sockname, tuple) and sockname else None
        host, origin = request.headers.get("Host"), request.headers.get("Origin")
        if self._websocket_hosts.allows(host, local):
            if origin is None or self._websocket_hosts.allows(urlsplit(origin).netloc, local):
                return None
            status, what = 403, f"origin {origin!a}"
        else:
            status, what = 421, f"host {host!a}"
        log.warning(
            "WebSocket handshake refused: a web page of another site", extra={"what": what, "peer": request.remote}
        )
        return web.json_response({"error": f"{what} is not allowed here (add it to http.allowed_hosts)"}, status=status)

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        config = self.config
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        chosen = next((p for p in config.subprotocols if p in offered), None)
        refusal = self._page_refusal(request)
        if refusal is not None:
            return refusal
        # A message bigger than the limit is refused (close 1009) without being read whole. No permessage-deflate,
        # which browsers offer: its compressor and decompressor cost about 100 KB per connection.
        ws = web.WebSocketResponse(
            protocols=(chosen,) if chosen else (), max_msg_size=config.max_websocket_message, compress=False
        )
        await ws.prepare(request)
        if chosen is None and (offered or config.subprotocol_required):
            # aiohttp would carry on without a subprotocol: refuse instead.
            if subprotocol_refused_log.first():
                log.info(
                    "WebSocket client refused: no supported subprotocol",
                    extra={"peer": request.remote, "offered": ascii(offered[:4])[:200], "protocol": config.protocol},
                )
            await ws.close(code=1002, message=f"no supported {config.protocol} subprotocol".encode())
            return ws
        peer = f"ws {request.remote}"
        if self.stopping:  # its clients go to another replica
            await ws.close(code=1001, message=b"the gateway is stopping")
            return ws
        if len(self.sessions) >= config.max_connections:
            await ws.close(code=1013, message=b"too many connections")
            return ws
        transport = request.transport
        certificate_name = peer_common_name(transport) if transport is not None else None
        wire = _WebSocketWire(
            ws,
            peer,
            request.remote or "?",
            binary=config.binary_frames,
            certificate_name=certificate_name,
            logging_in=self.logging_in,
            transport=transport,
            config=config,
        )
        if not self.admit_login(wire, peer):
            wire.writer.cancel()  # nothing was queued: the close below is the only frame
            await ws.close(code=1013, message=b"too many connections logging in")
            return ws
        session = self.open_session(wire)
        self.sessions.add(session)
        try:
            async for msg in ws:
                if msg.type is WSMsgType.BINARY:
                    session.feed(msg.data)
                elif msg.type is WSMsgType.TEXT and not config.binary_frames:
                    session.feed(msg.data.encode("utf-8"))
                elif msg.type is WSMsgType.TEXT:
                    log.info("text frame refused", extra={"peer": peer, "protocol": config.protocol})
                    await ws.close(code=1003, message=b"binary frames only")
                    break
                else:
                    break
                await wire.reading()
        finally:
            wire.lost()
            self.logging_in.discard(wire)
            session.connection_lost()  # at once, as a TCP connection's
            self.sessions.discard(session)
            self.ended.ended(session, len(self.sessions))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(wire.writer, 5)
        return ws

    # ------------------------------------------------------------------ HTTP
    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        failure = current().failure
        if failure is not None:  # a background task failed: the process is stopping
            return web.json_response({"status": "failed", "reason": failure}, status=503)
        if not self.started:
            return web.json_response({"status": "starting"}, status=503)
        if not await self.core_answers():
            return web.json_response({"status": "unavailable", "reason": "core unreachable"}, status=503)
        return web.json_response({"status": "ready", **self.ports})

    async def _metrics(self, _request: web.Request) -> web.Response:
        lines = []
        for m in self.metrics():
            name = f"tridentmq_{m.name}"
            lines += [f"# HELP {name} {m.help}", f"# TYPE {name} {m.kind}", f"{name} {m.value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


# ---------------------------------------------------------------------------------------------- entry point
class Gateway(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class _NodeSection(Protocol):
    @property
    def log_level(self) -> str: ...


class GatewaySettings(Protocol):
    @property
    def node(self) -> _NodeSection: ...


S = TypeVar("S", bound=GatewaySettings)


def run_gateway(
    protocol: str,
    settings_class: type[S],
    env_prefix: str,
    make: Callable[[S, Path | None], Gateway],
    argv: list[str] | None = None,
) -> None:
    """The ``main`` of ``tridentmq-<protocol>``: read the settings (``--config`` file, then environment), run
    the gateway ``make`` builds until SIGINT or SIGTERM, then stop it."""
    prog = f"tridentmq-{protocol}"
    parser = argparse.ArgumentParser(prog=prog, description=f"Run a TridentMQ {protocol.upper()} gateway.")
    parser.add_argument("--config", type=Path, help="TOML settings file (see docs/configuration.md)")
    parser.add_argument("--ports-file", type=Path, help="write the bound ports here as JSON once ready")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(settings_class, prefix=env_prefix, file=args.config, env=os.environ)
    except SettingsError as exc:
        cannot_start(prog, exc)
    setup_logging(settings.node.log_level)
    supervisor = Supervisor()
    install(supervisor)  # before the gateway exists: its parts supervise their tasks with it
    try:
        gateway = make(settings, args.ports_file)
    except SettingsError as exc:  # a value the loader cannot check alone (a malformed connector, say)
        cannot_start(prog, exc)
    try:
        code = run_main(_serve(gateway, supervisor))
    except OSError as exc:  # a port in use, a certificate that cannot be read
        cannot_start(prog, exc)
    if code:
        sys.exit(code)


#: How long a stop after a failed task may take before the process exits anyway.
STOP_TIMEOUT = 30.0


async def _serve(gateway: Gateway, supervisor: Supervisor) -> int:
    """Serve until a signal (exit status 0) or until a background task fails (``EXIT_TASK_FAILED``)."""
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled.set)
    failed = asyncio.ensure_future(supervisor.wait_failed())  # a failure during the start counts too
    stop = asyncio.ensure_future(signalled.wait())
    starting = asyncio.ensure_future(gateway.start())  # waits for the core: a signal meanwhile stops it
    await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    else:
        starting.result()
    await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if failed.done():
        code = EXIT_TASK_FAILED
        log.critical("stopping: a background task failed", extra={"reason": failed.result()})
    else:
        log.info("stopping on signal")
    for waiting in (stop, failed):
        waiting.cancel()
    try:
        await (asyncio.wait_for(gateway.stop(), STOP_TIMEOUT) if code else gateway.stop())
    except Exception:
        log.exception("the gateway did not stop cleanly")
        code = code or EXIT_TASK_FAILED
    return code
