"""The STOMP gateway as a real process between real STOMP clients (stomp.py, raw sockets) and a real core."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import stomp
from stomp.utils import Frame
from tests.conftest import CoreProcess, GatewayProcess, module_core, module_stomp_gateway, start_core, start_gateway
from tests.integration.cluster_nodes import wait_until

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import M_BODY, M_CONTENT_TYPE, M_DURABLE, M_PROPS, RoutingType, new_message

pytestmark = pytest.mark.integration

WAIT = 10.0


class Listener(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.messages: list[Frame] = []
        self.errors: list[Frame] = []
        self.receipts: list[str] = []
        self.changed = threading.Condition()

    def on_message(self, frame: Frame) -> None:
        with self.changed:
            self.messages.append(frame)
            self.changed.notify_all()

    def on_error(self, frame: Frame) -> None:
        with self.changed:
            self.errors.append(frame)
            self.changed.notify_all()

    def on_receipt(self, frame: Frame) -> None:
        with self.changed:
            self.receipts.append(frame.headers["receipt-id"])
            self.changed.notify_all()

    def wait(self, condition: Callable[[], bool], what: str = "condition") -> None:
        with self.changed:
            assert self.changed.wait_for(condition, WAIT), f"timed out waiting for {what}"

    def wait_messages(self, count: int) -> list[Frame]:
        self.wait(lambda: len(self.messages) >= count, f"{count} messages (got {len(self.messages)})")
        return self.messages[:count]


def connect(gateway: GatewayProcess, version: str = "1.2", **kwargs: Any) -> tuple[stomp.Connection, Listener]:
    cls = {"1.0": stomp.Connection10, "1.1": stomp.Connection11, "1.2": stomp.Connection12}[version]
    connect_headers = kwargs.pop("connect_headers", {})
    conn = cls([("127.0.0.1", gateway.port)], **kwargs)
    listener = Listener()
    conn.set_listener("test", listener)
    if version == "1.0":
        conn.connect(username="app", passcode="secret", wait=True)
    else:
        conn.connect(username="app", passcode="secret", wait=True, headers=connect_headers)
    return conn, listener


# One core and one gateway for the module: each test keeps to destinations and client ids of its own.
core = module_core
stomp_gateway = module_stomp_gateway


@pytest.fixture
def gateway(stomp_gateway: GatewayProcess) -> GatewayProcess:
    return stomp_gateway


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2"])
def test_send_and_receive_with_headers_preserved_in_every_version(gateway: GatewayProcess, version: str) -> None:
    conn, listener = connect(gateway, version)
    conn.subscribe("/queue/orders", id="s1", ack="auto")
    headers = {"x-order": "42", "correlation-id": "c-1", "reply-to": "/queue/replies", "x-text": "with spaces"}
    conn.send("/queue/orders", "first order", content_type="text/plain", headers=headers, receipt="r1")
    [message] = listener.wait_messages(1)
    assert message.body == "first order"
    assert message.headers["destination"] == "/queue/orders"
    assert message.headers["subscription"] == "s1"
    assert message.headers["content-type"] == "text/plain"
    for name, value in headers.items():
        assert message.headers[name] == value
    listener.wait(lambda: "r1" in listener.receipts, "the SEND's receipt")
    conn.disconnect()


def test_a_message_names_the_destination_its_send_named(gateway: GatewayProcess) -> None:
    """A bare name or another broker's syntax is an address as it is, and comes back as it was sent."""
    conn, listener = connect(gateway)
    destinations = ["probe-bare", "/exchange/amq.direct/route", "/queue/probe-q", "/topic/probe-t"]
    for n, destination in enumerate(destinations):
        conn.subscribe(destination, id=f"s{n}", ack="auto", headers={"receipt": f"sub-{n}"})
        listener.wait(lambda n=n: f"sub-{n}" in listener.receipts, f"the SUBSCRIBE to {destination}")
    for destination in destinations:
        conn.send(destination, destination)
    got = {m.body: m.headers["destination"] for m in listener.wait_messages(len(destinations))}
    assert got == {destination: destination for destination in destinations}
    conn.disconnect()


def test_a_fully_qualified_queue_of_a_topic_is_made_on_the_topic_and_gets_its_messages(gateway: GatewayProcess) -> None:
    """``/topic/news::archive`` subscribes to the queue ``archive`` of the topic ``news`` (made on it when
    missing), as in Artemis: it was a subscription queue bound to an address named ``news::archive``."""
    topic = f"fq-{uuid.uuid4().hex[:8]}"
    conn, listener = connect(gateway)
    conn.subscribe(
        f"/topic/{topic}::{topic}-archive", id="a", ack="auto", headers={"receipt": "sub-a", "selector": "n <> '0'"}
    )
    listener.wait(lambda: "sub-a" in listener.receipts)
    for n in range(3):
        conn.send(f"/topic/{topic}", f"news {n}", headers={"n": str(n)})
    assert [m.body for m in listener.wait_messages(2)] == ["news 1", "news 2"]
    conn.disconnect()


def test_topic_fans_out_to_every_subscriber_and_queue_competes(gateway: GatewayProcess) -> None:
    conn, listener = connect(gateway)
    other, other_listener = connect(gateway)
    conn.subscribe("/topic/news", id="a", ack="auto", headers={"receipt": "sub-a"})
    other.subscribe("/topic/news", id="b", ack="auto", headers={"receipt": "sub-b"})
    listener.wait(lambda: "sub-a" in listener.receipts)
    other_listener.wait(lambda: "sub-b" in other_listener.receipts)
    for n in range(10):
        conn.send("/topic/news", f"news {n}")
    assert [m.body for m in listener.wait_messages(10)] == [f"news {n}" for n in range(10)]
    assert [m.body for m in other_listener.wait_messages(10)] == [f"news {n}" for n in range(10)]
    conn.disconnect()
    other.disconnect()


def test_client_individual_nack_redelivers_then_dead_letters(tmp_path: Path) -> None:
    core = start_core(tmp_path, config='[[address_settings]]\nmatch = "#"\nmax_delivery_attempts = 2\n')
    gateway = start_gateway(tmp_path, core)
    try:
        conn, listener = connect(gateway)
        conn.send("/queue/work", "poison", receipt="sent")
        listener.wait(lambda: "sent" in listener.receipts)
        conn.subscribe("/queue/work", id="w", ack="client-individual")
        first = listener.wait_messages(1)[0]
        assert "redelivered" not in first.headers
        conn.nack(first.headers["ack"])
        second = listener.wait_messages(2)[1]
        assert second.headers["redelivered"] == "true"
        assert second.headers["message-id"] == first.headers["message-id"]
        conn.nack(second.headers["ack"])
        conn.subscribe("/queue/DLQ", id="dlq", ack="auto")
        dead = listener.wait_messages(3)[2]
        assert dead.body == "poison"
        assert dead.headers["subscription"] == "dlq"
        assert dead.headers["_AMQ_ORIG_ADDRESS"] == "work"
        conn.disconnect()
    finally:
        assert gateway.stop() == 0
        core.stop()


def test_client_ack_is_cumulative_and_unacked_messages_return_when_the_connection_ends(
    gateway: GatewayProcess,
) -> None:
    conn, listener = connect(gateway)
    for n in range(6):
        conn.send("/queue/cumulative", f"m{n}")
    conn.subscribe("/queue/cumulative", id="c", ack="client")
    messages = listener.wait_messages(6)
    conn.ack(messages[3].headers["ack"])  # acknowledges m0..m3
    conn.disconnect(receipt="bye")
    assert not listener.errors, listener.errors[0].body
    again, again_listener = connect(gateway)
    again.subscribe("/queue/cumulative", id="c2", ack="auto")
    assert [m.body for m in again_listener.wait_messages(2)] == ["m4", "m5"]
    assert all(m.headers.get("redelivered") == "true" for m in again_listener.messages[:2])
    again.disconnect()


def test_transactions_cover_send_and_ack(gateway: GatewayProcess) -> None:
    conn, listener = connect(gateway)
    conn.send("/queue/tx.in", "input", receipt="in")
    listener.wait(lambda: "in" in listener.receipts)
    conn.subscribe("/queue/tx.in", id="in", ack="client-individual")
    [message] = listener.wait_messages(1)
    conn.begin("t1")
    conn.send("/queue/tx.out", "output", transaction="t1")
    conn.ack(message.headers["ack"], transaction="t1")
    conn.abort("t1")  # the ACK is undone: the input comes back; the output was never sent
    redelivered = listener.wait_messages(2)[1]
    assert redelivered.body == "input"
    assert redelivered.headers["redelivered"] == "true"
    conn.begin("t2")
    conn.send("/queue/tx.out", "output", transaction="t2")
    conn.ack(redelivered.headers["ack"], transaction="t2")
    conn.commit("t2", headers={"receipt": "committed"})
    listener.wait(lambda: "committed" in listener.receipts)
    conn.subscribe("/queue/tx.out", id="out", ack="auto")
    assert listener.wait_messages(3)[2].body == "output"
    conn.unsubscribe("in")
    conn.subscribe("/queue/tx.in", id="in-again", ack="auto", headers={"receipt": "again"})
    listener.wait(lambda: "again" in listener.receipts)
    time.sleep(0.3)
    assert len(listener.messages) == 3  # the committed ACK consumed the input
    conn.disconnect()


def test_request_reply_through_a_temporary_queue(gateway: GatewayProcess, core: CoreProcess) -> None:
    requester, requests = connect(gateway)
    server, served = connect(gateway)
    server.subscribe("/queue/service", id="svc", ack="auto", headers={"receipt": "ready"})
    served.wait(lambda: "ready" in served.receipts)
    requester.subscribe("/temp-queue/replies", id="r", ack="auto")
    requester.send("/queue/service", "ping", headers={"reply-to": "/temp-queue/replies", "correlation-id": "c7"})
    [request] = served.wait_messages(1)
    reply_to = request.headers["reply-to"]
    assert reply_to.startswith("/queue/tmp.")  # a name any client can send to
    server.send(reply_to, "pong", headers={"correlation-id": request.headers["correlation-id"]})
    [reply] = requests.wait_messages(1)
    assert (reply.body, reply.headers["correlation-id"]) == ("pong", "c7")
    assert reply.headers["destination"] == "/temp-queue/replies"
    assert temporary_queues(core) == [reply_to.removeprefix("/queue/")]
    requester.disconnect()  # the temporary queue goes with its connection
    server.send(reply_to, "too late", receipt="late")
    served.wait(lambda: "late" in served.receipts, "the late reply's receipt")  # accepted, and dropped:
    assert not temporary_queues(core)  # no queue was created to keep it
    server.disconnect()


def acked_in_core(core: CoreProcess, addresses: tuple[str, ...]) -> int:
    """Acknowledgements the core counted on the queues of ``addresses``."""
    with urlopen(f"{core.management_url}/api/queues", timeout=WAIT) as response:
        return sum(q["acked"] for q in json.loads(response.read()) if q["address"] in addresses)


def temporary_queues(core: CoreProcess) -> list[str]:
    with urlopen(f"{core.management_url}/api/queues", timeout=WAIT) as response:
        return [q["name"] for q in json.loads(response.read()) if q["name"].startswith("tmp.")]


def test_a_selector_filters_what_a_subscription_gets(gateway: GatewayProcess) -> None:
    conn, listener = connect(gateway)
    conn.subscribe("/queue/selected", id="s", ack="auto", headers={"selector": "colour = 'red'"})
    for colour in ("blue", "red", "green", "red"):
        conn.send("/queue/selected", colour, headers={"colour": colour})
    assert [m.body for m in listener.wait_messages(2)] == ["red", "red"]
    conn.disconnect()


def test_a_durable_subscription_keeps_messages_across_a_gateway_restart(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, name="first")
    conn, listener = connect(gateway, connect_headers={"client-id": "app-1"})
    conn.subscribe(
        "/topic/events",
        id="d",
        ack="client-individual",
        headers={"durable-subscription-name": "audit", "receipt": "subscribed"},
    )
    listener.wait(lambda: "subscribed" in listener.receipts)
    conn.disconnect()
    assert gateway.stop() == 0
    replacement = start_gateway(tmp_path, core, name="second")
    try:
        producer, producer_listener = connect(replacement)
        for n in range(3):
            producer.send("/topic/events", f"event {n}", headers={"persistent": "true"}, receipt=f"e{n}")
        producer_listener.wait(lambda: len(producer_listener.receipts) == 3)
        again, again_listener = connect(replacement, connect_headers={"client-id": "app-1"})
        again.subscribe(
            "/topic/events", id="d", ack="client-individual", headers={"durable-subscription-name": "audit"}
        )
        assert [m.body for m in again_listener.wait_messages(3)] == [f"event {n}" for n in range(3)]
        for message in again_listener.messages:
            again.ack(message.headers["ack"])
        again.unsubscribe("d", headers={"durable-subscription-name": "audit", "receipt": "gone"})
        again_listener.wait(lambda: "gone" in again_listener.receipts)
        again.disconnect()
        producer.disconnect()
    finally:
        assert replacement.stop() == 0


def test_a_durable_subscription_with_a_new_selector_or_topic_starts_afresh(gateway: GatewayProcess) -> None:
    conn, listener = connect(gateway, connect_headers={"client-id": "app-3"})
    durable = {"durable-subscription-name": "picky"}
    conn.subscribe("/topic/colours", id="d", ack="auto", headers={**durable, "selector": "c = 'red'", "receipt": "1"})
    listener.wait(lambda: "1" in listener.receipts)
    conn.unsubscribe("d", headers={"receipt": "2"})  # detach only: the subscription keeps collecting
    listener.wait(lambda: "2" in listener.receipts)
    for colour in ("red", "blue", "red"):
        conn.send("/topic/colours", colour, headers={"c": colour, "persistent": "true"}, receipt=f"s-{colour}")
    listener.wait(lambda: len(listener.receipts) == 5)  # all three sends confirmed (two share a receipt id)
    conn.subscribe("/topic/colours", id="d", ack="auto", headers={**durable, "selector": "c = 'blue'", "receipt": "3"})
    listener.wait(lambda: "3" in listener.receipts)
    conn.send("/topic/colours", "blue", headers={"c": "blue"})
    conn.send("/topic/colours", "red", headers={"c": "red"}, receipt="4")
    listener.wait(lambda: "4" in listener.receipts)
    assert [m.body for m in listener.wait_messages(1)] == ["blue"]  # the reds kept for the old selector went
    conn.unsubscribe("d", headers={"receipt": "5"})
    listener.wait(lambda: "5" in listener.receipts)
    conn.subscribe("/topic/shapes", id="d", ack="auto", headers={**durable, "receipt": "6"})  # another topic
    listener.wait(lambda: "6" in listener.receipts)
    conn.send("/topic/shapes", "square", receipt="7")
    listener.wait(lambda: len(listener.messages) == 2)
    assert listener.messages[1].body == "square"
    assert not listener.errors
    conn.unsubscribe("d", headers={**durable, "receipt": "8"})
    listener.wait(lambda: "8" in listener.receipts)
    conn.disconnect()


def test_unacknowledged_deliveries_return_when_the_gateway_is_killed(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, name="doomed")
    conn, listener = connect(gateway, connect_headers={"client-id": "app-2"})
    conn.subscribe(
        "/topic/jobs",
        id="d",
        ack="client-individual",
        headers={"durable-subscription-name": "worker", "receipt": "subscribed"},
    )
    listener.wait(lambda: "subscribed" in listener.receipts)
    for n in range(4):
        conn.send("/topic/jobs", f"job {n}", headers={"persistent": "true"}, receipt=f"j{n}")
        conn.send("/queue/work", f"work {n}", headers={"persistent": "true"}, receipt=f"w{n}")
    conn.subscribe("/queue/work", id="q", ack="client-individual")
    listener.wait(lambda: len(listener.messages) == 8, "8 deliveries")
    conn.ack(listener.messages[0].headers["ack"], receipt="acked")
    listener.wait(lambda: "acked" in listener.receipts)
    # The RECEIPT says the gateway took the ACK; it passes it on to the core without waiting (see docs/stomp.md).
    wait_until(lambda: acked_in_core(core, ("jobs", "work")) == 1, WAIT, "the acknowledgement in the core")
    gateway.process.kill()  # no goodbye: the core only sees the gateway's links drop
    gateway.process.wait()
    replacement = start_gateway(tmp_path, core, name="replacement")
    try:
        again, again_listener = connect(replacement, connect_headers={"client-id": "app-2"})
        again.subscribe("/topic/jobs", id="d", ack="auto", headers={"durable-subscription-name": "worker"})
        again.subscribe("/queue/work", id="q", ack="auto")
        returned = again_listener.wait_messages(7)
        acked = listener.messages[0].body
        expected = {f"job {n}" for n in range(4)} | {f"work {n}" for n in range(4)}
        assert sorted(m.body for m in returned) == sorted(expected - {acked})
        assert all(m.headers.get("redelivered") == "true" for m in returned)
        again.unsubscribe("d", headers={"durable-subscription-name": "worker", "receipt": "gone"})
        again_listener.wait(lambda: "gone" in again_listener.receipts)
        again.disconnect()
    finally:
        assert replacement.stop() == 0


def test_a_link_client_message_reaches_a_stomp_consumer_with_its_properties(
    gateway: GatewayProcess, core: CoreProcess
) -> None:
    conn, listener = connect(gateway)
    conn.subscribe("/queue/from.link", id="s", ack="auto", headers={"receipt": "ready"})
    listener.wait(lambda: "ready" in listener.receipts)

    async def publish() -> None:
        async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as client:
            properties = {"count": 3, "ratio": 0.5, "flag": True, "text": "a:b\\c", "correlation-id": "c-9"}
            await client.publish(
                new_message(
                    "from.link",
                    b"\x01bytes\x00",
                    routing=RoutingType.ANYCAST,
                    durable=True,
                    priority=7,
                    properties=properties,
                    content_type="application/x-test",
                )
            )

    import asyncio  # noqa: PLC0415

    asyncio.run(publish())
    [message] = listener.wait_messages(1)
    assert message.headers["destination"] == "/queue/from.link"
    assert (message.headers["persistent"], message.headers["priority"]) == ("true", "7")
    assert message.headers["content-type"] == "application/x-test"
    assert {k: message.headers[k] for k in ("count", "ratio", "flag", "text", "correlation-id")} == {
        "count": "3",
        "ratio": "0.5",
        "flag": "true",
        "text": "a:b\\c",
        "correlation-id": "c-9",
    }
    assert message.headers["content-length"] == "7"
    conn.disconnect()


def test_persistent_messages_survive_a_core_restart(tmp_path: Path) -> None:
    core = start_core(tmp_path)
    port = core.link_port
    gateway = start_gateway(tmp_path, core)
    conn, listener = connect(gateway)
    for n in range(5):
        conn.send("/queue/keep", f"kept {n}", headers={"persistent": "true"}, receipt=f"k{n}")
    listener.wait(lambda: len(listener.receipts) == 5)
    conn.disconnect()
    assert gateway.stop() == 0
    core.process.kill()
    core.process.wait()
    core = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
    gateway = start_gateway(tmp_path, core)
    try:
        conn, listener = connect(gateway)
        conn.subscribe("/queue/keep", id="k", ack="auto")
        messages = listener.wait_messages(5)
        assert [m.body for m in messages] == [f"kept {n}" for n in range(5)]
        assert all(m.headers["persistent"] == "true" for m in messages)
        conn.disconnect()
    finally:
        assert gateway.stop() == 0
        core.stop()


def test_a_lost_links_frame_and_its_redelivery_are_each_acknowledged(tmp_path: Path) -> None:
    """The core restarts under a client that holds a message: the gateway's link comes back and the message is
    redelivered with the same ack header before the client acknowledged the first frame. Both ACKs are
    accepted (no ERROR: the connection goes on), the message is settled, and the window stays one message."""
    core = start_core(tmp_path)
    port = core.link_port
    gateway = start_gateway(tmp_path, core)
    conn, listener = connect(gateway)
    other, other_listener = connect(gateway)
    try:
        conn.subscribe(
            "/queue/twice", id="t", ack="client-individual", headers={"consumer-window-size": "1", "receipt": "sub"}
        )
        listener.wait(lambda: "sub" in listener.receipts, "the SUBSCRIBE's receipt")
        conn.send("/queue/twice", "held", headers={"persistent": "true"}, receipt="sent")
        first = listener.wait_messages(1)[0]
        core.process.kill()
        core.process.wait()
        core = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
        second = listener.wait_messages(2)[1]
        assert (second.body, second.headers["redelivered"]) == ("held", "true")
        assert second.headers["ack"] == first.headers["ack"]
        for n, frame in enumerate((first, second)):
            conn.ack(frame.headers["ack"], receipt=f"ack{n}")
        listener.wait(lambda: {"ack0", "ack1"} <= set(listener.receipts) or bool(listener.errors), "the ACKs")
        assert not listener.errors, listener.errors[0].body
        for n in range(2):
            conn.send("/queue/twice", f"m{n}", headers={"persistent": "true"}, receipt=f"m{n}")
        listener.wait(lambda: len(listener.messages) == 3 and {"m0", "m1"} <= set(listener.receipts), "m0")
        # The acknowledged message is gone and the window is still one: m1 waits for another consumer.
        other.subscribe("/queue/twice", id="o", ack="client-individual")
        assert [m.body for m in other_listener.wait_messages(1)] == ["m1"]
        assert [m.body for m in listener.messages] == ["held", "held", "m0"]
        assert not listener.errors
    finally:
        conn.disconnect()
        other.disconnect()
        assert gateway.stop() == 0
        core.stop()


def test_an_ack_receipt_waits_for_the_core_and_a_core_lost_first_gets_an_error(tmp_path: Path) -> None:
    """A RECEIPT to an ACK means the broker has it. While the core is paused (SIGSTOP, shorter than the link's
    failure detection) the RECEIPT does not come, and once it runs it does. When the core dies before it
    answered, the client gets an ERROR instead, and the restarted core delivers that message again (and not
    the one whose RECEIPT came)."""
    core = start_core(tmp_path)
    port = core.link_port
    gateway = start_gateway(tmp_path, core)
    conn, listener = connect(gateway)
    other, other_listener = connect(gateway)
    try:
        conn.subscribe("/queue/acked", id="a", ack="client-individual", headers={"receipt": "sub"})
        listener.wait(lambda: "sub" in listener.receipts, "the SUBSCRIBE's receipt")
        for n in range(2):
            conn.send("/queue/acked", f"m{n}", headers={"persistent": "true"}, receipt=f"m{n}")
        first, second = listener.wait_messages(2)
        listener.wait(lambda: {"m0", "m1"} <= set(listener.receipts), "the SENDs' receipts")
        core.process.send_signal(signal.SIGSTOP)
        try:
            conn.ack(first.headers["ack"], receipt="ack0")
            time.sleep(0.5)
            assert "ack0" not in listener.receipts  # the core has not seen it
        finally:
            core.process.send_signal(signal.SIGCONT)
        listener.wait(lambda: "ack0" in listener.receipts, "the ACK's receipt once the core answered")
        core.process.send_signal(signal.SIGSTOP)
        conn.ack(second.headers["ack"], receipt="ack1")
        time.sleep(0.3)
        core.process.kill()
        core.process.wait()
        listener.wait(lambda: bool(listener.errors), "an ERROR for the ACK the core never answered")
        assert "ack1" not in listener.receipts
        assert listener.errors[0].headers["receipt-id"] == "ack1"
        core = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
        other.subscribe("/queue/acked", id="b", ack="client-individual")
        [again] = other_listener.wait_messages(1)
        assert (again.body, again.headers["redelivered"]) == ("m1", "true")
        time.sleep(0.3)
        assert len(other_listener.messages) == 1  # m0's acknowledgement was on disk when its RECEIPT came
    finally:
        for client in (conn, other):
            with contextlib.suppress(Exception):
                client.disconnect()
        assert gateway.stop() == 0
        core.stop()


def test_a_stomp_message_reaches_a_link_consumer_intact(gateway: GatewayProcess, core: CoreProcess) -> None:
    conn, listener = connect(gateway)
    conn.send(
        "/queue/cross",
        b"\x00binary\xffbody",
        content_type="application/octet-stream",
        headers={"persistent": "true", "x-key": "v"},
        receipt="sent",
    )
    listener.wait(lambda: "sent" in listener.receipts)
    conn.disconnect()

    async def take() -> list[Any]:
        async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as client:
            consumer = await client.subscribe("cross", auto_ack=True)
            delivery = await consumer.get(timeout=WAIT)
            assert delivery is not None
            return delivery.message

    import asyncio  # noqa: PLC0415

    message = asyncio.run(take())
    assert message[M_BODY] == b"\x00binary\xffbody"
    assert message[M_CONTENT_TYPE] == "application/octet-stream"
    assert message[M_DURABLE] is True
    assert message[M_PROPS]["x-key"] == "v"


def test_bad_credentials_get_an_error(tmp_path: Path) -> None:
    users = '[[users]]\nname = "app"\npassword = "secret"\nroles = ["all"]\n'
    core = start_core(tmp_path, config=users + '[[permissions]]\nmatch = "#"\npermission = "send"\nroles = ["all"]\n')
    gateway = start_gateway(tmp_path, core)
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
            sock.sendall(b"CONNECT\naccept-version:1.2\nlogin:app\npasscode:wrong\n\n\x00")
            reply = read_until_closed(sock)
        assert reply.startswith(b"ERROR\nmessage:authentication failed\n")
        conn, listener = connect(gateway)  # the right passcode
        conn.subscribe("/queue/secret", id="s", ack="auto", headers={"receipt": "r"})
        listener.wait(lambda: bool(listener.errors), "an ERROR for the missing consume permission")
        assert listener.errors[0].headers["message"] == "permission denied"
        assert listener.errors[0].headers["receipt-id"] == "r"
    finally:
        assert gateway.stop() == 0
        core.stop()


def test_a_wildcard_subscription_needs_consume_on_every_address_it_matches(tmp_path: Path) -> None:
    """The core's rule for every protocol: consume on sensors.* does not cover /topic/sensors.# (issue 22)."""
    grants = "".join(
        f'[[permissions]]\nmatch = "{match}"\npermission = "{permission}"\nroles = ["all"]\n'
        for match, permission in [
            ("#", "send"),
            ("#", "createAddress"),
            ("#", "createNonDurableQueue"),
            ("#", "deleteNonDurableQueue"),
            ("sensors.*", "consume"),
        ]
    )
    core = start_core(tmp_path, config='[[users]]\nname = "app"\npassword = "secret"\nroles = ["all"]\n' + grants)
    gateway = start_gateway(tmp_path, core)
    try:
        conn, listener = connect(gateway)
        conn.subscribe("/topic/sensors.#", id="deep", ack="auto", headers={"receipt": "deep"})
        listener.wait(lambda: bool(listener.errors), "an ERROR for the filter reaching sensors.a.b")
        assert listener.errors[0].headers["message"] == "permission denied"
        conn, listener = connect(gateway)
        conn.subscribe("/topic/sensors.*", id="level", ack="auto", headers={"receipt": "level"})
        listener.wait(lambda: "level" in listener.receipts, "the subscription's receipt")
        conn.send("/topic/sensors.a.b", "too deep")
        conn.send("/topic/sensors.a", "one level")
        assert [m.body for m in listener.wait_messages(1)] == ["one level"]
        assert not listener.errors
        conn.disconnect()
    finally:
        assert gateway.stop() == 0
        core.stop()


# ---------------------------------------------------------------------------------------------------- raw frames
def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def raw(gateway: GatewayProcess) -> Callable[[bytes], bytes]:
    def exchange(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
            sock.sendall(data)
            return read_until_closed(sock)

    return exchange


CONNECT = b"CONNECT\naccept-version:1.2\nhost:anything\n\n\x00"


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (b"FLY\n\n\x00", "unknown command"),
        (b"SEND\nreceipt:9\n\nno destination\x00", "missing header"),
        (b"SEND\ndestination:/queue/x\ncontent-length:2\n\nabc\x00", "malformed frame"),
        (b"SEND\ndestination:/queue/x\nbad\\escape:1\n\n\x00", "malformed frame"),
        (b"SEND\ndestination:/queue/x\ncontent-length:99999999\n\n", "frame too large"),
        (b"SEND\n" + b"h:v\n" * 200 + b"\n\x00", "frame too large"),
        (b"ACK\nid:1-1\n\n\x00", "unknown ack id"),
        (b"COMMIT\ntransaction:never\n\n\x00", "no such transaction"),
        (b"SEND\ndestination:/queue/bad#name\nreceipt:r\n\nx\x00", "send refused"),
        (b"SEND\ndestination:/queue/bad#name\n\nno receipt asked\x00", "send refused"),
        (b"SEND\ndestination:/queue/x\npriority:high\n\nx\x00", "invalid header"),
        (b"SEND\ndestination:orders::audit\n\nx\x00", "invalid header"),  # a queue, not an address
        (b"NACK\nid:1-1\ntransaction:never\n\n\x00", "unknown ack id"),
    ],
)
def test_bad_frames_get_an_error_frame_then_the_connection_closes(
    raw: Callable[[bytes], bytes], frames: bytes, message: str
) -> None:
    reply = raw(CONNECT + frames)
    assert reply.startswith(b"CONNECTED\nversion:1.2\n")
    assert re.search(rb"ERROR\nmessage:" + message.encode() + rb"\n", reply), reply


def test_frames_before_connect_and_unsupported_versions_are_refused(raw: Callable[[bytes], bytes]) -> None:
    assert raw(b"SEND\ndestination:/queue/x\n\n\x00").startswith(b"ERROR\nmessage:not connected\n")
    reply = raw(b"CONNECT\naccept-version:3.0\n\n\x00")
    assert reply.startswith(b"ERROR\nversion:1.0,1.1,1.2\n")


def test_escaped_headers_come_back_escaped(raw: Callable[[bytes], bytes]) -> None:
    reply = raw(
        CONNECT + b"SUBSCRIBE\nid:0\ndestination:/queue/escaped\n\n\x00"
        b"SEND\ndestination:/queue/escaped\nkey\\cwith\\ccolons:line\\none\\\\two\\r\n\nx\x00"
        b"DISCONNECT\nreceipt:done\n\n\x00"
    )
    assert b"\nkey\\cwith\\ccolons:line\\none\\\\two\\r\n" in reply


def test_frames_pipelined_before_a_disconnect_are_all_handled(
    raw: Callable[[bytes], bytes], gateway: GatewayProcess
) -> None:
    reply = raw(
        CONNECT + b"BEGIN\ntransaction:t\n\n\x00SEND\ndestination:/queue/piped\ntransaction:t\n\nin tx\x00"
        b"COMMIT\ntransaction:t\n\n\x00SEND\ndestination:/queue/piped\n\nplain\x00DISCONNECT\n\n\x00"
        b"SEND\ndestination:/queue/piped\n\nafter the end\x00"
    )
    assert reply.startswith(b"CONNECTED\n")
    assert b"ERROR" not in reply
    conn, listener = connect(gateway)
    conn.subscribe("/queue/piped", id="p", ack="auto")
    assert [m.body for m in listener.wait_messages(2)] == ["in tx", "plain"]
    conn.disconnect(receipt="bye")
    assert [m.body for m in listener.messages] == ["in tx", "plain"]  # nothing read after the DISCONNECT


@pytest.mark.parametrize(
    "frame",
    [
        b"SEND\ndestination:/queue/x\ncontent-length:\xd9\xa1\n\nx\x00",  # an Arabic-Indic digit
        b"SUBSCRIBE\nid:1\ndestination:/queue/x\nconsumer-window-size:--1\nreceipt:r\n\n\x00",
        b"ACK\nid:\xc2\xb2-1\n\n\x00",  # a superscript two
    ],
)
def test_odd_numbers_in_headers_get_an_error_frame(raw: Callable[[bytes], bytes], frame: bytes) -> None:
    reply = raw(CONNECT + frame + b"DISCONNECT\n\n\x00")
    assert reply.startswith(b"CONNECTED\n")
    assert b"ERROR\nmessage:" in reply or b"RECEIPT\nreceipt-id:r" in reply  # a window it cannot read: default


def test_auto_ack_messages_the_client_was_not_sent_stay_in_the_queue(gateway: GatewayProcess) -> None:
    producer, producer_listener = connect(gateway)
    for n in range(50):
        producer.send("/queue/held", f"m{n}", receipt=f"s{n}")
    producer_listener.wait(lambda: len(producer_listener.receipts) == 50)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
        sock.sendall(CONNECT + b"SUBSCRIBE\nid:1\ndestination:/queue/held\nack:auto\nconsumer-window-size:5\n\n\x00")
        got = b""
        while got.count(b"MESSAGE\n") < 5:
            got += sock.recv(65536)
        sock.sendall(b"UNSUBSCRIBE\nid:1\nreceipt:u\n\n\x00")
        while b"receipt-id:u" not in got:
            got += sock.recv(65536)
    received = got.count(b"MESSAGE\n")  # written to the client: consumed; the rest never left the core
    producer.subscribe("/queue/held", id="rest", ack="auto")
    rest = producer_listener.wait_messages(50 - received)
    assert [m.body for m in rest] == [f"m{n}" for n in range(received, 50)]
    producer.disconnect()


def test_client_mode_prefetch_holds_back_no_more_than_the_window(gateway: GatewayProcess) -> None:
    first, first_listener = connect(gateway)
    second, second_listener = connect(gateway)
    first.subscribe(
        "/queue/fair", id="a", ack="client-individual", headers={"consumer-window-size": "1", "receipt": "a"}
    )
    first_listener.wait(lambda: "a" in first_listener.receipts)
    for n in range(4):
        first.send("/queue/fair", f"m{n}", receipt=f"s{n}")
    first_listener.wait(lambda: len(first_listener.messages) == 1 and len(first_listener.receipts) == 5)
    second.subscribe("/queue/fair", id="b", ack="client-individual")
    # The first subscriber holds exactly one message: the other three are free for the second.
    assert sorted(m.body for m in second_listener.wait_messages(3)) == ["m1", "m2", "m3"]
    assert [m.body for m in first_listener.messages] == ["m0"]
    first.disconnect()
    second.disconnect()


def test_stomp_10_header_values_are_trimmed(raw: Callable[[bytes], bytes]) -> None:
    reply = raw(
        b"CONNECT\n\n\x00SUBSCRIBE\ndestination: /queue/padded \n\n\x00"
        b"SEND\ndestination: /queue/padded\ncontent-length: 2\n\nhi\x00"
        b"DISCONNECT\nreceipt:done\n\n\x00"
    )
    assert b"MESSAGE\ndestination:/queue/padded\n" in reply
    assert reply.endswith(b"RECEIPT\nreceipt-id:done\n\n\x00")


def test_a_client_that_half_closes_after_disconnect_still_gets_its_receipt(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
        sock.sendall(
            CONNECT + b"SEND\ndestination:/queue/half\npersistent:true\n\nx\x00DISCONNECT\nreceipt:bye\n\n\x00"
        )
        sock.shutdown(socket.SHUT_WR)
        reply = read_until_closed(sock)
    assert reply.endswith(b"RECEIPT\nreceipt-id:bye\n\n\x00")


def test_a_client_that_half_closes_without_disconnect_gets_the_receipts_of_its_frames(
    gateway: GatewayProcess,
) -> None:
    sends = b"".join(
        b"SEND\ndestination:/queue/half-eof\npersistent:true\nreceipt:r%d\n\nm%d\x00" % (i, i) for i in range(3)
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
        sock.sendall(CONNECT + sends + b"SUBSCRIBE\nid:0\ndestination:/queue/other\nreceipt:sub\n\n\x00")
        sock.shutdown(socket.SHUT_WR)  # no DISCONNECT: the socket's read side stays open
        reply = read_until_closed(sock)
    assert re.findall(rb"receipt-id:([^\n]*)", reply) == [b"r0", b"r1", b"r2", b"sub"]
    conn, listener = connect(gateway)
    try:
        conn.subscribe("/queue/half-eof", id="s", ack="auto")
        assert [m.body for m in listener.wait_messages(3)] == ["m0", "m1", "m2"]
    finally:
        conn.disconnect()


def test_a_one_thread_client_that_sends_a_burst_before_reading_is_not_deadlocked(gateway: GatewayProcess) -> None:
    """The client blocks in its writes and reads only after its burst, while its own subscription fills its
    socket (an echo): the gateway goes on reading and handling its SENDs, so the burst is taken whole."""
    count, body = 30_000, b"x" * 1024  # about 30 MiB each way: more than the sockets' buffers hold
    sends = b"".join(b"SEND\ndestination:/queue/echo-burst\nreceipt:%d\n\n%s\x00" % (n, body) for n in range(count))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
        sock.sendall(CONNECT + b"SUBSCRIBE\nid:0\ndestination:/queue/echo-burst\n\n\x00")
        sock.sendall(sends + b"DISCONNECT\nreceipt:bye\n\n\x00")  # timed out here before (a deadlock)
        reply = read_until_closed(sock)
    assert re.findall(rb"\nreceipt-id:([^\n]*)", reply) == [b"%d" % n for n in range(count)] + [b"bye"]
    assert reply.count(b"MESSAGE\n") > 0


def test_frames_split_at_every_byte_over_the_socket(gateway: GatewayProcess) -> None:
    data = (
        CONNECT + b"SUBSCRIBE\nid:0\ndestination:/queue/split\n\n\x00"
        b"SEND\r\ndestination:/queue/split\r\ncontent-length:3\r\n\r\na\x00b\x00\n\n"
        b"DISCONNECT\nreceipt:done\n\n\x00"
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
        for byte in data:
            sock.sendall(bytes([byte]))
        reply = read_until_closed(sock)
    assert b"MESSAGE\n" in reply
    assert b"\n\na\x00b\x00" in reply  # the body with its NUL, framed by content-length
    assert reply.endswith(b"RECEIPT\nreceipt-id:done\n\n\x00")


def test_a_silent_client_is_disconnected_after_a_missed_heartbeat(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, TRIDENTMQ_STOMP_STOMP_HEARTBEAT_RECEIVE_MS="200")
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
            sock.sendall(b"CONNECT\naccept-version:1.2\nheart-beat:100,0\n\n\x00")
            started = time.monotonic()
            reply = read_until_closed(sock)
        assert b"heart-beat:0,200\n" in reply  # we expect one every max(100, 200) ms
        assert b"ERROR\nmessage:heart-beat missed\n" in reply
        assert time.monotonic() - started < 5
    finally:
        assert gateway.stop() == 0


def test_heartbeats_keep_an_idle_stomp_py_connection_alive(gateway: GatewayProcess) -> None:
    conn, listener = connect(gateway, heartbeats=(100, 100))
    time.sleep(1.0)
    conn.send("/queue/alive", "still here")
    conn.subscribe("/queue/alive", id="a", ack="auto")
    assert listener.wait_messages(1)[0].body == "still here"
    assert not listener.errors
    conn.disconnect()


def test_websocket_clients_with_and_without_a_subprotocol(gateway: GatewayProcess) -> None:
    conn = stomp.WSConnection([("127.0.0.1", gateway.ports["websocket"])], ws_path="/stomp")
    listener = Listener()
    conn.set_listener("ws", listener)
    conn.connect(username="app", passcode="secret", wait=True)
    conn.subscribe("/queue/ws", id="w", ack="auto")
    conn.send("/queue/ws", "over websocket")
    assert listener.wait_messages(1)[0].body == "over websocket"
    conn.disconnect()


def test_health_ready_and_metrics(gateway: GatewayProcess) -> None:
    import json  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    base = f"http://127.0.0.1:{gateway.ports['http']}"
    with urllib.request.urlopen(base + "/readyz", timeout=WAIT) as response:
        assert json.loads(response.read())["status"] == "ready"
    conn, _ = connect(gateway)
    conn.send("/queue/metrics", "m", receipt="r")
    conn.disconnect()
    with urllib.request.urlopen(base + "/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    assert re.search(r"^tridentmq_stomp_messages_published_total [1-9]", text, re.M)
    assert re.search(r"^tridentmq_stomp_connections_total [1-9]", text, re.M)


def test_an_unsubscribe_with_a_durable_header_leaves_a_queue_it_only_consumed(stomp_gateway: GatewayProcess) -> None:
    """Only a durable subscription's own queue ends with UNSUBSCRIBE and the durable header: a queue the client
    merely consumed keeps its messages (it was deleted, on every node of a cluster)."""
    queue = f"orders-{uuid.uuid4().hex[:8]}"
    conn, listener = connect(stomp_gateway, connect_headers={"client-id": f"app-{uuid.uuid4().hex[:8]}"})
    try:
        conn.send(f"/queue/{queue}", "kept", headers={"persistent": "true"}, receipt="sent")
        listener.wait(lambda: "sent" in listener.receipts, "the SEND's receipt")
        conn.subscribe(f"/queue/{queue}", id="q", ack="auto", headers={"selector": "n = 1", "receipt": "sub"})
        listener.wait(lambda: "sub" in listener.receipts, "the SUBSCRIBE")
        conn.unsubscribe("q", headers={"durable-subscription-name": "q", "receipt": "unsub"})
        listener.wait(lambda: "unsub" in listener.receipts, "the UNSUBSCRIBE")
        conn.subscribe(f"/queue/{queue}", id="again", ack="auto")
        assert [m.body for m in listener.wait_messages(1)] == ["kept"]
        assert listener.errors == []
    finally:
        conn.disconnect()
