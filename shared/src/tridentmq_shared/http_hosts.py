"""The Host check of every HTTP port (core management, gateway health and metrics) against DNS rebinding.

A web page can make a visitor's browser send requests to a loopback port by giving its own host name the
address 127.0.0.1: the browser then treats the answer as the page's own and lets it read it. Such a request
still carries the page's host name in its ``Host`` header. Answering only requests whose ``Host`` is a
loopback name, an IP address the server was reached at, or a name the operator configured defeats it.
A request without ``Host`` (HTTP/1.0 tools) is let through: a browser always sends one.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Middleware

log = logging.getLogger("tridentmq.http")

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
ANY_HOST = "*"  # in the allow-list: no Host check at all
WILDCARD_INTERFACES = frozenset({"", "0.0.0.0", "::"})  # "every interface": not a name

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_name(header: str) -> str | None:
    """The host part of a ``Host`` header, lowercased and without a trailing dot: ``Core.:80`` → ``core``,
    ``[::1]:8161`` → ``::1``; None when the header is not a host with an optional port."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal
        end = header.find("]")
        if end < 0 or (header[end + 1 :] and not _is_port(header[end + 1 :])):
            return None
        return header[1:end] or None
    name, colon, port = header.rpartition(":")
    if not colon:
        name = header
    elif not _is_port(":" + port):
        return None
    name = name.rstrip(".")
    return name if name and name.isascii() and all(c.isalnum() or c in "-._" for c in name) else None


def _is_port(text: str) -> bool:
    return len(text) > 1 and text[0] == ":" and text[1:].isascii() and text[1:].isdigit()


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.split("%", maxsplit=1)[0])
    except ValueError:
        return None


class HostCheck:
    """Which ``Host`` values a server answers: loopback names and addresses, the address a request came in on,
    and ``names`` (the configured ones, the listener's own host, …; ``*`` allows any)."""

    def __init__(self, names: Iterable[str]) -> None:
        wanted = {n.strip().lower().rstrip(".") for n in names if n.strip()}
        self.any = ANY_HOST in wanted
        self.names = frozenset((wanted - WILDCARD_INTERFACES - {ANY_HOST}) | LOOPBACK_NAMES)

    def allows(self, header: str | None, local_address: str | None) -> bool:
        if self.any or header is None:
            return True
        name = host_name(header)
        if name is None:
            return False
        if name in self.names:
            return True
        ip = _ip(name)
        if ip is None:
            return False
        return ip.is_loopback or (local_address is not None and ip == _ip(local_address))


def host_check_middleware(check: HostCheck, what: str) -> Middleware:
    """An aiohttp middleware answering 421 (Misdirected Request) to a request whose ``Host`` ``check`` refuses;
    ``what`` names the setting that adds host names, for the answer and the log line."""

    @web.middleware
    async def host_check(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Host")
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        local = sockname[0] if isinstance(sockname, tuple) and sockname else None
        if check.allows(header, local):
            return await handler(request)
        shown = ascii(header)  # the client's bytes, control characters escaped, for the log and the answer
        log.warning(
            "HTTP request refused: Host not allowed",
            extra={"host": shown, "peer": request.remote, "path": ascii(request.path)},
        )
        return web.json_response({"error": f"host {shown} is not allowed here (add it to {what})"}, status=421)

    return host_check
