"""MQTT across a cluster: gateways attached to different core nodes share sessions, retained messages and
client ids (link stealing), as the cluster moves the state to where the client comes back."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, GatewayProcess, start_gateway, stop_cleanly
from tests.integration.cluster_nodes import (
    client,
    cluster_view,
    remote_consumers,
    start_cluster,
    start_node,
    wait_until,
)
from tests.integration.mqtt_clients import Paho, Raw

from tridentmq_mqtt.convert import lock_queue, outbox_queue, session_queue
from tridentmq_mqtt.protocol.packets import (
    Connack,
    Disconnect,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Subscription,
)
from tridentmq_mqtt.protocol.properties import Properties

pytestmark = [pytest.mark.integration, pytest.mark.cluster]


@pytest.fixture
def two_sides(tmp_path: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two MQTT gateways, each linked to its own node of a 2-node cluster (``.nodes`` of the gateway)."""
    a, b = start_cluster(tmp_path, 2)
    # FIRST_ELEMENT keeps each gateway's links on its own node (the node lists itself first).
    pinned = {"TRIDENTMQ_MQTT_CORE_LOAD_BALANCING": "FIRST_ELEMENT"}
    left = start_gateway(tmp_path, a, "mqtt", name="mqtt-a", **pinned)
    right = start_gateway(tmp_path, b, "mqtt", name="mqtt-b", **pinned)
    NODES[left.port], NODES[right.port] = a, b
    # Each node knows the other's copy of the retained messages before anything is retained.
    wait_until(lambda: all(cluster_view(n)["remote_bindings"] >= 1 for n in (a, b)), what="the retained queues")
    yield left, right
    for gateway in (left, right):
        stop_cleanly(gateway)
    for node in (a, b):
        assert node.stop() == 0, node.log()
        assert "Traceback" not in node.log(), node.log()


NODES: dict[int, CoreProcess] = {}  # gateway port → its core node


async def _make_queue(node: CoreProcess, name: str) -> None:
    async with client(node) as link:
        await link.create_queue(name, durable=True, last_value_key="")


def _warnings(log: str) -> str:
    """A gateway's warnings, for a failure's report."""
    return "\n".join(line for line in log.splitlines() if " WARNING " in line or " ERROR " in line)[-2000:]


def _id() -> str:
    return uuid.uuid4().hex[:8]


def test_a_retained_message_is_seen_through_a_gateway_on_another_node(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    left, right = two_sides
    topic = f"state/{_id()}"
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    publisher.publish(topic, b"on", 1, retain=True)

    def retained_on_the_right() -> list[bytes]:
        reader = Paho(right.port, f"r-{_id()}")
        reader.connect()
        reader.subscribe(topic, 1)
        got = [m.payload for m in reader.receive(1, timeout=0.5)]
        reader.disconnect()
        return got

    wait_until(lambda: retained_on_the_right() == [b"on"], timeout=10, what="the retained message on node b")
    publisher.publish(topic, b"", 1, retain=True)  # cleared through node a: cleared on node b too
    wait_until(lambda: retained_on_the_right() == [], timeout=10, what="the retained message to clear on node b")
    publisher.disconnect()


def _persistent_session_left_on(left: GatewayProcess, right: GatewayProcess, client_id: str, topic_filter: str) -> None:
    """A new persistent session subscribed (QoS 1) through ``left``, disconnected, once ``right``'s node knows
    its queues (session record, subscription): a client coming back sooner than that through another node
    would start a new session."""
    first = Paho(left.port, client_id, clean=False)
    assert first.connect(expiry=300)[0] is False
    first.subscribe(topic_filter, 1)
    first.disconnect()
    wait_until(lambda: cluster_view(NODES[right.port])["remote_bindings"] >= 3, what="node b to learn the session")


def test_a_persistent_session_resumes_through_a_gateway_on_another_node(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    left, right = two_sides
    client_id = f"c-{_id()}"
    _persistent_session_left_on(left, right, client_id, "orders/#")
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    for i in range(10):
        publisher.publish(f"orders/{i}", str(i).encode(), 1)
    started = time.monotonic()
    again = Paho(right.port, client_id, clean=False)
    assert again.connect(expiry=300)[0] is True  # the session came over from node a
    assert sorted(m.payload for m in again.receive(10)) == sorted(str(i).encode() for i in range(10))
    publisher.publish("orders/late", b"late", 1)  # now routed to where the subscriber is
    assert [m.payload for m in again.receive(1)] == [b"late"]
    assert time.monotonic() - started < 10
    again.disconnect()
    publisher.disconnect()


@pytest.mark.parametrize("clean_start", [False, True])
def test_a_delayed_will_is_cancelled_by_a_reconnect_through_another_node(
    two_sides: tuple[GatewayProcess, GatewayProcess], clean_start: bool
) -> None:
    """MQTT 5, 3.1.3.2.2: a will whose delay has not passed when a new connection to its session is made is
    never sent. Its pending will was kept by the node the lost connection went through, and only a reconnect
    through that node cancelled it: through another one, the will was sent after its delay anyway. A clean
    start ends the session, and its will is sent at once ([MQTT-3.1.2-8] with 3.1.4-3)."""
    left, right = two_sides
    client_id = f"w-{_id()}"
    watcher = Paho(right.port, f"watch-{_id()}")
    watcher.connect()
    watcher.subscribe("status/#", 1)
    device = Paho(left.port, client_id, clean=False, reconnect=False)
    device.connect(expiry=300, will=("status/device", b"offline", 1, False), will_delay=3)
    device.drop()
    wait_until(lambda: cluster_view(NODES[right.port])["remote_bindings"] >= 3, what="node b to learn the session")
    again = Paho(right.port, client_id, clean=clean_start)
    again.connect(expiry=300)
    if clean_start:
        assert [m.payload for m in watcher.receive(1)] == [b"offline"]
    assert watcher.nothing_more(4.5)  # past the will delay
    again.disconnect()
    watcher.disconnect()


def test_an_unacknowledged_retained_message_comes_again_through_a_gateway_on_another_node(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """A retained message sent at QoS 1 on subscribe waits in the session's outbox on node a; the session
    resumed through node b gets it again (MQTT 4.4), as the outbox's queue comes over with the session."""
    left, right = two_sides
    client_id = f"c-{_id()}"
    topic = f"kept/{_id()}"
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    publisher.publish(topic, b"on", 1, retain=True)
    publisher.disconnect()
    with contextlib.ExitStack() as sockets:  # closed however the test ends
        first = Raw(left.port)
        sockets.callback(first.close)
        connack = first.connect(client_id, clean_start=False, properties=Properties(session_expiry_interval=300))
        assert isinstance(connack, Connack), connack
        assert connack.reason_code == 0, connack
        first.send(Subscribe(1, (Subscription(topic, 1),)))
        assert first.next() == Suback(1, (1,))
        delivered = first.next()
        assert isinstance(delivered, Publish), delivered
        assert (delivered.payload, delivered.retain, delivered.dup) == (b"on", True, False)
        # Node b knows the session's queues (record, subscription, outbox) before the client comes back there.
        wait_until(lambda: remote_consumers(NODES[right.port], outbox_queue(client_id)) == 1, what="the outbox")
        wait_until(lambda: cluster_view(NODES[right.port])["remote_bindings"] >= 4, what="node b to learn the session")
        first.close()  # without the PUBACK
        again = Raw(right.port)
        sockets.callback(again.close)
        connack = again.connect(client_id, clean_start=False, properties=Properties(session_expiry_interval=300))
        assert isinstance(connack, Connack), connack
        assert connack.session_present, (connack, _warnings(right.log()))
        resent = again.next()
        assert isinstance(resent, Publish), resent
        assert (resent.topic, resent.payload, resent.qos, resent.retain, resent.dup) == (topic, b"on", 1, True, True)
        again.send(Puback(resent.packet_id or 0))
        again.send(Disconnect())
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    publisher.publish(topic, b"", 1, retain=True)
    publisher.disconnect()


def test_a_qos2_publish_sent_again_through_another_node_is_stored_once(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """A QoS 2 PUBLISH whose PUBREC was lost with the connection is sent again (DUP) after the session resumed
    through a gateway on another node. Published there under the same duplicate id, it was stored a second
    time (a node drops only the duplicates it has seen itself): the subscriber got it twice. It now goes to
    the node that has the first copy, which drops it."""
    left, right = two_sides
    topic = f"once/{_id()}"
    subscriber = Paho(left.port, f"s-{_id()}")
    subscriber.connect()
    subscriber.subscribe(topic, 2)
    client_id = f"p-{_id()}"
    known = cluster_view(NODES[right.port])["remote_bindings"]
    with contextlib.ExitStack() as sockets:
        first = Raw(left.port)
        sockets.callback(first.close)
        session = Properties(session_expiry_interval=300)
        connack = first.connect(client_id, clean_start=False, properties=session)
        assert isinstance(connack, Connack), connack
        assert (connack.session_present, connack.reason_code) == (False, 0), connack
        first.send(Publish(topic, b"m1", qos=2, packet_id=7))
        assert first.next() == Pubrec(7)
        assert [m.payload for m in subscriber.receive(1)] == [b"m1"]
        first.close()  # as if the PUBREC were lost with the connection
        wait_until(
            lambda: cluster_view(NODES[right.port])["remote_bindings"] > known, what="node b to learn the session"
        )
        again = Raw(right.port)
        sockets.callback(again.close)
        connack = again.connect(client_id, clean_start=False, properties=session)
        assert isinstance(connack, Connack), connack
        assert connack.session_present, (connack, _warnings(right.log()))
        again.send(Publish(topic, b"m1", qos=2, dup=True, packet_id=7))
        assert again.next() == Pubrec(7)
        again.send(Pubrel(7))
        assert again.next() == Pubcomp(7)
        again.send(Disconnect())
    assert subscriber.nothing_more(1.0), [m.payload for m in subscriber.receive(5, timeout=0.1)]
    subscriber.disconnect()


def test_a_clean_start_on_another_node_discards_the_session_and_its_queued_messages(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """MQTT 3.1.2.4: with Clean Start, the server discards any existing session. The earlier session's queues
    were on node a; the client comes back with Clean Start through node b, then subscribes to the same filter:
    it must get none of what was queued for the old session, on node a or on its way over."""
    left, right = two_sides
    client_id = f"c-{_id()}"
    _persistent_session_left_on(left, right, client_id, "clean/#")
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    for i in range(5):
        publisher.publish(f"clean/{i}", b"old %d" % i, 1)
    again = Paho(right.port, client_id, clean=True)
    assert again.connect(expiry=300)[0] is False  # a new session
    again.subscribe("clean/#", 1)
    publisher.publish("clean/new", b"new", 1)
    assert [m.payload for m in again.receive(1)] == [b"new"]
    assert again.receive(1, timeout=2) == [], "a message queued for the discarded session came"
    again.disconnect()
    back = Paho(left.port, client_id, clean=False)  # the old session is gone from node a too
    back.connect(expiry=300)
    publisher.publish("clean/later", b"later", 1)
    assert [m.payload for m in back.receive(1)] == [b"later"]  # the session of the clean start, resumed
    assert back.receive(1, timeout=1) == []
    back.disconnect()
    publisher.disconnect()


def test_another_user_cannot_take_a_session_kept_on_another_node(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """The session's record comes over from node a before its owner can be checked: the newcomer of another
    user is refused then, and the session stays its owner's, with its queued messages."""
    left, right = two_sides
    client_id = f"c-{_id()}"
    topic = f"inbox/{_id()}"
    bob = Paho(left.port, client_id, clean=False, username="bob")
    bob.connect(expiry=300)
    bob.subscribe(topic, 1)
    bob.disconnect()
    wait_until(lambda: cluster_view(NODES[right.port])["remote_bindings"] >= 3, what="node b to learn the session")
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    publisher.publish(topic, b"queued", 1)
    alice = Paho(right.port, client_id, username="alice")  # clean start
    assert alice.connect(expiry=300)[1] == 0x87  # not authorized
    alice.disconnect()
    back = Paho(right.port, client_id, clean=False, username="bob")
    assert back.connect(expiry=300)[0] is True  # still bob's session
    assert [m.payload for m in back.receive(1)] == [b"queued"]
    back.disconnect()
    publisher.disconnect()


def test_link_stealing_across_gateways_on_different_nodes(two_sides: tuple[GatewayProcess, GatewayProcess]) -> None:
    left, right = two_sides
    client_id = f"c-{_id()}"
    with contextlib.ExitStack() as sockets:  # closed however the test ends
        first = Raw(left.port)
        sockets.callback(first.close)
        assert isinstance(first.connect(client_id), Connack)
        wait_until(
            lambda: remote_consumers(NODES[right.port], lock_queue(client_id)) == 1,
            what="node b to learn the lock queue's consumer on node a",
        )
        second = Raw(right.port)
        sockets.callback(second.close)
        connack = second.connect(client_id)
        assert isinstance(connack, Connack)
        assert connack.reason_code == 0, (connack, _warnings(right.log()), _warnings(left.log()))
        assert first.next() == Disconnect(0x8E)  # Session taken over
        assert first.closed()


def test_a_session_that_ends_on_its_node_while_fetched_is_no_session_not_a_refusal(
    two_sides: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """Node b still knew node a's queue of a client's session when the client came to b: the gateway on b
    waits for its record. That queue goes from a meanwhile (the session ended there; here an operator deletes
    it) with no record: the client gets a new session, not "server unavailable" after the fetch timeout."""
    left, right = two_sides
    client_id = f"c-{_id()}"
    queue = session_queue(client_id)

    async def make_then_delete() -> None:
        async with client(NODES[left.port]) as on_a:
            # A session queue whose record is not written yet; answered once node b knows it.
            await on_a.create_queue(queue, durable=True)
            with ThreadPoolExecutor(1) as pool:
                connecting = pool.submit(lambda: Raw(right.port))
                newcomer = connecting.result()
                connack = pool.submit(newcomer.connect, client_id)
                await asyncio.to_thread(
                    wait_until,
                    lambda: remote_consumers(NODES[left.port], queue) == 1,
                    10.0,
                    "the gateway on b to hold the session queue",
                )
                await on_a.delete_queue(queue)
                try:
                    answer = connack.result(timeout=10)
                finally:
                    newcomer.close()
        assert isinstance(answer, Connack)
        assert (answer.reason_code, answer.session_present) == (0, False), answer

    asyncio.run(make_then_delete())


@pytest.mark.parametrize("queue_here", [False, True], ids=["new-here", "queue-here-without-record"])
def test_a_session_kept_by_a_node_that_is_down_is_refused_for_now_not_started_afresh(
    tmp_path: Path, queue_here: bool
) -> None:
    """A client coming back with its persistent session while the node holding it is down used to get a new,
    empty session after five seconds: the messages its subscription held on that node were lost to it
    (found by the randomised run over ``up --nodes 3``). It is refused with "server unavailable" instead, and
    resumes its session, messages and all, once that node is back. The same when node b already has a queue
    of the session without its record (an earlier fetch's, say): there the new session's SUBSCRIBE then
    dropped the subscription's queue as an earlier session's leftover (found by the run over ``--pairs 3``)."""
    a, b = start_cluster(tmp_path, 2)
    pinned = {"TRIDENTMQ_MQTT_CORE_LOAD_BALANCING": "FIRST_ELEMENT"}  # each gateway's links stay on its node
    left = start_gateway(tmp_path, a, "mqtt", name="mqtt-a", **pinned)
    right = start_gateway(tmp_path, b, "mqtt", name="mqtt-b", **pinned)
    client_id = f"c-{_id()}"
    first = Paho(left.port, client_id, clean=False)
    assert first.connect(expiry=300)[0] is False
    first.subscribe("held/#", 1)
    first.disconnect()
    wait_until(lambda: cluster_view(b)["remote_bindings"] >= 3, what="node b to learn the session")
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    for i in range(5):
        publisher.publish(f"held/{i}", str(i).encode(), 1)  # PUBACKed: in node a's subscription queue
    publisher.disconnect()
    if queue_here:
        asyncio.run(_make_queue(b, session_queue(client_id)))
    a.process.kill()
    a.process.wait()
    again = Paho(right.port, client_id, clean=False)
    assert again.connect(expiry=300)[1] == 0x88  # server unavailable: not a new session without its messages
    again.disconnect()
    a = start_node(tmp_path, "node-0", [b])  # its data directory: the same node, back
    resumed: list[Paho] = []

    def resume() -> bool:
        client = Paho(right.port, client_id, clean=False)
        present, reason, _ = client.connect(expiry=300)
        if reason != 0:  # 0x88 again while the session's record is on its way
            client.disconnect()
            return False
        assert present is True  # the session came over from node a
        resumed.append(client)
        return True

    wait_until(resume, timeout=60, what="the session to be reachable again")
    back = resumed[0]
    assert sorted(m.payload for m in back.receive(5)) == [str(i).encode() for i in range(5)]
    back.disconnect()
    for gateway in (left, right):
        gateway.stop()
    for node in (a, b):
        assert node.stop() == 0, node.log()


def test_a_qos1_message_published_on_another_node_right_after_the_suback_is_delivered(tmp_path: Path) -> None:
    """The SUBACK says the subscription is known to every live node: a QoS 1 message published through a
    gateway on another node the moment it comes is routed to it, never matched against a cluster that has
    not heard of the subscription yet (acknowledged and dropped)."""
    nodes = start_cluster(tmp_path, 3)
    pinned = {"TRIDENTMQ_MQTT_CORE_LOAD_BALANCING": "FIRST_ELEMENT"}
    gateways = [start_gateway(tmp_path, node, "mqtt", name=f"mqtt-{i}", **pinned) for i, node in enumerate(nodes[:2])]
    subscriber, publisher = Paho(gateways[1].port, f"s-{_id()}"), Paho(gateways[0].port, f"p-{_id()}")
    try:
        subscriber.connect()
        publisher.connect()
        topics = [f"race/{_id()}/{i}" for i in range(30)]
        for topic in topics:
            subscriber.subscribe(topic, 1)
            publisher.publish(topic, topic.encode(), 1)  # waits for the PUBACK
        got = {m.topic for m in subscriber.receive(len(topics))}
        missed = [t for t in topics if t not in got]
        assert not missed, f"{len(missed)} of 30 acknowledged messages published after the SUBACK were lost"
    finally:
        for paho_client in (subscriber, publisher):
            paho_client.disconnect()
        for gateway in gateways:
            stop_cleanly(gateway)
        for node in nodes:
            assert node.stop() == 0, node.log()
            assert "Traceback" not in node.log(), node.log()


def test_a_session_whose_record_moved_away_is_fetched_back_not_resumed_empty(tmp_path: Path) -> None:
    """A scale-down (or redistribution) moves a session's record to another node and leaves its empty queue on
    the node that comes back. A client resuming there got "session present" with no subscriptions: nothing it
    had subscribed to reached it any more (found by the randomised run over ``up --nodes 3``)."""
    a, b = start_cluster(tmp_path, 2)
    pinned = {"TRIDENTMQ_MQTT_CORE_LOAD_BALANCING": "FIRST_ELEMENT"}
    left = start_gateway(tmp_path, a, "mqtt", name="mqtt-a", **pinned)
    client_id = f"c-{_id()}"
    first = Paho(left.port, client_id, clean=False)
    assert first.connect(expiry=300)[0] is False
    first.subscribe("moved/#", 1)
    first.disconnect()
    left.stop()
    assert a.stop() == 0, a.log()  # graceful: scale-down moves its messages, the session record too, to b
    assert "scale-down complete" in a.log()
    a = start_node(tmp_path, "node-0", [b])
    wait_until(lambda: cluster_view(b)["remote_bindings"] >= 1, what="b to see a again")
    left = start_gateway(tmp_path, a, "mqtt", name="mqtt-a2", **pinned)
    again = Paho(left.port, client_id, clean=False)
    assert again.connect(expiry=300)[0] is True
    publisher = Paho(left.port, f"p-{_id()}")
    publisher.connect()
    publisher.publish("moved/1", b"still subscribed", 1)
    assert [m.payload for m in again.receive(1)] == [b"still subscribed"]
    for paho in (again, publisher):
        paho.disconnect()
    left.stop()
    for node in (a, b):
        assert node.stop() == 0, node.log()
