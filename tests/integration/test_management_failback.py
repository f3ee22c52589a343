"""A failback an operator asks for: a pair with ``ha.allow_failback`` off stays on its backup after the primary
comes back and catches up, until ``tridentmq node failback`` hands it back (real core processes)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import CoreProcess
from tests.integration.cluster_nodes import node_id, start_node, wait_until
from tests.integration.ha_pairs import Pair, ha_view, start_pair
from tests.integration.test_ha import kill

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.fault]

WAIT = 30.0


def failback(node: CoreProcess, node_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tridentmq_shared.cli",
            "node",
            "failback",
            "--node",
            node_id,
            "--management",
            node.management_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def fail_over_and_return(tmp_path: Path, pair: Pair, group: str, port: int, settings: dict[str, str]) -> CoreProcess:
    """Kill the pair's primary, wait for its backup to take over, and start the primary again at its address:
    the returned node (it copies the active backup, and with allow_failback off stays its backup)."""
    kill(pair.primary)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, WAIT, "the takeover")
    (pair.backup.data_dir / "ports.json").unlink()
    return start_node(
        tmp_path,
        f"{group}-primary",
        [pair.backup],
        core_ha_policy="replication",
        core_ha_group_name=group,
        core_link_port=str(port),
        **settings,
    )


def test_an_operator_hands_the_pair_back_to_its_returned_primary(tmp_path: Path) -> None:
    settings = {"core_ha_activate_without_quorum": "true", "core_ha_allow_failback": "false"}
    pair = start_pair(tmp_path, "mf", **settings)
    primary_id = node_id(pair.primary)
    port = pair.primary.link_port
    refused = failback(pair.primary, primary_id)  # the primary serves in its own place: nothing to hand back
    assert refused.returncode == 1
    assert "409" in refused.stderr
    returned = fail_over_and_return(tmp_path, pair, "mf", port, settings)
    wait_until(lambda: ha_view(pair.backup).get("backup_in_sync") is True, WAIT, "the returned primary in sync")
    assert ha_view(returned).get("active") is not True  # allow_failback is off: it stays the backup
    done = failback(pair.backup, primary_id)  # the backup serves as that node
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("failback 1"), done.stdout
    wait_until(lambda: ha_view(returned).get("active") is True, WAIT, "the failback")
    assert node_id(returned) == primary_id


async def test_a_failback_whose_primary_goes_away_leaves_the_backup_serving_and_confirming(tmp_path: Path) -> None:
    """The returned primary went away during the failback, before it held everything: the backup said it served
    again, but had left the cluster and confirmed no durable publish any more (the lost backup's loss was
    never settled: no quorum asked, the confirm limit of its last acknowledgement kept). Found by a review."""
    settings = {"core_ha_activate_without_quorum": "true", "core_ha_allow_failback": "false"}
    pair = start_pair(tmp_path, "ff", **settings)
    primary_id = node_id(pair.primary)
    port = pair.primary.link_port
    returned = fail_over_and_return(tmp_path, pair, "ff", port, settings)
    try:
        wait_until(lambda: ha_view(pair.backup).get("backup_in_sync") is True, WAIT, "the returned primary in sync")
        async with LinkClient("127.0.0.1", pair.backup.link_port, reconnect=ReconnectPolicy(attempts=0)) as producer:
            await producer.publish(new_message("ff.q", b"before", durable=True))
            returned.process.send_signal(signal.SIGSTOP)  # it holds nothing more from here on
            await producer.publish_batch([new_message("ff.q", b"during", durable=True)])  # not confirmed yet
            started = await asyncio.to_thread(failback, pair.backup, primary_id)
            assert started.returncode == 0, started.stderr
        wait_until(lambda: "went away before it held everything" in pair.backup.log(), WAIT, "the failback to fail")
    finally:
        returned.process.send_signal(signal.SIGCONT)
        kill(returned)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, WAIT, "the backup to serve again")
    async with LinkClient("127.0.0.1", pair.backup.link_port, reconnect=ReconnectPolicy(attempts=0)) as producer:
        await asyncio.wait_for(producer.publish(new_message("ff.q", b"after", durable=True)), WAIT)
    assert "Traceback" not in pair.backup.log(), pair.backup.log()
    assert pair.backup.stop() == 0
