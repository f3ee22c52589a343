"""The restart policy of the audit stream's queries (tridentmq_spark.restarts, time passed in), and the loop that
follows it (stream._Supervised.restart) with starts that fail as told."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest

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


class _StartedQuery:
    """What ``_Supervised`` keeps of a started query: its name (the restart loop asks nothing else of it)."""

    name = "rates"


def _supervised(outcomes: list[BaseException | None]) -> tuple[Any, list[_StartedQuery]]:
    """A supervised query whose restarts raise or start as ``outcomes`` say (None: it starts)."""
    from tridentmq_spark import stream  # noqa: PLC0415  (imports Spark's Python side: only these tests need it)

    started: list[_StartedQuery] = []
    pending = iter(outcomes)

    def start() -> Any:
        outcome = next(pending)
        if outcome is not None:
            raise outcome
        started.append(_StartedQuery())
        return started[-1]

    supervised = stream._Supervised(start, cast(Any, _StartedQuery()), RestartBudget(max_restarts=3))
    return supervised, started


def test_a_restart_whose_start_fails_counts_a_failure_and_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.errors import PySparkException  # noqa: PLC0415

    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    supervised, started = _supervised([PySparkException("worker did not connect back"), None])
    supervised.restart(PySparkException("query failed"))
    assert pauses == [1.0, 2.0]  # the query's failure, then the start's
    assert supervised.query is started[0]


def test_out_of_restarts_the_querys_error_is_raised_with_the_last_start_failure_as_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pyspark.errors import PySparkException  # noqa: PLC0415

    monkeypatch.setattr(time, "sleep", lambda _s: None)
    start_failures = [PySparkException(f"start {i}") for i in range(3)]
    supervised, started = _supervised(list(start_failures))
    query_failed = PySparkException("query failed")
    with pytest.raises(PySparkException) as raised:
        supervised.restart(query_failed)
    assert raised.value is query_failed
    assert raised.value.__cause__ is start_failures[-1]
    assert not started


def test_a_start_failing_outside_spark_ends_the_stream_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.errors import PySparkException  # noqa: PLC0415

    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    gone = ConnectionRefusedError("the JVM is gone")
    supervised, _ = _supervised([gone, None])
    query_failed = PySparkException("query failed")
    with pytest.raises(ConnectionRefusedError) as raised:
        supervised.restart(query_failed)
    assert raised.value.__cause__ is query_failed
    assert pauses == [1.0]
