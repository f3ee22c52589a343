"""The network nemesis on real namespaces: partitions, one-way partitions, loss, isolation, clean-up.

Each node runs one small agent process (started with ``lab.run``): it serves a TCP echo and a UDP sink, and
on commands from its stdin probes another node. The test talks to the agents through their pipes, so it
never needs a route into the lab from the namespace it runs in.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from tests.jepsen import nemesis
from tests.jepsen.nemesis import NetLab, kill9

AVAILABLE = NetLab.available()
pytestmark = [pytest.mark.fault, pytest.mark.skipif(not AVAILABLE, reason=f"no network lab: {AVAILABLE.reason}")]

TCP_PORT = 7000
UDP_PORT = 7001
BLOCKED_WAIT = 0.5  # seconds a probe waits before calling a path blocked
AGENT = f"""
import socket, sys, threading
seen = set()
def echo(conn):
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
def tcp_server(server):
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
def udp_sink(sink):
    while True:
        data, _ = sink.recvfrom(4096)
        seen.add(data.decode())
server = socket.create_server(("0.0.0.0", {TCP_PORT}))
sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sink.bind(("0.0.0.0", {UDP_PORT}))
threading.Thread(target=tcp_server, args=(server,), daemon=True).start()
threading.Thread(target=udp_sink, args=(sink,), daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "tcp":
        try:
            with socket.create_connection((args[0], {TCP_PORT}), timeout=float(args[1])) as conn:
                conn.sendall(b"ping")
                answer = conn.recv(4) == b"ping"
        except OSError:
            answer = False
        print("yes" if answer else "no", flush=True)
    elif command == "udp":
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
            out.sendto(args[1].encode(), (args[0], {UDP_PORT}))
        print("sent", flush=True)
    elif command == "seen":
        print("yes" if args[0] in seen else "no", flush=True)
"""


class Agent:
    def __init__(self, lab: NetLab, node: str) -> None:
        self.lab = lab
        self.node = node
        self.process = lab.run(
            node, [sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self._read() == "ready"

    def _read(self) -> str:
        assert self.process.stdout is not None
        line: str = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the agent on {self.node} exited with {self.process.wait()}")
        return line.strip()

    def _ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def tcp(self, target: str, timeout: float = BLOCKED_WAIT) -> bool:
        """Whether a TCP connection to ``target``'s echo server completes and echoes within ``timeout``."""
        return self._ask(f"tcp {self.lab.address(target)} {timeout}") == "yes"

    def udp(self, target: str) -> str:
        """Send one datagram to ``target``'s sink; returns its token for :meth:`seen`."""
        token = secrets.token_hex(8)
        assert self._ask(f"udp {self.lab.address(target)} {token}") == "sent"
        return token

    def seen(self, token: str, wait: float = BLOCKED_WAIT) -> bool:
        """Whether this node's sink received ``token`` within ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            if self._ask(f"seen {token}") == "yes":
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            kill9(self.process.pid)
        self.process.wait(timeout=5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def udp_arrives(sender: Agent, receiver: Agent) -> bool:
    return receiver.seen(sender.udp(receiver.node))


def lab_netns() -> set[str]:
    listing = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True, env={"PATH": nemesis.tool_path()}
    ).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


@pytest.fixture
def agents() -> Iterator[dict[str, Agent]]:
    started: dict[str, Agent] = {}
    with NetLab(["a", "b", "c"]) as lab:
        try:
            for node in lab.nodes:
                started[node] = Agent(lab, node)
            yield started
        finally:
            for agent in started.values():
                agent.stop()


def test_connectivity_partition_and_heal(agents: dict[str, Agent]) -> None:
    a, b, c = agents["a"], agents["b"], agents["c"]
    lab = a.lab
    assert lab.address("a") != lab.address("b")
    assert b.tcp("a", timeout=5)
    assert a.tcp("b", timeout=5)
    lab.partition("a", "b")
    assert not b.tcp("a")
    assert not a.tcp("b")
    assert not udp_arrives(b, a)
    assert c.tcp("a", timeout=5)  # only the a-b link is cut
    assert c.tcp("b", timeout=5)
    lab.heal()
    assert b.tcp("a", timeout=5)
    assert a.tcp("b", timeout=5)
    assert "drop" not in lab.ruleset("a")


def test_partition_oneway(agents: dict[str, Agent]) -> None:
    """a->b dropped, b->a flowing: datagrams show the asymmetry; TCP, needing both ways, fails both ways."""
    a, b = agents["a"], agents["b"]
    lab = a.lab
    lab.partition_oneway("a", "b")
    assert udp_arrives(b, a)
    assert not udp_arrives(a, b)
    assert not a.tcp("b")  # the SYN is dropped
    assert not b.tcp("a")  # the SYN arrives, the SYN-ACK is dropped
    lab.heal()
    assert udp_arrives(a, b)
    assert a.tcp("b", timeout=5)


def test_loss(agents: dict[str, Agent]) -> None:
    a, b = agents["a"], agents["b"]
    lab = a.lab
    lab.loss("a", "b", 100)
    assert f"ip saddr {lab.address('a')} drop" in lab.ruleset("b")
    assert not a.tcp("b")
    assert not udp_arrives(b, a)
    lab.loss("a", "b", 0)
    assert "drop" not in lab.ruleset("a")
    assert "drop" not in lab.ruleset("b")
    assert a.tcp("b", timeout=5)
    lab.loss("a", "b", 100)
    lab.heal()
    assert b.tcp("a", timeout=5)


def test_partial_loss_drops_some(agents: dict[str, Agent]) -> None:
    a, b = agents["a"], agents["b"]
    lab = a.lab
    lab.loss("a", "b", 50)
    assert f"ip saddr {lab.address('a')} numgen random mod 100 < 50 drop" in lab.ruleset("b")
    tokens = [a.udp("b") for _ in range(60)]
    time.sleep(0.2)
    arrived = sum(b.seen(token, wait=0) for token in tokens)
    assert 5 < arrived < 55  # binomial(60, 0.5): outside this range with probability ~1e-11


def test_isolate_and_split(agents: dict[str, Agent]) -> None:
    a, b, c = agents["a"], agents["b"], agents["c"]
    lab = a.lab
    lab.isolate("a")
    assert not b.tcp("a")
    assert not a.tcp("c")
    assert b.tcp("c", timeout=5)
    lab.heal()
    assert b.tcp("a", timeout=5)
    lab.split(["a"], ["b", "c"])
    assert not c.tcp("a")
    assert b.tcp("c", timeout=5)
    lab.heal()
    assert c.tcp("a", timeout=5)


def test_close_leaves_nothing_behind() -> None:
    lab = NetLab(2)
    process = lab.run("n0", ["sleep", "60"])
    try:
        created = set(lab.namespaces)
        assert created == {lab.bridge_netns, lab.netns("n0"), lab.netns("n1")}
        assert all(name.startswith("tmqlab-") for name in created)
        assert created <= lab_netns()
    finally:
        lab.close()  # kills the sleep too: a process would keep its namespace alive after its name is gone
        if process.poll() is None:
            kill9(process.pid)
        process.wait(timeout=5)
    assert process.returncode == -9
    assert not created & lab_netns()
    assert lab.namespaces == ()
    lab.close()  # twice is harmless


def test_failed_build_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    lab_id = f"t{secrets.token_hex(3)}"
    monkeypatch.setattr(nemesis, "_lab_id", lambda: lab_id)
    with pytest.raises(ValueError, match="bad node name"):
        NetLab(["a", "B"])  # refused before anything is made
    monkeypatch.setattr(NetLab, "_add_netns", _fail_on_second_node(NetLab._add_netns))
    with pytest.raises(nemesis.NetLabError, match="injected"):
        NetLab(["a", "b"])
    assert not {name for name in lab_netns() if lab_id in name}


def _fail_on_second_node(add_netns: Callable[[NetLab, str], None]) -> Callable[[NetLab, str], None]:
    def add(lab: NetLab, name: str) -> None:
        if name.endswith("-b"):
            raise nemesis.NetLabError("injected")
        add_netns(lab, name)

    return add


def test_process_signals(agents: dict[str, Agent]) -> None:
    """pause() stops a node answering without closing its sockets; resume() brings it back."""
    a, b = agents["a"], agents["b"]
    with nemesis.paused(a.process.pid):
        assert not b.tcp("a")  # the kernel completes the handshake, but nobody echoes
    assert b.tcp("a", timeout=5)
    assert kill9(a.process.pid)
    assert a.process.wait(timeout=5) == -9
    assert not b.tcp("a")  # nothing listens any more: refused at once


def test_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = nemesis._probe.__wrapped__  # the uncached probe
    assert probe(faults=True)
    monkeypatch.setattr(shutil, "which", lambda tool, path=None: None if tool == "nft" else "/bin/true")
    missing = probe(faults=True)
    assert not missing
    assert "nftables" in missing.reason
    assert probe(faults=False)  # a lab without faults needs no nftables
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert probe(faults=True) == nemesis.Availability(ok=False, reason="network namespaces need root")
