"""``tridentmq-core``: run one core node until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from tridentmq_core.server import CoreNode
from tridentmq_core.settings import ENV_PREFIX, CoreSettings
from tridentmq_core.store.data_lock import LockedError
from tridentmq_core.store.identity import IdentityError
from tridentmq_core.store.journal import JournalCorruptedError, measure_fsync
from tridentmq_shared.logs import setup_logging
from tridentmq_shared.runtime import run_main
from tridentmq_shared.settings import SettingsError, load_settings
from tridentmq_shared.supervision import EXIT_TASK_FAILED, Supervisor, cannot_start, install

log = logging.getLogger("tridentmq.core")

#: How long a stop after a failed task may take before the process exits anyway.
STOP_TIMEOUT = 30.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tridentmq-core", description="Run a TridentMQ core broker node.")
    parser.add_argument("--config", type=Path, help="TOML settings file (see docs/configuration.md)")
    parser.add_argument("--ports-file", type=Path, help="write the bound ports here as JSON once ready")
    parser.add_argument(
        "--tune", action="store_true", help="measure the journal disk's fsync rate, suggest journal settings and exit"
    )
    return parser.parse_args(argv)


async def serve(settings: CoreSettings, ports_file: Path | None) -> int:
    """Run a node until a signal (exit status 0) or until one of its tasks fails (``EXIT_TASK_FAILED``)."""
    supervisor = Supervisor()
    install(supervisor)
    node = CoreNode(settings, ports_file=ports_file, supervisor=supervisor)
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled.set)
    await node.start()
    failed = asyncio.ensure_future(supervisor.wait_failed())  # a failure during the start counts too
    stop = asyncio.ensure_future(signalled.wait())
    await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if failed.done():
        code = EXIT_TASK_FAILED
        log.critical("stopping: a background task failed", extra={"reason": failed.result()})
    else:
        log.info("stopping on signal")
    for waiting in (stop, failed):
        waiting.cancel()
    try:  # the journal is closed and the audit segment sealed after a failure too, within a bound then
        await (asyncio.wait_for(node.stop(), STOP_TIMEOUT) if code else node.stop())
    except Exception:
        log.exception("the node did not stop cleanly")
        code = code or EXIT_TASK_FAILED
    return code


def tune(settings: CoreSettings) -> None:
    """Measure what group commit is bound by on this disk and print the settings to use."""
    directory = Path(settings.journal.directory or settings.node.data_dir / "journal")
    rate = measure_fsync(directory)
    sync_us = 1_000_000 / rate
    # A pause of half a sync lets a burst share one fsync at the cost of that much latency; on disks that
    # sync in well under 100 µs batching happens by itself and no pause is worth its latency.
    delay = 0 if sync_us < 100 else int(sync_us / 2)
    print(f"journal directory: {directory}")
    print(f"fdatasync of 4 KiB writes: {rate:,.0f} per second ({sync_us:,.0f} µs each)")
    print("suggested settings (a TOML file passed with --config):")
    print(f"  [journal]\n  sync_delay_us = {delay}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        settings = load_settings(CoreSettings, prefix=ENV_PREFIX, file=args.config, env=os.environ)
    except SettingsError as exc:
        cannot_start("tridentmq-core", exc)
    setup_logging(settings.node.log_level)
    if args.tune:
        tune(settings)
        return
    try:
        code = run_main(serve(settings, args.ports_file))
    except (OSError, SettingsError, LockedError, JournalCorruptedError, IdentityError) as exc:
        cannot_start("tridentmq-core", exc)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
