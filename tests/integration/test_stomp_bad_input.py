"""Bad input at the STOMP gateway, against real gateway and core processes over real sockets.

The requirement: garbage, truncated frames, huge headers, a slow reader and a flood of SENDs without receipts
get clear ERROR frames, the gateway's memory stays bounded (back-pressure through the core's credit reaches
the producer's TCP connection) and other connections do not notice. The plain bad-frame table lives in
test_stomp_gateway.py; this module covers what needs streams, several connections or the process's memory.

Memory is the gateway process's VmRSS, sampled every few milliseconds in a thread while the traffic runs.
"""

from __future__ import annotations

import asyncio
import json
import random
import select
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import websocket
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    module_core,
    module_stomp_gateway,
    shared,
    start_core,
    start_gateway,
    stop_cleanly,
    stop_core_cleanly,
)
from tests.memory import PeakRss

pytestmark = pytest.mark.integration

WAIT = 10.0  # generous: every wait below ends as soon as its condition holds
MIB = 1024 * 1024
# The bound on the gateway's RSS growth during one test. What it may legitimately hold: for a stalled
# subscription its prefetch (1000 messages) handed to the client's socket plus as many again in its link
# buffer (2 x 8 MB with the 8 KiB bodies used here), their encoded copies, up to 1000 parsed client frames
# waiting for credit (stomp.pending_frames), and the allocator's and the interpreter's slack. Measured: about
# 45 MB for the slow consumer, under 10 MB for the floods. 150 MB leaves room for a slower machine and is
# still below what holding a test's whole input costs where that is the failure looked for (the streamed
# inputs go on until they pass it; 200 000 parsed SEND frames are ~200 MB of Python objects). Where the
# traffic is smaller than the bound (the slow consumer's 40 MB) the queue depth is the evidence instead.
RSS_BOUND = 150 * MIB
CONNECT = b"CONNECT\naccept-version:1.2\nhost:anything\n\n\x00"
DISCONNECT = b"DISCONNECT\nreceipt:bye\n\n\x00"
SMALL_FRAME = 64 * 1024  # the limits of the `small` gateway
SMALL_HEADERS = 8
SMALL_HEADER_BYTES = 4096


# ------------------------------------------------------------------------------------------------ helpers
@dataclass
class Frame:
    command: str
    headers: dict[str, str]
    body: bytes


class FrameBuffer:
    """Server frames out of the bytes read so far (an offset rather than a copy per frame: a drain reads
    hundreds of thousands of them)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.pos = 0

    def feed(self, chunk: bytes) -> None:
        del self.data[: self.pos]
        self.pos = 0
        self.data += chunk

    def rest(self) -> bytes:
        return bytes(self.data[self.pos :])

    def take(self) -> Frame | None:
        """The next complete frame (None: not all of it is here yet)."""
        data = self.data
        start = self.pos
        while start < len(data) and data[start] in b"\r\n":  # heart-beats
            start += 1
        head_end = data.find(b"\n\n", start)
        if head_end == -1:
            return None
        lines = bytes(data[start:head_end]).decode("utf-8").split("\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.removesuffix("\r").partition(":")
            headers.setdefault(name, value)
        body_start = head_end + 2
        if "content-length" in headers:
            body_end = body_start + int(headers["content-length"])
            if len(data) <= body_end:
                return None
            assert data[body_end] == 0, "a server frame's body is not followed by a NUL"
        else:
            body_end = data.find(b"\x00", body_start)
            if body_end == -1:
                return None
        self.pos = body_end + 1
        return Frame(lines[0].removesuffix("\r"), headers, bytes(data[body_start:body_end]))


def frames_of(data: bytes) -> list[Frame]:
    buffer = FrameBuffer()
    buffer.feed(data)
    frames = []
    while (frame := buffer.take()) is not None:
        frames.append(frame)
    assert not buffer.rest().strip(b"\r\n"), f"trailing bytes after the last frame: {buffer.rest()[:200]!r}"
    return frames


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed: it may follow the last frame
    when the server closes with our bytes unread). A server that never closes fails on the socket timeout."""
    data = b""
    for _ in range(1_000_000):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError("the server kept sending")


class Peer:
    """A raw STOMP client socket that reads whole frames."""

    def __init__(self, port: int, *, receive_buffer: int | None = None, send_buffer: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Small kernel buffers keep what the kernel holds out of the picture (set before connect(), so the
        # window the peer sees is small from the start).
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        if send_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.sock.settimeout(WAIT)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = FrameBuffer()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self) -> Frame:
        for _ in range(1_000_000):
            frame = self.buffer.take()
            if frame is not None:
                return frame
            chunk = self.sock.recv(256 * 1024)
            assert chunk, f"the server closed; unparsed: {self.buffer.rest()[:200]!r}"
            self.buffer.feed(chunk)
        raise AssertionError("no frame")

    def expect(self, command: str) -> Frame:
        frame = self.frame()
        assert frame.command == command, f"expected {command}, got {frame}"
        return frame

    def connect(self) -> Frame:
        self.send(CONNECT)
        return self.expect("CONNECTED")

    def reset(self) -> None:
        """Close with a TCP reset instead of a FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=WAIT) as response:
        return json.loads(response.read())


def queue_stats(core: CoreProcess, name: str) -> dict[str, Any] | None:
    """The core's view of a queue (None: it does not exist)."""
    try:
        return get_json(f"{core.management_url}/api/queues/{urllib.parse.quote(name, safe='')}")  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            return None
        raise


def depth(core: CoreProcess, name: str) -> int:
    stats = queue_stats(core, name)
    return 0 if stats is None else int(stats["depth"])


def link_connections(core: CoreProcess) -> int:
    """The core's sessions of clients: a gateway's own links (readiness, and the shared link that carries its
    clients' sessions) stay open throughout."""
    links = get_json(f"{core.management_url}/api/connections")
    return sum(1 for link in links if not str(link.get("client_name", "")).endswith((" readiness", " sessions")))


class GatewayRss(PeakRss):
    """The gateway's VmRSS growth over its value on entry, sampled in a thread until exit."""

    def __init__(self, gateway: GatewayProcess) -> None:
        super().__init__(gateway.process.pid, limit_s=120)

    def over(self) -> bool:
        return self.growth > RSS_BOUND

    def check(self) -> None:
        assert not self.over(), f"the gateway's RSS grew by {self.growth / MIB:.0f} MB (bound {RSS_BOUND // MIB} MB)"


@dataclass
class Writer:
    """Writes ``chunks`` to a socket from a thread, as fast as the socket takes them, until they are all
    written, the peer closes, ``stop`` is set, or ``give_up`` says so (checked between writes)."""

    sock: socket.socket
    chunks: Sequence[bytes] | Iterator[bytes]
    give_up: Callable[[], bool] = lambda: False
    sent: int = 0
    blocked: int = 0  # times the socket could not take more: the reader is behind (TCP back-pressure)
    error: OSError | None = None
    last_progress: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Writer:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        try:
            for chunk in self.chunks:
                view = memoryview(chunk)
                while view:
                    if self.stop.is_set() or self.give_up() or time.monotonic() > deadline:
                        return
                    _, writable, _ = select.select([], [self.sock], [], 0)
                    if not writable:
                        self.blocked += 1
                        select.select([], [self.sock], [], 0.05)
                        continue
                    count = self.sock.send(view)
                    view = view[count:]
                    self.sent += count
                    self.last_progress = time.monotonic()
        except OSError as exc:  # the gateway closed the connection
            self.error = exc
        finally:
            self.done.set()

    def stalled(self, seconds: float) -> bool:
        return not self.done.is_set() and time.monotonic() - self.last_progress >= seconds

    def finish(self) -> None:
        self.stop.set()
        assert self.done.wait(WAIT), "the writer thread did not stop"


def assert_gateway_serves(gateway: GatewayProcess, queue: str) -> None:
    """The gateway process is alive and a fresh connection can subscribe, send with a receipt and receive."""
    assert gateway.process.poll() is None, f"the gateway died:\n{gateway.log()}"
    with Peer(gateway.port) as peer:
        peer.connect()
        peer.send(f"SUBSCRIBE\nid:0\ndestination:/queue/{queue}\nack:auto\nreceipt:sub\n\n\x00".encode())
        assert peer.expect("RECEIPT").headers["receipt-id"] == "sub"
        peer.send(f"SEND\ndestination:/queue/{queue}\nreceipt:sent\n\nstill fine\x00".encode())
        frames = [peer.frame(), peer.frame()]  # the RECEIPT and the MESSAGE, in either order
        assert sorted(f.command for f in frames) == ["MESSAGE", "RECEIPT"], frames
        message = next(f for f in frames if f.command == "MESSAGE")
        assert (message.body, message.headers["destination"]) == (b"still fine", f"/queue/{queue}")
        peer.send(DISCONNECT)
        assert peer.expect("RECEIPT").headers["receipt-id"] == "bye"


def assert_error_then_close(reply: bytes, message: str | None = None, *, connected: bool) -> Frame:
    """``reply`` (everything up to the server's close) is CONNECTED if ``connected``, then one ERROR frame
    with a ``message`` header (equal to ``message`` when given) and a plain-text body."""
    frames = frames_of(reply)
    commands = [f.command for f in frames]
    assert commands == (["CONNECTED", "ERROR"] if connected else ["ERROR"]), reply[:500]
    error = frames[-1]
    assert error.headers.get("message"), error
    if message is not None:
        assert error.headers["message"] == message, error
    assert error.body, "the ERROR frame says nothing about what was wrong"
    return error


# One core and one gateway for the module's light tests (each keeps to destinations of its own); the tests
# that push tens of megabytes through, or measure the gateway's memory, take a core and a gateway of their own
# (``heavy``), so that what they leave behind weighs on no other test.
core = module_core
stomp_gateway = module_stomp_gateway


@pytest.fixture
def gateway(stomp_gateway: GatewayProcess) -> GatewayProcess:
    return stomp_gateway


@dataclass
class Heavy:
    core: CoreProcess
    gateway: GatewayProcess


@pytest.fixture
def heavy(tmp_path: Path) -> Iterator[Heavy]:
    node = start_core(tmp_path)
    gateway = start_gateway(tmp_path, node)
    yield Heavy(node, gateway)
    stop_cleanly(gateway)
    stop_core_cleanly(node)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess) -> Iterator[GatewayProcess]:
    """A gateway with small limits, so that going past them takes little traffic."""
    gateway = shared(
        start_gateway(
            tmp_path_factory.mktemp("small"),
            core,
            name="small",
            TRIDENTMQ_STOMP_STOMP_MAX_FRAME_BYTES=str(SMALL_FRAME),
            TRIDENTMQ_STOMP_STOMP_MAX_HEADERS=str(SMALL_HEADERS),
            TRIDENTMQ_STOMP_STOMP_MAX_HEADER_BYTES=str(SMALL_HEADER_BYTES),
        )
    )
    yield gateway
    stop_cleanly(gateway)


def exchange(gateway: GatewayProcess, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


def garbage(size: int, seed: int) -> bytes:
    """Random bytes with no CR or LF in them (so they hold no frame boundary), the same on every run."""
    return bytes(b for b in random.Random(seed).randbytes(size * 2) if b not in b"\r\n")[:size]


# ------------------------------------------------------------------------------------------------ 1. garbage
#: name: (bytes sent, whether a CONNECTED comes first, the ERROR's message)
GARBAGE: dict[str, tuple[bytes, bool, str]] = {
    "random-bytes-instead-of-connect": (garbage(4000, 1) + b"\n\n\x00", False, "malformed frame"),
    "random-bytes-after-connect": (CONNECT + garbage(4000, 2) + b"\n\n\x00", True, "malformed frame"),
    "http-request": (b"GET /stomp HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n\r\n", False, "malformed frame"),
    "lower-case-command": (b"connect\naccept-version:1.2\n\n\x00", False, "malformed frame"),
    "non-utf8-connect-header": (b"CONNECT\naccept-version:1.2\nlogin:\xc3\x28\n\n\x00", False, "malformed frame"),
    "non-utf8-send-header": (
        CONNECT + b"SEND\ndestination:/queue/g\nx:\xff\xfe\x00\n\nbody\x00",
        True,
        "malformed frame",
    ),
    "control-bytes-header-line": (
        CONNECT + b"SEND\ndestination:/queue/g\n\x01\x02\x7f\n\nbody\x00",
        True,
        "malformed frame",
    ),
    "stray-cr-between-frames": (CONNECT + b"\rSEND\ndestination:/queue/g\n\nbody\x00", True, "malformed frame"),
    "non-ascii-command": (CONNECT + "SÉND\ndestination:/queue/g\n\nbody\x00".encode(), True, "unknown command"),
}


@pytest.mark.parametrize(
    ("data", "connected", "message"), [pytest.param(*case, id=name) for name, case in GARBAGE.items()]
)
def test_garbage_gets_an_error_frame_and_a_close_and_nothing_else_notices(
    gateway: GatewayProcess, core: CoreProcess, data: bytes, connected: bool, message: str
) -> None:
    with Peer(gateway.port) as bystander:  # a connection already open when the garbage arrives
        bystander.connect()
        assert_error_then_close(exchange(gateway, data), message, connected=connected)
        bystander.send(b"SEND\ndestination:/queue/bystander\nreceipt:r\n\nx\x00")
        assert bystander.expect("RECEIPT").headers["receipt-id"] == "r"
    assert depth(core, "g") == 0  # nothing of a refused frame was published
    assert_gateway_serves(gateway, "after-garbage")


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b"FLY\n\n\x00", id="unknown-command"),  # refused once parsed
        pytest.param(garbage(100, 6) + b"\n\n\x00", id="random-bytes"),  # refused by the parser
    ],
)
def test_frames_before_the_garbage_are_handled_and_answered_before_the_error(
    gateway: GatewayProcess, core: CoreProcess, bad: bytes
) -> None:
    """A client pipelines a good SEND and then garbage, in one write. The SEND came first: it is published
    and its RECEIPT comes back before the ERROR, so the client knows it need not send it again."""
    queue = f"before-{uuid.uuid4().hex[:8]}"
    reply = exchange(
        gateway, CONNECT + b"SEND\ndestination:/queue/%s\nreceipt:good\n\nfirst\x00" % queue.encode() + bad
    )
    wait_for(lambda: link_connections(core) == 0, "the session's link to close")
    assert depth(core, queue) == 1, "the SEND before the bad frame was not published"
    frames = frames_of(reply)
    answers = [(f.command, f.headers.get("receipt-id")) for f in frames]
    assert answers == [("CONNECTED", None), ("RECEIPT", "good"), ("ERROR", None)], frames


def test_garbage_without_any_frame_boundary_is_refused_at_once(gateway: GatewayProcess) -> None:
    """Bytes that cannot begin a STOMP frame (a TLS ClientHello, a NUL, binary noise holding no EOL) get an
    ERROR as soon as they arrive. The gateway must not sit waiting for a blank line that may never come:
    until CONNECT there is no heart-beat to end the wait, so such a client would hold its socket forever."""
    hello = bytes.fromhex("160301020001000001fc0303") + garbage(500, 3)  # what a TLS client says first
    cases = {
        "tls-client-hello": hello,
        "a-nul": b"\x00",
        "binary-noise-after-connect": CONNECT + garbage(2000, 4),
    }
    deadline = time.monotonic() + WAIT
    sockets = {name: socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT) for name in cases}
    unanswered = []
    try:
        for name, data in cases.items():
            sockets[name].sendall(data)
        for name, sock in sockets.items():
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                reply = read_until_closed(sock)
            except TimeoutError:
                unanswered.append(name)
                continue
            assert_error_then_close(reply, connected=name.endswith("after-connect"))
    finally:
        for sock in sockets.values():
            sock.close()
    assert not unanswered, f"no ERROR and no close within {WAIT} s for: {', '.join(unanswered)}"
    assert_gateway_serves(gateway, "after-noise")


# ------------------------------------------------------------------------------------------------ 2. truncated
TRUNCATED = {
    "headers-only": b"SEND\ndestination:/queue/{q}\nreceipt:t\n",
    "half-a-header": b"SEND\ndestination:/queue/{q}\nreceip",
    "body-without-nul": b"SEND\ndestination:/queue/{q}\nreceipt:t\n\nhalf a bo",
    "content-length-cut-short": b"SEND\ndestination:/queue/{q}\ncontent-length:100\nreceipt:t\n\n" + b"x" * 50,
    "content-length-body-no-nul": b"SEND\ndestination:/queue/{q}\ncontent-length:5\n\nhello",
    "crlf-cut": b"SEND\r\ndestination:/queue/{q}\r\n\r",
    "mid-escape": b"SEND\ndestination:/queue/{q}\nkey\\",
    "commit-cut": b"BEGIN\ntransaction:t\n\n\x00SEND\ndestination:/queue/{q}\ntransaction:t\n\nin tx\x00"
    b"COMMIT\ntransaction:t\n",
}


def test_truncated_frames_publish_nothing(gateway: GatewayProcess, core: CoreProcess) -> None:
    """A client sends the start of a frame and goes away, closing cleanly (FIN) or with a reset (RST)."""
    queues = []
    for close in ("fin", "rst"):
        for name, template in TRUNCATED.items():
            queue = f"trunc.{close}.{name}"
            queues.append(queue)
            peer = Peer(gateway.port)
            peer.connect()
            peer.send(template.replace(b"{q}", queue.encode()))
            if close == "fin":
                peer.sock.shutdown(socket.SHUT_WR)
                assert read_until_closed(peer.sock) == b"", f"{queue}: the gateway answered a cut frame"
                peer.sock.close()
            else:
                peer.reset()
    # Each STOMP connection has its own link to the core: once they are all gone every session has ended,
    # and anything it had published would be in its queue by now.
    wait_for(lambda: link_connections(core) == 0, "every session's link to close")
    published = {queue: depth(core, queue) for queue in queues}
    assert not any(published.values()), published
    assert "Traceback" not in gateway.log(), gateway.log()
    assert_gateway_serves(gateway, "after-truncation")


# ------------------------------------------------------------------------------------------------ 3. huge
def stream_until_cut(gateway: GatewayProcess, start: bytes, filler: bytes, total: int) -> tuple[bytes, Writer]:
    """Send ``start`` then ``filler`` over and over (at most ``total`` bytes, never a frame's end) while
    reading what comes back until the gateway closes."""
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT)
    try:
        sock.sendall(start)
        writer = Writer(sock, [filler] * (total // len(filler))).start()
        reply = read_until_closed(sock)
        assert writer.done.wait(WAIT), "the writer is still writing to a connection the gateway closed"
        return reply, writer
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("start", "filler"),
    [
        pytest.param(b"SEND\ndestination:/queue/huge\nx-huge:", b"a" * 65536, id="one-endless-header-line"),
        pytest.param(b"SEND\ndestination:/queue/huge\n", b"h:v\n" * 16384, id="endless-header-lines"),
        pytest.param(b"SEND\ndestination:/queue/huge\n\n", b"b" * 65536, id="endless-body-without-length"),
    ],
)
def test_an_endless_frame_is_cut_off_with_frame_too_large(
    small: GatewayProcess, core: CoreProcess, start: bytes, filler: bytes
) -> None:
    total = 256 * MIB  # the bound of the stream: far more than the gateway may read of one frame
    with GatewayRss(small) as memory:
        reply, writer = stream_until_cut(small, CONNECT + start, filler, total)
    assert_error_then_close(reply, "frame too large", connected=True)
    assert writer.sent < total // 4, f"the gateway read {writer.sent / MIB:.0f} MB of one frame before closing"
    assert writer.error is not None, "the connection was not closed under the writer"
    memory.check()
    assert depth(core, "huge") == 0
    assert_gateway_serves(small, "after-huge")


def test_the_header_count_limit_is_exact(small: GatewayProcess) -> None:
    def send_with(count: int) -> bytes:
        lines = ["destination:/queue/counted", "receipt:r"] + [f"h{n}:v" for n in range(count - 2)]
        return CONNECT + ("SEND\n" + "\n".join(lines) + "\n\nx\x00").encode() + DISCONNECT

    at_limit = frames_of(exchange(small, send_with(SMALL_HEADERS)))
    assert [f.command for f in at_limit] == ["CONNECTED", "RECEIPT", "RECEIPT"], at_limit
    error = assert_error_then_close(exchange(small, send_with(SMALL_HEADERS + 1)), "frame too large", connected=True)
    assert f"more than {SMALL_HEADERS} headers" in error.body.decode()


def test_headers_at_the_byte_limit_are_accepted_however_the_bytes_arrive(small: GatewayProcess) -> None:
    """``max_header_bytes`` counts the command and header lines. A head of exactly that size is accepted
    when it arrives in one piece, and must be when TCP splits it right after the last header's EOL too."""
    head = b"SEND\ndestination:/queue/exact\nreceipt:r\nx-pad:"
    head += b"p" * (SMALL_HEADER_BYTES - len(head))
    assert len(head) == SMALL_HEADER_BYTES
    whole = frames_of(exchange(small, CONNECT + head + b"\n\nbody\x00" + DISCONNECT))
    assert [f.command for f in whole] == ["CONNECTED", "RECEIPT", "RECEIPT"], whole
    with Peer(small.port) as peer:
        peer.connect()
        # The SEND before it makes the gateway read, parse and answer the first piece before the second is sent.
        peer.send(b"SEND\ndestination:/queue/exact\nreceipt:first\n\nx\x00" + head + b"\n")
        assert peer.frame() == Frame("RECEIPT", {"receipt-id": "first"}, b""), "the split head was refused"
        peer.send(b"\nbody\x00" + DISCONNECT)
        assert [peer.frame().command, peer.frame().command] == ["RECEIPT", "RECEIPT"]


def test_a_body_over_the_limit_is_refused_even_when_its_nul_arrives_with_it(
    small: GatewayProcess, core: CoreProcess
) -> None:
    """Without content-length the body runs to the first NUL; ``max_frame_bytes`` caps it whether the NUL is
    in the same read as the rest or not. A body of exactly the limit is fine."""
    exact = frames_of(
        exchange(
            small,
            CONNECT + b"SEND\ndestination:/queue/capped\nreceipt:r\n\n" + b"e" * SMALL_FRAME + b"\x00" + DISCONNECT,
        )
    )
    assert [f.command for f in exact] == ["CONNECTED", "RECEIPT", "RECEIPT"], exact
    reply = exchange(
        small,
        CONNECT + b"SEND\ndestination:/queue/capped\nreceipt:r\n\n" + b"o" * (SMALL_FRAME + 1) + b"\x00" + DISCONNECT,
    )
    wait_for(lambda: link_connections(core) == 0, "every session's link to close")
    published = depth(core, "capped") - 1  # the body of exactly the limit is in the queue
    assert_error_then_close(reply, "frame too large", connected=True)
    assert published == 0, "a body over max_frame_bytes was published"


# ------------------------------------------------------------------------------------------------ 4. slow reader
BODY = 8 * 1024
SLOW_COUNT = 5000  # 40 MB through one subscription


def produce(gateway: GatewayProcess, queue: str, count: int) -> None:
    """``count`` SENDs of BODY bytes numbered in their first 8 bytes; returns once the core confirmed them all."""
    padding = b"." * (BODY - 8)
    template = b"SEND\ndestination:/queue/" + queue.encode() + b"\ncontent-length:%d\n\n" % BODY + b"%08d%s\x00"
    with Peer(gateway.port) as producer:
        producer.connect()
        for first in range(0, count, 500):
            numbers = range(first, min(first + 500, count))
            producer.send(b"".join(template % (n, padding) for n in numbers))
        producer.send(DISCONNECT)  # its receipt comes once every SEND before it is confirmed
        assert producer.expect("RECEIPT").headers["receipt-id"] == "bye"


@pytest.mark.parametrize("ack", ["auto", "client-individual"])
def test_a_consumer_that_stops_reading_leaves_the_messages_in_the_core(heavy: Heavy, ack: str) -> None:
    core, gateway = heavy.core, heavy.gateway
    assert_gateway_serves(gateway, "warm-up")  # the baseline includes everything a connection loads
    slow = Peer(gateway.port, receive_buffer=64 * 1024)
    try:
        slow.connect()
        slow.send(f"SUBSCRIBE\nid:slow\ndestination:/queue/slow\nack:{ack}\nreceipt:sub\n\n\x00".encode())
        assert slow.expect("RECEIPT").headers["receipt-id"] == "sub"
        with GatewayRss(gateway) as memory:  # from here on the slow consumer reads nothing
            produce(gateway, "slow", SLOW_COUNT)
            stats = queue_stats(core, "slow")
            assert stats is not None
            # Out of the queue at most: the prefetch (1000) handed to the client's socket (the gateway's write
            # buffer and the kernel's, ~4 MB of it) and as many again in the gateway's link buffer.
            assert stats["depth"] >= SLOW_COUNT - 2500, f"the gateway pulled the queue empty: {stats}"
            assert_gateway_serves(gateway, "meanwhile")  # another connection does not notice
            memory.check()
        if ack == "auto":  # now it reads: every message arrives, in order
            numbers = []
            for _ in range(SLOW_COUNT):
                message = slow.expect("MESSAGE")
                assert len(message.body) == BODY
                numbers.append(int(message.body[:8]))
            assert numbers == list(range(SLOW_COUNT))
            wait_for(lambda: depth(core, "slow") == 0, "the queue to be empty")
        else:  # it dies with everything unacknowledged: every message goes back to the queue
            slow.reset()
            wait_for(lambda: depth(core, "slow") == SLOW_COUNT, f"all {SLOW_COUNT} messages back in the queue")
    finally:
        slow.sock.close()
    assert_gateway_serves(gateway, "afterwards")


def test_a_producer_that_never_reads_its_receipts_is_held_back(heavy: Heavy) -> None:
    """A slow reader on the other side: it sends SENDs with receipts (8 KiB receipt ids, well within the
    header limits) and never reads. The RECEIPT frames must not pile up in the gateway: it should stop
    reading the client once its own output to it is backed up, so the writer ends up blocked."""
    gateway = heavy.gateway
    assert_gateway_serves(gateway, "warm-up")
    receipt = "r" * 8192
    chunks = (
        b"".join(
            b"SEND\ndestination:/queue/receipts\nreceipt:%s-%d\n\nx\x00" % (receipt.encode(), n)
            for n in range(first, first + 100)
        )
        for first in range(0, 40_000, 100)
    )
    with Peer(gateway.port, receive_buffer=64 * 1024) as peer, GatewayRss(gateway) as memory:
        peer.connect()
        writer = Writer(peer.sock, chunks, give_up=memory.over).start()  # 330 MB of receipts at most
        wait_for(lambda: writer.done.is_set() or writer.stalled(1.0), "the writer to finish or stall", 40)
        writer.finish()
        assert_gateway_serves(gateway, "meanwhile")
        memory.check()
        assert writer.blocked, "the writer was never held back"


# ------------------------------------------------------------------------------------------------ 5. flood
FLOOD = 200_000


def flood_chunks(queue: str, count: int, body: int = 64) -> Iterator[bytes]:
    """``count`` SEND frames without receipts, 1000 to a chunk, the body a zero-padded sequence number."""
    template = b"SEND\ndestination:/queue/" + queue.encode() + b"\n\n%0" + str(body).encode() + b"d\x00"
    for first in range(0, count, 1000):
        yield b"".join(template % n for n in range(first, min(first + 1000, count)))


def test_a_flood_of_sends_without_receipts_is_slowed_at_tcp_and_nothing_is_lost(heavy: Heavy) -> None:
    core, gateway = heavy.core, heavy.gateway
    assert_gateway_serves(gateway, "warm-up")
    with Peer(gateway.port) as flooder, GatewayRss(gateway) as memory:
        flooder.connect()
        writer = Writer(flooder.sock, flood_chunks("flood", FLOOD)).start()
        wait_for(lambda: writer.blocked > 0 or writer.done.is_set(), "the flood to fill the socket", 30)
        assert writer.blocked, "the gateway took 200 000 frames as fast as they came"
        # Another client, while the flood is held back at its socket:
        with Peer(gateway.port) as other:
            other.connect()
            other.send(b"SEND\ndestination:/queue/other\nreceipt:mine\n\nx\x00")
            assert other.expect("RECEIPT").headers["receipt-id"] == "mine"
            assert not writer.done.is_set(), "the flood was over before the other client was answered"
        assert writer.done.wait(40), f"the flood did not get through: {writer.sent} bytes sent"
        assert writer.error is None, writer.error
        flooder.send(DISCONNECT)  # answered once every SEND before it is confirmed
        assert flooder.expect("RECEIPT").headers["receipt-id"] == "bye"
        memory.check()
    wait_for(lambda: depth(core, "flood") == FLOOD, f"{FLOOD} messages in the queue")
    assert depth(core, "other") == 1
    assert_gateway_serves(gateway, "afterwards")


@pytest.mark.parametrize(
    ("count", "body", "window"),
    [
        (100_000, 512, 8192),  # 55 MB: far more than the core takes (1 MB + its publish window) and the kernel holds
        # 250 MB in frames of 1 MiB: few frames, many bytes (stomp.pending_bytes). The core's publish window
        # counts messages, so it is made small here for the core not to take them all itself.
        (250, 1024 * 1024, 16),
    ],
)
def test_a_flood_into_a_full_address_stops_at_the_producers_socket(
    tmp_path: Path, count: int, body: int, window: int
) -> None:
    """The core withholds publish credit while the address is full (policy BLOCK): the gateway must stop
    reading the producer's socket, so the producer blocks; the gateway's memory stays flat; other
    connections carry on; once a consumer drains the address every message arrives."""
    config = '[[address_settings]]\nmatch = "blocked"\nmax_size_bytes = 1048576\naddress_full_policy = "BLOCK"\n'
    core = start_core(tmp_path, config=config, TRIDENTMQ_CORE_LINK_PUBLISH_WINDOW=str(window))
    gateway = start_gateway(tmp_path, core)
    try:
        assert_gateway_serves(gateway, "warm-up")
        with Peer(gateway.port, send_buffer=64 * 1024) as flooder, GatewayRss(gateway) as memory:
            flooder.connect()
            chunks = list(flood_chunks("blocked", count, body=body))  # built first: making them is no stall
            writer = Writer(flooder.sock, chunks).start()
            wait_for(lambda: writer.done.is_set() or writer.stalled(1.0), "the flood to stall", 30)
            assert not writer.done.is_set(), "the gateway read the whole flood while the core gave it no credit"
            assert writer.blocked
            wait_for(lambda: depth(core, "blocked") > 0, "the first messages in the core")  # still in transit?
            assert depth(core, "blocked") < count
            assert_gateway_serves(gateway, "meanwhile")  # another address, another link: unaffected
            memory.check()
            with Peer(gateway.port) as consumer:
                consumer.connect()
                consumer.send(b"SUBSCRIBE\nid:drain\ndestination:/queue/blocked\nack:auto\n\n\x00")
                numbers = [int(consumer.expect("MESSAGE").body[-12:]) for _ in range(count)]  # zero-padded
            assert writer.done.wait(WAIT), "the flood did not resume"
            assert writer.error is None, writer.error
            assert numbers == list(range(count)), "messages were lost or reordered"
            memory.check()
    finally:
        assert gateway.stop() == 0
        assert "Traceback" not in gateway.log(), gateway.log()
        core.stop()


# ------------------------------------------------------------------------------------------------ 6. WebSocket
async def test_a_websocket_client_offering_only_an_unknown_subprotocol_is_closed_with_1002(
    gateway: GatewayProcess,
) -> None:
    """Each logged a WARNING line of aiohttp's, at every handshake: now one line a minute says it."""
    url = f"http://127.0.0.1:{gateway.ports['websocket']}/stomp"
    for _ in range(3):
        async with aiohttp.ClientSession() as session, session.ws_connect(url, protocols=("mqtt",)) as ws:
            message = await ws.receive(timeout=WAIT)
            assert message.type is aiohttp.WSMsgType.CLOSE, message
            assert message.data == 1002
            assert ws.protocol is None
    await asyncio.to_thread(assert_gateway_serves, gateway, "after-websocket")
    log = gateway.log()
    assert "overlap server-known ones" not in log
    assert log.count("WebSocket client refused: no supported subprotocol") <= 1


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        pytest.param("text", "not a stomp frame at all\n\n\x00", id="text-garbage"),
        pytest.param("binary", garbage(2000, 5) + b"\n\n\x00", id="binary-garbage"),
        pytest.param("binary", CONNECT + b"SEND\ndestination:/queue/ws\nx:\xff\n\nx\x00", id="binary-non-utf8-header"),
    ],
)
async def test_websocket_garbage_gets_an_error_frame(gateway: GatewayProcess, kind: str, data: str | bytes) -> None:
    url = f"http://127.0.0.1:{gateway.ports['websocket']}/stomp"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, protocols=("v12.stomp",)) as ws:
        assert ws.protocol == "v12.stomp"
        if kind == "text":
            assert isinstance(data, str)
            await ws.send_str(data)
        else:
            assert isinstance(data, bytes)
            await ws.send_bytes(data)
        received = b""
        for _ in range(10):
            message = await ws.receive(timeout=WAIT)
            if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                break
            assert message.type is aiohttp.WSMsgType.TEXT, message  # an ERROR frame is UTF-8: TEXT
            received += message.data.encode()
        else:
            raise AssertionError("the gateway kept the connection open")
    assert_error_then_close(received, "malformed frame", connected=received.startswith(b"CONNECTED"))
    await asyncio.to_thread(assert_gateway_serves, gateway, "after-websocket")


def test_an_endless_websocket_message_is_cut_off(gateway: GatewayProcess) -> None:
    """One WebSocket message, sent in 1 MB fragments that never end it, holding a SEND whose body never
    ends: the gateway must stop it at its frame limit (4 MiB) like on TCP, not gather the whole message."""
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{gateway.ports['websocket']}/stomp", timeout=WAIT, subprotocols=["v12.stomp"]
    )
    fragment = b"w" * MIB
    sent = 0
    try:
        ws.send(CONNECT.decode())
        assert ws.recv().startswith("CONNECTED\n")
        with GatewayRss(gateway) as memory:
            start = b"SEND\ndestination:/queue/wsbig\n\n"
            ws.send_frame(websocket.ABNF.create_frame(start, websocket.ABNF.OPCODE_BINARY, fin=0))
            try:
                for _ in range(256):  # 256 MB at most; a gateway that gathers it all fails on RSS first
                    if memory.over():
                        break
                    ws.send_frame(websocket.ABNF.create_frame(fragment, websocket.ABNF.OPCODE_CONT, fin=0))
                    sent += MIB
            except (OSError, websocket.WebSocketException):
                pass  # the gateway closed the connection: what should happen
        memory.check()
        assert sent < 64 * MIB, f"the gateway took {sent // MIB} MB of one message"
    finally:
        ws.close()
    assert_gateway_serves(gateway, "after-websocket")
