"""A replication pair whose path carries 2 Mbit/s, in network namespaces (``NetLab``).

A backup was dropped when it acknowledged nothing for the heartbeat timeout (1 s). Over a slow path the first
batch of its copy (up to 1 MiB) took longer than that to arrive: it was dropped, copied again, dropped again,
and never got in sync (on 10 Mbit/s with a 30 MB backlog, 74 drops in 120 s, each one a new epoch for the
pair). It is now dropped only when its host also takes nothing more of what was sent.

Each core runs in a namespace of its own with the default ports; the client runs in the namespace ``cl``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integration.lab_cores import LabCores
from tests.jepsen.nemesis import NetLab, NetLabError, kill9

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.timeout(90)]

MESSAGES = 1000  # about 1.1 MB: 4.5 s on 2 Mbit/s, where a 1 MiB batch takes 4.2 s
PUBLISH = f"""
import asyncio, sys
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import new_message
async def main():
    async with LinkClient(sys.argv[1], 61616) as client:
        await client.create_queue("backlog", "backlog", durable=True)
        confirms = await client.publish_batch(new_message("backlog", b"m-%d-" % i + b"x" * 1000, durable=True)
                    for i in range({MESSAGES}))
        await asyncio.gather(*confirms)
asyncio.run(main())
"""
DRAIN = """
import asyncio, sys
from tridentmq_shared.link.client import LinkClient
async def main():
    async with LinkClient(sys.argv[1], 61616) as client:
        consumer = await client.subscribe("backlog", credit=1000)
        got = set()
        while (delivery := await consumer.get(timeout=3.0)) is not None:
            got.add(delivery.body)
            consumer.ack(delivery)
        await asyncio.sleep(0.2)
    print(len(got))
asyncio.run(main())
"""


def client(lab: NetLab, script: str, node: str) -> str:
    """Run ``script`` in the client namespace against ``node``; what it printed."""
    process = lab.run("cl", [sys.executable, "-c", script, lab.address(node)], stdout=subprocess.PIPE)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, f"client exited with {process.returncode}"
    return out.decode().strip()


@pytest.fixture
def lab() -> Iterator[NetLab]:
    available = NetLab.available()
    if not available:
        pytest.skip(f"no network lab: {available.reason}")
    with NetLab(["p", "b", "cl"]) as lab:
        yield lab


def test_a_backup_on_a_slow_path_gets_in_sync_and_takes_over_with_every_message(lab: NetLab, tmp_path: Path) -> None:
    pair = LabCores(lab, tmp_path)
    ha = {
        "TRIDENTMQ_CORE_CLUSTER_SCALE_DOWN": "false",
        "TRIDENTMQ_CORE_HA_POLICY": "replication",
        "TRIDENTMQ_CORE_HA_GROUP_NAME": "a",
        "TRIDENTMQ_CORE_HA_ACTIVATE_WITHOUT_QUORUM": "true",  # a single pair: no other pairs to vote
    }
    try:
        pair.start("p", [], **ha, TRIDENTMQ_CORE_HA_ROLE="primary")
        client(lab, PUBLISH, "p")
        try:
            lab.limit_rate("p", "2mbit")
        except NetLabError as error:
            pytest.skip(f"no token bucket here: {error}")
        pair.start("b", ["p"], **ha, TRIDENTMQ_CORE_HA_ROLE="backup")
        pair.wait_for_log("b", "in sync with the primary", timeout=40)
        assert "acknowledged nothing" not in pair.log("p"), pair.log("p")[-3000:]
        kill9(pair.processes["p"].pid)
        pair.processes["p"].wait(timeout=5)
        pair.wait_for_log("b", "backup activated", timeout=20)
        assert client(lab, DRAIN, "b") == str(MESSAGES)
    finally:
        pair.close()
