"""Randomised fault schedules against three replication pairs (marker ``slow``: ``pytest -m slow``).

A nemesis picks a random node every couple of seconds and kills it (-9) or pauses it (SIGSTOP) for longer than
the detection window; whatever exited is started again with its own configuration, as a supervisor would.
Producers publish unique values with confirms through link clients that follow the topology. When the
schedule ends the cluster must heal by itself (one active copy per pair, every backup in sync); then every
active node is drained and the total-queue checker asserts that nothing confirmed was lost.

``TRIDENTMQ_RANDOM_SEED`` replays a schedule; ``TRIDENTMQ_RANDOM_SECONDS`` sets its length (default 60).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import CoreProcess
from tests.integration.cluster_nodes import start_node, wait_until
from tests.integration.ha_pairs import ha_view
from tests.jepsen.checker import check

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.topology import Topology
from tridentmq_shared.message import new_message

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.fault, pytest.mark.slow]

GROUPS = ("a", "b", "c")
QUEUE = "random.q"
HEAL_TIMEOUT = 60.0  # seconds for the cluster to settle after a fault


def free_ports(count: int) -> list[int]:
    """Ports the nodes keep across restarts, so every node's connector list stays true."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@dataclass
class Node:
    """One configured node; ``process`` is its current incarnation."""

    name: str
    group: str
    role: str
    port: int
    process: CoreProcess | None = None
    incarnations: int = 0

    def running(self) -> bool:
        return self.process is not None and self.process.process.poll() is None


@dataclass
class Cluster:
    tmp_path: Path
    failback: bool
    nodes: list[Node] = field(default_factory=list)

    def start(self, node: Node) -> None:
        if node.process is not None:  # keep each incarnation's log for the report
            shutil.move(node.process.log_path, node.process.log_path.with_suffix(f".{node.incarnations}.log"))
        node.incarnations += 1
        others = [Port(n.port) for n in self.nodes if n is not node]
        settings = {
            "core_ha_policy": "replication",
            "core_ha_group_name": node.group,
            "core_ha_allow_failback": str(self.failback).lower(),
            "core_link_port": str(node.port),
        }
        if node.role == "backup":
            settings["core_ha_role"] = "backup"
        node.process = start_node(self.tmp_path, node.name, others, **settings)

    def view(self, node: Node) -> dict[str, Any]:
        """The node's HA view; a node that restarted itself in place (failback) wrote new ports first."""
        if not node.running() or node.process is None:
            return {}
        view = ha_view(node.process)
        ports = node.process.data_dir / "ports.json"
        if not view and ports.exists():
            with contextlib.suppress(ValueError, KeyError):
                node.process.management_port = json.loads(ports.read_text())["management"]
                view = ha_view(node.process)
        return view

    def pair(self, group: str) -> list[Node]:
        return [n for n in self.nodes if n.group == group]

    def healed(self) -> bool:
        """Every pair has exactly one active copy and an in-sync backup; with failback, the active copy is
        the configured primary again (until then a hand-over is still to come)."""
        for group in GROUPS:
            views = [self.view(n) for n in self.pair(group)]
            if sum(v.get("active") is True for v in views) != 1:
                return False
            if not any(v.get("in_sync") is True for v in views):
                return False
            if self.failback and not any(
                v.get("active") is True and v.get("configured_role") == "primary" for v in views
            ):
                return False
        return True

    def actives(self) -> list[Node]:
        return [n for n in self.nodes if self.view(n).get("active") is True]

    def report(self) -> str:
        lines = []
        for node in self.nodes:
            state = self.view(node)
            lines.append(f"{node.name}: running={node.running()} incarnations={node.incarnations} {state}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Port:
    """The link port a node keeps across its restarts: a connector for the others."""

    link_port: int


@dataclass
class Ledger:
    attempted: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


async def produce(cluster: Cluster, group: str, ledger: Ledger, stop: asyncio.Event) -> None:
    """Publish ``<group>-<n>`` values with confirms through a client that follows its pair."""
    ports = [n.port for n in cluster.pair(group)]
    producer = LinkClient(
        topology=Topology([("127.0.0.1", p) for p in ports]),
        follow_topology=True,
        reconnect=ReconnectPolicy(max_interval=0.5, initial_attempts=-1),
    )
    await producer.connect()
    pending: set[asyncio.Future[None]] = set()
    window = asyncio.Semaphore(100)  # unconfirmed publishes at a time
    try:
        i = 0
        while not stop.is_set():
            value = f"{group}-{i}"
            i += 1
            ledger.attempted.append(value)
            await window.acquire()
            try:
                (future,) = await asyncio.wait_for(
                    producer.publish_batch([new_message(QUEUE, value.encode(), durable=True)]), 5
                )
            except (TimeoutError, LinkRequestError):
                window.release()
                await asyncio.sleep(0.1)
                continue  # indeterminate: counted as attempted only
            pending.add(future)
            future.add_done_callback(lambda f, v=value: settled(ledger, v, f, pending, window))
            await asyncio.sleep(0.002)
        if pending:
            await asyncio.wait(pending, timeout=10)
    finally:
        await producer.close()


def settled(
    ledger: Ledger,
    value: str,
    future: asyncio.Future[None],
    pending: set[asyncio.Future[None]],
    window: asyncio.Semaphore,
) -> None:
    pending.discard(future)
    window.release()
    if future.cancelled():
        return
    error = future.exception()
    if error is None:
        ledger.confirmed.append(value)
    elif isinstance(error, LinkRequestError) and error.code == "rejected":
        ledger.rejected.append(value)


async def nemesis(cluster: Cluster, rng: random.Random, seconds: float, log: list[str]) -> None:
    """Kill -9 or pause a random node every 1.5 to 3.5 s; restart whatever exited. One fault at a time, as
    promised: the next comes once the cluster healed from the last (every pair serves, with its backup in
    sync again)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(1.5, 3.5))
        for node in cluster.nodes:  # a supervisor restarts what died (fenced, killed, failed)
            if not node.running():
                log.append(f"{time.monotonic():.1f} restart {node.name}")
                await asyncio.to_thread(cluster.start, node)
        await asyncio.to_thread(wait_until, cluster.healed, HEAL_TIMEOUT, "the cluster to heal from the last fault")
        node = rng.choice(cluster.nodes)
        if not node.running() or node.process is None:
            continue
        if rng.random() < 0.6:
            log.append(f"{time.monotonic():.1f} kill {node.name}")
            node.process.process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(node.process.process.wait, 10)
        else:
            pause = rng.uniform(1.0, 3.0)
            log.append(f"{time.monotonic():.1f} pause {node.name} {pause:.1f}s")
            node.process.process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(pause)
            node.process.process.send_signal(signal.SIGCONT)
    await asyncio.sleep(2.0)
    for node in cluster.nodes:
        if not node.running():
            log.append(f"{time.monotonic():.1f} restart {node.name}")
            await asyncio.to_thread(cluster.start, node)


async def drain(processes: list[CoreProcess], quiet: float = 5.0) -> dict[str, list[str]]:
    """Consume from every active node at once (so no node sends its backlog to another meanwhile) until none
    has delivered anything for ``quiet`` seconds; the values each node delivered."""
    got: dict[str, list[str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        consumers = []
        for process in processes:
            c = await stack.enter_async_context(
                LinkClient("127.0.0.1", process.link_port, reconnect=ReconnectPolicy(attempts=0))
            )
            consumers.append((process.log_path.parent.name, await c.subscribe(QUEUE, credit=1000)))
        last = time.monotonic()
        while time.monotonic() - last < quiet:
            for name, consumer in consumers:
                while (delivery := await consumer.get(timeout=0.05)) is not None:
                    got.setdefault(name, []).append(delivery.body.decode())
                    consumer.ack(delivery)
                    last = time.monotonic()
        await asyncio.sleep(0.2)  # the acks reach the nodes before the links close
    return got


@pytest.mark.parametrize("failback", [False, True], ids=["no-failback", "failback"])
async def test_random_kills_and_pauses_of_three_pairs_lose_nothing_confirmed(tmp_path: Path, failback: bool) -> None:
    seed = int(os.environ.get("TRIDENTMQ_RANDOM_SEED") or random.randrange(2**31))
    seconds = float(os.environ.get("TRIDENTMQ_RANDOM_SECONDS", "60"))
    rng = random.Random(seed)
    ports = free_ports(2 * len(GROUPS))
    cluster = Cluster(tmp_path, failback)
    for i, group in enumerate(GROUPS):
        cluster.nodes += [
            Node(f"{group}-primary", group, "primary", ports[2 * i]),
            Node(f"{group}-backup", group, "backup", ports[2 * i + 1]),
        ]
    for node in cluster.nodes:
        cluster.start(node)
    await asyncio.to_thread(wait_until, cluster.healed, 30, "three pairs in sync")
    ledger = Ledger()
    stop = asyncio.Event()
    schedule: list[str] = []
    producers = [asyncio.create_task(produce(cluster, group, ledger, stop)) for group in GROUPS]
    try:
        try:
            await nemesis(cluster, rng, seconds, schedule)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*producers), 30)
            await asyncio.to_thread(wait_until, cluster.healed, HEAL_TIMEOUT, "the cluster to heal")
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}\n" + "\n".join(schedule) + "\n" + cluster.report()) from exc
        by_node = await drain([n.process for n in cluster.actives() if n.process is not None])
        delivered = [value for values in by_node.values() for value in values]
        verdict = check(ledger.attempted, ledger.confirmed, ledger.rejected, delivered)
        counts = ", ".join(f"{name}: {len(values)}" for name, values in sorted(by_node.items()))
        assert verdict.ok, f"seed {seed}\n" + "\n".join(schedule) + f"\ndelivered {counts}\n" + verdict.report()
        assert len(ledger.confirmed) > 0
    finally:
        stop.set()
        for task in producers:
            task.cancel()
        for node in cluster.nodes:
            if node.process is not None:
                node.process.process.send_signal(signal.SIGCONT)
                node.process.stop()
