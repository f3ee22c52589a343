"""The shared-store pair: two nodes on one shared directory; whoever holds its lease serves.

The shared directory holds the lease (see ``lease.py``), the pair's identity (one node id for both halves)
and the journal, one directory per epoch. A node that wins the lease at epoch *e* writes the live state of
the newest older journal into ``epoch-<e>`` and serves from there: the journal a fenced holder may still be
writing into (a paused process wakes with writes queued) is never read again, so a plain POSIX lock on a
network filesystem is never trusted for exclusion. The holder also checks that its lease is still valid
before it confirms anything (``valid``), and stops when it learns that another node took the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Final

from tridentmq_core.ha.lease import LeaseEvent, LeaseFile, SharedStoreLease
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.data_lock import journal_lock_path
from tridentmq_core.store.journal import write_live_state
from tridentmq_shared.supervision import spawn

log = logging.getLogger("tridentmq.core.ha")

EPOCH_PREFIX: Final = "epoch-"


def epoch_directories(shared: Path) -> list[tuple[int, Path]]:
    """The journal directories of the shared directory, oldest epoch first."""
    found = []
    for path in shared.glob(f"{EPOCH_PREFIX}*"):
        suffix = path.name[len(EPOCH_PREFIX) :]
        if suffix.isdigit() and path.is_dir():
            found.append((int(suffix), path))
    return sorted(found)


def epoch_directory(shared: Path, epoch: int) -> Path:
    return shared / f"{EPOCH_PREFIX}{epoch:08d}"


def journal_for_epoch(shared: Path, epoch: int, segment_bytes: int) -> Path:
    """The journal directory of ``epoch``, holding the live state of the newest older one (which is then
    removed with the rest of the older ones)."""
    target = epoch_directory(shared, epoch)
    older = [(e, path) for e, path in epoch_directories(shared) if e < epoch]
    if older:
        read, written = write_live_state(older[-1][1], target, segment_bytes)
        log.info(
            "journal taken over from the previous epoch",
            extra={"epoch": epoch, "from": older[-1][1].name, "records_read": read, "written": written},
        )
        for _, path in older:
            shutil.rmtree(path, ignore_errors=True)
            journal_lock_path(path).unlink(missing_ok=True)
    else:
        target.mkdir(parents=True, exist_ok=True)
    return target


class SharedStore:
    """Drives the lease from a timer: activates the node when it wins the lease, fences it when it loses it."""

    def __init__(
        self,
        settings: CoreSettings,
        directory: Path,
        server_id: str,
        min_epoch: int,
        activate: Callable[[int], Coroutine[Any, Any, None]],
        fenced: Callable[[str], None],
    ) -> None:
        ha = settings.ha
        self.directory = directory
        settle = max(50, ha.lease_renew_ms // 2)
        self.lease = SharedStoreLease(
            LeaseFile(directory),
            server_id,
            renew_ms=ha.lease_renew_ms,
            expiry_ms=ha.lease_expiry_ms,
            settle_ms=settle,
            min_epoch=min_epoch,
        )
        self._activate = activate
        self._fenced = fenced
        self.on_renewed: Callable[[], None] = lambda: None  # the node releases confirms held for a renewal
        self.state = "waiting for the lease"
        self._task: asyncio.Task[None] | None = None
        self._activating: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = spawn(self._run(), "ha-shared-store")

    def valid(self) -> bool:
        return self.lease.valid(time.monotonic())

    async def _run(self) -> None:
        while True:
            event = self.lease.tick(time.monotonic())
            if event is LeaseEvent.ACQUIRED:
                self.state = "active"
                # Renewed meanwhile: activating takes seconds (the journal's take-over and replay, the cluster
                # join's wait), and a holder that stopped renewing for longer than the expiry lost the lease
                # to the other node, then fenced itself, and the two could take turns so.
                self._activating = spawn(self._activate(self.lease.epoch), "ha-shared-store-activate")
            elif event is LeaseEvent.FENCED:
                self.state = "fenced"
                self._fenced("the shared-store lease went to another node")
                return
            elif event is LeaseEvent.RENEWED and self.lease.renewed_in_time(time.monotonic()) is LeaseEvent.FENCED:
                self.state = "fenced"
                self._fenced("the shared-store lease may have gone to another node while this one was paused")
                return
            elif event is LeaseEvent.RENEWED:
                self.on_renewed()
            await asyncio.sleep(self.lease.next_delay())

    def status(self) -> dict[str, Any]:
        return {"shared_directory": str(self.directory), "state": self.state, "lease_epoch": self.lease.epoch}

    async def stop(self) -> None:
        """Stop renewing (``release`` gives the lease up once the journal is closed)."""
        for task in (self._task, self._activating):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def release(self) -> None:
        """After a clean stop: the waiting node takes over at once instead of after the expiry."""
        self.lease.release()
