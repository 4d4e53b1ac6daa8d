"""The demo's shared step pool: every mode trains on exactly workers x steps steps."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from ps.demo.budget import StepBudget


def _drain(path: str, total: int, q) -> None:
    budget = StepBudget(path, total)
    budget.start_together(parties=3, timeout_s=30)
    n = 0
    for _ in range(total + 1):  # bounded: a pool of ``total`` can never give more
        if not budget.claim():
            break
        n += 1
    q.put(n)


def test_processes_claiming_at_once_take_exactly_the_pool(tmp_path):
    budget = StepBudget.create(str(tmp_path / "steps"), total=300)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_drain, args=(budget.path, 300, q)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        counts = [q.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert sum(counts) == 300 and budget.taken() == 300
    assert not budget.claim()


def test_start_together_waits_for_every_party_and_gives_up_at_its_deadline(tmp_path):
    budget = StepBudget.create(str(tmp_path / "steps"), total=1)
    assert not budget.start_together(parties=2, timeout_s=0.05)  # alone: times out
    assert budget.start_together(parties=2, timeout_s=0.05)      # the second arrival


def test_a_new_pool_in_the_same_place_starts_a_new_start_line(tmp_path):
    path = str(tmp_path / "steps")
    first = StepBudget.create(path, total=1)
    assert first.start_together(parties=1, timeout_s=0.05)
    again = StepBudget.create(path, total=1)  # the next demo run writes to the same --out
    assert not again.start_together(parties=2, timeout_s=0.05)  # the old arrival does not count


def test_a_negative_pool_is_refused():
    with pytest.raises(ValueError, match="negative"):
        StepBudget("unused", total=-1)
