"""The AMQP 1.0 gateway as a real process between python-qpid-proton's own clients and a real core."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.request import urlopen

import pytest
import stomp
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from proton import Data, Delivery, Endpoint, Event, Message, Receiver, Terminus, Timeout, symbol, ulong
from proton.handlers import MessagingHandler, TransactionalClientHandler
from proton.reactor import AtMostOnce, Container, Copy, DurableSubscription, ReceiverOption, Selector, Transaction
from proton.utils import BlockingConnection, BlockingReceiver, LinkDetached, SendException
from tests.conftest import CoreProcess, GatewayProcess, module_amqp_gateway, module_core, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Paho

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import RoutingType, new_message

pytestmark = pytest.mark.integration

WAIT = 10.0

# One core and one AMQP gateway for the module: each test keeps to queues, topics and container ids of its own.
core = module_core
amqp_gateway = module_amqp_gateway


def url(gateway: GatewayProcess) -> str:
    return f"amqp://127.0.0.1:{gateway.port}"


def connect(gateway: GatewayProcess, **kwargs: object) -> BlockingConnection:
    return BlockingConnection(url(gateway), timeout=WAIT, **kwargs)


class TopicCapability(ReceiverOption):
    """A source with the ``topic`` capability, as Qpid JMS attaches to a topic."""

    def apply(self, receiver: Receiver) -> None:
        receiver.source.capabilities.put_object(symbol("topic"))


def unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def test_hello_world(amqp_gateway: GatewayProcess) -> None:
    queue = unique("hello")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        sender.send(Message(body="Hello World!"))
        receiver = conn.create_receiver(queue)
        message = receiver.receive(timeout=WAIT)
        receiver.accept()
        assert message.body == "Hello World!"
    finally:
        conn.close()


def test_messages_wait_in_the_queue_for_a_later_receiver(amqp_gateway: GatewayProcess) -> None:
    queue = unique("later")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        for i in range(20):
            sender.send(Message(body=f"m{i}", durable=True, properties={"n": i}))
        sender.close()
    finally:
        conn.close()
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(queue, credit=5)
        got = []
        for _ in range(20):
            message = receiver.receive(timeout=WAIT)
            got.append((message.body, message.properties["n"], message.durable))
            receiver.accept()
        assert got == [(f"m{i}", i, True) for i in range(20)]
    finally:
        conn.close()


def test_start_gateway_kind(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, "amqp", name="second")
    try:
        conn = connect(gateway)
        conn.close()
    finally:
        assert gateway.stop() == 0


def receive_all(receiver: BlockingReceiver, count: int) -> list[Message]:
    got = []
    for _ in range(count):
        got.append(receiver.receive(timeout=WAIT))
        receiver.accept()
    return got


def test_topic_copies_go_to_every_subscriber(amqp_gateway: GatewayProcess) -> None:
    topic = unique("news")
    conn = connect(amqp_gateway)
    try:
        first = conn.create_receiver(f"topic://{topic}")
        second = conn.create_receiver(topic, options=TopicCapability())
        sender = conn.create_sender(f"topic://{topic}")
        for i in range(3):
            sender.send(Message(body=f"n{i}"))
        assert [m.body for m in receive_all(first, 3)] == ["n0", "n1", "n2"]
        assert [m.body for m in receive_all(second, 3)] == ["n0", "n1", "n2"]
    finally:
        conn.close()


def test_selector_filters_what_a_receiver_gets(amqp_gateway: GatewayProcess) -> None:
    queue = unique("sel")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        for colour in ("red", "blue", "red"):
            sender.send(Message(body=colour, properties={"colour": colour}))
        receiver = conn.create_receiver(queue, options=Selector("colour = 'blue'"))
        assert [m.body for m in receive_all(receiver, 1)] == ["blue"]
        echoed = receiver.link.remote_source.filter  # echoed by the gateway: it applies the selector
        echoed.rewind()
        assert echoed.next()
        assert list(echoed.get_object()) == [symbol("selector")]
        reds = conn.create_receiver(queue, name="reds")
        assert [m.body for m in receive_all(reds, 2)] == ["red", "red"]
    finally:
        conn.close()


def test_a_fully_qualified_queue_of_a_topic_is_made_on_that_topic_and_its_receiver_s_selector_applies(
    amqp_gateway: GatewayProcess,
) -> None:
    """``topic::queue`` names a queue of a topic: a missing one is made on the topic (it was made on an address
    of its own name, and got nothing sent to the topic), and, not being a subscription of the link's own, its
    consumer applies the selector (with a durable terminus the selector was dropped)."""
    topic = unique("fq")
    conn = connect(amqp_gateway)
    try:
        blues = conn.create_receiver(
            f"topic://{topic}::{topic}-archive",
            name="blues",
            options=[DurableSubscription(), Selector("colour = 'blue'")],
        )
        sender = conn.create_sender(f"topic://{topic}")
        for colour in ("red", "blue", "red", "blue"):
            sender.send(Message(body=colour, properties={"colour": colour}))
        assert [m.body for m in receive_all(blues, 2)] == ["blue", "blue"]
        everything = conn.create_receiver(f"topic://{topic}::{topic}-archive", name="everything")
        assert [m.body for m in receive_all(everything, 2)] == ["red", "red"]  # the queue kept what blues left
    finally:
        conn.close()


def test_request_reply_through_a_dynamic_reply_queue(amqp_gateway: GatewayProcess) -> None:
    service = unique("service")
    server = connect(amqp_gateway)
    client = connect(amqp_gateway)
    try:
        requests = server.create_receiver(service)
        replies = client.create_receiver(None, dynamic=True)
        reply_to = replies.link.remote_source.address
        assert reply_to is not None
        assert reply_to.startswith("tmp.")
        client.create_sender(service).send(Message(body="ping", reply_to=reply_to, correlation_id="c-1"))
        request = requests.receive(timeout=WAIT)
        requests.accept()
        server.create_sender(None).send(
            Message(address=request.reply_to, body=request.body.upper(), correlation_id=request.correlation_id)
        )
        reply = replies.receive(timeout=WAIT)
        replies.accept()
        assert (reply.body, reply.correlation_id) == ("PING", "c-1")
    finally:
        client.close()
        server.close()


def test_message_sections_survive_the_core(amqp_gateway: GatewayProcess) -> None:
    queue = unique("sections")
    sent = Message(
        body={"k": [1, 2.5, "x"]},
        id=uuid.UUID(int=7),
        subject="subj",
        content_type="application/x",
        priority=7,
        ttl=60.0,
        durable=True,
        correlation_id=42,
        group_id="g",
        reply_to="replies",
        properties={"i": 1, "f": 2.5, "b": True, "s": "str", "bin": b"\x00\x01"},
        annotations={symbol("x-opt-trace"): "t"},
    )
    conn = connect(amqp_gateway)
    try:
        conn.create_sender(queue).send(sent)
        got = receive_all(conn.create_receiver(queue), 1)[0]
    finally:
        conn.close()
    assert got.body == sent.body
    assert (got.id, got.subject, got.content_type, got.correlation_id, got.group_id, got.reply_to) == (
        sent.id,
        sent.subject,
        sent.content_type,
        sent.correlation_id,
        sent.group_id,
        sent.reply_to,
    )
    assert (got.priority, got.durable) == (7, True)
    assert 0 < got.ttl <= 60.0
    assert got.properties == sent.properties
    assert got.annotations == sent.annotations


def test_released_and_modified_messages_come_back_and_rejected_go_to_the_dead_letters(
    amqp_gateway: GatewayProcess,
) -> None:
    queue = unique("dispositions")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        sender.send(Message(body="a"))
        receiver = conn.create_receiver(queue, credit=1)
        first = receiver.receive(timeout=WAIT)
        assert first.delivery_count == 0
        receiver.release(delivered=False)  # released: not counted
        again = receiver.receive(timeout=WAIT)
        assert (again.body, again.delivery_count) == ("a", 0)
        receiver.release(delivered=True)  # modified without delivery-failed: not counted (as in Artemis)
        third = receiver.receive(timeout=WAIT)
        assert (third.body, third.delivery_count) == ("a", 0)
        delivery = receiver.fetcher.unsettled.popleft()
        delivery.local.failed = True  # modified, delivery-failed: counted
        delivery.update(Delivery.MODIFIED)
        delivery.settle()
        fourth = receiver.receive(timeout=WAIT)
        assert (fourth.body, fourth.delivery_count) == ("a", 1)
        receiver.reject()
        dead = conn.create_receiver("DLQ", options=Selector(f"_AMQ_ORIG_QUEUE = '{queue}'"))
        message = dead.receive(timeout=WAIT)
        dead.accept()
        assert message.body == "a"
        assert message.annotations[symbol("x-opt-ORIG-QUEUE")] == queue
    finally:
        conn.close()


def test_anonymous_relay_sends_each_message_to_its_own_address(amqp_gateway: GatewayProcess) -> None:
    first, second = unique("relay"), unique("relay")
    conn = connect(amqp_gateway)
    try:
        relay = conn.create_sender(None)
        relay.send(Message(address=first, body="1"))
        relay.send(Message(address=f"queue://{second}", body="2"))
        assert receive_all(conn.create_receiver(first), 1)[0].body == "1"
        assert receive_all(conn.create_receiver(second), 1)[0].body == "2"
        with pytest.raises(SendException):  # no address at all: rejected
            relay.send(Message(body="nowhere"))
    finally:
        conn.close()


def test_a_large_message_crosses_in_many_frames(amqp_gateway: GatewayProcess) -> None:
    queue = unique("large")
    body = bytes(range(256)) * (5 * 4096)  # 5 MiB
    conn = connect(amqp_gateway)
    try:
        conn.create_sender(queue).send(Message(body=body, durable=True))
        got = receive_all(conn.create_receiver(queue), 1)[0]
    finally:
        conn.close()
    assert got.body == body


def test_browsing_shows_messages_without_taking_them(amqp_gateway: GatewayProcess) -> None:
    queue = unique("browse")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        for i in range(3):
            sender.send(Message(body=i))
        browser = conn.create_receiver(queue, options=Copy())
        assert [browser.receive(timeout=WAIT).body for _ in range(3)] == [0, 1, 2]
        assert [m.body for m in receive_all(conn.create_receiver(queue, name="taker"), 3)] == [0, 1, 2]
    finally:
        conn.close()


def test_durable_subscription_keeps_messages_while_its_client_is_away(amqp_gateway: GatewayProcess) -> None:
    topic, container = unique("events"), unique("app")
    conn = connect(amqp_gateway, container_id=container)
    subscription = conn.create_receiver(f"topic://{topic}", name="sub", options=DurableSubscription())
    subscription.detach()  # detached, not closed: the subscription stays
    conn.close()
    producer = connect(amqp_gateway)
    try:
        sender = producer.create_sender(f"topic://{topic}")
        for i in range(3):
            sender.send(Message(body=i, durable=True))
    finally:
        producer.close()
    conn = connect(amqp_gateway, container_id=container)
    try:
        subscription = conn.create_receiver(f"topic://{topic}", name="sub", options=DurableSubscription())
        assert [m.body for m in receive_all(subscription, 3)] == [0, 1, 2]
        subscription.close()  # closed: the subscription ends
    finally:
        conn.close()
    conn = connect(amqp_gateway, container_id=container)
    try:
        producer = connect(amqp_gateway)
        producer.create_sender(f"topic://{topic}").send(Message(body="after"))
        producer.close()
        subscription = conn.create_receiver(f"topic://{topic}", name="sub", options=DurableSubscription())
        with pytest.raises(Timeout):
            subscription.receive(timeout=0.5)
    finally:
        conn.close()


DOOMED_CLIENT = """
import sys, time
from proton.utils import BlockingConnection
conn = BlockingConnection(sys.argv[1], timeout=10)
receiver = conn.create_receiver(sys.argv[2], credit=10)
print(receiver.receive(timeout=10).body, flush=True)
time.sleep(60)
"""


def test_unsettled_messages_return_when_a_connection_dies(amqp_gateway: GatewayProcess) -> None:
    queue = unique("stale")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        for i in range(5):
            sender.send(Message(body=i))
    finally:
        conn.close()
    # A client in its own process takes the messages without settling them, and is killed: its socket goes
    # away without CLOSE or DETACH (proton's own pitfall: a stale link with credit swallowing messages).
    doomed = subprocess.Popen(
        [sys.executable, "-c", DOOMED_CLIENT, url(amqp_gateway), queue], stdout=subprocess.PIPE, text=True
    )
    try:
        assert doomed.stdout is not None
        assert doomed.stdout.readline().strip() == "0"
    finally:
        doomed.kill()
        doomed.wait()
        assert doomed.stdout is not None
        doomed.stdout.close()
    conn = connect(amqp_gateway)
    try:
        assert sorted(m.body for m in receive_all(conn.create_receiver(queue), 5)) == [0, 1, 2, 3, 4]
        with pytest.raises(Timeout):
            conn.create_receiver(queue, name="more").receive(timeout=0.3)
    finally:
        conn.close()


class TransactionalSender(TransactionalClientHandler):
    """Sends ``count`` messages in one transaction per entry of ``outcomes`` (True = commit, False = abort),
    the way proton's tx_send example does; then receives and accepts ``take`` messages in a transaction that
    is committed."""

    def __init__(self, address: str, queue: str, outcomes: list[bool], count: int, take: int) -> None:
        super().__init__()
        self.address = address
        self.queue = queue
        self.outcomes = outcomes
        self.count = count
        self.take = take
        self.events: list[str] = []
        self.received: list[object] = []
        self.transaction: Transaction | None = None

    def on_start(self, event: Event) -> None:
        self.conn = event.container.connect(self.address)
        self.sender = event.container.create_sender(self.conn, self.queue)
        event.container.declare_transaction(self.conn, handler=self)

    def on_transaction_declared(self, event: Event) -> None:
        self.transaction = event.transaction
        if not self.outcomes:  # the receiving transaction
            self.receiver = event.container.create_receiver(self.conn, self.queue)
            return
        for i in range(self.count):
            self.transaction.send(self.sender, Message(body=f"{len(self.outcomes)}-{i}", durable=True))
        if self.outcomes.pop(0):
            self.transaction.commit()
        else:
            self.transaction.abort()

    def on_message(self, event: Event) -> None:
        assert self.transaction is not None
        if len(self.received) == self.take:
            return  # prefetched beyond what this transaction takes: left unsettled, back to the queue at close
        self.received.append(event.message.body)
        self.accept(event.delivery, self.transaction)
        if len(self.received) == self.take:
            self.transaction.commit()

    def on_transaction_committed(self, event: Event) -> None:
        self.events.append("committed")
        self._next(event)

    def on_transaction_aborted(self, event: Event) -> None:
        self.events.append("aborted")
        self._next(event)

    def _next(self, event: Event) -> None:
        if self.outcomes or (self.take and not self.received):
            event.container.declare_transaction(self.conn, handler=self)
        else:
            self.conn.close()


def test_local_transactions_commit_or_roll_back_sends_and_acks(amqp_gateway: GatewayProcess) -> None:
    queue = unique("tx")
    handler = TransactionalSender(url(amqp_gateway), queue, [False, True, False], count=3, take=2)
    Container(handler).run()
    assert handler.events == ["aborted", "committed", "aborted", "committed"]
    assert handler.received == ["2-0", "2-1"]  # only the committed transaction's messages exist
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(queue)
        assert [m.body for m in receive_all(receiver, 1)] == ["2-2"]  # the two acked in a transaction are gone
        with pytest.raises(Timeout):
            receiver.receive(timeout=0.3)
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------- cross-protocol
class StompCollector(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.frames: list[stomp.utils.Frame] = []
        self.receipts: set[str] = set()
        self.arrived = threading.Condition()

    def on_message(self, frame: stomp.utils.Frame) -> None:
        with self.arrived:
            self.frames.append(frame)
            self.arrived.notify_all()

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        with self.arrived:
            self.receipts.add(frame.headers["receipt-id"])
            self.arrived.notify_all()

    def wait_receipt(self, receipt: str) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: receipt in self.receipts, WAIT), self.receipts

    def wait(self, count: int) -> list[stomp.utils.Frame]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.frames) >= count, WAIT), self.frames
        return self.frames


def test_amqp_stomp_mqtt_and_the_link_client_interoperate(
    amqp_gateway: GatewayProcess, stomp_gateway: GatewayProcess, mqtt_gateway: GatewayProcess, core: CoreProcess
) -> None:
    topic = unique("mix").replace(".", "_")
    stomp_conn = stomp.Connection12([("127.0.0.1", stomp_gateway.port)], auto_decode=False)
    collector = StompCollector()
    stomp_conn.set_listener("c", collector)
    stomp_conn.connect(wait=True)
    stomp_conn.subscribe(f"/topic/a.{topic}", "1", ack="auto", headers={"receipt": "subscribed"})
    mqtt = Paho(mqtt_gateway.port, f"m-{topic}")
    mqtt.connect()
    mqtt.subscribe(f"a/{topic}", 1)
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(f"topic://a.{topic}")
        collector.wait_receipt("subscribed")  # stomp.py's subscribe does not wait for it
        # AMQP -> everyone: the body as bytes, application properties as headers and user properties
        conn.create_sender(f"topic://a.{topic}").send(
            Message(
                body=b"from amqp",
                inferred=True,
                properties={"region": "eu", "n": 7},
                durable=True,
                correlation_id="c-1",
                reply_to="/queue/replies",
                content_type="text/plain",
            )
        )
        frame = collector.wait(1)[0]
        assert frame.body == b"from amqp"
        assert (frame.headers["region"], frame.headers["n"], frame.headers["persistent"]) == ("eu", "7", "true")
        assert (frame.headers["correlation-id"], frame.headers["reply-to"]) == ("c-1", "/queue/replies")
        assert frame.headers["content-type"] == "text/plain"
        assert not any(name.startswith("$enc.") for name in frame.headers)
        [published] = mqtt.receive(1)
        assert published.payload == b"from amqp"
        assert ("region", "eu") in published.properties.UserProperty
        assert receive_all(receiver, 1)[0].body == b"from amqp"
        # STOMP -> AMQP
        stomp_conn.send(
            f"/topic/a.{topic}",
            b"from stomp",
            headers={"region": "us", "correlation-id": "c-2", "reply-to": "/queue/r"},
        )
        got = receive_all(receiver, 1)[0]
        assert (got.body, got.properties["region"], got.correlation_id, got.reply_to) == (
            b"from stomp",
            "us",
            "c-2",
            "/queue/r",
        )
        # MQTT -> AMQP: user properties as application properties, correlation data as the correlation id
        props = PahoProperties(PacketTypes.PUBLISH)
        props.UserProperty = [("k", "v")]
        props.CorrelationData = b"corr"
        props.ResponseTopic = "answers/here"
        mqtt.publish(f"a/{topic}", b"from mqtt", 1, properties=props)
        got = receive_all(receiver, 1)[0]
        assert (got.body, got.properties["k"], got.durable) == (b"from mqtt", "v", True)
        assert (got.correlation_id, got.reply_to) == (b"corr", "answers/here")

        # the link client -> AMQP: typed properties keep their types
        async def via_link() -> None:
            async with LinkClient("127.0.0.1", core.link_port) as link:
                await link.publish(
                    new_message(
                        f"a.{topic}",
                        b"from link",
                        routing=RoutingType.MULTICAST,
                        properties={"n": 1, "f": 0.5, "flag": True},
                    )
                )

        asyncio.run(via_link())
        got = receive_all(receiver, 1)[0]
        assert (got.body, got.properties) == (b"from link", {"n": 1, "f": 0.5, "flag": True})
    finally:
        conn.close()
        mqtt.disconnect()
        stomp_conn.disconnect()


# ---------------------------------------------------------------------------------------------- statelessness
def test_durable_subscriptions_and_unsettled_messages_outlive_a_killed_gateway(
    amqp_gateway: GatewayProcess, tmp_path: Path, core: CoreProcess
) -> None:
    topic, container = unique("orders"), unique("billing")
    victim = start_gateway(tmp_path, core, "amqp", name="victim")
    try:
        conn = connect(victim, container_id=container)
        subscription = conn.create_receiver(f"topic://{topic}", name="sub", credit=10, options=DurableSubscription())
        producer = connect(amqp_gateway)
        sender = producer.create_sender(f"topic://{topic}")
        for i in range(5):
            sender.send(Message(body=i, durable=True))
        producer.close()
        assert [subscription.receive(timeout=WAIT).body for _ in range(2)] == [0, 1]  # taken, never settled
        victim.process.kill()  # the gateway dies: the client's socket is cut, nothing is said to anyone
        victim.process.wait()
    finally:
        victim.stop()
    conn = connect(amqp_gateway, container_id=container)  # the client reconnects through another replica
    try:
        subscription = conn.create_receiver(f"topic://{topic}", name="sub", options=DurableSubscription())
        got = receive_all(subscription, 5)
        assert [m.body for m in got] == [0, 1, 2, 3, 4]
        assert [m.delivery_count > 0 for m in got[:2]] == [True, True]  # redelivered, and flagged as such
    finally:
        conn.close()


def test_a_heartbeating_client_stays_connected_long_past_the_idle_timeouts(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, "amqp", name="heartbeats", TRIDENTMQ_AMQP_AMQP_IDLE_TIMEOUT_MS="1000")
    queue = unique("idle")
    try:
        conn = BlockingConnection(url(gateway), timeout=WAIT, heartbeat=1)
        try:
            receiver = conn.create_receiver(queue)
            # Idle but heartbeating both ways for 8 s: four times the 2 s of silence after which the gateway
            # closes a connection, eight times the client's own 1 s idle timeout.
            for _ in range(4):
                with pytest.raises(Timeout):
                    receiver.receive(timeout=2)
            conn.create_sender(queue).send(Message(body="still here"))
            assert receive_all(receiver, 1)[0].body == "still here"
        finally:
            conn.close()
    finally:
        stop_cleanly(gateway)


def test_health_readiness_and_metrics(amqp_gateway: GatewayProcess) -> None:
    base = f"http://127.0.0.1:{amqp_gateway.ports['http']}"
    with urlopen(f"{base}/healthz", timeout=WAIT) as reply:
        assert json.load(reply) == {"status": "ok"}
    with urlopen(f"{base}/readyz", timeout=WAIT) as reply:
        assert json.load(reply)["amqp"] == amqp_gateway.port

    def metrics() -> dict[str, str]:
        with urlopen(f"{base}/metrics", timeout=WAIT) as reply:
            text = reply.read().decode()
        return dict(line.split(" ") for line in text.splitlines() if line and not line.startswith("#"))

    conn = connect(amqp_gateway)
    try:
        queue = unique("metrics")
        conn.create_sender(queue).send(Message(body="x"))
        receive_all(conn.create_receiver(queue), 1)
        # Ours is the one connection once those of the module's earlier tests are gone (each closes its own).
        deadline = time.monotonic() + WAIT
        while (values := metrics())["tridentmq_amqp_connections"] != "1" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        conn.close()
    assert values["tridentmq_amqp_connections"] == "1"
    assert int(values["tridentmq_amqp_messages_published_total"]) >= 1
    assert int(values["tridentmq_amqp_messages_delivered_total"]) >= 1


def test_a_message_the_core_could_not_take_is_rejected_and_the_connection_goes_on(amqp_gateway: GatewayProcess) -> None:
    queue = unique("props")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        with pytest.raises(SendException):  # more properties than a core message may carry
            sender.send(Message(body="x", properties={f"p{i}": i for i in range(300)}))
        relay = conn.create_sender(None)
        with pytest.raises(SendException):  # a relayed message to one queue of an address
            relay.send(Message(address=f"{queue}::{queue}", body="x"))
        with pytest.raises(SendException):  # a property the gateway keeps for itself: nobody may forge it
            sender.send(Message(body="x", properties={"$enc.amqp.footer": "x"}))
        with pytest.raises(SendException):  # a delay no 64-bit clock can hold
            sender.send(Message(body="x", annotations={symbol("x-opt-delivery-delay"): ulong(2**64 - 1)}))
        sender.send(Message(body="fine"))
        assert receive_all(conn.create_receiver(queue), 1)[0].body == "fine"
    finally:
        conn.close()


def test_a_topic_subscription_ends_with_its_link(amqp_gateway: GatewayProcess, core: CoreProcess) -> None:
    topic = unique("ticks")
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(f"topic://{topic}")
        conn.create_sender(f"topic://{topic}").send(Message(body="t"))
        assert receive_all(receiver, 1)[0].body == "t"
        receiver.close()
        with urlopen(f"{core.management_url}/api/queues", timeout=WAIT) as reply:
            assert [q["name"] for q in json.load(reply) if q["address"] == topic] == []
    finally:
        conn.close()


@pytest.mark.parametrize("presettled", [False, True])
def test_a_message_that_expires_while_waiting_for_the_client_s_credit_is_not_delivered(
    amqp_gateway: GatewayProcess, core: CoreProcess, presettled: bool
) -> None:
    """The gateway fetches ahead of its client's credit; a message that expired there went out with its ttl
    spent, and never reached the expiry address (the queue counted it acknowledged)."""
    queue = unique("expiring")
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(queue, credit=0, options=AtMostOnce() if presettled else None)
        sender = conn.create_sender(queue)
        sender.send(Message(body="short", durable=True, ttl=0.5))
        sender.send(Message(body="long", durable=True))
        time.sleep(1.5)
        receiver.flow(5)
        got = [receiver.receive(timeout=WAIT).body]
        if not presettled:
            receiver.accept()
        with pytest.raises(Timeout):
            got.append(receiver.receive(timeout=1.0).body)
        assert got == ["long"]

        def counters() -> dict[str, object]:
            with urlopen(f"{core.management_url}/api/queues/{queue}", timeout=WAIT) as reply:
                return dict(json.load(reply))

        deadline = time.monotonic() + WAIT
        while counters().get("expired") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert counters()["expired"] == 1
    finally:
        conn.close()


def test_presettled_messages_all_arrive_when_the_producer_leaves_at_once(amqp_gateway: GatewayProcess) -> None:
    """At most once, but a healthy broker loses nothing: what a pre-settled producer sent before its CLOSE is
    published even when the gateway is still working through it as the connection ends."""
    queue, count = unique("presettled"), 3000
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue, options=AtMostOnce())
        for i in range(count):  # proton's client queues a pre-settled message without credit, and drops it at close
            conn.wait(lambda: sender.link.credit > 0, msg="credit")
            sender.send(Message(body=i, durable=True))
    finally:
        conn.close()
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(queue, credit=500, options=AtMostOnce())
        assert sorted(receiver.receive(timeout=WAIT).body for _ in range(count)) == list(range(count))
    finally:
        conn.close()


class SharedSubscription(ReceiverOption):
    """A source as Qpid JMS attaches it for a JMS 2.0 shared subscription (durable or not)."""

    def __init__(self, *, durable: bool, global_: bool = False) -> None:
        self.durable = durable
        self.global_ = global_

    def apply(self, receiver: Receiver) -> None:
        if self.durable:
            DurableSubscription().apply(receiver)
        capabilities = receiver.source.capabilities
        capabilities.put_array(described=False, element_type=Data.SYMBOL)
        capabilities.enter()
        for name in ("topic", "shared", *(("global",) if self.global_ else ())):
            capabilities.put_symbol(symbol(name))
        capabilities.exit()


def take_all(*receivers: BlockingReceiver) -> list[object]:
    """The bodies every receiver gets until it has had nothing for half a second (each accepted)."""
    bodies = []
    for receiver in receivers:
        while True:
            try:
                bodies.append(receiver.receive(timeout=0.5).body)
            except Timeout:
                break
            receiver.accept()
    return bodies


def queue_names(core: CoreProcess, address: str) -> list[str]:
    with urlopen(f"{core.management_url}/api/queues", timeout=WAIT) as reply:
        return [q["name"] for q in json.load(reply) if q["address"] == address]


class NullSource(ReceiverOption):
    """No source at all, as Qpid JMS attaches to find a durable subscription by its link name (to unsubscribe)."""

    def apply(self, receiver: Receiver) -> None:
        receiver.source.type = Terminus.UNSPECIFIED


@pytest.mark.parametrize("client_id", [True, False])
def test_a_null_source_finds_the_subscription_its_link_name_names_and_closing_the_link_ends_it(
    amqp_gateway: GatewayProcess, core: CoreProcess, client_id: bool
) -> None:
    # Qpid JMS's Session.unsubscribe: attach <name> (<name>|global without a client id) with a null source,
    # expect the subscription's source back, and close the link.
    topic, container = unique("unsubscribe"), unique("jms")
    name, queue = ("audit", f"{container}.audit") if client_id else (f"{topic}-sub|global", f"{topic}-sub")
    conn = connect(amqp_gateway, container_id=container)
    try:
        option = DurableSubscription() if client_id else SharedSubscription(durable=True, global_=True)
        conn.create_receiver(f"topic://{topic}", name=name, options=option).detach()
        conn.create_sender(f"topic://{topic}").send(Message(body="kept"))
        assert queue_names(core, topic) == [queue]
        lookup = conn.create_receiver(None, name=name, options=NullSource())
        source = lookup.link.remote_source
        assert (source.address, source.expiry_policy) == (topic, Terminus.EXPIRE_NEVER)
        lookup.close()
        assert queue_names(core, topic) == []
        with pytest.raises(LinkDetached, match="amqp:not-found"):  # JMS: InvalidDestinationException
            conn.create_receiver(None, name=name, options=NullSource())
    finally:
        conn.close()


def test_a_shared_durable_subscription_spreads_messages_and_ends_with_its_last_consumer(
    amqp_gateway: GatewayProcess, core: CoreProcess
) -> None:
    topic, container = unique("shared"), unique("app")
    first = connect(amqp_gateway, container_id=container)
    second = connect(amqp_gateway, container_id=container)
    try:
        option = SharedSubscription(durable=True)
        one = first.create_receiver(f"topic://{topic}", name="orders", options=option)
        two = second.create_receiver(f"topic://{topic}", name="orders", options=option)
        also = first.create_receiver(f"topic://{topic}", name="orders|2", options=option)  # Qpid JMS' second link
        assert queue_names(core, topic) == [f"{container}.orders"]
        sender = first.create_sender(f"topic://{topic}")
        for i in range(30):
            sender.send(Message(body=i, durable=True))
        assert sorted(take_all(one, two, also)) == list(range(30))  # each message once, across the three consumers
        one.close()
        also.close()
        assert queue_names(core, topic) == [f"{container}.orders"]  # another consumer still uses it
        two.close()  # the last one: the JMS unsubscribe
        assert queue_names(core, topic) == []
    finally:
        first.close()
        second.close()


def test_a_global_shared_subscription_is_shared_across_client_ids(
    amqp_gateway: GatewayProcess, core: CoreProcess
) -> None:
    topic = unique("shared")
    first, second = connect(amqp_gateway), connect(amqp_gateway)  # two different container ids
    try:
        option = SharedSubscription(durable=False, global_=True)
        one = first.create_receiver(f"topic://{topic}", name="feed|volatile1", options=option)
        two = second.create_receiver(f"topic://{topic}", name="feed|volatile1", options=option)
        assert queue_names(core, topic) == ["feed"]
        sender = first.create_sender(f"topic://{topic}")
        for i in range(10):
            sender.send(Message(body=i))
        assert sorted(take_all(one, two)) == list(range(10))
    finally:
        first.close()
        second.close()
    deadline = time.monotonic() + WAIT  # a non-durable shared subscription goes soon after its last consumer
    while queue_names(core, topic) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert queue_names(core, topic) == []


def test_drain_sends_what_is_there_then_uses_up_the_credit(amqp_gateway: GatewayProcess) -> None:
    queue = unique("drain")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        for i in range(3):
            sender.send(Message(body=i))
        receiver = conn.create_receiver(queue, credit=1)
        assert receiver.receive(timeout=WAIT).body == 0  # the gateway holds the other two now, waiting for credit
        receiver.accept()
        link = receiver.link
        link.drain(10)  # "send what you have, then tell me you are done"
        conn.wait(lambda: not link.draining() and link.credit == 0, msg="the drain to complete")
        assert [receiver.receive(timeout=WAIT).body for _ in range(2)] == [1, 2]
        receiver.accept()
    finally:
        conn.close()


class MaxMessageSize(ReceiverOption):
    """A receiver announcing the largest message its link takes (AMQP 1.0 2.7.3)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def apply(self, receiver: Receiver) -> None:
        receiver.max_message_size = self.size


def test_a_message_over_the_receiver_s_max_message_size_is_not_sent_to_it(amqp_gateway: GatewayProcess) -> None:
    queue = unique("mms")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        sender.send(Message(body=b"x" * 5000))
        sender.send(Message(body=b"small"))
        browser = conn.create_receiver(queue, name="small-browser", options=[Copy(), MaxMessageSize(2000)])
        assert bytes(browser.receive(timeout=WAIT).body) == b"small"  # a browser skips it: shown, not taken
        browser.close()
        everything = conn.create_receiver(queue, name="browser", options=Copy())
        assert [len(everything.receive(timeout=WAIT).body) for _ in range(2)] == [5000, 5]
        everything.close()
        receiver = conn.create_receiver(queue, options=MaxMessageSize(2000))
        message = receiver.receive(timeout=WAIT)  # the large one is never sent on this link: it goes dead
        receiver.accept()
        assert bytes(message.body) == b"small"
        assert receiver.link.state & Endpoint.REMOTE_ACTIVE
        dead = conn.create_receiver("DLQ", options=Selector(f"_AMQ_ORIG_QUEUE = '{queue}'"))
        message = dead.receive(timeout=WAIT)
        dead.accept()
        assert bytes(message.body) == b"x" * 5000
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------- event-driven API
class SimpleSend(MessagingHandler):
    """proton's simple_send example: sends ``total`` messages as credit allows, done when all are accepted."""

    def __init__(self, url: str, address: str, total: int) -> None:
        super().__init__()
        self.url, self.address, self.total = url, address, total
        self.sent = self.confirmed = 0

    def on_start(self, event: Event) -> None:
        event.container.create_sender(f"{self.url}/{self.address}")

    def on_sendable(self, event: Event) -> None:
        while event.sender.credit and self.sent < self.total:
            event.sender.send(Message(id=self.sent + 1, body={"sequence": self.sent + 1}, durable=True))
            self.sent += 1

    def on_accepted(self, event: Event) -> None:
        self.confirmed += 1
        if self.confirmed == self.total:
            event.connection.close()


class SimpleRecv(MessagingHandler):
    """proton's simple_recv example: receives ``total`` messages (auto-accepted), then closes."""

    def __init__(self, url: str, address: str, total: int) -> None:
        super().__init__()
        self.url, self.address, self.total = url, address, total
        self.received: list[object] = []

    def on_start(self, event: Event) -> None:
        event.container.create_receiver(f"{self.url}/{self.address}")

    def on_message(self, event: Event) -> None:
        self.received.append(event.message.body["sequence"])
        if len(self.received) == self.total:
            event.receiver.close()
            event.connection.close()


class UppercaseServer(MessagingHandler):
    """proton's server example: answers each request on its reply-to address, through the anonymous relay."""

    def __init__(self, url: str, address: str, requests: int) -> None:
        super().__init__()
        self.url, self.address, self.requests = url, address, requests

    def on_start(self, event: Event) -> None:
        self.conn = event.container.connect(self.url)
        event.container.create_receiver(self.conn, self.address)
        self.relay = event.container.create_sender(self.conn, None)

    def on_message(self, event: Event) -> None:
        request = event.message
        self.relay.send(
            Message(address=request.reply_to, body=str(request.body).upper(), correlation_id=request.correlation_id)
        )
        self.requests -= 1
        if not self.requests:
            self.conn.close()


class Client(MessagingHandler):
    """proton's client example: requests through a dynamic reply queue, one at a time."""

    def __init__(self, url: str, address: str, requests: list[str]) -> None:
        super().__init__()
        self.url, self.address, self.requests = url, address, list(requests)
        self.replies: list[tuple[object, object]] = []

    def on_start(self, event: Event) -> None:
        self.conn = event.container.connect(self.url)
        self.sender = event.container.create_sender(self.conn, self.address)
        self.receiver = event.container.create_receiver(self.conn, None, dynamic=True)

    def next_request(self) -> None:
        if self.receiver.remote_source.address:
            body = self.requests[len(self.replies)]
            self.sender.send(Message(reply_to=self.receiver.remote_source.address, body=body, correlation_id=body))

    def on_link_opened(self, event: Event) -> None:
        if event.receiver == self.receiver:
            self.next_request()

    def on_message(self, event: Event) -> None:
        self.replies.append((event.message.correlation_id, event.message.body))
        if len(self.replies) == len(self.requests):
            self.conn.close()
        else:
            self.next_request()


def test_protons_event_driven_examples(amqp_gateway: GatewayProcess) -> None:
    queue, service = unique("examples"), unique("uppercase")
    sender = SimpleSend(url(amqp_gateway), queue, 100)
    Container(sender).run()
    assert sender.confirmed == 100
    receiver = SimpleRecv(url(amqp_gateway), queue, 100)
    Container(receiver).run()
    assert receiver.received == list(range(1, 101))
    requests = ["Twas brillig", "and the slithy toves", "Did gire and gymble"]
    # One container each, as the examples run: a container's handlers get the events of all its connections.
    server = threading.Thread(
        target=Container(UppercaseServer(url(amqp_gateway), service, len(requests))).run, daemon=True
    )
    server.start()
    client = Client(url(amqp_gateway), service, requests)
    Container(client).run()
    server.join(WAIT)
    assert not server.is_alive()
    assert client.replies == [(r, r.upper()) for r in requests]
