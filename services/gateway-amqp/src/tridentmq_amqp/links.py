"""The state the gateway keeps per AMQP link, and what it reads from and writes into proton's link objects:
termini (capabilities, the selector filter), transactional delivery states and coordinator messages."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

from proton import Data, symbol

from tridentmq_amqp import convert
from tridentmq_amqp.protocol.engine import wrap_delivery
from tridentmq_amqp.protocol.errors import DECODE_ERROR, RemoteProtocolError
from tridentmq_amqp.protocol.types import Described, decode
from tridentmq_shared.link.client import Consumer
from tridentmq_shared.message import WireMessage

SELECTOR_DESCRIPTORS: Final = (0x0000468C00000004, "apache.org:selector-filter:string")
# Transaction coordinator messages (by code or by name) and states (AMQP 1.0 part 4).
DECLARE: Final = (0x31, "amqp:declare:list")
DISCHARGE: Final = (0x32, "amqp:discharge:list")
DECLARED: Final = 0x33
TRANSACTIONAL_STATE: Final = 0x34

#: Outcomes inside a transactional state, when a client names them by symbol rather than by code.
OUTCOME_CODES: Final = {
    "amqp:accepted:list": 0x24,
    "amqp:rejected:list": 0x25,
    "amqp:released:list": 0x26,
    "amqp:modified:list": 0x27,
}


@dataclass(eq=False)
class Inbound:
    """A link on which the client sends messages to the gateway."""

    link: Any  # pn_link_t*
    node: convert.Node | None  # None: the anonymous relay (each message's ``to`` says where)
    window: int
    credit: int = 0  # transfers the client may still send (what the gateway granted, less what came)
    granted: int = 0  # transfers received since the credit was last topped up
    unconfirmed: int = 0  # unsettled transfers published and not yet answered by the core
    # (condition, description) of the detach the link waits for: it takes no more transfers, and is detached
    # once the core answered those published before (their outcomes go out first)
    closing: tuple[str, str] | None = None


@dataclass(eq=False)
class Outbound:
    """A link on which the gateway sends a core consumer's messages to the client."""

    link: Any  # pn_link_t*
    consumer: Consumer
    presettled: bool
    browse: bool  # shown, not taken: nothing is acknowledged
    queue: str
    durable: bool  # a durable subscription: closing the link (not detaching it) deletes the queue
    temporary: bool  # a subscription queue of this link only: deleted when the link ends
    shared: bool  # a shared subscription: its queue is others' too
    address: str  # the address the link consumes from
    max_message_size: int = 0  # the client's max-message-size for the link (0: none)
    lookup: bool = False  # attached by the subscription's name alone: closing it is a JMS unsubscribe
    pending: deque[tuple[int, WireMessage]] = field(default_factory=deque)  # fetched, waiting for credit
    # Waits for the client to read what was written; the deliveries wait in the consumer meanwhile.
    draining: asyncio.Task[None] | None = None


@dataclass(eq=False)
class Coordinator:
    link: Any  # pn_link_t*


def terminus_symbols(data: Data) -> list[str]:
    """The symbols of a terminus' capabilities (an array, or a single symbol)."""
    data.rewind()
    if not data.next():
        return []
    value = data.get_object()
    if isinstance(value, str):
        return [str(value)]
    if isinstance(value, list | tuple):
        return [str(v) for v in value if isinstance(v, str)]
    items = getattr(value, "elements", None)
    return [str(v) for v in items if isinstance(v, str)] if items is not None else []


def put_capabilities(data: Data, *names: str) -> None:
    data.put_array(described=False, element_type=Data.SYMBOL)
    data.enter()
    for name in names:
        data.put_symbol(symbol(name))
    data.exit()


def terminus_selector(data: Data) -> str | None:
    """The JMS selector of a source's filter set (``apache.org:selector-filter:string``)."""
    data.rewind()
    if not data.next():
        return None
    filters = data.get_object()
    if not isinstance(filters, dict):
        return None
    for value in filters.values():
        descriptor = getattr(value, "descriptor", None)
        if descriptor in SELECTOR_DESCRIPTORS and isinstance(value.value, str):
            return str(value.value)
    return None


def answer_filters(answer: Data, asked: Data) -> None:
    """The filter set of the attach's answer: the filters actually in place (AMQP 1.0 3.5.3), i.e. the client's
    selector, and none of those the gateway does not apply (no-local, legacy bindings ...): the client must see
    that they are missing, to detach if it needs them."""
    asked.rewind()
    filters = asked.get_object() if asked.next() else None
    answer.clear()
    if not isinstance(filters, dict):
        return
    kept = {
        key: value
        for key, value in filters.items()
        if getattr(value, "descriptor", None) in SELECTOR_DESCRIPTORS and isinstance(value.value, str)
    }
    if kept:
        answer.put_object(kept)


def txn_id_of(delivery: Any) -> bytes | None:
    return transactional_state(delivery)[0]


def transactional_state(delivery: Any) -> tuple[bytes | None, int | None]:
    """The txn-id and the outcome code (accepted 0x24, rejected 0x25 ...) of a transactional state."""
    wrapped = wrap_delivery(delivery)
    fields: Any = wrapped.remote.data  # typed as a list of int by proton, but it is the state's fields
    if not fields or not isinstance(fields[0], bytes | bytearray | memoryview):
        return None, None
    txn_id = bytes(fields[0])  # copied at once: proton's views point into memory it frees
    outcome = getattr(fields[1], "descriptor", None) if len(fields) > 1 else None
    if isinstance(outcome, str):  # the outcome named by its symbol rather than its code
        outcome = OUTCOME_CODES.get(outcome)
    return txn_id, int(outcome) if isinstance(outcome, int) else None


def coordinator_body(data: bytes) -> Described:
    """The declare or discharge carried by a message to the coordinator (its amqp-value section)."""
    offset = 0
    while offset < len(data):
        section, offset = decode(data, offset)
        if isinstance(section, Described) and section.descriptor in (0x77, "amqp:amqp-value:*"):
            body = section.value
            if isinstance(body, Described) and body.descriptor in (*DECLARE, *DISCHARGE):
                return body
    raise RemoteProtocolError("a coordinator message carries a declare or a discharge", DECODE_ERROR)
