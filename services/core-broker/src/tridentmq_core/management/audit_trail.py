"""``GET /api/audit/messages/{message_id}``: the audit events of one message found in this node's audit files.

A message's history is the events whose ``message_id`` or ``origin_message_id`` is its id (see
docs/audit.md). The files are searched newest first, in a worker thread, one search at a time, and at most
``MAX_SCAN_BYTES`` of them per request, so a question about an old message on a busy node costs a bounded
amount of disk and memory and never holds up the broker's event loop; ``complete`` says whether every file was
searched. Every node folder of the audit directory is read (several nodes may share one directory); the
segment being written is read up to its last whole line.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

MAX_SCAN_BYTES = 256 * 1024 * 1024
MAX_EVENTS = 1000
MESSAGE_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._:-]{0,79}")
ACTIVE_DIR = ".active"


def _files(audit_dir: Path) -> list[Path]:
    """The segment files of every node folder, newest first."""
    found: list[Path] = []
    if not audit_dir.is_dir():
        return found
    for node in audit_dir.iterdir():
        if node.name.startswith(".") or not node.is_dir():
            continue
        for folder in (node, node / ACTIVE_DIR):
            if folder.is_dir():
                found += [p for p in folder.iterdir() if p.name.endswith(".jsonl") and p.is_file()]

    def modified(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # sealed (renamed) or removed meanwhile
            return 0.0

    return sorted(found, key=lambda p: (modified(p), p.name), reverse=True)


def find_events(
    audit_dir: Path, message_id: str, *, max_bytes: int = MAX_SCAN_BYTES, max_events: int = MAX_EVENTS
) -> tuple[list[dict[str, Any]], bool]:
    """The events of ``message_id`` (sorted by time, then node and seq) and whether every file was searched."""
    needle = orjson.dumps(message_id)  # with its quotes: "ab-12" must not match "ab-123"
    events: list[dict[str, Any]] = []
    budget = max_bytes
    complete = True
    for path in _files(audit_dir):
        if budget <= 0 or len(events) >= max_events:
            complete = False
            break
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                start = max(size - budget, 0)
                f.seek(start)
                data = f.read(size - start)
        except OSError:  # sealed (renamed) between listing and reading: its new name is read if listed
            continue
        budget -= len(data)
        if start > 0:
            complete = False
        _scan(data, needle, message_id, events, max_events, first_line_whole=start == 0)
    events.sort(key=lambda e: (e.get("ts_us", 0), str(e.get("node_id", "")), e.get("seq", 0)))
    return events, complete


def _scan(
    data: bytes,
    needle: bytes,
    message_id: str,
    events: list[dict[str, Any]],
    max_events: int,
    *,
    first_line_whole: bool,
) -> None:
    at = data.find(needle)
    while at >= 0 and len(events) < max_events:
        line_start = data.rfind(b"\n", 0, at) + 1
        line_end = data.find(b"\n", at)
        if line_end < 0:  # a line still being written
            return
        if line_start > 0 or first_line_whole:  # a line cut by the byte budget is not whole: skip it
            try:
                event = orjson.loads(data[line_start:line_end])
            except orjson.JSONDecodeError:
                event = None
            if isinstance(event, dict) and message_id in (event.get("message_id"), event.get("origin_message_id")):
                events.append(event)
        at = data.find(needle, line_end)


class AuditTrail:
    """The route's handler: ``audit_dir`` is None when the node writes no audit stream."""

    def __init__(self, audit_dir: Path | None) -> None:
        self.audit_dir = audit_dir
        self._one_at_a_time = asyncio.Lock()

    async def message(self, request: web.Request) -> web.Response:
        message_id = request.match_info["message_id"]
        if not MESSAGE_ID.fullmatch(message_id):
            return web.json_response({"error": "a message id is 1 to 80 letters, digits and ._:-"}, status=400)
        if self.audit_dir is None:
            return web.json_response({"error": "this node writes no audit stream (audit.enabled = false)"}, status=404)
        audit_dir = self.audit_dir
        async with self._one_at_a_time:
            events, complete = await asyncio.to_thread(find_events, audit_dir, message_id)
        return web.json_response({"message_id": message_id, "events": events, "complete": complete})


def add_audit_trail(app: web.Application, audit_dir: Path | None) -> None:
    app.router.add_get("/api/audit/messages/{message_id}", AuditTrail(audit_dir).message)
