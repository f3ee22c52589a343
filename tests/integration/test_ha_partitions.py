"""Jepsen-style network faults against three replication pairs (six core processes) in network namespaces.

Every core runs in a namespace of its own (``NetLab``), bound to its lab address; pair ``a`` is ``a1`` (primary)
and ``a2`` (backup), likewise ``b`` and ``c``. The namespaces are private, so every core uses the default link
and management ports and each node's connectors are known before anything starts.

The namespace the tests run in has no route into the lab (``NetLab`` adds nothing there), so the clients run
inside it, as small agent processes started with ``lab.run``: this very file run as a script
(``python test_ha_partitions.py <role> <json>``). A monitor in the client namespace ``cl`` polls every node's
``/api/status``; producers publish durable messages with confirms and time-stamp each confirm; a drainer
consumes a queue after healing. They talk to the test through their pipes (one JSON document a line).

Checks: Jepsen's total-queue checker (lost = 0, unexpected = 0; duplicates counted and reported), at most one
node of a pair serving at any sampled moment, no confirm from a cut-off primary after it was cut off, and the
old primary's journal holds no acknowledged message that the pair's active node lacks (``compare_nodes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import basic_auth
from tests.integration.lab_agent import Agent
from tests.jepsen.checker import Delivery, Verdict, check, compare_nodes
from tests.jepsen.nemesis import NetLab, kill9, paused, resume

from tridentmq_core.store.journal import list_segments
from tridentmq_core.store.records import Record, RecordType, scan
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import M_BODY, new_message

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.cluster, pytest.mark.timeout(90)]

PAIRS: dict[str, tuple[str, str]] = {"a": ("a1", "a2"), "b": ("b1", "b2"), "c": ("c1", "c2")}  # primary, backup
CLIENT = "cl"  # the namespace of the monitor and the clients that reach every node
LINK_PORT = 61616  # every core has a namespace of its own: the default ports never collide
MANAGEMENT_PORT = 8161
CLUSTER_USER = "cluster"
CLUSTER_PASSWORD = "s3cret-cluster"
USER = "jepsen"
PASSWORD = "jepsen-secret"
FENCED_EXIT_CODE = 3
CONFIRM_GRACE = 1.5  # seconds after a primary is cut off during which confirms already on their way may arrive
PERMISSIONS = (
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
)  # manage: the monitor reads /api/status
CONFIG = f'[[users]]\nname = "{USER}"\npassword = "{PASSWORD}"\nroles = ["app"]\n' + "".join(
    f'[[permissions]]\nmatch = "#"\npermission = "{p}"\nroles = ["app"]\n' for p in PERMISSIONS
)


def queue_of(pair: str) -> str:
    return f"jepsen.{pair}"


# ----------------------------------------------------------------------------------------------- agents
# These functions run in the agent processes, inside the lab's namespaces (see the bottom of the file).


def _compact_view(ha: dict[str, Any]) -> dict[str, Any]:
    keys = ("active", "epoch", "waiting_for_quorum", "cut_off", "in_sync", "backup_in_sync", "pairs", "state", "backup")
    return {key: ha[key] for key in keys if key in ha}


def agent_monitor(spec: dict[str, Any]) -> None:
    """Poll every node's ``/api/status`` (one thread per node); answer ``views`` with the latest HA view of
    each node (None: no answer), and ``stop`` with the whole timeline ``[sent, answered, node, view]``."""
    lock = threading.Lock()
    latest: dict[str, dict[str, Any] | None] = {}
    timeline: list[list[Any]] = []
    done = threading.Event()

    def poll(name: str, url: str) -> None:
        while not done.is_set():
            sent = time.monotonic()
            view: dict[str, Any] | None
            try:
                request = urllib.request.Request(url, headers=basic_auth(USER, PASSWORD))
                with urllib.request.urlopen(request, timeout=0.5) as response:
                    view = _compact_view(dict(json.loads(response.read()).get("ha") or {}))
            except (urllib.error.URLError, OSError, ValueError):
                view = None
            answered = time.monotonic()
            with lock:
                latest[name] = view
                timeline.append([sent, answered, name, view])
            done.wait(0.1)

    for name, (host, port) in spec["nodes"].items():
        url = f"http://{host}:{port}/api/status"
        threading.Thread(target=poll, args=(name, url), daemon=True).start()
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "views":
            with lock:
                print(json.dumps(latest), flush=True)
        elif command == "stop":
            done.set()
            with lock:
                print(json.dumps(timeline), flush=True)
            return


async def agent_produce(spec: dict[str, Any]) -> None:
    """Publish durable messages with confirms until a line on stdin (``where`` instead prints the node the
    client is on and how many were confirmed so far); then print what happened to each: confirmed (with the
    monotonic time of its confirm), rejected (with the code) or unknown. With ``follow`` the client follows
    the topology and reconnects, as an application's would."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    attempted: list[str] = []
    confirmed: dict[str, float] = {}

    def where() -> None:
        print(json.dumps({"host": client.host, "confirmed": len(confirmed)}), flush=True)

    def wait_for_stop() -> None:
        for line in sys.stdin:
            if line.strip() != "where":
                break
            loop.call_soon_threadsafe(where)
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_stop, daemon=True).start()
    rejected: dict[str, str] = {}
    unknown_codes: dict[str, int] = {}
    in_flight = 0
    ended = ""
    all_settled = asyncio.Event()

    def settled(body: str, future: asyncio.Future[None]) -> None:
        nonlocal in_flight
        in_flight -= 1
        if in_flight == 0:
            all_settled.set()
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            confirmed[body] = time.monotonic()
        elif isinstance(error, LinkClosedError) or not isinstance(error, LinkRequestError):
            key = getattr(error, "code", type(error).__name__)
            unknown_codes[key] = unknown_codes.get(key, 0) + 1
        else:
            rejected[body] = error.code

    follow = bool(spec.get("follow"))
    reconnect = ReconnectPolicy(retry_interval=0.05, max_interval=0.5) if follow else ReconnectPolicy(attempts=0)
    client = LinkClient(
        spec["host"],
        spec["port"],
        user=USER,
        password=PASSWORD,
        follow_topology=follow,
        reconnect=reconnect,
        connect_timeout=5.0,
    )
    await client.connect()
    print(json.dumps("ready"), flush=True)
    interval, window = float(spec.get("interval", 0.002)), int(spec.get("window", 200))
    number = 0
    while not stop.is_set():
        if in_flight >= window:  # confirms are held: wait, without piling up more
            await asyncio.sleep(0.01)
            continue
        body = f"{spec['prefix']}-{number}"
        number += 1
        attempted.append(body)
        try:
            (future,) = await asyncio.wait_for(
                client.publish_batch([new_message(spec["address"], body.encode(), durable=True)]), 1.0
            )
        except TimeoutError:
            continue  # no credit for a second: the outcome of this one is unknown (it was never sent)
        except LinkRequestError as exc:
            ended = f"{exc.code}: {exc.text}"
            break
        in_flight += 1
        all_settled.clear()
        future.add_done_callback(functools.partial(settled, body))
        await asyncio.sleep(interval)
    if in_flight:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_settled.wait(), 3.0)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 2.0)
    print(
        json.dumps(
            {
                "attempted": attempted,
                "confirmed": confirmed,
                "rejected": rejected,
                "unknown_codes": unknown_codes,
                "ended": ended,
            }
        ),
        flush=True,
    )


async def agent_drain(spec: dict[str, Any]) -> None:
    """Consume and acknowledge a queue until it stays empty; print every delivery with its redelivered flag."""
    got: list[tuple[str, bool]] = []
    distinct: set[str] = set()
    expected = int(spec["expected"])
    start = time.monotonic()
    async with LinkClient(
        spec["host"],
        spec["port"],
        user=USER,
        password=PASSWORD,
        reconnect=ReconnectPolicy(attempts=0),
        connect_timeout=5.0,
    ) as client:
        consumer = await client.subscribe(spec["queue"], credit=1000)
        last = time.monotonic()
        while time.monotonic() - start < float(spec.get("limit", 25.0)):
            delivery = await consumer.get(timeout=0.25)
            now = time.monotonic()
            if delivery is None:
                idle = now - last
                if (len(distinct) >= expected and idle > 1.5) or idle > 5.0:
                    break
                continue
            last = now
            body = delivery.body.decode()
            got.append((body, delivery.redelivered))
            distinct.add(body)
            consumer.ack(delivery)
        await asyncio.sleep(0.2)  # the acknowledgements reach the node before the link closes
    print(json.dumps(got), flush=True)


def agent_main(argv: list[str]) -> None:
    role, spec = argv[0], json.loads(argv[1])
    if role == "monitor":
        agent_monitor(spec)
    elif role == "produce":
        asyncio.run(agent_produce(spec))
    elif role == "drain":
        asyncio.run(agent_drain(spec))
    else:
        raise SystemExit(f"unknown agent role {role!r}")


# ----------------------------------------------------------------------------------------------- test side


@dataclass
class Node:
    name: str
    pair: str
    role: str
    address: str
    data_dir: Path
    process: subprocess.Popen[bytes]

    @property
    def log_path(self) -> Path:
        return self.data_dir / "core.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Produced:
    """What one producer agent recorded."""

    attempted: list[str]
    confirmed: dict[str, float]  # body -> monotonic time of its confirm
    rejected: dict[str, str]  # body -> error code
    unknown_codes: dict[str, int]
    ended: str


@dataclass
class HaLab:
    """Three replication pairs in a network lab, a monitor, and the agents a test starts."""

    lab: NetLab
    root: Path
    env: dict[str, dict[str, str]] = field(default_factory=dict)  # per node: settings of its own
    nodes: dict[str, Node] = field(default_factory=dict)
    agents: list[Agent] = field(default_factory=list)
    monitor: Agent | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        primaries = [primary for primary, _ in PAIRS.values()]
        for pair, (primary, _backup) in PAIRS.items():
            self._start_core(primary, pair, "primary", [p for p in primaries if p != primary])
        for pair, (primary, backup) in PAIRS.items():
            self._start_core(backup, pair, "backup", [primary, *(p for p in primaries if p != primary)])
        deadline = time.monotonic() + 20
        for node in self.nodes.values():
            while not (node.data_dir / "ports.json").exists():
                if node.process.poll() is not None:
                    raise AssertionError(f"{node.name} exited with {node.process.returncode}:\n{node.log()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{node.name} did not start:\n{node.log()}")
                time.sleep(0.05)
        spec = {"nodes": {name: [node.address, MANAGEMENT_PORT] for name, node in self.nodes.items()}}
        self.monitor = self.agent(CLIENT, "monitor", spec)
        assert self.monitor.read(15) == "ready"
        self.wait(self.all_in_sync, 30, "every backup in sync, knowing 3 pairs")

    def _start_core(self, name: str, pair: str, role: str, connectors: list[str]) -> None:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "core.toml").write_text(CONFIG)
        address = self.lab.address(name)
        env = {
            **os.environ,
            "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir),
            "TRIDENTMQ_CORE_NODE_NAME": name,
            "TRIDENTMQ_CORE_LINK_HOST": address,
            "TRIDENTMQ_CORE_LINK_PORT": str(LINK_PORT),
            "TRIDENTMQ_CORE_MANAGEMENT_HOST": address,
            "TRIDENTMQ_CORE_MANAGEMENT_PORT": str(MANAGEMENT_PORT),
            "TRIDENTMQ_CORE_CLUSTER_ADVERTISE_HOST": address,
            "TRIDENTMQ_CORE_CLUSTER_USER": CLUSTER_USER,
            "TRIDENTMQ_CORE_CLUSTER_PASSWORD": CLUSTER_PASSWORD,
            "TRIDENTMQ_CORE_CLUSTER_CONNECTORS": ",".join(f"{self.lab.address(c)}:{LINK_PORT}" for c in connectors),
            "TRIDENTMQ_CORE_CLUSTER_SCALE_DOWN": "false",  # a stop at the end of a test moves nothing around
            "TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES": str(8 * 1024 * 1024),
            "TRIDENTMQ_CORE_HA_POLICY": "replication",
            "TRIDENTMQ_CORE_HA_GROUP_NAME": pair,
            "TRIDENTMQ_CORE_HA_ROLE": role,
            **self.env.get(name, {}),
        }
        argv = [
            sys.executable,
            "-m",
            "tridentmq_core",
            "--ports-file",
            str(data_dir / "ports.json"),
            "--config",
            str(data_dir / "core.toml"),
        ]
        with (data_dir / "core.log").open("wb") as log:
            process = self.lab.run(name, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.nodes[name] = Node(name, pair, role, address, data_dir, process)

    # ------------------------------------------------------------------ observing
    def views(self) -> dict[str, dict[str, Any] | None]:
        assert self.monitor is not None
        return dict(self.monitor.ask("views"))

    def all_in_sync(self) -> bool:
        views = self.views()
        for primary, backup in PAIRS.values():
            p, b = views.get(primary) or {}, views.get(backup) or {}
            if not (p.get("backup_in_sync") is True and b.get("in_sync") is True and b.get("pairs") == 3):
                return False
        return True

    def wait(self, predicate: Any, timeout: float, what: str) -> None:
        if not self.poll(predicate, timeout):
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; views: {self.views()}")

    @staticmethod
    def poll(predicate: Any, timeout: float) -> bool:
        """Whether ``predicate`` became true within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def view(self, node: str) -> dict[str, Any]:
        return self.views().get(node) or {}

    def readyz(self, node: str) -> tuple[int, dict[str, Any]]:
        """``node``'s ``/readyz`` (status code and body), asked from the client namespace."""
        url = f"http://{self.lab.address(node)}:{MANAGEMENT_PORT}/readyz"
        script = (
            "import json, sys, urllib.error, urllib.request\n"
            "try:\n"
            f"    answer = urllib.request.urlopen({url!r}, timeout=5)\n"
            "except urllib.error.HTTPError as error:\n"
            "    answer = error\n"
            "print(json.dumps([answer.status, json.loads(answer.read())]))\n"
        )
        process = self.lab.run(CLIENT, [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        out, _ = process.communicate(timeout=15)
        status, body = json.loads(out)
        return int(status), dict(body)

    def timeline(self) -> list[list[Any]]:
        assert self.monitor is not None
        return list(self.monitor.ask("stop"))

    # ------------------------------------------------------------------ clients
    def agent(self, node: str, role: str, spec: dict[str, Any]) -> Agent:
        log_path = self.root / f"agent-{role}-{node}-{len(self.agents)}.log"
        agent = Agent(self.lab, node, Path(__file__), role, spec, log_path)
        self.agents.append(agent)
        return agent

    def producer(self, at: str, target: str, pair: str, prefix: str, *, follow: bool = False) -> Agent:
        """A producer in ``at``'s namespace publishing to ``target`` (a node name), on ``pair``'s queue;
        ``follow``: a client that follows the topology and reconnects."""
        spec = {
            "host": self.lab.address(target),
            "port": LINK_PORT,
            "address": queue_of(pair),
            "prefix": prefix,
            "follow": follow,
        }
        agent = self.agent(at, "produce", spec)
        assert agent.read(15) == "ready"
        return agent

    @staticmethod
    def produced(agent: Agent) -> Produced:
        # A producer whose node closed its link (a fenced node) reports and exits without waiting for this.
        with contextlib.suppress(BrokenPipeError):
            agent.send("stop")
        result = agent.read(20)
        return Produced(
            result["attempted"], result["confirmed"], result["rejected"], result["unknown_codes"], result["ended"]
        )

    def drain(self, node: str, pair: str, expected: int) -> list[Delivery[str]]:
        spec = {"host": self.lab.address(node), "port": LINK_PORT, "queue": queue_of(pair), "expected": expected}
        agent = self.agent(CLIENT, "drain", spec)
        got = agent.read(40)
        agent.stop()
        return [Delivery(body, bool(redelivered)) for body, redelivered in got]

    # ------------------------------------------------------------------ stopping
    def stop_cores(self, names: list[str] | None = None, timeout: float = 10.0) -> dict[str, int]:
        """SIGTERM (after SIGCONT) every named core still running, all at once, then wait; SIGKILL what is
        left after ``timeout``. Returns each node's exit status."""
        chosen = [self.nodes[n] for n in (names if names is not None else list(self.nodes))]
        for node in chosen:
            if node.process.poll() is None:
                resume(node.process.pid)
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: dict[str, int] = {}
        for node in chosen:
            try:
                codes[node.name] = node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill9(node.process.pid)
                codes[node.name] = node.process.wait()
        return codes

    def close(self) -> None:
        """Stop every agent and every core by its PID (the lab's close kills anything left)."""
        for agent in self.agents:
            agent.stop()
        self.stop_cores(timeout=8.0)


@pytest.fixture
def ha_lab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HaLab]:
    """The lab, started; parametrized indirectly, its parameter gives nodes settings of their own."""
    available = NetLab.available()
    if not available:
        pytest.skip(f"no network lab: {available.reason}")
    lab = NetLab([*(node for pair in PAIRS.values() for node in pair), CLIENT])
    try:
        cluster = HaLab(lab, tmp_path, env=getattr(request, "param", {}))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.close()
    finally:
        lab.close()


# ----------------------------------------------------------------------------------------------- checks


def serving_overlaps(timeline: list[list[Any]], pair: str) -> list[str]:
    """Moments (in the monitor's samples) when both nodes of ``pair`` were serving: active and not holding
    confirms for a quorum. A node that did not answer counts as unknown, not serving."""
    nodes = PAIRS[pair]
    state: dict[str, bool] = dict.fromkeys(nodes, False)
    overlaps: list[str] = []
    for _sent, answered, name, view in sorted(timeline, key=lambda sample: sample[1]):
        if name not in nodes:
            continue
        state[name] = bool(view and view.get("active") and not view.get("waiting_for_quorum"))
        if all(state.values()):
            overlaps.append(f"t={answered:.2f}: both {nodes} serving")
    return overlaps


def ever_active(timeline: list[list[Any]], node: str) -> bool:
    return any(view and view.get("active") for _s, _a, name, view in timeline if name == node)


def journal_bodies(data_dir: Path) -> set[str]:
    """Every message body in a (stopped) node's journal."""
    bodies: set[str] = set()
    for path in list_segments(data_dir / "journal"):
        for item in scan(path.read_bytes()):
            if not isinstance(item, Record):
                continue
            if item.type == RecordType.MESSAGE:
                bodies.add(bytes(item.payload[0][M_BODY]).decode(errors="replace"))
            elif item.type == RecordType.TX_MESSAGE:
                bodies.add(bytes(item.payload[1][M_BODY]).decode(errors="replace"))
    return bodies


def verdict_of(produced: list[Produced], delivered: list[Delivery[str]]) -> Verdict[str]:
    attempted = [body for p in produced for body in p.attempted]
    confirmed = [body for p in produced for body in p.confirmed]
    rejected = [body for p in produced for body in p.rejected]
    verdict = check(attempted, confirmed, rejected, delivered)
    print(verdict.report())  # duplicates and recovered values are allowed: reported, not failed
    return verdict


def confirmed_during(produced: Produced, start: float, end: float) -> int:
    return sum(1 for t in produced.confirmed.values() if start <= t <= end)


# ----------------------------------------------------------------------------------------------- tests
# Each test records every problem it finds and fails once at the end with all of them (a Jepsen run reports
# everything it saw, not only the first anomaly).


def test_primary_cut_off_from_its_backup_stays_active_with_a_quorum(ha_lab: HaLab) -> None:
    """a1 <-/-> a2 only: the voters still reach a1, so a2 must not take over; a1 goes on once a quorum agrees
    ("stay"), and keeps confirming; after healing nothing confirmed is lost and a2 copies a1 again."""
    problems: list[str] = []
    a1, a2 = ha_lab.nodes["a1"], ha_lab.nodes["a2"]
    producer = ha_lab.producer(CLIENT, "a1", "a", "p1")
    time.sleep(1.0)
    ha_lab.lab.partition("a1", "a2")
    cut = time.monotonic()
    if not ha_lab.poll(lambda: "quorum agrees: going on without the backup" in a1.log(), 8):
        problems.append(f"a1 did not go on with a quorum within 8 s of the partition; a1: {ha_lab.view('a1')}")
    time.sleep(max(0.0, cut + 10.0 - time.monotonic()))  # a2 keeps asking for votes: it must keep being refused
    healed = time.monotonic()
    ha_lab.lab.heal()
    if not ha_lab.poll(ha_lab.all_in_sync, 15):
        problems.append(f"a2 was not in sync with a1 again 15 s after healing: {ha_lab.views()}")
    produced = ha_lab.produced(producer)
    timeline = ha_lab.timeline()
    delivered = ha_lab.drain("a1", "a", len(produced.confirmed))
    verdict = verdict_of([produced], delivered)
    if not verdict.ok:
        problems.append(verdict.report())
    during = confirmed_during(produced, cut + 5.0, healed)
    if during == 0:
        problems.append("a1 confirmed nothing from 5 s after the partition until healing")
    if ever_active(timeline, "a2") or "backup activated" in a2.log():
        problems.append("a2 took over although the voters still reached a1")
    problems += serving_overlaps(timeline, "a")[:5]
    codes = ha_lab.stop_cores()
    if any(code != 0 for code in codes.values()):
        problems.append(f"exit codes: {codes}")
    print(f"confirmed {len(produced.confirmed)}, of which {during} during the partition after the stay vote")
    assert problems == [], "\n".join(problems)


def test_isolated_primary_is_replaced_and_confirms_nothing_after_isolation(ha_lab: HaLab) -> None:
    """a1 cut off from everyone: a2 takes over with a quorum; the producer inside a1's namespace sees no
    confirm later than the isolation plus a grace; after healing a1 is fenced (or serves nobody)."""
    problems: list[str] = []
    a1, a2 = ha_lab.nodes["a1"], ha_lab.nodes["a2"]
    inside = ha_lab.producer("a1", "a1", "a", "iso")  # the only client that still reaches a1 once it is isolated
    time.sleep(1.0)
    ha_lab.lab.isolate("a1")
    isolated = time.monotonic()
    ha_lab.wait(lambda: ha_lab.view("a2").get("active") is True, 20, "a2 to take over")
    took_over = time.monotonic() - isolated
    if "quorum reached" not in a2.log():
        problems.append("a2 activated without a quorum")
    time.sleep(2.0)  # a1 has had time to confirm something it must not
    ha_lab.lab.heal()
    with contextlib.suppress(subprocess.TimeoutExpired):
        a1.process.wait(timeout=15)
    a1_code = a1.process.poll()
    if a1_code is None:  # still running: it must refuse to serve
        view = ha_lab.view("a1")
        if view.get("active") and not view.get("waiting_for_quorum"):
            problems.append(f"a1 still serves 15 s after healing: {view}")
    elif a1_code != FENCED_EXIT_CODE or "fenced" not in a1.log():
        problems.append(f"a1 exited with {a1_code}, not fenced:\n{a1.log()[-2000:]}")
    epoch = ha_lab.view("a2").get("epoch")
    if epoch != 2:
        problems.append(f"a2 is active at epoch {epoch}, not 2")
    produced = ha_lab.produced(inside)
    late = {body: round(t - isolated, 3) for body, t in produced.confirmed.items() if t > isolated + CONFIRM_GRACE}
    if late:
        problems.append(f"the isolated a1 confirmed {len(late)} messages after isolation (+s): {late}")
    timeline = ha_lab.timeline()
    delivered = ha_lab.drain("a2", "a", len(produced.confirmed))
    verdict = verdict_of([produced], delivered)
    if not verdict.ok:
        problems.append(verdict.report())
    problems += serving_overlaps(timeline, "a")[:5]
    codes = ha_lab.stop_cores()
    if any(code != 0 for name, code in codes.items() if name != "a1"):
        problems.append(f"exit codes: {codes}")
    held = {"a1": journal_bodies(a1.data_dir), "a2": {d.value for d in delivered}}
    comparison = compare_nodes(held, {"a": ["a1", "a2"]}, {"a": "a2"}, produced.confirmed)
    print(comparison.report())
    if not comparison.ok:
        problems.append(comparison.report())
    print(f"a2 took over {took_over:.2f} s after the isolation; a1 ended with {a1_code}")
    assert problems == [], "\n".join(problems)


def test_a_primary_cut_off_from_the_cluster_says_so_and_its_following_client_finds_the_backup(ha_lab: HaLab) -> None:
    """a1 cut off from every other core, its client (in the client namespace) still reaching it: a2 takes
    over; a1, holding every confirm, reports that it serves nobody (not "active" beside a2) and sends its
    clients away; the client, which follows the topology, keeps the cluster it knew (a1 now reports itself
    alone) and carries on at a2. Nothing confirmed is lost."""
    problems: list[str] = []
    a1 = ha_lab.nodes["a1"]
    producer = ha_lab.producer(CLIENT, "a1", "a", "cut", follow=True)
    ha_lab.wait(lambda: producer.ask("where")["confirmed"] > 0, 10, "the first confirms")
    for other in (node for pair in PAIRS.values() for node in pair if node != "a1"):
        ha_lab.lab.partition("a1", other)
    cut = time.monotonic()
    ha_lab.wait(lambda: ha_lab.view("a2").get("active") is True, 20, "a2 to take over")
    took_over = time.monotonic() - cut
    if not ha_lab.poll(lambda: ha_lab.view("a1").get("cut_off") is True, 10):
        problems.append(f"a1 does not say it is cut off: {ha_lab.view('a1')}")
    status, body = ha_lab.readyz("a1")
    if status != 503 or body.get("status") != "not-serving":
        problems.append(f"a1's /readyz says it can serve while it is cut off: {status} {body}")
    if ha_lab.readyz("b1")[0] != 200:
        problems.append(f"b1's /readyz: {ha_lab.readyz('b1')}")
    a1_view, a2_view = ha_lab.view("a1"), ha_lab.view("a2")
    if a1_view.get("active") is not False:
        problems.append(f"a1 reports active beside a2 (epoch {a2_view.get('epoch')}): {a1_view}")
    confirmed_before = producer.ask("where")["confirmed"]
    a2_host = ha_lab.lab.address("a2")

    def moved() -> bool:
        now = producer.ask("where")
        return bool(now["host"] == a2_host and now["confirmed"] > confirmed_before)

    if not ha_lab.poll(moved, 15):
        problems.append(f"the client did not carry on at a2 within 15 s: {producer.ask('where')}")
    carried_on = time.monotonic() - cut
    ha_lab.lab.heal()
    with contextlib.suppress(subprocess.TimeoutExpired):
        a1.process.wait(timeout=15)
    if a1.process.poll() not in (None, FENCED_EXIT_CODE):
        problems.append(f"a1 exited with {a1.process.poll()}:\n{a1.log()[-2000:]}")
    produced = ha_lab.produced(producer)
    timeline = ha_lab.timeline()
    delivered = ha_lab.drain("a2", "a", len(produced.confirmed))
    verdict = verdict_of([produced], delivered)
    if not verdict.ok:
        problems.append(verdict.report())
    problems += serving_overlaps(timeline, "a")[:5]
    codes = ha_lab.stop_cores()
    if any(code != 0 for name, code in codes.items() if name != "a1"):
        problems.append(f"exit codes: {codes}")
    print(f"a2 took over {took_over:.2f} s after the cut; the client confirmed at a2 {carried_on:.2f} s after it")
    assert problems == [], "\n".join(problems)


def test_one_way_partition_of_a_primary_keeps_one_active_node(ha_lab: HaLab) -> None:
    """Every packet from a1 to the other cores dropped (the client namespace still reaches it both ways):
    at every sampled moment at most one node of the pair serves (active and not holding confirms for a
    quorum), a1 confirms nothing once cut off, pair b goes on; after healing nothing confirmed is lost."""
    problems: list[str] = []
    a1 = ha_lab.nodes["a1"]
    to_a1 = ha_lab.producer(CLIENT, "a1", "a", "ow")
    to_b1 = ha_lab.producer(CLIENT, "b1", "b", "owb")
    time.sleep(1.0)
    for other in (node for pair in PAIRS.values() for node in pair if node != "a1"):
        ha_lab.lab.partition_oneway("a1", other)
    cut = time.monotonic()
    ha_lab.wait(lambda: ha_lab.view("a2").get("active") is True, 20, "a2 to take over")
    time.sleep(2.0)
    ha_lab.lab.heal()
    with contextlib.suppress(subprocess.TimeoutExpired):
        a1.process.wait(timeout=15)
    if a1.process.poll() not in (None, FENCED_EXIT_CODE):
        problems.append(f"a1 exited with {a1.process.poll()}:\n{a1.log()[-2000:]}")
    produced_a, produced_b = ha_lab.produced(to_a1), ha_lab.produced(to_b1)
    timeline = ha_lab.timeline()
    late = {body: round(t - cut, 3) for body, t in produced_a.confirmed.items() if t > cut + CONFIRM_GRACE}
    if late:
        problems.append(f"a1 confirmed {len(late)} messages after it was cut off (+s): {late}")
    if confirmed_during(produced_b, cut, cut + 3.0) == 0:
        problems.append("pair b stopped confirming during a's partition")
    delivered = ha_lab.drain("a2", "a", len(produced_a.confirmed)) + ha_lab.drain("b1", "b", len(produced_b.confirmed))
    verdict = verdict_of([produced_a, produced_b], delivered)
    if not verdict.ok:
        problems.append(verdict.report())
    overlaps = serving_overlaps(timeline, "a")
    if overlaps:
        problems.append(f"{len(overlaps)} samples with two serving nodes, e.g. {overlaps[:3]}")
    ha_lab.stop_cores()
    held = {"a1": journal_bodies(a1.data_dir), "a2": {d.value for d in delivered}}
    comparison = compare_nodes(held, {"a": ["a1", "a2"]}, {"a": "a2"}, produced_a.confirmed)
    print(comparison.report())
    if not comparison.ok:
        problems.append(comparison.report())
    assert problems == [], "\n".join(problems)


def logged(node: Node, *parts: str) -> bool:
    """Whether one line of ``node``'s log has every one of ``parts``."""
    return any(all(part in line for part in parts) for line in node.log().splitlines())


@pytest.mark.parametrize("ha_lab", [{"b1": {"TRIDENTMQ_CORE_HA_VOTE_GRACE_MS": "600000"}}], indirect=True)
def test_a_primary_that_stood_still_is_not_fenced_by_its_backups_lost_bid(ha_lab: HaLab) -> None:
    """a1 stands still (SIGSTOP) long enough for a2 to bid for the next epoch and for c1 to promise it, while
    b1 still counts a1 as reachable (a long vote grace) and refuses: the bid is lost. a1 resumes cut off from
    b1, so it cannot go on at a new epoch yet, and joins c1 again at its old epoch. c1's promise must not
    fence it (a promise is not a win): once healed, a1 goes on at a new epoch with b1's grant, joins c1, a2
    copies it again and withdraws its bid at c1, new writes are confirmed, and nothing confirmed is lost.
    (Fenced there, a1 restarted and was refused for good, and the pair served nothing: seen in CI on an
    overloaded machine.)"""
    problems: list[str] = []
    a1, a2, c1 = ha_lab.nodes["a1"], ha_lab.nodes["a2"], ha_lab.nodes["c1"]
    before = ha_lab.producer(CLIENT, "a1", "a", "before")
    time.sleep(1.0)
    ha_lab.lab.partition("a1", "b1")
    with paused(a1.process.pid):
        ha_lab.wait(lambda: logged(c1, "vote kind=activate", "granted=True"), 20, "c1 to promise a2 the next epoch")
        time.sleep(1.0)  # a few more rounds, each lost at b1
    if not ha_lab.poll(lambda: logged(c1, "cluster join refused", "may have been replaced"), 15):
        problems.append(f"c1 did not keep a1 out while the bid's outcome was unknown:\n{c1.log()[-2000:]}")
    ha_lab.lab.heal()
    if not ha_lab.poll(ha_lab.all_in_sync, 30):
        problems.append(f"the pairs were not whole 30 s after healing: {ha_lab.views()}")
    if a1.process.poll() is not None:
        problems.append(f"a1 exited with {a1.process.poll()}:\n{a1.log()[-3000:]}")
        pytest.fail("\n".join(problems))  # nothing serves pair a: the rest cannot be checked
    # a2, copying a1 again, withdrew its lost bid: c1 forgot the promise (which would refuse a1's restart).
    if not ha_lab.poll(lambda: logged(c1, "vote kind=withdraw", "granted=True"), 10):
        problems.append(f"a2's lost bid was not withdrawn at c1:\n{a2.log()[-2000:]}")
    epoch = ha_lab.view("a1").get("epoch")
    if not (ha_lab.view("a1").get("active") and epoch == 2):
        problems.append(f"a1 does not serve at epoch 2: {ha_lab.view('a1')}")
    after = ha_lab.producer(CLIENT, "a1", "a", "after")
    if not ha_lab.poll(lambda: after.ask("where")["confirmed"] >= 10, 15):
        problems.append(f"a1 confirms no new writes: {after.ask('where')}")
    produced = [ha_lab.produced(before), ha_lab.produced(after)]
    timeline = ha_lab.timeline()
    if ever_active(timeline, "a2") or "backup activated" in a2.log():
        problems.append("a2 took over although its bid was lost")
    problems += serving_overlaps(timeline, "a")[:5]
    delivered = ha_lab.drain("a1", "a", sum(len(p.confirmed) for p in produced))
    verdict = verdict_of(produced, delivered)
    if not verdict.ok:
        problems.append(verdict.report())
    codes = ha_lab.stop_cores()
    if any(code != 0 for code in codes.values()):
        problems.append(f"exit codes: {codes}")
    assert problems == [], "\n".join(problems)


def test_loss_on_the_replication_link_causes_no_split_brain(ha_lab: HaLab) -> None:
    """30 % of the packets between a1 and a2 dropped for 8 s: never two serving nodes, nothing lost, and
    the pair whole again (its backup in sync) after healing."""
    problems: list[str] = []
    producer = ha_lab.producer(CLIENT, "a1", "a", "loss")
    time.sleep(1.0)
    ha_lab.lab.loss("a1", "a2", 30)
    time.sleep(8.0)
    ha_lab.lab.heal()
    if not ha_lab.poll(ha_lab.all_in_sync, 15):
        problems.append(f"the pair was not whole 15 s after healing: a1 {ha_lab.view('a1')}, a2 {ha_lab.view('a2')}")
    views = ha_lab.views()
    active = [node for node in PAIRS["a"] if (views.get(node) or {}).get("active")]
    produced = ha_lab.produced(producer)
    timeline = ha_lab.timeline()
    problems += serving_overlaps(timeline, "a")[:5]
    if len(active) != 1:
        problems.append(f"pair a has {len(active)} active nodes after healing: {views}")
    delivered = ha_lab.drain(active[0] if active else "a1", "a", len(produced.confirmed))
    verdict = verdict_of([produced], delivered)
    if not verdict.ok:
        problems.append(verdict.report())
    codes = ha_lab.stop_cores()
    if any(code != 0 for code in codes.values()):
        problems.append(f"exit codes (a node that needed SIGKILL shows -9): {codes}")
    print(f"active after the loss: {active}")
    assert problems == [], "\n".join(problems)


if __name__ == "__main__":  # an agent process inside the lab (see Agent)
    agent_main(sys.argv[1:])
