"""MQTT topics and filters ↔ core addresses and patterns: tables of round trips and refusals, checked against
the core's own router, and properties comparing MQTT's matching rules with the core's wildcards."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_core import router
from tridentmq_core.router import AddressTrie, pattern_matches, validate_address
from tridentmq_mqtt.convert import (
    MAX_ADDRESS_LENGTH,
    MAX_ADDRESS_WORDS,
    TOPIC_FILTER_INVALID,
    ConversionError,
    ParsedFilter,
    address_to_topic,
    delivers,
    filter_to_pattern,
    matches,
    parse_subscription,
    pattern_to_filter,
    shared_queue,
    subscription_queue,
    topic_to_address,
    validate_filter,
)
from tridentmq_mqtt.protocol.reason_codes import NOT_AUTHORIZED, TOPIC_NAME_INVALID


def mqtt_matches(topic_filter: str, topic: str) -> bool:
    """Reference: MQTT 5 section 4.7, written out level by level."""
    if topic.startswith("$") and topic_filter[0] in "+#":
        return False
    flevels, tlevels = topic_filter.split("/"), topic.split("/")
    for i, flevel in enumerate(flevels):
        if flevel == "#":
            return True  # the rest, zero levels included ('a/#' matches 'a')
        if i >= len(tlevels) or flevel not in ("+", tlevels[i]):
            return False
    return len(flevels) == len(tlevels)


def core_delivers(topic_filter: str, topic: str) -> bool:
    """What the gateway does: the core routes by pattern, then the gateway applies the '$' rule."""
    pattern, address = filter_to_pattern(topic_filter), topic_to_address(topic)
    routed = pattern_matches(pattern, address)
    trie: AddressTrie[int] = AddressTrie()
    trie.add(pattern, 1)
    # The broker's trie agrees with pattern_matches, except that routing never reaches a '$' address through
    # a leading wildcard (the core's own rule, which the gateway's '$' rule makes invisible here).
    system = address.startswith("$") and pattern.split(".")[0] != address.split(".")[0]
    assert (trie.match(address) == (1,)) == (routed and not system)
    return routed and delivers(topic_filter, topic)


# ---------------------------------------------------------------------------------------------- topics

# (topic, address)
TOPICS = [
    ("a", "a"),
    ("a/b/c", "a.b.c"),
    ("v1.0/x", "v1%2E0.x"),
    ("...", "%2E%2E%2E"),
    ("*", "%2A"),
    ("a*b/*", "a%2Ab.%2A"),
    ("100%", "100%25"),
    ("%", "%25"),
    ("%2E", "%252E"),
    ("%%/%25", "%25%25.%2525"),
    ("a//b", "a.%.b"),
    ("/a", "%.a"),
    ("a/", "a.%"),
    ("/", "%.%"),
    ("//", "%.%.%"),
    ("/%/", "%.%25.%"),
    ("$SYS/broker/load", "$SYS.broker.load"),
    ("urn:x:y", "urn:x:y"),
    ("a::b", "a%3A:b"),
    (":::", "%3A%3A:"),
    (":/:", ":.:"),
    ("salle 1/température", "salle 1.température"),
    ("日本/東京", "日本.東京"),
    ("🚀/x y", "🚀.x y"),
    ("a\tb", "a%09b"),
    ("\x01\x1f\x7f\x85\x9f", "%01%1F%7F%85%9F"),
    ("\xa0é", "\xa0é"),  # the first code point past C1 is kept
    ("tmp.c1.reply", "tmp%2Ec1%2Ereply"),
]


@pytest.mark.parametrize(("topic", "address"), TOPICS)
def test_topic_round_trip(topic: str, address: str) -> None:
    assert topic_to_address(topic) == address
    assert address_to_topic(address) == topic
    assert validate_address(address, allow_wildcards=False) == address
    assert "::" not in address


@pytest.mark.parametrize(
    ("topic", "message"),
    [
        ("", "must not be empty"),
        ("a/+", "contains '\\+'"),
        ("a/#", "contains '#'"),
        ("a+b", "contains '\\+'"),
        ("x\x00", "contains '\\\\x00'"),
        ("." * 86, "258-character address, the core's limit is 255"),
        ("/".join("x" * 33), "has 33 levels, the core's limit is 32"),
    ],
)
def test_invalid_topic(topic: str, message: str) -> None:
    with pytest.raises(ConversionError, match=message) as caught:
        topic_to_address(topic)
    assert caught.value.reason_code == TOPIC_NAME_INVALID


def test_topic_limits_are_the_cores() -> None:
    assert (MAX_ADDRESS_LENGTH, MAX_ADDRESS_WORDS) == (router.MAX_ADDRESS_LENGTH, router.MAX_ADDRESS_WORDS)
    assert len(topic_to_address("." * 85)) == 255
    assert topic_to_address("/".join("x" * 32)).count(".") == 31


@pytest.mark.parametrize(
    ("address", "topic"),
    [
        ("news.eu", "news/eu"),  # published by another protocol
        ("DLQ", "DLQ"),
        ("50%ab", "50%ab"),  # not an escape this module writes: kept
        ("a%2e", "a%2e"),  # lower case is not written either
        ("a%2", "a%2"),
        ("%2", "%2"),
        ("%.x", "/x"),
    ],
)
def test_foreign_address(address: str, topic: str) -> None:
    assert address_to_topic(address) == topic


@pytest.mark.parametrize("address", ["", "a.b+c", "+", "a.#"])
def test_address_without_topic(address: str) -> None:
    with pytest.raises(ConversionError):
        address_to_topic(address)


@pytest.mark.parametrize("topic", ["$mqtt", "$mqtt/retained", "$mqtt/lock/x", "$mqtt//a"])
def test_topics_under_the_gateways_own_level_are_refused_as_not_authorized(topic: str) -> None:
    with pytest.raises(ConversionError, match="reserved") as refused:
        topic_to_address(topic)
    assert refused.value.reason_code == NOT_AUTHORIZED


@pytest.mark.parametrize("topic", ["$mqttx/a", "a/$mqtt", "$MQTT/a", "mqtt/retained", "$mqtt%/a"])
def test_topics_that_only_look_like_the_gateways_own_are_clients(topic: str) -> None:
    assert not topic_to_address(topic).startswith("$mqtt.")


# ---------------------------------------------------------------------------------------------- filters

# (filter, pattern)
FILTERS = [
    ("a/b", "a.b"),
    ("+", "*"),
    ("#", "#"),
    ("a/+/c", "a.*.c"),
    ("a/#", "a.#"),
    ("+/+", "*.*"),
    ("+/#", "*.#"),
    ("/+", "%.*"),
    ("/#", "%.#"),
    ("a//#", "a.%.#"),
    ("/", "%.%"),
    ("v1.0/+", "v1%2E0.*"),
    ("*/x", "%2A.x"),
    ("a*/b%", "a%2A.b%25"),
    ("$SYS/#", "$SYS.#"),
    ("$share", "$share"),
    ("a::b/+", "a%3A:b.*"),
    ("日本/+/🚀", "日本.*.🚀"),
]


@pytest.mark.parametrize(("topic_filter", "pattern"), FILTERS)
def test_filter_to_pattern(topic_filter: str, pattern: str) -> None:
    assert filter_to_pattern(topic_filter) == pattern
    assert pattern_to_filter(pattern) == topic_filter
    assert validate_address(pattern, allow_wildcards=True) == pattern


@pytest.mark.parametrize(
    ("topic_filter", "message"),
    [
        ("", "must not be empty"),
        ("a/#/b", "'#' must be the whole of the last level"),
        ("#/a", "'#' must be the whole of the last level"),
        ("a#", "'#' must be the whole of the last level"),
        ("a/b#", "'#' must be the whole of the last level"),
        ("a/##", "'#' must be the whole of the last level"),
        ("a+", "'\\+' must be the whole of its level"),
        ("+a/b", "'\\+' must be the whole of its level"),
        ("a/++", "'\\+' must be the whole of its level"),
        ("a/+#", "'#' must be the whole of the last level"),
        ("\x00", "contains U\\+0000"),
        ("a/\x00/+", "contains U\\+0000"),
        ("/".join("+" * 33), "has 33 levels, the core's limit is 32"),
        ("*" * 90, "270-character address"),
    ],
)
def test_invalid_filter(topic_filter: str, message: str) -> None:
    with pytest.raises(ConversionError, match=message) as caught:
        filter_to_pattern(topic_filter)
    assert caught.value.reason_code == TOPIC_FILTER_INVALID


@pytest.mark.parametrize("topic_filter", ["$mqtt/#", "$mqtt/+/x", "$mqtt", "$mqtt/retained"])
def test_filters_under_the_gateways_own_level_are_refused_as_not_authorized(topic_filter: str) -> None:
    with pytest.raises(ConversionError, match="reserved") as refused:
        filter_to_pattern(topic_filter)
    assert refused.value.reason_code == NOT_AUTHORIZED


def test_validate_filter_returns_it() -> None:
    assert validate_filter("a/+/#") == "a/+/#"
    assert validate_filter("a.b*c") == "a.b*c"


def test_multi_level_wildcard_matches_the_parent_level() -> None:
    # The core's '#' matches zero words, so 'a.#' matches 'a': MQTT's 'a/#' matching 'a' needs nothing more.
    assert pattern_matches("a.#", "a")
    assert pattern_matches(filter_to_pattern("a/#"), topic_to_address("a"))
    assert core_delivers("a/#", "a")
    assert core_delivers("a/#", "a/")
    assert core_delivers("a/#", "a/b/c")
    assert core_delivers("a/+/#", "a/b")
    assert not core_delivers("a/#", "ab")
    assert not core_delivers("a/#", "b/a")
    assert not core_delivers("a/+/#", "a")


# (filter, topic, delivered)
MATCHES = [
    ("a/b", "a/b", True),
    ("a/+", "a/b", True),
    ("a/+", "a", False),
    ("a/+", "a/b/c", False),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+", "a", True),
    ("a/+/c", "a//c", True),
    ("v1.0/+", "v1.0/x", True),
    ("v1.0/+", "v1/0/x", False),
    ("v1/+", "v1.0/x", False),
    ("*", "a", False),  # '*' is no MQTT wildcard
    ("*", "*", True),
    ("#", "a/b", True),
    ("#", "/", True),
    # '$' topics: never matched by a filter starting with a wildcard
    ("#", "$SYS/broker", False),
    ("+/broker", "$SYS/broker", False),
    ("+/#", "$SYS", False),
    ("$SYS/#", "$SYS/broker", True),
    ("$SYS/+", "$SYS/broker", True),
    ("$SYS/#", "$SYS", True),
    ("a/#", "a/$b", True),  # only the first character of the topic counts
    ("#", "x$", True),
    ("/#", "/$x", True),
]


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), MATCHES)
def test_matching(topic_filter: str, topic: str, expected: bool) -> None:
    assert mqtt_matches(topic_filter, topic) is expected
    assert core_delivers(topic_filter, topic) is expected
    assert matches(topic_filter, topic) is expected


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("#", "$SYS/x", False),
        ("+", "$x", False),
        ("+/+", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("#", "a/b", True),
        ("+", "a", True),
        ("a/#", "$a", True),  # not wildcard-led: the router decides, and 'a.#' does not match '$a'
        ("#", "/$", True),
    ],
)
def test_delivers(topic_filter: str, topic: str, expected: bool) -> None:
    assert delivers(topic_filter, topic) is expected
    assert delivers(topic_filter, topic_to_address(topic)) is expected  # the address works as well


# ---------------------------------------------------------------------------------------------- shared


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("a/b", (None, "a/b")),
        ("#", (None, "#")),
        ("$share/g/a/b", ("g", "a/b")),
        ("$share/g/#", ("g", "#")),
        ("$share/g/+/x", ("g", "+/x")),
        ("$share/g//", ("g", "/")),
        ("$share/g/$SYS/#", ("g", "$SYS/#")),
        ("$share/$share/$share", ("$share", "$share")),
        ("$share/grüppe 1.*/x", ("grüppe 1.*", "x")),
        ("$share", (None, "$share")),
        ("$shared/g/x", (None, "$shared/g/x")),
        ("$SHARE/g/x", (None, "$SHARE/g/x")),
    ],
)
def test_parse_subscription(text: str, parsed: tuple[str | None, str]) -> None:
    result = parse_subscription(text)
    assert result == parsed
    assert isinstance(result, ParsedFilter)
    assert (result.group, result.topic_filter) == parsed


def test_parse_subscription_without_shared_subscriptions() -> None:
    assert parse_subscription("$share/g/a", shared=False) == (None, "$share/g/a")
    assert parse_subscription("$share//a", shared=False) == (None, "$share//a")
    with pytest.raises(ConversionError, match="last level"):
        parse_subscription("$share/g#/a", shared=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("$share//a", "empty share name"),
        ("$share/", "empty share name"),
        ("$share/g+/a", "must not contain '\\+' or '#'"),
        ("$share/+/a", "must not contain '\\+' or '#'"),
        ("$share/g#/a", "must not contain '\\+' or '#'"),
        ("$share/#", "must not contain '\\+' or '#'"),
        ("$share/g", "no topic filter after its share name"),
        ("$share/g/", "no topic filter after its share name"),
        ("$share/g/a/#/b", "'#' must be the whole of the last level"),
        ("$share/g/a+", "'\\+' must be the whole of its level"),
        ("", "must not be empty"),
        ("a/#/b", "'#' must be the whole of the last level"),
    ],
)
def test_invalid_subscription(text: str, message: str) -> None:
    with pytest.raises(ConversionError, match=message) as caught:
        parse_subscription(text)
    assert caught.value.reason_code == TOPIC_FILTER_INVALID


# ---------------------------------------------------------------------------------------------- queue names

PAIRS = [
    ("client-1", "a/b"),
    ("client-1", "a/+"),
    ("client-1", "a.b"),
    ("client-2", "a/b"),
    ("a", "bc"),
    ("ab", "c"),
    ("a.b", "c"),
    ("a", "b.c"),
    ("", "#"),
    ("", ""),
    ("c", "#"),
    ("c", "_"),  # '#' and '_' read the same, the hash keeps them apart
    ("x::y", "*/#"),
    ("日本 🚀", "\x01/\x85"),
    ("c" * 70000, "+/" * 1000 + "#"),
]


def test_queue_names_are_unique_and_valid() -> None:
    names = [subscription_queue(*pair) for pair in PAIRS] + [shared_queue(*pair) for pair in PAIRS]
    assert len(set(names)) == len(names)
    for name in names:
        assert validate_address(name, allow_wildcards=False) == name
        assert "::" not in name
        assert len(name) <= 206
    assert subscription_queue("client-1", "a/+") == subscription_queue("client-1", "a/+")  # stable
    name = subscription_queue("sensor-7", "home/+/temp")
    assert name.startswith("mqtt.sub.sensor-7.home/+/temp.")
    assert shared_queue("workers", "jobs/#").startswith("mqtt.shared.workers.jobs/_.")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.text(max_size=300))
def test_queue_name_property(owner: str, topic_filter: str) -> None:
    for name in (subscription_queue(owner, topic_filter), shared_queue(owner, topic_filter)):
        assert validate_address(name, allow_wildcards=False) == name
        assert "::" not in name


# ---------------------------------------------------------------------------------------------- properties

# Every character class the escaping cares about, plus ordinary and non-ASCII ones.
ALPHABET = st.sampled_from(list("ab.*:%$ /é\t\x7f\x85日🚀2EA"))
LEVEL_CHARS = st.sampled_from(list("a.*:%$ "))


@settings(max_examples=500, deadline=None)
@given(st.text(ALPHABET, min_size=1, max_size=60))
def test_topic_round_trip_property(topic: str) -> None:
    address = topic_to_address(topic)
    assert address_to_topic(address) == topic
    assert validate_address(address, allow_wildcards=False) == address
    assert "::" not in address
    assert address.count(".") == topic.count("/")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.text(ALPHABET.filter(lambda c: c != "/"), max_size=4), st.just("+")), min_size=1, max_size=6),
    st.booleans(),
)
def test_filter_round_trip_property(levels: list[str], multi: bool) -> None:
    topic_filter = "/".join([*levels, "#"] if multi else levels)
    if not topic_filter:
        return
    pattern = filter_to_pattern(topic_filter)
    assert pattern_to_filter(pattern) == topic_filter
    assert validate_address(pattern, allow_wildcards=True) == pattern


@st.composite
def topic_and_filter(draw: st.DrawFn) -> tuple[str, str]:
    """A topic, and a filter that is either unrelated or derived from it (so that matches are common)."""
    levels = draw(st.lists(st.text(LEVEL_CHARS, max_size=2), min_size=1, max_size=5))
    if levels == [""]:
        levels = ["a"]
    if draw(st.booleans()):
        flevels = draw(st.lists(st.one_of(st.text(LEVEL_CHARS, max_size=2), st.just("+")), min_size=1, max_size=5))
    else:
        flevels = [("+" if draw(st.integers(0, 3)) == 0 else level) for level in levels]
        if draw(st.booleans()):  # change one level
            i = draw(st.integers(0, len(flevels) - 1))
            flevels[i] = draw(st.text(LEVEL_CHARS, max_size=2))
        flevels = flevels[: draw(st.integers(0, len(flevels)))]
    if not flevels or draw(st.booleans()):
        flevels.append("#")
    if draw(st.integers(0, 5)) == 0:
        levels[0] = "$" + levels[0]
    topic_filter = "/".join(flevels)
    return "/".join(levels), (topic_filter or "#")


@settings(max_examples=1500, deadline=None)
@given(topic_and_filter())
def test_core_matching_equals_mqtt_matching(pair: tuple[str, str]) -> None:
    topic, topic_filter = pair
    assert core_delivers(topic_filter, topic) == mqtt_matches(topic_filter, topic) == matches(topic_filter, topic)
