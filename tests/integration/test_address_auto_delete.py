"""Addresses auto-created by publishes through real gateways go once unused, stay gone after a restart, and each
user may auto-create only so many (refused per protocol beyond); retained messages and persistent sessions,
whose addresses have queues, are kept."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.request import urlopen

import pytest
from proton import Delivery, Message
from proton.utils import BlockingConnection, SendException
from tests.conftest import CoreProcess, GatewayProcess, start_core, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Paho, Raw

from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.protocol.packets import Puback, Publish

pytestmark = pytest.mark.integration

TOPICS = 2000
WAIT = 30.0
# The STOMP and AMQP cap tests send one message at a time: their addresses must not go (and stop counting)
# before the last one, however slow the machine. The MQTT one (cap.#) sends in one write and waits for them to go.
SLOW_DELETE = "".join(
    f'[[address_settings]]\nmatch = "{m}"\nauto_delete_addresses_delay_ms = 600000\n' for m in ("stomp.#", "amqp.#")
)


def addresses(core: CoreProcess) -> set[str]:
    with urlopen(f"{core.management_url}/api/addresses", timeout=10) as response:
        return {a["name"] for a in json.loads(response.read())}


def eventually(check: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def publish_all(client: Raw, topics: list[str], batch: int = 50) -> list[Puback]:
    """QoS 1 publishes, ``batch`` in one write (within the gateway's receive maximum); their PUBACKs, in order."""
    acks = []
    for start in range(0, len(topics), batch):
        part = topics[start : start + batch]
        client.send(*(Publish(topic, b"21.5", 1, packet_id=n + 1) for n, topic in enumerate(part)))
        acks += [client.next() for _ in part]
    assert all(isinstance(ack, Puback) for ack in acks), acks
    return [ack for ack in acks if isinstance(ack, Puback)]


@pytest.fixture
def clients() -> Iterator[list[Paho | Raw]]:
    made: list[Paho | Raw] = []
    yield made
    for client in made:
        if isinstance(client, Raw):
            client.close()
        else:
            client.stop()


def test_published_topics_go_and_stay_gone_after_a_restart(tmp_path: Path, clients: list[Paho | Raw]) -> None:
    core = start_core(tmp_path)
    gateway = start_gateway(tmp_path, core, "mqtt")
    run = uuid.uuid4().hex[:6]
    away = Paho(gateway.port, f"away-{run}", clean=False)
    clients.append(away)
    away.connect(expiry=3600)
    assert away.subscribe(f"kept/{run}/sub", 1) == [1]
    away.disconnect()  # a persistent session: its queue keeps what comes meanwhile
    publisher = Raw(gateway.port)
    clients.append(publisher)
    publisher.connect(f"pub-{run}")
    publisher.send(
        Publish(f"kept/{run}/retained", b"last", 1, retain=True, packet_id=9000),
        Publish(f"kept/{run}/sub", b"while away", 1, packet_id=9001),
    )
    assert [publisher.next(), publisher.next()] == [Puback(9000), Puback(9001)]
    topics = [f"load/{run}/{n}" for n in range(TOPICS)]
    assert {ack.reason_code for ack in publish_all(publisher, topics)} == {0}
    prefix = f"load.{run}."
    assert eventually(lambda: not any(name.startswith(prefix) for name in addresses(core))), addresses(core)
    # The persistent session's queue keeps its topic's address; retained messages live in the last-value
    # queue of $mqtt.retained (keyed by topic), so their topics' own addresses may go like any other.
    kept = {f"kept.{run}.sub", "$mqtt.retained"}
    assert kept <= addresses(core)
    publisher.close()
    stop_cleanly(gateway)
    assert core.stop() == 0, core.log()

    core = start_core(tmp_path)  # the same data directory: the journal is replayed
    gateway = start_gateway(tmp_path, core, "mqtt", name="gateway-after")
    try:
        after = addresses(core)
        assert not any(name.startswith(prefix) for name in after)
        assert kept <= after
        fresh = Paho(gateway.port, f"fresh-{run}")
        clients.append(fresh)
        fresh.connect()
        fresh.subscribe(f"kept/{run}/retained", 1)
        assert [m.payload for m in fresh.receive(1)] == [b"last"]
        back = Paho(gateway.port, f"away-{run}", clean=False)
        clients.append(back)
        assert back.connect(expiry=3600)[0] is True  # session present
        assert [m.payload for m in back.receive(1)] == [b"while away"]
        fresh.disconnect()
        back.disconnect()
    finally:
        stop_cleanly(gateway)
        assert core.stop() == 0, core.log()
    assert "Traceback" not in core.log()


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[tuple[CoreProcess, GatewayProcess, GatewayProcess]]:
    core = start_core(tmp_path, config=SLOW_DELETE, TRIDENTMQ_CORE_BROKER_MAX_AUTO_CREATED_ADDRESSES_PER_USER="3")
    mqtt = start_gateway(tmp_path, core, "mqtt")
    stomp = start_gateway(tmp_path, core, "stomp")
    yield core, mqtt, stomp
    stop_cleanly(mqtt)
    stop_cleanly(stomp)
    assert core.stop() == 0, core.log()


def test_a_user_over_the_cap_gets_a_rejected_outcome_on_amqp(tmp_path: Path) -> None:
    core = start_core(tmp_path, config=SLOW_DELETE, TRIDENTMQ_CORE_BROKER_MAX_AUTO_CREATED_ADDRESSES_PER_USER="3")
    gateway = start_gateway(tmp_path, core, "amqp")
    run = uuid.uuid4().hex[:6]
    conn = BlockingConnection(
        f"amqp://127.0.0.1:{gateway.port}", timeout=WAIT, user=f"amqp-{run}", password="x", allowed_mechs="PLAIN"
    )
    try:
        relay = conn.create_sender(None)
        for n in range(3):
            relay.send(Message(address=f"topic://amqp.{run}.{n}", body="x"))
        with pytest.raises(SendException) as refused:
            relay.send(Message(address=f"topic://amqp.{run}.3", body="x"))
        assert refused.value.state == Delivery.REJECTED
        assert f"amqp.{run}.3" not in addresses(core)
        relay.send(Message(address=f"topic://amqp.{run}.0", body="an existing address still takes messages"))
    finally:
        conn.close()
        stop_cleanly(gateway)
        assert core.stop() == 0, core.log()


def test_a_user_over_the_cap_gets_quota_exceeded_on_mqtt(
    capped: tuple[CoreProcess, GatewayProcess, GatewayProcess],
    clients: list[Paho | Raw],
) -> None:
    core, mqtt, _ = capped
    run = uuid.uuid4().hex[:6]
    device = Raw(mqtt.port)
    clients.append(device)
    device.connect(f"dev-{run}", username=f"device-{run}", password=b"x")
    acks = publish_all(device, [f"cap/{run}/{n}" for n in range(4)])
    assert [ack.reason_code for ack in acks] == [0, 0, 0, rc.QUOTA_EXCEEDED]
    other = Raw(mqtt.port)
    clients.append(other)
    other.connect(f"other-{run}", username=f"other-{run}", password=b"x")
    assert publish_all(other, [f"cap/{run}/other"])[0].reason_code == 0  # a cap per user
    assert f"cap.{run}.3" not in addresses(core)
    # Once its topics are unused and gone, the user may create new ones again.
    assert eventually(lambda: not any(a.startswith(f"cap.{run}.") for a in addresses(core) - {f"cap.{run}.other"}))
    assert publish_all(device, [f"cap/{run}/3"])[0].reason_code == 0


def test_a_user_over_the_cap_gets_an_error_frame_on_stomp(
    capped: tuple[CoreProcess, GatewayProcess, GatewayProcess],
) -> None:
    _, _, stomp = capped
    run = uuid.uuid4().hex[:6]
    with socket.create_connection(("127.0.0.1", stomp.port), timeout=WAIT) as sock:
        frames = [f"CONNECT\naccept-version:1.2\nhost:/\nlogin:user-{run}\npasscode:x\n\n\x00"]
        frames += [f"SEND\ndestination:/topic/stomp.{run}.{n}\nreceipt:r{n}\n\nx\x00" for n in range(4)]
        sock.sendall("".join(frames).encode())
        received = b""
        while b"ERROR" not in received or not received.endswith(b"\x00"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    text = received.decode()
    for n in range(3):
        assert f"receipt-id:r{n}\n" in text
    assert "message:send refused" in text
    assert "max_auto_created_addresses_per_user" in text
