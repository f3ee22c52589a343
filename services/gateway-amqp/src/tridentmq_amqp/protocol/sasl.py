"""The server side of AMQP 1.0 SASL (spec part 5.3), sans-IO, in front of proton's engine.

The PyPI build of python-qpid-proton has no Cyrus SASL, so the gateway authenticates here and hands proton a
plain AMQP connection: from the client's ``AMQP 0 1.0.0`` header on, the bytes come out as ``Passthrough``
events, untouched, the first one starting with that header.

The exchange:

1. The client sends ``AMQP 3 1.0.0``; the layer answers with the same header and sasl-mechanisms.
2. The client sends sasl-init; the layer reports an ``AuthRequest``. The application checks the credentials and
   calls ``outcome``. Whatever the client pipelined behind its sasl-init (the AMQP header, its open...) is held
   until then, up to ``max_pending_bytes``: the shell should stop reading while it decides.
3. ``outcome(True)`` queues sasl-outcome ok and returns the held bytes; from then on ``receive_data`` is one
   branch and a list. ``outcome(False, code)`` queues sasl-outcome with the code and sets ``closed``.

Decisions:

* Only PLAIN and ANONYMOUS are implemented. Both finish in one round trip, so sasl-challenge/response never
  occur, and any SASL frame but one sasl-init from the client is a protocol error.
* A sasl-init naming a mechanism the layer did not offer is refused by the layer itself (sasl-outcome auth,
  then ``RemoteProtocolError``), so the application only ever judges requests whose credentials it can read.
* PLAIN (RFC 4616): a response that is not three NUL-separated UTF-8 fields, or is missing, is refused (auth).
  So is an authzid other than empty or the authcid: acting for another identity is not supported, and the RFC
  says to fail rather than ignore it. An empty username or password is passed on, for the authenticator to
  refuse. ANONYMOUS: the optional trace text is not interpreted.
* A client that starts with ``AMQP 0 1.0.0`` skipped SASL: with ``allow_no_sasl`` everything passes through and
  the connection is anonymous, otherwise it is refused like any other header we do not speak (not ``AMQP``,
  TLS, other versions): our SASL header is queued and the connection closed (spec part 2.2).
* Malformed or unexpected SASL frames, and bytes behind the sasl-init that are not the AMQP header, end the
  exchange with sasl-outcome sys-perm (a client retrying the same bytes cannot succeed), so a client learns
  why rather than seeing a reset. A bad header after an ok outcome is answered with the AMQP header.

Every refusal queues its answer, sets ``closed`` and then raises ``RemoteProtocolError``: the shell sends
``data_to_send()`` and closes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import Enum
from typing import Final

from tridentmq_amqp.protocol.errors import DECODE_ERROR, NOT_ALLOWED, LocalProtocolError, RemoteProtocolError
from tridentmq_amqp.protocol.types import Array, Described, Symbol, UByte, decode, encode

SASL_HEADER: Final = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER: Final = b"AMQP\x00\x01\x00\x00"
MECHANISMS: Final = ("PLAIN", "ANONYMOUS")  # those the layer can read credentials from

# sasl-code (5.3.3.6)
OK: Final = 0
AUTH: Final = 1
SYS: Final = 2
SYS_PERM: Final = 3
SYS_TEMP: Final = 4

#: The spec caps SASL frames at MIN-MAX-FRAME-SIZE (512), but clients put OAuth tokens and JWTs of a few KiB in
#: PLAIN passwords, and proton accepts them. 8 KiB holds those while bounding what an unauthenticated peer can
#: make us buffer; the limit cannot go below 512, which every client may use.
DEFAULT_MAX_FRAME_BYTES: Final = 8192
MIN_MAX_FRAME_SIZE: Final = 512
#: Bytes pipelined behind a sasl-init held until ``outcome``: room for a header, open, begin and attaches.
DEFAULT_MAX_PENDING_BYTES: Final = 65_536

_SASL_FRAME: Final = 0x01
_FRAME_HEAD: Final = struct.Struct(">IBBH")  # size, doff, type, ignored (channel)
_SASL_MECHANISMS: Final = 0x40
_SASL_INIT: Final = 0x41
_SASL_OUTCOME: Final = 0x44
_NAMES: Final = {
    0x40: "sasl-mechanisms",
    0x41: "sasl-init",
    0x42: "sasl-challenge",
    0x43: "sasl-response",
    0x44: "sasl-outcome",
}
_SYMBOLIC: Final = {f"amqp:{name}:list": code for code, name in _NAMES.items()}  # descriptors may be symbols


@dataclass(frozen=True, slots=True)
class AuthRequest:
    """The client asked to authenticate: the application checks and calls ``SaslLayer.outcome``.

    ``username``/``password`` are PLAIN's authcid and password; both ``None`` for ANONYMOUS."""

    mechanism: str
    username: str | None
    password: str | None
    hostname: str | None


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Bytes of the AMQP connection proper, for the engine (the first one starts with the AMQP header)."""

    data: bytes


class _State(Enum):
    HEADER = "awaiting the protocol header"
    INIT = "awaiting sasl-init"
    DECIDING = "awaiting outcome()"
    AMQP_HEADER = "awaiting the AMQP header after SASL"
    PASSTHROUGH = "passing through"
    CLOSED = "closed"


def sasl_frame(descriptor: int, fields: list[object]) -> bytes:
    """One SASL frame: the 8-byte header (DOFF 2, type 1, channel 0) and the described list."""
    body = encode(Described(descriptor, fields))
    return _FRAME_HEAD.pack(_FRAME_HEAD.size + len(body), 2, _SASL_FRAME, 0) + body


_OUTCOMES: Final = {code: sasl_frame(_SASL_OUTCOME, [UByte(code)]) for code in (OK, AUTH, SYS, SYS_PERM, SYS_TEMP)}


class SaslLayer:
    """The server side of one connection's SASL exchange (see the module docstring)."""

    def __init__(
        self,
        *,
        mechanisms: tuple[str, ...] = MECHANISMS,
        allow_no_sasl: bool = True,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        """``mechanisms`` are offered in order of preference; ``allow_no_sasl`` admits clients that skip SASL
        (as anonymous); ``max_frame_bytes`` bounds a SASL frame, ``max_pending_bytes`` the bytes held behind a
        sasl-init until ``outcome``."""
        if not mechanisms or len(set(mechanisms)) != len(mechanisms) or not set(mechanisms) <= set(MECHANISMS):
            raise LocalProtocolError(f"mechanisms {mechanisms!r}: need distinct ones among {MECHANISMS}")
        if not MIN_MAX_FRAME_SIZE <= max_frame_bytes <= 0xFFFFFFFF:
            raise LocalProtocolError(f"maximum SASL frame size {max_frame_bytes} is out of range")
        if max_pending_bytes < len(AMQP_HEADER):
            raise LocalProtocolError(f"maximum pending bytes {max_pending_bytes} cannot hold the AMQP header")
        self.mechanisms = mechanisms
        self.allow_no_sasl = allow_no_sasl
        self.max_frame_bytes = max_frame_bytes
        self.max_pending_bytes = max_pending_bytes
        self._state = _State.HEADER
        self._passthrough = False  # the fast path's only test
        self._anonymous = False
        self._buf = bytearray()
        self._out = bytearray()
        self._mechanisms_frame = sasl_frame(_SASL_MECHANISMS, [Array([Symbol(m) for m in mechanisms])])

    @property
    def done(self) -> bool:
        """SASL finished with success (or was skipped): everything now passes through (the first
        ``Passthrough`` waits until the whole AMQP header is in)."""
        return self._passthrough or self._state is _State.AMQP_HEADER

    @property
    def anonymous_without_sasl(self) -> bool:
        """The client skipped SASL (admitted because ``allow_no_sasl``)."""
        return self._anonymous

    @property
    def closed(self) -> bool:
        """The layer wants the connection closed once ``data_to_send()`` is sent (a refusal, or EOF during SASL)."""
        return self._state is _State.CLOSED

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    # ------------------------------------------------------------------ input
    def receive_data(self, data: bytes) -> list[AuthRequest | Passthrough]:
        """Feed bytes from the client; ``b""`` means it closed its side. Once the engine has its first
        ``Passthrough`` an EOF comes back as ``Passthrough(b"")`` for it to see; before, it closes the layer."""
        if self._passthrough:
            return [Passthrough(data)]
        if self._state is _State.CLOSED:
            return []
        if not data:
            self._close()
            return []
        self._buf += data
        try:
            return self._advance()
        except RemoteProtocolError:
            self._refuse(SYS_PERM)
            raise

    def _advance(self) -> list[AuthRequest | Passthrough]:
        events: list[AuthRequest | Passthrough] = []
        buf = self._buf
        if self._state is _State.HEADER:
            if buf[:4] != SASL_HEADER[: min(len(buf), 4)]:  # not AMQP at all: no need to wait for 8 bytes
                raise RemoteProtocolError(f"protocol header {bytes(buf[:8])!r} is not AMQP's")
            if len(buf) < len(SASL_HEADER):
                return events
            header = bytes(buf[:8])
            if header == AMQP_HEADER and self.allow_no_sasl:
                self._anonymous = True
                return [self._start_passthrough()]
            if header != SASL_HEADER:
                what = "a connection without SASL" if header == AMQP_HEADER else f"protocol header {header!r}"
                raise RemoteProtocolError(f"{what} is not supported", NOT_ALLOWED)
            del buf[:8]
            self._out += SASL_HEADER
            self._out += self._mechanisms_frame
            self._state = _State.INIT
        if self._state is _State.INIT:
            body = self._next_frame()
            if body is None:
                return events
            events.append(self._sasl_init(body))
            self._state = _State.DECIDING
        # DECIDING or AMQP_HEADER: what follows the sasl-init must be the AMQP header (no mechanism here sends a
        # sasl-response); checked as it arrives so that a pipelined mistake is caught before outcome()
        n = min(len(buf), 8)
        if buf[:n] != AMQP_HEADER[:n]:
            raise RemoteProtocolError(f"expected the AMQP header after sasl-init, got {bytes(buf[:8])!r}")
        if len(buf) > self.max_pending_bytes:
            raise RemoteProtocolError(f"more than {self.max_pending_bytes} bytes sent before the SASL outcome")
        if self._state is _State.AMQP_HEADER and n == 8:
            events.append(self._start_passthrough())
        return events

    def _next_frame(self) -> bytes | None:
        """The body of the next complete SASL frame in the buffer (removed from it), or None until it is all in."""
        buf = self._buf
        if len(buf) < 4:
            return None
        size = int.from_bytes(buf[:4], "big")
        if size > self.max_frame_bytes:
            raise RemoteProtocolError(f"SASL frame of {size} bytes exceeds the limit of {self.max_frame_bytes}")
        if len(buf) < _FRAME_HEAD.size:
            return None
        _, doff, frame_type, _ = _FRAME_HEAD.unpack_from(buf)
        if frame_type != _SASL_FRAME:
            raise RemoteProtocolError(f"frame type {frame_type} during SASL (expected {_SASL_FRAME})")
        if doff < 2 or doff * 4 >= size:  # the extended header is ignored; an empty frame is an error (5.3.1)
            raise RemoteProtocolError(f"SASL frame of {size} bytes with data offset {doff}: no body")
        if len(buf) < size:
            return None
        body = bytes(buf[doff * 4 : size])
        del buf[:size]
        return body

    def _sasl_init(self, body: bytes) -> AuthRequest:
        value, end = decode(body)
        if end != len(body):
            raise RemoteProtocolError(f"{len(body) - end} bytes follow the SASL frame's body")
        if not isinstance(value, Described) or not isinstance(value.value, list):
            raise RemoteProtocolError(f"SASL frame body {value!r} is not a described list")
        descriptor = value.descriptor
        code = _SYMBOLIC.get(descriptor) if isinstance(descriptor, str) else descriptor
        if code != _SASL_INIT:
            name = _NAMES.get(code) if isinstance(code, int) else None  # descriptors may be anything, even a list
            raise RemoteProtocolError(f"{name or f'descriptor {descriptor!r}'} from the client (expected sasl-init)")
        fields = [*value.value, None, None, None]  # trailing fields may be omitted; later versions may add some
        mechanism, response, hostname = fields[:3]
        if not isinstance(mechanism, Symbol):
            raise RemoteProtocolError(f"sasl-init mechanism {mechanism!r} is not a symbol", DECODE_ERROR)
        if response is not None and not isinstance(response, bytes):
            raise RemoteProtocolError(f"sasl-init initial-response {response!r} is not binary")
        if hostname is not None and not isinstance(hostname, str):
            raise RemoteProtocolError(f"sasl-init hostname {hostname!r} is not a string")
        if mechanism not in self.mechanisms:
            self._refuse(AUTH)
            raise RemoteProtocolError(f"mechanism {str(mechanism)!r} was not offered", NOT_ALLOWED)
        if mechanism == "ANONYMOUS":
            return AuthRequest("ANONYMOUS", None, None, hostname)
        username, password = self._plain(response)
        return AuthRequest("PLAIN", username, password, hostname)

    def _plain(self, response: bytes | None) -> tuple[str, str]:
        """authzid NUL authcid NUL passwd (RFC 4616) as (authcid, passwd)."""
        parts = [] if response is None else response.split(b"\x00")
        if len(parts) != 3:
            self._refuse(AUTH)
            raise RemoteProtocolError("PLAIN initial response is not authzid NUL authcid NUL password")
        try:
            authzid, username, password = (part.decode() for part in parts)
        except UnicodeDecodeError:
            self._refuse(AUTH)
            raise RemoteProtocolError("PLAIN initial response is not UTF-8") from None
        if authzid and authzid != username:
            self._refuse(AUTH)
            raise RemoteProtocolError(f"PLAIN authzid {authzid!r} differs from the username", NOT_ALLOWED)
        return username, password

    # ------------------------------------------------------------------ decisions
    def outcome(self, ok: bool, code: int = AUTH) -> list[Passthrough]:
        """Answer the ``AuthRequest``: ok, or a failure ``code`` (1 auth, 2 sys, 3 sys-perm, 4 sys-temp) after
        which the connection closes. When ok, returns the bytes held behind the sasl-init (nothing if the
        AMQP header is not complete yet). Ignored once the layer is closed (the client may have gone meanwhile).
        Call it as ``outcome(ok=...)``: ruff (FBT003) flags a positional boolean."""
        if self._state is _State.CLOSED:
            return []
        if self._state is not _State.DECIDING:
            raise LocalProtocolError(f"outcome() while {self._state.value}")
        if not ok:
            if code not in (AUTH, SYS, SYS_PERM, SYS_TEMP):
                raise LocalProtocolError(f"sasl-code {code} is not a failure")
            self._refuse(code)
            return []
        self._out += _OUTCOMES[OK]
        self._state = _State.AMQP_HEADER
        if len(self._buf) < len(AMQP_HEADER):
            return []
        return [self._start_passthrough()]

    # ------------------------------------------------------------------ helpers
    def _start_passthrough(self) -> Passthrough:
        """The AMQP header is in the buffer: hand it and whatever followed to the engine, then pass through."""
        self._state = _State.PASSTHROUGH
        self._passthrough = True
        data = bytes(self._buf)
        self._buf = bytearray()
        return Passthrough(data)

    def _refuse(self, code: int) -> None:
        """Queue the answer to a refusal in the current state and close."""
        match self._state:
            case _State.HEADER:
                self._out += SASL_HEADER  # the header we speak (spec 2.2)
            case _State.INIT | _State.DECIDING:
                self._out += _OUTCOMES[code]
            case _State.AMQP_HEADER:
                self._out += AMQP_HEADER
            case _:
                pass
        self._close()

    def _close(self) -> None:
        self._state = _State.CLOSED
        self._buf = bytearray()
