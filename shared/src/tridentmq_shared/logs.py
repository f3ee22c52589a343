"""Structured logging: one line per record, ``key=value`` fields after the message, UTC timestamps."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    """``2026-11-22T03:04:05.678Z INFO tridentmq.core message key=value …`` (extra= fields become pairs)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d}Z {record.levelname} {record.name} {record.getMessage()}"
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if extras:
            line += " " + " ".join(f"{k}={_quote(v)}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _quote(value: Any) -> str:
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger for a TridentMQ process (stderr, key=value lines)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
