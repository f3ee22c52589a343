"""Unit tests for the management HTTP server (tridentmq_core.management) against a real in-process broker."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tridentmq_core.audit import NullAuditSink
from tridentmq_core.broker import Broker
from tridentmq_core.management import NodeStatus, QueueRates, create_app, render_metrics
from tridentmq_core.management.metrics import escape_label
from tridentmq_core.queues import Consumer
from tridentmq_core.security import Principal
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.memory import MemoryStore
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import LinkConnection, Role, State
from tridentmq_shared.message import RoutingType, new_message

NODE_ID = "0f1e2d3c-node"
NOW_MS = 1_700_000_000_000
WEIRD_QUEUE = 'we"ird\\q\nname'
ANYCAST = int(RoutingType.ANYCAST)
MULTICAST = int(RoutingType.MULTICAST)

Api = tuple[TestClient[web.Request, web.Application], Broker, NodeStatus, QueueRates]
SampleKey = tuple[str, frozenset[tuple[str, str]]]


class Link:
    """A client LinkConnection wired to a server LinkConnection whose events go to the broker."""

    def __init__(self, broker: Broker, conn_id: str, client_name: str, user: str = "alice") -> None:
        self.broker = broker
        self.client = LinkConnection(Role.CLIENT)
        self.server = LinkConnection(Role.SERVER)
        self.client.hello(user, None, client_name)
        hello = self.server.receive_data(self.client.data_to_send(), 0.0)
        assert isinstance(hello[0], ev.HelloReceived)
        self.server.accept(broker.node_id, conn_id, 1000, 0.0)
        principal = Principal(user, frozenset(), unrestricted=True)
        self.session: Session = broker.open_session(
            self.server, conn_id, principal, "127.0.0.1:5000", hello[0].client_name, NOW_MS
        )
        welcomed = self.client.receive_data(self.server.data_to_send(), 0.0)
        assert isinstance(welcomed[0], ev.Welcomed)
        assert self.client.state is State.OPEN

    def roundtrip(self) -> list[ev.Event]:
        """Send what the client queued, let the broker handle it, return what the client receives."""
        # b"" would mean end of stream to the codec, so only frames are passed on.
        request = self.client.data_to_send()
        if request:
            self.broker.handle(self.session, self.server.receive_data(request, 0.0), NOW_MS)
        self.broker.flush_dispatch(NOW_MS)
        answer = self.server.data_to_send()
        events = self.client.receive_data(answer, 0.0) if answer else []
        assert self.client.state is State.OPEN, events
        return events


def make_broker() -> Broker:
    return Broker(NODE_ID, CoreSettings(), store=MemoryStore(), audit=NullAuditSink(), first_message_id=1)


def populate(broker: Broker) -> Link:
    """orders (anycast, 5 published, 2 delivered, 1 acked), a filtered multicast queue, a weird name,
    one unrouted multicast publish (which auto-creates its address)."""
    link = Link(broker, "conn-1", 'producer "one"')
    link.client.create_queue({"name": "orders", "address": "orders", "routing_type": ANYCAST})
    link.client.create_queue(
        {
            "name": "audit.eu",
            "address": "events",
            "filter": "region = 'eu'",
            "routing_type": MULTICAST,
            "durable": False,
        }
    )
    replies = link.roundtrip()
    assert [type(e) for e in replies] == [ev.Reply] * 2, replies
    # A link may no longer make a queue whose name holds a control character: this one is as a journal from an
    # older version would bring it back, and what shows it must still escape it.
    broker.catalog.create_queue(WEIRD_QUEUE, "weird", RoutingType.ANYCAST, durable=True, now_ms=NOW_MS)
    for n in range(5):
        link.client.publish(new_message("orders", b"x%d" % n, routing=ANYCAST))
    link.client.publish(new_message("events", b"e", routing=MULTICAST, properties={"region": "eu"}))
    link.client.publish(new_message("weird", b"w"))
    link.client.publish(new_message("nowhere.multicast", b"lost", routing=MULTICAST))
    link.roundtrip()
    _, consumer_id = link.client.subscribe("orders", 2)
    deliveries = [e for e in link.roundtrip() if isinstance(e, ev.Deliveries)]
    ids = [op[3][0] for batch in deliveries for op in batch.ops]
    assert len(ids) == 2
    link.client.ack(consumer_id, ids[:1])
    link.roundtrip()
    return link


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    broker = make_broker()
    status = NodeStatus(started_at=0.0, link_port=61616)
    rates = QueueRates()
    async with TestClient(TestServer(create_app(broker, status, rates))) as client:
        yield client, broker, status, rates


def parse_metrics(text: str) -> tuple[dict[str, tuple[str, str]], dict[SampleKey, float]]:
    """(family -> (type, help), (metric, labels) -> value); fails on any line it does not understand."""
    families: dict[str, tuple[str, str]] = {}
    helps: dict[str, str] = {}
    samples: dict[SampleKey, float] = {}
    sample_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
    seen_order: list[str] = []
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name in helps, f"TYPE before HELP for {name}"
            assert name not in families, f"{name} declared twice"
            families[name] = (kind, helps[name])
            seen_order.append(name)
        else:
            match = sample_re.match(line)
            assert match, f"bad sample line {line!r}"
            name, raw_labels, value = match.groups()
            family = seen_order[-1]
            suffixes = ("_bucket", "_sum", "_count") if families[family][0] == "histogram" else ("",)
            assert any(name == family + suffix for suffix in suffixes), f"{name} is outside its family block"
            labels: list[tuple[str, str]] = []
            pos = 0
            while raw_labels and pos < len(raw_labels):
                lm = label_re.match(raw_labels, pos)
                assert lm, f"bad labels {raw_labels!r}"
                unescaped = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), lm[2])
                labels.append((lm[1], unescaped))
                pos = lm.end()
            samples[(name, frozenset(labels))] = float(value)
    return families, samples


def q_labels(queue: str, address: str, routing: str) -> frozenset[tuple[str, str]]:
    return frozenset({("queue", queue), ("address", address), ("routing", routing)})


# ---------------------------------------------------------------------- probes
async def test_healthz_is_ok_even_while_starting(api: Api) -> None:
    client, _, _, _ = api
    response = await client.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"status": "ok"}


async def test_readyz_follows_the_status(api: Api) -> None:
    client, _, status, _ = api
    response = await client.get("/readyz")
    assert response.status == 503
    assert await response.json() == {"status": "starting"}
    status.ready = True
    status.recovered["orders"] = 12
    response = await client.get("/readyz")
    assert response.status == 200
    assert await response.json() == {"status": "ready", "recovered": {"orders": 12}, "truncated": []}


async def test_unknown_path_is_404(api: Api) -> None:
    client, _, _, _ = api
    response = await client.get("/api/nothing")
    assert response.status == 404


# ---------------------------------------------------------------------- JSON API
async def test_empty_broker_answers_every_route(api: Api) -> None:
    client, _, _, _ = api
    for path in ("/metrics", "/api/status", "/api/addresses", "/api/queues", "/api/connections"):
        response = await client.get(path)
        assert response.status == 200, path
    assert await (await client.get("/api/queues")).json() == []
    families, samples = parse_metrics(await (await client.get("/metrics")).text())
    assert samples[("tridentmq_queues", frozenset())] == 0
    assert families["tridentmq_queue_depth"][0] == "gauge"


async def test_status(api: Api) -> None:
    client, broker, status, _ = api
    populate(broker)
    status.ready = True
    body = await (await client.get("/api/status")).json()
    assert body["node_id"] == NODE_ID
    assert body["name"] == "core"
    assert body["ready"] is True
    assert body["link_port"] == 61616
    assert body["uptime_s"] > 0
    assert body["connections"] == 1
    assert body["addresses"] == 4  # the unrouted multicast publish auto-created "nowhere.multicast"
    assert body["queues"] == 3
    assert body["messages"] == 3 + 1 + 1  # orders: 5 - 2 delivered; audit.eu 1; weird 1
    assert body["in_flight"] == 1
    assert body["counters"] == {
        "routed": 7,
        "unrouted": 1,
        "duplicates": 0,
        "acked": 1,
        "expired": 0,
        "dead_lettered": 0,
        "rejected": 0,
        "dropped": 0,
        "forwarded": 0,
        "received": 0,
        "redistributed": 0,
    }


async def test_addresses(api: Api) -> None:
    client, broker, _, _ = api
    populate(broker)
    body = await (await client.get("/api/addresses")).json()
    # Each made by its first queue: auto-created, it goes with the last of its queues.
    assert body == [
        {"name": "events", "routing_types": ["multicast"], "queues": ["audit.eu"], "auto_created": True},
        {"name": "nowhere.multicast", "routing_types": ["multicast"], "queues": [], "auto_created": True},
        {"name": "orders", "routing_types": ["anycast"], "queues": ["orders"], "auto_created": True},
        {"name": "weird", "routing_types": ["anycast"], "queues": [WEIRD_QUEUE], "auto_created": True},
    ]


async def test_queues_list_and_one(api: Api) -> None:
    client, broker, _, _ = api
    populate(broker)
    body: list[dict[str, Any]] = await (await client.get("/api/queues")).json()
    assert [q["name"] for q in body] == sorted(["orders", "audit.eu", WEIRD_QUEUE])
    orders = next(q for q in body if q["name"] == "orders")
    assert orders == {
        "name": "orders",
        "address": "orders",
        "routing_type": "anycast",
        "durable": True,
        "temporary": False,
        "exclusive": False,
        "paused": False,
        "filter": None,
        "depth": 3,
        "in_flight": 1,
        "consumers": 1,
        "forwarders": 0,
        "added": 5,
        "acked": 1,
        "delivered": 2,
        "expired": 0,
        "dead_lettered": 0,
        "enqueue_rate": 0.0,
        "ack_rate": 0.0,
    }
    response = await client.get("/api/queues/audit.eu")
    assert response.status == 200
    audit = await response.json()
    assert audit["routing_type"] == "multicast"
    assert audit["filter"] == "region = 'eu'"
    assert audit["durable"] is False
    assert audit["depth"] == 1
    response = await client.get("/api/queues/" + quote(WEIRD_QUEUE, safe=""))
    assert response.status == 200
    assert (await response.json())["name"] == WEIRD_QUEUE


async def test_a_cluster_connection_moving_a_queue_is_no_consumer_of_it(api: Api) -> None:
    """Issue 21: a queue whose messages sat still showed ``consumers: 1`` with the subscriber on another node;
    the one consumer was the redistributor that moves them there."""
    client, broker, _, _ = api
    populate(broker)
    principal = Principal("cluster:node-2", frozenset(), unrestricted=True, cluster=True)
    bridge = broker.open_session(
        LinkConnection(Role.SERVER), "bridge", principal, "127.0.0.1:6000", "cluster:node-2", NOW_MS
    )
    mover = Consumer(9, bridge, broker.queues["orders"], 0)
    mover.forwarder = True
    broker.consuming.add_forwarder(bridge, mover)
    orders = await (await client.get("/api/queues/orders")).json()
    assert (orders["consumers"], orders["forwarders"]) == (1, 1)
    _, samples = parse_metrics(await (await client.get("/metrics")).text())
    labels = q_labels("orders", "orders", "anycast")
    assert (samples[("tridentmq_queue_consumers", labels)], samples[("tridentmq_queue_forwarders", labels)]) == (1, 1)


async def test_missing_queue_is_a_json_404(api: Api) -> None:
    client, _, _, _ = api
    response = await client.get("/api/queues/nope")
    assert response.status == 404
    assert "nope" in (await response.json())["error"]


async def test_connections(api: Api) -> None:
    client, broker, _, _ = api
    link = populate(broker)
    Link(broker, "conn-2", "idle")
    body = await (await client.get("/api/connections")).json()
    assert body == [
        {
            "conn_id": "conn-1",
            "peer": "127.0.0.1:5000",
            "client_name": 'producer "one"',
            "user": "alice",
            "opened_ms": NOW_MS,
            "consumers": 1,
        },
        {
            "conn_id": "conn-2",
            "peer": "127.0.0.1:5000",
            "client_name": "idle",
            "user": "alice",
            "opened_ms": NOW_MS,
            "consumers": 0,
        },
    ]
    broker.close_session(link.session, NOW_MS)
    body = await (await client.get("/api/connections")).json()
    assert [c["conn_id"] for c in body] == ["conn-2"]
    orders = await (await client.get("/api/queues/orders")).json()
    assert (orders["depth"], orders["in_flight"], orders["consumers"]) == (4, 0, 0)  # unacked one requeued


# ---------------------------------------------------------------------- metrics
async def test_metrics_exposition(api: Api) -> None:
    client, broker, status, _ = api
    populate(broker)
    status.ready = True
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families, samples = parse_metrics(await response.text())

    for name in (
        "connections",
        "addresses",
        "queues",
        "queue_depth",
        "queue_consumers",
        "queue_in_flight",
        "uptime_seconds",
        "node_info",
    ):
        assert families[f"tridentmq_{name}"][0] == "gauge", name
    for name in ("added", "acked", "delivered", "expired", "dead_lettered"):
        assert families[f"tridentmq_queue_messages_{name}_total"][0] == "counter", name
    for name in ("routed", "unrouted", "duplicates", "acked", "expired", "dead_lettered", "rejected"):
        assert families[f"tridentmq_messages_{name}_total"][0] == "counter", name
    assert all(help_text for _, help_text in families.values())

    assert samples[("tridentmq_connections", frozenset())] == 1
    assert samples[("tridentmq_addresses", frozenset())] == 4
    assert samples[("tridentmq_queues", frozenset())] == 3
    orders = q_labels("orders", "orders", "anycast")
    assert samples[("tridentmq_queue_depth", orders)] == 3
    assert samples[("tridentmq_queue_consumers", orders)] == 1
    assert samples[("tridentmq_queue_in_flight", orders)] == 1
    assert samples[("tridentmq_queue_messages_added_total", orders)] == 5
    assert samples[("tridentmq_queue_messages_acked_total", orders)] == 1
    assert samples[("tridentmq_queue_messages_delivered_total", orders)] == 2
    assert samples[("tridentmq_queue_depth", q_labels("audit.eu", "events", "multicast"))] == 1
    assert samples[("tridentmq_messages_routed_total", frozenset())] == 7
    assert samples[("tridentmq_messages_unrouted_total", frozenset())] == 1
    assert samples[("tridentmq_messages_acked_total", frozenset())] == 1
    assert samples[("tridentmq_uptime_seconds", frozenset())] > 0
    assert samples[("tridentmq_node_info", frozenset({("node_id", NODE_ID), ("name", "core")}))] == 1


async def test_metrics_escape_label_values(api: Api) -> None:
    client, broker, _, _ = api
    populate(broker)
    text = await (await client.get("/metrics")).text()
    assert 'queue="we\\"ird\\\\q\\nname"' in text
    _, samples = parse_metrics(text)  # the raw newline did not split the sample line
    assert samples[("tridentmq_queue_depth", q_labels(WEIRD_QUEUE, "weird", "anycast"))] == 1


def test_escape_label() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert escape_label("plain.name") == "plain.name"


# ---------------------------------------------------------------------- rates
def test_rates_from_successive_samples() -> None:
    broker = make_broker()
    link = populate(broker)
    rates = QueueRates()
    assert rates.rates("orders") == (0.0, 0.0)
    rates.sample(broker, 100.0)
    assert rates.rates("orders") == (0.0, 0.0)  # one sample is no rate yet
    for n in range(4):
        link.client.publish(new_message("orders", b"y%d" % n, routing=ANYCAST))
    link.roundtrip()
    rates.sample(broker, 102.0)
    assert rates.rates("orders") == (2.0, 0.0)
    assert rates.rates("audit.eu") == (0.0, 0.0)
    assert rates.rates("missing") == (0.0, 0.0)
    rates.sample(broker, 102.0)  # no time passed: nothing changes
    assert rates.rates("orders") == (2.0, 0.0)
    rates.sample(broker, 103.0)
    assert rates.rates("orders") == (0.0, 0.0)


async def test_rates_appear_in_the_api_and_metrics(api: Api) -> None:
    client, broker, _, rates = api
    link = populate(broker)
    rates.sample(broker, 10.0)
    for n in range(3):
        link.client.publish(new_message("orders", b"z%d" % n, routing=ANYCAST))
    link.roundtrip()
    rates.sample(broker, 10.5)
    orders = await (await client.get("/api/queues/orders")).json()
    assert (orders["enqueue_rate"], orders["ack_rate"]) == (6.0, 0.0)
    _, samples = parse_metrics(render_metrics(broker, NodeStatus(started_at=0.0), rates))
    assert samples[("tridentmq_queue_enqueue_rate", q_labels("orders", "orders", "anycast"))] == 6.0


def test_deleted_and_recreated_queue_reports_no_negative_rate() -> None:
    broker = make_broker()
    link = populate(broker)
    rates = QueueRates()
    rates.sample(broker, 1.0)
    link.client.unsubscribe(1)
    link.client.delete_queue("orders")
    link.client.create_queue({"name": "orders", "address": "orders"})
    link.roundtrip()
    rates.sample(broker, 2.0)
    assert rates.rates("orders") == (0.0, 0.0)


def test_rates_of_a_queue_quiet_for_long_or_made_since_the_last_sample() -> None:
    """A sample looks only at the queues whose messages came or went: one quiet for many samples counts on from
    its counters, a new one (also one made again under a deleted one's name) from zero."""
    broker = make_broker()
    link = populate(broker)
    for n in range(3):
        link.client.publish(new_message("orders", b"a%d" % n, routing=ANYCAST))
    link.roundtrip()
    rates = QueueRates()
    for now in (1.0, 2.0, 3.0, 4.0):  # counted once, then quiet
        rates.sample(broker, now)
    link.client.publish(new_message("orders", b"b", routing=ANYCAST))
    link.client.create_queue({"name": "fresh", "address": "fresh"})
    link.roundtrip()
    link.client.publish(new_message("fresh", b"c", routing=ANYCAST))
    link.client.publish(new_message("fresh", b"d", routing=ANYCAST))
    link.roundtrip()
    rates.sample(broker, 4.5)
    assert rates.rates("orders") == (2.0, 0.0)
    assert rates.rates("fresh") == (4.0, 0.0)
    link.client.delete_queue("fresh")
    link.client.create_queue({"name": "fresh", "address": "fresh"})
    link.roundtrip()
    rates.sample(broker, 5.0)
    link.client.publish(new_message("fresh", b"e", routing=ANYCAST))
    link.roundtrip()
    rates.sample(broker, 6.0)
    assert rates.rates("fresh") == (1.0, 0.0)


async def test_a_queue_made_through_the_api_is_a_last_value_queue_only_when_asked(api: Api) -> None:
    """``last_value_key`` absent makes a plain queue; "" one keyed on each message's own last-value key field."""
    client, broker, _, _ = api
    for body in (
        {"name": "plain", "address": "prices", "routing_type": "multicast"},
        {"name": "latest", "address": "prices", "routing_type": "multicast", "last_value_key": ""},
        {"name": "by-pair", "address": "prices", "routing_type": "multicast", "last_value_key": "pair"},
    ):
        response = await client.post("/api/queues", json=body)
        assert response.status == 200, await response.text()
    assert [broker.queues[name].last_value_key for name in ("plain", "latest", "by-pair")] == [None, "", "pair"]


async def test_a_body_nested_too_deep_is_no_json_to_take(api: Api) -> None:
    client, _, _, _ = api
    nested = '{"queue": ' + "[" * 30_000 + "]" * 30_000 + "}"  # within the size limit
    response = await client.post("/api/purge", data=nested, headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert await response.json() == {"error": "the body is not JSON"}


def test_a_node_is_named_by_a_unique_prefix_of_its_id_or_its_name_wherever_it_is_asked() -> None:
    """``?node=`` must not pick the node asked when the value names another node as well: with the default
    name ``core`` on every node, ``--node core`` acted on whichever node the operator happened to ask."""
    from aiohttp.test_utils import make_mocked_request  # noqa: PLC0415

    from tridentmq_core.management.operations_api import (  # noqa: PLC0415
        NodeControl,
        OperationsApi,
        RequestRefusedError,
    )

    broker = make_broker()  # node id NODE_ID (0f1e2d3c-...), name "core"
    others = [{"node_id": "0f1e9999-other", "name": "core"}, {"node_id": "7a7a7a7a-edge", "name": "edge"}]
    members = [{"node_id": broker.node_id, "name": "core"}, *others]
    api = OperationsApi(broker, lambda: lambda: {"members": members}, NodeControl())

    def target(node: str) -> tuple[bool, list[str]]:
        here, forward = api._target(make_mocked_request("GET", f"/api/queues?node={node}"))
        return here, [m["node_id"] for m in forward]

    assert target(NODE_ID) == (True, [])
    assert target("0f1e2") == (True, [])
    assert target("0f1e9") == (False, ["0f1e9999-other"])
    assert target("edge") == (False, ["7a7a7a7a-edge"])
    assert target("7a") == (False, ["7a7a7a7a-edge"])
    for ambiguous in ("core", "0f1e"):
        with pytest.raises(RequestRefusedError, match="names several nodes"):
            target(ambiguous)
    with pytest.raises(RequestRefusedError, match="no live node"):
        target("nope")


async def test_address_settings_of_another_node_are_that_nodes(api: Api) -> None:
    """A one-node view asked for another node (``--node``) is not this node's answer: it is that node's, or a
    refusal when no live node is named so."""
    client, _, _, _ = api
    response = await client.get("/api/address-settings?node=no-such-node")
    assert response.status == 404
    assert "no live node" in (await response.json())["error"]
    response = await client.get(f"/api/address-settings?node={NODE_ID}")
    assert response.status == 200
