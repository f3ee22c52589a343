"""TLS for every listener and every link client: one settings section and the ``ssl.SSLContext`` built from it.

Each process has one ``[tls]`` section (certificate, key, CA, client-certificate mode, lowest version). A
listener serves with ``ServerTls.context``; an outgoing link (gateway → core, core → core, the CLI) connects
with ``ClientTls.context()``. Both re-read their files when one changes (its modification time, size or
inode), so a renewed certificate is taken without a restart: the server checks at every handshake, before
choosing the certificate it presents (a TLS server-name callback swaps in the context built from the new
files), so the first connection after the files were replaced already gets the new certificate. A file that
cannot be read or does not match its key leaves the previous context in use, with one WARNING.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

from tridentmq_shared.settings import SettingsError, doc

log = logging.getLogger("tridentmq.tls")

#: A server's TLS handshake must end within this (asyncio waits 60 s by default): connections that send a
#: ClientHello and nothing more are closed then, like a plain connection that does not log in in time.
HANDSHAKE_TIMEOUT_S = 10.0

CLIENT_CERT_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}


@dataclass(frozen=True)
class TlsSection:
    """Certificates of this process, for its TLS listeners and the TLS links it opens."""

    cert_file: str = doc(
        "",
        "PEM certificate (chain) this process presents: on its TLS listeners, and as its "
        "client certificate on the TLS links it opens. Empty: no TLS listener can be "
        "enabled. Re-read when the file changes: new connections get the new "
        "certificate, open ones keep theirs.",
    )
    key_file: str = doc("", "PEM private key of that certificate (empty: it is in `cert_file`).")
    ca_file: str = doc(
        "",
        "PEM bundle of the certificate authorities trusted to sign peers' certificates: "
        "clients' certificates on the listeners, the server's on outgoing TLS links (empty: "
        "the system's authorities for outgoing links; client certificates cannot be "
        "checked).",
    )
    client_certs: str = doc(
        "none",
        "Client certificates on the TLS listeners (mutual TLS): `none` (not asked "
        "for), `optional` (checked against `ca_file` when a client sends one) or "
        "`required` (a client without a valid one is refused in the "
        "handshake).",
    )
    min_version: str = doc(
        "TLSv1.2", "Oldest TLS version accepted, on listeners and outgoing links: `TLSv1.2` or `TLSv1.3`."
    )
    verify_hostname: bool = doc(
        True,
        "Outgoing TLS links check that the server's certificate names the host "
        "connected to (its DNS name or IP address).",
    )

    @property
    def configured(self) -> bool:
        return bool(self.cert_file)

    def check(self, section: str = "tls") -> None:
        """SettingsError for a value the loader cannot check by type."""
        if self.client_certs not in CLIENT_CERT_MODES:
            raise SettingsError(
                f"{section}.client_certs: expected none, optional or required, got {self.client_certs!r}"
            )
        if self.min_version not in VERSIONS:
            raise SettingsError(f"{section}.min_version: expected TLSv1.2 or TLSv1.3, got {self.min_version!r}")
        if self.client_certs != "none" and not self.ca_file:
            raise SettingsError(
                f"{section}.client_certs = {self.client_certs}: set {section}.ca_file to the "
                f"authorities that sign client certificates"
            )


class _Files:
    """The files a context is built from, and whether they changed since it was built."""

    def __init__(self, *paths: str) -> None:
        self.paths = tuple(p for p in dict.fromkeys(paths) if p)
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append((-1, -1, -1))
            else:
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def changed(self) -> bool:
        stamp = self._stamp()
        if stamp == self.stamp:
            return False
        self.stamp = stamp
        return True


def _base_context(purpose: int, settings: TlsSection) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = VERSIONS[settings.min_version]
    context.options |= ssl.OP_NO_COMPRESSION
    return context


def _build_server(settings: TlsSection) -> ssl.SSLContext:
    context = _base_context(ssl.PROTOCOL_TLS_SERVER, settings)
    context.load_cert_chain(settings.cert_file, settings.key_file or None)
    if settings.ca_file:
        context.load_verify_locations(settings.ca_file)
    context.verify_mode = CLIENT_CERT_MODES[settings.client_certs]
    return context


def _build_client(settings: TlsSection) -> ssl.SSLContext:
    context = _base_context(ssl.PROTOCOL_TLS_CLIENT, settings)
    context.check_hostname = settings.verify_hostname
    if settings.ca_file:
        context.load_verify_locations(settings.ca_file)
    else:
        context.load_default_certs()
    if settings.cert_file:
        context.load_cert_chain(settings.cert_file, settings.key_file or None)
    return context


class ServerTls:
    """The context of a process's TLS listeners. ``context`` is given to every listener once; each
    handshake then runs on the context built from the files as they are now."""

    def __init__(self, settings: TlsSection, section: str = "tls") -> None:
        settings.check(section)
        if not settings.configured:
            raise SettingsError(f"a TLS listener is enabled but {section}.cert_file is empty")
        self.settings = settings
        self._files = _Files(settings.cert_file, settings.key_file, settings.ca_file)
        try:
            self._current = _build_server(settings)
            # The listeners' context: its verify mode and versions are those of every handshake (OpenSSL
            # copies them when a connection starts); its certificate and authorities are replaced by the
            # current context's in the server-name callback, which runs for every handshake.
            self.context = _build_server(settings)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(f"{section}: cannot load the certificate: {exc}") from None
        self.context.sni_callback = self._select
        self.reloads = 0

    def refresh(self) -> None:
        """Build the context again if a file changed (a broken new file keeps the old context)."""
        if not self._files.changed():
            return
        try:
            self._current = _build_server(self.settings)
        except (OSError, ssl.SSLError) as exc:
            log.warning("TLS certificate not reloaded: the previous one stays in use", extra={"reason": str(exc)})
            return
        self.reloads += 1
        log.info("TLS certificate reloaded", extra={"cert_file": self.settings.cert_file})

    def _select(
        self, connection: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _context: ssl.SSLContext
    ) -> None:
        self.refresh()
        connection.context = self._current


class ClientTls:
    """The context of a process's outgoing TLS links, built again when its files change."""

    def __init__(self, settings: TlsSection, section: str = "tls") -> None:
        settings.check(section)
        self.settings = settings
        self._files = _Files(settings.cert_file, settings.key_file, settings.ca_file)
        try:
            self._context = _build_client(settings)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(f"{section}: cannot load the certificates: {exc}") from None

    def context(self) -> ssl.SSLContext:
        if self._files.changed():
            try:
                self._context = _build_client(self.settings)
            except (OSError, ssl.SSLError) as exc:
                log.warning("TLS files not reloaded: the previous ones stay in use", extra={"reason": str(exc)})
        return self._context


def peer_common_name(transport: Any) -> str | None:
    """The common name of the certificate a TLS client presented and the handshake verified, if any."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    cert = ssl_object.getpeercert()
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
