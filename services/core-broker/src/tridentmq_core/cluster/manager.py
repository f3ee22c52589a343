"""The cluster manager: this node's cluster connections, what it tells the other nodes, redistribution.

The asyncio shell of clustering. Every node opens one cluster connection (a ``Bridge``, ``bridge.py``) to
every other node it learns of (static connectors, discovery, or the members another node reports), logged
in with the cluster credentials, and joins with a TOPOLOGY request. The node it joined answers with its
bindings and members, then pushes changes as TOPOLOGY_UPDATE operations. Messages for that node leave
through the same connection: the bridge consumes this node's store-and-forward queue for it (and, while
redistribution runs, the queues being moved) and acknowledges each message only when the other node has
confirmed it, so a dropped connection loses nothing: the messages go back to their queue and are sent again,
and the other node recognises the copies by their transfer id. This module keeps the members, the nodes
that joined this one (and what they were told), the ticks that pace redistribution, and node departures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from tridentmq_core.balancer import Balancer, is_local_consumer
from tridentmq_core.broker import Broker
from tridentmq_core.checks import BrokerError
from tridentmq_core.cluster.bridge import Bridge
from tridentmq_core.cluster.discovery import MAX_MEMBERS, Announcement, RedisDiscovery
from tridentmq_core.cluster.sync import BindingSync
from tridentmq_core.forwarder import FORWARD_QUEUE_PREFIX, Direct
from tridentmq_core.ha.votes import Standing
from tridentmq_core.ha.voting import Voter
from tridentmq_core.queues import Consumer, Queue
from tridentmq_core.redistribution import (
    Arrivals,
    Redistributor,
    best_target,
    due_again,
    saturated,
    stranded,
    targets,
)
from tridentmq_core.remote_bindings import Binding, BindingError, Key, RemoteBindings
from tridentmq_core.security import Principal
from tridentmq_core.sessions import Session
from tridentmq_core.settings import LOAD_BALANCING_POLICIES, CoreSettings
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode, NackMode, Op
from tridentmq_shared.link.topology import endpoint_from_wire, parse_endpoint
from tridentmq_shared.message import RoutingType, WireMessage
from tridentmq_shared.mqtt_queues import RETAINED_ADDRESS, TOPIC_PROPERTY, holds_records, retained_queue
from tridentmq_shared.runtime import wall_ms
from tridentmq_shared.settings import SettingsError
from tridentmq_shared.supervision import spawn

log = logging.getLogger("tridentmq.core.cluster")
#: How long a node waits for another to delete a queue's copy (DELETE_QUEUE_EVERYWHERE): this many heartbeat
#: intervals, and at least the floor (heartbeats may be off).
DELETE_ELSEWHERE_TIMEOUT_FACTOR: Final = 4
DELETE_ELSEWHERE_MIN_TIMEOUT_S: Final = 2.0

TICK_SECONDS: Final = 0.1
#: Queues a leaving node makes on their destinations at once, and how long it then waits to see them advertised.
SCALE_DOWN_COPIES_AT_ONCE: Final = 100
SCALE_DOWN_ADVERTISED_WAIT_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class Member:
    node_id: str
    name: str
    host: str
    port: int
    management: int = 0  # its management HTTP port (0: none), for `tridentmq status` across the cluster
    backup: tuple[str, int] | None = None  # the link endpoint of its in-sync backup (HA), where clients go next
    epoch: int = 0  # its activation epoch: clients refuse a copy of the node at a lower one

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "node_id": self.node_id,
            "name": self.name,
            "host": self.host,
            "port": self.port,
            "management": self.management,
            "epoch": self.epoch,
        }
        if self.backup is not None:
            wire["backup"] = list(self.backup)
        return wire

    @staticmethod
    def from_wire(item: Any) -> Member:
        if not isinstance(item, dict):
            raise ValueError("a member is a map")  # noqa: TRY004 - callers catch ValueError for any bad input
        node_id, name, host, port = item.get("node_id"), item.get("name", ""), item.get("host"), item.get("port")
        management = item.get("management", 0)
        if not (
            isinstance(node_id, str)
            and node_id
            and isinstance(name, str)
            and isinstance(host, str)
            and host
            and type(port) is int
            and 0 < port < 65536
            and type(management) is int
            and 0 <= management < 65536
        ):
            raise ValueError(f"malformed member {str(item)[:120]}")
        backup = endpoint_from_wire(item.get("backup"))
        if backup is None and item.get("backup") is not None:
            raise ValueError(f"malformed backup of member {node_id}")
        epoch = item.get("epoch", 0)
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"malformed epoch of member {node_id}")
        return Member(node_id, name, host, port, management, backup, epoch)


@dataclass(slots=True)
class Joined:
    """A node that joined this one: it gets this node's bindings over its own connection."""

    session: Session
    node_id: str
    acks_bindings: bool = False  # acknowledges the sync numbers of binding changes (``BindingSync``)
    knows_backlog: bool = False  # reads a binding's backlog flag (an older node refuses an 11-field binding)
    sent: dict[Key, list[Any]] = field(default_factory=dict)
    relayed: set[Key] = field(default_factory=set)  # the keys of ``sent`` that are not this node's own queues
    members_sent: list[dict[str, Any]] = field(default_factory=list)


def validate_cluster_settings(settings: CoreSettings) -> bool:
    """Whether the node clusters; raises ``SettingsError`` for settings it cannot cluster with."""
    cluster = settings.cluster
    wants = bool(cluster.connectors or cluster.discovery)
    has_credentials = bool(cluster.user and cluster.password)
    if wants and not has_credentials:
        raise SettingsError(
            "cluster.user and cluster.password are required to cluster (they have no default): "
            "set them, the same on every node"
        )
    if cluster.message_load_balancing.upper() not in LOAD_BALANCING_POLICIES:
        raise SettingsError(f"cluster.message_load_balancing must be one of {', '.join(LOAD_BALANCING_POLICIES)}")
    for connector in cluster.connectors:
        parse_connector(connector)
    return has_credentials


def stays_on_leaving_node(node_id: str, name: str) -> bool:
    """The queues a leaving node keeps in its journal: its store-and-forward queues, and its copy of the MQTT
    retained messages, which every node keeps whole for the gateways on it. Moved, that copy became a namesake
    of the one made when the node came back, and the cluster, taking the two for one subscription, split the
    retained messages between them: a gateway on that node read half of them, or none."""
    return name.startswith(FORWARD_QUEUE_PREFIX) or name == retained_queue(node_id)


def _taken_will(item: Any) -> tuple[str, str, bool]:
    """A will key another node's link took: [key, user, publish_pending]; ``ValueError`` when malformed."""
    if type(item) is not list or len(item) != 3:
        raise ValueError("a taken will is [key, user, publish_pending]")
    key, user, publish_pending = item
    if type(key) is not str or type(user) is not str or type(publish_pending) is not bool:
        raise ValueError("a taken will is [key, user, publish_pending]")
    return key, user, publish_pending


def _listed(report: dict[str, Any], key: str) -> list[Any]:
    """A list field of another node's report (absent: empty); ``ValueError`` when it is something else."""
    value = report.get(key)
    if value is None:
        return []
    if type(value) is not list:
        raise ValueError(f"{key} of a cluster report is a list")
    return value


def parse_connector(text: str) -> tuple[str, int]:
    try:
        return parse_endpoint(text)
    except ValueError as exc:
        raise SettingsError(f"cluster connector: {exc}") from None


class ClusterManager:
    def __init__(
        self,
        broker: Broker,
        settings: CoreSettings,
        *,
        node_id: str,
        name: str,
        advertise: tuple[str, int],
        schedule_flush: Callable[[], None],
        management_port: int = 0,
        epoch: int = 1,
        voter: Voter | None = None,
        server_id: str = "",
    ) -> None:
        cluster = settings.cluster
        self.epoch = epoch  # this node's activation epoch: a copy of it at a lower one is refused
        self.server_id = server_id  # this process, as votes name it: told with the epoch
        self.voter = voter  # knows the highest epoch promised or seen per node id
        #: Called when another node says a newer copy of this node is active (the server stops at once).
        self.on_fenced: Callable[[str], None] = lambda _reason: None
        #: The link endpoint of this node's in-sync backup, if any (reported with the members).
        self.backup: Callable[[], tuple[str, int] | None] = lambda: None
        self.broker = broker
        self.settings = settings
        self.node_id = node_id
        self.name = name
        self.advertise = advertise
        self.management_port = management_port
        self.schedule_flush = schedule_flush
        self.bindings = RemoteBindings(node_id, max_hops=cluster.max_hops, max_per_node=cluster.max_bindings)
        self.policy = cluster.message_load_balancing.upper()
        self.balancer = Balancer(self.bindings, self.policy)
        self.bridges: dict[str, Bridge] = {}  # by host:port
        self.bridges_by_node: dict[str, Bridge] = {}
        self._bridge_answered = asyncio.Event()
        self.members: dict[str, Member] = {}  # every node heard of, by id
        self.joined: dict[str, Joined] = {}  # by link connection id
        self._outbid_logged: set[tuple[str, Any]] = set()  # (node id, epoch) of joins refused as outbid, logged
        self.watchers: dict[str, Session] = {}  # gateways following the topology, by connection id
        # By queue name and target node: one per node with consumers for the queue.
        self.redistributors: dict[tuple[str, str], tuple[Bridge, Redistributor]] = {}
        self._stranded_since: dict[str, int] = {}
        self._moved_seen: dict[tuple[str, str], int] = {}  # each redistributor's ``moved`` at the last tick
        self._moving: set[str] = set()  # queues a redistributor moved messages of since the last tick
        self._stuck_since: dict[str, int] = {}  # queues with messages nobody here takes nor moves → since when
        self._gone_tried: dict[str, tuple[int, int]] = {}  # gone node → the binding versions its queue was tried at
        # A node whose connection was replaced (it came back at another address: a failback, a backup that took
        # over) → since when it has been unreachable: the new connection does not start its clock again.
        self._moved_down_since: dict[str, float] = {}
        self._joined_until: dict[str, float] = {}  # node id → when its own connection to this node last closed
        self._sent_version = (-1, -1)
        self._backlogged: frozenset[str] = frozenset()  # own queues last advertised as saturated
        self._members_version = 0
        self._members_full_logged = False
        # Replies to clients whose queue or consumer the other nodes must know first.
        self.sync = BindingSync(timeout_ms=max(2000, 8 * settings.link.heartbeat_ms))
        self._push_scheduled = False
        # Will keys taken here that a pending will on another node may be under: [key, user, publish_pending],
        # sent with the next update (see ``WillKeeper.taken_elsewhere``).
        self._wills_taken: list[list[Any]] = []
        broker.wills.tell_others = self._will_taken
        # The queues that may hold messages: what looks for backlogs, stranded messages and the messages of nodes
        # gone goes through, not the node's every queue (100,000 MQTT sessions are 200,000 queues, nearly all
        # empty). Those that got messages since the last look join them (see ``_with_messages``).
        self._changed = broker.activity.changed.reader()
        self._holding = {queue for queue in broker.queues.values() if len(queue)}
        # The bindings of this node's queues as the other nodes are to know them, by queue name, kept up to date
        # from the queues' notes (a push with each change went through every queue): the names changed since
        # the last push, whether the last push said this node leaves, the versions of what it relayed of others.
        self._bound = broker.activity.bindings.reader()
        self._own: dict[str, list[Any]] = {}
        self._own_changed: set[str] = set()
        for queue_name in broker.queues:
            self._rewire(queue_name)
        self._pushed_leaving = False
        self._relayed_version = (-1, -1)
        self._task: asyncio.Task[None] | None = None
        self._started = time.monotonic()
        self.discovery: RedisDiscovery | None = None
        self.leaving = False  # scaling down: this node advertises no bindings, so nothing new comes
        self._scale_down_deadline = 0.0  # set by prepare_scale_down (monotonic)
        self._scale_down_copies: dict[str, Bridge] = {}  # durable queue → the node its copy was made on
        self._scale_down_tried: set[tuple[str, str]] = set()  # (durable queue, node id) copied again there
        self._scale_down_looked_at: tuple[int, frozenset[str]] | None = None  # see _copy_to_live
        self._last_copies_checked: dict[str, tuple[tuple[int, int], int]] = {}  # see last_copies
        broker.cluster = self.balancer
        broker.on_topology = self.on_topology
        broker.hold_reply = self.hold_reply
        broker.delete_elsewhere = self.delete_elsewhere
        broker.forwarder.send_direct = self._send_direct

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        for connector in self.settings.cluster.connectors:
            host, port = parse_connector(connector)
            if (host, port) != self.advertise:
                self.connect(host, port)
        self._task = spawn(self._tick_forever(), "cluster")
        cluster = self.settings.cluster
        if cluster.discovery:
            host, port = self.advertise
            me = Announcement(cluster.name, self.node_id, self.name, host, port)
            self.discovery = RedisDiscovery(
                cluster.discovery,
                me,
                broadcast_period=cluster.broadcast_period_ms / 1000,
                refresh_timeout=cluster.refresh_timeout_ms / 1000,
                on_change=self._discovered,
            )
            await self.discovery.start()
        log.info(
            "clustering",
            extra={
                "cluster": self.settings.cluster.name,
                "policy": self.policy,
                "max_hops": self.settings.cluster.max_hops,
                "connectors": ",".join(self.settings.cluster.connectors),
            },
        )

    async def join(self, timeout: float, ignore: Collection[str] = ()) -> tuple[int, int]:
        """Wait, at most ``timeout`` seconds, until discovery (if any) has had its first look and every node known
        here has answered a first cluster connection (reporting its queues, or refusing as a passive backup
        does) or failed to. ``ignore``: addresses (host:port) not waited for (a backup's own primary holds no
        queue it does not). Returns (nodes that reported, nodes known)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                if self.discovery is not None:
                    await self.discovery.first_look.wait()
                while True:
                    self._bridge_answered.clear()
                    if all(b.state != "connecting" for a, b in self.bridges.items() if a not in ignore):
                        break
                    await self._bridge_answered.wait()
        bridges = [bridge for address, bridge in self.bridges.items() if address not in ignore]
        return sum(bridge.up for bridge in bridges), len(bridges)

    def bridge_answered(self) -> None:
        """A cluster connection got an answer (it is up, or it failed): ``join`` looks again."""
        self._bridge_answered.set()

    def down_since(self, node_id: str) -> float | None:
        """Since when ``node_id`` has been unreachable (``time.monotonic()``), None while it is connected. A
        node heard of but never connected counts from this node's start."""
        bridge = self.bridges_by_node.get(node_id)
        if bridge is not None and bridge.up:
            return None
        moved = self._moved_down_since.get(node_id)
        if bridge is None:
            return self._started if moved is None else moved
        return bridge.down_since if moved is None else min(bridge.down_since, moved)

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()  # announces the leave
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(bridge.stop() for bridge in list(self.bridges.values())), return_exceptions=True)

    def connect(self, host: str, port: int) -> None:
        """Open a cluster connection to ``host:port`` unless there is one."""
        key = f"{host}:{port}"
        if key in self.bridges:
            return
        bridge = self.bridges[key] = Bridge(self, host, port)
        bridge.start()

    def join_info(self) -> dict[str, Any]:
        host, port = self.advertise
        return {
            "cluster": self.settings.cluster.name,
            "node_id": self.node_id,
            "name": self.name,
            "host": host,
            "port": port,
            "management": self.management_port,
            "epoch": self.epoch,
            "server": self.server_id,
            "max_hops": self.settings.cluster.max_hops,
            "binding_acks": True,
            "binding_backlog": True,
        }

    def standing(self, node_id: str, epoch: Any, server: Any = "") -> Standing:
        """Whether ``node_id`` at ``epoch`` (served by the process ``server``) may be talked to (current), must stop
        (replaced: a newer copy of it serves), or waits (outbid: a newer epoch was promised to a copy not known
        to have won it)."""
        if self.voter is None:
            return Standing.CURRENT
        if type(epoch) is not int:
            return Standing.REPLACED
        return self.voter.observe(node_id, epoch, server if type(server) is str else "")

    # ------------------------------------------------------------------ another node joins us
    def on_topology(self, session: Session, info: dict[str, Any]) -> dict[str, Any]:
        join = info.get("join")
        if "synced" in info and session.principal.cluster:  # a node applied our binding changes up to there
            self.sync.acknowledged(session.conn_id, info["synced"])
            return {}
        if join is None:  # a gateway following the topology
            self.watchers[session.conn_id] = session
            return {"node_id": self.node_id, "members": self.members_view()}
        if not session.principal.cluster:
            raise BrokerError(ErrorCode.FORBIDDEN, "joining the cluster takes the cluster credentials")
        if not isinstance(join, dict):
            raise BrokerError(ErrorCode.INVALID, "join is a map")
        cluster = self.settings.cluster
        problem = None
        if join.get("cluster") != cluster.name:
            problem = f"cluster name {join.get('cluster')!r} is not this cluster's ({cluster.name!r})"
        elif join.get("max_hops") != cluster.max_hops:
            problem = f"max_hops {join.get('max_hops')!r} differs from this node's ({cluster.max_hops})"
        elif join.get("node_id") == self.node_id and self.settings.ha.policy != "none":
            # The other copy of this pair (a failover or failback moved the pair's node id): the epochs decide
            # which one serves, nothing for an operator to fix.
            problem = f"another copy of this pair (epoch {join.get('epoch')}; this one {self.epoch})"
            log.info("cluster join refused", extra={"peer": session.peer, "reason": problem})
            raise BrokerError(ErrorCode.INVALID, problem)
        elif join.get("node_id") == self.node_id:
            problem = f"node id {self.node_id} is this node's own (a copied data directory?)"
        elif (
            standing := self.standing(str(join.get("node_id")), join.get("epoch", 1), join.get("server", ""))
        ) is Standing.REPLACED:
            # A copy of a pair that another replaced: the fencing at work during a failover or failback; that
            # copy stops when it hears this.
            problem = f"epoch {join.get('epoch')} of node {join.get('node_id')} was replaced by a newer one"
            log.warning("cluster join refused", extra={"peer": session.peer, "reason": problem})
            raise BrokerError(ErrorCode.FENCED, problem)
        elif standing is Standing.OUTBID:
            # Its backup bid for a newer epoch here, maybe in vain (this node only stood still): it joins again
            # once it serves at a newer epoch, which a quorum grants it only if that backup did not win.
            problem = (
                f"epoch {join.get('epoch')} of node {join.get('node_id')} may have been replaced: a newer one was "
                "promised to another copy of that pair; join again at a newer epoch"
            )
            # Asked again every retry interval until it serves at a newer epoch: said once per epoch.
            outbid = (str(join.get("node_id")), join.get("epoch"))
            (log.debug if outbid in self._outbid_logged else log.warning)(
                "cluster join refused", extra={"peer": session.peer, "reason": problem}
            )
            if len(self._outbid_logged) >= 1024:  # a few per failover: only a peer gone wrong gets here
                self._outbid_logged.clear()
            self._outbid_logged.add(outbid)
            raise BrokerError(ErrorCode.INVALID, problem)
        try:
            member = Member.from_wire(join)
        except ValueError as exc:
            problem = problem or str(exc)
        if problem is not None:
            log.error("cluster join refused", extra={"peer": session.peer, "reason": problem})
            raise BrokerError(ErrorCode.INVALID, problem)
        joined = Joined(
            session,
            member.node_id,
            acks_bindings=join.get("binding_acks") is True,
            knows_backlog=join.get("binding_backlog") is True,
        )
        joined.sent = self._advertisement(member.node_id, backlog=joined.knows_backlog)
        joined.relayed = {key for key in joined.sent if key[0] != self.node_id}
        joined.members_sent = self.members_view()
        self.joined[session.conn_id] = joined
        self.learn(member)
        log.info(
            "node joined",
            extra={"node_id": member.node_id, "node_name": member.name, "address": f"{member.host}:{member.port}"},
        )
        self.broker.audit.emit(wall_ms() * 1000, "node.joined", {"peer_node": member.node_id, "name": member.name})
        return {
            "node_id": self.node_id,
            "name": self.name,
            "bindings": list(joined.sent.values()),
            "members": joined.members_sent,
            "epoch": self.epoch,
            "server": self.server_id,
        }

    def _send_direct(self, node_id: str, message: WireMessage, token: int, publisher: Session | None) -> Direct:
        bridge = self.bridges_by_node.get(node_id)
        return Direct.REFUSED if bridge is None else bridge.send_direct(message, token, publisher)

    def _discovered(self, announced: Mapping[str, Announcement]) -> None:
        """Discovery only finds nodes: connections, not Redis, decide whether a node is alive."""
        for announcement in announced.values():
            self.learn(Member(announcement.node_id, announcement.name, announcement.host, announcement.port))

    def learn(self, member: Member) -> None:
        """A node of the cluster (reported by another, or discovered): connect to it if we do not yet."""
        if member.node_id == self.node_id:
            return
        known = self.members.get(member.node_id)
        if known is None and len(self.members) >= MAX_MEMBERS:
            # Each member costs a cluster connection that is retried for ever: a peer's report is no reason
            # to open any number of them.
            if not self._members_full_logged:
                self._members_full_logged = True
                log.warning("cluster: member limit reached, further nodes ignored", extra={"limit": MAX_MEMBERS})
            return
        if known != member:
            self.members[member.node_id] = member
            self._members_version += 1
        bridge = self.bridges_by_node.get(member.node_id)
        if bridge is not None and not bridge.up and (bridge.host, bridge.port) != (member.host, member.port):
            # The node came back at another address (a restart on a new port, a backup that took over).
            self.retire(bridge)
            bridge = None
        if bridge is None:
            self.connect(member.host, member.port)

    def members_changed(self) -> None:
        """Something in this node's own entry changed (its backup): tell the others and the gateways."""
        self._members_version += 1

    def member_endpoints(self) -> list[tuple[str, int]]:
        """The link endpoint of every other node heard of."""
        return [(member.host, member.port) for member in self.members.values()]

    def reachable(self, node_id: str, grace_s: float) -> bool:
        """Whether the cluster connection to ``node_id`` is up, or went down less than ``grace_s`` ago."""
        since = self.down_since(node_id)
        if since is None:
            return True
        if node_id not in self.bridges_by_node and node_id not in self._moved_down_since:
            return False  # never connected from here: nothing says it is alive
        return time.monotonic() - since < grace_s

    def retire(self, bridge: Bridge) -> None:
        """Drop a bridge whose node now lives at another address."""
        if self.bridges_by_node.get(bridge.node_id) is bridge:
            del self.bridges_by_node[bridge.node_id]
            if not bridge.up:  # until its new connection is up, the node is away since the old one went down
                self._moved_down_since[bridge.node_id] = min(
                    bridge.down_since, self._moved_down_since.get(bridge.node_id, bridge.down_since)
                )
        self.bridges.pop(bridge.address, None)
        spawn(bridge.stop(), f"bridge-stop-{bridge.address}")

    def members_view(self) -> list[dict[str, Any]]:
        """The live members: this node and the nodes its cluster connections reach."""
        host, port = self.advertise
        view = [Member(self.node_id, self.name, host, port, self.management_port, self.backup(), self.epoch).to_wire()]
        for node_id, bridge in sorted(self.bridges_by_node.items()):
            if bridge.up:
                member = self.members.get(node_id) or Member(node_id, bridge.name, bridge.host, bridge.port)
                view.append(member.to_wire())
        return view

    # ------------------------------------------------------------------ our bridges
    def bridge_up(self, bridge: Bridge, reply: dict[str, Any]) -> bool:
        standing = self.standing(bridge.node_id, reply.get("epoch", 1), reply.get("server", ""))
        if standing is not Standing.CURRENT:
            reason = (
                f"epoch {reply.get('epoch')} of that node was replaced by a newer one (a fenced copy)"
                if standing is Standing.REPLACED
                else f"epoch {reply.get('epoch')} of that node may have been replaced: a newer one was promised"
            )
            bridge.note_refused(reason, logging.ERROR if standing is Standing.REPLACED else logging.WARNING)
            return False
        try:
            self.bindings.replace(bridge.node_id, _listed(reply, "bindings"))
            self._keep_retained_copy(_listed(reply, "bindings"))
            members = [Member.from_wire(m) for m in _listed(reply, "members")]
        except (BindingError, ValueError) as exc:
            log.error("cluster join answer refused", extra={"to": bridge.address, "reason": str(exc)})  # noqa: TRY400
            bridge.state, bridge.reason = "refused", str(exc)
            return False
        bridge.name = str(reply.get("name", ""))
        principal = Principal(f"cluster:{bridge.node_id}", frozenset(), unrestricted=True, cluster=True)
        bridge.open_session(principal)
        self._moved_down_since.pop(bridge.node_id, None)
        self._members_version += 1
        for member in members:
            self.learn(member)
        log.info(
            "cluster connection up",
            extra={"to": bridge.address, "node_id": bridge.node_id, "bindings": len(reply.get("bindings") or [])},
        )
        self.schedule_flush()
        return True

    def bridge_down(self, bridge: Bridge, *, was_up: bool = True) -> None:
        """``was_up``: the connection was up (else a try to reconnect failed: the node left once, when it went
        down, not at every try)."""
        # Its durable queues stay destinations (unreachable): their messages wait in its forward queue here
        # until it, or its backup under its id, is back, instead of being routed nowhere meanwhile.
        self.bindings.depart(bridge.node_id)
        for key, (owner, _) in list(self.redistributors.items()):
            if owner is bridge:
                del self.redistributors[key]
        self._members_version += 1
        if was_up:
            self.broker.audit.emit(wall_ms() * 1000, "node.left", {"peer_node": bridge.node_id, "name": bridge.name})

    def apply_update(self, bridge: Bridge, update: dict[str, Any]) -> None:
        if update.get("leaving") is True and not bridge.leaving:
            bridge.leaving = True
            leaving = bridge.node_id
            # Before its bindings go with this update. What it keeps needs no more messages: every node has
            # its own copy of the retained messages.
            self.bindings.leave(leaving, lambda q, a: self._holds(q, a) or stays_on_leaving_node(leaving, q))
            if last := self.last_copies(bridge.node_id):
                log.info(
                    "a node scaling down holds the only copy known here of some durable queues: they stay "
                    "destinations until another copy is known",
                    extra={"node_id": bridge.node_id, "queues": last},
                )
            # A leaving node moves nothing it gets after its last look: what moves there (a redistributor, a
            # scale-down mover of ours) stops, and once what it sent is confirmed the queue moves elsewhere.
            for consumer in bridge.consumers.values():
                if isinstance(consumer, Redistributor):
                    consumer.stop()
        try:
            if "bindings" in update or "removed" in update:
                self.bindings.apply(bridge.node_id, _listed(update, "bindings"), _listed(update, "removed"))
                self._keep_retained_copy(_listed(update, "bindings"))
            for member in _listed(update, "members"):
                self.learn(Member.from_wire(member))
            for key, user, publish_pending in map(_taken_will, _listed(update, "wills_taken")):
                self.broker.wills.taken_elsewhere(key, user, publish_pending, wall_ms())
        except (BindingError, ValueError) as exc:
            log.warning("cluster update refused", extra={"from": bridge.address, "reason": str(exc)})

    def last_copies(self, node_id: str) -> int:
        """How many durable queues of ``node_id``, scaling down, this node still routes to: it knows no other
        copy of them (see ``RemoteBindings.last_copies``). Looked at again only once a queue came or went, here
        or elsewhere: asked every 20 ms while that node waits, and it may have 100,000 queues."""
        checked = self._last_copies_checked.get(node_id)
        if checked is not None and checked[0] == (self.bindings.version, self.broker.bindings_version):
            return checked[1]
        count = self.bindings.last_copies(node_id, self._holds)
        self._last_copies_checked[node_id] = ((self.bindings.version, self.broker.bindings_version), count)
        return count

    def _holds(self, queue: str, address: str) -> bool:
        held = self.broker.queues.get(queue)
        return held is not None and held.address == address

    def _keep_retained_copy(self, bindings: list[Any]) -> None:
        """Once another node has a copy of the MQTT retained messages (``bindings`` it reported), this node makes
        its own: each retained publish then reaches every node, and a gateway's service link that moves here (a
        failover, a failback) reads them all. Made only when such a link first came, a copy lacked everything
        retained before, and the retained messages looked gone until the link went back."""
        own = retained_queue(self.broker.node_id)
        if own in self.broker.queues or not any(binding[2] == RETAINED_ADDRESS for binding in bindings):
            return
        self.broker.catalog.create_queue(
            own, RETAINED_ADDRESS, RoutingType.MULTICAST, durable=True, now_ms=wall_ms(), last_value_key=TOPIC_PROPERTY
        )
        log.info("copy of the MQTT retained messages made", extra={"queue": own})

    def refused(self, bridge: Bridge, consumer: Consumer, message_id: int, code: str = "", text: str = "") -> None:
        """The other node refused a forwarded message: a redistributor stops and gives it back; a forward
        queue's message is routed here instead."""
        session = bridge.session
        if session is None:
            return
        now_ms = wall_ms()
        if isinstance(consumer, Redistributor):
            self.broker.handle(
                session, [ev.Nacks([[Op.NACK, consumer.id, [message_id], int(NackMode.RELEASE)]])], now_ms
            )
            consumer.stop()  # the next tick removes it, and starts another if the queue still qualifies
        else:
            self.broker.forwarder.reroute_refused(consumer, message_id, now_ms, code, text)
        self.schedule_flush()

    # ------------------------------------------------------------------ periodic work
    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.tick()
            except Exception:  # a bug here must not stop clustering for good
                log.exception("cluster tick failed")

    def tick(self) -> None:
        now_ms = wall_ms()
        self.broker.now_ms = now_ms
        self._forget_closed()
        self._push_updates()
        self._redistribute(now_ms)
        self._declare_gone(now_ms)
        self.schedule_flush()

    def _forget_closed(self) -> None:
        sessions = self.broker.sessions
        for conn_id in [c for c in self.joined if c not in sessions]:
            self._joined_until[self.joined.pop(conn_id).node_id] = time.monotonic()
            self.sync.acked.pop(conn_id, None)
        for conn_id in [c for c in self.watchers if c not in sessions]:
            del self.watchers[conn_id]
        if self.sync:
            for late in self.sync.sweep(set(self.joined), wall_ms()):
                log.warning(
                    "binding change not acknowledged in time: replied anyway",
                    extra={
                        "nodes": ",".join(sorted(self.joined[c].node_id for c in late)),
                        "timeout_ms": self.sync.timeout_ms,
                    },
                )

    # ------------------------------------------------------------------ replies that wait for the other nodes
    def hold_reply(self, session: Session, req_id: int, result: Any) -> bool:
        """A client's request changed this node's bindings: reply once every node connected to this one
        applied the change (see ``BindingSync``), sent now rather than at the next tick."""
        if session.principal.cluster or self.leaving:
            return False
        broker = self.broker
        peers = {c for c, joined in self.joined.items() if joined.acks_bindings and c in broker.sessions}
        if not peers:
            return False

        def reply() -> None:
            if session.conn_id in broker.sessions:
                session.conn.reply(req_id, result)
                broker.dirty.add(session)

        self.sync.hold(reply, peers, wall_ms())
        if not self._push_scheduled:  # one push for every change of this turn of the event loop
            self._push_scheduled = True
            asyncio.get_running_loop().call_soon(self._push_now)
        return True

    def delete_elsewhere(self, session: Session, req_id: int, queue: str, node_ids: list[str]) -> None:
        """Delete ``queue`` on each of ``node_ids`` over this node's cluster connection to it, then reply to the
        client's DELETE_QUEUE_EVERYWHERE: ``{"elsewhere": deleted, "unreachable": [node ids]}``. A node down
        keeps its copy (it expires as it would have); the client is told which."""
        # The copy here went just before: its record (if durable) is what the answer waits for too.
        written = self.broker.catalog.written_token
        spawn(self._delete_elsewhere(session, req_id, queue, node_ids, written), "delete-elsewhere")

    async def _delete_elsewhere(
        self, session: Session, req_id: int, queue: str, node_ids: list[str], written: int
    ) -> None:
        timeout = max(
            DELETE_ELSEWHERE_TIMEOUT_FACTOR * self.settings.link.heartbeat_ms / 1000, DELETE_ELSEWHERE_MIN_TIMEOUT_S
        )

        async def delete_on(node_id: str) -> bool:
            bridge = self.bridges_by_node.get(node_id)
            client = bridge.client if bridge is not None and bridge.up else None
            if client is None:
                return False
            try:
                await asyncio.wait_for(client.delete_queue(queue), timeout)
            except LinkRequestError as exc:
                return exc.code == ErrorCode.NOT_FOUND  # gone meanwhile: as good as deleted
            except TimeoutError:
                return False
            except Exception:  # a bug: logged, and the client still gets its answer
                log.exception("deleting a queue's copy on another node failed", extra={"node_id": node_id})
                return False
            return True

        done = await asyncio.gather(*(delete_on(node_id) for node_id in node_ids))
        unreachable = [node_id for node_id, ok in zip(node_ids, done, strict=True) if not ok]
        if unreachable:
            log.warning(
                "a queue's copy on another node was not deleted (down, silent or refusing): it expires there",
                extra={"queue": queue[:120], "nodes": unreachable},
            )
        broker = self.broker
        result = {"elsewhere": len(node_ids) - len(unreachable), "unreachable": unreachable}

        def reply() -> None:
            if session.conn_id not in broker.sessions:
                return
            if not self.hold_reply(session, req_id, result):  # else once the others route without the copy here
                session.conn.reply(req_id, result)
                broker.dirty.add(session)
                self.schedule_flush()

        broker.when_safe(written, reply)  # a crash before the deletion here is on disk would bring it back

    def _will_taken(self, key: str, user: str, publish_pending: bool) -> None:
        self._wills_taken.append([key, user, publish_pending])
        if not self._push_scheduled:
            self._push_scheduled = True
            asyncio.get_running_loop().call_soon(self._push_now)

    def _push_now(self) -> None:
        self._push_scheduled = False
        self._push_updates()
        self.schedule_flush()

    def _push_updates(self) -> None:
        version = (self.broker.bindings_version + self.bindings.version * 1_000_003, self._members_version)
        sync, self.sync.unsent = self.sync.unsent, 0
        backlogged = frozenset(queue.name for queue in self._with_messages() if saturated(queue))
        wills_taken, self._wills_taken = self._wills_taken, []
        if (
            version == self._sent_version
            and not sync
            and not wills_taken
            and backlogged == self._backlogged
            and self.leaving == self._pushed_leaving
        ):
            return
        before, self._backlogged = self._backlogged, backlogged
        self._sent_version = version
        for name in backlogged ^ before:
            self._rewire(name)
        self._refresh_own()
        changed, self._own_changed = self._own_changed, set()
        toggled = self.leaving != self._pushed_leaving
        if toggled:  # every binding goes (or comes back)
            self._pushed_leaving = self.leaving
            changed |= self._own.keys()
        # Other nodes' bindings are relayed when a node is down (its durable queues, kept here) and beyond one
        # hop: gone through again only when they may have changed.
        bindings = self.bindings
        relayed_version = (bindings.kept_version, bindings.version if self.settings.cluster.max_hops > 1 else 0)
        relay = toggled or relayed_version != self._relayed_version
        self._relayed_version = relayed_version
        members = self.members_view()
        for joined in self.joined.values():
            upserts, removed = self._own_diff(joined, changed)
            if relay:
                current = self._relayed(joined.node_id, backlog=joined.knows_backlog)
                sent = joined.sent
                upserts += [wire for key, wire in current.items() if sent.get(key) != wire]
                removed += [list(key) for key in joined.relayed if key not in current]
                for key in joined.relayed - current.keys():
                    del sent[key]
                sent.update(current)
                joined.relayed = set(current)
            update: dict[str, Any] = {}
            if upserts or removed:
                update["bindings"], update["removed"] = upserts, removed
            if members != joined.members_sent:
                update["members"] = joined.members_sent = members
            if self.leaving:
                update["leaving"] = True
            if sync and joined.acks_bindings:
                update["sync"] = sync
            if wills_taken:
                update["wills_taken"] = wills_taken
            if update:
                joined.session.conn.topology_update(update)
                self.broker.dirty.add(joined.session)
        for session in self.watchers.values():
            session.conn.topology_update({"members": members})
            self.broker.dirty.add(session)

    def _own_diff(self, joined: Joined, names: set[str]) -> tuple[list[list[Any]], list[list[Any]]]:
        """What ``joined`` is to learn of the named queues of this node: (upserts, removals); its ``sent`` then
        says it."""
        upserts: list[list[Any]] = []
        removed: list[list[Any]] = []
        sent, own, leaving = joined.sent, self._own, self.leaving
        for name in names:
            key = (self.node_id, name)
            wire = None if leaving else own.get(name)
            if wire is not None and not joined.knows_backlog:
                wire = wire[:10]
            if wire == sent.get(key):
                continue
            if wire is None:
                del sent[key]
                removed.append(list(key))
            else:
                sent[key] = wire
                upserts.append(wire)
        return upserts, removed

    def _refresh_own(self) -> None:
        """Bring ``_own`` up to date with the queues whose bindings changed since the last time."""
        for queue in self._bound.take():
            self._rewire(queue.name)

    def _rewire(self, name: str) -> None:
        """The binding the other nodes are to know of this node's queue ``name`` (none: deleted, a
        store-and-forward queue, or a durable queue whose record is not safe yet, which a crash would take back)."""
        queue = self.broker.queues.get(name)
        wire = None
        if queue is not None and not name.startswith(FORWARD_QUEUE_PREFIX) and name not in self.broker.catalog.unsynced:
            wire = local_binding(self.node_id, queue, backlog=name in self._backlogged)
        if wire != self._own.get(name):
            if wire is None:
                del self._own[name]
            else:
                self._own[name] = wire
            self._own_changed.add(name)

    def _advertisement(self, peer: str, *, backlog: bool = True) -> dict[Key, list[Any]]:
        """What ``peer`` should know: this node's queues and, beyond one hop, what we reach that it may not.
        ``backlog``: whether the peer reads the backlog flag (else bindings end before it)."""
        if self.leaving:
            return {}
        self._refresh_own()
        own = self.node_id
        advert = {(own, name): wire if backlog else wire[:10] for name, wire in self._own.items()}
        advert.update(self._relayed(peer, backlog=backlog))
        return advert

    def _relayed(self, peer: str, *, backlog: bool) -> dict[Key, list[Any]]:
        """What ``peer`` should know of other nodes' queues: the durable queues kept for nodes that are down and,
        beyond one hop, what we reach that it may not."""
        advert: dict[Key, list[Any]] = {}
        if self.leaving:
            return advert
        for binding in self.bindings.kept():  # a node that joins while they are down learns of them too
            if binding.node_id != peer:
                advert[binding.key] = binding.to_wire()
        max_hops = self.settings.cluster.max_hops
        if max_hops > 1:
            for binding in self.bindings:
                if peer not in (binding.via, binding.node_id) and binding.distance < max_hops and binding.reachable:
                    advert[binding.key] = binding.to_wire(binding.distance + 1)
        if not backlog:
            advert = {key: wire[:10] for key, wire in advert.items()}
        return advert

    def _redistribute(self, now_ms: int) -> None:
        broker = self.broker
        wanted: dict[tuple[str, str], Binding] = {}
        waiting: dict[str, int] = {}  # queues that qualify now → since when (their delay runs from there)
        running = {name for name, _ in self.redistributors}
        if self.policy != "OFF":
            candidates = {queue.name: queue for queue in self._with_messages()}
            for name in running:
                if (queue := broker.queues.get(name)) is not None:
                    candidates[name] = queue  # emptied, but its redistributor goes on while it qualifies
            for queue in candidates.values():
                if queue.name.startswith(FORWARD_QUEUE_PREFIX) or any(is_local_consumer(c) for c in queue.consumers):
                    continue
                if queue.name not in running and not stranded(queue):
                    continue
                found = targets(queue, self.bindings.for_queue(queue.name))
                if not found:
                    continue
                delay = broker.address_settings.resolve(queue.address).redistribution_delay_ms
                if delay < 0:
                    continue
                since = waiting[queue.name] = self._stranded_since.get(queue.name, now_ms)
                if queue.name in running or now_ms - since >= delay:
                    for target in found:
                        wanted[(queue.name, target.node_id)] = target
        self._stranded_since = waiting  # a queue that stopped qualifying waits its full delay next time
        moving: set[str] = set()
        moved_seen: dict[tuple[str, str], int] = {}
        for key, (bridge, redistributor) in list(self.redistributors.items()):
            if redistributor.in_flight or redistributor.moved != self._moved_seen.get(key, 0):
                moving.add(key[0])
            moved_seen[key] = redistributor.moved
            wants = wanted.get(key)
            if wants is None or not bridge.up or bridge.leaving or redistributor.stopped:
                redistributor.stop()  # take nothing more; leave once what it sent is confirmed
                if not redistributor.in_flight:
                    bridge.remove_consumer(redistributor)
                    del self.redistributors[key]
            else:
                redistributor.target = wants  # consumers or selectors there may have changed
                if redistributor.pace():
                    broker.offer_again(redistributor.queue)
                if redistributor.held_back:
                    moving.add(key[0])  # waiting for the consumers over there to take what they have
                if due_again(redistributor, now_ms):
                    broker.offer_again(redistributor.queue)
                    moving.add(key[0])  # passed over for their residence, not stuck: they may move now
                elif redistributor.retry_at:
                    moving.add(key[0])  # messages wait out their residence, then move
        self._moving, self._moved_seen = moving, moved_seen
        self._stuck_since = {name: self._stuck_since.get(name, now_ms) for name in self.stranded()}
        for key, target in wanted.items():
            if key in self.redistributors:
                continue
            name = key[0]
            via = self.bindings.next_hop(target.node_id)
            through = self.bridges_by_node.get(via or "")
            if through is None or not through.up or through.leaving or name not in broker.queues:
                continue  # (removing a redistributor to another node may have deleted an auto-created queue)
            queue = broker.queues[name]

            def make(
                consumer_id: int, session: Session, queue: Queue = queue, target: Binding = target
            ) -> Redistributor:
                return Redistributor(
                    consumer_id,
                    session,
                    queue,
                    self.settings.cluster.forward_window,
                    target=target,
                    selectors=self.balancer.selectors,
                    arrivals=broker.forwarder.arrivals,
                    min_residence_ms=self.settings.cluster.min_residence_ms,
                    clock=lambda: broker.now_ms,
                )

            started = through.add_redistributor(make)
            if started is not None:
                self.redistributors[key] = (through, started)
                self._moving.add(name)  # just started: give it a tick before calling the queue stuck
                log.info(
                    "redistribution started", extra={"queue": name, "to_node": target.node_id, "messages": len(queue)}
                )

    def _declare_gone(self, now_ms: int) -> None:
        """Route again what waits for nodes unreachable for longer than node_gone_ms. What waits for a queue
        that exists nowhere else stays; it is tried again only when some queue or consumer came or went (a
        message that came later had nowhere else to go), not at every tick."""
        gone_after = self.settings.cluster.node_gone_ms / 1000
        mono = time.monotonic()
        versions = (self.broker.bindings_version, self.bindings.version)
        tried, self._gone_tried = self._gone_tried, {}
        for queue in self._with_messages():
            name = queue.name
            if not name.startswith(FORWARD_QUEUE_PREFIX) or not len(queue) or queue.consumers:
                continue
            node_id = name[len(FORWARD_QUEUE_PREFIX) :]
            down_since = self.down_since(node_id)
            if down_since is None or mono - max(down_since, self._last_joined(node_id, mono)) < gone_after:
                continue
            self._gone_tried[node_id] = versions
            if tried.get(node_id) == versions:
                continue
            moved = self.broker.reroute_forward_queue(node_id, now_ms)
            if moved:
                log.warning(
                    "node declared gone: its pending messages were routed again",
                    extra={"node_id": node_id, "messages": moved},
                )

    def _with_messages(self) -> list[Queue]:
        """This node's queues that hold messages now (queued or paged; those in flight do not count)."""
        holding, queues = self._holding, self.broker.queues
        holding |= self._changed.take()
        found = [queue for queue in holding if len(queue) and queues.get(queue.name) is queue]
        if len(found) < len(holding):
            holding.intersection_update(found)  # emptied or deleted: back when a message comes
        return found

    def _last_joined(self, node_id: str, now: float) -> float:
        """When ``node_id``'s own connection to this node was last up (``now`` while it is): a node heard from
        is not gone, even while this node's connection to it is still reconnecting. (In a randomised run a
        node killed, restarted and at once cut off again was declared gone 10 s after the first fault
        although it had joined in between: a resend held for it was routed again, and delivered twice.)"""
        if any(joined.node_id == node_id for joined in self.joined.values()):
            return now
        return self._joined_until.get(node_id, 0.0)

    # ------------------------------------------------------------------ an operator forgets a node
    def forget(self, node_id: str) -> dict[str, Any]:
        """``node_id`` will never come back (its data is lost): stop keeping its durable queues as destinations,
        stop reconnecting to it, and route what waits here for it to the remaining queues of those names, or
        to the dead-letter address. Refused (ValueError) while it is connected."""
        bridge = self.bridges_by_node.get(node_id)
        if bridge is not None and bridge.up:
            raise ValueError(f"node {node_id} is connected: stop it first (or scale it down)")
        known = (
            node_id in self.members
            or node_id in self.bindings.unreachable()
            or FORWARD_QUEUE_PREFIX + node_id in self.broker.queues
        )
        if not known:
            raise ValueError(f"no node {node_id!r} is known here")
        dropped = self.bindings.forget(node_id)
        if bridge is not None:
            self.retire(bridge)
        self._moved_down_since.pop(node_id, None)
        self._joined_until.pop(node_id, None)
        if self.members.pop(node_id, None) is not None:
            self._members_version += 1
        waiting = self.broker.queues.get(FORWARD_QUEUE_PREFIX + node_id)
        before = len(waiting) if waiting is not None else 0
        moved = self.broker.reroute_forward_queue(node_id, wall_ms(), forgotten=True)
        log.warning(
            "node forgotten by an operator",
            extra={"node_id": node_id, "bindings": dropped, "messages": before, "rerouted": moved},
        )
        self.broker.audit.emit(wall_ms() * 1000, "node.forgotten", {"peer_node": node_id})
        self._sent_version = (-1, -1)  # tell the others what we no longer keep
        self.schedule_flush()
        return {"bindings": dropped, "messages": before, "rerouted": moved, "dead_lettered": before - moved}

    # ------------------------------------------------------------------ scale-down
    async def prepare_scale_down(self) -> None:
        """The first step of a graceful stop with scale-down, taken while the node still runs as usual (its
        links' heartbeats go on): make each durable queue, empty ones too, on the live node it will move to,
        and wait until this node sees those copies advertised. Meanwhile it still advertises its own, so a
        message for a subscription reaches one copy or the other, never neither: else an empty subscription
        queue (never moved) would exist nowhere once this node left, and what was published for a
        subscription between this node's leaving and its queue's move would be lost to it."""
        deadline = time.monotonic() + self.settings.cluster.scale_down_timeout_ms / 1000
        self._scale_down_deadline = deadline
        if not self._live_targets():
            return
        await self._copy_to_live(deadline)
        # A copy's answer comes at once to a node's own link; its node advertises it at its next tick, to every
        # node at once. Seeing it here means the others have it on the way too.
        wait_until = min(deadline, time.monotonic() + SCALE_DOWN_ADVERTISED_WAIT_S)
        while time.monotonic() < wait_until:
            await self._copy_to_live(deadline)  # a node that scales down at the same time advertises none
            if all(
                any(b.node_id == bridge.node_id for b in self.bindings.for_queue(name))
                for name, bridge in self._scale_down_copies.items()
                if not bridge.leaving  # one that failed to be made again elsewhere: not waited for
            ):
                break
            await asyncio.sleep(0.02)

    async def _copy_to_live(self, deadline: float) -> None:
        """Make each durable queue of this node, empty ones too, on the live node it will move to, unless a live
        node has its copy already: also one whose copy went to a node that has left since (it scales down too,
        or is down), and one made here after the first look (by a node scaling down at the same time). An
        empty queue is never moved: its only other copy would be on a node that does not come back, and a
        subscription would exist nowhere once this node left. Each queue is tried once per node."""
        targets = self._live_targets()
        if not targets:
            return
        live = {b.node_id for b in targets}
        # Looked at again only when a queue came or went or the live nodes changed: called on every pass of
        # the scale-down loop, it would go over a node's 100,000 queues twenty times a second.
        looked_at = (self.broker.bindings_version, frozenset(live))
        if looked_at == self._scale_down_looked_at:
            return
        self._scale_down_looked_at = looked_at
        copies, tried = self._scale_down_copies, self._scale_down_tried
        todo = []
        for name, queue in self.broker.queues.items():
            if not queue.durable or self._stays(name):
                continue
            copy = copies.get(name)
            if copy is not None and copy.node_id in live:
                continue
            bridge = self._destination(queue, targets)
            if (name, bridge.node_id) not in tried:
                todo.append((queue, bridge))
        for start in range(0, len(todo), SCALE_DOWN_COPIES_AT_ONCE):
            if time.monotonic() >= deadline:
                return
            chunk = todo[start : start + SCALE_DOWN_COPIES_AT_ONCE]
            tried.update((q.name, bridge.node_id) for q, bridge in chunk)
            made = await asyncio.gather(*(self._copy_queue(q, bridge) for q, bridge in chunk))
            copies.update((q.name, bridge) for (q, bridge), ok in zip(chunk, made, strict=True) if ok)

    def _stays(self, name: str) -> bool:
        return stays_on_leaving_node(self.broker.node_id, name)

    async def scale_down(self, close_clients: Callable[[], None]) -> None:
        """Before a graceful stop (after ``prepare_scale_down``): tell the others to send nothing more, let this
        node's clients go, and move every queued message to a live node, each queue to the node its copy was
        made on, else to a node that has consumers for it if one does. Waits at most ``scale_down_timeout_ms``
        from the preparation; what could not move stays in the journal."""
        deadline = self._scale_down_deadline or time.monotonic() + self.settings.cluster.scale_down_timeout_ms / 1000
        self.leaving = True
        self._sent_version = (-1, -1)
        # The others acknowledge our leaving once they route nothing more to us and what they sent us is
        # confirmed: a node that had not heard of it yet (slow, or cut off one way) may still forward to us, and
        # what arrived after our last look would be stranded here.
        leave_sync = self.sync.announce()
        self._push_updates()
        self.schedule_flush()
        close_clients()
        await asyncio.sleep(0.3)  # the others learn we leave (a node stopping at the same time is no target)
        broker = self.broker
        movers: dict[str, tuple[Bridge, Redistributor]] = {}
        refused_by: dict[str, str] = {}  # queue → the node that refused its last mover's message
        targets = self._live_targets()
        # A node that does not acknowledge (silent, cut off) is waited for as long as a binding change is, counted
        # from the last time anything was left here: one still sending us its backlog keeps it going.
        ack_wait = self.sync.timeout_ms / 1000
        acks_until = time.monotonic() + ack_wait
        while (now := time.monotonic()) < deadline:
            await self._copy_to_live(deadline)  # its copy's node left since, or it came after the first look
            targets = self._live_targets()
            left = [
                q for name, q in broker.queues.items() if not self._stays(name) and (len(q) or q.in_flight or q.paged)
            ]
            pending = [q for q in broker.forwarder.forward_queues.values() if q.consumers and (len(q) or q.in_flight)]
            in_transit = any(b.in_transit for b in self.bridges.values())  # sent straight, not confirmed yet
            if left or pending or in_transit:
                acks_until = max(acks_until, now + ack_wait)
            elif unacknowledged := self._leave_unacknowledged(leave_sync):
                if now < acks_until:
                    await asyncio.sleep(0.02)  # what they routed here before they heard may still come
                    continue
                log.warning(
                    "scale-down: leaving not acknowledged in time: stopping anyway",
                    extra={"nodes": ", ".join(unacknowledged), "timeout_ms": self.sync.timeout_ms},
                )
            if not left and not pending and not in_transit:
                held = self._held_for_down_nodes()
                if held:  # only those nodes hold their queues: nowhere else to move them, nothing to wait for
                    log.warning(
                        "scale-down incomplete: messages for nodes that are down stay in this node's journal",
                        extra={"messages": sum(held.values()), "nodes": ", ".join(sorted(held))},
                    )
                    return
                log.info("scale-down complete: no messages left on this node")
                return
            if not targets:
                break
            for queue in left:
                if any(is_local_consumer(c) for c in queue.consumers):
                    continue
                if queue.name in movers:
                    bridge, mover = movers[queue.name]
                    attached = bridge.consumers.get(mover.id) is mover
                    if attached and bridge.leaving:
                        mover.stop()  # that node moves nothing it gets after its last look
                    if attached and (not mover.stopped or mover.in_flight):
                        continue  # moving, or a refused one's other messages are still to be confirmed or refused
                    # It stopped (a refusal, or its node leaves too), or its connection went (what it sent
                    # unconfirmed went back to the queue with it): move the queue again, to another live node if
                    # there is one.
                    if attached:
                        bridge.remove_consumer(mover)
                        if not bridge.leaving:
                            refused_by[queue.name] = bridge.node_id
                    del movers[queue.name]
                candidates = [b for b in targets if b.node_id != refused_by.get(queue.name)] or targets
                moving = await self._move_queue(queue, candidates, self._scale_down_copies.get(queue.name))
                if moving is not None:
                    movers[queue.name] = moving
            await asyncio.sleep(0.05)
        remaining = sum(len(q) + q.in_flight for q in broker.queues.values())
        log.warning(
            "scale-down incomplete: messages stay in this node's journal",
            extra={"messages": remaining, "live_targets": len(targets)},
        )

    def _leave_unacknowledged(self, number: int) -> list[str]:
        """The nodes still connected to this one that have not acknowledged the leaving sent with ``number``."""
        acked, sessions = self.sync.acked, self.broker.sessions
        return sorted(
            joined.node_id
            for conn_id, joined in self.joined.items()
            if joined.acks_bindings and acked.get(conn_id, 0) < number and conn_id in sessions
        )

    def _held_for_down_nodes(self) -> dict[str, int]:
        """Node id → messages waiting here for that node while it is down (its store-and-forward queue has no
        consumer). They cannot move: their queues are on that node, which a scale-down must not drop."""
        return {
            node_id: len(q) + q.in_flight + q.paged
            for node_id, q in self.broker.forwarder.forward_queues.items()
            if not q.consumers and (len(q) or q.in_flight or q.paged)
        }

    def _live_targets(self) -> list[Bridge]:
        return sorted((b for b in self.bridges_by_node.values() if b.up and not b.leaving), key=lambda b: b.node_id)

    def _destination(self, queue: Queue, targets: list[Bridge]) -> Bridge:
        """Where a leaving node's queue goes: the node with the most consumers for it, else the first live one."""
        by_node = {b.node_id: b for b in targets}
        remote = best_target(queue, [b for b in self.bindings.for_queue(queue.name) if b.node_id in by_node])
        return by_node[remote.node_id] if remote is not None else targets[0]

    async def _copy_queue(self, queue: Queue, bridge: Bridge) -> bool:
        """Make ``queue`` on ``bridge``'s node, with its shape, so a subscription stays a subscription (and an
        expiring one expires there too); whether it is there now."""
        client = bridge.client
        if client is None:
            return False
        spec: dict[str, Any] = {
            "filter": queue.filter.text if queue.filter is not None else None,
            "last_value_key": queue.last_value_key,
            "exclusive": queue.exclusive,
        }
        if queue.expires_ms >= 0:
            spec["expires_ms"] = queue.expires_ms
        if queue.max_consumers >= 0:
            spec["max_consumers"] = queue.max_consumers
        try:
            await client.create_queue(
                queue.name, queue.address, routing_type=queue.routing_type, durable=queue.durable, **spec
            )
        except LinkRequestError as exc:  # exists there with another shape (messages go by name anyway), or lost
            log.warning("scale-down: queue not created on the target", extra={"queue": queue.name, "reason": exc.text})
            return exc.code == ErrorCode.EXISTS
        return True

    async def _move_queue(
        self, queue: Queue, targets: list[Bridge], chosen: Bridge | None
    ) -> tuple[Bridge, Redistributor] | None:
        """Move a queue's messages to ``chosen`` while it is live (the node its copy was made on), else to the
        node with the most consumers for it (else the first live node), creating the queue there first. None
        when that node's connection went meanwhile, or it said it leaves too (the caller tries again)."""
        if chosen is not None and chosen in targets:
            bridge = chosen
        else:
            bridge = self._destination(queue, targets)
            await self._copy_queue(queue, bridge)
        target = Binding(
            bridge.node_id, queue.name, queue.address, int(queue.routing_type), None, 1, None, 1, bridge.node_id
        )

        def make(consumer_id: int, session: Session) -> Redistributor:
            return Redistributor(
                consumer_id,
                session,
                queue,
                self.settings.cluster.forward_window,
                target=target,
                selectors=self.balancer.selectors,
                arrivals=Arrivals(),
                min_residence_ms=0,
                clock=lambda: self.broker.now_ms,
                paced=False,
            )

        mover = bridge.add_redistributor(make) if bridge.up and not bridge.leaving else None
        if mover is None:
            return None
        log.info(
            "scale-down: moving queue", extra={"queue": queue.name, "to_node": bridge.node_id, "messages": len(queue)}
        )
        self.schedule_flush()
        return bridge, mover

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        now_ms = wall_ms()
        bridges = []
        for bridge in self.bridges.values():
            queue = self.broker.queues.get(FORWARD_QUEUE_PREFIX + bridge.node_id) if bridge.node_id else None
            bridges.append(
                {
                    "address": bridge.address,
                    "node_id": bridge.node_id,
                    "name": bridge.name,
                    "state": bridge.state,
                    "reason": bridge.reason,
                    "pending_forward": (len(queue) + queue.in_flight) if queue is not None else 0,
                }
            )
        return {
            "cluster": self.settings.cluster.name,
            "node_id": self.node_id,
            "policy": self.policy,
            "max_hops": self.settings.cluster.max_hops,
            "members": self.members_view(),
            "connections": bridges,
            "joined": sorted(j.node_id for j in self.joined.values()),
            "remote_bindings": len(self.bindings),
            "remote_consumers": remote_consumers(self.bindings),
            "unreachable": self.unreachable(),
            "redistributing": self.redistributing(),
            "held_back": self.held_back(),
            "stranded": self.stranded(),
            "stranded_since": {name: self._stuck_since.get(name, now_ms) for name in self.stranded()},
        }

    def redistributing(self) -> dict[str, list[str]]:
        """Queue name → the nodes its backlog is being moved to."""
        view: dict[str, list[str]] = {}
        for (name, node_id), (_, redistributor) in self.redistributors.items():
            if not redistributor.stopped:
                view.setdefault(name, []).append(node_id)
        return view

    def held_back(self) -> dict[str, list[str]]:
        """Queue name → the nodes its backlog waits for: their consumers have full windows (see ``pace``)."""
        view: dict[str, list[str]] = {}
        for (name, node_id), (_, redistributor) in self.redistributors.items():
            if redistributor.held_back and not redistributor.stopped:
                view.setdefault(name, []).append(node_id)
        return view

    def unreachable(self) -> dict[str, dict[str, Any]]:
        """Nodes whose connection is down but whose durable queues are kept as destinations: the queues, and
        how many messages wait here for them."""
        view: dict[str, dict[str, Any]] = {}
        for node_id, queues in self.bindings.unreachable().items():
            waiting = self.broker.queues.get(FORWARD_QUEUE_PREFIX + node_id)
            # ``is not None``: a queue is falsy when none is queued, though its messages may be in flight.
            pending = len(waiting) + waiting.in_flight if waiting is not None else 0
            view[node_id] = {"queues": queues, "pending_forward": pending}
        return view

    def stranded(self) -> dict[str, int]:
        """Queues of this node with messages that no consumer here takes and no redistribution moved since the
        last tick (none runs, none can take them, or it stopped): queue name → messages. A node elsewhere with
        consumers does not make a queue's messages move (a selector there may want none of them). The MQTT
        gateways' records wait for no consumer, so they are not listed."""
        view = {}
        for queue in self._with_messages():
            name = queue.name
            if (
                len(queue)
                and name not in self._moving
                and not name.startswith(FORWARD_QUEUE_PREFIX)
                and not any(is_local_consumer(c) for c in queue.consumers)
                and not holds_records(name, queue.address)
            ):
                view[name] = len(queue)
        return view


def remote_consumers(bindings: RemoteBindings) -> dict[str, dict[str, int]]:
    """Queue name → node id → consumers, for the queues of other nodes that have consumers."""
    view: dict[str, dict[str, int]] = {}
    for binding in bindings:
        if binding.consumers:
            view.setdefault(binding.queue, {})[binding.node_id] = binding.consumers
    return view


def local_binding(node_id: str, queue: Queue, *, backlog: bool) -> list[Any]:
    consumers = [c for c in queue.consumers if is_local_consumer(c)]
    selectors: tuple[str, ...] | None = ()
    texts = []
    for consumer in consumers:
        if consumer.selector is None:
            selectors = None
            break
        texts.append(consumer.selector.text)
    else:
        selectors = tuple(texts)
    return Binding(
        node_id,
        queue.name,
        queue.address,
        int(queue.routing_type),
        queue.filter.text if queue.filter is not None else None,
        len(consumers),
        selectors,
        1,
        durable=queue.durable,
        backlog=backlog,
    ).to_wire()
