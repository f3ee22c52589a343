"""``tridentmq audit stream --alerts-to tmq://host:port/address``: alerts published as TridentMQ messages.

Each alert row becomes one durable message on the address, through the link client: a JSON body (the row)
and properties ``alert``, ``node_id``, ``alert_address`` that any STOMP (headers), MQTT (user properties) or
AMQP (application properties) consumer of the address sees and can select on. A micro-batch is published
before Spark commits it (``foreachBatch``), and each message carries a dedup id made of the query and a
hash of the alert itself, so a batch replayed after a crash is dropped by the broker's duplicate detection
instead of alerting twice.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
from pyspark.sql import DataFrame

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import WireMessage, new_message

__all__ = ["AlertTarget", "publish_batch"]

SCHEME = "tmq"
CLIENT_NAME = "tridentmq-audit-alerts"


@dataclass(frozen=True)
class AlertTarget:
    host: str
    port: int
    address: str
    user: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> AlertTarget:
        """``tmq://[user:password@]host:port/address``."""
        parts = urlsplit(url)
        address = unquote(parts.path.removeprefix("/"))
        if parts.scheme != SCHEME or not parts.hostname or parts.port is None or not address:
            raise ValueError(f"--alerts-to wants {SCHEME}://[user:password@]host:port/address, not {url!r}")
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password else None
        return cls(parts.hostname, parts.port, address, user, password)


def _json_default(value: object) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


def publish_batch(target: AlertTarget, query: str, batch: DataFrame, batch_id: int) -> None:
    """``foreachBatch`` body: every alert row of the batch as a confirmed message (alerts are few)."""
    rows = [row.asDict() for row in batch.collect()]
    if rows:
        asyncio.run(_publish(target, query, rows))


async def _publish(target: AlertTarget, query: str, rows: list[dict[str, Any]]) -> None:
    client = LinkClient(target.host, target.port, user=target.user, password=target.password, client_name=CLIENT_NAME)
    async with client:
        # the batch is committed only once the broker confirmed every alert
        await asyncio.gather(*await client.publish_batch(_alerts(target, query, rows)))


def _alerts(target: AlertTarget, query: str, rows: list[dict[str, Any]]) -> Iterator[WireMessage]:
    for row in rows:
        properties = {"alert": str(row.get("alert") or ""), "node_id": str(row.get("node_id") or "")}
        if row.get("address") is not None:
            properties["alert_address"] = str(row["address"])
        body = orjson.dumps(row, default=_json_default, option=orjson.OPT_SORT_KEYS)
        yield new_message(
            target.address,
            body,
            durable=True,
            dedup_id=f"{query}-{hashlib.sha256(body).hexdigest()[:32]}",
            properties=properties,
            content_type="application/json",
        )
