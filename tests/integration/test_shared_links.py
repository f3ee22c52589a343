"""Sessions multiplexed over a gateway's shared link: a real core process, the real link client over real
sockets, and an MQTT gateway whose clients' sessions share its link.

Each session on a shared link keeps its own user (proved by password, or asserted by a link user listed in
``link.proxy_users``), its own permissions, credit and life: one that stalls, breaks or leaves disturbs no
other, and when the shared link dies each session fails over on its own.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import CoreProcess, start_core, start_gateway, stop_cleanly
from tests.integration.cluster_nodes import wait_until, wait_until_async
from tests.integration.mqtt_clients import Raw

from tridentmq_mqtt.protocol.packets import V311, Connack, Publish, Suback, Subscribe, Subscription
from tridentmq_shared.link import channels
from tridentmq_shared.link.channels import SharedLinks
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError, SharedLinksRefusedError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import new_message

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NO_RECONNECT = ReconnectPolicy(attempts=0)
ALL = (
    "send",
    "consume",
    "browse",
    "createAddress",
    "deleteAddress",
    "createDurableQueue",
    "deleteDurableQueue",
    "createNonDurableQueue",
    "deleteNonDurableQueue",
    "manage",
)


def _grant(match: str, role: str) -> str:
    return "".join(f'[[permissions]]\nmatch = "{match}"\npermission = "{p}"\nroles = ["{role}"]\n' for p in ALL)


CONFIG = (
    '[link]\nproxy_users = ["gw"]\n'
    '[[users]]\nname = "gw"\npassword = "gw-secret"\nroles = ["gateway"]\n'
    '[[users]]\nname = "alice"\npassword = "alice-pw"\nroles = ["a"]\n'
    '[[users]]\nname = "bob"\npassword = "bob-pw"\nroles = ["b"]\n'
    '[[users]]\nname = "mallory"\npassword = "mallory-pw"\nroles = ["b"]\n'
    + _grant("#", "gateway")
    + _grant("a.#", "a")
    + _grant("b.#", "b")
)


@pytest.fixture
def core(tmp_path: Path) -> Iterator[CoreProcess]:
    node = start_core(tmp_path, config=CONFIG)
    yield node
    assert node.stop() == 0, node.log()
    assert "Traceback" not in node.log(), node.log()


def _status(core: CoreProcess, path: str = "/api/status") -> Any:
    request = urllib.request.Request(core.management_url + path)
    request.add_header("Authorization", "Basic Z3c6Z3ctc2VjcmV0")  # gw:gw-secret, who may manage
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def _queue(core: CoreProcess, name: str) -> dict[str, Any]:
    return {q["name"]: q for q in _status(core, "/api/queues")}.get(name, {})


def _shared(user: str, password: str) -> SharedLinks:
    return SharedLinks(per_node=1, user=user, password=password, name="test gateway")


def _session(
    core: CoreProcess, shared: SharedLinks, *, reconnect: ReconnectPolicy = NO_RECONNECT, **login: str
) -> LinkClient:
    return LinkClient(
        "127.0.0.1", core.link_port, channels=shared, reconnect=reconnect, client_host="127.0.0.1", **login
    )  # type: ignore[arg-type]


async def test_sessions_share_one_link_each_with_its_own_users_permissions(core: CoreProcess) -> None:
    shared = _shared("gw", "gw-secret")
    links_before = _status(core)["links"]
    alice = _session(core, shared, user="gw", password="gw-secret", acting_for="alice")  # asserted by gw
    bob = _session(core, shared, user="bob", password="bob-pw")  # proved by its own password
    try:
        await alice.connect()
        await bob.connect()
        assert len(shared.carriers) == 1
        assert _status(core)["links"] == links_before + 1  # one connection for the gateway's link and both
        users = sorted(c["user"] for c in _status(core, "/api/connections"))
        assert users == ["alice", "bob", "gw"]
        await alice.publish(new_message("a.orders", b"from alice"))
        await bob.publish(new_message("b.orders", b"from bob"))
        # The core enforces each session's user, never the gateway's (which may do anything).
        with pytest.raises(LinkRequestError) as refused:
            await alice.publish(new_message("b.orders", b"not hers"))
        assert refused.value.code == ErrorCode.FORBIDDEN
        with pytest.raises(LinkRequestError) as refused:
            await bob.subscribe("a.orders")
        assert refused.value.code == ErrorCode.FORBIDDEN
        consumer = await alice.subscribe("a.orders")
        delivery = await consumer.get(timeout=10)
        assert delivery is not None
        assert delivery.body == b"from alice"
        consumer.ack(delivery)
    finally:
        await alice.close()
        await bob.close()
        await shared.close()


async def test_a_link_user_not_in_proxy_users_cannot_assert_users(core: CoreProcess) -> None:
    shared = _shared("mallory", "mallory-pw")
    claimed = _session(core, shared, user="mallory", password="mallory-pw", acting_for="alice")
    wrong = _session(core, shared, user="alice", password="not-hers")
    own = _session(core, shared, user="mallory", password="mallory-pw")
    try:
        with pytest.raises(LinkClosedError) as refused:
            await claimed.connect()
        assert refused.value.code == ErrorCode.UNAUTHENTICATED
        assert "link.proxy_users" in refused.value.text
        with pytest.raises(LinkClosedError) as refused:
            await wrong.connect()
        assert refused.value.code == ErrorCode.UNAUTHENTICATED
        # The refusals ended those sessions, not the link: a session with its own password still opens on it.
        await own.connect()
        assert [c.alive for c in shared.carriers] == [True]
        await own.publish(new_message("b.mallory", b"hers"))
        with pytest.raises(LinkRequestError) as forbidden:
            await own.publish(new_message("a.orders", b"alice's"))
        assert forbidden.value.code == ErrorCode.FORBIDDEN
    finally:
        for session in (claimed, wrong, own):
            await session.close()
        await shared.close()
    assert "user mallory may not open links for other users" in core.log()


async def test_one_misbehaving_session_disturbs_no_other_on_its_link(core: CoreProcess) -> None:
    shared = _shared("gw", "gw-secret")
    stalled, broken, leaving, worker = sessions = [
        _session(core, shared, user="gw", password="gw-secret", acting_for="alice") for _ in range(4)
    ]
    try:
        for session in sessions:
            await session.connect()
        assert len(shared.carriers) == 1
        # A consumer that takes nothing: the core stops at its window; the rest stays queued.
        slow = await stalled.subscribe("a.stalled", credit=10)
        for n in range(100):
            await worker.publish(new_message("a.stalled", str(n).encode()))
        wait_until(lambda: _queue(core, "a.stalled").get("in_flight") == 10, what="the stalled window to fill")
        # A session that sends garbage on its channel is closed by the core, alone.
        ended: list[LinkRequestError] = []
        broken.on_closed = ended.append
        assert broken._protocol is not None
        assert broken._protocol.transport is not None
        broken._protocol.transport.write(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # a frame msgpack cannot decode
        await wait_until_async(lambda: bool(ended), what="the broken session to be closed")
        assert ended[0].code == ErrorCode.MALFORMED
        await leaving.close()
        # Meanwhile the worker's own traffic on the same link flows in full.
        consumer = await worker.subscribe("a.work", credit=50)
        for n in range(500):
            await worker.publish(new_message("a.work", str(n).encode()))
        got = []
        while len(got) < 500:
            delivery = await consumer.get(timeout=10)
            assert delivery is not None, f"only {len(got)} of 500 delivered"
            consumer.ack(delivery)
            got.append(int(delivery.body))
        assert got == list(range(500))
        assert [c.alive for c in shared.carriers] == [True]
        # The stalled consumer still gets every one of its messages, in order, once it reads.
        bodies = []
        while len(bodies) < 100:
            delivery = await slow.get(timeout=10)
            assert delivery is not None
            slow.ack(delivery)
            bodies.append(int(delivery.body))
        assert bodies == list(range(100))
    finally:
        for session in sessions:
            await session.close()
        await shared.close()
    assert "link closed on protocol error" in core.log()


async def test_sessions_of_a_lost_shared_link_fail_over_each_on_its_own(core: CoreProcess) -> None:
    shared = _shared("gw", "gw-secret")
    again = ReconnectPolicy(retry_interval=0.05, attempts=20)
    sessions = [
        _session(core, shared, reconnect=again, user="gw", password="gw-secret", acting_for="alice") for _ in range(3)
    ]
    try:
        consumers = []
        for n, session in enumerate(sessions):
            await session.connect()
            consumers.append(await session.subscribe(f"a.failover.{n}", credit=10))
        (first,) = shared.carriers
        assert first.client._protocol is not None
        assert first.client._protocol.transport is not None
        first.client._protocol.transport.abort()  # the shared link dies under its three sessions
        for n, session in enumerate(sessions):
            await session.publish(new_message(f"a.failover.{n}", f"after {n}".encode()))  # waits for the resume
        for n, consumer in enumerate(consumers):
            delivery = await consumer.get(timeout=10)
            assert delivery is not None
            assert delivery.body == f"after {n}".encode()
            consumer.ack(delivery)
        assert [s.failovers for s in sessions] == [1, 1, 1]
        (second,) = shared.carriers  # all three resumed over one new shared link
        assert second is not first
        assert second.alive
    finally:
        for session in sessions:
            await session.close()
        await shared.close()


async def test_a_session_that_gives_up_on_a_frozen_core_leaves_the_others_waiting(core: CoreProcess) -> None:
    """While the core is frozen, two sessions wait for the same new shared link, and the first to ask gives up
    (its client left). The other gets its channel once the core is back. Before, the first to ask owned the
    shared link's connect: cancelling it cancelled every session waiting with it, and a session's resume
    cancelled so ended without a word, its link down for good ("not connected" to every request after)."""
    shared = _shared("gw", "gw-secret")
    core.process.send_signal(signal.SIGSTOP)
    try:
        leaving = asyncio.create_task(shared.open("127.0.0.1", core.link_port, asyncio.Protocol))
        await asyncio.sleep(0.2)
        staying = asyncio.create_task(shared.open("127.0.0.1", core.link_port, asyncio.Protocol))
        await asyncio.sleep(0.2)
        leaving.cancel()
        await asyncio.sleep(0.2)
        assert not staying.done(), staying
    finally:
        core.process.send_signal(signal.SIGCONT)
    try:
        transport, _ = await asyncio.wait_for(staying, 15)
        (carrier,) = shared.carriers
        assert carrier.alive
        transport.close()
    finally:
        await shared.close()


async def test_a_refused_gateway_user_is_tried_again_without_holding_up_a_client_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core refuses a login after a delay that grows with the failures from its address, up to longer than
    a link's connect timeout. A gateway whose own user was refused tried its shared link again within a
    client's login, every 30 s: that login then timed out ("cannot connect"), a client refused for nothing."""
    config = CONFIG + "[login]\nfailure_delay_ms = 100\nmax_failure_delay_ms = 3000\n"
    node = start_core(tmp_path, config=config)
    shared = SharedLinks(per_node=1, user="gw", password="wrong", name="test gateway", connect_timeout=1.0)
    monkeypatch.setattr(channels, "REFUSED_RETRY_SECONDS", 0.0)  # each refusal's time is up at once
    try:
        with pytest.raises(SharedLinksRefusedError):  # refused after 0.1 s
            await shared.open("127.0.0.1", node.link_port, asyncio.Protocol)
        for _ in range(5):  # the address's backoff grows to its 3 s cap, beyond the connect timeout
            with pytest.raises(LinkRequestError):
                await LinkClient(
                    "127.0.0.1", node.link_port, user="gw", password="wrong", reconnect=NO_RECONNECT
                ).connect()
        with pytest.raises(SharedLinksRefusedError):  # at once: the client's own link is next
            await shared.open("127.0.0.1", node.link_port, asyncio.Protocol)
        alice = LinkClient("127.0.0.1", node.link_port, user="alice", password="alice-pw", reconnect=NO_RECONNECT)
        await alice.connect()  # its own link, while the gateway's try waits for its refusal
        await alice.close()
    finally:
        await shared.close()
        assert node.stop() == 0, node.log()
    assert "Traceback" not in node.log(), node.log()


class _StrayCancellation:
    """Opens channels through real shared links; once armed, the next open ends with a CancelledError that no
    cancel() of the caller raised (as a shared connect cancelled by another session used to)."""

    def __init__(self, shared: SharedLinks) -> None:
        self.shared = shared
        self.armed = False

    def open_now(self, host: str, port: int, protocol_factory: Any) -> None:
        return None  # every open goes through ``open``, where the cancellation is

    async def open(self, host: str, port: int, protocol_factory: Any) -> Any:
        if self.armed:
            self.armed = False
            raise asyncio.CancelledError
        return await self.shared.open(host, port, protocol_factory)


async def test_a_resume_ended_by_a_stray_cancellation_ends_the_link_for_its_owner(core: CoreProcess) -> None:
    """A resume that ends with a CancelledError no cancel() raised must not leave its link down in silence
    (neither open nor resuming, its owner never told): the link ends, with its reason."""
    shared = _shared("gw", "gw-secret")
    opener = _StrayCancellation(shared)
    again = ReconnectPolicy(retry_interval=0.05, max_interval=0.2)
    session = LinkClient(
        "127.0.0.1",
        core.link_port,
        channels=opener,
        reconnect=again,
        client_host="127.0.0.1",
        user="gw",
        password="gw-secret",
        acting_for="alice",
    )
    ended: list[LinkRequestError] = []
    session.on_closed = ended.append
    try:
        await session.connect()
        (carrier,) = shared.carriers
        assert carrier.client._protocol is not None
        assert carrier.client._protocol.transport is not None
        opener.armed = True
        carrier.client._protocol.transport.abort()
        await wait_until_async(lambda: bool(ended), 5, "the link to end")
        assert "resume was cancelled" in ended[0].text
        assert not session.connected
        with pytest.raises(LinkClosedError, match="resume was cancelled"):
            await session.create_queue("a.after", durable=False)
    finally:
        await session.close()
        await shared.close()


def test_mqtt_clients_of_a_gateway_share_its_core_link(tmp_path: Path, core: CoreProcess) -> None:
    links_before = _status(core)["links"]
    gateway = start_gateway(
        tmp_path, core, "mqtt", TRIDENTMQ_MQTT_CORE_USER="gw", TRIDENTMQ_MQTT_CORE_PASSWORD="gw-secret"
    )
    clients: list[Raw] = []
    try:
        for n in range(40):
            client = Raw(gateway.port, V311)
            clients.append(client)
            user = ("alice", "alice-pw") if n % 2 == 0 else ("bob", "bob-pw")
            connack = client.connect(f"device-{n}", username=user[0], password=user[1].encode())
            assert isinstance(connack, Connack)
            assert connack.reason_code == 0
            client.send(Subscribe(1, (Subscription(f"{'a' if n % 2 == 0 else 'b'}/device/{n}", 1),)))
            suback = client.next()
            assert isinstance(suback, Suback)
            assert suback.reason_codes == (1,)
        # 40 sessions, and the gateway's links: the shared one and its readiness link.
        assert _status(core)["links"] <= links_before + 3
        sessions = [c for c in _status(core, "/api/connections") if c["client_name"].startswith("mqtt")]
        assert len(sessions) >= 40
        publisher = clients[0]
        for n in range(0, 40, 2):  # alice may publish to her own devices only
            publisher.send(Publish(f"a/device/{n}", f"hello {n}".encode(), qos=0))
        for n in range(0, 40, 2):
            message = clients[n].next() if n else _next_publish(clients[0])
            assert isinstance(message, Publish)
            assert message.payload == f"hello {n}".encode()
    finally:
        for client in clients:
            client.sock.close()
        stop_cleanly(gateway)


def _next_publish(client: Raw) -> Any:
    while not isinstance(packet := client.next(), Publish):
        pass
    return packet
