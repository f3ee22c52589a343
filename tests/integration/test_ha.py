"""High availability against real core processes: replication pairs, quorum takeover, epoch fencing."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, start_core, start_gateway, stop_cleanly
from tests.disks import fill, tmpfs
from tests.integration.cluster_nodes import (
    CLUSTER_PASSWORD,
    CLUSTER_USER,
    client,
    cluster_env,
    cluster_view,
    node_id,
    remote_consumers,
    start_node,
    wait_converged,
    wait_until,
    wait_until_async,
)
from tests.integration.ha_pairs import Pair, ha_view, start_pair
from tests.integration.mqtt_clients import Paho
from tests.jepsen.checker import Delivery, check

from tridentmq_mqtt.convert import subscription_queue
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.peer import PeerLink
from tridentmq_shared.link.topology import Topology
from tridentmq_shared.message import new_message

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.fault]

FENCED_EXIT_CODE = 3
NO_RETRY = ReconnectPolicy(attempts=0)


async def publish(node: CoreProcess, address: str, bodies: list[bytes]) -> None:
    async with client(node) as c:
        futures = await c.publish_batch(new_message(address, body, durable=True) for body in bodies)
        await asyncio.gather(*futures)


async def drain(node: CoreProcess, queue: str, expected: int, timeout: float = 10.0) -> list[bytes]:
    """Consume and acknowledge until ``expected`` messages came or nothing more arrives."""
    got: list[bytes] = []
    async with client(node) as c:
        consumer = await c.subscribe(queue, credit=1000)
        while len(got) < expected:
            delivery = await consumer.get(timeout=timeout if not got else 2.0)
            if delivery is None:
                break
            got.append(delivery.body)
            consumer.ack(delivery)
        await consumer.close()  # answered once the node has taken every acknowledgement sent before it
    return got


def readyz(node: CoreProcess) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(node.management_url + "/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def kill(node: CoreProcess) -> None:
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(timeout=10)


def three_pairs(tmp_path: Path) -> list[Pair]:
    first = start_pair(tmp_path, "a")
    pairs = [first, start_pair(tmp_path, "b", [first.primary]), start_pair(tmp_path, "c", [first.primary])]
    wait_converged([p.primary for p in pairs])
    # Each backup learns the cluster's members from its primary: all three are voters.
    wait_until(lambda: all(ha_view(p.backup).get("pairs") == 3 for p in pairs), 10, "backups to see 3 pairs")
    return pairs


async def test_backup_takes_over_a_killed_primary_with_every_confirmed_message(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, "solo", core_ha_activate_without_quorum="true")
    primary_id = node_id(pair.primary)
    status, body = readyz(pair.backup)
    assert (status, body["status"], body["in_sync"]) == (503, "backup", True)
    with pytest.raises(LinkRequestError, match="backup"):  # a backup serves no client
        async with LinkClient("127.0.0.1", pair.backup.link_port, reconnect=ReconnectPolicy(attempts=0)):
            pass
    bodies = [b"m%d" % i for i in range(3000)]
    await publish(pair.primary, "orders", bodies)
    kill(pair.primary)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, 10, "the backup to take over")
    view = ha_view(pair.backup)
    assert view["epoch"] == 2
    assert node_id(pair.backup) == primary_id  # the pair keeps its identity
    assert sorted(await drain(pair.backup, "orders", len(bodies))) == sorted(bodies)
    assert "backup activated" in pair.backup.log()
    assert pair.backup.stop() == 0


async def test_single_pair_backup_waits_without_a_quorum(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, "alone")
    await publish(pair.primary, "q", [b"x"])
    kill(pair.primary)
    wait_until(lambda: "votes" in str(ha_view(pair.backup).get("state", "")), 10, "the backup to count votes")
    await asyncio.sleep(1.0)
    view = ha_view(pair.backup)
    assert view["active"] is False, view
    assert "0 of 1 votes" in str(view["state"])
    assert readyz(pair.backup)[0] == 503
    assert pair.backup.stop() == 0


def test_backup_of_another_group_is_refused(tmp_path: Path) -> None:
    primary = start_node(tmp_path, "p", core_ha_policy="replication", core_ha_group_name="east")
    backup = start_node(
        tmp_path, "b", [primary], core_ha_policy="replication", core_ha_group_name="west", core_ha_role="backup"
    )
    wait_until(lambda: "refused" in str(ha_view(backup).get("state", "")), 10, "the refusal")
    assert "'west' is not this pair's ('east')" in str(ha_view(backup)["state"])
    assert "backup refused: another group" in primary.log()
    assert ha_view(primary)["backup"] == ""
    assert backup.stop() == 0
    assert primary.stop() == 0


async def test_backup_killed_primary_mid_copy_never_activates_with_partial_data(tmp_path: Path) -> None:
    """A backup whose copy is not whole stays passive even when allowed to take over without a quorum."""
    primary = start_node(tmp_path, "p", core_ha_policy="replication", core_ha_group_name="g", core_ha_sync_window="50")
    await publish(primary, "big", [b"%06d" % i + b"." * 2000 for i in range(20_000)])
    backup = start_node(
        tmp_path,
        "b",
        [primary],
        core_ha_policy="replication",
        core_ha_group_name="g",
        core_ha_role="backup",
        core_ha_activate_without_quorum="true",
    )
    wait_until(lambda: ha_view(backup).get("state") == "copying", 10, "the copy to start")
    kill(primary)
    wait_until(lambda: "before the copy was whole" in str(ha_view(backup).get("state", "")), 10, "the loss")
    await asyncio.sleep(0.5)
    assert ha_view(backup)["active"] is False
    assert "backup activated" not in backup.log()
    assert backup.stop() == 0


async def test_quorum_of_three_pairs_activates_the_backup_of_a_killed_primary(tmp_path: Path) -> None:
    pairs = three_pairs(tmp_path)
    a, b, c = pairs
    bodies = [b"b%d" % i for i in range(1000)]
    await publish(b.primary, "on-b", bodies)
    b_id = node_id(b.primary)
    kill(b.primary)
    wait_until(lambda: ha_view(b.backup).get("active") is True, 15, "b's backup to take over")
    assert "quorum reached" in b.backup.log()
    assert ha_view(b.backup)["epoch"] == 2
    # The other primaries follow the pair to its new address; the queue's messages are all there.
    wait_converged([a.primary, b.backup, c.primary])
    assert node_id(b.backup) == b_id
    assert sorted(await drain(b.backup, "on-b", len(bodies))) == sorted(bodies)
    for pair in (a, c):
        assert pair.primary.stop() == 0
        assert pair.backup.stop() == 0
    assert b.backup.stop() == 0


async def test_primary_that_loses_its_backup_goes_on_with_a_quorum(tmp_path: Path) -> None:
    a, b, c = three_pairs(tmp_path)
    kill(a.backup)
    wait_until(
        lambda: ha_view(a.primary).get("backup") == "" and not ha_view(a.primary)["waiting_for_quorum"],
        10,
        "the primary to go on alone",
    )
    await asyncio.wait_for(publish(a.primary, "after", [b"1", b"2"]), 10)
    assert "quorum agrees: going on without the backup" in a.primary.log()
    for node in (a.primary, b.primary, b.backup, c.primary, c.backup):
        assert node.stop() == 0


@pytest.mark.parametrize("first_fault", ["backup killed", "primary restarted"])
async def test_a_backup_whose_primary_confirmed_more_after_losing_it_never_takes_over(
    tmp_path: Path, first_fault: str
) -> None:
    """Two faults in a row in one pair. First the primary serves without its backup: the backup was killed
    (the primary goes on alone with a quorum), or the backup was paused while the primary restarted. The
    primary confirms more, then it is killed too. The backup's copy lacks those messages: it must not win a
    vote with it (it did, at the epoch after its copy's), and the returned primary serves every message."""
    a, b, c = three_pairs(tmp_path)
    before = [b"p%d" % i for i in range(100)]
    await publish(b.primary, "twice.q", before)
    ha = {"core_ha_policy": "replication", "core_ha_group_name": "b"}
    backup = b.backup
    if first_fault == "backup killed":
        kill(backup)
        wait_until(
            lambda: ha_view(b.primary).get("backup") == "" and not ha_view(b.primary)["waiting_for_quorum"],
            10,
            "b's primary to go on alone",
        )
        primary = b.primary
    else:
        backup.process.send_signal(signal.SIGSTOP)
        kill(b.primary)
        primary = start_node(tmp_path, "b-primary", [a.primary], **ha)
        wait_until(lambda: ha_view(primary).get("active") is True, 15, "b's primary to serve again")
    assert ha_view(primary)["epoch"] == 2  # a new epoch: the backup's copy is of epoch 1
    alone = [b"a%d" % i for i in range(100)]
    await publish(primary, "twice.q", alone)
    kill(primary)
    if first_fault == "backup killed":
        backup = start_node(tmp_path, "b-backup", [b.primary, a.primary], core_ha_role="backup", **ha)
    else:
        backup.process.send_signal(signal.SIGCONT)
    wait_until(
        lambda: "newer than this copy's 1: copying the active node" in backup.log(),
        20,
        "the backup to learn that its copy is stale",
    )
    assert ha_view(backup)["active"] is False
    primary = start_node(tmp_path, "b-primary", [a.primary], **ha)
    wait_until(lambda: ha_view(primary).get("active") is True, 15, "b's primary to serve again")
    assert ha_view(primary)["epoch"] == 3
    assert sorted(await drain(primary, "twice.q", 200)) == sorted(before + alone)
    wait_until(lambda: ha_view(backup).get("in_sync") is True, 20, "the backup to copy the primary again")
    for node in (backup, primary, a.primary, a.backup, c.primary, c.backup):
        assert node.stop() == 0


async def test_paused_primary_confirms_nothing_after_waking_and_is_fenced(tmp_path: Path) -> None:
    """SIGSTOP a primary while a producer publishes to it; its backup takes over; SIGCONT: the old primary
    must not confirm a publish sent while it stood still, and every confirmed message is on the new active.

    The producer's link outlives the pause (a 1 s heartbeat: 4 s of silence allowed), as a client's does
    whose heartbeat is slower than a takeover; the woken primary reads what it sent meanwhile, and what
    the backup acknowledged before it took over, before it hears of the takeover. A confirm the primary
    decided just before the SIGSTOP may reach the client after it wakes (its bytes were not yet written):
    that message is on the backup, which the drain below checks."""
    a, b, c = three_pairs(tmp_path)
    attempted: list[bytes] = []
    confirmed: list[bytes] = []
    rejected: list[bytes] = []
    confirmed_after_wake: list[bytes] = []
    woke = asyncio.Event()
    stop = asyncio.Event()

    def settled(body: bytes, future: asyncio.Future[None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        confirmed.append(body)
        if woke.is_set():
            confirmed_after_wake.append(body)

    async def produce() -> None:
        async with LinkClient("127.0.0.1", a.primary.link_port, reconnect=NO_RETRY, heartbeat_ms=1000) as producer:
            i = 0
            while not stop.is_set():
                body = b"v%d" % i
                i += 1
                attempted.append(body)
                try:
                    (future,) = await asyncio.wait_for(
                        producer.publish_batch([new_message("fence.q", body, durable=True)]), 1
                    )
                except (TimeoutError, LinkRequestError):
                    break
                future.add_done_callback(lambda f, body=body: settled(body, f))
                await asyncio.sleep(0.001)

    producing = asyncio.create_task(produce())
    await wait_until_async(lambda: len(confirmed) >= 50, 10, "messages confirmed before the pause")
    a.primary.process.send_signal(signal.SIGSTOP)
    sent_before_pause = len(attempted)
    try:
        await asyncio.to_thread(wait_until, lambda: ha_view(a.backup).get("active") is True, 15, "the takeover")
    finally:
        woke.set()
        a.primary.process.send_signal(signal.SIGCONT)
    assert await asyncio.to_thread(a.primary.process.wait, 15) == FENCED_EXIT_CODE
    stop.set()
    await asyncio.wait_for(producing, 10)
    assert "fenced" in a.primary.log()
    sent_while_paused = set(attempted[sent_before_pause:])
    assert sent_while_paused, "the producer sent nothing while the primary stood still"
    assert [body for body in confirmed_after_wake if body in sent_while_paused] == []
    delivered = await drain(a.backup, "fence.q", len(confirmed))
    verdict = check(attempted, confirmed, rejected, delivered)
    assert verdict.ok, verdict.report()
    for node in (a.backup, b.primary, b.backup, c.primary, c.backup):
        assert node.stop() == 0


async def test_a_link_client_follows_its_pair_to_the_backup(tmp_path: Path) -> None:
    """The client knows only the primary; the topology tells it the backup, where it resumes its session."""
    pair = start_pair(tmp_path, "follow", core_ha_activate_without_quorum="true")
    async with LinkClient("127.0.0.1", pair.primary.link_port, follow_topology=True) as c:
        primary, backup = ("127.0.0.1", pair.primary.link_port), ("127.0.0.1", pair.backup.link_port)
        await asyncio.to_thread(wait_until, lambda: c.nodes.backup_of(primary) == backup, 10, "the backup named")
        consumer = await c.subscribe("follow.q", credit=100)
        await c.publish(new_message("follow.q", b"before", durable=True))
        first = await consumer.get(timeout=5)
        assert first is not None
        assert first.body == b"before"
        consumer.ack(first)
        kill(pair.primary)
        await asyncio.wait_for(c.publish(new_message("follow.q", b"after", durable=True)), 10)
        assert c.port == pair.backup.link_port
        # The acknowledgement of "before" may have died with the primary: then it comes again, flagged.
        second = await consumer.get(timeout=5)
        while second is not None and second.body == b"before":
            assert second.redelivered
            consumer.ack(second)
            second = await consumer.get(timeout=5)
        assert second is not None
        assert second.body == b"after"
        consumer.ack(second)
        assert c.nodes.epochs[c.node_id] == 2
        # The old primary's data started again as a plain node (a mistake): a client that knows the pair's
        # newer epoch refuses that copy.
        stale = start_core(tmp_path, "follow-primary")
        refusing = LinkClient(
            topology=Topology([("127.0.0.1", stale.link_port)]), reconnect=ReconnectPolicy(attempts=0)
        )
        refusing.nodes.saw(c.node_id, 2)
        try:
            with pytest.raises(LinkRequestError, match="epoch 2 replaced it"):
                await refusing.connect()
        finally:
            await refusing.close()
        # Stopped from a thread: the loop goes on serving ``c`` (a blocked loop misses its heartbeats).
        assert await asyncio.to_thread(stale.stop) == 0
    assert await asyncio.to_thread(pair.backup.stop) == 0


def test_an_mqtt_session_carries_on_through_the_backup(tmp_path: Path) -> None:
    """An MQTT client of a gateway linked to the primary stays connected while the pair fails over; its QoS 1
    messages keep flowing, none acknowledged is lost; a QoS 0 subscriber of the gateway's fan-out carries on."""
    pair = start_pair(tmp_path, "mqtt", core_ha_activate_without_quorum="true")
    gateway = start_gateway(tmp_path, pair.primary, "mqtt")
    subscriber = Paho(gateway.port, "ha-sub", clean=False)
    subscriber.connect(expiry=300)
    subscriber.subscribe("ha/t", 1)
    fanned = Paho(gateway.port, "ha-fan")  # QoS 0 and clean: served by the gateway's fan-out
    fanned.connect()
    fanned.subscribe("ha/t", 0)
    publisher = Paho(gateway.port, "ha-pub")
    publisher.connect()
    for i in range(20):
        publisher.publish("ha/t", b"%d" % i, 1)
    assert sorted(m.payload for m in subscriber.receive(20)) == sorted(b"%d" % i for i in range(20))
    assert [m.payload for m in fanned.receive(20)] == [b"%d" % i for i in range(20)]
    kill(pair.primary)
    for i in range(20, 40):
        publisher.publish("ha/t", b"%d" % i, 1)  # waits for PUBACK: the gateway moved its links to the backup
    expected = {b"%d" % i for i in range(20, 40)}
    got: set[bytes] = set()
    for message in subscriber.receive(25, timeout=3):
        if message.payload in expected:
            got.add(message.payload)
        else:  # an acknowledgement that died with the primary: delivered again, flagged as such
            assert message.dup, message.payload
            assert int(message.payload) < 20
    assert got == expected
    # QoS 0 is at most once: what was published while the fan-out's own link moved may be missed, but the
    # subscription carries on through the backup, on the same connection.
    deadline = time.monotonic() + 10
    late: list[bytes] = []
    while b"late" not in late and time.monotonic() < deadline:
        publisher.publish("ha/t", b"late", 1)
        late += [m.payload for m in fanned.receive(1, timeout=0.2)]
    assert b"late" in late
    assert fanned.disconnects.empty()
    fanned.disconnect()
    publisher.disconnect()
    subscriber.disconnect()
    stop_cleanly(gateway)
    assert pair.backup.stop() == 0


def test_an_mqtt_subscription_on_a_killed_primary_gets_what_another_node_acknowledged_during_the_failover(
    tmp_path: Path,
) -> None:
    """Issue 21: while a pair failed over, the other nodes had dropped its bindings, and a QoS 1 publish through
    them that matched no other queue was PUBACKed and routed nowhere. The persistent subscription on the lost
    primary stays a destination: what is acknowledged meanwhile waits on the publisher's node for the backup."""
    a, b, c = three_pairs(tmp_path)
    c_id = node_id(c.primary)
    pinned = {"TRIDENTMQ_MQTT_CORE_LOAD_BALANCING": "FIRST_ELEMENT"}  # each gateway's links on its own node
    on_c = start_gateway(tmp_path, c.primary, "mqtt", name="mqtt-c", **pinned)
    on_a = start_gateway(tmp_path, a.primary, "mqtt", name="mqtt-a", **pinned)
    subscriber = Paho(on_c.port, "gap-sub", clean=False)
    subscriber.connect(expiry=300)
    subscriber.subscribe("gap/t", 1)
    wait_until(
        lambda: remote_consumers(a.primary, subscription_queue("gap-sub", "gap/t")) == 1,
        10,
        "a to see the subscription on c",
    )
    publisher = Paho(on_a.port, "gap-pub")
    publisher.connect()
    attempted: list[bytes] = []
    waited_on_a = 0  # the most messages seen waiting on a for c's pair: the gap was exercised

    def publish(count: int) -> None:
        for _ in range(count):
            attempted.append(b"%d" % len(attempted))
            publisher.publish("gap/t", attempted[-1], 1)  # returns once PUBACKed

    publish(50)
    kill(c.primary)
    while ha_view(c.backup).get("active") is not True:
        publish(10)
        waiting = cluster_view(a.primary)["unreachable"].get(c_id)
        waited_on_a = max(waited_on_a, waiting["pending_forward"] if waiting else 0)
        assert len(attempted) < 20_000, "c's backup did not take over"
    publish(50)
    delivered: list[Delivery[bytes]] = []
    while set(attempted) - {d.value for d in delivered}:
        got = subscriber.receive(len(attempted), timeout=15)
        if not got:
            break
        delivered += [Delivery(m.payload, bool(m.dup)) for m in got]
    verdict = check(attempted, attempted, [], delivered)
    assert verdict.ok, verdict.report()
    assert waited_on_a > 0
    assert subscriber.disconnects.empty()  # a pause, not a disconnect
    for client_ in (subscriber, publisher):
        client_.disconnect()
    for gateway in (on_a, on_c):
        stop_cleanly(gateway)
    for node in (a.primary, a.backup, b.primary, b.backup, c.backup):
        assert node.stop() == 0, node.log()


def test_an_mqtt_subscription_gets_what_another_node_acknowledged_during_a_failback(tmp_path: Path) -> None:
    """Issue 21, failback: the pair goes back to its returned primary, so its active copy stops serving for a
    moment again; what another node PUBACKs meanwhile for the subscription waits there for the pair."""
    a, b, c = three_pairs(tmp_path)
    pinned = {"TRIDENTMQ_MQTT_CORE_LOAD_BALANCING": "FIRST_ELEMENT"}
    on_c = start_gateway(tmp_path, c.primary, "mqtt", name="mqtt-c", **pinned)
    on_a = start_gateway(tmp_path, a.primary, "mqtt", name="mqtt-a", **pinned)
    subscriber = Paho(on_c.port, "fb-sub", clean=False)
    subscriber.connect(expiry=300)
    subscriber.subscribe("fb/t", 1)
    wait_until(
        lambda: remote_consumers(a.primary, subscription_queue("fb-sub", "fb/t")) == 1,
        10,
        "a to see the subscription on c",
    )
    publisher = Paho(on_a.port, "fb-pub")
    publisher.connect()
    attempted: list[bytes] = []

    def publish(count: int) -> None:
        for _ in range(count):
            attempted.append(b"%d" % len(attempted))
            publisher.publish("fb/t", attempted[-1], 1)

    port = c.primary.link_port
    kill(c.primary)
    wait_until(lambda: ha_view(c.backup).get("active") is True, 15, "c's backup to take over")
    publish(50)
    (c.backup.data_dir / "ports.json").unlink()  # it restarts itself as the backup after the failback
    primary = start_node(
        tmp_path,
        "c-primary",
        [c.backup, a.primary],
        core_ha_policy="replication",
        core_ha_group_name="c",
        core_link_port=str(port),
    )
    while not (ha_view(primary).get("active") is True and "failback done" in c.backup.log()):
        publish(10)
        assert len(attempted) < 30_000, "the pair did not go back to its primary"
    publish(50)
    delivered: list[Delivery[bytes]] = []
    while set(attempted) - {d.value for d in delivered}:
        got = subscriber.receive(len(attempted), timeout=20)
        if not got:
            break
        delivered += [Delivery(m.payload, bool(m.dup)) for m in got]
    verdict = check(attempted, attempted, [], delivered)
    assert verdict.ok, verdict.report()
    for client_ in (subscriber, publisher):
        client_.disconnect()
    for gateway in (on_a, on_c):
        stop_cleanly(gateway)
    reread_ports(c.backup)
    for node in (a.primary, a.backup, b.primary, b.backup, primary, c.backup):
        assert node.stop() == 0, node.log()


def reread_ports(node: CoreProcess) -> None:
    """A node that restarted itself in place (failback) wrote its new ports."""
    wait_until((node.data_dir / "ports.json").exists, 15, "the restarted node's ports")
    ports = json.loads((node.data_dir / "ports.json").read_text())
    node.link_port, node.management_port = ports["link"], ports["management"]


async def test_failback_hands_the_pair_back_to_its_returned_primary(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, "fb", core_ha_activate_without_quorum="true")
    primary_id = node_id(pair.primary)
    await publish(pair.primary, "fb.q", [b"a%d" % i for i in range(100)])
    port = pair.primary.link_port
    kill(pair.primary)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, 10, "the backup to take over")
    await publish(pair.backup, "fb.q", [b"b%d" % i for i in range(100)])
    (pair.backup.data_dir / "ports.json").unlink()
    # The primary comes back (at its address): it finds its pair active at a newer epoch, copies it as its
    # backup, and the backup hands the pair back and restarts itself as the backup.
    primary = start_node(
        tmp_path,
        "fb-primary",
        [pair.backup],
        core_ha_policy="replication",
        core_ha_group_name="fb",
        core_ha_activate_without_quorum="true",
        core_link_port=str(port),
    )
    wait_until(lambda: ha_view(primary).get("active") is True, 20, "the primary to take the pair back")
    view = ha_view(primary)
    assert view["epoch"] == 3, view
    assert node_id(primary) == primary_id
    assert "starting as a backup" in primary.log()
    wait_until(lambda: "failback done: restarting as a backup" in pair.backup.log(), 10, "the old backup to restart")
    reread_ports(pair.backup)
    wait_until(lambda: ha_view(pair.backup).get("in_sync") is True, 20, "the old backup to be a backup again")
    expected = [b"a%d" % i for i in range(100)] + [b"b%d" % i for i in range(100)]
    assert sorted(await drain(primary, "fb.q", len(expected))) == sorted(expected)
    assert pair.backup.stop() == 0
    assert primary.stop() == 0


async def test_a_replaced_primary_that_copied_its_backup_restarts_as_a_backup(tmp_path: Path) -> None:
    """Found by the randomised schedule: the old primary copies the pair's active node (its former backup,
    epoch 2); killed and restarted, its copy holds epoch 2 as well, and it must not serve that epoch too."""
    pair = start_pair(tmp_path, "copy", core_ha_activate_without_quorum="true", core_ha_allow_failback="false")
    port = pair.primary.link_port
    kill(pair.primary)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, 10, "the backup to take over")
    await publish(pair.backup, "copy.q", [b"1", b"2"])
    ha = {
        "core_ha_policy": "replication",
        "core_ha_group_name": "copy",
        "core_ha_activate_without_quorum": "true",
        "core_ha_allow_failback": "false",
        "core_link_port": str(port),
    }
    primary = start_node(tmp_path, "copy-primary", [pair.backup], **ha)
    wait_until(lambda: ha_view(primary).get("in_sync") is True, 20, "the old primary to copy the active node")
    kill(primary)
    primary = start_node(tmp_path, "copy-primary", [pair.backup], **ha)
    wait_until(lambda: ha_view(primary).get("in_sync") is True, 20, "the restarted copy to copy again")
    assert "its data is a copy of the pair's active node at epoch 2" in primary.log()
    assert ha_view(primary)["active"] is False
    assert ha_view(pair.backup)["active"] is True
    assert sorted(await drain(pair.backup, "copy.q", 2)) == [b"1", b"2"]
    for node in (primary, pair.backup):
        assert node.stop() == 0


async def test_a_primary_restarted_at_the_epoch_its_backup_won_is_fenced_not_copied(tmp_path: Path) -> None:
    """A whole cluster restarted after a failover: the primary, started while no voter answered, served at its
    own epoch plus one, which was the epoch its backup had won and served at. The backup, started next, took it
    for its primary and copied it, wiping every message confirmed since the failover. Now the backup's first
    words fence the stale copy, which copies the fresher one when it starts again."""
    ha = {
        "core_ha_policy": "replication",
        "core_ha_group_name": "stale",
        "core_ha_activate_without_quorum": "true",
        "core_ha_allow_failback": "false",
    }
    pair = start_pair(tmp_path, "stale", core_ha_activate_without_quorum="true", core_ha_allow_failback="false")
    primary_port, backup_port = pair.primary.link_port, pair.backup.link_port
    await publish(pair.primary, "stale.q", [b"a1", b"a2"])
    kill(pair.primary)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, 10, "the backup to take over")
    await publish(pair.backup, "stale.q", [b"b1", b"b2"])
    kill(pair.backup)
    primary = start_node(tmp_path, "stale-primary", [], core_link_port=str(primary_port), **ha)
    wait_until(lambda: ha_view(primary).get("active") is True, 10, "the stale copy to serve, no voter answering")
    assert ha_view(primary)["epoch"] == 2
    backup = start_node(
        tmp_path, "stale-backup", [primary], core_ha_role="backup", core_link_port=str(backup_port), **ha
    )
    assert await asyncio.to_thread(primary.process.wait, 20) == FENCED_EXIT_CODE
    assert "backup stale-backup" in primary.log()
    wait_until(lambda: ha_view(backup).get("active") is True, 20, "the fresher copy to serve")
    assert ha_view(backup)["epoch"] == 3
    assert sorted(await drain(backup, "stale.q", 4)) == [b"a1", b"a2", b"b1", b"b2"]
    primary = start_node(tmp_path, "stale-primary", [backup], core_link_port=str(primary_port), **ha)
    wait_until(lambda: ha_view(primary).get("in_sync") is True, 20, "the fenced copy to copy the fresher one")
    assert ha_view(primary)["active"] is False
    for node in (primary, backup):
        assert node.stop() == 0


def reserved_port() -> socket.socket:
    """A port of the test's own: bound and never listening, so that a connection there is refused and no test
    running alongside takes the port (one closed and reused once answered a node's network check in another
    test's place). ``listener`` listens on it beside this socket."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def listener(port: int) -> socket.socket:
    """A TCP listener on a ``reserved_port``, standing in for the network a node checks."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    return sock


async def test_a_node_cut_off_from_its_network_stops_serving_until_it_returns(tmp_path: Path) -> None:
    reserved = reserved_port()
    port = reserved.getsockname()[1]
    network = listener(port)
    node = start_core(
        tmp_path,
        "checked",
        TRIDENTMQ_CORE_NETWORK_CHECK_TARGETS=f"127.0.0.1:{port}",
        TRIDENTMQ_CORE_NETWORK_CHECK_PERIOD_MS="100",
        TRIDENTMQ_CORE_NETWORK_CHECK_TIMEOUT_MS="100",
    )
    try:
        c = client(node)
        await c.connect()
        closed: list[LinkRequestError] = []
        c.on_closed = closed.append
        network.close()
        await asyncio.to_thread(wait_until, lambda: bool(closed), 10, "the node to drop its clients")
        assert closed[0].code == ErrorCode.NOT_ACTIVE
        with pytest.raises(LinkRequestError, match="network check"):
            await client(node).connect()
        assert "network check: isolated" in node.log()
        network = listener(port)

        async def serving() -> bool:
            try:
                async with client(node):
                    return True
            except LinkRequestError:
                return False

        deadline = time.monotonic() + 10
        while not await serving():
            assert time.monotonic() < deadline, "the node did not serve again"
            await asyncio.sleep(0.1)
    finally:
        network.close()
        reserved.close()
    assert node.stop() == 0


async def test_a_backup_cut_off_from_its_network_never_takes_over(tmp_path: Path) -> None:
    unreachable = reserved_port()  # nothing answers there
    port = unreachable.getsockname()[1]
    primary = start_node(tmp_path, "p", core_ha_policy="replication", core_ha_group_name="iso")
    backup = start_node(
        tmp_path,
        "b",
        [primary],
        core_ha_policy="replication",
        core_ha_group_name="iso",
        core_ha_role="backup",
        core_ha_activate_without_quorum="true",
        core_network_check_targets=f"127.0.0.1:{port}",
        core_network_check_period_ms="100",
        core_network_check_timeout_ms="100",
    )
    wait_until(lambda: ha_view(backup).get("in_sync") is True, 20, "the backup to be in sync")
    kill(primary)
    wait_until(lambda: "cut off" in str(ha_view(backup).get("state", "")), 10, "the backup to notice")
    await asyncio.sleep(0.5)
    assert ha_view(backup)["active"] is False
    assert "backup activated" not in backup.log()
    assert backup.stop() == 0
    unreachable.close()


async def test_the_backup_retires_its_segments_after_each_compaction_of_the_primary(tmp_path: Path) -> None:
    """The backup's copy follows the primary's compactions instead of growing for ever."""
    small = {"core_journal_segment_bytes": str(256 * 1024), "core_journal_compact_min_segments": "3"}
    pair = start_pair(tmp_path, "compact", core_ha_activate_without_quorum="true", **small)
    for round_ in range(4):  # each round fills a few segments with messages that are consumed at once
        bodies = [b"r%d-%d" % (round_, i) + b"." * 200 for i in range(3000)]
        await publish(pair.primary, "churn", bodies)
        assert len(await drain(pair.primary, "churn", len(bodies))) == len(bodies)
    kept = [b"kept-%d" % i for i in range(50)]
    await publish(pair.primary, "churn", kept)

    def segments(node: CoreProcess) -> int:
        return len(list((node.data_dir / "journal").glob("journal-*.tmq")))

    wait_until(lambda: "journal compacted" in pair.primary.log(), 20, "a compaction on the primary")
    # The backup follows the compaction at its next check, and syncs the primary's end.
    wait_until(lambda: segments(pair.backup) <= segments(pair.primary) + 2, 10, "the backup's journal to shrink too")
    kill(pair.primary)
    wait_until(lambda: ha_view(pair.backup).get("active") is True, 10, "the backup to take over")
    assert sorted(await drain(pair.backup, "churn", len(kept))) == sorted(kept)
    assert pair.backup.stop() == 0


def silent_backup(node: CoreProcess) -> PeerLink:
    """A backup's link that never acknowledges what it receives (a hung disk); its heartbeats keep it up."""
    link = PeerLink(
        "127.0.0.1",
        node.link_port,
        user=CLUSTER_USER,
        password=CLUSTER_PASSWORD,
        client_name="backup:silent",
        reconnect=ReconnectPolicy(attempts=0, initial_attempts=1),
    )
    link.on_replica = lambda _records: None
    return link


SILENT = {"group": "g", "server_id": "silent", "epoch": 1, "host": "127.0.0.1", "port": 1, "role": "backup"}


async def test_a_backup_silent_during_its_copy_is_dropped_and_another_backup_can_attach(tmp_path: Path) -> None:
    """Acknowledging nothing during the copy, it held the compaction its copy started for ever: no other
    compaction, no other backup, and the primary kept all it wrote for it in memory."""
    primary = start_node(tmp_path, "p", core_ha_policy="replication", core_ha_group_name="g", core_ha_sync_window="10")
    async with client(primary) as c:
        for i in range(15):  # the copy is more than the window
            await c.create_queue(f"q{i}", f"a{i}")
    async with silent_backup(primary) as silent:
        await silent.replicate(SILENT)
        assert ha_view(primary)["backup"] == "silent"
        await wait_until_async(lambda: "acknowledged nothing" in primary.log(), 15, "the silent backup's drop")
        await wait_until_async(lambda: ha_view(primary).get("backup") == "", 10, "the backup gone")
    backup = start_node(
        tmp_path, "b", [primary], core_ha_policy="replication", core_ha_group_name="g", core_ha_role="backup"
    )
    await wait_until_async(lambda: ha_view(primary).get("backup_in_sync") is True, 15, "another backup in sync")
    for node in (backup, primary):
        assert node.stop() == 0


async def test_a_backup_that_falls_max_backlog_bytes_behind_is_dropped(tmp_path: Path) -> None:
    """What the primary has not sent its backup is held in memory: not without bound."""
    primary = start_node(
        tmp_path,
        "p",
        core_ha_policy="replication",
        core_ha_group_name="g",
        core_ha_sync_window="10",
        core_ha_max_backlog_bytes=str(64 * 1024),
        core_link_heartbeat_ms="30000",  # the silence alone would take two minutes to drop it
    )
    async with silent_backup(primary) as silent:
        await silent.replicate(SILENT)
        await publish(primary, "big", [b"%04d" % i + b"." * 2000 for i in range(100)])  # confirmed on disk here
        await wait_until_async(lambda: "max_backlog_bytes behind" in primary.log(), 15, "the lagging backup's drop")
        await wait_until_async(lambda: ha_view(primary).get("backup") == "", 10, "the backup gone")
    assert primary.stop() == 0


def shared_pair(tmp_path: Path) -> tuple[CoreProcess, CoreProcess]:
    """Two nodes on one shared directory: the first to win the lease serves, the other waits."""
    shared = {
        "TRIDENTMQ_CORE_HA_POLICY": "shared-store",
        "TRIDENTMQ_CORE_HA_SHARED_DIRECTORY": str(tmp_path / "shared"),
        "TRIDENTMQ_CORE_HA_LEASE_RENEW_MS": "200",
        "TRIDENTMQ_CORE_HA_LEASE_EXPIRY_MS": "1000",
    }
    first = start_core(tmp_path, "store-a", **shared)
    wait_until(lambda: ha_view(first).get("active") is True, 10, "the first node to win the lease")
    second = start_core(tmp_path, "store-b", **shared)
    wait_until(lambda: ha_view(second).get("state") == "waiting for the lease", 10, "the second node to wait")
    return first, second


async def test_a_shared_store_node_renews_its_lease_while_it_activates(tmp_path: Path) -> None:
    """Activating takes seconds (here the cluster join waits for a node that accepts connections and never
    answers). The lease was not renewed meanwhile: a node whose activation outlasted the lease's expiry fenced
    itself (exit 3) as soon as it had activated, and two such nodes took turns serving nothing (found by a
    review)."""
    silent = socket.socket()  # a node that is hung: its port takes connections, nothing answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        node = start_core(
            tmp_path,
            "store-slow",
            TRIDENTMQ_CORE_HA_POLICY="shared-store",
            TRIDENTMQ_CORE_HA_SHARED_DIRECTORY=str(tmp_path / "shared"),
            TRIDENTMQ_CORE_HA_LEASE_RENEW_MS="500",
            TRIDENTMQ_CORE_HA_LEASE_EXPIRY_MS="1500",
            TRIDENTMQ_CORE_CLUSTER_USER=CLUSTER_USER,
            TRIDENTMQ_CORE_CLUSTER_PASSWORD=CLUSTER_PASSWORD,
            TRIDENTMQ_CORE_CLUSTER_CONNECTORS=f"127.0.0.1:{silent.getsockname()[1]}",
        )
        wait_until(lambda: "joined the cluster" in node.log(), 15, "the activation to end")
        await publish(node, "slow.q", [b"served"])  # confirmed: the lease holds
        assert node.process.poll() is None, node.log()
        assert "fenced" not in node.log(), node.log()
        assert node.stop() == 0
    finally:
        silent.close()


async def test_shared_store_standby_takes_over_a_killed_node_after_its_lease_expires(tmp_path: Path) -> None:
    active, standby = shared_pair(tmp_path)
    bodies = [b"s%d" % i for i in range(500)]
    await publish(active, "shared.q", bodies)
    kill(active)
    wait_until(lambda: ha_view(standby).get("active") is True, 10, "the standby to take the lease")
    assert ha_view(standby)["epoch"] == 2
    assert sorted(await drain(standby, "shared.q", len(bodies))) == sorted(bodies)
    assert "journal taken over from the previous epoch" in standby.log()
    assert standby.stop() == 0


async def test_shared_store_paused_node_confirms_nothing_after_waking(tmp_path: Path) -> None:
    active, standby = shared_pair(tmp_path)
    confirmed: list[bytes] = []
    attempted: list[bytes] = []
    after_wake: list[bytes] = []
    woke = asyncio.Event()

    async def produce() -> None:
        async with LinkClient("127.0.0.1", active.link_port, reconnect=ReconnectPolicy(attempts=0)) as producer:
            for i in range(100_000):
                body = b"v%d" % i
                attempted.append(body)
                try:
                    (future,) = await asyncio.wait_for(
                        producer.publish_batch([new_message("paused.q", body, durable=True)]), 1
                    )
                except (TimeoutError, LinkRequestError):
                    return

                def settled(f: asyncio.Future[None], body: bytes = body) -> None:
                    if not f.cancelled() and f.exception() is None:
                        confirmed.append(body)
                        if woke.is_set():
                            after_wake.append(body)

                future.add_done_callback(settled)
                await asyncio.sleep(0.001)

    producing = asyncio.create_task(produce())
    await wait_until_async(lambda: len(confirmed) >= 50, 10, "messages confirmed before the pause")
    active.process.send_signal(signal.SIGSTOP)
    try:
        await asyncio.to_thread(wait_until, lambda: ha_view(standby).get("active") is True, 15, "the takeover")
    finally:
        woke.set()
        active.process.send_signal(signal.SIGCONT)
    assert await asyncio.to_thread(active.process.wait, 15) == FENCED_EXIT_CODE
    await asyncio.wait_for(producing, 10)
    assert after_wake == []
    delivered = await drain(standby, "paused.q", len(confirmed))
    verdict = check(attempted, confirmed, [], delivered)
    assert verdict.ok, verdict.report()
    assert standby.stop() == 0


async def test_shared_store_clean_stop_hands_the_lease_over_at_once(tmp_path: Path) -> None:
    active, standby = shared_pair(tmp_path)
    await publish(active, "handover.q", [b"1", b"2"])
    assert active.stop() == 0
    wait_until(lambda: ha_view(standby).get("active") is True, 5, "the standby to take the released lease")
    assert sorted(await drain(standby, "handover.q", 2)) == [b"1", b"2"]
    assert standby.stop() == 0


@pytest.mark.parametrize("first", ["primary", "backup"])
async def test_after_both_halves_stopped_only_the_freshest_copy_activates(tmp_path: Path, first: str) -> None:
    """The backup took over (epoch 2) and got more messages; then both halves die. Whatever the start order,
    the stale primary never serves: the backup's copy activates (epoch 3) and the primary copies it."""
    a, b, c = three_pairs(tmp_path)
    before = [b"p%d" % i for i in range(200)]
    await publish(b.primary, "fresh.q", before)
    kill(b.primary)
    wait_until(lambda: ha_view(b.backup).get("active") is True, 15, "b's backup to take over")
    after = [b"b%d" % i for i in range(100)]
    await publish(b.backup, "fresh.q", after)
    kill(b.backup)
    ha = {"core_ha_policy": "replication", "core_ha_group_name": "b", "core_ha_allow_failback": "false"}

    def start(role: str) -> CoreProcess:
        extra = {"core_ha_role": "backup"} if role == "backup" else {}
        return start_node(tmp_path, f"b-{role}", [a.primary], **ha, **extra)

    started = {first: start(first)}
    if first == "primary":
        await asyncio.sleep(2.0)
        assert ha_view(started["primary"])["active"] is False, "the stale primary must not serve"
        assert "starting as a backup" in started["primary"].log()
    started["backup" if first == "primary" else "primary"] = start("backup" if first == "primary" else "primary")
    backup, primary = started["backup"], started["primary"]
    wait_until(lambda: ha_view(backup).get("active") is True, 20, "the fresh copy to activate")
    assert ha_view(backup)["epoch"] == 3
    wait_until(lambda: ha_view(primary).get("in_sync") is True, 20, "the stale primary to copy the fresh one")
    assert ha_view(primary)["active"] is False
    assert sorted(await drain(backup, "fresh.q", 300)) == sorted(before + after)
    for node in (backup, primary, a.primary, a.backup, c.primary, c.backup):
        assert node.stop() == 0


async def test_votes_and_replication_need_the_cluster_credentials_and_well_formed_requests(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, "guarded")
    outsider_link = PeerLink("127.0.0.1", pair.primary.link_port, reconnect=ReconnectPolicy(attempts=0))
    async with outsider_link as outsider:  # a node's link without the cluster credentials
        with pytest.raises(LinkRequestError, match="high availability"):
            await outsider.vote({"kind": "activate", "node_id": node_id(pair.primary), "epoch": 9, "candidate": "x"})
        with pytest.raises(LinkRequestError, match="high availability"):
            await outsider.replicate({"group": "guarded", "server_id": "x", "host": "127.0.0.1", "port": 1})
    async with PeerLink(
        "127.0.0.1",
        pair.primary.link_port,
        user="cluster",
        password="s3cret-cluster",
        reconnect=ReconnectPolicy(attempts=0),
    ) as insider:
        with pytest.raises(LinkRequestError, match="malformed vote request"):
            await insider.vote({"kind": "crown", "node_id": "n", "epoch": 1, "candidate": "x"})
        answer = await insider.vote(
            {"kind": "activate", "node_id": node_id(pair.primary), "epoch": 9, "candidate": "x"}
        )
        assert answer["granted"] is False  # the asked node is that pair's active copy
        assert (answer["voter"], answer["pairs"]) == (node_id(pair.primary), 1)  # a voter names its pair
        with pytest.raises(LinkRequestError, match="already has a backup"):
            await insider.replicate({"group": "guarded", "server_id": "y", "host": "127.0.0.1", "port": 1})
    assert ha_view(pair.primary)["backup_in_sync"] is True  # the refusals changed nothing
    for node in (pair.backup, pair.primary):
        assert node.stop() == 0


def test_a_backup_with_the_wrong_cluster_password_is_refused_and_says_so(tmp_path: Path) -> None:
    primary = start_node(tmp_path, "p", core_ha_policy="replication", core_ha_group_name="pw")
    backup = start_node(
        tmp_path,
        "b",
        [primary],
        core_ha_policy="replication",
        core_ha_group_name="pw",
        core_ha_role="backup",
        password="not-the-password",
    )
    wait_until(lambda: "wrong cluster credentials" in str(ha_view(backup).get("state", "")), 10, "the refusal")
    assert "link refused" in primary.log()
    assert ha_view(primary)["backup"] == ""
    for node in (backup, primary):
        assert node.stop() == 0


async def test_a_paused_primary_of_a_single_pair_learns_from_its_backup_that_it_was_replaced(tmp_path: Path) -> None:
    """With no other pairs to vote, a backup allowed to activate alone takes over from a paused primary; the
    primary, waking, asks it too and stops instead of going on as a second active copy."""
    pair = start_pair(tmp_path, "single", core_ha_activate_without_quorum="true")
    await publish(pair.primary, "single.q", [b"before"])
    pair.primary.process.send_signal(signal.SIGSTOP)
    try:
        await asyncio.to_thread(wait_until, lambda: ha_view(pair.backup).get("active") is True, 15, "the takeover")
    finally:
        pair.primary.process.send_signal(signal.SIGCONT)
    assert await asyncio.to_thread(pair.primary.process.wait, 15) == FENCED_EXIT_CODE
    assert "taken by, another copy" in pair.primary.log()
    assert await drain(pair.backup, "single.q", 1) == [b"before"]
    assert pair.backup.stop() == 0


async def test_a_primary_whose_backup_is_still_copying_scales_down_on_a_graceful_stop(tmp_path: Path) -> None:
    """A backup still copying cannot take over: a graceful stop that skipped the scale-down for it ("a backup
    keeps the messages") left them on the stopped primary's disk, and the node the cluster had moved nothing
    to (found by a review: 0 of 50 moved)."""
    other = start_node(tmp_path, "other")
    primary = start_node(
        tmp_path, "primary", [other], core_ha_policy="replication", core_ha_group_name="g1", core_ha_sync_window="5"
    )
    wait_converged([other, primary])
    async with client(primary) as c:
        for i in range(10):
            await c.create_queue(f"pad{i}", f"pad{i}")  # more records than the window: the copy cannot end
        await c.create_queue("sd.q", "sd.q")
        await asyncio.gather(*await c.publish_batch(new_message("sd.q", b"m%d" % i, durable=True) for i in range(50)))
    copying = PeerLink(
        "127.0.0.1",
        primary.link_port,
        user=CLUSTER_USER,
        password=CLUSTER_PASSWORD,
        client_name="backup:copying",
        reconnect=ReconnectPolicy(attempts=0),
    )
    copying.on_replica = lambda records: None  # a backup whose copy goes on (a slow disk, a large journal)
    async with copying:
        await copying.replicate(
            {"group": "g1", "server_id": "copying", "epoch": 1, "host": "127.0.0.1", "port": 1, "role": "backup"}
        )
        await wait_until_async(lambda: ha_view(primary).get("backup") == "copying", what="the backup to attach")
        assert ha_view(primary)["backup_in_sync"] is False
        primary.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(primary.process.wait, 30) == 0
    assert "scale-down complete" in primary.log(), primary.log()
    assert sorted(await drain(other, "sd.q", 50)) == sorted(b"m%d" % i for i in range(50))
    stop_cleanly(other)


def shared_journal(tmp_path: Path) -> Path:
    [journal] = [path for path in (tmp_path / "shared").glob("epoch-*") if path.is_dir()]
    return journal


def compact(journal: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", "data", "compact", "--journal", str(journal)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_shared_store_active_node_holds_its_journal_against_compact(tmp_path: Path) -> None:
    """The active node of a shared-store pair holds its epoch's journal for `data compact` as any node does
    (compact used to lock the shared directory, which no node holds, and rewrote the journal being served);
    the standby holds no journal while it waits and takes over as before."""
    active, standby = shared_pair(tmp_path)
    await publish(active, "locked.q", [b"1", b"2"])
    refused = await asyncio.to_thread(compact, shared_journal(tmp_path))
    assert refused.returncode == 1, refused.stdout
    assert "in use by another TridentMQ process" in refused.stderr
    assert active.stop() == 0
    wait_until(lambda: ha_view(standby).get("active") is True, 5, "the standby to take the released lease")
    journal = shared_journal(tmp_path)  # the new epoch's
    refused = await asyncio.to_thread(compact, journal)
    assert refused.returncode == 1, refused.stdout
    assert sorted(await drain(standby, "locked.q", 2)) == [b"1", b"2"]
    assert standby.stop() == 0
    compacted = await asyncio.to_thread(compact, journal)  # both stopped: the lock is free
    assert compacted.returncode == 0, compacted.stderr


FAILING_FSYNC = """
import errno, os
_fdatasync = os.fdatasync
def fdatasync(fd):  # the disk reports a failed write-back once the marker file exists
    if os.path.exists(os.environ["TEST_FAIL_FSYNC_MARKER"]):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    _fdatasync(fd)
os.fdatasync = fdatasync
"""


def start_backup(tmp_path: Path, primary: CoreProcess, group: str, **env: str) -> CoreProcess:
    ha = {"TRIDENTMQ_CORE_HA_POLICY": "replication", "TRIDENTMQ_CORE_HA_GROUP_NAME": group}
    backup = start_core(
        tmp_path, f"{group}-backup", **cluster_env([primary]), **ha, TRIDENTMQ_CORE_HA_ROLE="backup", **env
    )
    wait_until(lambda: ha_view(backup).get("in_sync") is True, 20, "the backup to be in sync")
    wait_until(lambda: ha_view(primary).get("backup_in_sync") is True, 10, "the primary to see it")
    return backup


async def test_a_backup_whose_journal_fsync_fails_exits_70_and_its_primary_goes_on(tmp_path: Path) -> None:
    """Found by a review: with its journal dead the backup said "in sync" until its primary dropped it, then
    copied again into a journal that failed again, each time costing the pair a pause and a new epoch (ten
    epochs in ten seconds). A stand-in ``os.fdatasync`` fails in the backup's process only."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_FSYNC)
    marker = tmp_path / "fail-fsync"
    primary = start_node(tmp_path, "solo-primary", core_ha_policy="replication", core_ha_group_name="solo")
    backup = start_backup(tmp_path, primary, "solo", PYTHONPATH=str(site), TEST_FAIL_FSYNC_MARKER=str(marker))
    marker.touch()
    bodies = [b"m%d" % i for i in range(10)]
    await asyncio.wait_for(publish(primary, "q", bodies), 20)  # confirmed once the primary goes on alone
    assert await asyncio.to_thread(backup.process.wait, 15) == 70
    log = backup.log()
    assert "the backup's journal cannot write: stopping" in log
    assert "CRITICAL" in log
    wait_until(lambda: ha_view(primary).get("backup") == "", 10, "the primary to go on without its backup")
    assert sorted(await drain(primary, "q", len(bodies))) == sorted(bodies)
    assert primary.stop() == 0


async def test_a_backup_whose_disk_is_full_exits_70_and_its_primary_goes_on(tmp_path: Path) -> None:
    """A full disk acknowledged nothing either, but left the backup "in sync" and copying again for ever."""
    with tmpfs(tmp_path / "small", "16m") as disk:
        journal = {"core_journal_segment_bytes": str(1 << 20), "core_journal_max_disk_usage": "100"}
        primary = start_node(
            tmp_path, "full-primary", core_ha_policy="replication", core_ha_group_name="full", **journal
        )
        backup = start_backup(
            tmp_path,
            primary,
            "full",
            TRIDENTMQ_CORE_JOURNAL_DIRECTORY=str(disk / "journal"),
            **{f"TRIDENTMQ_{k.upper()}": v for k, v in journal.items()},
        )
        fill(disk, leave=512 * 1024)  # room for less than a segment: the backup's next roll fails
        bodies = [b"%02d" % i + b"x" * 100_000 for i in range(14)]
        await asyncio.wait_for(publish(primary, "q", bodies), 20)
        assert await asyncio.to_thread(backup.process.wait, 15) == 70
        assert "No space left on device" in backup.log()
        wait_until(lambda: ha_view(primary).get("backup") == "", 10, "the primary to go on without its backup")
        assert len(await drain(primary, "q", len(bodies))) == len(bodies)
        assert primary.stop() == 0
