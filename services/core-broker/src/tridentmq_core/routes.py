"""The routing table: the addresses, the queues bound to them, and which local queues a send reaches.

A send's route is looked up once per (address, routing type) and cached; a queue created or deleted on a
pattern drops the cached routes of the addresses that pattern matches, and only those, so 100,000 device
topics with devices joining do not make every route again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from tridentmq_core.address_settings import AddressSettingsRepository, ResolvedAddressSettings
from tridentmq_core.balancer import Remote
from tridentmq_core.queues import Queue
from tridentmq_core.router import AddressIndex, AddressTrie
from tridentmq_shared.message import M_ADDRESS, M_ROUTING, ROUTING_DEFAULT, RoutingType, WireMessage

#: Every M_ROUTING a send may carry.
ROUTINGS: Final = (ROUTING_DEFAULT, *(int(kind) for kind in RoutingType))
_BOTH_KINDS: Final = frozenset((RoutingType.ANYCAST, RoutingType.MULTICAST))
#: Every combination of routing types, one set each: an address holds one of these rather than a set of its own
#: (an empty set is 216 bytes, and a topic per device makes tens of thousands of addresses).
_KIND_SETS: Final = {
    kinds: kinds for kinds in (frozenset({RoutingType.ANYCAST}), frozenset({RoutingType.MULTICAST}), _BOTH_KINDS)
}
_MAX_CACHED: Final = 100_000  # kinds cached beyond this start again from empty
_MAX_SPLITS: Final = 10_000


def routing_kinds(routing_types: Iterable[RoutingType]) -> frozenset[RoutingType]:
    """The shared set of these routing types."""
    kinds = frozenset(routing_types)
    return _KIND_SETS.get(kinds, kinds)


class Address:
    __slots__ = ("auto_created", "creator", "journaled", "name", "queues", "routing_types")

    def __init__(
        self, name: str, routing_types: Iterable[RoutingType], *, auto_created: bool, journaled: bool = True
    ) -> None:
        self.name = name
        self.routing_types = routing_kinds(routing_types)
        self.auto_created = auto_created
        self.journaled = journaled  # False: made for non-durable queues only, which no restart brings back
        self.creator: str | None = None  # the user whose publish auto-created it (counted against their cap)
        self.queues: dict[str, Queue] = {}


class Routes:
    def __init__(self, address_settings: AddressSettingsRepository) -> None:
        self.address_settings = address_settings
        self.addresses: dict[str, Address] = {}
        self._trie: AddressTrie[Queue] = AddressTrie(cache_size=0)  # ``cache`` is the cache of its matches
        # (address, routing) → (queues, simple); simple = no queue filter and at most one anycast queue,
        # so the queues can be used as they are without looking at the message.
        self.cache: dict[tuple[str, int], tuple[tuple[Queue, ...], bool]] = {}
        # The addresses with entries in ``cache`` (or ``splits``): a queue created or deleted on a pattern
        # drops the routes of the addresses that pattern matches, and only those (see ``_invalidate``).
        self._routed = AddressIndex()
        self._kinds: dict[tuple[str, int], frozenset[RoutingType]] = {}
        #: (address, routing) → (local queues, other nodes' queues, the two binding versions it holds for): the
        #: route and balance of a send whose split depends on no message, made once instead of per message.
        self.splits: dict[tuple[str, int], tuple[tuple[Queue, ...], Remote, int, int]] = {}
        self._anycast_turn: dict[str, int] = {}

    def route(
        self,
        message: WireMessage,
        now_ms: int,
        *,
        pick: bool = True,
        on_miss: Callable[[str, int, int], None] | None = None,
    ) -> tuple[Queue, ...]:
        """The local queues that get ``message``; ``pick``: one of several anycast queues, in turn (else all
        that take it: the cluster's balancer takes the turn, over them and other nodes' queues together).
        ``on_miss``: called with the address, routing and time before a route is made (what a send creates)."""
        address = message[M_ADDRESS]
        routing = message[M_ROUTING]
        key = (address, routing)
        route = self.cache.get(key)
        if route is None:
            if on_miss is not None:
                on_miss(address, routing, now_ms)
            own = self.addresses.get(address)
            if own is not None:  # both caches keep the address's own name, not this message's copy of it
                key = (own.name, routing)
            kinds = self._kinds_of(key)
            queues = tuple(q for q in self._trie.match(address) if q.routing_type in kinds)
            simple = (
                all(q.filter is None for q in queues)
                and sum(q.routing_type is RoutingType.ANYCAST for q in queues) <= 1
            )
            route = self.cache[key] = (queues, simple)
            self._routed.add(address)
        queues, simple = route
        if simple:
            return queues
        filtered = tuple(q for q in queues if q.filter is None or q.accepts(message))
        anycast = [q for q in filtered if q.routing_type is RoutingType.ANYCAST]
        if len(anycast) <= 1 or not pick:
            return filtered
        # Anycast means one queue gets it: round-robin over the anycast queues that match.
        turn = self._anycast_turn.get(address, 0)
        self._anycast_turn[address] = turn + 1
        chosen = anycast[turn % len(anycast)]
        return tuple(q for q in filtered if q.routing_type is RoutingType.MULTICAST or q is chosen)

    def remember_split(
        self, key: tuple[str, int], queues: tuple[Queue, ...], remote: Remote, version: int, remote_version: int
    ) -> None:
        if len(self.splits) > _MAX_SPLITS:
            self.splits.clear()
        self.splits[key] = (queues, remote, version, remote_version)

    def kinds(self, address: str, routing: int) -> frozenset[RoutingType]:
        """The routing types a send reaches: its own, else the address's (the default type if it has both).
        Cached with the routes: a forwarding node asks for every message."""
        return self._kinds_of((address, routing))

    def _kinds_of(self, key: tuple[str, int]) -> frozenset[RoutingType]:
        """``kinds`` of (address, routing): a route made keeps one key for both caches."""
        kinds = self._kinds.get(key)
        if kinds is None:
            address, routing = key
            if routing != ROUTING_DEFAULT:
                kinds = frozenset((RoutingType(routing),))
            else:
                own = self.addresses.get(address)
                kinds = frozenset(own.routing_types) if own is not None else _BOTH_KINDS
                if len(kinds) == 2:
                    kinds = frozenset((self.address_settings.resolve(address).default_routing_type,))
            kinds = routing_kinds(kinds)  # shared: a set of its own cost 216 bytes per address sent to
            if len(self._kinds) > _MAX_CACHED:
                self._kinds.clear()
            self._kinds[key] = kinds
        return kinds

    def send_kind(self, address: str, routing: int, settings: ResolvedAddressSettings) -> RoutingType:
        """The routing type a send resolves to: its own, else the address's (anycast if it has both)."""
        if routing != ROUTING_DEFAULT:
            return RoutingType(routing)
        existing = self.addresses.get(address)
        if existing is None or len(existing.routing_types) == 2:
            return settings.default_routing_type
        return next(iter(existing.routing_types))

    def lacks_anycast_queue(self, address: str) -> bool:
        existing = self.addresses.get(address)
        return existing is None or not any(q.routing_type is RoutingType.ANYCAST for q in existing.queues.values())

    def bind(self, queue: Queue) -> None:
        self.addresses[queue.address].queues[queue.name] = queue
        self._trie.add(queue.address, queue)
        self._invalidate(queue.address)

    def unbind(self, queue: Queue) -> Address | None:
        """Take ``queue`` off its address; returns the address (None if it went first)."""
        address = self.addresses.get(queue.address)
        if address is not None:
            address.queues.pop(queue.name, None)
        self._trie.remove(queue.address, queue)
        self._invalidate(queue.address)
        return address

    def address_changed(self, address: str) -> None:
        """The address's own routing types changed (it came, went or gained a type): its kinds and routes."""
        for routing in ROUTINGS:
            self._kinds.pop((address, routing), None)
        if self._routed.discard(address):
            for routing in ROUTINGS:
                key = (address, routing)
                self.cache.pop(key, None)
                self.splits.pop(key, None)

    def address_deleted(self, address: str) -> None:
        self._anycast_turn.pop(address, None)
        self.address_changed(address)

    def forget_address(self, address: str) -> bool:
        """Drop what was cached for ``address``; True if a send had used it since it was last dropped."""
        used = False
        for routing in ROUTINGS:
            key = (address, routing)
            used |= self.cache.pop(key, None) is not None
            self._kinds.pop(key, None)
            used |= self.splits.pop(key, None) is not None
        self._routed.discard(address)
        return used

    def forget_all(self) -> None:
        """Every route, for a change that can alter any of them (the address settings' default routing type)."""
        self.cache.clear()
        self._kinds.clear()
        self.splits.clear()
        self._routed.clear()

    def _invalidate(self, pattern: str) -> None:
        """Drop the cached routes that a queue created or deleted on ``pattern`` (an address or a wildcard
        pattern) can change: those of the addresses it matches. A new address among 100,000 costs a few
        dictionary operations instead of every route being made again on the next publish to it."""
        for address in self._routed.remove_matching(pattern):
            for routing in ROUTINGS:
                key = (address, routing)
                self.cache.pop(key, None)
                self.splits.pop(key, None)
