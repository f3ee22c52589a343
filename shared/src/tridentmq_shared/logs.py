"""Structured logging: one line per record, ``key=value`` fields after the message, UTC timestamps.

Much of what is logged comes from clients (user names, client and container ids, destinations, error texts),
and a client must not be able to write a line of its own into the log: control characters in the message and
in every field are shown escaped (``\\n``, ``\\x1b``), a field value with a space, a quote or an ``=`` is
quoted with its quotes and backslashes escaped, and the lines of a traceback are indented, so every line
that starts at column 0 starts a record this formatter wrote.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

#: C0 controls, DEL, C1 controls (NEL among them) and the Unicode line and paragraph separators.
_ESCAPES: dict[int, str] = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})
_QUOTED: dict[int, str] = {**_ESCAPES, ord('"'): '\\"', ord("\\"): "\\\\"}
_NEEDS_QUOTES = frozenset(' "=')


def escape(text: str) -> str:
    """``text`` with its control characters escaped: it cannot start a line of the log."""
    return text.translate(_ESCAPES)


class KeyValueFormatter(logging.Formatter):
    """``2026-11-22T03:04:05.678Z INFO tridentmq.core message key=value …`` (extra= fields become pairs)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d}Z {record.levelname} {record.name} {escape(record.getMessage())}"
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if extras:
            line += " " + " ".join(f"{escape(k)}={_quote(v)}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + "\n".join("  " + escape(t) for t in self.formatException(record.exc_info).splitlines())
        return line


def _quote(value: Any) -> str:
    text = str(value)
    if not text or not _NEEDS_QUOTES.isdisjoint(text):
        return f'"{text.translate(_QUOTED)}"'
    return escape(text)


class BadHttpRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a malformed header, a broken WebSocket handshake) as an ERROR
    with a traceback; the fault is the client's, and its peer already got a 400: one WARNING line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__module__ == "aiohttp.http_exceptions":
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.reason = getattr(exc, "message", None) or str(exc)
            record.msg, record.args = "bad HTTP request refused", ()
            record.exc_info = record.exc_text = None
        return True


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger for a TridentMQ process (stderr, key=value lines)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadHttpRequests) for f in server.filters):
        server.addFilter(BadHttpRequests())
