"""Benchmark of the MQTT gateway: topic throughput and end-to-end latency through a gateway and its core.

Scenarios (MQTT 3.1.1, clean sessions, 100-byte payloads on a fresh topic ``bench/<id>`` per run):

* ``S1``: QoS 0, 4 publisher connections -> 1 subscriber connection (fan-in), unthrottled;
* ``S2``: QoS 1, as S1; each publisher keeps at most 500 PUBLISHes unacknowledged (it waits for PUBACKs),
  and the subscriber subscribes with QoS 1 and PUBACKs every message;
* ``S5``: QoS 0, 1 publisher connection -> 10 subscriber connections (fan-out), the subscriber connections
  in 2 processes of 5 (like the peer benchmark's ``--sub-procs 2``).

Every publisher connection runs in its own process, and so does every subscriber process, so that the
clients use several cores. The publishers start once every subscriber's SUBACK is in; t0 is the earliest
publisher start. A QoS 0 publisher ends with a PINGREQ: its PINGRESP says the gateway has read everything
before it; a QoS 1 publisher ends with its last PUBACK. Delivered rate = deliveries / (last delivery - t0),
where deliveries count every subscriber connection (10 per message in S5). Latency is publish-to-delivery
from the CLOCK_MONOTONIC stamp (ns, zero-padded decimal) that starts each payload, sampled once per socket
read. Lost = expected deliveries - deliveries, once the subscribers have waited a grace period after the
last publisher finished. Broker CPU is the user + system time of the core and gateway processes (from
``/proc``) over the run, per delivery; client cores are the clients' own CPU time per second of run.

``--rate R`` makes any scenario a latency run: the publishers together publish R msgs/s, evenly paced
(each publisher R/n msgs/s, offset from one another), for ``--seconds``, and p99.9 is reported as well.

The clients are small raw asyncio MQTT 3.1.1 clients (uvloop when installed), not paho, so that the client
is not the bottleneck. Without ``--port`` the script starts its own core (throw-away data directory) and
MQTT gateway on free loopback ports; with ``--port`` it targets a gateway that is already running (broker
CPU only with ``--core-pid`` / ``--gateway-pid``).

    uv run python -m bench.mqtt_gateway [--runs 3] [--count N] [--scenario S1|S2|S5]
    uv run python -m bench.mqtt_gateway --scenario S1 --rate 1000 [--seconds 10]  # latency at a fixed rate
    uv run python -m bench.mqtt_gateway --host 127.0.0.1 --port 1883  # a gateway already running
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as MpEvent
from typing import Any, TypedDict, TypeVar, cast

from bench.client import RawClient
from bench.node import broker_cpu_text, client_tls, cpu_of, cpu_self, gateway_target, machine, mqtt_gateway, quantile_ms

from tridentmq_shared.runtime import run_main

BODY_SIZE = 100
STAMP_DIGITS = 20  # the payload starts with the publish time: CLOCK_MONOTONIC ns, zero-padded decimal
MAX_UNACKED = 500  # QoS 1 PUBLISHes a publisher has sent and not yet seen a PUBACK for
BATCH = 100  # PUBLISHes written at once
KEEP_ALIVE_S = 600  # longer than any run: the clients send no PINGREQs to keep alive
GRACE_S = 5.0  # after the last publisher finished, how long subscribers wait for a missing message
CLOSE_S = 5.0  # how long a client waits for the gateway to close the connection after its DISCONNECT

# fixed packets and packet types (MQTT 3.1.1, section 2.2.1)
CONNACK, PUBLISH, PUBACK, SUBACK, PINGRESP = 2, 3, 4, 9, 13
PINGREQ_PACKET = b"\xc0\x00"
DISCONNECT_PACKET = b"\xe0\x00"
PUBACK_HEAD = b"\x40\x02"


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    qos: int
    publishers: int
    subscribers: int
    sub_procs: int
    count: int  # messages per publisher


SCENARIOS = [
    Scenario("S1", "S1 MQTT QOS 0 FAN-IN 4:1", qos=0, publishers=4, subscribers=1, sub_procs=1, count=50_000),
    Scenario("S2", "S2 MQTT QOS 1 FAN-IN 4:1", qos=1, publishers=4, subscribers=1, sub_procs=1, count=25_000),
    Scenario("S5", "S5 MQTT QOS 0 FAN-OUT 1:10", qos=0, publishers=1, subscribers=10, sub_procs=2, count=20_000),
]


@dataclass(frozen=True)
class RunOptions:
    host: str
    port: int
    run_id: str
    qos: int
    publishers: int
    count: int  # messages per publisher
    expected: int  # messages each subscriber connection should receive
    rate: int  # msgs/s across all publishers; 0 = unthrottled
    deadline_s: int
    ca_file: str = ""  # TLS to the gateway, checked against this authority (empty: plain TCP)

    @property
    def topic(self) -> bytes:
        return f"bench/{self.run_id}".encode()


class PublisherResult(TypedDict):
    error: str
    t0_ns: int
    done_ns: int
    sent: int
    cpu_s: float


class SubscriberResult(TypedDict):
    error: str
    delivered: list[int]  # per connection
    last_ns: int
    latencies_ns: list[int]
    cpu_s: float


# ---------------------------------------------------------------------------------------------- codec
def _remaining_length(size: int) -> bytes:
    """The variable-length Remaining Length of a fixed header (1 to 4 bytes, 7 bits each)."""
    out = bytearray()
    while True:
        size, byte = divmod(size, 128)
        out.append(byte | 0x80 if size else byte)
        if not size:
            return bytes(out)


def _string(value: bytes) -> bytes:
    return len(value).to_bytes(2, "big") + value


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + _remaining_length(len(body)) + body


def connect_packet(client_id: str) -> bytes:
    """CONNECT, protocol level 4 (3.1.1), clean session, no will, no user name."""
    return _packet(
        0x10, _string(b"MQTT") + bytes([4, 0x02]) + KEEP_ALIVE_S.to_bytes(2, "big") + _string(client_id.encode())
    )


def subscribe_packet(packet_id: int, topic: bytes, qos: int) -> bytes:
    return _packet(0x82, packet_id.to_bytes(2, "big") + _string(topic) + bytes([qos]))


def publish_head(topic: bytes, qos: int) -> bytes:
    """Fixed header and topic of a PUBLISH of ``BODY_SIZE`` bytes; a QoS 1 PUBLISH continues with its packet id."""
    size = 2 + len(topic) + (2 if qos else 0) + BODY_SIZE
    return bytes([0x30 | qos << 1]) + _remaining_length(size) + _string(topic)


class MqttError(Exception):
    pass


def _long_length(buf: bytearray, at: int, size: int) -> tuple[int, int]:
    """The Remaining Length that starts at ``buf[at]`` and where the rest of the packet starts, or
    ``(-1, -1)`` when ``buf[:size]`` does not hold all of it yet."""
    length = 0
    for n in range(4):
        if at + n >= size:
            return -1, -1
        byte = buf[at + n]
        length |= (byte & 0x7F) << (7 * n)
        if byte < 0x80:
            return length, at + n + 1
    raise MqttError("malformed remaining length")


# ---------------------------------------------------------------------------------------------- clients


class _MqttClient(RawClient):
    """An MQTT 3.1.1 connection: an incremental packet parser and the waits the benchmark needs."""

    error_type = MqttError

    def __init__(self) -> None:
        super().__init__()
        self.unacked = 0  # QoS 1 PUBLISHes sent and not yet acknowledged
        self._buffer = bytearray()
        self._connack: asyncio.Future[None] = self.loop.create_future()
        self._suback: asyncio.Future[None] | None = None
        self._pong: asyncio.Future[None] | None = None
        self._acked: asyncio.Future[None] | None = None
        self._new_acks = False

    # ---------------------------------------------------------------- asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        size = len(buf)
        pos = 0
        while size - pos >= 2:
            length = buf[pos + 1]
            start = pos + 2
            if length & 0x80:  # a remaining length of more than one byte
                try:
                    length, start = _long_length(buf, pos + 1, size)
                except MqttError as exc:
                    self._fail(str(exc))
                    return
                if start < 0:
                    break
            end = start + length
            if end > size:
                break
            self.packet(buf[pos], buf, start, end)
            pos = end
        del buf[:pos]
        self.chunk_done()

    # ---------------------------------------------------------------- packets
    def packet(self, first: int, buf: bytearray, start: int, end: int) -> None:
        """One whole packet: first byte of its fixed header ``first``, the rest in ``buf[start:end]``."""
        kind = first >> 4
        if kind == PUBACK:
            self.unacked -= 1
            self._new_acks = True
        elif kind == PINGRESP:
            if self._pong is not None and not self._pong.done():
                self._pong.set_result(None)
        elif kind == SUBACK:
            if any(code & 0x80 for code in buf[start + 2 : end]):
                self._fail(f"SUBACK refused the subscription: {bytes(buf[start:end]).hex()}")
            elif self._suback is not None and not self._suback.done():
                self._suback.set_result(None)
        elif kind == CONNACK:
            if end - start < 2 or buf[start + 1] != 0:
                self._fail(f"CONNACK refused the connection: {bytes(buf[start:end]).hex()}")
            elif not self._connack.done():
                self._connack.set_result(None)
        else:
            self._fail(f"unexpected packet {first:#04x}: {bytes(buf[start:end]).hex()}")

    def chunk_done(self) -> None:
        """Called after the packets of one read."""
        if self._new_acks:
            self._new_acks = False
            if self._acked is not None and not self._acked.done():
                self._acked.set_result(None)

    def _waiters(self) -> tuple[asyncio.Future[Any] | None, ...]:
        return self._connack, self._suback, self._pong, self._acked

    # ---------------------------------------------------------------- the client's side
    async def acked(self) -> None:
        """Waits for the next read that brings PUBACKs."""
        self._check()
        self._acked = self.loop.create_future()
        await self._acked

    async def ping(self) -> None:
        """PINGREQ, then waits for the PINGRESP: the gateway has read everything sent before."""
        self._pong = self.loop.create_future()
        self.write(PINGREQ_PACKET)
        await self._pong

    async def connect(self, client_id: str) -> None:
        self.write(connect_packet(client_id))
        await self._connack

    async def subscribe(self, topic: bytes, qos: int) -> None:
        self._suback = self.loop.create_future()
        self.write(subscribe_packet(1, topic, qos))
        await self._suback

    async def close(self) -> None:
        """DISCONNECT, then close (the transport writes what it holds first) and wait for the end."""
        self._closing = True
        if self.transport is not None and not self.error and not self.transport.is_closing():
            self.transport.write(DISCONNECT_PACKET)
        await self._shut(CLOSE_S)


C = TypeVar("C", bound=_MqttClient)


class _Subscriber(_MqttClient):
    pause_reading_when_blocked = True  # PUBACKs back up: stop reading PUBLISHes until they drain

    def __init__(self, expected: int) -> None:
        super().__init__()
        self.expected = expected
        self.delivered = 0
        self.last_ns = 0  # the read that brought the last message
        self.latencies_ns: list[int] = []
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self._now = 0
        self._first = True
        self._acks: list[bytes | bytearray] = []

    def data_received(self, data: bytes) -> None:
        self._now = time.monotonic_ns()
        self._first = True
        super().data_received(data)

    def packet(self, first: int, buf: bytearray, start: int, end: int) -> None:
        if first >> 4 != PUBLISH:
            super().packet(first, buf, start, end)
            return
        self.delivered += 1
        payload = start + 2 + (buf[start] << 8 | buf[start + 1])  # after the topic
        if first & 0x06:  # QoS 1 (or 2): a packet id precedes the payload
            self._acks += (PUBACK_HEAD, buf[payload : payload + 2])
            payload += 2
        if self._first:  # one latency sample per read keeps the subscriber cheap
            self._first = False
            self.latencies_ns.append(self._now - int(buf[payload : payload + STAMP_DIGITS]))

    def chunk_done(self) -> None:
        if self._acks and not self.error:
            self.write(b"".join(self._acks))
            self._acks = []
        if not self._first:
            self.last_ns = self._now
            if self.delivered >= self.expected and not self.finished.done():
                self.finished.set_result(None)


async def _connect(opts: RunOptions, name: str, factory: Callable[[], C]) -> C:
    _, client = await asyncio.get_running_loop().create_connection(
        factory, opts.host, opts.port, ssl=client_tls(opts.ca_file)
    )
    await asyncio.wait_for(client.connect(f"bench-{opts.run_id}-{name}"), 30)
    return client


async def _publish(opts: RunOptions, index: int, subscribed: list[MpEvent], result: PublisherResult) -> None:
    client = await _connect(opts, f"p{index}", _MqttClient)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + opts.deadline_s
    while not all(event.is_set() for event in subscribed):  # t0 is when every SUBACK is in
        if loop.time() > deadline:
            raise MqttError("the subscribers did not subscribe")
        await asyncio.sleep(0.001)
    qos, count = opts.qos, opts.count
    head = publish_head(opts.topic, qos)
    filler = b"x" * (BODY_SIZE - STAMP_DIGITS)
    interval = opts.publishers * 1e9 / opts.rate if opts.rate else 0.0  # ns between two of our messages
    clock = time.monotonic_ns
    cpu = cpu_self()
    t0 = result["t0_ns"] = clock()
    first_due = t0 + index * interval / opts.publishers  # the publishers' messages interleave evenly
    sent = 0
    while sent < count:
        await client.writable()
        end = min(count, sent + BATCH)
        if qos:
            while client.unacked >= MAX_UNACKED:
                await client.acked()
            end = min(end, sent + MAX_UNACKED - client.unacked)
        if interval:
            delay = first_due + sent * interval - clock()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            end = min(end, max(sent + 1, int((clock() - first_due) / interval) + 1))  # what is due by now
        parts: list[bytes] = []
        if qos:
            for i in range(sent, end):
                parts += (head, (i % 65535 + 1).to_bytes(2, "big"), b"%020d" % clock(), filler)
            client.unacked += end - sent
        else:
            for _ in range(sent, end):
                parts += (head, b"%020d" % clock(), filler)
        client.write(b"".join(parts))
        sent = result["sent"] = end
    if qos:
        while client.unacked > 0:
            await client.acked()
    else:
        await client.ping()
    result["done_ns"] = clock()
    result["cpu_s"] = cpu_self() - cpu
    await client.close()


async def _subscribe(
    opts: RunOptions,
    first: int,
    connections: int,
    subscribed: MpEvent,
    produced: list[MpEvent],
    result: SubscriberResult,
) -> None:
    clients = await asyncio.gather(
        *(_connect(opts, f"s{first + k}", lambda: _Subscriber(opts.expected)) for k in range(connections))
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + opts.deadline_s
    await asyncio.wait_for(asyncio.gather(*(client.subscribe(opts.topic, opts.qos) for client in clients)), 30)
    cpu = cpu_self()
    subscribed.set()
    quiet_since = 0.0

    def collect() -> None:
        result["delivered"] = [client.delivered for client in clients]
        result["last_ns"] = max(client.last_ns for client in clients)

    try:
        while loop.time() < deadline:
            waiting = [client.finished for client in clients if not client.finished.done()]
            if not waiting:
                break
            await asyncio.wait(waiting, timeout=0.1)
            collect()
            for client in clients:
                if client.error:
                    raise MqttError(client.error)
            if all(event.is_set() for event in produced):  # all is sent: wait a little for what is missing
                quiet_since = max(quiet_since or time.monotonic(), result["last_ns"] / 1e9)
                if time.monotonic() - quiet_since > GRACE_S:
                    break
    finally:
        collect()
        result["latencies_ns"] = [sample for client in clients for sample in client.latencies_ns]
        result["cpu_s"] = cpu_self() - cpu
    await asyncio.gather(*(client.close() for client in clients))


def _publisher_main(
    opts: RunOptions, index: int, subscribed: list[MpEvent], produced: MpEvent, out: Connection
) -> None:
    signal.alarm(opts.deadline_s + 30)  # the last resort: SIGALRM ends the process
    result = PublisherResult(error="", t0_ns=0, done_ns=0, sent=0, cpu_s=0.0)
    try:
        run_main(asyncio.wait_for(_publish(opts, index, subscribed, result), opts.deadline_s))
    except TimeoutError:
        result["error"] = f"publisher {index}: deadline of {opts.deadline_s} s"
    except Exception as exc:
        result["error"] = f"publisher {index}: {exc!r}"
    produced.set()
    out.send(result)


def _subscriber_main(
    opts: RunOptions, first: int, connections: int, subscribed: MpEvent, produced: list[MpEvent], out: Connection
) -> None:
    signal.alarm(opts.deadline_s + 30)
    result = SubscriberResult(error="", delivered=[0] * connections, last_ns=0, latencies_ns=[], cpu_s=0.0)
    try:
        run_main(
            asyncio.wait_for(
                _subscribe(opts, first, connections, subscribed, produced, result), opts.deadline_s + 2 * GRACE_S
            )
        )
    except TimeoutError:
        result["error"] = f"subscribers {first}..{first + connections - 1}: deadline of {opts.deadline_s} s"
    except Exception as exc:
        result["error"] = f"subscribers {first}..{first + connections - 1}: {exc!r}"
    out.send(result)


# ---------------------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunResult:
    delivered: int
    expected: int
    lost: int
    elapsed_s: float
    rate: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    samples: int
    client_cores: float
    server_cpu_s: dict[str, float]
    error: str

    @property
    def broker_us(self) -> float:
        """Broker CPU (all watched server processes) per delivery, in µs; NaN when not watched."""
        if not self.server_cpu_s or not self.delivered:
            return float("nan")
        return sum(self.server_cpu_s.values()) * 1e6 / self.delivered


def run_once(opts: RunOptions, scenario: Scenario, servers: dict[str, int]) -> RunResult:
    """The scenario's publisher and subscriber processes; ``servers`` are processes whose CPU use is shown."""
    ctx = multiprocessing.get_context("spawn")
    subscribed = [ctx.Event() for _ in range(scenario.sub_procs)]
    produced = [ctx.Event() for _ in range(scenario.publishers)]
    processes: list[BaseProcess] = []
    ends: list[Connection] = []
    per_proc = -(-scenario.subscribers // scenario.sub_procs)
    for n in range(scenario.sub_procs):
        first = n * per_proc
        connections = min(per_proc, scenario.subscribers - first)
        end, out = ctx.Pipe(duplex=False)
        processes.append(
            ctx.Process(
                target=_subscriber_main, daemon=True, args=(opts, first, connections, subscribed[n], produced, out)
            )
        )
        ends.append(end)
    for n in range(scenario.publishers):
        end, out = ctx.Pipe(duplex=False)
        processes.append(ctx.Process(target=_publisher_main, daemon=True, args=(opts, n, subscribed, produced[n], out)))
        ends.append(end)
    cpu = {name: cpu_of(pid) for name, pid in servers.items()}
    for process in processes:
        process.start()
    until = time.monotonic() + opts.deadline_s + 4 * GRACE_S + 30
    reports: list[PublisherResult | SubscriberResult | None] = []
    for end in ends:
        ready = end.poll(max(0.0, until - time.monotonic()))
        reports.append(cast(PublisherResult | SubscriberResult, end.recv()) if ready else None)
    cpu = {name: cpu_of(pid) - cpu[name] for name, pid in servers.items()}
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    if any(report is None for report in reports):
        raise SystemExit("a client process did not report")
    subscribers = [cast(SubscriberResult, report) for report in reports[: scenario.sub_procs]]
    publishers = [cast(PublisherResult, report) for report in reports[scenario.sub_procs :]]
    error = "; ".join(r["error"] for r in [*publishers, *subscribers] if r["error"])
    delivered = sum(sum(s["delivered"]) for s in subscribers)
    expected = opts.count * scenario.publishers * scenario.subscribers
    started = [p["t0_ns"] for p in publishers if p["t0_ns"]]
    last = max(s["last_ns"] for s in subscribers)
    elapsed = max(last - min(started), 1) / 1e9 if delivered and started else 0.0
    latencies = sorted(sample for s in subscribers for sample in s["latencies_ns"])

    def pick(q: float) -> float:
        return quantile_ms(latencies, q)

    clients = sum(r["cpu_s"] for r in [*publishers, *subscribers])
    return RunResult(
        delivered,
        expected,
        expected - delivered,
        elapsed,
        delivered / elapsed if elapsed else 0.0,
        pick(0.50),
        pick(0.99),
        pick(0.999),
        pick(1.0),
        len(latencies),
        clients / elapsed if elapsed else 0.0,
        cpu,
        error,
    )


def _broker(result: RunResult) -> str:
    return broker_cpu_text(result.server_cpu_s, result.delivered, result.elapsed_s, result.broker_us)


def _describe(result: RunResult, *, paced: bool) -> str:
    p999 = f" p99.9 {result.p999_ms:.2f}" if paced else ""
    text = (
        f"{result.rate:,.0f} msgs/s delivered ({result.delivered:,} of {result.expected:,} in "
        f"{result.elapsed_s:.2f} s); latency ms p50 {result.p50_ms:.2f} p99 {result.p99_ms:.2f}{p999} "
        f"max {result.max_ms:.2f} ({result.samples:,} samples); lost {result.lost:,}; {_broker(result)}; "
        f"client cores {result.client_cores:.2f}"
    )
    return f"{text}; FAILED: {result.error}" if result.error else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each scenario (the median is reported)")
    parser.add_argument(
        "--count",
        type=int,
        default=None,
        help="messages per publisher and run (default: S1 50,000, S2 25,000, S5 20,000; "
        "with --rate: rate x --seconds / publishers)",
    )
    parser.add_argument(
        "--scenario",
        type=str.upper,
        choices=[s.key for s in SCENARIOS],
        action="append",
        help="run only this scenario (may be repeated; default: all in turn)",
    )
    parser.add_argument("--rate", type=int, default=0, help="publish this many msgs/s in all (a latency run)")
    parser.add_argument("--seconds", type=int, default=10, help="length of a --rate run")
    parser.add_argument("--host", default="127.0.0.1", help="gateway host (with --port)")
    parser.add_argument("--port", type=int, default=None, help="MQTT port of a gateway already running")
    parser.add_argument("--core-pid", type=int, default=None, help="with --port: the core process to watch")
    parser.add_argument("--gateway-pid", type=int, default=None, help="with --port: the gateway process to watch")
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
    with gateway_target(
        "mqtt",
        mqtt_gateway,
        args.host,
        args.port,
        {"core": args.core_pid, "gateway": args.gateway_pid},
        tls=args.tls,
    ) as (port, servers, ca_file):
        for scenario in scenarios:
            count = args.count or (
                math.ceil(args.rate * args.seconds / scenario.publishers) if args.rate else scenario.count
            )
            paced = f" at {args.rate:,} msgs/s" if args.rate else ""
            results = []
            for n in range(1, args.runs + 1):
                opts = RunOptions(
                    args.host,
                    port,
                    uuid.uuid4().hex[:12],
                    scenario.qos,
                    scenario.publishers,
                    count,
                    count * scenario.publishers,
                    args.rate,
                    args.deadline,
                    ca_file,
                )
                result = run_once(opts, scenario, servers)
                results.append(result)
                print(f"{scenario.key} run {n}{paced}: {_describe(result, paced=bool(args.rate))}", flush=True)
            fields = ("rate", "elapsed_s", "p50_ms", "p99_ms", "p999_ms", "max_ms", "client_cores")
            median = replace(
                results[0], **{name: statistics.median(getattr(r, name) for r in results) for name in fields}
            )
            rates = [r.rate for r in results]
            failed = sum(1 for r in results if r.error)
            broker = statistics.median(r.broker_us for r in results)
            p999 = f" p99.9 {median.p999_ms:.2f}" if args.rate else ""
            print(
                f"{scenario.title}{paced.upper()} median {median.rate:,.0f} msgs/s delivered (min {min(rates):,.0f}, "
                f"max {max(rates):,.0f}) over {args.runs} runs of {scenario.publishers} x {count:,}; latency ms "
                f"p50 {median.p50_ms:.2f} p99 {median.p99_ms:.2f}{p999} max {median.max_ms:.2f}; lost "
                f"{sum(r.lost for r in results):,} in all; broker CPU µs/msg {broker:.1f}"
                + (f"; {failed} FAILED" if failed else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
