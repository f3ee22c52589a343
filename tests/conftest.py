"""Fixtures that start real TridentMQ processes on loopback with OS-assigned ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

STARTUP_TIMEOUT = 20.0


@dataclass
class CoreProcess:
    process: subprocess.Popen[bytes]
    link_port: int
    management_port: int
    data_dir: Path
    log_path: Path

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode


def start_core(tmp_path: Path, name: str = "core", config: str | None = None, **env: str) -> CoreProcess:
    data_dir = tmp_path / name
    data_dir.mkdir(parents=True, exist_ok=True)
    ports_file = data_dir / "ports.json"
    ports_file.unlink(missing_ok=True)  # a restart on the same data directory must not read the old ports
    log_path = data_dir / "core.log"
    args = ["--ports-file", str(ports_file)]
    if config is not None:
        (data_dir / "core.toml").write_text(config)
        args += ["--config", str(data_dir / "core.toml")]
    environment = {
        **os.environ,
        "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir),
        "TRIDENTMQ_CORE_NODE_NAME": name,
        "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
        "TRIDENTMQ_CORE_LINK_PORT": "0",
        "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
        **env,
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tridentmq_core", *args],
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not ports_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"core exited with {process.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"core did not start in {STARTUP_TIMEOUT} s:\n{log_path.read_text()}")
        time.sleep(0.05)
    ports = json.loads(ports_file.read_text())
    return CoreProcess(process, ports["link"], ports["management"], data_dir, log_path)


@pytest.fixture
def core(tmp_path: Path) -> Iterator[CoreProcess]:
    node = start_core(tmp_path)
    yield node
    code = node.stop()
    assert code == 0, f"core exited with {code}:\n{node.log()}"
    assert "Traceback" not in node.log(), node.log()
