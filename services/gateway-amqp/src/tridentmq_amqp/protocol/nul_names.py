"""The names proton would cut short: a NUL inside a link name or a terminus address (sans-IO).

proton keeps a link's name and its source and target addresses as C strings, so ``queue\\0x`` reaches the
gateway as ``queue``: a link the client meant for one node would attach to another, silently. The other
control characters get through and are refused where names are checked (``convert``). This follows the
frames of the client's AMQP stream (the protocol header, then each frame by its size, without decoding
it) and decodes only OPEN and ATTACH frames, the rare ones that carry names: a NUL in an ATTACH's name or
addresses is kept under the name proton will show, for the gateway to refuse that link; a NUL in OPEN's
container id (part of durable subscription queue names) is kept for the connection.
"""

from __future__ import annotations

import struct
from typing import Any, Final

from tridentmq_amqp.protocol.types import Described, decode
from tridentmq_shared.names import name_problem

_PROTOCOL_HEADER: Final = 8
_FRAME_HEADER: Final = 8
_AMQP_FRAME: Final = 0
_OPEN: Final = 0x10
_ATTACH: Final = 0x12
_NAMED: Final = frozenset((_OPEN, _ATTACH))
_SMALL_ULONG: Final = 0x53
_U32: Final = struct.Struct(">I").unpack_from
_ULONG: Final = 0x80
#: The most bytes from a frame's start that tell its performative (header, extended header, descriptor).
_MOST_TO_CLASSIFY: Final = 255 * 4 + 10
#: The largest OPEN or ATTACH gathered (a larger one is beyond any frame size proton accepts here).
_MOST_COLLECTED: Final = 1 << 20
#: Problems kept per connection at most: each is taken when its link attaches.
_MOST_KEPT: Final = 1024


class NulNames:
    __slots__ = ("_carry", "_collect", "_collect_left", "_skip", "container_problem", "problems")

    def __init__(self) -> None:
        self._skip = _PROTOCOL_HEADER  # bytes to pass over: the protocol header, then frames not read
        self._carry = b""  # the start of a frame too short so far to classify
        self._collect: bytearray | None = None  # an OPEN or ATTACH frame being gathered
        self._collect_left = 0
        #: (the link's name as proton shows it, whether the client is its receiver) -> what is wrong.
        self.problems: dict[tuple[str, bool], str] = {}
        #: What is wrong with the OPEN's container id, if anything.
        self.container_problem: str | None = None

    def feed(self, data: bytes | bytearray) -> None:
        """The client's next bytes, in order (all of them, before proton reads them)."""
        pos, end = 0, len(data)
        if self._carry:
            data, self._carry = self._carry + data, b""
            end = len(data)
        while pos < end:
            if self._collect is not None:
                step = min(self._collect_left, end - pos)
                self._collect += data[pos : pos + step]
                self._collect_left -= step
                pos += step
                if not self._collect_left:
                    frame, self._collect = bytes(self._collect), None
                    self._read(frame)
                continue
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            # The usual frame (a transfer, a disposition, a flow) passed over without a call: once per frame.
            if end - pos >= _FRAME_HEADER:
                size = _U32(data, pos)[0]
                body = pos + data[pos + 4] * 4
                if (
                    size > _FRAME_HEADER
                    and body + 3 <= end
                    and body - pos < size
                    and data[body + 1] == _SMALL_ULONG
                    and data[body + 2] not in _NAMED
                ):
                    pos += size
                    if pos > end:
                        self._skip = pos - end
                    continue
            pos = self._frame_at(data, pos, end)

    def _frame_at(self, data: bytes | bytearray, pos: int, end: int) -> int:
        """Classify the frame starting at ``pos``; returns where to go on from (``end``: wait for more)."""
        if end - pos < _FRAME_HEADER:
            self._carry = bytes(data[pos:end])
            return end
        size = int.from_bytes(data[pos : pos + 4], "big")
        body = pos + data[pos + 4] * 4
        if size <= _FRAME_HEADER or data[pos + 5] != _AMQP_FRAME or body - pos >= size:
            self._skip = max(size, _FRAME_HEADER)  # a heartbeat, a bad frame (proton refuses it) or SASL
            return pos
        if end - body < 10 and end - pos < min(size, _MOST_TO_CLASSIFY):
            self._carry = bytes(data[pos:end])
            return end
        code = _performative(data, body, min(end, pos + size))
        if code not in (_OPEN, _ATTACH) or size > _MOST_COLLECTED:  # too large: proton refuses it
            self._skip = size
            return pos
        self._collect, self._collect_left = bytearray(), size
        return pos

    def _read(self, frame: bytes) -> None:
        try:
            performative, _ = decode(frame, frame[4] * 4)
            fields = performative.value
            if performative.descriptor in (_OPEN, "amqp:open:list"):
                self.container_problem = _nul_problem(fields[0], "container id")
            elif performative.descriptor in (_ATTACH, "amqp:attach:list") and len(self.problems) < _MOST_KEPT:
                self._read_attach(fields)
        except Exception:  # noqa: BLE001 - a frame proton will refuse itself: nothing to say about its names
            return

    def _read_attach(self, fields: list[Any]) -> None:
        name = fields[0]
        client_receives = bool(fields[2]) if len(fields) > 2 else False
        problem = _nul_problem(name, "link name")
        for index, kind in ((5, "source address"), (6, "target address")):
            terminus = fields[index] if len(fields) > index else None
            if problem is None and isinstance(terminus, Described) and terminus.value:
                problem = _nul_problem(terminus.value[0], kind)
        if problem is not None and isinstance(name, str):
            self.problems[(name.split("\x00", 1)[0], client_receives)] = problem


def _performative(data: bytes | bytearray, body: int, end: int) -> int | str | None:
    """The code of the performative at ``body`` (a described list), when its descriptor is there whole."""
    if end - body < 3 or data[body] != 0:
        return None
    if data[body + 1] == _SMALL_ULONG:
        return data[body + 2]
    if data[body + 1] == _ULONG and end - body >= 10:
        return int.from_bytes(data[body + 2 : body + 10], "big")
    # A symbolic descriptor (``amqp:attach:list``): rare, decoded whole to see which it is.
    return _ATTACH if data[body + 1] in (0xA3, 0xB3) else None


def _nul_problem(value: Any, kind: str) -> str | None:
    if isinstance(value, str) and "\x00" in value:
        return name_problem(value, kind)
    return None
