"""What the benchmark scripts share: a core process and STOMP or MQTT gateways on free loopback ports, and
the machine's description."""

from __future__ import annotations

import http.client
import json
import os
import platform
import resource
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

from tests.tls_certs import Certificates


@dataclass(frozen=True)
class Core:
    process: subprocess.Popen[bytes]
    link_port: int
    management_port: int

    def get(self, path: str) -> bytes:
        with urlopen(f"http://127.0.0.1:{self.management_port}{path}", timeout=10) as response:
            data: bytes = response.read()
            return data

    def metric(self, name: str) -> float:
        """One unlabelled sample of ``/metrics``."""
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@contextmanager
def _service(
    module: str, what: str, ports: Path, args: list[str], environment: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, int]]]:
    """Run ``python -m module``, wait for the ports it writes to ``ports``, stop it at the end. With
    ``BENCH_PROFILE_DIR`` set, the process runs under cProfile and writes ``<dir>/<module>.prof`` as it stops."""
    ports.unlink(missing_ok=True)
    profile_dir = os.environ.get("BENCH_PROFILE_DIR")
    profiled = ["-m", "cProfile", "-o", str(Path(profile_dir) / f"{module}.prof")] if profile_dir else []
    process = subprocess.Popen(
        [sys.executable, *profiled, "-m", module, "--ports-file", str(ports), *args], env=environment
    )
    try:
        deadline = time.monotonic() + 120
        while not ports.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {what} did not start")
            time.sleep(0.01)
        yield process, json.loads(ports.read_text())
    finally:
        process.terminate()
        process.wait(timeout=60)


@contextmanager
def core_node(data_dir: Path, config: str | None = None, **env: str) -> Iterator[Core]:
    """A core on ``data_dir`` with settings from ``config`` (TOML) and ``TRIDENTMQ_CORE_*`` variables."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = []
    if config is not None:
        (data_dir / "core.toml").write_text(config)
        args += ["--config", str(data_dir / "core.toml")]
    environment = {
        **os.environ,
        "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir),
        "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
        "TRIDENTMQ_CORE_LINK_PORT": "0",
        "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
        "TRIDENTMQ_CORE_NODE_LOG_LEVEL": os.environ.get("TRIDENTMQ_CORE_NODE_LOG_LEVEL", "WARNING"),
        **{f"TRIDENTMQ_CORE_{key.upper()}": value for key, value in env.items()},
    }
    with _service("tridentmq_core", "core", data_dir / "ports.json", args, environment) as (process, bound):
        yield Core(process, bound["link"], bound["management"])


@dataclass(frozen=True)
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    http_port: int
    tls_port: int = -1  # the client listener over TLS (-1: none)


@contextmanager
def _gateway(
    module: str, what: str, prefix: str, port_key: str, core: Core, directory: Path, env: dict[str, str]
) -> Iterator[Gateway]:
    """A gateway linked to ``core``: its client listener (``port_key`` in its ports file) and HTTP on free
    loopback ports, no WebSocket listener; more settings from ``<prefix>_*`` variables."""
    directory.mkdir(parents=True, exist_ok=True)
    environment = {
        **os.environ,
        f"{prefix}_LISTENER_HOST": "127.0.0.1",
        f"{prefix}_LISTENER_PORT": "0",
        f"{prefix}_LISTENER_WEBSOCKET_PORT": "-1",
        f"{prefix}_HTTP_PORT": "0",
        f"{prefix}_CORE_PORT": str(core.link_port),
        f"{prefix}_NODE_LOG_LEVEL": "WARNING",
        **{f"{prefix}_{key.upper()}": value for key, value in env.items()},
    }
    with _service(module, what, directory / "ports.json", [], environment) as (process, bound):
        yield Gateway(process, bound[port_key], bound.get("http", -1), bound.get(f"{port_key}_tls", -1))


@contextmanager
def stomp_gateway(core: Core, directory: Path, **env: str) -> Iterator[Gateway]:
    """A STOMP gateway linked to ``core``: plain TCP and HTTP on free loopback ports, no WebSocket listener;
    more settings from ``TRIDENTMQ_STOMP_*`` variables (``env`` keys without the prefix)."""
    with _gateway("tridentmq_stomp", "STOMP gateway", "TRIDENTMQ_STOMP", "stomp", core, directory, env) as gateway:
        yield gateway


@contextmanager
def mqtt_gateway(core: Core, directory: Path, **env: str) -> Iterator[Gateway]:
    """An MQTT gateway linked to ``core``: plain TCP and HTTP on free loopback ports, no WebSocket listener;
    more settings from ``TRIDENTMQ_MQTT_*`` variables (``env`` keys without the prefix)."""
    with _gateway("tridentmq_mqtt", "MQTT gateway", "TRIDENTMQ_MQTT", "mqtt", core, directory, env) as gateway:
        yield gateway


@contextmanager
def amqp_gateway(core: Core, directory: Path, **env: str) -> Iterator[Gateway]:
    """An AMQP 1.0 gateway linked to ``core``: plain TCP and HTTP on free loopback ports, no WebSocket listener;
    more settings from ``TRIDENTMQ_AMQP_*`` variables (``env`` keys without the prefix)."""
    with _gateway("tridentmq_amqp", "AMQP gateway", "TRIDENTMQ_AMQP", "amqp", core, directory, env) as gateway:
        yield gateway


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, {platform.system()}"


def quantile_ms(sorted_ns: list[int], q: float) -> float:
    """The ``q`` quantile of sorted nanosecond latencies, in ms (NaN when there are none)."""
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e6 if sorted_ns else float("nan")


def broker_cpu_text(server_cpu_s: dict[str, float], delivered: int, elapsed_s: float, broker_us: float) -> str:
    """Broker CPU per delivered message, in all and per process (with the cores each used)."""
    if not server_cpu_s:
        return "broker CPU not watched"
    elapsed = elapsed_s or float("nan")
    parts = [
        f"{name} {used * 1e6 / delivered if delivered else float('nan'):.1f} ({used / elapsed:.2f} cores)"
        for name, used in server_cpu_s.items()
    ]
    return f"broker CPU µs/msg {broker_us:.1f}: {', '.join(parts)}"


def cpu_self() -> float:
    """CPU seconds (user + system) this process has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: Many-client scripts connect from these loopback addresses in turn (127.0.0.2, 127.0.0.3, ...). From one
#: address the kernel looks for a free ephemeral port among those its earlier connections hold: at 19,000 of
#: about 28,000 taken, one connect cost the client process about 190 µs of system time, so that the clients,
#: not the broker, set the pace (Mosquitto measured 2,200-3,500 connects/s that way, 7,600-8,400 after).
CLIENT_SOURCES = 64


def client_source(i: int) -> tuple[str, int]:
    """The local address client number ``i`` connects from (any port)."""
    return f"127.0.0.{2 + i % CLIENT_SOURCES}", 0


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from ``/proc``; 0 where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_usage(pid: int) -> dict[str, int]:
    """A process's resident memory (KiB) and open file descriptors, from ``/proc``."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"rss_kib": rss_kib, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


@contextmanager
def gateway_target(
    protocol: str,
    start: Callable[..., AbstractContextManager[Gateway]],
    host: str,
    port: int | None,
    watched: dict[str, int | None],
    *,
    tls: bool = False,
) -> Iterator[tuple[int, dict[str, int], str]]:
    """The gateway's client port, the server processes to watch and the authority file clients check the
    gateway's certificate with (empty without TLS): a core and gateway of our own (``start`` makes the
    gateway), unless ``port`` names a gateway that is already running (then ``watched``). With ``tls`` every
    connection is TLS: the clients' to the gateway, and the gateway's links to a TLS-only core."""
    if port is not None:
        if tls:
            raise SystemExit("--tls runs a core and gateway of its own: leave out --port")
        print(f"gateway: {host}:{port} (already running)")
        yield port, {name: pid for name, pid in watched.items() if pid is not None}, ""
        return
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"tridentmq-{protocol}-bench-")))
        core_env: dict[str, str] = {}
        gateway_env: dict[str, str] = {}
        ca_file = ""
        if tls:
            certs = Certificates.make(tmp / "certs")
            files = {
                "tls_cert_file": str(certs.server.cert),
                "tls_key_file": str(certs.server.key),
                "tls_ca_file": str(certs.ca),
            }
            core_env = {**files, "link_tls": "true"}
            gateway_env = {**files, "core_tls": "true", "listener_tls_port": "0"}
            ca_file = str(certs.ca)
        core = stack.enter_context(core_node(tmp / "core", **core_env))
        gateway = stack.enter_context(start(core, tmp / "gateway", **gateway_env))
        client_port = gateway.tls_port if tls else gateway.port
        print(
            f"gateway: started on 127.0.0.1:{client_port}{' (TLS)' if tls else ''} with its core on link port "
            f"{core.link_port}{' (TLS)' if tls else ''} (throw-away data directory)"
        )
        yield client_port, {"core": core.process.pid, "gateway": gateway.process.pid}, ca_file


def client_tls(ca_file: str) -> ssl.SSLContext | None:
    """The clients' TLS context (None: plain TCP): checks the gateway's certificate against ``ca_file``."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else None


@dataclass(frozen=True)
class Probed:
    answers: int
    not_ready: int  # answers other than 200: a gateway that had lost its core, say
    p50_ms: float
    max_ms: float


class ReadyProbe:
    """Asks a process's ``/readyz`` every ``every_s`` in a thread of its own, from its start: how long the answers
    take says how long the process's event loop stood still meanwhile."""

    def __init__(self, http_port: int, every_s: float) -> None:
        self._port = http_port
        self._every_s = every_s
        self._times: list[float] = []
        self._not_ready = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)
            try:
                connection.request("GET", "/readyz")
                status = connection.getresponse().status
            except OSError:
                status = 0
            finally:
                connection.close()
            self._times.append(time.monotonic() - began)
            self._not_ready += status != 200
            self._stop.wait(self._every_s)

    def finish(self, seconds: float) -> Probed:
        """Probe until ``seconds`` after the start, then stop."""
        time.sleep(max(0.0, self._started + seconds - time.monotonic()))
        return self.stop()

    def stop(self) -> Probed:
        self._stop.set()
        self._thread.join()
        times = sorted(self._times) or [float("nan")]
        return Probed(len(self._times), self._not_ready, times[len(times) // 2] * 1000, times[-1] * 1000)
