"""Audit stream schema v1 as every job reads it: the columns, their types and the known event names.

One flat row per event. Fields an event does not have are null. Rows that could not be read as a v1 event
keep their place in the same table with ``bad_reason`` set (and the line in ``raw``), so a job splits them
off into ``bad_records`` instead of failing or dropping them.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = [
    "BAD_DUPLICATE_SEQ",
    "BAD_FIELD_TYPE",
    "BAD_MISSING_HEADER",
    "BAD_NEWER_VERSION",
    "BAD_NOT_JSON",
    "BAD_SEQ_GAP",
    "BAD_UNKNOWN_EVENT",
    "COLUMNS",
    "DDL",
    "KNOWN_EVENTS",
    "SCHEMA_VERSION",
    "arrow_schema",
]

SCHEMA_VERSION = 1

KNOWN_EVENTS = frozenset(
    {
        "node.heartbeat",
        "node.joined",
        "node.left",
        "node.forgotten",
        "conn.opened",
        "conn.closed",
        "consumer.opened",
        "consumer.closed",
        "queue.expired",
        "will.published",
        "msg.sent",
        "msg.delivered",
        "msg.acked",
        "msg.nacked",
        "msg.dead_lettered",
        "msg.expired",
        "msg.forwarded",
        "msg.redistributed",
        "ha.activated",
        "ha.backup_in_sync",
        "ha.backup_lost",
        "ha.failback",
        "ha.fenced",
        # An operator's action through the management API (tridentmq_core.management.operations_api).
        "mgmt.queue.create",
        "mgmt.queue.delete",
        "mgmt.queue.purge",
        "mgmt.messages.move",
        "mgmt.messages.copy",
        "mgmt.pause",
        "mgmt.resume",
        "mgmt.connection.close",
        "mgmt.client.close",
        "mgmt.mqtt.session.delete",
        "mgmt.mqtt.retained.delete",
        "mgmt.failback",
        "mgmt.scale_down",
        "mgmt.address_settings.set",
        "mgmt.node.forget",
    }
)

# Why a line is in bad_records.
BAD_NOT_JSON = "not_json"  # torn or garbled line, or not a JSON object
BAD_MISSING_HEADER = "missing_header"  # no usable v / seq / ts_us / event
BAD_NEWER_VERSION = "newer_version"  # v above what these jobs understand
BAD_UNKNOWN_EVENT = "unknown_event"
BAD_FIELD_TYPE = "bad_field_type"  # a known field with a value of the wrong type
BAD_SEQ_GAP = "seq_gap"  # seqs missing from a node's log (seq = first missing, raw = how many)
BAD_DUPLICATE_SEQ = "duplicate_seq"

_INT = pa.int64()
_STR = pa.string()

#: (column, arrow type). Header first, then event fields, then the two bad-record columns.
COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("node_id", _STR),
    ("seq", _INT),
    ("ts_us", _INT),
    ("event", _STR),
    ("epoch", _INT),
    ("v", _INT),
    ("address", _STR),
    ("queue", _STR),
    ("message_id", _STR),
    ("origin_message_id", _STR),
    ("size", _INT),
    ("protocol", _STR),
    ("sent_ts_us", _INT),
    ("delivery_count", _INT),
    ("reason", _STR),
    ("conn_id", _STR),
    ("client_id", _STR),
    ("consumer_id", _STR),
    ("consumer_protocol", _STR),
    ("peer_node", _STR),
    ("name", _STR),
    ("target_node", _STR),
    ("target_queues", _STR),
    ("configured_role", _STR),
    ("group", _STR),
    ("backup", _STR),
    ("to", _STR),
    ("expires_ms", _INT),
    ("messages", _INT),
    ("key", _STR),
    ("bad_reason", _STR),
    ("raw", _STR),
)

_SPARK_TYPES = {_INT: "BIGINT", _STR: "STRING"}

#: The Spark schema of the source, as a DDL string (backquoted: `to` and `group` are SQL keywords).
DDL = ", ".join(f"`{name}` {_SPARK_TYPES[kind]}" for name, kind in COLUMNS)


def arrow_schema() -> pa.Schema:
    """The Arrow schema of the batches the source yields."""
    return pa.schema([pa.field(name, kind) for name, kind in COLUMNS])
