"""Queue expiry (``expires_ms`` in the CREATE_QUEUE spec) in the pure broker, driven through real codecs."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tests.unit.broker_harness import BASE_MS, MULTICAST, Client, Harness, bodies, failed, ok, recorded

from tridentmq_core.deadlines import Deadlines
from tridentmq_core.settings import CoreSettings, PermissionEntry, UserEntry
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.ops import ErrorCode


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def c(h: Harness) -> Client:
    return h.connect("app")


def gone_at(h: Harness, queue: str, step_ms: int = 50) -> int:
    """Tick every ``step_ms`` (as the server does) until ``queue`` is deleted; the time it went."""
    for _ in range(10_000):
        if queue not in h.broker.queues:
            return h.now_ms
        h.tick(h.now_ms + step_ms)
    raise AssertionError(f"{queue} never expired")


def test_idle_queue_is_deleted_with_its_messages_once_its_time_is_up() -> None:
    h, store, sink = recorded()
    c = h.connect()
    assert ok(c.create_queue("session.a", expires_ms=1000)) == {
        "created": True,
        "queue": "session.a",
        "address": "session.a",
    }
    c.send_all("session.a", [b"1", b"2"], durable=True)
    h.tick(BASE_MS + 999)
    assert len(h.broker.queues["session.a"]) == 2
    h.tick(BASE_MS + 1000)
    assert "session.a" not in h.broker.queues
    assert store.deleted == ["session.a"]
    assert store.specs[0]["expires_ms"] == 1000
    assert h.broker.memory.used == 0
    assert sink.of("queue.expired") == [
        ((BASE_MS + 1000) * 1000, {"queue": "session.a", "address": "session.a", "expires_ms": 1000, "messages": 2})
    ]


def test_a_consumer_stops_the_clock_and_its_leaving_restarts_it_in_full(h: Harness, c: Client) -> None:
    ok(c.create_queue("q", expires_ms=1000))
    h.tick(BASE_MS + 900)
    cid = c.consumer("q")
    h.tick(BASE_MS + 5000)
    assert "q" in h.broker.queues
    ok(c.unsubscribe(cid))
    h.tick(BASE_MS + 5999)
    assert "q" in h.broker.queues
    assert gone_at(h, "q", step_ms=1) == BASE_MS + 6000


def test_the_clock_starts_when_the_last_of_several_consumers_leaves(h: Harness, c: Client) -> None:
    other = h.connect("other")
    ok(c.create_queue("q", expires_ms=100))
    first, second = c.consumer("q"), other.consumer("q")
    ok(c.unsubscribe(first))
    h.tick(BASE_MS + 1000)
    assert "q" in h.broker.queues
    h.now_ms = BASE_MS + 2000
    other.close()  # the link goes: its consumer leaves with it
    assert second not in other.session.consumers
    h.tick(BASE_MS + 2099)
    assert "q" in h.broker.queues
    h.tick(BASE_MS + 2100)
    assert "q" not in h.broker.queues


def test_a_browser_is_not_a_consumer_and_hears_of_the_deletion(h: Harness) -> None:
    """A version 3 browser stays after its browse until its UNSUBSCRIBE (a version 4 one ends with it)."""
    c = h.connect(versions=(1, 2, 3))
    ok(c.create_queue("q", expires_ms=500))
    c.send_all("q", [b"m"])
    browser = c.consumer("q", browse=True)
    assert bodies(c.take(browser)) == [b"m"]
    h.tick(BASE_MS + 500)
    assert "q" not in h.broker.queues
    assert c.events(ev.ConsumerClosed) == [ev.ConsumerClosed(browser, ErrorCode.NOT_FOUND, "queue 'q' was deleted")]


def test_a_browser_leaving_does_not_restart_the_clock(h: Harness) -> None:
    """A version 3 browser stays until its UNSUBSCRIBE (a version 4 one ends with its browse: see test_broker)."""
    c = h.connect(versions=(1, 2, 3))
    ok(c.create_queue("q", expires_ms=1000))
    browser = c.consumer("q", browse=True)
    h.tick(BASE_MS + 900)
    ok(c.unsubscribe(browser))
    assert gone_at(h, "q", step_ms=1) == BASE_MS + 1000


def test_expires_ms_zero_deletes_at_the_next_tick_and_minus_one_never(h: Harness, c: Client) -> None:
    ok(c.create_queue("now", expires_ms=0))
    ok(c.create_queue("never", expires_ms=-1))
    ok(c.create_queue("plain"))
    h.tick(BASE_MS)
    assert "now" not in h.broker.queues
    h.tick(BASE_MS + 10**9)
    assert {"never", "plain"} <= set(h.broker.queues)


@pytest.mark.parametrize("value", ["1000", 1.5, True, -2, [1]])
def test_a_bad_expires_ms_is_invalid(c: Client, value: Any) -> None:
    failed(c.create_queue("q", expires_ms=value), ErrorCode.INVALID)
    assert "q" not in c.h.broker.queues
    ok(c.create_queue("q"))
    failed(c.create_queue("q", expires_ms=value), ErrorCode.INVALID)
    assert c.h.broker.queues["q"].expires_ms == -1


def test_create_queue_again_changes_the_expiry_keeping_the_idle_time() -> None:
    h, store, _ = recorded()
    c = h.connect()
    ok(c.create_queue("q", durable=True, expires_ms=10_000))
    h.now_ms = BASE_MS + 3000
    assert ok(c.create_queue("q"))["expires_ms"] == 10_000  # no expires_ms: unchanged, and said
    assert ok(c.create_queue("q", expires_ms=5000))["expires_ms"] == 5000
    assert [spec["expires_ms"] for spec in store.specs] == [10_000, 5000]  # re-recorded: it replaces the first
    h.tick(BASE_MS + 4999)
    assert "q" in h.broker.queues
    h.tick(BASE_MS + 5000)  # idle since its creation
    assert "q" not in h.broker.queues


def test_create_queue_again_can_switch_the_expiry_off_and_on(h: Harness, c: Client) -> None:
    ok(c.create_queue("q", durable=False, expires_ms=1000))
    assert ok(c.create_queue("q", durable=False, expires_ms=-1))["expires_ms"] == -1
    h.tick(BASE_MS + 5000)
    assert "q" in h.broker.queues
    ok(c.create_queue("q", durable=False, expires_ms=1000))  # the clock starts now: it had none
    h.tick(BASE_MS + 5999)
    assert "q" in h.broker.queues
    h.tick(BASE_MS + 6000)
    assert "q" not in h.broker.queues


def test_create_queue_again_for_a_queue_with_a_consumer_sets_the_expiry_for_later(h: Harness, c: Client) -> None:
    ok(c.create_queue("q"))
    cid = c.consumer("q")
    ok(c.create_queue("q", expires_ms=100))
    h.tick(BASE_MS + 1000)
    assert "q" in h.broker.queues
    h.now_ms = BASE_MS + 2000
    ok(c.unsubscribe(cid))
    assert gone_at(h, "q", step_ms=1) == BASE_MS + 2100


SECURE_USERS = [UserEntry("owner", "pw", ["owner"]), UserEntry("guest", "pw", ["guest"])]
SECURE_GRANTS = [
    PermissionEntry("#", "createAddress", ["owner", "guest"]),
    PermissionEntry("#", "createDurableQueue", ["owner", "guest"]),
    PermissionEntry("#", "deleteDurableQueue", ["owner"]),
    PermissionEntry("#", "send", ["owner", "guest"]),
]


def test_changing_the_expiry_of_an_existing_queue_takes_the_right_to_delete_it() -> None:
    h = Harness(CoreSettings(users=SECURE_USERS, permissions=SECURE_GRANTS))
    owner, guest = h.connect("o", "owner", "pw"), h.connect("g", "guest", "pw")
    ok(owner.create_queue("q"))
    failed(guest.create_queue("q", expires_ms=0), ErrorCode.FORBIDDEN)
    assert ok(guest.create_queue("q", expires_ms=-1))["expires_ms"] == -1  # the same value changes nothing
    ok(guest.create_queue("mine", expires_ms=1000))  # a new queue needs only the right to create it
    ok(owner.create_queue("q", expires_ms=0))
    h.tick(BASE_MS)
    assert "q" not in h.broker.queues


def test_restored_queues_keep_their_expiry_and_get_their_full_time_again() -> None:
    h, store, _ = recorded()
    c = h.connect()
    ok(c.create_queue("q", expires_ms=1000))
    ok(c.create_queue("keep"))
    spec, kept = store.specs
    assert h.broker.durable_snapshot().queues == [spec, kept]
    restarted, _, _ = recorded()
    restarted.broker.restore(
        RecoveredState(queues={"q": spec, "keep": kept, "old": {"name": "old", "address": "old", "routing_type": 0}}),
        BASE_MS + 60_000,
    )
    assert restarted.broker.queues["q"].expires_ms == 1000
    assert restarted.broker.queues["old"].expires_ms == -1  # recorded before expires_ms existed
    restarted.tick(BASE_MS + 60_999)
    assert "q" in restarted.broker.queues
    restarted.tick(BASE_MS + 61_000)
    assert set(restarted.broker.queues) == {"keep", "old"}


def test_a_multicast_subscription_queue_expires_and_stops_getting_copies(h: Harness, c: Client) -> None:
    ok(c.create_queue("sub.1", "news", MULTICAST, expires_ms=100))
    ok(c.create_queue("sub.2", "news", MULTICAST))
    c.send_all("news", [b"one"], routing=MULTICAST)
    h.tick(BASE_MS + 100)
    c.send_all("news", [b"two"], routing=MULTICAST)
    assert "sub.1" not in h.broker.queues
    assert bodies(c.take(c.consumer("sub.2"))) == [b"one", b"two"]


def test_deadlines_pop_in_order_and_skip_moved_and_cancelled_keys() -> None:
    deadlines: Deadlines[str] = Deadlines()
    deadlines.set("a", 30)
    deadlines.set("b", 10)
    deadlines.set("c", 20)
    deadlines.set("b", 40)  # moved later
    deadlines.set("c", 20)  # set again at the same time
    assert deadlines.cancel("a")
    assert not deadlines.cancel("a")
    assert deadlines.pop_due(39) == ["c"]
    assert len(deadlines) == 1
    assert "b" in deadlines
    assert deadlines.pop_due(40) == ["b"]
    assert deadlines.pop_due(10**9) == []


def test_deadlines_stay_small_and_right_under_churn() -> None:
    rng = random.Random(7)
    deadlines: Deadlines[int] = Deadlines()
    expected: dict[int, int] = {}
    for _ in range(50_000):
        key = rng.randrange(100)
        if rng.random() < 0.5:
            expected[key] = rng.randrange(1_000_000)
            deadlines.set(key, expected[key])
        else:
            assert deadlines.cancel(key) == (expected.pop(key, None) is not None)
    assert len(deadlines._heap) <= 2 * len(expected) + 1024 + 1
    popped = deadlines.pop_due(10**9)
    assert sorted(popped) == sorted(expected)
    assert [expected[k] for k in popped] == sorted(expected.values())


def test_a_passive_create_only_looks(h: Harness, c: Client) -> None:
    assert ok(c.create_queue("session.p", passive=True, expires_ms=0)) == {
        "created": False,
        "exists": False,
        "queue": "session.p",
        "address": "session.p",  # so that a cluster says which nodes hold it (``elsewhere``)
    }
    assert "session.p" not in h.broker.queues  # nothing was made
    ok(c.create_queue("session.p", expires_ms=60_000))
    found = ok(c.create_queue("session.p", passive=True, expires_ms=0))
    assert (found["created"], found["expires_ms"]) == (False, 60_000)  # and nothing was changed
    assert gone_at(h, "session.p", step_ms=1000) == BASE_MS + 60_000
