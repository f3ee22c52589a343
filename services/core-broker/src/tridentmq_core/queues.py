"""Queues and consumers: ordering, credit, dispatch and in-flight bookkeeping. Pure: no I/O, no clock.

A queue holds the wire messages themselves (lists, see ``tridentmq_shared.message``), one deque per
priority. Dispatch has a fast path (no selectors, no groups: pop and hand round-robin to consumers with
credit) and a scanning path that leaves behind what no ready consumer may take.

Delivery counts: a message delivered for the first time has count 1; the queue remembers a count only
for messages that came back (nack, release, consumer gone, rolled back), so the common case costs nothing.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol, cast

from tridentmq_core.outlet import Outlet
from tridentmq_core.selector import Selector
from tridentmq_shared.message import (
    M_BODY,
    M_DURABLE,
    M_EXPIRATION,
    M_GROUP,
    M_ID,
    M_LVQ,
    M_PRIORITY,
    M_PROPS,
    MAX_PRIORITY,
    SELECTOR_HEADERS,
    RoutingType,
    WireMessage,
    selector_view,
)


class LinkSession(Protocol):
    """The link session a consumer (or a temporary queue) belongs to, as the queues see it: where its
    deliveries go, and what names it. A ``sessions.Session`` is one."""

    @property
    def conn(self) -> Outlet: ...
    @property
    def conn_id(self) -> str: ...
    @property
    def client_name(self) -> str: ...
    @property
    def consumers(self) -> dict[int, Consumer]: ...
    @property
    def temporary_queues(self) -> dict[str, None]: ...


#: How many messages the scanning dispatch looks at per call; a scan cut there goes on from where it stopped at
#: the broker's next tick (``DeliverySink.on_scan_cut``), so a match further back is found without an event.
SCAN_LIMIT = 10_000
#: Bytes a queued message costs beyond its body (the list, its fields, queue bookkeeping): an estimate
#: that makes the memory limit meaningful for small messages.
MESSAGE_OVERHEAD = 256
#: A priority level that never held a message: empty to iterate, test and count, without a deque's 600 bytes
#: (ten deques per queue were half of a core's memory per MQTT session). Its first message makes the deque.
_UNUSED_LEVEL: Final = cast("deque[WireMessage]", ())
#: The levels of a queue that holds no message: shared by all such queues (a list of ten is 136 bytes, and a core
#: holds two queues per MQTT session). A tuple, so that a write into it fails instead of reaching every queue.
_NO_LEVELS: Final = cast("list[deque[WireMessage]]", (_UNUSED_LEVEL,) * (MAX_PRIORITY + 1))
# Shared empty containers, one per kind, that a queue or consumer holds until its first entry: most never get
# one (an empty dict is 64 bytes, a list 56, and a core holds a queue and a consumer or more per MQTT session).
# They are only ever read: each writer first swaps in a container of its own.
_NO_COUNTS: Final[dict[int, int]] = {}
_NO_GROUPS: Final[dict[str, Consumer]] = {}
_NO_LAST_VALUES: Final[dict[Any, WireMessage]] = {}
_NO_SUPERSEDED: Final[set[int]] = set()
_NO_ATTEMPTS: Final[list[tuple[Consumer, int, WireMessage]]] = []
_NO_IN_FLIGHT: Final[dict[int, WireMessage]] = {}  # an auto-acknowledging consumer never has any


class MemoryGauge:
    """Bytes held by queued and in-flight messages of every queue of a broker (shared by reference)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0


class QueueNotes:
    """Queues noted as something about them changed, for any number of readers: each reader's ``take`` returns
    those noted since its last. A reader that is dropped stops counting."""

    __slots__ = ("_readers", "noted")

    def __init__(self) -> None:
        self.noted: set[Queue] = set()  # since the readers last took them (cleared in place, never replaced)
        self._readers: weakref.WeakSet[QueueNotesReader] = weakref.WeakSet()

    def reader(self) -> QueueNotesReader:
        """A reader of what is noted from now on."""
        reader = QueueNotesReader(self)
        self._readers.add(reader)
        return reader

    def note(self, queue: Queue) -> None:
        if self._readers:  # nobody reads: keep nothing
            self.noted.add(queue)

    def share(self) -> None:
        """Hand what was noted since the last call to every reader."""
        noted = self.noted
        if noted:
            for reader in self._readers:
                reader.pending |= noted
            noted.clear()


class QueueNotesReader:
    """What one reader has not taken yet of a ``QueueNotes``."""

    __slots__ = ("__weakref__", "_notes", "pending")

    def __init__(self, notes: QueueNotes) -> None:
        self._notes = notes
        self.pending: set[Queue] = set()

    def take(self) -> set[Queue]:
        """The queues noted since the last call."""
        self._notes.share()
        taken, self.pending = self.pending, set()
        return taken


class QueueActivity:
    """The queues periodic work has to look at, noted as it happens rather than found by a look at every queue
    each time: a core with 100,000 MQTT sessions holds 200,000 queues, nearly all of them quiet (shared by
    reference, like ``MemoryGauge``)."""

    __slots__ = ("bindings", "changed", "timed")

    def __init__(self) -> None:
        #: Messages came in, came back or left for good, or it was deleted (the broker reads it: never unread).
        self.changed = QueueNotes()
        #: What the other nodes of a cluster know of it changed: made, deleted, a consumer came or went, its
        #: record became safe.
        self.bindings = QueueNotes()
        #: It held messages with an expiration, or paged ones, when last seen: the expiry scan visits these
        #: (and drops the ones that hold neither any more).
        self.timed: set[Queue] = set()


class PagedBrowse(Protocol):
    """A browser's copy of what was paged when it subscribed, read back for it alone (``store/paging.py``)."""

    @property
    def done(self) -> bool: ...
    def take(self) -> WireMessage | None: ...  # None: none now (done, or more after on_ready)
    def close(self) -> None: ...


class Pager(Protocol):
    """Where a queue over its size limit keeps further messages, in order (``store/paging.py``)."""

    count: int

    def append(self, message: WireMessage) -> None: ...
    def read(self, limit: int) -> list[WireMessage]: ...  # may return fewer: more after on_ready
    def peek(self) -> Iterator[WireMessage]: ...
    def browse(self) -> PagedBrowse: ...
    def close(self) -> None: ...


class Browse:
    """What a browser is offered: the queued messages when it subscribed, in delivery order, then those paged
    then (read back from the page files as it gets to them)."""

    __slots__ = ("_paged", "_queued", "_unsent")

    def __init__(self, queued: list[WireMessage], paged: PagedBrowse | None) -> None:
        self._queued = iter(queued)
        self._paged = paged
        self._unsent: WireMessage | None = None

    def next(self) -> WireMessage | None:
        """The next message; None when there is none now (the end if ``done``, else more after on_ready)."""
        message, self._unsent = self._unsent, None
        if message is not None:
            return message
        message = next(self._queued, None)
        if message is None and self._paged is not None:
            return self._paged.take()
        return message

    def unsend(self, message: WireMessage) -> None:
        """``message``, just taken, waits for credit: ``next`` gives it again."""
        self._unsent = message

    @property
    def done(self) -> bool:
        """After ``next`` gave None: whether that is the end."""
        return self._paged is None or self._paged.done

    def close(self) -> None:
        if self._paged is not None:
            self._paged.close()


#: Makes the pager of a queue: (queue name, called when paged messages are ready to read) → Pager.
PagerFactory = Callable[[str, Callable[[], None]], Pager]

#: Messages read back from a page file per step.
DEPAGE_CHUNK = 256


class DeliverySink(Protocol):
    """Where a queue reports what happened to a message (the broker: store, audit, counters)."""

    def on_acked(self, queue: Queue, message: WireMessage) -> None: ...
    def deliver_durable(self, queue: Queue, attempts: list[tuple[Consumer, int, WireMessage]]) -> None: ...
    def on_expired(self, queue: Queue, message: WireMessage) -> None: ...
    def on_pages_ready(self, queue: Queue) -> None: ...
    def on_delivered(self, queue: Queue, consumer: Consumer, delivery_count: int, message: WireMessage) -> None: ...
    def on_browse_done(self, queue: Queue, consumer: Consumer) -> None: ...
    def on_scan_cut(self, queue: Queue) -> None: ...  # dispatch it again at the next tick: its scan goes on


class Consumer:
    """A subscription's window: ``credit`` deliveries and, when its link asked for a byte window, ``byte_credit``
    body bytes. A delivery that uses the last of the bytes parks the message credit (``credit`` 0: every
    dispatch path skips the consumer as it is) until FLOW returns bytes."""

    __slots__ = (
        "auto_ack",
        "browse",
        "browse_iter",
        "byte_credit",
        "byte_window",
        "counts",
        "credit",
        "forwarder",
        "held",
        "id",
        "in_flight",
        "parked_credit",
        "queue",
        "selector",
        "session",
    )

    def __init__(
        self,
        consumer_id: int,
        session: LinkSession,
        queue: Queue,
        credit: int,
        *,
        selector: Selector | None = None,
        auto_ack: bool = False,
        browse: bool = False,
    ) -> None:
        self.id = consumer_id
        self.session = session
        self.queue = queue
        self.credit = credit
        self.selector = selector
        self.auto_ack = auto_ack
        self.browse = browse
        self.browse_iter: Browse | None = None
        self.in_flight = _NO_IN_FLIGHT
        self.counts = _NO_COUNTS  # delivery count of in-flight messages delivered more than once
        self.forwarder = False  # moves messages to another node (cluster): not a consumer of a client
        self.byte_window = 0  # 0: the window is in messages only
        self.byte_credit = 0
        self.parked_credit = 0  # message credit held back while the byte credit is used up
        # Deliveries waiting for a delivery attempt's record to be safe (see ``Queue._deliver``): the next wait too.
        self.held = 0

    def limit_bytes(self, window: int) -> None:
        """Bound the window in body bytes too (``credit_bytes`` of a version 2 SUBSCRIBE)."""
        self.byte_window = self.byte_credit = window

    def spend_bytes(self, size: int) -> None:
        """A delivery of a body of ``size`` bytes went out (a byte-bounded consumer)."""
        self.byte_credit -= size
        if self.byte_credit <= 0:
            self.parked_credit += self.credit
            self.credit = 0

    def add_credit(self, credit: int, credit_bytes: int, cap: int) -> None:
        """FLOW: more deliveries (at most ``cap`` in all) and, for a byte-bounded consumer, more bytes."""
        was_ready = self.credit > 0
        if not self.byte_window:
            self.credit = min(self.credit + credit, cap)
        else:
            total = min(self.credit + self.parked_credit + credit, cap)
            self.byte_credit = min(self.byte_credit + credit_bytes, self.byte_window)
            if self.byte_credit > 0:
                self.credit, self.parked_credit = total, 0
            else:
                self.credit, self.parked_credit = 0, total
        if not was_ready and self.credit > 0:
            self.queue.scan_from_head()  # it may take what a cut scan passed over without it

    def accepts(self, message: WireMessage) -> bool:
        return self.selector is None or self.selector.matches(selector_view(message))


class Queue:
    __slots__ = (
        "_activity",
        "_attempts",
        "_changes",
        "_count",
        "_dirty",
        "_expiring",
        "_groups",
        "_high",
        "_in_flight",
        "_levels",
        "_lvq",
        "_memory",
        "_page_limit",
        "_paged",
        "_paged_bytes",
        "_pager",
        "_pager_factory",
        "_returned",
        "_rr",
        "_scan_from",
        "_sink",
        "_superseded",
        "acked",
        "added",
        "address",
        "auto_created",
        "auto_delete",
        "bytes",
        "consumers",
        "dead_lettered",
        "delivered",
        "durable",
        "exclusive",
        "expired",
        "expires_ms",
        "filter",
        "last_value_key",
        "max_consumers",
        "name",
        "owner",
        "paused",
        "routing_type",
        "temporary",
    )

    def __init__(
        self,
        name: str,
        address: str,
        routing_type: RoutingType,
        *,
        sink: DeliverySink,
        dirty: set[LinkSession],
        memory: MemoryGauge,
        activity: QueueActivity,
        durable: bool = False,
        filter: Selector | None = None,
        temporary: bool = False,
        exclusive: bool = False,
        last_value_key: str | None = None,
        max_consumers: int = -1,
        auto_created: bool = False,
        auto_delete: bool = False,
        expires_ms: int = -1,
        owner: LinkSession | None = None,
        page_limit: int = -1,
        pager_factory: PagerFactory | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self.routing_type = routing_type
        self.durable = durable
        self.filter = filter
        self.temporary = temporary
        self.exclusive = exclusive
        self.last_value_key = last_value_key  # "" = the message's own last-value key field
        self.max_consumers = max_consumers
        self.auto_created = auto_created
        self.auto_delete = auto_delete
        self.expires_ms = expires_ms  # deleted after this long without consumers; -1 = never
        self.owner = owner
        self.paused = False  # an operator paused it: it takes messages in and delivers none
        self.consumers: list[Consumer] = []
        self.added = self.acked = self.delivered = self.expired = self.dead_lettered = 0
        self.bytes = 0  # accounted size of the messages this queue owns (queued and in flight)
        self._sink = sink
        self._dirty = dirty
        self._memory = memory
        self._activity = activity
        self._changes = activity.changed.noted
        self._attempts = _NO_ATTEMPTS  # a dispatch's durable deliveries
        # Paging: above page_limit bytes (the address's max_size_bytes with policy PAGE) further messages
        # go to a page file, and keep going there while any are paged, so order is kept.
        self._page_limit = page_limit if pager_factory is not None else -1
        self._pager_factory = pager_factory
        self._pager: Pager | None = None
        self._paged = 0
        self._paged_bytes = 0
        self._levels = _NO_LEVELS
        self._high = 0
        self._count = 0
        self._in_flight = 0  # messages its consumers hold unsettled (kept, not summed over them each time)
        self._expiring = 0
        self._rr = 0
        # Where a scan cut at SCAN_LIMIT goes on (priority, messages of that level passed over): the levels above
        # and those messages held nothing the ready consumers take. Forgotten when that may change.
        self._scan_from: tuple[int, int] | None = None
        self._returned = _NO_COUNTS  # delivery counts of the queued messages delivered before
        self._groups = _NO_GROUPS
        self._lvq = _NO_LAST_VALUES if last_value_key is None else {}
        # Ids of messages replaced by a newer value while out (in flight, a delayed redelivery): dropped when
        # they come back, even once the newer one is gone too (the key then says nothing about them).
        self._superseded = _NO_SUPERSEDED

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        return self._count + self._paged

    @property
    def paged(self) -> int:
        return self._paged

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def timed(self) -> bool:
        """Whether it holds messages that may expire, or paged ones (see ``QueueActivity.timed``)."""
        return bool(self._expiring or self._paged)

    def accepts(self, message: WireMessage) -> bool:
        return self.filter is None or self.filter.matches(selector_view(message))

    def messages(self) -> Iterator[WireMessage]:
        """Queued (not in-flight) messages in delivery order."""
        for level in range(MAX_PRIORITY, -1, -1):
            yield from self._levels[level]

    def browse_messages(self) -> Iterator[tuple[WireMessage, int, str]]:
        """What the queue holds, for an operator: (message, delivery count so far, state), the queued messages
        in delivery order, then those in flight, then those in the page file (``queued``/``in_flight``/``paged``)."""
        for message in self.messages():
            yield message, self._returned.get(message[M_ID], 0), "queued"
        for consumer in self.consumers:
            for message_id, message in consumer.in_flight.items():
                yield message, consumer.counts.get(message_id, 1), "in_flight"
        if self._pager is not None and self._paged:
            returned = self._returned  # a message restored with attempts may be paged: it keeps its count
            for message in self._pager.peek():
                yield message, returned.get(message[M_ID], 0), "paged"

    def live_messages(self) -> Iterator[tuple[WireMessage, int]]:
        """Every message this queue still owes, queued or in flight, with its delivery count so far."""
        for message in self.messages():
            yield message, self._returned.get(message[M_ID], 0)
        for consumer in self.consumers:
            for message_id, message in consumer.in_flight.items():
                yield message, consumer.counts.get(message_id, 1)
        if self._pager is not None and self._paged:
            # A message restored with attempts (recovery, a move, a forward taken back) may be paged: its count
            # is kept with the others, and a compaction's copy must keep it, or its redelivery goes unflagged.
            returned = self._returned
            for message in self._pager.peek():
                yield message, returned.get(message[M_ID], 0)

    @property
    def paging(self) -> bool:
        """Whether a message added now goes to the page files."""
        return self._page_limit >= 0 and (self._paged > 0 or self.bytes >= self._page_limit)

    # ------------------------------------------------------------------ adding
    def add(self, message: WireMessage) -> None:
        if self._page_limit >= 0 and (self._paged or self.bytes >= self._page_limit):
            self._page(message)
            return
        self._keep(message)

    def _page(self, message: WireMessage) -> None:
        pager = self._pager
        if pager is None:
            assert self._pager_factory is not None
            pager = self._pager = self._pager_factory(self.name, lambda: self._sink.on_pages_ready(self))
        pager.append(message)
        self._paged += 1
        self._paged_bytes += len(message[M_BODY]) + MESSAGE_OVERHEAD
        self.added += 1
        self._changes.add(self)
        if self._paged == 1:
            self._activity.timed.add(self)

    def _depage(self) -> None:
        """Read paged messages back while the queue holds less than half its limit."""
        low = max(self._page_limit // 2, 1)
        pager = self._pager
        while self._paged and pager is not None and self.bytes < low:
            # Read about as many as fit under the limit (by the average paged size), at least one.
            average = max(self._paged_bytes // self._paged, 1)
            batch = pager.read(max(1, min(DEPAGE_CHUNK, (self._page_limit - self.bytes) // average)))
            if not batch:
                return  # still being read from disk: on_pages_ready brings us back
            self._paged -= len(batch)
            for message in batch:
                self._paged_bytes -= len(message[M_BODY]) + MESSAGE_OVERHEAD
                self._keep(message)
                self.added -= 1  # counted once, when it was paged

    def _keep(self, message: WireMessage) -> None:
        if self.last_value_key is not None:
            self._replace_last_value(message)
        priority = message[M_PRIORITY]
        scan_from = self._scan_from
        if scan_from is not None and priority > scan_from[0]:  # where a cut scan would not look again
            self._scan_from = None
        level = self._levels[priority]
        if level is _UNUSED_LEVEL:
            self._start_level(priority, message)
        else:
            level.append(message)
        if priority > self._high:  # noqa: PLR1730 - max() is a builtin call per message
            self._high = priority
        self._count += 1
        self.added += 1
        size = len(message[M_BODY]) + MESSAGE_OVERHEAD
        self._memory.used += size
        self.bytes += size
        self._changes.add(self)
        if message[M_EXPIRATION]:
            self._expiring += 1
            if self._expiring == 1:
                self._activity.timed.add(self)

    def _lvq_key(self, message: WireMessage) -> Any:
        if self.last_value_key:
            return message[M_PROPS].get(self.last_value_key)
        return message[M_LVQ]

    def _replace_last_value(self, message: WireMessage) -> None:
        key = self._lvq_key(message)
        if key is None:
            return
        previous = self._lvq.get(key)
        if previous is not None:
            try:
                self._levels[previous[M_PRIORITY]].remove(previous)
            except (ValueError, AttributeError):  # out (its level may be unused again): dropped if it comes back
                if self._superseded is _NO_SUPERSEDED:
                    self._superseded = set()
                self._superseded.add(previous[M_ID])
            else:
                self._count -= 1
                self._scan_from = None  # the messages passed over moved
                self._forget(previous)
                self._returned.pop(previous[M_ID], None)
                self.acked += 1
                self._sink.on_acked(self, previous)  # superseded: gone for good, like an ack
        self._lvq[key] = message

    def _start_level(self, priority: int, message: WireMessage) -> None:
        """The first message of a level: its deque, and the queue's own list of levels at its first message."""
        if self._levels is _NO_LEVELS:
            self._levels = list(_NO_LEVELS)
        self._levels[priority] = deque((message,))

    def _expired(self, message: WireMessage) -> None:
        """A queued message found expired as it was taken out to be delivered: gone, with its redelivery count."""
        if self._returned:
            self._returned.pop(message[M_ID], None)
        self._forget(message)
        self._sink.on_expired(self, message)

    def _drained(self) -> None:
        """No message is queued any more: an idle queue keeps no deque (600 bytes each) nor list of levels."""
        self._levels = _NO_LEVELS

    def _pop_level(self) -> None:
        """Move ``_high`` down to the highest non-empty priority (callers know one exists)."""
        levels = self._levels
        while not levels[self._high]:
            self._high -= 1

    def _forget(self, message: WireMessage) -> None:
        """A message leaves this queue for good (acked, expired, dead-lettered, superseded, purged)."""
        size = len(message[M_BODY]) + MESSAGE_OVERHEAD
        self._memory.used -= size
        self.bytes -= size
        self._changes.add(self)
        if message[M_EXPIRATION]:
            self._expiring -= 1
        if self._lvq and self._lvq.get(self._lvq_key(message)) is message:
            del self._lvq[self._lvq_key(message)]
        if self._superseded:
            self._superseded.discard(message[M_ID])
            if not self._superseded:
                self._superseded = _NO_SUPERSEDED

    def restore(self, message: WireMessage, delivery_count: int) -> None:
        """Add a message that was delivered ``delivery_count`` times before (recovered from the journal, moved
        from another node, routed again), so that its next delivery counts on from there."""
        self.add(message)
        if delivery_count > 0:
            self._count_returned(message[M_ID], delivery_count)

    def return_message(self, message: WireMessage, delivery_count: int) -> None:
        """Put a message back at the head of its priority (after nack, release, close, rollback)."""
        if self._superseded and message[M_ID] in self._superseded:
            # A newer value for its key arrived while it was out: superseded, as in _replace_last_value.
            self._forget(message)
            self.acked += 1
            self._sink.on_acked(self, message)
            return
        priority = message[M_PRIORITY]
        level = self._levels[priority]
        if level is _UNUSED_LEVEL:
            self._start_level(priority, message)
        else:
            level.appendleft(message)
        self._scan_from = None  # before what a cut scan passed over
        if priority > self._high:  # noqa: PLR1730 - max() is a builtin call per message
            self._high = priority
        self._count += 1
        self._changes.add(self)
        if delivery_count > 0:
            self._count_returned(message[M_ID], delivery_count)

    def _count_returned(self, message_id: int, delivery_count: int) -> None:
        if self._returned is _NO_COUNTS:
            self._returned = {}
        self._returned[message_id] = delivery_count

    def remove_where(self, predicate: Callable[[WireMessage], bool]) -> list[WireMessage]:
        """Take out the queued messages matching ``predicate`` (expiry scan, management)."""
        self._scan_from = None  # the messages passed over may move
        taken: list[WireMessage] = []
        for level in self._levels:
            if not level:
                continue
            keep = [m for m in level if not predicate(m) or taken.append(m)]  # type: ignore[func-returns-value]
            level.clear()
            level.extend(keep)
        self._count -= len(taken)
        if not self._count:
            self._drained()
        for message in taken:
            self._returned.pop(message[M_ID], None)
            self._forget(message)
        return taken

    def take_all(self) -> list[tuple[WireMessage, int]]:
        """Take out every queued message, each with the delivery attempts it had (0: none)."""
        returned = self._returned
        counts = dict(returned) if returned else None
        taken = self.remove_where(lambda _m: True)
        if counts is None:
            return [(message, 0) for message in taken]
        return [(message, counts.get(message[M_ID], 0)) for message in taken]

    def expire_due(self, now_ms: int) -> None:
        if self._expiring:
            for message in self.remove_where(lambda m: 0 < m[M_EXPIRATION] <= now_ms):
                self._sink.on_expired(self, message)

    def purge(self) -> list[WireMessage]:
        if self._pager is not None:
            self._pager.close()
            self._pager = None
            self._paged = self._paged_bytes = 0
        return self.remove_where(lambda _m: True)

    # ------------------------------------------------------------------ consumers
    def scan_from_head(self) -> None:
        """The next scan looks at every message again: a consumer came, went or got credit."""
        self._scan_from = None

    def add_consumer(self, consumer: Consumer) -> None:
        self._scan_from = None
        if consumer.browse:
            paged = self._pager.browse() if self._pager is not None and self._paged else None
            consumer.browse_iter = Browse(self._browsed(consumer.selector), paged)
        self.consumers.append(consumer)

    def _browsed(self, selector: Selector | None) -> list[WireMessage]:
        """What a browser is offered from memory: the queued messages in delivery order (the paged ones follow,
        see ``Browse``). On a last-value queue keyed on the
        one property the selector must equal, only that key's message, found by key: an MQTT SUBSCRIBE browses
        the retained messages this way, and a scan of 100,000 of them per device is what it must not cost."""
        key = self.last_value_key
        equals = selector.equals if selector is not None else None
        if (
            equals is not None
            and key
            and equals[0] == key
            and key not in SELECTOR_HEADERS
            and not self._paged  # a paged message is not keyed yet
            and not self._in_flight  # so every keyed message is queued
        ):
            message = self._lvq.get(equals[1])
            return [] if message is None else [message]
        return list(self.messages())

    def remove_consumer(self, consumer: Consumer, keep: frozenset[int] = frozenset()) -> list[tuple[WireMessage, int]]:
        """Detach a consumer and hand back its unacknowledged messages with their delivery counts, newest
        first (returning them in that order to the head of the queue restores their order). Those in ``keep``
        (acknowledged in a transaction still open) stay in flight with it, for the commit to settle or the
        rollback to give back."""
        self.consumers.remove(consumer)
        self._scan_from = None  # the groups it owned are free
        if consumer.browse_iter is not None:
            consumer.browse_iter.close()  # the page files it still needed may go
            consumer.browse_iter = None
        for group, owner in list(self._groups.items()):
            if owner is consumer:
                del self._groups[group]
        in_flight, counts = consumer.in_flight, consumer.counts
        unacked = [(in_flight[i], counts.get(i, 1)) for i in sorted(in_flight, reverse=True) if i not in keep]
        self._in_flight -= len(unacked)
        if len(unacked) < len(in_flight):
            consumer.in_flight = {i: message for i, message in in_flight.items() if i in keep}
            consumer.counts = {i: count for i, count in counts.items() if i in keep} or _NO_COUNTS
        else:
            consumer.in_flight = _NO_IN_FLIGHT
            consumer.counts = _NO_COUNTS
        return unacked

    def take(self, consumer: Consumer, message_id: int) -> tuple[WireMessage, int] | None:
        """Remove an in-flight message from ``consumer``: (message, delivery count), None if unknown."""
        in_flight = consumer.in_flight
        message = in_flight.pop(message_id, None)
        if message is None:
            return None
        self._in_flight -= 1
        if not in_flight:  # a dict keeps its table when emptied: an idle consumer holds the shared empty one
            consumer.in_flight = _NO_IN_FLIGHT
        return message, consumer.counts.pop(message_id, 1)

    def settle(self, message: WireMessage) -> None:
        """An in-flight message is done with (acked, dead-lettered, expired)."""
        self._forget(message)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, now_ms: int) -> None:
        if self._paged:
            self._depage()
        if not self.consumers:
            return
        if self._count and not self.paused:
            ready = [c for c in self.consumers if c.credit > 0 and not c.browse]
            if self.exclusive:
                ready = ready[:1] if ready and ready[0] is self._exclusive_owner() else []
            if ready:
                if self._groups or any(c.selector is not None for c in ready):
                    self._dispatch_scan(ready, now_ms)
                else:
                    self._dispatch_fast(ready, now_ms)
                self._record_attempts()
                if not self._count:
                    self._drained()
        for consumer in self.consumers:
            if consumer.browse and consumer.browse_iter is not None:
                self._browse(consumer, now_ms)  # without credit too: its end needs none

    def _record_attempts(self) -> None:
        """Hand the durable deliveries collected so far to the sink: one record for all of them, and they go
        out once it is on disk."""
        if self._attempts:
            attempts, self._attempts = self._attempts, _NO_ATTEMPTS
            self._sink.deliver_durable(self, attempts)

    def _exclusive_owner(self) -> Consumer | None:
        return next((c for c in self.consumers if not c.browse), None)

    def _dispatch_fast(self, ready: list[Consumer], now_ms: int) -> None:
        self._scan_from = None  # it takes from the head
        rr = self._rr
        deliver = self._deliver
        while ready and self._count:
            level = self._levels[self._high]
            if not level:
                self._pop_level()
                continue
            message = level.popleft()
            self._count -= 1
            expiration = message[M_EXPIRATION]
            if expiration and expiration <= now_ms:
                self._expired(message)
                continue
            if message[M_GROUP] is not None:
                self.return_message(message, 0)
                self._rr = rr
                self._dispatch_scan(ready, now_ms)
                return
            consumer = ready[rr % len(ready)] if len(ready) > 1 else ready[0]
            rr += 1
            deliver(consumer, message)
            if not consumer.credit:
                ready.remove(consumer)
        self._rr = rr

    def _dispatch_scan(self, ready: list[Consumer], now_ms: int) -> None:
        """Deliver what the ready consumers may take, looking at SCAN_LIMIT messages at most; a scan cut there
        goes on after them at the next tick (without outside events, a match further back would wait for ever)."""
        scanned = 0
        start, self._scan_from = self._scan_from, None
        for priority in range(self._high, -1, -1):
            level = self._levels[priority]
            if not level or (start is not None and priority > start[0]):
                continue  # nothing here, or nothing the ready consumers take (a cut scan looked)
            if start is not None and priority == start[0] and start[1]:
                kept = deque(itertools.islice(level, start[1]))  # looked at already: kept in order
                level = deque(itertools.islice(level, start[1], None))
            else:
                kept = deque()
            while level and ready and scanned < SCAN_LIMIT:
                message = level.popleft()
                scanned += 1
                expiration = message[M_EXPIRATION]
                if expiration and expiration <= now_ms:
                    self._count -= 1
                    self._expired(message)
                    continue
                target = self._choose(message, ready)
                if target is None:
                    kept.append(message)
                    continue
                self._count -= 1
                self._deliver(target, message)
                if not target.credit:
                    ready.remove(target)
            passed_over = len(kept)
            kept.extend(level)
            self._levels[priority] = kept or _UNUSED_LEVEL
            if not ready:
                return
            if scanned >= SCAN_LIMIT:
                self._scan_from = (priority, passed_over)
                self._sink.on_scan_cut(self)
                return

    def _choose(self, message: WireMessage, ready: list[Consumer]) -> Consumer | None:
        group = message[M_GROUP]
        if group is not None:
            owner = self._groups.get(group)
            if owner is not None:
                return owner if owner in ready and owner.accepts(message) else None
        count = len(ready)
        for i in range(count):
            candidate = ready[(self._rr + i) % count]
            if candidate.accepts(message):
                self._rr += i + 1
                if group is not None:
                    if self._groups is _NO_GROUPS:
                        self._groups = {}
                    self._groups[group] = candidate
                return candidate
        return None

    def _deliver(self, consumer: Consumer, message: WireMessage) -> None:
        message_id = message[M_ID]
        count = self._returned.pop(message_id, 0) + 1 if self._returned else 1
        consumer.credit -= 1
        if consumer.byte_window:
            consumer.spend_bytes(len(message[M_BODY]))
        self.delivered += 1
        session = consumer.session
        if not consumer.forwarder:  # a forwarder's take is audited as forwarded or redistributed
            self._sink.on_delivered(self, consumer, count, message)
        if not consumer.auto_ack:  # in flight first: a delivery held for the disk is sent only if it still is
            if consumer.in_flight is _NO_IN_FLIGHT:
                consumer.in_flight = {}
            consumer.in_flight[message_id] = message
            self._in_flight += 1
            if count > 1:
                if consumer.counts is _NO_COUNTS:
                    consumer.counts = {}
                consumer.counts[message_id] = count
        # A durable message goes out once its delivery attempt is recorded (on disk, and at the backup): a copy
        # that a crash or failover leaves comes back flagged as redelivered. So does a forwarder's move: what a
        # redistributor moves may be delivered over there, and a store-and-forward copy sent before it was
        # safe here (its producer unconfirmed) could reach the other node while its producer's re-send was
        # routed again after a failover: two copies, neither flagged.
        # A message for a consumer with deliveries waiting so waits behind them, recorded or not: FIFO per consumer
        # (non-durable messages overtook the durable ones sent before them, by up to a window).
        if not consumer.auto_ack and (consumer.held or (self.durable and message[M_DURABLE])):
            if self._attempts is _NO_ATTEMPTS:
                self._attempts = []
            self._attempts.append((consumer, count, message))  # sent once the attempt is on disk
            consumer.held += 1
        else:
            if self._attempts:  # they come first: with nothing to wait for (no journal), they go out first
                self._record_attempts()
            session.conn.deliver(consumer.id, count, message)
            if session not in self._dirty:
                self._dirty.add(session)
        if consumer.auto_ack:
            self._forget(message)
            self.acked += 1
            self._sink.on_acked(self, message)

    def _browse(self, consumer: Consumer, now_ms: int) -> None:
        """Send a browser what its credit allows, and BROWSE_DONE once nothing is left, also when its last
        credit took the last message: an end needs no credit, and it would wait for a FLOW."""
        browse_iter = consumer.browse_iter
        assert browse_iter is not None
        session = consumer.session
        sent = False
        while True:
            message = browse_iter.next()
            if message is None:
                if browse_iter.done:
                    consumer.browse_iter = None
                    session.conn.browse_done(consumer.id)
                    self._sink.on_browse_done(self, consumer)
                    sent = True
                break  # else paged messages are being read for it: on_pages_ready brings it back
            expiration = message[M_EXPIRATION]
            if (expiration and expiration <= now_ms) or not consumer.accepts(message):
                continue
            if consumer.credit <= 0:
                browse_iter.unsend(message)  # one to send: not the end
                break
            consumer.credit -= 1
            if consumer.byte_window:
                consumer.spend_bytes(len(message[M_BODY]))
            session.conn.deliver(consumer.id, 1, message)
            sent = True
        if sent:
            self._dirty.add(session)
