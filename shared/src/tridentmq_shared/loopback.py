"""Whether a peer's address is this host's own: the clients the embedded default trusts, and the ones a web page in
a browser on this host speaks for."""

from __future__ import annotations

import functools
import ipaddress


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str | None) -> bool:
    """Parsed once per address: every session of a gateway's shared link asks for the same two."""
    if host is None:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack listener
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
