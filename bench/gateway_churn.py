"""Gateway memory under connection churn: waves of clients that connect, subscribe and leave.

Each wave, ``--count`` clients of the protocol (as ``bench.connections`` makes them: MQTT 3.1.1 clean sessions,
STOMP 1.2, AMQP 1.0) connect to one gateway (at most ``--concurrency`` handshakes under way), each subscribes to
a topic of its own, and then all of them leave at once; ``SETTLE_S`` later the script reads the gateway's resident
memory (VmRSS). A gateway that frees what its ended sessions held stays flat after the first wave; one that
keeps it until some collection grows from wave to wave. (What the core keeps of clients that came and went one
by one is ``bench.mqtt_churn``'s.)

    uv run python -m bench.gateway_churn [--protocol mqtt|stomp|amqp] [--waves 6] [--count 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench.connections import PROTOCOLS
from bench.node import client_source, core_node, machine, proc_usage

SETTLE_S = 3.0  # after a wave left: the clean-ups of its sessions (their requests to the core) are done


async def _wave(protocol: str, port: int, wave: int, count: int, concurrency: int) -> None:
    subscribe = PROTOCOLS[protocol].subscribe
    handshakes = asyncio.Semaphore(concurrency)
    writers: list[asyncio.StreamWriter] = []

    async def one(i: int) -> None:
        async with handshakes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=client_source(i))
            writers.append(writer)
            if not await subscribe(reader, writer, f"churn{wave}", i):
                raise SystemExit(f"client {i} of wave {wave} was not subscribed")

    await asyncio.gather(*(one(i) for i in range(count)))
    for writer in writers:
        writer.close()
    await asyncio.sleep(SETTLE_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="mqtt")
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--count", type=int, default=3000, help="clients per wave")
    parser.add_argument("--concurrency", type=int, default=200, help="handshakes under way at once")
    args = parser.parse_args()
    print(f"{machine()}; {args.waves} waves of {args.count} {PROTOCOLS[args.protocol].name} clients, one gateway")
    with (
        tempfile.TemporaryDirectory() as tmp,
        core_node(Path(tmp) / "core") as core,
        PROTOCOLS[args.protocol].gateway(core, Path(tmp) / "gateway") as gateway,
    ):
        pid = gateway.process.pid
        sizes = [proc_usage(pid)["rss_kib"]]
        for wave in range(args.waves):
            asyncio.run(_wave(args.protocol, gateway.port, wave, args.count, args.concurrency))
            sizes.append(proc_usage(pid)["rss_kib"])
    print("gateway RSS before, then after each wave: " + " -> ".join(f"{kib / 1024:.0f}" for kib in sizes) + " MiB")


if __name__ == "__main__":
    main()
