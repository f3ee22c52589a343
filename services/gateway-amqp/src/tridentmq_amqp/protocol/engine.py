"""proton's AMQP 1.0 engine (Connection, server Transport, Collector) as a sans-IO object: bytes in, proton
events out, bytes to send, and a deadline for idle-timeout heartbeats.

proton is already a state machine without I/O; this is the glue that feeds it. The per-message calls go
straight to the C library (``lib``): the Python wrapper classes cost about five times as much, so they are
kept for the rare events (attach, detach, open, close).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, Final, cast

from cproton_ffi import ffi, lib
from proton import Collector, Connection, Data, Delivery, Link, Session, Transport, symbol

from tridentmq_amqp.protocol.nul_names import NulNames
from tridentmq_amqp.protocol.types import Described, Symbol, encode

NULL: Final = ffi.NULL
_CLOSE: Final = 0x18
_ERROR: Final = 0x1D
#: Bytes read from proton's output per call; more calls when there is more.
_OUTPUT_CHUNK: Final = 256 * 1024
#: The buffer proton's output is read into and copied out of at once. One for the process, not one per
#: connection: a quarter of a megabyte per engine made every idle or half-open connection that much heavier.
#: Engines run on one thread (the event loop's), and nothing keeps a view of it past ``data_to_send``.
_OUTPUT: Final = bytearray(_OUTPUT_CHUNK)
_OUTPUT_VIEW: Final = ffi.from_buffer(_OUTPUT)
_OUTPUT_MEMORY: Final = memoryview(_OUTPUT)
OPEN_FAILED: Final = "amqp:connection-establishment-failed"


class Engine:
    """One client connection's AMQP engine, after SASL (the SASL layer hands it the plain AMQP stream)."""

    def __init__(
        self,
        *,
        container_id: str,
        max_frame_bytes: int,
        channel_max: int,
        idle_timeout_ms: int,
        offered_capabilities: Iterable[str] = (),
    ) -> None:
        self.connection = Connection()
        self.connection.container = container_id
        capabilities = [symbol(c) for c in offered_capabilities]
        if capabilities:
            self.connection.offered_capabilities = capabilities
        self.transport = Transport(Transport.SERVER)
        self.transport.max_frame_size = max_frame_bytes
        self.transport.channel_max = channel_max
        if idle_timeout_ms > 0:
            # proton announces half its own timeout (so that peers heartbeat with room to spare): announce
            # the setting, and close after twice that long without a frame.
            self.transport.idle_timeout = 2 * idle_timeout_ms / 1000
        self.collector = Collector()
        self.transport.bind(self.connection)
        self.connection.collect(self.collector)
        # The raw handles of the hot path.
        self.pn_transport: Any = self.transport._impl
        self.pn_connection: Any = self.connection._impl
        self.pn_collector: Any = self.collector._impl
        self._input = bytearray()  # bytes beyond what the transport could take so far
        self.tail_closed = False
        #: NULs in names, which proton would cut short: seen in the bytes before proton reads them.
        self.nul_names = NulNames()

    # ------------------------------------------------------------------ the OPEN
    def desired_capabilities(self) -> Data:
        """The capabilities the client's OPEN desires, as proton decoded them (an array, or a single symbol)."""
        return Data(lib.pn_connection_remote_desired_capabilities(self.connection._impl))

    def offer(self, capability: str) -> None:
        """Offer ``capability`` too, in the OPEN not sent yet."""
        offered = list(self.connection.offered_capabilities or ())
        self.connection.offered_capabilities = [*offered, symbol(capability)]

    def open_failed(self) -> None:
        """Mark the OPEN not sent yet as one a CLOSE follows at once (``amqp:connection-establishment-failed``,
        as the AMQP JMS mapping has it): the client reads the CLOSE's error instead of taking the connection."""
        self.connection.properties = {symbol(OPEN_FAILED): True}

    # ------------------------------------------------------------------ input
    def receive_data(self, data: bytes) -> None:
        """Bytes from the client (``b""``: it closed its side). What the transport cannot take yet stays
        buffered until ``pump_input`` after the events were handled."""
        if not data:
            self._close_tail()
            return
        self.nul_names.feed(data)
        if self._input:
            self._input += data
            self.pump_input()
            return
        self._push(data)

    def _push(self, data: bytes | bytearray) -> int:
        transport = self.pn_transport
        capacity = lib.pn_transport_capacity(transport)
        if capacity < 0:  # the transport's input side is closed (an error): nothing more is read
            return len(data)
        taken: int = min(capacity, len(data))
        if taken:
            lib.pn_transport_push(transport, ffi.from_buffer(data), taken)
        if taken < len(data):
            self._input += data[taken:]
        return taken

    def pump_input(self) -> None:
        """Give the transport what it could not take before (called after the events were handled)."""
        if self._input:
            data = bytes(self._input)
            self._input.clear()
            self._push(data)

    @property
    def buffered_input(self) -> int:
        return len(self._input)

    def _close_tail(self) -> None:
        if not self.tail_closed:
            self.tail_closed = True
            lib.pn_transport_close_tail(self.pn_transport)

    # ------------------------------------------------------------------ output
    def data_to_send(self) -> bytes:
        transport = self.pn_transport
        chunks = []
        while (pending := lib.pn_transport_pending(transport)) > 0:
            size = min(pending, _OUTPUT_CHUNK)
            if lib.pn_transport_peek(transport, _OUTPUT_VIEW, size) < 0:
                break
            chunks.append(_OUTPUT_MEMORY[:size].tobytes())
            lib.pn_transport_pop(transport, size)
        return b"".join(chunks) if len(chunks) != 1 else chunks[0]

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> float | None:
        """Let proton send heartbeats and detect a silent client; returns the next deadline (seconds on the
        same clock as ``now``) or None."""
        deadline_ms = lib.pn_transport_tick(self.pn_transport, int(now * 1000))
        return deadline_ms / 1000 if deadline_ms else None

    # ------------------------------------------------------------------ state
    @property
    def closed(self) -> bool:
        """Both directions of the transport are done: nothing more to read or write."""
        return bool(lib.pn_transport_closed(self.pn_transport)) and lib.pn_transport_pending(self.pn_transport) <= 0

    def error(self) -> tuple[str, str] | None:
        """The transport's error condition (name, description), if any."""
        condition = self.transport.condition
        if condition is None:
            return None
        return str(condition.name), str(condition.description or "")


# The wrappers of the rare events, typed (proton's ``wrap`` functions are not).
def wrap_link(pn_link: Any) -> Link:
    return cast(Link, Link.wrap(pn_link))  # type: ignore[no-untyped-call]


def link_name(link: Link) -> str | None:
    """The link's name, None when its ATTACH had none (a mandatory field, which proton lets by)."""
    return cast("str | None", link.name)


def wrap_session(pn_session: Any) -> Session:
    return cast(Session, Session.wrap(pn_session))  # type: ignore[no-untyped-call]


def wrap_delivery(pn_delivery: Any) -> Delivery:
    return cast(Delivery, Delivery.wrap(pn_delivery))  # type: ignore[no-untyped-call]


def field_info(field: str) -> dict[Any, Any]:
    """The info map of an ``amqp:invalid-field`` error naming the field (``{invalid-field: container-id}``)."""
    return {symbol("invalid-field"): symbol(field)}


def close_frame(condition: str, description: str) -> bytes:
    """A CLOSE frame with an error, for the one case proton writes none: the peer has not sent its OPEN."""
    body = encode(Described(_CLOSE, [Described(_ERROR, [Symbol(condition), description])]))
    return struct.pack(">IBBH", 8 + len(body), 2, 0, 0) + body
