"""What a request to the broker is checked against before anything changes: its fields and the user's
permissions. A refusal is a ``BrokerError``, which the broker answers with its code and text."""

from __future__ import annotations

from typing import Any

from tridentmq_core.queues import Queue
from tridentmq_core.router import InvalidAddress, validate_address
from tridentmq_core.security import Permission, Principal
from tridentmq_core.selector import Selector, SelectorError, compile_selector
from tridentmq_core.sessions import Session
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import RoutingType
from tridentmq_shared.names import name_problem


class BrokerError(Exception):
    """A request the broker refuses; ``code`` is an ``ErrorCode`` and the text is shown to the client."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


def valid_address(address: str, *, wildcards: bool) -> str:
    try:
        return validate_address(address, allow_wildcards=wildcards)
    except InvalidAddress as exc:
        raise BrokerError(ErrorCode.INVALID, str(exc)) from None


def valid_queue_name(name: str) -> str:
    """A queue name a link asks to create: the rules of any name (not empty, ``MAX_NAME_LENGTH`` characters
    at most, no control characters). Checked where a queue is made, not where one is looked up, so a queue
    that came with older rules stays reachable."""
    problem = name_problem(name, "queue name")
    if problem is not None:
        raise BrokerError(ErrorCode.INVALID, problem)
    return name


def routing_type(value: Any) -> RoutingType:
    try:
        return RoutingType(value)
    except ValueError:
        raise BrokerError(ErrorCode.INVALID, f"unknown routing type {value!r}") from None


def compiled_filter(text: Any) -> Selector | None:
    """A queue's filter or a consumer's selector (none for no text)."""
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise BrokerError(ErrorCode.INVALID, "a selector is a string")
    try:
        return compile_selector(text)
    except SelectorError as exc:
        raise BrokerError(ErrorCode.INVALID, f"bad selector: {exc}") from None


def require(principal: Principal, permission: Permission, address: str) -> None:
    if not principal.allowed(permission, address):
        text = f"user {principal.name!r} lacks permission {permission.value} on {address!r}"
        refused = principal.refused_address(permission, address)
        if refused is not None and refused != address:  # a filter: say which address it would reach
            text += f" (it matches {refused!r})"
        raise BrokerError(ErrorCode.FORBIDDEN, text)


def require_create(principal: Principal, address: str, *, durable: bool, address_exists: bool) -> None:
    """The rights to create a queue on ``address`` (and the address itself when it does not exist)."""
    if not address_exists:
        require(principal, Permission.CREATE_ADDRESS, address)
    require(principal, Permission.CREATE_DURABLE_QUEUE if durable else Permission.CREATE_NON_DURABLE_QUEUE, address)


def require_delete(session: Session, queue: Queue) -> None:
    """A temporary queue is its own link's only; any other needs the right to delete it, unless its link owns it."""
    if queue.temporary and queue.owner is not session:
        raise BrokerError(ErrorCode.FORBIDDEN, f"temporary queue {queue.name!r} belongs to another link")
    if queue.owner is not session:
        kind = Permission.DELETE_DURABLE_QUEUE if queue.durable else Permission.DELETE_NON_DURABLE_QUEUE
        require(session.principal, kind, queue.address)
