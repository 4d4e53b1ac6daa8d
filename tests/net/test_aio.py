"""ps.net.aio.wait_for: a timed wait that never loses its task's cancellation.

asyncio.wait_for on Python 3.10/3.11 returns the result when the cancel and the result come in
the same loop tick (python/cpython#86296). A standby's follow loop lost a promotion's cancel that
way and went on following; ``hps promote`` waited for it until its deadline (a CI failure).
"""

from __future__ import annotations

import asyncio

import pytest

from ps.core.types import LogMessage
from ps.net.aio import wait_for
from ps.net.follow import LogLink
from ps.net.wire import encode_log


def test_a_cancel_that_comes_with_the_result_is_not_lost():
    async def main() -> None:
        done = asyncio.create_task(asyncio.sleep(0, result=7))
        await done
        asyncio.current_task().cancel()  # delivered at the next suspension: inside the wait
        with pytest.raises(asyncio.CancelledError):
            await wait_for(done, 10)

    asyncio.run(main())


def test_a_result_comes_back_and_a_timeout_cancels_the_awaited():
    async def main() -> None:
        assert await wait_for(asyncio.sleep(0, result="x"), 5) == "x"
        slow = asyncio.create_task(asyncio.sleep(30))
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(slow, 0.01)
        assert slow.cancelled()
        with pytest.raises(KeyError):
            await wait_for(_raise(KeyError("k")), 5)
        assert await wait_for(asyncio.sleep(0, result=3), None) == 3

    asyncio.run(main())


async def _raise(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


class _Call:
    """A Follow stream whose first message arrives as its reader is cancelled (a promotion)."""

    def __init__(self, follower: list[asyncio.Task]) -> None:
        frames = encode_log(LogMessage("beat", term=1))
        self._frames = list(frames)
        self._follower = follower

    async def read(self):
        if not self._frames:
            await asyncio.sleep(30)
        if self._follower:
            self._follower.pop().cancel()  # the promotion, in the tick the message comes
        return self._frames.pop(0)

    def cancel(self) -> None:
        pass


class _Rpc:
    def __init__(self, call: _Call) -> None:
        self.channel = self
        self._call = call

    def stream_stream(self, _name: str):
        return lambda _requests, metadata: self._call


def test_a_standby_following_its_primary_stops_when_cancelled_as_a_message_arrives():
    async def main() -> list[str]:
        handled: list[str] = []
        follower: list[asyncio.Task] = []
        link = LogLink("127.0.0.1:1")
        await link.close()
        link._rpc = _Rpc(_Call(follower))  # type: ignore[assignment]

        async def handle(m: LogMessage) -> None:
            handled.append(m.kind)

        task = asyncio.create_task(link.follow(term=1, lease_s=1.0, handle=handle))
        follower.append(task)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)  # before: it ran on to the lease's end (Unavailable)
        return handled

    asyncio.run(main())
