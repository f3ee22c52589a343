"""Settings read from a TOML file and the environment: every value is checked where it comes in, and a bad one
is named by its key in one line (the process then exits, never starting on a value it cannot use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tridentmq_core.server import check_limits
from tridentmq_core.settings import ENV_PREFIX, CoreSettings
from tridentmq_mqtt.settings import ENV_PREFIX as MQTT_PREFIX
from tridentmq_mqtt.settings import MqttSettings
from tridentmq_shared.settings import SettingsError, load_settings


def core(tmp_path: Path, toml: str) -> CoreSettings:
    file = tmp_path / "core.toml"
    file.write_text(toml)
    return load_settings(CoreSettings, prefix=ENV_PREFIX, file=file, env={})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[link]\nport = 70000", "link.port: a port is from 0 to 65535 (-1: off, where it may be), got 70000"),
        ("[link]\nport = -5", "link.port: a port is from 0 to 65535"),
        ("[management]\nport = -3", "management.port: a port is from 0 to 65535"),
        ("[link]\nport = 61616.7", "link.port: expected an integer, got 61616.7"),
        ("[node]\nlog_level = 'LOUD'", "node.log_level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
        ("[journal]\ncompact_live_ratio = nan", "journal.compact_live_ratio: expected a finite number"),
        ("[lnk]\nport = 1", "unknown setting(s) lnk"),
    ],
)
def test_a_value_the_process_cannot_use_is_refused_naming_its_key(tmp_path: Path, toml: str, message: str) -> None:
    """A port of 70000 listened on 4464, 61616.7 on 61616, a log level `LOUD` and a port of -3 stopped the
    process through a traceback (a gateway with such an HTTP port hung, deaf to SIGTERM), `nan` was taken."""
    with pytest.raises(SettingsError) as refused:
        core(tmp_path, toml)
    assert str(refused.value).startswith(message), refused.value


def test_ports_off_any_and_whole_numbers_are_taken(tmp_path: Path) -> None:
    settings = core(tmp_path, "[link]\nport = 0\n[management]\nport = 8161.0\n[node]\nlog_level = 'debug'")
    assert (settings.link.port, settings.management.port, settings.node.log_level) == (0, 8161, "debug")
    gateway = load_settings(MqttSettings, prefix=MQTT_PREFIX, env={"TRIDENTMQ_MQTT_LISTENER_WEBSOCKET_PORT": "-1"})
    assert gateway.listener.websocket_port == -1
    with pytest.raises(SettingsError, match=r"http\.port: a port is from 0 to 65535"):
        load_settings(MqttSettings, prefix=MQTT_PREFIX, env={"TRIDENTMQ_MQTT_HTTP_PORT": "99999"})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[link]\nheartbeat_ms = -10", "link.heartbeat_ms is at least 0, got -10"),
        ("[link]\npublish_window = 0", "link.publish_window is at least 1, got 0"),
        ("[link]\nmax_connections = 0", "link.max_connections is at least 1, got 0"),
        ("[broker]\nmax_consumer_credit = 0", "broker.max_consumer_credit is at least 1, got 0"),
        ("[journal]\nsegment_bytes = 0", "journal.segment_bytes is at least 65536, got 0"),
        ("[journal]\nmax_disk_usage = 150", "journal.max_disk_usage is a percent from 0 to 100, got 150"),
        ("[journal]\ncompact_live_ratio = 5", "journal.compact_live_ratio is above 0 and at most 1, got 5"),
        ("[[users]]\nname = ''\npassword = 'x'", "users: a user has no name"),
        (
            "[[users]]\nname = 'ann'\npassword = 'x'\n[[users]]\nname = 'ann'\npassword = 'y'",
            "users: ann listed more than once (the last entry would win)",
        ),
        ("[[permissions]]\nmatch = '#'\npermission = 'sned'\nroles = ['r']", "permissions: 'sned' (match '#') is not"),
        ("[broker]\nexpiry_scan_ms = 0", "broker.expiry_scan_ms is at least 1, got 0"),
        ("[broker]\ndedup_window_seconds = -1", "broker.dedup_window_seconds is at least 0, got -1"),
        ("[cluster]\nretry_multiplier = 0.5", "cluster.retry_multiplier is at least 1, got 0.5"),
        ("[ha]\nvote_retry_ms = 0", "ha.vote_retry_ms is at least 1, got 0"),
        ("[login]\nverify_threads = 0", "login.verify_threads is at least 1, got 0"),
        ("[audit]\nroll_seconds = 0", "audit.roll_seconds is above 0, got 0"),
    ],
)
def test_a_value_the_node_would_run_with_but_not_work_under_is_refused(tmp_path: Path, toml: str, message: str) -> None:
    """Accepted before: every link refused (its handshake or the connection limit), producers waiting for ever,
    every consumer refused, durable publishes all refused; a permission typo granted nothing, silently, and of
    two entries of one user the last won."""
    with pytest.raises(SettingsError) as refused:
        check_limits(core(tmp_path, toml))
    assert str(refused.value).startswith(message), refused.value


def test_the_defaults_pass_the_checks(tmp_path: Path) -> None:
    check_limits(core(tmp_path, "[journal]\nmax_disk_usage = 0"))  # 0: any usage is over it (tests use it)
