"""A region's root for its outer jobs (``ps.tiers.outer``): ``Root`` with the job's inner
optimizer, no disk, and a sync with the global root every ``period`` versions.

Its own module so that a relay imports the root's code, and torch with it, only when it holds
an outer job whose inner loop runs at its role (``OuterRelay._inner_root``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ps.core.config import JobConfig, ServerConfig
from ps.core.optim import ServerOptimizer
from ps.core.types import Chunk, PullMeta, PushMeta, StepInfo, VersionMeta
from ps.core.view import Layout
from ps.tiers.jobstate import JobState, RootJob
from ps.tiers.root import Root
from ps.tiers.wal import WalRecord

if TYPE_CHECKING:
    from ps.tiers.outer import OuterRelay

__all__ = ["InnerRoot"]

PullReply = tuple[PullMeta, list[tuple[VersionMeta, list[Chunk]]]]


class InnerRoot(Root):
    """A region's root for its outer jobs: ``Root`` with the job's inner optimizer, no disk, and
    a sync with the global root every ``period`` versions (``OuterRelay.after_inner_version``)."""

    above_inner_loops = False  # it runs the inner loop: its rounds are the region's workers' bsp rounds

    def __init__(self, config: ServerConfig, relay: OuterRelay) -> None:
        super().__init__(dataclasses.replace(config, role="global", parent="", checkpoint_dir="",
                                             standby="", standby_of=""))
        self.role = relay.role
        self.epoch = relay.epoch  # one server epoch for the process, whichever part answers
        self.relay = relay

    @staticmethod
    def _optimizer(cfg: JobConfig, params: np.ndarray, layout: Layout) -> ServerOptimizer:
        return ServerOptimizer(cfg.optimizer, params, layout)  # the inner one

    @staticmethod
    def _delta_codec(cfg: JobConfig) -> str:
        return cfg.delta_codec  # the inner versions, to the region's zones

    @staticmethod
    def _published_keys(js: RootJob, step: StepInfo) -> frozenset[str] | None:
        return js.unfrozen  # inner versions: every key but the frozen ones trains every step

    async def _after_version(self, js: RootJob, rec: WalRecord) -> None:
        await self.relay.after_inner_version(js, rec.contributors)

    def _damaged(self, js: RootJob, why: str, version: int, exc_info: bool = False) -> None:
        super()._damaged(js, why, version, exc_info)
        self.relay.inner_damaged(js.config.name)  # no log to restore it from: a new lineage

    def _recovery(self, js: RootJob) -> str:
        return (f"this {self.role} tier starts the job's inner loop again from the outer view at once (the inner "
                "steps since its last sync are lost, and counted)")

    def _trained(self, js: RootJob, progress: tuple[tuple[int, int, int], ...]) -> None:
        self.relay.trained(js.config.name, progress)  # to the root with the syncs that carry it

    def _telemetry(self, js: RootJob, meta: PushMeta) -> bool:
        if not super()._telemetry(js, meta):
            return False
        ojs = self.relay.jobs.get(js.config.name)
        if ojs is not None:  # the root hears the region's losses with its next pseudo-gradient
            loss, n, secs = ojs.unsent_report
            ojs.unsent_report = (loss + meta.loss_sum, n + meta.loss_count, secs + meta.step_seconds_sum)
        return True

    async def _members_changed(self, js: JobState) -> None:
        await super()._members_changed(js)
        if len(js.members) == 0:
            await self.relay.inner_empty(js.config.name)

    async def pull(self, job: str, member: str, view_epoch: int, since: int, min_version: int,
                   wait_s: float, min_clock: int = 0) -> PullReply:
        js = self.jobs.get(job)
        if js is not None and self._may_read(js, member):  # a member's word only (one could inflate the count)
            self.relay.note_old_lineage(job, view_epoch, since)
        return await super().pull(job, member, view_epoch, since, min_version, wait_s, min_clock)
