"""The network health check: target parsing, the isolation decision and the probes."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tridentmq_core.ha import network_check
from tridentmq_core.ha.network_check import (
    NetworkCheck,
    NetworkHealth,
    Reachability,
    Target,
    parse_target,
    parse_targets,
    probe_all,
    probe_icmp,
)

A, B = Target("10.0.0.1", 5672), Target("gw.example", None)

# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("10.0.0.1:5672", Target("10.0.0.1", 5672)),
        (" broker-2.example:61616 ", Target("broker-2.example", 61616)),
        ("[::1]:5672", Target("::1", 5672)),
        ("icmp:10.0.0.254", Target("10.0.0.254")),
        ("ICMP:gw.example", Target("gw.example")),
        ("icmp:[fe80::1]", Target("fe80::1")),
        ("icmp:::1", Target("::1")),
    ],
)
def test_parse_target(text: str, target: Target) -> None:
    assert parse_target(text) == target


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "neither host:port nor icmp:host"),
        ("10.0.0.1", "neither host:port nor icmp:host"),
        ("host:", "neither host:port nor icmp:host"),
        ("host:0", "neither host:port nor icmp:host"),
        ("host:65536", "neither host:port nor icmp:host"),
        ("host:http", "neither host:port nor icmp:host"),
        ("icmp:", "no host after 'icmp:'"),
        ("icmp:  ", "no host after 'icmp:'"),
        ("icmp:-f", "invalid host '-f'"),
        ("icmp:a b", "invalid host 'a b'"),
        ("-x:5672", "invalid host '-x'"),
    ],
)
def test_bad_targets_are_refused_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(text)


def test_parse_targets_from_a_list_or_a_comma_separated_string() -> None:
    assert parse_targets("10.0.0.1:5672, icmp:gw.example,,10.0.0.1:5672") == [A, B]
    assert parse_targets(["icmp:gw.example", " "]) == [B]
    assert parse_targets("") == []


def test_targets_print_as_they_are_written() -> None:
    assert [str(t) for t in (A, B, Target("::1", 5672), Target("::1"))] == [
        "10.0.0.1:5672",
        "icmp:gw.example",
        "[::1]:5672",
        "icmp:::1",
    ]
    assert parse_target(str(Target("::1", 5672))) == Target("::1", 5672)


# ---------------------------------------------------------------- the decision (pure)


def up(*targets: Target) -> dict[Target, bool]:
    return {A: A in targets, B: B in targets}


DOWN = up()


def test_unknown_until_the_first_round_which_decides_at_once() -> None:
    health = NetworkHealth()
    assert (health.state, health.reachable) == (Reachability.UNKNOWN, False)
    assert health.record(up(B)) is Reachability.REACHABLE
    assert (health.state, health.reachable) == (Reachability.REACHABLE, True)
    isolated_at_start = NetworkHealth()
    assert isolated_at_start.record(DOWN) is Reachability.ISOLATED


def test_one_answering_target_is_enough() -> None:
    health = NetworkHealth(failures_to_isolate=1)
    health.record(up(A, B))
    for results in (up(A), up(B), up(A), up(A, B)):
        assert health.record(results) is None
        assert health.reachable


def test_isolated_only_after_consecutive_failed_rounds() -> None:
    health = NetworkHealth()  # 2 rounds to isolate, 1 to recover
    health.record(up(A))
    assert health.record(DOWN) is None
    assert health.reachable  # one lost round does not stop the node
    assert health.record(up(B)) is None  # and a good round resets the count
    assert health.record(DOWN) is None
    assert health.record(DOWN) is Reachability.ISOLATED
    assert (health.state, health.reachable) == (Reachability.ISOLATED, False)
    assert health.record(DOWN) is None  # reported once
    assert health.record(up(A)) is Reachability.REACHABLE
    assert health.record(up(A)) is None


def test_recovery_needs_consecutive_good_rounds() -> None:
    health = NetworkHealth(failures_to_isolate=3, successes_to_recover=2)
    health.record(up(A))
    assert [health.record(DOWN) for _ in range(3)] == [None, None, Reachability.ISOLATED]
    assert health.record(up(A)) is None
    assert health.record(DOWN) is None  # the good streak is broken
    assert health.record(up(B)) is None
    assert health.record(up(A, B)) is Reachability.REACHABLE
    assert (health.good_rounds, health.failed_rounds) == (2, 0)


def test_no_targets_means_always_reachable() -> None:
    health = NetworkHealth()
    assert health.record({}) is Reachability.REACHABLE
    for _ in range(5):
        assert health.record({}) is None
    assert health.reachable


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        NetworkHealth(failures_to_isolate=0)
    with pytest.raises(ValueError, match="at least 1"):
        NetworkHealth(successes_to_recover=0)


# ---------------------------------------------------------------- the probes


@pytest.fixture
async def listening() -> AsyncIterator[Target]:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield Target("127.0.0.1", port)
    server.close()
    await server.wait_closed()


def closed_port() -> Target:
    # A port the kernel just gave out and nothing listens on: connections are refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return Target("127.0.0.1", port)


async def test_tcp_probes_a_listener_and_a_closed_port_concurrently(listening: Target) -> None:
    closed = closed_port()
    assert await probe_all([listening, closed], timeout=2.0) == {listening: True, closed: False}
    assert await probe_all([], timeout=2.0) == {}


async def test_an_unresolvable_host_does_not_answer() -> None:
    target = Target("no-such-host.invalid", 5672)
    assert await probe_all([target], timeout=2.0) == {target: False}


async def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout"):
        await probe_all([], timeout=0)


@pytest.mark.skipif(shutil.which("ping") is None, reason="no ping binary here")
async def test_icmp_probe_of_loopback() -> None:
    target = Target("127.0.0.1")
    assert await probe_all([target], timeout=2.0) == {target: True}


async def test_icmp_without_ping_is_unreachable_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    network_check.ping_command.cache_clear()
    target = Target("127.0.0.1")
    try:
        with caplog.at_level(logging.ERROR, logger="tridentmq.core.ha"):
            assert await probe_all([target], timeout=1.0) == {target: False}
            assert await probe_all([target], timeout=1.0) == {target: False}
    finally:
        network_check.ping_command.cache_clear()
    assert caplog.text.count("no 'ping'") == 1


async def test_network_check_reports_and_logs_each_transition_once(
    listening: Target, caplog: pytest.LogCaptureFixture
) -> None:
    check = NetworkCheck([listening, closed_port()], timeout=2.0, health=NetworkHealth(failures_to_isolate=1))
    with caplog.at_level(logging.INFO, logger="tridentmq.core.ha"):
        assert await check.run_round() is Reachability.REACHABLE
        assert await check.run_round() is None
    assert caplog.text.count("reachable") == 1
    assert str(listening) in caplog.text

    dead = NetworkCheck([closed_port()], timeout=2.0, health=NetworkHealth(failures_to_isolate=1))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tridentmq.core.ha"):
        assert await dead.run_round() is Reachability.ISOLATED
        assert await dead.run_round() is None
    assert caplog.text.count("isolated") == 1


FAKE_PING = """#!/bin/sh
# Answers like iputils' ping: 0 for a reply, 1 for none, 2 for an error; the host comes last.
for host; do :; done
echo "$@" > "$(dirname "$0")/args"
case "$host" in
  127.0.0.1) exit 0 ;;
  10.255.255.1) exit 1 ;;
  hang.example) exec sleep 30 ;;
  *) echo "ping: socket: Operation not permitted" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def fake_ping(tmp_path: Path) -> str:
    path = tmp_path / "ping"
    path.write_text(FAKE_PING)
    path.chmod(0o755)
    return str(path)


async def test_icmp_probe_reads_pings_exit_status(fake_ping: str, caplog: pytest.LogCaptureFixture) -> None:
    assert await probe_icmp("127.0.0.1", 1.5, fake_ping)
    assert (Path(fake_ping).parent / "args").read_text().split() == ["-q", "-c", "1", "-W", "2", "127.0.0.1"]
    assert not await probe_icmp("10.255.255.1", 1.0, fake_ping)
    with caplog.at_level(logging.ERROR, logger="tridentmq.core.ha"):
        assert not await probe_icmp("denied.example", 1.0, fake_ping)
        assert not await probe_icmp("denied.example", 1.0, fake_ping)
    assert caplog.text.count("Operation not permitted") == 1  # a configuration error, said once


async def test_a_ping_that_hangs_is_killed(fake_ping: str) -> None:
    assert not await probe_icmp("hang.example", 0.1, fake_ping)


async def test_icmp_targets_go_through_ping(fake_ping: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network_check, "ping_command", lambda: fake_ping)
    targets = parse_targets("icmp:127.0.0.1,icmp:10.255.255.1")
    assert await probe_all(targets, timeout=1.0) == dict(zip(targets, [True, False], strict=True))
