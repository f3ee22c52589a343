"""A real core process, real sockets, the real link client."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from tests.conftest import CoreProcess, module_core, start_core

from tridentmq_shared.link.client import LinkClient, queue_spec
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import M_BODY, RoutingType, new_message

pytestmark = pytest.mark.integration

NO_RECONNECT = ReconnectPolicy(attempts=0)

# One core for the module: each test keeps to addresses and queues of its own (tests that restart a node or
# configure users start their own).
core = module_core


def client(core: CoreProcess, **kwargs: object) -> LinkClient:
    return LinkClient("127.0.0.1", core.link_port, reconnect=NO_RECONNECT, **kwargs)  # type: ignore[arg-type]


def get_json(core: CoreProcess, path: str) -> object:
    with urllib.request.urlopen(core.management_url + path, timeout=5) as response:
        return json.loads(response.read())


async def test_anycast_round_trip(core: CoreProcess) -> None:
    async with client(core) as c:
        for n in range(100):
            await c.publish(new_message("orders", f"order {n}".encode(), properties={"n": n}))
        consumer = await c.subscribe("orders", credit=10)
        bodies = []
        for _ in range(100):
            delivery = await consumer.get(timeout=5)
            assert delivery is not None
            consumer.ack(delivery)
            bodies.append(delivery.body)
        assert bodies == [f"order {n}".encode() for n in range(100)]
        assert await consumer.get(timeout=0.2) is None
        queues = {q["name"]: q for q in get_json(core, "/api/queues")}  # type: ignore[union-attr]
        assert queues["orders"]["added"] == 100
        assert queues["orders"]["acked"] == 100
        assert queues["orders"]["depth"] == 0
    # An auto-created queue goes away once it is empty and its last consumer has left (Artemis' default).
    assert "orders" not in {q["name"] for q in get_json(core, "/api/queues")}  # type: ignore[union-attr]


async def test_multicast_fan_out(core: CoreProcess) -> None:
    async with client(core) as c:
        for name in ("news.sub1", "news.sub2"):
            await c.create_queue(name, "news", routing_type=RoutingType.MULTICAST, durable=False)
        subs = [await c.subscribe(name, auto_ack=True) for name in ("news.sub1", "news.sub2")]
        await c.publish(new_message("news", b"hello", routing=RoutingType.MULTICAST))
        for sub in subs:
            delivery = await sub.get(timeout=5)
            assert delivery is not None
            assert delivery.body == b"hello"


async def test_unacked_messages_return_when_a_consumer_dies(core: CoreProcess) -> None:
    async with client(core) as c:
        await c.publish(new_message("work", b"job"))
    async with client(core) as c:
        consumer = await c.subscribe("work")
        delivery = await consumer.get(timeout=5)
        assert delivery is not None
        assert not delivery.redelivered
    async with client(core) as c:
        consumer = await c.subscribe("work")
        delivery = await consumer.get(timeout=5)
        assert delivery is not None
        assert delivery.body == b"job"
        assert delivery.delivery_count == 2


async def test_nack_redelivers_then_dead_letters(core: CoreProcess) -> None:
    async with client(core) as c:
        await c.publish(new_message("poison", b"bad"))
        consumer = await c.subscribe("poison")
        for attempt in range(1, 11):
            delivery = await consumer.get(timeout=5)
            assert delivery is not None
            assert delivery.delivery_count == attempt
            consumer.nack(delivery, mode=NackMode.REDELIVER)
        dlq = await c.subscribe("DLQ")
        dead = await dlq.get(timeout=5)
        assert dead is not None
        assert dead.body == b"bad"
        assert dead.properties["_AMQ_ORIG_QUEUE"] == "poison"
        assert await consumer.get(timeout=0.2) is None


async def test_transaction_commit_and_rollback(core: CoreProcess) -> None:
    async with client(core) as c:
        tx = await c.begin()
        await c.publish(new_message("tx.q", b"one"), tx_id=tx)
        consumer = await c.subscribe("tx.q", auto_ack=True)
        assert await consumer.get(timeout=0.3) is None
        await c.commit(tx)
        delivery = await consumer.get(timeout=5)
        assert delivery is not None
        assert delivery.body == b"one"
        tx = await c.begin()
        await c.publish(new_message("tx.q", b"two"), tx_id=tx)
        await c.rollback(tx)
        assert await consumer.get(timeout=0.3) is None


async def test_selector_and_browse(core: CoreProcess) -> None:
    async with client(core) as c:
        for n in range(10):
            await c.publish(new_message("sel", str(n).encode(), properties={"n": n}))
        browser = await c.subscribe("sel", browse=True)
        seen = [d.body async for d in browser]
        assert len(seen) == 10
        consumer = await c.subscribe("sel", selector="n >= 7", auto_ack=True)
        got = [await consumer.get(timeout=5) for _ in range(3)]
        assert [d.body for d in got if d] == [b"7", b"8", b"9"]
        assert await consumer.get(timeout=0.2) is None


class Version3Client(LinkClient):
    """A client of link protocol version 3: it makes a queue and subscribes in two requests, and ends a browser
    with an UNSUBSCRIBE."""

    versions = (1, 2, 3)


@pytest.mark.parametrize("kind", [LinkClient, Version3Client])
async def test_make_and_subscribe_and_a_browser_ending_whatever_the_version(
    core: CoreProcess, kind: type[LinkClient]
) -> None:
    name = f"made.{kind.__name__}"
    spec = queue_spec(name, durable=False, max_consumers=1)
    async with (
        kind("127.0.0.1", core.link_port, reconnect=NO_RECONNECT) as c,
        kind("127.0.0.1", core.link_port, reconnect=NO_RECONNECT) as other,
    ):
        made, owner = await c.subscribe_if_made(spec, nowhere_else=True, credit=1, create=False)
        assert made["created"] is True
        assert owner is not None
        assert c._conn is not None
        assert c._conn.version == max(kind.versions)
        made, none = await other.subscribe_if_made(spec, credit=1, create=False)
        assert (made["created"], made["consumers"], none) == (False, 1, None)
        with pytest.raises(LinkRequestError) as refused:  # one consumer at most: the made one holds it
            await other.make_and_subscribe(spec, credit=1)
        assert refused.value.code == "resource-limit"
        await other.publish(new_message(name, b"to the owner"))
        delivery = await owner.get(timeout=5)
        assert delivery is not None
        assert delivery.body == b"to the owner"
        owner.ack(delivery)
        assert get_json(core, f"/api/queues/{name}")["consumers"] == 1  # type: ignore[index]
        for n in range(3):
            await c.publish(new_message(f"{name}.browsed", str(n).encode()))
        browser = await c.subscribe(f"{name}.browsed", browse=True, credit=2)
        assert [d.body async for d in browser] == [b"0", b"1", b"2"]
        await browser.close()  # version 4: ended already; version 3: its UNSUBSCRIBE
        consumers = get_json(core, f"/api/queues/{name}.browsed")
        assert isinstance(consumers, dict)
        assert consumers["consumers"] == 0
        # The link is fine after it: the same queue consumed from, its messages all there.
        consumer = await c.subscribe(f"{name}.browsed", auto_ack=True)
        assert [(await consumer.get(timeout=5)).body for _ in range(3)] == [b"0", b"1", b"2"]  # type: ignore[union-attr]


async def test_duplicate_detection(core: CoreProcess) -> None:
    async with client(core) as c:
        for _ in range(3):
            await c.publish(new_message("dedup", b"once", dedup_id="producer-1:1"))
        consumer = await c.subscribe("dedup", auto_ack=True)
        assert await consumer.get(timeout=5) is not None
        assert await consumer.get(timeout=0.3) is None


def raw_frame(ops: object) -> bytes:
    payload = msgpack.packb(ops)
    return struct.pack(">I", len(payload)) + payload


def read_close(sock: socket.socket) -> list[object]:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    ops = []
    while data:
        (size,) = struct.unpack(">I", data[:4])
        ops.extend(msgpack.unpackb(data[4 : 4 + size]))
        data = data[4 + size :]
    return ops


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\x00\x00\x00\x05garba", "malformed"),
        (b"\x7f\xff\xff\xff", "frame-too-large"),
        (raw_frame([[20, 1, 0, []]]), "unexpected"),
        (raw_frame([[1, [99], None, None, "x", 0, 1 << 20]]), "version"),
    ],
)
def test_bad_input_closes_only_that_link(core: CoreProcess, frame: bytes, code: str) -> None:
    async def healthy_round_trip() -> None:
        async with client(core) as c:
            await c.publish(new_message("still.fine", b"ok"))
            consumer = await c.subscribe("still.fine", auto_ack=True)
            assert await consumer.get(timeout=5) is not None

    with socket.create_connection(("127.0.0.1", core.link_port), timeout=5) as sock:
        sock.sendall(frame)
        ops = read_close(sock)
    assert ops[-1][0] == 3  # CLOSE
    assert ops[-1][1] == code
    assert isinstance(ops[-1][2], str)
    assert ops[-1][2]
    asyncio.run(healthy_round_trip())


USERS = """
[[users]]
name = "alice"
password = "wonderland"
roles = ["app"]

[[permissions]]
match = "allowed.#"
permission = "send"
roles = ["app"]

[[permissions]]
match = "#"
permission = "consume"
roles = ["app"]

[[permissions]]
match = "#"
permission = "createAddress"
roles = ["app"]

[[permissions]]
match = "#"
permission = "createDurableQueue"
roles = ["app"]
"""


async def test_users_and_permissions(tmp_path: Path) -> None:
    node = start_core(tmp_path, config=USERS)
    try:
        with pytest.raises(LinkClosedError, match="wrong password"):
            async with client(node, user="alice", password="nope"):
                pass
        async with client(node, user="alice", password="wonderland") as c:
            await c.publish(new_message("allowed.x", b"fine"))
            with pytest.raises(LinkRequestError) as refused:
                await c.publish(new_message("secret", b"no"))
            assert refused.value.code == "forbidden"
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log()


def test_health_and_metrics(core: CoreProcess) -> None:
    assert get_json(core, "/healthz") == {"status": "ok"}
    ready = get_json(core, "/readyz")
    assert isinstance(ready, dict)
    assert ready["status"] == "ready"
    with urllib.request.urlopen(core.management_url + "/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert "tridentmq_connections" in metrics
    assert "tridentmq_node_info" in metrics


async def test_a_publisher_waits_for_the_socket_instead_of_buffering_without_bound(core: CoreProcess) -> None:
    """With the core frozen (SIGSTOP), large publishes stop at the socket's back-pressure, far short of the
    8192-message window; once it runs again every one is confirmed and delivered in order, with no reconnect."""
    body = bytes(64 * 1024)
    async with client(core, heartbeat_ms=5000) as c:
        await c.create_queue("big")
        sent: list[asyncio.Future[None]] = []

        async def publish_rest() -> None:
            while len(sent) < 2000:
                (confirmed,) = await c.publish_batch([new_message("big", len(sent).to_bytes(4, "big") + body)])
                sent.append(confirmed)

        core.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(publish_rest(), timeout=1.0)
            assert len(sent) < 1000  # 64 MiB: without back-pressure all 2000 (128 MiB) would be buffered
        finally:
            core.process.send_signal(signal.SIGCONT)
        await publish_rest()
        await asyncio.gather(*sent)
        consumer = await c.subscribe("big", credit=64, auto_ack=True)
        for n in range(2000):
            delivery = await consumer.get(timeout=10)
            assert delivery is not None
            assert int.from_bytes(delivery.message[M_BODY][:4], "big") == n


# ---------------------------------------------------------------------------------------------- queue expiry
def queue_names(core: CoreProcess) -> set[str]:
    queues = get_json(core, "/api/queues")
    assert isinstance(queues, list)
    return {q["name"] for q in queues}


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_queue_expires_once_it_has_had_no_consumer_for_its_time(core: CoreProcess) -> None:
    async with client(core) as c:
        created = await c.create_queue("session.x", expires_ms=600)
        assert created == {"created": True, "queue": "session.x", "address": "session.x"}
        await c.publish(new_message("session.x", b"kept while idle"))
        consumer = await c.subscribe("session.x")
        await asyncio.sleep(1.0)  # a consumer keeps it
        assert "session.x" in queue_names(core)
        await consumer.close()
        again = await c.create_queue("session.x")
        assert again["created"] is False
        assert again["expires_ms"] == 600
        started = time.monotonic()
        await wait_for(lambda: "session.x" not in queue_names(core))
        assert 0.5 <= time.monotonic() - started < 2.0


async def test_a_durable_queue_keeps_its_expiry_across_a_restart(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    try:
        async with client(node) as c:
            await c.create_queue("session.y", expires_ms=60_000)
            assert (await c.create_queue("session.y", expires_ms=1500))["expires_ms"] == 1500
    finally:
        assert node.stop() == 0
    node = start_core(tmp_path)
    try:
        started = time.monotonic()
        assert "session.y" in queue_names(node)  # idle again from the restart, with its full time
        await wait_for(lambda: "session.y" not in queue_names(node))
        assert time.monotonic() - started >= 1.0
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log()


# ---------------------------------------------------------------------------------------------- wills
async def test_a_will_is_published_when_its_link_closes_or_is_lost(core: CoreProcess) -> None:
    async with client(core) as watcher:
        status = await watcher.subscribe("status.wills", auto_ack=True)
        async with client(core) as closing:
            await closing.set_will("closing", new_message("status.wills", b"closed"))
        delivery = await status.get(timeout=5)
        assert delivery is not None
        assert delivery.body == b"closed"
        lost = client(core)
        await lost.connect()
        await lost.set_will("lost", new_message("status.wills", b"lost"))
        assert await status.get(timeout=0.3) is None
        assert lost._protocol is not None
        assert lost._protocol.transport is not None
        lost._protocol.transport.abort()  # a reset connection: no CLOSE reaches the core
        delivery = await status.get(timeout=5)
        assert delivery is not None
        assert delivery.body == b"lost"
        async with client(core) as cleared:
            await cleared.set_will("cleared", new_message("status.wills", b"never"))
            await cleared.clear_will()
        assert await status.get(timeout=0.5) is None


async def test_a_delayed_will_is_cancelled_by_a_reconnect_and_published_by_a_takeover(core: CoreProcess) -> None:
    async with client(core) as watcher:
        status = await watcher.subscribe("status.delayed", auto_ack=True)
        reconnecting = LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(retry_interval=0.05))
        await reconnecting.connect()
        await reconnecting.set_will("session-r", new_message("status.delayed", b"r"), delay_ms=500)
        assert reconnecting._protocol is not None
        assert reconnecting._protocol.transport is not None
        reconnecting._protocol.transport.abort()  # the client comes back and sets its will again in time
        assert await status.get(timeout=1.5) is None
        await reconnecting.close()  # now it is gone for good: the will follows after its delay
        started = time.monotonic()
        delivery = await status.get(timeout=5)
        assert delivery is not None
        assert delivery.body == b"r"
        assert time.monotonic() - started >= 0.4

        async with client(core) as dying:
            await dying.set_will("session-t", new_message("status.delayed", b"t"), delay_ms=60_000)
        async with client(core) as successor:
            await successor.set_will("session-t", None, publish_pending=True)
            delivery = await status.get(timeout=5)
            assert delivery is not None
            assert delivery.body == b"t"


async def test_a_will_the_link_could_not_publish_is_refused(core: CoreProcess) -> None:
    async with client(core) as c:
        with pytest.raises(LinkRequestError) as refused:
            await c.set_will("k", new_message("status.*", b"x"))
        assert refused.value.code == "invalid"
        with pytest.raises(LinkRequestError) as refused:
            await c.set_will("", new_message("status", b"x"))
        assert refused.value.code == "invalid"
