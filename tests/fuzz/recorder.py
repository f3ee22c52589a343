"""A loopback TCP proxy that records what a real client sends, to seed the fuzzer with real sessions."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class Recorder:
    """Listens on 127.0.0.1 (port 0), forwards every connection to ``target_port`` and both ways back, and keeps
    the bytes each client connection sent (in the order the connections were accepted)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sessions: list[bytearray] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += (client, upstream)
            recorded = bytearray()
            self.sessions.append(recorded)
            for source, sink, keep in ((client, upstream, recorded), (upstream, client, None)):
                thread = threading.Thread(target=_pump, args=(source, sink, keep), daemon=True)
                thread.start()
                self._threads.append(thread)

    def close(self) -> None:
        self._listener.close()
        for thread in self._threads:
            thread.join(10)
        for sock in self._sockets:
            sock.close()


def _pump(source: socket.socket, sink: socket.socket, keep: bytearray | None) -> None:
    try:
        while data := source.recv(65536):
            if keep is not None:
                keep += data
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)  # the other way may still be talking


def record(target_port: int, client: Callable[[int], None]) -> list[bytes]:
    """Run ``client`` (a round trip given a port) through a recorder; the bytes of each of its connections."""
    recorder = Recorder(target_port)
    try:
        client(recorder.port)
    finally:
        recorder.close()
    return [bytes(s) for s in recorder.sessions if s]
