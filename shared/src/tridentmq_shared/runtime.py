"""Running an asyncio entry point the same way in every TridentMQ process (uvloop when installed)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


#: Young-generation threshold of the cyclic GC. Messages are acyclic lists that arrive by the hundred
#: thousand; at CPython's default (700) the collector rescans them thousands of times a second.
GC_THRESHOLD = 100_000


def tune_gc() -> None:
    """Collect rarely: our hot objects hold no reference cycles, so frequent collections are pure cost."""
    gc.set_threshold(GC_THRESHOLD, 50, 100)
    gc.freeze()  # what exists at start-up (modules, settings) lives for ever: never scan it again


def run_main(main: Coroutine[Any, Any, T]) -> T:
    tune_gc()
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
