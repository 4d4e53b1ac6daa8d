"""A relay's link to its parent: register, heartbeat, push aggregates up, pull deltas down.

    up = Upstream("region-eu:7000", member="eu-a-1f2e", own_address="zone-eu-a:7001")
    reg = await up.register("lm", last_seq=0)
    meta, versions = await up.pull("lm", epoch, since=3, min_version=4, wait_s=5)

Transport only: every gRPC error becomes an hps exception (``from_rpc_error``) and every call
has a deadline. What to do about an error is the relay's business (ps/relay.py).
"""

from __future__ import annotations

import grpc

from ps.errors import TimedOut, Unavailable, from_rpc_error
from ps.tier import Ack, Registration
from ps.wire import (GRPC_OPTIONS, ROLE, PullMeta, VersionMeta, decode_pull_reply, job_from_pb,
                     layout_from_pb, pb, stubs)

__all__ = ["Upstream"]


class Upstream:
    def __init__(self, address: str, member: str, role: str, own_address: str = "",
                 timeout_s: float = 10.0) -> None:
        self.address = address
        self.member = member
        self.role = role
        self.own_address = own_address
        self.timeout_s = timeout_s
        self.server_epoch = 0
        self.reachable = False
        self.failures = 0
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._rpc = stubs(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, name: str, request, timeout: float | None = None):
        try:
            reply = await self._rpc[name](request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as err:
            exc = from_rpc_error(err)
            if isinstance(exc, (Unavailable, TimedOut)):
                self.reachable = False
                self.failures += 1
            raise exc from None
        self.reachable = True
        return reply

    async def register(self, job: str, last_seq: int) -> Registration:
        r = await self._call("Register", pb.RegisterRequest(
            job=job, member=self.member, role=ROLE[self.role], address=self.own_address,
            last_seq=last_seq))
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

    async def forward(self, name: str, request):
        """Pass a control call (ListJobs, EndJob) to the parent unchanged."""
        return await self._call(name, request)

    async def create_job(self, frames: list[bytes]) -> tuple[bool, int, int]:
        r = await self._call("CreateJob", iter(frames))
        return r.created, r.version, r.view_epoch

    async def pull(self, job: str, view_epoch: int, since: int, min_version: int, wait_s: float
                   ) -> tuple[PullMeta, list[tuple[VersionMeta, list]]]:
        req = pb.PullRequest(job=job, member=self.member, view_epoch=view_epoch, since_version=since,
                             min_version=min_version, wait_ms=int(wait_s * 1000))
        try:
            call = self._rpc["Pull"](req, timeout=wait_s + self.timeout_s)
            frames = [f async for f in call]
        except grpc.RpcError as err:
            exc = from_rpc_error(err)
            if isinstance(exc, (Unavailable, TimedOut)):
                self.reachable = False
                self.failures += 1
            raise exc from None
        self.reachable = True
        return decode_pull_reply(frames)
