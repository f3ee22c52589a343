"""What other nodes of the cluster hold: their queues (bindings) as this node learned them. Pure.

A binding names a queue on a node with what routing needs: its address, routing type, filter and how many
consumers it has (with their selectors, so ON_DEMAND and redistribution can tell whether one of them would
take a message). Each directly connected node reports its own queues at distance 1 and, with max-hops above
1, what it learned from others at their distance plus one; of several routes to the same queue the shortest
wins, and ``via`` says which connected node a message for it goes through.

When the connection to a node drops, its durable queues stay known, marked unreachable and without
consumers: a durable subscription or queue on a node that is down (or whose pair is failing over) is still
a destination, and messages for it wait in this node's store-and-forward queue for that node. The node's
next full report (its return, or its backup's takeover under the same id) replaces them; its scale-down
removes them, except a durable queue of which it holds the only copy this node knows of (its scale-down made a
copy on another node, but that node's report has not come here: a partition between the two): that one stays
a destination until another copy is known, so that what is published for it meanwhile goes to the leaving node,
which moves it with the rest, and not nowhere. Its other queues (non-durable, and what it relayed from further
away) go with the connection.
A node also tells the others what it kept (``kept``), flagged unreachable, so that a node that starts, or a
backup that takes over, while that node is down learns its durable queues too; such a relayed copy counts
only while the node it describes is not connected here (its own report is the truth about it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from tridentmq_core.router import AddressTrie, InvalidAddress, validate_address
from tridentmq_shared.message import RoutingType

Key = tuple[str, str]  # (node id, queue name)
MAX_SELECTORS = 64  # selectors kept per binding; a binding with more is treated as taking everything


class BindingError(ValueError):
    """A binding update that breaks the format or the limits: the update is refused."""


@dataclass(frozen=True, slots=True)
class Binding:
    node_id: str
    queue: str
    address: str
    routing: int
    filter: str | None
    consumers: int
    selectors: tuple[str, ...] | None  # None: some consumer takes every message
    distance: int
    via: str = ""  # the connected node this binding was learned from
    durable: bool = False  # the queue survives its node's restart (and its pair's failover)
    reachable: bool = True  # False: its node's connection is down; messages for it wait here
    # Messages wait there and each of its consumers has a full window: a node redistributing to it holds
    # back, so that a backlog goes to the nodes whose consumers have room (one that comes later included).
    backlog: bool = False

    @property
    def key(self) -> Key:
        return (self.node_id, self.queue)

    def to_wire(self, distance: int | None = None) -> list[Any]:
        selectors = None if self.selectors is None else list(self.selectors)
        wire = [
            self.node_id,
            self.queue,
            self.address,
            self.routing,
            self.filter,
            self.consumers,
            selectors,
            self.distance if distance is None else distance,
            self.durable,
        ]
        if not self.reachable or self.backlog:
            wire.append(self.reachable)
        if self.backlog:
            wire.append(True)
        return wire

    def unreachable(self) -> Binding:
        """This binding while its node is down: still a destination, with none of the consumers it had."""
        return replace(self, consumers=0, selectors=(), reachable=False, backlog=False)

    @staticmethod
    def from_wire(item: Any, via: str) -> Binding:
        if type(item) is not list or len(item) not in (8, 9, 10, 11):
            raise BindingError("a binding is a list of 8 to 11 fields")
        node_id, queue, address, routing, filter_text, consumers, selectors, distance = item[:8]
        durable = item[8] if len(item) > 8 else False  # a node before durable bindings: none kept for it
        reachable = item[9] if len(item) > 9 else True
        backlog = item[10] if len(item) > 10 else False
        if not (
            type(node_id) is str
            and node_id
            and type(queue) is str
            and queue
            and type(address) is str
            and type(routing) is int
            and routing in (RoutingType.ANYCAST, RoutingType.MULTICAST)
            and (filter_text is None or type(filter_text) is str)
            and type(consumers) is int
            and consumers >= 0
            and type(distance) is int
            and distance >= 1
            and type(durable) is bool
            and type(backlog) is bool
            and (reachable is True or (reachable is False and durable))
        ):
            raise BindingError(f"malformed binding {str(item)[:120]}")
        if selectors is not None:
            if type(selectors) is not list or not all(type(s) is str for s in selectors):
                raise BindingError("binding selectors are a list of strings or nil")
            selectors = tuple(selectors) if len(selectors) <= MAX_SELECTORS else None
        try:
            validate_address(address, allow_wildcards=True)
        except InvalidAddress as exc:
            raise BindingError(str(exc)) from None
        binding = Binding(
            node_id, queue, address, routing, filter_text, consumers, selectors, distance, via, durable, backlog=backlog
        )
        return binding if reachable else binding.unreachable()


class RemoteBindings:
    """The bindings of the other nodes, by the connected node they were learned from."""

    def __init__(self, own_id: str, *, max_hops: int, max_per_node: int) -> None:
        self.own_id = own_id
        self.max_hops = max_hops
        self.max_per_node = max_per_node
        self.version = 0  # bumped on every change, so caches of routing decisions know when to drop
        self.kept_version = 0  # bumped when what ``kept`` yields may have changed (a node came, went, was forgotten)
        self._by_via: dict[str, dict[Key, Binding]] = {}
        self._best: dict[Key, Binding] = {}
        self._by_queue: dict[str, set[Key]] = {}
        self._trie: AddressTrie[Binding] = AddressTrie()
        self._live: set[str] = set()  # connected nodes: what they report of themselves is the truth
        self.forgotten: set[str] = set()  # nodes an operator said never come back: their copies are ignored
        self._connected_once: set[str] = set()  # nodes connected since this node started (not forgotten)
        # Durable queues of nodes scaling down, by node: (queue, address). Not destinations (those nodes take
        # nothing new), but their messages are on the move, so a queue of that name here may still get them.
        self._moving: dict[str, set[tuple[str, str]]] = {}
        # Of those, the ones no other node (nor this one) was known to hold when it said it leaves: still
        # destinations, until another copy is known (``last_copies``).
        self._last_copies: dict[str, set[tuple[str, str]]] = {}

    def __len__(self) -> int:
        return len(self._best)

    def __iter__(self) -> Iterator[Binding]:
        return iter(self._best.values())

    def replace(self, via: str, items: Iterable[Any]) -> None:
        """A full report from ``via`` (after it connected): replaces what it said before."""
        self.forgotten.discard(via)  # it came back after all: what it says of itself counts again
        parsed = self._parse(via, items)
        old = self._by_via.get(via, {})
        self._by_via[via] = {b.key: b for b in parsed}
        self._live.add(via)
        self._connected_once.add(via)
        self.kept_version += 1
        self._refresh(set(old) | {b.key for b in parsed} | self._keys_of(via))
        if parsed and self._last_copies:  # another copy of a leaving node's last one may be among them
            self._drop_last_copies({(b.queue, b.address) for b in parsed if b.node_id not in self._moving})

    def apply(self, via: str, upserts: Iterable[Any], removals: Iterable[Any]) -> None:
        """Changes reported by ``via``."""
        parsed = self._parse(via, upserts)
        removed: list[Key] = []
        for item in removals:
            if type(item) is not list or len(item) != 2 or not all(type(x) is str for x in item):
                raise BindingError("a removal is [node_id, queue]")
            removed.append((item[0], item[1]))
        table = self._by_via.setdefault(via, {})
        if len(table) + len(parsed) > self.max_per_node and len({*table, *(b.key for b in parsed)}) > self.max_per_node:
            raise BindingError(f"more than {self.max_per_node} bindings from one node")
        if via not in self._live:
            self.kept_version += 1
        last = self._last_copies.get(via)
        for key in removed:
            binding = table.get(key)
            if last and binding is not None and key[0] == via and (binding.queue, binding.address) in last:
                continue  # a leaving node's only known copy: stays a destination until another one is known
            table.pop(key, None)
        for binding in parsed:
            table[binding.key] = binding
        self._refresh({*removed, *(b.key for b in parsed)})
        if parsed and self._last_copies:  # another copy of a leaving node's last one may be among them
            self._drop_last_copies({(b.queue, b.address) for b in parsed if b.node_id not in self._moving})

    def leave(self, node_id: str, unneeded: Callable[[str, str], bool]) -> None:
        """``node_id`` scales down (its bindings go next): remember its durable queues as on the move until it
        is gone, and keep as destinations those of which it holds the only copy known here: none on another
        node that stays, and none that ``unneeded(queue, address)`` (one here, or one it never moves)."""
        moving = {(b.queue, b.address) for b in self._best.values() if b.node_id == node_id and b.durable}
        self._moving[node_id] = moving
        last = {(q, a) for q, a in moving if not unneeded(q, a) and not self._held_by_another(q, a)}
        if last:
            self._last_copies[node_id] = last

    def last_copies(self, node_id: str, held_here: Callable[[str, str], bool]) -> int:
        """How many durable queues of ``node_id``, leaving, are still destinations because no other copy is
        known, once those now held here (``held_here(queue, address)``) or on another node are dropped. While
        there are some, this node may still route to it: it must not say it routes nothing more there."""
        last = self._last_copies.get(node_id)
        if last:
            self._drop_last_copies({(q, a) for q, a in last if held_here(q, a) or self._held_by_another(q, a)})
        return len(self._last_copies.get(node_id, ()))

    def _held_by_another(self, queue: str, address: str) -> bool:
        """Whether a node that is not leaving holds a queue ``queue`` on ``address`` (reachable or kept)."""
        return any(b.address == address and b.node_id not in self._moving for b in self.for_queue(queue))

    def _drop_last_copies(self, held: set[tuple[str, str]]) -> None:
        """Another copy of the queues ``held`` (queue, address) is known now (here, or on a node that stays): a
        leaving node's last copy of one is a destination no longer. Messages go to that copy, and the leaving
        node moves what it has."""
        dropped: set[Key] = set()
        for node_id, last in list(self._last_copies.items()):
            gone = last & held
            if not gone:
                continue
            last -= gone
            if not last:
                del self._last_copies[node_id]
            table = self._by_via.get(node_id, {})
            for queue, _ in gone:
                if table.pop((node_id, queue), None) is not None:
                    dropped.add((node_id, queue))
        if dropped:
            self._refresh(dropped)

    def moving(self, queue: str, address: str) -> list[str]:
        """The nodes scaling down that had a durable queue ``queue`` on ``address``: its messages are on the
        move (to wherever it has consumers)."""
        return [node for node, queues in self._moving.items() if (queue, address) in queues] if self._moving else []

    def depart(self, via: str) -> None:
        """``via`` is no longer connected: keep its own durable queues, unreachable, and forget the rest of
        what it reported."""
        self._moving.pop(via, None)
        self._last_copies.pop(via, None)  # still its own durable queues: kept below, unreachable, as any
        self._live.discard(via)
        old = self._by_via.pop(via, None) or {}
        kept = {key: b.unreachable() for key, b in old.items() if b.durable and b.node_id == via}
        if kept:
            self._by_via[via] = kept
        self.kept_version += 1
        self._refresh(set(old) | self._keys_of(via))

    def forget(self, node_id: str) -> int:
        """An operator says ``node_id`` (not connected) never comes back: drop every binding of it, kept here or
        relayed, and ignore copies of them the other nodes still relay. Returns how many were dropped."""
        self.forgotten.add(node_id)
        self._connected_once.discard(node_id)
        self._last_copies.pop(node_id, None)
        keys = self._keys_of(node_id)
        for table in self._by_via.values():
            for key in [k for k in table if k[0] == node_id]:
                del table[key]
        if not self._by_via.get(node_id, True):
            del self._by_via[node_id]
        self.kept_version += 1
        self._refresh(keys)
        return len(keys)

    def kept(self) -> Iterator[Binding]:
        """The durable queues this node keeps for the nodes whose connection dropped (to tell the others)."""
        for via, table in self._by_via.items():
            if via not in self._live:
                yield from (b for b in table.values() if b.node_id == via)

    def unreachable(self) -> dict[str, list[str]]:
        """Node id → the queues kept for it while it is down."""
        view: dict[str, list[str]] = {}
        for binding in self._best.values():
            if not binding.reachable:
                view.setdefault(binding.node_id, []).append(binding.queue)
        return {node_id: sorted(names) for node_id, names in view.items()}

    def match(self, address: str) -> tuple[Binding, ...]:
        return self._trie.match(address)

    def for_queue(self, queue: str) -> list[Binding]:
        return [self._best[key] for key in self._by_queue.get(queue, ())]

    def next_hop(self, node_id: str) -> str | None:
        """The connected node through which ``node_id`` is reached (itself while only its kept, unreachable
        queues are known: its store-and-forward queue holds their messages), None if it is not known."""
        if node_id in self._live:
            return node_id
        best: Binding | None = None
        kept = False
        for binding in self._best.values():
            if binding.node_id != node_id:
                continue
            if not binding.reachable:
                kept = True
            elif best is None or binding.distance < best.distance:
                best = binding
        if best is not None:
            return best.via
        return node_id if kept else None

    def knows(self, node_id: str) -> bool:
        """Whether ``node_id`` is a node of this cluster, up or down: one that connected since this node
        started and was not forgotten, or one reached through another."""
        return node_id in self._connected_once or self.next_hop(node_id) is not None

    def _keys_of(self, node_id: str) -> set[Key]:
        return {key for table in self._by_via.values() for key in table if key[0] == node_id}

    def _parse(self, via: str, items: Iterable[Any]) -> list[Binding]:
        parsed = []
        for item in items:
            binding = Binding.from_wire(item, via)
            if (
                binding.node_id != self.own_id
                and binding.distance <= self.max_hops
                and (binding.reachable or binding.node_id != via)
                and binding.node_id not in self.forgotten
            ):
                parsed.append(binding)
            if len(parsed) > self.max_per_node:
                raise BindingError(f"more than {self.max_per_node} bindings from one node")
        return parsed

    def _refresh(self, keys: set[Key]) -> None:
        live = self._live
        for key in keys:
            candidates = [table[key] for table in self._by_via.values() if key in table]
            if key[0] in live:  # connected: a copy kept for it elsewhere says nothing it does not say itself
                candidates = [b for b in candidates if b.reachable]
            best = min(candidates, key=lambda b: (not b.reachable, b.distance)) if candidates else None
            old = self._best.get(key)
            if old == best:
                continue
            if old is not None:
                self._trie.remove(old.address, old)
            if best is None:
                self._best.pop(key, None)
                names = self._by_queue.get(key[1])
                if names is not None:
                    names.discard(key)
                    if not names:
                        del self._by_queue[key[1]]
            else:
                self._best[key] = best
                self._trie.add(best.address, best)
                self._by_queue.setdefault(key[1], set()).add(key)
        if keys:
            self.version += 1
