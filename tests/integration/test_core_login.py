"""Wrong-password storms against a real core do not stall it (issue 22, item 3).

Password guessers connect from 127.0.0.2 over raw sockets, as fast as the core answers, against a user
whose password is hashed with PBKDF2 at its real cost (200,000 iterations). Meanwhile legitimate link
clients on 127.0.0.1 keep publishing and consuming, a crowd of them reconnects, and another user logs in
for the first time: their links must never lapse (a stalled event loop misses heartbeats and the clients
drop their links) and every guess must be refused.
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from pathlib import Path

import msgpack
import pytest
from tests.conftest import start_core

from tridentmq_core.security import hash_password
from tridentmq_core.server import LOGIN_BUSY
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.codec import LinkConnection, Role
from tridentmq_shared.link.ops import ErrorCode, Op
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration

GUESSERS = 64  # the parallel guessers
ATTACKER = "127.0.0.2"  # another address on loopback: the legitimate clients' 127.0.0.1 is not throttled
WRONG = "unknown user or wrong password"


def _users() -> str:
    alice = hash_password("wonderland", salt=b"alice-salt", iterations=200_000)
    bob = hash_password("builder", salt=b"bob-salt", iterations=200_000)
    grants = "\n".join(
        f'[[permissions]]\nmatch = "#"\npermission = "{p}"\nroles = ["app"]\n'
        for p in ("send", "consume", "createAddress", "createNonDurableQueue")
    )
    return f"""
[[users]]
name = "alice"
password = "{alice}"
roles = ["app"]

[[users]]
name = "bob"
password = "{bob}"
roles = ["app"]

{grants}
"""


def _hello(user: str, password: str) -> bytes:
    conn = LinkConnection(Role.CLIENT)
    conn.hello(user, password, "guesser")
    return conn.data_to_send()


async def _guess(port: int, hello: bytes) -> tuple[str, str]:
    """One login attempt from the attacker's address: the code and text of the core's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
    try:
        writer.write(hello)
        header = await reader.readexactly(4)
        (size,) = struct.unpack(">I", header)
        [op] = msgpack.unpackb(await reader.readexactly(size))
        assert op[0] == Op.CLOSE, f"a wrong password was answered with {op}"
        return op[1], op[2]
    finally:
        writer.close()


async def _guesser(port: int, answers: Counter[str], stop: asyncio.Event) -> None:
    hello = _hello("alice", "not-the-password")
    while not stop.is_set():
        code, text = await _guess(port, hello)
        assert code in (ErrorCode.UNAUTHENTICATED, ErrorCode.RESOURCE_LIMIT), (code, text)
        answers[text] += 1


async def _round_trip(producer: LinkClient, consumer_link: LinkClient, queue: str, count: int) -> None:
    consumer = await consumer_link.subscribe(queue, credit=count, auto_ack=True)
    await asyncio.gather(*[producer.publish(new_message(queue, b"m%d" % i)) for i in range(count)])
    for _ in range(count):
        assert await consumer.get(timeout=30) is not None
    await consumer.close()


async def test_a_wrong_password_storm_does_not_stall_the_node(tmp_path: Path) -> None:
    # Shorter refusal delays than the defaults: the same bound on guesses, reached in fewer seconds.
    node = start_core(
        tmp_path,
        config=_users(),
        TRIDENTMQ_CORE_LOGIN_FAILURE_DELAY_MS="100",
        TRIDENTMQ_CORE_LOGIN_MAX_FAILURE_DELAY_MS="1000",
    )
    port = node.link_port
    try:
        async with (
            LinkClient("127.0.0.1", port, user="alice", password="wonderland") as producer,
            LinkClient("127.0.0.1", port, user="alice", password="wonderland") as consumer_link,
        ):
            await producer.create_queue("work", durable=False)
            await _round_trip(producer, consumer_link, "work", 20)
            answers: Counter[str] = Counter()
            stop = asyncio.Event()
            guessers = [asyncio.create_task(_guesser(port, answers, stop)) for _ in range(GUESSERS)]
            while answers[WRONG] < 4:  # the storm is on: refusals come back (after their backoff delay)
                await asyncio.sleep(0.05)
                assert not any(g.done() for g in guessers), [g.exception() for g in guessers if g.done()]
            # A crowd of known clients reconnects (their password was checked before: no PBKDF2) ...
            crowd = [LinkClient("127.0.0.1", port, user="alice", password="wonderland") for _ in range(32)]
            await asyncio.gather(*[c.connect() for c in crowd])
            await asyncio.gather(*[c.publish(new_message("work", b"crowd")) for c in crowd])
            await asyncio.gather(*[c.close() for c in crowd])
            # ... and a user logs in for the first time (a full PBKDF2 check, beside the attacker's).
            async with LinkClient("127.0.0.1", port, user="bob", password="builder") as bob:
                await bob.publish(new_message("work", b"bob"))
            rounds = 0
            while rounds < 3 or answers[WRONG] < 8:  # the legitimate links work on during the storm
                await _round_trip(producer, consumer_link, "work", 20)
                rounds += 1
            stop.set()
            await asyncio.gather(*guessers)
            # Never stalled long enough to miss heartbeats: neither link was dropped and reconnected.
            assert producer.failovers == 0
            assert consumer_link.failovers == 0
        assert set(answers) <= {WRONG, LOGIN_BUSY}  # refused, or still waiting for a slot at the handshake timeout
    finally:
        assert node.stop() == 0
    log = node.log()
    assert "Traceback" not in log
    assert " ERROR " not in log
    refused = [line for line in log.splitlines() if "link refused" in line]
    assert len(refused) == 1, refused  # once per window and address, not once per guess
    assert f"peer={ATTACKER}" in refused[0]


async def test_an_unknown_user_is_refused_and_a_known_one_accepted(tmp_path: Path) -> None:
    node = start_core(tmp_path, config=_users())
    try:
        code, text = await _guess(node.link_port, _hello("nobody", "x"))
        assert (code, text) == (ErrorCode.UNAUTHENTICATED, WRONG)
        async with LinkClient("127.0.0.1", node.link_port, user="bob", password="builder") as bob:
            await bob.create_queue("q", durable=False)
    finally:
        assert node.stop() == 0
