"""What every tier does about who is in a job: joins (and new incarnations), goodbyes,
heartbeats, and dropping members that went silent -- with the tier's own stalls excused. Mixed
into ``ps.tiers.tier.Tier`` (it uses ``config``, ``clock``, ``role``, ``jobs``, ``children``,
``replaced``, ``job``, ``_progress`` and ``_flush_floor``); a member's push leaving the open
batch is the batch's business (``JobState.fail_open``).
"""

from __future__ import annotations

import asyncio
import logging

from ps.core.config import check_member, check_name
from ps.core.errors import BadInput, Conflict, Exhausted, Unavailable
from ps.core.logs import event
from ps.core.outer import check_outer_member
from ps.core.types import Registration
from ps.tiers.jobstate import JobState

__all__ = ["Membership"]

log = logging.getLogger("hps.tier")

MAX_WORKERS_SAID = 1 << 20  # workers one relay may say it speaks for (a count, bounded)
MAX_CHILDREN = 4096  # relay children listed (by heartbeat) at most: a tree has tens
_REPLACED_KEPT = 8  # incarnations remembered per member id, to catch two processes sharing one
MAX_REPLACED_IDS = 4096  # member ids whose replaced incarnations are remembered (newest replaced first)


class Membership:
    """Joins, goodbyes, heartbeats and expiry of a tier's members (see the module)."""

    async def _expire_loop(self) -> None:
        while True:
            slept = self.clock()  # after the last pass: a pass that waits on a parent is no stall
            await asyncio.sleep(self.config.heartbeat_s)
            now = self.clock()
            # Only a stall that matters: excusing every bit of a busy loop's lateness would
            # stretch the member timeout for a member that really died.
            late = now - slept - self.config.heartbeat_s
            if late > max(self.config.heartbeat_s, self.config.member_timeout_s / 4):
                self._stalled(late, now)
            try:
                await self._expire(now)
            except Exception:  # one bad pass must not end expiry for good (rounds would wait forever)
                log.exception("%s: expiring members failed; trying again in %gs", self.role,
                              self.config.heartbeat_s)

    def _stalled(self, seconds: float, now: float) -> None:
        """This pass came ``seconds`` late: the tier's own loop or process stalled (a long
        synchronous step, a GC pause, a starved CPU), and heartbeats that came meanwhile are
        still queued. That is not silence of its children: excused, as Cassandra's failure
        detector ignores its own pauses, so one stall does not drop every member at once."""
        for k, (role, address, seen) in list(self.children.items()):
            self.children[k] = (role, address, min(seen + seconds, now))
        for js in self.jobs.values():
            js.members.excuse(seconds, now)
        level = logging.WARNING if seconds >= self.config.member_timeout_s / 2 else logging.DEBUG
        log.log(level, "%s: stalled for %.2fs (its event loop or process did not run); not counted as its "
                "members' silence", self.role, seconds, extra=event("tier.stalled", seconds=round(seconds, 3)))

    async def _expire(self, now: float) -> None:
        """One pass: forget silent children, drop silent members, then the tier's housekeeping."""
        for k in [k for k, c in self.children.items() if now - c[2] > self.config.member_timeout_s]:
            del self.children[k]
        for js in list(self.jobs.values()):
            before = {m.id: (m.role, m.address) for m in js.members}
            gone = js.members.expire(now, self.config.member_timeout_s)
            for member in gone:
                js.lost[member] = (*before[member], now)
            if gone:
                log.warning("%s: job %s dropped members %s after %.1fs of silence",
                            self.role, js.config.name, gone, self.config.member_timeout_s,
                            extra=event("member.expired", job=js.config.name, members=gone,
                                        version=js.view.version))
                js.stats.members_expired += len(gone)
                for member in gone:
                    self._drop_member(js, member, "timed out")
                await self._members_changed(js)
        await self._housekeeping(now)

    async def _housekeeping(self, now: float) -> None:
        """Periodic work of a kind of tier (the root reaps jobs nobody joined)."""

    async def _members_changed(self, js: JobState) -> None:
        """Membership shrank: the open round may now be complete, the clock floor higher."""
        self._progress(js)
        self._flush_floor(js)

    def _drop_member(self, js: JobState, member: str, why: str) -> None:
        """``member`` is no longer in the job (already out of ``js.members``): its push leaves the
        open batch, which restarts; its sequence book is kept a while for late retries."""
        js.retire(member)
        pushed = js.round.pushed if js.bsp else js.window.pushed
        if member not in pushed:
            return
        label = f"round {js.round.round}" if js.bsp else "the open window"
        n = js.fail_open(Unavailable(f"{label} of job {js.config.name} restarted: member {member!r} "
                                     f"{why} with its push in it; push again"))
        js.stats.restarted_rounds += 1
        log.warning("%s: %s of job %s restarted without %r (%s); %d push(es) asked to resend",
                    self.role, label, js.config.name, member, why, n - 1,
                    extra=event("round.restarted", job=js.config.name, member=member, reason=why,
                                version=js.view.version))

    # -- membership ------------------------------------------------------------------------
    async def register(self, job: str, member: str, role: str, address: str, last_seq: int,
                       incarnation: int) -> Registration:
        self.check_register(job, member, incarnation)
        js = await self._job_for_register(job)
        check_outer_member(js.config, self.role, member, role)
        old = js.members.find(member)
        if old is not None and old.incarnation != incarnation:
            if incarnation in self.replaced.get(member, ()):
                raise Conflict(f"member id {member!r} is used by two processes (incarnation "
                               f"{incarnation:#x} was replaced by {old.incarnation:#x}); give each "
                               "worker or relay its own id")
            kept = self.replaced.setdefault(member, [])
            kept.append(old.incarnation)
            del kept[:-_REPLACED_KEPT]
            self.replaced.move_to_end(member)
            while len(self.replaced) > MAX_REPLACED_IDS:
                self.replaced.popitem(last=False)
            js.members.leave(member)
            js.stats.members_replaced += 1
            self._drop_member(js, member, "was replaced by a new incarnation (it restarted)")
            log.info("%s: %r in job %s is a new incarnation %#x (was %#x)", self.role, member, job,
                     incarnation, old.incarnation, extra=event("member.replaced", job=job, member=member))
        js.lost.pop(member, None)  # back: no longer lost
        # A late joiner must not hold the others back (SSP), nor lower a floor this tier sent up:
        # its parent keeps each child's highest, so a joiner below it went unbounded above.
        start_clock = max(js.view.clock_min, js.reported_floor, js.floor_sent)
        m = js.members.join(member, self.clock(), js.round.round, role, address, floor=start_clock,
                            incarnation=incarnation)
        js.joined = True
        book = js.book(member, incarnation)
        if not book.pending:
            # A (re)starting member continues after the last sequence number it used.
            book.highest = max(book.highest, last_seq)
        log.info("%s: %s %r joined job %s at round %d", self.role, role, member, job, m.first_round,
                 extra=event("member.joined", job=job, member=member, role=role, version=js.view.version))
        return Registration(js.config, js.layout, max(m.first_round, js.round.round), self.epoch,
                            start_clock)

    @staticmethod
    def check_register(job: str, member: str, incarnation: int) -> None:
        """A registration's own fields, checked before anything is joined (a relay joins its
        parent for the job first: a bad request must not leave it holding the parent's rounds)."""
        check_name(job)
        check_member(member)
        if not incarnation:
            raise BadInput("register needs the caller's incarnation (a non-zero random id per process)")

    async def _job_for_register(self, job: str) -> JobState:
        return self.job(job)

    def heartbeat(self, member: str, jobs: list[str], role: str = "worker", address: str = "",
                  workers: dict[str, int] | None = None) -> list[str]:
        now = self.clock()
        # A relay child, remembered for `hps status` even while it has no job; only one whose
        # role check (``ps.server.peers``) ran as a relay: a worker's heartbeat that named an
        # address made its name a "relay" here, and that worker's own calls were then refused.
        if address and role != "worker":
            if member not in self.children and len(self.children) >= MAX_CHILDREN:
                raise Exhausted(f"this tier already lists {MAX_CHILDREN} relay children; {member!r} is not added")
            self.children[member] = (role, address[:256], now)
        unknown = [j for j in jobs if j not in self.jobs or not self.jobs[j].members.touch(member, now)]
        if workers and role != "worker":
            # A relay's live workers, as its pushes report them: an asynchronous job weighs each
            # update by its share of every member's workers, and a member that had not pushed
            # yet counted as one (a region of 8 workers' first pseudo-gradient applied at 8/9,
            # not 1/2, while the other region of 8 had not synced).
            for j, n in workers.items():
                m = self.jobs[j].members.find(member) if j in self.jobs else None
                if m is not None:
                    m.workers = min(n, MAX_WORKERS_SAID)
        return unknown

    async def leave(self, job: str, member: str) -> None:
        js = self.job(job)
        js.lost.pop(member, None)  # a goodbye after an expiry (a worker cut off, then done)
        if js.members.leave(member):
            log.info("%s: %r left job %s", self.role, member, job,
                     extra=event("member.left", job=job, member=member, version=js.view.version))
            js.stats.members_left += 1
            self._drop_member(js, member, "left")
            await self._members_changed(js)
