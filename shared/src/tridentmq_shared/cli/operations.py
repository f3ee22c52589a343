"""The management operations from the shell: ``tridentmq queue|address|connection|client|mqtt|node ...``.

Each command is one call of the management API (docs/management.md lists them side by side); any node of a
cluster answers for all of them, and ``--node`` limits a command to one node.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

from tridentmq_shared.cli import admin

ManagementArgs = Callable[[argparse.ArgumentParser], None]


def _op(sub: Any, name: str, text: str, management_args: ManagementArgs) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
    management_args(parser)
    parser.add_argument("--node", help="run it on this node only (node id, id prefix or name)")
    return parser


def add_queue_commands(queue_sub: Any, management_args: ManagementArgs) -> None:
    create = _op(queue_sub, "create", "create a queue (on every node of a cluster)", management_args)
    create.add_argument("name")
    create.add_argument("--address", help="its address (default: the queue's name)")
    create.add_argument("--multicast", action="store_true", help="a multicast queue (a subscription)")
    create.add_argument("--non-durable", action="store_true", help="not kept across restarts")
    create.add_argument("--filter", help="only messages this selector matches enter it")
    create.add_argument("--exclusive", action="store_true", help="one consumer at a time gets its messages")
    create.add_argument("--last-value-key", help="a last-value queue keyed by this property")
    create.add_argument("--max-consumers", type=int, default=-1)
    delete = _op(queue_sub, "delete", "delete a queue and its messages", management_args)
    delete.add_argument("name")
    purge = _op(
        queue_sub,
        "purge",
        "drop a queue's queued, scheduled and delayed messages (not those in flight)",
        management_args,
    )
    purge.add_argument("name")
    purge.add_argument("--selector", help="only the messages this selector matches")
    browse = _op(queue_sub, "browse", "show a queue's messages: headers, properties, body preview", management_args)
    browse.add_argument("name")
    browse.add_argument("--offset", type=int, default=0)
    browse.add_argument("--limit", type=int, default=20)
    browse.add_argument("--selector")
    browse.add_argument("--preview", type=int, default=60, help="body bytes shown (default %(default)s)")
    for verb, text in (
        ("move", "move messages to another queue, or each back where it was dead-lettered from"),
        ("copy", "copy messages to another queue (or each to where it came from)"),
    ):
        parser = _op(queue_sub, verb, text, management_args)
        parser.add_argument("name")
        parser.add_argument("--to", help="the target queue (default: each message's original queue)")
        parser.add_argument("--selector", help="only the messages this selector matches")
        parser.add_argument("--limit", type=int, default=-1, help="at most this many per node (default all)")
        parser.add_argument(
            "--message-id",
            type=int,
            action="append",
            dest="message_ids",
            help="only this message (repeatable; needs --node)",
        )
    for verb in ("pause", "resume"):
        text = (
            "pause deliveries from a queue (it still takes messages in)"
            if verb == "pause"
            else "deliver from a paused queue again"
        )
        parser = _op(queue_sub, verb, text, management_args)
        parser.add_argument("name")


def add_commands(sub: Any, management_args: ManagementArgs) -> None:
    """The command groups besides ``queue``."""
    address = sub.add_parser("address", help="address commands: pause | resume | settings | set")
    address_sub = address.add_subparsers(dest="address_command", required=True, metavar="SUBCOMMAND")
    for verb in ("pause", "resume"):
        parser = _op(address_sub, verb, f"{verb} deliveries from every queue of an address", management_args)
        parser.add_argument("name")
    settings = _op(address_sub, "settings", "show the address settings (and what applies to ADDRESS)", management_args)
    settings.add_argument("name", nargs="?", metavar="ADDRESS")
    change = _op(
        address_sub, "set", "replace the address settings entry for MATCH at run time (not saved)", management_args
    )
    change.add_argument("match")
    change.add_argument("values", nargs="+", metavar="KEY=VALUE", help="a setting (JSON value, else a string)")

    connection = sub.add_parser("connection", help="link connections: list | close")
    connection_sub = connection.add_subparsers(dest="connection_command", required=True, metavar="SUBCOMMAND")
    _op(connection_sub, "list", "open link connections of the node asked", management_args)
    close = _op(connection_sub, "close", "close one link connection", management_args)
    close.add_argument("conn_id")

    client = sub.add_parser("client", help="clients: close")
    client_sub = client.add_subparsers(dest="client_command", required=True, metavar="SUBCOMMAND")
    close = _op(
        client_sub,
        "close",
        "close every link of a client: its connection id, client name, MQTT client "
        "id or a gateway client's host:port (the client is told and does not come back by itself)",
        management_args,
    )
    close.add_argument("client")

    mqtt = sub.add_parser("mqtt", help="MQTT state: sessions | session-delete | retained | retained-delete")
    mqtt_sub = mqtt.add_subparsers(dest="mqtt_command", required=True, metavar="SUBCOMMAND")
    _op(mqtt_sub, "sessions", "list MQTT sessions", management_args)
    delete = _op(
        mqtt_sub,
        "session-delete",
        "delete a client's MQTT session (a connected client is disconnected)",
        management_args,
    )
    delete.add_argument("client_id")
    retained = _op(mqtt_sub, "retained", "list retained messages", management_args)
    retained.add_argument("--prefix", default="", help="only topics starting with this")
    retained.add_argument("--limit", type=int, default=100)
    delete = _op(mqtt_sub, "retained-delete", "clear a topic's retained message", management_args)
    delete.add_argument("topic")

    node = sub.add_parser("node", help="node commands: failback | scale-down | forget")
    node_sub = node.add_subparsers(dest="node_command", required=True, metavar="SUBCOMMAND")
    _op(node_sub, "failback", "hand a replication pair back to its primary now (on its active backup)", management_args)
    _op(node_sub, "scale-down", "move every message of a node to the others, then stop it", management_args)
    forget = _op(
        node_sub,
        "forget",
        "drop a departed node that never comes back (its messages waiting on the "
        "others go to the remaining queues or the dead-letter address)",
        management_args,
    )
    forget.add_argument("node_id", help="the full node id of the departed node")


def _call(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    query: dict[str, Any] | None = None,
) -> Any:
    params = {k: v for k, v in (query or {}).items() if v is not None}
    if getattr(args, "node", None):
        params["node"] = args.node
    if params:
        path += "?" + urlencode(params)
    credentials = (args.user, args.password or "") if args.user else None
    return admin.send(args.management, method, path, body, timeout=30.0, ca_file=args.ca_file, credentials=credentials)


def _summary(answer: dict[str, Any]) -> str:
    counts = ", ".join(f"{k} {v}" for k, v in answer.items() if isinstance(v, int) and not isinstance(v, bool))
    lines = [counts or "done"]
    lines += [
        f"  {node.get('name') or node['node_id'][:8]}: {node.get('status')} {node.get('error')}"
        for node in answer.get("nodes", [])
        if node.get("status") != 200
    ]
    return "\n".join(lines)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _queue(args: argparse.Namespace) -> Any:
    name = args.name
    match args.queue_command:
        case "create":
            body = {
                "name": name,
                "address": args.address,
                "routing_type": "multicast" if args.multicast else "anycast",
                "durable": not args.non_durable,
                "filter": args.filter,
                "exclusive": args.exclusive,
                "last_value_key": args.last_value_key,
                "max_consumers": args.max_consumers,
            }
            return _call(args, "POST", "/api/queues", {k: v for k, v in body.items() if v is not None})
        case "delete":
            return _call(args, "DELETE", "/api/queues/" + quote(name, safe=""))
        case "purge":
            return _call(args, "POST", "/api/purge", {"queue": name, "selector": args.selector})
        case "browse":
            query = {
                "queue": name,
                "offset": args.offset,
                "limit": args.limit,
                "selector": args.selector,
                "preview": args.preview,
            }
            return _call(args, "GET", "/api/messages", query=query)
        case "move" | "copy":
            body = {
                "queue": name,
                "to": args.to,
                "selector": args.selector,
                "limit": args.limit,
                "message_ids": args.message_ids,
            }
            return _call(args, "POST", f"/api/{args.queue_command}", {k: v for k, v in body.items() if v is not None})
        case "pause" | "resume":
            return _call(args, "POST", f"/api/{args.queue_command}", {"queue": name})
    raise AssertionError(args.queue_command)


def _browse_text(answer: dict[str, Any]) -> str:
    rows = [
        [
            m.get("node", ""),
            m["message_id"],
            m["state"],
            m["delivery_count"],
            m["priority"],
            m["size"],
            ", ".join(f"{k}={v}" for k, v in m["properties"].items())[:40],
            m["body"].replace("\n", " ")[:60],
        ]
        for m in answer["messages"]
    ]
    table = admin.format_table(["node", "id", "state", "count", "prio", "size", "properties", "body"], rows)
    return f"{answer['total']} message(s)\n" + (table if rows else "")


def run(args: argparse.Namespace) -> int:
    """Run one operation command and print its answer (JSON with ``--json``)."""
    command = args.command
    text: Callable[[Any], str] = _summary
    match command:
        case "queue":
            answer = _queue(args)
            if args.queue_command == "browse":
                text = _browse_text
        case "address":
            sub = args.address_command
            if sub in ("pause", "resume"):
                answer = _call(args, "POST", f"/api/{sub}", {"address": args.name})
            elif sub == "settings":
                answer = _call(args, "GET", "/api/address-settings", query={"address": args.name})
                text = lambda a: json.dumps(a, indent=2)  # noqa: E731
            else:
                values = {}
                for item in args.values:
                    key, sep, value = item.partition("=")
                    if not sep:
                        raise SystemExit(f"tridentmq: settings are KEY=VALUE, got {item!r}")
                    values[key] = _value(value)
                answer = _call(args, "PUT", "/api/address-settings", {"match": args.match, "settings": values})
        case "connection":
            if args.connection_command == "list":
                answer = _call(args, "GET", "/api/connections")
                text = lambda a: admin.format_table(  # noqa: E731
                    ["conn id", "peer", "client", "user", "consumers"],
                    [[c["conn_id"], c["peer"], c["client_name"], c["user"], c["consumers"]] for c in a],
                )
            else:
                answer = _call(args, "DELETE", "/api/connections/" + quote(args.conn_id, safe=""))
        case "client":
            answer = _call(args, "DELETE", "/api/clients/" + quote(args.client, safe=""))
        case "mqtt":
            answer, text = _mqtt(args)
        case "node":
            if args.node_command == "forget":
                answer = _call(args, "POST", f"/api/cluster/nodes/{quote(args.node_id, safe='')}/forget", {})
            else:
                path = "/api/failback" if args.node_command == "failback" else "/api/scale-down"
                answer = _call(args, "POST", path, {})
        case _:
            raise AssertionError(command)
    print(json.dumps(answer, indent=2) if args.json else text(answer))
    return 0


def _mqtt(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str]]:
    match args.mqtt_command:
        case "sessions":

            def sessions(answer: Any) -> str:
                rows = [
                    [
                        s["client_id"] or s["label"],
                        s.get("user") or "",
                        "yes" if s["connected"] else "no",
                        "yes" if s["persistent"] else "no",
                        s["queued"],
                        ", ".join(s["subscriptions"])[:60],
                    ]
                    for s in answer["sessions"]
                ]
                return (
                    admin.format_table(["client", "user", "connected", "persistent", "queued", "subscriptions"], rows)
                    if rows
                    else "no MQTT sessions"
                )

            return _call(args, "GET", "/api/mqtt/sessions"), sessions
        case "session-delete":
            return _call(args, "DELETE", "/api/mqtt/sessions/" + quote(args.client_id, safe="")), _summary
        case "retained":

            def retained(answer: Any) -> str:
                rows = [[r["topic"], r["size"], r["body"][:60]] for r in answer["retained"]]
                return f"{answer['total']} retained message(s)\n" + admin.format_table(["topic", "size", "body"], rows)

            return _call(
                args, "GET", "/api/mqtt/retained", query={"prefix": args.prefix, "limit": args.limit}
            ), retained
        case "retained-delete":
            return _call(args, "DELETE", "/api/mqtt/retained/" + quote(args.topic, safe="")), _summary
    raise AssertionError(args.mqtt_command)
