"""The HTTP ports (a gateway's health and metrics, its WebSocket listener, the core's management API) against
clients that trickle their request heads: each is closed once it has not sent a whole head in time, no more
than the cap are open at once (the rest get 503, logged once), and a normal request works after. Real
processes, raw sockets."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, GatewayProcess, start_core, start_gateway, stop_cleanly
from tests.doors import http_round_trip, stomp_round_trip

pytestmark = pytest.mark.integration

WAIT = 10.0
CAP = 20
TRICKLERS = 40
PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


@pytest.fixture
def core(tmp_path: Path) -> Iterator[CoreProcess]:
    node = start_core(
        tmp_path,
        TRIDENTMQ_CORE_MANAGEMENT_MAX_CONNECTIONS=str(CAP),
        TRIDENTMQ_CORE_MANAGEMENT_REQUEST_TIMEOUT_MS="1000",
    )
    yield node
    assert node.stop() == 0, node.log()


@pytest.fixture
def gateway(tmp_path: Path, core: CoreProcess) -> Iterator[GatewayProcess]:
    gateway = start_gateway(
        tmp_path,
        core,
        "stomp",
        TRIDENTMQ_STOMP_HTTP_MAX_CONNECTIONS=str(CAP),
        TRIDENTMQ_STOMP_HTTP_REQUEST_TIMEOUT_MS="1000",
        TRIDENTMQ_STOMP_LISTENER_MAX_CONNECTIONS=str(CAP),
    )
    yield gateway
    stop_cleanly(gateway)


def until_closed(sock: socket.socket) -> bytes:
    """What the server wrote before it closed the connection (a timeout here means it never did)."""
    sock.settimeout(WAIT)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def trickle(port: int) -> list[bytes]:
    """Open ``TRICKLERS`` connections that each send part of a request head and nothing more; return what
    each got before the server closed it."""
    sockets = []
    try:
        for _ in range(TRICKLERS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            sockets.append(sock)
            sock.sendall(PARTIAL_HEAD)
        return [until_closed(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def check(answers: list[bytes]) -> None:
    busy = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    cut = [a for a in answers if not a]  # closed without an answer: the request head never came in time
    assert len(busy) + len(cut) == TRICKLERS, answers
    assert len(cut) <= CAP, f"{len(cut)} connections were open at once, the cap is {CAP}"
    assert len(busy) >= TRICKLERS - CAP


@pytest.mark.parametrize("listener", ["http", "websocket"])
def test_trickling_connections_to_a_gateway_are_capped_and_cut_off(gateway: GatewayProcess, listener: str) -> None:
    """20,000 such connections on a STOMP gateway's health port took all its file descriptors: STOMP clients
    were refused, and nothing was logged."""
    check(trickle(gateway.ports[listener]))
    assert gateway.log().count("http connection refused: too many connections") == 1, gateway.log()
    http_round_trip(gateway.ports["http"])
    stomp_round_trip(gateway.ports["websocket"], websocket=True)
    stomp_round_trip(gateway.port)


def test_trickling_connections_to_the_management_port_are_capped_and_cut_off(core: CoreProcess) -> None:
    check(trickle(core.management_port))
    assert core.log().count("http connection refused: too many connections") == 1, core.log()
    http_round_trip(core.management_port)
    http_round_trip(core.management_port, "/api/queues")


def test_a_request_whose_body_stalls_is_answered_408_and_closed(core: CoreProcess) -> None:
    """Its head came whole, its body never did: the connection stayed open unanswered, and 256 of them (the
    cap) took the management port, health probes included. A client that leaves in the middle of its body
    left aiohttp's ERROR and traceback in the log, one per connection."""
    head = (
        b"POST /api/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"queue": '
    )
    stalled = [socket.create_connection(("127.0.0.1", core.management_port), timeout=WAIT) for _ in range(CAP)]
    try:
        for sock in stalled:
            sock.sendall(head)
        answers = [until_closed(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers), answers[:3]
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", core.management_port), timeout=WAIT) as sock:
            sock.sendall(head)
    http_round_trip(core.management_port, "/healthz")
    log = core.log()
    assert "Traceback" not in log, log
    assert log.count("http request body not received in time") == CAP, log
