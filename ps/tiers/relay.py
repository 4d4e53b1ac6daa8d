"""A relay (regional master or zone replica): a server to its children, a client of its parent.

>>> async def zone(parent):
...     relay = Relay(ServerConfig(role="zone", parent=parent, name="eu-a"))
...     await relay.start()                    # ps.server.create_server also serves it
...     while not relay.synced():              # ready once its parent answered
...         await asyncio.sleep(0.05)
...     print(relay.role, relay.member_id, "ready, parent reachable:", relay.up.reachable)
...     await relay.stop()                     # leaves every job at its parent
>>> asyncio.run(zone(address))
zone eu-a ready, parent reachable: True

What it does with what passes through:
- upward: sums its children's pushes per round and forwards one aggregate (with the number
  of contributors and their clock range), acknowledging children once the parent has;
- downward: follows the parent's versions with long-polling pulls, verifies every checksum,
  and keeps the deltas verbatim in its own log, so its children are served without going
  upstream and a region pulls each delta across the WAN once.
A relay holds no durable state: after a restart it rebuilds from its parent. Its member id
at the parent is its name, stable across restarts, with its epoch as the incarnation: a
restarted relay replaces its dead self there (whose push leaves the parent's open round), and
its children's retries of pushes the dead one forwarded are resolved up the tree.

A relay's side of its parents (heartbeats, failover to alternates and back) is
``ps.tiers.parents``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable

import numpy as np

from ps.core import codecs
from ps.core.config import JobConfig, ServerConfig
from ps.core.consistency import Aggregate, Gradient, dense
from ps.core.encoder import Encoder
from ps.core.errors import (
    BadInput,
    Conflict,
    Exhausted,
    HpsError,
    NotMember,
    NotReady,
    Stale,
    TimedOut,
    Unavailable,
    UnknownJob,
    short,
)
from ps.core.exactly_once import MAX_IN_FLIGHT, Unanswered
from ps.core.leases import Dataset, Grant
from ps.core.logs import event
from ps.core.outer import above_inner
from ps.core.ranks import RankInfo
from ps.core.replica import apply_pull
from ps.core.tensors import Chunk, Pieces, payload_bytes
from ps.core.types import Ack, PullMeta, PushKey, PushMeta, Registration
from ps.core.view import Layout
from ps.net.aio import wait_for
from ps.net.tls import TlsFiles
from ps.net.upstream import Upstream
from ps.net.wire import as_resend, encode_push, push_digest
from ps.tiers.jobstate import RelayJob
from ps.tiers.parents import ParentLink
from ps.tiers.tier import APPLIED, UNKNOWN, Tier

__all__ = ["Relay"]

log = logging.getLogger("hps.relay")

_PULL_WAIT_S = 5.0   # long-poll window of the follow loop
_TOKEN_REFRESH_S = 5.0  # a job's token hash is asked for again at most this often (refresh_token_hash)
# First and largest retry delay. The largest matches the channels' reconnect backoff (at most
# 500 ms, ps.net.rpc): with 2 s, the first version after a root restart came 1.1-1.5 s after
# the root was serving again (benchmarks/chaos.py), the relays still sleeping off their backoff.
_BACKOFF_S = (0.05, 0.5)
_BAD_SNAPSHOTS = 3  # snapshots in a row failing their checksum before it is an error, not a warning
_FAILING_PULLS = 5  # a job's pulls failing in a row before its lag counts (and a warning says so)

# Lossless codecs a relay passes on as they came: each decodes to exactly what re-encoding the
# decoded values would carry, and keeps no state (no residual) at the sender.
_PASS_ON = frozenset({"fp32", "rows"})


def _verbatim(enc: Encoder, grad: Gradient, absent: frozenset[int], layout: Layout) -> list[Chunk] | None:
    """The chunks of a batch of one push, to forward as they came (their frames uncopied), when
    that is exactly what re-encoding it would send: this edge lossless and every chunk fp32 or
    rows. Chunks of a key the push declared absent are left out, as re-encoding leaves that key
    out (workers of this version send none; earlier ones, or a script calling
    ``ParameterClient.push`` with an older client, sent zeros for them); a frame that carried
    some of them is framed again, the others go as they came. Else None (decode, sum, re-encode).

    A zone with one worker (the demo's, every zone of dataplane.py's row) forwarded each push by
    laying it out as a vector and framing that again: two full copies per hop, now none."""
    if not isinstance(grad, Pieces) or not enc.lossless or enc.name not in _PASS_ON:
        return None
    if any(c.codec not in _PASS_ON for c in grad.chunks):
        return None
    skip = {layout.specs[i].key for i in absent}
    return [c for c in grad.chunks if c.key not in skip]


class _JobLocks:
    """One lock per job name, held while a caller attaches the job. A lock lives while anyone
    holds or waits for it, so a caller naming random jobs does not grow this, and two callers
    of one job never hold two different locks (the waiter woken by a release has not taken the
    lock yet: ``locked()`` is False then, and it must not be dropped)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, job: str) -> AsyncIterator[None]:
        lock, users = self._held.get(job, (None, 0))
        lock = lock or asyncio.Lock()
        self._held[job] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            users = self._held[job][1] - 1
            if users:
                self._held[job] = (lock, users)
            else:
                del self._held[job]

    def __len__(self) -> int:
        return len(self._held)


class Relay(ParentLink, Tier):
    def __init__(self, config: ServerConfig, **kw) -> None:
        super().__init__(config, **kw)
        self.role = config.role
        self.member_id = config.display_name
        self.up = Upstream(config.parent, self.member_id, config.role, incarnation=self.epoch,
                           timeout_s=config.upstream_timeout_s,
                           tls=TlsFiles.of(config.tls_cert, config.tls_key, config.tls_ca))
        self.attached: set[str] = set()
        self._locks = _JobLocks()
        self._up_acked: dict[str, int] = {}  # last sequence number the parent acknowledged
        self._force_snapshot: set[str] = set()
        self._token_asked: dict[str, float] = {}  # job -> when its token hash was last asked for again
        self._fwd_locks: dict[str, asyncio.Lock] = {}
        self._up_issued: dict[str, int] = {}  # async: the highest sequence number sent up
        # Forwards given up on with their outcome unknown: settled at the root before their
        # numbers or their pushes are used again (``_settle_unsure``, ``_unsure_of``).
        self.unanswered = Unanswered()
        # job -> (seq, its own key, parent switch count when last sent) of an outer sync given
        # up on unanswered, until the outer loop settles it (``OuterRelay._settle_sync``),
        # and the payload bytes it carried
        self.own_unsure: dict[str, tuple[int, tuple[PushKey, ...], int, int]] = {}
        self.cut_off_at: float | None = None  # since when no parent has answered (None: one does)
        self._loading: dict[frozenset[str], asyncio.Future] = {}  # codecs being imported, off the loop

    def set_address(self, address: str) -> None:
        self.up.own_address = address

    def job(self, name: str) -> RelayJob:
        js = self.jobs.get(name)
        if js is not None or name in self.ended:
            return super().job(name)
        # A relay learns jobs from its children's registrations; after a restart it holds
        # none. The caller must register (which asks the root), not end its training.
        raise NotMember(f"job {short(name)} is not held at this {self.role} tier (it restarted, or no "
                        "member registered here yet); register again")

    async def start(self) -> None:
        await super().start()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        if len(self.up.parents) > 1:
            self._tasks.append(asyncio.create_task(self._home_loop(), name="home"))

    async def stop(self) -> None:
        for job in list(self.attached):
            try:
                await wait_for(self.up.leave(job), 1.0)
            except (HpsError, asyncio.TimeoutError):
                pass  # the parent drops us by timeout instead
        await super().stop()
        await self.up.close()

    # -- joining the parent ----------------------------------------------------------------
    async def attach(self, job: str) -> None:
        """Join the parent for ``job`` as a child's registration would, before admitting that
        child: the server learns the job's token hash this way (ps/server/auth.py)."""
        await self._job_for_register(job)

    async def _job_for_register(self, job: str) -> RelayJob:
        async with self._locks.hold(job):
            return await self._attach(job)

    async def _attach(self, job: str) -> RelayJob:
        if job in self.ended:
            return super().job(job)  # UnknownJob: ended
        js = self.jobs.get(job)
        if js is not None and job in self.attached:
            return js
        reg = await self.up.register(job, last_seq=max(self._up_acked.get(job, 0),
                                                       self._up_issued.get(job, 0)))
        # A lossy codec's module imports torch (seconds): here, off the loop, before this job's
        # first push or delta can need it; a relay of lossless jobs never imports it.
        await self.loaded(codecs.unloaded(reg.config.codecs(self.config.up_codec)), codecs.load, "its codecs")
        if js is None or js.layout != reg.layout:
            js = RelayJob(reg.config, reg.layout, created_at=self.clock(),
                          above_inner=above_inner(reg.config, self.role))
            self.jobs[job] = js
            self._tasks.append(asyncio.create_task(self._follow(job, js), name=f"follow-{job}"))
        self.attached.add(job)
        if js.round.round != reg.start_version:
            js.reset_round(reg.start_version, "joined the parent's round")
        log.info("%s: attached to job %s at parent %s, round %d", self.role, job,
                 self.up.current, reg.start_version)
        return js

    async def loaded(self, key: frozenset[str], load: Callable[[frozenset[str]], object], what: str) -> object:
        """``load(key)`` in a thread, once at a time per key; its result. A child's call waits
        for it at most half the upstream timeout, then gets NotReady ("retry shortly") while the
        loading goes on: importing torch the first time takes seconds, many more on a loaded
        machine (it measured over 10 s in CI), and a call that outlives its deadline is not
        retried (TimedOut) where NotReady is."""
        if not key:
            return None
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.ensure_future(asyncio.to_thread(load, key))
            task.add_done_callback(lambda t: self._loading.pop(key, None) if self._loading.get(key) is t else None)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        done, _ = await asyncio.wait([task], timeout=min(5.0, self.config.upstream_timeout_s / 2))
        if not done:
            raise NotReady(f"this {self.role} tier is loading {what} (torch, the first time: seconds); "
                           "retry shortly")
        return task.result()

    async def refresh_token_hash(self, job: str) -> bool:
        """Ask the parent for ``job``'s token hash again (a registration with this relay's own
        credentials for the job: it keeps its place there), at most once every
        ``_TOKEN_REFRESH_S`` a job: a stranger's refused calls do not each cost a call upstream.
        Whether it asked."""
        now = self.clock()
        if job not in self.attached or now - self._token_asked.get(job, -_TOKEN_REFRESH_S) < _TOKEN_REFRESH_S:
            return False
        self._token_asked[job] = now
        async with self._locks.hold(job):
            if job not in self.attached:
                return False
            try:
                await self.up.register(job, last_seq=max(self._up_acked.get(job, 0), self._up_issued.get(job, 0)))
            except HpsError as exc:
                log.warning("%s: asking the parent for job %s's token again failed: %s", self.role, job, exc)
                return False
        return True

    async def detach(self, job: str, refused: bool = False) -> None:
        """Undo ``attach`` for a child refused here (its credentials, after the parent's reply
        told the server the job's token hash, or its registration): a relay attached with no
        child would hold the parent's rounds for the job until its heartbeats stopped, which
        they never do, and a token it kept from that call that is not the job's is the refused
        caller's. ``refused``: the caller was refused; a job no child ever joined here is then
        forgotten whole, so a stranger cannot have a relay copy a job of their choosing across
        the WAN and hold it in memory."""
        held = self.up.job_tokens.get(job)
        if held is not None and hashlib.sha256(held.encode()).digest() != self.up.token_hashes.get(job):
            del self.up.job_tokens[job]
        js = self.jobs.get(job)
        if js is not None and len(js.members) == 0:
            await self._members_changed(js)  # leaves the parent's rounds
        if refused and js is not None:
            async with self._locks.hold(job):  # a child's attach meanwhile keeps it
                st = js.stats
                if (self.jobs.get(job) is js and job not in self.attached and len(js.members) == 0
                        and st.members_left + st.members_expired + st.members_replaced == 0):
                    del self.jobs[job]  # its follow loop ends with its next pull
                    self.up.token_hashes.pop(job, None)
                    self.up.job_tokens.pop(job, None)
                    log.info("%s: forgot job %s: the caller that brought it here was refused", self.role, job)

    async def register(self, job: str, member: str, role: str, address: str, last_seq: int,
                       incarnation: int) -> Registration:
        try:
            return await super().register(job, member, role, address, last_seq, incarnation)
        except HpsError:
            await self.detach(job, refused=True)  # joined the parent for a child refused here
            raise

    async def _members_changed(self, js: RelayJob) -> None:
        await super()._members_changed(js)
        await self._leave_if_childless(js)

    async def _leave_if_childless(self, js: RelayJob) -> None:
        """Leave the parent's rounds of a job with no child left here (asked again under the
        job's attach lock: a child may come meanwhile)."""
        job = js.config.name

        def childless() -> bool:
            return len(js.members) == 0 and self.jobs.get(job) is js
        if childless() and job in self.attached:
            await self._leave_parent(job, childless)

    async def _leave_parent(self, job: str, still: Callable[[], bool]) -> None:
        """Stop holding the parent's rounds for ``job`` if ``still()`` holds. Under the job's
        attach lock: a child registering meanwhile attaches after the leave, not before it (the
        leave landing second would drop this relay at the parent while it believed itself
        attached); ``still`` is asked under the lock, as a child may have come meanwhile."""
        async with self._locks.hold(job):
            if job not in self.attached or not still():
                return
            self.attached.discard(job)
            try:
                await self.up.leave(job)
            except HpsError as exc:
                log.warning("%s: leaving job %s upstream failed: %s", self.role, job, exc)

    # -- upward ----------------------------------------------------------------------------
    def _finish_round(self, js: RelayJob, agg: Aggregate, keys: tuple[PushKey, ...], floor: int,
                      fut: asyncio.Future) -> None:
        task = asyncio.create_task(self._forward(js, agg, keys, floor, fut, js.view.epoch))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def in_flight_limit(self, js: RelayJob) -> int:
        # async: windows go up without waiting for the previous one's acknowledgement, which
        # comes only once the root applied it (a whole tree's round trip, or an ocean's).
        return MAX_IN_FLIGHT if js.config.mode == "async" else 1

    async def _forward(self, js: RelayJob, agg: Aggregate, keys: tuple[PushKey, ...], floor: int,
                       fut: asyncio.Future, epoch: int | None = None) -> None:
        """Send a closed batch up. ``epoch``: the lineage its gradients were computed on (the
        view's when the batch closed); one the view left while the forward waited for its turn
        (the lock, settling a forward given up on) is refused Stale, never stamped with the new
        lineage and placed on it (invariant 5)."""
        job = js.config.name

        def same_lineage() -> None:
            if epoch is not None and epoch != js.view.epoch:
                raise Stale(f"round {agg.round} of job {short(job)} was computed on root lineage {epoch:#x}, "
                            f"which this {self.role} tier has left for {js.view.epoch:#x}; pull and compute again")
        try:
            if js.config.mode == "async":
                # Each window in flight has its own sequence number, reused by its own retries.
                same_lineage()
                seq = self._up_issued[job] = max(self._up_issued.get(job, 0), self._up_acked.get(job, 0)) + 1
                await self._forward_one(js, agg, keys, floor, fut, seq)
            else:
                # bsp/ssp: one forward per job at a time, its number reused until acknowledged (a
                # refused round is sent again under it). A second forward started while the first
                # retries would carry the same number and get the first one's recorded ack --
                # acknowledged, never applied (invariant 4).
                async with self._fwd_locks.setdefault(job, asyncio.Lock()):
                    await self._settle_unsure(js)
                    same_lineage()
                    await self._forward_one(js, agg, keys, floor, fut, self._up_acked.get(job, 0) + 1)
        except Exception as exc:  # never leave the children of a closed batch waiting
            if not isinstance(exc, HpsError):
                log.exception("%s: forwarding round %d of %s failed", self.role, agg.round, job)
                exc = Unavailable(f"this {self.role} tier failed to forward the round "
                                  f"({type(exc).__name__}); push again")
            self._refuse(js, agg, fut, exc)
        # The last child may have left while this forward was on its way, and a forward the
        # parent answered NotMember registers this relay there again: with nobody below it
        # then, it held every later round of the parent's for good. (Not at the tier that runs
        # an outer job's inner loop: its outer loop leaves the root's rounds itself,
        # ps.tiers.outer; a relay above zones that run it leaves as any relay. Not once
        # cancelled: the tier is stopping.)
        if js.config.outer is None or js.config.outer.inner_tier != self.role:
            await self._leave_if_childless(js)

    def _carries_pseudo_gradients(self, js: RelayJob) -> bool:
        """Whether this edge of an outer job carries pseudo-gradients (at or above the tier that
        runs the inner loop). Its residual is training the region did that the outer model has
        not received yet, and that the region's parameters no longer hold once rebased: a new
        root lineage (a restart, a takeover) does not void it, as it voids a gradient's."""
        cfg = js.config
        return cfg.outer is not None and (js.above_inner or cfg.outer.inner_tier == self.role)

    def workers_below(self, js: RelayJob) -> int:
        """The live workers a push up speaks for (the parent weighs asynchronous updates by it)."""
        return js.members.workers()

    async def _forward_one(self, js: RelayJob, agg: Aggregate, keys: tuple[PushKey, ...], floor: int,
                           fut: asyncio.Future, seq: int) -> None:
        job = js.config.name
        # Re-encode the sum with this relay's own residual: sums of top-k vectors get denser
        # at every level, so re-sparsify (DGC; design invariant 6). Off the event loop: a large
        # model's encode takes tens of milliseconds (the encoder runs one at a time).
        enc = self.encoder(js)
        # Keys no contribution has a gradient for are not sent, and keep their residual.
        absent = frozenset(agg.step.absent)
        only = frozenset(s.key for i, s in enumerate(js.layout.specs) if i not in absent) if absent else None
        (loss, n, secs), js.unsent_report = js.unsent_report, (0.0, 0, 0.0)
        meta = PushMeta(job, self.member_id, seq, agg.round, js.view.epoch, agg.contributors, agg.clock_min,
                        agg.clock_max, floor, loss, n, secs, self.workers_below(js), self.epoch, keys, agg.step)

        def frames_of() -> tuple[list[bytes], int]:
            # fp32 chunks are views of the round's sum (copy=False), framed at once: the frames
            # are the one copy. Joined on the event loop, 400 MB of frames held it ~0.5 s. A
            # batch of one push of lossless chunks goes up as it came: its very frames.
            if not agg.contributors:
                chunks: list[Chunk] = []
            elif (verbatim := _verbatim(enc, agg.grad, absent, js.layout)) is not None:
                chunks = verbatim
            else:
                if not keys or js.config.mode != "async":
                    # One forward at a time (bsp, ssp, an outer sync): its encode is recorded,
                    # so a refusal puts the residual back as it was before it, keeping what
                    # earlier applied rounds still owe (a reset dropped that too). Async
                    # windows overlap: a refusal there drops the residual (``_refuse``).
                    enc.begin()
                chunks = enc.split(js.layout, dense(agg.grad), agg.round, only, copy=False)
            return encode_push(meta, chunks), payload_bytes(chunks)
        frames, nbytes = await asyncio.to_thread(frames_of)
        # A push that names no worker push (a region's outer sync) is known above by this
        # relay's own key: asked about by it, as worker pushes are by theirs.
        own = (PushKey(self.member_id, self.epoch, seq, push_digest(frames)),) if agg.contributors and not keys else ()
        js.floor_sent = max(js.floor_sent, floor)
        deadline = self.clock() + self.config.round_timeout_s
        delay = _BACKOFF_S[0]
        sent_via: int | None = None  # the parent link (switch count) of the last unanswered send
        # Whether a send may have been placed above (its answer was lost), and the incarnation
        # of the parent it went to.
        unknown, sent_to = False, self.up.server_epoch
        while True:
            try:
                moved = sent_via is not None and sent_via != self.up.switches
                # A parent that restarted since remembers nothing of it and would place it as
                # new: in ssp and async nothing else stopped that (applied twice).
                restarted = unknown and sent_to != self.up.server_epoch
                if (moved or restarted) and (keys or own):
                    # Sent through a parent this relay has left since (that one may have passed
                    # it on), or one that forgot it: the root decides before it goes again.
                    resolved = await self._resolve_moved(js, keys or own, deadline, moved)
                    if resolved is not None:
                        ack = resolved
                        break
                    unknown = False
                sent_via, sent_to = self.up.switches, self.up.server_epoch
                # Still unknown: the parent may be a new incarnation this relay has not noticed
                # yet; the push says it is a resend of one sent to incarnation ``sent_to`` (one
                # of another that does not hold it asks the root before placing it).
                body = list(as_resend(frames, sent_to)) if unknown and (keys or own) and sent_to else frames
                try:
                    ack = await self.up.push(body, timeout=max(1.0, deadline - self.clock()), job=job)
                except (Unavailable, TimedOut):
                    unknown = True
                    raise
                break
            except NotMember as exc:
                # The parent does not know us (it restarted, or timed us out): register again
                # and resend the very same push. The parent then places it, or -- if its round
                # moved on -- asks the root whether it was applied before answering.
                log.warning("%s: parent forgot us while pushing round %d of %s (%s); registering "
                            "again", self.role, agg.round, job, exc)
                self.attached.discard(job)
                failure: HpsError = exc
                try:
                    await self._job_for_register(job)
                    delay = _BACKOFF_S[0]  # registered again: resend soon
                except UnknownJob as gone:
                    self._drop_job(job, str(gone))
                    raise
                except HpsError as again:
                    failure = again
            except UnknownJob as exc:
                if await self._job_gone(job):
                    raise
                failure, delay = exc, _BACKOFF_S[0]
            except (Unavailable, TimedOut, Exhausted, NotReady) as exc:
                # Outcome unknown, or the parent is catching up: retry with the same sequence
                # number; the parent answers a retry of an applied push with its ack.
                failure = exc
            # Anything else (Stale: not applied and it will not be; BadInput; Conflict) is the
            # parent's answer to the children, passed on as it is (_forward refuses the batch).
            if self.clock() + delay > deadline:
                # Sent, perhaps more than once, and never answered: the parent may hold it in a
                # round still, and apply it after the children were told it failed. An outer
                # sync (``own``) is the outer loop's to settle before its next one: its steps
                # must not go up twice (``OuterRelay._settle_sync``).
                self.unanswered.gave_up(job, seq, keys or own)
                if own:
                    self.own_unsure[job] = (seq, own, sent_via if sent_via is not None else self.up.switches,
                                            nbytes)
                elif enc.recording:
                    # The parent may have applied it: its encode stands until the root says
                    # (``_settled``). Taken back, the residual held what the applied part
                    # carried as well, sent again later (error feedback broken).
                    enc.set_aside()
                raise failure
            log.warning("%s: pushing round %d of %s up failed (%s); retrying", self.role,
                        agg.round, job, failure)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_S[1])
        self._up_acked[job] = max(self._up_acked.get(job, 0), seq)
        # Only now: a floor the parent refused was never raised there, and is sent again.
        js.reported_floor = max(js.reported_floor, floor)
        js.stats.bytes_pushed_up += nbytes
        if enc.recording:
            enc.commit()
        if not fut.done():
            fut.set_result(ack)

    async def _resolve_moved(self, js: RelayJob, keys: tuple[PushKey, ...], deadline: float,
                             moved: bool = True) -> Ack | None:
        """What became of a push sent through a parent this relay has left (``moved``), or
        through one that restarted since: its Ack if the root applied it, None if it was not
        (send it again); Unavailable while it is still in flight above (a batch at the root
        holds it until the left parent times out there)."""
        job = js.config.name
        await self._job_for_register(job)  # a member of the new parent first: it asks on our behalf
        wait_s = self._resolve_wait_s(deadline - self.clock())
        outcome, version, epoch, skipped = await self.up.resolve(job, keys, wait_s, moved=moved)
        if outcome == APPLIED:
            log.info("%s: round of %s sent through the %s parent was applied as version %d",
                     self.role, job, "previous" if moved else "restarted", version)
            return Ack(version, epoch or js.view.epoch, duplicate=True, skipped=skipped)
        if outcome == UNKNOWN:
            raise Unavailable(f"a push of job {job} sent through the previous parent is still in flight "
                              "above; asking again")
        return None

    def _resolve_wait_s(self, limit: float) -> float:
        """How long one question to the root about pushes still in flight above may wait: a
        batch holds them until the tier they went through times out there (two member
        timeouts and some), at most ``limit``, at least a second."""
        return max(1.0, min(limit, 2 * self.config.member_timeout_s + 5.0))

    async def _settle_unsure(self, js: RelayJob) -> None:
        """Before a forward takes the number of one given up on with its outcome unknown: ask
        the root what became of that one. Applied, its number is spent (reusing it with another
        body was refused as a Conflict at the parent for good, and its pushes were applied);
        not applied, it is free. Unavailable while it is still in flight above."""
        job = js.config.name
        for seq, keys in self.unanswered.pending(job):
            if not keys:  # an empty forward (no worker push): nothing to apply twice, skip its number
                self._up_acked[job] = max(self._up_acked.get(job, 0), seq)
                self.unanswered.forget(job, seq)
                continue
            wait_s = self._resolve_wait_s(self.config.round_timeout_s)
            try:
                await self._resolve_here(js, keys, wait_s)
            except Conflict as exc:
                # One of its pushes was applied with another body: its sender asked elsewhere,
                # was told "not applied" and reused the number. So this forward, applied whole
                # or not at all, was not; refusing every round here for it wedged this relay.
                for s in self._settled(js, keys, applied=False):
                    log.warning("%s: round %d of %s, given up on with its outcome unknown, was not "
                                "applied (%s)", self.role, s, job, exc)
                continue
            except (NotReady, TimedOut, Exhausted, NotMember) as exc:  # not the children's doing
                raise Unavailable(f"cannot tell yet what became of round {seq} of job {job} that this "
                                  f"{self.role} forwarded ({exc}); push again shortly") from None
            if any(seq == s for s, _ in self.unanswered.pending(job)):
                raise Unavailable(f"round {seq} of job {job} that this {self.role} forwarded is still in "
                                  "flight above (its outcome is not known yet); push again shortly")

    def _settled(self, js: RelayJob, keys: tuple[PushKey, ...], applied: bool) -> list[int]:
        """The forwards given up on that held these pushes are settled (``Unanswered.settled``),
        and so is the encode set aside for them: kept if applied, else taken back."""
        done = self.unanswered.settled(js.config.name, keys, applied)
        if done and js.encoder is not None:
            js.encoder.settle(applied)
        return done

    def _unsure_of(self, js: RelayJob, keys: tuple[PushKey, ...]) -> bool:
        return self.unanswered.holds(js.config.name, keys)

    def _refuse(self, js: RelayJob, agg: Aggregate, fut: asyncio.Future, exc: Exception) -> None:
        enc = js.encoder
        if enc is None or enc.lossless or js.config.name in self.own_unsure:
            pass  # (an outer sync given up on unanswered: ``OuterRelay._settle_sync`` decides)
        elif enc.recording:  # not applied: its children (or the region's steps) send it again, whole
            enc.roll_back()
        elif js.config.mode == "async":
            # An async window: the refused aggregate's unsent part is in the residual, with
            # those of windows encoded since, and its children will send the same gradients
            # again: drop it rather than count it twice.
            enc.reset()
        # (else refused before its encode: nothing of it is in the residual)
        super()._refuse(js, agg, fut, exc)

    async def _resolve_here(self, js: RelayJob, keys: tuple[PushKey, ...], wait_s: float, moved: bool = False
                            ) -> tuple[str, int, int, bool]:
        """Nothing in flight here holds these pushes: the parent (and above it the root) knows.
        An answer about the pushes of a forward given up on settles that forward (a forward is
        applied whole or not at all)."""
        job = js.config.name
        try:
            answer = await self.up.resolve(job, keys, wait_s, moved)
        except NotMember:  # the parent forgot us (it restarted): a member again, then ask
            self.attached.discard(job)
            await self._job_for_register(job)
            answer = await self.up.resolve(job, keys, wait_s, moved)
        outcome, version = answer[0], answer[1]
        if outcome != UNKNOWN:
            for seq in self._settled(js, keys, applied=outcome == APPLIED):
                if outcome == APPLIED:
                    self._up_acked[job] = max(self._up_acked.get(job, 0), seq)
                log.warning("%s: round %d of %s, given up on with its outcome unknown, was %s", self.role,
                            seq, job, f"applied as version {version}" if outcome == APPLIED else "not applied")
        return answer

    async def _rank_here(self, js: RelayJob, member: str, incarnation: int, requested: int | None,
                         release: bool) -> RankInfo:
        return await self.up.rank(js.config.name, member, incarnation, requested, release)

    async def _lease_here(self, js: RelayJob, member: str, incarnation: int, dataset: Dataset, epoch: int,
                          want: bool, held: tuple[tuple[int, int], ...]) -> Grant:
        return await self.up.lease(js.config.name, member, incarnation, dataset, epoch, want, held)

    def _behind(self, js: RelayJob, since: int) -> bool:
        # The parent announced that version (or is out of reach, so nobody here knows better).
        return since <= js.parent_version or not self.up.reachable

    def _lag(self, js: RelayJob, now: float) -> tuple[int, float]:
        # Behind the parent, or cut off from it (then it cannot know how far behind): the time
        # since it last held the parent's newest version (every answered long-poll confirms).
        behind = (js.parent_version > js.view.version or not self.up.reachable
                  or js.pull_failures >= _FAILING_PULLS)  # answered, but not with versions it can take
        return (js.parent_version or js.view.version,
                (now - js.synced_at) if behind and js.synced_at else 0.0)

    def _telemetry(self, js: RelayJob, meta: PushMeta) -> bool:
        if not super()._telemetry(js, meta):
            return False
        loss, n, secs = js.unsent_report  # goes up with the next aggregate
        js.unsent_report = (loss + meta.loss_sum, n + meta.loss_count, secs + meta.step_seconds_sum)
        return True

    # -- jobs: the root decides; a relay passes the calls on --------------------------------
    def check_create(self, cfg: JobConfig | str, layout: Layout | None) -> None:
        if layout is not None and layout.numel > self.config.max_job_params:
            raise BadInput(f"job has {layout.numel} parameters; this {self.role} tier holds jobs of at "
                           f"most {self.config.max_job_params} (--max-job-params)")

    async def create_job(self, cfg: JobConfig | str, layout: Layout | None, values: np.ndarray | None,
                         job_token: str = "") -> tuple[bool, int, int]:
        """Passed on to the root (``job_token``: a sharded job's, from its shard 0, for this
        relay's root shard to take on)."""
        return await self.up.create_job(cfg, layout, values, job_token)

    async def create_job_through(self, name: str, frames: AsyncIterator[bytes],
                                 timeout: float | None = None) -> tuple[bool, int, int]:
        """A CreateJob's frames, passed on to the root as they arrive (the servicer checks each)."""
        return await self.up.create_job_through(name, frames, timeout)

    async def list_jobs(self) -> list[dict]:
        return await self.up.list_jobs()

    async def end_job(self, name: str) -> int:
        return await self.up.end_job(name)

    def encoder(self, js: RelayJob) -> Encoder:
        """The job's upward codec at this tier: --up-codec, else the job's relay codec, else
        its push codec."""
        if js.encoder is None:
            cfg = js.config
            name = self.config.up_codec or cfg.relay_codec or cfg.push_codec
            js.encoder = Encoder.for_job(cfg, name, seed=self.member_id)
        return js.encoder

    # -- downward --------------------------------------------------------------------------
    async def _follow(self, job: str, js: RelayJob) -> None:
        """Keep ``js``'s view on the parent's, until the job is dropped or replaced (one loop
        per job: two would each apply the same delta, the second to a view already past it)."""
        delay, bad_snapshots = _BACKOFF_S[0], 0
        while self.jobs.get(job) is js:
            forced = job in self._force_snapshot
            epoch = 0 if forced else js.view.epoch
            # Without a view, take a snapshot of whatever the parent holds right away.
            want = js.view.version + 1 if epoch else 0
            try:
                meta, versions = await self.up.pull(job, epoch, js.view.version, want, _PULL_WAIT_S)
                if self.jobs.get(job) is not js:
                    return  # dropped or replaced while the pull waited
                self._force_snapshot.discard(job)
                self.apply_pulled(js, meta, versions)
                delay, bad_snapshots, js.pull_failures = _BACKOFF_S[0], 0, 0
            except Stale as exc:
                self._force_snapshot.add(job)
                if not forced:  # a delta on another base: a snapshot at once
                    log.warning("%s: %s", self.role, exc)
                    continue
                # The snapshot itself failed its checksum: not a base, the bytes or the parent
                # (or a release apart). Never a tight loop of whole-model pulls; said loudly.
                bad_snapshots += 1
                js.pull_failures += 1
                log.log(logging.ERROR if bad_snapshots >= _BAD_SNAPSHOTS else logging.WARNING,
                        "%s: job %s: %d snapshot(s) in a row from the parent failed: %s", self.role, job,
                        bad_snapshots, exc, extra=event("parent.bad_snapshot", job=job, count=bad_snapshots))
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
            except UnknownJob:
                if await self._job_gone(job):
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
            except HpsError as exc:
                if isinstance(exc, BadInput):  # a reply whose chunks do not assemble: not pulled again
                    self._force_snapshot.add(job)
                js.pull_failures += 1  # (the parent out of reach says so itself: parent.lost)
                log.log(logging.WARNING if js.pull_failures == _FAILING_PULLS else logging.DEBUG,
                        "%s: pull of %s failed %d time(s) in a row: %s", self.role, job, js.pull_failures, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
            except Exception:  # a bug or a reply nothing checked: said, and the loop goes on
                js.pull_failures += 1
                log.exception("%s: following job %s failed", self.role, job)
                await asyncio.sleep(_BACKOFF_S[1])

    async def _job_gone(self, job: str) -> bool:
        """The parent says it does not know ``job``: it ended, or the parent restarted and holds
        no state for it yet (a relay learns jobs only from its children's registrations).
        Registering again asks the root, whose answer is authoritative: drop the job only if
        that fails with UnknownJob too. True if the job is gone."""
        self.attached.discard(job)
        try:
            await self._job_for_register(job)
            return False
        except UnknownJob as exc:
            self._drop_job(job, str(exc))
            return True
        except HpsError as exc:  # cannot tell now; the heartbeat loop registers again
            log.warning("%s: re-registering job %s failed: %s", self.role, job, exc)
            return False

    def _drop_job(self, job: str, why: str) -> None:
        """The parent no longer knows the job (it ended): refuse it here too."""
        js = self.jobs.pop(job, None)
        if js is None:
            return
        log.warning("%s: dropping job %s: %s", self.role, job, why)
        self.ended[job] = js.view.version
        self.attached.discard(job)
        for per_job in (self._up_acked, self._up_issued, self._fwd_locks):
            per_job.pop(job, None)
        self.unanswered.drop(job)
        self.own_unsure.pop(job, None)
        self._force_snapshot.discard(job)
        js.abort(why)

    def apply_pulled(self, js: RelayJob, meta: PullMeta, versions: list) -> None:
        """Bring the view to the parent's: a verified snapshot or verified deltas, which the log
        keeps verbatim to serve the children."""
        js.parent_version = max(meta.to_version, js.view.version) if meta.view_epoch == js.view.epoch \
            and not meta.snapshot else meta.to_version  # (a snapshot: what the parent holds, even if less)
        applied: list = []
        try:
            pulled = apply_pull(js.view, js.layout, meta, versions, applied)
        except HpsError:
            # A version of the reply failed: those before it are in the view, so in the log too
            # (it ended below the view: every child then took a snapshot), and waiting children
            # hear of them.
            for entry in applied:
                js.log.append(entry)
            if applied:
                js.notify()
            raise
        js.stats.bytes_pulled_in += pulled.nbytes
        if pulled.snapshot:
            js.log.clear()
        for entry in pulled.entries:
            js.log.append(entry)
        if pulled.new_lineage:
            log.warning("%s: job %s moved to root epoch %#x at version %d; resynced from a snapshot",
                        self.role, js.config.name, meta.view_epoch, js.view.version)
            js.reset_round(js.view.version, "the root restarted")
            if js.encoder is not None and not self._carries_pseudo_gradients(js):
                js.encoder.reset()  # residuals of gradients on the old lineage are void
        if js.view.version >= js.parent_version:
            js.synced_at = self.clock()
        if versions:
            js.notify()
