"""Authentication rules of the security manager (pure)."""

from __future__ import annotations

import pytest

from tridentmq_core.security import AuthenticationError, SecurityManager
from tridentmq_core.settings import UserEntry


@pytest.mark.parametrize(
    ("peer", "client_host", "accepted"),
    [
        ("127.0.0.1", None, True),  # a link of its own, from this host
        ("::1", None, True),
        ("127.0.0.1", "127.0.0.5", True),  # a gateway's client on this host
        ("127.0.0.1", "::ffff:127.0.0.1", True),
        ("127.0.0.1", "10.1.2.3", False),  # a gateway on this host serving a remote client
        ("127.0.0.1", "?", False),  # a gateway that could not tell: refused, not trusted
        ("10.1.2.3", None, False),
        ("10.1.2.3", "127.0.0.1", False),  # a remote link cannot vouch for itself
    ],
)
def test_without_users_only_loopback_clients_are_accepted(peer: str, client_host: str | None, accepted: bool) -> None:
    security = SecurityManager([], [])
    if accepted:
        assert security.authenticate(None, None, peer, client_host).unrestricted
    else:
        with pytest.raises(AuthenticationError, match="loopback"):
            security.authenticate(None, None, peer, client_host)


def test_allow_anonymous_remote_accepts_every_host() -> None:
    security = SecurityManager([], [], allow_anonymous_remote=True)
    assert security.authenticate("anyone", None, "10.1.2.3", "192.0.2.7").unrestricted


def test_with_users_the_address_does_not_matter_but_the_password_does() -> None:
    security = SecurityManager([UserEntry("bob", "pw", ["app"])], [])
    assert security.authenticate("bob", "pw", "127.0.0.1", "10.1.2.3").name == "bob"
    with pytest.raises(AuthenticationError):
        security.authenticate(None, None, "127.0.0.1", "127.0.0.1")
