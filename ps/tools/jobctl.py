"""``hps job create|list|end``: manage jobs through any tier (relays forward to the root).

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

from ps.core.config import JobConfig
from ps.net.rpc import Caller
from ps.net.tls import TlsFiles
from ps.net.wire import encode_create_job, jobs_from_pb, pb

__all__ = ["declare", "list_jobs", "end", "format_jobs"]


def _rpc(address: str, name: str, request, timeout_s: float = 10.0):
    with Caller(address, TlsFiles.from_env()) as rpc:  # mutual TLS when HPS_TLS_* are set
        return rpc.call(name, request, timeout_s)


def declare(address: str, config: JobConfig) -> bool:
    """Declare a job's configuration; its first worker brings the parameters. False: existed."""
    return _rpc(address, "CreateJob", iter(encode_create_job(config, None, []))).created


def list_jobs(address: str) -> list[dict]:
    return jobs_from_pb(_rpc(address, "ListJobs", pb.ListJobsRequest()))


def end(address: str, job: str) -> int:
    """End a job; returns its last version."""
    return _rpc(address, "EndJob", pb.EndJobRequest(job=job)).version


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
