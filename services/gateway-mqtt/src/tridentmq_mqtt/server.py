"""The MQTT gateway: the shared gateway shell (listeners, HTTP, ports file) around ``MqttSession``s, and the
gateway's own link to the core (``state.Registry``)."""

from __future__ import annotations

import logging
from pathlib import Path

from tridentmq_mqtt.feeds import Feeds
from tridentmq_mqtt.session import Counters, MqttSession
from tridentmq_mqtt.settings import MqttSettings
from tridentmq_mqtt.state import Registry
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.gateway import ClientSession, GatewayShell, Metric, ShellConfig, Wire, listener_tls
from tridentmq_shared.link.errors import LinkRequestError

log = logging.getLogger("tridentmq.mqtt")

# MQTT 3.1.1 and 5.0 over WebSocket, and 3.1 (Paho JavaScript offers "mqttv3.1" to a 3.1 server, and Mosquitto
# and EMQX take it); a client offering neither is closed with 1002.
SUBPROTOCOLS = ("mqtt", "mqttv3.1")


class MqttGateway:
    def __init__(self, settings: MqttSettings, ports_file: Path | None = None) -> None:
        self.settings = settings
        self.counters = Counters()
        core = settings.core
        # Its sessions' links and the registry's use it.
        self.core_links = CoreLinks.for_gateway(core, name=settings.node.name, tls=settings.tls)
        self.registry = Registry(self.core_links, core.user, core.password, settings.node.name)
        self.registry.on_lost.append(self._service_link_lost)
        limits = settings.mqtt
        self.feeds = Feeds(
            self.core_links, core, settings.node.name, limits.qos0_window, limits.qos0_fan_out_from, self._delivered
        )
        listener, http = settings.listener, settings.http
        config = ShellConfig(
            protocol="mqtt",
            host=listener.host,
            port=listener.port,
            websocket_port=listener.websocket_port,
            max_connections=listener.max_connections,
            max_logging_in=listener.max_logging_in,
            close_timeout_ms=listener.close_timeout_ms,
            drain_ms=listener.drain_ms,
            subprotocols=SUBPROTOCOLS,
            subprotocol_required=True,
            # The packet size limit is the codec's, per MQTT packet: a WebSocket message may hold several packets
            # ([MQTT-6.0.0-2]), as many as the gateway reads ahead of a TCP client (``pending_bytes``, then it
            # stops reading), or one whole packet if that is larger; only a larger message is refused (1009)
            # unread (aiohttp reads a message whole: this bounds what a connection not logged in can make us hold).
            max_websocket_message=max(settings.mqtt.max_packet_bytes, settings.mqtt.pending_bytes) + 8,
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
        self.shell = GatewayShell(config, self._open_session, self._metrics, self._core_ready, ports_file=ports_file)

    @property
    def ports(self) -> dict[str, int]:
        return self.shell.ports

    def _open_session(self, wire: Wire) -> ClientSession:
        return MqttSession(self.settings, self.core_links, self.registry, wire, self.counters, self.feeds)

    def _delivered(self, count: int) -> None:
        self.counters.messages_delivered += count

    async def _core_ready(self) -> bool:
        """The gateway serves when its service link is up: opened here (again), so that it comes back with
        the core even before a client asks for it. A link being resumed is not up: a session would wait."""
        try:
            link = await self.registry.link()
        except (LinkRequestError, OSError, TimeoutError):  # clients are refused (0x88) until the core is back
            return False
        return link.connected

    async def start(self) -> None:
        self.core_links.start()
        await self.shell.start()
        core = self.settings.core
        log.info("mqtt gateway ready", extra={**self.ports, "core": f"{core.host}:{core.port}"})

    async def stop(self) -> None:
        await self.shell.stop(_shut_down)
        await self.feeds.stop()
        await self.registry.close()
        await self.core_links.stop()

    def _service_link_lost(self) -> None:
        """Every session's lock went with the link: end them all (their clients reconnect)."""
        for session in list(self.shell.sessions):
            _shut_down(session, unavailable=True)

    def _metrics(self) -> list[Metric]:
        c = self.counters
        return [
            Metric("mqtt_connections", "gauge", "Open MQTT connections.", len(self.shell.sessions)),
            Metric("mqtt_connections_total", "counter", "MQTT connections accepted.", c.connections_total),
            Metric("mqtt_connections_refused_total", "counter", "CONNECTs refused.", c.refused),
            Metric(
                "mqtt_session_takeovers_total",
                "counter",
                "Connections ended by a later connection with the same client id.",
                c.takeovers,
            ),
            Metric("mqtt_packets_received_total", "counter", "Client packets received.", c.packets_received),
            Metric(
                "mqtt_messages_published_total", "counter", "PUBLISH packets passed to the core.", c.messages_published
            ),
            Metric("mqtt_messages_delivered_total", "counter", "Messages sent to subscribers.", c.messages_delivered),
            Metric(
                "mqtt_protocol_errors_total", "counter", "Connections closed for a protocol error.", c.protocol_errors
            ),
            Metric(
                "mqtt_qos0_dropped_total",
                "counter",
                "QoS 0 messages of a fan-out skipped for a connection that fell behind (mqtt.qos0_max_buffered_bytes).",
                c.qos0_dropped,
            ),
            Metric(
                "mqtt_fanout_feeds",
                "gauge",
                "Topic filters fanned out to QoS 0 subscribers by this gateway.",
                len(self.feeds),
            ),
        ]


def _shut_down(session: ClientSession, *, unavailable: bool = False) -> None:
    assert isinstance(session, MqttSession)
    session.shutdown(unavailable=unavailable)
