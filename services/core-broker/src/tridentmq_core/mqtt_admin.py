"""MQTT sessions and retained messages as an operator sees them: the core queues the MQTT gateway keeps them in
(named in ``tridentmq_shared.mqtt_queues``), read and changed on one node. Pure: no I/O, no clock.

A session is its lock queue (while a connection holds it) and, when persistent, its session queue with one
record (subscriptions, QoS 2 state, owner), a subscription queue per filter and perhaps an outbox (retained
messages on their way to the client). Deleting a session deletes them
all: the connection holding it loses its lock consumer, which is how the gateway learns of a takeover, so it
closes that client's connection.
"""

from __future__ import annotations

from typing import Any

import msgpack

from tridentmq_core.broker import Broker
from tridentmq_core.operations import OperationError, message_view
from tridentmq_core.queues import Queue
from tridentmq_shared.message import M_BODY, M_PROPS, RoutingType, new_message
from tridentmq_shared.mqtt_queues import (
    LOCK_PREFIX,
    RETAINED_ADDRESS,
    SESSION_PREFIX,
    TOPIC_PROPERTY,
    lock_queue,
    outbox_queue,
    retained_queue,
    session_queue,
    subscription_queue,
)


def _record(queue: Queue) -> dict[str, Any]:
    """The session record (the newest message of its last-value queue), {} when absent or unreadable."""
    latest = None
    for message, _, _ in queue.browse_messages():
        latest = message
    if latest is None:
        return {}
    try:
        record = msgpack.unpackb(bytes(latest[M_BODY]), strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return {}
    return record if isinstance(record, dict) else {}


def _client_of(name: str, prefix: str) -> tuple[str, str | None]:
    """(the readable client id in a queue name, the client id itself when the name proves it)."""
    label = name[len(prefix) :].rsplit(".", 2)[0]
    maker = session_queue if prefix == SESSION_PREFIX else lock_queue
    return label, label if maker(label) == name else None


class MqttAdmin:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def _connected(self, name: str) -> bool:
        queue = self.broker.queues.get(name)
        return queue is not None and any(not c.browse and not c.forwarder for c in queue.consumers)

    def sessions(self) -> list[dict[str, Any]]:
        """Every MQTT session this node holds a queue of, by client."""
        found: dict[str, dict[str, Any]] = {}
        for name, queue in sorted(self.broker.queues.items()):
            if name.startswith(SESSION_PREFIX):
                label, client = _client_of(name, SESSION_PREFIX)
                record = _record(queue)
                subs = record.get("subs")
                filters = sorted(str(f) for f in subs) if isinstance(subs, dict) else []
                user = record.get("user")
                lock = lock_queue(client) if client is not None else LOCK_PREFIX + name[len(SESSION_PREFIX) :]
                names = [subscription_queue(client, f) for f in filters] + [outbox_queue(client)] if client else []
                queued = sum(len(q) for n in names if (q := self.broker.queues.get(n)) is not None)
                found[name[len(SESSION_PREFIX) :]] = {
                    "client_id": client,
                    "label": label,
                    "persistent": True,
                    "connected": self._connected(lock),
                    "user": user if isinstance(user, str) else None,
                    "subscriptions": filters,
                    "queued": queued,
                    "expires_ms": queue.expires_ms,
                }
            elif name.startswith(LOCK_PREFIX):
                key = name[len(LOCK_PREFIX) :]
                if key in found or SESSION_PREFIX + key in self.broker.queues:
                    continue
                label, client = _client_of(name, LOCK_PREFIX)
                found[key] = {
                    "client_id": client,
                    "label": label,
                    "persistent": False,
                    "connected": self._connected(name),
                    "user": None,
                    "subscriptions": [],
                    "queued": 0,
                    "expires_ms": queue.expires_ms,
                }
        return list(found.values())

    def delete_session(self, client_id: str, now_ms: int) -> dict[str, Any]:
        """Delete client ``client_id``'s session here: its record, lock, outbox and subscription queues."""
        queues = self.broker.queues
        session = queues.get(session_queue(client_id))
        names = [session_queue(client_id), lock_queue(client_id), outbox_queue(client_id)]
        if session is not None:
            subs = _record(session).get("subs")
            if isinstance(subs, dict):
                names += [subscription_queue(client_id, str(f)) for f in subs]
        present = [queues[n] for n in names if n in queues]
        if not present:
            raise OperationError(404, f"no MQTT session of client {client_id!r} on this node")
        for queue in present:
            self.broker.catalog.delete_queue(queue, now_ms)
        return {
            "deleted": 1 if session is not None or lock_queue(client_id) in {q.name for q in present} else 0,
            "queues": len(present),
        }

    def retained(self, prefix: str, limit: int, preview: int) -> dict[str, Any]:
        """The first ``limit`` retained messages by topic, of the topics starting with ``prefix``, in this node's
        copy (a node has one once a gateway used it; it then gets every retained message)."""
        queue = self.broker.queues.get(retained_queue(self.broker.node_id))
        found: list[tuple[str, Any, int, str]] = []
        if queue is not None:
            for message, count, state in queue.browse_messages():
                topic = message[M_PROPS].get(TOPIC_PROPERTY)
                if type(topic) is str and message[M_BODY] and topic.startswith(prefix):  # empty: a cleared topic
                    found.append((topic, message, count, state))
        found.sort(key=lambda item: item[0])
        tag = self.broker.node_id[:8]
        items = [
            {"topic": topic, **message_view(message, tag, count, state, preview)}
            for topic, message, count, state in found[:limit]
        ]
        return {"total": len(found), "retained": items}

    def delete_retained(self, topic: str, now_ms: int) -> dict[str, Any]:
        """Clear ``topic``'s retained message as an MQTT client would, with an empty retained publish, which
        reaches every node's copy; done by each node whose copy holds it (the clears are alike)."""
        queue = self.broker.queues.get(retained_queue(self.broker.node_id))
        held = queue is not None and any(
            m[M_PROPS].get(TOPIC_PROPERTY) == topic and m[M_BODY] for m, _, _ in queue.browse_messages()
        )
        if not held:
            raise OperationError(404, f"no retained message on topic {topic!r} on this node")
        clear = new_message(
            RETAINED_ADDRESS,
            b"",
            routing=RoutingType.MULTICAST,
            durable=True,
            properties={TOPIC_PROPERTY: topic},
            protocol="mqtt",
        )
        self.broker.publish(clear, now_ms)
        return {"cleared": 1}
