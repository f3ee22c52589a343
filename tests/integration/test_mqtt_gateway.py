"""The MQTT gateway with real clients: paho-mqtt 3.1.1 and 5.0 over TCP and WebSocket, amqtt, STOMP and the
link client, through a real core; sessions resumed and taken over through a second gateway replica."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.request import Request, urlopen

import pytest
import stomp
from amqtt.client import MQTTClient
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from tests.conftest import CoreProcess, GatewayProcess, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Paho, Raw

from tridentmq_mqtt import convert
from tridentmq_mqtt.protocol.packets import V311, Connack, Disconnect, Puback, Publish, Subscribe, Subscription
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import RoutingType, new_message

VERSIONS = [pytest.param(4, id="3.1.1"), pytest.param(5, id="5.0")]
TRANSPORTS = [pytest.param(False, id="tcp"), pytest.param(True, id="websocket")]


def _id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def second_gateway(tmp_path: Path, core: CoreProcess) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path, core, "mqtt", name="gateway-mqtt-2")
    yield gateway
    stop_cleanly(gateway)


def _port(gateway: GatewayProcess, websocket: bool) -> int:
    return gateway.ports["websocket"] if websocket else gateway.port


@pytest.mark.parametrize("websocket", TRANSPORTS)
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_and_subscribe(mqtt_gateway: GatewayProcess, version: int, websocket: bool, qos: int) -> None:
    port = _port(mqtt_gateway, websocket)
    sub = Paho(port, f"sub-{_id()}", version=version, websocket=websocket)
    pub = Paho(port, f"pub-{_id()}", version=version, websocket=websocket)
    sub.connect()
    pub.connect()
    assert [code.value for code in sub.subscribe("sensors/+/temp", qos)] == [qos]
    for i in range(20):
        pub.publish(f"sensors/{i % 3}/temp", f"t{i}".encode(), qos)
    got = sub.receive(20)
    assert [m.payload for m in got] == [f"t{i}".encode() for i in range(20)]
    assert {m.qos for m in got} == {qos}
    assert [m.topic for m in got[:3]] == ["sensors/0/temp", "sensors/1/temp", "sensors/2/temp"]
    assert sub.nothing_more(0.2)
    pub.disconnect()
    sub.disconnect()


def test_wildcards_and_dollar_topics(mqtt_gateway: GatewayProcess) -> None:
    sub = Paho(mqtt_gateway.port, f"s-{_id()}")
    sub.connect()
    sub.subscribe("a/#", 1)
    sub.subscribe("#", 0)
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    pub.publish("a", b"parent", 1)  # a/# matches a
    pub.publish("$SYS/x", b"hidden", 1)  # no leading wildcard matches $ topics
    got = sub.receive(2)
    assert sorted((m.topic, m.payload) for m in got) == [("a", b"parent"), ("a", b"parent")]
    assert sub.nothing_more(0.3)


def test_5_0_properties_round_trip(mqtt_gateway: GatewayProcess) -> None:
    sub = Paho(mqtt_gateway.port, f"s-{_id()}")
    sub.connect()
    sub.subscribe("req/#", 1)
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    props = PahoProperties(PacketTypes.PUBLISH)
    props.ResponseTopic = "resp/1"
    props.CorrelationData = b"\x01\x02"
    props.UserProperty = [("a", "1"), ("a", "2")]
    props.ContentType = "text/plain"
    props.PayloadFormatIndicator = 1
    props.MessageExpiryInterval = 60
    pub.publish("req/x", b"hello", 1, properties=props)
    (m,) = sub.receive(1)
    got = m.properties
    assert (got.ResponseTopic, got.CorrelationData, got.ContentType, got.PayloadFormatIndicator) == (
        "resp/1",
        b"\x01\x02",
        "text/plain",
        1,
    )
    assert got.UserProperty == [("a", "1"), ("a", "2")]
    assert 58 <= got.MessageExpiryInterval <= 60


def test_retained_messages(mqtt_gateway: GatewayProcess, second_gateway: GatewayProcess) -> None:
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    pub.publish("home/kitchen/temp", b"21", 1, retain=True)
    pub.publish("home/hall/temp", b"19", 1, retain=True)
    pub.publish("home/hall/temp", b"18", 1, retain=True)  # replaces 19
    pub.publish("home/hall/humidity", b"40", 1, retain=True)  # same prefix, not matched
    pub.publish("homes/x/temp", b"0", 1, retain=True)
    sub = Paho(second_gateway.port, f"s-{_id()}")  # through the other replica
    sub.connect()
    sub.subscribe("home/+/temp", 1)
    got = sorted((m.topic, m.payload, m.retain) for m in sub.receive(2))
    assert got == [("home/hall/temp", b"18", True), ("home/kitchen/temp", b"21", True)]
    assert sub.nothing_more(0.3)
    pub.publish("home/hall/temp", b"", 1, retain=True)  # clears it
    (live,) = sub.receive(1)
    assert (live.payload, live.retain) == (b"", False)  # a live message is not flagged retained
    late = Paho(second_gateway.port, f"l-{_id()}")
    late.connect()
    late.subscribe("home/#", 0)
    assert sorted((m.topic, m.payload) for m in late.receive(3, timeout=1)) == [
        ("home/hall/humidity", b"40"),
        ("home/kitchen/temp", b"21"),
    ]


def test_session_resumes_through_another_gateway(mqtt_gateway: GatewayProcess, second_gateway: GatewayProcess) -> None:
    client_id = f"c-{_id()}"
    first = Paho(mqtt_gateway.port, client_id, clean=False)
    assert first.connect(expiry=300)[0] is False
    first.subscribe("orders/#", 1)
    first.disconnect()
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    for i in range(10):
        pub.publish(f"orders/{i}", str(i).encode(), 1)
    again = Paho(second_gateway.port, client_id, clean=False)
    assert again.connect(expiry=300)[0] is True  # session present
    assert [m.payload for m in again.receive(10)] == [str(i).encode() for i in range(10)]
    again.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_3_1_1_clean_session_0_keeps_queued_messages(mqtt_gateway: GatewayProcess, version: int) -> None:
    client_id = f"c-{_id()}"
    first = Paho(mqtt_gateway.port, client_id, version=version, clean=False)
    first.connect(expiry=60)
    first.subscribe("q/1", 1)
    first.disconnect()
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    pub.publish("q/1", b"kept", 1)
    pub.publish("q/1", b"qos0 may be kept too", 0)
    again = Paho(mqtt_gateway.port, client_id, version=version, clean=False)
    assert again.connect(expiry=60)[0] is True
    assert b"kept" in [m.payload for m in again.receive(2, timeout=3)]
    again.disconnect()
    clean = Paho(mqtt_gateway.port, client_id, version=version, clean=True)
    assert clean.connect()[0] is False  # clean start ends the session
    clean.disconnect()


def test_link_stealing_across_gateways(
    mqtt_gateway: GatewayProcess, second_gateway: GatewayProcess, raw: Callable[..., Raw]
) -> None:
    client_id = f"c-{_id()}"
    first = raw(mqtt_gateway.port)
    assert isinstance(first.connect(client_id), Connack)
    second = raw(second_gateway.port)
    connack = second.connect(client_id)
    assert isinstance(connack, Connack)
    assert connack.reason_code == 0
    assert first.next() == Disconnect(0x8E)  # Session taken over
    assert first.closed()
    second.send(Subscribe(1, (Subscription("t", 1),)))
    assert second.next().packet_id == 1  # type: ignore[attr-defined]


def test_will_on_abnormal_disconnect_only(mqtt_gateway: GatewayProcess) -> None:
    watcher = Paho(mqtt_gateway.port, f"w-{_id()}")
    watcher.connect()
    watcher.subscribe("status/#", 1)
    polite = Paho(mqtt_gateway.port, f"polite-{_id()}")
    polite.connect(will=("status/polite", b"gone", 1, False))
    polite.disconnect()
    rude = Paho(mqtt_gateway.port, f"rude-{_id()}")
    rude.connect(will=("status/rude", b"gone", 1, False))
    rude.drop()
    (will,) = watcher.receive(1)
    assert (will.topic, will.payload) == ("status/rude", b"gone")
    assert watcher.nothing_more(0.5)


def test_a_retained_will_is_retained_when_its_gateway_is_killed(
    tmp_path: Path, core: CoreProcess, mqtt_gateway: GatewayProcess
) -> None:
    # [MQTT-3.1.2-17]: the core publishes the will of a client whose gateway was killed, and retains it: a
    # client subscribing afterwards (through another gateway) gets "offline", not the old "online".
    topic = f"status/{_id()}"
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    pub.publish(topic, b"online", 1, retain=True)
    doomed = start_gateway(tmp_path, core, "mqtt", name="gateway-mqtt-doomed")
    try:
        device = Paho(doomed.port, f"dev-{_id()}")
        device.connect(will=(topic, b"offline", 1, True))
        watcher = Paho(mqtt_gateway.port, f"w-{_id()}")
        watcher.connect()
        watcher.subscribe(topic, 1, retainHandling=2)
        doomed.process.kill()
        doomed.process.wait()
        (will,) = watcher.receive(1)
        assert will.payload == b"offline"
        device.stop()
    finally:
        if doomed.process.poll() is None:
            doomed.process.kill()
            doomed.process.wait()
    late = Paho(mqtt_gateway.port, f"l-{_id()}")
    late.connect()
    late.subscribe(topic, 1)
    (retained,) = late.receive(1)
    assert (retained.payload, retained.retain) == (b"offline", True)
    assert late.nothing_more(0.3)
    for client in (pub, watcher, late):
        client.disconnect()


def test_will_delay_is_cancelled_by_a_reconnect(mqtt_gateway: GatewayProcess) -> None:
    watcher = Paho(mqtt_gateway.port, f"w-{_id()}")
    watcher.connect()
    watcher.subscribe("status/#", 1)
    client_id = f"d-{_id()}"
    first = Paho(mqtt_gateway.port, client_id, clean=False)
    first.connect(expiry=60, will=("status/delayed", b"gone", 1, False), will_delay=2)
    first.drop()
    back = Paho(mqtt_gateway.port, client_id, clean=False)
    back.connect(expiry=60)
    assert watcher.nothing_more(3.0)  # back in time: no will
    back.drop()  # no will this time
    other = Paho(mqtt_gateway.port, f"e-{_id()}")
    other.connect(will=("status/late", b"gone", 0, False), will_delay=1)
    other.drop()
    (will,) = watcher.receive(1, timeout=5)
    assert will.topic == "status/late"


def test_shared_subscriptions_spread_load(mqtt_gateway: GatewayProcess, second_gateway: GatewayProcess) -> None:
    members = [Paho(g.port, f"m{i}-{_id()}") for i, g in enumerate((mqtt_gateway, second_gateway, mqtt_gateway))]
    for member in members:
        member.connect()
        member.subscribe("$share/workers/jobs/+", 1)
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    for i in range(60):
        pub.publish(f"jobs/{i}", str(i).encode(), 1)
    counts = []
    payloads: list[bytes] = []
    for member in members:
        got = member.receive(60, timeout=2)
        counts.append(len(got))
        payloads += [m.payload for m in got]
    assert sorted(payloads) == sorted(str(i).encode() for i in range(60))  # each once
    assert all(count > 0 for count in counts), counts


def test_mqtt_and_stomp_and_the_link_client_interoperate(
    mqtt_gateway: GatewayProcess, stomp_gateway: GatewayProcess, core: CoreProcess
) -> None:
    sub = Paho(mqtt_gateway.port, f"s-{_id()}")
    sub.connect()
    sub.subscribe("a/b", 1)
    received: list[stomp.utils.Frame] = []
    subscribed = threading.Event()
    conn = stomp.Connection12([("127.0.0.1", stomp_gateway.port)])

    class Listener(stomp.ConnectionListener):
        def on_message(self, frame: stomp.utils.Frame) -> None:
            received.append(frame)

        def on_receipt(self, frame: stomp.utils.Frame) -> None:
            subscribed.set()

    conn.set_listener("l", Listener())
    conn.connect(wait=True)
    conn.subscribe("/topic/a.b", "1", ack="auto", headers={"receipt": "sub"})
    assert subscribed.wait(10), "no RECEIPT for the SUBSCRIBE"
    conn.send("/topic/a.b", b"from stomp", headers={"region": "eu", "persistent": "true"})
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    props = PahoProperties(PacketTypes.PUBLISH)
    props.UserProperty = [("k", "v")]
    pub.publish("a/b", b"from mqtt", 1, properties=props)

    async def via_link() -> None:
        async with LinkClient("127.0.0.1", core.link_port) as link:
            await link.publish(new_message("a.b", b"from link", routing=RoutingType.MULTICAST, properties={"n": 1}))

    asyncio.run(via_link())
    got = {m.payload: m for m in sub.receive(3)}
    assert set(got) == {b"from stomp", b"from mqtt", b"from link"}
    assert ("region", "eu") in got[b"from stomp"].properties.UserProperty
    assert got[b"from stomp"].qos == 1  # persistent
    assert ("n", "1") in got[b"from link"].properties.UserProperty
    deadline = time.monotonic() + 5
    while len(received) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    by_body = {f.body: f for f in received}  # stomp.py decodes bodies
    assert set(by_body) == {"from stomp", "from mqtt", "from link"}
    assert by_body["from mqtt"].headers["k"] == "v"
    assert by_body["from mqtt"].headers["destination"] == "/topic/a.b"
    conn.disconnect()


def test_amqtt_client(mqtt_gateway: GatewayProcess) -> None:
    async def scenario() -> list[bytes]:
        sub, pub = MQTTClient(client_id=f"as-{_id()}"), MQTTClient(client_id=f"ap-{_id()}")
        url = f"mqtt://127.0.0.1:{mqtt_gateway.port}/"
        await sub.connect(url)
        await pub.connect(url)
        await sub.subscribe([("amqtt/#", 2)])
        for qos in (0, 1, 2):
            await pub.publish(f"amqtt/{qos}", f"q{qos}".encode(), qos=qos)
        got = []
        for _ in range(3):
            message = await asyncio.wait_for(sub.deliver_message(), 10)
            assert message is not None
            got.append(bytes(message.publish_packet.payload.data))
        await pub.disconnect()
        await sub.disconnect()
        return got

    assert sorted(asyncio.run(scenario())) == [b"q0", b"q1", b"q2"]


def test_http_endpoints(mqtt_gateway: GatewayProcess) -> None:
    client = Paho(mqtt_gateway.port, f"h-{_id()}")
    client.connect()
    base = f"http://127.0.0.1:{mqtt_gateway.ports['http']}"
    assert json.loads(urlopen(f"{base}/healthz", timeout=5).read())["status"] == "ok"
    assert json.loads(urlopen(f"{base}/readyz", timeout=5).read())["mqtt"] == mqtt_gateway.port
    metrics = urlopen(f"{base}/metrics", timeout=5).read().decode()
    assert "tridentmq_mqtt_connections 1" in metrics
    client.disconnect()


def test_3_1_1_raw_qos1(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    client = raw(mqtt_gateway.port, V311)
    assert client.connect(f"r-{_id()}") == Connack(session_present=False, reason_code=0)
    client.send(Subscribe(1, (Subscription("raw/t", 1),)))
    assert client.next().reason_codes == (1,)  # type: ignore[attr-defined]
    client.send(Publish("raw/t", b"x", 1, packet_id=7))
    first, second = client.next(), client.next()
    by_type = {type(first): first, type(second): second}
    assert by_type[Puback] == Puback(7)
    delivered = by_type[Publish]
    assert isinstance(delivered, Publish)
    assert (delivered.payload, delivered.qos) == (b"x", 1)
    client.send(Puback(delivered.packet_id or 0))


def test_a_session_resumed_with_expiry_0_delivers_then_ends(mqtt_gateway: GatewayProcess) -> None:
    client_id = f"c-{_id()}"
    first = Paho(mqtt_gateway.port, client_id, clean=False)
    first.connect(expiry=60)
    first.subscribe("end/1", 1)
    first.disconnect()
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    pub.publish("end/1", b"queued", 1)
    last = Paho(mqtt_gateway.port, client_id, clean=False)
    assert last.connect(expiry=0)[0] is True  # resumed, to end with this connection
    assert [m.payload for m in last.receive(1)] == [b"queued"]
    last.disconnect()
    pub.publish("end/1", b"nobody", 1)
    after = Paho(mqtt_gateway.port, client_id, clean=False)
    assert after.connect(expiry=60)[0] is False
    assert after.nothing_more(0.5)
    after.disconnect()


def test_sessions_resumed_with_a_shorter_expiry_keep_what_waited_for_them(mqtt_gateway: GatewayProcess) -> None:
    """The expiry a reconnecting client asks for counts from when this connection ends. Set on the resumed
    queues before they were consumed from, it counted the time they had waited for the client: 0 deleted a
    queue at the core's next tick (every 50 ms) if that came before the consumer, the subscription's with its
    messages, or the session record's, which made the session look new (about once in five runs of the test
    above; with 20 clients here, in most runs)."""
    clients = [f"c-{_id()}" for _ in range(20)]
    for client_id in clients:
        first = Paho(mqtt_gateway.port, client_id, clean=False)
        first.connect(expiry=60)
        first.subscribe(f"short/{client_id}", 1)
        first.disconnect()
    pub = Paho(mqtt_gateway.port, f"p-{_id()}")
    pub.connect()
    for client_id in clients:
        pub.publish(f"short/{client_id}", client_id.encode(), 1)
    pub.disconnect()
    time.sleep(0.3)  # the scenario, not a wait: the sessions have been idle for several ticks when clients return
    for client_id in clients:
        last = Paho(mqtt_gateway.port, client_id, clean=False)
        assert last.connect(expiry=0)[0] is True, client_id
        assert [m.payload for m in last.receive(1)] == [client_id.encode()]
        last.disconnect()


def test_a_message_mqtt_cannot_carry_is_dead_lettered(mqtt_gateway: GatewayProcess, core: CoreProcess) -> None:
    sub = Paho(mqtt_gateway.port, f"s-{_id()}")
    sub.connect()
    sub.subscribe("odd/#", 1)

    async def via_link() -> list[bytes]:
        async with LinkClient("127.0.0.1", core.link_port) as link:
            for address in ("odd.a+b", "odd.fine"):  # '+' is no character of an MQTT topic name
                await link.publish(new_message(address, address.encode(), routing=RoutingType.MULTICAST, durable=True))
            dead = await link.subscribe("DLQ", credit=10)
            delivery = await dead.get(timeout=5)
            return [] if delivery is None else [delivery.body]

    assert asyncio.run(via_link()) == [b"odd.a+b"]
    assert [m.payload for m in sub.receive(1)] == [b"odd.fine"]  # the subscription goes on


def test_a_new_subscription_does_not_take_over_a_queue_an_earlier_session_left(
    mqtt_gateway: GatewayProcess, core: CoreProcess
) -> None:
    """A gateway that died between making a persistent session's subscription queue and saving the session left
    a queue no record lists. The next SUBSCRIBE of that filter starts empty: nothing queued before reaches the
    client, or any consumer (with one delivery attempt allowed, a delivery would dead-letter it on its way
    back), and what is published from then on arrives."""
    client_id = f"left-{_id()}"
    queue = convert.subscription_queue(client_id, "left/t")
    settings = {"match": "left.#", "settings": {"max_delivery_attempts": 1}}
    request = Request(
        f"{core.management_url}/api/address-settings",
        data=json.dumps(settings).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    with urlopen(request, timeout=5) as response:
        assert response.status == 200

    async def leave_a_queue() -> None:
        async with LinkClient("127.0.0.1", core.link_port) as link:
            await link.create_queue(queue, "left.t", routing_type=RoutingType.MULTICAST)
            for n in range(3):
                await link.publish(new_message("left.t", b"old %d" % n, routing=RoutingType.MULTICAST, durable=True))

    asyncio.run(leave_a_queue())
    client = Paho(mqtt_gateway.port, client_id, version=4, clean=False)
    assert client.connect()[0] is False  # no session record
    assert client.subscribe("left/t", 1) == [1]
    client.publish("left/t", b"new", 1)
    assert [m.payload for m in client.receive(2, timeout=2)] == [b"new"]
    assert "mqtt subscription queue left by an earlier session dropped" in mqtt_gateway.log()
    with urlopen(f"{core.management_url}/api/queues", timeout=5) as response:
        queues = {q["name"]: q for q in json.loads(response.read())}
    assert queues.get("DLQ", {"depth": 0})["depth"] == 0, queues.get("DLQ")
    client.disconnect()
