"""What an operator may do to one node's broker at run time (the management API's operations). Pure: no I/O,
no clock (``now_ms`` is passed in); the HTTP shell (``management/operations_api.py``) validates the request's
shape, runs an operation on every node of a cluster and audits it.

Each operation returns a JSON-ready dict or raises ``OperationError`` with an HTTP status (400 bad parameter,
404 no such queue, 409 conflicts with what is there). The node-local answers are summed over the cluster by
the shell, so they carry counts, not prose.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable
from typing import Any, Final

from tridentmq_core.address_settings import ResolvedAddressSettings, check_entry
from tridentmq_core.broker import Broker
from tridentmq_core.checks import BrokerError
from tridentmq_core.dead_letters import ORIGINAL_ADDRESS, ORIGINAL_QUEUE, ORIGINAL_REASON
from tridentmq_core.forwarder import FORWARD_QUEUE_PREFIX
from tridentmq_core.queues import Queue
from tridentmq_core.router import InvalidAddress, validate_address
from tridentmq_core.selector import SelectorError, compile_selector
from tridentmq_core.sessions import Session
from tridentmq_core.settings import AddressSettingsEntry
from tridentmq_shared.message import (
    M_ADDRESS,
    M_BODY,
    M_CONTENT_TYPE,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_GROUP,
    M_ID,
    M_LVQ,
    M_PRIORITY,
    M_PROPS,
    M_PROTOCOL,
    M_ROUTING,
    M_SCHEDULED,
    M_TIMESTAMP,
    RoutingType,
    WireMessage,
    selector_view,
)
from tridentmq_shared.settings import SettingsError

#: Most messages one browse page shows, and most body bytes shown per message.
MAX_BROWSE_LIMIT: Final = 500
MAX_PREVIEW_BYTES: Final = 65_536
DEFAULT_PREVIEW_BYTES: Final = 256
#: The properties that record where a dead-lettered or expired copy came from (dropped when it goes back).
_ORIGIN_PROPERTIES: Final = (ORIGINAL_ADDRESS, ORIGINAL_QUEUE, ORIGINAL_REASON)
#: Address settings fields and the types their values must have (from the settings dataclass).
_SETTING_TYPES: Final = {
    "dead_letter_address": str,
    "expiry_address": str,
    "max_delivery_attempts": int,
    "redelivery_delay_ms": int,
    "redelivery_multiplier": float,
    "max_redelivery_delay_ms": int,
    "auto_create_addresses": bool,
    "auto_create_queues": bool,
    "auto_delete_queues": bool,
    "auto_delete_addresses": bool,
    "auto_delete_addresses_delay_ms": int,
    "auto_create_dead_letter_resources": bool,
    "max_size_bytes": int,
    "address_full_policy": str,
    "default_routing_type": str,
    "redistribution_delay_ms": int,
}


class OperationError(Exception):
    """An operation refused; ``status`` is the HTTP status that says why (400, 404, 409)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def _compile(selector: str | None) -> Callable[[WireMessage], bool]:
    if not selector:
        return lambda _m: True
    try:
        compiled = compile_selector(selector)
    except SelectorError as exc:
        raise OperationError(400, f"bad selector: {exc}") from None
    return lambda m: compiled.matches(selector_view(m))


def check_selector(selector: str | None) -> None:
    """Raise ``OperationError`` 400 when ``selector`` does not compile (checked once before fanning out)."""
    _compile(selector)


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"base64": base64.b64encode(value).decode()}
    return value


def message_view(
    message: WireMessage,
    node_tag: str,
    delivery_count: int,
    state: str,
    preview: int,
) -> dict[str, Any]:
    """A message as an operator sees it: its headers, properties and the first ``preview`` body bytes (as text
    when they are UTF-8, else base64)."""
    body = bytes(message[M_BODY])
    shown = body[:preview]
    try:
        text, encoding = shown.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(shown).decode(), "base64"
    routing = message[M_ROUTING]
    return {
        "message_id": message[M_ID],
        "audit_id": f"{node_tag}-{message[M_ID]}",  # the id the audit stream knows it by
        "state": state,
        "delivery_count": delivery_count,
        "address": message[M_ADDRESS],
        "routing_type": RoutingType(routing).name.lower() if routing in (0, 1) else None,
        "durable": bool(message[M_DURABLE]),
        "priority": message[M_PRIORITY],
        "timestamp_ms": message[M_TIMESTAMP],
        "expiration_ms": message[M_EXPIRATION],
        "scheduled_ms": message[M_SCHEDULED],
        "group": message[M_GROUP],
        "dedup_id": message[M_DEDUP],
        "last_value_key": message[M_LVQ],
        "content_type": message[M_CONTENT_TYPE],
        "protocol": message[M_PROTOCOL],
        "size": len(body),
        "properties": {str(k): _json_value(v) for k, v in message[M_PROPS].items()},
        "body": text,
        "body_encoding": encoding,
        "body_truncated": len(body) > preview,
    }


def client_matches(session: Session, client: str) -> bool:
    """Whether a link is the one ``client`` names: its connection id, its whole client name, one word of the
    name after the first, or all between the first word and the last (a gateway names its client's links
    ``stomp <peer>``, ``mqtt <client id> <peer>``, ``amqp <peer>``; an MQTT client id may hold spaces)."""
    if client in (session.conn_id, session.client_name):
        return True
    words = session.client_name.split(" ")
    return client in words[1:] or " ".join(words[1:-1]) == client


class Operations:
    """The operations on ``broker``; every method runs on the broker's own event loop, between two events."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def _queue(self, name: str) -> Queue:
        queue = self.broker.queues.get(name)
        if queue is None:
            raise OperationError(404, f"queue {name!r} does not exist")
        return queue

    # ------------------------------------------------------------------ queues
    def create_queue(
        self,
        name: str,
        address: str,
        routing: RoutingType,
        *,
        durable: bool,
        filter_text: str | None,
        exclusive: bool,
        last_value_key: str | None,
        max_consumers: int,
        now_ms: int,
    ) -> dict[str, Any]:
        broker = self.broker
        existing = broker.queues.get(name)
        if existing is not None:
            raise OperationError(409, f"queue {name!r} exists (on address {existing.address!r})")
        for what, value in (("queue name", name), ("address", address)):
            try:
                validate_address(value, allow_wildcards=what == "address")
            except InvalidAddress as exc:
                raise OperationError(400, f"bad {what}: {exc}") from None
        check_selector(filter_text)
        known = broker.addresses.get(address)
        if known is not None and routing not in known.routing_types and known.queues:
            kinds = ", ".join(sorted(k.name.lower() for k in known.routing_types))
            raise OperationError(409, f"address {address!r} is {kinds}; it has no {routing.name.lower()} queues")
        try:
            broker.catalog.create_queue(
                name,
                address,
                routing,
                durable=durable,
                now_ms=now_ms,
                filter_text=filter_text,
                exclusive=exclusive,
                last_value_key=last_value_key,
                max_consumers=max_consumers,
            )
        except BrokerError as exc:
            raise OperationError(400, exc.text) from None
        return {"created": 1}

    def delete_queue(self, name: str, now_ms: int) -> dict[str, Any]:
        queue = self._queue(name)
        if name.startswith(FORWARD_QUEUE_PREFIX):
            raise OperationError(409, f"{name!r} is a cluster connection's store-and-forward queue")
        messages = len(queue) + queue.in_flight
        self.broker.catalog.delete_queue(queue, now_ms)
        return {"deleted": 1, "messages": messages}

    def purge(self, name: str, selector: str | None, now_ms: int) -> dict[str, Any]:
        """Drop the queued messages and those waiting for their time (those ``selector`` matches; all, paged
        ones included, without one)."""
        queue = self._queue(name)
        return {"purged": self.broker.catalog.purge_queue(queue, now_ms, _compile(selector) if selector else None)}

    def browse(self, name: str, offset: int, limit: int, selector: str | None, preview: int) -> dict[str, Any]:
        """A page of the queue's messages: queued ones in delivery order, then in-flight, then paged ones."""
        queue = self._queue(name)
        wanted = _compile(selector)
        tag = self.broker.events.tag
        total = 0
        page = []
        for message, count, state in queue.browse_messages():
            if not wanted(message):
                continue
            if offset <= total < offset + limit:
                page.append(message_view(message, tag, count, state, preview))
            total += 1
        return {"total": total, "messages": page}

    def move(
        self,
        name: str,
        target: str | None,
        *,
        selector: str | None,
        message_ids: list[int] | None,
        limit: int,
        copy: bool,
        now_ms: int,
    ) -> dict[str, Any]:
        """Move (or copy) queued messages of ``name`` into the queue ``target``, or with ``target`` None each
        back to the queue it was dead-lettered or expired from (its ``_AMQ_ORIG_QUEUE``). A message whose
        target queue does not exist here stays where it is and is counted as ``skipped``."""
        broker = self.broker
        source = self._queue(name)
        destination = self._queue(target) if target is not None else None
        if destination is source:
            raise OperationError(400, "the source and the target are the same queue")
        wanted = _compile(selector)
        ids = set(message_ids) if message_ids is not None else None
        queues = broker.queues

        def where(message: WireMessage) -> Queue | None:
            if destination is not None:
                return destination
            origin = message[M_PROPS].get(ORIGINAL_QUEUE)
            found = queues.get(origin) if type(origin) is str else None
            return found if found is not source else None

        def chosen(message: WireMessage) -> bool:
            return (ids is None or message[M_ID] in ids) and wanted(message) and where(message) is not None

        skipped = 0
        if destination is None:
            skipped = sum(
                1 for m in source.messages() if (ids is None or m[M_ID] in ids) and wanted(m) and where(m) is None
            )

        def place(picked: list[WireMessage]) -> None:
            for message in picked:
                into = where(message)
                assert into is not None
                broker.place_copy(_copy_for(message, into), into, broker.events.audit_id(message), now_ms)

        if copy:
            picked = [m for m in source.messages() if chosen(m)]
            picked = picked if limit < 0 else picked[:limit]
            place(picked)
        else:  # the copies are journaled before the originals' acknowledgement
            picked = broker.catalog.take_messages(source, chosen, limit, "moved", now_ms, before_acknowledging=place)
        return {"copied" if copy else "moved": len(picked), "skipped": skipped}

    # ------------------------------------------------------------------ pause
    def pause(self, *, queue: str | None, address: str | None, paused: bool) -> dict[str, Any]:
        """Pause (or resume) one queue, or an address: every queue it has and any it gets later."""
        broker = self.broker
        if queue is not None:
            found = self._queue(queue)
            broker.catalog.set_paused(found, paused)
            return {"queues": 1}
        assert address is not None
        known = broker.addresses.get(address)
        if paused:
            broker.catalog.paused_addresses.add(address)
        else:
            broker.catalog.paused_addresses.discard(address)
        if known is None:
            return {"queues": 0}
        for found in known.queues.values():
            broker.catalog.set_paused(found, paused)
        return {"queues": len(known.queues)}

    # ------------------------------------------------------------------ address settings
    def address_settings(self, address: str | None) -> dict[str, Any]:
        """The configured entries, and with ``address`` what applies to it."""
        repository = self.broker.address_settings
        view: dict[str, Any] = {"entries": [_entry_view(e) for e in repository.entries]}
        if address is not None:
            view["address"] = address
            view["resolved"] = _resolved_view(repository.resolve(address))
        return view

    def set_address_settings(self, match: str, values: dict[str, Any]) -> dict[str, Any]:
        """Replace the entry for ``match`` with ``values`` (fields left out or null fall through to less
        specific entries). Applies at once to what is decided per message; a queue's paging limit is fixed
        when the queue is created."""
        entry = settings_entry(match, values)
        self.broker.address_settings.set_entry(entry)
        self.broker.address_settings_changed()
        return {"changed": 1}


def settings_entry(match: str, values: dict[str, Any]) -> AddressSettingsEntry:
    """An address settings entry from an operator's JSON, every field checked (``OperationError`` 400)."""
    try:
        validate_address(match, allow_wildcards=True)
    except InvalidAddress as exc:
        raise OperationError(400, f"bad match: {exc}") from None
    fields: dict[str, Any] = {}
    for key, value in values.items():
        kind = _SETTING_TYPES.get(key)
        if kind is None:
            raise OperationError(400, f"unknown address setting {key!r} (known: {', '.join(_SETTING_TYPES)})")
        if value is None:
            continue
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            raise OperationError(400, f"{key} takes a value of type {kind.__name__}, not {type(value).__name__}")
        fields[key] = value
    entry = AddressSettingsEntry(match=match, **fields)
    try:
        check_entry(entry)
    except SettingsError as exc:
        raise OperationError(400, str(exc)) from None
    return entry


def _entry_view(entry: AddressSettingsEntry) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(entry).items() if v is not None}


def _resolved_view(resolved: ResolvedAddressSettings) -> dict[str, Any]:
    view = dataclasses.asdict(resolved)
    view["default_routing_type"] = resolved.default_routing_type.name.lower()
    return view


def _copy_for(message: WireMessage, queue: Queue) -> WireMessage:
    """A new message like ``message`` for ``queue``: a new id, no dedup id, addressed to the queue's address,
    without the dead-letter origin properties."""
    copy = list(message)
    copy[M_ID] = 0
    copy[M_DEDUP] = None
    copy[M_ADDRESS] = queue.address
    copy[M_ROUTING] = int(queue.routing_type)
    copy[M_PROPS] = {k: v for k, v in message[M_PROPS].items() if k not in _ORIGIN_PROPERTIES}
    return copy


__all__ = [
    "DEFAULT_PREVIEW_BYTES",
    "MAX_BROWSE_LIMIT",
    "MAX_PREVIEW_BYTES",
    "OperationError",
    "Operations",
    "check_selector",
    "client_matches",
    "message_view",
    "settings_entry",
]
