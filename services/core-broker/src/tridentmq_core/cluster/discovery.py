"""Broadcast and discovery groups (Artemis style) emulated over Redis.

Redis only carries announcements, never messages: the cluster keeps running while Redis is down, it just
cannot learn about new nodes meanwhile.

Broadcast group: every ``broadcast_period`` a node writes its announcement to the key
``tridentmq:{cluster}:node:{node_id}`` with a TTL of ``refresh_timeout`` and publishes it on the channel
``tridentmq:{cluster}:announce``. A clean stop deletes the key and publishes a leave.

Discovery group: subscribe first, then scan the keys (so nothing announced in between is missed); every
announcement refreshes its member, and members not refreshed within ``refresh_timeout`` are expired. While
Redis is unreachable a dead node cannot be told from a dead Redis, so expiry is suspended; on reconnecting
the keys are scanned again (pub/sub drops what was published during the outage) and every member's refresh
clock restarts from then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import orjson

if TYPE_CHECKING:  # redis-py is imported by ``start``: it is a third of a node's start-up, and few nodes use it
    from redis.asyncio import Redis
    from redis.asyncio.client import PubSub

from tridentmq_shared.supervision import spawn

__all__ = ["LEAVE", "MAX_ANNOUNCEMENT_BYTES", "MAX_MEMBERS", "Announcement", "RedisDiscovery"]

log = logging.getLogger("tridentmq.core.discovery")

VERSION = 1
LEAVE = "leave"
MAX_ANNOUNCEMENT_BYTES = 4096
MAX_MEMBERS = 1024  # a flood of junk keys must not exhaust memory
_MAX_DUPLICATES = 64
_ROLES = frozenset({"primary", "backup"})
_MIN_BACKOFF = 0.1
_MAX_BACKOFF = 1.0
_SCAN_BATCH = 100
_STOP_TIMEOUT = 1.0  # a clean stop must not hang on an unreachable Redis
_TASK_STOP_TIMEOUT = 5.0
_POLL = 0.5  # longest pub/sub wait: bounds how long a stop waits for the reader


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a node tells the other nodes of its cluster about itself."""

    cluster: str  # cluster name
    node_id: str  # node UUID
    name: str  # node name, for logs and status
    host: str  # internal link address the other nodes connect to
    port: int
    role: str = "primary"  # "primary" | "backup"
    pair: str = ""  # HA group name, "" if none
    epoch: int = 1

    def __post_init__(self) -> None:
        if not self.cluster:
            raise ValueError("empty cluster name")
        if not self.node_id:
            raise ValueError("empty node_id")
        if not self.host:
            raise ValueError("empty host")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of 1..65535")
        if self.role not in _ROLES:
            raise ValueError(f"unknown role {self.role!r}")
        if self.epoch < 0:
            raise ValueError(f"negative epoch {self.epoch}")

    def encode(self) -> bytes:
        """JSON with a ``"v"`` version field."""
        return orjson.dumps({"v": VERSION, **asdict(self)})

    @staticmethod
    def decode(data: bytes | str) -> Announcement:
        """Parse an announcement; raises ValueError on anything malformed."""
        return _announcement(_load(data))


def _load(data: bytes | str) -> dict[str, Any]:
    """The JSON object of a version-1 payload of bounded size, or ValueError."""
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > MAX_ANNOUNCEMENT_BYTES:
        raise ValueError(f"payload of {len(raw)} bytes exceeds {MAX_ANNOUNCEMENT_BYTES}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")  # noqa: TRY004 (callers expect ValueError for any bad payload)
    version = value.get("v")
    if type(version) is not int or version != VERSION:
        raise ValueError(f"unsupported version {version!r}")
    return value


def _field(fields: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = fields.get(key, default)
    if value is None:
        raise ValueError(f"missing field {key!r}")
    if type(value) is not kind:  # exact: a JSON true must not pass as an int
        raise ValueError(f"field {key!r} is not a {kind.__name__}")
    return value


def _announcement(fields: Mapping[str, Any]) -> Announcement:
    return Announcement(
        cluster=_field(fields, "cluster", str),
        node_id=_field(fields, "node_id", str),
        name=_field(fields, "name", str),
        host=_field(fields, "host", str),
        port=_field(fields, "port", int),
        role=_field(fields, "role", str, "primary"),
        pair=_field(fields, "pair", str, ""),
        epoch=_field(fields, "epoch", int, 1),
    )


def _redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _reason(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # a TaskGroup wraps the first failure
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def _client_name(node_id: str) -> str:
    """CLIENT SETNAME refuses spaces and control characters: keep a recognisable, safe name."""
    return "tridentmq-" + re.sub(r"[^A-Za-z0-9._-]", "_", node_id[:64])


def _glob_escape(text: str) -> str:
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


class RedisDiscovery:
    """Announces ``me`` and tracks the other nodes of the same cluster (see the module docstring).

    ``members`` maps node id to announcement and never holds this node; ``connected`` tells whether Redis is
    reachable right now; ``duplicates`` lists the (host, port) of other processes announcing this node's id
    (a copied data directory). ``on_change`` is called with the members whenever one joins, leaves, expires or
    changes its announcement.
    """

    def __init__(
        self,
        url: str,
        me: Announcement,
        *,
        broadcast_period: float = 1.0,
        refresh_timeout: float = 5.0,
        on_change: Callable[[Mapping[str, Announcement]], None] | None = None,
    ) -> None:
        if broadcast_period <= 0 or refresh_timeout <= 0:
            raise ValueError("broadcast_period and refresh_timeout must be positive")
        self.url = url
        self.members: dict[str, Announcement] = {}
        self.connected = False
        self.duplicates: set[tuple[str, int]] = set()
        self._me = me
        self._own_addresses = {(me.host, me.port)}  # an echo of an earlier announcement is still our own
        self._period = broadcast_period
        self._refresh_timeout = refresh_timeout
        self._on_change = on_change
        self._seen: dict[str, float] = {}  # node id → event-loop time of its last announcement
        self.first_look = asyncio.Event()  # set once the first try to reach Redis is over (scanned, or down)
        self._read_at = 0.0  # event-loop time the pub/sub reader last ran: announcements up to then are applied
        self._key_prefix = f"tridentmq:{me.cluster}:node:"
        self._channel = f"tridentmq:{me.cluster}:announce"
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._client: Redis | None = None
        self._outage_logged = False
        self._full_logged = False

    @property
    def me(self) -> Announcement:
        return self._me

    async def start(self) -> None:
        """Start announcing and discovering in the background; returns at once even if Redis is down."""
        if self._task is not None:
            return
        self._stopping = False
        from redis.asyncio import Redis  # noqa: PLC0415 (see the imports)
        from redis.asyncio.retry import Retry  # noqa: PLC0415
        from redis.backoff import NoBackoff  # noqa: PLC0415

        # Redis is a hint service: time out fast, never retry inside the client (the session loop retries and
        # rescans), and ping idle connections so a silently dead one is noticed.
        timeout = max(0.5, min(2.0, self._refresh_timeout / 2))
        health_check = max(1, round(self._refresh_timeout / 2))
        self._client = Redis.from_url(
            self.url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=health_check,
            retry=Retry(NoBackoff(), 0),
            client_name=_client_name(self._me.node_id),
        )
        self._task = spawn(self._run(self._client), "redis-discovery")

    async def stop(self) -> None:
        """Stop, deleting our key and publishing a leave; never raises, even with Redis down."""
        task, self._task = self._task, None
        client, self._client = self._client, None
        if task is not None:
            # On Python 3.11 redis-py can swallow a cancellation (asyncio.wait_for in its send path), so the
            # loops also end on _stopping; waiting (not awaiting) lets a cancellation of stop() itself through.
            self._stopping = True
            self._wake.set()
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=_TASK_STOP_TIMEOUT)
            if not done:
                log.error("discovery: background task did not stop", extra={"timeout_s": _TASK_STOP_TIMEOUT})
        if client is None:
            return
        me = self._me
        leave = orjson.dumps({"v": VERSION, LEAVE: me.node_id, "cluster": me.cluster})
        try:
            async with asyncio.timeout(_STOP_TIMEOUT):
                async with client.pipeline(transaction=True) as pipe:
                    pipe.delete(self._key_prefix + me.node_id)
                    pipe.publish(self._channel, leave)
                    await pipe.execute()
        except Exception as exc:  # noqa: BLE001 (the others will expire us instead)
            log.info("discovery: leave not published", extra={"url": _redact(self.url), "reason": _reason(exc)})
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_STOP_TIMEOUT):
                await client.aclose()
        self.connected = False

    def update(self, me: Announcement) -> None:
        """Announce ``me`` from now on (right away if connected); the cluster and node id cannot change."""
        if me.cluster != self._me.cluster or me.node_id != self._me.node_id:
            raise ValueError("the cluster name and node id of a running discovery cannot change")
        self._me = me
        self._own_addresses.add((me.host, me.port))
        self._wake.set()

    # ------------------------------------------------------------------ background task

    def _stopped(self) -> bool:
        return self._stopping  # a call: the flag changes across awaits, which attribute narrowing ignores

    async def _run(self, client: Redis) -> None:
        loop = asyncio.get_running_loop()
        backoff = _MIN_BACKOFF
        while not self._stopped():
            try:
                await self._session(client, loop)
                return  # only when stopping
            except Exception as exc:  # noqa: BLE001 (logged; the loop reconnects)
                if self.connected:
                    backoff = _MIN_BACKOFF
                if not self._outage_logged:
                    self._outage_logged = True
                    log.warning(
                        "discovery: Redis unreachable, membership frozen until it is back",
                        extra={"url": _redact(self.url), "reason": _reason(exc)},
                    )
                else:
                    log.debug("discovery: Redis still unreachable", extra={"reason": _reason(exc)})
            self.connected = False
            self.first_look.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def _session(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        """One connection lifetime: ends by raising, or by returning once stopping."""
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)  # before the scan: nothing announced in between is lost
            await self._announce(client)
            now = loop.time()
            for node_id in self._seen:  # the outage says nothing about the members: restart their clocks
                self._seen[node_id] = now
            await self._scan(client, loop)
            self._read_at = loop.time()
            self.connected = True
            self.first_look.set()
            if self._outage_logged:
                self._outage_logged = False
                log.info(
                    "discovery: Redis reachable again", extra={"url": _redact(self.url), "members": len(self.members)}
                )
            if self._stopped():
                return
            async with asyncio.TaskGroup() as group:
                group.create_task(self._read(pubsub, loop))
                group.create_task(self._tick(client, loop))
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_STOP_TIMEOUT):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # unannotated in redis-py

    async def _announce(self, client: Redis) -> None:
        me = self._me
        payload = me.encode()
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(self._key_prefix + me.node_id, payload, px=max(1, round(self._refresh_timeout * 1000)))
            pipe.publish(self._channel, payload)
            await pipe.execute()

    async def _tick(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stopped():
            self._wake.clear()  # before announcing: an update() made meanwhile wakes the next round at once
            await self._announce(client)
            if self._stopped():
                return
            # Only after Redis answered (expiry is suspended while it does not), and judged at the time the reader
            # last ran: after an event-loop stall, announcements still waiting in the socket must not count as lost.
            self._expire(min(loop.time(), self._read_at))
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation racing the wake-up.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._period):
                    await self._wake.wait()

    async def _read(self, pubsub: PubSub, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stopped():
            # A bounded wait, so the client pings the connection (health check) between messages.
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(self._period, _POLL))
            self._read_at = loop.time()
            if (
                message is not None
                and message.get("type") == "message"
                and self._receive(message.get("data"), "channel", loop.time())
            ):
                self._changed()

    async def _scan(self, client: Redis, loop: asyncio.AbstractEventLoop) -> None:
        changed = False
        keys: list[bytes] = []
        async for key in client.scan_iter(match=_glob_escape(self._key_prefix) + "*", count=_SCAN_BATCH):
            keys.append(key)
            if len(keys) >= _SCAN_BATCH:
                changed |= await self._fetch(client, keys, loop)
                keys = []
        if keys:
            changed |= await self._fetch(client, keys, loop)
        if changed:
            self._changed()

    async def _fetch(self, client: Redis, keys: list[bytes], loop: asyncio.AbstractEventLoop) -> bool:
        # GETRANGE rather than GET: a huge junk value costs at most one byte more than the limit.
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.getrange(key, 0, MAX_ANNOUNCEMENT_BYTES)
            values = await pipe.execute(raise_on_error=False)  # a key of another type must not end the session
        changed = False
        now = loop.time()
        for key, value in zip(keys, values, strict=True):
            if value:  # an empty value is a key that expired between SCAN and GETRANGE
                changed |= self._receive(value, "key", now, key=key)
        return changed

    # ------------------------------------------------------------------ membership

    def _receive(self, data: object, source: str, now: float, *, key: bytes | None = None) -> bool:
        """Apply one key value or channel message; True when the membership changed."""
        if not isinstance(data, bytes | str):
            self._ignore("not a string", source, data)
            return False
        try:
            fields = _load(data)
            if LEAVE in fields:
                return self._leave(fields, source, data)
            announcement = _announcement(fields)
        except ValueError as exc:
            self._ignore(str(exc), source, data)
            return False
        me = self._me
        if announcement.cluster != me.cluster:
            self._ignore(f"announcement of cluster {announcement.cluster!r}", source, data)
            return False
        if key is not None and key != (self._key_prefix + announcement.node_id).encode():
            self._ignore("key does not match the node id", source, data)
            return False
        if announcement.node_id == me.node_id:
            self._own_id(announcement)
            return False
        return self._apply(announcement, now)

    def _apply(self, announcement: Announcement, now: float) -> bool:
        node_id = announcement.node_id
        known = self.members.get(node_id)
        if known is None and len(self.members) >= MAX_MEMBERS:
            if not self._full_logged:
                self._full_logged = True
                log.warning(
                    "discovery: member limit reached, further nodes ignored",
                    extra={"limit": MAX_MEMBERS, "node_id": node_id},
                )
            return False
        self._seen[node_id] = now
        if known == announcement:
            return False
        self.members[node_id] = announcement
        log.info(
            "discovery: member joined" if known is None else "discovery: member changed",
            extra={
                "node_id": node_id,
                "node_name": announcement.name,
                "host": announcement.host,
                "port": announcement.port,
                "role": announcement.role,
                "epoch": announcement.epoch,
            },
        )
        return True

    def _leave(self, fields: Mapping[str, Any], source: str, data: bytes | str) -> bool:
        node_id, cluster = fields.get(LEAVE), fields.get("cluster")
        if not isinstance(node_id, str) or not isinstance(cluster, str):
            self._ignore("malformed leave", source, data)
            return False
        if cluster != self._me.cluster:
            self._ignore(f"leave of cluster {cluster!r}", source, data)
            return False
        if self.members.pop(node_id, None) is None:
            return False
        del self._seen[node_id]
        self._full_logged = False
        log.info("discovery: member left", extra={"node_id": node_id})
        return True

    def _expire(self, now: float) -> None:
        expired = [node_id for node_id, seen in self._seen.items() if now - seen > self._refresh_timeout]
        for node_id in expired:
            del self._seen[node_id]
            gone = self.members.pop(node_id)
            log.warning(
                "discovery: member expired",
                extra={"node_id": node_id, "node_name": gone.name, "timeout_s": self._refresh_timeout},
            )
        if expired:
            self._full_logged = False
            self._changed()

    def _own_id(self, announcement: Announcement) -> None:
        address = (announcement.host, announcement.port)
        if address in self._own_addresses or address in self.duplicates:
            return  # our own echo, or an impostor already reported
        if len(self.duplicates) >= _MAX_DUPLICATES:
            return
        self.duplicates.add(address)
        log.error(
            "discovery: another process announces this node's id: was the data directory copied?",
            extra={
                "node_id": announcement.node_id,
                "impostor_host": announcement.host,
                "impostor_port": announcement.port,
                "impostor_name": announcement.name,
            },
        )

    def _ignore(self, reason: str, source: str, data: object) -> None:
        size = len(data) if isinstance(data, bytes | str) else None
        log.warning("discovery: announcement ignored", extra={"reason": reason, "source": source, "size": size})

    def _changed(self) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(dict(self.members))
        except Exception:
            log.exception("discovery: on_change callback failed")
