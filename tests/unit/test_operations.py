"""Management operations on a pure broker (``tridentmq_core.operations``, ``tridentmq_core.mqtt_admin``): what
clients see after a purge, move, copy, pause or settings change, and the refusals."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from tests.unit.broker_harness import Harness, bodies, ok, recorded

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.management.operations_api import AUDITED_OPERATIONS
from tridentmq_core.mqtt_admin import MqttAdmin
from tridentmq_core.operations import OperationError, Operations, client_matches
from tridentmq_core.settings import AddressSettingsEntry, CoreSettings
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import RoutingType
from tridentmq_shared.mqtt_queues import (
    RETAINED_ADDRESS,
    TOPIC_PROPERTY,
    lock_queue,
    outbox_queue,
    retained_queue,
    session_queue,
    subscription_queue,
)
from tridentmq_shared.settings import SettingsError

NOW = 1_700_000_000_000


def _filled(count: int = 6) -> tuple[Harness, Operations]:
    h = Harness()
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    for n in range(count):
        c.publish("orders", f"m{n}".encode(), durable=True, properties={"color": "red" if n % 2 else "blue"})
    return h, Operations(h.broker)


def test_purge_with_a_selector_takes_only_matching_messages_and_acknowledges_them_in_the_store() -> None:
    h, store, sink = recorded()
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    for n in range(4):
        c.publish("orders", f"m{n}".encode(), durable=True, properties={"color": "red" if n % 2 else "blue"})
    ops = Operations(h.broker)
    assert ops.purge("orders", "color = 'red'", NOW) == {"purged": 2}
    assert [ids for queue, ids in store.acks if queue == "orders"] == [[2, 4]]
    assert [fields["reason"] for _, fields in sink.of("msg.acked")] == ["purged", "purged"]
    consumer = c.consumer("orders")
    assert bodies(c.take(consumer)) == [b"m0", b"m2"]


def test_purge_without_a_selector_leaves_in_flight_messages_with_their_consumer() -> None:
    h, ops = _filled(4)
    c = h.clients[0]
    consumer = c.consumer("orders", credit=1)
    (held,) = c.take(consumer)
    assert ops.purge("orders", None, NOW) == {"purged": 3}
    assert len(h.broker.queues["orders"]) == 0
    c.ack(consumer, [held.id])
    assert h.broker.queues["orders"].in_flight == 0


@pytest.mark.parametrize("selector", [None, "color = 'red'"])
def test_purge_drops_delayed_redeliveries_and_scheduled_messages_too(selector: str | None) -> None:
    """They wait outside the queue for their time, and came back into it after the purge (Artemis' purge drops
    them too)."""
    entry = AddressSettingsEntry(match="#", redelivery_delay_ms=1_000)
    h, store, sink = recorded(CoreSettings(address_settings=[entry]))
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    red = {"color": "red"}
    c.publish("orders", b"delayed", durable=True, properties=red)
    consumer = c.consumer("orders")
    (delayed,) = c.take(consumer)
    c.nack(consumer, [delayed.id])  # back in 1 s
    c.publish("orders", b"scheduled", durable=True, properties=red, scheduled_ms=h.now_ms + 1_000)
    c.publish("orders", b"blue later", durable=True, properties={"color": "blue"}, scheduled_ms=h.now_ms + 1_000)
    assert Operations(h.broker).purge("orders", selector, NOW) == {"purged": 3 if selector is None else 2}
    assert sorted(i for queue, ids in store.acks if queue == "orders" for i in ids) == (
        [1, 2, 3] if selector is None else [1, 2]
    )
    assert [fields["reason"] for _, fields in sink.of("msg.acked")] == ["purged"] * (3 if selector is None else 2)
    h.tick(h.now_ms + 1_000)
    assert bodies(c.take(consumer)) == ([] if selector is None else [b"blue later"])
    if selector is None:
        assert h.broker.memory.used == 0
        assert h.broker.durable_snapshot().messages == []


def test_browse_pages_in_delivery_order_with_headers_and_a_bounded_preview() -> None:
    _, ops = _filled(5)
    first = ops.browse("orders", 0, 2, None, 1)
    assert first["total"] == 5
    assert [m["body"] for m in first["messages"]] == ["m", "m"]
    assert all(m["body_truncated"] and m["size"] == 2 for m in first["messages"])
    rest = ops.browse("orders", 2, 10, "color = 'blue'", 100)
    assert rest["total"] == 3
    assert [m["body"] for m in rest["messages"]] == ["m4"]
    assert rest["messages"][0]["properties"] == {"color": "blue"}
    assert rest["messages"][0]["state"] == "queued"


def test_browse_shows_binary_bodies_as_base64() -> None:
    h = Harness()
    c = h.connect()
    ok(c.create_queue("bin"))
    c.publish("bin", b"\xff\x00")
    (message,) = Operations(h.broker).browse("bin", 0, 10, None, 16)["messages"]
    assert (message["body"], message["body_encoding"]) == ("/wA=", "base64")


def test_dead_letters_move_back_to_their_origin_queue_and_are_delivered_there() -> None:
    h = Harness()
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    ok(c.create_queue("DLQ", durable=True))
    c.send_all("orders", [b"a", b"b", b"c"], durable=True)
    consumer = c.consumer("orders", credit=10)
    c.nack(consumer, [d.id for d in c.take(consumer)], NackMode.REJECT)  # dead-lettered at once
    assert len(h.broker.queues["DLQ"]) == 3
    ops = Operations(h.broker)
    assert ops.move("DLQ", None, selector=None, message_ids=None, limit=2, copy=False, now_ms=NOW) == {
        "moved": 2,
        "skipped": 0,
    }
    back = c.take(consumer)
    assert bodies(back) == [b"a", b"b"]
    assert all(d.count == 1 for d in back)  # a fresh message: its delivery count starts again
    assert all("_AMQ_ORIG_QUEUE" not in d.props for d in back)
    assert len(h.broker.queues["DLQ"]) == 1


def test_move_to_a_named_queue_and_copy_keep_the_source_as_it_should() -> None:
    h, ops = _filled(4)
    c = h.clients[0]
    ok(c.create_queue("audit"))
    assert (
        ops.move("orders", "audit", selector="color = 'red'", message_ids=None, limit=-1, copy=True, now_ms=NOW)[
            "copied"
        ]
        == 2
    )
    assert len(h.broker.queues["orders"]) == 4
    assert ops.move("orders", "audit", selector=None, message_ids=[1], limit=-1, copy=False, now_ms=NOW)["moved"] == 1
    assert len(h.broker.queues["orders"]) == 3
    consumer = c.consumer("audit")
    assert bodies(c.take(consumer)) == [b"m1", b"m3", b"m0"]


def test_a_move_journals_the_copies_before_the_originals_acknowledgement() -> None:
    """A crash between the two records must leave both messages, never neither (management.md)."""
    h, store, _ = recorded()
    c = h.connect()
    ok(c.create_queue("orders", durable=True))
    ok(c.create_queue("audit", durable=True))
    for n in range(2):
        c.publish("orders", f"m{n}".encode(), durable=True)
    h.sync()
    order: list[str] = []
    store.add_message = lambda message, queues, counts=None: order.append(f"add {queues[0]}") or 0  # type: ignore[method-assign]
    store.acknowledge = lambda queue, ids: order.append(f"ack {queue} {len(ids)}")  # type: ignore[method-assign]
    moved = Operations(h.broker).move(
        "orders", "audit", selector=None, message_ids=None, limit=-1, copy=False, now_ms=NOW
    )
    assert moved["moved"] == 2
    assert order == ["add audit", "add audit", "ack orders 2"]


def test_move_refuses_an_unknown_target_and_the_same_queue() -> None:
    _, ops = _filled(1)
    with pytest.raises(OperationError) as unknown:
        ops.move("orders", "nowhere", selector=None, message_ids=None, limit=-1, copy=False, now_ms=NOW)
    assert unknown.value.status == 404
    with pytest.raises(OperationError) as same:
        ops.move("orders", "orders", selector=None, message_ids=None, limit=-1, copy=False, now_ms=NOW)
    assert same.value.status == 400
    with pytest.raises(OperationError) as bad:
        ops.purge("orders", "color = ", NOW)
    assert bad.value.status == 400


def test_move_back_to_origin_skips_messages_without_one() -> None:
    h, ops = _filled(2)
    result = ops.move("orders", None, selector=None, message_ids=None, limit=-1, copy=False, now_ms=NOW)
    assert result == {"moved": 0, "skipped": 2}
    assert len(h.broker.queues["orders"]) == 2


def test_a_paused_queue_takes_messages_in_and_delivers_none_until_resumed() -> None:
    h, ops = _filled(2)
    c = h.clients[0]
    ops.pause(queue="orders", address=None, paused=True)
    consumer = c.consumer("orders")
    c.publish("orders", b"later")
    assert c.take(consumer) == []
    assert len(h.broker.queues["orders"]) == 3
    ops.pause(queue="orders", address=None, paused=False)
    h.sync()
    assert bodies(c.take(consumer)) == [b"m0", b"m1", b"later"]


def test_pausing_an_address_pauses_its_queues_and_those_it_gets_later() -> None:
    h = Harness()
    c = h.connect()
    ok(c.create_queue("news.a", "news", routing=int(RoutingType.MULTICAST)))
    ops = Operations(h.broker)
    assert ops.pause(queue=None, address="news", paused=True) == {"queues": 1}
    ok(c.create_queue("news.b", "news", routing=int(RoutingType.MULTICAST)))
    c.publish("news", b"x", routing=int(RoutingType.MULTICAST))
    a, b = c.consumer("news.a"), c.consumer("news.b")
    assert c.take(a) == []
    assert c.take(b) == []
    assert ops.pause(queue=None, address="news", paused=False) == {"queues": 2}
    h.sync()
    assert bodies(c.take(a)) == [b"x"]
    assert bodies(c.take(b)) == [b"x"]


def test_create_and_delete_queue_and_their_refusals() -> None:
    h = Harness()
    ops = Operations(h.broker)
    assert ops.create_queue(
        "jobs",
        "jobs",
        RoutingType.ANYCAST,
        durable=True,
        filter_text="prio > 3",
        exclusive=False,
        last_value_key=None,
        max_consumers=-1,
        now_ms=NOW,
    ) == {"created": 1}
    assert h.broker.queues["jobs"].filter is not None
    with pytest.raises(OperationError) as exists:
        ops.create_queue(
            "jobs",
            "jobs",
            RoutingType.ANYCAST,
            durable=True,
            filter_text=None,
            exclusive=False,
            last_value_key=None,
            max_consumers=-1,
            now_ms=NOW,
        )
    assert exists.value.status == 409
    with pytest.raises(OperationError) as bad:
        ops.create_queue(
            "x",
            "a..b",
            RoutingType.ANYCAST,
            durable=True,
            filter_text=None,
            exclusive=False,
            last_value_key=None,
            max_consumers=-1,
            now_ms=NOW,
        )
    assert bad.value.status == 400
    c = h.connect()
    consumer = c.consumer("jobs")
    assert ops.delete_queue("jobs", NOW) == {"deleted": 1, "messages": 0}
    assert "jobs" not in h.broker.queues
    h.sync()
    assert [e.consumer_id for e in c.events(ev.ConsumerClosed)] == [consumer]
    with pytest.raises(OperationError) as gone:
        ops.delete_queue("jobs", NOW)
    assert gone.value.status == 404


def test_address_settings_change_applies_to_the_next_dead_letter_decision() -> None:
    h = Harness()
    c = h.connect()
    ok(c.create_queue("orders"))
    ok(c.create_queue("DLQ"))
    ops = Operations(h.broker)
    assert ops.address_settings("orders")["resolved"]["max_delivery_attempts"] == 10
    ops.set_address_settings("orders", {"max_delivery_attempts": 2})
    assert ops.address_settings("orders")["resolved"]["max_delivery_attempts"] == 2
    assert ops.address_settings(None)["entries"] == [{"match": "orders", "max_delivery_attempts": 2}]
    c.publish("orders", b"x")
    consumer = c.consumer("orders")
    for _ in range(2):
        c.nack(consumer, [d.id for d in c.take(consumer)], NackMode.REDELIVER)
        c.flow(consumer, 1)
    assert len(h.broker.queues["DLQ"]) == 1
    ops.set_address_settings("orders", {})  # the entry is replaced: its fields fall through again
    assert ops.address_settings("orders")["resolved"]["max_delivery_attempts"] == 10


@pytest.mark.parametrize(
    ("values", "text"),
    [({"max_delivery_attempts": "3"}, "max_delivery_attempts takes"), ({"nope": 1}, "unknown address setting"),
     ({"address_full_policy": "KEEP"}, "address_full_policy 'KEEP' is not one of"),
     ({"default_routing_type": "both"}, "default_routing_type is"),
     ({"redelivery_multiplier": float("nan")}, "redelivery_multiplier is a number"),
     ({"redelivery_multiplier": float("inf")}, "redelivery_multiplier is a number"),
     ({"redelivery_delay_ms": -5}, "redelivery_delay_ms is at least 0"),
     ({"max_delivery_attempts": -2}, "max_delivery_attempts is at least -1"),
     ({"dead_letter_address": "dead.#"}, "dead_letter_address")],
)  # fmt: skip
def test_address_settings_values_are_checked(values: dict[str, object], text: str) -> None:
    ops = Operations(Harness().broker)
    with pytest.raises(OperationError) as refused:
        ops.set_address_settings("orders", values)
    assert refused.value.status == 400
    assert text in refused.value.text


@pytest.mark.parametrize("match", ["", "a..b"])
def test_an_address_settings_entry_that_matches_no_address_is_refused(match: str) -> None:
    """An empty ``match`` was accepted and matched nothing: its settings applied nowhere, silently."""
    with pytest.raises(SettingsError, match="match is an address or a pattern"):
        AddressSettingsRepository([AddressSettingsEntry(match=match, max_delivery_attempts=3)])


def test_a_redelivery_delay_that_would_overflow_is_the_longest_delay() -> None:
    """A multiplier of 2 and a message that is never dead-lettered: its 1,025th attempt raised OverflowError
    in the middle of a nack."""
    h = Harness()
    Operations(h.broker).set_address_settings(
        "orders", {"redelivery_delay_ms": 100, "redelivery_multiplier": 2.0, "max_delivery_attempts": -1}
    )
    settings = h.broker.address_settings.resolve("orders")
    assert settings.redelivery_delay(3) == 400
    assert settings.redelivery_delay(5000) == settings.max_redelivery_delay_ms
    # A whole multiplier, as a settings file may give it, is no exact integer of a million digits either.
    whole = dataclasses.replace(settings, redelivery_multiplier=2)
    assert whole.redelivery_delay(10_000_000) == whole.max_redelivery_delay_ms


def test_a_client_is_named_by_connection_id_whole_name_or_a_word_after_the_protocol() -> None:
    h = Harness()
    stomp = h.connect("stomp 127.0.0.1:50412").session
    mqtt = h.connect("mqtt sensor-1 127.0.0.1:50413").session
    assert client_matches(stomp, "127.0.0.1:50412")
    assert client_matches(stomp, stomp.conn_id)
    assert client_matches(mqtt, "sensor-1")
    assert client_matches(mqtt, "mqtt sensor-1 127.0.0.1:50413")
    assert not client_matches(mqtt, "mqtt")
    assert not client_matches(stomp, "sensor-1")
    spaced = h.connect("mqtt my sensor 127.0.0.1:50414").session  # an MQTT client id may hold spaces
    assert client_matches(spaced, "my sensor")
    assert not client_matches(mqtt, "my sensor")


def test_mqtt_sessions_are_listed_and_deleted_with_their_subscription_queues() -> None:
    h = Harness()
    c = h.connect("mqtt gateway")
    client = "sensor-1"
    record = msgpack.packb({"v": 1, "subs": {"a/b": [1, False, False, None]}, "in": {}, "out": {}, "user": "bob"})
    ok(c.create_queue(session_queue(client), durable=True, last_value_key="state"))
    c.publish(session_queue(client), record, durable=True, last_value_key="state")
    ok(c.create_queue(subscription_queue(client, "a/b"), "a.b", routing=int(RoutingType.MULTICAST)))
    c.publish("a.b", b"queued", routing=int(RoutingType.MULTICAST))
    ok(c.create_queue(lock_queue(client)))
    c.consumer(lock_queue(client))
    ok(c.create_queue(outbox_queue(client), durable=True))  # retained messages on their way to the client
    c.publish(outbox_queue(client), b"retained", durable=True)
    ok(c.create_queue(lock_queue("clean:one")))  # a clean session: a lock queue only
    admin = MqttAdmin(h.broker)
    sessions = {s["label"]: s for s in admin.sessions()}
    assert sessions["sensor-1"] == {
        "client_id": "sensor-1",
        "label": "sensor-1",
        "persistent": True,
        "connected": True,
        "user": "bob",
        "subscriptions": ["a/b"],
        "queued": 2,
        "expires_ms": -1,
    }
    assert sessions["clean_one"]["client_id"] is None  # its id holds a character the queue name cannot show
    assert not sessions["clean_one"]["persistent"]
    assert admin.delete_session(client, NOW) == {"deleted": 1, "queues": 4}
    assert not any(client in name for name in h.broker.queues)
    with pytest.raises(OperationError) as gone:
        admin.delete_session(client, NOW)
    assert gone.value.status == 404


def test_retained_messages_are_listed_and_cleared_by_an_empty_retained_publish() -> None:
    h = Harness()
    c = h.connect("mqtt gateway")
    name = retained_queue(h.broker.node_id)
    ok(
        c.create_queue(
            name, RETAINED_ADDRESS, routing=int(RoutingType.MULTICAST), durable=True, last_value_key=TOPIC_PROPERTY
        )
    )
    for topic in ("home/kitchen/temp", "home/hall/temp", "garden/rain"):
        c.publish(
            RETAINED_ADDRESS,
            topic.encode(),
            routing=int(RoutingType.MULTICAST),
            durable=True,
            properties={TOPIC_PROPERTY: topic},
        )
    admin = MqttAdmin(h.broker)
    listed = admin.retained("home/", 10, 64)
    assert listed["total"] == 2
    assert [r["topic"] for r in listed["retained"]] == ["home/hall/temp", "home/kitchen/temp"]
    assert admin.delete_retained("home/hall/temp", NOW) == {"cleared": 1}
    h.sync()
    assert [r["topic"] for r in admin.retained("", 10, 64)["retained"]] == ["garden/rain", "home/kitchen/temp"]
    with pytest.raises(OperationError) as gone:
        admin.delete_retained("home/hall/temp", NOW)
    assert gone.value.status == 404


def test_every_audited_operation_is_an_event_the_spark_jobs_know() -> None:
    """Else the Spark jobs would count each operator's action as a bad record (``unknown_event``)."""
    from tridentmq_spark.schema import KNOWN_EVENTS  # noqa: PLC0415 - pyarrow, only for this test

    assert {f"mgmt.{operation}" for operation in AUDITED_OPERATIONS} <= KNOWN_EVENTS


def test_every_event_the_core_emits_is_one_the_spark_jobs_know() -> None:
    """Every event name the core passes to its audit sink (read from its source: the names are literals at
    the call) is in the Spark schema: ``node.forgotten`` was not, and each operator's forget of a node would
    have been a bad record."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from tridentmq_spark.schema import KNOWN_EVENTS  # noqa: PLC0415 - pyarrow, only for this test

    source = Path(__file__).parents[2] / "services" / "core-broker" / "src" / "tridentmq_core"
    # ``emit(<time>, "<event>", ...)`` and ``message(<time>, "<event>", ...)``; the time may hold one call.
    call = re.compile(r'(?:emit|message)\(\s*(?:[^,()]|\([^()]*\))+,\s*"([a-z_]+\.[a-z_.]+)"')
    emitted = {name for path in source.rglob("*.py") for name in call.findall(path.read_text())}
    assert {"node.forgotten", "conn.opened", "msg.sent", "queue.expired"} <= emitted  # the scan finds them
    assert emitted <= KNOWN_EVENTS
