"""The Host check of the HTTP ports (tridentmq_shared.http_hosts): parsing and the allow-list."""

from __future__ import annotations

import pytest

from tridentmq_shared.http_hosts import HostCheck, host_name


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost", "localhost"),
        ("LocalHost:8161", "localhost"),
        ("core.example.:80", "core.example"),
        ("127.0.0.1:8161", "127.0.0.1"),
        ("[::1]:8161", "::1"),
        ("[::1]", "::1"),
        ("", None),
        ("a b", None),
        ("host:port", None),
        ("host:", None),
        ("[::1", None),
        ("[::1]x", None),
        ("évil.example", None),
        ("evil.example/path", None),
    ],
)
def test_host_name(header: str, name: str | None) -> None:
    assert host_name(header) == name


def test_loopback_names_and_addresses_are_always_allowed() -> None:
    check = HostCheck([])
    for header in ("localhost", "127.0.0.1:1", "127.9.9.9", "[::1]:8161", "localhost.localdomain"):
        assert check.allows(header, None), header
    assert check.allows(None, None)  # no Host at all: not a browser


def test_other_names_need_configuring_and_addresses_must_be_the_one_reached() -> None:
    check = HostCheck(["Broker.Internal.", "0.0.0.0", ""])
    assert check.allows("broker.internal:8161", None)
    assert not check.allows("evil.example", "10.0.0.5")
    assert not check.allows("0.0.0.0", None)  # a wildcard interface is no name
    assert check.allows("10.0.0.5:8161", "10.0.0.5")  # the address the request came in on
    assert not check.allows("10.0.0.6", "10.0.0.5")
    assert not check.allows("127.0.0.1.evil.example", "127.0.0.1")


def test_a_star_allows_any_host() -> None:
    assert HostCheck(["*"]).allows("anything.example", None)
