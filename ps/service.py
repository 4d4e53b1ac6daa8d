"""The grpc.aio servicer: decode the request, call the tier, encode the reply.

    server.add_generic_rpc_handlers([handler(tier)])

Raw-frame methods (Push, Pull, CreateJob) are registered with identity serialisers, so
payload bytes are never copied into protobuf objects. Every hps exception leaves as the gRPC
status of ``ps.errors`` with its sentence as the details.
"""

from __future__ import annotations

import functools
import logging

import grpc

from ps.errors import BadInput, HpsError, code_of
from ps.metrics import NO_RPC_METRICS
from ps.relay import Relay
from ps.tier import Tier
from ps.wire import (METHODS, MODE, ROLE, ROLE_NAME, SERVICE, decode_create_job, decode_push,
                     encode_pull_reply, job_to_pb, layout_to_pb, pb)

__all__ = ["handler"]

log = logging.getLogger("hps.service")


def _unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except HpsError as exc:
            await context.abort(code_of(exc), str(exc))
    return wrapper


class _Servicer:
    def __init__(self, tier: Tier, rpc=NO_RPC_METRICS) -> None:
        self.tier = tier
        self.rpc = rpc  # latency histograms (ps.metrics.RpcMetrics)

    @_unary
    async def Register(self, req: pb.RegisterRequest, context) -> pb.RegisterReply:
        if req.role not in ROLE_NAME:
            raise BadInput(f"register needs a role, got enum value {req.role}")
        if not req.member:
            raise BadInput("register needs a member id")
        with self.rpc.timed("register") as timing:
            timing.job = req.job
            reg = await self.tier.register(req.job, req.member, ROLE_NAME[req.role], req.address, req.last_seq)
        return pb.RegisterReply(
            config=job_to_pb(reg.config), keys=layout_to_pb(reg.layout), server_epoch=reg.server_epoch,
            start_version=reg.start_version, start_clock=reg.start_clock,
            heartbeat_ms=int(self.tier.config.heartbeat_s * 1000),
            member_timeout_ms=int(self.tier.config.member_timeout_s * 1000))

    @_unary
    async def Heartbeat(self, req: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        unknown = self.tier.heartbeat(req.member, list(req.jobs), ROLE_NAME.get(req.role, "worker"),
                                      req.address)
        return pb.HeartbeatReply(server_epoch=self.tier.epoch, unknown_jobs=unknown)

    @_unary
    async def Leave(self, req: pb.LeaveRequest, context) -> pb.LeaveReply:
        await self.tier.leave(req.job, req.member)
        return pb.LeaveReply()

    @_unary
    async def Push(self, request_iterator, context) -> pb.PushAck:
        with self.rpc.timed("push") as timing:
            frames = [f async for f in request_iterator]
            meta, chunks = decode_push(frames)
            timing.job = meta.job
            ack = await self.tier.push(meta, chunks)
        return pb.PushAck(applied_version=ack.applied_version, duplicate=ack.duplicate,
                          view_epoch=ack.view_epoch)

    async def Pull(self, req: pb.PullRequest, context):
        with self.rpc.timed("pull") as timing:
            timing.job = req.job
            try:
                meta, versions = await self.tier.pull(req.job, req.member, req.view_epoch, req.since_version,
                                                      req.min_version, req.wait_ms / 1000.0, req.min_clock)
            except HpsError as exc:
                await context.abort(code_of(exc), str(exc))
            for frame in encode_pull_reply(meta, versions):
                yield frame

    @_unary
    async def CreateJob(self, request_iterator, context) -> pb.CreateJobReply:
        frames = [f async for f in request_iterator]
        if isinstance(self.tier, Relay):
            # Only the root creates jobs; a relay checks the stream and forwards it verbatim.
            decode_create_job(frames)
            created, version, epoch = await self.tier.up.create_job(frames)
        else:
            cfg, layout, chunks = decode_create_job(frames)
            created, version, epoch = await self.tier.create_job(cfg, layout, chunks)
        return pb.CreateJobReply(created=created, version=version, view_epoch=epoch)

    @_unary
    async def ListJobs(self, req: pb.ListJobsRequest, context) -> pb.ListJobsReply:
        if isinstance(self.tier, Relay):
            return await self.tier.up.forward("ListJobs", req)
        return pb.ListJobsReply(jobs=[
            pb.JobInfo(config=job_to_pb(j["config"]), state=j["state"], version=j["version"],
                       members=j["members"], parameters=j["parameters"]) for j in self.tier.list_jobs()])

    @_unary
    async def EndJob(self, req: pb.EndJobRequest, context) -> pb.EndJobReply:
        if isinstance(self.tier, Relay):
            return await self.tier.up.forward("EndJob", req)
        return pb.EndJobReply(version=await self.tier.end_job(req.job))

    @_unary
    async def Status(self, req: pb.StatusRequest, context) -> pb.StatusReply:
        s = self.tier.status()
        reachable = self.tier.up.reachable if isinstance(self.tier, Relay) else True
        def members(ms):
            return [pb.MemberStatus(member=m["member"], role=ROLE[m["role"]], address=m["address"],
                                    last_seen_s=m["last_seen_s"], pushes=m["pushes"]) for m in ms]

        jobs = []
        for j in s["jobs"]:
            fields = {k: v for k, v in j.items() if k in pb.JobStatus.DESCRIPTOR.fields_by_name
                      and k not in ("members", "mode")}
            jobs.append(pb.JobStatus(members=members(j["members"]), mode=MODE[j["mode"]], **fields))
        return pb.StatusReply(role=ROLE[s["role"]], name=s["name"], server_epoch=s["server_epoch"],
                              parent=s["parent"], parent_reachable=reachable, jobs=jobs,
                              uptime_s=s["uptime_s"], children=members(s["children"]))


def handler(tier: Tier, rpc=NO_RPC_METRICS) -> grpc.GenericRpcHandler:
    servicer = _Servicer(tier, rpc)
    handlers = {}
    for name, (kind, req, resp) in METHODS.items():
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[name] = make(getattr(servicer, name),
                              request_deserializer=req.FromString if req else None,
                              response_serializer=resp.SerializeToString if resp else None)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
