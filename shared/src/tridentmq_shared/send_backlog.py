"""How much a connection has written that its peer's host has not acknowledged yet: what waits in asyncio's
buffer plus what the kernel holds unacknowledged (``SIOCOUTQ``, Linux). A count that goes down means the peer
takes what was sent, however slowly; one that stays up means nothing gets through."""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios

_INT = struct.Struct("i")


def unacknowledged_bytes(transport: asyncio.WriteTransport) -> int:
    """Bytes written to ``transport`` that its peer has not acknowledged (asyncio's buffer alone where the
    kernel does not say)."""
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is None:
        return size
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(_INT.size))
    except (OSError, ValueError):  # not a TCP socket, or closed meanwhile
        return size
    return size + int(_INT.unpack(raw)[0])
