"""deploy/compose.yaml with compose.ha.yaml: kill -9 of a primary core loses no acknowledged message. With
its backup in sync, the backup takes over and the gateways follow it; with its backup out of sync (dropped
after a stall), the pair waits for the primary, which Docker's restart policy brings back after a crash."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import stomp
from proton import Timeout
from proton.utils import BlockingConnection
from stomp.utils import Frame
from tests.e2e.stack import PASSWORD, USER, Stack, build_image, docker_available
from tests.jepsen.checker import check

pytestmark = [pytest.mark.e2e, pytest.mark.fault, pytest.mark.timeout(900)]
WAIT = 30.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    build_image()
    stack = Stack(f"tmqe2eha{os.getpid()}", files=("compose.yaml", "compose.ha.yaml"))
    try:
        stack.compose("up", "-d")
        stack.wait_healthy(
            "core-1", "core-2", "core-3", "backup-1", "backup-2", "backup-3", "gateway-stomp", "gateway-amqp"
        )
        yield stack
    finally:
        stack.down(volumes=True)


class Receipts(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.receipts: set[str] = set()
        self.errors: list[str] = []
        self.changed = threading.Condition()

    def on_receipt(self, frame: Frame) -> None:
        with self.changed:
            self.receipts.add(frame.headers["receipt-id"])
            self.changed.notify_all()

    def on_error(self, frame: Frame) -> None:
        self.errors.append(frame.body)


class Publisher:
    """Receipted persistent STOMP SENDs of 1, 2, 3... to one queue through the stack's STOMP gateway, each
    connection a new session (the gateway spreads them round-robin over the core nodes)."""

    def __init__(self, stack: Stack, queue: str) -> None:
        self.stack = stack
        self.queue = queue
        self.attempted: list[int] = []
        self.acknowledged: list[int] = []

    def publish(self, count: int, until: threading.Event | None = None) -> None:
        """Up to ``count`` messages over one connection, one receipt awaited at a time; stops early once
        ``until`` is set or the connection fails."""
        listener = Receipts()
        conn = stomp.Connection12([("127.0.0.1", self.stack.ports["STOMP"])], reconnect_attempts_max=1)
        conn.set_listener("e2e", listener)
        sent: list[int] = []
        try:
            conn.connect(username=USER, passcode=PASSWORD, wait=True)
            for _ in range(count):
                value = len(self.attempted) + 1
                self.attempted.append(value)
                sent.append(value)
                conn.send(f"/queue/{self.queue}", str(value), headers={"persistent": "true", "receipt": str(value)})
                with listener.changed:
                    listener.changed.wait_for(lambda v=value: str(v) in listener.receipts, 5)
                if until is not None and until.is_set():
                    break
        except (stomp.exception.StompException, OSError):
            time.sleep(0.5)  # the connection went with the node: a new one, after a breath
        finally:
            self.acknowledged.extend(v for v in sent if str(v) in listener.receipts)
            if conn.is_connected():
                conn.disconnect()

    def assert_none_lost(self, context: str) -> None:
        """Consumes the queue through the AMQP gateway until every acknowledged message came (or 120 s),
        then the total-queue check."""
        amqp = BlockingConnection(
            f"amqp://127.0.0.1:{self.stack.ports['AMQP']}",
            timeout=WAIT,
            user=USER,
            password=PASSWORD,
            allowed_mechs="PLAIN",
        )
        delivered: list[int] = []
        try:
            receiver = amqp.create_receiver(self.queue)
            deadline = time.monotonic() + 120
            while not set(self.acknowledged) <= set(delivered) and time.monotonic() < deadline:
                try:
                    message = receiver.receive(timeout=5)
                except Timeout:
                    continue
                delivered.append(int(bytes(message.body)))  # STOMP text arrives as binary
                receiver.accept()
        finally:
            amqp.close()
        verdict = check(self.attempted, self.acknowledged, [], delivered)
        assert verdict.ok, (
            f"{verdict.report()}\n{context}\nthe stack's warnings:\n{self.stack.warnings()}\n"
            f"core-1's last log lines:\n{self.stack.tail('core-1')}\nbackup-1's:\n{self.stack.tail('backup-1')}"
        )


def test_kill_9_of_a_primary_core_its_in_sync_backup_takes_over_and_nothing_acknowledged_is_lost(
    stack: Stack,
) -> None:
    publisher = Publisher(stack, f"e2e.{uuid.uuid4().hex[:8]}.ha")
    stack.wait_backup_in_sync("core-1")
    publisher.publish(100)
    killed = threading.Event()
    kill_failed: list[BaseException] = []
    checked_at: list[float] = []

    def kill() -> None:
        try:
            checked_at.append(time.time())
            stack.wait_backup_in_sync("core-1", timeout=60)
            stack.kill("core-1")  # not restarted by Docker: the backup has to take over
        except BaseException as error:  # pytest.fail too: reported below, a kill that did not happen fails
            kill_failed.append(error)
        finally:
            killed.set()

    killer = threading.Timer(0.5, kill)  # while the publisher below is sending
    killer.start()
    try:
        publisher.publish(10_000, until=killed)
        killer.join()
        assert not kill_failed, f"core-1 not killed: {kill_failed!r}"
        if stack.logged_since("core-1", checked_at[0], "in-sync backup lost"):
            # Dropped between the check and the kill (a loaded machine's missed heartbeats): what core-1
            # confirmed alone since is not on backup-1, so the pair waits for core-1 (docs/ha.md), as an
            # operator would bring it back. The guarantee below still holds; the takeover is not asked for.
            stack.start("core-1")
            taken_over = "no: backup-1 was dropped just before the kill, core-1 started again"
        else:
            stack.wait_ready("backup-1", timeout=120)  # fails when the in-sync backup does not take over
            taken_over = "yes"
        deadline = time.monotonic() + 120
        while len(publisher.acknowledged) < 300 and time.monotonic() < deadline:  # the gateways follow
            publisher.publish(50)
        publisher.assert_none_lost(f"backup-1 took over: {taken_over}")
        assert len(publisher.acknowledged) >= 300
    finally:
        stack.start("core-1")  # the next test starts from the pair handed back to it


def test_a_primary_that_crashes_while_its_backup_is_out_of_sync_comes_back_with_what_it_acknowledged(
    stack: Stack,
) -> None:
    """Faults mixed: the backup stalls (SIGSTOP), so its primary goes on alone after a quorum's `stay`, which
    makes the backup's copy stale; then the primary crashes. The backup must not take over on its stale copy;
    the restart policy brings the primary back with every message it acknowledged alone."""
    queue = f"e2e.{uuid.uuid4().hex[:8]}.stale"
    publisher = Publisher(stack, queue)
    stack.wait_backup_in_sync("core-1")  # the previous test's failover and failback are over
    stack.stall("backup-1")
    try:
        for _ in range(6):  # six sessions, spread round-robin over the three primaries
            publisher.publish(10)
        ha = stack.management("core-1", "/api/status", admin=True).get("ha") or {}
        held = stack.management("core-1", f"/api/queues/{queue}", admin=True)
        stack.crash("core-1")
    finally:
        stack.resume("backup-1")
    # The case this test is for: core-1 confirmed messages alone, without its backup.
    assert ha.get("backup_in_sync") is False, ha
    assert held.get("added", 0) > 0, held
    publisher.assert_none_lost(f"core-1 before the crash: {ha}, its copy of the queue: {held}")
