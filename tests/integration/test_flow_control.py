"""Flow control in bytes, end to end, against real processes: a producer of large messages is held near the
core's memory limit (blocked, not refused) and resumes once a consumer drains; a gateway relaying large
messages to a client that does not read (STOMP, MQTT QoS 1, AMQP) holds a bounded number of bytes, and the client
gets every message once it reads again.

Memory is a process's VmRSS, sampled in a thread while the traffic runs (its growth over the value on entry).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from proton.utils import BlockingConnection
from tests.conftest import start_core, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Raw
from tests.integration.test_stomp_bad_input import (
    Peer,
    assert_gateway_serves,
    depth,
    get_json,
    queue_stats,
    wait_for,
)
from tests.memory import MIB, PeakRss

from tridentmq_mqtt import convert
from tridentmq_mqtt.protocol.packets import V311, Connack, Puback, Publish, Suback, Subscribe, Subscription
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.ops import Op
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration


class Settled:
    """Whether a counter has stopped moving: true once two readings 0.5 s apart are equal (a condition to wait
    for, not a timing assertion)."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.last = (read(), time.monotonic())

    def steady(self) -> bool:
        value, now = self.read(), time.monotonic()
        if value != self.last[0]:
            self.last = (value, now)
            return False
        return now - self.last[1] >= 0.5


# ---------------------------------------------------------------------------------------------- the core
async def test_a_producer_of_large_messages_is_blocked_near_the_memory_limit_and_resumes(tmp_path: Path) -> None:
    limit = 24 * MIB
    window = 8 * MIB
    body = b"x" * MIB
    total = 160  # 160 MiB: more than six times the limit
    node = start_core(
        tmp_path,
        TRIDENTMQ_CORE_BROKER_MAX_MEMORY_BYTES=str(limit),
        TRIDENTMQ_CORE_LINK_PUBLISH_WINDOW_BYTES=str(window),
    )
    try:
        async with (
            PipelinedLink("127.0.0.1", node.link_port) as producer,  # its credit is watched
            LinkClient("127.0.0.1", node.link_port) as consumer_link,
        ):
            await producer.create_queue("big", durable=False)
            sent = confirmed = 0
            blocked = asyncio.Event()

            def settled(_: asyncio.Future[None]) -> None:
                nonlocal confirmed
                confirmed += 1
                # Every publish sent is confirmed and the window stays shut: the core processed them all and
                # sent no credit with their confirms (it goes out in the same frame when it is granted).
                if confirmed == sent and producer.publish_credit == 0:
                    blocked.set()

            async def produce() -> None:
                nonlocal sent
                futures = []
                for _ in range(total):
                    future = await producer.send(new_message("big", body, durable=False))
                    sent += 1
                    future.add_done_callback(settled)
                    futures.append(future)
                await asyncio.gather(*futures)

            with PeakRss(node.process.pid) as memory:
                task = asyncio.create_task(produce())
                await asyncio.wait_for(blocked.wait(), 60)
                assert not task.done()  # blocked, not refused: nothing failed
                held = confirmed
                # Held at the limit plus one byte window and one message (the accounting counts bodies).
                assert held * MIB <= limit + window + MIB, held
                assert held * MIB >= limit  # and blocked only once the limit was reached
                consumer = await consumer_link.subscribe("big", credit=50, auto_ack=True, credit_bytes=4 * MIB)
                received = 0
                while received < total:
                    batch = await consumer.get_batch(timeout=30)
                    assert batch, f"stalled after {received} messages"
                    assert all(len(message[11]) == MIB for _, message in batch)
                    received += len(batch)
                await asyncio.wait_for(task, 30)
            assert received == total == confirmed
            # Generous: the bodies held (limit + window) plus the interpreter's own buffers and fragmentation;
            # before the byte window the whole 160 MiB flood was taken in.
            assert memory.growth < 3 * (limit + window), f"the core grew by {memory.growth / MIB:.0f} MiB"
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log()


def test_a_version_1_link_gets_a_message_window_that_bounds_its_bytes(tmp_path: Path) -> None:
    # No byte credit in version 1: the core grants as many publishes as the byte window holds at the largest
    # message size (16 MiB / 4 MiB here), so an old or hostile client cannot queue a message window of bodies.
    node = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(4 * MIB))
    try:
        with socket.create_connection(("127.0.0.1", node.link_port), timeout=10) as sock:
            hello = msgpack.packb([[Op.HELLO, [1], None, None, "old", 250, 64 * 1024]])
            sock.sendall(struct.pack(">I", len(hello)) + hello)
            data = b""
            while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                chunk = sock.recv(65536)
                assert chunk, "the core closed the link"
                data += chunk
            [welcome] = msgpack.unpackb(data[4 : 4 + struct.unpack(">I", data[:4])[0]])
            assert welcome[0] == Op.WELCOME
            assert welcome[1] == 1  # version 1: no byte field
            assert len(welcome) in (7, 8)
            assert welcome[6] == 4
    finally:
        assert node.stop() == 0


# ---------------------------------------------------------------------------------------------- gateways
SLOW_BODY = MIB
SLOW_COUNT = 120  # 120 MiB through one subscription
# What the gateway may hold for a subscription whose client reads nothing: its byte window (4 MiB) and one
# message in the link buffer, one batch of that size handed to the client's socket, and the kernel's socket
# buffers (a few MiB on loopback) -- about ten 1 MiB messages out of the queue; thirty leaves room.
SLOW_OUT_OF_QUEUE = 30


async def publish_numbered(port: int, queue: str, count: int, size: int) -> None:
    """``count`` messages of ``size`` bytes numbered in their first 8 bytes, straight into the core."""
    padding = b"." * (size - 8)
    async with LinkClient("127.0.0.1", port) as producer:
        futures = await producer.publish_batch(
            new_message(queue, b"%08d" % n + padding, durable=False) for n in range(count)
        )
        await asyncio.gather(*futures)


@pytest.mark.parametrize("ack", ["auto", "client-individual"])
def test_a_stomp_client_that_stops_reading_large_messages_costs_the_gateway_a_bounded_window(
    tmp_path: Path, ack: str
) -> None:
    node = start_core(tmp_path)
    gateway = start_gateway(tmp_path, node)
    try:
        assert_gateway_serves(gateway, "warm-up")  # the baseline includes everything a connection loads
        slow = Peer(gateway.port, receive_buffer=64 * 1024)
        try:
            slow.connect()
            slow.send(f"SUBSCRIBE\nid:slow\ndestination:/queue/slow\nack:{ack}\nreceipt:sub\n\n\x00".encode())
            assert slow.expect("RECEIPT").headers["receipt-id"] == "sub"
            with PeakRss(gateway.process.pid) as memory:  # from here on the slow client reads nothing
                asyncio.run(publish_numbered(node.link_port, "slow", SLOW_COUNT, SLOW_BODY))
                # The gateway takes what its window allows: wait until it has, then until it takes no more.
                wait_for(lambda: (queue_stats(node, "slow") or {}).get("delivered", 0) > 0, "a first delivery")
                settled = Settled(lambda: (queue_stats(node, "slow") or {}).get("delivered", 0))
                wait_for(settled.steady, "the gateway to stop taking messages")
                stats = queue_stats(node, "slow")
                assert stats is not None
                assert stats["delivered"] <= SLOW_OUT_OF_QUEUE, f"the gateway pulled too much: {stats}"
                assert_gateway_serves(gateway, "meanwhile")  # another connection does not notice
            # Before the byte window it took its whole prefetch: the 120 MiB.
            assert memory.growth < 64 * MIB, f"the gateway grew by {memory.growth / MIB:.0f} MiB"
            numbers = []  # now it reads: every message arrives, in order
            for _ in range(SLOW_COUNT):
                message = slow.expect("MESSAGE")
                assert len(message.body) == SLOW_BODY
                numbers.append(int(message.body[:8]))
                if ack != "auto":
                    slow.send(f"ACK\nid:{message.headers['ack']}\n\n\x00".encode())
            assert numbers == list(range(SLOW_COUNT))
            wait_for(lambda: depth(node, "slow") == 0, "the queue to be empty")
        finally:
            slow.sock.close()
    finally:
        stop_cleanly(gateway)
        assert node.stop() == 0


QOS1_BODY = 250 * 1024
QOS1_COUNT = 200  # 50 MB through one subscription
# The byte window (4 MiB: 17 messages of 250 KB), one batch of that handed to the client's socket, and the
# kernel's socket buffers; the QoS 1 window in messages alone is 4000 (max_inflight).
QOS1_OUT_OF_QUEUE = 80


def test_an_mqtt_qos1_client_that_stops_reading_costs_the_gateway_a_bounded_window(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    gateway = start_gateway(tmp_path, node, "mqtt")
    slow = Raw(gateway.port, V311)
    producer = Raw(gateway.port, V311)
    try:
        assert slow.connect("slow") == Connack(session_present=False, reason_code=0)
        slow.send(Subscribe(1, (Subscription("slow/t", 1),)))
        assert slow.next() == Suback(1, (1,))
        assert producer.connect("producer") == Connack(session_present=False, reason_code=0)
        queue = next(
            q["name"]
            for q in get_json(f"{node.management_url}/api/queues")
            if q["name"].startswith(convert.subscription_queue("slow", "slow/t"))
        )
        with PeakRss(gateway.process.pid) as memory:  # from here on the slow client reads nothing
            padding = b"." * (QOS1_BODY - 8)
            for n in range(QOS1_COUNT):
                producer.send(Publish("slow/t", b"%08d" % n + padding, 1, packet_id=n + 1))
            assert sorted(producer.next(30).packet_id for _ in range(QOS1_COUNT)) == list(  # type: ignore[attr-defined]
                range(1, QOS1_COUNT + 1)
            )
            settled = Settled(lambda: (queue_stats(node, queue) or {}).get("delivered", 0))
            wait_for(settled.steady, "the gateway to stop taking messages")
            stats = queue_stats(node, queue)
            assert stats is not None
            assert 0 < stats["delivered"] <= QOS1_OUT_OF_QUEUE, f"the gateway pulled too much: {stats}"
        assert memory.growth < 48 * MIB, f"the gateway grew by {memory.growth / MIB:.0f} MiB"
        numbers = []  # now it reads: every message arrives, in order
        while len(numbers) < QOS1_COUNT:
            packet = slow.next(30)
            assert isinstance(packet, Publish), packet
            assert len(packet.payload) == QOS1_BODY
            numbers.append(int(packet.payload[:8]))
            slow.send(Puback(packet.packet_id or 0))
        assert numbers == list(range(QOS1_COUNT))
        wait_for(lambda: (queue_stats(node, queue) or {}).get("acked") == QOS1_COUNT, "every message acked")
    finally:
        slow.close()
        producer.close()
        stop_cleanly(gateway)
        assert node.stop() == 0


AMQP_COUNT = 100  # 100 MiB through one receiving link


def test_an_amqp_receiver_that_grants_no_credit_costs_the_gateway_a_bounded_prefetch(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    gateway = start_gateway(tmp_path, node, "amqp")
    conn = BlockingConnection(f"amqp://127.0.0.1:{gateway.port}", timeout=30)
    try:
        # One credit: the gateway fetches its prefetch (1000 messages) ahead of the client's credit, and
        # holds what it cannot send yet.
        receiver = conn.create_receiver("slowamqp", credit=1)
        with PeakRss(gateway.process.pid) as memory:
            asyncio.run(publish_numbered(node.link_port, "slowamqp", AMQP_COUNT, SLOW_BODY))
            wait_for(lambda: (queue_stats(node, "slowamqp") or {}).get("delivered", 0) > 0, "a first delivery")
            settled = Settled(lambda: (queue_stats(node, "slowamqp") or {}).get("delivered", 0))
            wait_for(settled.steady, "the gateway to stop taking messages")
            stats = queue_stats(node, "slowamqp")
            assert stats is not None
            assert stats["delivered"] <= SLOW_OUT_OF_QUEUE, f"the gateway pulled too much: {stats}"
        assert memory.growth < 64 * MIB, f"the gateway grew by {memory.growth / MIB:.0f} MiB"
        numbers = []  # now it takes them: every message arrives, in order
        for _ in range(AMQP_COUNT):
            message = receiver.receive(timeout=30)
            body = bytes(message.body)
            assert len(body) == SLOW_BODY
            numbers.append(int(body[:8]))
            receiver.accept()
        assert numbers == list(range(AMQP_COUNT))
        # The blocking client sends its last disposition while it waits: the core then has every one.
        conn.wait(
            lambda: (queue_stats(node, "slowamqp") or {}).get("acked") == AMQP_COUNT,
            timeout=30,
            msg="every message acked",
        )
    finally:
        conn.close()
        stop_cleanly(gateway)
        assert node.stop() == 0
