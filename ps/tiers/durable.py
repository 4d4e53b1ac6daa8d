"""The root's durable state on disk (``--checkpoint-dir``), per job: its declaration, the
ranks and data leases (``roster.json``, written when they change), checkpoints written in the
background (the write-ahead log's older segments deleted once one is durable), and the
restore at start (newest checkpoint, then every logged version after it). Mixed into
``ps.tiers.root.Root`` before ``Tier``; the file formats are ``ps.tiers.checkpoint`` and
``ps.tiers.wal``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path

import numpy as np

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import HpsError, Unavailable
from ps.core.logs import event
from ps.core.types import LogMessage
from ps.core.view import KeySpec, Layout
from ps.tiers import checkpoint
from ps.tiers.jobstate import RootJob
from ps.tiers.wal import WalCorrupt

__all__ = ["Durable", "config_from_json"]

log = logging.getLogger("hps.root")

_CKPT_APPLIED_VERSIONS = 64  # versions of applied-push records a checkpoint carries


class Durable:
    """A root's job directories: mixed into ``Root`` (it uses ``config``, ``jobs``, ``ended``,
    ``declared``, ``damaged``, ``replication``, ``_install`` and ``_apply``)."""

    def _persist_declared(self, cfg: JobConfig) -> None:
        if self.config.checkpoint_dir:
            Path(self._job_dir(cfg.name)).mkdir(parents=True, exist_ok=True)
            checkpoint.write_atomic(Path(self._job_dir(cfg.name)) / "declared.json",
                                    json.dumps(dataclasses.asdict(cfg)))
            checkpoint.fsync_dir(self.config.checkpoint_dir)  # the job's directory entry too

    def _job_dir(self, job: str) -> str:
        return f"{self.config.checkpoint_dir}/{job}"

    def _roster(self, js: RootJob) -> dict:
        state = js.leases.state()
        return dict(ranks=js.ranks.state(), dataset=state["dataset"], leases=state["leases"], open=state["open"])

    async def _save_roster(self, js: RootJob) -> None:
        """Ranks, the dataset and the leases held, written (atomically) when they change: rare
        (joins, one lease per shard), so a rank or a lease is durable before it is answered.
        The trained offsets go in checkpoints and the write-ahead log, with the versions."""
        if not self.config.checkpoint_dir:
            return
        async with js.roster_lock:
            roster = self._roster(js)
            if roster == js.roster_saved:
                return
            path = Path(self._job_dir(js.config.name)) / "roster.json"
            try:
                await asyncio.to_thread(checkpoint.write_atomic, path, json.dumps(roster))
            except OSError as exc:
                raise Unavailable(f"the root could not save the ranks and data leases of job {js.config.name} "
                                  f"({exc}); retry") from None
            # On the standby before it is answered, as a job's creation is: a takeover must not
            # give a rank or a shard lease this root granted to another worker. Marked saved
            # first (a bootstrap under way sends the job's state with the saved roster after
            # it), and unmarked if the standby did not take it, so a retry sends it again.
            msg = LogMessage("roster", job=js.config.name, data=json.dumps(roster).encode())
            before, js.roster_saved = js.roster_saved, roster
            f = self.replication.follower
            try:
                if self.replication.required or (f is not None and f.alive and js.config.name in f.jobs):
                    await self.replication.confirm(msg)
                else:
                    self.replication.announce(msg)
            except BaseException:
                if js.roster_saved is roster:
                    js.roster_saved = before
                raise

    async def _quiesce(self, js: RootJob, apply: bool = True) -> None:
        """Wait for the job's version being applied (``apply``) and checkpoints being written."""
        if apply:
            async with js.apply_lock:
                pass
        mine = [t for t in self._ckpt_tasks if getattr(t, "job", None) == js.config.name]
        if mine:
            await asyncio.gather(*mine, return_exceptions=True)

    def _ckpt_state(self, js: RootJob) -> tuple[dict, dict]:
        """A checkpoint's arrays (copies) and meta, of the job as it is now."""
        arrays = {"params": js.params.copy(), "view": js.view.values.copy(),
                  "applied": np.frombuffer(js.applied.dump(_CKPT_APPLIED_VERSIONS), np.uint8),
                  "applied_runs": np.frombuffer(js.applied.dump_dropped(_CKPT_APPLIED_VERSIONS), np.uint8)}
        for k, v in js.optimizer.state_dict().items():
            if isinstance(v, np.ndarray):
                arrays[f"opt.{k}"] = v
        meta = dict(version=js.view.version, checksum=js.view.checksum, steps=js.optimizer.steps,
                    clock_min=js.view.clock_min,
                    data={k: v for k, v in js.leases.state().items() if k in ("done", "finished", "current_epoch")},
                    config=dataclasses.asdict(js.config),
                    keys=[[s.key, list(s.shape), s.dtype, s.kind] for s in js.layout])
        return arrays, meta

    def _checkpoint(self, js: RootJob) -> asyncio.Task | None:
        """Write a checkpoint of ``js`` as it is now, in the background (the task; None without
        a checkpoint directory, or for a job not served: its state in memory is suspect, and a
        checkpoint of it would be restored as the truth)."""
        if not self.config.checkpoint_dir or js.config.name in self.damaged:
            return None
        arrays, meta = self._ckpt_state(js)
        version, wal, name = js.view.version, js.wal, js.config.name
        # Records after this checkpoint go to a new segment; the old ones are deleted once
        # the checkpoint is durable (if it fails, replay still has everything).
        wal.rotate(version + 1)  # lazy: opens nothing, so it cannot fail

        def write() -> None:
            t0 = time.perf_counter()
            checkpoint.save(self._job_dir(name), version, arrays, meta, self.config.checkpoint_keep)
            wal.drop_upto(version)
            js.last_checkpoint = (time.time(), time.perf_counter() - t0, version)

        task = asyncio.ensure_future(asyncio.to_thread(write))
        task.job = name
        self._ckpt_tasks.add(task)
        task.add_done_callback(lambda t: self._ckpt_done(js, t))
        return task

    async def _created_durably(self, js: RootJob) -> None:
        """Wait until the job's first checkpoint is on disk, writing it again if that failed. A
        job is restored from its newest checkpoint plus the log after it: without one, a crash
        forgot the job and every version acknowledged since (the log alone cannot restore it).
        So neither its creator nor any round hears of it before; Unavailable while it fails."""
        if js.created_durably or not self.config.checkpoint_dir:
            return
        task = js.first_checkpoint
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # Nothing of the job was acknowledged yet, so its state is still the creation's.
            task = js.first_checkpoint = self._checkpoint(js)
            if task is None:
                raise Unavailable(f"job {js.config.name} is not served: {self.damaged.get(js.config.name)}")
        try:
            await asyncio.shield(task)
        except Exception as exc:
            raise Unavailable(f"the first checkpoint of job {js.config.name} could not be written ({exc}); "
                              "nothing of the job is acknowledged until it is: retry") from None
        js.created_durably = True

    def _ckpt_done(self, js: RootJob, task: asyncio.Task) -> None:
        self._ckpt_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            js.stats.checkpoint_failures += 1
            log.error("checkpoint of job %s failed (the write-ahead log still covers it): %s",
                      js.config.name, task.exception(), extra=event("checkpoint.failed", job=js.config.name))
        elif not task.cancelled():
            _, took, version = js.last_checkpoint
            log.info("checkpoint of job %s written at version %d in %.2fs", js.config.name, version, took,
                     extra=event("checkpoint.written", job=js.config.name, version=version, seconds=took))

    def _restore_all(self) -> None:
        for d in sorted(Path(self.config.checkpoint_dir).glob("*/")):
            if d.name.startswith("."):  # no job's (names start with a letter or digit): a tool's work
                continue                # in progress, such as `hps reshard` staging a target
            # One job's damaged files make that job unserved, not the root unable to start.
            try:
                if (d / "ENDED").exists():
                    version = json.loads((d / "ENDED").read_text())["version"]
                    declared = (config_from_json(json.loads((d / "declared.json").read_text()))
                                if (d / "declared.json").exists() else None)
                    self.ended[d.name] = version
                    if declared is not None:
                        self.ended_configs[d.name] = (declared, version)
                    continue
                js = self._load(d)
                cfg = (config_from_json(json.loads((d / "declared.json").read_text()))
                       if js is None and (d / "declared.json").exists() else None)
            except (WalCorrupt, HpsError, OSError, ValueError, KeyError, TypeError) as exc:
                self.damaged[d.name] = f"its checkpoint and write-ahead log could not be restored: {exc}"
                log.critical("job %s is not served: %s", d.name, exc, extra=event("job.damaged", job=d.name))
                continue
            if cfg is not None:
                self.declared[cfg.name] = cfg
                self.declared_at[cfg.name] = self.clock()

    def _load(self, d: Path, register: bool = True) -> RootJob | None:
        """A job from its newest checkpoint plus every logged version after it. WalCorrupt
        when what is on disk held versions this cannot restore (they may have been
        acknowledged): never a silent loss."""
        loaded = checkpoint.load_latest(d)
        files = checkpoint.list_checkpoints(d)
        if loaded is None:
            if files:
                raise WalCorrupt(f"none of its {len(files)} checkpoint(s) in {d} could be read: its versions "
                                 "cannot be restored (deploy/OPERATING.md)")
            if any(p.stat().st_size for p in d.glob("wal-*.log")):
                raise WalCorrupt(f"{d} holds a write-ahead log but no checkpoint to replay it on (a job's "
                                 "first one is written before anything of it is acknowledged; an older "
                                 "build did not wait for it): its versions cannot be restored")
            return None
        arrays, meta = loaded
        cfg = config_from_json(meta["config"])
        if cfg.name != d.name:  # a copied directory (lm -> lm-backup) would replay lm's log and serve as lm
            raise ValueError(f"{d} holds a checkpoint of job {cfg.name!r}: a job's files live in a directory "
                             "of its name (move it back, or out of the checkpoint directory)")
        layout = Layout([KeySpec(k[0], tuple(k[1]), k[2], *k[3:]) for k in meta["keys"]])  # kind: since issue 13
        if self.config.shard_count:
            # Before anything is installed or written: a shard started on another shard's
            # directory (or with the N before a reshard) served blocks its workers take for others.
            self._check_shard(cfg, layout)
        js = self._install(cfg, layout, arrays["params"], meta["version"], arrays["view"], register=False)
        state = {k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}
        js.optimizer.load_state_dict({"steps": meta["steps"], **state})
        js.view.clock_min = js.reported_floor = meta.get("clock_min", 0)
        if "applied" in arrays:
            js.applied.load(arrays["applied"].tobytes(),
                            arrays["applied_runs"].tobytes() if "applied_runs" in arrays else b"")
        roster_path = d / "roster.json"
        roster = json.loads(roster_path.read_text()) if roster_path.exists() else {}
        js.ranks.load(roster.get("ranks", []))
        js.leases.load({"dataset": roster.get("dataset"), **meta.get("data", {}), "leases": roster.get("leases", []),
                        "open": roster.get("open", [])},
                       self.clock())
        js.roster_saved = roster or None
        replayed = 0
        for rec in js.wal.records(after=js.view.version):
            self._apply(js, rec)
            replayed += 1
        newest = checkpoint.version_of(files[-1])
        if js.view.version < newest:  # the newer ones were unreadable, and the log does not reach them
            js.wal.close()
            raise WalCorrupt(f"its newest checkpoint (version {newest}) could not be read, and the one before "
                             f"(version {meta['version']}) with the write-ahead log reaches version "
                             f"{js.view.version} only: versions up to {newest} cannot be restored "
                             "(deploy/OPERATING.md)")
        js.reset_round(js.view.version, "restored")
        js.wal.rotate(js.view.version + 1)
        if register:
            self.jobs[cfg.name] = js
            log.info("restored job %s: checkpoint version %d + %d replayed from the write-ahead log "
                     "= version %d, checksum %#018x", cfg.name, meta["version"], replayed,
                     js.view.version, js.view.checksum,
                     extra=event("job.restored", job=cfg.name, version=js.view.version, replayed=replayed))
        else:
            js.wal.close()
        return js


def config_from_json(c: dict) -> JobConfig:
    """A JobConfig from its ``dataclasses.asdict`` JSON (OptimizerConfig rebuilds its groups
    and options from the dicts and lists JSON gives back).

    >>> cfg = JobConfig(name="lm", optimizer=OptimizerConfig(kind="adam", lr=3e-4))
    >>> config_from_json(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    True
    """
    return JobConfig(**{**c, "optimizer": OptimizerConfig(**c["optimizer"])})
