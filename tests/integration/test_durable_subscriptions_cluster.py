"""STOMP and AMQP durable subscriptions across a cluster: a client that subscribed through one node and came
back through another leaves a copy of its subscription queue on each. Ending the subscription ends it on
every node; a copy left behind would hand its messages to the next subscription of that name."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp
from proton import Message
from proton.reactor import DurableSubscription
from proton.utils import BlockingConnection
from tests.conftest import CoreProcess, GatewayProcess, start_gateway, stop_cleanly
from tests.integration.cluster_nodes import client, remote_consumers, start_cluster, wait_until
from tests.integration.test_amqp_container_id import assert_refused
from tests.integration.test_amqp_container_id import holder as amqp_sole
from tests.integration.test_stomp_gateway import connect as stomp_connect

from tridentmq_amqp.convert import durable_subscription_queue
from tridentmq_shared.message import RoutingType

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

WAIT = 10.0
PINNED = {"CORE_LOAD_BALANCING": "FIRST_ELEMENT"}  # each gateway's links stay on its own node


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[CoreProcess]]:
    nodes = start_cluster(tmp_path, 2)
    yield nodes
    for node in nodes:
        assert node.stop() == 0, node.log()
        assert "Traceback" not in node.log(), node.log()


def _pair(tmp_path: Path, nodes: list[CoreProcess], kind: str) -> tuple[GatewayProcess, GatewayProcess]:
    prefix = f"TRIDENTMQ_{kind.upper()}_"
    pinned = {prefix + key: value for key, value in PINNED.items()}
    return tuple(  # type: ignore[return-value]
        start_gateway(tmp_path, node, kind, name=f"{kind}-{i}", **pinned) for i, node in enumerate(nodes)
    )


def _holding(nodes: list[CoreProcess], queue: str, address: str) -> list[int]:
    """The indexes of the nodes that have the subscription queue ``queue`` of ``address``."""

    async def holds(node: CoreProcess) -> bool:
        async with client(node) as link:
            found = await link.create_queue(queue, address, routing_type=RoutingType.MULTICAST, passive=True)
            return found.get("exists") is not False

    return [i for i, node in enumerate(nodes) if asyncio.run(holds(node))]


def test_a_stomp_durable_unsubscribe_through_another_node_ends_the_subscription_on_both(
    tmp_path: Path, cluster: list[CoreProcess]
) -> None:
    first, second = _pair(tmp_path, cluster, "stomp")
    client_id, address = f"app-{uuid.uuid4().hex[:8]}", f"audit.{uuid.uuid4().hex[:8]}"
    topic = f"/topic/{address}"
    durable = {"durable-subscription-name": "audit"}
    queue = f"{client_id}.audit"
    try:
        conn, listener = stomp_connect(first, connect_headers={"client-id": client_id})
        conn.subscribe(topic, id="d", ack="auto", headers={**durable, "receipt": "subscribed"})
        listener.wait(lambda: "subscribed" in listener.receipts, "the first SUBSCRIBE")
        conn.disconnect()  # the subscription stays on node 0
        again, again_listener = stomp_connect(second, connect_headers={"client-id": client_id})
        again.subscribe(topic, id="d", ack="auto", headers={**durable, "receipt": "subscribed"})
        again_listener.wait(lambda: "subscribed" in again_listener.receipts, "the SUBSCRIBE through node 1")
        wait_until(lambda: remote_consumers(cluster[0], queue) == 1, WAIT, "node 0 to know the consumer on node 1")
        assert _holding(cluster, queue, address) == [0, 1]
        again.unsubscribe("d", headers={**durable, "receipt": "gone"})
        again_listener.wait(lambda: "gone" in again_listener.receipts, "the UNSUBSCRIBE")
        assert _holding(cluster, queue, address) == [], "a copy of the ended subscription stayed"
        again.disconnect()
    finally:
        for gateway in (first, second):
            stop_cleanly(gateway)


def test_an_amqp_durable_subscription_closed_through_another_node_ends_on_both(
    tmp_path: Path, cluster: list[CoreProcess]
) -> None:
    first, second = _pair(tmp_path, cluster, "amqp")
    container, address = f"app-{uuid.uuid4().hex[:8]}", f"audit.{uuid.uuid4().hex[:8]}"
    topic = f"topic://{address}"
    queue = durable_subscription_queue(container, "sub")
    try:
        conn = BlockingConnection(f"amqp://127.0.0.1:{first.port}", timeout=WAIT, container_id=container)
        conn.create_receiver(topic, name="sub", options=DurableSubscription()).detach()  # stays on node 0
        conn.close()
        conn = BlockingConnection(f"amqp://127.0.0.1:{second.port}", timeout=WAIT, container_id=container)
        subscription = conn.create_receiver(topic, name="sub", options=DurableSubscription())
        wait_until(lambda: remote_consumers(cluster[0], queue) == 1, WAIT, "node 0 to know the consumer on node 1")
        assert _holding(cluster, queue, address) == [0, 1]
        subscription.close()  # closed, not detached: the JMS unsubscribe
        assert _holding(cluster, queue, address) == [], "a copy of the ended subscription stayed"
        # Subscribing again under that name is a new subscription: it gets what is published from now on.
        subscription = conn.create_receiver(topic, name="sub", options=DurableSubscription())
        sender = conn.create_sender(topic)
        sender.send(Message(body="new", durable=True))
        got = subscription.receive(timeout=WAIT)
        subscription.accept()
        assert got.body == "new"
        subscription.close()
        conn.close()
    finally:
        for gateway in (first, second):
            stop_cleanly(gateway)


def test_a_stomp_client_id_is_one_connections_across_the_cluster(tmp_path: Path, cluster: list[CoreProcess]) -> None:
    """A client id held through node 0 is refused through node 1, and free there as soon as its holder leaves."""
    first, second = _pair(tmp_path, cluster, "stomp")
    client_id = f"app-{uuid.uuid4().hex[:8]}"
    try:
        holder, _ = stomp_connect(first, connect_headers={"client-id": client_id})
        with pytest.raises(stomp.exception.ConnectFailedException):
            stomp_connect(second, connect_headers={"client-id": client_id})
        assert "stomp client id in use" in second.log()
        holder.disconnect()
        again, _ = stomp_connect(second, connect_headers={"client-id": client_id})
        with pytest.raises(stomp.exception.ConnectFailedException):
            stomp_connect(first, connect_headers={"client-id": client_id})
        again.disconnect()
    finally:
        for gateway in (first, second):
            stop_cleanly(gateway)


def test_an_amqp_container_id_held_as_sole_is_one_connections_across_the_cluster(
    tmp_path: Path, cluster: list[CoreProcess]
) -> None:
    """A container id held through node 0 (sole-connection-for-container) is refused through node 1, and free
    there as soon as its holder leaves."""
    first, second = _pair(tmp_path, cluster, "amqp")
    container = f"app-{uuid.uuid4().hex[:8]}"
    try:
        holder = amqp_sole(first, container)
        assert_refused(second, container)
        holder.close()
        again = amqp_sole(second, container)
        assert_refused(first, container)
        again.close()
    finally:
        for gateway in (first, second):
            stop_cleanly(gateway)
