"""A stand-in for the core's confirm future, for the gateways' answer rules."""

from __future__ import annotations


class FakeOutcome:
    def __init__(self) -> None:
        self.finished = False
        self.error: BaseException | None = None
        self.read = False  # whether its outcome was retrieved

    def done(self) -> bool:
        return self.finished

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        assert self.finished
        self.read = True
        return self.error

    def confirm(self) -> FakeOutcome:
        self.finished = True
        return self

    def refuse(self, error: BaseException) -> FakeOutcome:
        self.finished, self.error = True, error
        return self
