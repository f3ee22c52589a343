"""``tridentmq``: start TridentMQ, inspect it, and move messages through it from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tridentmq_shared.cli import admin, operations, perf, supervisor
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.message import RoutingType, new_message
from tridentmq_shared.names import name_problem
from tridentmq_shared.runtime import run_main
from tridentmq_shared.tls import ClientTls, TlsSection

DEFAULT_MANAGEMENT = "http://127.0.0.1:8161"


def _at_least(low: int) -> Any:
    """An argparse type: an integer of ``low`` or more (else a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        return value

    return parse


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    port = _at_least(1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return int(port)


def _positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return value


def _name(kind: str) -> Any:
    """An argparse type: an address or queue name the core takes (else a usage error, exit 2)."""

    def parse(text: str) -> str:
        problem = name_problem(text, kind)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return text

    return parse


def _link_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="core node host (default %(default)s)")
    parser.add_argument("--port", type=_port, default=61616, help="core link port (default %(default)s)")
    _user_args(parser)
    parser.add_argument("--tls", action="store_true", help="connect over TLS (a core with link.tls)")
    _tls_file_args(parser)
    parser.add_argument("--cert-file", default="", help="PEM client certificate, for a core asking for one")
    parser.add_argument("--key-file", default="", help="PEM key of the client certificate (default: in --cert-file)")


def _management_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--management", default=DEFAULT_MANAGEMENT, help="management URL (%(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    _user_args(parser)
    _tls_file_args(parser)


def _user_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--user", default=os.environ.get("TRIDENTMQ_USER"), help="user (env TRIDENTMQ_USER)")
    parser.add_argument(
        "--password", default=os.environ.get("TRIDENTMQ_PASSWORD"), help="password (env TRIDENTMQ_PASSWORD)"
    )


def _tls_file_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca-file",
        default="",
        help="PEM authorities to check the server's certificate against (default: the system's)",
    )


def _link_tls(args: argparse.Namespace) -> TlsSection | None:
    if not args.tls:
        return None
    return TlsSection(cert_file=args.cert_file, key_file=args.key_file, ca_file=args.ca_file)


def _client_tls(args: argparse.Namespace) -> ClientTls | None:
    tls = _link_tls(args)
    return ClientTls(tls) if tls is not None else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tridentmq", description="TridentMQ message broker.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run a core node and every installed gateway (Ctrl-C stops all)")
    up.add_argument("--data-dir", type=Path, default=Path("data"), help="data directory (default %(default)s)")
    up.add_argument("--config", type=Path, help="the core's TOML settings file")
    up.add_argument(
        "--config-dir",
        type=Path,
        help="a directory of settings files, one per process: core.toml, "
        "stomp.toml, mqtt.toml, amqp.toml (each optional)",
    )
    up.add_argument(
        "--nodes",
        type=_at_least(1),
        default=1,
        help="core nodes: above 1, a local cluster on link ports "
        "61616, 61617, ... and management ports 8161, 8162, ... (default %(default)s)",
    )
    up.add_argument(
        "--discovery",
        default="",
        help="with --nodes, find each other through this Redis URL (redis://host:port/db) instead of static connectors",
    )
    up.add_argument(
        "--pairs",
        type=_at_least(0),
        default=0,
        help="a local cluster of this many primary/backup replication "
        "pairs: primaries on link ports 61616, ..., their backups after them (3 or more, so that a "
        "quorum can let a backup take over)",
    )

    core = sub.add_parser("core", help="run one core node in the foreground")
    core.add_argument("args", nargs=argparse.REMAINDER, help="arguments for tridentmq-core (see --help)")
    data = sub.add_parser("data", help="check, print or compact a stopped node's journal: verify | print | compact")
    data.add_argument("args", nargs=argparse.REMAINDER, help="verify|print|compact [--data-dir DIR] [--journal DIR]")

    audit = sub.add_parser("audit", help="analyse the audit stream with Spark: report | trace | stream")
    audit.add_argument("args", nargs=argparse.REMAINDER, help="report|trace|stream ... (see tridentmq audit --help)")

    for name, text in (("status", "show a core node's state"),):
        _management_args(sub.add_parser(name, help=text))

    queue = sub.add_parser("queue", help="queue commands")
    queue_sub = queue.add_subparsers(dest="queue_command", required=True, metavar="SUBCOMMAND")
    _management_args(queue_sub.add_parser("stat", help="table of queues: depth, consumers, in-flight, rates"))
    operations.add_queue_commands(queue_sub, _management_args)
    operations.add_commands(sub, _management_args)

    produce = sub.add_parser("produce", help="publish messages and wait for their confirms")
    produce.add_argument("address", type=_name("address"))
    produce.add_argument("--count", type=_at_least(0), default=1)
    produce.add_argument("--body", default="message {n}", help="body; {n} is the message number")
    produce.add_argument("--durable", action="store_true")
    produce.add_argument("--multicast", action="store_true", help="publish to multicast queues (a topic)")
    produce.add_argument("--property", action="append", default=[], metavar="KEY=VALUE")
    _link_args(produce)

    consume = sub.add_parser("consume", help="receive and acknowledge messages from a queue")
    consume.add_argument("queue", type=_name("queue"))
    consume.add_argument("--count", type=_at_least(0), default=1)
    consume.add_argument("--timeout", type=_positive_seconds, default=10.0, help="seconds to wait for each message")
    consume.add_argument("--selector", help="SQL-92 selector on message properties")
    consume.add_argument("--multicast", action="store_true", help="subscribe a multicast queue to the address")
    consume.add_argument("--quiet", action="store_true", help="do not print message bodies")
    _link_args(consume)

    bench = sub.add_parser("perf", help="link benchmark: one producer and one consumer process")
    bench.add_argument("--count", type=_at_least(1), default=500_000)
    bench.add_argument("--size", type=_at_least(0), default=100, help="body bytes (default %(default)s)")
    bench.add_argument("--durable", action="store_true")
    bench.add_argument("--rate", type=_at_least(0), default=0, help="paced msgs/s for a latency run (0 = flat out)")
    bench.add_argument("--window", type=_at_least(1), default=10_000, help="consumer credit (default %(default)s)")
    bench.add_argument("--json", action="store_true")
    _link_args(bench)
    return parser


async def _produce(args: argparse.Namespace) -> int:
    properties: dict[str, Any] = {}
    for item in args.property:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"tridentmq: --property takes KEY=VALUE, got {item!r}")
        properties[key] = value
    routing = RoutingType.MULTICAST if args.multicast else RoutingType.ANYCAST
    async with LinkClient(
        args.host,
        args.port,
        user=args.user,
        password=args.password,
        client_name="tridentmq-produce",
        tls=_client_tls(args),
    ) as client:
        messages = (
            new_message(
                args.address,
                args.body.replace("{n}", str(n)).encode(),
                routing=routing,
                durable=args.durable,
                properties=properties,
                protocol="link",
            )
            for n in range(1, args.count + 1)
        )
        await asyncio.gather(*await client.publish_batch(messages))
    print(f"{args.count} message(s) confirmed on {args.address}")
    return 0


async def _consume(args: argparse.Namespace) -> int:
    async with LinkClient(
        args.host,
        args.port,
        user=args.user,
        password=args.password,
        client_name="tridentmq-consume",
        tls=_client_tls(args),
    ) as client:
        options: dict[str, Any] = {}
        queue = args.queue
        if args.multicast:
            address, queue = args.queue, f"{args.queue}.consume-{os.getpid()}"
            await client.create_queue(queue, address, routing_type=RoutingType.MULTICAST, durable=False, temporary=True)
        consumer = await client.subscribe(
            queue, credit=min(max(args.count, 1), 1000), selector=args.selector, **options
        )
        received = 0
        while received < args.count:
            delivery = await consumer.get(timeout=args.timeout)
            if delivery is None:
                break
            consumer.ack(delivery)
            received += 1
            if not args.quiet:
                print(delivery.body.decode(errors="replace"))
        await consumer.close()
    if received < args.count:
        print(f"tridentmq: received {received} of {args.count} message(s) from {args.queue}", file=sys.stderr)
        return 1
    print(f"{received} message(s) received from {args.queue}", file=sys.stderr)
    return 0


def _perf(args: argparse.Namespace) -> int:
    opts = perf.PerfOptions(
        args.host,
        args.port,
        args.user,
        args.password,
        args.count,
        args.size,
        args.durable,
        args.rate,
        args.window,
        tls=_link_tls(args),
    )
    result = perf.run_once(opts)
    print(json.dumps(result) if args.json else perf.describe(result, opts))
    return 0 if result["received"] == args.count else 1


def _credentials(args: argparse.Namespace) -> admin.Credentials:
    """HTTP Basic credentials for the management API: given when a user is (a node without users needs none)."""
    return (args.user, args.password or "") if args.user else None


def run(args: argparse.Namespace) -> int:
    match args.command:
        case "up":
            children = supervisor.plan(
                args.data_dir,
                args.config,
                args.config_dir,
                nodes=args.nodes,
                discovery=args.discovery,
                pairs=args.pairs,
            )
            for unused in supervisor.unused_node_data(args.data_dir, children):
                print(
                    f"tridentmq up: {unused} holds a node's data that this topology does not use (made with "
                    "another --nodes or --pairs): its messages stay there, out of reach; start up as before to "
                    "serve them (see docs/management.md)",
                    file=sys.stderr,
                )
            return run_main(supervisor.supervise(children))
        case "status":
            status = admin.fetch(args.management, "/api/status", ca_file=args.ca_file, credentials=_credentials(args))
            if status.get("cluster"):
                status["cluster"]["nodes"] = admin.cluster_nodes(
                    status["cluster"],
                    _credentials(args),
                    tls=args.management.startswith("https:"),
                    ca_file=args.ca_file,
                )
            print(json.dumps(status, indent=2) if args.json else admin.status_text(status))
            return 0
        case "queue" if args.queue_command == "stat":
            queues = admin.fetch(args.management, "/api/queues", ca_file=args.ca_file, credentials=_credentials(args))
            print(json.dumps(queues, indent=2) if args.json else admin.queue_table(queues))
            return 0
        case "queue" | "address" | "connection" | "client" | "mqtt" | "node":
            return operations.run(args)
        case "produce":
            return run_main(_produce(args))
        case "consume":
            return run_main(_consume(args))
        case "perf":
            return _perf(args)
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # `core` and `data` belong to the core package (not importable from here): hand every argument over.
    if argv[:1] == ["core"]:
        os.execv(sys.executable, [sys.executable, "-m", "tridentmq_core", *argv[1:]])  # noqa: S606
    if argv[:1] == ["data"]:
        os.execv(sys.executable, [sys.executable, "-m", "tridentmq_core.data_tools", *argv[1:]])  # noqa: S606
    # `audit` runs the Spark jobs (the optional `spark` dependency group), in their own interpreter so that
    # nothing here imports pyspark.
    if argv[:1] == ["audit"]:
        os.execv(sys.executable, [sys.executable, "-m", "tridentmq_spark", *argv[1:]])  # noqa: S606
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except admin.AdminError as exc:
        sys.exit(f"tridentmq: {exc}")
    except LinkRequestError as exc:
        sys.exit(f"tridentmq: {exc.text} ({exc.code})")
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
