"""A node's link to another node: the cluster's and HA's verbs, which applications never use.

A ``PeerLink`` is a ``PipelinedLink`` (it publishes, subscribes and fails over as any link does) that also joins a
cluster and reports its progress (``topology``), streams a primary's journal (``replicate``, ``replica_ack``)
and asks for votes (``vote``). The node answers these only to a user with the cluster credentials.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tridentmq_shared.link import events as ev
from tridentmq_shared.link.pipelined import PipelinedLink


class PeerLink(PipelinedLink):
    # No slots (a node has a few of these): the callbacks' defaults are the class's.
    #: Called with each TOPOLOGY_UPDATE the node pushes (after a ``topology`` request).
    on_topology: Callable[[dict[str, Any]], None] | None = None
    #: Called with each batch of journal records a primary streams (after a ``replicate`` request).
    on_replica: Callable[[ev.ReplicaRecords], None] | None = None

    async def topology(self, info: dict[str, Any]) -> dict[str, Any]:
        """Join the cluster (``info`` names this node), report a sync, or only learn the members (``{}``);
        later changes go to ``on_topology``."""
        result = await self._request(lambda conn: conn.topology(info))
        return dict(result) if isinstance(result, dict) else {}

    async def replicate(self, info: dict[str, Any]) -> dict[str, Any]:
        """Ask a primary for its journal stream (``info`` names this backup); records go to ``on_replica``."""
        result = await self._request(lambda conn: conn.replicate(info), again=False)
        return dict(result) if isinstance(result, dict) else {}

    def replica_ack(self, upto: int) -> None:
        """Tell the primary every record up to ``upto`` is held here."""
        conn = self._conn
        if conn is not None and conn.open:
            conn.replica_ack(upto)
            self._schedule_flush()

    async def vote(self, request: dict[str, Any]) -> dict[str, Any]:
        """Ask a node for its vote (a backup that would take over, a primary that checks its quorum)."""
        result = await self._request(lambda conn: conn.vote(request), again=False)
        return dict(result) if isinstance(result, dict) else {}

    def _peer_event(self, event: ev.TopologyUpdate | ev.ReplicaRecords) -> None:
        if isinstance(event, ev.ReplicaRecords):
            if self.on_replica is not None:
                self.on_replica(event)
        elif self.on_topology is not None:
            self.on_topology(event.update)
