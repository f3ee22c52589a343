"""Benchmark of the STOMP gateway: queue throughput and end-to-end latency through a gateway and its core.

Scenarios (100-byte bodies, one producer connection and one consumer connection, each in its own process,
on a fresh ``/queue/bench.<id>``):

* ``s3``: ``persistent:true`` SENDs, consumer ``ack:client-individual`` (target S3);
* ``np-individual``: ``persistent:false`` SENDs, consumer ``ack:client-individual``;
* ``np-auto``: ``persistent:false`` SENDs, consumer ``ack:auto``.

The producer asks for a receipt on every 100th SEND and on the last, with at most 10 receipts outstanding.
The consumer subscribes with a prefetch of 1000 (``activemq.prefetchSize`` and ``consumer-window-size``),
ACKs every MESSAGE by its ``ack`` header (client-individual), and the producer starts (t0) once the
consumer's SUBSCRIBE receipt is in. Delivered rate = messages delivered / (last delivery - t0); latency is
send-to-delivery from the CLOCK_MONOTONIC stamp that starts each body, sampled once per socket read.

The clients are small raw asyncio STOMP 1.2 clients (uvloop when installed), not stomp.py, so that the
client is not the bottleneck. Without ``--port`` the script starts its own core (throw-away data directory)
and gateway on free loopback ports; with ``--port`` it targets a gateway that is already running.

    uv run python -m bench.stomp_gateway [--runs 3] [--count N] [--scenario s3|np-individual|np-auto]
    uv run python -m bench.stomp_gateway --rate 1000 [--seconds 10]  # latency at a fixed publish rate
    uv run python -m bench.stomp_gateway --host 127.0.0.1 --port 61613  # a gateway already running
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from typing import Any, TypedDict, TypeVar, cast

from bench.client import RawClient
from bench.node import client_tls, cpu_of, cpu_self, gateway_target, machine, quantile_ms, stomp_gateway

from tridentmq_shared.runtime import run_main

BODY_SIZE = 100
STAMP_DIGITS = 20  # the body starts with the send time: CLOCK_MONOTONIC ns, zero-padded decimal
RECEIPT_EVERY = 100
MAX_RECEIPTS = 10
PREFETCH = 1000
GRACE_S = 5.0  # after the producer's last receipt, how long the consumer waits for a missing message
CLOSE_S = 5.0  # how long a client waits for the receipt of its DISCONNECT


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    persistent: bool
    ack: str
    count: int


SCENARIOS = [
    Scenario("s3", "S3 PERSISTENT QUEUE", persistent=True, ack="client-individual", count=100_000),
    Scenario("np-individual", "NON-PERSISTENT QUEUE", persistent=False, ack="client-individual", count=200_000),
    Scenario("np-auto", "NON-PERSISTENT QUEUE", persistent=False, ack="auto", count=200_000),
]


@dataclass(frozen=True)
class RunOptions:
    host: str
    port: int
    destination: str
    persistent: bool
    ack: str
    count: int
    rate: int  # msgs/s; 0 = as fast as the receipt window allows
    deadline_s: int
    ca_file: str = ""  # TLS to the gateway, checked against this authority (empty: plain TCP)


class ProducerResult(TypedDict):
    error: str
    t0_ns: int
    done_ns: int
    sent: int
    cpu_s: float


class ConsumerResult(TypedDict):
    error: str
    delivered: int
    last_ns: int
    latencies_ns: list[int]
    cpu_s: float


# ---------------------------------------------------------------------------------------------- clients
class StompError(Exception):
    pass


class _StompClient(RawClient):
    """A STOMP 1.2 connection: an incremental frame parser and the waits the benchmark needs."""

    error_type = StompError

    def __init__(self) -> None:
        super().__init__()
        self.receipts = 0  # RECEIPT frames received
        self.outstanding = 0  # receipts asked for and not yet received
        self._buffer = b""
        self._connected: asyncio.Future[None] = self.loop.create_future()
        self._receipt: asyncio.Future[None] | None = None

    # ---------------------------------------------------------------- asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        buf = self._buffer + data if self._buffer else data
        size = len(buf)
        pos = 0
        while pos < size:
            if buf[pos] in b"\r\n":  # heart-beat EOLs between frames
                pos += 1
                continue
            head_end = buf.find(b"\n\n", pos)
            if head_end < 0:
                break
            body = head_end + 2
            length = buf.find(b"\ncontent-length:", pos, head_end)
            if length >= 0:
                line_end = buf.find(b"\n", length + 16, head_end)
                end = body + int(buf[length + 16 : head_end if line_end < 0 else line_end])
                if end >= size:
                    break
            else:
                end = buf.find(b"\x00", body)
                if end < 0:
                    break
            self.frame(buf, pos, head_end, body, end)
            pos = end + 1
        self._buffer = buf[pos:]
        self.chunk_done()

    # ---------------------------------------------------------------- frames
    def frame(self, buf: bytes, start: int, head_end: int, body: int, end: int) -> None:
        """One whole frame: command and headers in ``buf[start:head_end]``, body in ``buf[body:end]``."""
        if buf.startswith(b"RECEIPT", start):
            self.receipts += 1
            self.outstanding -= 1
            if self._receipt is not None and not self._receipt.done():
                self._receipt.set_result(None)
        elif buf.startswith(b"CONNECTED", start):
            if not self._connected.done():
                self._connected.set_result(None)
        elif buf.startswith(b"ERROR", start):
            head = buf[start:head_end].decode(errors="replace").replace("\n", "; ")
            self._fail(f"ERROR frame: {head}: {buf[body:end].decode(errors='replace')}")

    def chunk_done(self) -> None:
        """Called after the frames of one read."""

    def _waiters(self) -> tuple[asyncio.Future[Any] | None, ...]:
        return self._connected, self._receipt

    # ---------------------------------------------------------------- the client's side
    async def receipts_below(self, limit: int) -> None:
        """Waits until fewer than ``limit`` receipts are outstanding. It counts instead of waiting for "the next"
        RECEIPT: one that arrives before this coroutine first runs (``wait_for`` starts it a loop turn later)
        is not missed."""
        while self.outstanding >= limit:
            self._check()
            self._receipt = self.loop.create_future()
            await self._receipt

    async def connect(self) -> None:
        self.write(b"CONNECT\naccept-version:1.2\nhost:/\nheart-beat:0,0\n\n\x00")
        await self._connected

    async def close(self) -> None:
        """DISCONNECT with a receipt (so that everything sent before it was handled), then close."""
        self._closing = True  # the gateway closes its end after the receipt: that is no error
        if not self.error and self.transport is not None and not self.transport.is_closing():
            self.outstanding += 1
            self.write(b"DISCONNECT\nreceipt:disconnect\n\n\x00")
            with contextlib.suppress(TimeoutError, StompError):
                await asyncio.wait_for(self.receipts_below(1), CLOSE_S)
        if self.transport is not None:
            self.transport.close()


C = TypeVar("C", bound=_StompClient)


class _Consumer(_StompClient):
    pause_reading_when_blocked = True  # ACKs back up: stop reading MESSAGEs until they drain

    def __init__(self, expected: int, *, client_ack: bool) -> None:
        super().__init__()
        self.expected = expected
        self.client_ack = client_ack
        self.delivered = 0
        self.last_ns = 0  # the read that brought the last message
        self.latencies_ns: list[int] = []
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self._now = 0
        self._first = True
        self._acks: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self._now = time.monotonic_ns()
        self._first = True
        super().data_received(data)

    def frame(self, buf: bytes, start: int, head_end: int, body: int, end: int) -> None:
        if not buf.startswith(b"MESSAGE", start):
            super().frame(buf, start, head_end, body, end)
            return
        self.delivered += 1
        if self._first:  # one latency sample per read keeps the consumer cheap
            self._first = False
            self.latencies_ns.append(self._now - int(buf[body : body + STAMP_DIGITS]))
        if self.client_ack:
            ack = buf.find(b"\nack:", start, head_end)
            if ack >= 0:
                line_end = buf.find(b"\n", ack + 5, head_end)
                self._acks += (b"ACK\nid:", buf[ack + 5 : head_end if line_end < 0 else line_end], b"\n\n\x00")

    def chunk_done(self) -> None:
        if self._acks and not self.error:
            self.write(b"".join(self._acks))
            self._acks = []
        if not self._first:
            self.last_ns = self._now
            if self.delivered >= self.expected and not self.finished.done():
                self.finished.set_result(None)


async def _connect(opts: RunOptions, factory: Callable[[], C]) -> C:
    _, client = await asyncio.get_running_loop().create_connection(
        factory, opts.host, opts.port, ssl=client_tls(opts.ca_file)
    )
    await asyncio.wait_for(client.connect(), 30)
    return client


async def _produce(opts: RunOptions, subscribed: MpEvent, produced: MpEvent, result: ProducerResult) -> None:
    client = await _connect(opts, _StompClient)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + opts.deadline_s
    while not subscribed.is_set():  # t0 is when the consumer's SUBSCRIBE receipt is in
        if loop.time() > deadline:
            raise StompError("the consumer did not subscribe")
        await asyncio.sleep(0.001)
    persistent = "true" if opts.persistent else "false"
    head = f"SEND\ndestination:{opts.destination}\npersistent:{persistent}\n".encode()
    plain = head + f"content-length:{BODY_SIZE}\n\n".encode()
    receipted, receipted_tail = head + b"receipt:", f"\ncontent-length:{BODY_SIZE}\n\n".encode()
    filler = b"x" * (BODY_SIZE - STAMP_DIGITS) + b"\x00"
    count, last = opts.count, opts.count - 1
    interval = 1e9 / opts.rate if opts.rate else 0.0
    clock = time.monotonic_ns
    cpu = cpu_self()
    t0 = result["t0_ns"] = clock()
    sent = 0
    while sent < count:
        await client.receipts_below(MAX_RECEIPTS)
        await client.writable()
        end = min(count, (sent // RECEIPT_EVERY + 1) * RECEIPT_EVERY)  # up to the next receipt
        if interval:
            delay = t0 + sent * interval - clock()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            end = min(end, max(sent + 1, int((clock() - t0) / interval) + 1))  # what is due by now
        parts: list[bytes] = []
        for i in range(sent, end):
            if i % RECEIPT_EVERY == RECEIPT_EVERY - 1 or i == last:
                parts += (receipted, b"%d" % i, receipted_tail, b"%020d" % clock(), filler)
                client.outstanding += 1
            else:
                parts += (plain, b"%020d" % clock(), filler)
        client.write(b"".join(parts))
        sent = result["sent"] = end
    await client.receipts_below(1)
    result["done_ns"] = clock()
    produced.set()
    result["cpu_s"] = cpu_self() - cpu
    await client.close()


async def _consume(opts: RunOptions, subscribed: MpEvent, produced: MpEvent, result: ConsumerResult) -> None:
    client = await _connect(opts, lambda: _Consumer(opts.count, client_ack=opts.ack != "auto"))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + opts.deadline_s
    client.outstanding += 1
    client.write(
        f"SUBSCRIBE\nid:0\ndestination:{opts.destination}\nack:{opts.ack}\n"
        f"activemq.prefetchSize:{PREFETCH}\nconsumer-window-size:{PREFETCH}\nreceipt:subscribe\n\n\x00".encode()
    )
    await asyncio.wait_for(client.receipts_below(1), 30)
    cpu = cpu_self()
    subscribed.set()
    result["latencies_ns"] = client.latencies_ns
    quiet_since = 0.0
    try:
        while not client.finished.done() and loop.time() < deadline:
            await asyncio.wait([client.finished], timeout=0.1)
            result["delivered"], result["last_ns"] = client.delivered, client.last_ns
            if client.error:
                raise StompError(client.error)
            if produced.is_set():  # everything is sent: wait a little for what is missing, then give up
                quiet_since = max(quiet_since or time.monotonic(), client.last_ns / 1e9)
                if time.monotonic() - quiet_since > GRACE_S:
                    break
    finally:
        result["delivered"], result["last_ns"] = client.delivered, client.last_ns
        result["cpu_s"] = cpu_self() - cpu
    await client.close()


def _producer_main(opts: RunOptions, subscribed: MpEvent, produced: MpEvent, out: Connection) -> None:
    signal.alarm(opts.deadline_s + 30)  # the last resort: SIGALRM ends the process
    result = ProducerResult(error="", t0_ns=0, done_ns=0, sent=0, cpu_s=0.0)
    try:
        run_main(asyncio.wait_for(_produce(opts, subscribed, produced, result), opts.deadline_s))
    except TimeoutError:
        result["error"] = f"producer deadline of {opts.deadline_s} s"
    except Exception as exc:
        result["error"] = f"producer: {exc!r}"
    produced.set()
    out.send(result)


def _consumer_main(opts: RunOptions, subscribed: MpEvent, produced: MpEvent, out: Connection) -> None:
    signal.alarm(opts.deadline_s + 30)
    result = ConsumerResult(error="", delivered=0, last_ns=0, latencies_ns=[], cpu_s=0.0)
    try:
        run_main(asyncio.wait_for(_consume(opts, subscribed, produced, result), opts.deadline_s + 2 * GRACE_S))
    except TimeoutError:
        result["error"] = f"consumer deadline of {opts.deadline_s} s"
    except Exception as exc:
        result["error"] = f"consumer: {exc!r}"
    out.send(result)


# ---------------------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunResult:
    delivered: int
    lost: int
    elapsed_s: float
    rate: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    samples: int
    client_cores: float
    server_cores: dict[str, float]
    error: str


def _receive(end: Connection, timeout: float) -> ProducerResult | ConsumerResult | None:
    if not end.poll(timeout):
        return None
    return cast(ProducerResult | ConsumerResult, end.recv())


def run_once(opts: RunOptions, servers: dict[str, int]) -> RunResult:
    """One producer process and one consumer process; ``servers`` are processes whose CPU use is shown."""
    ctx = multiprocessing.get_context("spawn")
    subscribed, produced = ctx.Event(), ctx.Event()
    consumer_end, consumer_out = ctx.Pipe(duplex=False)
    producer_end, producer_out = ctx.Pipe(duplex=False)
    consumer = ctx.Process(target=_consumer_main, args=(opts, subscribed, produced, consumer_out), daemon=True)
    producer = ctx.Process(target=_producer_main, args=(opts, subscribed, produced, producer_out), daemon=True)
    cpu = {name: cpu_of(pid) for name, pid in servers.items()}
    consumer.start()
    producer.start()
    limit = opts.deadline_s + 4 * GRACE_S + 30
    produced_result = cast(ProducerResult | None, _receive(producer_end, limit))
    consumed_result = cast(ConsumerResult | None, _receive(consumer_end, limit))
    cpu = {name: cpu_of(pid) - cpu[name] for name, pid in servers.items()}
    for process in (producer, consumer):
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    if produced_result is None or consumed_result is None:
        raise SystemExit("a client process did not report")
    error = "; ".join(e for e in (produced_result["error"], consumed_result["error"]) if e)
    delivered = consumed_result["delivered"]
    elapsed = max(consumed_result["last_ns"] - produced_result["t0_ns"], 1) / 1e9 if delivered else 0.0
    latencies = sorted(consumed_result["latencies_ns"])

    def pick(q: float) -> float:
        return quantile_ms(latencies, q)

    clients = produced_result["cpu_s"] + consumed_result["cpu_s"]
    return RunResult(
        delivered,
        opts.count - delivered,
        elapsed,
        delivered / elapsed if elapsed else 0.0,
        pick(0.50),
        pick(0.99),
        pick(1.0),
        len(latencies),
        clients / elapsed if elapsed else 0.0,
        {name: used / elapsed if elapsed else 0.0 for name, used in cpu.items()},
        error,
    )


def _describe(result: RunResult) -> str:
    cores = ", ".join(
        f"{name} {used:.2f}" for name, used in {"clients": result.client_cores, **result.server_cores}.items()
    )
    text = (
        f"{result.rate:,.0f} msgs/s delivered ({result.delivered:,} in {result.elapsed_s:.2f} s); latency ms "
        f"p50 {result.p50_ms:.2f} p99 {result.p99_ms:.2f} max {result.max_ms:.2f} ({result.samples:,} samples); "
        f"lost {result.lost:,}; CPU cores: {cores}"
    )
    return f"{text}; FAILED: {result.error}" if result.error else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each scenario (the median is reported)")
    parser.add_argument(
        "--count",
        type=int,
        default=None,
        help="messages per run (default: 100,000 persistent, 200,000 non-persistent; with --rate: rate x --seconds)",
    )
    parser.add_argument(
        "--scenario",
        choices=[s.key for s in SCENARIOS],
        action="append",
        help="run only this scenario (may be repeated; default: all)",
    )
    parser.add_argument("--rate", type=int, default=0, help="publish at this many msgs/s (a latency run)")
    parser.add_argument("--seconds", type=int, default=10, help="length of a --rate run")
    parser.add_argument("--host", default="127.0.0.1", help="gateway host (with --port)")
    parser.add_argument("--port", type=int, default=None, help="STOMP port of a gateway already running")
    parser.add_argument("--deadline", type=int, default=120, help="seconds after which a client gives up")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="every connection over TLS (clients to the gateway, "
        "the gateway to its core), with throw-away certificates",
    )
    args = parser.parse_args()
    if args.runs < 1 or (args.count is not None and args.count < 1) or args.rate < 0 or args.seconds < 1:
        parser.error("--runs, --count and --seconds must be positive, --rate not negative")
    print(f"machine: {machine()}")
    scenarios = [s for s in SCENARIOS if not args.scenario or s.key in args.scenario]
    with gateway_target("stomp", stomp_gateway, args.host, args.port, {}, tls=args.tls) as (port, servers, ca_file):
        for scenario in scenarios:
            count = args.count or (args.rate * args.seconds if args.rate else scenario.count)
            paced = f" at {args.rate:,} msgs/s" if args.rate else ""
            label = f"{scenario.title} (ack {scenario.ack}){paced}"
            results = []
            for n in range(1, args.runs + 1):
                opts = RunOptions(
                    args.host,
                    port,
                    f"/queue/bench.{uuid.uuid4().hex[:12]}",
                    scenario.persistent,
                    scenario.ack,
                    count,
                    args.rate,
                    args.deadline,
                    ca_file,
                )
                result = run_once(opts, servers)
                results.append(result)
                print(f"{scenario.key} run {n}{paced}: {_describe(result)}", flush=True)
            median = replace(
                results[0],
                **{
                    name: statistics.median(getattr(r, name) for r in results)
                    for name in ("rate", "elapsed_s", "p50_ms", "p99_ms", "max_ms", "client_cores")
                },
            )
            rates = [r.rate for r in results]
            failed = sum(1 for r in results if r.error)
            print(
                f"{label.upper()} median {median.rate:,.0f} msgs/s delivered (min {min(rates):,.0f}, max "
                f"{max(rates):,.0f}) over {args.runs} runs of {count:,}; latency ms p50 {median.p50_ms:.2f} "
                f"p99 {median.p99_ms:.2f} max {median.max_ms:.2f}; lost {sum(r.lost for r in results):,} in all"
                + (f"; {failed} FAILED" if failed else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
