"""``asyncio.wait_for`` without its lost cancellation.

    data = await wait_for(call.read(), lease_s)   # asyncio.TimeoutError after lease_s

On Python 3.10 and 3.11, ``asyncio.wait_for`` returns the awaited result when its task is
cancelled in the same loop tick as that result arrives: the cancellation is dropped
(python/cpython#86296, fixed in 3.12 by rebuilding it on ``asyncio.timeout``). A standby's
follow loop that lost the cancel of a promotion went on following, and the promotion waited for
it for good (``hps promote`` timed out in CI). Every timed wait in the async shell goes through
this one; ruff refuses ``asyncio.wait_for`` (pyproject.toml, TID251).

Semantics as ``asyncio.wait_for``: on timeout the awaitable is cancelled, waited for, and
``asyncio.TimeoutError`` raised; when the caller is cancelled the awaitable is cancelled too and
the caller's ``CancelledError`` always propagates (a result that came at that moment is dropped,
as a cancelled caller would drop it anyway).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["wait_for"]

T = TypeVar("T")


async def _wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)  # never absorbs the caller's cancel
    except asyncio.CancelledError:
        fut.cancel()
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: a failure that came with the cancel is not logged as lost
        raise
    if not done:
        fut.cancel()
        await asyncio.wait({fut})  # ended before this returns, as asyncio.wait_for does
        try:
            return fut.result()  # it finished as it was cancelled: its result or error is not lost
        except asyncio.CancelledError:
            raise asyncio.TimeoutError from None
    return fut.result()


wait_for = asyncio.wait_for if sys.version_info >= (3, 12) else _wait_for  # noqa: TID251
