"""Jepsen's total-queue checker, as a pure function over what a test recorded.

A run records, for every value a producer tried to publish, whether the broker acknowledged it (a publish
confirm, STOMP RECEIPT, MQTT PUBACK/PUBCOMP, AMQP ``accepted``), definitely rejected it, or left the outcome
unknown (a timeout, a dropped connection); and every delivery the consumers saw, in order, duplicates
included, each with the broker's redelivered flag. :func:`check` turns that into a :class:`Verdict`:

- ``lost``: acknowledged but never delivered (must be empty);
- ``unexpected``: delivered but never attempted (must be empty);
- ``rejected_delivered``: definitely rejected, yet delivered (must be empty);
- ``contradicted``: both acknowledged and rejected (must be empty: the broker said two things);
- ``duplicated``: delivered more than once; every delivery after the first should carry the redelivered flag,
  and those that do not are counted apart. "After" is the order the consumers recorded them in, with one
  exception (``race_s``): an unflagged delivery recorded less than ``race_s`` after a flagged delivery of the
  same stored copy (one node's message id) to another consumer, or to the same consumer over another of its
  connections, was sent first, since a node's delivery count of a copy only grows; the first connection's
  client just recorded it late (its connection closed right after, say, and the node redelivered the copy to
  the other consumer, or to the consumer's next connection, at once). Copies on two nodes, two unflagged
  deliveries and one connection's own order are always taken as recorded;
- ``recovered``: outcome unknown, yet delivered (allowed, reported).

:func:`compare_nodes` checks the split-brain guarantee after healing: no node may hold an acknowledged value
that the active node of its pair lacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V", bound=Hashable)

EXAMPLES = 10  # at most this many example values per anomaly in a report


@dataclass(frozen=True)
class Delivery(Generic[V]):
    """One delivery a consumer saw; a plain value in the delivered sequence means ``redelivered=False``."""

    value: V
    redelivered: bool = False
    consumer: str = ""  # who saw it (one name for all the connections of one consumer, one after another)
    copy: str = ""  # which stored copy: the node's message id, when the client sees it
    at: float | None = None  # when it was recorded: seconds, on one clock for the whole run
    connection: str = ""  # which of the consumer's connections, for a client that reads each on a thread of its own


def _sent_first(earlier: Delivery[V], later: Delivery[V], race_s: float) -> bool:
    """Whether ``later``, unflagged, was sent before ``earlier``, flagged, though recorded after it: the same
    copy (whose delivery count only grows), another consumer or connection, recorded less than ``race_s`` apart."""
    return (
        race_s > 0
        and earlier.redelivered
        and (earlier.consumer, earlier.connection) != (later.consumer, later.connection)
        and earlier.copy != ""
        and earlier.copy == later.copy
        and earlier.at is not None
        and later.at is not None
        and 0 <= later.at - earlier.at < race_s
    )


@dataclass(frozen=True)
class Verdict(Generic[V]):
    """What a total-queue run did; ``ok`` is True when none of the must-be-empty anomalies occurred."""

    attempted: int
    acknowledged: int
    rejected: int
    unknown: int  # attempted, neither acknowledged nor rejected
    deliveries: int  # every delivery, duplicates included
    distinct_delivered: int
    lost: frozenset[V]
    unexpected: frozenset[V]
    rejected_delivered: frozenset[V]
    contradicted: frozenset[V]
    duplicated: frozenset[V]  # values delivered more than once
    duplicate_deliveries: int  # deliveries after the first of their value
    unflagged_duplicates: int  # of those, how many did not carry the redelivered flag
    unflagged_duplicated: frozenset[V]  # values with at least one unflagged duplicate
    recovered: frozenset[V]  # outcome unknown, yet delivered

    @property
    def ok(self) -> bool:
        """No acknowledged value lost, nothing unexpected, nothing rejected delivered, no contradiction."""
        return not (self.lost or self.unexpected or self.rejected_delivered or self.contradicted)

    @property
    def redelivery_flags_ok(self) -> bool:
        """Every duplicate delivery carried the redelivered flag (guarantee 1's second half)."""
        return self.unflagged_duplicates == 0

    def report(self) -> str:
        """A short human summary, with up to ten example values of each anomaly."""
        status = "OK" if self.ok else "FAILED"
        if self.ok and not self.redelivery_flags_ok:
            status = "OK (but duplicates without the redelivered flag)"
        lines = [
            f"total-queue check: {status}",
            (
                f"  attempted {self.attempted}: acknowledged {self.acknowledged}, rejected {self.rejected}, "
                f"unknown {self.unknown}"
            ),
            f"  delivered {self.deliveries} ({self.distinct_delivered} distinct)",
            _anomaly("lost (acknowledged, never delivered)", self.lost),
            _anomaly("unexpected (delivered, never attempted)", self.unexpected),
            _anomaly("rejected but delivered", self.rejected_delivered),
            _anomaly("both acknowledged and rejected", self.contradicted),
            _anomaly(
                f"duplicated ({self.duplicate_deliveries} extra deliveries, "
                f"{self.unflagged_duplicates} without the redelivered flag)",
                self.duplicated,
            ),
        ]
        if self.unflagged_duplicated:
            lines.append(_anomaly("duplicated without the redelivered flag", self.unflagged_duplicated))
        lines.append(_anomaly(f"recovered (outcome unknown, delivered; of {self.unknown} unknown)", self.recovered))
        return "\n".join(lines)


def check(
    attempted: Iterable[V],
    acknowledged: Iterable[V],
    rejected: Iterable[V],
    delivered: Iterable[V | Delivery[V]],
    race_s: float = 0.0,
) -> Verdict[V]:
    """Check one total-queue run.

    ``acknowledged`` and ``rejected`` must be subsets of ``attempted`` (anything else is a bug in the test's
    bookkeeping, so it raises ``ValueError``). ``delivered`` is every delivery in the order consumers saw them:
    plain values (not flagged redelivered) or :class:`Delivery` records. ``race_s``: how long after another
    consumer's flagged delivery of the same copy an unflagged one may be recorded and still be its first (0:
    never, the order recorded is the order sent).
    """
    attempted_set = frozenset(attempted)
    acknowledged_set = frozenset(acknowledged)
    rejected_set = frozenset(rejected)
    for name, values in (("acknowledged", acknowledged_set), ("rejected", rejected_set)):
        stray = values - attempted_set
        if stray:
            raise ValueError(f"{name} values that were never attempted: {_examples(stray)}")

    counts: Counter[V] = Counter()
    seen: dict[V, list[Delivery[V]]] = {}
    unflagged_duplicates = 0
    unflagged_duplicated: set[V] = set()
    for item in delivered:
        delivery = item if isinstance(item, Delivery) else Delivery(item)
        value = delivery.value
        counts[value] += 1
        earlier = seen.setdefault(value, [])
        if not delivery.redelivered and not all(_sent_first(e, delivery, race_s) for e in earlier):
            unflagged_duplicates += 1
            unflagged_duplicated.add(value)
        earlier.append(delivery)
    delivered_set = frozenset(counts)
    unknown_set = attempted_set - acknowledged_set - rejected_set
    duplicated = frozenset(value for value, count in counts.items() if count > 1)
    deliveries = sum(counts.values())
    return Verdict(
        attempted=len(attempted_set),
        acknowledged=len(acknowledged_set),
        rejected=len(rejected_set),
        unknown=len(unknown_set),
        deliveries=deliveries,
        distinct_delivered=len(delivered_set),
        lost=acknowledged_set - delivered_set,
        unexpected=delivered_set - attempted_set,
        rejected_delivered=rejected_set & delivered_set,
        contradicted=acknowledged_set & rejected_set,
        duplicated=duplicated,
        duplicate_deliveries=deliveries - len(delivered_set),
        unflagged_duplicates=unflagged_duplicates,
        unflagged_duplicated=frozenset(unflagged_duplicated),
        recovered=unknown_set & delivered_set,
    )


@dataclass(frozen=True)
class NodeComparison(Generic[V]):
    """Acknowledged values that a non-active node holds and the active node of its pair lacks."""

    active: Mapping[str, str]  # pair -> its active node
    missing: Mapping[str, Mapping[str, frozenset[V]]] = field(default_factory=dict)  # pair -> node -> values

    @property
    def ok(self) -> bool:
        return not any(values for nodes in self.missing.values() for values in nodes.values())

    @property
    def missing_values(self) -> frozenset[V]:
        """Every acknowledged value missing on the active node of some pair that holds it elsewhere."""
        return frozenset(value for nodes in self.missing.values() for values in nodes.values() for value in values)

    def report(self) -> str:
        if self.ok:
            return "node comparison: OK (no acknowledged value held only by a non-active node)"
        lines = [f"node comparison: FAILED ({len(self.missing_values)} acknowledged values missing on active nodes)"]
        for pair, nodes in sorted(self.missing.items()):
            for node, values in sorted(nodes.items()):
                if values:
                    lines.append(
                        _anomaly(f"pair {pair}: on {node}, not on active {self.active[pair]}", values),
                    )
        return "\n".join(lines)


def compare_nodes(
    held: Mapping[str, Iterable[V]],
    pairs: Mapping[str, Collection[str]],
    active: Mapping[str, str],
    acknowledged: Iterable[V],
) -> NodeComparison[V]:
    """Split-brain check after healing.

    ``held`` maps each node to the values it holds (or delivered) after healing; a node missing from it holds
    nothing. ``pairs`` maps each pair to its nodes, ``active`` each pair to its active node. Reports, per pair
    and non-active node, the acknowledged values that node holds and the active node does not.
    """
    acknowledged_set = frozenset(acknowledged)
    missing: dict[str, dict[str, frozenset[V]]] = {}
    for pair, nodes in pairs.items():
        if pair not in active:
            raise ValueError(f"no active node given for pair {pair!r}")
        if active[pair] not in nodes:
            raise ValueError(f"active node {active[pair]!r} is not a member of pair {pair!r}: {sorted(nodes)}")
        on_active = frozenset(held.get(active[pair], ()))
        per_node: dict[str, frozenset[V]] = {}
        for node in nodes:
            if node == active[pair]:
                continue
            only_here = (frozenset(held.get(node, ())) & acknowledged_set) - on_active
            if only_here:
                per_node[node] = only_here
        if per_node:
            missing[pair] = per_node
    stray = set(active) - set(pairs)
    if stray:
        raise ValueError(f"active nodes given for unknown pairs: {sorted(stray)}")
    return NodeComparison(active=dict(active), missing=missing)


def _sorted(values: Iterable[V]) -> list[V]:
    items = list(values)
    try:
        return sorted(items)  # type: ignore[type-var]  # Hashable values are usually, not always, ordered
    except TypeError:
        return sorted(items, key=repr)


def _examples(values: Collection[V]) -> str:
    shown = ", ".join(repr(value) for value in _sorted(values)[:EXAMPLES])
    more = len(values) - EXAMPLES
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"


def _anomaly(label: str, values: Collection[V]) -> str:
    return f"  {label}: {len(values)}" + (f" e.g. {_examples(values)}" if values else "")
