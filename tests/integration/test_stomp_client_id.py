"""A STOMP client id is one connection's at a time (as ActiveMQ has it): real core and gateway processes, clients
as raw sockets and stomp.py."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    module_core,
    module_stomp_gateway,
    shared,
    start_gateway,
    stop_cleanly,
)
from tests.integration.test_stomp_gateway import connect

pytestmark = pytest.mark.integration

WAIT = 10.0

core = module_core
gateway = module_stomp_gateway


@pytest.fixture(scope="module")
def other_gateway(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess) -> Iterator[GatewayProcess]:
    second = shared(start_gateway(tmp_path_factory.mktemp("other"), core, name="other"))
    yield second
    stop_cleanly(second)


class Raw:
    """A STOMP 1.2 client as a plain socket: every frame it reads is (command, headers, body)."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT)
        self._buffer = b""

    def send(self, command: str, body: bytes = b"", **headers: str) -> None:
        lines = [command, *(f"{k.replace('_', '-')}:{v}" for k, v in headers.items())]
        self.sock.sendall("\n".join(lines).encode() + b"\n\n" + body + b"\0")

    def frame(self) -> tuple[str, dict[str, str], bytes]:
        while b"\0" not in self._buffer:
            data = self.sock.recv(65536)
            assert data, f"the connection closed; got {self._buffer!r}"
            self._buffer += data
        raw, _, self._buffer = self._buffer.partition(b"\0")
        head, _, body = raw.lstrip(b"\r\n").partition(b"\n\n")
        command, *lines = head.decode().split("\n")
        return command, dict(line.split(":", 1) for line in lines), body

    def connect(self, client_id: str | None = None) -> tuple[str, dict[str, str], bytes]:
        headers = {"accept_version": "1.2", "host": "broker", "login": "app", "passcode": "secret"}
        if client_id is not None:
            headers["client_id"] = client_id
        self.send("CONNECT", **headers)
        return self.frame()

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def unique() -> str:
    return f"app-{uuid.uuid4().hex[:8]}"


def connected(gateway: GatewayProcess, client_id: str) -> Raw:
    client = Raw(gateway)
    command, headers, body = client.connect(client_id)
    assert command == "CONNECTED", (command, headers, body)
    return client


def refused(gateway: GatewayProcess, client_id: str) -> None:
    client = Raw(gateway)
    command, headers, body = client.connect(client_id)
    assert (command, headers.get("message")) == ("ERROR", "client id in use"), (command, headers, body)
    assert body == f"Client: {client_id} already connected".encode()
    assert client.closed_by_peer()
    client.close()


def still_works(client: Raw, destination: str) -> None:
    """The holder's connection is unaffected: it subscribes, sends and receives."""
    client.send("SUBSCRIBE", id="s", destination=destination, ack="auto", receipt="sub")
    assert client.frame()[:2] == ("RECEIPT", {"receipt-id": "sub"})
    client.send("SEND", b"still here", destination=destination)
    command, headers, body = client.frame()
    assert (command, body) == ("MESSAGE", b"still here"), (command, headers, body)


def test_a_second_connect_with_a_held_client_id_is_refused_through_either_gateway(
    gateway: GatewayProcess, other_gateway: GatewayProcess
) -> None:
    client_id = unique()
    holder = connected(gateway, client_id)
    refused(gateway, client_id)
    refused(other_gateway, client_id)
    still_works(holder, f"/queue/{client_id}")
    assert "stomp client id in use" in gateway.log()
    holder.send("DISCONNECT", receipt="bye")
    assert holder.frame()[0] == "RECEIPT"
    holder.close()


def test_the_client_id_is_free_at_once_after_a_disconnect(
    gateway: GatewayProcess, other_gateway: GatewayProcess
) -> None:
    client_id = unique()
    for through in (gateway, other_gateway, gateway):
        holder = connected(through, client_id)
        holder.send("DISCONNECT", receipt="bye")
        assert holder.frame()[:2] == ("RECEIPT", {"receipt-id": "bye"})
        holder.close()


def test_the_client_id_is_free_once_the_socket_just_closes(
    gateway: GatewayProcess, other_gateway: GatewayProcess
) -> None:
    client_id = unique()
    for through in (gateway, other_gateway, gateway):
        connected(through, client_id).close()  # no DISCONNECT: the next CONNECT comes at once
    holder = connected(gateway, client_id)
    refused(gateway, client_id)
    holder.close()


def test_different_client_ids_and_none_connect_side_by_side(gateway: GatewayProcess) -> None:
    first, second = unique(), unique()
    clients = [connected(gateway, first), connected(gateway, second)]
    for _ in range(2):  # no client id: nothing is held
        client = Raw(gateway)
        assert client.connect()[0] == "CONNECTED"
        clients.append(client)
    still_works(clients[0], f"/queue/{first}")
    still_works(clients[1], f"/queue/{second}")
    for client in clients:
        client.close()


def test_the_client_id_is_free_once_its_gateway_is_killed(
    tmp_path: Path, core: CoreProcess, gateway: GatewayProcess
) -> None:
    doomed = start_gateway(tmp_path, core, name="doomed")
    client_id = unique()
    holder = connected(doomed, client_id)
    refused(gateway, client_id)
    doomed.process.kill()  # no goodbye: the core only sees the gateway's link drop
    doomed.process.wait()
    holder.close()
    deadline = time.monotonic() + WAIT
    while True:
        client = Raw(gateway)
        command, headers, _ = client.connect(client_id)
        client.close()
        if command == "CONNECTED":
            break
        assert headers.get("message") == "client id in use"
        assert time.monotonic() < deadline, "the client id stayed held after its gateway died"


def test_a_durable_subscription_collects_while_away_and_its_client_id_comes_back(gateway: GatewayProcess) -> None:
    client_id, topic = unique(), f"/topic/events.{uuid.uuid4().hex[:8]}"
    durable = {"durable-subscription-name": "audit"}
    conn, listener = connect(gateway, connect_headers={"client-id": client_id})
    conn.subscribe(topic, id="d", ack="client-individual", headers={**durable, "receipt": "subscribed"})
    listener.wait(lambda: "subscribed" in listener.receipts)
    conn.disconnect()
    producer, producer_listener = connect(gateway)
    for n in range(3):
        producer.send(topic, f"event {n}", headers={"persistent": "true"}, receipt=f"e{n}")
    producer_listener.wait(lambda: len(producer_listener.receipts) == 3)
    again, again_listener = connect(gateway, connect_headers={"client-id": client_id})
    refused(gateway, client_id)  # the subscription is this connection's alone
    again.subscribe(topic, id="d", ack="client-individual", headers=durable)
    assert [m.body for m in again_listener.wait_messages(3)] == [f"event {n}" for n in range(3)]
    for message in again_listener.messages:
        again.ack(message.headers["ack"])
    again.unsubscribe("d", headers={**durable, "receipt": "gone"})
    again_listener.wait(lambda: "gone" in again_listener.receipts)
    again.disconnect()
    producer.disconnect()
