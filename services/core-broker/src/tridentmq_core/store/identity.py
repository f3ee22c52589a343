"""A node's identity and activation epoch, kept in its data directory.

The node id is created on first start and never changes. The epoch counts activations: 1 after the first
start, raised by one whenever the node takes over as the active copy of its data (HA failover) and, in a
replicated pair, whenever its primary restarts or goes on without its backup. It is stamped on the audit
stream, so a node that was fenced can be told apart from the one that replaced it.
Both files are written to a temporary name, synced and renamed, so a crash leaves the old value or the new.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Final

from tridentmq_core.store.files import write_durably

NODE_ID_FILE: Final = "node.id"
EPOCH_FILE: Final = "node.epoch"


class IdentityError(Exception):
    """The identity files of a data directory are unreadable: refuse to start rather than guess."""


class NodeIdentity:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        id_path = data_dir / NODE_ID_FILE
        if id_path.exists():
            self.node_id = id_path.read_text(encoding="ascii").strip()
        else:
            self.node_id = str(uuid.uuid4())
            self._write(id_path, self.node_id)
        epoch_path = data_dir / EPOCH_FILE
        #: No epoch was recorded before: this directory never served, so no other copy holds its data.
        self.first_start = not epoch_path.exists()
        if epoch_path.exists():
            text = epoch_path.read_text(encoding="ascii").strip()
            if not text.isdigit():
                raise IdentityError(f"{epoch_path} holds {text[:40]!r}, not an epoch number")
            self.epoch = int(text)
        else:
            self.epoch = 0
            self.advance_epoch()

    def advance_epoch(self) -> int:
        """Start a new activation epoch, durably, and return it."""
        self.epoch += 1
        self._write(self.data_dir / EPOCH_FILE, str(self.epoch))
        return self.epoch

    def adopt(self, node_id: str, epoch: int) -> None:
        """Take the identity of the node whose data this directory now holds (a backup of its primary)."""
        if node_id != self.node_id:
            self.node_id = node_id
            self._write(self.data_dir / NODE_ID_FILE, node_id)
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` (an activation a quorum granted, or the epoch of the copied primary)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._write(self.data_dir / EPOCH_FILE, str(epoch))

    @staticmethod
    def _write(path: Path, value: str) -> None:
        write_durably(path, value + "\n")
