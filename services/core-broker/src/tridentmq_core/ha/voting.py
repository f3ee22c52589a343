"""Quorum votes, the asyncio shell around ``votes.py``: on every active clustered node, ``Voter`` answers VOTE
requests and keeps its promises on disk; ``ask_votes`` asks the voters; ``primary_may_activate`` is a
primary's vote at start."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from tridentmq_core.checks import BrokerError
from tridentmq_core.ha.pair import HA_STATE_FILE, VOTES_FILE, BackupState, ClusterView, record_epoch
from tridentmq_core.ha.votes import ACTIVATE, STAY, Standing, VoteBook, VoteRequest, restart_refusal
from tridentmq_core.node_links import node_link
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.files import write_durably
from tridentmq_core.store.identity import IdentityError, NodeIdentity
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.topology import parse_endpoint

log = logging.getLogger("tridentmq.core.ha")


VOTE_TIMEOUT: Final = 1.0
#: The client name of a node's short links that ask for votes or the cluster's members (then its name).
VOTE_LINK_PREFIX: Final = "vote:"


class VoteStore:
    """The voter's promises, on disk so a restarted voter keeps them."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / VOTES_FILE
        self.book = VoteBook()
        if self.path.exists():
            try:
                self.book = VoteBook.from_json(json.loads(self.path.read_text(encoding="utf-8")))
            except ValueError as exc:  # forgetting promises could elect two copies: refuse to start instead
                raise IdentityError(f"{self.path} is unreadable ({exc}); restore it or remove it knowingly") from None

    def save(self) -> None:
        write_durably(self.path, json.dumps(self.book.to_json()))


class Voter:
    """Answers VOTE requests of backups (``activate``) and of primaries that lost their backup (``stay``)."""

    def __init__(self, votes: VoteStore, settings: CoreSettings, cluster: Callable[[], ClusterView | None]) -> None:
        self.votes = votes
        self.settings = settings
        self._cluster = cluster

    def primary_reachable(self, node_id: str) -> bool:
        cluster = self._cluster()
        return cluster is not None and cluster.reachable(node_id, self.settings.ha.vote_grace_ms / 1000)

    def vote(self, session: Session, raw: dict[str, Any]) -> dict[str, Any]:
        try:
            request = VoteRequest.from_wire(raw)
        except ValueError as exc:
            raise BrokerError(ErrorCode.INVALID, str(exc)) from None
        book = self.votes.book
        before = book.promised.get(request.node_id), book.freshness(request.node_id), book.won.get(request.node_id)
        cluster = self._cluster()
        if cluster is not None and request.node_id == cluster.node_id and request.kind == ACTIVATE:
            granted, why = False, "this node is that pair's active copy"
        else:
            granted, why = book.decide(request, primary_reachable=self.primary_reachable(request.node_id))
        if (
            book.promised.get(request.node_id),
            book.freshness(request.node_id),
            book.won.get(request.node_id),
        ) != before:
            self.votes.save()  # the promise is on disk before the candidate hears of it
        # Refusals repeat every vote round of a candidate: only grants are worth a line at INFO.
        (log.info if granted else log.debug)(
            "vote",
            extra={
                "kind": request.kind,
                "pair": request.node_id,
                "epoch": request.epoch,
                "candidate": request.candidate,
                "granted": granted,
                "reason": why,
                "peer": session.peer,
            },
        )
        return {
            "granted": granted,
            "voter": cluster.node_id if cluster is not None else "",  # the pair whose vote this is
            "pairs": 1 + len(cluster.member_endpoints()) if cluster is not None else 0,  # the pairs it heard of
            "reason": why,
            "epoch": book.epoch(request.node_id),
            "promisee": book.promisee(request.node_id),
            "fresh": book.freshness(request.node_id),
        }

    def observe(self, node_id: str, epoch: int, server: str = "") -> Standing:
        """A node is active at ``epoch``: recorded when it is current, else how it stands (``VoteBook.standing``)."""
        standing = self.votes.book.standing(node_id, epoch, server)
        if standing is Standing.CURRENT and self.votes.book.observe(node_id, epoch):
            self.votes.save()
        return standing


async def primary_may_activate(settings: CoreSettings, identity: NodeIdentity, server_id: str) -> tuple[bool, str]:
    """Whether a node configured as primary may serve at start: its data must be whole (not a copy cut
    short) and no voter may know a newer epoch of its pair (its backup took over meanwhile)."""
    state_path = identity.data_dir / HA_STATE_FILE
    state = BackupState.load(state_path)
    if state_path.exists() and not state.in_sync:
        return False, "its data is an unfinished copy"
    if state_path.exists() and not state.activated:
        # The node it copied holds this epoch and may still serve: only a vote for a new epoch (a backup's
        # takeover) may make this copy active again, never a restart with the same epoch.
        return False, f"its data is a copy of the pair's active node at epoch {state.epoch}"
    voters = list(dict.fromkeys([*(parse_endpoint(c) for c in settings.cluster.connectors), *state.members.values()]))
    # A restart serves at a new epoch: the backup's copy may be of the last life, and writes confirmed in this
    # one before it copies again must make that copy stale (a brand-new node has no copy anywhere).
    epoch = identity.epoch if identity.first_start else identity.epoch + 1
    request = VoteRequest(STAY, identity.node_id, epoch, server_id, identity.epoch)
    answers = [a for a in await ask_votes(settings, voters, request) if a is not None]
    # A copy that was a backup once counted the pairs then (its HA state); else every answer must agree.
    pairs = state.pairs if state_path.exists() else 0
    why = restart_refusal(answers, node_id=identity.node_id, own_epoch=identity.epoch, pairs=pairs)
    if why:
        return False, why
    record_epoch(identity, epoch)
    return True, ""


async def ask_votes(
    settings: CoreSettings,
    voters: list[tuple[str, int]],
    request: VoteRequest,
) -> list[dict[str, Any] | None]:
    """Every voter's answer (None: it did not answer in time), each over a short link of its own."""
    return list(await asyncio.gather(*(_vote_at(settings, host, port, request) for host, port in voters)))


async def _vote_at(settings: CoreSettings, host: str, port: int, request: VoteRequest) -> dict[str, Any] | None:
    client = node_link(settings, host, port, VOTE_LINK_PREFIX + settings.node.name, connect_timeout=VOTE_TIMEOUT)
    try:
        await client.connect()
        return await asyncio.wait_for(client.vote(request.to_wire()), VOTE_TIMEOUT)
    except (LinkRequestError, OSError, TimeoutError):
        return None
    finally:
        await client.close()
