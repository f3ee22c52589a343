"""Quorum votes on which copy of a pair is active, fenced by epochs (pure: no I/O, no clock).

A pair is named by its node id (the backup takes over the primary's id) and its active copy by an epoch
that grows with every activation. Each copy also knows its *data epoch*: the epoch of the node it copied, or
at which it activated. Active nodes vote:

- ``activate``: a copy lost its pair's active node and asks to become active at ``epoch``. A voter grants it
  when it cannot reach that node either (for at least the grace period), has never promised this epoch or
  a higher one for the pair, and the copy is fresh: its data epoch is not below the epoch the voter saw
  the pair active at, nor below the data epoch of the copy it last promised to. It then promises
  ``epoch``. A winner commits its epoch before serving with a ``stay`` at that epoch (below), which makes
  a majority refuse older copies from then on. Two copies asking for the same epoch can split the votes
  so that neither wins; a candidate then asks again above the promises, which the commit keeps safe.
- ``stay``: a primary lost its in-sync backup (or restarts) and asks whether it may go on alone at a new
  ``epoch``, its data being at ``data_epoch``. A voter grants it when no other copy can have served since
  that data epoch: it has promised no higher epoch (no backup took over meanwhile), has not promised or
  seen this epoch for another copy, nor the data epoch won by vote by another server (a copy that won it
  while the asking one held it without a vote: failback). A grant raises the pair's data epoch to
  ``epoch``, so the lost backup's copy, which lacks the writes confirmed from now on, is stale at every
  voter that granted it and can never win a majority. The winner of an ``activate`` commits with a stay
  at the epoch it won (no new one: ``data_epoch`` equal to ``epoch``).
- ``withdraw``: a backup that bid for ``epoch`` and lost now copies the pair's active node: it will never
  serve at that epoch, so a voter forgets its promise of it (the promise would otherwise keep outbidding the
  active node, and refuse that node's restart, for good). Only that candidate's promise of that very epoch
  goes, and no later bid asks for that epoch again (``Bids``): a late withdrawal never cancels a later bid.

Votes are majorities of the pairs of the cluster, so two requests for one pair cannot both win; a voter's
promises are kept on disk (the caller persists the book), so a restarted voter does not forget them.

A node of the pair that joins a voter's cluster connections at an older epoch than the voter knows is fenced
(it stops) only when the voter knows the newer epoch serves: seen active, or promised here and committed by
its winner (``standing``). A promise alone proves nothing: most lost bids are of a backup that missed a
primary which only stood still for a second. Fencing on it stopped the pair's newest copy for good (a primary
that never was a backup restarts only with every voter's grant, and the promising voter refuses it). A node
merely outbid by a promise is kept out until it serves at a newer epoch, which it gets by a stay (it lost its
backup) only if a majority agrees no other copy could have served.

A primary that restarts asks a ``stay`` at the epoch after its own (``restart_refusal``). Each voter grants at
most one of that stay and any other copy's ``activate`` that could have served since (above), so a majority
of grants, its own vote counted as when it goes on alone, means no other copy can hold a majority: one
voter's promise to a backup that never won does not keep the pair's newest copy from serving.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

ACTIVATE: Final = "activate"
STAY: Final = "stay"
WITHDRAW: Final = "withdraw"


class Standing(enum.Enum):
    """How a node of a pair, serving at some epoch, stands at a voter (``VoteBook.standing``)."""

    CURRENT = "current"  # no newer epoch known: talk to it
    OUTBID = "outbid"  # a newer epoch was promised to another copy, not known to serve: not now, not fenced
    REPLACED = "replaced"  # a newer epoch serves (seen, or committed by its winner): the node must stop


def quorum(pairs: int) -> int:
    """Votes needed among ``pairs`` pairs: a strict majority."""
    return pairs // 2 + 1


def answer_int(answer: Mapping[str, Any], key: str) -> int:
    """An integer field of a vote answer (0 when missing or malformed: another node's answer is input)."""
    value = answer.get(key, 0)
    return value if type(value) is int else 0


def restart_refusal(answers: Sequence[Mapping[str, Any]], *, node_id: str, own_epoch: int, pairs: int) -> str:
    """Why a restarting primary of pair ``node_id`` at ``own_epoch`` may not serve, given the voters'
    ``answers`` to its ``stay`` ("" when it may). ``pairs`` is the most pairs this copy saw (as a backup), 0
    when it never counted them.

    A quorum of grants, this copy's own vote counted, is enough; each other pair counts once, however many
    of its addresses were asked, and only when it names itself. The quorum is of the most pairs known to
    this copy, to the voters that answered, or counted by those voters (the cluster may have grown since
    this copy counted), and needs another pair's grant: never this copy's vote alone. An answer of this
    pair's other copy means that copy is active: it is never outvoted. Short of a quorum, any refusal or
    newer epoch keeps it from serving; when every voter that answered grants it, or none answered, it serves
    (a whole cluster starting at once)."""
    named = {answer.get("voter") for answer in answers}
    voters = {voter for voter in named if isinstance(voter, str) and voter and voter != node_id}
    granting = {answer.get("voter") for answer in answers if answer.get("granted") is True} & voters
    heard_of = max((answer_int(answer, "pairs") for answer in answers), default=0)
    if (
        pairs
        and granting
        and node_id not in named
        and 1 + len(granting) >= quorum(max(pairs, 1 + len(voters), heard_of))
    ):
        return ""
    newer = max((answer_int(answer, "epoch") for answer in answers), default=0)
    if newer > own_epoch:
        return f"epoch {newer} of this pair is active elsewhere (this copy has epoch {own_epoch})"
    refused = next((answer for answer in answers if answer.get("granted") is not True), None)
    if refused is not None:  # e.g. this epoch was won by vote by another copy: only a vote may settle it
        return f"a voter refused: {str(refused.get('reason', ''))[:200]}"
    return ""


@dataclass(slots=True)
class Bids:
    """A backup's bids: the epoch it asks for next, and every (epoch, candidate) it asked for that not every
    voter has been told is withdrawn yet (a candidate is the asking process: this one, or an earlier one on
    the same copy, whose bids the copy's HA state keeps)."""

    floor: int = 0  # asks for at least this: above a split vote's promises, and above every withdrawn bid
    pending: set[tuple[int, str]] = field(default_factory=set)

    @staticmethod
    def kept(bids: Sequence[tuple[int, str]]) -> Bids:
        """The bids an earlier process left to withdraw: this one asks above them all."""
        return Bids(max((epoch for epoch, _ in bids), default=-1) + 1, set(bids))

    def epoch_for(self, data_epoch: int) -> int:
        """The epoch to ask for with a copy at ``data_epoch``."""
        return max(data_epoch + 1, self.floor)

    def asked(self, epoch: int, candidate: str) -> None:
        self.pending.add((epoch, candidate))

    def outbid(self, promised: int) -> None:
        """Another copy was promised ``promised``: ask above it."""
        self.floor = max(self.floor, promised + 1)

    def withdrawing(self) -> list[tuple[int, str]]:
        """The bids to withdraw now. No later bid asks for any of their epochs or below again, so a withdrawal
        that reaches a voter late can never take away the promise of a later bid."""
        self.floor = max(self.floor, *(epoch + 1 for epoch, _ in self.pending), 0)
        return sorted(self.pending)

    def withdrawn(self, bid: tuple[int, str]) -> None:
        """Every voter answered the withdrawal of ``bid``."""
        self.pending.discard(bid)

    def to_state(self) -> list[tuple[int, str]]:
        return sorted(self.pending)


@dataclass(frozen=True, slots=True)
class VoteRequest:
    kind: str  # ACTIVATE, STAY or WITHDRAW
    node_id: str  # the pair
    epoch: int
    candidate: str  # who asks (a server id), for the log
    data_epoch: int = 0  # the asking copy's data epoch: the one it copied (ACTIVATE) or served at (STAY)

    def __post_init__(self) -> None:
        # A request that names no data epoch (0, which no copy has) is an activate asking for the epoch after
        # its copy's, or a stay of the copy serving at ``epoch`` (a commit).
        if not self.data_epoch:
            object.__setattr__(self, "data_epoch", self.epoch if self.kind == STAY else self.epoch - 1)

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "node_id": self.node_id,
            "epoch": self.epoch,
            "candidate": self.candidate,
            "data_epoch": self.data_epoch,
        }

    @staticmethod
    def from_wire(item: Any) -> VoteRequest:
        if not isinstance(item, dict):
            raise ValueError("a vote request is a map")  # noqa: TRY004 - callers catch ValueError for any bad input
        kind, node_id, epoch = item.get("kind"), item.get("node_id"), item.get("epoch")
        candidate, data_epoch = item.get("candidate"), item.get("data_epoch", 0)
        if (
            kind not in (ACTIVATE, STAY, WITHDRAW)
            or not isinstance(node_id, str)
            or not node_id
            or type(epoch) is not int
            or epoch < 1
            or not isinstance(candidate, str)
            or type(data_epoch) is not int
            or not 0 <= data_epoch <= epoch
        ):
            raise ValueError(f"malformed vote request {str(item)[:120]}")
        return VoteRequest(kind, node_id, epoch, candidate, data_epoch)


class VoteBook:
    """Per pair, the highest epoch this voter promised (and to whom) or saw active, and the data epoch a
    copy needs to be granted (``fresh``)."""

    def __init__(
        self,
        promised: dict[str, tuple[int, str]] | None = None,
        fresh: dict[str, int] | None = None,
        won: dict[str, int] | None = None,
    ) -> None:
        self.promised: dict[str, tuple[int, str]] = dict(promised or {})
        self.fresh: dict[str, int] = dict(fresh or {})
        self.won: dict[str, int] = dict(won or {})  # the promised epoch its promisee said it serves at (commit)

    def epoch(self, node_id: str) -> int:
        return self.promised.get(node_id, (0, ""))[0]

    def freshness(self, node_id: str) -> int:
        return self.fresh.get(node_id, 0)

    def decide(self, request: VoteRequest, *, primary_reachable: bool) -> tuple[bool, str]:
        """(granted, why not). A grant of ``activate`` changes the book: persist it before answering."""
        known, promisee = self.promised.get(request.node_id, (0, ""))
        if request.kind == WITHDRAW:
            return self._withdraw(request, known, promisee)
        if request.kind == STAY:
            why = self._stay_refusal(request, known, promisee)
            if why:
                return False, why
            self._raise_fresh(request.node_id, request.epoch)  # it serves at this epoch
            if (known, promisee) == (request.epoch, request.candidate) and promisee:
                self.won[request.node_id] = known  # the winner of the vote serves: no other copy may at this epoch
            return True, ""
        if known == request.epoch and promisee == request.candidate and request.candidate:
            return True, ""  # the same candidate asking again (an earlier round's answer was lost or too few)
        if request.epoch <= known:
            return False, f"epoch {known} was already promised"
        if request.data_epoch < (fresh := self.freshness(request.node_id)):
            return False, f"stale copy: data epoch {request.data_epoch}, the pair's is {fresh}"
        if primary_reachable:
            return False, "the primary is still reachable from this node"
        self.promised[request.node_id] = (request.epoch, request.candidate)
        self._raise_fresh(request.node_id, request.data_epoch)
        return True, ""

    def _withdraw(self, request: VoteRequest, known: int, promisee: str) -> tuple[bool, str]:
        """Forget the promise of ``request.epoch`` to ``request.candidate``, which lost that bid. The pair's
        data epoch stays: if it reached the promised epoch, another copy serves at it (the promise stands
        for "seen active"); else the promise goes as if never made (no other copy was promised it here)."""
        if not request.candidate or (known, promisee) != (request.epoch, request.candidate):
            return False, "no such promise"
        fresh = self.freshness(request.node_id)
        if fresh >= known:
            self.promised[request.node_id] = (known, "")
        elif fresh:
            self.promised[request.node_id] = (fresh, "")
        else:
            del self.promised[request.node_id]
        return True, ""

    @staticmethod
    def _stay_refusal(request: VoteRequest, known: int, promisee: str) -> str:
        """Why another copy may have served since the asking copy's data epoch ("" when none can have)."""
        epoch, data_epoch, candidate = request.epoch, request.data_epoch, request.candidate
        if known > epoch:
            return f"epoch {known} replaced epoch {data_epoch}"
        if known == epoch and promisee != candidate and (promisee or data_epoch < epoch):
            # Promised to another copy, or (a new epoch asked for) seen active: another copy has it.
            return f"epoch {known} was promised to {promisee}" if promisee else f"epoch {known} is active elsewhere"
        if data_epoch < known < epoch:
            return f"epoch {known} replaced epoch {data_epoch}"
        if known == data_epoch < epoch and promisee not in ("", candidate):
            return f"epoch {known} was won by {promisee}"
        return ""

    def standing(self, node_id: str, epoch: int, server: str = "") -> Standing:
        """How a node of pair ``node_id`` serving at ``epoch`` (the process ``server``, when it says) stands here.
        A promise of a newer epoch replaces it only with a sign that the promise was won: the promisee's commit
        raised the data epoch above ``epoch`` (a stay of this same node does not promise, so it never counts
        against it). So does a promise of this same epoch to another process that committed it (said it serves
        at it): a copy restarted while no voter answered takes its own epoch plus one, which may be the one its
        backup won meanwhile."""
        promised, promisee = self.promised.get(node_id, (0, ""))
        if epoch == promised and server and promisee not in ("", server) and self.won.get(node_id) == epoch:
            return Standing.REPLACED
        if epoch >= promised:
            return Standing.CURRENT
        if not promisee or self.freshness(node_id) > epoch:
            return Standing.REPLACED
        return Standing.OUTBID

    def observe(self, node_id: str, epoch: int) -> bool:
        """A node is active at ``epoch``; True when that raises what was known (persist it)."""
        changed = self._raise_fresh(node_id, epoch)
        if epoch > self.epoch(node_id):
            self.promised[node_id] = (epoch, "")
            return True
        return changed

    def _raise_fresh(self, node_id: str, epoch: int) -> bool:
        if epoch > self.freshness(node_id):
            self.fresh[node_id] = epoch
            return True
        return False

    def promisee(self, node_id: str) -> str:
        return self.promised.get(node_id, (0, ""))[1]

    def to_json(self) -> dict[str, list[Any]]:
        return {
            node_id: [*self.promised.get(node_id, (0, "")), self.freshness(node_id), self.won.get(node_id, 0)]
            for node_id in self.promised.keys() | self.fresh.keys() | self.won.keys()
        }

    @staticmethod
    def from_json(data: Any) -> VoteBook:
        if not isinstance(data, dict):
            raise ValueError("the vote book is a map")  # noqa: TRY004 - callers catch ValueError for any bad input
        promised: dict[str, tuple[int, str]] = {}
        fresh: dict[str, int] = {}
        won: dict[str, int] = {}
        for node_id, entry in data.items():
            if isinstance(entry, list) and 2 <= len(entry) < 4:
                entry = [*entry, 0, 0][:4]  # written before data epochs or commits were kept: nothing known yet
            if not (
                isinstance(entry, list)
                and len(entry) == 4
                and type(entry[0]) is int
                and isinstance(entry[1], str)
                and type(entry[2]) is int
                and type(entry[3]) is int
            ):
                raise ValueError(f"malformed vote book entry for {node_id!r}")
            if entry[0] or entry[1]:  # an entry may carry only a data epoch
                promised[node_id] = (entry[0], entry[1])
            if entry[2]:
                fresh[node_id] = entry[2]
            if entry[3]:
                won[node_id] = entry[3]
        return VoteBook(promised, fresh, won)
