"""The journal stream from a primary to its backup, primary side (pure: no I/O, no clock).

A backup is brought in sync by a compaction that starts when it connects: compaction rolls the journal and
copies the whole live state after the roll, so the records appended from the roll on (new ones and copied
ones interleaved) replay to the complete state. The feed therefore starts at the roll and holds every record
the backup has not been sent yet; ``sync_end`` is the compaction's last record. Once the backup acknowledges
it, the backup is in sync: from then on a durable write is confirmed only when both copies hold it.
"""

from __future__ import annotations

from collections import deque
from typing import Final

MAX_BATCH_BYTES: Final = 1024 * 1024
NO_BACKLOG_LIMIT: Final = 1 << 62
ROLL: Final = b""  # in the stream: the journal starts a new segment here


class ReplicaFeed:
    """What one backup still has to receive, and how far it has acknowledged.

    Besides records, the stream carries the journal's segment rolls (``ROLL``, an empty record that takes no
    number), so the backup's segments follow the primary's and it can retire the old ones after a
    compaction, as the primary does.

    What waits beyond the window is held here; once it exceeds ``max_backlog_bytes`` the feed is
    ``overflowed``: it keeps no more, sends nothing more, and its backup is to be dropped."""

    def __init__(
        self,
        epoch: int,
        first: int,
        *,
        window: int,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_backlog_bytes: int = NO_BACKLOG_LIMIT,
    ) -> None:
        self.epoch = epoch
        self.first = first  # the first record the backup gets
        self.window = window
        self.max_batch_bytes = max_batch_bytes
        self.max_backlog_bytes = max_backlog_bytes
        self._unsent: deque[bytes] = deque()
        self._unsent_records = 0  # rolls not counted
        self._unsent_bytes = 0
        self.overflowed = False
        self._next = first  # the number of the first record in _unsent
        self.acked = first - 1
        self.sync_end = 0  # 0 until the initial copy is fully appended
        self.in_sync = False

    @property
    def next_number(self) -> int:
        """The number of the next record to send."""
        return self._next

    @property
    def pending(self) -> int:
        """Records appended but not acknowledged by the backup."""
        return self._next + self._unsent_records - 1 - self.acked

    @property
    def confirmable(self) -> int | None:
        """The last record whose write may be confirmed (None: any on disk here, while the copy runs). The
        backup is in sync, and may take over, once it holds the copy's last record, so from the moment that
        record is known a later write waits until the backup holds it: confirmed here before this node heard
        that the backup is in sync, it could be missing from a backup that took over (as could a delivery
        let out, whose attempt record it is)."""
        return max(self.acked, self.sync_end) if self.sync_end else None

    def append(self, number: int, data: bytes) -> None:
        """Record ``number`` was appended; ``data`` is empty (and ``number`` ignored) for a segment roll."""
        if data is ROLL or not data:
            if not self.overflowed:
                self._unsent.append(ROLL)
            return
        expected = self._next + self._unsent_records
        if number != expected:
            raise ValueError(f"journal record {number} out of order (expected {expected})")
        self._unsent_records += 1  # counted still: ``pending`` says how far behind the backup is
        if self.overflowed:
            return
        self._unsent.append(data)
        self._unsent_bytes += len(data)
        if self._unsent_bytes > self.max_backlog_bytes:
            # The backup falls behind for good (or is stuck): holding all it has not been sent would grow
            # this node's memory without bound. It is dropped and copies afresh; what it missed is of no use.
            self.overflowed = True
            self._unsent.clear()
            self._unsent_bytes = 0

    def copied(self, last: int) -> None:
        """The initial copy ends with record ``last``."""
        self.sync_end = last

    def take(self) -> tuple[int, list[bytes]] | None:
        """The next batch to send (first number, records and rolls) within the window, or None."""
        room = self.window - (self._next - 1 - self.acked)
        unsent = self._unsent
        if room <= 0 or not unsent or self.overflowed:
            return None
        first = self._next
        batch: list[bytes] = []
        records = size = 0
        while unsent and records < room and (not batch or size + len(unsent[0]) <= self.max_batch_bytes):
            data = unsent.popleft()
            batch.append(data)
            size += len(data)
            if data:
                records += 1
        self._next += records
        self._unsent_records -= records
        self._unsent_bytes -= size
        return first, batch

    def ack(self, upto: int) -> bool:
        """The backup holds every record up to ``upto``; True when this makes it in sync."""
        if upto >= self._next:
            raise ValueError(f"acknowledgement of record {upto}, never sent (sent up to {self._next - 1})")
        if upto <= self.acked:
            return False
        self.acked = upto
        if not self.in_sync and self.sync_end and upto >= self.sync_end:
            self.in_sync = True
            return True
        return False
