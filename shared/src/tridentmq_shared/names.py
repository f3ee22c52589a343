"""What every address and queue name a client gives must be, whatever door it comes in by (pure).

The core checks the names of a link's requests and publishes; each gateway checks the names it maps its
protocol's destinations to before they reach the core, so that a client gets its own protocol's refusal
(a STOMP ERROR, an AMQP link refused with ``amqp:invalid-field``, an MQTT reason code) for a name the core
would refuse, rather than one the core makes of it. Names persisted before these rules (a longer queue
name in a journal) are still served: only new ones are checked.
"""

from __future__ import annotations

import re
from typing import Final

#: The longest address or queue name, in characters.
MAX_NAME_LENGTH: Final = 255
#: The most ``.``-separated words of an address.
MAX_ADDRESS_WORDS: Final = 32

# C0, DEL and C1: none of them is printable; NUL ends C strings, others break logs and line-based framing.
_CONTROL_CHARS: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def name_problem(name: str, kind: str = "address") -> str | None:
    """What is wrong with ``name``, an address or queue name (``kind`` says which, for the text), or None: it is
    empty, longer than ``MAX_NAME_LENGTH`` characters, or holds a control character."""
    if name and len(name) <= MAX_NAME_LENGTH and name.isprintable():  # the usual case, checked in C
        return None
    if not name:
        return f"{kind} must not be empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"{kind} is {len(name)} characters long, the limit is {MAX_NAME_LENGTH}: {name[:40]!r}..."
    bad = _CONTROL_CHARS.search(name)
    if bad is not None:
        return f"{kind} {name!r} contains control character {bad.group()!r} at position {bad.start()}"
    return None
