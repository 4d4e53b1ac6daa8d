"""What the root's record says of an applied push includes whether its version skipped its step
(an AMP overflow in the round): a worker that learns its push's fate by asking (Resolve, after
a lost answer or a tier switch), or whose retry is answered from the record, must hear that
its round was skipped, as the acknowledgement said: its GradScaler backs off and its residual
is put back. The answer said "applied" and nothing else."""

from __future__ import annotations

import asyncio

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, ServerConfig
from ps.core.tensors import split
from ps.core.types import PushKey, PushMeta, StepInfo
from ps.core.view import KeySpec, Layout
from ps.tiers.root import Root

LAYOUT = Layout([KeySpec("w", (3,))])


def test_resolve_and_a_forgotten_retry_say_the_round_was_skipped():
    async def run():
        root = Root(ServerConfig(role="global"))
        await root.start()
        await root.create_job(JobConfig(name="j"), LAYOUT, np.zeros(3, np.float32))
        await root.register("j", "w0", "worker", "", last_seq=0, incarnation=7)
        grad = split(LAYOUT, np.ones(3, np.float32), get_codec("fp32"))
        acks = []
        for seq, skip in ((1, True), (2, False)):
            meta = PushMeta("j", "w0", seq=seq, base_version=seq - 1, incarnation=7, step=StepInfo(skip=skip))
            acks.append(await root.push(meta, [] if skip else grad, bytes([seq]) * 16))
        answers = [await root.resolve("j", (PushKey("w0", 7, seq, bytes([seq]) * 16),), 0.0) for seq in (1, 2)]
        # A relay that forgot it sends the skipped worker push up again: answered from the record.
        await root.register("j", "r1", "zone", "", last_seq=0, incarnation=9)
        again = PushMeta("j", "r1", seq=1, base_version=2, incarnation=9, step=StepInfo(skip=True),
                         sources=(PushKey("w0", 7, 1, bytes([1]) * 16),))
        retry = await root.push(again, [], bytes([9]) * 16)
        await root.stop()
        return acks, answers, retry

    acks, answers, retry = asyncio.run(run())
    assert [(a.applied_version, a.skipped) for a in acks] == [(1, True), (2, False)]
    assert [(a[0], a[1], a[3]) for a in answers] == [("applied", 1, True), ("applied", 2, False)]
    assert (retry.applied_version, retry.duplicate, retry.skipped) == (1, True, True)
