"""Sessions carried as channels of one shared link (a gateway's clients): a fault in one ends that one only."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests.unit.gateway_harness import core_settings, eventually, running_core
from tests.unit.loop_turns import LoopTurns

from tridentmq_core import server
from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.channels import ChannelTransport
from tridentmq_shared.link.client import EARLY_WRITE_OPERATIONS
from tridentmq_shared.link.codec import LinkConnection, Role, State
from tridentmq_shared.link.errors import LinkClosedError
from tridentmq_shared.link.ops import HEADER_SIZE, ErrorCode
from tridentmq_shared.message import M_BODY, new_message
from tridentmq_shared.turn_pacer import TurnPacer


async def test_an_unexpected_error_in_one_channels_request_ends_that_channel_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug met by one session's request must not drop the link that carries every other client of the
    gateway (before, asyncio closed the whole connection: every session failed over at once), nor come back:
    the session ends with ``internal`` and does not resume (it would send the same request again, for ever).
    What the session had done before the fault is answered first: its earlier publish is confirmed, once."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        broker = core.node.broker
        handle_request = broker._request
        poisoned = 0

        def with_a_bug(session: Any, event: ev.Event, now_ms: int) -> Any:
            nonlocal poisoned
            if isinstance(event, ev.CreateAddress) and event.address == "poison":
                poisoned += 1
                raise RuntimeError("a bug")
            return handle_request(session, event, now_ms)

        monkeypatch.setattr(broker, "_request", with_a_bug)
        links = core.links
        victim = links.client(user="a", password="a", client_name="victim")
        bystander = links.client(user="b", password="b", client_name="bystander")
        await victim.connect()
        await bystander.connect()
        await bystander.create_queue("kept", durable=False)
        carriers = len(core.node.links)
        confirmed = await victim.send(new_message("kept", b"before the fault"))  # in the same batch as the poison
        with caplog.at_level(logging.ERROR, logger="tridentmq.core"), pytest.raises(LinkClosedError) as ended:
            await victim.create_address("poison")
        await confirmed
        assert ended.value.code == ErrorCode.INTERNAL
        await bystander.create_address("fine")  # its channel, and the link under it, still serve
        assert len(core.node.links) == carriers
        await asyncio.sleep(0.5)  # a resume would have sent the poison again by now
        assert poisoned == 1
        assert not victim.connected
        assert len(core.node.broker.catalog.queues["kept"]) == 1
        assert caplog.text.count("link channel ended on an unexpected error") == 1  # with its traceback
        assert "expected HELLO" not in caplog.text  # no channel made anew of the failed one's input
        await victim.close()
        await bystander.close()


async def test_input_for_a_channel_the_core_ended_makes_no_new_channel(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A session's bytes still on their way when the core ended its channel (a refusal, an error, a fault)
    arrive after the end, in a later read: before, the core took them for a new channel, which failed
    "expected HELLO first" and held a handshake slot meanwhile. Channel ids are never reused on a link, and
    a channel opens only with its HELLO: such input is dropped, and the link and its other sessions go on."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        links = core.links
        ended = links.client(user="a", password="a", client_name="ended")
        bystander = links.client(user="b", password="b", client_name="bystander")
        await ended.connect()
        await bystander.connect()
        channel = ended._protocol.transport if ended._protocol is not None else None
        assert isinstance(channel, ChannelTransport)
        carrier, channel_id = channel.carrier, channel.channel_id
        await ended.close()  # the channel ends on both sides
        [link] = core.node.links.values()
        await eventually(lambda: channel_id not in link.channels, "the core ended the channel")
        handshaking = len(core.node.handshaking)
        # What a session sends after its HELLO: a request, then the end of a large publish cut into chunks.
        late = LinkConnection(Role.CLIENT)
        late.hello(None, None, "late")
        late.data_to_send()
        late.state = State.OPEN
        late.create_address("late", [0])
        request = late.data_to_send()
        with caplog.at_level(logging.INFO, logger="tridentmq.core"):
            for data in (request, request[HEADER_SIZE:], b"\x00"):
                carrier.client._conn.channel(channel_id, data)  # as the shared link writes a session's bytes
                carrier.client._write_now()
                await bystander.create_address("fine")  # the link, and its other session, serve
        assert channel_id not in link.channels
        assert len(core.node.handshaking) == handshaking
        assert "expected HELLO" not in caplog.text
        assert "link closed on protocol error" not in caplog.text
        await bystander.close()


async def test_a_links_input_is_handled_over_several_loop_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link's input is handled for at most ``INPUT_TURN_S`` per loop turn, its sessions' input one channel's
    at a time; the rest waits for a later turn, so the node's output and timers (its heartbeats to every other
    link) go on meanwhile. Before, each read was handled whole in one turn: when 100,000 clients left six
    gateways at once, a turn took seconds and every gateway took its link for dead. Every request is still
    handled, each session's in order."""
    monkeypatch.setattr(server, "INPUT_TURN_S", 0.0)
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        handle_request = core.node.broker._request
        turns = LoopTurns()
        created: list[tuple[int, str]] = []  # (turn, address) of each CREATE_ADDRESS, as the node handles them

        def watched(session: Any, event: ev.Event, now_ms: int) -> Any:
            if isinstance(event, ev.CreateAddress):
                created.append((turns.now, event.address))
            return handle_request(session, event, now_ms)

        monkeypatch.setattr(core.node.broker, "_request", watched)
        clients = [core.links.client(user="a", password="a", client_name=f"s{i}") for i in range(200)]
        await asyncio.gather(*(client.connect() for client in clients))
        # Each session's two requests, all in one frame of the shared link.
        await asyncio.gather(
            *(client.create_address(f"burst.{i}.{n}") for n in range(2) for i, client in enumerate(clients))
        )
        turns.stop()
        for client in clients:
            await client.close()
        assert sorted(address for _, address in created) == sorted(
            f"burst.{i}.{n}" for i in range(200) for n in range(2)
        )
        for i in range(200):  # each session's in order
            mine = [address for _, address in created if address.startswith(f"burst.{i}.")]
            assert mine == [f"burst.{i}.0", f"burst.{i}.1"]
        # A session's input per turn (its two requests may share a frame).
        assert len({at for at, _ in created}) >= 200


async def test_the_sessions_of_a_lost_link_end_a_turn_s_worth_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway killed with 9,500 sessions on its shared link held the core's loop for 0.2-0.35 s as they all
    ended in one turn, and every other link's answers and heartbeats with it. They end ``CHANNEL_ENDS_PER_TURN`` a turn
    now, in the turns after the loss, and each still ends."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        node, broker = core.node, core.node.broker
        monkeypatch.setattr(node, "channel_ends", TurnPacer(5, logging.getLogger("tridentmq.core")))
        close_session = broker.close_session
        turns = LoopTurns()
        ended: dict[str, int] = {}  # conn id → the turn its session ended in

        def watched(session: Any, now_ms: int, **options: Any) -> bool:
            ended.setdefault(session.conn_id, turns.now)
            return close_session(session, now_ms, **options)

        monkeypatch.setattr(broker, "close_session", watched)
        clients = [core.links.client(user="a", password="a", client_name=f"lost{i}") for i in range(40)]
        await asyncio.gather(*(client.connect() for client in clients))
        carried = {s.conn_id for s in broker.sessions.values() if s.client_name.startswith("lost")}
        [carrier] = [p for p in node.links.values() if p.channels]
        assert carrier.transport is not None
        carrier.transport.abort()
        await eventually(lambda: carried <= set(ended), "every session of the lost link ended")
        turns.stop()
        per_turn: dict[int, int] = {}
        for conn_id in carried:
            per_turn[ended[conn_id]] = per_turn.get(ended[conn_id], 0) + 1
        assert max(per_turn.values()) <= 5
        assert len(per_turn) >= 8
        for client in clients:  # they failed over to a link of their own meanwhile
            await client.close()


async def test_the_wills_of_a_lost_links_sessions_are_published_before_the_sessions_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost link's sessions end a turn's worth at a time, but their wills go at once, as when they all ended
    together: a client that reconnects through another gateway meanwhile would otherwise take over the will of
    its old connection (its SET_WILL takes the key from a link the core thinks open) instead of it being
    published."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        node, broker = core.node, core.node.broker
        monkeypatch.setattr(node, "channel_ends", TurnPacer(1, logging.getLogger("tridentmq.core")))
        async with core.admin() as admin:
            await admin.create_queue("gone", durable=False)
        clients = [core.links.client(user="a", password="a", client_name=f"will{i}") for i in range(6)]
        await asyncio.gather(*(client.connect() for client in clients))
        for i, client in enumerate(clients):
            await client.set_will(f"will.{i}", new_message("gone", f"{i}".encode()))
        lost = {s.conn_id for s in broker.sessions.values() if s.client_name.startswith("will")}
        published_at_close: list[int] = []  # wills in the queue as each lost session ended
        close_session = broker.close_session

        def watched(session: Any, now_ms: int, **options: Any) -> bool:
            if session.conn_id in lost:
                published_at_close.append(len(broker.queues["gone"]))
            return close_session(session, now_ms, **options)

        monkeypatch.setattr(broker, "close_session", watched)
        [carrier] = [p for p in node.links.values() if p.channels]
        assert carrier.transport is not None
        carrier.transport.abort()
        await eventually(lambda: len(published_at_close) == len(lost), "every lost session ended")
        assert published_at_close == [6] * 6
        for i, client in enumerate(clients):  # they failed over meanwhile, and set their wills again
            await client.set_will(f"will.{i}", None)
            await client.close()


async def test_the_session_of_a_lost_link_with_many_consumers_closes_over_several_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway's service link holds a consumer for each of its clients' session locks: the core closes such a
    session ``CONSUMERS_CLOSED_PER_TURN`` consumers a turn once its link is lost, and each consumer goes."""
    monkeypatch.setattr(server, "CONSUMERS_CLOSED_PER_TURN", 5)
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        broker = core.node.broker
        calls: list[bool] = []
        close_session = broker.close_session

        def watched(session: Any, now_ms: int, **options: Any) -> bool:
            done = close_session(session, now_ms, **options)
            if session.client_name == "service":
                calls.append(done)
            return done

        monkeypatch.setattr(broker, "close_session", watched)
        service = core.links.client(user="a", password="a", client_name="service")  # a shared link's channel
        await service.connect()
        for i in range(12):
            await service.create_queue(f"lock.{i}", durable=False)
            await service.subscribe(f"lock.{i}", credit=1)
        [session] = [s for s in broker.sessions.values() if s.client_name == "service"]
        held = list(session.consumers.values())
        [carrier] = [p for p in core.node.links.values() if p.channels]
        assert carrier.transport is not None
        carrier.transport.abort()
        await eventually(lambda: bool(calls) and calls[-1], "the session closed")
        assert calls == [False, False, True]
        assert not any(consumer in consumer.queue.consumers for consumer in held)
        await service.close()  # it failed over meanwhile, with consumers of its own again


async def test_a_stall_of_the_node_does_not_drop_the_links_it_accepted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full garbage collection of a core holding 50,000 sessions stalled it for seconds: at its first timer
    after it, every gateway's shared link had sent nothing for longer than the heartbeat timeout (what they
    sent waited unread), and the core dropped them, with the 30,000 sessions they carried. A stall of the
    node is not its peers' silence: here the node (with its gateway link, in the same process) stalls for ten
    heartbeat intervals, and the link and its session go on."""
    settings = core_settings(tmp_path, heartbeat_ms=100)
    gateway = CoreLinkSettings(port=0, heartbeat_ms=100)
    async with running_core(settings, lambda port: replace(gateway, port=port)) as core, core.admin() as client:
        links = set(core.node.links)
        with caplog.at_level(logging.WARNING):
            time.sleep(1.0)  # noqa: ASYNC251 - the node's loop stalls (a garbage collection, say)
            await asyncio.sleep(0.5)  # five intervals more: the timers, then the peer's heartbeats
            await client.create_address("after.the.stall")
        assert set(core.node.links) == links
        assert "heartbeat-timeout" not in caplog.text
        assert client.connected


async def test_a_gateway_that_stops_does_not_report_its_shared_link_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway stopping with sessions still open closes its shared links itself: that is no loss to warn of
    ("shared core link lost: its sessions fail over" was logged at every stop of a busy gateway)."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        session = core.links.client(user="a", password="a", client_name="open at the stop")
        await session.connect()
        with caplog.at_level(logging.INFO):
            await core.links.stop()
        assert "shared core link lost" not in caplog.text
        await session.close()


async def test_a_sessions_large_output_goes_on_the_shared_link_at_once_and_small_output_with_the_links_turn(
    tmp_path: Path,
) -> None:
    """A batch of publishes a session writes early (``EARLY_WRITE_OPERATIONS``) is handed to the shared link's
    socket in the same call, not a loop turn later: the durable publishes of the AMQP gateway's S4 took 2.8 ms
    (median) to reach the core that way against 1.5 ms over a link of their own. A small write (one publish,
    a request) still waits for the link's own flush at the end of the turn, which the other sessions' share.
    Every message arrives, in order."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        session = core.links.client(user="a", password="a", client_name="producer")
        await session.connect()
        await session.create_queue("bulk", durable=False)
        assert core.links.shared is not None
        (carrier,) = core.links.shared.carriers
        link = carrier.client._conn
        assert link is not None
        confirmed = [session.try_send(new_message("bulk", f"{n:0100}".encode())) for n in range(EARLY_WRITE_OPERATIONS)]
        assert link.pending_operations == 0  # the session's early write went straight on to the socket
        confirmed.append(session.try_send(new_message("bulk", b"last")))
        session.flush()  # a write of one publish
        assert link.pending_operations == 1  # waits for the shared link's flush, with the turn's other output
        await asyncio.gather(*(future for future in confirmed if future is not None))
        assert all(future is not None for future in confirmed)
        reader = core.links.client(user="a", password="a", client_name="consumer")
        await reader.connect()
        consumer = await reader.subscribe("bulk")
        bodies: list[bytes] = []
        while len(bodies) < EARLY_WRITE_OPERATIONS + 1:
            batch = await consumer.get_batch(timeout=5)
            assert batch, f"only {len(bodies)} arrived"
            bodies += [message[M_BODY] for _, message in batch]
        assert bodies == [f"{n:0100}".encode() for n in range(EARLY_WRITE_OPERATIONS)] + [b"last"]
        await reader.close()
        await session.close()


async def test_a_sessions_output_reaches_the_shared_links_socket_in_the_loop_turn_after_it_was_queued(
    tmp_path: Path,
) -> None:
    """A session's publish goes out with the shared link's flush at the end of the turn: the shared link writes
    the session's output and then its socket in one callback. Before, the session's flush put it into the shared
    link a turn later and the shared link wrote it a turn after that, which cost each message alone (at a low
    rate) a poll of the event loop. Several sessions' output of one turn goes in one write of the socket, and a
    read that queued nothing to answer schedules no flush."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        sessions = [core.links.client(user="a", password="a", client_name=f"producer {n}") for n in range(3)]
        for session in sessions:
            await session.connect()
        await sessions[0].create_queue("turns", durable=False)
        assert core.links.shared is not None
        (carrier,) = core.links.shared.carriers
        protocol = carrier.client._protocol
        assert protocol is not None
        assert protocol.transport is not None
        socket_writes: list[int] = []
        real_write = protocol.transport.write

        def counted(data: bytes | bytearray | memoryview) -> None:
            socket_writes.append(len(data))
            real_write(data)

        protocol.transport.write = counted  # type: ignore[method-assign]
        try:
            confirmed = [
                session.try_send(new_message("turns", f"from {n}".encode())) for n, session in enumerate(sessions)
            ]
            assert socket_writes == []  # queued: nothing written yet
            await asyncio.sleep(0)  # one turn of the loop
            assert len(socket_writes) == 1  # every session's publish, in one write of the shared link
            assert all(session._flush_scheduled is False for session in sessions)
            await asyncio.gather(*(future for future in confirmed if future is not None))
            assert len(socket_writes) == 1  # (before, one session's went in that turn and the others' in the next)
            for session in sessions:
                assert session._conn is not None
                assert session._conn.pending_operations == 0
                assert not session._flush_scheduled  # the confirms read queued nothing: no flush for them
        finally:
            protocol.transport.write = real_write  # type: ignore[method-assign]
        reader = core.links.client(user="a", password="a", client_name="consumer")
        await reader.connect()
        consumer = await reader.subscribe("turns")
        bodies: list[bytes] = []
        while len(bodies) < len(sessions):
            batch = await consumer.get_batch(timeout=5)
            assert batch
            bodies += [message[M_BODY] for _, message in batch]
        assert sorted(bodies) == [b"from 0", b"from 1", b"from 2"]
        await reader.close()
        for session in sessions:
            await session.close()


async def test_the_cores_flush_writes_its_channels_links_in_the_same_flush_and_schedules_no_other(
    tmp_path: Path,
) -> None:
    """The core's flush writes each session's output and then the links that carry channels. A channel's output
    used to schedule one more flush as it went into its link, which found nothing left to do a turn later: a
    second pass over the dispatch, the audit and the dirty sessions for every message at a low rate."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        session = core.links.client(user="a", password="a", client_name="producer")
        await session.connect()
        node = core.node
        (channel,) = (c for carrier in node.links.values() for c in carrier.channels.values())
        assert channel.session is not None
        await eventually(lambda: not node._flush_scheduled, "the node's flushes to be done")
        channel.conn.grant_publish_credit(1)  # some output of the channel's session
        node.broker.dirty.add(channel.session)
        node._flush()
        assert not node._flush_scheduled  # its link was written in that flush: nothing is left for another
        assert not node.carriers
        credit = session._conn.publish_credit if session._conn is not None else 0
        await eventually(
            lambda: session._conn is not None and session._conn.publish_credit == credit + 1, "the credit to arrive"
        )
        await session.close()
