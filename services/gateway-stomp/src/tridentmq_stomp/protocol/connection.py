"""The server side of one STOMP connection, sans-IO: bytes in, events out; replies in, bytes queued.

It negotiates the version (``accept-version``, none = 1.0) and heart-beats and checks each frame for the
headers its command needs. Clients may pipeline frames behind CONNECT, so a protocol violation is not
answered at once: it becomes a ``ProtocolViolation`` event after the events of the frames before it, and
the shell answers it with ``reject`` once it has handled those. That queues the ERROR frame (with the
``receipt-id`` of the failing frame when it had a receipt), after which the connection is closed, as the
specification requires.
"""

from __future__ import annotations

from enum import Enum
from typing import Final, NoReturn

from tridentmq_stomp.protocol import events as ev
from tridentmq_stomp.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_stomp.protocol.frames import V10, V11, V12, VERSIONS, Frame, FrameParser, Limits, encode

#: A peer is declared dead after this many of its heart-beat intervals of silence (the spec leaves the
#: tolerance open; network and scheduling delays make one interval too tight).
HEARTBEAT_TOLERANCE: Final = 2
ACK_MODES: Final = frozenset({"auto", "client", "client-individual"})
_COMMANDS: Final = frozenset(
    {"SEND", "SUBSCRIBE", "UNSUBSCRIBE", "ACK", "NACK", "BEGIN", "COMMIT", "ABORT", "DISCONNECT", "CONNECT", "STOMP"}
)


class State(Enum):
    AWAITING_CONNECT = "awaiting-connect"
    CONNECTING = "connecting"  # CONNECT received; accept() or refuse() next
    CONNECTED = "connected"
    CLOSED = "closed"


class StompServerConnection:
    def __init__(
        self,
        limits: Limits | None = None,
        *,
        heartbeat: tuple[int, int] = (10_000, 10_000),
        min_heartbeat_ms: int = 100,
        connect_timeout: float = 0.0,
        max_connect_bytes: int = 0,
        now: float = 0.0,
    ) -> None:
        """``heartbeat`` is what this server offers: (sx, sy) = it can send every sx ms, wants to receive
        every sy ms; ``min_heartbeat_ms`` is the shortest interval it agrees to in either direction. A client
        that has not sent its CONNECT ``connect_timeout`` seconds after ``now`` (0: no limit) gets an ERROR,
        and so does one that sends more than ``max_connect_bytes`` (0: no limit) before its CONNECT is
        complete: an unauthenticated peer cannot make us buffer a frame of the full size."""
        self._parser = FrameParser(limits)
        self._max_connect_bytes = max_connect_bytes
        self._before_connect = 0  # bytes received while awaiting the CONNECT
        self._connect_timeout = connect_timeout
        self._connect_deadline = now + connect_timeout if connect_timeout > 0 else None
        self.state = State.AWAITING_CONNECT
        self.version = V10
        self._heartbeat = heartbeat
        self._min_heartbeat = min_heartbeat_ms
        self._client_heartbeat = (0, 0)
        self.send_interval = 0.0  # seconds between our heart-beats (0: none)
        self.receive_interval = 0.0  # seconds within which the client must send something (0: unchecked)
        self._out: list[bytes] = []
        self._input_done = False  # input after a violation or a DISCONNECT is ignored
        self._last_received = 0.0
        self._reading = True  # False while the shell does not read the socket
        self._last_sent = 0.0

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    # ------------------------------------------------------------------ input
    def receive_data(self, data: bytes, now: float) -> list[ev.Event]:
        """Feed bytes from the client; ``b""`` means it closed its sending side (EOF): nothing more is read, and
        no heart-beat is awaited, but the shell may still answer what came before (receipts, an ERROR) and then
        close, as after a DISCONNECT."""
        if self.state is State.CLOSED or self._input_done:
            return []
        self._last_received = now
        if not data:
            self._input_done = True
            self._reading = False
            return [ev.ConnectionClosed()]
        events: list[ev.Event] = []
        size = len(data)
        try:
            while frames := self._parser.feed(data):
                data = b""
                for frame in frames:
                    event = self._event(frame)
                    events.append(event)
                    if type(event) is ev.Disconnect:  # whatever follows is not read
                        return events
            if self.state is State.AWAITING_CONNECT and self._max_connect_bytes:
                self._before_connect += size
                if self._before_connect > self._max_connect_bytes:
                    self._fail(
                        "frame too large",
                        f"more than {self._max_connect_bytes} bytes before a complete CONNECT frame",
                        None,
                    )
        except RemoteProtocolError as exc:
            self._input_done = True
            events.append(ev.ProtocolViolation(exc.message, exc.detail, exc.receipt_id, exc.headers))
        return events

    def _event(self, frame: Frame) -> ev.Event:
        command, headers = frame.command, frame.headers
        receipt = headers.get("receipt")
        if command not in _COMMANDS:
            self._fail("unknown command", f"{command[:40]} is not a STOMP client command", receipt)
        if command in ("CONNECT", "STOMP"):
            if self.state is not State.AWAITING_CONNECT:
                self._fail("already connected", "CONNECT may be sent once per connection", receipt)
            return self._connect(headers)
        if self.state is State.AWAITING_CONNECT:  # frames right behind CONNECT wait for its answer: pipelining
            self._fail("not connected", f"{command} before CONNECT", receipt)
        if frame.body and command != "SEND":
            self._fail("malformed frame", f"{command} frames have no body", receipt)
        match command:
            case "SEND":
                return ev.Send(
                    self._need(headers, "destination", command),
                    headers.get("transaction"),
                    receipt,
                    headers,
                    frame.body,
                )
            case "SUBSCRIBE":
                destination = self._need(headers, "destination", command)
                sub_id = headers.get("id") if self.version != V10 else headers.get("id", destination)
                if sub_id is None:
                    self._fail("missing header", "SUBSCRIBE needs an id header", receipt)
                ack = headers.get("ack", "auto")
                if ack not in ACK_MODES:
                    self._fail(
                        "invalid header", f"ack mode {ack[:40]!r} is not auto, client or client-individual", receipt
                    )
                return ev.Subscribe(sub_id, destination, ack, receipt, headers)
            case "UNSUBSCRIBE":
                unsubscribe_id, named = headers.get("id"), headers.get("destination")
                if unsubscribe_id is None and (self.version != V10 or named is None):
                    self._fail("missing header", "UNSUBSCRIBE needs an id header", receipt)
                return ev.Unsubscribe(unsubscribe_id, named, receipt, headers)
            case "ACK" | "NACK":
                if command == "NACK" and self.version == V10:
                    self._fail("unknown command", "NACK is not part of STOMP 1.0", receipt)
                ack_id = headers.get("id") if self.version == V12 else headers.get("message-id")
                if ack_id is None:
                    name = "id" if self.version == V12 else "message-id"
                    self._fail("missing header", f"{command} needs a {name} header", receipt)
                if self.version == V11 and "subscription" not in headers:
                    self._fail("missing header", f"{command} needs a subscription header in STOMP 1.1", receipt)
                return ev.Ack(
                    ack_id, headers.get("subscription"), headers.get("transaction"), receipt, nack=command == "NACK"
                )
            case "BEGIN" | "COMMIT" | "ABORT":
                return ev.Transaction(command, self._need(headers, "transaction", command), receipt)
            case _:  # DISCONNECT: the shell handles the frames before it, answers, then closes
                self._input_done = True
                return ev.Disconnect(receipt)

    def _connect(self, headers: dict[str, str]) -> ev.Connect:
        offered = [v.strip() for v in headers.get("accept-version", V10).split(",")]
        common = [v for v in VERSIONS if v in offered]
        if not common:
            self._out.append(
                encode(
                    "ERROR",
                    [
                        ("version", ",".join(VERSIONS)),
                        ("content-type", "text/plain"),
                        ("message", "unsupported protocol version"),
                    ],
                    f"Supported protocol versions are {', '.join(VERSIONS)}".encode(),
                    V10,
                )
            )
            self.state = State.CLOSED
            raise RemoteProtocolError("unsupported protocol version", f"the client offered {offered}")
        self.version = common[-1]
        self._parser.version = self.version
        if self.version == V10:
            # 1.0 header names and values are trimmed, as ActiveMQ does ("login: app"), CONNECT's too: the
            # parser reads a CONNECT raw, before it knows the version.
            trimmed: dict[str, str] = {}
            for name, value in headers.items():
                trimmed.setdefault(name.strip(), value.strip())
            headers = trimmed
        cx, cy = _heartbeat_header(headers.get("heart-beat", "0,0")) if self.version != V10 else (0, 0)
        self._client_heartbeat = (cx, cy)
        self.state = State.CONNECTING
        return ev.Connect(
            self.version, headers.get("login"), headers.get("passcode"), headers.get("host"), (cx, cy), headers
        )

    @staticmethod
    def _need(headers: dict[str, str], name: str, command: str) -> str:
        value = headers.get(name)
        if value is None:
            raise _remote("missing header", f"{command} needs a {name} header", headers.get("receipt"))
        return value

    # ------------------------------------------------------------------ output
    def accept(self, session: str, server: str, now: float) -> None:
        """Answer the CONNECT: CONNECTED with the negotiated version and heart-beats."""
        if self.state is not State.CONNECTING:
            raise LocalProtocolError("not connecting", "accept() answers a CONNECT")
        sx, sy = self._heartbeat
        cx, cy = self._client_heartbeat
        floor = self._min_heartbeat
        send_ms = 0 if sx == 0 or cy == 0 else max(sx, cy, floor)
        receive_ms = 0 if sy == 0 or cx == 0 else max(sy, cx, floor)
        self.send_interval = send_ms / 1000
        self.receive_interval = receive_ms / 1000 * HEARTBEAT_TOLERANCE
        headers = [("version", self.version), ("session", session), ("server", server)]
        if self.version != V10:
            headers.append(("heart-beat", f"{send_ms},{receive_ms}"))
        self._out.append(encode("CONNECTED", headers, b"", self.version))
        self.state = State.CONNECTED
        self._last_received = self._last_sent = now

    def refuse(self, message: str, detail: str = "") -> None:
        """Answer the CONNECT with an ERROR (bad credentials, say) and close."""
        if self.state is not State.CONNECTING:
            raise LocalProtocolError("not connecting", "refuse() answers a CONNECT")
        self._error_frame(message, detail, None)

    def reject(self, violation: ev.ProtocolViolation) -> None:
        """Answer a ``ProtocolViolation`` with its ERROR frame and close."""
        if self.state is not State.CLOSED:
            self._error_frame(violation.message, violation.detail, violation.receipt_id, violation.headers)

    def message(self, headers: list[tuple[str, str]], body: bytes) -> None:
        self._send("MESSAGE", headers, body)

    def receipt(self, receipt_id: str) -> None:
        self._send("RECEIPT", [("receipt-id", receipt_id)], b"")

    def error(self, message: str, detail: str = "", receipt_id: str | None = None) -> None:
        """Report an error the client caused (a refused publish, a forbidden subscription) and close."""
        if self.state is not State.CLOSED:
            self._error_frame(message, detail, receipt_id)

    def _send(self, command: str, headers: list[tuple[str, str]], body: bytes) -> None:
        if self.state is not State.CONNECTED:
            raise LocalProtocolError("not connected", f"cannot send {command} while {self.state.value}")
        self._out.append(encode(command, headers, body, self.version))

    def _error_frame(
        self, message: str, detail: str, receipt_id: str | None, extra: tuple[tuple[str, str], ...] = ()
    ) -> None:
        headers = [*extra, ("message", message), ("content-type", "text/plain")]
        if receipt_id is not None:
            headers.append(("receipt-id", receipt_id))
        self._out.append(encode("ERROR", headers, detail.encode("utf-8"), self.version))
        self.state = State.CLOSED

    def _fail(self, message: str, detail: str, receipt_id: str | None) -> NoReturn:
        raise _remote(message, detail, receipt_id)

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    # ------------------------------------------------------------------ heart-beats
    def next_deadline(self) -> float | None:
        if self.state is State.AWAITING_CONNECT:
            return self._connect_deadline
        if self.state is not State.CONNECTED:
            return None
        deadlines = []
        if self.send_interval:
            deadlines.append(self._last_sent + self.send_interval)
        if self.receive_interval and self._reading:
            deadlines.append(self._last_received + self.receive_interval)
        return min(deadlines) if deadlines else None

    def handle_timeout(self, now: float) -> None:
        """Queue a heart-beat when due; raise ``RemoteProtocolError`` (ERROR queued) if the client went quiet
        or did not connect in time."""
        if self.state is State.AWAITING_CONNECT and self._connect_deadline is not None:
            if now >= self._connect_deadline:
                detail = f"no CONNECT frame within {self._connect_timeout:g} s"
                self._error_frame("connect timeout", detail, None)
                raise RemoteProtocolError("connect timeout", detail)
            return
        if self.state is not State.CONNECTED:
            return
        if self.receive_interval and self._reading and now - self._last_received >= self.receive_interval:
            detail = f"nothing received for {now - self._last_received:.3f} s"
            self._error_frame("heart-beat missed", detail, None)
            raise RemoteProtocolError("heart-beat missed", detail)
        if self.send_interval and now - self._last_sent >= self.send_interval and not self._out:
            self._out.append(b"\n")

    def reading_paused(self) -> None:
        """The shell stopped reading the socket (back-pressure): the client's silence is not its own."""
        self._reading = False

    def reading_resumed(self, now: float) -> None:
        self._reading = True
        self._last_received = now

    def sent(self, now: float) -> None:
        """The shell wrote ``data_to_send()`` to the socket at ``now`` (any bytes count as a heart-beat)."""
        self._last_sent = now


def _remote(message: str, detail: str, receipt_id: str | None) -> RemoteProtocolError:
    return RemoteProtocolError(message, detail, receipt_id)


#: The longest heart-beat interval taken from a client (about 24 days): a longer one is as good as none, and a
#: number of hundreds of digits would overflow the float of a timer.
MAX_HEARTBEAT_MS = 2**31 - 1


def _heartbeat_header(value: str) -> tuple[int, int]:
    parts = value.split(",")
    # ASCII digits only: str.isdigit() also accepts digits that int() cannot read.
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        raise _remote("invalid header", f"heart-beat {value[:40]!r} is not two numbers", None)
    return min(int(parts[0]), MAX_HEARTBEAT_MS), min(int(parts[1]), MAX_HEARTBEAT_MS)


__all__ = ["V10", "V11", "V12", "State", "StompServerConnection"]
