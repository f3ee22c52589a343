"""How often a failed streaming query may start again: the policy alone, without Spark, time passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: A query that fails more than ``--max-restarts`` times within this many seconds stops the stream.
RESTART_WINDOW_S: Final = 600
#: The longest pause before a restart; the pauses double from 1 s up to it.
MAX_RESTART_DELAY_S: Final = 30.0


@dataclass
class RestartBudget:
    """At most ``max_restarts`` failures within ``RESTART_WINDOW_S``, each followed by a pause of 1, 2, 4 ...
    up to ``MAX_RESTART_DELAY_S`` seconds before the next start."""

    max_restarts: int
    failures: list[float] = field(default_factory=list)  # the times of the failures still in the window

    def failed(self, now: float) -> float | None:
        """Count a failure at ``now`` (seconds, any monotonic clock): the pause before starting again, or None
        when that was one failure too many."""
        self.failures = [t for t in self.failures if now - t < RESTART_WINDOW_S] + [now]
        if len(self.failures) > self.max_restarts:
            return None
        return min(2.0 ** (len(self.failures) - 1), MAX_RESTART_DELAY_S)

    @property
    def spent(self) -> int:
        """Failures counted in the window."""
        return len(self.failures)
