"""The worker's link to its tier: register, push gradients, pull the published view.

>>> from ps.core.view import KeySpec
>>> layout = Layout([KeySpec("w", (4, 3)), KeySpec("b", (3,))])
>>> client = ParameterClient(address, job="linear", worker_id="w0")
>>> client.create_job(JobConfig(name="linear"), layout, np.zeros(15, np.float32))  # first caller wins
True
>>> client.register()
>>> version, nbytes = client.push(np.ones(15, np.float32))    # returns once applied (BSP)
>>> client.pull(min_version=version)                           # payload bytes received
60
>>> client.view.version, client.view.values[:3]                # the root's view_v, bit for bit
(1, array([-0.01, -0.01, -0.01], dtype=float32))
>>> client.close()

The client keeps its own replica (``ps.core.view.View``) and verifies every version's checksum,
so what a training script sees is the root's published view bit for bit (invariant 1). A
background thread heart-beats; transient faults are retried with backoff and logged.

Each client is one incarnation (a random id it registers with): a restarted process is a new
incarnation of its worker id, so none of its pushes is ever taken for the old one's. A retry
resends the very same bytes (same sequence number and digest), so a tier that already applied
it answers with the recorded acknowledgement. A push given up on unanswered (retries spent,
Ctrl-C) is asked after at the root by the next push; if the script sends the same gradient
again (same clocks, same view), that push is answered with the first one's version, known by a
fingerprint of what it was made from (``_Unheard``): its bytes may differ (a lossy codec's
second encode, the step's telemetry). Faults a tier's restart causes (unavailable,
"register again", "budget full, retry") are retried, so the training loop does not see them:
by default for as long as the tier would hold a silent worker (its member timeout, announced
at registration) but at least ``RETRY_FLOOR_S`` (60 s), or for an explicit ``retry_s``. Each
retry window logs one line when it opens (what failed, until when it retries), and one when it
ends (through, or given up on).

Alternate tiers (issue 15): ``address`` may list several, comma-separated (``"zone-a:7000,
zone-b:7000"``, also through ``HPS_ADDRESS``), tried in order. When the tier in use stops
answering -- at once if nothing listens there any more (a killed process), else after the
tier's member timeout -- the client moves to the next, registers there and goes on. A push
that was in flight through the tier it left is first resolved at the root through the new one
(``Resolve``): applied, its acknowledgement is returned; not applied, the very same push is sent
again. The training loop sees a pause, not an error.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch

from ps.core.codecs import get_codec
from ps.core.config import JobConfig
from ps.core.encoder import Encoder, input_print
from ps.core.errors import (
    BadInput,
    Conflict,
    Exhausted,
    HpsError,
    Internal,
    NotMember,
    NotReady,
    Stale,
    TimedOut,
    Unavailable,
)
from ps.core.leases import Dataset, Grant
from ps.core.logs import event
from ps.core.ranks import RankInfo
from ps.core.replica import apply_pull
from ps.core.tensors import payload_bytes, split
from ps.core.types import NO_STEP, Chunk, PullMeta, PushKey, PushMeta, StepInfo, VersionMeta
from ps.core.view import Layout, View
from ps.net.messages import (
    OUTCOME_NAME,
    ROLE,
    dataset_to_pb,
    grant_from_pb,
    job_from_pb,
    layout_from_pb,
    rank_from_pb,
    shards_to_pb,
)
from ps.net.rpc import Caller, cannot_connect
from ps.net.tls import TlsFiles
from ps.net.wire import as_resend, decode_pull_reply, encode_create_job, encode_push, keys_to_pb, pb, push_digest

__all__ = ["ParameterClient", "StepResult", "RETRY_FLOOR_S"]

log = logging.getLogger("hps.worker")
T = TypeVar("T")
# The shortest default retry window: a tier restarts in seconds (a process) to minutes (a pod
# rescheduled), longer than a short member timeout; the worker registers again when it is back.
RETRY_FLOOR_S = 60.0
# How long a tier that still connects but does not answer is tried before an alternate, while
# the tier's own member timeout is not known yet (before the first registration).
_SWITCH_AFTER_S = 3.0
_BAD_SNAPSHOTS = 3  # snapshots in a row that fail their checksum before a pull gives up


@dataclass(frozen=True)
class StepResult:
    """What ``HpsOptimizer.step`` did: the version now held, and the payload bytes it moved.

    >>> StepResult(version=42, applied=True, bytes_up=4096, bytes_down=4096).applied
    True
    """

    version: int          # version the worker now holds
    applied: bool         # False: the gradient was not applied (round aborted); see log
    bytes_up: int         # payload bytes pushed this step
    bytes_down: int       # payload bytes pulled this step


class ParameterClient:
    """One worker's link to job ``job`` at the tier ``address``: push gradients, pull the view.

    >>> client = ParameterClient(address, job="linear", worker_id="w1")   # a job created above
    >>> client.register()                       # joins; client.config and client.layout arrive
    >>> client.pull(min_version=client.start_version) > 0    # a snapshot of the published view
    True
    >>> client.config.name, client.view.version
    ('linear', 1)
    >>> client.close()                          # leaves: it no longer holds up bsp rounds

    ``worker_id`` names the worker in the job (a random one if None); each client is a new
    incarnation of it. ``timeout_s`` bounds each call, ``round_timeout_s`` a wait for a round
    or a version, ``retry_s`` how long transient faults are retried (seconds; None: the longer
    of the tier's member timeout and ``RETRY_FLOOR_S``, see ``retry_window_s``). ``tls``: the
    worker's certificate, key and the cluster's CA (``TlsFiles``; None: ``HPS_TLS_CERT``,
    ``HPS_TLS_KEY``, ``HPS_TLS_CA`` if set, else plaintext). ``token``: the job's token
    (default: HPS_TOKEN), or the admin's: a worker holding the admin token that creates its
    job is handed the job's token and uses it from then on. Every method
    raises the hps errors of ``ps.core.errors`` (``UnknownJob``, ``Conflict``, ``TimedOut``,
    ...); ``config``, ``layout``, ``view`` and ``encoder`` raise NotReady before ``register``.
    """

    def __init__(self, address: str, job: str, worker_id: str | None = None,
                 timeout_s: float = 30.0, round_timeout_s: float = 600.0, retry_s: float | None = None,
                 tls: TlsFiles | None = None, token: str | None = None) -> None:
        self.address = address
        self.job = job
        self.worker_id = worker_id or f"w-{uuid.uuid4().hex[:8]}"
        self.incarnation = secrets.randbits(62) | 1  # this process's, fresh per client
        self.timeout_s = timeout_s
        self.round_timeout_s = round_timeout_s
        self.retry_s = retry_s
        self.member_timeout_s = 0.0  # as the tier announced at registration
        self._config: JobConfig | None = None
        self._layout: Layout | None = None
        self._view: View | None = None
        self.start_version = 0
        self.start_clock = 0
        self.server_epoch = 0
        self.seq = 0                # sequence number of the push in flight (or last one)
        self.acked_seq = 0          # highest sequence number acknowledged
        self._issued = 0            # pipelined pushes: the highest sequence number sent
        # (seq, digest, tier switch count when sent) of a push whose answer never came
        self._unsure: tuple[int, bytes, int] | None = None
        # The last push whose call raised while it may have been applied: what it was made from,
        # so that the script sending it again is answered with its version (``_Unheard``).
        self._unheard: _Unheard | None = None
        self._last_meta: PushMeta | None = None  # the last push sent (``_answered_unheard``)
        # A streamed push interrupted while on its way (``worker.overlap.Sent``): what ends its
        # encoder recording once its delivery ends; the next push calls it first.
        self._pending: Callable[[], None] | None = None
        self._pending_lock = threading.Lock()  # (the encoding thread of an overlap calls it too)
        self._push_lock = threading.Lock()  # async: several pushes in flight (worker.sender)
        self.bytes_up = 0
        self.bytes_down = 0
        self.lost_steps = 0
        self.last_skipped = False   # the last acknowledged push's version skipped its step (AMP)
        # mutual TLS: this worker's certificate (None: HPS_TLS_CERT/KEY/CA if set, else plaintext);
        # rewritten files are picked up before the next call (ps/net/tls.py). The job's token
        # (or the admin's) is presented on every call; never logged.
        self._rpc = Caller(address, tls if tls is not None else TlsFiles.from_env(),
                           token or os.environ.get("HPS_TOKEN") or None)
        self.minted = ""  # the job's token, when this client created its job under the admin token
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._heartbeat_s = 0.5
        self._encoder: Encoder | None = None  # the push edge's codec and residuals (after register)
        self._dropped_epoch = 0  # the lineage held before a version failed (the view's epoch is 0 then)
        self._exit_hook: Callable[[], None] | None = None
        self._closed = False
        # On an alternate tier: the first one's health checks (``_probe_home``).
        self._home_ready, self._home_next, self._home_never = 0, 0.0, False
        self._go_home = threading.Event()  # ready twice in a row: the next push goes there

    # -- what registering brings -----------------------------------------------------------
    def _registered(self, value: T | None) -> T:
        if value is None:
            raise NotReady(f"{self.worker_id!r} has not registered for job {self.job!r}; call register() first")
        return value

    @property
    def config(self) -> JobConfig:
        """The job's configuration, as the tier answered the registration."""
        return self._registered(self._config)

    @property
    def layout(self) -> Layout:
        """The job's parameters: names, shapes, and where each sits in the flat vector."""
        return self._registered(self._layout)

    @property
    def view(self) -> View:
        """This worker's replica of the root's published view (verified, bit for bit)."""
        return self._registered(self._view)

    @property
    def encoder(self) -> Encoder:
        """The push edge's codec, density warm-up and error-feedback residuals."""
        return self._registered(self._encoder)

    # -- plumbing --------------------------------------------------------------------------
    def _call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        return self._rpc.call(name, request, timeout or self.timeout_s)

    @property
    def retry_window_s(self) -> float:
        """How long a transient fault is retried: ``retry_s`` if given, else as long as the tier
        would still hold this worker while it is silent (its member timeout), at least
        ``RETRY_FLOOR_S``. A tier set to ``HPS_MEMBER_TIMEOUT_S=300`` keeps its workers
        trying through a 5-minute pod reschedule."""
        if self.retry_s is not None:
            return self.retry_s
        return max(RETRY_FLOOR_S, self.member_timeout_s)

    def _retrying(self, what: str, fn: Callable[[], T], register_again: bool = True) -> T:
        """``fn()``, retried with backoff through the faults a tier's restart or a full budget
        causes, for ``retry_window_s``; NotMember registers again first."""
        window = self.retry_window_s
        start = time.monotonic()
        deadline, delay, attempts = start + window, 0.05, 0
        failing_since = start  # when the tier in use started failing
        while True:
            try:
                result = fn()
            except (Unavailable, Exhausted, NotReady) as exc:
                now = time.monotonic()
                attempts += 1
                if isinstance(exc, Unavailable) and len(self._rpc.addresses) > 1 and (
                        cannot_connect(exc) or now - failing_since >= (self.member_timeout_s or _SWITCH_AFTER_S)):
                    self._switch(exc)
                    failing_since, delay = now, 0.05
                if now + delay > deadline:
                    log.error("%s: %s at %s failed for %.1fs (%d attempts; retry window %.0fs); giving up: %s",
                              self.worker_id, what, self._rpc.address, now - start, attempts, window, exc,
                              extra=event("worker.gave_up", job=self.job, member=self.worker_id,
                                          seconds=round(now - start, 3), window_s=window))
                    raise
                if attempts == 1:  # one line per retry window, not one per attempt
                    until = time.strftime("%H:%M:%S", time.localtime(time.time() + deadline - now))
                    log.warning("%s: %s at %s failed (%s); retrying until %s (%.0fs window: %s)",
                                self.worker_id, what, self._rpc.address, exc, until, window,
                                "retry_s" if self.retry_s is not None else
                                f"the longer of the tier's member timeout {self.member_timeout_s:g}s "
                                f"and {RETRY_FLOOR_S:g}s",
                                extra=event("worker.retrying", job=self.job, member=self.worker_id,
                                            error=type(exc).__name__, window_s=window))
                time.sleep(delay)
                delay = min(delay * 2, 0.5)  # as the channel's reconnect backoff (ps.net.rpc)
                if isinstance(exc, NotMember) and register_again:
                    try:
                        self.register()
                    except (Unavailable, Exhausted, NotReady):
                        pass  # the next attempt says so again
            else:
                if attempts:
                    took = time.monotonic() - start
                    log.warning("%s: %s at %s went through after %.1fs of retries (%d attempts)",
                                self.worker_id, what, self._rpc.address, took, attempts,
                                extra=event("worker.recovered", job=self.job, member=self.worker_id,
                                            seconds=round(took, 3)))
                return result

    def _switch(self, why: HpsError) -> None:
        """Move to the next tier of ``address`` (the one in use is gone); the next call there
        is answered NotMember, and ``_retrying`` registers again."""
        old = self._rpc.address
        self._go_home.clear()  # wherever it goes now, a move back starts over
        self._home_ready = 0
        new = self._rpc.switch()
        log.warning("%s: tier %s is gone (%s); switching to %s", self.worker_id, old, str(why)[:160], new,
                    extra=event("worker.switched", job=self.job, member=self.worker_id, tier=new))

    def _land_pending(self) -> None:
        """Wait for a streamed push interrupted on its way (``_pending``) to be answered or given
        up on, and settle its encode by that; a push may not take its number while it is out."""
        with self._pending_lock:
            if self._pending is not None:
                self._pending()  # (interrupted again: it stays pending)
                self._pending = None

    def _unheard_push(self, seq: int, grad: np.ndarray | torch.Tensor, meta: PushMeta) -> None:
        """Push ``seq`` (``meta``, made from ``grad``) went unanswered as its call raises to the
        script: remember what it was made from, in case the script sends it again."""
        try:
            self._unheard = _Unheard(seq, self._input_print(grad, meta))
        except Exception:  # (out of memory copying it to the host): known by its bytes only
            self._unheard = None
            log.warning("%s: push %d went unanswered; sending the same gradient again may apply it twice "
                        "(its fingerprint failed)", self.worker_id, seq, exc_info=True)

    def _answered_unheard(self, grad: np.ndarray | torch.Tensor, version: int) -> None:
        """The last push (made from ``grad``) was answered, applied by ``version``, but the call
        the script made raised all the same (a sharded push another shard of which failed):
        remember it as one unheard, answered."""
        if self._last_meta is not None and self._last_meta.seq == self.acked_seq:
            self._unheard_push(self.acked_seq, grad, self._last_meta)
            self._heard(self.acked_seq, version, self.last_skipped)

    def _heard(self, seq: int, version: int, skipped: bool) -> None:
        """Push ``seq``'s answer, known after its call raised (asked at the root, or a streamed
        push whose delivery went on): version ``version`` applied it."""
        if self._unheard is not None and self._unheard.seq == seq:
            self._unheard.ack = (version, skipped)

    def _settle_unsure(self) -> Any | None:
        """What became of the push given up on unanswered (``_unsure``): its reply (a PushAck)
        if the root applied it (its number is spent: acknowledged now), None if not. Retried
        while it is still in flight above, for the retry window."""
        assert self._unsure is not None
        seq, digest, sent_via = self._unsure
        applied = self._retrying("resolving an unanswered push",
                                 lambda: self._resolve_push(seq, digest, moved=sent_via != self._rpc.switches))
        self._unsure = None
        if applied is not None:
            with self._push_lock:
                self.acked_seq = max(self.acked_seq, seq)
            self._heard(seq, applied.applied_version, applied.skipped)
        # What its encode took of the residual stays taken only if something of it was applied.
        self.encoder.settle(applied is not None and not applied.skipped)
        return applied

    def _resolve_push(self, seq: int, digest: bytes, moved: bool = True) -> Any | None:
        """What became of push ``seq``, sent through a tier this client has left (``moved``) or
        given up on unanswered: its reply (a PushAck) if the root applied it, None if not (send
        it again); NotReady while it is still in flight above (a batch there holds it until the
        tier it went through times out). A tier asked by a worker that moved there does not
        hold the open round for it (its gradient for that round went the other way)."""
        wait_s = min(30.0, 2 * (self.member_timeout_s or _SWITCH_AFTER_S) + 5.0)
        key = PushKey(self.worker_id, self.incarnation, seq, digest)
        r = self._call("Resolve", pb.ResolveRequest(job=self.job, member=self.worker_id, wait_ms=int(wait_s * 1000),
                                                    moved=moved, keys=keys_to_pb((key,))),
                       timeout=wait_s + self.timeout_s)
        outcome = OUTCOME_NAME.get(r.outcome, "unknown")
        if outcome == "applied":
            log.info("%s: push %d, whose answer was lost, was applied as version %d", self.worker_id,
                     seq, r.version)
            return pb.PushAck(applied_version=r.version, view_epoch=r.view_epoch, duplicate=True, skipped=r.skipped)
        if outcome == "not_applied":
            return None
        # NotReady, not Unavailable: this tier answers (the push is in a batch above), so it is
        # no reason to move to another one.
        raise NotReady(f"push {seq}, whose answer was lost, is still in flight above; asking again")

    def close(self) -> None:
        """Stop heart-beating, leave the job (best effort) and close the channel. Also runs at
        normal interpreter exit for a client still open: the tier then records a worker that
        finished, not one that died (issue 19: members lost must mean lost)."""
        if self._closed:
            return
        self._closed = True
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        if self._roster_used:  # a clean departure: the rank and the data-shard leases go back
            try:
                self._call("Rank", pb.RankRequest(job=self.job, member=self.worker_id, incarnation=self.incarnation,
                                                  release=True), timeout=2)
            except HpsError:
                pass
        if self._config is not None:
            try:
                self._call("Leave", pb.LeaveRequest(job=self.job, member=self.worker_id), timeout=2)
            except HpsError:
                pass
        self._rpc.close()

    # -- jobs and membership ---------------------------------------------------------------
    def create_job(self, config: JobConfig | str, layout: Layout, values: np.ndarray, job_token: str = "") -> bool:
        """Create the job with these initial values (``config``: its configuration, or the name of
        one declared with ``hps job create``); False if it already existed. ``job_token``: at a
        root shard, the token shard 0 minted for this sharded job (``worker.sharded``)."""
        frames = encode_create_job(config, layout, split(layout, values, get_codec("fp32")), job_token)
        reply = self._retrying("create job", lambda: self._call("CreateJob", iter(frames)))
        self.minted = reply.job_token
        if reply.job_token or job_token:  # this admin-token holder made the job: act in it with its token
            self._rpc.token = reply.job_token or job_token
        return reply.created

    def register(self) -> None:
        """Join the job (again, after a tier restart): fetches its configuration and layout,
        sets ``start_version``/``start_clock`` and starts heart-beating. UnknownJob if the tier
        knows no such job."""
        r = self._retrying("register", lambda: self._call("Register", pb.RegisterRequest(
            job=self.job, member=self.worker_id, role=ROLE["worker"], last_seq=self.last_seq,
            incarnation=self.incarnation)), register_again=False)
        config = job_from_pb(r.config)
        if config is None:
            raise BadInput(f"the tier answered the registration for job {self.job!r} without its configuration")
        self._config, self.start_version, self.start_clock = config, r.start_version, r.start_clock
        layout = layout_from_pb(r.keys)
        if self._layout is None or self._layout != layout:
            self._layout, self._view = layout, View(layout)
        self.server_epoch = r.server_epoch
        if self._encoder is None:  # kept across re-registrations: the residuals are still owed
            self._encoder = Encoder.for_job(config, seed=self.worker_id, worker=True)
        self._heartbeat_s = max(r.heartbeat_ms / 1000.0, 0.05)
        self.member_timeout_s = r.member_timeout_ms / 1000.0
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name=f"hps-heartbeat-{self.worker_id}")
            self._hb_thread.start()
        if self._exit_hook is None:  # a weak reference: the hook must not keep the client alive
            self._exit_hook = functools.partial(_leave_at_exit, weakref.ref(self))
            atexit.register(self._exit_hook)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self._heartbeat_s):
            try:
                r = self._call("Heartbeat", pb.HeartbeatRequest(
                    member=self.worker_id, jobs=[self.job], server_epoch=self.server_epoch),
                    timeout=max(self._heartbeat_s * 2, 1.0))
            except HpsError as exc:
                log.warning("%s: heartbeat failed: %s", self.worker_id, exc)
                continue
            if r.unknown_jobs or r.server_epoch != self.server_epoch:
                log.warning("%s: tier forgot us (restarted or dropped us); registering again", self.worker_id)
                # Known before the registration is: a push retried meanwhile asks the root first
                # (``_deliver``) instead of racing the registration into a fresh book.
                self.server_epoch = r.server_epoch or self.server_epoch
                try:
                    self.register()
                except HpsError as exc:
                    log.warning("%s: re-register failed: %s", self.worker_id, exc)
            self._probe_home()

    def _probe_home(self) -> None:
        """On an alternate tier, ask the first one every member timeout whether it is a relay
        ready for children again (a health check, as a relay on an alternate parent does,
        ``ps.tiers.parents``); after two ready answers in a row the next push goes there
        (``_move_home``). A first address that is a root (a root pair) is never gone back to:
        a worker follows the primary."""
        if self._rpc.index == 0 or self._home_never or self._go_home.is_set():
            self._home_ready = 0
            return
        now = time.monotonic()
        if now < self._home_next:
            return
        self._home_next = now + max(self.member_timeout_s, self._heartbeat_s)
        try:  # at most a heartbeat interval: a blackholed first zone must not hold the heartbeats
            ready = self._rpc.relay_ready(0, timeout=max(self._heartbeat_s, 0.2))
        except Exception as exc:  # HpsError, or TLS files mid-rotation: not ready
            log.debug("%s: health check of %s failed: %s", self.worker_id, self._rpc.addresses[0], exc)
            ready = False
        if ready is None:
            self._home_never = True
            return
        self._home_ready = self._home_ready + 1 if ready else 0
        if self._home_ready >= 2:
            self._go_home.set()

    def _move_home(self) -> None:
        """Between two pushes: register at the first tier again, then leave the alternate (in
        that order: a heartbeat the alternate answered "unknown" after the leave would register
        this worker there again, a member that holds its rounds until it times out)."""
        self._go_home.clear()
        self._home_ready = 0
        away = self._rpc.index
        if away == 0:  # a switch brought it home meanwhile
            return
        home = self._rpc.switch(to=0)
        log.warning("%s: tier %s is ready again (two health checks); moving back to it from %s", self.worker_id,
                    home, self._rpc.addresses[away],
                    extra=event("worker.returned", job=self.job, member=self.worker_id, tier=home))
        self.register()
        try:
            self._rpc.call_at(away, "Leave", pb.LeaveRequest(job=self.job, member=self.worker_id),
                              timeout=self.timeout_s)
        except HpsError as exc:  # it forgets us by its member timeout instead
            log.warning("%s: leaving %s failed: %s", self.worker_id, self._rpc.addresses[away], exc)

    # -- ranks, workers, data shards ---------------------------------------------------------
    # Class-level defaults: set by the first rank or lease call.
    _rank_info: RankInfo | None = None
    _roster_used = False

    def rank(self, requested: int | None = None) -> RankInfo:
        """This worker's stable rank in the job (0..N-1, assigned by the root) and the job's
        world: ``world_size`` is the larger of the job's ``min_workers`` and the ranks held now;
        ``joined`` the ranks held (a killed worker's counts until its replacement, same worker
        id, takes it back). ``requested``: the rank to ask for (default: the one this client
        holds, else the ``RANK`` environment variable, else the lowest free); Conflict if another
        worker holds it. ``close`` gives the rank back.

        >>> c = ParameterClient(address, job="linear", worker_id="r0")
        >>> c.rank()
        RankInfo(rank=0, world_size=1, joined=1, holders=((0, 'r0'),))
        >>> c.close()
        """
        if requested is None:
            held = self._rank_info.rank if self._rank_info is not None else -1
            requested = held if held >= 0 else _env_rank()
        self._roster_used = True
        req = pb.RankRequest(job=self.job, member=self.worker_id, incarnation=self.incarnation,
                             requested_rank=requested)
        info = rank_from_pb(self._retrying("rank", lambda: self._call("Rank", req)))
        self._rank_info = info
        return info

    def wait_workers(self, n: int | None = None, timeout_s: float = 600.0, poll_s: float = 0.2) -> RankInfo:
        """Take a rank (``rank``) and wait until at least ``n`` workers hold ranks (default: the
        job's ``min_workers``, known once registered); returns the rank information then.
        TimedOut after ``timeout_s``, naming who joined."""
        want = self.config.min_workers if n is None else n
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.rank()
            if info.joined >= want:
                return info
            if time.monotonic() + poll_s > deadline:
                who = ", ".join(f"{r}: {m!r}" for r, m in info.holders) or "none"
                raise TimedOut(f"{info.joined} of {want} workers joined job {self.job!r} within {timeout_s:g}s "
                               f"(ranks held: {who}); start the others, or lower min_workers")
            time.sleep(poll_s)

    def lease(self, dataset: Dataset, epoch: int, want: bool = True,
              held: tuple[tuple[int, int], ...] = ()) -> Grant:
        """A data shard of ``epoch`` from the root (``ps.core.leases``; ``worker.sampler`` is
        the usual caller), renewing this worker's other leases; ``want=False`` only renews.
        ``held``: the shards this worker holds (taken back after a root restart)."""
        self._roster_used = True
        req = pb.LeaseRequest(job=self.job, member=self.worker_id, incarnation=self.incarnation,
                              dataset=dataset_to_pb(dataset), epoch=epoch, want=want, held=shards_to_pb(held))
        return grant_from_pb(self._retrying("lease", lambda: self._call("Lease", req)))

    # -- data plane ------------------------------------------------------------------------
    def pull(self, min_version: int = 0, wait_s: float | None = None, min_clock: int = 0) -> int:
        """Bring the local view to at least ``min_version`` (and, for SSP, a clock floor of at
        least ``min_clock``); returns payload bytes received. Waits at most ``wait_s`` seconds
        (default ``round_timeout_s``), then raises TimedOut; a version that fails its checksum
        is dropped and a snapshot pulled instead."""
        deadline = time.monotonic() + (self.round_timeout_s if wait_s is None else wait_s)
        received = 0
        start_epoch = self.view.epoch
        bad_snapshots = 0
        while True:
            view = self.view

            def one_pull(view: View = view) -> list[bytes]:
                req = pb.PullRequest(job=self.job, member=self.worker_id, view_epoch=view.epoch,
                                     since_version=view.version, min_version=min_version,
                                     wait_ms=int(min(5.0, max(0.0, deadline - time.monotonic())) * 1000),
                                     min_clock=min_clock)
                return self._rpc.stream("Pull", req, self.timeout_s + 5.0)
            meta, versions = decode_pull_reply(self._retrying("pull", one_pull))
            try:
                received += self._apply(meta, versions)
                bad_snapshots = 0
            except Stale as exc:
                log.warning("%s: %s", self.worker_id, exc)
                self._dropped_epoch = view.epoch or self._dropped_epoch
                view.epoch = 0  # ask for a snapshot next time
                if meta.snapshot:  # not a wrong base: the bytes or the checksum itself are wrong
                    bad_snapshots += 1
                    if bad_snapshots >= _BAD_SNAPSHOTS:
                        raise Internal(f"{exc}; {bad_snapshots} snapshots in a row failed their checksum: "
                                       "memory or the network corrupts them, or this worker and its tiers "
                                       "run different hps releases (the view checksum changed from CRC-32 "
                                       "to XXH3-64 on 2026-11-26, to per-block digests on 2026-11-28)") from None
                    time.sleep(0.2 * bad_snapshots)  # never a tight loop of multi-megabyte pulls
                # Bounded like every other way round this loop; but a failed delta is always
                # followed by the snapshot its docstring promises (the next pull: epoch 0), even
                # past the deadline: an async step pulls with none (wait_s=0) and raised TimedOut
                # instead, leaving the view at epoch 0 for the script's next push (review).
                if time.monotonic() > deadline and meta.snapshot:
                    raise TimedOut(f"version {min_version} did not arrive within the deadline: {exc}") from None
                continue
            moved = start_epoch and view.epoch != start_epoch  # new lineage: versions restart
            if view.ready and ((view.version >= min_version and view.clock_min >= min_clock) or moved):
                self.bytes_down += received
                return received
            if time.monotonic() > deadline:
                if view.clock_min < min_clock:
                    raise TimedOut(f"staleness bound: waited for every live worker to reach clock "
                                   f"{min_clock}, the slowest is at {view.clock_min}; a worker is "
                                   "stuck or far slower (raise the staleness or the deadline)")
                raise TimedOut(f"version {min_version} did not arrive within the deadline; the tier "
                               f"holds {meta.to_version}")

    def _apply(self, meta: PullMeta, versions: list[tuple[VersionMeta, list[Chunk]]]) -> int:
        held = self.view.epoch or self._dropped_epoch  # (a failed version left the view at epoch 0)
        pulled = apply_pull(self.view, self.layout, meta, versions)
        self._dropped_epoch = 0
        if pulled.snapshot and held and held != self.view.epoch and self._encoder is not None:
            # A new lineage (the root restarted): what the residuals owe was computed on the
            # old one, as the relays also judge (they reset theirs).
            self.encoder.reset()
        return pulled.nbytes

    @property
    def last_seq(self) -> int:
        """The number a (re)registration continues after: the last acknowledged, or with
        pipelined pushes the last sent (an overtaken one is then processed as it arrives)."""
        return max(self.acked_seq, self._issued)

    def _carried(self, absent: tuple[int, ...]) -> frozenset[str] | None:
        """The keys a push carries: all (None) but those it declares absent."""
        if not absent:
            return None
        gone = set(absent)
        return frozenset(s.key for i, s in enumerate(self.layout.specs) if i not in gone)

    def push(self, grad: np.ndarray | torch.Tensor, clock: int = 0, *, clock_max: int | None = None,
             base_version: int | None = None, view_epoch: int | None = None,
             contributors: int = 1, report: tuple[float, int, float] = (0.0, 0, 0.0),
             pipelined: bool = False, step: StepInfo = NO_STEP) -> tuple[int, int]:
        """Push a flat gradient (a sum of ``contributors`` gradients computed at clocks
        ``clock..clock_max`` on ``base_version``, default: the held view); returns the version
        that applied it and the payload bytes sent.

        ``grad`` may be a torch tensor on the training device: the job's codec selects and
        quantises there, and only the compressed payload is copied to the host. Lossy codecs
        keep what they did not send in ``self.encoder`` (error feedback).
        ``report`` is training telemetry the tiers export as metrics, never applied: (sum of
        losses, how many, sum of step seconds).
        ``pipelined`` (async): other pushes may be in flight at once, from other threads; each
        takes its own sequence number (the tiers accept them out of order).
        ``step``: what the push says about its optimizer step beyond the gradient
        (hyperparameters, keys without a gradient, an AMP skip, buffers, leased-data progress).
        Raises Stale when the round it belonged to was aborted (nothing applied).
        """
        clock_max = clock if clock_max is None else clock_max
        finite = torch.isfinite(grad).all() if isinstance(grad, torch.Tensor) else np.isfinite(grad).all()
        if contributors and not finite:
            raise BadInput("the gradient holds NaN/Inf values; not pushed (check the loss scale)")
        if not pipelined:
            self._land_pending()
        if self._go_home.is_set() and not pipelined:
            self._move_home()
        # A push given up on unanswered holds the next number (``_unsure``): the root says what
        # became of it before this one encodes, so that one not applied gives back what it took
        # of the residual (``Encoder.settle``) and this encode starts from there.
        settled: tuple[Any, int, bytes] | None = None
        if not pipelined and self._unsure is not None and self._unsure[0] == self.acked_seq + 1:
            unsure_seq, unsure_digest = self._unsure[:2]
            settled = (self._settle_unsure(), unsure_seq, unsure_digest)
        unheard = self._unheard if not pipelined else None
        # A skipped step (step.skip: AMP found an overflow here) carries no gradient: encoding
        # zeros would send what the residual owes earlier steps in a round that is skipped.
        record = bool(contributors) and not pipelined and not step.skip and not self.encoder.lossless
        with self._push_lock:
            # Numbers advance only on acknowledgement: a retry (lost ack) or a refused push
            # reuses the number, and the tier answers an applied one with its recorded ack.
            # Pipelined, each push in flight holds its own number.
            if pipelined:
                seq = self._issued = max(self._issued, self.acked_seq) + 1
            elif settled is not None and settled[0] is not None:
                seq = settled[1]  # applied: this push is either that one again or takes the next number
            else:
                seq = self.acked_seq + 1
            self.seq = seq
            record = record and not self.encoder.recording  # (a streamed push records its own)
            if record:
                # Taken back whole if the push is not applied (refused, or its round skipped):
                # what it carried of the residual -- owed to earlier, acknowledged steps -- stays
                # owed. Costs a copy of each residual it touches (benchmarks/encode_recording.py).
                self.encoder.begin()
            # Encoded once: a retry resends these very bytes, so the residual is updated once.
            # An empty contribution (a worker with no data left this round) carries no body.
            # copy=False: fp32 chunks are views of grad, framed right here (one copy, not two).
            # Keys the step has no gradient for (step.absent: frozen, unused) are not sent at
            # all, and their residuals wait for a step that has one: a tier takes a key no
            # chunk covers as zeros, and the optimizer leaves an absent key alone.
            try:
                chunks = self.encoder.split(self.layout, grad, step=clock_max, copy=False,
                                            only=self._carried(step.absent)) if contributors and not step.skip else []
                meta = PushMeta(
                    self.job, self.worker_id, seq, self.view.version if base_version is None else base_version,
                    (self.view.epoch or self._dropped_epoch) if view_epoch is None else view_epoch,
                    contributors, clock, clock_max,
                    clock_max + 1, *report, incarnation=self.incarnation, step=step)
                frames = encode_push(meta, chunks)
            except BaseException:  # (out of memory, Ctrl-C): nothing was sent; the encode is taken back
                self._recorded(record, keep=False)
                raise
        sending = False
        try:
            nbytes = payload_bytes(chunks)
            digest = push_digest(frames)
            # The last push the script heard no answer for was applied: sent again -- the same
            # gradient on the same view and clocks -- it gets that version, and this encode is
            # taken back (nothing is sent; the first one's stood, or went back with the settle).
            # Known by what it was made from, not by its bytes: a lossy codec encodes it to other
            # bytes the second time (the residual moved on), and the script's telemetry differs.
            again: tuple[int, bool] | None = None
            if settled is not None and settled[0] is not None and settled[2] == digest:
                again = settled[0].applied_version, settled[0].skipped
            elif (unheard is not None and unheard.ack is not None and unheard.seq == self.acked_seq
                  and unheard.print == self._input_print(grad, meta)):
                again = unheard.ack
            if again is not None:
                self._unheard = None
                self.last_skipped = again[1]  # its round skipped: nothing of it was applied
                self._recorded(record, keep=False)
                return again[0], nbytes
            if settled is not None and settled[0] is not None:
                # The number of a push whose answer never came, and the root applied it (asked at
                # any tier: a resend through another would be placed there as new): another body
                # takes the next number.
                seq = self.seq = seq + 1
                frames = encode_push(replace(meta, seq=seq), chunks)
                digest = push_digest(frames)
            self._unheard, self._last_meta, sending = None, replace(meta, seq=seq), True
            result = self._deliver(seq, lambda: iter(frames), lambda: digest, contributors, lambda: nbytes)
        except (Stale, BadInput, Conflict):  # not applied, and it will not be
            self._recorded(record, keep=False)
            raise
        except BaseException:  # sent and unanswered, it may still be applied; never sent, it will not be
            if sending and self._unsure is not None and self._unsure[0] == seq:
                if record:
                    self.encoder.set_aside()  # until the next push asks the root (``_settle_unsure``)
                if not pipelined:  # (a pipelined push is never sent again by the script)
                    self._unheard_push(seq, grad, meta)
            else:  # refused by an answer, or never sent: not applied
                self._recorded(record, keep=False)
            raise
        self._recorded(record, keep=not self.last_skipped)
        return result

    @staticmethod
    def _input_print(grad: np.ndarray | torch.Tensor, meta: PushMeta) -> bytes:
        """What push ``meta`` was made from (``input_print``), its sequence number and telemetry
        aside: a push sent again after its answer was lost has the same."""
        return input_print(grad, meta.base_version, meta.view_epoch, meta.contributors, meta.clock_min, meta.clock_max,
                           meta.step.absent)

    def _recorded(self, record: bool, keep: bool) -> None:
        """End the encoder's recording of a push (if ``record``): keep what its encode did to the
        residuals, or take it back (the push was not applied)."""
        if record:
            if keep:
                self.encoder.commit()
            else:
                self.encoder.roll_back()

    def _deliver(self, seq: int, frames: Callable[[], Iterator[bytes]], digest: Callable[[], bytes],
                 contributors: int, nbytes: Callable[[], int]) -> tuple[int, int]:
        """Send push ``seq`` (``frames()``: its frames from the first, each time it is sent;
        ``digest()`` and ``nbytes()``: its end marker's digest and its payload bytes, asked for
        once it is complete) until a tier answers it; returns (applied version, payload bytes)."""
        sent_via: list[int] = []  # the tier (switch count) of the last unanswered send
        # Whether a send may have been placed (its answer was lost), and the incarnation of the
        # tier it went to (``server_epoch``, from the registration).
        unknown, sent_to = False, self.server_epoch

        def attempt() -> Any:
            nonlocal unknown, sent_to
            moved = bool(sent_via) and sent_via[-1] != self._rpc.switches
            # A tier that restarted since (registered again, by this call's retry or by the
            # heartbeat) remembers nothing of it and would place it as new: in ssp and async
            # nothing else stopped that, and it was applied twice.
            restarted = unknown and sent_to != self.server_epoch
            if (moved or restarted) and contributors:
                # Sent through a tier this client has left, or one that forgot it: the root
                # decides before it goes again.
                resolved = self._resolve_push(seq, digest(), moved=moved)
                if resolved is not None:
                    return resolved
                unknown = False
            sent_via.append(self._rpc.switches)
            sent_to = self.server_epoch
            # Still unknown: the tier may be a new incarnation that this client has not noticed
            # yet (the heartbeat registered there while this was on its way). The push says it
            # is a resend of one sent to incarnation ``sent_to`` (unchanged since the earlier
            # sends: a change asks the root above), and a tier of another incarnation that does
            # not hold it asks the root before placing it.
            body = as_resend(frames(), sent_to) if unknown and contributors and sent_to else frames()
            try:
                return self._call("Push", body, timeout=self.round_timeout_s)
            except Unavailable:
                unknown = True
                raise
            except HpsError:  # the tier's answer
                raise
            except BaseException:  # interrupted on its way (Ctrl-C while the round waits): it may be placed
                unknown = True
                raise
        # A retry after a lost acknowledgement reuses the sequence number: applied once.
        try:
            reply = self._retrying("push", attempt)
        except BaseException as exc:
            # Given up on unanswered, or interrupted after a send went unanswered (a refused
            # credential on the retry, Ctrl-C): the tiers may still apply it. The next push under
            # its number asks the root first (``_settle_unsure``), a resend of it too; else a
            # new gradient under the number was refused as another body (Conflict) for good.
            # A tier's own answer (Stale, BadInput, Conflict) says it was not applied.
            answered = isinstance(exc, (Stale, BadInput, Conflict))
            if contributors and not answered and (unknown or isinstance(
                    exc, (TimedOut, Unavailable, Exhausted, NotReady))):
                try:
                    self._unsure = (seq, digest(), sent_via[-1] if sent_via else self._rpc.switches)
                except BadInput:  # never completed, so never applied
                    pass
            raise
        with self._push_lock:
            self.acked_seq = max(self.acked_seq, seq)
            if self._unsure is not None and self._unsure[0] <= self.acked_seq:
                self._unsure = None
            self.bytes_up += nbytes()
            self.last_skipped = reply.skipped
        return reply.applied_version, nbytes()


@dataclass
class _Unheard:
    """A push whose call raised to the script while it may have been applied (``seq``), what it
    was made from (``ParameterClient._input_print``), and its answer once known: (the version
    that applied it, whether its round was skipped)."""

    seq: int
    print: bytes
    ack: tuple[int, bool] | None = None


def env_int(name: str) -> int | None:
    """An integer environment variable (RANK, WORLD_SIZE, LOCAL_RANK, as torchrun and Kubernetes
    indexed jobs set them), None when unset; BadInput when it is not an integer."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadInput(f"the {name} environment variable must be an integer, got {value!r}") from None


def _env_rank() -> int | None:
    return env_int("RANK")


def _leave_at_exit(ref: weakref.ref) -> None:
    client = ref()
    if client is not None:
        client.close()
