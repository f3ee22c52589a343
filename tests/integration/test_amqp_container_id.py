"""An AMQP container id is one connection's at a time when the client desires ``sole-connection-for-container``
(Qpid JMS with a client id), as Artemis and ActiveMQ answer it: real core and gateway processes, proton clients."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.request import urlopen

import pytest
from proton import Event, Message, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton.utils import BlockingConnection
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    module_amqp_gateway,
    module_core,
    shared,
    start_gateway,
    stop_cleanly,
)

pytestmark = pytest.mark.integration

WAIT = 10.0
SOLE = symbol("sole-connection-for-container")

core = module_core
amqp_gateway = module_amqp_gateway


@pytest.fixture(scope="module")
def other_gateway(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess) -> Iterator[GatewayProcess]:
    second = shared(start_gateway(tmp_path_factory.mktemp("other"), core, "amqp", name="other"))
    yield second
    stop_cleanly(second)


def url(gateway: GatewayProcess) -> str:
    return f"amqp://127.0.0.1:{gateway.port}"


def unique() -> str:
    return f"app-{uuid.uuid4().hex[:8]}"


def holder(gateway: GatewayProcess, container: str, *, sole: bool = True) -> BlockingConnection:
    desired = {"desired_capabilities": [SOLE]} if sole else {}
    conn = BlockingConnection(url(gateway), timeout=WAIT, container_id=container, **desired)
    offered = conn.conn.remote_offered_capabilities or []
    assert (SOLE in offered) == sole  # offered back only to a client that desires it
    return conn


class Opening(MessagingHandler):
    """One connection's OPEN and CLOSE as the gateway sent them (BlockingConnection raises on a CLOSE)."""

    def __init__(self, gateway: GatewayProcess, container: str, attach: str | None) -> None:
        super().__init__()
        self.url, self.container, self.attach = url(gateway), container, attach
        self.opened = self.closed = False
        self.properties: dict[Any, Any] | None = None
        self.offered: list[Any] = []
        self.condition: Any = None

    def on_start(self, event: Event) -> None:
        conn = event.container.connect(
            self.url, container_id=self.container, desired_capabilities=[SOLE], reconnect=False
        )
        if self.attach is not None:
            event.container.create_receiver(conn, self.attach)

    def on_connection_opened(self, event: Event) -> None:
        self.opened = True
        self.properties = event.connection.remote_properties
        self.offered = list(event.connection.remote_offered_capabilities or [])

    def on_connection_error(self, event: Event) -> None:  # a CLOSE with an error (not on_connection_closing)
        self.closed = True
        self.condition = event.connection.remote_condition
        event.connection.close()

    def on_transport_error(self, event: Event) -> None:
        pass


def open_once(gateway: GatewayProcess, container: str, attach: str | None = None) -> Opening:
    opening = Opening(gateway, container, attach)
    thread = threading.Thread(target=Container(opening).run, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), "the gateway did not close the connection"
    return opening


def assert_refused(gateway: GatewayProcess, container: str) -> None:
    logged = gateway.log().count("amqp container id in use")
    opening = open_once(gateway, container)
    assert opening.opened
    assert opening.properties == {symbol("amqp:connection-establishment-failed"): True}
    assert SOLE in opening.offered
    assert opening.closed
    assert opening.condition.name == "amqp:invalid-field"
    assert opening.condition.info == {symbol("invalid-field"): symbol("container-id")}
    assert container in opening.condition.description
    assert gateway.log().count("amqp container id in use") == logged + 1  # one line per refusal


def still_works(conn: BlockingConnection) -> None:
    queue = unique()
    conn.create_sender(queue).send(Message(body="still here"))
    receiver = conn.create_receiver(queue)
    assert receiver.receive(timeout=WAIT).body == "still here"
    receiver.accept()


def lock_queues(core: CoreProcess) -> list[str]:
    with urlopen(f"{core.management_url}/api/queues", timeout=WAIT) as reply:
        return [q["name"] for q in json.load(reply) if q["name"].startswith("$amqp.lock.")]


def test_a_second_open_with_a_held_container_id_is_refused_through_either_gateway(
    amqp_gateway: GatewayProcess, other_gateway: GatewayProcess
) -> None:
    container = unique()
    first = holder(amqp_gateway, container)
    try:
        assert_refused(amqp_gateway, container)
        assert_refused(other_gateway, container)
        still_works(first)  # the holder is unaffected
    finally:
        first.close()


def test_the_container_id_is_free_at_once_after_a_close(amqp_gateway: GatewayProcess) -> None:
    container = unique()
    holder(amqp_gateway, container).close()
    again = holder(amqp_gateway, container)  # freed before the CLOSE was answered
    again.close()


_DROPPED_HOLDER = """
import os, sys
from proton import symbol
from proton.utils import BlockingConnection
BlockingConnection(sys.argv[1], timeout=10, container_id=sys.argv[2], desired_capabilities=[symbol(sys.argv[3])])
print("open", flush=True)
sys.stdin.readline()
os._exit(0)  # the socket closes without a CLOSE
"""


def test_the_container_id_is_free_once_the_socket_just_closes(amqp_gateway: GatewayProcess) -> None:
    container = unique()
    with subprocess.Popen(
        [sys.executable, "-c", _DROPPED_HOLDER, url(amqp_gateway), container, str(SOLE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stdin is not None
            assert process.stdout.readline() == "open\n"
            assert_refused(amqp_gateway, container)
            process.stdin.write("\n")
            process.stdin.flush()
            assert process.wait(WAIT) == 0
        finally:
            if process.poll() is None:
                process.kill()
    holder(amqp_gateway, container).close()  # at once: the gateway waits a moment for the holder's end


def test_different_container_ids_connect_side_by_side(amqp_gateway: GatewayProcess) -> None:
    one, two = holder(amqp_gateway, unique()), holder(amqp_gateway, unique())
    try:
        still_works(one)
        still_works(two)
    finally:
        one.close()
        two.close()


def test_without_the_capability_a_container_id_is_not_held(amqp_gateway: GatewayProcess, core: CoreProcess) -> None:
    container = unique()
    one = holder(amqp_gateway, container, sole=False)
    two = holder(amqp_gateway, container, sole=False)  # as before: nothing asked of the core
    try:
        assert not [q for q in lock_queues(core) if f".{container}." in q]
        sole = holder(amqp_gateway, container)  # they hold nothing, so one that asks gets it
        try:
            assert [q for q in lock_queues(core) if f".{container}." in q]
            assert_refused(amqp_gateway, container)
            still_works(two)
        finally:
            sole.close()
    finally:
        one.close()
        two.close()


def test_a_refused_open_reaches_nothing_on_the_core(amqp_gateway: GatewayProcess, core: CoreProcess) -> None:
    """What the refused client sent after its OPEN (proton pipelines its BEGIN and ATTACH) is dropped."""
    container, queue = unique(), unique()
    first = holder(amqp_gateway, container)
    try:
        opening = open_once(amqp_gateway, container, attach=queue)
        assert opening.condition.name == "amqp:invalid-field"
        with urlopen(f"{core.management_url}/api/queues", timeout=WAIT) as reply:
            assert queue not in [q["name"] for q in json.load(reply)]  # a receiver would have auto-created it
    finally:
        first.close()
