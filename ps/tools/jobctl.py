"""``hps job create|list|end``: manage jobs through any tier (relays forward to the root).

Every function takes the admin token (``token=``; ``admin_token()`` reads HPS_ADMIN_TOKEN or
HPS_ADMIN_TOKEN_FILE); ``create`` returns the job's token, minted by the root, once.

>>> declare(address, JobConfig(name="jobctl-lm", mode="ssp", staleness=2))   # False: it existed
True
>>> print(format_jobs([r for r in list_jobs(address) if r["config"].name == "jobctl-lm"]))
job        state     mode    optimizer  codec  version  members  parameters
---------  --------  ------  ---------  -----  -------  -------  ----------
jobctl-lm  declared  ssp(2)  sgd 0.01   fp32         0        0           0
>>> end(address, "jobctl-lm")        # its last version (no worker brought parameters)
0
"""

from __future__ import annotations

import os

from ps.core.config import JobConfig
from ps.net.messages import jobs_from_pb
from ps.net.rpc import Caller
from ps.net.tls import TlsFiles
from ps.net.wire import encode_create_job, pb

__all__ = ["admin_token", "create", "declare", "list_jobs", "end", "format_jobs"]


def admin_token() -> str | None:
    """The admin token from HPS_ADMIN_TOKEN, or the file HPS_ADMIN_TOKEN_FILE names (None: none)."""
    if os.environ.get("HPS_ADMIN_TOKEN"):
        return os.environ["HPS_ADMIN_TOKEN"].strip()
    if os.environ.get("HPS_ADMIN_TOKEN_FILE"):
        from ps.server.auth import read_token_file

        return read_token_file(os.environ["HPS_ADMIN_TOKEN_FILE"], "admin token")
    return None


def _rpc(address: str, name: str, request, token: str | None, timeout_s: float = 10.0):
    with Caller(address, TlsFiles.from_env(), token) as rpc:  # mutual TLS when HPS_TLS_* are set
        return rpc.call(name, request, timeout_s)


def create(address: str, config: JobConfig, token: str | None = None) -> tuple[bool, str]:
    """Declare a job's configuration (its first worker brings the parameters): (created, the
    job's token: "" when the job had one already, or the tiers run without tokens)."""
    r = _rpc(address, "CreateJob", iter(encode_create_job(config, None, [])), token)
    return r.created, r.job_token


def declare(address: str, config: JobConfig, token: str | None = None) -> bool:
    """``create``, the token dropped. False: the job existed."""
    return create(address, config, token)[0]


def list_jobs(address: str, token: str | None = None) -> list[dict]:
    return jobs_from_pb(_rpc(address, "ListJobs", pb.ListJobsRequest(), token))


def end(address: str, job: str, token: str | None = None) -> int:
    """End a job; returns its last version."""
    return _rpc(address, "EndJob", pb.EndJobRequest(job=job), token).version


def format_jobs(rows: list[dict]) -> str:
    from ps.tools.format import summary_table

    table = []
    for r in rows:
        c: JobConfig = r["config"]
        mode = f"ssp({c.staleness})" if c.mode == "ssp" else c.mode
        table.append(dict(job=c.name, state=r["state"], mode=mode, optimizer=f"{c.optimizer.kind} {c.optimizer.lr:g}",
                          codec=c.push_codec, version=r["version"], members=r["members"],
                          parameters=r["parameters"]))
    cols = ["job", "state", "mode", "optimizer", "codec", "version", "members", "parameters"]
    return summary_table(table, cols) if table else "no jobs"
