"""Wills: a message a link sets (SET_WILL) to be published when it closes without clearing it, at once or
after a delay. The MQTT gateway builds its Last Will and Testament on it; the core knows only keys, owners
and delays.

This module keeps that book: which open link holds the will under each key, and the wills of closed links
waiting for their delay. The broker checks a will when it is set and routes it when it is due.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from tridentmq_core.deadlines import Deadlines
from tridentmq_shared.message import WireMessage


@dataclass(frozen=True, slots=True)
class Will:
    """A message published when the link that set it closes without clearing it (see SET_WILL)."""

    key: str
    message: WireMessage
    delay_ms: int
    conn_id: str  # the link that set it, for the audit trail
    user: str  # the user of that link: only this user may replace, cancel or publish it early
    # (store address, key properties): once published, a copy goes to that store with those properties added
    # (MQTT's retained will: the gateway's last-value queue of retained messages, keyed by topic).
    retain: tuple[str, dict[str, Any]] | None = None


class Holder(Protocol):
    """An open link, which holds at most one will."""

    will: Will | None
    conn_id: str


class Wills:
    def __init__(self) -> None:
        self.holders: dict[str, Holder] = {}  # will key → the open link holding that will
        self.pending: dict[str, Will] = {}  # will key → will of a closed link, waiting for its delay
        self._due: Deadlines[str] = Deadlines()

    def user(self, key: str) -> str | None:
        """The user of the will held or pending under ``key``; None when there is none."""
        pending = self.pending.get(key)
        if pending is not None:
            return pending.user
        holder = self.holders.get(key)
        return holder.will.user if holder is not None and holder.will is not None else None

    def hold(self, holder: Holder, will: Will) -> None:
        """``holder`` sets ``will``, replacing its own earlier one (``take_key`` first frees the key)."""
        self.drop(holder)
        holder.will = will
        self.holders[will.key] = holder

    def drop(self, holder: Holder) -> None:
        """``holder`` clears its will: nothing is published."""
        will, holder.will = holder.will, None
        if will is not None and self.holders.get(will.key) is holder:
            del self.holders[will.key]

    def take_key(self, key: str) -> tuple[Will | None, Holder | None]:
        """A SET_WILL names ``key``: the pending will under it (cancelled here; the caller publishes it or not)
        and the other open link that held it (dropped: a reconnected client takes over its key before the
        core has noticed that the old link is gone)."""
        pending = self.take_pending(key)
        holder = self.holders.pop(key, None)
        if holder is not None:
            holder.will = None
        return pending, holder

    def take_pending(self, key: str) -> Will | None:
        """The will pending under ``key``, taken out of the book (None when there is none)."""
        pending = self.pending.pop(key, None)
        if pending is not None:
            self._due.cancel(key)
        return pending

    def release(self, holder: Holder, now_ms: int) -> Will | None:
        """``holder`` closed: its will, to be published now; None when it has none or it waits for its delay
        (a newer pending will replaces an older one under the same key)."""
        will = holder.will
        if will is None:
            return None
        self.drop(holder)
        if will.delay_ms == 0:
            return will
        self.pending[will.key] = will
        self._due.set(will.key, now_ms + will.delay_ms)
        return None

    def due(self, now_ms: int) -> list[Will]:
        """The pending wills whose delay is over, taken out of the book."""
        return [self.pending.pop(key) for key in self._due.pop_due(now_ms)]

    def forget_held(self, holders: Iterable[Holder]) -> None:
        """The node closes these links itself (it stops serving them): their clients did not die, and their
        links set their wills again where they resume. Wills already pending stay."""
        for holder in holders:
            self.drop(holder)

    def discard(self, holders: Iterable[Holder]) -> None:
        """Forget every will: held by ``holders`` (the open links) and pending."""
        for holder in holders:
            holder.will = None
        self.holders.clear()
        self.pending.clear()
        self._due = Deadlines()
