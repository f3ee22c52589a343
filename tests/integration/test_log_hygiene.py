"""What clients send cannot forge log lines, and their bad input is one line, never an ERROR traceback.

Real core and gateway processes over real sockets; each case reads the process's log afterwards: every line
starts a record (a timestamp) or is an indented traceback line, the client's text shows up escaped, and
nothing is logged at ERROR.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from tests.conftest import CoreProcess, GatewayProcess, ServiceProcess, start_core
from tests.integration.test_amqp_bad_input import AMQP_HEADER, Peer, assert_closed_with, raw_frame
from tests.integration.test_amqp_bad_input import assert_serves as assert_amqp_serves
from tests.integration.test_core_link import USERS, read_close
from tests.integration.test_stomp_bad_input import assert_gateway_serves

pytestmark = pytest.mark.integration

WAIT = 10.0  # every wait ends as soon as its condition holds
RECORD = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ ")
FORGED = "x\n2026-11-28T00:00:00.000Z INFO tridentmq.core link opened user=admin\r\x1b[2J\u2028"


def link_frame(ops: object) -> bytes:
    payload = msgpack.packb(ops)
    return struct.pack(">I", len(payload)) + payload


def hello(user: str | None, password: str | None = None) -> bytes:
    return link_frame([[1, [1], user, password, "forger", 0, 1 << 20]])


def wait_for_log(process: ServiceProcess, text: str) -> str:
    deadline = time.monotonic() + WAIT
    while text not in (log := process.log()):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log}"
        time.sleep(0.05)
    return log


def assert_clean(log: str) -> None:
    """One record per line (continuations indented), nothing at ERROR or above, no traceback."""
    for line in log.splitlines():
        assert RECORD.match(line) or line.startswith("  "), f"a line that is no record: {line!r}"
    for worse in (" ERROR ", " CRITICAL ", "Traceback"):
        assert worse not in log, log


def test_a_user_name_cannot_forge_a_line_of_the_core_log(tmp_path: Path) -> None:
    core = start_core(tmp_path, config=USERS)
    try:
        with socket.create_connection(("127.0.0.1", core.link_port), timeout=WAIT) as sock:
            sock.sendall(hello(FORGED, "wrong"))
            ops = read_close(sock)
        assert ops[-1][:2] == [3, "unauthenticated"]
        log = wait_for_log(core, "link refused")
    finally:
        assert core.stop() == 0
    assert_clean(log)
    [refused] = [line for line in log.splitlines() if "link refused" in line]
    assert " WARNING tridentmq.core link refused " in refused
    assert r'user="x\n2026-11-28T00:00:00.000Z INFO tridentmq.core link opened user=admin\r\x1b[2J\u2028"' in refused


def test_an_accepted_user_name_is_escaped_too(core: CoreProcess) -> None:
    with socket.create_connection(("127.0.0.1", core.link_port), timeout=WAIT) as sock:
        sock.sendall(hello(FORGED))  # no users: loopback links are accepted with any name
        assert sock.recv(65536)  # the WELCOME
        log = wait_for_log(core, "link opened conn=")
    assert_clean(log)
    assert "link opened user=admin\\r" in log


def test_hello_and_close_in_one_write_is_no_error(core: CoreProcess) -> None:
    with socket.create_connection(("127.0.0.1", core.link_port), timeout=WAIT) as sock:
        sock.sendall(hello(None) + link_frame([[3, "bye", "just looking"]]))
        assert read_close(sock) == []  # nothing answers a link its peer already closed
    log = wait_for_log(core, "link closed by its peer during the handshake")
    assert_clean(log)


def test_an_mqtt_connect_then_a_half_close_is_no_error(mqtt_gateway: GatewayProcess) -> None:
    """The session ends quietly whether the end of input is seen while the login is checked (no CONNACK then)
    or after it (the gateway reads nothing more from a client until it is logged in)."""
    connect = bytes([0x10, 12]) + b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"  # 3.1.1, clean session, no client id
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", mqtt_gateway.port), timeout=WAIT) as sock:
            sock.sendall(connect)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):  # the gateway closes (after a CONNACK or without one)
                reply += chunk
        assert reply in (b"", b"\x20\x02\x00\x00"), reply
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="after-half-close")
    client.connect("127.0.0.1", mqtt_gateway.port)
    client.loop_start()
    try:
        client.publish("still/fine", b"x", qos=1).wait_for_publish(WAIT)
    finally:
        client.disconnect()
        client.loop_stop()
    assert_clean(mqtt_gateway.log())


def test_an_amqp_container_id_that_is_not_utf8_gets_a_decode_error(amqp_gateway: GatewayProcess) -> None:
    bad_open = b"\x00\x53\x10" + b"\xc0\x06\x01" + b"\xa1\x03\xff\xfe\xfd"  # open(container-id: str8 of 3 bytes)
    with Peer(amqp_gateway.port) as peer:
        peer.send(AMQP_HEADER, raw_frame(bad_open))
        assert peer.header() == AMQP_HEADER
        close = assert_closed_with(peer.until_closed(), "amqp:decode-error")
    assert "UTF-8" in str(close)
    log = wait_for_log(amqp_gateway, "amqp client sent a string that is not UTF-8")
    assert_clean(log)
    assert_amqp_serves(amqp_gateway, "after-bad-container")


BAD_REQUESTS = [
    b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad\x01Name: 1\r\n\r\n",
    b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


def http_exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_malformed_http_requests_get_400_and_one_warning_each(core: CoreProcess, stomp_gateway: GatewayProcess) -> None:
    ports = {
        "core": (core, core.management_port),
        "http": (stomp_gateway, stomp_gateway.ports["http"]),
        "websocket": (stomp_gateway, stomp_gateway.ports["websocket"]),
    }
    for process, port in ports.values():
        before = process.log().count("bad HTTP request refused")
        for request in BAD_REQUESTS:
            reply = http_exchange(port, request)
            assert re.match(rb"HTTP/1\.[01] 400 ", reply), reply[:200]
        deadline = time.monotonic() + WAIT
        while process.log().count("bad HTTP request refused") < before + len(BAD_REQUESTS):
            assert time.monotonic() < deadline, process.log()
            time.sleep(0.05)
    # A broken WebSocket handshake is answered 400 by the handler itself: nothing worth a line.
    with socket.create_connection(("127.0.0.1", stomp_gateway.ports["websocket"]), timeout=WAIT) as sock:
        sock.sendall(
            b"GET /stomp HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: !!\r\n\r\n"
        )
        reply = sock.recv(65536)  # the connection stays open (keep-alive): the status line is enough
    assert re.match(rb"HTTP/1\.[01] 400 ", reply), reply[:200]
    for process, _ in ports.values():
        assert_clean(process.log())
    assert_gateway_serves(stomp_gateway, "after-bad-http")
