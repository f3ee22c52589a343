"""Quorum votes on which copy of a pair is active: the quorum size, the wire form of a request, and the
voter's book of promises (refusals while the primary is reachable, epoch fencing, idempotent re-asks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_core.ha.pair import BackupState
from tridentmq_core.ha.votes import (
    ACTIVATE,
    STAY,
    WITHDRAW,
    Bids,
    Standing,
    VoteBook,
    VoteRequest,
    quorum,
    restart_refusal,
)

PAIR = "node-a"


def activate(epoch: int, candidate: str = "backup-1", node_id: str = PAIR, data: int = 0) -> VoteRequest:
    """A copy at data epoch ``data`` (by default ``epoch`` - 1: its first request) asking for ``epoch``."""
    return VoteRequest(ACTIVATE, node_id, epoch, candidate, data)


def stay(epoch: int, node_id: str = PAIR) -> VoteRequest:
    return VoteRequest(STAY, node_id, epoch, node_id)


# ---------------------------------------------------------------------------------------------------- quorum
@pytest.mark.parametrize(("pairs", "needed"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4)])
def test_quorum_is_a_strict_majority(pairs: int, needed: int) -> None:
    assert quorum(pairs) == needed


@given(st.integers(min_value=1, max_value=10_000))
def test_two_quorums_of_the_same_pairs_always_overlap(pairs: int) -> None:
    needed = quorum(pairs)
    assert needed <= pairs  # reachable when every pair answers
    assert 2 * needed > pairs  # two disjoint groups of voters cannot both reach it
    assert 2 * (needed - 1) <= pairs  # and it is the smallest such number


# ---------------------------------------------------------------------------------------------------- wire form
@pytest.mark.parametrize("kind", [ACTIVATE, STAY, WITHDRAW])
def test_a_request_round_trips_through_its_wire_form(kind: str) -> None:
    request = VoteRequest(kind, PAIR, 7, "server-2")
    wire = request.to_wire()
    assert wire == {
        "kind": kind,
        "node_id": PAIR,
        "epoch": 7,
        "candidate": "server-2",
        "data_epoch": 7 if kind == STAY else 6,
    }
    assert VoteRequest.from_wire(wire) == request
    # and through JSON / msgpack-like plain data, as it travels
    assert VoteRequest.from_wire(json.loads(json.dumps(wire))) == request


def test_from_wire_ignores_unknown_keys_and_accepts_an_empty_candidate() -> None:
    wire: dict[str, Any] = {"kind": STAY, "node_id": PAIR, "epoch": 1, "candidate": "", "extra": [1, 2]}
    assert VoteRequest.from_wire(wire) == VoteRequest(STAY, PAIR, 1, "")


GOOD: dict[str, Any] = {"kind": ACTIVATE, "node_id": PAIR, "epoch": 3, "candidate": "backup-1"}
MALFORMED_FIELDS: list[tuple[str, Any]] = [
    ("kind", None),
    ("kind", "ACTIVATE"),  # case matters
    ("kind", "promote"),
    ("kind", 1),
    ("node_id", None),
    ("node_id", ""),
    ("node_id", 5),
    ("node_id", b"node-a"),
    ("epoch", None),
    ("epoch", 0),
    ("epoch", -1),
    ("epoch", True),  # a bool is not an epoch, although it is an int subclass
    ("epoch", 3.0),
    ("epoch", "3"),
    ("candidate", None),
    ("candidate", 1),
    ("candidate", b"backup-1"),
    ("data_epoch", None),
    ("data_epoch", -1),
    ("data_epoch", 4),  # above the epoch asked for
    ("data_epoch", True),
    ("data_epoch", "2"),
]


@pytest.mark.parametrize(("field", "value"), MALFORMED_FIELDS)
def test_from_wire_refuses_a_field_of_the_wrong_shape(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match="malformed vote request"):
        VoteRequest.from_wire({**GOOD, field: value})


@pytest.mark.parametrize("field", sorted(GOOD))
def test_from_wire_refuses_a_missing_field(field: str) -> None:
    item = {k: v for k, v in GOOD.items() if k != field}
    with pytest.raises(ValueError, match="malformed vote request"):
        VoteRequest.from_wire(item)


@pytest.mark.parametrize("item", [None, [], [ACTIVATE, PAIR, 3, "b"], "activate", 3, (("kind", ACTIVATE),)])
def test_from_wire_refuses_anything_but_a_map(item: Any) -> None:
    with pytest.raises(ValueError, match="a vote request is a map"):
        VoteRequest.from_wire(item)


def test_from_wire_keeps_the_error_message_short() -> None:
    with pytest.raises(ValueError, match="malformed vote request") as caught:
        VoteRequest.from_wire({**GOOD, "epoch": 0, "candidate": "x" * 10_000})
    assert len(str(caught.value)) < 200


# ---------------------------------------------------------------------------------------------------- activate
def test_activate_is_granted_when_the_primary_is_unreachable_and_promises_the_epoch() -> None:
    book = VoteBook()
    assert book.epoch(PAIR) == 0
    assert book.decide(activate(1), primary_reachable=False) == (True, "")
    assert book.promised == {PAIR: (1, "backup-1")}
    assert book.epoch(PAIR) == 1


def test_activate_is_refused_while_the_primary_is_reachable_and_promises_nothing() -> None:
    book = VoteBook()
    granted, why = book.decide(activate(1), primary_reachable=True)
    assert not granted
    assert "reachable" in why
    assert book.promised == {}
    # a later round, once this voter lost the primary too, is granted
    assert book.decide(activate(1), primary_reachable=False) == (True, "")


@pytest.mark.parametrize("epoch", [1, 4, 5])
def test_activate_is_refused_for_an_epoch_not_above_the_promised_one(epoch: int) -> None:
    book = VoteBook({PAIR: (5, "backup-1")})
    granted, why = book.decide(activate(epoch, "backup-2"), primary_reachable=False)
    assert not granted
    assert "epoch 5 was already promised" in why
    assert book.promised == {PAIR: (5, "backup-1")}


def test_activate_above_the_promised_epoch_is_granted_and_replaces_the_promise() -> None:
    book = VoteBook({PAIR: (5, "backup-1")})
    assert book.decide(activate(6, "backup-2"), primary_reachable=False) == (True, "")
    assert book.promised == {PAIR: (6, "backup-2")}


def test_the_same_candidate_asking_again_for_the_same_epoch_is_granted_again() -> None:
    book = VoteBook()
    assert book.decide(activate(3, "backup-1"), primary_reachable=False) == (True, "")
    for _ in range(3):  # an earlier answer was lost, or too few voters granted: it asks again
        assert book.decide(activate(3, "backup-1"), primary_reachable=False) == (True, "")
    # the promise stands even if this voter now reaches the primary again: it was already made
    assert book.decide(activate(3, "backup-1"), primary_reachable=True) == (True, "")
    assert book.promised == {PAIR: (3, "backup-1")}


def test_a_different_candidate_for_the_same_epoch_is_refused() -> None:
    book = VoteBook()
    assert book.decide(activate(3, "backup-1"), primary_reachable=False) == (True, "")
    granted, why = book.decide(activate(3, "backup-2"), primary_reachable=False)
    assert not granted
    assert "already promised" in why
    assert book.promised == {PAIR: (3, "backup-1")}


def test_the_same_candidate_is_refused_an_epoch_below_its_promise() -> None:
    book = VoteBook({PAIR: (3, "backup-1")})
    granted, _ = book.decide(activate(2, "backup-1"), primary_reachable=False)
    assert not granted
    assert book.promised == {PAIR: (3, "backup-1")}


def test_an_empty_candidate_is_never_taken_for_the_promisee_of_an_observed_epoch() -> None:
    """``observe`` records an epoch with no promisee (""): a request with an empty candidate must not pass
    as "the same candidate asking again"."""
    book = VoteBook()
    book.observe(PAIR, 4)
    granted, _ = book.decide(activate(4, ""), primary_reachable=False)
    assert not granted
    assert book.promised == {PAIR: (4, "")}


def test_promises_are_kept_per_pair() -> None:
    book = VoteBook()
    assert book.decide(activate(2, "b-a", node_id="node-a"), primary_reachable=False)[0]
    assert book.decide(activate(1, "b-b", node_id="node-b"), primary_reachable=False)[0]
    assert not book.decide(activate(2, "other", node_id="node-a"), primary_reachable=False)[0]
    assert book.promised == {"node-a": (2, "b-a"), "node-b": (1, "b-b")}
    assert book.epoch("node-c") == 0


# ---------------------------------------------------------------------------------------------------- stay
@pytest.mark.parametrize("reachable", [False, True])
def test_stay_is_granted_when_no_higher_epoch_was_promised(reachable: bool) -> None:
    book = VoteBook()
    assert book.decide(stay(1), primary_reachable=reachable) == (True, "")
    assert book.promised == {}  # a stay promises nothing
    book = VoteBook({PAIR: (4, "")})
    assert book.decide(stay(4), primary_reachable=reachable) == (True, "")
    assert book.decide(stay(9), primary_reachable=reachable) == (True, "")
    assert book.promised == {PAIR: (4, "")}


@pytest.mark.parametrize("reachable", [False, True])
def test_stay_is_refused_once_a_higher_epoch_was_promised(reachable: bool) -> None:
    book = VoteBook()
    assert book.decide(activate(5, "backup-1"), primary_reachable=False)[0]  # the backup took over at 5
    granted, why = book.decide(stay(4), primary_reachable=reachable)
    assert not granted
    assert why == "epoch 5 replaced epoch 4"
    assert book.promised == {PAIR: (5, "backup-1")}


def test_stay_is_refused_after_a_higher_epoch_was_observed() -> None:
    book = VoteBook()
    book.observe(PAIR, 3)
    assert not book.decide(stay(2), primary_reachable=True)[0]
    assert book.decide(stay(3), primary_reachable=True)[0]


def test_a_stay_and_an_activate_for_one_pair_cannot_both_win_at_one_voter() -> None:
    """The backup asks to activate at epoch e + 1 while the primary asks to stay at e: once a voter
    granted the activation, it refuses the stay."""
    book = VoteBook({PAIR: (1, "")})
    assert book.decide(activate(2, "backup-1"), primary_reachable=False)[0]
    assert not book.decide(stay(1), primary_reachable=False)[0]


# ---------------------------------------------------------------------------------------------------- observe
def test_observe_raises_what_is_known_and_reports_when_it_did() -> None:
    book = VoteBook()
    assert book.observe(PAIR, 2) is True
    assert book.promised == {PAIR: (2, "")}
    assert book.observe(PAIR, 2) is False
    assert book.observe(PAIR, 1) is False
    assert book.promised == {PAIR: (2, "")}
    assert book.observe(PAIR, 3) is True
    assert book.epoch(PAIR) == 3


def test_observe_of_the_promised_epoch_keeps_the_promisee() -> None:
    book = VoteBook()
    assert book.decide(activate(2, "backup-1"), primary_reachable=False)[0]
    assert book.observe(PAIR, 2) is True  # the promise is unchanged; the pair's data epoch rose to 2
    assert book.promised == {PAIR: (2, "backup-1")}
    # so the candidate asking again is still granted
    assert book.decide(activate(2, "backup-1"), primary_reachable=False) == (True, "")


# ---------------------------------------------------------------------------------------------------- standing
def test_a_node_of_the_promised_epoch_or_a_newer_one_is_current() -> None:
    book = VoteBook()
    assert book.standing(PAIR, 1) is Standing.CURRENT  # nothing known
    assert book.decide(activate(3, "backup-1", data=2), primary_reachable=False)[0]
    assert book.standing(PAIR, 3) is Standing.CURRENT
    assert book.standing(PAIR, 4) is Standing.CURRENT


def test_a_promise_alone_only_outbids_the_older_epoch() -> None:
    """A backup bid for epoch 3 here and may have lost (its primary only stood still): the primary, still at
    2, is kept out but not fenced; it comes back at a newer epoch if a quorum lets it go on."""
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(3, "backup-1"), primary_reachable=False)[0]
    assert book.standing(PAIR, 2) is Standing.OUTBID
    assert book.standing(PAIR, 1) is Standing.REPLACED  # 2 was seen active
    assert book.decide(going_on(3, 2), primary_reachable=True)[0] is False  # this voter refuses its stay
    assert book.standing(PAIR, 3) is Standing.CURRENT  # it went on at 3 with the others' grants: welcome


def test_a_commit_of_the_promised_epoch_replaces_the_older_one() -> None:
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(3, "backup-1"), primary_reachable=False)[0]
    assert book.decide(VoteRequest(STAY, PAIR, 3, "backup-1"), primary_reachable=False)[0]  # the winner commits
    assert book.standing(PAIR, 2) is Standing.REPLACED


def test_a_copy_at_the_epoch_another_process_won_and_served_at_is_replaced() -> None:
    """A primary restarted while no voter answered serves at its own epoch plus one: the epoch its backup won
    and served at meanwhile. Both copies at one epoch, the voters took the stale one for current, and the
    backup then copied it, dropping what it had confirmed. Told which process serves, a voter fences it."""
    book = VoteBook({PAIR: (1, "")}, {PAIR: 1})
    assert book.decide(activate(2, "backup-1", data=1), primary_reachable=False)[0]
    book.observe(PAIR, 2)  # the primary went on at 2 with a quorum's stays: seen active here
    assert book.standing(PAIR, 2, "primary-2") is Standing.CURRENT  # the bid's winner never said it serves
    assert book.decide(VoteRequest(STAY, PAIR, 2, "backup-1"), primary_reachable=False)[0]  # now it does
    assert book.standing(PAIR, 2, "backup-1") is Standing.CURRENT
    assert book.standing(PAIR, 2, "primary-2") is Standing.REPLACED
    assert book.standing(PAIR, 2) is Standing.CURRENT  # a node that does not say (an older one)
    assert book.standing(PAIR, 3, "primary-2") is Standing.CURRENT  # a newer epoch, granted by a quorum
    again = VoteBook.from_json(json.loads(json.dumps(book.to_json())))  # kept across a voter's restart
    assert again.standing(PAIR, 2, "primary-2") is Standing.REPLACED
    assert VoteBook.from_json({PAIR: [2, "backup-1", 2]}).standing(PAIR, 2, "primary-2") is Standing.CURRENT


def test_a_newer_epoch_seen_active_replaces_the_older_one() -> None:
    book = VoteBook()
    assert book.observe(PAIR, 4)
    assert book.standing(PAIR, 3) is Standing.REPLACED
    assert book.standing(PAIR, 4) is Standing.CURRENT


def test_a_bid_after_an_uncommitted_win_replaces_what_it_won_against() -> None:
    """A backup won epoch 3 at a majority but could not commit it, so it bids 4 with data epoch 3: no copy at
    2 can serve again (the majority refuses its stays), so such a copy is replaced."""
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(4, "backup-1", data=3), primary_reachable=False)[0]
    assert book.standing(PAIR, 2) is Standing.REPLACED
    assert book.standing(PAIR, 3) is Standing.OUTBID


def test_a_nodes_own_stay_never_counts_against_it() -> None:
    """A stay granted here that has no quorum yet raises the data epoch but promises nothing: the node, still
    at its old epoch, stays current here (the data epoch alone never fences)."""
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(going_on(3, 2), primary_reachable=True)[0]
    assert book.standing(PAIR, 2) is Standing.CURRENT


# ---------------------------------------------------------------------------------------------------- withdraw
def withdraw(epoch: int, candidate: str = "backup-1") -> VoteRequest:
    return VoteRequest(WITHDRAW, PAIR, epoch, candidate)


def test_a_withdrawn_promise_of_an_epoch_another_copy_serves_at_is_kept_as_seen() -> None:
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(3, "backup-1"), primary_reachable=False)[0]
    book.observe(PAIR, 3)  # the primary went on at 3 with the other voters' grants, and joined here
    assert book.decide(withdraw(3), primary_reachable=True) == (True, "")
    assert book.promised == {PAIR: (3, "")}
    assert book.decide(going_on(4, 3), primary_reachable=True) == (True, "")  # its restart is no longer refused


def test_a_withdrawn_promise_of_an_epoch_nobody_serves_at_goes() -> None:
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(3, "backup-1"), primary_reachable=False)[0]
    assert book.standing(PAIR, 2) is Standing.OUTBID
    assert book.decide(withdraw(3), primary_reachable=True) == (True, "")
    assert book.promised == {PAIR: (2, "")}
    assert book.standing(PAIR, 2) is Standing.CURRENT
    fresh = VoteBook()
    assert fresh.decide(activate(1, "backup-1", data=0), primary_reachable=False)[0]
    assert fresh.decide(withdraw(1), primary_reachable=True)[0]
    assert fresh.promised == {}


@pytest.mark.parametrize(
    "request_",
    [withdraw(3, "backup-2"), withdraw(2), withdraw(4), VoteRequest(WITHDRAW, PAIR, 3, "")],
    ids=["another candidate", "an older bid", "a newer epoch", "no candidate"],
)
def test_only_the_candidates_own_promise_of_that_epoch_is_withdrawn(request_: VoteRequest) -> None:
    """A late withdrawal of an older bid never cancels a later one of the same candidate."""
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(3, "backup-1"), primary_reachable=False)[0]
    assert book.decide(request_, primary_reachable=True) == (False, "no such promise")
    assert book.promised == {PAIR: (3, "backup-1")}


def test_a_backup_never_asks_again_for_an_epoch_it_withdraws() -> None:
    """A withdrawal may reach a voter late (a link held up, then delivered): it must never match the promise
    of a later bid of the same process, so every later bid asks above it, whatever its copy's data epoch."""
    bids = Bids()
    assert bids.epoch_for(2) == 3
    bids.asked(3, "backup-1")
    bids.outbid(4)  # split votes: ask above the other copy's promise
    assert bids.epoch_for(2) == 5
    bids.asked(5, "backup-1")
    assert bids.withdrawing() == [(3, "backup-1"), (5, "backup-1")]  # a voter may hold either promise
    assert bids.epoch_for(2) == 6
    assert bids.epoch_for(7) == 8
    bids.withdrawn((5, "backup-1"))
    assert bids.to_state() == [(3, "backup-1")]
    bids.withdrawn((3, "backup-1"))
    assert bids.withdrawing() == []
    # At a voter: the late withdrawal of 5 leaves the promise of the next bid, at 6, alone.
    book = VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert book.decide(activate(bids.epoch_for(2), "backup-1", data=2), primary_reachable=False)[0]
    assert book.decide(withdraw(5), primary_reachable=True) == (False, "no such promise")
    assert book.promised == {PAIR: (6, "backup-1")}


def test_a_restarted_backup_withdraws_the_bids_of_the_processes_before_it(tmp_path: Path) -> None:
    """The bids are kept in the copy's HA state until withdrawn. A new process (a new candidate id) bids above
    them, and a bid of its own does not push out an earlier one: it withdraws each with its own candidate."""
    state = BackupState(PAIR, 2, in_sync=True, bids=[(3, "backup-1-old")])
    state.save(tmp_path / "ha.json")
    bids = Bids.kept(BackupState.load(tmp_path / "ha.json").bids)
    assert bids.epoch_for(2) == 4
    bids.asked(4, "backup-1-new")  # the primary still unreachable: it bid again before it copied
    old, new = VoteBook({PAIR: (2, "")}, {PAIR: 2}), VoteBook({PAIR: (2, "")}, {PAIR: 2})
    assert old.decide(activate(3, "backup-1-old"), primary_reachable=False)[0]
    assert not old.decide(activate(4, "backup-1-new", data=2), primary_reachable=True)[0]  # it reached the primary
    assert new.decide(activate(4, "backup-1-new", data=2), primary_reachable=False)[0]
    state.bids = bids.to_state()
    state.save(tmp_path / "ha.json")  # both kept, as the process saves them before it asks
    assert BackupState.load(tmp_path / "ha.json").bids == [(3, "backup-1-old"), (4, "backup-1-new")]
    for book in (old, new):
        answers = [book.decide(withdraw(e, c), primary_reachable=True)[0] for e, c in bids.withdrawing()]
        assert answers.count(True) == 1
        assert book.promised == {PAIR: (2, "")}


@pytest.mark.parametrize(
    "raw",
    [None, "x", [[3, None]], [[-1, "x"]], [[0, "x"]], [[3]], [{"a": 1, "b": 2}], [[3, ""]], [[True, "x"]]],
)
def test_bids_in_an_ha_state_file_that_are_not_epoch_and_candidate_are_no_bids(tmp_path: Path, raw: Any) -> None:
    (tmp_path / "ha.json").write_text(json.dumps({"node_id": PAIR, "epoch": 2, "bids": raw}))
    assert BackupState.load(tmp_path / "ha.json").bids == []
    if isinstance(raw, list):  # beside a good one, only the bad entry goes
        (tmp_path / "ha.json").write_text(json.dumps({"node_id": PAIR, "epoch": 2, "bids": [*raw, [5, "b"]]}))
        assert BackupState.load(tmp_path / "ha.json").bids == [(5, "b")]


def test_an_ha_state_file_written_before_bids_were_kept_has_none(tmp_path: Path) -> None:
    (tmp_path / "ha.json").write_text(json.dumps({"node_id": PAIR, "epoch": 2, "in_sync": True}))
    assert BackupState.load(tmp_path / "ha.json").bids == []


def test_a_lost_bid_withdrawn_lets_the_primary_that_went_on_restart() -> None:
    """Three pairs: a (primary-1, backup-1), b, c. primary-1 stood still; backup-1 bid for epoch 2; c promised
    it, b refused (it still reached primary-1). primary-1 went on at 2 with b's grant and joined c (current
    there, the promise kept). Were it to restart now, never having been a backup, c's promise would refuse it
    and every answer must agree: the pair would serve nothing. Once backup-1 copies primary-1 again and
    withdraws its bid, the restart is granted by both."""
    b, c = seen_at(1), seen_at(1)
    assert not b.decide(activate(2, "backup-1", data=1), primary_reachable=True)[0]
    assert c.decide(activate(2, "backup-1", data=1), primary_reachable=False)[0]
    stay_2 = going_on(2, 1, "primary-1")
    assert [answer(b, "node-b", stay_2)["granted"], answer(c, "node-c", stay_2)["granted"]] == [True, False]
    assert c.standing(PAIR, 2) is Standing.CURRENT
    c.observe(PAIR, 2)
    restart = going_on(3, 2, "primary-1-again")
    kept = [answer(VoteBook(dict(bk.promised), dict(bk.fresh)), n, restart) for n, bk in (("node-b", b), ("node-c", c))]
    assert restart_refusal(kept, node_id=PAIR, own_epoch=2, pairs=0).startswith("a voter refused: epoch 2 was won")
    assert c.decide(withdraw(2), primary_reachable=True) == (True, "")
    answers = [answer(b, "node-b", restart), answer(c, "node-c", restart)]
    assert restart_refusal(answers, node_id=PAIR, own_epoch=2, pairs=0) == ""


# ---------------------------------------------------------------------------------------------------- JSON
def test_the_book_round_trips_through_json() -> None:
    book = VoteBook()
    book.decide(activate(3, "backup-1", node_id="node-a"), primary_reachable=False)
    book.observe("node-b", 7)
    data = json.loads(json.dumps(book.to_json()))
    assert data == {"node-a": [3, "backup-1", 2, 0], "node-b": [7, "", 7, 0]}
    again = VoteBook.from_json(data)
    assert again.promised == book.promised
    assert again.fresh == book.fresh
    assert again.won == book.won
    # the restored book decides as the original would
    assert again.decide(activate(3, "backup-1", node_id="node-a"), primary_reachable=False) == (True, "")
    assert not again.decide(activate(3, "backup-2", node_id="node-a"), primary_reachable=False)[0]
    assert not again.decide(stay(6, node_id="node-b"), primary_reachable=True)[0]


def test_an_empty_book_round_trips() -> None:
    assert VoteBook().to_json() == {}
    assert VoteBook.from_json({}).promised == {}


def test_the_book_copies_the_promises_it_is_given() -> None:
    given_promises = {PAIR: (1, "x")}
    book = VoteBook(given_promises)
    book.observe(PAIR, 2)
    assert given_promises == {PAIR: (1, "x")}


@pytest.mark.parametrize("data", [None, [], [[PAIR, 1, ""]], "book", 3])
def test_from_json_refuses_anything_but_a_map(data: Any) -> None:
    with pytest.raises(ValueError, match="the vote book is a map"):
        VoteBook.from_json(data)


@pytest.mark.parametrize(
    "entry",
    [
        None,
        3,
        "3",
        (3, "b"),  # JSON has no tuples: only a list is a stored entry
        [],
        [3],
        [3, "b", "extra"],
        [3, "b", 1, 1, 1],
        [3, "b", 1, None],
        [3, "b", None],
        [True, "b"],
        [3.0, "b"],
        ["3", "b"],
        [None, "b"],
        [3, None],
        [3, 4],
        {"epoch": 3, "candidate": "b"},
    ],
)
def test_from_json_refuses_a_malformed_entry(entry: Any) -> None:
    with pytest.raises(ValueError, match="malformed vote book entry for 'node-b'"):
        VoteBook.from_json({"node-a": [1, "", 1], "node-b": entry})


def test_from_json_reads_an_entry_written_before_data_epochs_were_kept() -> None:
    book = VoteBook.from_json({"node-a": [3, "backup-1"]})
    assert book.promised == {"node-a": (3, "backup-1")}
    assert book.freshness("node-a") == 0


def test_from_json_of_unparsable_text_fails_with_value_error() -> None:
    """Callers read the file with ``json.loads`` and catch ValueError for any bad content."""
    with pytest.raises(ValueError, match="Expecting"):
        VoteBook.from_json(json.loads('{"node-a": [1, '))


# ---------------------------------------------------------------------------------------------------- freshness
def test_a_stale_copy_is_refused_whatever_epoch_it_asks_for() -> None:
    """The pair was seen active at epoch 3: a copy whose data is from epoch 2 never wins, even asking for an
    epoch above every promise (as a split-vote candidate does)."""
    book = VoteBook()
    book.observe(PAIR, 3)
    for epoch in (4, 5, 50):
        granted, why = book.decide(activate(epoch, "stale", data=2), primary_reachable=False)
        assert not granted
        assert "stale copy: data epoch 2, the pair's is 3" in why
    assert book.decide(activate(4, "fresh", data=3), primary_reachable=False) == (True, "")


def test_a_split_vote_is_resolved_by_asking_again_above_the_promise() -> None:
    """Two copies of one pair, both at data epoch 3, ask for epoch 4 and each gets one voter: neither has a
    majority. Asking again at 5 is granted by the voter that promised 4 to the other copy, since the copy is
    as fresh as the one it backed; two voters make a majority of three pairs."""
    first, second = VoteBook(), VoteBook()
    first.observe(PAIR, 3)
    second.observe(PAIR, 3)
    assert first.decide(activate(4, "copy-a", data=3), primary_reachable=False)[0]
    assert second.decide(activate(4, "copy-b", data=3), primary_reachable=False)[0]
    assert not first.decide(activate(4, "copy-b", data=3), primary_reachable=False)[0]
    assert first.decide(activate(5, "copy-b", data=3), primary_reachable=False) == (True, "")
    assert second.decide(activate(5, "copy-b", data=3), primary_reachable=False) == (True, "")
    assert first.promised[PAIR] == second.promised[PAIR] == (5, "copy-b")


def test_a_promise_raises_the_data_epoch_a_later_candidate_needs() -> None:
    book = VoteBook()
    assert book.decide(activate(4, "copy-a", data=3), primary_reachable=False)[0]
    granted, why = book.decide(activate(5, "older", data=2), primary_reachable=False)
    assert not granted
    assert "stale copy" in why
    assert book.freshness(PAIR) == 3


def test_a_granted_stay_means_the_pair_serves_at_that_epoch() -> None:
    book = VoteBook()
    assert book.decide(stay(3), primary_reachable=True)[0]
    assert book.freshness(PAIR) == 3
    assert not book.decide(activate(4, "stale", data=2), primary_reachable=False)[0]


def test_stay_is_refused_at_an_epoch_promised_to_another_server() -> None:
    """Failback gives the returned primary an epoch without a vote; if that copy dies unseen and the other
    one wins the same epoch by vote, the first one, restarting, must not serve that epoch too."""
    book = VoteBook()
    assert book.decide(activate(4, "backup-1", data=3), primary_reachable=False)[0]
    granted, why = book.decide(VoteRequest(STAY, PAIR, 4, "primary-2"), primary_reachable=True)
    assert not granted
    assert "epoch 4 was promised to backup-1" in why
    assert book.decide(VoteRequest(STAY, PAIR, 4, "backup-1"), primary_reachable=True) == (True, "")


def test_the_book_keeps_a_data_epoch_learnt_without_a_promise() -> None:
    book = VoteBook()
    assert book.decide(stay(3), primary_reachable=True)[0]  # no promise, but the pair serves at 3
    again = VoteBook.from_json(json.loads(json.dumps(book.to_json())))
    assert again.freshness(PAIR) == 3
    assert not again.decide(activate(4, "stale", data=2), primary_reachable=False)[0]


def test_a_commit_and_a_later_rival_exclude_each_other_at_every_voter() -> None:
    """A winner commits its epoch (a stay from the same server) before serving. At each voter, whichever
    comes first wins: a committed epoch makes the voter refuse an older copy asking higher; a higher promise
    made first makes the voter refuse the commit."""
    committed_first = VoteBook()
    assert committed_first.decide(activate(4, "winner", data=3), primary_reachable=False)[0]
    assert committed_first.decide(VoteRequest(STAY, PAIR, 4, "winner"), primary_reachable=False)[0]
    granted, why = committed_first.decide(activate(5, "rival", data=3), primary_reachable=False)
    assert not granted
    assert "stale copy" in why
    rival_first = VoteBook()
    assert rival_first.decide(activate(4, "winner", data=3), primary_reachable=False)[0]
    assert rival_first.decide(activate(5, "rival", data=3), primary_reachable=False)[0]
    assert not rival_first.decide(VoteRequest(STAY, PAIR, 4, "winner"), primary_reachable=False)[0]


# ---------------------------------------------------------------------------------------------------- a new epoch
def going_on(epoch: int, data: int, candidate: str = "primary-1") -> VoteRequest:
    """A primary that lost its backup (or restarted) asks to serve at ``epoch``, its data being at ``data``."""
    return VoteRequest(STAY, PAIR, epoch, candidate, data)


def test_going_on_at_a_new_epoch_makes_the_lost_backups_copy_stale() -> None:
    book = VoteBook({PAIR: (1, "")})
    assert book.decide(going_on(2, 1), primary_reachable=True) == (True, "")
    assert book.promised == {PAIR: (1, "")}  # no promise: the pair's data epoch rose to 2
    for epoch in (2, 3, 9):  # whatever it asks for, the backup's copy of epoch 1 lacks what came since
        granted, why = book.decide(activate(epoch, "backup-1", data=1), primary_reachable=False)
        assert not granted
        assert "stale copy: data epoch 1, the pair's is 2" in why
    assert book.decide(activate(3, "backup-1", data=2), primary_reachable=False) == (True, "")  # a copy of it


def test_a_new_epoch_is_refused_once_another_copy_was_promised_or_seen_at_it() -> None:
    promised = VoteBook({PAIR: (1, "")})
    assert promised.decide(activate(2, "backup-1", data=1), primary_reachable=False)[0]
    assert promised.decide(going_on(2, 1), primary_reachable=True) == (False, "epoch 2 was promised to backup-1")
    seen = VoteBook()
    seen.observe(PAIR, 2)  # a copy serves at 2 (it won without asking this voter, or by failback)
    assert seen.decide(going_on(2, 1), primary_reachable=True) == (False, "epoch 2 is active elsewhere")
    assert seen.decide(VoteRequest(STAY, PAIR, 2, "backup-1"), primary_reachable=True) == (True, "")  # itself


def test_a_new_epoch_is_refused_when_another_copy_won_the_data_epoch() -> None:
    """Failback gave the asking copy epoch 4 without a vote, while another copy won 4 by vote: the first one
    must not go on at 5 over it."""
    book = VoteBook()
    assert book.decide(activate(4, "backup-1", data=3), primary_reachable=False)[0]
    assert book.decide(going_on(5, 4), primary_reachable=True) == (False, "epoch 4 was won by backup-1")
    assert book.decide(going_on(5, 4, "backup-1"), primary_reachable=True) == (True, "")


def test_a_new_epoch_is_refused_after_a_later_one_was_promised() -> None:
    book = VoteBook()
    assert book.decide(activate(6, "backup-1", data=2), primary_reachable=False)[0]
    assert book.decide(going_on(5, 4), primary_reachable=True) == (False, "epoch 6 replaced epoch 4")


def test_a_restarted_voter_keeps_the_data_epoch_of_a_new_epoch() -> None:
    book = VoteBook({PAIR: (1, "")})
    assert book.decide(going_on(2, 1), primary_reachable=True)[0]
    again = VoteBook.from_json(json.loads(json.dumps(book.to_json())))
    assert not again.decide(activate(2, "backup-1", data=1), primary_reachable=False)[0]


# ---------------------------------------------------------------------------------------------------- a restart
def answer(book: VoteBook, voter: str, request: VoteRequest, pairs: int = 3) -> dict[str, Any]:
    """A voter's answer as ``Voter.vote`` sends it; ``pairs``: the pairs it heard of."""
    granted, why = book.decide(request, primary_reachable=False)
    return {
        "granted": granted,
        "voter": voter,
        "pairs": pairs,
        "reason": why,
        "epoch": book.epoch(request.node_id),
        "promisee": book.promisee(request.node_id),
        "fresh": book.freshness(request.node_id),
    }


def seen_at(epoch: int) -> VoteBook:
    book = VoteBook()
    book.observe(PAIR, epoch)
    return book


def test_a_restart_is_not_kept_waiting_by_one_voters_promise_to_a_backup_that_cannot_win() -> None:
    """Three pairs. The primary served at epoch 4 and crashed; its backup asked one voter for epoch 5 before
    the primary was back. The restarted primary asks to stay at 5: one voter refuses (its promise), the other
    grants. With its own vote that is a quorum: it serves, and the backup can no longer win."""
    b, c = seen_at(4), seen_at(4)
    assert answer(b, "node-b", activate(5, "backup-1", data=4))["granted"]
    restart = going_on(5, 4, "primary-1")
    answers = [answer(b, "node-b", restart), answer(c, "node-c", restart)]
    assert [a["granted"] for a in answers] == [False, True]
    assert restart_refusal(answers, node_id=PAIR, own_epoch=4, pairs=3) == ""
    # A copy that never counted the pairs (never a backup) still needs every answer to agree.
    assert restart_refusal(answers, node_id=PAIR, own_epoch=4, pairs=0) == (
        "epoch 5 of this pair is active elsewhere (this copy has epoch 4)"
    )
    for epoch in (5, 6, 7):  # the backup's copy is stale at the voter that granted the restart
        assert not answer(c, "node-c", activate(epoch, "backup-1", data=4))["granted"]


def test_a_restart_counts_the_pairs_the_voters_know_of_when_the_cluster_grew() -> None:
    """The copy counted 3 pairs when it was a backup; 5 serve now. Its backup won epoch 5 at three of the
    four other pairs; the fourth has not heard of it yet and grants the restart: 2 of 5 is no quorum."""
    c, *winners = seen_at(4), seen_at(4), seen_at(4), seen_at(4)
    for book in winners:
        assert book.decide(activate(5, "backup-1", data=4), primary_reachable=False)[0]
    restart = going_on(5, 4, "primary-1")
    granted = answer(c, "node-c", restart, pairs=5)
    refusals = [answer(book, f"node-{n}", restart, pairs=5) for n, book in enumerate(winners)]
    assert granted["granted"]
    assert not any(a["granted"] for a in refusals)
    assert restart_refusal([granted, *refusals], node_id=PAIR, own_epoch=4, pairs=3).startswith("epoch 5")
    # The voters that answered count too, whatever they say of the pairs; so does one voter's count alone.
    unsaid = [{k: v for k, v in a.items() if k != "pairs"} for a in (granted, *refusals)]
    assert restart_refusal(unsaid, node_id=PAIR, own_epoch=4, pairs=3).startswith("epoch 5")
    assert restart_refusal([granted, refusals[0]], node_id=PAIR, own_epoch=4, pairs=3).startswith("epoch 5")


def test_a_restart_needs_a_quorum_of_distinct_other_pairs() -> None:
    granted = {"granted": True, "voter": "node-b", "epoch": 4}
    refused = {"granted": False, "voter": "node-c", "epoch": 5, "reason": "epoch 5 was promised to backup-1"}
    # node-b asked at two addresses counts once; five pairs need three votes.
    assert restart_refusal([granted, granted, refused], node_id=PAIR, own_epoch=4, pairs=5).startswith("epoch 5")
    # An answer that names no pair, or this pair (its backup, active now), is no other pair's vote.
    for voter in ("", PAIR, None):
        anonymous = {**granted, "voter": voter}
        assert restart_refusal([anonymous, refused], node_id=PAIR, own_epoch=4, pairs=3).startswith("epoch 5")
    assert restart_refusal([granted, {**granted, "voter": "node-d"}, refused], node_id=PAIR, own_epoch=4, pairs=5) == ""


def test_a_restart_never_outvotes_its_own_pairs_active_copy() -> None:
    """A single pair whose backup took over without a quorum (``ha.activate_without_quorum``): the
    restarting primary hears from that copy alone. Counted as one pair, its own vote would be a quorum."""
    active = {"granted": False, "voter": PAIR, "pairs": 1, "epoch": 7, "reason": "epoch 7 is active elsewhere"}
    assert restart_refusal([active], node_id=PAIR, own_epoch=6, pairs=1).startswith("epoch 7")
    # Nor in a cluster: another pair's grant does not outvote the pair's active copy either.
    other = {"granted": True, "voter": "node-b", "pairs": 3, "epoch": 6}
    assert restart_refusal([active, other], node_id=PAIR, own_epoch=6, pairs=3).startswith("epoch 7")


def test_a_restart_needs_another_pairs_grant_whatever_the_count() -> None:
    refused = {"granted": False, "voter": "", "epoch": 7, "reason": "no"}  # an older node: names no pair
    assert restart_refusal([refused], node_id=PAIR, own_epoch=6, pairs=1).startswith("epoch 7")


def test_a_restart_short_of_a_quorum_serves_only_when_no_voter_objects() -> None:
    ok = {"granted": True, "voter": "node-b", "epoch": 4}
    assert restart_refusal([], node_id=PAIR, own_epoch=4, pairs=3) == ""  # nobody to ask: a cluster starting
    assert restart_refusal([ok], node_id=PAIR, own_epoch=4, pairs=5) == ""
    no = {"granted": False, "voter": "node-c", "epoch": 4, "reason": "epoch 4 was won by backup-1"}
    assert (
        restart_refusal([ok, no], node_id=PAIR, own_epoch=4, pairs=5) == "a voter refused: epoch 4 was won by backup-1"
    )


@settings(max_examples=1000)
@given(
    pairs=st.integers(min_value=2, max_value=7),
    counted=st.integers(min_value=1, max_value=7),
    seen=st.lists(st.booleans(), min_size=6, max_size=6),
    backup_epoch=st.integers(min_value=5, max_value=7),
    backup_data=st.integers(min_value=3, max_value=4),
    backup_first=st.lists(st.booleans(), min_size=6, max_size=6),
    silent=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_a_restart_that_a_voter_refused_never_serves_beside_a_backup_with_a_quorum(
    pairs: int,
    counted: int,
    seen: list[bool],
    backup_epoch: int,
    backup_data: int,
    backup_first: list[bool],
    silent: list[bool],
) -> None:
    """The primary served at epoch 4 (some voters saw it, others only epoch 3) and counted ``counted`` pairs
    when it was a backup, however many there are now. Its backup asks each other pair for ``backup_epoch``,
    the restarted primary to stay at 5, in either order at each voter, and some voters' answers to the
    primary are lost. Once a voter refused the restart (which alone kept it from serving before), it serves
    only on a quorum that the backup, needing a quorum of the other pairs, cannot also have."""
    backup_votes, restart_answers = 0, []
    for n in range(pairs - 1):
        book = seen_at(4 if seen[n] else 3)
        requests = [activate(backup_epoch, "backup-1", data=backup_data), going_on(5, 4, "primary-1")]
        for request in requests if backup_first[n] else requests[::-1]:
            reply = answer(book, f"node-{n}", request, pairs=pairs)
            if request.kind == ACTIVATE:
                backup_votes += reply["granted"]
            elif not silent[n]:
                restart_answers.append(reply)
    restarted = restart_refusal(restart_answers, node_id=PAIR, own_epoch=4, pairs=counted) == ""
    if any(not a["granted"] for a in restart_answers):
        assert not (restarted and backup_votes >= quorum(pairs))
