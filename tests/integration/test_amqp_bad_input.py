"""Bad input at the AMQP 1.0 gateway, against real gateway and core processes over real sockets.

Every case sends raw bytes (frames built with the gateway's own type codec) and asserts the exact answer at
the protocol level: the protocol header, the sasl-outcome code, or the error condition of the CLOSE, END or
DETACH, sent before the socket closes. After each, a normal proton client still sends and receives, and the
gateway's log has no traceback (checked when it stops).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import pytest
from proton import Message
from proton.utils import BlockingConnection
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    basic_auth,
    module_amqp_gateway,
    module_core,
    shared,
    start_core,
    start_gateway,
    stop_cleanly,
    stop_core_cleanly,
)
from tests.integration.blocking_sender import send_before_reading

from tridentmq_amqp.protocol.types import Described, Symbol, UByte, UInt, ULong, decode, encode

pytestmark = pytest.mark.integration

WAIT = 10.0  # generous: every wait below ends as soon as its condition holds
ANSWER = 3.0  # for an answer due at once (an error, a timer of 500 ms): waiting this long means it never comes
SASL_HEADER: Final = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER: Final = b"AMQP\x00\x01\x00\x00"
AMQP_FRAME: Final = 0
SASL_FRAME: Final = 1
_HEAD: Final = struct.Struct(">IBBH")  # size, doff, type, channel

OPEN, BEGIN, ATTACH, FLOW, TRANSFER, DISPOSITION, DETACH, END, CLOSE = range(0x10, 0x19)
SASL_MECHANISMS, SASL_INIT, SASL_CHALLENGE, SASL_RESPONSE, SASL_OUTCOME = range(0x40, 0x45)
NAMES: Final = {
    OPEN: "open",
    BEGIN: "begin",
    ATTACH: "attach",
    FLOW: "flow",
    TRANSFER: "transfer",
    DISPOSITION: "disposition",
    DETACH: "detach",
    END: "end",
    CLOSE: "close",
    SASL_MECHANISMS: "sasl-mechanisms",
    SASL_INIT: "sasl-init",
    SASL_CHALLENGE: "sasl-challenge",
    SASL_RESPONSE: "sasl-response",
    SASL_OUTCOME: "sasl-outcome",
}
ERROR: Final = 0x1D
SOURCE: Final = 0x28
TARGET: Final = 0x29
ACCEPTED: Final = 0x24
REJECTED: Final = 0x25
RELEASED: Final = 0x26
AMQP_VALUE: Final = 0x77
DATA: Final = 0x75
SASL_OK, SASL_AUTH, SASL_SYS, SASL_SYS_PERM, SASL_SYS_TEMP = range(5)

USER, PASSWORD = "app", "secret"
#: A core with one user: everything on open.#, only consume on consumeonly.#, nothing on secret.#.
_ALL = (
    "send",
    "consume",
    "browse",
    "createAddress",
    "createDurableQueue",
    "createNonDurableQueue",
    "deleteDurableQueue",
    "deleteNonDurableQueue",
)
ADMIN: Final = ("ops", "ops-secret")  # reads the management API (manage on everything), nothing else
SECURED_CONFIG: Final = (
    f'[[users]]\nname = "{USER}"\npassword = "{PASSWORD}"\nroles = ["app"]\n'
    f'[[users]]\nname = "{ADMIN[0]}"\npassword = "{ADMIN[1]}"\nroles = ["ops"]\n'
    '[[permissions]]\nmatch = "#"\npermission = "manage"\nroles = ["ops"]\n'
    + "".join(f'[[permissions]]\nmatch = "open.#"\npermission = "{p}"\nroles = ["app"]\n' for p in _ALL)
    + "".join(
        f'[[permissions]]\nmatch = "consumeonly.#"\npermission = "{p}"\nroles = ["app"]\n'
        for p in ("consume", "createAddress", "createDurableQueue")
    )
)


# ------------------------------------------------------------------------------------------------ frames
def frame(code: int, fields: list[Any], *, channel: int = 0, payload: bytes = b"", kind: int = AMQP_FRAME) -> bytes:
    """One frame: the 8-byte header (doff 2), the performative (a described list) and the payload."""
    body = encode(Described(ULong(code), fields)) + payload
    return _HEAD.pack(_HEAD.size + len(body), 2, kind, channel) + body


def raw_frame(body: bytes, *, channel: int = 0, kind: int = AMQP_FRAME) -> bytes:
    return _HEAD.pack(_HEAD.size + len(body), 2, kind, channel) + body


def open_frame(container: str = "raw-client", **fields: Any) -> bytes:
    values = [container, None, fields.get("max_frame_size"), fields.get("channel_max"), fields.get("idle_time_out")]
    while values[-1] is None:
        values.pop()
    return frame(OPEN, values)


def begin_frame(channel: int = 0) -> bytes:
    return frame(BEGIN, [None, UInt(0), UInt(65536), UInt(65536)], channel=channel)


def attach_sender(name: str, handle: int, address: str | None, *, channel: int = 0) -> bytes:
    """The client sends: role sender (false), unsettled, with the initial delivery-count a sender must give."""
    return frame(
        ATTACH,
        [
            name,
            UInt(handle),
            False,
            UByte(0),
            UByte(0),
            Described(ULong(SOURCE), [None]),
            Described(ULong(TARGET), [address]),
            None,
            False,
            UInt(0),
        ],
        channel=channel,
    )


def attach_receiver(name: str, handle: int, address: str | None, *, channel: int = 0) -> bytes:
    return frame(
        ATTACH,
        [
            name,
            UInt(handle),
            True,
            UByte(0),
            UByte(0),
            Described(ULong(SOURCE), [address]),
            Described(ULong(TARGET), [None]),
        ],
        channel=channel,
    )


def message_bytes(body: str | bytes, *, to: str | None = None) -> bytes:
    sections = b""
    if to is not None:
        sections += encode(Described(ULong(0x73), [None, None, to]))  # properties: message-id, user-id, to
    if isinstance(body, bytes):
        return sections + encode(Described(ULong(DATA), body))
    return sections + encode(Described(ULong(AMQP_VALUE), body))


def transfer_frame(
    handle: int, delivery_id: int, payload: bytes, *, more: bool = False, channel: int = 0, first: bool = True
) -> bytes:
    """A transfer; the continuation frames of a multi-frame delivery (``first=False``) may omit the ids."""
    if first:
        fields: list[Any] = [UInt(handle), UInt(delivery_id), f"t{delivery_id}".encode(), UInt(0), False, more]
    else:
        fields = [UInt(handle), None, None, None, False, more]
    return frame(TRANSFER, fields, channel=channel, payload=payload)


def sasl_init(mechanism: str, response: bytes | None = None) -> bytes:
    return frame(SASL_INIT, [Symbol(mechanism), response], kind=SASL_FRAME)


def plain(user: str, password: str) -> bytes:
    return sasl_init("PLAIN", f"\x00{user}\x00{password}".encode())


@dataclass
class Frame:
    kind: int
    channel: int
    code: int | None  # None: an empty frame (a heartbeat)
    fields: list[Any]
    payload: bytes

    @property
    def name(self) -> str:
        return "empty" if self.code is None else NAMES.get(self.code, hex(self.code))

    def field(self, index: int) -> Any:
        return self.fields[index] if index < len(self.fields) else None

    @property
    def error(self) -> tuple[str, str] | None:
        """(condition, description) of a close, end or detach."""
        value = self.field(2 if self.code == DETACH else 0)
        if value is None:
            return None
        assert isinstance(value, Described), value
        assert value.descriptor == ERROR, value
        condition, description = [*value.value, None, None][:2]
        return str(condition), str(description or "")

    @property
    def condition(self) -> str | None:
        error = self.error
        return None if error is None else error[0]

    def __repr__(self) -> str:
        return f"<{self.name} ch={self.channel} {self.fields!r}{f' +{len(self.payload)}B' if self.payload else ''}>"


def parse_frame(data: bytes) -> Frame:
    size, doff, kind, channel = _HEAD.unpack_from(data)
    assert size == len(data), data[:16]
    assert doff >= 2, data[:16]
    body = data[doff * 4 :]
    if not body:
        return Frame(kind, channel, None, [], b"")
    value, end = decode(body)
    assert isinstance(value, Described), value
    code = value.descriptor
    assert isinstance(code, int), value
    return Frame(kind, channel, code, list(value.value), body[end:])


class Peer:
    """A raw AMQP client socket that reads the protocol header and whole frames."""

    def __init__(self, port: int, timeout: float = WAIT) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.eof = False

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send(self, *chunks: bytes) -> None:
        self.sock.sendall(b"".join(chunks))

    def _fill(self, size: int) -> bool:
        """Read until ``size`` bytes are buffered; False at EOF (a reset counts as EOF)."""
        while len(self.buffer) < size:
            if self.eof:
                return False
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
                return False
            self.buffer += chunk
        return True

    def header(self) -> bytes:
        """The 8-byte protocol header (fewer bytes if the server closed before sending all of it)."""
        self._fill(8)
        header, self.buffer = self.buffer[:8], self.buffer[8:]
        return header

    def frame(self) -> Frame | None:
        """The next frame, heartbeats included; None when the server closed."""
        if not self._fill(4):
            assert not self.buffer, f"the server closed in a frame: {self.buffer!r}"
            return None
        size = int.from_bytes(self.buffer[:4], "big")
        assert size >= 8, f"a frame of {size} bytes from the server"
        assert self._fill(size), f"the server closed in a frame: {self.buffer[:64]!r}"
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return parse_frame(data)

    def next(self) -> Frame:
        """The next frame that is not a heartbeat or a session's flow (one without a link handle)."""
        while (got := self.frame()) is not None:
            if got.code is not None and not (got.code == FLOW and got.field(4) is None):
                return got
        raise AssertionError("the server closed the connection")

    def expect(self, code: int) -> Frame:
        got = self.next()
        assert got.code == code, f"expected {NAMES[code]}, got {got}"
        return got

    def until_closed(self) -> list[Frame]:
        """Every frame (heartbeats left out) until the server closes; a server that never closes fails on the
        socket's timeout."""
        frames = []
        while (got := self.frame()) is not None:
            if got.code is not None:
                frames.append(got)
        return frames

    def open(self, user: str | None = None, password: str | None = None) -> Frame:
        """Connect (PLAIN when a user is given, else without SASL) and return the gateway's OPEN."""
        if user is None:
            self.send(AMQP_HEADER, open_frame())
        else:
            self.send(SASL_HEADER, plain(user, password or ""), AMQP_HEADER, open_frame())
            assert self.header() == SASL_HEADER
            self.expect(SASL_MECHANISMS)
            outcome = self.expect(SASL_OUTCOME)
            assert outcome.field(0) == SASL_OK, outcome
        assert self.header() == AMQP_HEADER
        return self.expect(OPEN)

    def begin(self, channel: int = 0) -> Frame:
        self.send(begin_frame(channel))
        return self.expect(BEGIN)

    def attach_sender(self, name: str, handle: int, address: str | None) -> tuple[Frame, Frame]:
        """Attach a sending link; returns the gateway's attach and the flow granting credit."""
        self.send(attach_sender(name, handle, address))
        attach = self.expect(ATTACH)
        assert attach.field(6) is not None, f"the link was refused: {attach} {self.next()}"
        return attach, self.expect(FLOW)


def assert_closed_with(frames: list[Frame], condition: str | None = None) -> Frame:
    """The last frame before the socket closed is a CLOSE with an ``amqp:`` error condition."""
    assert frames, "the gateway closed the socket without a CLOSE"
    close = frames[-1]
    assert close.code == CLOSE, f"the last frame before the socket closed: {frames}"
    assert close.condition is not None, f"a CLOSE without an error: {close}"
    assert close.condition.startswith("amqp:"), close
    if condition is not None:
        assert close.condition == condition, close
    return close


# ------------------------------------------------------------------------------------------------ health
def unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def assert_serves(gateway: GatewayProcess, prefix: str = "healthy", **auth: Any) -> None:
    """A normal proton client still sends and receives a message."""
    queue = unique(prefix)
    conn = BlockingConnection(f"amqp://127.0.0.1:{gateway.port}", timeout=WAIT, **auth)
    try:
        sender = conn.create_sender(queue)
        sender.send(Message(body="still here"))
        receiver = conn.create_receiver(queue)
        message = receiver.receive(timeout=WAIT)
        receiver.accept()
        assert message.body == "still here"
    finally:
        conn.close()


def queue_depth(core: CoreProcess, name: str, auth: tuple[str, str] | None = None) -> int:
    url = f"{core.management_url}/api/queues/{urllib.parse.quote(name, safe='')}"
    request = urllib.request.Request(url, headers=basic_auth(*auth) if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return int(json.loads(response.read())["depth"])
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            return 0
        raise


# ------------------------------------------------------------------------------------------------ fixtures
# One core and one gateway for the module (every test keeps to queues of its own and to its own connections).
core = module_core
amqp_gateway = module_amqp_gateway


@pytest.fixture
def gateway(amqp_gateway: GatewayProcess) -> GatewayProcess:
    return amqp_gateway


@dataclass
class Secured:
    core: CoreProcess
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A core with users and permissions (SECURED_CONFIG) behind an AMQP gateway."""
    directory = tmp_path_factory.mktemp("secured")
    core = shared(start_core(directory, name="secured-core", config=SECURED_CONFIG))
    gateway = shared(start_gateway(directory, core, "amqp", name="secured"))
    yield Secured(core, gateway)
    stop_cleanly(gateway)
    stop_core_cleanly(core)


def secured_auth() -> dict[str, Any]:
    return {"user": USER, "password": PASSWORD, "allowed_mechs": "PLAIN"}


TunedGateways = dict[tuple[tuple[str, str], ...], GatewayProcess]


@pytest.fixture(scope="module")
def tuned_gateways(core: CoreProcess) -> Iterator[TunedGateways]:
    """The module's tuned gateways, one per set of settings, made on first use."""
    gateways: TunedGateways = {}
    yield gateways
    for gateway in gateways.values():
        stop_cleanly(gateway)


@pytest.fixture
def tuned(
    tuned_gateways: TunedGateways,
    tmp_path_factory: pytest.TempPathFactory,
    core: CoreProcess,
    request: pytest.FixtureRequest,
) -> GatewayProcess:
    """A gateway with the ``[amqp]`` settings given by ``@pytest.mark.parametrize("tuned", [{...}],
    indirect=True)`` (names of AmqpLimitsSection, values as strings), shared by the tests that give the same."""
    key = tuple(sorted(request.param.items()))
    if key not in tuned_gateways:
        env = {f"TRIDENTMQ_AMQP_AMQP_{name.upper()}": value for name, value in key}
        directory = tmp_path_factory.mktemp("tuned")
        tuned_gateways[key] = shared(start_gateway(directory, core, "amqp", name="tuned", **env))
    return tuned_gateways[key]


def tuned_with(**settings: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("tuned", [settings], indirect=True, ids=["-".join(settings)])


# ------------------------------------------------------------------------------------------------ 1. headers
@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", id="http"),
        pytest.param(b"AMQP\x02\x01\x00\x00", id="tls"),
        pytest.param(b"AMQP\x00\x00\x09\x01", id="amqp-0-9-1"),
        pytest.param(b"AMQP\x00\x01\x00\x01", id="amqp-1-0-1"),
        pytest.param(b"AMQP\x03\x02\x00\x00", id="sasl-2-0-0"),
        pytest.param(b"AMQP\x00\x01", id="truncated"),
        pytest.param(b"\x00" * 8, id="zeros"),
    ],
)
def test_a_protocol_header_we_do_not_speak_gets_ours_and_a_close(gateway: GatewayProcess, data: bytes) -> None:
    with Peer(gateway.port) as peer:
        peer.send(data)
        if len(data) < 8:
            peer.sock.shutdown(socket.SHUT_WR)  # EOF in the header
        header = peer.header()
        if len(data) < 8:  # nothing to refuse yet: an EOF during SASL ends the connection quietly
            assert header in (b"", SASL_HEADER), header
        else:
            assert header == SASL_HEADER
        assert peer.until_closed() == []
    assert_serves(gateway)


# ------------------------------------------------------------------------------------------------ 2. SASL
def test_plain_with_a_wrong_password_gets_outcome_auth_and_a_close(secured: Secured) -> None:
    with Peer(secured.gateway.port) as peer:
        peer.send(SASL_HEADER, plain(USER, "wrong"), AMQP_HEADER, open_frame())
        assert peer.header() == SASL_HEADER
        mechanisms = peer.expect(SASL_MECHANISMS)
        assert "PLAIN" in mechanisms.field(0).items
        outcome = peer.expect(SASL_OUTCOME)
        assert outcome.field(0) == SASL_AUTH, outcome
        assert peer.until_closed() == []
    assert_serves(secured.gateway, "open.after", **secured_auth())


def test_plain_with_the_right_password_works_end_to_end(secured: Secured) -> None:
    assert_serves(secured.gateway, "open.plain", **secured_auth())
    with Peer(secured.gateway.port) as peer:  # and the raw client's login too
        gateway_open = peer.open(USER, PASSWORD)
        assert gateway_open.field(0) == "gateway-amqp"


def test_no_credentials_against_a_core_with_users_is_refused_at_open(secured: Secured) -> None:
    with Peer(secured.gateway.port) as peer:
        peer.send(AMQP_HEADER, open_frame())
        assert peer.header() == AMQP_HEADER
        peer.expect(OPEN)
        close = peer.expect(CLOSE)
        assert close.condition == "amqp:unauthorized-access", close
        peer.send(frame(CLOSE, []))  # the gateway waits for ours
        assert peer.until_closed() == []
    assert_serves(secured.gateway, "open.after", **secured_auth())


@pytest.mark.parametrize(
    ("init", "code"),
    [
        pytest.param(sasl_init("SCRAM-SHA-256", b"n,,n=app,r=abc"), SASL_AUTH, id="unknown-mechanism"),
        pytest.param(sasl_init("PLAIN", b"no-nul-separators"), SASL_AUTH, id="plain-not-three-fields"),
        pytest.param(sasl_init("PLAIN"), SASL_AUTH, id="plain-without-response"),
        pytest.param(frame(SASL_INIT, ["PLAIN"], kind=SASL_FRAME), SASL_SYS_PERM, id="mechanism-is-a-string"),
        pytest.param(
            frame(SASL_INIT, [Symbol("PLAIN"), "text"], kind=SASL_FRAME), SASL_SYS_PERM, id="response-is-a-string"
        ),
        pytest.param(raw_frame(b"\x00\x53\x41\xc0\x05\x02\xa3", kind=SASL_FRAME), SASL_SYS_PERM, id="truncated-list"),
        pytest.param(raw_frame(b"\xff\xff\xff", kind=SASL_FRAME), SASL_SYS_PERM, id="unknown-constructor"),
        pytest.param(raw_frame(encode([Symbol("PLAIN")]), kind=SASL_FRAME), SASL_SYS_PERM, id="not-described"),
        pytest.param(frame(SASL_INIT, [Symbol("ANONYMOUS")], kind=AMQP_FRAME), SASL_SYS_PERM, id="amqp-frame-type"),
        pytest.param(_HEAD.pack(8, 2, SASL_FRAME, 0), SASL_SYS_PERM, id="empty-frame"),
        pytest.param(frame(SASL_RESPONSE, [b"\x00app\x00secret"], kind=SASL_FRAME), SASL_SYS_PERM, id="sasl-response"),
        pytest.param(frame(SASL_OUTCOME, [UByte(0)], kind=SASL_FRAME), SASL_SYS_PERM, id="sasl-outcome"),
        pytest.param(
            frame(SASL_INIT, [Symbol("PLAIN"), b"\x00app\x00" + b"x" * 9000], kind=SASL_FRAME),
            SASL_SYS_PERM,
            id="oversized",
        ),
        pytest.param(_HEAD.pack(0xFFFFFFFF, 2, SASL_FRAME, 0), SASL_SYS_PERM, id="size-4-gib"),
        pytest.param(sasl_init("ANONYMOUS") + b"GARBAGE!", SASL_SYS_PERM, id="garbage-after-init"),
    ],
)
def test_bad_sasl_gets_an_outcome_and_a_close(secured: Secured, init: bytes, code: int) -> None:
    with Peer(secured.gateway.port) as peer:
        peer.send(SASL_HEADER, init)
        assert peer.header() == SASL_HEADER
        peer.expect(SASL_MECHANISMS)
        outcome = peer.expect(SASL_OUTCOME)
        assert outcome.field(0) == code, outcome
        assert peer.until_closed() == []
    assert_serves(secured.gateway, "open.after", **secured_auth())


def test_a_connection_without_sasl_is_accepted_when_anonymous_access_is_allowed(gateway: GatewayProcess) -> None:
    with Peer(gateway.port) as peer:
        peer.send(AMQP_HEADER, open_frame())
        assert peer.header() == AMQP_HEADER
        peer.expect(OPEN)
        peer.send(frame(CLOSE, []))
        assert [f.code for f in peer.until_closed()] == [CLOSE]
    assert_serves(gateway, sasl_enabled=False)


@tuned_with(allow_anonymous="false")
@pytest.mark.parametrize("mechanism", ["none", "ANONYMOUS"])
def test_anonymous_access_is_refused_when_not_allowed(tuned: GatewayProcess, mechanism: str) -> None:
    with Peer(tuned.port) as peer:
        if mechanism == "none":
            peer.send(AMQP_HEADER, open_frame())
            assert peer.header() == SASL_HEADER  # the header we speak instead
        else:
            peer.send(SASL_HEADER, sasl_init("ANONYMOUS"), AMQP_HEADER, open_frame())
            assert peer.header() == SASL_HEADER
            assert peer.expect(SASL_MECHANISMS).field(0).items == ["PLAIN"]
            assert peer.expect(SASL_OUTCOME).field(0) == SASL_AUTH
        assert peer.until_closed() == []
    # The core has no users: PLAIN with any credentials is let in on loopback.
    assert_serves(tuned, user="someone", password="anything", allowed_mechs="PLAIN")


# ------------------------------------------------------------------------------------------------ 3. framing


@pytest.mark.parametrize(
    ("begun", "data", "condition"),
    [
        pytest.param(False, b"\xde\xad\xbe\xef" * 16, "amqp:connection:framing-error", id="garbage"),
        pytest.param(False, _HEAD.pack(4, 2, 0, 0) + b"\x00" * 12, "amqp:connection:framing-error", id="size-below-8"),
        pytest.param(False, _HEAD.pack(12, 1, 0, 0) + b"\x00" * 12, "amqp:connection:framing-error", id="doff-below-2"),
        pytest.param(
            False,
            _HEAD.pack(2 * 1024 * 1024, 2, 0, 0) + b"\x00" * 1024,
            "amqp:connection:framing-error",
            id="larger-than-max-frame-size",
        ),
        pytest.param(False, raw_frame(b"\xff\x01\x02"), "amqp:decode-error", id="undecodable-performative"),
        pytest.param(False, raw_frame(b"\x00\x53\x11\xc0\x10\x04"), "amqp:decode-error", id="truncated-performative"),
        pytest.param(False, frame(0x99, []), "amqp:decode-error", id="unknown-performative"),
        pytest.param(False, begin_frame(channel=300), "amqp:connection:framing-error", id="channel-above-channel-max"),
        pytest.param(False, transfer_frame(0, 0, message_bytes("x")), "amqp:not-allowed", id="transfer-before-begin"),
        pytest.param(False, attach_sender("s", 0, "x"), "amqp:not-allowed", id="attach-before-begin"),
        pytest.param(False, frame(END, [], channel=3), "amqp:not-allowed", id="end-before-begin"),
        pytest.param(
            True,
            frame(FLOW, [UInt(0), UInt(10), UInt(0), UInt(10)], channel=7),
            "amqp:not-allowed",
            id="flow-on-another-channel",
        ),
        pytest.param(
            True, transfer_frame(5, 0, message_bytes("x")), "amqp:invalid-field", id="transfer-on-unattached-handle"
        ),
        pytest.param(True, frame(DETACH, [UInt(9), True]), "amqp:invalid-field", id="detach-of-unattached-handle"),
        pytest.param(
            True,
            frame(FLOW, [UInt(0), UInt(10), UInt(0), UInt(10), UInt(9), UInt(0), UInt(10)]),
            "amqp:invalid-field",
            id="flow-on-unattached-handle",
        ),
    ],
)
def test_bad_framing_after_open_gets_a_close_with_an_amqp_error(
    gateway: GatewayProcess, begun: bool, data: bytes, condition: str
) -> None:
    with Peer(gateway.port) as peer:
        peer.open()
        if begun:
            peer.begin()
        peer.send(data)
        peer.sock.settimeout(ANSWER)
        try:
            frames = peer.until_closed()
        except TimeoutError:
            raise AssertionError(f"no CLOSE and the socket still open after {ANSWER} s") from None
    assert_closed_with(frames, condition)
    assert_serves(gateway)


def test_a_second_open_is_ignored(gateway: GatewayProcess) -> None:
    """proton tolerates a repeated OPEN (the spec forbids it, but nothing is gained by closing): the connection
    goes on."""
    with Peer(gateway.port) as peer:
        peer.open()
        peer.send(open_frame("again"))
        peer.begin()
        peer.attach_sender("s", 0, unique("again"))
        peer.send(transfer_frame(0, 0, message_bytes("fine")))
        assert peer.expect(DISPOSITION).field(4) == Described(ACCEPTED, [])
    assert_serves(gateway)


# ------------------------------------------------------------------------------------------------ 4. links
def test_an_attach_to_a_forbidden_address_is_refused_and_the_connection_stays_usable(secured: Secured) -> None:
    with Peer(secured.gateway.port) as peer:
        peer.open(USER, PASSWORD)
        peer.begin()
        peer.send(attach_receiver("forbidden", 0, "secret.queue"))
        peer.expect(ATTACH)  # with a null source: see test_a_refused_link_is_attached_with_a_null_terminus
        detach = peer.expect(DETACH)
        assert detach.field(0) == 0, detach
        assert detach.field(1) is True, detach
        assert detach.condition == "amqp:unauthorized-access", detach
        # the same connection and session go on
        peer.send(frame(DETACH, [UInt(0), True]))
        queue = unique("open.after")
        peer.attach_sender("allowed", 1, queue)
        peer.send(transfer_frame(1, 0, message_bytes("fine")))
        disposition = peer.expect(DISPOSITION)
        assert disposition.field(4) == Described(ACCEPTED, []), disposition
    assert queue_depth(secured.core, queue, ADMIN) == 1
    assert_serves(secured.gateway, "open.after", **secured_auth())


def test_sending_without_the_send_permission_is_rejected_and_the_link_detached(secured: Secured) -> None:
    queue = unique("consumeonly.q")
    with Peer(secured.gateway.port) as peer:
        peer.open(USER, PASSWORD)
        peer.begin()
        peer.attach_sender("no-send", 0, queue)
        peer.send(transfer_frame(0, 0, message_bytes("not allowed")))
        frames = [peer.next(), peer.next()]
        dispositions = [f for f in frames if f.code == DISPOSITION]
        detaches = [f for f in frames if f.code == DETACH]
        assert len(dispositions) == 1, frames
        assert len(detaches) == 1, frames
        state = dispositions[0].field(4)
        assert isinstance(state, Described), state
        assert state.descriptor == REJECTED, state
        assert state.value[0].value[0] == "amqp:unauthorized-access", state
        assert detaches[0].condition == "amqp:unauthorized-access", detaches[0]
        assert detaches[0].field(1) is True
        # the connection goes on
        peer.send(frame(DETACH, [UInt(0), True]))
        peer.attach_sender("allowed", 1, unique("open.after"))
        peer.send(transfer_frame(1, 1, message_bytes("fine")))
        assert peer.expect(DISPOSITION).field(4) == Described(ACCEPTED, [])
    assert queue_depth(secured.core, queue, ADMIN) == 0
    assert_serves(secured.gateway, "open.after", **secured_auth())


@pytest.mark.parametrize(
    ("attach", "condition"),
    [
        # (looked up as the durable subscription of its link name: none)
        pytest.param(attach_receiver("r", 0, None), "amqp:not-found", id="receiver-without-source-address"),
        pytest.param(attach_receiver("r", 0, ""), "amqp:invalid-field", id="receiver-with-empty-source-address"),
        pytest.param(attach_sender("s", 0, "open.addr::open.queue"), "amqp:invalid-field", id="sender-to-fqqn"),
    ],
)
def test_a_link_with_a_bad_terminus_is_refused(gateway: GatewayProcess, attach: bytes, condition: str) -> None:
    with Peer(gateway.port) as peer:
        peer.open()
        peer.begin()
        peer.send(attach)
        peer.expect(ATTACH)
        detach = peer.expect(DETACH)
        assert detach.condition == condition, detach
        assert detach.field(1) is True, detach
        peer.send(frame(DETACH, [UInt(0), True]))
        peer.attach_sender("after", 1, unique("after"))
        peer.send(transfer_frame(1, 0, message_bytes("fine")))
        assert peer.expect(DISPOSITION).field(4) == Described(ACCEPTED, [])
    assert_serves(gateway)


@pytest.mark.parametrize(
    ("attach", "condition"),
    [
        pytest.param(attach_receiver("r", 0, None), "amqp:not-found", id="receiver-without-source-address"),
        pytest.param(attach_sender("s", 0, "addr::queue"), "amqp:invalid-field", id="sender-to-fqqn"),
    ],
)
def test_a_refused_link_is_attached_with_a_null_terminus(
    gateway: GatewayProcess, attach: bytes, condition: str
) -> None:
    with Peer(gateway.port) as peer:
        peer.open()
        peer.begin()
        peer.send(attach)
        reply = peer.expect(ATTACH)
        assert peer.expect(DETACH).condition == condition
    # the terminus the gateway provides: the source when it sends (role false), else the target
    terminus = reply.field(5) if reply.field(2) is False else reply.field(6)
    assert terminus is None, f"a refused link's terminus must be null: {reply}"


def test_a_sender_without_a_target_address_is_the_anonymous_relay(gateway: GatewayProcess, core: CoreProcess) -> None:
    queue = unique("relay")
    with Peer(gateway.port) as peer:
        peer.open()
        peer.begin()
        peer.attach_sender("relay", 0, None)
        peer.send(transfer_frame(0, 0, message_bytes("relayed", to=queue)))
        assert peer.expect(DISPOSITION).field(4) == Described(ACCEPTED, [])
        # a message without a `to` has nowhere to go: rejected, the link stays
        peer.send(transfer_frame(0, 1, message_bytes("nowhere")))
        state = peer.expect(DISPOSITION).field(4)
        assert isinstance(state, Described), state
        assert state.descriptor == REJECTED, state
        assert str(state.value[0].value[0]).startswith("amqp:"), state
    assert queue_depth(core, queue) == 1
    assert_serves(gateway)


# ------------------------------------------------------------------------------------------------ 5. credit
@tuned_with(link_credit="4")
@pytest.mark.parametrize("extra", [1, 8])
def test_more_transfers_than_the_credit_detach_the_link(tuned: GatewayProcess, core: CoreProcess, extra: int) -> None:
    queue = unique("credit")
    with Peer(tuned.port) as peer:
        peer.open()
        peer.begin()
        _, flow = peer.attach_sender("greedy", 0, queue)
        credit = flow.field(6)
        assert credit == 4, flow
        # all in one write: the gateway sees them before it can top the credit up
        peer.send(*(transfer_frame(0, i, message_bytes(f"m{i}")) for i in range(credit + extra)))
        frames: list[Frame] = []
        peer.sock.settimeout(ANSWER)
        while not any(f.code == DETACH for f in frames):
            frames.append(peer.next())
        detach = next(f for f in frames if f.code == DETACH)
        assert detach.condition == "amqp:link:transfer-limit-exceeded", frames
        assert detach.field(1) is True, detach
        # those beyond the credit are released after the detach: not published, and the client knows it
        assert_released(peer, set(range(credit, credit + extra)))
        peer.sock.settimeout(WAIT)
        # the connection goes on
        peer.send(frame(DETACH, [UInt(0), True]))
        peer.attach_sender("polite", 1, unique("credit.after"))
        peer.send(transfer_frame(1, credit + extra, message_bytes("fine")))
        got = peer.next()
        while got.code != DISPOSITION:  # late dispositions or flows of the old link may come first
            got = peer.next()
        assert got.field(4) == Described(ACCEPTED, []), got
    assert queue_depth(core, queue) <= credit
    assert_serves(tuned)


def assert_released(peer: Peer, ids: set[int]) -> None:
    """The next dispositions release ``ids``, and nothing else."""
    released: set[int] = set()
    while released < ids:
        got = peer.next()
        assert got.code == DISPOSITION, got
        assert got.field(4) == Described(RELEASED, []), got
        released.update(range(got.field(1), (got.field(2) or got.field(1)) + 1))
    assert released == ids


@tuned_with(link_credit="4")
def test_transfers_within_the_credit_are_all_accepted(tuned: GatewayProcess, core: CoreProcess) -> None:
    queue = unique("credit.exact")
    with Peer(tuned.port) as peer:
        peer.open()
        peer.begin()
        _, flow = peer.attach_sender("exact", 0, queue)
        credit = flow.field(6)
        peer.send(*(transfer_frame(0, i, message_bytes(f"m{i}")) for i in range(credit)))
        settled: set[int] = set()
        while len(settled) < credit:
            got = peer.next()
            assert got.code in (DISPOSITION, FLOW), got
            if got.code == DISPOSITION:
                assert got.field(4) == Described(ACCEPTED, []), got
                settled.update(range(got.field(1), (got.field(2) or got.field(1)) + 1))
    assert queue_depth(core, queue) == credit


@pytest.mark.parametrize("closed", [True, False])
def test_a_sender_that_detaches_at_once_gets_the_outcomes_of_its_transfers_first(
    gateway: GatewayProcess, core: CoreProcess, closed: bool
) -> None:
    # proton's own examples send and close the sender at once, and wait for ``on_accepted``.
    queue = unique("detach.after.send")
    with Peer(gateway.port) as peer:
        peer.open()
        peer.begin()
        peer.attach_sender("quick", 0, queue)
        peer.send(*(transfer_frame(0, i, message_bytes(f"m{i}")) for i in range(3)), frame(DETACH, [UInt(0), closed]))
        settled: set[int] = set()
        while (got := peer.next()).code == DISPOSITION:
            assert got.field(4) == Described(ACCEPTED, []), got
            settled.update(range(got.field(1), (got.field(2) or got.field(1)) + 1))
        assert got.code == DETACH, got
        assert settled == {0, 1, 2}  # every stored message confirmed, before the link went
    assert queue_depth(core, queue) == 3


def burst_receiver(name: str, handle: int, address: str) -> bytes:
    """A receiving link whose deliveries come pre-settled (snd-settle-mode settled): the client's socket fills
    with as many as its credit allows, whatever it settles."""
    return frame(
        ATTACH,
        [
            name,
            UInt(handle),
            True,
            UByte(1),
            UByte(0),
            Described(ULong(SOURCE), [address]),
            Described(ULong(TARGET), [None]),
        ],
    )


def frames_from(sock: socket.socket, data: bytearray) -> Iterator[Frame]:
    """The frames of ``data`` and then of what the socket brings (without copying what is left at each frame)."""
    pos = 0
    while True:
        if len(data) - pos >= 4:
            size = int.from_bytes(data[pos : pos + 4], "big")
            if len(data) - pos >= size:
                yield parse_frame(bytes(data[pos : pos + size]))
                pos += size
                continue
        del data[:pos]
        pos = 0
        chunk = sock.recv(1 << 20)
        assert chunk, "the gateway closed the connection"
        data += chunk


def test_a_one_thread_client_that_sends_a_burst_before_reading_is_not_deadlocked(gateway: GatewayProcess) -> None:
    """A client with one thread and blocking writes attaches a receiver with plenty of credit and a sender to the
    same queue, then sends its whole link credit of transfers (settled and unsettled) before it reads anything:
    its own deliveries fill its socket. The gateway goes on reading and handling its frames, so the burst is taken
    whole (it waited for the client to read, and the client for it to read its burst: both hung)."""
    queue = unique("burst.echo")
    body = b"x" * 48 * 1024
    with Peer(gateway.port) as peer:
        peer.open()
        begin = peer.begin()
        peer.send(burst_receiver("echo", 1, queue))
        attach = peer.expect(ATTACH)
        assert attach.field(6) is not None, f"the link was refused: {attach}"
        # next-incoming-id, incoming-window, next-outgoing-id, outgoing-window, handle, delivery-count, link-credit
        flow = [begin.field(1), UInt(65536), UInt(0), UInt(65536), UInt(1), attach.field(9) or UInt(0)]
        peer.send(frame(FLOW, [*flow, UInt(1_000_000)]))
        _, credit_flow = peer.attach_sender("burst", 0, queue)
        count = credit_flow.field(6)  # the whole credit: about 48 MiB each way
        burst = b"".join(
            frame(TRANSFER, [UInt(0), UInt(n), b"%d" % n, UInt(0), n % 2 == 0], payload=message_bytes(body))
            for n in range(count)
        )
        sock = peer.sock
        stalled_at, data = send_before_reading(sock, burst, bytes(peer.buffer))
        assert stalled_at is None, f"deadlocked after {stalled_at} of {len(burst)} bytes"
        sock.settimeout(WAIT)
        accepted: list[int] = []
        delivered = 0
        frames = frames_from(sock, data)
        while len(accepted) < count // 2 or delivered < count:
            got = next(frames)
            if got.code == DISPOSITION:
                assert got.field(0) is True, got
                assert got.field(4) == Described(ACCEPTED, []), got
                accepted.extend(range(got.field(1), (got.field(2) or got.field(1)) + 1))
            elif got.code == TRANSFER:
                assert got.field(0) == attach.field(1), got
                assert got.payload.endswith(body), got
                delivered += 1
            else:
                assert got.code in (FLOW, None), got
        assert accepted == list(range(1, count, 2))  # every unsettled transfer, in order
        assert delivered == count
    assert_serves(gateway)


# ------------------------------------------------------------------------------------------------ 6. size
MAX_MESSAGE = 4096


@tuned_with(max_message_bytes=str(MAX_MESSAGE))
@pytest.mark.parametrize("frames", [pytest.param(1, id="one-frame"), pytest.param(5, id="five-frames")])
def test_a_message_over_max_message_size_detaches_the_link(
    tuned: GatewayProcess, core: CoreProcess, frames: int
) -> None:
    queue, other = unique("big"), unique("big.other")
    payload = message_bytes(b"x" * 10 * 1024)
    with Peer(tuned.port) as peer:
        peer.open()
        peer.begin()
        attach, _ = peer.attach_sender("big", 0, queue)
        assert attach.field(10) == MAX_MESSAGE, f"the link's max-message-size: {attach}"
        peer.attach_sender("other", 1, other)
        step = -(-len(payload) // frames)
        chunks = [payload[i : i + step] for i in range(0, len(payload), step)]
        peer.send(
            *(transfer_frame(0, 0, chunk, more=n < len(chunks) - 1, first=n == 0) for n, chunk in enumerate(chunks))
        )
        got = peer.next()
        assert got.code == DETACH, f"expected a detach, got {got}"
        assert got.condition == "amqp:link:message-size-exceeded", got
        assert got.field(1) is True, got
        assert_released(peer, {0})  # once all of it came, dropped as it did
        # the connection and the other link go on
        peer.send(transfer_frame(1, 1, message_bytes("small")))
        got = peer.next()
        assert got.code == DISPOSITION, got
        assert got.field(4) == Described(ACCEPTED, []), got
        peer.send(frame(DETACH, [UInt(0), True]))
    assert queue_depth(core, queue) == 0, "the oversized message reached the queue"
    assert queue_depth(core, other) == 1
    assert_serves(tuned)


@tuned_with(max_incomplete_bytes="16384")
def test_too_many_incomplete_messages_at_once_close_the_connection(tuned: GatewayProcess, core: CoreProcess) -> None:
    """Each link may hold a message just under the size limit in proton while its frames arrive; across the
    links of one connection that is bounded too."""
    queues = [unique("incomplete") for _ in range(3)]
    with Peer(tuned.port) as peer:
        peer.open()
        peer.begin()
        for handle, queue in enumerate(queues):
            peer.attach_sender(f"slow{handle}", handle, queue)
        # the first frames of three messages of 30 KiB, each 10 KiB so far: 30 KiB pending in all
        peer.send(
            *(
                transfer_frame(handle, handle, message_bytes(b"x" * 30 * 1024)[: 10 * 1024], more=True, first=True)
                for handle in range(len(queues))
            )
        )
        assert_closed_with(peer.until_closed(), "amqp:resource-limit-exceeded")
    assert all(queue_depth(core, queue) == 0 for queue in queues)
    assert_serves(tuned)


# ------------------------------------------------------------------------------------------------ 7-8. timers


@tuned_with(idle_timeout_ms="500")
def test_a_silent_client_is_closed_after_the_idle_timeout(tuned: GatewayProcess) -> None:
    with Peer(tuned.port) as peer:
        peer.open()
        start = time.monotonic()
        peer.sock.settimeout(3)
        frames = peer.until_closed()
        elapsed = time.monotonic() - start
    assert_closed_with(frames, "amqp:resource-limit-exceeded")
    assert 0.4 < elapsed < 2.5, elapsed
    assert_serves(tuned)


@tuned_with(idle_timeout_ms="500")
def test_the_open_announces_the_configured_idle_timeout(tuned: GatewayProcess) -> None:
    with Peer(tuned.port) as peer:
        gateway_open = peer.open()
    assert gateway_open.field(4) == 500, gateway_open


def test_the_gateway_sends_heartbeats_to_a_client_that_asks_for_them(gateway: GatewayProcess) -> None:
    """A client announcing idle-time-out 1000 ms needs a frame at least every second: proton sends an empty
    frame every 500 ms once it is ticked."""
    with Peer(gateway.port) as peer:
        peer.send(AMQP_HEADER, open_frame(idle_time_out=UInt(1000)))
        assert peer.header() == AMQP_HEADER
        peer.expect(OPEN)
        heartbeats = 0
        start = time.monotonic()
        peer.sock.settimeout(1.0)  # a second without any frame already lets the client give up
        while time.monotonic() - start < 2.0:
            try:
                got = peer.frame()
            except TimeoutError:
                raise AssertionError(f"no frame for a second ({heartbeats} heartbeats before)") from None
            assert got is not None, "the gateway closed the connection"
            assert got.code is None, got
            heartbeats += 1
        assert heartbeats >= 2, heartbeats


@tuned_with(idle_timeout_ms="500")
def test_a_client_sending_heartbeats_is_not_closed(tuned: GatewayProcess) -> None:
    with Peer(tuned.port) as peer:
        peer.open()
        for _ in range(8):  # 1.6 s, well past the timeout, one heartbeat every 200 ms
            peer.send(_HEAD.pack(8, 2, 0, 0))
            peer.sock.settimeout(0.2)
            try:
                while (got := peer.frame()) is not None and got.code is None:
                    pass  # the gateway's own heartbeats
            except TimeoutError:
                continue  # quiet for 200 ms: as it should be
            raise AssertionError(f"the gateway sent {got}")
        peer.sock.settimeout(WAIT)
        peer.send(frame(CLOSE, []))
        assert [f.code for f in peer.until_closed()] == [CLOSE]


@tuned_with(connect_timeout_ms="300")
@pytest.mark.parametrize(
    "data",
    [
        pytest.param(SASL_HEADER, id="sasl-header-only"),
        pytest.param(b"", id="nothing"),
        pytest.param(SASL_HEADER + sasl_init("ANONYMOUS"), id="sasl-without-amqp-header"),
    ],
)
def test_a_client_that_does_not_open_in_time_is_closed(tuned: GatewayProcess, data: bytes) -> None:
    with Peer(tuned.port) as peer:
        peer.send(data)
        start = time.monotonic()
        peer.sock.settimeout(2)
        try:
            received = peer.header()
            frames = peer.until_closed()
        except TimeoutError:
            raise AssertionError("the gateway kept the connection open") from None
        elapsed = time.monotonic() - start
    assert elapsed < 1.5, elapsed
    if data.startswith(SASL_HEADER):
        assert received == SASL_HEADER
        assert frames[0].code == SASL_MECHANISMS, frames
    else:
        assert received == b""
        assert frames == []
    assert_serves(tuned)


@tuned_with(connect_timeout_ms="300")
def test_a_client_that_sends_the_amqp_header_but_no_open_gets_a_close(tuned: GatewayProcess) -> None:
    with Peer(tuned.port) as peer:
        peer.send(AMQP_HEADER)
        peer.sock.settimeout(2)
        assert peer.header() == AMQP_HEADER
        frames = peer.until_closed()
    assert [f.code for f in frames] == [OPEN, CLOSE], frames
    assert_closed_with(frames, "amqp:connection:forced")


# ------------------------------------------------------------------------------------------------ 9. WebSocket
async def ws_read(ws: aiohttp.ClientWebSocketResponse, buffer: bytearray, size: int) -> bytes:
    """The next ``size`` bytes of the gateway's BINARY messages (message boundaries mean nothing)."""
    while len(buffer) < size:
        message = await ws.receive(timeout=WAIT)
        assert message.type is aiohttp.WSMsgType.BINARY, message
        buffer += message.data
    data = bytes(buffer[:size])
    del buffer[:size]
    return data


async def ws_frame(ws: aiohttp.ClientWebSocketResponse, buffer: bytearray) -> Frame:
    head = await ws_read(ws, buffer, 4)
    return parse_frame(head + await ws_read(ws, buffer, int.from_bytes(head, "big") - 4))


def ws_url(gateway: GatewayProcess) -> str:
    return f"http://127.0.0.1:{gateway.ports['websocket']}/"


@pytest.mark.parametrize("sasl", [False, True], ids=["no-sasl", "sasl-anonymous"])
async def test_websocket_carries_the_same_bytes(gateway: GatewayProcess, sasl: bool) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(gateway), protocols=("amqp",)) as ws:
        assert ws.protocol == "amqp"
        buffer = bytearray()
        if sasl:
            await ws.send_bytes(SASL_HEADER)  # the bytes in any split: here the header alone first
            await ws.send_bytes(sasl_init("ANONYMOUS") + AMQP_HEADER + open_frame("ws-client"))
            assert await ws_read(ws, buffer, 8) == SASL_HEADER
            assert (await ws_frame(ws, buffer)).code == SASL_MECHANISMS
            outcome = await ws_frame(ws, buffer)
            assert outcome.code == SASL_OUTCOME, outcome
            assert outcome.field(0) == SASL_OK, outcome
        else:
            await ws.send_bytes(AMQP_HEADER + open_frame("ws-client"))
        assert await ws_read(ws, buffer, 8) == AMQP_HEADER
        gateway_open = await ws_frame(ws, buffer)
        assert gateway_open.code == OPEN, gateway_open
        assert gateway_open.field(0) == "gateway-amqp", gateway_open
        await ws.send_bytes(frame(CLOSE, []))
        close = await ws_frame(ws, buffer)
        assert close.code == CLOSE, close
        assert close.error is None, close
        message = await ws.receive(timeout=WAIT)
        assert message.type is aiohttp.WSMsgType.CLOSE, message
    await asyncio.to_thread(assert_serves, gateway)


async def test_websocket_garbage_gets_our_header_and_a_close(gateway: GatewayProcess) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(gateway), protocols=("amqp",)) as ws:
        await ws.send_bytes(b"GET / HTTP/1.1\r\n\r\n")
        message = await ws.receive(timeout=WAIT)
        assert message.type is aiohttp.WSMsgType.BINARY, message
        assert message.data == SASL_HEADER, message
        message = await ws.receive(timeout=WAIT)
        assert message.type is aiohttp.WSMsgType.CLOSE, message
    await asyncio.to_thread(assert_serves, gateway)


@pytest.mark.parametrize("protocols", [(), ("mqtt",)], ids=["none", "other"])
async def test_websocket_without_the_amqp_subprotocol_is_closed_with_1002(
    gateway: GatewayProcess, protocols: tuple[str, ...]
) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(gateway), protocols=protocols) as ws:
        message = await ws.receive(timeout=WAIT)
        assert message.type is aiohttp.WSMsgType.CLOSE, message
        assert message.data == 1002
        assert ws.protocol is None
    await asyncio.to_thread(assert_serves, gateway)


async def test_a_websocket_text_frame_is_closed_with_1003(gateway: GatewayProcess) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(gateway), protocols=("amqp",)) as ws:
        await ws.send_str("AMQP\x00\x01\x00\x00")
        message = await ws.receive(timeout=WAIT)
        assert message.type is aiohttp.WSMsgType.CLOSE, message
        assert message.data == 1003
    await asyncio.to_thread(assert_serves, gateway)
