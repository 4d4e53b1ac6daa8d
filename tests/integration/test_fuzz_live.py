"""A bounded request fuzzer against live tiers: a root and a zone below it, as processes.

    .venv/bin/python -m pytest -q tests/integration/test_fuzz_live.py

The zone serves a real job ("real", bsp) with two workers that trained a few steps. Two more
jobs are the fuzzer's own: "fz" at the zone and "fzr" at the root, each with one worker whose
identity the fuzzer may use, so that hostile pushes get past the membership check into the
tiers' decoding, budgets, rounds, forwarding and optimizer. After a warm-up batch (so lazily
allocated buffers exist), 10,000 requests built from a fixed seed go to the two tiers over
every RPC of the service and the gRPC health check: random bytes, protobuf messages with
hostile field values (boundary numbers, 1 MiB strings, unknown enum values, other jobs' and
members' names, wrong incarnations), and Push / CreateJob streams made by the real encoders,
then mutated (bytes flipped, frames dropped, duplicated, reordered, cut, the end marker lost or
forged, NaN/Inf and 3.4e38 payloads, contributors near 2**32, keys of the wrong shape, huge
declared element counts), or valid but for one field.

Nothing may answer UNKNOWN or INTERNAL, calls that never wait may not time out, and the tiers
may log no bug (ERROR or CRITICAL); the real job's version, checksum, members and open round
are unchanged at both tiers; each tier's RSS and open file descriptors are back within 10% of
the post-warm-up baseline; afterwards the real workers train two more steps, every tier holds
the root's view bit for bit, and neither fuzz job is wedged (a fresh member trains a step).

The fuzzer never legitimately changes the real job, nor takes over a registration it does not
own: it does not end a job under test, let a real member leave, register as a member that is
not its own, or push as one (all correct behaviour, not bugs). Everything else is fair.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from ps.core.codecs import CODEC_NAMES, get_codec
from ps.core.config import JobConfig, OptimizerConfig, check_member
from ps.core.errors import BadInput, HpsError
from ps.core.tensors import Chunk, assemble, split
from ps.core.types import PushKey, PushMeta
from ps.core.view import KeySpec, Layout
from ps.net.messages import ROLE_NAME
from ps.net.rpc import CHANNEL_OPTIONS, Caller
from ps.net.wire import (
    METHODS,
    SERVICE,
    decode_frame,
    decode_pull_reply,
    encode_create_job,
    encode_frame,
    encode_push,
    pb,
)
from ps.server.service import parse
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status
from tests._hostile import (
    flip,
    hostile_float,
    hostile_int,
    hostile_message,
    hostile_str,
    mutate_frame_header,
    mutate_stream,
    restamp,
)
from tests.helpers import bsp_rounds
from worker import ParameterClient

pytestmark = pytest.mark.timeout(180)

SEED = 20261124
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
REQUESTS, WARMUP = 10_000, 1_000
THREADS = 6
WALL_LIMIT_S = 120.0  # for the 10,000; measured 12-16 s on 2 shared cores
REAL, FZ, FZR = "real", "fz", "fzr"  # the job under test; the fuzz's own at the zone and the root
REAL_LAYOUT = Layout([KeySpec("w", (32, 8)), KeySpec("b", (8,)), KeySpec("emb", (16, 4))])
FZ_LAYOUT = Layout([KeySpec("w", (16, 4)), KeySpec("b", (4,))])
MAX_JOB_PARAMS = 1 << 22
# member_timeout well above any stall the fuzz load can cause the real workers' heartbeats.
# max_job_params bounds what one CreateJob header makes a tier allocate (4 bytes per declared
# parameter, before any value arrives; under hps launch's malloc settings reused heap is then
# zeroed, i.e. touched): with the default 2**31, each tier would go to 8 GiB on this shared
# machine. test_a_create_job_refused_at_its_first_value_... below keeps that issue in view.
SETTINGS = {"heartbeat_s": 0.5, "member_timeout_s": 10.0, "max_job_params": MAX_JOB_PARAMS,
            "push_budget_mb": 256, "max_jobs": 200, "unjoined_job_ttl_s": 5.0}
TOPOLOGY = {"host": "127.0.0.1", "settings": SETTINGS, "root": {"name": "root", "zones": [{"name": "z"}]}}
HEALTH = "/grpc.health.v1.Health/Check"
# Deadlines: calls that may legitimately wait (for a round, a version, a push's outcome, the
# parent) get a short one and may time out; the others must answer well within theirs.
MAY_WAIT = {"Push": 1.5, "Pull": 1.0, "Resolve": 1.5, "Register": 3.0, "CreateJob": 3.0}
NEVER_WAITS_S = 10.0
# Relative weights: the streamed methods reach the most code.
WEIGHTS = {"Push": 22, "CreateJob": 12, "Register": 9, "Pull": 8, "Heartbeat": 8, "Resolve": 7, "Leave": 6,
           "EndJob": 6, "Status": 5, "ListJobs": 5, "Health": 6}


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"process {pid} has no VmRSS (it exited)")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class World:
    """What the fuzzer knows of the live cluster: addresses; every registration it must not
    take over (member -> incarnation, per tier and job); the fuzz identities whose pushes it
    may send as their owner would; the jobs' views."""

    def __init__(self, cluster: Cluster, real: list[ParameterClient], fz: ParameterClient,
                 fzr: ParameterClient) -> None:
        self.address = {name: cluster.address(name) for name in ("root", "z")}
        zone_epoch = fetch_status(self.address["z"]).server_epoch  # its incarnation at the root
        self.protected = {
            ("z", REAL): {c.worker_id: c.incarnation for c in real},
            ("z", FZ): {fz.worker_id: fz.incarnation},
            ("root", REAL): {"z": zone_epoch},
            ("root", FZ): {"z": zone_epoch},
            ("root", FZR): {fzr.worker_id: fzr.incarnation},
        }
        # The fuzz's own members: one worker per tier, alone in its job there (a root job for the
        # root, so that the zone's sequence numbers upstream are never the fuzz's to forge).
        self.identity = {"z": (FZ, fz.worker_id, fz.incarnation), "root": (FZR, fzr.worker_id, fzr.incarnation)}
        self.view = {c.job: (c.view.epoch, c.view.version) for c in (real[0], fz, fzr)}
        self.names = (REAL, FZ, FZR, "z", "root", fz.worker_id, fzr.worker_id, *[c.worker_id for c in real],
                      *(s.key for s in REAL_LAYOUT))
        self.acked: dict[str, int] = {}  # tier -> the highest sequence number of its fuzz identity applied
        self.round: dict[str, int] = {}  # tier -> the open round of its fuzz job

    def answered(self, tier: str, method: str, payload, code: str, reply: bytes | None) -> None:
        """Follow the fuzz identities' applied pushes, so near-valid ones take the next number
        and the next round."""
        if method == "Push" and code == "OK":
            p = decode_frame(payload[0])[0].push
            if (p.job, p.sender, p.incarnation) == self.identity[tier]:
                self.acked[tier] = max(self.acked.get(tier, 0), p.seq)
                applied = pb.PushAck.FromString(reply).applied_version
                self.round[tier] = max(self.round.get(tier, 0), applied)

    def follow(self) -> None:
        """The fuzz jobs' views and open rounds, as their tiers report them."""
        for tier, address in self.address.items():
            job = self.identity[tier][0]
            try:
                j = next(j for j in fetch_status(address).jobs if j.name == job)
            except (HpsError, StopIteration):
                continue
            self.view[job], self.round[tier] = (j.view_epoch, j.version), j.round

    def forbidden(self, tier: str, method: str, payload) -> str:
        """Why this request would legitimately change the real job or take a registration over
        (which would be correct behaviour, not a bug), or "" if it may be sent."""
        if method == "Push":
            try:
                header = decode_frame(payload[0])[0] if payload else None
            except BadInput:
                return ""
            if header is None or header.WhichOneof("kind") != "push":
                return ""
            p = header.push
            owner = self.protected.get((tier, p.job), {}).get(p.sender)
            if owner == p.incarnation and (p.job, p.sender, p.incarnation) != self.identity[tier]:
                return "a push as a member that is not the fuzz's own"
            return ""
        cls = METHODS[method][1] if method in METHODS else None  # the health check changes nothing
        if cls is None:
            return ""
        try:
            m = parse(cls, payload)
        except BadInput:  # the tier refuses it too
            return ""
        if method == "Register":
            valid = m.incarnation != 0 and m.role in ROLE_NAME and _is_member_id(m.member)
            if m.job == REAL and valid:
                return "joins (or re-registers in) the real job"
            known = self.protected.get((tier, m.job), {})
            own = (m.job, m.member, m.incarnation) == self.identity[tier]
            if valid and m.member in known and not own:
                # Another incarnation replaces the member (and the tiers then refuse the real one
                # as a second process on its id); the same one re-registers it with a last
                # sequence number of the fuzz's choosing. Either is impersonation, not a bug.
                return "registers as a member that is not the fuzz's own"
            if valid and m.job in (FZ, FZR) and m.member not in known:
                return "joins a fuzz job (its rounds would wait for the newcomer until it timed out)"
        if method == "Leave" and m.job == REAL and m.member in self.protected[(tier, REAL)]:
            return "a real member leaves"
        if method == "Leave" and (m.job, m.member) == self.identity[tier][:2]:
            return "the fuzz's own member leaves (its pushes would only be refused until it is back)"
        if method == "EndJob" and m.job in (REAL, FZ, FZR):
            return "ends a job under test"
        return ""


def _is_member_id(member: str) -> bool:
    try:
        check_member(member)
        return True
    except BadInput:
        return False


class Fuzzer:
    """Builds request ``i`` from its own seeded RNG (the same requests whatever the threads do)."""

    def __init__(self, world: World, seed: int) -> None:
        self.world, self.seed = world, seed

    def build(self, i: int) -> tuple[str, str, object, str]:
        """(tier, method, payload, what): payload is bytes (unary) or a list of frames."""
        rng = random.Random(f"{self.seed}:{i}")
        tier = "root" if i % 2 else "z"
        method = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        for _ in range(8):
            payload, what = getattr(self, f"_{method.lower()}")(rng, tier)
            if not self.world.forbidden(tier, method, payload):
                return tier, method, payload, what
        return tier, method, rng.randbytes(8) if method not in ("Push", "CreateJob") else [rng.randbytes(8)], "bytes"

    # -- unary ---------------------------------------------------------------------------
    def _unary(self, rng, cls, msg=None) -> tuple[bytes, str]:
        """A hostile message of ``cls`` (or ``msg``), serialised; sometimes damaged or random."""
        r = rng.random()
        if r < 0.12:
            return rng.randbytes(rng.choice((0, 1, 7, 64, 1024))), "random bytes"
        msg = msg if msg is not None else hostile_message(cls, rng, self.world.names)
        data = msg.SerializeToString()
        if r < 0.25:
            return flip(data, rng, head_bias=len(data) or 1), "flipped"
        return data, _brief(msg)

    def _job(self, rng) -> str:
        return rng.choice((REAL, FZ, FZR, f"fz-{rng.randrange(40)}", hostile_str(rng, self.world.names)))

    def _member(self, rng, tier: str, job: str) -> str:
        known = list(self.world.protected.get((tier, job), {}))
        return rng.choice(known) if known and rng.random() < 0.6 else hostile_str(rng, self.world.names)

    def _incarnation(self, rng, tier: str, job: str, member: str) -> int:
        true = self.world.protected.get((tier, job), {}).get(member)
        if true is not None and rng.random() < 0.7:
            return true  # refused by World.forbidden unless it is the fuzz's own identity
        return hostile_int(rng, 0, U64)

    def _register(self, rng, tier):
        if rng.random() < 0.5:
            return self._unary(rng, pb.RegisterRequest)
        job = self._job(rng)
        member = self._member(rng, tier, job)
        req = pb.RegisterRequest(job=job, member=member, role=rng.choice((0, 1, 2, 3, 4, 4, 4, 99)),
                                 address=hostile_str(rng, self.world.names), last_seq=hostile_int(rng, 0, U64),
                                 incarnation=self._incarnation(rng, tier, job, member))
        if job == REAL:  # only ever refused: a valid registration would join the real job
            rng.choice((lambda: setattr(req, "incarnation", 0), lambda: setattr(req, "role", 99)))()
        return self._unary(rng, pb.RegisterRequest, req)

    def _heartbeat(self, rng, tier):
        if rng.random() < 0.5:
            return self._unary(rng, pb.HeartbeatRequest)
        job = self._job(rng)
        req = pb.HeartbeatRequest(member=self._member(rng, tier, job),
                                  jobs=[self._job(rng) for _ in range(rng.choice((0, 1, 3, 1001)))],
                                  server_epoch=hostile_int(rng, 0, U64), role=hostile_int(rng, 0, 5),
                                  address=rng.choice(("", "127.0.0.1:1", hostile_str(rng, self.world.names))))
        return self._unary(rng, pb.HeartbeatRequest, req)

    def _leave(self, rng, tier):
        job = self._job(rng)
        return self._unary(rng, pb.LeaveRequest, pb.LeaveRequest(job=job, member=self._member(rng, tier, job)))

    def _pull(self, rng, tier):
        if rng.random() < 0.4:
            return self._unary(rng, pb.PullRequest)
        job = self._job(rng)
        epoch, version = self.world.view.get(job, (0, 0))
        req = pb.PullRequest(job=job, member=self._member(rng, tier, job),
                             view_epoch=rng.choice((0, epoch, epoch, hostile_int(rng, 0, U64))),
                             since_version=rng.choice((version, 0, hostile_int(rng, 0, U64))),
                             min_version=rng.choice((0, version, version + 1, hostile_int(rng, 0, U64))),
                             wait_ms=rng.choice((0, 0, 50, 300, U32)),
                             min_clock=rng.choice((0, 0, hostile_int(rng, 0, U64))))
        return self._unary(rng, pb.PullRequest, req)

    def _resolve(self, rng, tier):
        if rng.random() < 0.4:
            return self._unary(rng, pb.ResolveRequest)
        job = self._job(rng)
        keys = [pb.PushKey(member=self._member(rng, tier, job), incarnation=hostile_int(rng, 0, U64),
                           seq=hostile_int(rng, 0, U64), digest=rng.randbytes(rng.choice((0, 16, 17))))
                for _ in range(rng.choice((0, 1, 2, 5)))]
        req = pb.ResolveRequest(job=job, member=hostile_str(rng, self.world.names), keys=keys,
                                wait_ms=rng.choice((0, 10, 200, U32)))
        return self._unary(rng, pb.ResolveRequest, req)

    def _endjob(self, rng, tier):
        return self._unary(rng, pb.EndJobRequest, pb.EndJobRequest(job=self._job(rng)) if rng.random() < 0.6 else None)

    def _status(self, rng, tier):
        return self._unary(rng, pb.StatusRequest)

    def _listjobs(self, rng, tier):
        return self._unary(rng, pb.ListJobsRequest)

    def _health(self, rng, tier):
        msg = health_pb2.HealthCheckRequest(service=rng.choice(("", "hps.liveness", SERVICE,
                                                                hostile_str(rng, self.world.names))))
        return self._unary(rng, health_pb2.HealthCheckRequest, msg)

    # -- streamed ------------------------------------------------------------------------
    def _chunks(self, rng, layout: Layout) -> list:
        grad = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(layout.numel).astype(np.float32)
        r = rng.random()
        if r < 0.15:
            grad[rng.randrange(layout.numel)] = rng.choice((np.nan, np.inf, -np.inf))
        elif r < 0.3:
            grad[:] = rng.choice((3.4e38, -3.4e38, 1e-45))  # sums and steps that overflow
        codec = rng.choice(CODEC_NAMES[:-1])  # rows goes by key, below
        rows = frozenset({"emb"}) if "emb" in {s.key for s in layout} and rng.random() < 0.3 else frozenset()
        return split(layout, grad, get_codec(codec), chunk_elems=rng.choice((16, 64, 1 << 20)), rows=rows)

    def _mutated(self, rng, frames: list[bytes]) -> tuple[list[bytes], str]:
        """Mutations of a stream; most are then stamped with a matching end marker, so their
        hostile content reaches the tier's own checks instead of the digest check."""
        what = []
        if rng.random() < 0.3:  # hostile numbers in a chunk frame's header (numel, offset, ...)
            body = [i for i in range(1, len(frames) - 1)]
            if body:
                i = rng.choice(body)
                frames = list(frames)
                frames[i], where = mutate_frame_header(frames[i], rng, self.world.names)
                what.append(where)
        if rng.random() < 0.4:
            frames, ops = mutate_stream(frames, rng, self.world.names)
            what.append(ops)
        if what and rng.random() < 0.7 and frames:
            end = frames[-1]
            try:
                is_end = decode_frame(end)[0].WhichOneof("kind") == "end"
            except BadInput:
                is_end = False
            frames = restamp(frames[:-1] if is_end else frames)
            what.append("restamped")
        return frames, ", ".join(what) or "as encoded"

    def _push(self, rng, tier):
        r = rng.random()
        if r < 0.08:
            return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 3))], "random frames"
        if r < 0.55:
            return self._near_valid_push(rng, tier)
        job = rng.choice((self.world.identity[tier][0], FZ, REAL, REAL, hostile_str(rng, self.world.names)))
        layout = (REAL_LAYOUT if job == REAL else FZ_LAYOUT) if rng.random() < 0.85 else \
            (FZ_LAYOUT if job == REAL else REAL_LAYOUT)  # keys of another job's shape
        sender = self._member(rng, tier, job)
        incarnation = self._incarnation(rng, tier, job, sender)
        epoch, version = self.world.view.get(job, (0, 0))
        contributors = rng.choice((1, 1, 1, 1, 0, 2, (1 << 24), (1 << 24) + 1, U32))
        sources = () if rng.random() < 0.8 else tuple(
            PushKey(hostile_str(rng, self.world.names), hostile_int(rng, 0, U64),
                    hostile_int(rng, 0, U64), rng.randbytes(16)) for _ in range(rng.randint(1, 3)))
        meta = PushMeta(job, sender, rng.choice((1, 1, 2, 3, 5, 17, 0, hostile_int(rng, 0, U64))),
                        rng.choice((version, version, 0, hostile_int(rng, 0, U64))),
                        rng.choice((epoch, epoch, 0, hostile_int(rng, 0, U64))), contributors,
                        hostile_int(rng, 0, 20), hostile_int(rng, 0, 20), hostile_int(rng, 0, U64),
                        hostile_float(rng), hostile_int(rng, 0, U32), hostile_float(rng),
                        hostile_int(rng, 0, U32), incarnation, sources)
        chunks = self._chunks(rng, layout) if contributors or rng.random() < 0.3 else []
        frames, what = self._mutated(rng, encode_push(meta, chunks))
        return frames, f"{job!r:.20} from {sender!r:.20} seq {meta.seq} contributors {contributors}: {what}"

    def _near_valid_push(self, rng, tier):
        """A push of the fuzz's own worker at this tier, as that worker would send it on the open
        round, or with one thing wrong: a header field, a chunk's header, the stream."""
        job, sender, incarnation = self.world.identity[tier]
        epoch, version = self.world.view[job]
        version = self.world.round.get(tier, version)  # the round open there, if known
        clock = rng.randint(0, 20)
        seq = self.world.acked.get(tier, 0) + rng.choice((1, 1, 1, 2, 0))  # 0: a retry
        meta = PushMeta(job, sender, min(max(1, seq), U64), version, epoch, 1, clock, clock, clock + 1,
                        incarnation=incarnation)
        wrong = rng.choice(("nothing", "header", "header", "chunk", "stream"))
        if wrong == "header":
            field, value = rng.choice((
                ("seq", hostile_int(rng, 0, U64)), ("base_version", hostile_int(rng, 0, U64)),
                ("view_epoch", hostile_int(rng, 0, U64)), ("contributors", hostile_int(rng, 0, U32)),
                ("clock_min", hostile_int(rng, 0, U64)), ("clock_max", hostile_int(rng, 0, U64)),
                ("clock_floor", hostile_int(rng, 0, U64)), ("loss_sum", hostile_float(rng)),
                ("loss_count", hostile_int(rng, 0, U32)), ("step_seconds_sum", hostile_float(rng)),
                ("workers", hostile_int(rng, 0, U32)), ("incarnation", hostile_int(rng, 0, U64)),
                ("sources", (PushKey(hostile_str(rng, self.world.names), hostile_int(rng, 0, U64),
                                     hostile_int(rng, 0, U64), rng.randbytes(16)),))))
            meta = replace(meta, **{field: value})
        frames = encode_push(meta, self._chunks(rng, FZ_LAYOUT) if meta.contributors else [])
        what = f"{job} push {meta.seq} on {meta.base_version}"
        if wrong == "header":
            what += f", {field}={value!r:.40}"
        elif wrong == "chunk" and len(frames) > 2:
            i = rng.randrange(1, len(frames) - 1)
            frames[i], where = mutate_frame_header(frames[i], rng, self.world.names)
            frames = restamp(frames[:-1])
            what += f", {where}"
        elif wrong == "stream":
            frames, ops = mutate_stream(frames, rng, self.world.names)
            what += f", {ops}"
        return frames, what

    def _createjob(self, rng, tier):
        if rng.random() < 0.08:
            return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 3))], "random frames"
        name = rng.choice((f"fz-{rng.randrange(40)}", f"fz-{rng.randrange(40)}", REAL, FZ,
                           hostile_str(rng, self.world.names)))
        r = rng.random()
        if r < 0.5:  # small and valid: it may well create a job (which the root reaps, unjoined)
            layout = Layout([KeySpec(f"k{i}", tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 2))))
                             for i in range(rng.randint(1, 3))])
        elif r < 0.7:
            layout = REAL_LAYOUT
        elif r < 0.85:  # huge: past the tier's bound, or just within it
            layout = Layout([KeySpec("k", (rng.choice((MAX_JOB_PARAMS, MAX_JOB_PARAMS + 1, 1 << 40)),))])
        else:
            layout = None
        if rng.random() < 0.6:
            cfg = JobConfig(name=name if _is_job_name(name) else "fz-0", mode=rng.choice(("bsp", "ssp", "async")),
                            optimizer=OptimizerConfig(lr=rng.choice((0.1, 1.0, 1e3))))
        else:
            cfg = name if _is_job_name(name) else "fz-1"
        values = []
        if layout is not None and layout.numel <= 4096:
            x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(layout.numel).astype(np.float32)
            codec = get_codec(rng.choice(("fp32", "fp32+zstd", "fp16")))
            values = split(layout, x, codec, chunk_elems=rng.choice((8, 4096)))
        if layout is not None and not values and rng.random() < 0.5:  # a first value for a huge key
            values = [Chunk("k", layout.specs[0].shape, "float32", 0, 4, "fp32", np.ones(4, np.float32).tobytes())]
        if isinstance(cfg, str) and layout is None:
            layout = FZ_LAYOUT  # a config-less, key-less creation is refused by the encoder itself
        frames = encode_create_job(cfg, layout, values)
        if rng.random() < 0.3:  # a hostile configuration in place of the one encoded
            header = pb.FrameHeader(job=pb.JobHeader(config=hostile_message(pb.JobConfig, rng, self.world.names),
                                                     keys=decode_frame(frames[0])[0].job.keys))
            frames = restamp([encode_frame(header)] + frames[1:-1])
        frames, what = self._mutated(rng, frames)
        n = layout.numel if layout is not None else 0
        return frames, f"job {name!r:.20} with {n} parameters: {what}"


def _is_job_name(name: str) -> bool:
    try:
        JobConfig(name=name)
        return True
    except BadInput:
        return False


def _brief(msg) -> str:
    text = " ".join(str(msg).split())
    return text if len(text) <= 160 else text[:159] + "…"


class Sender:
    """Raw calls with identity serialisers: the bytes go out exactly as built."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.calls = {"Health": self.channel.unary_unary(HEALTH)}
        for name, (kind, _, _) in METHODS.items():
            self.calls[name] = getattr(self.channel, kind)(f"/{SERVICE}/{name}")

    def send(self, method: str, payload) -> tuple[str, str, bytes | None]:
        """(status code name, details, reply bytes) of one call."""
        timeout = MAY_WAIT.get(method, NEVER_WAITS_S)
        reply = None
        try:
            if method in ("Push", "CreateJob"):
                reply = self.calls[method](iter(payload), timeout=timeout)
            elif method == "Pull":
                for _ in self.calls[method](payload, timeout=timeout):
                    pass
            else:
                reply = self.calls[method](payload, timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name, err.details() or "", None
        return "OK", "", reply

    def close(self) -> None:
        self.channel.close()


def _fuzz(world: World, seed: int, count: int, senders: dict[str, Sender]):
    """Send requests 0..count-1 from THREADS threads; returns (codes per (tier, method, code),
    offenders: UNKNOWN/INTERNAL answers and timeouts of calls that never wait, sent)."""
    fuzzer, lock = Fuzzer(world, seed), threading.Lock()
    codes: Counter = Counter()
    offenders: list[str] = []
    nxt = iter(range(count))
    deadline = time.monotonic() + WALL_LIMIT_S

    def work() -> int:
        sent = 0
        while time.monotonic() < deadline:
            with lock:
                i = next(nxt, None)
            if i is None:
                break
            tier, method, payload, what = fuzzer.build(i)
            code, details, reply = senders[tier].send(method, payload)
            world.answered(tier, method, payload, code, reply)
            sent += 1
            bad = code in ("UNKNOWN", "INTERNAL") or (code == "DEADLINE_EXCEEDED" and method not in MAY_WAIT)
            with lock:
                codes[(tier, method, code)] += 1
                if bad and len(offenders) < 20:
                    offenders.append(f"request {i} to {tier}: {method} {code} ({details[:300]!r}); request: {what}")
        return sent

    def follow(stop: threading.Event) -> None:  # near-valid pushes go to the open round
        while not stop.wait(0.3) and time.monotonic() < deadline:
            world.follow()

    stop = threading.Event()
    follower = threading.Thread(target=follow, args=(stop,), daemon=True)
    follower.start()
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            sent = sum(pool.map(lambda _: work(), range(THREADS)))
    finally:
        stop.set()
        follower.join(10)
    return codes, offenders, sent


def _table(codes: Counter) -> str:
    """Answers per method (both tiers together) and status code, as a text table."""
    names = sorted({c for _, _, c in codes})
    width = max(map(len, names)) + 2

    def row(label: str, pick) -> str:
        return f"{label:10s}" + "".join(f"{sum(v for k, v in codes.items() if pick(k, n)):{width}d}" for n in names)

    lines = [f"{'method':10s}" + "".join(f"{n:>{width}s}" for n in names)]
    lines += [row(m, lambda k, n, m=m: k[1] == m and k[2] == n) for m in WEIGHTS]
    lines.append(row("(all)", lambda k, n: k[2] == n))
    return "\n".join(lines)


def _real_state(world: World) -> dict:
    """What the fuzz must not change: the real job at each tier."""
    out = {}
    for tier, addr in world.address.items():
        j = next(j for j in fetch_status(addr).jobs if j.name == REAL)
        out[tier] = dict(version=j.version, checksum=j.checksum, epoch=j.view_epoch, round=j.round,
                         round_pushed=j.round_pushed, members=sorted(m.member for m in j.members))
    return out


def _logged_bugs(cluster: Cluster) -> list[str]:
    """ERROR and CRITICAL lines of the tiers' logs, each with what follows it (a traceback): the
    tiers log only bugs (an exception nobody mapped to a status, a round that failed to finish,
    a push applied twice) and disk failures (no disk here) at those levels."""
    out = []
    for name, t in cluster.tiers.items():
        lines = t.log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if " ERROR " in line or " CRITICAL " in line:
                out.append(f"{name}: " + "\n".join(lines[i:i + 12]))
    return out


def _resources(cluster: Cluster) -> dict:
    return {name: (_rss_kb(t.proc.pid), _fds(t.proc.pid)) for name, t in cluster.tiers.items()}


def _snapshot(address: str, member: str) -> tuple[int, bytes]:
    """(version, float32 bytes) of the real job's view at a tier, as a snapshot pull by one of
    its members (a read)."""
    with Caller(address) as rpc:
        frames = rpc.stream("Pull", pb.PullRequest(job=REAL, member=member), 10.0)
    meta, versions = decode_pull_reply(frames)
    vm, chunks = versions[0]
    assert meta.snapshot
    return vm.version, assemble(REAL_LAYOUT, chunks, what="snapshot", check_finite=False, require_all=True).tobytes()


def _grad(i: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * step + i).standard_normal(REAL_LAYOUT.numel).astype(np.float32)


def _still_trains(address: str, job: str, member: str) -> int:
    """A fresh member of a fuzzed job pushes a zero gradient and pulls: the version it made
    (once the members the fuzz registered have timed out, the round is its alone)."""
    c = ParameterClient(address, job, member, round_timeout_s=30.0, retry_s=30.0)
    try:
        c.register()
        c.pull()
        version, _ = c.push(np.zeros(FZ_LAYOUT.numel, np.float32))
        c.pull(min_version=version, wait_s=10.0)
        return version
    finally:
        c.close()


def test_ten_thousand_fuzzed_requests_change_nothing_leak_nothing_and_fail_with_sentences(tmp_path, capsys):
    with Cluster.start(TOPOLOGY, tmp_path / "logs") as cluster:
        zone, root = cluster.address("z"), cluster.address("root")
        real = [ParameterClient(zone, REAL, f"w{i}") for i in range(2)]
        fz, fzr = ParameterClient(zone, FZ, "fz0"), ParameterClient(root, FZR, "fzr0")
        senders, closed = {}, set()
        try:
            real[0].create_job(JobConfig(name=REAL, optimizer=OptimizerConfig(lr=0.1)), REAL_LAYOUT,
                               np.linspace(-1, 1, REAL_LAYOUT.numel, dtype=np.float32))
            for c in (fz, fzr):  # lr 10: a 3.4e38 gradient makes a step non-finite
                c.create_job(JobConfig(name=c.job, optimizer=OptimizerConfig(lr=10.0)), FZ_LAYOUT,
                             np.zeros(FZ_LAYOUT.numel, np.float32))
            for c in (*real, fz, fzr):
                c.register()
                c.pull()
            bsp_rounds(real, 3, _grad)
            world = World(cluster, real, fz, fzr)
            senders = {tier: Sender(addr) for tier, addr in world.address.items()}

            _, warm_offenders, _ = _fuzz(world, SEED + 1, WARMUP, senders)  # lazy buffers, caches
            time.sleep(2.0)
            state, base = _real_state(world), _resources(cluster)
            t0 = time.monotonic()
            codes, offenders, sent = _fuzz(world, SEED, REQUESTS, senders)
            took = time.monotonic() - t0
            time.sleep(3.0)  # let timed-out calls and their connections wind down
            after, used = _real_state(world), _resources(cluster)

            with capsys.disabled():
                print(f"\n{sent} fuzzed requests in {took:.1f}s (root and zone together), status codes:\n"
                      f"{_table(codes)}\n" + "\n".join(
                          f"{t}: RSS {base[t][0] / 1024:.1f} -> {used[t][0] / 1024:.1f} MiB, "
                          f"fds {base[t][1]} -> {used[t][1]}" for t in base))
            offenders = warm_offenders + offenders
            assert not offenders, "answers that are bugs (the first ones):\n" + "\n".join(offenders)
            bugs = _logged_bugs(cluster)
            assert not bugs, f"the tiers logged {len(bugs)} bugs; the first:\n{bugs[0]}"
            assert sent == REQUESTS, f"only {sent} of {REQUESTS} requests went out within {WALL_LIMIT_S:.0f}s"
            assert after == state, f"the fuzz changed the real job: {state} -> {after}"
            for t in base:
                (rss0, fd0), (rss1, fd1) = base[t], used[t]
                assert rss1 <= rss0 * 1.10, f"{t}: RSS grew from {rss0} to {rss1} kB"
                # Absolute slack on top of 10%: gRPC connections (the real clients', the zone's
                # to the root, a status call's) and their event fds come and go, a few at a time.
                assert fd1 <= fd0 * 1.10 + 4, f"{t}: open fds grew from {fd0} to {fd1}"

            bsp_rounds(real, 2, lambda i, s: _grad(i, s + 3))
            version = state["root"]["version"] + 2
            root_view = _snapshot(root, "z")
            assert root_view[0] == version
            assert _snapshot(zone, "w0") == root_view, "the zone does not hold the root's view"
            for c in real:
                assert (c.view.version, c.view.values.tobytes()) == root_view, f"{c.worker_id}'s view differs"

            # No fuzzed job is wedged: their own members leave (the fuzz used up their sequence
            # numbers) and a fresh one trains a step at each tier.
            for c in (fz, fzr):
                c.close()
                closed.add(c)
            for address, job in ((zone, FZ), (root, FZR)):
                try:
                    _still_trains(address, job, "fresh")
                except HpsError as exc:
                    raise AssertionError(f"job {job} no longer trains after the fuzz: {exc}") from None
        finally:
            for s in senders.values():
                s.close()
            for c in (*real, fz, fzr):
                if c not in closed:
                    c.close()


def test_a_create_job_refused_at_its_first_value_costs_no_memory_for_the_parameters_it_declared(tmp_path):
    """Found while fuzzing (it is why the fuzz above bounds --max-job-params): a CreateJob
    stream of a JobHeader declaring N parameters followed by one garbage frame -- about 100
    bytes, refused INVALID_ARGUMENT -- makes a tier allocate its 4N-byte Assembler when the
    header arrives, before any value. Under hps launch's malloc settings (no trimming, no mmap)
    calloc then zeroes reused heap, so from the second such request on the tier touches all 4N
    bytes and keeps them: with the default --max-job-params 2**31, 8 GiB per tier for a request
    anyone can send. Measured here at 2**27 (512 MiB). Not fixed yet: see the fuzz report."""
    declared = 1 << 27
    topo = {"host": "127.0.0.1", "settings": {"max_job_params": declared}, "root": {"name": "root"}}
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        pid, sender = cluster.tiers["root"].proc.pid, Sender(cluster.address("root"))

        def refused(numel: int) -> None:
            header = encode_create_job(JobConfig(name="big"), Layout([KeySpec("k", (numel,))]), [])[0]
            with pytest.raises(grpc.RpcError) as err:  # a long deadline: zeroing 512 MiB takes a while
                sender.calls["CreateJob"](iter([header, b"\x0a\x00"]), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        try:
            refused(1024)  # the code paths, warm
            before = _rss_kb(pid)
            for _ in range(3):
                refused(declared)
            grown = (_rss_kb(pid) - before) / 1024
        finally:
            sender.close()
        assert grown < 64, (f"three refused ~100-byte CreateJobs declaring {declared} parameters raised "
                            f"the root's RSS by {grown:.0f} MiB")
