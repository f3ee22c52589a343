"""Events produced by ``LinkConnection.receive_data``.

Control operations become one event each. Message operations (publish, deliver, ack, …) arrive by the
thousand, so consecutive ones of the same kind are handed over together as one batch event holding the
validated operation lists themselves: no object per message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tridentmq_shared.message import WireMessage

# Batch item shapes (the operation list with its code still at index 0):
#   publish [op, seq, tx_id, message] · deliver [op, consumer_id, delivery_count, message]
#   ack [op, consumer_id, tx_id, message_ids] · nack [op, consumer_id, message_ids, mode]
OpList = list[Any]


@dataclass(frozen=True, slots=True)
class HelloReceived:
    """Server side: a client introduced itself; answer with ``accept`` or ``refuse``."""

    version: int
    user: str | None
    password: str | None
    client_name: str
    heartbeat_ms: int
    # The address of the client a gateway opens this link for (its real peer); None for a link of its own.
    client_host: str | None = None
    # The user a gateway opens this link for, on its own credentials (a client certificate's name); the core
    # lets only its link.proxy_users do so.
    acting_for: str | None = None


@dataclass(frozen=True, slots=True)
class Welcomed:
    """Client side: the server accepted the link."""

    version: int
    node_id: str
    conn_id: str
    heartbeat_ms: int
    publish_credit: int
    epoch: int = 0  # the node's activation epoch (HA); 0 when it did not say


@dataclass(frozen=True, slots=True)
class Closed:
    """The peer closed the link (``code`` is ``eof`` when the byte stream simply ended)."""

    code: str
    text: str


@dataclass(frozen=True, slots=True)
class Reply:
    req_id: int
    result: Any


@dataclass(frozen=True, slots=True)
class RequestFailed:
    req_id: int
    code: str
    text: str


@dataclass(frozen=True, slots=True)
class CreateAddress:
    req_id: int
    address: str
    routing_types: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DeleteAddress:
    req_id: int
    address: str


@dataclass(frozen=True, slots=True)
class CreateQueue:
    """``spec`` keys: name, address, routing_type, durable, filter, temporary, exclusive,
    last_value_key, max_consumers, auto_delete, expires_ms (see docs/link-protocol.md)."""

    req_id: int
    spec: dict[str, Any]


@dataclass(frozen=True, slots=True)
class DeleteQueue:
    req_id: int
    queue: str


@dataclass(frozen=True, slots=True)
class DeleteQueueEverywhere:
    """Version 3: delete the queue here and its namesakes on the other nodes of the cluster."""

    req_id: int
    queue: str


@dataclass(frozen=True, slots=True)
class Subscribe:
    """``options`` keys: selector, browse, auto_ack, and for a queue auto-created by the subscription:
    address, routing_type, durable."""

    req_id: int
    consumer_id: int
    queue: str
    credit: int
    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    req_id: int
    consumer_id: int


@dataclass(frozen=True, slots=True)
class TxBegin:
    req_id: int
    tx_id: int


@dataclass(frozen=True, slots=True)
class TxCommit:
    req_id: int
    tx_id: int


@dataclass(frozen=True, slots=True)
class TxRollback:
    req_id: int
    tx_id: int


@dataclass(frozen=True, slots=True)
class SetWill:
    """The link's will. ``key`` is None for a nil will (clear this link's will, nothing else); otherwise
    ``message`` None clears it too, and any pending will under ``key`` is cancelled or, with
    ``publish_pending``, published. With ``own``, it changes this link's own will under ``key`` and nothing
    else: nothing at all unless this link holds the will under ``key``. The message is checked by the broker,
    not the codec."""

    req_id: int
    key: str | None
    message: WireMessage | None
    delay_ms: int
    publish_pending: bool
    own: bool = False
    retain: tuple[str, dict[str, Any]] | None = None  # (store address, key properties): see SET_WILL's ``retain``
    everywhere: bool = False  # the pending will under ``key`` may be on another node of the cluster too


@dataclass(frozen=True, slots=True)
class Publishes:
    ops: list[OpList]


@dataclass(frozen=True, slots=True)
class Confirms:
    """Inclusive ranges of confirmed publish sequence numbers."""

    ranges: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Rejected:
    seq: int
    code: str
    text: str


@dataclass(frozen=True, slots=True)
class PublishCreditGranted:
    credit: int
    credit_bytes: int = 0  # version 2: body bytes added to the publish window


@dataclass(frozen=True, slots=True)
class Deliveries:
    ops: list[OpList]


@dataclass(frozen=True, slots=True)
class Acks:
    ops: list[OpList]


@dataclass(frozen=True, slots=True)
class Nacks:
    ops: list[OpList]


@dataclass(frozen=True, slots=True)
class Flow:
    consumer_id: int
    credit: int
    credit_bytes: int = 0  # version 2: body bytes added to a consumer subscribed with ``credit_bytes``


@dataclass(frozen=True, slots=True)
class ConsumerClosed:
    consumer_id: int
    code: str
    text: str


@dataclass(frozen=True, slots=True)
class BrowseDone:
    consumer_id: int


@dataclass(frozen=True, slots=True)
class Topology:
    """A cluster node joins (``info`` names it) or a gateway asks to follow the topology."""

    req_id: int
    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TopologyUpdate:
    update: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Replicate:
    """A backup asks for the journal stream (``info`` names its pair and epoch)."""

    req_id: int
    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReplicaRecords:
    """Backup side: journal records numbered from ``first``."""

    epoch: int
    first: int
    records: list[bytes]
    sync_end: int


@dataclass(frozen=True, slots=True)
class ReplicaAck:
    upto: int


@dataclass(frozen=True, slots=True)
class VoteRequested:
    req_id: int
    request: dict[str, Any]


ServerEvent = (
    HelloReceived
    | Closed
    | CreateAddress
    | DeleteAddress
    | CreateQueue
    | DeleteQueue
    | DeleteQueueEverywhere
    | Subscribe
    | Unsubscribe
    | TxBegin
    | TxCommit
    | TxRollback
    | SetWill
    | Publishes
    | Acks
    | Nacks
    | Flow
    | Topology
    | Replicate
    | ReplicaAck
    | VoteRequested
)
ClientEvent = (
    Welcomed
    | Closed
    | Reply
    | RequestFailed
    | Confirms
    | Rejected
    | PublishCreditGranted
    | Deliveries
    | ConsumerClosed
    | BrowseDone
    | TopologyUpdate
    | ReplicaRecords
)
Event = ServerEvent | ClientEvent
