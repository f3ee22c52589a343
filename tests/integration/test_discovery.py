"""Redis discovery against real redis-server processes: joining, leaving, expiry, outages and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping

import orjson
import pytest
from redis.asyncio import Redis
from tests.redis_server import RedisServer, redis_server

from tridentmq_core.cluster.discovery import _MAX_BACKOFF, LEAVE, MAX_MEMBERS, Announcement, RedisDiscovery

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

LOGGER = "tridentmq.core.discovery"
CLUSTER = "alpha"
PERIOD = 0.1
REFRESH = 1.0
DEADLINE = 10.0  # generous for a loaded machine; the assertions below expect things much sooner

_ports = itertools.count(31000)  # announced, never bound: discovery does not connect to the nodes


def announcement(
    name: str, *, cluster: str = CLUSTER, node_id: str | None = None, port: int | None = None
) -> Announcement:
    return Announcement(
        cluster=cluster, node_id=node_id or str(uuid.uuid4()), name=name, host="127.0.0.1", port=port or next(_ports)
    )


def key(a: Announcement) -> str:
    return f"tridentmq:{a.cluster}:node:{a.node_id}"


def channel(cluster: str = CLUSTER) -> str:
    return f"tridentmq:{cluster}:announce"


async def until(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> float:
    """Poll until ``predicate`` holds; returns the seconds it took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def ignored(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "reason", "") for r in caplog.records if r.name == LOGGER and r.msg.endswith("ignored")]


class Changes:
    """Records every on_change call and when it came (``time.monotonic``)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Announcement]] = []
        self.times: list[float] = []

    def __call__(self, members: Mapping[str, Announcement]) -> None:
        self.calls.append(dict(members))
        self.times.append(time.monotonic())


NodeFactory = Callable[..., Awaitable[RedisDiscovery]]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def redis_down() -> Iterator[RedisServer]:
    """A port for a Redis that is not running yet."""
    with redis_server(start=False) as server:
        yield server


@pytest.fixture
async def raw(redis: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def nodes() -> AsyncIterator[NodeFactory]:
    started: list[RedisDiscovery] = []

    async def start(
        url: str,
        me: Announcement,
        *,
        refresh: float = REFRESH,
        on_change: Callable[[Mapping[str, Announcement]], None] | None = None,
    ) -> RedisDiscovery:
        node = RedisDiscovery(url, me, broadcast_period=PERIOD, refresh_timeout=refresh, on_change=on_change)
        started.append(node)
        await node.start()
        return node

    try:
        yield start
    finally:
        for node in started:
            await node.stop()


# ---------------------------------------------------------------------- Announcement


def test_announcement_round_trip() -> None:
    a = Announcement(
        cluster="c", node_id="id-1", name="n1", host="10.0.0.1", port=6000, role="backup", pair="g1", epoch=7
    )
    encoded = a.encode()
    assert orjson.loads(encoded)["v"] == 1
    assert Announcement.decode(encoded) == a
    assert Announcement.decode(encoded.decode()) == a
    minimal = Announcement.decode(b'{"v":1,"cluster":"c","node_id":"x","name":"","host":"h","port":1,"new":0}')
    assert (minimal.role, minimal.pair, minimal.epoch) == ("primary", "", 1)


GOOD = {"v": 1, "cluster": "c", "node_id": "x", "name": "n", "host": "h", "port": 5000}


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe\x00",
        b"not json",
        b"[]",
        b"null",
        b"42",
        b'"text"',
        b"{}",
        orjson.dumps({**GOOD, "v": 2}),
        orjson.dumps({**GOOD, "v": True}),
        orjson.dumps({k: v for k, v in GOOD.items() if k != "v"}),
        orjson.dumps({k: v for k, v in GOOD.items() if k != "host"}),
        orjson.dumps({**GOOD, "port": "5000"}),
        orjson.dumps({**GOOD, "port": True}),
        orjson.dumps({**GOOD, "port": 5000.0}),
        orjson.dumps({**GOOD, "port": 0}),
        orjson.dumps({**GOOD, "port": 65536}),
        orjson.dumps({**GOOD, "node_id": ""}),
        orjson.dumps({**GOOD, "node_id": None}),
        orjson.dumps({**GOOD, "cluster": ""}),
        orjson.dumps({**GOOD, "host": ""}),
        orjson.dumps({**GOOD, "name": 5}),
        orjson.dumps({**GOOD, "role": "leader"}),
        orjson.dumps({**GOOD, "pair": []}),
        orjson.dumps({**GOOD, "epoch": -1}),
        orjson.dumps({**GOOD, "epoch": 1.5}),
        orjson.dumps({**GOOD, "name": "x" * 5000}),  # oversize
        orjson.dumps({"v": 1, LEAVE: "x", "cluster": "c"}),
    ],
)
def test_announcement_rejects_malformed(data: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 (any message: the type is the contract)
        Announcement.decode(data)


def test_announcement_validates_construction() -> None:
    with pytest.raises(ValueError, match="port"):
        Announcement(cluster="c", node_id="x", name="n", host="h", port=0)
    with pytest.raises(ValueError, match="node_id"):
        Announcement(cluster="c", node_id="", name="n", host="h", port=1)


# ---------------------------------------------------------------------- discovery


async def test_nodes_of_one_cluster_discover_each_other(
    redis: RedisServer, nodes: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    changes = Changes()
    a = await nodes(redis.url, announcement("a"), on_change=changes)
    b = await nodes(redis.url, announcement("b"))
    other = await nodes(redis.url, announcement("other", cluster="beta"))
    took = await until(lambda: set(a.members) == {b.me.node_id} and set(b.members) == {a.me.node_id}, "discovery")
    assert took < DEADLINE
    assert a.members[b.me.node_id] == b.me
    assert b.members[a.me.node_id] == a.me
    assert a.connected
    assert b.connected
    assert changes.calls[-1] == {b.me.node_id: b.me}
    await until(lambda: other.connected, "the other cluster connected")
    await asyncio.sleep(5 * PERIOD)  # several rounds of announcements from everyone
    assert other.members == {}
    assert set(a.members) == {b.me.node_id}
    assert a.duplicates == b.duplicates == set()
    assert [r for r in caplog.records if r.name == LOGGER] == []  # our own echo is ignored silently

    # An update (here: failover bumps the epoch and role) is announced right away.
    calls = len(changes.calls)
    b.update(dataclasses.replace(b.me, epoch=2, role="backup"))
    await until(lambda: a.members[b.me.node_id].epoch == 2, "the update")
    assert a.members[b.me.node_id].role == "backup"
    assert len(changes.calls) == calls + 1
    with pytest.raises(ValueError, match="cannot change"):
        b.update(dataclasses.replace(b.me, cluster="beta"))


async def test_silent_node_expires(redis: RedisServer, raw: Redis, nodes: NodeFactory) -> None:
    changes = Changes()
    a = await nodes(redis.url, announcement("a"), on_change=changes)
    await until(lambda: a.connected, "connected")
    # A node that announced once and died without leaving (its key carries the same TTL as the real ones).
    ghost = announcement("ghost")
    await raw.set(key(ghost), ghost.encode(), px=int(REFRESH * 1000))
    await raw.publish(channel(), ghost.encode())
    await until(lambda: ghost.node_id in a.members, "the ghost")
    seen = time.monotonic()
    await until(lambda: ghost.node_id not in a.members, "expiry")
    elapsed = time.monotonic() - seen
    assert REFRESH * 0.8 <= elapsed < REFRESH + 3.0, elapsed
    assert changes.calls[-1] == {}


async def test_clean_stop_is_seen_at_once(redis: RedisServer, raw: Redis, nodes: NodeFactory) -> None:
    refresh = 5.0
    a = await nodes(redis.url, announcement("a"), refresh=refresh)
    b = await nodes(redis.url, announcement("b"), refresh=refresh)
    await until(lambda: b.me.node_id in a.members, "discovery")
    started = time.monotonic()
    await b.stop()
    await until(lambda: a.members == {}, "the leave", timeout=refresh / 2)
    assert time.monotonic() - started < refresh / 2
    assert await raw.exists(key(b.me)) == 0
    assert not b.connected


async def test_redis_outage_freezes_membership(redis: RedisServer, nodes: NodeFactory) -> None:
    # A refresh timeout well above the reconnect backoff's ceiling: a clock that did not restart at the
    # reconnection would expire d within one backoff of Redis's return, a restarted one a whole timeout later.
    refresh = 3 * _MAX_BACKOFF
    changes = Changes()
    a = await nodes(redis.url, announcement("a"), on_change=changes, refresh=refresh)
    b = await nodes(redis.url, announcement("b"), refresh=refresh)
    d = await nodes(redis.url, announcement("d"), refresh=refresh)
    await until(lambda: set(a.members) == {b.me.node_id, d.me.node_id} and a.me.node_id in b.members, "discovery")
    calls = len(changes.calls)

    redis.stop()
    await until(lambda: not a.connected and not b.connected, "the outage to be noticed")
    # A node joining while Redis is down starts at once and waits; one leaving cannot say so.
    started = time.monotonic()
    c = await nodes(redis.url, announcement("c"), refresh=refresh)
    assert time.monotonic() - started < 0.5
    assert not c.connected
    await d.stop()
    # Nobody can be told dead while Redis is: membership is kept well past refresh_timeout.
    outage_end = time.monotonic() + 1.5 * refresh
    while time.monotonic() < outage_end:
        assert set(a.members) == {b.me.node_id, d.me.node_id}
        assert a.me.node_id in b.members
        await asyncio.sleep(0.05)
    assert len(changes.calls) == calls

    redis.start()  # same port, empty: everything is announced again and found by the rescan
    back = time.monotonic()  # a's reconnection, and so the restart of d's refresh clock, comes after this
    await until(lambda: a.connected and b.connected and c.connected, "the reconnections")
    everyone = {a.me.node_id, b.me.node_id, c.me.node_id}
    await until(
        lambda: set(a.members) == everyone - {a.me.node_id} and set(c.members) == everyone - {c.me.node_id},
        "the node that joined during the outage and the expiry of the one that left",
    )
    # Only the changes after the first discovery: a may have found b and d one at a time, each missing once.
    since = list(zip(changes.calls[calls:], changes.times[calls:], strict=True))
    expired_at = next(t for call, t in since if d.me.node_id not in call)
    assert expired_at - back >= refresh  # its clock restarted at the reconnection
    assert b.me.node_id in a.members  # never dropped
    assert all(b.me.node_id in call for call, _ in since)


async def test_rescan_after_reconnect_finds_what_pubsub_missed(
    redis: RedisServer, raw: Redis, nodes: NodeFactory
) -> None:
    a = await nodes(redis.url, announcement("a"), refresh=30.0)
    await until(lambda: a.connected, "connected")
    quiet = announcement("quiet")
    await raw.set(key(quiet), quiet.encode(), px=30_000)  # written, never published
    await asyncio.sleep(5 * PERIOD)
    assert quiet.node_id not in a.members
    killed = await raw.client_kill_filter(_type="pubsub")  # as a Redis restart would, but keeping the keys
    assert killed >= 1
    await until(lambda: quiet.node_id in a.members, "the rescan")
    assert a.connected


async def test_start_while_redis_is_down(redis_down: RedisServer, nodes: NodeFactory) -> None:
    started = time.monotonic()
    a = await nodes(redis_down.url, announcement("a"))
    b = await nodes(redis_down.url, announcement("b"))
    assert time.monotonic() - started < 0.5
    await asyncio.sleep(3 * PERIOD)
    assert not a.connected
    assert not b.connected
    assert a.members == {}
    redis_down.start()
    await until(lambda: a.connected and b.connected, "connection")
    await until(lambda: b.me.node_id in a.members and a.me.node_id in b.members, "discovery")


async def test_stop_with_redis_down_returns_promptly(redis: RedisServer, nodes: NodeFactory) -> None:
    a = await nodes(redis.url, announcement("a"))
    await until(lambda: a.connected, "connected")
    redis.stop()
    started = time.monotonic()
    await a.stop()  # no raise; the others will expire it
    assert time.monotonic() - started < 2.0
    assert not a.connected


async def test_malformed_input_is_ignored(
    redis: RedisServer, raw: Redis, nodes: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    prefix = f"tridentmq:{CLUSTER}:node:"
    stranger = announcement("stranger", cluster="beta")
    mismatched = announcement("mismatched")
    # Keys found by the scan: garbage, a wrong type, a huge value, a key of another type, a foreign cluster.
    await raw.set(prefix + "garbage", b"\xff\xfe\x00garbage")
    await raw.set(
        prefix + "wrong-type", orjson.dumps({**GOOD, "cluster": CLUSTER, "node_id": "wrong-type", "port": "80"})
    )
    await raw.set(prefix + "huge", b"{" + b" " * 100_000 + b"}")
    await raw.hset(prefix + "hash", "field", "value")
    await raw.set(prefix + stranger.node_id, stranger.encode())
    await raw.set(prefix + "not-" + mismatched.node_id, mismatched.encode())
    a = await nodes(redis.url, announcement("a"))
    await until(lambda: a.connected, "connected despite the junk")
    assert len(ignored(caplog)) == 6
    assert a.members == {}

    # Channel messages: garbage, wrong shapes, oversize, a foreign cluster, a malformed leave.
    for payload in [
        b"\xff\x00",
        b"[1, 2]",
        b"{}",
        orjson.dumps({**GOOD, "v": 2}),
        orjson.dumps({**GOOD, "port": -1}),
        b'{"v": 1, "name": "' + b"x" * 10_000 + b'"}',
        stranger.encode(),
        orjson.dumps({"v": 1, LEAVE: 5, "cluster": CLUSTER}),
        orjson.dumps({"v": 1, LEAVE: "someone", "cluster": "beta"}),
        orjson.dumps({"v": 1, "cluster": CLUSTER}),
    ]:
        await raw.publish(channel(), payload)
    await until(lambda: len(ignored(caplog)) == 6 + 10, "one log line per ignored message")
    reasons = " | ".join(ignored(caplog))
    for expected in [
        "not JSON",
        "not a JSON object",
        "missing field",
        "version",
        "port",
        "exceeds",
        "cluster 'beta'",
        "key does not match",
        "malformed leave",
    ]:
        assert expected in reasons, reasons

    # Still working: a real node is discovered and nothing else got in.
    b = await nodes(redis.url, announcement("b"))
    await until(lambda: set(a.members) == {b.me.node_id}, "discovery after the junk")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_same_node_id_from_another_process_is_a_duplicate(
    redis: RedisServer, nodes: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    original = announcement("original")
    copy = dataclasses.replace(original, name="copy", port=next(_ports))  # a copied data directory
    a = await nodes(redis.url, original)
    b = await nodes(redis.url, copy)
    c = await nodes(redis.url, announcement("c"))
    await until(
        lambda: a.duplicates == {(copy.host, copy.port)} and b.duplicates == {(original.host, original.port)},
        "the duplicate to be detected",
    )
    await until(lambda: c.me.node_id in a.members and c.me.node_id in b.members, "discovery of c")
    await asyncio.sleep(5 * PERIOD)  # many more announcements from the impostor: still one error each
    assert set(a.members) == set(b.members) == {c.me.node_id}
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert sorted(getattr(r, "impostor_port", 0) for r in errors) == sorted([original.port, copy.port])


async def test_members_are_capped(
    redis: RedisServer, raw: Redis, nodes: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with raw.pipeline(transaction=False) as pipe:
        for n in range(MAX_MEMBERS + 20):
            flood = announcement(f"flood-{n}", port=1 + n)
            pipe.set(key(flood), flood.encode(), px=30_000)
        await pipe.execute()
    a = await nodes(redis.url, announcement("a"), refresh=30.0)
    await until(lambda: a.connected, "connected")
    assert len(a.members) == MAX_MEMBERS
    assert len([r for r in caplog.records if "limit" in r.getMessage()]) == 1


async def test_failing_on_change_is_contained(
    redis: RedisServer, nodes: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(members: Mapping[str, Announcement]) -> None:
        raise RuntimeError("callback bug")

    a = await nodes(redis.url, announcement("a"), on_change=broken)
    b = await nodes(redis.url, announcement("b"))
    await until(lambda: b.me.node_id in a.members, "discovery")
    b.update(dataclasses.replace(b.me, epoch=3))
    await until(lambda: a.members[b.me.node_id].epoch == 3, "discovery goes on")
    assert any(r.exc_info and "callback bug" in str(r.exc_info[1]) for r in caplog.records)
