"""The domain types that cross the wire, as plain frozen dataclasses (no protobuf here).

>>> key = PushKey("w0", incarnation=0x5eed, seq=7, digest=bytes(16))
>>> meta = PushMeta(job="lm", sender="w0", seq=7, base_version=41, incarnation=0x5eed)
>>> ack = Ack(applied_version=42, view_epoch=0x1f)
>>> meta.contributors, ack.applied_version - meta.base_version
(1, 1)

``ps.net.wire`` converts these to and from protobuf; every other module uses only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from ps.core.config import JobConfig
    from ps.core.view import Layout

__all__ = ["Chunk", "PushKey", "StepInfo", "furthest", "NO_STEP", "PushMeta", "PullMeta", "VersionMeta", "Ack",
           "Registration", "JobStats", "MemberInfo", "JobStatus", "TierStatus", "LogMessage", "LOG_KINDS"]


@dataclass(frozen=True)
class Chunk:
    """Encoded elements [offset, offset+numel) of one key's flattened tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int
    codec: str
    payload: bytes | memoryview


@dataclass(frozen=True)
class PushKey:
    """One worker push, end to end: who sent it (member, incarnation), which of its pushes
    (seq), and what it carried (the digest of its frames). Relays list the keys they sum."""

    member: str
    incarnation: int
    seq: int
    digest: bytes = b""


@dataclass(frozen=True)
class StepInfo:
    """What a push says about its optimizer step beyond the gradient, merged up the tree.

    >>> a = StepInfo(hparams=((0, "lr", 0.1),), absent=(2, 3), progress=((0, 5, 64),))
    >>> b = StepInfo(hparams=((0, "lr", 0.1),), absent=(3,), skip=True)
    >>> m = a.merge(b)
    >>> m.absent, m.skip, m.progress         # absent where no contribution had a gradient
    ((3,), True, ((0, 5, 64),))

    ``hparams``: (param group, name, value) the worker's optimizer holds for this step (an
    ``lr_scheduler`` or a hand-written schedule changed them); the root applies them to the
    version the push makes. ``absent``: indices of layout keys this contribution has no
    gradient for (torch leaves such a parameter alone). ``skip``: a contribution was not finite
    (an AMP overflow): the round is skipped by everyone. ``buffers``: how many contributions
    carry their buffers' values (averaged at the root). ``progress``: (epoch, shard, end offset)
    of the leased data shards the step trained (recorded with the version that applies it).
    ``inner_rate``: an outer job's region, its inner steps per second (dynamic local steps,
    ``OuterConfig.dynamic_steps``; not recorded with the version: it steers, it is not applied).
    """

    hparams: tuple[tuple[int, str, float], ...] = ()
    absent: tuple[int, ...] = ()
    skip: bool = False
    buffers: int = 0
    progress: tuple[tuple[int, int, int], ...] = ()
    inner_rate: float = 0.0

    @property
    def empty(self) -> bool:
        return self == NO_STEP

    def agrees(self, other: StepInfo) -> str:
        """"" when ``other``'s hyperparameters equal these (bsp: a round's workers must agree),
        else a sentence naming the first difference."""
        mine, theirs = dict(((g, n), v) for g, n, v in self.hparams), dict(((g, n), v) for g, n, v in other.hparams)
        for k in sorted(set(mine) | set(theirs)):
            if mine.get(k) != theirs.get(k):
                return (f"param group {k[0]} {k[1]}: {mine.get(k)} here, {theirs.get(k)} in another "
                        "worker's push for the same round")
        return ""

    def merge(self, other: StepInfo, other_newer: bool = True) -> StepInfo:
        """Two contributions summed: absent keys intersect, skips and buffers accumulate, data
        progress keeps the furthest offset per (epoch, shard) (what the root records of it, so
        a window summing thousands of pushes still carries one entry per shard), and the
        hyperparameters are the newer contribution's (bsp checks that they agree first)."""
        absent = tuple(sorted(set(self.absent) & set(other.absent)))
        return StepInfo(other.hparams if (other_newer and other.hparams) or not self.hparams else self.hparams,
                        absent, self.skip or other.skip, self.buffers + other.buffers,
                        furthest(self.progress, other.progress), max(self.inner_rate, other.inner_rate))



def furthest(*progress: tuple[tuple[int, int, int], ...]) -> tuple[tuple[int, int, int], ...]:
    """Leased-data progress entries (epoch, shard, end offset) taken together: the furthest end
    per (epoch, shard), what the root records of them.

    >>> furthest(((0, 3, 100),), ((0, 4, 10), (0, 3, 40)))
    ((0, 3, 100), (0, 4, 10))
    """
    ends: dict[tuple[int, int], int] = {}
    for part in progress:
        for e, s, end in part:
            ends[(e, s)] = max(end, ends.get((e, s), end))
    return tuple((e, s, end) for (e, s), end in sorted(ends.items()))


NO_STEP = StepInfo()


@dataclass(frozen=True)
class PushMeta:
    """A push's header: who, which push, computed on what, and how many gradients it sums."""

    job: str
    sender: str
    seq: int
    base_version: int
    view_epoch: int = 0
    contributors: int = 1
    clock_min: int = 0
    clock_max: int = 0
    clock_floor: int = 0
    loss_sum: float = 0.0          # training telemetry (see PushHeader): reported, never applied
    loss_count: int = 0
    step_seconds_sum: float = 0.0
    workers: int = 1               # live workers at or below the sender
    incarnation: int = 0           # the sender's process incarnation (as it registered)
    sources: tuple[PushKey, ...] = ()  # relays: the worker pushes the aggregate sums
    step: StepInfo = NO_STEP      # hyperparameters, absent keys, skip, buffers, data progress


@dataclass(frozen=True)
class PullMeta:
    view_epoch: int
    from_version: int
    to_version: int
    snapshot: bool
    server_epoch: int


@dataclass(frozen=True)
class VersionMeta:
    version: int
    checksum: int
    clock_min: int = 0
    contributors: int = 0


@dataclass(frozen=True)
class Ack:
    """A push's acknowledgement: the version that includes it."""

    applied_version: int
    view_epoch: int
    duplicate: bool = False
    skipped: bool = False  # the version skipped its step (a contribution overflowed under AMP)
    pace: float = 0.0      # an outer job with dynamic steps: the fastest region's inner steps per second


@dataclass(frozen=True)
class Registration:
    """What a tier answers a joining member."""

    config: JobConfig
    layout: Layout
    start_version: int
    server_epoch: int
    start_clock: int = 0


@dataclass
class JobStats:
    """What one job has seen at one tier since the tier started (counters)."""

    pushes: int = 0
    bytes_pushed_in: int = 0
    bytes_pushed_up: int = 0
    bytes_pulled_out: int = 0
    bytes_pulled_in: int = 0
    snapshots_served: int = 0
    deltas_served: int = 0
    rounds: int = 0
    aborted_rounds: int = 0
    restarted_rounds: int = 0    # open rounds restarted without a member that left with its push
    refused_rounds: int = 0      # closed rounds refused whole (non-finite sum, failed write, ...)
    duplicates: int = 0          # retries answered with the recorded acknowledgement
    resolved: int = 0            # retries whose outcome had to be asked of the parent or root
    durable_failures: int = 0    # root: versions refused because the log write failed
    checkpoint_failures: int = 0  # root: checkpoints that failed to write
    double_applied: int = 0      # root: worker pushes applied by a second version (must stay 0)
    members_expired: int = 0     # members dropped after member_timeout of silence
    members_left: int = 0        # members that said goodbye
    members_replaced: int = 0    # members replaced by a new incarnation (a restarted process)
    staleness_count: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    round_wait_ms_sum: int = 0
    # What the workers below reported about their training (PushMeta telemetry), for metrics.
    loss_sum: float = 0.0
    loss_count: int = 0
    step_seconds_sum: float = 0.0
    # root: staleness in worker clocks, the unit of an ssp bound: how far the newest clock in
    # an update ran ahead of the clock floor of the view it was applied to (ssp(s) keeps it <= s)
    clock_staleness_count: int = 0
    clock_staleness_sum: int = 0
    clock_staleness_max: int = 0
    over_bound: int = 0          # root, ssp: updates whose clock staleness exceeded the bound s
    # An outer job at the tier running its region's inner loop (ps.tiers.outer):
    outer_version: int = 0       # the outer version its parameters were last rebased on
    outer_checksum: int = 0      # that outer view's checksum (every region's equals the root's)
    shard: str = ""              # a root shard's job: "I/N" ("" unsharded)
    shard_blocks: int = 0        # blocks of the job this shard owns
    shard_bytes: int = 0         # their bytes
    outer_syncs: int = 0         # pseudo-gradients the root applied
    outer_sync_failures: int = 0  # syncs that failed (the steps go with the next one)
    outer_sync_seconds_sum: float = 0.0  # from sending a pseudo-gradient to holding its outer version
    outer_bytes_up: int = 0      # pseudo-gradient payload bytes sent up (across the WAN)
    outer_bytes_down: int = 0    # outer-version payload bytes pulled (across the WAN)
    pseudo_grad_norm: float = 0.0  # L2 norm of the last pseudo-gradient, per worker
    inner_steps_since_sync: int = 0  # inner steps not yet in any pseudo-gradient
    inner_steps_lost: int = 0    # inner steps lost to restarts of this tier (reported, never silent)
    inner_steps_per_sync: int = 0  # the region's inner steps between syncs now (dynamic steps: by its speed)
    outer_syncs_postponed: int = 0  # syncs not landed within sync_wait_s: the region trained on without them
    outer_syncs_unsettled: int = 0  # syncs given up on unanswered, then asked about until the root knew

    def staleness(self, s: int) -> None:
        self.staleness_count += 1
        self.staleness_sum += s
        self.staleness_max = max(self.staleness_max, s)

    def clock_staleness(self, c: int, bound: int | None) -> None:
        self.clock_staleness_count += 1
        self.clock_staleness_sum += c
        self.clock_staleness_max = max(self.clock_staleness_max, c)
        if bound is not None and c > bound:
            self.over_bound += 1


@dataclass(frozen=True)
class MemberInfo:
    member: str
    role: str
    address: str
    last_seen_s: float
    pushes: int = 0


@dataclass(frozen=True)
class JobStatus:
    """One job as one tier holds it, at one moment."""

    name: str
    mode: str
    version: int
    view_epoch: int
    checksum: int
    parent_version: int          # the newest version this tier has heard of (its own at the root)
    lag_s: float                 # seconds since it last held its parent's newest version (0: in sync)
    round: int                   # bsp: the open round; ssp/async: windows closed
    round_pushed: int            # pushes in the open round or window
    clock_min: int
    staleness: int = 0           # the ssp bound s
    parameters: int = 0
    members: tuple[MemberInfo, ...] = ()
    stats: JobStats = field(default_factory=JobStats)
    # Members that went silent past the member timeout and have not registered again (a dead
    # worker or relay; last_seen_s: seconds since it was dropped). Members that said goodbye
    # (finished) are not here; the list empties when the job ends.
    lost: tuple[MemberInfo, ...] = ()
    inner_loop: bool = False     # an outer job whose region's inner loop runs at this tier

    @property
    def lag_versions(self) -> int:
        return max(0, self.parent_version - self.version)


@dataclass(frozen=True)
class TierStatus:
    """What a tier answers ``Status``: itself, its jobs, its relay children."""

    role: str
    name: str
    server_epoch: int
    parent: str
    parent_reachable: bool
    ready: bool
    uptime_s: float
    jobs: tuple[JobStatus, ...] = ()
    children: tuple[MemberInfo, ...] = ()
    insecure: bool = False  # plaintext, no client certificates (`hps status` says so loudly)
    tokens_required: bool = False  # False: the tier accepts calls without tokens (as the wire says)
    term: int = 0          # a root's fencing term (rises on every promotion of a standby)
    root_state: str = ""   # a root: "primary", "standby" or "fenced"
    parents: tuple[str, ...] = ()  # a relay's parents as configured, tried in order (issue 15)
    parent_switches: int = 0       # times the relay moved to another of its parents
    parent_cut_off_s: float = 0.0  # seconds no parent has answered (0: one does)


# What a Follow stream carries (hps.proto, LogEntry.Kind), in wire order.
LOG_KINDS = ("follow", "hello", "state", "declared", "ended", "record", "roster", "synced", "ack", "beat",
             "tokens", "token", "kept")


@dataclass(frozen=True)
class LogMessage:
    """One message of a standby's Follow stream (see ``LogEntry`` in hps.proto): ``data`` is the
    whole payload (a checkpoint file, a log record's bytes, JSON), however many frames it took."""

    kind: str
    job: str = ""
    version: int = 0
    term: int = 0
    epoch: int = 0
    seq: int = 0
    data: bytes = b""
