"""The options of ``tridentmq audit stream``, their defaults defined here once (the command line takes them
from here), without importing Spark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StreamOptions:
    audit_dir: Path
    checkpoint: Path
    out: Path | None = None
    window_seconds: int = 60
    watermark_seconds: int = 30
    stranded_seconds: int = 60
    dead_letter_spike: int = 10
    trigger_seconds: float = 5.0
    once: bool = False
    alerts_to: str | None = None  # tmq://host:port/address: alerts also published as messages there
    max_restarts: int = 5  # failures of one query within RESTART_WINDOW_S that it is restarted after

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StreamOptions:
        return cls(
            args.audit_dir,
            args.checkpoint,
            args.out,
            args.window_seconds,
            args.watermark_seconds,
            args.stranded_seconds,
            args.dead_letter_spike,
            args.trigger_seconds,
            args.once,
            args.alerts_to,
            args.max_restarts,
        )
