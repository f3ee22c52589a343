"""A scale-down while two other nodes are cut off from each other, in network namespaces (``NetLab``).

Seen in a randomised fault run over ``up --nodes 3``: core-0 scaled down while core-1 and core-2 could not
reach each other. A subscriber had just moved to core-2, so core-0's queue for it had a copy there, and
core-0 moved it there. core-1 had not heard of that copy: once core-0's bindings went, core-1 routed that
subscription's messages nowhere (the other subscription, on core-1, held them, so they were confirmed) until
the partition healed. 11 acknowledged messages never reached the subscriber. Here the nodes are ``core0`` to
``core2`` (a namespace's name has no dash).

Each core runs in a namespace of its own with the default ports; the client runs in the namespace ``cl`` as
this file run as a script (``python test_scale_down_partitions.py <json>``), and takes its commands from stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.lab_agent import Agent
from tests.integration.lab_cores import LINK_PORT, LabCores
from tests.jepsen.nemesis import NetLab

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import RoutingType, new_message

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.cluster, pytest.mark.timeout(90)]

NODES = ("core0", "core1", "core2")
CLIENT = "cl"
ADDRESS = "news"
SUBSCRIPTION = "news-sub"  # on core0, and (made during the partition) on core2, where its consumer is
KEPT = "news-kept"  # on core1: every message has a queue there, so each is confirmed whatever else happens
MULTICAST = RoutingType.MULTICAST


# ------------------------------------------------------------------------------------------ the client agent


async def agent(hosts: dict[str, str]) -> None:
    """Commands, one a line: ``setup``, ``copy`` (the subscription's copy and its consumer on core2),
    ``publish`` (to core1, every 5 ms, until ``stop``), ``stop`` (prints the confirmed bodies), ``received``
    (prints what the consumer got once nothing more came for 2 s)."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()
    threading.Thread(
        target=lambda: [loop.call_soon_threadsafe(lines.put_nowait, line.strip()) for line in sys.stdin], daemon=True
    ).start()

    def client(node: str) -> LinkClient:
        return LinkClient(hosts[node], LINK_PORT, reconnect=ReconnectPolicy(attempts=0), connect_timeout=5.0)

    def say(value: Any) -> None:
        print(json.dumps(value), flush=True)

    clients = {node: client(node) for node in NODES}
    for link in clients.values():
        await link.connect()
    received: list[str] = []
    confirmed: list[str] = []
    publishing: asyncio.Task[None] | None = None
    stop = asyncio.Event()

    async def consume() -> None:
        consumer = await clients["core2"].subscribe(SUBSCRIPTION, credit=1000)
        while True:
            delivery = await consumer.get(timeout=0.25)
            if delivery is not None:
                received.append(delivery.body.decode())
                consumer.ack(delivery)

    async def publish() -> None:
        number = 0
        pending: list[tuple[str, asyncio.Future[None]]] = []
        while not stop.is_set():
            body = f"m-{number}"
            number += 1
            message = new_message(ADDRESS, body.encode(), durable=True, routing=MULTICAST)
            (confirm,) = await clients["core1"].publish_batch([message])
            pending.append((body, confirm))
            await asyncio.sleep(0.005)
        for body, future in pending:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(future, 10)
                confirmed.append(body)

    tasks: list[asyncio.Task[None]] = []
    while True:
        command = await lines.get()
        if command == "setup":
            await clients["core0"].create_queue(SUBSCRIPTION, ADDRESS, routing_type=MULTICAST, durable=True)
            await clients["core1"].create_queue(KEPT, ADDRESS, routing_type=MULTICAST, durable=True)
            say("ready")
        elif command == "copy":
            await clients["core2"].create_queue(SUBSCRIPTION, ADDRESS, routing_type=MULTICAST, durable=True)
            tasks.append(asyncio.create_task(consume()))
            say("copied")
        elif command == "publish":
            publishing = asyncio.create_task(publish())
            say("publishing")
        elif command == "stop":
            stop.set()
            assert publishing is not None
            await publishing
            say(confirmed)
        elif command == "received":
            count = -1
            while count != len(received):
                count = len(received)
                await asyncio.sleep(2.0)
            say(received)
            return


# ----------------------------------------------------------------------------------------------- test side


@pytest.fixture
def lab() -> Iterator[NetLab]:
    available = NetLab.available()
    if not available:
        pytest.skip(f"no network lab: {available.reason}")
    with NetLab([*NODES, CLIENT]) as lab:
        yield lab


def test_a_scale_down_while_two_other_nodes_are_cut_off_from_each_other_loses_no_message(
    lab: NetLab, tmp_path: Path
) -> None:
    """core1 now keeps routing to core0, which moves what it gets, while it knows no other copy of the
    subscription, and acknowledges core0's leaving only once it does (the partition healed): every message
    confirmed to the publisher reaches the subscriber on core2."""
    cores = LabCores(lab, tmp_path)
    for node in NODES:
        cores.start(node, [other for other in NODES if other != node])
    hosts = {node: lab.address(node) for node in NODES}
    client = Agent(lab, CLIENT, Path(__file__), "client", hosts, tmp_path / "client.log")
    try:
        for node in NODES:
            for other in NODES:
                if other != node:
                    cores.wait_for_log(node, f"cluster connection up to={lab.address(other)}")
        assert client.ask("setup") == "ready"  # each answer comes once the other nodes know the queue
        lab.partition("core1", "core2")
        cores.wait_for_log("core1", f"cluster connection lost to={lab.address('core2')}")
        cores.wait_for_log("core2", f"cluster connection lost to={lab.address('core1')}")
        assert client.ask("copy") == "copied"  # core1 cannot hear of it
        assert client.ask("publish") == "publishing"
        time.sleep(0.5)
        cores.processes["core0"].send_signal(signal.SIGTERM)  # a graceful stop scales down
        time.sleep(1.5)  # core1 goes on publishing to a subscription it knows only on the leaving node
        lab.heal()
        assert cores.processes["core0"].wait(timeout=40) == 0, cores.log("core0")
        confirmed = client.ask("stop", timeout=30)
        received = client.ask("received", timeout=60)
    finally:
        client.stop()
        cores.close()
    assert len(confirmed) > 200
    lost = sorted(set(confirmed) - set(received), key=lambda body: int(body[2:]))
    assert lost == [], f"{len(lost)} of {len(confirmed)} lost: {lost[:20]}\n{cores.log('core1')[-4000:]}"
    assert "a node scaling down holds the only copy known here" in cores.log("core1")
    assert "Traceback" not in "".join(cores.log(node) for node in NODES)


if __name__ == "__main__":  # the client, inside the lab (see Agent)
    asyncio.run(agent(json.loads(sys.argv[2])))
