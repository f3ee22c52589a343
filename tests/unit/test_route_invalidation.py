"""A binding added or removed drops only the cached routes it changes (issue 23: 100,000 topics).

Checked against a naive matcher: the address index finds exactly what a pattern matches, the trie's match
cache and the broker's route cache never serve a stale answer, and they keep what a change does not touch.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.unit.broker_harness import MULTICAST, Harness, ok

from tridentmq_core.router import AddressIndex, AddressTrie, pattern_matches
from tridentmq_shared.message import ROUTING_DEFAULT, RoutingType

WORDS = st.sampled_from(["a", "b", "c", "$s"])
PATTERN_WORDS = st.sampled_from(["a", "b", "c", "$s", "*", "#"])
addresses = st.lists(WORDS, min_size=1, max_size=5).map(".".join)
patterns = st.lists(PATTERN_WORDS, min_size=1, max_size=5).map(".".join)


def naive_matches(pattern: str, address: str) -> bool:
    """``pattern_matches`` plus the broker's rule: only a literal first word reaches a ``$`` address."""
    if address.startswith("$") and pattern.split(".", 1)[0] != address.split(".", 1)[0]:
        return False
    return pattern_matches(pattern, address)


@settings(max_examples=300)
@given(held=st.lists(addresses, max_size=12), pattern=patterns)
def test_index_removes_exactly_what_a_pattern_matches(held: list[str], pattern: str) -> None:
    index = AddressIndex()
    for address in held:
        index.add(address)
    assert len(index) == len(set(held))
    removed = index.remove_matching(pattern)
    assert sorted(removed) == sorted({a for a in held if naive_matches(pattern, a)})
    rest = {a for a in held if not naive_matches(pattern, a)}
    assert len(index) == len(rest)
    assert sorted(index.remove_matching("#")) == sorted(a for a in rest if not a.startswith("$"))


def test_index_prunes_what_it_no_longer_holds() -> None:
    index = AddressIndex()
    index.add("a.b.c")
    index.add("a.b")
    assert index.discard("a.b.c")
    assert not index.discard("a.b.c")
    assert not index.discard("a")  # a node on the way, never added
    assert index.remove_matching("a.*") == ["a.b"]
    assert len(index) == 0
    assert index._root.children == {}


@settings(max_examples=200)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("add"), patterns, st.integers(0, 3)),
            st.tuples(st.just("remove"), patterns, st.integers(0, 3)),
            st.tuples(st.just("match"), addresses, st.just(0)),
        ),
        max_size=40,
    )
)
def test_trie_cache_never_serves_a_stale_match(steps: list[tuple[str, str, int]]) -> None:
    trie: AddressTrie[int] = AddressTrie(cache_size=6)  # small: overflows too
    model: dict[tuple[str, int], None] = {}  # live bindings in binding order
    for op, text, value in steps:
        if op == "add":
            trie.add(text, value)
            model.setdefault((text, value), None)
        elif op == "remove":
            assert trie.remove(text, value) == ((text, value) in model)
            model.pop((text, value), None)
        else:
            expected = tuple(dict.fromkeys(v for p, v in model if naive_matches(p, text)))
            assert trie.match(text) == expected
    assert len(trie._cached) == len(trie._cache)


def test_a_new_binding_keeps_the_cached_matches_it_does_not_change() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("devices.#", "all")
    devices = [f"devices.d{i}.up" for i in range(1000)]
    for address in devices:
        assert trie.match(address) == ("all",)
    trie.add("devices.d7.up", "d7")  # one device's own topic
    assert len(trie._cache) == 999
    trie.add("devices.d8.#", "d8")  # a wildcard below one device
    assert len(trie._cache) == 998
    assert trie.match("devices.d7.up") == ("all", "d7")
    assert trie.match("devices.d8.up") == ("all", "d8")
    trie.add("*.*.up", "ups")  # matches them all: all go
    assert len(trie._cache) == 0
    assert trie.match("devices.d1.up") == ("all", "ups")


# ---------------------------------------------------------------- the broker's route cache

FEW_WORDS = st.sampled_from(["a", "b", "$s"])
few_addresses = st.lists(FEW_WORDS, min_size=1, max_size=3).map(".".join)
few_patterns = st.lists(st.sampled_from(["a", "b", "$s", "*", "#"]), min_size=1, max_size=3).map(".".join)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("create"), few_patterns),
            st.tuples(st.just("delete"), st.integers(0, 9).map(str)),
            st.tuples(st.just("publish"), few_addresses),
        ),
        min_size=4,
        max_size=25,
    )
)
@example([("publish", "a.b"), ("create", "a.*"), ("publish", "a.b"), ("delete", "0"), ("publish", "a.b")])
@example([("publish", "a"), ("create", "#"), ("publish", "$s.a"), ("create", "$s.#"), ("publish", "$s.a")])
def test_broker_routes_follow_queues_created_and_deleted(steps: list[tuple[str, str]]) -> None:
    """Each publish reaches exactly the live queues whose pattern matches, however the cache was warmed."""
    h = Harness()
    c = h.connect("app")
    live: dict[str, tuple[str, int]] = {}  # queue name -> (pattern, consumer id)
    created = 0
    for op, text in steps:
        if op == "create":
            name = str(created % 10)
            if name in live:
                continue
            created += 1
            ok(c.create_queue(name, text, MULTICAST, durable=False))
            live[name] = (text, c.consumer(name))
        elif op == "delete":
            if text in live:
                c.delete_queue(text)
                del live[text]
        else:
            c.send_all(text, [text.encode()], routing=MULTICAST)
            for name, (pattern, consumer) in live.items():
                got = [d.body for d in c.take(consumer)]
                assert got == ([text.encode()] if naive_matches(pattern, text) else []), (name, pattern)


def test_a_new_device_topic_keeps_the_other_devices_routes() -> None:
    h = Harness()
    c = h.connect("app")
    c.create_queue("watch", "devices.#", MULTICAST, durable=False)
    for i in range(200):
        c.send_all(f"devices.d{i}.up", [b"x"], routing=MULTICAST)
    routes = h.broker.routes.cache
    assert len(routes) == 200
    c.create_queue("d7", "devices.d7.up", MULTICAST, durable=False)
    assert len(routes) == 199  # only the new queue's own address
    c.create_queue("d8-all", "devices.d8.#", MULTICAST, durable=False)
    assert len(routes) == 198
    c.delete_queue("d7")
    assert len(routes) == 198  # devices.d7.up was not published since
    c.create_queue("ups", "*.*.up", MULTICAST, durable=False)
    assert len(routes) == 0


def test_the_routing_types_a_send_reaches_are_one_shared_set_per_combination() -> None:
    """Cached per address sent to: a set of its own (216 bytes) was a twentieth of the core's memory per device."""
    h = Harness()
    c = h.connect()
    for n in range(3):
        ok(c.create_queue(f"sub-{n}", f"device.{n}", routing=MULTICAST))
        ok(c.create_queue(f"work-{n}", f"work.{n}"))
        c.send_all(f"device.{n}", [b"x"])
        c.send_all(f"work.{n}", [b"x"])
    routes = h.broker.routes
    for prefix in ("device", "work"):
        kinds = [routes.kinds(f"{prefix}.{n}", ROUTING_DEFAULT) for n in range(3)]
        assert all(k is kinds[0] for k in kinds)
    assert routes.kinds("device.0", ROUTING_DEFAULT) == {RoutingType.MULTICAST}
    assert routes.kinds("work.0", ROUTING_DEFAULT) == {RoutingType.ANYCAST}
    assert routes.kinds("device.0", int(RoutingType.ANYCAST)) is routes.kinds("work.1", ROUTING_DEFAULT)


def test_a_route_cached_for_a_topic_keeps_the_addresss_own_name_and_one_key() -> None:
    """A route per device topic kept the first message's copy of the address and a second key tuple for the
    routing types (together about 120 bytes per device)."""
    h = Harness()
    c = h.connect()
    ok(c.create_queue("sub-0", "device.0", routing=MULTICAST))
    ok(c.create_queue("work.0", "work.0"))
    c.send_all("device.0", [b"x"])
    c.send_all("work.0", [b"x"])
    routes = h.broker.routes
    for address in ("device.0", "work.0"):
        [key] = [k for k in routes.cache if k[0] == address]
        assert key[0] is routes.addresses[address].name
        assert next(k for k in routes._kinds if k == key) is key
