"""Every setting of an AMQP 1.0 gateway with its default: the single source of its configuration reference."""

from __future__ import annotations

from dataclasses import dataclass

from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.gateway import ListenerSettings
from tridentmq_shared.settings import doc
from tridentmq_shared.tls import TlsSection

ENV_PREFIX = "TRIDENTMQ_AMQP"


@dataclass(frozen=True)
class GatewayNodeSection:
    name: str = doc(
        "gateway-amqp",
        "Name of this gateway in logs and status output; also the container id it announces in its OPEN frames.",
    )
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING or ERROR.")


@dataclass(frozen=True)
class ListenerSection(ListenerSettings):
    """This gateway's client listeners, with the fields every gateway's has (``ListenerSettings``)."""

    host: str = doc(
        "127.0.0.1",
        "Interface for AMQP clients. While the core has no users it refuses "
        "clients of other hosts (core security.allow_anonymous_remote).",
    )
    port: int = doc(
        5672, "AMQP 1.0 over TCP (0 = any free port, written to the ports file; -1 = off, for clients over TLS only)."
    )
    websocket_port: int = doc(5673, "AMQP 1.0 over WebSocket, subprotocol `amqp` (-1 = off).")
    tls_port: int = doc(5671, "AMQP 1.0 over TLS, opened when `tls.cert_file` is set (-1 = off; 0 = any free port).")
    websocket_tls_port: int = doc(
        5674, "AMQP 1.0 over WebSocket over TLS (wss), opened when `tls.cert_file` is set (-1 = off)."
    )
    max_connections: int = doc(10_000, "AMQP connections accepted at once; more are refused.", least=1)
    max_logging_in: int = doc(
        1000,
        "Connections at once that have not logged in yet (each bounded by "
        "`max_connect_bytes`); more are refused, the first refusal of each minute "
        "logged.",
        least=1,
    )


@dataclass(frozen=True)
class CoreLinkSection(CoreLinkSettings):
    """The core nodes, load balancing and failover of client links: every gateway's (``CoreLinkSettings``)."""


@dataclass(frozen=True)
class AmqpLimitsSection:
    allow_anonymous: bool = doc(
        True,
        "Accept SASL ANONYMOUS and connections without a SASL layer; they reach "
        "the core without credentials, which it allows only while it has no "
        "users, and then only from clients on its host (unless its "
        "security.allow_anonymous_remote).",
    )
    max_frame_bytes: int = doc(1024 * 1024, "Largest AMQP frame accepted (the OPEN's max-frame-size).", least=512)
    max_message_bytes: int = doc(
        8 * 1024 * 1024,
        "Largest message accepted on a link (announced as the link's "
        "max-message-size; a larger one closes the link with "
        "`amqp:link:message-size-exceeded`).",
        least=1,
    )
    max_incomplete_bytes: int = doc(
        32 * 1024 * 1024,
        "Bytes of messages still arriving in several frames that "
        "one connection may have at once; more closes it with "
        "`amqp:resource-limit-exceeded`.",
        least=1,
    )
    channel_max: int = doc(255, "Most sessions on one connection.", least=0, most=65535)
    max_links: int = doc(
        1000, "Most links on one connection; another attach is refused with `amqp:resource-limit-exceeded`.", least=1
    )
    link_credit: int = doc(
        1000,
        "Credit granted to a client's sending link, topped up at half the window while the core keeps up.",
        least=1,
    )
    prefetch: int = doc(
        1000, "Messages of a consumer fetched from the core ahead of the client's credit and settlements.", least=1
    )
    idle_timeout_ms: int = doc(
        30_000,
        "Idle timeout announced in OPEN: clients send a frame at least this "
        "often, and one silent for twice as long is disconnected (0 = "
        "none).",
        least=0,
    )
    session_window: int = doc(
        1024,
        "Transfer frames a session may receive ahead of the gateway (its incoming "
        "window; at most 2 GiB worth of frames). Link credit is what bounds "
        "messages, and `max_incomplete_bytes` what a connection holds of them: "
        "the gateway reads each transfer as it comes.",
        least=1,
    )
    connect_timeout_ms: int = doc(
        10_000, "A connection that has not finished SASL and sent OPEN by then is closed.", least=1
    )
    pending_bytes: int = doc(
        8 * 1024 * 1024,
        "Client bytes read ahead of processing before the gateway stops reading the socket; also the answers "
        "(dispositions, flows, attaches) that may wait for a client that does not read before its frames wait too, "
        "and the transfers its session windows do not let out yet before its messages wait in the core.",
        least=1,
    )
    max_connect_bytes: int = doc(
        64 * 1024,
        "The same before the client has logged in (SASL, or the core's "
        "acceptance of an anonymous connection): what a connection that has "
        "not logged in can make the gateway hold. SASL frames are also "
        "limited to 8 KiB, and what is pipelined behind a sasl-init to 64 "
        "KiB.",
        least=0,
    )


@dataclass(frozen=True)
class HttpSection:
    enabled: bool = doc(True, "Serve /healthz, /readyz and /metrics over HTTP.")
    host: str = doc("127.0.0.1", "Interface of the HTTP server.")
    port: int = doc(8084, "Port of the HTTP server (0 = any free port).")
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
class AmqpSettings:
    node: GatewayNodeSection = doc(GatewayNodeSection(), "This gateway.")
    listener: ListenerSection = doc(ListenerSection(), "Client listeners.")
    core: CoreLinkSection = doc(CoreLinkSection(), "The core node behind this gateway.")
    amqp: AmqpLimitsSection = doc(AmqpLimitsSection(), "Protocol limits, windows and timers.")
    http: HttpSection = doc(HttpSection(), "Health and metrics HTTP server.")
    tls: TlsSection = doc(
        TlsSection(),
        "Certificates of the TLS listeners (`listener.tls_port`, "
        "`listener.websocket_tls_port`, `http.tls`) and of TLS links to the core "
        "(`core.tls`).",
    )
