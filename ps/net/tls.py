"""Mutual TLS for every gRPC edge: credentials from PEM files, re-read when the files change.

>>> files = TlsFiles(cert="zone.crt", key="zone.key", ca="ca.crt")   # doctest: +SKIP
>>> server.add_secure_port("0.0.0.0:7001", server_credentials(files))  # doctest: +SKIP
>>> rpc = Caller("region-eu:7000", tls=files)    # presents zone.crt, checks the CA # doctest: +SKIP

Who is who lives in the certificates, signed by the cluster's CA (``hps certs init``):

- every certificate names its holder in one SAN URI, ``hps://ROLE/...``: ``hps://global/root``,
  ``hps://regional/eu``, ``hps://zone/eu/eu-a`` (role, region, zone), ``hps://worker/NAME``;
  a parent reads it from the handshake (``ps.server.peers``) and accepts a relay child only
  with a relay certificate that names that child;
- a tier's certificate also carries the DNS name ``TIER_NAME`` (``hps-tier``), and clients
  verify the server against that name whatever address they dialled (``localhost``, a pod IP,
  a Service name): the CA says "this is a tier of this cluster". Worker certificates never carry
  it, so a worker cannot pose as a tier.

Rotation without restart: a server's certificate configuration is fetched by gRPC at each new
handshake and re-read only when a file's mtime or size changed (``grpc.dynamic_ssl_server_credentials``);
a client checks its files at most every ``CHECK_S`` seconds before a call and builds a new
channel when they changed (connections already up keep their session until they close).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["TlsFiles", "TIER_NAME", "CHECK_S", "server_credentials", "ClientTls", "client_options"]

log = logging.getLogger("hps.tls")

TIER_NAME = "hps-tier"   # the DNS SAN every tier certificate carries; clients verify it
CHECK_S = 1.0            # clients look at their files' mtimes at most this often


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this process's certificate chain and key, and the CA that signs its peers."""

    cert: str
    key: str
    ca: str

    def __post_init__(self) -> None:
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA certificate", self.ca)):
            if not path:
                raise ValueError(f"TLS needs a {what} file too (--tls-cert, --tls-key and --tls-ca go together)")

    @classmethod
    def of(cls, cert: str = "", key: str = "", ca: str = "") -> TlsFiles | None:
        """The files, or None when none is given (plaintext); some but not all is an error."""
        if not (cert or key or ca):
            return None
        return cls(cert, key, ca)

    @classmethod
    def from_env(cls) -> TlsFiles | None:
        """``HPS_TLS_CERT``, ``HPS_TLS_KEY``, ``HPS_TLS_CA`` (what a worker's pod mounts)."""
        return cls.of(os.environ.get("HPS_TLS_CERT", ""), os.environ.get("HPS_TLS_KEY", ""),
                      os.environ.get("HPS_TLS_CA", ""))

    def stamp(self) -> tuple:
        """What changes when any file is rewritten (or replaced, as Kubernetes swaps a Secret's link)."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.cert, self.key, self.ca):
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(cert, key, ca) bytes; a sentence naming the file when one cannot be read."""
        out = []
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA certificate", self.ca)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as exc:
                raise OSError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from None
        cert, key, ca = out
        if b"-----BEGIN" not in cert or b"-----BEGIN" not in key or b"-----BEGIN" not in ca:
            raise ValueError(f"the TLS files {self.cert!r}, {self.key!r}, {self.ca!r} must be PEM")
        return cert, key, ca


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that require and verify a client certificate signed by ``files.ca``,
    re-reading the files at the first handshake after they changed."""
    state = {"stamp": files.stamp()}
    lock = threading.Lock()

    def configuration(cert: bytes, key: bytes, ca: bytes) -> Any:
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch():  # called by gRPC before each handshake: a stat of three files, or a new config
        with lock:
            stamp = files.stamp()
            if stamp == state["stamp"]:
                return None
            try:
                config = configuration(*files.read())
            except (OSError, ValueError) as exc:  # half-written: keep serving the old one, try again later
                log.warning("TLS files changed but cannot be loaded yet (%s); keeping the previous ones", exc)
                return None
            state["stamp"] = stamp
            log.info("TLS certificate files changed; new handshakes use them (%s)", files.cert)
            return config

    return grpc.dynamic_ssl_server_credentials(configuration(*files.read()), fetch,
                                               require_client_authentication=True)


def client_options() -> list[tuple[str, str]]:
    """Channel options for a TLS client: verify the server as a tier of this cluster."""
    return [("grpc.ssl_target_name_override", TIER_NAME)]


class ClientTls:
    """A client's credentials and whether its files changed since the channel was built.

    ``changed()`` is cheap: a clock read, and three stats at most every ``CHECK_S`` seconds.
    """

    def __init__(self, files: TlsFiles, check_s: float = CHECK_S) -> None:
        self.files = files
        self.check_s = check_s
        self._stamp: tuple = ()
        self._next = 0.0

    def credentials(self) -> grpc.ChannelCredentials:
        self._stamp = self.files.stamp()
        self._next = time.monotonic() + self.check_s
        cert, key, ca = self.files.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.check_s
        return self.files.stamp() != self._stamp
