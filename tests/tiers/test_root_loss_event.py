"""The root logs ``training.loss_rising`` when its workers report losses the alert rule would
page on (ps.core.losswatch), once."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.tensors import split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.tiers.root import Root
from tests.core.test_losswatch import RISING_SLOWER


def test_the_root_logs_the_event_when_its_workers_report_rising_losses(caplog):
    now = [0.0]
    caplog.set_level(logging.WARNING, logger="hps.root")

    async def train():
        root = Root(ServerConfig(role="global"), clock=lambda: now[0])
        await root.start()
        layout = Layout([KeySpec("w", (3,))])
        await root.create_job(JobConfig(name="lm", optimizer=OptimizerConfig(lr=0.01)), layout,
                              np.zeros(3, np.float32))
        await root.register("lm", "w0", "worker", "", last_seq=0, incarnation=7)
        seq = 0
        for minute, (loss, steps) in enumerate([*RISING_SLOWER, (1.3, 1)]):
            now[0] = minute * 60.0
            seq += 1
            meta = PushMeta(job="lm", sender="w0", seq=seq, base_version=seq - 1, incarnation=7,
                            loss_sum=loss * steps, loss_count=steps, step_seconds_sum=0.1 * steps)
            await root.push(meta, split(layout, np.zeros(3, np.float32), get_codec("fp32")), bytes(16))
        await root.stop()

    asyncio.run(train())
    hits = [r for r in caplog.records if getattr(r, "event", "") == "training.loss_rising"]
    assert len(hits) == 1 and hits[0].job == "lm" and hits[0].loss == 1.2 and hits[0].loss_before == 1.0
