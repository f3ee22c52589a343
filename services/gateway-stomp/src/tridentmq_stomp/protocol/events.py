"""Events produced by ``StompServerConnection.receive_data``: one per client frame, already checked for the
headers its command requires in the negotiated version."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Connect:
    """CONNECT or STOMP: answer with ``accept`` or ``refuse``."""

    version: str  # the negotiated version
    login: str | None
    passcode: str | None
    host: str | None
    heartbeat: tuple[int, int]  # the client's cx, cy in ms
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Send:
    destination: str
    transaction: str | None
    receipt: str | None
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Subscribe:
    id: str
    destination: str
    ack: str  # auto, client or client-individual
    receipt: str | None
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    id: str | None  # 1.0 may name the destination instead
    destination: str | None
    receipt: str | None
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Ack:
    """ACK (``nack`` False) or NACK. ``id`` is the MESSAGE's ``ack`` header (1.2) or its ``message-id``."""

    id: str
    subscription: str | None
    transaction: str | None
    receipt: str | None
    nack: bool


@dataclass(frozen=True, slots=True)
class Transaction:
    """BEGIN, COMMIT or ABORT."""

    command: str
    transaction: str
    receipt: str | None


@dataclass(frozen=True, slots=True)
class Disconnect:
    receipt: str | None


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The client closed its side (EOF)."""


@dataclass(frozen=True, slots=True)
class ProtocolViolation:
    """The client broke the protocol; nothing after it is read. It comes after the events of the frames
    before it, so the shell answers those first, then sends the ERROR (``StompServerConnection.reject``)."""

    message: str
    detail: str
    receipt_id: str | None
    headers: tuple[tuple[str, str], ...] = ()  # extra ERROR headers (``version`` for a version mismatch)


Event = Connect | Send | Subscribe | Unsubscribe | Ack | Transaction | Disconnect | ConnectionClosed | ProtocolViolation
