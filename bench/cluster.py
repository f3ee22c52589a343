"""Cluster benchmarks: cross-node throughput under ON_DEMAND, redistribution of a backlog, and a 3-node
cluster's aggregate throughput, each next to the single-node figure for the same workload.

    uv run python -m bench.cluster [--runs 3] [--count 200000] [--backlog 100000]

- single node: one producer and one consumer process on one node (``tridentmq perf``'s workload: 100-byte
  messages, the producer keeps its publish window full, the consumer auto-acknowledges);
- ON_DEMAND A → B: the same, with the producer on node A and the consumer on node B of a 2-node cluster:
  every message is routed on A, forwarded (written through, or through A's store-and-forward queue when
  the link has no room for it), stored on B and delivered there;
- redistribution: ``--backlog`` durable messages queued on A with no consumer, then a consumer on B; the
  time from its subscription to the last message (including the 1 s redistribution delay);
- 3-node aggregate: a producer and a consumer on every node of a 3-node cluster, one queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.node import Core, core_node, machine

from tridentmq_shared.cli.perf import PerfOptions, run_once
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import M_ID, new_message

CLUSTER = {"cluster_user": "cluster", "cluster_password": "bench-secret"}


@contextmanager
def cluster(tmp: Path, count: int, **env: str) -> Iterator[list[Core]]:
    """``count`` core nodes clustered (each connects to the first), with more settings from ``env``."""
    with ExitStack() as stack:
        first = stack.enter_context(core_node(tmp / "node-0", **CLUSTER, **env))
        nodes = [first] + [
            stack.enter_context(
                core_node(tmp / f"node-{i}", cluster_connectors=f"127.0.0.1:{first.link_port}", **CLUSTER, **env)
            )
            for i in range(1, count)
        ]
        deadline = time.monotonic() + 30
        while any(len(json.loads(n.get("/api/cluster"))["members"]) != count for n in nodes):
            if time.monotonic() > deadline:
                raise SystemExit("the cluster did not form in 30 s")
            time.sleep(0.05)
        yield nodes


def wait_for_remote_consumer(node: Core, queue: str, consumers: int = 1) -> None:
    deadline = time.monotonic() + 30
    while sum(json.loads(node.get("/api/cluster"))["remote_consumers"].get(queue, {}).values()) < consumers:
        if time.monotonic() > deadline:
            raise SystemExit(f"node never learned of the consumer of {queue}")
        time.sleep(0.02)


def perf(node: Core, count: int, durable: bool, consumer: Core | None = None) -> float:
    opts = PerfOptions(
        "127.0.0.1",
        node.link_port,
        None,
        None,
        count,
        100,
        durable=durable,
        rate=0,
        window=10_000,
        consumer_port=consumer.link_port if consumer is not None else 0,
    )
    wait = (lambda queue: wait_for_remote_consumer(node, queue)) if consumer is not None else None
    result = run_once(opts, before_producing=wait)
    if result["received"] != count:
        raise SystemExit(f"only {result['received']} of {count} messages arrived")
    return float(result["rate"])


async def redistribution(a: Core, b: Core, backlog: int) -> tuple[float, float]:
    """Seconds from the consumer's subscription on B to its last message; and the publishing rate on A."""
    queue = f"moved.{time.monotonic_ns()}"
    async with LinkClient("127.0.0.1", a.link_port) as producer:
        started = time.monotonic()
        messages = (new_message(queue, b"x" * 100, durable=True) for _ in range(backlog))
        await asyncio.gather(*await producer.publish_batch(messages))
        publish_rate = backlog / (time.monotonic() - started)
    async with LinkClient("127.0.0.1", b.link_port) as client:
        subscribed = time.monotonic()
        consumer = await client.subscribe(queue, credit=10_000)
        received = 0
        while received < backlog:
            batch = await consumer.get_batch(timeout=60)
            if not batch:
                raise SystemExit(f"only {received} of {backlog} messages were redistributed")
            received += len(batch)
            consumer.ack_ids([m[M_ID] for _, m in batch])
        return time.monotonic() - subscribed, publish_rate


def _aggregate_worker(producer_port: int, consumer_port: int, queue: str, count: int, total: int, out: Any) -> None:
    async def work() -> tuple[int, float]:
        async with (
            LinkClient("127.0.0.1", consumer_port) as receiving,
            PipelinedLink("127.0.0.1", producer_port) as sending,
        ):
            consumer = await receiving.subscribe(queue, credit=10_000, auto_ack=True)
            out.send("ready")
            out.recv()  # go
            body = b"x" * 100
            received = 0

            async def produce() -> None:
                for _ in range(count):
                    message = new_message(queue, body)
                    while sending.send_if_open(message) < 0:
                        await sending.wait_for_credit()

            task = asyncio.create_task(produce())
            while True:
                batch = await consumer.get_batch(timeout=2)
                if not batch:
                    break
                received += len(batch)
            await task
            return received, time.monotonic()

    out.send(asyncio.run(work()))


def aggregate(nodes: list[Core], count: int) -> float:
    """A producer and a consumer on every node, one queue: messages delivered per second, all nodes."""
    queue = f"spread.{time.monotonic_ns()}"
    ctx = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for node in nodes:
        mine, theirs = ctx.Pipe()
        worker = ctx.Process(
            target=_aggregate_worker,
            args=(node.link_port, node.link_port, queue, count, count * len(nodes), theirs),
            daemon=True,
        )
        worker.start()
        pipes.append(mine)
        workers.append(worker)
    for pipe in pipes:
        pipe.recv()
    for node in nodes if len(nodes) > 1 else ():
        wait_for_remote_consumer(node, queue, len(nodes) - 1)
    started = time.monotonic()
    for pipe in pipes:
        pipe.send("go")
    results = [pipe.recv() for pipe in pipes]
    for worker in workers:
        worker.join()
    received = sum(r[0] for r in results)
    ended = max(r[1] for r in results) - 2.0  # the last worker waited 2 s for a batch that never came
    if received != count * len(nodes):
        print(f"  (aggregate: {received:,} of {count * len(nodes):,} delivered)")
    return float(received / (ended - started))


def median(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} msgs/s (min {min(values):,.0f}, max {max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (the median is reported)")
    parser.add_argument("--count", type=int, default=200_000, help="messages per throughput run")
    parser.add_argument("--backlog", type=int, default=100_000, help="messages to redistribute")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tridentmq-cluster-") as tmp:
        for durable in (False, True):
            kind = "durable" if durable else "non-durable"
            with core_node(Path(tmp) / f"single-{kind}") as single:
                alone = [perf(single, args.count, durable) for _ in range(args.runs)]
            with cluster(Path(tmp) / f"pair-{kind}", 2) as (a, b):
                across = [perf(a, args.count, durable, consumer=b) for _ in range(args.runs)]
            ratio = statistics.median(across) / statistics.median(alone)
            print(f"{kind:>11} single node      {median(alone)}")
            print(f"{kind:>11} ON_DEMAND A → B  {median(across)}  = {ratio:.0%} of single node")
        with cluster(Path(tmp) / "redistribution", 2) as (a, b):
            seconds, publish_rate = asyncio.run(redistribution(a, b, args.backlog))
            print(
                f"redistribution: {args.backlog:,} durable messages queued on A (published at "
                f"{publish_rate:,.0f} msgs/s) reached a new consumer on B in {seconds:.2f} s "
                f"(1 s redistribution delay included)"
            )
        with core_node(Path(tmp) / "single-aggregate") as single:
            one = [aggregate([single], args.count) for _ in range(args.runs)]
        with cluster(Path(tmp) / "three", 3) as nodes:
            three = [aggregate(nodes, args.count // 3) for _ in range(args.runs)]
        print(f"aggregate non-durable, 1 node (1 producer, 1 consumer)      {median(one)}")
        print(f"aggregate non-durable, 3 nodes (a producer and a consumer on each) {median(three)}")


if __name__ == "__main__":
    main()
