"""Settings read from a TOML file and the environment: every value is checked where it comes in, and a bad one
is named by its key in one line (the process then exits, never starting on a value it cannot use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tridentmq_amqp.settings import ENV_PREFIX as AMQP_PREFIX
from tridentmq_amqp.settings import AmqpSettings
from tridentmq_core.server import check_limits
from tridentmq_core.settings import ENV_PREFIX, CoreSettings
from tridentmq_mqtt.settings import ENV_PREFIX as MQTT_PREFIX
from tridentmq_mqtt.settings import MqttSettings
from tridentmq_shared.settings import SettingsError, load_settings
from tridentmq_stomp.settings import ENV_PREFIX as STOMP_PREFIX
from tridentmq_stomp.settings import StompSettings


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


@pytest.mark.parametrize(
    ("settings", "prefix", "env", "message"),
    [
        (MqttSettings, MQTT_PREFIX, {"MQTT_RECEIVE_MAXIMUM": "0"}, "mqtt.receive_maximum is at least 1, got 0"),
        (MqttSettings, MQTT_PREFIX, {"MQTT_RECEIVE_MAXIMUM": "70000"}, "mqtt.receive_maximum is at most 65535"),
        (MqttSettings, MQTT_PREFIX, {"CORE_SHARED_LINKS": "-1"}, "core.shared_links is at least 0, got -1"),
        (MqttSettings, MQTT_PREFIX, {"CORE_RETRY_INTERVAL_MS": "0"}, "core.retry_interval_ms is at least 1"),
        (StompSettings, STOMP_PREFIX, {"STOMP_PREFETCH": "0"}, "stomp.prefetch is at least 1, got 0"),
        (AmqpSettings, AMQP_PREFIX, {"AMQP_MAX_FRAME_BYTES": "100"}, "amqp.max_frame_bytes is at least 512, got 100"),
        (AmqpSettings, AMQP_PREFIX, {"LISTENER_MAX_CONNECTIONS": "0"}, "listener.max_connections is at least 1"),
    ],
)
def test_a_gateway_setting_outside_what_the_gateway_works_under_is_refused(
    settings: type[Any], prefix: str, env: dict[str, str], message: str
) -> None:
    """Each was taken before: a receive maximum of 0 or 70,000, which a CONNACK cannot carry; a prefetch of 0,
    which delivered nothing; -1 shared links; a retry interval of 0, which spun. The bounds are in the
    configuration reference."""
    with pytest.raises(SettingsError) as refused:
        load_settings(settings, prefix=prefix, env={f"{prefix}_{key}": value for key, value in env.items()})
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
        ("[journal]\nmax_disk_usage = 150", "journal.max_disk_usage is at most 100, got 150"),
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
        ("[audit]\nroll_seconds = 0", "audit.roll_seconds is at least 0.001, got 0"),
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
