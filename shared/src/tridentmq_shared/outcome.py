"""What a gateway's answer to its client waits for: the core's confirm of a publish (an ``asyncio.Future``).

The gateways' rules that order those answers see only this, so that they are tested without a loop.
"""

from __future__ import annotations

from typing import Protocol


class Outcome(Protocol):
    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...
