"""SET_WILL and the publishing of wills: a will is checked when it is set as its link's publish would be
(so that a will that could never be published is refused then, not dropped later), and routed like a publish
when it is due. The book of who holds which will is ``wills.Wills``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from tridentmq_core.admission import Admission
from tridentmq_core.audit_events import AuditEvents
from tridentmq_core.catalog import Catalog
from tridentmq_core.checks import BrokerError
from tridentmq_core.router import InvalidAddress, validate_address
from tridentmq_core.security import Permission
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.wills import Will, Wills
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import (
    M_ADDRESS,
    M_BODY,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_ROUTING,
    M_TIMESTAMP,
    MAX_TIME_MS,
    RoutingType,
    WireMessage,
    check_message,
)

log = logging.getLogger("tridentmq.core.broker")

MAX_WILL_KEY = 512
_MULTICAST = int(RoutingType.MULTICAST)


class WillKeeper:
    def __init__(
        self,
        settings: CoreSettings,
        *,
        admission: Admission,
        catalog: Catalog,
        audit: AuditEvents,
        accept: Callable[[WireMessage, int], object],
    ) -> None:
        self.settings = settings
        self.book = Wills()
        self._admission = admission
        self._catalog = catalog
        self._audit = audit
        self._accept = accept  # routes a message like a publish (BrokerError if it cannot be)
        # Tells the other nodes of the cluster that a will key was taken (key, user, publish_pending): the
        # cluster manager sets it.
        self.tell_others: Callable[[str, str, bool], None] = lambda _key, _user, _publish_pending: None

    def set(
        self,
        session: Session,
        key: str | None,
        message: WireMessage | None,
        delay_ms: int,
        publish_pending: bool,
        now_ms: int,
        *,
        own: bool = False,
        retain: tuple[str, dict[str, Any]] | None = None,
        everywhere: bool = False,
    ) -> None:
        """A link's SET_WILL: ``key`` None clears its own will; ``message`` None frees the key (publishing the
        will pending under it when ``publish_pending``). ``own``: only if this link holds the will under ``key``
        (a connection taken over since must not take the key back from its successor). ``retain`` (store
        address, key properties): once the will is published, a copy with those properties goes to that store
        (see ``_retained_copy``). ``everywhere``: the pending will may be on another node (the client's earlier
        connection went through it), which is told too."""
        book = self.book
        if key is None:  # a nil will: clear this link's own, nothing else
            book.drop(session)
            return
        if not key or len(key) > MAX_WILL_KEY:
            raise BrokerError(ErrorCode.INVALID, f"a will key is a string of 1 to {MAX_WILL_KEY} characters")
        if not 0 <= delay_ms <= MAX_TIME_MS:
            raise BrokerError(ErrorCode.INVALID, f"a will's delay_ms is within 0..{MAX_TIME_MS}")
        if own and book.holders.get(key) is not session:
            return
        owner = book.user(key)
        if owner is not None and owner != session.principal.name:
            raise BrokerError(ErrorCode.FORBIDDEN, f"the will under key {key!r} belongs to another user")
        if message is not None:
            self._check(session, message)  # before anything changes: a refusal leaves all as it was
            if retain is not None:
                self._check_retained(session, _retained_copy(message, *retain))
        else:
            retain = None
        book.drop(session)
        pending, holder = book.take_key(key)
        if pending is not None and publish_pending:
            self._publish(pending, now_ms)
        elif pending is not None:
            log.debug("pending will cancelled", extra={"will_key": key})
        if holder is not None:
            log.debug("will taken over", extra={"will_key": key, "conn": holder.conn_id})
        if everywhere and pending is None:
            self.tell_others(key, session.principal.name, publish_pending)
        if message is not None:
            book.hold(session, Will(key, message, delay_ms, session.conn_id, session.principal.name, retain))

    def taken_elsewhere(self, key: str, user: str, publish_pending: bool, now_ms: int) -> None:
        """Another node's link of ``user`` took will key ``key`` (its client connected again there): the will
        pending here under it is cancelled or, with ``publish_pending``, published now (MQTT 3.1.3.2.2: a new
        connection to the session before the will delay is over, and it is never sent)."""
        pending = self.book.pending.get(key)
        if pending is None or pending.user != user:
            return
        self.book.take_pending(key)
        if publish_pending:
            self._publish(pending, now_ms)
        else:
            log.debug("pending will cancelled by another node", extra={"will_key": key})

    def closed(self, session: Session, now_ms: int) -> None:
        """The link is gone: its will is published now, or waits for its delay."""
        will = self.book.release(session, now_ms)
        if will is not None:
            self._publish(will, now_ms)

    def tick(self, now_ms: int) -> None:
        for will in self.book.due(now_ms):
            self._publish(will, now_ms)

    def forget_held(self, sessions: Iterable[Session]) -> None:
        """The node closes these links itself (a failback, a cut-off): their clients are alive and their links
        set their wills again where they resume, so none is published here; pending wills stay."""
        self.book.forget_held(sessions)

    def discard(self, sessions: Iterable[Session]) -> None:
        """The node is stopping: its links close because of that, not because their clients went away, so
        no will is published. Pending wills are kept in memory only and would be lost anyway."""
        self.book.discard(sessions)

    def _check(self, session: Session, message: WireMessage) -> None:
        """Refuse a will its link could not publish now, with the code a REJECT would carry."""
        problem = check_message(message, session.conn.max_properties)
        if problem is not None:
            raise BrokerError(ErrorCode.INVALID, problem)
        admission = self._admission
        address = message[M_ADDRESS]
        refusal = admission.check_send(session, address)
        if refusal is None and (
            address not in self._catalog.addresses
            or (message[M_ROUTING] != _MULTICAST and address not in self._catalog.queues)
        ):
            refusal = admission.creation_problem(session, message)
        max_bytes = admission.max_durable_body if message[M_DURABLE] else self.settings.broker.max_message_bytes
        if refusal is None and len(message[M_BODY]) > max_bytes:
            refusal = (ErrorCode.RESOURCE_LIMIT, f"message body exceeds {max_bytes} bytes")
        if refusal is not None:
            raise BrokerError(*refusal)

    def _check_retained(self, session: Session, copy: WireMessage) -> None:
        """The retained copy of a will is written as a gateway writes a retained PUBLISH's: with the rights of the
        gateway's own user (the link carrying the session's channel; the session's own user on a link of its
        own), once the will itself, checked as the user's publish, is routed. So the user needs no right on the
        store, and a link that no gateway carries cannot write where its own user may not."""
        problem = check_message(copy, session.conn.max_properties)
        if problem is not None:
            raise BrokerError(ErrorCode.INVALID, f"a will's retained copy: {problem}")
        address = copy[M_ADDRESS]
        try:
            validate_address(address, allow_wildcards=False)
        except InvalidAddress as exc:
            raise BrokerError(ErrorCode.INVALID, f"a will's retained copy: {exc}") from None
        principal = session.carrier_principal or session.principal
        if not principal.allowed(Permission.SEND, address):
            raise BrokerError(ErrorCode.FORBIDDEN, f"user {principal.name!r} may not send to {address!r}")

    def _publish(self, will: Will, now_ms: int) -> None:
        """Route a will like a publish (its permissions were checked when it was set)."""
        message = list(will.message)
        expiration, timestamp = message[M_EXPIRATION], message[M_TIMESTAMP]
        if expiration and timestamp and expiration > timestamp:
            # A will's lifetime counts from its publication: as long from now as it was from its timestamp (MQTT's
            # will message expiry interval; a will that waited for its link to close is not expired by that).
            message[M_EXPIRATION] = min(now_ms + expiration - timestamp, MAX_TIME_MS)
        message[M_ID] = 0
        message[M_TIMESTAMP] = 0  # a fresh id and timestamp, as for any publish
        address = message[M_ADDRESS]
        # Made before the will is routed: the core fills in the very array it routes.
        copy = None if will.retain is None else _retained_copy(message, *will.retain)
        refusal = self._admission.durable_refusal if message[M_DURABLE] else None
        if refusal is None:
            try:
                self._accept(message, now_ms)
            except BrokerError as exc:
                refusal = (exc.code, exc.text)
        if refusal is not None:
            log.warning("will dropped", extra={"will_key": will.key, "address": address, "reason": refusal[1]})
            return  # a will not published is not retained either
        log.debug("will published", extra={"will_key": will.key, "address": address})
        self._audit.emit(now_ms, "will.published", key=will.key, address=address, conn_id=will.conn_id)
        if copy is not None:
            try:
                self._accept(copy, now_ms)
            except BrokerError as exc:
                log.warning(
                    "will not retained", extra={"will_key": will.key, "address": copy[M_ADDRESS], "reason": exc.text}
                )


def _retained_copy(message: WireMessage, store: str, key: dict[str, Any]) -> WireMessage:
    """The copy of a will for the retained store ``store``, as the MQTT gateway writes a retained PUBLISH's:
    multicast (to every node's copy of the store), no dedup id (the will's must not make it a duplicate), the
    ``key`` properties added; an empty body (which clears the key's value) never expires, or it could expire
    on its way to another node and leave the old value there."""
    copy = list(message)
    copy[M_ADDRESS] = store
    copy[M_ROUTING] = _MULTICAST
    copy[M_DEDUP] = None
    copy[M_PROPS] = {**message[M_PROPS], **key}
    if not message[M_BODY]:
        copy[M_EXPIRATION] = 0
    return copy
