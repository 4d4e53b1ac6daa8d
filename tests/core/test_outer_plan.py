"""ps.core.outer: the region's arithmetic of an outer job, without any server."""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.outer import OuterPlan
from ps.core.view import KeySpec, Layout

LAYOUT = Layout([KeySpec(f"k{i}", (n,)) for i, n in enumerate([40, 3, 17, 64, 5, 9, 30, 2])]
                + [KeySpec("bn.mean", (4,), kind="buffer")])


@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 9])
def test_fragments_cover_every_key_once_and_take_turns(fragments):
    plan = OuterPlan(LAYOUT, inner_steps=fragments * 3, fragments=fragments)
    keys = sorted(i for f in plan.keys for i in f)
    assert keys == list(range(len(LAYOUT.specs)))
    assert [plan.fragment(u) for u in range(2 * fragments)] == list(range(fragments)) * 2
    for f in range(fragments):
        assert sorted(plan.absent(f) + plan.keys[f]) == list(range(len(LAYOUT.specs)))


def test_fragments_are_balanced_by_elements():
    plan = OuterPlan(Layout([KeySpec(f"k{i}", (100,)) for i in range(12)]), inner_steps=4, fragments=4)
    assert [len(k) for k in plan.keys] == [3, 3, 3, 3]


def test_pseudo_gradient_is_zero_outside_its_fragment_and_buffers_carry_values():
    plan = OuterPlan(LAYOUT, inner_steps=2, fragments=2)
    rng = np.random.default_rng(0)
    base, params = rng.standard_normal((2, LAYOUT.numel), dtype=np.float32)
    for f in range(2):
        d = plan.pseudo_gradient(base, params, f, workers=3)
        for i, spec in enumerate(LAYOUT.specs):
            sl = slice(LAYOUT.offset(spec.key), LAYOUT.offset(spec.key) + spec.numel)
            if i not in plan.keys[f]:
                assert not d[sl].any()
            elif spec.kind == "buffer":
                assert np.array_equal(d[sl], params[sl] * np.float32(3))
            else:
                assert np.array_equal(d[sl], (base[sl] - params[sl]) * np.float32(3))


def test_rebase_with_overlap_keeps_what_was_trained_since_the_send():
    plan = OuterPlan(LAYOUT, inner_steps=1, fragments=1)
    rng = np.random.default_rng(1)
    sent, outer = rng.standard_normal((2, LAYOUT.numel), dtype=np.float32)
    params = sent + np.float32(0.5)        # trained on after the send
    base = np.zeros_like(params)
    plan.rebase(params, base, outer, 0, sent=sent)
    assert np.allclose(params, outer + 0.5) and np.array_equal(base, outer)
    # what was trained since goes with the next pseudo-gradient
    params_only = LAYOUT.offset("bn.mean")  # the buffer key is last; it carries values
    assert np.allclose(plan.pseudo_gradient(base, params, 0, 1)[:params_only], -0.5)
    without = sent.copy()
    plan.rebase(without, base, outer, 0)   # no overlap: the outer values exactly
    assert np.array_equal(without, outer)


def test_lost_steps_count_what_no_outer_version_holds():
    plan = OuterPlan(LAYOUT, inner_steps=4, fragments=1)  # stride 5: versions 5u .. 5u+4
    assert plan.start_version(3) == 15
    assert plan.lost_steps(17, outer_version=3) == 2      # two steps after the sync to 3
    assert plan.lost_steps(19, outer_version=3) == 4      # its sync never made outer version 4
    assert plan.lost_steps(19, outer_version=4) == 0      # it did: nothing lost
    assert plan.lost_steps(15, outer_version=3) == 0


def test_leased_data_waits_for_a_sync_of_every_fragment_not_for_any_f_syncs():
    """A synchronous region syncs the fragment of the outer version. Its sync of fragment 1
    failed (the root closed that round without it), and the next, two outer versions on, was
    of fragment 0 again: counted by syncs, the data trained before both was sent up as trained
    while its fragment-1 part was still only at the region, lost if the region died (review)."""
    from ps.core.outer import PendingProgress

    p = PendingProgress(fragments=2)
    p.add(((0, 3, 8),))
    n, carried = p.due(0)
    assert carried == ()
    p.synced(n, 0)       # fragment 0 in; the sync of fragment 1 failed: nothing synced
    n, carried = p.due(0)  # fragment 0's turn again
    assert carried == ()
    p.synced(n, 0)
    assert p.furthest(0, 3) == 8  # still held here, for a restarted worker not to train it again
    n, carried = p.due(1)
    assert carried == ((0, 3, 8),)
    p.synced(n, 1)
    assert not p
