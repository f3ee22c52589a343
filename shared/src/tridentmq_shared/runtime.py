"""Running an asyncio entry point the same way in every TridentMQ process (uvloop when installed)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_main(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)  # type: ignore[no-any-return]
