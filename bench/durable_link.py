"""Durable benchmark of one core over the link: group commit against the disk's own fsync rate.

Measures the raw ``fdatasync`` rate of the disk the journal is on, starts a core on it, runs the durable
``tridentmq perf`` workload (100-byte durable messages, one producer keeping its publish window full and
waiting for every confirm, one consumer acknowledging), and prints the delivered rate with the journal's
own counters from ``/metrics``: group commits, and the mean number of records each one carried.

    uv run python -m bench.durable_link [--runs 3] [--count 300000]
    uv run python -m bench.durable_link --rate 30000 [--runs 3] [--count 300000]   # latency at a fixed rate

With ``--rate`` the producer publishes at that rate instead of keeping its window full, and each run prints
the latency from publish to delivery (p50 to max): what the core's stalls (a roll of the audit stream, a
collection) cost durable messages below saturation.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.node import core_node, machine

from tridentmq_core.store.journal import measure_fsync
from tridentmq_shared.cli.perf import PerfOptions, run_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs (the median is reported)")
    parser.add_argument("--count", type=int, default=300_000, help="messages per run")
    parser.add_argument("--rate", type=int, default=0, help="msgs/s the producer publishes at (0: flat out)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tridentmq-durable-") as tmp:
        data_dir = Path(tmp) / "core"
        rate = measure_fsync(data_dir / "journal")
        print(f"disk: {rate:,.0f} fdatasync/s for 4 KiB writes (the journal's directory)")
        with core_node(data_dir) as core:
            rates = []
            for n in range(1, args.runs + 1):
                records = core.metric("tridentmq_journal_records_synced_total")
                syncs = core.metric("tridentmq_journal_syncs_total")
                opts = PerfOptions(
                    "127.0.0.1",
                    core.link_port,
                    None,
                    None,
                    args.count,
                    100,
                    durable=True,
                    rate=args.rate,
                    window=10_000,
                )
                result = run_once(opts)
                records = core.metric("tridentmq_journal_records_synced_total") - records
                syncs = core.metric("tridentmq_journal_syncs_total") - syncs
                rates.append(result["rate"])
                per_second, per_sync = syncs / result["elapsed_s"], records / max(syncs, 1)
                print(
                    f"run {n}: {result['rate']:,.0f} msgs/s delivered; {syncs:,.0f} group commits "
                    f"({per_second:,.0f}/s) of {per_sync:,.1f} records each"
                )
                if args.rate:
                    print(
                        f"run {n} latency (ms): "
                        + "  ".join(f"{name} {value:.2f}" for name, value in result["latency_ms"].items())
                    )
    print(
        f"DURABLE median {statistics.median(rates):,.0f} msgs/s delivered (min {min(rates):,.0f}, "
        f"max {max(rates):,.0f}) over {args.runs} runs; disk {rate:,.0f} fdatasync/s"
    )


if __name__ == "__main__":
    main()
