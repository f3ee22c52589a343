"""When the cluster manager declares another node gone (``cluster.node_gone_ms``) and routes again what waits
for it. It runs in process with a real broker; no connection is opened (a bridge is only its state here)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.unit.broker_harness import ANYCAST, Harness, ok, recorded

from tridentmq_core.cluster.bridge import Bridge
from tridentmq_core.cluster.manager import ClusterManager, Joined
from tridentmq_core.forwarder import FORWARD_QUEUE_PREFIX
from tridentmq_core.forwarding import FORWARD_PROPERTY, numbered_header
from tridentmq_core.security import Principal
from tridentmq_core.settings import ClusterSection, CoreSettings
from tridentmq_shared.message import M_ID, M_PROPS, new_message
from tridentmq_shared.mqtt_queues import retained_queue

GONE_MS = 10_000
OTHER = "node-2"


def _manager(h: Harness) -> ClusterManager:
    manager = ClusterManager(
        h.broker, h.settings, node_id="node-1", name="one", advertise=("127.0.0.1", 1), schedule_flush=lambda: None
    )
    manager._started -= 600  # this node has run for a while
    return manager


def _down_bridge(manager: ClusterManager, port: int, down_for_s: float) -> Bridge:
    """A cluster connection to OTHER at ``port`` that was up and went down ``down_for_s`` ago."""
    bridge = Bridge(manager, "127.0.0.1", port)
    bridge.node_id, bridge.state, bridge.down_since = OTHER, "down", time.monotonic() - down_for_s
    manager.bridges[bridge.address] = manager.bridges_by_node[OTHER] = bridge
    return bridge


def _waiting_for_other(h: Harness) -> int:
    """A message held here for OTHER (whose queue of its address this node also has), and how many wait."""
    ok(h.connect().create_queue("orders", "orders", ANYCAST))
    queue = h.broker.forwarder.forward_queue(OTHER, h.now_ms)
    message = new_message("orders", b"for node-2", routing=ANYCAST, durable=True)
    message[M_ID] = 1_000
    queue.add(message)
    return len(queue)


def _held(h: Harness) -> int:
    return len(h.broker.forwarder.forward_queue(OTHER, h.now_ms))


async def test_a_node_that_comes_back_at_another_address_is_not_declared_gone_in_between() -> None:
    """A failback (or a backup taking over) brings a node back at another address: its old connection is
    retired before the new one is up. In between, the node counted as away since this node started, so a
    tick declared it gone at once and routed its held messages elsewhere, while the copy it already had was
    delivered too (duplicates without the redelivered flag in a 30-minute randomised run)."""
    h = Harness(CoreSettings(cluster=ClusterSection(node_gone_ms=GONE_MS)))
    manager = _manager(h)
    assert _waiting_for_other(h) == 1
    old = _down_bridge(manager, 61617, down_for_s=0.5)
    manager.retire(old)  # the node was heard of at its new address; the new connection is not up yet
    await asyncio.sleep(0)  # (the retired bridge's stop runs)
    manager._declare_gone(h.now_ms)
    assert _held(h) == 1
    assert manager.reachable(OTHER, grace_s=2.0)


async def test_a_node_away_longer_than_node_gone_ms_is_gone_whatever_its_address() -> None:
    h = Harness(CoreSettings(cluster=ClusterSection(node_gone_ms=GONE_MS)))
    manager = _manager(h)
    _waiting_for_other(h)
    manager.retire(_down_bridge(manager, 61617, down_for_s=GONE_MS / 1000 + 1))
    await asyncio.sleep(0)
    _down_bridge(manager, 61620, down_for_s=0)  # its new connection, not up yet: the clock does not restart
    manager._declare_gone(h.now_ms)
    assert _held(h) == 0  # routed to this node's queue of its address
    assert not manager.reachable(OTHER, grace_s=2.0)


async def test_a_node_never_connected_from_here_is_not_reachable() -> None:
    assert not _manager(Harness()).reachable(OTHER, grace_s=2.0)


async def test_a_node_heard_from_over_its_own_connection_is_not_gone_while_this_one_reconnects() -> None:
    """Issue 21, an unflagged duplicate in the 30-minute randomised run over up --nodes 3: a node killed,
    restarted and at once cut off again joined this one in between, but this node's own connection to it was
    still reconnecting, and 10 s after the first fault it was declared gone: a resend held here to be sent
    home to it was routed again, while it had the first copy. Its own connection counts: it is away since
    that one closed."""
    h = Harness(CoreSettings(cluster=ClusterSection(node_gone_ms=GONE_MS)))
    manager = _manager(h)
    _waiting_for_other(h)
    _down_bridge(manager, 61617, down_for_s=GONE_MS / 1000 + 1)  # this node's connection to it: down long ago
    theirs = h.connect("cluster:node-2")
    manager.joined[theirs.session.conn_id] = Joined(theirs.session, OTHER)  # it joined this node meanwhile
    manager._declare_gone(h.now_ms)
    assert _held(h) == 1
    theirs.drop()  # then it was cut off: away since now
    manager._forget_closed()
    manager._declare_gone(h.now_ms)
    assert _held(h) == 1
    manager._joined_until[OTHER] -= GONE_MS / 1000 + 1  # and for longer than node_gone_ms
    manager._declare_gone(h.now_ms)
    assert _held(h) == 0


def test_a_node_that_announces_it_scales_down_keeps_its_durable_queues_on_the_move() -> None:
    """The update that says a node leaves also removes its bindings: its durable queues are noted as on the
    move first (see test_a_queue_of_a_node_scaling_down_counts_as_elsewhere_until_that_node_is_gone). One of
    which it holds the only copy known here stays a destination; one this node holds too does not."""
    h = Harness()
    manager = _manager(h)
    bridge = _down_bridge(manager, 61617, down_for_s=0)
    session_queue, sole = "$mqtt.session.client-7", "$mqtt.session.client-8"
    h.connect().create_queue(session_queue, session_queue, ANYCAST, durable=True)
    retained = retained_queue(OTHER)  # its own copy of the retained messages, which it keeps: needed no more
    manager.bindings.replace(
        OTHER,
        [[OTHER, name, name, ANYCAST, None, 0, None, 1, True] for name in (session_queue, sole, retained)],
    )
    removed = [[OTHER, session_queue], [OTHER, sole], [OTHER, retained]]
    manager.apply_update(bridge, {"leaving": True, "removed": removed})
    assert bridge.leaving
    assert manager.bindings.for_queue(session_queue) == []
    assert manager.bindings.for_queue(retained) == []
    assert [b.node_id for b in manager.bindings.for_queue(sole)] == [OTHER]
    assert manager.last_copies(OTHER) == 1  # its leaving is not acknowledged while this node routes there
    assert manager.bindings.moving(session_queue, session_queue) == [OTHER]
    manager.bridge_down(bridge)  # gone
    assert manager.bindings.moving(session_queue, session_queue) == []


def test_a_node_leaves_once_in_the_audit_stream_however_often_its_reconnect_fails() -> None:
    """Every failed try to reconnect to a dead node wrote node.left again (9 in its first 10 s, then one every
    2 s), so the audit's failover alerts counted dozens of failovers for one crash."""
    h, _, audit = recorded()
    manager = _manager(h)
    bridge = Bridge(manager, "127.0.0.1", 61617)
    bridge.node_id = OTHER
    manager.bridges[bridge.address] = manager.bridges_by_node[OTHER] = bridge
    bridge.open_session(Principal("cluster:node-2", frozenset(), unrestricted=True, cluster=True))  # up
    for _ in range(5):  # it goes down, then four tries to reconnect fail
        bridge._teardown()
    assert [fields for _, event, fields in audit.events if event == "node.left"] == [
        {"peer_node": OTHER, "name": bridge.name}
    ]


def _forwarded(h: Harness, body: bytes) -> list[Any]:
    """A durable message for OTHER's queue ``orders``, as the forwarder sends it straight there."""
    message = new_message("orders", body, routing=ANYCAST, durable=True)
    message[M_ID] = h.broker.new_message_id()
    message[M_PROPS] = {FORWARD_PROPERTY: numbered_header(OTHER, ("orders",), 1, h.broker.transfer_prefix)}
    return message


async def test_a_forward_sent_unconfirmed_to_a_node_declared_gone_is_routed_again_flagged() -> None:
    """A randomised run over up --nodes 3 (seed 206639929): a publish forwarded straight to another node, which
    stored and delivered it, whose confirm a partition lost; the partitions went on past node_gone_ms, and
    this node routed its copy again to its own queue: a second delivery, unflagged (count 1). What was sent
    may be over there: it counts an attempt, its next delivery here is flagged. What only waited for credit
    was never sent: its first delivery here is no redelivery."""
    h = Harness(CoreSettings(cluster=ClusterSection(node_gone_ms=GONE_MS)))
    manager = _manager(h)
    consumer = h.connect()
    ok(consumer.create_queue("orders", "orders", ANYCAST))
    forwarder = h.broker.forwarder
    forwarder.requeue_forwards(OTHER, [(_forwarded(h, b"sent"), 0)], h.now_ms, sent=True)
    forwarder.requeue_forwards(OTHER, [(_forwarded(h, b"held"), 0)], h.now_ms, sent=False)
    assert _held(h) == 2
    _down_bridge(manager, 61617, down_for_s=GONE_MS / 1000 + 1)
    manager._declare_gone(h.now_ms)
    assert _held(h) == 0
    subscription = consumer.consumer("orders")
    h.sync()
    counts = {d.body: d.count for d in consumer.take(subscription)}
    assert counts == {b"sent": 2, b"held": 1}


async def test_a_forward_returned_by_a_dropped_cluster_link_keeps_its_flag_when_routed_again() -> None:
    """A store-and-forward copy handed to the cluster connection and not confirmed when it dropped comes back
    to its forward queue with the attempt counted; routed again from there, it was admitted as new (the
    queue's count was dropped with it), and delivered unflagged though the other node may have it. It counts
    one attempt where it goes, however often the link dropped (moving is no failed delivery), and that is
    journaled with it: a restart before its delivery keeps the flag."""
    h, store, _ = recorded(CoreSettings(cluster=ClusterSection(node_gone_ms=GONE_MS)))
    manager = _manager(h)
    consumer = h.connect()
    ok(consumer.create_queue("orders", "orders", ANYCAST, durable=True))
    queue = h.broker.forwarder.forward_queue(OTHER, h.now_ms)
    queue.return_message(_forwarded(h, b"out when the link dropped"), 1)
    queue.return_message(_forwarded(h, b"out when the link dropped five times"), 5)
    _down_bridge(manager, 61617, down_for_s=GONE_MS / 1000 + 1)
    manager._declare_gone(h.now_ms)
    assert store.message_counts == [(("orders",), [1]), (("orders",), [1])]  # in the message's own record
    subscription = consumer.consumer("orders")
    h.sync()
    assert [d.count for d in consumer.take(subscription)] == [2, 2]


async def test_a_cluster_link_that_keeps_dropping_dead_letters_only_after_ten_times_the_attempts() -> None:
    """Each time a cluster connection drops, what its store-and-forward consumer had out comes back with one
    attempt more; at max_delivery_attempts it went to the dead-letter address, though it had failed no
    delivery: a confirmed message out of reach of its subscribers because a link flapped ten times. A drop
    now counts a tenth: one message that breaks the link each time it is sent still ends in the DLQ, rather
    than stall what waits behind it for ever."""
    h = Harness(CoreSettings(cluster=ClusterSection(node_gone_ms=GONE_MS)))
    manager = _manager(h)
    queue = h.broker.forwarder.forward_queue(OTHER, h.now_ms)
    queue.return_message(_forwarded(h, b"out at every drop"), 9)
    bridge = Bridge(manager, "127.0.0.1", 61617)
    bridge.node_id = OTHER
    bridge.client = _AcceptingLink()  # type: ignore[assignment]
    cluster = Principal("cluster:node-2", frozenset(), unrestricted=True, cluster=True)

    def drop() -> None:
        bridge.open_session(cluster)
        h.broker.flush_dispatch(h.now_ms)
        assert not len(queue)  # out with the bridge's consumer
        bridge._teardown()  # the link drops before the other node confirms it

    for _ in range(3):
        drop()
        assert len(queue) == 1
    assert "DLQ" not in h.broker.queues
    (message,) = queue.take_all()
    queue.return_message(message[0], 10 * 10 - 1)
    drop()
    assert not len(queue)
    assert len(h.broker.queues["DLQ"]) == 1


class _AcceptingLink:
    """A cluster link that takes everything and confirms nothing."""

    def body_fits(self, message: list[Any]) -> bool:
        return True

    def send_if_open(self, message: list[Any]) -> int:
        return 1


def test_an_unreachable_node_reports_the_forwards_in_flight_from_its_emptied_queue() -> None:
    """A store-and-forward queue whose messages are all in flight holds none queued: ``len`` 0 made it falsy,
    and the report said nothing waited for the node while messages did."""
    h = Harness()
    manager = _manager(h)
    bridge = _down_bridge(manager, 61617, down_for_s=0)
    manager.bindings.replace(OTHER, [[OTHER, "orders", "orders", ANYCAST, None, 0, None, 1, True]])
    manager.bridge_down(bridge)
    _waiting_for_other(h)
    client = h.connect()
    taker = client.consumer(FORWARD_QUEUE_PREFIX + OTHER, credit=1)
    assert len(client.take(taker)) == 1  # out, not acknowledged: the queue holds none queued
    assert manager.unreachable() == {OTHER: {"queues": ["orders"], "pending_forward": 1}}
