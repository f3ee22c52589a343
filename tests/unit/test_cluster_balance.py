"""The broker's routing with other nodes' bindings, in process: what stays here, what is forwarded, what a
redistributor moves."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.broker_harness import ANYCAST, MULTICAST, Harness, bodies, failed, ok, recorded

from tridentmq_core.balancer import Balancer, SelectorCache
from tridentmq_core.forwarder import FORWARD_QUEUE_PREFIX, Direct
from tridentmq_core.forwarding import FORWARD_PROPERTY, ForwardHeader
from tridentmq_core.queues import Consumer
from tridentmq_core.redistribution import Arrivals, Redistributor, due_again, targets
from tridentmq_core.remote_bindings import Binding, RemoteBindings
from tridentmq_core.security import Principal
from tridentmq_core.settings import CoreSettings, PermissionEntry, UserEntry
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import LinkConnection, Role
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import M_BODY, M_ID, M_PROPS, WireMessage


def clustered(policy: str = "ON_DEMAND", down: set[str] | None = None) -> tuple[Harness, RemoteBindings, list[bytes]]:
    """A broker with another node, node-2, whose bindings the test sets; what it sends straight to another
    node is recorded (a node in ``down`` has no connection: what is for it goes to its forward queue)."""
    h = Harness()
    bindings = RemoteBindings("node-1", max_hops=1, max_per_node=1000)
    h.broker.cluster = Balancer(bindings, policy)
    forwarded: list[bytes] = []
    down = set() if down is None else down

    def send_direct(via: str, message: WireMessage, token: int, publisher: Any) -> Direct:
        if via in down:
            return Direct.REFUSED
        forwarded.append(bytes(message[M_BODY]))
        return Direct.SENT

    h.broker.forwarder.send_direct = send_direct
    return h, bindings, forwarded


def binding(queue: str, address: str, routing: int, consumers: int = 1) -> list[Any]:
    return ["node-2", queue, address, routing, None, consumers, None, 1]


def test_a_filtered_subscription_gets_its_messages_when_another_node_has_one_too() -> None:
    """The balancer's plan was made from the queues the first message's filters left, and kept: a blue
    message first, and the red subscription here never got a red one."""
    h, bindings, forwarded = clustered()
    c = h.connect()
    ok(c.create_queue("sub-all", "t", MULTICAST))
    ok(c.create_queue("sub-red", "t", MULTICAST, filter="color = 'red'"))
    every, red = c.consumer("sub-all"), c.consumer("sub-red")
    bindings.replace("node-2", [binding("theirs", "t", MULTICAST)])
    for color in ("blue", "red", "red", "blue"):
        c.publish("t", color.encode(), routing=MULTICAST, properties={"color": color})
    assert bodies(c.take(red)) == [b"red", b"red"]
    assert bodies(c.take(every)) == [b"blue", b"red", b"red", b"blue"]
    assert forwarded == [b"blue", b"red", b"red", b"blue"]


def two_anycast_queues_here_and_q3_there(
    filter_there: str | None = None,
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Twelve messages to address "a": what q1 and q2 here got, and what went to node-2's q3."""
    h, bindings, forwarded = clustered()
    c = h.connect()
    ok(c.create_queue("q1", "a", ANYCAST))
    ok(c.create_queue("q2", "a", ANYCAST))
    first, second = c.consumer("q1"), c.consumer("q2")
    bindings.replace("node-2", [["node-2", "q3", "a", ANYCAST, filter_there, 1, None, 1]])
    for n in range(12):
        c.publish("a", b"%d" % n, routing=ANYCAST, properties={"color": "blue"})
    return bodies(c.take(first)), bodies(c.take(second)), forwarded


def test_two_anycast_queues_here_and_one_there_all_get_messages() -> None:
    """The same plan made from one message's anycast turn starved the other local queue."""
    to_first, to_second, forwarded = two_anycast_queues_here_and_q3_there()
    assert to_first  # each of the three gets some
    assert to_second
    assert forwarded
    assert sorted(to_first + to_second + forwarded) == sorted(b"%d" % n for n in range(12))  # each once


def test_when_no_remote_queue_takes_the_message_one_local_anycast_queue_still_does() -> None:
    to_first, to_second, forwarded = two_anycast_queues_here_and_q3_there("color = 'red'")  # q3 takes red only
    assert forwarded == []
    assert to_first
    assert to_second
    assert sorted(to_first + to_second) == sorted(b"%d" % n for n in range(12))  # each to one queue only


def durable_sub(node: str, queue: str = "sub", consumers: int = 1) -> list[Any]:
    return [node, queue, "t", MULTICAST, None, consumers, None, 1, True]


def waiting_for(h: Harness, node: str) -> list[tuple[bytes, tuple[str, ...]]]:
    """What waits in ``node``'s store-and-forward queue here: bodies and the queues there they are for."""
    queue = h.broker.queues.get(FORWARD_QUEUE_PREFIX + node)
    if queue is None:
        return []
    return [(bytes(m[M_BODY]), ForwardHeader.decode(m[M_PROPS][FORWARD_PROPERTY]).queues) for m in queue.messages()]


def test_a_publish_for_a_durable_subscription_on_a_node_that_is_down_waits_for_it_here() -> None:
    """Issue 21: the subscription's node was killed (or its pair was failing over); its bindings were dropped
    with its connection, and a publish that matched nothing else was confirmed and routed nowhere."""
    down = {"node-2"}
    h, bindings, forwarded = clustered(down=down)
    c = h.connect()
    bindings.replace("node-2", [durable_sub("node-2"), ["node-2", "temp", "t", MULTICAST, None, 1, None, 1, False]])
    bindings.depart("node-2")
    seq = c.publish("t", b"during the gap", routing=MULTICAST, durable=True)
    assert seq in c.confirmed
    assert waiting_for(h, "node-2") == [(b"during the gap", ("sub",))]  # stored, for its subscription only
    assert h.broker.counters.unrouted == 0
    # Its subscriber came back through another node, which has the subscription now, with a consumer: new
    # messages go there, not to the node that is down.
    down.discard("node-3")
    bindings.replace("node-3", [durable_sub("node-3")])
    c.publish("t", b"after the move", routing=MULTICAST, durable=True)
    assert forwarded == [b"after the move"]
    assert len(waiting_for(h, "node-2")) == 1
    # node-2 is declared gone: what waits for it goes to the subscription that lives on.
    assert h.broker.reroute_forward_queue("node-2", h.now_ms) == 1
    assert waiting_for(h, "node-2") == []
    assert waiting_for(h, "node-3") == [(b"during the gap", ("sub",))]


def test_what_waits_for_a_subscription_that_exists_only_on_a_gone_node_stays_for_it() -> None:
    h, bindings, _ = clustered(down={"node-2"})
    c = h.connect()
    bindings.replace("node-2", [durable_sub("node-2")])
    bindings.depart("node-2")
    c.publish("t", b"kept", routing=MULTICAST, durable=True)
    assert h.broker.reroute_forward_queue("node-2", h.now_ms) == 0
    assert waiting_for(h, "node-2") == [(b"kept", ("sub",))]


def test_a_live_instance_of_the_subscription_is_preferred_to_one_on_a_node_that_is_down() -> None:
    """ON_DEMAND without consumers keeps a message here; STRICT takes turns over the instances it can reach."""
    for policy in ("ON_DEMAND", "STRICT"):
        h, bindings, _ = clustered(policy, down={"node-2"})
        c = h.connect()
        ok(c.create_queue("sub", "t", MULTICAST))
        bindings.replace("node-2", [durable_sub("node-2", consumers=3)])
        bindings.depart("node-2")
        c.send_all("t", [b"1", b"2", b"3"], routing=MULTICAST, durable=True)
        assert waiting_for(h, "node-2") == [], policy
        assert len(h.broker.queues["sub"]) == 3, policy


class Moved(LinkConnection):
    """The broker side of a cluster connection, as the cluster manager's: records what it is handed to move."""

    def __init__(self) -> None:
        super().__init__(Role.SERVER)
        self.moved: list[bytes] = []

    def deliver(self, consumer_id: int, delivery_count: int, message: WireMessage) -> None:
        self.moved.append(bytes(message[M_BODY]))


def test_messages_a_redistributor_passed_over_for_their_residence_move_once_it_is_over() -> None:
    """Issue 21, stuck messages: a queue offers its messages to its consumers only when something happens to
    it. Messages that had just arrived from another node were passed over by the redistributor, and nothing
    offered them again: they stayed, the redistributor the queue's only consumer, nothing in flight."""
    h = Harness()
    c = h.connect()
    ok(c.create_queue("work", "work", ANYCAST))
    c.send_all("work", [b"old", b"new-1", b"new-2"])
    queue = h.broker.queues["work"]
    new = [m[M_ID] for m in queue.messages()][1:]
    arrivals = h.broker.forwarder.arrivals
    for message_id in new:
        arrivals.add(message_id, h.now_ms)  # forwarded here from another node just now
    port = Moved()
    principal = Principal("cluster:node-2", frozenset(), unrestricted=True, cluster=True)
    session = h.broker.open_session(port, "bridge", principal, "127.0.0.1", "cluster:node-2", h.now_ms)
    target = Binding("node-2", "work", "work", ANYCAST, None, 1, None, 1, "node-2")
    mover = Redistributor(
        7,
        session,
        queue,
        100,
        target=target,
        selectors=SelectorCache(),
        arrivals=arrivals,
        min_residence_ms=2000,
        clock=lambda: h.now_ms,
    )
    h.broker.consuming.add_forwarder(session, mover)
    h.sync()
    assert port.moved == [b"old"]
    assert mover.retry_at == h.now_ms + 2000
    h.tick(h.now_ms + 1999)
    assert not due_again(mover, h.now_ms)
    h.tick(h.now_ms + 1)
    h.sync()
    assert port.moved == [b"old"]  # nothing happened to the queue: without being offered again they stay
    assert due_again(mover, h.now_ms)
    assert not due_again(mover, h.now_ms)  # once
    h.broker.offer_again(queue)
    h.sync()
    assert port.moved == [b"old", b"new-1", b"new-2"]


@pytest.mark.parametrize("mover", ["redistributor", "forward queue"])
def test_a_move_to_another_node_goes_out_once_its_delivery_attempt_is_safe(mover: str) -> None:
    """Issue 21, duplicates without the redelivered flag. A backup that took over delivered again messages its
    primary had just moved to another node (which delivered them): the move was recorded nowhere. And a
    store-and-forward copy sent before it was safe reached the other node while its producer, unconfirmed,
    sent it again to the pair's next active node, which routed it anew. A forwarder's move is recorded as a
    delivery attempt, and goes only once that is safe, as a client's delivery does."""
    h, store, _ = recorded(hold_attempts=True)
    c = h.connect()
    ok(c.create_queue("work", "work", ANYCAST, durable=True))
    c.send_all("work", [b"a", b"b"], durable=True)
    queue = h.broker.queues["work"]
    port = Moved()
    principal = Principal("cluster:node-2", frozenset(), unrestricted=True, cluster=True)
    session = h.broker.open_session(port, "bridge", principal, "127.0.0.1", "cluster:node-2", h.now_ms)
    if mover == "redistributor":
        target = Binding("node-2", "work", "work", ANYCAST, None, 1, None, 1, "node-2")
        consumer: Consumer = Redistributor(
            7,
            session,
            queue,
            100,
            target=target,
            selectors=SelectorCache(),
            arrivals=h.broker.forwarder.arrivals,
            min_residence_ms=0,
            clock=lambda: h.now_ms,
        )
    else:
        consumer = Consumer(7, session, queue, 100)
        consumer.forwarder = True  # as a cluster connection makes the one of its store-and-forward queue
    h.broker.consuming.add_forwarder(session, consumer)
    h.sync()
    assert store.attempts == [("work", [1, 2], [1, 1])]  # recovered, they come back with one attempt each
    assert port.moved == []
    h.broker.on_durable(1)
    h.sync()
    assert port.moved == [b"a", b"b"]


def test_a_resend_to_the_next_life_of_a_node_goes_where_the_publish_was_written_through() -> None:
    """Issue 21, duplicates without the redelivered flag. A durable publish written through to another node
    is stored nowhere here. When this node died after that node had stored it but before its producer heard
    so, the producer sent it again to this node's next life (its backup), whose balancing picked a third
    node: two first deliveries (6 of 9 of the link's in a 30-minute randomised run). The store now notes
    where each went, and the next life sends a resend there again, under the same transfer id, where it is
    a duplicate if it arrived."""
    first, store, _ = recorded()
    bindings = RemoteBindings("node-1", max_hops=1, max_per_node=1000)
    first.broker.cluster = Balancer(bindings, "ON_DEMAND")
    sent: list[tuple[str, WireMessage]] = []

    def send_direct(via: str, message: WireMessage, token: int, publisher: Any) -> Direct:
        sent.append((via, message))
        return Direct.SENT

    first.broker.forwarder.send_direct = send_direct
    bindings.replace("node-2", [binding("work", "work", ANYCAST)])
    first.connect().publish("work", b"once", durable=True, dedup_id="producer-7")
    ((via, message),) = sent
    assert via == "node-2"
    assert [(dedup_id, node_id) for dedup_id, node_id, _ in store.through] == [("producer-7", "node-2")]
    snapshot = first.broker.durable_snapshot()
    assert [entry[:2] for entry in snapshot.through_ids] == [("producer-7", "node-2")]  # a compaction keeps it
    assert "producer-7" not in dict(snapshot.dedup_ids)  # not confirmed: no duplicate yet

    # The next life: node-2's consumer went away and node-3 has one now, so balancing alone would pick node-3.
    h, bindings = Harness(), RemoteBindings("node-1", max_hops=1, max_per_node=1000)
    h.broker.cluster = Balancer(bindings, "ON_DEMAND")
    h.broker.restore(RecoveredState(through_ids={"producer-7": ("node-2", h.now_ms)}), h.now_ms)
    sent.clear()
    h.broker.forwarder.send_direct = send_direct
    bindings.replace("node-2", [binding("work", "work", ANYCAST, consumers=0)])
    bindings.replace("node-3", [["node-3", "work", "work", ANYCAST, None, 1, None, 1]])
    h.connect().publish("work", b"once", durable=True, dedup_id="producer-7")
    h.connect().publish("work", b"new", durable=True, dedup_id="producer-8")
    assert [(via, bytes(m[M_BODY])) for via, m in sent] == [("node-2", b"once"), ("node-3", b"new")]
    transfer = [ForwardHeader.decode(m[M_PROPS][FORWARD_PROPERTY]).dedup_id for m in (message, sent[0][1])]
    assert transfer[0] == transfer[1] == "p:node-1:producer-7"  # the same transfer id: a duplicate if it got it


def test_a_publish_written_through_leaves_only_once_the_note_of_where_it_went_is_safe() -> None:
    """Issue 21, duplicates without the redelivered flag: the last cause left in the 30-minute randomised runs.
    The note of where a written-through publish went reached the journal and the backup at the end of the
    turn, after the publish had left. A partition of this node just then let the other node store the
    message while the backup never got the note; the producer sent it again to the backup, whose balancing
    picked a third node. Now the publish leaves once its note is safe, with its producer's credit; a later
    send to the same node waits behind it; one the link cannot take by then is stored here and forwarded."""
    h, store, _ = recorded(hold_notes=True)
    bindings = RemoteBindings("node-1", max_hops=1, max_per_node=1000)
    h.broker.cluster = Balancer(bindings, "ON_DEMAND")
    sent: list[bytes] = []
    link_takes = [True]

    def send_direct(via: str, message: WireMessage, token: int, publisher: Any) -> Direct:
        if not link_takes[0]:
            return Direct.REFUSED
        sent.append(bytes(message[M_BODY]))
        return Direct.SENT

    h.broker.forwarder.send_direct = send_direct
    bindings.replace("node-2", [binding("work", "work", ANYCAST)])
    c = h.connect()
    credit = c.conn.publish_credit
    durable = c.publish("work", b"durable", durable=True, dedup_id="p-1")
    c.publish("work", b"fast")  # not durable, nothing to note: behind the first all the same
    assert sent == []
    assert [entry[:2] for entry in store.through] == [("p-1", "node-2")]
    assert c.conn.publish_credit == credit - 2  # their producer's credit waits with them
    h.broker.on_durable(store.note_tokens[0])
    h.sync()
    assert sent == [b"durable", b"fast"]
    assert c.conn.publish_credit == credit
    assert durable not in c.confirmed  # written through: confirmed when node-2 confirms it

    link_takes[0] = False
    later = c.publish("work", b"later", durable=True, dedup_id="p-2")
    h.broker.on_durable(store.note_tokens[1])
    h.sync()
    assert sent == [b"durable", b"fast"]
    assert [bytes(m[M_BODY]) for m in store.messages] == [b"later"]  # stored here after all
    assert [bytes(m[M_BODY]) for m in h.broker.queues[FORWARD_QUEUE_PREFIX + "node-2"].messages()] == [b"later"]
    assert later in c.confirmed  # the recording store's writes are safe at once


def test_a_queue_of_a_node_scaling_down_counts_as_elsewhere_until_that_node_is_gone() -> None:
    """Issue 21, a loss in the 30-minute randomised run over up --nodes 3: an MQTT client reconnected while
    the node holding its session record scaled down. That node's bindings went with its first update, so the
    gateway's lookup found the record nowhere ("not elsewhere") while it was on its way here: a new session,
    whose SUBSCRIBE dropped the subscription's queue, with messages in it, as an earlier session's. A durable
    queue of a node that scales down now counts as elsewhere until that node is gone: the gateway waits for
    the record (or refuses the client for now) instead."""
    h, bindings, _ = clustered()
    record = "$mqtt.session.client-7"
    bindings.replace("node-2", [[*binding(record, record, ANYCAST, consumers=0), True], binding("tmp", "tmp", ANYCAST)])
    c = h.connect()
    made = c.create_queue(record, record, ANYCAST, durable=True)  # the gateway's, to hold the session here
    assert isinstance(made, ev.Reply), made
    assert made.result["elsewhere"] == ["node-2"]

    def elsewhere() -> object:
        answer = c.create_queue(record, record, ANYCAST, durable=True, passive=True)
        assert isinstance(answer, ev.Reply), answer
        return answer.result.get("elsewhere")

    assert elsewhere() == ["node-2"]
    bindings.leave("node-2", lambda queue, address: queue in h.broker.queues)  # its bindings go with this update
    bindings.apply("node-2", [], [["node-2", record], ["node-2", "tmp"]])
    assert bindings.for_queue(record) == []  # no destination (this node has one): it takes nothing new
    assert elsewhere() == ["node-2"]  # but what it held is on its way
    assert bindings.moving("tmp", "tmp") == []  # a non-durable queue is not moved: nothing to wait for
    bindings.depart("node-2")  # gone
    assert elsewhere() is None


def test_a_subscribe_on_condition_new_takes_no_queue_another_node_holds_one_of_and_made_does() -> None:
    """An MQTT session lock: made here while another node holds the owner's, the connection must send its
    takeover notice before it consumes (a consumer here would take the notice itself)."""
    h, bindings, _ = clustered()
    bindings.replace("node-2", [binding("lock", "lock", ANYCAST)])
    c = h.connect()
    spec = {"name": "lock", "address": "lock", "routing_type": ANYCAST, "durable": False, "max_consumers": 1}
    _, answer = c.subscribe("lock", 1, queue=spec, **{"if": "new"})
    assert ok(answer) == {"made": {"created": True, "queue": "lock", "address": "lock", "elsewhere": ["node-2"]}}
    assert h.broker.queues["lock"].consumers == []
    ok(c.delete_queue("lock"))
    consumer, answer = c.subscribe("lock", 1, queue=spec, **{"if": "made"})
    assert ok(answer)["made"]["elsewhere"] == ["node-2"]
    assert [x.id for x in h.broker.queues["lock"].consumers] == [consumer]


def test_a_passive_look_names_the_nodes_that_hold_a_queue_not_here() -> None:
    """An MQTT gateway looks before making a clean session's record queue: none here and none elsewhere, and
    nothing is made (nor deleted again); held by another node, it fetches the record."""
    h, bindings, _ = clustered()
    record = "$mqtt.session.client-8"
    bindings.replace("node-2", [binding(record, record, ANYCAST, consumers=0)])
    c = h.connect()
    answer = c.create_queue(record, record, ANYCAST, durable=True, passive=True)
    assert isinstance(answer, ev.Reply), answer
    assert answer.result["exists"] is False
    assert answer.result["elsewhere"] == ["node-2"]
    nowhere = c.create_queue("$mqtt.session.client-9", "$mqtt.session.client-9", ANYCAST, passive=True)
    assert isinstance(nowhere, ev.Reply), nowhere
    assert "elsewhere" not in nowhere.result
    assert record not in h.broker.queues


def test_a_description_tells_a_queue_of_its_own_from_a_subscriptions_here_and_on_other_nodes() -> None:
    """A gateway ends or replaces a durable subscription (``<client id>.<name>``) only when every queue of that
    name is a subscription's: a plain queue's name may be the same. A description never fails on another
    address or routing type, as a passive look does, and makes nothing."""
    h, bindings, _ = clustered()
    c = h.connect()
    assert isinstance(c.create_queue("orders.eu", "orders.eu", ANYCAST), ev.Reply)
    assert isinstance(c.create_queue("app.sub", "news", MULTICAST), ev.Reply)
    bindings.replace("node-2", [binding("app.sub", "news", MULTICAST), binding("app.other", "x", ANYCAST)])

    def described(name: str) -> dict[str, Any]:
        answer = c.create_queue(name, "ignored", MULTICAST, passive=True, describe=True)
        assert isinstance(answer, ev.Reply), answer
        return dict(answer.result)

    plain = described("orders.eu")
    assert (plain["exists"], plain["address"], plain["routing_type"], plain["temporary"]) == (
        True,
        "orders.eu",
        ANYCAST,
        False,
    )
    assert "elsewhere_routing_types" not in plain
    sub = described("app.sub")
    assert (sub["routing_type"], sub["elsewhere_routing_types"]) == (MULTICAST, [MULTICAST])
    other = described("app.other")
    assert (other["exists"], other["elsewhere_routing_types"]) == (False, [ANYCAST])
    assert "ignored" not in h.broker.addresses


def test_redistribution_targets_are_every_reachable_node_with_consumers_for_the_queue() -> None:
    h = Harness()
    ok(h.connect().create_queue("paint", "paint", ANYCAST))
    queue = h.broker.queues["paint"]
    few = Binding("node-2", "paint", "paint", ANYCAST, None, 1, ("color = 'red'",), 1, "node-2")
    many = Binding("node-3", "paint", "paint", ANYCAST, None, 3, None, 1, "node-3")
    none = Binding("node-4", "paint", "paint", ANYCAST, None, 0, None, 1, "node-4")
    elsewhere = Binding("node-5", "paint", "other", ANYCAST, None, 2, None, 1, "node-5")
    down = Binding("node-6", "paint", "paint", ANYCAST, None, 2, None, 1, "node-6").unreachable()
    assert [b.node_id for b in targets(queue, [few, many, none, elsewhere, down])] == ["node-3", "node-2"]


def test_a_backlog_goes_to_the_nodes_whose_consumers_take_it_and_is_spread_over_them() -> None:
    """Issue 21: with 200 red and 200 blue on A, B's consumer selecting red and C's taking all, blue stayed on
    A (the one redistributor went to B). One redistributor per node with consumers, each taking what a
    consumer there takes: red goes to B and C in turn, blue to C only."""
    h = Harness()
    c = h.connect()
    ok(c.create_queue("paint", "paint", ANYCAST))
    painted = [f"{color}-{i}".encode() for color in ("red", "blue") for i in range(20)]
    for body in painted:
        c.publish("paint", body, properties={"color": body.split(b"-")[0].decode()})
    queue = h.broker.queues["paint"]
    principal = Principal("cluster:peers", frozenset(), unrestricted=True, cluster=True)
    ports = {}
    # Unpaced: pacing is the cluster tick's, tested on real nodes (tests/integration/test_cluster.py).
    for node_id, selectors in (("node-2", ("color = 'red'",)), ("node-3", None)):
        port = ports[node_id] = Moved()
        session = h.broker.open_session(port, "bridge", principal, "127.0.0.1", f"cluster:{node_id}", h.now_ms)
        target = Binding(node_id, "paint", "paint", ANYCAST, None, 1, selectors, 1, node_id)
        mover = Redistributor(
            2,
            session,
            queue,
            1000,
            target=target,
            selectors=SelectorCache(),
            arrivals=Arrivals(),
            min_residence_ms=2000,
            clock=lambda: h.now_ms,
            paced=False,
        )
        h.broker.consuming.add_forwarder(session, mover)
    h.sync()
    to_b, to_c = ports["node-2"].moved, ports["node-3"].moved
    assert len(queue) == 0
    assert sorted(to_b + to_c) == sorted(painted)
    assert to_b
    assert all(body.startswith(b"red") for body in to_b)
    assert sum(body.startswith(b"blue") for body in to_c) == 20
    assert 0 < len([b for b in to_c if b.startswith(b"red")]) < 20  # red is shared, not all sent to one node


def test_a_queue_deleted_everywhere_goes_here_and_its_copies_are_deleted_on_their_nodes_before_the_reply() -> None:
    """DELETE_QUEUE_EVERYWHERE: the copy here goes at once; the other nodes holding a queue of that name are
    asked (the cluster manager's part), and the client's answer waits for theirs."""
    h, bindings, _ = clustered()
    asked: list[tuple[int, str, list[str]]] = []
    h.broker.delete_elsewhere = lambda session, req_id, queue, nodes: asked.append((req_id, queue, nodes))
    c = h.connect()
    ok(c.create_queue("sub.c1", "t.#", MULTICAST))
    bindings.replace("node-2", [binding("sub.c1", "t.#", MULTICAST, consumers=0)])
    req_id = c.conn.delete_queue("sub.c1", everywhere=True)
    h.sync()
    assert "sub.c1" not in h.broker.queues
    assert asked == [(req_id, "sub.c1", ["node-2"])]
    assert c.events(ev.Reply) == []  # the manager replies once node-2 answered
    # Only another node's copy: deleted there all the same; none anywhere: not found.
    ok(c.create_queue("elsewhere-only.x", "x", MULTICAST))
    ok(c.delete_queue("elsewhere-only.x"))
    bindings.replace("node-2", [binding("elsewhere-only.x", "x", MULTICAST, consumers=0)])
    c.conn.delete_queue("elsewhere-only.x", everywhere=True)
    h.sync()
    assert asked[-1][1:] == ("elsewhere-only.x", ["node-2"])
    failed(c.delete_queue("nowhere", everywhere=True), ErrorCode.NOT_FOUND)


def test_a_queue_deleted_everywhere_without_copies_elsewhere_is_answered_at_once() -> None:
    h, _, _ = clustered()
    h.broker.delete_elsewhere = lambda *_: pytest.fail("no other node holds the queue")
    c = h.connect()
    ok(c.create_queue("solo", "solo"))
    assert ok(c.delete_queue("solo", everywhere=True)) is None
    assert "solo" not in h.broker.queues


def test_deleting_everywhere_needs_the_right_to_delete_each_copy() -> None:
    """A copy on another node is checked against its address and durability as the copy here would be:
    refused, nothing is deleted anywhere."""
    users = [UserEntry("u", "p", ["app"])]
    grants = [
        PermissionEntry("#", "createAddress", ["app"]),
        PermissionEntry("#", "createDurableQueue", ["app"]),
        PermissionEntry("mine.#", "deleteDurableQueue", ["app"]),
    ]
    h = Harness(CoreSettings(users=users, permissions=grants))
    bindings = RemoteBindings("node-1", max_hops=1, max_per_node=1000)
    h.broker.cluster = Balancer(bindings, "ON_DEMAND")
    asked: list[str] = []
    h.broker.delete_elsewhere = lambda session, req_id, queue, nodes: asked.append(queue)
    c = h.connect("u", "u", "p")
    ok(c.create_queue("q", "mine.a"))
    copy = ["node-2", "q", "theirs.a", MULTICAST, None, 0, None, 1, True]  # durable
    bindings.replace("node-2", [copy])
    failed(c.delete_queue("q", everywhere=True), ErrorCode.FORBIDDEN)
    assert "q" in h.broker.queues
    assert asked == []
