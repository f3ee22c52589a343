"""The asyncio shell of a core node: sockets, timers and the management server around the pure broker.

The only module of the core that awaits. Each link connection is an ``asyncio.Protocol`` feeding bytes to
its codec and events to the broker; all output is written once per event-loop iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Final, cast

from aiohttp import web

from tridentmq_core.audit import AuditSink, NullAuditSink
from tridentmq_core.audit_writer import FileAuditSink
from tridentmq_core.broker import Broker
from tridentmq_core.checks import BrokerError
from tridentmq_core.cluster.manager import ClusterManager, validate_cluster_settings
from tridentmq_core.ha.backup import BackupRunner
from tridentmq_core.ha.network_check import NetworkCheck, NetworkHealth, Reachability, parse_targets
from tridentmq_core.ha.pair import (
    BACKUP,
    FENCED_EXIT_CODE,
    REPLICATION,
    SHARED_STORE,
    mark_released,
    validate_ha_settings,
)
from tridentmq_core.ha.shared_store import SharedStore, epoch_directory, journal_for_epoch
from tridentmq_core.ha.source import ReplicationSource, stall_limit
from tridentmq_core.ha.voting import Voter, VoteStore, primary_may_activate
from tridentmq_core.logins import LoginGuard
from tridentmq_core.management.app import create_app
from tridentmq_core.management.operations_api import NodeControl
from tridentmq_core.management.status import NodeStatus, QueueRates
from tridentmq_core.node_links import client_tls
from tridentmq_core.security import AuthenticationError, Credentials, Permission, Principal, SecurityManager
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.data_lock import DataDirectoryLock, JournalLock
from tridentmq_core.store.identity import NodeIdentity
from tridentmq_core.store.journal import Journal, MessageReader
from tridentmq_core.store.journal_store import JournalStore
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.store.paging import PageDirectory, ThreadIO
from tridentmq_core.store.recovery import replay
from tridentmq_shared.http_limits import http_runner, serve
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import (
    BYTE_CREDIT_VERSION,
    MIN_FRAME_SIZE,
    MIN_HANDSHAKE_FRAME_SIZE,
    PUBLISH_HEADROOM,
    LinkConnection,
    Role,
    opens_channel,
)
from tridentmq_shared.link.errors import LinkError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.log_window import LogWindow
from tridentmq_shared.message import MAX_PROPERTIES
from tridentmq_shared.runtime import LISTEN_BACKLOG, random_hex, wall_ms
from tridentmq_shared.send_backlog import unacknowledged_bytes
from tridentmq_shared.settings import SettingsError
from tridentmq_shared.supervision import Supervisor, current
from tridentmq_shared.tls import HANDSHAKE_TIMEOUT_S, ServerTls
from tridentmq_shared.turn_pacer import TurnPacer

log = logging.getLogger("tridentmq.core")

TICK_SECONDS = 0.05
#: A link's large reads are handled in slices of this many bytes, and one loop turn handles at most about
#: ``INPUT_TURN_S`` of a link's input: the rest waits for the next turn, with reading paused. Without it, a read
#: of 256 KiB from each of six gateways' links whose 100,000 clients left at once took up to 0.6 s each, all in
#: one turn, and the node's answers and heartbeats waited until every gateway took its link for dead.
INPUT_SLICE_BYTES = 32 * 1024
INPUT_TURN_S = 0.02
#: The sessions of a lost link (a gateway's shared link) a turn ends at most, each in about 20 µs here; the rest
#: end in the turns after. A gateway killed with 9,500 sessions on its link held this node's loop for 0.2-0.35 s
#: as they all ended in one turn, and so every other link's answers and heartbeats.
CHANNEL_ENDS_PER_TURN = 200
#: The consumers of a lost link's session that go per turn (about 5 µs each here). An MQTT gateway's service
#: link holds the lock of each of its clients' sessions: one with 18,815 consumers took 0.1 s to close.
CONSUMERS_CLOSED_PER_TURN = 500
#: A HELLO still waiting for its password check at the handshake timeout: retryable (its check, once done,
#: is in the cache), unlike a peer that never sent HELLO.
LOGIN_BUSY = "the password checks of this address did not finish within the handshake timeout: retry"


#: Properties a message may have on a link: one more than clients may send (a message forwarded by another node
#: carries its header). One int for all links, not one per session.
_MAX_PROPERTIES: Final = MAX_PROPERTIES + 1

#: The derived link frame limit is never below this (the limit of version 1 peers, and the old default).
DEFAULT_LINK_FRAME_BYTES = 16 * 1024 * 1024


def check_limits(settings: CoreSettings) -> None:
    """Refuse values the node would run with but not work under, that the settings' own lower bounds (``least``,
    checked as they load) do not cover, and security entries that cannot mean what was meant, naming the key."""
    journal = settings.journal
    if not 0 < journal.compact_live_ratio <= 1:
        raise SettingsError(f"journal.compact_live_ratio is above 0 and at most 1, got {journal.compact_live_ratio:g}")
    names = [user.name for user in settings.users]
    if "" in names:
        raise SettingsError("users: a user has no name")
    if len(set(names)) < len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise SettingsError(f"users: {', '.join(twice)} listed more than once (the last entry would win)")
    known = {permission.value for permission in Permission}
    for entry in settings.permissions:
        if entry.permission not in known:
            raise SettingsError(
                f"permissions: {entry.permission!r} (match {entry.match!r}) is not one of {', '.join(sorted(known))}"
            )


#: A channel's frames travel inside its link's frames: this much of the link's frame limit is left for the
#: CHANNEL operation around them.
CHANNEL_FRAME_MARGIN = 1024


def link_frame_bytes(settings: CoreSettings) -> int:
    """The node's link frame limit: ``link.max_frame_bytes``, or derived from ``broker.max_message_bytes`` when
    that is 0, so that a message of the largest body accepted fits in a frame with its headers. A limit set by
    hand that leaves no such room is refused: the node would accept messages it cannot pass on."""
    max_message = settings.broker.max_message_bytes
    if max_message <= 0:
        raise SettingsError("broker.max_message_bytes must be positive")
    needed = max_message + PUBLISH_HEADROOM + CHANNEL_FRAME_MARGIN  # a gateway's sessions are channels
    configured = settings.link.max_frame_bytes
    if configured == 0:
        return max(needed, DEFAULT_LINK_FRAME_BYTES)
    if configured < max(needed, MIN_FRAME_SIZE):
        raise SettingsError(
            f"link.max_frame_bytes = {configured} cannot carry a message of broker.max_message_bytes "
            f"= {max_message} with its headers: set it to at least {needed}, or to 0 to derive it"
        )
    return configured


#: A channel's output goes in CHANNEL operations of at most this many bytes, and its link is written as soon
#: as this many are queued: the peer then decodes small link frames as they come, and neither side holds a
#: second copy of a large batch of deliveries for longer than a small frame takes.
CHANNEL_CHUNK_BYTES = 64 * 1024
_NO_CHANNELS: Final[dict[int, LinkProtocol]] = {}


class ChannelTransport:
    """The byte stream of one session multiplexed over a link (a CHANNEL), as a transport for the session's own
    ``LinkProtocol``: what the session writes goes out as CHANNEL operations of the link; closing it ends the
    channel on both sides."""

    __slots__ = ("channel_id", "closing", "link")

    def __init__(self, link: LinkProtocol, channel_id: int) -> None:
        self.link = link
        self.channel_id = channel_id
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        transport = self.link.transport
        return transport.get_extra_info(name, default) if name == "peername" and transport is not None else default

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        if self.closing:
            return
        link, channel_id = self.link, self.channel_id
        if len(data) <= CHANNEL_CHUNK_BYTES:
            link.channel_write(channel_id, data)
            return
        with memoryview(data) as view:
            for start in range(0, len(data), CHANNEL_CHUNK_BYTES):
                link.channel_write(channel_id, bytes(view[start : start + CHANNEL_CHUNK_BYTES]))

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.link.channel_closed(self.channel_id, tell_peer=True)

    abort = close


class LinkProtocol(asyncio.Protocol):
    """One link connection: bytes → codec → broker. A channel of a link (one session of a gateway's shared
    link) is a ``LinkProtocol`` too, over a ``ChannelTransport``: ``carrier`` is then its link."""

    # Slots: a gateway's channels come by the hundred thousand, one of these each (an instance dict cost 56
    # bytes more per session).
    __slots__ = (
        "_channel_bytes",
        "_held",
        "_login",
        "_unread",
        "_unread_at",
        "carrier",
        "channel_transport",
        "channels",
        "conn",
        "conn_id",
        "node",
        "opened",
        "peer",
        "session",
        "transport",
    )

    def __init__(self, node: CoreNode, carrier: LinkProtocol | None = None) -> None:
        self.node = node
        self.carrier = carrier
        # A link's input not handled yet (see ``_go_on``): a channel never has any (its link holds it).
        self._unread = b""  # the last read
        self._unread_at = 0  # where its unhandled part begins
        self._held: deque[tuple[int, bytes]] | None = None  # channel input taken from the read, not yet handled
        # One property more than clients may send: a message forwarded by another node carries its header.
        link = node.settings.link
        # A channel has no heartbeats of its own (its link's tell whether the peer lives), and frames that fit
        # in its link's with the CHANNEL operation around them.
        self.conn = LinkConnection(
            Role.SERVER,
            max_frame_size=node.link_frame_bytes if carrier is None else node.channel_frame_bytes,
            heartbeat_ms=0 if carrier is not None else link.heartbeat_ms,
            max_properties=_MAX_PROPERTIES,
            handshake_frame_size=link.handshake_max_frame_bytes,
            carries_channels=carrier is None,
            # A stall of this node (a full garbage collection of a large heap takes seconds) is not its peers'
            # silence: what they sent meanwhile waits unread. Its role after a pause is the replication
            # source's to decide (``CoreNode.awake``), not a heartbeat's.
            forgive_own_stalls=True,
        )
        # Sessions multiplexed over this link, by channel id (a channel's codec refuses any: it shares one
        # empty table, only ever read, instead of a dict of its own).
        self.channels: dict[int, LinkProtocol] = {} if carrier is None else _NO_CHANNELS
        self._channel_bytes = 0  # channel output queued since this link was last written
        self.channel_transport: ChannelTransport | None = None  # when this is a channel
        self.session: Session | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.conn_id = random_hex(12)
        self.opened = time.monotonic()
        self._login: asyncio.Task[None] | None = None  # a password check in progress

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        node = self.node
        if self.carrier is not None:
            self.peer = self.carrier.peer  # one string for all its sessions, not a copy each (58 bytes)
            if len(self.carrier.channels) > node.settings.link.max_channels:  # itself counted already
                self._refuse_connection("channels", "the link has its maximum of sessions (link.max_channels)")
                return
        else:
            peer = transport.get_extra_info("peername")
            self.peer = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if len(node.links) >= node.settings.link.max_connections:
                self._refuse_connection("connections", "the node has its maximum of connections")
                return
        if len(node.handshaking) >= node.settings.link.max_handshaking:
            self._refuse_connection("handshaking", "the node has its maximum of connections still in their handshake")
            return
        node.protocols[self.conn_id] = self
        if self.carrier is None:
            node.links[self.conn_id] = self
        node.handshaking.add(self.conn_id)

    def _refuse_connection(self, limit: str, text: str) -> None:
        """Refuse at once (cheap: a flood may be what filled the limit) and say so once per window."""
        if self.node.refusals.first(limit, time.monotonic()):
            log.warning(
                "connection refused: limit reached (further refusals counted once a minute)",
                extra={"limit": limit, "peer": self.peer},
            )
        self.conn.close(ErrorCode.RESOURCE_LIMIT, text)
        self.write_pending()
        self.close_transport()

    def data_received(self, data: bytes) -> None:
        if self.carrier is not None:  # a channel: its link hands it its input a slice at a time
            self._handle_input(data)
            return
        if self._unread_at < len(self._unread):  # read while paused (TLS may): after what waits, in order
            self._unread = self._unread[self._unread_at :] + data
            self._unread_at = 0
            return
        self._unread, self._unread_at = data, 0
        self._go_on()

    def _go_on(self) -> None:
        """Handle what this link has read, its channels' input first (it came before what is still unread),
        a slice at a time until the turn's time is up: the rest waits for a later turn, with reading paused,
        after this turn's output and timers."""
        deadline = time.monotonic() + INPUT_TURN_S
        while True:
            held = self._held
            if held:
                channel_id, data = held[0]
                if len(data) > INPUT_SLICE_BYTES:
                    held[0] = (channel_id, data[INPUT_SLICE_BYTES:])
                    data = data[:INPUT_SLICE_BYTES]
                else:
                    held.popleft()
                self._channel_input(channel_id, data)
            elif (start := self._unread_at) < len(self._unread):
                self._unread_at = start + INPUT_SLICE_BYTES
                data = self._unread
                self._handle_input(
                    data if self._unread_at >= len(data) and not start else data[start : self._unread_at]
                )
            else:
                self._unread = b""
                return
            transport = self.transport
            if transport is None or transport.is_closing():
                # What is left goes unanswered, as if lost on the way: nobody would read the answers.
                self._held, self._unread, self._unread_at = None, b"", 0
                return
            if time.monotonic() >= deadline and (self._held or self._unread_at < len(self._unread)):
                transport.pause_reading()
                asyncio.get_running_loop().call_soon(self._resume_input)
                return

    def _resume_input(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.resume_reading()  # nothing is read before this call returns, so input keeps its order
        try:
            self._go_on()
        except Exception:  # a bug: this link ends, as when its input fails in ``data_received``
            log.exception("link input failed", extra={"conn": self.conn_id, "peer": self.peer})
            transport.abort()

    def _handle_input(self, data: bytes) -> None:
        now = time.monotonic()
        self.node.awake(now)  # before this input, which may have waited out a stall
        try:
            events = self.conn.receive_data(data, now)
        except LinkError as exc:
            self.fail(exc)
            return
        if self.session is None:
            self._handshake(events)
        else:
            self.node.broker.handle(self.session, events, wall_ms())
        if self.conn.channel_data:
            self._hold_channels()
        self.node.schedule_flush()
        if self.conn.closed and self.transport is not None:
            # The client sent CLOSE: end the connection once this batch's output is written (over TCP the
            # client's half-close would end it too; TLS has none).
            asyncio.get_running_loop().call_soon(self.close_transport)

    # ------------------------------------------------------------------ channels (on a link)
    def _hold_channels(self) -> None:
        """Bytes of the sessions multiplexed over this link wait, in order, to be handled by ``_go_on``."""
        received, self.conn.channel_data = self.conn.channel_data or [], None
        if self.session is None:
            return  # not open (yet, or any more): the codec accepts no CHANNEL before WELCOME anyway
        if self._held is None:
            self._held = deque(received)
        else:
            self._held.extend(received)

    def _channel_input(self, channel_id: int, data: bytes) -> None:
        """A session's input: fed to its channel's protocol, made on its first bytes; empty bytes: the peer
        ended that session."""
        if self.session is None:
            return
        channel = self.channels.get(channel_id)
        if not data:
            if channel is not None:
                self._end_channel(channel_id, channel)
            return
        if channel is None:
            if not opens_channel(data):
                # Input that was on its way when this side ended the channel (on a fault, a refusal, its
                # CLOSE), in this batch or an earlier one: not a new session. Ending it again costs the
                # peer nothing and answers one that sent a new channel something other than HELLO.
                log.debug("input for no open link channel", extra={"conn": self.conn_id, "channel": channel_id})
                self.channel_write(channel_id, b"")
                return
            channel = self.channels[channel_id] = LinkProtocol(self.node, carrier=self)
            transport = channel.channel_transport = ChannelTransport(self, channel_id)
            channel.connection_made(cast(asyncio.Transport, transport))
            if transport.closing:  # refused at a limit
                return
        try:
            channel.data_received(data)
        except Exception:  # a bug: it ends this session, not every session the link carries
            log.exception(
                "link channel ended on an unexpected error", extra={"conn": self.conn_id, "channel": channel_id}
            )
            self._fail_channel(channel_id, channel)

    def _fail_channel(self, channel_id: int, channel: LinkProtocol) -> None:
        """End a channel whose input met a fault of the node: with what it has to say first (answers, confirms)
        and a CLOSE ``internal``, on which its client does not resume (it would send the same input again)."""
        if self.channels.get(channel_id) is channel:
            try:
                channel.conn.close(ErrorCode.INTERNAL, "the node failed on this session's input (see its log)")
                channel.write_pending()
            except Exception:  # its codec is what failed, say: the end alone must do
                log.exception("link channel's CLOSE not sent", extra={"conn": self.conn_id, "channel": channel_id})
        self.channel_closed(channel_id, tell_peer=True)

    def channel_write(self, channel_id: int, data: bytes) -> None:
        """A channel's output, carried as a CHANNEL operation of this link (written with this turn's flush)."""
        if self.conn.open:
            self.conn.channel(channel_id, data)
            self._channel_bytes += len(data)
            if self._channel_bytes >= CHANNEL_CHUNK_BYTES:
                self.write_pending()
                return
            node = self.node
            node.carriers.add(self)
            if not node.writing_sessions:  # (else written below in that flush, not in one more a turn later)
                node.schedule_flush()

    def channel_closed(self, channel_id: int, *, tell_peer: bool) -> None:
        """A channel's session ended here (a refusal, a protocol error, a shutdown): the peer learns it."""
        channel = self.channels.get(channel_id)
        if channel is None:
            return
        if tell_peer:
            self.channel_write(channel_id, b"")
        self._end_channel(channel_id, channel)

    def _end_channel(
        self, channel_id: int, channel: LinkProtocol, call_soon: Callable[..., object] | None = None
    ) -> None:
        del self.channels[channel_id]
        if channel.channel_transport is not None:
            channel.channel_transport.closing = True
        # Like a socket's end, a loop turn later (or as ``call_soon`` paces it): the caller may be in the middle
        # of the node's flush.
        (call_soon or asyncio.get_running_loop().call_soon)(channel.connection_lost, None)

    # ------------------------------------------------------------------ handshake
    def _handshake(self, events: list[ev.Event]) -> None:
        for event in events:
            if not isinstance(event, ev.HelloReceived):
                continue
            if self.conn.closed:  # its CLOSE came with it: nobody waits for an answer, nor is one allowed
                log.info(
                    "link closed by its peer during the handshake",
                    extra={"peer": self.peer, "client": event.client_name},
                )
                self.close_transport()
                return
            if not self.node.serving:
                self._refuse(ErrorCode.NOT_ACTIVE, self.node.not_serving_reason())
                return
            carrier = self.carrier
            if carrier is not None and event.acting_for is not None and carrier.session is not None:
                # A session asserted by its link's user (a gateway that authenticated the client): no password
                # here; ``_open`` lets only link.proxy_users do so.
                self._open(event, carrier.session.principal)
                return
            logins = self.node.logins
            try:
                found = self.node.credentials(event.user, self.peer, event.client_host)
            except AuthenticationError as exc:
                refusal = logins.refuse(self.peer, event.user, str(exc), event.client_host)
                task = asyncio.get_running_loop().create_task(self._refuse_after(refusal, str(exc)))
                self._login = self.node.supervisor.watch(task, "login refusal")
                return
            if isinstance(found, Principal):
                self._open(event, found)
                return
            password = event.password or ""
            if found.principal is not None and logins.known_good(found, event.user or "", password):
                self._open(event, found.principal())
                return
            # PBKDF2, or a refusal after the backoff delay: off the loop, while other links carry on.
            task = asyncio.get_running_loop().create_task(self._log_in(event, found, password))
            self._login = self.node.supervisor.watch(task, "login")
            return

    async def _log_in(self, event: ev.HelloReceived, found: Credentials, password: str) -> None:
        matched = await self.node.logins.verify(found, event.user or "", password, self.peer, event.client_host)
        if self.conn.closed or self.transport is None or self.transport.is_closing():
            return  # gone meanwhile (or timed out)
        if not self.node.serving:
            self._refuse(ErrorCode.NOT_ACTIVE, self.node.not_serving_reason())
        elif matched and found.principal is not None:
            self._open(event, found.principal())
        else:
            self._refuse(ErrorCode.UNAUTHENTICATED, found.refusal)

    async def _refuse_after(self, delay: Coroutine[Any, Any, None], text: str) -> None:
        await delay
        if not (self.conn.closed or self.transport is None or self.transport.is_closing()):
            self._refuse(ErrorCode.UNAUTHENTICATED, text)

    def _refuse(self, code: str, text: str) -> None:
        self.conn.refuse(code, text)
        self.write_pending()
        self.close_transport()

    def _open(self, event: ev.HelloReceived, principal: Principal) -> None:
        node = self.node
        if event.acting_for is not None:
            try:
                principal = node.act_for(principal, event.acting_for)
            except AuthenticationError as exc:
                log.warning(
                    "link refused",
                    extra={
                        "peer": self.peer,
                        "user": principal.name,
                        "acting_for": event.acting_for,
                        "reason": str(exc),
                    },
                )
                self._refuse(ErrorCode.UNAUTHENTICATED, str(exc))
                return
        link = node.settings.link
        window = link.publish_window
        if self.conn.version < BYTE_CREDIT_VERSION:  # no byte credit: the message window alone bounds bytes
            window = min(window, max(1, link.publish_window_bytes // node.settings.broker.max_message_bytes))
        self.conn.accept(
            node.node_id, self.conn_id, window, time.monotonic(), node.identity.epoch, link.publish_window_bytes
        )
        node.handshaking.discard(self.conn_id)
        self.session = node.broker.open_session(
            self.conn, self.conn_id, principal, self.peer, event.client_name, wall_ms()
        )
        if self.carrier is not None and self.carrier.session is not None:
            self.session.carrier_principal = self.carrier.session.principal
        self.write_pending()
        if self.carrier is None:  # a gateway's sessions come by the thousand: their link is logged
            log.info(
                "link opened",
                extra={"conn": self.conn_id, "peer": self.peer, "client": event.client_name, "user": principal.name},
            )

    def fail(self, exc: LinkError) -> None:
        log.warning(
            "link closed on protocol error",
            extra={"conn": self.conn_id, "peer": self.peer, "code": exc.code, "reason": exc.text},
        )
        self.write_pending()
        if exc.code == ErrorCode.HEARTBEAT_TIMEOUT and self.transport is not None:
            # A silent peer (dead, paused, cut off) never reads: a close would wait for the buffered output to
            # drain for ever, and the session, still open, would hide the loss (a backup's, say).
            self.transport.abort()
            return
        self.close_transport()

    def write_pending(self) -> None:
        self._channel_bytes = 0
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        node = self.node
        node.protocols.pop(self.conn_id, None)
        node.links.pop(self.conn_id, None)
        node.handshaking.discard(self.conn_id)
        node.carriers.discard(self)
        if self._login is not None:
            self._login.cancel()  # its check, if not yet running, never runs
            self._login = None
        # The sessions this link carried end with it, each as if its own connection had dropped: thousands of
        # them, a turn's worth at a time, but their consumers stop and their wills go out at once. A client's next
        # session may open through another link before its old one's turn, as when the core has not yet seen a
        # link's failure (its heartbeat timeout).
        lost = [c.session for c in self.channels.values() if c.session is not None]
        if self.session is not None and len(self.session.consumers) > CONSUMERS_CLOSED_PER_TURN:
            lost.append(self.session)  # it closes over several turns too (see ``_close``)
        if lost:
            node.broker.links_lost(lost, wall_ms())
            node.schedule_flush()
        ends = node.channel_ends
        for channel_id, channel in list(self.channels.items()):
            self._end_channel(channel_id, channel, ends.call_soon)
        if self.session is not None:
            self._close(self.session)
            if self.carrier is None:
                log.info("link closed", extra={"conn": self.conn_id, "peer": self.peer})
            self.session = None

    def _close(self, session: Session) -> None:
        """Close the session of this lost link ``CONSUMERS_CLOSED_PER_TURN`` consumers at a time."""
        node = self.node
        if not node.broker.close_session(session, wall_ms(), at_most=CONSUMERS_CLOSED_PER_TURN):
            node.channel_ends.call_soon(self._close, session)
        node.schedule_flush()


class CoreNode:
    """A running core node: listener, broker, timers, management."""

    def __init__(
        self, settings: CoreSettings, *, ports_file: Path | None = None, supervisor: Supervisor | None = None
    ) -> None:
        self.settings = settings
        # Its timers and callbacks run under the process's supervisor: one that fails ends readiness.
        self.supervisor = supervisor or current()
        self.supervisor.on_failure.append(self._task_failed)
        self._flush_soon = self.supervisor.guard("flush", self._flush)
        self._in_loop_soon = self.supervisor.guard("journal callback", self._in_loop)
        self.ports_file = ports_file
        self.link_frame_bytes = link_frame_bytes(settings)
        self.channel_frame_bytes = self.link_frame_bytes - CHANNEL_FRAME_MARGIN  # (one int, not one per session)
        if not MIN_HANDSHAKE_FRAME_SIZE <= settings.link.handshake_max_frame_bytes <= self.link_frame_bytes:
            raise SettingsError(
                f"link.handshake_max_frame_bytes must be between {MIN_HANDSHAKE_FRAME_SIZE} and link.max_frame_bytes"
            )
        check_limits(settings)
        data_dir = settings.node.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.lock = DataDirectoryLock(data_dir)  # before touching anything in it
        ha = settings.ha
        shared = Path(ha.shared_directory) if ha.policy == SHARED_STORE and ha.shared_directory else None
        if shared is not None:
            shared.mkdir(parents=True, exist_ok=True)
        # Held while this process lives: `data compact` on a journal set apart from the data directory would
        # otherwise swap it from under the node. A shared-store node locks its epoch's journal on activation.
        self.journal_lock: JournalLock | None = None
        if settings.journal.enabled and shared is None:
            self.journal_lock = JournalLock(Path(settings.journal.directory or data_dir / "journal"))
        self.identity = NodeIdentity(shared or data_dir)  # a shared-store pair has one identity
        self.node_id = self.identity.node_id
        self.security = SecurityManager(
            settings.users, settings.permissions, allow_anonymous_remote=settings.security.allow_anonymous_remote
        )
        self.logins = LoginGuard(settings.login)
        self.audit: AuditSink = NullAuditSink()  # opened on activation, under the node id it serves as
        # Emptied at start: paged messages are journaled or volatile. Its I/O thread reports to the loop.
        self.pages = PageDirectory(data_dir / "paging", ThreadIO(self._call_in_loop))
        # Message ids start at the clock (ms) shifted left 20 bits: unique across restarts of this node
        # unless it accepts more than a million messages per millisecond.
        self.broker = Broker(
            self.node_id,
            settings,
            store=MemoryStore(),
            audit=self.audit,
            first_message_id=wall_ms() << 20,
            audit_messages=settings.audit.message_events,
            pager_factory=self.pages.pager,
            paging_behind=self.pages.io.behind,
        )
        self.journal: Journal | None = None
        self.journal_store: JournalStore | None = None
        self.status = NodeStatus(started_at=time.time(), epoch=self.identity.epoch)
        self.status.links = lambda: len(self.links)
        self.rates = QueueRates()
        self.protocols: dict[str, LinkProtocol] = {}  # links and the channels they carry, by connection id
        self.links: dict[str, LinkProtocol] = {}  # the links alone (connections)
        self.carriers: set[LinkProtocol] = set()  # links with channel output to write at this turn's flush
        self.channel_ends = TurnPacer(CHANNEL_ENDS_PER_TURN, log)  # the sessions of lost links
        self.writing_sessions = False  # ``_flush`` is writing the sessions: their links' output follows in it
        self.handshaking: set[str] = set()  # connections that have not completed HELLO (link.max_handshaking)
        self.refusals = LogWindow(60.0)  # connections refused at a limit, logged once a minute per limit
        self._flush_scheduled = False
        self._server: asyncio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._timer: asyncio.Task[None] | None = None
        self._network_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.management_port = 0
        self.clusters = validate_cluster_settings(settings)
        validate_ha_settings(settings, self.clusters)
        self.cluster: ClusterManager | None = None
        # High availability: a backup serves no client until it takes over (``active``).
        self.is_backup = settings.ha.policy == REPLICATION and settings.ha.role == BACKUP
        self.active = False
        self.server_id = f"{settings.node.name}-{uuid.uuid4().hex[:8]}"  # this process, in votes and logs
        self.votes = VoteStore(data_dir) if self.clusters else None
        self.voter = Voter(self.votes, settings, lambda: self.cluster) if self.votes is not None else None
        self.replication: ReplicationSource | None = None
        # When this process last ran (a link's input or a tick), and how long it may stand still before its
        # backup could have taken over: past that, its replication source is told before any input is handled.
        self.turned_at = time.monotonic()
        self.stall_limit = stall_limit(settings) if settings.ha.policy == REPLICATION else math.inf
        self.scale_down_requested = False  # an operator asked this node to scale down and stop
        self.backup: BackupRunner | None = None
        self.shared: SharedStore | None = None
        self._shared_journal: Path | None = None  # the shared-store pair's journal of this epoch
        self.network = self._network_check()
        self.isolated = False  # the network check reached none of its targets: serve nobody
        self.joining = False  # activated, learning the other nodes' queues before serving
        settings.tls.check()
        tls_listener = settings.link.tls or settings.management.tls
        self.tls = ServerTls(settings.tls) if tls_listener else None
        if settings.link.tls:
            client_tls(settings.tls)  # its files are loaded now: a mistake stops the start, not a later link

    def credentials(self, user: str | None, peer: str, client_host: str | None = None) -> Principal | Credentials:
        """The cluster user (when the node clusters) is checked against the cluster credentials, every
        other user against the configured users."""
        cluster = self.settings.cluster
        if self.clusters and user == cluster.user:
            return Credentials(
                cluster.password,
                lambda: Principal(f"cluster:{user}", frozenset(), unrestricted=True, cluster=True),
                "wrong cluster credentials",
            )
        return self.security.credentials(user, peer, client_host)

    def act_for(self, principal: Principal, user: str) -> Principal:
        """The principal of ``user`` for a link that ``principal`` (a gateway) opened for it, vouching for its
        identity (a client certificate): only ``link.proxy_users`` may, for configured users."""
        if self.security.embedded_default:
            return self.security.unrestricted(user)  # the gateway's link was already let in
        if principal.cluster or principal.name not in self.settings.link.proxy_users:
            raise AuthenticationError(f"user {principal.name} may not open links for other users (link.proxy_users)")
        return self.security.principal_of(user)

    def _network_check(self) -> NetworkCheck | None:
        settings = self.settings.network_check
        if not settings.targets:
            return None
        try:
            targets = parse_targets(settings.targets)
        except ValueError as exc:
            raise SettingsError(f"network_check.targets: {exc}") from None
        health = NetworkHealth(failures_to_isolate=settings.failures_to_isolate)
        return NetworkCheck(targets, settings.timeout_ms / 1000, health)

    @property
    def serving(self) -> bool:
        return self.active and not self.isolated and not (self.replication is not None and self.replication.cut_off)

    def not_serving_reason(self) -> str:
        if self.joining:
            return "this node is joining its cluster (learning the other nodes' queues): try again in a moment"
        if self.isolated:
            return "this node is cut off from its network (network check): connect to another node"
        if self.active:
            return "this node is cut off from its backup and from a quorum: connect to its backup"
        return "this node is a backup: connect to the active node"

    def _cut_off(self) -> None:
        self._close_client_links(ErrorCode.NOT_ACTIVE, self.not_serving_reason())

    async def _check_network_forever(self, network: NetworkCheck) -> None:
        period = self.settings.network_check.period_ms / 1000
        while True:
            change = await network.run_round()
            if change is Reachability.ISOLATED:
                self.isolated = True
                self._close_client_links(ErrorCode.NOT_ACTIVE, self.not_serving_reason())
            elif change is Reachability.REACHABLE:
                self.isolated = False
            await asyncio.sleep(period)

    def _open_audit(self) -> None:
        audit = self.settings.audit
        if audit.enabled:
            audit_dir = Path(audit.directory) if audit.directory else self.settings.node.data_dir / "audit"
            self.audit = FileAuditSink(
                audit_dir,
                self.node_id,
                epoch=self.identity.epoch,
                roll_bytes=audit.roll_bytes,
                roll_seconds=audit.roll_seconds,
                heartbeat_seconds=audit.heartbeat_seconds,
            )
            self.broker.audit = self.audit

    def _journal_dir(self) -> Path:
        if self._shared_journal is not None:
            return self._shared_journal
        return Path(self.settings.journal.directory or self.settings.node.data_dir / "journal")

    def _recover(self) -> None:
        """Replay the journal into the broker before anyone can connect, then journal from here on."""
        journal_settings = self.settings.journal
        if not journal_settings.enabled:
            log.warning("journal disabled: durable messages will not survive a restart")
            return
        journal = Journal(
            self._journal_dir(),
            segment_bytes=journal_settings.segment_bytes,
            sync_delay_us=journal_settings.sync_delay_us,
        )
        started = time.monotonic()
        dedup_limit = self.settings.broker.dedup_max_entries
        # Messages only paging queues hold stay in the segments until restore reads them back into their
        # queues, which page them: a restart then needs the paging limits, not the whole backlog, in memory.
        pages = self.broker.catalog.pages
        state, report = journal.recover(lambda records: replay(records, dedup_limit, pages))
        reader = MessageReader(journal.directory)
        try:
            self.broker.restore(state, wall_ms(), reader)
        finally:
            reader.close()
        for line in report.truncated:
            log.warning("journal tail cut off after a crash", extra={"detail": line})
        self.status.recovered = state.queue_counts()
        self.status.truncated = list(report.truncated)
        log.info(
            "journal recovered",
            extra={
                "segments": report.segments,
                "records": report.records,
                "messages": state.live_messages(),
                "queues": len(state.queues),
                "uncommitted_transactions_dropped": state.uncommitted,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        store = JournalStore(
            journal,
            self._call_in_loop,
            compact_min_segments=journal_settings.compact_min_segments,
            compact_live_ratio=journal_settings.compact_live_ratio,
        )
        self.journal_store = store
        self.broker.store = store
        # A record never spans segments: refuse at publish a durable body the journal could not write.
        segment = journal_settings.segment_bytes
        self.broker.admission.max_durable_body = min(
            self.settings.broker.max_message_bytes, segment - min(PUBLISH_HEADROOM, segment // 2)
        )
        store.attach(self.broker.on_durable)
        journal.on_error = lambda: self._call_in_loop(self._journal_error_changed)
        # At each new segment too, not only once a second: a fast producer took a small disk from 90 % to full
        # within the second, and a full disk leaves no room for the acknowledgements that would drain it.
        journal.on_segment = lambda: self._call_in_loop(self._check_disk)
        journal.start()
        self.journal = journal
        self.status.journal = journal

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        """From another thread: run ``fn`` on the loop, then write what it produced."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: we are shutting down
                loop.call_soon_threadsafe(self._in_loop_soon, fn)

    def _in_loop(self, fn: Callable[[], None]) -> None:
        self.awake(time.monotonic())  # a journal sync that completes on waking must not confirm first
        fn()
        self.schedule_flush()  # what it produced (confirms, deliveries) must be written

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        link = self.settings.link
        link_tls = self.tls.context if self.tls is not None and link.tls else None
        self._server = await loop.create_server(
            lambda: LinkProtocol(self),
            link.host,
            link.port,
            ssl=link_tls,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if link_tls is not None else None,
            backlog=LISTEN_BACKLOG,
        )
        self.status.link_port = self._server.sockets[0].getsockname()[1]
        if self.settings.management.enabled:
            management = self.settings.management
            control = NodeControl(
                flush=self.schedule_flush,
                close_link=self.close_link,
                failback=self._failback,
                scale_down=self._request_scale_down,
                forget_node=self._forget_node,
                tls_ca_file=self.settings.tls.ca_file,
                https=management.tls,
            )
            app = create_app(self.broker, self.status, self.rates, self.security, control)
            self._runner = http_runner(app, request_timeout_ms=management.request_timeout_ms)
            await self._runner.setup()
            management_tls = self.tls.context if self.tls is not None and management.tls else None
            self.management_port = await serve(
                self._runner,
                management.host,
                management.port,
                tls=management_tls,
                max_connections=management.max_connections,
                listener="management",
            )
        self._timer = self.supervisor.spawn("tick", self._tick_forever)
        if self.network is not None:
            # One round before anything serves or takes over: until then the node does not know where it is.
            if await self.network.run_round() is Reachability.ISOLATED:
                self.isolated = True
            network = self.network
            self._network_task = self.supervisor.spawn(
                "network check", lambda: self._check_network_forever(network), restart=True
            )
        if self.settings.ha.policy == REPLICATION and not self.is_backup:
            may, why = await primary_may_activate(self.settings, self.identity, self.server_id)
            if not may:
                log.warning("starting as a backup", extra={"reason": why})
                self.is_backup = True
        if self.settings.ha.policy == SHARED_STORE:
            # The lease numbers the activations; the identity's epoch (1 before any) is only a floor for it.
            self.shared = SharedStore(
                self.settings,
                self.identity.data_dir,
                self.server_id,
                self.identity.epoch - 1,
                self._activate_shared,
                self._fenced,
            )
            self.status.ha = self._ha_status
            self.shared.start()
            log.info(
                "shared-store node started: waiting for the lease",
                extra={"server_id": self.server_id, "directory": str(self.shared.directory)},
            )
        elif self.is_backup:
            self.backup = BackupRunner(
                self.settings,
                self.identity,
                self.server_id,
                self._journal_dir(),
                self._advertise(),
                self._call_in_loop,
                self.activate,
                lambda: self.isolated,
                self.supervisor.fail,
            )
            self.status.ha = self._ha_status
            self.backup.start()
            log.info(
                "backup started: looking for its primary",
                extra={"group": self.settings.ha.group_name, "server_id": self.server_id},
            )
        else:
            await self.activate()
        if self.ports_file is not None:
            tmp = self.ports_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"link": self.status.link_port, "management": self.management_port}))
            tmp.replace(self.ports_file)

    async def activate(self) -> None:
        """Serve: recover the journal, join the cluster, accept clients (at start, or when a backup takes over)."""
        self.node_id = self.identity.node_id
        self.status.epoch = self.identity.epoch
        self.broker.assume_identity(self.node_id)
        self.broker.number_from(wall_ms() << 20)  # as at the start of the process: ids grow with time
        self._open_audit()
        self._recover()
        await self._start_cluster()
        if self.voter is not None:
            self.voter.observe(self.node_id, self.identity.epoch)  # asked about its own pair, it knows this
            self.broker.on_ha = self._on_ha
        if self.settings.ha.policy == REPLICATION and self.journal_store is not None:
            self.replication = ReplicationSource(
                self.broker,
                self.journal_store,
                self.identity,
                self.server_id,
                self.settings,
                lambda: self.cluster,
                lambda: self.cluster.members_view() if self.cluster is not None else [],
                self._fenced,
                self._hand_over,
                self.drop_link,
                self.abort_link,
                self._cut_off,
                self._serve_at,
                self.link_backlog,
            )
            self.status.ha = self._ha_status
            if self.cluster is not None:
                self.cluster.backup = self.replication.in_sync_backup
        if self.settings.ha.policy == REPLICATION:
            self.audit.emit(
                wall_ms() * 1000,
                "ha.activated",
                {"configured_role": self.settings.ha.role, "group": self.settings.ha.group_name},
            )
        self.active = True
        self.status.not_serving = lambda: self._journal_problem() if self.serving else self.not_serving_reason()
        self.status.ready = True
        if self.security.embedded_default and self.security.allow_anonymous_remote:
            log.warning(
                "NO USERS CONFIGURED and security.allow_anonymous_remote: every client, from any host, "
                "is accepted with any credentials and has every right"
            )
        elif self.security.embedded_default:
            log.warning(
                "NO USERS CONFIGURED: clients on this host (loopback) are accepted with any credentials "
                "and every right; clients from other hosts, directly or through a gateway, are refused; "
                "configure [[users]] before exposing this node"
            )
        log.info(
            "core node ready",
            extra={
                "node_id": self.node_id,
                "node_name": self.settings.node.name,
                "epoch": self.identity.epoch,
                "link_port": self.status.link_port,
                "management_port": self.management_port,
            },
        )

    async def _start_cluster(self) -> None:
        """Join the cluster, if this node has one (when it activates, or serves again after a failed failback)."""
        if not self.clusters:
            return
        self.cluster = ClusterManager(
            self.broker,
            self.settings,
            node_id=self.node_id,
            name=self.settings.node.name,
            advertise=self._advertise(),
            schedule_flush=self.schedule_flush,
            management_port=self.management_port,
            epoch=self.identity.epoch,
            voter=self.voter,
            server_id=self.server_id,
        )
        self.status.cluster = self.cluster.status
        self.cluster.on_fenced = self._fenced
        await self.cluster.start()
        await self._join_cluster(self.cluster)
        if self.replication is not None:
            self.cluster.backup = self.replication.in_sync_backup

    def _serve_at(self, epoch: int) -> None:
        """The pair moved to a new ``epoch`` (recorded already): stamp it on what this node says from now on."""
        self.status.epoch = epoch
        if isinstance(self.audit, FileAuditSink):
            self.audit.epoch = epoch
        if self.voter is not None:
            self.voter.observe(self.node_id, epoch)
        if self.cluster is not None:
            self.cluster.epoch = epoch
            self.cluster.members_changed()

    async def _join_cluster(self, cluster: ClusterManager) -> None:
        """Before serving, learn the queues of the other nodes (until then links are refused as "joining"): a
        node that served at once would acknowledge a publish to a subscription held elsewhere and route it
        nowhere, as a backup that took over did to MQTT sessions on the other pairs."""
        wait = self.settings.cluster.join_wait_ms / 1000
        if wait <= 0:
            return
        self.joining = True
        started = time.monotonic()
        try:
            primary = self.backup.primary if self.backup is not None else ""
            reported, known = await cluster.join(wait, ignore=(primary,) if primary else ())
        finally:
            self.joining = False
        log.info(
            "joined the cluster",
            extra={
                "nodes_reported": reported,
                "nodes_known": known,
                "waited_ms": round((time.monotonic() - started) * 1000),
            },
        )

    async def _activate_shared(self, epoch: int) -> None:
        """This node won the shared-store lease at ``epoch``: take the journal over into this epoch's directory
        (a fenced holder may still write into the old one) and serve, confirming only while the lease holds."""
        shared = self.shared
        assert shared is not None
        self.identity = NodeIdentity(shared.directory)  # the other half may have created it
        self.identity.set_epoch(epoch)
        # Before writing it; the older epochs are not locked: a fenced holder may still hold its own.
        if self.journal_lock is not None:
            self.journal_lock.release()
        self.journal_lock = JournalLock(epoch_directory(shared.directory, epoch))
        self._shared_journal = await asyncio.to_thread(
            journal_for_epoch, shared.directory, epoch, self.settings.journal.segment_bytes
        )
        await self.activate()
        store = self.journal_store
        if store is not None:
            store.gate = shared.valid
            shared.on_renewed = store.recheck

    def drop_link(self, conn_id: str) -> None:
        """Send what a link has queued (its CLOSE) and close its connection."""
        protocol = self.protocols.get(conn_id)
        if protocol is not None:
            self.audit.flush()
            protocol.write_pending()
            protocol.close_transport()

    def close_link(self, conn_id: str, code: str, text: str) -> None:
        """Close a link telling its peer why (an operator's close)."""
        protocol = self.protocols.get(conn_id)
        if protocol is not None:
            protocol.conn.close(code, text)
            self.drop_link(conn_id)

    def _failback(self) -> str | None:
        if self.replication is None:
            return "this node is not the active half of a replication pair"
        return self.replication.request_failback()

    def _forget_node(self, node_id: str) -> dict[str, Any]:
        if self.cluster is None:
            raise ValueError("this node is not part of a cluster")
        return self.cluster.forget(node_id)

    def _request_scale_down(self) -> None:
        """Stop as on SIGTERM, moving every message to the other nodes first (even with ``cluster.scale_down``
        off), once the answer to the operator is out."""
        self.scale_down_requested = True
        log.warning("scale-down requested by an operator: moving every message to other nodes, then stopping")
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)

    def awake(self, now: float) -> None:
        """Called first by everything that runs on the loop and may confirm a write (a link's input, a
        journal sync's completion, the tick). If this process ran nothing (paused, or its loop blocked) for
        longer than ``stall_limit``, its pair's backup may have taken over meanwhile: the replication source
        hears of it before anything that waited out the stall is handled."""
        if now - self.turned_at > self.stall_limit and self.replication is not None:
            self.replication.stalled(now - self.turned_at)
        self.turned_at = now

    def link_backlog(self, conn_id: str) -> int | None:
        """Bytes written to a link's connection that its peer has not acknowledged; None without one."""
        protocol = self.protocols.get(conn_id)
        if protocol is None or protocol.transport is None or protocol.carrier is not None:
            return None
        return unacknowledged_bytes(protocol.transport)

    def abort_link(self, conn_id: str) -> None:
        """Drop a link's connection at once: its peer does not read (a close would wait for it for ever)."""
        protocol = self.protocols.get(conn_id)
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()

    def _advertise(self) -> tuple[str, int]:
        """The link endpoint other nodes and gateways reach this node at."""
        link = self.settings.link
        host = self.settings.cluster.advertise_host or (
            link.host if link.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        )
        return host, self.status.link_port

    def _on_ha(self, session: Session, event: ev.Event) -> Any:
        match event:
            case ev.VoteRequested(_, request) if self.voter is not None:
                return self.voter.vote(session, request)
            case ev.Replicate(_, info) if self.replication is not None:
                return self.replication.replicate(session, info)
            case ev.ReplicaAck(upto) if self.replication is not None:
                self.replication.acked(session, upto)
                return None
        raise BrokerError(ErrorCode.INVALID, "this node is not the active half of a replication pair")

    def _ha_status(self) -> dict[str, Any]:
        ha = self.settings.ha
        # "active" is the truth a client can use: a copy that is cut off (it may have been replaced) or isolated
        # serves nobody, and says why in "state".
        view: dict[str, Any] = {
            "group": ha.group_name,
            "configured_role": ha.role,
            "active": self.serving,
            "epoch": self.identity.epoch,
            "server_id": self.server_id,
        }
        if self.active and not self.serving:
            view["state"] = self.not_serving_reason()
        if self.backup is not None and not self.active:
            view.update(self.backup.status())
        if self.shared is not None:
            view.update(self.shared.status())
        if self.replication is not None:
            view.update(self.replication.status())
        return view

    async def _hand_over(self) -> None:
        """Failback: stop serving, let the returned primary (our in-sync backup) copy the last records, tell
        it to take over, then start again as the backup this node is configured to be."""
        replication = self.replication
        assert replication is not None
        self.active = False  # new links are refused from here on
        backup_session = replication.session
        self.audit.flush()
        # The links move to the returned primary, their clients alive: no will is published here.
        self.broker.wills.forget_held(self.broker.sessions.values())
        for protocol in list(self.protocols.values()):
            if protocol.session is not backup_session:
                protocol.conn.close(ErrorCode.NOT_ACTIVE, "the pair goes back to its primary")
                protocol.write_pending()
                protocol.close_transport()
        if self.cluster is not None:
            await self.cluster.stop()
            self.cluster = None
        if not await replication.drained():
            log.error("failback: the primary went away before it held everything; serving again")
            # As any node that lost its backup: in the cluster again, and confirming once the backup's loss
            # is settled (by a quorum if it was in sync: it may take over; so after joining, to ask the others).
            await self._start_cluster()
            replication.failback_failed()
            self.active = True
            return
        replication.release_backup()
        mark_released(self.identity.data_dir)
        self.audit.emit(wall_ms() * 1000, "ha.failback", {"to": replication.backup})
        self._flush()
        await asyncio.sleep(0.2)  # the CLOSE reaches the primary
        log.warning("failback done: restarting as a backup", extra={"epoch": self.identity.epoch})
        if self.journal is not None:
            self.journal.close()
        self.audit.close()
        if self.journal_lock is not None:
            self.journal_lock.release()
        self.lock.release()
        logging.shutdown()
        os.execv(sys.executable, sys.orig_argv)  # noqa: S606 - the same command: this node starts again as a backup

    def _fenced(self, reason: str) -> None:
        """Another copy of this pair took over: stop at once, before confirming anything more."""
        log.critical(
            "fenced: another copy of this pair is active; stopping (restart this node to make it a "
            "backup of the active one)",
            extra={"reason": reason, "epoch": self.identity.epoch},
        )
        self.active = False
        for protocol in list(self.protocols.values()):
            protocol.close_transport()
        if self.settings.ha.policy == REPLICATION:
            # A fresher copy serves: this one must copy it before it may serve again. Else a restart that no
            # voter answers (the whole cluster starting) would serve this stale copy again.
            with contextlib.suppress(OSError):
                mark_released(self.identity.data_dir)
        self.audit.emit(wall_ms() * 1000, "ha.fenced", {"reason": reason})
        self.audit.close()
        os._exit(FENCED_EXIT_CODE)  # no clean stop: a clean stop would scale down or confirm what is held

    def _task_failed(self, reason: str) -> None:
        """A timer or callback failed: this node no longer says it is ready (its entry point stops it)."""
        self.status.ready = False
        self.status.failure = reason

    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush_soon)  # the kept loop: no getpid() call

    def _flush(self) -> None:
        """Dispatch what the last batch of events made deliverable, then write each touched link once."""
        self._flush_scheduled = False
        broker = self.broker
        broker.flush_dispatch(wall_ms())
        if self.replication is not None:
            self.replication.pump()
        protocols = self.protocols
        # The audit events of what this turn confirms reach the file before the confirms reach the wire.
        self.audit.flush()
        self.writing_sessions = True
        try:
            for session in broker.take_dirty():
                protocol = protocols.get(session.conn_id)
                if protocol is None:
                    continue
                try:
                    protocol.write_pending()
                except LinkError as exc:  # an operation larger than the peer accepts: a bug, not the peer's
                    log.exception("cannot frame output", extra={"conn": session.conn_id, "reason": exc.text})
                    protocol.close_transport()
        finally:
            self.writing_sessions = False
        if self.carriers:  # after the channels' own output, which travels in their links' frames
            carriers, self.carriers = self.carriers, set()
            for protocol in carriers:
                protocol.write_pending()

    async def _tick_forever(self) -> None:
        last_second = 0.0
        self.turned_at = time.monotonic()  # the start (a journal's replay, say) is no stall
        while True:
            await asyncio.sleep(TICK_SECONDS)
            mono = time.monotonic()
            self.awake(mono)
            self.broker.tick(wall_ms())
            if self.replication is not None:
                self.replication.tick()
            handshake_deadline = mono - self.settings.link.handshake_timeout_ms / 1000
            # Links, and the channels still in their handshake: an open channel has no timer of its own.
            channels = [p for conn_id in self.handshaking if (p := self.protocols.get(conn_id)) and p.carrier]
            for protocol in [*self.links.values(), *channels]:
                if protocol.session is None and protocol.opened < handshake_deadline:
                    # Counted, not logged one by one: a login storm leaves many waiting for their check.
                    if self.refusals.first("handshake-timeout", mono):
                        log.warning(
                            "connection closed: handshake not completed within the timeout (further ones "
                            "counted once a minute)",
                            extra={"peer": protocol.peer},
                        )
                    if protocol._login is not None:  # its HELLO waits for a password check: ours to finish
                        protocol.conn.close(ErrorCode.RESOURCE_LIMIT, LOGIN_BUSY)
                    else:
                        protocol.conn.close(ErrorCode.UNAUTHENTICATED, "handshake not completed within the timeout")
                    protocol.write_pending()
                    protocol.close_transport()
                    continue
                try:
                    protocol.conn.handle_timeout(mono)
                except LinkError as exc:
                    protocol.fail(exc)
                    continue
                if protocol.session is not None:
                    self.broker.dirty.add(protocol.session)
                else:
                    protocol.write_pending()
            self._compact(mono - last_second >= 1.0)
            if mono - last_second >= 1.0:
                last_second = mono
                self.logins.tick(mono)
                for limit, count in self.refusals.ended(mono):
                    log.warning(
                        "connections refused or closed at a limit in the last minute",
                        extra={"limit": limit, "refused": count},
                    )
                self._check_disk()
                self.audit.tick(time.time_ns() // 1000)
                self.rates.sample(self.broker, mono)
            self._flush()

    def _journal_error_changed(self) -> None:
        journal = self.journal
        if journal is not None and journal.fatal is not None:
            # Nothing written after a failed fsync can be confirmed again: crash-only, as for a failed task.
            self.supervisor.fail("journal", journal.fatal)
        elif journal is not None and journal.error is not None and _removed(journal.error) and self.shared is None:
            # A segment or the directory removed under the node: no retry brings it back (a shared-store node
            # meets this when its epoch ended, and its lease check fences it).
            self.supervisor.fail("journal", journal.error)
        else:
            self._check_disk()  # refuse (or accept again) at once, not at the next second

    def _journal_problem(self) -> str:
        """Why the journal cannot take writes now ("" when it can): the node is not ready meanwhile."""
        journal = self.journal
        if journal is None or journal.error is None:
            return ""
        return f"the journal cannot write: {journal.error.strerror or journal.error}"

    def _check_disk(self) -> None:
        """Refuse durable publishes while the journal cannot keep them safe, and publishes a queue would page
        while the paging disk is over its limit; say so when it changes."""
        self._check_paging_disk()
        journal = self.journal
        if journal is None:
            return
        refusal: tuple[str, str] | None = None
        problem = self._journal_problem()
        if problem:
            refusal = (ErrorCode.RESOURCE_LIMIT, f"{problem}: durable publishes are refused until it can")
        else:
            try:
                usage = shutil.disk_usage(journal.directory)
            except FileNotFoundError as exc:
                if self.shared is None:
                    self.supervisor.fail(
                        "journal", OSError(exc.errno, f"the journal directory {journal.directory} is gone")
                    )
                    return
                # A shared-store node whose epoch ended while it stood still (the new holder removes the old
                # epoch's directory): its lease check fences it next.
                refusal = (ErrorCode.RESOURCE_LIMIT, f"the journal's directory is gone: {exc.strerror}")
            else:
                percent = 100.0 * (usage.total - usage.free) / usage.total
                limit = self.settings.journal.max_disk_usage
                if percent >= limit:
                    text = f"disk usage {percent:.1f} % is at or above journal.max_disk_usage {limit:g} %"
                    refusal = (ErrorCode.RESOURCE_LIMIT, f"{text}: durable publishes are refused")
                elif limit < 100:
                    admission = self.broker.admission
                    room = usage.free - usage.total * (100 - limit) / 100  # bytes until the limit
                    admission.disk_budget = int(room) - journal.unwritten_bytes()
                    admission.disk_limit_text = (
                        f"durable publishes would take the journal's disk past journal.max_disk_usage {limit:g} %: "
                        "refused until its next look at the disk"
                    )
        if refusal != self.broker.admission.durable_refusal:
            if refusal is None:
                log.info("durable publishes accepted again")
            else:
                log.error("durable publishes refused", extra={"reason": refusal[1]})
            self.broker.admission.durable_refusal = refusal
        # A commit would wait for a write the journal cannot make: refused, not left unanswered.
        commits = (ErrorCode.RESOURCE_LIMIT, f"{problem}: transaction commits are refused until it can")
        self.broker.transactions.write_refusal = commits if problem else None

    def _check_paging_disk(self) -> None:
        """Page files count against journal.max_disk_usage too (their own disk, when it is another one)."""
        admission = self.broker.admission
        try:
            usage = shutil.disk_usage(self.pages.directory)
        except OSError:  # removed under the node (its pages then fail and stay in memory): nothing to measure
            return
        percent = 100.0 * (usage.total - usage.free) / usage.total
        limit = self.settings.journal.max_disk_usage
        refusal: tuple[str, str] | None = None
        if percent >= limit:
            text = f"paging disk usage {percent:.1f} % is at or above journal.max_disk_usage {limit:g} %"
            refusal = (ErrorCode.RESOURCE_LIMIT, f"{text}: messages that would be paged are refused")
        if refusal != admission.paging_refusal:
            if refusal is None:
                log.info("messages that would be paged accepted again")
            else:
                log.error("messages that would be paged refused", extra={"reason": refusal[1]})
            admission.paging_refusal = refusal

    def _compact(self, consider: bool) -> None:
        """One chunk of a running compaction per tick; about once a second, see whether one is due."""
        store = self.journal_store
        if store is None:
            return
        if store.compacting:
            if self.replication is None or self.replication.may_compact():
                store.compaction_step()
        elif consider and store.wants_compaction(self._live_durable_messages):
            log.info("journal compaction started", extra={"live_messages": self._live_durable_messages()})
            store.start_compaction(self.broker.durable_snapshot())

    def _live_durable_messages(self) -> int:
        return sum(len(q) + q.in_flight for q in self.broker.queues.values() if q.durable)

    def _close_client_links(self, code: str = ErrorCode.SHUTDOWN, text: str = "the node is shutting down") -> None:
        """Close every link but the other cluster nodes': their consumers give their messages back. Their clients
        did not die: no will is published (their links set them again where they resume)."""
        self.audit.flush()
        self.broker.wills.forget_held(self.broker.sessions.values())
        for protocol in list(self.protocols.values()):
            if protocol.session is not None and not protocol.session.principal.cluster:
                protocol.conn.close(code, text)
                protocol.write_pending()
                protocol.close_transport()

    async def stop(self) -> None:
        """Close every link (telling peers why), stop the listener, seal the audit segment."""
        # A backup that may take over keeps the messages instead; one still copying cannot serve them.
        has_backup = self.replication is not None and self.replication.backup_may_take_over()
        scale_down = (self.settings.cluster.scale_down or self.scale_down_requested) and not has_backup
        if self.cluster is not None and scale_down:
            await self.cluster.prepare_scale_down()  # while the tick still keeps the links alive
        for task in (self._timer, self._network_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._server is not None:
            self._server.close()
        # The links close because we stop, not because their clients died: no will is published.
        self.broker.wills.discard(self.broker.sessions.values())
        if self.backup is not None:
            await self.backup.stop()
        if self.shared is not None:
            await self.shared.stop()
        if self.replication is not None:
            await self.replication.stop()
        if self.cluster is not None:
            if scale_down:
                await self.cluster.scale_down(self._close_client_links)
            await self.cluster.stop()
        for protocol in list(self.protocols.values()):
            protocol.conn.close(ErrorCode.SHUTDOWN, "the node is shutting down")
            protocol.write_pending()
            protocol.close_transport()
        if self._server is not None:
            await self._server.wait_closed()
        if self._runner is not None:
            await self._runner.cleanup()
        self.channel_ends.run_all()  # the closed links' sessions, before the journal and the audit close
        if self.journal is not None:
            self.journal.close()
        if self.shared is not None and self.active:
            self.shared.release()
        self.logins.close()
        self.audit.close()
        if self.journal_lock is not None:
            self.journal_lock.release()
        self.lock.release()
        log.info("core node stopped", extra={"node_id": self.node_id})


def _removed(error: OSError) -> bool:
    """The journal failed because its file or directory is gone."""
    return error.errno == errno.ENOENT
