"""STOMP framing: an incremental parser and the encoder, per protocol version.

A frame is a command line, header lines, a blank line, a body and a NUL. Lines end in LF or CR LF. The body
is ``content-length`` bytes (NULs allowed) followed by a NUL, or, without that header, everything up to the
first NUL. EOLs between frames are heart-beats. From 1.1 on header names and values are escaped (``\\n``,
``\\c``, ``\\\\``, and from 1.2 ``\\r``), except in CONNECT and CONNECTED; the first of repeated headers
counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NamedTuple

from tridentmq_stomp.protocol.errors import RemoteProtocolError

V10: Final = "1.0"
V11: Final = "1.1"
V12: Final = "1.2"
VERSIONS: Final = (V10, V11, V12)

#: Commands whose headers are never escaped, whatever the version.
_RAW_COMMANDS: Final = frozenset({"CONNECT", "STOMP", "CONNECTED"})
_UNESCAPE_11: Final = {"n": "\n", "c": ":", "\\": "\\"}
_UNESCAPE_12: Final = {**_UNESCAPE_11, "r": "\r"}


class Frame(NamedTuple):  # a tuple: a frozen dataclass costs 0.4 µs more per frame
    command: str
    headers: dict[str, str]  # the first occurrence of each header
    body: bytes


@dataclass(frozen=True, slots=True)
class Limits:
    max_frame_bytes: int = 4 * 1024 * 1024  # body and headers together
    max_headers: int = 64
    max_header_bytes: int = 64 * 1024  # the command line and all header lines


class FrameParser:
    """Bytes in, frames out. ``version`` decides header escaping; the connection sets it after CONNECT."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.version = V10
        self._buffer = bytearray()
        # What the first violation was (not the exception: its traceback holds this parser's frame, and so this
        # parser, which would hold it: a cycle only the cyclic collector frees, with the session around it).
        self._failure: tuple[str, str, str | None, tuple[tuple[str, str], ...]] | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """The frames completed by ``data``; EOLs between frames (heart-beats) are skipped. Parsing stops
        after a CONNECT: set ``version``, then call ``feed(b"")`` for the frames behind it. Bad input raises
        ``RemoteProtocolError``, but only once the frames before it have been returned: the next call raises."""
        if self._failure is not None:
            raise RemoteProtocolError(*self._failure)
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        pos = 0
        try:
            pos = self._parse(buffer, frames)
        except RemoteProtocolError as exc:
            self._failure = (exc.message, exc.detail, exc.receipt_id, exc.headers)
            buffer.clear()  # nothing after a violation is read
            if not frames:
                raise
            return frames
        del buffer[:pos]
        return frames

    def _parse(self, buffer: bytearray, frames: list[Frame]) -> int:
        """Append the complete frames at the start of ``buffer`` to ``frames``; return how far they reach."""
        pos = 0
        limits = self.limits
        while True:
            end = len(buffer)
            while pos < end and buffer[pos] in (10, 13):  # heart-beats, and the EOLs after a NUL
                if buffer[pos] == 13 and (pos + 1 >= end or buffer[pos + 1] != 10):
                    if pos + 1 >= end:
                        return pos  # a CR whose LF has not arrived yet
                    raise RemoteProtocolError("malformed frame", "a CR not followed by LF between frames")
                pos += 1
            if pos >= end:
                return pos
            head_end = buffer.find(b"\n\n", pos)
            # Only up to the LF LF: searching the whole buffer made parsing quadratic in frames per read.
            crlf_end = buffer.find(b"\n\r\n", pos, end if head_end == -1 else head_end + 1)
            if crlf_end != -1 and (head_end == -1 or crlf_end < head_end):
                head_end, body_start = crlf_end, crlf_end + 3
            else:
                body_start = head_end + 2
            # The limit counts the command and header lines up to the last one's EOL, however the bytes arrive.
            if head_end == -1:
                _check_command_start(buffer, pos, end)  # garbage is refused now, not after 64 KiB
                content_end = end
                while content_end > max(pos, end - 3) and buffer[content_end - 1] in (10, 13):
                    content_end -= 1  # EOLs of the blank line that has not fully arrived
                if content_end - pos > limits.max_header_bytes:
                    raise RemoteProtocolError("frame too large", f"headers exceed {limits.max_header_bytes} bytes")
                return pos
            if head_end - pos - (buffer[head_end - 1] == 13) > limits.max_header_bytes:
                raise RemoteProtocolError("frame too large", f"headers exceed {limits.max_header_bytes} bytes")
            command, headers = self._head(bytes(buffer[pos:head_end]))
            length_text = headers.get("content-length")
            if length_text is not None:
                if not (length_text.isascii() and length_text.isdigit()):  # int() also reads non-ASCII digits
                    raise RemoteProtocolError(
                        "malformed frame", f"content-length {length_text[:20]!r}", headers.get("receipt")
                    )
                length = int(length_text)
                if length > limits.max_frame_bytes:
                    raise RemoteProtocolError(
                        "frame too large",
                        f"body of {length} bytes exceeds {limits.max_frame_bytes}",
                        headers.get("receipt"),
                    )
                if end < body_start + length + 1:
                    return pos
                if buffer[body_start + length] != 0:
                    raise RemoteProtocolError(
                        "malformed frame",
                        "the body is not followed by a NUL (content-length wrong?)",
                        headers.get("receipt"),
                    )
                body_end = body_start + length
            else:
                body_end = buffer.find(b"\x00", body_start, body_start + limits.max_frame_bytes + 1)
                if body_end == -1:
                    if end - body_start > limits.max_frame_bytes:
                        raise RemoteProtocolError(
                            "frame too large", f"body exceeds {limits.max_frame_bytes} bytes", headers.get("receipt")
                        )
                    return pos
            frames.append(Frame(command, headers, bytes(buffer[body_start:body_end])))
            pos = body_end + 1
            if command in _RAW_COMMANDS:
                return pos  # the CONNECT decides the version, and so how the frames behind it are read

    def _head(self, head: bytes) -> tuple[str, dict[str, str]]:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError("malformed frame", "headers are not UTF-8") from None
        lines = text.split("\n")
        command = lines[0].removesuffix("\r")
        if not command or not command.isalpha() or not command.isupper():
            raise RemoteProtocolError("malformed frame", f"bad command line {command[:40]!r}")
        if len(lines) - 1 > self.limits.max_headers:
            raise RemoteProtocolError(
                "frame too large", f"more than {self.limits.max_headers} headers", _receipt_in(lines[1:])
            )
        unescape = (
            None
            if command in _RAW_COMMANDS or self.version == V10
            else (_UNESCAPE_12 if self.version == V12 else _UNESCAPE_11)
        )
        lines = lines[1:]
        trim = self.version == V10 and command not in _RAW_COMMANDS  # 1.0 clients pad: "destination: /queue/a"
        if "\r" not in text and (unescape is None or "\\" not in text) and not trim:
            # The common case, in C: no CR to strip, nothing to unescape, no header repeated.
            try:
                headers = dict([line.split(":", 1) for line in lines])
            except ValueError:
                pass  # a line without a colon: the loop below says which
            else:
                if len(headers) == len(lines):
                    return command, headers
        headers = {}
        for line in lines:
            line = line.removesuffix("\r")
            name, colon, value = line.partition(":")
            if not colon:
                raise RemoteProtocolError(
                    "malformed frame", f"header line without a colon: {line[:40]!r}", _receipt_in(lines)
                )
            if unescape is not None:
                try:
                    name, value = _unescape(name, unescape), _unescape(value, unescape)
                except RemoteProtocolError as exc:
                    raise RemoteProtocolError(exc.message, exc.detail, _receipt_in(lines)) from None
            elif trim:
                name, value = name.strip(), value.strip()
            headers.setdefault(name, value)
        return command, headers


def _check_command_start(buffer: bytearray, pos: int, end: int) -> None:
    """Refuse a frame whose command line, as far as it has arrived, is not upper-case letters."""
    eol = buffer.find(b"\n", pos, end)
    line = bytes(buffer[pos : end if eol == -1 else eol])
    if eol != -1:
        line = line.removesuffix(b"\r")
    if not line.isalpha() or not line.isupper():
        if eol == -1 and line.endswith(b"\r") and (line[:-1].isalpha() and line[:-1].isupper()):
            return  # a CR whose LF has not arrived yet
        raise RemoteProtocolError("malformed frame", f"bad command line {line[:40]!r}")


def _receipt_in(lines: list[str]) -> str | None:
    """The receipt a frame that fails to parse asked for, if its header reads (its ERROR then carries it)."""
    for line in lines:
        if line.startswith("receipt:"):
            value = line[8:].removesuffix("\r")
            return value if "\\" not in value else None
    return None


def _unescape(text: str, table: dict[str, str]) -> str:
    if "\\" not in text:
        return text
    out: list[str] = []
    chars = iter(text)
    for char in chars:
        if char != "\\":
            out.append(char)
            continue
        follower = next(chars, "")
        replacement = table.get(follower)
        if replacement is None:
            raise RemoteProtocolError("malformed frame", f"undefined escape sequence \\{follower}")
        out.append(replacement)
    return "".join(out)


# 1.1 cannot escape CR, and a CR ending a header line reads as part of its EOL: it is dropped. No version can
# carry U+0000 in a header (a NUL ends the frame for clients that read up to it, and the rest of the header
# became a frame of its own): it becomes U+FFFD, as a byte no text can hold does.
_ESCAPE_11: Final = str.maketrans({"\\": "\\\\", "\n": "\\n", ":": "\\c", "\r": "", "\x00": "\ufffd"})
_ESCAPE_12: Final = str.maketrans({"\\": "\\\\", "\n": "\\n", ":": "\\c", "\r": "\\r", "\x00": "\ufffd"})
_ESCAPE_RAW: Final = str.maketrans({"\n": " ", "\r": " ", "\x00": "\ufffd"})  # 1.0 and CONNECTED: keep framing
_ESCAPE_TABLES: Final = {V10: _ESCAPE_RAW, V11: _ESCAPE_11, V12: _ESCAPE_12}


def encode(command: str, headers: list[tuple[str, str]], body: bytes, version: str) -> bytes:
    """One frame; bodies always carry a ``content-length`` (they may contain NULs)."""
    head = "\n".join([command, *[f"{name}:{value}" for name, value in headers]])
    # Escaping is rare and str.translate is slow: when every line holds only its own EOL and colon (and no
    # backslash or CR), nothing needs it. 1.0 and CONNECT/CONNECTED escape nothing but EOLs.
    raw = command in _RAW_COMMANDS
    if (
        "\r" in head
        or "\x00" in head
        or head.count("\n") != len(headers)
        or (not raw and version != V10 and ("\\" in head or head.count(":") != len(headers)))
    ):
        table = _ESCAPE_RAW if raw else _ESCAPE_TABLES[version]
        head = "\n".join([command, *[f"{name.translate(table)}:{value.translate(table)}" for name, value in headers]])
    if body or command in ("MESSAGE", "ERROR"):
        head += f"\ncontent-length:{len(body)}"
    return b"".join((head.encode("utf-8"), b"\n\n", body, b"\x00"))
