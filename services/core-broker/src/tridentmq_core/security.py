"""Users, roles and per-address permissions (Artemis security-settings, matched by wildcard).

With no users configured the node runs in its embedded default: loopback clients are accepted whatever
credentials they present, everything else is refused (unless ``allow_anonymous_remote``). A gateway opens a
link per client from its own address, so it names the client's address in HELLO (``client_host``), and both
must be loopback: a gateway listening on every interface must not lend its loopback address to remote clients.

Grants allow a permission on an address pattern; deny rules (``deny = true``) refuse it, and **a deny rule
wins** over every grant, however specific. A wildcard filter (a subscription to ``sensors.#``) is allowed only
if *every* address it can match is allowed: it is compared with the rules as a pattern, never matched against
them as if it were a plain address (where ``*`` would match the literal word ``#``). ``Principal.allowed`` is
cached per address because it sits on the publish path.

Checking a hashed password takes PBKDF2's full cost (~55 ms at 200,000 iterations): ``credentials`` says
what a login must be checked against, and the node's shell (``tridentmq_core.logins``) runs
``password_matches`` off its event loop.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from tridentmq_core.router import ANY_WORD, ANY_WORDS, DELIMITER, is_wildcard, pattern_matches
from tridentmq_core.settings import PermissionEntry, UserEntry
from tridentmq_shared.loopback import is_loopback


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


_NO_ROLES: Final[frozenset[str]] = frozenset()
#: Principals kept for reuse under the embedded default, where any user name is let in (then forgotten at once).
MAX_SHARED_PRINCIPALS: Final = 10_000


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
        """Whether this user has ``permission`` on ``address``: on every address it matches, for a filter."""
        if self.unrestricted:
            return True
        key = (permission, address)
        found = self._cache.get(key)
        if found is None:
            found = self.refused_address(permission, address) is None
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = found
        return found

    def refused_address(self, permission: Permission, address: str) -> str | None:
        """An address (``address`` itself, or one its wildcards match) on which this user lacks
        ``permission``; None when there is none."""
        if self.unrestricted:
            return None
        rules = [g for g in self._grants if g.permission == permission.value and self.roles.intersection(g.roles)]
        allow = [g.match for g in rules if not g.deny]
        deny = [g.match for g in rules if g.deny]
        if is_wildcard(address):
            return refused_by_rules(address, allow, deny)
        if any(pattern_matches(p, address) for p in allow) and not any(pattern_matches(p, address) for p in deny):
            return None
        return address


#: Pattern steps (one pattern consuming one word) a decision may take before the filter is refused as too
#: costly to decide (fail closed): a few tenths of a second at most, on a subscribe, once per user and filter.
MAX_FILTER_WORK = 200_000


def refused_by_rules(address_filter: str, allow: Sequence[str], deny: Sequence[str]) -> str | None:
    """An address that ``address_filter`` matches and that the rules do not allow (no ``allow`` pattern
    matches it, or a ``deny`` pattern does), or None when the filter matches no such address.

    Decided exactly on the patterns: every pattern (the filter included) is a small automaton over words
    (``*`` one word, ``#`` any number of words, another word itself), and a breadth-first walk over all of
    them at once, one word at a time, finds the shortest address in the filter that the rules refuse. Words
    that no pattern names behave alike, so one stand-in word represents them all. Rules that share no address
    with the filter are left out first: they cannot change the answer."""
    filter_words = address_filter.split(DELIMITER)
    allowing = [w for w in (p.split(DELIMITER) for p in allow) if _search([filter_words, w], _both)]
    denying = [w for w in (p.split(DELIMITER) for p in deny) if _search([filter_words, w], _both)]
    allow_end = 1 + len(allowing)

    def refused(accepts: list[bool]) -> bool:
        return accepts[0] and (not any(accepts[1:allow_end]) or any(accepts[allow_end:]))

    return _search([filter_words, *allowing, *denying], refused, too_costly=address_filter)


def _both(accepts: list[bool]) -> bool:
    return all(accepts)


def _search(patterns: list[list[str]], wanted: Callable[[list[bool]], bool], too_costly: str = "") -> str | None:
    """The shortest address (of one word or more) on which the patterns' matches (``accepts[i]``: pattern
    ``i`` matches it) are ``wanted``, the first pattern always matching; None when there is none."""
    literals = {w for words in patterns for w in words if w not in (ANY_WORD, ANY_WORDS)}
    other = "x"
    while other in literals:
        other += "x"
    alphabet = [*sorted(literals), other]
    start = tuple(_closure(words, frozenset((0,))) for words in patterns)
    seen = {start}
    frontier: list[tuple[tuple[frozenset[int], ...], tuple[str, ...]]] = [(start, ())]
    work = 0
    while frontier:
        following = []
        for states, path in frontier:
            work += len(alphabet) * len(patterns)
            if work > MAX_FILTER_WORK:
                return too_costly or DELIMITER.join(patterns[0])  # undecided: refused, or counted as overlapping
            for word in alphabet:
                stepped = tuple(_step(words, at, word) for words, at in zip(patterns, states, strict=True))
                if not stepped[0]:
                    continue  # the first pattern matches no address starting so
                address = (*path, word)
                if wanted([len(words) in at for words, at in zip(patterns, stepped, strict=True)]):
                    return DELIMITER.join(address)
                if stepped not in seen:
                    seen.add(stepped)
                    following.append((stepped, address))
        frontier = following
    return None


def _step(words: list[str], positions: frozenset[int], word: str) -> frozenset[int]:
    """The positions in a pattern after it consumed ``word`` from ``positions``."""
    advanced = set()
    for i in positions:
        if i < len(words):
            if words[i] == ANY_WORDS:
                advanced.add(i)  # '#' takes the word and may take more
            elif words[i] in (ANY_WORD, word):
                advanced.add(i + 1)
    return _closure(words, frozenset(advanced)) if advanced else frozenset()


def _closure(words: list[str], positions: frozenset[int]) -> frozenset[int]:
    """Add the positions reached by letting each '#' match no word."""
    found = set(positions)
    stack = list(positions)
    while stack:
        i = stack.pop()
        if i < len(words) and words[i] == ANY_WORDS and i + 1 not in found:
            found.add(i + 1)
            stack.append(i + 1)
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a login's password is checked against, and who it makes the client when it matches."""

    stored: str  # the stored password: plain or ``pbkdf2_sha256$…``
    principal: Callable[[], Principal] | None  # None: no such user (the check runs all the same)
    refusal: str = "unknown user or wrong password"  # what the client is told when it does not match

    @property
    def hashed(self) -> bool:
        return is_hashed(self.stored)


def is_hashed(stored: str) -> bool:
    return stored.startswith("pbkdf2_sha256$")


def hash_password(password: str, *, salt: bytes, iterations: int = 200_000) -> str:
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def password_matches(stored: str, given: str) -> bool:
    if is_hashed(stored):
        try:
            _, iterations, salt, expected = stored.split("$")
            digest = hashlib.pbkdf2_hmac("sha256", given.encode(), bytes.fromhex(salt), int(iterations))
        except ValueError:
            return False
        return hmac.compare_digest(digest.hex(), expected)
    return hmac.compare_digest(stored.encode(), given.encode())


class SecurityManager:
    def __init__(
        self, users: Sequence[UserEntry], grants: Sequence[PermissionEntry], *, allow_anonymous_remote: bool = False
    ) -> None:
        self._users = {u.name: u for u in users}
        # Each user's roles as one set: every link of the user shares it (an empty set is 216 bytes).
        self._roles = {u.name: frozenset(u.roles) for u in users}
        self._grants = tuple(grants)
        self.allow_anonymous_remote = allow_anonymous_remote
        # An unknown user's password is checked against a hash as costly as the dearest configured one, so
        # the time to a refusal does not tell which user names exist. It matches no password.
        iterations = max((int(u.password.split("$")[1]) for u in users if _valid_hash(u.password)), default=0)
        self._no_user = f"pbkdf2_sha256${iterations}${'00' * 16}${'00' * 32}" if iterations else "\x00no user"
        # One principal per user, shared by all its links and sessions: its permission cache then serves them
        # all, and 100,000 sessions of a few users do not hold 100,000 principals. Names are the clients' own
        # under the embedded default, so the table is bounded.
        self._principals: dict[str, Principal] = {}

    @property
    def embedded_default(self) -> bool:
        return not self._users

    def credentials(
        self, user: str | None, peer_host: str | None, client_host: str | None = None
    ) -> Principal | Credentials:
        """A principal at once (the embedded default), or what the password must be checked against.
        ``peer_host`` is the link's peer; ``client_host`` the gateway's client the link serves, if any."""
        if self.embedded_default:
            remote = not is_loopback(peer_host) or (client_host is not None and not is_loopback(client_host))
            if remote and not self.allow_anonymous_remote:
                raise AuthenticationError(
                    "no users are configured, so only clients on the broker's own host (loopback) are accepted"
                )
            return self.unrestricted(user or "anonymous")
        entry = self._users.get(user or "")
        if entry is None:
            return Credentials(self._no_user, None)
        name = entry.name
        return Credentials(entry.password, lambda: self._principal(name))

    def principal_of(self, user: str) -> Principal:
        """The principal of a configured ``user`` whose identity was established without its password (a
        gateway vouching for a client certificate); AuthenticationError for an unknown user."""
        if user not in self._users:
            raise AuthenticationError(f"no user {user!r} is configured")
        return self._principal(user)

    def unrestricted(self, user: str) -> Principal:
        """The principal of ``user`` under the embedded default: every right."""
        found = self._principals.get(user)
        if found is None:
            if len(self._principals) >= MAX_SHARED_PRINCIPALS:
                self._principals.clear()
            found = self._principals[user] = Principal(user, _NO_ROLES, unrestricted=True)
        return found

    def _principal(self, user: str) -> Principal:
        """The principal of the configured ``user``."""
        found = self._principals.get(user)
        if found is None:
            found = self._principals[user] = Principal(
                user, self._roles[user], unrestricted=False, _grants=self._grants
            )
        return found

    def authenticate(
        self, user: str | None, password: str | None, peer_host: str | None, client_host: str | None = None
    ) -> Principal:
        """Everything in one call, the password check included (tests and tools; the node checks off-loop)."""
        found = self.credentials(user, peer_host, client_host)
        if isinstance(found, Principal):
            return found
        if found.principal is None or not password_matches(found.stored, password or ""):
            raise AuthenticationError(found.refusal)
        return found.principal()


def _valid_hash(stored: str) -> bool:
    parts = stored.split("$")
    return is_hashed(stored) and len(parts) == 4 and parts[1].isdigit()
