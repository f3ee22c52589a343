"""Link wills (SET_WILL) in the pure broker, driven through real codecs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from tests.unit.broker_harness import BASE_MS, Client, Harness, bodies, failed, ok, recorded

from tridentmq_core.settings import AddressSettingsEntry, BrokerSection, CoreSettings, PermissionEntry, UserEntry
from tridentmq_core.will_keeper import MAX_WILL_KEY
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import (
    M_BODY,
    M_DEDUP,
    M_EXPIRATION,
    M_ID,
    M_TIMESTAMP,
    MAX_TIME_MS,
    WireMessage,
    new_message,
)


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def c(h: Harness) -> Client:
    return h.connect("app")


def will(address: str = "status", body: bytes = b"gone", **fields: Any) -> WireMessage:
    return new_message(address, body, **fields)


def test_a_will_is_published_when_its_link_closes() -> None:
    h, _, sink = recorded()
    watcher, dying = h.connect("watcher"), h.connect("dying")
    ok(watcher.create_queue("status"))
    cid = watcher.consumer("status")
    message = will(dedup_id="w-1", properties={"p": 1})
    message[M_TIMESTAMP] = BASE_MS - 5
    assert ok(dying.set_will("session-1", message)) is None
    h.tick(BASE_MS + 10_000)
    assert watcher.take(cid) == []
    dying.close()
    [got] = watcher.take(cid)
    assert (got.body, got.props, got.message[M_DEDUP]) == (b"gone", {"p": 1}, "w-1")
    assert got.message[M_ID] > 0
    assert got.message[M_TIMESTAMP] == BASE_MS + 10_000  # stamped when published, not when set
    assert sink.of("will.published") == [
        ((BASE_MS + 10_000) * 1000, {"key": "session-1", "address": "status", "conn_id": dying.session.conn_id})
    ]


def test_a_will_is_published_when_the_connection_is_lost(h: Harness) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", will()))
    dying.drop()
    assert bodies(watcher.take(cid)) == [b"gone"]


@pytest.mark.parametrize("clear", ["nil", "no-message"])
def test_a_cleared_will_is_not_published(h: Harness, clear: str) -> None:
    watcher, leaving = h.connect("watcher"), h.connect("leaving")
    cid = watcher.consumer("status")
    ok(leaving.set_will("k", will()))
    ok(leaving.clear_will() if clear == "nil" else leaving.set_will("k", None))
    leaving.close()
    assert watcher.take(cid) == []
    assert not h.broker.wills.book.holders


def test_a_new_will_replaces_the_earlier_one(h: Harness) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k1", will(body=b"first")))
    ok(dying.set_will("k2", will(body=b"second")))
    dying.close()
    assert bodies(watcher.take(cid)) == [b"second"]


def test_a_delayed_will_is_pending_until_its_time(h: Harness) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", will(), delay_ms=5000))
    h.now_ms = BASE_MS + 1000
    dying.close()
    h.tick(BASE_MS + 5999)
    assert watcher.take(cid) == []
    h.tick(BASE_MS + 6000)
    assert bodies(watcher.take(cid)) == [b"gone"]
    h.tick(BASE_MS + 60_000)
    assert watcher.take(cid) == []


def test_a_will_with_a_timestamp_expires_as_long_after_its_publication_as_after_its_timestamp(h: Harness) -> None:
    watcher, dying, plain = h.connect("watcher"), h.connect("dying"), h.connect("plain")
    cid = watcher.consumer("status")
    stamped = will(body=b"stamped", expiration_ms=BASE_MS + 1000)
    stamped[M_TIMESTAMP] = BASE_MS  # a lifetime of 1 s from its publication
    ok(dying.set_will("k", stamped, delay_ms=5000))
    ok(plain.set_will("p", will(body=b"plain", expiration_ms=BASE_MS + 60_000)))  # no timestamp: kept as it is
    h.now_ms = BASE_MS + 10_000  # the links live longer than the lifetime
    dying.close()
    plain.close()
    h.tick(BASE_MS + 15_000)
    got = {m.body: m.message[M_EXPIRATION] for m in watcher.take(cid)}
    assert got == {b"stamped": BASE_MS + 16_000, b"plain": BASE_MS + 60_000}


def test_a_set_will_with_its_key_cancels_a_pending_will(h: Harness) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", will(body=b"old"), delay_ms=5000))
    dying.close()
    back = h.connect("back")
    ok(back.set_will("k", will(body=b"new"), delay_ms=5000))
    h.tick(BASE_MS + 60_000)
    assert watcher.take(cid) == []
    ok(h.connect("other").set_will("k", None))  # a SET_WILL from any link, without a message, counts too
    back.close()
    h.tick(BASE_MS + 120_000)
    assert watcher.take(cid) == []


def test_publish_pending_publishes_the_pending_will_at_once(h: Harness) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", will(body=b"old"), delay_ms=5000))
    dying.close()
    back = h.connect("back")
    ok(back.set_will("k", will(body=b"new"), delay_ms=5000, publish_pending=True))
    assert bodies(watcher.take(cid)) == [b"old"]
    h.tick(BASE_MS + 60_000)
    assert watcher.take(cid) == []
    ok(back.set_will("unused", None, publish_pending=True))  # nothing pending under that key: nothing happens
    assert watcher.take(cid) == []


def test_a_newer_pending_will_replaces_an_older_one_with_the_same_key(h: Harness) -> None:
    watcher = h.connect("watcher")
    cid = watcher.consumer("status")
    first = h.connect("first")
    ok(first.set_will("k", will(body=b"first"), delay_ms=1000))
    first.close()
    second = h.connect("second")
    ok(second.set_will("other", will(body=b"second"), delay_ms=1000))
    ok(second.set_will("k", will(body=b"second"), delay_ms=2000))  # cancels the pending "first"
    second.close()
    h.tick(BASE_MS + 10_000)
    assert bodies(watcher.take(cid)) == [b"second"]


def test_a_link_setting_a_key_another_open_link_holds_takes_it_over(h: Harness) -> None:
    watcher, old, new = h.connect("watcher"), h.connect("old"), h.connect("new")
    cid = watcher.consumer("status")
    ok(old.set_will("k", will(body=b"old")))
    ok(new.set_will("k", will(body=b"new")))
    old.drop()  # noticed only after the client came back on a new link
    assert watcher.take(cid) == []
    new.close()
    assert bodies(watcher.take(cid)) == [b"new"]


def test_an_own_will_change_of_a_link_whose_key_was_taken_over_changes_nothing(h: Harness) -> None:
    """A connection taken over, whose DISCONNECT gives its will a new delay (``own``), must not take the key back
    from its successor: the successor's will stays, and the old link's is gone."""
    watcher, old, new = h.connect("watcher"), h.connect("old"), h.connect("new")
    cid = watcher.consumer("status")
    ok(old.set_will("k", will(body=b"old"), delay_ms=60_000))
    ok(new.set_will("k", will(body=b"new")))
    assert ok(old.set_will("k", will(body=b"old"), delay_ms=0, own=True)) is None  # done: nothing to do
    assert h.broker.wills.book.holders["k"] is new.session
    old.close()
    assert watcher.take(cid) == []
    new.close()
    assert bodies(watcher.take(cid)) == [b"new"]


def test_an_own_will_change_of_the_holder_replaces_its_will(h: Harness) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", will(), delay_ms=60_000))
    ok(dying.set_will("k", will(), delay_ms=0, own=True))
    dying.close()
    assert bodies(watcher.take(cid)) == [b"gone"]  # at once: its delay is 0 now


def test_wills_are_not_published_when_the_node_stops(h: Harness) -> None:
    watcher, dying, delayed = h.connect("watcher"), h.connect("dying"), h.connect("delayed")
    cid = watcher.consumer("status")
    ok(delayed.set_will("d", will(), delay_ms=1000))
    delayed.close()
    ok(dying.set_will("k", will()))
    h.broker.wills.discard(h.broker.sessions.values())
    dying.drop()
    h.tick(BASE_MS + 10_000)
    assert watcher.take(cid) == []


def test_a_durable_will_is_stored_when_published() -> None:
    h, store, _ = recorded()
    watcher, dying = h.connect("watcher"), h.connect("dying")
    ok(watcher.create_queue("status"))
    ok(dying.set_will("k", will(durable=True)))
    assert store.messages == []
    dying.close()
    assert [bytes(m[M_BODY]) for m in store.messages] == [b"gone"]


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (will("status.*"), ErrorCode.INVALID),
        (will("bad..address"), ErrorCode.INVALID),
        (will()[:-1], ErrorCode.INVALID),
        ([*will()[:4], 12, *will()[5:]], ErrorCode.INVALID),  # priority out of range
        (will(body=bytes(11)), ErrorCode.RESOURCE_LIMIT),
    ],
)
def test_a_will_that_could_not_be_published_is_refused(message: WireMessage, code: str) -> None:
    h = Harness(CoreSettings(broker=BrokerSection(max_message_bytes=10)))
    watcher, c = h.connect("watcher"), h.connect()
    cid = watcher.consumer("status")
    ok(c.set_will("k", will(body=b"kept")))
    failed(c.set_will("k2", message), code)
    c.close()
    assert bodies(watcher.take(cid)) == [b"kept"]  # the refused one changed nothing


@pytest.mark.parametrize(
    ("key", "delay_ms"), [("", 0), ("k" * (MAX_WILL_KEY + 1), 0), ("k", -1), ("k", MAX_TIME_MS + 1)]
)
def test_a_bad_will_key_or_delay_is_invalid(c: Client, key: str, delay_ms: int) -> None:
    failed(c.set_will(key, will(), delay_ms=delay_ms), ErrorCode.INVALID)
    ok(c.set_will("k" * MAX_WILL_KEY, will(), delay_ms=0))


WILL_USERS = [UserEntry("owner", "pw", ["owner"]), UserEntry("guest", "pw", ["guest"])]
WILL_GRANTS = [
    PermissionEntry("status.#", "send", ["owner"]),
    PermissionEntry("status.#", "consume", ["owner"]),
    PermissionEntry("status.known", "createAddress", ["owner"]),
    PermissionEntry("status.known", "createDurableQueue", ["owner"]),
]


def test_a_will_needs_the_rights_its_publish_would_need() -> None:
    h = Harness(CoreSettings(users=WILL_USERS, permissions=WILL_GRANTS))
    owner, guest = h.connect("o", "owner", "pw"), h.connect("g", "guest", "pw")
    failed(guest.set_will("k", will("status.known")), ErrorCode.FORBIDDEN)  # no send
    failed(owner.set_will("k", will("status.other")), ErrorCode.FORBIDDEN)  # may not auto-create it
    ok(owner.set_will("k", will("status.known")))
    owner.close()
    watcher = h.connect("w", "owner", "pw")
    assert bodies(watcher.take(watcher.consumer("status.known"))) == [b"gone"]


def test_a_will_with_retain_is_copied_to_its_store_once_published() -> None:
    # The MQTT gateway's retained will ([MQTT-3.1.2-17]): a copy to the store address, multicast, with the key
    # properties, no dedup id; an empty body (which clears) never expires. On a link of its own (no gateway
    # carries it), the copy needs its own user's send right on the store.
    rights = ("send", "consume", "createAddress", "createDurableQueue", "createNonDurableQueue")
    grants = [*WILL_GRANTS, *(PermissionEntry("store", right, ["owner"]) for right in rights)]
    h = Harness(CoreSettings(users=WILL_USERS, permissions=grants))
    owner, guest = h.connect("o", "owner", "pw"), h.connect("g", "guest", "pw")
    watcher = h.connect("w", "owner", "pw")
    ok(watcher.create_queue("store", routing=1))
    ok(watcher.create_queue("status.known"))
    stored, live = watcher.consumer("store"), watcher.consumer("status.known")
    key = {"address": "store", "key": {"topic": "status/known"}}
    message = will("status.known", dedup_id="w-1", properties={"p": 1}, expiration_ms=BASE_MS + 60_000)
    failed(guest.set_will("g", will("status.known"), retain=key), ErrorCode.FORBIDDEN)
    failed(owner.set_will("k", message, retain={**key, "address": "status.*"}), ErrorCode.INVALID)
    ok(owner.set_will("k", message, retain={**key, "address": "status.known"}))  # may send there
    failed(owner.set_will("k", message, retain={**key, "address": "elsewhere"}), ErrorCode.FORBIDDEN)
    ok(owner.set_will("k", message, retain=key))
    owner.close()
    assert bodies(watcher.take(live)) == [b"gone"]
    [copy] = watcher.take(stored)
    assert (copy.body, copy.props, copy.message[M_DEDUP]) == (b"gone", {"p": 1, "topic": "status/known"}, None)
    assert copy.message[M_EXPIRATION] == BASE_MS + 60_000
    again = h.connect("o2", "owner", "pw")
    ok(again.set_will("k", will("status.known", b"", expiration_ms=BASE_MS + 60_000), retain=key))
    again.close()
    [cleared] = watcher.take(stored)
    assert (cleared.body, cleared.message[M_EXPIRATION]) == (b"", 0)
    nothing = h.connect("o3", "owner", "pw")
    ok(nothing.set_will("k", will("status.known", b"plain")))  # no retain: no copy
    nothing.close()
    assert bodies(watcher.take(live)) == [b"", b"plain"]
    assert watcher.take(stored) == []


def test_only_the_user_who_set_a_will_may_replace_cancel_or_publish_it() -> None:
    grants = [*WILL_GRANTS, PermissionEntry("status.#", "send", ["guest"])]
    h = Harness(CoreSettings(users=WILL_USERS, permissions=grants))
    owner, guest = h.connect("o", "owner", "pw"), h.connect("g", "guest", "pw")
    watcher = h.connect("w", "owner", "pw")
    ok(watcher.create_queue("status.known"))
    cid = watcher.consumer("status.known")
    ok(owner.set_will("k", will("status.known"), delay_ms=60_000))
    # Held by an open link: another user can neither take the key over nor clear it.
    assert "another user" in failed(guest.set_will("k", will("status.known", b"forged")), ErrorCode.FORBIDDEN)
    failed(guest.set_will("k", None, publish_pending=False), ErrorCode.FORBIDDEN)
    owner.close()
    # Pending (its delay running): another user can neither cancel it nor publish it early.
    failed(guest.set_will("k", None, publish_pending=False), ErrorCode.FORBIDDEN)
    failed(guest.set_will("k", None, publish_pending=True), ErrorCode.FORBIDDEN)
    assert watcher.take(cid) == []
    h.tick(BASE_MS + 60_000)
    assert bodies(watcher.take(cid)) == [b"gone"]  # it went out, untouched
    # The owner's own later link may cancel its pending will.
    again = h.connect("o2", "owner", "pw")
    ok(again.set_will("k", will("status.known", b"second"), delay_ms=60_000))
    again.close()
    ok(h.connect("o3", "owner", "pw").set_will("k", None, publish_pending=False))
    h.tick(BASE_MS + 200_000)
    assert watcher.take(cid) == []
    ok(guest.set_will("k", will("status.known", b"guest's")))  # a free key: anyone's


def test_a_will_to_an_address_that_may_not_be_created_is_not_found() -> None:
    h = Harness(CoreSettings(address_settings=[AddressSettingsEntry(match="#", auto_create_addresses=False)]))
    c = h.connect()
    failed(c.set_will("k", will("nowhere")), ErrorCode.NOT_FOUND)


def test_a_will_that_cannot_be_routed_when_it_fires_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(CoreSettings(address_settings=[AddressSettingsEntry(match="#", auto_create_addresses=False)]))
    c, dying = h.connect(), h.connect("dying")
    ok(c.create_queue("status"))
    ok(dying.set_will("k", will(), delay_ms=100))
    dying.close()
    ok(c.delete_queue("status"))
    ok(c._answer(c.conn.delete_address("status")))
    with caplog.at_level(logging.WARNING, logger="tridentmq.core.broker"):
        h.tick(BASE_MS + 100)
    assert [r.message for r in caplog.records] == ["will dropped"]
    assert not h.broker.wills.book.pending


def test_a_set_will_everywhere_tells_the_other_nodes_when_no_pending_will_is_here(h: Harness) -> None:
    """A client whose last connection went through another core node connects again through this one: the will
    pending there must be cancelled too (MQTT 5, 3.1.3.2.2). The gateway says so when the session was kept."""
    told: list[tuple[str, str, bool]] = []
    h.broker.wills.tell_others = lambda key, user, publish_pending: told.append((key, user, publish_pending))
    dying, back = h.connect("dying"), h.connect("back")
    ok(back.set_will("k", will(), delay_ms=5000, everywhere=True, publish_pending=True))
    ok(back.set_will("j", will()))  # not everywhere: a session nobody kept left no will anywhere
    ok(dying.set_will("i", will(), delay_ms=5000))
    dying.close()
    ok(back.set_will("i", None, everywhere=True))  # pending here: it was this node's, no other node has one
    assert told == [("k", "anonymous", True)]


@pytest.mark.parametrize(("publish_pending", "published"), [(False, []), (True, [b"gone"])])
def test_a_will_key_taken_on_another_node_cancels_or_publishes_the_will_pending_here(
    h: Harness, publish_pending: bool, published: list[bytes]
) -> None:
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", will(), delay_ms=5000))
    dying.close()
    h.broker.wills.taken_elsewhere("k", "someone-else", publish_pending, h.now_ms)  # not its user's: kept
    h.broker.wills.taken_elsewhere("k", "anonymous", publish_pending, h.now_ms)
    h.broker.wills.taken_elsewhere("unknown", "anonymous", publish_pending, h.now_ms)
    h.tick(BASE_MS + 1000)
    assert bodies(watcher.take(cid)) == published
    h.tick(BASE_MS + 60_000)
    assert watcher.take(cid) == []
