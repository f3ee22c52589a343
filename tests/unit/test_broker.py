"""Behaviour of the pure broker, driven through real link codecs (see ``broker_harness``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from tests.unit.broker_harness import (
    ANYCAST,
    BASE_MS,
    MULTICAST,
    PUBLISH_WINDOW,
    Client,
    Harness,
    RecordingAudit,
    bodies,
    ids,
    recorded,
)

from tridentmq_core import queues
from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.audit_writer import FileAuditSink
from tridentmq_core.broker import Broker
from tridentmq_core.cluster.bridge import Bridge
from tridentmq_core.cluster.manager import ClusterManager
from tridentmq_core.dead_letters import ORIGINAL_ADDRESS, ORIGINAL_QUEUE, ORIGINAL_REASON
from tridentmq_core.dedup import DuplicateIdCache, TransferIds
from tridentmq_core.forwarder import FORWARD_QUEUE_PREFIX
from tridentmq_core.forwarding import DEDUP_PREFIX, FORWARD_PROPERTY, MOVES_PROPERTY, ForwardHeader
from tridentmq_core.management import NodeStatus, QueueRates, render_metrics
from tridentmq_core.queues import MESSAGE_OVERHEAD
from tridentmq_core.security import AuthenticationError, Permission, SecurityManager, hash_password
from tridentmq_core.settings import (
    AddressSettingsEntry,
    BrokerSection,
    CoreSettings,
    PermissionEntry,
    UserEntry,
)
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.loopback import is_loopback
from tridentmq_shared.message import HOME_PROPERTY, M_EXPIRATION, M_ID, M_TIMESTAMP, new_message
from tridentmq_shared.settings import SettingsError


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
    h = with_address_settings(
        max_delivery_attempts=10, redelivery_delay_ms=100, redelivery_multiplier=2.0, max_redelivery_delay_ms=250
    )
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
    assert dead[0].props == {
        "k": 7,
        ORIGINAL_ADDRESS: "orders",
        ORIGINAL_QUEUE: "orders",
        ORIGINAL_REASON: "max_deliveries",
    }
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


def test_a_redelivered_message_expired_at_dispatch_leaves_no_redelivery_count(h: Harness, c: Client) -> None:
    ok(c.create_queue("orders"))
    cid = c.consumer("orders", credit=1)
    c.send_all("orders", [b"short"], expiration_ms=h.now_ms + 500)
    c.nack(cid, ids(c.take(cid)))  # back at the head, its delivery counted for the next one
    queue = h.broker.queues["orders"]
    assert queue._returned
    h.now_ms += 1000  # expired, and no tick has swept the queue since
    c.flow(cid, 1)
    assert c.take(cid) == []
    assert bodies(c.take(c.consumer("ExpiryQueue"))) == [b"short"]
    assert not queue._returned


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


def test_expired_message_without_expiry_address_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    h = with_address_settings(expiry_address="", dead_letter_address="")
    c = h.connect()
    ok(c.create_queue("q"))
    with caplog.at_level(logging.DEBUG, logger="tridentmq.core.broker"):
        c.send_all("q", [b"stale"], expiration_ms=h.now_ms - 1)
        h.tick(h.now_ms + 10_000)
        assert [r.levelno for r in caplog.records if r.message == "message dropped"] == [logging.DEBUG]
        cid = c.consumer("q")
        c.send_all("q", [b"poison"])
        c.nack(cid, [d.id for d in c.take(cid)], NackMode.REJECT)
    assert [r.levelno for r in caplog.records if r.message == "message dropped"] == [logging.DEBUG, logging.WARNING]


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


@pytest.mark.parametrize(("credit", "selector"), [(3, None), (2, "n <> 1"), (2, "n <> 2")])
def test_a_browser_whose_last_credit_took_the_last_message_is_done_at_once(
    c: Client, credit: int, selector: str | None
) -> None:
    """Nothing more to send needs no credit: BROWSE_DONE waited for the browser's next FLOW."""
    ok(c.create_queue("orders"))
    for n in range(3):
        c.publish("orders", b"m%d" % n, properties={"n": n})
    browser = c.consumer("orders", credit=credit, browse=True, selector=selector)
    assert len(c.take(browser)) == credit
    assert [e.consumer_id for e in c.events(ev.BrowseDone)] == [browser]


def test_a_selector_match_beyond_the_scan_limit_is_delivered_by_the_next_ticks(h: Harness, c: Client) -> None:
    """A dispatch looks at SCAN_LIMIT messages at most; a match behind them waited for a publish, FLOW or
    consumer event, for ever on an idle queue. The scan goes on from where it stopped at the next ticks, each
    as bounded."""
    ok(c.create_queue("orders"))
    for _ in range(2 * queues.SCAN_LIMIT // PUBLISH_WINDOW):
        c.send_all("orders", [b"no"] * PUBLISH_WINDOW, properties={"n": 0})
    c.publish("orders", b"yes", properties={"n": 1})
    cid = c.consumer("orders", selector="n = 1")
    assert c.take(cid) == []  # the first SCAN_LIMIT only
    h.tick(h.now_ms + 50)
    assert c.take(cid) == []  # the next ones
    h.tick(h.now_ms + 50)
    assert bodies(c.take(cid)) == [b"yes"]
    h.tick(h.now_ms + 50)
    assert c.take(c.consumer("orders")) != []  # what it skipped is still there, in order


def test_a_scan_going_on_after_its_limit_still_sees_what_came_before_it(h: Harness, c: Client) -> None:
    """Where a cut scan goes on is forgotten when what it passed over may be taken now: a message of a higher
    priority, and a consumer that came."""
    ok(c.create_queue("orders"))
    c.publish("orders", b"first", properties={"n": 0})
    for _ in range(2 * queues.SCAN_LIMIT // PUBLISH_WINDOW):
        c.send_all("orders", [b"no"] * PUBLISH_WINDOW, properties={"n": 0})
    cid = c.consumer("orders", selector="n = 1")
    assert c.take(cid) == []  # cut at SCAN_LIMIT: it goes on from there
    c.publish("orders", b"urgent", properties={"n": 1}, priority=9)
    assert bodies(c.take(cid)) == [b"urgent"]
    assert c.take(cid) == []  # cut again
    other = c.consumer("orders", credit=1, selector="n = 0")
    assert bodies(c.take(other)) == [b"first"]


def test_a_browser_of_a_last_value_queue_finds_its_key_by_key(c: Client) -> None:
    """``sym = '<key>'`` on a queue keyed on ``sym`` (the MQTT retained store) offers that key's one message: the
    same as a scan would, newest value included, and also while a consumer holds some in flight (then it scans)."""
    ok(c.create_queue("prices", last_value_key="sym"))
    for round_ in range(2):
        c.send_all("prices", [b"%d-%d" % (round_, k) for k in range(50)], properties={"sym": "?"})
        for k in range(50):
            c.publish("prices", b"%d-%d" % (round_, k), properties={"sym": f"k{k}", "n": str(k)}, sync=False)
    c.publish("prices", b"it's", properties={"sym": "it's"})

    def browse(selector: str) -> list[bytes]:
        browser = c.consumer("prices", credit=100, browse=True, selector=selector)
        got = bodies(c.take(browser))
        assert len(c.events(ev.BrowseDone)) == 1
        assert not any(consumer.browse for consumer in c.h.broker.queues["prices"].consumers)  # ended with it
        return got

    assert browse("sym = 'k7'") == [b"1-7"]
    assert browse("sym = 'it''s'") == [b"it's"]
    assert browse("sym = 'k99'") == []
    assert browse("n = '7'") == [b"1-7"]  # not the key: a scan
    holder = c.consumer("prices", credit=3)
    assert len(c.take(holder)) == 3  # the oldest three keys are in flight now
    assert browse("sym = 'k7'") == [b"1-7"]
    assert browse("sym = '?'") == []  # in flight: a browser sees the queued messages only


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


def test_a_queue_filter_sees_the_timestamp_the_core_gives_a_message(h: Harness, c: Client) -> None:
    """A queue filter was applied before the core stamped the message's timestamp: a message without one of its
    own (every gateway's) had ``JMSTimestamp`` 0 for the filter and the publish time for consumers' selectors."""
    ok(c.create_queue("recent", "events", MULTICAST, filter=f"JMSTimestamp >= {BASE_MS}", durable=False))
    c.send_all("events", [b"now"], routing=MULTICAST)
    assert bodies(c.take(c.consumer("recent"))) == [b"now"]


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


@pytest.mark.parametrize("ack_order", [[0, 1, 2], [2, 0, 1]])
def test_a_rollback_redelivers_in_the_order_first_delivered(c: Client, ack_order: list[int]) -> None:
    """A rolled back transaction gave its messages back newest first: m2, m1, m0 (JMS and Artemis redeliver a
    rolled back session's messages in their order, as a consumer's going here does)."""
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"m0", b"m1", b"m2"])
    got = c.take(cid)
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    for n in ack_order:
        c.ack(cid, [got[n].id], tx=tx)
    ok(c.tx_rollback(tx))
    assert [d.body for d in c.take(cid)] == [b"m0", b"m1", b"m2"]


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


def test_a_transaction_holds_at_most_max_transaction_bytes_then_can_only_roll_back() -> None:
    """Staged publishes are held until the commit: a transaction that grew without one would hold memory
    without bound. Past the limit the publish is refused and the commit fails; a rollback ends it."""
    h = Harness(CoreSettings(broker=BrokerSection(max_transaction_bytes=3 * (100 + MESSAGE_OVERHEAD))))
    c = h.connect()
    ok(c.create_queue("orders"))
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    staged = [c.publish("orders", b"x" * 100, tx=tx) for _ in range(3)]
    assert all(seq in c.confirmed for seq in staged)
    over = c.publish("orders", b"x" * 100, tx=tx)
    assert c.rejected[over].code == ErrorCode.RESOURCE_LIMIT
    failed(c.tx_commit(tx), ErrorCode.RESOURCE_LIMIT)  # rollback-only
    ok(c.tx_rollback(tx))
    cid = c.consumer("orders")
    assert c.take(cid) == []
    again = c.conn.new_tx_id()  # a new transaction starts with nothing held
    ok(c.tx_begin(again))
    assert all(c.publish("orders", b"y" * 100, tx=again) in c.confirmed for _ in range(2))
    beside = c.conn.new_tx_id()  # the limit counts every open transaction of the session
    ok(c.tx_begin(beside))
    assert c.publish("orders", b"z" * 100, tx=beside) in c.confirmed
    assert c.rejected[c.publish("orders", b"z" * 100, tx=beside)].code == ErrorCode.RESOURCE_LIMIT
    ok(c.tx_commit(again))
    assert bodies(c.take(cid)) == [b"y" * 100] * 2


def test_a_session_has_at_most_max_open_transactions() -> None:
    h = Harness(CoreSettings(broker=BrokerSection(max_open_transactions=2)))
    c = h.connect()
    first, second, third = (c.conn.new_tx_id() for _ in range(3))
    ok(c.tx_begin(first))
    ok(c.tx_begin(second))
    failed(c.tx_begin(third), ErrorCode.RESOURCE_LIMIT)
    ok(c.tx_rollback(first))
    ok(c.tx_begin(third))
    other = h.connect("other")  # each session counts its own
    ok(other.tx_begin(other.conn.new_tx_id()))
    ok(other.tx_begin(other.conn.new_tx_id()))


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


def test_a_durable_queue_is_answered_for_and_advertised_only_once_its_record_is_safe() -> None:
    """A durable queue's creation was answered, and the queue told to the other nodes, before its record was
    on disk. A node killed in between came back without the queue, and what another node had confirmed for
    it meanwhile (stored there, to be forwarded) went nowhere: a 3-node CI run lost 20 acknowledged messages.
    The answer and the advertisement now wait for the record; a non-durable queue has nothing to wait for."""
    h, _, _ = recorded(hold_queues=True)
    manager = ClusterManager(
        h.broker, h.settings, node_id="node-1", name="one", advertise=("127.0.0.1", 1), schedule_flush=lambda: None
    )
    c = h.connect()
    made = c.conn.create_queue({"name": "news-c", "address": "news", "routing_type": MULTICAST, "durable": True})
    h.sync()
    assert not [e for e in c.inbox if getattr(e, "req_id", None) == made]  # not answered yet
    assert ("node-1", "news-c") not in manager._advertisement("node-2")  # nor told to other nodes
    assert ok(c.create_queue("scratch", durable=False))  # nothing to wait for
    version = h.broker.bindings_version
    h.broker.on_durable(3_000_001)  # its record is synced
    h.sync()
    assert [e for e in c.inbox if isinstance(e, ev.Reply) and e.req_id == made]
    assert ("node-1", "news-c") in manager._advertisement("node-2")
    assert h.broker.bindings_version > version  # which makes the node push it to the others
    assert not h.broker.catalog.unsynced
    # Its deletion too: a crash before its record is safe brings the queue back, with its messages.
    gone = c.conn.delete_queue("news-c")
    h.sync()
    assert not [e for e in c.inbox if getattr(e, "req_id", None) == gone]
    h.broker.on_durable(4_000_001)
    h.sync()
    assert [e for e in c.inbox if isinstance(e, ev.Reply) and e.req_id == gone]


class _PeerDeletes:
    """The cluster connection's link to node-2, as far as a DELETE_QUEUE_EVERYWHERE uses it."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    async def delete_queue(self, queue: str) -> None:
        self.deleted.append(queue)


async def test_a_queue_deleted_everywhere_is_answered_once_its_deletion_here_is_safe() -> None:
    """The answer waited for the other nodes' copies to go, not for this node's deletion record: a crash in
    between brought the copy here back (an MQTT clean start deletes its old session's queues so)."""
    h, _, _ = recorded(hold_queues=True)
    manager = ClusterManager(
        h.broker, h.settings, node_id="node-1", name="one", advertise=("127.0.0.1", 1), schedule_flush=lambda: None
    )
    bridge = Bridge(manager, "127.0.0.1", 9)
    bridge.node_id, bridge.state = "node-2", "up"
    peer = bridge.client = _PeerDeletes()  # type: ignore[assignment]
    manager.bridges[bridge.address] = manager.bridges_by_node["node-2"] = bridge
    try:
        c = h.connect()
        made = c.conn.create_queue({"name": "sub.c1", "address": "t", "routing_type": MULTICAST, "durable": True})
        h.broker.on_durable(3_000_001)
        h.sync()
        assert [e for e in c.inbox if isinstance(e, ev.Reply) and e.req_id == made]
        manager.bindings.replace("node-2", [["node-2", "sub.c1", "t", MULTICAST, None, 0, None, 1]])
        gone = c.conn.delete_queue("sub.c1", everywhere=True)
        h.sync()
        for _ in range(20):
            await asyncio.sleep(0)
        assert peer.deleted == ["sub.c1"]  # node-2 answered
        h.sync()
        assert not [e for e in c.inbox if getattr(e, "req_id", None) == gone]  # the deletion here is not safe yet
        h.broker.on_durable(4_000_001)
        h.sync()
        assert [e for e in c.inbox if isinstance(e, ev.Reply) and e.req_id == gone]
    finally:
        manager.bridges.clear()
        manager.bridges_by_node.clear()
        await manager.stop()


def test_a_duplicate_is_confirmed_only_once_the_first_copy_is_safe() -> None:
    """A reconnecting link client sends its unconfirmed publishes again, perhaps through another link while
    the first copy's record still waits for its sync. The duplicate was confirmed at once: a crash (or a
    failed write) before the sync lost a message its producer was told was safe."""
    h, store, _ = recorded(hold_messages=True)
    a, b = h.connect("a"), h.connect("b")
    ok(a.create_queue("orders", durable=True))
    first = a.publish("orders", b"x", durable=True, dedup_id="order-17")
    again = b.publish("orders", b"x", durable=True, dedup_id="order-17")
    assert len(store.messages) == 1
    assert first not in a.confirmed
    assert again not in b.confirmed
    h.broker.on_durable(2_000_001)  # the first copy's record is synced
    h.sync()
    assert first in a.confirmed
    assert again in b.confirmed
    assert h.broker.write_through.token_of("order-17") is None  # nothing kept once it is safe
    assert b.publish("orders", b"x", durable=True, dedup_id="order-17") in b.confirmed  # safe: at once
    # A non-durable message is stored nowhere: its duplicate has nothing to wait for.
    assert a.publish("orders", b"y", dedup_id="order-18") in a.confirmed
    assert b.publish("orders", b"y", dedup_id="order-18") in b.confirmed
    assert len(store.messages) == 1
    assert h.broker.counters.duplicates == 3


def test_a_transfer_sent_again_is_confirmed_only_once_the_first_copy_is_safe() -> None:
    """Another node sends its unconfirmed transfers again when its link drops: confirmed at once, the other
    node removed its copy while this node's was not yet on disk."""
    h, store, _ = recorded(hold_messages=True)
    node_a = h.connect("node-a")
    node_a.session.principal = dataclasses.replace(node_a.session.principal, cluster=True)
    ok(h.connect().create_queue("orders", durable=True))
    header = ForwardHeader("node-1", ("orders",), 1, "node-a:", numbered=True).encode()
    sent = []
    for _ in range(2):
        message = new_message("orders", b"m", durable=True, properties={FORWARD_PROPERTY: header})
        message[M_ID] = 78  # its id on node-a, which completes the transfer id
        sent.append(node_a.conn.publish(message))
    h.sync()
    assert len(store.messages) == 1
    assert not set(sent) & node_a.confirmed
    h.broker.on_durable(2_000_001)
    h.sync()
    assert set(sent) <= node_a.confirmed


def test_a_publish_sent_home_again_is_confirmed_only_once_the_first_copy_is_safe() -> None:
    """A publish for another node (``$link.home``) is stored here until it goes there: a second copy of it
    (its producer sending it again) waits for the first's record too."""
    h, store, _ = recorded(hold_messages=True)
    ClusterManager(
        h.broker, h.settings, node_id="node-1", name="one", advertise=("127.0.0.1", 1), schedule_flush=lambda: None
    )
    assert h.broker.cluster is not None
    h.broker.cluster.bindings.replace("node-2", [])
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    home = {HOME_PROPERTY: "node-2"}
    sent = [c.publish("orders", b"x", durable=True, dedup_id="$link:p:1", properties=home) for _ in range(2)]
    assert len(store.messages) == 1
    assert len(h.broker.forwarder.forward_queue("node-2", h.now_ms)) == 1
    assert not set(sent) & c.confirmed
    h.broker.on_durable(2_000_001)
    h.sync()
    assert set(sent) <= c.confirmed


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
USERS = [
    UserEntry("alice", "secret", ["app"]),
    UserEntry("bob", hash_password("pw", salt=b"salt", iterations=10), ["reader"]),
]
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
    assert ok(c.create_queue("orders")) == {
        "created": False,
        "queue": "orders",
        "address": "orders",
        "filter": None,
        "expires_ms": -1,
        "consumers": 0,
    }
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


def test_a_durable_body_the_store_cannot_hold_is_rejected_and_a_plain_one_passes() -> None:
    h = Harness(CoreSettings(broker=BrokerSection(max_message_bytes=10)))
    h.broker.admission.max_durable_body = 5  # the journal's segments are smaller than the message limit
    c = h.connect()
    ok(c.create_queue("orders"))
    durable = c.publish("orders", b"x" * 6, durable=True)
    plain = c.publish("orders", b"y" * 6)
    assert c.rejected[durable].code == ErrorCode.RESOURCE_LIMIT
    assert "exceeds 5 bytes" in c.rejected[durable].text
    assert plain in c.confirmed
    assert bodies(c.take(c.consumer("orders"))) == [b"y" * 6]


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
    settings = CoreSettings(
        address_settings=[
            AddressSettingsEntry(match="#", max_delivery_attempts=5),
            AddressSettingsEntry(match="orders.#", max_delivery_attempts=1),
        ]
    )
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


def test_temporary_addresses_never_auto_create_queues_unless_configured_to() -> None:
    assert AddressSettingsRepository([]).resolve("tmp.c0ffee.replies").auto_create_queues is False
    assert AddressSettingsRepository([]).resolve("orders").auto_create_queues is True
    repo = AddressSettingsRepository([AddressSettingsEntry(match="tmp.#", auto_create_queues=True)])
    assert repo.resolve("tmp.c0ffee.replies").auto_create_queues is True


def test_address_settings_fall_through_field_by_field() -> None:
    repo = AddressSettingsRepository(
        [
            AddressSettingsEntry(match="#", max_delivery_attempts=5, dead_letter_address="DEAD"),
            AddressSettingsEntry(match="orders.#", redelivery_delay_ms=50),
            AddressSettingsEntry(match="orders.eu", max_delivery_attempts=2),
        ]
    )
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


def test_dedup_cache_evicts_the_oldest_live_id_past_forgotten_and_renewed_ones() -> None:
    cache = DuplicateIdCache(window_ms=100, max_entries=2)
    assert not cache.seen("a", 0)
    assert not cache.seen("b", 50)
    assert not cache.seen("a", 150)  # a's window has passed: it arrives anew, the newest now
    assert not cache.seen("c", 160)  # evicts b, the oldest live id, not a's first arrival
    assert len(cache) == 2
    assert cache.seen("a", 170)
    cache.forget("c")
    assert not cache.seen("d", 180)  # room: c was forgotten, so nothing is evicted
    assert cache.seen("a", 190)
    assert cache.seen("d", 190)
    assert [dedup_id for dedup_id, _ in cache.entries()] == ["a", "d"]


def test_numbered_link_ids_are_runs_per_producer_exact_in_any_order() -> None:
    cache = DuplicateIdCache(window_ms=1000, max_entries=100)
    p, q = "$link:p1:", "$cluster:p:node-a:$link:q1:"  # a producer's own ids, and written through another node
    assert not any(cache.seen(f"{p}{n}", 0) for n in range(1, 1001))
    assert all(cache.seen(f"{p}{n}", 1) for n in (1, 500, 1000))
    assert not cache.seen(f"{p}1002", 2)  # 1001 is missing: a second run
    assert not cache.seen(f"{q}7", 2)
    assert len(cache) == 3
    assert not cache.seen(f"{p}1001", 3)  # fills the gap: one run again
    assert len(cache) == 2
    assert cache.seen(f"{p}1001", 3)
    assert not cache.seen(f"{p}0", 3)  # before the run, joins it
    cache.forget(f"{p}500")  # refused: a retry is no duplicate, its neighbours still are
    assert len(cache) == 3
    assert cache.seen(f"{p}499", 4)
    assert cache.seen(f"{p}501", 4)
    assert not cache.seen(f"{p}500", 4)
    assert len(cache) == 2
    assert sorted(cache.entries()) == [(f"{q}7-7", 2), (f"{p}0-1002", 4)]


def test_numbered_link_ids_survive_a_restart_as_runs_and_streams_expire_whole() -> None:
    cache = DuplicateIdCache(window_ms=1000, max_entries=100)
    for n in (*range(1, 51), *range(60, 71)):
        cache.seen(f"$link:a:{n}", 100)
    cache.seen("$link:b:1", 900)
    cache.seen("plain-id", 950)
    entries = cache.entries()
    assert ("$link:a:1-50", 100) in entries
    assert ("$link:a:60-70", 100) in entries
    again = DuplicateIdCache(window_ms=1000, max_entries=100)
    for dedup_id, arrived in entries:
        again.remember(dedup_id, arrived)
    assert again.seen("$link:a:25", 960)
    assert again.seen("$link:a:60", 960)
    assert again.seen("$link:b:1", 960)
    assert again.seen("plain-id", 960)
    again.expire(1_100)  # a arrived last at 100: forgotten whole; b (900) is not
    assert not again.seen("$link:a:25", 1_100)
    assert again.seen("$link:b:1", 1_100)
    assert not again.seen("$link:b:2", 1_100)


def test_numbered_link_ids_are_bounded_in_runs_least_recently_used_stream_first() -> None:
    cache = DuplicateIdCache(window_ms=10_000, max_entries=4)
    for n in (1, 3, 5):
        cache.seen(f"$link:a:{n}", 0)  # three runs
    cache.seen("$link:b:1", 1)
    cache.seen("$link:b:3", 2)  # five runs: a, the least recently used, goes
    assert len(cache) == 2
    assert not cache.seen("$link:a:1", 3)
    assert cache.seen("$link:b:3", 3)


def test_a_client_id_shaped_like_a_run_or_an_odd_number_is_one_plain_id() -> None:
    """Runs are read back only at a restart: a publish with the id "$link:<victim>:1-1000000000" must not make
    every later message of that producer a duplicate; odd digits must neither raise nor alias."""
    cache = DuplicateIdCache(window_ms=1000, max_entries=100)
    assert not cache.seen("$link:victim:1-1000000000", 0)
    assert not cache.seen("$link:victim:5", 1)
    assert cache.seen("$link:victim:1-1000000000", 2)
    for odd in ("$link:v:\u00b2", "$link:v:\u0667", "$link:v:007", "$link:v:" + "9" * 5000):  # ², Arabic-Indic 7
        assert not cache.seen(odd, 3)
        assert cache.seen(odd, 4)
    assert not cache.seen("$link:v:7", 5)  # not "007", nor the Arabic-Indic seven
    cache.remember("$link:w:10-5", 6)  # an inverted run is no run: one plain id
    assert not cache.seen("$link:w:7", 7)


def test_runs_read_back_in_any_order_merge_exactly() -> None:
    """A message stamped after a compaction's roll but journaled before its runs comes first at a restart."""
    cache = DuplicateIdCache(window_ms=1000, max_entries=1_000_000)
    cache.remember("$link:p:5000", 0)
    for first in range(1, 4000, 10):  # runs of 5 with gaps of 5, all below 5000
        cache.remember(f"$link:p:{first}-{first + 4}", 0)
    cache.remember("$link:p:3-12", 0)  # overlaps two runs and fills the gap between them
    assert len(cache) == 400
    expected = {5000, *range(3, 13), *(n for first in range(1, 4000, 10) for n in range(first, first + 5))}
    assert [n for n in range(5002) if cache.seen(f"$link:p:{n}", 1)] == sorted(expected)


def test_numbered_ids_match_a_set_under_random_seen_and_forget() -> None:
    rng = random.Random(7)
    for _ in range(50):
        cache, truth = DuplicateIdCache(window_ms=10**9, max_entries=10**6), set()
        for _ in range(400):
            number = rng.randrange(60)
            if rng.random() < 0.2:
                cache.forget(f"$link:p:{number}")
                truth.discard(number)
            else:
                assert cache.seen(f"$link:p:{number}", 0) == (number in truth)
                truth.add(number)
        again = DuplicateIdCache(window_ms=10**9, max_entries=10**6)
        for dedup_id, arrived in cache.entries():
            again.remember(dedup_id, arrived)
        assert [n for n in range(60) if again.seen(f"$link:p:{n}", 0)] == sorted(truth)


def test_too_many_runs_drop_other_streams_then_the_oldest_half_never_the_number_just_seen() -> None:
    cache = DuplicateIdCache(window_ms=10**9, max_entries=10)
    cache.seen("$link:old:1", 0)
    for n in range(0, 40, 2):  # a gappy stream (another node's transfers, round robin): a run each
        assert not cache.seen(f"$link:p:{n}", 1)
        assert cache.seen(f"$link:p:{n}", 1)
    assert len(cache) <= 10
    assert not cache.seen("$link:old:1", 2)  # the least recently used stream went first
    assert cache.seen("$link:p:38", 2)


def test_transfer_ids_are_kept_per_node_for_at_least_the_window() -> None:
    ids = TransferIds(window_ms=100, max_entries=1_000)
    ids.expire(0)  # the first generation begins
    assert not ids.seen("a:", 7, 0)
    assert ids.seen("a:", 7, 10)
    assert not ids.seen("b:", 7, 10)  # another node's 7
    ids.expire(99)
    assert ids.seen("a:", 7, 99)
    ids.expire(100)  # a new generation: the old one is still remembered
    assert ids.seen("a:", 7, 150)
    assert not ids.seen("a:", 8, 150)
    ids.expire(199)
    assert ids.seen("a:", 7, 199)
    ids.expire(200)  # 7 arrived two generations ago: forgotten; 8, one generation ago, is not
    assert not ids.seen("a:", 7, 200)
    assert ids.seen("a:", 8, 200)
    ids.forget("a:", 8)
    ids.forget("a:", 7)
    assert not ids.seen("a:", 8, 201)
    assert not ids.seen("a:", 7, 201)


def test_transfer_ids_are_bounded_keeping_the_newest_half() -> None:
    ids = TransferIds(window_ms=10_000, max_entries=10)
    for number in range(12):
        assert not ids.seen("a:", number, 0)
    assert len(ids) <= 10
    assert all(ids.seen("a:", number, 0) for number in range(7, 12))  # the newest five at least
    assert not ids.seen("a:", 0, 0)


def _orders_with_a_peer() -> tuple[Harness, Client, Client, int]:
    """A broker with the queue "orders", a client auto-acking it, and another node's link ("node-a")."""
    h = Harness()
    node_a = h.connect("node-a")
    node_a.session.principal = dataclasses.replace(node_a.session.principal, cluster=True)
    c = h.connect()
    ok(c.create_queue("orders"))
    return h, node_a, c, c.consumer("orders", auto_ack=True)


def test_a_transfer_sent_again_is_a_duplicate_and_a_durable_one_journals_its_transfer_id() -> None:
    """Another node re-sends what it sent when its link dropped: numbered headers, non-durable and durable."""
    h, node_a, c, cid = _orders_with_a_peer()
    header = ForwardHeader("node-1", ("orders",), 1, "node-a:", numbered=True).encode()
    sent = []
    for durable, number in ((False, 77), (True, 78), (False, 79)):
        for _ in range(2):
            message = new_message(
                "orders", f"m{number}".encode(), durable=durable, properties={FORWARD_PROPERTY: header}
            )
            message[M_ID] = number  # its id on node-a, which completes the transfer id
            sent.append(node_a.conn.publish(message))
    h.sync()
    assert set(sent) <= node_a.confirmed
    got = c.take(cid)
    assert bodies(got) == [b"m77", b"m78", b"m79"]
    assert all(FORWARD_PROPERTY not in d.props for d in got)
    assert h.broker.counters.duplicates == 3
    # What a restart remembers: the durable one's transfer id (the others are lost with the node anyway).
    assert [dedup_id for dedup_id, _ in h.broker.durable_snapshot().dedup_ids] == [DEDUP_PREFIX + "node-a:78"]


def test_a_moved_message_counts_its_move_as_a_delivery_attempt_and_a_forwarded_publish_does_not() -> None:
    """A move's sender takes the message back and delivers it again, flagged, when the confirm is lost; the copy
    stored here must be flagged too. A forwarded publish is sent again instead (a duplicate here): no count.
    A message that keeps moving counts the moves once."""
    h, node_a, c, cid = _orders_with_a_peer()

    def transfer(number: int, *, moves: int = 0, delivered: int = 0) -> list[int]:
        node_part = "node-a:orders:" if moves else "node-a:"  # a move's transfer id names its queue
        header = ForwardHeader("node-1", ("orders",), 1, node_part, delivered, numbered=True).encode()
        props: dict[str, Any] = {FORWARD_PROPERTY: header} | ({MOVES_PROPERTY: moves} if moves else {})
        message = new_message("orders", b"m%d" % number, properties=props)
        message[M_ID] = number
        node_a.conn.publish(message)
        h.sync()
        return [d.count for d in c.take(cid)]

    assert transfer(1, moves=1) == [2]
    assert transfer(2) == [1]
    assert transfer(3, moves=4, delivered=1) == [2]
    assert transfer(4, moves=1, delivered=3) == [4]


def test_a_scheduled_message_moved_here_keeps_its_delivery_attempts() -> None:
    """A move carries the attempts a message had; a scheduled one waited for its time without them, and its
    next delivery here went out unflagged (count 1) although it may have been delivered over there."""
    h, node_a, c, cid = _orders_with_a_peer()
    header = ForwardHeader("node-1", ("orders",), 1, "node-a:orders:", 2, numbered=True).encode()
    message = new_message(
        "orders", b"later", properties={FORWARD_PROPERTY: header, MOVES_PROPERTY: 1}, scheduled_ms=h.now_ms + 500
    )
    message[M_ID] = 7
    node_a.conn.publish(message)
    h.sync()
    assert c.take(cid) == []
    h.tick(h.now_ms + 500)
    assert [(d.body, d.count) for d in c.take(cid)] == [(b"later", 3)]


def test_a_recovered_scheduled_message_keeps_its_delivery_attempts() -> None:
    h = Harness()
    state = RecoveredState()
    state.addresses["orders"] = ([0], False)
    state.queues["orders"] = {"name": "orders", "address": "orders", "routing_type": 0}
    message = new_message("orders", b"later", durable=True, scheduled_ms=h.now_ms + 500)
    message[M_ID] = 1
    state.messages[1] = message
    state.references["orders"] = {1: 2}
    h.broker.restore(state, h.now_ms)
    assert [counts for _, _, counts in h.broker.durable_snapshot().messages] == [[2]]  # a compaction keeps it
    c = h.connect()
    cid = c.consumer("orders")
    h.tick(h.now_ms + 500)
    assert [(d.body, d.count) for d in c.take(cid)] == [(b"later", 3)]


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


def test_a_send_whose_auto_created_queue_would_take_the_name_of_a_queue_elsewhere_is_refused(
    h: Harness, c: Client
) -> None:
    """A publish to the address "orders" made its queue "orders" over the one of that name bound to "shop": the
    first queue, its messages and its consumers were no longer reachable by name (nor expired, nor deleted)."""
    ok(c.create_queue("orders", "shop"))
    c.publish("shop", b"kept")
    seq = c.publish("orders", b"refused")
    assert c.rejected[seq].code == ErrorCode.EXISTS
    ok(c.tx_begin(1))
    c.publish("shop", b"in tx", tx=1)
    c.publish("orders", b"refused too", tx=1)
    failed(c.tx_commit(1), ErrorCode.EXISTS)  # before anything of it is applied
    ok(c.tx_rollback(1))
    assert "orders" not in h.broker.addresses
    queue = h.broker.queues["orders"]
    assert queue.address == "shop"
    assert bodies(c.take(c.consumer("orders"))) == [b"kept"]


def test_a_dead_letter_address_named_like_a_queue_elsewhere_leaves_that_queue_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = with_address_settings(max_delivery_attempts=1)
    c = h.connect()
    ok(c.create_queue("DLQ", "errors"))
    c.publish("errors", b"kept")
    ok(c.create_queue("work"))
    cid = c.consumer("work")
    c.publish("work", b"poison")
    c.nack(cid, ids(c.take(cid)))
    assert "message dropped" in caplog.text  # as for any dead-letter address that refuses the copy
    assert len(h.broker.queues["work"]) == 0
    assert h.broker.queues["DLQ"].address == "errors"
    assert bodies(c.take(c.consumer("DLQ"))) == [b"kept"]


def test_an_empty_store_and_forward_queue_restored_from_the_journal_is_the_one_used(h: Harness) -> None:
    """Looked up with ``or``, an empty restored queue (a falsy one) was made again: a second queue of its name."""
    state = RecoveredState()
    name = FORWARD_QUEUE_PREFIX + "node-2"
    state.addresses[name] = ([0], False)
    state.queues[name] = {"name": name, "address": name, "routing_type": 0}
    h.broker.restore(state, h.now_ms)
    restored = h.broker.queues[name]
    assert h.broker.forwarder.forward_queue("node-2", h.now_ms) is restored


def test_a_durable_delivery_whose_attempt_is_safe_at_once_is_sent() -> None:
    """A store that reports a delivery attempt as safe at once (0) made the delivery vanish: it was sent only
    if already in flight, and it became in flight only after."""
    h = Harness()  # the memory store: everything is "safe" at once
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.publish("orders", b"kept", durable=True)
    got = c.take(cid)
    assert bodies(got) == [b"kept"]
    c.ack(cid, ids(got))
    assert len(h.broker.queues["orders"]) == 0


def test_a_dispatch_records_its_delivery_attempts_at_once_and_an_ack_batch_its_acks() -> None:
    """One store call (one journal record) per dispatch and per ack batch, not per message; the deliveries
    go out only once their attempts are safe."""
    h, store, _ = recorded(hold_attempts=True)
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    c.send_all("orders", [b"a", b"b", b"c"], durable=True)
    c.publish("orders", b"plain")  # not durable: no attempt recorded, and it waits behind those that are
    cid = c.consumer("orders")
    assert store.attempts == [("orders", [1, 2, 3], [1, 1, 1])]
    assert c.take(cid) == []
    h.broker.on_durable(1)
    h.sync()
    got = c.take(cid)
    assert bodies(got) == [b"a", b"b", b"c", b"plain"]
    c.ack(cid, ids(got))
    h.sync()
    assert store.acks == [("orders", [1, 2, 3])]
    assert len(h.broker.queues["orders"]) == 0


def test_a_plain_message_waits_behind_its_consumers_durable_deliveries_across_dispatches() -> None:
    """FIFO per producer and queue: a durable message goes out once its delivery attempt is safe, and a plain
    one sent after it, dispatched at once, overtook it by up to a window (a producer alternating the two got
    1, 3, 5 ... and then 0, 2, 4 ...). It now waits behind its consumer's held deliveries, even those of an
    earlier dispatch, and goes with the newest record; another consumer's plain messages do not wait."""
    h, store, _ = recorded(hold_attempts=True)
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    cid = c.consumer("orders", credit=100)
    for n in range(6):
        c.publish("orders", b"%d" % n, durable=n % 2 == 0)
    assert c.take(cid) == []  # 0 waits for its attempt's record, and 1 to 5 behind it
    assert [attempt[1] for attempt in store.attempts] == [[1], [3], [5]]  # only durable ones are recorded
    got = []
    for token in (1, 2, 3):  # records are safe in the order they were written
        h.broker.on_durable(token)
        h.sync()
        got += c.take(cid)
        assert bodies(got) == [b"%d" % n for n in range(2 * token)]
    c.publish("orders", b"6")  # nothing held any more: at once
    got += c.take(cid)
    assert bodies(got)[-1] == b"6"
    other = h.connect()
    ok(other.create_queue("plain-only", durable=True))
    pid = other.consumer("plain-only")
    c.publish("orders", b"7", durable=True)  # held for c's consumer...
    other.publish("plain-only", b"x")  # ...not for another's
    assert bodies(other.take(pid)) == [b"x"]


def test_durable_and_plain_messages_keep_their_order_when_attempts_are_safe_at_once() -> None:
    """Without a journal the attempts of durable messages are safe at once: collected for one record, they
    must still go out before a plain message that came after them."""
    h, _, _ = recorded()
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    c.publish("orders", b"1", durable=True)
    c.publish("orders", b"2")
    c.publish("orders", b"3", durable=True)
    cid = c.consumer("orders")
    assert bodies(c.take(cid)) == [b"1", b"2", b"3"]


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


def test_a_superseded_message_that_comes_back_after_its_successor_was_acked_is_dropped(h: Harness, c: Client) -> None:
    """The newer value consumed and acknowledged meanwhile left no entry for its key: the stale value that came
    back was queued again and delivered after the newer one."""
    other = h.connect("other")
    ok(c.create_queue("prices", last_value_key=""))
    first = c.consumer("prices", credit=1)
    c.publish("prices", b"a1", last_value_key="A")
    stale = c.take(first)
    c.publish("prices", b"a2", last_value_key="A")
    second = other.consumer("prices", credit=1)
    newer = other.take(second)
    assert bodies(newer) == [b"a2"]
    other.ack(second, ids(newer))
    c.nack(first, ids(stale), NackMode.RELEASE)
    other.flow(second, 5)
    assert other.take(second) == []
    queue = h.broker.queues["prices"]
    assert (len(queue), queue.acked) == (0, 2)


# ====================================================================== memory limit
def message_cost(body: bytes) -> int:
    return len(body) + MESSAGE_OVERHEAD


def record_credit_grants(monkeypatch: pytest.MonkeyPatch, client: Client) -> list[int]:
    """The PUBLISH_CREDIT grants ``client`` receives from now on (the harness drops them)."""
    grants: list[int] = []
    receive = client.receive

    def recording(events: list[ev.Event]) -> None:
        grants.extend(e.credit for e in events if isinstance(e, ev.PublishCreditGranted))
        receive(events)

    monkeypatch.setattr(client, "receive", recording)
    return grants


def with_memory_limit(limit: int, **fields: Any) -> Harness:
    return Harness(
        CoreSettings(
            broker=BrokerSection(max_memory_bytes=limit), address_settings=[AddressSettingsEntry(match="#", **fields)]
        )
    )


def test_memory_limit_withholds_publish_credit_until_usage_is_under_90_percent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = with_memory_limit(2000)  # resumes under 1800
    c = h.connect()
    grants = record_credit_grants(monkeypatch, c)
    ok(c.create_queue("orders"))
    big = b"x" * (1800 - MESSAGE_OVERHEAD)
    c.publish("orders", big)
    assert h.broker.memory.used == 1800
    assert grants == [1]
    assert c.conn.publish_credit == PUBLISH_WINDOW
    # This batch takes usage to the limit: accepted, but its credit is withheld.
    seq = c.publish("orders", b"")
    assert seq in c.confirmed
    assert h.broker.memory.used == 1800 + MESSAGE_OVERHEAD
    assert grants == [1]
    assert c.conn.publish_credit == PUBLISH_WINDOW - 1
    c.send_all("orders", [b"", b""])  # still within the window the client holds: withheld too
    assert h.broker.memory.used == 1800 + 3 * MESSAGE_OVERHEAD
    assert grants == [1]
    assert c.conn.publish_credit == PUBLISH_WINDOW - 3
    cid = c.consumer("orders")
    got = c.take(cid)
    assert bodies(got) == [big, b"", b"", b""]
    assert h.broker.memory.used == 1800 + 3 * MESSAGE_OVERHEAD  # in flight still counts
    c.ack(cid, ids(got[1:]))
    assert h.broker.memory.used == 1800  # exactly 90 %: not under it, still blocked
    assert grants == [1]
    assert c.conn.publish_credit == PUBLISH_WINDOW - 3
    # The last ack, handled without flush_dispatch: memory is released, the credit waits for the flush.
    c.conn.ack(cid, [got[0].id], 0)
    h.broker.handle(c.session, c.server.receive_data(c.conn.data_to_send(), h.now_s), h.now_ms)
    assert h.broker.memory.used == 0
    assert c.session not in h.broker.dirty
    h.broker.flush_dispatch(h.now_ms)
    assert c.session in h.broker.dirty
    h.sync()
    assert grants == [1, 3]
    assert c.conn.publish_credit == PUBLISH_WINDOW
    c.publish("orders", b"again")
    assert grants == [1, 3, 1]


def test_the_publish_byte_window_is_topped_up_after_each_batch_and_withheld_with_the_credit() -> None:
    h = with_memory_limit(3000)
    c = h.connect(publish_bytes=1000)
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"x" * 600, b"x" * 600])  # the second starts with 400 left and overdraws
    assert (c.conn.publish_credit, c.conn.publish_bytes) == (PUBLISH_WINDOW, 1000)  # all given back
    c.send_all("orders", [b"x" * 900])
    assert h.broker.memory.used > 2000
    c.send_all("orders", [b"x" * 900])  # usage passes the limit: neither messages nor bytes come back
    assert (c.conn.publish_credit, c.conn.publish_bytes) == (PUBLISH_WINDOW - 1, 100)
    assert c.conn.can_publish
    c.send_all("orders", [b"x" * 200])
    assert (c.conn.publish_credit, c.conn.publish_bytes, c.conn.can_publish) == (PUBLISH_WINDOW - 2, -100, False)
    cid = c.consumer("orders", credit=10)
    c.ack(cid, ids(c.take(cid)))
    h.broker.flush_dispatch(h.now_ms)
    h.sync()
    assert (c.conn.publish_credit, c.conn.publish_bytes) == (PUBLISH_WINDOW, 1000)


def test_a_consumer_window_in_bytes_holds_deliveries_until_flow_returns_bytes(c: Client) -> None:
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"x" * 60] * 6)
    cid = c.consumer("orders", credit=10, credit_bytes=100)
    assert len(c.take(cid)) == 2  # the second starts with 40 bytes left and overdraws
    c.flow(cid, 0, 60)  # 40 bytes: one more
    assert len(c.take(cid)) == 1
    c.flow(cid, 3)  # messages alone do not help while the bytes are used up
    assert c.take(cid) == []
    c.flow(cid, 0, 1000)  # capped at the window: 100 bytes, two more
    assert len(c.take(cid)) == 2
    c.flow(cid, 0, 1000)
    assert len(c.take(cid)) == 1  # the last one
    assert c.conn.consumer_credit[cid] == 10 + 3 - 6


def test_a_byte_window_bounds_auto_ack_consumers_and_browsers(c: Client) -> None:
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"x" * 500] * 4)
    browser = c.consumer("orders", credit=10, credit_bytes=600, browse=True)
    assert len(c.take(browser)) == 2
    cid = c.consumer("orders", credit=10, credit_bytes=400, auto_ack=True)
    assert len(c.take(cid)) == 1
    c.flow(cid, 1, 500)
    assert len(c.take(cid)) == 1


def test_memory_limit_blocks_every_publishing_link_and_unblocks_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = with_memory_limit(2 * MESSAGE_OVERHEAD)
    c = h.connect()
    other = h.connect("other")
    mine = record_credit_grants(monkeypatch, c)
    theirs = record_credit_grants(monkeypatch, other)
    ok(c.create_queue("orders"))
    c.publish("orders", b"")
    other.publish("orders", b"")  # reaches the limit
    c.publish("orders", b"")  # over it
    assert (mine, theirs) == ([1], [])
    assert (c.conn.publish_credit, other.conn.publish_credit) == (PUBLISH_WINDOW - 1, PUBLISH_WINDOW - 1)
    cid = c.consumer("orders", auto_ack=True)
    assert len(c.take(cid)) == 3
    assert h.broker.memory.used == 0
    assert (mine, theirs) == ([1, 1], [1])
    assert (c.conn.publish_credit, other.conn.publish_credit) == (PUBLISH_WINDOW, PUBLISH_WINDOW)


def test_memory_released_by_expiry_unblocks_producers_on_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    h = with_memory_limit(2 * MESSAGE_OVERHEAD, expiry_address="")
    c = h.connect()
    grants = record_credit_grants(monkeypatch, c)
    ok(c.create_queue("orders"))
    c.publish("orders", b"", expiration_ms=h.now_ms + 100)
    c.publish("orders", b"", expiration_ms=h.now_ms + 100)  # reaches the limit
    assert grants == [1]
    assert h.broker.memory.used == 2 * MESSAGE_OVERHEAD
    h.tick(h.now_ms + 1000)
    assert h.broker.memory.used == 0
    assert grants == [1, 1]
    assert c.conn.publish_credit == PUBLISH_WINDOW


def test_memory_counts_a_multicast_message_once_per_queue(c: Client) -> None:
    memory = c.h.broker.memory
    ok(c.create_queue("news.a", "news", MULTICAST, durable=False))
    ok(c.create_queue("news.b", "news", MULTICAST, durable=False))
    ok(c.create_queue("news.c", "news", MULTICAST, durable=False, filter="n = 1"))
    c.publish("news", b"12345", routing=MULTICAST)
    assert memory.used == 2 * message_cost(b"12345")
    a = c.consumer("news.a")
    got = c.take(a)
    assert memory.used == 2 * message_cost(b"12345")
    c.ack(a, ids(got))
    assert memory.used == message_cost(b"12345")
    assert len(c.take(c.consumer("news.b", auto_ack=True))) == 1
    assert memory.used == 0


def test_memory_returns_to_zero_after_everything_is_acked(c: Client) -> None:
    memory = c.h.broker.memory
    ok(c.create_queue("orders"))
    cid = c.consumer("orders", credit=2)
    payloads = [b"a" * n for n in range(5)]
    c.send_all("orders", payloads)
    assert memory.used == sum(message_cost(p) for p in payloads)
    got = c.take(cid)
    c.nack(cid, [got[0].id])  # back in the queue: still counted once
    c.nack(cid, [got[1].id], NackMode.RELEASE)
    assert memory.used == sum(message_cost(p) for p in payloads)
    c.flow(cid, 10)
    got = c.take(cid)
    assert sorted(bodies(got)) == payloads
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    c.ack(cid, ids(got[:2]), tx=tx)
    ok(c.tx_commit(tx))
    c.ack(cid, ids(got[2:]))
    assert memory.used == 0


def test_memory_released_when_messages_are_dead_lettered_superseded_or_purged() -> None:
    h = with_address_settings(dead_letter_address="", max_delivery_attempts=1)
    c = h.connect()
    memory = h.broker.memory
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"dead", b"rejected"])
    got = c.take(cid)
    c.nack(cid, [got[0].id])
    c.nack(cid, [got[1].id], NackMode.REJECT)
    assert memory.used == 0
    ok(c.create_queue("prices", last_value_key=""))
    c.publish("prices", b"a1", last_value_key="A")
    c.publish("prices", b"a22", last_value_key="A")
    assert memory.used == message_cost(b"a22")
    c.send_all("orders", [b"queued"] * 2)
    ok(c.unsubscribe(cid))
    ok(c.delete_queue("prices"))
    ok(c.delete_queue("orders"))
    assert memory.used == 0


def test_memory_released_when_a_queue_with_in_flight_messages_is_deleted(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("orders"))
    cid = other.consumer("orders")
    c.send_all("orders", [b"in-flight"])
    assert len(other.take(cid)) == 1
    ok(c.delete_queue("orders"))
    assert h.broker.memory.used == 0


def test_memory_released_when_a_queue_with_a_delayed_redelivery_is_deleted() -> None:
    h = with_address_settings(redelivery_delay_ms=100)
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"later"])
    c.nack(cid, ids(c.take(cid)))
    ok(c.delete_queue("orders"))
    h.tick(h.now_ms + 100)
    assert h.broker.memory.used == 0


def test_a_message_that_came_and_went_leaves_its_queue_and_consumer_as_they_were(h: Harness, c: Client) -> None:
    """An idle queue holds no deque, and an idle consumer no grown in-flight table, after its traffic: a core
    holds one or more of each per MQTT session, and a deque alone is 600 bytes."""
    count = 200
    consumers = []
    for i in range(count):
        ok(c.create_queue(f"idle.{i}"))
        consumers.append(c.consumer(f"idle.{i}", credit=10))
    queues_module = [tracemalloc.Filter(inclusive=True, filename_pattern=queues.__file__)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(queues_module)
        for i in range(count):
            c.publish(f"idle.{i}", b"x", sync=False)
        h.sync()
        for consumer_id in consumers:
            got = c.take(consumer_id)
            assert len(got) == 1
            c.conn.ack(consumer_id, ids(got), 0)
        h.sync()
        h.tick(h.now_ms + h.broker.settings.broker.expiry_scan_ms)  # its scan takes the note of the changed ones
        after = tracemalloc.take_snapshot().filter_traces(queues_module)
    finally:
        tracemalloc.stop()
    kept = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert kept / count < 16, f"{kept / count:.0f} bytes kept per queue"
    queue = h.broker.queues["idle.0"]
    assert queue._levels is queues._NO_LEVELS  # not even a list of its ten levels
    assert all(consumer.in_flight is queues._NO_IN_FLIGHT for consumer in queue.consumers)


def test_a_session_holds_no_containers_of_its_own_until_it_uses_them(h: Harness, c: Client) -> None:
    """A device's session (a queue, a consumer, nothing sent) shares the empty transaction, temporary queue and
    send-check tables; each is its own from its first entry, and a second session's stay shared and empty."""
    session, other = c.session, h.connect().session
    assert (session.txs, session.temporary_queues, session.send_ok) == ({}, {}, {})
    assert session.txs is other.txs
    assert session.temporary_queues is other.temporary_queues
    assert session.send_ok is other.send_ok
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    ok(c.create_queue("mine", temporary=True))
    c.publish("mine", b"x")
    assert list(session.txs) == [tx]
    assert list(session.temporary_queues) == ["mine"]
    assert "mine" in session.send_ok
    assert (other.txs, other.temporary_queues, other.send_ok) == ({}, {}, {})


# ====================================================================== permissions of the newer operations
def user_with(*permissions: str, match: str = "#") -> Client:
    """A client of a fresh harness whose only user holds ``permissions`` on ``match``."""
    grants = [PermissionEntry(match, p, ["r"]) for p in permissions]
    h = Harness(CoreSettings(users=[UserEntry("u", "p", ["r"])], permissions=grants))
    return h.connect("u", "u", "p")


@pytest.mark.parametrize(
    ("grants", "routing", "allowed"),
    [
        ((), ANYCAST, False),
        (("createAddress",), ANYCAST, False),
        (("createDurableQueue",), ANYCAST, False),
        (("createAddress", "createNonDurableQueue"), ANYCAST, False),
        (("createAddress", "createDurableQueue"), ANYCAST, True),
        (("createAddress",), None, False),  # default routing: anycast
        (("createAddress", "createDurableQueue"), None, True),
    ],
)
def test_publish_to_new_anycast_address_needs_create_permissions(
    grants: tuple[str, ...], routing: int | None, allowed: bool
) -> None:
    c = user_with("send", *grants)
    broker = c.h.broker
    fields = {} if routing is None else {"routing": routing}
    seq = c.publish("fresh", b"x", **fields)
    if allowed:
        assert seq in c.confirmed
        assert c.rejected == {}
        assert broker.queues["fresh"].durable is True
        assert len(broker.queues["fresh"]) == 1
    else:
        assert seq not in c.confirmed
        assert c.rejected[seq].code == ErrorCode.FORBIDDEN
        assert "fresh" not in broker.addresses
        assert "fresh" not in broker.queues
        assert broker.counters.rejected == 1


def test_publish_to_new_multicast_address_needs_only_create_address() -> None:
    c = user_with("send")
    seq = c.publish("feed", b"x", routing=MULTICAST)
    assert c.rejected[seq].code == ErrorCode.FORBIDDEN
    assert "feed" not in c.h.broker.addresses
    c = user_with("send", "createAddress")
    seq = c.publish("feed", b"x", routing=MULTICAST)
    assert seq in c.confirmed
    assert c.h.broker.addresses["feed"].routing_types == {MULTICAST}
    assert "feed" not in c.h.broker.queues
    assert c.h.broker.counters.unrouted == 1


def test_publish_to_existing_address_needs_no_create_permission() -> None:
    users = [UserEntry("creator", "p", ["app", "create"]), UserEntry("sender", "p", ["app"])]
    grants = [
        PermissionEntry("#", "send", ["app"]),
        PermissionEntry("#", "createAddress", ["create"]),
        PermissionEntry("#", "createDurableQueue", ["create"]),
    ]
    h = Harness(CoreSettings(users=users, permissions=grants))
    creator = h.connect("creator", "creator", "p")
    sender = h.connect("sender", "sender", "p")
    refused = sender.publish("fresh", b"0")
    assert sender.rejected[refused].code == ErrorCode.FORBIDDEN
    creator.publish("fresh", b"1")
    seq = sender.publish("fresh", b"2")
    assert seq in sender.confirmed
    assert len(h.broker.queues["fresh"]) == 2


@pytest.mark.parametrize("browse", [False, True])
def test_subscribe_to_missing_queue_without_consume_permission_leaves_nothing(browse: bool) -> None:
    c = user_with("createAddress", "createDurableQueue", "createNonDurableQueue", "consume" if browse else "browse")
    broker = c.h.broker
    failed(c.subscribe("jobs", browse=browse)[1], ErrorCode.FORBIDDEN)
    failed(c.subscribe("sub", address="topic", routing_type=MULTICAST, browse=browse)[1], ErrorCode.FORBIDDEN)
    assert broker.queues == {}
    assert broker.addresses == {}
    # With the permission the same subscription auto-creates its queue.
    c = user_with("createAddress", "createDurableQueue", "browse" if browse else "consume")
    ok(c.subscribe("jobs", browse=browse)[1])
    if browse:  # it ended with its browse of the empty queue, which went with it as after an UNSUBSCRIBE
        assert c.events(ev.BrowseDone)
        assert "jobs" not in c.h.broker.queues
    else:
        assert "jobs" in c.h.broker.queues


def test_delete_queue_permissions() -> None:
    users = [
        UserEntry("owner", "p", ["app"]),
        UserEntry("dd", "p", ["app", "dd"]),
        UserEntry("dn", "p", ["app", "dn"]),
        UserEntry("all", "p", ["app", "dd", "dn"]),
    ]
    grants = [
        PermissionEntry("#", "createAddress", ["app"]),
        PermissionEntry("#", "createDurableQueue", ["app"]),
        PermissionEntry("#", "createNonDurableQueue", ["app"]),
        PermissionEntry("#", "deleteDurableQueue", ["dd"]),
        PermissionEntry("#", "deleteNonDurableQueue", ["dn"]),
    ]
    h = Harness(CoreSettings(users=users, permissions=grants))
    owner = h.connect("owner", "owner", "p")
    dd = h.connect("dd", "dd", "p")
    dn = h.connect("dn", "dn", "p")
    everything = h.connect("all", "all", "p")
    ok(owner.create_queue("kept"))
    ok(owner.create_queue("plain", durable=False))
    ok(owner.create_queue("reply.owner", temporary=True))
    ok(owner.create_queue("reply.other", temporary=True))
    # A durable queue needs deleteDurableQueue, even for the link that created it.
    failed(owner.delete_queue("kept"), ErrorCode.FORBIDDEN)
    failed(dn.delete_queue("kept"), ErrorCode.FORBIDDEN)
    # A non-durable queue needs deleteNonDurableQueue.
    failed(owner.delete_queue("plain"), ErrorCode.FORBIDDEN)
    failed(dd.delete_queue("plain"), ErrorCode.FORBIDDEN)
    # The temporary queue of another link: never, whatever the grants.
    failed(everything.delete_queue("reply.owner"), ErrorCode.FORBIDDEN)
    failed(dn.delete_queue("reply.owner"), ErrorCode.FORBIDDEN)
    assert set(h.broker.queues) == {"kept", "plain", "reply.owner", "reply.other"}
    ok(dd.delete_queue("kept"))
    ok(dn.delete_queue("plain"))
    ok(owner.delete_queue("reply.owner"))  # its own temporary queue: no grant needed
    assert set(h.broker.queues) == {"reply.other"}
    assert list(owner.session.temporary_queues) == ["reply.other"]


def test_delete_address_needs_delete_address_permission() -> None:
    users = [UserEntry("u", "p", ["app"]), UserEntry("admin", "p", ["app", "admin"])]
    grants = [PermissionEntry("#", "createAddress", ["app"]), PermissionEntry("#", "deleteAddress", ["admin"])]
    h = Harness(CoreSettings(users=users, permissions=grants))
    u = h.connect("u", "u", "p")
    admin = h.connect("admin", "admin", "p")
    assert ok(u._answer(u.conn.create_address("events", [MULTICAST]))) == {"created": True}
    failed(u._answer(u.conn.delete_address("events")), ErrorCode.FORBIDDEN)
    failed(u._answer(u.conn.delete_address("missing")), ErrorCode.FORBIDDEN)
    assert "events" in h.broker.addresses
    ok(admin._answer(admin.conn.delete_address("events")))
    assert "events" not in h.broker.addresses
    failed(admin._answer(admin.conn.delete_address("events")), ErrorCode.NOT_FOUND)


@pytest.mark.parametrize("address", ["a..b", ".a", "a.", "a.*", "*", "a.#", "a*b", "a.b#"])
def test_publish_to_invalid_address_is_rejected_invalid(c: Client, address: str) -> None:
    seq = c.publish(address, b"x")
    assert seq not in c.confirmed
    assert c.rejected[seq].code == ErrorCode.INVALID
    assert c.h.broker.addresses == {}
    assert c.h.broker.queues == {}
    good = c.publish("a.b", b"fine")
    assert good in c.confirmed


def test_publish_to_invalid_address_is_invalid_before_forbidden() -> None:
    c = user_with("send", "createAddress", "createDurableQueue")
    seq = c.publish("a..b", b"x")
    assert c.rejected[seq].code == ErrorCode.INVALID
    assert c.h.broker.addresses == {}


# ====================================================================== consumer gone with a poison message
def test_session_close_dead_letters_a_message_out_of_delivery_attempts() -> None:
    h = with_address_settings(max_delivery_attempts=2)
    c = h.connect("first")
    ok(c.create_queue("orders"))
    c.consumer("orders")
    c.send_all("orders", [b"poison"], properties={"k": 1})
    assert len(c.take(1)) == 1
    c.close()  # count 1 < 2: back to the queue
    assert "DLQ" not in h.broker.queues
    second = h.connect("second")
    cid = second.consumer("orders")
    got = second.take(cid)
    assert [(d.body, d.count) for d in got] == [(b"poison", 2)]
    second.close()  # count 2 = max_delivery_attempts: dead, not back to the queue
    third = h.connect("third")
    assert third.take(third.consumer("orders")) == []
    dead = third.take(third.consumer("DLQ"))
    assert bodies(dead) == [b"poison"]
    assert dead[0].count == 1
    assert dead[0].props == {
        "k": 1,
        ORIGINAL_ADDRESS: "orders",
        ORIGINAL_QUEUE: "orders",
        ORIGINAL_REASON: "max_deliveries",
    }
    assert h.broker.counters.dead_lettered == 1
    assert h.broker.memory.used == message_cost(b"poison")  # only the DLQ copy


def test_session_close_below_max_attempts_returns_messages_with_their_count() -> None:
    h = with_address_settings(max_delivery_attempts=3)
    c = h.connect("first")
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"a", b"b"])
    got = c.take(cid)
    c.nack(cid, [got[0].id])
    assert [(d.body, d.count) for d in c.take(cid)] == [(b"a", 2)]
    c.close()  # a at count 2, b at count 1: both below 3
    other = h.connect("other")
    again = other.take(other.consumer("orders"))
    assert [(d.body, d.count) for d in again] == [(b"a", 3), (b"b", 2)]
    assert "DLQ" not in h.broker.queues


# ====================================================================== rollback-only transactions
@pytest.mark.parametrize(("address", "code"), [("a..b", ErrorCode.INVALID), ("big", ErrorCode.RESOURCE_LIMIT)])
def test_refused_publish_makes_transaction_rollback_only(address: str, code: str) -> None:
    h = Harness(CoreSettings(broker=BrokerSection(max_message_bytes=10)))
    c = h.connect()
    ok(c.create_queue("orders"))
    cid = c.consumer("orders")
    c.send_all("orders", [b"held"])
    held = c.take(cid)
    tx = c.conn.new_tx_id()
    ok(c.tx_begin(tx))
    c.ack(cid, ids(held), tx=tx)
    staged = c.publish("orders", b"staged", tx=tx)
    refused = c.publish(address, b"x" * 11, tx=tx)
    assert staged in c.confirmed
    assert c.rejected[refused].code == code
    after = c.publish("orders", b"after", tx=tx)  # later publishes are still staged
    assert after in c.confirmed
    failed(c.tx_commit(tx), code)
    assert c.take(cid) == []
    assert len(h.broker.queues["orders"]) == 0
    assert list(h.broker.queues["orders"].consumers[0].in_flight) == ids(held)  # the ack was not applied
    failed(c.tx_commit(tx), code)  # still rollback-only
    assert c.take(cid) == []
    ok(c.tx_rollback(tx))
    assert [(d.body, d.count) for d in c.take(cid)] == [(b"held", 2)]
    failed(c.tx_commit(tx), ErrorCode.NOT_FOUND)
    assert "big" not in h.broker.queues


# ====================================================================== auto-delete sweep
def test_auto_created_queue_emptied_by_expiry_is_swept_by_a_later_tick(h: Harness, c: Client) -> None:
    c.publish("scratch", b"short", expiration_ms=h.now_ms + 500)
    assert h.broker.queues["scratch"].auto_created
    h.tick(h.now_ms + 100)  # first scan: nothing due yet
    assert "scratch" in h.broker.queues
    h.tick(h.now_ms + 500)  # past the expiration, but the next scan is not due
    assert "scratch" in h.broker.queues
    h.tick(h.now_ms + 500)  # expiry_scan_ms (1000) after the last scan
    assert "scratch" not in h.broker.queues
    assert "scratch" not in h.broker.addresses
    assert bodies(c.take(c.consumer("ExpiryQueue"))) == [b"short"]
    h.tick(h.now_ms + 5000)
    assert "ExpiryQueue" in h.broker.queues  # explicitly created dead-letter resource: not swept


def test_unused_explicit_auto_delete_queue_is_not_swept(h: Harness, c: Client) -> None:
    ok(c.create_queue("idle", auto_delete=True))
    for step in range(1, 4):
        h.tick(h.now_ms + step * 1000)
    assert "idle" in h.broker.queues
    c.publish("idle", b"x", expiration_ms=h.now_ms + 1)
    h.tick(h.now_ms + 2000)  # used and emptied by expiry: now it goes
    assert "idle" not in h.broker.queues


def test_the_expiry_scan_visits_only_queues_that_may_hold_expiring_or_paged_messages(h: Harness, c: Client) -> None:
    """A core with many sessions holds many quiet queues: the scan that expires messages is not paid for them."""
    for i in range(50):
        ok(c.create_queue(f"quiet.{i}"))
        c.publish(f"quiet.{i}", b"kept")  # no expiration
    c.publish("quiet.7", b"brief", expiration_ms=h.now_ms + 500)
    timed = h.broker.activity.timed
    assert timed == {h.broker.queues["quiet.7"]}
    h.tick(h.now_ms + 1000)
    assert [bodies(c.take(c.consumer("quiet.7")))] == [[b"kept"]]  # the other one expired in the scan
    h.tick(h.now_ms + 1000)
    assert timed == set()  # no expiring message left: not visited any more


def test_an_auto_delete_queue_emptied_by_an_operator_goes_at_the_next_scan(h: Harness, c: Client) -> None:
    """Only the queues whose messages came or went are looked at for auto-deletion: a purge, and the purge of
    messages still waiting for their scheduled time, are such changes."""
    ok(c.create_queue("drained", auto_delete=True))
    ok(c.create_queue("waiting", auto_delete=True))
    c.publish("drained", b"x")
    cid = c.consumer("waiting")
    c.publish("waiting", b"y")
    c.ack(cid, ids(c.take(cid)))
    c.publish("waiting", b"later", scheduled_ms=h.now_ms + 60_000)
    c.unsubscribe(cid)  # empty, but a message waits for its time: it stays
    h.tick(h.now_ms + 1000)
    assert {"drained", "waiting"} <= h.broker.queues.keys()
    catalog = h.broker.catalog
    assert catalog.purge_queue(h.broker.queues["drained"], h.now_ms) == 1
    assert catalog.purge_queue(h.broker.queues["waiting"], h.now_ms) == 1
    h.tick(h.now_ms + 1000)
    assert "drained" not in h.broker.queues
    assert "waiting" not in h.broker.queues


def test_a_paused_auto_delete_queue_is_kept_until_it_is_resumed(h: Harness, c: Client) -> None:
    """An operator paused a queue and purged it: the emptied queue was deleted with its pause, and the next
    publish made it anew, running, for a consumer to take what the operator held back."""
    ok(c.create_queue("held", auto_delete=True))
    c.publish("held", b"x")
    catalog = h.broker.catalog
    catalog.set_paused(h.broker.queues["held"], paused=True)
    assert catalog.purge_queue(h.broker.queues["held"], h.now_ms) == 1
    h.tick(h.now_ms + 1000)
    h.tick(h.now_ms + 1000)
    assert h.broker.queues["held"].paused
    catalog.set_paused(h.broker.queues["held"], paused=False)
    h.tick(h.now_ms + 1000)
    assert "held" not in h.broker.queues


# ====================================================================== audit of per-message events
def audited(settings: CoreSettings | None = None) -> tuple[Harness, RecordingAudit]:
    h = Harness(settings)
    sink = RecordingAudit()
    h.broker = Broker("node-1", h.settings, store=MemoryStore(), audit=sink, first_message_id=1, audit_messages="all")
    return h, sink


def test_message_events_reach_the_file_sink_whole(tmp_path: Path) -> None:
    """The broker's message events through the real sink: every field, the queue only where there is one."""
    h = Harness()
    sink = FileAuditSink(tmp_path, "node-1")
    h.broker = Broker("node-1", h.settings, store=MemoryStore(), audit=sink, first_message_id=1)
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    c.publish("orders", b"hello", durable=True)
    cid = c.consumer("orders")
    got = c.take(cid)
    c.nack(cid, ids(got))
    c.ack(cid, ids(c.take(cid)))
    h.sync()
    sink.close()
    lines = [
        json.loads(line)
        for path in sorted((tmp_path / "node-1").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    events = {line["event"]: line for line in lines}
    message = {"address": "orders", "size": 5, "protocol": "link", "message_id": "node-1-1"}
    assert events["msg.sent"].items() >= message.items()
    assert "queue" not in events["msg.sent"]
    assert events["msg.nacked"].items() >= {**message, "queue": "orders", "delivery_count": 1}.items()
    assert events["msg.acked"].items() >= {**message, "queue": "orders"}.items()
    assert events["msg.acked"]["sent_ts_us"] == events["msg.sent"]["sent_ts_us"] > 0
    assert events["msg.acked"]["consumer_id"] == str(cid)  # who acknowledged it, as in consumer.opened
    assert events["msg.acked"]["conn_id"] == events["consumer.opened"]["conn_id"]
    assert events["msg.acked"]["client_id"] == events["conn.opened"]["client_id"]
    # One msg.delivered per delivery, with its count and the consumer it went to, between sent and acked.
    delivered = [line for line in lines if line["event"] == "msg.delivered"]
    assert [line["delivery_count"] for line in delivered] == [1, 2]
    for line in delivered:
        assert line.items() >= {**message, "queue": "orders", "consumer_id": str(cid)}.items()
        assert line["conn_id"] == events["consumer.opened"]["conn_id"]
        assert line["client_id"] == events["conn.opened"]["client_id"]
        assert line["sent_ts_us"] == events["msg.sent"]["sent_ts_us"]
    order = [line["event"] for line in lines if line["event"].startswith("msg.")]
    assert order == ["msg.sent", "msg.delivered", "msg.nacked", "msg.delivered", "msg.acked"]


def test_non_durable_deliveries_are_audited_only_with_all_message_events(tmp_path: Path) -> None:
    h = Harness()
    sink = RecordingAudit()
    h.broker = Broker("node-1", h.settings, store=MemoryStore(), audit=sink, first_message_id=1)
    c = h.connect()
    ok(c.create_queue("orders"))
    c.publish("orders", b"fast")
    c.publish("orders", b"safe", durable=True)
    cid = c.consumer("orders")
    assert bodies(c.take(cid)) == [b"fast", b"safe"]
    assert [f["message_id"] for _, f in sink.of("msg.delivered")] == ["node-1-2"]


def test_audit_auto_ack_deliveries_record_acked_with_queue_and_time() -> None:
    h, sink = audited()
    c = h.connect()
    ok(c.create_queue("orders"))
    ok(c.create_queue("jobs"))
    c.send_all("orders", [b"a", b"b"])
    c.send_all("jobs", [b"j"])
    h.tick(h.now_ms + 5000)
    assert sink.of("msg.acked") == []
    orders = c.consumer("orders", auto_ack=True)
    assert bodies(c.take(orders)) == [b"a", b"b"]
    assert len(h.broker.queues["orders"]) == 0  # the queue became empty
    h.tick(h.now_ms + 7)
    jobs = c.consumer("jobs", auto_ack=True)
    assert bodies(c.take(jobs)) == [b"j"]
    acked = sink.of("msg.acked")
    assert [(ts, f["queue"], f["address"], f["message_id"]) for ts, f in acked] == [
        ((BASE_MS + 5000) * 1000, "orders", "orders", "node-1-1"),
        ((BASE_MS + 5000) * 1000, "orders", "orders", "node-1-2"),
        ((BASE_MS + 5007) * 1000, "jobs", "jobs", "node-1-3"),
    ]
    assert all(f["sent_ts_us"] == BASE_MS * 1000 for _, f in acked)


def test_audit_expiry_records_the_tick_time() -> None:
    h, sink = audited()
    c = h.connect()
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"short"], expiration_ms=h.now_ms + 500)
    h.tick(h.now_ms + 100)
    assert sink.of("msg.expired") == []
    h.tick(BASE_MS + 2345)
    expired = sink.of("msg.expired")
    assert [(ts, f["queue"], f["address"], f["reason"]) for ts, f in expired] == [
        ((BASE_MS + 2345) * 1000, "orders", "orders", "ttl")
    ]


def test_audit_expiry_at_dispatch_records_the_dispatch_time() -> None:
    h, sink = audited()
    c = h.connect()
    ok(c.create_queue("orders"))
    c.send_all("orders", [b"short"], expiration_ms=h.now_ms + 500)
    h.now_ms = BASE_MS + 800  # no tick: the expiry is found when dispatching
    c.consumer("orders")
    expired = sink.of("msg.expired")
    assert [(ts, f["queue"]) for ts, f in expired] == [((BASE_MS + 800) * 1000, "orders")]


def test_audit_superseded_message_returned_by_a_dropped_link_has_the_close_time() -> None:
    h, sink = audited()
    c = h.connect()
    ok(c.create_queue("prices", last_value_key=""))
    c.consumer("prices")
    c.publish("prices", b"a1", last_value_key="A")
    assert len(c.take(1)) == 1
    c.publish("prices", b"a2", last_value_key="A")  # a1 is in flight: superseded when it comes back
    assert sink.of("msg.acked") == []
    # The server shell closes a lost connection directly, not through handle().
    h.broker.close_session(c.session, BASE_MS + 9000)
    acked = sink.of("msg.acked")
    assert [(ts, f["queue"], f["message_id"]) for ts, f in acked] == [((BASE_MS + 9000) * 1000, "prices", "node-1-1")]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("not-an-ip", False), (None, False)],
)  # fmt: skip
def test_loopback_detection_for_the_embedded_default(host: str | None, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def limited(policy: str, max_size: int) -> Harness:
    return with_address_settings(max_size_bytes=max_size, address_full_policy=policy)


def test_address_full_policy_fail_rejects_once_the_address_is_full() -> None:
    per_message = 10 + MESSAGE_OVERHEAD
    h = limited("FAIL", 3 * per_message)
    c = h.connect()
    ok(c.create_queue("capped"))
    seqs = [c.publish("capped", b"0123456789", sync=False) for _ in range(5)]
    h.sync()
    assert sorted(c.rejected) == seqs[3:]
    assert all(e.code == ErrorCode.RESOURCE_LIMIT and "address-full-policy FAIL" in e.text for e in c.rejected.values())
    assert len(h.broker.queues["capped"]) == 3


def test_address_full_policy_drop_confirms_and_discards() -> None:
    h = limited("DROP", 2 * (10 + MESSAGE_OVERHEAD))
    c = h.connect()
    ok(c.create_queue("capped"))
    c.send_all("capped", [b"0123456789"] * 5)  # all confirmed
    assert len(h.broker.queues["capped"]) == 2
    assert h.broker.counters.dropped == 3
    # The producer is not told: the operator sees it in the metrics (it was counted, and shown nowhere).
    exposition = render_metrics(h.broker, NodeStatus(started_at=0.0), QueueRates())
    assert "tridentmq_messages_dropped_total 3" in exposition.splitlines()


def test_address_full_policy_block_withholds_credit_until_the_address_drains() -> None:
    h = limited("BLOCK", 2 * (10 + MESSAGE_OVERHEAD))
    c = h.connect()
    ok(c.create_queue("capped"))
    other = h.connect("other")
    before = c.conn.publish_credit
    c.send_all("capped", [b"0123456789"] * 3)
    assert c.conn.publish_credit == before - 3  # the batch that found the address full got no credit back
    assert len(h.broker.queues["capped"]) == 3  # nothing is lost: the message that hit the limit is kept
    other.publish("elsewhere", b"fine")  # other addresses and producers are not held up
    cid = other.consumer("capped")
    other.ack(cid, ids(other.take(cid)))
    assert c.conn.publish_credit == before  # drained below 90 %: the credit came back


def test_unknown_address_full_policy_is_refused_at_start() -> None:
    with pytest.raises(SettingsError, match="address_full_policy 'SPILL'"):
        limited("SPILL", 100)


def test_subscribe_with_create_false_never_makes_the_queue(h: Harness, c: Client) -> None:
    """A queue made with a spec (a lock: one consumer, an owner filter, expiry 0) may expire between its
    creation and the subscribe: with ``create: false`` the subscribe is refused rather than auto-creating a
    plain queue of that name, which would hold neither the consumer limit nor the filter."""
    _, answer = c.subscribe("lock.x", credit=1, create=False)
    failed(answer, ErrorCode.NOT_FOUND)
    assert "lock.x" not in h.broker.queues
    ok(c.create_queue("lock.x", durable=False, max_consumers=1, expires_ms=0))
    _, answer = c.subscribe("lock.x", credit=1, create=False)
    ok(answer)
    assert h.broker.queues["lock.x"].max_consumers == 1


def test_a_lost_session_with_many_consumers_closes_a_slice_at_a_time(h: Harness, c: Client) -> None:
    """An MQTT gateway's service link holds the lock of each of its clients' sessions: closing one with 18,815
    consumers held the core for 0.1 s. The shell closes a lost link's session ``at_most`` consumers a turn: each
    call gives back what that many held, the session takes no request from the first, and its temporary queues
    and its end's audit event go with the last. A consumer whose queue went meanwhile is skipped."""
    other = h.connect()
    for i in range(5):
        ok(other.create_queue(f"held.{i}"))
        other.publish(f"held.{i}", b"m")
    consumers = [c.consumer(f"held.{i}", credit=1) for i in range(5)]
    for consumer_id in consumers:
        assert len(c.take(consumer_id)) == 1
    ok(c.create_queue("mine", temporary=True, durable=False))
    queues = h.broker.queues

    def in_flight() -> list[int]:
        return [queues[f"held.{i}"].in_flight for i in range(5) if f"held.{i}" in queues]

    assert not h.broker.close_session(c.session, h.now_ms, at_most=2)
    assert c.session.conn_id not in h.broker.sessions
    assert in_flight() == [0, 0, 1, 1, 1]  # the first two consumers gave theirs back
    assert "mine" in queues
    ok(other.delete_queue("held.3"))  # a takeover deleting a lock queue, say
    assert not h.broker.close_session(c.session, h.now_ms, at_most=2)  # the third's, and the deleted one's turn
    assert in_flight() == [0, 0, 0, 1]
    assert "mine" in queues
    assert h.broker.close_session(c.session, h.now_ms, at_most=2)  # the last one's turn, then the rest
    assert in_flight() == [0, 0, 0, 0]
    assert "mine" not in queues
    assert not c.session.consumers
    assert h.broker.close_session(c.session, h.now_ms, at_most=2), "closed before: nothing to do"


def test_a_lost_sessions_consumers_take_nothing_more_until_it_ends(h: Harness, c: Client) -> None:
    """Between a link's loss and its session's turn to close, its consumers stop at once: a message published
    meanwhile waits in the queue for the client's next session (which may already be there, through another
    link), instead of going to a consumer nobody reads and coming back flagged as redelivered."""
    ok(c.create_queue("device", durable=False))
    old = c.consumer("device", credit=10)
    h.broker.links_lost([c.session], h.now_ms)
    successor = h.connect()
    fresh = successor.consumer("device", credit=10)
    successor.publish("device", b"after the loss")
    assert c.take(old) == []
    [delivery] = successor.take(fresh)
    assert delivery.count == 1  # its first delivery
    assert h.broker.close_session(c.session, h.now_ms, at_most=1)
