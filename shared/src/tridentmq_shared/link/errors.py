"""Exceptions of the link: the codec's (``LinkError``) and the client's (``LinkRequestError``)."""

from __future__ import annotations


class LinkError(Exception):
    """Base class: ``code`` is one of ``ErrorCode`` and ``text`` says what was wrong."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


class RemoteProtocolError(LinkError):
    """The peer broke the protocol; the codec has queued a CLOSE naming the problem and is closed."""


class LocalProtocolError(LinkError):
    """This side used the codec in a way the protocol forbids (a bug in the caller)."""


class LinkRequestError(Exception):
    """The server refused a request or a publish; ``code`` is an ``ErrorCode``."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


class LinkClosedError(LinkRequestError):
    """The link is closed (by us, or by the server and reconnecting is off or exhausted)."""


class SharedLinksRefusedError(Exception):
    """The core does not let the gateway's own user open a shared link: a session connects on its own."""
