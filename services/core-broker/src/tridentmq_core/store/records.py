"""Journal records: encoding and the scan that recovery relies on. Pure: bytes in, records out.

A record is a 10-byte header followed by a msgpack payload::

    magic (1 byte, 0xA7) · type (1) · payload length (4, big-endian) · CRC32C of type + payload (4)

Segments are pre-allocated with zeros, so a zero byte where a header should start is the clean end of the
written part. Anything else that does not check out (bad magic, a length past the end, a CRC mismatch)
is damage: ``scan`` stops there and says where and why, and ``records_behind`` finds what valid data lies
behind it: none means a torn last write (safe to truncate).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final, TypeVar

import msgpack
from crc32c import crc32c

MAGIC: Final = 0xA7
HEADER: Final = struct.Struct(">BBII")
HEADER_SIZE: Final = HEADER.size
_MAGIC_BYTE: Final = bytes((MAGIC,))


class RecordType(IntEnum):
    ADD_ADDRESS = 1  # [name, routing_types, auto_created]
    DELETE_ADDRESS = 2  # [name]
    ADD_QUEUE = 3  # [spec]
    DELETE_QUEUE = 4  # [name]
    MESSAGE = 5  # [wire message, [queue names]] or, written by compaction, [..., [delivery counts]]
    ACK = 6  # [queue, message_id]: read from older journals; ACKS replaced it
    DELIVERY_COUNT = 7  # [queue, message_id, count]: read from older journals; DELIVERY_COUNTS replaced it
    COMPACTED = 8  # []: the live state was copied forward before this point (replay ignores it)
    # A committed transaction is written at once: its messages and acks, then its commit. Replay applies
    # them at the commit and drops those of a transaction whose commit never reached the disk.
    TX_MESSAGE = 9  # [tx_id, wire message, [queue names]]
    TX_ACK = 10  # [tx_id, queue, message_id]
    TX_COMMIT = 11  # [tx_id]
    # Duplicate-detection ids outlive their messages: compaction copies the remembered ones forward.
    DEDUP_IDS = 12  # [[dedup id, arrival ms], ...]
    # One record for a consumer's batch: a record costs the core about 1 µs to encode and queue.
    ACKS = 13  # [queue, [message ids]]
    DELIVERY_COUNTS = 14  # [queue, [message ids], [counts]]
    # Durable publishes written through to another node (stored nowhere here): so that a resend to this node's
    # next life goes to that node again, under the same transfer id, and is a duplicate there if it got it.
    THROUGH_IDS = 15  # [[producer's dedup id, node id, arrival ms], ...]
    # Written by the writer after each fdatasync, and when it starts: everything before it was on disk. A
    # power cut can tear only what was written after the last one that reached the disk (replay ignores it).
    SYNCED = 16  # []


_TYPES: Final = frozenset(int(t) for t in RecordType)
#: The CRC32C of each type byte, indexed by type: the seed of its records' checksums (a list, as an IntEnum's
#: hash is Python code).
_CRC_SEEDS: Final = [crc32c(bytes((t,))) for t in range(max(_TYPES) + 1)]
#: An id record's entry: (dedup id, arrival ms) or (dedup id, node id, arrival ms).
IdEntry = TypeVar("IdEntry", tuple[str, int], tuple[str, str, int])
#: Bytes of ids per DEDUP_IDS record that compaction writes (at most a quarter of a segment).
DEDUP_IDS_RECORD_BYTES: Final = 64 * 1024


def encode(record_type: RecordType, payload: Any, pack: Callable[[Any], bytes] = msgpack.packb) -> bytes:
    """One record; ``pack``: a writer's own ``msgpack.Packer().pack``, a third cheaper than ``packb``, which
    makes a packer per call."""
    body: bytes = pack(payload)
    return HEADER.pack(MAGIC, record_type, len(body), crc32c(body, _CRC_SEEDS[record_type])) + body


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, three times the cost
# of a plain one (350 against 115 ns), paid once per record that recovery reads.
@dataclass(slots=True)
class Record:
    offset: int
    type: RecordType
    payload: Any
    segment: int = 0  # the number of the journal segment it was read from (0: not from one)


@dataclass(frozen=True, slots=True)
class ScanEnd:
    """Where the valid records of a buffer end; ``reason`` is None for a clean end (zeros or end of data)."""

    offset: int
    reason: str | None


def scan(data: bytes | memoryview, start: int = 0, segment: int = 0) -> Iterator[Record | ScanEnd]:
    """Yield every valid record from ``start`` (marked as read from journal segment ``segment``), then exactly
    one ``ScanEnd``."""
    view = memoryview(data)
    end = len(view)
    pos = start
    while True:
        if end - pos < HEADER_SIZE:
            tail = bytes(view[pos:end])
            yield ScanEnd(pos, None if not tail.strip(b"\0") else "torn record header")
            return
        magic, record_type, length, crc = HEADER.unpack_from(view, pos)
        if magic == 0 and record_type == 0 and length == 0 and crc == 0:
            yield ScanEnd(pos, None)
            return
        if magic != MAGIC or record_type not in _TYPES:
            yield ScanEnd(pos, f"bad record header at offset {pos}")
            return
        body_start = pos + HEADER_SIZE
        if length > end - body_start:
            yield ScanEnd(pos, f"record at offset {pos} runs past the end of the data (torn write)")
            return
        body = view[body_start : body_start + length]
        if crc32c(body, _CRC_SEEDS[record_type]) != crc:
            yield ScanEnd(pos, f"CRC mismatch in the record at offset {pos}")
            return
        try:
            payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:  # a CRC-valid but undecodable body
            yield ScanEnd(pos, f"undecodable record at offset {pos}: {exc}")
            return
        yield Record(pos, RecordType(record_type), payload, segment)
        pos = body_start + length


def flaw(data: bytes) -> str | None:
    """What is wrong with ``data`` as one whole encoded record (a record another node streams: it is written
    as it comes, so a bad one would stop this node's own recovery), None when nothing is."""
    if len(data) < HEADER_SIZE:
        return "shorter than a record header"
    magic, record_type, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC or record_type not in _TYPES:
        return "bad record header"
    if HEADER_SIZE + length != len(data):
        return "its length is not the header's"
    if crc32c(memoryview(data)[HEADER_SIZE:], _CRC_SEEDS[record_type]) != crc:
        return "CRC mismatch"
    return None


def records_behind(data: bytes | memoryview, offset: int, segment: int = 0) -> Iterator[Record]:
    """The valid records that lie behind damage at ``offset`` (from ``offset + 1``; -1 reads a whole segment
    that may itself be damaged).

    The damaged record's claimed length is not trusted (it may be the damaged part), so this looks for every
    record header with a valid CRC after ``offset``, and reads on from each as far as the records check out.
    """
    raw = bytes(data)  # damage is rare: one copy of the segment is fine
    pos = offset + 1
    while True:
        pos = raw.find(_MAGIC_BYTE, pos)
        if pos < 0:
            return
        end = pos
        for item in scan(raw, pos, segment):
            if isinstance(item, Record):
                yield item
            else:
                end = item.offset
        pos = max(end, pos + 1)


def damage_is_tail(data: bytes | memoryview, offset: int) -> bool:
    """True when nothing but the damaged record itself and zeros follow ``offset``: a torn last write."""
    return next(records_behind(data, offset), None) is None


def dedup_id_chunks(ids: Iterable[IdEntry], segment_bytes: int) -> Iterator[list[IdEntry]]:
    """Duplicate-detection ids, with what goes with each (DEDUP_IDS, THROUGH_IDS), in chunks that each fit one
    record of a segment."""
    budget = min(DEDUP_IDS_RECORD_BYTES, segment_bytes // 4)
    chunk: list[IdEntry] = []
    size = 0
    for entry in ids:
        chunk.append(entry)
        size += sum(len(part) for part in entry if isinstance(part, str)) + 16
        if size >= budget:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
