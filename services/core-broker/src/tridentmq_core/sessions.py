"""A link session as the broker keeps it: its outlet, who it is, its consumers, open transactions, temporary
queues, the send permissions it was checked for, and its will."""

from __future__ import annotations

from dataclasses import dataclass, field

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


class Session:
    """Broker-side state of one link connection."""

    __slots__ = (
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
        self.peer = peer
        self.client_name = client_name
        self.opened_ms = opened_ms
        self.consumers: dict[int, Consumer] = {}
        self.txs: dict[int, Transaction] = {}
        # The names of its temporary queues (a dict as an ordered set: 64 bytes empty, a set 216).
        self.temporary_queues: dict[str, None] = {}
        self.send_ok: dict[str, tuple[str, str] | None] = {}  # address → why a send is refused (None: allowed)
        self.will: Will | None = None
