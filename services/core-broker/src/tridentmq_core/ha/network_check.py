"""The network health check: whether this node can still reach the network it serves, or is isolated.

Artemis' ``network-check-list``, with its sharp edges removed. Targets are ``host:port`` (a TCP connect) or
``icmp:host`` (one echo through the ``ping`` binary). A round probes every target at once; the node is
reachable when at least one answered. It counts as isolated only after ``failures_to_isolate`` rounds in a
row with no answer, so one lost packet does not stop a broker, and reachable again after
``successes_to_recover`` good rounds. A missing ``ping`` is reported once and its targets never answer,
rather than passing silently; an empty list means the check is off (always reachable). An isolated node
stops serving, and an isolated backup never activates.

``NetworkHealth`` (the decision) is pure; ``probe_all`` runs the probes of one round; ``NetworkCheck`` joins
them for the node's timer and logs each transition once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from tridentmq_shared.link.topology import parse_endpoint

ICMP_PREFIX: Final = "icmp:"
DEFAULT_FAILURES_TO_ISOLATE: Final = 2
DEFAULT_SUCCESSES_TO_RECOVER: Final = 1

_log = logging.getLogger("tridentmq.core.ha")
_ping_failures_logged: set[str] = set()  # hosts whose ping error was logged: once each, not every round


@dataclass(frozen=True, slots=True)
class Target:
    """One address to probe: a TCP ``host:port``, or an ICMP host when ``port`` is None."""

    host: str
    port: int | None = None

    @property
    def icmp(self) -> bool:
        return self.port is None

    def __str__(self) -> str:
        if self.port is None:
            return f"{ICMP_PREFIX}{self.host}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_target(text: str) -> Target:
    """``host:port`` or ``icmp:host`` as a Target; ValueError saying what is wrong otherwise."""
    text = text.strip()
    if text[: len(ICMP_PREFIX)].lower() == ICMP_PREFIX:
        host = text[len(ICMP_PREFIX) :].strip().strip("[]")
        if not host:
            raise ValueError(f"network check target {text!r} has no host after {ICMP_PREFIX!r}")
        return Target(_checked_host(host, text))
    try:
        host, port = parse_endpoint(text)
    except ValueError:
        raise ValueError(f"network check target {text!r} is neither host:port nor {ICMP_PREFIX}host") from None
    return Target(_checked_host(host, text), port)


def _checked_host(host: str, text: str) -> str:
    # The host becomes an argument of ping: one starting with '-' would be read as an option.
    if host.startswith("-") or any(c.isspace() for c in host):
        raise ValueError(f"network check target {text!r} has an invalid host {host!r}")
    return host


def parse_targets(texts: str | Iterable[str]) -> list[Target]:
    """A comma-separated list (or an iterable) of targets, without blanks and duplicates, in order."""
    items = texts.split(",") if isinstance(texts, str) else texts
    return list(dict.fromkeys(parse_target(item) for item in items if item.strip()))


class Reachability(StrEnum):
    UNKNOWN = "unknown"  # before the first round: do not start serving or activate yet
    REACHABLE = "reachable"
    ISOLATED = "isolated"


class NetworkHealth:
    """Whether the node is reachable, from the results of successive probe rounds, with hysteresis. Pure."""

    def __init__(
        self,
        failures_to_isolate: int = DEFAULT_FAILURES_TO_ISOLATE,
        successes_to_recover: int = DEFAULT_SUCCESSES_TO_RECOVER,
    ) -> None:
        if failures_to_isolate < 1 or successes_to_recover < 1:
            raise ValueError("failures_to_isolate and successes_to_recover must be at least 1")
        self.failures_to_isolate = failures_to_isolate
        self.successes_to_recover = successes_to_recover
        self.state = Reachability.UNKNOWN
        self.failed_rounds = 0  # consecutive rounds in which no target answered
        self.good_rounds = 0  # consecutive rounds in which one did

    @property
    def reachable(self) -> bool:
        return self.state is Reachability.REACHABLE

    def record(self, results: Mapping[Target, bool]) -> Reachability | None:
        """Take one round's results (target -> answered); the new state when it changed, else None.

        No targets at all is a good round: the check is off. The first round decides at once, since
        there is no serving state yet to protect from a single lost probe.
        """
        good = not results or any(results.values())
        self.good_rounds, self.failed_rounds = (self.good_rounds + 1, 0) if good else (0, self.failed_rounds + 1)
        if self.state is Reachability.UNKNOWN:
            return self._become(Reachability.REACHABLE if good else Reachability.ISOLATED)
        if self.state is Reachability.REACHABLE and self.failed_rounds >= self.failures_to_isolate:
            return self._become(Reachability.ISOLATED)
        if self.state is Reachability.ISOLATED and self.good_rounds >= self.successes_to_recover:
            return self._become(Reachability.REACHABLE)
        return None

    def _become(self, state: Reachability) -> Reachability:
        self.state = state
        return state


@functools.cache
def ping_command() -> str | None:
    """The path of ``ping``, looked up once; its absence is logged once."""
    path = shutil.which("ping")
    if path is None:
        _log.error("network check: no 'ping' on PATH (Debian package iputils-ping): icmp: targets count as unreachable")
    return path


async def probe_tcp(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout`` seconds; it is closed at once."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):  # refused, unreachable, unresolvable or too slow
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def probe_icmp(host: str, timeout: float, ping: str | None = None) -> bool:
    """Whether ``host`` answers one ICMP echo within ``timeout`` seconds (False when there is no ping)."""
    ping = ping or ping_command()
    if ping is None:
        return False
    # -W takes whole seconds in older iputils; the options are those busybox' ping knows as well.
    args = [ping, "-q", "-c", "1", "-W", str(max(1, math.ceil(timeout))), host]
    try:
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        _log.error("network check: cannot run %s: %s", ping, exc)
        return False
    try:
        # ping's own -W does not bound name resolution: give it a second more, then kill it.
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout + 1)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return False
    if proc.returncode not in (0, 1) and host not in _ping_failures_logged:
        # 1 is "no answer"; anything else (no permission for raw sockets, unknown host) is a configuration error.
        _ping_failures_logged.add(host)
        _log.error("network check: ping %s failed: %s", host, stderr.decode(errors="replace").strip()[:200])
    return proc.returncode == 0


async def probe(target: Target, timeout: float) -> bool:
    if target.port is None:
        return await probe_icmp(target.host, timeout)
    return await probe_tcp(target.host, target.port, timeout)


async def probe_all(targets: Sequence[Target], timeout: float) -> dict[Target, bool]:
    """Probe every target concurrently; whether each answered within ``timeout`` seconds."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    answers = await asyncio.gather(*(probe(target, timeout) for target in targets))
    return dict(zip(targets, answers, strict=True))


class NetworkCheck:
    """The check a node runs: ``await run_round()`` every period; acts on the transitions it returns."""

    def __init__(self, targets: Sequence[Target], timeout: float, health: NetworkHealth | None = None) -> None:
        self.targets = list(dict.fromkeys(targets))
        self.timeout = timeout
        self.health = health or NetworkHealth()

    async def run_round(self) -> Reachability | None:
        """Probe all targets once; the new state when it changed (logged once here), else None."""
        results = await probe_all(self.targets, self.timeout)
        change = self.health.record(results)
        if change is Reachability.ISOLATED:
            _log.error("network check: isolated, none of %s answered: stop serving", ", ".join(map(str, results)))
        elif change is Reachability.REACHABLE:
            answered = [str(target) for target, ok in results.items() if ok]
            _log.info("network check: reachable (%s answered)", ", ".join(answered) or "no targets configured")
        return change
