"""Randomised Jepsen-style runs over the cluster ``tridentmq up --pairs 3`` / ``--nodes 3`` starts, with paho-mqtt,
stomp.py, python-qpid-proton and link clients at once, consumers moving every 0.2-3 s and a nemesis of kill -9,
SIGSTOP, partitions (symmetric, one-way, node-only), failback, a gateway killed or stopped with its clients on
it, and scale-down: see ``tests/jepsen/defaults.py``.

The run is a process of its own (it enters the lab's client namespace, which pytest's process must not). The
short schedule is in the default suite, with a new seed each run (a failure names it; ``TRIDENTMQ_RANDOM_SEED``
replays its schedule). The long one runs on demand:

    TRIDENTMQ_RANDOM_SEED=N TRIDENTMQ_RANDOM_SECONDS=1800 uv run pytest -m slow \
        tests/integration/test_jepsen_defaults.py
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tests.jepsen.nemesis import NetLab

AVAILABLE = NetLab.available()
REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.cluster,
    pytest.mark.fault,
    pytest.mark.skipif(not AVAILABLE, reason=f"no network lab: {AVAILABLE.reason}"),
]


def jepsen(tmp_path: Path, topology: str, seconds: float, gateway_sets: int) -> dict[str, object]:
    seed = int(os.environ.get("TRIDENTMQ_RANDOM_SEED") or random.randrange(2**31))
    out = tmp_path / "verdict.json"
    argv = [
        sys.executable,
        "-m",
        "tests.jepsen.defaults",
        "--topology",
        topology,
        "--seed",
        str(seed),
        "--seconds",
        str(seconds),
        "--gateway-sets",
        str(gateway_sets),
        "--dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=seconds + 600, check=False)
    assert out.exists(), f"seed {seed}: the run ended without a verdict ({done.returncode}):\n{done.stderr[-5000:]}"
    result: dict[str, object] = json.loads(out.read_text())
    verdicts = result["verdicts"]
    assert isinstance(verdicts, dict)
    summary = "\n".join(
        [
            f"seed {seed} ({topology}): {result['failure'] or 'healed'}; faults {result['faults']}",
            f"client threads that failed: {result['crashed_clients']}",
            *(
                f"{name}: {v['report']}\n  stuck after heal: {v['stuck']} e.g. {v['stuck_examples']}"
                for name, v in verdicts.items()
            ),
            "schedule:",
            *result["schedule"],
            "client notes (last):",
            *result["client_notes"][-40:],
        ]  # type: ignore[misc]
    )
    assert result["ok"], summary
    assert all(v["acknowledged"] > 0 and v["unflagged_duplicates"] == 0 for v in verdicts.values()), summary
    return result


@pytest.mark.timeout(600)
def test_short_schedule_over_up_nodes_loses_and_strands_nothing(tmp_path: Path) -> None:
    jepsen(tmp_path, "nodes", float(os.environ.get("TRIDENTMQ_RANDOM_SECONDS") or 10), gateway_sets=1)


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.parametrize("topology", ["pairs", "nodes"])
def test_long_schedule_over_up_loses_and_strands_nothing(tmp_path: Path, topology: str) -> None:
    jepsen(tmp_path, topology, float(os.environ.get("TRIDENTMQ_RANDOM_SECONDS") or 600), gateway_sets=2)
