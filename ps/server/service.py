"""The grpc.aio servicer: decode the request, call the tier, encode the reply.

>>> from ps.core.config import JobConfig, ServerConfig
>>> from ps.net.rpc import AsyncCaller
>>> from ps.tiers.root import Root
>>> async def serve_a_root():
...     tier = Root(ServerConfig(role="global"))
...     await tier.create_job(JobConfig(name="lm"), None, None)       # declared, no parameters yet
...     server = grpc.aio.server()
...     server.add_generic_rpc_handlers([handler(tier)])          # a server: handler(tier, metrics.rpc)
...     port = server.add_insecure_port("127.0.0.1:0")
...     await server.start()
...     rpc = AsyncCaller(f"127.0.0.1:{port}")
...     reply = await rpc.call("ListJobs", pb.ListJobsRequest(), timeout=5)
...     try:
...         await rpc.call("EndJob", pb.EndJobRequest(job="no-such-job"), timeout=5)
...     except HpsError as exc:                                   # raised at the tier, raised here
...         refused = type(exc).__name__
...     await rpc.close(); await server.stop(0)
...     return [j.config.name for j in reply.jobs], refused
>>> asyncio.run(serve_a_root())
(['lm'], 'UnknownJob')
>>> parse(pb.RegisterRequest, bytes([0xFF]))     # every request's bytes are parsed here
Traceback (most recent call last):
ps.core.errors.BadInput: the RegisterRequest does not parse (...)

Every method is registered with identity request deserialisers, so a request that does not
parse is this module's to refuse (INVALID_ARGUMENT with a sentence), not an UNKNOWN status and
a traceback from inside grpc. Raw-frame methods (Push, Pull, CreateJob) never copy payload
bytes into protobuf objects, and client-streamed bodies are decoded frame by frame as they
arrive: the header is checked before the body is read, memory is reserved before it is used,
and a stream that ends without its end marker changes nothing.

Every call's credentials are checked here, before the tier sees it (``ps.server.auth``: who may
do what, and the trust model between tiers); a refused call changes nothing.

Every hps exception leaves as its gRPC status (``ps.net.rpc``); anything else is a bug, logged (one
line with its traceback, rate-limited) and answered INTERNAL. Refusals are counted per method
and status code in the metrics; expected ones are logged at debug level only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback

import grpc
from google.protobuf.message import DecodeError

from ps.core import codecs
from ps.core.config import JobConfig, check_member, check_name
from ps.core.errors import BadInput, Conflict, HpsError, Internal, PermissionDenied, Unauthenticated, short
from ps.core.tensors import Assembler
from ps.net.aio import wait_for
from ps.net.frames import BodyReader
from ps.net.messages import (
    OUTCOME,
    ROLE_NAME,
    dataset_from_pb,
    grant_to_pb,
    job_to_pb,
    jobs_to_pb,
    layout_to_pb,
    rank_to_pb,
    shards_from_pb,
    status_to_pb,
)
from ps.net.rpc import FORWARDED, abort, bearer_tokens
from ps.net.wire import (
    METHODS,
    SERVICE,
    LogReader,
    adopted_token,
    chunks_of,
    create_job_of,
    encode_log,
    encode_pull_reply,
    keys_from_pb,
    pb,
    push_meta_of,
    with_tail,
)
from ps.server.auth import Guard, relay_identity
from ps.server.auth import digest as token_hash
from ps.server.peers import check_relay_child, reachable_address
from ps.tiers.metrics import NO_RPC_METRICS
from ps.tiers.tier import Tier

__all__ = ["handler", "parse"]

log = logging.getLogger("hps.service")


class _Throttle:
    """At most one log line per key per ``period_s``; the next one says how many were dropped."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def __call__(self, key: str, level: int, msg: str, *args, exc_info=None) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.period_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            msg += f" ({dropped} more like it in the last {self.period_s:.0f}s)"
        log.log(level, msg, *args, exc_info=exc_info)


_throttle = _Throttle()


def parse(message_class, data: bytes):
    """A request message from its bytes, or BadInput."""
    try:
        return message_class.FromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise BadInput(f"the {message_class.DESCRIPTOR.name} does not parse ({short(str(exc), 120)})") from None


async def refuse(context, method: str, exc: BaseException, rpc) -> None:
    """Answer the call with ``exc``'s status; count it; log bugs (throttled)."""
    if not isinstance(exc, HpsError):
        _throttle(f"{method}:bug", logging.ERROR, "%s failed: %s", method, exc, exc_info=exc)
        exc = Internal(f"the tier failed to handle {method} ({type(exc).__name__}); it is logged there")
    else:
        _throttle(f"{method}:{exc.code}", logging.DEBUG, "%s refused: %s: %s", method, exc.code, exc)
    rpc.error(method, exc.code)
    # The status's exception keeps the handler's frames alive in a reference cycle with gRPC's
    # call state (context.abort raises inside our except block), until the cyclic GC runs. A
    # refused push or CreateJob kept its decode buffer so: 40 refused CreateJobs of ~100 bytes,
    # each declaring 2**31 parameters, took a root to 24 GB and the OOM killer while the byte
    # budget counted them released. The handlers' own frames have finished: let go of them.
    traceback.clear_frames(exc.__traceback__)
    await abort(context, exc)


def _unary(name: str):
    """Parse the request (identity deserialiser) and turn exceptions into statuses."""
    request_class = METHODS[name][1]

    def wrap(fn):
        @functools.wraps(fn)
        async def wrapper(self, data, context):
            forwarded = FORWARDED.set(_tokens(context))
            try:
                return await fn(self, parse(request_class, data), context)
            except Exception as exc:
                await refuse(context, name, exc, self.rpc)
            finally:
                FORWARDED.reset(forwarded)
        return wrapper
    return wrap


_DRAIN_S = 5.0  # how long a refused stream's remaining frames are read (and dropped) at most


class _Stream:
    """A request iterator that knows whether it was read to its end."""

    def __init__(self, request_iterator) -> None:
        self._it = request_iterator.__aiter__()
        self.ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            self.ended = True
            raise

    async def drain(self, seconds: float = _DRAIN_S) -> None:
        """Read what is left of a refused stream, dropping each frame as it comes. Aborting while
        the sender was still writing lost the status at grpc.aio senders (a relay forwarding a
        large push got INTERNAL instead of the parent's NotMember in 19 of 30 tries); reading to
        the end first delivers it. Memory stays one frame; the time is bounded."""
        async def rest() -> None:
            async for _ in self:
                pass
        if self.ended:
            return
        try:
            await wait_for(rest(), seconds)
        except Exception:  # the stream was cut, or the time is up: the refusal goes out regardless
            pass


def _streamed(name: str):
    """``_unary`` for client-streamed bodies: the handler reads the request iterator in a frame
    of its own, which has finished (and can be cleared, see ``refuse``) when it is refused; the
    rest of a refused stream is read and dropped before the refusal goes out (``_Stream.drain``)."""
    def wrap(fn):
        @functools.wraps(fn)
        async def wrapper(self, request_iterator, context):
            stream = _Stream(request_iterator)
            forwarded = FORWARDED.set(_tokens(context))
            try:
                return await fn(self, stream, context)
            except Exception as exc:
                await stream.drain()
                await refuse(context, name, exc, self.rpc)
            finally:
                FORWARDED.reset(forwarded)
        return wrapper
    return wrap


def _tokens(context) -> tuple[str, ...]:
    """The bearer tokens the caller presented (never logged)."""
    return bearer_tokens(context.invocation_metadata())


class _Servicer:
    def __init__(self, tier: Tier, rpc=NO_RPC_METRICS, guard: Guard | None = None) -> None:
        self.tier = tier
        self.rpc = rpc  # latency histograms and error counters (ps.tiers.metrics.RpcMetrics)
        self.guard = guard if guard is not None else Guard(admin_token=None)
        self._minting: dict[str, asyncio.Lock] = {}  # job -> held while its token is minted
        self.relay = tier.role != "global"

    def _check_job(self, context, job: str, relay_role: bool = False) -> None:
        self.guard.check_job(_tokens(context), job, relay_identity(context) if relay_role else None)

    def _trusted(self, context) -> bool:
        """The caller is a relay (a verified relay certificate) or the admin, or every caller is
        trusted here (no admin token): the addresses it reports may be visited with the admin token."""
        return (not self.guard.enabled or relay_identity(context) is not None
                or self.guard.is_admin(_tokens(context)))

    def _check_child(self, context, member: str, role: str) -> None:
        """With mTLS, a relay child must hold a relay certificate naming it (ps.server.peers)."""
        check_relay_child(context, member, role, self.tier.children, self.tier.config.display_name,
                          self.tier.config.role)

    @_unary("Register")
    async def Register(self, req: pb.RegisterRequest, context) -> pb.RegisterReply:
        if req.role not in ROLE_NAME or ROLE_NAME[req.role] == "global":
            raise BadInput(f"register needs the role of a worker, zone or regional master, not enum value {req.role}")
        self._check_child(context, req.member, ROLE_NAME[req.role])
        relay_role = ROLE_NAME[req.role] != "worker"
        self.tier.check_register(req.job, req.member, req.incarnation)  # before the parent is joined
        attached = False
        if self.relay and self.guard.enabled and not self.guard.knows(req.job):
            # Join the parent first (it checks the tokens this call presented) to learn the
            # job's token hash, so the member is admitted only after its own token is checked.
            await self.tier.attach(check_name(req.job))  # type: ignore[attr-defined]
            attached = True
        try:
            try:
                self._check_job(context, req.job, relay_role)
            except (Unauthenticated, PermissionDenied):
                # A job its root held no token for (admin only) may have been given one since
                # (`hps job create` mints it): this relay asks its parent again, at most every
                # few seconds a job, and checks once more. It kept refusing the new token until
                # it registered upstream again, for good while it ran (review).
                if not (self.relay and self.guard.admin_only(req.job) and _tokens(context)
                        and await self.tier.refresh_token_hash(req.job)):  # type: ignore[attr-defined]
                    raise
                self._check_job(context, req.job, relay_role)
        except HpsError:
            if attached:  # refused: not attached for it (it held the parent's rounds of the job)
                await self.tier.detach(req.job, refused=True)  # type: ignore[attr-defined]
            raise
        # A relay's address is one `hps status` visits with the admin token: kept only from a
        # caller that is a relay (its certificate) or the admin. Over plaintext a job token's
        # holder registered as a "zone" at an address of theirs, and collected the admin token
        # there (security review). A relay shows itself by heartbeat (``Upstream.heartbeat``).
        address = reachable_address(req.address[:256], context.peer())
        if relay_role and not self._trusted(context):
            address = ""
        with self.rpc.timed("register") as timing:
            timing.job = req.job
            reg = await self.tier.register(req.job, req.member, ROLE_NAME[req.role], address,
                                           req.last_seq, req.incarnation)
        return pb.RegisterReply(
            config=job_to_pb(reg.config), keys=layout_to_pb(reg.layout), server_epoch=reg.server_epoch,
            start_version=reg.start_version, start_clock=reg.start_clock,
            heartbeat_ms=int(self.tier.config.heartbeat_s * 1000),
            member_timeout_ms=int(self.tier.config.member_timeout_s * 1000),
            token_sha256=self.guard.hash_of(req.job) if relay_role else b"")

    @_unary("Heartbeat")
    async def Heartbeat(self, req: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        if len(req.jobs) > 1000:
            raise BadInput(f"a heartbeat names at most 1000 jobs, got {len(req.jobs)}")
        if ROLE_NAME.get(req.role) == "global":
            raise BadInput("a heartbeat needs the role of a worker, zone or regional master, not a global root's")
        self._check_child(context, req.member, ROLE_NAME.get(req.role, "worker"))
        # Every job it names that this tier can check (see ps.server.auth), each once.
        relay_role = ROLE_NAME.get(req.role, "worker") != "worker"
        checked = self.guard.check_known(_tokens(context), list(req.jobs),
                                         relay_identity(context) if relay_role else None)
        trusted = self._trusted(context)
        # A job this tier cannot check the caller's token for (the root holds no token for it:
        # the admin's alone) is not kept alive by an unchecked caller: a token-less heartbeat
        # naming a dead member kept it in the round until the round timeout.
        jobs = list(dict.fromkeys(req.jobs)) if trusted else checked
        address = reachable_address(req.address, context.peer())
        if not trusted:
            # `hps status` walks a relay child's address with the admin token: over plaintext
            # anyone (a heartbeat naming no job needs no token), or a job token's holder, could
            # list an address of theirs and collect it there. A relay's heartbeat presents the
            # admin token its tier holds (``Upstream.admin_token``), or its certificate.
            address = ""
        # A relay's workers per job (checked ones only: a count weighs the job's async updates).
        workers = {j: w for j, w in zip(req.jobs, req.workers) if w and j in jobs} \
            if relay_role and len(req.workers) == len(req.jobs) else {}
        unknown = self.tier.heartbeat(check_member(req.member), jobs, ROLE_NAME.get(req.role, "worker"), address,
                                      workers)
        return pb.HeartbeatReply(server_epoch=self.tier.epoch, unknown_jobs=unknown)

    @_unary("Leave")
    async def Leave(self, req: pb.LeaveRequest, context) -> pb.LeaveReply:
        self._check_child(context, req.member, "worker")
        self._check_job(context, req.job, relay_role=True)
        await self.tier.leave(check_name(req.job), req.member)
        return pb.LeaveReply()

    @_streamed("Push")
    async def Push(self, request_iterator, context) -> pb.PushAck:
        intake = None
        try:
            with self.rpc.timed("push") as timing:
                reader = BodyReader("push", "push", tail="tail")
                async for data in request_iterator:
                    kind, h, payload = reader.feed(data)
                    if kind == "push":
                        meta = push_meta_of(h)
                        check_name(meta.job)
                        # an aggregate (it names its sources) is a relay's push
                        self._check_child(context, meta.sender, "relay" if meta.sources else "worker")
                        self._check_job(context, meta.job, relay_role=True)  # before anything is read
                        timing.job = meta.job
                        intake = self.tier.open_push(meta)  # refusals before the body is read
                    elif kind == "chunks":
                        chunks = chunks_of(h.chunks, payload)
                        # A codec this process has not loaded (a lossy one imports torch: ~2 s) is
                        # imported off the event loop, which must keep answering heartbeats; a
                        # relay loads its jobs' codecs as it attaches them, but a child may send
                        # another (its own --up-codec, a worker its own codec).
                        if missing := codecs.unloaded({c.codec for c in chunks}):
                            await asyncio.to_thread(codecs.load, missing)
                        intake.add(chunks)
                    elif kind == "tail":  # a streamed push's late fields
                        intake.late(with_tail(intake.meta, h))
                digest = reader.finish()
                ack = await self.tier.commit_push(intake, digest, resend_to=reader.resend_to)
            return pb.PushAck(applied_version=ack.applied_version, duplicate=ack.duplicate,
                              view_epoch=ack.view_epoch, skipped=ack.skipped, pace=ack.pace)
        finally:
            if intake is not None:
                intake.close()

    async def Pull(self, data: bytes, context):
        with self.rpc.timed("pull") as timing:
            forwarded = FORWARDED.set(_tokens(context))
            try:
                req = parse(pb.PullRequest, data)
                self._check_job(context, req.job, relay_role=True)
                timing.job = req.job
                # At most a minute, as Resolve: a uint32 of milliseconds parked a handler for weeks.
                meta, versions = await self.tier.pull(req.job, req.member, req.view_epoch, req.since_version,
                                                      req.min_version, min(req.wait_ms, 60_000) / 1000.0,
                                                      req.min_clock)
            except Exception as exc:
                await refuse(context, "Pull", exc, self.rpc)
            finally:
                FORWARDED.reset(forwarded)
            for frame in encode_pull_reply(meta, versions):
                yield frame

    def _check_create(self, context, name: str) -> None:
        """The admin creates jobs; a job's own token may bring the values of its declared job.
        A relay that does not know the job lets its root decide (it forwards these tokens)."""
        tokens = _tokens(context)
        if self.guard.knows(name) and (self.relay or self.guard.has_token(name)):
            self.guard.check_job(tokens, name)
        elif not self.relay:
            self.guard.check_admin(tokens, "create jobs")

    def _check_adopted(self, name: str, cfg: JobConfig | str, adopted: str) -> None:
        """A job token handed over in a CreateJob: only a root shard creating a sharded job
        takes one (its shard 0 minted it), and only the token the job holds already, if any. A
        relay (in a shard's tree) passes it on and its root shard decides."""
        if not adopted:
            return
        if not isinstance(cfg, JobConfig) or cfg.sharding is None or not (self.relay or self.tier.config.shard):
            raise BadInput("a job token is handed over in a create only to the root shards of a sharded job")
        if self.relay:
            return
        if self.guard.enabled and self.guard.has_token(name) and self.guard.hash_of(name) != token_hash(adopted):
            raise Conflict(f"job {short(name)} holds another token at this shard: its shards would not accept "
                           "one token (end the job and create it again)")

    async def _job_token(self, context, name: str, adopted: str = "") -> str:
        """The job's token for the admin who created it: minted here at the root (once: a job
        with a token never gets another), the one the root minted for a relayed CreateJob, or
        at a root shard the one ``adopted`` from shard 0 (kept, not handed back)."""
        if self.relay:
            link = self.tier.parent_link()
            token = link.minted.pop(name, "")
            if token and name in link.token_hashes:  # (a job held here as admin only: it has one now)
                link.token_hashes[name] = token_hash(token)
            return token
        if not self.guard.enabled:
            return ""
        # One at a time per job: creators that arrive together (each waits for the standby)
        # must not each mint a token, of which only the last would work.
        async with self._minting.setdefault(name, asyncio.Lock()):
            if self.guard.has_token(name):
                return ""
            self.guard.check_admin(_tokens(context), "create jobs")  # checked before; stays true
            if adopted:
                h = token_hash(adopted)
                await self.tier.keep_token(name, h)  # type: ignore[attr-defined]  # the standby's too
                self.guard.set_hash(name, h)
                return ""
            token, h = self.guard.new_token()
            await self.tier.keep_token(name, h)  # type: ignore[attr-defined]  # the standby's too
            self.guard.set_hash(name, h)
            return token

    async def _create_through(self, name: str, head: bytes, reader: BodyReader, request_iterator,
                              timeout: float | None) -> tuple[bool, int, int]:
        """A relay's CreateJob: the frames go up to its parent as they arrive (cut through), so
        the root checks the caller's credentials and the configuration at the first frame, and
        this tier never holds more than a frame or two: a stranger's create reserves nothing
        here, and a 100M-parameter job's initial values need no memory here (a refused stream's
        rest is still read and dropped, as every refused stream is). Each frame is checked as it
        passes (``reader``); one that is malformed, or a stream cut before its end marker,
        cancels the call above, where nothing is created (a partial create is never a whole).
        The call above gets what is left of the caller's deadline."""
        async def frames():
            yield head
            async for data in request_iterator:
                reader.feed(data)
                yield data
            reader.finish()
        return await self.tier.create_job_through(name, frames(), timeout)  # type: ignore[attr-defined]

    @_streamed("CreateJob")
    async def CreateJob(self, request_iterator, context) -> pb.CreateJobReply:
        reserved = 0
        try:
            reader, values, head, adopted = BodyReader("job", "create-job stream"), None, None, ""
            async for data in request_iterator:
                kind, h, payload = reader.feed(data)
                if kind == "job":
                    # Credentials first: building the configuration may import torch to check
                    # an optimizer (seconds, on this loop), and a stranger's call must not cost that.
                    name = check_name(h.job.config.name)
                    self._check_create(context, name)
                    head = create_job_of(h)
                    cfg, layout = head
                    adopted = adopted_token(h)
                    self._check_adopted(name, cfg, adopted)
                    self.tier.check_create(cfg, layout)  # refusals before any value is read
                    if self.relay:  # passed on frame by frame: nothing of it is held here
                        created, version, epoch = await self._create_through(name, data, reader, request_iterator,
                                                                             context.time_remaining())
                        return pb.CreateJobReply(created=created, version=version, view_epoch=epoch,
                                                 job_token=await self._job_token(context, name, adopted))
                    if layout is not None:
                        self.tier.budget.reserve(4 * layout.numel)  # refused: nothing to give back
                        reserved = 4 * layout.numel
                        values = Assembler(layout, what=f"initial values of job {short(h.job.config.name)}")
                elif kind == "chunks":
                    if values is None:
                        raise BadInput("a create-job stream with values needs the keys they belong to")
                    for c in chunks_of(h.chunks, payload):
                        values.add(c)
            reader.finish()
            cfg, layout = head
            vals = values.finish(require_all=True) if values is not None else None
            created, version, epoch = await self.tier.create_job(cfg, layout, vals)
            return pb.CreateJobReply(created=created, version=version, view_epoch=epoch,
                                     job_token=await self._job_token(context, name, adopted))
        finally:
            self.tier.budget.release(reserved)

    @_unary("ListJobs")
    async def ListJobs(self, req: pb.ListJobsRequest, context) -> pb.ListJobsReply:
        self.guard.check_admin(_tokens(context), "list jobs")
        return jobs_to_pb(await self.tier.list_jobs())

    @_unary("EndJob")
    async def EndJob(self, req: pb.EndJobRequest, context) -> pb.EndJobReply:
        self.guard.check_admin(_tokens(context), "end jobs")
        version = await self.tier.end_job(check_name(req.job))
        self.guard.forget(req.job)
        return pb.EndJobReply(version=version)

    @_unary("Resolve")
    async def Resolve(self, req: pb.ResolveRequest, context) -> pb.ResolveReply:
        if not req.keys or len(req.keys) > 1 << 20:
            raise BadInput(f"resolve names 1 to {1 << 20} pushes, got {len(req.keys)}")
        self._check_child(context, req.member, "worker")  # relays ask; a worker cert may not as one
        self._check_job(context, req.job, relay_role=True)
        outcome, version, epoch, skipped = await self.tier.resolve(check_name(req.job), keys_from_pb(req.keys),
                                                          min(req.wait_ms, 60_000) / 1000.0,
                                                          asker=req.member if req.moved else "")
        return pb.ResolveReply(outcome=OUTCOME[outcome], version=version, view_epoch=epoch, skipped=skipped)

    @_unary("Rank")
    async def Rank(self, req: pb.RankRequest, context) -> pb.RankReply:
        self._check_job(context, req.job, relay_role=True)
        info = await self.tier.rank(check_name(req.job), req.member, req.incarnation,
                                    req.requested_rank if req.HasField("requested_rank") else None, req.release)
        return rank_to_pb(info)

    @_unary("Lease")
    async def Lease(self, req: pb.LeaseRequest, context) -> pb.LeaseReply:
        self._check_job(context, req.job, relay_role=True)
        grant = await self.tier.lease(check_name(req.job), req.member, req.incarnation, dataset_from_pb(req.dataset),
                                      req.epoch, req.want, shards_from_pb(req.held))
        return grant_to_pb(grant)

    async def Follow(self, request_iterator, context):
        """A standby root follows this root's log (``ps.tiers.replication``): LogEntry frames out,
        its acknowledgements in."""
        forwarded = FORWARDED.set(_tokens(context))
        reader, follower = LogReader(), None
        it = request_iterator.__aiter__()
        try:
            self.guard.check_admin(_tokens(context), "follow this root's log")
            if self.relay:
                raise BadInput("only a root has a log to follow; point --standby-of at the primary root")
            first = None
            while first is None:
                first = reader.feed(await it.__anext__())
            if first.kind != "follow":
                raise BadInput(f"a follow stream starts with FOLLOW, got {first.kind.upper()}")
            follower = self.tier.follow(first.term, first.data.decode(errors="replace")[:256])  # type: ignore[attr-defined]
        except StopAsyncIteration:
            return
        except Exception as exc:
            await refuse(context, "Follow", exc, self.rpc)
        finally:
            FORWARDED.reset(forwarded)

        async def acks() -> None:
            try:
                async for data in it:
                    m = reader.feed(data)
                    if m is not None and m.kind == "ack":
                        follower.acked(m.seq)
            except Exception:  # a cut stream: the follower is dropped below
                pass
            finally:
                follower.close("the standby's stream ended")

        task = asyncio.create_task(acks())
        try:
            while (m := await follower.next()) is not None:
                for frame in encode_log(m):
                    yield frame
        finally:
            task.cancel()
            self.tier.replication.detach(follower, "the follow stream closed")  # type: ignore[attr-defined]

    @_unary("Promote")
    async def Promote(self, req: pb.PromoteRequest, context) -> pb.PromoteReply:
        self.guard.check_admin(_tokens(context), "promote a standby root")
        if self.relay:
            raise BadInput("only a standby root can be promoted")
        term = await self.tier.promote("asked to (hps promote)", force=req.force)  # type: ignore[attr-defined]
        return pb.PromoteReply(term=term)

    @_unary("Status")
    async def Status(self, req: pb.StatusRequest, context) -> pb.StatusReply:
        scope = self.guard.status_scope(_tokens(context))  # None: every job and the tree
        reply = status_to_pb(self.tier.status())
        if scope is not None:
            mine = [j for j in reply.jobs if j.name in scope]
            del reply.jobs[:]
            reply.jobs.extend(mine)
            del reply.children[:]
        reply.tokens_required = self.guard.enabled
        return reply


def handler(tier: Tier, rpc=NO_RPC_METRICS, guard: Guard | None = None) -> grpc.GenericRpcHandler:
    """``guard``: the tier's credentials (None: no admin token, every call accepted)."""
    servicer = _Servicer(tier, rpc, guard)
    handlers = {}
    for name, (kind, _req, resp) in METHODS.items():
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[name] = make(getattr(servicer, name), request_deserializer=None,
                              response_serializer=resp.SerializeToString if resp else None)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
