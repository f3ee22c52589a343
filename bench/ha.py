"""High-availability benchmarks: failover time, and durable throughput with a replicating backup.

    uv run python -m bench.ha [--runs 10] [--count 100000]

- failover time: a cluster of three replication pairs and an MQTT gateway linked to the primary of one of
  them; a paho client publishes QoS 1 messages one after another through the gateway. The primary is killed
  (SIGKILL); the figure is the time from the kill to the first PUBACK the client receives afterwards (its
  in-flight message, or the next one), i.e. detection, the quorum vote, the backup's recovery and the
  gateway's move to it. One fresh cluster per run; the distribution over ``--runs`` runs is printed.
- durable throughput: ``tridentmq perf``'s workload with durable messages (100 bytes, one producer keeping
  its publish window full, one consumer) on a primary without a backup, then on the same kind of primary
  with an in-sync backup, where every confirm waits for both copies.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import paho.mqtt.client as paho
from bench.cluster import perf
from bench.node import Core, core_node, machine, mqtt_gateway
from paho.mqtt.enums import CallbackAPIVersion

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
            backup = stack.enter_context(core_node(
                tmp / f"backup-{i}", cluster_connectors=",".join(f"127.0.0.1:{s.link_port}" for s in [primary, *seeds]),
                ha_role="backup", **ha))  # fmt: skip
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


def throughput(tmp: Path, count: int, runs: int) -> tuple[list[float], list[float]]:
    ha = {"ha_policy": "replication", "ha_group_name": "solo", **CLUSTER}
    with core_node(tmp / "alone", **ha) as alone:
        without = [perf(alone, count, durable=True) for _ in range(runs)]
    with core_node(tmp / "primary", **ha) as primary, \
            core_node(tmp / "backup", cluster_connectors=f"127.0.0.1:{primary.link_port}", ha_role="backup", **ha
                      ) as backup:  # fmt: skip
        wait("the backup in sync", lambda: ha_view(backup).get("in_sync") is True)
        replicated = [perf(primary, count, durable=True) for _ in range(runs)]
    return without, replicated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="failover runs (3 throughput runs each way)")
    parser.add_argument("--count", type=int, default=100_000, help="messages per throughput run")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tridentmq-ha-") as tmp:
        times = []
        for run in range(args.runs):
            seconds = failover_once(Path(tmp) / f"failover-{run}")
            times.append(seconds)
            print(f"  failover run {run + 1}: {seconds * 1000:,.0f} ms", flush=True)
        times.sort()
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        ms = [f"{t * 1000:,.0f} ms" for t in (statistics.median(times), p90, times[0], times[-1])]
        print(f"failover (kill -9 of a primary → PUBACK of the next publish through its gateway), {len(times)} runs: "
              f"median {ms[0]}, p90 {ms[1]}, min {ms[2]}, max {ms[3]}")  # fmt: skip
        without, replicated = throughput(Path(tmp), args.count, 3)
        ratio = statistics.median(replicated) / statistics.median(without)
        print(f"durable, no backup      {statistics.median(without):,.0f} msgs/s (min {min(without):,.0f}, "
              f"max {max(without):,.0f})")  # fmt: skip
        print(f"durable, in-sync backup {statistics.median(replicated):,.0f} msgs/s (min {min(replicated):,.0f}, "
              f"max {max(replicated):,.0f}) = {ratio:.0%} of no backup")  # fmt: skip


if __name__ == "__main__":
    main()
