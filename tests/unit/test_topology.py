"""Connection load-balancing policies and the topology a gateway's links share (pure: no I/O)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.link.topology import LoadBalancing, Member, Topology, load_balancing, parse_endpoint
from tridentmq_shared.settings import SettingsError

A, B, C, D = ("10.0.0.1", 61616), ("10.0.0.2", 61616), ("10.0.0.3", 61616), ("10.0.0.4", 61616)


def wire(*endpoints: tuple[str, int]) -> list[dict[str, object]]:
    return [{"node_id": f"id-{host}-{port}", "name": host, "host": host, "port": port} for host, port in endpoints]


def firsts(topology: Topology, count: int, failed: tuple[str, int] | None = None) -> list[tuple[str, int]]:
    return [topology.connection_order(failed)[0] for _ in range(count)]


def test_round_robin_starts_at_random_then_goes_in_turn() -> None:
    starts = set()
    for seed in range(20):
        topology = Topology([A, B, C], rng=random.Random(seed))
        chosen = firsts(topology, 6)
        start = [A, B, C].index(chosen[0])
        assert chosen == [[A, B, C][(start + i) % 3] for i in range(6)]
        starts.add(chosen[0])
    assert starts == {A, B, C}  # the start is random


def test_round_robin_is_the_default_and_names_are_case_insensitive() -> None:
    assert Topology([A]).policy.__class__.__name__ == "RoundRobinPolicy"
    assert load_balancing("random_sticky") is LoadBalancing.RANDOM_STICKY
    with pytest.raises(ValueError, match="unknown load balancing policy"):
        load_balancing("LEAST_LOADED")


def test_random_picks_every_node() -> None:
    topology = Topology([A, B, C], LoadBalancing.RANDOM, rng=random.Random(1))
    counts = Counter(firsts(topology, 300))
    assert set(counts) == {A, B, C}
    assert min(counts.values()) > 50


def test_random_sticky_keeps_its_node_while_it_lives() -> None:
    topology = Topology([A, B, C], LoadBalancing.RANDOM_STICKY, rng=random.Random(3))
    chosen = set(firsts(topology, 20))
    assert len(chosen) == 1
    (sticky,) = chosen
    others = [e for e in (A, B, C) if e != sticky]
    topology.update(wire(*others))  # its node left the cluster: another one, then that one
    again = set(firsts(topology, 20))
    assert len(again) == 1
    assert again <= set(others)
    topology.update(wire(A, B, C))  # the first one came back: stay where we are
    assert set(firsts(topology, 5)) == again


def test_first_element_takes_the_first_live_node() -> None:
    topology = Topology([A, B, C], "FIRST_ELEMENT")
    assert firsts(topology, 3) == [A, A, A]
    assert topology.connection_order(failed=A) == [B, C, A]


def test_the_failed_node_goes_last_and_the_others_follow_the_choice() -> None:
    topology = Topology([A, B, C], rng=random.Random(0))
    for _ in range(6):
        order = topology.connection_order(failed=B)
        assert order[-1] == B
        assert sorted(order[:2]) == sorted([A, C])
    order = topology.connection_order()
    assert sorted(order) == sorted([A, B, C])  # every node once, from the chosen one on


def test_members_replace_the_configured_nodes_which_stay_as_a_last_resort() -> None:
    topology = Topology([A], "FIRST_ELEMENT")
    assert topology.clustered is None
    assert topology.update(wire(B, C, A))
    assert topology.clustered
    assert topology.endpoints == [B, C, A]
    assert not topology.update(wire(B, C, A))  # no change
    version = topology.version
    assert topology.update(wire(B, C))  # A left the cluster
    assert topology.version == version + 1
    assert topology.connection_order() == [B, C, A]  # A is still tried, last: it may be back
    assert topology.connection_order(failed=B) == [C, A, B]


def test_malformed_members_are_skipped_and_an_empty_list_changes_nothing() -> None:
    topology = Topology([A])
    assert not topology.update([{"host": "x"}, "junk", {"host": "", "port": 1}, {"host": "h", "port": 70000}])
    assert topology.endpoints == [A]
    assert topology.update([{"host": "h", "port": 1, "node_id": 7}, {"host": "g", "port": True}])
    assert topology.members == (Member("h", 1),)


def test_a_node_outside_a_cluster_leaves_the_configured_nodes() -> None:
    topology = Topology([A, B, A])
    topology.not_clustered()
    assert topology.clustered is False
    assert topology.seeds == (A, B)  # duplicates once
    assert sorted(topology.connection_order()) == [A, B]
    with pytest.raises(ValueError, match="at least one"):
        Topology([])


def test_endpoints_parse_as_host_colon_port() -> None:
    assert parse_endpoint(" node-1:61617 ") == ("node-1", 61617)
    assert parse_endpoint("[::1]:61616") == ("::1", 61616)
    for bad in ("node-1", ":61616", "node:0", "node:http", "node:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_endpoint(bad)


def test_gateway_settings_give_the_endpoints_and_the_reconnect_policy() -> None:
    settings = CoreLinkSettings(
        host="a",
        port=1,
        connectors=["b:2", "c:3"],
        retry_interval_ms=50,
        retry_multiplier=1.5,
        max_retry_interval_ms=400,
        reconnect_attempts=-1,
    )
    assert settings.endpoints() == [("a", 1), ("b", 2), ("c", 3)]
    policy = settings.reconnect_policy()
    assert (
        policy.retry_interval,
        policy.multiplier,
        policy.max_interval,
        policy.attempts,
        policy.initial_attempts,
    ) == (0.05, 1.5, 0.4, -1, 1)
    with pytest.raises(SettingsError, match=r"core\.connectors"):
        CoreLinkSettings(connectors=["nope"]).endpoints()


def test_members_carry_their_backup_and_epoch_and_a_lower_epoch_of_a_node_is_refused() -> None:
    topology = Topology([("127.0.0.1", 1)])
    topology.update([{"host": "h", "port": 2, "node_id": "n", "epoch": 2, "backup": ["h", 3]}])
    assert topology.backup_of(("h", 2)) == ("h", 3)
    assert topology.backup_of(("h", 3)) is None
    assert topology.saw("n", 2)
    assert topology.saw("n", 3)
    assert not topology.saw("n", 2)  # the copy replaced at epoch 3
    assert topology.saw("other", 1)
    topology.update([{"host": "h", "port": 2, "node_id": "n", "epoch": "x", "backup": ["h", 0]}])
    assert topology.members[0].epoch == 0
    assert topology.members[0].backup is None


def test_a_node_cut_off_from_the_others_does_not_make_the_client_forget_the_cluster() -> None:
    """The cut-off node reports itself alone and without its backup: the backup (which takes over) and the
    other nodes are still known, tried after the reported members."""
    topology = Topology([A], "FIRST_ELEMENT")
    members = [{"host": h, "port": p, "node_id": f"id-{h}", "epoch": 1} for h, p in (A, B)]
    members[0]["backup"] = list(C)
    topology.update(members)
    assert topology.backup_of(A) == C
    topology.update([{"host": A[0], "port": A[1], "node_id": f"id-{A[0]}", "epoch": 1}])  # cut off: alone
    assert topology.endpoints == [A]
    assert topology.backup_of(A) == C  # where its pair goes on
    assert topology.connection_order(failed=A) == [B, A]  # the other node is still tried
    # The backup took over at epoch 2 (the same node id, at C): the old copy's view is no member any more.
    topology.update(
        [
            {"host": C[0], "port": C[1], "node_id": f"id-{A[0]}", "epoch": 2},
            {"host": B[0], "port": B[1], "node_id": f"id-{B[0]}", "epoch": 1},
        ]
    )
    assert topology.backup_of(C) is None  # the backup that took over has none yet; not itself
    assert not topology.update([{"host": A[0], "port": A[1], "node_id": f"id-{A[0]}", "epoch": 1}])
    assert topology.endpoints == [C, B]


def reference_order(topology: Topology, failed: tuple[str, int] | None) -> list[tuple[str, int]]:
    """The order worked out from scratch (FIRST_ELEMENT: the first live member leads)."""
    live = [e for e in topology.endpoints if e != failed]
    order = list(live)
    order += [e for e in topology.last_known if e != failed and e not in order]
    order += [e for e in topology.seeds if e != failed and e not in order]
    return [*order, failed] if failed is not None else order


@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.sampled_from([A, B, C, D]), st.integers(1, 3)), max_size=4),
            st.sampled_from([None, A, B, C, D]),
        ),
        max_size=8,
    )
)
def test_the_order_kept_between_changes_is_the_one_worked_out_afresh(
    views: list[tuple[list[tuple[tuple[str, int], int]], tuple[str, int] | None]],
) -> None:
    """A gateway asks for the order once per session it opens: what it keeps follows every change of the
    members and of the nodes known from earlier views (a node moving to another endpoint at a newer epoch)."""
    topology = Topology([A, D], "FIRST_ELEMENT")
    for members, failed in views:
        node_ids = {A: "n1", B: "n2", C: "n3", D: "n1"}  # D: where n1 comes back after a failover
        topology.update([{"host": h, "port": p, "node_id": node_ids[(h, p)], "epoch": e} for (h, p), e in members])
        assert topology.connection_order(failed) == reference_order(topology, failed)
        assert topology.connection_order() == reference_order(topology, None)
