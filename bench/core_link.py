"""Benchmark of one core node over the internal link: throughput and latency (issue 2's targets).

Starts its own core process on free loopback ports with a throw-away data directory, then runs
``tridentmq perf`` workloads (one producer process and one consumer process, 100-byte non-durable
messages) and prints the figures with a description of the machine:

    uv run python -m bench.core_link [--runs 5] [--count 1000000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.node import core_node, machine

from tridentmq_shared.cli.perf import PerfOptions, run_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="throughput runs (the median is reported)")
    parser.add_argument("--count", type=int, default=1_000_000, help="messages per throughput run")
    parser.add_argument("--latency-rate", type=int, default=5_000, help="msgs/s of the latency run")
    parser.add_argument("--latency-seconds", type=int, default=10)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tridentmq-bench-") as tmp, core_node(Path(tmp)) as core:
        port = core.link_port
        base = PerfOptions("127.0.0.1", port, None, None, args.count, 100, durable=False, rate=0, window=10_000)
        rates = []
        for n in range(1, args.runs + 1):
            result = run_once(base)
            rates.append(result["rate"])
            print(f"throughput run {n}: {result['rate']:,.0f} msgs/s delivered ({result['received']:,} messages)")
        print(
            f"THROUGHPUT median {statistics.median(rates):,.0f} msgs/s "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f}) over {args.runs} runs"
        )
        paced = PerfOptions(
            "127.0.0.1",
            port,
            None,
            None,
            args.latency_rate * args.latency_seconds,
            100,
            durable=False,
            rate=args.latency_rate,
            window=10_000,
        )
        latency = run_once(paced)["latency_ms"]
        print(f"LATENCY at {args.latency_rate:,} msgs/s (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in latency.items()))


if __name__ == "__main__":
    main()
