"""A region's syncs with the root in an outer job (issue 17): its pseudo-gradients up, the
outer versions that applied them down, merged into the inner loop. Mixed into
``ps.tiers.outer.OuterRelay`` (it uses the relay's ``jobs``, ``inner``, ``outer``, ``role``,
``config``, ``clock``, ``up``, ``own_unsure``, ``unanswered``, ``_forward``, ``_fwd_locks``,
``_resolve_here`` and ``_resolve_wait_s``); ``ps.tiers.outer`` says what a region is.

A sync is a push of the region's own (no worker keys) through the relay's encoder, with its
residual: sent every ``OuterState.due`` inner versions (``after_inner_version``), at most one
in flight, awaited (``_wait_sync``) or, with overlap, merged at the first inner version after it
lands (``_merge``: the fragment takes the outer values, keeping what the region trained since).
One given up on unanswered is settled at the root before its steps go again (``_settle_sync``),
and one acknowledged is awaited in the outer view however long that takes (``_hold_outer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from ps.core.consistency import Aggregate
from ps.core.errors import Conflict, HpsError, Stale, UnknownJob, short
from ps.core.logs import event
from ps.core.outer import OuterPlan, PendingProgress, StepRate, dynamic_period
from ps.core.types import Ack, StepInfo
from ps.tiers.jobstate import RelayJob, RootJob
from ps.tiers.tier import APPLIED, NOT_APPLIED, UNKNOWN

__all__ = ["OuterState", "OuterSync", "Pending"]

log = logging.getLogger("hps.outer")

_OUTER_WAIT_S = 60.0  # a warning this often while the outer version that applied a sync is awaited
_SETTLE_BACKOFF_S = (0.5, 10.0)  # between asking the root about a sync given up on


@dataclass
class Pending:
    """A sync in flight: what was sent, and when."""

    fragment: int
    outer_version: int          # the outer version its pseudo-gradient is based on
    t0: float
    bytes_before: int           # the WAN edge's push bytes before it
    norm: float
    steps: int                  # the inner steps it carries
    fragment_steps: int         # the inner steps its fragment held since its last sync (``OuterState.unsent``)
    params: np.ndarray | None   # overlap: the parameters when it was sent (the region trains on)
    progress: int = 0           # the leased data it completes (PendingProgress.due's count)
    rejoined: bool = False      # sent before every child left, still in flight when one came back
    postponed: bool = False     # not landed within the job's sync_wait_s: the region trains on


@dataclass
class OuterState:
    """A region's side of one outer job: where its fragments stand."""

    plan: OuterPlan
    base: np.ndarray            # the outer values each fragment was last rebased on
    base_version: int = 0       # ... and their outer version, per fragment (``based``)
    workers: int = 1            # contributors of the last inner round (the pseudo-gradient's weight)
    scratch: np.ndarray | None = None
    detached: bool = False      # every child left: not in the root's rounds until one is back
    inflight: asyncio.Task | None = None  # the sync in flight
    pending: Pending | None = None
    reported: dict[int, None] = dataclasses.field(default_factory=dict)  # old lineages counted lost, oldest first
    sent: int = 0               # syncs made (an asynchronous job's fragments go in this turn)
    rate: StepRate = dataclasses.field(default_factory=StepRate)  # the region's inner steps per second
    pace: float = 0.0           # dynamic steps: the fastest region's rate, as the root last answered
    idle_rounds: int = 0        # inner versions without a gradient since the last sync (leased data ran out)
    progress: PendingProgress = dataclasses.field(init=False)  # leased data trained, not yet in every fragment's sync
    lease_warned: bool = False  # the lease timeout was said to be too short for the syncs
    postpone_said: float = float("-inf")  # when a postponed sync was last logged as a warning

    def __post_init__(self) -> None:
        self.progress = PendingProgress(self.plan.fragments)
        self.based = [self.base_version] * self.plan.fragments
        # Per fragment, the inner steps trained since its last sync went up: with F > 1 a
        # region that leaves holds steps in every fragment, not only in the one sent last.
        self.unsent = [0] * self.plan.fragments

    def unsynced(self) -> int:
        """Inner steps whose update is not wholly in a sync sent (the oldest fragment's)."""
        return max(self.unsent)

    def drop_unsent(self) -> int:
        """Forget what no sync will carry (the region rebased, or leaves without it): how many
        inner steps were lost."""
        lost, self.unsent = self.unsynced(), [0] * self.plan.fragments
        return lost

    def due(self, dynamic: bool) -> int:
        """Inner steps between two syncs now: the plan's period, or with dynamic steps that
        scaled by this region's speed against the fastest region's."""
        return dynamic_period(self.plan.period, self.rate.rate, self.pace) if dynamic else self.plan.period


class OuterSync:
    """The region's side of its syncs with the root (see the module)."""

    async def after_inner_version(self, ijs: RootJob, contributors: int) -> None:
        """The inner root published a version (its apply lock held): take in a sync that has
        landed, and send the next fragment's pseudo-gradient when due. Without overlap the
        region waits for that sync here; with it, training goes on and the outer result is
        merged at the first inner version after it lands (one step delayed, as in Streaming
        DiLoCo's overlap). At most one sync is in flight: a due sync waits for the last one --
        with the job's ``sync_wait_s``, at most that long (``_wait_sync``)."""
        name = ijs.config.name
        st = self.outer.get(name)
        if st is None or self.inner is None or self.inner.jobs.get(name) is not ijs:
            return  # (not ijs: a lineage that failed and started again, ``OuterRelay._restart_inner``)
        if contributors:
            st.workers = contributors
            ijs.stats.inner_steps_since_sync += 1
            st.unsent = [n + 1 for n in st.unsent]
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
        # sync_wait_s 0: as long as the sync is retried, the round timeout -- not without end: the
        # wait holds the inner job's apply lock, and the root down held the region for good.
        wait = outer.sync_wait_s if outer is not None and outer.sync_wait_s > 0 else self.config.round_timeout_s
        if st.pending.postponed:
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
        n, progress = st.progress.due(f)
        rate = st.rate.close()  # (measured always: the lease-timeout check reads it too)
        step = StepInfo(absent=st.plan.absent(f), buffers=st.workers if st.plan.buffers(f) else 0,
                        progress=progress, inner_rate=rate if dynamic else 0.0)
        # Asynchronous: the root measures staleness from the round, the outer version the
        # fragment was rebased on (labelled u, the version at sending, it read ~0 and damping
        # did nothing); synchronous: the root's round, which every region's sync is for.
        agg = Aggregate(round=st.based[f] if asynchronous else u, grad=st.scratch, contributors=st.workers,
                        clock_min=u, clock_max=u, members=(), step=step)
        overlap = ijs.config.outer is not None and ijs.config.outer.overlap
        st.pending = Pending(f, u, time.perf_counter(), ojs.stats.bytes_pushed_up,
                             st.plan.norm(st.scratch, f, st.workers), ijs.stats.inner_steps_since_sync,
                             st.unsent[f], ijs.params.copy() if overlap else None, n)
        ijs.stats.inner_steps_since_sync, st.idle_rounds = 0, 0
        st.unsent[f] = 0
        st.inflight = asyncio.create_task(self._round_trip(ojs, agg), name=f"outer-sync-{name}")

    async def _round_trip(self, ojs: RelayJob, agg: Aggregate) -> Ack:
        fut = asyncio.get_running_loop().create_future()
        sent_on = ojs.view.epoch
        await self._forward(ojs, agg, (), agg.clock_min, fut)  # retries within round_timeout_s; never raises
        ack: Ack = fut.result() if fut.exception() is None else await self._settle_sync(ojs, fut.exception())
        await self._hold_outer(ojs, ack, sent_on)
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
                    outcome, version, epoch, _ = await self._resolve_here(ojs, keys, wait_s,
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
                lost = max(p.steps, p.fragment_steps)  # (its fragment's since its own last sync)
                ijs.stats.inner_steps_lost += lost
                log.warning("%s: job %s: the sync sent before every member left failed: %s; its %d inner "
                            "step(s) are counted lost (the root may have applied them before the failure)",
                            self.role, name, short(str(exc), 200), lost,
                            extra=event("outer.steps_lost", job=name, steps=lost))
                return
            ijs.stats.inner_steps_since_sync += p.steps
            st.unsent[p.fragment] += p.fragment_steps
            log.warning("%s: job %s: the sync of fragment %d (outer version %d) failed: %s; training on, "
                        "its steps go with the next sync", self.role, name, p.fragment, p.outer_version,
                        short(str(exc), 200), extra=event("outer.sync_failed", job=name, version=p.outer_version))
            return
        st.sent += 1  # synced: the next fragment's turn (a failed sync tries the same one again)
        st.progress.synced(p.progress, p.fragment)
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
        st.based[p.fragment] = ojs.view.version
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

    async def _hold_outer(self, ojs: RelayJob, ack: Ack, sent_on: int) -> None:
        """Wait until the followed outer view holds the version that applied our push, however
        long that takes: the push was applied, so a sync counted failed here would send its
        steps again with the next one (applied twice; a slow WAN or a partition after the ack
        did that at 60 s). A warning every ``_OUTER_WAIT_S``. Only a lineage newer than the
        ack's (the root restarted after it) that lacks that version ends the wait: that root
        kept no record of it (no checkpoints), so the sync failed and its steps go again.
        ``sent_on``: the lineage the sync was sent on -- not the one held when the ack came: a
        relay's recorded ack of the old lineage, answering a retry after the root restarted and
        this region moved, made a lineage newer than the ack's look like the start, for good."""
        start, reached = sent_on, False
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
