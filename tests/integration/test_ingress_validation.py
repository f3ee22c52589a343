"""Numbers out of range are refused at every door, against real processes over real sockets.

The reproducer of the poison message: a link publish of a non-durable, already expired message whose timestamp
is 2**63-1 once stopped a core's timers (its expiry's audit event overflowed), leaving a node that answered
/readyz but sent no heartbeats. Now the link refuses the message, and the gateways refuse what would
carry such a value with their protocol's error before it reaches the core.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from proton import Disposition, Message
from proton.utils import BlockingConnection, SendException
from tests.conftest import CoreProcess, GatewayProcess, start_core
from tests.integration.test_amqp_bad_input import assert_serves as assert_amqp_serves
from tests.integration.test_stomp_bad_input import assert_gateway_serves, exchange, frames_of

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import M_ID, M_SCHEDULED, M_TIMESTAMP, new_message

pytestmark = pytest.mark.integration

WAIT = 10.0  # every wait ends as soon as its condition holds


def audit_heartbeats(core: CoreProcess) -> int:
    lines = "".join(p.read_text() for p in sorted((core.data_dir / "audit").rglob("*.jsonl*")))
    return sum(json.loads(line)["event"] == "node.heartbeat" for line in lines.splitlines() if line)


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def ready(core: CoreProcess) -> object:
    with urllib.request.urlopen(core.management_url + "/readyz", timeout=WAIT) as response:
        return json.loads(response.read())["status"]


@pytest.mark.parametrize(
    ("field", "value"),
    [(M_TIMESTAMP, 2**63 - 1), (M_TIMESTAMP, -1), (M_SCHEDULED, 2**64 - 1), (M_ID, -(2**63))],
)
async def test_a_poison_message_is_refused_and_the_node_keeps_its_timers(
    tmp_path: Path, field: int, value: int
) -> None:
    # Audit heartbeats every 0.2 s and link heartbeats every 0.1 s: both stop at once if the node's tick dies.
    core = start_core(tmp_path, TRIDENTMQ_CORE_AUDIT_HEARTBEAT_SECONDS="0.2")
    try:
        watcher = LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0), heartbeat_ms=100)
        async with watcher:
            consumer = await watcher.subscribe("poison", auto_ack=True)
            async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as attacker:
                poison = new_message("poison", b"x", expiration_ms=1)  # non-durable and long expired
                poison[field] = value
                with pytest.raises(LinkClosedError) as refused:
                    await attacker.publish(poison)
            assert refused.value.code == "malformed"
            seen = audit_heartbeats(core)
            await wait_for(lambda: audit_heartbeats(core) >= seen + 3, "three more audit heartbeats")
            # The watcher's link outlived several heartbeat timeouts (4 x 0.1 s): the node kept sending them.
            await watcher.publish(new_message("poison", b"fine"))
            delivered = await consumer.get(timeout=WAIT)
            assert delivered is not None
            assert delivered.body == b"fine"
        assert ready(core) == "ready"
    finally:
        assert core.stop() == 0, core.log()
    log = core.log()
    assert "Traceback" not in log, log
    assert "link closed on protocol error" in log


def test_a_stomp_send_with_an_expiry_beyond_year_9999_gets_an_error(stomp_gateway: GatewayProcess) -> None:
    connect = b"CONNECT\naccept-version:1.2\nhost:x\n\n\x00"
    for expires in ("9223372036854775807", "253402300800000", "1" + "0" * 30):
        send = f"SEND\ndestination:/queue/late\nexpires:{expires}\nreceipt:r\n\nlate\x00".encode()
        frames = frames_of(exchange(stomp_gateway, connect + send))
        assert [f.command for f in frames] == ["CONNECTED", "ERROR"], frames
        assert "expires" in frames[-1].body.decode(), frames[-1]
    assert_gateway_serves(stomp_gateway, "after-late")


def test_an_amqp_message_expiring_after_year_9999_is_rejected(amqp_gateway: GatewayProcess) -> None:
    conn = BlockingConnection(f"amqp://127.0.0.1:{amqp_gateway.port}", timeout=WAIT)
    try:
        sender = conn.create_sender("late")
        with pytest.raises(SendException) as rejected:
            sender.send(Message(body="late", expiry_time=1e15))  # seconds: year 31 millions
        assert rejected.value.state == Disposition.REJECTED
    finally:
        conn.close()
    assert_amqp_serves(amqp_gateway, "after-late")


def test_the_core_link_refuses_a_hello_with_a_negative_heartbeat(core: CoreProcess) -> None:
    from tests.integration.test_core_link import raw_frame, read_close  # noqa: PLC0415 - its raw-frame helpers

    with socket.create_connection(("127.0.0.1", core.link_port), timeout=WAIT) as sock:
        sock.sendall(raw_frame([[1, [1], None, None, "x", -1, 1 << 20]]))
        ops = read_close(sock)
    assert ops[-1][:2] == [3, "malformed"]
