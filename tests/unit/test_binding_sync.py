"""BindingSync: a reply held for a binding change goes out once every node acknowledged it, or its
connection closed, or its deadline passed; never twice, never before."""

from __future__ import annotations

from tridentmq_core.cluster.sync import BindingSync


def test_a_reply_waits_for_every_node_and_an_acknowledgement_covers_earlier_numbers() -> None:
    sync = BindingSync(timeout_ms=2000)
    sent: list[str] = []
    first = sync.hold(lambda: sent.append("first"), {"a", "b"}, now_ms=0)
    second = sync.hold(lambda: sent.append("second"), {"a", "b"}, now_ms=0)
    assert sync.unsent == second > first
    sync.acknowledged("a", second)
    assert sent == []
    sync.acknowledged("b", first)
    assert sent == ["first"]
    sync.acknowledged("b", second)
    sync.acknowledged("b", second)
    assert sent == ["first", "second"]
    assert len(sync) == 0


def test_closed_connections_are_not_waited_for_and_the_deadline_releases_the_rest() -> None:
    sync = BindingSync(timeout_ms=2000)
    sent: list[str] = []
    sync.hold(lambda: sent.append("x"), {"a", "b"}, now_ms=0)
    sync.hold(lambda: sent.append("y"), {"a"}, now_ms=1000)
    assert sync.sweep({"a", "b"}, now_ms=1999) == []
    assert sync.sweep({"a"}, now_ms=1999) == []  # b went: x waits for a only
    assert sent == []
    assert sync.sweep({"a"}, now_ms=2000) == [{"a"}]  # x is late; y still has time
    assert sent == ["x"]
    sync.acknowledged("a", "not a number")
    assert sent == ["x"]
    assert sync.sweep(set(), now_ms=2000) == []  # a went too: y goes, not late
    assert sent == ["x", "y"]
