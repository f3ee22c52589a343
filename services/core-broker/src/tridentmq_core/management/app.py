"""The management HTTP application: ``/healthz``, ``/readyz``, ``/metrics`` and the JSON API under ``/api``.

Every handler reads the broker synchronously on the event loop that also drives the broker, so a response
is a consistent snapshot and nothing here ever awaits in the middle of reading broker state. The views are
here; the operations that change the broker are in ``operations_api.py``. Who may do what: ``access.py``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from tridentmq_core.broker import Broker
from tridentmq_core.management.access import ManagementAccess, access_middlewares
from tridentmq_core.management.audit_trail import add_audit_trail
from tridentmq_core.management.console import CONSOLE_PATH, add_console
from tridentmq_core.management.metrics import CONTENT_TYPE, render_metrics
from tridentmq_core.management.operations_api import NodeControl, OperationsApi, add_routes
from tridentmq_core.management.peers import PeerApi, add_peer_api
from tridentmq_core.management.status import NodeStatus, QueueRates
from tridentmq_core.queues import Queue
from tridentmq_core.security import SecurityManager
from tridentmq_core.sessions import Session


def queue_view(queue: Queue, rates: QueueRates) -> dict[str, Any]:
    enqueue_rate, ack_rate = rates.rates(queue.name)
    return {
        "name": queue.name,
        "address": queue.address,
        "routing_type": queue.routing_type.name.lower(),
        "durable": queue.durable,
        "temporary": queue.temporary,
        "exclusive": queue.exclusive,
        "paused": queue.paused,
        "filter": queue.filter.text if queue.filter is not None else None,
        "depth": len(queue),
        "in_flight": queue.in_flight,
        "consumers": sum(not c.forwarder for c in queue.consumers),  # clients' consumers (browsers included)
        "forwarders": sum(c.forwarder for c in queue.consumers),  # moving its messages to other nodes
        "added": queue.added,
        "acked": queue.acked,
        "delivered": queue.delivered,
        "expired": queue.expired,
        "dead_lettered": queue.dead_lettered,
        "enqueue_rate": round(enqueue_rate, 3),
        "ack_rate": round(ack_rate, 3),
    }


def connection_view(session: Session) -> dict[str, Any]:
    return {
        "conn_id": session.conn_id,
        "peer": session.peer,
        "client_name": session.client_name,
        "user": session.principal.name,
        "opened_ms": session.opened_ms,
        "consumers": len(session.consumers),
    }


class _Handlers:
    def __init__(self, broker: Broker, status: NodeStatus, rates: QueueRates) -> None:
        self.broker = broker
        self.status = status
        self.rates = rates

    async def root(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(CONSOLE_PATH + "/")

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.status.failure is not None:
            return web.json_response({"status": "failed", "reason": self.status.failure}, status=503)
        if not self.status.ready:
            if self.status.ha is not None:  # a backup: not serving, but says whether it could take over
                ha = self.status.ha()
                return web.json_response(
                    {"status": "backup", "in_sync": ha.get("in_sync", False), "state": ha.get("state", "")}, status=503
                )
            return web.json_response({"status": "starting"}, status=503)
        if why := self.status.not_serving():
            return web.json_response({"status": "not-serving", "reason": why}, status=503)
        return web.json_response(
            {"status": "ready", "recovered": dict(self.status.recovered), "truncated": list(self.status.truncated)}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.broker, self.status, self.rates)
        return web.Response(body=text.encode("utf-8"), headers={"Content-Type": CONTENT_TYPE})

    async def status_(self, request: web.Request) -> web.Response:
        broker = self.broker
        queues = broker.queues.values()
        return web.json_response(
            {
                "node_id": broker.node_id,
                "name": broker.settings.node.name,
                "epoch": self.status.epoch,
                "uptime_s": round(max(time.time() - self.status.started_at, 0.0), 3),
                "ready": self.status.ready,
                "link_port": self.status.link_port,
                "connections": len(broker.sessions),
                "links": self.status.links(),
                "addresses": len(broker.addresses),
                "queues": len(broker.queues),
                "messages": sum(len(q) for q in queues),
                "in_flight": sum(q.in_flight for q in queues),
                "counters": dataclasses.asdict(broker.counters),
                "latency": broker.latency.as_json(),
                "time_in_queue": broker.time_in_queue.as_json(),
                "cluster": self.status.cluster() if self.status.cluster is not None else None,
                "ha": self.status.ha() if self.status.ha is not None else None,
            }
        )

    async def cluster(self, request: web.Request) -> web.Response:
        if self.status.cluster is None:
            return web.json_response({"error": "this node is not part of a cluster"}, status=404)
        view = self.status.cluster()
        queues = self.broker.queues.items()
        view["backlog"] = {name: len(q) + q.in_flight for name, q in queues if len(q) or q.in_flight}
        return web.json_response(view)

    async def addresses(self, request: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "name": address.name,
                    "routing_types": [kind.name.lower() for kind in sorted(address.routing_types)],
                    "queues": sorted(address.queues),
                    "auto_created": address.auto_created,
                }
                for _, address in sorted(self.broker.addresses.items())
            ]
        )

    async def queues(self, request: web.Request) -> web.Response:
        return web.json_response([queue_view(q, self.rates) for _, q in sorted(self.broker.queues.items())])

    async def queue(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        queue = self.broker.queues.get(name)
        if queue is None:
            return web.json_response({"error": f"queue {name!r} does not exist"}, status=404)
        return web.json_response(queue_view(queue, self.rates))

    async def connections(self, request: web.Request) -> web.Response:
        sessions = sorted(self.broker.sessions.values(), key=lambda s: (s.opened_ms, s.conn_id))
        return web.json_response([connection_view(s) for s in sessions])


def create_app(
    broker: Broker,
    status: NodeStatus,
    rates: QueueRates,
    security: SecurityManager | None = None,
    control: NodeControl | None = None,
) -> web.Application:
    """The management application; the caller runs it (``web.AppRunner``) next to the link listener.
    ``security`` holds the users who may use it (by default those of the broker's settings); ``control`` is what
    the operations need of the running node (``operations_api.py``)."""
    handlers = _Handlers(broker, status, rates)
    settings = broker.settings
    if security is None:
        security = SecurityManager(settings.users, settings.permissions)
    access = ManagementAccess(security, public_metrics=settings.management.public_metrics)
    operations = OperationsApi(broker, lambda: status.cluster, control or NodeControl())
    app = web.Application(middlewares=access_middlewares(settings, access, operations.audit_refusal))
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/readyz", handlers.readyz)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/api/status", handlers.status_)
    app.router.add_get("/api/addresses", handlers.addresses)
    app.router.add_get("/api/queues", handlers.queues)
    # Queue names may hold "/" or even a newline (percent-encoded in the URL), hence the catch-all pattern.
    app.router.add_get(r"/api/queues/{name:[\s\S]+}", handlers.queue)
    app.router.add_get("/api/connections", handlers.connections)
    app.router.add_get("/api/cluster", handlers.cluster)
    add_routes(app, operations)
    app.router.add_get("/", handlers.root)
    add_console(app)
    add_peer_api(
        app,
        PeerApi(
            broker.node_id,
            lambda: status.cluster() if status.cluster is not None else None,
            tls=settings.tls if settings.management.tls else None,
        ),
    )
    audit = settings.audit
    audit_dir = Path(audit.directory) if audit.directory else settings.node.data_dir / "audit"
    add_audit_trail(app, audit_dir if audit.enabled else None)
    return app
