"""A process's resident memory, read from /proc, for tests that bound what hostile input may cost."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType

MIB = 1024 * 1024


def rss(pid: int) -> int:
    """Bytes of ``pid`` in RAM now (VmRSS)."""
    return _status_bytes(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """The most bytes ``pid`` has had in RAM since it started (VmHWM): the kernel's own peak, no sampling."""
    return _status_bytes(pid, "VmHWM")


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for process {pid}")


class PeakRss:
    """A process's VmRSS growth over its value on entry, sampled in a thread until exit (or ``limit_s``)."""

    def __init__(self, pid: int, limit_s: float = 300.0) -> None:
        self.pid = pid
        self.limit_s = limit_s
        self.baseline = rss(pid)
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def _sample(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not self._stop.wait(0.005) and time.monotonic() < deadline:
            try:
                self.peak = max(self.peak, rss(self.pid))
            except (FileNotFoundError, ProcessLookupError):  # the process died: the test says so
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))
