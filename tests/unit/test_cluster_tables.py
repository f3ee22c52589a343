"""The pure parts of clustering: the forward header, the table of other nodes' bindings, arrival times."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest

from tridentmq_core.forwarding import ForwardHeader
from tridentmq_core.redistribution import Arrivals, residence_ms
from tridentmq_core.remote_bindings import Binding, BindingError, RemoteBindings


@pytest.mark.parametrize("dedup_id", ["a:1", "x" * 31, "y" * 32, "z" * 300])
def test_forward_header_round_trips_as_plain_msgpack(dedup_id: str) -> None:
    for delivered in (0, 3, 500):
        header = ForwardHeader("node-b", ("q1", "q2"), 2, dedup_id, delivered)
        assert msgpack.unpackb(header.encode()) == [dedup_id, delivered, "node-b", ["q1", "q2"], 2]
        assert ForwardHeader.decode(header.encode()) == header
        assert ForwardHeader.decode(header.encode()) == header  # the second time from the cached suffix


@pytest.mark.parametrize("delivered", [0, 3, 500])
def test_a_numbered_header_is_the_same_bytes_for_every_message_and_completes_its_id(delivered: int) -> None:
    header = ForwardHeader("node-b", ("q1",), 1, "node-a:", delivered, numbered=True)
    raw = header.encode()
    assert msgpack.unpackb(raw) == ["node-a:", delivered, "node-b", ["q1"], 1, True]
    assert ForwardHeader.decode(raw) == header
    assert ForwardHeader.decode(bytes(raw)) is ForwardHeader.decode(raw)  # kept whole, not parsed again
    assert header.transfer_id(42) == "node-a:42"
    assert ForwardHeader("node-b", ("q1",), 1, "p:node-a:x").transfer_id(42) == "p:node-a:x"


def test_a_forward_header_in_the_first_layout_still_decodes() -> None:
    """Messages journaled in a forward queue before the per-message part moved to the front."""
    old = msgpack.packb(["node-b", ["q1"], 1, "a:7", 2])
    assert ForwardHeader.decode(old) == ForwardHeader("node-b", ("q1",), 1, "a:7", 2)


@pytest.mark.parametrize("value", [
    "text", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb(["d", 0, "n", ["q"], -1]),
    msgpack.packb(["d", 0, "n", [1], 0]), msgpack.packb(["", 0, "n", ["q"], 0]),
    msgpack.packb(["d", -1, "n", ["q"], 0]), msgpack.packb(["d", 0, "n", ["q"]]), msgpack.packb({"target": "n"}),
    b"\x95" + b"\x91" * 10_000, msgpack.packb(["d", 0, "n", ["q"], 0]) + b"\x00",
    msgpack.packb(["d", 0, "n", ["q"], 0, 1]), msgpack.packb(["", 0, "n", ["q"], 0, True]),
    b"\x95\xa2\xff\xfe" + msgpack.packb(0) + msgpack.packb("n") + msgpack.packb(["q"]) + msgpack.packb(0),
])  # fmt: skip
def test_a_malformed_forward_header_is_a_value_error(value: Any) -> None:
    ForwardHeader.decode(ForwardHeader("n", ("q",), 0, "ok").encode())  # the good suffix is cached
    with pytest.raises(ValueError):  # noqa: PT011 - every kind of bad header maps to ValueError
        ForwardHeader.decode(value)


def wire(
    node: str, queue: str, address: str = "orders", consumers: int = 1, distance: int = 1, durable: bool | None = None
) -> list[Any]:
    item = [node, queue, address, 0, None, consumers, None, distance]
    return item if durable is None else [*item, durable]  # without the flag: a node before it, never durable


def test_a_departed_nodes_durable_queues_stay_as_unreachable_destinations_until_it_reports_again() -> None:
    """A node's connection drops (killed, or its pair failing over): its durable queues are still where
    messages must go, so they stay, with no consumers; its temporary ones go with it."""
    table = RemoteBindings("me", max_hops=1, max_per_node=100)
    table.replace(
        "c",
        [wire("c", "sub", consumers=2, durable=True), wire("c", "temp", durable=False), wire("c", "old", consumers=1)],
    )
    version = table.version
    table.depart("c")
    assert table.version > version  # cached routing decisions are made again
    (kept,) = table.match("orders")
    assert (kept.queue, kept.reachable, kept.consumers, kept.selectors, kept.durable) == ("sub", False, 0, (), True)
    assert table.next_hop("c") == "c"  # its store-and-forward queue holds what waits for it
    assert table.unreachable() == {"c": ["sub"]}
    table.depart("c")  # a second drop (a retired connection) changes nothing
    assert table.unreachable() == {"c": ["sub"]}
    # It (or its backup under its id) is back: its full report replaces what was kept.
    table.replace("c", [wire("c", "sub", consumers=0, durable=True)])
    (back,) = table.match("orders")
    assert (back.reachable, back.consumers) == (True, 0)
    assert table.unreachable() == {}


def test_a_scaled_down_node_leaves_nothing_behind_and_relayed_queues_are_not_kept() -> None:
    table = RemoteBindings("me", max_hops=2, max_per_node=100)
    table.replace("c", [wire("c", "sub", durable=True), wire("d", "far", distance=2, durable=True)])
    table.apply("c", [], [["c", "sub"]])  # it scales down: it reports its queues gone before it leaves
    table.depart("c")
    assert list(table) == []
    assert table.next_hop("c") is None
    assert table.next_hop("d") is None


def nowhere_here(queue: str, address: str) -> bool:
    return False


def test_a_leaving_nodes_only_known_copy_of_a_durable_queue_stays_a_destination_until_another_is_known() -> None:
    """Seen in a fault run: node c scaled down while b was cut off from d. c had made its subscription's copy
    on d, but b had not heard of it: once c's bindings went, b routed that subscription's messages nowhere
    (another subscription held them, so they were confirmed) until d's report came, 0.3 s later. Now the
    queue stays a destination at c, which moves what it gets, until b knows another copy."""
    table = RemoteBindings("me", max_hops=1, max_per_node=100)
    table.replace("c", [wire("c", "sub", durable=True), wire("c", "both", durable=True), wire("c", "tmp")])
    table.replace("d", [wire("d", "both", consumers=0, durable=True)])
    table.leave("c", nowhere_here)
    assert table.last_copies("c", nowhere_here) == 1  # "both" is on d; "tmp" is not durable
    table.apply("c", [], [["c", "sub"], ["c", "both"], ["c", "tmp"]])  # it advertises nothing as it leaves
    assert sorted((b.node_id, b.queue) for b in table.match("orders")) == [("c", "sub"), ("d", "both")]
    assert table.moving("sub", "orders") == ["c"]
    version = table.version
    table.apply("d", [wire("d", "sub", durable=True)], [])  # its copy on d is known here now
    assert table.version > version  # cached routing decisions are made again
    assert [(b.node_id, b.reachable) for b in table.for_queue("sub")] == [("d", True)]
    assert table.last_copies("c", nowhere_here) == 0
    table.depart("c")
    assert sorted((b.node_id, b.queue) for b in table.match("orders")) == [("d", "both"), ("d", "sub")]


def test_a_leaving_nodes_last_copy_goes_once_this_node_holds_one_or_once_the_node_is_gone() -> None:
    table = RemoteBindings("me", max_hops=1, max_per_node=100)
    table.replace("c", [wire("c", "sub", durable=True), wire("c", "other", address="news", durable=True)])
    table.replace("e", [wire("e", "sub", address="elsewhere", durable=True)])  # same name, not the same queue
    table.leave("c", nowhere_here)
    table.apply("c", [], [["c", "sub"], ["c", "other"]])
    assert table.last_copies("c", nowhere_here) == 2
    assert table.last_copies("c", lambda queue, address: (queue, address) == ("sub", "orders")) == 1
    assert [b.node_id for b in table.for_queue("sub")] == ["e"]
    # It stops before another copy was known (its others never acknowledged): what it holds waits for it.
    table.depart("c")
    assert table.last_copies("c", nowhere_here) == 0
    assert table.unreachable() == {"c": ["other"]}


def test_two_nodes_leaving_at_once_are_not_each_others_other_copy() -> None:
    table = RemoteBindings("me", max_hops=1, max_per_node=100)
    table.replace("c", [wire("c", "sub", durable=True)])
    table.replace("d", [wire("d", "sub", durable=True)])
    table.leave("c", nowhere_here)
    table.leave("d", nowhere_here)
    assert (table.last_copies("c", nowhere_here), table.last_copies("d", nowhere_here)) == (0, 1)
    table.apply("c", [], [["c", "sub"]])
    table.apply("d", [], [["d", "sub"]])
    assert [b.node_id for b in table.for_queue("sub")] == ["d"]  # the one that said it leaves last


def test_a_reachable_route_to_a_node_wins_over_its_kept_queues() -> None:
    table = RemoteBindings("me", max_hops=2, max_per_node=100)
    table.replace("c", [wire("c", "sub", durable=True)])
    table.depart("c")
    table.replace("b", [wire("c", "sub", distance=2, durable=True)])  # b still reaches c
    (best,) = table.match("orders")
    assert (best.via, best.reachable) == ("b", True)
    assert table.next_hop("c") == "b"


def test_bindings_from_two_routes_keep_the_shortest_and_routing_follows_it() -> None:
    table = RemoteBindings("me", max_hops=2, max_per_node=100)
    table.replace("b", [wire("b", "orders"), wire("c", "orders", distance=2)])
    assert table.next_hop("c") == "b"
    table.replace("c", [wire("c", "orders")])
    assert {(x.node_id, x.via, x.distance) for x in table.match("orders")} == {("b", "b", 1), ("c", "c", 1)}
    table.depart("c")
    assert table.next_hop("c") == "b"
    table.apply("b", [], [["c", "orders"]])
    assert table.next_hop("c") is None
    assert [x.node_id for x in table.for_queue("orders")] == ["b"]


def test_a_node_that_joins_while_another_is_down_learns_its_durable_queues_from_those_that_kept_them() -> None:
    """b kept c's subscription when c went down, and tells the others (a node that restarts, a backup that
    takes over); a copy relayed so counts only until c itself reports."""
    b = RemoteBindings("b", max_hops=1, max_per_node=100)
    b.replace("c", [wire("c", "sub", consumers=1, durable=True)])
    b.depart("c")
    (kept,) = b.kept()
    relayed = kept.to_wire()
    assert relayed == ["c", "sub", "orders", 0, None, 0, [], 1, True, False]
    a = RemoteBindings("a", max_hops=1, max_per_node=100)  # started while c is down: it knows b only
    a.replace("b", [wire("b", "own"), relayed])
    assert list(a.kept()) == []  # a relays only what it kept itself: no copy of a copy goes round
    (learned,) = a.for_queue("sub")
    assert (learned.node_id, learned.via, learned.reachable, learned.consumers) == ("c", "b", False, 0)
    assert a.next_hop("c") == "c"  # what is for it waits in c's own store-and-forward queue
    assert a.unreachable() == {"c": ["sub"]}
    a.replace("c", [wire("c", "sub", consumers=2, durable=True)])  # c is back, connected to a
    (live,) = a.for_queue("sub")
    assert (live.via, live.reachable, live.consumers) == ("c", True, 2)
    a.replace("c", [])  # c's own word counts, though b still relays the copy it kept
    assert a.for_queue("sub") == []
    assert a.unreachable() == {}
    b.replace("c", [wire("c", "sub", durable=True)])
    assert list(b.kept()) == []  # c is back at b too: b relays nothing more for it


def test_bindings_beyond_max_hops_and_our_own_are_ignored() -> None:
    table = RemoteBindings("me", max_hops=1, max_per_node=100)
    table.replace("b", [wire("b", "q"), wire("c", "q", distance=2), wire("me", "q")])
    assert [(x.node_id, x.queue) for x in table] == [("b", "q")]


def test_a_flood_of_bindings_is_refused_whole() -> None:
    table = RemoteBindings("me", max_hops=1, max_per_node=3)
    table.replace("b", [wire("b", f"q{i}") for i in range(3)])
    version = table.version
    with pytest.raises(BindingError):
        table.apply("b", [wire("b", "q3")], [])
    assert len(table) == 3
    assert table.version == version


@pytest.mark.parametrize("item", [
    "x", [1] * 8, ["b", "q", "a", 7, None, 1, None, 1], ["b", "q", "a", 0, None, -1, None, 1],
    ["b", "q", "a..b", 0, None, 1, None, 1], ["b", "q", "a", 0, None, 1, [1], 1], ["b", "q", "a", 0, None, 1, None, 0],
    ["b", "q", "a", 0, None, 1, None, 1, 1], ["b", "q", "a", 0, None, 1, None, 1, True, 0],
    ["b", "q", "a", 0, None, 1, None, 1, False, False],
])  # fmt: skip
def test_a_malformed_binding_is_refused(item: Any) -> None:
    with pytest.raises(BindingError):
        Binding.from_wire(item, "b")


def test_arrivals_are_forgotten_oldest_first() -> None:
    arrivals = Arrivals()
    for i in range(10):
        arrivals.add(i, 100 + i)
    arrivals.forget_before(104)
    assert len(arrivals) == 5
    assert arrivals.get(4) is None
    assert arrivals.get(5) == 105


def test_arrivals_in_runs_answer_for_each_message_and_never_for_one_between_them() -> None:
    arrivals = Arrivals()
    for message_id in range(100, 200):
        arrivals.add(message_id, 1_000 + message_id // 50)  # 50 per millisecond: runs of 50
    arrivals.add(205, 1_004)  # 200-204 were this node's own messages
    arrivals.add(206, 1_004)
    assert len(arrivals) == 102
    assert [arrivals.get(i) for i in (99, 100, 149, 150, 199, 200, 204, 205, 206, 207)] == [
        None,
        1_002,
        1_002,
        1_003,
        1_003,
        None,
        None,
        1_004,
        1_004,
        None,
    ]
    arrivals.forget_before(1_002)
    assert len(arrivals) == 52
    assert arrivals.get(149) is None
    assert arrivals.get(150) == 1_003
    arrivals.forget_before(1_004)
    assert len(arrivals) == 0
    assert arrivals.get(206) is None
    arrivals.add(300, 2_000)
    assert arrivals.get(300) == 2_000


def test_arrivals_forget_a_long_history_without_slowing_down() -> None:
    arrivals = Arrivals()
    for message_id in range(0, 20_000, 2):  # never consecutive: a run each
        arrivals.add(message_id, message_id)
    arrivals.forget_before(15_000)
    assert len(arrivals) == 2_499
    assert arrivals.get(15_000) is None
    assert arrivals.get(15_002) == 15_002
    assert arrivals.get(19_998) == 19_998
    arrivals.add(20_000, 20_000)
    assert arrivals.get(20_000) == 20_000


def test_a_message_moved_again_and_again_stays_longer_each_time() -> None:
    """Issue 21: a consumer moving between nodes every 1.5 s dragged its backlog along, each message moved
    4 to 8 times. The residence doubles with each earlier move, up to four times the minimum."""
    assert [residence_ms(2000, moves) for moves in range(6)] == [2000, 2000, 4000, 8000, 8000, 8000]
    arrivals = Arrivals()
    arrivals.add(1, 100)  # forwarded at publish: not a move
    arrivals.add(2, 100, 1)  # same millisecond, next id, but a different history: a run of its own
    arrivals.add(3, 100, 1)
    arrivals.add(4, 100, 3)
    assert [arrivals.moves(i) for i in (1, 2, 3, 4, 5)] == [0, 1, 1, 3, 0]
    assert [arrivals.get(i) for i in (1, 2, 3, 4)] == [100, 100, 100, 100]
    arrivals.forget_before(100)
    assert arrivals.moves(4) == 0


def test_a_bindings_backlog_flag_round_trips_and_an_older_nodes_binding_has_none() -> None:
    busy = Binding("node-b", "q", "q", 0, None, 1, None, 1, durable=True, backlog=True)
    wire = busy.to_wire()
    assert len(wire) == 11
    assert Binding.from_wire(wire, "node-b") == replace(busy, via="node-b")
    assert Binding.from_wire(wire[:10], "node-b").backlog is False  # what a node before the flag is sent
    assert busy.unreachable().backlog is False
    with pytest.raises(BindingError):
        Binding.from_wire([*wire[:10], "yes"], "node-b")
