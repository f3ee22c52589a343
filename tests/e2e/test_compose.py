"""`docker compose up` of deploy/compose.yaml on a real Docker engine: real clients of all three protocols
through the load balancers, across protocols and cluster nodes, gateway replicas scaled up and down under
traffic with nothing acknowledged lost, and durable messages kept across a restart of the whole stack."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt.client as paho
import pytest
import stomp
from proton import Message
from proton.utils import BlockingConnection
from stomp.utils import Frame
from tests.e2e.stack import PASSWORD, USER, Stack, build_image, docker_available
from tests.jepsen.checker import check

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
WAIT = 30.0
GATEWAYS = ("gateway-stomp", "gateway-mqtt", "gateway-amqp")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    build_image()
    stack = Stack(f"tmqe2e{os.getpid()}")
    try:
        stack.compose("up", "-d")
        stack.wait_healthy("core-1", "core-2", "core-3", *GATEWAYS)
        yield stack
    finally:
        stack.down(volumes=True)


class StompListener(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.bodies: list[str] = []
        self.changed = threading.Condition()

    def on_message(self, frame: Frame) -> None:
        with self.changed:
            self.bodies.append(frame.body)
            self.changed.notify_all()

    def wait_for(self, count: int) -> list[str]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.bodies) >= count, WAIT), self.bodies
        return self.bodies


def text(message: Message) -> str:
    """An AMQP message's body as text: a STOMP message without content-type arrives as binary data (a view
    into the message, so the message must stay referenced while it is read)."""
    body = message.body
    return body if isinstance(body, str) else bytes(body).decode()


def retrying(connect: Callable[[], Any]) -> Any:
    """A first connection through a load balancer whose health checks may not have passed yet."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return connect()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def stomp_client(stack: Stack) -> tuple[stomp.Connection12, StompListener]:
    def connect() -> tuple[stomp.Connection12, StompListener]:
        conn = stomp.Connection12([("127.0.0.1", stack.ports["STOMP"])])
        listener = StompListener()
        conn.set_listener("e2e", listener)
        conn.connect(username=USER, passcode=PASSWORD, wait=True)
        return conn, listener

    return retrying(connect)  # type: ignore[no-any-return]


def amqp_client(stack: Stack) -> BlockingConnection:
    return retrying(
        lambda: BlockingConnection(
            f"amqp://127.0.0.1:{stack.ports['AMQP']}", timeout=WAIT, user=USER, password=PASSWORD, allowed_mechs="PLAIN"
        )
    )


class MqttClient:
    """A paho client that records what it receives and reconnects by itself (through the load balancer)."""

    def __init__(self, stack: Stack, client_id: str, *, clean: bool = True) -> None:
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean, protocol=paho.MQTTv311
        )
        self.client.username_pw_set(USER, PASSWORD)
        self.client.reconnect_delay_set(0.2, 2)
        self.received: list[tuple[bytes, bool]] = []  # (payload, dup flag)
        self.connected = threading.Event()
        self.client.on_message = lambda _c, _u, m: self.received.append((m.payload, bool(m.dup)))
        self.client.on_connect = lambda *_: self.connected.set()
        self.client.on_disconnect = lambda *_: self.connected.clear()
        retrying(lambda: self.client.connect("127.0.0.1", stack.ports["MQTT"], keepalive=10))
        self.client.loop_start()
        assert self.connected.wait(WAIT), "no CONNACK"

    def subscribe(self, topic: str, qos: int) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *_: done.set()
        self.client.subscribe(topic, qos)
        assert done.wait(WAIT), "no SUBACK"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_every_protocol_through_its_load_balancer_and_across_protocols(stack: Stack) -> None:
    run = uuid.uuid4().hex[:8]
    mqtt = MqttClient(stack, f"e2e-sub-{run}")
    mqtt.subscribe(f"e2e/{run}/news", 1)
    stomp_conn, listener = stomp_client(stack)
    stomp_conn.subscribe(f"/queue/e2e.{run}.from-amqp", id="1", ack="auto")
    amqp = amqp_client(stack)
    try:
        # STOMP -> AMQP (anycast queue), AMQP -> STOMP, and both -> MQTT (multicast topic)
        stomp_conn.send(f"/queue/e2e.{run}.from-stomp", "stomp to amqp", headers={"receipt": "r1"})
        amqp.create_sender(f"queue://e2e.{run}.from-amqp").send(Message(body="amqp to stomp"))
        receiver = amqp.create_receiver(f"e2e.{run}.from-stomp")
        assert text(receiver.receive(timeout=WAIT)) == "stomp to amqp"
        receiver.accept()
        assert listener.wait_for(1) == ["amqp to stomp"]
        stomp_conn.send(f"/topic/e2e.{run}.news", "stomp to mqtt")
        amqp.create_sender(f"topic://e2e.{run}.news").send(Message(body="amqp to mqtt"))
        deadline = time.monotonic() + WAIT
        while len(mqtt.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(payload for payload, _ in mqtt.received) == [b"amqp to mqtt", b"stomp to mqtt"]
    finally:
        amqp.close()
        stomp_conn.disconnect()
        mqtt.close()


def values(subscriber: MqttClient) -> list[int]:
    """What the subscriber received of the counted publishes (late probes left out)."""
    return [int(payload) for payload, _ in subscriber.received if payload != b"probe"]


def test_mqtt_gateways_scale_up_and_down_under_traffic_losing_nothing(stack: Stack) -> None:
    run = uuid.uuid4().hex[:8]
    topic = f"e2e/{run}/scale"
    subscriber = MqttClient(stack, f"e2e-scale-sub-{run}", clean=False)  # its session outlives its replica
    subscriber.subscribe(topic, 1)
    publisher = MqttClient(stack, f"e2e-scale-pub-{run}")
    # The subscription lives on one core node; the publisher's link may be on another, which routes to it
    # once the cluster has spread the new binding: counting starts when a probe went through.
    deadline = time.monotonic() + WAIT
    while not subscriber.received:
        assert time.monotonic() < deadline, "no probe reached the subscriber"
        publisher.client.publish(topic, b"probe", qos=1).wait_for_publish(5)
        time.sleep(0.2)
    subscriber.received.clear()
    attempted: list[int] = []
    acknowledged: list[int] = []
    stop = threading.Event()

    def publish() -> None:
        value = 0
        while not stop.is_set():
            value += 1
            attempted.append(value)
            info = publisher.client.publish(topic, str(value).encode(), qos=1)
            try:
                info.wait_for_publish(5)
            except (RuntimeError, ValueError):  # not sent: the connection was down
                publisher.connected.wait(WAIT)
                continue
            if info.is_published():
                acknowledged.append(value)

    producer = threading.Thread(target=publish, daemon=True)
    producer.start()
    try:
        stack.compose("up", "-d", "--no-recreate", "--scale", "gateway-mqtt=3", "gateway-mqtt")
        stack.wait_healthy("gateway-mqtt")
        assert len(stack.containers("gateway-mqtt")) == 3
        before = len(acknowledged)
        deadline = time.monotonic() + WAIT
        while len(acknowledged) < before + 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        stack.compose("up", "-d", "--no-recreate", "--scale", "gateway-mqtt=1", "gateway-mqtt")
        assert len(stack.containers("gateway-mqtt")) == 1
        before = len(acknowledged)
        deadline = time.monotonic() + WAIT
        while len(acknowledged) < before + 50 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        producer.join(WAIT)
    assert len(acknowledged) > 100, "the publisher could not publish through the scaling"
    deadline = time.monotonic() + 2 * WAIT
    while not set(acknowledged) <= set(values(subscriber)) and time.monotonic() < deadline:
        time.sleep(0.2)
    verdict = check(attempted, acknowledged, [], values(subscriber))
    publisher.close()
    subscriber.close()
    assert verdict.ok, f"{verdict.report()}\nthe stack's warnings:\n{stack.warnings()}"


def test_durable_messages_survive_a_restart_of_the_whole_stack(stack: Stack) -> None:
    run = uuid.uuid4().hex[:8]
    conn, _ = stomp_client(stack)
    receipts = [f"r{n}" for n in range(20)]
    for n, receipt in enumerate(receipts):
        conn.send(f"/queue/e2e.{run}.durable", f"kept {n}", headers={"persistent": "true", "receipt": receipt})
    conn.disconnect(receipt="bye")  # every SEND's receipt came before the DISCONNECT's
    stack.compose("stop", "--timeout", "45")
    stack.compose("up", "-d")
    stack.wait_healthy("core-1", "core-2", "core-3", *GATEWAYS)
    amqp = amqp_client(stack)
    try:
        receiver = amqp.create_receiver(f"e2e.{run}.durable")
        bodies = set()
        for _ in receipts:
            bodies.add(text(receiver.receive(timeout=WAIT)))
            receiver.accept()
    finally:
        amqp.close()
    assert bodies == {f"kept {n}" for n in range(20)}
