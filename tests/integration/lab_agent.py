"""A client process inside a network lab (``NetLab``): a test file run as a script in one of the lab's
namespaces (the namespace the tests run in has no route into the lab). It prints one JSON document a line
and reads its commands from stdin."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.jepsen.nemesis import NetLab, kill9

REPO = Path(__file__).resolve().parents[2]


class Agent:
    """``script`` run with ``role`` and ``spec`` (JSON) as its arguments in the lab's namespace ``node``."""

    def __init__(self, lab: NetLab, node: str, script: Path, role: str, spec: Any, log_path: Path) -> None:
        self.node, self.role = node, role
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with log_path.open("ab") as log:
            self.process: subprocess.Popen[str] = lab.run(
                node,
                [sys.executable, str(script.resolve()), role, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env=env,
                cwd=REPO,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read(self, timeout: float) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the {self.role} agent on {self.node} said nothing for {timeout} s") from None
        if line is None:
            raise AssertionError(
                f"the {self.role} agent on {self.node} exited with {self.process.wait()}:\n"
                f"{self.log_path.read_text(errors='replace')[-3000:]}"
            )
        return json.loads(line)

    def send(self, command: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(command + "\n")
        stdin.flush()

    def ask(self, command: str, timeout: float = 10.0) -> Any:
        self.send(command)
        return self.read(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            kill9(self.process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
