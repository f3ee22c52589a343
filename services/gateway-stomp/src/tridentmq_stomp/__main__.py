"""``tridentmq-stomp``: run one STOMP gateway until SIGINT or SIGTERM."""

from __future__ import annotations

from tridentmq_shared.gateway import run_gateway
from tridentmq_stomp.server import StompGateway
from tridentmq_stomp.settings import ENV_PREFIX, StompSettings


def main(argv: list[str] | None = None) -> None:
    run_gateway("stomp", StompSettings, ENV_PREFIX, StompGateway, argv)


if __name__ == "__main__":
    main()
