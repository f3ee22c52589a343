"""The shared-store HA lease: expiry on the waiter's own clock, takeover with a new epoch, fencing."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from tridentmq_core.ha.lease import (
    LEASE_FILE,
    Lease,
    LeaseEvent,
    LeaseFile,
    LeaseUnreadableError,
    LeaseWatch,
    SharedStoreLease,
    Verdict,
)

RENEW, EXPIRY, SETTLE = 1000, 10_000, 1000  # ms


def node(tmp_path: Path, server_id: str, **kwargs: int) -> SharedStoreLease:
    return SharedStoreLease(
        LeaseFile(tmp_path), server_id, renew_ms=RENEW, expiry_ms=EXPIRY, settle_ms=SETTLE, **kwargs
    )


def activate(lease: SharedStoreLease, now: float) -> float:
    """Take a free lease: claim, then confirm after the settle delay; the time after."""
    assert lease.tick(now) is LeaseEvent.CLAIMED
    now += SETTLE / 1000
    assert lease.tick(now) is LeaseEvent.ACQUIRED
    return now


# ---------------------------------------------------------------- the lease and its file


def test_the_file_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    file = LeaseFile(tmp_path)
    assert file.read() is None
    file.write(Lease("node-a", 3, 7, 1000))
    file.write(Lease("node-a", 3, 8, 1000))
    assert file.read() == Lease("node-a", 3, 8, 1000)
    assert json.loads((tmp_path / LEASE_FILE).read_text()) == {
        "holder": "node-a",
        "epoch": 3,
        "counter": 8,
        "period_ms": 1000,
    }
    assert [p.name for p in tmp_path.iterdir()] == [LEASE_FILE]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not JSON"),
        (b'{"holder": "a", "epoch": 1, "coun', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"holder": 5, "epoch": 1, "counter": 0, "period_ms": 1000}', "holder"),
        (b'{"holder": "a", "epoch": -1, "counter": 0, "period_ms": 1000}', "epoch"),
        (b'{"holder": "a", "epoch": 1, "counter": true, "period_ms": 1000}', "counter"),
        (b'{"holder": "a", "epoch": 1, "counter": 0}', "period_ms"),
        (b'{"holder": "a", "epoch": 1, "counter": 0, "period_ms": 0}', "period_ms"),
    ],
)
def test_a_corrupt_file_is_unreadable(tmp_path: Path, content: bytes, reason: str) -> None:
    (tmp_path / LEASE_FILE).write_bytes(content)
    with pytest.raises(LeaseUnreadableError, match=reason):
        LeaseFile(tmp_path).read()


def test_unknown_fields_are_ignored(tmp_path: Path) -> None:
    (tmp_path / LEASE_FILE).write_text('{"holder": "a", "epoch": 2, "counter": 5, "period_ms": 500, "x": 1}')
    assert LeaseFile(tmp_path).read() == Lease("a", 2, 5, 500)


def test_a_file_that_cannot_be_opened_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / LEASE_FILE).mkdir()
    with pytest.raises(LeaseUnreadableError, match="cannot read"):
        LeaseFile(tmp_path).read()


# ---------------------------------------------------------------- the waiter's expiry rule (pure)


def test_expires_only_after_expiry_ms_without_change_on_the_waiters_clock() -> None:
    watch = LeaseWatch(EXPIRY)
    lease = Lease("a", 1, 5, RENEW)
    assert watch.observe(lease, 100.0) is Verdict.LIVE  # first sight starts the wait, however old the lease
    assert watch.observe(lease, 109.9) is Verdict.LIVE
    assert watch.observe(lease, 110.0) is Verdict.EXPIRED


def test_no_expiry_while_the_counter_moves() -> None:
    watch = LeaseWatch(EXPIRY)
    for i in range(100):
        assert watch.observe(Lease("a", 1, i, RENEW), 100.0 + 5 * i) is Verdict.LIVE


def test_a_new_holder_or_epoch_restarts_the_wait() -> None:
    watch = LeaseWatch(EXPIRY)
    watch.observe(Lease("a", 1, 5, RENEW), 0.0)
    assert watch.observe(Lease("b", 2, 0, RENEW), 9.0) is Verdict.LIVE
    assert watch.observe(Lease("b", 2, 0, RENEW), 18.0) is Verdict.LIVE
    assert watch.observe(Lease("b", 2, 0, RENEW), 19.0) is Verdict.EXPIRED


def test_missing_or_released_lease_is_free() -> None:
    watch = LeaseWatch(EXPIRY)
    assert watch.observe(None, 0.0) is Verdict.FREE
    assert watch.observe(Lease("", 4, 9, RENEW), 0.0) is Verdict.FREE


def test_unreadable_is_unknown_until_it_has_stayed_so_for_expiry_ms() -> None:
    watch = LeaseWatch(EXPIRY)
    watch.observe(Lease("a", 1, 5, RENEW), 0.0)
    assert watch.observe_unreadable(3.0) is Verdict.UNKNOWN
    assert watch.observe_unreadable(12.9) is Verdict.UNKNOWN
    assert watch.observe(Lease("a", 1, 5, RENEW), 13.0) is Verdict.LIVE  # readable again: a fresh wait
    assert watch.observe_unreadable(14.0) is Verdict.UNKNOWN
    assert watch.observe_unreadable(24.0) is Verdict.EXPIRED


def test_a_holder_slower_than_our_expiry_gets_two_of_its_periods() -> None:
    watch = LeaseWatch(EXPIRY)
    slow = Lease("a", 1, 5, 8000)
    watch.observe(slow, 0.0)
    assert watch.observe(slow, 12.0) is Verdict.LIVE
    assert watch.observe(slow, 16.0) is Verdict.EXPIRED


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expiry_ms"):
        LeaseWatch(0)
    with pytest.raises(ValueError, match="must exceed"):
        SharedStoreLease(LeaseFile(tmp_path), "a", renew_ms=1000, expiry_ms=3000, settle_ms=1000)
    with pytest.raises(ValueError, match="server_id"):
        SharedStoreLease(LeaseFile(tmp_path), "")


# ---------------------------------------------------------------- a node's lease over real files


def test_missing_file_is_taken_at_once_with_epoch_1(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    assert (a.active, a.epoch) == (False, 0)
    activate(a, 0.0)
    assert (a.active, a.epoch) == (True, 1)
    assert LeaseFile(tmp_path).read() == Lease("a", 1, 0, RENEW)


def test_min_epoch_keeps_a_takeover_above_the_nodes_own_epoch(tmp_path: Path) -> None:
    a = node(tmp_path, "a", min_epoch=7)
    activate(a, 0.0)
    assert a.epoch == 8


def test_renewal_increments_the_counter(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    now = activate(a, 0.0)
    assert a.next_delay() == RENEW / 1000
    for counter in range(1, 6):
        now += RENEW / 1000
        assert a.tick(now) is LeaseEvent.RENEWED
        assert LeaseFile(tmp_path).read() == Lease("a", 1, counter, RENEW)


def test_a_waiter_takes_over_with_epoch_plus_1_only_after_expiry_without_renewals(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    now = activate(a, 0.0)
    for _ in range(30):  # a renews: b waits however long that goes on
        now += 1.0
        assert a.tick(now) is LeaseEvent.RENEWED
        assert b.tick(now) is LeaseEvent.WAITING
    # a stops renewing (crashed or paused): b gives up on it expiry_ms (of b's clock) after it saw the last renewal.
    last_seen = now
    for step in range(1, 10):
        assert b.tick(last_seen + step) is LeaseEvent.WAITING
    assert b.tick(last_seen + 10.0) is LeaseEvent.CLAIMED
    assert b.next_delay() == SETTLE / 1000
    assert b.tick(last_seen + 11.0) is LeaseEvent.ACQUIRED
    assert b.active
    assert b.epoch == 2
    assert LeaseFile(tmp_path).read() == Lease("b", 2, 0, RENEW)


def test_a_waiter_does_not_confirm_before_the_settle_delay(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    assert a.tick(0.0) is LeaseEvent.CLAIMED
    assert a.tick(0.5) is LeaseEvent.CLAIMED
    assert not a.active
    assert a.tick(1.0) is LeaseEvent.ACQUIRED


def test_the_fenced_old_holder_does_not_overwrite_the_new_lease(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    activate(a, 0.0)
    b.tick(0.0)
    b.tick(10.0)
    assert b.tick(11.0) is LeaseEvent.ACQUIRED
    taken = LeaseFile(tmp_path).read()
    # a wakes up within its own lease time (its clock was not running while paused).
    with caplog.at_level(logging.ERROR, logger="tridentmq.core.ha"):
        assert a.tick(2.0) is LeaseEvent.FENCED
    assert not a.active
    assert "fenced" in caplog.text
    assert LeaseFile(tmp_path).read() == taken
    assert a.tick(3.0) is LeaseEvent.WAITING  # now a waiter behind b
    assert b.tick(12.0) is LeaseEvent.RENEWED


class PausedWrite(LeaseFile):
    """A lease file whose next write first runs ``meanwhile``: the writer was paused after reading the lease."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.meanwhile: Callable[[], None] | None = None

    def write(self, lease: Lease) -> None:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        super().write(lease)


def test_a_holder_paused_between_its_read_and_its_write_stops_and_the_new_holder_goes_on(tmp_path: Path) -> None:
    """CI: a holder paused between reading the lease and writing its renewal wrote it on waking, over the lease
    of the node that had taken over; that node read a foreign holder and fenced itself, then the old one fenced
    itself for not having renewed: neither served."""
    file = PausedWrite(tmp_path)
    a = SharedStoreLease(file, "a", renew_ms=RENEW, expiry_ms=EXPIRY, settle_ms=SETTLE)
    b = node(tmp_path, "b")
    now = activate(a, 0.0)
    assert b.tick(now) is LeaseEvent.WAITING

    def b_takes_over() -> None:
        assert b.tick(now + 10.0) is LeaseEvent.CLAIMED
        assert b.tick(now + 11.0) is LeaseEvent.ACQUIRED

    file.meanwhile = b_takes_over
    assert a.tick(now + 1.0) is LeaseEvent.RENEWED  # its read saw its own lease; its write lands late
    assert LeaseFile(tmp_path).read() == Lease("a", 1, 1, RENEW)  # over b's
    assert a.renewed_in_time(now + 11.5) is LeaseEvent.FENCED
    assert not a.active
    assert not a.valid(now + 11.5)
    assert b.tick(now + 12.0) is LeaseEvent.RENEWED  # an older epoch: a late write, not a new holder
    assert b.active
    assert LeaseFile(tmp_path).read() == Lease("b", 2, 2, RENEW)  # counted on from the file's
    assert a.tick(now + 12.5) is LeaseEvent.WAITING
    assert b.tick(now + 13.0) is LeaseEvent.RENEWED


def test_a_renewal_is_in_time_if_it_finished_before_a_waiter_could_have_claimed(tmp_path: Path) -> None:
    """Measured from the write before (here the claim, at 0.0): a waiter claims expiry_ms after it, at the
    earliest, and its claim settles for settle_ms."""
    a = node(tmp_path, "a")
    now = activate(a, 0.0)
    assert a.tick(now + 1.0) is LeaseEvent.RENEWED
    assert a.renewed_in_time((EXPIRY - SETTLE) / 1000 - 0.1) is LeaseEvent.RENEWED  # a slow disk
    assert a.active
    assert a.tick(now + 2.0) is LeaseEvent.RENEWED  # the one before started at now + 1.0
    assert a.renewed_in_time(now + 1.0 + (EXPIRY - SETTLE) / 1000) is LeaseEvent.FENCED
    assert not a.active


def test_a_late_renewal_over_a_claim_wins_and_the_claimer_waits(tmp_path: Path) -> None:
    """A holder whose renewal lands after a claim (a slow write in time, say) keeps the lease: the claimer
    loses the race, as to any rename after its own."""
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    activate(a, 0.0)
    b.tick(0.0)
    assert b.tick(10.0) is LeaseEvent.CLAIMED
    LeaseFile(tmp_path).write(Lease("a", 1, 7, RENEW))
    assert b.tick(11.0) is LeaseEvent.LOST_RACE
    assert not b.active


def test_another_holder_at_our_own_epoch_fences(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    activate(a, 0.0)
    LeaseFile(tmp_path).write(Lease("b", 1, 0, RENEW))  # a waiter that claimed the same epoch, later
    assert a.tick(2.0) is LeaseEvent.FENCED


def test_a_higher_epoch_with_the_same_holder_fences_too(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    activate(a, 0.0)
    LeaseFile(tmp_path).write(Lease("a", 2, 0, RENEW))  # e.g. a second process with the same id took over
    assert a.tick(2.0) is LeaseEvent.FENCED


def test_a_holder_that_has_not_renewed_for_the_expiry_fences_itself(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    now = activate(a, 0.0)
    written = LeaseFile(tmp_path).read()
    # Paused past expiry_ms - settle_ms since its last write: a waiter may be renaming its claim right now.
    assert a.tick(now + 8.0) is LeaseEvent.FENCED
    assert LeaseFile(tmp_path).read() == written


def test_a_holder_whose_file_vanished_is_fenced(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    activate(a, 0.0)
    (tmp_path / LEASE_FILE).unlink()
    assert a.tick(2.0) is LeaseEvent.FENCED
    assert not (tmp_path / LEASE_FILE).exists()


def test_two_racing_waiters_the_later_rename_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    LeaseFile(tmp_path).write(Lease("old", 4, 17, RENEW))
    stale = LeaseFile(tmp_path).read()
    b, c = node(tmp_path, "b"), node(tmp_path, "c")
    assert b.tick(0.0) is LeaseEvent.WAITING
    assert c.tick(0.5) is LeaseEvent.WAITING
    assert b.tick(10.0) is LeaseEvent.CLAIMED
    # c read the file just before b's rename landed, so it decides on the old lease too.
    monkeypatch.setattr(c.file, "read", lambda: stale)
    assert c.tick(10.5) is LeaseEvent.CLAIMED
    monkeypatch.undo()
    assert b.tick(11.0) is LeaseEvent.LOST_RACE
    assert c.tick(11.5) is LeaseEvent.ACQUIRED
    assert (b.active, c.active) == (False, True)
    assert LeaseFile(tmp_path).read() == Lease("c", 5, 0, RENEW)
    # The loser waits behind the winner's lease, which c keeps renewing.
    for step in range(1, 20):
        assert c.tick(11.5 + step) is LeaseEvent.RENEWED
        assert b.tick(11.0 + step) is LeaseEvent.WAITING


def test_a_waiter_that_sees_the_other_claim_first_does_not_claim(tmp_path: Path) -> None:
    LeaseFile(tmp_path).write(Lease("old", 4, 17, RENEW))
    b, c = node(tmp_path, "b"), node(tmp_path, "c")
    b.tick(0.0)
    c.tick(0.5)
    assert b.tick(10.0) is LeaseEvent.CLAIMED
    assert c.tick(10.5) is LeaseEvent.WAITING  # b's claim is a new triple
    assert b.tick(11.0) is LeaseEvent.ACQUIRED


def test_a_corrupt_file_is_not_taken_over_until_it_stays_unreadable_for_the_expiry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    LeaseFile(tmp_path).write(Lease("a", 3, 1, RENEW))
    b = node(tmp_path, "b")
    assert b.tick(0.0) is LeaseEvent.WAITING
    (tmp_path / LEASE_FILE).write_bytes(b"\x00garbage")
    with caplog.at_level(logging.WARNING, logger="tridentmq.core.ha"):
        for step in range(1, 11):
            assert b.tick(float(step)) is LeaseEvent.WAITING
    assert caplog.text.count("unreadable") == 1  # one warning, not one per poll
    assert b.tick(11.0) is LeaseEvent.CLAIMED
    assert b.tick(12.0) is LeaseEvent.ACQUIRED
    assert b.epoch == 4  # above the last epoch it could read


def test_a_holder_that_cannot_read_its_file_does_not_write_and_lapses(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    now = activate(a, 0.0)
    (tmp_path / LEASE_FILE).write_bytes(b"not json")
    for step in range(1, 8):  # renewed (claimed) at 0.0; lapses at expiry_ms - settle_ms
        assert a.tick(now + step) is LeaseEvent.RENEW_FAILED
        assert a.active
    assert (tmp_path / LEASE_FILE).read_bytes() == b"not json"
    assert a.tick(now + 8.0) is LeaseEvent.FENCED


def test_a_failed_write_is_reported_and_the_holder_stays_active_until_it_lapses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node(tmp_path, "a")
    now = activate(a, 0.0)

    def broken_write(lease: Lease) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(a.file, "write", broken_write)
    assert a.tick(now + 1.0) is LeaseEvent.RENEW_FAILED
    assert a.active
    monkeypatch.undo()
    assert a.tick(now + 2.0) is LeaseEvent.RENEWED


def test_release_lets_a_waiter_take_over_at_once(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    activate(a, 0.0)
    assert b.tick(0.5) is LeaseEvent.WAITING
    assert a.release()
    assert not a.active
    assert not a.release()
    assert b.tick(1.5) is LeaseEvent.CLAIMED
    assert b.tick(2.5) is LeaseEvent.ACQUIRED
    assert b.epoch == 2


def test_a_restarted_holder_waits_out_its_own_old_lease(tmp_path: Path) -> None:
    activate(node(tmp_path, "a"), 0.0)
    again = node(tmp_path, "a")  # the process died; its lease was not released
    assert again.tick(100.0) is LeaseEvent.WAITING
    assert again.tick(110.0) is LeaseEvent.CLAIMED
    assert again.tick(111.0) is LeaseEvent.ACQUIRED
    assert again.epoch == 2
