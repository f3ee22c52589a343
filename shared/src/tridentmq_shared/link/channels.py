"""A gateway's shared links: a few links per core node carrying its clients' sessions as channels.

Each session keeps its own ``LinkClient`` and its own link stream (HELLO with the client's credentials or the
user the gateway asserts, its consumers, credit, publishes), but that stream travels as CHANNEL operations of
a link the gateway shares with its other sessions, rather than over a connection of its own: the core's cost
per session is its state, not a socket, a TCP handshake and a file descriptor on both sides. A session sees
its channel as a transport; when the shared link dies, every channel on it is lost as a connection would
be, and each session fails over as it always did (to a channel of another node's shared link).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from tridentmq_shared.link.client import EARLY_WRITE_OPERATIONS, LinkClient
from tridentmq_shared.link.codec import DEFAULT_HEARTBEAT_MS
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError, SharedLinksRefusedError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.topology import Endpoint
from tridentmq_shared.tls import ClientTls

log = logging.getLogger("tridentmq.gateway")
P = TypeVar("P", bound=asyncio.Protocol)

#: After the core refused the gateway's own user for a shared link, sessions connect one link each for this
#: long before a shared link is tried again.
REFUSED_RETRY_SECONDS = 30.0
#: A session's output goes in CHANNEL operations of at most this many bytes, and the shared link is written as
#: soon as this many are queued: the core decodes small frames as they come, and no second copy of a large
#: batch of publishes waits here for the end of the loop turn.
CHUNK_BYTES = 64 * 1024
#: A session's output of at least this many bytes (a batch of publishes or acknowledgements, which its link wrote
#: early or at the end of its own loop turn) goes on the shared link at once, not a loop turn later with the
#: link's own flush: there is little left to gain by sending it with other sessions' output, and a turn of a busy
#: gateway is long. Waiting, the AMQP gateway's durable publishes took 2.8 ms (median) from the session to the core
#: against 1.5 ms over a link of their own, and its durable throughput (500 unsettled transfers) was 8-11 % lower.
#: Smaller output (a login's HELLO, a request) still waits, so that a connection storm's hundreds of sessions share
#: the link's writes.
WRITE_THROUGH_BYTES = 16 * 1024


class ChannelTransport:
    """One session's stream over a shared link, as the transport of that session's link protocol."""

    __slots__ = ("carrier", "channel_id", "closing", "protocol")

    def __init__(self, carrier: Carrier, channel_id: int, protocol: asyncio.Protocol) -> None:
        self.carrier = carrier
        self.channel_id = channel_id
        self.protocol = protocol
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return False  # a session's link closes after the core answered its CLOSE, as over TLS

    def write(self, data: bytes) -> None:
        if self.closing or not data:
            return
        carrier, channel_id = self.carrier, self.channel_id
        if len(data) <= CHUNK_BYTES:
            carrier.write(channel_id, data)
            return
        with memoryview(data) as view:
            for start in range(0, len(data), CHUNK_BYTES):
                carrier.write(channel_id, bytes(view[start : start + CHUNK_BYTES]))

    def close(self) -> None:
        """End the channel on both sides; the session's protocol sees the end a loop turn later."""
        if not self.closing:
            self.carrier.write(self.channel_id, b"")
            self.carrier.ended(self.channel_id)

    abort = close


class Carrier:
    """One shared link to a core node and the channels it carries."""

    def __init__(self, links: SharedLinks, client: LinkClient) -> None:
        self.links = links
        self.client = client
        self.channels: dict[int, ChannelTransport] = {}
        self._ids = itertools.count(1)
        self._pending_bytes = 0  # channel bytes queued since the link was last written
        # Session links whose output waits for this turn's flush, which writes it and then the shared link.
        self._due: list[LinkClient] = []
        self._flushing = False
        self.alive = True
        client.on_channels = self._received
        client.on_closed = self._closed

    def open_channel(self, protocol_factory: Callable[[], P]) -> tuple[asyncio.Transport, P]:
        protocol = protocol_factory()
        transport = ChannelTransport(self, next(self._ids), protocol)
        self.channels[transport.channel_id] = transport
        carried = self.client._protocol
        if carried is not None and hasattr(protocol, "writable"):
            # The session waits while the shared link's socket is full (its own would have paused it).
            protocol.writable = carried.writable
        session = getattr(protocol, "client", None)
        if isinstance(session, LinkClient):
            session.flush_with = self
        channel = cast(asyncio.Transport, transport)  # what a session needs of a transport, duck-typed
        protocol.connection_made(channel)
        return channel, protocol

    def flush_later(self, client: LinkClient) -> None:
        """A session's link has output for this turn: it goes out with the shared link's own flush. One loop
        turn, not two (the session's flush into the shared link, then the shared link's to the socket): a
        message alone, at a low rate, reaches the core a turn sooner, and each turn costs the gateway a poll."""
        self._due.append(client)
        if len(self._due) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        due, self._due = self._due, []
        written = 0
        self._flushing = True  # what they write goes out below, not with a flush of its own a turn later
        try:
            for client in due:
                written += 1
                client._write_now()
        finally:
            self._flushing = False
            if written < len(due):  # one of them failed: the others' output still goes, next turn
                for client in due[written:]:
                    self.flush_later(client)
        self.client._write_now()

    def write(self, channel_id: int, data: bytes) -> None:
        conn = self.client._conn
        if conn is None or not conn.open:
            return  # the link is gone: its channels learn it from ``_closed``
        conn.channel(channel_id, data)
        self._pending_bytes += len(data)
        if (
            len(data) >= WRITE_THROUGH_BYTES
            or conn.pending_operations >= EARLY_WRITE_OPERATIONS
            or self._pending_bytes >= CHUNK_BYTES
        ):
            self._pending_bytes = 0
            self.client._write_now()
        elif not self._flushing:
            self.client._schedule_flush()

    def ended(self, channel_id: int) -> None:
        transport = self.channels.pop(channel_id, None)
        if transport is not None:
            transport.closing = True
            asyncio.get_running_loop().call_soon(transport.protocol.connection_lost, None)

    def _received(self, received: list[tuple[int, bytes]]) -> None:
        channels = self.channels
        for channel_id, data in received:
            transport = channels.get(channel_id)
            if transport is None:
                continue  # ended here already; what was on its way is dropped
            if data:
                transport.protocol.data_received(data)
            else:
                self.ended(channel_id)

    def _closed(self, error: LinkRequestError) -> None:
        """The shared link is gone: each of its sessions is lost as its own connection would have been."""
        self.alive = False
        self.links.forget(self)
        if self.channels and not self.links.stopping:  # (a gateway that stops ends its sessions itself)
            log.warning(
                "shared core link lost: its sessions fail over",
                extra={
                    "core": f"{self.client.host}:{self.client.port}",
                    "sessions": len(self.channels),
                    "reason": error.text,
                },
            )
        for channel_id in list(self.channels):
            self.ended(channel_id)


class SharedLinks:
    """The shared links of one gateway process to its core nodes, ``per_node`` to each, opened on first use
    with the gateway's own core user. Sessions are spread over a node's links by their count of channels."""

    def __init__(
        self,
        *,
        per_node: int,
        user: str | None,
        password: str | None,
        name: str,
        heartbeat_ms: int = DEFAULT_HEARTBEAT_MS,
        tls: ClientTls | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.per_node = per_node
        self.user = user
        self.password = password
        self.name = name
        self.heartbeat_ms = heartbeat_ms
        self.tls = tls
        self.connect_timeout = connect_timeout
        self._carriers: dict[Endpoint, list[Carrier]] = {}
        self._connecting: dict[Endpoint, asyncio.Task[Carrier]] = {}
        self._refused_until: dict[Endpoint, float] = {}
        self._closing = False

    @property
    def carriers(self) -> list[Carrier]:
        return [carrier for carriers in self._carriers.values() for carrier in carriers]

    def open_now(self, host: str, port: int, protocol_factory: Callable[[], P]) -> tuple[asyncio.Transport, P] | None:
        """``open`` without waiting, when the shared links to ``host``:``port`` are up (nearly always: a session's
        connect then costs no task); None when ``open`` has to be awaited."""
        endpoint = (host, port)
        if self._closing or self._refused_until.get(endpoint, 0.0) > time.monotonic():
            return None
        carriers = [c for c in self._carriers.get(endpoint, ()) if c.alive]
        if len(carriers) < self.per_node:
            return None
        return min(carriers, key=lambda c: len(c.channels)).open_channel(protocol_factory)

    async def open(self, host: str, port: int, protocol_factory: Callable[[], P]) -> tuple[asyncio.Transport, P]:
        """A new channel to ``host``:``port`` for a session's protocol. Raises as a connection would (OSError,
        TimeoutError, LinkClosedError), or ``SharedLinksRefusedError`` when the core refuses the gateway's user."""
        endpoint = (host, port)
        if self._closing:
            raise _stopping()
        refused_until = self._refused_until.get(endpoint)
        if refused_until is not None:
            now = time.monotonic()
            if refused_until <= now and endpoint not in self._connecting:
                # Tried again in the background: the core delays a refusal by its backoff for this address,
                # which grows with the gateway's own refused tries and may outlast a session's connect.
                self._refused_until[endpoint] = now + REFUSED_RETRY_SECONDS
                self._start_connect(endpoint)
            raise SharedLinksRefusedError(f"{host}:{port}")
        carriers = [c for c in self._carriers.get(endpoint, ()) if c.alive]
        if len(carriers) < self.per_node:
            carriers.append(await self._connect(endpoint))
        carrier = min(carriers, key=lambda c: len(c.channels))
        return carrier.open_channel(protocol_factory)

    async def _connect(self, endpoint: Endpoint) -> Carrier:
        """A new shared link to ``endpoint``; sessions asking meanwhile wait for the same one. The connect is a
        task of its own (bounded by the link's connect timeout): a session that gives up waiting, or whose
        client leaves, must not cancel it for the others (a resuming session would end cancelled, silently)."""
        pending = self._connecting.get(endpoint) or self._start_connect(endpoint)
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if pending.cancelled() and self._closing and task is not None and not task.cancelling():
                raise _stopping() from None  # ``close`` cancelled the connect
            raise

    def _start_connect(self, endpoint: Endpoint) -> asyncio.Task[Carrier]:
        pending = asyncio.get_running_loop().create_task(self._new_carrier(endpoint), name="shared link connect")
        self._connecting[endpoint] = pending
        pending.add_done_callback(lambda task: self._connected(endpoint, task))
        return pending

    def _connected(self, endpoint: Endpoint, task: asyncio.Task[Carrier]) -> None:
        if self._connecting.get(endpoint) is task:
            del self._connecting[endpoint]
        if task.cancelled():
            return
        error = task.exception()  # taken: every session that asked may have given up
        if error is not None and endpoint in self._refused_until and not isinstance(error, SharedLinksRefusedError):
            # A try again after a refusal, which no session waits for: said here, or never.
            log.info(
                "the gateway's shared core link is still not open: one link per client session",
                extra={"core": f"{endpoint[0]}:{endpoint[1]}", "reason": str(error) or type(error).__name__},
            )

    async def _new_carrier(self, endpoint: Endpoint) -> Carrier:
        client = LinkClient(
            *endpoint,
            user=self.user,
            password=self.password,
            client_name=f"{self.name} sessions",
            heartbeat_ms=self.heartbeat_ms,
            forgive_own_stalls=True,  # a gateway's: its stall must not drop every session the link carries
            reconnect=ReconnectPolicy(attempts=0, initial_attempts=1),
            connect_timeout=self.connect_timeout,
            tls=self.tls,
        )
        core = f"{endpoint[0]}:{endpoint[1]}"
        try:
            await client.connect()
        except LinkRequestError as exc:
            if exc.code != ErrorCode.UNAUTHENTICATED:
                raise
            self._refused_until[endpoint] = time.monotonic() + REFUSED_RETRY_SECONDS
            log.warning(
                "the core refused the gateway's core.user for a shared link: one link per client session instead",
                extra={"core": core, "reason": exc.text},
            )
            raise SharedLinksRefusedError(exc.text) from exc
        if self._closing:
            await client.close()
            raise _stopping()
        carrier = Carrier(self, client)
        self._refused_until.pop(endpoint, None)
        self._carriers.setdefault(endpoint, []).append(carrier)
        log.info("shared core link opened", extra={"core": core})
        return carrier

    def forget(self, carrier: Carrier) -> None:
        endpoint = (carrier.client.host, carrier.client.port)
        carriers = self._carriers.get(endpoint)
        if carriers is not None and carrier in carriers:
            carriers.remove(carrier)

    @property
    def stopping(self) -> bool:
        """The gateway closes its shared links: it stops."""
        return self._closing

    async def close(self) -> None:
        """Close every shared link (their sessions are lost, as by a closed connection)."""
        self._closing = True
        for pending in list(self._connecting.values()):
            pending.cancel()
        carriers = self.carriers
        self._carriers.clear()
        for carrier in carriers:
            await carrier.client.close()


def _stopping() -> LinkClosedError:
    """What a session asking for a channel gets once the shared links are closed: final, so that its connect or
    resume stops at once rather than trying the nodes again."""
    return LinkClosedError(ErrorCode.CLOSED_BY_OPERATOR, "the gateway is stopping")
