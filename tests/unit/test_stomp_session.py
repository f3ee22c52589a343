"""The STOMP session's rules, frame by frame: a real core node in this process, the session's client side as
bytes (``gateway_harness``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.unit.gateway_harness import (
    WAIT_S,
    Core,
    MemoryWire,
    core_settings,
    end_sessions,
    eventually,
    running_core,
    settle,
    unused_port,
)

from tridentmq_core.settings import PermissionEntry, UserEntry
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.message import RoutingType
from tridentmq_stomp.protocol.frames import V12, Frame, FrameParser, encode
from tridentmq_stomp.session import Counters, StompSession
from tridentmq_stomp.settings import CoreLinkSection, StompLimitsSection, StompSettings


class Client:
    """A STOMP client's side of one session: frames written as bytes, the session's frames parsed."""

    def __init__(self, core: Core, settings: StompSettings, *, peer: str = "127.0.0.1:40000") -> None:
        self.wire = MemoryWire(peer)
        self.counters = Counters()
        self.session = StompSession(settings, core.links, self.wire, self.counters)
        core.opened(self.session)
        self._parser = FrameParser()
        self._parser.version = V12
        self.frames: list[Frame] = []

    def send_frame(self, command: str, body: bytes = b"", **headers: str) -> None:
        self.session.feed(encode(command, [(k.replace("_", "-"), v) for k, v in headers.items()], body, V12))

    def _read(self) -> None:
        self.frames.extend(self._parser.feed(self.wire.take()))

    async def frame(self, command: str | None = None) -> Frame:
        """The next frame the session sent (of ``command``, which it must be)."""

        def first() -> Frame | None:
            self._read()
            return self.frames.pop(0) if self.frames else None

        got: Frame = await eventually(first, f"a {command or 'frame'}")
        if command is not None:
            assert got.command == command, got
        return got

    async def nothing(self) -> None:
        await settle()
        self._read()
        assert self.frames == []

    async def connect(self, version: str = "1.2", **headers: str) -> Frame:
        self.send_frame("CONNECT", accept_version=version, host="broker", **headers)
        return await self.frame("CONNECTED")

    async def receipt(self, command: str, body: bytes = b"", **headers: str) -> Frame:
        self.send_frame(command, body, receipt=f"r-{command}", **headers)
        answer = await self.frame("RECEIPT")
        assert answer.headers["receipt-id"] == f"r-{command}"
        return answer

    async def receipt_and_messages(self, command: str, count: int, **headers: str) -> list[Frame]:
        """Send with a receipt; wait for its RECEIPT and ``count`` MESSAGE frames in whatever order they come (an
        ACK's RECEIPT waits for the core's answer, the deliveries the ACK made room for do not): the MESSAGEs."""
        self.send_frame(command, receipt=f"r-{command}", **headers)
        frames = [await self.frame() for _ in range(count + 1)]
        assert [f.headers["receipt-id"] for f in frames if f.command == "RECEIPT"] == [f"r-{command}"], frames
        return [f for f in frames if f.command == "MESSAGE"]

    async def error(self) -> Frame:
        got = await self.frame("ERROR")
        await eventually(lambda: self.wire.closed, "the connection closed after the ERROR")
        return got


def stomp_settings(port: int, **limits: int) -> StompSettings:
    return StompSettings(core=CoreLinkSection(port=port), stomp=StompLimitsSection(**limits))


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        yield core


def client(core: Core, **limits: int) -> Client:
    return Client(core, stomp_settings(core.port, **limits))


async def connected(core: Core, **limits: int) -> Client:
    c = client(core, **limits)
    await c.connect()
    return c


async def test_connect_answers_connected_and_lets_the_client_in(core: Core) -> None:
    c = client(core)
    answer = await c.connect("1.1,1.2", login="any", passcode="any", heart_beat="0,0")
    assert answer.headers["version"] == "1.2"
    assert answer.headers["server"].startswith("TridentMQ/")
    assert answer.headers["session"] == c.session.id
    assert c.wire.logged_in_called
    assert c.counters.connections_total == 1


async def test_frames_before_connect_end_the_connection(core: Core) -> None:
    c = client(core)
    c.send_frame("SEND", b"x", destination="/queue/a")
    error = await c.error()
    assert c.counters.errors == 1
    assert error.headers["message"]


async def test_a_send_is_received_by_a_queue_subscriber_with_its_headers(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s1", destination="/queue/orders")
    await producer.receipt("SEND", b"hello", destination="/queue/orders", color="red", content_type="text/plain")
    message = await consumer.frame("MESSAGE")
    assert message.body == b"hello"
    assert message.headers["destination"] == "/queue/orders"
    assert message.headers["subscription"] == "s1"
    assert message.headers["color"] == "red"
    assert message.headers["content-type"] == "text/plain"
    assert producer.counters.messages_published == 1
    assert consumer.counters.messages_delivered == 1


async def test_a_topic_reaches_every_subscriber_and_a_selector_filters(core: Core) -> None:
    a, b, producer = await connected(core), await connected(core), await connected(core)
    await a.receipt("SUBSCRIBE", id="1", destination="/topic/news")
    await b.receipt("SUBSCRIBE", id="1", destination="/topic/news", selector="kind = 'sport'")
    await producer.receipt("SEND", b"weather", destination="/topic/news", kind="weather")
    await producer.receipt("SEND", b"match", destination="/topic/news", kind="sport")
    assert [(await a.frame("MESSAGE")).body for _ in range(2)] == [b"weather", b"match"]
    assert (await b.frame("MESSAGE")).body == b"match"
    await b.nothing()


async def test_a_selector_sees_correlation_id_and_type_as_jms_header_fields(core: Core) -> None:
    """As ActiveMQ and Artemis map them: a selector cannot name ``correlation-id`` (not an identifier), so a
    reply consumer on a shared queue selects ``JMSCorrelationID``; it used to match nothing and wait for ever."""
    producer, consumer = await connected(core), await connected(core)
    selector = "JMSCorrelationID = 'c-2' AND JMSType = 'reply'"
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/replies", selector=selector)
    await producer.receipt("SEND", b"1", destination="/queue/replies", correlation_id="c-1", type="reply")
    await producer.receipt("SEND", b"2", destination="/queue/replies", correlation_id="c-2", type="reply")
    await producer.receipt("SEND", b"3", destination="/queue/replies", correlation_id="c-2", type="other")
    mine = await consumer.frame("MESSAGE")
    assert (mine.body, mine.headers["correlation-id"], mine.headers["type"]) == (b"2", "c-2", "reply")
    await consumer.nothing()


async def test_client_ack_is_cumulative_and_the_prefetch_bounds_what_is_out(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    for n in range(5):
        await producer.receipt("SEND", str(n).encode(), destination="/queue/work")
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/work", ack="client", consumer_window_size="2")
    first, second = await consumer.frame("MESSAGE"), await consumer.frame("MESSAGE")
    assert (first.body, second.body) == (b"0", b"1")
    await consumer.nothing()  # two out, unacknowledged: the window is full
    third, fourth = await consumer.receipt_and_messages("ACK", 2, id=second.headers["ack"])  # acknowledges both
    assert (third.body, fourth.body) == (b"2", b"3")
    await consumer.nothing()  # the window is full again: "4" waits
    [fifth] = await consumer.receipt_and_messages("ACK", 1, id=third.headers["ack"])  # one place free
    assert fifth.body == b"4"


async def test_client_individual_nack_redelivers_only_that_message(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/jobs", ack="client-individual")
    for body in (b"a", b"b"):
        await producer.receipt("SEND", body, destination="/queue/jobs")
    a, b = await consumer.frame("MESSAGE"), await consumer.frame("MESSAGE")
    await consumer.receipt("ACK", id=b.headers["ack"])
    [again] = await consumer.receipt_and_messages("NACK", 1, id=a.headers["ack"])
    assert again.body == b"a"
    assert again.headers["redelivered"] == "true"
    await consumer.receipt("ACK", id=again.headers["ack"])
    await consumer.nothing()


async def _held_ack(core: Core) -> Client:
    """A client that ACKed a persistent message with a receipt while the core holds its answers to what it
    wrote (the journal's confirm gate closed, as a node's whose disk is slow), then sent a SUBSCRIBE with a
    receipt: the gateway has answered neither."""
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/acked", ack="client-individual")
    await producer.receipt("SEND", b"m", destination="/queue/acked", persistent="true")
    message = await consumer.frame("MESSAGE")
    core.node.journal_store.gate = lambda: False
    consumer.send_frame("ACK", id=message.headers["ack"], receipt="r-ack")
    consumer.send_frame("SUBSCRIBE", id="t", destination="/queue/after", receipt="r-after")
    await asyncio.sleep(0.2)
    await consumer.nothing()  # the SUBSCRIBE's waits in line behind the ACK's
    return consumer


async def test_an_ack_receipt_comes_once_the_core_has_the_ack_on_disk_in_frame_order(core: Core) -> None:
    consumer = await _held_ack(core)
    store = core.node.journal_store
    store.gate = lambda: True
    store.recheck()
    assert [(await consumer.frame("RECEIPT")).headers["receipt-id"] for _ in range(2)] == ["r-ack", "r-after"]
    async with core.admin() as admin:  # the ack is applied: nothing comes back to another consumer
        probe = await admin.subscribe("acked", credit=1)
        assert await probe.get(timeout=0.3) is None


async def test_an_ack_whose_answer_the_link_loses_gets_an_error_not_its_receipt(core: Core) -> None:
    consumer = await _held_ack(core)
    await core.stop_node()
    error = await consumer.error()
    assert (error.headers["message"], error.headers["receipt-id"]) == ("server unavailable", "r-ack")
    assert b"did not confirm the acknowledgement" in error.body


async def test_an_ack_without_a_receipt_and_one_in_a_transaction_do_not_wait(core: Core) -> None:
    """Only a receipt waits for the core: a plain ACK's is the client's own business (throughput), and one in a
    transaction takes effect at COMMIT, whose receipt waits instead."""
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/plain", ack="client-individual")
    for body in (b"a", b"b"):
        await producer.receipt("SEND", body, destination="/queue/plain", persistent="true")
    a, b = await consumer.frame("MESSAGE"), await consumer.frame("MESSAGE")
    await consumer.receipt("BEGIN", transaction="t")
    store = core.node.journal_store
    store.gate = lambda: False
    consumer.send_frame("ACK", id=a.headers["ack"])
    await consumer.receipt("ACK", id=b.headers["ack"], transaction="t")
    consumer.send_frame("COMMIT", transaction="t", receipt="r-commit")
    await asyncio.sleep(0.2)
    await consumer.nothing()  # the COMMIT's receipt waits for the commit on disk
    store.gate = lambda: True
    store.recheck()
    assert (await consumer.frame("RECEIPT")).headers["receipt-id"] == "r-commit"


async def test_an_ack_of_an_unknown_id_is_an_error(core: Core) -> None:
    c = await connected(core)
    c.send_frame("ACK", id="nope", receipt="r")
    error = await c.error()
    assert error.headers["message"] == "unknown ack id"
    assert error.headers["receipt-id"] == "r"


async def test_unacknowledged_messages_go_back_to_the_queue_when_the_connection_ends(core: Core) -> None:
    producer, first = await connected(core), await connected(core)
    await first.receipt("SUBSCRIBE", id="s", destination="/queue/q", ack="client")
    await producer.receipt("SEND", b"kept", destination="/queue/q")
    assert (await first.frame("MESSAGE")).body == b"kept"
    first.session.connection_lost()
    await first.session.wait_closed()
    assert first.wire.closed
    second = await connected(core)
    await second.receipt("SUBSCRIBE", id="s", destination="/queue/q")
    again = await second.frame("MESSAGE")
    assert again.body == b"kept"
    assert again.headers["redelivered"] == "true"


async def test_a_transaction_delivers_its_sends_and_acks_at_commit_only(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/tx", ack="client-individual")
    await producer.receipt("BEGIN", transaction="t1")
    await producer.receipt("SEND", b"one", destination="/queue/tx", transaction="t1")
    await producer.receipt("SEND", b"outside", destination="/queue/tx")  # comes first: "one" waits for COMMIT
    outside = await consumer.frame("MESSAGE")
    assert outside.body == b"outside"
    await consumer.receipt("ACK", id=outside.headers["ack"])
    await producer.receipt("COMMIT", transaction="t1")
    one = await consumer.frame("MESSAGE")
    assert one.body == b"one"
    await consumer.receipt("BEGIN", transaction="t2")
    await consumer.receipt("ACK", id=one.headers["ack"], transaction="t2")
    # A transaction that aborts gives back what it acknowledged: the message comes again.
    consumer.send_frame("ABORT", transaction="t2")
    again = await consumer.frame("MESSAGE")
    assert (again.body, again.headers["redelivered"]) == (b"one", "true")
    await producer.receipt("BEGIN", transaction="t3")
    await producer.receipt("SEND", b"never", destination="/queue/tx", transaction="t3")
    await producer.receipt("ABORT", transaction="t3")
    await producer.receipt("SEND", b"after", destination="/queue/tx")
    assert (await consumer.frame("MESSAGE")).body == b"after"  # and not "never", which would have come first


@pytest.mark.parametrize(("end", "redelivered"), [("COMMIT", False), ("ABORT", True)])
async def test_an_ack_in_a_transaction_outlives_its_subscription(core: Core, end: str, redelivered: bool) -> None:
    """ACK in a transaction, UNSUBSCRIBE, then COMMIT: the message is consumed (the unsubscribe used to give it
    back to the queue, and the commit then acknowledged nothing: a duplicate); ABORT gives it back."""
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("BEGIN", transaction="t")
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/tx-unsub", ack="client-individual")
    await producer.receipt("SEND", b"once", destination="/queue/tx-unsub", persistent="true")
    message = await consumer.frame("MESSAGE")
    await consumer.receipt("ACK", id=message.headers["ack"], transaction="t")
    await consumer.receipt("UNSUBSCRIBE", id="s")
    await consumer.nothing()
    await consumer.receipt(end, transaction="t")
    other = await connected(core)
    await other.receipt("SUBSCRIBE", id="s", destination="/queue/tx-unsub")
    if redelivered:
        again = await other.frame("MESSAGE")
        assert (again.body, again.headers["redelivered"]) == (b"once", "true")
    await other.nothing()
    assert len(core.node.broker.queues["tx-unsub"]) == 0


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([("COMMIT", {"transaction": "nope"})], "no such transaction"),
        ([("BEGIN", {"transaction": "t"}), ("BEGIN", {"transaction": "t"})], "transaction exists"),
        ([("SEND", {"destination": "/queue/x", "transaction": "nope"})], "no such transaction"),
        ([("SUBSCRIBE", {"id": "1", "destination": "/queue/x"})] * 2, "duplicate subscription"),
        ([("UNSUBSCRIBE", {"id": "9"})], "no such subscription"),
        ([("SUBSCRIBE", {"id": "1", "destination": "/topic/x", "durable-subscription-name": "d"})], "missing header"),
    ],
)
async def test_frames_that_name_nothing_valid_get_an_error_with_their_receipt(
    core: Core, frames: list[tuple[str, dict[str, str]]], message: str
) -> None:
    c = await connected(core)
    *before, (command, headers) = frames
    for earlier_command, earlier_headers in before:
        c.send_frame(earlier_command, **{k.replace("-", "_"): v for k, v in earlier_headers.items()})
    c.send_frame(command, receipt="last", **{k.replace("-", "_"): v for k, v in headers.items()})
    frames_seen = []
    while True:
        frame = await c.frame()
        frames_seen.append(frame)
        if frame.command == "ERROR":
            break
    assert frame.headers["message"] == message, frames_seen
    assert frame.headers["receipt-id"] == "last"
    await eventually(lambda: c.wire.closed, "the connection closed")


async def test_unsubscribe_stops_deliveries_and_ends_a_temporary_subscription(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/topic/t")
    [mine] = [name for name in core.node.broker.queues if name.startswith(f"stomp.{consumer.session.id}.")]
    await consumer.receipt("UNSUBSCRIBE", id="s")
    await consumer.receipt("SUBSCRIBE", id="s2", destination="/topic/t")
    await producer.receipt("SEND", b"x", destination="/topic/t")
    assert (await consumer.frame("MESSAGE")).headers["subscription"] == "s2"  # once: "s" is gone
    await consumer.nothing()
    assert mine not in core.node.broker.queues


async def test_stomp_10_unsubscribes_by_destination(core: Core) -> None:
    producer, consumer = await connected(core), client(core)
    await consumer.connect("1.0")
    await consumer.receipt("SUBSCRIBE", destination="/queue/old")
    await consumer.receipt("UNSUBSCRIBE", destination="/queue/old")
    await producer.receipt("SEND", b"x", destination="/queue/old")
    await consumer.receipt("SUBSCRIBE", destination="/queue/other")
    await producer.receipt("SEND", b"y", destination="/queue/other")
    assert (await consumer.frame("MESSAGE")).body == b"y"  # not "x": that subscription ended
    assert len(core.node.broker.queues["old"]) == 1


async def test_a_durable_subscription_keeps_messages_while_away_and_ends_with_its_name(core: Core) -> None:
    producer = await connected(core)
    sub = client(core)
    await sub.connect(client_id="app")
    await sub.receipt("SUBSCRIBE", id="d", destination="/topic/prices", durable_subscription_name="p")
    sub.session.connection_lost()
    await sub.session.wait_closed()
    await producer.receipt("SEND", b"while away", destination="/topic/prices")
    back = client(core)
    await back.connect(client_id="app")
    await back.receipt("SUBSCRIBE", id="d", destination="/topic/prices", durable_subscription_name="p")
    assert (await back.frame("MESSAGE")).body == b"while away"
    # Unsubscribing with the name ends it for good: what is sent meanwhile is not kept for it.
    await back.receipt("UNSUBSCRIBE", id="d", durable_subscription_name="p")
    await producer.receipt("SEND", b"after the end", destination="/topic/prices")
    await back.receipt("SUBSCRIBE", id="d2", destination="/topic/prices", durable_subscription_name="p")
    await producer.receipt("SEND", b"new", destination="/topic/prices")
    assert (await back.frame("MESSAGE")).body == b"new"  # not "after the end"


async def test_a_plain_queue_named_as_a_durable_subscription_is_never_deleted_for_one(core: Core) -> None:
    """A durable subscription's queue is ``<client-id>.<name>``, which a plain queue may be named too: an
    UNSUBSCRIBE by that name, or a durable SUBSCRIBE under it to a topic, deleted the queue and its messages."""
    producer = await connected(core)
    for n in range(3):
        await producer.receipt("SEND", b"%d" % n, destination="/queue/orders.eu", persistent="true")
    app = client(core)
    await app.connect(client_id="orders")
    app.send_frame("UNSUBSCRIBE", id="any", durable_subscription_name="eu", receipt="u")
    assert (await app.error()).headers["message"] == "no such subscription"
    again = client(core)
    await again.connect(client_id="orders")
    again.send_frame("SUBSCRIBE", id="d", destination="/topic/news", durable_subscription_name="eu", receipt="s")
    refused = await again.error()
    assert "not a durable subscription's" in refused.body.decode()
    queue = core.node.broker.queues["orders.eu"]
    assert (queue.routing_type, len(queue)) == (RoutingType.ANYCAST, 3)


@pytest.mark.parametrize("header", ["durable_subscription_name", "activemq.subscriptionName"])
@pytest.mark.parametrize("selector", [None, "x = 1"])
async def test_a_durable_subscription_has_one_subscriber_on_its_connection(
    core: Core, header: str, selector: str | None
) -> None:
    """As with ActiveMQ: a second SUBSCRIBE to a durable subscription the connection consumes is refused, whatever
    it asks (another selector would otherwise delete the subscription and its messages), and the first keeps all."""
    producer = await connected(core)
    sub = client(core)
    await sub.connect(client_id="dup")
    named = {header: "n"}
    await sub.receipt("SUBSCRIBE", id="s1", destination="/topic/dup", **named)
    await producer.receipt("SEND", b"kept", destination="/topic/dup")
    again = {"selector": selector} if selector else {}
    sub.send_frame("SUBSCRIBE", id="s2", destination="/topic/dup", receipt="r2", **named, **again)
    frames = [await sub.frame(), await sub.frame()]
    error = next(f for f in frames if f.command == "ERROR")
    assert error.headers["message"] == "duplicate subscription"
    assert error.headers["receipt-id"] == "r2"
    assert b"Durable consumer is in use for client: dup and subscriptionName: n" in error.body
    assert [f.body for f in frames if f.command == "MESSAGE"] == [b"kept"]
    await eventually(lambda: sub.wire.closed, "the connection closed after the ERROR")
    await producer.receipt("SEND", b"later", destination="/topic/dup")
    back = client(core)
    await back.connect(client_id="dup")
    await back.receipt("SUBSCRIBE", id="s1", destination="/topic/dup", **named)
    assert (await back.frame("MESSAGE")).body == b"later"  # the subscription kept collecting ("kept" was consumed)


async def test_durable_subscriptions_of_one_name_under_two_client_ids_each_get_every_message(core: Core) -> None:
    producer, first, second = await connected(core), client(core), client(core)
    await first.connect(client_id="one")
    await second.connect(client_id="two")
    for c in (first, second):
        await c.receipt("SUBSCRIBE", id="s", destination="/topic/both", durable_subscription_name="n")
    await producer.receipt("SEND", b"m", destination="/topic/both")
    assert (await first.frame("MESSAGE")).body == (await second.frame("MESSAGE")).body == b"m"


async def test_a_durable_subscription_is_ended_by_name_without_subscribing_first(core: Core) -> None:
    """As with ActiveMQ: a connection with the client-id ends a durable subscription it is not consuming (made by
    an earlier connection) with an UNSUBSCRIBE naming it. It used to get ERROR no such subscription, and the
    subscription's queue went on collecting every message of the topic, with no way to end it over STOMP."""
    producer = await connected(core)
    sub = client(core)
    await sub.connect(client_id="app")
    await sub.receipt("SUBSCRIBE", id="d", destination="/topic/news", durable_subscription_name="n")
    await sub.receipt("DISCONNECT")
    await sub.session.wait_closed()
    await producer.receipt("SEND", b"kept", destination="/topic/news")
    assert len(core.node.broker.queues["app.n"]) == 1
    back = client(core)
    await back.connect(client_id="app")
    await back.receipt("UNSUBSCRIBE", id="d", durable_subscription_name="n")
    assert "app.n" not in core.node.broker.queues
    await producer.receipt("SEND", b"gone", destination="/topic/news")
    assert "app.n" not in core.node.broker.queues
    # One it consumes under another id ends the same way, with that consumer.
    await back.receipt("SUBSCRIBE", id="m", destination="/topic/news", durable_subscription_name="m")
    await back.receipt("UNSUBSCRIBE", id="other", durable_subscription_name="m")
    assert "app.m" not in core.node.broker.queues
    assert back.session.subscriptions == {}
    await back.nothing()
    # A name that names no subscription is still an error; so is a plain UNSUBSCRIBE of nothing.
    back.send_frame("UNSUBSCRIBE", id="x", durable_subscription_name="never", receipt="r")
    assert (await back.error()).headers["message"] == "no such subscription"


async def test_a_durable_subscription_with_a_new_selector_is_a_new_subscription(core: Core) -> None:
    producer = await connected(core)
    sub = client(core)
    await sub.connect(client_id="app")
    await sub.receipt("SUBSCRIBE", id="d", destination="/topic/t", durable_subscription_name="n")
    await sub.receipt("UNSUBSCRIBE", id="d")  # without the name: only this consumer ends
    await producer.receipt("SEND", b"old", destination="/topic/t", kind="b")  # kept for the old subscription
    assert len(core.node.broker.queues["app.n"]) == 1
    await sub.receipt("SUBSCRIBE", id="d", destination="/topic/t", durable_subscription_name="n", selector="kind='b'")
    await producer.receipt("SEND", b"new", destination="/topic/t", kind="b")
    assert (await sub.frame("MESSAGE")).body == b"new"  # the old subscription's message went with it


async def test_temporary_queues_answer_replies_and_keep_their_stomp_name(core: Core) -> None:
    requester, responder = await connected(core), await connected(core)
    await responder.receipt("SUBSCRIBE", id="s", destination="/queue/service")
    await requester.receipt("SUBSCRIBE", id="r", destination="/temp-queue/replies")
    await requester.receipt("SEND", b"ping", destination="/queue/service", reply_to="/temp-queue/replies")
    request = await responder.frame("MESSAGE")
    reply_to = request.headers["reply-to"]
    assert reply_to.startswith("/queue/tmp.")  # a name every client can send to
    await responder.receipt("SEND", b"pong", destination=reply_to)
    reply = await requester.frame("MESSAGE")
    assert reply.body == b"pong"
    assert reply.headers["destination"] == "/temp-queue/replies"
    # Sending to one's own temporary queue also makes it.
    await requester.receipt("SEND", b"self", destination="/temp-queue/other")
    assert len(core.node.broker.queues[f"tmp.{requester.session.id}.other"]) == 1


async def test_a_refused_send_is_an_error_in_the_order_of_the_frames(tmp_path: Path) -> None:
    settings = core_settings(
        tmp_path,
        users=[UserEntry("alice", "secret", ["app"])],
        permissions=[
            PermissionEntry("allowed.#", permission, ["app"])
            for permission in ("send", "createAddress", "createDurableQueue")
        ],
    )
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = client(core)
        await c.connect(login="alice", passcode="secret")
        c.send_frame("SEND", b"ok", destination="/queue/allowed.one", receipt="1")
        c.send_frame("SEND", b"no", destination="/queue/secret", receipt="2")
        assert (await c.frame("RECEIPT")).headers["receipt-id"] == "1"
        error = await c.error()
        assert error.headers["message"] == "permission denied"
        assert error.headers["receipt-id"] == "2"


@pytest.mark.parametrize(
    "failing",
    [
        ("ACK", {"id": "1-999"}),  # an unknown ack id
        ("SEND", {"destination": "/queue/p", "priority": "12"}),  # a header the gateway cannot map
        ("UNSUBSCRIBE", {"id": "nope"}),  # no such subscription
    ],
)
async def test_an_error_follows_the_receipts_of_the_sends_before_it(
    core: Core, failing: tuple[str, dict[str, str]]
) -> None:
    """The SEND before the failing frame was stored: its RECEIPT must reach the client before the ERROR, or a
    client that sends again what had no receipt stores it twice."""
    c = await connected(core)
    c.send_frame("SEND", b"x", destination="/queue/p", receipt="s1", persistent="true")
    command, headers = failing
    c.send_frame(command, receipt="bad", **headers)
    assert (await c.frame("RECEIPT")).headers["receipt-id"] == "s1"
    assert (await c.error()).headers["receipt-id"] == "bad"
    assert len(core.node.broker.queues["p"]) == 1


async def test_a_commit_after_a_refused_send_is_not_committed(tmp_path: Path) -> None:
    """The client gets the SEND's ERROR and nothing for its COMMIT: the transaction must not have been
    committed meanwhile, or the client that runs it again has it twice."""
    settings = core_settings(
        tmp_path,
        users=[UserEntry("alice", "secret", ["app"])],
        permissions=[
            PermissionEntry("allowed.#", permission, ["app"])
            for permission in ("send", "createAddress", "createDurableQueue", "consume")
        ],
    )
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = client(core)
        await c.connect(login="alice", passcode="secret")
        await c.receipt("BEGIN", transaction="t")
        await c.receipt("SEND", b"in-tx", destination="/queue/allowed.tx", transaction="t", persistent="true")
        c.send_frame("SEND", b"no", destination="/queue/secret", receipt="refused")
        c.send_frame("COMMIT", transaction="t", receipt="commit")
        error = await c.error()
        assert (error.headers["message"], error.headers["receipt-id"]) == ("permission denied", "refused")
        await settle()
        queue = core.node.broker.queues.get("allowed.tx")  # made by the commit, when it runs
        assert queue is None or len(queue) == 0


async def test_subscriptions_per_connection_are_capped(core: Core) -> None:
    """Each subscription may hold a window of messages for a client that stops reading: their number is what
    bounds the connection's memory."""
    c = await connected(core, max_subscriptions=2)
    for n in range(2):
        await c.receipt("SUBSCRIBE", id=f"s{n}", destination=f"/topic/t{n}")
    c.send_frame("SUBSCRIBE", id="s2", destination="/topic/t2", receipt="third")
    error = await c.error()
    assert (error.headers["message"], error.headers["receipt-id"]) == ("resource limit", "third")


async def test_a_bad_login_is_refused(tmp_path: Path) -> None:
    settings = core_settings(tmp_path, users=[UserEntry("alice", "secret", ["app"])])
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = client(core)
        c.send_frame("CONNECT", accept_version="1.2", host="b", login="alice", passcode="wrong")
        error = await c.error()
        assert error.headers["message"] == "authentication failed"
        assert not c.wire.logged_in_called


async def test_a_gateway_without_a_core_refuses_clients_as_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    """Each is refused in its protocol; the log says so once a minute (every device retrying said it)."""
    port = unused_port()
    links = CoreLinks(CoreLinkSection(port=port, shared_links=0), name="gateway-test")
    wires = [MemoryWire() for _ in range(3)]
    sessions = [StompSession(stomp_settings(port), links, wire, Counters()) for wire in wires]
    try:
        for session in sessions:
            session.feed(encode("CONNECT", [("accept-version", "1.2"), ("host", "b")], b"", V12))
            await asyncio.wait_for(session.wait_closed(), WAIT_S)
    finally:
        await end_sessions(sessions)
        await links.stop()
    for wire in wires:
        error = FrameParser().feed(wire.take())[0]
        assert (error.command, error.headers["message"]) == ("ERROR", "server unavailable")
    assert [r.getMessage() for r in caplog.records].count("core unavailable") == 1


async def test_disconnect_answers_after_every_send_is_confirmed(core: Core) -> None:
    c = await connected(core)
    for n in range(50):
        c.send_frame("SEND", str(n).encode(), destination="/queue/d")
    c.send_frame("DISCONNECT", receipt="bye")
    assert (await c.frame("RECEIPT")).headers["receipt-id"] == "bye"
    await eventually(lambda: c.wire.closed, "the connection closed")
    reader = await connected(core)
    await reader.receipt("SUBSCRIBE", id="s", destination="/queue/d")
    assert [int((await reader.frame("MESSAGE")).body) for _ in range(50)] == list(range(50))


async def test_a_client_that_closes_its_sending_side_gets_the_receipts_of_its_frames(core: Core) -> None:
    c = await connected(core)
    for n in range(20):
        c.send_frame("SEND", str(n).encode(), destination="/queue/eof", persistent="true", receipt=f"r{n}")
    c.session.feed(b"")  # the client's EOF, no DISCONNECT: the socket's write side is still open
    assert [(await c.frame("RECEIPT")).headers["receipt-id"] for _ in range(20)] == [f"r{n}" for n in range(20)]
    await eventually(lambda: c.wire.closed, "the connection closed")
    reader = await connected(core)
    await reader.receipt("SUBSCRIBE", id="s", destination="/queue/eof")
    assert [int((await reader.frame("MESSAGE")).body) for _ in range(20)] == list(range(20))


async def test_a_protocol_violation_is_answered_after_the_frames_before_it(core: Core) -> None:
    c = await connected(core)
    c.send_frame("SEND", b"x", destination="/queue/v", receipt="ok")
    c.session.feed(b"BOGUS\n\n\x00")
    assert (await c.frame("RECEIPT")).headers["receipt-id"] == "ok"
    await c.error()


async def test_a_client_that_stops_reading_gets_its_messages_once_it_reads_again(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/slow")
    consumer.wire.stall()
    for n in range(3):
        await producer.receipt("SEND", str(n).encode(), destination="/queue/slow")
    await consumer.nothing()
    consumer.wire.drain()
    assert [(await consumer.frame("MESSAGE")).body for _ in range(3)] == [b"0", b"1", b"2"]


async def test_a_client_that_sends_while_it_does_not_read_is_still_served(core: Core) -> None:
    """A one-thread client sends a burst before it reads, while its subscription fills its socket: the gateway
    goes on handling its frames (it would otherwise wait for the client to read, and the client for the gateway
    to read its burst: a deadlock); its deliveries wait for the socket."""
    c, producer, reader = await connected(core), await connected(core), await connected(core)
    await c.receipt("SUBSCRIBE", id="s", destination="/queue/mine")
    await reader.receipt("SUBSCRIBE", id="s", destination="/queue/burst")
    c.wire.stall()
    for n in range(3):
        await producer.receipt("SEND", b"for c %d" % n, destination="/queue/mine")
    for n in range(5):
        c.send_frame("SEND", b"%d" % n, destination="/queue/burst", receipt=f"r{n}")
    assert [(await reader.frame("MESSAGE")).body for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]
    c.wire.drain()
    frames = [await c.frame() for _ in range(8)]
    assert [f.headers["receipt-id"] for f in frames if f.command == "RECEIPT"] == [f"r{n}" for n in range(5)]
    assert [f.body for f in frames if f.command == "MESSAGE"] == [b"for c 0", b"for c 1", b"for c 2"]


async def test_the_answers_waiting_for_a_client_that_does_not_read_are_bounded(core: Core) -> None:
    c, reader = await connected(core, pending_bytes=1000), await connected(core)
    await reader.receipt("SUBSCRIBE", id="s", destination="/queue/bounded")
    c.wire.stall()
    for n in range(20):  # each RECEIPT is over 100 bytes: after about ten, the gateway waits for the client
        c.send_frame("SEND", b"%d" % n, destination="/queue/bounded", receipt=f"{n:03d}" + "r" * 100)
        await settle()
    await settle()
    handled = bytes(reader.wire.out).count(b"MESSAGE\n")
    assert 5 <= handled < 20
    assert len(c.wire.out) < 2000
    c.wire.drain()
    receipts = [(await c.frame("RECEIPT")).headers["receipt-id"][:3] for _ in range(20)]
    assert receipts == [f"{n:03d}" for n in range(20)]
    assert [int((await reader.frame("MESSAGE")).body) for _ in range(20)] == list(range(20))


async def test_messages_never_written_to_a_client_that_left_come_back_unflagged(core: Core) -> None:
    """Closing the link returns what its consumer holds as failed deliveries: a client that reconnects often to
    a backlog, reading a little each time, had the rest dead-lettered without its ever being delivered."""
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="s", destination="/queue/left", ack="client")
    await producer.receipt("SEND", b"written", destination="/queue/left")
    assert (await consumer.frame("MESSAGE")).body == b"written"  # not acknowledged
    consumer.wire.stall()
    for n in range(2):
        await producer.receipt("SEND", b"waiting %d" % n, destination="/queue/left")
    await consumer.nothing()
    consumer.wire.drain()  # as the socket's end does: what waits for the client to read wakes up
    consumer.session.connection_lost()
    await consumer.session.wait_closed()
    again = await connected(core)
    await again.receipt("SUBSCRIBE", id="s", destination="/queue/left", ack="auto")
    got = [await again.frame("MESSAGE") for _ in range(3)]
    assert [(m.body, m.headers.get("redelivered")) for m in got] == [
        (b"written", "true"),
        (b"waiting 0", None),
        (b"waiting 1", None),
    ]


async def test_a_silent_client_is_disconnected_after_two_heartbeat_intervals(core: Core) -> None:
    c = client(core, heartbeat_receive_ms=100, min_heartbeat_ms=50)
    answer = await c.connect(heart_beat="100,0")  # the client promises a heart-beat every 100 ms
    assert answer.headers["heart-beat"].endswith(",100")
    assert (await c.error()).headers["message"] == "heart-beat missed"


async def test_a_client_that_never_connects_is_closed(core: Core) -> None:
    c = client(core, connect_timeout_ms=50)
    error = await c.error()
    assert error.headers["message"] == "connect timeout"


async def test_frames_while_a_send_waits_for_credit_keep_their_order(tmp_path: Path) -> None:
    """The core grants two publishes at a time: most SENDs wait for credit, and the receipts, a SUBSCRIBE's
    among them, still come in the order of the frames."""
    async with running_core(core_settings(tmp_path, publish_window=2), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core)
        for n in range(300):
            c.send_frame("SEND", b"x" * 1000, destination=f"/queue/many{n % 3}", receipt=str(n))
            if n == 150:
                c.send_frame("SUBSCRIBE", id="s", destination="/queue/elsewhere", receipt="subscribed")
        receipts = [(await c.frame("RECEIPT")).headers["receipt-id"] for _ in range(301)]
        assert receipts == [*map(str, range(151)), "subscribed", *map(str, range(151, 300))]
        assert sum(len(core.node.broker.queues[f"many{n}"]) for n in range(3)) == 300


async def test_a_header_the_gateway_cannot_map_is_an_error(core: Core) -> None:
    c = await connected(core)
    c.send_frame("SUBSCRIBE", id="1", destination="bare", destination_type="BROADCAST", receipt="r")
    error = await c.error()
    assert (error.headers["message"], error.headers["receipt-id"]) == ("invalid header", "r")
    assert b"BROADCAST" in error.body


async def test_a_subscribe_the_core_refuses_is_an_error(tmp_path: Path) -> None:
    settings = core_settings(
        tmp_path,
        users=[UserEntry("bob", "pw", ["reader"])],
        permissions=[PermissionEntry("mine.#", "consume", ["reader"])],
    )
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = client(core)
        await c.connect(login="bob", passcode="pw")
        c.send_frame("SUBSCRIBE", id="1", destination="/queue/theirs", receipt="r")
        error = await c.error()
        assert (error.headers["message"], error.headers["receipt-id"]) == ("permission denied", "r")


async def test_a_fully_qualified_queue_is_made_on_its_address_and_consumed(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core)
    await consumer.receipt("SUBSCRIBE", id="1", destination="/topic/events::audit")
    await producer.receipt("SEND", b"e1", destination="/topic/events")
    message = await consumer.frame("MESSAGE")
    assert message.body == b"e1"
    assert core.node.broker.queues["audit"].durable


async def test_a_durable_name_reused_on_another_topic_starts_a_new_subscription(core: Core) -> None:
    producer = await connected(core)
    sub = client(core)
    await sub.connect(client_id="app")
    await sub.receipt("SUBSCRIBE", id="d", destination="/topic/one", durable_subscription_name="n")
    await sub.receipt("UNSUBSCRIBE", id="d")
    await producer.receipt("SEND", b"on one", destination="/topic/one")
    await sub.receipt("SUBSCRIBE", id="d", destination="/topic/two", durable_subscription_name="n")
    await producer.receipt("SEND", b"on two", destination="/topic/two")
    assert (await sub.frame("MESSAGE")).body == b"on two"
    await sub.nothing()


@pytest.mark.parametrize(
    ("subscribed", "message", "detail"),
    [
        (False, "server unavailable", b"the link to the broker closed: connection lost"),
        (True, "subscription ended", b"connection lost"),
    ],
)
async def test_a_client_is_told_when_its_core_goes_away(
    tmp_path: Path, subscribed: bool, message: str, detail: bytes
) -> None:
    async with running_core(
        core_settings(tmp_path), lambda port: CoreLinkSection(port=port, reconnect_attempts=0)
    ) as core:
        c = await connected(core)
        if subscribed:  # its consumer learns it first
            await c.receipt("SUBSCRIBE", id="1", destination="/queue/q")
        await core.stop_node()
        error = await c.error()
        assert (error.headers["message"], error.body) == (message, detail)


async def test_a_client_id_is_refused_while_a_connection_holds_it(core: Core) -> None:
    """As ActiveMQ: two connections with one client id would consume its durable subscriptions and split them."""
    first = client(core)
    await first.connect(client_id="holder")
    second = client(core)
    second.send_frame("CONNECT", accept_version="1.2", host="broker", client_id="holder")
    error = await second.error()
    assert error.headers["message"] == "client id in use"
    assert error.body == b"Client: holder already connected"
    await second.session.wait_closed()
    assert len([q for q in core.node.broker.queues if q.startswith("$stomp.lock.holder.")]) == 1
    other = client(core)
    await other.connect(client_id="someone else")
    await first.receipt("SUBSCRIBE", id="d", destination="/topic/held", durable_subscription_name="n")  # unaffected


async def test_a_client_id_is_free_once_its_connection_ends(core: Core) -> None:
    first = client(core)
    await first.connect(client_id="passing")
    await first.receipt("DISCONNECT")  # freed before its RECEIPT: a client may connect again at once
    second = client(core)
    await second.connect(client_id="passing")
    second.session.connection_lost()  # the link's end frees it too
    await second.session.wait_closed()
    third = client(core, heartbeat_receive_ms=100, min_heartbeat_ms=50)
    await third.connect(client_id="passing", heart_beat="100,0")
    assert (await third.error()).headers["message"] == "heart-beat missed"  # a client gone silent frees it too
    await third.session.wait_closed()
    fourth = client(core)
    await fourth.connect(client_id="passing")


async def test_a_connection_without_client_id_asks_the_core_nothing_more(core: Core) -> None:
    c = await connected(core)
    assert not [q for q in core.node.broker.queues if q.startswith("$stomp.")]
    c.send_frame("DISCONNECT")
    held = client(core)
    await held.connect(client_id="x")
    assert [q for q in core.node.broker.queues if q.startswith("$stomp.lock.x.")]


async def test_a_client_id_needs_the_right_to_make_its_lock_queue(tmp_path: Path) -> None:
    settings = core_settings(
        tmp_path,
        users=[UserEntry("alice", "secret", ["app"]), UserEntry("bob", "secret", ["locks"])],
        permissions=[
            PermissionEntry("$stomp.lock.#", permission, ["locks"])
            for permission in ("createAddress", "createNonDurableQueue")
        ],
    )
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        refused = client(core)
        refused.send_frame("CONNECT", accept_version="1.2", host="b", login="alice", passcode="secret", client_id="a")
        error = await refused.error()
        assert error.headers["message"] == "permission denied"
        assert b"createNonDurableQueue on $stomp.lock.#" in error.body
        await client(core).connect(login="alice", passcode="secret")  # without client-id: nothing asked
        await client(core).connect(login="bob", passcode="secret", client_id="b")


async def test_stomp_10_connect_headers_are_trimmed_like_the_others(tmp_path: Path) -> None:
    settings = core_settings(
        tmp_path,
        users=[UserEntry("bob", "secret", ["locks"])],
        permissions=[
            PermissionEntry("$stomp.lock.#", permission, ["locks"])
            for permission in ("createAddress", "createNonDurableQueue")
        ],
    )
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = client(core)
        # A 1.0 client (no accept-version) pads its headers, as with ActiveMQ, which trims them.
        c.session.feed(b"CONNECT\nlogin: bob \npasscode: secret\nclient-id: c-1\nhost: b\n\n\x00")
        answer = await c.frame("CONNECTED")
        assert answer.headers["version"] == "1.0"
        assert c.session.client_id == "c-1"
        # From 1.1 on spaces are part of a header, in CONNECT too: " bob " is no user.
        padded = client(core)
        padded.session.feed(b"CONNECT\naccept-version:1.1\nhost:b\nlogin: bob \npasscode:secret\n\n\x00")
        assert (await padded.error()).headers["message"] == "authentication failed"
