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
The syncs are ``ps.tiers.outersync`` (mixed in); this module is the region's job and its
children's calls.

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
An inner job that fails part-way through a version (``InnerRoot._damaged``: a root would wait
for a restart to restore it from its log) starts a new lineage the same way at once
(``_restart_inner``), its lost steps counted there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from ps.core.config import JobConfig, ServerConfig
from ps.core.encoder import Encoder
from ps.core.errors import HpsError, NotReady, Stale, short
from ps.core.intake import PushIntake
from ps.core.leases import GRANTED, WAIT, Dataset, Grant
from ps.core.logs import event
from ps.core.outer import OuterPlan, StepRate
from ps.core.ranks import RankInfo
from ps.core.tensors import Chunk
from ps.core.types import Ack, PullMeta, PushKey, PushMeta, Registration, TierStatus, VersionMeta
from ps.tiers.jobstate import JobState, RelayJob
from ps.tiers.outersync import OuterState, OuterSync
from ps.tiers.relay import Relay
from ps.tiers.tier import new_epoch

if TYPE_CHECKING:  # the root's code and torch: imported with the first outer job held here
    from ps.tiers.inner import InnerRoot

__all__ = ["OuterRelay", "runs_inner"]

log = logging.getLogger("hps.outer")

PullReply = tuple[PullMeta, list[tuple[VersionMeta, list[Chunk]]]]


_REASKS = 8  # lease calls to the root per worker's call, past shards trained to their end here


def runs_inner(cfg: JobConfig, role: str) -> bool:
    """Whether a tier of ``role`` runs ``cfg``'s inner loop."""
    return cfg.outer is not None and cfg.outer.inner_tier == role


def _inner_root_class() -> type[InnerRoot]:
    from ps.core.optim import warm_up
    from ps.tiers.inner import InnerRoot

    warm_up()
    return InnerRoot


# Syncs a restart of a failed inner job waits out before it starts the job again (a leave sends
# at most one per fragment after the one in flight).
_RESTART_TRIES = 64


class OuterRelay(OuterSync, Relay):
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
        try:
            inner = await self._ensure_inner(js)
            await self._rejoin(js, inner)
            return await inner.register(job, member, role, address, last_seq, incarnation)
        except HpsError:
            await self._leave_if_no_child(job)
            raise

    async def _leave_if_no_child(self, job: str) -> None:
        """A child's registration failed here after the region joined the root's job for it
        (torch still loading, no outer view yet, a refusal): with no child in the region, leave
        the root's rounds, which would otherwise wait for this region's syncs -- every region's
        synchronous outer rounds, for good, while the heartbeats kept the region a member."""
        ijs = self.inner.jobs.get(job) if self.inner is not None else None
        if ijs is not None and len(ijs.members) > 0:
            return
        st = self.outer.get(job)
        if st is not None and not st.detached:
            await self.inner_empty(job)  # its steps since the last sync go up first
            return

        def nobody() -> bool:  # (asked again under the job's attach lock)
            held = self.inner.jobs.get(job) if self.inner is not None else None
            now = self.outer.get(job)
            return (held is None or len(held.members) == 0) and (now is None or now.detached)
        await self._leave_parent(job, nobody)

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
            self.outer[name] = OuterState(plan, ojs.view.values.copy(), base_version=ojs.view.version)
            ijs.stats.inner_steps_per_sync = plan.period
            log.info("%s: job %s runs its inner loop here from outer version %d (inner version %d; "
                     "%d inner steps per sync, %d fragment(s))", self.role, name, u, ijs.view.version,
                     plan.period, plan.fragments,
                     extra=event("outer.started", job=name, version=u))
            return inner

    async def inner_empty(self, job: str) -> None:
        """Every child left (the job's end here): send the steps since the last sync (with
        fragments, every fragment's: ``_leave_after`` sends the others), so the outer model
        holds every inner step, then leave the root's rounds, which would otherwise
        wait for this region. The inner job stays (children pulling still get answers); a child
        registering again rebases it on the outer view first (``_rejoin``)."""
        st = self.outer.get(job)
        ijs = self.inner.jobs.get(job) if self.inner is not None else None
        if st is None or st.detached:
            return
        st.detached = True
        if ijs is not None:
            async with ijs.apply_lock:  # (a sync may have started while the lock was awaited)
                if st.inflight is None and (st.unsynced() or st.progress):
                    self._send(ijs, st)
                if st.inflight is None:  # not sent (no outer view to sync with)
                    self._lost_leaving(ijs, st, "could not be synced (no outer view)")
        if st.inflight is not None:  # the last pseudo-gradient lands first
            task = asyncio.create_task(self._leave_after(job, st, st.inflight), name=f"outer-leave-{job}")
            self._tasks.append(task)
            task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
            return
        await self._leave_root(job, st)

    async def _leave_after(self, job: str, st: OuterState, sync: asyncio.Task) -> None:
        """Merge the last sync, then leave the root's rounds. Steps that other fragments still
        hold (``OuterState.unsent``), and leased data trained here that still needs other
        fragments' syncs (``PendingProgress``), get those syncs first: at most F more
        (a failed one is tried again within that bound), so the root counts it as trained.
        The last of those is merged, never followed by another send: a sync still in flight as
        the region leaves the root's rounds is retried there, registers the region again, and
        the root's rounds then wait for a region with no workers."""
        for i in range(st.plan.fragments + 1):
            await asyncio.wait([sync])
            ijs = self.inner.jobs.get(job) if self.inner is not None else None
            if (ijs is None or st.inflight is not sync or self.outer.get(job) is not st
                    or job in self.inner.damaged):
                break  # (damaged, or not st: the job's inner loop starts again, ``_restart_inner``)
            async with ijs.apply_lock:
                if st.inflight is not sync or not st.detached:
                    break  # merged, or a child came back: its next inner version merges it
                self._merge(ijs, st)
                # Steps trained since (a child came back, and left again before this landed) or
                # a failed sync's go up too, as leased data still short of a fragment's sync does.
                if i == st.plan.fragments and st.detached and st.unsynced():
                    self._lost_leaving(ijs, st, f"are in no sync after {st.plan.fragments + 1} tries")
                if (i == st.plan.fragments or not st.detached
                        or not (st.progress or st.unsynced())):
                    break
                self._send(ijs, st)
                if st.inflight is None:  # not sent: leaving without them, counted (they went uncounted)
                    self._lost_leaving(ijs, st, "could not be synced (no outer view)")
                    break
                sync = st.inflight
        # Another leave's sync in flight (the region left twice): that one leaves once it lands.
        if st.inflight in (None, sync):
            await self._leave_root(job, st)

    def _lost_leaving(self, ijs, st: OuterState, why: str) -> None:
        """The steps the region still holds as it leaves the root's rounds are lost: counted
        and said, never silent."""
        lost = st.drop_unsent()
        if not lost:
            return
        job = ijs.config.name
        ijs.stats.inner_steps_since_sync = 0
        ijs.stats.inner_steps_lost += lost
        log.warning("%s: job %s: %d inner step(s) trained before every member left %s; leaving the root's rounds "
                    "without them", self.role, job, lost, why, extra=event("outer.steps_lost", job=job, steps=lost))

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
            lost = st.drop_unsent()  # every fragment is rebased: what each held since its sync goes
            st.progress.clear()  # the data of the dropped steps is not in the outer model
            st.idle_rounds, st.rate = 0, StepRate()  # the time away was not training
            for f in range(st.plan.fragments):
                st.plan.rebase(ijs.params, st.base, ojs.view.values, f)
            st.based = [ojs.view.version] * st.plan.fragments
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

    def inner_damaged(self, job: str) -> None:
        """The inner root serves ``job`` no more (a version failed part-way: ``Root._damaged``);
        start its inner loop again from the outer view, in the background (``_restart_inner``)."""
        task = asyncio.create_task(self._restart_inner(job), name=f"outer-restart-{job}")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _restart_inner(self, job: str) -> None:
        """A new lineage of ``job``'s inner loop from the outer view, in place of one that failed
        part-way through a version: what a restart of this tier does, without the restart (its
        other jobs go on). It kept no log to restore the old one from, and until this it was
        served by nobody. A sync in flight lands first, however long the root takes to say what
        became of it (the outer view then holds it, or its steps are lost with the rest); the
        inner steps since the last sync are lost, counted (``inner_steps_lost``) and logged.
        Pushes waiting in its rounds are refused as Stale; its children are unknown to the new
        job, so they register again and take a snapshot of the new lineage."""
        try:
            await self._start_inner_again(job)
        except Exception:  # (a background task: said, never silent)
            log.exception("%s: job %s: starting its inner loop again failed; the next child to register "
                          "starts it", self.role, job)

    async def _start_inner_again(self, job: str) -> None:
        inner = self.inner
        lock = self._inner_locks.setdefault(job, asyncio.Lock())
        for _ in range(_RESTART_TRIES):  # a sync that lands may be followed by another (a leave's)
            st = self.outer.get(job)
            if st is not None and st.inflight is not None and not st.inflight.done():
                await asyncio.wait([st.inflight])
                continue
            async with lock:
                if self.outer.get(job) is not st or (st is not None and st.inflight is not None
                                                     and not st.inflight.done()):
                    continue  # moved on while the lock was awaited: look again
                ojs = self.jobs.get(job)
                old = inner.jobs.get(job) if inner is not None else None
                if inner is None or old is None or job not in inner.damaged or not isinstance(ojs, RelayJob):
                    return  # dropped or ended meanwhile
                lost, detached = 0, st is not None and st.detached
                if st is not None:
                    task, p = st.inflight, st.pending
                    st.inflight, st.pending = None, None  # settled here: nothing merges it any more
                    if task is not None and p is not None and (task.cancelled() or task.exception() is not None):
                        if p.rejoined:  # in neither view (as ``_merge`` counts it)
                            lost += max(p.steps, p.fragment_steps)
                        else:  # its steps were to go with the next sync
                            st.unsent[p.fragment] += p.fragment_steps
                    lost += st.drop_unsent()
                del inner.jobs[job]
                why = inner.damaged.pop(job)
                self.outer.pop(job, None)  # (a leave still running with it stops: ``_leave_after``)
                old.abort(f"job {job}'s inner loop at this {self.role} tier failed and starts again from the "
                          "outer view", Stale)
            break
        else:
            log.error("%s: job %s: its inner loop failed and could not start again: its syncs kept coming; "
                      "restart this tier", self.role, job)
            return
        try:
            await self._ensure_inner(ojs)  # (a child registering meanwhile made it already: the same)
        except HpsError as exc:  # no outer view yet: the next child to register makes it
            log.warning("%s: job %s: its inner loop could not start again yet (%s); the next child to "
                        "register starts it", self.role, job, exc)
        ijs, new = inner.jobs.get(job), self.outer.get(job)
        if ijs is not None:
            ijs.stats.inner_steps_lost += old.stats.inner_steps_lost + lost
        log.warning("%s: job %s: its inner loop failed (%s) and started again from outer version %d; %d inner "
                    "step(s) since the last sync were lost", self.role, job, why, ojs.view.version, lost,
                    extra=event("outer.restarted", job=job, version=ojs.view.version, steps=lost))
        if detached and new is not None and ijs is not None and len(ijs.members) == 0:
            # Every child had left: the new lineage has none either, so it leaves the root's
            # rounds as the old one was leaving them (a child coming back rejoins: ``_rejoin``).
            new.detached = True
            await self._leave_root(job, new)
            return
        # The old lineage's children register again with the new one within a member timeout;
        # if none does (they died with it, or the new one could not start), the region must not
        # stay in the root's rounds, which would wait for its syncs for good (review).
        await asyncio.sleep(self.config.member_timeout_s)
        await self._leave_if_no_child(job)

    def note_old_lineage(self, job: str, view_epoch: int, since: int) -> None:
        """A child pulled holding ``since`` of another lineage: if it is one this process never
        served, a predecessor died with it; count the inner steps in no outer version."""
        ijs, st = self.inner.jobs.get(job) if self.inner else None, self.outer.get(job)
        if (ijs is None or st is None or not view_epoch or view_epoch == ijs.view.epoch or since <= 0
                or view_epoch in st.reported):
            return
        st.reported[view_epoch] = None
        if len(st.reported) > 64:
            del st.reported[next(iter(st.reported))]  # the oldest (a set dropped any one, to be counted again)
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

    # -- children's calls: the inner root answers for inner jobs ----------------------------
    def heartbeat(self, member: str, jobs: list[str], role: str = "worker", address: str = "",
                  workers: dict[str, int] | None = None) -> list[str]:
        unknown = super().heartbeat(member, [j for j in jobs if not self._inner(j)], role, address, workers)
        if self.inner is None:
            return unknown
        return unknown + self.inner.heartbeat(member, [j for j in jobs if self._inner(j)], role, address, workers)

    async def leave(self, job: str, member: str) -> None:
        if self.inner is not None and self._inner(job):
            return await self.inner.leave(job, member)
        return await super().leave(job, member)

    def open_push(self, meta: PushMeta) -> PushIntake:
        if self.inner is not None and self._inner(meta.job):
            return self.inner.open_push(meta)
        return super().open_push(meta)

    async def commit_push(self, intake: PushIntake, digest: bytes, resend_to: int = 0) -> Ack:
        if self.inner is not None and self._inner(intake.meta.job):
            return await self.inner.commit_push(intake, digest, resend_to)
        return await super().commit_push(intake, digest, resend_to)

    async def pull(self, job: str, member: str, view_epoch: int, since: int, min_version: int,
                   wait_s: float, min_clock: int = 0) -> PullReply:
        if self.inner is not None and self._inner(job):
            return await self.inner.pull(job, member, view_epoch, since, min_version, wait_s, min_clock)
        return await super().pull(job, member, view_epoch, since, min_version, wait_s, min_clock)

    async def resolve(self, job: str, keys: tuple[PushKey, ...], wait_s: float, asker: str = ""
                      ) -> tuple[str, int, int, bool]:
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
        st = self.outer.get(job)
        if st is not None:
            self._check_lease_timeout(job, st, dataset.lease_timeout_s)
        trained: tuple[tuple[int, int], ...] = ()
        for _ in range(_REASKS):
            grant = await super().lease(job, member, incarnation, dataset, epoch, want, held + trained)
            if grant.status != GRANTED or st is None:
                return grant
            end = st.progress.furthest(grant.epoch, grant.shard)
            if end < grant.end:
                return dataclasses.replace(grant, start=end) if end > grant.start else grant
            # Trained to its end here: the worker holds it at the root (its data is on its way
            # up) but never learns of it, so the root, asked again without it, would hand it
            # over as an answer lost on the way. Listed, the root hands the next shard.
            trained += ((grant.epoch, grant.shard),)
        return dataclasses.replace(grant, status=WAIT, shard=-1, start=0, end=0)

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
        if ijs is None:
            return super().workers_below(js)
        st = self.outer.get(js.config.name)
        if len(ijs.members) == 0 and st is not None:
            # Every worker left: the syncs sent as the region leaves carry their steps, at their
            # share (1, the floor of a memberless count, applied them at 4/5 for 4 of 8 workers).
            return st.workers
        return ijs.members.workers()

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

