"""The MQTT gateway's answers to a client's PUBLISH packets: in order, once the core (and for a retained
message the retained store) has the message, and how each version says no."""

from __future__ import annotations

import pytest
from tests.unit.outcomes import FakeOutcome

from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.publish_answers import Pending, PublishAnswers, Refusal
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.ops import ErrorCode


def pending(packet_id: int, qos: int, outcome: FakeOutcome | None = None, topic: str = "t") -> Pending[FakeOutcome]:
    return Pending(outcome or FakeOutcome(), packet_id, qos, topic)


def test_answers_go_out_in_the_order_of_the_packets() -> None:
    answers: PublishAnswers[FakeOutcome] = PublishAnswers()
    first, second, third = pending(1, 1), pending(0, 0), pending(2, 2)
    for p in (first, second, third):
        answers.waits(p)
    assert answers
    second.outcome.confirm()
    third.outcome.confirm()
    assert answers.answerable(v5=True) == []  # the first still waits: nothing overtakes it
    assert answers.outstanding() == [first.outcome]
    first.outcome.confirm()
    assert answers.answerable(v5=True) == [first, second, third]
    assert not answers
    assert answers.answerable(v5=True) == []


def test_a_retained_message_is_answered_once_the_retained_store_has_it_too() -> None:
    answers: PublishAnswers[FakeOutcome] = PublishAnswers()
    retained = pending(7, 1, FakeOutcome().confirm())
    retained.retained = FakeOutcome()
    answers.waits(retained)
    assert answers.answerable(v5=True) == []
    assert answers.outstanding() == [retained.retained]
    retained.retained.refuse(LinkRequestError(ErrorCode.RESOURCE_LIMIT, "the store is full"))
    assert answers.answerable(v5=True) == [Refusal(7, 1, "t", rc.QUOTA_EXCEEDED, "the store is full", close=False)]


@pytest.mark.parametrize(
    ("code", "reason_code"),
    [
        (ErrorCode.FORBIDDEN, rc.NOT_AUTHORIZED),
        (ErrorCode.RESOURCE_LIMIT, rc.QUOTA_EXCEEDED),
        (ErrorCode.INVALID, rc.TOPIC_NAME_INVALID),
        (ErrorCode.NOT_FOUND, rc.TOPIC_NAME_INVALID),
        (ErrorCode.INTERNAL, rc.UNSPECIFIED_ERROR),
    ],
)
def test_a_refusal_says_why_in_its_reason_code(code: str, reason_code: int) -> None:
    answers: PublishAnswers[FakeOutcome] = PublishAnswers()
    answers.waits(pending(3, 2, FakeOutcome().refuse(LinkRequestError(code, "no")), topic="a/b"))
    assert answers.answerable(v5=True) == [Refusal(3, 2, "a/b", reason_code, "no", close=False)]


def test_mqtt_3_1_1_can_only_refuse_a_qos_1_or_2_message_by_closing() -> None:
    answers: PublishAnswers[FakeOutcome] = PublishAnswers()
    lost = LinkClosedError(ErrorCode.EOF, "connection lost")
    answers.waits(pending(0, 0, FakeOutcome().refuse(ValueError("odd"))))
    answers.waits(pending(4, 1, FakeOutcome().refuse(lost)))
    assert answers.answerable(v5=False) == [
        Refusal(0, 0, "t", rc.UNSPECIFIED_ERROR, "odd", close=False),  # QoS 0: logged only
        Refusal(4, 1, "t", rc.UNSPECIFIED_ERROR, "connection lost", close=True),
    ]


def test_answers_nobody_will_read_are_retrieved_when_the_connection_ends() -> None:
    answers: PublishAnswers[FakeOutcome] = PublishAnswers()
    finished = pending(1, 1, FakeOutcome().refuse(LinkRequestError(ErrorCode.INVALID, "bad")))
    finished.retained = FakeOutcome().confirm()
    waiting = pending(2, 1)
    answers.waits(finished)
    answers.waits(waiting)
    answers.drop()
    assert finished.outcome.read is True
    assert finished.retained.read is True
    assert waiting.outcome.read is False
    assert not answers
