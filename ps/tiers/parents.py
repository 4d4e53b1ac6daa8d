"""A relay's side of its parents: heartbeats, a parent lost and regained, failover to an
alternate parent, and the move back (``ParentLink``, mixed into ``ps.tiers.relay.Relay``,
whose upstream link, jobs and rounds it uses).

Alternate parents (``--parent A,B``; issue 15). A relay whose parent stops answering -- at once
when nothing listens there any more (a killed process), else after the member timeout --
registers every job it holds with the next parent in turn and goes on from there: a sibling
that follows the same root holds the same lineage (root epoch, version numbers, contents), so
the follow loop resumes from deltas, else from a snapshot. The two roots of a hot-standby pair
are such siblings (``--parent ROOT_A,ROOT_B``): a standby answers heartbeats but refuses
registrations and pushes (``NotPrimary``) until it takes over, so a relay stays on it for up to
the member timeout (a takeover comes within the lease), then tries the next parent in the list.
A push it had sent up through the parent it left is first resolved at the root through the new
one (``Resolve``, ``Relay._resolve_moved``): applied, it is acknowledged; not applied, it is
sent again; so none is applied twice. Its children see a pause. Readiness goes once the relay
has been cut off from every parent longer than the member timeout (its parent has dropped it by
then: the view it serves no longer moves).

On an alternate, a relay asks its first parent every member timeout whether it is a relay ready
for children (a gRPC health check, tokenless: ``Upstream.relay_ready``); ready at two probes in
a row, the first parent takes the jobs back (``_home_loop``), as a switch does, between two bsp
rounds. A root answers that it is none: of a root pair, the relay follows whichever is the
primary.
"""

from __future__ import annotations

import asyncio
import logging

from ps.core.errors import HpsError, NotPrimary, short
from ps.core.logs import event
from ps.net.upstream import Upstream

__all__ = ["ParentLink"]

log = logging.getLogger("hps.relay")


class ParentLink:
    """Heartbeats to the parent in use, failover and the move back: mixed into ``Relay``
    before ``Tier`` (it uses ``self.up``, ``attached``, ``jobs`` and the relay's locks)."""

    async def _heartbeat_loop(self) -> None:
        lost_at: float | None = None  # monotonic time the current parent stopped answering
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            known = self.up.server_epoch
            parent = self.up.current
            try:
                jobs = sorted(self.attached)
                epoch, unknown = await self.up.heartbeat(
                    jobs, [self.workers_below(self.jobs[j]) if j in self.jobs else 0 for j in jobs])
            except HpsError as exc:
                now = self.clock()
                if self.cut_off_at is None:
                    self.cut_off_at = now
                if lost_at is None:  # once per outage: the transition is the event
                    lost_at = now
                    log.warning("%s: parent %s unreachable: %s", self.role, parent, exc,
                                extra=event("parent.lost", parent=parent))
                else:
                    log.debug("%s: parent %s still unreachable: %s", self.role, parent, exc)
                if len(self.up.parents) > 1 and (self.up.hard_failure
                                                 or now - lost_at >= self.config.member_timeout_s):
                    await self._switch_parent(parent, exc)
                    lost_at = None  # the next parent gets its own member timeout
                continue
            refused = self.up.refused_since
            if len(self.up.parents) > 1 and refused is not None \
                    and asyncio.get_running_loop().time() - refused >= self.config.member_timeout_s:
                # A root that is not the primary (a standby) answers, but takes no registration or
                # push. Right after a primary died its standby is about to take over (within the
                # lease, shorter than the member timeout): stay. Past the member timeout this one
                # is not taking over (a relay restarted after a takeover, its first parent now
                # the old primary as a standby): the primary is another parent in the list.
                await self._switch_parent(parent, NotPrimary(f"{parent} refused writes for "
                                                             f"{self.config.member_timeout_s:g}s as a root "
                                                             "that is not the primary"))
                continue
            if self.cut_off_at is not None:
                log.warning("%s: parent %s reachable after %.1fs", self.role, parent,
                            self.clock() - self.cut_off_at,
                            extra=event("parent.regained", parent=parent,
                                        seconds=round(self.clock() - self.cut_off_at, 3)))
            lost_at = self.cut_off_at = None
            self.up.server_epoch = epoch
            if known and epoch != known:
                log.warning("%s: parent %s restarted (epoch %#x -> %#x); registering again",
                            self.role, parent, known, epoch,
                            extra=event("parent.restarted", parent=parent))
                unknown = sorted(self.attached)
            await self._register_again(unknown)

    async def _register_again(self, unknown: list[str]) -> None:
        """Register the jobs the parent forgot, and jobs detached after a refusal (NotReady) or a
        switch of parents that still have children here: their rounds never close otherwise."""
        detached = [j for j in self.jobs if j not in self.attached and self._has_children(j)]
        for job in sorted(set(unknown) | set(detached)):
            self.attached.discard(job)
            if job in self.jobs and self._has_children(job):
                try:
                    await self._job_for_register(job)
                except HpsError as exc:
                    log.warning("%s: re-registering job %s failed: %s", self.role, job, exc)

    def _has_children(self, job: str) -> bool:
        """Members below hold ``job`` here (a job without any is not registered again)."""
        return len(self.jobs[job].members) > 0

    async def _switch_parent(self, old: str, why: HpsError) -> None:
        """Move to the next parent in turn and register every job held here with it."""
        jobs = sorted(self.attached)
        new = self.up.switch(jobs)
        self.attached.clear()
        log.warning("%s: parent %s is gone (%s); switching to %s (alternate %d of %d)", self.role, old,
                    short(str(why), 160), new, self.up.index + 1, len(self.up.parents),
                    extra=event("parent.switched", parent=new, previous=old, switches=self.up.switches))
        await self._register_again([])

    async def _home_loop(self) -> None:
        """On an alternate parent: move back to the first one once it has served for a while.
        An alternate is where a zone goes while its own regional master is down, often in
        another region, so every round would cross the WAN until the zone restarted. Every
        member timeout the first parent is asked whether it is a relay ready for children
        (``Upstream.relay_ready``: synced with its own parent); ready on two probes in a row, it
        takes the jobs back, at a moment no bsp round is on its way up (a round forwarded
        through the alternate finishes there) and no job is being attached. The parents of a
        root pair are skipped: a relay follows whichever root is the primary."""
        period = max(self.config.member_timeout_s, self.config.heartbeat_s)
        ready = 0  # probes in a row that found the first parent ready
        while True:
            await asyncio.sleep(period)
            if self.up.index == 0:
                ready = 0
                continue
            try:
                answer = await self.up.relay_ready(0, period)
            except HpsError:
                ready = 0
                continue
            if answer is None:  # a root (or a build that cannot say): nothing to go back to
                self.up.close_probe()
                return
            ready = ready + 1 if answer else 0
            if ready >= 2 and await self._between_rounds(period) and self.up.index != 0:
                ready = 0
                old, jobs = self.up.current, sorted(self.attached)
                self.up.switch(jobs, to=0)
                self.attached.clear()
                log.warning("%s: first parent %s is ready again (two health checks %gs apart); moving "
                            "back to it from %s", self.role, self.up.current, period, old,
                            extra=event("parent.returned", parent=self.up.current, previous=old,
                                        switches=self.up.switches))
                await self._register_again([])

    async def _between_rounds(self, within: float) -> bool:
        """Wait (up to ``within`` seconds) until no bsp/ssp round is being forwarded up and no job
        is being attached or left (a registration in flight to the parent being left)."""
        deadline = self.clock() + within
        while len(self._locks) or any(lock.locked() for lock in self._fwd_locks.values()):
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(min(0.01, self.config.heartbeat_s))
        return True

    def parent_reachable(self) -> bool:
        return self.up.reachable

    def parent_link(self) -> Upstream:
        return self.up

    def parent_address(self) -> str:
        return self.up.current

    def parent_failover(self) -> tuple[tuple[str, ...], int, float]:
        cut = 0.0 if self.cut_off_at is None else self.clock() - self.cut_off_at
        return self.up.parents, self.up.switches, cut

    def synced(self) -> bool:
        """The parent has answered (a heartbeat or a register; ``server_epoch`` is never
        cleared), every job held here has a view from it, and this relay has not been cut off
        from every parent for longer than the member timeout. A shorter outage (a parent
        restarting, a switch to an alternate) keeps readiness: the relay still serves the view
        it holds, and flipping readiness would empty the Kubernetes Services below it. A longer
        one means the parent has dropped this relay: its view no longer moves, and workers are
        better sent to a zone that still trains (issue 15)."""
        answered = bool(self.up.reachable or self.up.server_epoch)
        cut_off = self.cut_off_at is not None and self.clock() - self.cut_off_at > self.config.member_timeout_s
        return answered and not cut_off and all(js.view.ready for js in self.jobs.values())
