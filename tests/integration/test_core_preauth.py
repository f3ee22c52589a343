"""Unauthenticated peers on the core link cannot grow a real core's memory or stall it (issue 22, item 2).

Hostile raw sockets send what a HELLO-less peer can: frames announcing 16 MiB, frames of msgpack empty
arrays or nils, or nothing at all. Meanwhile a legitimate link client keeps publishing and consuming, and
the core's resident memory is sampled from /proc: it must stay within a bound derived from the settings.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from tests.conftest import CoreProcess, start_core
from tests.integration.cluster_nodes import wait_until_async

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration

HANDSHAKE_FRAME = 64 * 1024  # link.handshake_max_frame_bytes (the default)
MAX_HANDSHAKING = 32  # link.max_handshaking, lowered so the attack overflows it
#: Bytes one read may hand the protocol before the frame header is checked (asyncio and uvloop read 256 KiB).
READ_CHUNK = 256 * 1024
#: The legitimate client's traffic, the allocator's arenas and the hostile connections' kernel-side state.
SLACK = 48 * 1024 * 1024
BIG = 16 * 1024 * 1024  # what the attacker announced (the link's full frame limit)
PER_KIND = 40  # connections of each kind of attack


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """Samples a process's RSS in a thread until stopped; keeps the highest value."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = _rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _frame_of(item: bytes, size: int) -> tuple[bytes, Callable[[int], bytes]]:
    """The header of a ``size``-byte frame holding one msgpack array of ``item``s, and its body in chunks."""
    count = size - 5
    header = struct.pack(">I", size) + b"\xdd" + struct.pack(">I", count)
    return header, lambda n: item * n


def _attack(port: int, header: bytes, body: Callable[[int], bytes], length: int, closed: list[bool]) -> None:
    """Send ``header`` then ``length`` body bytes as fast as the core takes them; note whether the core
    closed the connection (EOF or reset) rather than keeping it."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(header)
            sent = 0
            while sent < length:
                chunk = body(min(256 * 1024, length - sent))
                sock.sendall(chunk)
                sent += len(chunk)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        closed.append(True)  # recv returned b"" or the core reset us: a hang fails on the socket timeout


def _silent(port: int, stop: threading.Event, closed: list[bool]) -> None:
    """Connect and say nothing until told to go (fills the handshaking slots)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.settimeout(0.05)
        while not stop.is_set():
            try:
                if sock.recv(65536) == b"":
                    closed.append(True)  # refused at the limit
                    return
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed.append(True)
                return


async def _round_trip(producer: LinkClient, consumer_link: LinkClient, queue: str, count: int) -> None:
    consumer = await consumer_link.subscribe(queue, credit=count, auto_ack=True)
    await asyncio.gather(*[producer.publish(new_message(queue, b"m%d" % i)) for i in range(count)])
    received = 0
    while received < count:
        delivery = await consumer.get(timeout=30)
        assert delivery is not None, f"the core stalled: {received} of {count} delivered"
        received += 1
    await consumer.close()


async def test_hostile_handshakes_leave_memory_bounded_and_the_core_serving(tmp_path: Path) -> None:
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_MAX_HANDSHAKING=str(MAX_HANDSHAKING))
    try:
        async with (
            LinkClient("127.0.0.1", node.link_port) as producer,
            LinkClient("127.0.0.1", node.link_port) as consumer_link,
        ):
            await producer.create_queue("live", durable=False)
            await _round_trip(producer, consumer_link, "live", 200)  # warmed up before the baseline
            baseline = _rss(node.process.pid)
            sampler = PeakRss(node.process.pid)
            closed: list[bool] = []
            attacks = []
            for item in (b"\x00", b"\x90", b"\xc0"):  # raw bytes, empty arrays, nils
                header, body = _frame_of(item, BIG)
                attacks += [(header, body, BIG - 6) for _ in range(PER_KIND)]  # all but the last byte
                small_header, small_body = _frame_of(item, HANDSHAKE_FRAME)  # fits the handshake limit
                attacks += [(small_header, small_body, HANDSHAKE_FRAME - 5) for _ in range(PER_KIND)]
            threads = [threading.Thread(target=_attack, args=(node.link_port, h, b, n, closed)) for h, b, n in attacks]
            stop_silent = threading.Event()
            silent_closed: list[bool] = []
            silent = [
                threading.Thread(target=_silent, args=(node.link_port, stop_silent, silent_closed))
                for _ in range(PER_KIND)
            ]
            for thread in threads + silent:
                thread.start()
            rounds = 0
            while rounds == 0 or any(t.is_alive() for t in threads):  # the legitimate client works meanwhile
                await _round_trip(producer, consumer_link, "live", 50)
                rounds += 1
            await asyncio.to_thread(lambda: [t.join() for t in threads])
            # The silent connections came last: a loaded core may still have some waiting in its accept queue
            # once the attacks are over. Those beyond the limit must be refused when it gets to them.
            await wait_until_async(
                lambda: len(silent_closed) >= PER_KIND - MAX_HANDSHAKING, 30, "the connections beyond the limit refused"
            )
            stop_silent.set()
            await asyncio.to_thread(lambda: [t.join() for t in silent])
            peak = sampler.stop()
            bound = baseline + MAX_HANDSHAKING * (HANDSHAKE_FRAME + READ_CHUNK) + SLACK
            mib = 2**20
            assert peak <= bound, f"RSS {peak / mib:.0f} MiB above {bound / mib:.0f} (baseline {baseline / mib:.0f})"
            assert len(closed) == len(attacks)  # the core closed every hostile connection
            await _round_trip(producer, consumer_link, "live", 50)
    finally:
        assert node.stop() == 0
    log = node.log()
    assert "Traceback" not in log
    assert " ERROR " not in log
    assert log.count("connection refused: limit reached") == 1  # then counted, once a minute


def _connect_refused(node: CoreProcess) -> tuple[str, str]:
    with socket.create_connection(("127.0.0.1", node.link_port), timeout=30) as sock:
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    (size,) = struct.unpack(">I", data[:4])
    [close] = msgpack.unpackb(data[4 : 4 + size])
    return close[1], close[2]


async def test_connections_beyond_the_handshaking_limit_are_refused_until_one_completes(tmp_path: Path) -> None:
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_MAX_HANDSHAKING="3")
    holders = [socket.create_connection(("127.0.0.1", node.link_port), timeout=30) for _ in range(3)]
    try:
        code, text = await asyncio.to_thread(_connect_refused, node)
        assert code == ErrorCode.RESOURCE_LIMIT
        assert "handshake" in text
        with pytest.raises(LinkRequestError) as refused:  # its HELLO may cross the CLOSE: then a reset
            await LinkClient("127.0.0.1", node.link_port).connect()
        assert refused.value.code in (ErrorCode.RESOURCE_LIMIT, ErrorCode.EOF)
        holders.pop().close()
        # The slot frees once the core has seen the close: a client gets in then (it retries until it does).
        client = LinkClient(
            "127.0.0.1",
            node.link_port,
            reconnect=ReconnectPolicy(retry_interval=0.05, max_interval=0.2, initial_attempts=200),
        )
        await client.connect()
        await client.create_queue("after", durable=False)
        await client.publish(new_message("after", b"in"))
        await client.close()
    finally:
        for sock in holders:
            sock.close()
        assert node.stop() == 0
