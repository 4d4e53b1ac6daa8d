"""Leased data shards: each sample of an epoch is trained once, even when workers die.

>>> book = LeaseBook()
>>> book.declare(Dataset(length=40, shard_size=16, lease_timeout_s=30))   # shards of 16, 16, 8
True
>>> book.lease("a", 1, epoch=0, now=0.0)
Grant(status='granted', epoch=0, shard=0, start=0, end=16, current_epoch=0, lost=())
>>> book.lease("b", 1, epoch=0, now=0.0).shard                          # (a caller lists what it
1
>>> book.lease("b", 1, epoch=0, now=0.0, held=((0, 1),)).shard          #  holds: see ``lease``)
2
>>> book.lease("c", 1, epoch=0, now=1.0).status     # every shard left is held by someone
'wait'
>>> book.progress([(0, 0, 8)], now=2.0)             # a's first 8 samples were applied
1
>>> book.lease("c", 1, epoch=0, now=40.0)           # a went silent: its lease expired
Grant(status='granted', epoch=0, shard=0, start=8, end=16, current_epoch=0, lost=())
>>> book.progress([(0, 0, 16), (0, 1, 16), (0, 2, 8)], now=41.0)
3
>>> book.lease("a", 1, epoch=0, now=42.0).status, 0 in book.finished
('done', True)

The dataset is declared once per job (the first declarer wins; another declaration is a
Conflict). Shard ``s`` of epoch ``e`` is a fixed slice of a seeded permutation of the sample
indices (``worker.sampler.shard_indices``), the same on every worker, so a shard handed to
another worker resumes exactly where the last one stopped: at its ``done`` offset, the samples
whose gradients the root has applied. The root records progress with the version that applies
it (and replays it from its write-ahead log), so a sample counts as trained iff its gradient
was applied.

A lease lasts ``lease_timeout_s`` after its holder's last renewal (any lease call) or the last
progress on its shard; then the shard goes back to the pool. A new incarnation of a worker id
(a restarted process) gives its predecessor's leases back at once. Answers: ``granted`` (a
shard, from its done offset to its end), ``wait`` (every unfinished shard is held by others;
ask again), ``done`` (nothing left to lease in this epoch for the caller: every shard is trained
or held by it), ``renewed`` (a renewal that asked for no new shard).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ps.core.errors import BadInput, Conflict, Exhausted, NotReady

__all__ = ["Dataset", "Grant", "LeaseBook", "GRANTED", "WAIT", "DONE", "RENEWED", "MAX_SHARDS", "check_epoch"]

GRANTED, WAIT, DONE, RENEWED = "granted", "wait", "done", "renewed"
MAX_SHARDS = 1 << 20        # per epoch (a lease scans them: keep shards large)
MAX_OPEN_EPOCHS = 64        # unfinished epochs held at once
MAX_EPOCH = 1 << 40
MAX_MEMBERS_SEEN = 4096     # worker ids whose incarnations are remembered (the least recent forgotten first)
_OLDER_KEPT = 8             # replaced incarnations remembered per worker id


@dataclass(frozen=True)
class Dataset:
    """A job's dataset as the root leases it: ``length`` samples in shards of ``shard_size``.

    >>> Dataset(length=10, shard_size=4).shards, Dataset(length=10, shard_size=4).shard_len(2)
    (3, 2)
    >>> Dataset(length=0, shard_size=4)
    Traceback (most recent call last):
    ps.core.errors.BadInput: a dataset needs length >= 1 and shard_size >= 1, got length 0, shard_size 4
    """

    length: int
    shard_size: int
    seed: int = 0
    lease_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.length < 1 or self.shard_size < 1:
            raise BadInput(f"a dataset needs length >= 1 and shard_size >= 1, got length {self.length}, "
                           f"shard_size {self.shard_size}")
        if self.shards > MAX_SHARDS:
            raise BadInput(f"{self.length} samples in shards of {self.shard_size} make {self.shards} shards; "
                           f"at most {MAX_SHARDS} (use larger shards)")
        if not 0 <= self.seed < 1 << 63:
            raise BadInput(f"a dataset's seed must be in [0, 2**63), got {self.seed}")
        if not (math.isfinite(self.lease_timeout_s) and 0 < self.lease_timeout_s <= 86400):
            raise BadInput(f"lease_timeout_s must be in (0, 86400], got {self.lease_timeout_s!r}")

    @property
    def shards(self) -> int:
        return -(-self.length // self.shard_size)

    def shard_len(self, shard: int) -> int:
        return min(self.shard_size, self.length - shard * self.shard_size)


@dataclass(frozen=True)
class Grant:
    """The answer to a lease call (see the module's docstring for ``status``)."""

    status: str
    epoch: int
    shard: int = -1          # granted: the shard, its samples [start, end) (offsets in the shard)
    start: int = 0
    end: int = 0
    current_epoch: int = 0   # the newest epoch any worker has leased from
    lost: tuple[tuple[int, int], ...] = ()  # (epoch, shard) the caller said it held and does not


class LeaseBook:
    """One job's dataset, the trained (``done``) offset of every shard, and who holds which."""

    def __init__(self) -> None:
        self.dataset: Dataset | None = None
        self.done: dict[int, list[int]] = {}   # unfinished epoch -> done offset per shard
        self.finished: set[int] = set()        # epochs every sample of which was trained
        self.current_epoch = 0
        self._holders: dict[tuple[int, int], list] = {}  # (epoch, shard) -> [member, incarnation, expires]
        self._left: dict[int, int] = {}        # unfinished epoch -> shards not yet done
        # member -> its incarnations in the order first seen here, newest last (memory only)
        self._seen: OrderedDict[str, list[int]] = OrderedDict()

    def declare(self, ds: Dataset) -> bool:
        """The job's dataset; True when this call declared it."""
        if self.dataset is None:
            self.dataset = ds
            return True
        if ds != self.dataset:
            raise Conflict(f"this job's dataset is declared as {_describe(self.dataset)}; this worker "
                           f"declares {_describe(ds)}. Every worker of a job must agree")
        return False

    def holders(self) -> dict[tuple[int, int], str]:
        return {k: h[0] for k, h in self._holders.items()}

    # -- leasing ---------------------------------------------------------------------------------
    def lease(self, member: str, incarnation: int, epoch: int, now: float, want: bool = True,
              held: tuple[tuple[int, int], ...] = ()) -> Grant:
        """Renew ``member``'s leases that ``held`` lists (every shard the caller holds), take back
        those of ``held`` nobody else holds, and (``want``) hand it the first unfinished, unheld
        shard of ``epoch`` -- or again the one it holds there and does not list (a retried call
        whose answer was lost). A lease it does not list is not renewed and expires."""
        ds = self._declared()
        check_epoch(epoch)
        self._incarnation(member, incarnation)
        self.expire(now)
        for key in [k for k, h in self._holders.items() if h[0] == member and h[1] != incarnation]:
            del self._holders[key]  # its predecessor died: back to the pool, from the done offset
        listed = set(held)
        for key, h in self._holders.items():
            # Only what the caller says it holds: one it does not list (an answer it never got, a
            # shard its loop left) is not renewed -- renewed forever, nobody trained it.
            if h[0] == member and key in listed:
                h[2] = now + ds.lease_timeout_s
        for e, s in held:  # after a root restart (leases it had not saved) or a late renewal
            if (e, s) not in self._holders and e in self.done and 0 <= s < ds.shards \
                    and self.done[e][s] < ds.shard_len(s):
                self._holders[(e, s)] = [member, incarnation, now + ds.lease_timeout_s]
        lost = tuple((e, s) for e, s in held if self._holders.get((e, s), [None])[0] != member)
        if epoch in self.finished:
            return Grant(DONE, epoch, current_epoch=self.current_epoch, lost=lost)
        if not want:
            return Grant(RENEWED, epoch, current_epoch=self.current_epoch, lost=lost)
        done = self._epoch(epoch)
        self.current_epoch = max(self.current_epoch, epoch)
        for (e, s), h in self._holders.items():
            # Held by this very caller but not listed: granted to a call whose answer it never
            # got (the call is retried). The same shard again, from its done offset.
            if e == epoch and h[0] == member and h[1] == incarnation and (e, s) not in listed:
                h[2] = now + ds.lease_timeout_s
                return Grant(GRANTED, epoch, s, done[s], ds.shard_len(s), self.current_epoch, lost)
        mine = False
        for s, offset in enumerate(done):
            if offset >= ds.shard_len(s):
                continue
            holder = self._holders.get((epoch, s))
            if holder is None:
                self._holders[(epoch, s)] = [member, incarnation, now + ds.lease_timeout_s]
                return Grant(GRANTED, epoch, s, offset, ds.shard_len(s), self.current_epoch, lost)
            mine = mine or holder[0] != member
        return Grant(WAIT if mine else DONE, epoch, current_epoch=self.current_epoch, lost=lost)

    def _incarnation(self, member: str, incarnation: int) -> None:
        """Conflict for a process of ``member`` that a newer one replaced (an incarnation first
        seen here before the newest). A partitioned old pod whose replacement runs under its id
        took every one of the new one's leases back and re-adopted its own, so a third worker
        was granted the new one's shard while both trained theirs (review)."""
        seen = self._seen.get(member)
        if seen is None:
            seen = self._seen[member] = []
        self._seen.move_to_end(member)
        while len(self._seen) > MAX_MEMBERS_SEEN:
            self._seen.popitem(last=False)
        if seen and seen[-1] == incarnation:
            return
        if incarnation in seen:
            raise Conflict(f"worker id {member!r}: this process (incarnation {incarnation:#x}) was replaced by a newer "
                           f"one ({seen[-1]:#x}) that leases data shards under the same id; stop it, or give each "
                           "worker its own id")
        seen.append(incarnation)
        del seen[:-_OLDER_KEPT]

    def expire(self, now: float) -> list[tuple[int, int, str]]:
        """Leases not renewed within the timeout go back to the pool: (epoch, shard, holder)."""
        gone = [(k, h[0]) for k, h in self._holders.items() if h[2] < now]
        for k, _ in gone:
            del self._holders[k]
        return [(*k, m) for k, m in gone]

    def renew_all(self, now: float) -> None:
        """Every lease lasts a full timeout from ``now`` (a root that takes over: a holder's
        renewals reached only its old primary, which never told its standby -- they do not
        change the roster -- so the new primary's clocks said nothing of its holders' lives)."""
        ds = self.dataset
        if ds is not None:
            for h in self._holders.values():
                h[2] = max(h[2], now + ds.lease_timeout_s)

    def release(self, member: str, incarnation: int = 0) -> int:
        """``member`` left cleanly: its leases go back to the pool now. Returns how many."""
        mine = [k for k, h in self._holders.items() if h[0] == member and (not incarnation or h[1] == incarnation)]
        for k in mine:
            del self._holders[k]
        return len(mine)

    # -- progress (recorded with the version that applies it) -------------------------------------
    def progress(self, entries: Iterable[tuple[int, int, int]], now: float) -> int:
        """Samples trained: (epoch, shard, end offset) per batch applied. Returns how many
        entries counted (those naming no shard of an unfinished epoch are ignored)."""
        ds = self.dataset
        if ds is None:
            return 0
        counted = 0
        for e, s, end in entries:
            # Only epochs a lease opened (durably: the roster lists them): progress that named
            # any other opened one, with a list of a million offsets, per entry of a push.
            if e not in self.done or not 0 <= s < ds.shards:
                continue
            done, length = self.done[e], ds.shard_len(s)
            if done[s] >= length:
                continue
            done[s] = max(done[s], min(end, length))
            counted += 1
            holder = self._holders.get((e, s))
            if done[s] < length:
                if holder is not None:
                    holder[2] = now + ds.lease_timeout_s  # progress is a sign of life
                continue
            self._holders.pop((e, s), None)
            self._left[e] -= 1
            if not self._left[e]:
                self._finish(e)
        return counted

    # -- persistence (JSON-ready) -------------------------------------------------------------------
    def state(self) -> dict:
        # Copies: a checkpoint writes this later, from a thread, while versions go on.
        return dict(dataset=asdict(self.dataset) if self.dataset else None,
                    done={str(e): list(d) for e, d in self.done.items()}, finished=sorted(self.finished),
                    current_epoch=self.current_epoch, open=sorted(self.done),
                    leases=[[e, s, h[0], h[1]] for (e, s), h in sorted(self._holders.items())])

    def load(self, state: dict, now: float) -> None:
        """Restore what ``state`` holds (any of its keys); loaded leases last a full timeout."""
        if state.get("dataset"):
            self.dataset = Dataset(**state["dataset"])
        ds = self.dataset
        if "done" in state:
            self.done = {int(e): [int(x) for x in d] for e, d in state["done"].items()}
            self.finished = {int(e) for e in state.get("finished", ())}
            self.current_epoch = int(state.get("current_epoch", 0))
        if ds is not None:  # epochs a lease opened since the checkpoint (the roster lists them)
            for e in state.get("open", ()):
                if int(e) not in self.finished:
                    self._epoch(int(e), bounded=False)
        # The shards each open epoch still waits for, from ``done`` whenever the dataset is known:
        # a standby loads a checkpoint's ``done`` before the roster that declares the dataset, and
        # counted nothing then -- the first shard finished afterwards raised KeyError in every
        # apply of the record that finished it, and the job stopped (review).
        self._left = {e: sum(x < ds.shard_len(s) for s, x in enumerate(d)) for e, d in self.done.items()} \
            if ds is not None else {}
        if "leases" in state and ds is not None:
            self._holders = {(int(e), int(s)): [str(m), int(i), now + ds.lease_timeout_s]
                             for e, s, m, i in state["leases"]}
        self._holders = {k: h for k, h in self._holders.items()
                         if k[0] in self.done and self.done[k[0]][k[1]] < ds.shard_len(k[1])} if ds else {}

    # -- internals ---------------------------------------------------------------------------------
    def _declared(self) -> Dataset:
        if self.dataset is None:
            raise NotReady("this job has no dataset declared; a lease call declares it (length, shard size, seed)")
        return self.dataset

    def _epoch(self, epoch: int, bounded: bool = True) -> list[int]:
        done = self.done.get(epoch)
        if done is None:
            ds = self._declared()
            if bounded and len(self.done) >= MAX_OPEN_EPOCHS:
                raise Exhausted(f"{len(self.done)} epochs of this job are open (unfinished) at once; at most "
                                f"{MAX_OPEN_EPOCHS}: finish one first")
            done = self.done[epoch] = [0] * ds.shards
            self._left[epoch] = ds.shards
        return done

    def _finish(self, epoch: int) -> None:
        self.finished.add(epoch)
        self.done.pop(epoch, None)
        self._left.pop(epoch, None)
        for k in [k for k in self._holders if k[0] == epoch]:
            del self._holders[k]


def check_epoch(epoch: int) -> None:
    """BadInput unless ``epoch`` is one a lease may name."""
    if not 0 <= epoch < MAX_EPOCH:
        raise BadInput(f"an epoch must be in [0, {MAX_EPOCH}), got {epoch}")


def _describe(ds: Dataset) -> str:
    return (f"{ds.length} samples in shards of {ds.shard_size}, seed {ds.seed}, lease timeout "
            f"{ds.lease_timeout_s:g}s")
