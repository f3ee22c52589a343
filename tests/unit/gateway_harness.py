"""Drive a gateway's client session in this process: a real core node in the same event loop (its link over
loopback TCP, its journal in a temporary directory), the gateway's real ``CoreLinks`` with its default
settings, and the client's transport replaced by ``MemoryWire``, which holds what the session writes.

The protocol's client side is bytes the test writes and parses, so every rule of a session (ack modes,
receipts, QoS states, settlement) is reachable without starting a process, in milliseconds a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from tridentmq_core.server import CoreNode
from tridentmq_core.settings import (
    AddressSettingsEntry,
    CoreSettings,
    LinkSection,
    ManagementSection,
    NodeSection,
    PermissionEntry,
    UserEntry,
)
from tridentmq_shared.core_links import CoreLinks, CoreLinkSettings
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.supervision import Supervisor

#: How long a test waits for something the session should do at once (the loop is this test's only one).
WAIT_S = 5.0


class MemoryWire:
    """The client's transport as a session sees it (``tridentmq_shared.gateway.Wire``), in memory."""

    def __init__(self, peer: str = "127.0.0.1:40000", certificate_name: str | None = None) -> None:
        self.peer = peer
        self.host = peer.rsplit(":", 1)[0]
        self.certificate_name = certificate_name
        self.out = bytearray()
        self.closed = False
        self.paused = False
        self.logged_in_called = False
        self._drained = asyncio.Event()
        self._drained.set()

    # ------------------------------------------------------------------ Wire
    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
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
    """Let the session, the link and the core exchange what they have queued (for checking nothing came)."""
    for _ in range(turns):
        await asyncio.sleep(0.001)


class Session(Protocol):
    def feed(self, data: bytes) -> None: ...
    def connection_lost(self) -> None: ...
    async def wait_closed(self) -> None: ...


@dataclasses.dataclass
class Core:
    """An in-process core node and a gateway's links to it."""

    node: CoreNode
    links: CoreLinks
    link_settings: CoreLinkSettings
    sessions: list[Session] = dataclasses.field(default_factory=list)

    @property
    def port(self) -> int:
        return self.node.status.link_port

    def opened(self, session: Session) -> Session:
        self.sessions.append(session)
        return session

    async def admin(self) -> LinkClient:
        """A link client of the test's own (anonymous on loopback while the core has no users)."""
        client = self.links.client(user="admin", password="admin", client_name="test")
        await client.connect()
        return client


def core_settings(
    data_dir: Path,
    *,
    users: list[UserEntry] | None = None,
    permissions: list[PermissionEntry] | None = None,
    address_settings: list[AddressSettingsEntry] | None = None,
) -> CoreSettings:
    return CoreSettings(
        node=NodeSection(data_dir=data_dir),
        link=LinkSection(host="127.0.0.1", port=0),
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
    try:
        link_config = link_settings(node.status.link_port)
        links = CoreLinks(link_config, name="gateway-test")
        links.start()
        core = Core(node, links, link_config)
        try:
            yield core
        finally:
            for session in core.sessions:
                session.connection_lost()
            for session in core.sessions:
                await asyncio.wait_for(session.wait_closed(), WAIT_S)
            await links.stop()
    finally:
        await node.stop()
