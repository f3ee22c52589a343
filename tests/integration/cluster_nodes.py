"""Helpers for cluster tests: start core nodes that form a cluster, read their cluster view, wait for it."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tests.conftest import CoreProcess, start_core

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy

CLUSTER_USER = "cluster"
CLUSTER_PASSWORD = "s3cret-cluster"
NO_RECONNECT = ReconnectPolicy(attempts=0)


class Connector(Protocol):
    """Anything with a link port: a running node, or the port a node will come back on."""

    @property
    def link_port(self) -> int: ...


def cluster_env(connectors: Sequence[Connector] = (), **settings: str) -> dict[str, str]:
    env = {
        "TRIDENTMQ_CORE_CLUSTER_USER": CLUSTER_USER,
        "TRIDENTMQ_CORE_CLUSTER_PASSWORD": CLUSTER_PASSWORD,
        "TRIDENTMQ_CORE_CLUSTER_CONNECTORS": ",".join(f"127.0.0.1:{n.link_port}" for n in connectors),
    }
    env.update({f"TRIDENTMQ_CORE_CLUSTER_{k.upper()}": v for k, v in settings.items()})
    return env


def start_node(tmp_path: Path, name: str, connectors: Sequence[Connector] = (), **settings: str) -> CoreProcess:
    env = cluster_env(connectors, **{k: v for k, v in settings.items() if not k.startswith("core_")})
    env.update({f"TRIDENTMQ_{k.upper()}": v for k, v in settings.items() if k.startswith("core_")})
    return start_core(tmp_path, name, **env)


def cluster_view(node: CoreProcess) -> dict[str, Any]:
    with urllib.request.urlopen(node.management_url + "/api/cluster", timeout=5) as response:
        return dict(json.loads(response.read()))


def members(node: CoreProcess) -> set[str]:
    try:
        return {m["node_id"] for m in cluster_view(node)["members"]}
    except (urllib.error.URLError, OSError):
        return set()


def node_id(node: CoreProcess) -> str:
    return str(cluster_view(node)["node_id"])


def wait_until(predicate: Any, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def wait_until_async(predicate: Any, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def wait_converged(nodes: list[CoreProcess], timeout: float = 15.0) -> None:
    """Every node sees every other node as a live member."""
    ids = {node_id(n) for n in nodes}
    wait_until(lambda: all(members(n) == ids for n in nodes), timeout, f"{len(nodes)} nodes to see each other")


def start_cluster(tmp_path: Path, count: int, **settings: str) -> list[CoreProcess]:
    """``count`` nodes: the first alone, each later one pointed at the first; they find the rest themselves."""
    first = start_node(tmp_path, "node-0", **settings)
    nodes = [first] + [start_node(tmp_path, f"node-{i}", [first], **settings) for i in range(1, count)]
    wait_converged(nodes)
    return nodes


def remote_consumers(node: CoreProcess, queue: str) -> int:
    """Consumers of ``queue`` on the other nodes, as ``node`` knows them."""
    return sum(cluster_view(node)["remote_consumers"].get(queue, {}).values())


def client(node: CoreProcess) -> LinkClient:
    return LinkClient("127.0.0.1", node.link_port, reconnect=NO_RECONNECT)
