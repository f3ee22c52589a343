"""Benchmark of the AMQP 1.0 gateway: scenario S4, durable queue throughput and end-to-end latency through a
gateway and its core.

S4: one producer connection and one consumer connection, each in its own process, on a fresh queue
``bench.<id>`` per run (the consumer's attach creates the anycast queue, and the producer attaches after
that). Every message is a transfer of a header section with ``durable=true`` and one ``data``
section of 100 bytes, in one frame.

* default (at least once): the producer sends unsettled transfers, at most 500 of them not yet settled by
  the gateway, which settles each with ``accepted`` once the core has the message on disk;
* ``--presettled`` (at most once): the producer sends pre-settled transfers and the consumer's link is in
  snd-settle-mode ``settled``, so no dispositions are sent either way.

The producer never exceeds the link credit and the session incoming-window that the gateway grants (from its
begin and flow frames), and writes at most 100 transfers at a time. The consumer attaches with link credit
1000 and tops it up to 1000 once half is used. In the default mode it accepts and settles what each socket
read brought with one ranged disposition ``first..last`` (settled, ``accepted``). The producer starts (t0)
once the consumer has attached and granted credit.

Figures: delivered rate = deliveries / (last delivery - t0). Producer-confirmed rate = messages / (the read
that brought the last ``accepted`` disposition - t0); with ``--presettled`` the producer detaches at the end,
and the detach reply stands in for the last confirmation. Latency is send-to-delivery from the
CLOCK_MONOTONIC stamp (ns, 20 zero-padded decimals) that starts each body, sampled once per socket read. A
sequence number after the stamp counts duplicates. Lost = sent - distinct messages delivered, once the consumer
has waited a grace period after the producer finished. Broker CPU is the user + system time of the core and
gateway processes (from ``/proc``) over the run, per delivery. Client cores are the clients' own CPU time per
second of run. ``--rate R`` makes it a latency run: the producer sends R msgs/s, evenly paced, for
``--seconds``, and p99.9 is reported as well.

The clients are small raw AMQP 1.0 clients over asyncio (uvloop when installed), not proton (whose Python
client tops out at about 9k msgs/s), encoding and decoding performatives with the gateway's own type codec
(``tridentmq_amqp.protocol.types``). The transfer frames are precomputed, and incoming frames are parsed
incrementally. They connect without a SASL layer, or with SASL PLAIN (``--sasl plain --user --password``).
Without ``--port`` the script starts its own core (throw-away data directory) and AMQP gateway on free
loopback ports. With ``--port`` it targets a gateway that is already running (broker CPU only with
``--core-pid`` / ``--gateway-pid``).

How to run:

    uv run python -m bench.amqp_gateway [--runs 3] [--count N] [--presettled]
    uv run python -m bench.amqp_gateway --rate 1000 [--seconds 10]  # latency at a fixed rate
    uv run python -m bench.amqp_gateway --host 127.0.0.1 --port 5672 [--sasl plain --user U --password P]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import signal
import statistics
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from typing import Any, TypedDict, TypeVar, cast

from bench.client import RawClient
from bench.node import amqp_gateway, broker_cpu_text, client_tls, cpu_of, cpu_self, gateway_target, machine, quantile_ms

from tridentmq_amqp.protocol.types import Array, Described, Symbol, UByte, UInt, ULong, UShort, decode, encode, skip
from tridentmq_shared.runtime import run_main

BODY_SIZE = 100
STAMP_DIGITS = 20  # the body starts with the send time: CLOCK_MONOTONIC ns, zero-padded decimal
SEQ_DIGITS = 10  # then the message's sequence number, zero-padded decimal
MAX_UNSETTLED = 500  # unsettled transfers the producer has sent and the gateway has not settled yet
CREDIT = 1000  # the consumer's link credit, topped up once half is used
BATCH = 100  # transfers written at once
MAX_FRAME = 1024 * 1024  # our OPEN's max-frame-size
WINDOW = 0x7FFFFFFF  # our session's incoming and outgoing windows: no limit in practice
GRACE_S = 5.0  # after the producer finished, how long the consumer waits for a missing message
CLOSE_S = 5.0  # how long a client waits for the gateway's CLOSE (and its end of the connection)
SETUP_S = 30.0  # how long a client waits for each step of its connection setup

# AMQP 1.0 part 2 (transport) and part 5 (security); part 3 (messaging) for the termini and outcomes
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
EMPTY_FRAME = b"\x00\x00\x00\x08\x02\x00\x00\x00"  # a heartbeat
OPEN, BEGIN, ATTACH, FLOW, TRANSFER, DISPOSITION, DETACH, END, CLOSE = range(0x10, 0x19)
SASL_MECHANISMS, SASL_INIT, SASL_OUTCOME = 0x40, 0x41, 0x44
SOURCE, TARGET = 0x28, 0x29
ACCEPTED = 0x24
SETTLE_UNSETTLED, SETTLE_SETTLED = 0, 1  # snd-settle-mode
HANDLE = 0  # the one link of a client, on channel 0
DATA_HEAD = b"\x00\x53\x75\xa0" + bytes([BODY_SIZE])  # a data section of BODY_SIZE bytes (vbin8)
_U32 = struct.Struct(">I")
_FRAME_HEAD = struct.Struct(">IBBH")  # size, doff, type, channel


@dataclass(frozen=True)
class RunOptions:
    host: str
    port: int
    address: str
    presettled: bool
    count: int
    rate: int  # msgs/s; 0 = as fast as credit, windows and the unsettled limit allow
    deadline_s: int
    sasl_user: str | None  # SASL PLAIN with these credentials; None: no SASL layer
    sasl_password: str
    ca_file: str = ""  # TLS to the gateway, checked against this authority (empty: plain TCP)


class ProducerResult(TypedDict):
    error: str
    t0_ns: int
    done_ns: int
    sent: int
    confirmed: int
    cpu_s: float


class ConsumerResult(TypedDict):
    error: str
    delivered: int
    distinct: int
    last_ns: int
    latencies_ns: list[int]
    cpu_s: float


# ---------------------------------------------------------------------------------------------- codec
def frame(performative: int, fields: list[Any], *, kind: int = 0, channel: int = 0) -> bytes:
    """One frame (``kind`` 0: AMQP, 1: SASL) with a performative and no payload."""
    body = encode(Described(ULong(performative), fields))
    return _FRAME_HEAD.pack(8 + len(body), 2, kind, channel) + body


@dataclass(frozen=True)
class TransferTemplate:
    """A transfer frame of one message, cut where it varies: ``head``, delivery-id, ``tag``, delivery-id
    again (the 4-byte delivery-tag), ``middle``, stamp and sequence number, ``filler``. The delivery-id
    takes the wide uint encoding so that every frame has the same size."""

    head: bytes
    ids: struct.Struct  # delivery-id, vbin8 head of the tag, tag
    middle: bytes
    filler: bytes

    @classmethod
    def build(cls, *, settled: bool) -> TransferTemplate:
        # transfer: handle, delivery-id (uint), delivery-tag (vbin8 of 4 bytes), message-format 0, settled
        fields_size = 1 + 5 + 6 + 1 + 1
        performative = b"\x00\x53\x14" + bytes([0xC0, fields_size + 1, 5])
        message = encode(Described(ULong(0x70), [True])) + DATA_HEAD  # header (durable) and data sections
        size = 8 + len(performative) + fields_size + len(message) + BODY_SIZE
        head = _FRAME_HEAD.pack(size, 2, 0, 0) + performative + b"\x43\x70"
        middle = b"\x43" + (b"\x41" if settled else b"\x42") + message
        return cls(head, struct.Struct(">IHI"), middle, b"x" * (BODY_SIZE - STAMP_DIGITS - SEQ_DIGITS))

    def frames(self, first: int, end: int, clock: Callable[[], int]) -> bytes:
        """The transfers of messages (and delivery-ids) ``first`` to ``end - 1``, stamped now."""
        head, pack, middle, filler = self.head, self.ids.pack, self.middle, self.filler
        parts: list[bytes] = []
        for i in range(first, end):
            parts += (head, pack(i, 0xA004, i), middle, b"%020d%010d" % (clock(), i), filler)
        return b"".join(parts)


# disposition: role receiver, first, last (wide uints), settled, accepted
_DISPOSITION_HEAD = _FRAME_HEAD.pack(8 + 3 + 3 + 16, 2, 0, 0) + b"\x00\x53\x15" + bytes([0xC0, 17, 5]) + b"\x41"
_DISPOSITION_IDS = struct.Struct(">BIBI")
_DISPOSITION_TAIL = b"\x41\x00\x53\x24\x45"


def disposition_frame(first: int, last: int) -> bytes:
    """A ranged disposition ``first..last`` from a receiver: settled, ``accepted``."""
    return _DISPOSITION_HEAD + _DISPOSITION_IDS.pack(0x70, first, 0x70, last) + _DISPOSITION_TAIL


def _uint(buf: bytearray, at: int) -> tuple[int | None, int]:
    """The uint (or null) at ``buf[at]`` and the offset after it."""
    code = buf[at]
    if code == 0x52:
        return buf[at + 1], at + 2
    if code == 0x70:
        return _U32.unpack_from(buf, at + 1)[0], at + 5
    if code == 0x43:
        return 0, at + 1
    if code == 0x40:
        return None, at + 1
    value, end = decode(bytes(buf[at : at + 9]))
    return cast(int, value), at + end


def _body_at(buf: bytearray, at: int, end: int) -> int:
    """Where the data section's bytes start in the message of a transfer whose performative (its list) is at
    ``buf[at]`` and whose frame ends at ``end``; -1 when there is no data section."""
    if buf.startswith(DATA_HEAD, end - BODY_SIZE - len(DATA_HEAD)):  # the gateway's usual layout: data last
        return end - BODY_SIZE
    data = bytes(buf[at:end])
    pos = skip(data, 0)
    while pos < len(data):
        if data[pos] == 0 and data[pos + 1] == 0x53 and data[pos + 2] == 0x75:
            code = data[pos + 3]
            return at + pos + (5 if code == 0xA0 else 8)
        pos = skip(data, pos)
    return -1


def _descriptor(buf: bytearray, start: int, end: int) -> tuple[int, int]:
    """The performative code of the frame body at ``buf[start]`` (in any ulong encoding) and where its
    fields start."""
    if buf[start] != 0:
        raise AmqpError(f"a frame body that is no performative: {bytes(buf[start:end])[:40].hex()}")
    descriptor, after = decode(bytes(buf[start + 1 : end]))
    if type(descriptor) is not int:
        raise AmqpError(f"unexpected descriptor {descriptor!r}")
    return descriptor, start + 1 + after


def _condition(error: Any) -> str:
    """An error (0x1d) as text."""
    if isinstance(error, Described) and isinstance(error.value, list):
        fields = [*error.value, None, None]
        return f"{fields[0]}: {fields[1] or ''}"
    return repr(error)


def _fields(value: Any, count: int) -> list[Any]:
    """A performative's fields, padded with the nulls that may be left off its end."""
    fields = list(value) if isinstance(value, list) else []
    return fields + [None] * (count - len(fields))


# ---------------------------------------------------------------------------------------------- clients
class AmqpError(Exception):
    pass


class _AmqpClient(RawClient):
    """An AMQP 1.0 connection with one session (channel 0) and one link (handle 0): an incremental frame
    parser, the flow-control state of the link and session, and the waits the benchmark needs."""

    error_type = AmqpError

    def __init__(self) -> None:
        super().__init__()
        self.remote_idle_ms = 0
        self.remote_next_outgoing = 0  # the gateway's first transfer-id (its begin)
        self.remote_delivery_count = 0  # the gateway's initial-delivery-count, when it is the sender
        self.credit_limit = 0  # delivery-count + link-credit of the gateway's last flow: what we may send up to
        self.window_limit = 0  # next-incoming-id + incoming-window of the gateway's session
        self.settled = 0  # our transfers the gateway settled
        self.confirmed = 0  # ... with accepted
        self.last_settled_ns = 0  # the read that brought the last of them
        self._now = 0
        self._buffer = bytearray()
        self._headers = 0  # protocol headers we sent and the gateway has not answered yet
        self._events: dict[str, asyncio.Future[Any]] = {}
        self._changed: asyncio.Future[None] | None = None
        self._news = False  # a flow or disposition in this read
        self._keepalive: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._keepalive is not None:
            self._keepalive.cancel()

    def data_received(self, data: bytes) -> None:
        self._now = time.monotonic_ns()
        buf = self._buffer
        buf += data
        size = len(buf)
        pos = 0
        while size - pos >= 8 and not self.error:
            if self._headers:
                self._headers -= 1
                self._event("header", bytes(buf[pos : pos + 8]))
                pos += 8
                continue
            length, doff, kind, _ = _FRAME_HEAD.unpack_from(buf, pos)
            end = pos + length
            if length < 8 or doff < 2 or 4 * doff > length:
                self._fail(f"malformed frame header {bytes(buf[pos : pos + 8]).hex()}")
                return
            if end > size:
                break
            start = pos + 4 * doff
            if start < end:  # else an empty frame: a heartbeat
                try:
                    if buf[start] == 0 and buf[start + 1] == 0x53:  # a smallulong descriptor, as usual
                        code, at = buf[start + 2], start + 3
                    else:
                        code, at = _descriptor(buf, start, end)
                    if code == TRANSFER and kind == 0:
                        self.transfer(buf, at, end)
                    else:
                        self.control(code, decode(bytes(buf[at:end]))[0])
                except Exception as exc:
                    self._fail(f"bad frame {bytes(buf[pos:end])[:200].hex()}: {exc!r}")
                    return
            pos = end
        del buf[:pos]
        self.chunk_done()

    # ---------------------------------------------------------------- frames
    def transfer(self, buf: bytearray, at: int, end: int) -> None:
        """A transfer: its performative's list at ``buf[at]``, the message up to ``end``."""
        raise AmqpError("unexpected transfer")

    def control(self, code: int, value: Any) -> None:
        """Any other performative, decoded."""
        if code == FLOW:
            f = _fields(value, 11)
            # next-incoming-id is null until the gateway got our begin: then our first transfer-id, 0
            self.window_limit = (f[0] or 0) + (f[1] or 0)
            if f[4] is not None and f[6] is not None:
                self.credit_limit = (f[5] or 0) + f[6]
            self._news = True
        elif code == DISPOSITION:
            f = _fields(value, 6)
            if f[0] is True and f[3] is True:  # the gateway (receiver) settled our transfers first..last
                n = (f[1] if f[2] is None else f[2]) - f[1] + 1
                self.settled += n
                state = f[4]
                if state is None or (isinstance(state, Described) and state.descriptor == ACCEPTED):
                    self.confirmed += n
                elif not self.error:
                    self.error = f"the gateway settled transfers {f[1]}..{f[2]} with {state!r}"
                self.last_settled_ns = self._now
                self._news = True
        elif code == OPEN:
            self.remote_idle_ms = _fields(value, 10)[4] or 0
            self._event("open", value)
        elif code == BEGIN:
            f = _fields(value, 8)
            self.remote_next_outgoing = f[1] or 0
            self.window_limit = f[2] or 0  # our first transfer-id is 0
            self._event("begin", value)
        elif code == ATTACH:
            f = _fields(value, 14)
            if f[2] is False:  # the gateway is the sender
                self.remote_delivery_count = f[9] or 0
            self._event("attach", f)
        elif code == DETACH:
            f = _fields(value, 3)
            if f[2] is not None:
                self._fail(f"detach: {_condition(f[2])}")
            self._event("detach", f)
        elif code in (END, CLOSE):
            f = _fields(value, 1)
            if f[0] is not None:
                self._fail(f"{'end' if code == END else 'close'}: {_condition(f[0])}")
            self._event("end" if code == END else "close", f)
        elif code == SASL_MECHANISMS:
            self._event("sasl-mechanisms", _fields(value, 1)[0])
        elif code == SASL_OUTCOME:
            self._event("sasl-outcome", _fields(value, 2))
        else:
            self._fail(f"unexpected performative {code:#04x}: {value!r}")

    def chunk_done(self) -> None:
        """Called after the frames of one read."""
        if self._news:
            self._news = False
            if self._changed is not None and not self._changed.done():
                self._changed.set_result(None)

    def _event(self, name: str, value: Any) -> None:
        future = self._events.get(name)
        if future is None or future.done():
            future = self._events[name] = self.loop.create_future()
        future.set_result(value)

    async def wait(self, name: str, timeout: float = SETUP_S) -> Any:
        """The next ``name`` event (``open``, ``attach`` ...), even if it came before the wait."""
        future = self._events.get(name)
        if future is None:
            future = self._events[name] = self.loop.create_future()
        self._check()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise AmqpError(f"no {name} from the gateway within {timeout} s") from None
        finally:
            if future.done() and self._events.get(name) is future:
                del self._events[name]

    def _waiters(self) -> tuple[asyncio.Future[Any] | None, ...]:
        return self._changed, *self._events.values()

    # ---------------------------------------------------------------- the client's side
    async def changed(self) -> None:
        """Waits for the next read that brings a flow or a disposition."""
        self._check()
        self._changed = self.loop.create_future()
        await self._changed

    async def _header(self, header: bytes) -> None:
        self._headers += 1
        self.write(header)
        answer = await self.wait("header")
        if answer != header:
            raise AmqpError(f"the gateway answered protocol header {header!r} with {answer!r}")

    async def connect(self, opts: RunOptions, name: str, *, receiver: bool) -> None:
        """SASL (if asked for), open, begin, and attach our link to ``opts.address``."""
        if opts.sasl_user is not None:
            await self._header(SASL_HEADER)
            mechanisms = await self.wait("sasl-mechanisms")
            offered = mechanisms.items if isinstance(mechanisms, Array) else [mechanisms]
            if "PLAIN" not in offered:
                raise AmqpError(f"the gateway does not offer SASL PLAIN: {offered!r}")
            response = b"\x00" + opts.sasl_user.encode() + b"\x00" + opts.sasl_password.encode()
            self.write(frame(SASL_INIT, [Symbol("PLAIN"), response, opts.host], kind=1))
            outcome = await self.wait("sasl-outcome")
            if outcome[0] != 0:
                raise AmqpError(f"SASL outcome {outcome[0]}: {outcome[1]!r}")
        await self._header(AMQP_HEADER)
        settle = SETTLE_SETTLED if opts.presettled else SETTLE_UNSETTLED
        if receiver:  # source: the queue; target: us
            source, target = Described(ULong(SOURCE), [opts.address]), Described(ULong(TARGET), [])
        else:
            source, target = Described(ULong(SOURCE), []), Described(ULong(TARGET), [opts.address])
        attach: list[Any] = [f"{name}-{opts.address}", UInt(HANDLE), receiver, UByte(settle), UByte(0), source, target]
        if not receiver:
            attach += [None, False, UInt(0)]  # unsettled, incomplete-unsettled, initial-delivery-count
        self.write(
            frame(OPEN, [f"bench-{name}-{uuid.uuid4().hex[:8]}", opts.host, UInt(MAX_FRAME), UShort(0)])
            + frame(BEGIN, [None, UInt(0), UInt(WINDOW), UInt(WINDOW)])
            + frame(ATTACH, attach)
        )
        await self.wait("open")
        if self.remote_idle_ms:
            self._keepalive = self.loop.create_task(self._heartbeats(self.remote_idle_ms / 2000))
        await self.wait("begin")
        fields = await self.wait("attach")
        if fields[5 if receiver else 6] is None:  # refused: a detach with the reason follows
            with contextlib.suppress(AmqpError):
                await self.wait("detach", CLOSE_S)
            raise AmqpError(self.error or "the gateway refused the attach")

    async def _heartbeats(self, interval: float) -> None:
        while self.transport is not None and not self.transport.is_closing():
            await asyncio.sleep(interval)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(EMPTY_FRAME)

    async def detach(self) -> None:
        """Close our link and wait for the gateway's detach: it has handled everything sent before."""
        self.write(frame(DETACH, [UInt(HANDLE), True]))
        await self.wait("detach")

    async def close(self, *, detached: bool = False) -> None:
        """Detach, end, close, wait for the gateway's close and for the connection's end."""
        self._closing = True
        if self.transport is None:
            return
        if not self.error and not self.transport.is_closing():
            self.transport.write(
                (b"" if detached else frame(DETACH, [UInt(HANDLE), True])) + frame(END, []) + frame(CLOSE, [])
            )
            with contextlib.suppress(AmqpError):
                await self.wait("close", CLOSE_S)
        await self._shut(CLOSE_S)
        if self._keepalive is not None:
            self._keepalive.cancel()


C = TypeVar("C", bound=_AmqpClient)


class _Consumer(_AmqpClient):
    pause_reading_when_blocked = True  # dispositions back up: stop reading transfers until they drain

    def __init__(self, expected: int, *, presettled: bool) -> None:
        super().__init__()
        self.expected = expected
        self.presettled = presettled
        self.delivered = 0
        self.distinct = 0
        self.last_ns = 0  # the read that brought the last message
        self.latencies_ns: list[int] = []
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self._seen = bytearray(expected)
        self._first = True
        self._first_id = -1
        self._last_id = -1
        self._granted_at = 0  # transfers received when the credit was last set

    def data_received(self, data: bytes) -> None:
        self._first = True
        super().data_received(data)

    def grant(self) -> bytes:
        """A flow frame that sets our link credit to ``CREDIT`` (delivery-count: what we received)."""
        received = self._granted_at = self.delivered
        return frame(
            FLOW,
            [
                UInt(self.remote_next_outgoing + received),
                UInt(WINDOW),
                UInt(0),
                UInt(WINDOW),
                UInt(HANDLE),
                UInt(self.remote_delivery_count + received),
                UInt(CREDIT),
            ],
        )

    def transfer(self, buf: bytearray, at: int, end: int) -> None:
        code = buf[at]
        if code == 0xC0:
            pos = at + 3
        elif code == 0xD0:
            pos = at + 9
        else:
            raise AmqpError(f"transfer fields are not a list: {code:#04x}")
        _, pos = _uint(buf, pos)  # handle: we have one link
        delivery_id, pos = _uint(buf, pos)
        if delivery_id is None:
            raise AmqpError("a transfer without delivery-id (a multi-frame message?)")
        if self._first_id < 0:
            self._first_id = delivery_id
        self._last_id = delivery_id
        self.delivered += 1
        body = _body_at(buf, at, end)
        if body < 0 or body + STAMP_DIGITS + SEQ_DIGITS > end:
            raise AmqpError(f"a message without the benchmark's body: {bytes(buf[at:end])[:200].hex()}")
        seq = int(buf[body + STAMP_DIGITS : body + STAMP_DIGITS + SEQ_DIGITS])
        if seq < self.expected and not self._seen[seq]:
            self._seen[seq] = 1
            self.distinct += 1
        if self._first:  # one latency sample per read keeps the consumer cheap
            self._first = False
            self.latencies_ns.append(self._now - int(buf[body : body + STAMP_DIGITS]))

    def chunk_done(self) -> None:
        super().chunk_done()
        if self._first_id < 0 or self.error:
            return
        parts = [] if self.presettled else [disposition_frame(self._first_id, self._last_id)]
        self._first_id = -1
        if (self.delivered - self._granted_at) * 2 >= CREDIT:
            parts.append(self.grant())
        if parts:
            self.write(b"".join(parts))
        self.last_ns = self._now
        if self.distinct >= self.expected and not self.finished.done():
            self.finished.set_result(None)


async def _connect(opts: RunOptions, name: str, factory: Callable[[], C], *, receiver: bool) -> C:
    _, client = await asyncio.get_running_loop().create_connection(
        factory, opts.host, opts.port, ssl=client_tls(opts.ca_file)
    )
    await client.connect(opts, name, receiver=receiver)
    return client


async def _wait_for(event: MpEvent, deadline: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    while not event.is_set():
        if loop.time() > deadline:
            raise AmqpError(what)
        await asyncio.sleep(0.001)


async def _produce(opts: RunOptions, attached: MpEvent, subscribed: MpEvent, result: ProducerResult) -> None:
    client = await _connect(opts, "producer", _AmqpClient, receiver=False)
    attached.set()  # the queue exists: the consumer may attach
    loop = asyncio.get_running_loop()
    await _wait_for(subscribed, loop.time() + opts.deadline_s, "the consumer did not attach")
    template = TransferTemplate.build(settled=opts.presettled)
    count, presettled = opts.count, opts.presettled
    interval = 1e9 / opts.rate if opts.rate else 0.0
    clock = time.monotonic_ns
    cpu = cpu_self()
    t0 = result["t0_ns"] = clock()
    sent = 0
    while sent < count:
        await client.writable()
        # our delivery-count and next transfer-id are both ``sent``: one frame per message
        end = min(count, sent + BATCH, client.credit_limit, client.window_limit)
        if not presettled:
            end = min(end, client.settled + MAX_UNSETTLED)
        if interval:
            delay = t0 + sent * interval - clock()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            end = min(end, max(sent + 1, int((clock() - t0) / interval) + 1))  # what is due by now
        if end <= sent:
            await client.changed()
            continue
        client.write(template.frames(sent, end, clock))
        sent = result["sent"] = end
    if presettled:
        await client.detach()
        result["done_ns"] = clock()
    else:
        while client.settled < sent:
            await client.changed()
        result["done_ns"] = client.last_settled_ns
    result["confirmed"] = sent if presettled else client.confirmed
    result["cpu_s"] = cpu_self() - cpu
    await client.close(detached=presettled)


async def _consume(
    opts: RunOptions, attached: MpEvent, subscribed: MpEvent, produced: MpEvent, result: ConsumerResult
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + opts.deadline_s
    await _wait_for(attached, deadline, "the producer did not attach")
    client = await _connect(opts, "consumer", lambda: _Consumer(opts.count, presettled=opts.presettled), receiver=True)
    client.write(client.grant())
    cpu = cpu_self()
    subscribed.set()
    result["latencies_ns"] = client.latencies_ns
    quiet_since = 0.0

    def collect() -> None:
        result["delivered"], result["distinct"], result["last_ns"] = client.delivered, client.distinct, client.last_ns

    try:
        while not client.finished.done() and loop.time() < deadline:
            await asyncio.wait([client.finished], timeout=0.1)
            collect()
            if client.error:
                raise AmqpError(client.error)
            if produced.is_set():  # everything is sent: wait a little for what is missing, then give up
                quiet_since = max(quiet_since or time.monotonic(), client.last_ns / 1e9)
                if time.monotonic() - quiet_since > GRACE_S:
                    break
    finally:
        collect()
        result["cpu_s"] = cpu_self() - cpu
    await client.close()


def _producer_main(
    opts: RunOptions, attached: MpEvent, subscribed: MpEvent, produced: MpEvent, out: Connection
) -> None:
    signal.alarm(opts.deadline_s + 30)  # the last resort: SIGALRM ends the process
    result = ProducerResult(error="", t0_ns=0, done_ns=0, sent=0, confirmed=0, cpu_s=0.0)
    try:
        run_main(asyncio.wait_for(_produce(opts, attached, subscribed, result), opts.deadline_s))
    except TimeoutError:
        result["error"] = f"producer deadline of {opts.deadline_s} s"
    except Exception as exc:
        result["error"] = f"producer: {exc!r}"
    produced.set()
    out.send(result)


def _consumer_main(
    opts: RunOptions, attached: MpEvent, subscribed: MpEvent, produced: MpEvent, out: Connection
) -> None:
    signal.alarm(opts.deadline_s + 30)
    result = ConsumerResult(error="", delivered=0, distinct=0, last_ns=0, latencies_ns=[], cpu_s=0.0)
    try:
        run_main(
            asyncio.wait_for(_consume(opts, attached, subscribed, produced, result), opts.deadline_s + 2 * GRACE_S)
        )
    except TimeoutError:
        result["error"] = f"consumer deadline of {opts.deadline_s} s"
    except Exception as exc:
        result["error"] = f"consumer: {exc!r}"
    out.send(result)


# ---------------------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunResult:
    sent: int
    delivered: int
    duplicates: int
    lost: int
    elapsed_s: float
    rate: float
    confirmed_rate: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    samples: int
    client_cores: float
    server_cpu_s: dict[str, float]
    error: str

    @property
    def broker_us(self) -> float:
        """Broker CPU (all watched server processes) per delivery, in µs; NaN when not watched."""
        if not self.server_cpu_s or not self.delivered:
            return float("nan")
        return sum(self.server_cpu_s.values()) * 1e6 / self.delivered


def run_once(opts: RunOptions, servers: dict[str, int]) -> RunResult:
    """One producer process and one consumer process; ``servers`` are processes whose CPU use is measured."""
    ctx = multiprocessing.get_context("spawn")
    attached, subscribed, produced = ctx.Event(), ctx.Event(), ctx.Event()
    consumer_end, consumer_out = ctx.Pipe(duplex=False)
    producer_end, producer_out = ctx.Pipe(duplex=False)
    consumer = ctx.Process(
        target=_consumer_main, args=(opts, attached, subscribed, produced, consumer_out), daemon=True
    )
    producer = ctx.Process(
        target=_producer_main, args=(opts, attached, subscribed, produced, producer_out), daemon=True
    )
    cpu = {name: cpu_of(pid) for name, pid in servers.items()}
    consumer.start()
    producer.start()
    until = time.monotonic() + opts.deadline_s + 4 * GRACE_S + 30
    reports: list[ProducerResult | ConsumerResult | None] = []
    for end in (producer_end, consumer_end):
        ready = end.poll(max(0.0, until - time.monotonic()))
        reports.append(cast(ProducerResult | ConsumerResult, end.recv()) if ready else None)
    cpu = {name: cpu_of(pid) - cpu[name] for name, pid in servers.items()}
    for process in (producer, consumer):
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    if reports[0] is None or reports[1] is None:
        raise SystemExit("a client process did not report")
    produced_result, consumed_result = cast(ProducerResult, reports[0]), cast(ConsumerResult, reports[1])
    error = "; ".join(e for e in (produced_result["error"], consumed_result["error"]) if e)
    delivered, distinct = consumed_result["delivered"], consumed_result["distinct"]
    t0 = produced_result["t0_ns"]
    elapsed = max(consumed_result["last_ns"] - t0, 1) / 1e9 if delivered and t0 else 0.0
    confirmed_s = (produced_result["done_ns"] - t0) / 1e9 if produced_result["done_ns"] and t0 else 0.0
    latencies = sorted(consumed_result["latencies_ns"])

    def pick(q: float) -> float:
        return quantile_ms(latencies, q)

    clients = produced_result["cpu_s"] + consumed_result["cpu_s"]
    return RunResult(
        produced_result["sent"],
        delivered,
        delivered - distinct,
        produced_result["sent"] - distinct,
        elapsed,
        delivered / elapsed if elapsed else 0.0,
        produced_result["confirmed"] / confirmed_s if confirmed_s > 0 else 0.0,
        pick(0.50),
        pick(0.99),
        pick(0.999),
        pick(1.0),
        len(latencies),
        clients / elapsed if elapsed else 0.0,
        cpu,
        error,
    )


def _broker(result: RunResult) -> str:
    return broker_cpu_text(result.server_cpu_s, result.delivered, result.elapsed_s, result.broker_us)


def _describe(result: RunResult, *, paced: bool) -> str:
    p999 = f" p99.9 {result.p999_ms:.2f}" if paced else ""
    text = (
        f"{result.rate:,.0f} msgs/s delivered ({result.delivered:,} of {result.sent:,} in {result.elapsed_s:.2f} "
        f"s), {result.confirmed_rate:,.0f} msgs/s producer-confirmed; latency ms p50 {result.p50_ms:.2f} p99 "
        f"{result.p99_ms:.2f}{p999} max {result.max_ms:.2f} ({result.samples:,} samples); lost {result.lost:,}, "
        f"duplicates {result.duplicates:,}; {_broker(result)}; client cores {result.client_cores:.2f}"
    )
    return f"{text}; FAILED: {result.error}" if result.error else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs (the median is reported)")
    parser.add_argument(
        "--count", type=int, default=None, help="messages per run (default: 100,000; with --rate: rate x --seconds)"
    )
    parser.add_argument(
        "--presettled",
        action="store_true",
        help="pre-settled transfers and a consumer link in snd-settle-mode settled (at most once)",
    )
    parser.add_argument("--rate", type=int, default=0, help="send this many msgs/s (a latency run)")
    parser.add_argument("--seconds", type=int, default=10, help="length of a --rate run")
    parser.add_argument("--host", default="127.0.0.1", help="gateway host (with --port)")
    parser.add_argument("--port", type=int, default=None, help="AMQP port of a gateway already running")
    parser.add_argument("--core-pid", type=int, default=None, help="with --port: the core process to watch")
    parser.add_argument("--gateway-pid", type=int, default=None, help="with --port: the gateway process to watch")
    parser.add_argument(
        "--sasl",
        choices=["none", "plain"],
        default="none",
        help="connect without a SASL layer (default) or with SASL PLAIN",
    )
    parser.add_argument("--user", default=None, help="with --sasl plain: the user name")
    parser.add_argument("--password", default="", help="with --sasl plain: the password")
    parser.add_argument("--deadline", type=int, default=120, help="seconds after which a client gives up")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="every connection over TLS (clients to the gateway, "
        "the gateway to its core), with throw-away certificates",
    )
    args = parser.parse_args()
    if args.runs < 1 or (args.count is not None and args.count < 1) or args.rate < 0 or args.seconds < 1:
        parser.error("--runs, --count and --seconds must be positive, --rate not negative")
    if args.sasl == "plain" and args.user is None:
        parser.error("--sasl plain needs --user (and --password)")
    print(f"machine: {machine()}")
    count = args.count or (args.rate * args.seconds if args.rate else 100_000)
    paced = f" at {args.rate:,} msgs/s" if args.rate else ""
    mode = "pre-settled" if args.presettled else f"unsettled, {MAX_UNSETTLED} in flight"
    title = f"S4 AMQP DURABLE QUEUE ({mode}){paced}"
    with gateway_target(
        "amqp",
        amqp_gateway,
        args.host,
        args.port,
        {"core": args.core_pid, "gateway": args.gateway_pid},
        tls=args.tls,
    ) as (port, servers, ca_file):
        results = []
        for n in range(1, args.runs + 1):
            user = args.user if args.sasl == "plain" else None
            opts = RunOptions(
                args.host,
                port,
                f"bench.{uuid.uuid4().hex[:12]}",
                args.presettled,
                count,
                args.rate,
                args.deadline,
                user,
                args.password,
                ca_file,
            )
            result = run_once(opts, servers)
            results.append(result)
            print(f"S4 run {n}{paced}: {_describe(result, paced=bool(args.rate))}", flush=True)
        fields = ("rate", "confirmed_rate", "elapsed_s", "p50_ms", "p99_ms", "p999_ms", "max_ms", "client_cores")
        median = replace(results[0], **{name: statistics.median(getattr(r, name) for r in results) for name in fields})
        rates = [r.rate for r in results]
        failed = sum(1 for r in results if r.error)
        broker = statistics.median(r.broker_us for r in results)
        p999 = f" p99.9 {median.p999_ms:.2f}" if args.rate else ""
        print(
            f"{title.upper()} median {median.rate:,.0f} msgs/s delivered (min {min(rates):,.0f}, max "
            f"{max(rates):,.0f}), {median.confirmed_rate:,.0f} msgs/s producer-confirmed, over {args.runs} runs "
            f"of {count:,}; latency ms p50 {median.p50_ms:.2f} p99 {median.p99_ms:.2f}{p999} max "
            f"{median.max_ms:.2f}; lost {sum(r.lost for r in results):,}, duplicates "
            f"{sum(r.duplicates for r in results):,} in all; broker CPU µs/msg {broker:.1f}; client cores "
            f"{median.client_cores:.2f}" + (f"; {failed} FAILED" if failed else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
