"""Validated, frozen configuration: one dataclass per job and per server role.

>>> job = JobConfig(name="lm", optimizer=OptimizerConfig(kind="adam", lr=3e-4))
>>> OptimizerConfig(kind="AdamW", lr=1e-3, options=(("amsgrad", True),),
...                 groups=(ParamGroup(("*.bias", "*norm*"), (("weight_decay", 0.0),)),)).kind
'adamw'
>>> OptimizerConfig(kind="sgd", options=(("momentom", 0.9),))
Traceback (most recent call last):
ps.core.errors.BadInput: optimizer SGD takes no option 'momentom'; its options: lr, momentum, dampening, ...
>>> srv = ServerConfig(role="zone", listen="127.0.0.1:0", parent="127.0.0.1:7000")
>>> JobConfig(name="lm", mode="bsp", staleness=2)
Traceback (most recent call last):
ps.core.errors.BadInput: staleness 2 only applies to mode ssp, not 'bsp'

Every check runs at construction and names the bad value, so a typo in a flag or a YAML
file fails at start-up with a sentence rather than mid-run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from ps.core.errors import BadInput, short

__all__ = ["OptimizerConfig", "ParamGroup", "OuterConfig", "ShardingConfig", "JobConfig", "ServerConfig", "MODES",
           "ROLES", "OPTIMIZERS",
           "CODEC_NAMES", "POWERSGD_MAX_RANK", "check_name", "check_member", "address_list"]

MODES = ("bsp", "ssp", "async", "outer")
# The codecs a job may name (ps.core.codecs implements each and asserts so at import; this
# module names them without importing torch, so a configuration loads in milliseconds).
CODEC_NAMES = ("fp32", "fp32+zstd", "fp16", "bf16", "int8", "int4", "topk", "sign", "rows", "powersgd")
# The largest rank the powersgd codec takes or decodes: a decode costs rank passes over its chunk.
POWERSGD_MAX_RANK = 64
ROLES = ("global", "regional", "zone")
# The optimizers the wire's OptimizerKind enum names (older peers); any torch.optim class is
# accepted by name (OptimizerConfig.kind), checked against torch itself.
OPTIMIZERS = ("sgd", "adam")
_OPTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_OPTIONS = 64      # options per optimizer or per group
MAX_GROUPS = 64       # param groups besides the default one
MAX_PATTERNS = 64     # patterns per group
MAX_PATTERN_LENGTH = 256
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_MEMBER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


def check_name(name: str) -> str:
    """A job name from the wire, or BadInput (the name cut short in the sentence)."""
    _require(bool(_NAME.match(name)), f"job name {short(name)} must be 1-63 letters, digits, '.', '_' or '-'")
    return name


def check_member(member: str) -> str:
    """A member id from the wire (a worker id or a relay's name), or BadInput."""
    _require(bool(_MEMBER.match(member)),
             f"member id {short(member)} must be 1-128 letters, digits, '.', '_', ':', '@' or '-'")
    return member


_SHARD = re.compile(r"^(0|[1-9][0-9]{0,3})/([1-9][0-9]{0,3})$")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BadInput(message)


def _finite(obj: Any) -> None:
    """Every float field of a config is a finite number: ``lr=inf`` passed every range check
    (inf > 0) and would have made the first step non-finite."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            _require(math.isfinite(value), f"{f.name} must be a finite number, got {value!r}")


OptionValue = bool | int | float | tuple[float, ...]
Options = tuple[tuple[str, OptionValue], ...]


def _options(raw: Any, where: str) -> Options:
    """Keyword arguments of an optimizer class, normalised: (name, value) pairs sorted by name
    (so equal configurations compare equal however they were written), values bool, int, float
    or a tuple of floats (``betas``), every number finite. Accepts a mapping or pairs (lists
    too: what JSON gives back from a checkpoint)."""
    items = list(raw.items()) if isinstance(raw, dict) else list(raw)
    _require(len(items) <= MAX_OPTIONS, f"{where}: at most {MAX_OPTIONS} options, got {len(items)}")
    out: dict[str, OptionValue] = {}
    for item in items:
        _require(isinstance(item, (tuple, list)) and len(item) == 2, f"{where}: option {short(str(item))} "
                 "is not a (name, value) pair")
        name, value = item
        _require(isinstance(name, str) and bool(_OPTION_NAME.match(name)),
                 f"{where}: option name {short(str(name))} is not an identifier")
        _require(name not in out, f"{where}: option {name!r} is given twice")
        _require(name not in ("params", "differentiable"),
                 f"{where}: option {name!r} cannot be set (the root owns the parameters and steps without autograd)")
        if isinstance(value, (tuple, list)):
            _require(0 < len(value) <= 8 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value),
                     f"{where}: option {name}={short(str(value))} must be 1-8 numbers")
            value = tuple(float(v) for v in value)
            _require(all(math.isfinite(v) for v in value), f"{where}: option {name} must be finite, got {value}")
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{where}: option {name} must be a finite number, got {value!r}")
        elif not isinstance(value, (bool, int)):
            _require(False, f"{where}: option {name}={short(str(value))} must be a number, a bool or numbers")
        elif isinstance(value, int) and not isinstance(value, bool):
            _require(abs(value) < 1 << 63, f"{where}: option {name}={value} is out of range")
        out[name] = value
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class ParamGroup:
    """A torch param group of the job's optimizer: the parameters whose names match one of the
    ``fnmatch`` patterns (case-sensitive), with their own options (``weight_decay=0`` for
    ``*.bias``). A key goes to the first group that matches; keys matching none to group 0."""

    match: tuple[str, ...]
    options: Options = ()

    def __post_init__(self) -> None:
        match = (self.match,) if isinstance(self.match, str) else tuple(self.match)
        _require(0 < len(match) <= MAX_PATTERNS, f"a param group needs 1-{MAX_PATTERNS} name patterns, "
                 f"got {len(match)}")
        for m in match:
            _require(isinstance(m, str) and 0 < len(m) <= MAX_PATTERN_LENGTH and m.isprintable(),
                     f"param group pattern {short(str(m))} must be 1-{MAX_PATTERN_LENGTH} printable characters")
        object.__setattr__(self, "match", match)
        object.__setattr__(self, "options", _options(self.options, f"param group {','.join(match)}"))


@dataclass(frozen=True)
class OptimizerConfig:
    """The root's optimizer for a job: any ``torch.optim`` class, with torch's semantics.

    ``kind``: the class name, any case ("sgd", "adamw", "rmsprop"; stored lower-case).
    ``options``: further keyword arguments of that class (``amsgrad``, ``alpha``, ``betas``).
    ``groups``: param groups 1.. (``ParamGroup``); group 0 holds the keys no pattern matches.
    The flat fields (lr, momentum, nesterov, weight_decay, beta1/beta2 as ``betas``, eps) are
    passed to the class where it takes them: lr always, the others only when changed from
    their defaults here, so each class keeps torch's own defaults otherwise (AdamW's
    weight_decay 0.01, Adagrad's eps 1e-10). ``options`` win over flat fields.
    ``warmup_steps``: lr rises linearly over the first steps (where a push sends no lr of its
    own). ``clip_grad_norm``: > 0 clips the averaged gradient at the root as one process's
    ``torch.nn.utils.clip_grad_norm_`` would (global L2 norm over the trained keys); workers
    then must not clip themselves. Anything but plain sgd/adam is checked against torch at
    construction (the class is instantiated and stepped once on a dummy tensor), which imports
    torch; plain configurations stay torch-free.
    """

    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    options: Options = ()
    groups: tuple[ParamGroup, ...] = ()
    clip_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        _finite(self)
        _require(isinstance(self.kind, str) and bool(_OPTION_NAME.match(self.kind)),
                 f"optimizer kind {short(str(self.kind))} is not a torch.optim class name")
        object.__setattr__(self, "kind", self.kind.lower())
        object.__setattr__(self, "options", _options(self.options, f"optimizer {self.kind}"))
        groups = tuple(ParamGroup(**g) if isinstance(g, dict) else g for g in self.groups)
        _require(len(groups) <= MAX_GROUPS and all(isinstance(g, ParamGroup) for g in groups),
                 f"an optimizer has at most {MAX_GROUPS} ParamGroups besides the default one")
        object.__setattr__(self, "groups", groups)
        _require(self.lr > 0, f"learning rate must be positive, got {self.lr}")
        _require(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        _require(not self.nesterov or self.momentum > 0, "nesterov needs momentum > 0")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
                 f"Adam betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        _require(self.eps > 0, f"eps must be positive, got {self.eps}")
        _require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.clip_grad_norm >= 0, f"clip_grad_norm must be >= 0 (0: off), got {self.clip_grad_norm}")
        if not self.plain:
            from ps.core.optim import check_config  # torch: only for what needs it

            check_config(self)

    @property
    def plain(self) -> bool:
        """sgd or adam from the flat fields alone: checked here, without torch."""
        return self.kind in OPTIMIZERS and not self.options and not self.groups


def _outer_optimizer() -> OptimizerConfig:
    return OptimizerConfig(kind="sgd", lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer step


@dataclass(frozen=True)
class OuterConfig:
    """An ``outer`` job's cross-region loop (DiLoCo; ../shared/DESIGN.md, Consistency modes).

    The tier whose role is ``inner_tier`` (the regional master by default) runs the job's inner
    loop for its region: bsp rounds of its workers, stepped with the job's ``optimizer``. Every
    ``inner_steps // fragments`` inner steps it sends the root the pseudo-gradient of the next
    fragment (outer view - its parameters, encoded with ``codec`` and its residual); the root
    averages the regions' by workers, steps ``optimizer`` (here: the outer one) and publishes
    an outer version (its delta encoded with ``delta_codec``, the error kept at the root), which
    each region takes as its new parameters for that fragment.
    """

    inner_steps: int = 50          # H: inner steps between two syncs of one fragment
    fragments: int = 1             # F: parameter blocks synced in turn, one every H // F inner steps
    codec: str = "int8"            # the pseudo-gradient's codec, with the region's residual
    delta_codec: str = "int8"      # the root's outer versions (the job's delta_codec: the inner ones)
    optimizer: OptimizerConfig = field(default_factory=_outer_optimizer)
    inner_tier: str = "regional"   # the role that runs the inner loop
    overlap: bool = False          # keep training while a fragment's sync is in flight
    # Regions do not wait for each other: the root applies each region's pseudo-gradient as it
    # arrives, at its share of the workers (lr x its workers / all), and a region syncs its
    # fragments in its own turn. The job's ``damping`` scales each by 1 / (1 + its staleness).
    asynchronous: bool = False
    # Asynchronous, with an SGD Nesterov outer optimizer: delayed Nesterov. Each region's update
    # applies its own gradient step at once; the momentum moves once every ``nesterov_delay``
    # updates (set it to the number of regions), on their sum: over one update from each region
    # that is exactly one synchronous Nesterov step. 0: the momentum moves at every update.
    nesterov_delay: int = 0
    # Asynchronous: dynamic local steps (Async Local-SGD's DyLU). ``inner_steps`` is the fastest
    # region's H; each region syncs every ``period * its inner steps per second / the fastest
    # region's`` inner steps (at least 1), so the regions sync about equally often in wall time
    # and a slow region's pseudo-gradient is no staler than a fast one's. The root hears each
    # region's rate with its pseudo-gradients and answers the fastest with its acknowledgement.
    dynamic_steps: bool = False
    # Seconds a region waits for a sync (the one due, or without overlap the one just sent)
    # before it trains on without it: with the root or the WAN down, the region keeps making
    # inner steps, and the sync, retried meanwhile, is merged when it lands; the steps since go
    # with the next one. 0: wait as long as the sync is retried (the round timeout). Set it above
    # a sync's round trip, or every sync is put off (overlap, in effect, with more steps each).
    sync_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            object.__setattr__(self, "optimizer", OptimizerConfig(**self.optimizer))
        _require(not isinstance(self.sync_wait_s, bool) and isinstance(self.sync_wait_s, (int, float))
                 and 0 <= self.sync_wait_s <= 86400 and math.isfinite(self.sync_wait_s),
                 f"outer sync_wait_s must be a number of seconds in [0, 86400], got {self.sync_wait_s!r}")
        for flag in ("dynamic_steps", "overlap", "asynchronous"):  # a string "false" read as true
            _require(isinstance(getattr(self, flag), bool), f"outer {flag} must be true or false, "
                     f"got {getattr(self, flag)!r}")
        _require(not self.dynamic_steps or self.asynchronous,
                 "outer dynamic_steps applies to asynchronous outer steps (synchronous regions wait for "
                 "each other at every sync, so each must take the same inner steps)")
        _require(not isinstance(self.inner_steps, bool) and isinstance(self.inner_steps, int)
                 and 1 <= self.inner_steps <= 1_000_000,
                 f"outer inner_steps must be an integer in [1, 1000000], got {self.inner_steps!r}")
        _require(not isinstance(self.fragments, bool) and isinstance(self.fragments, int)
                 and 1 <= self.fragments <= min(self.inner_steps, 1024),
                 f"outer fragments must be an integer in [1, min(inner_steps {self.inner_steps}, 1024)], "
                 f"got {self.fragments!r}")
        _require(self.codec in CODEC_NAMES, f"outer codec {self.codec!r} is not one of {CODEC_NAMES}")
        _require(self.delta_codec in CODEC_NAMES,
                 f"outer delta codec {self.delta_codec!r} is not one of {CODEC_NAMES}")
        _require(isinstance(self.optimizer, OptimizerConfig), "outer optimizer must be an OptimizerConfig")
        _require(not isinstance(self.nesterov_delay, bool) and isinstance(self.nesterov_delay, int)
                 and 0 <= self.nesterov_delay <= 1024,
                 f"outer nesterov_delay must be an integer in [0, 1024], got {self.nesterov_delay!r}")
        if self.nesterov_delay:
            o = self.optimizer
            _require(self.asynchronous, "outer nesterov_delay applies to asynchronous outer steps (synchronous "
                     "ones step the momentum once per round already)")
            _require(self.fragments == 1, "outer nesterov_delay with fragments > 1 is not built (its delay counts the "
                     "root's steps, and a key gets a gradient only at its own fragment's syncs): use fragments=1")
            _require(o.kind == "sgd" and o.momentum > 0 and o.nesterov and o.weight_decay == 0 and not o.options
                     and not o.groups and o.clip_grad_norm == 0,
                     "outer nesterov_delay (delayed Nesterov) needs the outer optimizer SGD with momentum and "
                     "nesterov, and no weight decay, options, groups or clipping")
        _require(self.inner_tier in ("regional", "zone"),
                 f"outer inner_tier must be 'regional' or 'zone' (the root's would be flat bsp), "
                 f"got {self.inner_tier!r}")

    @property
    def period(self) -> int:
        """Inner steps between two syncs (of successive fragments): H // F, so each fragment
        syncs every F * (H // F) <= H inner steps (H = 10, F = 4: every 8)."""
        return self.inner_steps // self.fragments


SHARD_BLOCK_ELEMS = 1 << 20  # 4 MiB of float32: a frame's worth, and few enough blocks to place quickly
MAX_SHARDS = 256


@dataclass(frozen=True)
class ShardingConfig:
    """A job's parameters spread over several root shards (DESIGN.md, "Sharding";
    ``ps.core.sharding`` places the blocks).

    ``weights``: one per root shard, in shard order (shard ``i`` is the root started with
    ``--shard i/N``); a shard of weight 2 takes about twice the bytes of one of weight 1.
    ``block_elems``: tensors larger than this are cut into blocks of this many elements.
    ``keys``: the whole job's layout, (name, shape, dtype, kind) per tensor, as the creating
    worker had it: every tier and worker recomputes the placement from it (filled in by the
    worker that creates the job).
    """

    weights: tuple[float, ...] = (1.0,)
    block_elems: int = SHARD_BLOCK_ELEMS
    keys: tuple[tuple[str, tuple[int, ...], str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        object.__setattr__(self, "keys", tuple((str(k[0]), tuple(int(d) for d in k[1]), str(k[2]), str(k[3]))
                                               for k in self.keys))
        _require(1 <= len(self.weights) <= MAX_SHARDS,
                 f"a sharded job has 1 to {MAX_SHARDS} shard weights, got {len(self.weights)}")
        _require(all(math.isfinite(w) and w > 0 for w in self.weights),
                 f"shard weights must be positive, got {list(self.weights)}")
        _require(not isinstance(self.block_elems, bool) and isinstance(self.block_elems, int)
                 and 1 <= self.block_elems <= 1 << 30,
                 f"block_elems must be an integer in [1, 2**30], got {self.block_elems!r}")

    @property
    def shards(self) -> int:
        return len(self.weights)


@dataclass(frozen=True)
class JobConfig:
    """One training run's configuration, fixed at creation."""

    name: str
    mode: str = "bsp"
    staleness: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    push_codec: str = "fp32"       # worker -> its tier
    delta_codec: str = "fp32"      # the root's published-view deltas (error kept at the root)
    delta_log_length: int = 64     # deltas each tier keeps for its children (and at most 2 dense snapshots' bytes)
    damping: bool = False  # async/ssp/asynchronous outer: lr / (1 + staleness) at the root
    # Relays re-encode their children's sum with this codec and their own error-feedback
    # residual ("": the push codec); a tier's --up-codec overrides it for its own edge.
    relay_codec: str = ""
    topk: float = 0.01             # density k of the topk codec, as a fraction of elements
    topk_warmup_steps: int = 0     # DGC warm-up: density 25% -> topk over these many steps
    powersgd_rank: int = 4         # rank r of the powersgd codec's factors (torch's hook: 1-4 typical)
    # DGC momentum correction (Lin et al. 2018, sec. 3.2) for sgd+momentum with topk pushes:
    # workers keep the velocity and sparsify it (masking what they sent); the root then steps
    # plain SGD on what arrives. Momentum at the root would apply to stale, sparse sums instead.
    momentum_correction: bool = False
    # Workers a job waits for before training (``ParameterClient.wait_workers``); the world size
    # the ranks report is at least this (0: as many as hold ranks).
    min_workers: int = 0
    # Module buffers (BatchNorm's running statistics) are averaged across workers every this
    # many steps (1: every step, like DDP's broadcast_buffers; 0: never, each worker keeps its
    # own). Frozen parameters and buffers start from the creating worker's values either way.
    buffer_sync_every: int = 1
    # The run that created the job (HPS_RUN_ID, or torchrun's TORCHELASTIC_RUN_ID): a worker of
    # another run does not silently join it and its old weights; it resumes only when told to.
    run_id: str = ""
    # mode "outer": the cross-region loop (None for any other mode; mode "outer" alone takes
    # OuterConfig's defaults). ``optimizer`` is then the regions' inner optimizer.
    outer: OuterConfig | None = None
    # Several root shards, each owning some blocks of the parameters (None: one root).
    sharding: ShardingConfig | None = None

    def __post_init__(self) -> None:
        _finite(self)
        if isinstance(self.outer, dict):
            object.__setattr__(self, "outer", OuterConfig(**self.outer))
        if isinstance(self.sharding, dict):
            object.__setattr__(self, "sharding", ShardingConfig(**self.sharding))
        _require(self.sharding is None or isinstance(self.sharding, ShardingConfig),
                 "sharding must be a ShardingConfig")
        # Said plainly rather than half-working (issue 16).
        _require(self.sharding is None or self.mode != "outer",
                 "outer jobs over root shards are not built yet; use one root for an outer job")
        _require(self.sharding is None or not self.optimizer.clip_grad_norm,
                 "clip_grad_norm with root shards is not built yet (the norm spans every shard's blocks); "
                 "clip in the training script or use one root")
        if self.mode == "outer" and self.outer is None:
            object.__setattr__(self, "outer", OuterConfig())
        _require(self.outer is None or (self.mode == "outer" and isinstance(self.outer, OuterConfig)),
                 f"outer settings apply to mode outer, not {self.mode!r}")
        _require(self.buffer_sync_every >= 0, f"buffer_sync_every must be >= 0, got {self.buffer_sync_every}")
        _require(self.run_id == "" or bool(_MEMBER.match(self.run_id)),
                 f"run id {short(self.run_id)} must be 1-128 letters, digits, '.', '_', ':', '@' or '-'")
        _require(isinstance(self.name, str) and bool(_NAME.match(self.name)),
                 f"job name {short(self.name)} must be 1-63 letters, digits, '.', '_' or '-'")
        _require(self.mode in MODES, f"mode {self.mode!r} is not one of {MODES}")
        _require(self.staleness >= 0, f"staleness must be >= 0, got {self.staleness}")
        _require(self.mode == "ssp" or self.staleness == 0,
                 f"staleness {self.staleness} only applies to mode ssp, not {self.mode!r}")
        asynchronous = self.outer is not None and self.outer.asynchronous
        _require(not self.damping or self.mode in ("ssp", "async") or asynchronous,
                 f"damping applies to ssp, async and asynchronous outer jobs, not {self.mode}")
        _require(self.mode != "outer" or not self.momentum_correction,
                 "momentum_correction does not apply to outer jobs (the inner optimizer is at the region)")
        _require(self.push_codec in CODEC_NAMES, f"push codec {self.push_codec!r} is not one of {CODEC_NAMES}")
        _require(self.delta_codec in CODEC_NAMES, f"delta codec {self.delta_codec!r} is not one of {CODEC_NAMES}")
        _require(self.relay_codec == "" or self.relay_codec in CODEC_NAMES,
                 f"relay codec {self.relay_codec!r} is not one of {CODEC_NAMES} (or '' for the push codec)")
        _require(not isinstance(self.topk, bool) and 0 < self.topk <= 1,
                 f"topk density must be in (0, 1], got {self.topk!r}")
        _require(self.topk_warmup_steps >= 0, f"topk_warmup_steps must be >= 0, got {self.topk_warmup_steps}")
        _require(not isinstance(self.powersgd_rank, bool) and isinstance(self.powersgd_rank, int)
                 and 1 <= self.powersgd_rank <= POWERSGD_MAX_RANK,
                 f"powersgd_rank must be an integer in [1, {POWERSGD_MAX_RANK}], got {self.powersgd_rank!r}")
        o = self.optimizer
        _require(not self.momentum_correction or (o.kind == "sgd" and o.momentum > 0 and not o.nesterov
                                                  and self.push_codec == "topk"),
                 "momentum_correction needs optimizer sgd with momentum > 0 (not nesterov) and push "
                 f"codec topk; got {o.kind} momentum {o.momentum} nesterov {o.nesterov}, push codec "
                 f"{self.push_codec!r}")
        _require(0 <= self.min_workers <= 1 << 20, f"min_workers must be in [0, 1048576], got {self.min_workers}")
        _require(1 <= self.delta_log_length <= 100_000,
                 f"delta_log_length must be in [1, 100000], got {self.delta_log_length}")

    def codecs(self, up_codec: str = "") -> frozenset[str]:
        """Every codec a tier of this job may decode or encode (``up_codec``: the tier's own).

        >>> sorted(JobConfig("lm", push_codec="int8", relay_codec="fp16").codecs())
        ['fp16', 'fp32', 'int8']
        """
        names = {self.push_codec, self.delta_codec, self.relay_codec, up_codec}
        if self.outer is not None:
            names |= {self.outer.codec, self.outer.delta_codec}
        return frozenset(names - {""})


@dataclass(frozen=True)
class ServerConfig:
    """One server process (a tier)."""

    role: str
    listen: str = "127.0.0.1:0"
    parent: str = ""
    name: str = ""
    metrics_port: int = -1  # -1: no /metrics endpoint; 0: any free port
    # A second gRPC port, plaintext, serving grpc.health.v1.Health only (what kubelet's gRPC
    # probe, which cannot do TLS, asks): -1 off; 0 any free port. Bound on --listen's host.
    health_port: int = -1
    heartbeat_s: float = 0.5
    member_timeout_s: float = 3.0
    checkpoint_dir: str = ""
    checkpoint_every: int = 50
    checkpoint_keep: int = 3
    upstream_timeout_s: float = 10.0
    round_timeout_s: float = 600.0
    # ssp/async aggregation window: flush after this long or this many payload bytes, whichever
    # first (a zone may flush every few ms, a regional master towards the root far less often).
    flush_ms: float = 5.0
    flush_bytes: int = 64 * 1024 * 1024
    # Codec of this tier's upward edge, overriding the job's relay codec ("": the job decides):
    # a region whose link to the root is thin may send sign while its zones send top-k.
    up_codec: str = ""
    # Budgets checked before anything is allocated (refusals are RESOURCE_EXHAUSTED or
    # INVALID_ARGUMENT with a sentence): the largest job this tier holds, in float32
    # parameters; the bytes of pushes being received and decoded at once; jobs held.
    max_job_params: int = 1 << 31
    push_budget_mb: int = 2048
    max_jobs: int = 1000
    # The root ends a job that no worker joined within this many seconds of its creation or
    # declaration (0: never), so jobs created by mistake do not hold memory and files forever.
    unjoined_job_ttl_s: float = 86400.0
    # Mutual TLS (ps/net/tls.py): this tier's certificate and key, and the CA its children's
    # and its parent's certificates are signed by; all three or none. None: plaintext, which
    # `hps serve` runs only when told --insecure.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    insecure: bool = False
    # A file holding the admin token (ps/server/auth.py); "": none, and the tier accepts every
    # call without a token (it says so in its log and in `hps status`).
    admin_token_file: str = ""
    # A hot-standby pair of roots (ps/tiers/standby.py): ``standby_of`` starts this root as the
    # standby of the primary there; ``standby`` names this primary's standby, so a version is
    # acknowledged only once the standby holds its record (and this root, restarted after a
    # takeover, finds the new primary there and rejoins as its standby). ``lease_s``: how long
    # a primary waits for its standby's acknowledgement, and a standby for its primary, before
    # the one refuses pushes and the other takes over.
    standby_of: str = ""
    standby: str = ""
    lease_s: float = 2.0
    # A root shard: "I/N", this root owns the blocks the ring places on shard I of N (a sharded
    # job's weights and placement are in its JobConfig.sharding); "": an unsharded root.
    shard: str = ""

    def __post_init__(self) -> None:
        _finite(self)
        _require(self.role in ROLES, f"role {self.role!r} is not one of {ROLES}")
        _require(":" in self.listen, f"listen address {self.listen!r} must be HOST:PORT")
        if self.role == "global":
            _require(not self.parent, f"the global root has no parent, got parent={self.parent!r}")
        else:
            _require(bool(self.parents) and all(":" in a for a in self.parents),
                     f"a {self.role} tier needs --parent HOST:PORT (or several, comma-separated: "
                     f"alternates tried in order), got {self.parent!r}")
            _require(not self.checkpoint_dir, "only the global root writes checkpoints")
        _require(0 < self.heartbeat_s < self.member_timeout_s,
                 f"heartbeat ({self.heartbeat_s}s) must be positive and shorter than the member "
                 f"timeout ({self.member_timeout_s}s)")
        _require(self.metrics_port >= -1, f"metrics port must be >= -1, got {self.metrics_port}")
        _require(self.health_port >= -1, f"health port must be >= -1, got {self.health_port}")
        _require(self.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        _require(self.checkpoint_keep >= 1, f"checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        _require(self.upstream_timeout_s > 0, f"upstream timeout must be positive, got {self.upstream_timeout_s}")
        _require(0 <= self.flush_ms <= 60_000, f"flush window must be in [0, 60000] ms, got {self.flush_ms}")
        _require(self.flush_bytes > 0, f"flush byte budget must be positive, got {self.flush_bytes}")
        _require(self.up_codec == "" or self.up_codec in CODEC_NAMES,
                 f"up codec {self.up_codec!r} is not one of {CODEC_NAMES} (or '' for the job's choice)")
        _require(self.role != "global" or not self.up_codec, "the global root has no upward edge to encode")
        _require(self.max_job_params >= 1, f"max_job_params must be >= 1, got {self.max_job_params}")
        _require(self.push_budget_mb >= 1, f"push budget must be >= 1 MB, got {self.push_budget_mb}")
        _require(self.max_jobs >= 1, f"max_jobs must be >= 1, got {self.max_jobs}")
        _require(self.unjoined_job_ttl_s >= 0, f"unjoined_job_ttl_s must be >= 0, got {self.unjoined_job_ttl_s}")
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        _require(all(tls) or not any(tls), "--tls-cert, --tls-key and --tls-ca go together, got "
                 f"cert={self.tls_cert!r} key={self.tls_key!r} ca={self.tls_ca!r}")
        _require(not (self.insecure and any(tls)), "--insecure and the --tls-* files exclude each other")
        _require(self.round_timeout_s > 0, f"round timeout must be positive, got {self.round_timeout_s}")
        _require(not self.shard or (self.role == "global" and bool(_SHARD.match(self.shard))
                                    and self.shard_index < self.shard_count <= MAX_SHARDS),
                 f"--shard is I/N with 0 <= I < N <= {MAX_SHARDS}, at the global root only; got {self.shard!r}")
        peers = (self.standby_of, self.standby)
        _require(self.role == "global" or not any(peers),
                 "only the global root has a standby (--standby, --standby-of)")
        _require(not all(peers), f"a root is a standby (--standby-of {self.standby_of}) or has one "
                 f"(--standby {self.standby}), not both")
        _require(all(":" in p for p in peers if p), f"a standby's peer must be HOST:PORT, got {peers}")
        _require(not any(peers) or bool(self.checkpoint_dir), "a root with a standby, or a standby, needs "
                 "--checkpoint-dir (the term and the log are durable)")
        _require(0.1 <= self.lease_s <= 600, f"lease must be in [0.1, 600] seconds, got {self.lease_s}")

    @property
    def secure(self) -> bool:
        """Whether this tier serves (and calls its parent) over mutual TLS."""
        return bool(self.tls_cert)

    @property
    def shard_index(self) -> int:
        return int(self.shard.split("/")[0]) if self.shard else 0

    @property
    def shard_count(self) -> int:
        """Root shards of this root's jobs (0: not a shard)."""
        return int(self.shard.split("/")[1]) if self.shard else 0

    @property
    def parents(self) -> tuple[str, ...]:
        """The parent's addresses, in the order they are tried (``address_list``)."""
        return address_list(self.parent)

    @property
    def display_name(self) -> str:
        return self.name or self.role


_SCHEME = re.compile(r"^(ipv4|ipv6):")


def address_list(spec: str) -> tuple[str, ...]:
    """The addresses of a comma-separated list, in order: a relay's parents (``--parent``,
    ``HPS_PARENT``) or a worker's tiers (``HPS_ADDRESS``), alternates tried in turn. A gRPC
    ``ipv4:``/``ipv6:`` multi-address target is read the same way (the scheme applies to each
    address); a DNS name stays one entry (gRPC tries its addresses itself).

    >>> address_list("eu-1:7000, eu-2:7000")
    ('eu-1:7000', 'eu-2:7000')
    >>> address_list("ipv4:10.0.0.1:7000,10.0.0.2:7000")
    ('ipv4:10.0.0.1:7000', 'ipv4:10.0.0.2:7000')
    """
    out: list[str] = []
    scheme = ""
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = _SCHEME.match(part)
        if m:
            scheme = m.group(0)
        elif scheme and not part.startswith(("dns:", "unix:")):
            part = scheme + part
        out.append(part)
    return tuple(dict.fromkeys(out))
