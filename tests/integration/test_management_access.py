"""The management API of a real core with users: Basic authentication, the manage permission, the Host check
against DNS rebinding, open probes, and no secret in what anyone may read; the CLI passing credentials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    basic_auth,
    shared,
    start_core,
    start_gateway,
    stop_cleanly,
    stop_core_cleanly,
)

from tridentmq_core.security import hash_password

pytestmark = pytest.mark.integration

ADMIN_PASSWORD = "admin-pass-7f3"
APP_PASSWORD = "app-pass-91c"
CLUSTER_PASSWORD = "cluster-pass-e42"
# The admin's password is stored hashed (PBKDF2), as in production: the core checks it in a worker thread.
ADMIN_HASH = hash_password(ADMIN_PASSWORD, salt=b"management-test", iterations=20_000)
CONFIG = f"""
[cluster]
user = "cluster"
password = "{CLUSTER_PASSWORD}"

[[users]]
name = "admin"
password = "{ADMIN_HASH}"
roles = ["admin"]

[[users]]
name = "app"
password = "{APP_PASSWORD}"
roles = ["app"]

[[permissions]]
match = "#"
permission = "manage"
roles = ["admin"]

[[permissions]]
match = "#"
permission = "send"
roles = ["app"]
"""
SECRETS = (ADMIN_PASSWORD, APP_PASSWORD, CLUSTER_PASSWORD, ADMIN_HASH.rsplit("$", 1)[1])


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """Status, headers and body of a GET; HTTP errors are answers too."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read().decode()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoreProcess]:
    """One core for the module's tests, which only read from it."""
    core = shared(start_core(tmp_path_factory.mktemp("secured"), config=CONFIG))
    yield core
    stop_core_cleanly(core)


def test_the_api_needs_credentials(secured: CoreProcess) -> None:
    status, headers, body = get(secured.management_url + "/api/status")
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Basic ")
    assert "authentication required" in json.loads(body)["error"]
    wrong = get(secured.management_url + "/api/queues", basic_auth("admin", "not-it"))
    assert wrong[0] == 401
    unknown = get(secured.management_url + "/api/queues", basic_auth("nobody", ADMIN_PASSWORD))
    assert unknown[0] == 401
    malformed = get(secured.management_url + "/api/queues", {"Authorization": "Basic !!!not-base64"})
    assert malformed[0] == 401


def test_the_api_needs_the_manage_permission(secured: CoreProcess) -> None:
    status, _, body = get(secured.management_url + "/api/status", basic_auth("app", APP_PASSWORD))
    assert status == 403
    assert "manage" in json.loads(body)["error"]


def test_an_admin_reads_the_api(secured: CoreProcess) -> None:
    for path in ("/api/status", "/api/queues", "/api/addresses", "/api/connections"):
        status, _, body = get(secured.management_url + path, basic_auth("admin", ADMIN_PASSWORD))
        assert status == 200, (path, body)
        json.loads(body)
    status, _, body = get(secured.management_url + "/api/status", basic_auth("admin", ADMIN_PASSWORD))
    assert json.loads(body)["name"] == "core"


def test_probes_and_metrics_stay_open(secured: CoreProcess) -> None:
    assert get(secured.management_url + "/healthz")[:1] == (200,)
    status, _, body = get(secured.management_url + "/readyz")
    assert (status, json.loads(body)["status"]) == (200, "ready")
    status, _, metrics = get(secured.management_url + "/metrics")
    assert status == 200
    assert "tridentmq_ready 1" in metrics


def test_nothing_anyone_may_read_holds_a_secret(secured: CoreProcess) -> None:
    answers = [get(secured.management_url + path)[2] for path in ("/healthz", "/readyz", "/metrics", "/api/status")]
    answers.append(get(secured.management_url + "/api/status", basic_auth("app", APP_PASSWORD))[2])
    answers.append(get(secured.management_url + "/api/status", basic_auth("admin", "wrong"))[2])
    for answer in answers:
        for secret in SECRETS:
            assert secret not in answer
    log = secured.log()  # the failed login was logged, without the password it tried
    assert "management API login failed" in log
    assert "not-it" not in log
    assert "wrong" not in log.split("management API login failed", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "bad host", ""])
def test_a_foreign_host_header_is_refused_everywhere(secured: CoreProcess, host: str) -> None:
    """DNS rebinding: a page of evil.example whose name resolves to 127.0.0.1 gets nothing, credentials or not."""
    for path in ("/healthz", "/metrics", "/api/status"):
        status, _, body = get(secured.management_url + path, {"Host": host, **basic_auth("admin", ADMIN_PASSWORD)})
        assert status == 421, (path, body)
        assert "management.allowed_hosts" in json.loads(body)["error"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.:8161", "127.0.0.1", "127.0.0.2:1", "[::1]:8161"])
def test_loopback_host_names_are_allowed(secured: CoreProcess, host: str) -> None:
    assert get(secured.management_url + "/api/status", {"Host": host, **basic_auth("admin", ADMIN_PASSWORD)})[0] == 200


def test_configured_host_names_are_allowed_and_metrics_may_need_manage(tmp_path: Path) -> None:
    core = start_core(
        tmp_path,
        config=CONFIG,
        TRIDENTMQ_CORE_MANAGEMENT_ALLOWED_HOSTS="broker.internal",
        TRIDENTMQ_CORE_MANAGEMENT_PUBLIC_METRICS="false",
    )
    try:
        admin = basic_auth("admin", ADMIN_PASSWORD)
        assert get(core.management_url + "/healthz", {"Host": "broker.internal:8161"})[0] == 200
        assert get(core.management_url + "/healthz", {"Host": "other.internal"})[0] == 421
        assert get(core.management_url + "/metrics")[0] == 401
        assert get(core.management_url + "/metrics", basic_auth("app", APP_PASSWORD))[0] == 403
        status, _, metrics = get(core.management_url + "/metrics", {"Host": "broker.internal", **admin})
        assert status == 200
        assert "tridentmq_ready 1" in metrics
        assert get(core.management_url + "/readyz")[0] == 200
    finally:
        assert core.stop() == 0, core.log()


def tridentmq(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("TRIDENTMQ_USER", "TRIDENTMQ_PASSWORD")}
    return subprocess.run(
        [sys.executable, "-m", "tridentmq_shared.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**environment, **env},
    )


def test_the_cli_passes_credentials(secured: CoreProcess) -> None:
    url = secured.management_url
    refused = tridentmq("status", "--management", url)
    assert refused.returncode == 1
    assert "401" in refused.stderr
    assert "--user" in refused.stderr  # says what to do
    forbidden = tridentmq("queue", "stat", "--management", url, "--user", "app", "--password", APP_PASSWORD)
    assert forbidden.returncode == 1
    assert "403" in forbidden.stderr
    by_option = tridentmq("status", "--json", "--management", url, "--user", "admin", "--password", ADMIN_PASSWORD)
    assert by_option.returncode == 0, by_option.stderr
    assert json.loads(by_option.stdout)["ready"] is True
    by_env = tridentmq("queue", "stat", "--management", url, TRIDENTMQ_USER="admin", TRIDENTMQ_PASSWORD=ADMIN_PASSWORD)
    assert by_env.returncode == 0, by_env.stderr


@pytest.mark.parametrize("kind", ["stomp", "mqtt", "amqp"])
def test_a_gateway_http_port_checks_the_host(tmp_path: Path, kind: str) -> None:
    core = start_core(tmp_path)
    gateway: GatewayProcess | None = None
    try:
        prefix = f"TRIDENTMQ_{kind.upper()}"
        gateway = start_gateway(tmp_path, core, kind, **{f"{prefix}_HTTP_ALLOWED_HOSTS": "gw.internal"})
        base = f"http://127.0.0.1:{gateway.ports['http']}"
        for path in ("/healthz", "/readyz", "/metrics"):
            assert get(base + path)[0] == 200
            assert get(base + path, {"Host": "localhost"})[0] == 200
            assert get(base + path, {"Host": "gw.internal:8081"})[0] == 200
            status, _, body = get(base + path, {"Host": "evil.example"})
            assert status == 421
            assert "http.allowed_hosts" in body
    finally:
        if gateway is not None:
            stop_cleanly(gateway)
        assert core.stop() == 0
