"""What a node's push tells the nodes that joined it about its own queues: what changed since the last push,
kept up to date from the queues' notes rather than found by comparing every queue's binding each time. In
process with a real broker; the joined node is a link client of it."""

from __future__ import annotations

from typing import Any

from tests.unit.broker_harness import Client, Harness, ok

from tridentmq_core.cluster.manager import ClusterManager, Joined
from tridentmq_shared.link import events as ev

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
