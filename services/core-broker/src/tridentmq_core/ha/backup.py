"""A backup: ``BackupRunner`` finds its primary among the connectors, copies its journal into a fresh journal of
its own (acknowledging what is on disk), and when the primary is lost while in sync, asks the other primaries
for their votes; with a majority it takes the pair's node id and a new epoch and activates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tridentmq_core.ha.pair import HA_STATE_FILE, BackupState
from tridentmq_core.ha.votes import ACTIVATE, STAY, WITHDRAW, Bids, VoteRequest, answer_int, quorum
from tridentmq_core.ha.voting import VOTE_LINK_PREFIX, VOTE_TIMEOUT, ask_votes
from tridentmq_core.node_links import node_link, watch_close
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.identity import NodeIdentity
from tridentmq_core.store.journal import Journal, list_segments
from tridentmq_core.store.records import MAGIC, RecordType, flaw
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.peer import PeerLink
from tridentmq_shared.link.topology import parse_endpoint
from tridentmq_shared.runtime import cancel_and_wait
from tridentmq_shared.supervision import spawn

log = logging.getLogger("tridentmq.core.ha")


class BackupRunner:
    """A backup: copy the primary's journal, and take over when it is lost and a quorum agrees."""

    def __init__(
        self,
        settings: CoreSettings,
        identity: NodeIdentity,
        server_id: str,
        journal_dir: Path,
        advertise: tuple[str, int],
        call_in_loop: Callable[[Callable[[], None]], None],
        activate: Callable[[], Awaitable[None]],
        isolated: Callable[[], bool],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.settings = settings
        self.advertise = advertise  # this node's link endpoint, where clients find it once it is active
        self.identity = identity
        self.server_id = server_id
        self.journal_dir = journal_dir
        self._call_in_loop = call_in_loop
        self._activate = activate
        self._isolated = isolated  # the network check's verdict: an isolated backup never takes over
        self._fail = fail  # ends the process (exit status 70), as a failed task does
        self.state_path = identity.data_dir / HA_STATE_FILE
        # A whole copy from an earlier run may take over when no copy of the pair is active (both halves
        # restarted); votes make sure it is the freshest one.
        self.state = BackupState.load(self.state_path)
        self.primary = ""  # host:port of the primary being copied
        self.reason = "looking for the primary"
        self.journal: Journal | None = None
        self.client: PeerLink | None = None
        self._offset = 0  # primary record number = local record number + offset
        self._expected = 0
        self._sync_end = 0
        self._compacted_at = 0  # local number of the last compaction's COMPACTED record, until it is synced
        self._compaction_roll = 0  # the roll that started that compaction: the segments before it go then
        self._early: list[ev.ReplicaRecords] = []  # records that came before the answer to REPLICATE
        self.handed_over = False  # the active copy handed the pair over (failback): take over without a vote
        self.bids = Bids.kept(self.state.bids)  # what it asks for, and the lost bids it withdraws (earlier ones too)
        self._logged: set[str] = set()  # reasons logged since the last copy started
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = spawn(self._run(), "ha-backup")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await self._close_link()
        self._close_journal()

    def status(self) -> dict[str, Any]:
        return {"primary": self.primary, "in_sync": self.state.in_sync, "state": self.reason, "pairs": self.state.pairs}

    # ------------------------------------------------------------------ the loop
    def _candidates(self) -> list[tuple[str, int]]:
        seen: list[tuple[str, int]] = []
        for endpoint in [*(parse_endpoint(c) for c in self.settings.cluster.connectors), *self.state.members.values()]:
            if endpoint not in seen:
                seen.append(endpoint)
        return seen

    async def _run(self) -> None:
        cluster = self.settings.cluster
        delay = cluster.retry_interval_ms / 1000
        while True:
            for host, port in self._candidates():
                self.primary = ""
                copied = await self._copy_from(host, port)
                if self.primary:  # it had a copy going: look again quickly
                    delay = cluster.retry_interval_ms / 1000
                if copied and await self._take_over((host, port)):
                    return
            if self.state.in_sync and await self._take_over(None):
                return  # no copy of the pair is active anywhere, and this one is the freshest
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # noqa: S311 - jitter: two copies may both ask
            delay = min(delay * cluster.retry_multiplier, cluster.max_retry_interval_ms / 1000)

    async def _copy_from(self, host: str, port: int) -> bool:
        """Copy the primary at ``host:port`` until the link ends; True when it ended with the copy whole."""
        self._close_journal()  # an earlier copy's: what arrives from here on belongs to this link's copy
        client = node_link(self.settings, host, port, f"backup:{self.settings.node.name}", connect_timeout=1.0)
        closed, why = watch_close(client)
        client.on_replica = lambda event: self._records(client, event)
        # Follow the cluster's members: they are the voters, their count sets the quorum, and among them is
        # the pair's active copy wherever it moved (asking every node we reach is how a backup finds it).
        client.on_topology = lambda update: self._learn(update.get("members"))
        self.client = client
        self._early.clear()
        try:
            await client.connect()
            with contextlib.suppress(LinkRequestError):
                self._learn((await client.topology({})).get("members"))
            reply = await client.replicate(
                {
                    "group": self.settings.ha.group_name,
                    "server_id": self.server_id,
                    "epoch": self.identity.epoch,
                    "activated": self.state.activated,
                    "host": self.advertise[0],
                    "port": self.advertise[1],
                    "role": self.settings.ha.role,
                }
            )
        except LinkRequestError as exc:
            if exc.code in (ErrorCode.INVALID, ErrorCode.EXISTS, ErrorCode.UNAUTHENTICATED):
                # Another group's primary is a normal answer while looking; each refusal is logged once.
                self._note(f"{host}:{port} refused: {exc.text}", error=exc.code != ErrorCode.INVALID)
            await self._close_link()
            return False
        except (OSError, TimeoutError):
            await self._close_link()
            return False
        served = reply.get("epoch")
        if self.state.activated and (type(served) is not int or served <= self.state.epoch):
            # This copy served the pair at its epoch, by a quorum's vote: one at that epoch or an older one
            # took it without (a restart no voter answered). Copying it would wipe the fresher data.
            self._note(f"{host}:{port} serves at epoch {served}, not after this copy's {self.state.epoch}: not copied")
            await self._close_link()
            return False
        self.primary = f"{host}:{port}"
        self._logged.clear()
        self._start_copy(reply)
        withdrawing = spawn(self._withdraw_bids(self.state.node_id), "ha-withdraw") if self.bids.pending else None
        try:
            await closed.wait()
        finally:
            await cancel_and_wait(withdrawing)
        self.client = None
        in_sync = self.state.in_sync
        self.handed_over = bool(in_sync and why and why[0].code == ErrorCode.FAILBACK)
        if self.handed_over:
            log.warning("failback: the active copy handed the pair back", extra={"from": self.primary})
            return True
        log.warning("primary lost", extra={"primary": self.primary, "in_sync": in_sync})
        self.reason = "primary lost" + ("" if in_sync else " before the copy was whole")
        return in_sync

    def _start_copy(self, reply: dict[str, Any]) -> None:
        node_id, epoch = str(reply.get("node_id", "")), int(reply.get("epoch", 0))
        self._learn(reply.get("members"))
        # Not in sync, on disk, before the old copy is wiped: a crash from here on never activates.
        self.state = BackupState(
            node_id, epoch, in_sync=False, members=self.state.members, pairs=self.state.pairs, bids=self.state.bids
        )
        self.state.save(self.state_path)
        self.identity.adopt(node_id, epoch)
        self._close_journal()
        for path in list_segments(self.journal_dir):
            path.unlink()
        journal = Journal(self.journal_dir, segment_bytes=self.settings.journal.segment_bytes)
        journal.recover()
        journal.on_synced = lambda upto: self._call_in_loop(lambda: self._synced(journal, upto))
        journal.on_error = lambda: self._call_in_loop(lambda: self._journal_failed(journal))
        journal.start()
        self.journal = journal
        self._offset = self._expected = self._sync_end = self._compacted_at = self._compaction_roll = 0
        self.reason = "copying"
        early, self._early = self._early, []
        for event in early:
            if self.client is not None:
                self._records(self.client, event)
        log.info("copying the primary's journal", extra={"primary": self.primary, "node_id": node_id, "epoch": epoch})

    def _learn(self, members: Any) -> None:
        known = dict(self.state.members)
        for item in members or []:
            if isinstance(item, dict) and isinstance(item.get("node_id"), str):
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    known[item["node_id"]] = (str(item["host"]), int(item["port"]))
        pairs = max(self.state.pairs, len(known))
        if known != self.state.members or pairs != self.state.pairs:
            self.state.members, self.state.pairs = known, pairs
            self.state.save(self.state_path)

    def _records(self, client: PeerLink, event: ev.ReplicaRecords) -> None:
        journal = self.journal
        if client is not self.client:
            return  # a late batch of an earlier link
        if journal is None:  # the first records can arrive in the same read as the answer to REPLICATE
            self._early.append(event)
            return
        if not self._expected:
            self._offset = event.first - 1
            self._expected = event.first
        if event.epoch != self.state.epoch or event.first != self._expected:
            log.error(
                "replication stream out of order: copying again",
                extra={"epoch": event.epoch, "first": event.first, "expected": self._expected},
            )
            spawn(client.close(), "ha-backup-close")
            return
        if event.records:
            number, rolls = journal.appended, journal.rolls
            for data in event.records:
                if not data:
                    rolls += 1  # numbered as ``append_encoded`` numbers it
                    continue
                reason = flaw(data) or (
                    f"{len(data)} bytes do not fit this node's journal.segment_bytes ({journal.segment_bytes}): "
                    "set it as large as the primary's"
                    if len(data) > journal.segment_bytes
                    else None
                )
                if reason is not None:  # written, it would stop this copy's recovery when it takes over
                    log.error("replication stream record refused: copying again", extra={"reason": reason})
                    spawn(client.close(), "ha-backup-close")
                    return
                number += 1
                if data[0] == MAGIC and data[1] == RecordType.COMPACTED:
                    # Once it is on disk, the segments before this compaction's roll go: not those before
                    # the last roll written, which may be the next compaction's, whose copy is not whole yet.
                    self._compacted_at, self._compaction_roll = number, rolls
            journal.append_encoded(event.records)
            self._expected = number + self._offset + 1
        if event.sync_end:
            self._sync_end = event.sync_end
            if journal.synced + self._offset >= event.sync_end:
                self._synced(journal, journal.synced)

    def _synced(self, journal: Journal, upto: int) -> None:
        client = self.client
        if client is None or not upto or journal is not self.journal:
            return  # nothing to tell, or the sync of an earlier copy's journal
        primary_upto = upto + self._offset
        client.replica_ack(primary_upto)
        if self._compacted_at and upto >= self._compacted_at:
            self._compacted_at = 0
            journal.retire_before_roll(self._compaction_roll)  # as the primary did after the same compaction
        if not self.state.in_sync and self._sync_end and primary_upto >= self._sync_end:
            self.state.in_sync = True
            self.state.save(self.state_path)
            self.reason = "in sync"
            log.info("in sync with the primary: ready to take over", extra={"primary": self.primary})

    def _journal_failed(self, journal: Journal) -> None:
        """This copy's journal cannot write: fail the node (exit 70), as a primary does on a failed fsync.
        Its writer acknowledged nothing it did not sync, but a backup that stayed would still say "in sync"
        and could take over with a dead journal; and each fresh copy would fail again, dropped by the primary
        after the heartbeat timeout and costing the pair a new epoch every time. Crash-only: the primary goes
        on as without a backup, and the restarted backup copies afresh (its old copy, stale by then, is
        wiped, which also frees its disk). A full disk ends it too: a copy is written afresh anyway."""
        error = journal.fatal or journal.error
        if journal is not self.journal or error is None:
            return  # an earlier copy's journal, or space came back meanwhile
        log.critical("the backup's journal cannot write: stopping", extra={"reason": str(error)})
        self._fail("backup journal", error)

    # ------------------------------------------------------------------ takeover
    async def _take_over(self, primary: tuple[str, int] | None) -> bool:
        """Vote rounds until a quorum lets this copy activate (True), or the lost ``primary`` answers again.
        Without a primary (none found active), one round only."""
        ha = self.settings.ha
        node_id, data_epoch = self.state.node_id, self.state.epoch
        epoch = self.bids.epoch_for(data_epoch)
        while not self.handed_over:
            if self._isolated():
                self._note("cut off from the network (network check): not taking over")
                if primary is None or await self._primary_back(*primary):
                    return False
                await asyncio.sleep(ha.vote_retry_ms / 1000)
                continue
            await self._refresh_members(node_id)  # the voters' addresses may have moved since the loss
            voters = [endpoint for member, endpoint in self.state.members.items() if member != node_id]
            needed = quorum(self.state.pairs)
            if not voters and ha.activate_without_quorum:
                log.warning("taking over without a quorum (ha.activate_without_quorum)")
                break
            request = VoteRequest(ACTIVATE, node_id, epoch, self.server_id, data_epoch)
            self.bids.asked(epoch, self.server_id)
            self._keep_bids()
            answers = [a for a in await ask_votes(self.settings, voters, request) if a is not None]
            grants = sum(1 for a in answers if a.get("granted") is True)
            stale = max((answer_int(a, "fresh") for a in answers), default=0) > data_epoch
            if voters and grants >= needed and not stale:
                log.info("quorum reached", extra={"votes": grants, "pairs": self.state.pairs, "epoch": epoch})
                # Commit before serving: a majority must still hold this epoch for this copy. A voter that
                # grants the commit knows the pair serves at ``epoch`` and refuses any copy older than that;
                # one that promised a higher epoch to another copy meanwhile refuses it, and that copy, not
                # this one, may activate. Two majorities share a voter, so never both.
                commit = VoteRequest(STAY, node_id, epoch, self.server_id)
                answers = [a for a in await ask_votes(self.settings, voters, commit) if a is not None]
                grants = sum(1 for a in answers if a.get("granted") is True)
                if grants >= needed:
                    break
                log.warning("epoch won but not committed: asking again", extra={"epoch": epoch, "votes": grants})
                if grants:
                    # Those voters now refuse copies older than ``epoch``. Nobody else can have served at it
                    # (a majority promised it to this copy) and this copy wrote nothing at it, so its data
                    # is whole at ``epoch``: say so, or both copies would be stale against a phantom.
                    data_epoch = self.state.epoch = epoch
                    self.state.activated = False
                    self.state.save(self.state_path)
            fresh = max((answer_int(a, "fresh") for a in answers), default=0)
            if fresh > data_epoch:
                self._note(
                    f"the pair was active at epoch {fresh}, newer than this copy's {data_epoch}: "
                    "copying the active node"
                )
                self.state.in_sync = False  # only a copy of the active node is whole from now on
                self.state.save(self.state_path)
                return False
            promised = max((answer_int(a, "epoch") for a in answers if a.get("granted") is not True), default=0)
            if promised >= epoch and len(answers) >= needed:
                # Another copy of this pair asked for this epoch or a higher one, and the votes split: ask
                # above them, after a random pause so the two do not split again. Safe, since a copy
                # serves only once a majority committed its epoch, and then any majority of answers
                # includes a voter that refuses this copy as stale. (With fewer answers, a committed
                # epoch could hide among the silent: bidding above it would fence the serving copy.)
                self.bids.outbid(promised)
                epoch = self.bids.epoch_for(data_epoch)
            lost = "primary lost" if primary else "no active copy"
            self.reason = f"{lost}: {grants} of {needed} votes (pairs: {self.state.pairs})"
            if primary is None or await self._primary_back(*primary):
                return False
            await asyncio.sleep(ha.vote_retry_ms / 1000 * random.uniform(0.5, 1.5))  # noqa: S311 - jitter
        self._close_journal()
        self.identity.set_epoch(epoch)
        self.state.epoch, self.state.activated = epoch, True
        self.state.bids = []  # won: nothing to withdraw
        self.state.save(self.state_path)
        self.reason = "active"
        log.warning("backup activated", extra={"node_id": node_id, "epoch": epoch})
        await self._activate()
        return True

    async def _withdraw_bids(self, node_id: str) -> None:
        """This copy lost its bids and copies the pair's active node: the voters forget their promises to it,
        which would otherwise keep that node out of their cluster connections and refuse its restart. Asked
        again while a voter does not answer, as long as the copy goes on."""
        bids = self.bids.withdrawing()
        while bids:
            voters = [endpoint for member, endpoint in self.state.members.items() if member != node_id]
            for epoch, candidate in list(bids):
                request = VoteRequest(WITHDRAW, node_id, epoch, candidate)
                answers = await ask_votes(self.settings, voters, request)
                if all(answer is not None for answer in answers):
                    granted = sum(1 for answer in answers if answer is not None and answer.get("granted") is True)
                    log.info("lost bid withdrawn", extra={"epoch": epoch, "voters": len(voters), "forgotten": granted})
                    self.bids.withdrawn((epoch, candidate))
                    bids.remove((epoch, candidate))
                    self._keep_bids()
            if bids:
                await asyncio.sleep(self.settings.cluster.max_retry_interval_ms / 1000)

    def _keep_bids(self) -> None:
        """The bids to withdraw, on disk: a backup restarted before it withdrew them still does."""
        bids = self.bids.to_state()
        if bids != self.state.bids:
            self.state.bids = bids
            self.state.save(self.state_path)

    async def _refresh_members(self, own_node_id: str) -> None:
        """Learn the cluster's members from the first active node that answers: a voter may have failed over
        (or failed back) to another address since this backup last heard from its primary."""
        endpoints = [e for n, e in self.state.members.items() if n != own_node_id]
        endpoints += [parse_endpoint(c) for c in self.settings.cluster.connectors]
        asking = [asyncio.ensure_future(self._members_at(*e)) for e in dict.fromkeys(endpoints)]
        try:
            for answer in asyncio.as_completed(asking):  # the first active node to answer is enough
                members = await answer
                if members is not None:
                    self._learn([m for m in members if isinstance(m, dict) and m.get("node_id") != own_node_id])
                    return
        finally:
            for task in asking:
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)  # their links are closed before going on

    async def _members_at(self, host: str, port: int) -> list[Any] | None:
        name = VOTE_LINK_PREFIX + self.settings.node.name
        client = node_link(self.settings, host, port, name, connect_timeout=VOTE_TIMEOUT)
        try:
            await client.connect()
            members = (await asyncio.wait_for(client.topology({}), VOTE_TIMEOUT)).get("members")
        except (LinkRequestError, OSError, TimeoutError):
            return None
        except Exception:  # another node's answer is input: one odd answer must not end the backup's task
            log.exception("unexpected answer to a topology request", extra={"node": f"{host}:{port}"})
            return None
        finally:
            await client.close()
        return members if isinstance(members, list) else None

    async def _primary_back(self, host: str, port: int) -> bool:
        """Whether the lost primary completes a handshake again (a paused or dead one cannot): then it is
        copied afresh, not replaced."""
        client = node_link(self.settings, host, port, f"backup:{self.settings.node.name}", connect_timeout=0.3)
        try:
            await client.connect()
        except (LinkRequestError, OSError, TimeoutError):
            return False
        finally:
            await client.close()
        log.info("the primary answers again: copying it afresh", extra={"primary": f"{host}:{port}"})
        return True

    # ------------------------------------------------------------------ helpers
    def _note(self, reason: str, *, error: bool = False) -> None:
        """Say why the backup is not copying or taking over: in its status always, in the log once."""
        if reason not in self._logged:
            self._logged.add(reason)
            (log.error if error else log.warning)("backup", extra={"state": reason})
        self.reason = reason

    def _close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    async def _close_link(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
