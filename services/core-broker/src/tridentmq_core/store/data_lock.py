"""An exclusive lock on a node's data directory: one running node (or offline tool) per directory.

``flock`` on a file in the directory; the kernel drops it when the process dies, so a crashed node never
leaves a stale lock behind. (Like every POSIX lock it is not to be trusted on network filesystems; the
shared-store HA mode uses its own lease for that.)
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "node.lock"


class DataDirectoryLockedError(Exception):
    """Another process holds the data directory."""


class DataDirectoryLock:
    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DataDirectoryLockedError(
                f"{data_dir} is in use by another TridentMQ process (stop it first)"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
