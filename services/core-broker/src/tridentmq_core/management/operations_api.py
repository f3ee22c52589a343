"""The management API's operations: queues, messages, pause, connections, MQTT state, failback, scale-down and
address settings, for the cluster as a whole.

Any node answers for all: a request without ``node`` runs here and on every live member of the cluster (each
gets it over HTTP with the caller's own credentials and ``node=<its id>``, so it runs there alone and is
checked and audited there), and the answer sums their counts and lists each node's. ``node=<id, id prefix or
name>`` runs it on that node only. The semantics are in ``tridentmq_core.operations`` (pure); this module
checks each parameter's shape (400 with a JSON ``error``), audits every operation as a ``mgmt.*`` event and
fans out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from aiohttp import web

from tridentmq_core.broker import Broker
from tridentmq_core.management.access import USER_KEY
from tridentmq_core.mqtt_admin import MqttAdmin
from tridentmq_core.operations import (
    DEFAULT_PREVIEW_BYTES,
    MAX_BROWSE_LIMIT,
    MAX_PREVIEW_BYTES,
    OperationError,
    Operations,
    check_selector,
    client_matches,
    settings_entry,
)
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import RoutingType
from tridentmq_shared.runtime import wall_ms

log = logging.getLogger("tridentmq.core.management")

FORWARD_TIMEOUT_S: Final = 10.0
MAX_BODY_BYTES: Final = 64 * 1024
MAX_TEXT: Final = 4096  # longest name, selector or client id accepted
#: The operations that change something, each audited as ``mgmt.<operation>`` (docs/audit.md; the Spark jobs
#: list them as known events).
AUDITED_OPERATIONS: Final = (
    "queue.create",
    "queue.delete",
    "queue.purge",
    "messages.move",
    "messages.copy",
    "pause",
    "resume",
    "connection.close",
    "client.close",
    "mqtt.session.delete",
    "mqtt.retained.delete",
    "failback",
    "scale_down",
    "address_settings.set",
    "node.forget",
)
#: What a closed client's link is told (the link client does not reconnect after it).
CLOSED_TEXT: Final = "closed by an operator"


@dataclass
class NodeControl:
    """What the operations need of the running node beyond its broker (all optional: a bare app in tests)."""

    flush: Callable[[], None] = lambda: None  # write what the broker queued (deliveries, closes)
    close_link: Callable[[str, str, str], None] | None = None  # conn id, code, text: close a link
    failback: Callable[[], str | None] | None = None  # hand the pair back to its primary: None, or why not
    scale_down: Callable[[], None] | None = None  # move every message to other nodes, then stop
    forget_node: Callable[[str], dict[str, Any]] | None = None  # drop a departed node (ValueError: why not)
    tls_ca_file: str = ""  # to check the other nodes' certificates when the management port serves HTTPS
    https: bool = False


class RequestRefusedError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


Local = Callable[[], dict[str, Any]]


class OperationsApi:
    def __init__(
        self, broker: Broker, cluster: Callable[[], Callable[[], dict[str, Any]] | None], control: NodeControl
    ) -> None:
        self.broker = broker
        self.ops = Operations(broker)
        self.mqtt = MqttAdmin(broker)
        self._cluster = cluster
        self.control = control
        self._client: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ plumbing
    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not request.body_exists:  # (read already by the body deadline: http_limits)
            return {}
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise RequestRefusedError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        raw = await request.read()  # bounded by the application's client_max_size; kept for forwarding
        if len(raw) > MAX_BODY_BYTES:
            raise RequestRefusedError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: arrays nested thousands deep
            raise RequestRefusedError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestRefusedError(400, "the body is a JSON object")
        return body

    def _members(self) -> list[dict[str, Any]]:
        view = self._cluster()
        return list(view()["members"]) if view is not None else []

    def _target(self, request: web.Request) -> tuple[bool, list[dict[str, Any]]]:
        """(run here?, the other members to forward to)."""
        wanted = request.query.get("node")
        others = [m for m in self._members() if m["node_id"] != self.broker.node_id]
        if wanted is None:
            return True, others
        me = self.broker.node_id

        def named(node_id: str, name: str | None) -> bool:
            return bool(wanted) and (node_id.startswith(wanted) or name == wanted)

        here = named(me, self.broker.settings.node.name)
        found = [m for m in others if named(m["node_id"], m.get("name"))]
        if wanted == me or (here and not found):  # a whole node id names one node, whatever else it starts
            return True, []
        exact = [m for m in found if m["node_id"] == wanted]
        if exact or (len(found) == 1 and not here):
            return False, exact or found
        raise RequestRefusedError(
            404,
            f"no live node {wanted!r} in the cluster"
            if not found
            else f"{wanted!r} names several nodes: give more of the node id",
        )

    async def _forward(self, request: web.Request, member: dict[str, Any], body: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {"node_id": member["node_id"], "name": member.get("name", "")}
        if not member.get("management"):
            return {**entry, "status": 503, "error": "that node has no management port"}
        if self._client is None:
            context = (
                ssl.create_default_context(cafile=self.control.tls_ca_file or None) if self.control.https else None
            )
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S),
                connector=aiohttp.TCPConnector(ssl=context or False),
            )
        scheme = "https" if self.control.https else "http"
        host = member["host"]
        host = f"[{host}]" if ":" in host else host
        query = {**request.query, "node": member["node_id"]}
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        url = f"{scheme}://{host}:{member['management']}{request.rel_url.raw_path}"
        try:
            async with self._client.request(
                request.method, url, params=query, data=body or None, headers=headers
            ) as response:
                answer = await response.json(content_type=None)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return {**entry, "status": 502, "error": f"cannot reach it: {type(exc).__name__} {exc}".strip()}
        if status >= 300:
            return {**entry, "status": status, "error": answer.get("error") if isinstance(answer, dict) else None}
        inner = answer.get("nodes", [{}])[0] if isinstance(answer, dict) else {}
        return {**entry, "status": status, "result": inner.get("result", answer)}

    async def run(self, request: web.Request, operation: str, target: str, local: Local) -> web.Response:
        """Run ``local`` here and on the other nodes it is meant for, audit it here, and sum the answers."""
        try:
            here, others = self._target(request)
        except RequestRefusedError as exc:
            return _refused(request, exc)
        results: list[dict[str, Any]] = []
        body = await request.read()  # read (and kept) by the checks already, when there is one
        forwards = [self._forward(request, m, body) for m in others]
        if here:
            results.append(self._local(request, operation, target, local))
        if forwards:
            results += await asyncio.gather(*forwards)
        return _combine(results)

    def _local(self, request: web.Request, operation: str, target: str, local: Local) -> dict[str, Any]:
        entry: dict[str, Any] = {"node_id": self.broker.node_id, "name": self.broker.settings.node.name}
        audited = operation in AUDITED_OPERATIONS  # the others only read
        try:
            result = local()
        except OperationError as exc:
            if audited:
                self._audit(request, operation, target, f"refused: {exc.text}")
            return {**entry, "status": exc.status, "error": exc.text}
        self.control.flush()
        if audited:
            self._audit(request, operation, target, "ok", result)
        return {**entry, "status": 200, "result": result}

    def audit_refusal(self, request: web.Request, reason: str) -> None:
        """A logged-in user refused an operation before it ran (no manage permission): audited as one it
        refused itself."""
        route = request.match_info.route
        if route.name in AUDITED_OPERATIONS:
            self._audit(request, route.name, request.path_qs[:500], f"refused: {reason}")

    def _audit(
        self, request: web.Request, operation: str, target: str, result: str, counts: dict[str, Any] | None = None
    ) -> None:
        fields: dict[str, object] = {
            "user": request.get(USER_KEY, "anonymous"),
            "operation": operation,
            "target": target,
            "result": result,
            "peer": request.remote,
        }
        if counts:
            fields["counts"] = json.dumps({k: v for k, v in counts.items() if isinstance(v, int)}, sort_keys=True)
        self.broker.audit.emit(wall_ms() * 1000, f"mgmt.{operation}", fields)
        self.broker.audit.flush()  # an operator's action is on disk before the answer says it was done
        level = logging.INFO if result == "ok" else logging.WARNING
        log.log(
            level,
            "management operation",
            extra={"operation": operation, "target": target[:200], "result": result[:200], "user": fields["user"]},
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    # ------------------------------------------------------------------ handlers
    async def create_queue(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            body = await self._body(request)
            name = _text(body, "name", required=True)
            address = _text(body, "address") or name
            routing = _routing(body.get("routing_type", "anycast"))
            durable = _flag(body, "durable", default=True)
            filter_text = _text(body, "filter") or None
            check_selector_400(filter_text)
            exclusive = _flag(body, "exclusive", default=False)
            # Absent or null: no last-value queue ("" would make one keyed on each message's own key field).
            lvq = _text(body, "last_value_key") if body.get("last_value_key") is not None else None
            max_consumers = _int(body, "max_consumers", -1, minimum=-1)
            return name, lambda: self.ops.create_queue(
                name,
                address,
                routing,
                durable=durable,
                filter_text=filter_text,
                exclusive=exclusive,
                last_value_key=lvq,
                max_consumers=max_consumers,
                now_ms=wall_ms(),
            )

        return await self._guarded(request, "queue.create", prepare)

    async def delete_queue(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            name = _name(request.match_info["name"])
            return name, lambda: self.ops.delete_queue(name, wall_ms())

        return await self._guarded(request, "queue.delete", prepare)

    async def purge(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            body = await self._body(request)
            name = _text(body, "queue", required=True)
            selector = _text(body, "selector") or None
            check_selector_400(selector)
            return name, lambda: self.ops.purge(name, selector, wall_ms())

        return await self._guarded(request, "queue.purge", prepare)

    async def move(self, request: web.Request) -> web.Response:
        return await self._move(request, copy=False)

    async def copy(self, request: web.Request) -> web.Response:
        return await self._move(request, copy=True)

    async def _move(self, request: web.Request, *, copy: bool) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            body = await self._body(request)
            name = _text(body, "queue", required=True)
            to = _text(body, "to") or None
            selector = _text(body, "selector") or None
            check_selector_400(selector)
            ids = body.get("message_ids")
            if ids is not None and (
                not isinstance(ids, list) or len(ids) > 10_000 or not all(type(i) is int and i > 0 for i in ids)
            ):
                raise RequestRefusedError(400, "message_ids is a list of at most 10000 positive integers")
            if ids is not None and request.query.get("node") is None and self._members():
                raise RequestRefusedError(400, "message ids are a node's own: give node= with message_ids")
            limit = _int(body, "limit", -1, minimum=-1)
            return f"{name} -> {to or 'origin'}", lambda: self.ops.move(
                name, to, selector=selector, message_ids=ids, limit=limit, copy=copy, now_ms=wall_ms()
            )

        return await self._guarded(request, "messages.copy" if copy else "messages.move", prepare)

    async def browse(self, request: web.Request) -> web.Response:
        try:
            name = _name(request.query.get("queue", ""))
            offset = _query_int(request, "offset", 0, 0, 10**9)
            limit = _query_int(request, "limit", 50, 0, MAX_BROWSE_LIMIT)
            preview = _query_int(request, "preview", DEFAULT_PREVIEW_BYTES, 0, MAX_PREVIEW_BYTES)
            selector = _query_selector(request)
            here, others = self._target(request)
        except RequestRefusedError as exc:
            return _refused(request, exc)
        if others or not here:
            return await self._browse_cluster(request, name, offset, limit, here, others)
        return self._browse_reply(
            [
                self._local(
                    request, "messages.browse", name, lambda: self.ops.browse(name, offset, limit, selector, preview)
                )
            ]
        )

    async def _browse_cluster(
        self, request: web.Request, name: str, offset: int, limit: int, here: bool, others: list[dict[str, Any]]
    ) -> web.Response:
        """One page over the nodes in turn (by node id): first each node's count, then the slices wanted."""
        selector = request.query.get("selector") or None
        preview = _query_int(request, "preview", DEFAULT_PREVIEW_BYTES, 0, MAX_PREVIEW_BYTES)
        members = sorted(
            ([{"node_id": self.broker.node_id, "name": self.broker.settings.node.name, "self": True}] if here else [])
            + others,
            key=lambda m: m["node_id"],
        )

        async def ask(member: dict[str, Any], start: int, count: int) -> dict[str, Any]:
            if member.get("self"):
                return self._local(
                    request, "messages.browse", name, lambda: self.ops.browse(name, start, count, selector, preview)
                )
            forwarded = request.clone(
                rel_url=request.rel_url.with_query({**request.query, "offset": str(start), "limit": str(count)})
            )
            return await self._forward(forwarded, member, b"")

        counted = await asyncio.gather(*(ask(m, 0, 0) for m in members))
        slices = []
        position = 0
        for member, answer in zip(members, counted, strict=True):
            total = answer.get("result", {}).get("total", 0) if answer.get("status") == 200 else 0
            start = max(offset - position, 0)
            count = min(offset + limit - position, total) - start
            if count > 0 and start < total:
                slices.append((member, start, count))
            position += total
        pages = {
            id(m): r
            for (m, _, _), r in zip(slices, await asyncio.gather(*(ask(m, s, c) for m, s, c in slices)), strict=True)
        }
        results = [pages.get(id(m), answer) for m, answer in zip(members, counted, strict=True)]
        return self._browse_reply(results)

    @staticmethod
    def _browse_reply(results: list[dict[str, Any]]) -> web.Response:
        good = [r for r in results if r.get("status") == 200]
        if not good:
            return _combine(results)
        messages = [{**m, "node_id": r["node_id"], "node": r["name"]} for r in good for m in r["result"]["messages"]]
        nodes = [
            {k: v for k, v in r.items() if k != "result"} | ({"total": r["result"]["total"]} if "result" in r else {})
            for r in results
        ]
        return web.json_response(
            {"total": sum(r["result"]["total"] for r in good), "messages": messages, "nodes": nodes}
        )

    async def pause(self, request: web.Request) -> web.Response:
        return await self._pause(request, paused=True)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._pause(request, paused=False)

    async def _pause(self, request: web.Request, *, paused: bool) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            body = await self._body(request)
            queue = _text(body, "queue") or None
            address = _text(body, "address") or None
            if (queue is None) == (address is None):
                raise RequestRefusedError(400, "give either queue or address")
            target = f"queue {queue}" if queue is not None else f"address {address}"
            return target, lambda: self.ops.pause(queue=queue, address=address, paused=paused)

        return await self._guarded(request, "pause" if paused else "resume", prepare)

    async def close_connection(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            conn_id = _name(request.match_info["conn_id"])
            return conn_id, lambda: self._close_connection(conn_id)

        return await self._guarded(request, "connection.close", prepare)

    async def close_client(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            client = _name(request.match_info["client"])
            # One match per link: the list of the client's links, built again for each link, made a close of
            # 10,000 MQTT clients take about 30 s with the node stalled.
            return client, lambda: self._close(lambda s: client_matches(s, client))

        return await self._guarded(request, "client.close", prepare)

    def _close_connection(self, conn_id: str) -> dict[str, Any]:
        """A connection id names one link: none is an error (a client, by contrast, may just be away)."""
        closed = self._close(lambda s: s.conn_id == conn_id)
        if not closed["closed"]:
            raise OperationError(404, f"no connection {conn_id!r} on this node")
        return closed

    def _close(self, chosen: Callable[[Any], bool]) -> dict[str, Any]:
        close_link = self.control.close_link
        if close_link is None:
            raise OperationError(409, "this node cannot close links")
        sessions = [s for s in list(self.broker.sessions.values()) if not s.principal.cluster and chosen(s)]
        for session in sessions:
            close_link(session.conn_id, ErrorCode.CLOSED_BY_OPERATOR, CLOSED_TEXT)
        return {"closed": len(sessions)}

    async def mqtt_sessions(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            return "", lambda: {"sessions": self.mqtt.sessions()}

        return await self._guarded(request, "mqtt.sessions", prepare, merge_lists="sessions")

    async def delete_mqtt_session(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            client = _name(request.match_info["client_id"])
            return client, lambda: self.mqtt.delete_session(client, wall_ms())

        return await self._guarded(request, "mqtt.session.delete", prepare)

    async def retained(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            prefix = request.query.get("prefix", "")
            limit = _query_int(request, "limit", 100, 1, MAX_BROWSE_LIMIT)
            preview = _query_int(request, "preview", DEFAULT_PREVIEW_BYTES, 0, MAX_PREVIEW_BYTES)
            return prefix, lambda: self.mqtt.retained(prefix, limit, preview)

        response = await self._guarded(request, "mqtt.retained", prepare)
        if response.status != 200:
            return response
        # The nodes' copies hold the same messages (those a gateway used): one entry per topic, first by topic.
        answer = json.loads(response.body)  # type: ignore[arg-type]
        merged: dict[str, dict[str, Any]] = {}
        for node in answer["nodes"]:
            for item in node.get("result", {}).get("retained", []) if node.get("status") == 200 else []:
                merged.setdefault(item["topic"], {**item, "node_id": node["node_id"]})
        limit = _query_int(request, "limit", 100, 1, MAX_BROWSE_LIMIT)
        answer["retained"] = [merged[topic] for topic in sorted(merged)][:limit]
        answer["total"] = max((n["result"]["total"] for n in answer["nodes"] if n.get("status") == 200), default=0)
        return web.json_response(answer)

    async def delete_retained(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            topic = request.match_info["topic"]
            if not topic or len(topic) > MAX_TEXT:
                raise RequestRefusedError(400, f"a topic is 1 to {MAX_TEXT} characters")
            return topic, lambda: self.mqtt.delete_retained(topic, wall_ms())

        return await self._guarded(request, "mqtt.retained.delete", prepare)

    async def failback(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            if "node" not in request.query and self._members():
                raise RequestRefusedError(400, "name the node: node=<node id or name>")
            return self.broker.node_id, self._failback

        return await self._guarded(request, "failback", prepare)

    def _failback(self) -> dict[str, Any]:
        if self.control.failback is None:
            raise OperationError(409, "this node is not half of a replication pair")
        why = self.control.failback()
        if why is not None:
            raise OperationError(409, why)
        return {"failback": 1}

    async def scale_down(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            if "node" not in request.query:
                raise RequestRefusedError(400, "name the node that scales down: node=<node id or name>")
            return self.broker.node_id, self._scale_down

        return await self._guarded(request, "scale_down", prepare)

    def _scale_down(self) -> dict[str, Any]:
        if self.control.scale_down is None or self._cluster() is None:
            raise OperationError(409, "this node is not part of a cluster: there is nowhere to move its messages")
        self.control.scale_down()
        return {"scale_down": 1}

    async def forget_node(self, request: web.Request) -> web.Response:
        """Every live node drops a node that never comes back (``docs/clustering.md``, forgetting a node)."""

        async def prepare() -> tuple[str, Local]:
            node_id = request.match_info["node_id"]
            if not node_id or len(node_id) > MAX_TEXT:
                raise RequestRefusedError(400, f"a node id is 1 to {MAX_TEXT} characters")
            return node_id, lambda: self._forget_node(node_id)

        return await self._guarded(request, "node.forget", prepare)

    def _forget_node(self, node_id: str) -> dict[str, Any]:
        if self.control.forget_node is None:
            raise OperationError(409, "this node is not part of a cluster")
        try:
            return self.control.forget_node(node_id)
        except ValueError as exc:
            raise OperationError(409, str(exc)) from None

    async def address_settings(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            address = request.query.get("address") or None
            if address is not None and len(address) > MAX_TEXT:
                raise RequestRefusedError(400, f"address is longer than {MAX_TEXT} characters")
            return address or "", lambda: self.ops.address_settings(address)

        return await self._guarded(request, "address_settings", prepare, here_only=True)

    async def set_address_settings(self, request: web.Request) -> web.Response:
        async def prepare() -> tuple[str, Local]:
            body = await self._body(request)
            match = _text(body, "match", required=True)
            values = body.get("settings")
            if not isinstance(values, dict):
                raise RequestRefusedError(400, "settings is a JSON object of address settings")
            try:
                settings_entry(match, values)
            except OperationError as exc:
                raise RequestRefusedError(exc.status, exc.text) from None
            return match, lambda: self.ops.set_address_settings(match, values)

        return await self._guarded(request, "address_settings.set", prepare)

    async def _guarded(
        self,
        request: web.Request,
        operation: str,
        prepare: Callable[[], Awaitable[tuple[str, Local]]],
        *,
        here_only: bool = False,
        merge_lists: str = "",
    ) -> web.Response:
        """Check the request (``prepare``: 400 before anything runs anywhere), then run it."""
        try:
            target, local = await prepare()
        except RequestRefusedError as exc:
            return _refused(request, exc)
        if here_only:
            try:
                here, chosen = self._target(request) if "node" in request.query else (True, [])
            except RequestRefusedError as exc:
                return _refused(request, exc)
            if not here:  # a view of one node (``--node``): that node's own answer
                entry = await self._forward(request, chosen[0], b"")
                if entry["status"] != 200:
                    return _error(entry["status"], entry["error"] or "that node refused")
                return web.json_response(entry["result"])
            result = self._local(request, operation, target, local)
            if result["status"] != 200:
                return _error(result["status"], result["error"])
            return web.json_response(result["result"])
        response = await self.run(request, operation, target, local)
        if merge_lists and response.status == 200:
            answer = json.loads(response.body)  # type: ignore[arg-type]
            merged = [
                {**item, "node_id": n["node_id"]}
                for n in answer["nodes"]
                if n.get("status") == 200
                for item in n["result"][merge_lists]
            ]
            answer[merge_lists] = merged
            return web.json_response(answer)
        return response


def check_selector_400(selector: str | None) -> None:
    try:
        check_selector(selector)
    except OperationError as exc:
        raise RequestRefusedError(400, exc.text) from None


def _combine(results: list[dict[str, Any]]) -> web.Response:
    """Sum the nodes' counts: 200 when any node did it, else the nodes' common refusal (502 when they differ)."""
    good = [r for r in results if r.get("status") == 200]
    answer: dict[str, Any] = {}
    for result in good:
        for key, value in result["result"].items():
            if isinstance(value, int) and not isinstance(value, bool):
                answer[key] = answer.get(key, 0) + value
    answer["nodes"] = results
    if good:
        return web.json_response(answer)
    statuses = {r.get("status", 502) for r in results}
    status = statuses.pop() if len(statuses) == 1 else 502
    errors = "; ".join(f"{r.get('name') or r['node_id'][:8]}: {r.get('error')}" for r in results)
    return web.json_response(
        {"error": errors if len(results) > 1 else results[0].get("error"), "nodes": results}, status=status
    )


def _refused(request: web.Request, exc: RequestRefusedError) -> web.Response:
    """A request refused before it ran anywhere: one WARNING line, and the JSON error."""
    log.warning(
        "management request refused",
        extra={"path": request.path[:200], "status": exc.status, "reason": exc.text[:200], "peer": request.remote},
    )
    return _error(exc.status, exc.text)


def _error(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status)


def _text(body: dict[str, Any], key: str, *, required: bool = False) -> str:
    value = body.get(key)
    if value is None:
        if required:
            raise RequestRefusedError(400, f"{key} is required")
        return ""
    if not isinstance(value, str) or len(value) > MAX_TEXT or (required and not value):
        raise RequestRefusedError(400, f"{key} is a string of {1 if required else 0} to {MAX_TEXT} characters")
    return value


def _name(value: str) -> str:
    if not value or len(value) > MAX_TEXT:
        raise RequestRefusedError(400, f"a name is 1 to {MAX_TEXT} characters")
    return value


def _flag(body: dict[str, Any], key: str, *, default: bool) -> bool:
    value = body.get(key, default)
    if type(value) is not bool:
        raise RequestRefusedError(400, f"{key} is true or false")
    return value


def _int(body: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = body.get(key, default)
    if type(value) is not int or not minimum <= value <= 2**31:
        raise RequestRefusedError(400, f"{key} is an integer from {minimum}")
    return value


def _query_int(request: web.Request, key: str, default: int, minimum: int, maximum: int) -> int:
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RequestRefusedError(400, f"{key} is an integer") from None
    if not minimum <= value <= maximum:
        raise RequestRefusedError(400, f"{key} is from {minimum} to {maximum}")
    return value


def _query_selector(request: web.Request) -> str | None:
    selector = request.query.get("selector") or None
    if selector is not None and len(selector) > MAX_TEXT:
        raise RequestRefusedError(400, f"selector is longer than {MAX_TEXT} characters")
    check_selector_400(selector)
    return selector


def _routing(value: Any) -> RoutingType:
    if value not in ("anycast", "multicast"):
        raise RequestRefusedError(400, "routing_type is anycast or multicast")
    return RoutingType.ANYCAST if value == "anycast" else RoutingType.MULTICAST


def add_routes(app: web.Application, api: OperationsApi) -> None:
    """The operations' routes; names that may hold ``/`` take the rest of the path (percent-encode the rest)."""
    router = app.router
    router.add_post("/api/queues", api.create_queue, name="queue.create")
    router.add_delete(r"/api/queues/{name:[\s\S]+}", api.delete_queue, name="queue.delete")
    router.add_get("/api/messages", api.browse)
    router.add_post("/api/purge", api.purge, name="queue.purge")
    router.add_post("/api/move", api.move, name="messages.move")
    router.add_post("/api/copy", api.copy, name="messages.copy")
    router.add_post("/api/pause", api.pause, name="pause")
    router.add_post("/api/resume", api.resume, name="resume")
    router.add_delete(r"/api/connections/{conn_id:[\s\S]+}", api.close_connection, name="connection.close")
    router.add_delete(r"/api/clients/{client:[\s\S]+}", api.close_client, name="client.close")
    router.add_get("/api/mqtt/sessions", api.mqtt_sessions)
    router.add_delete(r"/api/mqtt/sessions/{client_id:[\s\S]+}", api.delete_mqtt_session, name="mqtt.session.delete")
    router.add_get("/api/mqtt/retained", api.retained)
    router.add_delete(r"/api/mqtt/retained/{topic:[\s\S]+}", api.delete_retained, name="mqtt.retained.delete")
    router.add_post("/api/failback", api.failback, name="failback")
    router.add_post("/api/scale-down", api.scale_down, name="scale_down")
    router.add_post("/api/cluster/nodes/{node_id}/forget", api.forget_node, name="node.forget")
    router.add_get("/api/address-settings", api.address_settings)
    router.add_put("/api/address-settings", api.set_address_settings, name="address_settings.set")

    async def close_client(_app: web.Application) -> None:
        await api.close()

    app.on_cleanup.append(close_client)
