"""Authentication and permission rules of the security manager (pure)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_core import security
from tridentmq_core.router import pattern_matches
from tridentmq_core.security import AuthenticationError, Permission, Principal, SecurityManager
from tridentmq_core.settings import PermissionEntry, UserEntry


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


def test_the_links_of_one_user_share_its_principal_and_permission_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    grants = [PermissionEntry("orders.#", "consume", ["app"])]
    users = SecurityManager([UserEntry("bob", "pw", ["app"]), UserEntry("eve", "pw", ["app"])], grants)
    bob = users.authenticate("bob", "pw", "127.0.0.1")
    assert bob.allowed(Permission.CONSUME, "orders.eu")
    assert users.authenticate("bob", "pw", "127.0.0.1") is bob  # a second link of bob's: decided already
    assert users.principal_of("bob") is bob  # a gateway vouching for bob's certificate
    assert users.authenticate("eve", "pw", "127.0.0.1") is not bob
    with pytest.raises(AuthenticationError):
        users.authenticate("bob", "wrong", "127.0.0.1")
    # Under the embedded default any name comes in: the table of them is bounded.
    monkeypatch.setattr(security, "MAX_SHARED_PRINCIPALS", 3)
    anyone = SecurityManager([], [])
    first = anyone.authenticate("device-0", None, "127.0.0.1")
    assert anyone.authenticate("device-0", None, "127.0.0.1") is first
    names = [anyone.authenticate(f"device-{i}", None, "127.0.0.1").name for i in range(10)]
    assert names == [f"device-{i}" for i in range(10)]
    assert len(anyone._principals) <= 3


# ----------------------------------------------------------------------------------------------- permissions

WORDS = ("a", "b", "c")  # few words, so that random patterns overlap often


def principal(*rules: tuple[str, bool]) -> Principal:
    """A user holding ``consume`` by these (pattern, deny) rules."""
    grants = [PermissionEntry(match, "consume", ["r"], deny) for match, deny in rules]
    return SecurityManager([UserEntry("u", "p", ["r"])], grants).authenticate("u", "p", "127.0.0.1")


@pytest.mark.parametrize(
    ("rules", "address_filter", "allowed"),
    [
        ([("sensors.*", False)], "sensors.#", False),  # issue 22: '*' must not match the word '#'
        ([("sensors.*", False)], "sensors.*", True),
        ([("sensors.*", False)], "sensors.+", True),  # a plain word here (MQTT maps "+" to "*")
        ([("sensors.*", False)], "sensors.*.*", False),
        ([("sensors.*", False)], "#", False),
        ([("sensors.#", False)], "sensors.*.*", True),
        ([("sensors.#", False)], "sensors.#", True),
        ([("sensors.#", False)], "*.#", False),
        ([("#", False)], "#", True),
        ([("a", False), ("a.*", False), ("a.*.#", False)], "a.#", True),  # covered by the rules together only
        ([("a.*", False), ("a.*.#", False)], "a.#", False),  # 'a' itself is not covered
        ([("test.#", False), ("test.nosubscribe", True)], "test.#", False),  # a deny inside wins
        ([("test.#", False), ("test.nosubscribe", True)], "test.*", False),
        ([("test.#", False), ("test.nosubscribe", True)], "test.other.#", True),
        ([("test.#", False), ("test.*.x", True)], "test.a.*", False),
        ([("#", False), ("#", True)], "a.*", False),
    ],
)
def test_a_filter_is_allowed_only_if_every_address_it_matches_is(
    rules: list[tuple[str, bool]], address_filter: str, allowed: bool
) -> None:
    user = principal(*rules)
    assert user.allowed(Permission.CONSUME, address_filter) is allowed
    witness = user.refused_address(Permission.CONSUME, address_filter)
    assert (witness is None) is allowed
    if witness is not None:
        assert pattern_matches(address_filter, witness)
        assert not user.allowed(Permission.CONSUME, witness)


def test_a_deny_rule_wins_over_a_more_specific_grant() -> None:
    user = principal(("test.nosubscribe", False), ("test.#", True))
    assert not user.allowed(Permission.CONSUME, "test.nosubscribe")
    assert not user.allowed(Permission.CONSUME, "test.other")


def test_plain_addresses_are_matched_as_before() -> None:
    user = principal(("orders.*", False), ("orders.secret", True))
    assert user.allowed(Permission.CONSUME, "orders.eu")
    assert not user.allowed(Permission.CONSUME, "orders.secret")
    assert not user.allowed(Permission.CONSUME, "orders.eu.x")
    assert not user.allowed(Permission.SEND, "orders.eu")  # another permission


def test_rules_of_other_roles_do_not_count() -> None:
    grants = [
        PermissionEntry("#", "consume", ["admin"]),
        PermissionEntry("a.#", "consume", ["r"]),
        PermissionEntry("a.b", "consume", ["other"], deny=True),
    ]
    user = SecurityManager([UserEntry("u", "p", ["r"])], grants).authenticate("u", "p", "127.0.0.1")
    assert user.allowed(Permission.CONSUME, "a.#")
    assert not user.allowed(Permission.CONSUME, "b.#")


word = st.sampled_from(WORDS)
pattern_word = st.sampled_from((*WORDS, "*", "#"))
patterns = st.lists(pattern_word, min_size=1, max_size=4).map(".".join)
addresses = st.lists(word, min_size=1, max_size=6).map(".".join)
rule_sets = st.lists(st.tuples(patterns, st.booleans()), max_size=4)


def _instances(address_filter: str, choose: st.DataObject) -> str:
    """An address ``address_filter`` matches, its wildcards filled in at random."""
    out: list[str] = []
    for w in address_filter.split("."):
        if w == "*":
            out.append(choose.draw(word))
        elif w == "#":
            out.extend(choose.draw(st.lists(word, max_size=3)))
        else:
            out.append(w)
    return ".".join(out) if out else choose.draw(word)  # '#' alone: any address


@given(rules=rule_sets, address_filter=patterns, choose=st.data())
@settings(max_examples=400, deadline=None)
def test_an_allowed_filter_reaches_only_allowed_addresses(
    rules: list[tuple[str, bool]], address_filter: str, choose: st.DataObject
) -> None:
    user = principal(*rules)
    if user.allowed(Permission.CONSUME, address_filter):
        for _ in range(10):
            address = _instances(address_filter, choose)
            if pattern_matches(address_filter, address):
                assert user.allowed(Permission.CONSUME, address), address


@given(rules=rule_sets, address_filter=patterns)
@settings(max_examples=400, deadline=None)
def test_the_decision_agrees_with_every_short_address(rules: list[tuple[str, bool]], address_filter: str) -> None:
    """Brute force over every address of up to 5 words (over the pattern words and one other): a filter that
    matches a refused one is refused. A refusal names an address the filter matches and the rules refuse, of
    any length (``#.b.a.a`` under a refused ``a.a.a.#`` is refused for ``a.a.a.b.a.a``, six words)."""
    user = principal(*rules)
    short = [".".join(ws) for n in range(1, 6) for ws in itertools.product((*WORDS, "z"), repeat=n)]
    refused = [a for a in short if pattern_matches(address_filter, a) and not user.allowed(Permission.CONSUME, a)]
    allowed = user.allowed(Permission.CONSUME, address_filter)
    witness = user.refused_address(Permission.CONSUME, address_filter)
    if refused:
        assert not allowed
    if allowed:
        assert witness is None
    else:
        assert witness is not None
        assert pattern_matches(address_filter, witness)
        assert not user.allowed(Permission.CONSUME, witness)


def test_rules_that_share_no_address_with_the_filter_cost_nothing() -> None:
    rules = [(f"orders.region{i}.*", False) for i in range(2000)] + [("sensors.#", False), ("sensors.x", True)]
    user = principal(*rules)
    assert user.allowed(Permission.CONSUME, "sensors.a.#")
    assert user.refused_address(Permission.CONSUME, "sensors.*") == "sensors.x"


def test_a_filter_too_costly_to_decide_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(security, "MAX_FILTER_WORK", 10)
    user = principal(("a.#", False), ("a.*.b", False), ("a.*.*.c", False))
    assert user.refused_address(Permission.CONSUME, "a.#") == "a.#"
