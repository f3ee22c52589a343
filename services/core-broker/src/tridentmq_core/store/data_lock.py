"""Exclusive locks: one running node (or offline tool) per data directory, and per journal directory.

``flock`` on a lock file; the kernel drops it when the process dies, so a crashed node never leaves a stale
lock behind. (Like every POSIX lock it is not to be trusted on network filesystems; the shared-store HA
mode uses its own lease for that.)

The journal has its own lock because ``journal.directory`` may lie outside the data directory: the node
holds it for its whole life, and ``tridentmq data compact`` takes it before rewriting the journal. It is a
file beside the journal directory, not in it: the compaction swaps the directory by two renames, so a lock
inside would move away with it and there would be a moment with no journal directory to lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "node.lock"
JOURNAL_LOCK_SUFFIX = ".lock"


class LockedError(Exception):
    """Another process holds the directory."""


class DataDirectoryLockedError(LockedError):
    """Another process holds the data directory."""


class JournalLockedError(LockedError):
    """Another process (a node or an offline tool) holds the journal directory."""


def _lock_exclusive(path: Path) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


class _Lock:
    _fd = -1

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


class DataDirectoryLock(_Lock):
    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / LOCK_FILE
        fd = _lock_exclusive(self.path)
        if fd is None:
            raise DataDirectoryLockedError(f"{data_dir} is in use by another TridentMQ process (stop it first)")
        self._fd = fd


def journal_lock_path(journal_dir: Path) -> Path:
    # Resolved: the node's setting and a tool's --journal may name the same directory differently.
    resolved = journal_dir.resolve()
    return resolved.with_name(resolved.name + JOURNAL_LOCK_SUFFIX)


class JournalLock(_Lock):
    def __init__(self, journal_dir: Path) -> None:
        self.path = journal_lock_path(journal_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock_exclusive(self.path)
        if fd is None:
            raise JournalLockedError(
                f"the journal {journal_dir} is in use by another TridentMQ process (a running node or "
                f"`tridentmq data compact`; stop it first)"
            )
        self._fd = fd


def journal_in_use(journal_dir: Path) -> bool:
    """Whether a node (or a compaction) holds the journal now; a probe that takes no lock it keeps and
    creates nothing, for the read-only tools."""
    try:
        fd = os.open(journal_lock_path(journal_dir), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock if it was taken
    return False
