"""Paging benchmark: peak memory of a core node while an address pages gigabytes of messages.

Starts a core whose address `bench.paging` pages above `--limit-mib`, publishes `--gigabytes` of
non-durable 64 KiB messages with no consumer, then drains them all in order, sampling the core's resident
memory (VmRSS) throughout, and prints the peak against the limit:

    uv run python -m bench.paging_memory [--gigabytes 5] [--limit-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.node import core_node

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import M_BODY, new_message
from tridentmq_shared.runtime import run_main

SIZE = 64 * 1024


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def workload(port: int, pid: int, count: int) -> tuple[float, float, float]:
    peak = 0.0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    async with LinkClient("127.0.0.1", port) as client:
        await client.create_queue("bench.paging", durable=False)
        started = time.monotonic()
        messages = (new_message("bench.paging", n.to_bytes(8, "big") + bytes(SIZE - 8)) for n in range(count))
        confirms = await client.publish_batch(messages)
        await confirms[-1]
        published = time.monotonic() - started
        consumer = await client.subscribe("bench.paging", credit=64, auto_ack=True)
        expected = 0
        while expected < count:
            batch = await consumer.get_batch(timeout=30)
            if not batch:
                raise SystemExit(f"stalled after {expected} messages")
            for _, message in batch:
                if int.from_bytes(message[M_BODY][:8], "big") != expected:
                    raise SystemExit(f"out of order at {expected}")
                expected += 1
        drained = time.monotonic() - started - published
    sampler.cancel()
    return peak, published, drained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=5.0)
    parser.add_argument("--limit-mib", type=int, default=64)
    args = parser.parse_args()
    count = int(args.gigabytes * 2**30 / SIZE)
    config = (
        f'[[address_settings]]\nmatch = "bench.#"\nmax_size_bytes = {args.limit_mib << 20}\n'
        'address_full_policy = "PAGE"\n'
    )
    # A broker memory limit far above the address limit: only paging may keep the memory down.
    with (
        tempfile.TemporaryDirectory(prefix="tridentmq-paging-") as tmp,
        core_node(Path(tmp) / "core", config, broker_max_memory_bytes=str(8 << 30)) as core,
    ):
        idle = rss_mib(core.process.pid)
        peak, published, drained = run_main(workload(core.link_port, core.process.pid, count))
    print(
        f"{count:,} messages of 64 KiB ({args.gigabytes:g} GiB) paged against a {args.limit_mib} MiB address "
        f"limit: published in {published:.1f} s, drained in order in {drained:.1f} s"
    )
    print(
        f"PAGING MEMORY: core RSS idle {idle:.0f} MiB, peak {peak:.0f} MiB "
        f"(limit {args.limit_mib} MiB + {peak - idle - args.limit_mib:.0f} MiB above idle)"
    )


if __name__ == "__main__":
    main()
