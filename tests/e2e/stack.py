"""The compose stack of deploy/ as the end-to-end tests drive it: image built by deploy/build-image.sh,
`docker compose` (v2 plugin or the v1 docker-compose) under a project name of the test's own, host ports
picked free on 127.0.0.1, and clients through the load balancers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
#: What the stack's clients log in as (deploy/config/core.toml).
USER, PASSWORD = "app", "app-secret"
READY_TIMEOUT = 240.0  # the whole stack from `up` to serving, on a loaded machine
PORTS = ("STOMP", "STOMP_WS", "MQTT", "MQTT_WS", "AMQP", "AMQP_WS")


def docker_available() -> str | None:
    """Why no Docker engine can run the stack here (None: one can)."""
    if shutil.which("docker") is None:
        return "no docker client installed (.ci/run installs docker.io and starts dockerd)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip().splitlines()[-1:]}"
    if compose_command() is None:
        return "no docker compose (v2 plugin) nor docker-compose (v1) installed"
    return None


def compose_command() -> list[str] | None:
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    found = shutil.which("docker-compose")
    return [found] if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_image() -> None:
    """deploy/build-image.sh, reusing its cached base images; the local Debian base unless the official
    Python image is already here (no registry is needed)."""
    env = dict(os.environ)
    have_official = (
        subprocess.run(["docker", "image", "inspect", "python:3.11-slim"], capture_output=True, check=False).returncode
        == 0
    )
    env.setdefault("TRIDENTMQ_BASE", "python:3.11-slim" if have_official else "local")
    env.setdefault("TRIDENTMQ_PULL", "0")
    result = subprocess.run([str(DEPLOY / "build-image.sh")], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"image build failed:\n{result.stdout}\n{result.stderr[-4000:]}"


@dataclass
class Stack:
    project: str
    files: tuple[str, ...] = ("compose.yaml",)
    ports: dict[str, int] = field(default_factory=lambda: {name: free_port() for name in PORTS})

    def env(self) -> dict[str, str]:
        return {**os.environ, **{f"TRIDENTMQ_{name}_PORT": str(port) for name, port in self.ports.items()}}

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        command = compose_command()
        assert command is not None
        files = [arg for name in self.files for arg in ("-f", str(DEPLOY / name))]
        result = subprocess.run(
            [*command, "-p", self.project, *files, *args],
            env=self.env(),
            cwd=DEPLOY,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )
        if check:
            assert result.returncode == 0, f"compose {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def health(self, service: str) -> list[str]:
        states = []
        for container in self.containers(service):
            inspect = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Health.Status}}", container],
                capture_output=True,
                text=True,
                check=False,
            )
            states.append(inspect.stdout.strip())
        return states

    def wait_healthy(self, *services: str, timeout: float = READY_TIMEOUT) -> float:
        """Seconds until every container of these services is healthy."""
        started = time.monotonic()
        while True:
            states = {service: self.health(service) for service in services}
            if all(s and all(h == "healthy" for h in s) for s in states.values()):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                logs = self.compose("logs", "--tail", "40", check=False).stdout
                pytest.fail(f"not healthy in {timeout:.0f} s: {states}\n{logs[-6000:]}")
            time.sleep(1)

    def readiness(self, service: str) -> dict[str, object]:
        """The body of the service's first container's /readyz (a backup's says whether it is in sync), read
        inside the container: the management port is not published."""
        script = (
            "import urllib.request as u, urllib.error as e\n"
            "try:\n print(u.urlopen('http://127.0.0.1:8161/readyz', timeout=3).read().decode())\n"
            "except e.HTTPError as x:\n print(x.read().decode())"
        )
        result = subprocess.run(
            ["docker", "exec", self.containers(service)[0], "python3", "-c", script],
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            body = json.loads(result.stdout)
        except json.JSONDecodeError:
            return {"status": "unreadable", "output": result.stdout + result.stderr}
        return body if isinstance(body, dict) else {"status": "unreadable", "output": result.stdout}

    def wait_in_sync(self, backup: str, timeout: float = READY_TIMEOUT) -> None:
        """Until the backup says it holds its primary's whole copy (only then can it take over)."""
        deadline = time.monotonic() + timeout
        while (state := self.readiness(backup)).get("in_sync") is not True:
            if time.monotonic() > deadline:
                pytest.fail(f"{backup} not in sync in {timeout:.0f} s: {state}")
            time.sleep(0.5)

    def crash(self, service: str) -> None:
        """SIGKILL of the service's main process from the host, as the OOM killer or a crash would: unlike
        `docker kill`, which the engine takes for an operator's stop, the restart policy brings it back."""
        pid = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Pid}}", self.containers(service)[0]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        os.kill(int(pid), signal.SIGKILL)

    def warnings(self, limit: int = 8000) -> str:
        """The stack's WARNING, ERROR and CRITICAL log lines (and tracebacks), the latest ``limit`` characters:
        what a failure's report needs to be explained after the stack is gone."""
        logs = self.compose("logs", "--no-color", check=False).stdout
        marks = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback", "Error:")
        return "\n".join(line for line in logs.splitlines() if any(m in line for m in marks))[-limit:]

    def down(self, *, volumes: bool) -> None:
        """Remove the stack; again if something was left (a container restarting after a kill, say, keeps
        the network busy the first time)."""
        for _ in range(3):
            result = self.compose("down", "--timeout", "30", *(["--volumes"] if volumes else []), check=False)
            if result.returncode == 0 and not self.compose("ps", "-q", check=False).stdout.split():
                return
        pytest.fail(f"compose down left the stack behind:\n{result.stdout}\n{result.stderr}")
