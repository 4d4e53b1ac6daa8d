"""``hps certs init DIR``: a CA and one certificate per tier (and per worker) for a topology.

>>> paths = init_certs("certs", topology, workers=["w0", "w1"])     # doctest: +SKIP
>>> sorted(paths)                                                   # doctest: +SKIP
['ca', 'eu', 'eu-a', 'eu-b', 'root', 'us', 'us-a', 'us-b', 'w0', 'w1']

DIR/ca.crt (and ca.key, which signs: keep it off the tiers), DIR/NAME.crt and DIR/NAME.key
for each tier of the topology and each worker. Identities (ps/net/tls.py): a SAN URI
``hps://global/NAME``, ``hps://regional/REGION``, ``hps://zone/REGION/ZONE`` or
``hps://worker/NAME``; tier certificates also carry the DNS name ``hps-tier`` that clients
verify, plus ``localhost``, 127.0.0.1 and any ``hosts`` given. ECDSA P-256 keys (mode 0600).
A second ``init`` over the same DIR keeps the CA and re-issues every leaf: a rotation.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ps.core.config import check_member
from ps.net.tls import TIER_NAME, TlsFiles
from ps.server.auth import write_secret

__all__ = ["init_certs", "tiers_of", "identity_uri", "issue"]

_DAYS = 365


def identity_uri(role: str, name: str, region: str = "") -> str:
    """The SAN URI that names a certificate's holder (parsed back by ps.server.peers)."""
    if role == "zone":
        return f"hps://zone/{region}/{name}"
    return f"hps://{role}/{name}"


def tiers_of(topology: dict) -> list[tuple[str, str, str]]:
    """(role, name, region) of every tier in a topology (``hps launch``'s format)."""
    root = topology.get("root") if isinstance(topology.get("root"), dict) else {}
    name = str(root.get("name") or "root")
    shards = root.get("shards")  # root shards (ps.tools.launch): NAME-0 .. NAME-(N-1), each a root
    count = shards if isinstance(shards, int) and not isinstance(shards, bool) else \
        len(shards) if isinstance(shards, list) else 0
    # Below a sharded root every relay is one per shard (NAME-I below its parent's I-th).
    per = [f"-{i}" for i in range(count)] or [""]
    out = [("global", f"{name}{s}", "") for s in per]
    if isinstance(root.get("standby"), dict):  # the hot-standby root (issue 15), one per shard: a root too
        out += [("global", str(root["standby"].get("name") or "root-standby") + s, "") for s in per]
    for z in root.get("zones") or []:  # zones straight below the root: the root is their region
        out += [("zone", str(z["name"] if isinstance(z, dict) else z) + s, name + s) for s in per]
    for r in topology.get("regions") or []:
        out += [("regional", str(r["name"]) + s, str(r["name"]) + s) for s in per]
        for z in r.get("zones") or []:
            out += [("zone", str(z["name"] if isinstance(z, dict) else z) + s, str(r["name"]) + s) for s in per]
    return out


def _write(path: Path, data: bytes, private: bool = False) -> None:
    write_secret(path, data, private)  # whole files only: a server re-reading them never sees half of one


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    crt, key = directory / "ca.crt", directory / "ca.key"
    if crt.exists() and key.exists():
        return (x509.load_pem_x509_certificate(crt.read_bytes()),
                serialization.load_pem_private_key(key.read_bytes(), None))  # type: ignore[return-value]
    k = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(k, hashes.SHA256()))
    _write(key, _pem_key(k), private=True)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM))
    return cert, k


def issue(directory: str | os.PathLike, role: str, name: str, region: str = "", hosts: tuple[str, ...] = (),
          days: int = _DAYS) -> TlsFiles:
    """Sign a certificate for one tier or worker with DIR's CA (made if missing); its files."""
    check_member(name)  # the files' name: no '/' out of DIR
    if name == "ca":
        raise ValueError("'ca' names the CA's own files (ca.crt, ca.key); give the tier or worker another name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca(d, "hps cluster CA")
    k = _key()
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(role, name, region))]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role != "worker":  # tiers serve (and call their parent): a server name; workers only call
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        for h in (TIER_NAME, "localhost", "127.0.0.1", *hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                     x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
            .issuer_name(ca_cert.subject).public_key(k.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256()))
    # Key first: a server that re-reads between the two writes pairs the old cert with the new
    # key, fails to load, keeps the old pair and tries again at its next handshake.
    _write(d / f"{name}.key", _pem_key(k), private=True)
    _write(d / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(str(d / f"{name}.crt"), str(d / f"{name}.key"), str(d / "ca.crt"))


def init_certs(directory: str | os.PathLike, topology: dict, workers: list[str] | tuple[str, ...] = ("worker",),
               hosts: tuple[str, ...] = ()) -> dict[str, TlsFiles]:
    """A CA (kept if DIR has one) and a certificate for every tier of ``topology`` and every worker."""
    tiers, seen = tiers_of(topology), set()
    # Every name checked before any file is written: one certificate per file name
    for name in [n for _, n, _ in tiers] + list(workers):
        check_member(name)
        if name == "ca" or name in seen:
            holders = "the CA's and another's" if name == "ca" else "two tiers', or a tier's and a worker's"
            raise ValueError(f"{name!r} would name {holders} certificate files: certificates are named after "
                             "their holder; rename one (nothing was written)")
        seen.add(name)
    out = {}
    for role, name, region in tiers:
        out[name] = issue(directory, role, name, region, hosts)
    for w in workers:
        out[w] = issue(directory, "worker", w)
    return out
