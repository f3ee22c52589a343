"""Link protocol version 4 in the pure broker, through real codecs: a SUBSCRIBE that makes its queue (option
``queue``, on condition ``if``), and a browser that ends with its browse."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.broker_harness import BASE_MS, MULTICAST, Client, Harness, bodies, failed, ok

from tridentmq_core.settings import CoreSettings, PermissionEntry, UserEntry
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.ops import ErrorCode


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def c(h: Harness) -> Client:
    return h.connect("app")


def lock_spec(name: str = "lock") -> dict[str, Any]:
    """An MQTT session lock's queue: gone at the next tick without a consumer, one consumer at most."""
    return {
        "name": name,
        "address": name,
        "routing_type": 0,
        "durable": False,
        "max_consumers": 1,
        "expires_ms": 0,
        "filter": "owner = 'alice'",
    }


def test_a_subscribe_makes_its_queue_as_the_spec_says_and_consumes_from_it(h: Harness, c: Client) -> None:
    consumer, answer = c.subscribe("lock", credit=1, queue=lock_spec(), create=False)
    assert ok(answer) == {
        "queue": "lock",
        "address": "lock",
        "routing_type": 0,
        "made": {"created": True, "queue": "lock", "address": "lock"},
    }
    queue = h.broker.queues["lock"]
    assert (queue.max_consumers, queue.expires_ms, queue.durable) == (1, 0, False)
    assert queue.filter is not None
    assert queue.filter.text == "owner = 'alice'"
    assert [x.id for x in queue.consumers] == [consumer]
    # Made and consumed in one request: its expiry of 0 never found it without its consumer.
    h.tick(BASE_MS + 1000)
    assert "lock" in h.broker.queues
    c.publish("lock", b"notice", properties={"owner": "alice"})
    assert bodies(c.take(consumer)) == [b"notice"]


def test_a_queue_that_exists_is_consumed_from_and_its_answer_says_so(h: Harness, c: Client) -> None:
    spec = {"name": "sub", "address": "news", "routing_type": MULTICAST, "durable": True}
    first = ok(c.subscribe("sub", queue=spec)[1])
    assert first["made"]["created"] is True
    second, answer = c.subscribe("sub", queue=spec)
    made = ok(answer)["made"]
    assert (made["created"], made["consumers"]) == (False, 1)
    assert len(h.broker.queues["sub"].consumers) == 2
    c.publish("news", b"m")
    assert bodies(c.take(second)) + bodies(c.take(1)) == [b"m"]


@pytest.mark.parametrize("condition", ["made", "new"])
def test_a_condition_consumes_only_from_a_queue_this_request_made(h: Harness, c: Client, condition: str) -> None:
    """(What sets ``new`` apart, a queue of the name on another node, is tested with a cluster's bindings in
    test_cluster_balance.)"""
    owner, answer = c.subscribe("lock", credit=1, queue=lock_spec(), **{"if": condition})
    assert ok(answer)["made"]["created"] is True
    other = h.connect("other")
    refused, answer = other.subscribe("lock", credit=1, queue=lock_spec(), **{"if": condition})
    assert ok(answer) == {
        "made": {
            "created": False,
            "queue": "lock",
            "address": "lock",
            "expires_ms": 0,
            "filter": "owner = 'alice'",
            "consumers": 1,
        }
    }
    assert [x.id for x in h.broker.queues["lock"].consumers] == [owner]
    c.publish("lock", b"x", properties={"owner": "alice"})
    assert bodies(c.take(owner)) == [b"x"]
    assert other.take(refused) == []


def test_the_subscribes_own_fields_are_checked_before_anything_is_made(h: Harness, c: Client) -> None:
    c.consumer("other")
    spec = {"name": "q", "address": "q", "routing_type": 0}
    failed(c.subscribe("q", 100, queue=spec, selector="a = ")[1], ErrorCode.INVALID)
    failed(c.subscribe("q", 10**6, queue=spec)[1], ErrorCode.INVALID)
    assert set(h.broker.queues) == {"other"}


def test_an_older_link_gets_the_plain_subscribe_it_knows(h: Harness) -> None:
    """Version 3 had no ``queue`` option: the queue is auto-created as any SUBSCRIBE's, by its name."""
    c = h.connect(versions=(1, 2, 3))
    reply = ok(c.subscribe("lock", queue=lock_spec(), **{"if": "new"})[1])
    assert "made" not in reply
    assert h.broker.queues["lock"].max_consumers == -1


@pytest.mark.parametrize(
    "options",
    [
        {"queue": {**lock_spec(), "name": "other"}},  # another queue's spec
        {"queue": {**lock_spec(), "passive": True}},  # a look makes nothing to consume from
        {"queue": "lock"},
        {"queue": lock_spec(), "if": "yes"},
        {"queue": lock_spec(), "if": True},
        {"if": "made"},  # a condition on no queue to make
    ],
)
def test_a_make_that_does_not_describe_the_queue_is_invalid_and_makes_nothing(
    h: Harness, c: Client, options: dict[str, Any]
) -> None:
    failed(c.subscribe("lock", **options)[1], ErrorCode.INVALID)
    assert h.broker.queues == {}
    assert all(not session.consumers for session in h.broker.sessions.values())


def test_a_refused_make_subscribes_nothing_and_a_refused_subscribe_keeps_what_was_made() -> None:
    def user_with(*permissions: str) -> Client:
        grants = [PermissionEntry("#", p, ["r"]) for p in permissions]
        return Harness(CoreSettings(users=[UserEntry("u", "p", ["r"])], permissions=grants)).connect("u", "u", "p")

    spec = {"name": "jobs", "address": "jobs", "routing_type": 0, "durable": True}
    c = user_with("consume")
    failed(c.subscribe("jobs", queue=spec)[1], ErrorCode.FORBIDDEN)
    assert c.h.broker.queues == {}
    # As CREATE_QUEUE then SUBSCRIBE would: the queue is made, the consumer refused.
    c = user_with("createAddress", "createDurableQueue")
    failed(c.subscribe("jobs", queue=spec)[1], ErrorCode.FORBIDDEN)
    assert c.h.broker.queues["jobs"].consumers == []


def test_a_browser_ends_with_its_browse(h: Harness, c: Client) -> None:
    c.send_all("q", [b"1", b"2", b"3"])
    browser = c.consumer("q", credit=2, browse=True)
    assert bodies(c.take(browser)) == [b"1", b"2"]
    assert [x.id for x in h.broker.queues["q"].consumers] == [browser]  # not done: it waits for credit
    c.flow(browser, 2)
    assert bodies(c.take(browser)) == [b"3"]
    assert c.events(ev.BrowseDone) == [ev.BrowseDone(browser)]
    assert h.broker.queues["q"].consumers == []
    assert browser not in c.conn.consumer_credit
    failed(c.unsubscribe(browser), ErrorCode.NOT_FOUND)  # nothing left to end
    consumer = c.consumer("q")  # the browse took nothing
    assert bodies(c.take(consumer)) == [b"1", b"2", b"3"]


def test_a_version_3_browser_stays_until_its_unsubscribe(h: Harness) -> None:
    c = h.connect(versions=(1, 2, 3))
    c.send_all("q", [b"1"])
    browser = c.consumer("q", browse=True)
    assert bodies(c.take(browser)) == [b"1"]
    assert c.events(ev.BrowseDone) == [ev.BrowseDone(browser)]
    assert [x.id for x in h.broker.queues["q"].consumers] == [browser]
    assert browser in c.conn.consumer_credit
    ok(c.unsubscribe(browser))
    assert h.broker.queues["q"].consumers == []
