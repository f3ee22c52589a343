"""``tridentmq-mqtt``: run one MQTT gateway until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from tridentmq_mqtt.server import MqttGateway
from tridentmq_mqtt.settings import ENV_PREFIX, MqttSettings
from tridentmq_shared.logs import setup_logging
from tridentmq_shared.runtime import run_main
from tridentmq_shared.settings import SettingsError, load_settings

log = logging.getLogger("tridentmq.mqtt")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tridentmq-mqtt", description="Run a TridentMQ MQTT gateway.")
    parser.add_argument("--config", type=Path, help="TOML settings file (see docs/configuration.md)")
    parser.add_argument("--ports-file", type=Path, help="write the bound ports here as JSON once ready")
    return parser.parse_args(argv)


async def serve(settings: MqttSettings, ports_file: Path | None) -> None:
    gateway = MqttGateway(settings, ports_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    await stop.wait()
    log.info("stopping on signal")
    await gateway.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        settings = load_settings(MqttSettings, prefix=ENV_PREFIX, file=args.config, env=os.environ)
    except SettingsError as exc:
        sys.exit(f"tridentmq-mqtt: {exc}")
    setup_logging(settings.node.log_level)
    try:
        run_main(serve(settings, args.ports_file))
    except OSError as exc:
        sys.exit(f"tridentmq-mqtt: {exc}")


if __name__ == "__main__":
    main()
