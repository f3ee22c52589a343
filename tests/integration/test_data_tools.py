"""`tridentmq data verify|print` on journals written by the real journal, clean and damaged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, start_core

from tridentmq_core.store.journal import Journal, JournalCorruptedError, list_segments
from tridentmq_core.store.records import HEADER_SIZE, Record, RecordType, encode, scan
from tridentmq_core.store.recovery import RecoveredState, replay
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message
from tridentmq_shared.supervision import EXIT_CANNOT_START

pytestmark = pytest.mark.integration


def data(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", "data", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def write_journal(directory: Path, messages: int, *, one_batch: bool = False) -> list[int]:
    """Write a journal and return the offsets of its message records (``one_batch``: the messages written and
    synced at once, so no SYNCED record lies between them)."""
    journal = Journal(directory, segment_bytes=1 << 20)
    journal.recover()
    journal.start()
    journal.append(RecordType.ADD_QUEUE, [{"name": "q", "address": "q", "routing_type": 0}])
    encoded = []
    for n in range(messages):
        message = new_message("q", f"body {n}".encode(), durable=True)
        message[0] = n + 1
        encoded.append(encode(RecordType.MESSAGE, [message, ["q"]]))
    if one_batch:
        journal.append_encoded(encoded)
    else:
        for record in encoded:
            journal.append_encoded([record])
    journal.close()
    records, _ = Journal(directory).recover(list)
    return [r.offset for r in records if r.type is RecordType.MESSAGE]


def test_verify_and_print_a_clean_journal(tmp_path: Path) -> None:
    write_journal(tmp_path / "journal", 5)
    verified = data("verify", "--journal", str(tmp_path / "journal"))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "6 valid records: ok" in verified.stdout
    printed = data("print", "--data-dir", str(tmp_path))
    assert printed.returncode == 0
    lines = printed.stdout.splitlines()
    assert len(lines) == 6
    assert "add-queue q" in lines[0]
    assert "message id=5 address=q queues=q body=6B durable=True" in lines[-1]


def test_verify_tells_a_torn_tail_from_damage_in_the_middle(tmp_path: Path) -> None:
    offsets = write_journal(tmp_path / "journal", 5)
    segment = list_segments(tmp_path / "journal")[0]
    pristine = segment.read_bytes()

    torn = bytearray(pristine)
    torn[offsets[-1] + HEADER_SIZE + 2 :] = bytes(len(torn) - offsets[-1] - HEADER_SIZE - 2)  # last write cut short
    segment.write_bytes(torn)
    result = data("verify", "--journal", str(tmp_path / "journal"))
    assert result.returncode == 0, result.stdout
    assert "torn tail" in result.stdout
    assert f"valid data ends at offset {offsets[-1]}" in result.stdout

    flipped = bytearray(pristine)
    flipped[offsets[1] + HEADER_SIZE + 3] ^= 0x10  # a bit flip with three valid records behind it
    segment.write_bytes(flipped)
    result = data("verify", "--journal", str(tmp_path / "journal"))
    assert result.returncode == 1
    assert "DAMAGED" in result.stdout
    assert f"offset {offsets[1]}" in result.stdout


def test_verify_calls_damaged_the_zeros_recovery_refuses(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    offsets = write_journal(journal, 5)
    segment = list_segments(journal)[0]
    lost = bytearray(segment.read_bytes())
    lost[offsets[1] : offsets[2]] = bytes(offsets[2] - offsets[1])  # one record lost to zeros, three valid after
    segment.write_bytes(lost)
    with pytest.raises(JournalCorruptedError, match="data verify"):
        Journal(journal).recover()
    result = data("verify", "--journal", str(journal))
    assert result.returncode == 1, result.stdout
    assert f"DAMAGED: zeros at offset {offsets[1]} with valid records behind them" in result.stdout


def test_a_core_cuts_a_torn_tail_and_reports_it_in_readyz(tmp_path: Path) -> None:
    offsets = write_journal(tmp_path / "core" / "journal", 5)
    segment = list_segments(tmp_path / "core" / "journal")[0]
    torn = bytearray(segment.read_bytes())
    torn[offsets[-1] + HEADER_SIZE + 2 :] = bytes(len(torn) - offsets[-1] - HEADER_SIZE - 2)
    segment.write_bytes(torn)
    node = start_core(tmp_path)
    try:
        with urllib.request.urlopen(node.management_url + "/readyz", timeout=5) as response:
            ready = json.loads(response.read())
        assert ready["recovered"] == {"q": 4}  # the fifth message's record was torn
        [line] = ready["truncated"]
        assert f"cut at offset {offsets[-1]}" in line
        assert "journal tail cut off after a crash" in node.log()
    finally:
        assert node.stop() == 0


def test_a_write_the_power_cut_tore_is_cut_off_by_the_core_and_verify_says_so(tmp_path: Path) -> None:
    """Five messages written in one batch whose sync never completed: the page with the second one never
    reached the disk, the pages behind it did. Nobody was told they were safe, so the core starts with the
    first and clears the rest; verify says so beforehand."""
    journal = tmp_path / "core" / "journal"
    offsets = write_journal(journal, 5, one_batch=True)
    segment = list_segments(journal)[0]
    image = bytearray(segment.read_bytes())
    [*_, last_sync] = [r.offset for r in scan(bytes(image)) if isinstance(r, Record) and r.type is RecordType.SYNCED]
    assert last_sync > offsets[-1]
    image[last_sync:] = bytes(len(image) - last_sync)  # the SYNCED record after the batch's sync: never written
    image[offsets[1] : offsets[2]] = bytes(offsets[2] - offsets[1])
    segment.write_bytes(image)
    result = data("verify", "--journal", str(journal))
    assert result.returncode == 0, result.stdout
    assert f"torn write never synced: zeros at offset {offsets[1]}" in result.stdout
    node = start_core(tmp_path)
    try:
        with urllib.request.urlopen(node.management_url + "/readyz", timeout=5) as response:
            ready = json.loads(response.read())
        assert ready["recovered"] == {"q": 1}
        [line] = ready["truncated"]
        assert f"cut at offset {offsets[1]}, with the never synced records behind it" in line
    finally:
        assert node.stop() == 0
    result = data("verify", "--journal", str(journal))
    assert result.returncode == 0, result.stdout
    assert "(clean)" in result.stdout


def test_verify_without_a_journal_says_so(tmp_path: Path) -> None:
    result = data("verify", "--journal", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert "no journal segments" in result.stderr


def churned_journal(directory: Path) -> None:
    """A queue, 100 messages of which 90 acknowledged, and delivery counts on some of the rest."""
    journal = Journal(directory, segment_bytes=1 << 16)
    journal.recover()
    journal.start()
    journal.append(RecordType.ADD_ADDRESS, ["q", [0], True])
    journal.append(RecordType.ADD_QUEUE, [{"name": "q", "address": "q", "routing_type": 0}])
    for n in range(1, 101):
        message = new_message("q", f"body {n}".encode(), durable=True)
        message[0] = n
        journal.append(RecordType.MESSAGE, [message, ["q"]])
    for n in range(1, 91):
        journal.append(RecordType.ACK, ["q", n])
    for n in (95, 96):
        journal.append(RecordType.DELIVERY_COUNT, ["q", n, 3])
    journal.close()


def recovered(directory: Path) -> RecoveredState:
    return Journal(directory, segment_bytes=1 << 16).recover(replay)[0]


def test_compact_keeps_the_live_state_and_drops_the_rest(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    churned_journal(journal)
    before = recovered(journal)
    result = data("compact", "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "194 records -> 12 records" in result.stdout
    after = recovered(journal)
    assert after.references == before.references == {"q": {n: 3 if n in (95, 96) else 0 for n in range(91, 101)}}
    assert after.messages == before.messages
    assert after.addresses == before.addresses == {"q": ([0], True)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal", "journal.lock"]


def test_an_interrupted_compaction_is_undone_or_finished_by_recovery(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    churned_journal(journal)
    expected = recovered(journal).references
    # Crash while writing the new journal: no completion marker, so the old journal stays.
    (tmp_path / "journal.compact").mkdir()
    (tmp_path / "journal.compact" / "journal-00000001.tmq").write_bytes(b"\xa7garbage")
    assert recovered(journal).references == expected
    assert not (tmp_path / "journal.compact").exists()
    # Crash between the two renames: the complete new journal is swapped in.
    assert data("compact", "--data-dir", str(tmp_path)).returncode == 0
    journal.rename(tmp_path / "journal.compact")
    (tmp_path / "journal.compact" / "COMPLETE").write_bytes(b"")
    (tmp_path / "journal.old").mkdir()
    assert recovered(journal).references == expected
    assert not (tmp_path / "journal.compact").exists()
    assert not (tmp_path / "journal.old").exists()
    assert not (journal / "COMPLETE").exists()


def test_compact_and_a_second_node_are_refused_while_a_node_runs(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    try:
        result = data("compact", "--data-dir", str(node.data_dir))
        assert result.returncode == 1
        assert "in use by another TridentMQ process" in result.stderr
        second = run_core(node.data_dir)
        assert second.returncode == EXIT_CANNOT_START  # so that ``up`` stops rather than restart it for ever
        assert "in use by another TridentMQ process" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        assert node.stop() == 0


async def publish(port: int, address: str, bodies: list[bytes]) -> None:
    async with LinkClient("127.0.0.1", port, reconnect=ReconnectPolicy(attempts=0)) as client:
        await asyncio.gather(*await client.publish_batch(new_message(address, body, durable=True) for body in bodies))


def run_core(data_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A core run to its end (one expected to be refused at start)."""
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_core"],
        env={
            **os.environ,
            "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir),
            "TRIDENTMQ_CORE_LINK_PORT": "0",
            "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def recovered_counts(node: CoreProcess) -> dict[str, int]:
    with urllib.request.urlopen(node.management_url + "/readyz", timeout=5) as response:
        counts: dict[str, int] = json.loads(response.read())["recovered"]
    return counts


async def test_a_node_and_compact_exclude_each_other_on_a_journal_apart_from_the_data_dir(tmp_path: Path) -> None:
    """With journal.directory outside the data directory, compact took the lock of the journal's parent,
    which no node holds: it swapped the journal from under a running node, and everything confirmed after
    went to the deleted directory (found by a review)."""
    journal = tmp_path / "volume" / "journal"
    node = start_core(tmp_path, TRIDENTMQ_CORE_JOURNAL_DIRECTORY=str(journal))
    try:
        await publish(node.link_port, "q", [b"a%d" % n for n in range(50)])
        compacted = data("compact", "--journal", str(journal))
        assert compacted.returncode == 1, compacted.stdout
        assert "in use by another TridentMQ process" in compacted.stderr
        # The read-only tools read a live journal, saying so.
        verified = data("verify", "--journal", str(journal))
        assert verified.returncode == 0, verified.stdout
        assert "in use by a running node" in verified.stderr
        # A second node, on its own data directory but the same journal, is refused too.
        second = run_core(tmp_path / "other", TRIDENTMQ_CORE_JOURNAL_DIRECTORY=str(journal))
        assert second.returncode == EXIT_CANNOT_START
        assert "in use by another TridentMQ process" in second.stderr
        await publish(node.link_port, "q", [b"b%d" % n for n in range(50)])
    finally:
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)
    node = start_core(tmp_path, TRIDENTMQ_CORE_JOURNAL_DIRECTORY=str(journal))
    try:
        assert recovered_counts(node) == {"q": 100}
    finally:
        assert node.stop() == 0
    compacted = data("compact", "--journal", str(journal))  # stopped: the lock is free
    assert compacted.returncode == 0, compacted.stderr
    assert "note:" not in data("verify", "--journal", str(journal)).stderr
