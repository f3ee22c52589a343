"""Sans-IO state machine of the internal link: bytes in, events out; calls in, bytes queued.

No sockets, no asyncio, no clock: time is passed in as ``now`` (seconds, any monotonic origin). The same
class serves both ends; ``role`` decides which operations each side may send and receive.

Flow control both ways: the server grants the client a publish window (``PUBLISH_CREDIT``) and the client
grants each consumer a delivery window (``SUBSCRIBE`` credit and ``FLOW``); a peer that exceeds a window
breaks the protocol. From version 2 both windows are also counted in body bytes (the publish window always,
a consumer's when it subscribes with ``credit_bytes``): a message may start while any byte credit is left,
so one large message still passes a small window, and the bytes on their way stay bounded. Everything
queued between two ``data_to_send`` calls leaves as one frame, so a busy link costs one write and one msgpack
call per event-loop iteration, not per message.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, Final, NoReturn

import msgpack

from tridentmq_shared.link import events as ev
from tridentmq_shared.link.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_shared.link.ops import HEADER_SIZE, PROTOCOL_VERSIONS, ErrorCode, NackMode, Op
from tridentmq_shared.message import M_BODY, MAX_PROPERTIES, WireMessage, check_message

DEFAULT_MAX_FRAME_SIZE: Final = 16 * 1024 * 1024
DEFAULT_MAX_OPS_PER_FRAME: Final = 65_536
DEFAULT_HEARTBEAT_MS: Final = 250
#: A peer is declared dead after this many heartbeat intervals of silence.
HEARTBEAT_TIMEOUT_FACTOR: Final = 4
#: Intervals between two timer calls beyond which this side was stalled, not the peer silent.
STALL_INTERVALS: Final = 2
MIN_FRAME_SIZE: Final = 64 * 1024
#: What a delivery may add to the message its publish carried: the operation, the id and timestamp the node
#: fills in, a cluster node's forwarding header. From version 2 a client accepts frames this much larger than
#: the server's own limit, and the server sends one operation up to that size whatever the client announced,
#: so whatever a node accepted in a publish it can deliver.
DELIVERY_HEADROOM: Final = 64 * 1024
#: What a message may carry besides its body (fields, properties, the operation) within the server's frame
#: limit: a client refuses a larger body before sending it (gateways bound headers far below this).
PUBLISH_HEADROOM: Final = 1024 * 1024
#: Largest frame a server accepts before the handshake by default: HELLO takes a few hundred bytes.
DEFAULT_HANDSHAKE_FRAME_SIZE: Final = 64 * 1024
#: Smallest handshake frame limit: room for HELLO with long names.
MIN_HANDSHAKE_FRAME_SIZE: Final = 1024
#: Arrays and maps a frame may hold before the handshake: HELLO or CLOSE and a short list of versions.
#: msgpack turns each 1-byte empty array into a ~64-byte list, so an unauthenticated peer gets no large ones.
_HANDSHAKE_CONTAINER_LEN: Final = 16
#: Operations per outgoing frame (see ``data_to_send``).
FRAME_OPERATIONS: Final = 512
#: The byte credit of a window that is not counted in bytes (a version 1 link): never used up.
UNBOUNDED_BYTES: Final = 1 << 62
#: The first protocol version whose windows are counted in bytes too.
BYTE_CREDIT_VERSION: Final = 2
#: The first protocol version with DELETE_QUEUE_EVERYWHERE.
EVERYWHERE_VERSION: Final = 3
#: The first protocol version whose SUBSCRIBE can make its queue (option ``queue``) and whose BROWSE_DONE ends
#: the browser on both sides (no UNSUBSCRIBE follows it).
MAKE_AND_SUBSCRIBE_VERSION: Final = 4

_NACK_MODES: Final = frozenset(int(m) for m in NackMode)
#: One packer for every connection: each holds a 4 KiB buffer, and a gateway or a core has a connection per
#: client session. A pack of our plain types runs whole under the GIL and returns its bytes (autoreset).
_PACKER: Final = msgpack.Packer(autoreset=True)
#: Every integer field of an operation (ids, sequence numbers, counts, times) is within 0..MAX_FIELD_INT: a
#: peer's value is added to, stored, echoed and logged, and must stay a signed 64-bit integer doing so.
MAX_FIELD_INT: Final = 2**63 - 1
#: Largest credit one SUBSCRIBE, FLOW or PUBLISH_CREDIT grants (windows are thousands of messages).
MAX_CREDIT: Final = 2**31 - 1
#: Error texts are cut to this length so a CLOSE always fits in a frame.
MAX_ERROR_TEXT: Final = 512
MAX_CLIENT_HOST: Final = 256  # an IPv6 address with a zone fits many times over
_PUBLISH: Final = int(Op.PUBLISH)
_DELIVER: Final = int(Op.DELIVER)
_CONFIRM: Final = int(Op.CONFIRM)
_CHANNEL: Final = int(Op.CHANNEL)
_OPT_STR: Final = (str, type(None))
_OPT_MAP: Final = (dict, type(None))


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class State(Enum):
    HANDSHAKE = "handshake"  # client: HELLO sent, awaiting WELCOME; server: awaiting HELLO
    AUTHENTICATING = "authenticating"  # server: HELLO received, awaiting accept() or refuse()
    OPEN = "open"
    CLOSED = "closed"


# Enum members as plain module constants: on Python 3.11 ``State.OPEN`` costs a descriptor call, and
# the state is checked for every message.
_OPEN: Final = State.OPEN
_CLOSED: Final = State.CLOSED
_SERVER: Final = Role.SERVER
_CLIENT: Final = Role.CLIENT

#: The consumer windows of a link that has no consumers: one shared empty dict, only ever read (each link
#: swaps in its own on its first SUBSCRIBE).
_NO_CONSUMERS: Final[dict[int, int]] = {}

# Field types of control operations after the op code, checked before an event is built.
_FIELDS: Final[dict[int, tuple[type | tuple[type, ...], ...]]] = {
    Op.HELLO: (list, _OPT_STR, _OPT_STR, str, int, int),
    Op.WELCOME: (int, str, str, int, int, int),
    Op.CLOSE: (str, str),
    Op.HEARTBEAT: (),
    Op.OK: (int, object),
    Op.ERROR: (int, str, str),
    Op.CREATE_ADDRESS: (int, str, list),
    Op.DELETE_ADDRESS: (int, str),
    Op.CREATE_QUEUE: (int, dict),
    Op.DELETE_QUEUE: (int, str),
    Op.SUBSCRIBE: (int, int, str, int, dict),
    Op.UNSUBSCRIBE: (int, int),
    Op.TX_BEGIN: (int, int),
    Op.TX_COMMIT: (int, int),
    Op.TX_ROLLBACK: (int, int),
    Op.SET_WILL: (int, _OPT_MAP),
    Op.PUBLISH: (int, int, list),
    Op.CONFIRM: (int, int),
    Op.REJECT: (int, str, str),
    Op.PUBLISH_CREDIT: (int,),
    Op.DELIVER: (int, int, list),
    Op.ACK: (int, int, list),
    Op.NACK: (int, list, int),
    Op.FLOW: (int, int),
    Op.CONSUMER_CLOSED: (int, str, str),
    Op.BROWSE_DONE: (int,),
    Op.TOPOLOGY: (int, dict),
    Op.TOPOLOGY_UPDATE: (dict,),
    Op.REPLICATE: (int, dict),
    Op.REPLICA: (int, int, list, int),
    Op.REPLICA_ACK: (int,),
    Op.VOTE: (int, dict),
    Op.CHANNEL: (int, bytes),
}
# Version 2: PUBLISH_CREDIT and FLOW carry bytes after the message credit (WELCOME's extra field is read apart).
_FIELDS_V2: Final[dict[int, tuple[type | tuple[type, ...], ...]]] = {
    **_FIELDS,
    Op.PUBLISH_CREDIT: (int, int),
    Op.FLOW: (int, int, int),
}

_FIELDS_V3: Final[dict[int, tuple[type | tuple[type, ...], ...]]] = {
    **_FIELDS_V2,
    Op.DELETE_QUEUE_EVERYWHERE: (int, str),
}
_FIELDS_OF_VERSION: Final = {1: _FIELDS, 2: _FIELDS_V2, 3: _FIELDS_V3, 4: _FIELDS_V3}

_RECEIVES: Final = {
    Role.SERVER: frozenset(
        {
            Op.CLOSE,
            Op.HEARTBEAT,
            Op.CREATE_ADDRESS,
            Op.DELETE_ADDRESS,
            Op.CREATE_QUEUE,
            Op.DELETE_QUEUE,
            Op.DELETE_QUEUE_EVERYWHERE,
            Op.SUBSCRIBE,
            Op.UNSUBSCRIBE,
            Op.TX_BEGIN,
            Op.TX_COMMIT,
            Op.TX_ROLLBACK,
            Op.SET_WILL,
            Op.PUBLISH,
            Op.ACK,
            Op.NACK,
            Op.FLOW,
            Op.TOPOLOGY,
            Op.REPLICATE,
            Op.REPLICA_ACK,
            Op.VOTE,
            Op.CHANNEL,
        }
    ),
    Role.CLIENT: frozenset(
        {
            Op.CLOSE,
            Op.HEARTBEAT,
            Op.OK,
            Op.ERROR,
            Op.CONFIRM,
            Op.REJECT,
            Op.PUBLISH_CREDIT,
            Op.DELIVER,
            Op.CONSUMER_CLOSED,
            Op.BROWSE_DONE,
            Op.TOPOLOGY_UPDATE,
            Op.REPLICA,
            Op.CHANNEL,
        }
    ),
}

_SIMPLE_REQUESTS: Final[dict[int, Callable[[int, Any], ev.Event]]] = {
    Op.DELETE_ADDRESS: ev.DeleteAddress,
    Op.DELETE_QUEUE: ev.DeleteQueue,
    Op.DELETE_QUEUE_EVERYWHERE: ev.DeleteQueueEverywhere,
    Op.UNSUBSCRIBE: ev.Unsubscribe,
    Op.TX_BEGIN: ev.TxBegin,
    Op.TX_COMMIT: ev.TxCommit,
    Op.TX_ROLLBACK: ev.TxRollback,
}
_BATCHED: Final[dict[int, Callable[[list[ev.OpList]], ev.Event]]] = {
    Op.PUBLISH: ev.Publishes,
    Op.DELIVER: ev.Deliveries,
    Op.ACK: ev.Acks,
    Op.NACK: ev.Nacks,
}


def opens_channel(data: bytes) -> bool:
    """Whether the first bytes seen of a channel id can open it: the start of a frame whose first operation is
    HELLO (a session's first write; a long one may come in pieces). Anything else on an unknown id was on its
    way when this side ended the channel (channel ids are never reused on a link), and must not make a
    channel anew. Only the frame's opening is read: the outer array, the operation's array, its code."""
    if len(data) < HEADER_SIZE + 3 or int.from_bytes(data[:HEADER_SIZE], "big") < 3:
        return False
    unpacker = msgpack.Unpacker(max_buffer_size=len(data))
    unpacker.feed(data[HEADER_SIZE : HEADER_SIZE + 32])  # room for the widest headers and code
    try:
        if not unpacker.read_array_header() or not unpacker.read_array_header():
            return False
        code = unpacker.unpack()
    except (ValueError, TypeError, msgpack.UnpackException):
        return False
    return type(code) is int and code == Op.HELLO


class LinkConnection:
    """One end of an internal link."""

    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = (
        "_fields",
        "_frame_limit",
        "_hello_sent",
        "_inbuf",
        "_last_recv",
        "_last_timer",
        "_next_consumer_id",
        "_next_req_id",
        "_next_send_check",
        "_next_seq",
        "_next_tx_id",
        "_open_confirm",
        "_out",
        "_peer_max_frame",
        "_peer_max_operation",
        "_released_consumers",
        "_sent_since_check",
        "carries_channels",
        "channel_data",
        "consumer_bytes",
        "consumer_credit",
        "forgive_own_stalls",
        "heartbeat_ms",
        "max_frame_size",
        "max_ops_per_frame",
        "max_properties",
        "publish_bytes",
        "publish_credit",
        "publish_window_bytes",
        "role",
        "state",
        "version",
        "versions",
    )

    def __init__(
        self,
        role: Role,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_ops_per_frame: int = DEFAULT_MAX_OPS_PER_FRAME,
        heartbeat_ms: int = DEFAULT_HEARTBEAT_MS,
        max_properties: int = MAX_PROPERTIES,
        handshake_frame_size: int = DEFAULT_HANDSHAKE_FRAME_SIZE,
        versions: tuple[int, ...] = PROTOCOL_VERSIONS,
        carries_channels: bool = True,
        forgive_own_stalls: bool = False,
    ) -> None:
        """``handshake_frame_size`` (server): the largest frame accepted until ``accept()``, whoever the peer.
        ``carries_channels`` False: the link is itself a channel, and a CHANNEL in it is a protocol error
        (channels do not nest: a link's ``max_channels`` bounds its sessions). ``forgive_own_stalls``: see
        ``handle_timeout``."""
        if max_frame_size < MIN_FRAME_SIZE:
            raise ValueError(f"max_frame_size must be at least {MIN_FRAME_SIZE}")
        if handshake_frame_size < MIN_HANDSHAKE_FRAME_SIZE:
            raise ValueError(f"handshake_frame_size must be at least {MIN_HANDSHAKE_FRAME_SIZE}")
        if not versions or not set(versions) <= set(PROTOCOL_VERSIONS):
            raise ValueError(f"versions must be among {PROTOCOL_VERSIONS}")
        self.role = role
        self.carries_channels = carries_channels
        self.forgive_own_stalls = forgive_own_stalls
        self.versions = versions  # offered (client) or accepted (server); a subset only to test older peers
        self.state = State.HANDSHAKE
        self.version = 0
        self.max_frame_size = max_frame_size
        # What an unauthenticated peer may make us buffer and decode; the full limit once the link is open.
        self._frame_limit = min(handshake_frame_size, max_frame_size) if role is Role.SERVER else max_frame_size
        self.max_ops_per_frame = max_ops_per_frame
        self.max_properties = max_properties
        self.heartbeat_ms = heartbeat_ms  # our wish until the handshake, the agreed interval after it
        self._peer_max_frame = DEFAULT_MAX_FRAME_SIZE
        self._peer_max_operation = DEFAULT_MAX_FRAME_SIZE  # the largest frame holding one operation
        self._fields = _FIELDS  # the field table of the agreed version
        # The start of an incomplete frame; None when none is (most reads end on a frame's end, and a
        # bytearray keeps its largest size: tens of thousands of idle session links would each hold one).
        self._inbuf: bytearray | None = None
        self._out: list[list[Any] | tuple[Any, ...]] = []
        # heartbeats
        self._last_recv = 0.0
        self._last_timer = 0.0  # when ``handle_timeout`` was last called
        self._next_send_check = 0.0
        self._sent_since_check = False
        # server: publish sequence and window; client: the same seen from the other side
        self._next_seq = 1
        self.publish_credit = 0
        self.publish_bytes = UNBOUNDED_BYTES  # body bytes the client may still start publishes with (v2)
        self.publish_window_bytes = UNBOUNDED_BYTES  # server: what each grant tops the byte credit up to
        self._open_confirm: list[Any] | None = None
        # client: ids and per-consumer delivery windows
        self._hello_sent = False
        self._next_req_id = 0
        self._next_consumer_id = 1
        self._next_tx_id = 1
        # (Empty and shared until the first SUBSCRIBE: a server's and a producer's links never have any.)
        self.consumer_credit: dict[int, int] = _NO_CONSUMERS
        self.consumer_bytes: dict[int, int] = _NO_CONSUMERS  # byte credit of those subscribed with ``credit_bytes``
        self._released_consumers: set[int] | None = None  # made by the first release (an empty set: 216 bytes)
        #: (channel id, bytes) of the CHANNEL operations received, in order, for the shell to drain after each
        #: ``receive_data``: the streams of sessions multiplexed over this link (empty bytes: the channel closed).
        #: None until one is received: the links of the sessions themselves never have any.
        self.channel_data: list[tuple[int, bytes]] | None = None

    @property
    def open(self) -> bool:
        return self.state is _OPEN

    @property
    def closed(self) -> bool:
        return self.state is _CLOSED

    # ------------------------------------------------------------------ receiving
    def receive_data(self, data: bytes, now: float) -> list[ev.Event]:
        """Feed bytes read from the peer; ``b""`` means end of stream."""
        if self.state is _CLOSED:
            return []
        self._last_recv = now
        if not data:
            self.state = _CLOSED
            return [ev.Closed(ErrorCode.EOF, "the peer closed the connection")]
        buf = self._inbuf
        if buf is not None:
            buf += data
        source = data if buf is None else buf  # whole frames are read from the caller's bytes, uncopied
        events: list[ev.Event] = []
        pos = 0
        end = len(source)
        with memoryview(source) as view:
            while end - pos >= HEADER_SIZE:
                size = int.from_bytes(view[pos : pos + HEADER_SIZE], "big")
                if size > self._frame_limit:
                    self._fail(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {size} bytes exceeds {self._frame_limit}"
                        + ("" if self.state is _OPEN else " before the handshake"),
                    )
                if end - pos - HEADER_SIZE < size:
                    break
                start = pos + HEADER_SIZE
                pos = start + size
                self._receive_frame(view[start:pos], now, events)
                if self.closed:
                    break
        if buf is None:
            if pos < end:
                self._inbuf = bytearray(source[pos:])
        elif pos == end:
            self._inbuf = None
        else:
            del buf[:pos]
        return events

    def _receive_frame(self, payload: memoryview, now: float, events: list[ev.Event]) -> None:
        try:
            if self.state is _OPEN or self.role is _CLIENT:  # WELCOME may come with more behind it
                # Lengths are bounded by the frame's size (msgpack's defaults), nesting by its fixed stack.
                ops = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
            else:
                ops = msgpack.unpackb(
                    payload,
                    raw=False,
                    strict_map_key=True,
                    use_list=True,
                    max_array_len=_HANDSHAKE_CONTAINER_LEN,
                    max_map_len=_HANDSHAKE_CONTAINER_LEN,
                    max_ext_len=0,
                )
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
            self._fail(ErrorCode.MALFORMED, f"undecodable frame: {exc}")
        if type(ops) is not list or not ops:
            self._fail(ErrorCode.MALFORMED, "a frame holds a non-empty array of operations")
        if len(ops) > self.max_ops_per_frame:
            self._fail(ErrorCode.MALFORMED, f"more than {self.max_ops_per_frame} operations in a frame")
        if self.state is not _OPEN:
            self._receive_handshake(ops[0], len(ops), now, events)
            if not self.open or len(ops) == 1:
                return
            ops = ops[1:]  # a client may find the server's first operations behind WELCOME
        receives = _RECEIVES[self.role]
        hot = _PUBLISH if self.role is _SERVER else _DELIVER
        max_properties = self.max_properties
        batch_code = -1
        batch: list[list[Any]] = []
        for op in ops:
            if type(op) is not list or not op or type(op[0]) is not int:
                self._fail(ErrorCode.MALFORMED, "an operation is a non-empty array starting with its code")
            code = op[0]
            # The per-message operation of this direction, checked inline: it is most of the traffic.
            if (
                code == hot
                and len(op) == 4
                and type(op[1]) is int
                and type(op[2]) is int
                and 0 <= op[1] <= MAX_FIELD_INT
                and 0 <= op[2] <= MAX_FIELD_INT
            ):
                problem = check_message(op[3], max_properties)
                if problem is not None:
                    self._fail(ErrorCode.MALFORMED, problem)
                self._count_hot(op)
            elif (
                code == _CHANNEL
                and len(op) == 3
                and type(op[1]) is int
                and type(op[2]) is bytes
                and 0 < op[1] <= MAX_FIELD_INT
                and self.carries_channels
            ):
                # Nearly all of a shared link's traffic, in both directions: checked inline too (anything
                # else about it, a channel id 0 say, is refused below with the other operations).
                if self.channel_data is None:
                    self.channel_data = [(op[1], op[2])]
                else:
                    self.channel_data.append((op[1], op[2]))
                batch_code = -1
                continue
            else:
                if code not in receives:
                    self._fail(ErrorCode.UNEXPECTED, f"operation {code} is not valid from the {self._peer_name()}")
                self._check_fields(op)
                if code not in _BATCHED:
                    batch_code = -1
                    event = self._control_event(code, op)
                    if event is not None:
                        events.append(event)
                    if self.closed:
                        return
                    continue
                self._check_batched(code, op)
            if code != batch_code:  # consecutive operations of one kind travel as one batch event
                batch = []
                batch_code = code
                events.append(_BATCHED[code](batch))
            batch.append(op)

    def _check_fields(self, op: list[Any]) -> None:
        spec = self._fields.get(op[0])
        if spec is None:  # an operation of a later version than this link's
            self._fail(ErrorCode.UNEXPECTED, f"operation {op[0]} is not in protocol version {self.version}")
        if len(op) != len(spec) + 1:
            self._fail(ErrorCode.MALFORMED, f"operation {op[0]} takes {len(spec)} fields, got {len(op) - 1}")
        for value, kind in zip(op[1:], spec, strict=True):
            if not isinstance(value, kind):
                self._fail(ErrorCode.MALFORMED, f"operation {op[0]}: field of type {type(value).__name__}")
            if type(value) is int and not 0 <= value <= MAX_FIELD_INT:
                self._fail(ErrorCode.MALFORMED, f"operation {op[0]}: integer field outside 0..{MAX_FIELD_INT}")

    def _count_hot(self, op: list[Any]) -> None:
        """Sequence and window accounting of a PUBLISH (server side) or a DELIVER (client side)."""
        if op[0] == _PUBLISH:
            if op[1] != self._next_seq:
                self._fail(ErrorCode.MALFORMED, f"publish sequence {op[1]}, expected {self._next_seq}")
            self._next_seq += 1
            self.publish_credit -= 1
            if self.publish_credit < 0:
                self._fail(ErrorCode.CREDIT, "publish beyond the granted publish window")
            if self.publish_bytes <= 0:
                self._fail(ErrorCode.CREDIT, "publish beyond the granted publish window in bytes")
            self.publish_bytes -= len(op[3][M_BODY])
            return
        consumer_id = op[1]
        credit = self.consumer_credit.get(consumer_id)
        if credit is None:
            if self._released_consumers is None or consumer_id not in self._released_consumers:
                self._fail(ErrorCode.UNEXPECTED, f"delivery to unknown consumer {consumer_id}")
        elif credit <= 0:
            self._fail(ErrorCode.CREDIT, f"delivery to consumer {consumer_id} without credit")
        else:
            self.consumer_credit[consumer_id] = credit - 1
            if self.consumer_bytes:
                left = self.consumer_bytes.get(consumer_id)
                if left is not None:
                    if left <= 0:
                        self._fail(ErrorCode.CREDIT, f"delivery to consumer {consumer_id} beyond its bytes")
                    self.consumer_bytes[consumer_id] = left - len(op[3][M_BODY])

    def _check_batched(self, code: int, op: list[Any]) -> None:
        if code in (_PUBLISH, _DELIVER):
            self._check_message(op[3])
            self._count_hot(op)
        elif code == Op.ACK:
            if not all(type(i) is int and 0 <= i <= MAX_FIELD_INT for i in op[3]):
                self._fail(ErrorCode.MALFORMED, "acknowledged message ids must be integers")
        elif not all(type(i) is int and 0 <= i <= MAX_FIELD_INT for i in op[2]) or op[3] not in _NACK_MODES:
            self._fail(ErrorCode.MALFORMED, "nack takes integer message ids and a known mode")

    def _check_message(self, message: Any) -> None:
        problem = check_message(message, self.max_properties)
        if problem is not None:
            self._fail(ErrorCode.MALFORMED, problem)

    def _control_event(self, code: int, op: list[Any]) -> ev.Event | None:
        if code == Op.HEARTBEAT:
            return None
        if code == Op.CHANNEL:
            if op[1] == 0:
                self._fail(ErrorCode.MALFORMED, "channel ids start at 1")
            if not self.carries_channels:
                self._fail(ErrorCode.MALFORMED, "a channel carries no channels")
            if self.channel_data is None:
                self.channel_data = [(op[1], op[2])]
            else:
                self.channel_data.append((op[1], op[2]))
            return None
        if code == Op.CLOSE:
            self.state = _CLOSED
            return ev.Closed(op[1], op[2])
        if code in _SIMPLE_REQUESTS:
            return _SIMPLE_REQUESTS[code](op[1], op[2])
        match code:
            case Op.CREATE_ADDRESS:
                if not all(type(r) is int for r in op[3]):
                    self._fail(ErrorCode.MALFORMED, "routing types are integers")
                return ev.CreateAddress(op[1], op[2], tuple(op[3]))
            case Op.CREATE_QUEUE:
                return ev.CreateQueue(op[1], op[2])
            case Op.SET_WILL:
                return self._set_will_event(op[1], op[2])
            case Op.SUBSCRIBE:
                if op[4] > MAX_CREDIT:
                    self._fail(ErrorCode.MALFORMED, f"credit above {MAX_CREDIT}")
                return ev.Subscribe(op[1], op[2], op[3], op[4], op[5])
            case Op.FLOW:
                if op[2] > MAX_CREDIT:
                    self._fail(ErrorCode.MALFORMED, f"credit above {MAX_CREDIT}")
                return ev.Flow(op[1], op[2], op[3] if len(op) > 3 else 0)
            case Op.OK:
                return ev.Reply(op[1], op[2])
            case Op.ERROR:
                return ev.RequestFailed(op[1], op[2], op[3])
            case Op.CONFIRM:
                if not 0 < op[1] <= op[2] < self._next_seq:
                    self._fail(ErrorCode.MALFORMED, f"confirm of unsent range {op[1]}..{op[2]}")
                return ev.Confirms([(op[1], op[2])])
            case Op.REJECT:
                return ev.Rejected(op[1], op[2], op[3])
            case Op.PUBLISH_CREDIT:
                if op[1] > MAX_CREDIT:
                    self._fail(ErrorCode.MALFORMED, f"credit above {MAX_CREDIT}")
                credit_bytes = op[2] if len(op) > 2 else 0
                self.publish_credit += op[1]
                self.publish_bytes += credit_bytes
                return ev.PublishCreditGranted(op[1], credit_bytes)
            case Op.CONSUMER_CLOSED:
                self.consumer_credit.pop(op[1], None)
                self.consumer_bytes.pop(op[1], None)
                self._released(op[1])
                return ev.ConsumerClosed(op[1], op[2], op[3])
            case Op.BROWSE_DONE:
                if self.version >= MAKE_AND_SUBSCRIBE_VERSION:  # the browser is gone: nothing follows for it
                    self.consumer_credit.pop(op[1], None)
                    self.consumer_bytes.pop(op[1], None)
                return ev.BrowseDone(op[1])
            case Op.TOPOLOGY:
                return ev.Topology(op[1], op[2])
            case Op.TOPOLOGY_UPDATE:
                return ev.TopologyUpdate(op[1])
            case Op.REPLICATE:
                return ev.Replicate(op[1], op[2])
            case Op.VOTE:
                return ev.VoteRequested(op[1], op[2])
            case Op.REPLICA_ACK:
                return ev.ReplicaAck(op[1])
            case Op.REPLICA:
                if op[2] < 1 or not all(type(r) is bytes for r in op[3]):
                    self._fail(ErrorCode.MALFORMED, "replica records are numbered from 1 and are byte strings")
                return ev.ReplicaRecords(op[1], op[2], op[3], op[4])
        raise AssertionError(f"unhandled operation {code}")  # _RECEIVES and this match agree

    def _set_will_event(self, req_id: int, will: dict[str, Any] | None) -> ev.SetWill:
        if will is None:
            return ev.SetWill(req_id, None, None, 0, publish_pending=False)
        key, message = will.get("key"), will.get("message")
        delay_ms, publish_pending = will.get("delay_ms", 0), will.get("publish_pending", False)
        own, retain, everywhere = will.get("own", False), will.get("retain"), will.get("everywhere", False)
        if (
            type(key) is not str
            or (message is not None and type(message) is not list)
            or type(delay_ms) is not int
            or type(publish_pending) is not bool
            or type(own) is not bool
            or type(everywhere) is not bool
            or not (
                retain is None
                or (
                    type(retain) is dict
                    and type(retain.get("address")) is str
                    and type(retain.get("key")) is dict
                    and all(type(name) is str for name in retain["key"])
                )
            )
        ):
            self._fail(
                ErrorCode.MALFORMED,
                "a will is nil or {key: str, message: message or nil, delay_ms: int, publish_pending: bool, own: bool,"
                " retain: {address: str, key: map} or nil, everywhere: bool}",
            )
        kept = None if retain is None else (retain["address"], retain["key"])
        return ev.SetWill(req_id, key, message, delay_ms, publish_pending, own, kept, everywhere)

    def _receive_handshake(self, op: Any, count: int, now: float, events: list[ev.Event]) -> None:
        expected = Op.HELLO if self.role is _SERVER else Op.WELCOME
        if type(op) is list and len(op) == 3 and op[0] == Op.CLOSE and type(op[0]) is int:
            self.state = _CLOSED
            code, text = (v if type(v) is str else "?" for v in op[1:])
            events.append(ev.Closed(code[:MAX_ERROR_TEXT], text[:MAX_ERROR_TEXT]))
            return
        if (
            self.state is not State.HANDSHAKE
            or type(op) is not list
            or not op
            or type(op[0]) is not int
            or op[0] != expected
        ):
            self._fail(ErrorCode.UNEXPECTED, f"expected {expected.name} first, and nothing before the answer")
        if count != 1 and self.role is _SERVER:
            self._fail(ErrorCode.UNEXPECTED, "HELLO travels alone in its frame")
        epoch = 0
        client_host = acting_for = None
        if self.role is _SERVER and len(op) == len(_FIELDS[Op.HELLO]) + 3:  # for a user the gateway vouches for
            acting_for = op.pop()
            if type(acting_for) is not str or not 0 < len(acting_for) <= MAX_CLIENT_HOST:
                self._fail(ErrorCode.MALFORMED, f"HELLO's acting_for is a string of 1 to {MAX_CLIENT_HOST} characters")
        if self.role is _SERVER and len(op) == len(_FIELDS[Op.HELLO]) + 2:  # on behalf of a gateway's client
            client_host = op.pop()
            if type(client_host) is not str or not 0 < len(client_host) <= MAX_CLIENT_HOST:
                self._fail(ErrorCode.MALFORMED, f"HELLO's client_host is a string of 1 to {MAX_CLIENT_HOST} characters")
        publish_bytes = UNBOUNDED_BYTES
        byte_form = self.role is _CLIENT and len(op) == len(_FIELDS[Op.WELCOME]) + 3
        if byte_form:  # version 2: epoch, publish bytes
            publish_bytes = op.pop()
            if type(publish_bytes) is not int or publish_bytes <= 0:
                self._fail(ErrorCode.MALFORMED, "WELCOME's publish bytes are a positive integer")
        if self.role is _CLIENT and len(op) == len(_FIELDS[Op.WELCOME]) + 2:  # with the node's epoch (HA)
            epoch = op.pop()
            if type(epoch) is not int or epoch < 0:
                self._fail(ErrorCode.MALFORMED, "WELCOME's epoch is a non-negative integer")
        self._check_fields(op)
        if self.role is _SERVER:
            _, versions, user, password, client_name, heartbeat_ms, max_frame = op
            common = set(self.versions) & {v for v in versions if type(v) is int}
            if not common:
                self._fail(ErrorCode.VERSION, f"no common protocol version (supported: {list(self.versions)})")
            if max_frame < MIN_FRAME_SIZE:
                self._fail(ErrorCode.INVALID, f"max frame size below {MIN_FRAME_SIZE}")
            self.version = max(common)
            self._fields = _FIELDS_OF_VERSION[self.version]
            self._peer_max_frame = self._peer_max_operation = max_frame
            if self.version >= BYTE_CREDIT_VERSION:  # the client takes frames up to our limit + the headroom
                self._peer_max_operation = max(max_frame, self.max_frame_size + DELIVERY_HEADROOM)
            # The server decides whether heartbeats run: a client cannot switch off dead-peer detection
            # by offering 0, it can only ask for a longer interval.
            if self.heartbeat_ms > 0:
                self.heartbeat_ms = max(self.heartbeat_ms, heartbeat_ms)
            self.state = State.AUTHENTICATING
            events.append(
                ev.HelloReceived(self.version, user, password, client_name, self.heartbeat_ms, client_host, acting_for)
            )
            return  # the heartbeat clock starts at accept(): authentication may take a while
        _, version, node_id, conn_id, heartbeat_ms, max_frame, credit = op
        if (
            version not in self.versions
            or heartbeat_ms < 0
            or credit < 0
            or max_frame < MIN_FRAME_SIZE
            or (version >= BYTE_CREDIT_VERSION) != byte_form
        ):
            self._fail(ErrorCode.INVALID, "WELCOME carries values outside what was offered")
        self.version = version
        self._fields = _FIELDS_OF_VERSION[version]
        self.publish_bytes = publish_bytes
        self._peer_max_frame = self._peer_max_operation = max_frame
        if version >= BYTE_CREDIT_VERSION:  # whatever the server accepted in a publish, it can deliver here
            self.max_frame_size = self._frame_limit = max(self.max_frame_size, max_frame + DELIVERY_HEADROOM)
        self.heartbeat_ms = heartbeat_ms
        self.publish_credit = credit
        self.state = _OPEN
        events.append(ev.Welcomed(version, node_id, conn_id, heartbeat_ms, credit, epoch))
        self._start_heartbeats(now)

    # ------------------------------------------------------------------ timers
    def _start_heartbeats(self, now: float) -> None:
        self._last_recv = self._last_timer = now
        self._next_send_check = now + self.heartbeat_ms / 1000

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must be called next (None: no timer needed)."""
        if self.state is not _OPEN or self.heartbeat_ms <= 0:
            return None
        timeout = self.heartbeat_ms * HEARTBEAT_TIMEOUT_FACTOR / 1000
        return min(self._next_send_check, self._last_recv + timeout)

    def handle_timeout(self, now: float) -> None:
        """Queue a heartbeat if we have been silent; raise if the peer has been silent too long.

        The shell calls it at its deadlines (``next_deadline``, at most an interval apart). With
        ``forgive_own_stalls``, a call more than ``STALL_INTERVALS`` intervals after the one before tells of a
        stall on this side (its event loop busy or paused): what the peer sent meanwhile may be waiting unread,
        so the stall does not count as the peer's silence. That is for a gateway's links: a gateway busy for a
        second must not drop the thousands of sessions its shared link carries, and then again while it
        restores them; and for the links a node accepts: a node in a full garbage collection of a large heap
        must not drop every gateway's. Never for the links a node opens to its peers: a node that was paused
        may have lost its role meanwhile (its backup took over), and their silence is what tells it so on
        waking."""
        if self.state is not _OPEN or self.heartbeat_ms <= 0:
            return
        interval = self.heartbeat_ms / 1000
        if self.forgive_own_stalls and now - self._last_timer > interval * STALL_INTERVALS:
            self._last_recv = max(self._last_recv, now - interval)
        self._last_timer = now
        if now - self._last_recv >= interval * HEARTBEAT_TIMEOUT_FACTOR:
            self._fail(ErrorCode.HEARTBEAT_TIMEOUT, f"nothing received for {now - self._last_recv:.3f} s")
        if now >= self._next_send_check:
            if not self._sent_since_check:
                self._out.append([Op.HEARTBEAT])
            self._sent_since_check = False
            self._next_send_check = now + interval

    # ------------------------------------------------------------------ sending
    @property
    def pending_operations(self) -> int:
        """Operations queued since the last ``data_to_send`` (shells write early past a threshold)."""
        return len(self._out)

    def data_to_send(self) -> bytes:
        """Everything queued since the last call, framed; ``b""`` when there is nothing.

        Frames carry at most ``FRAME_OPERATIONS`` operations: the peer decodes a frame only once all of it
        has arrived, so moderate frames let it work while the rest is still on the wire.
        """
        if not self._out:
            return b""
        ops, self._out = self._out, []
        self._open_confirm = None
        self._sent_since_check = True
        if len(ops) <= FRAME_OPERATIONS:
            return self._frame(ops)
        return b"".join(self._frame(ops[i : i + FRAME_OPERATIONS]) for i in range(0, len(ops), FRAME_OPERATIONS))

    @property
    def max_publish_body(self) -> int:
        """The largest message body a publish to this server fits in its frames with room for the rest."""
        return max(self._peer_max_frame - PUBLISH_HEADROOM, self._peer_max_frame // 2)

    def _frame(self, ops: list[list[Any] | tuple[Any, ...]]) -> bytes:
        payload: bytes = _PACKER.pack(ops)
        if len(payload) <= self._peer_max_frame and len(ops) <= self.max_ops_per_frame:
            return len(payload).to_bytes(HEADER_SIZE, "big") + payload
        if len(ops) == 1:
            if len(payload) <= self._peer_max_operation:
                return len(payload).to_bytes(HEADER_SIZE, "big") + payload
            raise LocalProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"one operation of {len(payload)} bytes exceeds the peer's frame limit {self._peer_max_frame}",
            )
        half = len(ops) // 2
        return self._frame(ops[:half]) + self._frame(ops[half:])

    def close(self, code: str, text: str) -> None:
        """Queue a CLOSE; the caller sends ``data_to_send()`` and then closes the transport."""
        if self.state is not _CLOSED:
            self._out.append([Op.CLOSE, code, text])
            self.state = _CLOSED

    def _fail(self, code: str, text: str) -> NoReturn:
        text = text[:MAX_ERROR_TEXT]
        self._out.append([Op.CLOSE, code, text])
        self.state = _CLOSED
        raise RemoteProtocolError(code, text)

    def _peer_name(self) -> str:
        return "client" if self.role is _SERVER else "server"

    def _require(self, role: Role) -> None:
        if self.state is _OPEN and self.role is role:
            return
        if self.role is not role:
            raise LocalProtocolError(ErrorCode.UNEXPECTED, f"only the {role.value} sends this")
        raise LocalProtocolError(ErrorCode.UNEXPECTED, f"link is {self.state.value}, not open")

    # ------------------------------------------------------------------ server side
    def _answering(self) -> bool:
        """Whether a server answer goes out. A peer's last batch may hold requests followed by its CLOSE:
        the broker still handles them (their messages are routed), but their answers reach no one."""
        if self.state is _CLOSED and self.role is _SERVER:
            return False
        self._require(_SERVER)
        return True

    def accept(
        self,
        node_id: str,
        conn_id: str,
        publish_credit: int,
        now: float,
        epoch: int = 0,
        publish_bytes: int = UNBOUNDED_BYTES,
    ) -> None:
        """Open the link; ``epoch`` (HA) lets a client refuse a copy of ``node_id`` older than one it has seen.
        ``publish_bytes`` is the publish window in body bytes (version 2; a version 1 link has none)."""
        if self.role is not _SERVER or self.state is not State.AUTHENTICATING:
            raise LocalProtocolError(ErrorCode.UNEXPECTED, "accept() answers a HELLO")
        if publish_bytes <= 0:
            raise ValueError("publish_bytes must be positive")
        self.publish_credit = publish_credit
        self.state = _OPEN
        self._frame_limit = self.max_frame_size
        self._start_heartbeats(now)
        welcome = [Op.WELCOME, self.version, node_id, conn_id, self.heartbeat_ms, self.max_frame_size, publish_credit]
        if self.version >= BYTE_CREDIT_VERSION:
            self.publish_bytes = self.publish_window_bytes = min(publish_bytes, UNBOUNDED_BYTES)
            welcome += [epoch, self.publish_bytes]
        elif epoch:
            welcome.append(epoch)
        self._out.append(welcome)

    def refuse(self, code: str, text: str) -> None:
        if self.role is not _SERVER or self.state is not State.AUTHENTICATING:
            raise LocalProtocolError(ErrorCode.UNEXPECTED, "refuse() answers a HELLO")
        self.close(code, text)

    def reply(self, req_id: int, result: Any = None) -> None:
        if not self._answering():
            return
        self._out.append([Op.OK, req_id, result])

    def error(self, req_id: int, code: str, text: str) -> None:
        if not self._answering():
            return
        self._out.append([Op.ERROR, req_id, code, text])

    def confirm(self, seq: int) -> None:
        """Confirm one publish; consecutive confirms merge into one range operation."""
        open_range = self._open_confirm
        if open_range is not None and open_range[2] + 1 == seq:
            open_range[2] = seq
            return
        if not self._answering():
            return
        self._open_confirm = [_CONFIRM, seq, seq]
        self._out.append(self._open_confirm)

    def reject(self, seq: int, code: str, text: str) -> None:
        if not self._answering():
            return
        self._out.append([Op.REJECT, seq, code, text])

    def grant_publish_credit(self, credit: int) -> None:
        """``credit`` more publishes; on a version 2 link the byte credit is also topped up to the window."""
        if not self._answering():
            return
        if self.version < BYTE_CREDIT_VERSION:
            if credit > 0:
                self.publish_credit += credit
                self._out.append([Op.PUBLISH_CREDIT, credit])
            return
        top_up = self.publish_window_bytes - self.publish_bytes
        if credit > 0 or top_up > 0:
            self.publish_credit += credit
            self.publish_bytes += top_up
            self._out.append([Op.PUBLISH_CREDIT, credit, top_up])

    def deliver(self, consumer_id: int, delivery_count: int, message: WireMessage) -> None:
        if (self.state is not _OPEN or self.role is not _SERVER) and not self._answering():
            return
        self._out.append((_DELIVER, consumer_id, delivery_count, message))

    def consumer_closed(self, consumer_id: int, code: str, text: str) -> None:
        if not self._answering():
            return
        self._out.append([Op.CONSUMER_CLOSED, consumer_id, code, text])

    def browse_done(self, consumer_id: int) -> None:
        if not self._answering():
            return
        self._out.append([Op.BROWSE_DONE, consumer_id])

    def topology_update(self, update: dict[str, Any]) -> None:
        if not self._answering():
            return
        self._out.append([Op.TOPOLOGY_UPDATE, update])

    def replica(self, epoch: int, first: int, records: list[bytes], sync_end: int) -> None:
        """Journal records ``first``… for a backup; ``sync_end`` (0 until known) is the record whose receipt
        completes its initial synchronisation."""
        if not self._answering():
            return
        self._out.append([Op.REPLICA, epoch, first, records, sync_end])

    # ------------------------------------------------------------------ both sides
    def channel(self, channel_id: int, data: bytes) -> None:
        """Queue bytes of channel ``channel_id``'s stream (``b""``: the channel is closed from this side and
        gone on both: a session multiplexed over this link ends)."""
        if self.state is not _OPEN:
            raise LocalProtocolError(ErrorCode.UNEXPECTED, f"link is {self.state.value}, not open")
        self._out.append((Op.CHANNEL, channel_id, data))

    # ------------------------------------------------------------------ client side
    def hello(
        self,
        user: str | None,
        password: str | None,
        client_name: str,
        client_host: str | None = None,
        acting_for: str | None = None,
    ) -> None:
        """Open the link; ``client_host`` is the address of the client a gateway opens it for, ``acting_for``
        the user that client proved to be by other means than a password (its TLS certificate), for whom
        ``user`` (the gateway's own) opens the link."""
        if self.role is not _CLIENT or self.state is not State.HANDSHAKE or self._hello_sent:
            raise LocalProtocolError(ErrorCode.UNEXPECTED, "hello() opens a client link, once")
        self._hello_sent = True
        hello = [Op.HELLO, list(self.versions), user, password, client_name, self.heartbeat_ms, self.max_frame_size]
        if client_host or acting_for:
            hello.append(client_host or "?")
        if acting_for:
            hello.append(acting_for)
        self._out.append(hello)

    def _request(self, op: Op, *fields: Any) -> int:
        self._require(_CLIENT)
        self._next_req_id += 1
        self._out.append([op, self._next_req_id, *fields])
        return self._next_req_id

    def topology(self, info: dict[str, Any]) -> int:
        return self._request(Op.TOPOLOGY, info)

    def replicate(self, info: dict[str, Any]) -> int:
        return self._request(Op.REPLICATE, info)

    def vote(self, request: dict[str, Any]) -> int:
        return self._request(Op.VOTE, request)

    def replica_ack(self, upto: int) -> None:
        self._require(_CLIENT)
        self._out.append([Op.REPLICA_ACK, upto])

    def create_address(self, address: str, routing_types: list[int]) -> int:
        return self._request(Op.CREATE_ADDRESS, address, routing_types)

    def delete_address(self, address: str) -> int:
        return self._request(Op.DELETE_ADDRESS, address)

    def create_queue(self, spec: dict[str, Any]) -> int:
        return self._request(Op.CREATE_QUEUE, spec)

    def delete_queue(self, queue: str, *, everywhere: bool = False) -> int:
        """With ``everywhere`` (a version 3 link), its namesakes on the other nodes of the cluster go too."""
        if everywhere and self.version >= EVERYWHERE_VERSION:
            return self._request(Op.DELETE_QUEUE_EVERYWHERE, queue)
        return self._request(Op.DELETE_QUEUE, queue)

    def set_will(self, will: dict[str, Any] | None) -> int:
        """``will``: None, or {"key", "message", "delay_ms", "publish_pending", "own", "retain", "everywhere"}
        (docs/link-protocol.md)."""
        return self._request(Op.SET_WILL, will)

    def subscribe(
        self, queue: str, credit: int, options: dict[str, Any] | None = None, credit_bytes: int = 0
    ) -> tuple[int, int]:
        """Returns (req_id, consumer_id). ``credit_bytes`` > 0 bounds the window in body bytes too (from
        version 2; a version 1 server knows no byte credit and the window is then in messages only)."""
        self._require(_CLIENT)
        consumer_id = self._next_consumer_id
        self._next_consumer_id += 1
        if self.consumer_credit is _NO_CONSUMERS:
            self.consumer_credit = {}
        self.consumer_credit[consumer_id] = credit
        options = options or {}
        if credit_bytes > 0 and self.version >= BYTE_CREDIT_VERSION:
            options = {**options, "credit_bytes": credit_bytes}
            if self.consumer_bytes is _NO_CONSUMERS:
                self.consumer_bytes = {}
            self.consumer_bytes[consumer_id] = credit_bytes
        return self._request(Op.SUBSCRIBE, consumer_id, queue, credit, options), consumer_id

    def unsubscribe(self, consumer_id: int) -> int:
        # Deliveries already on their way stay legal; the server requeues what we do not ack.
        self.consumer_bytes.pop(consumer_id, None)
        if self.consumer_credit.pop(consumer_id, None) is not None:
            self._released(consumer_id)
        return self._request(Op.UNSUBSCRIBE, consumer_id)

    def not_subscribed(self, consumer_id: int) -> None:
        """The node made no consumer for this SUBSCRIBE (a version 4 one whose ``if`` its queue did not meet)."""
        self.consumer_credit.pop(consumer_id, None)
        self.consumer_bytes.pop(consumer_id, None)

    def _released(self, consumer_id: int) -> None:
        """A consumer gone: deliveries to it that were already on their way stay legal."""
        if self._released_consumers is None:
            self._released_consumers = set()
        self._released_consumers.add(consumer_id)

    def new_tx_id(self) -> int:
        self._next_tx_id += 1
        return self._next_tx_id - 1

    def tx_begin(self, tx_id: int) -> int:
        return self._request(Op.TX_BEGIN, tx_id)

    def tx_commit(self, tx_id: int) -> int:
        return self._request(Op.TX_COMMIT, tx_id)

    def tx_rollback(self, tx_id: int) -> int:
        return self._request(Op.TX_ROLLBACK, tx_id)

    @property
    def can_publish(self) -> bool:
        """Whether the publish window has room: messages and, from version 2, bytes."""
        return self.publish_credit > 0 and self.publish_bytes > 0

    def publish(self, message: WireMessage, tx_id: int = 0) -> int:
        """Queue a publish within the granted window; returns its sequence number."""
        if self.publish_credit <= 0 or self.publish_bytes <= 0:
            raise LocalProtocolError(ErrorCode.CREDIT, "no publish credit: wait for PUBLISH_CREDIT")
        if self.state is not _OPEN or self.role is not _CLIENT:
            self._require(_CLIENT)
        self.publish_credit -= 1
        self.publish_bytes -= len(message[M_BODY])
        seq = self._next_seq
        self._next_seq += 1
        self._out.append((_PUBLISH, seq, tx_id, message))
        return seq

    def ack(self, consumer_id: int, message_ids: list[int], tx_id: int = 0) -> None:
        self._require(_CLIENT)
        self._out.append([Op.ACK, consumer_id, tx_id, message_ids])

    def nack(self, consumer_id: int, message_ids: list[int], mode: NackMode = NackMode.REDELIVER) -> None:
        self._require(_CLIENT)
        self._out.append([Op.NACK, consumer_id, message_ids, int(mode)])

    def flow(self, consumer_id: int, credit: int, credit_bytes: int = 0) -> None:
        """``credit`` more deliveries and, for a consumer subscribed with ``credit_bytes``, that many bytes."""
        self._require(_CLIENT)
        if consumer_id not in self.consumer_credit or (credit <= 0 and credit_bytes <= 0):
            return
        self.consumer_credit[consumer_id] += credit
        if self.version < BYTE_CREDIT_VERSION:
            if credit > 0:
                self._out.append([Op.FLOW, consumer_id, credit])
            return
        if consumer_id in self.consumer_bytes:
            self.consumer_bytes[consumer_id] += credit_bytes
        else:
            credit_bytes = 0
        self._out.append([Op.FLOW, consumer_id, credit, credit_bytes])
