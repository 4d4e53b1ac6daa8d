"""Outer jobs at the tier that runs a region's inner loop (issue 17; DESIGN.md, mode ``outer``).

>>> async def region(parent):   # a root at ``parent`` holds an outer job "lm" (JobConfig.outer)
...     tier = OuterRelay(ServerConfig(role="regional", parent=parent, name="eu"))
...     await tier.start()      # ps.server.create_server serves every relay as one
...     reg = await tier.register("lm", "eu-a", "zone", "", last_seq=0, incarnation=0x5eed)
...     held = tier.inner.jobs["lm"].view.version, tier.jobs["lm"].view.version
...     await tier.stop()
...     return reg.config.mode, held     # the inner lineage starts at outer version 0 * stride
>>> asyncio.run(region(address))
('outer', (0, 0))

An ``OuterRelay`` is a relay for every job but the outer jobs whose ``inner_tier`` is its role.
For those it holds two things:

- its place in the root's job, as any relay does (``Relay``): registered as one member, it
  follows the *outer* view with long-polling pulls (a region pulls each outer delta across the
  WAN once) and pushes up through its encoder, with its residual (error feedback);
- an ``InnerRoot``: the region's own root for the job. Its children (zones, workers) register,
  push, pull and resolve there as at any root: bsp rounds close here, the job's optimizer (the
  inner one) steps here, versions are published here with every invariant of the tree (replicas
  bit for bit, exactly-once, epochs). A zone below cannot tell it from the global root.

Every ``period = inner_steps / fragments`` inner versions the inner root, before acknowledging
the round, sends the root the next fragment's pseudo-gradient (``ps.core.outer``) as a push of
the region's workers, waits for the outer version that applied it, takes the fragment's outer
values as its parameters and publishes that as one more inner version (the rebase), whose
number the round's acknowledgement carries. With ``overlap`` it does not wait: the region
trains on, and the outer result is merged at the first inner version after it lands, keeping
what was trained meanwhile (which goes up with the next pseudo-gradient). The result of a sync
sent at the job's last step stays at the root (it is in the outer view a checkpoint exports).

With asynchronous outer steps (``OuterConfig.asynchronous``) the root, and a relay above the
inner loop, take each region's push as it comes (``JobState.outer_async``: a window closed at
once) and the root applies it at the region's share of the workers (``workers_below``: the
inner root's members); a region then takes the fragments in its own turn (``OuterState.sent``),
since the outer version moves with every region's sync.

Leased data (``worker.sampler``): the root leases shards for every region (a relay forwards
the calls); the data an inner version trained waits at the region (``PendingProgress``) and
goes to the root with the syncs that carry every fragment of its gradient, so a sample counts
as trained once it is in the outer model. While the workers wait in rounds of empty pushes
(the shards left are held by others), data held here goes up at once, and in a synchronous job
those rounds count towards the next sync (the root's rounds wait for every region). The root
keeps an outer job's leases when a worker leaves cleanly (its data may not have been synced
yet); they end with that data's arrival or by expiry, so the lease timeout must exceed a
region's time between syncs. A region answers a lease with where it trained the shard
(``OuterRelay.lease``), so a worker restarted here does not train the unsynced samples again.

The inner state is in memory only. A restarted region starts a new lineage from the outer view;
the inner steps its old lineage held beyond its last sync are counted (``inner_steps_lost``,
``hps_outer_inner_steps_lost_total``) and logged as soon as a child pulls with the old lineage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ps.core.config import JobConfig, ServerConfig
from ps.core.consistency import Aggregate
from ps.core.encoder import Encoder
from ps.core.errors import Conflict, HpsError, NotReady, Stale, UnknownJob, short
from ps.core.intake import PushIntake
from ps.core.leases import GRANTED, WAIT, Dataset, Grant
from ps.core.logs import event
from ps.core.outer import OuterPlan, PendingProgress, StepRate, dynamic_period
from ps.core.ranks import RankInfo
from ps.core.tensors import Chunk
from ps.core.types import Ack, PullMeta, PushKey, PushMeta, Registration, StepInfo, TierStatus, VersionMeta
from ps.tiers.jobstate import JobState, RelayJob, RootJob
from ps.tiers.relay import Relay
from ps.tiers.tier import APPLIED, NOT_APPLIED, UNKNOWN, new_epoch

if TYPE_CHECKING:  # the root's code and torch: imported with the first outer job held here
    from ps.tiers.inner import InnerRoot

__all__ = ["OuterRelay", "runs_inner"]

log = logging.getLogger("hps.outer")

PullReply = tuple[PullMeta, list[tuple[VersionMeta, list[Chunk]]]]
_OUTER_WAIT_S = 60.0  # a warning this often while the outer version that applied a sync is awaited
_SETTLE_BACKOFF_S = (0.5, 10.0)  # between asking the root about a sync given up on


def runs_inner(cfg: JobConfig, role: str) -> bool:
    """Whether a tier of ``role`` runs ``cfg``'s inner loop."""
    return cfg.outer is not None and cfg.outer.inner_tier == role


@dataclass
class Pending:
    """A sync in flight: what was sent, and when."""

    fragment: int
    outer_version: int          # the outer version its pseudo-gradient is based on
    t0: float
    bytes_before: int           # the WAN edge's push bytes before it
    norm: float
    steps: int                  # the inner steps it carries
    params: np.ndarray | None   # overlap: the parameters when it was sent (the region trains on)
    progress: int = 0           # the leased data it completes (PendingProgress.due's count)
    rejoined: bool = False      # sent before every child left, still in flight when one came back
    postponed: bool = False     # not landed within the job's sync_wait_s: the region trains on


@dataclass
class OuterState:
    """A region's side of one outer job: where its fragments stand."""

    plan: OuterPlan
    base: np.ndarray            # the outer values each fragment was last rebased on
    workers: int = 1            # contributors of the last inner round (the pseudo-gradient's weight)
    scratch: np.ndarray | None = None
    detached: bool = False      # every child left: not in the root's rounds until one is back
    inflight: asyncio.Task | None = None  # the sync in flight
    pending: Pending | None = None
    reported: set[int] = dataclasses.field(default_factory=set)  # old lineages whose loss is counted
    sent: int = 0               # syncs made (an asynchronous job's fragments go in this turn)
    rate: StepRate = dataclasses.field(default_factory=StepRate)  # the region's inner steps per second
    pace: float = 0.0           # dynamic steps: the fastest region's rate, as the root last answered
    idle_rounds: int = 0        # inner versions without a gradient since the last sync (leased data ran out)
    progress: PendingProgress = dataclasses.field(init=False)  # leased data trained, not yet in every fragment's sync
    lease_warned: bool = False  # the lease timeout was said to be too short for the syncs
    postpone_said: float = float("-inf")  # when a postponed sync was last logged as a warning

    def __post_init__(self) -> None:
        self.progress = PendingProgress(self.plan.fragments)

    def due(self, dynamic: bool) -> int:
        """Inner steps between two syncs now: the plan's period, or with dynamic steps that
        scaled by this region's speed against the fastest region's."""
        return dynamic_period(self.plan.period, self.rate.rate, self.pace) if dynamic else self.plan.period


def _inner_root_class() -> type[InnerRoot]:
    from ps.core.optim import warm_up
    from ps.tiers.inner import InnerRoot

    warm_up()
    return InnerRoot


class OuterRelay(Relay):
    """A relay that runs the inner loop of the outer jobs whose ``inner_tier`` is its role."""

    def __init__(self, config: ServerConfig, **kw) -> None:
        super().__init__(config, **kw)
        # Made with the first outer job held here: a relay of other jobs builds no optimizer.
        self.inner: InnerRoot | None = None
        self.outer: dict[str, OuterState] = {}
        self._inner_locks: dict[str, asyncio.Lock] = {}
        self._inner_made = asyncio.Lock()

    async def stop(self) -> None:
        for st in self.outer.values():  # a sync retrying towards a gone root must not hold the stop
            if st.inflight is not None:
                st.inflight.cancel()
        if self.inner is not None:
            await self.inner.stop()
        await super().stop()

    def _inner(self, job: str) -> bool:
        return self.inner is not None and job in self.inner.jobs

    async def _inner_root(self) -> InnerRoot:
        async with self._inner_made:  # two first registrations at once make one
            if self.inner is None:
                # The root's code and torch's first optimizer import for seconds: not on the loop
                # (a relay of other jobs never imports them), and NotReady to the children while
                # it takes longer than their calls can wait.
                root_class = await self.loaded(frozenset({"inner-root"}), lambda _: _inner_root_class(),
                                               "the code of outer jobs' inner loops")
                inner = root_class(self.config, self)
                await inner.start()
                self.inner = inner
        return self.inner

    # -- the region's own job --------------------------------------------------------------
    async def register(self, job: str, member: str, role: str, address: str, last_seq: int,
                       incarnation: int) -> Registration:
        self.check_register(job, member, incarnation)
        js = await self._job_for_register(job)
        if not runs_inner(js.config, self.role):
            return await super().register(job, member, role, address, last_seq, incarnation)
        inner = await self._ensure_inner(js)
        await self._rejoin(js, inner)
        try:
            return await inner.register(job, member, role, address, last_seq, incarnation)
        except HpsError:
            ijs = inner.jobs.get(job)
            if ijs is not None and len(ijs.members) == 0:  # nobody here: do not hold the root's rounds
                await self.inner_empty(job)
            raise

    async def _ensure_inner(self, ojs: RelayJob) -> InnerRoot:
        """Make the region's inner job from the outer view (its first child, or after a restart)."""
        name = ojs.config.name
        inner = await self._inner_root()
        async with self._inner_locks.setdefault(name, asyncio.Lock()):
            if name in inner.jobs:
                return inner
            deadline = self.clock() + self.config.upstream_timeout_s
            while not ojs.view.ready and self.clock() < deadline:
                await ojs.wait_change(deadline - self.clock())
            if not ojs.view.ready:
                raise NotReady(f"this {self.role} tier has no outer view of job {short(name)} yet; retry shortly")
            cfg, oc = ojs.config, ojs.config.outer
            assert oc is not None
            plan = OuterPlan(ojs.layout, oc.inner_steps, oc.fragments)
            u = ojs.view.version
            ijs = inner._install(cfg, ojs.layout, ojs.view.values, plan.start_version(u))
            # A lineage of its own: children of an earlier one (this process's, or a dead
            # predecessor's) take a snapshot rather than deltas that do not apply to theirs.
            ijs.view.load_snapshot(new_epoch(), ijs.view.version, ijs.view.values.copy(), ijs.view.checksum)
            ijs.stats.outer_version, ijs.stats.outer_checksum = u, ojs.view.checksum
            self.outer[name] = OuterState(plan, ojs.view.values.copy())
            ijs.stats.inner_steps_per_sync = plan.period
            log.info("%s: job %s runs its inner loop here from outer version %d (inner version %d; "
                     "%d inner steps per sync, %d fragment(s))", self.role, name, u, ijs.view.version,
                     plan.period, plan.fragments,
                     extra=event("outer.started", job=name, version=u))
            return inner

    async def inner_empty(self, job: str) -> None:
        """Every child left (the job's end here): send the steps since the last sync, so the
        outer model holds every inner step, then leave the root's rounds, which would otherwise
        wait for this region. The inner job stays (children pulling still get answers); a child
        registering again rebases it on the outer view first (``_rejoin``)."""
        st = self.outer.get(job)
        ijs = self.inner.jobs.get(job) if self.inner is not None else None
        if st is None or st.detached:
            return
        st.detached = True
        if ijs is not None:
            async with ijs.apply_lock:  # (a sync may have started while the lock was awaited)
                if st.inflight is None and (ijs.stats.inner_steps_since_sync > 0 or st.progress):
                    self._send(ijs, st)
        if st.inflight is not None:  # the last pseudo-gradient lands first
            task = asyncio.create_task(self._leave_after(job, st, st.inflight), name=f"outer-leave-{job}")
            self._tasks.append(task)
            task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
            return
        await self._leave_root(job, st)

    async def _leave_after(self, job: str, st: OuterState, sync: asyncio.Task) -> None:
        """Merge the last sync, then leave the root's rounds. Leased data trained here that
        still needs other fragments' syncs (``PendingProgress``) gets them first: at most F more
        (a failed one is tried again within that bound), so the root counts it as trained.
        The last of those is merged, never followed by another send: a sync still in flight as
        the region leaves the root's rounds is retried there, registers the region again, and
        the root's rounds then wait for a region with no workers."""
        for i in range(st.plan.fragments + 1):
            await asyncio.wait([sync])
            ijs = self.inner.jobs.get(job) if self.inner is not None else None
            if ijs is None or st.inflight is not sync:
                break
            async with ijs.apply_lock:
                if st.inflight is not sync or not st.detached:
                    break  # merged, or a child came back: its next inner version merges it
                self._merge(ijs, st)
                # Steps trained since (a child came back, and left again before this landed) or
                # a failed sync's go up too, as leased data still short of a fragment's sync does.
                if i == st.plan.fragments and st.detached and ijs.stats.inner_steps_since_sync > 0:
                    lost, ijs.stats.inner_steps_since_sync = ijs.stats.inner_steps_since_sync, 0
                    ijs.stats.inner_steps_lost += lost
                    log.warning("%s: job %s: %d inner step(s) trained before every member left are in no "
                                "sync after %d tries; leaving the root's rounds without them", self.role, job,
                                lost, st.plan.fragments + 1, extra=event("outer.steps_lost", job=job, steps=lost))
                if (i == st.plan.fragments or not st.detached
                        or not (st.progress or ijs.stats.inner_steps_since_sync > 0)):
                    break
                self._send(ijs, st)
                if st.inflight is None:
                    break
                sync = st.inflight
        # Another leave's sync in flight (the region left twice): that one leaves once it lands.
        if st.inflight in (None, sync):
            await self._leave_root(job, st)

    async def _leave_root(self, job: str, st: OuterState) -> None:
        """The region has left (every child gone, its last syncs sent): leave the root's rounds,
        unless a child came back meanwhile."""
        await self._leave_parent(job, lambda: st.detached and self.outer.get(job) is st)

    async def _rejoin(self, ojs: RelayJob, inner: InnerRoot) -> None:
        """A child came back to a job this region had left: take the outer view whole (the root
        moved on without us) and publish it as an inner version; the steps not synced are lost,
        and said so."""
        name = ojs.config.name
        st, ijs = self.outer.get(name), inner.jobs.get(name)
        if st is None or ijs is None or not st.detached:
            return
        async with ijs.apply_lock:
            if st.inflight is not None and st.inflight.done():
                self._merge(ijs, st)  # sent before every child left, and landed since
            lost = ijs.stats.inner_steps_since_sync
            st.progress.clear()  # the data of the dropped steps is not in the outer model
            st.idle_rounds, st.rate = 0, StepRate()  # the time away was not training
            for f in range(st.plan.fragments):
                st.plan.rebase(ijs.params, st.base, ojs.view.values, f)
            if st.pending is not None:
                # Still in flight: a synchronous outer round holds it until every region has
                # synced, and it lands in a later outer version. Dropping it would not take it
                # back from the root, and the next sync would reuse its sequence number (refused
                # as another body). It is merged when it lands as with overlap: its fragment
                # takes that outer version, keeping what was trained here since now on top.
                st.pending = dataclasses.replace(st.pending, params=ijs.params.copy(), progress=0,
                                                 rejoined=True)
            inner._publish(ijs, ijs.view.clock_min, 0)
            ijs.reset_round(ijs.view.version, "the region joined the root's rounds again")
            ijs.stats.inner_steps_lost += lost
            ijs.stats.inner_steps_since_sync = 0
            ijs.stats.outer_version, ijs.stats.outer_checksum = ojs.view.version, ojs.view.checksum
            st.detached = False
        log.warning("%s: job %s: joined the root's rounds again at outer version %d; %d inner step(s) "
                    "not synced before every member left were dropped", self.role, name, ojs.view.version,
                    lost, extra=event("outer.dropped", job=name, steps=lost))

    def note_old_lineage(self, job: str, view_epoch: int, since: int) -> None:
        """A child pulled holding ``since`` of another lineage: if it is one this process never
        served, a predecessor died with it; count the inner steps in no outer version."""
        ijs, st = self.inner.jobs.get(job) if self.inner else None, self.outer.get(job)
        if (ijs is None or st is None or not view_epoch or view_epoch == ijs.view.epoch or since <= 0
                or view_epoch in st.reported):
            return
        st.reported.add(view_epoch)
        if len(st.reported) > 64:
            st.reported.pop()
        lost = st.plan.lost_steps(since, ijs.stats.outer_version)
        ijs.stats.inner_steps_lost += lost
        log.warning("%s: job %s: a child held inner version %d of an earlier lineage (epoch %#x): %d inner "
                    "step(s) since its last sync are in no outer version and were lost", self.role, job,
                    since, view_epoch, lost, extra=event("outer.steps_lost", job=job, steps=lost))

    def trained(self, job: str, progress: tuple[tuple[int, int, int], ...]) -> None:
        """An inner version applied gradients of this leased data: it goes to the root with the
        syncs that carry every fragment of it (``PendingProgress``)."""
        st = self.outer.get(job)
        if st is not None:
            st.progress.add(progress)

    # -- the sync ---------------------------------------------------------------------------
    async def after_inner_version(self, ijs: RootJob, contributors: int) -> None:
        """The inner root published a version (its apply lock held): take in a sync that has
        landed, and send the next fragment's pseudo-gradient when due. Without overlap the
        region waits for that sync here; with it, training goes on and the outer result is
        merged at the first inner version after it lands (one step delayed, as in Streaming
        DiLoCo's overlap). At most one sync is in flight: a due sync waits for the last one --
        with the job's ``sync_wait_s``, at most that long (``_wait_sync``)."""
        name = ijs.config.name
        st = self.outer.get(name)
        if st is None or self.inner is None:
            return
        if contributors:
            st.workers = contributors
            ijs.stats.inner_steps_since_sync += 1
            st.rate.step(time.perf_counter())
        else:  # a round of empty pushes: the workers wait for leased data (held by others)
            st.idle_rounds += 1
            st.rate.skip(time.perf_counter())  # waiting is not training
        if st.inflight is not None and st.inflight.done():
            self._merge(ijs, st)
        outer = ijs.config.outer
        # A synchronous job's idle rounds count towards a sync, so a region whose workers wait
        # for data still takes part in the root's rounds (an asynchronous one waits for nobody).
        # While they wait, leased data trained here goes up at once: the shards they wait for
        # may be finished by it.
        idle = st.idle_rounds if outer is not None and not outer.asynchronous else 0
        flush = bool(st.idle_rounds and st.progress)
        due = st.due(outer is not None and outer.dynamic_steps)
        if ijs.stats.inner_steps_since_sync + idle < due and not flush:
            return
        if st.inflight is not None:
            if not await self._wait_sync(ijs, st):
                return  # postponed: training goes on, this sync is due again at the next version
            self._merge(ijs, st)
            if flush and not st.progress and ijs.stats.inner_steps_since_sync + idle < due:
                return  # the sync that just landed carried the data: nothing more is due
        self._send(ijs, st)
        if st.inflight is not None and (outer is None or not outer.overlap):
            if await self._wait_sync(ijs, st):
                self._merge(ijs, st)

    async def _wait_sync(self, ijs: RootJob, st: OuterState) -> bool:
        """Wait for the sync in flight (the region's training waits too: not counted in its rate).
        With the job's ``sync_wait_s``, at most that long, and not again for a sync already
        postponed: False, and the region trains on without it (the root or the WAN is down).
        Its round trip keeps retrying; it is merged at the first inner version after it lands,
        keeping what was trained meanwhile, which goes up with the next sync."""
        assert st.inflight is not None and st.pending is not None
        outer = ijs.config.outer
        wait = outer.sync_wait_s if outer is not None and outer.sync_wait_s > 0 else None
        if wait is not None and st.pending.postponed:
            wait = 0.0
        t0 = time.perf_counter()
        done, _ = await asyncio.wait([st.inflight], timeout=wait)
        st.rate.waited(time.perf_counter() - t0)
        if done:
            return True
        p = st.pending
        if not p.postponed:  # counted and said once per sync
            ijs.stats.outer_syncs_postponed += 1
            # Sent without overlap, nothing was trained since: these are its parameters, from
            # which the merge keeps what the region trains meanwhile (as with overlap).
            st.pending = dataclasses.replace(p, postponed=True,
                                             params=ijs.params.copy() if p.params is None else p.params)
            # A warning a minute at most: a sync_wait_s under the WAN's round trip postpones them all.
            now = self.clock()
            level = logging.WARNING if now - st.postpone_said >= 60.0 else logging.DEBUG
            if level == logging.WARNING:
                st.postpone_said = now
            log.log(level, "%s: job %s: the sync of fragment %d (outer version %d) has not landed in %gs; "
                    "training on without it (it is retried and merged when it lands; %d so far)", self.role,
                    ijs.config.name, p.fragment, p.outer_version, wait, ijs.stats.outer_syncs_postponed,
                    extra=event("outer.sync_postponed", job=ijs.config.name, version=p.outer_version))
        return False

    def _send(self, ijs: RootJob, st: OuterState) -> None:
        """Start the sync of the due fragment: its pseudo-gradient up, then the outer version
        that applied it (``st.inflight``)."""
        name = ijs.config.name
        ojs = self.jobs.get(name)
        if not isinstance(ojs, RelayJob) or not ojs.view.ready:
            ijs.stats.outer_sync_failures += 1
            log.warning("%s: job %s: no outer view to sync with; training on", self.role, name)
            return
        u = ojs.view.version
        # Synchronous: every region syncs the fragment of the outer version (they agree on it).
        # Asynchronous: the outer version moves with every region's sync, so each region takes
        # its fragments in its own turn.
        asynchronous = ijs.config.outer is not None and ijs.config.outer.asynchronous
        f = st.plan.fragment(st.sent if asynchronous else u)
        st.scratch = st.plan.pseudo_gradient(st.base, ijs.params, f, st.workers, out=st.scratch)
        dynamic = ijs.config.outer is not None and ijs.config.outer.dynamic_steps
        n, progress = st.progress.due()
        step = StepInfo(absent=st.plan.absent(f), buffers=st.workers if st.plan.buffers(f) else 0,
                        progress=progress, inner_rate=st.rate.close() if dynamic else 0.0)
        agg = Aggregate(round=u, grad=st.scratch, contributors=st.workers, clock_min=u, clock_max=u,
                        members=(), step=step)
        overlap = ijs.config.outer is not None and ijs.config.outer.overlap
        st.pending = Pending(f, u, time.perf_counter(), ojs.stats.bytes_pushed_up,
                             st.plan.norm(st.scratch, f, st.workers), ijs.stats.inner_steps_since_sync,
                             ijs.params.copy() if overlap else None, n)
        ijs.stats.inner_steps_since_sync, st.idle_rounds = 0, 0
        st.inflight = asyncio.create_task(self._round_trip(ojs, agg), name=f"outer-sync-{name}")

    async def _round_trip(self, ojs: RelayJob, agg: Aggregate) -> Ack:
        fut = asyncio.get_running_loop().create_future()
        await self._forward(ojs, agg, (), agg.round, fut)  # retries within round_timeout_s; never raises
        ack: Ack = fut.result() if fut.exception() is None else await self._settle_sync(ojs, fut.exception())
        await self._hold_outer(ojs, ack)
        return ack

    async def _settle_sync(self, ojs: RelayJob, failure: BaseException) -> Ack:
        """The sync failed. If it went up and was never answered (given up on after the round
        timeout), the root may still apply it -- a synchronous outer round holds it until every
        region has synced. Then its steps must not go up again with the next sync (applied
        twice), nor its number carry another body (refused for good as a Conflict). So ask the
        root by this region's own key until it knows: applied, the sync succeeded (its Ack);
        not applied, it failed (``failure``) and its number is free."""
        job = ojs.config.name
        unsure = self.own_unsure.pop(job, None)
        if unsure is None:
            raise failure  # refused, or never sent: nothing above holds it
        seq, keys, via, nbytes = unsure
        enc = ojs.encoder
        ijs = self.inner.jobs.get(job) if self.inner is not None else None
        if ijs is not None:
            ijs.stats.outer_syncs_unsettled += 1
        wait_s = self._resolve_wait_s(self.config.round_timeout_s)
        delay, said = _SETTLE_BACKOFF_S[0], False
        while True:
            try:
                async with self._fwd_locks.setdefault(job, asyncio.Lock()):
                    outcome, version, epoch = await self._resolve_here(ojs, keys, wait_s,
                                                                       moved=via != self.up.switches)
            except (UnknownJob, Conflict):
                # Not settled: the next sync reuses the number, and the root's book decides (a
                # Conflict if this one was applied) -- never a second application.
                self.unanswered.forget(job, seq)
                if enc is not None and enc.recording:
                    enc.roll_back()
                raise
            except HpsError as exc:
                outcome = f"not known ({short(str(exc), 120)})"
            if outcome == APPLIED:  # the encoder's residual holds what it did not carry: kept
                if enc is not None and enc.recording:
                    enc.commit()
                ojs.stats.bytes_pushed_up += nbytes
                return Ack(version, epoch or ojs.view.epoch, duplicate=True)
            if outcome == NOT_APPLIED:
                if enc is not None and enc.recording:
                    enc.roll_back()  # as before its encode: the next sync carries these steps, whole
                raise failure
            if not said:  # once per sync: the root or the other regions are slow, not gone
                said = True
                log.warning("%s: job %s: the sync sent as push %d was given up on unanswered; its outcome "
                            "is %s: asking the root until it knows (training goes on with sync_wait_s or "
                            "overlap)", self.role, job, seq, outcome if outcome != UNKNOWN else "not known yet",
                            extra=event("outer.sync_unsettled", job=job, seq=seq))
            await asyncio.sleep(delay)
            delay = min(delay * 2, _SETTLE_BACKOFF_S[1])

    def _merge(self, ijs: RootJob, st: OuterState) -> None:
        """A sync ended: rebase its fragment on the outer version and publish that as an inner
        version (keeping what the region trained since it was sent), or count its failure (its
        steps go with the next sync: the base did not move)."""
        task, p = st.inflight, st.pending
        st.inflight, st.pending = None, None
        if task is None or p is None:
            return
        name = ijs.config.name
        exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
        ojs = self.jobs.get(name)
        if exc is not None or not isinstance(ojs, RelayJob):
            ijs.stats.outer_sync_failures += 1
            if p.rejoined:  # the region took the outer view since: these steps are in neither
                ijs.stats.inner_steps_lost += p.steps
                log.warning("%s: job %s: the sync sent before every member left failed: %s; its %d inner "
                            "step(s) are counted lost (the root may have applied them before the failure)",
                            self.role, name, short(str(exc), 200), p.steps,
                            extra=event("outer.steps_lost", job=name, steps=p.steps))
                return
            ijs.stats.inner_steps_since_sync += p.steps
            log.warning("%s: job %s: the sync of fragment %d (outer version %d) failed: %s; training on, "
                        "its steps go with the next sync", self.role, name, p.fragment, p.outer_version,
                        short(str(exc), 200), extra=event("outer.sync_failed", job=name, version=p.outer_version))
            return
        st.sent += 1  # synced: the next fragment's turn (a failed sync tries the same one again)
        st.progress.synced(p.progress)
        ack: Ack = task.result()
        outer = ijs.config.outer
        if outer is not None and outer.dynamic_steps and ack.pace > 0:
            st.pace = ack.pace
            period = st.due(True)
            if period != ijs.stats.inner_steps_per_sync:
                log.info("%s: job %s: %d inner steps per sync now (%.2f inner steps per second here, "
                         "%.2f at the fastest region)", self.role, name, period, st.rate.rate, st.pace,
                         extra=event("outer.steps_per_sync", job=name, steps=period))
            ijs.stats.inner_steps_per_sync = period
        st.plan.rebase(ijs.params, st.base, ojs.view.values, p.fragment, sent=p.params)
        assert self.inner is not None
        self.inner._publish(ijs, ijs.view.clock_min, 0)
        ijs.reset_round(ijs.view.version, "the region synced with the root")
        s = ijs.stats
        s.outer_syncs += 1
        s.outer_version, s.outer_checksum = ojs.view.version, ojs.view.checksum
        s.outer_bytes_up += ojs.stats.bytes_pushed_up - p.bytes_before
        s.outer_bytes_down = ojs.stats.bytes_pulled_in
        s.pseudo_grad_norm = p.norm
        s.outer_sync_seconds_sum += time.perf_counter() - p.t0
        log.debug("%s: job %s: fragment %d synced: outer version %d, inner version %d, %.3fs", self.role,
                  name, p.fragment, ojs.view.version, ijs.view.version, time.perf_counter() - p.t0)

    async def _hold_outer(self, ojs: RelayJob, ack: Ack) -> None:
        """Wait until the followed outer view holds the version that applied our push, however
        long that takes: the push was applied, so a sync counted failed here would send its
        steps again with the next one (applied twice; a slow WAN or a partition after the ack
        did that at 60 s). A warning every ``_OUTER_WAIT_S``. Only a lineage newer than the
        ack's (the root restarted after it) that lacks that version ends the wait: that root
        kept no record of it (no checkpoints), so the sync failed and its steps go again."""
        start, reached = ojs.view.epoch, False
        said = self.clock()
        while ojs.view.version < ack.applied_version or ojs.view.epoch != ack.view_epoch:
            if self.jobs.get(ojs.config.name) is not ojs:
                raise UnknownJob(f"job {ojs.config.name} is no longer held here")
            epoch = ojs.view.epoch
            reached = reached or epoch == ack.view_epoch
            if epoch != ack.view_epoch and (reached or epoch != start):  # newer than the ack's
                if ojs.view.version >= ack.applied_version:
                    return  # the root restarted meanwhile: its lineage holds at least that version
                raise Stale(f"the root restarted without outer version {ack.applied_version}, which "
                            "applied this sync (it keeps no checkpoints): the sync's steps go again")
            if self.clock() - said >= _OUTER_WAIT_S:
                said = self.clock()
                log.warning("%s: job %s: the sync applied as outer version %d was acknowledged, but this "
                            "region holds version %d of the outer view still; waiting for it (the WAN "
                            "or the root is slow)", self.role, ojs.config.name, ack.applied_version,
                            ojs.view.version)
            await ojs.wait_change(_OUTER_WAIT_S)

    # -- children's calls: the inner root answers for inner jobs ----------------------------
    def heartbeat(self, member: str, jobs: list[str], role: str = "worker", address: str = "") -> list[str]:
        unknown = super().heartbeat(member, [j for j in jobs if not self._inner(j)], role, address)
        if self.inner is None:
            return unknown
        return unknown + self.inner.heartbeat(member, [j for j in jobs if self._inner(j)], role, address)

    async def leave(self, job: str, member: str) -> None:
        if self.inner is not None and self._inner(job):
            return await self.inner.leave(job, member)
        return await super().leave(job, member)

    def open_push(self, meta: PushMeta) -> PushIntake:
        if self.inner is not None and self._inner(meta.job):
            return self.inner.open_push(meta)
        return super().open_push(meta)

    async def commit_push(self, intake: PushIntake, digest: bytes, resend: bool = False) -> Ack:
        if self.inner is not None and self._inner(intake.meta.job):
            return await self.inner.commit_push(intake, digest, resend)
        return await super().commit_push(intake, digest, resend)

    async def pull(self, job: str, member: str, view_epoch: int, since: int, min_version: int,
                   wait_s: float, min_clock: int = 0) -> PullReply:
        if self.inner is not None and self._inner(job):
            return await self.inner.pull(job, member, view_epoch, since, min_version, wait_s, min_clock)
        return await super().pull(job, member, view_epoch, since, min_version, wait_s, min_clock)

    async def resolve(self, job: str, keys: tuple[PushKey, ...], wait_s: float, asker: str = ""
                      ) -> tuple[str, int, int]:
        if self.inner is not None and self._inner(job):
            return await self.inner.resolve(job, keys, wait_s, asker)
        return await super().resolve(job, keys, wait_s, asker)

    async def rank(self, job: str, member: str, incarnation: int, requested: int | None = None,
                   release: bool = False) -> RankInfo:
        return await super().rank(job, member, incarnation, requested, release)  # the root's, across regions

    async def lease(self, job: str, member: str, incarnation: int, dataset: Dataset, epoch: int,
                    want: bool = True, held: tuple[tuple[int, int], ...] = ()) -> Grant:
        """The root leases (a relay forwards the call); a shard this region trained further than
        the root knows (data not synced yet: a worker here restarted, or another took over its
        shard) is handed on from there, or, trained to its end, answered ``wait`` until that
        data reaches the root, so no sample of it is trained twice."""
        grant = await super().lease(job, member, incarnation, dataset, epoch, want, held)
        st = self.outer.get(job)
        if st is not None:
            self._check_lease_timeout(job, st, dataset.lease_timeout_s)
        if grant.status != GRANTED or st is None:
            return grant
        end = st.progress.furthest(grant.epoch, grant.shard)
        if end >= grant.end:
            return dataclasses.replace(grant, status=WAIT, shard=-1, start=0, end=0)
        return dataclasses.replace(grant, start=end) if end > grant.start else grant

    def _check_lease_timeout(self, job: str, st: OuterState, timeout_s: float) -> None:
        """Say once (per job) when the dataset's lease timeout is not well above this region's
        time between syncs: a departed worker's shard could then expire before its data reaches
        the root and be handed to another region from the root's older offset (trained twice)."""
        ijs = self.inner.jobs.get(job) if self.inner is not None else None
        if st.lease_warned or ijs is None or st.rate.rate <= 0:
            return
        s = ijs.stats
        between = st.due(ijs.config.outer is not None and ijs.config.outer.dynamic_steps) / st.rate.rate
        between += s.outer_sync_seconds_sum / s.outer_syncs if s.outer_syncs else 0.0
        if timeout_s < 2 * between:
            st.lease_warned = True
            log.warning("%s: job %s: the dataset's lease timeout (%.1fs) is under twice this region's time "
                        "between syncs (~%.1fs): a shard of a worker that left could expire before its data "
                        "reaches the root and be trained again in another region; raise lease_timeout_s",
                        self.role, job, timeout_s, between)

    def _may_read(self, js: JobState, member: str) -> bool:
        return super()._may_read(js, member) or (self.inner is not None and member in self.inner.children)

    def _has_children(self, job: str) -> bool:
        ijs = self.inner.jobs.get(job) if self.inner is not None else None
        return super()._has_children(job) or (ijs is not None and len(ijs.members) > 0)

    def _drop_job(self, job: str, why: str) -> None:
        super()._drop_job(job, why)
        ijs = self.inner.jobs.pop(job, None) if self.inner is not None else None
        st = self.outer.pop(job, None)
        if st is not None and st.inflight is not None:  # it would wait for an outer view no more followed
            st.inflight.cancel()
        if ijs is not None and self.inner is not None:
            self.inner.ended[job] = ijs.view.version
            ijs.abort(why)

    def workers_below(self, js: RelayJob) -> int:
        """An outer job's pseudo-gradients weigh by the region's workers (its inner root's members):
        an asynchronous root applies each at that share."""
        ijs = self.inner.jobs.get(js.config.name) if self.inner is not None else None
        return ijs.members.workers() if ijs is not None else super().workers_below(js)

    def encoder(self, js: RelayJob) -> Encoder:
        """An outer job's edge above its inner loop carries pseudo-gradients: the outer codec."""
        cfg = js.config
        below = self.role == "zone" and cfg.outer is not None and cfg.outer.inner_tier != "zone"
        if js.encoder is None and cfg.outer is not None and not below:
            name = self.config.up_codec or cfg.outer.codec
            js.encoder = Encoder.for_job(cfg, name, seed=self.member_id)
        return super().encoder(js)

    def synced(self) -> bool:
        return super().synced() and (self.inner is None or all(js.view.ready for js in self.inner.jobs.values()))

    def status(self) -> TierStatus:
        st = super().status()
        if self.inner is None or not self.inner.jobs:
            return st
        inner = {j.name: j for j in self.inner.status().jobs}
        jobs = []
        for j in st.jobs:
            i = inner.pop(j.name, None)
            if i is None:
                jobs.append(j)
                continue
            # What the children see (the inner job), with the WAN edge's lag and bytes.
            stats = dataclasses.replace(i.stats, bytes_pushed_up=j.stats.bytes_pushed_up,
                                        bytes_pulled_in=j.stats.bytes_pulled_in)
            jobs.append(dataclasses.replace(i, parent_version=i.version, lag_s=j.lag_s, stats=stats,
                                            inner_loop=True))
        children = {c.member: c for c in (*st.children, *self.inner.status().children)}
        return dataclasses.replace(st, jobs=(*jobs, *inner.values()), children=tuple(children.values()))

