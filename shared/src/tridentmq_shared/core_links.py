"""A gateway's links to the core: the nodes it may use, the topology it follows, the client links it opens.

Each gateway process keeps one ``CoreLinks`` (per ``[core]`` section): a ``Topology`` seeded from the
configured nodes and kept up to date by one watcher link, which sends TOPOLOGY ``{}`` to its node after
every (re)connect and takes in the node's TOPOLOGY_UPDATE pushes. Every client link of the gateway picks
its node from that topology (so the load-balancing policy spreads clients over the cluster) and, when its
node dies, fails over to a live one. A node that is not clustered refuses the request: the topology is then
just the configured nodes and the watcher closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from tridentmq_shared.link.channels import SharedLinks
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.link.topology import Endpoint, Topology, load_balancing, parse_endpoint
from tridentmq_shared.settings import SettingsError, doc
from tridentmq_shared.supervision import spawn
from tridentmq_shared.tls import ClientTls, TlsSection

log = logging.getLogger("tridentmq.gateway")


@dataclass(frozen=True)
class CoreLinkSettings:
    """The fields every gateway's ``[core]`` section has (each gateway's section derives from this one)."""

    host: str = doc("127.0.0.1", "Core node to connect clients to (the first one tried).")
    port: int = doc(61616, "Its link port.")
    connectors: list[str] = doc(
        list,
        "More core nodes, as `host:port`, tried when the first is down. The gateway "
        "learns the other nodes of a cluster from whichever node it reaches, so one "
        "is enough while it is up.",
        factory=True,
    )
    load_balancing: str = doc(
        "ROUND_ROBIN",
        "How each client link picks its core node among the live ones: "
        "`ROUND_ROBIN` (a random start, then in turn), `RANDOM`, "
        "`RANDOM_STICKY` (one random node, for as long as it lives) or "
        "`FIRST_ELEMENT`.",
    )
    retry_interval_ms: int = doc(
        100,
        "Wait before trying the nodes again when a client link lost its node and "
        "no live node answered (each try goes over every live node, the lost one "
        "last).",
        least=1,
    )
    retry_multiplier: float = doc(2.0, "Factor by which that wait grows after each try.", least=1)
    max_retry_interval_ms: int = doc(2000, "Longest wait between tries.", least=1)
    reconnect_attempts: int = doc(
        10,
        "Tries before a client link that lost its node gives up (about 11 s with the "
        "defaults): then its client is disconnected as by an unavailable broker. "
        "-1 = try for ever, 0 = no failover.",
        least=-1,
    )
    initial_connect_attempts: int = doc(
        1, "Tries over the nodes when a client connects before it is refused as unavailable (-1 = for ever).", least=-1
    )
    failover_window_ms: int = doc(
        5000,
        "When a lost node has an in-sync backup (HA), how long a client link "
        "waits for that backup to take over before it goes to another "
        "node.",
        least=0,
    )
    user: str = doc(
        "",
        "Core user of the gateway's own link that follows the cluster's topology (empty = "
        "anonymous, which the core allows on loopback while it has no users). Without it the "
        "gateway knows only the configured nodes.",
    )
    password: str = doc("", "Password of that user.")
    tls: bool = doc(
        False,
        "Connect to the core over TLS (the core's `link.tls`), checking its certificate "
        "against `tls.ca_file` and presenting `tls.cert_file` when set.",
    )
    heartbeat_ms: int = doc(
        1000,
        "Heartbeat interval asked of the core on the gateway's links: either side "
        "silent for 4 intervals is taken for dead. Longer than the core's 250 ms: a "
        "shared link carries thousands of sessions, and a gateway busy for a second "
        "(a burst of thousands of connections) or a core pausing under load (a full "
        "garbage collection with millions of messages queued) must not drop them all.",
        least=0,
    )
    shared_links: int = doc(
        1,
        "Links to each core node that carry the gateway's client sessions, each session a "
        "channel of one of them (opened with `core.user`, which the core must accept): "
        "a session then costs the core its state, not a connection. 0: one link per "
        "client session. Should the core refuse `core.user`, sessions fall back to a "
        "link each, and the shared link is tried again in the background every 30 s.",
        least=0,
    )
    consumer_window_bytes: int = doc(
        4 * 1024 * 1024,
        "Message bodies one subscription may have on their way "
        "from the core or waiting in the gateway for its client, besides its "
        "window in messages (one message may pass it): what bounds the gateway's "
        "memory for a client that reads slowly, whatever the message size "
        "(0: messages only).",
        least=0,
    )

    def endpoints(self) -> list[Endpoint]:
        """``host``:``port`` then the connectors (SettingsError for a malformed one)."""
        found = [(self.host, self.port)]
        for connector in self.connectors:
            try:
                found.append(parse_endpoint(connector))
            except ValueError as exc:
                raise SettingsError(f"core.connectors: {exc}") from None
        return found

    def reconnect_policy(self) -> ReconnectPolicy:
        return ReconnectPolicy(
            retry_interval=self.retry_interval_ms / 1000,
            multiplier=self.retry_multiplier,
            max_interval=self.max_retry_interval_ms / 1000,
            attempts=self.reconnect_attempts,
            initial_attempts=self.initial_connect_attempts,
            failover_window=self.failover_window_ms / 1000,
        )


class CoreLinks:
    """The core nodes behind one gateway process and the client links to them. The gateway makes one and
    hands it to its sessions."""

    def __init__(
        self,
        settings: CoreLinkSettings,
        *,
        name: str = "gateway",
        tls: ClientTls | None = None,
    ) -> None:
        try:
            policy = load_balancing(settings.load_balancing)
        except ValueError as exc:
            raise SettingsError(f"core.load_balancing: {exc}") from None
        self.settings = settings
        self.name = name
        self.heartbeat_ms = settings.heartbeat_ms
        self.tls = tls
        self.topology = Topology(settings.endpoints(), policy)
        self.reconnect = settings.reconnect_policy()
        self._watcher: LinkClient | None = None
        self._watching: asyncio.Task[None] | None = None
        self._readiness: LinkClient | None = None  # the link ``reachable`` keeps
        if settings.shared_links < 0:
            raise SettingsError("core.shared_links must be 0 or more")
        self.shared: SharedLinks | None = None
        if settings.shared_links:
            self.shared = SharedLinks(
                per_node=settings.shared_links,
                user=settings.user or None,
                password=settings.password or None,
                name=name,
                heartbeat_ms=settings.heartbeat_ms,
                tls=tls,
            )

    @classmethod
    def for_gateway(cls, settings: CoreLinkSettings, *, name: str, tls: TlsSection) -> CoreLinks:
        """A gateway's links, TLS ones with its ``[tls]`` section when ``settings.tls``."""
        return cls(settings, name=name, tls=ClientTls(tls) if settings.tls else None)

    def client(
        self,
        *,
        user: str | None,
        password: str | None,
        client_name: str,
        client_host: str | None = None,
        acting_for: str | None = None,
    ) -> PipelinedLink:
        """A client link (not connected yet) on a node of the topology, failing over as configured;
        ``client_host`` is the address of the gateway's client it serves (the core checks it); with
        ``acting_for``, ``user`` is the gateway's own and the link has ``acting_for``'s permissions."""
        return PipelinedLink(
            topology=self.topology,
            reconnect=self.reconnect,
            user=user,
            password=password,
            client_name=client_name,
            client_host=client_host,
            heartbeat_ms=self.heartbeat_ms,
            forgive_own_stalls=True,  # a gateway's link (see LinkConnection.handle_timeout)
            tls=self.tls,
            acting_for=acting_for,
            channels=self.shared,
        )

    async def reachable(self) -> bool:
        """Whether a core node of the topology answers a link: what a gateway needs before it can serve a
        client. One link is kept open for the question (a new one per look would fill the core's log); once
        lost, each look tries the nodes once. A node refusing the gateway's own credentials answers too (its
        clients bring theirs)."""
        if self._readiness is not None and self._readiness.connected:
            return True
        probe = LinkClient(
            topology=self.topology,
            reconnect=ReconnectPolicy(attempts=0, initial_attempts=1),
            user=self.settings.user or None,
            password=self.settings.password or None,
            client_name=f"{self.name} readiness",
            heartbeat_ms=self.heartbeat_ms,
            forgive_own_stalls=True,  # a gateway's link (see LinkConnection.handle_timeout)
            tls=self.tls,
        )
        try:
            await probe.connect()
        except LinkClosedError as exc:
            await probe.close()
            return exc.code == ErrorCode.UNAUTHENTICATED
        except (LinkRequestError, OSError, TimeoutError):
            await probe.close()
            return False
        if self._readiness is not None:
            await self._readiness.close()
        self._readiness = probe
        return True

    # ------------------------------------------------------------------ the watcher
    def start(self) -> None:
        """Follow the cluster's topology in the background (the gateway serves meanwhile, from the
        configured nodes)."""
        if self._watching is None:
            self._watching = spawn(self._watch(), "core topology")

    async def _watch(self) -> None:
        settings = self.settings
        # The gateway's own link keeps trying for as long as the gateway runs.
        reconnect = ReconnectPolicy(
            self.reconnect.retry_interval,
            self.reconnect.multiplier,
            self.reconnect.max_interval,
            attempts=-1,
            initial_attempts=-1,
            failover_window=self.reconnect.failover_window,
        )
        watcher = LinkClient(
            topology=self.topology,
            follow_topology=True,
            user=settings.user or None,
            password=settings.password or None,
            client_name=f"{self.name} topology",
            heartbeat_ms=self.heartbeat_ms,
            forgive_own_stalls=True,  # a gateway's link (see LinkConnection.handle_timeout)
            reconnect=reconnect,
            tls=self.tls,
        )
        self._watcher = watcher  # from now on ``stop`` closes it
        try:
            await watcher.connect()
        except LinkRequestError as exc:
            log.warning(
                "cannot follow the cluster topology: only the configured core nodes are used",
                extra={"reason": exc.text},
            )
            await watcher.close()
            return
        if self.topology.clustered is False:
            log.info(
                "core node not clustered: only the configured core nodes are used",
                extra={"core": f"{watcher.host}:{watcher.port}"},
            )
            await watcher.close()
            return
        log.info(
            "following the cluster topology",
            extra={
                "core": f"{watcher.host}:{watcher.port}",
                "members": ",".join(f"{host}:{port}" for host, port in self.topology.endpoints),
            },
        )

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching
        if self._watcher is not None:
            await self._watcher.close()
        if self._readiness is not None:
            await self._readiness.close()
        if self.shared is not None:
            await self.shared.close()
