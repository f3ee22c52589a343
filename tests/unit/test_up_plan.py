"""``tridentmq up``'s plan of child processes: single node, a cluster, replication pairs."""

from __future__ import annotations

from pathlib import Path

from tridentmq_shared.cli.supervisor import plan


def test_a_single_node_and_the_gateways(tmp_path: Path) -> None:
    children = plan(tmp_path, None)
    assert children[0].name == "core"
    assert children[0].env == {"TRIDENTMQ_CORE_NODE_DATA_DIR": str(tmp_path / "core")}
    assert {c.name for c in children[1:]} <= {"gateway-stomp", "gateway-mqtt", "gateway-amqp"}


def test_three_pairs_are_six_nodes_each_backup_named_after_its_primary_group(tmp_path: Path) -> None:
    children = plan(tmp_path, None, pairs=3)
    cores = {c.name: c.env for c in children if not c.name.startswith("gateway-")}
    assert sorted(cores) == ["backup-0", "backup-1", "backup-2", "core-0", "core-1", "core-2"]
    for i in range(3):
        primary, backup = cores[f"core-{i}"], cores[f"backup-{i}"]
        assert primary["TRIDENTMQ_CORE_HA_ROLE"] == "primary"
        assert backup["TRIDENTMQ_CORE_HA_ROLE"] == "backup"
        assert primary["TRIDENTMQ_CORE_HA_GROUP_NAME"] == backup["TRIDENTMQ_CORE_HA_GROUP_NAME"] == f"pair-{i}"
        assert primary["TRIDENTMQ_CORE_LINK_PORT"] == str(61616 + i)
        assert backup["TRIDENTMQ_CORE_LINK_PORT"] == str(61619 + i)
        # Every node knows every other one, its own backup included.
        assert f"127.0.0.1:{61619 + i}" in primary["TRIDENTMQ_CORE_CLUSTER_CONNECTORS"].split(",")
    gateways = [c for c in children if c.name.startswith("gateway-")]
    for gateway in gateways:  # linked to primaries only, knowing every node
        kind = gateway.name.removeprefix("gateway-").upper()
        assert int(gateway.env[f"TRIDENTMQ_{kind}_CORE_PORT"]) in (61616, 61617, 61618)
        assert len(gateway.env[f"TRIDENTMQ_{kind}_CORE_CONNECTORS"].split(",")) == 6
    assert (tmp_path / "cluster.password").exists()
