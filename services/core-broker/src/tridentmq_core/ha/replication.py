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


class ReplicaFeed:
    """What one backup still has to receive, and how far it has acknowledged."""

    def __init__(self, epoch: int, first: int, *, window: int, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.epoch = epoch
        self.first = first  # the first record the backup gets
        self.window = window
        self.max_batch_bytes = max_batch_bytes
        self._unsent: deque[bytes] = deque()
        self._next = first  # the number of _unsent[0]
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
        return self._next + len(self._unsent) - 1 - self.acked

    def append(self, number: int, data: bytes) -> None:
        expected = self._next + len(self._unsent)
        if number != expected:
            raise ValueError(f"journal record {number} out of order (expected {expected})")
        self._unsent.append(data)

    def copied(self, last: int) -> None:
        """The initial copy ends with record ``last``."""
        self.sync_end = last

    def take(self) -> tuple[int, list[bytes]] | None:
        """The next batch to send (first number, records) within the window, or None."""
        room = self.window - (self._next - 1 - self.acked)
        if room <= 0 or not self._unsent:
            return None
        first = self._next
        batch: list[bytes] = []
        size = 0
        unsent = self._unsent
        while unsent and len(batch) < room and (not batch or size + len(unsent[0]) <= self.max_batch_bytes):
            data = unsent.popleft()
            batch.append(data)
            size += len(data)
        self._next += len(batch)
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
