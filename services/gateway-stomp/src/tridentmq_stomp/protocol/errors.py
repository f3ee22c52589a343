"""Exceptions of the STOMP codec."""

from __future__ import annotations


class StompError(Exception):
    """Base class: ``message`` goes in the ERROR frame's ``message`` header, ``detail`` in its body."""

    def __init__(
        self, message: str, detail: str = "", receipt_id: str | None = None, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(f"{message}: {detail}" if detail else message)
        self.message = message
        self.detail = detail
        self.receipt_id = receipt_id
        self.headers = headers  # extra headers for the ERROR frame


class RemoteProtocolError(StompError):
    """The client broke the protocol. From ``receive_data`` it arrives as a ``ProtocolViolation`` event;
    ``handle_timeout`` raises it for a missed heart-beat, with the ERROR frame queued and the connection
    closed."""


class LocalProtocolError(StompError):
    """This side used the codec in a way the protocol forbids (a bug in the caller)."""
