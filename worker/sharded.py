"""A worker's link to a job whose parameters are spread over several root shards (DESIGN.md,
"Sharding"): one ``ParameterClient`` per shard, pushes cut by the job's plan, pulls joined.

    client = connect("root-0:7000;root-1:7000;root-2:7000", job="lm", worker_id="w1")
    client.register()                  # every shard; the plan comes with the job's configuration
    client.pull(min_version=client.start_version)   # each shard's blocks, joined in client.view
    client.push(grad, clock=0)         # each shard gets its blocks of the gradient

(tests/integration/test_sharding.py runs this against real root shards.)

``connect`` gives a ``ParameterClient`` for one address and a ``ShardedClient`` for several
separated by ``;`` (in shard order: shard ``i`` is the root started with ``--shard i/N``; each
may list its standby after a comma, as for one root). ``HpsOptimizer`` takes either, from
``HPS_ADDRESS`` too.

Every push goes to every shard (a shard none of whose blocks has a gradient gets an empty
one), so in bsp a version v is the same round everywhere and the joined view at v is one
consistent model; ssp and async keep their bounds per shard, and the joined view's version is
the lowest shard's. Ranks, data-shard leases and the data progress a push carries live at
shard 0. Each shard keeps its own exactly-once book: a push that times out at one shard is
retried there alone, and a restarted shard answers it from its write-ahead log.

The addresses may be relays, one per shard (a zone of a sharded root is N relay processes,
relay I below shard I; ``hps launch`` starts them): each carries its shard's blocks only, and
this client cuts and joins as it does at the shards.

Not built yet: a round aborted at one shard and applied at the others (a member dropped by one
shard only) is reported as Stale but leaves the shards one version apart; one relay process that
splits and joins by shard itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from ps.core.config import JobConfig, ShardingConfig
from ps.core.errors import BadInput, Conflict, NotReady, Stale
from ps.core.exactly_once import MAX_IN_FLIGHT
from ps.core.leases import Dataset
from ps.core.ranks import RankInfo
from ps.core.sharding import ShardPlan, keys_of, layout_of
from ps.core.types import NO_STEP, StepInfo
from ps.core.view import Layout, View
from ps.net.tls import TlsFiles
from worker.client import ParameterClient

__all__ = ["ShardedClient", "connect", "with_keys"]

log = logging.getLogger("hps.worker")
T = TypeVar("T")
_BASES = 256  # joined versions whose per-shard versions are remembered (async pushes name their base)


def connect(address: str, job: str, worker_id: str | None = None, timeout_s: float = 30.0,
            round_timeout_s: float = 600.0, retry_s: float | None = None, tls: TlsFiles | None = None,
            token: str | None = None) -> ParameterClient | ShardedClient:
    """The client for ``address``: one tier, or root shards separated by ``;``."""
    shards = [a.strip() for a in address.split(";")]
    if len(shards) == 1:
        return ParameterClient(shards[0], job, worker_id, timeout_s, round_timeout_s, retry_s, tls, token)
    return ShardedClient(shards, job, worker_id, timeout_s, round_timeout_s, retry_s, tls, token)


def default_sharding(cfg: JobConfig, shards: int) -> JobConfig:
    """``cfg`` as created at ``shards`` root shards: a job without a sharding of its own is placed
    by the weights in HPS_SHARD_WEIGHTS (comma-separated, what `hps launch` prints for a sharded
    root), else by equal weights. A sharding over another count is refused."""
    if cfg.sharding is not None:
        if cfg.sharding.shards != shards:
            raise BadInput(f"job {cfg.name!r} is sharded over {cfg.sharding.shards} roots; "
                           f"{shards} addresses were given")
        return cfg
    text = os.environ.get("HPS_SHARD_WEIGHTS", "").strip()
    try:
        weights = tuple(float(w) for w in text.split(",")) if text else (1.0,) * shards
    except ValueError:
        raise BadInput(f"HPS_SHARD_WEIGHTS is comma-separated numbers, got {text!r}") from None
    if len(weights) != shards:
        raise BadInput(f"HPS_SHARD_WEIGHTS gives {len(weights)} weights for {shards} shard addresses")
    return replace(cfg, sharding=ShardingConfig(weights=weights))


def with_keys(cfg: JobConfig, layout: Layout) -> JobConfig:
    """A sharded job's configuration with the whole layout recorded (what the plan is computed
    from); BadInput when it records another one."""
    if cfg.sharding is None:
        return cfg
    keys = keys_of(layout)
    if cfg.sharding.keys and cfg.sharding.keys != keys:
        raise BadInput(f"job {cfg.name!r}'s sharding records other keys than the model's")
    return replace(cfg, sharding=replace(cfg.sharding, keys=keys))


class _Residuals:
    """The shards' push-edge residuals as one state dict (``HpsOptimizer.state_dict``)."""

    def __init__(self, clients: list[ParameterClient]) -> None:
        self._clients = clients

    def state_dict(self) -> dict[str, np.ndarray]:
        return {f"{i}/{k}": v for i, c in enumerate(self._clients) for k, v in c.encoder.state_dict().items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for i, c in enumerate(self._clients):
            c.encoder.load_state_dict({k.split("/", 1)[1]: v for k, v in state.items() if k.split("/", 1)[0] == str(i)})

    def reset(self) -> None:
        for c in self._clients:
            c.encoder.reset()


def _joined_epoch(epochs: list[int]) -> int:
    """The joined view's lineage: a new one when any shard's is (a restart of any shard, not of
    shard 0 alone, voids what a background sender summed on the old views; a shard refusing
    each push on its old lineage while the others applied it lost every step after the restart)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(epochs)}Q", *epochs), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2 | 1


class ShardedClient:
    """``ParameterClient``'s interface over the root shards at ``addresses`` (shard order)."""

    def __init__(self, addresses: list[str], job: str, worker_id: str | None = None, timeout_s: float = 30.0,
                 round_timeout_s: float = 600.0, retry_s: float | None = None, tls: TlsFiles | None = None,
                 token: str | None = None) -> None:
        if len(addresses) < 2 or not all(addresses):
            raise BadInput(f"a sharded job needs two or more shard addresses, got {addresses}")
        self.job = job
        self.worker_id = worker_id or f"w-{uuid.uuid4().hex[:8]}"
        self.timeout_s, self.round_timeout_s = timeout_s, round_timeout_s
        self.clients = [ParameterClient(a, job, self.worker_id, timeout_s, round_timeout_s, retry_s, tls, token)
                        for a in addresses]
        # Pushes have threads of their own: a pull waiting for a clock floor (ssp) needs this
        # worker's own push, which queued behind it in one pool of N threads stalled until the
        # round timeout; and an async sender's pushes in flight would each wait for the others.
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix=f"hps-shards-{self.worker_id}")
        self._push_pool = ThreadPoolExecutor(len(addresses) * MAX_IN_FLIGHT,
                                             thread_name_prefix=f"hps-shard-push-{self.worker_id}")
        self.plan: ShardPlan | None = None
        self._view: View | None = None
        self._bases: OrderedDict[tuple[int, int], tuple[tuple[int, int], ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.lost_steps = 0
        self.start_version = self.start_clock = 0
        self.member_timeout_s = 0.0
        self._minted = ""  # the job token shard 0 minted when this client created the job

    # -- what every shard does ------------------------------------------------------------
    def _each(self, fn: Callable[[int, ParameterClient], T], pool: ThreadPoolExecutor | None = None,
              answered: dict[int, T] | None = None) -> list[T]:
        """``fn`` on every shard at once; the first failure is raised once all have finished.
        ``answered`` (a caller that must know every shard's outcome, also when one failed): filled
        with each shard's result, and a Ctrl-C here waits for the shards still running before it
        is raised (a second one leaves at once); without it, an interrupted shard runs on."""
        out: dict[int, T] = {} if answered is None else answered
        futures: list = []
        error: BaseException | None = None
        try:
            for i, c in enumerate(self.clients):
                futures.append((pool or self._pool).submit(fn, i, c))
        except BaseException as exc:  # (Ctrl-C while starting them: those started are waited for)
            if answered is None:
                raise
            error = exc
        for i, f in enumerate(futures):
            try:
                out[i] = f.result()
                continue
            except BaseException as exc:  # the shard's failure, or Ctrl-C in this thread
                error = error or exc
                if answered is None:
                    continue
            try:  # interrupted while the shard's call runs on in the pool: waited for once more
                out[i] = f.result()
            except BaseException:
                if not f.done():
                    raise
        if error is not None:
            raise error
        return [out[i] for i in range(len(self.clients))]

    def _registered(self) -> ShardPlan:
        if self.plan is None:
            raise NotReady(f"{self.worker_id!r} has not registered for job {self.job!r}; call register() first")
        return self.plan

    @property
    def config(self) -> JobConfig:
        self._registered()
        return self.clients[0].config

    @property
    def layout(self) -> Layout:
        return self._registered().layout

    @property
    def view(self) -> View:
        self._registered()
        assert self._view is not None
        return self._view

    @property
    def encoder(self) -> _Residuals:
        return _Residuals(self.clients)

    @property
    def bytes_up(self) -> int:
        return sum(c.bytes_up for c in self.clients)

    @property
    def bytes_down(self) -> int:
        return sum(c.bytes_down for c in self.clients)

    @property
    def last_skipped(self) -> bool:
        return any(c.last_skipped for c in self.clients)

    @property
    def _closed(self) -> bool:
        return all(c._closed for c in self.clients)

    @property
    def _rank_info(self) -> RankInfo | None:
        return self.clients[0]._rank_info

    # -- joining --------------------------------------------------------------------------
    def create_job(self, config: JobConfig | str, layout: Layout, values: np.ndarray) -> bool:
        """Create the job on every shard, each with its blocks of ``values``; False if it
        already existed everywhere."""
        if not isinstance(config, JobConfig):
            raise BadInput(f"{len(self.clients)} shard addresses were given: create job {config!r} with a "
                           "JobConfig (a job declared by name is not built for root shards yet)")
        config = with_keys(default_sharding(config, len(self.clients)), layout)
        plan = ShardPlan.of(config)
        parts = plan.split(np.asarray(values, np.float32))
        # Shard 0 first: under the admin token it mints the job's token, which the others take
        # on, so one token acts in the job at every shard (a worker's HPS_TOKEN).
        first = self.clients[0].create_job(config, plan.shard_layout(0), parts[0])
        # A retry after a shard failed the first try: shard 0 has the job and mints nothing now,
        # so its token is the one kept from the first try (the others minted their own).
        token = self.clients[0].minted = self.clients[0].minted or self._minted
        self._minted = token
        rest = self._each(lambda i, c: c.create_job(config, plan.shard_layout(i), parts[i], job_token=token)
                          if i else first)
        strays = [i for i, c in enumerate(self.clients) if i and c.minted and c.minted != token]
        if strays:
            raise Conflict(f"root shard(s) {strays} minted job tokens of their own for job {config.name!r} (shard 0 "
                           "made the job before this client, and its token is not known here): no one token acts "
                           "at every shard. End the job at every shard (hps job end) and create it again")
        return any(rest)

    def register(self) -> None:
        """Join the job at every shard, and check that they hold one sharded job's blocks in
        this client's shard order."""
        self._each(lambda i, c: c.register())
        cfg = self.clients[0].config
        if cfg.sharding is None:
            raise BadInput(f"job {self.job!r} is not sharded; give this worker one address, not "
                           f"{len(self.clients)}")
        if cfg.sharding.shards != len(self.clients):
            raise BadInput(f"job {self.job!r} is sharded over {cfg.sharding.shards} roots; this worker was "
                           f"given {len(self.clients)} addresses")
        for i, c in enumerate(self.clients):
            if c.config != cfg:
                raise Conflict(f"shard {i} holds job {self.job!r} with another configuration than shard 0")
        plan = ShardPlan(layout_of(cfg.sharding.keys), cfg.sharding, cfg.optimizer.kind)
        for i, c in enumerate(self.clients):
            if c.layout != plan.shard_layout(i):
                raise Conflict(f"the root at {c.address} holds other blocks than shard {i}'s: list the "
                               "shard addresses in shard order (shard i: --shard i/N)")
        if self.plan is None or self.plan.layout != plan.layout:
            self._view = View(plan.layout)
        self.plan = plan
        self.start_version = min(c.start_version for c in self.clients)
        self.start_clock = min(c.start_clock for c in self.clients)
        self.member_timeout_s = max(c.member_timeout_s for c in self.clients)

    def rank(self, requested: int | None = None) -> RankInfo:
        return self.clients[0].rank(requested)

    def wait_workers(self, n: int | None = None, timeout_s: float = 600.0, poll_s: float = 0.2) -> RankInfo:
        return self.clients[0].wait_workers(n, timeout_s, poll_s)

    def lease(self, dataset: Dataset, epoch: int, want: bool = True, **kw: Any) -> Any:
        return self.clients[0].lease(dataset, epoch, want, **kw)

    # -- values ---------------------------------------------------------------------------
    def pull(self, min_version: int = 0, wait_s: float | None = None, min_clock: int = 0) -> int:
        """Every shard to at least ``min_version`` (and the clock floor), joined into ``view``."""
        plan = self._registered()
        received = self._each(lambda i, c: c.pull(min_version, wait_s, min_clock))
        with self._lock:
            view = self.view
            plan.merge([c.view.values for c in self.clients], out=view.values)
            view.version = min(c.view.version for c in self.clients)
            view.clock_min = min(c.view.clock_min for c in self.clients)
            view.epoch = _joined_epoch([c.view.epoch for c in self.clients])
            # Each shard checks its own blocks; the joined view's is the XOR of theirs (a shard's
            # changes it), not a checksum of the joined values.
            view.checksum = 0
            for c in self.clients:
                view.checksum ^= c.view.checksum
            self._bases[(view.epoch, view.version)] = tuple((c.view.epoch, c.view.version) for c in self.clients)
            while len(self._bases) > _BASES:
                self._bases.popitem(last=False)
        return sum(received)

    def push(self, grad: np.ndarray | torch.Tensor, clock: int = 0, *, clock_max: int | None = None,
             base_version: int | None = None, view_epoch: int | None = None,
             contributors: int = 1, report: tuple[float, int, float] = (0.0, 0, 0.0),
             pipelined: bool = False, step: StepInfo = NO_STEP) -> tuple[int, int]:
        """``ParameterClient.push`` at every shard, each with its blocks; returns the lowest
        version that applied it (in bsp every shard's is the same) and the bytes sent."""
        plan = self._registered()
        finite = torch.isfinite(grad).all() if isinstance(grad, torch.Tensor) else np.isfinite(grad).all()
        if contributors and not finite:  # checked once here: no shard may take it while another refuses
            raise BadInput("the gradient holds NaN/Inf values; not pushed (check the loss scale)")
        # A round with nothing of this worker's (``idle``: contributors 0) carries no elements.
        parts = plan.split(grad) if contributors else [grad[:0]] * len(self.clients)
        absent = plan.absent(step.absent)
        with self._lock:
            base = None
            if base_version is not None:
                base = self._bases.get((self.view.epoch if view_epoch is None else view_epoch, base_version))

        def one(i: int, c: ParameterClient) -> tuple[int, int]:
            sub = replace(step, absent=absent[i], progress=step.progress if i == 0 else ())
            epoch, version = base[i] if base is not None else (None, None)
            held = (c.view.epoch, c.view.version, c.view.checksum)
            try:
                return c.push(parts[i], clock, clock_max=clock_max, base_version=version, view_epoch=epoch,
                              contributors=contributors, report=report, pipelined=pipelined, step=sub)
            except Stale as exc:
                # A shard that restarted (a new epoch) refuses a gradient computed on its old
                # lineage, while the others may have applied it. It restored every acknowledged
                # version: if its snapshot at the gradient's base is bit for bit the view the
                # gradient was computed on, the gradient is as valid there, and goes again.
                if contributors == 0 or (version is not None and version != held[1]):
                    raise
                self._pull_epoch(c, held[1], held[0] if exc.epoch is not None else None)
                if c.view.epoch == held[0] or (c.view.version, c.view.checksum) != held[1:]:
                    raise
                log.warning("%s: root shard %d restarted at version %d with the same parameters; the push "
                            "goes again on its new lineage", self.worker_id, i, held[1])
                return c.push(parts[i], clock, clock_max=clock_max, base_version=held[1],
                              view_epoch=c.view.epoch, contributors=contributors, report=report,
                              pipelined=pipelined, step=sub)
        answered: dict[int, tuple[int, int]] = {}
        try:
            results = self._each(one, self._push_pool, answered)
        except BaseException:
            # The script hears an error for a push some shards applied: sent again, the same
            # gradient must get their versions there, not be applied a second time.
            if contributors and not pipelined:
                for i, (v, _) in answered.items():
                    self.clients[i]._answered_unheard(parts[i], v)
            raise
        versions = [v for v, _ in results]
        if self.config.mode == "bsp" and len(set(versions)) > 1:
            log.error("%s: the shards applied one push at versions %s (a round aborted at some shards "
                      "only); their bsp rounds are apart from now on", self.worker_id, versions)
        return min(versions), sum(n for _, n in results)

    def _pull_epoch(self, c: ParameterClient, version: int, old_epoch: int | None) -> None:
        """Pull ``c`` to ``version``; when a tier refused the push for a newer root epoch than
        ``old_epoch``, until ``c`` holds a view off ``old_epoch`` (its relay moves once it hears
        of the restart, within its parent's heartbeat; seen: a zone below a region answered on
        the old epoch right after the region had refused on the new one), for at most
        ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        c.pull(min_version=version)
        while old_epoch is not None and c.view.epoch == old_epoch and time.monotonic() < deadline:
            time.sleep(0.05)
            c.pull(min_version=version)

    def close(self) -> None:
        """Leave the job at every shard."""
        try:
            self._each(lambda i, c: c.close())
        finally:
            self._pool.shutdown(wait=False)
            self._push_pool.shutdown(wait=False)
