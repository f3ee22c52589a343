"""MQTT topics and topic filters ↔ core addresses and patterns, and the names of subscription queues (pure).

**Levels and words.** An MQTT topic is levels separated by ``/``; a core address is words separated by ``.``.
Each level becomes exactly one word (``a/b/c`` ↔ ``a.b.c``), so in filters ``+`` becomes ``*`` (one word) and
``#`` stays ``#`` (any number of words, zero included: the core's ``a.#`` matches ``a``, just as MQTT's
``a/#`` matches ``a``).

**Escaping.** A level may hold characters the core gives a meaning to, and may be empty; neither is allowed
in a core word. Inside a level these are written ``%XX`` (``XX`` the code point in upper-case hex):

=====================================  ==========================================
in a level                             in the word
=====================================  ==========================================
``%``                                  ``%25``
``.`` (the core's delimiter)           ``%2E``
``*`` (a core wildcard)                ``%2A``
``:`` directly followed by ``:``       ``%3A`` (an address never holds ``::``, the FQQN separator)
U+0001 to U+001F, U+007F to U+009F     ``%01`` to ``%1F``, ``%7F`` to ``%9F`` (no control characters in the core)
the empty level (``a//b``, ``/a``)     the word ``%`` alone
=====================================  ==========================================

Everything else (``$``, spaces, any other Unicode) is kept as it is. MQTT forbids ``+``,
``#`` and U+0000 in topic names (and anywhere but as a whole level in filters), so they are refused, never
escaped. :func:`address_to_topic` decodes exactly the escapes above, so it inverts :func:`topic_to_address`
exactly. An address written by another protocol maps to the topic it spells unless it holds one of these
escapes (``50%2E`` reads as ``50.``); one that spells no valid MQTT topic name (it holds ``+``) is refused.

**``$`` topics.** A filter starting with a wildcard must not match a topic starting with ``$`` (MQTT 4.7.2).
The core's ``#`` and ``*`` do match ``$SYS``, so the gateway asks :func:`delivers` before each delivery.
``$`` is never escaped, so the test may be made on the address as well as on the topic.

**``$mqtt`` topics** are the gateway's own (its retained store, session records, locks and outboxes): a client's
topic name or filter whose first level is ``$mqtt`` is refused as not authorized (0x87).

**Subscription queues.** :func:`subscription_queue` and :func:`shared_queue` name the core queue of a
subscription: ``mqtt.sub.<client id>.<filter>.<hash>`` and ``mqtt.shared.<group>.<filter>.<hash>``
(:func:`fanout_queue` names a gateway's QoS 0 fan-out queues, :func:`session_queue` and :func:`lock_queue` a
client's session queues, :func:`outbox_queue` its outbox, the same way). The middle words are only there to be
read by people: shortened, with every character that is not safe in a core word replaced by ``_``. The last
word, 32 hex digits of the SHA-256 of the length-prefixed inputs, makes the name unique per (client id, filter)
or (group, filter). Names are at most 206 characters, hold no ``::`` and are valid core addresses without
wildcards, so the core accepts them wherever it takes a name.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from tridentmq_mqtt.protocol.reason_codes import NOT_AUTHORIZED, TOPIC_FILTER_INVALID, TOPIC_NAME_INVALID
from tridentmq_shared import mqtt_queues, names

LEVEL_SEPARATOR: Final = "/"
SINGLE_LEVEL: Final = "+"
MULTI_LEVEL: Final = "#"
SHARE_PREFIX: Final = "$share/"
#: The core's delimiter and wildcards (``tridentmq_core.router``; services do not import each other).
DELIMITER: Final = "."
ANY_WORD: Final = "*"
ANY_WORDS: Final = "#"
#: The core's address limits: the rules of every name (``tridentmq_shared.names``).
MAX_ADDRESS_LENGTH: Final = names.MAX_NAME_LENGTH
MAX_ADDRESS_WORDS: Final = names.MAX_ADDRESS_WORDS
ESCAPE: Final = "%"
#: The word that stands for an empty level.
EMPTY_LEVEL: Final = ESCAPE

#: The core queues of MQTT state are named in the shared library (the core finds sessions by them too).
SUBSCRIPTION_PREFIX: Final = mqtt_queues.SUBSCRIPTION_PREFIX
SHARED_PREFIX: Final = mqtt_queues.SHARED_PREFIX
FANOUT_PREFIX: Final = mqtt_queues.FANOUT_PREFIX
SESSION_PREFIX: Final = mqtt_queues.SESSION_PREFIX
LOCK_PREFIX: Final = mqtt_queues.LOCK_PREFIX
RETAINED_ADDRESS: Final = mqtt_queues.RETAINED_ADDRESS
#: The topic level of the gateway's own addresses (``mqtt_queues.RESERVED_WORD``, never escaped).
RESERVED_LEVEL: Final = mqtt_queues.RESERVED_WORD
queue_name = mqtt_queues.queue_name
subscription_queue = mqtt_queues.subscription_queue
session_queue = mqtt_queues.session_queue
lock_queue = mqtt_queues.lock_queue
OUTBOX_PREFIX: Final = mqtt_queues.OUTBOX_PREFIX
outbox_queue = mqtt_queues.outbox_queue
retained_queue = mqtt_queues.retained_queue

_CONTROL: Final = frozenset(chr(c) for c in (*range(0x01, 0x20), *range(0x7F, 0xA0)))
_ALWAYS_ESCAPED: Final = frozenset({ESCAPE, DELIMITER, ANY_WORD}) | _CONTROL
#: Characters a level may hold that force the slow path of _escape (':' only matters when doubled).
_SPECIAL: Final = _ALWAYS_ESCAPED | {":"}
#: escape → character, for exactly the escapes _escape writes.
_UNESCAPE: Final = {f"{ESCAPE}{ord(c):02X}": c for c in (*_ALWAYS_ESCAPED, ":")}
_FORBIDDEN_IN_TOPIC: Final = (SINGLE_LEVEL, MULTI_LEVEL, "\x00")


class ConversionError(ValueError):
    """A topic, filter or address that has no counterpart on the other side; ``reason_code`` is the MQTT 5
    reason code to answer with (0x90 for topic names, 0x8F for filters)."""

    def __init__(self, message: str, reason_code: int = TOPIC_NAME_INVALID) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class ParsedFilter(NamedTuple):
    """A SUBSCRIBE's filter text split into its shared-subscription group (None: not shared) and filter."""

    group: str | None
    topic_filter: str


# ---------------------------------------------------------------------------------------------- topics


def topic_to_address(topic: str) -> str:
    """The core address of an MQTT topic name: ``a/b`` → ``a.b``, with levels escaped (see the module)."""
    if not topic:
        raise ConversionError("a topic name must not be empty")
    for char in _FORBIDDEN_IN_TOPIC:
        if char in topic:
            raise ConversionError(f"topic name {_show(topic)} contains {char!r}, which MQTT forbids in topic names")
    _refuse_reserved(topic, "topic name")
    return _checked(DELIMITER.join(_escape(level) for level in topic.split(LEVEL_SEPARATOR)), topic)


def is_topic_name(text: str) -> bool:
    """Whether ``text`` may name a topic in a PUBLISH: not empty, no wildcard, no U+0000."""
    return bool(text) and not any(char in text for char in _FORBIDDEN_IN_TOPIC)


def _refuse_reserved(text: str, what: str) -> None:
    """Refuse a client's topic or filter under ``$mqtt``: the gateway keeps its clients' retained messages,
    session records, locks and outboxes there. A client with rights on them (every client, with no users
    configured) could otherwise poison the retained store, read others' sessions or take their sessions over."""
    if text.startswith(RESERVED_LEVEL) and text.partition(LEVEL_SEPARATOR)[0] == RESERVED_LEVEL:
        raise ConversionError(f"{what} {_show(text)} is reserved for the broker's own use", NOT_AUTHORIZED)


def address_to_topic(address: str) -> str:
    """The MQTT topic name of a core address; the exact inverse of :func:`topic_to_address`."""
    if not address:
        raise ConversionError("an empty address has no topic name")
    topic = LEVEL_SEPARATOR.join(_unescape(word) for word in address.split(DELIMITER))
    for char in _FORBIDDEN_IN_TOPIC:
        if char in topic:
            raise ConversionError(f"address {_show(address)} is no MQTT topic name: it holds {char!r}")
    return topic


# ---------------------------------------------------------------------------------------------- filters


def validate_filter(topic_filter: str) -> str:
    """Return ``topic_filter`` unchanged, or raise :class:`ConversionError` saying which MQTT rule it breaks:
    not empty, no U+0000, ``#`` alone in the last level, ``+`` alone in its level."""
    if not topic_filter:
        raise ConversionError("a topic filter must not be empty", TOPIC_FILTER_INVALID)
    if "\x00" in topic_filter:
        raise ConversionError(f"topic filter {_show(topic_filter)} contains U+0000", TOPIC_FILTER_INVALID)
    if SINGLE_LEVEL not in topic_filter and MULTI_LEVEL not in topic_filter:
        return topic_filter
    levels = topic_filter.split(LEVEL_SEPARATOR)
    last = len(levels) - 1
    for position, level in enumerate(levels):
        if MULTI_LEVEL in level and (level != MULTI_LEVEL or position != last):
            raise ConversionError(
                f"topic filter {_show(topic_filter)}: '#' must be the whole of the last level", TOPIC_FILTER_INVALID
            )
        if SINGLE_LEVEL in level and level != SINGLE_LEVEL:
            raise ConversionError(
                f"topic filter {_show(topic_filter)}: '+' must be the whole of its level", TOPIC_FILTER_INVALID
            )
    return topic_filter


def filter_to_pattern(topic_filter: str) -> str:
    """The core pattern of a (validated here) MQTT filter: ``+`` → ``*``, ``#`` → ``#``, other levels as in
    :func:`topic_to_address`. It matches what the filter matches, ``$`` topics aside (see :func:`delivers`)."""
    validate_filter(topic_filter)
    _refuse_reserved(topic_filter, "topic filter")
    words = []
    for level in topic_filter.split(LEVEL_SEPARATOR):
        if level == SINGLE_LEVEL:
            words.append(ANY_WORD)
        elif level == MULTI_LEVEL:
            words.append(ANY_WORDS)
        else:
            words.append(_escape(level))
    return _checked(DELIMITER.join(words), topic_filter, TOPIC_FILTER_INVALID)


def pattern_to_filter(pattern: str) -> str:
    """The MQTT filter of a core pattern; the exact inverse of :func:`filter_to_pattern`."""
    if not pattern:
        raise ConversionError("an empty pattern has no topic filter", TOPIC_FILTER_INVALID)
    levels = []
    for word in pattern.split(DELIMITER):
        if word == ANY_WORD:
            levels.append(SINGLE_LEVEL)
        elif word == ANY_WORDS:
            levels.append(MULTI_LEVEL)
        else:
            levels.append(_unescape(word))
    return validate_filter(LEVEL_SEPARATOR.join(levels))


def delivers(topic_filter: str, topic: str) -> bool:
    """False when MQTT forbids delivering ``topic`` to a subscription on ``topic_filter`` although the core
    pattern matches: a filter starting with ``+`` or ``#`` never matches a topic starting with ``$``.

    ``topic`` may be the topic name or its core address (``$`` is never escaped). Call it with the MQTT filter
    (the part after ``$share/<group>/`` for a shared subscription)."""
    return not (topic[:1] == "$" and topic_filter[:1] in (SINGLE_LEVEL, MULTI_LEVEL))


def matches(topic_filter: str, topic: str) -> bool:
    """Whether a subscription on ``topic_filter`` receives a message on ``topic`` (MQTT 4.7), level by level,
    the ``$`` rule of :func:`delivers` included: for lookups the core's routing does not make (retained
    messages)."""
    if not delivers(topic_filter, topic):
        return False
    levels = topic.split(LEVEL_SEPARATOR)
    wanted = topic_filter.split(LEVEL_SEPARATOR)
    for i, level in enumerate(wanted):
        if level == MULTI_LEVEL:
            return True  # also when the topic ends just before it: "a/#" matches "a"
        if i >= len(levels) or (level != SINGLE_LEVEL and level != levels[i]):
            return False
    return len(levels) == len(wanted)


def parse_subscription(text: str, *, shared: bool = True) -> ParsedFilter:
    """Split a SUBSCRIBE's filter text: ``$share/<group>/<filter>`` → (group, filter), anything else →
    (None, text); both filters validated. With ``shared=False`` (no shared subscriptions, as in MQTT 3.1.1)
    ``$share/...`` is an ordinary filter."""
    if not shared or not text.startswith(SHARE_PREFIX):
        return ParsedFilter(None, validate_filter(text))
    group, separator, topic_filter = text[len(SHARE_PREFIX) :].partition(LEVEL_SEPARATOR)
    if not group:
        raise ConversionError(f"shared subscription {_show(text)} has an empty share name", TOPIC_FILTER_INVALID)
    if SINGLE_LEVEL in group or MULTI_LEVEL in group:
        raise ConversionError(f"share name {_show(group)} must not contain '+' or '#' (nor '/')", TOPIC_FILTER_INVALID)
    if not separator or not topic_filter:
        raise ConversionError(
            f"shared subscription {_show(text)} has no topic filter after its share name", TOPIC_FILTER_INVALID
        )
    return ParsedFilter(group, validate_filter(topic_filter))


# ---------------------------------------------------------------------------------------------- queues


def shared_queue(group: str, topic_filter: str) -> str:
    """The core queue that the members of shared subscription ``$share/<group>/<topic_filter>`` consume from."""
    return queue_name(SHARED_PREFIX, group, topic_filter)


def fanout_queue(owner: str, topic_filter: str) -> str:
    """The temporary core queue of a gateway's QoS 0 fan-out of ``topic_filter`` (``owner`` tells the gateway
    process, user and feed apart)."""
    return queue_name(FANOUT_PREFIX, owner, topic_filter)


# ---------------------------------------------------------------------------------------------- internals


def _escape(level: str) -> str:
    if not level:
        return EMPTY_LEVEL
    if _SPECIAL.isdisjoint(level):  # the common case: nothing to escape
        return level
    out = []
    last = len(level) - 1
    for i, char in enumerate(level):
        if char in _ALWAYS_ESCAPED or (char == ":" and i < last and level[i + 1] == ":"):
            out.append(f"{ESCAPE}{ord(char):02X}")
        else:
            out.append(char)
    return "".join(out)


def _unescape(word: str) -> str:
    if ESCAPE not in word:
        return word
    if word == EMPTY_LEVEL:
        return ""
    out = []
    i, end = 0, len(word)
    while i < end:
        char = _UNESCAPE.get(word[i : i + 3]) if word[i] == ESCAPE else None
        if char is None:
            out.append(word[i])
            i += 1
        else:
            out.append(char)
            i += 3
    return "".join(out)


def _checked(address: str, source: str, reason_code: int = TOPIC_NAME_INVALID) -> str:
    if len(address) > MAX_ADDRESS_LENGTH:
        raise ConversionError(
            f"{_show(source)} becomes a {len(address)}-character address, the core's limit is {MAX_ADDRESS_LENGTH}",
            reason_code,
        )
    words = address.count(DELIMITER) + 1
    if words > MAX_ADDRESS_WORDS:
        raise ConversionError(
            f"{_show(source)} has {words} levels, the core's limit is {MAX_ADDRESS_WORDS}", reason_code
        )
    return address


def _show(text: str) -> str:
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}..."
