"""Every setting of a STOMP gateway with its default: the single source of its configuration reference."""

from __future__ import annotations

from dataclasses import dataclass

from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.gateway import ListenerSettings
from tridentmq_shared.settings import doc
from tridentmq_shared.tls import TlsSection

ENV_PREFIX = "TRIDENTMQ_STOMP"


@dataclass(frozen=True)
class GatewayNodeSection:
    name: str = doc("gateway-stomp", "Name of this gateway in logs and status output.")
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING or ERROR.")


@dataclass(frozen=True)
class ListenerSection(ListenerSettings):
    """This gateway's client listeners, with the fields every gateway's has (``ListenerSettings``)."""

    host: str = doc(
        "127.0.0.1",
        "Interface for STOMP clients. While the core has no users it refuses "
        "clients of other hosts (core security.allow_anonymous_remote).",
    )
    port: int = doc(
        61613, "STOMP over TCP (0 = any free port, written to the ports file; -1 = off, for clients over TLS only)."
    )
    websocket_port: int = doc(61614, "STOMP over WebSocket, subprotocols v10/v11/v12.stomp or none (-1 = off).")
    tls_port: int = doc(61612, "STOMP over TLS, opened when `tls.cert_file` is set (-1 = off; 0 = any free port).")
    websocket_tls_port: int = doc(
        61615, "STOMP over WebSocket over TLS (wss), opened when `tls.cert_file` is set (-1 = off)."
    )
    max_connections: int = doc(10_000, "STOMP connections accepted at once; more are refused.", least=1)
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
class StompLimitsSection:
    max_frame_bytes: int = doc(4 * 1024 * 1024, "Largest frame body accepted (ERROR `frame too large` above).", least=1)
    max_headers: int = doc(64, "Most headers in one frame.", least=1)
    max_header_bytes: int = doc(64 * 1024, "Most bytes of command and header lines in one frame.", least=1)
    prefetch: int = doc(
        1000,
        "Messages sent to a subscription ahead of its acks, unless the SUBSCRIBE says "
        "`consumer-window-size` or `activemq.prefetchSize`.",
        least=1,
    )
    max_prefetch: int = doc(10_000, "Largest prefetch a subscription may ask for.", least=1)
    max_subscriptions: int = doc(
        1000,
        "Most subscriptions on one connection; another SUBSCRIBE is an ERROR `resource limit` (each may hold "
        "up to `core.consumer_window_bytes` of messages for a client that stops reading).",
        least=1,
    )
    pending_frames: int = doc(
        1000,
        "Client frames read ahead of processing before the gateway stops reading "
        "the socket (back-pressure to a fast producer).",
        least=1,
    )
    pending_bytes: int = doc(
        8 * 1024 * 1024,
        "Bytes read ahead of processing before the gateway stops reading "
        "the socket, whatever the frame count (large frames); also the answers (receipts) that may wait for "
        "a client that does not read before its frames wait too.",
        least=1,
    )
    heartbeat_send_ms: int = doc(10_000, "Heart-beat interval the gateway offers to send (sx of CONNECTED).", least=0)
    heartbeat_receive_ms: int = doc(
        10_000,
        "Heart-beat interval the gateway asks of clients (sy); a client "
        "silent for twice the agreed interval is disconnected.",
        least=0,
    )
    min_heartbeat_ms: int = doc(100, "Shortest heart-beat interval agreed to, either way.", least=0)
    connect_timeout_ms: int = doc(
        10_000,
        "A connection that has not sent its CONNECT frame by then gets ERROR "
        "`connect timeout` and is closed (0 = wait for ever).",
        least=0,
    )
    max_connect_bytes: int = doc(
        64 * 1024,
        "Most bytes a client may send before its CONNECT frame is complete "
        "(ERROR `frame too large` beyond, 0 = no limit); while its login is "
        "checked, the gateway reads nothing more from it. Bounds what a "
        "connection that has not logged in can make the gateway "
        "hold.",
        least=0,
    )


@dataclass(frozen=True)
class HttpSection:
    enabled: bool = doc(True, "Serve /healthz, /readyz and /metrics over HTTP.")
    host: str = doc("127.0.0.1", "Interface of the HTTP server.")
    port: int = doc(8081, "Port of the HTTP server (0 = any free port).")
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
class StompSettings:
    node: GatewayNodeSection = doc(GatewayNodeSection(), "This gateway.")
    listener: ListenerSection = doc(ListenerSection(), "Client listeners.")
    core: CoreLinkSection = doc(CoreLinkSection(), "The core node behind this gateway.")
    stomp: StompLimitsSection = doc(StompLimitsSection(), "Protocol limits, windows and heart-beats.")
    http: HttpSection = doc(HttpSection(), "Health and metrics HTTP server.")
    tls: TlsSection = doc(
        TlsSection(),
        "Certificates of the TLS listeners (`listener.tls_port`, "
        "`listener.websocket_tls_port`, `http.tls`) and of TLS links to the core "
        "(`core.tls`).",
    )
