"""The book of publishes written through to another node: what it keeps, and when held sends may go."""

from __future__ import annotations

import pytest

from tridentmq_core import write_through
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.write_through import WriteThrough
from tridentmq_shared.message import M_BODY, WireMessage, new_message


class NotingStore(MemoryStore):
    """Notes complete only when the test says so: each call returns the next token."""

    def __init__(self) -> None:
        self.notes: list[list[tuple[str, str, int]]] = []

    def note_through(self, entries: list[tuple[str, str, int]]) -> int:
        self.notes.append(list(entries))
        return len(self.notes)


def message(body: bytes) -> WireMessage:
    return new_message("work", body, durable=True)


def bodies(unsent: list[tuple[str, WireMessage, int, str | None]]) -> list[bytes]:
    return [bytes(m[M_BODY]) for _, m, _, _ in unsent]


def test_the_latest_notes_are_kept_and_a_repeated_id_counts_as_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_through, "THROUGH_KEPT", 3)
    book: WriteThrough[str] = WriteThrough()
    for n, node in enumerate(["node-2", "node-3", "node-2"]):
        book.note(f"p-{n}", node, 1000 + n)
    book.note("p-0", "node-4", 2000)  # sent again, elsewhere: the latest note counts
    book.note("p-3", "node-2", 2001)
    assert book.target("p-1") is None  # the oldest went
    assert book.target("p-0") == "node-4"
    assert book.snapshot() == [("p-2", "node-2", 1002), ("p-0", "node-4", 2000), ("p-3", "node-2", 2001)]
    book.end_turn(MemoryStore())
    restored: WriteThrough[str] = WriteThrough()
    restored.restore({"a": ("node-2", 1), "b": ("node-3", 2), "c": ("node-2", 3), "d": ("node-3", 4)})
    assert [entry[0] for entry in restored.snapshot()] == ["b", "c", "d"]


def test_held_sends_go_once_their_note_is_safe_and_later_ones_wait_behind_them() -> None:
    book: WriteThrough[str] = WriteThrough()
    store = NotingStore()
    book.hold("node-2", message(b"a"), -1, "producer")
    book.note("p-1", "node-2", 1000)
    assert book.holds_for("node-2")
    assert not book.holds_for("node-3")
    assert book.end_turn(store) == []  # waits for note 1
    assert store.notes == [[("p-1", "node-2", 1000)]]

    book.hold("node-2", message(b"b"), 0, None)  # nothing to note this turn: behind "a" all the same
    assert book.end_turn(store) == []
    book.hold("node-2", message(b"c"), -2, "producer")
    book.note("p-2", "node-2", 1001)
    assert book.end_turn(store) == []  # waits for note 2

    assert bodies(book.noted(1)) == [b"a", b"b"]
    assert book.holds_for("node-2")
    assert book.noted(1) == []  # once
    assert bodies(book.noted(2)) == [b"c"]
    assert not book.holds_for("node-2")


def test_with_notes_that_are_safe_at_once_held_sends_go_at_the_end_of_their_turn() -> None:
    book: WriteThrough[str] = WriteThrough()
    book.hold("node-2", message(b"a"), -1, "producer")
    book.note("p-1", "node-2", 1000)
    book.hold("node-3", message(b"b"), 0, None)
    assert bodies(book.end_turn(MemoryStore())) == [b"a", b"b"]
    assert not book.holds_for("node-2")
    assert not book.holds_for("node-3")
    assert book.end_turn(MemoryStore()) == []


def test_a_publish_on_its_way_holds_its_duplicates_back_and_is_not_remembered_by_a_restart() -> None:
    book: WriteThrough[str] = WriteThrough()
    book.track("p-1", -1)  # on its way to the other node
    book.track("p-2", -2)
    assert book.token_of("p-1") == -1
    entries = [("p-1", 10), ("p-2", 11), ("p-3", 12)]
    assert book.to_remember(entries) == [("p-3", 12)]
    assert book.forget(-2) == "p-2"  # the other node confirmed it: safe
    assert book.forget(-1) == "p-1"  # the link dropped: stored here after all, and its confirm passes on
    book.track("p-1", 7)  # to store token 7
    assert book.token_of("p-1") == 7
    assert book.forget(-1) is None  # the old token stands for nothing now
    assert book.to_remember(entries) == entries  # stored here: a resend after a restart is a duplicate
    assert book.forget(7) == "p-1"
    assert book.token_of("p-1") is None
