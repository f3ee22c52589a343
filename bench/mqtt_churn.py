"""Device churn through the MQTT gateway: what the core keeps of clients that came and went.

N MQTT 3.1.1 clients with clean sessions, each with a client id and a topic of its own, connect, subscribe at
QoS 0, and DISCONNECT, at most ``--concurrency`` at once (raw asyncio sockets, from ``client_source``
addresses). Once all are gone the script reports the rate, the addresses and queues the core still holds (one
of each is the retained store's), its resident memory (VmRSS) before and after, and its CPU time per client.
IoT fleets reconnect with fresh client ids all day: what stays behind per client grows without bound.

    uv run python -m bench.mqtt_churn --count 20000 [--concurrency 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

from bench.mqtt_packets import CONNACK, SUBACK, connect_packet, read_packet, subscribe_packet
from bench.node import client_source, core_node, cpu_of, machine, mqtt_gateway, proc_usage

DISCONNECT = b"\xe0\x00"


async def _one(port: int, run: str, i: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=client_source(i))
    try:
        writer.write(connect_packet(f"churn-{run}-{i}"))
        kind, _ = await read_packet(reader)
        if kind != CONNACK:
            raise ConnectionError(f"client {i}: packet type {kind} instead of CONNACK")
        writer.write(subscribe_packet(f"churn/{run}/{i}", 0))
        kind, _ = await read_packet(reader)
        if kind != SUBACK:
            raise ConnectionError(f"client {i}: packet type {kind} instead of SUBACK")
        writer.write(DISCONNECT)
        await writer.drain()
    finally:
        writer.close()


async def _churn(port: int, count: int, concurrency: int) -> None:
    run = uuid.uuid4().hex[:6]
    slots = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        async with slots:
            await _one(port, run, i)

    await asyncio.gather(*(guarded(i) for i in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=100, help="clients under way at once")
    args = parser.parse_args()
    print(f"{machine()}; {args.count} MQTT 3.1.1 clean-session clients, each: connect, subscribe, disconnect")
    with (
        tempfile.TemporaryDirectory() as tmp,
        core_node(Path(tmp) / "core") as core,
        mqtt_gateway(core, Path(tmp) / "gw") as gateway,
    ):
        pid = core.process.pid
        rss_before = proc_usage(pid)["rss_kib"]
        cpu_before = cpu_of(pid)
        started = time.perf_counter()
        asyncio.run(_churn(gateway.port, args.count, args.concurrency))
        elapsed = time.perf_counter() - started
        time.sleep(2.0)  # the gateway's last sessions end in the core
        addresses = len(json.loads(core.get("/api/addresses")))
        queues = len(json.loads(core.get("/api/queues")))
        rss_after = proc_usage(pid)["rss_kib"]
        cpu = cpu_of(pid) - cpu_before
    print(f"churn: {args.count / elapsed:,.0f} clients/s ({elapsed:.1f} s for {args.count})")
    print(f"core afterwards: {addresses} addresses, {queues} queues (the retained store's are one each)")
    print(
        f"core: RSS {rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB "
        f"({(rss_after - rss_before) * 1024 / args.count:,.0f} B per client gone); "
        f"CPU {cpu * 1e6 / args.count:.0f} µs per client"
    )


if __name__ == "__main__":
    main()
