"""The broker's durable state and the journal: rebuilt from what a recovered journal holds, and taken as the
snapshot a journal compaction writes as its new base."""

from __future__ import annotations

from collections.abc import Callable

from tridentmq_core.catalog import Catalog, queue_spec
from tridentmq_core.dedup import DuplicateIdCache
from tridentmq_core.queues import Queue
from tridentmq_core.sessions import Session
from tridentmq_core.store.base import DurableSnapshot
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_core.timers import Timers
from tridentmq_core.write_through import WriteThrough
from tridentmq_shared.message import M_DURABLE, M_ID, M_SCHEDULED, RoutingType, WireMessage


def _nothing_located(where: int) -> WireMessage:
    raise KeyError(where)


class DurableState:
    def __init__(
        self, *, catalog: Catalog, timers: Timers, dedup: DuplicateIdCache, write_through: WriteThrough[Session]
    ) -> None:
        self._catalog = catalog
        self._timers = timers
        self._dedup = dedup
        self._write_through = write_through

    def restore(self, state: RecoveredState, now_ms: int, load: Callable[[int], WireMessage] | None = None) -> int:
        """Rebuild addresses, durable queues and their messages (the store must not record them again: the
        caller swaps in one that does not). Every queue starts idle at ``now_ms``: one with an expiry gets its
        full time again. ``load`` reads back a message of ``state.located`` by its location, as its queue takes
        it (so a paging queue pages it then, and the backlog is never in memory whole). Returns the id the next
        message may have (after the highest recovered one)."""
        catalog = self._catalog
        messages, located = state.messages, state.located
        if load is None:
            if located:
                raise ValueError("the state has messages left in the journal, and nothing to read them back with")
            load = _nothing_located
        for name, (kinds, auto_created) in state.addresses.items():
            catalog.ensure_address(name, {RoutingType(k) for k in kinds}, auto_created=auto_created)
        for name, spec in state.queues.items():
            queue = catalog.create_queue(
                name,
                spec["address"],
                RoutingType(spec["routing_type"]),
                durable=True,
                now_ms=now_ms,
                filter_text=spec.get("filter"),
                exclusive=bool(spec.get("exclusive")),
                last_value_key=spec.get("last_value_key"),
                max_consumers=int(spec.get("max_consumers", -1)),
                auto_created=bool(spec.get("auto_created")),
                auto_delete=bool(spec.get("auto_delete")),
                expires_ms=int(spec.get("expires_ms", -1)),
            )
            # By id, which grows with publish order: a compaction writes the older messages it copies after
            # the ones published while it ran.
            for message_id, count in sorted(state.references.get(name, {}).items()):
                message = messages.get(message_id)
                if message is None:
                    message = load(located[message_id])
                if message[M_SCHEDULED] > now_ms:
                    self._timers.schedule(message[M_SCHEDULED], queue, message, count)  # not due yet
                else:
                    queue.restore(message, count)
        for dedup_id, arrived in state.dedup_ids.items():  # oldest first, acknowledged messages' ones too
            self._dedup.remember(dedup_id, arrived)
        self._write_through.restore(state.through_ids)
        self._dedup.expire(now_ms)
        for address in catalog.addresses.values():  # journals written before auto-delete hold unused ones too
            if address.auto_created and not address.queues:
                catalog.watch_unused_address(address.name, now_ms)
        highest = max((message[M_ID] for message in messages.values()), default=-1)
        return max(highest, max(located, default=-1)) + 1  # a located message's key is its id

    def snapshot(self) -> DurableSnapshot:
        """The live durable state as records would rebuild it: what journal compaction copies forward."""
        catalog = self._catalog
        queues = [q for q in catalog.queues.values() if q.durable]
        messages: dict[int, tuple[WireMessage, list[str], list[int]]] = {}

        def owe(queue: Queue, message: WireMessage, count: int) -> None:
            if message[M_DURABLE]:
                entry = messages.setdefault(message[M_ID], (message, [], []))
                entry[1].append(queue.name)
                entry[2].append(count)

        for queue in queues:
            for message, count in queue.live_messages():
                owe(queue, message, count)
        for held, message, count in self._timers:  # scheduled and delayed redeliveries
            if held is not None and held.durable and catalog.queues.get(held.name) is held:
                owe(held, message, count)
        return DurableSnapshot(
            addresses=[
                (a.name, sorted(int(r) for r in a.routing_types), a.auto_created)
                for a in catalog.addresses.values()
                if a.journaled  # created on purpose, by a publish, or for a durable queue: not only non-durable ones
            ],
            queues=[queue_spec(q) for q in queues],
            messages=list(messages.values()),
            dedup_ids=self._write_through.to_remember(self._dedup.entries()),
            through_ids=self._write_through.snapshot(),
        )
