"""Failback is a pause like a failover: clients of every protocol, publishing and consuming through it, see
no error and no disconnect, and every acknowledged message arrives (real core, gateway and client processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from proton import Message, Timeout
from proton.utils import BlockingConnection
from stomp.utils import Frame
from tests.conftest import CoreProcess, GatewayProcess, start_gateway, stop_cleanly
from tests.integration.cluster_nodes import node_id, start_node, wait_until
from tests.integration.ha_pairs import Pair, ha_view, start_pair
from tests.integration.mqtt_clients import Paho
from tests.integration.test_ha import kill, reread_ports
from tests.integration.test_stomp_gateway import connect as stomp_connect
from tests.jepsen.checker import Delivery, check

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.fault]

WAIT = 20.0


class Producer:
    """Publishes ``prefix-0``, ``prefix-1``, ... one at a time with ``publish`` (which returns once the broker
    acknowledged it) on its own thread until stopped; a failure is kept, not retried."""

    def __init__(self, prefix: str, publish: Callable[[str], None]) -> None:
        self.prefix = prefix
        self.publish = publish
        self.acked: list[str] = []
        self.attempted: list[str] = []
        self.failure: BaseException | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            body = f"{self.prefix}-{len(self.attempted)}"
            self.attempted.append(body)
            try:
                self.publish(body)
            except BaseException as exc:  # reported by the test
                self.failure = exc
                return
            self.acked.append(body)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(WAIT)


def stomp_publisher(gateway: GatewayProcess) -> Callable[[str], None]:
    conn, listener = stomp_connect(gateway)

    def publish(body: str) -> None:
        receipt = f"r-{body}"
        conn.send("/queue/fb.stomp", body, receipt=receipt, headers={"persistent": "true"})
        listener.wait(lambda: receipt in listener.receipts or bool(listener.errors), f"the receipt {receipt}")
        assert not listener.errors, listener.errors[0].body

    return publish


def amqp_publisher(gateway: GatewayProcess) -> Callable[[str], None]:
    sender = BlockingConnection(f"amqp://127.0.0.1:{gateway.port}", timeout=WAIT).create_sender("fb.amqp")
    return lambda body: sender.send(Message(body=body, durable=True))  # returns once accepted


def mqtt_publisher(gateway: GatewayProcess) -> tuple[Paho, Callable[[str], None]]:
    client = Paho(gateway.port, "fb-pub", clean=False)
    client.connect(expiry=300)

    def publish(body: str) -> None:
        client.publish("fb/mqtt", body.encode(), 1)  # returns once PUBACKed

    return client, publish


class AmqpReceiver:
    """A receiver on its own connection and thread, accepting what it gets."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.connection = BlockingConnection(f"amqp://127.0.0.1:{gateway.port}", timeout=WAIT)
        self.receiver = self.connection.create_receiver("fb.amqp", credit=50)
        self.got: list[Delivery[str]] = []
        self.failure: BaseException | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                message = self.receiver.receive(timeout=0.5)
            except Timeout:
                continue
            except BaseException as exc:  # reported by the test
                self.failure = exc
                return
            self.got.append(Delivery(str(message.body), message.delivery_count > 0))
            self.receiver.accept()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(WAIT)
        with contextlib.suppress(Exception):
            self.connection.close()


def _queues(node: CoreProcess) -> str:
    """The test's queues on ``node`` as its management API shows them, for a failure's report."""
    try:
        with urllib.request.urlopen(node.management_url + "/api/queues", timeout=5) as response:
            queues = json.loads(response.read())
    except (urllib.error.URLError, OSError) as exc:
        return f"{node.data_dir.name}: unreachable ({exc})"
    keys = ("message_count", "consumers", "in_flight")
    return f"{node.data_dir.name}: " + "; ".join(
        f"{q['name']} {[q.get(k) for k in keys]}" for q in queues if q["name"].startswith("fb.")
    )


def _warnings(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if " WARNING " in line or " ERROR " in line)[-3000:]


async def test_failback_is_a_pause_for_stomp_mqtt_amqp_and_link_clients(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, "fb", core_ha_activate_without_quorum="true")
    gateways = {kind: start_gateway(tmp_path, pair.primary, kind) for kind in ("stomp", "mqtt", "amqp")}
    for gateway in gateways.values():
        wait_until(lambda g=gateway: "following the cluster topology" in g.log(), WAIT, "the gateway to follow")
    async with contextlib.AsyncExitStack() as clients:  # closed however the test ends: no socket left behind
        returned = await _fail_over_and_back(tmp_path, pair, gateways, clients)
    for gateway in gateways.values():
        stop_cleanly(gateway)
    wait_until(lambda: "failback done: restarting as a backup" in pair.backup.log(), WAIT, "the old backup to restart")
    reread_ports(pair.backup)
    for node in (pair.backup, returned):
        assert node.stop() == 0, node.log()


async def _fail_over_and_back(
    tmp_path: Path, pair: Pair, gateways: dict[str, GatewayProcess], clients: contextlib.AsyncExitStack
) -> CoreProcess:
    """Clients of every kind publishing and consuming through a failover and a failback; returns the primary
    that came back, once every acknowledged message arrived."""
    primary_id = node_id(pair.primary)
    # Consumers, one per protocol, that stay connected throughout.
    stomp_sub, stomp_listener = stomp_connect(gateways["stomp"])
    clients.callback(_quietly, stomp_sub.disconnect)
    stomp_sub.subscribe("/queue/fb.stomp", id="s", ack="client-individual", headers={"receipt": "sub"})
    stomp_listener.wait(lambda: "sub" in stomp_listener.receipts, "the SUBSCRIBE's receipt")
    stomp_got: list[Delivery[str]] = []

    def stomp_message(frame: Frame) -> None:
        stomp_got.append(Delivery(frame.body, frame.headers.get("redelivered") == "true"))
        stomp_sub.ack(frame.headers["ack"])

    stomp_listener.on_message = stomp_message  # type: ignore[method-assign]
    mqtt_sub = Paho(gateways["mqtt"].port, "fb-sub", clean=False)
    clients.callback(_quietly, mqtt_sub.disconnect)
    mqtt_sub.connect(expiry=300)
    mqtt_sub.subscribe("fb/mqtt", 1)
    mqtt_sub.subscribe("fb/will", 1)
    # Connected throughout: its will must not be published (the backup handing the pair back published it).
    with_will = Paho(gateways["mqtt"].port, "fb-will")
    clients.callback(_quietly, with_will.disconnect)
    with_will.connect(will=("fb/will", b"fb-will is gone", 1, False))
    amqp_receiver = AmqpReceiver(gateways["amqp"])
    clients.callback(amqp_receiver.stop)
    fast = ReconnectPolicy(retry_interval=0.05, max_interval=0.5)
    link = LinkClient("127.0.0.1", pair.primary.link_port, follow_topology=True, reconnect=fast)
    await link.connect()
    clients.push_async_callback(link.close)
    primary, backup = ("127.0.0.1", pair.primary.link_port), ("127.0.0.1", pair.backup.link_port)
    await asyncio.to_thread(wait_until, lambda: link.nodes.backup_of(primary) == backup, WAIT, "the backup named")
    await link.create_queue("fb.link")
    link_consumer = await link.subscribe("fb.link", credit=50)
    link_got: list[Delivery[str]] = []
    link_failure: list[BaseException] = []

    async def consume_link() -> None:
        try:
            async for delivery in link_consumer:
                link_got.append(Delivery(delivery.body.decode(), delivery.redelivered))
                link_consumer.ack(delivery)  # across the failback too: never raises
        except BaseException as exc:
            link_failure.append(exc)
            raise

    consuming = asyncio.create_task(consume_link())
    clients.callback(consuming.cancel)
    loop = asyncio.get_running_loop()
    mqtt_pub, mqtt_publish = mqtt_publisher(gateways["mqtt"])
    clients.callback(_quietly, mqtt_pub.disconnect)
    producers = [
        Producer("stomp", stomp_publisher(gateways["stomp"])),
        Producer("mqtt", mqtt_publish),
        Producer("amqp", amqp_publisher(gateways["amqp"])),
        Producer(
            "link",
            lambda body: asyncio.run_coroutine_threadsafe(
                link.publish(new_message("fb.link", body.encode(), durable=True)), loop
            ).result(WAIT * 2),
        ),
    ]
    for producer in producers:
        clients.callback(producer.stop)

    def progressed() -> Callable[[], bool]:
        marks = [len(p.acked) for p in producers]
        return lambda: all(len(p.acked) > mark or p.failure for p, mark in zip(producers, marks, strict=True))

    await asyncio.to_thread(wait_until, progressed(), WAIT, "every producer to publish")
    # Failover first (the pair's primary is killed), then the primary comes back and the pair fails back.
    port = pair.primary.link_port
    kill(pair.primary)
    await asyncio.to_thread(wait_until, lambda: ha_view(pair.backup).get("active") is True, WAIT, "the takeover")
    await asyncio.to_thread(wait_until, progressed(), WAIT, "every producer to publish through the backup")
    (pair.backup.data_dir / "ports.json").unlink()
    # In a thread: starting a process takes seconds under load, and this event loop runs the link client,
    # whose heartbeats must go on (a blocked loop once made the returned primary drop its link).
    returned = await asyncio.to_thread(
        start_node,
        tmp_path,
        "fb-primary",
        [pair.backup],
        core_ha_policy="replication",
        core_ha_group_name="fb",
        core_ha_activate_without_quorum="true",
        core_link_port=str(port),
    )
    await asyncio.to_thread(wait_until, lambda: ha_view(returned).get("active") is True, 40, "the failback")
    assert node_id(returned) == primary_id
    await asyncio.to_thread(wait_until, progressed(), WAIT, "every producer to publish after the failback")
    for producer in producers:
        producer.stop()
    for producer in producers:
        assert producer.failure is None, f"{producer.prefix}: {producer.failure!r}"
    # Links come back to the returned primary.
    assert link.port == port
    expected = {p.prefix: set(p.acked) for p in producers}
    received = {"stomp": stomp_got, "mqtt": [], "amqp": amqp_receiver.got, "link": link_got}

    def all_arrived() -> bool:
        received["mqtt"] += [Delivery(m.payload.decode(), bool(m.dup)) for m in mqtt_sub.receive(1000, timeout=0.1)]
        return all(expected[k] <= {d.value for d in received[k]} for k in expected)

    with contextlib.suppress(AssertionError):  # what is still missing then, the checker names per protocol
        await asyncio.to_thread(wait_until, all_arrived, 30, "every acknowledged message to arrive")
    for producer in producers:
        verdict = check(producer.attempted, producer.acked, [], received[producer.prefix])
        gateway = gateways.get(producer.prefix)
        assert verdict.ok, "\n".join(
            [
                f"{producer.prefix}: {verdict.report()}",
                _queues(returned),
                _queues(pair.backup),
                f"STOMP errors: {[e.body for e in stomp_listener.errors]}",
                _warnings(gateway.log()) if gateway is not None else "",
            ]
        )
    assert not stomp_listener.errors, stomp_listener.errors[0].body
    assert "fb-will is gone" not in {d.value for d in received["mqtt"]}
    assert with_will.disconnects.empty()
    assert mqtt_sub.disconnects.empty()
    assert mqtt_pub.disconnects.empty()
    assert amqp_receiver.failure is None
    assert not link_failure
    return returned


def _quietly(close: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        close()
