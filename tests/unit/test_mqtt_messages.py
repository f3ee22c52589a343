"""MQTT application messages ↔ core messages, and the session record."""

from __future__ import annotations

import json

import msgpack
import pytest

from tridentmq_mqtt import messages
from tridentmq_mqtt.protocol.packets import V5, Publish, encode
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_mqtt.state import SessionState, StoredSubscription, _literal_prefix
from tridentmq_shared.message import (
    M_ADDRESS,
    M_BODY,
    M_CONTENT_TYPE,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_PROTOCOL,
    M_ROUTING,
    RoutingType,
    check_message,
    new_message,
)

NOW = 1_700_000_000_000


def test_a_plain_publish_becomes_a_plain_message_and_back() -> None:
    m = messages.to_message("a.b", b"x", 1, NO_PROPERTIES, "c1", NOW)
    assert check_message(m) is None
    assert (m[M_BODY], m[M_DURABLE], m[M_EXPIRATION], m[M_PROTOCOL]) == (b"x", True, 0, "mqtt")
    assert messages.published_qos(m) == 1
    assert not messages.was_retained(m)
    assert messages.publish_properties(m, NOW, None) is NO_PROPERTIES


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_qos_0_is_not_durable_and_the_qos_survives(qos: int) -> None:
    m = messages.to_message("t", b"", qos, NO_PROPERTIES, "c", NOW, retain=True)
    assert m[M_DURABLE] is (qos > 0)
    assert messages.published_qos(m) == qos
    assert messages.was_retained(m)


def test_other_protocols_messages_have_a_qos_from_their_durability() -> None:
    assert messages.published_qos(new_message("t", b"", durable=True)) == 1
    assert messages.published_qos(new_message("t", b"", durable=False)) == 0
    assert messages.published_qos(new_message("t", b"", properties={messages.QOS: 7})) == 0  # not ours


def test_every_5_0_property_round_trips() -> None:
    props = Properties(
        payload_format_indicator=1,
        message_expiry_interval=30,
        content_type="text/plain",
        response_topic="r/1",
        correlation_data=b"\x00\x01",
        user_properties=(("a", "1"), ("b", "2")),
    )
    m = messages.to_message("t", b"hi", 1, props, "c", NOW)
    assert check_message(m) is None
    assert m[M_EXPIRATION] == NOW + 30_000
    assert m[M_CONTENT_TYPE] == "text/plain"
    assert m[M_PROPS]["a"] == "1"  # visible to other protocols as a plain property
    back = messages.publish_properties(m, NOW + 10_500, 7)
    assert back == Properties(
        payload_format_indicator=1,
        message_expiry_interval=20,
        content_type="text/plain",
        response_topic="r/1",
        correlation_data=b"\x00\x01",
        subscription_identifiers=(7,),
        user_properties=(("a", "1"), ("b", "2")),
    )


def test_repeated_or_clashing_user_property_names_keep_their_order() -> None:
    pairs = (("k", "1"), ("k", "2"), (messages.QOS, "mine"))
    m = messages.to_message("t", b"", 0, Properties(user_properties=pairs), "c", NOW)
    assert json.loads(m[M_PROPS][messages.USER_PROPERTIES]) == [list(p) for p in pairs]
    assert messages.publish_properties(m, NOW, None).user_properties == pairs


def test_more_user_properties_than_a_core_message_may_have_are_kept_together() -> None:
    """300 user properties made a core message the node finds malformed: it ended the client's session (DISCONNECT
    0x88), and the client sent the same message again at its reconnect, for ever."""
    pairs = tuple((f"p{n}", str(n)) for n in range(300))
    m = messages.to_message("t", b"", 1, Properties(user_properties=pairs), "c", NOW)
    assert check_message(m) is None
    assert messages.publish_properties(m, NOW, None).user_properties == pairs


def test_the_expiry_left_is_rounded_up_and_never_zero() -> None:
    m = messages.to_message("t", b"", 0, Properties(message_expiry_interval=2), "c", NOW)
    assert messages.publish_properties(m, NOW + 1, None).message_expiry_interval == 2
    assert messages.publish_properties(m, NOW + 1999, None).message_expiry_interval == 1


def test_properties_of_other_protocols_become_user_properties() -> None:
    m = new_message("t", b"", properties={"region": "eu", "n": 3, "flag": True, "raw": b"b"}, content_type="a/b")
    props = messages.publish_properties(m, NOW, None)
    assert props.user_properties == (("region", "eu"), ("n", "3"), ("flag", "true"), ("raw", "b"))
    assert props.content_type == "a/b"


def test_a_nul_in_another_protocols_property_becomes_a_replacement_character() -> None:
    """MQTT strings may not hold U+0000: an AMQP binary correlation-id or a STOMP header holding one made the
    PUBLISH fail to encode, and the message was dead-lettered for every MQTT subscriber."""
    properties = {"correlation_id": b"\x00\x01bin", "a\x00b": "c\x00d"}
    m = new_message("t", b"", properties=properties, content_type="text/\x00")
    props = messages.publish_properties(m, NOW, None)
    assert props.user_properties == (("correlation_id", "\ufffd\x01bin"), ("a\ufffdb", "c\ufffdd"))
    assert props.content_type == "text/\ufffd"
    publish = Publish("t", b"", 1, packet_id=1, properties=props)
    assert encode(publish, V5)  # encodes (it raised)


def test_the_session_record_round_trips() -> None:
    subscriptions = {
        "a/+": StoredSubscription(2, no_local=True, retain_as_published=True, subscription_id=9),
        "$share/g/b": StoredSubscription(0),
    }
    state = SessionState(subscriptions, {3: "mqtt:c:x"}, {65535: (123456789, "a/+")})
    assert SessionState.decode(state.encode()) == state
    assert SessionState.decode(SessionState().encode()) == SessionState()


def test_the_session_record_says_whether_the_session_has_an_outbox() -> None:
    state = SessionState(outbox=True)
    assert SessionState.decode(state.encode()).outbox is True
    older = msgpack.packb({"v": 1, "subs": {}, "in": {}, "out": {}})  # written before outboxes: it has none
    assert SessionState.decode(older).outbox is False
    assert b"outbox" not in SessionState().encode()  # an earlier gateway reads a record without one as before


def test_a_retained_message_copied_to_an_outbox_is_a_new_durable_message_of_that_queue_alone() -> None:
    published = messages.to_message("a.b", b"21", 2, Properties(message_expiry_interval=60), "pub", NOW, retain=True)
    stored = list(published)  # as the retained store holds it (``Registry.retain``)
    stored[M_ID], stored[M_ADDRESS], stored[M_DEDUP] = 41, "$mqtt.retained", "mqtt:pub:x"
    stored[M_PROPS] = {**published[M_PROPS], messages.TOPIC: "a/b"}
    copy = messages.retained_delivery(stored, "$mqtt.outbox.c._.0", 1, 7)
    assert check_message(copy) is None
    assert (copy[M_ID], copy[M_ADDRESS], copy[M_ROUTING], copy[M_DURABLE]) == (
        0,
        "$mqtt.outbox.c._.0",
        int(RoutingType.ANYCAST),
        True,
    )
    assert (copy[M_DEDUP], copy[M_BODY], copy[M_EXPIRATION]) == (None, b"21", stored[M_EXPIRATION])
    assert messages.published_qos(copy) == 1  # the QoS its subscription gets it at
    assert messages.was_retained(copy)
    assert messages.outbox_subscription_id(copy) == 7
    assert copy[M_PROPS][messages.TOPIC] == "a/b"
    assert messages.publish_properties(copy, NOW, 7).user_properties == ()  # none of this shows as a property
    assert stored[M_PROPS].get(messages.SUBSCRIPTION_ID) is None  # the store's copy is left alone
    assert messages.outbox_subscription_id(messages.retained_delivery(stored, "q", 2, None)) is None


def test_a_session_record_of_an_older_gateway_keeps_its_released_messages() -> None:
    """Records written before copies were told apart hold a bare message id: that message counts as the
    client's, whichever subscription's copy it is (as it did then)."""
    older = msgpack.packb({"v": 1, "subs": {}, "in": {}, "out": {7: 6}})
    assert SessionState.decode(older).released_out == {7: (6, None)}


@pytest.mark.parametrize(("topic_filter", "prefix"), [
    ("a/b", "a/b"), ("a/+/c", "a/"), ("a/#", "a"), ("#", ""), ("+/x", ""), ("a/b/#", "a/b"), ("/#", ""),
])  # fmt: skip
def test_retained_lookups_narrow_by_the_literal_prefix(topic_filter: str, prefix: str) -> None:
    assert _literal_prefix(topic_filter) == prefix


def test_another_protocols_original_encoding_is_not_shown() -> None:
    props = {"colour": "red", "$enc.amqp.properties": b"\x00\x53\x73\x45"}
    assert messages.user_properties(props) == (("colour", "red"),)


@pytest.mark.parametrize("response_topic", ["answers/+/#", "", "a\x00b", 7])
def test_a_response_topic_set_by_another_protocol_that_is_no_topic_name_is_not_sent(response_topic: object) -> None:
    """A STOMP header ``mqtt_response_topic:answers/+/#`` reached MQTT 5 subscribers as their Response Topic,
    which MQTT forbids ([MQTT-3.3.2-13/14]): what the gateway itself answers with 0x82 when a client sends it."""
    m = new_message("a", b"x", properties={"mqtt_response_topic": response_topic, "k": "v"})
    assert messages.publish_properties(m, NOW, None).response_topic is None
    good = new_message("a", b"x", properties={"mqtt_response_topic": "answers/1"})
    assert messages.publish_properties(good, NOW, None).response_topic == "answers/1"


def test_a_correlation_data_set_as_text_by_another_protocol_goes_as_its_utf8() -> None:
    """A STOMP replier echoes an MQTT requester's correlation data as a header, a string: it was dropped, and the
    requester could not match the answer."""
    m = new_message("a", b"x", properties={"mqtt_correlation_data": "req-1 é"})
    assert messages.publish_properties(m, NOW, None).correlation_data == "req-1 é".encode()
