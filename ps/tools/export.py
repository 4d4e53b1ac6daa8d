"""A job's checkpoint as plain torch files: the model's state_dict and the optimizer's.

>>> import asyncio, shutil, tempfile
>>> import numpy as np, torch
>>> from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
>>> from ps.core.view import KeySpec, Layout
>>> from ps.tiers.root import Root
>>> d = tempfile.mkdtemp()
>>> layout = Layout([KeySpec("weight", (2, 3)), KeySpec("bias", (2,))])
>>> async def create():
...     root = Root(ServerConfig(role="global", checkpoint_dir=d))
...     await root.create_job(JobConfig(name="lm", optimizer=OptimizerConfig(kind="adamw")), layout,
...                           np.arange(8, dtype=np.float32))
...     await root.stop()
>>> asyncio.run(create())
>>> made = export(f"{d}/lm", f"{d}/model.pt", optimizer_out=f"{d}/opt.pt")
>>> made.version, sorted(torch.load(f"{d}/model.pt"))
(0, ['bias', 'weight'])
>>> model = torch.nn.Linear(3, 2)
>>> model.load_state_dict(torch.load(f"{d}/model.pt"))
<All keys matched successfully>
>>> torch.optim.AdamW(model.parameters()).load_state_dict(torch.load(f"{d}/opt.pt"))
>>> shutil.rmtree(d)

The model comes from the published view (what workers load), every key kind included
(parameters, frozen parameters, buffers). The optimizer's state dict is torch's shape: state by
the trained keys' ordinal in layout order, one param group per configured group; load it into
the job's class built over the model's trained parameters (``requires_grad``), grouped alike.

By default the root's write-ahead log is replayed onto the newest checkpoint in a temporary
copy of the job's directory (the root's files are only read), so the export holds every
acknowledged version; ``replay=False`` exports the checkpoint alone. A root writing while the
copy is taken can leave it a torn last record (cut, as a restart would) or, rarely, a log that no
longer continues the copied checkpoint (refused with a sentence): export from a stopped root, or
retry.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ps.core.errors import BadInput
from ps.core.optim import ServerOptimizer
from ps.core.view import KeySpec, Layout
from ps.tiers import checkpoint

__all__ = ["export", "export_shards", "Exported", "find_job_dir"]


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote."""

    job: str
    version: int
    keys: int
    optimizer: str   # the torch.optim class
    replayed: bool   # the write-ahead log was replayed onto the checkpoint


def find_job_dir(path: str | Path, job: str = "") -> Path:
    """The job directory ``path`` names: itself when it holds checkpoints, else its child
    ``job`` (or its only child holding checkpoints)."""
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"{p} is not a directory")
    if checkpoint.list_checkpoints(p) and not job:
        return p
    if job:
        if checkpoint.list_checkpoints(p) and _job_name(p) == job:
            return p  # the job's own directory (a shard's, as `hps checkpoint export` takes them too)
        if not checkpoint.list_checkpoints(p / job):
            raise BadInput(f"{p / job} holds no checkpoint (ckpt-*.npz)")
        return p / job
    jobs = sorted(d.name for d in p.iterdir()
                  if d.is_dir() and not d.name.startswith(".") and checkpoint.list_checkpoints(d))
    if len(jobs) != 1:
        raise BadInput(f"{p} holds checkpoints of {len(jobs)} jobs ({', '.join(jobs) or 'none'}); name one with --job")
    return p / jobs[0]


def _from_checkpoint(job_dir: Path) -> tuple[np.ndarray, Layout, ServerOptimizer, int]:
    from ps.tiers.durable import config_from_json

    loaded = checkpoint.load_latest(job_dir)
    if loaded is None:
        raise BadInput(f"{job_dir} holds no readable checkpoint")
    arrays, meta = loaded
    cfg = config_from_json(meta["config"])
    layout = Layout([KeySpec(k[0], tuple(k[1]), k[2], *k[3:]) for k in meta["keys"]])
    params = np.array(arrays["params"], np.float32)
    opt = ServerOptimizer(cfg.optimizer, params, layout)
    opt.load_state_dict({"steps": meta["steps"], **{k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}})
    return np.array(arrays["view"], np.float32), layout, opt, int(meta["version"])


def _job_name(job_dir: Path) -> str:
    """The job a directory's newest readable checkpoint is of (a backup may be named otherwise:
    /backups/lm-20261127); the directory's name when none reads (the restore then says why)."""
    import json
    import zipfile

    from ps.core.config import check_name

    for path in reversed(checkpoint.list_checkpoints(job_dir)):
        try:
            with np.load(path) as z:
                return check_name(str(json.loads(bytes(z["__meta__"]).decode())["config"]["name"]))
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
            continue
    return job_dir.name


@contextmanager
def restored(job_dir: Path) -> Iterator:
    """The root's job (``RootJob``) restored from ``job_dir`` as a restarted root would restore
    it (newest checkpoint plus its write-ahead log), in a temporary copy: ``job_dir`` is only read."""
    from ps.core.config import ServerConfig
    from ps.tiers.root import Root

    name = _job_name(job_dir)
    with tempfile.TemporaryDirectory(prefix="hps-restore-") as tmp:
        copy = Path(tmp) / name  # (a root serves a directory as the job of its name only)
        shutil.copytree(job_dir, copy, ignore=shutil.ignore_patterns("*.tmp"))
        root = Root(ServerConfig(role="global", checkpoint_dir=tmp))
        if name in root.damaged:
            raise BadInput(f"job {name} ({job_dir}): {root.damaged[name]}")
        js = root.jobs.get(name)
        if js is None:
            raise BadInput(f"{job_dir} holds no job the root could restore (ended, or no checkpoint)")
        try:
            yield root, js
        finally:
            if js.wal is not None:
                js.wal.close()


def _replayed(job_dir: Path) -> tuple[np.ndarray, Layout, ServerOptimizer, int]:
    with restored(job_dir) as (_, js):
        return js.view.values.copy(), js.layout, js.optimizer, js.view.version


def export_shards(paths: list[str | Path], out: str | Path, optimizer_out: str | Path | None = None,
                  job: str = "") -> Exported:
    """``export`` of a job sharded over root shards: ``paths`` are the shards' checkpoint
    directories in shard order. Each is restored (checkpoint plus write-ahead log, in a
    temporary copy), the blocks joined into whole tensors (``ps.tools.reshard`` onto one shard
    that cuts nothing), then exported as an unsharded job would be."""
    from ps.tools.reshard import reshard_dirs

    name = find_job_dir(paths[0], job).name
    with tempfile.TemporaryDirectory(prefix="hps-export-") as tmp:
        reshard_dirs(list(paths), [tmp], name, weights=(1.0,), block_elems=1 << 30)
        made = export(Path(tmp) / name, out, optimizer_out, replay=False)
    return Exported(name, made.version, made.keys, made.optimizer, replayed=True)


def export(path: str | Path, out: str | Path, optimizer_out: str | Path | None = None, job: str = "",
           replay: bool = True) -> Exported:
    """Write the job's model state_dict to ``out`` (and its optimizer's to ``optimizer_out``)."""
    job_dir = find_job_dir(path, job)
    view, layout, opt, version = (_replayed if replay else _from_checkpoint)(job_dir)
    model = {}
    for s in layout:
        off = layout.offset(s.key)
        model[s.key] = torch.from_numpy(view[off:off + s.numel].copy()).view(s.shape)
    torch.save(model, out)
    if optimizer_out:
        torch.save(opt.torch_state_dict(), optimizer_out)
    return Exported(job_dir.name, version, len(layout.specs), type(opt.optimizer).__name__, replay)
