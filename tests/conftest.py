"""Fixtures that start real TridentMQ processes on loopback: a core at a fixed link port (it may start again
there), the other ports assigned by the OS."""

from __future__ import annotations

import base64
import functools
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import settings as hypothesis_settings
from tests.tls_certs import Certificates

# Property tests are not timed: Hypothesis's default deadline (200 ms per example) failed examples that took
# 390 ms on a machine loaded by other work, and passed them when tried again.
hypothesis_settings.register_profile("untimed", deadline=None)
hypothesis_settings.load_profile("untimed")

STARTUP_TIMEOUT = 60.0  # a ceiling, not a wait: a start takes seconds, 20 s and more on a loaded 2-core machine
_started: list[subprocess.Popen[bytes]] = []  # every process a test started: none outlives its test
_shared: list[subprocess.Popen[bytes]] = []  # processes of module fixtures: none outlives the session
_logs: dict[int, Path] = {}  # process id → its log, for the report of a test that fails
LOG_LINES_ON_FAILURE = 40  # of each process the failing test started: what a flaky run leaves to read
#: Below Linux's ephemeral range (32768-60999 by default): no outgoing connection takes such a port as its own.
#: Each pytest-xdist worker picks from a share of its own: a port one test freed is never another worker's next
#: pick, which a node of the first test, still trying it, could reach.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
FIXED_PORTS = range(20000, 32768)[_WORKER::_WORKERS]
EX_CONFIG = 78  # a core's exit when it cannot bind its port (sysexits)


def _kill_all(processes: list[subprocess.Popen[bytes]]) -> None:
    while processes:
        process = processes.pop()
        if process.poll() is None:
            process.kill()
            process.wait()


# The suite runs on several pytest-xdist workers (see pyproject). A test on its own goes to whichever worker is
# free; the tests sharing processes wider than one test (a module's core and gateways, the Spark session of
# tests/spark) are one unit that one worker runs, so that they are started once. (pytest-xdist's own
# ``--dist loadgroup`` renames test ids to find its groups, which the pytest in use ignores: this scheduler
# finds the units from the files instead.)
_TESTS = Path(__file__).parent
_SHARED_BY_MODULE = ('scope="module"', "module_core")


@functools.cache
def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@functools.cache
def _unit_of(path: str) -> str | None:
    """The unit of work of the tests in ``path`` (rootdir-relative), or None when each test is one."""
    module = _TESTS.parent / path
    directory = module.parent
    while directory != _TESTS and _TESTS in directory.parents:
        if 'scope="session"' in _text(directory / "conftest.py"):
            return str(directory.relative_to(_TESTS.parent))
        directory = directory.parent
    shared_here = _text(module) + _text(module.parent / "conftest.py") if module.parent != _TESTS else _text(module)
    return path if any(word in shared_here for word in _SHARED_BY_MODULE) else None


def _unit(nodeid: str) -> str:
    return _unit_of(nodeid.split("::", 1)[0]) or nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 (only the controller of a run schedules)

    class SharedProcessScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return SharedProcessScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Workers collect, and the scheduler hands out, in this order: the shared units first, the one of a
    session fixture (the Spark session: minutes of tests) before those of a module, so that none of them is
    still running alone at the end; single tests then fill the gaps in their collection order (the quick unit
    tests last); the Docker Compose stacks at the very end. A stack starts every process of a deployment at
    once, as `docker compose up` does on a machine of its own: started first, beside three workers' cores and
    the Spark session (load average about 24 on two cores), the HA stack's primaries were cut off from their
    backups while they started, and one pair had no serving copy 240 s later (docs/ha.md, "Not yet")."""
    if hasattr(config, "workerinput"):
        items.sort(key=_schedule_rank)


def _schedule_rank(item: pytest.Item) -> int:
    unit = _unit(item.nodeid)
    if unit.startswith("tests/e2e/"):
        return 3
    if unit == item.nodeid:
        return 2
    return 1 if unit.endswith(".py") else 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report ends with the last lines of the logs of the processes it started (and of the
    module's shared ones): a failure seen once in a loaded run is then not lost with its temporary directory."""
    report = yield
    if getattr(report, "failed", False):
        item.stash[_FAILED] = True
    if call.when == "call" and getattr(report, "failed", False):
        for process in [*_started, *_shared]:
            log = _logs.get(process.pid)
            if log is not None and log.is_file():
                tail = log.read_text(errors="replace").splitlines()[-LOG_LINES_ON_FAILURE:]
                report.sections.append((f"log of {log.parent.name}/{log.name} (pid {process.pid})", "\n".join(tail)))
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A test CA with server and client certificates, for the TLS tests (made once per module)."""
    return Certificates.make(tmp_path_factory.mktemp("certs"))


@pytest.fixture(autouse=True)
def _stop_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failing test may not reach its own clean-up: kill what it left running, and collect what it left
    open (a client's transport, its socket), so that the warnings of their finalizers are reported on it, not
    on whichever test the collector next runs in. (CI 56: a unit test of pure parsing failed with 8 of them
    after two integration tests had failed.)"""
    yield
    _kill_all(_started)
    if request.node.stash.get(_FAILED, False):
        gc.collect()


@pytest.fixture(autouse=True, scope="session")
def _stop_shared_processes() -> Iterator[None]:
    yield
    _kill_all(_shared)


def shared(service: ServiceProcessT) -> ServiceProcessT:
    """``service`` outlives the test that started it: a module fixture stops it (or the session's end kills it)."""
    _started.remove(service.process)
    _shared.append(service.process)
    return service


ServiceProcessT = TypeVar("ServiceProcessT", bound="ServiceProcess")


def shared_by_module(*processes: subprocess.Popen[bytes]) -> None:
    """Processes a module-scoped fixture starts and stops itself: the per-test clean-up leaves them alone."""
    for process in processes:
        _started.remove(process)


@dataclass
class ServiceProcess:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode


def fixed_port() -> int:
    """A free port for a server that may start again at the same address, or after clients try it. One from
    the ephemeral range may be taken meanwhile as the local port of any outgoing connection (the other tests'
    thousands, or a client's own retries, connecting to itself), and the server then cannot bind it ("address
    already in use": a restarted core in CI 56, a gateway's core in CI 61)."""
    for port in random.sample(FIXED_PORTS, 100):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class StartFailed(RuntimeError):
    """A service exited before it wrote its ports."""

    def __init__(self, module: str, returncode: int, log: str) -> None:
        super().__init__(f"{module} exited with {returncode}:\n{log}")
        self.returncode, self.log = returncode, log


def _spawn(
    module: str, ports_file: Path, log_path: Path, args: list[str], environment: dict[str, str]
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """Start ``python -m module`` logging to ``log_path``; wait for the ports it writes to ``ports_file``."""
    ports_file.unlink(missing_ok=True)  # a restart in the same directory must not read the old ports
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", module, "--ports-file", str(ports_file), *args],
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    _started.append(process)
    _logs[process.pid] = log_path
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not ports_file.exists():
        if process.poll() is not None:
            raise StartFailed(module, process.returncode, log_path.read_text())
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{module} did not start in {STARTUP_TIMEOUT} s:\n{log_path.read_text()}")
        time.sleep(0.05)
    return process, json.loads(ports_file.read_text())


def basic_auth(user: str, password: str) -> dict[str, str]:
    """The header that authenticates a management API request as ``user`` (HTTP Basic)."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@dataclass
class CoreProcess(ServiceProcess):
    link_port: int
    management_port: int
    data_dir: Path

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"


def start_core(tmp_path: Path, name: str = "core", config: str | None = None, **env: str) -> CoreProcess:
    data_dir = tmp_path / name
    data_dir.mkdir(parents=True, exist_ok=True)
    args = []
    if config is not None:
        (data_dir / "core.toml").write_text(config)
        args += ["--config", str(data_dir / "core.toml")]
    environment = {
        **os.environ,
        "TRIDENTMQ_CORE_NODE_DATA_DIR": str(data_dir),
        "TRIDENTMQ_CORE_NODE_NAME": name,
        "TRIDENTMQ_CORE_LINK_HOST": "127.0.0.1",
        "TRIDENTMQ_CORE_MANAGEMENT_PORT": "0",
        # Smaller than the 64 MiB default: every segment is pre-allocated, and a run starts hundreds of cores.
        "TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES": str(8 * 1024 * 1024),
        **env,
    }
    log_path = data_dir / "core.log"
    # Tests start a node again at its link port (a restart, a failback): that port is a fixed one, picked
    # here unless the test chose it. Another test's pick may bind it first: then a fresh one.
    picked = "TRIDENTMQ_CORE_LINK_PORT" not in env
    attempts = 5 if picked else 1
    while True:
        if picked:
            environment["TRIDENTMQ_CORE_LINK_PORT"] = str(fixed_port())
        try:
            process, ports = _spawn("tridentmq_core", data_dir / "ports.json", log_path, args, environment)
            break
        except StartFailed as failed:
            attempts -= 1
            if not attempts or failed.returncode != EX_CONFIG or "address already in use" not in failed.log:
                raise
    return CoreProcess(process, log_path, ports["link"], ports["management"], data_dir)


def stop_core_cleanly(node: CoreProcess) -> None:
    code = node.stop()
    assert code == 0, f"core exited with {code}:\n{node.log()}"
    assert "Traceback" not in node.log(), node.log()


@pytest.fixture
def core(tmp_path: Path) -> Iterator[CoreProcess]:
    node = start_core(tmp_path)
    yield node
    stop_core_cleanly(node)


@dataclass
class GatewayProcess(ServiceProcess):
    ports: dict[str, int]
    kind: str = "stomp"

    @property
    def port(self) -> int:
        """The client port (TCP) of its protocol."""
        return self.ports[self.kind]


def start_gateway(
    tmp_path: Path, core: CoreProcess, kind: str = "stomp", name: str | None = None, **env: str
) -> GatewayProcess:
    """A gateway process (``tridentmq_<kind>``) on OS-assigned loopback ports, linked to ``core``."""
    directory = tmp_path / (name or f"gateway-{kind}")
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"TRIDENTMQ_{kind.upper()}"
    environment = {
        **os.environ,
        f"{prefix}_LISTENER_HOST": "127.0.0.1",
        f"{prefix}_LISTENER_PORT": "0",
        f"{prefix}_LISTENER_WEBSOCKET_PORT": "0",
        f"{prefix}_HTTP_PORT": "0",
        f"{prefix}_CORE_PORT": str(core.link_port),
        **env,
    }
    log_path = directory / "gateway.log"
    process, ports = _spawn(f"tridentmq_{kind}", directory / "ports.json", log_path, [], environment)
    return GatewayProcess(process, log_path, ports, kind)


def stop_cleanly(gateway: GatewayProcess) -> None:
    code = gateway.stop()
    assert code == 0, f"gateway exited with {code}:\n{gateway.log()}"
    assert "Traceback" not in gateway.log(), gateway.log()


@pytest.fixture
def stomp_gateway(tmp_path: Path, core: CoreProcess) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path, core)
    yield gateway
    stop_cleanly(gateway)


@pytest.fixture
def mqtt_gateway(tmp_path: Path, core: CoreProcess) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path, core, "mqtt")
    yield gateway
    stop_cleanly(gateway)


@pytest.fixture
def amqp_gateway(tmp_path: Path, core: CoreProcess) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path, core, "amqp")
    yield gateway
    stop_cleanly(gateway)


# Module-wide processes. Starting a core and a gateway costs seconds of CPU each (the interpreter and its
# imports), more than most protocol tests run. A module whose tests keep to their own queues, topics, client
# ids and connections takes these instead, by defining in its own namespace
#
#     core = module_core
#     stomp_gateway = module_stomp_gateway  (and the other kinds it uses)
#
# (imported from here) so that its tests and the fixtures they use all get the same processes; they are
# stopped, and their logs checked for tracebacks, after the module's last test. Tests that stop, kill or
# reconfigure a process start their own (start_core / start_gateway with ``tmp_path``).
@pytest.fixture(scope="module")
def module_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoreProcess]:
    node = shared(start_core(tmp_path_factory.mktemp("module")))
    yield node
    stop_core_cleanly(node)


def _module_gateway(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess, kind: str) -> Iterator[GatewayProcess]:
    gateway = shared(start_gateway(tmp_path_factory.mktemp("module"), core, kind))
    yield gateway
    stop_cleanly(gateway)


@pytest.fixture(scope="module")
def module_stomp_gateway(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess) -> Iterator[GatewayProcess]:
    yield from _module_gateway(tmp_path_factory, core, "stomp")


@pytest.fixture(scope="module")
def module_mqtt_gateway(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess) -> Iterator[GatewayProcess]:
    yield from _module_gateway(tmp_path_factory, core, "mqtt")


@pytest.fixture(scope="module")
def module_amqp_gateway(tmp_path_factory: pytest.TempPathFactory, core: CoreProcess) -> Iterator[GatewayProcess]:
    yield from _module_gateway(tmp_path_factory, core, "amqp")
