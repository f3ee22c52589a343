"""Benchmark of one core node over the internal link: throughput and latency (issue 2's targets).

Starts its own core process on free loopback ports with a throw-away data directory, then runs
``tridentmq perf`` workloads (one producer process and one consumer process, 100-byte non-durable
messages) and prints the figures with a description of the machine:

    uv run python bench/core_link.py [--runs 5] [--count 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tridentmq_shared.cli.perf import PerfOptions, run_once


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, {platform.system()}"


def start_core(data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    ports = data_dir / "ports.json"
    env = {**os.environ, "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir), "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
           "TRIDENTMQ_CORE_LINK_PORT": "0", "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
           "TRIDENTMQ_CORE_NODE_LOG_LEVEL": "WARNING"}  # fmt: skip
    core = subprocess.Popen([sys.executable, "-m", "tridentmq_core", "--ports-file", str(ports)], env=env)
    deadline = time.monotonic() + 20
    while not ports.exists():
        if core.poll() is not None or time.monotonic() > deadline:
            core.kill()
            raise SystemExit("the core did not start")
        time.sleep(0.05)
    return core, int(json.loads(ports.read_text())["link"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="throughput runs (the median is reported)")
    parser.add_argument("--count", type=int, default=1_000_000, help="messages per throughput run")
    parser.add_argument("--latency-rate", type=int, default=5_000, help="msgs/s of the latency run")
    parser.add_argument("--latency-seconds", type=int, default=10)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tridentmq-bench-") as tmp:
        core, port = start_core(Path(tmp))
        try:
            base = PerfOptions("127.0.0.1", port, None, None, args.count, 100, durable=False, rate=0, window=10_000)
            rates = []
            for n in range(1, args.runs + 1):
                result = run_once(base)
                rates.append(result["rate"])
                print(f"throughput run {n}: {result['rate']:,.0f} msgs/s delivered ({result['received']:,} messages)")
            print(f"THROUGHPUT median {statistics.median(rates):,.0f} msgs/s "
                  f"(min {min(rates):,.0f}, max {max(rates):,.0f}) over {args.runs} runs")  # fmt: skip
            paced = PerfOptions("127.0.0.1", port, None, None, args.latency_rate * args.latency_seconds, 100,
                                durable=False, rate=args.latency_rate, window=10_000)  # fmt: skip
            latency = run_once(paced)["latency_ms"]
            print(f"LATENCY at {args.latency_rate:,} msgs/s (ms): " +
                  "  ".join(f"{k} {v:.3f}" for k, v in latency.items()))  # fmt: skip
        finally:
            core.terminate()
            core.wait(timeout=10)


if __name__ == "__main__":
    main()
