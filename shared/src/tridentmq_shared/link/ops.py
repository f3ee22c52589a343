"""Operation codes, error codes and enums of the internal link protocol (versions 1 to 4).

A frame is a 4-byte big-endian length followed by a msgpack array of operations; each operation is an
array whose first element is one of the codes below. ``docs/link-protocol.md`` documents every field.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

#: Version 2 counts the publish window and, when asked, consumer windows in bytes too (WELCOME's publish
#: bytes, PUBLISH_CREDIT's and FLOW's byte fields, SUBSCRIBE's ``credit_bytes`` option). Version 3 adds
#: DELETE_QUEUE_EVERYWHERE; version 4 lets a SUBSCRIBE make its queue, and ends a browser at its BROWSE_DONE.
PROTOCOL_VERSIONS: Final = (1, 2, 3, 4)
HEADER_SIZE: Final = 4


class Op(IntEnum):
    # connection
    HELLO = 1  # C→S [op, versions, user, password, client_name, heartbeat_ms, max_frame, client_host?, acting_for?]
    WELCOME = 2  # S→C [op, version, node_id, conn_id, heartbeat_ms, max_frame, publish_credit, epoch?, bytes v2]
    CLOSE = 3  # both [op, code, text]: the sender closes the link after it
    HEARTBEAT = 4  # both [op]
    # request / reply
    OK = 5  # S→C [op, req_id, result]
    ERROR = 6  # S→C [op, req_id, code, text]
    CREATE_ADDRESS = 10  # C→S [op, req_id, address, routing_types]
    DELETE_ADDRESS = 11  # C→S [op, req_id, address]
    CREATE_QUEUE = 12  # C→S [op, req_id, spec]
    DELETE_QUEUE = 13  # C→S [op, req_id, queue]
    SUBSCRIBE = 14  # C→S [op, req_id, consumer_id, queue, credit, options]
    UNSUBSCRIBE = 15  # C→S [op, req_id, consumer_id]
    TX_BEGIN = 16  # C→S [op, req_id, tx_id]
    TX_COMMIT = 17  # C→S [op, req_id, tx_id]
    TX_ROLLBACK = 18  # C→S [op, req_id, tx_id]
    SET_WILL = 19  # C→S [op, req_id, will]: will = nil or {key, message, delay_ms, publish_pending, own, retain}
    # messages
    PUBLISH = 20  # C→S [op, seq, tx_id, message]
    CONFIRM = 21  # S→C [op, first_seq, last_seq]
    REJECT = 22  # S→C [op, seq, code, text]
    PUBLISH_CREDIT = 23  # S→C [op, credit, bytes v2]
    DELIVER = 24  # S→C [op, consumer_id, delivery_count, message]
    ACK = 25  # C→S [op, consumer_id, tx_id, message_ids]
    NACK = 26  # C→S [op, consumer_id, message_ids, mode]
    FLOW = 27  # C→S [op, consumer_id, credit, bytes v2]
    CONSUMER_CLOSED = 28  # S→C [op, consumer_id, code, text]
    BROWSE_DONE = 29  # S→C [op, consumer_id]
    # cluster
    TOPOLOGY = 30  # C→S [op, req_id, info]: join the cluster (info names the node) or watch its topology
    TOPOLOGY_UPDATE = 31  # S→C [op, update]: members and, for a joined node, binding changes
    # high availability
    REPLICATE = 32  # C→S [op, req_id, info]: a backup asks its primary for the journal stream
    REPLICA = 33  # S→C [op, epoch, first, records, sync_end]: journal records numbered from ``first``
    REPLICA_ACK = 34  # C→S [op, upto]: the backup holds every record up to this number
    VOTE = 35  # C→S [op, req_id, request]: a node asks an active node for its vote on a pair's epoch
    # sessions multiplexed over one link
    CHANNEL = 36  # both [op, channel_id, data]: bytes of a session's own link stream; empty data closes it
    # version 3
    DELETE_QUEUE_EVERYWHERE = 37  # C→S [op, req_id, queue]: the queue of that name on every node of the cluster


class NackMode(IntEnum):
    """What a negative acknowledgement asks for."""

    REDELIVER = 0  # delivery failed: count the attempt, redeliver with the redelivery delay, then DLA
    RELEASE = 1  # not processed at all: back to the queue, the attempt does not count
    REJECT = 2  # poison: straight to the dead-letter address


class ErrorCode:
    """Error codes carried by CLOSE, ERROR and REJECT; the text says the specifics."""

    MALFORMED: Final = "malformed"
    FRAME_TOO_LARGE: Final = "frame-too-large"
    UNEXPECTED: Final = "unexpected"
    VERSION: Final = "version"
    UNAUTHENTICATED: Final = "unauthenticated"
    FORBIDDEN: Final = "forbidden"
    NOT_FOUND: Final = "not-found"
    EXISTS: Final = "exists"
    INVALID: Final = "invalid"
    CREDIT: Final = "credit"
    HEARTBEAT_TIMEOUT: Final = "heartbeat-timeout"
    RESOURCE_LIMIT: Final = "resource-limit"
    SHUTDOWN: Final = "shutdown"
    EOF: Final = "eof"
    INTERNAL: Final = "internal"
    NOT_ACTIVE: Final = "not-active"  # a backup (or a fenced node) serves no clients: try another node
    FENCED: Final = "fenced"  # the peer's copy of its node was replaced by one at a higher epoch
    FAILBACK: Final = "failback"  # an active backup hands its pair back to the primary it just brought in sync
    CLOSED_BY_OPERATOR: Final = "closed-by-operator"  # the management API closed the link: do not reconnect
