"""Message load balancing across the cluster (Artemis' message-load-balancing). Pure.

For a message routed on this node, the local queues it matched and the remote bindings matching its address
are grouped by queue name: a queue of the same name on several nodes is one logical queue, and only one of
its instances gets the message. Anycast picks one instance among all the matching queues; multicast picks
one instance per subscription. Which instances qualify depends on the policy:

- ``OFF``: local queues only; nothing is forwarded.
- ``STRICT``: every instance, in turn, consumers or not.
- ``ON_DEMAND`` (default): instances with a consumer that would take the message; when none has one the
  message stays local (or, for a subscription that exists only elsewhere, goes to it).
- ``OFF_WITH_REDISTRIBUTION``: routed as ``OFF``; redistribution moves backlog later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from tridentmq_core.queues import Consumer, Queue
from tridentmq_core.remote_bindings import Binding, RemoteBindings
from tridentmq_core.selector import Selector, SelectorError, compile_selector
from tridentmq_shared.message import RoutingType, WireMessage, selector_view

OFF: Final = "OFF"
STRICT: Final = "STRICT"
ON_DEMAND: Final = "ON_DEMAND"
OFF_WITH_REDISTRIBUTION: Final = "OFF_WITH_REDISTRIBUTION"

Remote = dict[str, tuple[str, ...]]  # node id → names of the queues there that get the message
_NO_REMOTE: Final[Remote] = {}
Instance = Queue | Binding
# A routing plan: None = decide per message; a fixed answer; or per group, the instances to take turns over.
_Plan = tuple[tuple[Queue, ...], Remote] | list[tuple[str, tuple[Instance, ...]]] | None


def is_local_consumer(consumer: Consumer) -> bool:
    """A consumer of this node's clients (not a browser, not a forwarder to another node)."""
    return not consumer.browse and not consumer.forwarder


class SelectorCache:
    """Compiled selectors of remote bindings and consumers; a selector that does not compile never matches."""

    def __init__(self, limit: int = 10_000) -> None:
        self._compiled: dict[str, Selector | None] = {}
        self._limit = limit

    def matches(self, text: str, message: WireMessage) -> bool:
        compiled = self._compiled.get(text, False)
        if compiled is False:
            try:
                compiled = compile_selector(text)
            except SelectorError:
                compiled = None
            if len(self._compiled) >= self._limit:
                self._compiled.clear()
            self._compiled[text] = compiled
        return compiled is not None and compiled.matches(selector_view(message))  # type: ignore[union-attr]

    def binding_takes(self, binding: Binding, message: WireMessage) -> bool:
        """Whether the remote queue's filter lets the message in."""
        return binding.filter is None or self.matches(binding.filter, message)

    def binding_consumes(self, binding: Binding, message: WireMessage) -> bool:
        """Whether a consumer of the remote queue would take the message."""
        if binding.consumers <= 0:
            return False
        return binding.selectors is None or any(self.matches(s, message) for s in binding.selectors)


class Balancer:
    def __init__(self, bindings: RemoteBindings, policy: str) -> None:
        self.bindings = bindings
        self.policy = policy
        self.selectors = SelectorCache()
        self._rr: dict[str, int] = {}
        self._has_remote: dict[str, bool] = {}
        self._version = -1
        self._plans: dict[tuple[str, frozenset[RoutingType]], _Plan] = {}
        self._plan_versions = (-1, -1)

    @property
    def forwards(self) -> bool:
        return self.policy in (STRICT, ON_DEMAND)

    def has_remote(self, address: str) -> bool:
        """Whether routing to ``address`` must look at other nodes at all (cached until bindings change)."""
        if self._version != self.bindings.version:
            self._has_remote.clear()
            self._version = self.bindings.version
        found = self._has_remote.get(address)
        if found is None:
            found = self.forwards and bool(self.bindings.match(address))
            if len(self._has_remote) > 100_000:
                self._has_remote.clear()
            self._has_remote[address] = found
        return found

    def balance(
        self,
        message: WireMessage,
        address: str,
        local: tuple[Queue, ...],
        kinds: frozenset[RoutingType],
        local_version: int,
        *,
        whole: bool = True,
    ) -> tuple[tuple[Queue, ...], Remote]:
        """Split a routed message between local queues and other nodes. ``local_version`` changes whenever a
        local queue or consumer comes or goes (the broker's ``bindings_version``). ``whole``: ``local`` is every
        local queue of the address, not those this message's filters left (a plan made from those would hold
        for the next message too, and skip queues). Either way it may hold several anycast queues, of which
        the turn here picks one (one picked before, locally, fell in step with this turn and starved a queue)."""
        if not whole:
            return self._balance_each(message, address, local, kinds)
        versions = (local_version, self.bindings.version)
        if versions != self._plan_versions:
            self._plans.clear()
            self._plan_versions = versions
        key = (address, kinds)
        if key in self._plans:
            plan = self._plans[key]
        else:
            plan = self._plan(address, local, kinds)
            if len(self._plans) > 10_000:
                self._plans.clear()
            self._plans[key] = plan
        if plan is None:
            return self._balance_each(message, address, local, kinds)
        if isinstance(plan, tuple):
            return plan  # one choice whatever the message
        chosen = [group[0] if len(group) == 1 else self._turn(name, group) for name, group in plan]
        return self._split(chosen)

    def fixed(self, address: str, kinds: frozenset[RoutingType]) -> bool:
        """Whether ``balance`` splits every message to ``address`` the same way, until a binding version
        changes (no filter, selector or round-robin involved)."""
        return isinstance(self._plans.get((address, kinds)), tuple)

    def _plan(self, address: str, local: tuple[Queue, ...], kinds: frozenset[RoutingType]) -> _Plan:
        """When no selector or filter is involved, the instances that qualify depend only on consumer counts:
        work them out once per change instead of per message. None: they depend on the message."""
        remote = [b for b in self.bindings.match(address) if RoutingType(b.routing) in kinds]
        if (
            any(q.filter is not None or any(c.selector is not None for c in q.consumers) for q in local)
            or any(b.filter is not None or b.selectors for b in remote)
            or sum(q.routing_type is RoutingType.ANYCAST for q in local) > 1
        ):
            return None
        groups = [
            (name, tuple(self._qualified(instances, None))) for name, instances in self._groups(address, local, remote)
        ]
        if all(len(group) == 1 for _, group in groups):
            return self._split([group[0] for _, group in groups])
        return groups

    def _balance_each(
        self, message: WireMessage, address: str, local: tuple[Queue, ...], kinds: frozenset[RoutingType]
    ) -> tuple[tuple[Queue, ...], Remote]:
        takes = self.selectors.binding_takes
        remote = [b for b in self.bindings.match(address) if RoutingType(b.routing) in kinds and takes(b, message)]
        if not remote and sum(q.routing_type is RoutingType.ANYCAST for q in local) <= 1:
            return local, _NO_REMOTE
        chosen = []
        for name, instances in self._groups(address, local, remote):
            qualified = self._qualified(instances, message)
            chosen.append(qualified[0] if len(qualified) == 1 else self._turn(name, qualified))
        return self._split(chosen)

    @staticmethod
    def _groups(address: str, local: tuple[Queue, ...], remote: list[Binding]) -> list[tuple[str, list[Instance]]]:
        """Anycast: one group of every instance (one of them gets the message); multicast: one per name."""
        anycast: list[Instance] = [q for q in local if q.routing_type is RoutingType.ANYCAST]
        anycast += [b for b in remote if b.routing == RoutingType.ANYCAST]
        groups: dict[str, list[Instance]] = {}
        for queue in local:
            if queue.routing_type is RoutingType.MULTICAST:
                groups.setdefault(queue.name, []).append(queue)
        for binding in remote:
            if binding.routing == RoutingType.MULTICAST:
                groups.setdefault(binding.queue, []).append(binding)
        return ([(address, anycast)] if anycast else []) + list(groups.items())

    @staticmethod
    def _split(chosen: list[Instance]) -> tuple[tuple[Queue, ...], Remote]:
        local_chosen = tuple(i for i in chosen if isinstance(i, Queue))
        forwarded: dict[str, list[str]] = {}
        for instance in chosen:
            if isinstance(instance, Binding):
                forwarded.setdefault(instance.node_id, []).append(instance.queue)
        return local_chosen, {node_id: tuple(names) for node_id, names in forwarded.items()}

    def _qualified(self, instances: list[Instance], message: WireMessage | None) -> list[Instance]:
        """The instances that may get the message under the policy (``message`` None: no selector matters).
        A durable queue on a node that is down (unreachable) gets it only when no other instance can: it then
        waits in this node's store-and-forward queue for that node, rather than go nowhere."""
        reachable = [i for i in instances if isinstance(i, Queue) or i.reachable]
        if self.policy == STRICT:
            return reachable or instances
        qualified = [i for i in reachable if self._consumes(i, message)]
        if qualified:
            return qualified
        local: list[Instance] = [i for i in instances if isinstance(i, Queue)]
        return local or reachable or instances  # nobody consumes: keep it here, else where its queue is

    def _consumes(self, instance: Instance, message: WireMessage | None) -> bool:
        if isinstance(instance, Queue):
            return any(is_local_consumer(c) and (message is None or c.accepts(message)) for c in instance.consumers)
        if message is None:
            return instance.consumers > 0
        return self.selectors.binding_consumes(instance, message)

    def _turn(self, key: str, candidates: Sequence[Instance]) -> Instance:
        turn = self._rr.get(key, 0)
        if len(self._rr) > 100_000:
            self._rr.clear()
        self._rr[key] = turn + 1
        return candidates[turn % len(candidates)]
