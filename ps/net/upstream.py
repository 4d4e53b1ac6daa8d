"""A relay's link to its parent: register, heartbeat, push aggregates up, pull deltas down.

>>> import asyncio
>>> from ps.core.view import KeySpec
>>> async def follow(parent):
...     up = Upstream(parent, member="eu-a", role="zone", incarnation=0x5eed)
...     await up.create_job(JobConfig(name="relayed"), Layout([KeySpec("w", (3,))]), np.zeros(3, np.float32))
...     reg = await up.register("relayed", last_seq=0)
...     meta, versions = await up.pull("relayed", view_epoch=0, since=0, min_version=0, wait_s=5)
...     await up.leave("relayed"); await up.close()
...     return reg.start_version, meta.snapshot, [vm.version for vm, chunks in versions]
>>> asyncio.run(follow(address))   # a view epoch of 0 holds nothing: a snapshot of version 0
(0, True, [0])

Credentials (ps/server/auth.py has the trust model): calls about one job present the token
this relay holds for it (``job_tokens``: one its parent accepted when it registered for the
job); until it holds one, and for the admin's calls it forwards (create, list, end jobs), it
presents the tokens of the call it is serving (``ps.net.rpc.FORWARDED``). A registration's
reply brings the job's token hash (``token_hashes``), with which this tier checks its own
children; a job's token minted by a forwarded CreateJob waits in ``minted`` for the servicer.

Transport only: every gRPC error becomes an hps exception (``ps.net.rpc``) and every call has a
deadline. What to do about an error is the relay's business (ps/tiers/relay.py).

Alternate parents (issue 15): ``address`` may list several, comma-separated (``--parent A,B``);
calls go to one at a time (``current``), and ``switch`` moves them to the next in turn. Who
decides to switch, and what to re-register, is the relay's business too. ``hard_failure`` says
whether the last failed call could not even connect (nothing listens: a killed process);
``refused_since`` since when the parent has refused writes as a root that is not the primary
(``NotPrimary``: a standby answers heartbeats and reads, so only these say it cannot be used).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator

import grpc
import numpy as np
from grpc_health.v1 import health_pb2

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, address_list
from ps.core.errors import HpsError, NotPrimary, TimedOut, Unavailable
from ps.core.leases import Dataset, Grant
from ps.core.ranks import RankInfo
from ps.core.tensors import split
from ps.core.types import Ack, PullMeta, PushKey, Registration, VersionMeta
from ps.core.view import Layout
from ps.net.messages import (
    OUTCOME_NAME,
    ROLE,
    dataset_to_pb,
    grant_from_pb,
    job_from_pb,
    jobs_from_pb,
    layout_from_pb,
    rank_from_pb,
    shards_to_pb,
)
from ps.net.rpc import (
    FORWARDED,
    RELAY_CHECK,
    AsyncCaller,
    cancelled_here,
    cannot_connect,
    relay_check,
    relay_check_failed,
)
from ps.net.tls import TlsFiles
from ps.net.wire import decode_pull_reply, encode_create_job, keys_to_pb, pb

__all__ = ["Upstream"]

# Calls only a primary root serves (a standby serves heartbeats and reads): one that succeeds says
# the parent is usable.
_WRITES = frozenset({"Register", "Push", "Resolve", "Rank", "Lease", "CreateJob", "EndJob"})


# A child's frame still being read when the parent answers a CreateJob: waited for this long at
# most before the read is cancelled. Letting it arrive keeps the child's stream whole for the
# servicer to drain, so a grpc.aio child hears the refusal's status (cut off mid-write, those
# got INTERNAL: ``ps.server.service._Stream.drain``).
_READ_ON_S = 5.0


async def _settle_read(read: asyncio.Future) -> None:
    """Let ``read`` (the child's next frame) finish within ``_READ_ON_S``, else cancel it; its
    outcome is retrieved either way (dropped: the call it was for has ended)."""
    if not read.done():
        await asyncio.wait((read,), timeout=_READ_ON_S)
    if not read.done():
        read.cancel()
        await asyncio.wait((read,))
    if not read.cancelled():
        read.exception()


class Upstream:
    def __init__(self, address: str, member: str, role: str, incarnation: int, own_address: str = "",
                 timeout_s: float = 10.0, tls: TlsFiles | None = None, admin_token: str | None = None) -> None:
        self.address = address
        self.parents = address_list(address) or (address,)
        self.index = 0                 # which of ``parents`` the calls go to
        self.switches = 0              # times the calls moved to another parent
        self.hard_failure = False      # the last failed call could not connect at all
        self.refused_since: float | None = None  # monotonic: the parent refuses writes (NotPrimary)
        self.member = member
        self.role = role
        self.incarnation = incarnation
        self.own_address = own_address
        self.timeout_s = timeout_s
        self.server_epoch = 0
        self.reachable = False
        self.failures = 0
        self.job_tokens: dict[str, str] = {}      # job -> the token its parent accepted (memory only)
        self.token_hashes: dict[str, bytes] = {}  # job -> SHA-256 of its token (b"": parent has none)
        self.minted: dict[str, str] = {}          # job -> token minted by a forwarded CreateJob
        # The admin token this relay's tier holds (every tier of a deployment holds the same), on
        # heartbeats only: it makes the parent record this relay's address for `hps status` to
        # visit. Never on calls made for a child (a register would admit it to any job).
        self.admin_token = admin_token
        self._tls = tls  # this relay's certificate, shown to its parent
        self._rpc = AsyncCaller(self.parents[0], tls)
        self._retired: list[AsyncCaller] = []  # earlier parents' links: calls in flight finish there
        self._probe: AsyncCaller | None = None  # to a parent not in use: does it serve again?
        self._closing: set[asyncio.Future] = set()  # background closes and goodbyes, referenced

    @property
    def current(self) -> str:
        """The parent the calls go to now."""
        return self.parents[self.index]

    async def close(self) -> None:
        for rpc in [*self._retired, self._rpc, *([self._probe] if self._probe else [])]:
            await rpc.close()
        self._retired.clear()
        self._probe = None

    async def relay_ready(self, index: int, timeout: float) -> bool | None:
        """Whether ``parents[index]`` (one not in use) is a relay ready to take children again
        (``grpc.health.v1`` service ``RELAY_READY``; no token: a parent that restarted knows no
        job's token until a child registers through it). None: it is a root, or a build that
        does not say; HpsError: it does not answer."""
        address = self.parents[index]
        if self._probe is None or self._probe.address != address:
            self.close_probe()
            self._probe = AsyncCaller(address, self._tls)
        try:
            r = await relay_check(self._probe.channel)(RELAY_CHECK, timeout=timeout)
        except asyncio.CancelledError:  # its channel closed under it (a switch): no answer
            raise cancelled_here() from None
        except grpc.RpcError as err:
            return relay_check_failed(err)
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def close_probe(self) -> None:
        """Close the probe's channel (in the background)."""
        if self._probe is not None:
            self._closing.add(task := asyncio.ensure_future(self._probe.close()))
            task.add_done_callback(self._closing.discard)
            self._probe = None

    def switch(self, jobs: list[str], to: int | None = None) -> str:
        """Send every call from now on to parent ``to`` (default: the next in turn); returns its
        address. The previous one is told we leave ``jobs`` (best effort, in the background: a
        dead parent forgets us by its member timeout instead). Its channel is closed only at a
        later switch: a call still in flight there ends by itself (closing would cancel it, an
        error that is not the parent's answer)."""
        old = self._rpc
        while len(self._retired) > 2:  # bounded: a flapping pair must not pile up channels
            # (a call still in flight there has a call's time to end before it is cut)
            self._closing.add(task := asyncio.ensure_future(self._retired.pop(0).close(grace=self.timeout_s)))
            task.add_done_callback(self._closing.discard)
        self._retired.append(old)
        self.index = (self.index + 1) % len(self.parents) if to is None else to
        self.close_probe()
        self._rpc = AsyncCaller(self.current, self._tls)
        self.switches += 1
        self.reachable = False
        self.hard_failure = False
        self.refused_since = None
        for job in jobs:
            req = pb.LeaveRequest(job=job, member=self.member)
            task = asyncio.ensure_future(old.call("Leave", req, 1.0, self._tokens(job)))
            self._closing.add(task)
            task.add_done_callback(lambda t: self._closing.discard(t) or t.cancelled() or t.exception())
        return self.current

    def _tokens(self, job: str | None) -> tuple[str, ...]:
        held = self.job_tokens.get(job) if job is not None else None
        return (held,) if held else FORWARDED.get()

    async def _call(self, name: str, request, timeout: float | None = None, stream: bool = False,
                    job: str | None = None, tokens: tuple[str, ...] | None = None, idle: float | None = None):
        tokens = self._tokens(job) if tokens is None else tokens
        try:
            if stream:
                reply = await self._rpc.stream(name, request, timeout or self.timeout_s, tokens, idle)
            else:
                reply = await self._rpc.call(name, request, timeout or self.timeout_s, tokens)
        except HpsError as exc:
            self._failed(exc)
            raise
        self._answered(name)
        return reply

    def _failed(self, exc: HpsError) -> None:
        if isinstance(exc, NotPrimary):  # it answered: reachable, but not the root to write to
            if self.refused_since is None:
                self.refused_since = asyncio.get_running_loop().time()
        elif isinstance(exc, (Unavailable, TimedOut)):
            self.reachable = False
            self.failures += 1
            self.hard_failure = cannot_connect(exc)

    def _answered(self, name: str) -> None:
        self.reachable = True
        if name in _WRITES:
            self.refused_since = None

    async def register(self, job: str, last_seq: int) -> Registration:
        tokens = self._tokens(job)
        r = await self._call("Register", pb.RegisterRequest(
            job=job, member=self.member, role=ROLE[self.role], address=self.own_address,
            last_seq=last_seq, incarnation=self.incarnation), tokens=tokens)
        self.server_epoch = r.server_epoch
        self.token_hashes[job] = bytes(r.token_sha256)
        if job not in self.job_tokens and tokens:
            # Keep the job's own token if it was among those presented, else the one the parent
            # accepted (the admin's, when a worker holding it brought the job here).
            own = [t for t in tokens if hmac.compare_digest(hashlib.sha256(t.encode()).digest(),
                                                            bytes(r.token_sha256))]
            self.job_tokens[job] = (own or list(tokens))[0]
        return Registration(job_from_pb(r.config), layout_from_pb(r.keys), r.start_version, r.server_epoch)

    async def heartbeat(self, jobs: list[str], workers: list[int] | None = None) -> tuple[int, list[str]]:
        """``workers``: per job of ``jobs``, the live workers below this relay (the parent
        weighs asynchronous updates by every member's share before all of them have pushed)."""
        held = tuple(dict.fromkeys(self.job_tokens[j] for j in jobs if j in self.job_tokens))
        if self.admin_token:
            held += (self.admin_token,)
        r = await self._call("Heartbeat", pb.HeartbeatRequest(
            member=self.member, jobs=jobs, server_epoch=self.server_epoch, role=ROLE[self.role],
            address=self.own_address, workers=workers or ()), tokens=held)
        return r.server_epoch, list(r.unknown_jobs)

    async def leave(self, job: str) -> None:
        await self._call("Leave", pb.LeaveRequest(job=job, member=self.member), job=job)

    async def push(self, frames: list[bytes], timeout: float, job: str | None = None) -> Ack:
        r = await self._call("Push", iter(frames), timeout=timeout, job=job)
        return Ack(r.applied_version, r.view_epoch, r.duplicate, r.skipped, r.pace)

    async def list_jobs(self) -> list[dict]:
        return jobs_from_pb(await self._call("ListJobs", pb.ListJobsRequest()))

    async def end_job(self, job: str) -> int:
        return (await self._call("EndJob", pb.EndJobRequest(job=job))).version

    async def create_job(self, cfg: JobConfig | str, layout: Layout | None, values: np.ndarray | None,
                         job_token: str = "") -> tuple[bool, int, int]:
        chunks = split(layout, values, get_codec("fp32")) if layout is not None else []
        r = await self._call("CreateJob", iter(encode_create_job(cfg, layout, chunks, job_token)))
        if r.job_token:  # the servicer hands it to the caller that created the job
            self.minted[cfg if isinstance(cfg, str) else cfg.name] = r.job_token
        return r.created, r.version, r.view_epoch

    async def create_job_through(self, name: str, frames: AsyncIterator[bytes],
                                 timeout: float | None = None) -> tuple[bool, int, int]:
        """A CreateJob's frames as a child sent them, each written up as ``frames`` yields it (one
        frame held at a time; ``timeout``: what is left of the child's deadline). ``frames``
        raising cancels the call, so the parent creates nothing. The parent's refusal (at the
        first frame: the caller's credentials) ends it before the next write, and a frame still
        being read from the child is waited for at most ``_READ_ON_S``: a stranger's values are
        not waited for without end."""
        tokens = self._tokens(None)
        nxt: asyncio.Future | None = None
        try:
            call = await self._rpc.open("CreateJob", self.timeout_s if timeout is None else timeout, tokens)
            ended = asyncio.ensure_future(call.ended())
            try:
                while True:
                    nxt = asyncio.ensure_future(anext(frames))
                    await asyncio.wait((nxt, ended), return_when=asyncio.FIRST_COMPLETED)
                    if ended.done():  # answered before the end: the answer is a refusal
                        break
                    read, nxt = nxt, None
                    try:
                        frame = read.result()
                    except StopAsyncIteration:
                        break
                    await call.write(frame)
                r = await call.finish()
            except BaseException as exc:
                call.cancel()
                if nxt is not None and isinstance(exc, asyncio.CancelledError):
                    nxt.cancel()  # this call itself is cancelled (the child went, the tier stops)
                raise
            finally:
                ended.cancel()
                if nxt is not None:
                    await _settle_read(nxt)
                await frames.aclose()  # type: ignore[attr-defined]
        except HpsError as exc:
            self._failed(exc)
            raise
        self._answered("CreateJob")
        if r.job_token:  # the servicer hands it to the caller that created the job
            self.minted[name] = r.job_token
        return r.created, r.version, r.view_epoch

    async def resolve(self, job: str, keys: tuple[PushKey, ...], wait_s: float, moved: bool = False
                      ) -> tuple[str, int, int, bool]:
        """Ask the parent what became of these worker pushes (see ``Tier.resolve``); ``moved``:
        they went up through a parent this relay has left since."""
        r = await self._call("Resolve", pb.ResolveRequest(job=job, member=self.member, keys=keys_to_pb(keys),
                                                          wait_ms=int(wait_s * 1000), moved=moved),
                             timeout=wait_s + self.timeout_s, job=job)
        return OUTCOME_NAME.get(r.outcome, "unknown"), r.version, r.view_epoch, r.skipped

    async def rank(self, job: str, member: str, incarnation: int, requested: int | None,
                   release: bool) -> RankInfo:
        """A worker's rank call, passed on towards the root (see ``Tier.rank``)."""
        r = await self._call("Rank", pb.RankRequest(job=job, member=member, incarnation=incarnation,
                                                    requested_rank=requested, release=release), job=job)
        return rank_from_pb(r)

    async def lease(self, job: str, member: str, incarnation: int, dataset: Dataset, epoch: int, want: bool,
                    held: tuple[tuple[int, int], ...]) -> Grant:
        """A worker's lease call, passed on towards the root (see ``Tier.lease``)."""
        r = await self._call("Lease", pb.LeaseRequest(job=job, member=member, incarnation=incarnation,
                                                      dataset=dataset_to_pb(dataset), epoch=epoch, want=want,
                                                      held=shards_to_pb(held)), job=job)
        return grant_from_pb(r)

    async def pull(self, job: str, view_epoch: int, since: int, min_version: int, wait_s: float
                   ) -> tuple[PullMeta, list[tuple[VersionMeta, list]]]:
        req = pb.PullRequest(job=job, member=self.member, view_epoch=view_epoch, since_version=since,
                             min_version=min_version, wait_ms=int(wait_s * 1000))
        # The long-poll and the first frame within wait_s + the upstream timeout; then each
        # frame within the upstream timeout, however long a large reply takes across a WAN.
        frames = await self._call("Pull", req, timeout=wait_s + self.timeout_s, stream=True, job=job,
                                  idle=self.timeout_s)
        return decode_pull_reply(frames)

