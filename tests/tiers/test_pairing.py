"""The Follow stream's order at the primary: "hello" (which makes the standby drop what it held)
comes first, before anything announced after the follower attached."""

from __future__ import annotations

import asyncio

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
