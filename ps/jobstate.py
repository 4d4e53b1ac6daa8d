"""One job's state at one tier, and what a tier answers (plain data for the async shell).

    js = JobState(config, layout)        # view, delta log, members, the open round or window
    js.notify()                          # wakes every pull waiting for a newer version
    ack = await asyncio.shield(js.open_future())

``ps.tier`` drives these; they hold no I/O of their own besides the event-loop futures that
pushes and pulls wait on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from ps.codecs import get_codec
from ps.config import JobConfig
from ps.consistency import BspRound, Membership, SeqBook, Window
from ps.deltas import DeltaLog
from ps.encoder import Encoder
from ps.errors import Stale, UnknownJob
from ps.store import Layout, View
from ps.tensors import Chunk, split

__all__ = ["Ack", "Registration", "JobStats", "JobState"]


@dataclass(frozen=True)
class Ack:
    applied_version: int
    view_epoch: int
    duplicate: bool = False


@dataclass(frozen=True)
class Registration:
    config: JobConfig
    layout: Layout
    start_version: int
    server_epoch: int
    start_clock: int = 0


@dataclass
class JobStats:
    pushes: int = 0
    bytes_pushed_in: int = 0
    bytes_pushed_up: int = 0
    bytes_pulled_out: int = 0
    bytes_pulled_in: int = 0
    snapshots_served: int = 0
    deltas_served: int = 0
    rounds: int = 0
    aborted_rounds: int = 0
    staleness_count: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    round_wait_ms_sum: int = 0
    # What the workers below reported about their training (PushMeta telemetry), for metrics.
    loss_sum: float = 0.0
    loss_count: int = 0
    step_seconds_sum: float = 0.0

    def staleness(self, s: int) -> None:
        self.staleness_count += 1
        self.staleness_sum += s
        self.staleness_max = max(self.staleness_max, s)


@dataclass
class JobState:
    """One job at one tier: the replica view, its delta log, members and the open round."""

    config: JobConfig
    layout: Layout
    view: View = None
    log: DeltaLog = None
    members: Membership = field(default_factory=Membership)
    books: dict[str, SeqBook] = field(default_factory=dict)
    round: BspRound = None               # bsp: the open round
    window: Window = None                # ssp/async: the open aggregation window
    futs: dict[int, asyncio.Future] = field(default_factory=dict)  # open/in-flight batches
    serial: int = 0                      # the open batch's key in futs
    inflight: int = 0                    # ssp/async: closed windows being applied / sent up
    timer: asyncio.TimerHandle | None = None
    reported_floor: int = 0              # the clock floor last sent up (relay) or stamped (root)
    pending: dict[tuple[str, int], asyncio.Future] = field(default_factory=dict)
    stats: JobStats = field(default_factory=JobStats)
    parent_version: int = 0
    synced_at: float = 0.0
    encoder: Encoder | None = None       # relay: the upward edge's codec and residuals
    unsent_report: tuple[float, int, float] = (0.0, 0, 0.0)  # relay: telemetry not yet sent up
    scratch: np.ndarray | None = None    # root: reused buffer for params - view
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _snapshot: tuple[int, int, list[Chunk]] | None = None

    def __post_init__(self) -> None:
        self.view = self.view or View(self.layout)
        self.log = self.log or DeltaLog(self.config.delta_log_length)
        self.round = self.round or BspRound(round=0, numel=self.layout.numel)
        self.window = self.window or self.new_window()

    @property
    def bsp(self) -> bool:
        return self.config.mode == "bsp"

    def new_window(self) -> Window:
        return Window(numel=self.layout.numel, repeats=self.config.mode == "async")

    def notify(self) -> None:
        """Wake everything waiting for a newer version."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def open_future(self) -> asyncio.Future:
        """The outcome of the open batch (round or window), shared by every push in it."""
        fut = self.futs.get(self.serial)
        if fut is None:
            fut = self.futs[self.serial] = asyncio.get_running_loop().create_future()
            key = self.serial
            fut.add_done_callback(lambda _: self.futs.pop(key, None))
        return fut

    def close_batch(self) -> asyncio.Future:
        fut = self.open_future()
        self.serial += 1
        return fut

    def reset_round(self, round_: int, why: str) -> None:
        """Abort every pending push (they were not applied) and open ``round_``."""
        for fut in list(self.futs.values()):
            if not fut.done():
                fut.set_exception(Stale(f"the batch was aborted ({why}); pull the latest version"))
                self.stats.aborted_rounds += 1
        self.futs.clear()
        self.round = BspRound(round=round_, numel=self.layout.numel)
        self.window = self.new_window()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for m in self.members:
            m.first_round = min(m.first_round, round_)

    def abort(self, why: str) -> None:
        """The job is gone (ended): fail every waiting push with UnknownJob."""
        for fut in list(self.futs.values()):
            if not fut.done():
                fut.set_exception(UnknownJob(why))
        self.futs.clear()
        if self.timer is not None:
            self.timer.cancel()
        self.notify()

    def snapshot_chunks(self) -> list[Chunk]:
        """The held view, losslessly encoded; cached per (epoch, version)."""
        key = (self.view.epoch, self.view.version)
        if self._snapshot is None or self._snapshot[:2] != key:
            codec = get_codec("fp32+zstd" if self.config.delta_codec == "fp32+zstd" else "fp32")
            self._snapshot = (*key, split(self.layout, self.view.values, codec))
        return self._snapshot[2]
