"""A node's identity and activation epoch in its data directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tridentmq_core.store.identity import EPOCH_FILE, NODE_ID_FILE, IdentityError, NodeIdentity


def test_first_start_creates_an_id_and_epoch_1_and_restarts_keep_them(tmp_path: Path) -> None:
    first = NodeIdentity(tmp_path)
    assert first.epoch == 1
    assert (tmp_path / NODE_ID_FILE).read_text().strip() == first.node_id
    again = NodeIdentity(tmp_path)
    assert (again.node_id, again.epoch) == (first.node_id, 1)
    assert again.advance_epoch() == 2
    assert NodeIdentity(tmp_path).epoch == 2  # durable
    assert not list(tmp_path.glob("*.tmp"))


def test_a_node_id_file_from_before_epochs_is_kept(tmp_path: Path) -> None:
    (tmp_path / NODE_ID_FILE).write_text("d0c2a0b4-0000-4000-8000-000000000001\n")
    identity = NodeIdentity(tmp_path)
    assert identity.node_id == "d0c2a0b4-0000-4000-8000-000000000001"
    assert identity.epoch == 1


def test_a_damaged_epoch_file_refuses_to_start(tmp_path: Path) -> None:
    NodeIdentity(tmp_path)
    (tmp_path / EPOCH_FILE).write_text("\x00\x00garbage")
    with pytest.raises(IdentityError, match="not an epoch number"):
        NodeIdentity(tmp_path)
