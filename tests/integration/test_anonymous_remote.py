"""With no users configured, gateways listening on every interface serve only clients on the broker's host.

A lab (``NetLab``, network namespaces, no faults) has two nodes: ``broker`` runs a core (link on loopback) and
the STOMP, MQTT and AMQP gateways listening on 0.0.0.0; ``remote`` is another host on the lab's subnet. Clients
run as small agent processes inside the namespaces (this file run as a script: ``python
test_anonymous_remote.py <host> <stomp port> <mqtt port> <amqp port>``), each printing one line per protocol:
``ok`` when the broker let it in, else what it answered.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.jepsen.nemesis import NetLab, stop

AVAILABLE = NetLab.available(faults=False)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not AVAILABLE, reason=f"no network lab: {AVAILABLE.reason}"),
]

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 30.0
GATEWAYS = ("stomp", "mqtt", "amqp")


# ----------------------------------------------------------------------------------------------- the agent


def _stomp(host: str, port: int) -> str:
    with socket.create_connection((host, port), timeout=20) as conn:
        conn.sendall(b"CONNECT\naccept-version:1.2\nhost:/\n\n\x00")
        data = b""
        while b"\x00" not in data and (chunk := conn.recv(4096)):
            data += chunk
    command = data.split(b"\n", 1)[0].decode()
    return "ok" if command == "CONNECTED" else f"{command} {data[:300]!r}"


def _mqtt(host: str, port: int) -> str:
    client_id = b"anonymous-probe"
    variable = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id  # 3.1.1, clean
    with socket.create_connection((host, port), timeout=20) as conn:
        conn.sendall(bytes([0x10, len(variable)]) + variable)
        data = b""
        while len(data) < 4 and (chunk := conn.recv(4)):
            data += chunk
    if data[:2] != b"\x20\x02":
        return f"no CONNACK: {data!r}"
    return "ok" if data[3] == 0 else f"CONNACK {data[3]}"


def _amqp(host: str, port: int) -> str:
    from proton import ConnectionException  # noqa: PLC0415 (the agent alone needs proton)
    from proton.utils import BlockingConnection  # noqa: PLC0415

    try:
        conn = BlockingConnection(f"amqp://{host}:{port}", timeout=20, sasl_enabled=True, allowed_mechs="ANONYMOUS")
    except ConnectionException as exc:
        return f"refused {exc}"
    conn.close()
    return "ok"


def agent(host: str, ports: list[int]) -> None:
    for probe, port in zip((_stomp, _mqtt, _amqp), ports, strict=True):
        print(json.dumps(probe(host, port)), flush=True)


# ----------------------------------------------------------------------------------------------- the test


def _start(lab: NetLab, module: str, directory: Path, environment: dict[str, str]) -> tuple[Any, dict[str, int]]:
    """``python -m module`` in the broker's namespace; its ports once it wrote them."""
    directory.mkdir(parents=True, exist_ok=True)
    ports_file = directory / "ports.json"
    with (directory / "log").open("wb") as log:
        process = lab.run(
            "broker",
            [sys.executable, "-m", module, "--ports-file", str(ports_file)],
            env={**os.environ, **environment},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not ports_file.exists():
        assert process.poll() is None, (directory / "log").read_text()
        assert time.monotonic() < deadline, f"{module} did not start:\n{(directory / 'log').read_text()}"
        time.sleep(0.05)
    return process, json.loads(ports_file.read_text())


class Broker:
    """A core and the three gateways in the lab's ``broker`` namespace."""

    def __init__(self, lab: NetLab, directory: Path, **core_env: str) -> None:
        self.lab = lab
        self.directory = directory
        core_dir = directory / "core"
        self.core, core_ports = _start(
            lab,
            "tridentmq_core",
            core_dir,
            {
                "TRIDENTMQ_CORE_NODE_DATA_DIR": str(core_dir),
                "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
                "TRIDENTMQ_CORE_LINK_PORT": "0",
                "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
                "TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES": str(8 * 1024 * 1024),
                **core_env,
            },
        )
        self.gateways: list[Any] = []
        self.ports: list[int] = []
        for kind in GATEWAYS:
            prefix = f"TRIDENTMQ_{kind.upper()}"
            process, ports = _start(
                lab,
                f"tridentmq_{kind}",
                directory / kind,
                {
                    f"{prefix}_LISTENER_HOST": "0.0.0.0",
                    f"{prefix}_LISTENER_PORT": "0",
                    f"{prefix}_LISTENER_WEBSOCKET_PORT": "-1",
                    f"{prefix}_HTTP_HOST": "127.0.0.1",
                    f"{prefix}_HTTP_PORT": "0",
                    f"{prefix}_CORE_PORT": str(core_ports["link"]),
                },
            )
            self.gateways.append(process)
            self.ports.append(ports[kind])

    def probe(self, node: str, host: str) -> list[str]:
        """What each protocol's client in ``node`` gets from the gateways at ``host``."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        agent = self.lab.run(
            node,
            [sys.executable, str(Path(__file__).resolve()), host, *map(str, self.ports)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        out, _ = agent.communicate(timeout=90)
        assert agent.returncode == 0, out
        return [json.loads(line) for line in out.splitlines()]

    def core_log(self) -> str:
        return (self.directory / "core" / "log").read_text()

    def stop(self) -> None:
        for process in [*self.gateways, self.core]:
            assert stop(process, timeout=10) == 0
        for name in ("core", *GATEWAYS):
            assert "Traceback" not in (self.directory / name / "log").read_text()


@pytest.fixture
def lab() -> Iterator[NetLab]:
    with NetLab(["broker", "remote"], faults=False) as built:
        yield built


def test_no_users_refuses_remote_clients_of_every_gateway(lab: NetLab, tmp_path: Path) -> None:
    broker = Broker(lab, tmp_path)
    try:
        remote = broker.probe("remote", lab.address("broker"))
        local = broker.probe("broker", "127.0.0.1")
    finally:
        broker.stop()
    stomp, mqtt, amqp = remote
    assert stomp.startswith("ERROR"), stomp
    assert mqtt == "CONNACK 4", mqtt  # 3.1.1: bad user name or password
    assert amqp.startswith("refused"), amqp
    assert "auth" in amqp.lower(), amqp
    assert local == ["ok", "ok", "ok"]
    log = broker.core_log()
    assert "clients from other hosts, directly or through a gateway, are refused" in log
    refusals = [line for line in log.splitlines() if "link refused" in line]
    # The three refusals (one per gateway) come from one client address: said once per window, then counted.
    assert len(refusals) == 1, log
    assert all(lab.address("remote") in line for line in refusals), refusals


def test_allow_anonymous_remote_lets_remote_clients_in(lab: NetLab, tmp_path: Path) -> None:
    broker = Broker(lab, tmp_path, TRIDENTMQ_CORE_SECURITY_ALLOW_ANONYMOUS_REMOTE="true")
    try:
        remote = broker.probe("remote", lab.address("broker"))
    finally:
        broker.stop()
    assert remote == ["ok", "ok", "ok"]
    assert "every client, from any host, is accepted" in broker.core_log()


if __name__ == "__main__":
    agent(sys.argv[1], [int(port) for port in sys.argv[2:]])
