"""Durable messages against real core processes that are stopped, killed and restarted."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, start_core
from tests.disks import fill, tmpfs
from tests.integration.test_ha import readyz
from tests.memory import MIB, peak_rss

from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import M_BODY, M_ID, RoutingType, new_message

pytestmark = pytest.mark.integration

NO_RECONNECT = ReconnectPolicy(attempts=0)


def client(node: CoreProcess) -> LinkClient:
    return LinkClient("127.0.0.1", node.link_port, reconnect=NO_RECONNECT)


async def publish_confirmed(node: CoreProcess, address: str, bodies: list[bytes]) -> None:
    async with client(node) as c:
        futures = await c.publish_batch(new_message(address, body, durable=True) for body in bodies)
        await asyncio.gather(*futures)


async def drain(node: CoreProcess, queue: str, expect: int) -> list[tuple[bytes, int]]:
    got: list[tuple[bytes, int]] = []
    async with client(node) as c:
        consumer = await c.subscribe(queue, credit=1000)
        while len(got) < expect:
            batch = await consumer.get_batch(timeout=10)
            assert batch, f"only {len(got)} of {expect} messages came back"
            got.extend((bytes(m[M_BODY]), count) for count, m in batch)
            consumer.ack_ids([m[M_ID] for _, m in batch])
        assert await consumer.get_batch(timeout=0.3) == []
    return got


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "kill-9"])
async def test_confirmed_durable_messages_survive_a_restart(tmp_path: Path, stop: signal.Signals) -> None:
    node = start_core(tmp_path)
    port = node.link_port
    bodies = [f"m{n}".encode() for n in range(500)]
    await publish_confirmed(node, "durable.q", bodies)
    # Take (and do not acknowledge) the first ten, so the journal knows they were delivered once.
    async with client(node) as c:
        consumer = await c.subscribe("durable.q", credit=10)
        taken = []
        while len(taken) < 10:
            taken.extend(await consumer.get_batch(timeout=5))
        node.process.send_signal(stop)
        node.process.wait(timeout=10)
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
    try:
        with urllib.request.urlopen(node.management_url + "/readyz", timeout=5) as response:
            assert json.loads(response.read())["recovered"] == {"durable.q": 500}
        got = await drain(node, "durable.q", 500)
        assert sorted(body for body, _ in got) == sorted(bodies)
        counts = dict(got)
        assert all(counts[f"m{n}".encode()] == 2 for n in range(10)), "delivered before the stop: redelivered"
        assert all(counts[f"m{n}".encode()] == 1 for n in range(10, 500))
    finally:
        assert node.stop() == 0
    # Everything was acknowledged: a third start recovers an empty queue.
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
    try:
        with urllib.request.urlopen(node.management_url + "/readyz", timeout=5) as response:
            # The drained queue was auto-created, so it was auto-deleted when its consumer left.
            assert json.loads(response.read())["recovered"] == {}
    finally:
        assert node.stop() == 0


async def test_non_durable_messages_do_not_survive(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    port = node.link_port
    async with client(node) as c:
        await c.publish(new_message("mixed.q", b"durable", durable=True))
        await c.publish(new_message("mixed.q", b"volatile", durable=False))
    assert node.stop() == 0
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
    try:
        got = await drain(node, "mixed.q", 1)
        assert got == [(b"durable", 1)]
    finally:
        assert node.stop() == 0


async def test_durable_messages_reach_an_auto_acknowledging_consumer(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    try:
        await publish_confirmed(node, "auto.q", [b"a", b"b", b"c"])
        async with client(node) as c:
            consumer = await c.subscribe("auto.q", auto_ack=True)
            got = []
            while len(got) < 3:
                batch = await consumer.get_batch(timeout=5)
                assert batch, f"only {len(got)} of 3 arrived"
                got.extend(bytes(m[M_BODY]) for _, m in batch)
        assert got == [b"a", b"b", b"c"]
    finally:
        assert node.stop() == 0


async def test_compaction_retires_dead_segments_and_keeps_live_messages(tmp_path: Path) -> None:
    node = start_core(
        tmp_path, TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES="65536", TRIDENTMQ_CORE_JOURNAL_COMPACT_MIN_SEGMENTS="3"
    )
    port = node.link_port
    journal = tmp_path / "core" / "journal"
    try:
        async with client(node) as c:
            await c.create_queue("compact.q")
            # Ten messages stay live throughout; the first four are delivered once and left unacknowledged.
            await publish_confirmed(node, "compact.q", [f"keep{n}".encode() for n in range(10)])
            holder = await c.subscribe("compact.q", credit=4)
            held = []
            while len(held) < 4:
                held.extend(await holder.get_batch(timeout=5))
            # Churn: thousands of messages published and acknowledged fill many segments with dead records.
            worker_link = client(node)
            await worker_link.connect()
            churn = await worker_link.subscribe("churn.q", credit=2000)
            for round_ in range(6):
                await publish_confirmed(node, "churn.q", [f"r{round_}-{n}".encode() for n in range(500)])
                done = 0
                while done < 500:
                    batch = await churn.get_batch(timeout=5)
                    churn.ack_ids([m[M_ID] for _, m in batch])
                    done += len(batch)
            most = len(list(journal.glob("journal-*.tmq")))
            # Compaction runs from the node's timer: wait (bounded) until it has retired segments.
            for _ in range(100):
                await asyncio.sleep(0.1)
                if len(list(journal.glob("journal-*.tmq"))) < most:
                    break
            assert len(list(journal.glob("journal-*.tmq"))) < most, "no segment was retired"
            await worker_link.close()
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(timeout=10)
        node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
        got = await drain(node, "compact.q", 10)
        assert sorted(body for body, _ in got) == sorted(f"keep{n}".encode() for n in range(10))
        counts = dict(got)
        # Taken before the kill: flagged. The holder's client topped its credit up by 4 when it took them, so
        # keep4..keep7 may have been delivered too; keep8 and keep9 cannot have been.
        assert [counts[f"keep{n}".encode()] for n in range(4)] == [2] * 4
        assert {counts[f"keep{n}".encode()] for n in range(4, 8)} <= {1, 2}
        assert [counts[f"keep{n}".encode()] for n in (8, 9)] == [1, 1]
        assert "Traceback" not in node.log()
    finally:
        assert node.stop() == 0


async def refused_in_time(publish: Callable[[], Awaitable[object]]) -> LinkRequestError:
    """The refusal of ``publish``, tried again until the node refuses it (it checks the disk about once a
    second); fails the test after 5 s of acceptances."""
    for _ in range(50):
        try:
            await publish()
        except LinkRequestError as exc:
            return exc
        await asyncio.sleep(0.1)
    pytest.fail("the publish was never refused")


async def test_durable_publishes_are_refused_while_the_disk_is_over_its_limit(tmp_path: Path) -> None:
    node = start_core(tmp_path, TRIDENTMQ_CORE_JOURNAL_MAX_DISK_USAGE="0")  # any usage is over the limit
    try:
        async with client(node) as c:
            await c.publish(new_message("full.q", b"volatile"))  # non-durable: unaffected
            refused = await refused_in_time(lambda: c.publish(new_message("full.q", b"durable", durable=True)))
            assert refused.code == "resource-limit"
            assert "journal.max_disk_usage" in refused.text
        assert "durable publishes refused" in node.log()
    finally:
        assert node.stop() == 0


async def test_messages_that_would_be_paged_are_refused_while_the_disk_is_over_its_limit(tmp_path: Path) -> None:
    """Page files fill a disk as the journal does: over journal.max_disk_usage, a publish a queue would page is
    refused, durable or not; one a queue keeps in memory is not."""
    config = """
[[address_settings]]
match = "paged.#"
max_size_bytes = 4096
address_full_policy = "PAGE"
"""
    node = start_core(tmp_path, config=config, TRIDENTMQ_CORE_JOURNAL_MAX_DISK_USAGE="0")
    try:
        async with client(node) as c:
            await c.create_queue("paged.q")
            for _ in range(3):  # under its limit: kept in memory
                await c.publish(new_message("paged.q", b"x" * 1000))
            refused = await refused_in_time(lambda: c.publish(new_message("paged.q", b"x" * 1000)))
            assert refused.code == "resource-limit"
            assert "messages that would be paged are refused" in refused.text
            await c.publish(new_message("other.q", b"volatile"))  # kept in memory: unaffected
        assert "messages that would be paged refused" in node.log()
    finally:
        assert node.stop() == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small", "16m") as mount:
        yield mount


async def until_ready(node: CoreProcess, status: int) -> dict[str, object]:
    for _ in range(100):
        code, answer = readyz(node)
        if code == status:
            return answer
        await asyncio.sleep(0.1)
    pytest.fail(f"/readyz never answered {status}: {code} {answer}")


async def test_a_burst_is_refused_at_the_segment_that_crosses_the_disk_limit_not_a_second_later(
    tmp_path: Path, small_disk: Path
) -> None:
    """The disk usage limit was checked once a second: a burst took a small disk from under 90 % to full within
    it, the journal could not open its next segment, and the node held publishes unanswered and could not even
    write the acknowledgements that would drain it. The check now runs at every new segment too."""
    node = start_core(
        tmp_path,
        TRIDENTMQ_CORE_JOURNAL_DIRECTORY=str(small_disk / "journal"),
        TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES=str(1024 * 1024),
    )
    try:
        fill(small_disk, leave=4 * 1024 * 1024)  # about 75 % used: under the limit (90 %)
        await asyncio.sleep(1.2)  # the once-a-second check has seen it
        async with client(node) as c:
            sent = await c.publish_batch(new_message("burst.q", b"x" * 100_000, durable=True) for _ in range(60))
            answers = await asyncio.wait_for(asyncio.gather(*sent, return_exceptions=True), 30)  # none held
        confirmed = sum(answer is None for answer in answers)
        refused = [answer for answer in answers if answer is not None]
        assert confirmed, answers
        assert refused, answers
        assert all(isinstance(a, LinkRequestError) and a.code == "resource-limit" for a in refused), refused
        assert "journal.max_disk_usage" in str(refused[0])
        assert readyz(node)[0] == 200  # refusing, not failing: the journal never found the disk full
        assert len(await drain(node, "burst.q", confirmed)) == confirmed  # room is left to acknowledge them
    finally:
        assert node.stop() == 0
    assert "journal cannot write" not in node.log()


async def test_a_full_disk_refuses_durable_work_until_space_returns(tmp_path: Path, small_disk: Path) -> None:
    """The journal's disk full at a segment roll: the node says it is not ready and why, refuses durable
    publishes and commits instead of leaving them unanswered, and writes what it held once space returns."""
    node = start_core(
        tmp_path,
        TRIDENTMQ_CORE_JOURNAL_DIRECTORY=str(small_disk / "journal"),
        TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES=str(1024 * 1024),
        TRIDENTMQ_CORE_JOURNAL_MAX_DISK_USAGE="100",
    )
    try:
        async with client(node) as c:
            await publish_confirmed(node, "full.q", [b"before"])
            consumer = await c.subscribe("full.q", credit=10)
            [(_, first)] = await consumer.get_batch(timeout=5)
            tx = await c.begin()
            consumer.ack_ids([first[M_ID]], tx_id=tx)
            # Room for less than a segment, and under the disk usage limit: the next segment is what fails (at
            # 100 % the once-a-second disk check would refuse the publishes first, and nothing fail to write).
            filler = fill(small_disk, leave=512 * 1024)
            # The fill reached 100 % before it gave some back: a disk check that ran then refuses durable
            # publishes until the next one (a second later), and this test wants them to reach the journal.
            await asyncio.sleep(1.2)
            sent = await c.publish_batch(
                new_message("full.q", b"x" * 100_000, durable=True) for _ in range(14)
            )  # a roll
            answer = await until_ready(node, 503)
            assert "No space left on device" in str(answer["reason"])
            await asyncio.sleep(0)
            held = [future for future in sent if not future.done()]  # the ones that would have hung for good
            assert held
            with pytest.raises(LinkRequestError) as refused:
                await c.publish(new_message("full.q", b"durable", durable=True))
            assert refused.value.code == "resource-limit"
            assert "the journal cannot write" in refused.value.text
            with pytest.raises(LinkRequestError, match="transaction commits are refused"):
                await c.commit(tx)
            await c.publish(new_message("full.q", b"volatile"))  # non-durable: unaffected
            filler.unlink()
            await until_ready(node, 200)
            # Written once space returned (one the node had not taken yet when it said so may be refused).
            answers = await asyncio.gather(*held, return_exceptions=True)
            assert None in answers
            assert all(a is None or "the journal cannot write" in str(a) for a in answers), answers
            await c.commit(tx)  # the refused commit left the transaction open
            await c.publish(new_message("full.q", b"after", durable=True))
        assert "journal cannot write" in node.log()
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("removed", ["segment", "directory"])
async def test_a_journal_removed_under_the_node_stops_it_and_confirms_nothing_more(
    tmp_path: Path, removed: str
) -> None:
    """An operator's ``rm`` of the journal's segment: the node went on confirming durable publishes into the
    deleted file, stayed ready and said nothing, then restarted empty. With the directory gone it stopped
    through a traceback of its disk check. Now it confirms nothing written after the removal, says which
    file went, and stops (exit 70)."""
    node = start_core(tmp_path)
    journal = tmp_path / "core" / "journal"
    try:
        await publish_confirmed(node, "gone.q", [b"before"])
        for path in journal.iterdir():
            if path.name.startswith("journal-"):
                path.unlink()
        if removed == "directory":
            journal.rmdir()
        # The once-a-second disk check may have seen the directory gone first: the node is stopping, and
        # turns the link away or refuses the publish.
        try:
            async with client(node) as c:
                try:
                    (after,) = await c.publish_batch([new_message("gone.q", b"after", durable=True)])
                except LinkRequestError:
                    after = None
                assert await asyncio.to_thread(node.process.wait, 20) == 70
                if after is not None:
                    await asyncio.wait([after], timeout=5)
                    assert not after.done() or after.exception() is not None, (
                        "a publish into a removed file was confirmed"
                    )
        except LinkClosedError:
            assert await asyncio.to_thread(node.process.wait, 20) == 70
    finally:
        node.stop()
    log = node.log()
    # The directory's removal is seen by the writer (its segment went with it) or by the disk check, first.
    assert "journal-00000001.tmq was removed while in use" in log or "journal directory" in log, log[-3000:]
    assert "Traceback" not in log


async def test_paging_far_past_the_limit_drains_in_order_and_survives_kill_9(tmp_path: Path) -> None:
    config = """
[[address_settings]]
match = "paged.#"
max_size_bytes = 262144
address_full_policy = "PAGE"
"""
    node = start_core(tmp_path, config=config)
    port = node.link_port
    bodies = [f"{n:06d}".encode() + b"x" * 2000 for n in range(3000)]  # ~6.7 MB against a 256 KiB limit
    try:
        await publish_confirmed(node, "paged.q", bodies)
        paging = tmp_path / "core" / "paging"
        assert any(p.stat().st_size > 4 * 262144 for p in paging.iterdir()), "nothing was paged"
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)
        node = start_core(tmp_path, config=config, TRIDENTMQ_CORE_LINK_PORT=str(port))
        got = await drain(node, "paged.q", 3000)
        assert [body for body, _ in got] == bodies  # every one, in order, after paging on both sides of a crash
    finally:
        assert node.stop() == 0


async def test_a_restart_after_a_long_history_recovers_the_live_messages_exactly_in_little_memory(
    tmp_path: Path,
) -> None:
    """A restart needs about the live state, not the journal's history: 6,000 messages of 32 KiB published to
    two subscriptions and acknowledged (192 MiB of journal, never compacted), a few left in each. Recovery
    used to hold every record until the end: its peak grew by 205 MiB, now by 14 MiB."""
    never_compact = {"TRIDENTMQ_CORE_JOURNAL_COMPACT_MIN_SEGMENTS": "1000000"}
    node = start_core(tmp_path, **never_compact)
    port = node.link_port
    idle_peak = peak_rss(node.process.pid)
    kept = {"hist.a": [n for n in range(6000) if n % 500 == 7], "hist.b": [n for n in range(6000) if n % 700 == 3]}

    def body(n: int) -> bytes:
        return f"{n:05d}".encode() + bytes(32 * 1024 - 5)

    async with client(node) as c:
        for name in kept:
            await c.create_queue(name, "hist", routing_type=RoutingType.MULTICAST)
        consumers = {name: await c.subscribe(name, credit=200) for name in kept}
        for start in range(0, 6000, 200):
            confirms = await c.publish_batch(
                new_message("hist", body(n), durable=True) for n in range(start, start + 200)
            )
            await asyncio.gather(*confirms)
            for name, consumer in consumers.items():
                taken = 0
                while taken < 200:
                    batch = await consumer.get_batch(timeout=10)
                    assert batch, f"{name}: {taken} of 200"
                    taken += len(batch)
                    consumer.ack_ids([m[M_ID] for _, m in batch if int(m[M_BODY][:5]) not in kept[name]])
        for consumer in consumers.values():
            await consumer.close()  # what it held unacknowledged goes back, delivered once
        # Confirmed only once synced, with every record queued before it (the acks among them).
        await c.publish(new_message("hist.done", b"last", durable=True))
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(timeout=10)
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port), **never_compact)
    try:
        restart_peak = peak_rss(node.process.pid)  # ready: recovery is over
        recovered = {"hist.a": len(kept["hist.a"]), "hist.b": len(kept["hist.b"]), "hist.done": 1}
        assert readyz(node)[1]["recovered"] == recovered
        for name, numbers in kept.items():
            got = await drain(node, name, len(numbers))
            assert got == [(body(n), 2) for n in numbers], name  # in order, each delivered once before
        growth = restart_peak - idle_peak
        assert growth < 96 * MIB, f"the restart peaked {growth / MIB:.0f} MiB above an empty node's start"
    finally:
        assert node.stop() == 0


async def test_a_restart_with_a_paged_backlog_recovers_it_exactly_within_the_paging_limit(tmp_path: Path) -> None:
    """A queue that paged 125 MiB past its 4 MiB limit comes back after kill -9 without holding the backlog in
    memory: replay keeps only where its messages are, and the restore reads them back into the queue, which
    pages them again. Replay used to hold them all until the journal's end: its peak grew by the backlog."""
    config = """
[[address_settings]]
match = "paged.#"
max_size_bytes = 4194304
"""
    settings = {
        "TRIDENTMQ_CORE_JOURNAL_COMPACT_MIN_SEGMENTS": "1000000",  # every record stays, as after a crash
        "TRIDENTMQ_CORE_JOURNAL_SEGMENT_BYTES": str(8 * MIB),  # recovery reads one at a time: keep it small
    }
    node = start_core(tmp_path, config=config, **settings)
    port = node.link_port
    idle_peak = peak_rss(node.process.pid)

    def body(n: int) -> bytes:
        return f"{n:05d}".encode() + bytes(32 * 1024 - 5)

    for start in range(0, 4000, 250):
        await publish_confirmed(node, "paged.q", [body(n) for n in range(start, start + 250)])
    async with client(node) as c:
        consumer = await c.subscribe("paged.q", credit=50)
        taken: list[tuple[int, list[object]]] = []
        while len(taken) < 50:
            batch = await consumer.get_batch(timeout=10)
            assert batch
            taken.extend(batch)
        consumer.ack_ids([m[M_ID] for _, m in taken if int(m[M_BODY][:5]) % 2 == 0])
        await consumer.close()  # the odd ones go back, delivered once
        await c.publish(new_message("paged.done", b"last", durable=True))  # synced after the acks and counts
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(timeout=10)
    node = start_core(tmp_path, config=config, TRIDENTMQ_CORE_LINK_PORT=str(port), **settings)
    try:
        restart_peak = peak_rss(node.process.pid)  # ready: recovery is over
        assert readyz(node)[1]["recovered"] == {"paged.q": 25 + 3950, "paged.done": 1}
        got = await drain(node, "paged.q", 25 + 3950)
        expected = [(body(n), 2) for n in range(1, 50, 2)] + [(body(n), 1) for n in range(50, 4000)]
        assert got == expected  # every one, in order, with its delivery count
        growth = restart_peak - idle_peak
        assert growth < 80 * MIB, f"the restart peaked {growth / MIB:.0f} MiB above an empty node's start"
    finally:
        assert node.stop() == 0


async def test_a_browser_of_a_paging_queue_sees_every_message_while_a_consumer_drains_it(tmp_path: Path) -> None:
    """The paged part of a browse's snapshot is read back for the browser through the node's page I/O thread,
    while the queue's own consumer reads the same page files back and has them deleted."""
    config = """
[[address_settings]]
match = "paged.#"
max_size_bytes = 262144
"""
    node = start_core(tmp_path, config=config)
    bodies = [f"{n:06d}".encode() + b"x" * 2000 for n in range(3000)]
    try:
        await publish_confirmed(node, "paged.q", bodies)
        async with client(node) as c:
            browser = await c.subscribe("paged.q", credit=100, browse=True)
            drained = asyncio.create_task(drain(node, "paged.q", 3000))
            browsed: list[bytes] = []
            while batch := await browser.get_batch(timeout=10):
                browsed.extend(bytes(m[M_BODY]) for _, m in batch)
            assert browsed == bodies
            assert [body for body, _ in await drained] == bodies
        paging = tmp_path / "core" / "paging"
        for _ in range(50):  # the I/O thread deletes the files read by both
            if not list(paging.iterdir()):
                break
            await asyncio.sleep(0.1)
        assert not list(paging.iterdir())
    finally:
        assert node.stop() == 0


async def test_a_committed_transaction_survives_kill_9_and_an_open_one_leaves_nothing(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    port = node.link_port
    async with client(node) as c:
        await c.create_queue("tx.q")
        await c.publish(new_message("tx.q", b"before", durable=True))
        consumer = await c.subscribe("tx.q", credit=10)
        [(_, first)] = await consumer.get_batch(timeout=5)
        tx = await c.begin()
        for n in range(50):
            await c.publish(new_message("tx.q", f"in {n}".encode(), durable=True), tx_id=tx)
        consumer.ack_ids([first[M_ID]], tx_id=tx)
        await c.commit(tx)  # replied only once the whole transaction is synced
        open_tx = await c.begin()
        for n in range(20):
            await c.publish(new_message("tx.q", f"open {n}".encode(), durable=True), tx_id=open_tx)
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
    try:
        got = await drain(node, "tx.q", 50)
        assert sorted(body for body, _ in got) == sorted(f"in {n}".encode() for n in range(50))  # "before" acked
    finally:
        assert node.stop() == 0


async def test_duplicate_detection_remembers_acknowledged_ids_across_kill_9(tmp_path: Path) -> None:
    """A producer that re-sends after a crash (it never saw the confirm) must not create a second copy, even
    when the first was already consumed and acknowledged before the crash."""
    node = start_core(tmp_path)
    port = node.link_port
    async with client(node) as c:
        await c.publish(new_message("dedup.q", b"once", durable=True, dedup_id="producer-7:1"))
    assert [body for body, _ in await drain(node, "dedup.q", 1)] == [b"once"]  # consumed and acknowledged
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(timeout=10)
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port))
    try:
        async with client(node) as c:
            await c.create_queue("dedup.q")
            await c.publish(new_message("dedup.q", b"once", durable=True, dedup_id="producer-7:1"))
            await c.publish(new_message("dedup.q", b"next", durable=True, dedup_id="producer-7:2"))
        assert [body for body, _ in await drain(node, "dedup.q", 1)] == [b"next"]
    finally:
        assert node.stop() == 0


async def test_journal_metrics_count_records_and_group_commits(tmp_path: Path) -> None:
    node = start_core(tmp_path)
    try:

        def sample(name: str) -> float:
            with urllib.request.urlopen(node.management_url + "/metrics", timeout=5) as response:
                lines = response.read().decode().splitlines()
            return float(next(line.split()[1] for line in lines if line.startswith(f"tridentmq_{name} ")))

        before = sample("journal_records_synced_total"), sample("journal_syncs_total")
        await publish_confirmed(node, "metrics.q", [f"m{n}".encode() for n in range(200)])
        records = sample("journal_records_synced_total") - before[0]
        syncs = sample("journal_syncs_total") - before[1]
        assert records >= 200  # the messages, confirmed only once synced (plus the queue's definition)
        assert 1 <= syncs <= records
    finally:
        assert node.stop() == 0


def _audit_records(node_dir: Path) -> list[dict[str, object]]:
    """Every record of a node's audit log, sealed segments and the active one."""
    paths = sorted(node_dir.glob("*.jsonl")) + sorted((node_dir / ".active").glob("*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_bytes().splitlines()]


async def test_the_audit_events_of_confirmed_durable_messages_survive_kill_9(tmp_path: Path) -> None:
    # Heartbeats and time-based flushes far apart: only the flush before each confirm can save the events.
    env = {"TRIDENTMQ_CORE_AUDIT_HEARTBEAT_SECONDS": "3600", "TRIDENTMQ_CORE_AUDIT_ROLL_SECONDS": "3600"}
    node = start_core(tmp_path, **env)
    port = node.link_port
    await publish_confirmed(node, "audited.q", [f"a{n}".encode() for n in range(300)])
    node.process.send_signal(signal.SIGKILL)  # at once: the events live only in the OS now, if anywhere
    node.process.wait(timeout=10)
    node = start_core(tmp_path, TRIDENTMQ_CORE_LINK_PORT=str(port), **env)
    await publish_confirmed(node, "audited.q", [f"b{n}".encode() for n in range(20)])
    assert node.stop() == 0
    (node_dir,) = [d for d in (tmp_path / "core" / "audit").iterdir() if d.is_dir()]
    records = _audit_records(node_dir)
    sent = [r for r in records if r["event"] == "msg.sent" and r["address"] == "audited.q"]
    assert len(sent) == 320
    assert len({r["message_id"] for r in sent}) == 320
    seqs = [r["seq"] for r in records]
    assert seqs == list(range(len(records))), "seqs are gap-free, unique and in file order"
