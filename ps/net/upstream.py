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

Transport only: every gRPC error becomes an hps exception (``ps.net.rpc``) and every call has a
deadline. What to do about an error is the relay's business (ps/tiers/relay.py).
"""

from __future__ import annotations

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig
from ps.core.errors import HpsError, TimedOut, Unavailable
from ps.core.tensors import split
from ps.core.types import Ack, PullMeta, PushKey, Registration, VersionMeta
from ps.core.view import Layout
from ps.net.rpc import AsyncCaller
from ps.net.tls import TlsFiles
from ps.net.wire import (
    OUTCOME_NAME,
    ROLE,
    decode_pull_reply,
    encode_create_job,
    job_from_pb,
    jobs_from_pb,
    keys_to_pb,
    layout_from_pb,
    pb,
)

__all__ = ["Upstream"]


class Upstream:
    def __init__(self, address: str, member: str, role: str, incarnation: int, own_address: str = "",
                 timeout_s: float = 10.0, tls: TlsFiles | None = None) -> None:
        self.address = address
        self.member = member
        self.role = role
        self.incarnation = incarnation
        self.own_address = own_address
        self.timeout_s = timeout_s
        self.server_epoch = 0
        self.reachable = False
        self.failures = 0
        self._rpc = AsyncCaller(address, tls)  # tls: this relay's certificate, shown to its parent

    async def close(self) -> None:
        await self._rpc.close()

    async def _call(self, name: str, request, timeout: float | None = None, stream: bool = False):
        try:
            if stream:
                reply = await self._rpc.stream(name, request, timeout or self.timeout_s)
            else:
                reply = await self._rpc.call(name, request, timeout or self.timeout_s)
        except HpsError as exc:
            if isinstance(exc, (Unavailable, TimedOut)):
                self.reachable = False
                self.failures += 1
            raise
        self.reachable = True
        return reply

    async def register(self, job: str, last_seq: int) -> Registration:
        r = await self._call("Register", pb.RegisterRequest(
            job=job, member=self.member, role=ROLE[self.role], address=self.own_address,
            last_seq=last_seq, incarnation=self.incarnation))
        self.server_epoch = r.server_epoch
        return Registration(job_from_pb(r.config), layout_from_pb(r.keys), r.start_version, r.server_epoch)

    async def heartbeat(self, jobs: list[str]) -> tuple[int, list[str]]:
        r = await self._call("Heartbeat", pb.HeartbeatRequest(
            member=self.member, jobs=jobs, server_epoch=self.server_epoch, role=ROLE[self.role],
            address=self.own_address))
        return r.server_epoch, list(r.unknown_jobs)

    async def leave(self, job: str) -> None:
        await self._call("Leave", pb.LeaveRequest(job=job, member=self.member))

    async def push(self, frames: list[bytes], timeout: float) -> Ack:
        r = await self._call("Push", iter(frames), timeout=timeout)
        return Ack(r.applied_version, r.view_epoch, r.duplicate)

    async def list_jobs(self) -> list[dict]:
        return jobs_from_pb(await self._call("ListJobs", pb.ListJobsRequest()))

    async def end_job(self, job: str) -> int:
        return (await self._call("EndJob", pb.EndJobRequest(job=job))).version

    async def create_job(self, cfg: JobConfig | str, layout: Layout | None, values: np.ndarray | None
                         ) -> tuple[bool, int, int]:
        chunks = split(layout, values, get_codec("fp32")) if layout is not None else []
        r = await self._call("CreateJob", iter(encode_create_job(cfg, layout, chunks)))
        return r.created, r.version, r.view_epoch

    async def resolve(self, job: str, keys: tuple[PushKey, ...], wait_s: float) -> tuple[str, int, int]:
        """Ask the parent what became of these worker pushes (see ``Tier.resolve``)."""
        r = await self._call("Resolve", pb.ResolveRequest(job=job, member=self.member, keys=keys_to_pb(keys),
                                                          wait_ms=int(wait_s * 1000)),
                             timeout=wait_s + self.timeout_s)
        return OUTCOME_NAME.get(r.outcome, "unknown"), r.version, r.view_epoch

    async def pull(self, job: str, view_epoch: int, since: int, min_version: int, wait_s: float
                   ) -> tuple[PullMeta, list[tuple[VersionMeta, list]]]:
        req = pb.PullRequest(job=job, member=self.member, view_epoch=view_epoch, since_version=since,
                             min_version=min_version, wait_ms=int(wait_s * 1000))
        frames = await self._call("Pull", req, timeout=wait_s + self.timeout_s, stream=True)
        return decode_pull_reply(frames)
