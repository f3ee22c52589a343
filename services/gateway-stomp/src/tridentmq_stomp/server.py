"""The STOMP gateway: the shared gateway shell (listeners, HTTP, ports file) around ``StompSession``s."""

from __future__ import annotations

import logging
from pathlib import Path

from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.gateway import ClientSession, GatewayShell, Metric, ShellConfig, Wire, listener_tls
from tridentmq_stomp.session import Counters, StompSession
from tridentmq_stomp.settings import StompSettings

log = logging.getLogger("tridentmq.stomp")

#: WebSocket subprotocols, best first; a client offering only others is closed with 1002 (stomp.py offers none).
SUBPROTOCOLS = ("v12.stomp", "v11.stomp", "v10.stomp")


class StompGateway:
    def __init__(self, settings: StompSettings, ports_file: Path | None = None) -> None:
        self.settings = settings
        self.counters = Counters()
        # Its sessions' links use it.
        self.core_links = CoreLinks.for_gateway(settings.core, name=settings.node.name, tls=settings.tls)
        listener, limits, http = settings.listener, settings.stomp, settings.http
        config = ShellConfig(
            protocol="stomp",
            host=listener.host,
            port=listener.port,
            websocket_port=listener.websocket_port,
            max_connections=listener.max_connections,
            max_logging_in=listener.max_logging_in,
            close_timeout_ms=listener.close_timeout_ms,
            drain_ms=listener.drain_ms,
            subprotocols=SUBPROTOCOLS,
            subprotocol_required=False,
            max_websocket_message=limits.max_frame_bytes + limits.max_header_bytes + 16,  # a message holds a frame
            binary_frames=False,
            http_enabled=http.enabled,
            http_host=http.host,
            http_port=http.port,
            tls=listener_tls(settings.tls, listener.tls_port, listener.websocket_tls_port, http_tls=http.tls),
            tls_port=listener.tls_port,
            websocket_tls_port=listener.websocket_tls_port,
            http_tls=http.tls,
            http_allowed_hosts=tuple(http.allowed_hosts),
            http_request_timeout_ms=http.request_timeout_ms,
            http_max_connections=http.max_connections,
        )
        self.shell = GatewayShell(
            config, self._open_session, self._metrics, self.core_links.reachable, ports_file=ports_file
        )

    @property
    def ports(self) -> dict[str, int]:
        return self.shell.ports

    def _open_session(self, wire: Wire) -> ClientSession:
        return StompSession(self.settings, self.core_links, wire, self.counters)

    async def start(self) -> None:
        self.core_links.start()
        await self.shell.start()
        core = self.settings.core
        log.info("stomp gateway ready", extra={**self.ports, "core": f"{core.host}:{core.port}"})

    async def stop(self) -> None:
        await self.shell.stop(lambda session: session.connection_lost())
        await self.core_links.stop()

    def _metrics(self) -> list[Metric]:
        c = self.counters
        return [
            Metric("stomp_connections", "gauge", "Open STOMP connections.", len(self.shell.sessions)),
            Metric("stomp_connections_total", "counter", "STOMP connections accepted.", c.connections_total),
            Metric("stomp_frames_received_total", "counter", "Client frames received.", c.frames_received),
            Metric(
                "stomp_messages_published_total", "counter", "SEND frames passed to the core.", c.messages_published
            ),
            Metric("stomp_messages_delivered_total", "counter", "MESSAGE frames sent.", c.messages_delivered),
            Metric("stomp_errors_total", "counter", "ERROR frames sent (the connection closed after each).", c.errors),
        ]
