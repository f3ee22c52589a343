"""A randomised Jepsen-style run over the cluster ``tridentmq up`` starts, with all four client kinds at once.

    python -m tests.jepsen.defaults --topology pairs|nodes [--seed N] [--seconds S] [--out verdict.json]

The cluster is exactly what ``tridentmq up --pairs 3`` (or ``--nodes 3``) starts: the children come from the
supervisor's own :func:`plan`, with its settings and the gateways' default policies (ROUND_ROBIN over the
cluster), each process given only what running it in a network namespace of its own needs (its lab address
instead of 127.0.0.1, and anonymous clients from the lab's other namespaces). Every core node runs in a
:class:`NetLab` namespace of its own, so every node keeps ``up``'s ports and partitions are real. The gateways
of ``up`` (one per protocol) and a second set linked to another node run in the client namespace ``cl``, where
this process and its clients run too (it enters that namespace before starting any thread).

Clients: paho-mqtt with persistent sessions (QoS 1 durable subscriptions: every subscriber must get every
message of its topic), stomp.py (a durable work queue, client-individual acks), python-qpid-proton (a durable
work queue, explicit accepts) and the link client (a work queue, acks); a producer of each kind publishes
unique values and records what the broker acknowledged. Every consumer moves to another gateway (or node, for
the link client) every 0.2 to 3 s. A nemesis mixes kill -9, SIGSTOP, symmetric, one-way and node-only
partitions, failback (a primary killed, its backup takes over, the primary returns and is handed its pair
back), a gateway killed or stopped (SIGTERM) with its clients on it and, with ``--nodes``, scale-down (a
graceful stop that moves the node's messages away); after each fault it heals the network, restarts what
exited (as ``up``'s supervisor does) and waits for the cluster.

Checker, per queue (each MQTT subscriber is a queue of its own): lost 0, unexpected 0, duplicates flagged
redelivered where the protocol has the flag (MQTT DUP, STOMP ``redelivered``, AMQP delivery-count, the link's
delivery count), and stuck 0: once the cluster healed and every consumer is connected, every acknowledged
message reaches a consumer of its queue within 10 s, seen only through the consumers (no node is read).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import stomp
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from proton import Message
from proton.utils import BlockingConnection
from tests.jepsen.checker import Delivery, check
from tests.jepsen.nemesis import NetLab

from tridentmq_shared.cli.supervisor import Child, plan
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.topology import Topology
from tridentmq_shared.message import new_message

EPOCH = time.monotonic()  # schedule and client notes are stamped in seconds since the run began
CLIENT_NS = "cl"
CLONE_NEWNET = 0x40000000
STUCK_SECONDS = 10.0  # after heal, every acknowledged message reaches a consumer within this
LOST_GRACE = 30.0  # what is still missing this much later is counted lost (and stuck)
HEAL_TIMEOUT = 180.0  # a pair restarting in place replays its journal: over a minute on a loaded 2-core machine
START_TIMEOUT = 180.0  # six cores and six gateways importing at once on a loaded 2-core machine
MOVE_INTERVAL = (0.2, 3.0)
ACK_TIMEOUT = 20.0  # a publish not acknowledged in this long is counted unknown
#: How long after another consumer's flagged delivery of the same stored copy an unflagged one may be recorded
#: and still count as that copy's first delivery (checker.check's race_s): a consumer whose connection closed
#: right after its node sent it the copy records it late, after the other consumer recorded the redelivery
#: (seen: 10 ms apart at the core, recorded in the other order).
CONSUMER_RACE_S = 0.5
#: The second gateway of each kind listens on these ports of the client namespace (the first keeps up's).
SECOND_GATEWAY = {"stomp": 62613, "mqtt": 2883, "amqp": 6672}
FIRST_GATEWAY = {"stomp": 61613, "mqtt": 1883, "amqp": 5672}


def enter_netns(name: str) -> None:
    """Move the calling thread (and whatever it starts later) into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------- cluster


@dataclass
class Proc:
    """One child of ``up``, run in a lab namespace; ``process`` is its current incarnation."""

    child: Child
    netns_node: str
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    incarnations: int = 0

    @property
    def name(self) -> str:
        return self.child.name

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Cluster:
    def __init__(self, root: Path, topology: str, gateway_sets: int = 2) -> None:
        self.root = root
        self.topology = topology
        children = plan(root / "data", None, nodes=3, pairs=3 if topology == "pairs" else 0)
        self.cores = [c for c in children if c.name.startswith(("core-", "backup-"))]
        gateways = [c for c in children if c.name.startswith("gateway-")]
        lab_names = [c.name.replace("-", "") for c in self.cores] + [CLIENT_NS]
        self.lab = NetLab(lab_names)
        by_port = {c.env["TRIDENTMQ_CORE_LINK_PORT"]: self.lab.address(c.name.replace("-", "")) for c in self.cores}
        self.address = {c.name: by_port[c.env["TRIDENTMQ_CORE_LINK_PORT"]] for c in self.cores}
        self.link_port = {c.name: int(c.env["TRIDENTMQ_CORE_LINK_PORT"]) for c in self.cores}
        self.management_port = {c.name: int(c.env["TRIDENTMQ_CORE_MANAGEMENT_PORT"]) for c in self.cores}

        def relocate(connectors: str) -> str:
            return ",".join(f"{by_port[c.split(':')[1]]}:{c.split(':')[1]}" for c in connectors.split(",") if c)

        self.procs: dict[str, Proc] = {}
        for core in self.cores:
            env = dict(core.env)
            env["TRIDENTMQ_CORE_LINK_HOST"] = self.address[core.name]
            env["TRIDENTMQ_CORE_CLUSTER_CONNECTORS"] = relocate(env["TRIDENTMQ_CORE_CLUSTER_CONNECTORS"])
            env["TRIDENTMQ_CORE_SECURITY_ALLOW_ANONYMOUS_REMOTE"] = "true"  # gateways and clients are in `cl`
            env["TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES"] = str(8 * 1024 * 1024)  # smaller pre-allocated files
            argv = [*core.argv, "--ports-file", str(root / f"{core.name}.ports.json")]
            self.procs[core.name] = Proc(
                Child(core.name, argv, core.env), core.name.replace("-", ""), env, root / f"{core.name}.log"
            )
        self.gateway_ports: dict[str, list[int]] = {}
        for index, gateway in enumerate(gateways):
            kind = gateway.name.removeprefix("gateway-")
            prefix = f"TRIDENTMQ_{kind.upper()}"
            linked = int(gateway.env[f"{prefix}_CORE_PORT"])
            first_core = next(c.name for c in self.cores if self.link_port[c.name] == linked)
            # The second set links to the next active node: a client that moves between gateways moves between nodes.
            actives = [c.name for c in self.cores if c.name.startswith("core-")]
            second_core = actives[(actives.index(first_core) + 1) % len(actives)]
            for copy, core_name in ((0, first_core), (1, second_core))[:gateway_sets]:
                env = dict(gateway.env)
                env[f"{prefix}_CORE_HOST"] = self.address[core_name]
                env[f"{prefix}_CORE_PORT"] = str(self.link_port[core_name])
                env[f"{prefix}_CORE_CONNECTORS"] = relocate(env[f"{prefix}_CORE_CONNECTORS"])
                if copy:
                    env[f"{prefix}_LISTENER_PORT"] = str(SECOND_GATEWAY[kind])
                    env[f"{prefix}_LISTENER_WEBSOCKET_PORT"] = "-1"
                    env[f"{prefix}_HTTP_PORT"] = "0"
                name = f"{gateway.name}-{copy}"
                self.procs[name] = Proc(Child(name, gateway.argv, gateway.env), CLIENT_NS, env, root / f"{name}.log")
            self.gateway_ports[kind] = [FIRST_GATEWAY[kind], SECOND_GATEWAY[kind]][:gateway_sets]
            del index
        self._status = {
            c.name: ThreadPoolExecutor(1, initializer=enter_netns, initargs=(self.lab.netns(c.name.replace("-", "")),))
            for c in self.cores
        }

    # -------------------------------------------------------------------------------------- processes

    def start(self, proc: Proc) -> None:
        if proc.process is not None:
            proc.process.wait()
        proc.incarnations += 1
        with proc.log.open("ab") as log:
            log.write(f"---- incarnation {proc.incarnations} at {time.monotonic():.1f}\n".encode())
            log.flush()
            proc.process = self.lab.run(
                proc.netns_node, proc.child.argv, env={**os.environ, **proc.env}, stdout=log, stderr=subprocess.STDOUT
            )

    def start_all(self) -> None:
        for name, proc in self.procs.items():
            if name.startswith(("core-", "backup-")):
                self.start(proc)
        wait_for("every core to answer", lambda: all(self.status(c.name) for c in self.cores), START_TIMEOUT)
        for name, proc in self.procs.items():
            if name.startswith("gateway-"):
                self.start(proc)
        ports = [p for kind in self.gateway_ports.values() for p in kind]
        wait_for("every gateway to listen", lambda: all(listening(p) for p in ports), START_TIMEOUT)

    def restart_exited(self, log: Callable[[str], None]) -> None:
        """What ``up``'s supervisor does: start again whatever exited."""
        for proc in self.procs.values():
            if not proc.running():
                log(f"restart {proc.name}")
                self.start(proc)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.process is not None and proc.process.poll() is None:
                proc.process.send_signal(signal.SIGCONT)
                proc.process.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            if proc.process is not None:
                try:
                    proc.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.process.kill()
                    proc.process.wait()
        for executor in self._status.values():
            executor.shutdown(wait=False)
        self.lab.close()

    # -------------------------------------------------------------------------------------- status

    def status(self, core: str) -> dict[str, Any]:
        """The node's /api/status, read from inside its namespace (management answers loopback only)."""
        url = f"http://127.0.0.1:{self.management_port[core]}/api/status"
        try:
            return self._status[core].submit(_get_json, url).result(timeout=10)
        except (OSError, ValueError, TimeoutError):
            return {}

    def queues(self, core: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.management_port[core]}/api/queues"
        try:
            answer: Any = self._status[core].submit(_get_any, url).result(timeout=10)
        except (OSError, ValueError, TimeoutError):
            return []
        return [q for q in answer if isinstance(q, dict)] if isinstance(answer, list) else []

    def healed(self) -> bool:
        if not all(p.running() for p in self.procs.values()):
            return False
        statuses = {c.name: self.status(c.name) for c in self.cores}
        if self.topology == "pairs":
            for pair in {c.name.split("-")[1] for c in self.cores}:
                views = [statuses[f"core-{pair}"].get("ha") or {}, statuses[f"backup-{pair}"].get("ha") or {}]
                if sum(v.get("active") is True for v in views) != 1:
                    return False
                if not (views[0].get("active") is True and views[1].get("in_sync") is True):
                    return False  # failback: the primary serves again, with its backup in sync
                if views[1].get("pairs") != 3:
                    return False
        # Every serving node sees every other serving node as a live member.
        serving = self.primaries()
        for name in serving:
            members = (statuses[name].get("cluster") or {}).get("members")
            if not isinstance(members, list) or len(members) < len(serving) - 1:
                return False
        return True

    def primaries(self) -> list[str]:
        return [c.name for c in self.cores if c.name.startswith("core-")]


def _compact(status: dict[str, Any]) -> dict[str, Any]:
    ha = status.get("ha") or {}
    members = (status.get("cluster") or {}).get("members")
    keys = ("active", "epoch", "in_sync", "backup_in_sync", "waiting_for_quorum", "cut_off", "pairs")
    return {
        "up": bool(status),
        "members": len(members) if isinstance(members, list) else None,
        **{k: ha[k] for k in keys if k in ha},
    }


def _get_any(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return dict(json.loads(response.read()))


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def wait_for(what: str, predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------------------------- records


@dataclass
class Stream:
    """One queue's record: what producers attempted and had acknowledged, and what its consumers saw."""

    name: str
    attempted: list[str] = field(default_factory=list)
    acknowledged: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    delivered: list[Delivery[str]] = field(default_factory=list)
    first_seen: dict[str, float] = field(default_factory=dict)
    origins: dict[str, list[str]] = field(default_factory=dict)  # value -> where each delivery came from
    lock: threading.Lock = field(default_factory=threading.Lock)

    def deliver(
        self, value: str, redelivered: bool, consumer: str, *, copy: str = "", origin: str = "", connection: str = ""
    ) -> None:
        """One delivery to ``consumer`` (its name, whichever connection it has) of the stored ``copy`` (the
        node's message id, where the client sees it); ``origin`` says more for the report (its gateway, node),
        the consumer's name when empty; ``connection`` tells the consumer's connections apart when each is read
        on a thread of its own (their records may then come in another order than their deliveries)."""
        with self.lock:
            now = time.monotonic()  # under the lock: the records' order and their times agree
            self.delivered.append(Delivery(value, redelivered, consumer, copy, now, connection))
            self.first_seen.setdefault(value, now)
            self.origins.setdefault(value, []).append(f"{now - EPOCH:.1f} {origin or consumer}")

    def missing(self) -> set[str]:
        with self.lock:
            return set(self.acknowledged) - set(self.first_seen)


@dataclass
class Run:
    rng: random.Random
    streams: dict[str, Stream]
    stop_producing: threading.Event = field(default_factory=threading.Event)
    settle: threading.Event = field(default_factory=threading.Event)  # consumers stop moving
    stop_consuming: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)
    connected: dict[str, bool] = field(default_factory=dict)  # consumer -> subscribed right now
    moves: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, text: str) -> None:
        with self.lock:
            if len(self.errors) < 2000:
                self.errors.append(f"{time.monotonic() - EPOCH:7.1f} {text}")

    def pause(self, low: float, high: float, event: threading.Event | None = None) -> None:
        with self.lock:
            seconds = self.rng.uniform(low, high)
        (event or self.stop_consuming).wait(seconds)

    def choice(self, items: list[Any]) -> Any:
        with self.lock:
            return self.rng.choice(items)


# ----------------------------------------------------------------------------------------------- MQTT


MqttConnection = tuple[paho.Client, threading.Event, list[bool]]  # the client, CONNACK received, session present


def mqtt_client(
    client_id: str,
    port: int,
    *,
    persistent: bool,
    on_message: Callable[[Any, Any, Any], None] | None = None,
    reconnect: bool = True,
) -> MqttConnection:
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5, reconnect_on_failure=reconnect
    )
    if on_message is not None:  # before CONNECT: a resumed session's messages follow the CONNACK at once
        client.on_message = on_message
    connected = threading.Event()
    present: list[bool] = []

    def on_connect(_c: Any, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            present.append(bool(flags.session_present))
            connected.set()

    client.on_connect = on_connect
    props = PahoProperties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600 if persistent else 0
    client.connect("127.0.0.1", port, keepalive=10, clean_start=not persistent, properties=props)
    client.loop_start()
    return client, connected, present


def mqtt_producer(run: Run, cluster: Cluster, topic: str, stream: Stream, prefix: str) -> None:
    n = 0
    while not run.stop_producing.is_set():
        port = run.choice(cluster.gateway_ports["mqtt"])
        try:
            # No reconnection by paho: it would send the publish under way again on its own, a second message
            # (a new session knows nothing of the first), and the checker could not tell that duplicate from
            # the broker's. A publish whose connection dropped is left unknown, as a client would count it.
            client, connected, _ = mqtt_client(f"{prefix}-pub", port, persistent=False, reconnect=False)
        except OSError as exc:
            run.note(f"mqtt producer connect: {exc}")
            run.pause(0.2, 0.5, run.stop_producing)
            continue
        try:
            if not connected.wait(10):
                run.note("mqtt producer: no CONNACK")
                continue
            while not run.stop_producing.is_set():
                value = f"{prefix}-{n}"
                n += 1
                with stream.lock:
                    stream.attempted.append(value)
                info = client.publish(topic, value.encode(), qos=1)
                if not _acknowledged(client, info):
                    run.note(f"mqtt publish {value} unacknowledged (rc {info.rc})")
                    break
                with stream.lock:
                    stream.acknowledged.append(value)
                time.sleep(0.02)
        finally:
            client.loop_stop()
            with contextlib.suppress(Exception):
                client.disconnect()


def _acknowledged(client: paho.Client, info: paho.MQTTMessageInfo) -> bool:
    """Whether the broker acknowledged a QoS 1 publish within ``ACK_TIMEOUT``, while its connection lasts. paho
    raises instead of answering when the publish could not be sent (no connection)."""
    deadline = time.monotonic() + ACK_TIMEOUT
    try:
        while time.monotonic() < deadline:
            info.wait_for_publish(0.1)
            if info.is_published():
                return True
            if not client.is_connected():
                return False
    except (RuntimeError, ValueError):
        return False
    return False


def mqtt_subscriber(run: Run, cluster: Cluster, client_id: str, topic: str, stream: Stream) -> None:
    subscribed = False
    while not run.stop_consuming.is_set():
        port = run.choice(cluster.gateway_ports["mqtt"])
        try:
            client, connected, present = mqtt_client(
                client_id,
                port,
                persistent=True,
                on_message=lambda _c, _u, m, at=port: stream.deliver(
                    m.payload.decode(), m.dup, client_id, origin=str(at)
                ),
            )
        except OSError as exc:
            run.note(f"{client_id} connect: {exc}")
            run.pause(0.2, 0.5)
            continue
        try:
            if not connected.wait(10):
                run.note(f"{client_id}: no CONNACK on {port}")
                continue
            if subscribed and not present[-1]:
                run.note(f"{client_id}: session not present on reconnect to {port}")
            if not subscribed or not present[-1]:
                suback = threading.Event()
                client.on_subscribe = lambda *_a, done=suback: done.set()
                client.subscribe(topic, qos=1)
                if not suback.wait(10):
                    run.note(f"{client_id}: no SUBACK")
                    continue
                subscribed = True
            run.connected[client_id] = True
            moved = stay(run, client.is_connected)
            run.connected[client_id] = False
            if moved:
                run.moves += 1
        finally:
            run.connected[client_id] = False
            client.disconnect()
            client.loop_stop()


def stay(run: Run, alive: Callable[[], bool]) -> bool:
    """Stay connected 0.2-3 s (until the run settles: then until it ends); False when the connection died."""
    if run.settle.is_set():
        while not run.stop_consuming.is_set() and alive():
            run.stop_consuming.wait(0.1)
        return alive()
    deadline = time.monotonic() + run.rng.uniform(*MOVE_INTERVAL)
    while time.monotonic() < deadline and not run.settle.is_set():
        if not alive():
            return False
        time.sleep(0.05)
    if run.settle.is_set():
        return stay(run, alive)
    return True


# ----------------------------------------------------------------------------------------------- STOMP


class StompSession(stomp.ConnectionListener):  # type: ignore[misc]
    """One stomp.py connection to a gateway: receipts awaited by the producer, messages handed to ``stream``
    (and acknowledged one by one), and whether it is still up."""

    def __init__(self, run: Run, name: str, port: int, stream: Stream | None = None) -> None:
        self.run, self.name, self.stream = run, name, stream
        self.receipts: dict[str, threading.Event] = {}
        self.errors: list[str] = []
        self.alive = threading.Event()
        self.conn = stomp.Connection12([("127.0.0.1", port)], heartbeats=(2000, 2000), reconnect_attempts_max=1)
        self.conn.set_listener("jepsen", self)
        self.conn.connect(wait=True)
        self.alive.set()

    def on_receipt(self, frame: Any) -> None:
        self.receipts.pop(frame.headers["receipt-id"], threading.Event()).set()

    def on_message(self, frame: Any) -> None:
        if self.stream is not None:
            redelivered = frame.headers.get("redelivered") == "true"
            copy = frame.headers.get("message-id", "")
            origin = f"{self.name} {copy}{' redelivered' if redelivered else ''}"  # what the report shows
            self.stream.deliver(frame.body, redelivered, self.name, copy=copy, origin=origin, connection=str(id(self)))
            with contextlib.suppress(Exception):  # a connection going away: the message comes back
                self.conn.ack(frame.headers["ack"])

    def on_error(self, frame: Any) -> None:
        self.errors.append(f"ERROR {frame.headers.get('message')}")
        self._down()

    def on_disconnected(self) -> None:
        self.errors.append("disconnected")
        self._down()

    def _down(self) -> None:
        self.alive.clear()
        for event in list(self.receipts.values()):
            event.set()

    def send(self, destination: str, value: str) -> bool:
        """Send a persistent message; whether its receipt came (without an error first)."""
        done = self.receipts[value] = threading.Event()
        self.conn.send(destination, value, receipt=value, headers={"persistent": "true"})
        return done.wait(ACK_TIMEOUT) and not self.errors

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.disconnect()


def stomp_producer(run: Run, cluster: Cluster, destination: str, stream: Stream, prefix: str) -> None:
    n = 0
    while not run.stop_producing.is_set():
        try:
            session = StompSession(run, "stomp-producer", run.choice(cluster.gateway_ports["stomp"]))
        except Exception as exc:  # stomp.py raises its own exceptions and OSError
            run.note(f"stomp producer connect: {type(exc).__name__} {exc}")
            run.pause(0.2, 0.5, run.stop_producing)
            continue
        try:
            while not run.stop_producing.is_set():
                value = f"{prefix}-{n}"
                n += 1
                with stream.lock:
                    stream.attempted.append(value)
                if not session.send(destination, value):
                    run.note(f"stomp send {value}: {session.errors or 'no receipt'}")
                    break
                with stream.lock:
                    stream.acknowledged.append(value)
                time.sleep(0.02)
        except Exception as exc:
            run.note(f"stomp producer: {type(exc).__name__} {exc}")
        finally:
            session.close()


def stomp_consumer(run: Run, cluster: Cluster, name: str, destination: str, stream: Stream) -> None:
    while not run.stop_consuming.is_set():
        port = run.choice(cluster.gateway_ports["stomp"])
        try:
            session = StompSession(run, name, port, stream)
            session.conn.subscribe(destination, id="1", ack="client-individual")
        except Exception as exc:
            run.note(f"{name} connect: {type(exc).__name__} {exc}")
            run.pause(0.2, 0.5)
            continue
        run.connected[name] = True
        if stay(run, session.alive.is_set):
            run.moves += 1
        elif session.errors:
            run.note(f"{name} on {port}: {session.errors}")
        run.connected[name] = False
        session.close()


# ----------------------------------------------------------------------------------------------- AMQP


def amqp_producer(run: Run, cluster: Cluster, address: str, stream: Stream, prefix: str) -> None:
    n = 0
    while not run.stop_producing.is_set():
        port = run.choice(cluster.gateway_ports["amqp"])
        try:
            conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=ACK_TIMEOUT)
            sender = conn.create_sender(address)
        except Exception as exc:
            run.note(f"amqp producer connect: {type(exc).__name__} {exc}")
            run.pause(0.2, 0.5, run.stop_producing)
            continue
        try:
            while not run.stop_producing.is_set():
                value = f"{prefix}-{n}"
                n += 1
                with stream.lock:
                    stream.attempted.append(value)
                sender.send(Message(body=value, durable=True))  # returns once accepted, raises otherwise
                with stream.lock:
                    stream.acknowledged.append(value)
                time.sleep(0.02)
        except Exception as exc:
            run.note(f"amqp producer: {type(exc).__name__} {exc}")
        finally:
            with contextlib.suppress(Exception):
                conn.close()


def amqp_consumer(run: Run, cluster: Cluster, name: str, address: str, stream: Stream) -> None:
    while not run.stop_consuming.is_set():
        port = run.choice(cluster.gateway_ports["amqp"])
        try:
            conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=10)
            receiver = conn.create_receiver(address, credit=10)
        except Exception as exc:
            run.note(f"{name} connect: {type(exc).__name__} {exc}")
            run.pause(0.2, 0.5)
            continue
        run.connected[name] = True
        deadline = time.monotonic() + run.rng.uniform(*MOVE_INTERVAL)
        try:
            while not run.stop_consuming.is_set() and (run.settle.is_set() or time.monotonic() < deadline):
                try:
                    message = receiver.receive(timeout=0.2)
                except Exception as exc:
                    if type(exc).__name__ == "Timeout":
                        continue
                    raise
                copy = "" if message.id is None else str(message.id)
                stream.deliver(
                    str(message.body), (message.delivery_count or 0) > 0, name, copy=copy, origin=f"{name}@{port}"
                )
                receiver.accept()
            run.moves += 1
        except Exception as exc:
            run.note(f"{name}: {type(exc).__name__} {exc}")
        finally:
            run.connected[name] = False
            with contextlib.suppress(Exception):
                conn.close()


# ----------------------------------------------------------------------------------------------- link


def link_producer(run: Run, cluster: Cluster, address: str, stream: Stream, prefix: str) -> None:
    async def main() -> None:
        topology = Topology([(cluster.address[c], cluster.link_port[c]) for c in cluster.primaries()])
        client = LinkClient(
            topology=topology, follow_topology=True, reconnect=ReconnectPolicy(max_interval=0.5, initial_attempts=-1)
        )
        await client.connect()
        pending: set[asyncio.Future[None]] = set()
        window = asyncio.Semaphore(20)
        n = 0

        def settled(value: str, future: asyncio.Future[None]) -> None:
            pending.discard(future)
            window.release()
            if future.cancelled():
                return
            error = future.exception()
            with stream.lock:
                if error is None:
                    stream.acknowledged.append(value)
                elif isinstance(error, LinkRequestError) and error.code == "rejected":
                    stream.rejected.append(value)

        node = client.host
        try:
            while not run.stop_producing.is_set():
                value = f"{prefix}-{n}"
                n += 1
                with stream.lock:
                    stream.attempted.append(value)
                await window.acquire()
                if client.host != node:
                    run.note(f"link producer moved from {node} to {client.host} before {value}")
                    node = client.host
                try:
                    (future,) = await asyncio.wait_for(
                        client.publish_batch([new_message(address, value.encode(), durable=True)]), ACK_TIMEOUT
                    )
                except (TimeoutError, LinkRequestError) as exc:
                    window.release()
                    run.note(f"link send {value}: {exc!r}")
                    await asyncio.sleep(0.1)
                    continue
                pending.add(future)
                future.add_done_callback(lambda f, v=value: settled(v, f))
                await asyncio.sleep(0.02)
            if pending:
                await asyncio.wait(pending, timeout=ACK_TIMEOUT)
        finally:
            await client.close()

    asyncio.run(main())


def link_consumer(run: Run, cluster: Cluster, name: str, address: str, stream: Stream) -> None:
    async def main() -> None:
        while not run.stop_consuming.is_set():
            node = run.choice(cluster.primaries())
            client = LinkClient(
                cluster.address[node],
                cluster.link_port[node],
                follow_topology=True,
                reconnect=ReconnectPolicy(max_interval=0.5),
            )
            try:
                await asyncio.wait_for(client.connect(), 10)
                consumer = await asyncio.wait_for(client.subscribe(address, credit=10), 10)
            except (TimeoutError, OSError, LinkRequestError) as exc:
                run.note(f"{name} connect to {node}: {exc!r}")
                with contextlib.suppress(Exception):
                    await client.close()
                await asyncio.sleep(0.3)
                continue
            run.connected[name] = True
            deadline = time.monotonic() + run.rng.uniform(*MOVE_INTERVAL)
            try:
                while not run.stop_consuming.is_set() and (run.settle.is_set() or time.monotonic() < deadline):
                    delivery = await consumer.get(timeout=0.1)
                    if delivery is not None:
                        # The node's message id finds the delivery in the audit stream (node tag + "-" + id).
                        audit_id = f"{client.node_id[:8]}-{delivery.id}"
                        origin = f"{name}@{client.host} {audit_id} count {delivery.delivery_count}"
                        stream.deliver(delivery.body.decode(), delivery.redelivered, name, copy=audit_id, origin=origin)
                        consumer.ack(delivery)
                run.moves += 1
            except LinkRequestError as exc:
                run.note(f"{name}: {exc!r}")
            finally:
                run.connected[name] = False
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 10)

    asyncio.run(main())


# ----------------------------------------------------------------------------------------------- nemesis


@dataclass
class Nemesis:
    cluster: Cluster
    rng: random.Random
    schedule: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    heal_times: list[float] = field(default_factory=list)
    failovers: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def log(self, text: str) -> None:
        self.schedule.append(f"{time.monotonic() - EPOCH:7.1f} {text}")
        print(self.schedule[-1], file=sys.stderr, flush=True)

    only: tuple[str, ...] = ()  # a subset of the fault kinds, to replay one kind of fault

    def kinds(self) -> list[str]:
        common = ["kill", "pause", "partition", "oneway", "isolate", "gateway"]
        kinds = [*common, "failback"] if self.cluster.topology == "pairs" else [*common, "scale-down"]
        return [k for k in kinds if k in self.only] if self.only else kinds

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(self.rng.uniform(0.5, 2.0))
            kind = self.rng.choice(self.kinds())
            self.counts[kind] = self.counts.get(kind, 0) + 1
            getattr(self, "_" + kind.replace("-", "_"))()
            self.heal()

    def heal(self) -> None:
        cluster = self.cluster
        cluster.lab.heal()
        start = time.monotonic()
        deadline = start + HEAL_TIMEOUT
        while not cluster.healed():
            cluster.restart_exited(self.log)
            if time.monotonic() > deadline:
                views = {c.name: _compact(cluster.status(c.name)) for c in cluster.cores}
                raise TimeoutError(f"the cluster did not heal in {HEAL_TIMEOUT:.0f} s: {views}")
            time.sleep(0.2)
        self.heal_times.append(time.monotonic() - start)

    def _pick(self) -> str:
        return self.rng.choice([c.name for c in self.cluster.cores])

    def _two(self) -> tuple[str, str]:
        a, b = self.rng.sample([c.name for c in self.cluster.cores], 2)
        return a, b

    def _lab(self, core: str) -> str:
        return core.replace("-", "")

    def _kill(self) -> None:
        node = self._pick()
        proc = self.cluster.procs[node]
        self.log(f"kill -9 {node}")
        if proc.process is not None:
            proc.process.kill()
            proc.process.wait()
        time.sleep(self.rng.uniform(0.5, 4.0))  # the supervisor restarts it after a while

    def _pause(self) -> None:
        node = self._pick()
        seconds = self.rng.uniform(1.0, 4.0)
        proc = self.cluster.procs[node]
        self.log(f"SIGSTOP {node} for {seconds:.1f} s")
        if proc.process is not None:
            proc.process.send_signal(signal.SIGSTOP)
            time.sleep(seconds)
            proc.process.send_signal(signal.SIGCONT)

    def _partition(self) -> None:
        a, b = self._two()
        seconds = self.rng.uniform(1.0, 6.0)
        self.log(f"partition {a} | {b} for {seconds:.1f} s")
        self.cluster.lab.partition(self._lab(a), self._lab(b))
        time.sleep(seconds)

    def _oneway(self) -> None:
        a, b = self._two()
        seconds = self.rng.uniform(1.0, 6.0)
        self.log(f"one-way {a} -> {b} dropped for {seconds:.1f} s")
        self.cluster.lab.partition_oneway(self._lab(a), self._lab(b))
        time.sleep(seconds)

    def _isolate(self) -> None:
        node = self._pick()
        seconds = self.rng.uniform(1.0, 6.0)
        self.log(f"node-only partition: {node} cut off from the other nodes (not from clients) for {seconds:.1f} s")
        others = [c.name for c in self.cluster.cores if c.name != node]
        self.cluster.lab.split([self._lab(node)], [self._lab(o) for o in others])
        time.sleep(seconds)

    def _failback(self) -> None:
        pair = self.rng.choice([c.name.split("-")[1] for c in self.cluster.cores if c.name.startswith("core-")])
        primary, backup = f"core-{pair}", f"backup-{pair}"
        self.log(f"failback: kill -9 {primary}, wait for {backup}, start {primary} again")
        proc = self.cluster.procs[primary]
        killed = time.monotonic()
        if proc.process is not None:
            proc.process.kill()
            proc.process.wait()
        with contextlib.suppress(TimeoutError):
            wait_for(
                f"{backup} to take over",
                lambda: (self.cluster.status(backup).get("ha") or {}).get("active") is True,
                30,
            )
            self.failovers.append(time.monotonic() - killed)
        self.cluster.start(proc)

    def _gateway(self) -> None:
        """A gateway goes away with its clients' connections and sessions: killed (a crash), or stopped (SIGTERM, a
        rolling restart); the supervisor starts it again after a while, meanwhile its clients come back through the
        other gateways."""
        name = self.rng.choice(sorted(n for n in self.cluster.procs if n.startswith("gateway-")))
        proc = self.cluster.procs[name]
        graceful = self.rng.random() < 0.5
        self.log(f"gateway: {'graceful stop (SIGTERM)' if graceful else 'kill -9'} of {name}")
        if proc.process is not None:
            if graceful:
                proc.process.send_signal(signal.SIGTERM)
                try:
                    proc.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.log(f"{name} did not stop in 30 s")
            else:
                proc.process.kill()
                proc.process.wait()
        time.sleep(self.rng.uniform(0.5, 3.0))

    def _scale_down(self) -> None:
        node = self._pick()
        proc = self.cluster.procs[node]
        self.log(f"scale-down: graceful stop of {node}")
        if proc.process is not None:
            proc.process.send_signal(signal.SIGTERM)
            try:
                proc.process.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.log(f"{node} did not stop in 45 s")
        time.sleep(self.rng.uniform(0.5, 3.0))


# ----------------------------------------------------------------------------------------------- the run


def run_once(
    topology: str, seed: int, seconds: float, root: Path, gateway_sets: int = 2, faults: tuple[str, ...] = ()
) -> dict[str, Any]:
    rng = random.Random(seed)
    cluster = Cluster(root, topology, gateway_sets)
    enter_netns(cluster.lab.netns(CLIENT_NS))  # before any thread: clients and gateways share this namespace
    streams = {name: Stream(name) for name in ("mqtt-sub-0", "mqtt-sub-1", "stomp", "amqp", "link")}
    run = Run(random.Random(rng.random()), streams)
    nemesis = Nemesis(cluster, random.Random(rng.random()), only=faults)
    threads: list[threading.Thread] = []
    crashed: list[str] = []  # client threads that ended on an exception
    result: dict[str, Any] = {"topology": topology, "seed": seed, "seconds": seconds}
    wall = time.monotonic()
    try:
        cluster.start_all()
        wait_for("the cluster to form", cluster.healed, START_TIMEOUT)
        result["start_seconds"] = round(time.monotonic() - wall, 1)

        def client(target: Callable[..., None], *args: Any) -> None:
            try:
                target(run, cluster, *args)
            except Exception as exc:  # a client that stops checks nothing more: the run fails
                crashed.append(f"{target.__name__}{args[:1]}: {type(exc).__name__}: {exc}")
                raise

        def spawn(target: Callable[..., None], *args: Any) -> None:
            thread = threading.Thread(target=client, args=(target, *args), daemon=True, name=str(args[0]))
            thread.start()
            threads.append(thread)

        consumers = ["mqtt-sub-0", "mqtt-sub-1", "stomp-c0", "stomp-c1", "amqp-c0", "amqp-c1", "link-c0", "link-c1"]
        for sub in ("mqtt-sub-0", "mqtt-sub-1"):
            spawn(mqtt_subscriber, sub, "jepsen/mqtt", streams[sub])
        for c in ("stomp-c0", "stomp-c1"):
            spawn(stomp_consumer, c, "/queue/jepsen.stomp", streams["stomp"])
        for c in ("amqp-c0", "amqp-c1"):
            spawn(amqp_consumer, c, "jepsen.amqp", streams["amqp"])
        for c in ("link-c0", "link-c1"):
            spawn(link_consumer, c, "jepsen.link", streams["link"])
        wait_for("every consumer connected", lambda: all(run.connected.get(c) for c in consumers), START_TIMEOUT)
        fanout = Stream("mqtt")  # the producer's record, copied to every subscriber's stream below
        spawn(mqtt_producer, "jepsen/mqtt", fanout, "mqtt")
        spawn(stomp_producer, "/queue/jepsen.stomp", streams["stomp"], "stomp")
        spawn(amqp_producer, "jepsen.amqp", streams["amqp"], "amqp")
        spawn(link_producer, "jepsen.link", streams["link"], "link")
        producers = threads[-4:]
        # Start-up: until each queue delivered its first message, a publish may still reach a node that does
        # not know the consumers' queues yet (bindings travel); those are reported apart, as "at start".
        wait_for("a first delivery on every queue", lambda: all(s.first_seen for s in streams.values()), START_TIMEOUT)
        at_start = {
            name: set(fanout.acknowledged if name.startswith("mqtt") else s.acknowledged) for name, s in streams.items()
        }
        failure = ""
        try:
            nemesis.run(seconds)
        except Exception as exc:  # a cluster that does not heal (or a nemesis error) ends the schedule
            failure = f"{type(exc).__name__}: {exc}"
            nemesis.log(f"FAILED: {failure}")
        run.stop_producing.set()
        for thread in producers:
            thread.join(timeout=ACK_TIMEOUT + 15)
        for sub in ("mqtt-sub-0", "mqtt-sub-1"):
            streams[sub].attempted, streams[sub].acknowledged = fanout.attempted, fanout.acknowledged
            streams[sub].rejected = fanout.rejected
        if not failure:
            with contextlib.suppress(TimeoutError):
                nemesis.heal()
        run.settle.set()
        with contextlib.suppress(TimeoutError):
            wait_for("every consumer connected", lambda: all(run.connected.get(c) for c in consumers), 60)
        healed_at = time.monotonic()
        result["consumers_connected"] = {c: bool(run.connected.get(c)) for c in consumers}
        with contextlib.suppress(TimeoutError):
            wait_for(
                "every acknowledged message delivered",
                lambda: not any(s.missing() for s in streams.values()),
                STUCK_SECONDS,
            )
        stuck = {name: sorted(s.missing()) for name, s in streams.items()}
        with contextlib.suppress(TimeoutError):
            wait_for("the stuck messages", lambda: not any(s.missing() for s in streams.values()), LOST_GRACE)
        if any(s.missing() for s in streams.values()):
            # Where the missing messages wait, for the report only (the check above reads no node).
            result["queues_holding_messages"] = {
                c.name: [
                    {k: q.get(k) for k in ("name", "messages", "consumers", "in_flight")}
                    for q in cluster.queues(c.name)
                    if q.get("messages")
                ]
                for c in cluster.cores
            }
        run.stop_consuming.set()
        for thread in threads:
            thread.join(timeout=15)
        verdicts = {}
        for name, s in streams.items():
            verdict = check(s.attempted, s.acknowledged, s.rejected, s.delivered, race_s=CONSUMER_RACE_S)
            late = [v for v in stuck[name] if v in s.first_seen]
            lost_at_start = sorted(verdict.lost & at_start[name])
            stuck[name] = [v for v in stuck[name] if v not in at_start[name]]
            lost = verdict.lost - at_start[name]
            verdicts[name] = {
                "ok": not (lost or verdict.unexpected or verdict.rejected_delivered or stuck[name]),
                "lost_at_start": len(lost_at_start),
                "lost_at_start_examples": lost_at_start[:10],
                "attempted": verdict.attempted,
                "acknowledged": verdict.acknowledged,
                "unknown": verdict.unknown,
                "deliveries": verdict.deliveries,
                "lost": len(lost),
                "unexpected": len(verdict.unexpected),
                "stuck": len(stuck[name]),
                "stuck_then_delivered_s": [round(s.first_seen[v] - healed_at, 1) for v in late][:10],
                "duplicates": verdict.duplicate_deliveries,
                "unflagged_duplicates": verdict.unflagged_duplicates,
                "recovered": len(verdict.recovered),
                "report": verdict.report(),
                "stuck_examples": stuck[name][:10],
                "duplicate_origins": {v: s.origins.get(v) for v in sorted(verdict.unflagged_duplicated)[:10]},
            }
        result.update(
            {
                "failure": failure,
                "verdicts": verdicts,
                "faults": nemesis.counts,
                "schedule": nemesis.schedule,
                "moves": run.moves,
                "client_notes": run.errors[-200:],
                "client_note_count": len(run.errors),
                "heal_seconds": _summary(nemesis.heal_times),
                "failover_seconds": _summary(nemesis.failovers),
                "wall_seconds": round(time.monotonic() - wall, 1),
            }
        )
        result["crashed_clients"] = crashed
        result["ok"] = not failure and not crashed and all(v["ok"] for v in verdicts.values())
        return result
    finally:
        run.stop_producing.set()
        run.stop_consuming.set()
        run.settle.set()
        for thread in threads:
            thread.join(timeout=5)
        cluster.stop_all()


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"count": len(values), "median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=("pairs", "nodes"), default="pairs")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--gateway-sets",
        type=int,
        choices=(1, 2),
        default=2,
        help="up's gateways only (1), or a second gateway of each kind linked to another node (2)",
    )
    parser.add_argument("--faults", default="", help="comma-separated fault kinds to draw from (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write the verdict here as JSON")
    parser.add_argument("--dir", type=Path, default=None, help="keep the nodes' logs and data here")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    with contextlib.ExitStack() as stack:
        root = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tridentmq-jepsen-")))
        root.mkdir(parents=True, exist_ok=True)
        faults = tuple(k for k in args.faults.split(",") if k)
        result = run_once(args.topology, seed, args.seconds, root, args.gateway_sets, faults)
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text if args.out is None else json.dumps({k: result[k] for k in ("ok", "seed", "faults")}))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
