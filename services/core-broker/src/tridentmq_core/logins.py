"""Link logins that cannot stall the node: password checks off the event loop, a cache, a per-address backoff.

A hashed password costs PBKDF2's full work (~55 ms at 200,000 iterations). On the event loop, a few dozen
parallel guessers made every other link wait seconds and heartbeats lapse. Here:

- hashed passwords are checked in a small thread pool (hashlib releases the GIL while it hashes);
- a successful check is remembered as a keyed hash of (user, stored password, password), so a reconnect
  storm of known clients costs one hash each, not PBKDF2 (a changed user entry no longer matches);
- each client address may have only ``max_pending_per_source`` checks (and delayed refusals) at once, so
  its guesses queue behind each other, not in front of everyone else's logins;
- a failed login is refused after a delay that doubles with each failure of the address in the window,
  which bounds the guesses one address can make however many connections it opens;
- failures are logged once per window and address (and gateway client), with their count when the window
  ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tridentmq_core.security import Credentials, password_matches
from tridentmq_core.settings import LoginSection
from tridentmq_shared.log_window import LogWindow

log = logging.getLogger("tridentmq.core")  # the node's own lines: one logger, one place to look

#: Addresses remembered (failure counts, pending checks); beyond, the idle ones longest unseen go first.
MAX_SOURCES = 100_000


def failure_delay(failures: int, settings: LoginSection) -> float:
    """Seconds before the refusal of an address's ``failures``-th failed login of the window."""
    delay_ms = min(settings.failure_delay_ms << min(max(failures - 1, 0), 30), settings.max_failure_delay_ms)
    return max(0, delay_ms) / 1000


@dataclass(slots=True)
class _Source:
    """One client address: its pending checks and recent failures."""

    slots: asyncio.Semaphore
    pending: int = 0  # checks holding or waiting for a slot
    failures: int = 0  # in the current window
    last_failure: float = field(default=0.0)


class LoginGuard:
    def __init__(self, settings: LoginSection) -> None:
        self.settings = settings
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, settings.verify_threads), thread_name_prefix="password-check"
        )
        self._secret = os.urandom(32)  # this process's cache key: the cache means nothing outside it
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._sources: dict[str, _Source] = {}
        self._window = settings.failure_window_ms / 1000
        self._failure_log = LogWindow(self._window)
        self.hashed_checks = 0  # PBKDF2 checks run (a cache hit runs none)
        self.failed = 0  # logins refused for their credentials

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _key(self, user: str, stored: str, password: str) -> bytes:
        digest = hashlib.blake2b(key=self._secret, digest_size=32)
        for part in (user, stored, password):
            data = part.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(4, "big") + data)  # length-prefixed: no two splits collide
        return digest.digest()

    def known_good(self, found: Credentials, user: str, password: str) -> bool:
        """True when the password is known to match without PBKDF2: a plain one that matches, or a hashed
        one that matched before (the cache). False means: ``verify`` it."""
        if found.principal is None:
            return False
        if not found.hashed:
            return password_matches(found.stored, password)  # a constant-time compare, on the loop
        key = self._key(user, found.stored, password)
        if key in self._cache:
            self._cache.move_to_end(key)
            return True
        return False

    async def verify(
        self, found: Credentials, user: str, password: str, source: str, client_host: str | None = None
    ) -> bool:
        """Check off the loop, one of at most ``max_pending_per_source`` of ``source``'s at a time; a failure
        returns False only after the address's current backoff delay."""
        state = self._source(source)
        state.pending += 1
        try:
            async with state.slots:
                if found.hashed:
                    self.hashed_checks += 1
                    check = self._pool.submit(password_matches, found.stored, password)
                    if found.principal is not None:  # remembered even if this login is gone when it ends
                        key = self._key(user, found.stored, password)
                        loop = asyncio.get_running_loop()
                        check.add_done_callback(lambda done: self._report(loop, done, key))
                    if await asyncio.wrap_future(check) and found.principal is not None:
                        return True
                elif found.principal is not None and password_matches(found.stored, password):
                    return True  # known_good was not asked (or the entry changed): still a match
                delay = self._failure(state, source, user, found.refusal, client_host, time.monotonic())
                await asyncio.sleep(delay)  # holding the slot: an address's guesses wait for each other
                return False
        finally:
            state.pending -= 1

    async def refuse(self, source: str, user: str | None, reason: str, client_host: str | None = None) -> None:
        """A login refused without a password check (no users configured and a remote client): counted,
        delayed and logged like a wrong password, so it cannot be repeated faster."""
        state = self._source(source)
        state.pending += 1
        try:
            async with state.slots:
                await asyncio.sleep(self._failure(state, source, user, reason, client_host, time.monotonic()))
        finally:
            state.pending -= 1

    def _failure(
        self, state: _Source, source: str, user: str | None, refusal: str, client_host: str | None, now: float
    ) -> float:
        if now - state.last_failure > self._window:
            state.failures = 0
        state.failures += 1
        state.last_failure = now
        self.failed += 1
        # Keyed by the gateway's client too, when a gateway names it: each remote client is said once.
        key = source if client_host is None else f"{source} {client_host}"
        if self._failure_log.first(key, now):
            log.warning(
                "link refused (further failures from this address are counted until the window ends)",
                extra={"peer": source, "client_host": client_host, "user": user, "reason": refusal},
            )
        return failure_delay(state.failures, self.settings)

    def _report(self, loop: asyncio.AbstractEventLoop, done: Future[bool], key: bytes) -> None:
        """From the checking thread: hand the outcome to the loop (gone at shutdown: nothing to keep)."""
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._checked, done, key)

    def _checked(self, done: Future[bool], key: bytes) -> None:
        if not done.cancelled() and done.exception() is None and done.result():
            self._remember(key)

    def _remember(self, key: bytes) -> None:
        if self.settings.cache_entries <= 0:
            return
        self._cache[key] = None
        self._cache.move_to_end(key)
        while len(self._cache) > self.settings.cache_entries:
            self._cache.popitem(last=False)

    def _source(self, source: str) -> _Source:
        state = self._sources.get(source)
        if state is None:
            if len(self._sources) >= MAX_SOURCES:
                self._forget_idle(time.monotonic(), everything_idle=True)
            state = self._sources[source] = _Source(asyncio.Semaphore(max(1, self.settings.max_pending_per_source)))
        return state

    def _forget_idle(self, now: float, *, everything_idle: bool = False) -> None:
        for source, state in list(self._sources.items()):
            if state.pending == 0 and (everything_idle or now - state.last_failure > self._window):
                del self._sources[source]

    def tick(self, now: float) -> None:
        """About once a second: report the windows that ended with failures counted, forget idle addresses."""
        for key, count in self._failure_log.ended(now):
            source, _, client_host = key.partition(" ")
            log.warning(
                "failed logins from one address in the last window",
                extra={
                    "peer": source,
                    "client_host": client_host or None,
                    "failures": count + 1,
                    "window_s": self._window,
                },
            )
        self._forget_idle(now)

    def cache_size(self) -> int:
        return len(self._cache)

    def pending(self, source: str) -> int:
        state = self._sources.get(source)
        return 0 if state is None else state.pending
