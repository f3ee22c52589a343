"""A real ``redis-server`` for tests: loopback only, no persistence, stoppable and restartable on its port."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

STARTUP_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process in its own directory; the port stays the same across restarts."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the server (again) on ``self.port`` and wait until it answers PING."""
        if self.running:
            return
        self.starts += 1
        arguments = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
            "--databases",
            "1",
        ]
        self.process = subprocess.Popen(
            arguments, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=self.directory
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not _pong(self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start in {STARTUP_TIMEOUT} s:\n{self.log()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); a no-op when it is not running."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(*, start: bool = True) -> Iterator[RedisServer]:
    """A redis-server on a free loopback port in a temporary directory, stopped on exit whatever happens.

    With ``start=False`` the port is chosen but nothing listens on it until ``server.start()``.
    """
    with tempfile.TemporaryDirectory(prefix="tridentmq-redis-") as directory:
        server = RedisServer(Path(directory))
        try:
            for attempt in range(3 if start else 0):
                try:
                    server.start()
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
                    server.port = free_port()  # taken between choosing and binding it: try another
            yield server
        finally:
            server.stop()
