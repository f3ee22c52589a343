"""MQTT 3.1.1 packets for the benchmark scripts' raw-socket clients: what they send, and reading what comes back."""

from __future__ import annotations

import asyncio

CONNACK, SUBACK, PUBLISH = 2, 9, 3


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(2, "big") + data


def connect_packet(client_id: str, *, clean: bool = True) -> bytes:
    """An MQTT 3.1.1 CONNECT without keep-alive; ``clean`` False asks for a persistent session."""
    body = _string("MQTT") + bytes([4, 0x02 if clean else 0x00]) + (0).to_bytes(2, "big") + _string(client_id)
    return b"\x10" + _length(len(body)) + body


def subscribe_packet(topic: str, qos: int = 0) -> bytes:
    body = (1).to_bytes(2, "big") + _string(topic) + bytes([qos])
    return b"\x82" + _length(len(body)) + body


def publish_packet(topic: str, payload: bytes, packet_id: int = 0) -> bytes:
    """A PUBLISH: QoS 0, or QoS 1 with a ``packet_id``."""
    if not packet_id:
        body = _string(topic) + payload
        return b"\x30" + _length(len(body)) + body
    body = _string(topic) + packet_id.to_bytes(2, "big") + payload
    return b"\x32" + _length(len(body)) + body


async def read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(packet type, body) of the next packet."""
    head, body = await read_packet_with_flags(reader)
    return head >> 4, body


async def read_packet_with_flags(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(first byte: packet type and flags, body) of the next packet."""
    head = (await reader.readexactly(1))[0]
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return head, await reader.readexactly(length)
