"""The node's login guard: password checks in real threads, the success cache, the per-address limits."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tridentmq_core.logins import LoginGuard, failure_delay
from tridentmq_core.security import Credentials, Principal, SecurityManager, hash_password
from tridentmq_core.settings import LoginSection, UserEntry

HASHED = hash_password("secret", salt=b"salt", iterations=1000)


def _security(stored: str = HASHED) -> SecurityManager:
    return SecurityManager([UserEntry("alice", stored, ["app"])], [])


def _credentials(security: SecurityManager, user: str = "alice") -> Credentials:
    found = security.credentials(user, "10.0.0.1")
    assert isinstance(found, Credentials)
    return found


async def test_a_hashed_password_is_checked_once_then_served_from_the_cache() -> None:
    guard = LoginGuard(LoginSection())
    found = _credentials(_security())
    try:
        assert not guard.known_good(found, "alice", "secret")
        assert await guard.verify(found, "alice", "secret", "10.0.0.1")
        assert guard.hashed_checks == 1
        assert guard.known_good(found, "alice", "secret")
        assert not guard.known_good(found, "alice", "wrong")
        assert not guard.known_good(_credentials(_security(), "bob"), "bob", "secret")  # unknown user
    finally:
        guard.close()


async def test_a_changed_user_entry_is_not_served_from_the_cache() -> None:
    guard = LoginGuard(LoginSection(failure_delay_ms=0))
    try:
        assert await guard.verify(_credentials(_security()), "alice", "secret", "10.0.0.1")
        changed = _credentials(_security(hash_password("new", salt=b"other", iterations=1000)))
        assert not guard.known_good(changed, "alice", "secret")
        assert not await guard.verify(changed, "alice", "secret", "10.0.0.1")
        assert await guard.verify(changed, "alice", "new", "10.0.0.1")
    finally:
        guard.close()


async def test_the_cache_is_bounded() -> None:
    guard = LoginGuard(LoginSection(cache_entries=2))
    users = [UserEntry(f"u{i}", hash_password("pw", salt=b"s%d" % i, iterations=100), []) for i in range(3)]
    security = SecurityManager(users, [])
    try:
        for i in range(3):
            found = security.credentials(f"u{i}", "10.0.0.1")
            assert isinstance(found, Credentials)
            assert await guard.verify(found, f"u{i}", "pw", "10.0.0.1")
        assert guard.cache_size() == 2
        first = security.credentials("u0", "10.0.0.1")
        assert isinstance(first, Credentials)
        assert not guard.known_good(first, "u0", "pw")  # the oldest went first
    finally:
        guard.close()


async def test_an_address_has_a_bounded_number_of_checks_and_others_pass_meanwhile() -> None:
    # Failures are refused only after a long delay, holding the address's slots: its further guesses wait.
    guard = LoginGuard(LoginSection(max_pending_per_source=2, failure_delay_ms=60_000, max_failure_delay_ms=60_000))
    found = _credentials(_security())
    guesses = [asyncio.create_task(guard.verify(found, "alice", f"guess{i}", "10.6.6.6")) for i in range(5)]
    try:
        while guard.hashed_checks < 2:  # two checks run (then their refusals wait); three wait for a slot
            await asyncio.sleep(0.01)
            assert not any(g.done() for g in guesses)
        assert guard.pending("10.6.6.6") == 5
        # Another address logs in at once, through the same threads.
        assert await guard.verify(found, "alice", "secret", "10.0.0.1")
        assert guard.hashed_checks == 3  # the attacker's other three guesses were never checked
        assert not any(g.done() for g in guesses)
    finally:
        for guess in guesses:
            guess.cancel()
        await asyncio.gather(*guesses, return_exceptions=True)
        guard.close()
    assert guard.pending("10.6.6.6") == 0


def test_the_refusal_delay_doubles_up_to_its_cap() -> None:
    settings = LoginSection(failure_delay_ms=200, max_failure_delay_ms=1000)
    assert [failure_delay(n, settings) for n in range(1, 6)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert failure_delay(10_000, settings) == 1.0


async def test_failures_are_logged_once_per_window_and_address(caplog: pytest.LogCaptureFixture) -> None:
    guard = LoginGuard(LoginSection(failure_delay_ms=0, failure_window_ms=60_000))
    found = _credentials(_security("plain-password"))
    try:
        with caplog.at_level(logging.WARNING, logger="tridentmq.core"):
            for _ in range(10):
                assert not await guard.verify(found, "alice", "wrong", "10.6.6.6")
            assert not await guard.verify(found, "alice", "wrong", "10.7.7.7")
            assert guard.hashed_checks == 0  # a plain password needs no thread
            lines = [r for r in caplog.records if r.getMessage().startswith("link refused")]
            assert [r.__dict__["peer"] for r in lines] == ["10.6.6.6", "10.7.7.7"]
            caplog.clear()
            guard.tick(10**9)  # long after: the windows have ended
            summaries = {r.__dict__["peer"]: r.__dict__["failures"] for r in caplog.records}
            assert summaries == {"10.6.6.6": 10}  # the other address failed once: already said
    finally:
        guard.close()


def test_the_embedded_default_needs_no_password_check() -> None:
    security = SecurityManager([], [])
    assert isinstance(security.credentials("anyone", "127.0.0.1"), Principal)


async def test_an_unknown_user_costs_a_check_like_a_known_one() -> None:
    guard = LoginGuard(LoginSection(failure_delay_ms=0))
    unknown = _credentials(_security(), "mallory")
    try:
        assert unknown.hashed  # checked against a hash as costly as alice's: timing tells nothing
        assert not await guard.verify(unknown, "mallory", "secret", "10.0.0.1")
        assert guard.hashed_checks == 1
    finally:
        guard.close()


async def test_refusals_without_a_check_are_throttled_and_logged_per_gateway_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = LoginGuard(LoginSection(failure_delay_ms=0))
    try:
        with caplog.at_level(logging.WARNING, logger="tridentmq.core"):
            for client in ("10.1.1.1", "10.1.1.1", "10.2.2.2"):  # two clients behind one gateway
                await guard.refuse("127.0.0.1", None, "remote clients are refused", client)
        assert guard.failed == 3
        lines = [r for r in caplog.records if r.getMessage().startswith("link refused")]
        assert [(r.__dict__["peer"], r.__dict__["client_host"]) for r in lines] == [
            ("127.0.0.1", "10.1.1.1"),
            ("127.0.0.1", "10.2.2.2"),
        ]
    finally:
        guard.close()


async def test_a_check_that_outlives_its_login_still_fills_the_cache() -> None:
    # A login closed by the handshake timeout while its check runs: the client's retry finds the result.
    guard = LoginGuard(LoginSection())
    found = _credentials(_security(hash_password("secret", salt=b"slow", iterations=200_000)))
    try:
        login = asyncio.create_task(guard.verify(found, "alice", "secret", "10.0.0.1"))
        while guard.hashed_checks == 0:  # the check has been handed to a thread
            await asyncio.sleep(0.001)
            assert not login.done()
        login.cancel()
        while guard.cache_size() == 0:
            await asyncio.sleep(0.01)
            assert login.cancelled()
        assert guard.known_good(found, "alice", "secret")
    finally:
        guard.close()
