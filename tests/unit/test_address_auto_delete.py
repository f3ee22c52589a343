"""Auto-created addresses go once unused (no queue, no publish), journaled; each user may auto-create only so many."""

from __future__ import annotations

from tests.unit.broker_harness import ANYCAST, MULTICAST, Client, Harness, ok

from tridentmq_core.settings import AddressSettingsEntry, BrokerSection, CoreSettings
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_shared.link.ops import ErrorCode

SCAN_MS = BrokerSection().expiry_scan_ms


class RecordingStore(MemoryStore):
    """The memory store, remembering the address records a journal would get."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str]] = []

    def add_address(self, name: str, routing_types: tuple[int, ...], *, auto_created: bool) -> int:
        self.records.append(("add", name))
        return 0

    def delete_address(self, name: str) -> None:
        self.records.append(("delete", name))


def harness(settings: CoreSettings | None = None) -> tuple[Harness, RecordingStore]:
    h = Harness(settings)
    store = RecordingStore()
    h.broker.store = store
    store.attach(h.broker.on_durable)
    return h, store


def after_scans(h: Harness, scans: int = 2) -> None:
    for _ in range(scans):
        h.tick(h.now_ms + SCAN_MS)


def topics(h: Harness, prefix: str) -> set[str]:
    return {name for name in h.broker.addresses if name.startswith(prefix)}


def test_topics_published_without_subscribers_are_deleted_and_journaled_as_deleted() -> None:
    h, store = harness()
    c = h.connect("sensors", user="device")
    names = [f"sensors.{n}" for n in range(500)]
    for name in names:
        c.publish(name, b"21.5", routing=MULTICAST, sync=False)
    h.sync()
    assert len(c.confirmed) == 500
    assert topics(h, "sensors.") == set(names)
    assert h.broker.catalog.auto_created_by == {"device": 500}
    after_scans(h)
    assert topics(h, "sensors.") == set()
    assert sorted(name for kind, name in store.records if kind == "delete") == sorted(names)
    assert h.broker.catalog.auto_created_by == {}


def test_a_topic_still_published_to_stays_and_goes_once_publishing_stops() -> None:
    h, _ = harness()
    c = h.connect("app")
    for _ in range(5):
        c.publish("live", b"x", routing=MULTICAST)
        h.tick(h.now_ms + SCAN_MS)
        assert "live" in h.broker.addresses
    after_scans(h)
    assert "live" not in h.broker.addresses
    c.publish("live", b"again", routing=MULTICAST)  # created anew on the next publish
    assert "live" in h.broker.addresses
    assert len(c.confirmed) == 6


def test_addresses_with_queues_stay_retained_and_durable_subscriptions_included() -> None:
    h, _ = harness()
    c = h.connect("app")
    c.publish("retained.topic", b"first", routing=MULTICAST)  # created by a publish, then given a queue
    ok(c.create_queue("retained.topic.lvq", "retained.topic", MULTICAST, last_value_key="", durable=True))
    c.publish("retained.topic", b"kept", routing=MULTICAST, last_value_key="k")
    ok(c.create_queue("sub.durable", "news", MULTICAST, durable=True))  # a durable subscription, nobody on it
    c.publish("news", b"n", routing=MULTICAST)
    after_scans(h, 5)
    assert {"retained.topic", "news"} <= set(h.broker.addresses)
    assert len(h.broker.queues["retained.topic.lvq"]) == 1


def test_an_address_whose_last_queue_goes_is_deleted_at_once() -> None:
    h, store = harness()
    c = h.connect("app")
    c.publish("orders", b"o", routing=ANYCAST)  # auto-creates the address and its auto-deleting queue
    consumer = c.consumer("orders")
    (delivery,) = c.take(consumer)
    c.ack(consumer, [delivery.id])
    ok(c.unsubscribe(consumer))
    assert "orders" not in h.broker.queues
    assert "orders" not in h.broker.addresses
    assert ("delete", "orders") in store.records


def test_an_address_a_queue_made_goes_with_its_last_queue() -> None:
    """What a device's connect makes in the core: a lock queue and a subscription queue, each on an address
    of its own that nothing else made. Both addresses stayed after the queues went, so every client id and
    topic ever seen stayed in memory (and journaled) for ever."""
    h, _ = harness()
    c = h.connect("gateway")
    ok(c.create_queue("$mqtt.lock.dev-1", "$mqtt.lock.dev-1", ANYCAST, durable=False))
    ok(c.create_queue("sub.dev-1", "devices.1.cmd", MULTICAST, durable=False))
    assert {"$mqtt.lock.dev-1", "devices.1.cmd"} <= set(h.broker.addresses)
    ok(c.delete_queue("$mqtt.lock.dev-1"))
    ok(c.delete_queue("sub.dev-1"))
    assert not {"$mqtt.lock.dev-1", "devices.1.cmd"} & set(h.broker.addresses)


def test_an_address_made_for_non_durable_queues_only_is_not_journaled() -> None:
    """No restart brings a non-durable queue back, so neither the address made for it: journaling it made
    two records per device connect (its making and its deletion). A durable queue on it journals it then."""
    h, store = harness()
    c = h.connect("gateway")
    ok(c.create_queue("sub.a", "devices.a", MULTICAST, durable=False))
    ok(c.create_queue("sub.b", "devices.b", MULTICAST, durable=False))
    ok(c.delete_queue("sub.a"))
    assert "devices.a" not in h.broker.addresses
    assert store.records == []
    ok(c.create_queue("sub.b.durable", "devices.b", MULTICAST, durable=True))
    assert store.records == [("add", "devices.b")]
    ok(c.delete_queue("sub.b.durable"))
    ok(c.delete_queue("sub.b"))
    assert store.records == [("add", "devices.b"), ("delete", "devices.b")]


def test_an_address_a_queue_made_stays_where_addresses_are_not_auto_created() -> None:
    h, store = harness(CoreSettings(address_settings=[AddressSettingsEntry(match="#", auto_create_addresses=False)]))
    c = h.connect("app")
    ok(c.create_queue("orders", "orders", ANYCAST))
    ok(c.delete_queue("orders"))
    assert "orders" in h.broker.addresses
    ok(c.create_queue("news.sub", "news", MULTICAST, durable=False))
    assert ("add", "news") in store.records  # it stays without queues: a restart must bring it back


def test_an_address_created_on_purpose_after_a_queue_made_it_stays() -> None:
    h, store = harness()
    c = h.connect("app")
    ok(c.create_queue("sub.a", "devices.a", MULTICAST, durable=False))
    assert ok(c._answer(c.conn.create_address("devices.a", [MULTICAST]))) == {"created": False}
    ok(c.delete_queue("sub.a"))
    after_scans(h)
    assert "devices.a" in h.broker.addresses
    assert store.records == [("add", "devices.a")]  # journaled, as not auto-created: a restart keeps it


def test_the_delay_is_an_address_setting() -> None:
    delay = 10 * SCAN_MS
    h, _ = harness(
        CoreSettings(
            address_settings=[
                AddressSettingsEntry(match="slow.#", auto_delete_addresses_delay_ms=delay),
                AddressSettingsEntry(match="kept.#", auto_delete_addresses=False),
            ]
        )
    )
    c = h.connect("app")
    for name in ("slow.a", "kept.a", "fast.a"):
        c.publish(name, b"x", routing=MULTICAST)
    after_scans(h)
    assert {"slow.a", "kept.a"} <= set(h.broker.addresses)
    assert "fast.a" not in h.broker.addresses
    h.tick(h.now_ms + delay)
    h.tick(h.now_ms + delay)
    assert "slow.a" not in h.broker.addresses
    assert "kept.a" in h.broker.addresses


def test_unused_auto_created_addresses_of_an_old_journal_go_after_a_restart() -> None:
    h, store = harness()
    state = RecoveredState(
        addresses={
            "old.topic": ([MULTICAST], True),  # auto-created, no queue: what earlier versions left behind
            "made.by.admin": ([MULTICAST], False),  # created on purpose: stays
            "subscribed": ([MULTICAST], True),
        },
        queues={"subscribed.q": {"address": "subscribed", "routing_type": MULTICAST}},
    )
    h.broker.restore(state, h.now_ms)
    after_scans(h)
    assert set(h.broker.addresses) >= {"made.by.admin", "subscribed"}
    assert "old.topic" not in h.broker.addresses
    assert ("delete", "old.topic") in store.records


def capped(cap: int) -> tuple[Harness, dict[str, Client]]:
    h, _ = harness(CoreSettings(broker=BrokerSection(max_auto_created_addresses_per_user=cap)))
    return h, {"alice": h.connect("a", user="alice"), "bob": h.connect("b", user="bob")}


def test_a_user_may_auto_create_only_so_many_addresses() -> None:
    h, clients = capped(3)
    alice, bob = clients["alice"], clients["bob"]
    for n in range(3):
        alice.publish(f"a.{n}", b"x", routing=MULTICAST)
    seq = alice.publish("a.3", b"x", routing=MULTICAST)
    refused = alice.rejected[seq]
    assert refused.code == ErrorCode.RESOURCE_LIMIT
    assert "max_auto_created_addresses_per_user" in refused.text
    assert "a.3" not in h.broker.addresses
    again = alice.publish("a.0", b"existing addresses take messages still", routing=MULTICAST)
    assert again in alice.confirmed
    assert bob.publish("b.0", b"another user has a cap of his own", routing=MULTICAST) in bob.confirmed
    after_scans(h)  # the unused ones go, and with them what they counted
    assert alice.publish("a.3", b"x", routing=MULTICAST) in alice.confirmed


def test_a_refused_anycast_send_creates_neither_address_nor_queue() -> None:
    h, clients = capped(1)
    alice = clients["alice"]
    first = alice.publish("q.1", b"x")
    second = alice.publish("q.2", b"x")
    assert first in alice.confirmed
    assert alice.rejected[second].code == ErrorCode.RESOURCE_LIMIT
    assert "q.2" not in h.broker.queues
    assert "q.2" not in h.broker.addresses


def test_no_cap_when_it_is_zero() -> None:
    h, clients = capped(0)
    seqs = [clients["alice"].publish(f"free.{n}", b"x", routing=MULTICAST, sync=False) for n in range(50)]
    h.sync()
    assert all(seq in clients["alice"].confirmed for seq in seqs)


def test_compaction_keeps_every_journaled_address_and_only_those() -> None:
    """Compaction copied only the addresses of durable queues: an address created on purpose with no durable
    queue (its subscribers' queues non-durable, or none yet) was gone after a compaction and a restart, and
    publishes to it were refused where addresses are not auto-created."""
    h, _ = harness()
    c = h.connect("app")
    assert ok(c._answer(c.conn.create_address("news", [MULTICAST]))) == {"created": True}
    ok(c.create_queue("news.sub", "news", MULTICAST, durable=False))
    ok(c.create_queue("orders", "orders", ANYCAST, durable=True))
    ok(c.create_queue("sub.dev", "devices.1", MULTICAST, durable=False))
    c.publish("topic.x", b"nobody listens", routing=MULTICAST)  # auto-created, journaled, watched
    kept = {name for name, _, _ in h.broker.durable_snapshot().addresses}
    assert kept == {"news", "orders", "topic.x"}
