"""A link session as the broker keeps it: its outlet, who it is, its consumers, open transactions, temporary
queues, the send permissions it was checked for, and its will."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from tridentmq_core.outlet import Outlet
from tridentmq_core.queues import Consumer
from tridentmq_core.security import Principal
from tridentmq_core.wills import Will
from tridentmq_shared.message import WireMessage


@dataclass(slots=True)
class Transaction:
    publishes: list[WireMessage] = field(default_factory=list)
    acks: list[tuple[Consumer, int]] = field(default_factory=list)
    failed: tuple[str, str] | None = None  # a publish of it was refused: commit must fail (rollback-only)
    staged_bytes: int = 0  # what its publishes hold until the commit (bodies plus MESSAGE_OVERHEAD each)


# Shared empty containers that a session holds until its first entry, as queues do (64 bytes each): most
# sessions never open a transaction, and a device that only subscribes never publishes. Only read: the writers
# below swap in a container of the session's own first.
_NO_TXS: Final[dict[int, Transaction]] = {}
_NO_TEMPORARY_QUEUES: Final[dict[str, None]] = {}
_NO_SEND_CHECKS: Final[dict[str, tuple[str, str] | None]] = {}


class Session:
    """Broker-side state of one link connection."""

    __slots__ = (
        "carrier_principal",
        "client_name",
        "conn",
        "conn_id",
        "consumers",
        "opened_ms",
        "peer",
        "principal",
        "send_ok",
        "temporary_queues",
        "txs",
        "will",
    )

    def __init__(
        self, conn: Outlet, conn_id: str, principal: Principal, peer: str, client_name: str, opened_ms: int
    ) -> None:
        self.conn = conn
        self.conn_id = conn_id
        self.principal = principal
        # A channel's: the user of the link that carries it (a gateway's own user), None for a link of its own.
        self.carrier_principal: Principal | None = None
        self.peer = peer
        self.client_name = client_name
        self.opened_ms = opened_ms
        self.consumers: dict[int, Consumer] = {}
        self.txs = _NO_TXS
        # The names of its temporary queues (a dict as an ordered set: 64 bytes empty, a set 216).
        self.temporary_queues = _NO_TEMPORARY_QUEUES
        self.send_ok = _NO_SEND_CHECKS  # address → why a send is refused (None: allowed)
        self.will: Will | None = None

    def open_transaction(self, tx_id: int) -> None:
        if self.txs is _NO_TXS:
            self.txs = {}
        self.txs[tx_id] = Transaction()

    def drop_transactions(self) -> list[Transaction]:
        """Its open transactions, which it holds no more (its link is gone)."""
        transactions, self.txs = list(self.txs.values()), _NO_TXS
        return transactions

    def add_temporary_queue(self, name: str) -> None:
        if self.temporary_queues is _NO_TEMPORARY_QUEUES:
            self.temporary_queues = {}
        self.temporary_queues[name] = None

    def remember_send_check(self, address: str, problem: tuple[str, str] | None, limit: int) -> None:
        """Keep what a send to ``address`` was found to be; past ``limit`` addresses, start again."""
        if self.send_ok is _NO_SEND_CHECKS or len(self.send_ok) > limit:
            self.send_ok = {}
        self.send_ok[address] = problem
