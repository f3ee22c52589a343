"""Shared fixtures of the Spark tests: ONE local Spark session, and audit files from a real cluster run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import stomp
from pyspark.sql import SparkSession
from tests.conftest import start_gateway
from tests.integration.cluster_nodes import client, remote_consumers, start_cluster, wait_until
from tests.integration.mqtt_clients import Paho

from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import M_BODY, M_ID, new_message
from tridentmq_spark.session import get_session


@dataclass
class ClusterAudit:
    audit_dir: Path
    node_ids: list[str]
    stomp_sent: int  # durable messages sent through the STOMP gateway (linked to node-0) to "orders"
    link_sent: int  # durable messages sent by a link client to "orders" on node-2
    rejected: int  # link client messages the consumer rejected (dead-lettered): each one was forwarded


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = get_session("local[2]")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


async def _link_traffic(nodes: list, audit: dict[str, int]) -> None:
    a, b, c = nodes
    async with client(b) as cb, client(c) as cc:
        consumer = await cb.subscribe("orders", credit=100)
        wait_until(lambda: remote_consumers(a, "orders") == 1, what="node-0 to see node-1's consumer")
        # STOMP producer: the gateway spreads its sessions over the cluster's nodes (ROUND_ROBIN), so a STOMP
        # message may or may not be forwarded to the consumer on node-1.
        conn = stomp.Connection12([("127.0.0.1", audit["stomp_port"])])
        conn.connect(wait=True)
        for i in range(audit["stomp_sent"]):
            conn.send("/queue/orders", f"stomp {i}", headers={"persistent": "true", "receipt": f"r{i}"})
        conn.disconnect()
        messages = (new_message("orders", f"link {i}".encode(), durable=True) for i in range(audit["link_sent"]))
        await asyncio.gather(*await cc.publish_batch(messages))
        total, got, rejected = audit["stomp_sent"] + audit["link_sent"], 0, 0
        deadline = time.monotonic() + 30
        while got < total and time.monotonic() < deadline:
            batch = await consumer.get_batch(timeout=0.5)
            for _, message in batch:
                got += 1
                # Only messages sent on node-2: each was forwarded, which the trace test follows.
                if rejected < audit["rejected"] and message[M_BODY].startswith(b"link "):
                    rejected += 1
                    consumer.nack_ids([message[M_ID]], mode=NackMode.REJECT)
                else:
                    consumer.ack_ids([message[M_ID]])
        assert got == total, f"received {got} of {total}"


@pytest.fixture(scope="session")
def cluster_audit(tmp_path_factory: pytest.TempPathFactory) -> ClusterAudit:
    """Three real core nodes writing into one audit folder, with traffic through the STOMP and MQTT gateways
    and link clients (forwarding across nodes, a dead letter), then a node leaving and a clean stop."""
    tmp = tmp_path_factory.mktemp("cluster-audit")
    audit_dir = tmp / "audit"
    nodes = start_cluster(tmp, 3, core_audit_directory=str(audit_dir), core_audit_message_events="all")
    gateways = []
    try:
        gateways = [start_gateway(tmp, nodes[0], "stomp"), start_gateway(tmp, nodes[1], "mqtt")]
        audit = {"stomp_port": gateways[0].port, "stomp_sent": 40, "link_sent": 30, "rejected": 3}
        asyncio.run(_link_traffic(nodes, audit))
        mqtt = Paho(gateways[1].port, "audit-mqtt")
        mqtt.connect()
        for i in range(5):
            mqtt.client.publish("sensors/temp", f"{i}".encode(), qos=1).wait_for_publish(10)
        mqtt.disconnect()
        for gateway in gateways:
            gateway.stop()
        assert nodes[2].stop() == 0  # the others write node.left
        for node in nodes[:2]:
            assert node.stop() == 0
    finally:
        for process in [*gateways, *nodes]:
            process.stop()
    node_ids = sorted(p.name for p in audit_dir.iterdir())
    assert len(node_ids) == 3
    return ClusterAudit(audit_dir, node_ids, audit["stomp_sent"], audit["link_sent"], audit["rejected"])
