"""High-availability benchmarks: failover time, failover and failback per protocol, and durable throughput
with a replicating backup.

    uv run python -m bench.ha [--runs 10] [--count 100000] [--protocols-only]

- failover time: a cluster of three replication pairs and an MQTT gateway linked to the primary of one of
  them; a paho client publishes QoS 1 messages one after another through the gateway. The primary is killed
  (SIGKILL); the figure is the time from the kill to the first PUBACK the client receives afterwards (its
  in-flight message, or the next one), i.e. detection, the quorum vote, the backup's recovery and the
  gateway's move to it. One fresh cluster per run; the distribution over ``--runs`` runs is printed.
- failover and failback per protocol: the same three pairs, with a STOMP, an MQTT and an AMQP gateway and
  a link client all linked to the primary of one pair, each publishing durable messages one after another
  and waiting for each acknowledgement (a STOMP receipt, a PUBACK, an accepted disposition, a link confirm).
  Failover: the time from the kill -9 of the primary to the acknowledgement of the first message published
  after it. Failback: the primary is started again; it copies the backup, which then hands the pair back;
  the figure is the longest wait for an acknowledgement while that happens (from the last acknowledgement
  by the backup to the first by the returned primary). Any error a client sees is counted and printed.
- durable throughput: ``tridentmq perf``'s workload with durable messages (100 bytes, one producer keeping
  its publish window full, one consumer) on a primary without a backup, then on the same kind of primary
  with an in-sync backup, where every confirm waits for both copies.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import paho.mqtt.client as paho
import stomp
from bench.cluster import perf
from bench.node import Core, amqp_gateway, core_node, machine, mqtt_gateway, stomp_gateway
from paho.mqtt.enums import CallbackAPIVersion
from proton import Message
from proton.utils import BlockingConnection

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message

CLUSTER = {"cluster_user": "cluster", "cluster_password": "bench-secret"}


def ha_view(node: Core) -> dict[str, object]:
    return dict(json.loads(node.get("/api/status")).get("ha") or {})


def wait(what: str, predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def pairs(tmp: Path, count: int) -> Iterator[list[tuple[Core, Core]]]:
    """``count`` replication pairs forming one cluster, every backup in sync and knowing every pair."""
    with ExitStack() as stack:
        made: list[tuple[Core, Core]] = []
        for i in range(count):
            seeds = [made[0][0]] if made else []
            ha = {"ha_policy": "replication", "ha_group_name": f"pair-{i}", **CLUSTER}
            primary = stack.enter_context(
                core_node(
                    tmp / f"primary-{i}", cluster_connectors=",".join(f"127.0.0.1:{s.link_port}" for s in seeds), **ha
                )
            )
            backup = stack.enter_context(
                core_node(
                    tmp / f"backup-{i}",
                    cluster_connectors=",".join(f"127.0.0.1:{s.link_port}" for s in [primary, *seeds]),
                    ha_role="backup",
                    **ha,
                )
            )
            made.append((primary, backup))
        wait(
            "every backup in sync and seeing every pair",
            lambda: all(ha_view(b).get("in_sync") and ha_view(b).get("pairs") == count for _, b in made),
        )
        yield made


def failover_once(tmp: Path) -> float:
    """Seconds from SIGKILL of a primary to the first PUBACK through the gateway linked to it."""
    with pairs(tmp, 3) as made:
        primary, backup = made[1]
        # FIRST_ELEMENT keeps the client's link on the primary it is linked to (a node lists itself first).
        with mqtt_gateway(primary, tmp / "gateway", core_load_balancing="FIRST_ELEMENT") as gateway:
            acked: list[tuple[float, float]] = []  # (sent, acknowledged) of each publish, in order
            stop = threading.Event()
            client = paho.Client(CallbackAPIVersion.VERSION2, client_id="failover-bench")
            client.connect("127.0.0.1", gateway.port)
            client.loop_start()

            def publish() -> None:
                i = 0
                while not stop.is_set():
                    sent = time.monotonic()
                    client.publish("bench/failover", b"%d" % i, qos=1).wait_for_publish(30)
                    acked.append((sent, time.monotonic()))
                    i += 1

            publisher = threading.Thread(target=publish, daemon=True)
            publisher.start()
            wait("traffic", lambda: len(acked) >= 200)
            killed = time.monotonic()
            primary.process.send_signal(signal.SIGKILL)
            primary.process.wait()
            # The first publish sent after the kill: the one in flight may have been confirmed just before it.
            wait("an acknowledgement of a publish sent after the kill", lambda: acked[-1][0] > killed)
            first = next(done for sent, done in acked if sent > killed)
            stop.set()
            publisher.join(timeout=30)
            client.loop_stop()
            client.disconnect()
            if not ha_view(backup).get("active"):
                raise SystemExit("the publish was acknowledged, but not by the backup")
            return first - killed


class Publisher:
    """Publishes with ``publish`` (which returns once the message is acknowledged) one message after another
    on its own thread, recording (sent, acknowledged) of each, and the errors it sees (it goes on after one)."""

    def __init__(self, name: str, publish: Callable[[bytes], None]) -> None:
        self.name = name
        self.publish = publish
        self.acked: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stopped.is_set():
            sent = time.monotonic()
            try:
                self.publish(b"%d" % i)
            except Exception as exc:  # what the client saw: counted, then it goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)
                continue
            self.acked.append((sent, time.monotonic()))
            i += 1

    def first_ack_after(self, moment: float) -> float:
        """Seconds from ``moment`` to the acknowledgement of the first publish sent after it."""
        wait(f"a {self.name} acknowledgement", lambda: bool(self.acked) and self.acked[-1][0] > moment, 60)
        return next(done for sent, done in self.acked if sent > moment) - moment

    def longest_wait(self, start: float, end: float) -> float:
        """The longest time between two acknowledgements from ``start`` to the first after ``end``."""
        wait(f"a {self.name} acknowledgement", lambda: bool(self.acked) and self.acked[-1][1] > end, 60)
        times = [done for _, done in self.acked if done >= start]
        last = next(i for i, t in enumerate(times) if t > end)
        return max(b - a for a, b in itertools.pairwise(times[: last + 1])) if last else 0.0

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=60)


def stomp_publish(port: int) -> Callable[[bytes], None]:
    conn = stomp.Connection12([("127.0.0.1", port)])
    receipts: dict[str, threading.Event] = {}
    errors: list[str] = []

    class Listener(stomp.ConnectionListener):  # type: ignore[misc]
        def on_receipt(self, frame: stomp.utils.Frame) -> None:
            receipts.pop(frame.headers["receipt-id"], threading.Event()).set()

        def on_error(self, frame: stomp.utils.Frame) -> None:
            errors.append(f"ERROR {frame.headers.get('message')}: {frame.body}")
            for event in list(receipts.values()):
                event.set()

    conn.set_listener("bench", Listener())
    conn.connect(wait=True)
    count = iter(range(1 << 62))

    def publish(body: bytes) -> None:
        receipt = f"r{next(count)}"
        done = receipts[receipt] = threading.Event()
        conn.send("/queue/bench.ha.stomp", body, receipt=receipt, headers={"persistent": "true"})
        if not done.wait(60) or errors:
            raise RuntimeError(errors.pop() if errors else "no receipt")

    return publish


def mqtt_publish(port: int) -> Callable[[bytes], None]:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="failback-bench")
    client.connect("127.0.0.1", port)
    client.loop_start()
    disconnects: list[str] = []
    client.on_disconnect = lambda _c, _u, _f, reason, _p: disconnects.append(str(reason))

    def publish(body: bytes) -> None:
        info = client.publish("bench/ha/mqtt", body, qos=1)
        info.wait_for_publish(60)
        if disconnects:
            raise RuntimeError(f"disconnected: {disconnects.pop()}")

    return publish


def amqp_publish(port: int) -> Callable[[bytes], None]:
    sender = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=60).create_sender("bench.ha.amqp")

    def publish(body: bytes) -> None:
        sender.send(Message(body=body, durable=True))  # returns once accepted

    return publish


def link_publish(port: int) -> Callable[[bytes], None]:
    """A link client on a loop of its own thread."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    client = LinkClient("127.0.0.1", port, follow_topology=True, reconnect=ReconnectPolicy(retry_interval=0.05))
    asyncio.run_coroutine_threadsafe(client.connect(), loop).result(30)

    def publish(body: bytes) -> None:
        message = new_message("bench.ha.link", body, durable=True)
        asyncio.run_coroutine_threadsafe(client.publish(message), loop).result(60)

    return publish


def failover_and_failback(tmp: Path) -> dict[str, tuple[float, float, list[str]]]:
    """Per protocol: (failover seconds, failback seconds, errors seen) through gateways linked to a primary."""
    with pairs(tmp, 3) as made, ExitStack() as stack:
        primary, backup = made[1]
        first = {"core_load_balancing": "FIRST_ELEMENT"}  # the links stay on the primary they are linked to
        ports = {
            "stomp": stack.enter_context(stomp_gateway(primary, tmp / "stomp", **first)).port,
            "mqtt": stack.enter_context(mqtt_gateway(primary, tmp / "mqtt", **first)).port,
            "amqp": stack.enter_context(amqp_gateway(primary, tmp / "amqp", **first)).port,
            "link": primary.link_port,
        }
        makers = {"stomp": stomp_publish, "mqtt": mqtt_publish, "amqp": amqp_publish, "link": link_publish}
        publishers = [Publisher(name, makers[name](port)) for name, port in ports.items()]
        wait("traffic", lambda: all(len(p.acked) >= 50 for p in publishers))
        killed = time.monotonic()
        primary.process.send_signal(signal.SIGKILL)
        primary.process.wait()
        failover = {p.name: p.first_ack_after(killed) for p in publishers}
        wait("the backup to take over", lambda: ha_view(backup).get("active") is True)
        restarted = time.monotonic()
        ha = {"ha_policy": "replication", "ha_group_name": "pair-1", **CLUSTER}
        returned = stack.enter_context(
            core_node(
                tmp / "primary-1",
                link_port=str(primary.link_port),
                cluster_connectors=f"127.0.0.1:{backup.link_port},127.0.0.1:{made[0][0].link_port}",
                **ha,
            )
        )
        wait("the failback", lambda: ha_view(returned).get("active") is True, 120)
        back = time.monotonic()
        failback = {p.name: p.longest_wait(restarted, back) for p in publishers}
        for publisher in publishers:
            publisher.stop()
        return {p.name: (failover[p.name], failback[p.name], p.errors) for p in publishers}


def protocols(tmp: Path, runs: int) -> None:
    results: dict[str, list[tuple[float, float, list[str]]]] = {}
    for run in range(runs):
        for name, outcome in failover_and_failback(tmp / f"protocols-{run}").items():
            results.setdefault(name, []).append(outcome)
            print(
                f"  run {run + 1} {name}: failover {outcome[0] * 1000:,.0f} ms, failback {outcome[1] * 1000:,.0f} ms"
                + (f", errors {outcome[2]}" if outcome[2] else ""),
                flush=True,
            )
    for name, outcomes in results.items():
        over, back = [o[0] * 1000 for o in outcomes], [o[1] * 1000 for o in outcomes]
        errors = sum(len(o[2]) for o in outcomes)
        print(
            f"{name:5}: failover median {statistics.median(over):,.0f} ms, max {max(over):,.0f} ms; failback "
            f"median {statistics.median(back):,.0f} ms, max {max(back):,.0f} ms; client errors {errors} "
            f"({len(outcomes)} runs)"
        )


def throughput(tmp: Path, count: int, runs: int) -> tuple[list[float], list[float]]:
    ha = {"ha_policy": "replication", "ha_group_name": "solo", **CLUSTER}
    with core_node(tmp / "alone", **ha) as alone:
        without = [perf(alone, count, durable=True) for _ in range(runs)]
    with (
        core_node(tmp / "primary", **ha) as primary,
        core_node(
            tmp / "backup", cluster_connectors=f"127.0.0.1:{primary.link_port}", ha_role="backup", **ha
        ) as backup,
    ):
        wait("the backup in sync", lambda: ha_view(backup).get("in_sync") is True)
        replicated = [perf(primary, count, durable=True) for _ in range(runs)]
    return without, replicated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="failover runs (3 throughput runs each way)")
    parser.add_argument("--count", type=int, default=100_000, help="messages per throughput run")
    parser.add_argument("--protocols-only", action="store_true", help="only failover and failback per protocol")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tridentmq-ha-") as tmp:
        protocols(Path(tmp), args.runs)
        if args.protocols_only:
            return
        times = []
        for run in range(args.runs):
            seconds = failover_once(Path(tmp) / f"failover-{run}")
            times.append(seconds)
            print(f"  failover run {run + 1}: {seconds * 1000:,.0f} ms", flush=True)
        times.sort()
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        ms = [f"{t * 1000:,.0f} ms" for t in (statistics.median(times), p90, times[0], times[-1])]
        print(
            f"failover (kill -9 of a primary → PUBACK of the next publish through its gateway), {len(times)} runs: "
            f"median {ms[0]}, p90 {ms[1]}, min {ms[2]}, max {ms[3]}"
        )
        without, replicated = throughput(Path(tmp), args.count, 3)
        ratio = statistics.median(replicated) / statistics.median(without)
        print(
            f"durable, no backup      {statistics.median(without):,.0f} msgs/s (min {min(without):,.0f}, "
            f"max {max(without):,.0f})"
        )
        print(
            f"durable, in-sync backup {statistics.median(replicated):,.0f} msgs/s (min {min(replicated):,.0f}, "
            f"max {max(replicated):,.0f}) = {ratio:.0%} of no backup"
        )


if __name__ == "__main__":
    main()
