"""Small files that must hold either their old or their new content after a crash."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write to a temporary name, sync, rename over ``path`` and sync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)
    fsync_directory(path.parent)
