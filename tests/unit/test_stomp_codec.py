"""The sans-IO STOMP codec: literal frames in, events and literal frames out, fed whole and byte by byte."""

from __future__ import annotations

import contextlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_stomp.protocol import events as ev
from tridentmq_stomp.protocol.connection import State, StompServerConnection
from tridentmq_stomp.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_stomp.protocol.frames import V10, V11, V12, Frame, FrameParser, Limits, encode

CONNECT_12 = b"CONNECT\naccept-version:1.0,1.1,1.2\nhost:broker\nlogin:u\npasscode:p\nheart-beat:0,0\n\n\x00"


def feed_in_pieces(data: bytes, sizes: int | None) -> list[Frame]:
    parser = FrameParser()
    if sizes is None:
        return parser.feed(data)
    frames: list[Frame] = []
    for start in range(0, len(data), sizes):
        frames.extend(parser.feed(data[start : start + sizes]))
    return frames


def violation(conn: StompServerConnection, data: bytes, now: float = 1.0) -> ev.ProtocolViolation:
    """Feed ``data``, expect it to end in a violation, answer it as a shell would and return it."""
    events = conn.receive_data(data, now)
    assert events, "expected a ProtocolViolation"
    last = events[-1]
    assert isinstance(last, ev.ProtocolViolation), events
    conn.reject(last)
    return last


def connected(version_header: str = "1.0,1.1,1.2", heartbeat: str = "0,0", **kwargs: object) -> StompServerConnection:
    conn = StompServerConnection(**kwargs)  # type: ignore[arg-type]
    [connect] = conn.receive_data(
        f"CONNECT\naccept-version:{version_header}\nheart-beat:{heartbeat}\n\n\x00".encode(), 0.0
    )
    assert isinstance(connect, ev.Connect)
    conn.accept("session-1", "TridentMQ", 0.0)
    conn.data_to_send()
    return conn


# ---------------------------------------------------------------------------------------------------- framing
FRAMES = (
    b"SEND\ndestination:/queue/a\n\nhello\x00"
    b"\n\r\n"  # heart-beats between frames
    b"SEND\r\ndestination:/queue/b\r\ncontent-length:5\r\n\r\na\x00b\x00c\x00"
    b"DISCONNECT\nreceipt:77\n\n\x00\n"
)


@pytest.mark.parametrize("piece", [None, 1, 2, 3, 7, 64])
def test_frames_split_at_every_byte_parse_the_same(piece: int | None) -> None:
    frames = feed_in_pieces(FRAMES, piece)
    assert frames == [
        Frame("SEND", {"destination": "/queue/a"}, b"hello"),
        Frame("SEND", {"destination": "/queue/b", "content-length": "5"}, b"a\x00b\x00c"),
        Frame("DISCONNECT", {"receipt": "77"}, b""),
    ]


@pytest.mark.parametrize("piece", [None, 1, 5])
def test_crlf_and_lf_blank_lines_end_the_headers_whichever_comes_first(piece: int | None) -> None:
    data = (
        b"SEND\r\ndestination:a\r\n\r\n\nbody\x00"  # CRLF blank line, then a body starting with LF
        b"SEND\ndestination:b\n\nx\n\r\ny\x00"
    )  # LF blank line, then a body holding CR LF
    assert [(f.headers["destination"], f.body) for f in feed_in_pieces(data, piece)] == [
        ("a", b"\nbody"),
        ("b", b"x\n\r\ny"),
    ]


def test_the_first_of_repeated_headers_wins() -> None:
    [frame] = FrameParser().feed(b"SEND\ndestination:first\ndestination:second\n\n\x00")
    assert frame.headers["destination"] == "first"


@pytest.mark.parametrize(
    ("version", "raw", "value"),
    [
        (V10, "a\\nb", "a\\nb"),  # 1.0 has no escaping
        (V11, "a\\nb\\cc\\\\d", "a\nb:c\\d"),
        (V12, "a\\r\\nb", "a\r\nb"),
    ],
)
def test_header_unescaping_per_version(version: str, raw: str, value: str) -> None:
    parser = FrameParser()
    parser.version = version
    [frame] = parser.feed(f"SEND\ndestination:q\nx-key:{raw}\n\n\x00".encode())
    assert frame.headers["x-key"] == value


def test_connect_headers_are_never_unescaped() -> None:
    parser = FrameParser()
    parser.version = V12
    [frame] = parser.feed(b"CONNECT\npasscode:a\\cb\n\n\x00")
    assert frame.headers["passcode"] == "a\\cb"


@pytest.mark.parametrize("version", [V11, V12])
def test_an_undefined_escape_is_an_error(version: str) -> None:
    parser = FrameParser()
    parser.version = version
    with pytest.raises(RemoteProtocolError, match="escape"):
        parser.feed(b"SEND\ndestination:a\\tb\n\n\x00")


@pytest.mark.parametrize(
    "head",
    [
        b"SEND\nreceipt:r1\ndestination:a\\tb",  # an undefined escape after the receipt
        b"SEND\ndestination:a\nreceipt:r1\nno colon here",
        b"SEND\nreceipt:r1\n" + b"".join(b"h%d:v\n" % n for n in range(70)) + b"x:y",  # too many headers
    ],
)
def test_a_frame_whose_headers_fail_still_names_its_receipt(head: bytes) -> None:
    """The ERROR carries the receipt-id of the failing frame when it had a receipt (docs/stomp.md): one whose
    headers broke a rule after its receipt header came without it."""
    parser = FrameParser()
    parser.version = V12
    with pytest.raises(RemoteProtocolError) as failed:
        parser.feed(head + b"\n\n\x00")
    assert failed.value.receipt_id == "r1"


def test_encode_escapes_per_version_and_always_frames_bodies_by_length() -> None:
    headers = [("x:key", "line1\nline2\\")]
    assert (
        encode("MESSAGE", headers, b"a\x00b", V12)
        == b"MESSAGE\nx\\ckey:line1\\nline2\\\\\ncontent-length:3\n\na\x00b\x00"
    )
    assert encode("MESSAGE", headers, b"", V10) == b"MESSAGE\nx:key:line1 line2\\\ncontent-length:0\n\n\x00"
    assert encode("RECEIPT", [("receipt-id", "1")], b"", V12) == b"RECEIPT\nreceipt-id:1\n\n\x00"


@pytest.mark.parametrize("version", [V10, V11, V12])
@pytest.mark.parametrize("command", ["MESSAGE", "CONNECTED"])
def test_a_nul_in_a_header_never_reaches_the_wire(version: str, command: str) -> None:
    """A NUL ends a frame for the clients that read up to it (stomp.py): an MQTT correlation data or an AMQP
    binary correlation-id holding one cut the MESSAGE there and made the rest of its headers a frame of its
    own. It becomes U+FFFD, in names and values."""
    data = encode(command, [("mqtt_correlation_data", "ab\x00cd"), ("k\x00", "v")], b"body", version)
    assert data.index(b"\x00") == len(data) - 1  # the frame's own NUL only
    parser = FrameParser()
    parser.version = version
    [frame] = parser.feed(data)
    assert (frame.headers["mqtt_correlation_data"], frame.headers["k\ufffd"], frame.body) == (
        "ab\ufffdcd",
        "v",
        b"body",
    )


@settings(max_examples=200, deadline=None)
@given(
    version=st.sampled_from([V11, V12]),
    headers=st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=30), max_size=6),
    body=st.binary(max_size=200),
    piece=st.integers(min_value=1, max_value=50),
)
def test_encode_then_parse_round_trips(version: str, headers: dict[str, str], body: bytes, piece: int) -> None:
    headers = {k: v for k, v in headers.items() if k != "content-length"}
    data = encode("SEND", list(headers.items()), body, version)
    if version == V11:  # 1.1 cannot carry CR in headers (the encoder drops it)
        headers = {k.replace("\r", ""): v.replace("\r", "") for k, v in headers.items()}
    # No version carries U+0000 in a header (it becomes U+FFFD).
    headers = {k.replace("\x00", "\ufffd"): v.replace("\x00", "\ufffd") for k, v in headers.items()}
    parser = FrameParser()
    parser.version = version
    frames: list[Frame] = []
    for start in range(0, len(data), piece):
        frames.extend(parser.feed(data[start : start + piece]))
    [frame] = frames
    assert frame.body == body
    assert {k: v for k, v in frame.headers.items() if k != "content-length"} == headers


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_gives_frames_or_a_protocol_error_never_a_crash(data: bytes) -> None:
    parser = FrameParser(Limits(max_frame_bytes=1000, max_headers=8, max_header_bytes=200))
    with contextlib.suppress(RemoteProtocolError):
        parser.feed(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"SEND\ndestination:q\ncontent-length:3\n\nabcd\x00", "malformed frame"),  # length wrong
        (b"SEND\ndestination:q\ncontent-length:-1\n\n\x00", "malformed frame"),
        (b"SEND\nno colon here\n\n\x00", "malformed frame"),
        (b"send\n\n\x00", "malformed frame"),
        (b"SEND\n" + b"h:v\n" * 100 + b"\n\x00", "frame too large"),  # header count
        (b"SEND\nh:" + b"v" * 300 + b"\n\n\x00", "frame too large"),  # header bytes
        (b"SEND\nh:" + b"v" * 300, "frame too large"),  # header bytes, before the blank line arrives
        (b"SEND\ncontent-length:5000\n\n", "frame too large"),
        (b"SEND\n\n" + b"x" * 2000, "frame too large"),  # no NUL in sight
        (b"SEND\nh:\xff\n\n\x00", "malformed frame"),
    ],
)
def test_bad_frames_raise_with_a_clear_message(data: bytes, message: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        FrameParser(Limits(max_frame_bytes=1000, max_headers=8, max_header_bytes=200)).feed(data)
    assert info.value.message == message


def test_frames_before_bad_input_in_the_same_read_come_first_and_the_error_next() -> None:
    parser = FrameParser()
    assert [f.body for f in parser.feed(b"SEND\ndestination:a\n\nx\x00\x16\x03\x01garbage")] == [b"x"]
    for more in (b"", b"SEND\n\n\x00"):  # the violation is raised, and nothing after it is read
        with pytest.raises(RemoteProtocolError, match="bad command line"):
            parser.feed(more)


@pytest.mark.parametrize(
    "data", [b"\x16\x03\x01\x02\x00", b"\x00", b"GET / HTTP/1.1", b"sEND", b"SEND\rX", b"\xc3\x84"]
)
def test_garbage_is_refused_before_any_line_ends(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="bad command line"):
        FrameParser().feed(data)


@pytest.mark.parametrize("data", [b"SEN", b"SEND\r", b"SEND\ndestination:/queue/a"])
def test_a_command_that_has_not_fully_arrived_waits(data: bytes) -> None:
    assert FrameParser().feed(data) == []


@pytest.mark.parametrize("size", [10, 11])
def test_the_body_limit_holds_when_the_nul_arrives_in_the_same_read(size: int) -> None:
    parser = FrameParser(Limits(max_frame_bytes=10))
    data = b"SEND\n\n" + b"x" * size + b"\x00"
    if size <= 10:
        assert parser.feed(data)[0].body == b"x" * size
        return
    with pytest.raises(RemoteProtocolError, match="body exceeds 10 bytes"):
        parser.feed(data)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_headers_of_exactly_the_byte_limit_pass_however_they_are_split(eol: bytes) -> None:
    head = b"SEND" + eol + b"h:" + b"v" * 40  # the command and header lines, EOLs included: the limit
    limits = Limits(max_header_bytes=len(head))
    data = head + eol + eol + b"\x00"
    for piece in range(1, len(data) + 1):
        parser = FrameParser(limits)
        frames = [f for start in range(0, len(data), piece) for f in parser.feed(data[start : start + piece])]
        assert [f.headers for f in frames] == [{"h": "v" * 40}], piece
    with pytest.raises(RemoteProtocolError, match="frame too large"):
        FrameParser(Limits(max_header_bytes=len(head) - 1)).feed(data)


# ---------------------------------------------------------------------------------------------------- connection
@pytest.mark.parametrize(
    ("offered", "chosen"), [("1.0,1.1,1.2", V12), ("1.1", V11), (None, V10), ("1.0,1.1", V11), ("1.2,2.0", V12)]
)
def test_version_negotiation(offered: str | None, chosen: str) -> None:
    conn = StompServerConnection()
    head = "CONNECT\n" + (f"accept-version:{offered}\n" if offered else "") + "\n"
    [connect] = conn.receive_data(head.encode() + b"\x00", 0.0)
    assert isinstance(connect, ev.Connect)
    assert connect.version == chosen
    conn.accept("s1", "TridentMQ/0.1", 0.0)
    out = conn.data_to_send().decode()
    assert out.startswith(f"CONNECTED\nversion:{chosen}\nsession:s1\nserver:TridentMQ/0.1\n")
    assert ("heart-beat:" in out) is (chosen != V10)


def test_an_unsupported_version_gets_an_error_listing_ours() -> None:
    conn = StompServerConnection()
    violation(conn, b"CONNECT\naccept-version:2.0\n\n\x00")
    out = conn.data_to_send().decode()
    assert re.match(r"ERROR\nversion:1.0,1.1,1.2\n", out)
    assert "Supported protocol versions are 1.0, 1.1, 1.2" in out
    assert conn.closed


def test_stomp_command_connects_and_credentials_and_host_are_reported() -> None:
    [connect] = StompServerConnection().receive_data(CONNECT_12.replace(b"CONNECT", b"STOMP"), 0.0)
    assert isinstance(connect, ev.Connect)
    assert (connect.login, connect.passcode, connect.host) == ("u", "p", "broker")


def test_refuse_sends_an_error_and_closes() -> None:
    conn = StompServerConnection()
    conn.receive_data(CONNECT_12, 0.0)
    conn.refuse("authentication failed", "bad login or passcode")
    out = conn.data_to_send()
    assert out.startswith(b"ERROR\nmessage:authentication failed\n")
    assert out.endswith(b"bad login or passcode\x00")
    assert conn.closed
    with pytest.raises(LocalProtocolError):
        conn.accept("s", "x", 0.0)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"SEND\n\n\x00", "missing header"),
        (b"SUBSCRIBE\ndestination:/queue/a\n\n\x00", "missing header"),  # 1.2 needs an id
        (b"SUBSCRIBE\ndestination:/queue/a\nid:1\nack:sometimes\n\n\x00", "invalid header"),
        (b"ACK\nmessage-id:1\n\n\x00", "missing header"),  # 1.2 acks by id
        (b"BEGIN\n\n\x00", "missing header"),
        (b"FLY\n\n\x00", "unknown command"),
        (b"CONNECT\n\n\x00", "already connected"),
        (b"ACK\nid:1\n\nbody\x00", "malformed frame"),
    ],
)
def test_bad_frames_after_connect_give_an_error_with_the_receipt_id(frame: bytes, message: str) -> None:
    conn = connected()
    frame = frame.replace(b"\n\n", b"\nreceipt:r-9\n\n", 1)
    assert violation(conn, frame).message == message
    out = conn.data_to_send().decode()
    assert out.startswith(f"ERROR\nmessage:{message}\ncontent-type:text/plain\nreceipt-id:r-9\n")
    assert conn.closed
    assert conn.receive_data(b"SEND\ndestination:x\n\n\x00", 2.0) == []


def test_frames_before_connect_are_refused() -> None:
    conn = StompServerConnection()
    assert violation(conn, b"SEND\ndestination:/queue/a\n\nx\x00").message == "not connected"
    assert conn.data_to_send().startswith(b"ERROR\nmessage:not connected\n")


def test_frames_pipelined_behind_connect_are_events_and_a_violation_comes_after_them() -> None:
    conn = StompServerConnection()
    events = conn.receive_data(CONNECT_12 + b"SEND\ndestination:/queue/a\n\nx\x00FLY\n\n\x00SEND\n\n\x00", 0.0)
    assert [type(e) for e in events] == [ev.Connect, ev.Send, ev.ProtocolViolation]
    conn.accept("s", "x", 0.0)  # the shell answers in order: CONNECTED first
    conn.reject(events[-1])  # type: ignore[arg-type]
    out = conn.data_to_send()
    assert out.startswith(b"CONNECTED\n")
    assert b"ERROR\nmessage:unknown command\n" in out
    assert conn.receive_data(b"SEND\ndestination:x\n\n\x00", 1.0) == []


def test_each_command_becomes_its_event() -> None:
    conn = connected()
    data = (
        b"SEND\ndestination:/queue/a\ntransaction:t1\nreceipt:1\ncustom:v\n\nbody\x00"
        b"SUBSCRIBE\nid:s1\ndestination:/topic/t\nack:client-individual\n\n\x00"
        b"ACK\nid:a-1\ntransaction:t1\n\n\x00"
        b"NACK\nid:a-2\n\n\x00"
        b"BEGIN\ntransaction:t1\n\n\x00COMMIT\ntransaction:t1\n\n\x00ABORT\ntransaction:t2\n\n\x00"
        b"UNSUBSCRIBE\nid:s1\n\n\x00"
        b"DISCONNECT\nreceipt:bye\n\n\x00"
    )
    events = conn.receive_data(data, 1.0)
    assert events == [
        ev.Send(
            "/queue/a",
            "t1",
            "1",
            {
                "destination": "/queue/a",
                "transaction": "t1",
                "receipt": "1",
                "custom": "v",
            },
            b"body",
        ),
        ev.Subscribe(
            "s1",
            "/topic/t",
            "client-individual",
            None,
            {"id": "s1", "destination": "/topic/t", "ack": "client-individual"},
        ),
        ev.Ack("a-1", None, "t1", None, nack=False),
        ev.Ack("a-2", None, None, None, nack=True),
        ev.Transaction("BEGIN", "t1", None),
        ev.Transaction("COMMIT", "t1", None),
        ev.Transaction("ABORT", "t2", None),
        ev.Unsubscribe("s1", None, None, {"id": "s1"}),
        ev.Disconnect("bye"),
    ]


def test_stomp_10_defaults_subscription_id_and_acks_by_message_id() -> None:
    conn = connected(version_header="1.0")
    events = conn.receive_data(
        b"SUBSCRIBE\ndestination:/queue/a\n\n\x00ACK\nmessage-id:m1\n\n\x00UNSUBSCRIBE\ndestination:/queue/a\n\n\x00",
        1.0,
    )
    assert events == [
        ev.Subscribe("/queue/a", "/queue/a", "auto", None, {"destination": "/queue/a"}),
        ev.Ack("m1", None, None, None, nack=False),
        ev.Unsubscribe(None, "/queue/a", None, {"destination": "/queue/a"}),
    ]
    assert "NACK" in violation(conn, b"NACK\nmessage-id:m1\n\n\x00").detail


def test_stomp_11_ack_needs_the_subscription() -> None:
    conn = connected(version_header="1.1")
    events = conn.receive_data(b"ACK\nmessage-id:m1\nsubscription:s\n\n\x00", 1.0)
    assert events == [ev.Ack("m1", "s", None, None, nack=False)]
    assert "subscription" in violation(conn, b"ACK\nmessage-id:m1\n\n\x00").detail


def test_nothing_after_a_disconnect_is_read_but_the_frames_before_it_are_answered() -> None:
    conn = connected()
    events = conn.receive_data(b"SEND\ndestination:x\n\n\x00DISCONNECT\n\n\x00SEND\ndestination:x\n\n\x00", 1.0)
    assert [type(e) for e in events] == [ev.Send, ev.Disconnect]
    assert conn.receive_data(b"SEND\ndestination:y\n\n\x00", 1.0) == []
    conn.receipt("for-the-send")  # the shell may still answer what came before
    assert conn.data_to_send().startswith(b"RECEIPT\nreceipt-id:for-the-send\n")


def test_messages_receipts_and_errors_are_encoded_in_the_negotiated_version() -> None:
    conn = connected(version_header="1.1")
    conn.message([("destination", "/queue/a"), ("x", "a:b")], b"hi")
    conn.receipt("r1")
    assert conn.data_to_send() == (
        b"MESSAGE\ndestination:/queue/a\nx:a\\cb\ncontent-length:2\n\nhi\x00RECEIPT\nreceipt-id:r1\n\n\x00"
    )
    conn.error("send refused", "address full", "r2")
    assert conn.data_to_send() == (
        b"ERROR\nmessage:send refused\ncontent-type:text/plain\nreceipt-id:r2\ncontent-length:12\n\naddress full\x00"
    )
    with pytest.raises(LocalProtocolError):
        conn.receipt("late")


def test_eof_is_an_event() -> None:
    conn = connected(heartbeat="1000,0")
    assert conn.receive_data(b"", 1.0) == [ev.ConnectionClosed()]
    # Only the client's sending side closed: what it sent before can still be answered.
    assert not conn.closed
    conn.receipt("r1")
    assert conn.data_to_send() == b"RECEIPT\nreceipt-id:r1\n\n\x00"
    assert conn.receive_data(b"SEND\ndestination:/queue/a\n\n\x00", 2.0) == []
    conn.handle_timeout(1000.0)  # no heart-beat is awaited from a client that closed its side
    assert not conn.closed


# ---------------------------------------------------------------------------------------------------- heart-beats
def test_heartbeats_are_negotiated_sent_and_missed_ones_close_the_connection() -> None:
    conn = StompServerConnection(heartbeat=(500, 1000), min_heartbeat_ms=100)
    conn.receive_data(b"CONNECT\naccept-version:1.2\nheart-beat:200,300\n\n\x00", 0.0)
    conn.accept("s", "x", 0.0)
    assert b"heart-beat:500,1000\n" in conn.data_to_send()  # send max(500,300), expect max(1000,200)
    assert conn.send_interval == 0.5
    assert conn.receive_interval == 2.0  # twice the interval: tolerance for the network and scheduling
    assert conn.next_deadline() == 0.5
    conn.handle_timeout(0.5)
    assert conn.data_to_send() == b"\n"
    conn.sent(0.5)
    conn.receive_data(b"\n", 1.5)  # a client heart-beat
    conn.handle_timeout(3.4)  # 1.9 s of silence: still within 2 s
    assert not conn.closed
    assert conn.data_to_send() == b"\n"
    conn.sent(3.4)
    with pytest.raises(RemoteProtocolError, match="heart-beat missed"):
        conn.handle_timeout(3.6)
    assert conn.data_to_send().startswith(b"ERROR\nmessage:heart-beat missed\n")


def test_heartbeats_off_when_either_side_says_zero_and_never_below_the_floor() -> None:
    conn = connected(heartbeat="0,0")
    assert conn.next_deadline() is None
    fast = StompServerConnection(heartbeat=(10, 10), min_heartbeat_ms=100)
    fast.receive_data(b"CONNECT\naccept-version:1.2\nheart-beat:1,1\n\n\x00", 0.0)
    fast.accept("s", "x", 0.0)
    assert (fast.send_interval, fast.receive_interval) == (0.1, 0.2)


def test_a_heartbeat_of_hundreds_of_digits_is_the_longest_interval_not_an_overflow() -> None:
    """Divided into seconds, such a number raised OverflowError in accept(): no CONNECTED, no ERROR."""
    conn = StompServerConnection(heartbeat=(1000, 1000))
    conn.receive_data(b"CONNECT\naccept-version:1.2\nheart-beat:1" + b"0" * 400 + b",1" + b"0" * 400 + b"\n\n\x00", 0.0)
    conn.accept("s", "x", 0.0)
    assert (conn.send_interval, conn.receive_interval) == ((2**31 - 1) / 1000, (2**31 - 1) / 1000 * 2)
    assert conn.data_to_send().startswith(b"CONNECTED\n")


def test_a_client_that_does_not_connect_in_time_gets_an_error() -> None:
    conn = StompServerConnection(connect_timeout=5.0, now=100.0)
    assert conn.next_deadline() == 105.0
    conn.handle_timeout(104.9)
    assert conn.data_to_send() == b""
    with pytest.raises(RemoteProtocolError, match="connect timeout"):
        conn.handle_timeout(105.0)
    assert conn.data_to_send().startswith(b"ERROR\nmessage:connect timeout\n")
    assert conn.closed


def test_the_connect_timeout_ends_with_the_connect() -> None:
    conn = StompServerConnection(connect_timeout=5.0, now=100.0, heartbeat=(0, 0))
    conn.receive_data(CONNECT_12, 101.0)
    assert conn.next_deadline() is None  # waiting for the shell's accept(): not the client's fault
    conn.accept("s", "x", 101.0)
    conn.handle_timeout(200.0)
    assert conn.state is State.CONNECTED
    assert StompServerConnection().next_deadline() is None  # no limit by default


def test_no_heartbeat_is_missed_while_the_shell_is_not_reading() -> None:
    conn = StompServerConnection(heartbeat=(0, 1000))
    conn.receive_data(b"CONNECT\naccept-version:1.2\nheart-beat:1000,0\n\n\x00", 0.0)
    conn.accept("s", "x", 0.0)
    assert conn.next_deadline() == conn.receive_interval
    conn.reading_paused()
    assert conn.next_deadline() is None
    conn.handle_timeout(100.0)  # long silent, but the bytes wait unread in the socket
    assert not conn.closed
    conn.reading_resumed(100.0)
    assert conn.next_deadline() == 100.0 + conn.receive_interval


def test_a_bad_heartbeat_header_is_an_error() -> None:
    conn = StompServerConnection()
    assert "heart-beat" in violation(conn, b"CONNECT\naccept-version:1.2\nheart-beat:soon\n\n\x00").detail
    assert conn.state is State.CLOSED


@pytest.mark.parametrize(
    ("version_header", "login"), [("", "app"), ("accept-version: 1.0\n", "app"), ("accept-version:1.2\n", " app ")]
)
def test_connect_headers_are_trimmed_in_stomp_10_only(version_header: str, login: str) -> None:
    conn = StompServerConnection()
    [connect] = conn.receive_data(f"CONNECT\n{version_header}login: app \n passcode :s\n\n\x00".encode(), 0.0)
    assert isinstance(connect, ev.Connect)
    assert connect.login == login
    assert (connect.passcode is None) == (login != "app")
