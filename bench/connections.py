"""Connection-scale benchmark of a gateway: many clients, each connects, subscribes to its own topic and
receives one message.

N clients connect to one gateway (``--protocol mqtt``: MQTT 3.1.1, clean sessions, no keep-alive; ``stomp``: STOMP
1.2 without heart-beats; ``amqp``: AMQP 1.0 without SASL or idle timeout) from ``--procs`` client processes (raw
asyncio sockets, at most ``--concurrency`` handshakes under way per process): each logs in, waits for the answer,
subscribes to a topic of its own (MQTT QoS 0 ``conn/<run>/<i>``, STOMP ``/topic/conn.<run>.<i>`` with a receipt,
AMQP a receiving link from ``topic://conn.<run>.<i>``) and waits for the SUBACK, RECEIPT or the gateway's ATTACH
(with its source: not refused). The connect + subscribe rate is N / the time from the start to the last one; the
CPU time the core and the gateway spent meanwhile, per client, says what it costs whatever else the machine runs.
With every client subscribed, the script reads the resident memory (VmRSS) and open file descriptors of the core
and the gateway, and the core's sessions and link connections; then one publisher sends one message to each
client's topic (AMQP: through the core's link), and every client must receive its own. Memory per connection is
(RSS with N clients - RSS before the first) / N, read once all are subscribed and again once each had its message
(what an idle device costs after some traffic, plus what the allocators kept of the publisher's burst). Last, the
CPU each process spends over ``IDLE_S`` seconds while every client stays connected and quiet: what a fleet of idle
devices costs the broker by itself (periodic work that grows with the sessions shows there). Then every client
leaves at once, and for ``LEAVE_S`` seconds the script asks the (first) gateway's ``/readyz`` every
``PROBE_EVERY_S``: how long its answers take says how long the gateway's event loop stood still while it ended
all those sessions (a loop that stands still for the core link's heartbeat timeout loses the link); the CPU each
process spent meanwhile, per client, is what a departure costs.

A gateway holds one descriptor per client and the clients one each, so the clients run in processes of their
own: each process's open-file limit then counts only its share. The script starts its own core (throw-away
data directory) and gateway on free loopback ports, with ``listener.max_connections`` above N; or, with ``--port``
and ``--broker-pid``, measures another MQTT or STOMP broker already running there with the same clients (the
figures side by side with a peer's).

With ``--gateways G`` the script starts G gateways of the protocol on one core and client number i connects to
gateway i mod G: how a fleet of gateways scales past one process's open-file limit, and what the core costs per
session at that many sessions. With ``--nodes N`` the core is a cluster of N nodes: the gateways link to the
first and learn of the others, and each node's CPU and memory are reported per client (what a connect costs the
nodes that hold no session of it, too).

    uv run python -m bench.connections --count 19000 [--protocol mqtt|stomp|amqp] [--procs 2] [--concurrency 500]
    uv run python -m bench.connections --count 100000 --gateways 6 --procs 6
    uv run python -m bench.connections --count 18000 --nodes 2
    uv run python -m bench.connections --count 19000 --port 22883 --broker-pid <its pid>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from bench.amqp_gateway import (
    AMQP_HEADER,
    ATTACH,
    BEGIN,
    FLOW,
    MAX_FRAME,
    OPEN,
    SOURCE,
    TARGET,
    TRANSFER,
    WINDOW,
    frame,
)
from bench.cluster import cluster
from bench.mqtt_packets import CONNACK, PUBLISH, SUBACK, connect_packet, publish_packet, read_packet, subscribe_packet
from bench.node import (
    Core,
    Gateway,
    Probed,
    ReadyProbe,
    amqp_gateway,
    client_source,
    core_node,
    cpu_of,
    machine,
    mqtt_gateway,
    proc_usage,
    stomp_gateway,
)

from tridentmq_amqp.protocol.types import Described, UByte, UInt, ULong, UShort, decode
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import RoutingType, new_message
from tridentmq_shared.runtime import raise_open_file_limit, run_main

WAIT_S = 120.0  # longest wait for one client's login, subscription or message
IDLE_S = 10.0  # how long the idle clients are watched for the CPU their connections cost
LEAVE_S = 10.0  # how long the gateway is probed from the moment every client leaves
PROBE_EVERY_S = 0.02
BATCH = 1000  # messages the publisher writes at once


# ---------------------------------------------------------------------- MQTT
async def _mqtt_subscribe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, run: str, i: int) -> bool:
    writer.write(connect_packet(f"c{run}-{i}"))
    kind, body = await asyncio.wait_for(read_packet(reader), WAIT_S)
    if kind != CONNACK or body[1] != 0:
        return False
    writer.write(subscribe_packet(f"conn/{run}/{i}"))
    kind, body = await asyncio.wait_for(read_packet(reader), WAIT_S)
    return kind == SUBACK and body[-1] == 0


async def _mqtt_received(reader: asyncio.StreamReader) -> bool:
    kind, _ = await read_packet(reader)
    return kind == PUBLISH


async def _mqtt_publish_all(port: int, _core_port: int, run: str, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_packet(f"p{run}"))
    await read_packet(reader)
    for start in range(0, count, BATCH):
        writer.write(
            b"".join(publish_packet(f"conn/{run}/{i}", b"hello") for i in range(start, min(count, start + BATCH)))
        )
        await writer.drain()
    writer.write(b"\xc0\x00")  # PINGREQ: its PINGRESP says every PUBLISH before it was read
    await read_packet(reader)
    writer.close()


# ---------------------------------------------------------------------- STOMP
def _stomp_frame(command: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = "".join(f"{name}:{value}\n" for name, value in headers.items())
    return f"{command}\n{head}\n".encode() + body + b"\0"


async def _stomp_read(reader: asyncio.StreamReader) -> str:
    """The command of the next frame (heart-beat newlines between frames skipped)."""
    frame = await reader.readuntil(b"\0")
    return frame.lstrip(b"\r\n").split(b"\n", 1)[0].decode()


_STOMP_CONNECT = _stomp_frame("CONNECT", {"accept-version": "1.2", "host": "/", "heart-beat": "0,0"})


async def _stomp_subscribe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, run: str, i: int) -> bool:
    writer.write(_STOMP_CONNECT)
    if await asyncio.wait_for(_stomp_read(reader), WAIT_S) != "CONNECTED":
        return False
    writer.write(_stomp_frame("SUBSCRIBE", {"id": "0", "destination": f"/topic/conn.{run}.{i}", "receipt": "s"}))
    return await asyncio.wait_for(_stomp_read(reader), WAIT_S) == "RECEIPT"


async def _stomp_received(reader: asyncio.StreamReader) -> bool:
    return await _stomp_read(reader) == "MESSAGE"


async def _stomp_publish_all(port: int, _core_port: int, run: str, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_STOMP_CONNECT)
    await _stomp_read(reader)
    for start in range(0, count, BATCH):
        writer.write(
            b"".join(
                _stomp_frame("SEND", {"destination": f"/topic/conn.{run}.{i}"}, b"hello")
                for i in range(start, min(count, start + BATCH))
            )
        )
        await writer.drain()
    writer.write(_stomp_frame("DISCONNECT", {"receipt": "end"}))  # its RECEIPT: every SEND before it was taken
    await _stomp_read(reader)
    writer.close()


# ---------------------------------------------------------------------- AMQP 1.0
_FRAME_HEAD = struct.Struct(">IBBH")  # size, doff, type, channel


async def _amqp_frame(reader: asyncio.StreamReader) -> tuple[int, list[Any]]:
    """The performative code and fields of the next frame (heartbeats skipped)."""
    while True:
        size, doff, _, _ = _FRAME_HEAD.unpack(await reader.readexactly(8))
        body = await reader.readexactly(size - 8)
        if 4 * doff - 8 < len(body):
            performative, _ = decode(body, 4 * doff - 8)
            assert isinstance(performative, Described)
            return int(performative.descriptor), list(performative.value)


async def _amqp_subscribe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, run: str, i: int) -> bool:
    source = Described(ULong(SOURCE), [f"topic://conn.{run}.{i}"])
    writer.write(
        AMQP_HEADER
        + frame(OPEN, [f"c{run}-{i}", "localhost", UInt(MAX_FRAME), UShort(0)])
        + frame(BEGIN, [None, UInt(0), UInt(WINDOW), UInt(WINDOW)])
        + frame(ATTACH, [f"r{i}", UInt(0), True, UByte(0), UByte(0), source, Described(ULong(TARGET), [])])
    )
    if await asyncio.wait_for(reader.readexactly(8), WAIT_S) != AMQP_HEADER:
        return False
    while True:
        code, fields = await asyncio.wait_for(_amqp_frame(reader), WAIT_S)
        if code == ATTACH:
            break
        if code not in (OPEN, BEGIN):
            return False
    if len(fields) < 6 or fields[5] is None:  # no source: refused (a detach follows)
        return False
    # credit 1 for the one message (next-incoming-id, windows, handle, delivery-count, link-credit)
    writer.write(frame(FLOW, [UInt(0), UInt(WINDOW), UInt(0), UInt(WINDOW), UInt(0), UInt(0), UInt(1)]))
    return True


async def _amqp_received(reader: asyncio.StreamReader) -> bool:
    while True:
        code, _ = await _amqp_frame(reader)
        if code == TRANSFER:
            return True
        if code != FLOW:
            return False


async def _amqp_publish_all(_port: int, core_port: int, run: str, count: int) -> None:
    """Through the core's link: the gateway's side under test is the receivers'."""
    async with LinkClient("127.0.0.1", core_port) as client:
        messages = (new_message(f"conn.{run}.{i}", b"hello", routing=int(RoutingType.MULTICAST)) for i in range(count))
        await asyncio.gather(*await client.publish_batch(messages))


@dataclass(frozen=True)
class Protocol:
    name: str
    gateway: Callable[..., AbstractContextManager[Gateway]]
    subscribe: Callable[[asyncio.StreamReader, asyncio.StreamWriter, str, int], Any]  # -> bool: subscribed
    received: Callable[[asyncio.StreamReader], Any]  # -> bool: the next thing read is the client's message
    publish_all: Callable[[int, int, str, int], Any]  # gateway port, core port, run, count


PROTOCOLS = {
    "mqtt": Protocol("MQTT 3.1.1", mqtt_gateway, _mqtt_subscribe, _mqtt_received, _mqtt_publish_all),
    "stomp": Protocol("STOMP 1.2", stomp_gateway, _stomp_subscribe, _stomp_received, _stomp_publish_all),
    "amqp": Protocol("AMQP 1.0", amqp_gateway, _amqp_subscribe, _amqp_received, _amqp_publish_all),
}


async def _clients(
    protocol: str,
    ports: tuple[int, ...],
    run: str,
    first: int,
    count: int,
    concurrency: int,
    start: MpEvent,
    out: Connection,
) -> None:
    """``count`` clients from number ``first`` (client i to ``ports[i % len(ports)]``): report (subscribed,
    refused, seconds to the last subscription), then (received) once each got its message or waited ``WAIT_S``,
    then hold the connections until told."""
    speaks = PROTOCOLS[protocol]
    handshakes = asyncio.Semaphore(concurrency)
    writers: list[asyncio.StreamWriter] = []
    refused = 0
    received = 0
    subscribed = 0
    last_subscribed = 0.0
    handshakes_done = asyncio.Event()  # every client subscribed or refused

    async def handshake(i: int) -> asyncio.StreamReader | None:
        """The client's reader once subscribed; None when refused (or failed)."""
        async with handshakes:
            try:
                port = ports[i % len(ports)]
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=client_source(i))
                writers.append(writer)
                done: bool = await speaks.subscribe(reader, writer, run, i)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return None
            return reader if done else None

    async def one(i: int) -> None:
        nonlocal refused, received, subscribed, last_subscribed
        reader = await handshake(i)
        if reader is None:
            refused += 1
        else:
            subscribed += 1
            last_subscribed = time.perf_counter()
        if subscribed + refused == count:
            handshakes_done.set()
        if reader is None:
            return
        try:
            if await asyncio.wait_for(speaks.received(reader), WAIT_S * 2):
                received += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass

    raise_open_file_limit()
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(first + i)) for i in range(count)]
    await handshakes_done.wait()
    out.send((subscribed, refused, last_subscribed - t0 if subscribed else 0.0))
    await asyncio.gather(*tasks)
    out.send(received)
    await asyncio.get_running_loop().run_in_executor(None, out.recv)  # hold until the parent is done
    for writer in writers:
        writer.close()


def _client_process(*args: Any) -> None:
    run_main(_clients(*args))


def _status(core: Core) -> dict[str, Any]:
    status: dict[str, Any] = json.loads(core.get("/api/status"))
    return status


@dataclass
class Figures:
    subscribed: int
    refused: int
    received: int
    elapsed: float
    before: dict[str, dict[str, int]]
    after: dict[str, dict[str, int]]
    delivered: dict[str, dict[str, int]]  # once every client had its message
    cpu: dict[str, float]  # seconds, per watched process and "clients" (all the client processes)
    idle: dict[str, float]  # share of a core per watched process while every client is connected and quiet
    leaving: Probed | None  # the first gateway's /readyz while every client left at once (None: not ours)
    leave_cpu: dict[str, float]  # seconds, per watched process, from the clients' leaving to LEAVE_S later
    status: dict[str, Any] | None  # the core's, when the run started it


def _clients_processes(args: argparse.Namespace, ports: tuple[int, ...], run: str, start: MpEvent) -> Iterator[Any]:
    share = -(-args.count // args.procs)
    for p in range(args.procs):
        first = p * share
        count = min(share, args.count - first)
        here, there = multiprocessing.Pipe()
        process = multiprocessing.Process(
            target=_client_process,
            args=(args.protocol, ports, run, first, count, args.concurrency, start, there),
        )
        process.start()
        yield here, process


@dataclass(frozen=True)
class Target:
    """What the clients connect to, and the processes whose memory and CPU the run reads."""

    ports: tuple[int, ...]  # the gateways' (or the other broker's) client ports
    http_port: int | None  # the first gateway's HTTP port (None: another broker)
    core: Core | None  # TridentMQ's own core: its link for the AMQP publisher, its status
    pids: dict[str, int]  # name → process


@contextmanager
def _started(args: argparse.Namespace) -> Iterator[Target]:
    """A core and ``--gateways`` gateways of the protocol, started for this run."""
    per_gateway = -(-args.count // args.gateways)
    limit = str(args.count + 100)
    with (
        tempfile.TemporaryDirectory() as tmp,
        cluster(Path(tmp), args.nodes, link_max_connections=limit)
        if args.nodes > 1
        else _one(core_node(Path(tmp) / "core", link_max_connections=limit)) as cores,
        ExitStack() as gateways,
    ):
        core = cores[0]
        started = [
            gateways.enter_context(
                PROTOCOLS[args.protocol].gateway(
                    core,
                    Path(tmp) / f"gw{g}",
                    listener_max_connections=str(per_gateway + 100),
                    core_shared_links=str(args.shared_links),
                )
            )
            for g in range(args.gateways)
        ]
        names = ["gateway"] if args.gateways == 1 else [f"gateway {g + 1}" for g in range(args.gateways)]
        pids = {name: gateway.process.pid for name, gateway in zip(names, started, strict=True)}
        nodes = ["core"] if args.nodes == 1 else [f"core {n + 1}" for n in range(args.nodes)]
        pids.update((name, node.process.pid) for name, node in zip(nodes, cores, strict=True))
        yield Target(tuple(gateway.port for gateway in started), started[0].http_port, core, pids)


@contextmanager
def _one(node: AbstractContextManager[Core]) -> Iterator[list[Core]]:
    with node as core:
        yield [core]


@contextmanager
def _running(args: argparse.Namespace) -> Iterator[Target]:
    """A broker already running on ``--port`` (another broker, side by side), watched as ``--broker-pid``."""
    yield Target((args.port,), None, None, {"broker": args.broker_pid})


def measure(args: argparse.Namespace) -> Figures:
    run = uuid.uuid4().hex[:6]
    speaks = PROTOCOLS[args.protocol]
    with _running(args) if args.port else _started(args) as target:
        pids = target.pids
        before = {name: proc_usage(pid) for name, pid in pids.items()}
        start = multiprocessing.Event()
        pipes: list[tuple[Connection, multiprocessing.Process]] = []
        try:
            pipes.extend(_clients_processes(args, target.ports, run, start))
            time.sleep(1.0)  # the client processes are up and waiting (their start is the event, not this)
            clients = [process.pid for _, process in pipes if process.pid is not None]
            cpu_before = {name: cpu_of(pid) for name, pid in pids.items()}
            clients_before = sum(cpu_of(pid) for pid in clients)
            start.set()
            results = [here.recv() for here, _ in pipes]
            cpu = {name: cpu_of(pid) - cpu_before[name] for name, pid in pids.items()}
            cpu["clients"] = sum(cpu_of(pid) for pid in clients) - clients_before
            after = {name: proc_usage(pid) for name, pid in pids.items()}
            status = _status(target.core) if target.core is not None else None
            core_port = target.core.link_port if target.core is not None else 0
            asyncio.run(speaks.publish_all(target.ports[0], core_port, run, args.count))
            received = sum(here.recv() for here, _ in pipes)
            delivered = {name: proc_usage(pid) for name, pid in pids.items()}
            idle_from = {name: cpu_of(pid) for name, pid in pids.items()}
            time.sleep(IDLE_S)  # every client connected, subscribed and quiet (no keep-alive)
            idle = {name: (cpu_of(pid) - idle_from[name]) / IDLE_S for name, pid in pids.items()}
            leave_from = {name: cpu_of(pid) for name, pid in pids.items()}
            probe = ReadyProbe(target.http_port, PROBE_EVERY_S) if target.http_port is not None else None
            for here, _ in pipes:
                here.send("done")
            for _, process in pipes:
                process.join(60)
            leaving = probe.finish(LEAVE_S) if probe is not None else None
            leave_cpu = {name: cpu_of(pid) - leave_from[name] for name, pid in pids.items()}
        finally:  # the clients never outlive the run, whatever failed
            for _, process in pipes:
                if process.is_alive():
                    process.terminate()
    return Figures(
        subscribed=sum(r[0] for r in results),
        refused=sum(r[1] for r in results),
        received=received,
        elapsed=max(r[2] for r in results),
        before=before,
        after=after,
        delivered=delivered,
        cpu=cpu,
        idle=idle,
        leaving=leaving,
        leave_cpu=leave_cpu,
        status=status,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="mqtt")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=500, help="handshakes under way per client process")
    parser.add_argument(
        "--shared-links", type=int, default=1, help="the gateway's core.shared_links (0: a link per client)"
    )
    parser.add_argument("--gateways", type=int, default=1, help="gateways of the protocol on the one core")
    parser.add_argument(
        "--nodes", type=int, default=1, help="core nodes, clustered: the gateways link to the first and to the others"
    )
    parser.add_argument("--port", type=int, default=0, help="a broker already running on 127.0.0.1 (MQTT, STOMP)")
    parser.add_argument("--broker-pid", type=int, default=0, help="with --port: its process, for memory and CPU")
    args = parser.parse_args()
    if args.port and (not args.broker_pid or args.protocol == "amqp"):
        parser.error("--port needs --broker-pid, and an MQTT or STOMP broker (AMQP publishes through the core)")
    limit = raise_open_file_limit()
    if args.gateways < 1 or (args.port and args.gateways != 1):
        parser.error("--gateways is at least 1, and 1 with --port")
    if args.nodes < 1 or (args.port and args.nodes != 1):
        parser.error("--nodes is at least 1, and 1 with --port")
    # Each client process and each gateway holds a descriptor per client, and each is one process.
    if -(-args.count // args.procs) > limit - 100 or (not args.port and -(-args.count // args.gateways) > limit - 100):
        parser.error(f"the open-file limit is {limit} per process: raise --procs and --gateways")
    against = (
        f"the broker on port {args.port}"
        if args.port
        else f"{args.gateways} gateway(s), core.shared_links = {args.shared_links}, {args.nodes} core node(s)"
    )
    print(
        f"{machine()}; open-file limit {limit}; {args.count} {PROTOCOLS[args.protocol].name} clients from "
        f"{args.procs} processes, {against}"
    )
    f = measure(args)
    print(f"subscribed {f.subscribed} / {args.count} (refused {f.refused}), received {f.received} / {args.count}")
    print(f"connect + subscribe: {f.subscribed / f.elapsed:,.0f} /s ({f.elapsed:.1f} s for {f.subscribed})")
    if f.status is not None:
        first = "core" if args.nodes == 1 else "core 1"
        print(f"{first}: {f.status['connections']} sessions over {f.status['links']} link connections")
    fleet = [name for name in f.before if name.startswith("gateway ")]

    def served(name: str) -> float:
        """The clients a process served: a gateway of a fleet its share."""
        return max(f.subscribed / len(fleet) if name in fleet else f.subscribed, 1)

    for name in f.before:
        grown = f.after[name]["rss_kib"] - f.before[name]["rss_kib"]
        print(
            f"{name}: RSS {f.before[name]['rss_kib'] / 1024:.0f} -> {f.after[name]['rss_kib'] / 1024:.0f} MiB, "
            f"{grown / served(name):.1f} KiB per connection; "
            f"fds {f.before[name]['fds']} -> {f.after[name]['fds']}; "
            f"CPU {f.cpu[name] * 1e6 / served(name):.0f} µs per connect + subscribe"
        )
    if fleet:
        grown = sum(f.after[name]["rss_kib"] - f.before[name]["rss_kib"] for name in fleet)
        print(
            f"gateways, all {len(fleet)}: {grown / max(f.subscribed, 1):.1f} KiB per connection; "
            f"CPU {sum(f.cpu[name] for name in fleet) * 1e6 / max(f.subscribed, 1):.0f} µs per connect + subscribe"
        )
    print(f"clients: CPU {f.cpu['clients'] * 1e6 / max(f.subscribed, 1):.0f} µs per connect + subscribe")
    for name in f.before:
        grown = f.delivered[name]["rss_kib"] - f.before[name]["rss_kib"]
        print(
            f"{name} once each client had its message: RSS {f.delivered[name]['rss_kib'] / 1024:.0f} MiB, "
            f"{grown / served(name):.1f} KiB per connection"
        )
    print(
        f"idle, every client connected and quiet for {IDLE_S:.0f} s: "
        + ", ".join(f"{name} {share:.1%} of a core" for name, share in f.idle.items())
    )
    if f.leaving is not None:
        print(
            f"every client leaving at once: the gateway's /readyz over {LEAVE_S:.0f} s answered {f.leaving.answers} "
            f"times ({f.leaving.not_ready} not ready), in {f.leaving.p50_ms:.1f} ms at the median, "
            f"{f.leaving.max_ms:.0f} ms at most; CPU per client that left: "
            + ", ".join(f"{name} {cpu * 1e6 / served(name):.0f} µs" for name, cpu in f.leave_cpu.items())
        )


if __name__ == "__main__":
    main()
