"""A replication pair's settings, roles and state on disk (whose copy, which epoch, whether it is whole), and
what it asks of its node's cluster connections (``ClusterView``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.files import write_durably
from tridentmq_core.store.identity import NodeIdentity
from tridentmq_shared.settings import SettingsError

REPLICATION: Final = "replication"
SHARED_STORE: Final = "shared-store"
PRIMARY: Final = "primary"
BACKUP: Final = "backup"
HA_STATE_FILE: Final = "ha.json"
VOTES_FILE: Final = "votes.json"
FENCED_EXIT_CODE: Final = 3  # the process exits with this when a quorum says another copy replaced it


def validate_ha_settings(settings: CoreSettings, clusters: bool) -> None:
    ha = settings.ha
    if ha.policy not in ("none", REPLICATION, SHARED_STORE):
        raise SettingsError("ha.policy must be none, replication or shared-store")
    if ha.policy == "none":
        return
    if ha.policy == SHARED_STORE:
        if not ha.shared_directory:
            raise SettingsError("ha.shared_directory is required with the shared-store policy")
        if ha.lease_expiry_ms <= 2 * ha.lease_renew_ms:
            raise SettingsError("ha.lease_expiry_ms must exceed twice ha.lease_renew_ms")
        if not settings.journal.enabled:
            raise SettingsError("a shared-store pair needs the journal (journal.enabled)")
        return
    if ha.role not in (PRIMARY, BACKUP):
        raise SettingsError("ha.role must be primary or backup")
    if not ha.group_name:
        raise SettingsError("ha.group_name names the pair: set it, the same on the primary and its backup")
    if not clusters:
        raise SettingsError(
            "a replication pair needs the cluster credentials and connectors (cluster.user, "
            "cluster.password, and cluster.connectors naming the other half and other nodes)"
        )
    if not settings.journal.enabled:
        raise SettingsError("a replication pair needs the journal (journal.enabled)")


class ClusterView(Protocol):
    """What a pair asks of its node's cluster connections (``cluster/manager.py``)."""

    node_id: str

    def member_endpoints(self) -> list[tuple[str, int]]:
        """The link endpoint of every other node heard of."""

    def reachable(self, node_id: str, grace_s: float) -> bool:
        """Whether the cluster connection to ``node_id`` is up, or went down less than ``grace_s`` ago."""

    def members_changed(self) -> None:
        """Something in this node's own entry changed (its backup): tell the others and the gateways."""


def record_epoch(identity: NodeIdentity, epoch: int) -> None:
    """The active copy serves at a new ``epoch`` that a quorum granted it: on disk before it confirms anything
    at it, in its identity and, for a copy that was a backup once, in its HA state (its data epoch)."""
    identity.set_epoch(epoch)
    path = identity.data_dir / HA_STATE_FILE
    if path.exists():
        state = BackupState.load(path)
        if state.epoch != epoch:
            state.epoch = epoch
            state.save(path)


@dataclass
class BackupState:
    """What a pair member knows about its copy, on disk: whose data, which epoch, whether the copy is whole (a
    backup in sync, or the active node), and the cluster's active nodes last seen (its voters)."""

    node_id: str = ""
    epoch: int = 0
    in_sync: bool = False
    members: dict[str, tuple[str, int]] = field(default_factory=dict)
    pairs: int = 1  # most pairs seen: the quorum is a majority of these
    #: This copy activated at ``epoch`` itself; False: it copied the node that did, which may still serve.
    activated: bool = False
    #: The (epoch, candidate) of each bid this copy asked for (its process then) and not every voter answered
    #: the withdrawal of: a restarted backup still withdraws the bids its earlier process lost.
    bids: list[tuple[int, str]] = field(default_factory=list)

    @staticmethod
    def load(path: Path) -> BackupState:
        if not path.exists():
            return BackupState()
        data = json.loads(path.read_text(encoding="utf-8"))
        members = {str(k): (str(v[0]), int(v[1])) for k, v in dict(data.get("members") or {}).items()}
        return BackupState(
            str(data.get("node_id", "")),
            int(data.get("epoch", 0)),
            bool(data.get("in_sync")),
            members,
            max(1, int(data.get("pairs", 1))),
            bool(data.get("activated")),
            _bids(data.get("bids")),
        )

    def save(self, path: Path) -> None:
        write_durably(
            path,
            json.dumps(
                {
                    "node_id": self.node_id,
                    "epoch": self.epoch,
                    "in_sync": self.in_sync,
                    "members": self.members,
                    "pairs": self.pairs,
                    "activated": self.activated,
                    "bids": self.bids,
                }
            ),
        )


def _bids(raw: Any) -> list[tuple[int, str]]:
    """The bids kept in an HA state file: [epoch, candidate] pairs; anything else is no bid (not one a voter
    would have promised)."""
    if not isinstance(raw, list):
        return []
    return [
        (item[0], item[1])
        for item in raw
        if isinstance(item, list)
        and len(item) == 2
        and type(item[0]) is int
        and item[0] >= 1
        and isinstance(item[1], str)
        and item[1]
    ]


def mark_released(data_dir: Path) -> None:
    """This copy handed its pair over (failback): it may serve again only after copying the node it handed
    to, never by bidding with its old copy while that node still replays its journal."""
    path = data_dir / HA_STATE_FILE
    state = BackupState.load(path)
    state.in_sync = state.activated = False
    state.save(path)
