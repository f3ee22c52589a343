"""High availability, the asyncio shell: a pair's journal stream, quorum votes and a backup's takeover.

- On the active node of a pair, ``ReplicationSource`` answers the backup's REPLICATE request: it starts a
  compaction (whose copy plus what follows is the whole state, see ``replication.py``), streams every journal
  record from there, and once the backup holds the copy, confirms durable writes only when both copies hold
  them. When an in-sync backup is lost, confirms wait until a quorum of the other primaries says no backup
  took over (``stay``) and the pair moves to a new epoch, which makes the lost backup's copy stale; a
  refusal means this node was replaced: it stops at once.
- On every active clustered node, ``Voter`` answers VOTE requests and keeps its promises on disk.
- On a backup, ``BackupRunner`` finds its primary among the connectors, copies its journal into a fresh
  journal of its own (acknowledging what is on disk), and when the primary is lost while in sync, asks the
  other primaries for their votes; with a majority it takes the pair's node id and a new epoch and activates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from tridentmq_core.broker import Broker, BrokerError, Session
from tridentmq_core.cluster.links import node_link, watch_close
from tridentmq_core.ha.replication import ReplicaFeed
from tridentmq_core.ha.votes import ACTIVATE, STAY, VoteBook, VoteRequest, quorum
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.files import write_durably
from tridentmq_core.store.identity import IdentityError, NodeIdentity
from tridentmq_core.store.journal import Journal, list_segments
from tridentmq_core.store.journal_store import JournalStore
from tridentmq_core.store.records import MAGIC, RecordType
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.client import LinkClient, LinkRequestError
from tridentmq_shared.link.codec import HEARTBEAT_TIMEOUT_FACTOR, LinkConnection
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.topology import parse_endpoint
from tridentmq_shared.runtime import cancel_and_wait, wall_ms
from tridentmq_shared.settings import SettingsError
from tridentmq_shared.supervision import spawn

log = logging.getLogger("tridentmq.core.ha")

REPLICATION: Final = "replication"
SHARED_STORE: Final = "shared-store"
PRIMARY: Final = "primary"
BACKUP: Final = "backup"
HA_STATE_FILE: Final = "ha.json"
VOTES_FILE: Final = "votes.json"
FENCED_EXIT_CODE: Final = 3  # the process exits with this when a quorum says another copy replaced it
VOTE_TIMEOUT: Final = 1.0


def validate_ha_settings(settings: CoreSettings, clusters: bool) -> None:
    ha = settings.ha
    if ha.policy not in ("none", REPLICATION, SHARED_STORE):
        raise SettingsError("ha.policy must be none, replication or shared-store")
    if ha.policy == "none":
        return
    if ha.policy == SHARED_STORE:
        if not ha.shared_directory:
            raise SettingsError("ha.shared_directory is required with the shared-store policy")
        if ha.lease_expiry_ms <= 2 * ha.lease_renew_ms:
            raise SettingsError("ha.lease_expiry_ms must exceed twice ha.lease_renew_ms")
        if not settings.journal.enabled:
            raise SettingsError("a shared-store pair needs the journal (journal.enabled)")
        return
    if ha.role not in (PRIMARY, BACKUP):
        raise SettingsError("ha.role must be primary or backup")
    if not ha.group_name:
        raise SettingsError("ha.group_name names the pair: set it, the same on the primary and its backup")
    if not clusters:
        raise SettingsError(
            "a replication pair needs the cluster credentials and connectors (cluster.user, "
            "cluster.password, and cluster.connectors naming the other half and other nodes)"
        )
    if not settings.journal.enabled:
        raise SettingsError("a replication pair needs the journal (journal.enabled)")


class VoteStore:
    """The voter's promises, on disk so a restarted voter keeps them."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / VOTES_FILE
        self.book = VoteBook()
        if self.path.exists():
            try:
                self.book = VoteBook.from_json(json.loads(self.path.read_text(encoding="utf-8")))
            except ValueError as exc:  # forgetting promises could elect two copies: refuse to start instead
                raise IdentityError(f"{self.path} is unreadable ({exc}); restore it or remove it knowingly") from None

    def save(self) -> None:
        write_durably(self.path, json.dumps(self.book.to_json()))


class ClusterView(Protocol):
    """What a pair asks of its node's cluster connections (``cluster/manager.py``)."""

    node_id: str

    def member_endpoints(self) -> list[tuple[str, int]]:
        """The link endpoint of every other node heard of."""

    def reachable(self, node_id: str, grace_s: float) -> bool:
        """Whether the cluster connection to ``node_id`` is up, or went down less than ``grace_s`` ago."""

    def members_changed(self) -> None:
        """Something in this node's own entry changed (its backup): tell the others and the gateways."""


class Voter:
    """Answers VOTE requests of backups (``activate``) and of primaries that lost their backup (``stay``)."""

    def __init__(self, votes: VoteStore, settings: CoreSettings, cluster: Callable[[], ClusterView | None]) -> None:
        self.votes = votes
        self.settings = settings
        self._cluster = cluster

    def primary_reachable(self, node_id: str) -> bool:
        cluster = self._cluster()
        return cluster is not None and cluster.reachable(node_id, self.settings.ha.vote_grace_ms / 1000)

    def vote(self, session: Session, raw: dict[str, Any]) -> dict[str, Any]:
        try:
            request = VoteRequest.from_wire(raw)
        except ValueError as exc:
            raise BrokerError(ErrorCode.INVALID, str(exc)) from None
        book = self.votes.book
        before = book.epoch(request.node_id), book.freshness(request.node_id)
        cluster = self._cluster()
        if cluster is not None and request.node_id == cluster.node_id and request.kind == ACTIVATE:
            granted, why = False, "this node is that pair's active copy"
        else:
            granted, why = book.decide(request, primary_reachable=self.primary_reachable(request.node_id))
        if (book.epoch(request.node_id), book.freshness(request.node_id)) != before:
            self.votes.save()  # the promise is on disk before the candidate hears of it
        # Refusals repeat every vote round of a candidate: only grants are worth a line at INFO.
        (log.info if granted else log.debug)(
            "vote",
            extra={
                "kind": request.kind,
                "pair": request.node_id,
                "epoch": request.epoch,
                "candidate": request.candidate,
                "granted": granted,
                "reason": why,
                "peer": session.peer,
            },
        )
        return {
            "granted": granted,
            "reason": why,
            "epoch": book.epoch(request.node_id),
            "promisee": book.promisee(request.node_id),
            "fresh": book.freshness(request.node_id),
        }

    def observe(self, node_id: str, epoch: int) -> bool:
        """A node is active at ``epoch``: False when a higher one was promised (it is stale: refuse it)."""
        if epoch < self.votes.book.epoch(node_id):
            return False
        if self.votes.book.observe(node_id, epoch):
            self.votes.save()
        return True


def _number(answer: dict[str, Any], key: str) -> int:
    """An integer field of a vote answer (0 when missing or malformed: another node's answer is input)."""
    value = answer.get(key, 0)
    return value if type(value) is int else 0


async def primary_may_activate(settings: CoreSettings, identity: NodeIdentity, server_id: str) -> tuple[bool, str]:
    """Whether a node configured as primary may serve at start: its data must be whole (not a copy cut
    short) and no voter may know a newer epoch of its pair (its backup took over meanwhile)."""
    state_path = identity.data_dir / HA_STATE_FILE
    state = BackupState.load(state_path)
    if state_path.exists() and not state.in_sync:
        return False, "its data is an unfinished copy"
    if state_path.exists() and not state.activated:
        # The node it copied holds this epoch and may still serve: only a vote for a new epoch (a backup's
        # takeover) may make this copy active again, never a restart with the same epoch.
        return False, f"its data is a copy of the pair's active node at epoch {state.epoch}"
    voters = list(dict.fromkeys([*(parse_endpoint(c) for c in settings.cluster.connectors), *state.members.values()]))
    # A restart serves at a new epoch: the backup's copy may be of the last life, and writes confirmed in this
    # one before it copies again must make that copy stale (a brand-new node has no copy anywhere).
    epoch = identity.epoch if identity.first_start else identity.epoch + 1
    request = VoteRequest(STAY, identity.node_id, epoch, server_id, identity.epoch)
    answers = [a for a in await ask_votes(settings, voters, request) if a is not None]
    newer = max((_number(a, "epoch") for a in answers), default=0)
    if newer > identity.epoch:
        return False, f"epoch {newer} of this pair is active elsewhere (this copy has epoch {identity.epoch})"
    refused = next((a for a in answers if not a.get("granted")), None)
    if refused is not None:  # e.g. this epoch was won by vote by another copy: only a vote may settle it
        return False, f"a voter refused: {str(refused.get('reason', ''))[:200]}"
    record_epoch(identity, epoch)
    return True, ""


def record_epoch(identity: NodeIdentity, epoch: int) -> None:
    """The active copy serves at a new ``epoch`` that a quorum granted it: on disk before it confirms anything
    at it, in its identity and, for a copy that was a backup once, in its HA state (its data epoch)."""
    identity.set_epoch(epoch)
    path = identity.data_dir / HA_STATE_FILE
    if path.exists():
        state = BackupState.load(path)
        if state.epoch != epoch:
            state.epoch = epoch
            state.save(path)


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
        self.held_since = 0.0  # monotonic: confirms wait for a quorum since then (0: they do not)
        self._progress_at = 0.0  # monotonic: the backup last acknowledged something, or had nothing to
        self._stay_task: asyncio.Task[None] | None = None

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
        feed = ReplicaFeed(epoch, self.journal.appended + 1, window=ha.sync_window)
        self.journal.tap = feed.append
        self.store.on_copied = lambda last: self._copied(feed, last)
        self.store.start_compaction(self.broker.durable_snapshot())
        self.session, self.feed, self.backup, self._sync_end_sent = session, feed, server_id, 0
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
        if session is not self.session or feed is None or link is None:
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
        if feed is None or session is None or conn is None:
            return
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
        self.session = self.feed = self._link = None
        self._members_changed()
        self.journal.tap = None
        self.store.on_copied = lambda _number: None
        if self.failing_back:
            return  # this node let the backup go itself: it takes over, and this node restarts as its backup
        # Once the end of the copy was sent, the backup may hold it and count itself in sync (its acknowledgement
        # can be lost with the link): it may take over, so this node needs a quorum to go on, as below.
        if not feed.in_sync and not (feed.sync_end and self._sync_end_sent == feed.sync_end):
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

    def _check_progress(self, session: Session, feed: ReplicaFeed) -> None:
        """A backup that acknowledges nothing for a heartbeat timeout while records wait is lost, even if its
        heartbeats still arrive: when only this node's packets are dropped, the backup stops hearing from it
        (and may take over) while its own frames still come through for a while."""
        now = time.monotonic()
        if not feed.in_sync or not feed.pending or self.failing_back:
            self._progress_at = now
            return
        timeout = self.settings.link.heartbeat_ms * HEARTBEAT_TIMEOUT_FACTOR / 1000
        if now - self._progress_at > timeout:
            log.warning(
                "backup acknowledged nothing for the heartbeat timeout: dropping it",
                extra={"backup": self.backup, "pending": feed.pending},
            )
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
            newer = max((_number(a, "epoch") for a in [*answers, backup] if a is not None), default=0)
            if newer > epoch or (
                backup is not None and backup.get("granted") is not True and _number(backup, "epoch") >= epoch
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
            if not self.cut_off and time.monotonic() - self.held_since >= self._takeover_time():
                # The backup may be active by now: saying "active" and keeping the clients, whose writes
                # are never confirmed here, would strand them. They are sent on (to the backup first).
                log.warning(
                    "cut off from the backup and from a quorum: serving no client until a quorum answers",
                    extra={"votes": grants, "pairs": pairs},
                )
                self.cut_off = True
                self._cut_off()
            await asyncio.sleep(retry)

    def _takeover_time(self) -> float:
        """The earliest a backup that lost this node can be active: it notices (a heartbeat timeout), then
        the voters must have missed this node for the vote grace."""
        return (self.settings.link.heartbeat_ms * HEARTBEAT_TIMEOUT_FACTOR + self.settings.ha.vote_grace_ms) / 1000

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


async def ask_votes(
    settings: CoreSettings,
    voters: list[tuple[str, int]],
    request: VoteRequest,
) -> list[dict[str, Any] | None]:
    """Every voter's answer (None: it did not answer in time), each over a short link of its own."""
    return list(await asyncio.gather(*(_vote_at(settings, host, port, request) for host, port in voters)))


async def _vote_at(settings: CoreSettings, host: str, port: int, request: VoteRequest) -> dict[str, Any] | None:
    client = node_link(settings, host, port, f"vote:{settings.node.name}", connect_timeout=VOTE_TIMEOUT)
    try:
        await client.connect()
        return await asyncio.wait_for(client.vote(request.to_wire()), VOTE_TIMEOUT)
    except (LinkRequestError, OSError, TimeoutError):
        return None
    finally:
        await client.close()


@dataclass
class BackupState:
    """What a pair member knows about its copy, on disk: whose data, which epoch, whether the copy is whole (a
    backup in sync, or the active node), and the cluster's active nodes last seen (its voters)."""

    node_id: str = ""
    epoch: int = 0
    in_sync: bool = False
    members: dict[str, tuple[str, int]] = field(default_factory=dict)
    pairs: int = 1  # most pairs seen: the quorum is a majority of these
    #: This copy activated at ``epoch`` itself; False: it copied the node that did, which may still serve.
    activated: bool = False

    @staticmethod
    def load(path: Path) -> BackupState:
        if not path.exists():
            return BackupState()
        data = json.loads(path.read_text(encoding="utf-8"))
        members = {str(k): (str(v[0]), int(v[1])) for k, v in dict(data.get("members") or {}).items()}
        return BackupState(
            str(data.get("node_id", "")),
            int(data.get("epoch", 0)),
            bool(data.get("in_sync")),
            members,
            max(1, int(data.get("pairs", 1))),
            bool(data.get("activated")),
        )

    def save(self, path: Path) -> None:
        write_durably(
            path,
            json.dumps(
                {
                    "node_id": self.node_id,
                    "epoch": self.epoch,
                    "in_sync": self.in_sync,
                    "members": self.members,
                    "pairs": self.pairs,
                    "activated": self.activated,
                }
            ),
        )


def mark_released(data_dir: Path) -> None:
    """This copy handed its pair over (failback): it may serve again only after copying the node it handed
    to, never by bidding with its old copy while that node still replays its journal."""
    path = data_dir / HA_STATE_FILE
    state = BackupState.load(path)
    state.in_sync = state.activated = False
    state.save(path)


class BackupRunner:
    """A backup: copy the primary's journal, and take over when it is lost and a quorum agrees."""

    def __init__(
        self,
        settings: CoreSettings,
        identity: NodeIdentity,
        server_id: str,
        journal_dir: Path,
        advertise: tuple[str, int],
        call_in_loop: Callable[[Callable[[], None]], None],
        activate: Callable[[], Awaitable[None]],
        isolated: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.advertise = advertise  # this node's link endpoint, where clients find it once it is active
        self.identity = identity
        self.server_id = server_id
        self.journal_dir = journal_dir
        self._call_in_loop = call_in_loop
        self._activate = activate
        self._isolated = isolated  # the network check's verdict: an isolated backup never takes over
        self.state_path = identity.data_dir / HA_STATE_FILE
        # A whole copy from an earlier run may take over when no copy of the pair is active (both halves
        # restarted); votes make sure it is the freshest one.
        self.state = BackupState.load(self.state_path)
        self.primary = ""  # host:port of the primary being copied
        self.reason = "looking for the primary"
        self.journal: Journal | None = None
        self.client: LinkClient | None = None
        self._offset = 0  # primary record number = local record number + offset
        self._expected = 0
        self._sync_end = 0
        self._compacted_at = 0  # local number of the last compaction's COMPACTED record, until it is synced
        self._early: list[ev.ReplicaRecords] = []  # records that came before the answer to REPLICATE
        self.handed_over = False  # the active copy handed the pair over (failback): take over without a vote
        self._next_epoch = 0  # the epoch to ask for next, above the promises of a split vote
        self._logged: set[str] = set()  # reasons logged since the last copy started
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = spawn(self._run(), "ha-backup")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await self._close_link()
        self._close_journal()

    def status(self) -> dict[str, Any]:
        return {"primary": self.primary, "in_sync": self.state.in_sync, "state": self.reason, "pairs": self.state.pairs}

    # ------------------------------------------------------------------ the loop
    def _candidates(self) -> list[tuple[str, int]]:
        seen: list[tuple[str, int]] = []
        for endpoint in [*(parse_endpoint(c) for c in self.settings.cluster.connectors), *self.state.members.values()]:
            if endpoint not in seen:
                seen.append(endpoint)
        return seen

    async def _run(self) -> None:
        cluster = self.settings.cluster
        delay = cluster.retry_interval_ms / 1000
        while True:
            for host, port in self._candidates():
                self.primary = ""
                copied = await self._copy_from(host, port)
                if self.primary:  # it had a copy going: look again quickly
                    delay = cluster.retry_interval_ms / 1000
                if copied and await self._take_over((host, port)):
                    return
            if self.state.in_sync and await self._take_over(None):
                return  # no copy of the pair is active anywhere, and this one is the freshest
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # noqa: S311 - jitter: two copies may both ask
            delay = min(delay * cluster.retry_multiplier, cluster.max_retry_interval_ms / 1000)

    async def _copy_from(self, host: str, port: int) -> bool:
        """Copy the primary at ``host:port`` until the link ends; True when it ended with the copy whole."""
        self._close_journal()  # an earlier copy's: what arrives from here on belongs to this link's copy
        client = node_link(self.settings, host, port, f"backup:{self.settings.node.name}", connect_timeout=1.0)
        closed, why = watch_close(client)
        client.on_replica = lambda event: self._records(client, event)
        # Follow the cluster's members: they are the voters, their count sets the quorum, and among them is
        # the pair's active copy wherever it moved (asking every node we reach is how a backup finds it).
        client.on_topology = lambda update: self._learn(update.get("members"))
        self.client = client
        self._early.clear()
        try:
            await client.connect()
            with contextlib.suppress(LinkRequestError):
                self._learn((await client.topology({})).get("members"))
            reply = await client.replicate(
                {
                    "group": self.settings.ha.group_name,
                    "server_id": self.server_id,
                    "epoch": self.identity.epoch,
                    "host": self.advertise[0],
                    "port": self.advertise[1],
                    "role": self.settings.ha.role,
                }
            )
        except LinkRequestError as exc:
            if exc.code in (ErrorCode.INVALID, ErrorCode.EXISTS, ErrorCode.UNAUTHENTICATED):
                # Another group's primary is a normal answer while looking; each refusal is logged once.
                self._note(f"{host}:{port} refused: {exc.text}", error=exc.code != ErrorCode.INVALID)
            await self._close_link()
            return False
        except (OSError, TimeoutError):
            await self._close_link()
            return False
        self.primary = f"{host}:{port}"
        self._logged.clear()
        self._start_copy(reply)
        await closed.wait()
        self.client = None
        in_sync = self.state.in_sync
        self.handed_over = bool(in_sync and why and why[0].code == ErrorCode.FAILBACK)
        if self.handed_over:
            log.warning("failback: the active copy handed the pair back", extra={"from": self.primary})
            return True
        log.warning("primary lost", extra={"primary": self.primary, "in_sync": in_sync})
        self.reason = "primary lost" + ("" if in_sync else " before the copy was whole")
        return in_sync

    def _start_copy(self, reply: dict[str, Any]) -> None:
        node_id, epoch = str(reply.get("node_id", "")), int(reply.get("epoch", 0))
        self._learn(reply.get("members"))
        # Not in sync, on disk, before the old copy is wiped: a crash from here on never activates.
        self.state = BackupState(node_id, epoch, in_sync=False, members=self.state.members, pairs=self.state.pairs)
        self.state.save(self.state_path)
        self.identity.adopt(node_id, epoch)
        self._close_journal()
        for path in list_segments(self.journal_dir):
            path.unlink()
        journal = Journal(self.journal_dir, segment_bytes=self.settings.journal.segment_bytes)
        journal.recover()
        journal.on_synced = lambda upto: self._call_in_loop(lambda: self._synced(journal, upto))
        journal.start()
        self.journal = journal
        self._offset = self._expected = self._sync_end = self._compacted_at = 0
        self.reason = "copying"
        early, self._early = self._early, []
        for event in early:
            if self.client is not None:
                self._records(self.client, event)
        log.info("copying the primary's journal", extra={"primary": self.primary, "node_id": node_id, "epoch": epoch})

    def _learn(self, members: Any) -> None:
        known = dict(self.state.members)
        for item in members or []:
            if isinstance(item, dict) and isinstance(item.get("node_id"), str):
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    known[item["node_id"]] = (str(item["host"]), int(item["port"]))
        pairs = max(self.state.pairs, len(known))
        if known != self.state.members or pairs != self.state.pairs:
            self.state.members, self.state.pairs = known, pairs
            self.state.save(self.state_path)

    def _records(self, client: LinkClient, event: ev.ReplicaRecords) -> None:
        journal = self.journal
        if client is not self.client:
            return  # a late batch of an earlier link
        if journal is None:  # the first records can arrive in the same read as the answer to REPLICATE
            self._early.append(event)
            return
        if not self._expected:
            self._offset = event.first - 1
            self._expected = event.first
        if event.epoch != self.state.epoch or event.first != self._expected:
            log.error(
                "replication stream out of order: copying again",
                extra={"epoch": event.epoch, "first": event.first, "expected": self._expected},
            )
            asyncio.get_running_loop().create_task(client.close())
            return
        if event.records:
            number = journal.appended
            for data in event.records:
                if data:
                    number += 1
                    if data[0] == MAGIC and data[1] == RecordType.COMPACTED:
                        self._compacted_at = number  # once it is on disk, the segments before the roll go
            journal.append_encoded(event.records)
            self._expected = number + self._offset + 1
        if event.sync_end:
            self._sync_end = event.sync_end
            if journal.synced + self._offset >= event.sync_end:
                self._synced(journal, journal.synced)

    def _synced(self, journal: Journal, upto: int) -> None:
        client = self.client
        if client is None or not upto or journal is not self.journal:
            return  # nothing to tell, or the sync of an earlier copy's journal
        primary_upto = upto + self._offset
        client.replica_ack(primary_upto)
        if self._compacted_at and upto >= self._compacted_at:
            self._compacted_at = 0
            journal.retire_before(journal.rolled_to)  # as the primary did after the same compaction
        if not self.state.in_sync and self._sync_end and primary_upto >= self._sync_end:
            self.state.in_sync = True
            self.state.save(self.state_path)
            self.reason = "in sync"
            log.info("in sync with the primary: ready to take over", extra={"primary": self.primary})

    # ------------------------------------------------------------------ takeover
    async def _take_over(self, primary: tuple[str, int] | None) -> bool:
        """Vote rounds until a quorum lets this copy activate (True), or the lost ``primary`` answers again.
        Without a primary (none found active), one round only."""
        ha = self.settings.ha
        node_id, data_epoch = self.state.node_id, self.state.epoch
        epoch = max(data_epoch + 1, self._next_epoch)
        while not self.handed_over:
            if self._isolated():
                self._note("cut off from the network (network check): not taking over")
                if primary is None or await self._primary_back(*primary):
                    return False
                await asyncio.sleep(ha.vote_retry_ms / 1000)
                continue
            await self._refresh_members(node_id)  # the voters' addresses may have moved since the loss
            voters = [endpoint for member, endpoint in self.state.members.items() if member != node_id]
            needed = quorum(self.state.pairs)
            if not voters and ha.activate_without_quorum:
                log.warning("taking over without a quorum (ha.activate_without_quorum)")
                break
            request = VoteRequest(ACTIVATE, node_id, epoch, self.server_id, data_epoch)
            answers = [a for a in await ask_votes(self.settings, voters, request) if a is not None]
            grants = sum(1 for a in answers if a.get("granted") is True)
            stale = max((_number(a, "fresh") for a in answers), default=0) > data_epoch
            if voters and grants >= needed and not stale:
                log.info("quorum reached", extra={"votes": grants, "pairs": self.state.pairs, "epoch": epoch})
                # Commit before serving: a majority must still hold this epoch for this copy. A voter that
                # grants the commit knows the pair serves at ``epoch`` and refuses any copy older than that;
                # one that promised a higher epoch to another copy meanwhile refuses it, and that copy, not
                # this one, may activate. Two majorities share a voter, so never both.
                commit = VoteRequest(STAY, node_id, epoch, self.server_id)
                answers = [a for a in await ask_votes(self.settings, voters, commit) if a is not None]
                grants = sum(1 for a in answers if a.get("granted") is True)
                if grants >= needed:
                    break
                log.warning("epoch won but not committed: asking again", extra={"epoch": epoch, "votes": grants})
                if grants:
                    # Those voters now refuse copies older than ``epoch``. Nobody else can have served at it
                    # (a majority promised it to this copy) and this copy wrote nothing at it, so its data
                    # is whole at ``epoch``: say so, or both copies would be stale against a phantom.
                    data_epoch = self.state.epoch = epoch
                    self.state.activated = False
                    self.state.save(self.state_path)
            fresh = max((_number(a, "fresh") for a in answers), default=0)
            if fresh > data_epoch:
                self._note(
                    f"the pair was active at epoch {fresh}, newer than this copy's {data_epoch}: "
                    "copying the active node"
                )
                self.state.in_sync = False  # only a copy of the active node is whole from now on
                self.state.save(self.state_path)
                return False
            promised = max((_number(a, "epoch") for a in answers if a.get("granted") is not True), default=0)
            if promised >= epoch and len(answers) >= needed:
                # Another copy of this pair asked for this epoch or a higher one, and the votes split: ask
                # above them, after a random pause so the two do not split again. Safe, since a copy
                # serves only once a majority committed its epoch, and then any majority of answers
                # includes a voter that refuses this copy as stale. (With fewer answers, a committed
                # epoch could hide among the silent: bidding above it would fence the serving copy.)
                epoch = self._next_epoch = promised + 1
            lost = "primary lost" if primary else "no active copy"
            self.reason = f"{lost}: {grants} of {needed} votes (pairs: {self.state.pairs})"
            if primary is None or await self._primary_back(*primary):
                return False
            await asyncio.sleep(ha.vote_retry_ms / 1000 * random.uniform(0.5, 1.5))  # noqa: S311 - jitter
        self._close_journal()
        self.identity.set_epoch(epoch)
        self.state.epoch, self.state.activated = epoch, True
        self.state.save(self.state_path)
        self.reason = "active"
        log.warning("backup activated", extra={"node_id": node_id, "epoch": epoch})
        await self._activate()
        return True

    async def _refresh_members(self, own_node_id: str) -> None:
        """Learn the cluster's members from the first active node that answers: a voter may have failed over
        (or failed back) to another address since this backup last heard from its primary."""
        endpoints = [e for n, e in self.state.members.items() if n != own_node_id]
        endpoints += [parse_endpoint(c) for c in self.settings.cluster.connectors]
        asking = [asyncio.ensure_future(self._members_at(*e)) for e in dict.fromkeys(endpoints)]
        try:
            for answer in asyncio.as_completed(asking):  # the first active node to answer is enough
                members = await answer
                if members is not None:
                    self._learn([m for m in members if isinstance(m, dict) and m.get("node_id") != own_node_id])
                    return
        finally:
            for task in asking:
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)  # their links are closed before going on

    async def _members_at(self, host: str, port: int) -> list[Any] | None:
        client = node_link(self.settings, host, port, f"vote:{self.settings.node.name}", connect_timeout=VOTE_TIMEOUT)
        try:
            await client.connect()
            members = (await asyncio.wait_for(client.topology({}), VOTE_TIMEOUT)).get("members")
        except (LinkRequestError, OSError, TimeoutError):
            return None
        except Exception:  # another node's answer is input: one odd answer must not end the backup's task
            log.exception("unexpected answer to a topology request", extra={"node": f"{host}:{port}"})
            return None
        finally:
            await client.close()
        return members if isinstance(members, list) else None

    async def _primary_back(self, host: str, port: int) -> bool:
        """Whether the lost primary completes a handshake again (a paused or dead one cannot): then it is
        copied afresh, not replaced."""
        client = node_link(self.settings, host, port, f"backup:{self.settings.node.name}", connect_timeout=0.3)
        try:
            await client.connect()
        except (LinkRequestError, OSError, TimeoutError):
            return False
        finally:
            await client.close()
        log.info("the primary answers again: copying it afresh", extra={"primary": f"{host}:{port}"})
        return True

    # ------------------------------------------------------------------ helpers
    def _note(self, reason: str, *, error: bool = False) -> None:
        """Say why the backup is not copying or taking over: in its status always, in the log once."""
        if reason not in self._logged:
            self._logged.add(reason)
            (log.error if error else log.warning)("backup", extra={"state": reason})
        self.reason = reason

    def _close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    async def _close_link(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
