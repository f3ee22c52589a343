"""Which core node a link connects to: the cluster's live members and Artemis' connection load-balancing.

Pure: no I/O and no clock. A ``Topology`` starts with the configured endpoints and is updated from the
TOPOLOGY answers and TOPOLOGY_UPDATE pushes of the cluster; every link that shares it asks it for the
order in which to try the nodes. The policy lives with the topology (as Artemis' lives with a server
locator), so round-robin spreads the clients that share one topology over the nodes.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

Endpoint = tuple[str, int]


class LoadBalancing(StrEnum):
    ROUND_ROBIN = "ROUND_ROBIN"  # a random start, then each node in turn (the default)
    RANDOM = "RANDOM"  # a random node each time
    RANDOM_STICKY = "RANDOM_STICKY"  # a random node once, then that one for as long as it is live
    FIRST_ELEMENT = "FIRST_ELEMENT"  # the first live node


def parse_endpoint(text: str) -> Endpoint:
    """``host:port`` (an IPv6 host in brackets) as (host, port); ValueError when it is not that."""
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host.strip("[]"), int(port)


def endpoint_from_wire(wire: Any) -> Endpoint | None:
    """``[host, port]`` from the wire, or None when it is not that."""
    if isinstance(wire, list) and len(wire) == 2:
        host, port = wire
        if isinstance(host, str) and host and type(port) is int and 0 < port < 65536:
            return host, port
    return None


@dataclass(frozen=True, slots=True)
class Member:
    """A live node as the cluster reports it (``node_id`` is empty for a configured endpoint)."""

    host: str
    port: int
    node_id: str = ""
    name: str = ""
    backup: Endpoint | None = None  # its in-sync backup (HA), which takes over its clients when it dies
    epoch: int = 0  # its activation epoch (HA)

    @property
    def endpoint(self) -> Endpoint:
        return self.host, self.port

    @classmethod
    def from_wire(cls, member: Any) -> Member | None:
        """A member of a TOPOLOGY answer or update; None when malformed (it is skipped, not fatal)."""
        if not isinstance(member, Mapping):
            return None
        host, port, node_id, name = (member.get(k) for k in ("host", "port", "node_id", "name"))
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            return None
        epoch = member.get("epoch", 0)
        epoch = epoch if type(epoch) is int and epoch > 0 else 0
        return cls(
            host,
            port,
            node_id if isinstance(node_id, str) else "",
            name if isinstance(name, str) else "",
            endpoint_from_wire(member.get("backup")),
            epoch,
        )


class Policy:
    """Artemis' ``ConnectionLoadBalancingPolicy``: picks one of the live endpoints for a new connection."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        raise NotImplementedError


class RoundRobinPolicy(Policy):
    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._pos = -1

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        # A random start, so that gateways restarted together do not all begin with the same node.
        self._pos = self.rng.randrange(len(candidates)) if self._pos < 0 else (self._pos + 1) % len(candidates)
        return candidates[self._pos]


class RandomPolicy(Policy):
    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        return candidates[self.rng.randrange(len(candidates))]


class RandomStickyPolicy(Policy):
    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._chosen: Endpoint | None = None

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        # Sticky to the node rather than to a position in the list (Artemis'), which moves as members come and go.
        chosen = self._chosen
        if chosen is None or chosen not in candidates:
            chosen = self._chosen = candidates[self.rng.randrange(len(candidates))]
        return chosen


class FirstElementPolicy(Policy):
    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        return candidates[0]


_POLICIES: dict[LoadBalancing, type[Policy]] = {
    LoadBalancing.ROUND_ROBIN: RoundRobinPolicy,
    LoadBalancing.RANDOM: RandomPolicy,
    LoadBalancing.RANDOM_STICKY: RandomStickyPolicy,
    LoadBalancing.FIRST_ELEMENT: FirstElementPolicy,
}


def load_balancing(name: str | LoadBalancing) -> LoadBalancing:
    """The policy named ``name`` (any case); ValueError for an unknown one."""
    try:
        return LoadBalancing(str(name).upper())
    except ValueError:
        raise ValueError(f"unknown load balancing policy {name!r} (one of {', '.join(LoadBalancing)})") from None


def make_policy(name: str | LoadBalancing, rng: random.Random | None = None) -> Policy:
    # Spreading load, not keeping secrets: the ordinary generator is right.
    return _POLICIES[load_balancing(name)](rng or random.Random())  # noqa: S311


class Topology:
    """The core nodes a set of links may use: the cluster's live members once known, else the configured
    endpoints. The configured endpoints stay as a last resort behind the members (a cluster restarted as a
    whole comes back under new identities, or elsewhere)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        policy: str | LoadBalancing = LoadBalancing.ROUND_ROBIN,
        rng: random.Random | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a topology needs at least one endpoint")
        self.seeds: tuple[Endpoint, ...] = tuple(dict.fromkeys(endpoints))
        self.policy = make_policy(policy, rng)
        self.members: tuple[Member, ...] = tuple(Member(host, port) for host, port in self.seeds)
        #: None until a node answered a TOPOLOGY request; False when it is not part of a cluster.
        self.clustered: bool | None = None
        self.epochs: dict[str, int] = {}  # node id → highest activation epoch seen (HA)
        self.version = 0  # goes up with each change of the members
        # The last known good view, merged from every answer: a node cut off from the others reports itself
        # alone and without its backup, and a client that replaced its view with that one would forget where
        # the pair's backup (which takes over) and the other nodes are. The reported members come first; these
        # are tried after them (a member that left for good only costs a refused connection).
        self.known: dict[str, Member] = {}  # node id → the member at its newest epoch
        self.backups: dict[str, tuple[int, Endpoint]] = {}  # node id → (epoch, its in-sync backup) last reported
        self._known_changes = 0
        self._candidates_key: tuple[object, ...] = ()
        self._candidates_of: tuple[list[Endpoint], list[Endpoint]] = ([], [])

    @property
    def endpoints(self) -> list[Endpoint]:
        """The live members' endpoints, in the cluster's order."""
        return list(dict.fromkeys(m.endpoint for m in self.members))

    def update(self, members: Iterable[Any]) -> bool:
        """Replace the members with a TOPOLOGY answer's or update's list; False if nothing changed (or the list
        had no usable member: the cluster always lists at least the node that answers)."""
        self.clustered = True
        found = tuple(m for m in (Member.from_wire(w) for w in members) if m is not None)
        # A copy at an older epoch than one seen (a cut-off old primary reporting itself) is no member.
        found = tuple(m for m in found if not (m.node_id and m.epoch) or self.saw(m.node_id, m.epoch))
        for member in found:
            if member.node_id:
                self._remember(member)
        if not found or found == self.members:
            return False
        self.members = found
        self.version += 1
        return True

    def saw(self, node_id: str, epoch: int) -> bool:
        """A node answered at ``epoch``: False when a newer copy of it was seen (a fenced copy: do not use)."""
        known = self.epochs.get(node_id, 0)
        if epoch < known:
            return False
        self.epochs[node_id] = epoch
        return True

    def _remember(self, member: Member) -> None:
        known = self.known.get(member.node_id)
        if known is None or member.epoch >= known.epoch:
            self.known[member.node_id] = member
            if known != member:
                self._known_changes += 1
        if member.backup is not None:
            self.backups[member.node_id] = (member.epoch, member.backup)

    @property
    def last_known(self) -> list[Endpoint]:
        """Endpoints of nodes known from earlier views that the current one does not list, newest first."""
        live = set(self.endpoints)
        return list(dict.fromkeys(m.endpoint for m in reversed(self.known.values()) if m.endpoint not in live))

    def backup_of(self, endpoint: Endpoint) -> Endpoint | None:
        """The in-sync backup of the member at ``endpoint``: as the current view says, else as last reported for
        the node at its current epoch (a node that lost its backup, by a cut, reports none; the backup is where
        the pair goes on)."""
        found = next((m.backup for m in self.members if m.endpoint == endpoint and m.backup is not None), None)
        if found is not None:
            return found
        for node_id, member in self.known.items():
            if member.endpoint == endpoint:
                epoch, backup = self.backups.get(node_id, (0, endpoint))
                if backup != endpoint and epoch >= member.epoch:
                    return backup
        return None

    def not_clustered(self) -> None:
        """The node refused TOPOLOGY: a single node (or several unclustered ones) is just the configured list."""
        self.clustered = False

    def connection_order(self, failed: Endpoint | None = None) -> list[Endpoint]:
        """The endpoints to try, in order, for one connection attempt: the policy's choice among the live
        members, the other members after it, then the nodes of earlier views, the configured endpoints that are
        not members, and the endpoint that just ``failed`` last (it may be back, and for a single node it is
        the only one)."""
        live, later = self._candidates()
        if failed is not None:
            live = [e for e in live if e != failed]
        order: list[Endpoint] = []
        if live:
            first = live.index(self.policy.choose(live))
            order = [*live[first:], *live[:first]]
        if failed is None:
            order += later
        else:
            order += [e for e in later if e != failed]
            order.append(failed)
        return order

    def _candidates(self) -> tuple[list[Endpoint], list[Endpoint]]:
        """The live members' endpoints, and the others to try after them (earlier views', then the configured
        ones): worked out again only when the members or the known nodes changed, not for every session a
        gateway opens."""
        key = (self.members, self._known_changes)
        if self._candidates_key != key:
            live = self.endpoints
            later = dict.fromkeys(self.last_known)
            later.update(dict.fromkeys(e for e in self.seeds if e not in live))
            self._candidates_of = (live, list(later))
            self._candidates_key = key
        return self._candidates_of
