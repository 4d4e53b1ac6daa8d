"""Membership, BSP rounds and SSP/async windows (pure, time injected; exactly-once: ps.core.exactly_once).

>>> members = Membership()
>>> _ = members.join("w0", now=0.0, first_round=0), members.join("w1", now=0.0, first_round=0)
>>> rnd = BspRound(round=0, numel=3)
>>> rnd.add("w0", base_version=0, grad=np.ones(3, np.float32), contributors=1, clocks=(0, 0))
>>> rnd.complete(members)                       # w1 still holds the round
False
>>> rnd.add("w1", base_version=0, grad=np.ones(3, np.float32), contributors=1, clocks=(0, 0))
>>> agg = rnd.close()                           # sum, contributors, clock range
>>> agg.grad, agg.contributors
(array([2., 2., 2.], dtype=float32), 2)

A round r aggregates gradients computed on version r. It is complete when every live member
expected in it (joined at or before r) has pushed: a member that stops heart-beating is
dropped and no longer holds the round (DESIGN: "a worker that dies leaves the barrier").

SSP and async jobs aggregate in a ``Window`` instead: pushes on any base version, closed after
a time window or a byte budget. Each member carries a clock floor (how many of its workers'
pushes are included once its pushes are applied); a tier's floor is the minimum over its live
members, and the root stamps it on every version for SSP's wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ps.core.errors import BadInput, NotMember, NotReady, Stale, short
from ps.core.pieces import Pieces
from ps.core.types import NO_STEP, StepInfo

# A push's gradient as a tier receives it (its decoded chunks), or a vector.
Gradient = np.ndarray | Pieces

__all__ = ["Member", "Membership", "BspRound", "Window", "Aggregate", "Gradient", "MAX_CONTRIBUTORS", "dense"]


@dataclass
class Member:
    id: str
    role: str
    address: str
    first_round: int
    last_seen: float
    pushes: int = 0
    floor: int = 0  # SSP clock floor this member reported with its latest accepted push
    workers: int = 1  # live workers at or below it, as its latest accepted push reported
    incarnation: int = 0  # the member process's incarnation, as it registered
    in_flight: int = 0  # its pushes being received or waiting for their batch here
    joined: float = 0.0  # when this incarnation joined here


class Membership:
    """Live children of one tier for one job."""

    def __init__(self) -> None:
        self._m: dict[str, Member] = {}

    def __len__(self) -> int:
        return len(self._m)

    def __contains__(self, member: str) -> bool:
        return member in self._m

    def __iter__(self):
        return iter(self._m.values())

    def find(self, member: str) -> Member | None:
        return self._m.get(member)

    def get(self, member: str) -> Member:
        try:
            return self._m[member]
        except KeyError:
            raise NotMember(f"{short(member)} is not a registered member of this job here; register "
                            "first") from None

    def join(self, member: str, now: float, first_round: int, role: str = "worker",
             address: str = "", floor: int = 0, incarnation: int = 0) -> Member:
        old = self._m.get(member)
        if old is not None and old.incarnation == incarnation:
            # Re-registration keeps the place it had in the rounds.
            old.last_seen, old.role, old.address = now, role, address
            return old
        # New, or a new incarnation replacing a dead one (the caller dropped its contribution).
        m = Member(member, role, address, first_round, now, floor=floor, incarnation=incarnation, joined=now)
        self._m[member] = m
        return m

    def touch(self, member: str, now: float) -> bool:
        m = self._m.get(member)
        if m is None:
            return False
        m.last_seen = now
        return True

    def leave(self, member: str) -> bool:
        return self._m.pop(member, None) is not None

    def excuse(self, seconds: float, now: float) -> None:
        """The tier was not listening for ``seconds`` up to ``now`` (its own process or event
        loop stalled): that is not its members' silence, so it does not count towards their
        timeout (a member is never seen later than ``now``).

        >>> ms = Membership(); _ = ms.join("w1", now=10.0, first_round=0); _ = ms.join("w2", now=12.9, first_round=0)
        >>> ms.excuse(2.5, now=13.0); ms.expire(now=13.0, timeout=1.0)
        []
        >>> [m.last_seen for m in ms]
        [12.5, 13.0]
        >>> ms.expire(now=13.6, timeout=1.0)
        ['w1']
        """
        for m in self._m.values():
            m.last_seen = min(m.last_seen + seconds, now)

    def expire(self, now: float, timeout: float) -> list[str]:
        gone = [k for k, m in self._m.items() if now - m.last_seen > timeout]
        for k in gone:
            del self._m[k]
        return gone

    def expected_in(self, round_: int) -> set[str]:
        return {k for k, m in self._m.items() if m.first_round <= round_}

    def workers(self) -> int:
        """Live workers below this tier (each member counts what it last reported; at least 1)."""
        return max(1, sum(m.workers for m in self._m.values()))

    def floor(self, default: int) -> int:
        """The clock floor below this tier: the slowest live member's (``default`` if none)."""
        return min((m.floor for m in self._m.values()), default=default)


# The most worker gradients one push or one batch may sum: far beyond any cluster, and far
# below the u32 a relay's PushHeader carries, so an aggregate can always be forwarded (a count
# past 2^32-1 once made a zone's forward raise and wedged the round).
MAX_CONTRIBUTORS = 1 << 24


def _first(grad: Gradient, owned: bool) -> Gradient:
    """A batch's running sum from its first gradient: the array itself when the caller gives it
    away (float32, contiguous, writable), else a copy. The copy was 6% of a root's profile
    under 400 MB pushes (benchmarks/README.md, dataplane.py). Pieces stay pieces (immutable):
    a batch of one push is never laid out here."""
    if isinstance(grad, Pieces):
        return grad
    if owned and grad.dtype == np.float32 and grad.flags.c_contiguous and grad.flags.writeable:
        return grad
    return np.array(grad, dtype=np.float32, copy=True)


def _summed(total: Gradient, grad: Gradient) -> np.ndarray:
    """``total + grad`` into ``total``'s memory (a first push still in pieces is laid out now,
    once); ``grad`` in pieces is added straight from its chunks."""
    if isinstance(total, Pieces):
        total = total.dense()
    if isinstance(grad, Pieces):
        grad.add_to(total)
    else:
        with np.errstate(over="ignore"):  # an overflow is refused when the batch closes
            total += grad
    return total


def dense(grad: Gradient) -> np.ndarray:
    """A closed batch's gradient as one vector (one push's pieces laid out now)."""
    return grad.dense() if isinstance(grad, Pieces) else grad


def _check_contributors(pushed: dict[str, int], contributors: int) -> None:
    if contributors < 0 or sum(pushed.values()) + contributors > MAX_CONTRIBUTORS:
        raise BadInput(f"a push of {contributors} contributors takes its batch past {MAX_CONTRIBUTORS} "
                       "worker gradients")


@dataclass(frozen=True)
class Aggregate:
    """A closed round: the summed gradient and who is in it."""

    round: int          # BSP: the round; windows: the smallest base version included
    grad: Gradient      # the sum; a batch of one push: its pieces (``dense(agg.grad)``)
    contributors: int
    clock_min: int
    clock_max: int
    members: tuple[str, ...]
    nbytes: int = 0     # payload bytes received for it
    step: StepInfo = NO_STEP  # the contributions' step information, merged


@dataclass
class BspRound:
    """Running sum of one round's pushes."""

    round: int
    numel: int
    pushed: dict[str, int] = field(default_factory=dict)  # member -> contributors it brought
    _sum: Gradient | None = None
    _clock_min: int | None = None
    _clock_max: int | None = None
    _step: StepInfo | None = None

    def check(self, member: str, base_version: int, contributors: int = 0, step: StepInfo | None = None) -> None:
        """Raise unless ``member`` may push for this round now (changes nothing)."""
        if base_version < self.round:
            raise Stale(f"gradient computed on version {base_version}, but round {self.round} is "
                        "open here; the round it belonged to has closed: pull and recompute",
                        wait_version=self.round)
        if base_version > self.round:
            raise NotReady(f"gradient computed on version {base_version}, ahead of this tier's round "
                           f"{self.round}; the tier is still catching up, retry shortly")
        if member in self.pushed:
            raise BadInput(f"{short(member)} already pushed for round {self.round} with another sequence number")
        _check_contributors(self.pushed, contributors)
        if step is not None and self._step is not None and contributors > 0:
            differ = self._step.agrees(step)
            if differ:
                raise BadInput(f"the workers of round {self.round} disagree on a hyperparameter ({differ}); in "
                               "bsp every worker must step its learning-rate schedule the same way")

    def add(self, member: str, base_version: int, grad: Gradient | None, contributors: int,
            clocks: tuple[int, int], step: StepInfo | None = None, owned: bool = False) -> None:
        """Add a push to the round. ``owned``: ``grad`` is the caller's to give away (never used
        again), so the first one becomes the sum uncopied; a push's ``Pieces`` always are."""
        self.check(member, base_version, contributors, step)
        if grad is not None and contributors > 0:
            step = step or StepInfo()
            self._step = step if self._step is None else self._step.merge(step)
            self._sum = _first(grad, owned) if self._sum is None else _summed(self._sum, grad)
            lo, hi = clocks
            self._clock_min = lo if self._clock_min is None else min(self._clock_min, lo)
            self._clock_max = hi if self._clock_max is None else max(self._clock_max, hi)
        self.pushed[member] = contributors

    def lay_out(self) -> None:
        """Lay a first push still in pieces out as the running sum now (the round waits for more:
        the pass then overlaps their arrival instead of delaying the next one's commit)."""
        if isinstance(self._sum, Pieces):
            self._sum = self._sum.dense()

    def complete(self, members: Membership) -> bool:
        expected = members.expected_in(self.round)
        if not expected and not self.pushed:
            return False  # nobody here for this round: nothing to aggregate
        return expected.issubset(self.pushed)

    def close(self) -> Aggregate:
        total = sum(self.pushed.values())
        grad = self._sum if self._sum is not None else np.zeros(self.numel, dtype=np.float32)
        return Aggregate(self.round, grad, total, self._clock_min or 0, self._clock_max or 0,
                         tuple(self.pushed), step=self._step or StepInfo())


@dataclass
class Window:
    """An SSP/async aggregation window: any base versions, one push per member, closed on time
    or bytes. ``base_min`` (the oldest base included) measures staleness at the root."""

    numel: int
    opened: float | None = None
    nbytes: int = 0
    pushed: dict[str, int] = field(default_factory=dict)
    base_min: int | None = None
    _sum: Gradient | None = None
    _clock_min: int | None = None
    _clock_max: int | None = None
    _step: StepInfo | None = None

    # async: a sender may keep several pushes in flight (MAX_IN_FLIGHT), so two of them can
    # land in one window and are summed; ssp senders keep one, so their clock floors arrive in
    # order (a later push's floor must never overtake an earlier push's gradients).
    repeats: bool = False

    def check(self, member: str, contributors: int = 0) -> None:
        if member in self.pushed and not self.repeats:
            raise BadInput(f"{short(member)} pushed twice into one aggregation window; an ssp sender keeps "
                           "one push in flight and sums gradients meanwhile")
        _check_contributors(self.pushed, contributors)

    def add(self, member: str, base_version: int, grad: Gradient | None, contributors: int,
            clocks: tuple[int, int], nbytes: int, now: float, step: StepInfo | None = None,
            owned: bool = False) -> None:
        """Add a push to the window (``owned``: as ``BspRound.add``)."""
        self.check(member, contributors)
        if self.opened is None:
            self.opened = now
        if grad is not None and contributors > 0:
            # ssp/async: pushes computed at different clocks may share a window; the newest
            # clock's hyperparameters are the window's (a schedule only moves forward).
            step = step or StepInfo()
            newer = self._clock_max is None or clocks[1] >= self._clock_max
            self._step = step if self._step is None else self._step.merge(step, other_newer=newer)
            self._sum = _first(grad, owned) if self._sum is None else _summed(self._sum, grad)
            self.base_min = base_version if self.base_min is None else min(self.base_min, base_version)
            lo, hi = clocks
            self._clock_min = lo if self._clock_min is None else min(self._clock_min, lo)
            self._clock_max = hi if self._clock_max is None else max(self._clock_max, hi)
        self.pushed[member] = self.pushed.get(member, 0) + contributors
        self.nbytes += nbytes

    def due(self, now: float, flush_s: float, flush_bytes: int) -> bool:
        if not self.pushed or self.opened is None:
            return False
        return now - self.opened >= flush_s or self.nbytes >= flush_bytes

    def close(self, default_base: int) -> Aggregate:
        total = sum(self.pushed.values())
        grad = self._sum if self._sum is not None else np.zeros(self.numel, dtype=np.float32)
        base = self.base_min if self.base_min is not None else default_base
        return Aggregate(base, grad, total, self._clock_min or 0, self._clock_max or 0,
                         tuple(self.pushed), self.nbytes, self._step or StepInfo())
