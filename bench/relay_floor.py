"""The latency floor of relaying through Python processes on this machine: no protocol, no broker, only bytes.

Publishers send fixed-size stamped messages at a fixed rate; a subscriber receives them and records how long
each took. Between them, ``--shape``:

* ``direct``: publishers write straight to the subscriber's listener (the clients' own cost);
* ``one``: through one relay process (a single broker process, as Mosquitto runs);
* ``two``: through relay A, then relay B and back through A (a gateway and its core: client → gateway →
  core → gateway → client, the four socket hops every TridentMQ message takes).

Each relay forwards each read to the next socket at once in a protocol callback (uvloop, as the brokers run),
so what is measured is the wake-ups, reads and writes that a message pays at each hop when it travels alone.
Every process runs on its own; publishers and the subscriber match ``bench.mqtt_gateway``'s fixed-rate runs
(4 publishers at rate / 4 each, 100-byte bodies, one subscriber).

    uv run python -m bench.relay_floor --shape two --rate 1000 --seconds 5 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from typing import Any, cast

import uvloop
from bench.node import cpu_of, machine, quantile_ms

BODY_SIZE = 100  # bytes per message, the stamp included
STAMP_DIGITS = 20  # a message starts with its send time in ns, as 20 ASCII digits
SHAPES = ("direct", "one", "two")


class _Forward(asyncio.Protocol):
    """Writes whatever it reads to ``target()``'s transport."""

    def __init__(self, target: Callable[[], asyncio.Transport | None]) -> None:
        self._target = target
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass of asyncio's

    def data_received(self, data: bytes) -> None:
        target = self._target()
        if target is not None:
            target.write(data)


async def _relay(listen_port: Connection, upstream_port: int | None) -> None:
    """A relay whose first accepted connection is where replies go: the subscriber's (relay A, a single
    relay) or relay A's own link (relay B, which so sends everything back). With ``upstream_port`` (relay A)
    what the others send goes to relay B, and what B sends back to the subscriber."""
    loop = asyncio.get_running_loop()
    first: list[asyncio.Transport] = []

    def to_first() -> asyncio.Transport | None:
        return first[0] if first else None

    next_hop = to_first
    if upstream_port is not None:
        _, upstream = await loop.create_connection(lambda: _Forward(to_first), "127.0.0.1", upstream_port)
        next_hop = lambda: upstream.transport  # noqa: E731 - the one line it takes

    class Accepted(_Forward):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if not first and self.transport is not None:
                first.append(self.transport)

    server = await loop.create_server(lambda: Accepted(next_hop), "127.0.0.1", 0, backlog=64)
    listen_port.send(server.sockets[0].getsockname()[1])
    await asyncio.Future()  # until terminated


def _relay_process(listen_port: Connection, upstream_port: int | None) -> None:
    uvloop.run(_relay(listen_port, upstream_port))


async def _subscribe(port: Connection, expected: int, ready: MpEvent, result: Connection) -> None:
    """Listens (``direct``) or connects to the first relay; records each message's latency in ns."""
    latencies: list[int] = []
    done = asyncio.get_running_loop().create_future()
    buffer = bytearray()

    class Receiver(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            now = time.monotonic_ns()
            buffer.extend(data)
            whole = len(buffer) - len(buffer) % BODY_SIZE
            latencies.extend(now - int(buffer[at : at + STAMP_DIGITS]) for at in range(0, whole, BODY_SIZE))
            del buffer[:whole]
            if len(latencies) >= expected and not done.done():
                done.set_result(None)

    loop = asyncio.get_running_loop()
    target = port.recv()
    if target == 0:  # direct: the publishers connect to us
        server = await loop.create_server(Receiver, "127.0.0.1", 0)
        port.send(server.sockets[0].getsockname()[1])
    else:
        await loop.create_connection(Receiver, "127.0.0.1", target)
    ready.set()
    with contextlib.suppress(TimeoutError):  # what came is reported; the run shows what is missing
        await asyncio.wait_for(done, timeout=60 + expected / 100)
    result.send(latencies)


def _subscriber_process(port: Connection, expected: int, ready: MpEvent, result: Connection) -> None:
    uvloop.run(_subscribe(port, expected, ready, result))


async def _publish(port: int, index: int, publishers: int, rate: float, count: int, start: MpEvent) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    start.wait()
    interval = publishers * 1e9 / rate
    filler = b"x" * (BODY_SIZE - STAMP_DIGITS)
    clock = time.monotonic_ns
    first_due = clock() + index * interval / publishers  # the publishers' messages interleave evenly
    for sent in range(count):
        delay = first_due + sent * interval - clock()
        if delay > 0:
            await asyncio.sleep(delay / 1e9)
        writer.write(b"%020d" % clock() + filler)
    await writer.drain()
    await asyncio.sleep(0.5)
    writer.close()


def _publisher_process(port: int, index: int, publishers: int, rate: float, count: int, start: MpEvent) -> None:
    uvloop.run(_publish(port, index, publishers, rate, count, start))


def run_once(shape: str, rate: float, seconds: float, publishers: int) -> dict[str, Any]:
    """One run of ``shape``: latency quantiles (ms) and the relays' CPU per message (µs)."""
    context = multiprocessing.get_context("spawn")
    per_publisher = int(rate * seconds / publishers)
    expected = per_publisher * publishers
    relays: list[multiprocessing.process.BaseProcess] = []
    upstream: int | None = None
    for _ in range({"direct": 0, "one": 1, "two": 2}[shape]):  # B first, then A linked to it
        mine, theirs = context.Pipe()
        relay = context.Process(target=_relay_process, args=(theirs, upstream), daemon=True)
        relay.start()
        relays.append(relay)
        upstream = mine.recv()
    ready, start = context.Event(), context.Event()
    port_mine, port_theirs = context.Pipe()
    result_mine, result_theirs = context.Pipe()
    subscriber = context.Process(
        target=_subscriber_process, args=(port_theirs, expected, ready, result_theirs), daemon=True
    )
    subscriber.start()
    port_mine.send(upstream or 0)
    entry = upstream if upstream is not None else port_mine.recv()
    if not ready.wait(30):
        raise SystemExit("the subscriber did not start")
    senders = [
        context.Process(target=_publisher_process, args=(entry, i, publishers, rate, per_publisher, start), daemon=True)
        for i in range(publishers)
    ]
    for sender in senders:
        sender.start()
    time.sleep(0.5)  # every publisher connected
    cpu_before = sum(cpu_of(relay.pid or 0) for relay in relays)
    start.set()
    if not result_mine.poll(90 + expected / 100):  # the subscriber reports by then, or it died
        raise SystemExit("the subscriber did not report")
    latencies = sorted(result_mine.recv())
    cpu_used = sum(cpu_of(relay.pid or 0) for relay in relays) - cpu_before
    for process in (*senders, subscriber, *relays):
        process.terminate()
        process.join(10)
    return {
        "received": len(latencies),
        "expected": expected,
        "p50": quantile_ms(latencies, 0.5),
        "p99": quantile_ms(latencies, 0.99),
        "relay_us": cpu_used * 1e6 / max(1, len(latencies)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, action="append", help="may be repeated (default: all)")
    parser.add_argument("--rate", type=float, default=1000.0, help="messages per second in all")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--publishers", type=int, default=4)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    for shape in args.shape or SHAPES:
        runs = []
        for run in range(1, args.runs + 1):
            figures = run_once(shape, args.rate, args.seconds, args.publishers)
            runs.append(figures)
            print(
                f"{shape} run {run}: {figures['received']:,} of {figures['expected']:,} received; latency ms "
                f"p50 {figures['p50']:.3f} p99 {figures['p99']:.3f}; relays' CPU µs/msg {figures['relay_us']:.1f}"
            )
        print(
            f"{shape.upper()} at {args.rate:,.0f} msgs/s median of {len(runs)}: p50 "
            f"{statistics.median(r['p50'] for r in runs):.3f} ms, p99 {statistics.median(r['p99'] for r in runs):.3f}"
            f" ms, relays' CPU {statistics.median(r['relay_us'] for r in runs):.1f} µs/msg"
        )


if __name__ == "__main__":
    main()
