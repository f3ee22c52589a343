"""``tridentmq up``: run a core node and every installed gateway as supervised child processes.

Children's output is prefixed with their name; a child that dies is restarted with backoff, unless its first
run ends saying it cannot start (a port in use, a data directory another process holds): then ``up`` stops
everything and fails, rather than retry for ever beside the ``up`` that is already running. Ctrl-C (or
SIGTERM) stops them all, politely first (SIGTERM), then firmly after a grace period: the gateways first, so
that their clients' sessions end while the core still serves them, then the backups, then the nodes they back
up (a primary stopped before its backup would hand its pair over to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
import secrets
import signal
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tridentmq_shared.supervision import EXIT_CANNOT_START

GATEWAYS = ("stomp", "mqtt", "amqp")
GRACE_SECONDS = 10.0
MAX_BACKOFF = 30.0
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
#: A child's output is read in chunks of this size; a line longer than that is printed in pieces.
_CHUNK = 64 * 1024


#: The order in which ``up`` stops its children (see the module docstring).
STOP_GATEWAYS, STOP_BACKUPS, STOP_NODES = 0, 1, 2


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: asyncio.subprocess.Process | None = None
    stop_stage: int = STOP_NODES
    cannot_start: bool = False  # its first run ended with ``EXIT_CANNOT_START``


def installed_services() -> list[tuple[str, str]]:
    """(name, module) of every service whose entry point is installed: the core and the gateways."""
    services = [("core", "tridentmq_core")]
    for gateway in GATEWAYS:
        module = f"tridentmq_{gateway}"
        if importlib.util.find_spec(module) is not None and importlib.util.find_spec(f"{module}.__main__"):
            services.append((f"gateway-{gateway}", module))
    return services


def plan(
    data_dir: Path,
    config: Path | None,
    config_dir: Path | None = None,
    *,
    nodes: int = 1,
    discovery: str = "",
    pairs: int = 0,
) -> list[Child]:
    """The children of ``up``: ``config`` is the core's settings file; ``config_dir`` may hold one file per
    process, named after it (``core.toml``, ``stomp.toml``, ``mqtt.toml``, ``amqp.toml``).

    With ``nodes`` above 1 the core nodes form a local cluster: node *i* listens on link port 61616 + *i* and
    management port 8161 + *i*, knows the others as static connectors (or finds them through ``discovery``),
    and the gateways are spread over the nodes. With ``pairs`` the cluster is made of that many replication
    pairs: primary *i* is node *i*, its backup node ``pairs`` + *i*. The cluster password is made up on first
    use and kept in the data directory, since cluster credentials have no default."""
    cores = _pairs(data_dir, pairs, discovery) if pairs else _cluster(data_dir, nodes, discovery) if nodes > 1 else []
    actives = [env for _, env in cores if env.get("TRIDENTMQ_CORE_HA_ROLE") != "backup"]
    children = []
    gateways = 0
    for name, module in installed_services():
        argv = [sys.executable, "-m", module]
        own = _own_file(config_dir, name)
        if name == "core" and config is not None:
            argv += ["--config", str(config)]
        elif own is not None:
            argv += ["--config", str(own)]
        if name != "core":
            env = {}
            if not cores:  # the gateways dial the core started here, wherever its settings put it
                kind = name.removeprefix("gateway-").upper()
                core_file = config if config is not None else _own_file(config_dir, "core")
                env[f"TRIDENTMQ_{kind}_CORE_HOST"], env[f"TRIDENTMQ_{kind}_CORE_PORT"] = _core_link(core_file)
            if actives:
                kind = name.removeprefix("gateway-").upper()
                env[f"TRIDENTMQ_{kind}_CORE_PORT"] = actives[gateways % len(actives)]["TRIDENTMQ_CORE_LINK_PORT"]
                env[f"TRIDENTMQ_{kind}_CORE_CONNECTORS"] = ",".join(
                    f"127.0.0.1:{e['TRIDENTMQ_CORE_LINK_PORT']}" for _, e in cores
                )
            gateways += 1
            children.append(Child(name, argv, env, stop_stage=STOP_GATEWAYS))
        elif not cores:
            children.append(Child(name, argv, {"TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir / "core")}))
        else:
            children += [
                Child(
                    child,
                    argv,
                    env,
                    stop_stage=STOP_BACKUPS if env.get("TRIDENTMQ_CORE_HA_ROLE") == "backup" else STOP_NODES,
                )
                for child, env in cores
            ]
    return children


_DATA_DIR = "TRIDENTMQ_CORE_NODE_DATA_DIR"


def unused_node_data(data_dir: Path, children: list[Child]) -> list[Path]:
    """The node data directories under ``data_dir`` that no child of this plan uses: made by ``up`` with
    another topology (``core`` of a single node, ``core-N`` of a cluster, ``backup-N`` of pairs). Their
    messages, sessions and retained messages stay there, out of reach, while this plan starts afresh."""
    used = {Path(child.env[_DATA_DIR]) for child in children if _DATA_DIR in child.env}
    if not data_dir.is_dir():
        return []
    return sorted(path for path in data_dir.iterdir() if (path / "node.id").is_file() and path not in used)


def _own_file(config_dir: Path | None, name: str) -> Path | None:
    """``name``'s settings file in ``config_dir`` (``core.toml``, ``stomp.toml``, ...), when there is one."""
    if config_dir is None:
        return None
    own = config_dir / f"{name.removeprefix('gateway-')}.toml"
    return own if own.exists() else None


BASE_LINK_PORT = 61616
BASE_MANAGEMENT_PORT = 8161
_ANY_ADDRESS = ("", "0.0.0.0", "::")  # a listener on every address is reached on loopback


def _core_link(config: Path | None) -> tuple[str, str]:
    """(host, port) of the single core's link listener, as the core reads its settings: the environment
    over the ``[link]`` table of its file over the defaults."""
    link: dict[str, object] = {}
    if config is not None and config.exists():
        with config.open("rb") as file:
            table = tomllib.load(file).get("link", {})
        link = table if isinstance(table, dict) else {}
    host = os.environ.get("TRIDENTMQ_CORE_LINK_HOST", str(link.get("host", "127.0.0.1")))
    port = os.environ.get("TRIDENTMQ_CORE_LINK_PORT", str(link.get("port", BASE_LINK_PORT)))
    return ("127.0.0.1" if host in _ANY_ADDRESS else host), port


def _cluster(data_dir: Path, nodes: int, discovery: str) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of each node of a local cluster."""
    data_dir.mkdir(parents=True, exist_ok=True)
    secret = data_dir / "cluster.password"
    if not secret.exists():  # made readable by its owner only from the start, not chmod-ed after the write
        descriptor = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_urlsafe(24))
    password = secret.read_text().strip()
    cores = []
    for i in range(nodes):
        others = [f"127.0.0.1:{BASE_LINK_PORT + j}" for j in range(nodes) if j != i]
        cores.append(
            (
                f"core-{i}",
                {
                    "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir / f"core-{i}"),
                    "TRIDENTMQ_CORE_NODE_NAME": f"core-{i}",
                    "TRIDENTMQ_CORE_LINK_PORT": str(BASE_LINK_PORT + i),
                    "TRIDENTMQ_CORE_MANAGEMENT_PORT": str(BASE_MANAGEMENT_PORT + i),
                    "TRIDENTMQ_CORE_CLUSTER_USER": "cluster",
                    "TRIDENTMQ_CORE_CLUSTER_PASSWORD": password,
                    "TRIDENTMQ_CORE_CLUSTER_CONNECTORS": "" if discovery else ",".join(others),
                    "TRIDENTMQ_CORE_CLUSTER_DISCOVERY": discovery,
                },
            )
        )
    return cores


def _pairs(data_dir: Path, pairs: int, discovery: str) -> list[tuple[str, dict[str, str]]]:
    """A local cluster of ``pairs`` replication pairs: the first half of the nodes are primaries, each with
    its backup in the second half (a backup finds its primary among the connectors by the group name)."""
    cores = _cluster(data_dir, 2 * pairs, discovery)
    named = []
    for i, (_, env) in enumerate(cores):
        pair, backup = i % pairs, i >= pairs
        name = f"backup-{pair}" if backup else f"core-{pair}"
        env.update(
            {
                "TRIDENTMQ_CORE_NODE_NAME": name,
                "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir / name),
                "TRIDENTMQ_CORE_HA_POLICY": "replication",
                "TRIDENTMQ_CORE_HA_GROUP_NAME": f"pair-{pair}",
                "TRIDENTMQ_CORE_HA_ROLE": "backup" if backup else "primary",
            }
        )
        named.append((name, env))
    return named


async def _pump(name: str, stream: asyncio.StreamReader) -> None:
    """Print a child's output, each line prefixed with its name, until the child closes it. It never stops
    reading before that: a child whose output nobody reads blocks on its next log line, and its exit is not
    seen. So a line longer than a chunk is printed in pieces, a last line without its newline gets one, and
    once our own output fails (a closed pipe) the rest is read and dropped."""
    prefix = f"{name:<15}| ".encode()
    tail = b""
    printing = True
    while chunk := await stream.read(_CHUNK):
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        if len(tail) >= _CHUNK:
            lines.append(tail)
            tail = b""
        if printing and lines:
            printing = _print(b"".join(prefix + line + b"\n" for line in lines))
    if printing and tail:
        _print(prefix + tail + b"\n")


def _print(data: bytes) -> bool:
    """Write to our standard output; False once that fails for good."""
    out = sys.stdout
    try:
        buffer = getattr(out, "buffer", None)  # the bytes as they came (a test's capture may have no buffer)
        if buffer is not None:
            out.flush()
            buffer.write(data)
        else:
            out.write(data.decode(errors="replace"))
        out.flush()
    except (OSError, ValueError):  # a closed pipe or file (ValueError: stdout itself closed)
        return False
    return True


async def _run_child(child: Child, stopping: asyncio.Event) -> None:
    backoff = 1.0  # the wait before the next restart: 1 s, then twice as long each time, 1 s again after a long run
    first_run = True
    while not stopping.is_set():
        started = time.monotonic()
        child.process = await asyncio.create_subprocess_exec(
            *child.argv,
            env={**os.environ, **child.env},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
        )
        assert child.process.stdout is not None
        pump = asyncio.create_task(_pump(child.name, child.process.stdout))
        code = await child.process.wait()
        await pump
        if stopping.is_set():
            return
        if first_run and code == EXIT_CANNOT_START and time.monotonic() - started < MAX_BACKOFF:
            # A port in use, a held data directory, bad settings, found at start: a restart would only loop.
            child.cannot_start = True
            print(f"tridentmq up: {child.name} cannot start (see above); stopping", file=sys.stderr, flush=True)
            stopping.set()
            return
        first_run = False
        if time.monotonic() - started > MAX_BACKOFF:
            backoff = 1.0
        print(f"{child.name} exited with {code}; restarting in {backoff:.0f} s", file=sys.stderr, flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), backoff)
        backoff = min(backoff * 2, MAX_BACKOFF)


def _stop_with_parent() -> None:
    """In the child, before it runs: SIGTERM when ``up`` dies. The children run in sessions of their own (a
    Ctrl-C reaches ``up`` alone, which stops them in order), so a SIGKILL of ``up`` left them running, holding
    the ports and data directories the next ``up`` needs, their output going nowhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_signals() -> tuple[signal.Signals, ...]:
    """What stops ``up``: Ctrl-C, a polite kill, and the terminal going away (the children run in sessions of
    their own, so they would outlive a closed terminal, holding the ports and data the next ``up`` needs), unless
    ``up`` was started to ignore that (``nohup``)."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)


async def supervise(children: list[Child]) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop_signals = _stop_signals()
    for sig in stop_signals:
        loop.add_signal_handler(sig, stopping.set)

    def kill_all() -> None:
        for child in children:
            if child.process is not None and child.process.returncode is None:
                child.process.kill()

    names = ", ".join(c.name for c in children)
    _print(f"tridentmq up: starting {names} (Ctrl-C stops everything)\n".encode())
    tasks = [asyncio.create_task(_run_child(c, stopping)) for c in children]
    try:
        await stopping.wait()
        for sig in stop_signals:
            loop.add_signal_handler(sig, kill_all)
        _print(b"tridentmq up: stopping (Ctrl-C again kills what is left at once)\n")
        clean = await stop_children(children, tasks)
    finally:
        kill_all()  # whatever ended this (an error of our own): no child outlives it
    return 0 if clean and not any(child.cannot_start for child in children) else 1


async def stop_children(children: list[Child], tasks: list[asyncio.Task[None]], grace_s: float = GRACE_SECONDS) -> bool:
    """Stop ``children`` (their ``_run_child`` tasks, in the same order, end with them) stage by stage: SIGTERM to
    a stage, then SIGKILL to what of it still runs after ``grace_s``, before the next stage is asked. Returns
    whether every child stopped by itself."""
    clean = True
    for stage in sorted({child.stop_stage for child in children}):
        group = [(child, task) for child, task in zip(children, tasks, strict=True) if child.stop_stage == stage]
        for child, _ in group:
            if child.process is not None and child.process.returncode is None:
                child.process.send_signal(signal.SIGTERM)
        await asyncio.wait([task for _, task in group], timeout=grace_s)
        for child, _ in group:
            if child.process is not None and child.process.returncode is None:
                print(f"{child.name} did not stop in {grace_s:.0f} s; killing it", file=sys.stderr, flush=True)
                child.process.kill()
                clean = False
        await asyncio.gather(*(task for _, task in group), return_exceptions=True)
    return clean
