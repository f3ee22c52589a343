"""What the web console needs from a core's management port, over real HTTP: its files with a strict
Content-Security-Policy, the refusal of cross-site state-changing requests, and a message's audit trail read
from the node's audit files (the browser itself: test_console.py)."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from tests.conftest import CoreProcess

from tridentmq_core.latency import BOUNDS_MS, percentile
from tridentmq_core.management.audit_trail import find_events
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import new_message

pytestmark = pytest.mark.integration


def call(
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_console_files_are_served_with_a_strict_policy(core: CoreProcess) -> None:
    status, headers, body = call(core.management_url + "/console/")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    assert b'<script src="console.js"' in body
    assert b"<script>" not in body
    policy = headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
    assert "connect-src 'self'" in policy
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["X-Content-Type-Options"] == "nosniff"
    for path in ("console.js", "console.css", "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/LICENSE"):
        status, _, body = call(f"{core.management_url}/console/{path}")
        assert status == 200, path
        assert body, path
    assert call(core.management_url + "/console/../app.py")[0] == 404
    assert call(core.management_url + "/console/console.py")[0] == 404  # only the console's own files
    # The root and the bare path lead to the console.
    request = urllib.request.Request(core.management_url + "/")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.url.endswith("/console/")


def test_a_state_changing_request_must_prove_it_comes_from_a_program(core: CoreProcess) -> None:
    """A form of another site can POST (with the browser's cached credentials): such a request is refused
    before anything else; with the marker header or a JSON body it goes on (here to a 405: a read-only path)."""
    url = core.management_url + "/api/status"
    status, _, body = call(url, "POST", {"Content-Type": "application/x-www-form-urlencoded"}, b"a=1")
    assert status == 403
    assert b"X-TridentMQ-Request" in body
    assert call(url, "POST", {"X-TridentMQ-Request": "1"})[0] == 405
    assert call(url, "POST", {"Content-Type": "application/json"}, b"{}")[0] == 405
    status, _, body = call(url, "POST", {"X-TridentMQ-Request": "1", "Origin": "http://evil.example"})
    assert status == 403
    assert b"another site" in body
    same = f"http://127.0.0.1:{core.management_port}"
    assert call(url, "POST", {"X-TridentMQ-Request": "1", "Origin": same})[0] == 405
    assert call(url, "DELETE")[0] == 405  # a browser asks (CORS preflight) before a cross-site DELETE: no marker
    assert call(url, "DELETE", {"Origin": "http://evil.example"})[0] == 403
    assert call(url)[0] == 200  # reads need nothing of this


async def test_the_audit_trail_of_a_message_lists_its_events(core: CoreProcess) -> None:
    async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as client:
        await client.create_queue("trail")
        await client.publish(new_message("trail", b"followed", durable=True))
        await client.publish(new_message("trail", b"other", durable=True))
        consumer = await client.subscribe("trail", credit=10)
        first = await consumer.get(timeout=10)
        second = await consumer.get(timeout=10)
        assert first is not None
        assert second is not None
        consumer.ack(first)
        consumer.nack(second, mode=NackMode.REJECT)  # dead-lettered: a copy with its own id
        await client.create_queue("ping")  # a round trip: the ack and nack were handled before its answer
    node_id = json.loads(call(core.management_url + "/api/status")[2])["node_id"]
    message_id = f"{node_id[:8]}-{first.id}"
    trail = _trail(core, message_id)
    assert [e["event"] for e in trail["events"]] == ["msg.sent", "msg.delivered", "msg.acked"], trail
    assert trail["complete"] is True
    assert all(e["message_id"] == message_id for e in trail["events"])
    assert _trail(core, f"{node_id[:8]}-{second.id}")["events"][-1]["event"] == "msg.dead_lettered"
    assert _trail(core, f"{node_id[:8]}-999999999")["events"] == []
    status, _, body = call(core.management_url + "/api/audit/messages/%22x%3C")
    assert status == 400
    assert b"message id" in body


async def test_the_latency_histogram_counts_every_acknowledged_message(core: CoreProcess) -> None:
    """After N acked messages the node's latency histogram has N more, and its percentiles lie within what
    the client measured (the first publish to the answer after the acks: longer than any message took)."""
    count = 40
    before = json.loads(call(core.management_url + "/api/status")[2])
    async with LinkClient("127.0.0.1", core.link_port, reconnect=ReconnectPolicy(attempts=0)) as client:
        await client.create_queue("timed")
        started = time.time()
        for n in range(count):
            await client.publish(new_message("timed", b"t%d" % n))
        consumer = await client.subscribe("timed", credit=count)
        for _ in range(count):
            delivery = await consumer.get(timeout=10)
            assert delivery is not None
            consumer.ack(delivery)
        await client.create_queue("ping")  # a round trip: the acks were handled before its answer
        longest_ms = (time.time() - started) * 1000
    after = json.loads(call(core.management_url + "/api/status")[2])
    for name in ("latency", "time_in_queue"):
        assert after[name]["le_ms"] == list(BOUNDS_MS)
        assert after[name]["count"] - before[name]["count"] == count, name
    counts = [b - a for a, b in zip(before["latency"]["counts"], after["latency"]["counts"], strict=True)]
    p50, p99, p100 = (percentile(counts, f) for f in (0.5, 0.99, 1.0))
    assert p50 is not None
    assert p99 is not None
    assert p100 is not None
    assert p50 <= p99 <= p100
    slowest = max(i for i, n in enumerate(counts) if n)
    floor_ms = BOUNDS_MS[slowest - 1] + 1 if slowest else 0  # the smallest latency the slowest bucket holds
    assert floor_ms <= math.ceil(longest_ms) + 1  # the ms clock of the node may round the other way
    assert after["latency"]["sum_ms"] - before["latency"]["sum_ms"] <= count * (math.ceil(longest_ms) + 1)
    metrics = call(core.management_url + "/metrics")[2].decode()
    assert f"tridentmq_message_latency_seconds_count {after['latency']['count']}" in metrics


def _trail(core: CoreProcess, message_id: str) -> dict[str, Any]:
    status, _, body = call(f"{core.management_url}/api/audit/messages/{message_id}")
    assert status == 200, body
    return dict(json.loads(body))


def test_the_audit_search_is_bounded_and_skips_a_line_it_cut(tmp_path: Any) -> None:
    folder = tmp_path / "audit" / "node-1"
    folder.mkdir(parents=True)
    lines = [json.dumps({"seq": n, "ts_us": n, "event": "msg.sent", "message_id": f"ab-{n % 3}"}) for n in range(30)]
    (folder / "00000000000000000000.jsonl").write_text("\n".join(lines) + "\n")
    (folder / ".active").mkdir()
    active = json.dumps({"seq": 30, "ts_us": 30, "event": "msg.acked", "message_id": "ab-0"})
    active += '\n{"seq": 31, "message_id": "ab-0"'  # the last line is still being written
    (folder / ".active" / "00000000000000000030.jsonl").write_text(active)
    events, complete = find_events(tmp_path / "audit", "ab-0")
    assert [e["seq"] for e in events] == [*range(0, 30, 3), 30]
    assert complete
    assert find_events(tmp_path / "audit", "ab-1", max_events=4)[0] == find_events(tmp_path / "audit", "ab-1")[0][:4]
    # The active file, the last two lines of the sealed one and a few bytes of the line before them.
    budget = len(active) + len(lines[-1]) + len(lines[-2]) + 2 + 5
    events, complete = find_events(tmp_path / "audit", "ab-2", max_bytes=budget)
    assert not complete
    assert [e["seq"] for e in events] == [29]
    assert find_events(tmp_path / "missing", "ab-0") == ([], True)
