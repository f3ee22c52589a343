"""Numbers out of range are refused at every door, against real processes over real sockets.

The reproducer of the poison message: a link publish of a non-durable, already expired message whose timestamp
is 2**63-1 once stopped a core's timers (its expiry's audit event overflowed), leaving a node that answered
/readyz but sent no heartbeats. Now the link refuses the message, and the gateways refuse what would
carry such a value with their protocol's error before it reaches the core.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from proton import Disposition, Message
from proton.utils import BlockingConnection, SendException
from tests.conftest import CoreProcess, GatewayProcess, start_core
from tests.integration.test_amqp_bad_input import ATTACH, DETACH, Peer, attach_receiver, attach_sender
from tests.integration.test_amqp_bad_input import assert_serves as assert_amqp_serves
from tests.integration.test_stomp_bad_input import assert_gateway_serves, exchange, frames_of

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import M_ID, M_SCHEDULED, M_TIMESTAMP, new_message

pytestmark = pytest.mark.integration

WAIT = 10.0  # every wait ends as soon as its condition holds


def audit_heartbeats(core: CoreProcess) -> int:
    lines = "".join(p.read_text() for p in sorted((core.data_dir / "audit").rglob("*.jsonl*")))
    return sum(json.loads(line)["event"] == "node.heartbeat" for line in lines.splitlines() if line)


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def ready(core: CoreProcess) -> object:
    with urllib.request.urlopen(core.management_url + "/readyz", timeout=WAIT) as response:
        return json.loads(response.read())["status"]


@pytest.mark.parametrize(
    ("field", "value"),
    [(M_TIMESTAMP, 2**63 - 1), (M_TIMESTAMP, -1), (M_SCHEDULED, 2**64 - 1), (M_ID, -(2**63))],
)
async def test_a_poison_message_is_refused_and_the_node_keeps_its_timers(
    tmp_path: Path, field: int, value: int
) -> None:
    # Audit heartbeats every 0.2 s and link heartbeats every 0.1 s: both stop at once if the node's tick dies.
    core = start_core(tmp_path, TRIDENTMQ_CORE_AUDIT_HEARTBEAT_SECONDS="0.2")
    try:
        watcher = LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0), heartbeat_ms=100)
        async with watcher:
            consumer = await watcher.subscribe("poison", auto_ack=True)
            async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as attacker:
                poison = new_message("poison", b"x", expiration_ms=1)  # non-durable and long expired
                poison[field] = value
                with pytest.raises(LinkClosedError) as refused:
                    await attacker.publish(poison)
            assert refused.value.code == "malformed"
            seen = audit_heartbeats(core)
            await wait_for(lambda: audit_heartbeats(core) >= seen + 3, "three more audit heartbeats")
            # The watcher's link outlived several heartbeat timeouts (4 x 0.1 s): the node kept sending them.
            await watcher.publish(new_message("poison", b"fine"))
            delivered = await consumer.get(timeout=WAIT)
            assert delivered is not None
            assert delivered.body == b"fine"
        assert ready(core) == "ready"
    finally:
        assert core.stop() == 0, core.log()
    log = core.log()
    assert "Traceback" not in log, log
    assert "link closed on protocol error" in log


def test_a_stomp_send_with_an_expiry_beyond_year_9999_gets_an_error(stomp_gateway: GatewayProcess) -> None:
    connect = b"CONNECT\naccept-version:1.2\nhost:x\n\n\x00"
    for expires in ("9223372036854775807", "253402300800000", "1" + "0" * 30):
        send = f"SEND\ndestination:/queue/late\nexpires:{expires}\nreceipt:r\n\nlate\x00".encode()
        frames = frames_of(exchange(stomp_gateway, connect + send))
        assert [f.command for f in frames] == ["CONNECTED", "ERROR"], frames
        assert "expires" in frames[-1].body.decode(), frames[-1]
    assert_gateway_serves(stomp_gateway, "after-late")


def test_an_amqp_message_expiring_after_year_9999_is_rejected(amqp_gateway: GatewayProcess) -> None:
    conn = BlockingConnection(f"amqp://127.0.0.1:{amqp_gateway.port}", timeout=WAIT)
    try:
        sender = conn.create_sender("late")
        with pytest.raises(SendException) as rejected:
            sender.send(Message(body="late", expiry_time=1e15))  # seconds: year 31 millions
        assert rejected.value.state == Disposition.REJECTED
    finally:
        conn.close()
    assert_amqp_serves(amqp_gateway, "after-late")


def test_the_core_link_refuses_a_hello_with_a_negative_heartbeat(core: CoreProcess) -> None:
    from tests.integration.test_core_link import raw_frame, read_close  # noqa: PLC0415 - its raw-frame helpers

    with socket.create_connection(("127.0.0.1", core.link_port), timeout=WAIT) as sock:
        sock.sendall(raw_frame([[1, [1], None, None, "x", -1, 1 << 20]]))
        ops = read_close(sock)
    assert ops[-1][:2] == [3, "malformed"]


# ------------------------------------------------------------------------------------------------ names
# A NUL (or another control character) in a name, or a name too long, is refused at every door with that
# protocol's refusal and one log line; the connection's process goes on serving.


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        ("SEND\ndestination:/queue/nul\x00name\nreceipt:r\n\nx\x00", "control character '\\x00'"),
        ("SUBSCRIBE\nid:1\ndestination:/queue/ok::q\x01\nreceipt:r\n\n\x00", "control character '\\x01'"),
        ("SUBSCRIBE\nid:1\ndestination:/topic/t\nactivemq.subscriptionName:d\x00\nreceipt:r\n\n\x00", "control"),
        ("SEND\ndestination:/queue/" + "x" * 256 + "\nreceipt:r\n\nx\x00", "the limit is 255"),
    ],
)
def test_a_stomp_destination_with_a_nul_or_too_long_is_an_error(
    stomp_gateway: GatewayProcess, frame: str, problem: str
) -> None:
    connect = b"CONNECT\naccept-version:1.2\nhost:x\nclient-id:names\n\n\x00"
    frames = frames_of(exchange(stomp_gateway, connect + frame.encode()))
    assert [f.command for f in frames] == ["CONNECTED", "ERROR"], frames
    error = frames[-1]
    assert (error.headers["message"], error.headers["receipt-id"]) == ("invalid header", "r"), error
    assert problem in error.body.decode(), error
    assert_gateway_serves(stomp_gateway, "after-names")
    assert stomp_gateway.log().count("stomp error sent") == 1


@pytest.mark.parametrize("address", ["nul\x00name", "queue://ok::q\x00", "ctl\x01", "topic://" + "x" * 256])
@pytest.mark.parametrize("attach", [attach_sender, attach_receiver])
def test_an_amqp_link_to_an_address_with_a_nul_or_too_long_is_refused(
    amqp_gateway: GatewayProcess, address: str, attach: Callable[..., bytes]
) -> None:
    """Raw frames: proton's own client cuts an address at its NUL before sending it (and the gateway's proton
    would too, when reading it: the gateway sees the NUL in the frame first)."""
    with Peer(amqp_gateway.port) as peer:
        peer.open()
        peer.begin()
        peer.send(attach("bad", 0, address))
        assert peer.expect(ATTACH).field(5 if attach is attach_receiver else 6) is None  # a null terminus
        detach = peer.expect(DETACH)
        assert detach.condition == "amqp:invalid-field", detach
        assert "the limit is 255" in str(detach.error) or "control character" in str(detach.error), detach
        peer.attach_sender("good", 1, "after-names")  # the connection goes on
    assert_amqp_serves(amqp_gateway, "after-names")
    assert amqp_gateway.log().count("amqp link refused") == 1
    assert "Traceback" not in amqp_gateway.log()


def _mqtt_string(text: bytes) -> bytes:
    return len(text).to_bytes(2, "big") + text


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("packet", ["publish", "subscribe"])
def test_an_mqtt_topic_with_a_nul_is_a_malformed_packet(
    mqtt_gateway: GatewayProcess, version: int, packet: str
) -> None:
    """MQTT forbids U+0000 in every string [MQTT-1.5.4-2]: the packet is malformed, so the connection ends
    (MQTT 5: DISCONNECT 0x81 Malformed Packet first), and the gateway goes on."""
    properties = b"\x00" if version == 5 else b""
    if packet == "publish":
        body = _mqtt_string(b"nul\x00topic") + properties + b"payload"
        data = b"\x30" + bytes([len(body)]) + body
    else:
        body = b"\x00\x01" + properties + _mqtt_string(b"nul/\x00/#") + b"\x01"
        data = b"\x82" + bytes([len(body)]) + body
    connect_body = _mqtt_string(b"MQTT") + bytes([version, 0x02]) + b"\x00\x3c" + properties + _mqtt_string(b"nul")
    with socket.create_connection(("127.0.0.1", mqtt_gateway.port), timeout=WAIT) as sock:
        sock.sendall(b"\x10" + bytes([len(connect_body)]) + connect_body)
        head = sock.recv(2)
        assert head[0] == 0x20, head  # CONNACK
        sock.recv(head[1])
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply == (b"\xe0\x01\x81" if version == 5 else b""), reply  # DISCONNECT Malformed Packet (5)
    assert mqtt_gateway.process.poll() is None
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", mqtt_gateway.port)
    client.loop_start()
    try:
        client.subscribe("after/names", qos=1)
        assert client.publish("after/names", b"fine", qos=1).wait_for_publish(WAIT) is None
    finally:
        client.loop_stop()
        client.disconnect()
    assert "Traceback" not in mqtt_gateway.log()


async def test_the_core_link_refuses_names_with_a_nul_and_the_link_goes_on(core: CoreProcess) -> None:
    async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as client:
        for make in (
            lambda: client.create_queue("q\x00", "names"),
            lambda: client.create_queue("names.q", "names\x00"),
            lambda: client.subscribe("names::q\x00"),
            lambda: client.subscribe("q\x00", address="names"),
            lambda: client.create_address("a\x00"),
            lambda: client.create_queue("x" * 256, "names"),
            lambda: client.publish(new_message("a\x00", b"x")),
        ):
            with pytest.raises(LinkRequestError) as refused:
                await make()
            assert refused.value.code == "invalid", refused.value
        assert (await client.create_queue("names.q", "names"))["created"]  # the same link goes on
    assert "Traceback" not in core.log()
