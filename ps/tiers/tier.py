"""What every tier does with what passes through: BSP rounds, pushes, pulls (who is in a job:
``ps.tiers.membership``, mixed in).

>>> import numpy as np
>>> from ps.core.codecs import get_codec
>>> from ps.core.config import JobConfig
>>> from ps.core.tensors import split
>>> from ps.core.view import KeySpec, Layout
>>> from ps.tiers.root import Root
>>> async def one_round():
...     tier = Root(ServerConfig(role="global"))    # or Relay(config)
...     await tier.start()
...     layout = Layout([KeySpec("w", (3,))])
...     await tier.create_job(JobConfig(name="lm"), layout, np.zeros(3, np.float32))  # BSP
...     await tier.register("lm", "w0", "worker", "", last_seq=0, incarnation=0x5eed)
...     meta = PushMeta(job="lm", sender="w0", seq=1, base_version=0, incarnation=0x5eed)
...     chunks = split(layout, np.ones(3, np.float32), get_codec("fp32"))
...     ack = await tier.push(meta, chunks, digest=bytes(16))   # once the root applied it
...     pulled, versions = await tier.pull("lm", "w0", ack.view_epoch, since=0, min_version=1, wait_s=5)
...     await tier.stop()
...     return ack.applied_version, pulled.snapshot, [vm.version for vm, chunks in versions]
>>> asyncio.run(one_round())        # the one member's push closed round 1: delta 0 -> 1
(1, False, [1])

``push`` is ``open_push(meta)`` (header checks, memory reserved) then ``intake.add(chunks)``
as frames arrive and ``commit_push(intake, digest)``; ``digest`` is the push body's XXH3-128
(``ps.net.frames``), its identity for exactly-once.

This is the async shell over the pure core (store, deltas, consistency, exactly_once,
tensors): it owns the event-loop waiting (version waits, batch futures) and nothing about
protobuf. ``Root`` and ``Relay`` differ in how a closed batch is finished, where views come
from, and who answers "was this push applied?" (``resolve``).

Exactly once (invariant 4). A push is (member, incarnation, seq) with one body (its digest).
A retry of an applied push gets the recorded ack; one still in a batch shares its outcome; one
that cannot be placed (its round closed, or the root restarted) is resolved -- the root keeps
which worker pushes each version applied -- before anyone is told Stale. A member that leaves,
times out or is replaced by a new incarnation takes its push out of the open batch: the batch
restarts and its other pushers resend (the sum cannot be un-added exactly).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import replace

from ps.core.config import ServerConfig, check_member
from ps.core.consistency import MAX_CONTRIBUTORS, Aggregate, BspRound
from ps.core.errors import (
    BadInput,
    Conflict,
    Exhausted,
    HpsError,
    NotMember,
    NotPrimary,
    NotReady,
    Stale,
    TimedOut,
    Unavailable,
    UnknownJob,
    short,
)
from ps.core.exactly_once import MAX_IN_FLIGHT
from ps.core.intake import ByteBudget, PushIntake
from ps.core.leases import Dataset, Grant
from ps.core.logs import event
from ps.core.ranks import RankInfo
from ps.core.tensors import Chunk, Pieces, all_finite, payload_bytes
from ps.core.types import Ack, JobStatus, MemberInfo, PullMeta, PushKey, PushMeta, TierStatus, VersionMeta
from ps.net.aio import wait_for
from ps.tiers.jobstate import JobState
from ps.tiers.membership import Membership

__all__ = ["Tier", "APPLIED", "NOT_APPLIED", "UNKNOWN"]

log = logging.getLogger("hps.tier")

# Outcomes of ``resolve``.
APPLIED, NOT_APPLIED, UNKNOWN = "applied", "not_applied", "unknown"
_RESOLVE_WAIT_S = 30.0
# How long a pull from a caller ahead of this tier (same lineage) waits for the tier to catch up
# even when the caller asked not to wait (an async worker): a tier a moment behind its parent.
_AHEAD_WAIT_S = 2.0
_FLOOR_RETRY_S = 1.0  # a refused window's clock floor is sent again this much later


def new_epoch() -> int:
    """A fresh, non-zero incarnation id."""
    return secrets.randbits(62) | 1


class Tier(Membership):
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
        self.budget = ByteBudget(config.push_budget_mb << 20, f"this {config.role} tier")
        # member id -> incarnations replaced (newest last); the ids least recently replaced go
        # past MAX_REPLACED_IDS (a caller registering ever new ids grew it without bound)
        self.replaced: OrderedDict[str, list[int]] = OrderedDict()
        self._tasks: list[asyncio.Task] = []

    # -- lookups ---------------------------------------------------------------------------
    def job(self, name: str) -> JobState:
        try:
            return self.jobs[name]
        except KeyError:
            if name in self.ended:
                raise UnknownJob(f"job {short(name)} has ended (at version {self.ended[name]})") from None
            raise UnknownJob(f"job {short(name)} is not known at this {self.role} tier; create it first "
                             "(the first worker with a JobConfig does) or check the name") from None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._expire_loop(), name="expire"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # -- push ------------------------------------------------------------------------------
    def open_push(self, meta: PushMeta) -> PushIntake:
        """Check a push's header before its body arrives, and reserve what decoding it needs."""
        js = self.job(meta.job)
        member = js.members.get(meta.sender)
        if meta.incarnation != member.incarnation:
            raise NotMember(f"this process is not the registered incarnation of {meta.sender!r} (it "
                            "was replaced by a newer one, or never registered); register again")
        if meta.sources and member.role == "worker":
            raise BadInput("a worker's push names no sources: it is its own")
        # ``workers`` scales every update (``Membership.workers``): a worker is one, a relay at
        # most what a batch may sum. 2**32-1 from one member made every later update ~0.
        if meta.workers != 1 and member.role == "worker":
            raise BadInput(f"a worker's push counts {meta.workers} live workers; a worker is 1")
        if meta.workers > MAX_CONTRIBUTORS:
            raise BadInput(f"a push counts {meta.workers} live workers below its sender; at most {MAX_CONTRIBUTORS}")
        for k in meta.sources:  # worker push keys, as the root's log records them
            check_member(k.member)
            if len(k.digest) != 16:
                raise BadInput(f"push source {short(k.member)}/{k.seq} has a {len(k.digest)}-byte digest; a "
                               "push's digest is its end marker's XXH3-128, 16 bytes")
        kind = js.book(meta.sender, meta.incarnation).classify(meta.seq)
        if member.in_flight >= MAX_IN_FLIGHT + 2:
            raise Exhausted(f"{meta.sender!r} has {member.in_flight} pushes in flight here (at most "
                            f"{MAX_IN_FLIGHT}); wait for their acknowledgements")
        decode = kind in ("new", "retry") and meta.contributors > 0

        def done() -> None:
            member.in_flight -= 1
        intake = PushIntake(js.layout, meta, decode, self.budget, release=done)
        member.in_flight += 1
        return intake

    async def commit_push(self, intake: PushIntake, digest: bytes, resend_to: int = 0) -> Ack:
        """The whole push has arrived (``digest`` of its frames): answer it, or add it to the open
        batch and wait for the batch's outcome. ``resend_to``: its sender sent it before, to the
        tier incarnation it names, and never heard back (``as_resend``); 0 on a first send."""
        meta = intake.meta
        js = self.job(meta.job)  # ended while the body arrived: UnknownJob
        member = js.members.get(meta.sender)
        if member.incarnation != meta.incarnation:
            raise NotMember(f"{meta.sender!r} was replaced by a new incarnation while this push arrived; "
                            "register again")
        book = js.book(meta.sender, meta.incarnation)
        kind = book.classify(meta.seq)
        if kind in ("duplicate", "pending"):
            book.check_body(meta.seq, digest)
        if kind == "duplicate":
            js.stats.duplicates += 1
            return replace(book.ack_of(meta.seq), duplicate=True)
        pkey = (meta.sender, meta.incarnation, meta.seq)
        if kind == "pending":  # the same push is still in a batch: share its outcome (as long
            # as a push waits for its round: a forward that never ended held this retry for good)
            try:
                return replace(await wait_for(asyncio.shield(js.pending[pkey]), self.config.round_timeout_s),
                               duplicate=True)
            except asyncio.TimeoutError:
                raise TimedOut(f"the push this one retries is still in its {'round' if js.bsp else 'window'} "
                               f"after {self.config.round_timeout_s:.0f}s; it stays there") from None
        if not intake.decoded and meta.contributors:
            # It was a retry of a pending push when its header came; that batch failed since.
            raise Unavailable("the push this one retries was refused while it arrived; send it again")
        if meta.sources:
            await self._wait_sources_elsewhere(js, meta)
        keys = meta.sources or ((PushKey(meta.sender, meta.incarnation, meta.seq, digest),)
                                if meta.contributors else ())
        known = self._applied_already(js, book, meta, digest, keys)
        if known is not None:
            return known
        forgotten = bool(resend_to) and resend_to != self.epoch
        if keys and (forgotten or (kind == "retry" and self._unsure_of(js, keys))):
            # It was in a forward this tier gave up on with its outcome unknown, or its sender
            # sent it before to another incarnation of this tier and never heard back (it cannot
            # always know that one is gone: its heartbeat may have registered it here while the
            # resend was on its way). That one may have passed it on: the root decides before it
            # is placed here as new, among other senders' pushes.
            resolved = await self._resolved(js, book, meta, digest, keys)
            if resolved is not None:
                return resolved
            if book.classify(meta.seq) in ("pending", "duplicate"):  # another copy of it was placed meanwhile
                raise Unavailable(f"push {meta.seq} from {meta.sender!r} is being placed by another retry; "
                                  "retry shortly")
            if js.members.get(meta.sender).incarnation != meta.incarnation:  # replaced while it was asked about
                raise NotMember(f"{meta.sender!r} was replaced by a new incarnation while this push was "
                                "resolved; register again")
        grad = intake.gradient()
        try:
            self._check_placement(js, meta)
        except Stale as exc:
            # The number is spent (the sender never sends it again for this body): seen. An async
            # sender's numbers run ahead of the last one accepted, and 17 refusals in a row (its
            # windows on a lineage the root had just left) made every later push "from the future".
            book.highest = max(book.highest, meta.seq)
            if not keys:
                raise
            return await self._resolve_late(js, book, meta, digest, keys, exc)
        if kind == "retry" and keys and meta.seq + book.keep <= book.highest:
            # Older than every acknowledgement this tier keeps for the sender, so it may have been
            # applied: a push reusing such a number with another body, on the open round, was
            # applied twice (found by the request fuzzer). The root's record decides; a number
            # that old that was never applied is no retry a sender makes, and is refused too.
            return await self._resolve_late(js, book, meta, digest, keys, Conflict(
                f"push {meta.seq} of {meta.sender!r} is older than the last {book.keep} this tier "
                "remembers and was not applied; a new gradient takes the next sequence number"))
        # Everything is validated: from here the push is committed to the batch.
        book.accept(meta.seq, digest)
        nbytes = intake.nbytes
        clocks = (meta.clock_min, meta.clock_max)
        if js.bsp:
            js.round.add(meta.sender, meta.base_version, grad, meta.contributors, clocks, meta.step, owned=True)
        else:
            js.window.add(meta.sender, meta.base_version, grad, meta.contributors, clocks, nbytes, self.clock(),
                          meta.step, owned=True)
        js.add_sources(keys)
        intake.decoded_into_batch()
        member.pushes += 1
        js.note_floor(member.id, member.incarnation, meta.clock_floor)  # once the batch is applied
        member.workers = meta.workers
        self._telemetry(js, meta)
        js.stats.pushes += 1
        js.stats.bytes_pushed_in += nbytes
        fut = js.open_future()
        js.pending[pkey] = fut
        fut.add_done_callback(lambda f: self._settle(js, book, pkey, f))
        t0 = self.clock()
        self._progress(js)
        if js.bsp:  # still open (else a fresh round): more pushes come, so no pass-through
            js.round.lay_out()
        try:
            return await wait_for(asyncio.shield(fut), self.config.round_timeout_s)
        except asyncio.TimeoutError:
            raise TimedOut(f"the push's {'round' if js.bsp else 'window'} did not complete within "
                           f"{self.config.round_timeout_s:.0f}s; the push stays in it") from None
        finally:
            js.stats.round_wait_ms_sum += int((self.clock() - t0) * 1000)

    async def push(self, meta: PushMeta, chunks: list[Chunk], digest: bytes) -> Ack:
        """A whole push at once (tests and in-process callers): ``open_push`` + ``commit_push``."""
        intake = self.open_push(meta)
        try:
            intake.add(chunks)
            return await self.commit_push(intake, digest)
        finally:
            intake.close()

    def _check_placement(self, js: JobState, meta: PushMeta) -> None:
        """Raise unless the push fits the open round or window now (changes nothing)."""
        if js.outer_async and (js.window.pushed or js.inflight):
            # Each region's update is a step of its own (delayed Nesterov counts them; damping
            # is by its own staleness): never summed with another that came meanwhile.
            raise Unavailable(f"another region's update of outer job {short(meta.job)} is being applied; "
                              "asynchronous outer steps apply one at a time: retry shortly")
        if meta.view_epoch and js.view.ready and meta.view_epoch != js.view.epoch:
            raise Stale(f"gradient computed on a view of root epoch {meta.view_epoch:#x}; this tier "
                        f"holds epoch {js.view.epoch:#x} (the root restarted): pull a snapshot",
                        wait_version=js.view.version, epoch=js.view.epoch)
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
            js.round.check(meta.sender, meta.base_version, meta.contributors, meta.step)
        else:
            js.window.check(meta.sender, meta.contributors)
            if js.view.ready and meta.base_version > js.view.version:
                raise NotReady(f"gradient computed on version {meta.base_version}, ahead of this tier's "
                               f"{js.view.version}; the tier is still catching up, retry shortly")

    async def _wait_sources_elsewhere(self, js: JobState, meta: PushMeta) -> None:
        """A relay's push names worker pushes that a batch here already holds, sent through
        another relay (a child that switched parents, issue 15; a worker that switched zones):
        summing both would apply them twice. Wait for that batch (the relay it came through
        died: it leaves the open batch by the member timeout); then the sender retries. If that
        batch was applied, the push can no longer be placed whole: refused, loudly (a sender that
        switched resolves first, ``Relay._forward_one``, so this is a guard, not a path)."""
        held = {f for f in (js.batch_of(k) for k in meta.sources) if f is not None}
        if not held:
            return
        js.stats.resolved += 1
        await asyncio.wait([asyncio.shield(f) for f in held], timeout=_RESOLVE_WAIT_S)
        if any(f.done() and not f.cancelled() and f.exception() is None for f in held):
            raise Conflict(f"push {meta.seq} of {meta.sender!r} sums worker pushes that another path "
                           "had applied meanwhile; resolve them (Resolve) before sending them again")
        raise Unavailable(f"push {meta.seq} of {meta.sender!r} sums worker pushes still in a batch here "
                          "that came through another relay; retry shortly")

    async def _resolve_late(self, js: JobState, book, meta: PushMeta, digest: bytes,
                            keys: tuple[PushKey, ...], stale: HpsError) -> Ack:
        """A push that cannot be placed may have been applied already (its ack was lost in a
        restart): ask before saying Stale, which means "not applied, and it will not be"."""
        ack = await self._resolved(js, book, meta, digest, keys)
        if ack is None:
            raise stale
        return ack

    def _unsure_of(self, js: JobState, keys: tuple[PushKey, ...]) -> bool:
        """Whether a forward of these pushes was given up on with its outcome unknown (a relay)."""
        return False

    def _applied_already(self, js: JobState, book, meta: PushMeta, digest: bytes,
                         keys: tuple[PushKey, ...]) -> Ack | None:
        """The push's ack if the record of applied pushes (the root's) says it was applied
        already; None to place it. Relays keep no such record."""
        return None

    async def _resolved(self, js: JobState, book, meta: PushMeta, digest: bytes,
                        keys: tuple[PushKey, ...]) -> Ack | None:
        """The push's ack if the root applied it (recorded: a retry is a duplicate from now on),
        None if it did not; Unavailable while that is not known."""
        js.stats.resolved += 1
        try:
            outcome, version, epoch, skipped = await self.resolve(js.config.name, keys, _RESOLVE_WAIT_S)
        except (NotReady, NotPrimary) as exc:  # the parent restarted and knows nothing yet, or a standby
            # root answered (this tier's parent link fails over; the child's must not): not the pusher's doing
            raise Unavailable(f"cannot tell yet whether push {meta.seq} from {meta.sender!r} was applied "
                              f"({exc}); retry shortly") from None
        if outcome == APPLIED:
            ack = Ack(version, epoch or js.view.epoch, duplicate=True, skipped=skipped)  # the root's lineage
            book.accept(meta.seq, digest)
            book.settle(meta.seq, ack)
            return ack
        if outcome == UNKNOWN:
            raise Unavailable(f"push {meta.seq} from {meta.sender!r} is still in flight above this tier "
                              "(its outcome is not known yet); retry shortly")
        return None

    def _telemetry(self, js: JobState, meta: PushMeta) -> bool:
        """Count what the push reports about training (never part of the update); False when
        the report is not a number (a NaN loss would poison every sum after it)."""
        if not (math.isfinite(meta.loss_sum) and math.isfinite(meta.step_seconds_sum)
                and meta.step_seconds_sum >= 0 and meta.loss_count >= 0):
            return False
        st = js.stats
        st.loss_sum += meta.loss_sum
        st.loss_count += meta.loss_count
        st.step_seconds_sum += meta.step_seconds_sum
        return True

    @staticmethod
    def _settle(js: JobState, book, pkey: tuple[str, int, int], fut: asyncio.Future) -> None:
        """Record the outcome even when the pusher is gone (its retry gets the same ack)."""
        if js.pending.get(pkey) is fut:
            del js.pending[pkey]
        ok = not fut.cancelled() and fut.exception() is None
        book.settle(pkey[2], fut.result() if ok else None)

    # -- batches ---------------------------------------------------------------------------
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
        floor = js.batch_floor(js.view.clock_min)
        fut, keys = js.close_batch()
        js.round = BspRound(round=agg.round + 1, numel=js.layout.numel)
        js.stats.rounds += 1
        self._finish_checked(js, agg, keys, floor, fut)

    def in_flight_limit(self, js: JobState) -> int:
        """Closed windows of ``js`` that may be in flight at once at this tier: one (the root
        applies versions in order; ssp clock floors must reach the parent in order)."""
        return 1

    def _maybe_flush(self, js: JobState, force: bool = False) -> None:
        """Close the window when due (time or bytes), with at most ``in_flight_limit``
        closed batches in flight."""
        if js.inflight >= self.in_flight_limit(js) or not js.window.pushed:
            return
        # An asynchronous outer job's syncs go as they come (each region's is one step of its own).
        now, flush_s = self.clock(), 0.0 if js.outer_async else self.config.flush_ms / 1000.0
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
        floor = js.batch_floor(js.view.clock_min)
        fut, keys = js.close_batch()
        js.window = js.new_window()
        js.inflight += 1
        js.stats.rounds += 1
        fut.add_done_callback(lambda f: self._window_done(js, f))
        self._finish_checked(js, agg, keys, floor, fut)

    def _window_done(self, js: JobState, fut: asyncio.Future) -> None:
        js.inflight = max(0, js.inflight - 1)
        self._maybe_flush(js)
        # A floor that rose while this window was on its way (a member expired meanwhile) was
        # not sent then: nothing else would send it, and the live workers waited for it until
        # the round timeout. After a refused window, a moment later: a refusal that comes at
        # once (a log that cannot be written) would make it a tight loop, and without it a
        # refused floor-only window was never sent again (no pusher retries one).
        if not fut.cancelled() and fut.exception() is None:
            self._flush_floor(js)
        elif not fut.cancelled():
            def again() -> None:
                if self.jobs.get(js.config.name) is js:  # still served here
                    self._flush_floor(js)
            asyncio.get_running_loop().call_later(_FLOOR_RETRY_S, again)

    def _flush_floor(self, js: JobState) -> None:
        """SSP: membership shrank and the clock floor rose; send the news up even with nothing
        to aggregate, so a dead worker stops holding the others back."""
        if (js.bsp or js.outer_async or js.members.floor(js.view.clock_min) <= js.reported_floor
                or not len(js.members)):  # (regions' clocks bound nothing in an outer job)
            return
        if not js.window.pushed and not js.inflight:
            js.window.add(f"{self.role}:floor", js.view.version, None, 0, (0, 0), 0, self.clock())
            self._maybe_flush(js, force=True)

    def _finish_checked(self, js: JobState, agg: Aggregate, keys: tuple[PushKey, ...], floor: int,
                        fut: asyncio.Future) -> None:
        """A batch closed: refuse it whole if its sum is not finite, else finish it. A batch of
        one push (still in pieces) is no sum: its every chunk was checked as it arrived."""
        if agg.contributors and not isinstance(agg.grad, Pieces) and not all_finite(agg.grad):
            self._refuse(js, agg, fut, BadInput(
                f"the sum of {agg.contributors} gradients for version {agg.round} of job {js.config.name} "
                "is not finite (float32 overflow); nothing was applied. Lower the learning rate or "
                "the loss scale"))
            return
        try:
            self._finish_round(js, agg, keys, floor, fut)
        except Exception as exc:  # never leave a batch's pushers waiting on a failed finish
            log.exception("%s: finishing round %d of job %s failed", self.role, agg.round, js.config.name)
            self._refuse(js, agg, fut, exc if isinstance(exc, HpsError) else Unavailable(
                f"this {self.role} tier failed to finish the round ({type(exc).__name__}); push again"))

    def _finish_round(self, js: JobState, agg: Aggregate, keys: tuple[PushKey, ...], floor: int,
                      fut: asyncio.Future) -> None:
        """Apply (root) or forward (relay) a closed batch; resolve ``fut`` with the Ack."""
        raise NotImplementedError

    def _refuse(self, js: JobState, agg: Aggregate, fut: asyncio.Future, exc: Exception) -> None:
        """A closed batch was not applied: fail its pushers with ``exc``. In BSP the round opens
        again (its pushers resend or recompute on the same version) unless the refusal says the
        round is gone (Stale) or the round moved on meanwhile."""
        js.stats.refused_rounds += 1
        log.warning("%s: round %d of job %s refused: %s", self.role, agg.round, js.config.name, exc,
                    extra=event("round.refused", job=js.config.name, round=agg.round, version=js.view.version,
                                reason=type(exc).__name__))
        if (js.bsp and not isinstance(exc, Stale) and js.round.round == agg.round + 1
                and not js.round.pushed and js.view.version <= agg.round):
            js.round = BspRound(round=agg.round, numel=js.layout.numel)
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: a batch's pushers may all be gone

    # -- resolve ---------------------------------------------------------------------------
    async def resolve(self, job: str, keys: tuple[PushKey, ...], wait_s: float, asker: str = ""
                      ) -> tuple[str, int, int, bool]:
        """What became of these worker pushes: (APPLIED, version, epoch, skipped: whether that
        version skipped its step), (NOT_APPLIED, 0, 0, False) or (UNKNOWN, 0, 0, False). Pushes
        still in a batch here are waited for (at most ``wait_s``).
        ``asker``: a child that sent them through a tier it has left since (``_excuse_moved``)."""
        deadline = self.clock() + max(0.0, wait_s)
        while True:
            js = self.job(job)
            futs = {f for f in (js.batch_of(k) for k in keys) if f is not None}
            if not futs:
                answer = await self._resolve_here(js, keys, max(0.0, deadline - self.clock()))
                break
            left = deadline - self.clock()
            if left <= 0:
                answer = UNKNOWN, 0, 0, False
                break
            await asyncio.wait([asyncio.shield(f) for f in futs], timeout=left)
        if asker and answer[0] == UNKNOWN:
            self._excuse_moved(self.job(job), asker)
        return answer

    def _excuse_moved(self, js: JobState, asker: str) -> None:
        """``asker`` moved here from another tier with a push sent that way, which is still in a
        batch above (the answer was UNKNOWN). If the asker joined during the open BSP round, has
        not pushed in it, and joined two member timeouts ago, that batch may be waiting for this
        tier's round, which waits for the asker, which waits for the answer (the tier it left
        lives on and keeps the push in the root's round): the round stops waiting for it. Not
        sooner: when the tier it left died, its push leaves the root's round once that tier
        times out there (not applied), and the round here waits for the asker's resend. Once
        excused, a resend is still placed while the round is open (else it is Stale: its
        workers pull and compute again)."""
        m = js.members.find(asker)
        if (m is None or not js.bsp or m.first_round != js.round.round or asker in js.round.pushed
                # A dead tier the push went through is dropped above within two member timeouts
                # of its death, and its push with it: till then, no reason to excuse anyone.
                or self.clock() - m.joined < 2 * self.config.member_timeout_s):
            return
        m.first_round = js.round.round + 1
        log.warning("%s: job %s: %r moved here during round %d with a push sent through another tier, still "
                    "in flight above; the round does not wait for it", self.role, js.config.name, asker,
                    js.round.round)
        self._progress(js)

    async def _resolve_here(self, js: JobState, keys: tuple[PushKey, ...], wait_s: float
                            ) -> tuple[str, int, int, bool]:
        """Nothing here holds the keys: the root answers from its record, a relay asks up."""
        raise NotImplementedError

    # -- ranks and leased data shards (the root decides; relays pass the calls on) -------------
    async def rank(self, job: str, member: str, incarnation: int, requested: int | None = None,
                   release: bool = False) -> RankInfo:
        """``member``'s stable rank in ``job`` (``ps.core.ranks``), or (``release``) its clean
        departure: its rank and its data-shard leases go back."""
        check_member(member)
        return await self._rank_here(self.job(job), member, incarnation, requested, release)

    async def lease(self, job: str, member: str, incarnation: int, dataset: Dataset, epoch: int,
                    want: bool = True, held: tuple[tuple[int, int], ...] = ()) -> Grant:
        """A data shard of ``epoch`` for ``member`` (``ps.core.leases``), renewing its leases."""
        check_member(member)
        return await self._lease_here(self.job(job), member, incarnation, dataset, epoch, want, held)

    async def _rank_here(self, js: JobState, member: str, incarnation: int, requested: int | None,
                         release: bool) -> RankInfo:
        raise NotImplementedError

    async def _lease_here(self, js: JobState, member: str, incarnation: int, dataset: Dataset, epoch: int,
                          want: bool, held: tuple[tuple[int, int], ...]) -> Grant:
        raise NotImplementedError

    # -- pull ------------------------------------------------------------------------------
    async def pull(self, job: str, member: str, view_epoch: int, since: int, min_version: int,
                   wait_s: float, min_clock: int = 0) -> tuple[PullMeta, list[tuple[VersionMeta, list[Chunk]]]]:
        js = self.job(job)
        if not self._may_read(js, member):
            # A guard against mistakes (a worker of one job reading another's keys), not
            # authentication: the member id is the caller's own word.
            raise NotMember(f"{short(member) if member else 'an anonymous caller'} is not a member of job "
                            f"{short(job)} here; register for the job before pulling its parameters")
        deadline = self.clock() + max(0.0, wait_s)
        if view_epoch == js.view.epoch and since > js.view.version:  # see below: a moment to catch up
            deadline = max(deadline, self.clock() + _AHEAD_WAIT_S)

        def must_wait() -> bool:
            if not js.view.ready:
                return True
            # A caller from another lineage needs a snapshot now: its version numbers do not
            # compare with ours.
            return view_epoch == js.view.epoch and (js.view.version < max(min_version, since) or
                                                    js.view.clock_min < min_clock)

        while must_wait() and self.clock() < deadline:
            await js.wait_change(deadline - self.clock())
            js = self.job(job)  # ended while we waited: UnknownJob
        if not js.view.ready:
            raise NotReady(f"this {self.role} tier has no view of job {short(job)} yet (still syncing "
                           "with its parent); retry shortly")
        v = js.view.version
        if view_epoch == js.view.epoch and since > v and self._behind(js, since):
            # The caller is ahead of this tier on the same lineage (it came over from another
            # tier of the tree, or this one is cut off from its parent): a snapshot of v would
            # take its version back -- and a relay's whole subtree with it.
            why = (f"this {self.role} tier holds version {v} of job {short(job)}, behind the caller's {since}")
            if not self.parent_reachable():  # a tier of its own: the caller's client moves to another
                raise Unavailable(f"{why}, and is cut off from its parent")
            raise NotReady(f"{why}; retry shortly (it is still catching up with its parent)")
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

    def _behind(self, js: JobState, since: int) -> bool:
        """Whether a caller holding ``since`` of this tier's lineage, past its version, is ahead
        only because this tier lags (it waits, NotReady), rather than past what the authority
        holds: a root's view is the authority (a standby promoted by force, without what its
        primary published last), and the caller takes its snapshot."""
        return False

    def _may_read(self, js: JobState, member: str) -> bool:
        return member in js.members or member in self.children

    @staticmethod
    def _is_worker(js: JobState, member: str) -> bool:
        found = js.members.find(member)
        return found is not None and found.role == "worker"

    # -- what a tier is -----------------------------------------------------------------------
    def set_address(self, address: str) -> None:
        """Where this tier serves (a relay tells its parent, for `hps status`)."""

    def parent_reachable(self) -> bool:
        return True  # the root has no parent

    def parent_link(self):
        """The upstream link (``ps.net.upstream.Upstream``) of a relay; None at the root."""
        return None

    def parent_address(self) -> str:
        """The parent the calls go to now ("" at the root)."""
        return self.config.parent

    def parent_failover(self) -> tuple[tuple[str, ...], int, float]:
        """(the parents configured, in order; switches between them; seconds cut off from every
        parent, 0 while one answers): the root has none."""
        return (), 0, 0.0

    def synced(self) -> bool:
        """Readiness: the tier serves views its parent published (the root always does)."""
        return True

    def _lag(self, js: JobState, now: float) -> tuple[int, float]:
        """(the newest version heard of, seconds out of sync): the root is the reference."""
        return js.view.version, 0.0

    # -- status ----------------------------------------------------------------------------
    def status(self) -> TierStatus:
        now = self.clock()
        jobs = []
        for name, js in self.jobs.items():
            parent_version, lag_s = self._lag(js, now)
            jobs.append(JobStatus(
                name=name, mode=js.config.mode, version=js.view.version, view_epoch=js.view.epoch,
                checksum=js.view.checksum, parent_version=parent_version, lag_s=lag_s,
                round=js.round.round if js.bsp else js.stats.rounds,
                round_pushed=len(js.round.pushed if js.bsp else js.window.pushed),
                clock_min=js.view.clock_min, staleness=js.config.staleness, parameters=js.layout.numel,
                members=tuple(MemberInfo(m.id, m.role, m.address, now - m.last_seen, m.pushes)
                              for m in js.members),
                stats=replace(js.stats),
                lost=tuple(MemberInfo(k, r, a, now - t) for k, (r, a, t) in js.lost.items())))
        children = tuple(MemberInfo(k, r, a, now - t) for k, (r, a, t) in self.children.items())
        parents, switches, cut_off_s = self.parent_failover()
        return TierStatus(role=self.role, name=self.config.display_name, server_epoch=self.epoch,
                          parent=self.parent_address(), parent_reachable=self.parent_reachable(),
                          ready=self.synced(), uptime_s=now - self.started, jobs=tuple(jobs),
                          children=children, insecure=not self.config.secure, parents=parents,
                          parent_switches=switches, parent_cut_off_s=cut_off_s)
