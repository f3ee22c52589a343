"""Drive a gateway's client session in this process: a real core node in the same event loop (its link over
loopback TCP, its journal in a temporary directory), the gateway's real ``CoreLinks`` with its default
settings, and the client's transport replaced by ``MemoryWire``, which holds what the session writes.

The protocol's client side is bytes the test writes and parses, so every rule of a session (ack modes,
receipts, QoS states, settlement) is reachable without starting a process, in a fraction of a second a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from tridentmq_core.server import CoreNode
from tridentmq_core.settings import (
    AddressSettingsEntry,
    CoreSettings,
    JournalSection,
    LinkSection,
    ManagementSection,
    NodeSection,
    PermissionEntry,
    UserEntry,
)
from tridentmq_shared.core_links import CoreLinks, CoreLinkSettings
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.supervision import Supervisor

#: How long a test waits for something the session should do at once: generous, since the suite's other
#: workers load the machine, and only a failing test waits it out.
WAIT_S = 20.0


class MemoryWire:
    """The client's transport as a session sees it (``tridentmq_shared.gateway.Wire``), in memory."""

    def __init__(self, peer: str = "127.0.0.1:40000", certificate_name: str | None = None) -> None:
        self.peer = peer
        self.host = peer.rsplit(":", 1)[0]
        self.certificate_name = certificate_name
        self.out = bytearray()
        #: Writes after ``close``: a session bug, but one its own error handling would swallow (the harness
        #: fails the test at its end instead).
        self.written_after_close = 0
        self.closed = False
        self.paused = False
        self.logged_in_called = False
        self._drained = asyncio.Event()
        self._drained.set()

    # ------------------------------------------------------------------ Wire
    def write(self, data: bytes) -> None:
        if self.closed:
            self.written_after_close += 1
            return
        self.out += data

    def close(self) -> None:
        self.closed = True
        self._drained.set()  # as a socket's end does: nobody waits for it to drain

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    async def drained(self) -> None:
        await self._drained.wait()

    def writable(self) -> bool:
        return self._drained.is_set()

    def buffered(self) -> int:
        return 0 if self._drained.is_set() else len(self.out)

    def logged_in(self) -> None:
        self.logged_in_called = True

    # ------------------------------------------------------------------ the test's side
    def stall(self) -> None:
        """The client stops reading: the socket's buffer is full until ``drain``."""
        self._drained.clear()

    def drain(self) -> None:
        self._drained.set()

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data


async def eventually(condition: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """The first true value of ``condition()``, polled while the loop runs the session and the core."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def settle(turns: int = 20) -> None:
    """Let the session, the link and the core exchange what they have queued. Only for what needs no disk
    or timer: that something did not come is proven by a later marker that did (a message sent after it)."""
    for _ in range(turns):
        await asyncio.sleep(0.001)


class Session(Protocol):
    wire: MemoryWire

    def feed(self, data: bytes) -> None: ...
    def connection_lost(self) -> None: ...
    async def wait_closed(self) -> None: ...


async def end_sessions(sessions: list[Session]) -> None:
    """End every session and wait for each (all of them, whatever one does); then fail on what went wrong."""
    problems: list[str] = []
    for session in sessions:
        session.wire.drain()  # as a socket's end does: whatever waits for the client to read wakes up
        try:
            session.connection_lost()
        except Exception as exc:
            problems.append(f"connection_lost raised {exc!r}")
    for session in sessions:
        try:
            await asyncio.wait_for(session.wait_closed(), WAIT_S)
        except Exception as exc:
            problems.append(f"a session did not end: {exc!r}")
        if session.wire.written_after_close:
            problems.append(f"a session wrote {session.wire.written_after_close} times after closing its wire")
    assert not problems, problems


def unused_port() -> int:
    """A loopback port nothing listens on (a core that is down)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass
class Core:
    """An in-process core node and a gateway's links to it."""

    node: CoreNode
    links: CoreLinks
    link_settings: CoreLinkSettings
    #: Stops the node in the middle of a test (the core goes away); the end of the test then does not.
    stop_node: Callable[[], Awaitable[None]]
    sessions: list[Session] = dataclasses.field(default_factory=list)

    @property
    def port(self) -> int:
        return self.node.status.link_port

    def opened(self, session: Session) -> Session:
        self.sessions.append(session)
        return session

    @contextlib.asynccontextmanager
    async def admin(self) -> AsyncIterator[LinkClient]:
        """A link client of the test's own (any credentials on loopback while the core has no users)."""
        client = self.links.client(user="admin", password="admin", client_name="test")
        await client.connect()
        try:
            yield client
        finally:
            await client.close()


def core_settings(
    data_dir: Path,
    *,
    users: list[UserEntry] | None = None,
    permissions: list[PermissionEntry] | None = None,
    address_settings: list[AddressSettingsEntry] | None = None,
    **link: Any,
) -> CoreSettings:
    """A node on a free loopback port with its data in ``data_dir``; ``link`` changes ``LinkSection``'s
    defaults (``publish_window``, say)."""
    return CoreSettings(
        node=NodeSection(data_dir=data_dir),
        # 8 MiB as the suite's other cores (tests/conftest.py), not the 64 MiB default: every segment is
        # pre-allocated, and the unit suite starts hundreds of these nodes (at 64 MiB, 15 GB per run).
        journal=JournalSection(segment_bytes=8 * 1024 * 1024),
        link=LinkSection(host="127.0.0.1", port=0, **link),
        management=ManagementSection(port=0),
        users=users or [],
        permissions=permissions or [],
        address_settings=address_settings or [],
    )


@contextlib.asynccontextmanager
async def running_core(settings: CoreSettings, link_settings: Callable[[int], CoreLinkSettings]) -> AsyncIterator[Core]:
    """A core node with ``settings`` and the gateway links of ``link_settings(port)``; at the end every session
    opened through ``Core.opened`` is ended and waited for, then the links and the node stop."""
    node = CoreNode(settings, supervisor=Supervisor())
    await node.start()
    node_stopped = False

    async def stop_node() -> None:
        nonlocal node_stopped
        node_stopped = True
        await node.stop()

    try:
        link_config = link_settings(node.status.link_port)
        links = CoreLinks(link_config, name="gateway-test")
        links.start()
        core = Core(node, links, link_config, stop_node)
        try:
            yield core
        finally:
            try:
                await end_sessions(core.sessions)
            finally:
                await links.stop()
    finally:
        if not node_stopped:
            await node.stop()
