"""The AMQP 1.0 gateway: the shared gateway shell (listeners, HTTP, ports file) around ``AmqpSession``s."""

from __future__ import annotations

import logging
from pathlib import Path

from tridentmq_amqp.session import AmqpSession, Counters
from tridentmq_amqp.settings import AmqpSettings
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.gateway import ClientSession, GatewayShell, Metric, ShellConfig, Wire, listener_tls

log = logging.getLogger("tridentmq.amqp")

SUBPROTOCOLS = ("amqp",)  # AMQP over WebSocket; a client not offering it is closed with 1002


class AmqpGateway:
    def __init__(self, settings: AmqpSettings, ports_file: Path | None = None) -> None:
        self.settings = settings
        self.counters = Counters()
        # Its sessions' links use it.
        self.core_links = CoreLinks.for_gateway(settings.core, name=settings.node.name, tls=settings.tls)
        listener, limits, http = settings.listener, settings.amqp, settings.http
        config = ShellConfig(
            protocol="amqp",
            host=listener.host,
            port=listener.port,
            websocket_port=listener.websocket_port,
            max_connections=listener.max_connections,
            max_logging_in=listener.max_logging_in,
            close_timeout_ms=listener.close_timeout_ms,
            drain_ms=listener.drain_ms,
            subprotocols=SUBPROTOCOLS,
            subprotocol_required=True,
            max_websocket_message=max(limits.max_frame_bytes, limits.max_message_bytes) + 1024,
            binary_frames=True,
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
        return AmqpSession(self.settings, self.core_links, wire, self.counters)

    async def start(self) -> None:
        self.core_links.start()
        await self.shell.start()
        core = self.settings.core
        log.info("amqp gateway ready", extra={**self.ports, "core": f"{core.host}:{core.port}"})

    async def stop(self) -> None:
        await self.shell.stop(_shut_down)
        await self.core_links.stop()

    def _metrics(self) -> list[Metric]:
        c = self.counters
        return [
            Metric("amqp_connections", "gauge", "Open AMQP connections.", len(self.shell.sessions)),
            Metric("amqp_connections_total", "counter", "AMQP connections accepted.", c.connections_total),
            Metric("amqp_connections_refused_total", "counter", "Connections refused by SASL or the core.", c.refused),
            Metric("amqp_messages_published_total", "counter", "Transfers passed to the core.", c.messages_published),
            Metric("amqp_messages_delivered_total", "counter", "Transfers sent to clients.", c.messages_delivered),
            Metric(
                "amqp_protocol_errors_total", "counter", "Connections closed for a protocol error.", c.protocol_errors
            ),
        ]


def _shut_down(session: ClientSession) -> None:
    assert isinstance(session, AmqpSession)
    session.shutdown()
