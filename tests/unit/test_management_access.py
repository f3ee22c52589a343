"""The management server's access control against a real broker and aiohttp server: passwords are checked in a
worker thread, a verified login is not hashed again, and deny rules hold for manage as for any permission."""

from __future__ import annotations

import base64
import threading

from aiohttp.test_utils import TestClient, TestServer

from tridentmq_core.audit import NullAuditSink
from tridentmq_core.broker import Broker
from tridentmq_core.management import NodeStatus, QueueRates, create_app
from tridentmq_core.security import Principal, SecurityManager, hash_password
from tridentmq_core.settings import CoreSettings, PermissionEntry, UserEntry
from tridentmq_core.store.memory import MemoryStore

PASSWORD = "s3cret"
SETTINGS = CoreSettings(
    users=[
        UserEntry("ops", hash_password(PASSWORD, salt=b"unit", iterations=1000), ["ops"]),
        UserEntry("muted", PASSWORD, ["ops", "muted"]),
    ],
    permissions=[
        PermissionEntry("#", "manage", ["ops"]),
        PermissionEntry("$sys.management", "manage", ["muted"], deny=True),
    ],
)


class CountingSecurity(SecurityManager):
    """The configured users, remembering which thread checked each password."""

    def __init__(self) -> None:
        super().__init__(SETTINGS.users, SETTINGS.permissions)
        self.threads: list[threading.Thread] = []

    def authenticate(
        self, user: str | None, password: str | None, peer_host: str | None, client_host: str | None = None
    ) -> Principal:
        self.threads.append(threading.current_thread())
        return super().authenticate(user, password, peer_host, client_host)


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def test_passwords_are_checked_off_the_event_loop_and_once_per_login() -> None:
    broker = Broker("node", SETTINGS, store=MemoryStore(), audit=NullAuditSink(), first_message_id=1)
    security = CountingSecurity()
    app = create_app(broker, NodeStatus(started_at=0.0), QueueRates(), security)
    async with TestClient(TestServer(app)) as client:
        for _ in range(3):
            response = await client.get("/api/status", headers=basic("ops", PASSWORD))
            assert response.status == 200
        assert len(security.threads) == 1  # verified once, then remembered
        assert security.threads[0] is not threading.current_thread()
        assert (await client.get("/api/status", headers=basic("ops", "wrong"))).status == 401
        assert (await client.get("/api/status", headers=basic("ops", "wrong"))).status == 401
        assert len(security.threads) == 3  # failures are never remembered
        assert all(thread is not threading.current_thread() for thread in security.threads)


async def test_a_deny_rule_refuses_manage() -> None:
    broker = Broker("node", SETTINGS, store=MemoryStore(), audit=NullAuditSink(), first_message_id=1)
    async with TestClient(TestServer(create_app(broker, NodeStatus(started_at=0.0), QueueRates()))) as client:
        response = await client.get("/api/queues", headers=basic("muted", PASSWORD))
        assert response.status == 403
        assert "manage" in (await response.json())["error"]
