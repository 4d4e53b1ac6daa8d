"""The global root: authoritative parameters, the optimizer, the published view, checkpoints.

    root = Root(ServerConfig(role="global", checkpoint_dir="/var/lib/hps"))
    await root.create_job(config, layout, chunks)     # initial values from the first worker

A closed round becomes one optimizer step on the averaged sum, then a new published version:
d_v = encode(params_v - view_{v-1}); view_v = view_{v-1} + decode(d_v). Whatever the codec
drops stays in params - view and goes out with the next delta (error feedback, invariant 6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np

from ps import checkpoint
from ps.codecs import get_codec
from ps.config import JobConfig, OptimizerConfig, ServerConfig
from ps.consistency import Aggregate
from ps.deltas import DeltaEntry
from ps.errors import Conflict, UnknownJob
from ps.optim import ServerOptimizer
from ps.store import KeySpec, Layout, checksum
from ps.tensors import Chunk, assemble, split
from ps.tier import Ack, JobState, Tier
from ps.wal import WalRecord, WriteAheadLog

__all__ = ["Root"]

log = logging.getLogger("hps.root")


class Root(Tier):
    role = "global"

    def __init__(self, config: ServerConfig, **kw) -> None:
        super().__init__(config, **kw)
        self._ckpt_tasks: set[asyncio.Task] = set()
        self.declared: dict[str, JobConfig] = {}   # configured, waiting for parameters
        self.ended_configs: dict[str, tuple[JobConfig, int]] = {}
        if config.checkpoint_dir:
            self._restore_all()

    # -- jobs ------------------------------------------------------------------------------
    async def create_job(self, cfg: JobConfig | str, layout: Layout | None, chunks: list[Chunk]
                         ) -> tuple[bool, int, int]:
        """Declare (no layout), initialise (a name only: adopt the declared config) or both.

        Returns (created, version, epoch); an existing job with the same config and keys is not
        an error (every worker of a job may call this; the first one's values win).
        """
        name = cfg if isinstance(cfg, str) else cfg.name
        if name in self.ended:
            raise Conflict(f"job {name!r} has ended; its name cannot be reused (choose another)")
        existing = self.jobs.get(name)
        known = existing.config if existing is not None else self.declared.get(name)
        if isinstance(cfg, str):
            if known is None:
                raise UnknownJob(f"job {name!r} is not declared; create it with `hps job create {name}` "
                                 "or give the worker a JobConfig")
            cfg = known
        elif known is not None and known != cfg:
            raise Conflict(f"job {name!r} exists with another configuration ({_describe(known)}); "
                           f"this caller asked for {_describe(cfg)}")
        if existing is not None:
            if layout is not None and existing.layout != layout:
                raise Conflict(f"job {name!r} already exists with other parameters; choose another "
                               "name or end the old job")
            return False, existing.view.version, existing.view.epoch
        if layout is None:
            created = name not in self.declared
            self.declared[name] = cfg
            self._persist_declared(cfg)
            log.info("declared job %s: mode %s", name, cfg.mode)
            return created, 0, self.epoch
        values = assemble(layout, chunks, what=f"initial values of job {name!r}", require_all=True)
        js = self._install(cfg, layout, values, version=0)
        self.declared.pop(name, None)
        log.info("created job %s: %d keys, %d parameters, mode %s", name, len(layout.specs),
                 layout.numel, cfg.mode)
        self._checkpoint(js)
        return True, 0, self.epoch

    def list_jobs(self) -> list[dict]:
        out = [dict(config=cfg, state="declared", version=0, members=0, parameters=0)
               for cfg in self.declared.values()]
        out += [dict(config=js.config, state="running", version=js.view.version, members=len(js.members),
                     parameters=js.layout.numel) for js in self.jobs.values()]
        out += [dict(config=cfg, state="ended", version=v, members=0, parameters=0)
                for cfg, v in self.ended_configs.values()]
        return out

    async def end_job(self, name: str) -> int:
        if name in self.declared:
            cfg, version = self.declared.pop(name), 0
        else:
            js = self.job(name)
            cfg, version = js.config, js.view.version
            self._checkpoint(js)
            js.abort(f"job {name!r} was ended")
            del self.jobs[name]
        self.ended[name] = version
        self.ended_configs[name] = (cfg, version)
        if self.config.checkpoint_dir:
            Path(self._job_dir(name)).mkdir(parents=True, exist_ok=True)
            _write_atomic(Path(self._job_dir(name)) / "ENDED", json.dumps(dict(version=version)))
        log.info("ended job %s at version %d", name, version)
        return version

    def _persist_declared(self, cfg: JobConfig) -> None:
        if self.config.checkpoint_dir:
            Path(self._job_dir(cfg.name)).mkdir(parents=True, exist_ok=True)
            _write_atomic(Path(self._job_dir(cfg.name)) / "declared.json", json.dumps(dataclasses.asdict(cfg)))

    def _install(self, cfg: JobConfig, layout: Layout, values: np.ndarray, version: int,
                 view_values: np.ndarray | None = None) -> JobState:
        js = JobState(cfg, layout)
        js.params = np.array(values, dtype=np.float32, copy=True)
        opt = cfg.optimizer
        if cfg.momentum_correction:  # the workers hold the momentum (DGC); it must not apply twice
            opt = dataclasses.replace(opt, momentum=0.0)
        js.optimizer = ServerOptimizer(opt, js.params)
        view = js.params.copy() if view_values is None else np.array(view_values, np.float32)
        js.view.load_snapshot(self.epoch, version, view, checksum(view))
        js.wal = WriteAheadLog(self._job_dir(cfg.name)) if self.config.checkpoint_dir else None
        js.reset_round(version, "job installed")
        self.jobs[cfg.name] = js
        return js

    def _job_dir(self, job: str) -> str:
        return f"{self.config.checkpoint_dir}/{job}"

    # -- rounds ----------------------------------------------------------------------------
    def _finish_round(self, js: JobState, agg: Aggregate, floor: int, fut: asyncio.Future) -> None:
        # Average over contributors: the same gradient as one process on the concatenated
        # batch when each worker's loss is a mean (invariant 2).
        # In place: the closed batch's sum is this round's own buffer (a fresh 400 MB array per
        # round measured 9% of a large model's push at the root).
        grad = np.divide(agg.grad, np.float32(agg.contributors), out=agg.grad) if agg.contributors > 0 else None
        scale = 1.0
        if grad is not None:
            staleness = max(0, js.view.version - agg.round)  # versions since its oldest base
            js.stats.staleness(staleness)
            if js.config.damping:
                scale = 1.0 / (1.0 + staleness)
            if not js.bsp:
                # Learning rate per sample, as in bsp: an update carrying c of the N live
                # workers' gradients moves c/N of a bsp step. Unscaled, every small window was a
                # full step: modes.py measured ssp(2) +57% and async +90% validation loss against
                # bsp; scaled, +15% and +37% (3 runs each, demo model, one worker 2x slower).
                # Never more than one step: a fast sender that summed many queued gradients into
                # one push would otherwise take an Adam step many times lr (measured: diverged).
                scale *= min(1.0, agg.contributors / js.members.workers())
        rec = WalRecord(js.view.version + 1, agg.contributors, floor, grad, scale)
        task = asyncio.ensure_future(self._apply_durably(js, rec, fut))
        self._ckpt_tasks.add(task)
        task.add_done_callback(self._ckpt_tasks.discard)

    async def _apply_durably(self, js: JobState, rec: WalRecord, fut: asyncio.Future) -> None:
        try:
            if js.wal is not None:  # durable before applied and acknowledged
                await asyncio.to_thread(js.wal.append, rec)
            self._apply(js, rec)
        except Exception as exc:  # never leave pushers hanging on a failed apply
            log.exception("applying version %d of job %s failed", rec.version, js.config.name)
            if not fut.done():
                fut.set_exception(exc)
            return
        fut.set_result(Ack(js.view.version, js.view.epoch))
        if js.view.version % self.config.checkpoint_every == 0:
            self._checkpoint(js)

    def _apply(self, js: JobState, rec: WalRecord) -> None:
        if rec.grad is not None:
            js.optimizer.step(rec.grad, rec.scale)
        self._publish(js, rec.clock_min, rec.contributors)

    def _publish(self, js: JobState, clock_min: int, contributors: int) -> None:
        # No separate residual: params - view is exactly what earlier deltas did not carry.
        # Into buffers the job keeps: fresh 400 MB arrays for the difference, the decoded delta
        # and the new view measured ~40% of a 100M-parameter push at the root (py-spy).
        cfg = js.config
        codec = get_codec(cfg.delta_codec, k=cfg.topk) if cfg.delta_codec == "topk" else get_codec(cfg.delta_codec)
        if js.scratch is None:
            js.scratch = np.empty_like(js.params)
        diff = np.subtract(js.params, js.view.values, out=js.scratch)
        chunks = split(js.layout, diff, codec)  # the payloads are copies: scratch is free again
        # A lossless codec decodes to exactly ``diff``: no need to decode what was just encoded.
        decoded = diff if codec.lossless else assemble(js.layout, chunks, what="published delta",
                                                       check_finite=False)
        # The view is the root's own array (pulls are served from encoded chunks, checkpoints
        # copy it), so it is updated in place.
        new = np.add(js.view.values, decoded, out=js.view.values)
        crc = checksum(new)
        version = js.view.version + 1
        js.view.version, js.view.checksum = version, crc
        js.view.clock_min = max(js.view.clock_min, clock_min)
        js.reported_floor = js.view.clock_min
        js.log.append(DeltaEntry(version, crc, tuple(chunks), js.view.clock_min, contributors))
        js.notify()

    # -- checkpoints -----------------------------------------------------------------------
    def _checkpoint(self, js: JobState) -> None:
        if not self.config.checkpoint_dir:
            return
        arrays = {"params": js.params.copy(), "view": js.view.values.copy()}
        for k, v in js.optimizer.state_dict().items():
            if isinstance(v, np.ndarray):
                arrays[f"opt.{k}"] = v
        meta = dict(version=js.view.version, checksum=js.view.checksum, steps=js.optimizer.steps,
                    clock_min=js.view.clock_min,
                    config=dataclasses.asdict(js.config),
                    keys=[[s.key, list(s.shape), s.dtype] for s in js.layout])
        version, wal = js.view.version, js.wal
        # Records after this checkpoint go to a new segment; the old ones are deleted once
        # the checkpoint is durable (if it fails, replay still has everything).
        wal.rotate(version + 1)

        def write() -> None:
            checkpoint.save(self._job_dir(js.config.name), version, arrays, meta, self.config.checkpoint_keep)
            wal.drop_upto(version)

        task = asyncio.ensure_future(asyncio.to_thread(write))
        self._ckpt_tasks.add(task)
        task.add_done_callback(self._ckpt_done)

    def _ckpt_done(self, task: asyncio.Task) -> None:
        self._ckpt_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("checkpoint failed (the write-ahead log still covers it): %s", task.exception())

    def _restore_all(self) -> None:
        for d in sorted(Path(self.config.checkpoint_dir).glob("*/")):
            if (d / "ENDED").exists():
                version = json.loads((d / "ENDED").read_text())["version"]
                self.ended[d.name] = version
                if (d / "declared.json").exists():
                    self.ended_configs[d.name] = (_config(json.loads((d / "declared.json").read_text())), version)
                continue
            loaded = checkpoint.load_latest(d)
            if loaded is None:
                if (d / "declared.json").exists():
                    cfg = _config(json.loads((d / "declared.json").read_text()))
                    self.declared[cfg.name] = cfg
                continue
            arrays, meta = loaded
            cfg = _config(meta["config"])
            layout = Layout([KeySpec(k, tuple(s), dt) for k, s, dt in meta["keys"]])
            js = self._install(cfg, layout, arrays["params"], meta["version"], arrays["view"])
            state = {k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}
            js.optimizer.load_state_dict({"steps": meta["steps"], **state})
            js.view.clock_min = js.reported_floor = meta.get("clock_min", 0)
            replayed = 0
            for rec in js.wal.records(after=js.view.version):
                if rec.version != js.view.version + 1:
                    log.error("write-ahead log of %s skips from %d to %d; stopping replay there",
                              cfg.name, js.view.version, rec.version)
                    break
                self._apply(js, rec)
                replayed += 1
            js.reset_round(js.view.version, "restored")
            js.wal.rotate(js.view.version + 1)
            log.info("restored job %s: checkpoint version %d + %d replayed from the write-ahead log "
                     "= version %d, checksum %#010x", cfg.name, meta["version"], replayed,
                     js.view.version, js.view.checksum)

    async def stop(self) -> None:
        for js in self.jobs.values():
            self._checkpoint(js)
        while self._ckpt_tasks:  # in-flight applies and checkpoints finish first
            await asyncio.gather(*list(self._ckpt_tasks), return_exceptions=True)
        for js in self.jobs.values():
            if js.wal is not None:
                js.wal.close()
        await super().stop()


def _config(c: dict) -> JobConfig:
    return JobConfig(**{**c, "optimizer": OptimizerConfig(**c["optimizer"])})


def _describe(cfg: JobConfig) -> str:
    o = cfg.optimizer
    return (f"mode {cfg.mode}" + (f"({cfg.staleness})" if cfg.mode == "ssp" else "") +
            f", {o.kind} lr {o.lr:g}, push codec {cfg.push_codec}")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
