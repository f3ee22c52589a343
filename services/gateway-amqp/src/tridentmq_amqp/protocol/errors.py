"""Exceptions of the AMQP layers, each carrying the AMQP error condition to answer with."""

from __future__ import annotations

from typing import Final

DECODE_ERROR: Final = "amqp:decode-error"
INVALID_FIELD: Final = "amqp:invalid-field"
NOT_ALLOWED: Final = "amqp:not-allowed"
FRAME_SIZE_TOO_SMALL: Final = "amqp:frame-size-too-small"
INTERNAL_ERROR: Final = "amqp:internal-error"
UNAUTHORIZED: Final = "amqp:unauthorized-access"
NOT_FOUND: Final = "amqp:not-found"
RESOURCE_LIMIT: Final = "amqp:resource-limit-exceeded"
RESOURCE_LOCKED: Final = "amqp:resource-locked"
MESSAGE_SIZE: Final = "amqp:link:message-size-exceeded"
TRANSFER_LIMIT: Final = "amqp:link:transfer-limit-exceeded"
DETACH_FORCED: Final = "amqp:link:detach-forced"
CONNECTION_FORCED: Final = "amqp:connection:forced"
FRAMING_ERROR: Final = "amqp:connection:framing-error"
TX_UNKNOWN: Final = "amqp:transaction:unknown-id"
TX_ROLLBACK: Final = "amqp:transaction:rollback"


class AmqpError(Exception):
    """Base class: ``condition`` is the AMQP error condition symbol (``amqp:decode-error`` ...)."""

    def __init__(self, message: str, condition: str = DECODE_ERROR) -> None:
        super().__init__(f"{message} ({condition})")
        self.message = message
        self.condition = condition


class RemoteProtocolError(AmqpError):
    """The peer sent bytes the protocol forbids."""


class LocalProtocolError(AmqpError):
    """This side asked a layer for something the protocol cannot express (a bug in the caller)."""
