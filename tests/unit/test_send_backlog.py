"""What a connection has written that its peer has not taken: it grows while the peer does not read, and goes
down as it reads (the replication source tells a slow backup from a silent one by it)."""

from __future__ import annotations

import asyncio

from tridentmq_shared.send_backlog import unacknowledged_bytes


async def test_the_backlog_counts_what_the_peer_has_not_taken_and_goes_down_as_it_reads() -> None:
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put((reader, writer))

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    reader, peer = await accepted.get()
    transport = writer.transport
    assert unacknowledged_bytes(transport) == 0
    total = 32 * 1024 * 1024  # more than the socket buffers of both ends hold
    writer.write(b"x" * total)
    await asyncio.sleep(0.05)
    stuck = unacknowledged_bytes(transport)
    assert stuck > total // 2  # the peer reads nothing: most of it waits here, in asyncio's buffer or the kernel's
    await reader.readexactly(total // 2)
    await asyncio.sleep(0.05)
    assert unacknowledged_bytes(transport) < stuck
    await reader.readexactly(total - total // 2)
    await writer.drain()
    for _ in range(100):  # the last acknowledgements are on their way
        if unacknowledged_bytes(transport) == 0:
            break
        await asyncio.sleep(0.01)
    assert unacknowledged_bytes(transport) == 0
    writer.close()
    peer.close()
    server.close()
    await server.wait_closed()
