"""Reading sealed audit segments from disk into Arrow batches (plain Python: it runs in Spark's workers).

Layout (docs/audit.md): ``<audit dir>/<node_id>/<first_seq:020d>.jsonl``; hidden folders (``.active``) are
never read. A sealed file never changes, so a node's readable log ends at the last seq of its newest sealed
segment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from tridentmq_spark import schema

__all__ = ["Segment", "list_nodes", "list_segments", "node_end", "read_range", "split", "time_span"]

_SUFFIX = ".jsonl"
_TAIL_CHUNK = 64 * 1024
_BATCH_ROWS = 65_536
_INT_COLUMNS = frozenset(name for name, kind in schema.COLUMNS if kind == pa.int64())
_EVENT_COLUMNS = tuple(name for name, _ in schema.COLUMNS if name not in {"bad_reason", "raw"})
_TARGET_QUEUES = "target_queues"
_GATEWAY_PROTOCOLS = frozenset({"stomp", "mqtt", "amqp"})


@dataclass(frozen=True)
class Segment:
    path: Path
    first_seq: int


def list_nodes(audit_dir: Path) -> list[str]:
    """Node folders present now (a node that appears later is picked up by the next call)."""
    try:
        entries = os.scandir(audit_dir)
    except FileNotFoundError:
        return []
    with entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def list_segments(node_dir: Path) -> list[Segment]:
    """Sealed segments of one node, by first seq."""
    found = []
    try:
        entries = os.scandir(node_dir)
    except FileNotFoundError:
        return []
    with entries:
        for e in entries:
            stem = e.name[: -len(_SUFFIX)]
            if e.name.endswith(_SUFFIX) and stem.isdigit() and e.is_file():
                found.append(Segment(Path(e.path), int(stem)))
    found.sort(key=lambda s: s.first_seq)
    return found


def node_end(segments: list[Segment]) -> int:
    """One past the last seq of the newest sealed segment (0 when there is none)."""
    if not segments:
        return 0
    last = segments[-1]
    seq = _last_seq(last.path)
    return max(seq + 1, last.first_seq + 1) if seq is not None else last.first_seq + 1


def split(segments: list[Segment], end: int, target_bytes: int) -> list[tuple[int, int]]:
    """Seq ranges [start, end) of consecutive segments of about ``target_bytes`` each, cut at segment starts:
    a batch read spreads one node's log over several tasks."""
    ranges: list[tuple[int, int]] = []
    start, size = None, 0
    for segment in segments:
        if start is None:
            start = segment.first_seq
        elif size >= target_bytes:
            ranges.append((start, segment.first_seq))
            start, size = segment.first_seq, 0
        size += segment.path.stat().st_size
    if start is not None and start < end:
        ranges.append((start, end))
    return ranges


def time_span(audit_dir: Path) -> tuple[int | None, int | None]:
    """Event time (ts_us) of the first line of the oldest and the last line of the newest sealed segment over
    all nodes: the span a report covers, read from a few file ends without a pass over the data."""
    firsts, lasts = [], []
    for node in list_nodes(audit_dir):
        found = list_segments(audit_dir / node)
        if found:
            with found[0].path.open("rb") as f:
                first = _field_of(f.readline(), "ts_us")
            last = _last_field(found[-1].path, "ts_us")
            firsts += [first] if first is not None else []
            lasts += [last] if last is not None else []
    return (min(firsts) if firsts else None), (max(lasts) if lasts else None)


def _last_seq(path: Path) -> int | None:
    return _last_field(path, "seq")


def _last_field(path: Path, name: str) -> int | None:
    """The seq on the last line that carries one, read from the file's tail."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - _TAIL_CHUNK)
        f.seek(start)
        tail = f.read()
    lines = tail.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first piece may be a partial line
    for line in reversed(lines):
        value = _field_of(line, name)
        if value is not None:
            return value
    if start > 0:  # no readable line in the tail: scan the whole file
        values = [v for v in (_field_of(line, name) for line in path.read_bytes().split(b"\n")) if v is not None]
        return max(values) if values else None
    return None


def _field_of(line: bytes, name: str) -> int | None:
    """A non-negative integer field of one line, or None (torn, not JSON, missing)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    value = record.get(name) if isinstance(record, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_range(node_dir: Path, node_id: str, start: int, end: int) -> Iterator[pa.RecordBatch]:
    """Every record of ``node_id`` with ``start <= seq < end`` as Arrow batches, bad lines included.

    Offsets always fall on segment boundaries (a stream's end is a sealed segment's end), so the segments
    read are those whose first seq lies in [start, end); a bad line in them is reported exactly once.
    Missing seqs inside the range become one ``seq_gap`` row each run.
    """
    builder = _BatchBuilder()
    expected = start
    for segment in list_segments(node_dir):
        if not start <= segment.first_seq < end:
            continue
        fast = _read_clean_segment(segment.path, node_id)
        if fast is not None and fast.num_rows:
            first, last = fast["seq"][0].as_py(), fast["seq"][-1].as_py()
            if start <= first and last < end and first >= expected:
                if first > expected:
                    builder.add(_gap(node_id, expected, first))
                expected = last + 1
                yield from fast.to_batches(max_chunksize=_BATCH_ROWS)
                continue
        with segment.path.open("rb") as f:
            for line in f:
                row = _parse(line, node_id)
                seq = row.get("seq")
                if row.get("bad_reason") is None or isinstance(seq, int):
                    assert isinstance(seq, int)
                    if seq >= end:
                        continue  # a later range owns it (cannot happen with sealed files; kept defensive)
                    if seq > expected:
                        builder.add(_gap(node_id, expected, seq))
                    elif seq < expected:
                        row = {**row, "bad_reason": schema.BAD_DUPLICATE_SEQ, "raw": _raw(line)}
                    expected = max(expected, seq + 1)
                builder.add(row)
                if builder.rows >= _BATCH_ROWS:
                    yield builder.take()
    if expected < end:
        builder.add(_gap(node_id, expected, end))
    if builder.rows:
        yield builder.take()


_JSON_SCHEMA = pa.schema(
    [
        pa.field(name, pa.list_(pa.string()) if name == _TARGET_QUEUES else kind)
        for name, kind in schema.COLUMNS
        if name not in {"node_id", "consumer_protocol", "bad_reason", "raw"}
    ]
)


@cache
def _value_sets() -> tuple[pa.Array, pa.Array]:
    """The known events and the gateway protocols as Arrow arrays, made on first use: ``pa.array`` imports
    pandas (over a second), and this module is imported by every Python worker Spark starts, whose
    connection back to the JVM must come within 10 s."""
    return pa.array(sorted(schema.KNOWN_EVENTS), pa.string()), pa.array(sorted(_GATEWAY_PROTOCOLS), pa.string())


def _read_clean_segment(path: Path, node_id: str) -> pa.Table | None:
    """The fast road (Arrow's C++ JSON reader) for a segment with nothing wrong in it, else None.

    Any doubt (a line Arrow cannot parse, a field of the wrong type, a missing header, a newer version, an
    unknown event, seqs not consecutive) sends the segment down the line-by-line road, which names the fault.
    """
    try:
        table = pj.read_json(
            path,
            read_options=pj.ReadOptions(block_size=16 << 20),
            parse_options=pj.ParseOptions(explicit_schema=_JSON_SCHEMA, unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
        return None
    n = table.num_rows
    if n == 0:
        return None
    known_events, gateways = _value_sets()
    for header in ("v", "seq", "ts_us", "event"):
        if table[header].null_count:
            return None
    versions = pc.min_max(table["v"]).as_py()
    if (
        not 1 <= versions["min"] <= versions["max"] <= schema.SCHEMA_VERSION
        or not pc.all(pc.is_in(table["event"], known_events)).as_py()
    ):
        return None
    seqs = table["seq"].to_numpy()
    if seqs[0] < 0 or (n > 1 and not np.all(np.diff(seqs) == 1)):
        return None
    columns = {name: table[name] for name in table.column_names}
    columns["node_id"] = pa.array([node_id] * n, pa.string())
    columns[_TARGET_QUEUES] = pc.binary_join(table[_TARGET_QUEUES], ",")
    kind = pc.list_element(pc.split_pattern(table["client_id"], " ", max_splits=1), 0)
    acked = pc.and_(pc.equal(table["event"], "msg.acked"), pc.is_valid(table["client_id"]))
    protocol = pc.if_else(pc.is_in(kind, gateways), kind, pa.scalar("link"))
    columns["consumer_protocol"] = pc.if_else(acked, protocol, pa.scalar(None, pa.string()))
    columns["bad_reason"] = columns["raw"] = pa.nulls(n, pa.string())
    return pa.Table.from_arrays([columns[name] for name, _ in schema.COLUMNS], schema=schema.arrow_schema())


def _gap(node_id: str, first_missing: int, next_present: int) -> dict[str, object]:
    count = next_present - first_missing
    return {"node_id": node_id, "seq": first_missing, "bad_reason": schema.BAD_SEQ_GAP, "raw": f"{count} missing"}


def _raw(line: bytes) -> str:
    return line.rstrip(b"\n").decode("utf-8", "replace")[:4096]


def _parse(line: bytes, node_id: str) -> dict[str, object]:
    """One line as a row: the event's fields, or a bad row with the reason and the raw line."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {"node_id": node_id, "bad_reason": schema.BAD_NOT_JSON, "raw": _raw(line)}
    if not isinstance(record, dict):
        return {"node_id": node_id, "bad_reason": schema.BAD_NOT_JSON, "raw": _raw(line)}
    seq, v, ts, event = record.get("seq"), record.get("v"), record.get("ts_us"), record.get("event")
    if not (_is_int(seq) and _is_int(v) and v >= 1 and _is_int(ts) and isinstance(event, str)):  # type: ignore[operator]
        return {
            "node_id": node_id,
            "seq": seq if _is_int(seq) else None,
            "bad_reason": schema.BAD_MISSING_HEADER,
            "raw": _raw(line),
        }
    record["node_id"] = node_id  # the folder names the node; a line claiming another one is not trusted
    if v > schema.SCHEMA_VERSION:  # type: ignore[operator]
        return {
            "node_id": node_id,
            "seq": seq,
            "ts_us": ts,
            "event": event,
            "v": v,
            "bad_reason": schema.BAD_NEWER_VERSION,
            "raw": _raw(line),
        }
    if event not in schema.KNOWN_EVENTS:
        return {
            "node_id": node_id,
            "seq": seq,
            "ts_us": ts,
            "event": event,
            "v": v,
            "bad_reason": schema.BAD_UNKNOWN_EVENT,
            "raw": _raw(line),
        }
    client = record.get("client_id")
    if event == "msg.acked" and isinstance(client, str):
        # A gateway's link is named "<protocol> <peer>"; any other client is a link client.
        kind = client.split(" ", 1)[0]
        record["consumer_protocol"] = kind if kind in _GATEWAY_PROTOCOLS else "link"
    queues = record.get(_TARGET_QUEUES)
    if isinstance(queues, list):
        record[_TARGET_QUEUES] = ",".join(map(str, queues))
    for name in _INT_COLUMNS:
        value = record.get(name)
        if value is not None and not _is_int(value):
            return {
                "node_id": node_id,
                "seq": seq,
                "ts_us": ts,
                "event": event,
                "v": v,
                "bad_reason": schema.BAD_FIELD_TYPE,
                "raw": _raw(line),
            }
    return record


def _is_int(value: object) -> bool:
    """An integer of a 64-bit column (JSON has no bound: a bigger one made the whole batch fail)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 63)


class _BatchBuilder:
    """Collects rows column by column and turns them into one Arrow batch."""

    def __init__(self) -> None:
        self._rows: list[dict[str, object]] = []

    @property
    def rows(self) -> int:
        return len(self._rows)

    def add(self, row: dict[str, object]) -> None:
        self._rows.append(row)

    def take(self) -> pa.RecordBatch:
        rows, self._rows = self._rows, []
        arrays = []
        for name, kind in schema.COLUMNS:
            values = [r.get(name) for r in rows]
            if kind == pa.string():
                values = [x if x is None or isinstance(x, str) else _text(x) for x in values]
            arrays.append(pa.array(values, type=kind))
        return pa.RecordBatch.from_arrays(arrays, schema=schema.arrow_schema())


def _text(value: object) -> str:
    return orjson.dumps(value).decode()
