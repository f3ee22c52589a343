"""What the benchmarks' raw asyncio clients share: the connection's plumbing, back-pressure and failure, under
each protocol's own parser and waits."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, ClassVar, cast


class RawClient(asyncio.Protocol):
    """One connection: its transport, the first error, write back-pressure and the end of the connection.
    A subclass names the exception it raises (``error_type``) and the futures a failure must wake
    (``_waiters``)."""

    error_type: ClassVar[type[Exception]]
    # a consumer sets it: when its acknowledgements back up, it stops reading deliveries until they drain
    pause_reading_when_blocked: ClassVar[bool] = False

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.error = ""
        self._writable: asyncio.Future[None] | None = None
        self._closed: asyncio.Future[None] = self.loop.create_future()
        self._closing = False  # our close: the connection's end is no error then

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._closing and not self.error:
            self.error = f"connection lost: {exc}" if exc else "connection closed by the gateway"
        self._wake(self.error or "connection closed")
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        if self.pause_reading_when_blocked:
            assert self.transport is not None
            self.transport.pause_reading()
        elif self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.pause_reading_when_blocked:
            assert self.transport is not None
            self.transport.resume_reading()
        elif self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

    # ---------------------------------------------------------------- failure
    def _waiters(self) -> Iterable[asyncio.Future[Any] | None]:
        """The protocol's own futures that a failure must wake (besides back-pressure)."""
        return ()

    def _fail(self, error: str) -> None:
        self.error = self.error or error
        self._wake(self.error)
        if self.transport is not None:
            self.transport.close()

    def _wake(self, error: str) -> None:
        for future in (*self._waiters(), self._writable):
            if future is not None and not future.done():
                future.set_exception(self.error_type(error))
                future.exception()  # retrieved: nobody may be waiting for it

    def _check(self) -> None:
        if self.error:
            raise self.error_type(self.error)
        if self._closed.done():
            raise self.error_type("connection closed")

    # ---------------------------------------------------------------- the client's side
    def write(self, data: bytes) -> None:
        self._check()
        assert self.transport is not None
        self.transport.write(data)

    async def writable(self) -> None:
        """Back-pressure: returns once the transport's buffer is below its high-water mark."""
        if self._writable is not None:
            await self._writable
        self._check()

    async def _shut(self, timeout: float) -> None:
        """Close the transport (it writes what it holds first) and wait for the connection's end, or abort it
        after ``timeout`` seconds."""
        if self.transport is None:
            return
        self.transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), timeout)
        except TimeoutError:
            self.transport.abort()
