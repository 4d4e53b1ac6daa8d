"""The integration a PyTorch script expects: a ``torch.optim.Optimizer`` that trains through hps.

>>> model = torch.nn.Linear(4, 1)
>>> opt = HpsOptimizer(model, address, JobConfig(name="mlp"), worker_id="w0")
>>> isinstance(opt, torch.optim.Optimizer), opt.rank, opt.world_size
(True, 0, 1)
>>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
>>> for x, y in [(torch.ones(8, 4), torch.zeros(8, 1))] * 3:
...     opt.zero_grad()
...     torch.nn.functional.mse_loss(model(x), y).backward()
...     result = opt.step()   # push gradients, wait for the round, bring parameters back
...     sched.step()          # the new lr travels with the next push; the root applies it
>>> result.version, result.applied, opt.param_groups[0]["lr"]
(3, True, 0.005)
>>> opt.close()

The job's param groups (``OptimizerConfig.groups``) appear as ``param_groups``; an
``lr_scheduler`` or a hand-written ``group["lr"] = ...`` changes what the root applies for the
version the next push makes (in bsp the round's workers must agree). The root holds the
optimizer's state and runs the job's torch optimizer on the averaged gradient.

The model's parameters, frozen parameters and buffers are overwritten with the published view
on construction (every worker starts from the same values); parameters after every step,
buffers after each step that averages them (``JobConfig.buffer_sync_every``). Gradients are
gathered on the model's device into one flat vector; the job's push codec compresses it there
(top-k selects, int8 quantises on the GPU), so only the compressed payload crosses to the
host. A parameter whose ``.grad`` is None is not updated (torch's semantics), and AMP's
``GradScaler`` works unchanged: a round in which any worker overflowed is skipped by every
worker, and every worker's scaler backs off.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ps.core.config import JobConfig
from ps.core.errors import BadInput, Conflict, Stale, TimedOut, UnknownJob
from ps.core.exactly_once import MAX_IN_FLIGHT
from ps.core.optim import flat_hparams, group_defaults, group_index
from ps.core.types import StepInfo, furthest
from ps.core.view import KeySpec, Layout
from ps.net.tls import TlsFiles
from worker.client import ParameterClient, StepResult, env_int
from worker.overlap import Overlap
from worker.sampler import LeasedSampler
from worker.sender import Sender
from worker.sharded import ShardedClient, connect, default_sharding, with_keys

__all__ = ["HpsOptimizer"]

log = logging.getLogger("hps.worker")

# ssp: how long one pull waits for the clock floor before the sender's errors are looked at.
_FLOOR_SLICE_S = 2.0

Params = torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]]


def _keys(params: Params) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, kind) in layout order: parameters (trained or frozen), then buffers."""
    if isinstance(params, torch.nn.Module):
        named = list(params.named_parameters())
        buffers = [(n, b) for n, b in params.named_buffers() if b is not None]
    else:
        named, buffers = list(params), []
    out = [(n, p, "param" if p.requires_grad else "frozen") for n, p in named]
    return out + [(n, b, "buffer") for n, b in buffers]


def _env_run_id() -> str:
    """The run this process belongs to: HPS_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID."""
    run = os.environ.get("HPS_RUN_ID", "")
    if not run:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        run = "" if run == "none" else run
    return run


class HpsOptimizer(torch.optim.Optimizer):
    """Trains ``params`` through the job ``job`` at the tier ``address``, as a torch optimizer.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> job = JobConfig(name="mlp-ssp", mode="ssp", staleness=1)
    >>> with HpsOptimizer(model, address, job, worker_id="w0") as opt:   # leaves the job on exit
    ...     model(torch.ones(2, 4)).sum().backward()
    ...     _ = opt.step(loss=0.5)       # the loss rides along for the tiers' metrics
    ...     version = opt.sync()         # ssp/async: wait for the last push, load the newest view
    ...     ckpt = opt.state_dict()      # torch's shape, plus hps's clock and residuals
    >>> version, sorted(ckpt), ckpt["hps"]["clock"]
    (1, ['hps', 'param_groups', 'state'], 1)

    ``params``: a module (its parameters, frozen ones included, and its buffers) or
    ``(name, parameter)`` pairs. ``address``: the worker's tier (default: ``HPS_ADDRESS``).
    ``job``: a ``JobConfig`` creates the job if it does not exist (the first worker's values
    win; a running job with another configuration raises Conflict); a name joins one declared
    with ``hps job create`` (default: ``HPS_JOB``). ``worker_id``: default ``HPS_WORKER_ID``,
    else ``rank<RANK>`` under torchrun, else a random one. On construction the worker
    registers, takes a stable rank (``RANK`` if set), waits until the job's ``min_workers``
    (``WORLD_SIZE`` under torchrun) have joined, and loads the published view.

    A job that has trained (version > 0) is not joined by a new run: ``resume=True`` (or
    ``HPS_RESUME=1``) continues it; workers of one run share ``HPS_RUN_ID`` (torchrun's run
    id is used when set), and may then join, leave and restart freely.

    ``timeout_s`` bounds each call, ``round_timeout_s`` a wait for a round or a clock floor
    (seconds); ``start_timeout_s`` the wait for ``min_workers``. ``record`` keeps ``trace``:
    (clock, version computed on) per step, for tests. ``tls``: the worker's certificate files
    (None: ``HPS_TLS_*`` if set, else plaintext). ``token``: the job's token (default:
    ``HPS_TOKEN``). ``overlap`` (bsp and outer jobs; default ``HPS_OVERLAP``): send each
    bucket of about ``bucket_mb`` MB of gradients from a backward hook as soon as backward has
    made it, so the push travels while backward goes on (``worker/overlap.py``); the script
    must then not change gradients between ``backward()`` and ``step()`` (clip at the root with
    ``OptimizerConfig.clip_grad_norm``; accumulate micro-batches inside ``no_sync()``), and
    cannot use AMP's GradScaler. Raises ValueError when the model does not match the job,
    Conflict for another configuration or run, and the hps errors of ``ParameterClient``.
    """

    _step_supports_amp_scaling = True  # GradScaler hands step() its scale and found_inf

    def __init__(self, params: Params, address: str | None = None, job: JobConfig | str | None = None,
                 worker_id: str | None = None, timeout_s: float = 30.0, round_timeout_s: float = 600.0,
                 record: bool = False, tls: TlsFiles | None = None, token: str | None = None,
                 resume: bool | None = None, start_timeout_s: float = 600.0, overlap: bool | None = None,
                 bucket_mb: float = 25.0) -> None:
        address = address or os.environ.get("HPS_ADDRESS", "")
        if not address:
            raise ValueError("no tier address: pass address= or set HPS_ADDRESS (e.g. zone-eu-a:7001)")
        if job is None:
            job = os.environ.get("HPS_JOB", "")
            if not job:
                raise ValueError("no job: pass job=JobConfig(...) or a job name, or set HPS_JOB")
        requested_rank = env_int("RANK")
        self.local_rank = env_int("LOCAL_RANK") or 0
        run_id = _env_run_id()
        if resume is None:
            resume = os.environ.get("HPS_RESUME", "").lower() in ("1", "true", "yes")
        if isinstance(job, JobConfig):
            world = env_int("WORLD_SIZE")
            if run_id and not job.run_id:
                job = replace(job, run_id=run_id)
            if world and not job.min_workers:
                job = replace(job, min_workers=world)
        worker_id = (worker_id or os.environ.get("HPS_WORKER_ID")
                     or (f"rank{requested_rank}" if requested_rank is not None else None))
        self._keys = _keys(params)
        if not any(kind == "param" for _, _, kind in self._keys):
            raise ValueError("HpsOptimizer needs at least one parameter that requires grad")
        name = job.name if isinstance(job, JobConfig) else job
        # One tier, or root shards separated by ";" (worker/sharded.py).
        self.client = connect(address, name, worker_id, timeout_s, round_timeout_s, tls=tls, token=token)
        self.layout = Layout([KeySpec(n, tuple(t.shape), kind=kind) for n, t, kind in self._keys])
        if isinstance(job, JobConfig) and isinstance(self.client, ShardedClient):
            # Placed over the shards given (HPS_SHARD_WEIGHTS, else equal weights, unless the
            # job says), recording the model's layout: its placement's input.
            job = with_keys(default_sharding(job, len(self.client.clients)), self.layout)
        self.clock = 0
        self.last_step_s = 0.0
        self.last_result: StepResult | None = None
        self._iteration_start = time.perf_counter()  # step time = from one step() to the next
        self._sampler: LeasedSampler | None = None  # its progress rides with each push
        # Leased-data progress of steps not applied (a skipped ssp/async step, a bsp step refused
        # as Stale): it goes with the next push (``_progress``).
        self._carried: tuple[tuple[int, int, int], ...] = ()
        self._round_skipped = False  # the last bsp round this worker pushed to was skipped
        self._micro_batches = 0  # no_sync blocks since the last step (their batches' progress goes with it)
        # Join a running job without sending the initial values: across a WAN every joining
        # worker would otherwise ship the whole model to the root only to have it ignored.
        # Otherwise a JobConfig creates the job, and a name adopts one declared with `hps job
        # create`; the first worker's values win.
        try:
            self.client.register()
            created = False
        except UnknownJob:
            created = self.client.create_job(job, self.layout, self._values())
            self.client.register()
        cfg = self.client.config
        try:
            self._check_join(job, name, created, run_id, resume)
            self.rank, self.world_size = self._take_rank(requested_rank, cfg.min_workers, start_timeout_s)
            log.info("%s: job %s %s as rank %d of %d", self.client.worker_id, name,
                     "created" if created else "joined", self.rank, self.world_size)
            self.client.pull(min_version=self.client.start_version)
            self._load_view(buffers=True, frozen=True)
            # The job's param groups, as torch's class would hold them; what the script changes in
            # them from these values travels with each push.
            trained = [(i, t) for i, (_, t, kind) in enumerate(self._keys) if kind == "param"]
            defaults = group_defaults(cfg.optimizer)
            where = group_index(cfg.optimizer, [self._keys[i][0] for i, _ in trained])
            groups: list[dict[str, Any]] = [{"params": [], **d} for d in defaults]
            for (_, t), g in zip(trained, where, strict=True):
                groups[g]["params"].append(t)
            self._configured = [flat_hparams(d) for d in defaults]
            self._init_done = False
            super().__init__(groups, defaults[0])
            self._init_done = True
            # An outer job's workers train in bsp rounds at their region (its inner loop).
            self.mode = "bsp" if cfg.mode == "outer" else cfg.mode
            self.staleness = cfg.staleness
            self.clock = self.client.start_clock
            self.trace: list[tuple[int, int]] = []  # (clock, version computed on), if record
            self._record = record
            # async: several pushes in flight (each acknowledged only once the root applied it);
            # ssp: one, so the clock floors it reports arrive in order.
            self.sender = (Sender(self.client, record, in_flight=MAX_IN_FLIGHT if self.mode == "async" else 1)
                           if self.mode != "bsp" else None)
        except BaseException:
            # Leave again: a member that never pushes would hold up bsp rounds (a script that
            # catches this and retries would leave one behind per try).
            self.client.close()
            raise
        self._overlap: Overlap | None = None
        from_env = overlap is None
        if overlap is None:
            overlap = os.environ.get("HPS_OVERLAP", "").lower() in ("1", "true", "yes")
        if overlap:
            try:
                self._overlap = self._overlapping(bucket_mb)
            except ValueError as exc:
                if not from_env:
                    self.close()
                    raise
                log.warning("%s: HPS_OVERLAP is set but not used here: %s", self.client.worker_id, exc)
            except Exception:
                self.close()
                raise

    def _overlapping(self, bucket_mb: float) -> Overlap:
        if self.mode != "bsp":
            raise ValueError(f"overlap=True streams a bsp round's push from backward; a {self.mode} job already "
                             "pushes in the background (its sender)")
        if not isinstance(self.client, ParameterClient):
            raise ValueError("overlap=True is not built for root shards yet (a push per shard): pass overlap=False")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        return Overlap(self.client, self._keys, self.layout, bucket_bytes=int(bucket_mb * (1 << 20)),
                       clock=lambda: self.clock)

    # -- joining -----------------------------------------------------------------------------
    def _check_join(self, job: JobConfig | str, name: str, created: bool, run_id: str, resume: bool) -> None:
        have = self.client.config
        if have.sharding is not None and not isinstance(self.client, ShardedClient):
            raise ValueError(f"job {name!r} is sharded over {have.sharding.shards} root shards: give the worker "
                             "every shard's address, in shard order, separated by ';' (HPS_ADDRESS)")
        if self.client.layout != self.layout:
            raise ValueError(f"the model's parameters do not match job {name!r}: the job holds "
                             f"{[(s.key, s.shape, s.kind) for s in self.client.layout]}")
        if created:
            return
        ours = job.run_id if isinstance(job, JobConfig) else run_id
        other_run = have.run_id != ours
        if isinstance(job, JobConfig) and have != job and replace(have, run_id=job.run_id) != job:
            raise Conflict(f"job {name!r} is running with another configuration ({have}); this worker "
                           f"asked for {job}")
        if resume or self.client.start_version == 0:
            return  # resuming on purpose, or nothing trained yet (a declared job, a fresh one)
        if not isinstance(job, JobConfig) and not have.run_id:
            # Joined by name a job that names no run (declared with `hps job create`): the job
            # is the run, and its late, elastic and restarted workers must get in; refusing them
            # left a declared job to the workers that joined it at version 0.
            return
        if not other_run and ours:
            return  # a worker of the same run joining (late, elastically, or restarted)
        raise Conflict(
            f"job {name!r} already trained to version {self.client.start_version}"
            + (f" in run {have.run_id!r}" if have.run_id else "")
            + (f"; this worker is of run {ours!r}" if ours else "; this worker names no run (HPS_RUN_ID)")
            + ". To continue that job pass resume=True (or set HPS_RESUME=1); to start afresh pick "
            "another job name or end it first (hps job end " + name + "). Workers of one run share "
            "HPS_RUN_ID (torchrun's run id counts) and then join and restart freely.")

    def _take_rank(self, requested: int | None, min_workers: int, timeout_s: float) -> tuple[int, int]:
        """A stable rank from the root (``RANK`` if set), then, with ``min_workers``, the wait
        until that many workers hold ranks: bsp rounds then start with everyone."""
        info = self.client.rank(requested)
        if min_workers > 1:
            info = self.client.wait_workers(min_workers, timeout_s)
        return info.rank, max(info.world_size, 1)

    @property
    def is_main(self) -> bool:
        """Rank 0: the worker that saves checkpoints and logs for the job."""
        return self.rank == 0

    @property
    def version(self) -> int:
        """The version of the parameters the model holds now."""
        return self.client.view.version

    def sampler(self, dataset_len: int, batch_size: int, **kw: Any) -> LeasedSampler:
        """A batch sampler (``DataLoader(ds, batch_sampler=opt.sampler(len(ds), 64))``) that
        leases this job's data shards from the root: every sample of an epoch is trained once
        across the workers, whoever joins, leaves or dies mid-epoch (a dead worker's shard goes
        back to the pool from where its applied steps left it). Its progress rides with each
        push; a worker with no shard left takes part in rounds empty-handed (``idle``) until the
        epoch ends. ``kw``: ``LeasedSampler``'s options (shard_size, seed, lease_timeout_s);
        ``set_epoch(e)`` as with DistributedSampler."""
        self._sampler = LeasedSampler(self.client, dataset_len, batch_size, idle=self.idle, **kw)
        return self._sampler

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_init_done", False):
            raise ValueError("the job's param groups are fixed when it is created: declare them in "
                             "OptimizerConfig.groups (parameter-name patterns with their options)")
        super().add_param_group(param_group)

    # -- values in and out ----------------------------------------------------------------------
    def _values(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1).to(torch.float32) for _, t, _ in self._keys]).cpu().numpy()

    def _device(self) -> torch.device:
        return self._keys[0][1].device

    def _load_view(self, buffers: bool = False, frozen: bool = False) -> None:
        values = torch.from_numpy(self.client.view.values)
        device = self._device()
        if device.type != "cpu":
            values = values.to(device, non_blocking=True)
        off = 0
        with torch.no_grad():
            for _, t, kind in self._keys:
                n = t.numel()
                if kind == "param" or (kind == "buffer" and buffers) or (kind == "frozen" and frozen):
                    v = values[off:off + n].view(t.shape)
                    t.copy_(v if t.is_floating_point() else v.round())
                off += n

    def _gather(self, sync_buffers: bool, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """This step's flat vector on the device (gradients, unscaled if AMP scaled them; buffer
        values on a step that averages them) and the keys it carries nothing for."""
        device = self._device()
        parts, absent = [], []
        with torch.no_grad():
            for i, (_, t, kind) in enumerate(self._keys):
                g = t.grad if kind == "param" else None
                if g is not None:
                    g = (g.coalesce().to_dense() if g.is_sparse else g).reshape(-1).to(torch.float32)
                    parts.append(g * inv_scale if inv_scale is not None else g)
                elif kind == "buffer" and sync_buffers:
                    parts.append(t.detach().reshape(-1).to(torch.float32))
                else:
                    parts.append(torch.zeros(t.numel(), dtype=torch.float32, device=device))
                    absent.append(i)
            return torch.cat(parts), tuple(absent)

    def _hparams(self) -> tuple[tuple[int, str, float], ...]:
        """What the script changed in the groups (an lr schedule): sent, applied at the root."""
        out = []
        for i, group in enumerate(self.param_groups):
            configured = self._configured[i]
            for name, value in flat_hparams(group).items():
                if name in configured and value != configured[name]:
                    out.append((i, name, value))
        return tuple(out)

    # -- the step --------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients, as ``torch.optim.Optimizer.zero_grad`` does (with
        overlap, a push that backward began and no ``step()`` finished is dropped too)."""
        if self._overlap is not None and self._overlap.active:
            self._overlap.abort()
        for _, t, kind in self._keys:
            if kind != "param" or t.grad is None:
                continue
            if set_to_none:
                t.grad = None
            else:
                t.grad.detach_()
                t.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, loss: float | torch.Tensor | None = None
             ) -> Any:
        """Push this step's gradients and bring back the parameters to compute the next on.

        Follows ``torch.optim.Optimizer.step``: ``closure`` (optional) re-evaluates the model
        and returns the loss, which ``step`` then returns; without one, ``step`` returns the
        ``StepResult`` (version held, whether the update was applied, bytes moved), also kept
        in ``last_result``. ``loss`` (optional) travels with the push, with the time since the
        previous step, so every tier exports the job's training loss and step time.

        bsp: waits for the round and returns version v+1. ssp(s): hands the gradient to the
        background sender, then waits until every live worker's updates from clocks < c - s
        are in the held version. async: takes whatever version the tier holds now.
        A non-finite gradient (an AMP overflow, found by ``GradScaler`` or here) is not
        applied: in bsp the whole round is skipped by every worker; in ssp/async this worker's
        step is not pushed. Raises TimedOut when the round or the clock floor does not come
        within ``round_timeout_s``; ssp/async raise here what a background push ended with.
        """
        if closure is not None and not callable(closure):
            raise TypeError("step() takes an optional closure, as torch.optim does; pass the loss as "
                            "step(loss=...)")
        returned = None
        if closure is not None:
            with torch.enable_grad():
                returned = closure()
            loss = loss if loss is not None else returned
        t0 = time.perf_counter()
        report = (0.0, 0, 0.0)
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            report = (value, 1, t0 - self._iteration_start)
        self._iteration_start = t0
        # GradScaler (with _step_supports_amp_scaling) sets these for the duration of the call:
        # the scale still in the gradients (None once unscale_ ran) and whether it saw inf/NaN.
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        inv_scale = (scale.double().reciprocal().float().to(self._device())
                     if isinstance(scale, torch.Tensor) else None)
        every = self.client.config.buffer_sync_every
        sync_buffers = bool(every) and (self.clock + 1) % every == 0
        if self._overlap is not None and self._overlap.active:
            if scale is not None or found_inf is not None:
                self._overlap.abort()
                raise ValueError("overlap=True sends gradients as backward() makes them, before GradScaler "
                                 "unscales them; with AMP's GradScaler pass overlap=False")
            result = self._step_streamed(t0, report, sync_buffers)
            self.last_result = result
            return returned if closure is not None else result
        grad, absent = self._gather(sync_buffers, inv_scale)
        overflow = bool(found_inf.item() > 0) if isinstance(found_inf, torch.Tensor) else \
            not bool(torch.isfinite(grad).all())
        if overflow:
            grad.zero_()
            if found_inf is None:
                log.warning("%s: step %d has a non-finite gradient; %s", self.client.worker_id, self.clock,
                            "the round is skipped by every worker" if self.mode == "bsp" else "not pushed")
        has_buffers = sync_buffers and any(kind == "buffer" for _, _, kind in self._keys)
        progress = self._progress()
        info = StepInfo(self._hparams(), absent, overflow and self.mode == "bsp", int(has_buffers), progress)
        if self._record:
            self.trace.append((self.clock, self.client.view.version))
        if self.sender is not None:
            result = self._step_nonblocking(grad, t0, report, info, skip=overflow, sync_buffers=sync_buffers)
        else:
            result = self._step_bsp(lambda: self.client.push(grad, clock=self.clock, report=report, step=info),
                                    t0, sync_buffers, progress)
            if self._round_skipped and not overflow and found_inf is not None:
                self._scaler_backs_off()
        self.last_result = result
        return returned if closure is not None else result

    def _step_streamed(self, t0: float, report: tuple[float, int, float], sync_buffers: bool) -> StepResult:
        """bsp with overlap: most of the push went up during backward; send the rest, its tail."""
        assert self._overlap is not None
        sent = self._overlap.complete(sync_buffers)
        try:
            if sent.overflow:
                log.warning("%s: step %d has a non-finite gradient; the round is skipped by every worker",
                            self.client.worker_id, self.clock)
            has_buffers = sync_buffers and any(kind == "buffer" for _, _, kind in self._keys)
            progress = self._progress()
            info = StepInfo(self._hparams(), sent.absent, sent.overflow, int(has_buffers), progress)
        except BaseException:
            sent.abort()  # not left open at the zone until its round timeout
            raise
        if self._record:
            self.trace.append((self.clock, self.client.view.version))
        client = self._overlap_client()
        meta = replace(sent.stream.meta, step=info)
        unheard = client._unheard
        if unheard is not None and unheard.ack is not None and unheard.seq == client.acked_seq:
            # The last step's push went unanswered to the script, and was applied: a step that
            # ran backward again on the same batch and view is that push again (known by what
            # it was made from), answered with its version; this one is cut.
            try:
                again = unheard.print == client._input_print(self._made_from(sync_buffers), meta)
            except BaseException:
                sent.abort()
                raise
            if again:
                sent.abort()
                (version, skipped), client._unheard = unheard.ack, None
                client.last_skipped = skipped
                return self._step_bsp(lambda: (version, 0), t0, sync_buffers, progress)

        def send() -> tuple[int, int]:
            try:
                return sent.finish(info, report)
            except (Stale, BadInput, Conflict, RuntimeError):  # refused or cut: not applied
                raise
            except BaseException:
                # Unanswered, or interrupted on its way: the script may step again, and that
                # step goes as a whole push (no backward streamed it). It is known by what it
                # was made from, the vector ``_gather`` makes, if this one was applied.
                try:
                    client._unheard_push(meta.seq, self._made_from(sync_buffers), meta)
                except Exception:  # (out of memory): known by its bytes only; the push's error is raised
                    client._unheard = None
                if sent.stream.sent_whole and not sent.stream.delivering:
                    reply, _ = sent.stream.outcome()  # answered as it was interrupted: heard now
                    if reply is not None:
                        client._heard(meta.seq, reply[0], client.last_skipped)
                raise
        return self._step_bsp(send, t0, sync_buffers, progress)

    def _made_from(self, sync_buffers: bool) -> torch.Tensor:
        """The vector a whole push of this step is made from (``step``: ``_gather``, zeroed if
        not finite): a streamed push's fingerprint, which a step sent again whole must match."""
        grad = self._gather(sync_buffers, None)[0]
        if not bool(torch.isfinite(grad).all()):
            grad.zero_()
        return grad

    def _overlap_client(self) -> ParameterClient:
        assert isinstance(self.client, ParameterClient)  # (overlap is refused with root shards)
        return self.client

    def _progress(self) -> tuple[tuple[int, int, int], ...]:
        """The leased-data progress this step's push carries: its batch's, after what steps not
        applied left (``_carried``). Without it a lost step's progress was never reported: at a
        shard's last batch the shard stayed leased to this worker, which the root then told its
        epoch was done while every other worker waited for that shard. A lost step's samples
        count as trained with the next step, as a lost step's before a shard's end always did
        (the next batch's end offset covers them)."""
        # One batch per step, and one more per micro-batch accumulated under ``no_sync``: a
        # step on k batches that reported one fell ever further behind, its shards held for good.
        batches, self._micro_batches = 1 + self._micro_batches, 0
        mine = self._sampler.step_progress(batches) if self._sampler is not None else ()
        carried, self._carried = self._carried, ()
        return furthest(carried, mine) if carried else mine

    def _step_bsp(self, send: Callable[[], tuple[int, int]], t0: float, sync_buffers: bool,
                  progress: tuple[tuple[int, int, int], ...] = ()) -> StepResult:
        """Push (``send()``: the applied version and payload bytes), wait for the round, load it.
        ``progress``: the push's leased-data progress, carried to the next push if it is lost."""
        down0 = self.client.bytes_down
        applied, up = True, 0
        # Whether this round was skipped (another worker overflowed): read only from this
        # push's own answer; ``client.last_skipped`` still holds the last one's after a Stale.
        self._round_skipped = False
        try:
            version, up = send()
            applied = not self.client.last_skipped
            self._round_skipped = self.client.last_skipped
        except BaseException as exc:
            # Not applied (Stale), or raised to the script (its outcome unknown): its progress
            # goes with the next push (reported twice is harmless: the root keeps the furthest).
            self._carried = furthest(progress, self._carried)
            if not isinstance(exc, Stale):
                raise
            # Not applied, and it will not be (its round closed while a tier restarted, or the
            # root restarted): counted in lost_steps. Wait for the version the tier names --
            # computing again on the view held would only be refused again.
            log.warning("%s: step %d not applied: %s", self.client.worker_id, self.clock, exc)
            self.client.lost_steps += 1
            applied, version = False, exc.wait_version or 0
        self.client.pull(min_version=version)
        self._load_view(buffers=sync_buffers)
        self.clock += 1
        self.last_step_s = time.perf_counter() - t0
        return StepResult(self.client.view.version, applied, up, self.client.bytes_down - down0)

    def _scaler_backs_off(self) -> None:
        """Another worker overflowed, so the round was skipped: make this worker's GradScaler
        see an overflow too, so every worker's scale backs off together as one device's would.
        The scaler is the caller of ``step`` (``GradScaler.step``); without one, nothing to do."""
        frame = inspect.currentframe()
        try:
            for _ in range(8):
                frame = frame.f_back if frame is not None else None
                if frame is None:
                    break
                state, owner = frame.f_locals.get("optimizer_state"), frame.f_locals.get("self")
                if isinstance(owner, torch.amp.GradScaler) and isinstance(state, dict):
                    for t in state.get("found_inf_per_device", {}).values():
                        t.fill_(1.0)
                    return
        finally:
            del frame

    def idle(self) -> None:
        """Take part in a bsp round with nothing to contribute (a worker whose data for the
        epoch is done while others still train), so the others' rounds are not held up; then
        load the round's parameters (``last_result`` says which version). ssp/async: nothing
        to do."""
        if self.mode == "bsp":
            if self._overlap is not None:
                self._overlap.abort()  # a backward's gradient, if any, is not this round's
            self.last_result = self._step_bsp(
                lambda: self.client.push(torch.zeros(0), clock=self.clock, contributors=0), time.perf_counter(), False)

    def _step_nonblocking(self, grad: torch.Tensor, t0: float, report: tuple[float, int, float],
                          info: StepInfo, skip: bool, sync_buffers: bool) -> StepResult:
        assert self.sender is not None  # ssp and async have one
        sender = self.sender
        down0, up0 = self.client.bytes_down, sender.bytes_up
        view = self.client.view
        if skip and self.mode == "ssp":
            # Nothing pushed, but this worker's clock floor still moves: the floor rises only
            # with a push, and with staleness s, s + 1 skipped steps in a row left this worker
            # waiting for its own floor until the round timeout (AMP's first steps overflow).
            # The batch still counts as consumed (as a skipped step on one device): its progress
            # goes with the next push that carries a gradient (a tier keeps the step
            # information of contributions only). Every key is absent from it: summed with a
            # later gradient, it must not make a key that one lacks look present, nor count as a
            # push that carried buffers (summed with a step that carries none, the root took
            # the absent buffer keys' zeros as their average).
            self._carried = info.progress
            sender.submit(None, self.clock, view.version, view.epoch, report,
                          replace(info, progress=(), absent=tuple(range(len(self._keys))), buffers=0))
        elif skip:  # async: no floor; not pushed
            self._carried = info.progress  # (it holds what was carried before: ``_progress``)
        else:
            sender.submit(grad, self.clock, view.version, view.epoch, report, info)
        self.clock += 1
        if self.mode == "ssp":
            self._wait_floor(max(0, self.clock - self.staleness))
        else:
            self.client.pull(wait_s=0.0)
        self._load_view(buffers=sync_buffers)
        self.last_step_s = time.perf_counter() - t0
        return StepResult(self.client.view.version, not skip, sender.bytes_up - up0,
                          self.client.bytes_down - down0)

    def _wait_floor(self, floor: int) -> None:
        """ssp: pull until every live worker reached clock ``floor`` (up to the round timeout), in
        slices, so that a push of this worker's that failed in the background -- often the very
        one the floor waits for -- is raised at once, not after a staleness TimedOut that blamed
        another worker."""
        assert self.sender is not None
        deadline = time.monotonic() + self.client.round_timeout_s
        while True:
            try:
                self.client.pull(min_clock=floor, wait_s=min(_FLOOR_SLICE_S, max(0.0, deadline - time.monotonic())))
                return
            except TimedOut:
                self.sender.raise_kept()
                if time.monotonic() >= deadline:
                    raise

    def sync(self, timeout_s: float = 60.0) -> int:
        """Wait until every pushed gradient is applied, then load the newest parameters and
        buffers (the end of training in ssp/async); returns the version now held."""
        deadline = time.monotonic() + timeout_s
        if self.sender is not None and not self.sender.drain(timeout_s):
            raise TimedOut(f"pushes still unacknowledged after {timeout_s:.0f}s")
        # At least the version that applied this worker's last push: a relay answers a push
        # once its parent has applied it, which may be before it has pulled that version.
        epoch, newest = self.sender.newest if self.sender is not None else (0, 0)
        self.client.pull(min_version=newest if epoch == self.client.view.epoch else 0,
                         wait_s=max(0.0, deadline - time.monotonic()))
        self._load_view(buffers=self.client.config.buffer_sync_every > 0)
        return self.version

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without sending them (micro-batches;
        as DDP's ``no_sync``): with ``overlap=True`` the backward after the block sends the
        summed gradients. Without overlap nothing is sent before ``step()`` anyway. Each block
        counts as one micro-batch of the next step, its last one outside (DDP's pattern: one
        block per micro-batch but the last), for the leased data's progress (``sampler``)."""
        self._micro_batches += 1
        if self._overlap is None:
            yield
            return
        self._overlap.paused = True
        try:
            yield
        finally:
            self._overlap.paused = False

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's shape: ``state`` (empty here: the job's optimizer state lives at the root,
        which checkpoints it; ``hps checkpoint export`` writes it out as torch's) and
        ``param_groups`` (hyperparameters as the script left them, parameter indices), plus
        ``hps``: the job, the version held, the worker's clock and the push edge's
        error-feedback residuals (gradient mass not yet sent)."""
        self._quiesce()
        groups, index = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(index, index + n))})
            index += n
        enc = self.client.encoder
        return {"state": {}, "param_groups": groups,
                "hps": {"job": self.client.job, "version": self.version, "clock": self.clock,
                        "rank": self.rank, "residuals": enc.state_dict() if enc is not None else {}}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved: the groups' hyperparameters (so a schedule goes on
        where it was), the clock (never moved back) and the residuals. A torch optimizer's
        ``state`` (its moments) cannot be loaded into a worker: the root holds the job's; say
        ``resume=True`` to continue a job, whose state the root restores from its checkpoint.
        Older hps checkpoints (``{"clock", "residuals"}``) load too."""
        self._quiesce()
        if state_dict.get("state"):
            raise ValueError("this state dict holds a torch optimizer's per-parameter state; with hps the "
                             "job's optimizer state lives at the root (restored from its checkpoint when "
                             "the job is resumed with resume=True). Load only hps's own state dicts here")
        saved_groups = state_dict.get("param_groups")
        if saved_groups is not None:
            if len(saved_groups) != len(self.param_groups) or any(
                    len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=True)):
                raise ValueError(f"the saved param groups ({[len(s['params']) for s in saved_groups]} parameters) "
                                 f"do not match this job's ({[len(g['params']) for g in self.param_groups]})")
            for saved, group in zip(saved_groups, self.param_groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        hps = state_dict.get("hps", state_dict)
        if "clock" in hps:
            self.clock = max(self.clock, int(hps["clock"]))
        if "residuals" in hps:
            self.client.encoder.load_state_dict(hps["residuals"])

    def _quiesce(self, timeout_s: float = 60.0) -> None:
        """ssp/async: let the background sender push what it holds, so the residuals are not
        being changed by its encode while they are read or replaced."""
        if self.sender is not None and not self.sender.drain(timeout_s, raise_kept=False):
            raise TimedOut(f"pushes still unacknowledged after {timeout_s:.0f}s")
        if self._overlap is not None:  # a streamed push interrupted on its way: its encode decided
            self._overlap.client._land_pending()

    def close(self) -> None:
        """Drain the background sender (ssp/async), stop heart-beating and leave the job."""
        try:
            sender = getattr(self, "sender", None)
            if sender is not None:
                sender.close(self.client.timeout_s)
        finally:  # whatever that raised, this worker leaves: a member that never pushes holds rounds up
            try:
                overlap = getattr(self, "_overlap", None)
                if overlap is not None:
                    overlap.close()
            finally:
                self.client.close()

    def __enter__(self) -> HpsOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
