"""``tridentmq data verify|print|compact``: a node's journal offline.

``verify`` walks every segment, checks every record's CRC and says where the valid data ends and why;
exit 0 when the journal is clean or ends in a torn last write (which recovery cuts off, with whatever of that
never synced write lies behind the tear), 1 when there is damage or zeros with valid records behind them that
were synced (recovery refuses to start: both decide by ``damage_in``), 2 when there is nothing to read.
``print`` lists every record in a readable form. Both only read: on a running node's journal they say so and
read it as it is being written. ``compact`` rewrites the journal with only its live state, holding the journal
lock (``JournalLock``) throughout: refused while a node (or another compaction) holds it, and a node cannot
start meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tridentmq_core.store.data_lock import JournalLock, JournalLockedError, journal_in_use
from tridentmq_core.store.journal import (
    JournalCorruptedError,
    compact_offline,
    damage_in,
    list_segments,
    segments_problem,
)
from tridentmq_core.store.records import Record, RecordType, ScanEnd, scan
from tridentmq_shared.message import M_ADDRESS, M_BODY, M_DURABLE, M_ID


def journal_dir(args: argparse.Namespace) -> Path:
    return Path(args.journal) if args.journal else Path(args.data_dir) / "journal"


def describe(record: Record) -> str:
    p: Any = record.payload
    match record.type:
        case RecordType.MESSAGE:
            message, queues = p[0], p[1]  # compaction adds the delivery counts
            return (
                f"message id={message[M_ID]} address={message[M_ADDRESS]} queues={','.join(queues)} "
                f"body={len(message[M_BODY])}B durable={message[M_DURABLE]}"
            )
        case RecordType.ACK:
            return f"ack queue={p[0]} id={p[1]}"
        case RecordType.ACKS:
            return f"ack queue={p[0]} ids={','.join(map(str, p[1]))}"
        case RecordType.DELIVERY_COUNT:
            return f"delivery-count queue={p[0]} id={p[1]} count={p[2]}"
        case RecordType.DELIVERY_COUNTS:
            return f"delivery-count queue={p[0]} ids={','.join(map(str, p[1]))} counts={','.join(map(str, p[2]))}"
        case RecordType.ADD_QUEUE:
            return f"add-queue {p[0].get('name')} address={p[0].get('address')} routing={p[0].get('routing_type')}"
        case RecordType.DELETE_QUEUE:
            return f"delete-queue {p[0]}"
        case RecordType.ADD_ADDRESS:
            return f"add-address {p[0]} routing={p[1]}"
        case RecordType.DELETE_ADDRESS:
            return f"delete-address {p[0]}"
        case RecordType.TX_MESSAGE:
            return f"tx={p[0]} " + describe(Record(record.offset, RecordType.MESSAGE, p[1:]))
        case RecordType.TX_ACK:
            return f"tx={p[0]} " + describe(Record(record.offset, RecordType.ACK, p[1:]))
        case RecordType.TX_COMMIT:
            return f"commit tx={p[0]}"
        case RecordType.DEDUP_IDS:
            return f"dedup-ids count={len(p)}"
        case RecordType.THROUGH_IDS:
            return f"through-ids count={len(p)}"
        case RecordType.COMPACTED:
            return "compacted: the live state above was copied forward; older segments are retired"
        case RecordType.SYNCED:
            return "synced: the records above were on disk"


def note_if_live(directory: Path) -> None:
    if journal_in_use(directory):
        print(
            f"note: {directory} is in use by a running node: this reads it while it is written, so the last "
            f"segment may end in a torn write and a segment may change or go meanwhile; stop the node for a "
            f"definitive answer",
            file=sys.stderr,
        )


def verify(directory: Path) -> int:
    segments = list_segments(directory)
    if not segments:
        print(f"no journal segments in {directory}", file=sys.stderr)
        return 2
    note_if_live(directory)
    status = 0
    problem = segments_problem(directory)
    if problem is not None:
        print(f"DAMAGED: {problem}; recovery will refuse to start")
        status = 1
    total = 0
    marked = False
    for index, path in enumerate(segments):
        data = path.read_bytes()
        count = 0
        end = ScanEnd(0, None)
        for item in scan(data):
            if isinstance(item, Record):
                if item.type is RecordType.SYNCED:  # the writer's own, not counted (as recovery does)
                    marked = True
                else:
                    count += 1
            else:
                end = item
        total += count
        line = f"{path.name}: {count} records, valid data ends at offset {end.offset}"
        later = segments[index + 1 :]
        damage = damage_in(data, end, later, marked=marked)
        if damage is None:
            if end.reason is None:
                print(f"{line} (clean)")
            else:
                print(f"{line}: torn tail: {end.reason}; recovery cuts it off here")
        elif damage.unsynced:
            print(
                f"{line}: torn write never synced: {damage.reason}; recovery cuts it off here with what lies "
                f"behind it" + (f", and removes the {len(later)} segment(s) after this one" if later else "")
            )
            break
        else:
            print(f"{line}: DAMAGED: {damage.reason}; recovery will refuse to start")
            status = 1
    print(f"{len(segments)} segment(s), {total} valid records: {'DAMAGED' if status else 'ok'}")
    return status


def print_records(directory: Path) -> int:
    segments = list_segments(directory)
    if not segments:
        print(f"no journal segments in {directory}", file=sys.stderr)
        return 2
    note_if_live(directory)
    for path in segments:
        for item in scan(path.read_bytes()):
            if isinstance(item, Record):
                if item.type is not RecordType.SYNCED:  # one after every sync: noise here
                    print(f"{path.name}@{item.offset}: {describe(item)}")
            elif item.reason is not None:
                print(f"{path.name}@{item.offset}: -- {item.reason}")
    return 0


def compact(directory: Path) -> int:
    if not list_segments(directory):
        print(f"no journal segments in {directory}", file=sys.stderr)
        return 2
    try:
        lock = JournalLock(directory)  # the one a node holds on its journal, wherever that lies; kept across the swap
    except JournalLockedError as exc:
        print(f"tridentmq data: {exc}", file=sys.stderr)
        return 1
    try:
        before, after = compact_offline(directory)
    except JournalCorruptedError as exc:
        print(f"tridentmq data: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the copy was not swapped in: the next start removes what was written of it
        print(f"tridentmq data: compaction failed, the journal is unchanged: {exc}", file=sys.stderr)
        return 1
    finally:
        lock.release()
    print(f"compacted {directory}: {before} records -> {after} records")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tridentmq data", description="Inspect a core node's journal offline.")
    parser.add_argument("command", choices=["verify", "print", "compact"])
    parser.add_argument("--data-dir", default="data/core", help="the node's data directory (default %(default)s)")
    parser.add_argument("--journal", help="the journal directory itself (default <data-dir>/journal)")
    args = parser.parse_args(argv)
    directory = journal_dir(args)
    try:
        if args.command == "compact":
            code = compact(directory)
        else:
            code = verify(directory) if args.command == "verify" else print_records(directory)
        sys.stdout.flush()
    except BrokenPipeError:  # `tridentmq data print | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
