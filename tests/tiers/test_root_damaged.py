"""A job the root stops serving (damaged: its state matches neither its view nor its log) takes
no further version: a round that waited for the apply lock while the failing version held it
is refused, not applied on the damaged state."""

from __future__ import annotations

import asyncio

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.errors import Unavailable
from ps.core.tensors import split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.tiers.root import Root

LAYOUT = Layout([KeySpec("w", (3,))])


def test_a_round_queued_behind_a_version_that_damaged_the_job_is_refused_not_applied():
    async def run() -> tuple[list, int, list[int]]:
        root = Root(ServerConfig(role="global", flush_ms=0, member_timeout_s=600.0))
        await root.start()
        await root.create_job(JobConfig(name="j", mode="bsp", optimizer=OptimizerConfig(lr=0.1)), LAYOUT,
                              np.zeros(3, np.float32))
        for who in ("a", "b"):
            await root.register("j", who, "worker", "", last_seq=0, incarnation=7)
        gate, calls = asyncio.Event(), []

        async def failing_first(js, rec):
            calls.append(rec.version)
            if len(calls) == 1:
                await gate.wait()  # holds the job's apply lock meanwhile
                raise RuntimeError("injected: the version failed after it was published")
        root._after_version = failing_first

        def push(who: str, seq: int, clock: int):
            meta = PushMeta("j", who, seq=seq, base_version=clock, incarnation=7, clock_min=clock, clock_max=clock,
                            clock_floor=clock + 1)
            return asyncio.ensure_future(root.push(meta, split(LAYOUT, np.ones(3, np.float32),
                                                               get_codec("fp32")), bytes([seq]) * 16))
        first = [push("a", 1, 0), push("b", 1, 0)]
        for _ in range(100):  # bounded: until version 1 is published and holds the lock
            if calls:
                break
            await asyncio.sleep(0.02)
        # Version 1 is published (pullable) before it is acknowledged: the next round can close
        # while it still holds the job's apply lock.
        second = [push("a", 2, 1), push("b", 2, 1)]
        await asyncio.sleep(0.3)  # that round closed and waits for the lock
        gate.set()
        out = await asyncio.gather(*first, *second, return_exceptions=True)
        version = root.jobs["j"].view.version
        await root.stop()
        return out, version, calls

    out, version, calls = asyncio.run(run())
    assert calls == [1], calls  # the queued round never reached the version's end
    said = [str(r) if isinstance(r, Unavailable) else repr(r) for r in out]
    assert all("not published" in s for s in said[:2]) and all("is not served" in s for s in said[2:]), said
    assert version == 1, version  # the failed version was published; nothing after it
