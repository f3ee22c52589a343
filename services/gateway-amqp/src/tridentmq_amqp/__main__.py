"""``tridentmq-amqp``: run one AMQP 1.0 gateway until SIGINT or SIGTERM."""

from __future__ import annotations

from tridentmq_amqp.server import AmqpGateway
from tridentmq_amqp.settings import ENV_PREFIX, AmqpSettings
from tridentmq_shared.gateway import run_gateway


def main(argv: list[str] | None = None) -> None:
    run_gateway("amqp", AmqpSettings, ENV_PREFIX, AmqpGateway, argv)


if __name__ == "__main__":
    main()
