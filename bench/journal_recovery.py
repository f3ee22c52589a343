"""Recovery benchmark: time for a core node to be ready on a journal holding N live durable messages.

Writes the journal with the journal writer itself (an address, a durable anycast queue, N 100-byte durable
messages), then starts a real core process on it and measures from process start to ready (the moment it
writes its ports file, after recovery and before accepting links):

    uv run python -m bench.journal_recovery [--messages 1000000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.node import core_node

from tridentmq_core.store.journal import Journal
from tridentmq_core.store.records import RecordType
from tridentmq_shared.message import M_ID, M_TIMESTAMP, new_message


def write_journal(directory: Path, count: int) -> float:
    started = time.monotonic()
    journal = Journal(directory)
    journal.recover()
    journal.start()
    journal.append(RecordType.ADD_ADDRESS, ["bench.recovery", [0]])
    journal.append(RecordType.ADD_QUEUE, [{"name": "bench.recovery", "address": "bench.recovery", "routing_type": 0}])
    body = b"x" * 100
    now_ms = time.time_ns() // 1_000_000
    for n in range(count):
        message = new_message("bench.recovery", body, durable=True)
        message[M_ID] = n + 1
        message[M_TIMESTAMP] = now_ms
        journal.append(RecordType.MESSAGE, [message, ["bench.recovery"]])
    journal.close()
    return time.monotonic() - started


def time_to_ready(data_dir: Path) -> tuple[float, dict[str, int]]:
    started = time.monotonic()
    with core_node(data_dir, broker_max_memory_bytes=str(4 << 30)) as core:
        elapsed = time.monotonic() - started
        recovered: dict[str, int] = json.loads(core.get("/readyz"))["recovered"]
    return elapsed, recovered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridentmq-recovery-") as tmp:
        data_dir = Path(tmp)
        wrote = write_journal(data_dir / "journal", args.messages)
        size = sum(p.stat().st_size for p in (data_dir / "journal").iterdir())
        print(
            f"journal: {args.messages:,} live messages, {size / 2**20:,.0f} MiB of segments (written in {wrote:.1f} s)"
        )
        elapsed, recovered = time_to_ready(data_dir)
        print(f"RECOVERY: ready in {elapsed:.2f} s (process start included); recovered {recovered}")


if __name__ == "__main__":
    main()
