"""An id held by one connection at a time, through any gateway and any node of a cluster: a STOMP client-id, an
AMQP container-id (as ActiveMQ has them: two connections with one id would consume its durable subscriptions and
split their messages).

The core decides who holds an id: the holder is the link whose temporary queue the id's lock is, on its node,
and no other node has one of that name (cluster nodes answer a queue's creation once the others know of it, and
say when another node has one). The queue goes with the link, however the connection ends. Each gateway names
its locks (a prefix starting with ``$``, out of reach of wildcard subscriptions, then the id hashed as
``mqtt_queues.queue_name`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Final, Protocol

from tridentmq_shared.link.errors import LinkRequestError

#: How long a connection whose id is held waits for it to come free before it is refused, looking every
#: ``RETRY_S``: a holder's end reaches its core node a moment after its client saw it (a closed socket), and the
#: other nodes of a cluster up to a cluster tick later.
WAIT_S: Final = 0.5
RETRY_S: Final = 0.05


class QueueMaker(Protocol):
    """What of a ``LinkClient`` holding an id needs."""

    async def create_queue(self, name: str, address: str | None = None, **options: Any) -> dict[str, Any]: ...

    async def delete_queue(self, name: str) -> None: ...


async def hold(link: QueueMaker, name: str, *, wait_s: float = WAIT_S, retry_s: float = RETRY_S) -> bool:
    """Make the lock ``name`` ``link``'s: True once it holds it, False when another connection still does after
    ``wait_s``. The core's refusals (a missing right, the link gone) are raised as ``LinkRequestError``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = await link.create_queue(name, durable=False, temporary=True)
        if found.get("created") and not found.get("elsewhere"):
            return True
        if found.get("created"):  # another node's connection holds it: ours must not stand meanwhile
            await link.delete_queue(name)
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(retry_s)


async def release(link: QueueMaker, name: str) -> None:
    """Free the lock now, rather than when the link closes (a client that reconnects at once must find it free)."""
    with contextlib.suppress(LinkRequestError):  # a link gone took the queue with it
        await link.delete_queue(name)
