"""Core nodes in a network lab (``NetLab``): each in a namespace of its own, bound to its lab address with
the default ports, clustered with the nodes it is given, accepting clients from other hosts (they run in
another namespace of the lab)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tests.jepsen.nemesis import NetLab, kill9

LINK_PORT = 61616


class LabCores:
    def __init__(self, lab: NetLab, root: Path) -> None:
        self.lab, self.root = lab, root
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, connectors: Iterable[str], **settings: str) -> None:
        """Start ``node`` clustered with ``connectors`` (lab nodes); ``settings`` are more environment, by
        their variables' names. Returns once it listens."""
        data_dir = self.root / node
        data_dir.mkdir(parents=True, exist_ok=True)
        address = self.lab.address(node)
        env = {
            **os.environ,
            "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir),
            "TRIDENTMQ_CORE_NODE_NAME": node,
            "TRIDENTMQ_CORE_LINK_HOST": address,
            "TRIDENTMQ_CORE_MANAGEMENT_HOST": address,
            "TRIDENTMQ_CORE_CLUSTER_ADVERTISE_HOST": address,
            "TRIDENTMQ_CORE_CLUSTER_USER": "cluster",
            "TRIDENTMQ_CORE_CLUSTER_PASSWORD": "s3cret-cluster",
            "TRIDENTMQ_CORE_CLUSTER_CONNECTORS": ",".join(f"{self.lab.address(c)}:{LINK_PORT}" for c in connectors),
            "TRIDENTMQ_CORE_SECURITY_ALLOW_ANONYMOUS_REMOTE": "true",
            **settings,
        }
        argv = [sys.executable, "-m", "tridentmq_core", "--ports-file", str(data_dir / "ports.json")]
        with (data_dir / "core.log").open("ab") as log:
            self.processes[node] = self.lab.run(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not (data_dir / "ports.json").exists():
            assert self.processes[node].poll() is None, self.log(node)
            assert time.monotonic() < deadline, f"{node} did not start:\n{self.log(node)}"
            time.sleep(0.05)

    def log(self, node: str) -> str:
        return (self.root / node / "core.log").read_text(errors="replace")

    def wait_for_log(self, node: str, text: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(node):
            assert time.monotonic() < deadline, f"{node} never logged {text!r}:\n{self.log(node)[-3000:]}"
            time.sleep(0.05)

    def close(self) -> None:
        """Stop every node gracefully, by its PID (kill -9 one that does not stop within 8 s)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=8)
            except subprocess.TimeoutExpired:
                kill9(process.pid)
                process.wait(timeout=5)
