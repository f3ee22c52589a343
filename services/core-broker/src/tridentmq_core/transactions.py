"""A link's transactions: publishes and acknowledgements staged until COMMIT applies them all at once (one
store transaction), or ROLLBACK redelivers what it acknowledged."""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.catalog import Catalog
from tridentmq_core.checks import BrokerError
from tridentmq_core.consuming import Consuming
from tridentmq_core.deliveries import Deliveries
from tridentmq_core.queues import Queue
from tridentmq_core.sessions import Session, Transaction
from tridentmq_core.store.base import Store
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.message import M_ADDRESS, M_ROUTING, WireMessage


class Transactions:
    def __init__(
        self,
        address_settings: AddressSettingsRepository,
        *,
        max_open: int,
        store: Store,
        catalog: Catalog,
        consuming: Consuming,
        deliveries: Deliveries,
        accept: Callable[[WireMessage, int], object],
        to_dispatch: set[Queue],
    ) -> None:
        self.address_settings = address_settings
        self._max_open = max_open  # transactions one session may have open (broker.max_open_transactions)
        self.store = store
        self._catalog = catalog
        self._consuming = consuming
        self._deliveries = deliveries
        self._accept = accept  # routes a message like a publish
        self._to_dispatch = to_dispatch
        #: Set by the server while the store cannot write: commits are refused with this (code, text).
        self.write_refusal: tuple[str, str] | None = None

    def begin(self, session: Session, tx_id: int) -> None:
        if tx_id in session.txs:
            raise BrokerError(ErrorCode.EXISTS, f"transaction {tx_id} is already open")
        if len(session.txs) >= self._max_open:
            raise BrokerError(
                ErrorCode.RESOURCE_LIMIT, f"{self._max_open} transactions are open (broker.max_open_transactions)"
            )
        session.open_transaction(tx_id)

    def commit(self, session: Session, tx_id: int, now_ms: int) -> int:
        """Apply the transaction and close it; returns the store's token for it (0: safe already)."""
        tx = self._open(session, tx_id)
        if tx.failed is not None:
            code, text = tx.failed
            raise BrokerError(code, f"transaction is rollback-only: a publish in it was refused ({text})")
        if self.write_refusal is not None:  # left open: the client may commit again once the store writes
            raise BrokerError(*self.write_refusal)
        # All or nothing: refuse before applying anything. What a send cannot create is the only reason
        # accepting a message refuses; failing half-way would leave the transaction open with part of it
        # applied, and a retried commit would apply that part twice.
        for message in tx.publishes:
            refusal = self._catalog.send_refusal(message[M_ADDRESS], message[M_ROUTING])
            if refusal is not None:
                raise refusal
        left: list[Queue] = []  # queues whose consumer went before the commit: they may auto-delete now
        self.store.begin_transaction()
        try:
            for message in tx.publishes:
                self._accept(message, now_ms)
            for consumer, message_id in tx.acks:
                queue = consumer.queue
                taken = queue.take(consumer, message_id)
                if taken is None:
                    continue
                if not self._live(queue):  # deleted since, with its messages: nothing to acknowledge
                    queue.settle(taken[0])
                    continue
                self._deliveries.settle(queue, taken[0], now_ms, None, consumer)
                if consumer not in queue.consumers:
                    left.append(queue)
        finally:
            token = self.store.commit_transaction()
        del session.txs[tx_id]
        for queue in left:
            self._catalog.maybe_auto_delete(queue, now_ms)
        return token

    def rollback(self, session: Session, tx_id: int, now_ms: int) -> None:
        self.undo(self._open(session, tx_id), now_ms)
        del session.txs[tx_id]

    def undo(self, tx: Transaction, now_ms: int) -> None:
        """Redeliver what the transaction acknowledged (its publishes were never applied), in the order they
        were sent: each goes back to the head of its queue, so the newest goes first (as a consumer's going)."""
        for consumer, message_id in sorted(tx.acks, key=itemgetter(1), reverse=True):
            taken = consumer.queue.take(consumer, message_id)
            if taken is None:
                continue
            if self._live(consumer.queue):
                self._consuming.give_back(consumer.queue, taken[0], taken[1], NackMode.REDELIVER, now_ms)
                self._to_dispatch.add(consumer.queue)
            else:  # the consumer went, and then its queue with the messages it had: this one goes with them
                consumer.queue.settle(taken[0])

    def _live(self, queue: Queue) -> bool:
        return self._catalog.queues.get(queue.name) is queue

    @staticmethod
    def _open(session: Session, tx_id: int) -> Transaction:
        tx = session.txs.get(tx_id)
        if tx is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"no open transaction {tx_id}")
        return tx
