"""The arithmetic of an ``outer`` job's region (pure): fragments, pseudo-gradients, rebasing.

>>> from ps.core.view import KeySpec, Layout
>>> layout = Layout([KeySpec("a", (4,)), KeySpec("b", (2,)), KeySpec("c", (2,))])
>>> plan = OuterPlan(layout, inner_steps=4, fragments=2)
>>> plan.keys                                   # each fragment's keys, balanced by elements
((0,), (1, 2))
>>> plan.fragment(outer_version=5), plan.period  # fragments in turn, one every H // F inner steps
(1, 2)
>>> base = np.zeros(8, np.float32); params = np.arange(8, dtype=np.float32)
>>> delta = plan.pseudo_gradient(base, params, 1, workers=2)  # (base - params) * workers
>>> delta.tolist()
[0.0, 0.0, 0.0, 0.0, -8.0, -10.0, -12.0, -14.0]
>>> plan.absent(1)                               # what the root's outer optimizer leaves alone
(0,)
>>> plan.rebase(params, base, np.full(8, 9, np.float32), 1); params.tolist(), base.tolist()
([0.0, 1.0, 2.0, 3.0, 9.0, 9.0, 9.0, 9.0], [0.0, 0.0, 0.0, 0.0, 9.0, 9.0, 9.0, 9.0])

DiLoCo (Douillard et al. 2023): a region trains H inner steps from the outer parameters
``base``; its pseudo-gradient is ``base - params``; the root averages the regions' (by workers,
as bsp averages by workers) and takes one outer optimizer step on it, whose result every
region takes as its new ``params`` and ``base``. Streaming DiLoCo (2501.18512) syncs the
parameters in F fragments, one every H // F inner steps, so each fragment syncs once every
F * (H // F) <= H steps and the WAN carries a 1/F share at a time.

Inner version numbers follow the outer ones: a region's inner lineage starts at
``outer_version * stride`` and every sync publishes one version (the rebase), so the inner
versions between two syncs are ``u * stride .. u * stride + period``. A restarted region can
then tell, from the version a child last held, how many inner steps it lost (``lost_steps``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ps.core.config import JobConfig
from ps.core.errors import BadInput
from ps.core.view import Layout

__all__ = ["OuterPlan", "check_outer_member", "above_inner", "Pace", "StepRate", "dynamic_period", "PendingProgress"]

_RANK = {"worker": 0, "zone": 1, "regional": 2, "global": 3}


def above_inner(cfg: JobConfig, tier_role: str) -> bool:
    """Whether a tier of ``tier_role`` stands above ``cfg``'s inner loop (only pseudo-gradients
    reach it): the root, and a regional master above zones that run the inner loop."""
    return cfg.outer is not None and _RANK[tier_role] > _RANK[cfg.outer.inner_tier]


def check_outer_member(cfg: JobConfig, tier_role: str, member: str, member_role: str) -> None:
    """Above an outer job's inner loop only pseudo-gradients travel: a tier there takes members
    of the inner tier's role (or between), never a worker or a relay below the inner loop, whose
    raw gradients the outer optimizer would take for pseudo-gradients. BadInput says where it
    belongs.

    >>> from ps.core.config import JobConfig
    >>> try:
    ...     check_outer_member(JobConfig(name="lm", mode="outer"), "global", "eu-a", "zone")
    ... except BadInput as exc:
    ...     print(str(exc)[:90])
    job lm is an outer job whose inner loop runs at the regional tier; zone 'eu-a' cannot join
    """
    if cfg.outer is None:
        return
    inner = cfg.outer.inner_tier
    if _RANK[tier_role] > _RANK[inner] and not _RANK[inner] <= _RANK.get(member_role, 0) < _RANK[tier_role]:
        where = "a regional master" if inner == "regional" else "a zone"
        raise BadInput(f"job {cfg.name} is an outer job whose inner loop runs at the {inner} tier; "
                       f"{member_role} {member!r} cannot join it at the {tier_role} tier: put it below {where}"
                       + (" (or create the job with inner_tier 'zone')" if inner == "regional" else ""))


class OuterPlan:
    """Where each fragment lives in the flat vector and when it syncs."""

    def __init__(self, layout: Layout, inner_steps: int, fragments: int) -> None:
        self.layout = layout
        self.inner_steps = inner_steps
        self.period = inner_steps // fragments
        # Keys in order, cut into F runs of about numel / F elements each (a key is never split:
        # the optimizer's per-key state and the absent list are per key). Fewer keys than
        # fragments leaves some fragments empty; they still take their turn.
        specs = list(layout)
        target = layout.numel / fragments
        keys: list[list[int]] = [[] for _ in range(fragments)]
        acc = 0
        for i, s in enumerate(specs):
            f = min(fragments - 1, int(acc // target)) if target else 0
            keys[f].append(i)
            acc += s.numel
        self.keys = tuple(tuple(k) for k in keys)
        self.names = tuple(frozenset(specs[i].key for i in k) for k in self.keys)
        self._spans = tuple(tuple((layout.offset(specs[i].key), specs[i].numel) for i in k) for k in self.keys)
        self._buffers = frozenset(i for i, s in enumerate(specs) if s.kind == "buffer")

    @property
    def fragments(self) -> int:
        return len(self.keys)

    @property
    def stride(self) -> int:
        """Inner versions per outer version: ``period`` inner steps and the rebase."""
        return self.period + 1

    def fragment(self, outer_version: int) -> int:
        """The fragment the sync based on ``outer_version`` carries (every region agrees)."""
        return outer_version % self.fragments

    def absent(self, fragment: int) -> tuple[int, ...]:
        """Key indices a sync of ``fragment`` carries no gradient for (sorted)."""
        inside = set(self.keys[fragment])
        return tuple(i for i in range(len(self.layout.specs)) if i not in inside)

    def buffers(self, fragment: int) -> bool:
        """Whether ``fragment`` holds buffer keys (a sync then carries their values)."""
        return any(i in self._buffers for i in self.keys[fragment])

    def pseudo_gradient(self, base: np.ndarray, params: np.ndarray, fragment: int, workers: int,
                        out: np.ndarray | None = None) -> np.ndarray:
        """``(base - params) * workers`` on ``fragment``'s keys, zero elsewhere: the sum a bsp
        round of ``workers`` would send, so the root's average weighs regions by workers.
        Buffer keys carry ``params * workers`` (values, averaged at the root as in bsp)."""
        out = np.zeros_like(params) if out is None else out
        out.fill(0.0)
        w = np.float32(workers)
        for i, (off, n) in zip(self.keys[fragment], self._spans[fragment], strict=True):
            sl = slice(off, off + n)
            if i in self._buffers:
                np.multiply(params[sl], w, out=out[sl])
            else:
                np.subtract(base[sl], params[sl], out=out[sl])
                out[sl] *= w
        return out

    def rebase(self, params: np.ndarray, base: np.ndarray, outer: np.ndarray, fragment: int,
               sent: np.ndarray | None = None) -> None:
        """Take the outer values of ``fragment`` as the region's parameters and new base (in
        place: the inner optimizer's tensors are views of ``params``). ``sent``: the parameters
        when the pseudo-gradient left (overlap); what the region trained since is kept on top,
        and goes with the next pseudo-gradient (``base - params`` holds it)."""
        for off, n in self._spans[fragment]:
            sl = slice(off, off + n)
            if sent is not None:
                params[sl] -= sent[sl]
                params[sl] += outer[sl]
            else:
                params[sl] = outer[sl]
            base[sl] = outer[sl]

    def norm(self, delta: np.ndarray, fragment: int, workers: int) -> float:
        """The L2 norm of the pseudo-gradient (per worker: ``delta`` is scaled by ``workers``)."""
        sq = 0.0
        for i, (off, n) in zip(self.keys[fragment], self._spans[fragment], strict=True):
            if i not in self._buffers:
                part = delta[off:off + n].astype(np.float64)
                sq += float(part @ part)
        return float(np.sqrt(sq)) / max(1, workers)

    def start_version(self, outer_version: int) -> int:
        """The inner version a region's lineage starts at when its base is ``outer_version``."""
        return outer_version * self.stride

    def lost_steps(self, old_version: int, outer_version: int) -> int:
        """Inner steps a region's old lineage held at ``old_version`` that are in no outer
        version, when the outer view is now at ``outer_version``: those since its last sync,
        unless its pending sync (all ``period`` steps done) made it into a later outer version.
        It assumes each sync landed when due (inner versions ``stride`` apart): after a failed
        or postponed sync, with dynamic steps or overlap, the rebases fall elsewhere and this
        is a lower bound, as with asynchronous outer steps (the outer version also moves with
        the other regions' syncs, so a pending sync that did not make it may count as made),
        and with fragments: the steps the other F - 1 fragments held since their own syncs (up
        to (F - 1) * period more; the version alone does not say how old the lineage was) are
        not counted."""
        synced_to, steps = divmod(old_version, self.stride)
        if steps == self.period and outer_version > synced_to:
            return 0
        return steps


# Dynamic local steps (OuterConfig.dynamic_steps; Async Local-SGD's DyLU, Liu et al. 2024):
# every region syncs after about the same wall time, the fastest after ``period`` steps.

def dynamic_period(period: int, rate: float, pace: float) -> int:
    """A region's inner steps per sync: ``period`` scaled by its speed against the fastest
    region's (``pace``), at least 1 and at most ``period``; ``period`` while either is unknown.

    >>> dynamic_period(10, rate=5.0, pace=10.0), dynamic_period(10, 1.0, 40.0), dynamic_period(10, 12.0, 10.0)
    (5, 1, 10)
    >>> dynamic_period(10, 0.0, 10.0), dynamic_period(10, 5.0, 0.0)
    (10, 10)
    """
    if rate <= 0 or pace <= 0:
        return period
    return max(1, min(period, round(period * rate / pace)))


class StepRate:
    """A region's inner steps per second, timed from one inner version to the next, leaving out
    the time the region spent waiting for its own syncs (so a region that waits on the WAN does
    not read as slow and shrink its H further). Smoothed across syncs.

    >>> r = StepRate()
    >>> for t in (0.0, 0.5, 1.0, 1.5):  # a step every 0.5 s
    ...     r.step(t)
    >>> r.waited(2.0); r.step(4.0)      # 2 s of it waiting for a sync: 0.5 s of training
    >>> r.close()                       # at a sync: this interval's rate joins the average
    2.0
    >>> r.step(4.25); r.step(4.5); r.close()   # 4 steps per second now: halfway there
    3.0
    """

    def __init__(self, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self.rate = 0.0        # the smoothed inner steps per second (0: not measured yet)
        self._last: float | None = None
        self._steps = 0
        self._seconds = 0.0
        self._waited = 0.0

    def step(self, now: float) -> None:
        """An inner step was published at ``now``."""
        if self._last is not None:
            self._steps += 1
            self._seconds += max(0.0, now - self._last - self._waited)
        self._last, self._waited = now, 0.0

    def skip(self, now: float) -> None:
        """An inner version that trained nothing (its workers waited for data) at ``now``: the
        time since the last step was not training."""
        self._last, self._waited = now, 0.0

    def waited(self, seconds: float) -> None:
        """The region waited ``seconds`` for a sync since the last step."""
        self._waited += seconds

    def close(self) -> float:
        """A sync is sent: fold the steps since the last one into the rate; return it."""
        if self._steps and self._seconds > 0:
            fresh = self._steps / self._seconds
            self.rate = fresh if self.rate == 0 else self.smoothing * self.rate + (1 - self.smoothing) * fresh
        self._steps, self._seconds = 0, 0.0
        return self.rate


class Pace:
    """At the root: the regions' inner step rates as their pseudo-gradients report them, and the
    fastest (what each region's H is scaled against). A region not heard from for ``horizon``
    times its own interval between reports (at least ``min_horizon_s``) has stopped or died and
    no longer counts, so a dead fast region does not keep the others' H small.

    >>> pace = Pace()
    >>> pace.heard("eu", 10.0, now=0.0); pace.heard("us", 5.0, now=0.5)
    >>> pace.fastest(now=1.0)
    10.0
    >>> pace.heard("us", 5.0, now=31.0); pace.fastest(now=60.0)   # eu silent for a minute
    5.0
    >>> pace.heard("eu", 10.0, now=61.0); pace.forget("eu"); pace.fastest(now=62.0)  # eu left
    5.0
    """

    def __init__(self, horizon: float = 4.0, min_horizon_s: float = 30.0) -> None:
        self.horizon, self.min_horizon_s = horizon, min_horizon_s
        self._heard: dict[str, tuple[float, float, float]] = {}  # source: (rate, when, interval)

    def heard(self, source: str, rate: float, now: float) -> None:
        if not rate > 0:
            return
        prev = self._heard.get(source)
        self._heard[source] = (rate, now, now - prev[1] if prev is not None else 0.0)
        if len(self._heard) > 4096:  # bounded: sources are regions (or zones), never workers
            self._heard.pop(next(iter(self._heard)))

    def forget(self, source: str) -> None:
        """``source`` left the job."""
        self._heard.pop(source, None)

    def fastest(self, now: float) -> float:
        best = 0.0
        for source, (rate, when, interval) in list(self._heard.items()):
            if now - when > max(self.min_horizon_s, self.horizon * interval):
                del self._heard[source]
            else:
                best = max(best, rate)
        return best


class PendingProgress:
    """Leased data a region trained (its inner versions' ``StepInfo.progress``), held until the
    data's gradient is in the outer model: after a sync of every fragment succeeded, so the root
    counts a sample as trained iff every fragment of its gradient was applied there. ``due(f)``
    is what a sync of fragment ``f`` carries; ``synced(n, f)`` when it succeeded (``n``: what
    ``due`` saw; data trained after it waits for the next syncs). Counted by fragment, not by
    sync: a synchronous region's fragment follows the outer version, so after a failed sync the
    next may be of a fragment synced already, and counting syncs sent the data up as trained
    with one fragment of it still only here (review).

    >>> p = PendingProgress(fragments=2)
    >>> p.add(((0, 3, 8),)); n, carried = p.due(0); carried     # one fragment of it is not enough
    ()
    >>> p.synced(n, 0); p.add(((0, 3, 16), (0, 4, 4))); n, carried = p.due(0); carried  # fragment 0 again
    ()
    >>> p.synced(n, 0); n, carried = p.due(1); carried   # fragment 1 completes both
    ((0, 3, 16), (0, 4, 4))
    >>> p.synced(n, 1); bool(p)
    False
    """

    def __init__(self, fragments: int) -> None:
        self.fragments = fragments
        self._items: list[tuple[dict, set[int]]] = []  # ({(epoch, shard): furthest end}, fragments still needed)
        self._open = False            # the last item takes more data (no sync has seen it yet)

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, entries: Iterable[tuple[int, int, int]]) -> None:
        if not entries:
            return
        if not self._open:
            self._items.append(({}, set(range(self.fragments))))
            self._open = True
        furthest = self._items[-1][0]
        for e, s, end in entries:
            furthest[(e, s)] = max(end, furthest.get((e, s), end))

    def due(self, fragment: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """(how many items a sync of ``fragment`` covers, the progress it completes: furthest
        per shard, of the items it is the last fragment of)."""
        self._open = False
        furthest: dict[tuple[int, int], int] = {}
        for done, left in self._items:
            if left == {fragment}:
                for k, end in done.items():
                    furthest[k] = max(end, furthest.get(k, end))
        return len(self._items), tuple((e, s, end) for (e, s), end in sorted(furthest.items()))

    def furthest(self, epoch: int, shard: int) -> int:
        """The furthest offset of (epoch, shard) trained here and not yet at the root (0: none)."""
        return max((done.get((epoch, shard), 0) for done, _ in self._items), default=0)

    def synced(self, n: int, fragment: int) -> None:
        for _, left in self._items[:n]:
            left.discard(fragment)
        self._items = [item for item in self._items if item[1]]

    def clear(self) -> None:
        self._items, self._open = [], False
