"""The supervisor of background tasks: a failure is logged with its traceback, then restarted or fatal."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.unit.broker_harness import Harness

import tridentmq_core.store.journal as journal_module
from tridentmq_core.__main__ import serve
from tridentmq_core.cluster.bridge import Bridge
from tridentmq_core.server import CoreNode
from tridentmq_core.settings import CoreSettings, LinkSection, ManagementSection, NodeSection
from tridentmq_shared.gateway import ClientSession, GatewayShell, ShellConfig, Wire
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message
from tridentmq_shared.supervision import EXIT_TASK_FAILED, Supervisor, current, end_on_failure, install


class Boom(RuntimeError):
    pass


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None and isinstance(r.exc_info[1], Boom)]


async def test_a_restartable_task_is_logged_and_started_again(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor()
    runs = 0
    done = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise Boom(f"run {runs}")
        done.set()

    supervisor.spawn("flaky", flaky, restart=True)
    await asyncio.wait_for(done.wait(), 10)
    assert runs == 3
    assert supervisor.healthy
    assert len(tracebacks(caplog)) == 2
    assert sum(r.getMessage() == "background task restarted" for r in caplog.records) == 2


async def test_a_task_failing_too_often_fails_the_process(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor(max_restarts=2)
    reported: list[str] = []
    supervisor.on_failure.append(reported.append)

    async def always() -> None:
        raise Boom("again")

    supervisor.spawn("always", always, restart=True)
    reason = await asyncio.wait_for(supervisor.wait_failed(), 10)
    assert reason == "always: Boom: again"
    assert reported == [reason]
    assert not supervisor.healthy
    assert len(tracebacks(caplog)) == 3  # the first run and two restarts
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)


async def test_a_fatal_task_a_watched_task_and_a_guarded_callback_each_fail_the_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise Boom("task")

    def callback() -> None:
        raise Boom("callback")

    fatal = Supervisor()
    fatal.spawn("fatal", fails)
    assert await asyncio.wait_for(fatal.wait_failed(), 10) == "fatal: Boom: task"

    watched = Supervisor()
    watched.watch(asyncio.get_running_loop().create_task(fails()), "watched")
    assert await asyncio.wait_for(watched.wait_failed(), 10) == "watched: Boom: task"

    guarded = Supervisor()
    asyncio.get_running_loop().call_soon(guarded.guard("flush", callback))
    assert await asyncio.wait_for(guarded.wait_failed(), 10) == "flush: Boom: callback"
    assert len(tracebacks(caplog)) == 3


async def test_a_task_that_returns_or_is_cancelled_is_no_failure() -> None:
    supervisor = Supervisor()

    async def quick() -> None:
        return

    await supervisor.spawn("quick", quick)
    sleeper = supervisor.spawn("sleeper", lambda: asyncio.sleep(60))
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper
    assert supervisor.healthy


def readyz(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def started_core(data_dir: Path, supervisor: Supervisor) -> CoreNode:
    """A core node in this process, on free ports, whose tasks ``supervisor`` watches."""
    settings = CoreSettings(
        node=NodeSection(data_dir=data_dir),
        link=LinkSection(host="127.0.0.1", port=0),
        management=ManagementSection(port=0),
    )
    node = CoreNode(settings, supervisor=supervisor)
    await node.start()
    return node


async def test_a_core_whose_tick_fails_is_no_longer_ready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    supervisor = Supervisor()
    node = await started_core(tmp_path, supervisor)
    try:
        assert (await asyncio.to_thread(readyz, node.management_port))[0] == 200

        def tick(now_ms: int) -> None:  # a bug in the broker's timers, injected
            raise Boom(f"tick at {now_ms}")

        monkeypatch.setattr(node.broker, "tick", tick)
        reason = await asyncio.wait_for(supervisor.wait_failed(), 10)
        assert reason.startswith("tick: Boom: tick at ")
        status, body = await asyncio.to_thread(readyz, node.management_port)
        assert (status, body["status"]) == (503, "failed")
        assert body["reason"] == reason
        assert tracebacks(caplog)
    finally:
        await node.stop()


async def test_a_core_whose_journal_fsync_fails_stops_being_ready_and_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fsync nothing the journal holds can be made safe by retrying: the node fails (its entry
    point then exits with ``EXIT_TASK_FAILED``) instead of staying ready with a dead journal."""
    supervisor = Supervisor()
    node = await started_core(tmp_path, supervisor)
    try:

        def fdatasync(fd: int) -> None:  # the disk reports a failed write-back
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(journal_module.os, "fdatasync", fdatasync)
        async with LinkClient("127.0.0.1", node.status.link_port, reconnect=ReconnectPolicy(attempts=0)) as client:
            (confirm,) = await client.publish_batch([new_message("fsync.q", b"never safe", durable=True)])
            reason = await asyncio.wait_for(supervisor.wait_failed(), 10)
            assert reason == "journal: SyncFailedError: journal fsync failed: Input/output error"
            status, body = await asyncio.to_thread(readyz, node.management_port)
            assert (status, body["status"]) == (503, "failed")
            assert not confirm.done()
        assert any(r.levelno == logging.CRITICAL and "journal" in r.getMessage() for r in caplog.records)
    finally:
        await node.stop()


async def test_a_failed_connection_task_is_logged_and_ends_its_connection(caplog: pytest.LogCaptureFixture) -> None:
    ended: list[str] = []

    async def pump() -> None:
        raise Boom("a delivery the pump could not convert")

    async def quiet() -> None:
        return

    failing = end_on_failure(
        asyncio.get_running_loop().create_task(pump(), name="pump"), lambda: ended.append("x"), "127.0.0.1:5555"
    )
    fine = end_on_failure(asyncio.get_running_loop().create_task(quiet()), lambda: ended.append("y"), "peer")
    await asyncio.wait({failing, fine})
    await asyncio.sleep(0)  # done callbacks run in the next turn
    assert ended == ["x"]
    [logged] = tracebacks(caplog)
    assert logged.getMessage() == "connection task failed: the connection is closed"
    assert logged.__dict__["peer"] == "127.0.0.1:5555"


async def test_serve_stops_a_failed_node_cleanly_and_returns_70(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash-only: the node's entry point stops it (journal closed, data directory unlocked) and exits 70."""
    settings = CoreSettings(
        node=NodeSection(data_dir=tmp_path),
        link=LinkSection(host="127.0.0.1", port=0),
        management=ManagementSection(port=0),
    )
    started = CoreNode.start

    async def start_then_break(node: CoreNode) -> None:
        await started(node)

        def tick(now_ms: int) -> None:
            raise Boom(f"tick at {now_ms}")

        monkeypatch.setattr(node.broker, "tick", tick)

    monkeypatch.setattr(CoreNode, "start", start_then_break)
    previous = current()
    loop = asyncio.get_running_loop()
    try:
        assert await asyncio.wait_for(serve(settings, None), 30) == EXIT_TASK_FAILED
    finally:
        install(previous)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    monkeypatch.setattr(CoreNode, "start", started)
    again = CoreNode(settings, supervisor=Supervisor())  # the lock was released, the journal closed
    await again.start()
    await again.stop()


async def test_a_gateway_whose_task_failed_is_no_longer_ready() -> None:
    config = ShellConfig(
        protocol="stomp",
        host="127.0.0.1",
        port=0,
        websocket_port=-1,
        max_connections=10,
        subprotocols=(),
        subprotocol_required=False,
        max_websocket_message=1024,
        binary_frames=False,
        http_enabled=True,
        http_host="127.0.0.1",
        http_port=0,
    )

    def no_session(wire: Wire) -> ClientSession:
        raise AssertionError("no client connects in this test")

    supervisor = Supervisor()
    previous = install(supervisor)
    shell = GatewayShell(config, no_session, list)
    await shell.start()
    try:
        assert (await asyncio.to_thread(readyz, shell.ports["http"]))[0] == 200
        supervisor.spawn("core topology", lambda: asyncio.sleep(0, result=1 / 0))
        reason = await asyncio.wait_for(supervisor.wait_failed(), 10)
        status, body = await asyncio.to_thread(readyz, shell.ports["http"])
        assert (status, body) == (503, {"status": "failed", "reason": reason})
    finally:
        install(previous)
        await shell.stop(lambda _: None)


async def test_a_cluster_connection_whose_sender_fails_fails_the_process(caplog: pytest.LogCaptureFixture) -> None:
    """The task that sends a cluster connection's waiting messages is the process's: a bug in it would else
    die unseen and leave every message after it waiting for good."""

    class _Manager:
        def __init__(self, h: Harness) -> None:
            self.broker = h.broker
            self.settings = h.settings

    class _Link:
        async def wait_for_credit(self) -> None:
            return None

        def send_if_open(self, message: object) -> int:
            raise Boom("send")

    previous = install(Supervisor())
    try:
        bridge = Bridge(_Manager(Harness()), "127.0.0.1", 1)  # type: ignore[arg-type]
        link = _Link()
        bridge.client = link  # type: ignore[assignment]
        bridge._wait((None, 1, new_message("orders", b"m"), None), link)  # type: ignore[arg-type]
        failed = await asyncio.wait_for(current().wait_failed(), 5)
    finally:
        install(previous)
    assert "bridge-send-127.0.0.1" in failed
    assert tracebacks(caplog)
