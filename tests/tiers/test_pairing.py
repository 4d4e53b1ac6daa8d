"""The Follow stream's order at the primary: "hello" (which makes the standby drop what it held)
comes first, before anything announced after the follower attached."""

from __future__ import annotations

import asyncio

import numpy as np

from ps.core.config import ServerConfig
from ps.core.types import LogMessage
from ps.tiers.root import Root


def test_hello_is_first_on_a_new_follow_stream_whatever_is_announced_after_it(tmp_path):
    async def stream() -> list[str]:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path), standby=f"127.0.0.1:{1}",
                                 lease_s=1.0))
        root.state = "primary"  # as a primary whose peer is down: no start(), nothing asked of it
        f = root.follow(root.term)
        # A job created in the same turn of the loop as the Follow call, before the bootstrap
        # task ran: its state is announced to the follower.
        root.replication.announce(LogMessage("state", job="early", version=0), force=True)
        for _ in range(5):
            await asyncio.sleep(0)  # the bootstrap task runs: tokens, then "synced" (no jobs)
        kinds = []
        while not f._queue.empty():
            kinds.append((await f.next()).kind)
        f.close("test over")
        await asyncio.gather(*root._ckpt_tasks, return_exceptions=True)
        return kinds

    kinds = asyncio.run(stream())
    assert kinds[:2] == ["hello", "state"] and kinds.count("hello") == 1 and "synced" in kinds, kinds


def test_an_unexpected_error_while_following_is_logged_and_the_standby_follows_again(tmp_path, caplog):
    """A bug in handling the stream (any exception, not only a network error) must not end
    ``Standby.run``: that would end following, and with it the takeover."""
    from ps.tiers.standby import Standby

    class Link:
        def __init__(self) -> None:
            self.calls = 0
            self.again = asyncio.Event()

        async def follow(self, *args) -> None:
            self.calls += 1
            if self.calls == 1:
                raise KeyError("a bug in a handler")
            self.again.set()
            await asyncio.sleep(3600)

        async def status(self, timeout: float) -> None:
            return None  # the primary answers: no takeover

    async def follow_twice() -> int:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path), lease_s=1.0))
        standby = Standby(root, "127.0.0.1:1")
        standby.link = link = Link()
        run = asyncio.create_task(standby.run())
        try:
            await asyncio.wait_for(link.again.wait(), 10)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        return link.calls

    assert asyncio.run(follow_twice()) == 2
    assert "following the primary 127.0.0.1:1 failed; following it again" in caplog.text


def test_a_forced_promotion_of_a_standby_not_in_sync_starts_a_new_lineage(tmp_path):
    """A standby still taking its primary's state holds the primary's view epoch and perhaps
    fewer versions than it published. Promoted with --force, it published other values under
    the same (epoch, version) numbers: a child already at such a version is answered "up to
    date" with no checksum and kept the old values (review). A new epoch makes every child take
    a snapshot. A standby in sync holds every published version: its lineage goes on."""
    import numpy as np

    from ps.core.config import JobConfig
    from ps.core.deltas import DeltaEntry
    from ps.core.view import KeySpec, Layout

    async def promote(synced: bool) -> tuple[int, int, int, int]:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path / str(synced)), lease_s=1.0))
        root.state = "standby"
        root.reset_for_follow(3, 0xE0E0)  # as the primary's "hello" leaves it
        js = root._install(JobConfig(name="j"), Layout([KeySpec("w", (4,))]), np.zeros(4, np.float32), 5)
        js.log.append(DeltaEntry(5, 0, ()))
        root.set_role(synced=synced)
        term = await root.promote("test", force=True)
        await asyncio.gather(*root._ckpt_tasks, return_exceptions=True)
        return term, root.epoch, js.view.epoch, len(js.log)

    term, epoch, view_epoch, logged = asyncio.run(promote(synced=False))
    assert term == 4 and epoch == view_epoch != 0xE0E0 and logged == 0
    term, epoch, view_epoch, logged = asyncio.run(promote(synced=True))
    assert term == 4 and epoch == view_epoch == 0xE0E0 and logged == 1


def test_a_standby_waits_for_a_checkpoint_still_being_written_before_it_wipes_that_job(tmp_path):
    """A checkpoint of job "lm" a record before started in a thread; the primary then says the
    job ended (or sends its state again, or a new "hello"). A writer that finished after the wipe
    put back a checkpoint of a state the primary no longer holds, which this root, once promoted,
    restored. The wipe waits for the writer."""
    import json
    import threading
    from pathlib import Path

    from ps.tiers import checkpoint
    from ps.tiers.standby import Standby

    async def end_while_writing() -> tuple[bool, list[str]]:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path), lease_s=1.0))
        root.state = "standby"
        standby = Standby(root, "127.0.0.1:1")
        job_dir = Path(root._job_dir("lm"))
        started, release = threading.Event(), threading.Event()

        def slow_save() -> None:  # the writer, stalled on a slow disk until the wipe was asked for
            started.set()
            release.wait(10)
            checkpoint.save(job_dir, 7, {"values": np.zeros(3, np.float32)}, {"job": "lm"})

        task = asyncio.create_task(asyncio.to_thread(slow_save))
        task.job = "lm"  # as Root._checkpoint names its tasks
        root._ckpt_tasks.add(task)
        task.add_done_callback(root._ckpt_tasks.discard)
        await asyncio.to_thread(started.wait, 10)
        handled = asyncio.create_task(standby._handle(LogMessage("ended", job="lm", data=json.dumps(
            {"version": 7, "why": "done"}).encode())))
        await asyncio.sleep(0.3)
        waited = not handled.done()
        release.set()
        await asyncio.wait_for(handled, 10)
        return waited, sorted(p.name for p in job_dir.iterdir())

    waited, left = asyncio.run(end_while_writing())
    assert waited
    assert left == ["ENDED"], left   # the late checkpoint was wiped with the rest, not left behind


def test_a_promoted_standby_gives_every_lease_a_full_timeout(tmp_path):
    """A lease's renewals reach only the primary (they change no roster, so the standby is not
    told): on the standby its expiry stays where the last roster put it. Promoted, the new
    primary expired every lease its holder had only renewed since, at the first lease call,
    and handed a healthy worker's shard to the next one (review). A restart gives every lease a
    full timeout; a takeover now does too."""
    from ps.core.config import JobConfig
    from ps.core.leases import Dataset
    from ps.core.view import KeySpec, Layout

    async def promote() -> list:
        root = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path), lease_s=1.0))
        root.state = "standby"
        root.reset_for_follow(3, 0xE0E0)
        js = root._install(JobConfig(name="j"), Layout([KeySpec("w", (4,))]), np.zeros(4, np.float32), 5)
        js.leases.declare(Dataset(length=64, shard_size=16, lease_timeout_s=30))
        js.leases.lease("a", 1, 0, now=root.clock() - 60)  # the roster's last word, 60 s ago
        root.set_role(synced=True)
        await root.promote("test")
        await asyncio.gather(*root._ckpt_tasks, return_exceptions=True)
        return js.leases.expire(root.clock())

    assert asyncio.run(promote()) == []
