"""Tests for the address trie and the wildcard matching helpers."""

from __future__ import annotations

import re
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_core.router import (
    AddressTrie,
    InvalidAddress,
    is_wildcard,
    pattern_matches,
    validate_address,
)


def reference_regex(pattern: str) -> re.Pattern[str]:
    """Translate a pattern to a regex over '.'-prefixed words ('a.b' is matched as '.a.b')."""
    parts = []
    for word in pattern.split("."):
        if word == "#":
            parts.append(r"(?:\.[^.]+)*")
        elif word == "*":
            parts.append(r"\.[^.]+")
        else:
            parts.append(re.escape("." + word))
    return re.compile("".join(parts))


def regex_matches(pattern: str, address: str) -> bool:
    return reference_regex(pattern).fullmatch("." + address) is not None


# (pattern, address, expected)
MATCH_CASES = [
    ("a.b.c", "a.b.c", True),
    ("a.b.c", "a.b", False),
    ("a.b", "a.b.c", False),
    ("a.b.c", "a.b.d", False),
    ("a.#", "a", True),
    ("a.#", "a.b", True),
    ("a.#", "a.b.c", True),
    ("a.#", "b", False),
    ("a.#", "ab.c", False),
    ("#", "a", True),
    ("#", "a.b.c.d", True),
    ("*", "a", True),
    ("*", "a.b", False),
    ("a.*.c", "a.b.c", True),
    ("a.*.c", "a.c", False),
    ("a.*.c", "a.b.b.c", False),
    ("a.#.c", "a.c", True),
    ("a.#.c", "a.b.c", True),
    ("a.#.c", "a.b.d.c", True),
    ("a.#.c", "a.b.d", False),
    ("#.c", "c", True),
    ("#.c", "a.b.c", True),
    ("#.c", "a.c.d", False),
    ("#.b.#", "b", True),
    ("#.b.#", "a.b.c", True),
    ("#.b.#", "a.c", False),
    ("#.#", "a", True),
    ("#.#", "a.b.c", True),
    ("a.#.b.#.c", "a.b.c", True),
    ("a.#.b.#.c", "a.x.b.y.z.c", True),
    ("a.#.b.#.c", "a.c", False),
    ("a.#.b.#.c", "a.x.c", False),
    ("#.*", "a", True),
    ("#.*", "a.b", True),
    ("*.#", "a.b.c", True),
    ("*.*", "a", False),
    ("*.#.*", "a", False),
    ("*.#.*", "a.b", True),
    ("*.#.*", "a.b.c.d", True),
    ("#.a.*.#", "x.a.y", True),
    ("#.a.*.#", "x.a", False),
    ("orders.eu.created", "orders.eu.created", True),
    ("orders.*.created", "orders.us.created", True),
    ("orders.#", "orders.eu.created", True),
]


@pytest.mark.parametrize(("pattern", "address", "expected"), MATCH_CASES)
def test_pattern_matches_table(pattern: str, address: str, expected: bool) -> None:
    assert pattern_matches(pattern, address) is expected
    assert regex_matches(pattern, address) is expected  # keeps the reference honest


@pytest.mark.parametrize(("pattern", "address", "expected"), MATCH_CASES)
def test_trie_match_table(pattern: str, address: str, expected: bool) -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add(pattern, "v")
    assert trie.match(address) == (("v",) if expected else ())


def test_trie_match_all_cases_in_one_trie() -> None:
    trie: AddressTrie[int] = AddressTrie()
    patterns = list(dict.fromkeys(p for p, _, _ in MATCH_CASES))
    for i, pattern in enumerate(patterns):
        trie.add(pattern, i)
    for _, address, _ in MATCH_CASES:
        expected = tuple(i for i, p in enumerate(patterns) if pattern_matches(p, address))
        assert trie.match(address) == expected


def test_many_hashes_do_not_blow_up() -> None:
    # Naive backtracking over 30 '#' against 32 words would run for ages.
    pattern = ".".join(["#"] * 30 + ["b"])
    miss = ".".join(["a"] * 32)
    hit = ".".join(["a"] * 31 + ["b"])
    trie: AddressTrie[str] = AddressTrie()
    trie.add(pattern, "v")
    assert trie.match(miss) == ()
    assert trie.match(hit) == ("v",)
    assert not pattern_matches(pattern, miss)
    assert pattern_matches(pattern, hit)


def test_match_order_is_binding_order_and_values_are_unique() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.#", "first")
    trie.add("a.b", "second")
    trie.add("#", "third")
    trie.add("a.*", "first")  # same value under a second matching pattern
    trie.add("x.y", "unrelated")
    assert trie.match("a.b") == ("first", "second", "third")
    # Dropping the earliest binding of "first" moves it to its later binding's position.
    assert trie.remove("a.#", "first")
    assert trie.match("a.b") == ("second", "third", "first")


def test_same_pattern_values_in_insertion_order() -> None:
    trie: AddressTrie[int] = AddressTrie()
    for v in (3, 1, 2):
        trie.add("q", v)
    assert trie.match("q") == (3, 1, 2)
    trie.remove("q", 3)
    trie.add("q", 3)
    assert trie.match("q") == (1, 2, 3)


def test_add_is_idempotent() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.b", "v")
    trie.add("a.b", "w")
    trie.add("a.b", "v")
    assert len(trie) == 2
    assert trie.match("a.b") == ("v", "w")
    assert trie.patterns() == ["a.b"]


def test_remove() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.*", "v")
    trie.add("a.*", "w")
    assert trie.remove("a.*", "v") is True
    assert trie.remove("a.*", "v") is False
    assert trie.remove("a.b", "w") is False  # never bound to that pattern
    assert trie.remove("nope", "w") is False
    assert trie.remove("a..b", "w") is False  # an invalid pattern simply is not there
    assert len(trie) == 1
    assert trie.match("a.b") == ("w",)
    assert trie.remove("a.*", "w") is True
    assert len(trie) == 0
    assert trie.match("a.b") == ()
    assert trie.patterns() == []


def test_patterns_and_len() -> None:
    trie: AddressTrie[int] = AddressTrie()
    assert len(trie) == 0
    trie.add("b.#", 1)
    trie.add("a", 2)
    trie.add("b.#", 3)
    assert trie.patterns() == ["b.#", "a"]
    assert len(trie) == 3
    trie.remove("b.#", 1)
    assert trie.patterns() == ["b.#", "a"]
    trie.remove("b.#", 3)
    assert trie.patterns() == ["a"]


def test_remove_prunes_empty_nodes() -> None:
    trie: AddressTrie[str] = AddressTrie()
    root = trie._root
    trie.add("a.b.*", "v")
    trie.add("a.*.#", "w")
    trie.add("a.#", "x")
    trie.remove("a.b.*", "v")
    node_a = root.children["a"]
    assert "b" not in node_a.children
    assert node_a.star is not None
    trie.remove("a.*.#", "w")
    assert trie._root.children["a"].star is None
    assert node_a.hash is not None
    assert node_a.hash.values  # "a.#" still carries "x", so it stays
    trie.remove("a.#", "x")
    assert root.is_empty()


def test_prune_keeps_nodes_with_children() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.*", "v")
    trie.add("a.*.c", "w")
    trie.remove("a.*", "v")
    assert trie.match("a.b.c") == ("w",)
    star = trie._root.children["a"].star
    assert star is not None
    assert "c" in star.children
    trie.remove("a.*.c", "w")
    assert trie._root.is_empty()


def test_literal_patterns_are_no_trie_nodes_and_keep_the_binding_order_with_wildcard_ones() -> None:
    trie: AddressTrie[str] = AddressTrie(cache_size=0)
    trie.add("devices.d1", "own")
    trie.add("$mqtt.lock.d1", "lock")
    assert trie._root.is_empty()  # a dict look-up finds them
    assert (trie.match("devices.d1"), trie.match("$mqtt.lock.d1"), trie.match("devices.d2")) == (
        ("own",),
        ("lock",),
        (),
    )
    trie.add("devices.*", "all")
    trie.add("devices.d1", "later")
    assert trie.match("devices.d1") == ("own", "all", "later")
    trie.add("devices.*", "own")  # the same value under two patterns: once, at its first binding
    assert trie.match("devices.d1") == ("own", "all", "later")
    trie.remove("devices.*", "all")
    trie.remove("devices.*", "own")
    assert trie._root.is_empty()
    assert trie.match("devices.d1") == ("own", "later")
    assert trie.patterns() == ["devices.d1", "$mqtt.lock.d1"]


def test_a_literal_pattern_bound_once_holds_its_pair_and_becomes_a_table_with_a_second_value() -> None:
    trie: AddressTrie[str] = AddressTrie(cache_size=0)
    trie.add("devices.d1", "own")
    trie.add("devices.d1", "own")  # the same pair again: nothing
    assert (len(trie), trie.match("devices.d1")) == (1, ("own",))
    assert not trie.remove("devices.d1", "other")
    assert not trie.remove("devices.d2", "own")
    trie.add("devices.d1", "second")
    assert (len(trie), trie.match("devices.d1")) == (2, ("own", "second"))
    assert trie.remove("devices.d1", "own")
    assert trie.match("devices.d1") == ("second",)
    assert trie.remove("devices.d1", "second")
    assert (len(trie), trie.match("devices.d1"), trie.patterns()) == (0, (), [])
    trie.add("devices.d1", "again")
    assert trie.match("devices.d1") == ("again",)


def test_a_literal_binding_costs_a_pair_not_a_table() -> None:
    """100,000 devices bring two literal patterns each: a dict of one binding would take 232 bytes."""
    trie: AddressTrie[object] = AddressTrie(cache_size=0)
    patterns = [f"devices.d{i}" for i in range(2000)]
    values = [object() for _ in patterns]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for pattern, value in zip(patterns, values, strict=True):
            trie.add(pattern, value)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown / len(patterns) < 150  # the pair (56), its sequence number (32) and the table's slot


def test_cache_invalidated_on_add() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.b", "v")
    assert trie.match("a.b") == ("v",)
    assert trie.match("x") == ()
    trie.add("a.#", "w")
    trie.add("x", "y")
    assert trie.match("a.b") == ("v", "w")
    assert trie.match("x") == ("y",)


def test_cache_invalidated_on_remove() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.b", "v")
    trie.add("#", "w")
    assert trie.match("a.b") == ("v", "w")
    trie.remove("#", "w")
    assert trie.match("a.b") == ("v",)


def test_cache_hit_returns_same_result() -> None:
    trie: AddressTrie[str] = AddressTrie()
    trie.add("a.*", "v")
    first = trie.match("a.b")
    assert trie.match("a.b") is first
    assert "a.b" in trie._cache


def test_cache_is_bounded() -> None:
    trie: AddressTrie[str] = AddressTrie(cache_size=8)
    trie.add("#", "v")
    for i in range(100):
        assert trie.match(f"addr.{i}") == ("v",)
        assert len(trie._cache) <= 8
    assert trie._cache  # still caching after evictions


def test_cache_size_zero_disables_cache() -> None:
    trie: AddressTrie[str] = AddressTrie(cache_size=0)
    trie.add("a", "v")
    assert trie.match("a") == ("v",)
    assert trie._cache == {}


def test_negative_cache_size_rejected() -> None:
    with pytest.raises(ValueError, match="cache_size"):
        AddressTrie(cache_size=-1)


def test_add_validates_pattern() -> None:
    trie: AddressTrie[str] = AddressTrie()
    with pytest.raises(InvalidAddress):
        trie.add("a..b", "v")
    with pytest.raises(InvalidAddress):
        trie.add("a*", "v")
    assert len(trie) == 0
    assert trie.patterns() == []


@pytest.mark.parametrize("address", ["", "a..b", ".a", "a.", "*", "#", "a.*.#", "\x00"])
def test_match_with_odd_addresses_does_not_crash(address: str) -> None:
    trie: AddressTrie[str] = AddressTrie()
    for pattern in ("#", "a.*", "a.#.b", "*.*"):
        trie.add(pattern, pattern)
    result = trie.match(address)
    assert isinstance(result, tuple)
    assert "#" in result


def test_match_agrees_with_pattern_matches_for_wildcard_addresses() -> None:
    trie: AddressTrie[str] = AddressTrie()
    patterns = ["#", "a.*", "a.#.b", "*.*", "a.b", "*", "a.#"]
    for pattern in patterns:
        trie.add(pattern, pattern)
    for address in ("a.*", "a.#", "*.b", "#", "*", "a.#.b"):
        assert trie.match(address) == tuple(p for p in patterns if pattern_matches(p, address))


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("a.b", False),
        ("a.*", True),
        ("#", True),
        ("a.#.b", True),
        ("a*", False),
        ("a.b#", False),
        ("", False),
    ],
)
def test_is_wildcard(address: str, expected: bool) -> None:
    assert is_wildcard(address) is expected


# (address, allow_wildcards)
VALID = [
    ("a", False),
    ("orders.eu.created", False),
    ("with space.and-dash_underscore", False),
    ("ünïcödé.名前", False),
    ("x" * 255, False),
    (".".join(["w"] * 32), False),
    ("a.*", True),
    ("#", True),
    ("a.#.b.#", True),
    ("*.*.*", True),
]

# (address, allow_wildcards, fragment of the message)
INVALID = [
    ("", True, "empty"),
    ("a..b", True, "empty word"),
    (".a", True, "empty word"),
    ("a.", True, "empty word"),
    (".", True, "empty word"),
    ("a*", True, "mixing"),
    ("a.#b", True, "mixing"),
    ("a.b*c", True, "mixing"),
    ("**", True, "mixing"),
    ("*#", True, "mixing"),
    ("a.*", False, "wildcard"),
    ("#", False, "wildcard"),
    ("x" * 256, True, "limit is 255"),
    (".".join(["w"] * 33), True, "33 words"),
    ("a\nb", True, "control character"),
    ("a\x00", True, "control character"),
    ("a\x7f", True, "control character"),
    ("a\x85b", True, "control character"),
    ("a\tb", True, "control character"),
]


@pytest.mark.parametrize(("address", "allow_wildcards"), VALID)
def test_validate_address_accepts(address: str, allow_wildcards: bool) -> None:
    assert validate_address(address, allow_wildcards=allow_wildcards) is address


@pytest.mark.parametrize(("address", "allow_wildcards", "fragment"), INVALID)
def test_validate_address_rejects(address: str, allow_wildcards: bool, fragment: str) -> None:
    with pytest.raises(InvalidAddress, match=re.escape(fragment)):
        validate_address(address, allow_wildcards=allow_wildcards)


def test_invalid_address_is_value_error() -> None:
    assert issubclass(InvalidAddress, ValueError)


# ---------------------------------------------------------------- properties

CONCRETE_WORDS = st.sampled_from(["a", "b", "c"])
PATTERN_WORDS = st.sampled_from(["a", "b", "c", "*", "#"])
addresses = st.lists(CONCRETE_WORDS, min_size=1, max_size=7).map(".".join)
patterns = st.lists(PATTERN_WORDS, min_size=1, max_size=6).map(".".join)


@given(pattern=patterns, address=addresses)
def test_pattern_matches_agrees_with_regex(pattern: str, address: str) -> None:
    assert pattern_matches(pattern, address) == regex_matches(pattern, address)


@settings(max_examples=300)
@given(
    bound=st.lists(patterns, min_size=1, max_size=15),
    probes=st.lists(addresses, min_size=1, max_size=10),
)
def test_trie_agrees_with_pattern_matches_and_regex(bound: list[str], probes: list[str]) -> None:
    trie: AddressTrie[int] = AddressTrie()
    for i, pattern in enumerate(bound):
        trie.add(pattern, i)
    for address in probes:
        expected = tuple(i for i, p in enumerate(bound) if pattern_matches(p, address))
        assert expected == tuple(i for i, p in enumerate(bound) if regex_matches(p, address))
        assert trie.match(address) == expected
        assert trie.match(address) == expected  # from the cache this time


@settings(max_examples=200)
@given(
    bound=st.lists(st.tuples(patterns, st.integers(0, 3)), min_size=1, max_size=12),
    removals=st.lists(st.integers(0, 11), max_size=8),
    probes=st.lists(addresses, min_size=1, max_size=6),
)
def test_trie_after_removals_matches_model(
    bound: list[tuple[str, int]], removals: list[int], probes: list[str]
) -> None:
    """A dict of live bindings in insertion order is the model; values may repeat across patterns."""
    trie: AddressTrie[int] = AddressTrie(cache_size=4)
    model: dict[tuple[str, int], None] = {}
    for pattern, value in bound:
        trie.add(pattern, value)
        model.setdefault((pattern, value), None)
    for address in probes:
        trie.match(address)  # warm the cache so removals must invalidate it
    for index in removals:
        if index < len(bound):
            key = bound[index]
            assert trie.remove(*key) == (key in model)
            model.pop(key, None)
    assert len(trie) == len(model)
    # patterns() keeps the order in which each surviving pattern was first bound.
    live = {p for p, _ in model}
    assert trie.patterns() == [p for p in dict.fromkeys(p for p, _ in bound) if p in live]
    for address in probes:
        expected = tuple(dict.fromkeys(v for p, v in model if pattern_matches(p, address)))
        assert trie.match(address) == expected
    for key in list(model):
        trie.remove(*key)
    assert trie._root.is_empty()


def test_leading_wildcards_do_not_reach_the_brokers_own_addresses() -> None:
    trie: AddressTrie[str] = AddressTrie()
    for pattern in ("#", "*.retained", "$mqtt.#", "$mqtt.retained", "a.#"):
        trie.add(pattern, pattern)
    assert trie.match("$mqtt.retained") == ("$mqtt.#", "$mqtt.retained")
    assert trie.match("$sys") == ()
    assert trie.match("a.$b") == ("#", "a.#")  # only a first word is special
