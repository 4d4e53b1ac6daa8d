"""Mutual TLS for the benchmarks: a throw-away CA, and local clusters whose tiers use it.

>>> certs = make_certs(tmp, topology, workers=["w0"])           # doctest: +SKIP
>>> with tls_cluster(certs).start(topology, logdir) as cluster:   # doctest: +SKIP
...     ParameterClient(cluster.address("root"), "job", "w0", tls=certs["w0"])

``hps launch`` (``ps.tools.launch.Cluster``) starts every tier with ``--insecure`` today; the
class ``tls_cluster`` returns starts each tier with its own certificate from ``init_certs``
instead (``--tls-cert/--tls-key/--tls-ca``), so the same topology runs both ways, side by side.

Run as a script, it runs ``hps demo`` over mutual TLS (what ``bsp_step.py`` measures):

    python benchmarks/_tls.py demo CERT_DIR -- --steps 30 --workers 4 --out DIR

every tier with its certificate, every worker (and the demo's status calls) with the worker
certificate ``CERT_DIR/worker.crt`` through ``HPS_TLS_CERT/KEY/CA``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ps.net.tls import TlsFiles  # noqa: E402
from ps.tools.launch import Cluster  # noqa: E402

_TIER_ENV = ("HPS_TLS_CERT", "HPS_TLS_KEY", "HPS_TLS_CA", "HPS_INSECURE")


def make_certs(directory: str | os.PathLike, topology: dict, workers: tuple[str, ...] | list[str] = ("worker",)
               ) -> dict[str, TlsFiles]:
    """A CA and a certificate for every tier of ``topology`` and every worker (ECDSA P-256)."""
    from ps.tools.certs import init_certs

    return init_certs(directory, topology, workers=list(workers))


def tls_cluster(certs: dict[str, TlsFiles]) -> type[Cluster]:
    """A ``Cluster`` whose tiers serve (and call their parents) with mutual TLS: each tier's
    ``--insecure`` becomes its own ``--tls-cert/--tls-key/--tls-ca`` from ``certs``."""

    class TlsCluster(Cluster):
        def _popen(self, name, role, cmd, log, parent, extra_env=None):
            if role != "link":
                if "--insecure" not in cmd:
                    raise RuntimeError("ps.tools.launch no longer starts tiers with --insecure: "
                                       "benchmarks/_tls.py must follow it")
                f = certs[name]
                i = cmd.index("--insecure")
                cmd = [*cmd[:i], "--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca, *cmd[i + 1:]]
                # The worker's certificate may be in this process's environment (HPS_TLS_*): not the tiers'.
                self.env = {k: v for k, v in (self.env or os.environ).items() if k not in _TIER_ENV}
            return super()._popen(name, role, cmd, log, parent, extra_env)

    return TlsCluster


def _demo(cert_dir: str, demo_args: list[str]) -> int:
    """``hps demo`` with every tier on its certificate and every worker on ``worker.crt``."""
    import ps.demo.run as demo_run
    from ps.tools.cli import main as cli_main
    from ps.tools.launch import load_topology

    topo_arg = demo_args[demo_args.index("--topology") + 1] if "--topology" in demo_args else None
    certs = make_certs(cert_dir, load_topology(topo_arg), workers=["worker"])
    demo_run.Cluster = tls_cluster(certs)  # what ps.demo.run starts its tiers with
    w = certs["worker"]
    os.environ.update(HPS_TLS_CERT=w.cert, HPS_TLS_KEY=w.key, HPS_TLS_CA=w.ca)  # workers and status calls
    return cli_main(["demo", *demo_args])


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "demo":
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    rest = sys.argv[3:]
    sys.exit(_demo(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest))
