"""Links from this node to other nodes: cluster connections, a backup's replication link, vote requests."""

from __future__ import annotations

import asyncio
import functools

from tridentmq_core.settings import CoreSettings
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.peer import PeerLink
from tridentmq_shared.tls import ClientTls, TlsSection


def node_link(settings: CoreSettings, host: str, port: int, name: str, *, connect_timeout: float) -> PeerLink:
    """A link to another node, logged in with the cluster credentials; it does not reconnect by itself (its
    owner decides what a lost link means)."""
    cluster = settings.cluster
    return PeerLink(
        host,
        port,
        user=cluster.user,
        password=cluster.password,
        client_name=name,
        heartbeat_ms=settings.link.heartbeat_ms,
        connect_timeout=connect_timeout,
        reconnect=ReconnectPolicy(attempts=0, initial_attempts=1),
        tls=client_tls(settings.tls) if settings.link.tls else None,
    )


@functools.cache
def client_tls(settings: TlsSection) -> ClientTls:
    """One client context per process for the links to other nodes (their link listeners are TLS when
    this node's is: a cluster sets ``link.tls`` alike on every node)."""
    return ClientTls(settings)


def watch_close(client: PeerLink) -> tuple[asyncio.Event, list[LinkRequestError]]:
    """An event set when ``client`` closes for good, and the reason it closed with."""
    closed = asyncio.Event()
    why: list[LinkRequestError] = []

    def on_closed(error: LinkRequestError) -> None:
        why.append(error)
        closed.set()

    client.on_closed = on_closed
    return closed, why
