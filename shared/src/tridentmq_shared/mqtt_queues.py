"""Names of the core queues that hold MQTT state: the MQTT gateway makes them, the core's management
operations find a client's session by them. Pure.

A name shows its owner and topic filter to people (characters the core treats specially become ``_``) and ends
in a hash of both, so it is unique whatever they hold.
"""

from __future__ import annotations

import hashlib
from typing import Final

#: The queues of subscriptions: a client's own, a shared subscription's, a gateway's QoS 0 fan-out.
SUBSCRIPTION_PREFIX: Final = "mqtt.sub."
SHARED_PREFIX: Final = "mqtt.shared."
FANOUT_PREFIX: Final = "mqtt.fanout."
#: The first word of the addresses of the gateways' own state below (the MQTT topic level ``$mqtt``): the gateway
#: refuses it in its clients' topics and filters, whatever their rights on the core.
RESERVED_WORD: Final = "$mqtt"
#: The gateways' own queues; ``$`` keeps them out of reach of wildcards (the core's rule for ``$`` addresses).
SESSION_PREFIX: Final = "$mqtt.session."
LOCK_PREFIX: Final = "$mqtt.lock."
#: A persistent session's outbox: the retained messages its SUBSCRIBEs sent at QoS 1 and 2, on their way to the
#: client (kept until it acknowledges them, as its subscriptions' messages are in their queues).
OUTBOX_PREFIX: Final = "$mqtt.outbox."
#: Retained messages are published (multicast) here; every core node keeps its own last-value copy of all of
#: them, so a gateway reads its own node's and sees what was retained through any node of the cluster.
RETAINED_ADDRESS: Final = "$mqtt.retained"
#: The property holding a retained message's topic (its last-value key in the retained store).
TOPIC_PROPERTY: Final = "mqtt_topic"
#: The last-value key of a session record.
STATE_KEY: Final = "state"

_HASH_HEX_DIGITS: Final = 32
_READABLE_CLIENT: Final = 64
_READABLE_FILTER: Final = 96


def queue_name(prefix: str, owner: str, topic_filter: str) -> str:
    digest = hashlib.sha256(f"{len(owner)}:{owner}{topic_filter}".encode(errors="surrogatepass")).hexdigest()
    readable = (_readable(owner, _READABLE_CLIENT), _readable(topic_filter, _READABLE_FILTER))
    return f"{prefix}{readable[0]}.{readable[1]}.{digest[:_HASH_HEX_DIGITS]}"


_SPECIAL: Final = str.maketrans(dict.fromkeys(" .*#:%", "_"))


def _readable(text: str, limit: int) -> str:
    """A non-empty core word that shows ``text`` to people: characters the core treats specially become '_'."""
    text = text[:limit]
    if not text.isprintable():  # rare: the usual case stays a C loop instead of a Python one per character
        text = "".join(c if c.isprintable() else "_" for c in text)
    return text.translate(_SPECIAL) or "_"


def subscription_queue(client_id: str, topic_filter: str) -> str:
    """The core queue of client ``client_id``'s subscription on ``topic_filter`` (one per client and filter)."""
    return queue_name(SUBSCRIPTION_PREFIX, client_id, topic_filter)


def session_queue(client_id: str) -> str:
    """The core queue holding the persistent state of client ``client_id``'s session (one record)."""
    return queue_name(SESSION_PREFIX, client_id, "")


def lock_queue(client_id: str) -> str:
    """The core queue whose one consumer is the connection that owns client ``client_id``'s session."""
    return queue_name(LOCK_PREFIX, client_id, "")


def outbox_queue(client_id: str) -> str:
    """The core queue of client ``client_id``'s session outbox (see ``OUTBOX_PREFIX``)."""
    return queue_name(OUTBOX_PREFIX, client_id, "")


def retained_queue(node_id: str) -> str:
    """The queue of core node ``node_id``'s copy of the retained messages."""
    return f"{RETAINED_ADDRESS}.{node_id}"


def holds_records(queue: str, address: str) -> bool:
    """Whether a queue keeps the gateways' records (a session's, a node's copy of the retained messages) rather
    than messages on their way to a consumer: nothing reads it until a client needs it, by design."""
    return queue.startswith(SESSION_PREFIX) or address == RETAINED_ADDRESS
