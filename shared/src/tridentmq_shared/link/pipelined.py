"""The publishing verbs of a process that relays others' messages: a gateway's sessions, a node forwarding to another.

An application publishes with ``LinkClient.publish`` (acknowledged), ``publish_unconfirmed`` (fire-and-forget) and
``publish_batch``. A relay publishes message by message at a high rate, for many clients at once, and follows
each outcome itself: a coroutine or a future per message costs more than the publish, and a relay that cannot
send now must hold the client's frame back rather than wait inside its handler. A ``PipelinedLink`` adds the
calls that say "now or not at all" (``try_send``, ``send_if_open``), the wait for the window they need
(``wait_for_credit``), ``send`` (a confirm future, once the window allows), and what a relay checks before
(``can_send``, ``body_fits``, ``publish_credit``).
"""

from __future__ import annotations

import asyncio

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import M_BODY, WireMessage


class PipelinedLink(LinkClient):
    __slots__ = ()  # one per gateway session: no dict of its own

    async def send(self, message: WireMessage, tx_id: int = 0) -> asyncio.Future[None]:
        """Write a publish once the window allows (across a reconnection) and return at once with the future of
        its confirm: the next publish need not wait for this one's."""
        return await self._send(message, tx_id)

    def try_send(self, message: WireMessage, tx_id: int = 0) -> asyncio.Future[None] | None:
        """``send`` without waiting: None, sending nothing, when the publish cannot go now (no credit, a full
        socket, a link being resumed)."""
        conn = self._open_for_sending()
        return None if conn is None else self._send_on(conn, message, tx_id)

    def send_if_open(self, message: WireMessage) -> int:
        """Publish without a confirm future: the server still confirms, but nothing here waits for it and
        nothing is re-sent after a reconnect (at most once). Returns the publish's sequence number, for a caller
        that follows outcomes itself (``on_confirms``, ``on_rejected``); -1, sending nothing, when the publish
        cannot go now (``wait_for_credit``). Check ``body_fits`` first: a body the link does not take breaks the
        link."""
        conn = self._open_for_sending()
        return -1 if conn is None else self._send_unconfirmed_on(conn, message)

    async def wait_for_credit(self) -> None:
        """Wait until a publish may go: the link is open (after a reconnection's re-sends), the server grants
        credit, and the socket keeps up."""
        await self._wait_window()

    @property
    def can_send(self) -> bool:
        """Whether a publish may go now (False while the link is being resumed: ``send`` waits for that)."""
        return self._open_for_sending() is not None

    def body_fits(self, message: WireMessage) -> bool:
        """Whether the core's link takes this message's body (``send`` refuses a larger one, ``send_if_open``
        would break the link on it). True while no link is open."""
        conn = self._conn
        return conn is None or len(message[M_BODY]) <= conn.max_publish_body

    @property
    def publish_credit(self) -> int:
        """Publishes the server allows right now (0 once the byte window is used up, or while resuming)."""
        conn = self._conn
        return conn.publish_credit if conn is not None and conn.publish_bytes > 0 and not self._resuming else 0
