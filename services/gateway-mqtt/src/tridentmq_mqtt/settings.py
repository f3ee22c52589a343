"""Every setting of an MQTT gateway with its default: the single source of its configuration reference."""

from __future__ import annotations

from dataclasses import dataclass

from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.gateway import ListenerSettings
from tridentmq_shared.settings import doc
from tridentmq_shared.tls import TlsSection

ENV_PREFIX = "TRIDENTMQ_MQTT"


@dataclass(frozen=True)
class GatewayNodeSection:
    name: str = doc("gateway-mqtt", "Name of this gateway in logs and status output.")
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING or ERROR.")


@dataclass(frozen=True)
class ListenerSection(ListenerSettings):
    """This gateway's client listeners, with the fields every gateway's has (``ListenerSettings``)."""

    host: str = doc(
        "127.0.0.1",
        "Interface for MQTT clients. While the core has no users it refuses "
        "clients of other hosts (core security.allow_anonymous_remote).",
    )
    port: int = doc(
        1883, "MQTT over TCP (0 = any free port, written to the ports file; -1 = off, for clients over TLS only)."
    )
    websocket_port: int = doc(8083, "MQTT over WebSocket, subprotocol `mqtt` (-1 = off).")
    tls_port: int = doc(8883, "MQTT over TLS, opened when `tls.cert_file` is set (-1 = off; 0 = any free port).")
    websocket_tls_port: int = doc(
        8884, "MQTT over WebSocket over TLS (wss), opened when `tls.cert_file` is set (-1 = off)."
    )
    max_connections: int = doc(10_000, "MQTT connections accepted at once; more are refused.", least=1)
    max_logging_in: int = doc(
        1000,
        "Connections at once that have not logged in yet (each bounded by "
        "`max_connect_bytes`); more are refused, the first refusal of each minute "
        "logged.",
        least=1,
    )


@dataclass(frozen=True)
class CoreLinkSection(CoreLinkSettings):
    """The core nodes, load balancing and failover of client links as every gateway's (``CoreLinkSettings``),
    and the gateway's own link."""

    user: str = doc(
        "",
        "Core user of the gateway itself, for the session, lock, outbox and retained-message queues "
        "under `$mqtt.` and for following the cluster's topology (empty = anonymous, which the "
        "core allows on loopback while it has no users). Clients publish and subscribe as "
        "themselves.",
    )
    password: str = doc("", "Password of that user.")


@dataclass(frozen=True)
class MqttLimitsSection:
    max_packet_bytes: int = doc(
        8 * 1024 * 1024 + 64 * 1024,
        "Largest packet accepted (the core's largest "
        "message plus room for properties); 5.0 clients learn it from the CONNACK, "
        "others are disconnected when they exceed it.",
        least=1024,
        most=268435460,
    )
    receive_maximum: int = doc(
        1000,
        "QoS 1 and 2 messages a client may have unacknowledged towards the gateway "
        "(5.0 clients learn it from the CONNACK).",
        least=1,
        most=65535,
    )
    max_inflight: int = doc(
        4000,
        "QoS 1 and 2 messages sent to a subscription ahead of the client's "
        "acknowledgements (lowered to the client's receive maximum). Also the "
        "subscription's window on the core: it must cover the messages on their way "
        "between core, gateway and client, or a subscriber that keeps up is held "
        "back by the round trip.",
        least=1,
    )
    max_subscriptions: int = doc(
        1000,
        "Most subscriptions of one connection; a SUBSCRIBE beyond is refused for that filter with reason code "
        "0x97 quota exceeded (0x80 before 5.0). Each may hold a window of messages in the gateway for a "
        "client that stops reading.",
        least=1,
    )
    qos0_window: int = doc(
        1000, "QoS 0 messages of a subscription fetched from the core ahead of being written to the client.", least=1
    )
    qos0_fan_out_from: int = doc(
        2,
        "QoS 0 subscriptions of sessions that end with their connection share one "
        "core subscription per user and topic filter on this gateway (a fan-out) once "
        "this many of one user to one filter are open: each message then comes from "
        "the core once and is encoded once for all of them (the ones before had a "
        "queue of their own and move over; 1 = always, 0 = never). A fan-out takes "
        "one more core link per user, and a connection that falls behind by more than "
        "`qos0_max_buffered_bytes` loses its QoS 0 messages.",
        least=0,
    )
    qos0_max_buffered_bytes: int = doc(
        4 * 1024 * 1024,
        "Of a fan-out (`qos0_fan_out_from`): bytes waiting to "
        "be written to a connection above which a batch of the fan-out's messages "
        "skips it (counted in `mqtt_qos0_dropped_total`) rather than hold up the "
        "other subscribers. Checked before each batch, so a connection may go "
        "over by one batch (`qos0_window` messages).",
        least=1,
    )
    topic_alias_maximum: int = doc(
        64, "Topic aliases a 5.0 client may set up towards the gateway (0 = none).", least=0, most=65535
    )
    max_keep_alive_s: int = doc(
        0,
        "Longest keep-alive granted; a 5.0 client asking for more (or for none) is "
        "given this as server keep-alive (0 = grant what the client asks).",
        least=0,
        most=65535,
    )
    max_session_expiry_s: int = doc(
        7 * 24 * 3600,
        "Longest session expiry granted, also to 3.1.1 clients "
        "that connect with clean session 0 (whose sessions otherwise "
        "never expire).",
        least=0,
        most=4294967295,
    )
    response_information_prefix: str = doc(
        "reply/",
        "A 5.0 client that sets Request Response Information is "
        "given this followed by its client id as Response Information in the "
        "CONNACK, to build its response topics on (it still needs the "
        "permissions to use them). Empty = never sent.",
    )
    connect_timeout_ms: int = doc(10_000, "A connection that has not sent its CONNECT by then is closed.", least=1)
    max_connect_bytes: int = doc(
        64 * 1024,
        "Most bytes a client may send before its CONNECT is complete (will "
        "message included; refused as too large beyond, 0 = no limit); while "
        "its login is checked, the gateway reads nothing more from it. Bounds "
        "what a connection that has not logged in can make the gateway "
        "hold.",
        least=0,
    )
    bind_sessions_to_users: bool = doc(
        True,
        "A persistent session belongs to the user who created it: a "
        "CONNECT of another user with its client id is refused (CONNACK "
        "0x87 not authorized; 5 for 3.1.1) instead of taking the session "
        "over or, with clean start, discarding it. Off: any user may take "
        "over any client id.",
    )
    takeover_timeout_ms: int = doc(
        5_000,
        "How long a CONNECT waits for an earlier connection of the same client "
        "id, on any gateway, to let go of the session.",
        least=0,
    )
    pending_packets: int = doc(
        1000,
        "Client packets read ahead of processing before the gateway stops reading "
        "the socket (back-pressure to a fast publisher).",
        least=1,
    )
    pending_bytes: int = doc(
        8 * 1024 * 1024,
        "Bytes read ahead of processing before the gateway stops reading "
        "the socket, whatever the packet count (large packets); also the answers (PUBACKs, SUBACKs, "
        "PINGRESPs) that may wait for a client that does not read before its packets wait too.",
        least=1,
    )
    use_identity_as_username: bool = doc(
        False,
        "Clients are the user named by the common name of their TLS "
        "client certificate (as Mosquitto's option of that name): the CONNECT's "
        "user name and password are ignored, a client without a verified "
        "certificate (cleartext, or `tls.client_certs` not `required`) is "
        "refused, and the gateway opens the client's core link with its own "
        "`core.user`, which the core must list in `link.proxy_users`. The "
        "core enforces that user's permissions.",
    )


@dataclass(frozen=True)
class HttpSection:
    enabled: bool = doc(True, "Serve /healthz, /readyz and /metrics over HTTP.")
    host: str = doc("127.0.0.1", "Interface of the HTTP server.")
    port: int = doc(8082, "Port of the HTTP server (0 = any free port).")
    tls: bool = doc(False, "Serve HTTPS instead of HTTP on that port (certificates in `[tls]`).")
    allowed_hosts: list[str] = doc(
        list,
        "Host names requests may carry in their Host header besides loopback "
        "names, the address they came in on and `http.host` (a check against "
        "DNS rebinding); `*` allows any. A WebSocket handshake from this host "
        "(a browser here) must name such a host in its Host and Origin headers, "
        "`listener.host` counting too.",
        factory=True,
    )
    request_timeout_ms: int = doc(
        10_000,
        "A connection to the HTTP port or to the WebSocket listeners must send "
        "a whole request head within this, and is closed after as long "
        "idle.",
        least=1,
    )
    max_connections: int = doc(
        256,
        "HTTP connections open at once; more get 503 and are closed (logged once a "
        "minute). The WebSocket listeners take `listener.max_connections`.",
        least=1,
    )


@dataclass(frozen=True)
class MqttSettings:
    node: GatewayNodeSection = doc(GatewayNodeSection(), "This gateway.")
    listener: ListenerSection = doc(ListenerSection(), "Client listeners.")
    core: CoreLinkSection = doc(CoreLinkSection(), "The core node behind this gateway.")
    mqtt: MqttLimitsSection = doc(MqttLimitsSection(), "Protocol limits, windows and timers.")
    http: HttpSection = doc(HttpSection(), "Health and metrics HTTP server.")
    tls: TlsSection = doc(
        TlsSection(),
        "Certificates of the TLS listeners (`listener.tls_port`, "
        "`listener.websocket_tls_port`, `http.tls`) and of TLS links to the core "
        "(`core.tls`).",
    )
