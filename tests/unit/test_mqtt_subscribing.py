"""What an MQTT SUBSCRIBE asks of the core (``subscribing``), without a connection."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tridentmq_mqtt import convert
from tridentmq_mqtt.convert import ConversionError
from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.settings import MqttLimitsSection
from tridentmq_mqtt.subscribing import (
    QueueKind,
    check_options,
    keeps_its_queue,
    keeps_retained,
    longer_expiry,
    plan,
    sends_retained,
    window,
)

LIMITS = MqttLimitsSection()


def test_a_shared_subscription_consumes_from_its_group_s_durable_queue() -> None:
    planned = plan("$share/g1/sensors/+", 1, v5=True, client_id="c1", persistent=False, resumed=False)
    assert (planned.kind, planned.group, planned.topic_filter) == (QueueKind.SHARED, "g1", "sensors/+")
    assert planned.queue == convert.shared_queue("g1", "sensors/+")
    assert planned.pattern == convert.filter_to_pattern("sensors/+")
    assert planned.durable
    assert not planned.fannable  # a group's messages are shared among its members, not fanned out


def test_3_1_1_has_no_shared_subscriptions() -> None:
    planned = plan("$share/g1/t", 1, v5=False, client_id="c1", persistent=True, resumed=False)
    assert planned.kind is QueueKind.DURABLE
    assert planned.group is None
    assert planned.topic_filter == "$share/g1/t"


def test_a_session_kept_after_its_connection_consumes_from_its_durable_queue() -> None:
    for persistent, resumed in ((True, False), (False, True), (True, True)):
        planned = plan("a/#", 0, v5=True, client_id="c1", persistent=persistent, resumed=resumed)
        assert planned.kind is QueueKind.DURABLE
        assert planned.queue == convert.subscription_queue("c1", "a/#")
        assert planned.durable
        assert not planned.fannable  # kept for the next connection: its messages wait for acknowledgements


def test_a_session_that_ends_with_its_connection_has_queues_of_its_own_and_qos_0_may_fan_out() -> None:
    qos0 = plan("a/b", 0, v5=True, client_id="c1", persistent=False, resumed=False)
    assert qos0.kind is QueueKind.CONNECTION
    assert not qos0.durable
    assert qos0.fannable
    assert qos0.queue == convert.subscription_queue("c1", "a/b")  # the session makes it unique
    assert not plan("a/b", 1, v5=True, client_id="c1", persistent=False, resumed=False).fannable


def test_a_filter_mqtt_refuses_is_refused() -> None:
    with pytest.raises(ConversionError):
        plan("a/#/b", 0, v5=True, client_id="c1", persistent=False, resumed=False)
    with pytest.raises(ConversionError):
        check_options("a/#/b", no_local=False, v5=True)


def test_no_local_on_a_shared_subscription_is_a_protocol_error() -> None:
    with pytest.raises(ConversionError) as refused:
        check_options("$share/g/t", no_local=True, v5=True)
    assert refused.value.reason_code == rc.PROTOCOL_ERROR
    check_options("$share/g/t", no_local=False, v5=True)
    check_options("t", no_local=True, v5=True)
    check_options("$share/g/t", no_local=True, v5=False)  # 3.1.1: an ordinary filter


def test_the_window_is_a_batch_for_qos_0_and_what_the_client_takes_for_qos_1_and_2() -> None:
    assert window(0, LIMITS, 10) == LIMITS.qos0_window
    assert window(1, LIMITS, 10) == 10
    assert window(2, LIMITS, 65535) == LIMITS.max_inflight
    assert window(1, replace(LIMITS, max_inflight=5), 10) == 5


def test_a_filter_subscribed_again_keeps_its_queue_unless_qos_0_without_acknowledgements_asks_for_more() -> None:
    assert keeps_its_queue(acknowledged=True, qos=2)
    assert keeps_its_queue(acknowledged=False, qos=0)
    assert not keeps_its_queue(acknowledged=False, qos=1)


@pytest.mark.parametrize(
    ("retain_handling", "shared", "new", "sent"),
    [
        (0, False, True, True),
        (0, False, False, True),
        (1, False, True, True),
        (1, False, False, False),
        (2, False, True, False),
        (0, True, True, False),
        (1, True, True, False),
    ],
)
def test_retained_messages_follow_retain_handling_and_never_go_to_a_shared_subscription(
    retain_handling: int, shared: bool, new: bool, sent: bool
) -> None:
    assert sends_retained(retain_handling, shared=shared, new=new) is sent


@pytest.mark.parametrize(
    ("qos", "persistent", "kept"),
    [(1, True, True), (2, True, True), (0, True, False), (1, False, False), (2, False, False), (0, False, False)],
)
def test_retained_messages_at_qos_1_and_2_of_a_persistent_session_are_kept_until_acknowledged(
    qos: int, persistent: bool, kept: bool
) -> None:
    assert keeps_retained(qos, persistent=persistent) is kept


def test_a_shared_subscriptions_queue_keeps_the_longest_expiry_of_its_members() -> None:
    assert longer_expiry(None, 0) == 0  # no queue yet: the member's own
    assert longer_expiry(300_000, 0) == 300_000  # a passing member does not shorten it
    assert longer_expiry(0, 300_000) == 300_000
    assert longer_expiry(-1, 300_000) == -1  # never expires
    assert longer_expiry(5_000, -1) == -1
