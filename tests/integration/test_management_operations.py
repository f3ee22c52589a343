"""The management operations against one real core with users and a STOMP gateway: the manage permission, the
CLI and HTTP calls, what real clients see afterwards (moved dead letters, a paused queue, a closed client) and
the audit events. One node and one gateway serve the whole module; each test uses its own queues."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import stomp
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    basic_auth,
    shared_by_module,
    start_core,
    start_gateway,
    stop_cleanly,
)
from tests.integration.test_stomp_gateway import Listener

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration

ADMIN = ("admin", "admin-pass-5d1")
APP = ("app", "app-pass-0c7")
PERMISSIONS = (
    "send",
    "consume",
    "browse",
    "createAddress",
    "createDurableQueue",
    "deleteDurableQueue",
    "createNonDurableQueue",
    "deleteNonDurableQueue",
)
CONFIG = f"""
[[users]]
name = "admin"
password = "{ADMIN[1]}"
roles = ["admin"]

[[users]]
name = "app"
password = "{APP[1]}"
roles = ["app"]

[[permissions]]
match = "#"
permission = "manage"
roles = ["admin"]
""" + "".join(
    f"""
[[permissions]]
match = "#"
permission = "{p}"
roles = ["admin", "app"]
"""
    for p in PERMISSIONS
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, GatewayProcess]]:
    tmp_path = tmp_path_factory.mktemp("operations")
    core = start_core(tmp_path, config=CONFIG, TRIDENTMQ_CORE_AUDIT_ROLL_SECONDS="3600")
    gateway = start_gateway(tmp_path, core)
    shared_by_module(core.process, gateway.process)
    yield core, gateway
    stop_cleanly(gateway)
    assert core.stop() == 0, core.log()
    assert "Traceback" not in core.log()


def call(
    core: CoreProcess,
    method: str,
    path: str,
    body: Any = None,
    user: tuple[str, str] | None = ADMIN,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = basic_auth(*user) if user else {}
    if data is not None:  # as the CLI and the console send it (a POST of a form is refused: CSRF)
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(core.management_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def cli(core: CoreProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tridentmq_shared.cli",
            *args,
            "--management",
            core.management_url,
            "--user",
            ADMIN[0],
            "--password",
            ADMIN[1],
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def depth(core: CoreProcess, queue: str) -> dict[str, Any]:
    status, view = call(core, "GET", "/api/queues/" + queue)
    assert status == 200, view
    return view


def stomp_consumer(gateway: GatewayProcess, destination: str) -> tuple[stomp.Connection, Listener]:
    conn = stomp.Connection12([("127.0.0.1", gateway.port)])
    listener = Listener()
    conn.set_listener("test", listener)
    conn.connect(username=APP[0], passcode=APP[1], wait=True)
    conn.subscribe(destination, id="1", ack="auto", headers={"receipt": "subscribed"})
    listener.wait(lambda: "subscribed" in listener.receipts, "the SUBSCRIBE receipt")
    return conn, listener


def link(core: CoreProcess) -> LinkClient:
    return LinkClient(
        "127.0.0.1", core.link_port, user=ADMIN[0], password=ADMIN[1], reconnect=ReconnectPolicy(attempts=0)
    )


def audit_events(core: CoreProcess, prefix: str) -> list[dict[str, Any]]:
    paths = sorted((core.data_dir / "audit").rglob("*.jsonl"))  # <node id>/ sealed and .active/ segments
    records = [json.loads(line) for path in paths for line in path.read_bytes().splitlines()]
    return [r for r in records if str(r["event"]).startswith(prefix)]


def test_operations_need_the_manage_permission(node: tuple[CoreProcess, GatewayProcess]) -> None:
    core, _ = node
    assert call(core, "POST", "/api/queues", {"name": "perm.q"})[0] == 200
    assert call(core, "POST", "/api/purge", {"queue": "perm.q"}, user=None)[0] == 401
    status, refused = call(core, "POST", "/api/purge", {"queue": "perm.q"}, user=APP)
    assert status == 403
    assert "manage" in refused["error"]
    assert call(core, "DELETE", "/api/queues/perm.q", user=APP)[0] == 403
    assert "perm.q" in {q["name"] for q in call(core, "GET", "/api/queues")[1]}
    # Refused after login, so audited and logged, as the operations a user with the permission is refused.
    refusals = [
        (e["operation"], e["user"], e["result"])
        for e in audit_events(core, "mgmt.")
        if str(e.get("result", "")).startswith("refused")
    ]
    lacking = ("app", "refused: the user lacks the manage permission")
    assert ("queue.purge", *lacking) in refusals
    assert ("queue.delete", *lacking) in refusals
    assert core.log().count("management operation") >= 2
    status, done = call(core, "DELETE", "/api/queues/perm.q")
    assert (status, done["deleted"]) == (200, 1)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "text"),
    [
        ("POST", "/api/purge", b"{not json", 400, "not JSON"),
        ("POST", "/api/purge", b"[1]", 400, "JSON object"),
        ("POST", "/api/purge", b"{}", 400, "queue is required"),
        ("POST", "/api/purge", b'{"queue": 7}', 400, "queue is a string"),
        ("POST", "/api/purge", b'{"queue": "x", "selector": "a = "}', 400, "bad selector"),
        ("POST", "/api/purge", b'{"queue": "no.such.queue"}', 404, "does not exist"),
        ("POST", "/api/move", b'{"queue": "x", "limit": "all"}', 400, "limit is an integer"),
        ("POST", "/api/move", b'{"queue": "x", "message_ids": [0]}', 400, "message_ids"),
        ("POST", "/api/pause", b'{"queue": "x", "address": "y"}', 400, "either queue or address"),
        ("POST", "/api/queues", b'{"name": "q", "routing_type": "broadcast"}', 400, "routing_type"),
        ("POST", "/api/queues", b'{"name": "q", "durable": "yes"}', 400, "durable is true or false"),
        ("GET", "/api/messages?queue=x&limit=100000", None, 400, "limit is from 0 to 500"),
        ("GET", "/api/messages?queue=x&offset=-1", None, 400, "offset is from 0"),
        ("GET", "/api/messages", None, 400, "a name is 1 to"),
        ("POST", "/api/purge?node=nowhere", b'{"queue": "x"}', 404, "no live node"),
        ("PUT", "/api/address-settings", b'{"match": "a.#", "settings": {"max_size_bytes": 1.5}}', 400, "max_size"),
        ("POST", "/api/scale-down", b"{}", 400, "name the node"),
    ],
)  # fmt: skip
def test_bad_parameters_get_a_clear_json_error(
    node: tuple[CoreProcess, GatewayProcess], method: str, path: str, body: bytes | None, status: int, text: str
) -> None:
    core, _ = node
    answer = call(core, method, path, raw=body)
    assert answer[0] == status, answer
    assert text in answer[1]["error"]


async def test_dead_letters_move_back_and_a_stomp_consumer_gets_them(
    node: tuple[CoreProcess, GatewayProcess],
) -> None:
    core, gateway = node
    async with link(core) as client:
        await client.create_queue("dlq.orders", "dlq.orders", durable=True)
        for n in range(4):
            await client.publish(new_message("dlq.orders", f"order {n}".encode(), durable=True, properties={"n": n}))
        consumer = await client.subscribe("dlq.orders", credit=10)
        for _ in range(4):
            delivery = await consumer.get(timeout=10)
            assert delivery is not None
            consumer.nack(delivery, mode=NackMode.REJECT)  # dead-lettered: to DLQ with its origin
        await consumer.close()
    browse = cli(core, "queue", "browse", "DLQ", "--selector", "_AMQ_ORIG_QUEUE = 'dlq.orders'", "--json")
    assert browse.returncode == 0, browse.stderr
    seen = json.loads(browse.stdout)
    assert seen["total"] == 4
    assert {m["properties"]["_AMQ_ORIG_REASON"] for m in seen["messages"]} == {"rejected"}
    conn, listener = stomp_consumer(gateway, "/queue/dlq.orders")
    try:
        moved = cli(core, "queue", "move", "DLQ", "--selector", "_AMQ_ORIG_QUEUE = 'dlq.orders' AND n >= 2")
        assert moved.returncode == 0, moved.stderr
        assert moved.stdout.startswith("moved 2"), moved.stdout
        frames = listener.wait_messages(2)
        assert sorted(f.body for f in frames) == ["order 2", "order 3"]
        assert all("_AMQ_ORIG_QUEUE" not in f.headers for f in frames)
        copied = cli(
            core,
            "queue",
            "copy",
            "DLQ",
            "--to",
            "dlq.orders",
            "--limit",
            "1",
            "--selector",
            "_AMQ_ORIG_QUEUE = 'dlq.orders'",
        )
        assert copied.stdout.startswith("copied 1"), copied.stdout + copied.stderr
        assert listener.wait_messages(3)[2].body == "order 0"
    finally:
        conn.disconnect()
    assert depth(core, "DLQ")["depth"] >= 2  # the copy left its original; two were never moved
    events = audit_events(core, "mgmt.messages.")
    move = next(e for e in events if e["event"] == "mgmt.messages.move")
    assert (move["user"], move["target"], move["result"]) == ("admin", "DLQ -> origin", "ok")
    assert json.loads(move["counts"])["moved"] == 2
    assert any(e["event"] == "mgmt.messages.copy" for e in events)


async def test_a_paused_queue_holds_its_messages_until_resumed(node: tuple[CoreProcess, GatewayProcess]) -> None:
    core, gateway = node
    assert cli(core, "queue", "create", "held.q").returncode == 0
    assert cli(core, "queue", "pause", "held.q").returncode == 0
    async with link(core) as client:
        for n in range(3):
            await client.publish(new_message("held.q", f"h{n}".encode(), durable=True))
    conn, listener = stomp_consumer(gateway, "/queue/held.q")
    try:
        view = depth(core, "held.q")
        assert (view["depth"], view["consumers"], view["in_flight"], view["delivered"]) == (3, 1, 0, 0)
        resumed = cli(core, "queue", "resume", "held.q")
        assert resumed.returncode == 0, resumed.stderr
        assert [f.body for f in listener.wait_messages(3)] == ["h0", "h1", "h2"]
    finally:
        conn.disconnect()


async def test_purge_browse_and_delete_through_the_cli(node: tuple[CoreProcess, GatewayProcess]) -> None:
    core, _ = node
    async with link(core) as client:
        await client.create_queue("purge.q", "purge.q", durable=True)
        for n in range(6):
            await client.publish(
                new_message("purge.q", f"p{n}".encode(), durable=True, properties={"kind": "old" if n < 4 else "new"})
            )
    table = cli(core, "queue", "browse", "purge.q", "--limit", "2")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0] == "6 message(s)"
    assert "p0" in table.stdout
    assert "p2" not in table.stdout
    purged = cli(core, "queue", "purge", "purge.q", "--selector", "kind = 'old'")
    assert purged.stdout.startswith("purged 4"), purged.stdout + purged.stderr
    assert depth(core, "purge.q")["depth"] == 2
    deleted = cli(core, "queue", "delete", "purge.q")
    assert deleted.stdout.startswith("deleted 1, messages 2"), deleted.stdout
    missing = cli(core, "queue", "purge", "purge.q")
    assert missing.returncode == 1
    assert "does not exist" in missing.stderr


def test_closing_a_client_ends_its_stomp_connection(node: tuple[CoreProcess, GatewayProcess]) -> None:
    core, gateway = node
    conn, listener = stomp_consumer(gateway, "/queue/close.q")
    try:
        peer = f"127.0.0.1:{conn.transport.socket.getsockname()[1]}"
        links = [c for c in call(core, "GET", "/api/connections")[1] if c["client_name"] == f"stomp {peer}"]
        assert len(links) == 1, links
        closed = cli(core, "client", "close", peer)
        assert closed.stdout.startswith("closed 1"), closed.stdout + closed.stderr
        listener.wait(lambda: bool(listener.errors) or not conn.is_connected(), "the gateway to end the client")
        deadline = time.monotonic() + 10
        while any(c["conn_id"] == links[0]["conn_id"] for c in call(core, "GET", "/api/connections")[1]):
            assert time.monotonic() < deadline, "the link is still open"
            time.sleep(0.05)
    finally:
        if conn.is_connected():
            conn.disconnect()
    event = audit_events(core, "mgmt.client.close")[-1]
    assert (event["target"], event["result"]) == (peer, "ok")
    # A connection id names one link: closing one that is gone is an error, not "closed 0".
    missing = cli(core, "connection", "close", links[0]["conn_id"])
    assert missing.returncode == 1, missing.stdout
    assert "no connection" in missing.stderr, missing.stderr


def test_address_settings_are_shown_and_changed_at_run_time(node: tuple[CoreProcess, GatewayProcess]) -> None:
    core, _ = node
    changed = cli(core, "address", "set", "settings.#", "max_delivery_attempts=3", "dead_letter_address=settings.dlq")
    assert changed.returncode == 0, changed.stderr
    shown = cli(core, "address", "settings", "settings.orders", "--json")
    resolved = json.loads(shown.stdout)["resolved"]
    assert (resolved["max_delivery_attempts"], resolved["dead_letter_address"]) == (3, "settings.dlq")
    refused = cli(core, "address", "set", "settings.#", "address_full_policy=KEEP")
    assert refused.returncode == 1
    assert "address_full_policy 'KEEP' is not one of PAGE, BLOCK, FAIL, DROP" in refused.stderr
