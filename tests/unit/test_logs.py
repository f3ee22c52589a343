"""The log formatter: one record per line whatever the fields hold, and bad HTTP requests as one warning."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

from tridentmq_shared.logs import BadHttpRequests, KeyValueFormatter, escape


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as a logged exception has one."""

    def throw() -> None:
        raise exc

    try:
        throw()
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


def record(msg: str, *args: object, exc: BaseException | None = None, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord(
        "tridentmq.test",
        logging.INFO,
        __file__,
        1,
        msg,
        args or None,
        (type(exc), exc, exc.__traceback__) if exc is not None else None,
    )
    made.__dict__.update(extra)
    return made


def test_control_characters_in_the_message_and_the_fields_are_escaped() -> None:
    line = KeyValueFormatter().format(record("hello %s", "a\nb", user="x\r\n\x1b[31mfake\x85\u2028", peer="p"))
    assert "\n" not in line
    assert line.endswith(r"hello a\nb user=x\r\n\x1b[31mfake\x85\u2028 peer=p")


def test_a_field_cannot_end_its_quotes_and_start_a_field_of_its_own() -> None:
    line = KeyValueFormatter().format(record("link opened", user='x" peer="10.0.0.1', client="a=b", empty=""))
    assert line.endswith(r'link opened user="x\" peer=\"10.0.0.1" client="a=b" empty=""')


def test_traceback_lines_are_indented_so_none_can_pass_for_a_record() -> None:
    exc = raised(ValueError("bad\n2026-11-28T00:00:00.000Z INFO forged\x1b"))
    line = KeyValueFormatter().format(record("failed", exc=exc))
    first, *rest = line.splitlines()
    assert first.endswith("INFO tridentmq.test failed")
    assert rest[0] == "  Traceback (most recent call last):"
    assert all(r.startswith("  ") for r in rest)
    assert rest[-2:] == ["  ValueError: bad", r"  2026-11-28T00:00:00.000Z INFO forged\x1b"]


def test_escape_leaves_printable_text_alone() -> None:
    assert escape("plain ünïcode text, 'quotes' = fine") == "plain ünïcode text, 'quotes' = fine"


def test_a_request_aiohttp_cannot_parse_is_one_warning_without_traceback() -> None:
    bad = record("Error handling request from %s", "10.1.2.3", exc=raised(BadHttpMessage("Invalid character")))
    bad.levelno, bad.levelname = logging.ERROR, "ERROR"
    assert BadHttpRequests().filter(bad)
    line = KeyValueFormatter().format(bad)
    assert line.splitlines() == [line]
    assert " WARNING " in line
    assert line.endswith('bad HTTP request refused peer=10.1.2.3 reason="Invalid character"')


def test_other_aiohttp_errors_keep_their_traceback() -> None:
    bug = record("Error handling request from %s", "10.1.2.3", exc=raised(RuntimeError("a bug in a handler")))
    bug.levelno, bug.levelname = logging.ERROR, "ERROR"
    assert BadHttpRequests().filter(bug)
    assert bug.levelname == "ERROR"
    assert bug.exc_info is not None
