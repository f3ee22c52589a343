"""Client links that follow the cluster's topology: node choice by policy, failover when a node dies, and the
gateways' client links failing over under their clients (real core, gateway and client processes)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import uvloop
from tests.conftest import CoreProcess, start_core, start_gateway, stop_cleanly, stop_core_cleanly
from tests.integration.cluster_nodes import start_cluster, start_node, wait_until, wait_until_async
from tests.integration.test_stomp_gateway import connect

from tridentmq_shared.link import events as ev
from tridentmq_shared.link.client import Consumer, LinkClient, queue_spec
from tridentmq_shared.link.codec import LinkConnection, Role, State
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import M_BODY, M_DEDUP, M_ID, new_message

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

FAST = ReconnectPolicy(retry_interval=0.05, max_interval=0.5, attempts=-1)


def endpoint(node: CoreProcess) -> tuple[str, int]:
    return "127.0.0.1", node.link_port


def connections(node: CoreProcess) -> list[dict[str, Any]]:
    with urllib.request.urlopen(node.management_url + "/api/connections", timeout=5) as response:
        return list(json.loads(response.read()))


def stomp_links(node: CoreProcess) -> list[dict[str, Any]]:
    """The links a STOMP gateway opened for its clients on ``node``."""
    return [c for c in connections(node) if c["client_name"].startswith("stomp ")]


def stop_all(nodes: list[CoreProcess]) -> None:
    for node in nodes:
        assert node.stop() == 0, node.log()
        assert "Traceback" not in node.log(), node.log()


def kill(node: CoreProcess) -> None:
    node.process.kill()
    node.process.wait()


async def take(consumer: Consumer, count: int, timeout: float = 10.0) -> list[list[Any]]:
    """``count`` messages (acknowledged), or fewer after ``timeout``."""
    got: list[list[Any]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < count and loop.time() < deadline:
        batch = await consumer.get_batch(timeout=0.2)
        got.extend(message for _, message in batch)
        consumer.ack_ids([m[M_ID] for _, m in batch])
    return got


async def test_a_client_given_one_node_learns_the_others_and_a_lone_node_is_just_itself(tmp_path: Path) -> None:
    nodes = await asyncio.to_thread(start_cluster, tmp_path, 3)
    async with LinkClient(*endpoint(nodes[0]), follow_topology=True, reconnect=FAST) as watcher:
        assert watcher.nodes.clustered
        assert sorted(watcher.nodes.endpoints) == sorted(endpoint(n) for n in nodes)
        # Round-robin over what it learned: three clients sharing the topology, one on each node.
        clients = [LinkClient(topology=watcher.nodes, reconnect=FAST) for _ in nodes]
        for client in clients:
            await client.connect()
        assert sorted(c.port for c in clients) == sorted(n.link_port for n in nodes)
        for client in clients:
            await client.close()
    lone = await asyncio.to_thread(start_core, tmp_path, "lone")
    async with LinkClient(*endpoint(lone), follow_topology=True) as alone:
        assert alone.nodes.clustered is False  # refused: "this node is not part of a cluster"
        assert alone.nodes.endpoints == [endpoint(lone)]
    stop_all([*nodes, lone])


async def test_a_client_whose_node_is_killed_goes_on_elsewhere_resending_and_resubscribing(tmp_path: Path) -> None:
    """The re-sent publishes name the killed node, which may have stored them: the new node holds them for it
    and, as it stays away for ``cluster.node_gone_ms`` (here 2 s), routes them itself."""
    nodes = await asyncio.to_thread(start_cluster, tmp_path, 3, core_cluster_node_gone_ms="2000")
    by_port = {n.link_port: n for n in nodes}
    async with LinkClient(*endpoint(nodes[0]), follow_topology=True, reconnect=FAST) as watcher:
        client = LinkClient(topology=watcher.nodes, reconnect=FAST)
        await client.connect()
        victim, first_node = by_port[client.port], client.node_id
        consumer = await client.subscribe("failover", credit=100)
        await client.publish(new_message("failover", b"before", durable=True))
        assert [bytes(m[M_BODY]) for m in await take(consumer, 1)] == [b"before"]
        victim.process.send_signal(signal.SIGSTOP)  # nothing sent from now on is confirmed by that node
        during = await client.publish_batch(
            new_message("failover", f"during {i}".encode(), durable=True) for i in range(20)
        )
        await asyncio.sleep(0.05)
        assert not any(f.done() for f in during)
        kill(victim)
        # Publishing goes on at once: these wait for the failover, then go after the re-sent ones.
        after = await client.publish_batch(
            new_message("failover", f"after {i}".encode(), durable=True) for i in range(20)
        )
        await asyncio.wait_for(asyncio.gather(*during, *after), 10)  # no exception reaches the application
        assert client.failovers == 1
        assert client.node_id != first_node
        assert client.port != victim.link_port
        got = await take(consumer, 40)  # the consumer was made again on the new node
        expected = [f"{phase} {i}".encode() for phase in ("during", "after") for i in range(20)]
        assert sorted(bytes(m[M_BODY]) for m in got) == sorted(expected)
        assert all(str(m[M_DEDUP]).startswith(f"$link:{client.producer_id}:") for m in got)  # re-sends carry their ids
        await client.close()
    stop_all([n for n in nodes if n is not victim])


async def test_closing_a_browser_that_ended_before_a_failover_leaves_the_restored_consumers_alone(
    tmp_path: Path,
) -> None:
    """Ids start again on the new link: the ended browser's old id is a restored consumer's there."""
    node = await asyncio.to_thread(start_core, tmp_path, "node")
    port = node.link_port
    async with LinkClient(*endpoint(node), reconnect=FAST) as client:
        await client.publish(new_message("browsed", b"seen", durable=True))
        browser = await client.subscribe("browsed", browse=True)  # id 1
        assert [d.body async for d in browser] == [b"seen"]
        consumer = await client.subscribe("jobs", credit=10)  # id 2; id 1 once restored
        await asyncio.to_thread(stop_core_cleanly, node)
        node = await asyncio.to_thread(start_core, tmp_path, "node", TRIDENTMQ_CORE_LINK_PORT=str(port))
        await wait_until_async(lambda: client.failovers == 1, what="the failover")
        await browser.close()
        await client.publish(new_message("jobs", b"after", durable=True))
        assert [bytes(m[M_BODY]) for m in await take(consumer, 1)] == [b"after"]
    stop_all([node])


async def test_a_make_on_an_older_node_that_stops_right_after_making_the_queue_goes_on_when_resumed() -> None:
    """A version 3 node (the real codec, serving) answers the first link's CREATE_QUEUE and closes it in the same
    frame, as a node stopping does: the client resumes and subscribes on the next link."""
    links = 0
    subscribed: list[tuple[int, str]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal links
        links += 1
        link = links
        node = LinkConnection(Role.SERVER, versions=(1, 2, 3))
        while data := await reader.read(65536):
            for event in node.receive_data(data, time.monotonic()):
                match event:
                    case ev.HelloReceived():
                        node.accept("node", f"conn-{link}", 1000, time.monotonic())
                    case ev.CreateQueue(req_id, spec):
                        node.reply(req_id, {"created": True, "queue": spec["name"], "address": spec["address"]})
                        if link == 1:
                            node.close(ErrorCode.SHUTDOWN, "stopping")
                    case ev.Subscribe(req_id, _, queue):
                        subscribed.append((link, queue))
                        node.reply(req_id, {"queue": queue, "address": queue, "routing_type": 0})
            writer.write(node.data_to_send())
            if node.state is State.CLOSED:
                break
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server, LinkClient("127.0.0.1", server.sockets[0].getsockname()[1], reconnect=FAST) as client:
        made, consumer = await asyncio.wait_for(client.make_and_subscribe(queue_spec("q", durable=False)), 10)
        assert made["created"] is True
        assert consumer.consumer_id in client._consumers
        assert (client.failovers, subscribed) == (1, [(2, "q")])


async def test_a_stopped_and_restarted_node_is_used_again(tmp_path: Path) -> None:
    nodes = await asyncio.to_thread(start_cluster, tmp_path, 3)
    first, _, last = nodes
    async with LinkClient(*endpoint(first), follow_topology=True, reconnect=FAST) as watcher:
        await asyncio.to_thread(last.stop)
        await wait_until_async(lambda: endpoint(last) not in watcher.nodes.endpoints, what="the node to leave")
        clients = [LinkClient(topology=watcher.nodes, reconnect=FAST) for _ in range(4)]
        for client in clients:
            await client.connect()
        assert last.link_port not in {c.port for c in clients}
        restarted = await asyncio.to_thread(start_node, tmp_path, "node-2", [first], core_link_port=str(last.link_port))
        await wait_until_async(lambda: endpoint(restarted) in watcher.nodes.endpoints, what="the node to return")
        again = [LinkClient(topology=watcher.nodes, reconnect=FAST) for _ in range(3)]
        for client in again:
            await client.connect()
        assert sorted(c.port for c in again) == sorted(n.link_port for n in nodes)  # round robin reaches it
        for client in clients + again:
            await client.close()
    stop_all([*nodes[:2], restarted])


def test_stomp_clients_are_spread_and_keep_their_connection_and_subscription_when_a_node_dies(tmp_path: Path) -> None:
    nodes = start_cluster(tmp_path, 3)
    gateway = start_gateway(tmp_path, nodes[0], "stomp", TRIDENTMQ_STOMP_CORE_RETRY_INTERVAL_MS="50")
    wait_until(lambda: "following the cluster topology" in gateway.log(), what="the gateway to learn the cluster")
    others = [connect(gateway) for _ in range(5)]
    conn, listener = connect(gateway)
    assert sorted(len(stomp_links(n)) for n in nodes) == [2, 2, 2]  # round robin over the three nodes
    conn.subscribe("/queue/failover", id="q", ack="auto")
    conn.subscribe("/topic/news", id="t", ack="client-individual", headers={"receipt": "sub"})  # a temporary queue
    listener.wait(lambda: "sub" in listener.receipts, "the subscriptions")
    [victim] = [n for n in nodes if any(c["consumers"] for c in stomp_links(n))]
    conn.send("/queue/failover", "before", receipt="r-before")
    listener.wait_messages(1)
    kill(victim)
    live = [n for n in nodes if n is not victim]
    wait_until(lambda: any(c["consumers"] == 2 for n in live for c in stomp_links(n)), what="the subscriptions to move")
    for i in range(10):
        conn.send("/queue/failover", f"after {i}", receipt=f"r{i}")
    conn.send("/topic/news", "news", receipt="r-news")
    messages = listener.wait_messages(12)
    on_queue = [m.body for m in messages if m.headers["subscription"] == "q"]
    assert on_queue == ["before"] + [f"after {i}" for i in range(10)]
    [news] = [m for m in messages if m.headers["subscription"] == "t"]
    assert news.body == "news"
    conn.ack(news.headers["ack"])
    listener.wait(lambda: {f"r{i}" for i in range(10)} | {"r-news"} <= set(listener.receipts), "the receipts")
    assert conn.is_connected()
    assert not listener.errors
    for other, _ in [*others, (conn, listener)]:
        other.disconnect()
    stop_cleanly(gateway)
    stop_all(live)


def test_a_connection_reset_at_once_is_a_connection_error_under_uvloop() -> None:
    """A node that resets a link right after accepting it (it is dying, or turns links away) made the HELLO's
    write raise RuntimeError under uvloop, the cores' loop: a cluster bridge died of it and stopped its node
    (found by the randomised run over ``up --pairs 3``). It is a connection error like any other."""

    async def run() -> list[BaseException]:
        def reset(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            writer.transport.abort()

        server = await asyncio.start_server(reset, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        errors: list[BaseException] = []
        async with server:
            for _ in range(5):
                client = LinkClient("127.0.0.1", port, reconnect=ReconnectPolicy(attempts=0))
                try:
                    await client.connect()
                except Exception as exc:  # the test is about which exception it is
                    errors.append(exc)
                else:
                    await client.close()
        return errors

    errors = uvloop.run(run())
    assert [type(e) for e in errors] == [LinkClosedError] * 5, errors
