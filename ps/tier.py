"""What every tier does with what passes through: membership, BSP rounds, pushes, pulls.

    tier = Root(ServerConfig(role="global"))           # or Relay(config, upstream)
    ack = await tier.push(meta, chunks)                 # returns once the root applied it
    meta, versions = await tier.pull("lm", epoch, since=3, min_version=4, wait_s=5)

This is the async shell over the pure core (store, deltas, consistency, tensors): it owns the
event-loop waiting (version waits, round futures) and nothing about protobuf. ``Root`` and
``Relay`` differ only in how a closed round is finished and where views come from.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import replace

from ps.config import ServerConfig
from ps.consistency import Aggregate, BspRound, SeqBook
from ps.errors import NotReady, Stale, TimedOut, UnknownJob
from ps.jobstate import Ack, JobState, JobStats, Registration
from ps.tensors import Chunk, assemble, payload_bytes
from ps.wire import PullMeta, PushMeta, VersionMeta

# JobState and friends live in ps.jobstate; re-exported here for the tiers built on Tier.
__all__ = ["Tier", "JobState", "Ack", "Registration", "JobStats"]

log = logging.getLogger("hps.tier")


def new_epoch() -> int:
    """A fresh, non-zero incarnation id."""
    return secrets.randbits(62) | 1


class Tier:
    """Behaviour shared by the root and the relays."""

    role = "tier"

    def __init__(self, config: ServerConfig, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.epoch = new_epoch()
        self.started = clock()
        self.jobs: dict[str, JobState] = {}
        self.children: dict[str, tuple[str, str, float]] = {}  # relay id -> (role, address, seen)
        self.ended: dict[str, int] = {}  # job -> its last version
        self._tasks: list[asyncio.Task] = []

    # -- lookups ---------------------------------------------------------------------------
    def job(self, name: str) -> JobState:
        try:
            return self.jobs[name]
        except KeyError:
            if name in self.ended:
                raise UnknownJob(f"job {name!r} has ended (at version {self.ended[name]})") from None
            raise UnknownJob(f"job {name!r} is not known at this {self.role} tier; create it first "
                             "(the first worker with a JobConfig does) or check the name") from None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._expire_loop(), name="expire"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now = self.clock()
            for k in [k for k, c in self.children.items() if now - c[2] > self.config.member_timeout_s]:
                del self.children[k]
            for js in list(self.jobs.values()):
                gone = js.members.expire(now, self.config.member_timeout_s)
                if gone:
                    log.warning("%s: job %s dropped members %s after %.1fs of silence",
                                self.role, js.config.name, gone, self.config.member_timeout_s)
                    await self._members_changed(js)

    async def _members_changed(self, js: JobState) -> None:
        """Membership shrank: the open round may now be complete, the clock floor higher."""
        self._progress(js)
        self._flush_floor(js)

    # -- membership ------------------------------------------------------------------------
    async def register(self, job: str, member: str, role: str, address: str, last_seq: int) -> Registration:
        js = await self._job_for_register(job)
        start_clock = js.view.clock_min  # a late joiner must not hold the others back (SSP)
        m = js.members.join(member, self.clock(), js.round.round, role, address, floor=start_clock)
        book = js.books.setdefault(member, SeqBook())
        if not any(k[0] == member for k in js.pending):
            # A (re)starting member continues after the last sequence number it used.
            book.highest = last_seq
            for s in [s for s in book.acks if s > last_seq]:
                del book.acks[s]
        log.info("%s: %s %r joined job %s at round %d", self.role, role, member, job, m.first_round)
        return Registration(js.config, js.layout, max(m.first_round, js.round.round), self.epoch,
                            start_clock)

    async def _job_for_register(self, job: str) -> JobState:
        return self.job(job)

    def heartbeat(self, member: str, jobs: list[str], role: str = "worker", address: str = "") -> list[str]:
        now = self.clock()
        if address:  # a relay child: remembered for `hps status` even while it has no job
            self.children[member] = (role, address, now)
        return [j for j in jobs if j not in self.jobs or not self.jobs[j].members.touch(member, now)]

    async def leave(self, job: str, member: str) -> None:
        js = self.job(job)
        if js.members.leave(member):
            log.info("%s: %r left job %s", self.role, member, job)
            await self._members_changed(js)

    # -- push ------------------------------------------------------------------------------
    async def push(self, meta: PushMeta, chunks: list[Chunk]) -> Ack:
        js = self.job(meta.job)
        member = js.members.get(meta.sender)
        book = js.books.setdefault(meta.sender, SeqBook())
        kind = book.classify(meta.seq)
        if kind == "duplicate":
            return replace(book.acks[meta.seq], duplicate=True)
        if kind == "seen":
            fut = js.pending.get((meta.sender, meta.seq))
            if fut is not None:  # the same push is still in the round: share its outcome
                return replace(await asyncio.shield(fut), duplicate=True)
            # Otherwise it was refused and never applied; the checks below decide afresh
            # (a push from a round that has closed is refused as stale).
        if meta.view_epoch and js.view.ready and meta.view_epoch != js.view.epoch:
            raise Stale(f"gradient computed on a view of root epoch {meta.view_epoch:#x}; this tier "
                        f"holds epoch {js.view.epoch:#x} (the root restarted): pull a snapshot")
        if js.bsp:
            if (not js.round.pushed and js.view.ready
                    and js.round.round < meta.base_version <= js.view.version):
                # An empty round behind the held version: reopened after a refusal while the
                # parent went on (seen after a root kill -9: the zone stayed at round 7 holding
                # version 8, and every push on 8 was told to retry until the worker gave up).
                # Nobody can complete it any more; the push opens the round of its version.
                log.info("%s: round %d of %s is behind version %d; moving to round %d", self.role,
                         js.round.round, meta.job, js.view.version, meta.base_version)
                js.round = BspRound(round=meta.base_version, numel=js.layout.numel)
            js.round.check(meta.sender, meta.base_version)
        else:
            js.window.check(meta.sender)
            if js.view.ready and meta.base_version > js.view.version:
                raise NotReady(f"gradient computed on version {meta.base_version}, ahead of this tier's "
                               f"{js.view.version}; the tier is still catching up, retry shortly")
        if meta.contributors == 0:
            if chunks:
                raise NotReady("a push with 0 contributors must carry no tensors")
            grad = None
        else:
            grad = assemble(js.layout, chunks, what=f"push {meta.seq} from {meta.sender!r}")
        # Everything is validated: from here the push is committed to the round.
        book.accept(meta.seq)
        nbytes = payload_bytes(chunks)
        clocks = (meta.clock_min, meta.clock_max)
        if js.bsp:
            js.round.add(meta.sender, meta.base_version, grad, meta.contributors, clocks)
        else:
            js.window.add(meta.sender, meta.base_version, grad, meta.contributors, clocks, nbytes, self.clock())
        member.pushes += 1
        member.floor = max(member.floor, meta.clock_floor)
        member.workers = meta.workers
        self._telemetry(js, meta)
        js.stats.pushes += 1
        js.stats.bytes_pushed_in += nbytes
        fut = js.open_future()
        key = (meta.sender, meta.seq)
        js.pending[key] = fut
        fut.add_done_callback(lambda f: self._settle(js, book, key, f))
        t0 = self.clock()
        self._progress(js)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.config.round_timeout_s)
        except asyncio.TimeoutError:
            raise TimedOut(f"the push's {'round' if js.bsp else 'window'} did not complete within "
                           f"{self.config.round_timeout_s:.0f}s; the push stays in it") from None
        finally:
            js.stats.round_wait_ms_sum += int((self.clock() - t0) * 1000)

    @staticmethod
    def _telemetry(js: JobState, meta: PushMeta) -> None:
        """Count what the push reports about training (never part of the update)."""
        if not (math.isfinite(meta.loss_sum) and math.isfinite(meta.step_seconds_sum)
                and meta.step_seconds_sum >= 0 and meta.loss_count >= 0):
            return  # a NaN loss would poison every sum after it; the metrics show it stalled
        st = js.stats
        st.loss_sum += meta.loss_sum
        st.loss_count += meta.loss_count
        st.step_seconds_sum += meta.step_seconds_sum
        loss, n, secs = js.unsent_report
        js.unsent_report = (loss + meta.loss_sum, n + meta.loss_count, secs + meta.step_seconds_sum)

    @staticmethod
    def _settle(js: JobState, book: SeqBook, key: tuple[str, int], fut: asyncio.Future) -> None:
        """Record the outcome even when the pusher is gone (its retry gets the same ack)."""
        js.pending.pop(key, None)
        if not fut.cancelled() and fut.exception() is None:
            book.record(key[1], fut.result())

    def _progress(self, js: JobState) -> None:
        """Close the open batch if it is ready: a complete round, or a due window."""
        if js.bsp:
            self._maybe_close(js)
        else:
            self._maybe_flush(js)

    def _maybe_close(self, js: JobState) -> None:
        if not js.round.complete(js.members):
            return
        agg = js.round.close()
        fut = js.close_batch()
        js.round = BspRound(round=agg.round + 1, numel=js.layout.numel)
        js.stats.rounds += 1
        self._finish_round(js, agg, js.members.floor(js.view.clock_min), fut)

    def in_flight_limit(self, js: JobState) -> int:
        """Closed windows of ``js`` that may be in flight at once at this tier: one (the root
        applies versions in order; ssp clock floors must reach the parent in order)."""
        return 1

    def _maybe_flush(self, js: JobState, force: bool = False) -> None:
        """Close the window when due (time or bytes), with at most ``in_flight_limit``
        closed batches in flight."""
        if js.inflight >= self.in_flight_limit(js) or not js.window.pushed:
            return
        now, flush_s = self.clock(), self.config.flush_ms / 1000.0
        if not (force or js.window.due(now, flush_s, self.config.flush_bytes)):
            if js.timer is None:
                def fire() -> None:
                    js.timer = None
                    self._maybe_flush(js)
                delay = max(0.0, js.window.opened + flush_s - now)
                js.timer = asyncio.get_running_loop().call_later(delay, fire)
            return
        if js.timer is not None:
            js.timer.cancel()
            js.timer = None
        agg = js.window.close(default_base=js.view.version)
        fut = js.close_batch()
        js.window = js.new_window()
        js.inflight += 1
        js.stats.rounds += 1
        fut.add_done_callback(lambda _: self._window_done(js))
        self._finish_round(js, agg, js.members.floor(js.view.clock_min), fut)

    def _window_done(self, js: JobState) -> None:
        js.inflight = max(0, js.inflight - 1)
        self._maybe_flush(js)

    def _flush_floor(self, js: JobState) -> None:
        """SSP: membership shrank and the clock floor rose; send the news up even with nothing
        to aggregate, so a dead worker stops holding the others back."""
        if js.bsp or js.members.floor(js.view.clock_min) <= js.reported_floor or not len(js.members):
            return
        if not js.window.pushed and not js.inflight:
            js.window.add(f"{self.role}:floor", js.view.version, None, 0, (0, 0), 0, self.clock())
            self._maybe_flush(js, force=True)

    def _finish_round(self, js: JobState, agg: Aggregate, floor: int, fut: asyncio.Future) -> None:
        """Apply (root) or forward (relay) a closed batch; resolve ``fut`` with the Ack."""
        raise NotImplementedError

    # -- pull ------------------------------------------------------------------------------
    async def pull(self, job: str, member: str, view_epoch: int, since: int, min_version: int,
                   wait_s: float, min_clock: int = 0) -> tuple[PullMeta, list[tuple[VersionMeta, list[Chunk]]]]:
        js = self.job(job)
        if member not in js.members and member not in self.children:
            # A guard against mistakes (a worker of one job reading another's keys), not
            # authentication: the member id is the caller's own word.
            raise NotReady(f"{member or 'an anonymous caller'!r} is not a member of job {job!r} here; "
                           "register for the job before pulling its parameters")
        deadline = self.clock() + max(0.0, wait_s)

        def must_wait() -> bool:
            if not js.view.ready:
                return True
            # A caller from another lineage needs a snapshot now: its version numbers do not
            # compare with ours.
            return view_epoch == js.view.epoch and (js.view.version < min_version or
                                                    js.view.clock_min < min_clock)

        while must_wait() and self.clock() < deadline:
            await js.wait_change(deadline - self.clock())
            js = self.job(job)  # ended while we waited: UnknownJob
        if not js.view.ready:
            raise NotReady(f"this {self.role} tier has no view of job {job!r} yet (still syncing "
                           "with its parent); retry shortly")
        v = js.view.version
        if view_epoch == js.view.epoch:
            entries = js.log.since(since, v)
            nbytes = sum(e.nbytes for e in entries) if entries else 0
            # A worker keeps no log, so it takes the view itself when that is smaller than the
            # deltas (dense deltas: any two). ssp/async workers fall several versions behind
            # between pulls: measured 8 dense deltas per pull on the demo, 8x the bytes.
            if entries is not None and (len(entries) <= 1 or nbytes <= 4 * js.layout.numel
                                        or not self._is_worker(js, member)):
                js.stats.deltas_served += len(entries)
                js.stats.bytes_pulled_out += nbytes
                versions = [(VersionMeta(e.version, e.checksum, e.clock_min, e.contributors), list(e.chunks))
                            for e in entries]
                return PullMeta(js.view.epoch, since, v, False, self.epoch), versions
        chunks = js.snapshot_chunks()
        js.stats.snapshots_served += 1
        js.stats.bytes_pulled_out += payload_bytes(chunks)
        return (PullMeta(js.view.epoch, since, v, True, self.epoch),
                [(VersionMeta(v, js.view.checksum, js.view.clock_min), chunks)])

    @staticmethod
    def _is_worker(js: JobState, member: str) -> bool:
        return member in js.members and js.members.get(member).role == "worker"

    # -- status ----------------------------------------------------------------------------
    def parent_reachable(self) -> bool:
        return True  # the root has no parent

    def status(self) -> dict:
        now = self.clock()
        jobs = []
        for name, js in self.jobs.items():
            jobs.append(dict(
                name=name, mode=js.config.mode, version=js.view.version, view_epoch=js.view.epoch,
                parent_version=js.parent_version or js.view.version,
                # Behind the parent, or cut off from it (then we cannot know how far behind).
                lag_s=(now - js.synced_at) if js.synced_at and (js.parent_version > js.view.version
                                                                or not self.parent_reachable()) else 0.0,
                round=js.round.round if js.bsp else js.stats.rounds,
                round_pushed=len(js.round.pushed if js.bsp else js.window.pushed),
                checksum=js.view.checksum, clock_min=js.view.clock_min,
                members=[dict(member=m.id, role=m.role, address=m.address,
                              last_seen_s=now - m.last_seen, pushes=m.pushes) for m in js.members],
                **js.stats.__dict__))
        children = [dict(member=k, role=r, address=a, last_seen_s=now - t, pushes=0)
                    for k, (r, a, t) in self.children.items()]
        return dict(role=self.role, name=self.config.display_name, server_epoch=self.epoch,
                    parent=self.config.parent, uptime_s=now - self.started, jobs=jobs,
                    children=children)
