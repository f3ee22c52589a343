"""Throwaway certificates for TLS tests, made with the ``openssl`` command at test time.

``Certificates.make(directory)`` writes a test authority, a server certificate for ``localhost`` and
127.0.0.1, client certificates with a chosen common name, and ``foreign`` ones signed by another authority.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    def serial(self) -> int:
        out = subprocess.run(
            ["openssl", "x509", "-noout", "-serial", "-in", str(self.cert)], check=True, capture_output=True, text=True
        ).stdout
        return int(out.strip().partition("=")[2], 16)


@dataclass(frozen=True)
class Certificates:
    directory: Path
    ca: Path
    server: Pair

    @classmethod
    def make(cls, directory: Path) -> Certificates:
        directory.mkdir(parents=True, exist_ok=True)
        ca = _authority(directory, "ca")
        return cls(directory, ca, issue(directory, "server", "localhost", "ca", server=True))

    def client(self, name: str, authority: str = "ca") -> Pair:
        """A client certificate with common name ``name`` (signed by another authority: ``authority``)."""
        if not (self.directory / f"{authority}.pem").exists():
            _authority(self.directory, authority)
        return issue(self.directory, f"client-{authority}-{name}", name, authority, server=False)

    def another_server(self, name: str) -> Pair:
        return issue(self.directory, name, "localhost", "ca", server=True)


def _authority(directory: Path, name: str) -> Path:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN=TridentMQ test authority {name}",
        cwd=directory,
    )
    return directory / f"{name}.pem"


def issue(directory: Path, stem: str, common_name: str, authority: str, *, server: bool) -> Pair:
    extensions = directory / f"{stem}.ext"
    if server:
        extensions.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    else:
        extensions.write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        f"{stem}.key",
        "-out",
        f"{stem}.csr",
        "-subj",
        f"/CN={common_name}",
        cwd=directory,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{stem}.csr",
        "-CA",
        f"{authority}.pem",
        "-CAkey",
        f"{authority}.key",
        "-CAcreateserial",
        "-out",
        f"{stem}.pem",
        "-days",
        "2",
        "-extfile",
        extensions.name,
        cwd=directory,
    )
    return Pair(directory / f"{stem}.pem", directory / f"{stem}.key")


def replace(target: Pair, source: Pair) -> None:
    """Put ``source``'s certificate and key in ``target``'s files, each by an atomic rename."""
    for src, dst in ((source.key, target.key), (source.cert, target.cert)):
        tmp = dst.with_suffix(".new")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
