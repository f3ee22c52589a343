"""Tests for the total-queue checker and the split-brain node comparison of the fault-testing toolkit."""

from __future__ import annotations

import dataclasses

import pytest
from tests.jepsen.checker import Delivery, NodeComparison, Verdict, check, compare_nodes


def test_empty_run_is_ok() -> None:
    verdict: Verdict[int] = check([], [], [], [])
    assert verdict.ok
    assert verdict.redelivery_flags_ok
    assert (verdict.attempted, verdict.acknowledged, verdict.rejected, verdict.unknown) == (0, 0, 0, 0)
    assert (verdict.deliveries, verdict.distinct_delivered, verdict.duplicate_deliveries) == (0, 0, 0)
    assert not verdict.lost
    assert not verdict.unexpected
    assert not verdict.duplicated
    assert not verdict.recovered
    assert verdict.report().splitlines()[0] == "total-queue check: OK"


def test_clean_run() -> None:
    verdict = check(range(100), range(100), [], range(100))
    assert verdict.ok
    assert verdict.acknowledged == verdict.distinct_delivered == verdict.deliveries == 100
    assert "lost (acknowledged, never delivered): 0" in verdict.report()


def test_lost() -> None:
    verdict = check(range(10), range(10), [], [0, 1, 2, 3, 4])
    assert not verdict.ok
    assert verdict.lost == frozenset({5, 6, 7, 8, 9})
    assert "lost (acknowledged, never delivered): 5 e.g. [5, 6, 7, 8, 9]" in verdict.report()
    assert verdict.report().startswith("total-queue check: FAILED")


def test_unacknowledged_undelivered_is_not_lost() -> None:
    verdict = check(range(10), range(5), [], range(5))
    assert verdict.ok
    assert verdict.unknown == 5
    assert not verdict.lost
    assert not verdict.recovered


def test_unexpected() -> None:
    verdict = check(["a", "b"], ["a", "b"], [], ["a", "b", "zz"])
    assert not verdict.ok
    assert verdict.unexpected == frozenset({"zz"})
    assert "unexpected (delivered, never attempted): 1 e.g. ['zz']" in verdict.report()


def test_rejected_delivered() -> None:
    verdict = check(range(4), [0, 1], [2, 3], [0, 1, 3])
    assert not verdict.ok
    assert verdict.rejected_delivered == frozenset({3})
    assert verdict.rejected == 2
    assert verdict.unknown == 0


def test_rejected_not_delivered_is_fine() -> None:
    verdict = check(range(4), [0, 1], [2, 3], [0, 1])
    assert verdict.ok
    assert not verdict.rejected_delivered


def test_contradicted() -> None:
    verdict = check(range(3), [0, 1, 2], [2], [0, 1, 2])
    assert not verdict.ok
    assert verdict.contradicted == frozenset({2})
    assert verdict.rejected_delivered == frozenset({2})


def test_recovered() -> None:
    """An unknown outcome may go either way: delivered ones are recovered, the rest simply never happened."""
    verdict = check(range(6), [0, 1], [], [0, 1, 2, 3])
    assert verdict.ok
    assert verdict.unknown == 4
    assert verdict.recovered == frozenset({2, 3})
    assert "recovered (outcome unknown, delivered; of 4 unknown): 2 e.g. [2, 3]" in verdict.report()


def test_duplicates_flagged() -> None:
    deliveries = [0, 1, Delivery(1, redelivered=True), 2, Delivery(2, redelivered=True), Delivery(2, redelivered=True)]
    verdict = check(range(3), range(3), [], deliveries)
    assert verdict.ok
    assert verdict.redelivery_flags_ok
    assert verdict.duplicated == frozenset({1, 2})
    assert verdict.duplicate_deliveries == 3
    assert verdict.unflagged_duplicates == 0
    assert verdict.deliveries == 6
    assert verdict.distinct_delivered == 3


def test_duplicates_unflagged() -> None:
    deliveries = [Delivery(0), Delivery(0), 1, 1, Delivery(1, redelivered=True), 2]
    verdict = check(range(3), range(3), [], deliveries)
    assert verdict.ok  # duplicates are allowed (at-least-once) ...
    assert not verdict.redelivery_flags_ok  # ... but each must say it is one
    assert verdict.duplicated == frozenset({0, 1})
    assert verdict.duplicate_deliveries == 3
    assert verdict.unflagged_duplicates == 2
    assert verdict.unflagged_duplicated == frozenset({0, 1})
    report = verdict.report()
    assert report.startswith("total-queue check: OK (but duplicates without the redelivered flag)")
    assert "duplicated without the redelivered flag: 2 e.g. [0, 1]" in report


def test_an_unflagged_first_delivery_recorded_just_after_its_copys_redelivery_elsewhere_is_no_duplicate() -> None:
    """The audit stream of a run over ``up --nodes 3`` (seed 8317): a node sent its copy (delivery count 1) to
    one consumer, whose connection closed right after, and redelivered the same copy, flagged, to another
    consumer 10 ms later; the first consumer recorded its delivery last. Only that is excused: two nodes'
    copies (a move whose confirm was lost), one consumer's own order, two unflagged deliveries, or the same
    copy a while later (a delivery count that went back) are unflagged duplicates."""

    def unflagged(*deliveries: tuple[str, str, float, str], race_s: float = 0.5) -> int:
        """(consumer, copy, when, "flagged" or "plain") per delivery of one message."""
        seen = [
            Delivery(1, redelivered=flag == "flagged", consumer=consumer, copy=copy, at=at)
            for consumer, copy, at, flag in deliveries
        ]
        return check([1], [1], [], seen, race_s=race_s).unflagged_duplicates

    assert unflagged(("c0", "n1-7", 10.0, "flagged"), ("c1", "n1-7", 10.1, "plain")) == 0
    assert unflagged(("c0", "n1-7", 10.0, "flagged"), ("c1", "n2-9", 10.1, "plain")) == 1  # two nodes' copies
    assert unflagged(("c0", "n1-7", 10.0, "flagged"), ("c0", "n1-7", 10.1, "plain")) == 1  # one consumer
    assert unflagged(("c0", "n1-7", 10.0, "flagged"), ("c1", "n1-7", 11.0, "plain")) == 1  # a second later
    assert unflagged(("c0", "n1-7", 10.0, "plain"), ("c1", "n1-7", 10.1, "plain")) == 1  # two unflagged
    assert unflagged(("c0", "", 10.0, "flagged"), ("c1", "", 10.1, "plain")) == 1  # no copy known
    assert unflagged(("c0", "n1-7", 10.0, "flagged"), ("c1", "n1-7", 10.1, "plain"), race_s=0) == 1  # default
    assert unflagged(("c0", "n1-7", 10.0, "plain"), ("c1", "n1-7", 10.1, "flagged")) == 0
    # One consumer that moved to a new connection (seed 1130266892: stomp.py reads each connection on a thread of
    # its own, and the old one recorded its copy 4 ms late, after the new one recorded the redelivery).
    moved = [
        Delivery(1, redelivered=True, consumer="c0", copy="n1-7", at=10.0, connection="second"),
        Delivery(1, redelivered=False, consumer="c0", copy="n1-7", at=10.004, connection="first"),
    ]
    assert check([1], [1], [], moved, race_s=0.5).unflagged_duplicates == 0
    same = [dataclasses.replace(d, connection="only") for d in moved]  # one connection's own order stands
    assert check([1], [1], [], same, race_s=0.5).unflagged_duplicates == 1
    # the exemption needs every earlier delivery to excuse it
    assert (
        unflagged(("c0", "n1-7", 10.0, "flagged"), ("c2", "n2-9", 10.05, "flagged"), ("c1", "n1-7", 10.1, "plain")) == 1
    )


def test_first_delivery_flagged_redelivered_is_not_a_duplicate() -> None:
    """A consumer may see only the redelivery of a message whose first delivery it never recorded."""
    verdict = check([7], [7], [], [Delivery(7, redelivered=True)])
    assert verdict.ok
    assert not verdict.duplicated
    assert verdict.duplicate_deliveries == 0


def test_every_anomaly_at_once_and_examples_are_capped() -> None:
    attempted = range(100)
    acknowledged = range(60)
    rejected = range(60, 80)
    delivered = [*range(30), 30, 30, *range(60, 75), *range(80, 85), 1000, 1001]
    verdict = check(attempted, acknowledged, rejected, delivered)
    assert not verdict.ok
    assert verdict.lost == frozenset(range(31, 60))
    assert verdict.unexpected == frozenset({1000, 1001})
    assert verdict.rejected_delivered == frozenset(range(60, 75))
    assert verdict.recovered == frozenset(range(80, 85))
    assert verdict.duplicated == frozenset({30})
    assert verdict.unflagged_duplicates == 1
    report = verdict.report()
    assert (
        "lost (acknowledged, never delivered): 29 e.g. [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, ... 19 more]" in report
    )
    assert len(report.splitlines()) <= 12


def test_unorderable_values_are_reported() -> None:
    verdict = check([1, "a", (2,)], [1, "a", (2,)], [], [])
    assert len(verdict.lost) == 3
    assert "lost (acknowledged, never delivered): 3 e.g. " in verdict.report()


def test_bookkeeping_errors_raise() -> None:
    with pytest.raises(ValueError, match="acknowledged values that were never attempted"):
        check([1], [1, 2], [], [])
    with pytest.raises(ValueError, match="rejected values that were never attempted"):
        check([1], [], [3], [])


def test_generators_are_consumed_once() -> None:
    verdict = check((i for i in range(5)), (i for i in range(5)), iter(()), (i for i in range(5)))
    assert verdict.ok
    assert verdict.distinct_delivered == 5


def test_verdict_is_frozen() -> None:
    verdict = check([1], [1], [], [1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.lost = frozenset({1})  # type: ignore[misc]


# ------------------------------------------------------------------------------------------- split brain

PAIRS = {"p1": ("a1", "b1"), "p2": ("a2", "b2")}


def test_nodes_consistent() -> None:
    held = {"a1": {1, 2, 3}, "b1": {1, 2}, "a2": {10, 11}, "b2": {10, 11}}
    comparison: NodeComparison[int] = compare_nodes(held, PAIRS, {"p1": "a1", "p2": "b2"}, {1, 2, 3, 10, 11})
    assert comparison.ok
    assert not comparison.missing_values
    assert comparison.report().startswith("node comparison: OK")


def test_split_brain_detected() -> None:
    """b1 accepted and acknowledged 4 and 5 while it wrongly believed itself active; a1 never got them."""
    held = {"a1": {1, 2, 3}, "b1": {1, 2, 3, 4, 5}, "a2": {10}, "b2": {10}}
    comparison = compare_nodes(held, PAIRS, {"p1": "a1", "p2": "a2"}, {1, 2, 3, 4, 5, 10})
    assert not comparison.ok
    assert comparison.missing == {"p1": {"b1": frozenset({4, 5})}}
    assert comparison.missing_values == frozenset({4, 5})
    report = comparison.report()
    assert "FAILED (2 acknowledged values missing on active nodes)" in report
    assert "pair p1: on b1, not on active a1: 2 e.g. [4, 5]" in report


def test_unacknowledged_values_on_a_backup_are_fine() -> None:
    held = {"a1": {1}, "b1": {1, 99}}
    comparison = compare_nodes(held, {"p1": ("a1", "b1")}, {"p1": "a1"}, {1})
    assert comparison.ok


def test_active_node_that_reported_nothing_lacks_everything() -> None:
    held = {"b1": {1, 2}}
    comparison = compare_nodes(held, {"p1": ("a1", "b1")}, {"p1": "a1"}, {1, 2})
    assert comparison.missing == {"p1": {"b1": frozenset({1, 2})}}


def test_node_comparison_of_nothing() -> None:
    comparison: NodeComparison[int] = compare_nodes({}, {}, {}, [])
    assert comparison.ok


def test_node_comparison_rejects_bad_topology() -> None:
    with pytest.raises(ValueError, match="no active node"):
        compare_nodes({}, {"p1": ("a1", "b1")}, {}, [])
    with pytest.raises(ValueError, match="not a member"):
        compare_nodes({}, {"p1": ("a1", "b1")}, {"p1": "a2"}, [])
    with pytest.raises(ValueError, match="unknown pairs"):
        compare_nodes({}, {"p1": ("a1", "b1")}, {"p1": "a1", "p9": "x"}, [])
