"""Benchmark of a wrong-password storm against one core node: how fast guesses are answered, and what the
storm does to other clients' latency and logins (issue 22, item 3).

Starts its own core with two users whose passwords are hashed with PBKDF2 (200,000 iterations) and one
with a plain password. A separate process runs ``--guessers`` parallel connections from 127.0.0.2 that
log in with a wrong password as fast as the core answers. Meanwhile, from 127.0.0.1, one link client
publishes a message and waits for its delivery, over and over (the round trip is its latency); another
client reconnects with known credentials every half second (the login latency, a cache hit); and a user
logs in for the first time once (a full PBKDF2 check). Each phase runs ``--seconds``, first without the
storm, then with it against the hashed user, then against the plain-password user. Last, a reconnect
storm: ``--known`` clients of a user whose password was checked before and ``--fresh`` users never seen
(each a PBKDF2 check) connect at once from another process, while the probe client goes on:

    uv run python -m bench.login_storm [--guessers 64] [--seconds 10] [--known 2000] [--fresh 100]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import struct
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
from bench.node import core_node, machine, quantile_ms

from tridentmq_core.security import hash_password
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.codec import LinkConnection, Role
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message

ATTACKER = "127.0.0.2"


def _config(fresh: int) -> str:
    alice = hash_password("wonderland", salt=b"alice-salt", iterations=200_000)
    bob = hash_password("builder", salt=b"bob-salt", iterations=200_000)
    # The reconnect storm's users seen for the first time: each with its own salt, so each costs a PBKDF2.
    crowd = [(f"fresh{n}", hash_password("builder", salt=b"fresh-%d" % n, iterations=200_000)) for n in range(fresh)]
    grants = "\n".join(
        f'[[permissions]]\nmatch = "#"\npermission = "{p}"\nroles = ["app"]\n'
        for p in ("send", "consume", "createAddress", "createNonDurableQueue")
    )
    newcomers = [(f"bob{n}", bob) for n in range(3)]  # one first login per phase
    users = [("alice", alice), *newcomers, ("carol", "plain-password"), *crowd]
    return "".join(f'[[users]]\nname = "{n}"\npassword = "{p}"\nroles = ["app"]\n\n' for n, p in users) + grants


async def _guesses(port: int, user: str, guessers: int, seconds: float) -> tuple[int, int]:
    """(wrong-password refusals, other answers: handshake timeouts, resets) of ``guessers`` connections
    guessing ``user``'s password for ``seconds``."""
    conn = LinkConnection(Role.CLIENT)
    conn.hello(user, "not-the-password", "guesser")
    hello = conn.data_to_send()
    deadline = time.monotonic() + seconds
    counts = [0, 0]

    async def guesser() -> None:
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
            except OSError:
                counts[1] += 1
                continue
            try:
                writer.write(hello)
                (size,) = struct.unpack(">I", await reader.readexactly(4))
                [op] = msgpack.unpackb(await reader.readexactly(size))
                counts[0 if op[2] == "unknown user or wrong password" else 1] += 1
            except (OSError, asyncio.IncompleteReadError):
                counts[1] += 1
            finally:
                writer.close()

    await asyncio.gather(*[guesser() for _ in range(guessers)])
    return counts[0], counts[1]


def _storm_process(port: int, user: str, guessers: int, seconds: float, out: Connection) -> None:
    out.send(asyncio.run(_guesses(port, user, guessers, seconds)))


@dataclass
class Phase:
    name: str
    round_trips_ns: list[int] = field(default_factory=list)
    logins_ns: list[int] = field(default_factory=list)
    first_login_ns: int = 0
    refusals: int = 0
    other_answers: int = 0
    seconds: float = 0.0


async def _measure(port: int, phase: Phase, seconds: float, newcomer: str) -> None:
    async with LinkClient("127.0.0.1", port, user="alice", password="wonderland", connect_timeout=60) as client:
        await client.create_queue("probe", durable=False)
        consumer = await client.subscribe("probe", credit=10, auto_ack=True)
        deadline = time.monotonic() + seconds

        async def round_trips() -> None:
            while time.monotonic() < deadline:
                started = time.perf_counter_ns()
                await client.publish(new_message("probe", b"x" * 100))
                assert await consumer.get(timeout=60) is not None
                phase.round_trips_ns.append(time.perf_counter_ns() - started)

        async def logins() -> None:
            while time.monotonic() < deadline:
                started = time.perf_counter_ns()
                async with LinkClient("127.0.0.1", port, user="alice", password="wonderland", connect_timeout=60):
                    phase.logins_ns.append(time.perf_counter_ns() - started)
                await asyncio.sleep(0.5)

        async def first_login() -> None:
            await asyncio.sleep(seconds / 2)
            started = time.perf_counter_ns()
            async with LinkClient("127.0.0.1", port, user=newcomer, password="builder", connect_timeout=60):
                phase.first_login_ns = time.perf_counter_ns() - started

        await asyncio.gather(round_trips(), logins(), first_login())


def run_phase(port: int, name: str, storm_user: str | None, guessers: int, seconds: float, newcomer: str) -> Phase:
    phase = Phase(name, seconds=seconds)
    process = None
    receiver, sender = multiprocessing.get_context("spawn").Pipe(duplex=False)
    if storm_user is not None:
        process = multiprocessing.get_context("spawn").Process(
            target=_storm_process, args=(port, storm_user, guessers, seconds, sender)
        )
        process.start()
        time.sleep(1.0)  # the guessers are connecting before the measurement starts
    asyncio.run(_measure(port, phase, seconds - 1.0 if process else seconds, newcomer))
    if process is not None:
        phase.refusals, phase.other_answers = receiver.recv()
        process.join()
    return phase


async def _reconnect(port: int, known: int, fresh: int) -> tuple[float, int]:
    """``known`` clients of a user whose password was checked before and ``fresh`` users never seen connect
    at once (retrying when refused at link.max_handshaking): (seconds until all are in, refusals met)."""
    policy = ReconnectPolicy(retry_interval=0.05, max_interval=1.0, initial_attempts=1000)
    users = [("alice", "wonderland")] * known + [(f"fresh{n}", "builder") for n in range(fresh)]
    # Slow heartbeats: a few thousand links in one client process must not spend it on heartbeats.
    clients = [
        LinkClient("127.0.0.1", port, user=u, password=p, reconnect=policy, connect_timeout=60, heartbeat_ms=10_000)
        for u, p in users
    ]
    started = time.monotonic()
    await asyncio.gather(*[c.connect() for c in clients])
    elapsed = time.monotonic() - started
    await asyncio.gather(*[c.close() for c in clients])
    return elapsed, 0


def _reconnect_process(port: int, known: int, fresh: int, out: Connection) -> None:
    out.send(asyncio.run(_reconnect(port, known, fresh)))


async def _probe_until(port: int, phase: Phase, done: Connection) -> None:
    async with LinkClient("127.0.0.1", port, user="alice", password="wonderland", connect_timeout=60) as client:
        await client.create_queue("probe", durable=False)
        consumer = await client.subscribe("probe", credit=10, auto_ack=True)
        while not done.poll():
            started = time.perf_counter_ns()
            await client.publish(new_message("probe", b"x" * 100))
            assert await consumer.get(timeout=60) is not None
            phase.round_trips_ns.append(time.perf_counter_ns() - started)


def reconnect_storm(port: int, known: int, fresh: int) -> str:
    """Other clients' round trips while ``known`` + ``fresh`` clients reconnect at once (another process)."""
    phase = Phase("reconnect storm")
    receiver, sender = multiprocessing.get_context("spawn").Pipe(duplex=False)
    process = multiprocessing.get_context("spawn").Process(target=_reconnect_process, args=(port, known, fresh, sender))
    process.start()
    asyncio.run(_probe_until(port, phase, receiver))
    elapsed, _ = receiver.recv()
    process.join()
    trips = sorted(phase.round_trips_ns)
    return (
        f"reconnect storm of {known:,} known clients and {fresh} first logins: all in after {elapsed:.1f} s "
        f"({(known + fresh) / elapsed:,.0f} logins/s); meanwhile round trip p50 {quantile_ms(trips, 0.5):.2f} "
        f"ms, p99 {quantile_ms(trips, 0.99):.2f} ms, max {quantile_ms(trips, 1.0):.2f} ms "
        f"({len(trips)} trips)"
    )


def report(phase: Phase) -> str:
    trips = sorted(phase.round_trips_ns)
    logins = sorted(phase.logins_ns)
    storm = ""
    if phase.refusals or phase.other_answers:
        storm = (
            f"; wrong passwords refused {phase.refusals / phase.seconds:,.1f}/s, handshakes timed out "
            f"{phase.other_answers / phase.seconds:,.1f}/s"
        )
    return (
        f"{phase.name}: round trip p50 {quantile_ms(trips, 0.5):.2f} ms, p99 {quantile_ms(trips, 0.99):.2f} ms, "
        f"max {quantile_ms(trips, 1.0):.2f} ms ({len(trips)} trips); known-user login p50 "
        f"{quantile_ms(logins, 0.5):.1f} ms, max {quantile_ms(logins, 1.0):.1f} ms; a first login (PBKDF2) "
        f"{phase.first_login_ns / 1e6:.0f} ms{storm}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guessers", type=int, default=64, help="parallel wrong-password connections")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--known", type=int, default=1000, help="reconnect storm: clients of a known user")
    parser.add_argument("--fresh", type=int, default=100, help="reconnect storm: users logging in first time")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with (
        tempfile.TemporaryDirectory(prefix="tridentmq-bench-") as tmp,
        core_node(Path(tmp), config=_config(args.fresh)) as core,
    ):
        phases = (("no storm", None), ("storm on a hashed password", "alice"), ("storm on a plain password", "carol"))
        for n, (name, user) in enumerate(phases):
            phase = run_phase(core.link_port, name, user, args.guessers, args.seconds, f"bob{n}")
            print(report(phase), flush=True)
        print(reconnect_storm(core.link_port, args.known, args.fresh), flush=True)


if __name__ == "__main__":
    main()
