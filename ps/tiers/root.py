"""The global root: authoritative parameters, the optimizer, the published view, checkpoints
(its job directories on disk -- declarations, rosters, checkpoints, the restore at start --
are ``ps.tiers.durable``).

>>> import shutil, tempfile
>>> from ps.core.types import PushMeta
>>> from ps.core.view import KeySpec
>>> d, layout = tempfile.mkdtemp(), Layout([KeySpec("w", (3,))])
>>> async def one_step():
...     root = Root(ServerConfig(role="global", checkpoint_dir=d))   # a server: /var/lib/hps
...     await root.start()
...     await root.create_job(JobConfig(name="lm"), layout, np.zeros(3, np.float32))  # initial values
...     await root.register("lm", "w0", "worker", "", last_seq=0, incarnation=0x5eed)
...     meta = PushMeta("lm", "w0", seq=1, base_version=0, incarnation=0x5eed)
...     ack = await root.push(meta, split(layout, np.ones(3, np.float32), get_codec("fp32")), bytes(16))
...     await root.stop()                        # writes a final checkpoint
...     return ack.applied_version
>>> asyncio.run(one_step())                      # one member (BSP): its push closes the round
1
>>> job = Root(ServerConfig(role="global", checkpoint_dir=d)).job("lm")   # a restart recovers it
>>> job.view.version, job.view.values            # sgd, lr 0.01
(1, array([-0.01, -0.01, -0.01], dtype=float32))
>>> shutil.rmtree(d)

A closed round becomes one optimizer step on the averaged sum, then a new published version:
d_v = encode(params_v - view_{v-1}); view_v = view_{v-1} + decode(d_v). Whatever the codec
drops stays in params - view and goes out with the next delta (error feedback, invariant 6).

A version is applied whole or not at all (invariants 7, 8): the optimizer steps, its output
is checked (finite), the record is made durable in the write-ahead log, and only then is the
version published and acknowledged. If the output is not finite or the write fails, the job
goes back to version v exactly (from its checkpoint and log, or an in-memory copy when it
keeps none), the round's pushers hear why, and the round opens again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, ServerConfig, check_name
from ps.core.consistency import Aggregate, Gradient
from ps.core.deltas import DeltaEntry
from ps.core.errors import BadInput, Conflict, Exhausted, HpsError, Stale, Unavailable, UnknownJob, short
from ps.core.exactly_once import decode_applied, encode_applied
from ps.core.leases import Dataset, Grant, check_epoch
from ps.core.logs import event
from ps.core.nesterov import DelayedNesterov
from ps.core.optim import ServerOptimizer, warm_up
from ps.core.ranks import RankInfo
from ps.core.sharding import ShardPlan
from ps.core.tensors import Pieces, all_finite, assemble, split
from ps.core.types import Ack, LogMessage, PushKey, PushMeta, StepInfo, TierStatus
from ps.core.view import Layout, checksum, normalized
from ps.net.tls import TlsFiles
from ps.net.wire import framed
from ps.tiers import checkpoint
from ps.tiers.durable import Durable, config_from_json
from ps.tiers.jobstate import RootJob
from ps.tiers.pairing import Pairing
from ps.tiers.replication import Replication
from ps.tiers.standby import Standby, read_role
from ps.tiers.tier import APPLIED, NOT_APPLIED, UNKNOWN, Tier
from ps.tiers.wal import WalRecord, WalWriteError, WriteAheadLog

__all__ = ["Root"]

log = logging.getLogger("hps.root")


class TokenStore(Protocol):
    """Where a root keeps its jobs' token hashes (``ps.server.auth.Guard``): its standby must
    hold them too, or a takeover refuses every job's token (and relays treat jobs as open)."""

    def hashes(self) -> dict[str, bytes]: ...
    def set_hash(self, job: str, h: bytes) -> None: ...
    def replace(self, hashes: dict[str, bytes]) -> None: ...


def _averaged(grad: Gradient, contributors: int) -> np.ndarray:
    """A closed batch's sum over its ``contributors``, in the batch's own memory (a fresh 400
    MB array per round measured 9% of a large model's push at the root); one push still in
    pieces is laid out and divided in the same pass, and x / 1 is x, bit for bit: no pass."""
    if isinstance(grad, Pieces):
        return grad.dense(None if contributors == 1 else contributors)
    if contributors == 1:
        return grad
    return np.divide(grad, np.float32(contributors), out=grad)


class Root(Durable, Pairing, Tier):
    role = "global"
    above_inner_loops = True  # an outer job's regions sync with this root (not so a region's own root)

    def __init__(self, config: ServerConfig, **kw) -> None:
        super().__init__(config, **kw)
        # One root per checkpoint directory: refused before anything in it is read or written.
        self._dir_lock = checkpoint.hold(config.checkpoint_dir) if config.checkpoint_dir else None
        if config.checkpoint_dir and (swept := checkpoint.sweep_temporary(config.checkpoint_dir)):
            log.warning("%s: deleted %d temporary file(s) writes that never finished left in %s (a crash "
                        "mid-write)", self.role, swept, config.checkpoint_dir)
        warm_up()  # here, not on the event loop at the first job: a stall a standby would read as death
        self._ckpt_tasks: set[asyncio.Task] = set()
        self.declared: dict[str, JobConfig] = {}   # configured, waiting for parameters
        self.declared_at: dict[str, float] = {}
        self.ended_configs: dict[str, tuple[JobConfig, int]] = {}
        self.damaged: dict[str, str] = {}  # jobs whose log could not be replayed: why
        # A hot-standby pair (ps.tiers.standby, ps.tiers.replication): this root's state
        # ("primary", "standby", "fenced"), its durable term and role, its peer root.
        self.peer = config.standby_of or config.standby
        self.tokens: TokenStore | None = None  # set by the server when tokens are on
        self._stopping = False
        self.tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_ca) if config.secure else None
        self.role_state = (read_role(config.checkpoint_dir, "standby" if config.standby_of else "primary")
                           if config.checkpoint_dir else dict(term=0, state="primary", synced=False, sync=False))
        self.term = self.role_state["term"]
        self.state = "primary" if not self.peer else "starting"
        self.replication = Replication(config.lease_s, required=bool(self.peer) and self.role_state["sync"])
        self.standby: Standby | None = None
        self._standby_task: asyncio.Task | None = None
        self._token = ""
        self.address = ""
        if config.admin_token_file:
            self._token = Path(config.admin_token_file).read_text().strip().splitlines()[0].strip()
        if config.checkpoint_dir:
            self._restore_all()

    # -- primary and standby (ps.tiers.pairing): what a standby takes from its primary -------
    def follow_declared(self, c: dict) -> None:
        cfg = config_from_json(c)
        self.declared[cfg.name] = cfg
        self.declared_at[cfg.name] = self.clock()
        self._persist_declared(cfg)

    def follow_ended(self, name: str, info: dict) -> None:
        version = info["version"]
        self.ended[name] = version
        if info.get("config"):
            cfg = config_from_json(info["config"])
            self.ended_configs[name] = (cfg, version)
            self._persist_declared(cfg)
        Path(self._job_dir(name)).mkdir(parents=True, exist_ok=True)
        checkpoint.write_atomic(Path(self._job_dir(name)) / "ENDED",
                                json.dumps(dict(version=version, why=info.get("why", ""))))

    def set_address(self, address: str) -> None:
        self.address = address

    def open_push(self, meta: PushMeta):
        self.writable()
        return super().open_push(meta)

    async def _job_for_register(self, job: str) -> RootJob:
        self.writable()
        js = self.job(job)
        # Nobody joins a job a crash could still forget (its first checkpoint not on disk yet).
        await self._created_durably(js)
        return js

    def _may_read(self, js, member: str) -> bool:
        return self.state != "primary" or super()._may_read(js, member)  # a standby serves reads

    def status(self) -> TierStatus:
        st = super().status()
        return dataclasses.replace(st, term=self.term, root_state=self.state,
                                   parent=self.peer if self.state == "standby" else "",
                                   parent_reachable=self.state != "standby"
                                   or bool(self.standby and self.standby.connected))

    def job(self, name: str) -> RootJob:
        if name in self.damaged:
            raise Unavailable(f"job {short(name)} is not served: {self.damaged[name]}")
        return super().job(name)

    # -- jobs ------------------------------------------------------------------------------
    async def create_job(self, cfg: JobConfig | str, layout: Layout | None, values: np.ndarray | None
                         ) -> tuple[bool, int, int]:
        """Declare (no layout), initialise (a name only: adopt the declared config) or both.

        Returns (created, version, epoch); an existing job with the same config and keys is not
        an error (every worker of a job may call this; the first one's values win). ``values``:
        the initial parameters, every element checked (``check_create`` ran before they came).
        """
        self.writable()
        head = self.check_create(cfg, layout)
        if head is None:
            name = cfg if isinstance(cfg, str) else cfg.name
            await self.replication.held(name)  # the first creator's try may not have been acknowledged
            js = self.job(name)
            await self._created_durably(js)  # ... nor its first checkpoint written
            return False, js.view.version, js.view.epoch
        cfg, created = head
        if layout is None:
            self.declared[cfg.name] = cfg
            self.declared_at[cfg.name] = self.clock()
            self._persist_declared(cfg)
            await self.replication.confirm(LogMessage("declared", job=cfg.name,
                                                      data=json.dumps(dataclasses.asdict(cfg)).encode()))
            log.info("declared job %s: mode %s", cfg.name, cfg.mode, extra=event("job.declared", job=cfg.name))
            return created, 0, self.epoch
        if values is None or values.shape != (layout.numel,):
            raise BadInput(f"job {cfg.name!r} needs initial values for its {layout.numel} parameters")
        js = self._install(cfg, layout, values, version=0)
        js.created_durably = False
        self.declared.pop(cfg.name, None)
        self.declared_at.pop(cfg.name, None)
        log.info("created job %s: %d keys, %d parameters, mode %s", cfg.name, len(layout.specs),
                 layout.numel, cfg.mode, extra=event("job.created", job=cfg.name, version=0))
        js.first_checkpoint = self._checkpoint(js)
        if self.replication.follower is not None or self.replication.required:
            arrays, meta = self._ckpt_state(js)
            # Waited for where a standby is required: a takeover must not forget a job its first
            # worker was told exists. Not rolled back if it fails: the caller retries, and the
            # retry is answered only once a standby holds the job (``Replication.held``; one
            # that reconnects gets it in its bootstrap), so no caller learns of it before.
            await self.replication.confirm(LogMessage("state", job=cfg.name, version=0,
                                                      data=checkpoint.to_bytes(arrays, meta)))
        # Not rolled back if it fails either: a retry of the creation (or the first round)
        # writes it again, and nothing of the job is acknowledged before it is on disk.
        await self._created_durably(js)
        return True, 0, self.epoch

    async def keep_token(self, job: str, h: bytes) -> None:
        """A job token's hash, minted for the admin who created the job, kept here and on the
        standby before the token is handed out (Unavailable if a required standby does not
        acknowledge it; the hash is then dropped here, and a retry mints another). Kept here
        first, as a job's state is: a standby that attaches meanwhile gets it in its bootstrap,
        whose snapshot of the hashes replaces what it held."""
        self.writable()
        if self.tokens is not None:
            self.tokens.set_hash(job, h)
        try:
            await self.replication.confirm(LogMessage("token", job=job, data=h))
        except BaseException:
            if self.tokens is not None:
                self.tokens.set_hash(job, b"")
            raise

    def check_create(self, cfg: JobConfig | str, layout: Layout | None) -> tuple[JobConfig, bool] | None:
        """Everything a CreateJob can be refused for, checked before its values arrive. None: the
        job exists as asked (nothing to do); else the config to use and whether it is new."""
        name = check_name(cfg if isinstance(cfg, str) else cfg.name)
        if name in self.ended:
            raise Conflict(f"job {name!r} has ended; its name cannot be reused (choose another)")
        if name in self.damaged:
            raise Unavailable(f"job {name!r} is not served: {self.damaged[name]}")
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
        self._check_shard(cfg, layout)
        if existing is not None:
            if layout is not None and existing.layout != layout:
                raise Conflict(f"job {name!r} already exists with other parameters; choose another "
                               "name or end the old job")
            return None
        if layout is not None and layout.numel > self.config.max_job_params:
            raise BadInput(f"job {name!r} has {layout.numel} parameters; this root holds jobs of at most "
                           f"{self.config.max_job_params} (--max-job-params)")
        if name not in self.declared and len(self.jobs) + len(self.declared) >= self.config.max_jobs:
            raise Exhausted(f"this root holds {self.config.max_jobs} jobs already (--max-jobs); end one first")
        return cfg, name not in self.declared

    def _check_shard(self, cfg: JobConfig, layout: Layout | None) -> None:
        """A root shard serves the blocks the ring places on it, of jobs sharded over as many
        roots as it was started among; an unsharded root serves no sharded job."""
        n, i = self.config.shard_count, self.config.shard_index
        if cfg.sharding is None:
            if n:
                raise BadInput(f"this root is shard {i}/{n}: it serves jobs sharded over {n} roots only "
                               f"(JobConfig.sharding with {n} weights); job {cfg.name!r} is not sharded")
            return
        if not n:
            raise BadInput(f"job {cfg.name!r} is sharded over {cfg.sharding.shards} roots; this root is not a "
                           "shard (start each with --shard I/N)")
        if cfg.sharding.shards != n:
            raise BadInput(f"job {cfg.name!r} is sharded over {cfg.sharding.shards} roots; this root is "
                           f"shard {i}/{n}")
        if layout is not None and ShardPlan.of(cfg).shard_layout(i) != layout:
            raise BadInput(f"the keys sent to shard {i}/{n} are not the blocks the ring places there "
                           "(are the worker's shard addresses in shard order?)")

    async def list_jobs(self) -> list[dict]:
        out = [dict(config=cfg, state="declared", version=0, members=0, parameters=0)
               for cfg in self.declared.values()]
        out += [dict(config=js.config, state="running", version=js.view.version, members=len(js.members),
                     parameters=js.layout.numel) for js in self.jobs.values()]
        out += [dict(config=cfg, state="ended", version=v, members=0, parameters=0)
                for cfg, v in self.ended_configs.values()]
        return out

    async def end_job(self, name: str, why: str = "") -> int:
        self.writable()
        if name in self.declared:
            cfg = self.declared.pop(name)
            self.declared_at.pop(name, None)
            return await self._mark_ended(name, cfg, 0, why)
        js = self.job(name)
        if js.ending_task is None:  # else another call is ending it: the same answer, once it has
            # A round that closes from now on applies nothing (_apply_durably): the version
            # checkpointed and reported is the job's last, in memory and on disk.
            js.ending = f"job {name!r} was ended" + (f" ({why})" if why else "")
            js.ending_task = asyncio.create_task(self._end_running(js, why), name=f"end-{name}")
            self._tasks.append(js.ending_task)
            js.ending_task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        # Shielded: a caller that gives up (its RPC's deadline) does not leave the job half ended
        # (refusing every round, never marked ended); the end goes on, and a retry waits for it.
        return await asyncio.shield(js.ending_task)

    async def _end_running(self, js: RootJob, why: str) -> int:
        name = js.config.name
        await self._quiesce(js)
        version = js.view.version
        # Waited for: an ended job is not restored from its log (ps.tiers.durable), so the
        # versions since its last checkpoint are on disk only once this one is. A job damaged
        # meanwhile (a round before the end failed past its log append) is not checkpointed: it
        # stays, to be restored by a restart, rather than ended without its logged versions.
        try:
            if name in self.damaged:
                raise Unavailable(f"it is not served: {self.damaged[name]}")
            task = self._checkpoint(js)
            if task is not None:
                await task
        except Exception as exc:
            js.ending_task = None  # a retry of the end writes it again; rounds stay refused
            raise Unavailable(f"job {short(name)} was not ended: its final checkpoint (version {version}) "
                              f"failed: {exc}; retry ending it (its rounds are refused meanwhile)") from exc
        js.abort(js.ending)
        del self.jobs[name]
        if js.wal is not None:
            js.wal.close()
        return await self._mark_ended(name, js.config, version, why)

    async def _mark_ended(self, name: str, cfg: JobConfig, version: int, why: str) -> int:
        self.ended[name] = version
        self.ended_configs[name] = (cfg, version)
        ended = LogMessage("ended", job=name, version=version, data=json.dumps(dict(
            version=version, why=why, config=dataclasses.asdict(cfg))).encode())
        if self.config.checkpoint_dir:
            Path(self._job_dir(name)).mkdir(parents=True, exist_ok=True)
            checkpoint.write_atomic(Path(self._job_dir(name)) / "ENDED", json.dumps(dict(version=version, why=why)))
        log.info("ended job %s at version %d%s", name, version, f" ({why})" if why else "",
                 extra=event("job.ended", job=name, version=version))
        await self.replication.confirm(ended)  # after the local end: a retry finds it ended
        return version

    async def _housekeeping(self, now: float) -> None:
        ttl = self.config.unjoined_job_ttl_s
        if not ttl or self.state != "primary":
            return
        def unjoined(name: str) -> bool:
            js = self.jobs.get(name)
            if js is not None:
                return not js.joined and now - js.created_at > ttl
            return now - self.declared_at.get(name, now) > ttl

        stale = [n for n in self.jobs if unjoined(n)] + [n for n in self.declared_at if unjoined(n)]
        for name in stale:
            # Asked again: ending the one before awaited, and meanwhile this one may have been
            # ended, created from its declaration, or joined.
            if not unjoined(name):
                continue
            try:
                await self.end_job(name, why=f"reaped: no worker joined within {ttl:.0f}s")
            except HpsError as exc:  # Unavailable: ended here; the standby gets it with its next bootstrap
                log.warning("reaping job %s: %s", name, exc)

    def _install(self, cfg: JobConfig, layout: Layout, values: np.ndarray, version: int,
                 view_values: np.ndarray | None = None, register: bool = True) -> RootJob:
        params = np.array(values, dtype=np.float32, copy=True)
        js = RootJob(cfg, layout, created_at=self.clock(), params=params, above_inner=self.above_inner_loops,
                     optimizer=self._optimizer(cfg, params, layout),
                     wal=WriteAheadLog(self._job_dir(cfg.name)) if self.config.checkpoint_dir else None)
        if any(s.kind == "frozen" for s in layout.specs):
            js.unfrozen = frozenset(s.key for s in layout.specs if s.kind != "frozen")
        view = normalized(params.copy() if view_values is None else np.array(view_values, np.float32))
        js.view.load_snapshot(self.epoch, version, view, checksum(view))
        js.reset_round(version, "job installed")
        if cfg.sharding is not None:
            js.stats.shard, js.stats.shard_blocks = self.config.shard, len(layout.specs)
            js.stats.shard_bytes = 4 * layout.numel
        if register:
            self.jobs[cfg.name] = js
        return js

    @staticmethod
    def _optimizer(cfg: JobConfig, params: np.ndarray, layout: Layout) -> ServerOptimizer:
        # An outer job's optimizer field is the regions' inner one; the root steps the outer one.
        opt = cfg.outer.optimizer if cfg.outer is not None else cfg.optimizer
        if cfg.momentum_correction:  # the workers hold the momentum (DGC); it must not apply twice
            opt = dataclasses.replace(opt, momentum=0.0)
        if cfg.outer is not None and cfg.outer.nesterov_delay:  # asynchronous outer steps
            return DelayedNesterov(opt, params, layout, delay=cfg.outer.nesterov_delay)
        return ServerOptimizer(opt, params, layout)

    # -- rounds ----------------------------------------------------------------------------
    def _finish_round(self, js: RootJob, agg: Aggregate, keys: tuple[PushKey, ...], floor: int,
                      fut: asyncio.Future) -> None:
        # Average over contributors: the same gradient as one process on the concatenated
        # batch when each worker's loss is a mean (invariant 2).
        grad = _averaged(agg.grad, agg.contributors) if agg.contributors > 0 else None
        scale = 1.0
        if grad is not None:
            staleness = max(0, js.view.version - agg.round)  # versions since its oldest base
            js.stats.staleness(staleness)
            # In clocks, the unit of the ssp bound: a worker computing clock c held a view with
            # floor >= c - s, and the floor only rises, so ssp(s) keeps this <= s (invariant 3).
            js.stats.clock_staleness(max(0, agg.clock_max - js.view.clock_min),
                                     js.config.staleness if js.config.mode == "ssp" else None)
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
        rec = WalRecord(js.view.version + 1, agg.contributors, floor, grad, scale, encode_applied(keys, agg.step))
        task = asyncio.ensure_future(self._apply_durably(js, agg, rec, keys, agg.step, fut))
        self._ckpt_tasks.add(task)
        task.add_done_callback(self._ckpt_tasks.discard)

    async def _apply_durably(self, js: RootJob, agg: Aggregate, rec: WalRecord,
                             keys: tuple[PushKey, ...], step: StepInfo, fut: asyncio.Future) -> None:
        try:
            self.writable()
            self.job(js.config.name)  # not served any more (damaged, ended): refused, not applied
            await self.replication.ready(js.config.name)  # a standby that holds the job, if required
            await self._created_durably(js)  # its first checkpoint on disk, or a crash forgets the job
        except HpsError as exc:
            self._refuse(js, agg, fut, exc)
            return
        async with js.apply_lock:
            if js.ending:  # end_job took the lock before this round: the job's last version is out
                self._refuse(js, agg, fut, UnknownJob(js.ending))
                return
            try:
                # Asked again under the lock: the version that held it may have left the job
                # damaged, or (a region's inner job) replaced by a new lineage meanwhile, and
                # this root may have been fenced (a standby took over) while the round waited.
                self.writable()
                if self.job(js.config.name) is not js:
                    raise Stale(f"job {short(js.config.name)} started again here (a new lineage) while this "
                                "round waited; nothing of it was applied: pull and compute again")
            except HpsError as exc:
                self._refuse(js, agg, fut, exc)
                return
            if js.wal is None:  # no log to roll back from: keep an in-memory copy of this step's start
                js.optimizer.save_point()
            replicated = False
            try:
                if rec.grad is not None:
                    js.optimizer.step(rec.grad, rec.scale, step, rec.contributors)
                    if not all_finite(js.params):
                        raise BadInput(f"the optimizer's step for version {rec.version} of job "
                                       f"{js.config.name} made parameters non-finite; nothing was "
                                       "applied. Lower the learning rate")
                # The standby holds it before this root's own log does: a deposed primary's log
                # never holds a version the new primary lacks (ps.tiers.replication).
                replicated = await self.replication.replicate(js.config.name, rec)
                if js.wal is not None:  # durable before published and acknowledged
                    await asyncio.to_thread(js.wal.append, rec)
            except Exception as exc:
                if replicated and self.replication.follower is not None:  # it holds what we rolled back
                    self.replication.detach(self.replication.follower, f"version {rec.version} was rolled back")
                try:
                    await self._roll_back(js)
                except Exception as failed:
                    # Its parameters hold the refused step under the published view: not served
                    # until a restart restores it from the disk (as a mismatch, ``_roll_back``).
                    # (Unless this root follows another primary now: the job is not this one.)
                    if self.jobs.get(js.config.name) is js:
                        self._damaged(js, f"rolling back version {rec.version} failed ({failed})", rec.version,
                                      exc_info=True)
                if isinstance(exc, WalWriteError):
                    js.stats.durable_failures += 1
                    log.error("job %s: %s; refusing the round until a write succeeds", js.config.name, exc,
                              extra=event("wal.write_failed", job=js.config.name, version=rec.version))
                    exc = Unavailable(f"the root could not make version {rec.version} of job "
                                      f"{js.config.name} durable ({exc}); nothing was applied; retry")
                elif not isinstance(exc, HpsError):
                    log.exception("applying version %d of job %s failed", rec.version, js.config.name)
                    exc = Unavailable(f"the root failed to apply version {rec.version} "
                                      f"({type(exc).__name__}); nothing was applied; retry")
                self._refuse(js, agg, fut, exc)
                return
            try:
                self._publish(js, rec.clock_min, rec.contributors, step.skip, self._published_keys(js, step))
                # With the version that applied their gradients: a sample counts as trained iff
                # its gradient was applied (replayed from the log by ``_apply``).
                self._trained(js, step.progress)
                doubles = self._record(js, js.view.version, keys, step.skip)
                if doubles:  # invariant 4 broken: loud, counted, never silent
                    js.stats.double_applied += doubles
                    log.critical("job %s: version %d applied %d worker push(es) an earlier version had "
                                 "applied already", js.config.name, js.view.version, doubles)
                await self._after_version(js, rec)
            except Exception as exc:
                # Logged (and replicated) but not all done (out of memory while framing the delta,
                # a bug): the parameters are one version past what the view or the books say, and
                # an unanswered round would hold the job's window forever. Not served until a
                # restart restores it from its checkpoint and log, which hold the version whole.
                if self.jobs.get(js.config.name) is js:
                    self._damaged(js, f"version {rec.version} was logged but publishing it failed "
                                      f"({type(exc).__name__}: {exc})", rec.version, exc_info=True)
                self._refuse(js, agg, fut, Unavailable(f"job {js.config.name}: version {rec.version} was logged "
                                                       f"but not published; {self._recovery(js)}; retry then"))
                return
            if not fut.done():
                fut.set_result(Ack(js.view.version, js.view.epoch, skipped=step.skip, pace=self._pace(js, keys, step)))
            if js.view.version % self.config.checkpoint_every == 0:
                self._checkpoint(js)

    def _drop_member(self, js: RootJob, member: str, why: str) -> None:
        js.pace.forget(member)  # a region that left no longer sets the others' H
        super()._drop_member(js, member, why)

    def _trained(self, js: RootJob, progress: tuple[tuple[int, int, int], ...]) -> None:
        """The leased data a version applied the gradients of (a region's own root: its inner
        versions' data, which counts once its syncs carried it to the root)."""
        js.leases.progress(progress, self.clock())

    def _pace(self, js: RootJob, keys: tuple[PushKey, ...], step: StepInfo) -> float:
        """An outer job with dynamic steps: note the inner step rate the applied pseudo-gradient
        reported (keyed by the regions that sent it) and answer the fastest rate heard lately."""
        oc = js.config.outer
        if oc is None or not oc.dynamic_steps:
            return 0.0
        now = self.clock()
        for k in keys:
            js.pace.heard(k.member, step.inner_rate, now)
        return js.pace.fastest(now)

    async def _after_version(self, js: RootJob, rec: WalRecord) -> None:
        """A version was published and is about to be acknowledged (the job's apply lock held):
        nothing more at the root; a region's inner loop syncs with the root here (ps.tiers.outer)."""

    async def _roll_back(self, js: RootJob) -> None:
        """Put the job's parameters and optimizer back to its published version, exactly."""
        if js.wal is None:
            js.optimizer.roll_back()
            return
        await self._quiesce(js, apply=False)
        if self.jobs.get(js.config.name) is not js:
            # This root went over to following another primary meanwhile (its jobs cleared, its
            # directories being rewritten from the new primary's state): nothing of this one is
            # served any more, and what the disk holds now is not its to judge.
            return
        fresh = self._load(Path(self._job_dir(js.config.name)), register=False)
        if fresh is None or (fresh.view.version, fresh.view.checksum) != (js.view.version, js.view.checksum):
            # The disk does not hold the published version: the log holds one this process never
            # published (an append whose failure could not be undone, a publication that failed
            # after it), or lacks one. Taking its parameters under the published view left the
            # job refusing every round (the next version's number was taken) with a state that
            # matched neither; a retry of the refused push could then apply its gradient twice.
            # Not served until a restart, which restores the job from what the disk holds.
            got = None if fresh is None else (fresh.view.version, hex(fresh.view.checksum))
            self._damaged(js, f"rolling back to its published version {js.view.version} from disk gave {got}",
                          js.view.version)
            return
        js.params, js.optimizer, js.scratch = fresh.params, fresh.optimizer, None
        log.warning("job %s: rolled back to version %d from its checkpoint and log", js.config.name,
                    js.view.version)

    def _damaged(self, js: RootJob, why: str, version: int, exc_info: bool = False) -> None:
        """Serve ``js`` no more: its state matches neither its view nor its log. Every call about
        it is refused with ``why`` and what brings it back (``_recovery``)."""
        name = js.config.name
        self.damaged[name] = f"{why}; {self._recovery(js)}"
        log.critical("job %s is not served: %s", name, self.damaged[name], exc_info=exc_info,
                     extra=event("job.damaged", job=name, version=version))

    def _recovery(self, js: RootJob) -> str:
        """What serves a damaged job again."""
        if js.wal is not None:
            return "restart the root: it restores the job from its checkpoint and log"
        return f"restart this {self.role} tier (it keeps no log to restore the job from)"

    def _apply(self, js: RootJob, rec: WalRecord) -> None:
        """Replay one logged version (restore): the same arithmetic as when it was made."""
        keys, step = decode_applied(rec.keys)
        if rec.grad is not None:
            js.optimizer.step(rec.grad, rec.scale, step, rec.contributors)
        self._publish(js, rec.clock_min, rec.contributors, step.skip, self._published_keys(js, step))
        js.leases.progress(step.progress, self.clock())
        self._record(js, rec.version, keys, step.skip)

    def _publish(self, js: RootJob, clock_min: int, contributors: int, skip: bool = False,
                 only: frozenset[str] | None = None) -> None:
        """Publish params - view as the next version's delta; ``only``: of these keys alone (the
        others' difference stays in params - view for a later version)."""
        # No separate residual: params - view is exactly what earlier deltas did not carry.
        # Into buffers the job keeps: fresh 400 MB arrays for the difference, the decoded delta
        # and the new view measured ~40% of a 100M-parameter push at the root (py-spy).
        cfg = js.config
        name = self._delta_codec(cfg)
        codec = get_codec(name, k=cfg.topk) if name == "topk" else get_codec(name)
        if js.scratch is None:
            js.scratch = np.empty_like(js.params)
        diff = np.subtract(js.params, js.view.values, out=js.scratch)
        if skip:  # a skipped step changes nothing, not even what earlier deltas left unsent
            diff.fill(0.0)
        # Framed here, once (fp32 payloads are views of scratch until then: one copy, not two);
        # every pull of this version then sends these very frames. Scratch is free again.
        chunks = framed(split(js.layout, diff, codec, only=only, copy=False))
        # The view is the root's own array (pulls are served from encoded chunks, checkpoints
        # copy it), so it is updated in place. Only the published keys can change: elsewhere a
        # replica adds +0.0, which leaves a view without -0.0 as it was (ps.core.view).
        view, spans = js.view.values, None if only is None else js.layout.spans(only)
        if codec.lossless:  # decodes to exactly ``diff``: no need to decode what was just encoded
            for a, b in [(0, view.size)] if spans is None else spans:
                np.add(view[a:b], diff[a:b], out=view[a:b])
        else:
            np.add(view, assemble(js.layout, chunks, what="published delta", check_finite=False), out=view)
        crc = js.view.rehash(spans)
        version = js.view.version + 1
        js.view.version = version
        js.view.clock_min = max(js.view.clock_min, clock_min)
        js.reported_floor = js.view.clock_min
        js.log.append(DeltaEntry(version, crc, tuple(chunks), js.view.clock_min, contributors))
        js.notify()

    @staticmethod
    def _published_keys(js: RootJob, step: StepInfo) -> frozenset[str] | None:
        """The keys a version's delta carries (None: all): never a frozen key (fixed at creation:
        its zeros in every delta were most of a fine-tune's bytes down, and every tier hashed
        them), and of an outer job only its fragment (its pseudo-gradient's keys; the others did
        not move). A dense int8 delta of the whole model for a quarter of it measured 4x the WAN
        bytes with four fragments (benchmarks/wan_loss.py)."""
        if js.config.outer is None or not step.absent:
            return js.unfrozen
        absent = set(step.absent)
        return frozenset(s.key for i, s in enumerate(js.layout.specs) if i not in absent and s.kind != "frozen")

    @staticmethod
    def _delta_codec(cfg: JobConfig) -> str:
        """The codec of the versions this root publishes (an outer job's: its outer one)."""
        return cfg.outer.delta_codec if cfg.outer is not None else cfg.delta_codec

    def _telemetry(self, js: RootJob, meta: PushMeta) -> bool:
        """Count the push's training report, and check the job's loss as the alert rule does
        (``ps.core.losswatch``): the root hears every worker, so it can say so in its log."""
        if not super()._telemetry(js, meta):
            return False
        if meta.loss_count:
            hit = js.loss_watch.add(meta.loss_sum, meta.loss_count, self.clock())
            if hit is not None:
                log.warning("job %s: the training loss rose for three reports in a row, to %.4g from %.4g, "
                            "while its step rate fell (as HpsTrainingLossRising; deploy/OPERATING.md)",
                            js.config.name, hit[0], hit[1],
                            extra=event("training.loss_rising", job=js.config.name, version=js.view.version,
                                        loss=hit[0], loss_before=hit[1]))
        return True

    @staticmethod
    def _record(js: RootJob, version: int, keys: tuple[PushKey, ...], skip: bool) -> int:
        """Record what ``version`` applied (``AppliedBook.add``), and whether it skipped its step:
        a push settled later by Resolve, or answered from the record, says so as its ack did. Not
        kept across a restart for the versions a checkpoint holds (those read as not skipped)."""
        if skip:
            js.skipped.add(version)
        if js.skipped and min(js.skipped) <= version - js.applied.horizon:
            js.skipped = {v for v in js.skipped if v > version - js.applied.horizon}
        return js.applied.add(version, keys)

    def _applied_already(self, js: RootJob, book, meta: PushMeta, digest: bytes,
                         keys: tuple[PushKey, ...]) -> Ack | None:
        """A push whose worker pushes this root applied already -- a retry whose sender or relay
        forgot it (a restart, a move, a forward given up on that a later path settled) -- is
        answered from the record, never placed again (invariant 4), whatever the tiers below
        remembered. One that sums applied pushes with others cannot be placed whole: Conflict;
        one of them applied with another body: Conflict (``AppliedBook.lookup``)."""
        if not keys:
            return None
        found = {js.applied.applied_at(k) for k in keys}
        if found == {None}:
            return None
        if None in found or len(found) > 1:
            raise Conflict(f"push {meta.seq} of {meta.sender!r} sums worker pushes of which some were applied "
                           f"already (versions {sorted(v for v in found if v is not None)}) and some not: it "
                           "cannot be placed whole")
        version = found.pop()
        ack = Ack(version, js.view.epoch, duplicate=True, skipped=version in js.skipped)
        book.accept(meta.seq, digest)
        book.settle(meta.seq, ack)
        js.stats.duplicates += 1
        log.warning("job %s: push %d of %r carries worker pushes applied already as version %d: answered "
                    "from the record, not applied again", js.config.name, meta.seq, meta.sender, version)
        return ack

    # -- resolve ---------------------------------------------------------------------------
    async def _resolve_here(self, js: RootJob, keys: tuple[PushKey, ...], wait_s: float
                            ) -> tuple[str, int, int, bool]:
        found = {js.applied.applied_at(k) for k in keys}
        if found == {None}:
            return NOT_APPLIED, 0, 0, False
        if None in found or len(found) > 1:
            log.warning("job %s: a push's worker gradients were applied in different versions %s (or some "
                        "never)", js.config.name, sorted(v for v in found if v is not None))
            return UNKNOWN, 0, 0, False
        version = found.pop()
        if js.applied.lookup(keys[0]) is None:  # applied before the horizon: never "not applied"
            log.warning("job %s: asked about %d push(es) (%s's number %d ...) applied before the versions "
                        "whose records the root keeps: answered as applied at or before version %d",
                        js.config.name, len(keys), keys[0].member, keys[0].seq, version,
                        extra=event("push.forgotten", job=js.config.name, member=keys[0].member, version=version))
        return APPLIED, version, js.view.epoch, version in js.skipped

    # -- ranks and leased data shards -------------------------------------------------------------
    async def _rank_here(self, js: RootJob, member: str, incarnation: int, requested: int | None,
                         release: bool) -> RankInfo:
        self.writable()
        if release:
            freed = js.ranks.release(member, incarnation)
            # An outer job's worker may leave with trained data its region has not synced yet:
            # its shards stay leased until that arrives (or the lease expires), or another
            # worker would be handed them from the root's older offset and train them again.
            leases = js.leases.release(member, incarnation) if js.config.outer is None else 0
            if freed or leases:
                log.info("job %s: worker %r left cleanly: rank freed %s, %d shard lease(s) back",
                         js.config.name, member, freed, leases,
                         extra=event("rank.released", job=js.config.name, member=member))
        else:
            had = js.ranks.info(member).rank
            rank = js.ranks.take(member, incarnation, requested)
            if rank != had:
                log.info("job %s: worker %r holds rank %d", js.config.name, member, rank,
                         extra=event("rank.assigned", job=js.config.name, member=member, rank=rank))
        await self._save_roster(js)  # durable before answered: a restart gives the same ranks
        return js.ranks.info(member, js.config.min_workers)

    async def _lease_here(self, js: RootJob, member: str, incarnation: int, dataset: Dataset, epoch: int,
                          want: bool, held: tuple[tuple[int, int], ...]) -> Grant:
        self.writable()
        check_epoch(epoch)  # before the declaration: a refused call declares nothing (it was not saved)
        if js.leases.declare(dataset):
            log.info("job %s: dataset declared by %r: %d samples in %d shards of %d", js.config.name, member,
                     dataset.length, dataset.shards, dataset.shard_size,
                     extra=event("data.declared", job=js.config.name, member=member))
        now = self.clock()
        for e, s, holder in js.leases.expire(now):
            log.warning("job %s: the lease of shard %d of epoch %d expired (%r silent for %.0fs); it goes to "
                        "the next worker from its trained offset", js.config.name, s, e, holder,
                        dataset.lease_timeout_s,
                        extra=event("lease.expired", job=js.config.name, member=holder, epoch=e, shard=s))
        grant = js.leases.lease(member, incarnation, epoch, now, want, held)
        await self._save_roster(js)
        return grant

    async def stop(self) -> None:
        self._stopping = True
        if self.replication.follower is not None:
            self.replication.detach(self.replication.follower, "the primary is stopping")
        if self._standby_task is not None:
            self._standby_task.cancel()
        while self._ckpt_tasks:  # in-flight applies and checkpoints finish first
            await asyncio.gather(*list(self._ckpt_tasks), return_exceptions=True)
        for js in self.jobs.values():
            self._checkpoint(js)
        while self._ckpt_tasks:
            await asyncio.gather(*list(self._ckpt_tasks), return_exceptions=True)
        for js in self.jobs.values():
            if js.wal is not None:
                js.wal.close()
        await super().stop()
        if self._dir_lock is not None:
            self._dir_lock.close()  # another root may take the directory now
            self._dir_lock = None


def _describe(cfg: JobConfig) -> str:
    o = cfg.optimizer
    text = (f"mode {cfg.mode}" + (f"({cfg.staleness})" if cfg.mode == "ssp" else "") +
            f", {o.kind} lr {o.lr:g}, push codec {cfg.push_codec}")
    if cfg.outer is not None:
        c = cfg.outer
        text += (f"; outer {c.optimizer.kind} lr {c.optimizer.lr:g} every {c.inner_steps} inner steps "
                 f"in {c.fragments} fragment(s), {c.codec} pseudo-gradients, inner loop at the {c.inner_tier} tier"
                 + (", overlapped" if c.overlap else "")
                 + (", asynchronous (each region's as it comes)" if c.asynchronous else "")
                 + (f", delayed Nesterov every {c.nesterov_delay}" if c.nesterov_delay else "")
                 + (", dynamic inner steps" if c.dynamic_steps else "")
                 + (f", regions train on after {c.sync_wait_s:g}s without a sync" if c.sync_wait_s else ""))
    return text
