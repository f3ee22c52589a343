"""Who may use the management HTTP server.

- Every request: its ``Host`` must be allowed (DNS rebinding, see ``tridentmq_shared.http_hosts``).
- ``/healthz`` and ``/readyz`` are open (probes), ``/metrics`` too unless ``management.public_metrics`` is off
  (Prometheus; it holds names and counts, no secret).
- The web console's files (``/console/...``) are open: they hold no data (see ``console.py``).
- Everything else (``/api/...``): with users configured, HTTP Basic credentials of a user holding the ``manage``
  permission on the address ``$sys.management`` (a grant matching ``#`` covers it); with no users (the embedded
  default), loopback clients only, as on the link.
- A request that may change something is refused when a browser could have sent it for another site (CSRF: a
  browser that once got the user's Basic credentials sends them along by itself): an ``Origin`` header, when
  present, must name the host the request was sent to, and a POST (the one such method a form or a plain
  cross-site fetch can send) must carry ``Content-Type: application/json`` or the header ``X-TridentMQ-Request``,
  which a page of another origin cannot set without a CORS preflight (never granted here).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from tridentmq_core.management.console import is_console_path
from tridentmq_core.security import AuthenticationError, Permission, Principal, SecurityManager
from tridentmq_core.settings import CoreSettings
from tridentmq_shared.http_hosts import HostCheck, host_check_middleware
from tridentmq_shared.loopback import is_loopback

log = logging.getLogger("tridentmq.core.management")

MANAGEMENT_ADDRESS = "$sys.management"
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/"})
REQUEST_HEADER = "X-TridentMQ-Request"  # marks a request as sent by a program (the console, the CLI), not a form
CONSOLE_HEADER = "X-TridentMQ-Console"  # the console's calls: a 401 without WWW-Authenticate (no browser prompt)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
REALM = 'Basic realm="tridentmq", charset="UTF-8"'
MAX_PARALLEL_CHECKS = 2  # password hashes checked at once, in threads: a flood of guesses queues, the loop runs on
MAX_WAITING_CHECKS = 64  # beyond, a login is answered 429 at once instead of queueing
CACHE_SECONDS = 60.0  # a verified user and password pair is trusted this long without hashing again
CACHE_ENTRIES = 256
FAILURE_LOG_SECONDS = 10.0  # failed logins are logged once per window, with their count
USER_KEY = web.RequestKey("user", str)  # the name of a request's authenticated user (audited operations)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Authenticate = Callable[[str | None, str | None, str | None], Principal]


async def verify_credentials(authenticate: Authenticate, user: str, password: str, peer: str | None) -> Principal:
    """Check ``user``/``password`` with ``authenticate`` (a PBKDF2 hash: tens of ms) in a worker thread, so the
    broker's event loop never waits for it. The one place to change when the node gets a shared verifier."""
    return await asyncio.to_thread(authenticate, user, password, peer)


def _credentials(header: str) -> tuple[str, str] | None:
    """User and password of an ``Authorization: Basic`` header, or None when it is not one."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic" or not encoded or len(encoded) > 4096:
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, colon, password = decoded.partition(":")
    return (user, password) if colon and user else None


class ManagementAccess:
    """Authentication and authorisation of the management API (``security`` holds the configured users)."""

    def __init__(self, security: SecurityManager, *, public_metrics: bool) -> None:
        self.security = security
        self.public_metrics = public_metrics
        self._checks = asyncio.Semaphore(MAX_PARALLEL_CHECKS)
        self._cache_key = os.urandom(16)  # verified passwords are kept only as keyed hashes
        self._verified: dict[bytes, tuple[float, Principal]] = {}
        self._waiting = 0
        self._failures = 0
        self._failure_window = 0.0

    def is_open(self, path: str) -> bool:
        return path in OPEN_PATHS or is_console_path(path) or (path == "/metrics" and self.public_metrics)

    async def refusal(self, request: web.Request) -> web.Response | None:
        """None when ``request`` may go on, else the answer that refuses it (401 or 403)."""
        peer = request.remote
        if self.security.embedded_default:
            if is_loopback(peer):
                request[USER_KEY] = "anonymous"
                return None
            return _error(403, "no users are configured, so the management API answers loopback clients only")
        given = _credentials(request.headers.get("Authorization", ""))
        if given is None:
            return _error(401, "authentication required (HTTP Basic, a user with the manage permission)")
        if self._waiting >= MAX_WAITING_CHECKS:
            return _error(429, "too many logins in progress, try again later")
        principal = await self._principal(given[0], given[1], peer)
        if principal is None:
            return _error(401, "unknown user or wrong password")
        request[USER_KEY] = principal.name
        if not principal.allowed(Permission.MANAGE, MANAGEMENT_ADDRESS):
            return _error(403, f"user {principal.name!r} lacks the manage permission on {MANAGEMENT_ADDRESS}")
        return None

    async def _principal(self, user: str, password: str, peer: str | None) -> Principal | None:
        key = hashlib.blake2b(f"{user}\0{password}".encode(), key=self._cache_key, digest_size=32).digest()
        now = time.monotonic()
        cached = self._verified.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        self._waiting += 1
        try:
            async with self._checks:
                principal = await verify_credentials(self.security.authenticate, user, password, peer)
        except AuthenticationError:
            self._failed(user, peer, now)
            return None
        finally:
            self._waiting -= 1
        if len(self._verified) >= CACHE_ENTRIES:
            self._verified = {k: v for k, v in self._verified.items() if v[0] > now}
            if len(self._verified) >= CACHE_ENTRIES:
                self._verified.clear()
        self._verified[key] = (now + CACHE_SECONDS, principal)
        return principal

    def _failed(self, user: str, peer: str | None, now: float) -> None:
        """One WARNING line per window however many guesses came in it (the count is in the next one)."""
        self._failures += 1
        if now - self._failure_window >= FAILURE_LOG_SECONDS:
            log.warning(
                "management API login failed",
                extra={"user": ascii(user), "peer": peer, "failures_in_window": self._failures},
            )
            self._failures = 0
            self._failure_window = now


def _error(status: int, text: str) -> web.Response:
    headers = {"WWW-Authenticate": REALM} if status == 401 else None
    return web.json_response({"error": text}, status=status, headers=headers)


def cross_site_refusal(request: web.Request) -> web.Response | None:
    """None when ``request`` cannot be a forgery by a page of another site (see the module docstring)."""
    if request.method in SAFE_METHODS:
        return None
    origin = request.headers.get("Origin")
    if origin is not None and origin != "null":
        _, _, authority = origin.partition("://")
        if authority.lower() != request.host.lower():
            return _error(403, f"a request from the page of another site ({origin[:100]}) is refused")
    elif origin == "null":
        return _error(403, "a request from a page without an origin is refused")
    # Only a POST can come from a form or a plain cross-site fetch: other methods need a preflight first.
    if (
        request.method == "POST"
        and request.content_type != "application/json"
        and REQUEST_HEADER not in request.headers
    ):
        return _error(
            403,
            f"a request that changes something needs a JSON body (Content-Type: application/json) "
            f"or the header {REQUEST_HEADER}: 1 (a defence against cross-site requests)",
        )
    return None


def allowed_host_names(settings: CoreSettings) -> list[str]:
    """The names besides loopback that requests may carry in ``Host``: the configured ones and the node's own."""
    return [
        *settings.management.allowed_hosts,
        settings.management.host,
        settings.link.host,
        settings.cluster.advertise_host,
    ]


def access_middlewares(
    settings: CoreSettings, access: ManagementAccess, audit_refusal: Callable[[web.Request, str], None]
) -> list[Middleware]:
    """The Host check, then authentication and the manage permission for whatever is not open. An operation
    refused to a logged-in user for want of the permission goes to ``audit_refusal``."""

    @web.middleware
    async def authorise(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = cross_site_refusal(request)
        if refused is None and not access.is_open(request.path):
            refused = await access.refusal(request)
            if refused is not None and refused.status == 403 and USER_KEY in request:
                audit_refusal(request, "the user lacks the manage permission")
        if refused is not None:
            if CONSOLE_HEADER in request.headers:
                refused.headers.popall("WWW-Authenticate", None)
            return refused
        return await handler(request)

    hosts = HostCheck(allowed_host_names(settings))
    return [host_check_middleware(hosts, "management.allowed_hosts"), authorise]
