"""Stable worker ranks per job: 0..N-1, assigned by the root, kept across worker restarts.

>>> book = RankBook()
>>> [book.take(w, incarnation=1) for w in ("a", "b", "c")]
[0, 1, 2]
>>> book.take("b", incarnation=2)          # b restarted (a new process): the same rank
1
>>> book.release("a", incarnation=1)       # a left cleanly: its rank is free again
True
>>> book.take("d", incarnation=1), book.take("e", incarnation=1, requested=7)
(0, 7)
>>> book.take("f", incarnation=1, requested=7)
Traceback (most recent call last):
ps.core.errors.Conflict: rank 7 of this job is held by worker 'e'; worker 'f' asked for it (its RANK)...
>>> book.info("d", min_workers=4)          # world size: the larger of min_workers and ranks held
RankInfo(rank=0, world_size=4, joined=4, holders=((0, 'd'), (1, 'b'), (2, 'c'), (7, 'e')))

A worker id gets the same rank on every call, a restarted process (same id, new incarnation)
included: a worker killed with SIGKILL keeps its rank for its replacement. A rank is released
only when its holder leaves cleanly (``ParameterClient.close``), and only by the incarnation
that holds it (an old process exiting late must not free its successor's rank). A requested
rank (the ``RANK`` environment variable) is honoured when free or already the caller's.

``world_size`` is the larger of the job's ``min_workers`` and the ranks held at that moment:
ranks held, not processes alive (a killed worker's rank counts until its replacement comes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ps.core.errors import BadInput, Conflict, short

__all__ = ["RankBook", "RankInfo", "MAX_RANK"]

MAX_RANK = 1 << 20  # a requested rank beyond this is a mistake, not a cluster


@dataclass(frozen=True)
class RankInfo:
    """A worker's rank in its job, and the job's membership as the root counts it."""

    rank: int                             # this worker's rank (-1: it holds none, after a release)
    world_size: int                       # max(min_workers, ranks held)
    joined: int                           # ranks held now
    holders: tuple[tuple[int, str], ...]  # (rank, worker id), by rank


class RankBook:
    """Rank per worker id (pure: the root persists its ``state``)."""

    def __init__(self) -> None:
        self._ranks: dict[str, tuple[int, int]] = {}  # worker id -> (rank, incarnation)

    def __len__(self) -> int:
        return len(self._ranks)

    def holder(self, rank: int) -> str | None:
        return next((m for m, (r, _) in self._ranks.items() if r == rank), None)

    def take(self, member: str, incarnation: int, requested: int | None = None) -> int:
        """The rank of ``member`` (assigned now if it holds none)."""
        if requested is not None and not 0 <= requested < MAX_RANK:
            raise BadInput(f"a requested rank must be in [0, {MAX_RANK}), got {requested}")
        held = self._ranks.get(member)
        if held is not None:
            if requested is not None and requested != held[0]:
                raise Conflict(f"worker {short(member)} holds rank {held[0]} of this job; it asked for rank "
                               f"{requested} (its RANK). Give each worker id one rank, or let it leave first")
            self._ranks[member] = (held[0], incarnation)
            return held[0]
        if requested is not None:
            other = self.holder(requested)
            if other is not None:
                raise Conflict(f"rank {requested} of this job is held by worker {short(other)}; worker "
                               f"{short(member)} asked for it (its RANK). Give each worker its own rank, "
                               "or none (the lowest free one is assigned)")
            rank = requested
        else:
            taken = {r for r, _ in self._ranks.values()}
            rank = next(r for r in range(len(taken) + 1) if r not in taken)
        self._ranks[member] = (rank, incarnation)
        return rank

    def release(self, member: str, incarnation: int) -> bool:
        """``member`` left cleanly: free its rank (only the holding incarnation may, or 0)."""
        held = self._ranks.get(member)
        if held is None or (incarnation and held[1] != incarnation):
            return False
        del self._ranks[member]
        return True

    def info(self, member: str, min_workers: int = 0) -> RankInfo:
        held = self._ranks.get(member)
        holders = tuple(sorted((r, m) for m, (r, _) in self._ranks.items()))
        return RankInfo(held[0] if held else -1, max(min_workers, len(holders)), len(holders), holders)

    # -- persistence (JSON-ready) ---------------------------------------------------------------
    def state(self) -> list:
        return [[m, r, i] for m, (r, i) in sorted(self._ranks.items())]

    def load(self, state: list) -> None:
        self._ranks = {str(m): (int(r), int(i)) for m, r, i in state}
