"""Producers' confirms and commit replies that wait for a token: a store token (positive), completed when
the store has made the message or transaction safe, or a negative one for a durable publish written through
to another node, completed when that node confirms it (see ``forwarder``).

A producer's duplicate of a publish not yet safe (its record still waiting for the sync, or on its way to
another node) is confirmed with the first, never before: its token is an alias that completes (or is
refused) with the first's.
"""

from __future__ import annotations

from tridentmq_core.counters import Counters
from tridentmq_core.dedup import DuplicateIdCache
from tridentmq_core.outlet import Outlet
from tridentmq_core.queues import LinkSession
from tridentmq_core.sessions import Session
from tridentmq_core.write_through import WriteThrough


def reject_publish(counters: Counters, conn: Outlet, seq: int, code: str, text: str) -> None:
    counters.rejected += 1
    conn.reject(seq, code, text)


class Confirms:
    def __init__(
        self,
        *,
        write_through: WriteThrough[Session],
        dedup: DuplicateIdCache,
        dirty: set[LinkSession],
        counters: Counters,
    ) -> None:
        self.waiting: dict[int, tuple[Session, int]] = {}  # token → (session, publish sequence number)
        self._replies: dict[int, tuple[Session, int]] = {}  # token → (session, request id) of a commit
        self._aliases: dict[int, list[int]] = {}  # token → tokens of duplicates that wait for it
        self._write_through = write_through
        self._dedup = dedup
        self._dirty = dirty
        self._counters = counters
        #: The token the next durable publish written through gets: they count down, store tokens are positive.
        self.through_token = -1

    def reply_when_done(self, token: int, session: Session, req_id: int) -> None:
        self._replies[token] = (session, req_id)

    def alias(self, token: int) -> int:
        """A token for a duplicate of the publish waiting for ``token``: completed or refused with it."""
        alias = self.through_token
        self.through_token -= 1
        self._aliases.setdefault(token, []).append(alias)
        return alias

    def track(self, dedup_id: str | None, token: int) -> int:
        """The publish with ``dedup_id`` is safe once the store token ``token`` completes (0: at once): its
        duplicates wait for it until then (see ``duplicate``). Returns ``token``."""
        if token > 0 and dedup_id is not None:
            self._write_through.track(dedup_id, token)  # forgotten when it completes: kept only while pending
        return token

    def duplicate(self, dedup_id: str) -> int:
        """The token a duplicate of the publish with ``dedup_id`` must wait for: an alias of the first's while
        that is not safe (a reconnecting client resends what it had no confirm for, perhaps before the first's
        record is synced: confirmed at once, a crash then lost it), else 0, confirmed now."""
        pending = self._write_through.token_of(dedup_id)
        return 0 if pending is None else self.alias(pending)

    def done(self, token: int) -> list[int]:
        """``token`` completed: send what waited for it. Returns the aliases that complete with it."""
        waiting = self.waiting.pop(token, None)
        if waiting is not None:
            session, seq = waiting
            session.conn.confirm(seq)
            self._dirty.add(session)
        committed = self._replies.pop(token, None)
        if committed is not None:
            session, req_id = committed
            session.conn.reply(req_id, None)
            self._dirty.add(session)
        self._write_through.forget(token)
        return self._aliases.pop(token, []) if self._aliases else []

    def pass_on(self, token: int, new_token: int) -> None:
        """The confirm that waited for ``token`` (and those of its duplicates) waits for ``new_token`` now
        (none: they go at once)."""
        if not token:
            return
        dedup_id = self._write_through.forget(token)
        aliases = self._aliases.pop(token, None) if self._aliases else None
        waiting = self.waiting.pop(token, None)
        if new_token:
            if waiting is not None:
                self.waiting[new_token] = waiting
            if aliases:
                self._aliases.setdefault(new_token, []).extend(aliases)
            if dedup_id is not None:  # duplicates keep waiting, now for the disk here
                self._write_through.track(dedup_id, new_token)
            return
        if waiting is not None:
            session, seq = waiting
            session.conn.confirm(seq)
            self._dirty.add(session)
        for alias in aliases or ():
            self.pass_on(alias, 0)

    def refuse(self, token: int, code: str, text: str, dedup_id: str | None = None) -> bool:
        """Reject the publish whose confirm waited for ``token`` (and its duplicates'), forgetting its
        duplicate id so that it may be sent again; False if none waited."""
        self._write_through.forget(token)
        if dedup_id is not None:
            self._dedup.forget(dedup_id)
        waiting = self.waiting.pop(token, None)
        if waiting is not None:
            reject_publish(self._counters, waiting[0].conn, waiting[1], code, text)
            self._dirty.add(waiting[0])
        aliases = self._aliases.pop(token, None) if self._aliases else None
        for alias in aliases or ():
            self.refuse(alias, code, text)
        return waiting is not None or bool(aliases)

    def forget(self, session: Session) -> None:
        """The link is gone: nothing waits to be sent to it."""
        for book in (self.waiting, self._replies):
            for token in [token for token, (owner, _) in book.items() if owner is session]:
                del book[token]
