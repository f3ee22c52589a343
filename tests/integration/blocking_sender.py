"""A client with one thread and blocking writes (many embedded libraries): it sends a whole burst before it
reads anything, while what it subscribed to fills its socket."""

from __future__ import annotations

import select
import socket
import threading
import time

STALL_S = 10.0  # nothing sent for this long: a deadlock


def send_before_reading(sock: socket.socket, burst: bytes, already: bytes = b"") -> tuple[int | None, bytearray]:
    """Send ``burst`` with blocking writes from a thread of its own, reading nothing meanwhile. Returns where
    the sending stalled for ``STALL_S`` (None: all of it went), and what was read after it ended (after
    ``already``, bytes read earlier); a stalled sender is freed by reading."""
    sock.settimeout(None)
    sent = [0]

    def send_burst() -> None:
        view = memoryview(burst)
        while sent[0] < len(view):
            sent[0] += sock.send(view[sent[0] : sent[0] + 65536])

    sender = threading.Thread(target=send_burst, daemon=True)
    sender.start()
    stalled_at = None
    last, last_change = 0, time.monotonic()
    while sender.is_alive():
        sender.join(0.2)
        if sent[0] != last:
            last, last_change = sent[0], time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            stalled_at = sent[0]  # read now, to end it
            break
    data = bytearray(already)
    while sender.is_alive():
        if select.select([sock], [], [], 0.2)[0]:
            data += sock.recv(1 << 20)
    return stalled_at, data
