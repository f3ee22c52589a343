"""The ``tridentmq_audit`` Spark data source: batch and streaming reads of a folder of audit logs.

``spark.read.format("tridentmq_audit").load(audit_dir)`` or ``spark.readStream...``. The offset of a
stream is ``{node_id: next seq}``; each micro-batch reads, per node, the sealed segments between two offsets
(one partition per node). A node folder that appears later starts at seq 0. Only sealed files are read, so
a batch never sees a file that is still growing; with Spark's checkpoint that makes the stream exactly-once.
Rows come as Arrow batches in the schema of :mod:`tridentmq_spark.schema`, bad lines included.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from tridentmq_spark import schema, segments

__all__ = ["FORMAT", "AuditDataSource"]

FORMAT = "tridentmq_audit"
_PARTITION_BYTES = 32 << 20


@dataclass
class NodeRange(InputPartition):
    """Seqs [start, end) of one node."""

    node_id: str
    start: int
    end: int


def _path(options: Mapping[str, str]) -> Path:
    path = options.get("path")
    if not path:
        raise ValueError("the tridentmq_audit source needs the audit directory: .load(<audit dir>)")
    return Path(path)


def _ends(audit_dir: Path) -> dict[str, int]:
    ends = {}
    for node in segments.list_nodes(audit_dir):
        end = segments.node_end(segments.list_segments(audit_dir / node))
        if end:
            ends[node] = end
    return ends


def _read(audit_dir: Path, part: InputPartition) -> Iterator[pa.RecordBatch]:
    if not isinstance(part, NodeRange):
        # Spark reads one partition of its own when a reader has none (nothing sealed yet): no rows.
        return
    yield from segments.read_range(audit_dir / part.node_id, part.node_id, part.start, part.end)


class AuditDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return schema.DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return _BatchReader(_path(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _StreamReader(_path(self.options))


class _BatchReader(DataSourceReader):
    def __init__(self, audit_dir: Path) -> None:
        self._dir = audit_dir

    def partitions(self) -> list[NodeRange]:
        """Each node's log in pieces of about 32 MiB of segments, so the tasks spread over every core (one
        partition per node kept a core idle while the largest node was read). Ranges are cut at segment
        starts, so a seq gap before a cut is reported by the range before it, and a line repeating a seq of
        an earlier range is a duplicate_seq of the range it is in."""
        parts = []
        for node in segments.list_nodes(self._dir):
            found = segments.list_segments(self._dir / node)
            end = segments.node_end(found)
            parts += [NodeRange(node, a, b) for a, b in segments.split(found, end, _PARTITION_BYTES)]
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(self._dir, partition)


class _StreamReader(DataSourceStreamReader):
    def __init__(self, audit_dir: Path) -> None:
        self._dir = audit_dir

    def initialOffset(self) -> dict[str, int]:
        return {}

    # Spark 4.3 passes (start, limit); earlier 4.x call it without arguments.
    def latestOffset(self, start: Any = None, limit: Any = None) -> dict[str, int]:
        latest = dict(start or {})
        for node, end in _ends(self._dir).items():
            latest[node] = max(end, latest.get(node, 0))
        return latest

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[NodeRange]:
        return [
            NodeRange(node, start.get(node, 0), stop) for node, stop in sorted(end.items()) if stop > start.get(node, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(self._dir, partition)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release: segments are deleted by the writer's retention, not by the reader."""
