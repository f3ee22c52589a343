"""The MQTT session's rules, packet by packet, in 3.1.1 and 5.0: a real core node in this process, the gateway's
real registry and fan-out feeds, and the client's side as bytes encoded and decoded with the gateway's own codec
(``gateway_harness``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

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
)

from tridentmq_core.settings import AddressSettingsEntry, PermissionEntry, UserEntry
from tridentmq_mqtt import convert
from tridentmq_mqtt.feeds import Feeds
from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.protocol.packets import (
    V5,
    V311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketParser,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_mqtt.session import Counters, MqttSession
from tridentmq_mqtt.settings import CoreLinkSection, MqttLimitsSection, MqttSettings
from tridentmq_mqtt.state import Registry, SessionState
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import M_BODY, RoutingType, new_message

P = TypeVar("P", bound=Packet)

#: The gateway's own core user when the core has users (it needs every right on ``$mqtt.#``).
GATEWAY_USER = UserEntry("gateway", "gw-secret", ["gateway"])
GATEWAY_GRANTS = [
    PermissionEntry("$mqtt.#", permission, ["gateway"])
    for permission in (
        "send",
        "consume",
        "browse",
        "createAddress",
        "createDurableQueue",
        "deleteDurableQueue",
        "createNonDurableQueue",
        "deleteNonDurableQueue",
    )
]


@dataclasses.dataclass
class Gateway:
    """What an MQTT gateway gives each of its sessions (as ``server.MqttGateway`` makes them)."""

    core: Core
    settings: MqttSettings
    registry: Registry
    feeds: Feeds
    counters: Counters

    def client(self, version: int = V5, peer: str = "127.0.0.1:40000") -> Client:
        return Client(self, version, peer)

    async def connected(self, client_id: str = "", version: int = V5, **connect: Any) -> Client:
        c = self.client(version)
        connack = await c.connect(client_id, **connect)
        assert connack.reason_code == 0, connack
        return c

    def queues(self, prefix: str) -> list[str]:
        return sorted(name for name in self.core.node.broker.queues if name.startswith(prefix))


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path,
    *,
    users: list[UserEntry] | None = None,
    permissions: list[PermissionEntry] | None = None,
    address_settings: list[AddressSettingsEntry] | None = None,
    shared_links: int = 1,
    **limits: Any,
) -> AsyncIterator[Gateway]:
    """A core node and an MQTT gateway's shared parts; ``limits`` change ``MqttLimitsSection``'s defaults;
    ``shared_links`` 0: each session on a link of its own."""
    if users is not None:
        users, permissions = [GATEWAY_USER, *users], [*GATEWAY_GRANTS, *(permissions or [])]
    section: list[CoreLinkSection] = []

    def link(port: int) -> CoreLinkSection:
        credentials = (GATEWAY_USER.name, GATEWAY_USER.password) if users else ("", "")
        section.append(
            CoreLinkSection(port=port, user=credentials[0], password=credentials[1], shared_links=shared_links)
        )
        return section[0]

    settings_of_core = core_settings(tmp_path, users=users, permissions=permissions, address_settings=address_settings)
    async with running_core(settings_of_core, link) as core:
        settings = MqttSettings(core=section[0], mqtt=MqttLimitsSection(**limits))
        counters = Counters()
        registry = Registry(core.links, settings.core.user, settings.core.password, settings.node.name)
        mqtt = settings.mqtt

        def delivered(count: int) -> None:
            counters.messages_delivered += count

        feeds = Feeds(
            core.links, settings.core, settings.node.name, mqtt.qos0_window, mqtt.qos0_fan_out_from, delivered
        )
        try:
            yield Gateway(core, settings, registry, feeds, counters)
        finally:
            # The sessions end before their feeds and registry (``running_core`` would end them after).
            sessions, core.sessions = list(core.sessions), []
            try:
                await end_sessions(sessions)
            finally:
                try:
                    await feeds.stop()
                finally:
                    await registry.close()


class Client:
    """An MQTT client's side of one session: packets written as bytes, the session's bytes parsed."""

    def __init__(self, gw: Gateway, version: int, peer: str) -> None:
        self.gw = gw
        self.version = version
        self.wire = MemoryWire(peer)
        self.session = MqttSession(gw.settings, gw.core.links, gw.registry, self.wire, gw.counters, gw.feeds)
        gw.core.opened(self.session)
        self.parser = PacketParser(version)
        self.packets: list[Packet] = []

    def send(self, *packets: Packet) -> None:
        self.session.feed(b"".join(encode(packet, self.version) for packet in packets))

    def _read(self) -> None:
        data = self.wire.take()
        if data:
            self.packets.extend(self.parser.feed(data))

    async def packet(self, kind: type[P]) -> P:
        """The next packet the session sent, which must be a ``kind``."""

        def first() -> Packet | None:
            self._read()
            return self.packets.pop(0) if self.packets else None

        got = await eventually(first, f"a {kind.__name__}")
        assert type(got) is kind, got
        return got

    async def packets_of_any_kind(self, count: int) -> list[Packet]:
        """The next ``count`` packets the session sent, whatever their kinds."""

        def arrived() -> bool:
            self._read()
            return len(self.packets) >= count

        await eventually(arrived, f"{count} packets")
        got, self.packets = self.packets[:count], self.packets[count:]
        return got

    async def nothing(self) -> None:
        """Nothing came so far: only for what the session would have written at once (or before a marker)."""
        await settle()
        self._read()
        assert self.packets == []

    async def handled_in_order(self, packet_id: int = 99) -> None:
        """A marker: the client's events are handled one after another, so the SUBACK of a SUBSCRIBE sent now
        comes after all the session wrote handling the packets before (the retained messages of a SUBSCRIBE,
        say); ``packet`` fails on anything else that comes first."""
        await self.subscribe(Subscription("marker/unused", 0), packet_id=packet_id)

    async def connect(self, client_id: str = "", **fields: Any) -> Connack:
        self.send(Connect(client_id, **fields))
        return await self.packet(Connack)

    async def subscribe(self, *subscriptions: Subscription | str, packet_id: int = 1, sid: int | None = None) -> Suback:
        subs = tuple(Subscription(s, 1) if isinstance(s, str) else s for s in subscriptions)
        props = Properties(subscription_identifiers=(sid,)) if sid is not None else NO_PROPERTIES
        self.send(Subscribe(packet_id, subs, props))
        suback = await self.packet(Suback)
        assert suback.packet_id == packet_id
        return suback

    async def unsubscribe(self, *filters: str, packet_id: int = 2) -> Unsuback:
        self.send(Unsubscribe(packet_id, filters))
        unsuback = await self.packet(Unsuback)
        assert unsuback.packet_id == packet_id
        return unsuback

    async def publish(
        self, topic: str, payload: bytes, qos: int = 1, packet_id: int = 1, **fields: Any
    ) -> Puback | Pubcomp | None:
        """A PUBLISH with its whole flow: PUBACK (QoS 1), PUBREC-PUBREL-PUBCOMP (QoS 2); QoS 0 answers nothing."""
        self.send(Publish(topic, payload, qos, packet_id=packet_id if qos else None, **fields))
        if qos == 1:
            puback = await self.packet(Puback)
            assert puback.packet_id == packet_id
            return puback
        if qos == 2:
            pubrec = await self.packet(Pubrec)
            assert (pubrec.packet_id, pubrec.reason_code) == (packet_id, 0), pubrec
            self.send(Pubrel(packet_id))
            pubcomp = await self.packet(Pubcomp)
            assert (pubcomp.packet_id, pubcomp.reason_code) == (packet_id, 0), pubcomp
            return pubcomp
        return None

    async def message(self, qos: int | None = None) -> Publish:
        """The next PUBLISH, acknowledged as its QoS asks (QoS 2 through to the PUBCOMP)."""
        got = await self.packet(Publish)
        if qos is not None:
            assert got.qos == qos, got
        if got.qos == 1:
            assert got.packet_id is not None
            self.send(Puback(got.packet_id))
        elif got.qos == 2:
            assert got.packet_id is not None
            self.send(Pubrec(got.packet_id))
            assert (await self.packet(Pubrel)).packet_id == got.packet_id
            self.send(Pubcomp(got.packet_id))
        return got

    async def ended(self) -> None:
        await eventually(lambda: self.wire.closed, "the connection closed")
        self._read()

    async def gone(self) -> None:
        """The connection ends without a DISCONNECT (the socket closed)."""
        self.session.connection_lost()
        await self.session.wait_closed()
        assert self.wire.closed

    async def disconnect(self, reason_code: int = 0, properties: Properties = NO_PROPERTIES) -> None:
        self.send(Disconnect(reason_code, properties))
        await self.ended()
        assert self.packets == []


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with gateway(tmp_path) as gw:
        yield gw


def persistent(expiry_s: int = 300) -> Properties:
    return Properties(session_expiry_interval=expiry_s)


def pending_wills(gw: Gateway) -> dict[str, tuple[bytes, int]]:
    """The core's wills of closed links waiting for their delay: will key → (payload, delay in ms)."""
    book = gw.core.node.broker.wills.book
    return {key: (will.message[M_BODY], will.delay_ms) for key, will in book.pending.items()}


def held_by(c: Client) -> int:
    """The messages ``c``'s subscriptions hold in the gateway, not written yet. The core's count of messages in
    flight is no sign of that: one on its way to the gateway when the session ends is returned as a delivery
    that failed (the gateway never saw it to give it back uncounted)."""
    return sum(len(sub.consumer.peek()) for sub in c.session.subs.values() if sub.consumer is not None)


def link_of(gw: Gateway, client_id: str) -> bool:
    """Whether the core still has the link of ``client_id``'s connection (a will goes when it closes)."""
    return any(s.client_name.startswith(f"mqtt {client_id} ") for s in gw.core.node.broker.sessions.values())


# ---------------------------------------------------------------------------------------------- CONNECT


async def test_a_v5_connect_is_accepted_with_the_gateways_limits(gw: Gateway) -> None:
    c = gw.client()
    connack = await c.connect("sensor-1", keep_alive=30)
    assert (connack.session_present, connack.reason_code) == (False, 0)
    assert connack.properties == Properties(
        receive_maximum=1000, topic_alias_maximum=64, maximum_packet_size=8 * 1024 * 1024 + 64 * 1024
    )
    assert c.session.client_id == "sensor-1"
    assert c.wire.logged_in_called
    assert gw.counters.connections_total == 1
    c.send(Pingreq())
    await c.packet(Pingresp)
    await c.disconnect()
    assert gw.counters.refused == 0


async def test_a_311_connect_has_no_properties_and_answers_pings(gw: Gateway) -> None:
    c = gw.client(V311)
    connack = await c.connect("old", keep_alive=60)
    assert connack == Connack(session_present=False, reason_code=0)
    c.send(Pingreq())
    await c.packet(Pingresp)


async def test_an_empty_client_id_is_assigned_one_in_v5(gw: Gateway) -> None:
    c = gw.client()
    connack = await c.connect("")
    assigned = connack.properties.assigned_client_identifier
    assert assigned is not None
    assert assigned.startswith("auto-")
    assert c.session.client_id == assigned


async def test_a_connack_larger_than_the_clients_maximum_packet_size_closes_the_connection(gw: Gateway) -> None:
    c = gw.client()
    # The assigned client id alone makes the CONNACK longer than 12 bytes: it cannot be sent, and a client
    # waiting for it would wait for ever.
    c.send(Connect("", properties=Properties(maximum_packet_size=12)))
    await c.ended()
    assert c.packets == []
    big = await gw.connected("big", properties=Properties(maximum_packet_size=64))  # one that fits is sent
    await big.disconnect()


async def test_an_empty_client_id_with_clean_session_0_is_refused_in_311(gw: Gateway) -> None:
    c = gw.client(V311)
    connack = await c.connect("", clean_start=False)
    assert connack.reason_code == 2  # identifier rejected
    await c.ended()
    assert not c.wire.logged_in_called
    assert gw.counters.refused == 1


async def test_the_granted_terms_cap_the_expiry_and_keep_alive_and_give_response_information(tmp_path: Path) -> None:
    async with gateway(tmp_path, max_session_expiry_s=10, max_keep_alive_s=20) as gw:
        c = gw.client()
        props = Properties(session_expiry_interval=3600, request_response_information=True)
        connack = await c.connect("app", keep_alive=0, properties=props)
        assert connack.properties.session_expiry_interval == 10
        assert connack.properties.server_keep_alive == 20
        assert connack.properties.response_information == "reply/app"
        assert c.session.expiry_s == 10


async def test_a_will_topic_the_core_cannot_hold_refuses_the_connect(gw: Gateway) -> None:
    c = gw.client()
    connack = await c.connect("w", will=Will("/".join("x" * 40), b"bye"))
    assert connack.reason_code == rc.TOPIC_NAME_INVALID
    assert connack.properties.reason_string is not None
    await c.ended()


async def test_a_connect_of_an_unsupported_version_gets_return_code_1(gw: Gateway) -> None:
    c = gw.client(V311)
    c.session.feed(bytes.fromhex("10 0c 00 04 4d 51 54 54 06 02 00 3c 00 00"))  # level 6
    await c.ended()
    assert c.packets == [Connack(session_present=False, reason_code=1)]


async def test_a_client_that_never_connects_is_closed(tmp_path: Path) -> None:
    async with gateway(tmp_path, connect_timeout_ms=30) as gw:
        c = gw.client()
        await c.ended()
        assert c.packets == []


async def trickle(c: Client, data: bytes, interval_s: float) -> None:
    """Feed ``data`` a byte every ``interval_s``, until it is all fed or the connection is closed."""
    for byte in data:
        if c.wire.closed:
            return
        c.session.feed(byte.to_bytes(1, "big"))
        await asyncio.sleep(interval_s)


async def test_a_connect_trickled_a_byte_at_a_time_still_meets_the_connect_timeout(tmp_path: Path) -> None:
    async with gateway(tmp_path, connect_timeout_ms=300) as gw:
        c = gw.client()
        await trickle(c, encode(Connect("slow", keep_alive=1), V5)[:-1], 0.05)
        assert c.wire.closed  # closed while the bytes still came
        c._read()
        assert c.packets == []


async def test_bytes_that_never_make_a_packet_do_not_keep_a_connection_alive(gw: Gateway) -> None:
    c = await gw.connected("trickle", keep_alive=1)  # closed 1.5 s after the last whole packet
    await trickle(c, encode(Publish("t/x", b"x" * 200), V5)[:40], 0.1)  # 4 s: the packet would take 20 s
    assert c.wire.closed  # closed while the bytes still came
    c._read()
    assert c.packets == [Disconnect(0x8D)]  # Keep Alive timeout


async def test_packets_right_behind_the_connect_are_handled_after_the_connack(gw: Gateway) -> None:
    c = gw.client()
    c.send(Connect("eager"), Subscribe(1, (Subscription("a/b", 1),)), Pingreq())
    assert (await c.packet(Connack)).reason_code == 0
    assert (await c.packet(Pingresp)) == Pingresp()
    assert (await c.packet(Suback)).reason_codes == (1,)


async def test_a_bad_login_is_refused(tmp_path: Path) -> None:
    async with gateway(tmp_path, users=[UserEntry("alice", "secret", ["app"])]) as gw:
        c = gw.client()
        connack = await c.connect("a", username="alice", password=b"wrong")
        assert connack.reason_code == rc.BAD_USER_NAME_OR_PASSWORD
        await c.ended()
        old = gw.client(V311)
        assert (await old.connect("a", username="alice", password=b"wrong")).reason_code == 4
        good = gw.client()
        assert (await good.connect("a", username="alice", password=b"secret")).reason_code == 0
        assert good.session.user == "alice"
        assert gw.counters.refused == 2


async def test_a_password_that_is_not_utf8_is_a_bad_password(gw: Gateway) -> None:
    c = gw.client()
    connack = await c.connect("a", username="u", password=b"\xff\xfe")
    assert connack.reason_code == rc.BAD_USER_NAME_OR_PASSWORD


async def test_a_connect_asking_for_enhanced_authentication_is_refused_as_a_bad_method(gw: Gateway) -> None:
    # [MQTT-4.12.0-1]: the gateway supports no authentication method, so it must refuse and close, not accept
    # a client that then waits for the AUTH exchange it asked for.
    c = gw.client()
    connack = await c.connect("scram", properties=Properties(authentication_method="SCRAM-SHA-1"))
    assert connack.reason_code == 0x8C
    await c.ended()
    assert c.packets == []
    assert not c.wire.logged_in_called
    assert gw.counters.refused == 1


async def test_a_second_connection_of_a_client_id_takes_the_session_over(gw: Gateway) -> None:
    first = await gw.connected("same")
    second = gw.client()
    assert (await second.connect("same")).reason_code == 0
    assert (await first.packet(Disconnect)).reason_code == rc.SESSION_TAKEN_OVER
    await first.ended()
    assert gw.counters.takeovers == 1
    # The newcomer keeps going.
    await second.subscribe("t")
    pub = await gw.connected("pub")
    await pub.publish("t", b"still here")
    assert (await second.message(1)).payload == b"still here"


async def test_a_311_connection_taken_over_is_closed_without_a_packet(gw: Gateway) -> None:
    first = await gw.connected("same", V311)
    await gw.connected("same", V311)
    await first.ended()
    assert first.packets == []


async def test_another_users_connect_cannot_take_a_bound_session(tmp_path: Path) -> None:
    users = [UserEntry("alice", "a", ["app"]), UserEntry("bob", "b", ["app"])]
    grants = [
        PermissionEntry("#", p, ["app"])
        for p in (
            "send",
            "consume",
            "createAddress",
            "createDurableQueue",
            "createNonDurableQueue",
            "deleteDurableQueue",
        )
    ]
    async with gateway(tmp_path, users=users, permissions=grants) as gw:
        alice = await gw.connected("phone", username="alice", password=b"a", properties=persistent())
        bob = gw.client()
        assert (await bob.connect("phone", username="bob", password=b"b")).reason_code == rc.NOT_AUTHORIZED
        await bob.ended()
        # Alice's connection carries on: a message through the core, and no DISCONNECT before it.
        assert (await alice.subscribe("mine")).reason_codes == (1,)
        pub = await gw.connected("pub", username="alice", password=b"a")
        await pub.publish("mine", b"still hers")
        assert (await alice.message()).payload == b"still hers"
        assert not alice.wire.closed
        # Once alice's connection is gone, her persistent session record still names her.
        await alice.gone()
        again = gw.client()
        holders_when_answered: list[int] = []
        write = again.wire.write

        def answer(data: bytes) -> None:  # the moment the CONNACK goes out
            lock = gw.core.node.broker.queues.get(convert.lock_queue("phone"))
            holders_when_answered.append(0 if lock is None else len(lock.consumers))
            write(data)

        again.wire.write = answer  # type: ignore[method-assign]
        connack = await again.connect("phone", clean_start=False, username="bob", password=b"b")
        assert connack.reason_code == rc.NOT_AUTHORIZED
        # The refused connection let go of the session's lock before it answered: its owner, coming back the
        # moment bob has his answer, must not find the lock held by him (and be refused as another user).
        assert holders_when_answered[0] == 0
        back = gw.client()
        connack = await back.connect(
            "phone", clean_start=False, username="alice", password=b"a", properties=persistent()
        )
        assert (connack.reason_code, connack.session_present) == (0, True), connack


# ---------------------------------------------------------------------------------------------- publish & subscribe


@pytest.mark.parametrize("version", [V311, V5])
async def test_qos0_and_qos1_messages_reach_a_subscriber_at_the_lower_qos(gw: Gateway, version: int) -> None:
    sub, pub = await gw.connected("sub", version), await gw.connected("pub", version)
    assert (await sub.subscribe(Subscription("a/b", 1))).reason_codes == (1,)
    await pub.publish("a/b", b"zero", qos=0)
    assert await pub.publish("a/b", b"one", qos=1, packet_id=7) == Puback(7)
    await pub.publish("a/b", b"two", qos=2, packet_id=8)
    got = [await sub.message() for _ in range(3)]
    assert [(m.payload, m.qos, m.retain, m.dup) for m in got] == [
        (b"zero", 0, False, False),
        (b"one", 1, False, False),
        (b"two", 1, False, False),
    ]
    assert all(m.topic == "a/b" for m in got)
    assert got[1].packet_id is not None
    await pub.publish("a/b", b"marker", qos=0)
    assert (await sub.message()).payload == b"marker"  # and no copy of the three before it
    assert gw.counters.messages_published == 4


async def test_an_acknowledged_message_leaves_the_core_and_an_unacknowledged_one_stays(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("q/1", 1))
    (queue,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    await pub.publish("q/1", b"x")
    first = await sub.packet(Publish)
    assert first.packet_id is not None
    # A PUBLISH of the subscriber's own, answered by the core over the same link: an ack sent before it (which
    # the client has not given) would have reached the core first.
    await sub.publish("elsewhere", b"round trip", packet_id=2)
    held = gw.core.node.broker.queues[queue]
    assert (len(held), held.in_flight) == (0, 1)  # delivered, not acknowledged
    sub.send(Puback(first.packet_id))
    await eventually(lambda: len(held) == 0 and held.in_flight == 0, "the ack reached the core")


async def test_qos2_to_a_qos2_subscriber_runs_both_flows(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("x", 2))
    await pub.publish("x", b"exactly once", qos=2, packet_id=3)
    got = await sub.packet(Publish)
    assert (got.qos, got.payload) == (2, b"exactly once")
    assert got.packet_id is not None
    sub.send(Pubrec(got.packet_id))
    assert await sub.packet(Pubrel) == Pubrel(got.packet_id)
    sub.send(Pubcomp(got.packet_id))
    await pub.publish("x", b"marker", qos=2, packet_id=4)
    assert (await sub.message(2)).payload == b"marker"  # the first was not sent again before it


async def test_a_qos2_publish_sent_again_before_its_pubrel_is_delivered_once(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("d", 2))
    pub.send(Publish("d", b"once", 2, packet_id=5))
    assert (await pub.packet(Pubrec)).packet_id == 5
    pub.send(Publish("d", b"once", 2, dup=True, packet_id=5))
    assert (await pub.packet(Pubrec)).packet_id == 5  # repeated by the codec
    pub.send(Pubrel(5))
    assert await pub.packet(Pubcomp) == Pubcomp(5)
    assert (await sub.message(2)).payload == b"once"
    await pub.publish("d", b"marker", qos=2, packet_id=6)
    assert (await sub.message(2)).payload == b"marker"  # no second copy before it


async def test_a_qos2_publish_sent_again_in_the_same_read_gets_its_pubrec_too(gw: Gateway) -> None:
    """Until the PUBREL every PUBLISH of the id gets a PUBREC ([MQTT-4.3.3-2]): two in one read got one."""
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("d2", 2))
    pub.send(Publish("d2", b"once", 2, packet_id=5), Publish("d2", b"once", 2, dup=True, packet_id=5))
    assert [await pub.packet(Pubrec) for _ in range(2)] == [Pubrec(5), Pubrec(5)]
    pub.send(Pubrel(5))
    assert await pub.packet(Pubcomp) == Pubcomp(5)
    assert (await sub.message(2)).payload == b"once"
    await pub.publish("d2", b"marker", qos=2, packet_id=6)
    assert (await sub.message(2)).payload == b"marker"  # no second copy before it


async def test_a_pubrel_of_an_unknown_packet_id_is_answered_not_found(gw: Gateway) -> None:
    c = await gw.connected("c")
    c.send(Pubrel(42))
    assert await c.packet(Pubcomp) == Pubcomp(42, rc.PACKET_IDENTIFIER_NOT_FOUND)


@pytest.mark.parametrize("version", [V5, V311])
@pytest.mark.parametrize("expiry_s", [0, 300])
async def test_a_pubrel_sent_again_before_its_pubcomp_gets_a_pubcomp_too(
    gw: Gateway, version: int, expiry_s: int
) -> None:
    # A client retrying its PUBREL (3.1.1 clients with a retry interval do) gets a PUBCOMP for each; the second
    # PUBREL used to end the connection as the gateway's own failure (5.0: DISCONNECT 0x83).
    props = persistent(expiry_s) if version == V5 and expiry_s else NO_PROPERTIES
    sub = await gw.connected("sub")
    await sub.subscribe(Subscription("rel", 2))
    pub = await gw.connected("pub", version, clean_start=not expiry_s, properties=props)
    pub.send(Publish("rel", b"once", 2, packet_id=7))
    assert (await pub.packet(Pubrec)).packet_id == 7
    pub.send(Pubrel(7), Pubrel(7))
    assert await pub.packet(Pubcomp) == Pubcomp(7)
    assert await pub.packet(Pubcomp) == Pubcomp(7)
    assert (await sub.message(2)).payload == b"once"
    await pub.publish("rel", b"next", qos=2, packet_id=7)  # the id is free again
    assert (await sub.message(2)).payload == b"next"
    assert not pub.wire.closed


async def test_a_qos1_publish_sent_again_while_unanswered_is_published_once(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe("dup")
    pub.send(Publish("dup", b"1", 1, packet_id=9), Publish("dup", b"1", 1, dup=True, packet_id=9))
    assert await pub.packet(Puback) == Puback(9)
    assert await pub.packet(Puback) == Puback(9)  # each PUBLISH gets one ([MQTT-4.3.2-2])
    assert (await sub.message(1)).payload == b"1"
    # The next publish's PUBACK is the publisher's next packet, its message the subscriber's next: no third
    # PUBACK and no second copy came before them (the journal's write included).
    assert await pub.publish("dup", b"2", packet_id=10) == Puback(10)
    assert (await sub.message(1)).payload == b"2"


async def test_wildcards_match_levels_but_not_dollar_topics(gw: Gateway) -> None:
    plus, hash_, all_, pub = [await gw.connected(n) for n in ("plus", "hash", "all", "pub")]
    await plus.subscribe(Subscription("a/+/c", 0))
    await hash_.subscribe(Subscription("a/#", 0))
    await all_.subscribe(Subscription("#", 1))
    for topic in ("a/b/c", "a", "a/b/d", "$SYS/x", "$app/x"):
        await pub.publish(topic, topic.encode())
    assert (await plus.message()).topic == "a/b/c"
    assert [(await hash_.message()).topic for _ in range(3)] == ["a/b/c", "a", "a/b/d"]
    assert [(await all_.message()).topic for _ in range(3)] == ["a/b/c", "a", "a/b/d"]
    await pub.publish("a/b/c", b"marker")
    for c in (plus, hash_, all_):
        assert (await c.message()).payload == b"marker"  # no $ topic before it


async def test_the_gateways_own_topics_are_out_of_every_clients_reach(gw: Gateway) -> None:
    """``$mqtt/...`` maps to the addresses of the gateway's retained store, session records, locks and outboxes.
    With no users configured every client has every right on the core: one subscribed to ``$mqtt/#`` read every
    retained message, and a PUBLISH to ``$mqtt/retained`` (PUBACK 0) put a message without a topic in the store,
    which ended its subscribers' connections with 0x83 and a traceback."""
    spy = await gw.connected("spy")
    suback = await spy.subscribe(
        Subscription("$mqtt/#", 1), Subscription("$share/g/$mqtt/retained", 0), Subscription("$SYS/x", 0)
    )
    assert suback.reason_codes == (rc.NOT_AUTHORIZED, rc.NOT_AUTHORIZED, 0)
    pub = await gw.connected("pub")
    pub.send(Publish("$mqtt/retained", b"poison", 1, packet_id=1))
    assert (await pub.packet(Disconnect)).reason_code == rc.NOT_AUTHORIZED
    await pub.ended()
    c = gw.client()
    connack = await c.connect("w", will=Will("$mqtt/lock/victim", b"bye"))
    assert connack.reason_code == rc.NOT_AUTHORIZED
    stores = gw.queues("$mqtt.retained.")
    assert stores
    assert not any(len(gw.core.node.broker.queues[name]) for name in stores)  # nothing of theirs


async def test_a_message_in_an_outbox_without_its_topic_is_dead_lettered_not_a_failure(gw: Gateway) -> None:
    """A client of another protocol with rights on a session's outbox (any, with no users configured) can put a
    message there without the property that names its topic: it ended the MQTT session with 0x83 and a
    traceback, again at every reconnect. It goes to the dead-letter address now, and the session goes on."""
    pub = await gw.connected("pub")
    await pub.publish("kept/v", b"x", retain=True)
    c = await gw.connected("victim", clean_start=False, properties=persistent())
    await c.subscribe(Subscription("kept/v", 1))
    assert (await c.packet(Publish)).retain  # its outbox holds it until acknowledged
    await c.gone()
    async with gw.core.admin() as admin:
        await admin.publish(new_message(convert.outbox_queue("victim"), b"poison", routing=RoutingType.ANYCAST))
    back = gw.client()
    assert (await back.connect("victim", clean_start=False, properties=persistent())).session_present
    got = await back.message()
    assert (got.topic, got.retain, got.dup) == ("kept/v", True, True)
    await back.handled_in_order()  # the poison was not sent, and the session goes on
    dead = gw.core.node.broker.queues["DLQ"]
    await eventually(lambda: len(dead) == 1, "the message without a topic dead-lettered")


async def test_topics_with_characters_the_core_gives_a_meaning_go_both_ways(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe("a.b/*/%/")
    await pub.publish("a.b/*/%/", b"odd")
    assert (await sub.message()).topic == "a.b/*/%/"


async def test_filters_the_core_cannot_hold_are_refused_in_the_suback(gw: Gateway) -> None:
    c = await gw.connected("c")
    deep = "/".join("l" * 40)
    suback = await c.subscribe(Subscription("ok", 2), Subscription("a/#/b", 0), Subscription(deep, 1))
    assert suback.reason_codes == (2, rc.TOPIC_FILTER_INVALID, rc.TOPIC_FILTER_INVALID)
    old = await gw.connected("old", V311)
    assert (await old.subscribe(Subscription("a/#/b", 0))).reason_codes == (0x80,)


async def test_subscriptions_beyond_the_connections_maximum_are_refused_with_quota_exceeded(tmp_path: Path) -> None:
    """Each subscription may hold a window of messages in the gateway for a client that stops reading; a
    client could open as many as it liked (STOMP and AMQP connections had their caps)."""
    async with gateway(tmp_path, max_subscriptions=2) as gw:
        c = await gw.connected("c")
        suback = await c.subscribe(Subscription("a", 1), Subscription("b", 0), Subscription("c", 1))
        assert suback.reason_codes == (1, 0, rc.QUOTA_EXCEEDED)
        assert (await c.subscribe(Subscription("a", 2), packet_id=2)).reason_codes == (2,)  # a replacement: not more
        assert (await c.unsubscribe("b", packet_id=3)).reason_codes == (0,)
        assert (await c.subscribe(Subscription("c", 1), packet_id=4)).reason_codes == (1,)
        old = await gw.connected("old", V311)
        assert (await old.subscribe(Subscription("x", 0), Subscription("y", 0), Subscription("z", 0))).reason_codes == (
            0,
            0,
            0x80,
        )


async def test_a_shared_subscription_splits_the_messages_between_its_members(gw: Gateway) -> None:
    a, b, pub = await gw.connected("a"), await gw.connected("b"), await gw.connected("pub")
    assert (await a.subscribe("$share/g/jobs/+")).reason_codes == (1,)
    assert (await b.subscribe("$share/g/jobs/+")).reason_codes == (1,)
    assert len(gw.queues(convert.SHARED_PREFIX)) == 1
    for n in range(6):
        await pub.publish("jobs/x", str(n).encode(), packet_id=n + 1)
    # The members compete for the group's queue, which hands its messages round-robin to the consumers with
    # credit: both have room for all six, so they take turns.
    got = {name: [(await c.message(1)).payload for _ in range(3)] for name, c in (("a", a), ("b", b))}
    evens, odds = [b"0", b"2", b"4"], [b"1", b"3", b"5"]
    assert sorted([got["a"], got["b"]]) == [evens, odds], got
    # The group's queue stays while a member is left, and the one left gets every message.
    await a.unsubscribe("$share/g/jobs/+")
    for n in (6, 7):
        await pub.publish("jobs/x", str(n).encode(), packet_id=n + 1)
    assert [(await b.message(1)).payload for _ in range(2)] == [b"6", b"7"]
    assert len(gw.queues(convert.SHARED_PREFIX)) == 1
    await a.nothing()  # b had its messages after a's unsubscribe was answered


async def test_a_shared_subscription_keeps_messages_for_an_away_persistent_member_whoever_joined_last(
    gw: Gateway,
) -> None:
    # The group's queue took the expiry of the member that subscribed last: a member whose session ends with
    # its connection (expiry 0) joining after a persistent one had the queue deleted when it left, and with it
    # the messages published for the persistent member while it was away.
    away = await gw.connected("away", properties=persistent())
    await away.subscribe("$share/g/jobs")
    await away.gone()
    passing = await gw.connected("passing")
    await passing.subscribe("$share/g/jobs")
    await passing.disconnect()
    await asyncio.sleep(0.2)  # the core checks queue expiries every 50 ms
    assert gw.queues("mqtt.shared.g.jobs.")
    pub = await gw.connected("pub")
    await pub.publish("jobs", b"while away")
    back = gw.client()
    assert (await back.connect("away", clean_start=False, properties=persistent())).session_present
    assert (await back.message()).payload == b"while away"


async def test_no_local_on_a_shared_subscription_is_a_protocol_error(gw: Gateway) -> None:
    c = await gw.connected("c")
    c.send(Subscribe(1, (Subscription("$share/g/t", 1, no_local=True),)))
    assert (await c.packet(Disconnect)).reason_code == rc.PROTOCOL_ERROR
    await c.ended()
    assert gw.counters.protocol_errors == 1


async def test_a_subscription_identifier_comes_with_each_message(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("s/1", 1), sid=7)
    await sub.subscribe(Subscription("s/+", 0), packet_id=2, sid=9)
    await pub.publish("s/1", b"m", qos=1)
    got = sorted([(await sub.message()).properties.subscription_identifiers for _ in range(2)])
    assert got == [(7,), (9,)]


async def test_no_local_keeps_a_clients_own_messages_from_it(gw: Gateway) -> None:
    me, other = await gw.connected("me"), await gw.connected("other")
    await me.subscribe(Subscription("chat", 1, no_local=True))
    await me.publish("chat", b"mine")
    await other.publish("chat", b"theirs")
    assert (await me.message()).payload == b"theirs"
    await me.nothing()  # "mine" was queued before "theirs": it would have come first


async def test_retain_as_published_keeps_the_retain_flag_of_live_messages(gw: Gateway) -> None:
    keep, plain, pub = await gw.connected("keep"), await gw.connected("plain"), await gw.connected("pub")
    await keep.subscribe(Subscription("r", 1, retain_as_published=True))
    await plain.subscribe(Subscription("r", 1))
    await pub.publish("r", b"live", retain=True)
    assert (await keep.message()).retain is True
    assert (await plain.message()).retain is False


async def test_retained_messages_are_set_sent_on_subscribe_and_cleared(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("home/temp", b"21", retain=True)
    await pub.publish("home/hum", b"40", qos=0, retain=True)
    await pub.publish("office/temp", b"19", qos=2, retain=True)
    sub = await gw.connected("sub")
    await sub.subscribe(Subscription("home/+", 1))
    got = sorted([(m.topic, m.payload, m.qos, m.retain) for m in [await sub.message() for _ in range(2)]])
    assert got == [("home/hum", b"40", 0, True), ("home/temp", b"21", 1, True)]
    await sub.handled_in_order()  # no third retained message (office/temp) came before
    await pub.publish("home/temp", b"", retain=True)  # clears it, and is delivered live as empty
    live = await sub.message()
    assert (live.topic, live.payload, live.retain) == ("home/temp", b"", False)
    late = await gw.connected("late")
    await late.subscribe(Subscription("home/temp", 1), Subscription("office/#", 2))
    office = await late.message()
    assert (office.topic, office.payload, office.qos, office.retain) == ("office/temp", b"19", 2, True)
    await late.handled_in_order()  # the cleared home/temp did not come


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("payload", [b"new", b""], ids=["replaced", "cleared"])
async def test_a_retained_publish_right_before_the_socket_closes_still_reaches_the_store(
    gw: Gateway, qos: int, payload: bytes
) -> None:
    """The store is written once the core has accepted the message, and the core answers nothing behind a link's
    CLOSE: a client that closed its socket right after the PUBLISH had it delivered live and left the old
    retained message in the store (found by hand: about 7 closes in 10)."""
    pub = await gw.connected("pub")
    await pub.publish("r/close", b"old", qos=1, retain=True)
    pub.send(Publish("r/close", payload, qos, packet_id=2 if qos else None, retain=True))
    await pub.gone()
    late = await gw.connected("late")
    await late.subscribe(Subscription("r/close", 0))
    if payload:
        got = await late.message()
        assert (got.payload, got.retain) == (payload, True)
    await late.handled_in_order()  # (cleared: nothing before the marker)


async def test_retained_messages_the_client_can_take_at_once_are_sent_without_a_task(gw: Gateway) -> None:
    """The SUBSCRIBE's worker sends them itself: a task of their own for every SUBSCRIBE was a fifth of the tasks
    a device's connect, subscribe and disconnect made. A task goes on only where the client must read first
    (the tests below)."""
    pub = await gw.connected("pub")
    await pub.publish("dev/1", b"on", qos=1, retain=True)
    sub = await gw.connected("sub")
    await sub.subscribe(Subscription("dev/1", 1), Subscription("dev/2", 0))
    message = await sub.message()
    assert (message.topic, message.payload, message.retain) == ("dev/1", b"on", True)
    # The worker handles packets one after another: its UNSUBACK comes once the SUBSCRIBE's handling has ended
    # (the client may read the message before the worker has looked for dev/2's).
    await sub.unsubscribe("unused/marker")
    assert sub.session._background is None  # no task was made for them
    assert sub.session._sending_retained is None


async def test_retained_messages_wait_for_a_subscriber_that_does_not_read(gw: Gateway) -> None:
    """A SUBSCRIBE to ``#`` read the whole retained store into the gateway and wrote it to the client at once,
    whether it read or not: a gateway's memory for each such subscription was the size of the store. Now
    the store is read a batch at a time (the browse's window), and the next batch waits for the client."""
    pub = await gw.connected("pub")
    count = 2500
    for n in range(count):
        pub.send(Publish(f"all/{n}", b"%d" % n, 0, retain=True))
    await pub.publish("all/last", b"marker", retain=True)  # after the QoS 0 ones, in order
    sub = await gw.connected("sub")
    sub.wire.stall()
    sub.send(Subscribe(1, (Subscription("all/#", 0),)))
    await eventually(lambda: sub.wire.out.count(b"all/") >= 100, "the first retained messages written")
    await settle()
    written = sub.wire.out.count(b"all/")
    assert written <= 1000  # one browse window of the store, not all of it
    sub.wire.drain()
    suback, *retained = await sub.packets_of_any_kind(count + 2)
    assert type(suback) is Suback
    topics = [m.topic for m in retained if isinstance(m, Publish)]
    assert sorted(topics) == sorted([f"all/{n}" for n in range(count)] + ["all/last"])


async def test_retained_messages_beyond_the_clients_receive_maximum_wait_in_the_store(gw: Gateway) -> None:
    """A SUBSCRIBE at QoS 1 over more retained messages than the client's receive maximum: the rest waited in
    the gateway, all of them (2,490 of 2,500 here), and the client's PUBACKs waited behind the SUBSCRIBE. Now
    the store is read on while the client acknowledges, a batch at a time."""
    pub = await gw.connected("pub")
    count = 2500
    for first in range(0, count, 500):  # within the gateway's receive maximum
        pub.send(*(Publish(f"q1/{n}", b"%d" % n, 1, packet_id=n + 1, retain=True) for n in range(first, first + 500)))
        await pub.packets_of_any_kind(500)  # their PUBACKs: retained
    sub = await gw.connected("sub", properties=Properties(receive_maximum=10))
    sub.send(Subscribe(1, (Subscription("q1/#", 1),)))
    assert type(await sub.packet(Suback)) is Suback
    first = [await sub.message(1) for _ in range(10)]
    await settle()
    assert len(sub.session._outbound.parked) <= 1000  # one batch of the store, not all of it
    topics = [m.topic for m in first]
    for m in first:
        sub.send(Puback(m.packet_id or 0))
    while len(topics) < count:
        m = await sub.message(1)
        topics.append(m.topic)
        sub.send(Puback(m.packet_id or 0))
    assert sorted(topics) == sorted(f"q1/{n}" for n in range(count))


async def test_retain_handling_decides_whether_a_subscribe_gets_the_retained_messages(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("rh", b"kept", retain=True)
    c = await gw.connected("c")
    # Each SUBACK below is the next packet: the retained message of a SUBSCRIBE before it would come first.
    await c.subscribe(Subscription("rh", 1, retain_handling=2))  # never
    await c.subscribe(Subscription("rh", 1, retain_handling=1), packet_id=2)  # not new: none
    await c.subscribe(Subscription("rh", 1, retain_handling=0), packet_id=3)  # always
    assert (await c.message()).payload == b"kept"
    await c.handled_in_order()  # once
    other = await gw.connected("other")
    await other.subscribe(Subscription("rh", 0, retain_handling=1))  # new
    assert (await other.message()).payload == b"kept"
    await other.handled_in_order()
    shared = await gw.connected("shared")
    await shared.subscribe(Subscription("$share/g/rh", 1))
    await shared.handled_in_order()  # a new shared subscription gets none


async def test_a_persistent_sessions_retained_messages_at_qos_1_come_again_until_acknowledged(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("kept/a", b"21", retain=True)
    await pub.publish("kept/b", b"40", qos=0, retain=True)
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("kept/+", 1), sid=7)
    got = {m.topic: m for m in [await c.packet(Publish), await c.packet(Publish)]}
    assert {t: (m.qos, m.retain, m.dup) for t, m in got.items()} == {
        "kept/a": (1, True, False),
        "kept/b": (0, True, False),  # QoS 0: written at once, kept nowhere
    }
    first = got["kept/a"]
    assert first.properties.subscription_identifiers == (7,)
    await c.gone()  # without the PUBACK
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    again = await back.message()  # acknowledged now
    assert (again.topic, again.payload, again.qos, again.retain, again.dup, again.packet_id) == (
        "kept/a",
        b"21",
        1,
        True,
        True,
        first.packet_id,
    )
    assert again.properties.subscription_identifiers == (7,)
    await back.handled_in_order()  # kept/b did not come again
    await back.gone()
    third = gw.client()
    assert (await third.connect("dev", clean_start=False, properties=persistent())).session_present
    await third.handled_in_order()  # nor kept/a, acknowledged


async def test_a_retained_message_at_qos_2_whose_pubrec_was_recorded_is_released_not_sent_again(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("kept/q2", b"once", qos=2, retain=True)
    c = await gw.connected("dev", version=V311, clean_start=False)
    await c.subscribe(Subscription("kept/q2", 2))
    got = await c.packet(Publish)
    assert (got.qos, got.retain, got.dup) == (2, True, False)
    assert got.packet_id is not None
    c.send(Pubrec(got.packet_id))
    assert await c.packet(Pubrel) == Pubrel(got.packet_id)
    await c.gone()  # before the PUBCOMP
    back = gw.client(V311)
    assert (await back.connect("dev", clean_start=False)).session_present
    assert await back.packet(Pubrel) == Pubrel(got.packet_id)
    back.send(Pubcomp(got.packet_id))
    await back.handled_in_order()  # the PUBLISH did not come again


async def test_many_retained_messages_come_through_the_outbox_within_the_clients_receive_maximum(
    gw: Gateway,
) -> None:
    pub = await gw.connected("pub")
    for i in range(60):
        await pub.publish(f"many/{i}", b"%d" % i, retain=True, packet_id=i + 1)
    c = await gw.connected("dev", properties=Properties(session_expiry_interval=300, receive_maximum=20))
    await c.subscribe(Subscription("many/#", 1))
    first = [await c.packet(Publish) for _ in range(20)]
    await c.nothing()  # the client's receive maximum: no more until it acknowledges
    await c.gone()
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    again = [await back.message() for _ in range(60)]
    assert all(m.retain for m in again)
    assert sorted(m.topic for m in again) == sorted(f"many/{i}" for i in range(60))
    assert {(m.topic, m.packet_id) for m in again if m.dup} == {(m.topic, m.packet_id) for m in first}
    await back.handled_in_order()


async def test_a_session_that_ends_with_its_connection_keeps_no_outbox(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("kept/clean", b"x", retain=True)
    c = await gw.connected("dev")
    await c.subscribe(Subscription("kept/clean", 1))
    assert (await c.packet(Publish)).retain
    await c.gone()
    assert not gw.queues(convert.OUTBOX_PREFIX)
    back = gw.client()
    assert (await back.connect("dev")).session_present is False
    await back.handled_in_order()


async def test_an_outbox_goes_with_its_session(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("kept/out", b"x", retain=True)
    outbox = convert.outbox_queue("dev")

    async def unacknowledged(**connect: Any) -> None:
        c = await gw.connected("dev", clean_start=False, properties=persistent(), **connect)
        await c.subscribe(Subscription("kept/out", 1))
        assert (await c.packet(Publish)).retain
        assert gw.core.node.broker.queues[outbox].expires_ms == 300_000  # the session's expiry
        await c.gone()

    await unacknowledged()
    fresh = gw.client()  # a clean start discards it
    assert (await fresh.connect("dev", clean_start=True, properties=persistent())).session_present is False
    await fresh.handled_in_order()
    assert not gw.queues(outbox)
    await fresh.gone()
    await unacknowledged()
    ending = await gw.connected("dev", clean_start=False, properties=persistent())  # a DISCONNECT ends it
    assert (await ending.message()).dup
    await ending.disconnect(properties=Properties(session_expiry_interval=0))
    await eventually(lambda: not gw.queues(outbox), "the outbox dropped")
    await unacknowledged()
    once = gw.client()  # resumed with expiry 0: what waited comes, and the outbox goes with the connection
    assert (await once.connect("dev", clean_start=False)).session_present is True
    assert (await once.message()).dup
    await once.disconnect()
    await eventually(lambda: not gw.queues(outbox), "the outbox dropped")


async def test_an_overdue_clean_up_closes_the_outbox_consumer_on_the_service_link_too(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("kept/abort", b"x", retain=True)
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("kept/abort", 1))
    assert (await c.packet(Publish)).retain
    outbox = gw.core.node.broker.queues[convert.outbox_queue("dev")]
    assert len(outbox.consumers) == 1
    for sub in c.session.subs.values():  # as the clean-up does first, before it hangs (on the core, say)
        assert sub.consumer is not None
        sub.consumer.on_wake = None
    await c.session.abort()
    await eventually(lambda: not outbox.consumers, "the outbox's consumer closed")
    await eventually(lambda: len(outbox) == 1, "the unacknowledged copy back in the outbox")


async def test_an_outbox_consumer_opened_for_a_session_that_ended_meanwhile_is_closed(gw: Gateway) -> None:
    opening = asyncio.ensure_future(gw.registry.open_outbox("dev", 60_000, 10, 0))
    await asyncio.sleep(0)  # on its way to the core
    opening.cancel()  # the session ended (its worker is cancelled)
    with pytest.raises(asyncio.CancelledError):
        await opening
    queues = gw.core.node.broker.queues
    outbox = convert.outbox_queue("dev")
    await eventually(lambda: outbox in queues, "the outbox made (with its consumer, in one request)")
    await eventually(lambda: not queues[outbox].consumers, "the consumer nobody holds closed")


async def test_unsubscribe_stops_the_messages_and_drops_the_queue(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe("u/1")
    assert len(gw.queues(convert.SUBSCRIPTION_PREFIX)) == 1
    unsuback = await sub.unsubscribe("u/1", "never/subscribed", "u/#/1")
    assert unsuback.reason_codes == (0, rc.NO_SUBSCRIPTION_EXISTED, rc.TOPIC_FILTER_INVALID)
    await eventually(lambda: not gw.queues(convert.SUBSCRIPTION_PREFIX), "the queue dropped")
    await sub.subscribe("u/marker", packet_id=3)
    await pub.publish("u/1", b"x")
    await pub.publish("u/marker", b"marker", packet_id=2)
    assert (await sub.message()).payload == b"marker"  # and u/1's never came: no queue is left to bring it
    old = await gw.connected("old", V311)
    await old.subscribe("u/2")
    assert await old.unsubscribe("u/2") == Unsuback(2)


async def test_a_qos0_subscription_subscribed_again_at_qos1_gets_acknowledged_messages(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("up", 0))
    assert (await sub.subscribe(Subscription("up", 1), packet_id=2)).reason_codes == (1,)
    await pub.publish("up", b"now qos 1")
    assert (await sub.message(1)).payload == b"now qos 1"
    # And down again: the queue is kept, its messages come at QoS 0.
    assert (await sub.subscribe(Subscription("up", 0), packet_id=3)).reason_codes == (0,)
    await pub.publish("up", b"qos 0 again")
    assert (await sub.message(0)).payload == b"qos 0 again"


# ---------------------------------------------------------------------------------------------- flow control


async def test_the_clients_receive_maximum_bounds_the_messages_in_flight(gw: Gateway) -> None:
    sub = gw.client()
    await sub.connect("slow", properties=Properties(receive_maximum=2))
    await sub.subscribe(Subscription("rm", 1))
    (name,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    queue = gw.core.node.broker.queues[name]
    pub = await gw.connected("pub")
    for n in range(4):
        await pub.publish("rm", str(n).encode(), packet_id=n + 1)
    first, second = await sub.packet(Publish), await sub.packet(Publish)
    assert (first.payload, second.payload) == (b"0", b"1")
    # The subscription's window on the core is the client's receive maximum: the other two wait there.
    assert (len(queue), queue.in_flight) == (2, 2)
    await sub.nothing()
    assert first.packet_id is not None
    sub.send(Puback(first.packet_id))
    assert (await sub.packet(Publish)).payload == b"2"
    await eventually(lambda: (len(queue), queue.in_flight) == (1, 2), "the ack and the next delivery")
    await sub.nothing()


async def test_more_qos2_messages_than_the_receive_maximum_is_a_protocol_error(tmp_path: Path) -> None:
    async with gateway(tmp_path, receive_maximum=2) as gw:
        c = gw.client()
        assert (await c.connect("c")).properties.receive_maximum == 2
        c.send(*(Publish("t", b"x", 2, packet_id=n) for n in (1, 2, 3)))
        assert [(await c.packet(Pubrec)).packet_id for _ in range(2)] == [1, 2]
        assert (await c.packet(Disconnect)).reason_code == 0x93
        await c.ended()


async def test_a_client_that_stops_reading_gets_its_messages_once_it_reads_again(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("slow/1", 1), Subscription("slow/0", 0), packet_id=1)
    sub.wire.stall()
    for n in range(3):
        await pub.publish("slow/1", str(n).encode(), packet_id=n + 1)
        await pub.publish("slow/0", str(n).encode(), qos=0)
    queues = [gw.core.node.broker.queues[name] for name in gw.queues(convert.SUBSCRIPTION_PREFIX)]
    await eventually(lambda: all(len(q) == 0 for q in queues), "all six delivered to the gateway")
    await sub.nothing()  # the session has them, and holds them while the client does not read
    sub.wire.drain()
    got = sorted([((m := await sub.message()).topic, m.payload) for _ in range(6)])
    assert got == sorted([(f"slow/{q}", str(n).encode()) for q in (0, 1) for n in range(3)])


async def test_a_message_too_large_for_the_client_is_dropped_as_if_sent(gw: Gateway) -> None:
    sub = gw.client()
    await sub.connect("small", properties=Properties(maximum_packet_size=64))
    await sub.subscribe(Subscription("big", 1), Subscription("big0", 0))
    pub = await gw.connected("pub")
    await pub.publish("big", b"x" * 100)
    await pub.publish("big0", b"y" * 100, qos=0)
    await pub.publish("big", b"fits", packet_id=2)
    await pub.publish("big0", b"fits too", qos=0)
    # Each queue's small message is the first of it to come: the large one before it was dropped.
    assert sorted([(await sub.message()).payload for _ in range(2)]) == [b"fits", b"fits too"]
    queues = [gw.core.node.broker.queues[name] for name in gw.queues(convert.SUBSCRIPTION_PREFIX)]
    assert len(queues) == 2
    await eventually(
        lambda: all((len(q), q.in_flight) == (0, 0) for q in queues), "the dropped messages done as if sent"
    )


# ---------------------------------------------------------------------------------------------- 5.0 message features


async def test_topic_aliases_name_the_topic_of_later_publishes(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("long/topic/name", 0))
    await pub.publish("long/topic/name", b"1", qos=0, properties=Properties(topic_alias=3))
    await pub.publish("", b"2", qos=1, properties=Properties(topic_alias=3))
    assert [(m.topic, m.payload) for m in [await sub.message() for _ in range(2)]] == [
        ("long/topic/name", b"1"),
        ("long/topic/name", b"2"),
    ]


#: A topic of more levels than the core takes, and the reason string that refuses it.
DEEP_TOPIC = "/".join("z" * 40)
TOO_DEEP = f"{DEEP_TOPIC[:60]!r}... has 40 levels, the core's limit is 32"
NOT_UTF8 = "the payload is not UTF-8 as its format says"
UTF8 = Properties(payload_format_indicator=1)


@pytest.mark.parametrize(
    ("packets", "reason_code", "reason_string"),
    [
        # Found by the codec: a DISCONNECT with the reason code alone.
        ([Publish("t", b"", 0, properties=Properties(topic_alias=65))], 0x94, None),
        ([Publish("", b"", 0, properties=Properties(topic_alias=2))], rc.PROTOCOL_ERROR, None),
        ([Publish("t", b"", 1, packet_id=1), Pubrel(1)], rc.PROTOCOL_ERROR, None),  # a PUBREL before its PUBREC
        ([Publish("t", b"", 2, packet_id=1), Publish("t", b"", 1, packet_id=1)], rc.PROTOCOL_ERROR, None),  # in use
        ([Auth()], rc.PROTOCOL_ERROR, None),
        ([Publish("t", b"", 1, packet_id=1, properties=Properties(response_topic="reply/+"))], rc.PROTOCOL_ERROR, None),
        ([Publish("t", b"", 0, properties=Properties(response_topic="reply/#"))], rc.PROTOCOL_ERROR, None),
        ([Connect("again")], rc.PROTOCOL_ERROR, None),
        ([Suback(1, (0,))], rc.PROTOCOL_ERROR, None),
        # Found by the session: its reason string too.
        ([Publish("t", b"\xff", 0, properties=UTF8)], rc.PAYLOAD_FORMAT_INVALID, NOT_UTF8),
        ([Publish("t", b"\xff", 1, packet_id=1, properties=UTF8)], rc.PAYLOAD_FORMAT_INVALID, NOT_UTF8),
        ([Publish("t", b"\xff", 2, packet_id=1, properties=UTF8)], rc.PAYLOAD_FORMAT_INVALID, NOT_UTF8),
        ([Publish(DEEP_TOPIC, b"", 0)], rc.TOPIC_NAME_INVALID, TOO_DEEP),
        ([Publish(DEEP_TOPIC, b"", 1, packet_id=1)], rc.TOPIC_NAME_INVALID, TOO_DEEP),
        ([Publish(DEEP_TOPIC, b"", 2, packet_id=1)], rc.TOPIC_NAME_INVALID, TOO_DEEP),
    ],
)
async def test_protocol_violations_end_a_v5_connection_with_their_reason_code_and_send_the_will(
    gw: Gateway, packets: list[Packet], reason_code: int, reason_string: str | None
) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("wills/c", 1))
    c = await gw.connected("c", will=Will("wills/c", b"broke the protocol"))
    c.send(*packets)
    answered = packets[0] if len(packets) > 1 else None  # the packet before the violation is answered first
    if isinstance(answered, Publish):
        ack: Puback | Pubrec = await (c.packet(Puback) if answered.qos == 1 else c.packet(Pubrec))
        assert (ack.packet_id, ack.reason_code) == (answered.packet_id, 0)
    disconnect = await c.packet(Disconnect)
    assert (disconnect.reason_code, disconnect.properties.reason_string) == (reason_code, reason_string)
    await c.ended()
    assert c.packets == []
    assert gw.counters.protocol_errors == 1
    assert (await watcher.message()).payload == b"broke the protocol"


async def test_a_protocol_violation_ends_a_311_connection_without_a_packet_after_what_came_before(
    gw: Gateway,
) -> None:
    c = await gw.connected("c", V311)
    c.send(Publish("ok", b"", 1, packet_id=1))
    c.session.feed(b"\xf0\x00")  # reserved packet type 15
    assert await c.packet(Puback) == Puback(1)
    await c.ended()
    assert c.packets == []


async def test_message_properties_pass_through_and_the_expiry_counts_down(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("p", 1))
    props = Properties(
        payload_format_indicator=1,
        message_expiry_interval=60,
        content_type="text/plain",
        response_topic="replies/me",
        correlation_data=b"\x01\x02",
        user_properties=(("k", "v"), ("k", "w")),
    )
    await pub.publish("p", b"hello", properties=props)
    got = (await sub.message()).properties
    assert got.message_expiry_interval in (59, 60)
    assert dataclasses.replace(got, message_expiry_interval=60) == props


async def test_an_expired_message_is_not_delivered(gw: Gateway) -> None:
    sub, pub = await gw.connected("sub"), await gw.connected("pub")
    await sub.subscribe(Subscription("e", 1))
    sub.wire.stall()
    await pub.publish("e", b"short-lived", properties=Properties(message_expiry_interval=1))
    expired_by = time.time() + 1.0  # the gateway stamped its expiry before this PUBACK
    await pub.publish("e", b"lasting", packet_id=2)
    # The message's own timer has to run out (the core's and the gateway's clock is the wall clock).
    await eventually(lambda: time.time() > expired_by, "the message's expiry", timeout=WAIT_S)
    sub.wire.drain()
    assert (await sub.message()).payload == b"lasting"  # the first of the queue to come


async def test_messages_of_other_protocols_reach_v5_subscribers_with_user_properties(gw: Gateway) -> None:
    sub = await gw.connected("sub")
    await sub.subscribe(Subscription("from/stomp", 2))
    async with gw.core.admin() as admin:
        message = new_message(
            "from.stomp", b"cross", routing=RoutingType.MULTICAST, durable=True, properties={"color": "red"}
        )
        await admin.publish(message)
    got = await sub.message(1)  # durable: QoS 1
    assert (got.topic, got.payload, got.properties.user_properties) == ("from/stomp", b"cross", (("color", "red"),))


# ---------------------------------------------------------------------------------------------- persistent sessions


async def test_a_persistent_session_keeps_qos1_messages_while_away(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("cmd/+", 1), Subscription("cmd0", 0))
    await c.disconnect()
    pub = await gw.connected("pub")
    await pub.publish("cmd/a", b"while away")
    await pub.publish("cmd0", b"qos0 while away", qos=0)
    back = gw.client()
    connack = await back.connect("dev", clean_start=False, properties=persistent())
    assert connack.session_present is True
    got = sorted([(await back.message()).payload for _ in range(2)])
    assert got == [b"qos0 while away", b"while away"]
    # A clean start ends it: the next connection has no session and no subscriptions.
    await back.disconnect()
    fresh = gw.client()
    assert (await fresh.connect("dev", clean_start=True, properties=persistent())).session_present is False
    assert not gw.queues(convert.subscription_queue("dev", "cmd/+"))
    assert not gw.queues(convert.subscription_queue("dev", "cmd0"))
    await fresh.subscribe("marker")
    await pub.publish("cmd/a", b"after the end")
    await pub.publish("marker", b"marker", packet_id=2)
    assert (await fresh.message()).payload == b"marker"  # and no cmd/a: the old subscriptions are gone


async def test_a_311_session_with_clean_session_0_is_resumed_with_session_present(gw: Gateway) -> None:
    c = await gw.connected("old", V311, clean_start=False)
    assert c.session.expiry_s == 7 * 24 * 3600
    await c.subscribe(Subscription("o", 1))
    await c.disconnect()
    pub = await gw.connected("pub")
    await pub.publish("o", b"kept")
    back = gw.client(V311)
    assert (await back.connect("old", clean_start=False)).session_present is True
    assert (await back.message(1)).payload == b"kept"


async def test_an_unacknowledged_message_comes_again_with_dup_and_its_packet_id(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("r", 1))
    pub = await gw.connected("pub")
    await pub.publish("r", b"unacked")
    first = await c.packet(Publish)
    assert first.dup is False
    await c.gone()
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    again = await back.message()
    assert (again.payload, again.dup, again.packet_id) == (b"unacked", True, first.packet_id)


async def test_a_qos2_message_whose_pubrec_was_recorded_is_released_not_sent_again(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("q2", 2))
    pub = await gw.connected("pub")
    await pub.publish("q2", b"once", qos=2)
    got = await c.packet(Publish)
    assert got.packet_id is not None
    c.send(Pubrec(got.packet_id))
    assert await c.packet(Pubrel) == Pubrel(got.packet_id)
    await c.gone()  # before the PUBCOMP
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    assert await back.packet(Pubrel) == Pubrel(got.packet_id)
    back.send(Pubcomp(got.packet_id))
    await eventually(lambda: not back.session.state.released_out, "the record forgot the packet id")
    await pub.publish("q2", b"next", qos=2, packet_id=2)
    assert (await back.message(2)).payload == b"next"  # "once" was not sent again before it


async def test_overlapping_qos2_subscriptions_of_a_persistent_session_each_deliver_their_copy(gw: Gateway) -> None:
    """One core message has one id in both subscriptions' queues: the second copy is not taken for the first
    once that one's flow is complete, on the live connection or after a reconnect (each copy with its own
    subscription identifier, [MQTT-3.3.4-4])."""
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("o2/a", 2), sid=1)
    await c.subscribe(Subscription("o2/+", 2), packet_id=2, sid=2)
    pub = await gw.connected("pub")
    await pub.publish("o2/a", b"live", qos=2)
    got = [await c.message(2), await c.message(2)]
    assert sorted(m.properties.subscription_identifiers for m in got) == [(1,), (2,)]
    assert {m.payload for m in got} == {b"live"}
    # The first copy's PUBREC recorded, the connection lost before its PUBCOMP: the other copy still comes.
    await pub.publish("o2/a", b"resumed", qos=2, packet_id=2)
    first = await c.packet(Publish)
    assert first.packet_id is not None
    c.send(Pubrec(first.packet_id))
    assert await c.packet(Pubrel) == Pubrel(first.packet_id)
    await c.gone()
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    assert await back.packet(Pubrel) == Pubrel(first.packet_id)
    back.send(Pubcomp(first.packet_id))
    other = await back.message(2)
    assert other.payload == b"resumed"
    assert other.properties.subscription_identifiers != first.properties.subscription_identifiers
    await pub.publish("o2/a", b"marker", qos=2, packet_id=3)
    assert [(await back.message(2)).payload for _ in range(2)] == [b"marker", b"marker"]  # "resumed" once each


async def test_a_session_whose_client_stopped_reading_ends_without_waiting_for_it(gw: Gateway) -> None:
    """A randomised run: a client that left without closing its socket (nothing read any more) was taken over,
    but the old session's clean-up waited for that client to read what was written. Its link stayed open for
    minutes, and at each failover its consumer took the session's messages again, counting an attempt for
    each, until 571 of them were dead-lettered. The clean-up no longer waits for the client."""
    old = await gw.connected("dev", properties=persistent())
    await old.subscribe(Subscription("held", 1))
    old.wire.stall()  # the client reads nothing more: what comes waits for it to drain
    pub = await gw.connected("pub")
    await pub.publish("held", b"while stalled")
    await eventually(lambda: held_by(old) == 1, "the old session to take it")
    new = gw.client()
    assert (await new.connect("dev", clean_start=False, properties=persistent())).session_present
    got = await new.message(1)
    assert (got.payload, got.dup) == (b"while stalled", False)  # never written to the old client: no attempt


async def test_messages_never_written_to_a_client_that_left_come_back_unflagged(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("unsent", 1))
    pub = await gw.connected("pub")
    await pub.publish("unsent", b"sent")
    sent = await c.packet(Publish)  # written; the client leaves before its PUBACK
    c.wire.stall()
    for n in range(3):
        await pub.publish("unsent", b"waiting %d" % n, packet_id=n + 2)
    await eventually(lambda: held_by(c) == 3, "the gateway to take them all")
    c.wire.drain()  # as a socket's end does: what waits for the client to read wakes up
    await c.gone()
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    got = [await back.message(1) for _ in range(4)]
    assert [(m.payload, m.dup) for m in got] == [
        (sent.payload, True),  # written: it may have reached the client
        (b"waiting 0", False),
        (b"waiting 1", False),
        (b"waiting 2", False),
    ]


async def test_a_qos2_publish_retried_after_a_reconnect_is_published_once(gw: Gateway) -> None:
    sub = await gw.connected("sub")
    await sub.subscribe(Subscription("x2", 2))
    c = await gw.connected("dev", properties=persistent())
    c.send(Publish("x2", b"exactly once", 2, packet_id=11))
    assert (await c.packet(Pubrec)).packet_id == 11
    await c.gone()  # the PUBREC is taken as lost
    back = gw.client()
    assert (await back.connect("dev", clean_start=False, properties=persistent())).session_present
    back.send(Publish("x2", b"exactly once", 2, dup=True, packet_id=11))
    assert (await back.packet(Pubrec)).packet_id == 11
    back.send(Pubrel(11))
    assert await back.packet(Pubcomp) == Pubcomp(11)
    assert (await sub.message(2)).payload == b"exactly once"
    await back.publish("x2", b"marker", qos=2, packet_id=12)
    assert (await sub.message(2)).payload == b"marker"  # no second copy before it


async def test_a_disconnect_may_end_a_persistent_session(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe("gone/soon")
    await c.disconnect(properties=Properties(session_expiry_interval=0))
    await eventually(lambda: not gw.queues(convert.session_queue("dev")), "the session queue dropped")
    assert not gw.queues(convert.subscription_queue("dev", "gone/soon"))
    back = gw.client()
    assert (await back.connect("dev", clean_start=False)).session_present is False


async def test_a_disconnect_may_lengthen_a_persistent_session(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent(60))
    await c.subscribe("kept")
    queues = gw.core.node.broker.queues
    names = (convert.session_queue("dev"), convert.subscription_queue("dev", "kept"))
    assert [queues[name].expires_ms for name in names] == [60_000, 60_000]
    await c.disconnect(properties=Properties(session_expiry_interval=600))
    assert [queues[name].expires_ms for name in names] == [600_000, 600_000]
    back = gw.client()
    assert (await back.connect("dev", clean_start=False)).session_present is True


async def test_resuming_with_expiry_0_gets_the_queued_messages_and_ends_the_session(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe("last/call")
    await c.disconnect()
    pub = await gw.connected("pub")
    await pub.publish("last/call", b"waiting")
    once = gw.client()
    assert (await once.connect("dev", clean_start=False)).session_present is True
    assert (await once.message()).payload == b"waiting"
    await once.disconnect()
    await eventually(lambda: not gw.queues(convert.subscription_queue("dev", "last/call")), "the queue dropped")
    again = gw.client()
    assert (await again.connect("dev", clean_start=False)).session_present is False


async def test_the_session_record_keeps_the_subscriptions_and_their_options(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("opts", 2, no_local=True, retain_as_published=True), sid=5)
    state = await gw.registry.open_session("dev")
    assert isinstance(state, SessionState)
    assert state.subscriptions["opts"].qos == 2
    assert (state.subscriptions["opts"].no_local, state.subscriptions["opts"].retain_as_published) == (True, True)
    assert state.subscriptions["opts"].subscription_id == 5
    assert state.user == ""
    assert SessionState.decode(state.encode()) == state


# ---------------------------------------------------------------------------------------------- wills


async def test_a_will_is_published_when_the_connection_ends_without_disconnect(gw: Gateway) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    c = await gw.connected("dev", will=Will("status/dev", b"offline", qos=1, properties=Properties(content_type="t")))
    await c.gone()
    will = await watcher.message()
    assert (will.topic, will.payload, will.properties.content_type) == ("status/dev", b"offline", "t")


async def test_a_will_with_retain_becomes_its_topics_retained_message(gw: Gateway) -> None:
    # [MQTT-3.1.2-17]: a will with Will Retain 1 is published as a retained message. It used to be delivered
    # only: a client subscribing afterwards saw the topic's older retained message ("online"), or none.
    pub, watcher = await gw.connected("pub"), await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    await pub.publish("status/dev", b"online", retain=True)
    assert (await watcher.message()).payload == b"online"
    c = await gw.connected("dev", will=Will("status/dev", b"offline", qos=1, retain=True))
    await c.gone()
    assert (await watcher.message()).payload == b"offline"  # routed with its retained copy, in one turn
    late = await gw.connected("late")
    await late.subscribe(Subscription("status/#", 1))
    got = await late.message()
    assert (got.topic, got.payload, got.retain) == ("status/dev", b"offline", True)
    await late.nothing()
    # An empty retained will clears it ([MQTT-3.3.1-6]); a will without retain leaves the retained message.
    plain = await gw.connected("plain", will=Will("status/other", b"gone", qos=1))
    await pub.publish("status/other", b"kept", retain=True, packet_id=2)
    await plain.gone()
    empty = await gw.connected("empty", will=Will("status/dev", b"", qos=1, retain=True))
    await empty.gone()
    assert sorted([(await watcher.message()).payload for _ in range(3)]) == [b"", b"gone", b"kept"]
    later = await gw.connected("later")
    await later.subscribe(Subscription("status/#", 1))
    got = await later.message()
    assert (got.topic, got.payload, got.retain) == ("status/other", b"kept", True)
    await later.nothing()


async def test_a_wills_message_expiry_counts_from_when_it_is_published(gw: Gateway) -> None:
    # 5.0, 3.1.3.2.4: the will's Message Expiry Interval is its lifetime once published. It used to count from
    # the CONNECT, so a will with a short expiry on a connection that lived longer was dropped as expired.
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    lifetime = Properties(message_expiry_interval=1)
    c = await gw.connected("dev", will=Will("status/dev", b"offline", qos=1, properties=lifetime))
    await asyncio.sleep(1.2)  # the connection outlives the will's expiry interval
    await c.gone()
    will = await watcher.message()
    assert (will.payload, will.properties.message_expiry_interval) == (b"offline", 1)


async def test_a_disconnect_discards_the_will_unless_its_reason_is_0x04(gw: Gateway) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    polite = await gw.connected("polite", will=Will("status/polite", b"never"))
    await polite.disconnect()
    # The core publishes a will as it closes the link: once polite's link is gone, its will would be routed.
    await eventually(lambda: not link_of(gw, "polite"), "the core closed polite's link")
    asked = await gw.connected("asked", will=Will("status/asked", b"sent anyway"))
    await asked.disconnect(0x04)
    assert (await watcher.message()).payload == b"sent anyway"
    pub = await gw.connected("pub")
    await pub.publish("status/marker", b"marker")
    assert (await watcher.message()).payload == b"marker"  # no second will before it


async def test_a_disconnect_setting_an_expiry_after_0_is_an_error_and_keeps_the_will(gw: Gateway) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    c = await gw.connected("dev", will=Will("status/dev", b"kept"))
    c.send(Disconnect(0, Properties(session_expiry_interval=60)))
    await c.ended()
    assert gw.counters.protocol_errors == 1
    assert (await watcher.message()).payload == b"kept"
    back = gw.client()
    assert (await back.connect("dev", clean_start=False)).session_present is False  # the expiry stayed 0


async def test_a_disconnect_that_ends_the_session_sends_its_delayed_will_at_once(gw: Gateway) -> None:
    """The will waits no longer than the session lasts (5.0, 3.1.3.2.2): a DISCONNECT 0x04 that sets the session
    expiry to 0 ends the session, and the will goes now, not after its delay."""
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    will = Will("status/dev", b"gone", properties=Properties(will_delay_interval=600))
    c = await gw.connected("dev", will=will, properties=persistent(300))
    c.send(Disconnect(0x04, Properties(session_expiry_interval=0)))
    await c.ended()
    assert (await watcher.message()).payload == b"gone"
    assert pending_wills(gw) == {}


async def test_a_disconnect_that_lengthens_the_session_lets_the_will_wait_its_own_delay(gw: Gateway) -> None:
    will = Will("status/dev", b"late", properties=Properties(will_delay_interval=600))
    c = await gw.connected("dev", will=will, properties=persistent(10))
    c.send(Disconnect(0x04, Properties(session_expiry_interval=3600)))
    await c.ended()
    key = convert.lock_queue("dev")
    await eventually(lambda: pending_wills(gw) == {key: (b"late", 600_000)}, "the will pending for its 600 s")


async def test_a_disconnect_setting_an_expiry_after_0_is_answered_with_a_protocol_error(gw: Gateway) -> None:
    c = await gw.connected("dev")
    c.send(Disconnect(0, Properties(session_expiry_interval=60)))
    await c.ended()
    assert [(type(p), getattr(p, "reason_code", None)) for p in c.packets] == [(Disconnect, rc.PROTOCOL_ERROR)]


async def test_a_delayed_will_waits_and_a_clean_start_publishes_it_at_once(gw: Gateway) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    will = Will("status/dev", b"late", properties=Properties(will_delay_interval=60))
    c = await gw.connected("dev", will=will, properties=persistent())
    key = convert.lock_queue("dev")
    assert pending_wills(gw) == {}
    await c.gone()
    # The core holds it for its delay, unpublished (the book hands a will either to the router or to itself).
    await eventually(lambda: pending_wills(gw) == {key: (b"late", 60_000)}, "the will pending for 60 s")
    await gw.connected("dev", clean_start=True)
    assert pending_wills(gw) == {}
    assert (await watcher.message()).payload == b"late"


async def test_a_connect_asks_the_core_about_wills_only_when_one_could_be_set_or_waiting(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean connect without a will, whose client id no node knows, costs no SET_WILL: no will could wait
    under its key. With a will, or once a session of that id was kept, it does (see the tests around)."""
    keeper = gw.core.node.broker.wills
    asked: list[str | None] = []
    set_will = keeper.set

    def counted(session: Any, key: str | None, *rest: Any, **options: Any) -> None:
        asked.append(key)
        set_will(session, key, *rest, **options)

    monkeypatch.setattr(keeper, "set", counted)
    plain = await gw.connected("plain")
    assert asked == []
    await gw.connected("said", will=Will("status/said", b"bye"))
    assert asked == [convert.lock_queue("said")]
    kept = await gw.connected("kept", properties=persistent())
    assert asked[1:] == [convert.lock_queue("kept")]
    await kept.gone()
    await gw.connected("kept", clean_start=True)  # its record is there: a will could be pending under its key
    assert asked[2:] == [convert.lock_queue("kept")]
    await gw.connected("plain")  # takes the session over from the first "plain": its lock was held
    assert asked[3:] == [convert.lock_queue("plain")]
    await plain.gone()


async def test_a_delayed_will_is_cancelled_by_a_reconnect(gw: Gateway) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    will = Will("status/dev", b"late", properties=Properties(will_delay_interval=60))
    c = await gw.connected("dev", will=will, properties=persistent())
    await c.gone()
    await eventually(lambda: pending_wills(gw) == {convert.lock_queue("dev"): (b"late", 60_000)}, "the will pending")
    back = await gw.connected("dev", clean_start=False, properties=persistent())
    assert pending_wills(gw) == {}  # cancelled as the CONNECT was answered, not published
    await back.disconnect()
    await eventually(lambda: not link_of(gw, "dev"), "the core closed the link")
    assert pending_wills(gw) == {}
    pub = await gw.connected("pub")
    await pub.publish("status/dev", b"marker")
    assert (await watcher.message()).payload == b"marker"  # the will was not published before it


async def test_a_silent_client_is_disconnected_after_its_keep_alive_and_its_will_sent(gw: Gateway) -> None:
    watcher = await gw.connected("watcher")
    await watcher.subscribe(Subscription("status/#", 1))
    c = await gw.connected("quiet", keep_alive=1, will=Will("status/quiet", b"timed out"))
    assert (await c.packet(Disconnect)).reason_code == 0x8D  # keep alive timeout
    await c.ended()
    assert (await watcher.message()).payload == b"timed out"


# ---------------------------------------------------------------------------------------------- permissions


def app_grants(*permissions: str, match: str = "allowed.#") -> list[PermissionEntry]:
    return [PermissionEntry(match, permission, ["app"]) for permission in permissions]


async def test_refused_publishes_get_0x87_in_v5_and_close_a_311_connection(tmp_path: Path) -> None:
    grants = app_grants("send", "consume", "createNonDurableQueue", "createAddress")
    async with gateway(tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants) as gw:
        login: dict[str, Any] = {"username": "alice", "password": b"a"}
        c = await gw.connected("c", **login)
        assert await c.publish("allowed/x", b"ok") == Puback(1)
        c.send(Publish("secret", b"no", 1, packet_id=2))
        refused = await c.packet(Puback)
        assert (refused.packet_id, refused.reason_code) == (2, rc.NOT_AUTHORIZED)
        c.send(Publish("secret", b"no", 2, packet_id=3))
        refused_rec = await c.packet(Pubrec)
        assert (refused_rec.packet_id, refused_rec.reason_code) == (3, rc.NOT_AUTHORIZED)
        await c.publish("secret", b"dropped", qos=0)  # only logged
        assert await c.publish("allowed/y", b"still connected", packet_id=4) == Puback(4)
        old = await gw.connected("old", V311, **login)
        old.send(Publish("secret", b"no", 1, packet_id=1))
        await old.ended()
        assert old.packets == []


@pytest.mark.parametrize("qos", [1, 2])
async def test_a_bad_publish_ends_the_connection_after_the_answers_of_the_publishes_before_it(
    gw: Gateway, qos: int
) -> None:
    """The core stored "good": without its PUBACK (PUBREC) the client sends it again, and its subscribers get it
    twice. The DISCONNECT used to go out at once."""
    sub = await gw.connected("sub")
    await sub.subscribe(Subscription("t", 1))
    c = await gw.connected("c")
    bad = Properties(payload_format_indicator=1)  # says UTF-8
    c.send(Publish("t", b"good", qos, packet_id=1), Publish("t", b"\xff\xfe", qos, packet_id=2, properties=bad))
    answer = await c.packet(Puback if qos == 1 else Pubrec)
    assert (answer.packet_id, answer.reason_code) == (1, 0)
    assert (await c.packet(Disconnect)).reason_code == rc.PAYLOAD_FORMAT_INVALID
    await c.ended()
    assert (await sub.message()).payload == b"good"


async def test_a_session_resumed_to_end_with_its_connection_stays_ended_after_a_pubrel(gw: Gateway) -> None:
    """A persistent session with a QoS 2 message awaiting its PUBREL, resumed by a connection whose session
    ends with it (no session expiry): the PUBREL saved the session record again, and the next connection
    found the session, its subscription included, brought back."""
    c = await gw.connected("dev", properties=persistent())
    await c.subscribe(Subscription("keep/+", 1))
    c.send(Publish("x2", b"once", 2, packet_id=11))
    assert (await c.packet(Pubrec)).packet_id == 11
    await c.gone()
    back = gw.client()
    await back.connect("dev", clean_start=False)  # session expiry 0: this session ends with this connection
    back.send(Pubrel(11))
    assert (await back.packet(Pubcomp)).packet_id == 11
    await back.disconnect()
    await settle()
    third = gw.client()
    assert not (await third.connect("dev", clean_start=False)).session_present
    assert gw.queues("$mqtt.session") == []


async def test_a_refused_retained_publish_retains_nothing(tmp_path: Path) -> None:
    """The retained store is written on the gateway's own link, which may do what the user may not: a user who
    may read ``secret`` but not publish there set its retained message all the same, and was told 0x87."""
    grants = app_grants("send", "consume", "createNonDurableQueue", "createAddress")
    grants += app_grants("consume", "createNonDurableQueue", "createAddress", match="secret.#")
    async with gateway(tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants) as gw:
        login: dict[str, Any] = {"username": "alice", "password": b"a"}
        c = await gw.connected("c", **login)
        c.send(Publish("secret/x", b"forged", 1, retain=True, packet_id=2))
        refused = await c.packet(Puback)
        assert (refused.packet_id, refused.reason_code) == (2, rc.NOT_AUTHORIZED)
        assert await c.publish("allowed/x", b"kept", retain=True, packet_id=3) == Puback(3)
        reader = await gw.connected("reader", **login)
        await reader.subscribe(Subscription("secret/x", 1), Subscription("allowed/x", 1))
        assert (await reader.message()).payload == b"kept"
        await reader.nothing()


async def test_refused_subscriptions_get_0x87_in_v5_and_0x80_in_311(tmp_path: Path) -> None:
    grants = app_grants("consume", "createNonDurableQueue", "createDurableQueue", "createAddress")
    async with gateway(tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants) as gw:
        login: dict[str, Any] = {"username": "alice", "password": b"a"}
        c = await gw.connected("c", **login)
        suback = await c.subscribe(Subscription("allowed/a", 1), Subscription("secret/a", 1), Subscription("#", 0))
        assert suback.reason_codes == (1, rc.NOT_AUTHORIZED, rc.NOT_AUTHORIZED)
        old = await gw.connected("old", V311, **login)
        assert (await old.subscribe(Subscription("secret/b", 0))).reason_codes == (0x80,)


# ---------------------------------------------------------------------------------------------- the end


async def test_a_gateway_shutting_down_tells_v5_clients(gw: Gateway) -> None:
    c = await gw.connected("c")
    c.session.shutdown()
    assert (await c.packet(Disconnect)).reason_code == rc.SERVER_SHUTTING_DOWN
    await c.ended()
    other = await gw.connected("other")
    other.session.shutdown(unavailable=True)
    assert (await other.packet(Disconnect)).reason_code == rc.SERVER_UNAVAILABLE
    await other.ended()
    assert other.packets == []


async def test_the_end_of_a_clean_session_drops_its_queues_and_lock(gw: Gateway) -> None:
    c = await gw.connected("short")
    await c.subscribe(Subscription("a", 1), Subscription("b", 2))
    assert len(gw.queues(convert.SUBSCRIPTION_PREFIX)) == 2
    assert gw.queues(convert.lock_queue("short"))
    await c.disconnect()
    await eventually(lambda: not gw.queues(convert.SUBSCRIPTION_PREFIX), "the subscription queues dropped")
    await eventually(lambda: not gw.queues(convert.lock_queue("short")), "the lock dropped")
    assert not gw.queues(convert.session_queue("short"))


async def test_eof_from_the_client_ends_the_session_and_later_bytes_are_ignored(gw: Gateway) -> None:
    c = await gw.connected("c")
    c.session.feed(b"")
    await c.ended()
    c.send(Pingreq())
    await c.nothing()


async def test_the_clients_receive_maximum_holds_messages_of_all_its_subscriptions_back(gw: Gateway) -> None:
    sub = gw.client()
    await sub.connect("slow", properties=Properties(receive_maximum=2))
    await sub.subscribe(Subscription("rm/1", 1), Subscription("rm/2", 2))
    pub = await gw.connected("pub")
    for n, topic in enumerate(("rm/1", "rm/2", "rm/1", "rm/2")):
        await pub.publish(topic, str(n).encode(), packet_id=n + 1)
    first, second = await sub.packet(Publish), await sub.packet(Publish)
    # Two in flight: the others wait, parked in the session (each queue's window is 2) or in the core.
    queues = [gw.core.node.broker.queues[name] for name in gw.queues(convert.SUBSCRIPTION_PREFIX)]
    await eventually(lambda: sum(q.in_flight for q in queues) == 4, "all four delivered to the gateway")
    await sub.nothing()
    for got in (first, second):
        assert got.packet_id is not None
        if got.qos == 1:
            sub.send(Puback(got.packet_id))
        else:
            sub.send(Pubrec(got.packet_id))
            assert await sub.packet(Pubrel) == Pubrel(got.packet_id)
            sub.send(Pubcomp(got.packet_id))
    rest = sorted([(await sub.message()).payload for _ in range(2)])
    assert sorted([first.payload, second.payload, *rest]) == [b"0", b"1", b"2", b"3"]


async def test_a_pubrec_refusing_a_message_ends_its_flow(gw: Gateway) -> None:
    sub = gw.client()
    await sub.connect("refuser", properties=Properties(receive_maximum=1))
    await sub.subscribe(Subscription("no/thanks", 2))
    pub = await gw.connected("pub")
    await pub.publish("no/thanks", b"refused", qos=2, packet_id=1)
    await pub.publish("no/thanks", b"next", qos=2, packet_id=2)
    refused = await sub.packet(Publish)
    assert refused.packet_id is not None
    assert refused.payload == b"refused"
    sub.send(Pubrec(refused.packet_id, 0x80))
    assert (await sub.message(2)).payload == b"next"  # the window is free again, nothing to release
    (name,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    queue = gw.core.node.broker.queues[name]
    await eventually(lambda: (len(queue), queue.in_flight) == (0, 0), "the refused message done in the core")
    await pub.publish("no/thanks", b"last", qos=2, packet_id=3)
    assert (await sub.message(2)).payload == b"last"  # the refused one did not come again


async def test_a_disconnect_with_the_expiry_in_force_changes_nothing(gw: Gateway) -> None:
    c = await gw.connected("dev", properties=persistent(60))
    await c.subscribe("same")
    await c.disconnect(properties=Properties(session_expiry_interval=60))
    queues = gw.core.node.broker.queues
    names = (convert.session_queue("dev"), convert.subscription_queue("dev", "same"))
    assert [queues[name].expires_ms for name in names] == [60_000, 60_000]
    assert (await gw.client().connect("dev", clean_start=False)).session_present is True


async def test_a_takeover_notice_in_the_lock_queue_ends_the_connection(gw: Gateway) -> None:
    c = await gw.connected("noticed")
    async with gw.core.admin() as admin:
        notice = new_message(
            convert.lock_queue("noticed"), b"", routing=RoutingType.ANYCAST, properties={"takeover": "another-node"}
        )
        await admin.publish(notice)
    assert (await c.packet(Disconnect)).reason_code == rc.SESSION_TAKEN_OVER
    await c.ended()
    assert gw.counters.takeovers == 1


async def test_a_session_still_held_past_the_takeover_timeout_refuses_the_newcomer(tmp_path: Path) -> None:
    async with gateway(tmp_path, takeover_timeout_ms=0) as gw:
        first = await gw.connected("busy")
        second = gw.client()
        assert (await second.connect("busy")).reason_code == rc.SERVER_BUSY
        await second.ended()
        old = gw.client(V311)
        assert (await old.connect("busy")).reason_code == 3
        # A round trip on first's link after the refusals: a takeover notice would have come before its answer.
        assert (await first.subscribe("still/mine")).reason_codes == (1,)
        assert not first.wire.closed


async def test_a_session_queue_without_its_record_is_a_new_session(gw: Gateway) -> None:
    async with gw.core.admin() as admin:
        await admin.create_queue(convert.session_queue("orphan"), routing_type=RoutingType.ANYCAST, durable=True)
    c = gw.client()
    assert (await c.connect("orphan", clean_start=False, properties=persistent())).session_present is False


async def test_an_unreadable_session_record_starts_an_empty_session(gw: Gateway) -> None:
    async with gw.core.admin() as admin:
        name = convert.session_queue("garbled")
        await admin.create_queue(name, routing_type=RoutingType.ANYCAST, durable=True, last_value_key="")
        await admin.publish(new_message(name, b"\xc1 not msgpack", routing=RoutingType.ANYCAST, durable=True))
    c = gw.client()
    assert (await c.connect("garbled", clean_start=False, properties=persistent())).reason_code == 0
    assert c.session.state.subscriptions == {}
    await c.subscribe("works")


async def test_a_subscription_whose_queue_the_core_deletes_ends_the_connection(gw: Gateway) -> None:
    c = await gw.connected("c")
    await c.subscribe(Subscription("doomed", 1))
    (name,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    broker = gw.core.node.broker
    broker.catalog.delete_queue(broker.queues[name], int(time.time() * 1000))
    assert (await c.packet(Disconnect)).reason_code == rc.UNSPECIFIED_ERROR
    await c.ended()


async def test_an_address_that_spells_no_topic_name_is_dead_lettered(gw: Gateway) -> None:
    c = await gw.connected("c")
    await c.subscribe(Subscription("odd/#", 1))
    async with gw.core.admin() as admin:
        for body in (b"no topic", b"fine"):
            address = "odd.a+b" if body == b"no topic" else "odd.ok"
            await admin.publish(new_message(address, body, routing=RoutingType.MULTICAST, durable=True))
    got = await c.message(1)
    assert (got.topic, got.payload) == ("odd/ok", b"fine")
    await c.nothing()
    (name,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    queue = gw.core.node.broker.queues[name]
    await eventually(lambda: len(queue) == 0 and queue.in_flight == 0, "the message rejected, not kept")
    dead = gw.core.node.broker.queues.get("DLQ")
    assert dead is not None
    assert [m[M_BODY] for m in dead.messages()] == [b"no topic"]


async def test_identity_as_user_name_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    async with gateway(tmp_path, use_identity_as_username=True) as gw:
        c = gw.client()
        connack = await c.connect("c", username="anyone", password=b"x")
        assert connack.reason_code == rc.NOT_AUTHORIZED
        assert connack.properties.reason_string == "a client certificate is required"


# ---------------------------------------------------------------------------------------------- QoS 0 fan-out


async def test_qos0_subscribers_of_one_filter_share_a_feed_each_message_once(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    first = await gw.connected("first")
    await first.subscribe(Subscription("news/#", 0))
    assert len(gw.feeds) == 0  # one subscriber: a queue of its own
    assert len(gw.queues(convert.SUBSCRIPTION_PREFIX)) == 1
    second = await gw.connected("second", V311)
    await second.subscribe(Subscription("news/#", 0))
    assert len(gw.feeds) == 1
    assert len(gw.queues(convert.FANOUT_PREFIX)) == 1
    for n in range(3):
        await pub.publish(f"news/{n}", str(n).encode(), qos=n % 2)
    for c in (first, second):
        assert [(m.topic, m.payload, m.qos) for m in [await c.message() for _ in range(3)]] == [
            (f"news/{n}", str(n).encode(), 0) for n in range(3)
        ]
        await c.nothing()
    # The first moved over to the feed: its own queue is gone.
    await eventually(lambda: not gw.queues(convert.SUBSCRIPTION_PREFIX), "the solo queue dropped")
    await pub.publish("news/late", b"late", qos=0)
    for c in (first, second):
        assert (await c.message()).payload == b"late"
        await c.nothing()
    assert gw.counters.messages_delivered == 8
    await first.unsubscribe("news/#")
    await pub.publish("news/after", b"after", qos=0)
    assert (await second.message()).payload == b"after"
    await first.nothing()  # a feed writes a batch to all its members at once: first's copy would be here
    await second.disconnect()
    await eventually(lambda: len(gw.feeds) == 0, "the feed retired with its last member")
    await eventually(lambda: not gw.queues(convert.FANOUT_PREFIX), "the feed's queue dropped")


async def test_a_solo_subscription_behind_its_feed_moves_over_without_a_gap(tmp_path: Path) -> None:
    """The first subscriber of a filter has a queue of its own; the second makes the feed, which may run ahead of
    it. The first moves over only once its own queue gave it everything the feed handed out: before, it moved
    after its next batch and dropped its queue with the messages between the two (seen as a block of 100-500
    QoS 0 messages missing for the early subscribers of a ten-subscriber fan-out, about one run in fifty)."""
    async with gateway(tmp_path, qos0_window=4) as gw:
        pub, first, second = await gw.connected("pub"), await gw.connected("first"), await gw.connected("second")
        await first.subscribe(Subscription("ahead/t", 0))
        await second.subscribe(Subscription("ahead/t", 0))
        assert len(gw.feeds) == 1
        assert len(gw.queues(convert.SUBSCRIPTION_PREFIX)) == 1  # the first's own
        first.wire.stall()  # it takes no more from its queue (a window of 4) while its client does not read
        sent = [str(n).encode() for n in range(10)]
        for body in sent:
            await pub.publish("ahead/t", body, qos=0)
        assert [(await second.message()).payload for _ in sent] == sent  # the feed is 10 messages on
        first.wire.drain()
        assert [(await first.message()).payload for _ in sent] == sent
        await first.nothing()
        await eventually(lambda: not gw.queues(convert.SUBSCRIPTION_PREFIX), "the first moved over to the feed")
        await pub.publish("ahead/t", b"after", qos=0)
        for c in (first, second):
            assert (await c.message()).payload == b"after"
            await c.nothing()


async def test_a_feed_writes_each_member_its_own_way(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        plain, rap, ids, own = [await gw.connected(n) for n in ("plain", "rap", "ids", "own")]
        small = await gw.connected("small", properties=Properties(maximum_packet_size=40))
        await plain.subscribe(Subscription("f/+", 0))
        await rap.subscribe(Subscription("f/+", 0, retain_as_published=True, retain_handling=2))
        await ids.subscribe(Subscription("f/+", 0), sid=4)
        await own.subscribe(Subscription("f/+", 0, no_local=True))
        await small.subscribe(Subscription("f/+", 0))
        assert len(gw.feeds) == 1
        assert not gw.queues(convert.SUBSCRIPTION_PREFIX)
        await own.publish("f/a", b"r" * 50, qos=0, retain=True)
        await own.publish("f/b", b"s", qos=1)
        expected: dict[Client, list[tuple[str, bool, tuple[int, ...]]]] = {
            plain: [("f/a", False, ()), ("f/b", False, ())],
            rap: [("f/a", True, ()), ("f/b", False, ())],
            ids: [("f/a", False, (4,)), ("f/b", False, (4,))],
            small: [("f/b", False, ())],
        }
        for c, messages in expected.items():
            got = [await c.message(0) for _ in messages]
            assert [(m.topic, m.retain, m.properties.subscription_identifiers) for m in got] == messages
            await c.nothing()
        await own.nothing()


async def test_a_feed_skips_a_member_that_falls_behind(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1, qos0_max_buffered_bytes=0) as gw:
        slow, quick, pub = await gw.connected("slow"), await gw.connected("quick"), await gw.connected("pub")
        for c in (slow, quick):
            await c.subscribe(Subscription("tick", 0))
        slow.wire.stall()
        for n in range(3):
            await pub.publish("tick", str(n).encode(), qos=0)
            assert (await quick.message()).payload == str(n).encode()
        slow.wire.drain()
        assert (await slow.message()).payload == b"0"  # written before it fell behind; the rest skipped
        await slow.nothing()
        assert gw.counters.qos0_dropped == 2
        await pub.publish("tick", b"again", qos=0)
        assert (await slow.message()).payload == b"again"


async def test_a_feed_member_subscribing_again_at_qos1_gets_a_queue_of_its_own(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        c, pub = await gw.connected("c"), await gw.connected("pub")
        await c.subscribe(Subscription("up", 0))
        assert len(gw.feeds) == 1
        await c.subscribe(Subscription("up", 1), packet_id=2)
        await eventually(lambda: len(gw.feeds) == 0, "the feed retired")
        assert len(gw.queues(convert.SUBSCRIPTION_PREFIX)) == 1
        await pub.publish("up", b"acknowledged")
        assert (await c.message(1)).payload == b"acknowledged"


async def test_a_qos0_subscription_of_its_own_asked_again_at_qos1_leaves_no_queue_behind(gw: Gateway) -> None:
    """A lone QoS 0 subscriber has a queue of its own; subscribing again at QoS 1 makes an acknowledged queue and
    deletes the first. Before, the first stayed bound, without a consumer, and kept a copy of every message
    until the connection ended."""
    c, pub = await gw.connected("c"), await gw.connected("pub")
    await c.subscribe(Subscription("lone", 0))
    (before,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    await c.subscribe(Subscription("lone", 1), packet_id=2)
    (after,) = gw.queues(convert.SUBSCRIPTION_PREFIX)
    assert after != before
    await pub.publish("lone", b"acknowledged")
    got = await c.message(1)
    assert got.payload == b"acknowledged"
    await c.nothing()
    assert gw.queues(convert.SUBSCRIPTION_PREFIX) == [after]


async def test_a_feed_whose_queue_the_core_deletes_ends_its_members_connections(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        a, b = await gw.connected("a"), await gw.connected("b")
        for c in (a, b):
            await c.subscribe(Subscription("lost", 0))
        (name,) = gw.queues(convert.FANOUT_PREFIX)
        broker = gw.core.node.broker
        broker.catalog.delete_queue(broker.queues[name], int(time.time() * 1000))
        for c in (a, b):
            assert (await c.packet(Disconnect)).reason_code == rc.SERVER_UNAVAILABLE
            await c.ended()
        assert len(gw.feeds) == 0
        # A new subscriber makes a new feed.
        c, pub = await gw.connected("c"), await gw.connected("pub")
        await c.subscribe(Subscription("lost", 0))
        await pub.publish("lost", b"found", qos=0)
        assert (await c.message()).payload == b"found"


async def test_a_feed_the_core_refuses_refuses_the_subscription(tmp_path: Path) -> None:
    grants = app_grants("send", "consume", "createNonDurableQueue", "createAddress")
    async with gateway(
        tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants, qos0_fan_out_from=1
    ) as gw:
        c = await gw.connected("c", username="alice", password=b"a")
        suback = await c.subscribe(Subscription("secret/x", 0), Subscription("allowed/x", 0))
        assert suback.reason_codes == (rc.NOT_AUTHORIZED, 0)
        assert len(gw.feeds) == 1
        await c.publish("allowed/x", b"in", qos=0)
        assert (await c.message()).payload == b"in"


async def test_an_address_that_spells_no_topic_name_is_skipped_by_a_feed(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        c = await gw.connected("c")
        await c.subscribe(Subscription("odd/#", 0))
        async with gw.core.admin() as admin:
            await admin.publish(new_message("odd.a+b", b"no topic", routing=RoutingType.MULTICAST))
            await admin.publish(new_message("odd.ok", b"fine", routing=RoutingType.MULTICAST))
        assert (await c.message(0)).payload == b"fine"
        await c.nothing()


async def test_a_session_expires_its_expiry_after_the_connection_ends(gw: Gateway) -> None:
    c = await gw.connected("brief", properties=persistent(1))
    await c.subscribe("brief/t")
    session_queue = gw.core.node.broker.queues[convert.session_queue("brief")]
    assert session_queue.expires_ms == 1000
    await c.disconnect()
    await eventually(lambda: not gw.queues(convert.session_queue("brief")), "the session expired", timeout=5)
    await eventually(lambda: not gw.queues(convert.subscription_queue("brief", "brief/t")), "its queue expired")
    back = gw.client()
    assert (await back.connect("brief", clean_start=False, properties=persistent(1))).session_present is False


async def test_retained_messages_keep_their_expiry_and_get_the_subscription_identifier(gw: Gateway) -> None:
    pub = await gw.connected("pub")
    await pub.publish("kept/x", b"v", retain=True, properties=Properties(message_expiry_interval=100))
    c = await gw.connected("c")
    await c.subscribe(Subscription("kept/#", 1), sid=12)
    got = await c.message(1)
    assert (got.retain, got.properties.subscription_identifiers) == (True, (12,))
    assert got.properties.message_expiry_interval in (99, 100)


async def test_a_client_asking_for_no_problem_information_gets_no_reason_strings(tmp_path: Path) -> None:
    grants = app_grants("send")
    async with gateway(tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants) as gw:
        login: dict[str, Any] = {"username": "alice", "password": b"a"}
        told = await gw.connected("told", **login)
        told.send(Publish("secret", b"", 1, packet_id=1))
        assert (await told.packet(Puback)).properties.reason_string is not None
        quiet = await gw.connected("quiet", properties=Properties(request_problem_information=False), **login)
        quiet.send(Publish("secret", b"", 1, packet_id=1))
        assert await quiet.packet(Puback) == Puback(1, rc.NOT_AUTHORIZED)


async def test_a_message_larger_than_the_core_takes_is_refused(tmp_path: Path) -> None:
    async with gateway(tmp_path, max_packet_bytes=12 * 1024 * 1024) as gw:
        sub, pub = await gw.connected("sub"), await gw.connected("pub")
        await sub.subscribe("big")
        huge = b"h" * (9 * 1024 * 1024)
        pub.send(Publish("big", huge, 1, packet_id=1))
        refused = await pub.packet(Puback)
        assert (refused.packet_id, refused.reason_code) == (1, rc.QUOTA_EXCEEDED)
        await pub.publish("big", huge, qos=0)  # dropped, logged
        await pub.publish("big", b"small", packet_id=2)
        assert (await sub.message()).payload == b"small"
        await sub.nothing()
        old = await gw.connected("old", V311)
        old.send(Publish("big", huge, 1, packet_id=1))
        await old.ended()
        assert old.packets == []


async def test_a_link_the_core_closes_ends_the_connection_as_unavailable(gw: Gateway) -> None:
    c = await gw.connected("victim")
    node = gw.core.node
    (conn_id,) = [cid for cid, s in node.broker.sessions.items() if s.client_name.startswith("mqtt victim ")]
    node.close_link(conn_id, ErrorCode.CLOSED_BY_OPERATOR, "closed by a test")
    assert (await c.packet(Disconnect)).reason_code == rc.SERVER_UNAVAILABLE
    await c.ended()


async def test_a_will_the_user_may_not_publish_refuses_the_connect(tmp_path: Path) -> None:
    grants = app_grants("send", "createAddress")
    async with gateway(tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants) as gw:
        c = gw.client()
        connack = await c.connect("c", username="alice", password=b"a", will=Will("secret/will", b"x"))
        assert connack.reason_code == rc.NOT_AUTHORIZED
        await c.ended()
        ok = gw.client()
        connack = await ok.connect("c", username="alice", password=b"a", will=Will("allowed/will", b"x"))
        assert connack.reason_code == 0


async def subscribed_after_a_retained_will(gw: Gateway, login: dict[str, Any]) -> Client:
    """A client with a retained will on allowed/will goes (a watcher gets the will); then a client subscribes to
    allowed/#, and is returned."""
    c = await gw.connected("c", will=Will("allowed/will", b"bye", qos=1, retain=True), **login)
    watcher = await gw.connected("w", **login)
    await watcher.subscribe(Subscription("allowed/#", 1))
    await c.gone()
    assert (await watcher.message()).payload == b"bye"
    late = await gw.connected("late", **login)
    await late.subscribe(Subscription("allowed/#", 1))
    return late


async def test_a_retained_will_needs_the_right_to_publish_it_and_none_on_the_retained_store(tmp_path: Path) -> None:
    # The core writes a will's retained copy with the gateway's rights, as the gateway writes a retained
    # PUBLISH's: alice may send to her topic, and has (and needs) no right on the gateway's own addresses.
    grants = app_grants("send", "consume", "createNonDurableQueue", "createAddress")
    async with gateway(tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants) as gw:
        login: dict[str, Any] = {"username": "alice", "password": b"a"}
        late = await subscribed_after_a_retained_will(gw, login)
        got = await late.message()
        assert (got.topic, got.payload, got.retain) == ("allowed/will", b"bye", True)
        refused = gw.client()
        connack = await refused.connect("r", will=Will("secret/will", b"x", retain=True), **login)
        assert connack.reason_code == rc.NOT_AUTHORIZED


async def test_a_retained_will_on_a_link_of_its_own_is_published_unretained(tmp_path: Path) -> None:
    # Without shared links a session's link has only its user's rights, none on the retained store: the core
    # refuses the retained copy, and the gateway sets the will without it rather than refuse the CONNECT.
    grants = app_grants("send", "consume", "createNonDurableQueue", "createAddress")
    users = [UserEntry("alice", "a", ["app"])]
    async with gateway(tmp_path, users=users, permissions=grants, shared_links=0) as gw:
        late = await subscribed_after_a_retained_will(gw, {"username": "alice", "password": b"a"})
        await late.handled_in_order()


async def test_a_client_that_leaves_before_its_connack_gets_nothing(gw: Gateway) -> None:
    c = gw.client()
    c.send(Connect("leaver"))
    c.session.feed(b"")  # EOF while the core is asked
    await c.ended()
    assert c.packets == []
    await eventually(lambda: not gw.queues(convert.lock_queue("leaver")), "the lock released")


async def test_a_subscription_queue_no_session_record_lists_starts_empty(gw: Gateway) -> None:
    async with gw.core.admin() as admin:
        queue = convert.subscription_queue("fresh", "left/over")
        await admin.create_queue(queue, "left.over", routing_type=RoutingType.MULTICAST, durable=True)
        await admin.publish(new_message("left.over", b"stale", routing=RoutingType.MULTICAST, durable=True))
    assert len(gw.core.node.broker.queues[queue]) == 1
    c = await gw.connected("fresh", properties=persistent())
    await c.subscribe("left/over")
    await c.nothing()  # not what the queue gathered before this session
    pub = await gw.connected("pub")
    await pub.publish("left/over", b"new")
    assert (await c.message()).payload == b"new"


async def test_losing_the_service_link_ends_every_session_and_it_opens_again(gw: Gateway) -> None:
    a, b = await gw.connected("a"), await gw.connected("b", V311)
    node = gw.core.node
    (conn_id,) = [cid for cid, s in node.broker.sessions.items() if s.client_name.startswith("mqtt gateway ")]
    node.close_link(conn_id, ErrorCode.CLOSED_BY_OPERATOR, "closed by a test")
    assert (await a.packet(Disconnect)).reason_code == rc.SERVER_UNAVAILABLE
    await a.ended()
    await b.ended()
    assert b.packets == []
    again = gw.client()
    assert (await again.connect("a")).reason_code == 0


async def test_fan_outs_of_one_user_share_its_link_and_a_refused_one_leaves_the_others(tmp_path: Path) -> None:
    grants = [
        *app_grants("send", "consume", "createNonDurableQueue", "createAddress"),
        *app_grants("createNonDurableQueue", "createAddress", match="half.#"),  # may make, not consume
    ]
    async with gateway(
        tmp_path, users=[UserEntry("alice", "a", ["app"])], permissions=grants, qos0_fan_out_from=1
    ) as gw:
        c = await gw.connected("c", username="alice", password=b"a")
        suback = await c.subscribe(
            Subscription("allowed/#", 0), Subscription("allowed/x/+", 0), Subscription("half/x", 0)
        )
        assert suback.reason_codes == (0, 0, rc.NOT_AUTHORIZED)
        assert len(gw.feeds) == 2
        await eventually(lambda: len(gw.queues(convert.FANOUT_PREFIX)) == 2, "the refused feed's queue dropped")
        sessions = gw.core.node.broker.sessions.values()
        assert len([s for s in sessions if s.client_name.startswith("mqtt fan-out ")]) == 1
        await c.publish("allowed/x/y", b"both", qos=0)
        await c.publish("allowed/x/z", b"marker", qos=0)
        # Each feed's marker comes after its copy of the first: no third copy of it before them.
        assert sorted([(await c.message()).payload for _ in range(4)]) == [b"both", b"both", b"marker", b"marker"]


async def test_a_fan_out_link_the_core_closes_ends_its_members_connections(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        a, b = await gw.connected("a"), await gw.connected("b")
        await a.subscribe(Subscription("x", 0))
        await b.subscribe(Subscription("y/#", 0))
        node = gw.core.node
        (conn_id,) = [cid for cid, s in node.broker.sessions.items() if s.client_name.startswith("mqtt fan-out ")]
        node.close_link(conn_id, ErrorCode.CLOSED_BY_OPERATOR, "closed by a test")
        for c in (a, b):
            assert (await c.packet(Disconnect)).reason_code == rc.SERVER_UNAVAILABLE
            await c.ended()
        assert len(gw.feeds) == 0


async def test_a_fan_out_of_a_filter_starting_with_a_wildcard_skips_dollar_topics(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        c, pub = await gw.connected("c"), await gw.connected("pub")
        await c.subscribe(Subscription("+/x", 0))
        await pub.publish("$app/x", b"hidden", qos=0)
        await pub.publish("app/x", b"seen", qos=0)
        assert (await c.message()).payload == b"seen"
        await c.nothing()


async def test_stopped_feeds_let_go_of_their_queues_and_new_subscriptions_take_their_own(tmp_path: Path) -> None:
    async with gateway(tmp_path, qos0_fan_out_from=1) as gw:
        c = await gw.connected("c")
        await c.subscribe(Subscription("s", 0))
        assert len(gw.queues(convert.FANOUT_PREFIX)) == 1
        await gw.feeds.stop()
        assert len(gw.feeds) == 0
        await eventually(lambda: not gw.queues(convert.FANOUT_PREFIX), "the feed's queue dropped with its link")
        other = await gw.connected("other")
        await other.subscribe(Subscription("s", 0))
        assert len(gw.queues(convert.SUBSCRIPTION_PREFIX)) == 1


async def test_a_persistent_session_taken_over_is_resumed_by_the_newcomer(gw: Gateway) -> None:
    first = await gw.connected("dev", properties=persistent())
    await first.subscribe(Subscription("orders/+", 1))
    second = gw.client()
    assert (await second.connect("dev", clean_start=False, properties=persistent())).session_present is True
    assert (await first.packet(Disconnect)).reason_code == rc.SESSION_TAKEN_OVER
    await first.ended()
    pub = await gw.connected("pub")
    await pub.publish("orders/1", b"to the newcomer")
    assert (await second.message(1)).payload == b"to the newcomer"
    await first.nothing()


async def test_a_client_that_does_not_read_still_has_its_packets_handled(gw: Gateway) -> None:
    """A one-thread client publishes a burst before it reads, while its subscription fills its socket: the
    gateway goes on handling its packets (it would otherwise wait for the client to read, and the client for the
    gateway to read its burst: a deadlock); its deliveries wait for the socket."""
    c, producer, reader = await gw.connected("c"), await gw.connected("producer"), await gw.connected("reader")
    await c.subscribe("mine")
    await reader.subscribe(Subscription("burst", 0))
    c.wire.stall()
    for n in range(3):
        await producer.publish("mine", b"for c %d" % n)
    for n in range(5):
        c.send(Publish("burst", b"%d" % n, 1, packet_id=n + 1))
    assert [(await reader.packet(Publish)).payload for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]
    c.wire.drain()
    got = await c.packets_of_any_kind(8)
    assert [p.packet_id for p in got if isinstance(p, Puback)] == [1, 2, 3, 4, 5]
    assert [p.payload for p in got if isinstance(p, Publish)] == [b"for c 0", b"for c 1", b"for c 2"]


async def test_the_answers_waiting_for_a_client_that_does_not_read_are_bounded(tmp_path: Path) -> None:
    async with gateway(tmp_path, pending_bytes=1000) as gw:
        c, reader = await gw.connected("c"), await gw.connected("reader")
        await reader.subscribe(Subscription("bounded", 0))
        c.wire.stall()
        unknown = tuple(f"never/{n}" for n in range(100))
        for n in range(20):  # each UNSUBACK is over 100 bytes: after about ten, the gateway waits for the client
            c.send(Unsubscribe(n + 1, unknown), Publish("bounded", b"%d" % n))
            await settle()
        await settle()
        handled = bytes(reader.wire.out).count(b"bounded")
        assert 5 <= handled < 20
        assert len(c.wire.out) < 2000
        c.wire.drain()
        assert [(await c.packet(Unsuback)).packet_id for _ in range(20)] == list(range(1, 21))
        assert [int((await reader.packet(Publish)).payload) for _ in range(20)] == list(range(20))


async def test_the_pingresps_waiting_for_a_client_that_does_not_read_are_bounded(tmp_path: Path) -> None:
    """The codec answers a PINGREQ (or a PUBREC of an unknown packet id) by itself, without an event for the
    worker: a client that sent them without reading had every answer written, and reading never paused, so the
    gateway's buffer for it grew for as long as it kept sending."""
    async with gateway(tmp_path, pending_bytes=1000) as gw:
        c = await gw.connected("c")
        c.wire.stall()
        for n in range(2000):
            c.session.feed(encode(Pingreq(), V5) if n % 2 else encode(Pubrec(n // 2 + 1), V5))
            if c.wire.paused:
                break
            await asyncio.sleep(0)
        assert c.wire.paused
        assert len(c.wire.out) < 1000 + 100
        c.wire.drain()
        got = await c.packets_of_any_kind(n + 1)
        assert [type(p) for p in got] == [Pingresp if m % 2 else Pubrel for m in range(n + 1)]
        assert [p.packet_id for p in got if isinstance(p, Pubrel)] == [m // 2 + 1 for m in range(0, n + 1, 2)]
