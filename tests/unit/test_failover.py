"""The link client's failover rules, with a fake ``open_node``: which nodes it tries, in what order, when it
gives up, and how a re-sent publish names its first node."""

from __future__ import annotations

import asyncio

import pytest

from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.failover import FATAL, ReconnectPolicy, connect_first, homed, reach_backup
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.topology import LoadBalancing, Topology
from tridentmq_shared.message import HOME_PROPERTY, M_PROPS, new_message

A, B, C = ("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1)
QUICK = ReconnectPolicy(retry_interval=0.001, multiplier=2.0, max_interval=0.004, failover_window=0.2)


class Nodes:
    """Stands for the network: each node answers with what ``answers`` says (None: it accepts)."""

    def __init__(self, **answers: list[BaseException | None]) -> None:
        self.answers = answers
        self.tried: list[tuple[str, int]] = []
        self.closed = False

    async def open_node(self, host: str, port: int) -> None:
        self.tried.append((host, port))
        script = self.answers.get(host, [])
        answer = script.pop(0) if script else OSError("refused")
        if answer is not None:
            raise answer

    def stop_if_closed(self) -> None:
        if self.closed:
            raise LinkClosedError(ErrorCode.EOF, "the client was closed")


def first_element(*endpoints: tuple[str, int]) -> Topology:
    return Topology(list(endpoints), LoadBalancing.FIRST_ELEMENT)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_the_failed_node_is_tried_last_and_the_first_that_answers_is_kept() -> None:
    nodes = Nodes(**{"10.0.0.2": [OSError("down")], "10.0.0.3": [None], "10.0.0.1": [None]})
    run(connect_first(first_element(A, B, C), QUICK, nodes.open_node, nodes.stop_if_closed, 1, failed=A))
    assert nodes.tried == [B, C]


def test_a_single_node_that_failed_is_tried_again_until_it_answers() -> None:
    nodes = Nodes(**{"10.0.0.1": [OSError("down"), TimeoutError(), None]})
    run(connect_first(first_element(A), QUICK, nodes.open_node, nodes.stop_if_closed, -1, failed=A))
    assert nodes.tried == [A, A, A]


def test_after_its_attempts_the_last_problem_is_raised_with_its_cause() -> None:
    nodes = Nodes()
    with pytest.raises(LinkClosedError, match=r"cannot connect to 10\.0\.0\.2:1") as raised:
        run(connect_first(first_element(A, B), QUICK, nodes.open_node, nodes.stop_if_closed, 2))
    assert nodes.tried == [A, B, A, B]
    assert isinstance(raised.value.__cause__, OSError)


@pytest.mark.parametrize("code", FATAL)
def test_a_refusal_every_node_would_repeat_ends_the_attempts_at_once(code: str) -> None:
    nodes = Nodes(**{"10.0.0.1": [LinkClosedError(code, "no")], "10.0.0.2": [None]})
    with pytest.raises(LinkClosedError) as raised:
        run(connect_first(first_element(A, B), QUICK, nodes.open_node, nodes.stop_if_closed, -1))
    assert raised.value.code == code
    assert nodes.tried == [A]


def test_a_node_that_turns_the_link_away_passes_it_to_the_next() -> None:
    busy = LinkClosedError(ErrorCode.RESOURCE_LIMIT, "too many links")
    nodes = Nodes(**{"10.0.0.1": [busy], "10.0.0.2": [None]})
    run(connect_first(first_element(A, B), QUICK, nodes.open_node, nodes.stop_if_closed, 1))
    assert nodes.tried == [A, B]


def test_a_closed_client_stops_trying() -> None:
    nodes = Nodes()

    async def close_soon() -> None:
        task = asyncio.ensure_future(connect_first(first_element(A), QUICK, nodes.open_node, nodes.stop_if_closed, -1))
        await asyncio.sleep(0.02)
        nodes.closed = True
        with pytest.raises(LinkClosedError, match="closed"):
            await asyncio.wait_for(task, 1.0)

    run(close_soon())


def with_backup() -> Topology:
    topology = first_element(A, B)
    topology.update(
        [
            {"node_id": "a", "host": A[0], "port": A[1], "backup": list(C)},
            {"node_id": "b", "host": B[0], "port": B[1]},
        ]
    )
    return topology


def test_the_backup_of_the_failed_node_is_waited_for_until_it_takes_over() -> None:
    topology = with_backup()
    assert topology.backup_of(A) == C
    nodes = Nodes(**{"10.0.0.3": [LinkClosedError(ErrorCode.EOF, "not active"), OSError("not yet"), None]})
    assert run(reach_backup(topology, QUICK, nodes.open_node, nodes.stop_if_closed, A)) is True
    assert nodes.tried == [C, C, C]


def test_a_backup_that_does_not_take_over_in_the_window_gives_way_to_the_other_nodes() -> None:
    nodes = Nodes()
    assert run(reach_backup(with_backup(), QUICK, nodes.open_node, nodes.stop_if_closed, A)) is False
    assert nodes.tried
    assert set(nodes.tried) == {C}
    nodes = Nodes()
    assert run(reach_backup(with_backup(), QUICK, nodes.open_node, nodes.stop_if_closed, B)) is False
    assert nodes.tried == []  # no backup: nothing to wait for


def test_a_re_sent_durable_publish_names_the_node_it_was_first_sent_to() -> None:
    loop = asyncio.new_event_loop()
    future: asyncio.Future[None] = loop.create_future()
    durable = new_message("q", b"x", durable=True, dedup_id="$link:p:1")
    resent = homed((durable, 0, future), "node-a")
    assert resent[0][M_PROPS][HOME_PROPERTY] == "node-a"
    assert resent[0] is not durable
    assert HOME_PROPERTY not in durable[M_PROPS]
    assert homed(resent, "node-b")[0][M_PROPS][HOME_PROPERTY] == "node-a"  # the first node stays named
    fire_and_forget = new_message("q", b"x", durable=False, dedup_id="$link:p:2")
    assert homed((fire_and_forget, 0, future), "node-a")[0] is fire_and_forget
    loop.close()
