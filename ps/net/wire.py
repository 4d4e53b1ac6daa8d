"""The only place generated protobuf meets domain types, streamed half: pushes, pull replies,
job creations and a standby's log, as frames; the method table.

>>> import numpy as np
>>> from ps.core.codecs import get_codec
>>> from ps.core.tensors import split
>>> from ps.core.view import KeySpec
>>> chunks = split(Layout([KeySpec("w", (3,))]), np.ones(3, np.float32), get_codec("fp32"))
>>> frames = encode_push(PushMeta(job="lm", sender="w0", seq=1, base_version=0), chunks)
>>> len(frames)                                  # header, one chunk batch, end marker
3
>>> meta, got, digest = decode_push(frames)      # BadInput if malformed or cut
>>> meta.sender, meta.seq, [(c.key, c.numel) for c in got]
('w0', 1, [('w', 3)])
>>> type(got[0].payload).__name__, len(digest)   # zero-copy slices; the body's XXH3-128
('memoryview', 16)

How a message is cut into frames, and how a streamed body proves it is whole, is
``ps.net.frames``; the unary messages (jobs, ranks, leases, status) and the enum tables are
``ps.net.messages``; this module says what the frames carry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from ps.core.config import JobConfig
from ps.core.errors import BadInput, short
from ps.core.types import LOG_KINDS, Chunk, LogMessage, PullMeta, PushKey, PushMeta, StepInfo, VersionMeta
from ps.core.view import Layout
from ps.net.frames import MAX_FRAME_PAYLOAD, BodyReader, as_resend, decode_frame, encode_frame, with_end
from ps.net.messages import CODEC, DTYPE, job_from_pb, job_to_pb, layout_from_pb, layout_to_pb, name_of
from ps.net.proto import hps_pb2 as pb

__all__ = [
    "pb", "encode_push", "as_resend", "encode_push_head", "encode_push_tail", "with_tail", "chunk_frames", "framed",
    "decode_push", "push_meta_of", "chunks_of", "keys_to_pb", "keys_from_pb", "step_to_pb", "step_from_pb",
    "push_digest", "encode_pull_reply", "decode_pull_reply", "encode_create_job", "decode_create_job", "create_job_of",
    "adopted_token", "METHODS", "SERVICE", "RELAY_READY", "stubs", "encode_log", "LogReader",
]


def chunk_frames(chunks: Iterable[Chunk]) -> Iterator[bytes]:
    """Pack chunks into frames of at most MAX_FRAME_PAYLOAD payload bytes each.

    Chunks that are the whole of a frame this process received (``chunks_of``'s zero-copy
    slices: a relay serving the deltas it pulled) go out as that very frame, uncopied: a zone
    no longer re-frames each 400 MB version once per child that pulls it.
    """
    batch: list[Chunk] = []
    size = 0
    chunks = list(chunks)
    i = 0
    while i < len(chunks):
        frame, n = _received_frame(chunks, i)
        if frame is not None:
            if batch:
                yield _batch_frame(batch)
                batch, size = [], 0
            yield frame
            i += n
            continue
        c = chunks[i]
        if batch and size + len(c.payload) > MAX_FRAME_PAYLOAD:
            yield _batch_frame(batch)
            batch, size = [], 0
        batch.append(c)
        size += len(c.payload)
        i += 1
    if batch:
        yield _batch_frame(batch)


def framed(chunks: Iterable[Chunk]) -> list[Chunk]:
    """``chunks`` framed now, as ``chunk_frames`` frames them, and given back as zero-copy
    slices of those frames: whoever serves them later sends the frames themselves (a tier
    that publishes a version once and serves it to every child that pulls it)."""
    out: list[Chunk] = []
    for frame in chunk_frames(chunks):
        h, payload = decode_frame(frame)
        out.extend(chunks_of(h.chunks, payload))
    return out


def _received_frame(chunks: list[Chunk], i: int) -> tuple[bytes | None, int]:
    """(the received frame, how many chunks it carries) when ``chunks[i:]`` begins with every
    chunk of one frame, in order, as ``chunks_of`` sliced them from it; else (None, 0)."""
    p = chunks[i].payload
    frame = p.obj if isinstance(p, memoryview) else None
    if not isinstance(frame, bytes):
        return None, 0
    try:
        h, payload = decode_frame(frame)
    except BadInput:
        return None, 0
    carried = h.chunks.chunks if h.WhichOneof("kind") == "chunks" else ()
    group = chunks[i:i + len(carried)]
    if not carried or len(group) != len(carried):
        return None, 0
    pos = len(frame) - len(payload)  # where the payload starts in the frame
    for tc, c in zip(carried, group, strict=True):
        view = c.payload
        if not (isinstance(view, memoryview) and view.obj is frame and view.nbytes == tc.nbytes
                and _address(view) == _address(memoryview(frame)) + pos
                and (c.key, c.offset, c.numel, tuple(c.shape)) == (tc.key, tc.offset, tc.numel, tuple(tc.shape))
                and DTYPE.get(c.dtype) == tc.dtype and CODEC.get(c.codec) == tc.codec):
            return None, 0
        pos += tc.nbytes
    return frame, len(carried)


def _address(view: memoryview) -> int:
    """Where a byte view's memory starts (to tell which slice of a frame a chunk is)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else -1


def _batch_frame(batch: list[Chunk]) -> bytes:
    h = pb.FrameHeader(chunks=pb.ChunkBatch(chunks=[
        pb.TensorChunk(key=c.key, dtype=DTYPE[c.dtype], shape=c.shape, offset=c.offset, numel=c.numel,
                       codec=CODEC[c.codec], nbytes=len(c.payload)) for c in batch]))
    return encode_frame(h, [c.payload for c in batch])  # one copy: header and payloads joined at once


def chunks_of(h: pb.ChunkBatch, payload: memoryview) -> list[Chunk]:
    """The chunks a frame carries; their payloads are zero-copy slices of ``payload``."""
    if not h.chunks:
        raise BadInput("malformed frame: a chunk batch with no chunks")
    out, pos = [], 0
    for c in h.chunks:
        if pos + c.nbytes > len(payload):
            raise BadInput(f"malformed frame: chunk of key {short(c.key)} claims {c.nbytes} bytes past "
                           f"the {len(payload)}-byte payload")
        out.append(Chunk(c.key, tuple(c.shape), name_of(DTYPE, c.dtype, "dtype"), c.offset, c.numel,
                         name_of(CODEC, c.codec, "codec"), payload[pos:pos + c.nbytes]))
        pos += c.nbytes
    if pos != len(payload):
        raise BadInput(f"malformed frame: chunks account for {pos} of {len(payload)} payload bytes")
    return out


# ---- pushes ----------------------------------------------------------------------------

def keys_to_pb(keys: Iterable[PushKey]) -> list[pb.PushKey]:
    return [pb.PushKey(member=k.member, incarnation=k.incarnation, seq=k.seq, digest=k.digest) for k in keys]


def keys_from_pb(keys: Iterable[pb.PushKey]) -> tuple[PushKey, ...]:
    return tuple(PushKey(k.member, k.incarnation, k.seq, bytes(k.digest)) for k in keys)


# Bounds on a push's step information, checked as it is decoded (a header is at most a frame).
MAX_HPARAMS = 1024
MAX_PROGRESS = 4096
_HPARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")


def step_to_pb(step: StepInfo) -> pb.StepInfo | None:
    if step.empty:
        return None
    return pb.StepInfo(hparams=[pb.HParam(group=g, name=n, value=v) for g, n, v in step.hparams],
                       absent=step.absent, skip=step.skip, buffers=step.buffers,
                       progress=[pb.ShardProgress(epoch=e, shard=s, end=n) for e, s, n in step.progress],
                       inner_rate=step.inner_rate)


def step_from_pb(m: pb.StepInfo) -> StepInfo:
    """A push's step information, or BadInput naming what is wrong with it."""
    if len(m.hparams) > MAX_HPARAMS or len(m.progress) > MAX_PROGRESS:
        raise BadInput(f"a push's step carries {len(m.hparams)} hyperparameters and {len(m.progress)} shard "
                       f"progress entries; at most {MAX_HPARAMS} and {MAX_PROGRESS}")
    hparams = []
    for h in m.hparams:
        if not _HPARAM_NAME.match(h.name) or not math.isfinite(h.value):
            raise BadInput(f"hyperparameter {short(h.name)}={h.value!r} of group {h.group}: names are "
                           "identifiers of at most 32 characters, values finite numbers")
        hparams.append((h.group, h.name, h.value))
    if len(set((g, n) for g, n, _ in hparams)) != len(hparams):
        raise BadInput("a push's step names one hyperparameter of a group twice")
    absent = tuple(m.absent)
    if list(absent) != sorted(set(absent)):
        raise BadInput("a push's absent keys must be increasing key indices")
    if not (math.isfinite(m.inner_rate) and m.inner_rate >= 0):
        raise BadInput(f"a push's inner_rate must be a finite number >= 0, got {m.inner_rate!r}")
    return StepInfo(tuple(hparams), absent, m.skip, m.buffers,
                    tuple((p.epoch, p.shard, p.end) for p in m.progress), m.inner_rate)


def encode_push(meta: PushMeta, chunks: Iterable[Chunk]) -> list[bytes]:
    """A whole push: header frame, chunk frames, and the end marker that digests them."""
    return with_end([encode_push_head(meta), *chunk_frames(chunks)])


def push_digest(frames: list[bytes]) -> bytes:
    """The digest an encoded push's end marker carries: what the receiving tier's books know
    the push by (a sender asks the root about a push by it)."""
    return bytes(decode_frame(frames[-1])[0].end.digest)


def encode_push_head(meta: PushMeta) -> bytes:
    """A push's header frame (a streamed push sends it before its gradient is complete)."""
    fields = {k: v for k, v in meta.__dict__.items() if k not in ("sources", "step")}
    return encode_frame(pb.FrameHeader(push=pb.PushHeader(**fields, sources=keys_to_pb(meta.sources),
                                                          step=step_to_pb(meta.step))))


def encode_push_tail(meta: PushMeta) -> bytes:
    """A streamed push's tail frame: the fields of ``meta`` known only once its gradient is."""
    return encode_frame(pb.FrameHeader(tail=pb.PushTail(
        loss_sum=meta.loss_sum, loss_count=meta.loss_count, step_seconds_sum=meta.step_seconds_sum,
        step=step_to_pb(meta.step))))


def with_tail(meta: PushMeta, h: pb.FrameHeader) -> PushMeta:
    """``meta`` with the late fields of a push's tail frame ``h``."""
    t = h.tail
    return replace(meta, loss_sum=t.loss_sum, loss_count=t.loss_count, step_seconds_sum=t.step_seconds_sum,
                   step=step_from_pb(t.step) if t.HasField("step") else StepInfo())


def push_meta_of(h: pb.FrameHeader) -> PushMeta:
    p = h.push
    return PushMeta(p.job, p.sender, p.seq, p.base_version, p.view_epoch, p.contributors,
                    p.clock_min, p.clock_max, p.clock_floor, p.loss_sum, p.loss_count,
                    p.step_seconds_sum, max(1, p.workers), p.incarnation, keys_from_pb(p.sources),
                    step_from_pb(p.step) if p.HasField("step") else StepInfo())


def decode_push(frames: Iterable[bytes]) -> tuple[PushMeta, list[Chunk], bytes]:
    """A whole push stream: (meta, chunks, digest); BadInput if malformed or cut."""
    reader, meta, chunks = BodyReader("push", "push", tail="tail"), None, []
    for data in frames:
        kind, h, payload = reader.feed(data)
        if kind == "push":
            meta = push_meta_of(h)
        elif kind == "chunks":
            chunks.extend(chunks_of(h.chunks, payload))
        elif kind == "tail":
            assert meta is not None  # the reader demands the header first
            meta = with_tail(meta, h)
    digest = reader.finish()
    assert meta is not None  # the reader demands the header first
    return meta, chunks, digest


def encode_pull_reply(meta: PullMeta, versions: Iterable[tuple[VersionMeta, Iterable[Chunk]]]
                      ) -> Iterator[bytes]:
    yield encode_frame(pb.FrameHeader(pull=pb.PullHeader(**meta.__dict__)))
    for vm, chunks in versions:
        yield encode_frame(pb.FrameHeader(version=pb.VersionHeader(**vm.__dict__)))
        yield from chunk_frames(chunks)


def decode_pull_reply(frames: Iterable[bytes]) -> tuple[PullMeta, list[tuple[VersionMeta, list[Chunk]]]]:
    meta: PullMeta | None = None
    versions: list[tuple[VersionMeta, list[Chunk]]] = []
    for i, data in enumerate(frames):
        h, payload = decode_frame(data)
        kind = h.WhichOneof("kind")
        if i == 0:
            if kind != "pull":
                raise BadInput(f"malformed pull reply: first frame is {kind!r}")
            meta = PullMeta(h.pull.view_epoch, h.pull.from_version, h.pull.to_version,
                            h.pull.snapshot, h.pull.server_epoch)
        elif kind == "version":
            v = h.version
            versions.append((VersionMeta(v.version, v.checksum, v.clock_min, v.contributors), []))
        elif kind == "chunks" and versions:
            versions[-1][1].extend(chunks_of(h.chunks, payload))
        else:
            raise BadInput(f"malformed pull reply: unexpected {kind!r} frame at position {i}")
    if meta is None:
        raise BadInput("malformed pull reply: empty stream")
    # What the header promises, whole: a snapshot is one version, the one it names; deltas run
    # from the caller's version to the one named, each once (a stream short of its end, or one
    # naming versions it does not carry, is not taken for the pull it claims to be).
    got = [vm.version for vm, _ in versions]
    if meta.snapshot:
        whole = got == [meta.to_version]
    else:
        whole = (meta.to_version - meta.from_version == len(got)
                 and all(v == meta.from_version + 1 + i for i, v in enumerate(got)))
    if not whole:
        raise BadInput(f"malformed pull reply: {'a snapshot' if meta.snapshot else 'deltas'} to version "
                       f"{meta.to_version} from {meta.from_version} carries versions {short(got)}")
    return meta, versions


# ---- Follow streams (a standby root following its primary's log) -------------------------

_LOG: dict[str, Any] = {k: i + 1 for i, k in enumerate(LOG_KINDS)}  # LogEntry.Kind values, in wire order
_LOG_NAME = {v: k for k, v in _LOG.items()}
assert set(_LOG.values()) == set(pb.LogEntry.Kind.values()) - {0}


def encode_log(msg: LogMessage) -> list[bytes]:
    """``msg`` as frames: its payload split at ``MAX_FRAME_PAYLOAD`` (no copy of the data)."""
    data = memoryview(msg.data)
    pieces = [data[i:i + MAX_FRAME_PAYLOAD] for i in range(0, len(data), MAX_FRAME_PAYLOAD)] or [data]
    return [encode_frame(pb.FrameHeader(log=pb.LogEntry(
        kind=_LOG[msg.kind], job=msg.job, version=msg.version, term=msg.term, epoch=msg.epoch, seq=msg.seq,
        more=i + 1 < len(pieces))), p) for i, p in enumerate(pieces)]


class LogReader:
    """Frames of a Follow stream back into ``LogMessage``s (``feed`` returns one when whole).

    >>> reader = LogReader()
    >>> [reader.feed(f) for f in encode_log(LogMessage("ack", job="lm", version=7, seq=3))]
    [LogMessage(kind='ack', job='lm', version=7, term=0, epoch=0, seq=3, data=b'')]
    """

    _LIMIT = 1 << 36  # a payload larger than this is refused (a checkpoint of 16 G parameters)

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> LogMessage | None:
        h, payload = decode_frame(data)
        if h.WhichOneof("kind") != "log" or h.log.kind not in _LOG_NAME:
            raise BadInput(f"a follow stream carries log entries, got a {h.WhichOneof('kind')} frame")
        e = h.log
        self._parts.append(bytes(payload))
        self._size += len(payload)
        if self._size > self._LIMIT:
            raise BadInput(f"a follow stream's message exceeds {self._LIMIT} bytes")
        if e.more:
            return None
        whole, self._parts, self._size = b"".join(self._parts), [], 0
        return LogMessage(_LOG_NAME[e.kind], e.job, e.version, e.term, e.epoch, e.seq, whole)


def encode_create_job(cfg: JobConfig | str, layout: Layout | None, chunks: Iterable[Chunk],
                      job_token: str = "") -> list[bytes]:
    """A job's creation: config (or just its name, to adopt a declared one), keys, initial values.

    No layout: declare the configuration only (`hps job create`). ``job_token``: a sharded job's
    token from its shard 0, for the other shards to take on (``adopted_token``).
    """
    config = job_to_pb(cfg) if isinstance(cfg, JobConfig) else pb.JobConfig(name=cfg)
    h = pb.FrameHeader(job=pb.JobHeader(config=config, keys=layout_to_pb(layout) if layout else [],
                                        job_token=job_token))
    return with_end([encode_frame(h), *chunk_frames(chunks)])


def adopted_token(h: pb.FrameHeader) -> str:
    """The job token a CreateJob header hands over (a sharded job's, minted by shard 0), or ""."""
    return h.job.job_token


def create_job_of(h: pb.FrameHeader) -> tuple[JobConfig | str, Layout | None]:
    """The configuration (or the name of a declared one) and the keys a CreateJob header names."""
    cfg = job_from_pb(h.job.config) or h.job.config.name
    layout = layout_from_pb(h.job.keys) if h.job.keys else None
    if layout is None and isinstance(cfg, str):
        raise BadInput(f"creating job {short(cfg)} needs a configuration, its parameters, or both")
    return cfg, layout


def decode_create_job(frames: Iterable[bytes]) -> tuple[JobConfig | str, Layout | None, list[Chunk]]:
    reader, head, chunks = BodyReader("job", "create-job stream"), None, []
    for data in frames:
        kind, h, payload = reader.feed(data)
        if kind == "job":
            head = create_job_of(h)
        elif kind == "chunks":
            chunks.extend(chunks_of(h.chunks, payload))
    reader.finish()
    assert head is not None
    cfg, layout = head
    if layout is None and chunks:
        raise BadInput(f"job {short(cfg if isinstance(cfg, str) else cfg.name)}: initial values "
                       "came without the keys they belong to")
    return cfg, layout, chunks


# ---- method table (shared by the server, the relays' async link and the worker) ----------

SERVICE = "hps.v1.ParameterServer"
# grpc.health.v1 service names beside readiness ("") and SERVICE (ps.server.health): a ready
# relay (NOT_FOUND at a root), what a relay on an alternate asks its first parent, tokenless.
RELAY_READY = "hps.relay"
_ident = None  # identity (de)serialiser: raw frames are passed as bytes
# name -> (cardinality, request serialiser, response deserialiser)
METHODS: dict[str, tuple[str, Any, Any]] = {
    "Register": ("unary_unary", pb.RegisterRequest, pb.RegisterReply),
    "Heartbeat": ("unary_unary", pb.HeartbeatRequest, pb.HeartbeatReply),
    "Leave": ("unary_unary", pb.LeaveRequest, pb.LeaveReply),
    "Push": ("stream_unary", _ident, pb.PushAck),
    "Pull": ("unary_stream", pb.PullRequest, _ident),
    "CreateJob": ("stream_unary", _ident, pb.CreateJobReply),
    "Status": ("unary_unary", pb.StatusRequest, pb.StatusReply),
    "ListJobs": ("unary_unary", pb.ListJobsRequest, pb.ListJobsReply),
    "EndJob": ("unary_unary", pb.EndJobRequest, pb.EndJobReply),
    "Resolve": ("unary_unary", pb.ResolveRequest, pb.ResolveReply),
    "Rank": ("unary_unary", pb.RankRequest, pb.RankReply),
    "Lease": ("unary_unary", pb.LeaseRequest, pb.LeaseReply),
    "Follow": ("stream_stream", _ident, _ident),
    "Promote": ("unary_unary", pb.PromoteRequest, pb.PromoteReply),
}


def stubs(channel: Any) -> dict[str, Any]:
    """Callables for every method on a grpc (sync or aio) channel."""
    out = {}
    for name, (kind, req, resp) in METHODS.items():
        out[name] = getattr(channel, kind)(
            f"/{SERVICE}/{name}",
            request_serializer=req.SerializeToString if req else None,
            response_deserializer=resp.FromString if resp else None)
    return out
