"""A redistributor's move whose confirm is lost: the message is then on two nodes, and each copy's next
delivery must be flagged as a redelivery. The randomised run's unflagged MQTT duplicate (seed 779102): node
core-2 moved a message of a subscription queue to core-1, core-1's packets to core-2 were dropped (its
confirm with them), core-2's cluster connection timed out and took the message back (delivery count 1, so
delivered again with 2, flagged), and core-1 delivered the copy it had stored with count 1."""

from __future__ import annotations

from typing import Any

from tests.unit.broker_harness import ANYCAST, Harness, ok

from tridentmq_core.balancer import SelectorCache
from tridentmq_core.cluster.bridge import Bridge, BridgeOutlet
from tridentmq_core.forwarding import FORWARD_PROPERTY, numbered_header
from tridentmq_core.queues import Consumer
from tridentmq_core.redistribution import Redistributor
from tridentmq_core.remote_bindings import Binding
from tridentmq_core.security import Principal
from tridentmq_shared.message import M_ID, M_PROPS, WireMessage, new_message


class _Link:
    """A cluster link that takes everything and whose confirms never arrive (a one-way partition)."""

    def __init__(self) -> None:
        self.sent: list[WireMessage] = []

    def body_fits(self, message: WireMessage) -> bool:
        return True

    def send_if_open(self, message: WireMessage) -> int:
        self.sent.append(message)
        return len(self.sent)


class _Manager:
    def __init__(self, h: Harness) -> None:
        self.broker = h.broker
        self.settings = h.settings


def test_a_move_whose_confirm_was_lost_is_flagged_on_both_nodes() -> None:
    source, target = Harness(), Harness()
    producer = source.connect()
    ok(producer.create_queue("sub", "t", ANYCAST, durable=True))
    ok(target.connect().create_queue("sub", "t", ANYCAST, durable=True))
    producer.publish("t", b"m", routing=ANYCAST, durable=True)

    # The source's cluster connection to the target, with a redistributor of "sub" (the queue has no consumer
    # here, the target's has one).
    bridge = Bridge(_Manager(source), "127.0.0.1", 1)  # type: ignore[arg-type]
    link = _Link()
    bridge.client = link  # type: ignore[assignment]
    principal = Principal("cluster:node-2", frozenset(), unrestricted=True, cluster=True)
    session = source.broker.open_session(
        BridgeOutlet(bridge), "bridge", principal, "127.0.0.1", "cluster:node-2", source.now_ms
    )
    queue = source.broker.queues["sub"]
    mover = Redistributor(
        7,
        session,
        queue,
        100,
        target=Binding("node-2", "sub", "t", ANYCAST, None, 1, None, 1, "node-2"),
        selectors=SelectorCache(),
        arrivals=source.broker.forwarder.arrivals,
        min_residence_ms=0,
        clock=lambda: source.now_ms,
    )
    bridge.consumers[mover.id] = mover
    bridge.session = session
    source.broker.consuming.add_forwarder(session, mover)
    source.sync()
    source.broker.on_durable(1)  # the move's delivery attempt is on disk: it goes
    source.sync()
    assert len(link.sent) == 1

    # The target takes the move in and stores it; its confirm is lost (the target's packets to the source are
    # dropped), so the source's cluster connection times out and its session closes: the move goes back.
    moved: Any = list(link.sent[0])
    target.broker.forwarder.accept_from_cluster(moved, target.now_ms)
    source.broker.close_session(session, source.now_ms)

    # The subscriber is back on the source node: the copy there is a redelivery, flagged.
    here = source.connect()
    on_source = here.consumer("sub")
    source.sync()
    source.broker.on_durable(2)
    source.sync()
    assert [(d.count, d.body) for d in here.take(on_source)] == [(2, b"m")]

    # It moves to the target node: the same message again. It must be flagged too.
    there = target.connect()
    on_target = there.consumer("sub")
    target.sync()
    for token in range(1, 5):  # the target's records (the queues, the move, its delivery attempt) are safe
        target.broker.on_durable(token)
    target.sync()
    assert [(d.count, d.body) for d in there.take(on_target)] == [(2, b"m")]


def test_a_forward_sent_again_is_flagged_over_there_even_once_its_transfer_id_is_forgotten() -> None:
    """A store-and-forward queue's message whose confirm was lost goes again with its stored header. Its
    transfer id makes the copy a duplicate over there for ``dedup_window_seconds``; a node that was away
    longer stored it as a new message, delivered unflagged a second time. The header of a resend counts an
    attempt now."""
    source, target = Harness(), Harness()
    ok(target.connect().create_queue("orders", "orders", ANYCAST, durable=True))
    message = new_message("orders", b"m", routing=ANYCAST, durable=True)
    message[M_ID] = source.broker.new_message_id()
    message[M_PROPS] = {FORWARD_PROPERTY: numbered_header("node-1", ("orders",), 1, source.broker.transfer_prefix)}
    bridge = Bridge(_Manager(source), "127.0.0.1", 1)  # type: ignore[arg-type]
    link = _Link()
    bridge.client = link  # type: ignore[assignment]
    forward_queue = source.broker.forwarder.forward_queue("node-1", source.now_ms)
    bridge.consumers[3] = Consumer(3, source.connect().session, forward_queue, 100)
    outlet = BridgeOutlet(bridge)
    outlet.deliver(3, 1, message)  # sent; the confirm is lost with the link
    outlet.deliver(3, 2, message)  # sent again on the next link
    first, again = link.sent

    def accepted(sent: WireMessage) -> list[tuple[int, bytes]]:
        target.broker.forwarder.accept_from_cluster(list(sent), target.now_ms)
        client = target.connect()
        consumer = client.consumer("orders")
        target.sync()
        for token in range(1, 20):  # every record so far is on disk
            target.broker.on_durable(token)
        target.sync()
        taken = client.take(consumer)
        client.ack(consumer, [d.id for d in taken])
        client.close()
        target.sync()
        return [(d.count, d.body) for d in taken]

    assert accepted(first) == [(1, b"m")]
    target.tick(target.now_ms + int(target.settings.broker.dedup_window_seconds * 1000) + 1_000)
    assert accepted(again) == [(2, b"m")]
