"""MQTT clients for the integration tests: paho-mqtt (an independent client, 3.1.1 and 5.0, TCP and WebSocket)
and a raw client that writes exactly the packets a test asks for and shows exactly what comes back."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions
from tests.conftest import CoreProcess, GatewayProcess, start_gateway, stop_cleanly

from tridentmq_mqtt.protocol.errors import RemoteProtocolError
from tridentmq_mqtt.protocol.packets import V5, Connect, Packet, PacketParser, encode

TIMEOUT = 10.0


class Paho:
    """A paho-mqtt client run by its own thread; received messages and disconnects land in queues. With
    ``reconnect`` (paho's default) a dropped connection is tried again every second or so: a client that is
    meant to stay away once the server ended its connection (a takeover) says ``reconnect=False``."""

    def __init__(
        self,
        port: int,
        client_id: str = "",
        *,
        version: int = 5,
        websocket: bool = False,
        clean: bool = True,
        username: str | None = None,
        password: str | None = None,
        reconnect: bool = True,
    ) -> None:
        self.version = version
        protocol = paho.MQTTv5 if version == 5 else paho.MQTTv311
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=protocol,
            transport="websockets" if websocket else "tcp",
            clean_session=None if version == 5 else clean,
            reconnect_on_failure=reconnect,
        )
        if websocket:
            self.client.ws_set_options(path="/mqtt")
        if username is not None:
            self.client.username_pw_set(username, password)
        self.port = port
        self.clean = clean
        self.messages: queue.Queue[paho.MQTTMessage] = queue.Queue()
        self.disconnects: queue.Queue[ReasonCode] = queue.Queue()
        self.connack: tuple[bool, ReasonCode, Any] | None = None
        self._connected = threading.Event()
        self.client.on_message = lambda _c, _u, message: self.messages.put(message)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda _c, _u, _f, reason, _p: self.disconnects.put(reason)

    def _on_connect(self, _c: Any, _u: Any, flags: Any, reason: ReasonCode, props: Any) -> None:
        self.connack = (bool(flags.session_present), reason, props)
        self._connected.set()

    def connect(
        self,
        *,
        expiry: int | None = None,
        will: tuple[str, bytes, int, bool] | None = None,
        will_delay: int | None = None,
        keepalive: int = 30,
    ) -> tuple[bool, ReasonCode, Any]:
        props = None
        if self.version == 5 and expiry is not None:
            props = PahoProperties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = expiry
        if will is not None:
            will_props = None
            if will_delay is not None:
                will_props = PahoProperties(PacketTypes.WILLMESSAGE)
                will_props.WillDelayInterval = will_delay
            self.client.will_set(will[0], will[1], will[2], will[3], properties=will_props)
        self._connected.clear()
        if self.version == 5:
            self.client.connect("127.0.0.1", self.port, keepalive=keepalive, clean_start=self.clean, properties=props)
        else:
            self.client.connect("127.0.0.1", self.port, keepalive=keepalive)
        self.client.loop_start()
        assert self._connected.wait(TIMEOUT), "no CONNACK"
        assert self.connack is not None
        return self.connack

    def subscribe(self, topic: str, qos: int = 0, **options: Any) -> list[Any]:
        """Subscribe and wait for the SUBACK; the granted QoS or reason codes."""
        done = threading.Event()
        granted: list[Any] = []

        def on_subscribe(_c: Any, _u: Any, _mid: int, codes: list[Any], _p: Any) -> None:
            granted.extend(codes)
            done.set()

        self.client.on_subscribe = on_subscribe
        if self.version == 5:
            self.client.subscribe(topic, options=SubscribeOptions(qos=qos, **options))
        else:
            self.client.subscribe(topic, qos)
        assert done.wait(TIMEOUT), "no SUBACK"
        return granted

    def publish(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, properties: PahoProperties | None = None
    ) -> paho.MQTTMessageInfo:
        info = self.client.publish(topic, payload, qos, retain, properties=properties)
        if qos:
            info.wait_for_publish(TIMEOUT)
            assert info.is_published(), "no PUBACK/PUBCOMP"
        return info

    def receive(self, count: int, timeout: float = TIMEOUT) -> list[paho.MQTTMessage]:
        received = []
        deadline = time.monotonic() + timeout
        while len(received) < count:
            try:
                received.append(self.messages.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                break
        return received

    def nothing_more(self, wait: float = 0.5) -> bool:
        time.sleep(wait)
        return self.messages.empty()

    def disconnect(self) -> None:
        self.client.disconnect()
        self.stop()

    def drop(self) -> None:
        """Vanish without DISCONNECT (the socket closes under the client)."""
        self.stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()

    def stop(self) -> None:
        """Stop the client's thread. paho leaves open the socket pair that woke that thread, which Python
        reports when it collects it (an error of the run with warnings as errors): it is closed here."""
        self.client.loop_stop()
        self.client._reset_sockets(sockpair_only=True)


class Raw:
    """Packets in and out over a plain socket, with our codec; nothing is answered automatically."""

    def __init__(self, port: int, version: int = V5) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.version = version
        self.parser = PacketParser(version=version)
        self.pending: list[Packet] = []

    def send(self, *packets: Packet) -> None:
        self.sock.sendall(b"".join(encode(p, self.version) for p in packets))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def connect(self, client_id: str, **fields: Any) -> Packet:
        self.send(Connect(client_id, **fields))
        return self.next()

    def next(self, timeout: float = TIMEOUT) -> Packet:
        """The next packet from the server (AssertionError when none comes, or the connection closes)."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise AssertionError("no packet from the server") from None
            assert data, "the server closed the connection"
            self.pending.extend(self.parser.feed(data))
        return self.pending.pop(0)

    def closed(self, timeout: float = TIMEOUT) -> bool:
        """Whether the server closes the connection (after whatever it sends first, which is dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
            if not data:
                return True
            with contextlib.suppress(RemoteProtocolError):
                self.pending.extend(self.parser.feed(data))
        return False

    def close(self) -> None:
        self.sock.close()


def silent(client: Raw, wait: float = 0.5) -> list[Packet]:
    """Whatever the server sends within ``wait`` seconds (a test expecting nothing asserts it is empty)."""
    got: list[Packet] = []
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        try:
            got.append(client.next(left))
        except AssertionError:
            break
    return got


@pytest.fixture
def raw() -> Iterator[Callable[..., Raw]]:
    """Raw clients, closed at the end of the test."""
    made: list[Raw] = []

    def make(port: int, version: int = V5) -> Raw:
        made.append(Raw(port, version))
        return made[-1]

    yield make
    for client in made:
        client.close()


@pytest.fixture
def replicas(tmp_path: Path, core: CoreProcess) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two MQTT gateways on the test module's ``core``: A (which a test may kill) and B (stopped cleanly at the end)."""
    a = start_gateway(tmp_path, core, "mqtt", name="gateway-a")
    b = start_gateway(tmp_path, core, "mqtt", name="gateway-b")
    yield a, b
    stop_cleanly(b)
    if a.process.poll() is None:
        stop_cleanly(a)
