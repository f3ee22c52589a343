"""Quorum votes on which copy of a pair is active, fenced by epochs (pure: no I/O, no clock).

A pair is named by its node id (the backup takes over the primary's id) and its active copy by an epoch
that grows with every activation. Active nodes vote:

- ``activate``: a backup lost its primary and asks to become active at ``epoch`` (its last epoch + 1). A
  voter grants it when it cannot reach that primary either (for at least the grace period) and has never
  promised this epoch or a higher one for the pair: it then promises ``epoch``.
- ``stay``: a primary lost its in-sync backup and asks whether it may go on alone at ``epoch``. A voter
  grants it when it has promised no higher epoch (no backup took over meanwhile).

Votes are majorities of the pairs of the cluster, so two requests for one pair cannot both win; a voter's
promises are kept on disk (the caller persists ``promised``), so a restarted voter does not forget them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

ACTIVATE: Final = "activate"
STAY: Final = "stay"


def quorum(pairs: int) -> int:
    """Votes needed among ``pairs`` pairs: a strict majority."""
    return pairs // 2 + 1


@dataclass(frozen=True, slots=True)
class VoteRequest:
    kind: str  # ACTIVATE or STAY
    node_id: str  # the pair
    epoch: int
    candidate: str  # who asks (a server id), for the log

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "node_id": self.node_id, "epoch": self.epoch, "candidate": self.candidate}

    @staticmethod
    def from_wire(item: Any) -> VoteRequest:
        if not isinstance(item, dict):
            raise ValueError("a vote request is a map")  # noqa: TRY004 - callers catch ValueError for any bad input
        kind, node_id, epoch = item.get("kind"), item.get("node_id"), item.get("epoch")
        candidate = item.get("candidate")
        if (kind not in (ACTIVATE, STAY) or not isinstance(node_id, str) or not node_id or type(epoch) is not int
                or epoch < 1 or not isinstance(candidate, str)):  # fmt: skip
            raise ValueError(f"malformed vote request {str(item)[:120]}")
        return VoteRequest(kind, node_id, epoch, candidate)


class VoteBook:
    """Per pair, the highest epoch this voter promised (and to whom) or saw active."""

    def __init__(self, promised: dict[str, tuple[int, str]] | None = None) -> None:
        self.promised: dict[str, tuple[int, str]] = dict(promised or {})

    def epoch(self, node_id: str) -> int:
        return self.promised.get(node_id, (0, ""))[0]

    def decide(self, request: VoteRequest, *, primary_reachable: bool) -> tuple[bool, str]:
        """(granted, why not). A grant of ``activate`` changes ``promised``: persist it before answering."""
        known, promisee = self.promised.get(request.node_id, (0, ""))
        if request.kind == STAY:
            if known > request.epoch:
                return False, f"epoch {known} replaced epoch {request.epoch}"
            return True, ""
        if known == request.epoch and promisee == request.candidate and request.candidate:
            return True, ""  # the same candidate asking again (an earlier round's answer was lost or too few)
        if request.epoch <= known:
            return False, f"epoch {known} was already promised"
        if primary_reachable:
            return False, "the primary is still reachable from this node"
        self.promised[request.node_id] = (request.epoch, request.candidate)
        return True, ""

    def observe(self, node_id: str, epoch: int) -> bool:
        """A node is active at ``epoch``; True when that raises what was known (persist it)."""
        if epoch > self.epoch(node_id):
            self.promised[node_id] = (epoch, "")
            return True
        return False

    def to_json(self) -> dict[str, list[Any]]:
        return {node_id: [epoch, candidate] for node_id, (epoch, candidate) in self.promised.items()}

    @staticmethod
    def from_json(data: Any) -> VoteBook:
        if not isinstance(data, dict):
            raise ValueError("the vote book is a map")  # noqa: TRY004 - callers catch ValueError for any bad input
        promised: dict[str, tuple[int, str]] = {}
        for node_id, entry in data.items():
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                    and isinstance(entry[1], str)):  # fmt: skip
                raise ValueError(f"malformed vote book entry for {node_id!r}")
            promised[node_id] = (entry[0], entry[1])
        return VoteBook(promised)
