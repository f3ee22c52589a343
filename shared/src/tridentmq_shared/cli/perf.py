"""``tridentmq perf``: a link-level benchmark with one producer process and one consumer process.

Throughput: the producer publishes as fast as its publish window allows; the rate is messages delivered
to the consumer divided by the time from the first publish to the last delivery. Latency: the producer
paces itself at a fixed rate and the consumer measures publish-to-delivery time from a monotonic
timestamp in the body (one clock: both processes are on this machine).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import M_BODY, RoutingType, new_message
from tridentmq_shared.runtime import run_main
from tridentmq_shared.tls import ClientTls, TlsSection

_STAMP = struct.Struct(">q")


@dataclass(frozen=True)
class PerfOptions:
    host: str
    port: int
    user: str | None
    password: str | None
    count: int
    size: int
    durable: bool
    rate: int  # 0 = as fast as possible
    window: int
    consumer_port: int = 0  # another node of a cluster for the consumer (0: the producer's node)
    queue: str = ""  # an existing queue to use (empty: a fresh one is made)
    tls: TlsSection | None = None  # connect over TLS with these files


def _tls(opts: PerfOptions) -> ClientTls | None:
    return ClientTls(opts.tls) if opts.tls is not None else None


def _body(size: int) -> bytearray:
    return bytearray(max(size, _STAMP.size))


async def _produce(opts: PerfOptions, queue: str) -> dict[str, Any]:
    async with PipelinedLink(  # the relays' calls: no coroutine or future per message unless durable
        opts.host, opts.port, user=opts.user, password=opts.password, client_name="perf-producer", tls=_tls(opts)
    ) as client:
        body = _body(opts.size)
        prototype = new_message(queue, b"", durable=opts.durable)
        confirms = []
        start = time.monotonic_ns()
        interval = 1e9 / opts.rate if opts.rate else 0.0
        last = opts.count - 1
        for i in range(opts.count):
            if interval:
                delay = (start + i * interval - time.monotonic_ns()) / 1e9
                if delay > 0.0005:
                    await asyncio.sleep(delay)
            _STAMP.pack_into(body, 0, time.monotonic_ns())
            message = prototype.copy()
            message[M_BODY] = bytes(body)
            if opts.durable or i == last:
                confirms.append(await client.send(message))  # durable: wait for every confirm (the store's promise)
                continue
            while client.send_if_open(message) < 0:
                await client.wait_for_credit()
        # The last publishes go now: gathering a run's hundreds of thousands of futures holds the loop for a
        # quarter of a second, and they would wait that long in the link's output (the run's largest latency).
        client.flush()
        await asyncio.gather(*confirms)
        return {"start_ns": start, "confirmed_ns": time.monotonic_ns()}


async def _consume(opts: PerfOptions, queue: str, ready: Connection) -> dict[str, Any]:
    async with LinkClient(
        opts.host,
        opts.consumer_port or opts.port,
        user=opts.user,
        password=opts.password,
        client_name="perf-consumer",
        tls=_tls(opts),
    ) as client:
        consumer = await client.subscribe(queue, credit=opts.window, auto_ack=True)
        ready.send("ready")
        latencies: list[int] = []
        sample_every = 1 if opts.rate else max(1, opts.count // 20_000)
        received = 0
        unpack = _STAMP.unpack_from
        while received < opts.count:
            batch = await consumer.get_batch(timeout=30)
            if not batch:
                break
            now = time.monotonic_ns()
            for _, message in batch[::sample_every] if sample_every > 1 else batch:
                latencies.append(now - unpack(message[M_BODY])[0])
            received += len(batch)
        return {"received": received, "end_ns": time.monotonic_ns(), "latencies": latencies}


def _producer_main(opts: PerfOptions, queue: str, out: Connection) -> None:
    out.send(run_main(_produce(opts, queue)))


def _consumer_main(opts: PerfOptions, queue: str, out: Connection) -> None:
    out.send(run_main(_consume(opts, queue, out)))


async def _make_queue(opts: PerfOptions) -> str:
    if opts.queue:
        return opts.queue
    queue = f"perf.{uuid.uuid4().hex[:8]}"
    async with LinkClient(
        opts.host,
        opts.consumer_port or opts.port,
        user=opts.user,
        password=opts.password,
        client_name="perf-setup",
        tls=_tls(opts),
    ) as client:
        await client.create_queue(queue, routing_type=RoutingType.ANYCAST, durable=opts.durable, auto_delete=True)
    return queue


def run_once(opts: PerfOptions, before_producing: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One producer process and one consumer process against a fresh queue; returns their measurements.
    ``before_producing(queue)`` runs once the consumer is subscribed (a cluster benchmark waits there until
    the producer's node knows of the consumer)."""
    queue = asyncio.run(_make_queue(opts))
    ctx = multiprocessing.get_context("spawn")
    consumer_end, consumer_mine = ctx.Pipe()
    producer_end, producer_mine = ctx.Pipe()
    consumer = ctx.Process(target=_consumer_main, args=(opts, queue, consumer_mine), daemon=True)
    consumer.start()
    if not consumer_end.poll(30) or consumer_end.recv() != "ready":
        consumer.kill()
        raise RuntimeError("the consumer did not subscribe within 30 s")
    if before_producing is not None:
        before_producing(queue)
    producer = ctx.Process(target=_producer_main, args=(opts, queue, producer_mine), daemon=True)
    producer.start()
    produced = producer_end.recv()
    consumed = consumer_end.recv()
    producer.join()
    consumer.join()
    elapsed = (consumed["end_ns"] - produced["start_ns"]) / 1e9
    latencies_ms = sorted(x / 1e6 for x in consumed["latencies"])
    return {
        "received": consumed["received"],
        "elapsed_s": elapsed,
        "rate": consumed["received"] / elapsed,
        "latency_ms": _percentiles(latencies_ms),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}

    def pick(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "p50": pick(0.50),
        "p90": pick(0.90),
        "p99": pick(0.99),
        "p99.9": pick(0.999),
        "max": values[-1],
        "mean": statistics.fmean(values),
    }


def describe(result: dict[str, Any], opts: PerfOptions) -> str:
    kind = "durable" if opts.durable else "non-durable"
    lat = result["latency_ms"]
    head = f"{result['received']:,} {kind} messages of {opts.size} bytes"
    if opts.rate:
        head += f" at {opts.rate:,} msgs/s"
    lines = [f"{head}: {result['rate']:,.0f} msgs/s delivered ({result['elapsed_s']:.2f} s)"]
    if lat:
        lines.append("latency ms: " + "  ".join(f"{k} {v:.3f}" for k, v in lat.items()))
    return "\n".join(lines)
