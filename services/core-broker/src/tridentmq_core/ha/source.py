"""The active node's side of its pair: ``ReplicationSource`` answers the backup's REPLICATE request, starts a
compaction (whose copy plus what follows is the whole state, see ``replication.py``) and streams every journal
record from there; once the backup holds the copy, durable writes are confirmed only when both copies hold
them. When an in-sync backup is lost, confirms wait until a quorum of the other primaries says no backup took
over (``stay``) and the pair moves to a new epoch, which makes the lost backup's copy stale; a refusal means
this node was replaced: it stops at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from tridentmq_core.broker import Broker
from tridentmq_core.checks import BrokerError
from tridentmq_core.ha.pair import BACKUP, PRIMARY, ClusterView, record_epoch
from tridentmq_core.ha.replication import ReplicaFeed
from tridentmq_core.ha.votes import STAY, VoteRequest, answer_int, quorum
from tridentmq_core.ha.voting import ask_votes
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.identity import NodeIdentity
from tridentmq_core.store.journal import Journal
from tridentmq_core.store.journal_store import JournalStore
from tridentmq_shared.link.codec import HEARTBEAT_TIMEOUT_FACTOR, LinkConnection
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.runtime import cancel_and_wait, wall_ms
from tridentmq_shared.supervision import spawn

log = logging.getLogger("tridentmq.core.ha")


def takeover_time(settings: CoreSettings) -> float:
    """How long, in seconds, after a backup last heard of this node it can be active at the earliest: it
    notices (a heartbeat timeout), then the voters must have missed this node for the vote grace."""
    return (settings.link.heartbeat_ms * HEARTBEAT_TIMEOUT_FACTOR + settings.ha.vote_grace_ms) / 1000


def stall_limit(settings: CoreSettings) -> float:
    """How long this node may stand still before its backup may have taken over: as ``takeover_time``, counted
    from the last frame this node sent, which can be two heartbeat intervals before it last ran (a heartbeat
    goes only after an interval with nothing sent); a backup that activates without a quorum waits for no
    vote grace."""
    heartbeat_s = settings.link.heartbeat_ms / 1000
    limit = heartbeat_s * (HEARTBEAT_TIMEOUT_FACTOR - 2)
    if not settings.ha.activate_without_quorum:
        limit += settings.ha.vote_grace_ms / 1000
    return limit


class ReplicationSource:
    """The active node's side of its pair: one backup at a time."""

    def __init__(
        self,
        broker: Broker,
        store: JournalStore,
        identity: NodeIdentity,
        server_id: str,
        settings: CoreSettings,
        cluster: Callable[[], ClusterView | None],
        members: Callable[[], list[dict[str, Any]]],
        fenced: Callable[[str], None],
        hand_over: Callable[[], Coroutine[Any, Any, None]],
        drop_link: Callable[[str], None],
        abort_link: Callable[[str], None],
        cut_off: Callable[[], None] = lambda: None,
        new_epoch: Callable[[int], None] = lambda _epoch: None,
        link_backlog: Callable[[str], int | None] = lambda _conn_id: None,
    ) -> None:
        self.broker = broker
        self.store = store
        self.identity = identity
        self.server_id = server_id  # this process: what it asks for in a stay vote
        self.settings = settings
        self._cluster = cluster
        self._members = members
        self._fenced = fenced
        self._hand_over = hand_over
        self._drop_link = drop_link  # closes a link's connection once its CLOSE is written
        self._abort_link = abort_link  # closes it at once (a peer that does not read)
        self._cut_off = cut_off  # this node stops serving its clients: its backup may have taken over
        self._new_epoch = new_epoch  # this node serves at a new epoch (recorded): tell the cluster and the audit
        self._link_backlog = link_backlog  # bytes written to a link that its peer's host has not acknowledged
        #: Held for a quorum longer than the backup needs to take over, without one: its clients go elsewhere.
        self.cut_off = False
        self.failing_back = False
        self.session: Session | None = None
        self._link: LinkConnection | None = None  # the backup's link connection: the session's outlet
        self.feed: ReplicaFeed | None = None
        self.backup = ""  # the backup's server id
        self.backup_endpoint: tuple[str, int] = ("", 0)  # where the backup will serve clients once active
        self.backup_role = BACKUP  # the role the backup is configured with (a returned primary: failback)
        self._sync_end_sent = 0
        self._lost_may_take_over = False  # whether the backup last lost may have taken over
        self.held_since = 0.0  # monotonic: confirms wait for a quorum since then (0: they do not)
        self._progress_at = 0.0  # monotonic: the backup last acknowledged something, took more, or had nothing to
        self._backlog_seen: int | None = None  # the backup link's unacknowledged bytes at the last tick
        self._stay_task: asyncio.Task[None] | None = None
        self._dropped = False  # the backup is being dropped (``stalled``): what it acknowledges no longer counts

    @property
    def journal(self) -> Journal:
        return self.store.journal

    def replicate(self, session: Session, info: dict[str, Any]) -> dict[str, Any]:
        ha = self.settings.ha
        group, server_id, host, port = info.get("group"), info.get("server_id"), info.get("host"), info.get("port")
        if group != ha.group_name:
            # A backup looking for its primary asks every node it knows: normal, not an error here.
            log.info(
                "backup refused: another group",
                extra={"peer": session.peer, "group": group, "own_group": ha.group_name},
            )
            raise BrokerError(ErrorCode.INVALID, f"group {group!r} is not this pair's ({ha.group_name!r})")
        if not isinstance(server_id, str) or not server_id:
            raise BrokerError(ErrorCode.INVALID, "replicate names the backup's server id")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise BrokerError(ErrorCode.INVALID, "replicate names the backup's link host and port")
        if self.session is not None and self.session.conn_id in self.broker.sessions:
            raise BrokerError(ErrorCode.EXISTS, f"this pair already has a backup ({self.backup})")
        if self.held_since:
            raise BrokerError(ErrorCode.RESOURCE_LIMIT, "waiting for a quorum after losing the backup; retry")
        if self.store.compacting:
            raise BrokerError(ErrorCode.RESOURCE_LIMIT, "a compaction is running; retry")
        if not isinstance(session.conn, LinkConnection):
            raise BrokerError(ErrorCode.INVALID, "a backup replicates over a link connection of its own")
        epoch = self.identity.epoch
        served = info.get("epoch")
        if info.get("activated") is True and type(served) is int and served >= epoch:
            # The backup served this pair at this epoch or a later one, which a quorum granted it; this copy took
            # the epoch without one (started while no voter answered): the backup's copy is the fresher.
            self._fenced(f"backup {server_id} served this pair at epoch {served}; this copy serves at {epoch}")
            raise BrokerError(ErrorCode.FENCED, "this copy is stale: it stops")
        feed = ReplicaFeed(
            epoch, self.journal.appended + 1, window=ha.sync_window, max_backlog_bytes=ha.max_backlog_bytes
        )
        self.journal.tap = feed.append
        self.store.on_copied = lambda last: self._copied(feed, last)
        self.store.start_compaction(self.broker.durable_snapshot())
        self.session, self.feed, self.backup, self._sync_end_sent = session, feed, server_id, 0
        self._dropped = False
        self._progress_at = time.monotonic()  # counted from now, not from an earlier backup's last ack
        self._backlog_seen = None
        self._link = session.conn
        self.backup_endpoint = (host, port)
        self.backup_role = str(info.get("role", BACKUP))
        log.info("backup connected: initial synchronisation started", extra={"backup": server_id, "peer": session.peer})
        return {
            "node_id": self.identity.node_id,
            "epoch": epoch,
            "name": self.settings.node.name,
            "members": self._members(),
        }

    def _copied(self, feed: ReplicaFeed, last: int) -> None:
        feed.copied(last)
        self.store.limit_confirms(feed.confirmable)

    async def drained(self) -> bool:
        """Wait until the backup holds every record written (after this node stopped serving); False when the
        backup went away first."""
        while (feed := self.feed) is not None and self.session is not None:
            if feed.pending == 0 and self.journal.synced >= self.journal.appended:
                return True
            await asyncio.sleep(0.01)
        return False

    def release_backup(self) -> None:
        """Tell the backup to take over now: the last step of a failback."""
        session, link = self.session, self._link
        if session is not None and link is not None:
            link.close(ErrorCode.FAILBACK, "the pair goes back to its primary")
            self._drop_link(session.conn_id)

    def backup_may_take_over(self) -> bool:
        """Whether the attached backup holds, or may count itself to hold, everything: in sync, or sent the end
        of its copy (its acknowledgement can be lost with the link). A backup still copying cannot serve."""
        feed = self.feed
        return feed is not None and (feed.in_sync or bool(feed.sync_end and self._sync_end_sent == feed.sync_end))

    def in_sync_backup(self) -> tuple[str, int] | None:
        """The link endpoint of the backup while it is in sync (clients of this node go there next)."""
        return self.backup_endpoint if self.feed is not None and self.feed.in_sync else None

    def _members_changed(self) -> None:
        cluster = self._cluster()
        if cluster is not None:
            cluster.members_changed()

    def may_compact(self) -> bool:
        """Pace the initial copy by the backup's acknowledgements, not by the disk here."""
        feed = self.feed
        return feed is None or feed.pending < feed.window

    def acked(self, session: Session, upto: int) -> None:
        feed, link = self.feed, self._link
        if session is not self.session or feed is None or link is None or self._dropped:
            return
        self._progress_at = time.monotonic()
        try:
            became_in_sync = feed.ack(upto)
        except ValueError as exc:
            log.error("backup acknowledged what it was never sent", extra={"reason": str(exc)})  # noqa: TRY400
            link.close(ErrorCode.MALFORMED, str(exc))
            self._drop_link(session.conn_id)
            return
        if became_in_sync:
            log.info(
                "backup in sync: durable writes are confirmed once both copies hold them",
                extra={"backup": self.backup, "records": feed.acked - feed.first + 1},
            )
            self.broker.audit.emit(wall_ms() * 1000, "ha.backup_in_sync", {"backup": self.backup})
            self._members_changed()
            if self.settings.ha.allow_failback:
                self.request_failback()
        if feed.sync_end:
            self.store.limit_confirms(feed.confirmable)

    def request_failback(self) -> str | None:
        """Hand the pair back to its primary now, if this is an active backup whose primary is back and in sync
        (with ``ha.allow_failback`` that happens by itself; an operator asks for it otherwise): None when the
        failback starts, else why it cannot."""
        feed = self.feed
        if self.settings.ha.role != BACKUP or self.backup_role != PRIMARY:
            return "this node is not a backup serving in place of its primary"
        if self.failing_back:
            return "a failback is already under way"
        if feed is None or not feed.in_sync:
            return "the primary is not back and in sync yet"
        self.failing_back = True
        log.warning("failback: the pair's primary is back and in sync; handing the pair back to it")
        spawn(self._hand_over(), "ha-failback")
        return None

    def pump(self) -> None:
        """Queue what the backup has not been sent yet (called before each write of the links)."""
        feed, session, conn = self.feed, self.session, self._link
        if feed is None or session is None or conn is None or feed.overflowed:
            return  # an overflowed feed lacks records: not even the end of the copy goes (it is being dropped)
        sent = False
        while (batch := feed.take()) is not None:
            conn.replica(feed.epoch, batch[0], batch[1], feed.sync_end)
            sent = True
        if feed.sync_end and self._sync_end_sent != feed.sync_end:
            if not sent:  # nothing left to carry it: an empty batch announces the end of the copy
                conn.replica(feed.epoch, feed.next_number, [], feed.sync_end)
            self._sync_end_sent = feed.sync_end
            sent = True
        if sent:
            self.broker.dirty.add(session)

    def tick(self) -> None:
        session, feed = self.session, self.feed
        if session is None or feed is None:
            return
        if session.conn_id in self.broker.sessions:
            self._check_progress(session, feed)
            return
        self._lost_may_take_over = self.backup_may_take_over()
        self.session = self.feed = self._link = None
        self._dropped = False
        self._members_changed()
        self.journal.tap = None
        self.store.on_copied = lambda answer_int: None
        if self.failing_back:
            return  # this node let the backup go itself: it takes over, and this node restarts as its backup
        self._backup_lost()

    def failback_failed(self) -> None:
        """The failback ended with the backup gone before it held everything: this node serves on, having lost
        that backup (``tick`` left its loss to the failback)."""
        self.failing_back = False
        if self.feed is None:
            self._backup_lost()

    def _backup_lost(self) -> None:
        # Once the end of the copy was sent, the backup may hold it and count itself in sync (its acknowledgement
        # can be lost with the link): it may take over, so this node needs a quorum to go on, as below.
        if not self._lost_may_take_over:
            log.warning("backup lost before it was in sync", extra={"backup": self.backup})
            self.store.limit_confirms(None)
            return
        self.broker.audit.emit(wall_ms() * 1000, "ha.backup_lost", {"backup": self.backup})
        if not self.settings.ha.vote_on_replication_failure:
            log.warning("in-sync backup lost: going on alone (ha.vote_on_replication_failure is off)")
            self.store.limit_confirms(None)
            return
        log.warning(
            "in-sync backup lost: durable writes wait for a quorum of the other primaries",
            extra={"backup": self.backup},
        )
        self.held_since = time.monotonic()
        self._stay_task = spawn(self._ask_to_stay(), "ha-stay")

    def stalled(self, seconds: float) -> None:
        """This node stood still for ``seconds``, long enough for its backup to have taken over (a SIGSTOP, a
        blocked loop). Before anything that waited meanwhile is handled, the backup is dropped as lost, so
        that nothing is confirmed from now on until a quorum says this node may go on: an acknowledgement the
        backup sent before it took over would otherwise let this node confirm writes to clients that should
        have been sent on (``tick`` then waits for a quorum as for any lost backup)."""
        session, feed = self.session, self.feed
        if session is None or feed is None or self._dropped or self.failing_back:
            return
        log.warning(
            "this node stood still longer than its backup needs to take over: dropping the backup",
            extra={"backup": self.backup, "stalled_s": round(seconds, 3)},
        )
        self._dropped = True
        self.store.hold_confirms()
        self._abort_link(session.conn_id)

    def _check_progress(self, session: Session, feed: ReplicaFeed) -> None:
        """A backup that acknowledges nothing for a heartbeat timeout while records wait, and whose host takes
        nothing more of what was sent meanwhile, is lost, even if its heartbeats still arrive: when only this
        node's packets are dropped, the backup stops hearing from it (and may take over) while its own frames
        still come through for a while. During the copy too: one stuck there (a hung disk) would keep the
        compaction, which its acknowledgements pace, from ending, and with it any other compaction and backup
        (it is dropped once it has taken what the window let out). So is one that falls
        ``ha.max_backlog_bytes`` behind: what it has not been sent is held in memory. Either copies again once
        it reconnects."""
        now = time.monotonic()
        if not feed.pending or self.failing_back:
            self._progress_at = now
            return
        # A slow path (a few Mbit/s) carries a batch of the copy, or one large record, for longer than the
        # timeout: while the backup's host takes what was sent, the backup is slow, not gone.
        backlog = self._link_backlog(session.conn_id)
        if backlog is not None and self._backlog_seen is not None and backlog < self._backlog_seen:
            self._progress_at = now
        self._backlog_seen = backlog
        extra = {"backup": self.backup, "in_sync": feed.in_sync, "pending": feed.pending}
        if feed.overflowed:
            log.warning("backup fell more than ha.max_backlog_bytes behind: dropping it", extra=extra)
            self._abort_link(session.conn_id)
            return
        timeout = self.settings.link.heartbeat_ms * HEARTBEAT_TIMEOUT_FACTOR / 1000
        if now - self._progress_at > timeout:
            log.warning("backup acknowledged nothing for the heartbeat timeout: dropping it", extra=extra)
            self._abort_link(session.conn_id)

    async def _ask_to_stay(self) -> None:
        # Going on alone is a new epoch: once a quorum granted it, the lost backup's copy (of the epoch served
        # so far) is stale to a majority, so it can never win a vote without the writes confirmed from now on.
        serving = self.identity.epoch
        epoch = serving + 1
        request = VoteRequest(STAY, self.identity.node_id, epoch, self.server_id, serving)
        retry = self.settings.ha.vote_retry_ms / 1000
        while True:
            cluster = self._cluster()
            voters = cluster.member_endpoints() if cluster is not None else []
            pairs = 1 + len(voters)
            # The lost backup is asked too, though it does not count: if it took over, it says so (a single
            # pair whose backup may activate without a quorum learns here that it was replaced).
            *answers, backup = await ask_votes(self.settings, [*voters, self.backup_endpoint], request)
            newer = max((answer_int(a, "epoch") for a in [*answers, backup] if a is not None), default=0)
            if newer > epoch or (
                backup is not None and backup.get("granted") is not True and answer_int(backup, "epoch") >= epoch
            ):
                self._fenced(f"epoch {newer} of this pair was promised to, or taken by, another copy")
                return
            # Every refusal names another copy that has, or may have, served since ``serving``.
            claimed = sum(1 for a in answers if a is not None and a.get("granted") is not True)
            if claimed >= quorum(pairs):
                self._fenced(f"a quorum says another copy of this pair served since epoch {serving}")
                return
            grants = 1 + sum(1 for a in answers if a is not None and a.get("granted"))  # this node's vote counts
            if grants >= quorum(pairs):
                log.info(
                    "quorum agrees: going on without the backup at a new epoch",
                    extra={"votes": grants, "pairs": pairs, "epoch": epoch},
                )
                record_epoch(self.identity, epoch)
                self._new_epoch(epoch)
                self.held_since = 0.0
                self.cut_off = False
                self.store.limit_confirms(None)
                return
            if not self.cut_off and time.monotonic() - self.held_since >= takeover_time(self.settings):
                # The backup may be active by now: saying "active" and keeping the clients, whose writes
                # are never confirmed here, would strand them. They are sent on (to the backup first).
                log.warning(
                    "cut off from the backup and from a quorum: serving no client until a quorum answers",
                    extra={"votes": grants, "pairs": pairs},
                )
                self.cut_off = True
                self._cut_off()
            await asyncio.sleep(retry)

    def status(self) -> dict[str, Any]:
        feed = self.feed
        return {
            "backup": self.backup if feed is not None else "",
            "backup_in_sync": bool(feed is not None and feed.in_sync),
            "backup_pending_records": feed.pending if feed is not None else 0,
            "waiting_for_quorum": bool(self.held_since),
            "cut_off": self.cut_off,
        }

    async def stop(self) -> None:
        await cancel_and_wait(self._stay_task)
