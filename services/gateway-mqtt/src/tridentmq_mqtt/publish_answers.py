"""The answers to a client's PUBLISH packets, in the order of the packets (no I/O, no link).

A QoS 1 PUBLISH gets its PUBACK, a QoS 2 one its PUBREC, once the core has the message and, for a retained
message, the retained store has it too; a QoS 0 PUBLISH gets no answer. A refusal travels in the answer's
reason code (MQTT 5.0). MQTT 3.1.1 has no way to refuse a QoS 1 or 2 message but to close the connection
([MQTT-3.3.5-2]); a refused QoS 0 message is only logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.outcome import Outcome

#: The reason code of a PUBACK or PUBREC for the core's refusal.
REFUSALS: Final = {
    ErrorCode.FORBIDDEN: rc.NOT_AUTHORIZED,
    ErrorCode.RESOURCE_LIMIT: rc.QUOTA_EXCEEDED,
    ErrorCode.INVALID: rc.TOPIC_NAME_INVALID,
    ErrorCode.NOT_FOUND: rc.TOPIC_NAME_INVALID,
}


OutcomeT = TypeVar("OutcomeT", bound=Outcome)


class Pending(Generic[OutcomeT]):
    """A PUBLISH waiting for the core (packet id 0: QoS 0). A plain class: one is made per message."""

    __slots__ = ("outcome", "packet_id", "qos", "retained", "topic")

    def __init__(self, outcome: OutcomeT, packet_id: int, qos: int, topic: str) -> None:
        self.outcome = outcome
        self.packet_id = packet_id
        self.qos = qos
        self.topic = topic
        self.retained: OutcomeT | None = None  # a retained message's update of the store


@dataclass(frozen=True, slots=True)
class Refusal:
    """A PUBLISH the core (or the retained store) refused."""

    packet_id: int
    qos: int
    topic: str
    reason_code: int
    text: str
    close: bool  # MQTT 3.1.1 and QoS 1 or 2: the connection ends instead of an answer


class PublishAnswers(Generic[OutcomeT]):
    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        # in the order of the packets; a list cut once per batch (an empty deque is 600 bytes per connection)
        self._waiting: list[Pending[OutcomeT]] = []

    def waits(self, pending: Pending[OutcomeT]) -> None:
        self._waiting.append(pending)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def answerable(self, *, v5: bool) -> list[Pending[OutcomeT] | Refusal]:
        """The PUBLISH packets answerable now, in order, taken off: each confirmed one as it was, each refused
        one as its ``Refusal``."""
        waiting = self._waiting
        answers: list[Pending[OutcomeT] | Refusal] = []
        for pending in waiting:
            outcome, retained = pending.outcome, pending.retained
            if not outcome.done() or (retained is not None and not retained.done()):
                break
            error = outcome.exception()
            if error is None and retained is not None:
                error = retained.exception()
            answers.append(pending if error is None else refusal(pending, error, v5=v5))
        if answers:
            del waiting[: len(answers)]
        return answers

    def outstanding(self) -> list[OutcomeT]:
        """What the answers still wait for."""
        return [
            outcome
            for pending in self._waiting
            for outcome in (pending.outcome, pending.retained)
            if outcome is not None and not outcome.done()
        ]

    def drop(self) -> None:
        """The connection ended: nobody reads the answers. The finished ones are read all the same, so asyncio
        does not report a refusal nobody retrieved."""
        for pending in self._waiting:
            for outcome in (pending.outcome, pending.retained):
                if outcome is not None and outcome.done() and not outcome.cancelled():
                    outcome.exception()
        self._waiting.clear()


def refusal(pending: Pending[OutcomeT], error: BaseException, *, v5: bool) -> Refusal:
    if isinstance(error, LinkRequestError):
        code, text = REFUSALS.get(error.code, rc.UNSPECIFIED_ERROR), error.text
    else:
        code, text = rc.UNSPECIFIED_ERROR, str(error)
    return Refusal(pending.packet_id, pending.qos, pending.topic, code, text, close=not v5 and pending.qos > 0)
