"""The restart policy of the audit stream's queries (tridentmq_spark.restarts), time passed in."""

from __future__ import annotations

from tridentmq_spark.restarts import MAX_RESTART_DELAY_S, RESTART_WINDOW_S, RestartBudget


def test_the_pauses_double_from_one_second_up_to_the_longest() -> None:
    budget = RestartBudget(max_restarts=10)
    assert [budget.failed(float(t)) for t in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_RESTART_DELAY_S, 30.0]


def test_one_failure_more_than_the_budget_within_the_window_gives_up() -> None:
    budget = RestartBudget(max_restarts=2)
    assert budget.failed(0.0) == 1.0
    assert budget.failed(10.0) == 2.0
    assert budget.failed(20.0) is None
    assert budget.spent == 3


def test_failures_older_than_the_window_no_longer_count() -> None:
    budget = RestartBudget(max_restarts=2)
    budget.failed(0.0)
    budget.failed(1.0)
    assert budget.failed(RESTART_WINDOW_S + 0.5) == 2.0  # the first one left the window, the second did not
    assert budget.spent == 2
    assert budget.failed(2 * RESTART_WINDOW_S + 2.0) == 1.0  # a quiet window later: as good as new


def test_no_restart_at_all_with_a_budget_of_zero() -> None:
    assert RestartBudget(max_restarts=0).failed(0.0) is None
