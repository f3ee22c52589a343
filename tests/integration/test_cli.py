"""The tridentmq command line against real processes: `up`, produce/consume, status, queue stat."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proton import ConnectionException, Message
from proton.utils import BlockingConnection
from tests.conftest import CoreProcess

from tridentmq_shared.supervision import EXIT_CANNOT_START

pytestmark = pytest.mark.integration


def tridentmq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def link_args(core: CoreProcess) -> list[str]:
    return ["--port", str(core.link_port)]


def test_produce_consume_round_trip_anycast(core: CoreProcess) -> None:
    produced = tridentmq("produce", "cli.orders", "--count", "25", "--durable", *link_args(core))
    assert produced.returncode == 0, produced.stderr
    assert "25 message(s) confirmed" in produced.stdout
    stat = tridentmq("queue", "stat", "--management", core.management_url)
    assert stat.returncode == 0, stat.stderr
    row = next(line for line in stat.stdout.splitlines() if line.startswith("cli.orders"))
    assert row.split()[3] == "25"  # depth
    consumed = tridentmq("consume", "cli.orders", "--count", "25", *link_args(core))
    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout.splitlines() == [f"message {n}" for n in range(1, 26)]


def test_consume_fails_when_messages_are_missing(core: CoreProcess) -> None:
    tridentmq("produce", "cli.short", "--count", "2", *link_args(core))
    consumed = tridentmq("consume", "cli.short", "--count", "3", "--timeout", "0.5", *link_args(core))
    assert consumed.returncode == 1
    assert "received 2 of 3" in consumed.stderr


def test_multicast_reaches_a_subscriber(core: CoreProcess) -> None:
    consumer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tridentmq_shared.cli",
            "consume",
            "cli.news",
            "--multicast",
            "--count",
            "1",
            "--timeout",
            "20",
            *link_args(core),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            queues = json.loads(tridentmq("queue", "stat", "--json", "--management", core.management_url).stdout)
            if any(q["address"] == "cli.news" and q["consumers"] for q in queues):
                break
            time.sleep(0.1)
        produced = tridentmq("produce", "cli.news", "--multicast", "--body", "breaking", *link_args(core))
        assert produced.returncode == 0, produced.stderr
        out, err = consumer.communicate(timeout=30)
    finally:
        consumer.kill()
    assert consumer.returncode == 0, err
    assert out.strip() == "breaking"


def test_status_json_and_errors(core: CoreProcess) -> None:
    status = tridentmq("status", "--json", "--management", core.management_url)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["link_port"] == core.link_port
    unreachable = tridentmq("status", "--management", "http://127.0.0.1:9")
    assert unreachable.returncode != 0
    assert "cannot reach" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
    refused = tridentmq("produce", "x", "--port", "9")
    assert refused.returncode != 0
    assert "cannot connect" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("produce", ""),  # the core closed the link as malformed, and the CLI reopened it for ever
        ("consume", ""),
        ("produce", "x", "--count", "-1"),  # "-1 message(s) confirmed", exit 0
        ("perf", "--count", "0"),
        ("perf", "--size", "-1"),
        ("perf", "--rate", "-5"),
        ("perf", "--window", "0"),  # waited 30 s, left a queue behind
    ],
)
def test_arguments_no_run_could_use_are_usage_errors(args: tuple[str, ...]) -> None:
    done = tridentmq(*args, "--port", "9", timeout=30)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "error: argument" in done.stderr
    assert "Traceback" not in done.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stomp_round_trip(port: int) -> bytes:
    """SEND and receive one message over raw STOMP (retrying while the gateway starts)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with sock:
        sock.sendall(
            b"CONNECT\naccept-version:1.2\n\n\x00SUBSCRIBE\nid:0\ndestination:/queue/up.stomp\n\n\x00"
            b"SEND\ndestination:/queue/up.stomp\n\nvia stomp\x00"
        )
        data = b""
        while b"MESSAGE" not in data or not data.endswith(b"\x00"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        sock.sendall(b"DISCONNECT\n\n\x00")
    return data.rsplit(b"\n\n", 1)[1].rstrip(b"\x00")


def amqp_round_trip(port: int) -> str:
    """Send and receive one message with proton's client (retrying while the gateway starts)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=10)
            break
        except ConnectionException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        conn.create_sender("up.amqp").send(Message(body="via amqp"))
        receiver = conn.create_receiver("up.amqp")
        body = str(receiver.receive(timeout=10).body)
        receiver.accept()
        return body
    finally:
        conn.close()


def test_up_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    link, management, stomp_port, amqp_port = free_port(), free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "TRIDENTMQ_CORE_LINK_PORT": str(link),
        "TRIDENTMQ_CORE_MANAGEMENT_PORT": str(management),
        "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
        "TRIDENTMQ_STOMP_LISTENER_PORT": str(stomp_port),
        "TRIDENTMQ_STOMP_LISTENER_WEBSOCKET_PORT": "0",
        "TRIDENTMQ_STOMP_HTTP_PORT": "0",
        "TRIDENTMQ_AMQP_LISTENER_PORT": str(amqp_port),
        "TRIDENTMQ_AMQP_LISTENER_WEBSOCKET_PORT": "0",
        "TRIDENTMQ_AMQP_HTTP_PORT": "0",
        "TRIDENTMQ_MQTT_LISTENER_PORT": "0",
        "TRIDENTMQ_MQTT_LISTENER_WEBSOCKET_PORT": "0",
        "TRIDENTMQ_MQTT_HTTP_PORT": "0",
    }
    # The core's link is moved off 61616 and the gateways are not told: ``up`` points them at it itself.
    up = subprocess.Popen(
        [sys.executable, "-m", "tridentmq_shared.cli", "up", "--data-dir", str(tmp_path / "data")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = tridentmq("status", "--json", "--management", f"http://127.0.0.1:{management}")
            if status.returncode == 0:
                break
            time.sleep(0.2)
        assert status.returncode == 0, status.stderr
        produced = tridentmq("produce", "up.q", "--count", "3", "--port", str(link))
        assert produced.returncode == 0, produced.stderr
        consumed = tridentmq("consume", "up.q", "--count", "3", "--port", str(link))
        assert consumed.returncode == 0, consumed.stderr
        assert stomp_round_trip(stomp_port) == b"via stomp"
        assert amqp_round_trip(amqp_port) == "via amqp"
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=30)
    finally:
        up.kill()
    assert up.returncode == 0, output
    assert "core node ready" in output
    assert "stomp gateway ready" in output
    assert "amqp gateway ready" in output
    assert "core node stopped" in output
    assert "fail over" not in output  # the gateways stopped first: none lost its core link under its sessions
    assert "Traceback" not in output
    assert (tmp_path / "data" / "core" / "node.id").exists()


def test_up_stops_when_a_child_cannot_start_instead_of_restarting_it_for_ever(tmp_path: Path) -> None:
    """A second ``up`` beside a running one (a port in use) restarted its children with backoff for ever,
    printing the bind error again each time. A first run that says it cannot start stops ``up``, which fails."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {
            **os.environ,
            "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
            "TRIDENTMQ_CORE_LINK_PORT": str(taken.getsockname()[1]),
            "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
            **{
                f"TRIDENTMQ_{gateway}_{port}": "0"  # the gateways' own ports out of other tests' way
                for gateway in ("STOMP", "MQTT", "AMQP")
                for port in ("LISTENER_PORT", "LISTENER_WEBSOCKET_PORT", "HTTP_PORT")
            },
        }
        up = subprocess.run(
            [sys.executable, "-m", "tridentmq_shared.cli", "up", "--data-dir", str(tmp_path / "data")],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    output = up.stdout + up.stderr
    assert up.returncode == 1, output
    assert "address already in use" in output
    assert "tridentmq up: core cannot start (see above); stopping" in output
    assert "core exited with" not in output  # never restarted
    assert "Traceback" not in output


def test_the_children_of_an_up_killed_with_sigkill_stop_too(tmp_path: Path) -> None:
    """The children run in sessions of their own: a SIGKILL of ``up`` left core and gateways running, holding
    the ports and the data directory, and the next ``up`` could not start. They now get SIGTERM when it dies."""
    management = free_port()
    env = {
        **os.environ,
        "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
        "TRIDENTMQ_CORE_LINK_PORT": str(free_port()),
        "TRIDENTMQ_CORE_MANAGEMENT_PORT": str(management),
        **{
            f"TRIDENTMQ_{gateway}_{port}": "0"
            for gateway in ("STOMP", "MQTT", "AMQP")
            for port in ("LISTENER_PORT", "LISTENER_WEBSOCKET_PORT", "HTTP_PORT")
        },
    }
    up = subprocess.Popen(
        [sys.executable, "-m", "tridentmq_shared.cli", "up", "--data-dir", str(tmp_path / "data")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if tridentmq("status", "--management", f"http://127.0.0.1:{management}").returncode == 0:
                children = [int(p) for p in Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split()]
                if len(children) == 4:
                    break
            time.sleep(0.2)
        assert len(children) == 4, children
        up.kill()
        up.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in children):
            time.sleep(0.2)
        left = [pid for pid in children if Path(f"/proc/{pid}").exists()]
        assert not left, f"still running after up was killed: {left}"
    finally:
        up.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_core_reports_bad_settings_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[link]\nport = "abc"\n')
    result = tridentmq("core", "--config", str(bad))
    assert result.returncode == EXIT_CANNOT_START
    assert result.stderr.strip() == "tridentmq-core: link.port: expected an integer, got 'abc'"
    missing = tridentmq("core", "--config", str(tmp_path / "missing.toml"))
    assert missing.returncode == EXIT_CANNOT_START
    assert "cannot read" in missing.stderr
    assert "Traceback" not in missing.stderr + result.stderr


def test_core_tune_measures_the_disk_and_suggests_settings(tmp_path: Path) -> None:
    env = {**os.environ, "TRIDENTMQ_CORE_NODE_DATA_DIR": str(tmp_path / "core")}
    result = subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", "core", "--tune"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rate = next(line for line in result.stdout.splitlines() if line.startswith("fdatasync of 4 KiB writes:"))
    assert float(rate.split(":")[1].split()[0].replace(",", "")) > 0
    assert "sync_delay_us = " in result.stdout
    assert not list((tmp_path / "core" / "journal").iterdir())  # the probe file is removed
