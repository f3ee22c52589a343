"""Duplicate detection: producer-stamped ids remembered for a time window, bounded in count."""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict, deque

from tridentmq_shared.message import LINK_DEDUP_PREFIX


class DuplicateIdCache:
    """``seen(id, now)`` answers whether ``id`` arrived within the window, and remembers it if not.

    The oldest ids are forgotten through a queue of arrivals, not from the front of the dict: every entry
    deleted there leaves a hole that the next look at the dict's first entry steps over, so a full cache
    (one forgotten per arrival) or a large expiry slowed down without bound (60 µs per message at 300,000
    arrivals into a cache of 100,000, and worse the fuller it was)."""

    def __init__(self, window_ms: int, max_entries: int) -> None:
        self._window_ms = window_ms
        self._max_entries = max_entries
        self._expiry: dict[str, int] = {}  # id → deadline; insertion order is arrival order
        # (deadline, id) in arrival order; an entry whose id was forgotten or seen again since is stale.
        self._order: deque[tuple[int, str]] = deque()
        self._streams = _Streams(window_ms, max_entries)  # the link client's numbered ids

    def __len__(self) -> int:
        """Ids remembered one by one, plus runs of numbered ids."""
        return len(self._expiry) + self._streams.runs

    def seen(self, dedup_id: str, now_ms: int) -> bool:
        if LINK_DEDUP_PREFIX in dedup_id:  # also inside a cluster transfer's id for such a message
            stream, _, number = dedup_id.rpartition(":")
            if _is_number(number):
                return self._streams.seen(stream, int(number), now_ms)
        return self._seen_one(dedup_id, now_ms)

    def remember(self, dedup_id: str, arrived_ms: int) -> None:
        """``seen`` for an id a restart read back, which may be a run ``<stream>:<first>-<last>`` that
        ``entries`` wrote (only here: a client's id of that shape is one id, never a run)."""
        if LINK_DEDUP_PREFIX in dedup_id:
            stream, _, number = dedup_id.rpartition(":")
            first, dash, last = number.partition("-")
            if dash and _is_number(first) and _is_number(last) and int(first) <= int(last):
                self._streams.add_run(stream, int(first), int(last), arrived_ms)
                return
        self.seen(dedup_id, arrived_ms)

    def _seen_one(self, dedup_id: str, now_ms: int) -> bool:
        expiry = self._expiry
        deadline = expiry.get(dedup_id)
        if deadline is not None:
            if deadline > now_ms:
                return True
            del expiry[dedup_id]  # re-inserted below, so it counts as the newest
        deadline = now_ms + self._window_ms
        expiry[dedup_id] = deadline
        self._order.append((deadline, dedup_id))
        if len(expiry) > self._max_entries:
            self._forget_oldest()
        return False

    def forget(self, dedup_id: str) -> None:
        """Undo ``seen`` for a message that was then refused, so a retry is not mistaken for a duplicate."""
        if LINK_DEDUP_PREFIX in dedup_id:
            stream, _, number = dedup_id.rpartition(":")
            if _is_number(number):
                self._streams.forget(stream, int(number))
                return
        self._expiry.pop(dedup_id, None)

    def expire(self, now_ms: int) -> None:
        self._streams.expire(now_ms)
        order, expiry = self._order, self._expiry
        while order and order[0][0] <= now_ms:
            deadline, dedup_id = order.popleft()
            if expiry.get(dedup_id) == deadline:
                del expiry[dedup_id]
        if len(order) > 2 * len(expiry) + 1024:  # mostly stale (ids forgotten or seen again): rebuild
            self._order = deque((deadline, dedup_id) for dedup_id, deadline in expiry.items())

    def _forget_oldest(self) -> None:
        order, expiry = self._order, self._expiry
        while order:
            deadline, dedup_id = order.popleft()
            if expiry.get(dedup_id) == deadline:
                del expiry[dedup_id]
                return

    def entries(self) -> list[tuple[str, int]]:
        """Every remembered id with its arrival time, oldest first (what a restart must remember, through
        ``remember``); numbered ids as runs, ``<stream>:<first>-<last>``, with their stream's last arrival,
        after the others: a restart that keeps fewer keeps them."""
        window = self._window_ms
        return [(dedup_id, deadline - window) for dedup_id, deadline in self._expiry.items()] + self._streams.entries()


def _is_number(text: str) -> bool:
    """Written as the link client writes its numbers: ASCII digits, no leading zero, at most 18 of them
    (``int`` takes other digits too, and "007" would be 7)."""
    return text.isascii() and text.isdigit() and len(text) <= 18 and (text[0] != "0" or text == "0")


class _Stream:
    """The numbers seen from one producer: sorted, disjoint runs [first, last] in two lists. Its numbers
    usually arrive in order, so they make one run that grows at its end."""

    __slots__ = ("arrived", "firsts", "lasts")

    def __init__(self) -> None:
        self.firsts: list[int] = []
        self.lasts: list[int] = []
        self.arrived = 0

    def add(self, number: int) -> int:
        """Remember ``number``; returns how many runs that added (-1: it joined two; 0 with ``number``
        already in: check with ``has`` first)."""
        firsts, lasts = self.firsts, self.lasts
        i = bisect_right(firsts, number) - 1  # the run starting at or before it
        if i >= 0 and number <= lasts[i] + 1:
            if number <= lasts[i]:
                return 0
            lasts[i] = number
            if i + 1 < len(firsts) and firsts[i + 1] == number + 1:  # it closed the gap to the next run
                lasts[i] = lasts[i + 1]
                del firsts[i + 1], lasts[i + 1]
                return -1
            return 0
        if i + 1 < len(firsts) and firsts[i + 1] == number + 1:
            firsts[i + 1] = number
            return 0
        firsts.insert(i + 1, number)
        lasts.insert(i + 1, number)
        return 1

    def add_run(self, first: int, last: int) -> int:
        """Remember ``first`` to ``last``, merged with the runs it touches; returns how many runs that added."""
        firsts, lasts = self.firsts, self.lasts
        start = bisect_right(lasts, first - 2)  # the first run that ends at or after first - 1
        end = bisect_right(firsts, last + 1)  # past the last run that starts at or before last + 1
        if start < end:  # it touches runs start..end-1: one run covers them all
            first, last = min(first, firsts[start]), max(last, lasts[end - 1])
        firsts[start:end] = [first]
        lasts[start:end] = [last]
        return 1 - (end - start)

    def has(self, number: int) -> bool:
        lasts = self.lasts
        if lasts and lasts[-1] < number:  # the usual case: a number after all the others
            return False
        i = bisect_right(self.firsts, number) - 1
        return i >= 0 and number <= lasts[i]

    def remove(self, number: int) -> int:
        """Forget ``number``; returns how many runs that added."""
        i = bisect_right(self.firsts, number) - 1
        if i < 0 or number > self.lasts[i]:
            return 0
        first, last = self.firsts[i], self.lasts[i]
        if first == last:
            del self.firsts[i], self.lasts[i]
            return -1
        if number == first:
            self.firsts[i] = number + 1
        elif number == last:
            self.lasts[i] = number - 1
        else:  # split
            self.lasts[i] = number - 1
            self.firsts.insert(i + 1, number + 1)
            self.lasts.insert(i + 1, last)
            return 1
        return 0


class _Streams:
    """Numbered duplicate-detection ids (``<stream>:<number>``, see ``LINK_DEDUP_PREFIX``) as runs of numbers
    per stream: a producer's millionth message costs what its first did, and a restart has a run to copy,
    not a million ids. A stream is forgotten whole ``window_ms`` after its last arrival; with more than
    ``max_runs`` runs, the least recently used streams go first (see ``_forget_oldest``)."""

    def __init__(self, window_ms: int, max_runs: int) -> None:
        self._window_ms = window_ms
        self._max_runs = max_runs
        self._streams: OrderedDict[str, _Stream] = OrderedDict()  # least recently arrived first
        self.runs = 0

    def seen(self, stream: str, number: int, now_ms: int) -> bool:
        streams = self._streams
        numbers = streams.get(stream)
        if numbers is None:
            numbers = streams[stream] = _Stream()
        else:
            lasts = numbers.lasts
            if lasts and lasts[-1] == number - 1:  # the usual case: the producer's next number
                lasts[-1] = number
                streams.move_to_end(stream)
                if now_ms > numbers.arrived:  # noqa: PLR1730 - max() is a builtin call per message
                    numbers.arrived = now_ms
                return False
            if numbers.has(number):
                return True
            streams.move_to_end(stream)
        numbers.arrived = max(numbers.arrived, now_ms)
        self.runs += numbers.add(number)
        if self.runs > self._max_runs:
            self._forget_oldest(numbers)
        return False

    def add_run(self, stream: str, first: int, last: int, now_ms: int) -> None:
        """Remember ``first`` to ``last`` (a restart reading back what ``entries`` wrote)."""
        numbers = self._streams.get(stream)
        if numbers is None:
            numbers = self._streams[stream] = _Stream()
        else:
            self._streams.move_to_end(stream)
        numbers.arrived = max(numbers.arrived, now_ms)
        self.runs += numbers.add_run(first, last)
        if self.runs > self._max_runs:
            self._forget_oldest(numbers)

    def forget(self, stream: str, number: int) -> None:
        numbers = self._streams.get(stream)
        if numbers is not None:
            self.runs += numbers.remove(number)

    def expire(self, now_ms: int) -> None:
        streams, cutoff = self._streams, now_ms - self._window_ms
        while streams:
            stream, numbers = next(iter(streams.items()))
            if numbers.arrived > cutoff:
                return
            del streams[stream]
            self.runs -= len(numbers.firsts)

    def _forget_oldest(self, current: _Stream) -> None:
        """The least recently used streams go first; the one just added to (the most recent) never whole,
        but, when it alone holds too many runs, its oldest half (in one go: deleting from the front of a
        list moves the rest)."""
        streams = self._streams
        while self.runs > self._max_runs:
            numbers = next(iter(streams.values()))
            if numbers is not current:
                streams.popitem(last=False)
                self.runs -= len(numbers.firsts)
                continue
            half = (len(numbers.firsts) + 1) // 2
            del numbers.firsts[:half], numbers.lasts[:half]
            self.runs -= half

    def entries(self) -> list[tuple[str, int]]:
        return [
            (f"{stream}:{first}-{last}", numbers.arrived)
            for stream, numbers in self._streams.items()
            for first, last in zip(numbers.firsts, numbers.lasts, strict=True)
        ]


class TransferIds:
    """``seen(node, number, now)`` answers whether the transfer ``number`` from ``node`` arrived lately, and
    remembers it if not: ``DuplicateIdCache`` for the numbered transfers of non-durable messages between
    nodes, which need not survive a restart (the messages do not).

    The numbers are kept per node in two generations of sets, the older dropped whole: no id string to build
    and no queue entry per transfer, and a node's numbers grow, so they sit side by side in their sets (a
    look-up in a full ``DuplicateIdCache`` took a microsecond, mostly cache misses). A number is remembered
    for at least ``window_ms``, and the newest ``max_entries // 2`` at least, of at most ``max_entries``."""

    def __init__(self, window_ms: int, max_entries: int) -> None:
        self._window_ms = window_ms
        self._generation_size = max(1, max_entries // 2)
        self._current: dict[str, set[int]] = {}
        self._previous: dict[str, set[int]] = {}
        self._size = 0  # numbers in the current generation
        self._started_ms = 0  # when the current generation began

    def __len__(self) -> int:
        return self._size + sum(len(numbers) for numbers in self._previous.values())

    def seen(self, node: str, number: int, now_ms: int) -> bool:
        current = self._current.get(node)
        if current is None:
            current = self._current[node] = set()
        elif number in current:
            return True
        previous = self._previous.get(node)
        if previous is not None and number in previous:
            return True
        current.add(number)
        self._size += 1
        if self._size >= self._generation_size:
            self._next_generation(now_ms)
        return False

    def forget(self, node: str, number: int) -> None:
        """Undo ``seen`` for a transfer that was then refused, so that sending it again is no duplicate."""
        for generation in (self._current, self._previous):
            numbers = generation.get(node)
            if numbers is not None and number in numbers:
                numbers.discard(number)
                if generation is self._current:
                    self._size -= 1

    def expire(self, now_ms: int) -> None:
        if now_ms - self._started_ms >= self._window_ms:
            self._next_generation(now_ms)

    def _next_generation(self, now_ms: int) -> None:
        self._previous, self._current = self._current, {}
        self._size = 0
        self._started_ms = now_ms
