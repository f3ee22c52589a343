"""Recovery benchmark: time and peak memory for a core node to be ready on a journal.

Writes the journal with the journal writer itself (an address, a durable anycast queue, then the messages in
batches of 1,000 as a producer and a consumer would leave them: each batch, then one ACKS record for the
ones consumed), then starts a real core process on it and measures from process start to ready (the moment
it writes its ports file, after recovery and before accepting links), and the process's peak resident
memory then (VmHWM):

    uv run python -m bench.journal_recovery [--messages 1000000] [--acked 0] [--size 100] [--runs 1]
                                            [--page-limit-mib 0]

``--messages`` stay live (spread evenly among the acknowledged ones), ``--acked`` are published and
acknowledged; the journal is not compacted, as after a crash before compaction caught up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.node import core_node, cpu_of, machine

from tridentmq_core.store.journal import Journal
from tridentmq_core.store.journal_store import IDS_PER_RECORD
from tridentmq_core.store.records import RecordType
from tridentmq_shared.message import M_ID, M_TIMESTAMP, new_message

QUEUE = "bench.recovery"
BATCH = 1000


def write_journal(directory: Path, live: int, acked: int, size: int) -> float:
    started = time.monotonic()
    journal = Journal(directory)
    journal.recover()
    journal.start()
    journal.append(RecordType.ADD_ADDRESS, [QUEUE, [0]])
    journal.append(RecordType.ADD_QUEUE, [{"name": QUEUE, "address": QUEUE, "routing_type": 0}])
    body = b"x" * size
    now_ms = time.time_ns() // 1_000_000
    total = live + acked
    every = total / live if live else 0.0  # message n stays live when it is the next of every ``every``
    kept = 0
    consumed: list[int] = []
    for n in range(total):
        message = new_message(QUEUE, body, durable=True)
        message[M_ID] = n + 1
        message[M_TIMESTAMP] = now_ms
        journal.append(RecordType.MESSAGE, [message, [QUEUE]])
        if kept < live and n >= kept * every:
            kept += 1
        else:
            consumed.append(n + 1)
        if (n + 1) % BATCH == 0 or n + 1 == total:
            for start in range(0, len(consumed), IDS_PER_RECORD):
                journal.append(RecordType.ACKS, [QUEUE, consumed[start : start + IDS_PER_RECORD]])
            consumed = []
    journal.close()
    return time.monotonic() - started


def peak_rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB: now, and the peak since it started."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def time_to_ready(data_dir: Path, page_limit_mib: int) -> tuple[float, float, float, float, dict[str, int]]:
    """Seconds to ready, CPU seconds the core used until then, its RSS and peak RSS (MiB), what it recovered."""
    config = None
    if page_limit_mib:
        config = f'[[address_settings]]\nmatch = "bench.#"\nmax_size_bytes = {page_limit_mib << 20}\n'
        config += 'address_full_policy = "PAGE"\n'
    started = time.monotonic()
    with core_node(data_dir, config, broker_max_memory_bytes=str(4 << 30)) as core:
        elapsed = time.monotonic() - started
        cpu = cpu_of(core.process.pid)  # less swayed than the wall time by other work on the machine
        rss, peak = peak_rss_mib(core.process.pid)
        recovered: dict[str, int] = json.loads(core.get("/readyz"))["recovered"]
    return elapsed, cpu, rss, peak, recovered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000, help="live messages (default %(default)s)")
    parser.add_argument("--acked", type=int, default=0, help="published and acknowledged (default %(default)s)")
    parser.add_argument("--size", type=int, default=100, help="body bytes (default %(default)s)")
    parser.add_argument("--runs", type=int, default=1, help="restarts on the same journal (default %(default)s)")
    parser.add_argument("--page-limit-mib", type=int, default=0, help="page the queue above this (0: no paging)")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="tridentmq-recovery-") as tmp:
        data_dir = Path(tmp)
        wrote = write_journal(data_dir / "journal", args.messages, args.acked, args.size)
        size = sum(p.stat().st_size for p in (data_dir / "journal").iterdir())
        print(
            f"journal: {args.messages:,} live and {args.acked:,} acknowledged messages of {args.size} B, "
            f"{size / 2**20:,.0f} MiB of segments (written in {wrote:.1f} s)"
        )
        times, cpus, peaks = [], [], []
        for _ in range(args.runs):
            elapsed, cpu, rss, peak, recovered = time_to_ready(data_dir, args.page_limit_mib)
            times.append(elapsed)
            cpus.append(cpu)
            peaks.append(peak)
            print(
                f"  ready in {elapsed:.2f} s, {cpu:.2f} CPU s (process start included), RSS {rss:.0f} MiB, "
                f"peak RSS {peak:.0f} MiB; recovered {recovered}"
            )
        print(
            f"RECOVERY: ready in {statistics.median(times):.2f} s, {statistics.median(cpus):.2f} CPU s (medians of "
            f"{args.runs}), peak RSS {statistics.median(peaks):.0f} MiB"
        )


if __name__ == "__main__":
    main()
