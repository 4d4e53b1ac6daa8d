"""A primary root's side of a hot standby: the follower it replicates its log to, synchronously.

>>> async def one_follower():
...     repl = Replication(lease_s=1.0, required=False)
...     f = repl.attach(term=0)                         # a standby called Follow
...     seq = f.send(LogMessage("record", job="lm", version=1, data=b"..."))
...     f.acked(seq)                                    # its ACK came back
...     await f.wait(seq, timeout=1.0)                  # what the primary waits for
...     return (await f.next()).kind, f.alive
>>> asyncio.run(one_follower())
('record', True)

Why synchronous (DESIGN.md, invariant 8): the primary acknowledges a version only once its
standby holds the record, so a standby that takes over has every acknowledged version. The
primary sends a record *before* appending it to its own log: its own log therefore never holds a
version its standby lacks, and a deposed primary that restarts replays only versions the new
primary has too (never a fork). A standby that does not acknowledge within the lease is
dropped (its stream closed); it reconnects and starts again from a checkpoint.

``required``: with a configured standby (``--standby``) a version needs a follower's
acknowledgement; a root without one acknowledges alone (the behaviour before standbys). A
promoted standby runs alone until its first follower is in sync, then requires one again: once a
follower has been in sync, losing it may mean it is taking over, so the primary refuses pushes
rather than acknowledge alone (never two primaries accepting pushes).

The Follow stream itself (frames, acks) is ``ps.server.service``'s; the bootstrap (what a new
follower is sent first) is ``ps.tiers.pairing``'s. This module is the bookkeeping in between.
"""

from __future__ import annotations

import asyncio
import logging

from ps.core.errors import Unavailable
from ps.core.types import LogMessage
from ps.net.aio import wait_for
from ps.tiers.walrecord import WalRecord, to_bytes

__all__ = ["Follower", "Replication"]

log = logging.getLogger("hps.replication")


class Follower:
    """One attached standby: the queue of what it is sent, and the acknowledgements it gave."""

    def __init__(self, term: int) -> None:
        self.term = term
        self.jobs: dict[str, int] = {}  # jobs whose state it was sent (their records go to it) -> that message
        self.synced = False           # it acknowledged SYNCED: it holds the whole root
        self.alive = True
        self.why = ""
        self._queue: asyncio.Queue[LogMessage | None] = asyncio.Queue()
        self._seq = 0
        self._acked = 0
        self._waiters: dict[int, asyncio.Future] = {}

    def send(self, msg: LogMessage) -> int:
        """Queue ``msg`` (numbered here); its sequence number, which its ACK names."""
        if not self.alive:
            raise Unavailable(f"the standby is gone ({self.why})")
        self._seq += 1
        self._queue.put_nowait(LogMessage(msg.kind, msg.job, msg.version, msg.term, msg.epoch, self._seq, msg.data))
        return self._seq

    async def next(self) -> LogMessage | None:
        """The next message to send; None once closed."""
        return await self._queue.get() if self.alive else None

    def acked(self, seq: int) -> None:
        """The standby holds every message up to ``seq`` (it acknowledges in order)."""
        self._acked = max(self._acked, seq)
        for s in [s for s in self._waiters if s <= seq]:
            fut = self._waiters.pop(s)
            if not fut.done():
                fut.set_result(None)

    async def wait(self, seq: int, timeout: float) -> None:
        """Until message ``seq`` is acknowledged; Unavailable after ``timeout`` or if closed."""
        if self._acked >= seq:
            return
        if not self.alive:
            raise Unavailable(f"the standby is gone ({self.why})")
        fut = self._waiters.setdefault(seq, asyncio.get_running_loop().create_future())
        try:
            await wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(f"the standby did not acknowledge within the lease ({timeout:.1f}s)") from None

    def close(self, why: str) -> None:
        if not self.alive:
            return
        self.alive, self.why = False, why
        self._queue.put_nowait(None)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(Unavailable(f"the standby is gone ({why})"))
                fut.exception()
        self._waiters.clear()


class Replication:
    """The primary's follower (at most one at a time) and whether a version needs it."""

    def __init__(self, lease_s: float, required: bool) -> None:
        self.lease_s = lease_s
        self.required = required
        self.follower: Follower | None = None
        self._changed = asyncio.Event()

    def attach(self, term: int) -> Follower:
        """A new follower; one already attached is dropped (a standby reconnecting)."""
        if self.follower is not None:
            self.detach(self.follower, "replaced by a new follow stream")
        self.follower = Follower(term)
        self._notify()
        return self.follower

    def detach(self, f: Follower, why: str) -> None:
        f.close(why)
        if self.follower is f:
            self.follower = None
            if f.synced:
                log.warning("the standby is gone (%s); %s", why,
                            "versions wait for it to return" if self.required else "acknowledging alone")
        self._notify()

    def in_sync(self) -> bool:
        return self.follower is not None and self.follower.synced

    def set_synced(self, f: Follower) -> None:
        f.synced = True
        self.required = True  # from now on, losing it may mean it takes over: never acknowledge alone
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def ready(self, job: str) -> None:
        """Before a version of ``job`` is made: a follower that holds the job must be there when
        one is required; waits up to the lease for one, then Unavailable."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_s
        while self.required and not (self.follower is not None and job in self.follower.jobs):
            left = deadline - loop.time()
            if left <= 0:
                raise Unavailable(f"this root's standby does not hold job {job!r} (it is gone or still "
                                  "catching up); no version is acknowledged without it. Retry shortly")
            try:
                await wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def held(self, job: str) -> None:
        """Before telling a caller that ``job`` exists (a CreateJob retried after its first try
        was not acknowledged): where a standby is required, it must hold the job's state,
        acknowledged and not only sent, or a takeover forgets a job its workers were told exists.
        Unavailable if it does not within the lease."""
        if not self.required:
            return
        await self.ready(job)
        f = self.follower
        if f is None or job not in f.jobs:
            return
        try:
            await f.wait(f.jobs[job], self.lease_s)
        except Unavailable as exc:
            raise Unavailable(f"this root's standby does not hold job {job!r} yet ({exc}); retry shortly") from None

    async def replicate(self, job: str, rec: WalRecord) -> bool:
        """Send the record of ``rec.version`` and wait for the standby to hold it. False: no
        follower holds the job and none is required (acknowledged alone); Unavailable: it did not
        acknowledge within the lease (it is dropped)."""
        version = rec.version
        f = self.follower
        if f is None or job not in f.jobs:
            if self.required:
                raise Unavailable(f"this root's standby does not hold job {job!r}; version {version} was "
                                  "not made. Retry shortly")
            return False
        # Its bytes only when a standby takes them, and off the event loop (a dense record of a
        # large model is hundreds of MB: the copy once ran on the loop for every version).
        data = await asyncio.to_thread(to_bytes, rec)
        if self.follower is not f:  # it went (or another came) meanwhile
            if self.follower is None and not self.required:
                return False
            raise Unavailable(f"this root's standby changed while version {version} of job {job!r} was "
                              "being sent; nothing was applied. Retry shortly")
        seq = f.send(LogMessage("record", job=job, version=version, data=data))
        try:
            await f.wait(seq, self.lease_s)
        except Unavailable as exc:
            self.detach(f, f"version {version} of {job} not acknowledged: {exc}")
            raise Unavailable(f"this root's standby did not acknowledge version {version} of job {job!r} "
                              f"({exc}); nothing was applied. Retry shortly") from None
        return True

    async def confirm(self, msg: LogMessage) -> None:
        """``announce``, waited for: a job-level change the caller acknowledges (a job declared,
        created or ended) must be on the standby too when one is required, or a takeover forgets
        a job its workers were told exists. Unavailable if no follower holds it within the lease."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_s
        while self.required and (self.follower is None or not self.follower.alive):
            left = deadline - loop.time()
            if left <= 0:
                raise Unavailable(f"this root's standby is not there to hold the change to job {msg.job!r} "
                                  "(it is gone or taking over); retry shortly")
            try:
                await wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        f = self.follower
        if f is None or not f.alive:
            return  # none required: acknowledged alone
        seq = self.announce(msg, force=True)
        try:
            await f.wait(seq, self.lease_s)
        except Unavailable as exc:
            self.detach(f, f"the change to job {msg.job} was not acknowledged: {exc}")
            raise Unavailable(f"this root's standby did not acknowledge the change to job {msg.job!r} ({exc}); "
                              "retry shortly") from None

    def announce(self, msg: LogMessage, force: bool = False) -> int:
        """Send a job-level change (declared, created, ended, roster) to the follower, if any;
        not waited for (a state's records that follow are)."""
        f = self.follower
        seq = 0
        if f is not None and f.alive and (force or msg.kind != "roster" or msg.job in f.jobs):
            seq = f.send(msg)
            if msg.kind == "state":
                f.jobs[msg.job] = seq
            elif msg.kind == "ended":
                f.jobs.pop(msg.job, None)
        return seq
