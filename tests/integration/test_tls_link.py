"""TLS on the core's listeners: the link (clients, the CLI, cluster connections) and the management HTTP
server, with mutual TLS and certificate reload, against real core processes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, start_core
from tests.integration.cluster_nodes import (
    members,
    node_id,
    remote_consumers,
    start_node,
    wait_until,
    wait_until_async,
)
from tests.integration.ha_pairs import ha_view, start_pair
from tests.tls_certs import Certificates, Pair, replace

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message
from tridentmq_shared.tls import ClientTls, TlsSection

pytestmark = pytest.mark.integration

NO_RECONNECT = ReconnectPolicy(attempts=0)


def tls_env(certs: Certificates, server: Pair | None = None, client_certs: str = "none") -> dict[str, str]:
    server = server or certs.server
    return {
        "TRIDENTMQ_CORE_LINK_TLS": "true",
        "TRIDENTMQ_CORE_MANAGEMENT_TLS": "true",
        "TRIDENTMQ_CORE_TLS_CERT_FILE": str(server.cert),
        "TRIDENTMQ_CORE_TLS_KEY_FILE": str(server.key),
        "TRIDENTMQ_CORE_TLS_CA_FILE": str(certs.ca),
        "TRIDENTMQ_CORE_TLS_CLIENT_CERTS": client_certs,
    }


def client_tls(certs: Certificates, client: Pair | None = None) -> ClientTls:
    return ClientTls(
        TlsSection(
            ca_file=str(certs.ca),
            cert_file=str(client.cert) if client else "",
            key_file=str(client.key) if client else "",
        )
    )


def stop(node: CoreProcess) -> None:
    code = node.stop()
    assert code == 0, node.log()
    assert "Traceback" not in node.log(), node.log()


def presented_serial(port: int, certs: Certificates) -> int:
    """The serial number of the certificate the server presents to a new connection."""
    context = ssl.create_default_context(cafile=str(certs.ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        cert = tls.getpeercert()
    assert cert is not None
    return int(cert["serialNumber"], 16)


async def round_trip(port: int, tls: ClientTls | None, address: str) -> bytes:
    async with LinkClient("127.0.0.1", port, tls=tls, reconnect=NO_RECONNECT) as client:
        await client.create_queue(address)
        await client.publish(new_message(address, b"over tls", durable=True))
        consumer = await client.subscribe(address, credit=1)
        delivery = await consumer.get(timeout=10)
        assert delivery is not None
        consumer.ack(delivery)
        return delivery.body


async def test_link_and_management_over_tls_refuse_cleartext(tmp_path: Path, certs: Certificates) -> None:
    core = start_core(tmp_path, **tls_env(certs))
    try:
        assert await round_trip(core.link_port, client_tls(certs), "tls.orders") == b"over tls"
        with pytest.raises(LinkClosedError, match="connection lost during the handshake"):  # cleartext HELLO
            async with LinkClient("127.0.0.1", core.link_port, reconnect=NO_RECONNECT, connect_timeout=5):
                pass
        # A client that does not trust the server's authority is refused by its own check.
        with pytest.raises(LinkClosedError, match="CERTIFICATE_VERIFY_FAILED"):
            async with LinkClient(
                "127.0.0.1",
                core.link_port,
                reconnect=NO_RECONNECT,
                tls=ClientTls(TlsSection(ca_file=str(certs.client("x", "other").cert))),
            ):
                pass
        # Management over HTTPS, checked against the test authority.
        context = ssl.create_default_context(cafile=str(certs.ca))
        url = f"https://127.0.0.1:{core.management_port}/healthz"
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert json.loads(response.read()) == {"status": "ok"}
        # The CLI: produce over a TLS link, status over HTTPS.
        env = {**os.environ, "PYTHONWARNINGS": "error"}
        cli = [sys.executable, "-m", "tridentmq_shared.cli"]
        produce = [
            *cli,
            "produce",
            "tls.cli",
            "--count",
            "3",
            "--port",
            str(core.link_port),
            "--tls",
            "--ca-file",
            str(certs.ca),
        ]
        produced = await asyncio.to_thread(
            subprocess.run, produce, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert produced.returncode == 0, produced.stderr
        assert "3 message(s) confirmed on tls.cli" in produced.stdout
        status_command = [
            *cli,
            "status",
            "--json",
            "--management",
            f"https://127.0.0.1:{core.management_port}",
            "--ca-file",
            str(certs.ca),
        ]
        status = await asyncio.to_thread(
            subprocess.run, status_command, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["node_id"]
    finally:
        stop(core)


async def test_mutual_tls_required_refuses_a_client_without_a_trusted_certificate(
    tmp_path: Path, certs: Certificates
) -> None:
    core = start_core(tmp_path, **tls_env(certs, client_certs="required"))
    try:
        for refused in (client_tls(certs), client_tls(certs, certs.client("intruder", "other"))):
            # TLS 1.3: the client finishes its side before the server checks its certificate, so the
            # refusal shows as an alert or a closed connection while the link opens.
            with pytest.raises(LinkClosedError, match="cannot connect"):
                async with LinkClient("127.0.0.1", core.link_port, tls=refused, reconnect=NO_RECONNECT):
                    pass
        trusted = client_tls(certs, certs.client("gateway-1"))
        assert await round_trip(core.link_port, trusted, "mtls.orders") == b"over tls"
    finally:
        stop(core)


async def test_a_replaced_certificate_is_served_to_new_connections_without_a_restart(
    tmp_path: Path, certs: Certificates
) -> None:
    live = Pair(tmp_path / "live.pem", tmp_path / "live.key")
    replace(live, certs.server)
    core = start_core(tmp_path, **tls_env(certs, server=live))
    try:
        tls = client_tls(certs)
        # Its heartbeat is slow: this is about the certificate, and a loaded machine (the suite runs on several
        # workers) can keep the core quiet for the 4 default intervals (1 s) that declare a peer dead.
        async with LinkClient(
            "127.0.0.1", core.link_port, tls=tls, reconnect=NO_RECONNECT, heartbeat_ms=2000
        ) as before:
            assert await asyncio.to_thread(presented_serial, core.link_port, certs) == certs.server.serial()
            renewed = certs.another_server("renewed")
            replace(live, renewed)
            # The very next handshake gets the new certificate, on the link and on management (HTTPS).
            assert await asyncio.to_thread(presented_serial, core.link_port, certs) == renewed.serial()
            assert await asyncio.to_thread(presented_serial, core.management_port, certs) == renewed.serial()
            assert await round_trip(core.link_port, tls, "reload.after") == b"over tls"
            # The connection made before keeps working.
            await before.create_queue("reload.before")
        # A broken file is not taken: the last good certificate stays.
        live.cert.write_text("not a certificate")
        assert await asyncio.to_thread(presented_serial, core.link_port, certs) == renewed.serial()
        assert "TLS certificate not reloaded" in core.log()
    finally:
        stop(core)


async def test_cluster_connections_over_tls(tmp_path: Path, certs: Certificates) -> None:
    # Management stays HTTP here so the cluster helpers can read each node's view.
    settings = {**tls_env(certs, client_certs="required"), "TRIDENTMQ_CORE_MANAGEMENT_TLS": "false"}
    env = {f"core_{k.removeprefix('TRIDENTMQ_CORE_').lower()}": v for k, v in settings.items()}
    a = start_node(tmp_path, "a", **env)
    b = start_node(tmp_path, "b", [a], **env)
    try:
        joined = lambda: members(a) == members(b) == {node_id(a), node_id(b)}  # noqa: E731
        try:
            await asyncio.to_thread(wait_until, joined, what="two nodes joined over TLS")
        except AssertionError:
            raise AssertionError(a.log() + b.log()) from None
        # Their links are TLS with client certificates: a message crosses from one to the other.
        tls = client_tls(certs, certs.client("app"))
        async with LinkClient("127.0.0.1", b.link_port, tls=tls, reconnect=NO_RECONNECT) as consumer_side:
            await consumer_side.create_queue("cluster.tls")
            consumer = await consumer_side.subscribe("cluster.tls", credit=1)
            await wait_until_async(lambda: remote_consumers(a, "cluster.tls") == 1, what="a sees b's consumer")
            async with LinkClient("127.0.0.1", a.link_port, tls=tls, reconnect=NO_RECONNECT) as producer:
                await producer.create_queue("cluster.tls")
                await producer.publish(new_message("cluster.tls", b"across", durable=True))
            delivery = await consumer.get(timeout=15)
            assert delivery is not None
            assert delivery.body == b"across"
    finally:
        stop(b)
        stop(a)


async def test_replication_to_a_backup_and_its_takeover_over_tls(tmp_path: Path, certs: Certificates) -> None:
    settings = {**tls_env(certs, client_certs="required"), "TRIDENTMQ_CORE_MANAGEMENT_TLS": "false"}
    env = {f"core_{k.removeprefix('TRIDENTMQ_CORE_').lower()}": v for k, v in settings.items()}
    # In sync means the backup copied the primary's journal over its TLS replication link.
    pair = await asyncio.to_thread(start_pair, tmp_path, "tls", core_ha_activate_without_quorum="true", **env)
    tls = client_tls(certs, certs.client("app"))
    async with LinkClient("127.0.0.1", pair.primary.link_port, tls=tls, reconnect=NO_RECONNECT) as producer:
        await producer.create_queue("ha.tls")
        await producer.publish_batch(new_message("ha.tls", b"m%d" % n, durable=True) for n in range(100))
        await producer.publish(new_message("ha.tls", b"last", durable=True))
    pair.primary.process.kill()
    pair.primary.process.wait(timeout=10)
    await wait_until_async(lambda: ha_view(pair.backup).get("active") is True, what="the backup to take over")
    async with LinkClient("127.0.0.1", pair.backup.link_port, tls=tls, reconnect=NO_RECONNECT) as consumer_side:
        consumer = await consumer_side.subscribe("ha.tls", credit=200)
        bodies = []
        while len(bodies) < 101:
            delivery = await consumer.get(timeout=15)
            assert delivery is not None, f"{len(bodies)} of 101 messages after the takeover"
            consumer.ack(delivery)
            bodies.append(delivery.body)
    assert sorted(bodies) == sorted([b"m%d" % n for n in range(100)] + [b"last"])
    stop(pair.backup)
