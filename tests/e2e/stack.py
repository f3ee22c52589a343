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
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
#: What the stack's clients log in as (deploy/config/core.toml).
USER, PASSWORD = "app", "app-secret"
#: The management API's user there.
ADMIN_USER, ADMIN_PASSWORD = "admin", "admin-secret"
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
                # The services that are not healthy say why in their own logs; the others' would crowd them out.
                unhealthy = [service for service, s in states.items() if not s or any(h != "healthy" for h in s)]
                logs = self.compose("logs", "--no-color", "--tail", "150", *unhealthy, check=False).stdout
                pytest.fail(f"not healthy in {timeout:.0f} s: {states}\n{logs[-20000:]}")
            time.sleep(1)

    def management(self, service: str, path: str, *, admin: bool = False) -> dict[str, Any]:
        """The JSON body of ``path`` on the management server of the service's first container (error statuses
        included), read inside the container: the management port is not published. ``admin``: with the
        management user's credentials (``/api/...``). ``{"status": "unreadable"}`` when no answer came."""
        script = (
            "import base64, sys, urllib.request as u, urllib.error as e\n"
            "r = u.Request('http://127.0.0.1:8161' + sys.argv[1])\n"
            "if len(sys.argv) > 2:\n"
            " r.add_header('Authorization', 'Basic ' + base64.b64encode(sys.argv[2].encode()).decode())\n"
            "try:\n print(u.urlopen(r, timeout=3).read().decode())\n"
            "except e.HTTPError as x:\n print(x.read().decode())"
        )
        containers = self.containers(service)
        if not containers:
            return {"status": "unreadable", "output": f"no running container of {service}"}
        credentials = [f"{ADMIN_USER}:{ADMIN_PASSWORD}"] if admin else []
        try:
            result = subprocess.run(
                ["docker", "exec", containers[0], "python3", "-c", script, path, *credentials],
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            return {"status": "unreadable", "output": "docker exec timed out"}
        try:
            body = json.loads(result.stdout)
        except json.JSONDecodeError:
            return {"status": "unreadable", "output": result.stdout + result.stderr}
        return body if isinstance(body, dict) else {"status": "unreadable", "output": result.stdout}

    def readiness(self, service: str) -> dict[str, Any]:
        """/readyz: ``ready`` when the node serves; a backup's says whether it holds a whole copy."""
        return self.management(service, "/readyz")

    def wait_ready(self, service: str, timeout: float = READY_TIMEOUT) -> None:
        """Until the node serves clients (a backup: once it took over)."""
        deadline = time.monotonic() + timeout
        while (state := self.readiness(service)).get("status") != "ready":
            if time.monotonic() > deadline:
                pytest.fail(f"{service} not serving in {timeout:.0f} s: {state}")
            time.sleep(0.5)

    def wait_backup_in_sync(self, primary: str, timeout: float = READY_TIMEOUT) -> None:
        """Until the primary serves and says its backup holds its whole copy and confirms with it (only then can
        the backup take over). The primary's view, not the backup's: a backup's own flag still says in sync for
        a while after its primary dropped it."""
        deadline = time.monotonic() + timeout
        while True:
            ha = self.management(primary, "/api/status", admin=True).get("ha") or {}
            if ha.get("active") and ha.get("backup_in_sync") and not ha.get("waiting_for_quorum"):
                return
            if time.monotonic() > deadline:
                backup = primary.replace("core-", "backup-")
                pytest.fail(
                    f"{primary}'s backup not in sync in {timeout:.0f} s: {ha}\n"
                    f"{backup}'s last log lines:\n{self.tail(backup)}\n{primary}'s:\n{self.tail(primary)}"
                )
            time.sleep(0.5)

    def tail(self, service: str, lines: int = 60) -> str:
        """The last ``lines`` log lines of the service's first container, whatever their level."""
        containers = self.containers_all(service)
        if not containers:
            return f"({service} has no container)"
        logs = subprocess.run(
            ["docker", "logs", "--tail", str(lines), containers[0]], capture_output=True, text=True, check=False
        )
        return logs.stdout + logs.stderr

    def containers_all(self, service: str) -> list[str]:
        """The service's containers, stopped ones included."""
        return self.compose("ps", "-a", "-q", service).stdout.split()

    def kill(self, service: str) -> None:
        """`docker kill -s KILL`: the engine takes it for an operator's stop and does not restart it."""
        subprocess.run(["docker", "kill", "-s", "KILL", self.containers(service)[0]], capture_output=True, check=True)

    def start(self, service: str) -> None:
        """`docker start` of the service's containers (nothing happens to a running one)."""
        for container in self.containers_all(service):
            subprocess.run(["docker", "start", container], capture_output=True, check=True)

    def stall(self, service: str) -> None:
        """SIGSTOP of the service's main process from the host: a stall. Not `docker pause`, which failed once in
        CI (exit 1, its reason not kept); a stop signal to a running process does not fail that way."""
        os.kill(self._main_pid(service), signal.SIGSTOP)

    def resume(self, service: str) -> None:
        os.kill(self._main_pid(service), signal.SIGCONT)

    def crash(self, service: str) -> None:
        """SIGKILL of the service's main process from the host, as the OOM killer or a crash would: unlike
        `docker kill`, which the engine takes for an operator's stop, the restart policy brings it back."""
        os.kill(self._main_pid(service), signal.SIGKILL)

    def _main_pid(self, service: str) -> int:
        """The host pid of the process of the service's first container, which must be running."""
        fields = "{{.State.Pid}} {{.State.Running}} {{.State.Restarting}} {{.State.Paused}}"
        inspect = ["docker", "inspect", "-f", fields, self.containers(service)[0]]
        pid, *state = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.split()
        # Pid 0 (a container in its restart back-off) would make os.kill signal this process's own group.
        assert state == ["true", "false", "false"], f"{service} is not running: {pid} {state}"
        assert int(pid) > 0, f"{service} has no process: {pid} {state}"
        return int(pid)

    def logged_since(self, service: str, since: float, text: str) -> bool:
        """Whether the service's first container logged ``text`` since the Unix time ``since``."""
        logs = subprocess.run(
            ["docker", "logs", "--since", f"{since:.3f}", self.containers_all(service)[0]],
            capture_output=True,
            text=True,
            check=False,
        )
        return text in logs.stdout + logs.stderr

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
