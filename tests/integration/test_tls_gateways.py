"""TLS on the gateways: STOMP, MQTT and AMQP over TLS and over WebSocket over TLS, HTTPS health, each
gateway's link to a TLS-only core with mutual TLS, and client certificates on the gateways' listeners.
Real clients throughout: stomp.py, paho-mqtt, python-qpid-proton, websocket-client, urllib."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp
import websocket
from proton import Message as AmqpMessage
from proton import SSLDomain
from proton.utils import BlockingConnection
from tests.conftest import CoreProcess, GatewayProcess, start_core, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Paho
from tests.integration.test_stomp_gateway import Listener
from tests.tls_certs import Certificates, Pair

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy

pytestmark = pytest.mark.integration

WAIT = 10.0


@pytest.fixture
def tls_core(tmp_path: Path, certs: Certificates) -> Iterator[CoreProcess]:
    """A core whose link is TLS only and asks every link for a trusted client certificate."""
    node = start_core(
        tmp_path,
        TRIDENTMQ_CORE_LINK_TLS="true",
        TRIDENTMQ_CORE_TLS_CERT_FILE=str(certs.server.cert),
        TRIDENTMQ_CORE_TLS_KEY_FILE=str(certs.server.key),
        TRIDENTMQ_CORE_TLS_CA_FILE=str(certs.ca),
        TRIDENTMQ_CORE_TLS_CLIENT_CERTS="required",
    )
    yield node
    assert node.stop() == 0, node.log()
    assert "Traceback" not in node.log(), node.log()


def tls_gateway(
    tmp_path: Path, core: CoreProcess, kind: str, certs: Certificates, client_certs: str = "none", **env: str
) -> GatewayProcess:
    prefix = f"TRIDENTMQ_{kind.upper()}"
    settings = {
        "LISTENER_TLS_PORT": "0",
        "LISTENER_WEBSOCKET_TLS_PORT": "0",
        "HTTP_TLS": "true",
        "CORE_TLS": "true",
        # Its certificate serves its listeners and is its client certificate towards the core.
        "TLS_CERT_FILE": str(certs.server.cert),
        "TLS_KEY_FILE": str(certs.server.key),
        "TLS_CA_FILE": str(certs.ca),
        "TLS_CLIENT_CERTS": client_certs,
    }
    return start_gateway(tmp_path, core, kind, **{**{f"{prefix}_{k}": v for k, v in settings.items()}, **env})


def client_context(certs: Certificates, client: Pair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def https_ready(gateway: GatewayProcess, certs: Certificates) -> dict[str, object]:
    url = f"https://127.0.0.1:{gateway.ports['http']}/readyz"
    with urllib.request.urlopen(url, context=client_context(certs), timeout=WAIT) as response:
        return dict(json.loads(response.read()))


def test_stomp_over_tls_and_wss(tmp_path: Path, tls_core: CoreProcess, certs: Certificates) -> None:
    gateway = tls_gateway(tmp_path, tls_core, "stomp", certs)
    try:
        assert https_ready(gateway, certs)["status"] == "ready"
        port = gateway.ports["stomp_tls"]
        conn = stomp.Connection12([("127.0.0.1", port)])
        conn.set_ssl(for_hosts=[("127.0.0.1", port)], ca_certs=str(certs.ca))
        listener = Listener()
        conn.set_listener("tls", listener)
        conn.connect(wait=True)
        conn.subscribe("/queue/tls", id="s", ack="auto")
        conn.send("/queue/tls", "over tls", receipt="sent")
        assert listener.wait_messages(1)[0].body == "over tls"
        conn.disconnect()
        ws_port = gateway.ports["websocket_tls"]
        ws = stomp.WSConnection([("127.0.0.1", ws_port)], ws_path="/stomp")
        ws.set_ssl(for_hosts=[("127.0.0.1", ws_port)], ca_certs=str(certs.ca))
        ws_listener = Listener()
        ws.set_listener("wss", ws_listener)
        ws.connect(wait=True)
        ws.subscribe("/queue/wss", id="w", ack="auto")
        ws.send("/queue/wss", "over wss")
        assert ws_listener.wait_messages(1)[0].body == "over wss"
        ws.disconnect()
    finally:
        stop_cleanly(gateway)
    assert "eof_received" not in gateway.log()  # a TLS client's close is no warning


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_mqtt_over_tls_and_wss(tmp_path: Path, tls_core: CoreProcess, certs: Certificates) -> None:
    gateway = tls_gateway(tmp_path, tls_core, "mqtt", certs)
    try:
        assert https_ready(gateway, certs)["status"] == "ready"
        subscriber = Paho(gateway.ports["websocket_tls"], "wss-sub", websocket=True)
        subscriber.client.tls_set(ca_certs=str(certs.ca))
        subscriber.connect()
        assert subscriber.subscribe("tls/t", 1) == [1]
        publisher = Paho(gateway.ports["mqtt_tls"], "tls-pub")
        publisher.client.tls_set(ca_certs=str(certs.ca))
        publisher.connect()
        publisher.publish("tls/t", b"over tls", 1)
        assert [m.payload for m in subscriber.receive(1)] == [b"over tls"]
        for client in (publisher, subscriber):
            client.disconnect()
            # paho closes the loopback socket pair that wakes its loop only when the client is collected,
            # and in a reference cycle the pair's own finaliser may warn first: close it now, and collect
            # whatever is left here rather than at the end of the session.
            client.client._reset_sockets()
        del publisher, subscriber, client
        gc.collect()
    finally:
        stop_cleanly(gateway)


def test_amqp_over_amqps_and_wss(tmp_path: Path, tls_core: CoreProcess, certs: Certificates) -> None:
    gateway = tls_gateway(tmp_path, tls_core, "amqp", certs)
    try:
        assert https_ready(gateway, certs)["status"] == "ready"
        domain = SSLDomain(SSLDomain.MODE_CLIENT)
        domain.set_trusted_ca_db(str(certs.ca))
        domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
        conn = BlockingConnection(
            f"amqps://127.0.0.1:{gateway.ports['amqp_tls']}", timeout=WAIT, ssl_domain=domain, virtual_host="localhost"
        )
        try:
            receiver = conn.create_receiver("tls.amqp")
            conn.create_sender("tls.amqp").send(AmqpMessage(body="over amqps"))
            message = receiver.receive(timeout=WAIT)
            receiver.accept()
            assert message.body == "over amqps"
        finally:
            conn.close()
        # AMQP over wss: the gateway answers the SASL protocol header and offers its mechanisms.
        assert _amqp_wss_header(gateway.ports["websocket_tls"], certs).startswith(b"AMQP\x03\x01\x00\x00")
    finally:
        stop_cleanly(gateway)


def _amqp_wss_header(port: int, certs: Certificates) -> bytes:
    # websocket-client (stomp.py's): its socket is closed when close() returns, unlike an aiohttp session's
    # TLS transport, which may still be closing when the event loop ends.
    ws = websocket.create_connection(
        f"wss://127.0.0.1:{port}/", subprotocols=["amqp"], timeout=WAIT, sslopt={"ca_certs": str(certs.ca)}
    )
    try:
        ws.send_binary(b"AMQP\x03\x01\x00\x00")
        received = b""
        while len(received) <= 8:  # the header, then the sasl-mechanisms frame
            received += ws.recv()
        return received
    finally:
        ws.close()


#: An MQTT 3.1.1 CONNECT: clean session, keep-alive 60 s, empty client id.
CONNECT = b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"


def mqtt_connack_over_tls(port: int, context: ssl.SSLContext) -> bytes:
    """What the gateway answers a CONNECT with over TLS; b"" when the TLS layer refused the client."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(CONNECT)
                return tls.recv(4)
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            # Refused in the handshake (TLS 1.2), or just after it (TLS 1.3: the client's side completes
            # before the server has checked its certificate).
            return b""


def test_a_listener_requiring_client_certificates_refuses_a_client_without_one(
    tmp_path: Path, tls_core: CoreProcess, certs: Certificates
) -> None:
    # Cleartext TCP off: TLS with a client certificate is the only way in (besides WebSocket over TLS).
    gateway = tls_gateway(
        tmp_path,
        tls_core,
        "mqtt",
        certs,
        client_certs="required",
        TRIDENTMQ_MQTT_LISTENER_PORT="-1",
        TRIDENTMQ_MQTT_LISTENER_WEBSOCKET_PORT="-1",
    )
    assert set(gateway.ports) == {"mqtt_tls", "websocket_tls", "http"}
    port = gateway.ports["mqtt_tls"]
    try:
        assert mqtt_connack_over_tls(port, client_context(certs)) == b""
        assert mqtt_connack_over_tls(port, client_context(certs, certs.client("intruder", "other"))) == b""
        assert mqtt_connack_over_tls(port, client_context(certs, certs.client("device-1"))) == b"\x20\x02\x00\x00"
    finally:
        stop_cleanly(gateway)


ALL_PERMISSIONS = (
    "send",
    "consume",
    "browse",
    "createAddress",
    "deleteAddress",
    "createDurableQueue",
    "deleteDurableQueue",
    "createNonDurableQueue",
    "deleteNonDurableQueue",
    "manage",
)
DEVICE_CONFIG = (
    '[link]\nproxy_users = ["gw"]\n'
    '[[users]]\nname = "gw"\npassword = "gw-secret"\nroles = ["gateway"]\n'
    '[[users]]\nname = "device-1"\npassword = "not-used-by-the-device"\nroles = ["device"]\n'
    + "".join(f'[[permissions]]\nmatch = "#"\npermission = "{p}"\nroles = ["gateway"]\n' for p in ALL_PERMISSIONS)
    + "".join(
        f'[[permissions]]\nmatch = "#"\npermission = "{p}"\nroles = ["device"]\n'
        for p in ALL_PERMISSIONS
        if p not in ("consume", "browse")
    )
    + '[[permissions]]\nmatch = "telemetry.#"\npermission = "consume"\nroles = ["device"]\n'
)


def test_mqtt_device_certificates_are_users_with_their_permissions(tmp_path: Path, certs: Certificates) -> None:
    core = start_core(tmp_path, config=DEVICE_CONFIG)
    gateway = tls_gateway(
        tmp_path,
        core,
        "mqtt",
        certs,
        client_certs="required",
        TRIDENTMQ_MQTT_CORE_TLS="false",
        TRIDENTMQ_MQTT_CORE_USER="gw",
        TRIDENTMQ_MQTT_CORE_PASSWORD="gw-secret",
        TRIDENTMQ_MQTT_MQTT_USE_IDENTITY_AS_USERNAME="true",
    )
    clients: list[Paho] = []

    def device(name: str) -> Paho:
        pair = certs.client(name)
        # The user name and password it sends are ignored: its certificate says who it is.
        client = Paho(gateway.ports["mqtt_tls"], name, username="mallory", password="guess")
        client.client.tls_set(ca_certs=str(certs.ca), certfile=str(pair.cert), keyfile=str(pair.key))
        clients.append(client)
        return client

    try:
        known = device("device-1")
        assert int(known.connect()[1].value) == 0
        assert [int(getattr(c, "value", c)) for c in known.subscribe("telemetry/+", 1)] == [1]
        assert [int(getattr(c, "value", c)) for c in known.subscribe("admin/#", 1)] == [0x87]  # its permissions
        known.publish("telemetry/device-1", b"21.5", 1)
        assert [m.payload for m in known.receive(1)] == [b"21.5"]
        # A certificate from the trusted authority for a user the core does not know is refused.
        unknown = device("device-2")
        assert int(unknown.connect()[1].value) == 0x86
        assert "acting_for=device-2" in core.log()
        # Only link.proxy_users may act for another user: a device's own login cannot become the gateway.
        with pytest.raises(LinkRequestError, match="may not open links for other users"):
            asyncio.run(_open_link(core.link_port, "device-1", "not-used-by-the-device", acting_for="gw"))
        known.disconnect()
    finally:
        for client in clients:
            client.client.loop_stop()
            client.client._reset_sockets()  # see test_mqtt_over_tls_and_wss
        clients.clear()
        gc.collect()
        stop_cleanly(gateway)
        assert core.stop() == 0, core.log()
        assert "Traceback" not in core.log()


async def _open_link(port: int, user: str, password: str, *, acting_for: str) -> None:
    async with LinkClient(
        "127.0.0.1", port, user=user, password=password, acting_for=acting_for, reconnect=ReconnectPolicy(attempts=0)
    ):
        pass
