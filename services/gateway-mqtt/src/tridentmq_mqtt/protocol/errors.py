"""Exceptions of the MQTT codec, each carrying the MQTT 5 reason code to answer with."""

from __future__ import annotations

from tridentmq_mqtt.protocol.reason_codes import MALFORMED_PACKET


class MqttError(Exception):
    """Base class. ``reason_code`` is what a 5.0 CONNACK or DISCONNECT should carry; before 5.0 the connection
    is simply closed (or, for a bad protocol version, answered with CONNACK return code 1)."""

    def __init__(self, message: str, reason_code: int = MALFORMED_PACKET) -> None:
        super().__init__(f"{message} (reason 0x{reason_code:02x})")
        self.message = message
        self.reason_code = reason_code


class RemoteProtocolError(MqttError):
    """The peer sent bytes the protocol forbids."""


class LocalProtocolError(MqttError):
    """This side asked the codec for something the protocol cannot express (a bug in the caller)."""
