"""``tridentmq up``'s plan of child processes (single node, a cluster, replication pairs) and how it stops them."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from tridentmq_shared.cli import supervisor
from tridentmq_shared.cli.supervisor import (
    STOP_BACKUPS,
    STOP_GATEWAYS,
    STOP_NODES,
    Child,
    _run_child,
    _stop_signals,
    plan,
    stop_children,
    unused_node_data,
)


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
    assert (tmp_path / "cluster.password").stat().st_mode & 0o777 == 0o600


def test_the_gateways_stop_first_then_the_backups_then_the_nodes(tmp_path: Path) -> None:
    stages = {c.name: c.stop_stage for c in plan(tmp_path, None, pairs=2)}
    assert {name: stage for name, stage in stages.items() if not name.startswith("gateway-")} == {
        "core-0": STOP_NODES,
        "core-1": STOP_NODES,
        "backup-0": STOP_BACKUPS,
        "backup-1": STOP_BACKUPS,
    }
    assert {stage for name, stage in stages.items() if name.startswith("gateway-")} == {STOP_GATEWAYS}
    assert {c.stop_stage for c in plan(tmp_path / "single", None)} <= {STOP_GATEWAYS, STOP_NODES}


# A child that notes when it was asked to stop and when it is gone, taking a while in between (as a gateway ending
# its clients' sessions does), and one that ignores SIGTERM.
_POLITE = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
def stop(*_):
    log.write(f"{sys.argv[2]} asked\\n"); time.sleep(0.2); log.write(f"{sys.argv[2]} gone\\n"); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
log.write(f"{sys.argv[2]} up\\n")
while True: time.sleep(1)
"""
_STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "a").write(f"{sys.argv[2]} up\\n")
while True: time.sleep(1)
"""


async def test_each_stage_is_gone_before_the_next_is_asked_and_a_stubborn_child_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "log"

    def child(name: str, script: str, stage: int) -> Child:
        return Child(name, [sys.executable, "-c", script, str(log), name], stop_stage=stage)

    children = [
        child("core-0", _POLITE, STOP_NODES),
        child("gateway-mqtt", _POLITE, STOP_GATEWAYS),
        child("backup-0", _POLITE, STOP_BACKUPS),
        child("gateway-stomp", _STUBBORN, STOP_GATEWAYS),
    ]
    stopping = asyncio.Event()
    tasks = [asyncio.create_task(_run_child(c, stopping)) for c in children]
    try:
        for _ in range(400):
            if log.exists() and len(log.read_text().splitlines()) == len(children):
                break
            await asyncio.sleep(0.05)
        assert len(log.read_text().splitlines()) == len(children), log.read_text()  # every child is up
        stopping.set()
        # A grace a loaded machine cannot miss for the polite ones (CI once starved one for 2 s): the stubborn one
        # costs the whole of it.
        assert not await stop_children(children, tasks, grace_s=6.0)  # not clean: one had to be killed
    finally:
        for c in children:
            if c.process is not None and c.process.returncode is None:
                c.process.kill()
    lines = [line for line in log.read_text().splitlines() if not line.endswith(" up")]
    assert lines == [
        "gateway-mqtt asked",  # the gateways first (the stubborn one ignores it, and is killed after its grace)
        "gateway-mqtt gone",
        "backup-0 asked",  # then the backups, once every gateway is gone
        "backup-0 gone",
        "core-0 asked",  # then the nodes they back up
        "core-0 gone",
    ]
    assert {c.name: c.process.returncode for c in children if c.process is not None} == {
        "core-0": 0,
        "gateway-mqtt": 0,
        "backup-0": 0,
        "gateway-stomp": -9,
    }


def test_with_a_settings_folder_the_gateways_dial_the_link_its_core_file_sets(tmp_path: Path) -> None:
    (tmp_path / "core.toml").write_text("[link]\nport = 61700\n")
    children = plan(tmp_path / "data", None, tmp_path)
    core = next(c for c in children if c.name == "core")
    assert core.argv[-2:] == ["--config", str(tmp_path / "core.toml")]
    for gateway in (c for c in children if c.name.startswith("gateway-")):
        kind = gateway.name.removeprefix("gateway-").upper()
        assert gateway.env[f"TRIDENTMQ_{kind}_CORE_PORT"] == "61700"


# Writes one line longer than a pipe's read limit, then a last line without its newline, and exits.
_LONG_LINE = """
import sys
sys.stdout.write("x" * 200_000 + "\\n" + "last words")
"""


async def test_a_child_with_a_line_longer_than_a_read_is_seen_to_exit_and_started_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 64 KiB line stopped the reading of a child's output for good: the child was never seen to exit, so
    it was never started again, and ``up`` hung at Ctrl-C. The first restart comes after 1 s."""
    child = Child("gateway-mqtt", [sys.executable, "-c", _LONG_LINE])
    stopping = asyncio.Event()
    task = asyncio.create_task(_run_child(child, stopping))
    first = None
    for _ in range(200):
        await asyncio.sleep(0.05)
        if child.process is not None and first is None:
            first = child.process
        if child.process is not first:  # started again
            break
    stopping.set()
    await asyncio.wait_for(task, 10)
    assert child.process is not first
    out, err = capsys.readouterr()
    lines = out.splitlines()
    pieces = [line.removeprefix("gateway-mqtt   | ") for line in lines if "x" in line]  # both runs' lines
    assert "".join(pieces) == "x" * 200_000 * (len("".join(pieces)) // 200_000) != ""
    assert max(len(piece) for piece in pieces) <= 64 * 1024
    assert "gateway-mqtt   | last words" in lines
    assert "gateway-mqtt exited with 0; restarting in 1 s" in err


async def test_a_child_that_cannot_start_stops_up_but_one_that_ran_a_while_is_restarted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit status 78 at start (a port in use beside another ``up``) stops ``up``; the same status after the
    child ran a while (any later error) is a crash like another, and the child is started again."""
    cannot = Child("core", [sys.executable, "-c", "raise SystemExit(78)"])
    stopping = asyncio.Event()
    await asyncio.wait_for(_run_child(cannot, stopping), 10)
    assert cannot.cannot_start
    assert stopping.is_set()
    assert "tridentmq up: core cannot start (see above); stopping" in capsys.readouterr().err
    monkeypatch.setattr(supervisor, "MAX_BACKOFF", 0.0)  # every run counts as a long one
    ran = Child("core", [sys.executable, "-c", "raise SystemExit(78)"])
    stopping = asyncio.Event()
    task = asyncio.create_task(_run_child(ran, stopping))
    first = None
    for _ in range(200):
        await asyncio.sleep(0.05)
        first = first or ran.process
        if ran.process is not first:  # started again
            break
    stopping.set()
    await asyncio.wait_for(task, 10)
    assert ran.process is not first
    assert not ran.cannot_start


def test_a_hangup_stops_up_unless_it_was_started_to_ignore_it() -> None:
    """The children run in sessions of their own: without this a closed terminal left them all running; with
    ``nohup`` (SIGHUP ignored) ``up`` keeps running, as the user asked."""
    for handler, stops in ((signal.SIG_DFL, True), (signal.SIG_IGN, False)):
        previous = signal.signal(signal.SIGHUP, handler)
        try:
            assert (signal.SIGHUP in _stop_signals()) is stops
        finally:
            signal.signal(signal.SIGHUP, previous)


def test_node_data_another_topology_made_is_named_not_silently_left_behind(tmp_path: Path) -> None:
    """``up`` then ``up --nodes 3`` on the same data directory started a fresh cluster beside ``core``: its
    queued messages, sessions and retained messages were out of reach, and nothing said so."""
    for name in ("core", "core-0", "backup-1", "scratch"):
        (tmp_path / name).mkdir()
    for name in ("core", "core-0", "backup-1"):
        (tmp_path / name / "node.id").write_text("x")
    assert unused_node_data(tmp_path, plan(tmp_path, None, nodes=3)) == [tmp_path / "backup-1", tmp_path / "core"]
    assert unused_node_data(tmp_path, plan(tmp_path, None)) == [tmp_path / "backup-1", tmp_path / "core-0"]
    assert unused_node_data(tmp_path, plan(tmp_path, None, pairs=3)) == [tmp_path / "core"]
    assert unused_node_data(tmp_path / "missing", plan(tmp_path, None)) == []
