"""What a CONNECT asks and what the gateway grants, without I/O: the client id (assigned when empty), the
session expiry in force, the keep alive the server sets, the CONNACK's properties, how long a will may wait,
and what a DISCONNECT may change. The session asks the core for the rest (the login, the session's lock and
record)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from tridentmq_mqtt.protocol import events as ev
from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.protocol.packets import V5, V31, Will
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_mqtt.settings import MqttLimitsSection

#: The session expiry interval that means "never expires" (5.0), and what a 3.1.1 session with clean session
#: 0 asks for.
NEVER: Final = 0xFFFFFFFF

#: Characters no topic may hold: a response information built from such a client id is left out.
_NOT_IN_TOPICS: Final = "+#\x00"


@dataclass(frozen=True, slots=True)
class Terms:
    """The CONNECT's terms as granted."""

    client_id: str
    assigned_client_id: str | None  # the id the server made for an empty one (5.0 CONNACK property)
    password: str | None
    asked_expiry_s: int  # what the client asked for (NEVER: a 3.1.1 persistent session)
    expiry_s: int  # the session expiry in force: the client's, capped by ``max_session_expiry_s``
    server_keep_alive: int | None  # 5.0: the keep alive the server sets instead of the client's (None: the client's)
    properties: Properties  # the 5.0 CONNACK's own properties (a capped expiry, response information)


@dataclass(frozen=True, slots=True)
class Refused:
    """A CONNECT to be answered with ``reason_code`` (the CONNACK's, in the client's version)."""

    reason_code: int
    text: str


def negotiate(event: ev.Connect, limits: MqttLimitsSection, new_client_id: Callable[[], str]) -> Terms | Refused:
    """The terms a CONNECT gets, or why it is refused before anyone is asked."""
    v5 = event.version == V5
    if v5 and event.properties.authentication_method is not None:
        # [MQTT-4.12.0-1]: a method the server does not support (it supports none) is refused and the connection
        # closed; accepting would leave the client waiting for an AUTH exchange that never comes.
        return Refused(rc.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not supported")
    client_id, assigned = event.client_id, None
    if not client_id:
        if event.version == V31:
            # 3.1 knows no empty client id: "between 1 and 23 characters long", else return code 2, Identifier
            # Rejected (MQTT V3.1, CONNECT payload). Longer ones are accepted, as 3.1.1 and 5.0 allow.
            return Refused(rc.CLIENT_IDENTIFIER_NOT_VALID, "MQTT 3.1 needs a client id")
        if not v5 and not event.clean_start:  # [MQTT-3.1.3-8]: return code 2
            return Refused(rc.CLIENT_IDENTIFIER_NOT_VALID, "an empty client id needs a clean session")
        client_id = assigned = new_client_id()
    try:
        password = event.password.decode("utf-8") if event.password is not None else None
    except UnicodeDecodeError:
        return Refused(rc.BAD_USER_NAME_OR_PASSWORD, "the password is not UTF-8")
    props = event.properties
    asked = (props.session_expiry_interval or 0) if v5 else (0 if event.clean_start else NEVER)
    expiry_s = min(asked, limits.max_session_expiry_s)
    server_keep_alive = None
    granted = NO_PROPERTIES
    if v5:
        if limits.max_keep_alive_s and not 0 < event.keep_alive <= limits.max_keep_alive_s:
            server_keep_alive = limits.max_keep_alive_s  # none (0), or longer than allowed: the maximum
        response_information = None
        if props.request_response_information and limits.response_information_prefix:
            response_information = f"{limits.response_information_prefix}{client_id}"
            if any(c in response_information for c in _NOT_IN_TOPICS):
                response_information = None
        if expiry_s != asked or response_information is not None:
            granted = Properties(
                session_expiry_interval=expiry_s if expiry_s != asked else None,
                response_information=response_information,
            )
    return Terms(client_id, assigned, password, asked, expiry_s, server_keep_alive, granted)


def will_delay_ms(will: Will, expiry_s: int) -> int:
    """How long the will waits after the connection is lost: its delay, but no longer than the session lasts
    (the will goes when the session ends, at the latest)."""
    return min(will.properties.will_delay_interval or 0, expiry_s) * 1000


def leaving(asked: int | None, limits: MqttLimitsSection) -> int | None:
    """The session expiry from a 5.0 DISCONNECT on (``asked``; None when it sets none, and the result too):
    capped as on CONNECT. One that sets it after a CONNECT that asked for 0 never gets here: the codec
    refuses it as a protocol error (5.0, 3.14.2.2.2)."""
    return None if asked is None else min(asked, limits.max_session_expiry_s)
