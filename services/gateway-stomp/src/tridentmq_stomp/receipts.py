"""The answers to a STOMP client's frames, in the order of its frames (no I/O, no link).

A frame's RECEIPT, or the ERROR of a SEND the core refused, goes out once that frame is done and every frame
before it has been answered. A SEND is done when the core confirmed it (a persistent message once it is on
disk) or refused it; the other frames once handled.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.outcome import Outcome

OutcomeT = TypeVar("OutcomeT", bound=Outcome)


class Receipts(Generic[OutcomeT]):
    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        # (the SEND's outcome or None, the frame's receipt header or None), in the order of the frames; a list
        # cut once per answer batch (an empty deque is 600 bytes, and every connection has one of these)
        self._waiting: list[tuple[OutcomeT | None, str | None]] = []

    def done(self, receipt: str | None) -> None:
        """A frame handled now: its receipt follows those of the frames before it."""
        if receipt is not None:
            self._waiting.append((None, receipt))

    def after(self, outcome: OutcomeT, receipt: str | None) -> None:
        """A SEND answered once ``outcome`` is done (its ERROR if refused, with or without a receipt)."""
        self._waiting.append((outcome, receipt))

    def answerable(self) -> list[tuple[str | None, BaseException | None]]:
        """The (receipt, refusal) of the frames that can be answered now, in order, taken off."""
        waiting = self._waiting
        count = 0
        for outcome, _ in waiting:
            if outcome is not None and not outcome.done():
                break
            count += 1
        if not count:
            return []
        answers = [(receipt, None if outcome is None else outcome.exception()) for outcome, receipt in waiting[:count]]
        del waiting[:count]
        return answers

    def outstanding(self) -> list[OutcomeT]:
        """The SENDs still waiting for the core."""
        return [outcome for outcome, _ in self._waiting if outcome is not None and not outcome.done()]

    def drop(self) -> None:
        """The connection ended: nobody reads the answers. The finished ones are read all the same, so asyncio
        does not report a refusal nobody retrieved."""
        for outcome, _ in self._waiting:
            if outcome is not None and outcome.done() and not outcome.cancelled():
                outcome.exception()
        self._waiting.clear()


class FrameError(Exception):
    """A frame the gateway refused (an unknown ack id, a duplicate subscription id ...): its ERROR goes out in
    the order of the frames, once every frame before it is answered."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(detail)
        self.message = message
        self.detail = detail


def refusal(error: BaseException) -> tuple[str, str]:
    """The ERROR frame's ``message`` and detail for a SEND the core refused, or a frame the gateway refused."""
    if isinstance(error, FrameError):
        return error.message, error.detail
    if isinstance(error, LinkRequestError):
        return ("permission denied" if error.code == ErrorCode.FORBIDDEN else "send refused"), error.text
    return "send refused", str(error)
