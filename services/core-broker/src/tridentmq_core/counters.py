"""The node's message counters since it started (``/metrics`` shows them; each queue counts its own too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    routed: int = 0
    unrouted: int = 0
    duplicates: int = 0
    acked: int = 0
    expired: int = 0
    dead_lettered: int = 0
    rejected: int = 0
    dropped: int = 0  # discarded by address-full-policy DROP
    forwarded: int = 0  # copies put in a store-and-forward queue for another node
    received: int = 0  # messages that came from another node
    redistributed: int = 0  # messages moved to another node's queue of the same name
