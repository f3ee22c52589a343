"""The MQTT gateway's QoS 0 fan-out (feeds): subscribers of one filter on one gateway share one core
subscription per user once there are two of them, each still gets what its own options say, a slow one
loses QoS 0 messages without holding up the others, and the feed goes with its last subscriber."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from tests.conftest import CoreProcess, GatewayProcess, start_core, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Paho, Raw, silent

from tridentmq_mqtt.protocol.packets import (
    V311,
    Connack,
    Puback,
    Publish,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
)
from tridentmq_mqtt.protocol.properties import Properties

FANOUT_PREFIX = "mqtt.fanout."


def _id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def fanout_gateway(tmp_path: Path, core: CoreProcess) -> Iterator[GatewayProcess]:
    """A gateway that fans out from the first QoS 0 subscriber on (the default waits for a second)."""
    gateway = start_gateway(tmp_path, core, "mqtt", name="fanout", TRIDENTMQ_MQTT_MQTT_QOS0_FAN_OUT_FROM="1")
    yield gateway
    stop_cleanly(gateway)


@pytest.fixture
def paho() -> Iterator[Callable[..., Paho]]:
    made: list[Paho] = []

    def make(port: int, **options: Any) -> Paho:
        made.append(Paho(port, f"p-{_id()}", **options))
        made[-1].connect()
        return made[-1]

    yield make
    for client in made:
        client.client.disconnect()
        client.stop()


def _connected(client: Raw, **fields: Any) -> None:
    connack = client.connect(f"r-{_id()}", **fields)
    assert isinstance(connack, Connack), connack
    assert connack.reason_code == 0, connack


def _subscribed(client: Raw, packet_id: int, *subscriptions: Subscription, props: Properties | None = None) -> None:
    client.send(Subscribe(packet_id, subscriptions, props or Properties()))
    assert client.next() == Suback(packet_id, tuple(s.qos for s in subscriptions))


def _publishes(client: Raw, count: int, timeout: float = 10) -> list[Publish]:
    got: list[Publish] = []
    while len(got) < count:
        packet = client.next(timeout)
        assert isinstance(packet, Publish), packet
        got.append(packet)
    return got


def _metric(gateway: GatewayProcess, name: str) -> int:
    text = urlopen(f"http://127.0.0.1:{gateway.ports['http']}/metrics", timeout=5).read().decode()
    values = [line.split()[1] for line in text.splitlines() if line.startswith(f"tridentmq_{name} ")]
    assert len(values) == 1, text
    return int(values[0])


def _core_queues(core: CoreProcess, prefix: str) -> list[dict[str, Any]]:
    queues = json.loads(urlopen(f"{core.management_url}/api/queues", timeout=5).read())
    return [q for q in queues if q["name"].startswith(prefix)]


def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _fan_out_links(core: CoreProcess) -> list[dict[str, Any]]:
    links = json.loads(urlopen(f"{core.management_url}/api/connections", timeout=5).read())
    return [link for link in links if link["client_name"].startswith("mqtt fan-out")]


def test_subscribers_of_a_filter_share_one_core_subscription(
    mqtt_gateway: GatewayProcess, core: CoreProcess, paho: Callable[..., Paho]
) -> None:
    base = f"fan{_id()}"
    subscribers = [
        paho(mqtt_gateway.port, version=4),
        paho(mqtt_gateway.port, version=5),
        paho(mqtt_gateway.ports["websocket"], version=5, websocket=True),
    ]
    assert [code.value for code in subscribers[0].subscribe(f"{base}/+/x", 0)] == [0]
    # One subscriber of the filter: a queue of its own, no fan-out and no extra link to the core.
    assert len(_core_queues(core, "mqtt.sub.")) == 1
    assert not _core_queues(core, FANOUT_PREFIX)
    assert not _fan_out_links(core)
    for client in subscribers[1:]:  # the second one makes the fan-out, the third joins it
        assert [code.value for code in client.subscribe(f"{base}/+/x", 0)] == [0]
    (feed,) = _core_queues(core, FANOUT_PREFIX)
    assert (feed["consumers"], feed["temporary"], feed["durable"]) == (1, True, False)
    assert len(_fan_out_links(core)) == 1
    assert len(_core_queues(core, "mqtt.sub.")) == 1
    assert _metric(mqtt_gateway, "mqtt_fanout_feeds") == 1
    publisher = paho(mqtt_gateway.port)
    for i in range(30):
        publisher.publish(f"{base}/{i % 3}/x", f"m{i}".encode(), 1)
    for client in subscribers:
        got = client.receive(30)
        assert [m.payload for m in got] == [f"m{i}".encode() for i in range(30)]
        assert {m.qos for m in got} == {0}
        assert [m.topic for m in got[:3]] == [f"{base}/0/x", f"{base}/1/x", f"{base}/2/x"]
    assert _core_queues(core, FANOUT_PREFIX)[0]["delivered"] == 30  # once for all three
    assert _eventually(lambda: not _core_queues(core, "mqtt.sub."))  # the first moved over to the fan-out
    for client in subscribers:
        client.disconnect()
    assert _eventually(lambda: not _core_queues(core, FANOUT_PREFIX) and not _core_queues(core, "mqtt.sub."))
    assert _eventually(lambda: not _fan_out_links(core))
    assert _metric(mqtt_gateway, "mqtt_fanout_feeds") == 0


def test_the_first_subscriber_moves_to_the_fan_out_without_duplicates(
    mqtt_gateway: GatewayProcess, core: CoreProcess, paho: Callable[..., Paho]
) -> None:
    topic = f"move/{_id()}"
    first, publisher = paho(mqtt_gateway.port), paho(mqtt_gateway.port)
    first.subscribe(topic, 0)
    for i in range(100):
        publisher.publish(topic, b"%d" % i, 1)
    second = paho(mqtt_gateway.port)
    second.subscribe(topic, 0)  # makes the fan-out: the first moves over while messages keep coming
    for i in range(100, 300):
        publisher.publish(topic, b"%d" % i, 1)
    got = [int(m.payload) for m in first.receive(300, timeout=5)]
    assert got == sorted(set(got)), "in order, none twice"
    assert set(range(100, 300)) <= set(got), "nothing published after the fan-out was made is missed"
    assert [int(m.payload) for m in second.receive(200)] == list(range(100, 300))
    assert not _core_queues(core, "mqtt.sub.")
    assert len(_core_queues(core, FANOUT_PREFIX)) == 1


def test_a_subscriber_that_moved_over_can_ask_for_qos1_at_once(
    mqtt_gateway: GatewayProcess, core: CoreProcess, raw: Callable[..., Raw], paho: Callable[..., Paho]
) -> None:
    topic = f"up/{_id()}"
    first = raw(mqtt_gateway.port)
    _connected(first)
    _subscribed(first, 1, Subscription(topic, 0))  # a queue of its own, for now
    paho(mqtt_gateway.port).subscribe(topic, 0)  # the fan-out
    publisher = raw(mqtt_gateway.port)
    _connected(publisher)
    publisher.send(Publish(topic, b"m1", 1, packet_id=1))
    assert publisher.next() == Puback(1)
    assert [(p.payload, p.qos) for p in _publishes(first, 1)] == [(b"m1", 0)]  # and it moves over
    _subscribed(first, 2, Subscription(topic, 1))  # while its old queue may still be on its way out
    publisher.send(Publish(topic, b"m2", 1, packet_id=2))
    assert publisher.next() == Puback(2)
    (m2,) = _publishes(first, 1)
    assert (m2.payload, m2.qos) == (b"m2", 1)
    first.send(Puback(m2.packet_id or 0))
    assert silent(first, 0.5) == []  # still connected, nothing more
    assert len(_core_queues(core, "mqtt.sub.")) == 1


def test_each_subscriber_gets_its_own_options(fanout_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    base = f"opt{_id()}"
    plain, tagged, own, v311 = (
        raw(fanout_gateway.port),
        raw(fanout_gateway.port),
        raw(fanout_gateway.port),
        raw(fanout_gateway.port, V311),
    )
    _connected(plain)
    _connected(tagged)
    _connected(own)
    _connected(v311)
    everything = Subscription(f"{base}/#", 0)
    _subscribed(plain, 1, everything)
    _subscribed(
        tagged,
        1,
        Subscription(f"{base}/#", 0, retain_as_published=True),
        props=Properties(subscription_identifiers=(42,)),
    )
    _subscribed(own, 1, Subscription(f"{base}/#", 0, no_local=True))
    _subscribed(v311, 1, everything)
    own.send(
        Publish(f"{base}/a", b"from-own", 1, packet_id=1),
        Publish(f"{base}/b", b"retained", 1, retain=True, packet_id=2),
    )
    for client in (plain, tagged, v311):
        got = _publishes(client, 2)
        assert [(p.topic, p.payload, p.qos) for p in got] == [
            (f"{base}/a", b"from-own", 0),
            (f"{base}/b", b"retained", 0),
        ]
        retain_flag = got[1].retain
        assert retain_flag is (client is tagged)  # retain as published: only where asked
        ids = {p.properties.subscription_identifiers for p in got}
        assert ids == ({(42,)} if client is tagged else {()})
    rest = silent(own, 0.3)  # no-local: its own messages do not come back; the PUBACKs do
    assert sorted(p.packet_id for p in rest if isinstance(p, Puback)) == [1, 2]
    assert not [p for p in rest if isinstance(p, Publish)]
    plain.send(Publish(f"{base}/b", b"", 1, retain=True, packet_id=3))
    assert Puback(3) in silent(plain, 0.3)


def test_dollar_topics_and_maximum_packet_size(fanout_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    base = f"mx{_id()}"
    small, large, wild = raw(fanout_gateway.port), raw(fanout_gateway.port), raw(fanout_gateway.port)
    _connected(small, properties=Properties(maximum_packet_size=200))
    _connected(large)
    _connected(wild)
    _subscribed(small, 1, Subscription(f"{base}/#", 0))
    _subscribed(large, 1, Subscription(f"{base}/#", 0))
    _subscribed(wild, 1, Subscription("+/x", 0))
    publisher = raw(fanout_gateway.port)
    _connected(publisher)
    publisher.send(
        Publish(f"{base}/1", b"small", 1, packet_id=1),
        Publish(f"{base}/2", b"L" * 500, 1, packet_id=2),
        Publish(f"{base}/3", b"small again", 1, packet_id=3),
        Publish("$dollar/x", b"no", 1, packet_id=4),
        Publish(f"{base}x/x", b"yes", 1, packet_id=5),
    )
    assert [publisher.next() for _ in range(5)] == [Puback(i) for i in range(1, 6)]
    assert [p.payload for p in _publishes(large, 3)] == [b"small", b"L" * 500, b"small again"]
    # Too large for the client: dropped for it alone, as if sent ([MQTT-3.1.2-25]).
    assert [p.payload for p in _publishes(small, 2)] == [b"small", b"small again"]
    assert [p.payload for p in _publishes(wild, 1)] == [b"yes"]  # a leading wildcard never matches $ topics
    for client in (small, large, wild):
        assert silent(client, 0.3) == []


def test_a_subscriber_that_falls_behind_loses_qos0_messages_alone(
    tmp_path: Path, core: CoreProcess, raw: Callable[..., Raw]
) -> None:
    gateway = start_gateway(
        tmp_path,
        core,
        "mqtt",
        TRIDENTMQ_MQTT_MQTT_QOS0_MAX_BUFFERED_BYTES="65536",
        TRIDENTMQ_MQTT_MQTT_QOS0_FAN_OUT_FROM="1",
    )
    topic, count, size = f"slow/{_id()}", 12_000, 1024
    slow = raw(gateway.port)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    _connected(slow)
    _subscribed(slow, 1, Subscription(topic, 0))
    fast = raw(gateway.port)
    _connected(fast)
    _subscribed(fast, 1, Subscription(topic, 0))
    publisher = raw(gateway.port)
    _connected(publisher)
    window = 500
    for start in range(0, count, window):
        publisher.send(
            *(
                Publish(topic, i.to_bytes(4, "big") + b"x" * size, 1, packet_id=i + 1)
                for i in range(start, start + window)
            )
        )
        assert [publisher.next() for _ in range(window)] == [Puback(i + 1) for i in range(start, start + window)]
        # The fast one reads as it goes: it keeps up.
        assert [int.from_bytes(p.payload[:4], "big") for p in _publishes(fast, window)] == list(
            range(start, start + window)
        )
    assert _eventually(lambda: _metric(gateway, "mqtt_qos0_dropped_total") > 0)
    dropped = _metric(gateway, "mqtt_qos0_dropped_total")
    seen: list[int] = []
    while got := [p for p in silent(slow, 1.0) if isinstance(p, Publish)]:  # what it was sent, in order
        seen += [int.from_bytes(p.payload[:4], "big") for p in got]
    assert seen == sorted(set(seen))  # in order, none twice
    assert len(seen) + dropped == count
    assert "falling behind" in gateway.log()
    stop_cleanly(gateway)


def test_resubscribing_at_qos1_moves_to_a_queue_of_its_own(
    fanout_gateway: GatewayProcess, core: CoreProcess, raw: Callable[..., Raw]
) -> None:
    topic = f"up/{_id()}"
    client = raw(fanout_gateway.port)
    _connected(client)
    _subscribed(client, 1, Subscription(topic, 0))
    assert len(_core_queues(core, FANOUT_PREFIX)) == 1
    client.send(Publish(topic, b"q0", 1, packet_id=2))
    got = [client.next(), client.next()]
    assert Puback(2) in got
    assert [(p.payload, p.qos) for p in got if isinstance(p, Publish)] == [(b"q0", 0)]
    _subscribed(client, 3, Subscription(topic, 1))
    assert _eventually(lambda: not _core_queues(core, FANOUT_PREFIX))
    assert len(_core_queues(core, "mqtt.sub.")) == 1
    client.send(Publish(topic, b"q1", 1, packet_id=4))
    got = [client.next(), client.next()]
    (delivered,) = [p for p in got if isinstance(p, Publish)]
    assert (delivered.payload, delivered.qos) == (b"q1", 1)
    client.send(Puback(delivered.packet_id or 0), Unsubscribe(5, (topic,)))
    assert client.next() == Unsuback(5, (0,))
    assert _eventually(lambda: not _core_queues(core, "mqtt.sub."))


def test_feeds_are_per_user(tmp_path: Path, raw: Callable[..., Raw]) -> None:
    config = "".join(
        f'[[users]]\nname = "{name}"\npassword = "pw"\nroles = ["{role}"]\n'
        for name, role in (("gw", "all"), ("app", "app"), ("ops", "all"))
    )
    for permission in (
        "send",
        "consume",
        "createNonDurableQueue",
        "deleteNonDurableQueue",
        "createAddress",
        "createDurableQueue",
        "deleteDurableQueue",
        "deleteAddress",
        "browse",
        "manage",
    ):
        config += f'[[permissions]]\nmatch = "#"\npermission = "{permission}"\nroles = ["all"]\n'
        if permission not in ("send", "consume", "browse"):
            config += f'[[permissions]]\nmatch = "#"\npermission = "{permission}"\nroles = ["app"]\n'
    config += '[[permissions]]\nmatch = "open.#"\npermission = "consume"\nroles = ["app"]\n'
    core = start_core(tmp_path, config=config)
    gateway = start_gateway(
        tmp_path,
        core,
        "mqtt",
        TRIDENTMQ_MQTT_CORE_USER="gw",
        TRIDENTMQ_MQTT_CORE_PASSWORD="pw",
        TRIDENTMQ_MQTT_MQTT_QOS0_FAN_OUT_FROM="1",
    )
    app, ops = raw(gateway.port), raw(gateway.port)
    _connected(app, username="app", password=b"pw")
    _connected(ops, username="ops", password=b"pw")
    app.send(Subscribe(1, (Subscription("secret/x", 0), Subscription("open/x", 0))))
    assert app.next() == Suback(1, (0x87, 0))  # the core refuses app's feed of secret/x
    _subscribed(ops, 1, Subscription("secret/x", 0), Subscription("open/x", 0))
    assert _metric(gateway, "mqtt_fanout_feeds") == 3  # app's open/x, ops' open/x and secret/x
    ops.send(Publish("open/x", b"o", 1, packet_id=2), Publish("secret/x", b"s", 1, packet_id=3))
    assert [p.payload for p in _publishes(app, 1)] == [b"o"]
    assert sorted(p.payload for p in silent(ops, 1.0) if isinstance(p, Publish)) == [b"o", b"s"]
    assert silent(app, 0.3) == []
    app.close()
    ops.close()
    assert _eventually(lambda: _metric(gateway, "mqtt_fanout_feeds") == 0)
    stop_cleanly(gateway)
    assert core.stop() == 0


def test_fan_out_off_gives_each_subscription_a_queue(
    tmp_path: Path, core: CoreProcess, paho: Callable[..., Paho]
) -> None:
    gateway = start_gateway(tmp_path, core, "mqtt", TRIDENTMQ_MQTT_MQTT_QOS0_FAN_OUT_FROM="0")
    topic = f"off/{_id()}"
    subscribers = [paho(gateway.port) for _ in range(2)]
    for client in subscribers:
        client.subscribe(topic, 0)
    assert not _core_queues(core, FANOUT_PREFIX)
    assert len([q for q in _core_queues(core, "mqtt.sub.") if q["address"] == topic.replace("/", ".")]) == 2
    paho(gateway.port).publish(topic, b"hello", 1)
    for client in subscribers:
        assert [m.payload for m in client.receive(1)] == [b"hello"]
    assert _metric(gateway, "mqtt_fanout_feeds") == 0
    for client in subscribers:
        client.disconnect()
    stop_cleanly(gateway)


def test_a_member_leaving_abruptly_does_not_stop_the_feed(
    fanout_gateway: GatewayProcess, paho: Callable[..., Paho]
) -> None:
    topic = f"drop/{_id()}"
    staying, leaving = paho(fanout_gateway.port), paho(fanout_gateway.port, version=4)
    staying.subscribe(topic, 0)
    leaving.subscribe(topic, 0)
    publisher = paho(fanout_gateway.port)
    publisher.publish(topic, b"before", 1)
    assert [m.payload for m in leaving.receive(1)] == [b"before"]
    leaving.drop()
    assert _eventually(lambda: _metric(fanout_gateway, "mqtt_connections") == 2)
    publisher.publish(topic, b"after", 1)
    assert [m.payload for m in staying.receive(2)] == [b"before", b"after"]
    assert _metric(fanout_gateway, "mqtt_fanout_feeds") == 1


def test_no_feed_outlives_its_subscribers(
    fanout_gateway: GatewayProcess, core: CoreProcess, raw: Callable[..., Raw]
) -> None:
    """Connections taken over (their worker cancelled) while they join a feed, and connections that vanish
    right after subscribing: once they are gone, so are their feeds."""
    for i in range(10):
        client_id = f"t-{_id()}"
        first = raw(fanout_gateway.port, V311)
        assert first.connect(client_id) == Connack(session_present=False, reason_code=0)
        first.send(Subscribe(1, (Subscription(f"race/{i}/a", 0), Subscription(f"race/{i}/b", 0))))
        second = raw(fanout_gateway.port, V311)  # takes the session over while the first may still subscribe
        assert second.connect(client_id) == Connack(session_present=False, reason_code=0)
        second.send(Subscribe(1, (Subscription(f"race/{i}/c", 0),)))
        second.close()
    assert _eventually(lambda: _metric(fanout_gateway, "mqtt_connections") == 0)
    assert _eventually(lambda: _metric(fanout_gateway, "mqtt_fanout_feeds") == 0)
    assert _eventually(lambda: not _core_queues(core, FANOUT_PREFIX))
