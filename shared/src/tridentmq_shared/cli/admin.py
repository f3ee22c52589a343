"""Talk to a core node's management API: ``tridentmq status``, ``queue stat`` and the operations."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

Credentials = tuple[str, str] | None  # user and password for HTTP Basic, None: send none

_HINT = {
    401: "give --user and --password, or set TRIDENTMQ_USER and TRIDENTMQ_PASSWORD",
    403: "the user needs the manage permission",
}


class AdminError(Exception):
    """The management API could not be reached or answered badly; the text is for the user."""


def fetch(
    base_url: str,
    path: str,
    timeout: float = 5.0,
    *,
    ca_file: str = "",
    credentials: Credentials = None,
) -> Any:
    """GET ``path`` as JSON, as ``credentials``' user when given; an https URL's certificate is checked against
    ``ca_file`` (else the system's authorities)."""
    return send(base_url, "GET", path, None, timeout, ca_file=ca_file, credentials=credentials)


def send(
    base_url: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    timeout: float = 5.0,
    *,
    ca_file: str = "",
    credentials: Credentials = None,
) -> Any:
    """``method`` ``path`` with ``body`` as JSON (none when None); the answer's JSON. See ``fetch``."""
    url = base_url.rstrip("/") + path
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith("https:") else None
    data = json.dumps(body).encode() if body is not None else None
    try:
        request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - an operator-given URL
    except ValueError as exc:  # no scheme, say
        raise AdminError(f"bad management URL {base_url!r}: {exc} (see --management)") from None
    if data is not None:
        request.add_header("Content-Type", "application/json")
    request.add_header("X-TridentMQ-Request", "1")  # a program, not a cross-site form (the core's CSRF rule)
    if credentials is not None:
        token = base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:  # noqa: S310 - operator-given
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AdminError(f"{url} answered {exc.code}{_why(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminError(f"cannot reach {url}: {reason} (is the core running? see --management)") from None
    except http.client.InvalidURL as exc:  # a port that is no number
        raise AdminError(f"bad management URL {base_url!r}: {exc} (see --management)") from None
    except json.JSONDecodeError:
        raise AdminError(f"{url} did not answer JSON") from None


def _why(error: urllib.error.HTTPError) -> str:
    """What the server said about a refusal (its JSON ``error``) and what to do about it."""
    try:
        said = json.loads(error.read(4096)).get("error")
    except (ValueError, AttributeError, OSError):
        said = None
    parts = [str(said)] if said else []
    if error.code in _HINT:
        parts.append(_HINT[error.code])
    return f": {'; '.join(parts)}" if parts else ""


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def status_text(status: dict[str, Any]) -> str:
    counters = status.get("counters", {})
    lines = [
        f"node        {status.get('name')} ({status.get('node_id')})",
        (f"state       {_state(status)}, up {status.get('uptime_s', 0):.0f} s, link port {status.get('link_port')}"),
        f"sessions    {status.get('connections')} over {status.get('links')} link connection(s)",
        f"addresses   {status.get('addresses')}   queues {status.get('queues')}",
        f"messages    {status.get('messages')} queued, {status.get('in_flight')} in flight",
        "counters    " + ", ".join(f"{k} {v:,}" for k, v in counters.items()),
    ]
    ha = status.get("ha")
    if ha:
        lines.append(ha_line(ha))
    cluster = status.get("cluster")
    if cluster:
        lines += cluster_lines(cluster)
    return "\n".join(lines)


def _state(status: dict[str, Any]) -> str:
    if status.get("ready"):
        return "ready"
    return "backup (serves no client)" if status.get("ha") else "starting"


def ha_line(ha: dict[str, Any]) -> str:
    """The replication pair as this node sees it: its role now, the epoch, the other half's sync state."""
    if ha.get("active"):
        backup = ha.get("backup") or "none"
        state = "in sync" if ha.get("backup_in_sync") else "copying" if ha.get("backup") else ""
        waiting = ", waiting for a quorum" if ha.get("waiting_for_quorum") else ""
        return (
            f"pair        {ha['group']}: active (configured {ha['configured_role']}), epoch {ha['epoch']}, "
            f"backup {backup} {state}{waiting}"
        ).rstrip()
    if "waiting_for_quorum" in ha:  # the pair's active copy, serving nobody (cut off or isolated)
        return (
            f"pair        {ha['group']}: NOT SERVING (configured {ha['configured_role']}), epoch {ha['epoch']}: "
            f"{ha.get('state', '')}"
        )
    return (
        f"pair        {ha['group']}: backup of {ha.get('primary') or '?'}, epoch {ha['epoch']}, "
        f"{'in sync (can take over)' if ha.get('in_sync') else 'not in sync'}; {ha.get('state', '')}"
    )


def cluster_lines(cluster: dict[str, Any]) -> list[str]:
    """The cluster part of ``tridentmq status``: members, this node's connections, backlog going elsewhere."""
    members = ", ".join(f"{m['name'] or m['node_id'][:8]} ({m['host']}:{m['port']})" for m in cluster["members"])
    lines = [
        (
            f"cluster     {cluster['cluster']}: {len(cluster['members'])} live nodes, policy {cluster['policy']}, "
            f"max-hops {cluster['max_hops']}"
        ),
        f"members     {members}",
    ]
    rows = [
        [c["name"] or c["node_id"][:8] or "?", c["address"], c["state"], c["pending_forward"], c["reason"]]
        for c in cluster["connections"]
    ]
    if rows:
        lines.append(format_table(["to node", "address", "state", "to forward", "reason"], rows))
    if cluster.get("redistributing"):
        moves = [
            f"{q} → {', '.join(n[:8] for n in ([nodes] if isinstance(nodes, str) else nodes))}"
            for q, nodes in cluster["redistributing"].items()
        ]
        lines.append("redistributing " + "; ".join(moves))
    stranded = cluster.get("stranded") or {}
    since = cluster.get("stranded_since") or {}
    now_ms = time.time() * 1000
    lines.append(
        "stranded    "
        + (
            ", ".join(
                f"{q} {n:,}" + (f" for {max(0.0, now_ms - since[q]) / 1000:,.0f} s" if q in since else "")
                for q, n in stranded.items()
            )
            or "none"
        )
    )
    for node, kept in (cluster.get("unreachable") or {}).items():  # down, its durable queues still destinations
        lines.append(
            f"down        {node[:8]}: {kept['pending_forward']:,} messages wait here for its "
            f"{len(kept['queues'])} durable queues ({', '.join(kept['queues'][:5])})"
        )
    nodes = cluster.get("nodes")
    if nodes:
        rows = [
            [
                n["name"],
                n["link"],
                n.get("backup", "-"),
                n.get("backlog", "?"),
                n.get("stranded", "?"),
                n.get("forwarding", "?"),
                n.get("error", ""),
            ]
            for n in nodes
        ]
        lines.append(
            format_table(["node", "link", "in-sync backup", "backlog", "stranded", "to forward", "note"], rows)
        )
    return lines


def cluster_nodes(
    cluster: dict[str, Any], credentials: Credentials = None, *, tls: bool = False, ca_file: str = ""
) -> list[dict[str, Any]]:
    """Every live member's own figures, read from its management API (an unreachable one says why); over
    HTTPS (``tls``, checked against ``ca_file``) when the node asked was: the credentials never go in clear."""
    nodes = []
    for member in cluster["members"]:
        backup = member.get("backup")
        entry: dict[str, Any] = {
            "name": member["name"] or member["node_id"][:8],
            "node_id": member["node_id"],
            "link": f"{member['host']}:{member['port']}",
            "backup": f"{backup[0]}:{backup[1]}" if backup else "-",
        }
        if not member.get("management"):
            entry["error"] = "no management port"
        else:
            try:
                view = fetch(
                    f"{'https' if tls else 'http'}://{member['host']}:{member['management']}",
                    "/api/cluster",
                    timeout=2.0,
                    ca_file=ca_file,
                    credentials=credentials,
                )
            except AdminError as exc:
                entry["error"] = str(exc)
            else:
                entry["backlog"] = sum(n for q, n in view["backlog"].items() if not q.startswith("$sys.cluster."))
                entry["stranded"] = sum(view["stranded"].values())
                entry["forwarding"] = sum(c["pending_forward"] for c in view["connections"])
        nodes.append(entry)
    return nodes


def queue_table(queues: list[dict[str, Any]]) -> str:
    headers = [
        "queue",
        "address",
        "type",
        "depth",
        "consumers",
        "in-flight",
        "added",
        "acked",
        "in/s",
        "ack/s",
    ]
    rows = [
        [
            q["name"],
            q["address"],
            q["routing_type"],
            q["depth"],
            q["consumers"],
            q["in_flight"],
            q["added"],
            q["acked"],
            q.get("enqueue_rate", 0.0),
            q.get("ack_rate", 0.0),
        ]
        for q in queues
    ]
    return format_table(headers, rows) if rows else "no queues"
