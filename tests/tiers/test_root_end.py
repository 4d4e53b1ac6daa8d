"""Ending a job waits for its final checkpoint: an ended job is not restored from its
write-ahead log, so the versions acknowledged since the last periodic checkpoint are kept
only by that one. A final checkpoint that fails leaves the job not ended, to be retried."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, ServerConfig
from ps.core.errors import Unavailable
from ps.core.tensors import split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.tiers import checkpoint
from ps.tiers.root import Root


def test_an_end_whose_final_checkpoint_fails_is_refused_and_a_retry_keeps_every_version(tmp_path, monkeypatch):
    layout = Layout([KeySpec("w", (3,))])
    save, failing = checkpoint.save, [True]

    def flaky_save(*args, **kwargs):
        if failing[0] and args[1] == 4:  # the final checkpoint, of version 4
            raise OSError(28, "No space left on device (simulated)")
        return save(*args, **kwargs)
    monkeypatch.setattr(checkpoint, "save", flaky_save)

    async def run() -> tuple[int, list[str]]:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path), checkpoint_every=1000))
        await root.start()
        await root.create_job(JobConfig(name="lm"), layout, np.zeros(3, np.float32))
        await root.register("lm", "w0", "worker", "", last_seq=0, incarnation=7)
        for seq in range(1, 5):
            meta = PushMeta("lm", "w0", seq=seq, base_version=seq - 1, incarnation=7)
            ack = await root.push(meta, split(layout, np.ones(3, np.float32), get_codec("fp32")), bytes(16))
            assert ack.applied_version == seq
        with pytest.raises(Unavailable, match="final checkpoint"):
            await root.end_job("lm", "done")
        failing[0] = False
        version = await root.end_job("lm", "done")
        await root.stop()
        return version, [p.name for p in checkpoint.list_checkpoints(tmp_path / "lm")]

    version, ckpts = asyncio.run(run())
    assert version == 4
    assert any("000004" in name for name in ckpts), ckpts  # what the ended job keeps has version 4


LAYOUT = Layout([KeySpec("w", (3,))])


async def _started(tmp_path) -> Root:
    """A root on ``tmp_path`` with job lm (sgd, lr 0.01) and its member w0."""
    root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path)))
    await root.start()
    await root.create_job(JobConfig(name="lm"), LAYOUT, np.zeros(3, np.float32))
    await root.register("lm", "w0", "worker", "", last_seq=0, incarnation=7)
    return root


def _push(root: Root, seq: int):
    meta = PushMeta("lm", "w0", seq=seq, base_version=seq - 1, incarnation=7)
    return root.push(meta, split(LAYOUT, np.ones(3, np.float32), get_codec("fp32")), bytes(16))


def test_a_version_logged_but_not_published_is_refused_at_once_and_a_restart_restores_it(tmp_path, monkeypatch):
    """An exception after the log append (out of memory while framing the delta) left the
    round unanswered: the push waited forever and the job's window stayed full, with the
    parameters one version past the view. Now the job is marked damaged and refused at once,
    and a restarted root serves the version its log holds."""
    publish, failed = Root._publish, []

    def failing_once(self, js, *args, **kwargs):
        if js.view.version == 1 and not failed:
            failed.append(True)
            raise MemoryError("framing the delta (simulated)")
        return publish(self, js, *args, **kwargs)
    monkeypatch.setattr(Root, "_publish", failing_once)

    async def first() -> None:
        root = await _started(tmp_path)
        assert (await _push(root, 1)).applied_version == 1
        with pytest.raises(Unavailable, match="logged but not published"):
            await asyncio.wait_for(_push(root, 2), 10.0)
        assert "lm" in root.damaged
        with pytest.raises(Unavailable, match="not served"):
            await asyncio.wait_for(_push(root, 2), 10.0)
        await root.stop()

    async def restarted() -> tuple[int, np.ndarray]:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path)))
        await root.start()
        js = root.job("lm")
        out = js.view.version, js.view.values.copy()
        await root.stop()
        return out

    asyncio.run(first())
    version, values = asyncio.run(restarted())
    assert version == 2 and np.allclose(values, -0.02)  # sgd, lr 0.01: both versions, once each


def test_an_end_that_waited_for_a_round_which_damaged_the_job_leaves_it_to_be_restored(tmp_path, monkeypatch):
    """end_job waited for the round in progress; that round's version was logged but not
    published (the job marked damaged), and the end then wrote ENDED without a checkpoint of
    it: a restarted root skips an ended job's log, and the acknowledged-or-logged version was
    gone. The end is now refused and the restart restores the job."""
    publish = Root._publish

    def failing_after_one(self, js, *args, **kwargs):
        if js.view.version == 1:
            raise MemoryError("framing the delta (simulated)")
        return publish(self, js, *args, **kwargs)

    async def first() -> None:
        root = await _started(tmp_path)
        assert (await _push(root, 1)).applied_version == 1
        js = root.job("lm")
        append = js.wal.append
        js.wal.append = lambda rec: (time.sleep(0.5), append(rec))[1]  # the round is in its log append
        monkeypatch.setattr(Root, "_publish", failing_after_one)
        pushing = asyncio.ensure_future(_push(root, 2))
        await asyncio.sleep(0.2)
        with pytest.raises(Unavailable, match="not ended"):
            await asyncio.wait_for(root.end_job("lm", "done"), 10.0)
        with pytest.raises(Unavailable):
            await pushing
        assert "lm" not in root.ended
        await root.stop()

    async def restarted() -> tuple[int, set]:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path)))
        await root.start()
        out = root.job("lm").view.version, set(root.ended)
        await root.stop()
        return out

    asyncio.run(first())
    monkeypatch.setattr(Root, "_publish", publish)
    assert asyncio.run(restarted()) == (2, set())
