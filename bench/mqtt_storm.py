"""Reconnect storm of the MQTT gateway: one of two (or more) gateways is killed (SIGKILL) and its clients come
back through the others with their sessions and the messages queued meanwhile. With ``--stop term`` the gateway
is stopped (SIGTERM) instead, as in a rolling restart: it ends its clients' connections and sessions itself.

N MQTT 3.1.1 clients with persistent sessions (clean session 0, no keep-alive), each subscribed at QoS 1 to a
topic of its own, connect in equal shares to gateway A and gateway B (and C, D, ... with ``--gateways``), from
one client process per gateway (raw asyncio sockets, at most ``--concurrency`` handshakes under way per
process). Then A is killed, and one QoS 1 message is published through B to each of A's clients' topics at once.
Each of A's clients reconnects as soon as its connection drops, to B (client i to the (i mod G-1)-th of the
others with G gateways); it must find its session (CONNACK with session present) and receive its message
without subscribing again. After that, each of the other gateways' clients is sent a message of its own and
must receive it. More than two gateways take more sessions than one process's open-file limit allows.

Meanwhile a probe client on B publishes QoS 1 to its own topic every 10 ms and times each message from PUBLISH
to its delivery: how the storm slows a client that is not part of it. The script reports the time from the kill
until the last of A's clients had its session back and its message, the probe's latency during the storm, how
long the core and B stood still (their /readyz, asked every 20 ms from the kill to the storm's end), the core's
link connections (B's link kept: the core's heartbeats went on), and the CPU and memory of core and B.

    uv run python -m bench.mqtt_storm --count 10000 [--concurrency 500]
    uv run python -m bench.mqtt_storm --count 50000 --gateways 4
    uv run python -m bench.mqtt_storm --count 19000 --stop term
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
import uuid
from contextlib import ExitStack
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from bench.mqtt_packets import (
    CONNACK,
    PUBLISH,
    SUBACK,
    connect_packet,
    publish_packet,
    read_packet,
    read_packet_with_flags,
    subscribe_packet,
)
from bench.node import (
    Core,
    Probed,
    ReadyProbe,
    client_source,
    core_node,
    cpu_of,
    machine,
    mqtt_gateway,
    proc_usage,
    quantile_ms,
)

from tridentmq_shared.runtime import raise_open_file_limit, run_main

PUBACK = 4
WAIT_S = 120.0  # longest wait for one client's CONNACK, SUBACK or message
PROBE_EVERY_S = 0.01


def _puback(packet_id: int) -> bytes:
    return b"\x40\x02" + packet_id.to_bytes(2, "big")


def _qos1_delivery(body: bytes, flags: int) -> tuple[int, bytes]:
    """(packet id, payload) of a QoS 1 PUBLISH's body."""
    topic_length = int.from_bytes(body[:2], "big")
    at = 2 + topic_length
    if (flags >> 1) & 3 == 0:
        return 0, body[at:]
    return int.from_bytes(body[at : at + 2], "big"), body[at + 2 :]


async def _read_publish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """The payload of the next PUBLISH (acknowledged if QoS 1); other packets are skipped."""
    while True:
        head, body = await read_packet_with_flags(reader)
        if head >> 4 == PUBLISH:
            packet_id, payload = _qos1_delivery(body, head & 0x0F)
            if packet_id:
                writer.write(_puback(packet_id))
            return payload


async def _login(
    port: int, client_id: str, topic: str | None, number: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
    """A persistent session's connection (subscribed at QoS 1 to ``topic`` if given) and its session-present
    flag, client ``number``'s (see ``client_source``); raises ConnectionError when refused."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=client_source(number))
    writer.write(connect_packet(client_id, clean=False))
    kind, body = await asyncio.wait_for(read_packet(reader), WAIT_S)
    if kind != CONNACK or body[1] != 0:
        writer.close()
        raise ConnectionError(f"CONNACK {body[1] if kind == CONNACK else kind}")
    if topic is not None:
        writer.write(subscribe_packet(topic, qos=1))
        kind, body = await asyncio.wait_for(read_packet(reader), WAIT_S)
        if kind != SUBACK or body[-1] != 1:
            writer.close()
            raise ConnectionError("SUBSCRIBE refused")
    return reader, writer, bool(body[0] & 1) if topic is None else False


async def _side(
    port: int,
    failover_ports: tuple[int, ...],
    run: str,
    first: int,
    count: int,
    concurrency: int,
    start: MpEvent,
    out: Connection,
) -> None:
    """``count`` clients from number ``first`` on ``port``: report how many subscribed; then each waits for one
    message, reconnecting to ``failover_ports[i % len(failover_ports)]`` (its session expected there) if its
    connection drops first; report (received, came back, came back without their session, came back times)."""
    handshakes = asyncio.Semaphore(concurrency)
    subscribed = refused = received = back = no_session = 0
    back_at: list[float] = []
    all_in = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def one(i: int) -> None:
        nonlocal subscribed, refused, received, back, no_session
        client_id, topic = f"s{run}-{i}", f"storm/{run}/{i}"
        try:
            async with handshakes:
                reader, writer, _ = await _login(port, client_id, topic, i)
            subscribed += 1
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            refused += 1
            return
        finally:
            if subscribed + refused == count:
                all_in.set()
        writers.append(writer)
        try:
            await _read_publish(reader, writer)
            received += 1
            return
        except (OSError, asyncio.IncompleteReadError):
            pass  # the gateway is gone: reconnect below
        writer.close()
        try:
            async with handshakes:
                reader, writer, present = await _login(failover_ports[i % len(failover_ports)], client_id, None, i)
            back += 1
            no_session += not present
            back_at.append(time.monotonic())
            writers.append(writer)
            await asyncio.wait_for(_read_publish(reader, writer), WAIT_S)
            received += 1
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass

    raise_open_file_limit()
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    tasks = [asyncio.create_task(one(first + i)) for i in range(count)]
    await all_in.wait()
    out.send((subscribed, refused))
    await asyncio.gather(*tasks)
    out.send((received, back, no_session, sorted(back_at)))
    await asyncio.get_running_loop().run_in_executor(None, out.recv)  # hold until the parent is done
    for writer in writers:
        writer.close()


def _side_process(*args: Any) -> None:
    run_main(_side(*args))


async def _publish_qos1(port: int, client_id: str, topics: list[str]) -> None:
    """One QoS 1 message to each topic, at most 1,000 unacknowledged."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_packet(client_id))
    await read_packet(reader)
    for start in range(0, len(topics), 1000):
        chunk = topics[start : start + 1000]
        writer.write(b"".join(publish_packet(t, b"queued", packet_id=n + 1) for n, t in enumerate(chunk)))
        for _ in chunk:
            kind, _ = await asyncio.wait_for(read_packet(reader), WAIT_S)
            if kind != PUBACK:
                raise SystemExit(f"publisher got packet type {kind} instead of PUBACK")
    writer.close()


async def _probe(port: int, run: str, stop: asyncio.Event) -> list[tuple[float, int]]:
    """(time sent, latency ns) of QoS 1 messages a client on ``port`` publishes to itself every 10 ms."""
    reader, writer, _ = await _login(port, f"probe{run}", f"storm/{run}/probe")
    samples: list[tuple[float, int]] = []
    packet_id = 0
    while not stop.is_set():
        packet_id = packet_id % 65535 + 1
        sent = time.monotonic()
        begin = time.perf_counter_ns()
        writer.write(publish_packet(f"storm/{run}/probe", b"probe", packet_id=packet_id))
        while True:  # its PUBACK and its delivery, in either order
            head, body = await asyncio.wait_for(read_packet_with_flags(reader), WAIT_S)
            if head >> 4 == PUBLISH:
                delivered_id, _ = _qos1_delivery(body, head & 0x0F)
                writer.write(_puback(delivered_id))
                samples.append((sent, time.perf_counter_ns() - begin))
                break
        await asyncio.sleep(PROBE_EVERY_S)
    writer.close()
    return samples


#: How often the core's and B's /readyz are asked during the storm.
READY_EVERY_S = 0.02
#: What ``_storm`` saw: A's clients (received, back, without their session, when each was back), the others'
#: (received, dropped), the kill's time, the probe's samples, the storm's end, and the /readyz answers.
_Storm = tuple[
    tuple[int, int, int, list[float]], tuple[int, int], float, list[tuple[float, int]], float, dict[str, Probed]
]


def _status(core: Core) -> dict[str, Any]:
    status: dict[str, Any] = json.loads(core.get("/api/status"))
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="clients in all, an equal share on each gateway")
    parser.add_argument("--gateways", type=int, default=2, help="MQTT gateways, at least 2; the first, A, is stopped")
    parser.add_argument("--concurrency", type=int, default=500, help="handshakes under way per client process")
    parser.add_argument(
        "--stop",
        choices=("kill", "term"),
        default="kill",
        help="how A ends: kill (SIGKILL, a crash) or term (SIGTERM, a graceful stop as in a rolling restart)",
    )
    args = parser.parse_args()
    if args.gateways < 2:
        parser.error("--gateways is at least 2")
    run = uuid.uuid4().hex[:6]
    limit = raise_open_file_limit()
    share = args.count // args.gateways
    survivors = args.gateways - 1
    if share + -(-share // survivors) > limit - 100:
        parser.error(f"a gateway that takes over would hold more clients than its open-file limit ({limit})")
    print(
        f"{machine()}; open-file limit {limit}; {share * args.gateways} MQTT 3.1.1 persistent sessions, {share} on "
        f"each of {args.gateways} gateways; gateway A is {'killed' if args.stop == 'kill' else 'stopped (SIGTERM)'}"
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        core_node(Path(tmp) / "core", link_max_connections="100") as core,
        ExitStack() as stack,
    ):
        gateways = [
            stack.enter_context(mqtt_gateway(core, Path(tmp) / f"gw{g}", listener_max_connections=str(2 * share + 100)))
            for g in range(args.gateways)
        ]
        gateway_a, others = gateways[0], gateways[1:]
        watched = {"core": core.process.pid, **{_name(g): gw.process.pid for g, gw in enumerate(others, 1)}}
        start = multiprocessing.Event()
        sides: list[tuple[Connection, multiprocessing.Process]] = []
        try:
            for g, gateway in enumerate(gateways):
                failover = tuple(o.port for o in others) if g == 0 else (gateway.port,)
                here, there = multiprocessing.Pipe()
                process = multiprocessing.Process(
                    target=_side_process,
                    args=(gateway.port, failover, run, g * share, share, args.concurrency, start, there),
                )
                process.start()
                sides.append((here, process))
            time.sleep(1.0)  # the client processes are up and waiting
            t0 = time.monotonic()
            start.set()
            logged_in = [here.recv() for here, _ in sides]
            print(
                "subscribed: "
                + ", ".join(f"{_name(g)} {n} (refused {r})" for g, (n, r) in enumerate(logged_in))
                + f" in {time.monotonic() - t0:.1f} s"
            )
            before = _status(core)
            usage_before = {name: proc_usage(pid) for name, pid in watched.items()}
            cpu_before = {name: cpu_of(pid) for name, pid in watched.items()}
            ready_ports = {"core": core.management_port, "B": others[0].http_port}
            storm = asyncio.run(_storm(ready_ports, gateway_a, args.stop, others[0].port, run, share, sides))
            cpu = {name: cpu_of(pid) - cpu_before[name] for name, pid in watched.items()}
            after = _status(core)
            usage_after = {name: proc_usage(pid) for name, pid in watched.items()}
            for here, process in sides:
                here.send("done")
                process.join(60)
        finally:  # the clients never outlive the run, whatever failed
            for _, process in sides:
                if process.is_alive():
                    process.terminate()
    (received_a, back, no_session, back_at), (received_others, dropped_others), t_kill, samples, storm_end, ready = (
        storm
    )
    back_s = [t - t_kill for t in back_at] or [float("nan")]
    through = "B" if survivors == 1 else f"the other {survivors} gateways"
    print(
        f"A's {share} clients: {back} back through {through} ({no_session} without their session), {received_a} "
        f"received their message; last back {back_s[-1]:.1f} s after the kill (median {back_s[len(back_s) // 2]:.1f} "
        f"s), all done {storm_end - t_kill:.1f} s after it"
    )
    print(
        f"the other gateways' {share * survivors} clients: {received_others} received their message after the storm; "
        f"{dropped_others} of them lost their connection meanwhile (and came back)"
    )
    during = sorted(ns for sent, ns in samples if t_kill <= sent <= storm_end)
    quiet = sorted(ns for sent, ns in samples if sent < t_kill)
    print(
        f"probe on B, QoS 1 publish to delivery: before the kill p50 {quantile_ms(quiet, 0.5):.2f} ms ({len(quiet)}); "
        f"during the storm p50 {quantile_ms(during, 0.5):.2f}, p99 {quantile_ms(during, 0.99):.2f}, "
        f"max {quantile_ms(during, 1.0):.2f} ms ({len(during)} messages)"
    )
    print(
        "/readyz during the storm, asked every 20 ms: "
        + ", ".join(
            f"{name} {r.p50_ms:.1f} ms at the median, {r.max_ms:.0f} ms at most ({r.answers} answers, "
            f"{r.not_ready} not ready)"
            for name, r in ready.items()
        )
    )
    print(
        f"core: link connections {before['links']} before, {after['links']} after (A's gone); sessions "
        f"{before['connections']} -> {after['connections']}"
    )
    for name in watched:
        print(
            f"{name}: RSS {usage_before[name]['rss_kib'] / 1024:.0f} -> {usage_after[name]['rss_kib'] / 1024:.0f} MiB, "
            f"fds {usage_before[name]['fds']} -> {usage_after[name]['fds']}, CPU {cpu[name]:.1f} s during the storm"
        )


def _ended(process: Any) -> float:
    """When ``process`` ended (waits for it)."""
    process.wait()
    return time.monotonic()


def _name(g: int) -> str:
    """Gateway number ``g``'s name: A, B, C, ..."""
    return chr(ord("A") + g)


async def _storm(
    ready_ports: dict[str, int],
    gateway_a: Any,
    stop_a: str,
    port_b: int,
    run: str,
    share: int,
    sides: list[tuple[Connection, multiprocessing.Process]],
) -> tuple[
    tuple[int, int, int, list[float]], tuple[int, int], float, list[tuple[float, int]], float, dict[str, Probed]
]:
    """Kill A with the probe running, publish to A's clients, wait for them, then serve the others' clients."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    probe = asyncio.create_task(_probe(port_b, run, stop))
    await asyncio.sleep(2.0)  # the probe's quiet baseline
    # How long the core and B stand still: their /readyz, asked from threads of their own.
    standing = {name: ReadyProbe(port, READY_EVERY_S) for name, port in ready_ports.items()}
    t_kill = time.monotonic()
    if stop_a == "kill":
        gateway_a.process.kill()
    else:
        gateway_a.process.terminate()
    a_gone = loop.run_in_executor(None, _ended, gateway_a.process)
    await _publish_qos1(port_b, f"pa{run}", [f"storm/{run}/{i}" for i in range(share)])
    result_a = await loop.run_in_executor(None, sides[0][0].recv)
    storm_end = time.monotonic()
    a_ended = await a_gone
    print(f"A ended {a_ended - t_kill:.2f} s after its SIG{stop_a.upper()}")
    stop.set()
    samples = await probe
    ready = {name: probe.stop() for name, probe in standing.items()}
    await _publish_qos1(port_b, f"pb{run}", [f"storm/{run}/{i}" for i in range(share, share * len(sides))])
    received = dropped = 0
    for here, _ in sides[1:]:
        side_received, side_dropped, _, _ = await loop.run_in_executor(None, here.recv)
        received += side_received
        dropped += side_dropped
    return result_a, (received, dropped), t_kill, samples, storm_end, ready


if __name__ == "__main__":
    main()
