"""Flow control in bytes, end to end, against real processes: a producer of large messages is held near the
core's memory limit (blocked, not refused) and resumes once a consumer drains; a gateway relaying large
messages to a client that does not read holds a bounded number of bytes, and the client gets every message
once it reads again.

Memory is a process's VmRSS, sampled in a thread while the traffic runs (its growth over the value on entry).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from pathlib import Path
from types import TracebackType

import msgpack
import pytest
from tests.conftest import start_core

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.ops import Op
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


class PeakRss:
    """A process's VmRSS growth over its value on entry, sampled in a thread until exit."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = rss(pid)
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def _sample(self) -> None:
        deadline = time.monotonic() + 300
        while not self._stop.wait(0.005) and time.monotonic() < deadline:
            try:
                self.peak = max(self.peak, rss(self.pid))
            except (FileNotFoundError, ProcessLookupError):  # the process died: the test says so
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))


# ---------------------------------------------------------------------------------------------- the core
async def test_a_producer_of_large_messages_is_blocked_near_the_memory_limit_and_resumes(tmp_path: Path) -> None:
    limit = 24 * MIB
    window = 8 * MIB
    body = b"x" * MIB
    total = 160  # 160 MiB: more than six times the limit
    node = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MEMORY_BYTES=str(limit),
                      TRIDENTMQ_CORE_LINK_PUBLISH_WINDOW_BYTES=str(window))  # fmt: skip
    try:
        async with LinkClient("127.0.0.1", node.link_port) as producer, \
                LinkClient("127.0.0.1", node.link_port) as consumer_link:  # fmt: skip
            await producer.create_queue("big", durable=False)
            sent = confirmed = 0
            blocked = asyncio.Event()

            def settled(_: asyncio.Future[None]) -> None:
                nonlocal confirmed
                confirmed += 1
                # Every publish sent is confirmed and the window stays shut: the core processed them all and
                # sent no credit with their confirms (it goes out in the same frame when it is granted).
                if confirmed == sent and producer.publish_credit == 0:
                    blocked.set()

            async def produce() -> None:
                nonlocal sent
                futures = []
                for _ in range(total):
                    future = await producer.send(new_message("big", body, durable=False))
                    sent += 1
                    future.add_done_callback(settled)
                    futures.append(future)
                await asyncio.gather(*futures)

            with PeakRss(node.process.pid) as memory:
                task = asyncio.create_task(produce())
                await asyncio.wait_for(blocked.wait(), 60)
                assert not task.done()  # blocked, not refused: nothing failed
                held = confirmed
                # Held at the limit plus one byte window and one message (the accounting counts bodies).
                assert held * MIB <= limit + window + MIB, held
                assert held * MIB >= limit  # and blocked only once the limit was reached
                consumer = await consumer_link.subscribe("big", credit=50, auto_ack=True, credit_bytes=4 * MIB)
                received = 0
                while received < total:
                    batch = await consumer.get_batch(timeout=30)
                    assert batch, f"stalled after {received} messages"
                    assert all(len(message[11]) == MIB for _, message in batch)
                    received += len(batch)
                await asyncio.wait_for(task, 30)
            assert received == total == confirmed
            # Generous: the bodies held (limit + window) plus the interpreter's own buffers and fragmentation;
            # before the byte window the whole 160 MiB flood was taken in.
            assert memory.growth < 3 * (limit + window), f"the core grew by {memory.growth / MIB:.0f} MiB"
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log()


def test_a_version_1_link_gets_a_message_window_that_bounds_its_bytes(tmp_path: Path) -> None:
    # No byte credit in version 1: the core grants as many publishes as the byte window holds at the largest
    # message size (16 MiB / 4 MiB here), so an old or hostile client cannot queue a message window of bodies.
    node = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(4 * MIB))
    try:
        with socket.create_connection(("127.0.0.1", node.link_port), timeout=10) as sock:
            hello = msgpack.packb([[Op.HELLO, [1], None, None, "old", 250, 64 * 1024]])
            sock.sendall(struct.pack(">I", len(hello)) + hello)
            data = b""
            while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                chunk = sock.recv(65536)
                assert chunk, "the core closed the link"
                data += chunk
            [welcome] = msgpack.unpackb(data[4 : 4 + struct.unpack(">I", data[:4])[0]])
            assert welcome[0] == Op.WELCOME
            assert welcome[1] == 1  # version 1: no byte field
            assert len(welcome) in (7, 8)
            assert welcome[6] == 4
    finally:
        assert node.stop() == 0
