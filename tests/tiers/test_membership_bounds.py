"""Per-caller state a tier keeps is bounded: the incarnations it remembers as replaced (to
catch two processes sharing one member id) are kept for the most recently replaced ids only."""

from __future__ import annotations

import asyncio

import numpy as np

from ps.core.config import JobConfig, ServerConfig
from ps.core.view import KeySpec, Layout
from ps.tiers.membership import MAX_REPLACED_IDS
from ps.tiers.root import Root


def test_replaced_incarnations_are_remembered_for_a_bounded_number_of_member_ids():
    async def run() -> tuple[int, bool]:
        root = Root(ServerConfig(role="global"))
        await root.start()
        await root.create_job(JobConfig(name="j"), Layout([KeySpec("w", (1,))]), np.zeros(1, np.float32))
        for i in range(MAX_REPLACED_IDS + 50):
            await root.register("j", f"w{i}", "worker", "", last_seq=0, incarnation=1)
            await root.register("j", f"w{i}", "worker", "", last_seq=0, incarnation=2)
        out = len(root.replaced), f"w{MAX_REPLACED_IDS + 49}" in root.replaced and "w0" not in root.replaced
        await root.stop()
        return out

    n, newest_kept = asyncio.run(run())
    assert n == MAX_REPLACED_IDS and newest_kept
