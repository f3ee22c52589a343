"""The broker's routing with other nodes' bindings, in process: what stays here and what is forwarded."""

from __future__ import annotations

from typing import Any

from tests.unit.broker_harness import ANYCAST, MULTICAST, Harness, bodies, ok

from tridentmq_core.broker import Direct, WireMessage
from tridentmq_core.cluster.balancer import Balancer
from tridentmq_core.cluster.bindings import RemoteBindings
from tridentmq_shared.message import M_BODY


def clustered(policy: str = "ON_DEMAND") -> tuple[Harness, RemoteBindings, list[bytes]]:
    """A broker with another node, node-2, whose bindings the test sets; what it forwards is recorded."""
    h = Harness()
    bindings = RemoteBindings("node-1", max_hops=1, max_per_node=1000)
    h.broker.cluster = Balancer(bindings, policy)
    forwarded: list[bytes] = []

    def send_direct(via: str, message: WireMessage, token: int, publisher: Any) -> Direct:
        forwarded.append(bytes(message[M_BODY]))
        return Direct.SENT

    h.broker.send_direct = send_direct
    return h, bindings, forwarded


def binding(queue: str, address: str, routing: int, consumers: int = 1) -> list[Any]:
    return ["node-2", queue, address, routing, None, consumers, None, 1]


def test_a_filtered_subscription_gets_its_messages_when_another_node_has_one_too() -> None:
    """The balancer's plan was made from the queues the first message's filters left, and kept: a blue
    message first, and the red subscription here never got a red one."""
    h, bindings, forwarded = clustered()
    c = h.connect()
    ok(c.create_queue("sub-all", "t", MULTICAST))
    ok(c.create_queue("sub-red", "t", MULTICAST, filter="color = 'red'"))
    every, red = c.consumer("sub-all"), c.consumer("sub-red")
    bindings.replace("node-2", [binding("theirs", "t", MULTICAST)])
    for color in ("blue", "red", "red", "blue"):
        c.publish("t", color.encode(), routing=MULTICAST, properties={"color": color})
    assert bodies(c.take(red)) == [b"red", b"red"]
    assert bodies(c.take(every)) == [b"blue", b"red", b"red", b"blue"]
    assert forwarded == [b"blue", b"red", b"red", b"blue"]


def two_anycast_queues_here_and_q3_there(filter_there: str | None = None) -> tuple[list[bytes], list[bytes],
                                                                                list[bytes]]:  # fmt: skip
    """Twelve messages to address "a": what q1 and q2 here got, and what went to node-2's q3."""
    h, bindings, forwarded = clustered()
    c = h.connect()
    ok(c.create_queue("q1", "a", ANYCAST))
    ok(c.create_queue("q2", "a", ANYCAST))
    first, second = c.consumer("q1"), c.consumer("q2")
    bindings.replace("node-2", [["node-2", "q3", "a", ANYCAST, filter_there, 1, None, 1]])
    for n in range(12):
        c.publish("a", b"%d" % n, routing=ANYCAST, properties={"color": "blue"})
    return bodies(c.take(first)), bodies(c.take(second)), forwarded


def test_two_anycast_queues_here_and_one_there_all_get_messages() -> None:
    """The same plan made from one message's anycast turn starved the other local queue."""
    to_first, to_second, forwarded = two_anycast_queues_here_and_q3_there()
    assert to_first  # each of the three gets some
    assert to_second
    assert forwarded
    assert sorted(to_first + to_second + forwarded) == sorted(b"%d" % n for n in range(12))  # each once


def test_when_no_remote_queue_takes_the_message_one_local_anycast_queue_still_does() -> None:
    to_first, to_second, forwarded = two_anycast_queues_here_and_q3_there("color = 'red'")  # q3 takes red only
    assert forwarded == []
    assert to_first
    assert to_second
    assert sorted(to_first + to_second) == sorted(b"%d" % n for n in range(12))  # each to one queue only
