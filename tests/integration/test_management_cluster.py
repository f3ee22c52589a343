"""The management operations on a real 3-node cluster: any node answers for all. A queue created through one
node exists on every node; browse pages over every node's messages; a purge, pause or move asked of one node
acts on all of them; ``node=`` picks one; scale-down empties a node into the others and stops it. One cluster
serves the whole module (the scale-down test, last, takes its third node away)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import CoreProcess, shared_by_module, start_gateway, stop_cleanly
from tests.integration.cluster_nodes import client, node_id, start_cluster, wait_until
from tests.integration.mqtt_clients import Paho

from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[CoreProcess]]:
    started = start_cluster(tmp_path_factory.mktemp("mgmt-cluster"), 3)
    shared_by_module(*(n.process for n in started))
    yield started
    for node in started:
        node.stop()
        assert "Traceback" not in node.log(), node.log()


def call(node: CoreProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        node.management_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def queue(node: CoreProcess, name: str) -> dict[str, Any] | None:
    status, view = call(node, "GET", "/api/queues/" + name)
    return view if status == 200 else None


async def fill(node: CoreProcess, name: str, count: int, **properties: Any) -> None:
    """``count`` durable messages published on ``node`` (no consumer anywhere: they stay there)."""
    async with client(node) as link:
        for n in range(count):
            body = f"{name} {node.management_port} {n}".encode()
            await link.publish(new_message(name, body, durable=True, properties={"n": n, **properties}))


def cli(node: CoreProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", *args, "--management", node.management_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_a_queue_made_browsed_and_purged_through_one_node_is_so_on_all(nodes: list[CoreProcess]) -> None:
    first, second, third = nodes
    status, made = call(first, "POST", "/api/queues", {"name": "everywhere"})
    assert status == 200, made
    assert made["created"] == 3
    assert all(queue(n, "everywhere") is not None for n in nodes)
    for count, node in zip((2, 3, 4), nodes, strict=True):
        await fill(node, "everywhere", count)
    assert [queue(n, "everywhere")["depth"] for n in nodes] == [2, 3, 4]  # type: ignore[index]

    status, page = call(second, "GET", "/api/messages?queue=everywhere&limit=100")
    assert status == 200, page
    assert page["total"] == 9
    assert len(page["messages"]) == 9
    by_node = {n["node_id"]: n["total"] for n in page["nodes"]}
    assert by_node == {node_id(n): c for n, c in zip(nodes, (2, 3, 4), strict=True)}
    ordered = sorted(nodes, key=node_id)  # a page runs over the nodes by node id
    cut = queue(ordered[0], "everywhere")["depth"]  # type: ignore[index]
    status, across = call(third, "GET", f"/api/messages?queue=everywhere&offset={cut - 1}&limit=2")
    assert status == 200, across
    assert [m["node_id"] for m in across["messages"]] == [node_id(ordered[0]), node_id(ordered[1])]
    assert across["messages"][1]["body"].endswith(" 0")  # the first message of the next node

    status, one = call(first, "POST", f"/api/purge?node={node_id(second)[:8]}", {"queue": "everywhere"})
    assert (status, one["purged"], len(one["nodes"])) == (200, 3, 1)
    purged = cli(third, "queue", "purge", "everywhere")
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.startswith("purged 6"), purged.stdout
    assert [queue(n, "everywhere")["depth"] for n in nodes] == [0, 0, 0]  # type: ignore[index]
    deleted = cli(second, "queue", "delete", "everywhere")
    assert deleted.stdout.startswith("deleted 3"), deleted.stdout
    assert all(queue(n, "everywhere") is None for n in nodes)


async def test_pause_through_one_node_holds_the_queue_on_every_node(nodes: list[CoreProcess]) -> None:
    first, second, third = nodes
    assert call(first, "POST", "/api/queues", {"name": "paused.q"})[0] == 200
    status, paused = call(third, "POST", "/api/pause", {"address": "paused.q"})
    assert (status, paused["queues"]) == (200, 3)
    assert all(queue(n, "paused.q")["paused"] for n in nodes)  # type: ignore[index]
    await fill(second, "paused.q", 3)
    async with client(second) as link:
        consumer = await link.subscribe("paused.q", credit=10)
        view = queue(second, "paused.q")
        assert view is not None
        assert (view["depth"], view["consumers"], view["delivered"]) == (3, 1, 0)
        assert call(first, "POST", "/api/resume", {"address": "paused.q"})[1]["queues"] == 3
        for n in range(3):
            delivery = await consumer.get(timeout=10)
            assert delivery is not None
            assert delivery.body.endswith(f" {n}".encode())
            consumer.ack(delivery)
    assert not any(queue(n, "paused.q")["paused"] for n in nodes)  # type: ignore[index]


async def test_dead_letters_on_every_node_go_back_through_one_call(nodes: list[CoreProcess]) -> None:
    first, second, third = nodes
    assert call(first, "POST", "/api/queues", {"name": "dl.orders"})[0] == 200
    for node in (second, third):
        await fill(node, "dl.orders", 2)
        async with client(node) as link:  # each node's messages die there, into its own DLQ
            consumer = await link.subscribe("dl.orders", credit=10)
            for _ in range(2):
                delivery = await consumer.get(timeout=10)
                assert delivery is not None
                consumer.nack(delivery, mode=NackMode.REJECT)
            await consumer.close()
    wait_until(lambda: all((queue(n, "DLQ") or {}).get("depth") == 2 for n in (second, third)), what="dead letters")
    status, moved = call(first, "POST", "/api/move", {"queue": "DLQ", "selector": "_AMQ_ORIG_QUEUE = 'dl.orders'"})
    assert status == 200, moved
    assert moved["moved"] == 4
    assert [queue(n, "dl.orders")["depth"] for n in (second, third)] == [2, 2]  # type: ignore[index]
    assert all((queue(n, "DLQ") or {}).get("depth", 0) == 0 for n in nodes)


def test_mqtt_sessions_and_retained_messages_are_listed_and_deleted_from_any_node(
    nodes: list[CoreProcess], tmp_path: Path
) -> None:
    first, second, third = nodes
    gateway = start_gateway(tmp_path, first, "mqtt")
    try:
        sensor = Paho(gateway.port, "sensor-7", clean=False, reconnect=False)  # its session is deleted below
        sensor.connect(expiry=3600)
        sensor.subscribe("home/+/temp", 1)
        sensor.publish("home/attic/temp", b"31", 1, retain=True)
        assert sensor.receive(1)[0].payload == b"31"
        status, listed = call(second, "GET", "/api/mqtt/sessions")
        assert status == 200, listed
        (session,) = [s for s in listed["sessions"] if s["client_id"] == "sensor-7"]
        assert (session["connected"], session["persistent"], session["subscriptions"]) == (True, True, ["home/+/temp"])
        assert session["node_id"] == node_id(first)
        table = cli(third, "mqtt", "retained", "--prefix", "home/")
        assert "home/attic/temp" in table.stdout, table.stdout + table.stderr
        cleared = cli(third, "mqtt", "retained-delete", "home/attic/temp")
        # Each node keeps a copy; one made a moment after the publish lacks it, and says so (404).
        assert re.match(r"cleared [123]\b", cleared.stdout), cleared.stdout + cleared.stderr
        wait_until(
            lambda: all(call(n, "GET", "/api/mqtt/retained")[1]["total"] == 0 for n in nodes),
            what="the retained message to be cleared on every node",
        )
        dropped = cli(second, "mqtt", "session-delete", "sensor-7")
        assert dropped.stdout.startswith("deleted 1"), dropped.stdout + dropped.stderr
        sensor.disconnects.get(timeout=10)  # the gateway ends the connection that held the session
        sensor.stop()
        assert not [s for s in call(first, "GET", "/api/mqtt/sessions")[1]["sessions"] if s["label"] == "sensor-7"]
        assert cli(first, "mqtt", "session-delete", "sensor-7").returncode == 1  # gone everywhere: 404
    finally:
        stop_cleanly(gateway)


async def test_scale_down_asked_of_one_node_empties_another_and_stops_it(nodes: list[CoreProcess]) -> None:
    first, second, third = nodes
    assert call(first, "POST", "/api/queues", {"name": "leaving.q"})[0] == 200
    await fill(third, "leaving.q", 5)
    assert call(first, "POST", "/api/scale-down", {})[0] == 400  # the node must be named
    done = cli(first, "node", "scale-down", "--node", node_id(third)[:8])
    assert done.returncode == 0, done.stderr
    assert third.process.wait(timeout=60) == 0
    remaining = [queue(n, "leaving.q")["depth"] for n in (first, second)]  # type: ignore[index]
    assert sum(remaining) == 5, remaining
    assert "scale-down complete" in third.log()
