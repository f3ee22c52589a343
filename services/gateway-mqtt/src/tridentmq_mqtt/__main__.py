"""``tridentmq-mqtt``: run one MQTT gateway until SIGINT or SIGTERM."""

from __future__ import annotations

from tridentmq_mqtt.server import MqttGateway
from tridentmq_mqtt.settings import ENV_PREFIX, MqttSettings
from tridentmq_shared.gateway import run_gateway


def main(argv: list[str] | None = None) -> None:
    run_gateway("mqtt", MqttSettings, ENV_PREFIX, MqttGateway, argv)


if __name__ == "__main__":
    main()
