"""deploy/compose.yaml with compose.ha.yaml: kill -9 of a primary core container loses no acknowledged
message (its in-sync backup takes over and the gateways follow it).

The kill is a crash, as the OOM killer's would be, so the restart policy brings the primary back: a backup
that fell out of sync just before (a loaded machine's missed heartbeats) cannot take over, and what the
primary acknowledged alone since is on its disk only, until it returns (docs/ha.md)."""

from __future__ import annotations

import os
import subprocess
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
        assert verdict.ok, f"{verdict.report()}\n{context}\nthe stack's warnings:\n{self.stack.warnings()}"


def test_kill_9_of_a_primary_core_loses_no_acknowledged_message(stack: Stack) -> None:
    publisher = Publisher(stack, f"e2e.{uuid.uuid4().hex[:8]}.ha")
    stack.wait_in_sync("backup-1")
    publisher.publish(100)
    stack.wait_in_sync("backup-1")
    killed = threading.Event()
    backup_at_kill: dict[str, object] = {}

    def kill() -> None:
        backup_at_kill.update(stack.readiness("backup-1"))
        stack.crash("core-1")
        killed.set()

    killer = threading.Timer(0.5, kill)  # while the publisher below is sending
    killer.start()
    publisher.publish(10_000, until=killed)
    killer.join()
    deadline = time.monotonic() + 120
    while len(publisher.acknowledged) < 300 and time.monotonic() < deadline:  # the gateways follow the takeover
        publisher.publish(50)
    publisher.assert_none_lost(f"backup-1 at the kill: {backup_at_kill}")
    assert len(publisher.acknowledged) >= 300


def test_a_primary_that_crashes_while_its_backup_is_out_of_sync_comes_back_with_what_it_acknowledged(
    stack: Stack,
) -> None:
    """Faults mixed: the backup stalls (its primary goes on alone after a quorum's `stay`, which makes the
    backup's copy stale), then the primary crashes. The backup must not take over on its stale copy; the
    restart policy brings the primary back with every message it acknowledged alone."""
    publisher = Publisher(stack, f"e2e.{uuid.uuid4().hex[:8]}.stale")
    stack.wait_in_sync("backup-1")  # the previous test's failover and failback are over
    backup = stack.containers("backup-1")[0]
    subprocess.run(["docker", "pause", backup], capture_output=True, check=True)
    try:
        for _ in range(6):  # six sessions: two of them on core-1, whose acknowledgements wait for the quorum
            publisher.publish(10)
        stack.crash("core-1")
    finally:
        subprocess.run(["docker", "unpause", backup], capture_output=True, check=True)
    assert publisher.acknowledged, "nothing acknowledged while the backup stalled"
    publisher.assert_none_lost(f"backup-1 after the crash: {stack.readiness('backup-1')}")
