"""Helpers for HA tests: start primary/backup pairs that cluster, read their HA view, wait for sync."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import CoreProcess
from tests.integration.cluster_nodes import Connector, start_node, wait_until


@dataclass
class Pair:
    primary: CoreProcess
    backup: CoreProcess


def ha_view(node: CoreProcess) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(node.management_url + "/api/status", timeout=5) as response:
            return dict(json.loads(response.read()).get("ha") or {})
    except (urllib.error.URLError, OSError):
        return {}


def start_pair(tmp_path: Path, group: str, connectors: Sequence[Connector] = (), **settings: str) -> Pair:
    """A primary (pointed at ``connectors``) and its backup (pointed at the primary and ``connectors``), in sync."""
    ha = {"core_ha_policy": "replication", "core_ha_group_name": group, **settings}
    primary = start_node(tmp_path, f"{group}-primary", list(connectors), **ha)
    backup = start_node(tmp_path, f"{group}-backup", [primary, *connectors], core_ha_role="backup", **ha)
    wait_until(lambda: ha_view(backup).get("in_sync") is True, 20, f"{group}'s backup to be in sync")
    wait_until(lambda: ha_view(primary).get("backup_in_sync") is True, 10, f"{group}'s primary to see it")
    return Pair(primary, backup)
