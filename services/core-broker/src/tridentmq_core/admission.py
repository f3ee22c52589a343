"""Publish admission: which of a link's publishes are taken (permission, auto-creation rights, size, the
address's size limit, durable writes being safe) and the producer credit that paces it. A producer gets its
credit back per batch, or, while the node is over its memory limit, paging lags, or an address it filled is
over its limit with the BLOCK policy, once that clears (under 90 %)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.catalog import Catalog
from tridentmq_core.checks import BrokerError
from tridentmq_core.confirms import Confirms, reject_publish
from tridentmq_core.counters import Counters
from tridentmq_core.queues import MESSAGE_OVERHEAD, LinkSession, MemoryGauge
from tridentmq_core.router import InvalidAddress, validate_address
from tridentmq_core.routes import Routes
from tridentmq_core.security import Permission
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import M_ADDRESS, M_BODY, M_DURABLE, M_ROUTING, RoutingType, WireMessage

log = logging.getLogger("tridentmq.core.broker")

_UNCHECKED: Final[tuple[str, str]] = ("", "")  # marker: the send permission cache has no entry yet
_MULTICAST: Final = int(RoutingType.MULTICAST)
_NO_LIMIT_YET: Final = (-2, "")  # marker: the address's size limit has not been looked up yet
_MAX_CACHED: Final = 100_000  # limits cached beyond this start again from empty
_MAX_SEND_CHECKS: Final = 10_000  # per link

#: Takes one admitted publish in (routes and stores it); returns the token its confirm waits for (0: none).
Accept = Callable[[WireMessage, int], int]


class Admission:
    def __init__(
        self,
        settings: CoreSettings,
        address_settings: AddressSettingsRepository,
        *,
        catalog: Catalog,
        routes: Routes,
        counters: Counters,
        memory: MemoryGauge,
        dirty: set[LinkSession],
        sessions: dict[str, Session],
        confirms: Confirms,
        paging: bool,
        paging_behind: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.address_settings = address_settings
        self._catalog = catalog
        self._routes = routes
        self._counters = counters
        self._memory = memory
        self._dirty = dirty
        self._sessions = sessions
        self._confirms = confirms
        self._paging = paging  # False: no pager, so PAGE behaves as BLOCK
        self._paging_behind = paging_behind  # page writes lag the producers: withhold credit as for memory
        self._memory_limit = settings.broker.max_memory_bytes
        self._blocked: dict[Session, int] = {}  # publish credit withheld while over the memory limit
        self._blocked_on: dict[Session, set[str]] = {}  # … or while these addresses are over their size limit
        self._limits: dict[str, tuple[int, str] | None] = {}  # address → (max_size_bytes, policy), None: none
        # Set by the server while durable writes cannot be made safe (disk nearly full, journal failed):
        # durable publishes are then refused with this (code, text) instead of being accepted unsafely.
        self.durable_refusal: tuple[str, str] | None = None
        # ... and between two looks at the disk, the bytes of durable messages it may still take before the
        # disk reaches journal.max_disk_usage (None: no limit): a burst is refused at the limit, not a second
        # after the disk filled up with it and left no room for the acknowledgements that would drain it.
        self.disk_budget: int | None = None
        self.disk_limit_text = ""
        # Set by the server while the paging directory's disk is over journal.max_disk_usage: a publish that a
        # queue would page is refused with this (code, text) rather than fill that disk.
        self.paging_refusal: tuple[str, str] | None = None
        #: The largest durable body the store can hold (a journal record fits one segment): at most the
        #: largest body accepted, lowered by the shell when the journal's segments are smaller.
        self.max_durable_body = settings.broker.max_message_bytes
        self.publisher: Session | None = None  # whose publishes ``take`` is admitting
        self.withheld = 0  # how many of them wait for a cluster connection (their credit comes back later)

    def take(self, session: Session, ops: list[list[Any]], accept: Accept, now_ms: int) -> None:
        """A link's batch of publishes: each is refused, staged in its transaction, or accepted; then the
        batch's credit is granted, or withheld while the node or an address is full."""
        conn = session.conn
        send_ok = session.send_ok
        max_bytes, max_durable = self.settings.broker.max_message_bytes, self.max_durable_body
        self.publisher, self.withheld = session, 0
        confirm = conn.confirm
        addresses = self._catalog.addresses
        queues = self._catalog.queues
        limits = self._limits
        full: set[str] = set()  # addresses over their size limit with the BLOCK policy
        for _, seq, tx_id, message in ops:
            address = message[M_ADDRESS]
            problem = send_ok.get(address, _UNCHECKED)
            if problem is _UNCHECKED:
                problem = self.check_send(session, address)
                send_ok = session.send_ok  # the session's own now, where it held the shared empty one
            if problem is None and (
                address not in addresses or (message[M_ROUTING] != _MULTICAST and address not in queues)
            ):
                problem = self.creation_problem(session, message)
            if problem is None and message[M_DURABLE]:
                if self.durable_refusal is not None:
                    problem = self.durable_refusal
                elif self.disk_budget is not None:
                    cost = len(message[M_BODY]) + MESSAGE_OVERHEAD
                    if cost > self.disk_budget:
                        problem = (ErrorCode.RESOURCE_LIMIT, self.disk_limit_text)
                    else:
                        self.disk_budget -= cost
            if problem is None and self.paging_refusal is not None and self._would_page(address):
                problem = self.paging_refusal
            if problem is None and len(message[M_BODY]) > (max_durable if message[M_DURABLE] else max_bytes):
                limit_bytes = max_durable if message[M_DURABLE] else max_bytes
                problem = (ErrorCode.RESOURCE_LIMIT, f"message body exceeds {limit_bytes} bytes")
            if problem is None:
                limit = limits.get(address, _NO_LIMIT_YET)
                if limit is _NO_LIMIT_YET:
                    limit = self._address_limit(address)
                if limit is not None and self._address_bytes(address) >= limit[0]:
                    if limit[1] == "FAIL":
                        text = f"address {address!r} is full ({limit[0]} bytes, address-full-policy FAIL)"
                        problem = (ErrorCode.RESOURCE_LIMIT, text)
                    elif limit[1] == "DROP":
                        self._counters.dropped += 1
                        confirm(seq)
                        continue
                    else:
                        full.add(address)
            if problem is not None:
                reject_publish(self._counters, conn, seq, *problem)
                if tx_id and tx_id in session.txs:
                    session.txs[tx_id].failed = session.txs[tx_id].failed or problem
                continue
            if tx_id:
                tx = session.txs.get(tx_id)
                if tx is None:
                    reject_publish(self._counters, conn, seq, ErrorCode.NOT_FOUND, f"no open transaction {tx_id}")
                    continue
                size = len(message[M_BODY]) + MESSAGE_OVERHEAD
                held = tx.staged_bytes if len(session.txs) == 1 else sum(t.staged_bytes for t in session.txs.values())
                if held + size > self.settings.broker.max_transaction_bytes:
                    # Staged messages are held until the commit: transactions that grew without one would
                    # hold memory without bound. This one can only roll back now.
                    problem = (
                        ErrorCode.RESOURCE_LIMIT,
                        "the session's transactions exceed broker.max_transaction_bytes",
                    )
                    reject_publish(self._counters, conn, seq, *problem)
                    tx.failed = tx.failed or problem
                    continue
                tx.staged_bytes += size
                tx.publishes.append(message)
                conn.confirm(seq)  # staged; the commit reply is what makes it count
                continue
            try:
                token = accept(message, now_ms)
            except BrokerError as exc:
                reject_publish(self._counters, conn, seq, exc.code, exc.text)
                continue
            if token:
                self._confirms.waiting[token] = (session, seq)
            else:
                confirm(seq)
        self.publisher = None
        credit = len(ops) - self.withheld  # the held ones' comes with ``return_credit``
        if self._memory.used < self._memory_limit and not full and not self._paging_behind():
            conn.grant_publish_credit(credit)
        else:
            if not self._blocked:
                log.warning(
                    "memory, address or paging limit reached: producers are blocked until it clears",
                    extra={
                        "used": self._memory.used,
                        "limit": self._memory_limit,
                        "full_addresses": ",".join(sorted(full)),
                        "paging_behind": self._paging_behind(),
                    },
                )
            self._blocked[session] = self._blocked.get(session, 0) + credit
            if full:
                self._blocked_on.setdefault(session, set()).update(full)
        self._dirty.add(session)

    def return_credit(self, session: Session, credit: int) -> None:
        """Publishes of ``session`` held for a cluster connection's credit went out: it may send as many more
        (once unblocked, if the node is blocking producers)."""
        if self._sessions.get(session.conn_id) is not session:
            return
        if session in self._blocked:
            self._blocked[session] += credit
        else:
            session.conn.grant_publish_credit(credit)
            self._dirty.add(session)

    def unblock(self) -> None:
        """Give blocked producers their credit back once memory, and every address they filled, is under 90 %."""
        if not self._blocked or self._memory.used * 10 >= self._memory_limit * 9 or self._paging_behind():
            return
        for session in list(self._blocked):
            still_full = [
                a
                for a in self._blocked_on.get(session, ())
                if (limit := self._address_limit(a)) is not None and self._address_bytes(a) * 10 >= limit[0] * 9
            ]
            if still_full:
                continue
            session.conn.grant_publish_credit(self._blocked.pop(session))
            self._blocked_on.pop(session, None)
            self._dirty.add(session)
        if not self._blocked:
            log.info("producers resume", extra={"used": self._memory.used})

    def forget(self, session: Session) -> None:
        """The link is gone: nothing is owed to it."""
        self._blocked.pop(session, None)
        self._blocked_on.pop(session, None)

    def forget_limit(self, address: str) -> None:
        self._limits.pop(address, None)

    def settings_changed(self) -> None:
        self._limits.clear()

    def check_send(self, session: Session, address: str) -> tuple[str, str] | None:
        """Why ``session`` may not send to ``address`` (code, text), or None; cached per link."""
        problem: tuple[str, str] | None = None
        try:
            validate_address(address, allow_wildcards=False)
        except InvalidAddress as exc:
            problem = (ErrorCode.INVALID, str(exc))
        else:
            if not session.principal.allowed(Permission.SEND, address):
                problem = (ErrorCode.FORBIDDEN, f"user {session.principal.name!r} may not send to {address!r}")
        session.remember_send_check(address, problem, _MAX_SEND_CHECKS)
        return problem

    def creation_problem(self, session: Session, message: WireMessage) -> tuple[str, str] | None:
        """A publish to an address that does not exist yet will auto-create it (and, for anycast, a durable
        queue of the same name): the sender needs the permissions for that too."""
        address = message[M_ADDRESS]
        settings = self.address_settings.resolve(address)
        addresses = self._catalog.addresses
        needed = []
        principal = session.principal
        if address not in addresses:
            if not settings.auto_create_addresses:
                return (ErrorCode.NOT_FOUND, f"address {address!r} does not exist")
            needed.append(Permission.CREATE_ADDRESS)
        kind = self._routes.send_kind(address, message[M_ROUTING], settings)
        if kind is RoutingType.ANYCAST and settings.auto_create_queues and self._routes.lacks_anycast_queue(address):
            needed.append(Permission.CREATE_DURABLE_QUEUE)
        for permission in needed:
            if not principal.allowed(permission, address):
                text = f"user {principal.name!r} lacks permission {permission.value} to auto-create {address!r}"
                return (ErrorCode.FORBIDDEN, text)
        cap = self.settings.broker.max_auto_created_addresses_per_user
        if (
            address not in addresses
            and cap > 0
            and not principal.cluster
            and self._catalog.auto_created_by.get(principal.name, 0) >= cap
        ):
            text = (
                f"user {principal.name!r} already has {cap} auto-created addresses in use "
                f"(broker.max_auto_created_addresses_per_user): {address!r} is not created"
            )
            return (ErrorCode.RESOURCE_LIMIT, text)
        return None

    def _address_limit(self, address: str) -> tuple[int, str] | None:
        settings = self.address_settings.resolve(address)
        policy = settings.address_full_policy
        if policy == "PAGE":  # the queues page by themselves; without a pager it degrades to BLOCK
            policy = "" if self._paging else "BLOCK"
        limit = (settings.max_size_bytes, policy) if settings.max_size_bytes >= 0 and policy else None
        if len(self._limits) > _MAX_CACHED:
            self._limits.clear()
        self._limits[address] = limit
        return limit

    def _would_page(self, address: str) -> bool:
        existing = self._catalog.addresses.get(address)
        return existing is not None and any(q.paging for q in existing.queues.values())

    def _address_bytes(self, address: str) -> int:
        existing = self._catalog.addresses.get(address)
        return sum(q.bytes for q in existing.queues.values()) if existing is not None else 0
