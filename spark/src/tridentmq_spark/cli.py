"""Command line of the audit jobs: ``python -m tridentmq_spark report|trace|stream`` (and ``tridentmq audit``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tridentmq_spark.options import StreamOptions
from tridentmq_spark.restarts import RESTART_WINDOW_S

__all__ = ["add_commands", "main", "run"]


def add_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="audit_command", required=True, metavar="SUBCOMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--audit-dir",
        type=Path,
        default=Path("data/core/audit"),
        help="folder holding one sub-folder per node (default %(default)s)",
    )
    common.add_argument("--master", default=None, help="Spark master URL (default: local[2], or spark-submit's)")
    report = sub.add_parser("report", parents=[common], help="batch report: Parquet tables and report.html")
    report.add_argument("--out", type=Path, required=True, help="output folder")
    report.add_argument("--bucket-seconds", type=int, default=0, help="time bucket of the charts (default: auto)")
    tr = sub.add_parser("trace", parents=[common], help="every event of one message across all nodes")
    tr.add_argument("message_id")
    stream = sub.add_parser("stream", parents=[common], help="continuous windowed rates, latencies and alerts")
    stream.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (restart resumes here)")
    stream.add_argument("--out", type=Path, help="Parquet output folder (default: print to the console)")
    stream.add_argument(
        "--window-seconds", type=int, default=StreamOptions.window_seconds, help="window of rates and latencies"
    )
    stream.add_argument(
        "--watermark-seconds", type=int, default=StreamOptions.watermark_seconds, help="how late an event may arrive"
    )
    stream.add_argument(
        "--stranded-seconds",
        type=int,
        default=StreamOptions.stranded_seconds,
        help="alert when a queue has messages and no consumer for this long",
    )
    stream.add_argument(
        "--dead-letter-spike",
        type=int,
        default=StreamOptions.dead_letter_spike,
        help="alert when a window has this many dead letters on one address",
    )
    stream.add_argument(
        "--trigger-seconds", type=float, default=StreamOptions.trigger_seconds, help="micro-batch interval"
    )
    stream.add_argument("--once", action="store_true", help="process what is sealed now, then stop")
    stream.add_argument(
        "--alerts-to",
        metavar="tmq://HOST:PORT/ADDRESS",
        help="also publish each alert as a durable JSON message to this address of a core node (link port)",
    )
    stream.add_argument(
        "--max-restarts",
        type=int,
        default=StreamOptions.max_restarts,
        help=f"restart a failed query from its checkpoint up to this many times in {RESTART_WINDOW_S // 60} minutes"
        " (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    if args.audit_command != "stream" and not args.audit_dir.is_dir():  # (a stream may start before its nodes)
        print(f"no audit directory {args.audit_dir} (see --audit-dir)", file=sys.stderr)
        return 2
    from tridentmq_spark.session import get_session  # noqa: PLC0415  (pyspark loads only when a job runs)

    spark = get_session(args.master)
    spark.sparkContext.setLogLevel("WARN")
    if args.audit_command == "report":
        from tridentmq_spark.report import build_report  # noqa: PLC0415

        result = build_report(spark, args.audit_dir, args.out, bucket_seconds=args.bucket_seconds)
        print(f"{result.events} events, {result.bad_records} bad records")
        for name, rows in result.tables.items():
            print(f"  {name}: {rows} rows")
        print(f"report: {result.html_path}")
        return 0
    if args.audit_command == "trace":
        from tridentmq_spark.trace import format_trace, trace  # noqa: PLC0415

        found = trace(spark, args.audit_dir, args.message_id)
        if not found:
            print(f"no events for message {args.message_id}", file=sys.stderr)
            return 1
        print(format_trace(found))
        return 0
    from tridentmq_spark.stream import run_stream  # noqa: PLC0415

    run_stream(spark, StreamOptions.from_args(args))
    return 0


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m tridentmq_spark", description="TridentMQ audit analytics.")
    add_commands(parser)
    sys.exit(run(parser.parse_args(argv)))
