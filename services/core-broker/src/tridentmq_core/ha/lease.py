"""The shared-store HA lease: which of the nodes sharing a data directory is the active one.

A plain POSIX lock is not trusted on a network filesystem, so the active node holds a lease file in the
shared directory instead: JSON ``{holder, epoch, counter, period_ms}``, always written to a temporary name,
synced and renamed (a reader sees the old lease or the new one, never half of one). The holder renews it
by writing ``counter + 1`` every ``renew_ms``. A waiting node never compares clocks across machines: it
takes the lease as expired only when the (holder, epoch, counter) triple has stayed the same for
``expiry_ms`` of its own monotonic clock since it first saw that triple. It then writes a claim with the
next epoch and reads it back ``settle_ms`` later: of two racing waiters the later rename wins and the other
sees a foreign holder and goes back to waiting. Before every renewal the holder reads the file; a foreign
holder, a higher epoch or no file at all means it was fenced, and it stops without writing. It also stops
when it has not renewed for ``expiry_ms - settle_ms`` (a paused process), since a waiter may be taking
over at that moment. Reading and writing are two steps: a holder paused between them writes its renewal
on waking, perhaps over the lease of the node that took over meanwhile. So it checks when the write
finished (``renewed_in_time``) and fences itself when that was too late; and a holder that finds a lower
epoch where its own lease should be takes it for such a late write (epochs only grow) and writes its own
again instead of stopping.

``LeaseWatch`` (the expiry rule) is pure; ``LeaseFile`` does the file I/O; ``SharedStoreLease`` joins them
behind a synchronous ``tick(now)`` for the node's timer. Nothing here reads a clock: ``now`` is the
caller's monotonic time in seconds. On NFS, keep ``settle_ms`` above the client's lookup cache time (or
mount with ``lookupcache=positive``) so the read-back sees the other waiter's rename.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

LEASE_FILE: Final = "server.lease"
DEFAULT_RENEW_MS: Final = 1000
DEFAULT_EXPIRY_MS: Final = 10_000
DEFAULT_SETTLE_MS: Final = 1000
_MAX_LEASE_BYTES: Final = 64 * 1024

_log = logging.getLogger("tridentmq.core.ha")


class LeaseUnreadableError(Exception):
    """The lease file exists but cannot be read or is not a lease: the state is unknown."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One version of the lease file. An empty ``holder`` is a lease given up on shutdown: free to take."""

    holder: str
    epoch: int
    counter: int
    period_ms: int

    @property
    def key(self) -> tuple[str, int, int]:
        """What must change for the holder to count as alive."""
        return self.holder, self.epoch, self.counter

    def encode(self) -> bytes:
        fields = {"holder": self.holder, "epoch": self.epoch, "counter": self.counter, "period_ms": self.period_ms}
        return json.dumps(fields, sort_keys=True).encode() + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> Lease:
        """The lease in ``data``; LeaseUnreadableError when it is not one (extra fields are ignored)."""
        try:
            fields = json.loads(data)
        except ValueError as exc:  # also UnicodeDecodeError
            raise LeaseUnreadableError(f"not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise LeaseUnreadableError("not a JSON object")
        holder = fields.get("holder")
        if not isinstance(holder, str):
            raise LeaseUnreadableError("holder is not a string")
        epoch, counter, period_ms = (_count(fields, name) for name in ("epoch", "counter", "period_ms"))
        if period_ms == 0:
            raise LeaseUnreadableError("period_ms is 0")
        return cls(holder, epoch, counter, period_ms)


def _count(fields: dict[str, Any], name: str) -> int:
    value = fields.get(name)
    if type(value) is not int or value < 0:  # type(): a JSON true is not a count
        raise LeaseUnreadableError(f"{name} is not a non-negative integer")
    return value


class Verdict(StrEnum):
    FREE = "free"  # no lease, or one given up: take it now
    LIVE = "live"  # held, and it changed within expiry_ms
    UNKNOWN = "unknown"  # unreadable for less than expiry_ms: wait
    EXPIRED = "expired"  # unchanged (or unreadable) for expiry_ms: take it


_UNREADABLE: Final = ("", -1, -1)  # the key of an unreadable file: it "changes" only when readable again


class LeaseWatch:
    """A waiter's view of the lease: expired once the same triple has been seen for ``expiry_ms``. Pure."""

    def __init__(self, expiry_ms: int) -> None:
        if expiry_ms <= 0:
            raise ValueError(f"expiry_ms must be positive, not {expiry_ms}")
        self.expiry_ms = expiry_ms
        self._key: tuple[str, int, int] | None = None
        self._since = 0.0
        self._period_ms = 0

    def observe(self, lease: Lease | None, now: float) -> Verdict:
        """The verdict on ``lease`` (None: no file) as read at monotonic time ``now`` (seconds)."""
        if lease is None or not lease.holder:
            self._key = None
            return Verdict.FREE
        self._period_ms = lease.period_ms
        return Verdict.EXPIRED if self._unchanged_for_expiry(lease.key, now) else Verdict.LIVE

    def observe_unreadable(self, now: float) -> Verdict:
        """The verdict on a file that could not be read at ``now``: never free, expired only after expiry_ms."""
        return Verdict.EXPIRED if self._unchanged_for_expiry(_UNREADABLE, now) else Verdict.UNKNOWN

    def _unchanged_for_expiry(self, key: tuple[str, int, int], now: float) -> bool:
        if key != self._key:
            self._key, self._since = key, now
            return False
        # A holder renewing more slowly than our expiry would look dead between renewals: wait two of its periods.
        expiry_ms = max(self.expiry_ms, 2 * self._period_ms)
        return (now - self._since) * 1000 >= expiry_ms


class LeaseFile:
    """The lease file in the shared directory, read whole and replaced atomically."""

    def __init__(self, directory: Path, name: str = LEASE_FILE) -> None:
        self.path = directory / name

    def read(self) -> Lease | None:
        """The current lease; None when there is no file; LeaseUnreadableError when it cannot be read or parsed."""
        try:
            with self.path.open("rb") as file:
                data = file.read(_MAX_LEASE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LeaseUnreadableError(f"cannot read {self.path}: {exc}") from exc
        if len(data) > _MAX_LEASE_BYTES:
            raise LeaseUnreadableError(f"{self.path} is larger than {_MAX_LEASE_BYTES} bytes")
        return Lease.decode(data)

    def write(self, lease: Lease) -> None:
        """Replace the lease durably: temporary file, fsync, rename, fsync of the directory. OSError on failure."""
        # A temporary name per writer, so racing waiters never write into each other's half-written file.
        tmp = self.path.with_name(f".{self.path.name}.{re.sub(r'[^A-Za-z0-9_.-]', '_', lease.holder)[:64]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, lease.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _stale(current: Lease, ours: Lease) -> bool:
    """Whether ``current``, found where our lease should be, is a late write of an older epoch's holder: epochs
    only grow, so it comes from a holder paused between reading the lease and writing its renewal (or its
    release), which fenced itself once the write finished (``renewed_in_time``)."""
    return current.epoch < ours.epoch


class LeaseEvent(StrEnum):
    WAITING = "waiting"  # another node holds the lease (or it is unreadable): stay passive
    CLAIMED = "claimed"  # a claim was written: tick again after settle_ms to confirm it
    ACQUIRED = "acquired"  # the claim held: activate with ``epoch``
    LOST_RACE = "lost-race"  # another waiter's claim replaced ours: stay passive
    RENEWED = "renewed"  # still the active node
    RENEW_FAILED = "renew-failed"  # could not read or write the file: still active until the lease lapses
    FENCED = "fenced"  # another node took over, or ours lapsed: stop serving at once


class _State(StrEnum):
    WAITING = "waiting"
    CLAIMING = "claiming"
    HOLDING = "holding"


class SharedStoreLease:
    """One node's side of the lease, driven by ``tick(now)`` from a timer every ``next_delay()`` seconds.

    Synchronous file I/O (a few hundred bytes and two fsyncs per tick): call it from the event loop's
    default executor if the shared filesystem can stall.
    """

    def __init__(
        self,
        file: LeaseFile,
        server_id: str,
        *,
        renew_ms: int = DEFAULT_RENEW_MS,
        expiry_ms: int = DEFAULT_EXPIRY_MS,
        settle_ms: int = DEFAULT_SETTLE_MS,
        min_epoch: int = 0,
    ) -> None:
        if not server_id:
            raise ValueError("server_id must not be empty")
        if renew_ms <= 0 or settle_ms <= 0:
            raise ValueError("renew_ms and settle_ms must be positive")
        if renew_ms + 2 * settle_ms >= expiry_ms:
            # The holder must renew (and finish writing) well before a waiter can give up on it.
            raise ValueError(
                f"expiry_ms ({expiry_ms}) must exceed renew_ms + 2 * settle_ms ({renew_ms + 2 * settle_ms})"
            )
        self.file = file
        self.server_id = server_id
        self.renew_ms, self.expiry_ms, self.settle_ms = renew_ms, expiry_ms, settle_ms
        self._epoch_floor = min_epoch  # the highest epoch seen: a takeover goes above it
        self._watch = LeaseWatch(expiry_ms)
        self._state = _State.WAITING
        self._lease: Lease | None = None  # ours, while claiming or holding
        self._written_at = 0.0  # when our last successful write started
        self._previous_write = 0.0  # when the one before it started
        self._warned_unreadable = False

    @property
    def active(self) -> bool:
        """Whether this node holds a confirmed lease and may serve."""
        return self._state is _State.HOLDING

    @property
    def epoch(self) -> int:
        """The epoch of our lease while claiming or holding; otherwise the highest epoch seen."""
        return self._lease.epoch if self._lease is not None else self._epoch_floor

    def valid(self, now: float) -> bool:
        """Whether this node holds the lease and renewed it recently enough that no waiter can have taken it
        (what a holder checks before it confirms anything: a process that was paused may not)."""
        return self._state is _State.HOLDING and (now - self._written_at) * 1000 < self.expiry_ms - self.settle_ms

    def next_delay(self) -> float:
        """Seconds until the next ``tick``."""
        return (self.settle_ms if self._state is _State.CLAIMING else self.renew_ms) / 1000

    def tick(self, now: float) -> LeaseEvent:
        """Read (and perhaps write) the lease at monotonic time ``now`` and say what changed."""
        if self._state is _State.HOLDING:
            return self._renew(now)
        if self._state is _State.CLAIMING:
            return self._confirm(now)
        return self._poll(now)

    def release(self) -> bool:
        """On a clean shutdown: give the lease up so a waiter takes over at once. False if it was not ours."""
        if self._state is not _State.HOLDING or self._lease is None:
            return False
        lease, self._state, self._lease = self._lease, _State.WAITING, None
        try:
            current = self.file.read()
            if current is None or (current.holder, current.epoch) != (lease.holder, lease.epoch):
                return False
            self.file.write(Lease("", lease.epoch, current.counter + 1, lease.period_ms))
        except (LeaseUnreadableError, OSError) as exc:
            _log.warning("shared-store lease: could not release %s: %s", self.file.path, exc)
            return False
        _log.info("shared-store lease: released epoch %d", lease.epoch)
        return True

    def _read(self) -> Lease | None:
        """The file's lease; LeaseUnreadableError is passed on after one warning per unreadable spell."""
        try:
            lease = self.file.read()
        except LeaseUnreadableError as exc:
            if not self._warned_unreadable:
                _log.warning("shared-store lease: %s is unreadable, treating it as unknown: %s", self.file.path, exc)
                self._warned_unreadable = True
            raise
        if self._warned_unreadable:
            _log.info("shared-store lease: %s is readable again", self.file.path)
            self._warned_unreadable = False
        if lease is not None:
            self._epoch_floor = max(self._epoch_floor, lease.epoch)
        return lease

    def _poll(self, now: float) -> LeaseEvent:
        try:
            verdict = self._watch.observe(self._read(), now)
        except LeaseUnreadableError:
            verdict = self._watch.observe_unreadable(now)
        if verdict is Verdict.FREE or verdict is Verdict.EXPIRED:
            return self._claim(now, verdict)
        return LeaseEvent.WAITING

    def _claim(self, now: float, verdict: Verdict) -> LeaseEvent:
        lease = Lease(self.server_id, self._epoch_floor + 1, 0, self.renew_ms)
        try:
            self.file.write(lease)
        except OSError as exc:
            _log.warning("shared-store lease: could not write a claim to %s: %s", self.file.path, exc)
            return LeaseEvent.WAITING
        _log.info("shared-store lease: %s, claimed epoch %d", verdict, lease.epoch)
        self._state, self._lease, self._written_at, self._previous_write = _State.CLAIMING, lease, now, now
        return LeaseEvent.CLAIMED

    def _confirm(self, now: float) -> LeaseEvent:
        claim = self._lease
        assert claim is not None
        if (now - self._written_at) * 1000 < self.settle_ms:
            return LeaseEvent.CLAIMED  # ticked early: a racing waiter's rename may still be on its way
        try:
            current = self._read()
        except LeaseUnreadableError:
            current = None
        if current == claim:
            self._state = _State.HOLDING
            _log.info("shared-store lease: acquired epoch %d", claim.epoch)
            return LeaseEvent.ACQUIRED
        self._back_to_waiting()
        if current is not None:
            self._watch.observe(current, now)  # the winner's claim starts a fresh expiry wait
        _log.info("shared-store lease: epoch %d went to %r", claim.epoch, current.holder if current else "?")
        return LeaseEvent.LOST_RACE

    def _renew(self, now: float) -> LeaseEvent:
        ours = self._lease
        assert ours is not None
        if (now - self._written_at) * 1000 >= self.expiry_ms - self.settle_ms:
            return self._fence(f"not renewed for {now - self._written_at:.1f} s, a waiter may be taking over")
        try:
            current = self._read()
        except LeaseUnreadableError:
            return LeaseEvent.RENEW_FAILED
        if current is None:
            return self._fence("the lease file is gone")
        if (current.holder, current.epoch) != (ours.holder, ours.epoch):
            if not _stale(current, ours):
                return self._fence(f"{current.holder or 'nobody'!r} holds epoch {current.epoch}")
            _log.warning(
                "shared-store lease: %r wrote its older epoch %d over ours (%d): ours is written again",
                current.holder,
                current.epoch,
                ours.epoch,
            )
        # From the file's counter, not ours: a write that failed after its rename still counts.
        renewal = Lease(ours.holder, ours.epoch, max(current.counter, ours.counter) + 1, self.renew_ms)
        try:
            self.file.write(renewal)
        except OSError as exc:
            _log.warning("shared-store lease: could not renew %s: %s", self.file.path, exc)
            return LeaseEvent.RENEW_FAILED
        self._lease, self._previous_write, self._written_at = renewal, self._written_at, now
        return LeaseEvent.RENEWED

    def renewed_in_time(self, now: float) -> LeaseEvent:
        """After a RENEWED tick, with the monotonic time its write finished: FENCED when it finished too late.
        Reading the lease and writing the renewal are two steps; a holder paused between them may have written
        over the claim of a waiter that took over meanwhile, and must stop at once (the new holder writes its
        lease again, see ``_stale``). Otherwise RENEWED."""
        if self._state is _State.HOLDING and (now - self._previous_write) * 1000 >= self.expiry_ms - self.settle_ms:
            return self._fence(f"the renewal took until {now - self._previous_write:.1f} s after the one before")
        return LeaseEvent.RENEWED

    def _fence(self, reason: str) -> LeaseEvent:
        assert self._lease is not None
        _log.error("shared-store lease: epoch %d fenced, stop serving: %s", self._lease.epoch, reason)
        self._back_to_waiting()
        return LeaseEvent.FENCED

    def _back_to_waiting(self) -> None:
        if self._lease is not None:
            self._epoch_floor = max(self._epoch_floor, self._lease.epoch)
        self._state, self._lease, self._watch = _State.WAITING, None, LeaseWatch(self.expiry_ms)
