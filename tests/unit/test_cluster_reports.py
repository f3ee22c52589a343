"""Another node's reports (its join answer, its topology updates) are checked at the edge: a malformed field
refuses that report, with one log line; it never raises into the cluster connection's task (which would stop
the whole node) or its link's callback. And however many members a node reports, this one connects to a
bounded number of them. In process with a real broker (``broker_harness``)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.broker_harness import ANYCAST, Harness

from tridentmq_core.cluster.bridge import Bridge
from tridentmq_core.cluster.discovery import MAX_MEMBERS
from tridentmq_core.cluster.manager import ClusterManager

OTHER = "node-2"


def _manager(h: Harness) -> ClusterManager:
    return ClusterManager(
        h.broker, h.settings, node_id="node-1", name="one", advertise=("127.0.0.1", 1), schedule_flush=lambda: None
    )


def _bridge(manager: ClusterManager, state: str) -> Bridge:
    bridge = Bridge(manager, "127.0.0.1", 9)
    bridge.node_id, bridge.state = OTHER, state
    manager.bridges[bridge.address] = manager.bridges_by_node[OTHER] = bridge
    return bridge


@pytest.mark.parametrize(
    "reply", [{"bindings": 5}, {"members": 7}, {"bindings": [], "members": True}, {"bindings": "queues"}]
)
def test_a_join_answer_with_a_field_of_the_wrong_kind_is_refused(reply: dict[str, Any]) -> None:
    """Found by a review: ``TypeError`` out of the join stopped the node (exit 70)."""
    manager = _manager(Harness())
    bridge = _bridge(manager, "connecting")
    assert manager.bridge_up(bridge, reply) is False
    assert bridge.state == "refused"
    assert "is a list" in bridge.reason


@pytest.mark.parametrize("update", [{"members": 5}, {"bindings": 5}, {"removed": 3}, {"bindings": [], "removed": {}}])
def test_an_update_with_a_field_of_the_wrong_kind_is_refused_and_the_link_goes_on(update: dict[str, Any]) -> None:
    manager = _manager(Harness())
    bridge = _bridge(manager, "up")
    binding = [OTHER, "orders", "orders", ANYCAST, None, 0, None, 1, True]
    manager.bindings.replace(OTHER, [binding])
    manager.apply_update(bridge, update)  # raised TypeError into the link's data_received, dropping the link
    assert [b.queue for b in manager.bindings.for_queue("orders")] == ["orders"]


async def test_a_node_connects_to_a_bounded_number_of_reported_members() -> None:
    """Each member learned gets a cluster connection retried for ever: one update listing thousands of members
    started thousands of them."""
    manager = _manager(Harness())
    bridge = _bridge(manager, "up")
    members = [{"node_id": f"n{i}", "name": "", "host": "127.0.0.1", "port": 20_000 + i} for i in range(1_500)]
    try:
        manager.apply_update(bridge, {"members": members})
        assert len(manager.members) == MAX_MEMBERS
        assert len(manager.bridges) == MAX_MEMBERS + 1  # and the one to OTHER
    finally:
        manager.bridges.pop(bridge.address)
        await manager.stop()
