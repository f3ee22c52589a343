"""A process's resident memory, read from /proc, for tests that bound what hostile input may cost."""

from __future__ import annotations

from pathlib import Path

MIB = 1024 * 1024


def rss(pid: int) -> int:
    """Bytes of ``pid`` in RAM now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
