"""What a node's push tells the nodes that joined it about its own queues: what changed since the last push,
kept up to date from the queues' notes rather than found by comparing every queue's binding each time. In
process with a real broker; the joined node is a link client of it."""

from __future__ import annotations

from typing import Any

from tests.unit.broker_harness import Client, Harness, ok

from tridentmq_core.cluster.bridge import Bridge
from tridentmq_core.cluster.manager import ClusterManager, Joined
from tridentmq_shared.link import events as ev
from tridentmq_shared.message import new_message

OTHER = "node-2"


def _joined(h: Harness) -> tuple[ClusterManager, Client]:
    manager = ClusterManager(
        h.broker, h.settings, node_id="node-1", name="one", advertise=("127.0.0.1", 1), schedule_flush=lambda: None
    )
    theirs = h.connect("cluster:node-2")
    joined = Joined(theirs.session, OTHER, knows_backlog=True)
    joined.sent = manager._advertisement(OTHER)
    joined.members_sent = manager.members_view()
    manager.joined[theirs.session.conn_id] = joined
    return manager, theirs


def _pushed(h: Harness, manager: ClusterManager, theirs: Client) -> list[dict[str, Any]]:
    manager._push_updates()
    h.sync()
    updates = [event.update for event in theirs.inbox if isinstance(event, ev.TopologyUpdate)]
    theirs.inbox.clear()
    return updates


def _bound(update: dict[str, Any]) -> dict[str, list[Any]]:
    return {wire[1]: wire for wire in update.get("bindings", ())}


def test_a_push_tells_a_joined_node_what_changed_of_this_nodes_queues_and_nothing_else() -> None:
    h = Harness()
    c = h.connect()
    for i in range(20):
        ok(c.create_queue(f"q{i}"))
    manager, theirs = _joined(h)
    assert {name for _, name in manager._advertisement(OTHER)} == {f"q{i}" for i in range(20)}
    assert _pushed(h, manager, theirs) == []  # nothing changed since it joined

    ok(c.create_queue("new"))
    consumer = c.consumer("q3", credit=1)
    ok(c.delete_queue("q7"))
    [update] = _pushed(h, manager, theirs)
    assert set(_bound(update)) == {"new", "q3"}
    assert _bound(update)["q3"][5] == 1  # its consumer
    assert update["removed"] == [["node-1", "q7"]]

    c.publish("q3", b"taken")
    c.publish("q3", b"waits")  # its only consumer has a full window: a backlog here
    [update] = _pushed(h, manager, theirs)
    [wire] = update["bindings"]
    assert wire[:2] == ["node-1", "q3"]
    assert wire[10:] == [True]  # the backlog flag
    c.ack(consumer, [d.id for d in c.take(consumer)])
    c.flow(consumer, 1)
    h.sync()
    [update] = _pushed(h, manager, theirs)
    assert update["bindings"] == [wire[:9]]  # taken: no backlog

    manager.leaving = True  # scaling down: it advertises nothing
    [update] = _pushed(h, manager, theirs)
    assert update["leaving"] is True
    assert sorted(name for _, name in update["removed"]) == sorted({f"q{i}" for i in range(20)} - {"q7"} | {"new"})
    manager.leaving = False  # and back
    [update] = _pushed(h, manager, theirs)
    assert set(_bound(update)) == {f"q{i}" for i in range(20)} - {"q7"} | {"new"}
    assert _pushed(h, manager, theirs) == []


def test_the_durable_queues_kept_for_a_node_that_is_down_are_relayed_while_it_is_down() -> None:
    """A node that joins, or a backup that takes over, while another is down learns that one's durable queues
    from the others; they are relayed again only when what is kept changed."""
    h = Harness()
    manager, theirs = _joined(h)
    durable = ["node-3", "sub", "news", 1, None, 1, None, 1, True]
    manager.bindings.replace("node-3", [durable])
    assert _pushed(h, manager, theirs) == []  # up: it tells the others itself
    manager.bindings.depart("node-3")
    [update] = _pushed(h, manager, theirs)
    assert update["bindings"] == [["node-3", "sub", "news", 1, None, 0, [], 1, True, False]]  # unreachable
    ok(h.connect().create_queue("mine"))
    [update] = _pushed(h, manager, theirs)
    assert [wire[1] for wire in update["bindings"]] == ["mine"]
    manager.bindings.replace("node-3", [durable])  # back
    [update] = _pushed(h, manager, theirs)
    assert update["removed"] == [["node-3", "sub"]]


async def test_a_will_key_taken_everywhere_goes_to_the_joined_nodes_with_the_next_push() -> None:
    """A client connected again through this node while its delayed will waited on another: that node is
    told, and cancels it (MQTT 5, 3.1.3.2.2)."""
    h = Harness()
    manager, theirs = _joined(h)
    back = h.connect()
    ok(back.set_will("k", None, everywhere=True))
    [update] = _pushed(h, manager, theirs)
    assert update == {"wills_taken": [["k", "anonymous", False]]}
    assert _pushed(h, manager, theirs) == []  # told once


async def test_a_will_key_taken_on_another_node_cancels_the_will_pending_here() -> None:
    h = Harness()
    manager, _ = _joined(h)
    watcher, dying = h.connect("watcher"), h.connect("dying")
    cid = watcher.consumer("status")
    ok(dying.set_will("k", new_message("status", b"gone"), delay_ms=5000))
    dying.close()
    bridge = Bridge(manager, "127.0.0.1", 2)
    bridge.node_id = OTHER
    manager.apply_update(bridge, {"wills_taken": [["k", "anonymous", False]]})
    manager.apply_update(bridge, {"wills_taken": [["k", 7, False]]})  # malformed: refused, logged
    h.tick(h.now_ms + 60_000)
    assert watcher.take(cid) == []
