"""A Jepsen-style total-queue check of the journal's promise: a durable message whose publish was
confirmed survives ``kill -9``.

Three producers publish unique bodies with a window of unconfirmed publishes while a consumer takes and
acknowledges some of them; the core is killed with SIGKILL at a random moment, restarted on the same data
directory and drained. After three such cycles and a final clean stop/start, the history is checked:

* lost = confirmed - delivered must be empty (a publish whose future failed is "unknown", not lost);
* unexpected = delivered - sent must be empty;
* duplicates (bodies delivered more than once) are allowed (at-least-once) and only reported, as are
  redeliveries after a crash that do not carry a delivery count above 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, start_core

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import M_BODY, M_ID, new_message

pytestmark = [pytest.mark.integration, pytest.mark.fault]

QUEUE = "crash.q"
PRODUCERS = 3
WINDOW = 200  # unconfirmed publishes in flight per producer
CYCLES = 3
SEED = int(os.environ.get("TRIDENTMQ_CRASH_SEED", "20240611"))
NO_RECONNECT = ReconnectPolicy(attempts=0)
STEP_TIMEOUT = 5.0  # bound of every single await against the core


@dataclass
class History:
    sent: set[bytes] = field(default_factory=set)  # every body handed to send(), confirmed or not
    confirmed: set[bytes] = field(default_factory=set)
    unknown: set[bytes] = field(default_factory=set)  # the confirm future failed: the link died
    delivered: Counter[bytes] = field(default_factory=Counter)
    # bodies handed to the live consumer and never acknowledged by it when the core was killed
    held: set[bytes] = field(default_factory=set)
    redelivered_flagged: int = 0  # came back after a crash, delivered before, delivery count > 1
    redelivered_unflagged: int = 0  # came back after a crash, delivered before, delivery count == 1
    next_number: dict[int, int] = field(default_factory=dict)  # producer → next unique number

    def settle(self, body: bytes, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.confirmed.add(body)
        else:
            self.unknown.add(body)


def client(node: CoreProcess) -> LinkClient:
    return LinkClient("127.0.0.1", node.link_port, reconnect=NO_RECONNECT, connect_timeout=STEP_TIMEOUT)


async def produce(c: LinkClient, producer: int, history: History, stop: asyncio.Event) -> None:
    """Publish unique durable bodies until the link dies, keeping at most ``WINDOW`` unconfirmed."""
    in_flight: set[asyncio.Future[None]] = set()
    try:
        while not stop.is_set():
            if len(in_flight) >= WINDOW:
                done, _ = await asyncio.wait(in_flight, timeout=STEP_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
                assert done, f"producer {producer}: no confirm for {STEP_TIMEOUT} s"
                in_flight -= done
                continue
            number = history.next_number.get(producer, 0)
            history.next_number[producer] = number + 1
            body = f"p{producer}-{number}".encode()
            history.sent.add(body)
            message = new_message(QUEUE, body, durable=True, properties={"producer": producer, "n": number})
            try:
                (future,) = await asyncio.wait_for(c.publish_batch([message]), STEP_TIMEOUT)
            except LinkRequestError:
                history.unknown.add(body)  # the link is gone (it may not even have been written)
                break
            future.add_done_callback(lambda f, b=body: history.settle(b, f))
            in_flight.add(future)
    finally:
        # After a SIGKILL every unconfirmed future fails at once (no reconnect); wait for them all.
        if in_flight:
            await asyncio.wait(in_flight, timeout=STEP_TIMEOUT)
        for future in in_flight:
            if not future.done():
                future.cancel()  # still unresolved: recorded as unknown by its callback


async def consume_live(c: LinkClient, history: History, stop: asyncio.Event) -> None:
    """Take messages while the producers run, acknowledging each batch only once the next one arrived, so
    that at the kill some deliveries are acknowledged and some are still held."""
    consumer = await asyncio.wait_for(c.subscribe(QUEUE, credit=100), STEP_TIMEOUT)
    unacked: dict[int, bytes] = {}  # message id → body, delivered here and not acknowledged yet
    try:
        while not stop.is_set():
            batch = await consumer.get_batch(timeout=0.2)
            if not batch:
                continue
            earlier = list(unacked)
            for _, m in batch:
                body = bytes(m[M_BODY])
                history.delivered[body] += 1
                unacked[m[M_ID]] = body
            if earlier:
                consumer.ack_ids(earlier)  # raises once the link is dead (a buffered batch may still come)
                for message_id in earlier:
                    del unacked[message_id]
            await asyncio.sleep(0.05)  # slower than the producers: a backlog builds up
    except LinkRequestError:
        pass  # the core was killed
    history.held.update(unacked.values())


def recovered(node: CoreProcess) -> dict[str, int]:
    with urllib.request.urlopen(node.management_url + "/readyz", timeout=STEP_TIMEOUT) as response:
        return dict(json.loads(response.read())["recovered"])


async def drain(node: CoreProcess, history: History, *, after_crash: bool) -> int:
    """Take and acknowledge everything in the queue; returns how many messages came back."""
    expect = recovered(node).get(QUEUE, 0)
    delivered_before = set(history.delivered)
    got = 0
    async with client(node) as c:
        consumer = await asyncio.wait_for(c.subscribe(QUEUE, credit=1000), STEP_TIMEOUT)
        while True:
            # Wait long while the recovered count is not reached; then only make sure nothing else follows.
            batch = await consumer.get_batch(timeout=STEP_TIMEOUT if got < expect else 0.3)
            if not batch:
                break
            for count, m in batch:
                body = bytes(m[M_BODY])
                history.delivered[body] += 1
                if after_crash and body in delivered_before:
                    if count > 1:
                        history.redelivered_flagged += 1
                    else:
                        history.redelivered_unflagged += 1
            consumer.ack_ids([m[M_ID] for _, m in batch])
            got += len(batch)
        await asyncio.wait_for(consumer.close(), STEP_TIMEOUT)
    assert got >= expect, f"the core recovered {expect} messages in {QUEUE} but only {got} were delivered"
    return got


def assert_clean_log(node: CoreProcess) -> None:
    log = node.log()
    assert "Traceback" not in log, log


async def cycle(node: CoreProcess, history: History, delay: float) -> None:
    """Producers and a consumer run against ``node`` until it is killed after ``delay`` seconds."""
    stop = asyncio.Event()
    clients = [client(node) for _ in range(PRODUCERS + 1)]
    tasks: list[asyncio.Task[None]] = []
    try:
        for c in clients:
            await asyncio.wait_for(c.connect(), STEP_TIMEOUT)
        tasks += [asyncio.create_task(produce(c, p, history, stop)) for p, c in enumerate(clients[:PRODUCERS])]
        tasks.append(asyncio.create_task(consume_live(clients[-1], history, stop)))
        await asyncio.sleep(delay)
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        assert not failed, f"a task failed before the kill: {failed[0].exception()!r}"
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=STEP_TIMEOUT)
        assert_clean_log(node)  # the killed node's own log, before a restart overwrites it
        await asyncio.sleep(0.2)  # the link loss reaches the clients; then stop whatever still runs
        stop.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2 * STEP_TIMEOUT)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"a task failed after the kill: {errors[0]!r}"
    finally:
        stop.set()
        for c in clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.close(), STEP_TIMEOUT)
        for task in tasks:
            task.cancel()  # only reached by a task still running after a failed assertion


@pytest.mark.timeout(90)
async def test_confirmed_durable_messages_survive_kill_9(tmp_path: Path) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    history = History()
    nodes: list[CoreProcess] = []
    per_cycle: list[str] = []
    try:
        nodes.append(start_core(tmp_path))
        for number in range(CYCLES):
            delay = rng.uniform(0.3, 1.5)
            confirmed_before, delivered_before = len(history.confirmed), history.delivered.total()
            await cycle(nodes[-1], history, delay)
            nodes.append(start_core(tmp_path))
            drained = await drain(nodes[-1], history, after_crash=True)
            assert_clean_log(nodes[-1])
            per_cycle.append(
                f"cycle {number}: kill after {delay:.2f} s, "
                f"{len(history.confirmed) - confirmed_before} confirmed, "
                f"{history.delivered.total() - delivered_before - drained} delivered live, {drained} drained"
            )
        # A clean stop and start: nothing may be left, nothing may come back.
        code = nodes[-1].stop()
        assert code == 0, f"core exited with {code}:\n{nodes[-1].log()}"
        assert_clean_log(nodes[-1])
        nodes.append(start_core(tmp_path))
        final = await drain(nodes[-1], history, after_crash=False)
        assert_clean_log(nodes[-1])
    finally:
        for node in nodes:
            node.stop()  # SIGTERM, then SIGKILL, to this Popen's PID only; a no-op for exited nodes

    lost = history.confirmed - set(history.delivered)
    unexpected = set(history.delivered) - history.sent
    duplicates = {body: n for body, n in history.delivered.items() if n > 1}
    # Handed to the live consumer, never acknowledged, and not delivered again after the crash.
    held_not_back = {body for body in history.held if history.delivered[body] < 2}
    summary = "\n".join(
        [
            f"seed {SEED}, {time.monotonic() - started:.1f} s",
            *per_cycle,
            f"final drain after a clean restart: {final}",
            (
                f"sent {len(history.sent)}, confirmed {len(history.confirmed)}, unknown {len(history.unknown)}, "
                f"delivered {len(history.delivered)} distinct / {history.delivered.total()} total"
            ),
            f"lost {len(lost)}, unexpected {len(unexpected)}, duplicates {len(duplicates)}",
            f"held unacknowledged at a kill {len(history.held)}, of which not redelivered {len(held_not_back)}",
            (
                f"redelivered after a crash: {history.redelivered_flagged} with delivery count > 1, "
                f"{history.redelivered_unflagged} with delivery count 1"
            ),
        ]
    )
    print(summary)
    assert history.confirmed, f"nothing was confirmed: the check proved nothing\n{summary}"
    assert not lost, f"confirmed but never delivered: {sorted(lost)[:20]}\n{summary}"
    assert not unexpected, f"delivered but never sent: {sorted(unexpected)[:20]}\n{summary}"
    assert final == 0, f"{final} messages came back after everything was acknowledged\n{summary}"
