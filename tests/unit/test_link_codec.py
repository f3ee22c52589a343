"""Tests of the sans-IO internal link codec (``tridentmq_shared.link``) and of the wire message checks.

Everything goes through the public API: ``LinkConnection`` fed with bytes (built by the codec itself or
by hand with msgpack), events and ``data_to_send()`` bytes compared with what the protocol says.
"""

from __future__ import annotations

import contextlib
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import (
    DEFAULT_HEARTBEAT_MS,
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_MAX_OPS_PER_FRAME,
    DELIVERY_HEADROOM,
    FRAME_OPERATIONS,
    HEARTBEAT_TIMEOUT_FACTOR,
    MAX_CREDIT,
    MAX_FIELD_INT,
    MIN_FRAME_SIZE,
    LinkConnection,
    Role,
    State,
    opens_channel,
)
from tridentmq_shared.link.errors import LinkError, LocalProtocolError, RemoteProtocolError
from tridentmq_shared.link.ops import HEADER_SIZE, PROTOCOL_VERSIONS, ErrorCode, NackMode, Op
from tridentmq_shared.message import (
    M_BODY,
    M_DURABLE,
    M_PRIORITY,
    M_PROPS,
    M_ROUTING,
    MAX_TIME_MS,
    MESSAGE_FIELDS,
    ROUTING_DEFAULT,
    RoutingType,
    check_message,
    new_message,
)

HYPOTHESIS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------------------------- helpers
def raw_frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def frame(ops: Any) -> bytes:
    """A frame built by hand: 4-byte big-endian length, then the msgpack payload."""
    return raw_frame(msgpack.packb(ops))


def split_frames(data: bytes) -> list[bytes]:
    """The payloads of the complete frames in ``data`` (which must hold nothing else)."""
    payloads = []
    pos = 0
    while pos < len(data):
        assert len(data) - pos >= HEADER_SIZE, "truncated header"
        (size,) = struct.unpack(">I", data[pos : pos + HEADER_SIZE])
        pos += HEADER_SIZE
        assert len(data) - pos >= size, "truncated body"
        payloads.append(data[pos : pos + size])
        pos += size
    return payloads


def decode_frames(data: bytes) -> list[list[Any]]:
    return [msgpack.unpackb(p, raw=False) for p in split_frames(data)]


def decoded_ops(data: bytes) -> list[Any]:
    return [op for ops in decode_frames(data) for op in ops]


def pump(src: LinkConnection, dst: LinkConnection, now: float = 0.0) -> list[Any]:
    """Move whatever ``src`` has queued into ``dst`` (nothing queued: no call, b"" would mean EOF)."""
    data = src.data_to_send()
    return dst.receive_data(data, now) if data else []


def open_pair(
    *,
    client_kw: dict[str, Any] | None = None,
    server_kw: dict[str, Any] | None = None,
    credit: int = 100,
    now: float = 0.0,
) -> tuple[LinkConnection, LinkConnection]:
    client = LinkConnection(Role.CLIENT, **(client_kw or {}))
    server = LinkConnection(Role.SERVER, **(server_kw or {}))
    client.hello("user", "pw", "test-client")
    [hello] = pump(client, server, now)
    assert isinstance(hello, ev.HelloReceived)
    server.accept("node-1", "conn-1", credit, 0.0)
    [welcome] = pump(server, client, now)
    assert isinstance(welcome, ev.Welcomed)
    assert client.state is State.OPEN
    assert server.state is State.OPEN
    return client, server


def message(address: str = "orders", body: bytes = b"payload", **fields: Any) -> list[Any]:
    return new_message(address, body, **fields)


def expect_remote_error(conn: LinkConnection, data: bytes, code: str, now: float = 1.0) -> RemoteProtocolError:
    """``data`` breaks the protocol: RemoteProtocolError(code), a CLOSE naming it queued, link closed."""
    with pytest.raises(RemoteProtocolError) as info:
        conn.receive_data(data, now)
    error = info.value
    assert error.code == code
    assert isinstance(error, LinkError)
    assert conn.state is State.CLOSED
    close = decoded_ops(conn.data_to_send())[-1]
    assert close == [Op.CLOSE, code, error.text]
    assert error.text
    # a closed link ignores whatever still arrives
    assert conn.receive_data(frame([[Op.HEARTBEAT]]), now) == []
    return error


def deeply_nested(depth: int) -> bytes:
    """msgpack bytes of a str wrapped in ``depth`` one-element arrays (too deep to build with packb)."""
    return b"\x91" * depth + msgpack.packb("x")


# ---------------------------------------------------------------------------------------------- golden bytes
HELLO_GOLDEN = (  # a version 1 client's
    b"\x00\x00\x00\x1f"  # length 31
    b"\x91\x97\x01\x91\x01\xa5alice\xa6secret\xa4gw-1\xcd\x01\xf4\xce\x00\x01\x00\x00"
)
HELLO_V2_GOLDEN = (
    b"\x00\x00\x00\x20"  # length 32
    b"\x91\x97\x01\x92\x01\x02\xa5alice\xa6secret\xa4gw-1\xcd\x01\xf4\xce\x00\x01\x00\x00"
)
HELLO_V3_GOLDEN = (
    b"\x00\x00\x00\x21"  # length 33
    b"\x91\x97\x01\x93\x01\x02\x03\xa5alice\xa6secret\xa4gw-1\xcd\x01\xf4\xce\x00\x01\x00\x00"
)
HELLO_V4_GOLDEN = (
    b"\x00\x00\x00\x22"  # length 34
    b"\x91\x97\x01\x94\x01\x02\x03\x04\xa5alice\xa6secret\xa4gw-1\xcd\x01\xf4\xce\x00\x01\x00\x00"
)


def test_hello_golden_bytes() -> None:
    client = LinkConnection(Role.CLIENT, heartbeat_ms=500, max_frame_size=65536)
    client.hello("alice", "secret", "gw-1")
    data = client.data_to_send()
    assert data == HELLO_V4_GOLDEN
    assert data == frame([[1, [1, 2, 3, 4], "alice", "secret", "gw-1", 500, 65536]])
    assert client.data_to_send() == b""
    v3 = LinkConnection(Role.CLIENT, heartbeat_ms=500, max_frame_size=65536, versions=(1, 2, 3))
    v3.hello("alice", "secret", "gw-1")
    assert v3.data_to_send() == HELLO_V3_GOLDEN
    v2 = LinkConnection(Role.CLIENT, heartbeat_ms=500, max_frame_size=65536, versions=(1, 2))
    v2.hello("alice", "secret", "gw-1")
    assert v2.data_to_send() == HELLO_V2_GOLDEN
    old = LinkConnection(Role.CLIENT, heartbeat_ms=500, max_frame_size=65536, versions=(1,))
    old.hello("alice", "secret", "gw-1")
    assert old.data_to_send() == HELLO_GOLDEN


def test_hello_golden_bytes_are_understood_by_a_server() -> None:
    server = LinkConnection(Role.SERVER, heartbeat_ms=100)
    assert server.receive_data(HELLO_GOLDEN, 0.0) == [ev.HelloReceived(1, "alice", "secret", "gw-1", 500)]
    assert server.state is State.AUTHENTICATING


def test_welcome_carries_the_node_epoch_when_it_has_one() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello(None, None, "gw")
    pump(client, server)
    server.accept("node-1", "conn-1", 10, 0.0, epoch=3)
    assert pump(server, client) == [ev.Welcomed(4, "node-1", "conn-1", DEFAULT_HEARTBEAT_MS, 10, 3)]
    old = LinkConnection(Role.CLIENT, versions=(1,))
    server = LinkConnection(Role.SERVER)
    old.hello(None, None, "gw")
    pump(old, server)
    server.accept("node-1", "conn-1", 10, 0.0, epoch=3)
    assert pump(server, old) == [ev.Welcomed(1, "node-1", "conn-1", DEFAULT_HEARTBEAT_MS, 10, 3)]


def test_a_welcome_with_a_bad_epoch_is_malformed() -> None:
    client = LinkConnection(Role.CLIENT)
    client.hello(None, None, "gw")
    client.data_to_send()
    expect_remote_error(client, frame([[Op.WELCOME, 1, "n", "c", 100, MIN_FRAME_SIZE, 10, -1]]), ErrorCode.MALFORMED)


def test_op_codes_are_stable() -> None:
    assert PROTOCOL_VERSIONS == (1, 2, 3, 4)
    assert HEADER_SIZE == 4
    assert {op.name: int(op) for op in Op} == {
        "HELLO": 1,
        "WELCOME": 2,
        "CLOSE": 3,
        "HEARTBEAT": 4,
        "OK": 5,
        "ERROR": 6,
        "CREATE_ADDRESS": 10,
        "DELETE_ADDRESS": 11,
        "CREATE_QUEUE": 12,
        "DELETE_QUEUE": 13,
        "SUBSCRIBE": 14,
        "UNSUBSCRIBE": 15,
        "TX_BEGIN": 16,
        "TX_COMMIT": 17,
        "TX_ROLLBACK": 18,
        "SET_WILL": 19,
        "PUBLISH": 20,
        "CONFIRM": 21,
        "REJECT": 22,
        "PUBLISH_CREDIT": 23,
        "DELIVER": 24,
        "ACK": 25,
        "NACK": 26,
        "FLOW": 27,
        "CONSUMER_CLOSED": 28,
        "BROWSE_DONE": 29,
        "TOPOLOGY": 30,
        "TOPOLOGY_UPDATE": 31,
        "REPLICATE": 32,
        "REPLICA": 33,
        "REPLICA_ACK": 34,
        "VOTE": 35,
        "CHANNEL": 36,
        "DELETE_QUEUE_EVERYWHERE": 37,
    }
    assert [int(m) for m in NackMode] == [0, 1, 2]


def test_delete_queue_everywhere_needs_version_3() -> None:
    """A version 3 link carries DELETE_QUEUE_EVERYWHERE; on an older one the request is a plain DELETE_QUEUE
    (the node deletes its own copy), and a peer that sends it there anyway breaks the link."""
    client, server = open_pair()
    req = client.delete_queue("mqtt.sub.c.t", everywhere=True)
    assert pump(client, server) == [ev.DeleteQueueEverywhere(req, "mqtt.sub.c.t")]
    old, server = open_pair(client_kw={"versions": (1, 2)})
    req = old.delete_queue("mqtt.sub.c.t", everywhere=True)
    assert pump(old, server) == [ev.DeleteQueue(req, "mqtt.sub.c.t")]
    expect_remote_error(server, frame([[Op.DELETE_QUEUE_EVERYWHERE, 9, "q"]]), ErrorCode.UNEXPECTED)


def test_topology_request_and_updates_cross_the_link() -> None:
    client, server = open_pair()
    req = client.topology({"join": {"node_id": "n1"}})
    assert server.receive_data(client.data_to_send(), 0.0) == [ev.Topology(req, {"join": {"node_id": "n1"}})]
    server.reply(req, {"members": []})
    server.topology_update({"bindings": [], "removed": []})
    assert client.receive_data(server.data_to_send(), 0.0) == [
        ev.Reply(req, {"members": []}),
        ev.TopologyUpdate({"bindings": [], "removed": []}),
    ]


def test_channel_bytes_cross_the_link_both_ways_beside_other_operations() -> None:
    client, server = open_pair()
    client.channel(7, b"session seven")
    req = client.create_address("orders", [0])
    client.channel(8, b"")  # channel 8 ends
    assert server.receive_data(client.data_to_send(), 0.0) == [ev.CreateAddress(req, "orders", (0,))]
    assert server.channel_data == [(7, b"session seven"), (8, b"")]
    server.channel(7, b"answer")
    assert client.receive_data(server.data_to_send(), 0.0) == []
    assert client.channel_data == [(7, b"answer")]


@pytest.mark.parametrize(
    ("op", "code"),
    [
        ([Op.CHANNEL, 0, b"x"], ErrorCode.MALFORMED),  # ids start at 1
        ([Op.CHANNEL, -1, b"x"], ErrorCode.MALFORMED),
        ([Op.CHANNEL, 1, "text"], ErrorCode.MALFORMED),  # bytes, not a string
        ([Op.CHANNEL, 1], ErrorCode.MALFORMED),
        ([Op.CHANNEL, 1, b"x", 2], ErrorCode.MALFORMED),
        ([Op.CHANNEL, 2**64 - 1, b"x"], ErrorCode.MALFORMED),
    ],
)
def test_a_malformed_channel_operation_closes_the_link(op: list[Any], code: str) -> None:
    """CHANNEL operations, nearly all of a shared link's traffic, are checked inline; whatever that check does
    not pass is refused by the operations' common checks."""
    _, server = open_pair()
    expect_remote_error(server, frame([op]), code)


def test_a_channel_of_a_channel_is_refused() -> None:
    """Channels do not nest: a session's own link carries none."""
    _, server = open_pair(server_kw={"carries_channels": False})
    expect_remote_error(server, frame([[Op.CHANNEL, 1, b"x"]]), ErrorCode.MALFORMED)


def test_only_a_hello_opens_a_channel() -> None:
    """The first bytes seen of a channel id open it only if they start a session's first write, its HELLO
    frame: whatever else comes on an unknown id was on its way when the channel was ended there."""
    session = LinkConnection(Role.CLIENT)
    session.hello("alice", "secret", "gw-1", "10.0.0.7", "device-7")
    hello = session.data_to_send()
    assert opens_channel(hello)
    assert opens_channel(HELLO_GOLDEN)
    # A HELLO of more than a channel chunk (a long password, a raised handshake limit) comes in pieces.
    assert opens_channel(hello[: HEADER_SIZE + 8])
    long = LinkConnection(Role.CLIENT, max_frame_size=1 << 20)
    long.hello("alice", "p" * 70_000, "gw-1")
    assert opens_channel(long.data_to_send()[: 64 * 1024])
    wide = frame([[int(Op.HELLO), [4], "a", None, "gw", 0, 65536]])
    assert opens_channel(raw_frame(b"\xdd\x00\x00\x00\x01" + wide[HEADER_SIZE + 1 :]))  # any array width
    client, _server = open_pair()
    client.create_address("orders", [0])
    client.publish(message())
    assert not opens_channel(client.data_to_send())  # a session's later frames
    assert not opens_channel(frame([[int(Op.CLOSE), "eof", "bye"]]))
    assert not opens_channel(frame([[int(Op.HEARTBEAT)], [int(Op.HELLO)]]))  # HELLO only as the first
    assert not opens_channel(frame([[1.0, [4]]]))  # the code is an integer
    assert not opens_channel(frame([[True, [4]]]))
    assert not opens_channel(hello[HEADER_SIZE:])  # the middle of a stream
    assert not opens_channel(b"")
    assert not opens_channel(hello[: HEADER_SIZE + 2])
    assert not opens_channel(raw_frame(b"\xc1"))  # undecodable
    assert not opens_channel(frame([]))
    assert not opens_channel(frame({"a": 1}))
    assert not opens_channel(frame([["x"]]))
    assert not opens_channel(raw_frame(b"\xdd\xff\xff\xff\xff"))  # an array that claims 4 G entries
    # Bytes from the middle of a large publish cut into chunks: as good as never taken for a HELLO.
    noise = random.Random(7)
    assert sum(opens_channel(noise.randbytes(64)) for _ in range(100_000)) <= 5


@pytest.mark.parametrize("op", [[36, 0, b"x"], [36, 1, "not bytes"], [36, 1], [36, -1, b"x"]])
def test_a_malformed_channel_operation_breaks_the_link(op: list[Any]) -> None:
    _client, server = open_pair()
    with pytest.raises(RemoteProtocolError) as error:
        server.receive_data(frame([op]), 0.0)
    assert error.value.code == ErrorCode.MALFORMED


def test_a_channel_carries_no_channels() -> None:
    """A channel's own link may not open channels: they would multiply a link's ``max_channels``."""
    _client, server = open_pair(server_kw={"carries_channels": False})
    with pytest.raises(RemoteProtocolError) as error:
        server.receive_data(frame([[36, 1, b"x"]]), 0.0)
    assert error.value.code == ErrorCode.MALFORMED
    assert server.closed


def test_frames_split_anywhere_arrive_whole_and_once() -> None:
    """Whole frames are read from the caller's bytes; only an incomplete frame's start is kept between reads."""

    def requests() -> tuple[LinkConnection, bytes, list[ev.Event]]:
        client, server = open_pair()
        reqs = [client.create_address(f"orders.{i}", [0]) for i in range(20)]
        return server, client.data_to_send(), [ev.CreateAddress(r, f"orders.{i}", (0,)) for i, r in enumerate(reqs)]

    for cut in (1, 3, 5, 200, -1):
        server, data, expected = requests()
        assert server.receive_data(data[:cut], 0.0) + server.receive_data(data[cut:], 0.0) == expected
    server, data, expected = requests()
    assert [event for i in range(len(data)) for event in server.receive_data(data[i : i + 1], 0.0)] == expected


def test_channel_bytes_need_an_open_link() -> None:
    client = LinkConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError):
        client.channel(1, b"too early")
    server = LinkConnection(Role.SERVER)
    with pytest.raises(RemoteProtocolError):  # nothing but HELLO before the handshake
        server.receive_data(frame([[36, 1, b"x"]]), 0.0)


def test_a_malformed_topology_request_breaks_the_link() -> None:
    _client, server = open_pair()
    with pytest.raises(RemoteProtocolError):
        server.receive_data(frame([[30, 1, "not a map"]]), 0.0)


def test_welcome_bytes_match_a_hand_built_frame() -> None:
    client = LinkConnection(Role.CLIENT, heartbeat_ms=100, versions=(1,))
    server = LinkConnection(Role.SERVER, heartbeat_ms=300, max_frame_size=MIN_FRAME_SIZE)
    client.hello(None, None, "c")
    pump(client, server)
    server.accept("node-7", "conn-9", 42, 0.0)
    assert server.data_to_send() == frame([[2, 1, "node-7", "conn-9", 300, MIN_FRAME_SIZE, 42]])
    # Version 2 on: the epoch is always there (0: none), then the publish window in bytes.
    client = LinkConnection(Role.CLIENT, heartbeat_ms=100)
    server = LinkConnection(Role.SERVER, heartbeat_ms=300, max_frame_size=MIN_FRAME_SIZE)
    client.hello(None, None, "c")
    pump(client, server)
    server.accept("node-7", "conn-9", 42, 0.0, publish_bytes=5000)
    assert server.data_to_send() == frame([[2, 4, "node-7", "conn-9", 300, MIN_FRAME_SIZE, 42, 0, 5000]])


def test_request_and_message_bytes_match_hand_built_frames() -> None:
    client, server = open_pair(client_kw={"versions": (1,)})
    m = message()
    req = client.create_address("orders", [0, 1])
    seq = client.publish(m, tx_id=3)
    client.ack(5, [7, 8])
    client.nack(5, [9], NackMode.REJECT)
    assert client.data_to_send() == frame(
        [
            [10, req, "orders", [0, 1]],
            [20, seq, 3, m],
            [25, 5, 0, [7, 8]],
            [26, 5, [9], 2],
        ]
    )
    server.reply(req, {"created": True})
    server.confirm(seq)
    server.grant_publish_credit(10)
    assert server.data_to_send() == frame([[5, req, {"created": True}], [21, seq, seq], [23, 10]])


def test_hand_built_frames_are_decoded() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 5)
    pump(client, server)
    m = message(body=b"\x00\x01")
    data = frame([[24, cid, 2, m], [5, 1, None], [6, 9, "not-found", "no such queue"], [29, cid]])
    assert client.receive_data(data, 1.0) == [
        ev.Deliveries([[24, cid, 2, m]]),
        ev.Reply(1, None),
        ev.RequestFailed(9, "not-found", "no such queue"),
        ev.BrowseDone(cid),
    ]


# ---------------------------------------------------------------------------------------------- handshake
def test_handshake_events_and_state() -> None:
    client = LinkConnection(Role.CLIENT, heartbeat_ms=100, versions=(1,))
    server = LinkConnection(Role.SERVER, heartbeat_ms=300, max_frame_size=MIN_FRAME_SIZE * 2)
    assert client.state is State.HANDSHAKE
    assert server.state is State.HANDSHAKE
    assert client.data_to_send() == b""
    client.hello("alice", "secret", "gateway-stomp")
    assert pump(client, server) == [ev.HelloReceived(1, "alice", "secret", "gateway-stomp", 300)]
    assert server.state is State.AUTHENTICATING
    assert server.version == 1
    server.accept("node-1", "conn-42", 64, 0.0)
    assert server.state is State.OPEN
    assert pump(server, client) == [ev.Welcomed(1, "node-1", "conn-42", 300, 64)]
    assert client.state is State.OPEN
    assert client.version == 1
    assert client.heartbeat_ms == 300
    assert server.heartbeat_ms == 300
    assert client.publish_credit == 64
    assert server.publish_credit == 64


def test_hello_without_credentials() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello(None, None, "anonymous")
    [hello] = pump(client, server)
    assert hello.user is None
    assert hello.password is None
    assert hello.client_name == "anonymous"


def test_hello_names_the_gateways_client_when_given() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello("alice", "secret", "stomp 10.1.2.3:5000", "10.1.2.3")
    assert decoded_ops(client.data_to_send()) == [
        [
            Op.HELLO,
            [1, 2, 3, 4],
            "alice",
            "secret",
            "stomp 10.1.2.3:5000",
            client.heartbeat_ms,
            client.max_frame_size,
            "10.1.2.3",
        ]
    ]
    client = LinkConnection(Role.CLIENT)
    client.hello("alice", "secret", "stomp 10.1.2.3:5000", "10.1.2.3")
    [hello] = pump(client, server)
    assert hello.client_host == "10.1.2.3"


def test_hello_names_the_user_a_gateway_acts_for() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello("gw", "secret", "mqtt d1 10.1.2.3:5000", "10.1.2.3", acting_for="device-1")
    [hello] = pump(client, server)
    assert (hello.user, hello.client_host, hello.acting_for) == ("gw", "10.1.2.3", "device-1")


@pytest.mark.parametrize("acting_for", [None, 7, "", "x" * 257, ["device-1"]])
def test_a_bad_acting_for_is_malformed(acting_for: Any) -> None:
    server = LinkConnection(Role.SERVER)
    expect_remote_error(
        server, frame([[Op.HELLO, [1], "u", "p", "c", 0, MIN_FRAME_SIZE, "10.0.0.1", acting_for]]), ErrorCode.MALFORMED
    )


@pytest.mark.parametrize("client_host", [None, 7, "", "x" * 257, ["10.0.0.1"]])
def test_a_bad_client_host_is_malformed(client_host: Any) -> None:
    server = LinkConnection(Role.SERVER)
    expect_remote_error(
        server, frame([[Op.HELLO, [1], "u", "p", "c", 0, MIN_FRAME_SIZE, client_host]]), ErrorCode.MALFORMED
    )


@pytest.mark.parametrize(
    ("client_hb", "server_hb", "agreed"),
    # The server decides: its 0 disables heartbeats, a client's 0 cannot (a negative interval is malformed).
    [(100, 300, 300), (300, 100, 300), (250, 250, 250), (0, 300, 300), (300, 0, 0), (0, 0, 0)],
)
def test_agreed_heartbeat(client_hb: int, server_hb: int, agreed: int) -> None:
    client, server = open_pair(client_kw={"heartbeat_ms": client_hb}, server_kw={"heartbeat_ms": server_hb})
    assert client.heartbeat_ms == agreed
    assert server.heartbeat_ms == agreed


def test_hello_received_reports_agreed_heartbeat() -> None:
    server = LinkConnection(Role.SERVER, heartbeat_ms=0)
    [hello] = server.receive_data(frame([[Op.HELLO, [1], "u", "p", "c", 500, MIN_FRAME_SIZE]]), 0.0)
    assert hello.heartbeat_ms == 0


def test_hello_picks_the_common_version() -> None:
    server = LinkConnection(Role.SERVER)
    [hello] = server.receive_data(frame([[Op.HELLO, [7, 1, "x", 5], None, None, "c", 0, MIN_FRAME_SIZE]]), 0)
    assert hello.version == 1


def test_refuse_reaches_the_client_as_closed() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello("mallory", "guess", "c")
    pump(client, server)
    server.refuse(ErrorCode.UNAUTHENTICATED, "bad credentials")
    assert server.state is State.CLOSED
    data = server.data_to_send()
    assert data == frame([[Op.CLOSE, "unauthenticated", "bad credentials"]])
    assert client.receive_data(data, 0.0) == [ev.Closed("unauthenticated", "bad credentials")]
    assert client.state is State.CLOSED
    assert client.next_deadline() is None


def test_client_close_during_handshake_reaches_the_server() -> None:
    server = LinkConnection(Role.SERVER)
    assert server.receive_data(frame([[Op.CLOSE, "shutdown", "bye"]]), 0.0) == [ev.Closed("shutdown", "bye")]
    assert server.state is State.CLOSED


@pytest.mark.parametrize("versions", [[5], [], [0, 99], ["1"], [1.0], [True]])
def test_version_mismatch(versions: list[Any]) -> None:
    server = LinkConnection(Role.SERVER)
    data = frame([[Op.HELLO, versions, "u", "p", "c", 100, MIN_FRAME_SIZE]])
    expect_remote_error(server, data, ErrorCode.VERSION)


def test_hello_with_too_small_max_frame_is_invalid() -> None:
    server = LinkConnection(Role.SERVER)
    data = frame([[Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE - 1]])
    expect_remote_error(server, data, ErrorCode.INVALID)


@pytest.mark.parametrize(
    "ops",
    [
        [[Op.HEARTBEAT]],
        [[Op.CREATE_ADDRESS, 1, "a", [0]]],
        [[Op.PUBLISH, 1, 0, new_message("a", b"")]],
        [[Op.WELCOME, 1, "n", "c", 0, MIN_FRAME_SIZE, 1]],
        ["hello"],
        [[]],
    ],
)
def test_anything_before_hello_is_unexpected(ops: list[Any]) -> None:
    server = LinkConnection(Role.SERVER)
    expect_remote_error(server, frame(ops), ErrorCode.UNEXPECTED)


def test_ops_bundled_with_hello_are_refused() -> None:
    server = LinkConnection(Role.SERVER)
    hello = [Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE]
    expect_remote_error(server, frame([hello, [Op.HEARTBEAT]]), ErrorCode.UNEXPECTED)


def test_a_second_hello_frame_is_unexpected() -> None:
    server = LinkConnection(Role.SERVER)
    hello = frame([[Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE]])
    server.receive_data(hello, 0.0)
    expect_remote_error(server, hello, ErrorCode.UNEXPECTED)


def test_data_before_the_answer_to_hello_is_unexpected() -> None:
    server = LinkConnection(Role.SERVER)
    server.receive_data(frame([[Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE]]), 0.0)
    expect_remote_error(server, frame([[Op.DELETE_QUEUE, 1, "q"]]), ErrorCode.UNEXPECTED)


def test_hello_with_wrong_field_types_is_malformed() -> None:
    server = LinkConnection(Role.SERVER)
    expect_remote_error(server, frame([[Op.HELLO, [1], 5, "p", "c", 100, MIN_FRAME_SIZE]]), ErrorCode.MALFORMED)
    server = LinkConnection(Role.SERVER)
    expect_remote_error(server, frame([[Op.HELLO, [1], "u", "p", "c", 100]]), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "ops",
    [[[Op.OK, 1, None]], [[Op.HELLO, [1], None, None, "c", 0, MIN_FRAME_SIZE]], [[Op.PUBLISH_CREDIT, 5]]],
)
def test_client_expects_welcome_first(ops: list[Any]) -> None:
    client = LinkConnection(Role.CLIENT)
    client.hello("u", "p", "c")
    client.data_to_send()
    expect_remote_error(client, frame(ops), ErrorCode.UNEXPECTED)


@pytest.mark.parametrize(
    "welcome",
    [
        [Op.WELCOME, 2, "n", "c", 100, MIN_FRAME_SIZE, 10],  # version not offered
        [Op.WELCOME, 1, "n", "c", 100, MIN_FRAME_SIZE - 1, 10],
    ],
)
def test_invalid_welcome(welcome: list[Any]) -> None:
    client = LinkConnection(Role.CLIENT)
    client.hello("u", "p", "c")
    client.data_to_send()
    expect_remote_error(client, frame([welcome]), ErrorCode.INVALID)


@pytest.mark.parametrize(
    "welcome",
    [[Op.WELCOME, 1, "n", "c", -1, MIN_FRAME_SIZE, 10], [Op.WELCOME, 1, "n", "c", 100, MIN_FRAME_SIZE, -1]],
)
def test_a_welcome_with_a_negative_integer_is_malformed(welcome: list[Any]) -> None:
    client = LinkConnection(Role.CLIENT)
    client.hello("u", "p", "c")
    client.data_to_send()
    expect_remote_error(client, frame([welcome]), ErrorCode.MALFORMED)


def test_welcome_with_wrong_field_type_is_malformed() -> None:
    client = LinkConnection(Role.CLIENT)
    client.hello("u", "p", "c")
    client.data_to_send()
    expect_remote_error(client, frame([[Op.WELCOME, 1, 7, "c", 100, MIN_FRAME_SIZE, 10]]), ErrorCode.MALFORMED)


def test_welcome_followed_by_other_ops_in_the_same_flush_is_understood() -> None:
    # Nothing stops a server from queueing more after accept() before it flushes; its own client codec
    # must understand the resulting frame.
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello("u", "p", "c")
    pump(client, server)
    server.accept("node", "conn", 10, 0.0)
    server.grant_publish_credit(5)
    assert pump(server, client) == [ev.Welcomed(4, "node", "conn", 250, 10), ev.PublishCreditGranted(5)]
    assert client.publish_credit == 15


def test_local_handshake_misuse() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    with pytest.raises(LocalProtocolError):
        server.hello("u", "p", "c")
    with pytest.raises(LocalProtocolError):
        server.accept("n", "c", 1, 0.0)  # before any HELLO
    with pytest.raises(LocalProtocolError):
        server.refuse("forbidden", "no")
    with pytest.raises(LocalProtocolError):
        client.accept("n", "c", 1, 0.0)
    with pytest.raises(LocalProtocolError):
        client.create_queue({"name": "q"})  # not open yet
    client.hello("u", "p", "c")
    with pytest.raises(LocalProtocolError):
        client.hello("u", "p", "c")
    pump(client, server)
    server.accept("n", "c", 1, 0.0)
    with pytest.raises(LocalProtocolError):
        server.accept("n", "c", 1, 0.0)
    with pytest.raises(LocalProtocolError):
        server.refuse("forbidden", "no")


def test_too_small_max_frame_size_is_refused_locally() -> None:
    with pytest.raises(ValueError, match="max_frame_size"):
        LinkConnection(Role.CLIENT, max_frame_size=MIN_FRAME_SIZE - 1)


# ---------------------------------------------------------------------------------------------- requests
def test_every_request_reaches_the_server_with_its_fields() -> None:
    client, server = open_pair()
    ids = [
        client.create_address("orders", [RoutingType.ANYCAST, RoutingType.MULTICAST]),
        client.delete_address("old"),
        client.create_queue({"name": "q1", "address": "orders", "routing_type": 0, "durable": True}),
        client.delete_queue("q0"),
    ]
    sub_req, cid = client.subscribe("q1", 10, {"selector": "color = 'red'", "browse": False})
    sub2_req, cid2 = client.subscribe("q2", 0)
    unsub_req = client.unsubscribe(cid2)
    tx = client.new_tx_id()
    tx2 = client.new_tx_id()
    begin, commit, rollback = client.tx_begin(tx), client.tx_commit(tx), client.tx_rollback(tx2)
    assert ids == [1, 2, 3, 4]
    assert (sub_req, sub2_req, unsub_req, begin, commit, rollback) == (5, 6, 7, 8, 9, 10)
    assert (cid, cid2) == (1, 2)
    assert (tx, tx2) == (1, 2)
    assert pump(client, server) == [
        ev.CreateAddress(1, "orders", (0, 1)),
        ev.DeleteAddress(2, "old"),
        ev.CreateQueue(3, {"name": "q1", "address": "orders", "routing_type": 0, "durable": True}),
        ev.DeleteQueue(4, "q0"),
        ev.Subscribe(5, 1, "q1", 10, {"selector": "color = 'red'", "browse": False}),
        ev.Subscribe(6, 2, "q2", 0, {}),
        ev.Unsubscribe(7, 2),
        ev.TxBegin(8, 1),
        ev.TxCommit(9, 1),
        ev.TxRollback(10, 2),
    ]


def test_every_server_answer_reaches_the_client_with_its_fields() -> None:
    client, server = open_pair(client_kw={"versions": (1,)})
    _, cid = client.subscribe("q", 3)
    seq = client.publish(message())
    pump(client, server)
    server.reply(1, {"consumers": 0, "list": [1, 2]})
    server.reply(2)
    server.error(3, ErrorCode.NOT_FOUND, "no queue q")
    server.confirm(seq)
    server.reject(seq, ErrorCode.FORBIDDEN, "not allowed")
    server.grant_publish_credit(7)
    server.grant_publish_credit(0)  # ignored
    server.browse_done(cid)
    server.consumer_closed(cid, ErrorCode.SHUTDOWN, "queue deleted")
    assert pump(server, client) == [
        ev.Reply(1, {"consumers": 0, "list": [1, 2]}),
        ev.Reply(2, None),
        ev.RequestFailed(3, "not-found", "no queue q"),
        ev.Confirms([(1, 1)]),
        ev.Rejected(1, "forbidden", "not allowed"),
        ev.PublishCreditGranted(7),
        ev.BrowseDone(cid),
        ev.ConsumerClosed(cid, "shutdown", "queue deleted"),
    ]
    assert client.publish_credit == 99 + 7
    assert cid not in client.consumer_credit


def test_acks_nacks_and_flow_reach_the_server() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 1)
    pump(client, server)
    client.ack(cid, [10, 11], tx_id=4)
    client.flow(cid, 5)
    client.nack(cid, [12])
    client.nack(cid, [13, 14], NackMode.RELEASE)
    client.flow(cid, 0)  # nothing to grant: not sent
    client.flow(99, 3)  # unknown consumer: not sent
    assert pump(client, server) == [
        ev.Acks([[Op.ACK, cid, 4, [10, 11]]]),
        ev.Flow(cid, 5),
        ev.Nacks([[Op.NACK, cid, [12], NackMode.REDELIVER], [Op.NACK, cid, [13, 14], NackMode.RELEASE]]),
    ]
    assert client.consumer_credit[cid] == 6


def test_server_only_methods_refuse_a_client_and_vice_versa() -> None:
    client, server = open_pair()
    for call in (
        lambda: client.reply(1),
        lambda: client.error(1, "x", "y"),
        lambda: client.reject(1, "x", "y"),
        lambda: client.consumer_closed(1, "x", "y"),
        lambda: client.browse_done(1),
        lambda: server.create_address("a", [0]),
        lambda: server.delete_address("a"),
        lambda: server.create_queue({}),
        lambda: server.delete_queue("q"),
        lambda: server.subscribe("q", 1),
        lambda: server.unsubscribe(1),
        lambda: server.tx_begin(1),
        lambda: server.tx_commit(1),
        lambda: server.tx_rollback(1),
        lambda: server.publish(message()),
        lambda: server.ack(1, [1]),
        lambda: server.nack(1, [1]),
        lambda: server.flow(1, 1),
    ):
        with pytest.raises(LocalProtocolError):
            call()
    assert client.data_to_send() == b""
    assert server.data_to_send() == b""


def _client_with_consumer() -> LinkConnection:
    client, _ = open_pair()
    client.subscribe("q", 5)
    return client


def _authenticating_server() -> LinkConnection:
    server = LinkConnection(Role.SERVER)
    server.receive_data(frame([[Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE]]), 0.0)
    return server


@pytest.mark.parametrize(
    "make",
    [_client_with_consumer, _authenticating_server],
    ids=["client", "server-before-accept"],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.confirm(1),
        lambda c: c.deliver(1, 0, new_message("a", b"")),
        lambda c: c.grant_publish_credit(3),
    ],
    ids=["confirm", "deliver", "grant_publish_credit"],
)
def test_server_message_methods_refuse_misuse(
    make: Callable[[], LinkConnection], call: Callable[[LinkConnection], None]
) -> None:
    # A client has nothing to confirm, deliver or grant, and a server that has not accepted yet must not
    # send anything but WELCOME or CLOSE: the peer codec would close the link with "unexpected".
    conn = make()
    conn.data_to_send()
    with pytest.raises(LocalProtocolError):
        call(conn)
    assert conn.data_to_send() == b""


def test_requests_after_close_are_refused() -> None:
    client, _ = open_pair()
    client.close(ErrorCode.SHUTDOWN, "bye")
    with pytest.raises(LocalProtocolError):
        client.publish(message())  # still has credit, but the link is closed
    with pytest.raises(LocalProtocolError):
        client.delete_queue("q")


def test_answers_to_a_batch_that_ended_in_close_are_dropped() -> None:
    # The broker handles every event before the peer's CLOSE (routing its messages); its answers to them
    # have no one to go to and must not raise.
    client, server = open_pair()
    client.publish(message())
    client.create_queue({"name": "q"})
    client.close(ErrorCode.SHUTDOWN, "bye")
    events = pump(client, server)
    assert isinstance(events[-1], ev.Closed)
    server.confirm(1)
    server.reject(2, ErrorCode.INVALID, "no")
    server.reply(1)
    server.error(1, ErrorCode.INVALID, "no")
    server.grant_publish_credit(1)
    server.deliver(1, 1, message())
    server.consumer_closed(1, ErrorCode.SHUTDOWN, "bye")
    server.browse_done(1)
    assert server.data_to_send() == b""


# ---------------------------------------------------------------------------------------------- publish
def test_publish_sequence_numbers_and_fields() -> None:
    client, server = open_pair(credit=10)
    m1, m2, m3 = message(body=b"1"), message(body=b"2", durable=True), message(body=b"3", priority=9)
    assert [client.publish(m1), client.publish(m2, tx_id=7), client.publish(m3)] == [1, 2, 3]
    assert client.publish_credit == 7
    assert pump(client, server) == [
        ev.Publishes([[Op.PUBLISH, 1, 0, m1], [Op.PUBLISH, 2, 7, m2], [Op.PUBLISH, 3, 0, m3]])
    ]
    assert server.publish_credit == 7
    assert client.publish(m1) == 4
    assert pump(client, server) == [ev.Publishes([[Op.PUBLISH, 4, 0, m1]])]


def test_confirm_of_consecutive_sequences_merges_into_one_range() -> None:
    client, server = open_pair()
    for _ in range(3):
        client.publish(message())
    pump(client, server)
    for seq in (1, 2, 3):
        server.confirm(seq)
    data = server.data_to_send()
    assert decoded_ops(data) == [[Op.CONFIRM, 1, 3]]
    assert client.receive_data(data, 1.0) == [ev.Confirms([(1, 3)])]


def test_confirm_with_a_gap_gives_two_ranges() -> None:
    client, server = open_pair()
    for _ in range(4):
        client.publish(message())
    pump(client, server)
    for seq in (1, 2, 4):
        server.confirm(seq)
    data = server.data_to_send()
    assert decoded_ops(data) == [[Op.CONFIRM, 1, 2], [Op.CONFIRM, 4, 4]]
    events = client.receive_data(data, 1.0)
    assert all(isinstance(e, ev.Confirms) for e in events)
    assert [r for e in events for r in e.ranges] == [(1, 2), (4, 4)]


def test_reject_between_confirms() -> None:
    client, server = open_pair()
    for _ in range(4):
        client.publish(message())
    pump(client, server)
    server.confirm(1)
    server.reject(2, ErrorCode.RESOURCE_LIMIT, "address full")
    server.confirm(3)
    server.confirm(4)
    data = server.data_to_send()
    assert decoded_ops(data) == [
        [Op.CONFIRM, 1, 1],
        [Op.REJECT, 2, "resource-limit", "address full"],
        [Op.CONFIRM, 3, 4],
    ]
    assert client.receive_data(data, 1.0) == [
        ev.Confirms([(1, 1)]),
        ev.Rejected(2, "resource-limit", "address full"),
        ev.Confirms([(3, 4)]),
    ]


def test_confirm_ranges_do_not_span_flushes() -> None:
    client, server = open_pair()
    client.publish(message())
    client.publish(message())
    pump(client, server)
    server.confirm(1)
    assert pump(server, client) == [ev.Confirms([(1, 1)])]
    server.confirm(2)
    assert decoded_ops(server.data_to_send()) == [[Op.CONFIRM, 2, 2]]


@pytest.mark.parametrize(("first", "last"), [(0, 1), (2, 1), (1, 3), (3, 3), (-1, 1)])
def test_confirm_of_unsent_range_is_malformed(first: int, last: int) -> None:
    client, server = open_pair()
    client.publish(message())
    client.publish(message())
    pump(client, server)
    expect_remote_error(client, frame([[Op.CONFIRM, first, last]]), ErrorCode.MALFORMED)


def test_client_publish_needs_credit() -> None:
    client, server = open_pair(credit=2)
    client.publish(message())
    client.publish(message())
    with pytest.raises(LocalProtocolError) as info:
        client.publish(message())
    assert info.value.code == ErrorCode.CREDIT
    assert client.publish_credit == 0
    assert len(decoded_ops(client.data_to_send())) == 2
    server.grant_publish_credit(1)
    assert pump(server, client) == [ev.PublishCreditGranted(1)]
    assert client.publish(message()) == 3
    with pytest.raises(LocalProtocolError):
        client.publish(message())


def test_client_without_initial_credit() -> None:
    client, _ = open_pair(credit=0)
    with pytest.raises(LocalProtocolError) as info:
        client.publish(message())
    assert info.value.code == ErrorCode.CREDIT


def test_server_enforces_its_publish_window() -> None:
    _, server = open_pair(credit=1)
    data = frame([[Op.PUBLISH, 1, 0, message()], [Op.PUBLISH, 2, 0, message()]])
    expect_remote_error(server, data, ErrorCode.CREDIT)


def test_server_publish_window_grows_with_grants() -> None:
    _, server = open_pair(credit=1)
    server.grant_publish_credit(1)
    events = server.receive_data(frame([[Op.PUBLISH, 1, 0, message()], [Op.PUBLISH, 2, 0, message()]]), 1)
    assert len(events[0].ops) == 2
    expect_remote_error(server, frame([[Op.PUBLISH, 3, 0, message()]]), ErrorCode.CREDIT)


@pytest.mark.parametrize("seqs", [[2], [1, 3], [1, 1], [0], [1, 2, 2]])
def test_out_of_order_publish_sequence_is_malformed(seqs: list[int]) -> None:
    _, server = open_pair()
    data = frame([[Op.PUBLISH, seq, 0, message()] for seq in seqs])
    expect_remote_error(server, data, ErrorCode.MALFORMED)


@pytest.mark.parametrize("op", [[Op.PUBLISH_CREDIT, -1, 0], [Op.PUBLISH_CREDIT, 1, -1], [Op.PUBLISH_CREDIT, 1]])
def test_negative_publish_credit_is_malformed(op: list[int]) -> None:
    client, _ = open_pair()
    expect_remote_error(client, frame([op]), ErrorCode.MALFORMED)


# ---------------------------------------------------------------------------------------------- byte credit (v2)
def open_byte_pair(credit: int = 100, publish_bytes: int = 1000) -> tuple[LinkConnection, LinkConnection]:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello(None, None, "c")
    pump(client, server)
    server.accept("node-1", "conn-1", credit, 0.0, publish_bytes=publish_bytes)
    pump(server, client)
    assert (client.version, client.publish_bytes, server.publish_bytes) == (4, publish_bytes, publish_bytes)
    return client, server


def test_the_publish_window_is_counted_in_bytes_and_one_message_may_pass_it() -> None:
    client, server = open_byte_pair(publish_bytes=1000)
    client.publish(message(body=b"x" * 600))
    assert client.can_publish
    client.publish(message(body=b"x" * 600))  # starts with 400 left: allowed, and the credit goes below 0
    assert (client.publish_credit, client.publish_bytes, client.can_publish) == (98, -200, False)
    with pytest.raises(LocalProtocolError) as info:
        client.publish(message(body=b""))
    assert info.value.code == ErrorCode.CREDIT
    [publishes] = pump(client, server)
    assert len(publishes.ops) == 2
    assert server.publish_bytes == -200
    server.grant_publish_credit(2)  # tops the bytes up to the window again
    assert decoded_ops(server.data_to_send()) == [[Op.PUBLISH_CREDIT, 2, 1200]]
    assert (server.publish_credit, server.publish_bytes) == (100, 1000)
    client.receive_data(frame([[Op.PUBLISH_CREDIT, 2, 1200]]), 1.0)
    assert (client.publish_credit, client.publish_bytes, client.can_publish) == (100, 1000, True)


def test_the_server_enforces_the_byte_window() -> None:
    _, server = open_byte_pair(publish_bytes=1000)
    big = message(body=b"x" * 1000)
    data = frame([[Op.PUBLISH, 1, 0, big], [Op.PUBLISH, 2, 0, message(body=b"")]])
    expect_remote_error(server, data, ErrorCode.CREDIT)


def test_a_grant_of_bytes_alone_goes_out_and_a_full_window_gets_none() -> None:
    client, server = open_byte_pair(publish_bytes=1000)
    server.grant_publish_credit(0)
    assert server.data_to_send() == b""  # nothing used: nothing to give
    client.publish(message(body=b"x" * 10))
    pump(client, server)
    server.grant_publish_credit(0)  # the message's credit withheld (a cluster link's), its bytes not
    assert pump(server, client) == [ev.PublishCreditGranted(0, 10)]


def test_a_version_1_link_counts_no_bytes() -> None:
    client, server = open_pair(client_kw={"versions": (1,)}, credit=3)
    for _ in range(3):
        client.publish(message(body=b"x" * 100_000))
    pump(client, server)
    server.grant_publish_credit(3)
    assert decoded_ops(server.data_to_send()) == [[Op.PUBLISH_CREDIT, 3]]
    assert client.can_publish is False
    _, cid = client.subscribe("q", 2, credit_bytes=10)  # no byte credit in version 1: not asked for
    assert decoded_ops(client.data_to_send())[0][-1] == {}
    client.flow(cid, 1, 5)
    assert decoded_ops(client.data_to_send()) == [[Op.FLOW, cid, 1]]


def test_a_consumer_window_in_bytes_is_tracked_and_enforced_on_the_client() -> None:
    client, server = open_byte_pair()
    _, cid = client.subscribe("q", 10, {"auto_ack": True}, credit_bytes=100)
    [subscribe] = pump(client, server)
    assert subscribe.options == {"auto_ack": True, "credit_bytes": 100}
    m = message(body=b"x" * 60)
    server.deliver(cid, 1, m)
    server.deliver(cid, 1, m)  # starts with 40 left: allowed
    pump(server, client)
    assert (client.consumer_credit[cid], client.consumer_bytes[cid]) == (8, -20)
    client.flow(cid, 2, 120)
    assert pump(client, server) == [ev.Flow(cid, 2, 120)]
    assert client.consumer_bytes[cid] == 100
    server.deliver(cid, 1, message(body=b"x" * 100))
    server.deliver(cid, 1, message(body=b""))  # no bytes left: a violation
    expect_remote_error(client, server.data_to_send(), ErrorCode.CREDIT)


def test_flow_of_a_consumer_without_a_byte_window_carries_no_bytes() -> None:
    client, server = open_byte_pair()
    _, cid = client.subscribe("q", 1)
    pump(client, server)
    client.flow(cid, 1, 500)
    assert decoded_ops(client.data_to_send()) == [[Op.FLOW, cid, 1, 0]]
    expect_remote_error(server, frame([[Op.FLOW, cid, 1, -1]]), ErrorCode.MALFORMED)


# ---------------------------------------------------------------------------------------------- deliveries
def test_consumer_credit_is_tracked_on_the_client() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 2)
    assert client.consumer_credit == {cid: 2}
    pump(client, server)
    m = message()
    server.deliver(cid, 0, m)
    server.deliver(cid, 1, m)
    assert pump(server, client) == [ev.Deliveries([[Op.DELIVER, cid, 0, m], [Op.DELIVER, cid, 1, m]])]
    assert client.consumer_credit[cid] == 0
    client.flow(cid, 3)
    assert client.consumer_credit[cid] == 3
    assert pump(client, server) == [ev.Flow(cid, 3)]
    server.deliver(cid, 0, m)
    pump(server, client)
    assert client.consumer_credit[cid] == 2


def test_delivery_beyond_credit_is_a_credit_error() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 1)
    pump(client, server)
    server.deliver(cid, 0, message())
    server.deliver(cid, 0, message())
    expect_remote_error(client, server.data_to_send(), ErrorCode.CREDIT)


def test_delivery_to_a_consumer_subscribed_without_credit_is_a_credit_error() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 0)
    pump(client, server)
    expect_remote_error(client, frame([[Op.DELIVER, cid, 0, message()]]), ErrorCode.CREDIT)


def test_delivery_to_unknown_consumer_is_unexpected() -> None:
    client, _ = open_pair()
    client.subscribe("q", 5)
    expect_remote_error(client, frame([[Op.DELIVER, 99, 0, message()]]), ErrorCode.UNEXPECTED)


def test_deliveries_to_an_unsubscribed_consumer_are_accepted() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 1)
    client.unsubscribe(cid)
    assert cid not in client.consumer_credit
    pump(client, server)
    m = message()
    data = frame([[Op.DELIVER, cid, 0, m]] * 3)  # in flight when the unsubscribe left: no window applies
    assert client.receive_data(data, 1.0) == [ev.Deliveries([[Op.DELIVER, cid, 0, m]] * 3)]
    client.flow(cid, 5)  # no longer a consumer: nothing sent
    assert client.data_to_send() == b""


def test_deliveries_after_consumer_closed_are_accepted() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 1)
    pump(client, server)
    server.consumer_closed(cid, ErrorCode.NOT_FOUND, "queue deleted")
    server.deliver(cid, 0, message())
    server.deliver(cid, 0, message())
    events = pump(server, client)
    assert events[0] == ev.ConsumerClosed(cid, "not-found", "queue deleted")
    assert len(events[1].ops) == 2


@pytest.mark.parametrize(
    "ops",
    [
        [[Op.FLOW, 1, -1]],
        [[Op.SUBSCRIBE, 1, 2, "q", -3, {}]],
        [[Op.CREATE_ADDRESS, 1, "a", [0, "multicast"]]],
        [[Op.CREATE_ADDRESS, 1, "a", [0, 1.0]]],
    ],
)
def test_server_side_field_validation(ops: list[Any]) -> None:
    _, server = open_pair()
    expect_remote_error(server, frame(ops), ErrorCode.MALFORMED)


# ---------------------------------------------------------------------------------------------- wills
def test_set_will_bytes_and_events() -> None:
    client, server = open_pair()
    m = message("status.gone", b"bye")
    will = {"key": "session-1", "message": m, "delay_ms": 5000, "publish_pending": True}
    first = client.set_will(will)
    second = client.set_will(None)
    assert client.data_to_send() == frame([[19, first, will], [19, second, None]])
    client.set_will(will)
    client.set_will(None)
    assert pump(client, server) == [
        ev.SetWill(3, "session-1", m, 5000, publish_pending=True),
        ev.SetWill(4, None, None, 0, publish_pending=False),
    ]


def test_set_will_fields_default_and_unknown_ones_are_ignored() -> None:
    _, server = open_pair()
    assert server.receive_data(frame([[Op.SET_WILL, 7, {"key": "k", "future": 1}]]), 0.0) == [
        ev.SetWill(7, "k", None, 0, publish_pending=False)
    ]
    assert server.receive_data(frame([[Op.SET_WILL, 8, {"key": "k", "own": True}]]), 0.0) == [
        ev.SetWill(8, "k", None, 0, publish_pending=False, own=True)
    ]
    retain = {"address": "store", "key": {"topic": "a/b"}}
    assert server.receive_data(frame([[Op.SET_WILL, 9, {"key": "k", "retain": retain}]]), 0.0) == [
        ev.SetWill(9, "k", None, 0, publish_pending=False, retain=("store", {"topic": "a/b"}))
    ]
    assert server.receive_data(frame([[Op.SET_WILL, 10, {"key": "k", "everywhere": True}]]), 0.0) == [
        ev.SetWill(10, "k", None, 0, publish_pending=False, everywhere=True)
    ]


@pytest.mark.parametrize(
    "will",
    [
        ["k", None],
        "k",
        {"message": None},
        {"key": 5},
        {"key": b"k"},
        {"key": "k", "message": "text"},
        {"key": "k", "message": {"body": b""}},
        {"key": "k", "delay_ms": 1.5},
        {"key": "k", "delay_ms": True},
        {"key": "k", "publish_pending": 1},
        {"key": "k", "own": 1},
        {"key": "k", "everywhere": "yes"},
        {"key": "k", "retain": "store"},
        {"key": "k", "retain": {"address": 1, "key": {}}},
        {"key": "k", "retain": {"address": "store"}},
        {"key": "k", "retain": {"address": "store", "key": {1: "x"}}},
    ],
)
def test_set_will_with_a_wrong_field_type_is_malformed(will: Any) -> None:
    _, server = open_pair()
    expect_remote_error(server, frame([[Op.SET_WILL, 1, will]]), ErrorCode.MALFORMED)


# ---------------------------------------------------------------------------------------------- acks / nacks
@pytest.mark.parametrize(
    "op",
    [
        [Op.ACK, 1, 0, [1, "2"]],
        [Op.ACK, 1, 0, [1, 2.0]],
        [Op.ACK, 1, 0, [True]],
        [Op.ACK, 1, 0, [[1]]],
        [Op.ACK, 1, 0, 5],
        [Op.ACK, 1, "tx", [1]],
        [Op.ACK, "c", 0, [1]],
        [Op.ACK, 1, 0],
        [Op.ACK, 1, 0, [1], 9],
        [Op.NACK, 1, [1], 3],
        [Op.NACK, 1, [1], -1],
        [Op.NACK, 1, [None], 0],
        [Op.NACK, 1, [1], "release"],
        [Op.NACK, 1, 1, 0],
        [Op.NACK, 1, [1]],
    ],
)
def test_ack_and_nack_field_validation(op: list[Any]) -> None:
    _, server = open_pair()
    expect_remote_error(server, frame([op]), ErrorCode.MALFORMED)


def test_valid_acks_and_nacks() -> None:
    _, server = open_pair()
    ops = [
        [Op.ACK, 1, 0, []],
        [Op.ACK, 2, 5, [1, 2, 3]],
        [Op.NACK, 1, [4], 0],
        [Op.NACK, 1, [], 1],
        [Op.NACK, 1, [5, 6], 2],
    ]
    assert server.receive_data(frame(ops), 1.0) == [ev.Acks(ops[:2]), ev.Nacks(ops[2:])]


# ---------------------------------------------------------------------------------------------- batching
def test_server_side_batching_preserves_order() -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", 1)
    pump(client, server)
    m = message()
    client.publish(m)
    client.publish(m)
    client.ack(cid, [1])
    client.ack(cid, [2])
    req = client.create_queue({"name": "x"})
    client.publish(m)
    client.nack(cid, [3])
    client.nack(cid, [4])
    client.flow(cid, 2)
    client.nack(cid, [5])
    client.ack(cid, [6])
    assert pump(client, server) == [
        ev.Publishes([[Op.PUBLISH, 1, 0, m], [Op.PUBLISH, 2, 0, m]]),
        ev.Acks([[Op.ACK, cid, 0, [1]], [Op.ACK, cid, 0, [2]]]),
        ev.CreateQueue(req, {"name": "x"}),
        ev.Publishes([[Op.PUBLISH, 3, 0, m]]),
        ev.Nacks([[Op.NACK, cid, [3], 0], [Op.NACK, cid, [4], 0]]),
        ev.Flow(cid, 2),
        ev.Nacks([[Op.NACK, cid, [5], 0]]),
        ev.Acks([[Op.ACK, cid, 0, [6]]]),
    ]


def test_client_side_batching_preserves_order() -> None:
    client, server = open_pair()
    _, c1 = client.subscribe("q1", 10)
    _, c2 = client.subscribe("q2", 10)
    client.publish(message())
    pump(client, server)
    m = message()
    server.deliver(c1, 0, m)
    server.deliver(c2, 0, m)
    server.confirm(1)
    server.deliver(c1, 1, m)
    server.reply(1, "ok")
    server.deliver(c2, 1, m)
    server.deliver(c1, 2, m)
    assert pump(server, client) == [
        ev.Deliveries([[Op.DELIVER, c1, 0, m], [Op.DELIVER, c2, 0, m]]),
        ev.Confirms([(1, 1)]),
        ev.Deliveries([[Op.DELIVER, c1, 1, m]]),
        ev.Reply(1, "ok"),
        ev.Deliveries([[Op.DELIVER, c2, 1, m], [Op.DELIVER, c1, 2, m]]),
    ]
    assert client.consumer_credit == {c1: 7, c2: 8}


def test_a_long_burst_travels_as_frames_of_bounded_size_one_event_each() -> None:
    client, server = open_pair(credit=5000)
    for i in range(5000):
        client.publish(message(body=str(i).encode()))
    events = pump(client, server)
    assert len(events) == -(-5000 // FRAME_OPERATIONS)
    assert all(isinstance(e, ev.Publishes) for e in events)
    assert [len(e.ops) for e in events[:-1]] == [FRAME_OPERATIONS] * (len(events) - 1)
    ops = [op for e in events for op in e.ops]
    assert [op[1] for op in ops] == list(range(1, 5001))
    assert ops[4999][3][M_BODY] == b"4999"


def test_heartbeat_operations_produce_no_event() -> None:
    client, server = open_pair()
    assert server.receive_data(frame([[Op.HEARTBEAT], [Op.HEARTBEAT]]), 1.0) == []
    assert client.receive_data(frame([[Op.HEARTBEAT]]), 1.0) == []


# ---------------------------------------------------------------------------------------------- closing
def test_close_from_the_server() -> None:
    client, server = open_pair()
    server.close(ErrorCode.SHUTDOWN, "node stopping")
    server.close(ErrorCode.INTERNAL, "second close is ignored")
    assert server.state is State.CLOSED
    data = server.data_to_send()
    assert decoded_ops(data) == [[Op.CLOSE, "shutdown", "node stopping"]]
    assert client.receive_data(data, 1.0) == [ev.Closed("shutdown", "node stopping")]
    assert client.state is State.CLOSED
    assert client.next_deadline() is None
    assert client.receive_data(frame([[Op.HEARTBEAT]]), 2.0) == []


def test_close_from_the_client() -> None:
    client, server = open_pair()
    client.close(ErrorCode.SHUTDOWN, "gateway stopping")
    assert pump(client, server) == [ev.Closed("shutdown", "gateway stopping")]
    assert server.state is State.CLOSED


def test_operations_after_a_close_in_the_same_frame_are_ignored() -> None:
    _, server = open_pair(client_kw={"versions": (1,)})
    data = frame([[Op.FLOW, 1, 1], [Op.CLOSE, "shutdown", "bye"], [Op.FLOW, 1, 2], [Op.HEARTBEAT]])
    assert server.receive_data(data, 1.0) == [ev.Flow(1, 1), ev.Closed("shutdown", "bye")]


def test_events_before_a_close_are_kept() -> None:
    client, server = open_pair()
    client.publish(message())
    client.close(ErrorCode.SHUTDOWN, "bye")
    events = pump(client, server)
    assert isinstance(events[0], ev.Publishes)
    assert events[1] == ev.Closed("shutdown", "bye")


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_end_of_stream(role: Role) -> None:
    client, server = open_pair()
    conn = client if role is Role.CLIENT else server
    assert conn.receive_data(b"", 1.0) == [ev.Closed("eof", "the peer closed the connection")]
    assert conn.state is State.CLOSED
    assert conn.receive_data(b"", 2.0) == []


def test_end_of_stream_during_handshake() -> None:
    server = LinkConnection(Role.SERVER)
    [closed] = server.receive_data(b"", 0.0)
    assert closed.code == ErrorCode.EOF
    assert server.state is State.CLOSED


def test_close_with_wrong_fields_is_malformed() -> None:
    _, server = open_pair()
    expect_remote_error(server, frame([[Op.CLOSE, "shutdown"]]), ErrorCode.MALFORMED)


# ---------------------------------------------------------------------------------------------- chunking
def _server_stream() -> tuple[bytes, Callable[[], LinkConnection]]:
    """Bytes a client sends after the handshake, and a factory of servers ready to read them."""
    client, _ = open_pair(credit=50)
    _, cid = client.subscribe("q", 3)
    client.create_address("a", [1])
    for i in range(20):
        client.publish(message(body=bytes([i]) * i, properties={"i": i, "f": i / 2, "s": "é" * i}))
    client.ack(cid, [1, 2])
    client.nack(cid, [3], NackMode.REJECT)
    stream = client.data_to_send()
    client.flow(cid, 4)
    tx = client.new_tx_id()
    client.tx_begin(tx)
    for _ in range(5):
        client.publish(message(), tx_id=tx)
    client.tx_commit(tx)
    stream += client.data_to_send()
    client.handle_timeout(0.5)
    client.handle_timeout(0.75)  # nothing sent since the last check: a heartbeat frame
    heartbeat = client.data_to_send()
    assert heartbeat == frame([[Op.HEARTBEAT]])
    stream += heartbeat
    client.close(ErrorCode.SHUTDOWN, "done")
    stream += client.data_to_send()
    return stream, lambda: open_pair(credit=50)[1]


def _client_stream() -> tuple[bytes, Callable[[], LinkConnection]]:
    """Bytes a server sends after the handshake, and a factory of clients ready to read them."""

    def prepare() -> tuple[LinkConnection, LinkConnection]:
        client, server = open_pair(credit=50)
        client.subscribe("q", 30)
        for _ in range(10):
            client.publish(message())
        pump(client, server)
        return client, server

    _, server = prepare()
    server.reply(1, {"ok": True})
    for i in range(15):
        server.deliver(1, i % 3, message(body=b"d" * i))
    server.confirm(1)
    server.confirm(2)
    server.reject(3, ErrorCode.INVALID, "bad")
    stream = server.data_to_send()
    server.grant_publish_credit(10)
    for i in range(10):
        server.deliver(1, 0, message(body=bytes([i])))
    server.consumer_closed(1, ErrorCode.SHUTDOWN, "bye")
    server.deliver(1, 0, message())
    stream += server.data_to_send()
    server.close(ErrorCode.SHUTDOWN, "done")
    stream += server.data_to_send()
    return stream, lambda: prepare()[0]


STREAMS = {"to-server": _server_stream, "to-client": _client_stream}


def _feed(conn: LinkConnection, stream: bytes, sizes: list[int]) -> list[Any]:
    events: list[Any] = []
    pos = 0
    i = 0
    while pos < len(stream):
        size = sizes[i % len(sizes)] if sizes else len(stream)
        events += conn.receive_data(stream[pos : pos + size], 1.0)
        pos += size
        i += 1
    return events


@pytest.mark.parametrize("direction", sorted(STREAMS))
def test_chunking_whole_vs_byte_by_byte_vs_random(direction: str) -> None:
    stream, make = STREAMS[direction]()
    whole = make().receive_data(stream, 1.0)
    assert whole[-1] == ev.Closed("shutdown", "done")
    assert len(whole) > 5
    assert _feed(make(), stream, [1]) == whole
    rng = random.Random(1234)
    for _ in range(5):
        sizes = [rng.randint(1, 200) for _ in range(50)]
        assert _feed(make(), stream, sizes) == whole


@pytest.mark.parametrize("direction", sorted(STREAMS))
@given(sizes=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_chunking_property(direction: str, sizes: list[int]) -> None:
    stream, make = STREAMS[direction]()
    assert _feed(make(), stream, sizes) == make().receive_data(stream, 1.0)


def test_partial_frame_produces_nothing_until_complete() -> None:
    _, server = open_pair(client_kw={"versions": (1,)})
    data = frame([[Op.FLOW, 1, 1]])
    assert server.receive_data(data[:2], 1.0) == []
    assert server.receive_data(data[2:5], 1.0) == []
    assert server.receive_data(data[5:], 1.0) == [ev.Flow(1, 1)]
    assert server.receive_data(data + data[:3], 1.0) == [ev.Flow(1, 1)]
    assert server.receive_data(data[3:], 1.0) == [ev.Flow(1, 1)]


# ---------------------------------------------------------------------------------------------- heartbeats
HB = {"heartbeat_ms": 125}  # 1/8 s: deadlines are exact binary fractions
INTERVAL = 0.125


def test_deadlines_after_open() -> None:
    client = LinkConnection(Role.CLIENT, **HB)
    server = LinkConnection(Role.SERVER, **HB)
    assert client.next_deadline() is None
    assert server.next_deadline() is None
    client.hello("u", "p", "c")
    pump(client, server, 10.0)
    assert server.next_deadline() is None  # authenticating: no timer yet
    server.accept("n", "c", 1, 10.0)
    pump(server, client, 10.0)
    assert client.next_deadline() == pytest.approx(10.125)
    assert server.next_deadline() == pytest.approx(10.125)


def _send_something(conn: LinkConnection) -> None:
    if conn.role is Role.CLIENT:
        conn.delete_queue("q")
    else:
        conn.reply(1)


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_heartbeat_only_when_nothing_was_sent(role: Role) -> None:
    client, server = open_pair(client_kw=HB, server_kw=HB, now=0.0)
    conn, peer = (client, server) if role is Role.CLIENT else (server, client)
    _send_something(conn)
    pump(conn, peer, 0.05)
    # data went out since the last check: no heartbeat
    conn.handle_timeout(0.125)
    assert conn.data_to_send() == b""
    assert conn.next_deadline() == pytest.approx(0.25)
    # nothing went out since: one heartbeat
    conn.handle_timeout(0.25)
    data = conn.data_to_send()
    assert data == frame([[Op.HEARTBEAT]])
    assert data == b"\x00\x00\x00\x03\x91\x91\x04"
    assert peer.receive_data(data, 0.25) == []
    # the heartbeat itself counts as traffic for the next check
    conn.handle_timeout(0.375)
    assert conn.data_to_send() == b""
    conn.handle_timeout(0.5 - 1e-9)  # early: nothing to do, and the peer is not dead yet
    assert conn.data_to_send() == b""


def test_server_heartbeat_after_the_welcome_interval() -> None:
    _, server = open_pair(client_kw=HB, server_kw=HB, now=0.0)
    server.handle_timeout(0.125)  # the WELCOME left in this interval
    assert server.data_to_send() == b""
    server.handle_timeout(0.25)
    assert server.data_to_send() == frame([[Op.HEARTBEAT]])


def test_handle_timeout_before_the_deadline_does_nothing() -> None:
    client, _ = open_pair(client_kw=HB, server_kw=HB, now=0.0)
    client.handle_timeout(0.125)
    client.data_to_send()
    client.handle_timeout(0.2)
    assert client.data_to_send() == b""
    assert client.next_deadline() == pytest.approx(0.25)


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_silent_peer_times_out(role: Role) -> None:
    client, server = open_pair(client_kw=HB, server_kw=HB, now=0.0)
    conn = client if role is Role.CLIENT else server
    for now in (0.125, 0.25, 0.375):
        conn.handle_timeout(now)
        conn.data_to_send()
    timeout = INTERVAL * HEARTBEAT_TIMEOUT_FACTOR
    assert conn.next_deadline() == pytest.approx(timeout)
    conn.handle_timeout(timeout - 0.01)  # not yet
    assert conn.state is State.OPEN
    with pytest.raises(RemoteProtocolError) as info:
        conn.handle_timeout(timeout + 0.01)
    assert info.value.code == ErrorCode.HEARTBEAT_TIMEOUT
    assert conn.state is State.CLOSED
    assert decoded_ops(conn.data_to_send())[-1][:2] == [Op.CLOSE, "heartbeat-timeout"]
    assert conn.next_deadline() is None


def test_traffic_from_the_peer_keeps_the_link_alive() -> None:
    client, server = open_pair(client_kw=HB, server_kw=HB, now=0.0)
    for step in range(1, 30):
        now = step * INTERVAL
        client.handle_timeout(now)
        server.handle_timeout(now)
        pump(client, server, now)
        pump(server, client, now)
    assert client.state is State.OPEN
    assert server.state is State.OPEN
    # partial data counts as traffic as well
    server.receive_data(b"\x00", 3.7)
    for now in (3.75, 3.875, 4.0, 4.125):  # the shell's timer keeps its deadlines
        server.handle_timeout(now)
    assert server.state is State.OPEN
    with pytest.raises(RemoteProtocolError):
        server.handle_timeout(3.7 + INTERVAL * HEARTBEAT_TIMEOUT_FACTOR + 0.01)


def test_a_gateway_s_stall_is_not_the_peers_silence() -> None:
    """A timer call long after the one before means this side's loop was busy: the peer's heartbeats may wait
    unread in the socket. A link that forgives its own stalls (a gateway's) gives the peer its time again, and
    one that stays silent is found dead after it."""
    client, _server = open_pair(client_kw={**HB, "forgive_own_stalls": True}, server_kw=HB, now=0.0)
    client.handle_timeout(INTERVAL)
    stalled_until = 10 * INTERVAL * HEARTBEAT_TIMEOUT_FACTOR
    client.handle_timeout(stalled_until)
    assert client.state is State.OPEN
    now = stalled_until
    while client.state is State.OPEN:
        deadline = client.next_deadline()
        assert deadline is not None
        now = max(now, deadline)
        with contextlib.suppress(RemoteProtocolError):
            client.handle_timeout(now)
    assert stalled_until + INTERVAL < now <= stalled_until + INTERVAL * HEARTBEAT_TIMEOUT_FACTOR


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
def test_a_node_s_own_pause_shows_as_its_peers_silence(role: Role) -> None:
    """A node's links do not forgive their own stalls: a node paused past the timeout may have lost its role
    (its backup took over), and on waking its first timer call finds its peers silent."""
    client, server = open_pair(client_kw=HB, server_kw=HB, now=0.0)
    conn = client if role is Role.CLIENT else server
    conn.handle_timeout(INTERVAL)
    with pytest.raises(RemoteProtocolError) as info:
        conn.handle_timeout(10 * INTERVAL * HEARTBEAT_TIMEOUT_FACTOR)
    assert info.value.code == ErrorCode.HEARTBEAT_TIMEOUT


def test_heartbeat_zero_disables_timers() -> None:
    client, server = open_pair(client_kw=HB, server_kw={"heartbeat_ms": 0}, now=0.0)
    assert client.heartbeat_ms == 0
    assert client.next_deadline() is None
    assert server.next_deadline() is None
    client.handle_timeout(1e9)
    server.handle_timeout(1e9)
    assert client.data_to_send() == b""
    assert server.data_to_send() == b""
    assert client.state is State.OPEN
    assert server.state is State.OPEN


def test_slow_authentication_does_not_time_the_client_out() -> None:
    # The client can send nothing between HELLO and WELCOME, so the time the server spends deciding
    # (a slow password check) is not silence on the client's part.
    client = LinkConnection(Role.CLIENT, **HB)
    server = LinkConnection(Role.SERVER, **HB)
    client.hello("u", "p", "c")
    pump(client, server, 0.0)
    # ... authentication takes two seconds; the server accepts at t = 2.0 and arms its timer
    server.accept("n", "c", 1, 2.0)
    pump(server, client, 2.0)
    server.handle_timeout(2.0)
    assert server.state is State.OPEN


# ---------------------------------------------------------------------------------------------- limits
def test_frame_too_large_is_refused_from_its_header() -> None:
    _, server = open_pair(server_kw={"max_frame_size": MIN_FRAME_SIZE})
    expect_remote_error(server, struct.pack(">I", MIN_FRAME_SIZE + 1), ErrorCode.FRAME_TOO_LARGE)


def test_frame_too_large_during_handshake() -> None:
    server = LinkConnection(Role.SERVER)
    expect_remote_error(server, b"\xff\xff\xff\xff", ErrorCode.FRAME_TOO_LARGE)


def test_before_hello_succeeds_only_a_small_frame_is_accepted() -> None:
    # An unauthenticated peer announcing a big frame is refused from the header: nothing of it is buffered.
    server = LinkConnection(Role.SERVER, handshake_frame_size=4096)
    expect_remote_error(server, struct.pack(">I", 4097), ErrorCode.FRAME_TOO_LARGE)
    # The same limit holds while the password is being checked (HELLO received, not yet accepted).
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER, handshake_frame_size=4096)
    client.hello("u", "p", "c")
    pump(client, server)
    expect_remote_error(server, struct.pack(">I", 4097), ErrorCode.FRAME_TOO_LARGE)


def test_after_hello_succeeds_the_full_frame_limit_applies() -> None:
    _, server = open_pair(server_kw={"handshake_frame_size": 4096})
    spec = {"name": "q", "filler": "f" * 60_000}  # a 60 KB frame: 15 times the handshake limit
    [created] = server.receive_data(frame([[Op.CREATE_QUEUE, 1, spec]]), 1.0)
    assert created == ev.CreateQueue(1, spec)


@pytest.mark.parametrize("item", [b"\x90", b"\xc0", b"\x80"], ids=["empty-arrays", "nils", "empty-maps"])
def test_a_handshake_frame_of_many_small_objects_is_refused_before_decoding_them(item: bytes) -> None:
    # Decoded, each byte would become an object of ~8-64 bytes: before HELLO, no array or map may be long.
    count = 60_000
    payload = b"\xdd" + struct.pack(">I", count) + item * count
    expect_remote_error(LinkConnection(Role.SERVER), raw_frame(payload), ErrorCode.MALFORMED)
    tail = b"".join(msgpack.packb(v) for v in ["u", "p", "c", 100, MIN_FRAME_SIZE])
    nested = b"\x91\x97\x01\xdc" + struct.pack(">H", count) + item * count + tail  # as HELLO's version list
    expect_remote_error(LinkConnection(Role.SERVER), raw_frame(nested), ErrorCode.MALFORMED)


def test_a_client_understands_a_long_first_frame_behind_welcome() -> None:
    client = LinkConnection(Role.CLIENT)
    server = LinkConnection(Role.SERVER)
    client.hello("u", "p", "c")
    pump(client, server)
    server.accept("node", "conn", 10, 0.0)
    for _ in range(100):
        server.grant_publish_credit(1)
    events = pump(server, client)
    assert len(events) == 101
    assert client.publish_credit == 110


def test_a_handshake_frame_limit_below_the_minimum_is_refused_locally() -> None:
    with pytest.raises(ValueError, match="handshake_frame_size"):
        LinkConnection(Role.SERVER, handshake_frame_size=100)


def test_frame_at_the_limit_is_accepted() -> None:
    _, server = open_pair(server_kw={"max_frame_size": MIN_FRAME_SIZE})
    n = MIN_FRAME_SIZE - 40
    while True:
        op = [Op.CREATE_QUEUE, 1, {"name": "q", "x": "f" * n}]
        payload = msgpack.packb([op])
        if len(payload) >= MIN_FRAME_SIZE:
            break
        n += 1
    assert len(payload) == MIN_FRAME_SIZE
    data = raw_frame(payload)
    assert server.receive_data(data[:100], 1.0) == []
    assert server.receive_data(data[100:], 1.0) == [ev.CreateQueue(1, op[2])]


def test_too_many_operations_in_a_frame() -> None:
    _, server = open_pair(server_kw={"max_ops_per_frame": 3})
    assert server.receive_data(frame([[Op.HEARTBEAT]] * 3), 1.0) == []
    expect_remote_error(server, frame([[Op.HEARTBEAT]] * 4), ErrorCode.MALFORMED)


def test_too_many_operations_in_the_hello_frame() -> None:
    server = LinkConnection(Role.SERVER, max_ops_per_frame=1)
    hello = [Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE]
    expect_remote_error(server, frame([hello, hello]), ErrorCode.MALFORMED)


def test_data_to_send_splits_a_batch_to_the_peer_frame_limit() -> None:
    client, server = open_pair(client_kw={"max_frame_size": MIN_FRAME_SIZE})
    _, cid = client.subscribe("q", 100)
    pump(client, server)
    sent = [message(body=bytes([i]) * 4000, properties={"n": i}) for i in range(60)]
    for m in sent:
        server.deliver(cid, 1, m)
    data = server.data_to_send()
    payloads = split_frames(data)
    assert len(payloads) > 1
    assert all(len(p) <= MIN_FRAME_SIZE for p in payloads)
    ops = decoded_ops(data)
    assert ops == [[Op.DELIVER, cid, 1, m] for m in sent]
    events = client.receive_data(data, 1.0)
    assert [op[3] for e in events for op in e.ops] == sent
    assert all(isinstance(e, ev.Deliveries) for e in events)
    assert client.consumer_credit[cid] == 40


def test_client_splits_publishes_to_the_server_limit() -> None:
    client, server = open_pair(server_kw={"max_frame_size": MIN_FRAME_SIZE}, credit=50)
    sent = [message(body=b"p" * 5000) for _ in range(50)]
    for m in sent:
        client.publish(m)
    data = client.data_to_send()
    assert len(split_frames(data)) > 1
    events = server.receive_data(data, 1.0)
    assert [op[1] for e in events for op in e.ops] == list(range(1, 51))
    assert [op[3] for e in events for op in e.ops] == sent


def test_one_operation_larger_than_the_peer_limit_is_a_local_error() -> None:
    """Larger than what the client announced and than the server's own limit plus the delivery headroom."""
    client, server = open_pair(
        client_kw={"max_frame_size": MIN_FRAME_SIZE}, server_kw={"max_frame_size": MIN_FRAME_SIZE}
    )
    _, cid = client.subscribe("q", 10)
    pump(client, server)
    too_large = MIN_FRAME_SIZE + DELIVERY_HEADROOM
    server.deliver(cid, 0, message(body=b"x" * too_large))
    with pytest.raises(LocalProtocolError) as info:
        server.data_to_send()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    # the same single operation in a batch of small ones
    server.deliver(cid, 0, message())
    server.deliver(cid, 0, message(body=b"x" * too_large))
    server.deliver(cid, 0, message())
    with pytest.raises(LocalProtocolError):
        server.data_to_send()


def test_frames_from_data_to_send_respect_the_default_operation_limit() -> None:
    # Two codecs with default settings: whatever one side queues between two flushes must be readable
    # by the other, however many operations that is.
    client, server = open_pair()
    _, cid = client.subscribe("q", 1)
    pump(client, server)
    count = DEFAULT_MAX_OPS_PER_FRAME + 1
    for i in range(count):
        client.ack(cid, [i])
    events = server.receive_data(client.data_to_send(), 1.0)
    assert sum(len(e.ops) for e in events) == count


def test_error_text_is_bounded_so_the_close_frame_can_be_sent() -> None:
    # A bad value is echoed into the CLOSE text; a big one must not make the CLOSE itself unsendable.
    client, server = open_pair(client_kw={"max_frame_size": MIN_FRAME_SIZE})
    bad = message()
    bad[M_ROUTING] = b"\x00" * 20_000  # 20 kB in, ~80 kB of repr
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(frame([[Op.PUBLISH, 1, 0, bad]]), 1.0)
    assert info.value.code == ErrorCode.MALFORMED
    data = server.data_to_send()
    assert client.receive_data(data, 1.0)[-1].code == ErrorCode.MALFORMED


# ---------------------------------------------------------------------------------------------- garbage
def feed_garbage(conn: LinkConnection, data: bytes) -> None:
    """Only RemoteProtocolError (leaving a CLOSE to send) or nothing at all may come out."""
    error: RemoteProtocolError | None = None
    try:
        conn.receive_data(data, 1.0)
    except RemoteProtocolError as exc:
        error = exc
    if error is not None:
        assert conn.state is State.CLOSED
        assert error.code in vars(ErrorCode).values()
        assert decoded_ops(conn.data_to_send())[-1] == [Op.CLOSE, error.code, error.text]


def _ready_server() -> LinkConnection:
    client, server = open_pair(credit=5)
    client.subscribe("q", 5)
    pump(client, server)
    return server


def _ready_client() -> LinkConnection:
    client, server = open_pair(credit=5)
    client.subscribe("q", 2)
    client.publish(message())
    pump(client, server)
    return client


def _fresh_server() -> LinkConnection:
    return LinkConnection(Role.SERVER)


def _waiting_client() -> LinkConnection:
    client = LinkConnection(Role.CLIENT)
    client.hello("u", "p", "c")
    client.data_to_send()
    return client


ENDPOINTS = {
    "server": _ready_server,
    "client": _ready_client,
    "handshake-server": _fresh_server,
    "handshake-client": _waiting_client,
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.integers(min_value=-2, max_value=3)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
map_keys = st.text(max_size=5) | st.integers(min_value=-3, max_value=3) | st.binary(max_size=3)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(map_keys, inner, max_size=4),
    max_leaves=25,
)
valid_messages = st.builds(
    new_message,
    st.sampled_from(["a", "orders"]),
    st.binary(max_size=4),
    properties=st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
)
fields = msgpack_values | st.integers(min_value=-1, max_value=6) | valid_messages | st.lists(st.integers(0, 3))
op_codes = st.sampled_from([int(o) for o in Op] + [0, 7, 99, -1, 2**40])
operations = st.builds(lambda code, rest: [code, *rest], op_codes, st.lists(fields, max_size=7))
op_frames = st.lists(operations | msgpack_values, max_size=5)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@given(data=st.binary(max_size=200))
@HYPOTHESIS
def test_arbitrary_bytes(endpoint: str, data: bytes) -> None:
    feed_garbage(ENDPOINTS[endpoint](), data)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@given(payload=st.binary(max_size=200))
@HYPOTHESIS
def test_arbitrary_framed_bytes(endpoint: str, payload: bytes) -> None:
    feed_garbage(ENDPOINTS[endpoint](), raw_frame(payload))


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@given(value=msgpack_values)
@HYPOTHESIS
def test_arbitrary_msgpack_values(endpoint: str, value: Any) -> None:
    feed_garbage(ENDPOINTS[endpoint](), frame(value))


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@given(ops=op_frames)
@HYPOTHESIS
def test_arbitrary_operations(endpoint: str, ops: list[Any]) -> None:
    feed_garbage(ENDPOINTS[endpoint](), frame(ops))


message_fields = st.integers(min_value=0, max_value=MESSAGE_FIELDS - 1)


@given(index=message_fields, value=msgpack_values, deliver=st.booleans())
@HYPOTHESIS
def test_messages_with_a_mutated_field(index: int, value: Any, deliver: bool) -> None:
    m = message()
    m[index] = value
    if deliver:
        conn = _ready_client()
        data = frame([[Op.DELIVER, 1, 0, m]])
    else:
        conn = _ready_server()
        data = frame([[Op.PUBLISH, 1, 0, m]])
    if check_message(msgpack.unpackb(msgpack.packb(m), raw=False, strict_map_key=False)) is None:
        # still a valid message (or rejected before by the decoder): no other exception may come out
        feed_garbage(conn, data)
    else:
        expect_remote_error(conn, data, ErrorCode.MALFORMED)


@pytest.mark.parametrize("endpoint", ["server", "client"])
def test_invalid_utf8(endpoint: str) -> None:
    conn = ENDPOINTS[endpoint]()
    # [[FLOW / OK, 1, <str of two invalid bytes>]]
    payload = b"\x91\x93" + bytes([Op.FLOW if endpoint == "server" else Op.OK]) + b"\x01\xa2\xff\xfe"
    expect_remote_error(conn, raw_frame(payload), ErrorCode.MALFORMED)


def test_invalid_utf8_in_hello() -> None:
    payload = msgpack.packb([[Op.HELLO, [1], "u", "p", "c", 100, MIN_FRAME_SIZE]])
    payload = payload.replace(b"\xa1u", b"\xa1\xc3")  # truncated 2-byte sequence
    expect_remote_error(LinkConnection(Role.SERVER), raw_frame(payload), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "value",
    [msgpack.ExtType(5, b"abc"), msgpack.Timestamp(1, 0)],
    ids=["app-ext", "timestamp"],
)
def test_ext_types(value: Any) -> None:
    server = _ready_server()
    expect_remote_error(server, frame([[Op.FLOW, 1, value]]), ErrorCode.MALFORMED)
    server = _ready_server()
    expect_remote_error(server, frame(value), ErrorCode.MALFORMED)
    bad = message()
    bad[M_PROPS] = {"k": value}
    expect_remote_error(_ready_server(), frame([[Op.PUBLISH, 1, 0, bad]]), ErrorCode.MALFORMED)


def test_invalid_timestamp_ext() -> None:
    # [[FLOW, 1, ext -1 of one byte]]: the timestamp extension only has 4, 8 and 12-byte forms
    payload = b"\x91\x93" + bytes([Op.FLOW]) + b"\x01" + b"\xd4\xff\x00"
    expect_remote_error(_ready_server(), raw_frame(payload), ErrorCode.MALFORMED)


def test_ext_type_as_a_reply_result_is_harmless() -> None:
    client = _ready_client()
    [reply] = client.receive_data(frame([[Op.OK, 1, msgpack.ExtType(5, b"abc")]]), 1.0)
    assert reply.req_id == 1


@pytest.mark.parametrize(
    "spec",
    [{1: "a"}, {"a": 1, 2: "b"}, {None: 1}, {1.5: 1}, {True: 1}],
)
def test_maps_with_non_string_keys(spec: dict[Any, Any]) -> None:
    expect_remote_error(_ready_server(), frame([[Op.CREATE_QUEUE, 1, spec]]), ErrorCode.MALFORMED)


def test_properties_with_binary_keys() -> None:
    bad = message()
    bad[M_PROPS] = {b"key": 1}
    expect_remote_error(_ready_server(), frame([[Op.PUBLISH, 1, 0, bad]]), ErrorCode.MALFORMED)


def test_nesting_beyond_the_decoder_limit_is_malformed() -> None:
    payload = b"\x91\x93" + bytes([Op.FLOW]) + b"\x01" + deeply_nested(5000)
    expect_remote_error(_ready_server(), raw_frame(payload), ErrorCode.MALFORMED)


def test_deep_nesting_in_hello_versions() -> None:
    # [[HELLO, [<nested>], "u", "p", "c", 100, 65536]]: decodable, but offers no usable version
    tail = b"".join(msgpack.packb(v) for v in ["u", "p", "c", 100, MIN_FRAME_SIZE])
    payload = b"\x91\x97\x01\x91" + deeply_nested(1015) + tail
    expect_remote_error(LinkConnection(Role.SERVER), raw_frame(payload), ErrorCode.VERSION)


def test_deep_nesting_in_a_handshake_close() -> None:
    payload = b"\x91\x93\x03" + deeply_nested(1015) + msgpack.packb("text")
    feed_garbage(LinkConnection(Role.SERVER), raw_frame(payload))


def _message_with_raw_field(index: int, raw: bytes) -> bytes:
    m = message()
    parts = [msgpack.packb(v) for v in m]
    parts[index] = raw
    return b"\x9f" + b"".join(parts)


@pytest.mark.parametrize("index", [M_ROUTING, M_PROPS, M_BODY, M_DURABLE])
def test_deep_nesting_in_a_published_message(index: int) -> None:
    raw_message = _message_with_raw_field(index, deeply_nested(1015))
    payload = b"\x91\x94" + bytes([Op.PUBLISH]) + b"\x01\x00" + raw_message
    expect_remote_error(_ready_server(), raw_frame(payload), ErrorCode.MALFORMED)


def test_deep_nesting_in_a_delivered_message() -> None:
    raw_message = _message_with_raw_field(M_ROUTING, deeply_nested(1015))
    payload = b"\x91\x94" + bytes([Op.DELIVER]) + b"\x01\x00" + raw_message
    expect_remote_error(_ready_client(), raw_frame(payload), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x91", b"\x92\x91\x04", b"\x91\x91\x04\x00", b"\xdd\xff\xff\xff\xff", b"\xc4\x05ab"],
    ids=["empty", "never-used", "truncated", "truncated-2", "extra-data", "huge-array", "short-bin"],
)
def test_undecodable_payloads(payload: bytes) -> None:
    expect_remote_error(_ready_server(), raw_frame(payload), ErrorCode.MALFORMED)
    expect_remote_error(_ready_client(), raw_frame(payload), ErrorCode.MALFORMED)


@pytest.mark.parametrize("value", [[], {}, 4, "ops", None, [[]], [4], [["4"]], [[4.0]], [[None]]])
def test_frame_shape_errors(value: Any) -> None:
    expect_remote_error(_ready_server(), frame(value), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    ("endpoint", "code"),
    [
        ("server", Op.HELLO),
        ("server", Op.WELCOME),
        ("server", Op.OK),
        ("server", Op.DELIVER),
        ("server", Op.CONFIRM),
        ("server", 99),
        ("server", -1),
        ("client", Op.HELLO),
        ("client", Op.WELCOME),
        ("client", Op.PUBLISH),
        ("client", Op.ACK),
        ("client", Op.FLOW),
        ("client", Op.SUBSCRIBE),
        ("client", Op.SET_WILL),
        ("client", 0),
    ],
)
def test_operations_not_valid_from_the_peer(endpoint: str, code: int) -> None:
    expect_remote_error(ENDPOINTS[endpoint](), frame([[code, 1, 2, 3]]), ErrorCode.UNEXPECTED)


@pytest.mark.parametrize(
    "op",
    [
        [Op.DELETE_QUEUE, 1],
        [Op.DELETE_QUEUE, 1, "q", "extra"],
        [Op.DELETE_QUEUE, "1", "q"],
        [Op.DELETE_QUEUE, 1, b"q"],
        [Op.CREATE_QUEUE, 1, ["name", "q"]],
        [Op.SUBSCRIBE, 1, 1, "q", 5, None],
        [Op.HEARTBEAT, 1],
        [Op.FLOW, 1, 1.5, 0],
        [Op.TX_BEGIN, 1, None],
        [Op.PUBLISH, 1, 0, "message"],
    ],
)
def test_wrong_field_count_or_type(op: list[Any]) -> None:
    expect_remote_error(_ready_server(), frame([op]), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "op",
    [
        [Op.DELETE_QUEUE, -1, "q"],
        [Op.DELETE_QUEUE, 2**63, "q"],
        [Op.TX_BEGIN, 1, 2**64 - 1],
        [Op.UNSUBSCRIBE, 1, -5],
        [Op.SUBSCRIBE, 1, 1, "q", -1, {}],
        [Op.SUBSCRIBE, 1, 1, "q", MAX_CREDIT + 1, {}],
        [Op.FLOW, 1, MAX_CREDIT + 1, 0],
        [Op.FLOW, -1, 1, 0],
        [Op.FLOW, 1, 1, -1],
        [Op.FLOW, 1, 1, 2**63],
        [Op.ACK, 1, 0, [1, 2**63]],
        [Op.NACK, 1, [-1], int(NackMode.REDELIVER)],
        [Op.PUBLISH, 1, -1, new_message("a", b"")],
        [Op.PUBLISH, 1, 2**63, new_message("a", b"")],
    ],
)
def test_integer_fields_out_of_range_are_malformed(op: list[Any]) -> None:
    """Every integer a peer sends stays within what the receiver can add to, store, echo and log."""
    expect_remote_error(_ready_server(), frame([op]), ErrorCode.MALFORMED)


def test_a_credit_grant_out_of_range_is_malformed() -> None:
    expect_remote_error(_ready_client(), frame([[Op.PUBLISH_CREDIT, MAX_CREDIT + 1, 0]]), ErrorCode.MALFORMED)
    expect_remote_error(_ready_client(), frame([[Op.DELIVER, 1, -1, message()]]), ErrorCode.MALFORMED)


def test_integer_fields_at_their_limits_are_accepted() -> None:
    server = _ready_server()
    ops = [[Op.FLOW, MAX_FIELD_INT, MAX_CREDIT, MAX_FIELD_INT], [Op.TX_BEGIN, MAX_FIELD_INT, 0]]
    events = server.receive_data(frame(ops), 1.0)
    assert events == [ev.Flow(MAX_FIELD_INT, MAX_CREDIT, MAX_FIELD_INT), ev.TxBegin(MAX_FIELD_INT, 0)]


# ---------------------------------------------------------------------------------------------- messages
def _with(index: int, value: Any) -> list[Any]:
    m = message()
    m[index] = value
    return m


INVALID_MESSAGES = {
    "not-a-list": {"body": b"x"},
    "too-short": message()[:-1],
    "too-long": [*message(), 0],
    "id-not-int": _with(0, "1"),
    "empty-address": _with(1, ""),
    "address-not-str": _with(1, b"orders"),
    "unknown-routing": _with(M_ROUTING, 5),
    "routing-bool": _with(M_ROUTING, value=True),
    "routing-str": _with(M_ROUTING, "anycast"),
    "durable-not-bool": _with(M_DURABLE, 1),
    "priority-10": _with(M_PRIORITY, 10),
    "priority-negative": _with(M_PRIORITY, -1),
    "priority-float": _with(M_PRIORITY, 4.0),
    "expiration-not-int": _with(5, None),
    "timestamp-not-int": _with(6, 1.5),
    "group-not-str": _with(7, 3),
    "dedup-not-str": _with(8, b"d"),
    "lvq-not-str": _with(9, ["k"]),
    "props-not-map": _with(M_PROPS, [["k", 1]]),
    "props-list-value": _with(M_PROPS, {"k": [1]}),
    "props-map-value": _with(M_PROPS, {"k": {"a": 1}}),
    "props-too-many": _with(M_PROPS, {str(i): i for i in range(257)}),
    "body-str": _with(M_BODY, "text"),
    "body-nil": _with(M_BODY, None),
    "content-type-not-str": _with(12, 1),
    "protocol-not-str": _with(13, value=True),
    "scheduled-not-int": _with(14, "now"),
    # Out of range: the core turns times into microseconds and adds to them (a timestamp of 2**63-1 once
    # stopped a core's timers when its expiry was audited).
    "id-negative": _with(0, -1),
    "id-above-int64": _with(0, 2**63),
    "timestamp-int64-max": _with(6, 2**63 - 1),
    "timestamp-negative": _with(6, -1),
    "timestamp-after-9999": _with(6, MAX_TIME_MS + 1),
    "expiration-int64-max": _with(5, 2**63 - 1),
    "expiration-negative": _with(5, -1),
    "scheduled-uint64-max": _with(14, 2**64 - 1),
    "scheduled-negative": _with(14, -(2**63)),
}


@pytest.mark.parametrize("name", sorted(INVALID_MESSAGES))
def test_check_message_rejects(name: str) -> None:
    problem = check_message(INVALID_MESSAGES[name])
    assert isinstance(problem, str)
    assert problem


@pytest.mark.parametrize("name", sorted(INVALID_MESSAGES))
def test_invalid_message_published_is_malformed(name: str) -> None:
    data = frame([[Op.PUBLISH, 1, 0, INVALID_MESSAGES[name]]])
    error = expect_remote_error(_ready_server(), data, ErrorCode.MALFORMED)
    if type(INVALID_MESSAGES[name]) is list:
        assert error.text == check_message(INVALID_MESSAGES[name])


@pytest.mark.parametrize("name", sorted(INVALID_MESSAGES))
def test_invalid_message_delivered_is_malformed(name: str) -> None:
    data = frame([[Op.DELIVER, 1, 0, INVALID_MESSAGES[name]]])
    expect_remote_error(_ready_client(), data, ErrorCode.MALFORMED)


def test_max_properties_setting() -> None:
    m = message(properties={"a": 1, "b": 2, "c": 3})
    assert check_message(m, max_properties=3) is None
    assert check_message(m, max_properties=2) is not None
    client, server = open_pair(server_kw={"max_properties": 2})
    client.publish(m)
    with pytest.raises(RemoteProtocolError) as info:
        pump(client, server)
    assert info.value.code == ErrorCode.MALFORMED


def test_valid_messages_pass_check_message() -> None:
    assert check_message(message()) is None
    assert check_message(_with(6, MAX_TIME_MS)) is None
    assert check_message(_with(0, 2**63 - 1)) is None
    assert check_message(message(routing=int(RoutingType.MULTICAST))) is None
    assert check_message(message(routing=ROUTING_DEFAULT, priority=0)) is None
    full = message(
        routing=0,
        durable=True,
        priority=9,
        expiration_ms=1,
        group_id="g",
        dedup_id="d",
        last_value_key="k",
        properties={"s": "x", "i": -1, "f": 1.5, "b": False, "y": b"\x00", "n": None},
        content_type="text/plain",
        protocol="stomp",
        scheduled_ms=5,
    )
    assert check_message(full) is None
    assert len(full) == MESSAGE_FIELDS


# ---------------------------------------------------------------------------------------------- round trip
property_values = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
opt_text = st.none() | st.text(max_size=10)
ms = st.integers(min_value=0, max_value=MAX_TIME_MS)
wire_messages = st.builds(
    new_message,
    st.text(min_size=1, max_size=20),
    st.binary(max_size=100),
    routing=st.sampled_from([ROUTING_DEFAULT, 0, 1]),
    durable=st.booleans(),
    priority=st.integers(min_value=0, max_value=9),
    expiration_ms=ms,
    group_id=opt_text,
    dedup_id=opt_text,
    last_value_key=opt_text,
    properties=st.dictionaries(st.text(max_size=8), property_values, max_size=6),
    content_type=opt_text,
    protocol=opt_text,
    scheduled_ms=ms,
)


@given(messages=st.lists(wire_messages, min_size=1, max_size=5), tx_id=st.integers(0, 2**32))
@HYPOTHESIS
def test_published_messages_arrive_equal(messages: list[list[Any]], tx_id: int) -> None:
    for m in messages:
        assert check_message(m) is None
    client, server = open_pair(credit=len(messages))
    seqs = [client.publish(m, tx_id=tx_id) for m in messages]
    [event] = pump(client, server)
    assert event == ev.Publishes([[Op.PUBLISH, s, tx_id, m] for s, m in zip(seqs, messages, strict=True)])
    assert [type(v) for op in event.ops for v in op[3]] == [type(v) for m in messages for v in m]


@given(messages=st.lists(wire_messages, min_size=1, max_size=5), count=st.integers(0, 2**32))
@HYPOTHESIS
def test_delivered_messages_arrive_equal(messages: list[list[Any]], count: int) -> None:
    client, server = open_pair()
    _, cid = client.subscribe("q", len(messages))
    pump(client, server)
    for m in messages:
        server.deliver(cid, count, m)
    assert pump(server, client) == [ev.Deliveries([[Op.DELIVER, cid, count, m] for m in messages])]
    assert client.consumer_credit[cid] == 0


def test_default_limits() -> None:
    assert DEFAULT_MAX_FRAME_SIZE == 16 * 1024 * 1024
    assert MIN_FRAME_SIZE == 64 * 1024
    assert HEARTBEAT_TIMEOUT_FACTOR == 4


# ---------------------------------------------------------------------------------------------- derived limits
def _deliver_one(server: LinkConnection, client: LinkConnection, body: bytes) -> list[ev.Event]:
    client.subscribe("q", 1)
    pump(client, server)
    server.deliver(1, 1, message(body=body))
    return pump(server, client)


def test_a_client_takes_deliveries_as_large_as_the_servers_own_limit() -> None:
    """Whatever the server accepted in a publish (its frame limit) it can deliver, whatever the client
    announced: the client's limit follows the server's from the WELCOME on (version 2)."""
    big = 4 * MIN_FRAME_SIZE
    client, server = open_pair(client_kw={"max_frame_size": MIN_FRAME_SIZE}, server_kw={"max_frame_size": big})
    assert client.max_frame_size == big + DELIVERY_HEADROOM
    assert client.max_publish_body == big // 2  # a small limit: half of it for the body
    [deliveries] = _deliver_one(server, client, b"x" * (big - 1024))
    assert isinstance(deliveries, ev.Deliveries)
    assert len(deliveries.ops[0][3][M_BODY]) == big - 1024
    # Several operations still travel in frames of the size the client announced.
    client.flow(1, 3)
    pump(client, server)
    for _ in range(3):
        server.deliver(1, 1, message(body=b"y" * (MIN_FRAME_SIZE // 2)))
    frames = split_frames(server.data_to_send())
    assert len(frames) == 3
    assert all(len(p) <= MIN_FRAME_SIZE for p in frames)


def test_a_version_1_client_keeps_the_limit_it_announced() -> None:
    big = 4 * MIN_FRAME_SIZE
    client, server = open_pair(
        client_kw={"max_frame_size": MIN_FRAME_SIZE, "versions": (1,)}, server_kw={"max_frame_size": big}
    )
    assert client.max_frame_size == MIN_FRAME_SIZE
    client.subscribe("q", 1)
    pump(client, server)
    server.deliver(1, 1, message(body=b"x" * (2 * MIN_FRAME_SIZE)))
    with pytest.raises(LocalProtocolError) as too_large:
        server.data_to_send()
    assert too_large.value.code == ErrorCode.FRAME_TOO_LARGE


def test_the_publish_body_limit_leaves_room_for_the_headers() -> None:
    client, _ = open_pair(server_kw={"max_frame_size": 32 * 1024 * 1024})
    assert client.max_publish_body == 31 * 1024 * 1024
