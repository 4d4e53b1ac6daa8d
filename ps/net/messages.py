"""The only place generated protobuf meets domain types, unary half: job configurations and
layouts, ranks and data leases, tier status, and the tables between the proto's enums and the
domain's names (the streamed frames are ``ps.net.wire``).

>>> from ps.core.config import JobConfig
>>> job_from_pb(job_to_pb(JobConfig(name="lm", mode="ssp", staleness=2))).staleness
2
>>> name_of(MODE, pb.MODE_ASYNC, "mode"), ROLE_NAME[pb.ROLE_ZONE]
('async', 'zone')
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields as dataclass_fields
from typing import Any

from ps.core.config import (
    CODEC_NAMES,
    MAX_GROUPS,
    MAX_OPTIONS,
    MAX_PATTERNS,
    MODES,
    OPTIMIZERS,
    JobConfig,
    OptimizerConfig,
    OuterConfig,
    ParamGroup,
    ShardingConfig,
)
from ps.core.errors import BadInput, short
from ps.core.leases import DONE, GRANTED, RENEWED, WAIT, Dataset, Grant
from ps.core.ranks import RankInfo
from ps.core.types import JobStats, JobStatus, MemberInfo, TierStatus
from ps.core.view import KEY_KINDS, KeySpec, Layout
from ps.net.proto import hps_pb2 as pb

__all__ = [
    "job_to_pb", "job_from_pb", "jobs_to_pb", "jobs_from_pb", "layout_to_pb", "layout_from_pb",
    "rank_to_pb", "rank_from_pb", "dataset_to_pb", "dataset_from_pb", "grant_to_pb", "grant_from_pb",
    "shards_to_pb", "shards_from_pb", "status_to_pb", "status_from_pb",
    "ROLE", "ROLE_NAME", "MODE", "OUTCOME", "OUTCOME_NAME", "CODEC", "DTYPE", "name_of",
]

# Enum tables; complete at import (every non-UNSPECIFIED value has a domain name).
_MODE = {"bsp": pb.MODE_BSP, "ssp": pb.MODE_SSP, "async": pb.MODE_ASYNC, "outer": pb.MODE_OUTER}
CODEC = {"fp32": pb.CODEC_FP32, "fp32+zstd": pb.CODEC_FP32_ZSTD, "fp16": pb.CODEC_FP16,
          "bf16": pb.CODEC_BF16, "int8": pb.CODEC_INT8, "topk": pb.CODEC_TOPK, "sign": pb.CODEC_SIGN,
          "rows": pb.CODEC_ROWS, "powersgd": pb.CODEC_POWERSGD, "int4": pb.CODEC_INT4}
_OPT = {"sgd": pb.OPTIMIZER_SGD, "adam": pb.OPTIMIZER_ADAM}
DTYPE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16,
          "float64": pb.DTYPE_FLOAT64}
ROLE = {"global": pb.ROLE_GLOBAL, "regional": pb.ROLE_REGIONAL, "zone": pb.ROLE_ZONE,
        "worker": pb.ROLE_WORKER}
ROLE_NAME = {v: k for k, v in ROLE.items()}
MODE = _MODE
# What became of a push (ps.tiers.tier.resolve's answers).
OUTCOME = {"applied": pb.OUTCOME_APPLIED, "not_applied": pb.OUTCOME_NOT_APPLIED, "unknown": pb.OUTCOME_UNKNOWN}
OUTCOME_NAME = {v: k for k, v in OUTCOME.items()}
# What a lease call answered (ps.core.leases).
_LEASE = {GRANTED: pb.LEASE_STATUS_GRANTED, WAIT: pb.LEASE_STATUS_WAIT, DONE: pb.LEASE_STATUS_DONE,
          RENEWED: pb.LEASE_STATUS_RENEWED}
for _table, _enum, _names in ((_MODE, pb.Mode, MODES), (CODEC, pb.Codec, CODEC_NAMES),
                              (_OPT, pb.OptimizerKind, OPTIMIZERS),
                              (DTYPE, pb.DType, ("float32", "float16", "bfloat16", "float64")),
                              (ROLE, pb.Role, tuple(ROLE)), (OUTCOME, pb.Outcome, tuple(OUTCOME)),
                              (_LEASE, pb.LeaseStatus, (GRANTED, WAIT, DONE, RENEWED))):
    assert set(_table.values()) == set(_enum.values()) - {0}, f"{_enum} has unmapped values"
    assert set(_table) == set(_names), f"{_names} and the proto disagree"
del _table, _enum, _names


def name_of(table: Mapping[str, int], value: int, what: str) -> str:
    for k, v in table.items():
        if v == value:
            return k
    raise BadInput(f"unknown {what} enum value {value}")


_KIND = {"param": pb.KEY_KIND_PARAM, "frozen": pb.KEY_KIND_FROZEN, "buffer": pb.KEY_KIND_BUFFER}
assert set(_KIND.values()) == set(pb.KeyKind.values()) and set(_KIND) == set(KEY_KINDS)


def layout_to_pb(layout: Layout) -> list[pb.KeySpec]:
    return [pb.KeySpec(key=s.key, dtype=DTYPE[s.dtype], shape=s.shape, kind=_KIND[s.kind]) for s in layout]


def layout_from_pb(keys: Iterable[pb.KeySpec]) -> Layout:
    return Layout([KeySpec(k.key, tuple(k.shape), name_of(DTYPE, k.dtype, "dtype"), name_of(_KIND, k.kind, "key kind"))
                   for k in keys])


# ---- jobs ---------------------------------------------------------------------------------

def _options_to_pb(options: Iterable[tuple[str, Any]]) -> list[pb.OptimizerOption]:
    out = []
    for name, value in options:
        if isinstance(value, bool):
            out.append(pb.OptimizerOption(name=name, flag=value))
        elif isinstance(value, int):
            out.append(pb.OptimizerOption(name=name, integer=value))
        elif isinstance(value, tuple):
            out.append(pb.OptimizerOption(name=name, reals=pb.Reals(values=value)))
        else:
            out.append(pb.OptimizerOption(name=name, real=value))
    return out


def _options_from_pb(options: Iterable[pb.OptimizerOption]) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    for o in options:
        which = o.WhichOneof("value")
        if which is None:
            raise BadInput(f"optimizer option {short(o.name)} has no value")
        if which == "reals":
            if len(o.reals.values) > 8:
                raise BadInput(f"optimizer option {short(o.name)} has {len(o.reals.values)} numbers, at most 8")
            out.append((o.name, tuple(o.reals.values)))
        else:
            out.append((o.name, getattr(o, which)))
    return tuple(out)


def _optimizer_to_pb(o: OptimizerConfig) -> pb.OptimizerConfig:
    return pb.OptimizerConfig(kind=_OPT.get(o.kind, pb.OPTIMIZER_UNSPECIFIED), lr=o.lr, momentum=o.momentum,
                              nesterov=o.nesterov, weight_decay=o.weight_decay,
                              beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                              warmup_steps=o.warmup_steps, class_name=o.kind,
                              options=_options_to_pb(o.options),
                              groups=[pb.ParamGroup(match=g.match, options=_options_to_pb(g.options))
                                      for g in o.groups],
                              clip_grad_norm=o.clip_grad_norm)


def _optimizer_from_pb(o: pb.OptimizerConfig) -> OptimizerConfig:
    # Bounded before anything is built (OptimizerConfig checks the same bounds on what it gets).
    if len(o.options) > MAX_OPTIONS or len(o.groups) > MAX_GROUPS or any(
            len(g.options) > MAX_OPTIONS or len(g.match) > MAX_PATTERNS for g in o.groups):
        raise BadInput(f"optimizer configuration too large: at most {MAX_OPTIONS} options, {MAX_GROUPS} groups "
                       f"of {MAX_PATTERNS} patterns")
    return OptimizerConfig(kind=o.class_name or name_of(_OPT, o.kind, "optimizer"), lr=o.lr,
                           momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay,
                           beta1=o.beta1, beta2=o.beta2, eps=o.eps, warmup_steps=o.warmup_steps,
                           options=_options_from_pb(o.options),
                           groups=tuple(ParamGroup(tuple(g.match), _options_from_pb(g.options))
                                        for g in o.groups),
                           clip_grad_norm=o.clip_grad_norm)


def _outer_to_pb(c: OuterConfig | None) -> pb.OuterConfig | None:
    if c is None:
        return None
    return pb.OuterConfig(inner_steps=c.inner_steps, fragments=c.fragments, codec=CODEC[c.codec],
                          optimizer=_optimizer_to_pb(c.optimizer), inner_tier=ROLE[c.inner_tier],
                          overlap=c.overlap, asynchronous=c.asynchronous, delta_codec=CODEC[c.delta_codec],
                          nesterov_delay=c.nesterov_delay, dynamic_steps=c.dynamic_steps, sync_wait_s=c.sync_wait_s)


def _outer_from_pb(m: pb.JobConfig) -> OuterConfig | None:
    if not m.HasField("outer"):
        return None
    c = m.outer
    return OuterConfig(inner_steps=c.inner_steps, fragments=c.fragments, codec=name_of(CODEC, c.codec, "codec"),
                       optimizer=_optimizer_from_pb(c.optimizer), inner_tier=ROLE_NAME.get(c.inner_tier, "?"),
                       overlap=c.overlap, asynchronous=c.asynchronous,
                       delta_codec=name_of(CODEC, c.delta_codec, "codec") if c.delta_codec else "int8",
                       nesterov_delay=c.nesterov_delay, dynamic_steps=c.dynamic_steps, sync_wait_s=c.sync_wait_s)


def _sharding_to_pb(c: ShardingConfig | None) -> pb.ShardingConfig | None:
    if c is None:
        return None
    return pb.ShardingConfig(weights=c.weights, block_elems=c.block_elems, keys=[
        pb.KeySpec(key=k[0], dtype=DTYPE[k[2]], shape=k[1], kind=_KIND[k[3]]) for k in c.keys])


def _sharding_from_pb(m: pb.JobConfig) -> ShardingConfig | None:
    if not m.HasField("sharding"):
        return None
    c = m.sharding
    return ShardingConfig(weights=tuple(c.weights), block_elems=c.block_elems, keys=tuple(
        (k.key, tuple(k.shape), name_of(DTYPE, k.dtype, "dtype"), name_of(_KIND, k.kind, "key kind")) for k in c.keys))


def job_to_pb(cfg: JobConfig) -> pb.JobConfig:
    return pb.JobConfig(sharding=_sharding_to_pb(cfg.sharding),
        name=cfg.name, mode=_MODE[cfg.mode], staleness=cfg.staleness,
        optimizer=_optimizer_to_pb(cfg.optimizer), outer=_outer_to_pb(cfg.outer),
        push_codec=CODEC[cfg.push_codec], delta_codec=CODEC[cfg.delta_codec],
        delta_log_length=cfg.delta_log_length, damping=cfg.damping,
        relay_codec=CODEC[cfg.relay_codec] if cfg.relay_codec else pb.CODEC_UNSPECIFIED,
        topk=cfg.topk, topk_warmup_steps=cfg.topk_warmup_steps, powersgd_rank=cfg.powersgd_rank,
        momentum_correction=cfg.momentum_correction, min_workers=cfg.min_workers,
        buffer_sync_every=cfg.buffer_sync_every, buffers_never=cfg.buffer_sync_every == 0, run_id=cfg.run_id)


def job_from_pb(m: pb.JobConfig) -> JobConfig | None:
    """The job's configuration; None when the message only names the job (adopt the declared one)."""
    if m.mode == pb.MODE_UNSPECIFIED:
        if not m.name:
            raise BadInput("a job configuration needs at least the job's name")
        return None
    return JobConfig(
        name=m.name, mode=name_of(_MODE, m.mode, "mode"), staleness=m.staleness,
        optimizer=_optimizer_from_pb(m.optimizer), outer=_outer_from_pb(m), sharding=_sharding_from_pb(m),
        push_codec=name_of(CODEC, m.push_codec, "codec"), delta_codec=name_of(CODEC, m.delta_codec, "codec"),
        delta_log_length=m.delta_log_length, damping=m.damping,
        relay_codec=name_of(CODEC, m.relay_codec, "codec") if m.relay_codec else "",
        topk=m.topk or 0.01,  # 0: a peer from before the field; its default
        topk_warmup_steps=m.topk_warmup_steps, momentum_correction=m.momentum_correction,
        powersgd_rank=m.powersgd_rank or 4,  # 0: a peer from before the field; its default
        min_workers=m.min_workers,
        buffer_sync_every=0 if m.buffers_never else (m.buffer_sync_every or 1), run_id=m.run_id)


def jobs_to_pb(rows: list[dict]) -> pb.ListJobsReply:
    return pb.ListJobsReply(jobs=[
        pb.JobInfo(config=job_to_pb(j["config"]), state=j["state"], version=j["version"],
                   members=j["members"], parameters=j["parameters"]) for j in rows])


def jobs_from_pb(reply: pb.ListJobsReply) -> list[dict]:
    return [dict(config=job_from_pb(j.config), state=j.state, version=j.version, members=j.members,
                 parameters=j.parameters) for j in reply.jobs]


# ---- ranks and leased data shards ------------------------------------------------------

def rank_to_pb(info: RankInfo) -> pb.RankReply:
    return pb.RankReply(rank=info.rank, world_size=info.world_size, joined=info.joined,
                        holders=[pb.RankHolder(rank=r, member=m) for r, m in info.holders])


def rank_from_pb(m: pb.RankReply) -> RankInfo:
    return RankInfo(m.rank, m.world_size, m.joined, tuple((h.rank, h.member) for h in m.holders))


def dataset_to_pb(ds: Dataset) -> pb.DatasetSpec:
    return pb.DatasetSpec(length=ds.length, shard_size=ds.shard_size, seed=ds.seed,
                          lease_timeout_ms=round(ds.lease_timeout_s * 1000))


def dataset_from_pb(m: pb.DatasetSpec) -> Dataset:
    """A lease call's dataset, or BadInput (``Dataset`` checks it)."""
    return Dataset(m.length, m.shard_size, m.seed, m.lease_timeout_ms / 1000.0)


def shards_to_pb(shards: Iterable[tuple[int, int]]) -> list[pb.ShardRef]:
    return [pb.ShardRef(epoch=e, shard=s) for e, s in shards]


MAX_HELD = 4096  # shards one lease call may name


def shards_from_pb(refs: Any) -> tuple[tuple[int, int], ...]:
    if len(refs) > MAX_HELD:
        raise BadInput(f"a lease call names {len(refs)} held shards; at most {MAX_HELD}")
    return tuple((r.epoch, r.shard) for r in refs)


def grant_to_pb(g: Grant) -> pb.LeaseReply:
    return pb.LeaseReply(status=_LEASE[g.status], epoch=g.epoch, shard=max(g.shard, 0), start=g.start, end=g.end,
                         current_epoch=g.current_epoch, lost=shards_to_pb(g.lost))


def grant_from_pb(m: pb.LeaseReply) -> Grant:
    status = name_of(_LEASE, m.status, "lease status")
    return Grant(status, m.epoch, m.shard if status == GRANTED else -1, m.start, m.end, m.current_epoch,
                 shards_from_pb(m.lost))


# ---- status ---------------------------------------------------------------------------------

_STATS = tuple(f.name for f in dataclass_fields(JobStats))
assert set(_STATS) == set(pb.JobStats.DESCRIPTOR.fields_by_name), "JobStats and its message disagree"


def _members_to_pb(ms: Iterable[MemberInfo]) -> list[pb.MemberStatus]:
    return [pb.MemberStatus(member=m.member, role=ROLE[m.role], address=m.address,
                            last_seen_s=m.last_seen_s, pushes=m.pushes) for m in ms]


def _members_from_pb(ms: Iterable[pb.MemberStatus]) -> tuple[MemberInfo, ...]:
    return tuple(MemberInfo(m.member, ROLE_NAME.get(m.role, "worker"), m.address, m.last_seen_s, m.pushes)
                 for m in ms)


def status_to_pb(s: TierStatus) -> pb.StatusReply:
    return pb.StatusReply(
        role=ROLE[s.role], name=s.name, server_epoch=s.server_epoch, parent=s.parent,
        parent_reachable=s.parent_reachable, ready=s.ready, uptime_s=s.uptime_s, insecure=s.insecure,
        children=_members_to_pb(s.children), tokens_required=s.tokens_required,
        root_term=s.term, root_state=s.root_state,
        parents=s.parents, parent_switches=s.parent_switches, parent_cut_off_s=s.parent_cut_off_s,
        jobs=[pb.JobStatus(name=j.name, mode=_MODE[j.mode], version=j.version, view_epoch=j.view_epoch,
                           checksum=j.checksum, parent_version=j.parent_version, lag_s=j.lag_s,
                           round=j.round, round_pushed=j.round_pushed, clock_min=j.clock_min,
                           staleness=j.staleness, parameters=j.parameters,
                           members=_members_to_pb(j.members), lost=_members_to_pb(j.lost),
                           inner_loop=j.inner_loop, stats=pb.JobStats(**{k: getattr(j.stats, k) for k in _STATS}))
              for j in s.jobs])


def status_from_pb(m: pb.StatusReply) -> TierStatus:
    return TierStatus(
        role=ROLE_NAME.get(m.role, "?"), name=m.name, server_epoch=m.server_epoch, parent=m.parent,
        parent_reachable=m.parent_reachable, ready=m.ready, uptime_s=m.uptime_s, insecure=m.insecure,
        children=_members_from_pb(m.children), tokens_required=m.tokens_required,
        term=m.root_term, root_state=m.root_state,
        parents=tuple(m.parents), parent_switches=m.parent_switches, parent_cut_off_s=m.parent_cut_off_s,
        jobs=tuple(JobStatus(name=j.name, mode=name_of(_MODE, j.mode, "mode"), version=j.version,
                             view_epoch=j.view_epoch, checksum=j.checksum, parent_version=j.parent_version,
                             lag_s=j.lag_s, round=j.round, round_pushed=j.round_pushed,
                             clock_min=j.clock_min, staleness=j.staleness, parameters=j.parameters,
                             members=_members_from_pb(j.members), lost=_members_from_pb(j.lost),
                             inner_loop=j.inner_loop, stats=JobStats(**{k: getattr(j.stats, k) for k in _STATS}))
                   for j in m.jobs))
