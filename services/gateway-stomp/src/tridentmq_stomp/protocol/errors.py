"""Exceptions of the STOMP codec."""

from __future__ import annotations


class StompError(Exception):
    """Base class: ``message`` goes in the ERROR frame's ``message`` header, ``detail`` in its body."""

    def __init__(self, message: str, detail: str = "", receipt_id: str | None = None) -> None:
        super().__init__(f"{message}: {detail}" if detail else message)
        self.message = message
        self.detail = detail
        self.receipt_id = receipt_id


class RemoteProtocolError(StompError):
    """The client broke the protocol: the connection has queued an ERROR frame and is closed."""


class LocalProtocolError(StompError):
    """This side used the codec in a way the protocol forbids (a bug in the caller)."""
