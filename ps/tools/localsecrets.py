"""The credentials of a local cluster (``hps launch``, ``hps demo``): a throw-away CA, a
certificate per tier and one for local clients, and an admin token, under the run directory;
and ``LOGDIR/client.env``, what a client of that cluster needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ps.tools.launch import Cluster

__all__ = ["LocalSecrets", "CLIENT_ENV", "write_client_env", "read_client_env"]


@dataclass(frozen=True)
class LocalSecrets:
    """A throw-away CA, a certificate per tier and one for local clients, and an admin token,
    under a run directory (``secure=True``): what `hps launch` and `hps demo` run with.

    ``client_env()`` is what a client of the cluster needs (``HPS_TLS_*``, the admin token's
    file); `hps launch` writes it to ``LOGDIR/client.env`` for ``source``, and `hps status
    --launch-dir` reads it. Keys and the token file are mode 0600; nothing prints them."""

    directory: Path
    tls: dict                 # tier name (and "client") -> TlsFiles
    admin_token_file: Path

    @classmethod
    def create(cls, directory: Path, topo: dict) -> LocalSecrets:
        import secrets as _secrets

        from ps.server.auth import write_secret
        from ps.tools.certs import init_certs

        directory.mkdir(parents=True, exist_ok=True)
        tls = init_certs(directory / "certs", topo, workers=["client"])
        token_file = directory / "admin-token"
        write_secret(token_file, _secrets.token_urlsafe(32) + "\n")
        return cls(directory, tls, token_file)

    def tier_args(self, name: str) -> list[str]:
        f = self.tls[name]
        return ["--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca,
                "--admin-token-file", str(self.admin_token_file)]

    def admin_token(self) -> str:
        return self.admin_token_file.read_text().strip()

    def client_env(self) -> dict[str, str]:
        f = self.tls["client"]
        return {"HPS_TLS_CERT": f.cert, "HPS_TLS_KEY": f.key, "HPS_TLS_CA": f.ca,
                "HPS_ADMIN_TOKEN_FILE": str(self.admin_token_file)}


CLIENT_ENV = "client.env"


def write_client_env(cluster: Cluster) -> Path:
    """``LOGDIR/client.env``: the variables a client of a secure local cluster needs (paths, not
    secrets: the token stays in its 0600 file)."""
    assert cluster.secrets is not None
    path = cluster.logdir / CLIENT_ENV
    path.write_text("".join(f"{k}={v}\n" for k, v in cluster.secrets.client_env().items()))
    return path


def read_client_env(logdir: str | Path) -> dict[str, str]:
    """What ``write_client_env`` wrote ({} for an insecure cluster or none)."""
    try:
        text = (Path(logdir) / CLIENT_ENV).read_text()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
