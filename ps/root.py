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
import logging

import numpy as np

from ps import checkpoint
from ps.codecs import get_codec
from ps.config import JobConfig, OptimizerConfig, ServerConfig
from ps.consistency import Aggregate
from ps.deltas import DeltaEntry
from ps.errors import Conflict
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
        if config.checkpoint_dir:
            self._restore_all()

    # -- jobs ------------------------------------------------------------------------------
    async def create_job(self, cfg: JobConfig, layout: Layout, chunks: list[Chunk]) -> tuple[bool, int, int]:
        existing = self.jobs.get(cfg.name)
        if existing is not None:
            if existing.layout != layout:
                raise Conflict(f"job {cfg.name!r} already exists with other parameters; choose "
                               "another name or end the old job")
            return False, existing.view.version, existing.view.epoch
        values = assemble(layout, chunks, what=f"initial values of job {cfg.name!r}", require_all=True)
        js = self._install(cfg, layout, values, version=0)
        log.info("created job %s: %d keys, %d parameters, mode %s", cfg.name, len(layout.specs),
                 layout.numel, cfg.mode)
        self._checkpoint(js)
        return True, 0, self.epoch

    def _install(self, cfg: JobConfig, layout: Layout, values: np.ndarray, version: int,
                 view_values: np.ndarray | None = None) -> JobState:
        js = JobState(cfg, layout)
        js.params = np.array(values, dtype=np.float32, copy=True)
        js.optimizer = ServerOptimizer(cfg.optimizer, js.params)
        view = js.params.copy() if view_values is None else np.array(view_values, np.float32)
        js.view.load_snapshot(self.epoch, version, view, checksum(view))
        js.wal = WriteAheadLog(self._job_dir(cfg.name)) if self.config.checkpoint_dir else None
        js.reset_round(version, "job installed")
        self.jobs[cfg.name] = js
        return js

    def _job_dir(self, job: str) -> str:
        return f"{self.config.checkpoint_dir}/{job}"

    # -- rounds ----------------------------------------------------------------------------
    def _finish_round(self, js: JobState, agg: Aggregate, fut: asyncio.Future) -> None:
        # Average over contributors: the same gradient as one process on the concatenated
        # batch when each worker's loss is a mean (invariant 2).
        grad = agg.grad / np.float32(agg.contributors) if agg.contributors > 0 else None
        rec = WalRecord(js.view.version + 1, agg.contributors, agg.clock_min, grad)
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
            js.optimizer.step(rec.grad)
        self._publish(js, rec.clock_min, rec.contributors)

    def _publish(self, js: JobState, clock_min: int, contributors: int) -> None:
        codec = get_codec(js.config.delta_codec)
        chunks = split(js.layout, js.params - js.view.values, codec)
        decoded = assemble(js.layout, chunks, what="published delta", check_finite=False)
        new = js.view.values + decoded
        crc = checksum(new)
        version = js.view.version + 1
        js.view.values, js.view.version, js.view.checksum = new, version, crc
        js.log.append(DeltaEntry(version, crc, tuple(chunks), clock_min, contributors))
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
        from pathlib import Path

        for d in sorted(Path(self.config.checkpoint_dir).glob("*/")):
            loaded = checkpoint.load_latest(d)
            if loaded is None:
                continue
            arrays, meta = loaded
            c = dict(meta["config"])
            cfg = JobConfig(**{**c, "optimizer": OptimizerConfig(**c["optimizer"])})
            layout = Layout([KeySpec(k, tuple(s), dt) for k, s, dt in meta["keys"]])
            js = self._install(cfg, layout, arrays["params"], meta["version"], arrays["view"])
            state = {k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}
            js.optimizer.load_state_dict({"steps": meta["steps"], **state})
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
