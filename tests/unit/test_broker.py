"""Behaviour of the pure broker, driven through real link codecs (see ``broker_harness``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tests.unit.broker_harness import ANYCAST, BASE_MS, MULTICAST, Client, Delivery, Harness, bodies

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.broker import ORIGINAL_ADDRESS, ORIGINAL_QUEUE, ORIGINAL_REASON
from tridentmq_core.dedup import DuplicateIdCache
from tridentmq_core.security import AuthenticationError, Permission, SecurityManager, hash_password
from tridentmq_core.settings import (
    AddressSettingsEntry,
    BrokerSection,
    CoreSettings,
    PermissionEntry,
    UserEntry,
)
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.message import M_EXPIRATION, M_TIMESTAMP


def with_address_settings(**fields: Any) -> Harness:
    """A harness whose "#" address settings entry sets ``fields``."""
    return Harness(CoreSettings(address_settings=[AddressSettingsEntry(match="#", **fields)]))


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def c(h: Harness) -> Client:
    return h.connect("app")


def ok(answer: ev.Reply | ev.RequestFailed) -> Any:
    assert isinstance(answer, ev.Reply), answer
    return answer.result


def failed(answer: ev.Reply | ev.RequestFailed, code: str) -> str:
    assert isinstance(answer, ev.RequestFailed), answer
    assert answer.code == code, answer
    return answer.text


def ids(deliveries: list[Delivery]) -> list[int]:
    return [d.id for d in deliveries]


# ====================================================================== routing
def test_anycast_round_trip(c: Client) -> None:
    assert ok(c.create_queue("orders")) == {"created": True, "queue": "orders", "address": "orders"}
    cid = c.consumer("orders")
    seq = c.publish("orders", b"hello", routing=ANYCAST)
    assert seq in c.confirmed
    assert c.rejected == {}
    got = c.take(cid)
    assert len(got) == 1
    assert got[0].body == b"hello"
    assert got[0].count == 1
    assert got[0].id == 1  # first_message_id
    assert got[0].message[M_TIMESTAMP] == BASE_MS
    c.ack(cid, ids(got))
    assert c.take(cid) == []
    # Acked: nothing comes back when the consumer goes away and another one arrives.
    ok(c.unsubscribe(cid))
    cid2 = c.consumer("orders")
    assert c.take(cid2) == []


def test_publish_to_unknown_address_auto_creates_anycast_queue(c: Client) -> None:
    seq = c.publish("auto.created", b"first")
    assert seq in c.confirmed
    cid, answer = c.subscribe("auto.created")
    assert ok(answer) == {"queue": "auto.created", "address": "auto.created", "routing_type": ANYCAST}
    assert bodies(c.take(cid)) == [b"first"]


def test_multicast_each_queue_gets_a_copy(c: Client) -> None:
    ok(c.create_queue("news.a", "news", MULTICAST, durable=False))
    ok(c.create_queue("news.b", "news", MULTICAST, durable=False))
    a = c.consumer("news.a")
    b = c.consumer("news.b")
    c.send_all("news", [b"n1", b"n2"], routing=MULTICAST)
    assert bodies(c.take(a)) == [b"n1", b"n2"]
    assert bodies(c.take(b)) == [b"n1", b"n2"]


def test_anycast_two_queues_on_one_address_round_robin(c: Client) -> None:
    ok(c.create_queue("q1", "work"))
    ok(c.create_queue("q2", "work"))
    q1 = c.consumer("q1")
    q2 = c.consumer("q2")
    c.send_all("work", [b"m0", b"m1", b"m2", b"m3"], routing=ANYCAST)
    assert bodies(c.take(q1)) == [b"m0", b"m2"]
    assert bodies(c.take(q2)) == [b"m1", b"m3"]


def test_wildcard_queue_receives_matching_multicast(c: Client) -> None:
    ok(c.create_queue("all-a", "a.#", MULTICAST, durable=False))
    cid = c.consumer("all-a")
    c.send_all("a.b", [b"ab"], routing=MULTICAST)
    c.send_all("b.c", [b"bc"], routing=MULTICAST)
    c.send_all("a.b.c", [b"abc"], routing=MULTICAST)
    c.send_all("a", [b"a"], routing=MULTICAST)
    assert bodies(c.take(cid)) == [b"ab", b"abc", b"a"]


def test_fqqn_subscribe(c: Client) -> None:
    ok(c.create_queue("sub1", "news", MULTICAST, durable=False))
    ok(c.create_queue("sub2", "news", MULTICAST, durable=False))
    cid, answer = c.subscribe("news::sub1")
    assert ok(answer) == {"queue": "sub1", "address": "news", "routing_type": MULTICAST}
    c.send_all("news", [b"x"], routing=MULTICAST)
    got = c.take(cid)
    assert bodies(got) == [b"x"]
    # The other queue kept its own copy.
    assert bodies(c.take(c.consumer("sub2"))) == [b"x"]
    # A queue named through the wrong address is not found.
    failed(c.subscribe("other::sub1")[1], ErrorCode.NOT_FOUND)


# ====================================================================== credit and acknowledgement
def test_credit_limits_deliveries_until_flow(c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders", credit=2)
    c.send_all("orders", [b"m%d" % i for i in range(5)])
    assert bodies(c.take(cid)) == [b"m0", b"m1"]
    assert c.take(cid) == []
    c.flow(cid, 2)
    assert bodies(c.take(cid)) == [b"m2", b"m3"]
    c.flow(cid, 5)
    assert bodies(c.take(cid)) == [b"m4"]


def test_round_robin_between_two_consumers(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("orders"))
    first = c.consumer("orders")
    second = other.consumer("orders")
    c.send_all("orders", [b"m0", b"m1", b"m2", b"m3"])
    assert bodies(c.take(first)) == [b"m0", b"m2"]
    assert bodies(other.take(second)) == [b"m1", b"m3"]


def test_auto_ack_consumer_needs_no_ack(c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders", auto_ack=True)
    c.send_all("orders", [b"a", b"b"])
    assert bodies(c.take(cid)) == [b"a", b"b"]
    ok(c.unsubscribe(cid))
    assert c.take(c.consumer("orders")) == []


def test_unacked_messages_return_when_consumer_unsubscribes(c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a", b"b", b"c"])
    got = c.take(cid)
    assert [d.count for d in got] == [1, 1, 1]
    c.ack(cid, [got[1].id])
    ok(c.unsubscribe(cid))
    again = c.take(c.consumer("orders"))
    assert bodies(again) == [b"a", b"c"]
    assert [d.count for d in again] == [2, 2]
    assert ids(again) == [got[0].id, got[2].id]


def test_unacked_messages_return_when_session_closes(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    c.consumer("orders")
    c.send_all("orders", [b"a", b"b"])
    c.close()
    other = h.connect("other")
    again = other.take(other.consumer("orders"))
    assert bodies(again) == [b"a", b"b"]
    assert [d.count for d in again] == [2, 2]


def test_ack_of_unknown_consumer_is_an_error(c: Client) -> None:
    c.ack(99, [1])
    errors = c.events(ev.RequestFailed)
    assert [(e.req_id, e.code) for e in errors] == [(0, ErrorCode.NOT_FOUND)]


# ====================================================================== nack, redelivery, dead letters
def test_nack_redeliver_increments_delivery_count() -> None:
    h = with_address_settings(max_delivery_attempts=5)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a"])
    for expected in (1, 2, 3):
        got = c.take(cid)
        assert [d.count for d in got] == [expected]
        c.nack(cid, ids(got))
    assert [d.count for d in c.take(cid)] == [4]


def test_redelivery_delay_with_multiplier_and_cap() -> None:
    h = with_address_settings(max_delivery_attempts=10, redelivery_delay_ms=100, redelivery_multiplier=2.0,
                              max_redelivery_delay_ms=250)  # fmt: skip
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a"])
    got = c.take(cid)
    assert [d.count for d in got] == [1]
    for expected_delay, next_count in ((100, 2), (200, 3), (250, 4), (250, 5)):
        c.nack(cid, ids(got))
        start = h.now_ms
        assert c.take(cid) == []
        h.tick(start + expected_delay - 1)
        assert c.take(cid) == [], expected_delay
        h.tick(start + expected_delay)
        got = c.take(cid)
        assert [(d.body, d.count) for d in got] == [(b"a", next_count)], expected_delay


def test_max_delivery_attempts_moves_message_to_dlq() -> None:
    h = with_address_settings(max_delivery_attempts=3)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"poison", b"fine"], properties={"k": 7})
    counts = []
    for _ in range(3):
        got = [d for d in c.take(cid) if d.body == b"poison"]
        assert len(got) == 1
        counts.append(got[0].count)
        c.nack(cid, ids(got))
    assert counts == [1, 2, 3]
    assert c.take(cid) == []  # the poison message is gone from orders
    dlq = c.consumer("DLQ")
    dead = c.take(dlq)
    assert bodies(dead) == [b"poison"]
    assert dead[0].count == 1
    assert dead[0].props == {"k": 7, ORIGINAL_ADDRESS: "orders", ORIGINAL_QUEUE: "orders",
                             ORIGINAL_REASON: "max_deliveries"}  # fmt: skip
    assert dead[0].message[1] == "DLQ"


def test_nack_reject_goes_straight_to_dlq() -> None:
    h = with_address_settings(max_delivery_attempts=10)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"bad"])
    c.nack(cid, ids(c.take(cid)), NackMode.REJECT)
    assert c.take(cid) == []
    dead = c.take(c.consumer("DLQ"))
    assert bodies(dead) == [b"bad"]
    assert dead[0].props[ORIGINAL_REASON] == "rejected"
    assert dead[0].props[ORIGINAL_QUEUE] == "orders"


def test_nack_release_does_not_count_an_attempt() -> None:
    h = with_address_settings(max_delivery_attempts=2, redelivery_delay_ms=1000)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a"])
    for _ in range(4):
        got = c.take(cid)
        assert [d.count for d in got] == [1]  # released, immediately back, still the first attempt
        c.nack(cid, ids(got), NackMode.RELEASE)
    got = c.take(cid)
    c.nack(cid, ids(got), NackMode.REDELIVER)
    h.tick(h.now_ms + 1000)
    got = c.take(cid)
    assert [d.count for d in got] == [2]
    c.nack(cid, ids(got), NackMode.RELEASE)  # released after a failed attempt: keeps count 2
    got = c.take(cid)
    assert [d.count for d in got] == [2]
    c.nack(cid, ids(got), NackMode.REDELIVER)  # second counted attempt: dead
    h.tick(h.now_ms + 10_000)
    assert c.take(cid) == []
    assert bodies(c.take(c.consumer("DLQ"))) == [b"a"]


def test_empty_dead_letter_address_drops() -> None:
    h = with_address_settings(dead_letter_address="", max_delivery_attempts=1)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a", b"b"])
    got = c.take(cid)
    c.nack(cid, [got[0].id], NackMode.REDELIVER)
    c.nack(cid, [got[1].id], NackMode.REJECT)
    assert c.take(cid) == []
    assert "DLQ" not in h.broker.queues
    ok(c.unsubscribe(cid))
    assert c.take(c.consumer("orders")) == []
    assert h.broker.counters.dead_lettered == 2


# ====================================================================== expiry
def test_message_expired_at_dispatch_goes_to_expiry_queue(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"stale"], expiration_ms=h.now_ms - 1)
    c.send_all("orders", [b"fresh"], expiration_ms=h.now_ms + 60_000)
    assert bodies(c.take(cid)) == [b"fresh"]
    expired = c.take(c.consumer("ExpiryQueue"))
    assert bodies(expired) == [b"stale"]
    assert expired[0].props == {
        ORIGINAL_ADDRESS: "orders",
        ORIGINAL_QUEUE: "orders",
        ORIGINAL_REASON: "expired",
    }
    assert expired[0].message[M_EXPIRATION] == 0


def test_message_expires_on_tick_without_consumer(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"short"], expiration_ms=h.now_ms + 500)
    c.send_all("orders", [b"long"], expiration_ms=h.now_ms + 100_000)
    h.tick(h.now_ms + 400)
    assert "ExpiryQueue" not in h.broker.queues
    h.tick(h.now_ms + 1000)
    assert bodies(c.take(c.consumer("ExpiryQueue"))) == [b"short"]
    assert bodies(c.take(c.consumer("orders"))) == [b"long"]


def test_empty_expiry_address_drops() -> None:
    h = with_address_settings(expiry_address="")
    c = h.connect()
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"stale"], expiration_ms=h.now_ms - 1)
    cid = c.consumer("orders")
    assert c.take(cid) == []
    assert "ExpiryQueue" not in h.broker.queues
    assert h.broker.counters.expired == 1


# ====================================================================== ordering and queue kinds
@pytest.mark.parametrize("selector", [None, "n >= 0"])
def test_priorities_higher_first_fifo_within(c: Client, selector: str | None) -> None:
    ok(c.create_queue("orders"))
    for n, priority in enumerate((4, 9, 0, 9, 4, 0)):
        c.publish("orders", b"p%d-%d" % (priority, n), priority=priority, properties={"n": n})
    options: dict[str, Any] = {"selector": selector} if selector else {}
    got = c.take(c.consumer("orders", **options))
    assert bodies(got) == [b"p9-1", b"p9-3", b"p4-0", b"p4-4", b"p0-2", b"p0-5"]


def test_priority_of_returned_message_is_kept(c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders", credit=1)
    c.publish("orders", b"low", priority=1)
    got = c.take(cid)
    c.publish("orders", b"high", priority=8)
    c.nack(cid, ids(got), NackMode.RELEASE)
    c.flow(cid, 10)
    assert bodies(c.take(cid)) == [b"high", b"low"]


def test_message_groups_stick_and_move_when_owner_leaves(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("orders"))
    first = c.consumer("orders")
    second = other.consumer("orders")
    # Plain round-robin would alternate; groups keep each group on the consumer that got it first.
    for n, group in enumerate(["g1", "g1", "g1", "g2", "g2", "g1"]):
        c.publish("orders", b"%s-%d" % (group.encode(), n), group_id=group)
    got_first = c.take(first)
    got_second = other.take(second)
    assert bodies(got_first) == [b"g1-0", b"g1-1", b"g1-2", b"g1-5"]
    assert bodies(got_second) == [b"g2-3", b"g2-4"]
    c.ack(first, [got_first[0].id])
    c.publish("orders", b"g1-6", group_id="g1")
    assert bodies(c.take(first)) == [b"g1-6"]
    ok(c.unsubscribe(first))
    moved = other.take(second)
    assert [(d.body, d.count) for d in moved] == [(b"g1-1", 2), (b"g1-2", 2), (b"g1-5", 2), (b"g1-6", 2)]
    c.publish("orders", b"g1-7", group_id="g1")
    assert bodies(other.take(second)) == [b"g1-7"]


def test_exclusive_queue_delivers_to_first_consumer_and_fails_over(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("orders", exclusive=True))
    first = c.consumer("orders", credit=3)
    second = other.consumer("orders")
    c.send_all("orders", [b"m%d" % i for i in range(5)])
    got = c.take(first)
    assert bodies(got) == [b"m0", b"m1", b"m2"]
    assert other.take(second) == []  # the owner is out of credit, the others still get nothing
    c.ack(first, [got[0].id])
    ok(c.unsubscribe(first))
    moved = other.take(second)
    assert [(d.body, d.count) for d in moved] == [(b"m1", 2), (b"m2", 2), (b"m3", 1), (b"m4", 1)]


def test_last_value_queue_with_message_key(c: Client) -> None:
    ok(c.create_queue("prices", last_value_key=""))
    c.publish("prices", b"a1", last_value_key="A")
    c.publish("prices", b"b1", last_value_key="B")
    c.publish("prices", b"a2", last_value_key="A")
    c.publish("prices", b"x", properties={"sym": "A"})  # no last-value key field: kept as is
    c.publish("prices", b"a3", last_value_key="A")
    assert bodies(c.take(c.consumer("prices"))) == [b"b1", b"x", b"a3"]


def test_last_value_queue_with_property_key(c: Client) -> None:
    ok(c.create_queue("prices", last_value_key="sym"))
    c.publish("prices", b"a1", properties={"sym": "A"})
    c.publish("prices", b"b1", properties={"sym": "B"})
    c.publish("prices", b"a2", properties={"sym": "A"}, last_value_key="B")
    assert bodies(c.take(c.consumer("prices"))) == [b"b1", b"a2"]


def test_scheduled_delivery_waits_for_tick(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    seq = c.publish("orders", b"later", scheduled_ms=h.now_ms + 500)
    assert seq in c.confirmed
    c.publish("orders", b"now")
    assert bodies(c.take(cid)) == [b"now"]
    h.tick(h.now_ms + 499)
    assert c.take(cid) == []
    h.tick(h.now_ms + 1)
    got = c.take(cid)
    assert [(d.body, d.count) for d in got] == [(b"later", 1)]


def test_browse_sees_messages_without_removing_them(c: Client) -> None:
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"a", b"b", b"c"], properties={"n": 1})
    browser = c.consumer("orders", credit=10, browse=True)
    assert bodies(c.take(browser)) == [b"a", b"b", b"c"]
    assert [e.consumer_id for e in c.events(ev.BrowseDone)] == [browser]
    consumer = c.consumer("orders")
    got = c.take(consumer)
    assert [(d.body, d.count) for d in got] == [(b"a", 1), (b"b", 1), (b"c", 1)]


def test_browse_respects_credit_and_selector(c: Client) -> None:
    ok(c.create_queue("orders"))
    for n in range(4):
        c.publish("orders", b"m%d" % n, properties={"n": n})
    browser = c.consumer("orders", credit=1, browse=True, selector="n <> 1")
    assert bodies(c.take(browser)) == [b"m0"]
    assert c.events(ev.BrowseDone) == []
    c.flow(browser, 5)
    assert bodies(c.take(browser)) == [b"m2", b"m3"]
    assert len(c.events(ev.BrowseDone)) == 1


def test_consumer_selector_leaves_others_for_another_consumer(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    red = c.consumer("orders", selector="color = 'red'")
    c.send_all("orders", [b"r1"], properties={"color": "red"})
    c.send_all("orders", [b"b1"], properties={"color": "blue"})
    c.send_all("orders", [b"r2"], properties={"color": "red"})
    c.send_all("orders", [b"g1"], properties={"color": "green"})
    assert bodies(c.take(red)) == [b"r1", b"r2"]
    other = h.connect("other")
    blue = other.consumer("orders", selector="color = 'blue'")
    assert bodies(other.take(blue)) == [b"b1"]
    anything = other.consumer("orders")
    assert bodies(other.take(anything)) == [b"g1"]


def test_queue_filter(c: Client) -> None:
    ok(c.create_queue("eu", "events", MULTICAST, filter="region = 'eu'", durable=False))
    ok(c.create_queue("all", "events", MULTICAST, durable=False))
    c.send_all("events", [b"e1"], routing=MULTICAST, properties={"region": "eu"})
    c.send_all("events", [b"u1"], routing=MULTICAST, properties={"region": "us"})
    c.send_all("events", [b"n1"], routing=MULTICAST)
    assert bodies(c.take(c.consumer("eu"))) == [b"e1"]
    assert bodies(c.take(c.consumer("all"))) == [b"e1", b"u1", b"n1"]


# ====================================================================== transactions
def test_transacted_publishes_appear_on_commit(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    consumer = h.connect("consumer")
    cid = consumer.consumer("orders")
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    seqs = [c.publish("orders", b"t%d" % i, tx=tx) for i in range(2)]
    assert all(s in c.confirmed for s in seqs)
    assert consumer.take(cid) == []
    ok(c.tx_commit(tx))
    assert bodies(consumer.take(cid)) == [b"t0", b"t1"]
    failed(c.tx_commit(tx), ErrorCode.NOT_FOUND)  # the transaction is over


def test_transacted_publishes_dropped_on_rollback(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    c.publish("orders", b"gone", tx=tx)
    ok(c.tx_rollback(tx))
    c.publish("orders", b"kept")
    assert bodies(c.take(c.consumer("orders"))) == [b"kept"]


def test_transacted_acks_take_effect_on_commit(c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a", b"b"])
    got = c.take(cid)
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    c.ack(cid, ids(got), tx=tx)
    ok(c.tx_commit(tx))
    ok(c.unsubscribe(cid))
    assert c.take(c.consumer("orders")) == []


def test_transacted_acks_redelivered_on_rollback(c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a", b"b"])
    got = c.take(cid)
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    c.ack(cid, ids(got), tx=tx)
    assert c.take(cid) == []  # acked in a tx: still in flight, not redelivered
    ok(c.tx_rollback(tx))
    again = c.take(cid)
    assert sorted((d.body, d.count) for d in again) == [(b"a", 2), (b"b", 2)]


def test_transaction_errors(c: Client) -> None:
    ok(c.create_queue("orders"))
    failed(c.tx_commit(42), ErrorCode.NOT_FOUND)
    failed(c.tx_rollback(42), ErrorCode.NOT_FOUND)
    seq = c.publish("orders", b"x", tx=42)
    assert c.rejected[seq].code == ErrorCode.NOT_FOUND
    ok(c.tx_begin(7))
    failed(c.tx_begin(7), ErrorCode.EXISTS)
    cid = c.consumer("orders")
    assert c.take(cid) == []
    c.ack(cid, [1], tx=43)
    assert [e.code for e in c.events(ev.RequestFailed)] == [ErrorCode.NOT_FOUND]


# ====================================================================== duplicate detection
def test_duplicate_detection_confirms_both_stores_one(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    first = c.publish("orders", b"once", dedup_id="p1:1")
    second = c.publish("orders", b"once", dedup_id="p1:1")
    third = c.publish("orders", b"other", dedup_id="p1:2")
    assert {first, second, third} <= c.confirmed
    assert c.rejected == {}
    assert bodies(c.take(c.consumer("orders"))) == [b"once", b"other"]
    assert h.broker.counters.duplicates == 1


def test_duplicate_id_forgotten_after_window() -> None:
    h = Harness(CoreSettings(broker=BrokerSection(dedup_window_seconds=1.0)))
    c = h.connect()
    ok(c.create_queue("orders"))
    c.publish("orders", b"one", dedup_id="d")
    h.tick(h.now_ms + 1000)
    c.publish("orders", b"two", dedup_id="d")
    assert bodies(c.take(c.consumer("orders"))) == [b"one", b"two"]


def test_refused_message_does_not_burn_its_dedup_id() -> None:
    h = with_address_settings(auto_create_addresses=False, auto_create_queues=False)
    c = h.connect()
    seq = c.publish("orders", b"x", dedup_id="d1")
    assert c.rejected[seq].code == ErrorCode.NOT_FOUND
    ok(c.create_queue("orders"))
    retry = c.publish("orders", b"x", dedup_id="d1")
    assert retry in c.confirmed
    assert bodies(c.take(c.consumer("orders"))) == [b"x"]


# ====================================================================== security
USERS = [UserEntry("alice", "secret", ["app"]), UserEntry("bob", hash_password("pw", salt=b"salt", iterations=10),
                                                          ["reader"])]  # fmt: skip
GRANTS = [
    PermissionEntry("orders.#", "send", ["app"]),
    PermissionEntry("orders.#", "consume", ["app", "reader"]),
    PermissionEntry("#", "createAddress", ["app", "reader"]),
    PermissionEntry("#", "createDurableQueue", ["app", "reader"]),
    PermissionEntry("#", "browse", ["app"]),
]


@pytest.fixture
def secure() -> Harness:
    return Harness(CoreSettings(users=USERS, permissions=GRANTS))


def test_wrong_password_is_refused(secure: Harness) -> None:
    with pytest.raises(AuthenticationError):
        secure.connect("x", "alice", "wrong")
    with pytest.raises(AuthenticationError):
        secure.connect("x", "nobody", "secret")
    with pytest.raises(AuthenticationError):
        secure.connect("x", None, None)
    assert secure.connect("x", "alice", "secret").session.principal.name == "alice"
    assert secure.connect("y", "bob", "pw").session.principal.roles == frozenset({"reader"})
    with pytest.raises(AuthenticationError):
        secure.connect("x", "bob", "PW")


def test_send_without_permission_is_rejected_forbidden(secure: Harness) -> None:
    alice = secure.connect("alice", "alice", "secret")
    bob = secure.connect("bob", "bob", "pw")
    ok(alice.create_queue("orders.eu"))
    seq = bob.publish("orders.eu", b"nope")
    assert bob.rejected[seq].code == ErrorCode.FORBIDDEN
    assert seq not in bob.confirmed
    seq = alice.publish("elsewhere", b"nope")
    assert alice.rejected[seq].code == ErrorCode.FORBIDDEN
    alice.publish("orders.eu", b"yes")
    assert bodies(bob.take(bob.consumer("orders.eu"))) == [b"yes"]
    assert secure.broker.counters.rejected == 2


def test_consume_without_permission_is_forbidden(secure: Harness) -> None:
    alice = secure.connect("alice", "alice", "secret")
    bob = secure.connect("bob", "bob", "pw")
    ok(alice.create_queue("jobs"))
    failed(bob.subscribe("jobs")[1], ErrorCode.FORBIDDEN)
    failed(alice.subscribe("jobs")[1], ErrorCode.FORBIDDEN)
    failed(bob.subscribe("orders.x", browse=True)[1], ErrorCode.FORBIDDEN)
    ok(alice.subscribe("orders.x", browse=True)[1])


def test_permissions_match_wildcards() -> None:
    principal = SecurityManager(USERS, GRANTS).authenticate("alice", "secret", "10.0.0.1")
    assert principal.allowed(Permission.SEND, "orders.eu.fr")
    assert principal.allowed(Permission.SEND, "orders")
    assert not principal.allowed(Permission.SEND, "order")
    assert not principal.allowed(Permission.MANAGE, "orders.eu")


def test_embedded_default_accepts_only_loopback() -> None:
    security = SecurityManager([], [])
    assert security.embedded_default
    for peer in ("127.0.0.1", "::1", "127.0.0.5"):
        principal = security.authenticate("anyone", "anything", peer)
        assert principal.unrestricted
    for remote in ("10.0.0.1", "192.168.1.2", "example.com", None):
        with pytest.raises(AuthenticationError):
            security.authenticate(None, None, remote)
    with pytest.raises(AuthenticationError):
        Harness().connect("remote", peer="10.1.2.3")


# ====================================================================== errors
def test_subscribe_to_missing_queue_without_auto_create() -> None:
    h = with_address_settings(auto_create_queues=False)
    c = h.connect()
    failed(c.subscribe("missing")[1], ErrorCode.NOT_FOUND)
    assert "missing" not in h.broker.queues


def test_bad_selector_is_invalid(c: Client) -> None:
    ok(c.create_queue("orders"))
    failed(c.subscribe("orders", selector="color = ")[1], ErrorCode.INVALID)
    failed(c.create_queue("filtered", filter="((("), ErrorCode.INVALID)
    failed(c.subscribe("orders", selector=5)[1], ErrorCode.INVALID)
    assert "filtered" not in c.h.broker.queues


def test_create_queue_conflict_is_exists(c: Client) -> None:
    ok(c.create_queue("orders"))
    assert ok(c.create_queue("orders")) == {"created": False, "queue": "orders", "address": "orders"}
    failed(c.create_queue("orders", "elsewhere"), ErrorCode.EXISTS)
    failed(c.create_queue("orders", routing=MULTICAST), ErrorCode.EXISTS)


def test_oversized_message_is_rejected() -> None:
    h = Harness(CoreSettings(broker=BrokerSection(max_message_bytes=10)))
    c = h.connect()
    ok(c.create_queue("orders"))
    big = c.publish("orders", b"x" * 11)
    fits = c.publish("orders", b"x" * 10)
    assert c.rejected[big].code == ErrorCode.RESOURCE_LIMIT
    assert fits in c.confirmed
    assert bodies(c.take(c.consumer("orders"))) == [b"x" * 10]


def test_delete_queue_with_consumer_closes_it(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("orders"))
    cid = other.consumer("orders")
    c.send_all("orders", [b"a"])
    assert len(other.take(cid)) == 1
    ok(c.delete_queue("orders"))
    h.sync()
    closed = other.events(ev.ConsumerClosed)
    assert [(e.consumer_id, e.code) for e in closed] == [(cid, ErrorCode.NOT_FOUND)]
    assert "orders" not in h.broker.queues
    failed(c.delete_queue("orders"), ErrorCode.NOT_FOUND)
    other.ack(cid, [1])
    assert [e.code for e in other.events(ev.RequestFailed)] == [ErrorCode.NOT_FOUND]


def test_max_consumers(c: Client) -> None:
    ok(c.create_queue("orders", max_consumers=1))
    c.consumer("orders")
    failed(c.subscribe("orders")[1], ErrorCode.RESOURCE_LIMIT)
    c.consumer("orders", browse=True)  # browsers do not count


# ====================================================================== queue lifetimes
def test_temporary_queue_deleted_when_session_closes(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("reply.1", temporary=True))
    c.publish("reply.1", b"r")
    c.close()
    assert "reply.1" not in h.broker.queues
    assert ok(other.create_queue("reply.1")) == {"created": True, "queue": "reply.1", "address": "reply.1"}
    assert other.take(other.consumer("reply.1")) == []


def test_auto_delete_queue_removed_when_last_consumer_leaves_empty(h: Harness, c: Client) -> None:
    ok(c.create_queue("jobs", auto_delete=True))
    first = c.consumer("jobs")
    second = c.consumer("jobs")
    c.send_all("jobs", [b"a"])
    got = c.take(first) + c.take(second)
    c.ack(got[0].consumer_id, ids(got))
    ok(c.unsubscribe(first))
    assert "jobs" in h.broker.queues  # one consumer left
    ok(c.unsubscribe(second))
    assert "jobs" not in h.broker.queues
    assert ok(c.create_queue("jobs"))["created"] is True


def test_auto_delete_queue_kept_while_it_holds_messages(h: Harness, c: Client) -> None:
    ok(c.create_queue("jobs", auto_delete=True))
    cid = c.consumer("jobs")
    c.send_all("jobs", [b"a"])
    assert len(c.take(cid)) == 1
    ok(c.unsubscribe(cid))  # unacked: back in the queue
    assert "jobs" in h.broker.queues
    assert [(d.body, d.count) for d in c.take(c.consumer("jobs"))] == [(b"a", 2)]


def test_auto_created_queue_is_auto_deleted(h: Harness, c: Client) -> None:
    cid = c.consumer("scratch")
    ok(c.unsubscribe(cid))
    assert "scratch" not in h.broker.queues
    assert "scratch" not in h.broker.addresses


def test_settings_are_per_address() -> None:
    settings = CoreSettings(address_settings=[
        AddressSettingsEntry(match="#", max_delivery_attempts=5),
        AddressSettingsEntry(match="orders.#", max_delivery_attempts=1),
    ])  # fmt: skip
    h = Harness(dataclasses.replace(settings))
    c = h.connect()
    ok(c.create_queue("orders.eu"))
    ok(c.create_queue("other"))
    eu = c.consumer("orders.eu")
    other = c.consumer("other")
    c.send_all("orders.eu", [b"e"])
    c.send_all("other", [b"o"])
    c.nack(eu, ids(c.take(eu)))
    c.nack(other, ids(c.take(other)))
    assert c.take(eu) == []
    assert [d.count for d in c.take(other)] == [2]
    assert bodies(c.take(c.consumer("DLQ"))) == [b"e"]


def test_address_settings_fall_through_field_by_field() -> None:
    repo = AddressSettingsRepository([
        AddressSettingsEntry(match="#", max_delivery_attempts=5, dead_letter_address="DEAD"),
        AddressSettingsEntry(match="orders.#", redelivery_delay_ms=50),
        AddressSettingsEntry(match="orders.eu", max_delivery_attempts=2),
    ])  # fmt: skip
    eu = repo.resolve("orders.eu")
    assert (eu.max_delivery_attempts, eu.redelivery_delay_ms, eu.dead_letter_address) == (2, 50, "DEAD")
    us = repo.resolve("orders.us")
    assert (us.max_delivery_attempts, us.redelivery_delay_ms, us.dead_letter_address) == (5, 50, "DEAD")
    other = repo.resolve("other")
    assert (other.max_delivery_attempts, other.redelivery_delay_ms, other.expiry_address) == (
        5,
        0,
        "ExpiryQueue",
    )


def test_default_routing_type_multicast_for_auto_created_addresses() -> None:
    h = with_address_settings(default_routing_type="multicast")
    c = h.connect()
    c.publish("feed", b"lost")  # auto-created multicast address, no subscription yet: unrouted
    assert "feed" not in h.broker.queues
    assert h.broker.counters.unrouted == 1
    first = c.consumer("feed.s1", address="feed", routing_type=MULTICAST)
    second = c.consumer("feed.s2", address="feed", routing_type=MULTICAST)
    c.publish("feed", b"news")
    assert bodies(c.take(first)) == [b"news"]
    assert bodies(c.take(second)) == [b"news"]


def test_subscription_queue_auto_created_on_multicast_address(h: Harness, c: Client) -> None:
    cid, answer = c.subscribe("sub-1", address="topic", routing_type=MULTICAST)
    assert ok(answer) == {"queue": "sub-1", "address": "topic", "routing_type": MULTICAST}
    c.publish("topic", b"t", routing=MULTICAST)
    got = c.take(cid)
    assert bodies(got) == [b"t"]
    assert h.broker.queues["sub-1"].durable is False
    c.ack(cid, ids(got))
    ok(c.unsubscribe(cid))
    assert "sub-1" not in h.broker.queues


def test_dedup_cache_is_bounded_and_forgets() -> None:
    cache = DuplicateIdCache(window_ms=1000, max_entries=2)
    assert not cache.seen("a", 0)
    assert cache.seen("a", 999)
    assert not cache.seen("b", 10)
    assert not cache.seen("c", 20)  # evicts "a", the oldest
    assert len(cache) == 2
    assert not cache.seen("a", 30)
    cache.forget("a")
    assert not cache.seen("a", 40)
    cache.expire(1019)
    assert len(cache) == 2  # "c" is due at 1020: not yet
    cache.expire(1020)
    assert len(cache) == 1  # only "a" (due 1040) remains; "c" is due at 1020, "b" before
    assert cache.seen("a", 1021)
    assert not cache.seen("c", 1021)


# ====================================================================== regressions of fixed bugs
def test_failed_commit_applies_nothing_and_can_be_rolled_back() -> None:
    h = with_address_settings(auto_create_addresses=False, auto_create_queues=False)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    ok(c.tx_begin(1))
    c.publish("orders", b"ok", tx=1)
    c.publish("missing", b"bad", tx=1)
    failed(c.tx_commit(1), ErrorCode.NOT_FOUND)
    assert c.take(cid) == []
    failed(c.tx_commit(1), ErrorCode.NOT_FOUND)
    assert c.take(cid) == []
    ok(c.tx_rollback(1))
    c.publish("orders", b"after")
    assert bodies(c.take(cid)) == [b"after"]


def test_auto_delete_queue_kept_while_a_redelivery_is_delayed() -> None:
    h = with_address_settings(redelivery_delay_ms=100)
    c = h.connect()
    c.publish("jobs", b"a")  # auto-created queue, auto-delete
    cid = c.consumer("jobs")
    got = c.take(cid)
    c.nack(cid, ids(got))
    ok(c.unsubscribe(cid))
    h.tick(h.now_ms + 100)
    again = c.take(c.consumer("jobs"))
    assert [(d.body, d.count) for d in again] == [(b"a", 2)]


def test_auto_delete_queue_kept_while_a_message_is_scheduled(h: Harness, c: Client) -> None:
    cid = c.consumer("jobs")  # auto-created by the subscribe, auto-delete
    c.publish("jobs", b"later", scheduled_ms=h.now_ms + 100)
    ok(c.unsubscribe(cid))
    h.tick(h.now_ms + 100)
    assert bodies(c.take(c.consumer("jobs"))) == [b"later"]


def test_temporary_queue_needs_no_durable_queue_permission() -> None:
    grants = [PermissionEntry("#", "createAddress", ["r"]), PermissionEntry("#", "consume", ["r"])]
    h = Harness(CoreSettings(users=[UserEntry("u", "p", ["r"])], permissions=grants))
    c = h.connect("u", "u", "p")
    failed(c.create_queue("reply.u", temporary=True), ErrorCode.FORBIDDEN)  # needs createNonDurableQueue
    grants.append(PermissionEntry("#", "createNonDurableQueue", ["r"]))
    h = Harness(CoreSettings(users=[UserEntry("u", "p", ["r"])], permissions=grants))
    c = h.connect("u", "u", "p")
    ok(c.create_queue("reply.u", temporary=True))
    assert h.broker.queues["reply.u"].durable is False
    failed(c.create_queue("kept.u"), ErrorCode.FORBIDDEN)  # durable by default: needs createDurableQueue
    ok(c.create_queue("kept.u", durable=False))


def test_dead_letter_of_wildcard_queue_records_the_message_address() -> None:
    h = with_address_settings(max_delivery_attempts=1)
    c = h.connect()
    ok(c.create_queue("watch", "a.#", MULTICAST, durable=False))
    cid = c.consumer("watch")
    c.publish("a.b", b"x", routing=MULTICAST)
    c.nack(cid, ids(c.take(cid)))
    dead = c.take(c.consumer("DLQ"))
    assert bodies(dead) == [b"x"]
    assert dead[0].props[ORIGINAL_ADDRESS] == "a.b"
    assert dead[0].props[ORIGINAL_QUEUE] == "watch"


def test_last_value_queue_drops_a_superseded_message_that_comes_back(c: Client) -> None:
    ok(c.create_queue("prices", last_value_key=""))
    cid = c.consumer("prices", credit=1)
    c.publish("prices", b"a1", last_value_key="A")
    got = c.take(cid)
    assert bodies(got) == [b"a1"]
    c.publish("prices", b"a2", last_value_key="A")
    c.publish("prices", b"b1", last_value_key="B")
    c.nack(cid, ids(got), NackMode.RELEASE)  # a1 is stale now: a2 replaced it
    c.flow(cid, 10)
    assert bodies(c.take(cid)) == [b"a2", b"b1"]
    # A returned message that is still the latest value for its key does come back.
    c.publish("prices", b"a3", last_value_key="A")
    got = c.take(cid)
    assert bodies(got) == [b"a3"]
    ok(c.unsubscribe(cid))  # b1 and a3 come back; a2 was superseded by a3 while in flight
    assert [(d.body, d.count) for d in c.take(c.consumer("prices"))] == [(b"b1", 2), (b"a3", 2)]
