"""Who is calling: the peer's verified identity from its TLS certificate, and the one rule
certificates decide here (a relay child must hold a relay certificate that names it).

>>> peer = peer_identity(context)      # doctest: +SKIP
>>> peer.role, peer.region, peer.name  # from SAN URI hps://zone/eu/eu-a    # doctest: +SKIP
('zone', 'eu', 'eu-a')

``peer_identity`` returns None on a plaintext server (``--insecure``): there is nobody to
check, and nothing here refuses. With TLS, gRPC has already verified the chain to the
cluster's CA before a handler runs; a certificate without an ``hps://`` URI is an identity of
role ``""`` (signed by our CA, but neither a tier nor a worker). Tokens (who may touch which
job) are checked beside this, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ps.core.errors import PermissionDenied

__all__ = ["Identity", "peer_identity", "NotRelay", "check_relay_child", "RELAY_ROLES", "reachable_address"]

RELAY_ROLES = ("regional", "zone")
_ROLES = ("global", "regional", "zone", "worker")


@dataclass(frozen=True)
class Identity:
    """A peer as its certificate names it: ``hps://ROLE/NAME`` or ``hps://zone/REGION/NAME``."""

    role: str     # global | regional | zone | worker | "" (no hps identity in the certificate)
    name: str     # the tier's name (its member id at its parent) or the worker's
    region: str = ""  # a zone's region; a regional master's own name

    @property
    def relay(self) -> bool:
        return self.role in RELAY_ROLES


def parse_uri(uri: str) -> Identity | None:
    if not uri.startswith("hps://"):
        return None
    parts = uri[len("hps://"):].split("/")
    if parts[0] == "zone" and len(parts) == 3 and all(parts):
        return Identity("zone", parts[2], parts[1])
    if parts[0] in _ROLES and parts[0] != "zone" and len(parts) == 2 and parts[1]:
        return Identity(parts[0], parts[1], parts[1] if parts[0] == "regional" else "")
    return None


def peer_identity(context: Any) -> Identity | None:
    """The calling peer's identity from its verified certificate; None without TLS."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    for raw in auth.get("peer_uri", ()):
        found = parse_uri(raw.decode("utf-8", "replace"))
        if found is not None:
            return found
    cn = auth.get("x509_common_name", [b""])[0].decode("utf-8", "replace")
    return Identity("", cn)


class NotRelay(PermissionDenied):
    """Right cluster, wrong certificate: only a relay's certificate may act as that relay
    (a PermissionDenied; a client that does not know this name gets that class by its code)."""


def check_relay_child(context: Any, member: str, role: str, relays: Any, parent: str, parent_role: str) -> None:
    """Refuse ``member`` acting as ``role`` unless the certificate allows it: a relay role (or a
    member known here as a relay, in ``relays``) needs a relay certificate of that role naming
    ``member``; a zone certificate's region must be this regional master's name."""
    peer = peer_identity(context)
    if peer is None:
        return
    claims_relay = role in RELAY_ROLES or role == "relay" or member in relays
    if not claims_relay:
        return
    if not peer.relay:
        raise NotRelay(f"{member!r} acts as a {role if role in RELAY_ROLES else 'relay'} child here, but the "
                       f"caller's certificate is a {peer.role or 'certificate with no hps:// identity'} "
                       f"({peer.name!r}); a relay connects with the certificate `hps certs init` made for it")
    if peer.name != member or (role in RELAY_ROLES and peer.role != role):
        raise NotRelay(f"the caller's certificate names {peer.role} {peer.name!r}, not {role} {member!r}; a relay "
                       "registers, heartbeats and pushes under the name its certificate holds")
    if parent_role == "regional" and peer.role == "zone" and peer.region != parent:
        raise NotRelay(f"zone {peer.name!r}'s certificate places it in region {peer.region!r}, not {parent!r}; "
                       "connect it to its own region's master")


_UNSPECIFIED = ("0.0.0.0", "::", "[::]", "")


def reachable_address(address: str, peer: str) -> str:
    """The address a child says it serves on, made reachable: a tier listening on every
    interface (``0.0.0.0:7000``, as every pod does) says so, and that is no address another
    machine can call; its host is replaced by the one its call came from (``context.peer()``:
    ``ipv4:10.1.2.3:51234`` or ``ipv6:[fd00::3]:51234``). Certificates are verified against
    the name every tier's carries, not the host, so TLS works to an address found so.

    >>> reachable_address("0.0.0.0:7000", "ipv4:10.1.2.3:51234")
    '10.1.2.3:7000'
    >>> reachable_address("[::]:7000", "ipv6:[fd00::3]:51234")
    '[fd00::3]:7000'
    >>> reachable_address("[::]:7000", "ipv6:%5Bfd00::3%5D:51234")
    '[fd00::3]:7000'
    >>> reachable_address("eu-a.hps:7000", "ipv4:10.1.2.3:51234")
    'eu-a.hps:7000'
    """
    host, sep, port = address.rpartition(":")
    if not sep or host not in _UNSPECIFIED:
        return address
    kind, _, where = peer.partition(":")
    ip = unquote(where).rpartition(":")[0]  # (gRPC percent-encodes an IPv6 peer's brackets)
    if kind not in ("ipv4", "ipv6") or not ip:
        return address
    return f"{ip}:{port}"
