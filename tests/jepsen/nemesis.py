"""Fault injection against real processes: kill -9, SIGSTOP/SIGCONT, and network partitions.

:class:`NetLab` (root only) builds an isolated network out of Linux network namespaces: a bridge in a namespace
of its own and one namespace per node, each joined to the bridge by a veth pair and given an address on a
private /24. Nothing is added to the namespace the tests run in, so the lab cannot disturb the machine's own
network, and parallel labs never collide (every name carries a random id and starts with ``tmqlab-``).

Faults are nftables drop rules on the *receiving* side (the input hook of the destination namespace), so a
sender sees silence (timeouts), as on a real network, rather than an immediate local error. ``tc netem`` does
not exist on every kernel; packet loss is a ``numgen random`` rule instead. Every change rewrites the whole
rule set of the namespaces concerned in one nftables transaction. A slow link is a token bucket (``tc``'s
``tbf``) on the sending node's interface (:meth:`NetLab.limit_rate`).

Note on one-way partitions and TCP: ``partition_oneway(src, dst)`` drops every packet from src to dst. A TCP
connection needs packets both ways (the handshake's SYN-ACK and every ACK), so TCP between the two breaks in
*both* directions of connection set-up; only datagrams (UDP) from dst to src still arrive. Asymmetric
partitions matter for protocols whose heartbeats or votes travel over their own connections in each direction.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

PREFIX = "tmqlab-"
SBIN_DIRS = ("/usr/sbin", "/sbin")
TABLE = "tmqlab"  # the nftables table a lab owns inside each node namespace
COMMAND_TIMEOUT = 15.0  # seconds for one ip/nft invocation
_NODE_NAME = re.compile(r"[a-z0-9][a-z0-9_]{0,15}")


# ----------------------------------------------------------------------------------------------- processes


def kill9(pid: int) -> bool:
    """SIGKILL ``pid``; False when no such process exists any more."""
    return _signal(pid, signal.SIGKILL)


def pause(pid: int) -> bool:
    """SIGSTOP ``pid`` (it keeps its sockets but answers nothing); False when no such process exists."""
    return _signal(pid, signal.SIGSTOP)


def resume(pid: int) -> bool:
    """SIGCONT ``pid``; False when no such process exists."""
    return _signal(pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """Keep ``pid`` stopped for the duration of the block; it is resumed however the block ends."""
    pause(pid)
    try:
        yield
    finally:
        resume(pid)


def stop(process: subprocess.Popen[Any], timeout: float = 5.0) -> int:
    """Stop a child by its PID: SIGCONT (a paused one could not act on SIGTERM), SIGTERM, then SIGKILL after
    ``timeout`` seconds; returns its exit status."""
    if process.poll() is None:
        resume(process.pid)
        _signal(process.pid, signal.SIGTERM)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill9(process.pid)
    return process.wait()


def _signal(pid: int, signum: signal.Signals) -> bool:
    if pid <= 0:
        raise ValueError(f"refusing to signal pid {pid} (a process group or every process)")
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


# ----------------------------------------------------------------------------------------------- network


def tool_path() -> str:
    """The PATH used to find ``ip`` and ``nft``: the current one with the sbin directories added."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join([*parts, *(d for d in SBIN_DIRS if d not in parts)])


@dataclass(frozen=True)
class Availability:
    """Whether :class:`NetLab` can run here; falsy with a ``reason`` when not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class NetLabError(RuntimeError):
    """An ``ip`` or ``nft`` command failed."""


class NetLab:
    """An isolated network of namespaces; see the module docstring.

    ``nodes`` is a count (nodes named ``n0``, ``n1``, ...) or a list of short names (lower-case letters,
    digits, ``_``). Every method takes node names. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, nodes: int | Sequence[str] = 2, *, faults: bool = True) -> None:
        names = [f"n{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        if len(names) < 1 or len(names) > 250:
            raise ValueError(f"a lab has 1 to 250 nodes, not {len(names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique: {names}")
        for name in names:
            if not _NODE_NAME.fullmatch(name):
                raise ValueError(f"bad node name {name!r}: 1-16 of a-z, 0-9, _ (starting with a letter or digit)")
        self.id = _lab_id()
        self.nodes: tuple[str, ...] = tuple(names)
        subnet = ipaddress.IPv4Network(f"10.213.{secrets.randbelow(256)}.0/24")
        self.subnet = subnet
        self._addresses = {name: str(subnet.network_address + i + 1) for i, name in enumerate(names)}
        self.bridge_netns = f"{PREFIX}{self.id}-br"
        self._netns = {name: f"{PREFIX}{self.id}-{name}" for name in names}
        self._created: list[str] = []  # namespaces this lab made, in order: close() deletes exactly these
        self._processes: list[subprocess.Popen[Any]] = []
        self._blocked: set[tuple[str, str]] = set()  # (src, dst): every packet from src to dst is dropped
        self._loss: dict[tuple[str, str], int] = {}  # (src, dst): percent of packets dropped
        self._closed = False
        self._env = {**os.environ, "PATH": tool_path()}
        self._ip = _require("ip")
        self._nft = _require("nft") if faults else ""  # without faults, a lab needs no nftables
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------- set-up

    @staticmethod
    def available(*, faults: bool = True) -> Availability:
        """Whether labs can be built here: root, ``ip`` (and ``nft`` for ``faults``) present, and a namespace
        with a bridge, a veth pair (and an nftables table) can really be made (probed once, then cached)."""
        return _probe(faults)

    def _build(self) -> None:
        self._add_netns(self.bridge_netns)
        self._cmd(self._ip, "-n", self.bridge_netns, "link", "set", "lo", "up")
        self._cmd(self._ip, "-n", self.bridge_netns, "link", "add", "br0", "type", "bridge")
        self._cmd(self._ip, "-n", self.bridge_netns, "link", "set", "br0", "up")
        for index, node in enumerate(self.nodes):
            netns = self._netns[node]
            port = f"p{index}"
            self._add_netns(netns)
            self._cmd(self._ip, "-n", netns, "link", "set", "lo", "up")
            self._cmd(
                self._ip,
                "-n",
                self.bridge_netns,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                netns,
            )
            self._cmd(self._ip, "-n", self.bridge_netns, "link", "set", port, "master", "br0")
            self._cmd(self._ip, "-n", self.bridge_netns, "link", "set", port, "up")
            prefix = f"{self._addresses[node]}/{self.subnet.prefixlen}"
            self._cmd(self._ip, "-n", netns, "addr", "add", prefix, "dev", "eth0")
            self._cmd(self._ip, "-n", netns, "link", "set", "eth0", "up")

    def _add_netns(self, name: str) -> None:
        self._cmd(self._ip, "netns", "add", name)  # fails if the name exists: never adopt a foreign namespace
        self._created.append(name)

    # ------------------------------------------------------------------------------------------- queries

    def address(self, node: str) -> str:
        """The IPv4 address of ``node`` on the lab's subnet."""
        return self._addresses[self._node(node)]

    def netns(self, node: str) -> str:
        """The name of ``node``'s network namespace (for ``ip netns exec`` or ``nsenter``)."""
        return self._netns[self._node(node)]

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace this lab created and has not deleted yet."""
        return tuple(self._created)

    def ruleset(self, node: str) -> str:
        """The nftables rule set inside ``node``'s namespace, as ``nft list ruleset`` prints it."""
        return self._cmd(self._ip, "netns", "exec", self.netns(node), self._nft, "list", "ruleset")

    # ------------------------------------------------------------------------------------------- processes

    def run(self, node: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node``'s namespace (``ip netns exec`` execs it: the PID is the program's).

        Keyword arguments go to :class:`subprocess.Popen`. The caller stops the process; :meth:`close` kills
        whatever is still running as a last resort.
        """
        if self._closed:
            raise RuntimeError("the lab is closed")
        argv = [self._ip, "netns", "exec", self.netns(node), *argv]
        process: subprocess.Popen[Any] = subprocess.Popen(argv, **popen_kwargs)
        self._processes.append(process)
        return process

    # ------------------------------------------------------------------------------------------- faults

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between ``a`` and ``b``, both ways."""
        self._block([(a, b), (b, a)])

    def partition_oneway(self, src: str, dst: str) -> None:
        """Drop every packet from ``src`` to ``dst``; ``dst`` to ``src`` still flows (see the module note on TCP)."""
        self._block([(src, dst)])

    def isolate(self, node: str) -> None:
        """Cut ``node`` off from every other node, both ways."""
        node = self._node(node)
        self._block([pair for other in self.nodes if other != node for pair in ((node, other), (other, node))])

    def split(self, *groups: Iterable[str]) -> None:
        """Partition the nodes into ``groups``: nodes of different groups cannot reach each other. A node in
        no group keeps its links (use :meth:`isolate` for it)."""
        members = [[self._node(node) for node in group] for group in groups]
        seen = [node for group in members for node in group]
        if len(set(seen)) != len(seen):
            raise ValueError(f"a node appears in more than one group: {members}")
        crossing = [
            (a, b) for i, group in enumerate(members) for other in members[i + 1 :] for a in group for b in other
        ]
        self._block([*crossing, *((b, a) for a, b in crossing)])

    def loss(self, a: str, b: str, percent: int) -> None:
        """Drop a random ``percent`` of the packets between ``a`` and ``b``, both ways (0 removes the loss;
        a full partition of the pair, if any, stays)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss is a percentage, not {percent}")
        a, b = self._node(a), self._node(b)
        if a == b:
            raise ValueError("a node cannot lose packets to itself")
        for pair in ((a, b), (b, a)):
            if percent:
                self._loss[pair] = percent
            else:
                self._loss.pop(pair, None)
        self._apply({a, b})

    def limit_rate(self, node: str, rate: str) -> None:
        """Shape what ``node`` sends to ``rate`` (``tc``'s token bucket on its interface, "2mbit" say): a slow
        link. It stays until the lab closes."""
        tc = _require("tc")
        argv = ["qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        self._cmd(self._ip, "netns", "exec", self.netns(node), tc, *argv)

    def heal(self) -> None:
        """Remove every fault: all partitions and all loss."""
        touched = {dst for _, dst in self._blocked} | {dst for _, dst in self._loss}
        self._blocked.clear()
        self._loss.clear()
        self._apply(touched)

    def _block(self, pairs: Iterable[tuple[str, str]]) -> None:
        checked = [(self._node(src), self._node(dst)) for src, dst in pairs]
        if any(src == dst for src, dst in checked):
            raise ValueError("a node cannot be partitioned from itself")
        self._blocked.update(checked)
        self._apply(dst for _, dst in checked)

    def _apply(self, nodes: Iterable[str]) -> None:
        """Rewrite the lab's table in each of ``nodes`` from the wanted state, in one transaction per node."""
        if self._closed:
            raise RuntimeError("the lab is closed")
        if not self._nft:
            raise RuntimeError("this lab was built without faults (faults=False)")
        for node in sorted(set(nodes)):
            rules = [f"ip saddr {self._addresses[src]} drop" for src, dst in sorted(self._blocked) if dst == node]
            rules += [
                f"ip saddr {self._addresses[src]} numgen random mod 100 < {percent} drop"
                if percent < 100
                else f"ip saddr {self._addresses[src]} drop"  # numgen ... mod 100 yields 0-99: 100 is every packet
                for (src, dst), percent in sorted(self._loss.items())
                if dst == node and (src, dst) not in self._blocked
            ]
            script = [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}"]  # creates, then drops it: idempotent
            if rules:
                body = "".join(f"    {rule}\n" for rule in rules)
                script.append(
                    f"table inet {TABLE} {{\n  chain input {{\n"
                    f"    type filter hook input priority -10; policy accept;\n{body}  }}\n}}"
                )
            self._cmd(self._ip, "netns", "exec", self._netns[node], self._nft, "-f", "-", stdin="\n".join(script))

    # ------------------------------------------------------------------------------------------- tear-down

    def close(self) -> None:
        """Kill what :meth:`run` started and is still running, then delete every namespace this lab created
        (which removes their veths and the bridge). Safe to call twice; tries everything before raising."""
        self._closed = True
        for process in self._processes:
            if process.poll() is None:
                kill9(process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self._processes.clear()
        errors: list[str] = []
        for name in list(reversed(self._created)):
            try:
                self._cmd(self._ip, "netns", "delete", name)
            except NetLabError as error:
                errors.append(str(error))
            else:
                self._created.remove(name)
        if errors:
            raise NetLabError("; ".join(errors))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- helpers

    def _node(self, node: str) -> str:
        if node not in self._netns:
            raise KeyError(f"no node {node!r} in this lab (nodes: {', '.join(self.nodes)})")
        return node

    def _cmd(self, *argv: str, stdin: str | None = None) -> str:
        return _run(argv, self._env, stdin)


def _lab_id() -> str:
    return secrets.token_hex(4)


def _require(tool: str) -> str:
    found = shutil.which(tool, path=tool_path())
    if found is None:
        raise NetLabError(f"{tool!r} not found in PATH or {', '.join(SBIN_DIRS)}")
    return found


def _run(argv: Sequence[str], env: dict[str, str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise NetLabError(f"{' '.join(argv)}: no answer within {COMMAND_TIMEOUT} s") from error
    if done.returncode != 0:
        raise NetLabError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@functools.cache
def _probe(faults: bool) -> Availability:
    if os.geteuid() != 0:
        return Availability(ok=False, reason="network namespaces need root")
    for tool in ("ip", "nft") if faults else ("ip",):
        if shutil.which(tool, path=tool_path()) is None:
            package = {"ip": "iproute2", "nft": "nftables"}[tool]
            return Availability(ok=False, reason=f"{tool!r} is missing (Debian package {package})")
    env = {**os.environ, "PATH": tool_path()}
    ip = _require("ip")
    netns = f"{PREFIX}probe-{_lab_id()}"
    try:
        _run([ip, "netns", "add", netns], env)
    except NetLabError as error:
        return Availability(ok=False, reason=f"cannot create a network namespace: {error}")
    try:
        _run([ip, "-n", netns, "link", "add", "br0", "type", "bridge"], env)
        _run([ip, "-n", netns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], env)
        if faults:
            _run([ip, "netns", "exec", netns, _require("nft"), "add", "table", "inet", TABLE], env)
    except NetLabError as error:
        return Availability(ok=False, reason=f"bridges, veths or nftables do not work in a namespace: {error}")
    finally:
        with contextlib.suppress(NetLabError):
            _run([ip, "netns", "delete", netns], env)
    return Availability(ok=True)
