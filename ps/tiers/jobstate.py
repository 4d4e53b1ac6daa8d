"""One job's state at one tier (plain data for the async shell): what every tier keeps
(``JobState``), and what only the root (``RootJob``) or a relay (``RelayJob``) adds.

>>> from ps.core.view import KeySpec
>>> async def one_round():
...     js = RelayJob(JobConfig(name="lm"), Layout([KeySpec("w", (3,))]))   # view, delta log,
...     pull = asyncio.create_task(js.wait_change(timeout=5))   # members, the open round or window
...     await asyncio.sleep(0); js.notify()    # wakes every pull waiting for a newer version
...     await pull
...     push = asyncio.shield(js.open_future())    # each push in the open round waits on this
...     fut, sources = js.close_batch(); fut.set_result("ack of v1")
...     return await push
>>> asyncio.run(one_round())
'ack of v1'

``ps.tiers.tier`` drives these; they hold no I/O of their own besides the event-loop futures that
pushes and pulls wait on.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig
from ps.core.consistency import BspRound, Membership, Window
from ps.core.deltas import DeltaLog
from ps.core.encoder import Encoder
from ps.core.errors import HpsError, Stale, UnknownJob
from ps.core.exactly_once import AppliedBook, SeqBook
from ps.core.leases import LeaseBook
from ps.core.losswatch import LossWatch
from ps.core.outer import Pace
from ps.core.ranks import RankBook
from ps.core.tensors import Chunk, split
from ps.core.types import JobStats, PushKey
from ps.core.view import Layout, View
from ps.net.aio import wait_for
from ps.net.wire import framed
from ps.tiers.wal import WriteAheadLog

if TYPE_CHECKING:  # the root's (torch): a relay's jobs have none
    from ps.core.optim import ServerOptimizer

__all__ = ["JobState", "RootJob", "RelayJob"]

_DEPARTED_BOOKS = 4096  # sequence books kept for members that left or timed out


@dataclass
class JobState:
    """One job at one tier: the replica view, its delta log, members and the open round."""

    config: JobConfig
    layout: Layout
    view: View = None
    log: DeltaLog = None
    members: Membership = field(default_factory=Membership)
    books: dict[str, SeqBook] = field(default_factory=dict)
    # Books of members that left or timed out, so a retry after a short absence is still
    # recognised (bounded: oldest first out).
    departed: OrderedDict = field(default_factory=OrderedDict)
    # Members dropped after the member timeout that have not registered again: id -> (role,
    # address, when dropped). A member that leaves (finished) or comes back is taken out, so
    # "lost" means died, not done (issue 19). Bounded by the members the job ever had.
    lost: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    round: BspRound = None               # bsp: the open round
    window: Window = None                # ssp/async: the open aggregation window
    futs: dict[int, asyncio.Future] = field(default_factory=dict)  # open/in-flight batches
    serial: int = 0                      # the open batch's key in futs
    # The worker pushes each open or in-flight batch sums (what a relay forwards as sources,
    # what the root records as applied), and where each one is.
    sources: dict[int, list[PushKey]] = field(default_factory=dict)
    where: dict[tuple[str, int, int], int] = field(default_factory=dict)
    # SSP: the clock floor each member's pushes in an open or in-flight batch raise it to,
    # (incarnation, floor) by member, taken into ``Member.floor`` only once that batch is
    # applied: a batch that fails leaves the floors as they were, so no later batch claims
    # clocks whose gradients were never applied (invariant 3).
    floors: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    inflight: int = 0                    # ssp/async: closed windows being applied / sent up
    timer: asyncio.TimerHandle | None = None
    reported_floor: int = 0              # the clock floor last sent up (relay) or stamped (root)
    floor_sent: int = 0                  # the highest clock floor a relay has sent up (answered or not)
    pending: dict[tuple[str, int, int], asyncio.Future] = field(default_factory=dict)
    stats: JobStats = field(default_factory=JobStats)
    created_at: float = 0.0
    joined: bool = False                 # a member ever registered (the root reaps jobs nobody joins)
    above_inner: bool = False            # this tier is above an outer job's inner loop (the root, a relay)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _snapshot: tuple[int, int, list[Chunk]] | None = None

    def __post_init__(self) -> None:
        self.view = self.view or View(self.layout, reuse=True)  # a tier's own replica
        # Bytes too: twice a dense snapshot's (a child further behind is served one more cheaply),
        # and never under 64 MiB (a small model keeps its whole count).
        self.log = self.log or DeltaLog(self.config.delta_log_length,
                                        max_bytes=max(64 << 20, 2 * 4 * self.layout.numel))
        self.round = self.round or BspRound(round=0, numel=self.layout.numel)
        self.window = self.window or self.new_window()

    @property
    def bsp(self) -> bool:
        # outer: bsp rounds of the workers inside a region, and of the regions at the root,
        # unless its outer steps are asynchronous: then each region's push is applied alone
        return self.config.mode in ("bsp", "outer") and not self.outer_async

    @property
    def outer_async(self) -> bool:
        """At this tier (above an outer job's inner loop), regions' pushes go as they come."""
        return self.above_inner and self.config.outer is not None and self.config.outer.asynchronous

    def new_window(self) -> Window:
        return Window(numel=self.layout.numel, repeats=self.config.mode == "async")

    def notify(self) -> None:
        """Wake everything waiting for a newer version."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        try:
            await wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- members' sequence books -------------------------------------------------------------
    def book(self, member: str, incarnation: int) -> SeqBook:
        """The sequence book of this member incarnation; a new incarnation starts a new one."""
        book = self.books.get(member)
        if book is None or book.incarnation != incarnation:
            old = self.departed.pop(member, None)
            book = old if old is not None and old.incarnation == incarnation else SeqBook(incarnation)
            self.books[member] = book
        return book

    def retire(self, member: str) -> None:
        """The member left or timed out: keep its book a while for late retries."""
        book = self.books.pop(member, None)
        if book is not None:
            self.departed[member] = book
            self.departed.move_to_end(member)
            while len(self.departed) > _DEPARTED_BOOKS:
                self.departed.popitem(last=False)

    # -- batches -----------------------------------------------------------------------------
    def open_future(self) -> asyncio.Future:
        """The outcome of the open batch (round or window), shared by every push in it."""
        fut = self.futs.get(self.serial)
        if fut is None:
            fut = self.futs[self.serial] = asyncio.get_running_loop().create_future()
            key = self.serial
            fut.add_done_callback(lambda f: self.futs.pop(key) if self.futs.get(key) is f else None)
        return fut

    def add_sources(self, keys: tuple[PushKey, ...]) -> None:
        """The open batch now sums these worker pushes."""
        self.sources.setdefault(self.serial, []).extend(keys)
        for k in keys:
            self.where[(k.member, k.incarnation, k.seq)] = self.serial

    def note_floor(self, member: str, incarnation: int, floor: int) -> None:
        """A push of ``member`` in the open batch raises its clock floor to ``floor`` once the
        batch is applied."""
        pending = self.floors.setdefault(self.serial, {})
        held = pending.get(member)
        pending[member] = (incarnation, max(floor, held[1] if held and held[0] == incarnation else 0))

    def batch_floor(self, default: int) -> int:
        """The clock floor the open batch stands for once applied: the slowest live member's,
        counting what its pushes in the batch raise (``default`` without members)."""
        pending = self.floors.get(self.serial, {})

        def floor(m) -> int:
            held = pending.get(m.id)
            return max(m.floor, held[1]) if held and held[0] == m.incarnation else m.floor
        return min((floor(m) for m in self.members), default=default)

    def close_batch(self) -> tuple[asyncio.Future, tuple[PushKey, ...]]:
        """Close the open batch: its future and the worker pushes it sums."""
        fut, serial = self.open_future(), self.serial
        keys = tuple(self.sources.get(serial, ()))
        floors = self.floors.pop(serial, {})
        fut.add_done_callback(lambda f: self._batch_done(serial, f, floors))
        self.serial += 1
        return fut, keys

    def _batch_done(self, serial: int, fut: asyncio.Future, floors: dict[str, tuple[int, int]]) -> None:
        self._forget_sources(serial)
        if fut.cancelled() or fut.exception() is not None:
            return
        for member, (incarnation, floor) in floors.items():
            m = self.members.find(member)
            if m is not None and m.incarnation == incarnation:
                m.floor = max(m.floor, floor)

    def _forget_sources(self, serial: int) -> None:
        for k in self.sources.pop(serial, ()):
            if self.where.get((k.member, k.incarnation, k.seq)) == serial:
                del self.where[(k.member, k.incarnation, k.seq)]

    def batch_of(self, key: PushKey) -> asyncio.Future | None:
        """The future of the open or in-flight batch that holds worker push ``key``, if any."""
        serial = self.where.get((key.member, key.incarnation, key.seq))
        return None if serial is None else self.futs.get(serial)

    def fail_open(self, exc: HpsError) -> int:
        """Fail the open batch's pushes with ``exc`` (not applied) and start a fresh batch with
        the same round number; returns how many pushes were failed."""
        n = len(self.round.pushed if self.bsp else self.window.pushed)
        fut = self.futs.get(self.serial)
        self._forget_sources(self.serial)
        self.floors.pop(self.serial, None)  # not applied: the floors its pushes raise are not either
        self.serial += 1
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: nobody may be waiting any more
        self.round = BspRound(round=self.round.round, numel=self.layout.numel)
        self.window = self.new_window()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return n

    def reset_round(self, round_: int, why: str) -> None:
        """Open ``round_``, failing the open batch's pushes as Stale (they were never sent on, so
        never applied). Closed batches in flight are left to whoever finishes them: their
        outcome is still to come."""
        if self.fail_open(Stale(f"the round was abandoned ({why}); pull version {round_} and "
                                "compute again", wait_version=round_)):
            self.stats.aborted_rounds += 1
        self.round = BspRound(round=round_, numel=self.layout.numel)
        for m in self.members:
            m.first_round = min(m.first_round, round_)

    def abort(self, why: str, error: type[HpsError] = UnknownJob) -> None:
        """The job is gone here: fail every waiting push with ``error`` (UnknownJob: it ended;
        NotPrimary: this root became a standby, so the push's outcome is the new primary's to
        tell, and the pusher retries there)."""
        for fut in list(self.futs.values()):
            if not fut.done():
                fut.set_exception(error(why))
                fut.exception()
        self.futs.clear()
        if self.timer is not None:
            self.timer.cancel()
        self.notify()

    def snapshot_chunks(self) -> list[Chunk]:
        """The held view, losslessly encoded; cached per (epoch, version)."""
        key = (self.view.epoch, self.view.version)
        if self._snapshot is None or self._snapshot[:2] != key:
            codec = get_codec("fp32+zstd" if self.config.delta_codec == "fp32+zstd" else "fp32")
            # Framed once (views of the values until then), served as these frames to every
            # child that needs a snapshot of this version.
            self._snapshot = (*key, framed(split(self.layout, self.view.values, codec, copy=False)))
        return self._snapshot[2]


@dataclass
class RootJob(JobState):
    """The root's job: the authoritative parameters, their optimizer, the log that makes each
    version durable, and the record of which worker pushes each version applied."""

    params: np.ndarray = None            # authoritative parameters (float32, flat)
    optimizer: ServerOptimizer = None    # steps ``params`` in place
    wal: WriteAheadLog | None = None     # None: a root that keeps no checkpoints
    applied: AppliedBook = field(default_factory=AppliedBook)
    skipped: set[int] = field(default_factory=set)  # versions the book holds that skipped their step (AMP)
    apply_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one version at a time
    last_checkpoint: tuple[float, float, int] | None = None  # (unix time, seconds, version)
    scratch: np.ndarray | None = None    # reused buffer for params - view
    unfrozen: frozenset[str] | None = None  # the keys a delta may carry; None: all (no frozen key)
    loss_watch: LossWatch = field(default_factory=LossWatch)  # the loss-anomaly check, in-process
    ranks: RankBook = field(default_factory=RankBook)      # workers' stable ranks
    leases: LeaseBook = field(default_factory=LeaseBook)   # the dataset's shards: trained, leased
    roster_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one roster.json write at a time
    roster_saved: dict | None = None     # what roster.json holds (ranks, dataset, leases)
    pace: Pace = field(default_factory=Pace)  # outer jobs with dynamic steps: the regions' step rates
    ending: str = ""                     # being ended (why): no version is applied any more
    ending_task: asyncio.Task | None = None  # the end under way (Root.end_job), shared by its callers
    # A job is restored from its newest checkpoint and the log after it: until its first
    # checkpoint is on disk a crash forgets the job, so nothing of it is acknowledged before
    # (``Durable._created_durably``). Restored and replicated jobs have one.
    created_durably: bool = True
    first_checkpoint: asyncio.Task | None = None  # the creation's checkpoint write


@dataclass
class RelayJob(JobState):
    """A relay's job: its upward edge (codec and residuals, telemetry not yet sent) and how far
    it trails its parent."""

    encoder: Encoder | None = None       # the upward edge's codec and residuals (made on first use)
    unsent_report: tuple[float, int, float] = (0.0, 0, 0.0)  # telemetry not yet sent up
    parent_version: int = 0              # the newest version the parent has announced
    synced_at: float = 0.0               # when this tier last held the parent's newest version
    pull_failures: int = 0               # the parent's answers to this job's pulls failing in a row
