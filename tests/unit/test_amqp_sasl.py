"""The gateway's server-side SASL layer: headers, sasl-init parsing, outcomes, pass-through, and proton's client
on the other end (client frames are built with proton's codec, so the layer is checked against an independent one)."""

from __future__ import annotations

import random
import struct
from typing import Any

import proton
import pytest

from tridentmq_amqp.protocol.errors import NOT_ALLOWED, LocalProtocolError, RemoteProtocolError
from tridentmq_amqp.protocol.sasl import (
    AMQP_HEADER,
    AUTH,
    DEFAULT_MAX_FRAME_BYTES,
    OK,
    SASL_HEADER,
    SYS_PERM,
    SYS_TEMP,
    AuthRequest,
    Passthrough,
    SaslLayer,
)

# Golden frames, as proton decodes them below.
MECHANISMS_FRAME = b'\x00\x00\x00"\x02\x01\x00\x00\x00S@\xc0\x15\x01\xe0\x12\x02\xa3\x05PLAIN\tANONYMOUS'
OUTCOME_OK = b"\x00\x00\x00\x10\x02\x01\x00\x00\x00SD\xc0\x03\x01P\x00"
OUTCOME_AUTH = b"\x00\x00\x00\x10\x02\x01\x00\x00\x00SD\xc0\x03\x01P\x01"
OUTCOME_SYS_PERM = b"\x00\x00\x00\x10\x02\x01\x00\x00\x00SD\xc0\x03\x01P\x03"
# An open frame (container id "c"), as a client pipelines it behind its AMQP header.
OPEN_FRAME = b"\x00\x00\x00\x11\x02\x00\x00\x00\x00S\x10\xc0\x04\x01\xa1\x01c"


def frame(body: bytes, *, doff: int = 2, frame_type: int = 1) -> bytes:
    return struct.pack(">IBBH", doff * 4 + len(body), doff, frame_type, 0) + b"\x00" * (doff * 4 - 8) + body


def performative(descriptor: int | str, *fields: Any) -> bytes:
    """A described list encoded by proton: ``proton.symbol``, ``bytes``, ``str``, ``None`` fields."""
    data = proton.Data()
    data.put_object(
        proton.Described(
            proton.symbol(descriptor) if isinstance(descriptor, str) else proton.ulong(descriptor), list(fields)
        )
    )
    return bytes(data.encode())


def init(mechanism: str, response: bytes | None = None, hostname: str | None = None) -> bytes:
    return frame(performative(0x41, proton.symbol(mechanism), response, hostname))


PLAIN_INIT = init("PLAIN", b"\x00alice\x00secret", "broker.example")
PLAIN_REQUEST = AuthRequest("PLAIN", "alice", "secret", "broker.example")


def proton_decode(sasl_frame: bytes) -> Any:
    size, doff, frame_type, _ = struct.unpack_from(">IBBH", sasl_frame)
    assert (size, doff, frame_type) == (len(sasl_frame), 2, 1)
    data = proton.Data()
    assert data.decode(sasl_frame[8:]) == size - 8
    return data.get_object()


def feed(layer: SaslLayer, data: bytes, chunks: list[int] | None = None) -> list[AuthRequest | Passthrough]:
    """Feed ``data`` in chunks of the given sizes (the rest in one piece); all the events."""
    events: list[AuthRequest | Passthrough] = []
    for size in chunks or []:
        piece, data = data[:size], data[size:]
        if piece:
            events += layer.receive_data(piece)
    if data:
        events += layer.receive_data(data)
    return events


def refused(layer: SaslLayer, data: bytes) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        layer.receive_data(data)
    assert layer.closed
    assert not layer.done
    return info.value


def passed(events: list[AuthRequest | Passthrough] | list[Passthrough]) -> bytes:
    assert all(type(e) is Passthrough for e in events)
    return b"".join(e.data for e in events if type(e) is Passthrough)


# ---------------------------------------------------------------- the exchange


def test_whole_exchange_fed_whole() -> None:
    layer = SaslLayer()
    assert layer.receive_data(SASL_HEADER) == []
    assert layer.data_to_send() == SASL_HEADER + MECHANISMS_FRAME
    assert layer.receive_data(PLAIN_INIT) == [PLAIN_REQUEST]
    assert layer.data_to_send() == b""
    assert (layer.done, layer.closed) == (False, False)
    assert layer.outcome(ok=True) == []
    assert layer.data_to_send() == OUTCOME_OK
    assert (layer.done, layer.closed, layer.anonymous_without_sasl) == (True, False, False)
    assert layer.receive_data(AMQP_HEADER) == [Passthrough(AMQP_HEADER)]
    assert layer.receive_data(OPEN_FRAME) == [Passthrough(OPEN_FRAME)]
    assert layer.receive_data(b"") == [Passthrough(b"")]  # the engine sees the EOF too
    assert layer.data_to_send() == b""


def test_pipelined_sasl_and_amqp_bytes_wait_for_the_outcome() -> None:
    layer = SaslLayer()
    assert layer.receive_data(SASL_HEADER + PLAIN_INIT + AMQP_HEADER + OPEN_FRAME) == [PLAIN_REQUEST]
    assert layer.data_to_send() == SASL_HEADER + MECHANISMS_FRAME
    assert layer.receive_data(OPEN_FRAME) == []  # still held
    assert layer.outcome(ok=True) == [Passthrough(AMQP_HEADER + OPEN_FRAME + OPEN_FRAME)]
    assert layer.data_to_send() == OUTCOME_OK
    assert layer.receive_data(b"x") == [Passthrough(b"x")]


def test_the_first_passthrough_holds_the_whole_amqp_header() -> None:
    layer = SaslLayer()
    feed(layer, SASL_HEADER + PLAIN_INIT + AMQP_HEADER[:3])
    assert layer.outcome(ok=True) == []
    assert layer.done
    assert layer.receive_data(AMQP_HEADER[3:7]) == []
    assert layer.receive_data(AMQP_HEADER[7:] + OPEN_FRAME) == [Passthrough(AMQP_HEADER + OPEN_FRAME)]


@pytest.mark.parametrize("seed", range(20))
def test_exchange_in_random_chunks(seed: int) -> None:
    rng = random.Random(seed)
    wire = SASL_HEADER + PLAIN_INIT + AMQP_HEADER + OPEN_FRAME
    layer = SaslLayer()
    events = feed(layer, wire, [rng.randint(1, 12) for _ in range(len(wire))] if seed else [1] * len(wire))
    assert events == [PLAIN_REQUEST]
    assert layer.data_to_send() == SASL_HEADER + MECHANISMS_FRAME
    assert passed(layer.outcome(ok=True)) == AMQP_HEADER + OPEN_FRAME
    assert layer.data_to_send() == OUTCOME_OK


@pytest.mark.parametrize("seed", range(10))
def test_amqp_stream_after_the_outcome_in_random_chunks(seed: int) -> None:
    rng = random.Random(seed)
    layer = SaslLayer()
    feed(layer, SASL_HEADER + PLAIN_INIT)
    assert layer.outcome(ok=True) == []
    rest = AMQP_HEADER + OPEN_FRAME * 3
    events = feed(layer, rest, [rng.randint(1, 9) for _ in range(len(rest))])
    assert passed(events[:1]).startswith(AMQP_HEADER)
    assert passed(events) == rest


# ---------------------------------------------------------------- mechanisms


@pytest.mark.parametrize(
    ("response", "username", "password"),
    [
        (b"\x00alice\x00secret", "alice", "secret"),
        (b"alice\x00alice\x00secret", "alice", "secret"),  # authzid = authcid
        (b"\x00alice\x00", "alice", ""),  # empty password: the authenticator's call
        (b"\x00\x00", "", ""),
        ("\x00j\u00f6rg\x00p\u00e4ss \u2603".encode(), "j\u00f6rg", "p\u00e4ss \u2603"),
    ],
)
def test_plain(response: bytes, username: str, password: str) -> None:
    layer = SaslLayer()
    assert feed(layer, SASL_HEADER + init("PLAIN", response)) == [AuthRequest("PLAIN", username, password, None)]


@pytest.mark.parametrize(
    "response",
    [
        None,  # PLAIN needs an initial response: there are no challenges here
        b"alice\x00secret",
        b"",
        b"\x00alice\x00sec\x00ret",  # NUL is not allowed in the fields
        b"\x00al\xffice\x00secret",  # invalid UTF-8
        b"\x00alice\x00\xc3",
    ],
)
def test_malformed_plain_is_refused_with_auth(response: bytes | None) -> None:
    layer = SaslLayer()
    layer.receive_data(SASL_HEADER)
    layer.data_to_send()
    refused(layer, init("PLAIN", response))
    assert layer.data_to_send() == OUTCOME_AUTH


def test_plain_for_another_identity_is_refused() -> None:
    layer = SaslLayer()
    layer.receive_data(SASL_HEADER)
    layer.data_to_send()
    assert refused(layer, init("PLAIN", b"admin\x00alice\x00secret")).condition == NOT_ALLOWED
    assert layer.data_to_send() == OUTCOME_AUTH


@pytest.mark.parametrize("response", [None, b"", b"trace@example.com"])
def test_anonymous(response: bytes | None) -> None:
    layer = SaslLayer()
    events = feed(layer, SASL_HEADER + init("ANONYMOUS", response, "vhost"))
    assert events == [AuthRequest("ANONYMOUS", None, None, "vhost")]


def test_sasl_init_with_only_the_mechanism_and_a_symbolic_descriptor() -> None:
    layer = SaslLayer()
    body = performative("amqp:sasl-init:list", proton.symbol("ANONYMOUS"))
    assert feed(layer, SASL_HEADER + frame(body)) == [AuthRequest("ANONYMOUS", None, None, None)]


def test_extended_header_and_extra_fields_are_ignored() -> None:
    layer = SaslLayer()
    body = performative(0x41, proton.symbol("PLAIN"), b"\x00a\x00b", "h", "a later field")
    assert feed(layer, SASL_HEADER + frame(body, doff=3)) == [AuthRequest("PLAIN", "a", "b", "h")]


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [(("PLAIN", "ANONYMOUS"), "EXTERNAL"), (("PLAIN",), "ANONYMOUS"), (("ANONYMOUS",), "PLAIN"), (("PLAIN",), "plain")],
)
def test_a_mechanism_not_offered_is_refused_by_the_layer(offered: tuple[str, ...], chosen: str) -> None:
    layer = SaslLayer(mechanisms=offered)
    layer.receive_data(SASL_HEADER)
    mechanisms = proton_decode(layer.data_to_send()[8:])
    assert list(mechanisms.value[0]) == list(offered)
    assert refused(layer, init(chosen, b"\x00a\x00b")).condition == NOT_ALLOWED
    assert layer.data_to_send() == OUTCOME_AUTH


# ---------------------------------------------------------------- outcomes


def test_failed_authentication_sends_the_code_and_closes() -> None:
    layer = SaslLayer()
    feed(layer, SASL_HEADER + PLAIN_INIT + AMQP_HEADER + OPEN_FRAME)
    layer.data_to_send()
    assert layer.outcome(ok=False) == []
    assert layer.data_to_send() == OUTCOME_AUTH
    assert layer.closed
    assert not layer.done
    assert layer.receive_data(AMQP_HEADER) == []  # ignored from now on
    assert layer.outcome(ok=True) == []
    assert layer.data_to_send() == b""


def test_failure_codes() -> None:
    layer = SaslLayer()
    feed(layer, SASL_HEADER + PLAIN_INIT)
    layer.data_to_send()
    with pytest.raises(LocalProtocolError):
        layer.outcome(ok=False, code=OK)
    with pytest.raises(LocalProtocolError):
        layer.outcome(ok=False, code=5)
    layer.outcome(ok=False, code=SYS_TEMP)
    assert proton_decode(layer.data_to_send()).value == [proton.ubyte(SYS_TEMP)]


@pytest.mark.parametrize("wire", [b"", SASL_HEADER, AMQP_HEADER, SASL_HEADER + PLAIN_INIT])
def test_outcome_out_of_turn(wire: bytes) -> None:
    layer = SaslLayer()
    feed(layer, wire)
    if wire.endswith(PLAIN_INIT):
        layer.outcome(ok=True)  # answered already
    with pytest.raises(LocalProtocolError):
        layer.outcome(ok=True)


def test_eof_during_sasl_closes_and_a_late_outcome_is_ignored() -> None:
    layer = SaslLayer()
    feed(layer, SASL_HEADER + PLAIN_INIT + AMQP_HEADER)
    assert layer.receive_data(b"") == []
    assert layer.closed
    assert layer.outcome(ok=True) == []
    assert layer.data_to_send() == SASL_HEADER + MECHANISMS_FRAME


def test_eof_before_the_header() -> None:
    layer = SaslLayer()
    assert layer.receive_data(b"AM") == []
    assert layer.receive_data(b"") == []
    assert layer.closed
    assert layer.data_to_send() == b""


# ---------------------------------------------------------------- without SASL, and wrong headers


@pytest.mark.parametrize("chunks", [None, [1] * 20, [3, 5, 2]])
def test_no_sasl_allowed_passes_everything_through(chunks: list[int] | None) -> None:
    layer = SaslLayer()
    events = feed(layer, AMQP_HEADER + OPEN_FRAME, chunks)
    assert passed(events[:1]).startswith(AMQP_HEADER)  # the whole header comes first, in one piece
    assert passed(events) == AMQP_HEADER + OPEN_FRAME
    assert layer.done
    assert layer.anonymous_without_sasl
    assert not layer.closed
    assert layer.data_to_send() == b""


def test_no_sasl_refused() -> None:
    layer = SaslLayer(allow_no_sasl=False)
    assert refused(layer, AMQP_HEADER + OPEN_FRAME).condition == NOT_ALLOWED
    assert layer.data_to_send() == SASL_HEADER
    assert not layer.anonymous_without_sasl


@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x02\x01\x00\x00",  # TLS
        b"AMQP\x03\x01\x00\x01",  # other revision
        b"AMQP\x00\x02\x00\x00",  # other major version
        b"AMQP\x01\x01\x00\x00",  # unknown protocol id
        b"AMQP\x00\x00\x09\x01",  # AMQP 0-9-1
        b"GET / HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
        b"\x00\x00\x00\x10\x02\x01\x00\x00",
    ],
)
@pytest.mark.parametrize("allow_no_sasl", [True, False])
def test_wrong_header_is_answered_with_ours_and_closed(header: bytes, allow_no_sasl: bool) -> None:
    layer = SaslLayer(allow_no_sasl=allow_no_sasl)
    refused(layer, header)
    assert layer.data_to_send() == SASL_HEADER
    assert layer.receive_data(SASL_HEADER) == []


def test_a_header_that_is_not_amqp_is_refused_at_the_first_wrong_byte() -> None:
    layer = SaslLayer()
    assert layer.receive_data(b"AM") == []
    refused(layer, b"X")
    assert layer.data_to_send() == SASL_HEADER


def test_a_second_sasl_header_after_the_outcome_is_answered_with_the_amqp_header() -> None:
    layer = SaslLayer()
    feed(layer, SASL_HEADER + PLAIN_INIT)
    layer.outcome(ok=True)
    layer.data_to_send()
    with pytest.raises(RemoteProtocolError):
        layer.receive_data(SASL_HEADER)
    assert layer.closed
    assert layer.data_to_send() == AMQP_HEADER


# ---------------------------------------------------------------- malformed SASL frames


def test_oversized_frame_is_refused_from_its_size_alone() -> None:
    layer = SaslLayer()
    layer.receive_data(SASL_HEADER)
    layer.data_to_send()
    refused(layer, struct.pack(">I", DEFAULT_MAX_FRAME_BYTES + 1))
    assert layer.data_to_send() == OUTCOME_SYS_PERM


def test_frame_size_limit_is_configurable() -> None:
    big = init("PLAIN", b"\x00alice\x00" + b"t" * 1000)
    assert feed(SaslLayer(), SASL_HEADER + big)[0] == AuthRequest("PLAIN", "alice", "t" * 1000, None)
    small = SaslLayer(max_frame_bytes=512)
    small.receive_data(SASL_HEADER)
    refused(small, big)
    with pytest.raises(LocalProtocolError):
        SaslLayer(max_frame_bytes=511)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00\x00\x08\x02\x01\x00\x00",  # empty frame
        b"\x00\x00\x00\x05\x02\x01\x00",  # shorter than its header
        frame(performative(0x41, proton.symbol("ANONYMOUS")), frame_type=0),  # an AMQP frame
        frame(performative(0x41, proton.symbol("ANONYMOUS")), doff=1),
        b"\x00\x00\x00\x0c\x04\x01\x00\x00\x00SA\x45",  # data offset beyond the frame
        frame(b"\xff\x00\x00\x00"),  # undecodable
        frame(b"\x00SA\xc0\x09\x01\xa3"),  # truncated
        frame(performative(0x41, proton.symbol("ANONYMOUS")) + b"\x40"),  # two values
        frame(b"\xa1\x05hello"),  # not described
        frame(b"\x00SA\xa1\x01x"),  # described, not a list
        frame(performative(0x41, "ANONYMOUS")),  # mechanism a string, not a symbol
        frame(performative(0x41)),  # no mechanism
        frame(performative(0x41, proton.symbol("PLAIN"), "\x00a\x00b")),  # response a string
        frame(performative(0x41, proton.symbol("PLAIN"), b"\x00a\x00b", b"host")),  # hostname binary
        MECHANISMS_FRAME,  # server to client only
        frame(performative(0x42, b"challenge")),
        frame(performative(0x43, b"\x00alice\x00secret")),  # a sasl-response
        frame(performative(0x44, proton.ubyte(0))),
        frame(performative(0x99, proton.symbol("PLAIN"))),
        frame(performative("amqp:open:list", proton.symbol("PLAIN"))),
        frame(b"\x00\x45\x45"),  # an (empty) list as the descriptor
    ],
)
def test_garbage_after_the_header_ends_with_sys_perm(garbage: bytes) -> None:
    layer = SaslLayer()
    layer.receive_data(SASL_HEADER)
    layer.data_to_send()
    refused(layer, garbage + b"\x00" * 8)
    assert layer.data_to_send() == OUTCOME_SYS_PERM


def test_a_sasl_response_behind_the_init_is_refused_before_the_outcome() -> None:
    layer = SaslLayer()
    wire = SASL_HEADER + PLAIN_INIT
    assert feed(layer, wire) == [PLAIN_REQUEST]
    layer.data_to_send()
    refused(layer, frame(performative(0x43, b"more")))
    assert layer.data_to_send() == OUTCOME_SYS_PERM
    assert layer.outcome(ok=True) == []  # the application's late answer changes nothing
    assert layer.data_to_send() == b""


def test_too_much_pipelined_before_the_outcome() -> None:
    layer = SaslLayer(max_pending_bytes=64)
    feed(layer, SASL_HEADER + PLAIN_INIT + AMQP_HEADER + b"\x00" * 56)
    refused(layer, b"\x00")
    assert layer.data_to_send().endswith(OUTCOME_SYS_PERM)


@pytest.mark.parametrize(
    "kwargs",
    [{"mechanisms": ()}, {"mechanisms": ("PLAIN", "PLAIN")}, {"mechanisms": ("SCRAM-SHA-256",)},
     {"max_frame_bytes": 1 << 32}, {"max_pending_bytes": 7}],
)  # fmt: skip
def test_constructor_checks(kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        SaslLayer(**kwargs)


# ---------------------------------------------------------------- golden bytes, checked with proton's codec


def test_mechanisms_frame_decoded_by_proton() -> None:
    layer = SaslLayer()
    layer.receive_data(SASL_HEADER)
    sent = layer.data_to_send()
    assert sent == SASL_HEADER + MECHANISMS_FRAME
    mechanisms = proton_decode(MECHANISMS_FRAME)
    assert mechanisms.descriptor == proton.ulong(0x40)
    (array,) = mechanisms.value
    assert array.type == proton.Data.SYMBOL
    assert list(array) == [proton.symbol("PLAIN"), proton.symbol("ANONYMOUS")]


@pytest.mark.parametrize(("code", "wire"), [(OK, OUTCOME_OK), (AUTH, OUTCOME_AUTH), (SYS_PERM, OUTCOME_SYS_PERM)])
def test_outcome_frames_decoded_by_proton(code: int, wire: bytes) -> None:
    outcome = proton_decode(wire)
    assert outcome.descriptor == proton.ulong(0x44)
    assert outcome.value == [proton.ubyte(code)]
    assert type(outcome.value[0]) is proton.ubyte


# ---------------------------------------------------------------- proton's client on the other end


def proton_client(mechanism: str, user: str | None = None, password: str | None = None) -> proton.Transport:
    transport = proton.Transport()  # client mode
    sasl = transport.sasl()
    sasl.allowed_mechs(mechanism)
    sasl.allow_insecure_mechs = True  # PLAIN without TLS, as over loopback or a TLS-terminating proxy
    connection = proton.Connection()
    connection.container = "test-client"
    connection.hostname = "broker.example"
    if user is not None and password is not None:
        connection.user = user
        connection.password = password
    transport.bind(connection)
    connection.open()
    return transport


def output(transport: proton.Transport) -> bytes:
    pending = transport.pending()
    if pending <= 0:
        return b""
    data = bytes(transport.peek(pending) or b"")
    transport.pop(len(data))
    return data


def test_sasl_init_encoded_by_proton() -> None:
    client = proton_client("PLAIN", "alice", "s3cr\u00eat")
    layer = SaslLayer()
    assert layer.receive_data(output(client)) == []  # proton waits for the mechanisms before its sasl-init
    client.push(layer.data_to_send())
    (request,) = layer.receive_data(output(client))
    assert type(request) is AuthRequest
    assert (request.mechanism, request.username, request.password) == ("PLAIN", "alice", "s3cr\u00eat")


@pytest.mark.parametrize(
    ("mechanism", "user", "accept", "expected"),
    [
        ("PLAIN", "alice", True, proton.SASL.OK),
        ("ANONYMOUS", None, True, proton.SASL.OK),
        ("PLAIN", "mallory", False, proton.SASL.AUTH),
    ],
)
def test_end_to_end_with_proton_client_and_server(
    mechanism: str, user: str | None, accept: bool, expected: int
) -> None:
    client = proton_client(mechanism, user, None if user is None else "secret")
    server = proton.Transport(proton.Transport.SERVER)  # the engine behind the layer: no SASL of its own
    server_connection = proton.Connection()
    server.bind(server_connection)
    layer = SaslLayer()
    requests: list[AuthRequest] = []
    for _ in range(20):
        for event in layer.receive_data(output(client)):
            if type(event) is AuthRequest:
                requests.append(event)
                for passthrough in layer.outcome(ok=accept and event.username in (None, "alice")):
                    server.push(passthrough.data)
            else:
                assert type(event) is Passthrough
                server.push(event.data)
        to_client = layer.data_to_send()
        if to_client:
            client.push(to_client)
        if server.pending() > 0:
            client.push(output(server))
        if layer.closed:
            client.close_tail()
            break
    assert len(requests) == 1
    assert requests[0].mechanism == mechanism
    assert requests[0].username == user
    assert client.sasl().outcome == expected
    if accept:
        assert layer.done
        assert server_connection.remote_container == "test-client"  # proton's engine read the client's open
        assert server_connection.remote_hostname == "broker.example"
    else:
        assert layer.closed
        assert server_connection.remote_container is None
