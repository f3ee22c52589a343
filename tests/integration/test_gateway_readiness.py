"""A gateway's readiness means it can serve: no client port before its core answers, /readyz green only
while the core answers, and green again by itself when the core comes back (what load balancers and
Kubernetes probes rely on)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

import pytest
from tests.conftest import _started, fixed_port, start_core, start_gateway
from tests.integration.test_cli import free_port

WAIT = 30.0


def readyz(http_port: int) -> tuple[int, dict[str, object]]:
    """(status, body) of /readyz; (0, {}) while nothing listens."""
    try:
        with urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (URLError, ConnectionError):
        return 0, {}


def wait_for(http_port: int, status: int) -> dict[str, object]:
    deadline = time.monotonic() + WAIT
    while (answer := readyz(http_port))[0] != status:
        assert time.monotonic() < deadline, f"/readyz still {answer}, waiting for {status}"
        time.sleep(0.1)
    return answer[1]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("kind", ["stomp", "mqtt", "amqp"])
def test_gateway_serves_only_while_its_core_answers(tmp_path: Path, kind: str) -> None:
    # The client port too is bound only once the core answers: from the ephemeral range, the core's own
    # management port (port 0) once took it first (CI 61: "address already in use").
    link, http, client = fixed_port(), free_port(), fixed_port()
    while client == link:  # both are bound later: picked free, each could be picked twice
        client = fixed_port()
    prefix = f"TRIDENTMQ_{kind.upper()}"
    env = {
        **os.environ,
        f"{prefix}_CORE_PORT": str(link),
        f"{prefix}_HTTP_PORT": str(http),
        f"{prefix}_LISTENER_HOST": "127.0.0.1",
        f"{prefix}_LISTENER_PORT": str(client),
        f"{prefix}_LISTENER_WEBSOCKET_PORT": "-1",
    }
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", f"tridentmq_{kind}"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    _started.append(gateway)
    assert wait_for(http, 503) == {"status": "starting"}
    assert not listening(client), "the client port opened before the core answered"

    core = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(link))
    assert wait_for(http, 200)[kind] == client  # no client needed: the gateway found its core by itself
    assert listening(client)

    assert core.stop() == 0
    assert wait_for(http, 503)["status"] == "unavailable"
    core = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(link))
    wait_for(http, 200)

    gateway.terminate()
    assert gateway.wait(timeout=WAIT) == 0, log_path.read_text()
    assert core.stop() == 0
    assert "Traceback" not in log_path.read_text(), log_path.read_text()


def test_gateway_waiting_for_its_core_stops_on_sigterm(tmp_path: Path) -> None:
    http = free_port()
    env = {
        **os.environ,
        "TRIDENTMQ_STOMP_CORE_PORT": str(fixed_port()),
        "TRIDENTMQ_STOMP_HTTP_PORT": str(http),
        "TRIDENTMQ_STOMP_LISTENER_PORT": "0",
        "TRIDENTMQ_STOMP_LISTENER_WEBSOCKET_PORT": "-1",
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "tridentmq_stomp"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    _started.append(gateway)
    wait_for(http, 503)
    gateway.terminate()
    output, _ = gateway.communicate(timeout=WAIT)
    assert gateway.returncode == 0, output.decode()
    assert b"waiting for the core" in output
    assert b"Traceback" not in output


def test_a_draining_gateway_refuses_new_clients_and_keeps_its_own_until_the_drain_ends(tmp_path: Path) -> None:
    """With listener.drain_ms, a stopping gateway first fails /readyz and refuses new connections (a load
    balancer marks it down meanwhile), then ends its clients' connections: they reconnect to the other
    replicas. Without it they were ended at once, and a balancer still counting this replica up (with the
    fewest connections) sent their reconnects back to it as it went."""
    core = start_core(tmp_path)
    gateway = start_gateway(tmp_path, core, "stomp", TRIDENTMQ_STOMP_LISTENER_DRAIN_MS="5000")
    client = socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT)
    client.sendall(b"CONNECT\naccept-version:1.2\nhost:/\n\n\0")
    assert client.recv(4096).startswith(b"CONNECTED")
    gateway.process.terminate()
    wait_for(gateway.ports["http"], 503)
    assert not listening(gateway.port)
    client.sendall(b"SEND\ndestination:/queue/draining\nreceipt:r1\n\nstill here\0")
    assert client.recv(4096).startswith(b"RECEIPT")  # still served meanwhile
    while client.recv(4096):  # ended once the drain is over (an ERROR frame, then the close)
        pass
    client.close()
    assert gateway.process.wait(timeout=WAIT) == 0, gateway.log()
    assert "draining" in gateway.log()
    assert "Traceback" not in gateway.log()
    assert core.stop() == 0
