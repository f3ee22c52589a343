"""Routing with 100,000 device topics while devices keep joining (issue 23).

A pure broker is driven through real link codecs (the unit tests' harness). ``--devices`` device addresses
are made, each with its own queue (a device's subscription to its own topic), beside a few wildcard
subscriptions over all of them (``devices.#``, ``devices.*.up``, ``*.*.up``). Then two figures:

- creating the addresses: one queue per device address over the link, with ``--publishes-per-device``
  routing look-ups of random existing devices after each one (traffic flows while devices join);
- routing cost per publish: the broker's route look-up for a random device address, with no device joining,
  and with one joining every ``--churn`` publishes.

Before precise invalidation every new queue dropped every cached route, so with devices joining nearly every
publish computed its route again; now a new device drops only its own address's routes.

    uv run python -m bench.routing [--devices 100000] [--publishes 200000] [--churn 100]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.node import machine
from tests.unit.broker_harness import MULTICAST, Client, Harness, ok

from tridentmq_shared.message import new_message

WILDCARDS = ("devices.#", "devices.*.up", "*.*.up")


def create_devices(client: Client, first: int, count: int) -> None:
    for i in range(first, first + count):
        ok(client.create_queue(f"d{i}", f"devices.d{i}.up", MULTICAST, durable=False))


def route_cost(harness: Harness, devices: int, publishes: int, churn: int, rng: random.Random) -> float:
    """µs of CPU per route look-up of a random device address; a new device joins every ``churn`` (0: none)."""
    broker = harness.broker
    client = harness.clients[0]
    messages = [new_message(f"devices.d{rng.randrange(devices)}.up", b"x", routing=MULTICAST) for _ in range(1000)]
    joined = devices
    spent = 0
    for n in range(publishes):
        if churn and n % churn == 0:
            create_devices(client, joined, 1)  # not counted: the look-ups after it are
            joined += 1
        message = messages[n % 1000]
        start = time.process_time_ns()
        broker.route(message, harness.now_ms)
        spent += time.process_time_ns() - start
    return spent / publishes / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--publishes", type=int, default=200_000, help="route look-ups per figure")
    parser.add_argument("--churn", type=int, default=100, help="publishes per device joining")
    parser.add_argument("--publishes-per-device", type=int, default=10, help="look-ups after each device made")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rng = random.Random(23)
    harness = Harness()
    client = harness.connect("bench")
    for pattern in WILDCARDS:
        ok(client.create_queue(pattern, pattern, MULTICAST, durable=False))
    broker = harness.broker
    wall = time.perf_counter()
    cpu = time.process_time()
    for i in range(args.devices):
        create_devices(client, i, 1)
        for _ in range(args.publishes_per_device):
            target = new_message(f"devices.d{rng.randrange(i + 1)}.up", b"x", routing=MULTICAST)
            broker.route(target, harness.now_ms)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    print(
        f"CREATE {args.devices:,} device addresses with {args.publishes_per_device} look-ups after each: "
        f"{wall:.1f} s wall, {cpu:.1f} s CPU ({args.devices / wall:,.0f} addresses/s)"
    )
    steady = route_cost(harness, args.devices, args.publishes, 0, rng)
    print(f"ROUTE steady: {steady:.2f} µs CPU per publish ({args.devices:,} devices, {len(WILDCARDS)} wildcards)")
    joining = route_cost(harness, args.devices, args.publishes, args.churn, rng)
    print(f"ROUTE with a device joining every {args.churn} publishes: {joining:.2f} µs CPU per publish")


if __name__ == "__main__":
    main()
