"""The MQTT session's QoS 1/2 PUBLISH packets to its client (``outbound``): packet ids, what the client already
has, waiting in order, and what PUBACK, PUBREC and PUBCOMP settle."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_mqtt.outbound import MAX_PACKET_ID, Copy, Outbound, packet_id


def test_a_packet_id_is_never_0_and_the_same_each_time_a_message_comes() -> None:
    assert packet_id(0) == 1
    assert packet_id(MAX_PACKET_ID - 1) == MAX_PACKET_ID
    assert packet_id(MAX_PACKET_ID) == 1  # wraps: the two collide
    assert packet_id(1 << 40) == packet_id(1 << 40)
    assert all(1 <= packet_id(m) <= MAX_PACKET_ID for m in range(0, 3 * MAX_PACKET_ID, 997))


def test_the_client_has_a_message_whose_pubrec_is_recorded_and_no_other_under_its_packet_id() -> None:
    outbound: Outbound[str] = Outbound()
    released: dict[int, Copy] = {packet_id(70_000): (70_000, "a")}
    assert outbound.client_has(70_000, "a", released)
    assert not outbound.client_has(70_000, "b", released)  # the same message for another subscription
    colliding = 70_000 + MAX_PACKET_ID  # the same packet id, another message
    assert packet_id(colliding) == packet_id(70_000)
    assert not outbound.client_has(colliding, "a", released)
    assert not outbound.client_has(70_001, "a", released)


def test_a_copy_recorded_by_an_older_gateway_is_the_clients_for_any_subscription() -> None:
    outbound: Outbound[str] = Outbound()
    released: dict[int, Copy] = {packet_id(9): (9, None)}
    assert outbound.client_has(9, "a", released)
    assert outbound.client_has(9, "b", released)


def test_a_completed_flow_frees_its_packet_id_and_the_client_still_has_the_message() -> None:
    """After the PUBCOMP the record goes, yet the core may deliver the message again (its ack was lost): the
    client must not get it twice."""
    outbound: Outbound[str] = Outbound()
    released: dict[int, Copy] = {packet_id(5): (5, "a")}
    outbound.sent(packet_id(5), "m5")
    assert outbound.completed(packet_id(5), released) == (5, "a")
    assert released == {}
    assert outbound.in_flight == {}
    assert outbound.client_has(5, "a", released)
    assert not outbound.client_has(5, "b", released)  # another subscription's copy still goes
    assert not outbound.client_has(6, "a", released)


def test_a_pubcomp_for_a_flow_never_recorded_frees_the_id_and_remembers_nothing() -> None:
    outbound: Outbound[str] = Outbound()
    outbound.sent(7, "m")
    assert outbound.completed(7, {}) is None
    assert outbound.in_flight == {}
    assert not outbound.client_has(6, "a", {})  # message 6 has packet id 7


def test_a_puback_settles_once() -> None:
    outbound: Outbound[str] = Outbound()
    outbound.sent(3, "m")
    assert outbound.acknowledged(3) == "m"
    assert outbound.acknowledged(3) is None
    assert outbound.acknowledged(4) is None


def test_waiting_packets_go_in_order_until_one_cannot() -> None:
    outbound: Outbound[str] = Outbound()
    assert not outbound.must_wait()
    outbound.parked.extend(["a", "b", "c", "d"])
    assert outbound.must_wait()
    taken: list[str] = []

    def send(out: str) -> bool:
        if out == "c":
            return False
        taken.append(out)
        return True

    assert outbound.unpark(send) == 2
    assert taken == ["a", "b"]
    assert outbound.parked == ["c", "d"]
    assert outbound.unpark(lambda out: False) == 0
    assert outbound.parked == ["c", "d"]


def test_an_ended_subscription_s_waiting_packets_are_dropped_and_the_others_keep_their_order() -> None:
    outbound: Outbound[tuple[str, int]] = Outbound()
    outbound.parked.extend([("s1", 1), ("s2", 2), ("s1", 3), ("s2", 4)])
    outbound.forget_parked(lambda out: out[0] == "s1")
    assert outbound.parked == [("s2", 2), ("s2", 4)]


@settings(max_examples=200, deadline=None)
@given(
    message_ids=st.lists(st.integers(min_value=0, max_value=4 * MAX_PACKET_ID), min_size=1, max_size=60),
    window=st.integers(min_value=1, max_value=8),
    ack_order=st.randoms(use_true_random=False),
)
def test_every_message_is_sent_once_in_the_order_it_came_and_no_two_share_a_packet_id(
    message_ids: list[int], window: int, ack_order: random.Random
) -> None:
    """As the session uses it: a new message waits behind waiting ones; one goes when the client's window
    has room and its packet id is free; each PUBACK (in any order) lets the waiting ones go."""
    outbound: Outbound[int] = Outbound()
    sent: list[int] = []

    def try_send(message_id: int) -> bool:
        packet = packet_id(message_id)
        if packet in outbound.in_flight or len(outbound.in_flight) >= window:
            return False
        outbound.sent(packet, message_id)
        sent.append(message_id)
        return True

    unique = list(dict.fromkeys(message_ids))  # the core delivers a message once while it is in flight
    for message_id in unique:
        if outbound.must_wait() or not try_send(message_id):
            outbound.parked.append(message_id)
        assert len(outbound.in_flight) <= window
        if ack_order.random() < 0.5 and outbound.in_flight:
            outbound.acknowledged(ack_order.choice(sorted(outbound.in_flight)))
            outbound.unpark(try_send)
    while outbound.in_flight:
        outbound.acknowledged(ack_order.choice(sorted(outbound.in_flight)))
        outbound.unpark(try_send)
    assert outbound.parked == []
    assert sent == unique
