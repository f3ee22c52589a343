"""deploy/compose.yaml with compose.ha.yaml: kill -9 of a primary core container loses no acknowledged
message (its backup takes over and the gateways follow it)."""

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


def test_kill_9_of_a_primary_core_loses_no_acknowledged_message(stack: Stack) -> None:
    queue = f"e2e.{uuid.uuid4().hex[:8]}.ha"
    attempted: list[int] = []
    acknowledged: list[int] = []
    killed = threading.Event()
    value = 0

    def publish_until(condition: threading.Event | None, count: int) -> None:
        nonlocal value
        listener = Receipts()
        conn = stomp.Connection12([("127.0.0.1", stack.ports["STOMP"])], reconnect_attempts_max=1)
        conn.set_listener("e2e", listener)
        sent: list[int] = []
        try:
            conn.connect(username=USER, passcode=PASSWORD, wait=True)
            for _ in range(count):
                value += 1
                attempted.append(value)
                sent.append(value)
                conn.send(f"/queue/{queue}", str(value), headers={"persistent": "true", "receipt": str(value)})
                with listener.changed:
                    listener.changed.wait_for(lambda v=value: str(v) in listener.receipts, 5)
                if condition is not None and condition.is_set():
                    break
        except (stomp.exception.StompException, OSError):
            time.sleep(0.5)  # the connection went with the node: a new one, after a breath
        finally:
            acknowledged.extend(v for v in sent if str(v) in listener.receipts)
            if conn.is_connected():
                conn.disconnect()

    publish_until(None, 100)
    core_1 = stack.containers("core-1")[0]

    def kill() -> None:
        subprocess.run(["docker", "kill", "-s", "KILL", core_1], capture_output=True, check=True)
        killed.set()

    killer = threading.Timer(0.5, kill)  # while the publisher below is sending
    killer.start()
    publish_until(killed, 10_000)
    killer.join()
    deadline = time.monotonic() + 120
    while len(acknowledged) < 300 and time.monotonic() < deadline:  # after the takeover: the gateways follow
        publish_until(None, 50)
    amqp = BlockingConnection(
        f"amqp://127.0.0.1:{stack.ports['AMQP']}", timeout=WAIT, user=USER, password=PASSWORD, allowed_mechs="PLAIN"
    )
    delivered: list[int] = []
    try:
        receiver = amqp.create_receiver(queue)
        deadline = time.monotonic() + 120
        while not set(acknowledged) <= set(delivered) and time.monotonic() < deadline:
            try:
                message = receiver.receive(timeout=5)
            except Timeout:
                continue
            delivered.append(int(bytes(message.body)))  # STOMP text arrives as binary
            receiver.accept()
    finally:
        amqp.close()
    verdict = check(attempted, acknowledged, [], delivered)
    assert verdict.ok, f"{verdict.report()}\nthe stack's warnings:\n{stack.warnings()}"
    assert len(acknowledged) >= 300
