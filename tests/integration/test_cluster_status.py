"""What a node's cluster status says about its connections (real core processes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import fixed_port
from tests.integration.cluster_nodes import cluster_view, start_node, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.cluster]


@dataclass
class Port:
    link_port: int


def connection_to(view: dict[str, Any], port: int) -> dict[str, Any]:
    return next((c for c in view["connections"] if c["address"].endswith(f":{port}")), {})


def test_a_connection_that_came_up_carries_no_stale_error(tmp_path: Path) -> None:
    """The other node was not up yet when this one started: the connection failed, then came up; its
    reason is no longer that first failure."""
    later = Port(fixed_port())  # nothing listens there until the second node starts
    first = start_node(tmp_path, "first", [later])
    wait_until(lambda: connection_to(cluster_view(first), later.link_port).get("reason"), 15, "the first failure")
    second = start_node(tmp_path, "second", [first], core_link_port=str(later.link_port))
    wait_until(lambda: connection_to(cluster_view(first), later.link_port).get("state") == "up", 15, "the link up")
    assert connection_to(cluster_view(first), later.link_port)["reason"] == ""
    for node in (second, first):
        assert node.stop() == 0, node.log()
