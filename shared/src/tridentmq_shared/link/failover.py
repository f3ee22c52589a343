"""How a link client finds a node again: which nodes it tries, in what order, how often, and how long it waits
for an HA backup to take over; and how a publish the old node never confirmed goes again.

What the link had set up (its will, queues, consumers) is the client's to restore; this module only gets it a
connection. ``open_node`` is the client's: it connects to one node and raises as a connection would
(``OSError``, ``TimeoutError``), or ``LinkClosedError`` when that node turned the link away.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.topology import Endpoint, Topology
from tridentmq_shared.message import HOME_PROPERTY, M_DEDUP, M_DURABLE, M_PROPS, WireMessage

log = logging.getLogger("tridentmq.link.client")

#: Refusals that another node or a later attempt would give again: a (re)connect stops at them. ``internal``: the
#: node failed on this link's input, which a resume would send again; ``malformed``: that input broke the protocol
#: (a publish to an empty address), and a resume sent it again, over and over, thousands of links a second.
FATAL: Final = (
    ErrorCode.UNAUTHENTICATED,
    ErrorCode.VERSION,
    ErrorCode.CLOSED_BY_OPERATOR,
    ErrorCode.INTERNAL,
    ErrorCode.MALFORMED,
)

OpenNode = Callable[[str, int], Awaitable[None]]
#: Raises ``LinkClosedError`` once the client is closed: a resume that goes on must not try the nodes forever.
StopIfClosed = Callable[[], None]
#: A publish the node has not confirmed: the message, its transaction (0: none), its confirm's future.
Unconfirmed = tuple[WireMessage, int, "asyncio.Future[None]"]


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """Artemis' reconnect parameters: -1 attempts = forever. One attempt tries every node of the topology
    once; the wait between attempts starts at ``retry_interval`` seconds and grows to ``max_interval``."""

    retry_interval: float = 0.1
    multiplier: float = 2.0
    max_interval: float = 5.0
    attempts: int = -1
    initial_attempts: int = 1
    #: How long a link whose node has an in-sync backup (HA) waits for that backup to take over before it
    #: tries the other nodes: the session then stays on its pair.
    failover_window: float = 5.0


async def connect_first(
    nodes: Topology,
    policy: ReconnectPolicy,
    open_node: OpenNode,
    stop_if_closed: StopIfClosed,
    attempts: int,
    failed: Endpoint | None = None,
) -> None:
    """Connect to the first node that answers, trying them in the topology's order (``failed`` last),
    ``attempts`` times over (-1: until one answers), waiting longer after each round."""
    delay = policy.retry_interval
    for attempt in itertools.count(1):
        problem: LinkClosedError | None = None
        for host, port in nodes.connection_order(failed):
            stop_if_closed()
            try:
                await open_node(host, port)
                return
            except (OSError, TimeoutError) as exc:
                problem = LinkClosedError(ErrorCode.EOF, f"cannot connect to {host}:{port}: {exc}")
                problem.__cause__ = exc  # a TLS failure (ssl.SSLError) tells its owner to say so
            except LinkClosedError as exc:  # refused by that node (stopping, too many links): the next one
                if exc.code in FATAL:
                    raise
                stop_if_closed()
                problem = exc
        if attempts >= 0 and attempt >= attempts:
            raise problem or LinkClosedError(ErrorCode.EOF, "no node to connect to")
        await asyncio.sleep(delay)
        delay = min(delay * policy.multiplier, policy.max_interval)


async def reach_backup(
    nodes: Topology,
    policy: ReconnectPolicy,
    open_node: OpenNode,
    stop_if_closed: StopIfClosed,
    failed: Endpoint,
) -> bool:
    """Connect to the in-sync backup of the node that ``failed`` once it has taken over (it refuses links
    until then); False when it has none or did not take over within the failover window."""
    backup = nodes.backup_of(failed)
    if backup is None:
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.failover_window
    while loop.time() < deadline:
        stop_if_closed()
        try:
            await open_node(*backup)
            return True
        except (OSError, TimeoutError):
            pass
        except LinkClosedError as exc:
            if exc.code in FATAL:
                raise
            stop_if_closed()
        await asyncio.sleep(0.05)
    log.warning("the backup of %s:%s did not take over in time: trying the other nodes", *failed)
    return False


def homed(entry: Unconfirmed, node_id: str) -> Unconfirmed:
    """An unconfirmed publish about to go again: a durable one with a duplicate id names the node it was first
    sent to (``HOME_PROPERTY``), which may hold it although its confirm never came."""
    message = entry[0]
    props = message[M_PROPS]
    if not node_id or not message[M_DURABLE] or message[M_DEDUP] is None or HOME_PROPERTY in props:
        return entry
    homed_message = list(message)
    homed_message[M_PROPS] = {**props, HOME_PROPERTY: node_id}
    return homed_message, entry[1], entry[2]
