"""`tridentmq data verify|print` on journals written by the real journal, clean and damaged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tridentmq_core.store.journal import Journal, list_segments
from tridentmq_core.store.records import HEADER_SIZE, RecordType
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration


def data(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", "data", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def write_journal(directory: Path, messages: int) -> list[int]:
    """Write a journal and return the offsets of its message records."""
    journal = Journal(directory, segment_bytes=1 << 20)
    journal.recover()
    journal.start()
    journal.append(RecordType.ADD_QUEUE, [{"name": "q", "address": "q", "routing_type": 0}])
    for n in range(messages):
        message = new_message("q", f"body {n}".encode(), durable=True)
        message[0] = n + 1
        journal.append(RecordType.MESSAGE, [message, ["q"]])
    journal.close()
    records, _ = Journal(directory).recover()
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


def test_verify_without_a_journal_says_so(tmp_path: Path) -> None:
    result = data("verify", "--journal", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert "no journal segments" in result.stderr
