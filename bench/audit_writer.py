"""The audit writer's cost per durable message on the core, with and without the flush before confirms.

Drives the core's real ``FileAuditSink`` the way the broker does for a durable message (``msg.sent`` and
``msg.acked``, two events) into a real segment folder, and flushes the buffer once per event-loop turn as
the server does since the audit events of confirmed messages must survive a kill of the process. A turn
carries as many messages as a batch from the clients brought: the cost of the flush (one ``write``) is
shared by them. Flushing never is the writer before that change (a write only every 256 KiB or once a
second); the last setting adds the ``msg.delivered`` event each delivery writes now.

    uv run python -m bench.audit_writer [--messages 200000] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.node import machine

from tridentmq_core.audit_writer import FileAuditSink

_EMPTY: dict[str, object] = {}


def run(directory: Path, messages: int, turn: int, delivered: bool = False) -> float:
    """µs of writer CPU per durable message (two events, three with ``delivered``), flushing every ``turn``
    messages (0: never)."""
    sink = FileAuditSink(directory, "bench", roll_seconds=3600, heartbeat_seconds=3600)
    ts = time.time_ns() // 1000
    start = time.process_time_ns()
    for n in range(messages):
        message_id = f"node-{n}"
        sink.emit_message(ts, "msg.sent", None, "bench.q", message_id, 100, "link", ts, _EMPTY)
        if delivered:
            sink.emit_delivered(ts, "bench.q", "bench.q", message_id, 100, "link", ts, 1, "c-1", "7", "bench-client")
        sink.emit_acked(ts, "bench.q", "bench.q", message_id, 100, "link", ts, "c-1", "7", "bench-client")
        if turn and n % turn == 0:
            sink.flush()
    sink.flush()
    elapsed = time.process_time_ns() - start
    sink.close()
    return elapsed / 1000 / messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000, help="durable messages per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per setting (the median is reported)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    settings = [(turn, False) for turn in (0, 1000, 100, 10, 1)] + [(100, True)]
    for turn, delivered in settings:
        costs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="tridentmq-audit-") as tmp:
                costs.append(run(Path(tmp), args.messages, turn, delivered))
        label = "before (no flush per turn)" if turn == 0 else f"flush every {turn} messages"
        if delivered:
            label += " + msg.delivered"
        print(
            f"{label:>30}: {statistics.median(costs):.2f} µs per durable message (runs: "
            + ", ".join(f"{c:.2f}" for c in costs)
            + ")"
        )


if __name__ == "__main__":
    main()
