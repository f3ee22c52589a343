"""Users, roles and per-address permissions (Artemis security-settings, matched by wildcard).

With no users configured the node runs in its embedded default: loopback clients are accepted whatever
credentials they present, everything else is refused (unless ``allow_anonymous_remote``). A gateway opens a
link per client from its own address, so it names the client's address in HELLO (``client_host``), and both
must be loopback: a gateway listening on every interface must not lend its loopback address to remote clients.
``Principal.allowed`` is cached per address
because it sits on the publish path.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tridentmq_core.router import pattern_matches
from tridentmq_core.settings import PermissionEntry, UserEntry


class Permission(StrEnum):
    SEND = "send"
    CONSUME = "consume"
    BROWSE = "browse"
    CREATE_ADDRESS = "createAddress"
    CREATE_DURABLE_QUEUE = "createDurableQueue"
    DELETE_DURABLE_QUEUE = "deleteDurableQueue"
    CREATE_NON_DURABLE_QUEUE = "createNonDurableQueue"
    DELETE_NON_DURABLE_QUEUE = "deleteNonDurableQueue"
    DELETE_ADDRESS = "deleteAddress"
    MANAGE = "manage"


class AuthenticationError(Exception):
    """Credentials refused; the message is safe to show to the client."""


@dataclass(slots=True)
class Principal:
    """An authenticated link user and its permission cache."""

    name: str
    roles: frozenset[str]
    unrestricted: bool
    cluster: bool = False  # a node of this cluster (authenticated with the cluster credentials)
    _grants: Sequence[PermissionEntry] = ()
    _cache: dict[tuple[Permission, str], bool] = field(default_factory=dict)

    def allowed(self, permission: Permission, address: str) -> bool:
        if self.unrestricted:
            return True
        key = (permission, address)
        found = self._cache.get(key)
        if found is None:
            found = any(
                g.permission == permission.value
                and self.roles.intersection(g.roles)
                and pattern_matches(g.match, address)
                for g in self._grants
            )
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = found
        return found


def hash_password(password: str, *, salt: bytes, iterations: int = 200_000) -> str:
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def password_matches(stored: str, given: str) -> bool:
    if stored.startswith("pbkdf2_sha256$"):
        try:
            _, iterations, salt, expected = stored.split("$")
            digest = hashlib.pbkdf2_hmac("sha256", given.encode(), bytes.fromhex(salt), int(iterations))
        except ValueError:
            return False
        return hmac.compare_digest(digest.hex(), expected)
    return hmac.compare_digest(stored.encode(), given.encode())


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack listener
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class SecurityManager:
    def __init__(self, users: Sequence[UserEntry], grants: Sequence[PermissionEntry], *,
                 allow_anonymous_remote: bool = False) -> None:  # fmt: skip
        self._users = {u.name: u for u in users}
        self._grants = tuple(grants)
        self.allow_anonymous_remote = allow_anonymous_remote

    @property
    def embedded_default(self) -> bool:
        return not self._users

    def authenticate(self, user: str | None, password: str | None, peer_host: str | None,
                     client_host: str | None = None) -> Principal:  # fmt: skip
        """``peer_host`` is the link's peer; ``client_host`` the gateway's client the link serves, if any."""
        if self.embedded_default:
            remote = not is_loopback(peer_host) or (client_host is not None and not is_loopback(client_host))
            if remote and not self.allow_anonymous_remote:
                raise AuthenticationError("no users are configured, so only clients on the broker's own host "
                                          "(loopback) are accepted")  # fmt: skip
            return Principal(user or "anonymous", frozenset(), unrestricted=True)
        entry = self._users.get(user or "")
        if entry is None or not password_matches(entry.password, password or ""):
            raise AuthenticationError("unknown user or wrong password")
        return Principal(entry.name, frozenset(entry.roles), unrestricted=False, _grants=self._grants)
