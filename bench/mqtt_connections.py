"""Connection-scale benchmark of the MQTT gateway: many clients, each CONNECTs, SUBSCRIBEs to its own topic and
receives one message.

N MQTT 3.1.1 clients (clean sessions, no keep-alive) connect to one gateway from ``--procs`` client processes
(raw asyncio sockets, at most ``--concurrency`` handshakes under way per process): each sends CONNECT, waits
for its CONNACK, sends SUBSCRIBE (QoS 0) to ``conn/<run>/<i>``, waits for its SUBACK. The connect + subscribe
rate is N / the time from the start to the last SUBACK; the CPU time the core and the gateway spent meanwhile,
per client, says what it costs whatever else the machine runs. With every client subscribed, the script reads the
resident memory (VmRSS) and open file descriptors of the core and the gateway, and the core's sessions and
link connections; then one publisher sends one message to each client's topic, and every client must receive
its own. Memory per connection is (RSS with N clients - RSS before the first) / N.

A gateway holds one descriptor per client and the clients one each, so the clients run in processes of their
own: each process's open-file limit then counts only its share. The script starts its own core (throw-away
data directory) and MQTT gateway on free loopback ports, with ``listener.max_connections`` above N.

    uv run python -m bench.mqtt_connections --count 19000 [--procs 2] [--concurrency 500] [--shared-links 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import tempfile
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from bench.node import Core, core_node, cpu_of, machine, mqtt_gateway

from tridentmq_shared.runtime import raise_open_file_limit, run_main

CONNACK, SUBACK, PUBLISH = 2, 9, 3
WAIT_S = 120.0  # longest wait for one client's CONNACK, SUBACK or message


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(2, "big") + data


def connect_packet(client_id: str, *, clean: bool = True) -> bytes:
    """An MQTT 3.1.1 CONNECT without keep-alive; ``clean`` False asks for a persistent session."""
    body = _string("MQTT") + bytes([4, 0x02 if clean else 0x00]) + (0).to_bytes(2, "big") + _string(client_id)
    return b"\x10" + _length(len(body)) + body


def subscribe_packet(topic: str, qos: int = 0) -> bytes:
    body = (1).to_bytes(2, "big") + _string(topic) + bytes([qos])
    return b"\x82" + _length(len(body)) + body


def publish_packet(topic: str, payload: bytes, packet_id: int = 0) -> bytes:
    """A PUBLISH: QoS 0, or QoS 1 with a ``packet_id``."""
    if not packet_id:
        body = _string(topic) + payload
        return b"\x30" + _length(len(body)) + body
    body = _string(topic) + packet_id.to_bytes(2, "big") + payload
    return b"\x32" + _length(len(body)) + body


async def read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(packet type, body) of the next packet."""
    head, body = await read_packet_with_flags(reader)
    return head >> 4, body


async def read_packet_with_flags(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(first byte: packet type and flags, body) of the next packet."""
    head = (await reader.readexactly(1))[0]
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return head, await reader.readexactly(length)


async def _clients(
    port: int, run: str, first: int, count: int, concurrency: int, start: MpEvent, out: Connection
) -> None:
    """``count`` clients from number ``first``: report (subscribed, refused, seconds to the last SUBACK), then
    (received) once each got its message or waited ``WAIT_S``, then hold the connections until told."""
    handshakes = asyncio.Semaphore(concurrency)
    writers: list[asyncio.StreamWriter] = []
    refused = 0
    received = 0
    subscribed = 0
    last_suback = 0.0
    handshakes_done = asyncio.Event()  # every client subscribed or refused

    async def handshake(i: int) -> asyncio.StreamReader | None:
        """The client's reader once subscribed; None when refused (or failed)."""
        async with handshakes:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writers.append(writer)
                writer.write(connect_packet(f"c{run}-{i}"))
                kind, body = await asyncio.wait_for(read_packet(reader), WAIT_S)
                if kind != CONNACK or body[1] != 0:
                    return None
                writer.write(subscribe_packet(f"conn/{run}/{i}"))
                kind, body = await asyncio.wait_for(read_packet(reader), WAIT_S)
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                return None
            return reader if kind == SUBACK and body[-1] == 0 else None

    async def one(i: int) -> None:
        nonlocal refused, received, subscribed, last_suback
        reader = await handshake(i)
        if reader is None:
            refused += 1
        else:
            subscribed += 1
            last_suback = time.perf_counter()
        if subscribed + refused == count:
            handshakes_done.set()
        if reader is None:
            return
        try:
            kind, _ = await asyncio.wait_for(read_packet(reader), WAIT_S * 2)
            if kind == PUBLISH:
                received += 1
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass

    raise_open_file_limit()
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(first + i)) for i in range(count)]
    await handshakes_done.wait()
    out.send((subscribed, refused, last_suback - t0 if subscribed else 0.0))
    await asyncio.gather(*tasks)
    out.send(received)
    await asyncio.get_running_loop().run_in_executor(None, out.recv)  # hold until the parent is done
    for writer in writers:
        writer.close()


def _client_process(*args: Any) -> None:
    run_main(_clients(*args))


def proc_usage(pid: int) -> dict[str, int]:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"rss_kib": rss_kib, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def _publish_all(port: int, run: str, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_packet(f"p{run}"))
    await read_packet(reader)
    for start in range(0, count, 1000):
        writer.write(
            b"".join(publish_packet(f"conn/{run}/{i}", b"hello") for i in range(start, min(count, start + 1000)))
        )
        await writer.drain()
    writer.write(b"\xc0\x00")  # PINGREQ: its PINGRESP says every PUBLISH before it was read
    await read_packet(reader)
    writer.close()


def _status(core: Core) -> dict[str, Any]:
    status: dict[str, Any] = json.loads(core.get("/api/status"))
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=500, help="handshakes under way per client process")
    parser.add_argument(
        "--shared-links", type=int, default=1, help="the gateway's core.shared_links (0: a link per client)"
    )
    args = parser.parse_args()
    run = uuid.uuid4().hex[:6]
    limit = raise_open_file_limit()
    print(
        f"{machine()}; open-file limit {limit}; {args.count} MQTT 3.1.1 clients from {args.procs} processes, "
        f"core.shared_links = {args.shared_links}"
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        core_node(Path(tmp) / "core", link_max_connections=str(args.count + 100)) as core,
        mqtt_gateway(
            core,
            Path(tmp) / "gw",
            listener_max_connections=str(args.count + 100),
            core_shared_links=str(args.shared_links),
        ) as gateway,
    ):
        before = {"core": proc_usage(core.process.pid), "gateway": proc_usage(gateway.process.pid)}
        start = multiprocessing.Event()
        pipes: list[tuple[Connection, multiprocessing.Process]] = []
        try:
            share = -(-args.count // args.procs)
            for p in range(args.procs):
                first = p * share
                count = min(share, args.count - first)
                here, there = multiprocessing.Pipe()
                process = multiprocessing.Process(
                    target=_client_process, args=(gateway.port, run, first, count, args.concurrency, start, there)
                )
                process.start()
                pipes.append((here, process))
            time.sleep(1.0)  # the client processes are up and waiting (their start is the event, not this)
            cpu_before = {"core": cpu_of(core.process.pid), "gateway": cpu_of(gateway.process.pid)}
            start.set()
            results = [here.recv() for here, _ in pipes]
            cpu = {
                "core": cpu_of(core.process.pid) - cpu_before["core"],
                "gateway": cpu_of(gateway.process.pid) - cpu_before["gateway"],
            }
            subscribed = sum(r[0] for r in results)
            refused = sum(r[1] for r in results)
            elapsed = max(r[2] for r in results)
            after = {"core": proc_usage(core.process.pid), "gateway": proc_usage(gateway.process.pid)}
            status = _status(core)
            asyncio.run(_publish_all(gateway.port, run, args.count))
            received = sum(here.recv() for here, _ in pipes)
            for here, process in pipes:
                here.send("done")
                process.join(60)
        finally:  # the clients never outlive the run, whatever failed
            for _, process in pipes:
                if process.is_alive():
                    process.terminate()
    print(f"subscribed {subscribed} / {args.count} (refused {refused}), received {received} / {args.count}")
    print(f"connect + subscribe: {subscribed / elapsed:,.0f} /s ({elapsed:.1f} s for {subscribed})")
    print(f"core: {status['connections']} sessions over {status['links']} link connections")
    for name in ("gateway", "core"):
        grown = after[name]["rss_kib"] - before[name]["rss_kib"]
        print(
            f"{name}: RSS {before[name]['rss_kib'] / 1024:.0f} -> {after[name]['rss_kib'] / 1024:.0f} MiB, "
            f"{grown * 1024 / max(subscribed, 1) / 1024:.1f} KiB per connection; "
            f"fds {before[name]['fds']} -> {after[name]['fds']}; CPU {cpu[name] * 1e6 / max(subscribed, 1):.0f} µs "
            "per connect + subscribe"
        )


if __name__ == "__main__":
    main()
