"""One node (a core and the three gateways) for a whole fuzz module, its doors, and seeds recorded from real
clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, GatewayProcess, ServiceProcess, start_core, start_gateway
from tests.doors import (
    amqp_round_trip,
    amqp_websocket_round_trip,
    http_round_trip,
    link_round_trip,
    mqtt_round_trip,
    stomp_round_trip,
)
from tests.fuzz.recorder import record
from tests.memory import MIB, rss

#: How far above its size after start-up a process may grow during the fuzzing. Generous: a case is at most
#: a few KiB sent on one of at most ``CONCURRENCY`` connections, each bounded before login by 64 KiB
#: (max_connect_bytes, link.handshake_max_frame_bytes) and after by the protocol's frame limit (4-8 MiB).
RSS_HEADROOM = 160 * MIB


@pytest.fixture(autouse=True)
def _stop_leftover_processes() -> None:
    """The node outlives each test of its module (the module fixture stops it): nothing to kill per test."""


@dataclass(frozen=True)
class Door:
    name: str
    port: int
    family: str  # the seeds and strategy: stomp, mqtt, amqp, link, http
    wire: str  # tcp, ws (the family's bytes in binary WebSocket messages) or http
    subprotocol: str = ""
    round_trip: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)


@dataclass
class Node:
    core: CoreProcess
    gateways: dict[str, GatewayProcess]
    doors: dict[str, Door]
    baseline: dict[str, int] = field(default_factory=dict)

    @property
    def processes(self) -> dict[str, ServiceProcess]:
        return {"core": self.core, **self.gateways}

    def check(self) -> None:
        """Every process alive and within its memory bound, and a real client's round trip through every door."""
        for name, process in self.processes.items():
            assert process.process.poll() is None, f"{name} died:\n{process.log()[-3000:]}"
            if name in self.baseline:  # measured once the node is up
                grown = rss(process.process.pid) - self.baseline[name]
                assert grown < RSS_HEADROOM, f"{name} grew by {grown / MIB:.0f} MB"
        for door in self.doors.values():
            door.round_trip()


def _doors(core: CoreProcess, gateways: dict[str, GatewayProcess]) -> dict[str, Door]:
    stomp, mqtt, amqp = gateways["stomp"], gateways["mqtt"], gateways["amqp"]
    doors = [
        Door("link", core.link_port, "link", "tcp", round_trip=partial(link_round_trip, core.link_port)),
        Door(
            "management",
            core.management_port,
            "http",
            "http",
            round_trip=partial(http_round_trip, core.management_port, "/api/queues"),
        ),
        Door("stomp", stomp.port, "stomp", "tcp", round_trip=partial(stomp_round_trip, stomp.port)),
        Door(
            "stomp-ws",
            stomp.ports["websocket"],
            "stomp",
            "ws",
            "v12.stomp",
            partial(stomp_round_trip, stomp.ports["websocket"], websocket=True),
        ),
        Door("mqtt", mqtt.port, "mqtt", "tcp", round_trip=partial(mqtt_round_trip, mqtt.port)),
        Door(
            "mqtt-ws",
            mqtt.ports["websocket"],
            "mqtt",
            "ws",
            "mqtt",
            partial(mqtt_round_trip, mqtt.ports["websocket"], websocket=True),
        ),
        Door("amqp", amqp.port, "amqp", "tcp", round_trip=partial(amqp_round_trip, amqp.port)),
        Door(
            "amqp-ws",
            amqp.ports["websocket"],
            "amqp",
            "ws",
            "amqp",
            partial(amqp_websocket_round_trip, amqp.ports["websocket"]),
        ),
    ]
    for kind, gateway in gateways.items():
        port = gateway.ports["http"]
        doors.append(Door(f"{kind}-http", port, "http", "http", round_trip=partial(http_round_trip, port)))
    return {door.name: door for door in doors}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp_path: Path = tmp_path_factory.mktemp("fuzz")
    core = start_core(tmp_path)
    gateways: dict[str, GatewayProcess] = {}
    try:
        for kind in ("stomp", "mqtt", "amqp"):
            gateways[kind] = start_gateway(tmp_path, core, kind)
        node = Node(core, gateways, _doors(core, gateways))
        node.check()  # every door works before any fuzzing (and the first round trips allocate what they keep)
        node.baseline = {name: rss(process.process.pid) for name, process in node.processes.items()}
        yield node
        for name, process in node.processes.items():
            log = process.log()
            assert "Traceback" not in log, f"{name} logged a traceback:\n{log[-5000:]}"
    finally:
        for process in (*gateways.values(), core):
            process.stop()


@pytest.fixture(scope="module")
def seeds(node: Node) -> dict[str, list[bytes]]:
    """What real clients sent in their sessions, recorded through a proxy, per family."""
    core, gateways = node.core, node.gateways
    recorded = {
        "stomp": record(gateways["stomp"].port, stomp_round_trip),
        "mqtt": record(gateways["mqtt"].port, mqtt_round_trip),
        "amqp": record(gateways["amqp"].port, amqp_round_trip),
        "link": record(core.link_port, link_round_trip),
        "http": [
            *record(gateways["stomp"].ports["http"], http_round_trip),
            *record(gateways["mqtt"].ports["http"], partial(http_round_trip, path="/metrics")),
            *record(core.management_port, partial(http_round_trip, path="/api/queues")),
        ],
    }
    for family, sessions in recorded.items():
        assert sessions, f"nothing recorded of {family}"
    return recorded
