"""``GET /api/nodes/{node_id}/{path}``: any node answers the read-only API of every live member of its cluster.

The console (a page of one node) cannot call the other nodes itself: they are other origins. This node
passes the request on to the member's management port with the caller's own ``Authorization`` header, so the
member decides with its own users what the caller may read, and returns the answer as it came. Only ``GET``
passes, only to members this node knows through its cluster connections, and never to ``/api/nodes`` again.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from tridentmq_shared.tls import ClientTls, TlsSection

log = logging.getLogger("tridentmq.core.management")

TIMEOUT_SECONDS = 5.0
MAX_ANSWER_BYTES = 16 * 1024 * 1024
PASSED_HEADERS = ("Authorization", "Accept")


class PeerApi:
    """Forwards API reads to the other members (``cluster`` returns the node's cluster view, or None)."""

    def __init__(
        self,
        node_id: str,
        cluster: Callable[[], dict[str, Any] | None],
        *,
        tls: TlsSection | None,
    ) -> None:
        self.node_id = node_id
        self.cluster = cluster
        self._tls = ClientTls(tls) if tls is not None else None
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS), auto_decompress=True
            )
        return self._session

    async def close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        node_id, path = request.match_info["node_id"], request.match_info["path"]
        # The rest of the path as it came (still percent-encoded: a queue name may hold "/").
        raw = "/".join(request.raw_path.partition("?")[0].split("/")[4:])
        if request.query_string:
            raw += "?" + request.query_string
        if path == "nodes" or path.startswith("nodes/"):
            return web.json_response({"error": "a node forwards to one member only"}, status=400)
        if node_id == self.node_id:  # this node: answer here, under the same credentials
            raise web.HTTPTemporaryRedirect(f"/api/{raw}")
        view = self.cluster()
        members = {m["node_id"]: m for m in (view or {}).get("members", [])}
        member = members.get(node_id)
        if member is None:
            return web.json_response({"error": f"node {node_id!r} is not a live member of this cluster"}, status=404)
        if not member.get("management"):
            return web.json_response({"error": f"node {node_id!r} has no management port"}, status=404)
        scheme = "https" if self._tls is not None else "http"
        host = member["host"] if ":" not in member["host"] else f"[{member['host']}]"
        url = f"{scheme}://{host}:{member['management']}/api/{raw}"
        headers = {name: request.headers[name] for name in PASSED_HEADERS if name in request.headers}
        tls: ssl.SSLContext | bool = self._tls.context() if self._tls is not None else False
        request_url = URL(url, encoded=True)
        try:
            async with self._client().get(request_url, headers=headers, ssl=tls, allow_redirects=False) as answer:
                body = await answer.content.read(MAX_ANSWER_BYTES + 1)
                if len(body) > MAX_ANSWER_BYTES:
                    return web.json_response({"error": f"the answer of node {node_id!r} is too large"}, status=502)
                return web.Response(
                    body=body, status=answer.status, content_type=answer.content_type or "application/json"
                )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
            return web.json_response({"error": f"node {node_id!r} did not answer: {reason}"}, status=502)


def add_peer_api(app: web.Application, peers: PeerApi) -> None:
    app.router.add_get(r"/api/nodes/{node_id:[^/]+}/{path:[\s\S]+}", peers.forward)
    app.on_cleanup.append(peers.close)
