"""Unit tests for ps.core.consistency: membership, BSP rounds and windows.

    .venv/bin/python -m pytest -q tests/core/test_consistency.py

Time is injected (``now=``), so expiry is tested without sleeping or an event loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.consistency import BspRound, Membership, Window
from ps.core.errors import BadInput, NotReady, Stale

__all__: list[str] = []

N = 6


def _members(*ids: str, now: float = 0.0, first_round: int = 0) -> Membership:
    m = Membership()
    for i in ids:
        m.join(i, now=now, first_round=first_round)
    return m


def _g(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


# ============================================================================ Membership


def test_rejoin_keeps_the_place_in_the_rounds():
    m = Membership()
    first = m.join("w0", now=0.0, first_round=2, address="a:1")
    again = m.join("w0", now=5.0, first_round=9, address="b:2")
    assert again is first and len(m) == 1
    assert again.first_round == 2 and again.last_seen == 5.0 and again.address == "b:2"
    assert m.expected_in(2) == {"w0"}


def test_get_unknown_member_says_register_first():
    with pytest.raises(NotReady, match="register"):
        Membership().get("ghost")


def test_expire_drops_only_silent_members():
    m = _members("w0", "w1", "w2", now=0.0)
    assert m.touch("w0", now=2.5)
    assert not m.touch("ghost", now=2.5)
    gone = m.expire(now=3.5, timeout=3.0)
    assert sorted(gone) == ["w1", "w2"]
    assert "w0" in m and "w1" not in m and len(m) == 1
    assert m.expire(now=4.0, timeout=3.0) == []


def test_leave():
    m = _members("w0", "w1")
    assert m.leave("w0") and not m.leave("w0")
    assert m.expected_in(0) == {"w1"}


# ============================================================================ BspRound


def test_round_completes_only_when_every_expected_member_pushed():
    m = _members("w0", "w1", "w2")
    rnd = BspRound(round=0, numel=N)
    for i, w in enumerate(["w2", "w0", "w1"]):
        assert not rnd.complete(m)
        rnd.add(w, base_version=0, grad=_g(i), contributors=1, clocks=(0, 0))
    assert rnd.complete(m)


def test_an_empty_round_is_not_complete():
    assert not BspRound(round=0, numel=N).complete(Membership())


def test_a_member_that_joined_later_is_not_waited_for():
    m = _members("w0", "w1")
    m.join("late", now=0.0, first_round=4)
    rnd = BspRound(round=3, numel=N)
    assert m.expected_in(3) == {"w0", "w1"}
    rnd.add("w0", 3, _g(0), 1, (3, 3))
    assert not rnd.complete(m)
    rnd.add("w1", 3, _g(1), 1, (3, 3))
    assert rnd.complete(m)
    # ... but it is waited for in the round it joined at.
    nxt = BspRound(round=4, numel=N)
    nxt.add("w0", 4, _g(0), 1, (4, 4))
    nxt.add("w1", 4, _g(1), 1, (4, 4))
    assert not nxt.complete(m)
    nxt.add("late", 4, _g(2), 1, (4, 4))
    assert nxt.complete(m)


def test_expiring_a_silent_member_lets_the_round_complete():
    m = _members("w0", "w1", "dead", now=0.0)
    rnd = BspRound(round=0, numel=N)
    rnd.add("w0", 0, _g(0), 1, (0, 0))
    rnd.add("w1", 0, _g(1), 1, (0, 0))
    m.touch("w0", now=10.0)
    m.touch("w1", now=10.0)
    assert not rnd.complete(m)
    assert m.expire(now=10.0, timeout=5.0) == ["dead"]
    assert rnd.complete(m)
    agg = rnd.close()
    assert agg.members == ("w0", "w1") and agg.contributors == 2


def test_a_member_that_pushed_then_died_still_counts():
    m = _members("w0", "w1", now=0.0)
    rnd = BspRound(round=0, numel=N)
    rnd.add("w0", 0, _g(0), 1, (0, 0))
    m.touch("w1", now=10.0)
    m.expire(now=10.0, timeout=5.0)  # w0 goes silent after pushing
    assert not rnd.complete(m)
    rnd.add("w1", 0, _g(1), 1, (0, 0))
    assert rnd.complete(m)
    agg = rnd.close()
    np.testing.assert_array_equal(agg.grad, _g(0) + _g(1))
    assert agg.contributors == 2


def test_aggregate_sums_gradients_contributors_and_clock_range():
    rnd = BspRound(round=5, numel=N)
    pushes = [("zoneA", _g(1), 3, (4, 9)), ("zoneB", _g(2), 2, (2, 6)), ("zoneC", _g(3), 1, (5, 5))]
    for member, g, n, clocks in pushes:
        rnd.add(member, 5, g, n, clocks)
    agg = rnd.close()
    want = np.zeros(N, np.float32)
    for _, g, _, _ in pushes:
        want += g
    assert agg.round == 5 and agg.grad.dtype == np.float32
    np.testing.assert_array_equal(agg.grad, want)
    assert agg.contributors == 6
    assert (agg.clock_min, agg.clock_max) == (2, 9)
    assert agg.members == ("zoneA", "zoneB", "zoneC")


def test_the_round_owns_its_sum():
    g = _g(1)
    keep = g.copy()
    rnd = BspRound(round=0, numel=N)
    rnd.add("w0", 0, g, 1, (0, 0))
    rnd.add("w1", 0, _g(2), 1, (0, 0))
    np.testing.assert_array_equal(g, keep)  # the first push's buffer is not the accumulator
    g[:] = 99  # nor is it aliased by the round
    np.testing.assert_array_equal(rnd.close().grad, keep + _g(2))


def test_an_empty_push_counts_as_present_but_adds_nothing():
    m = _members("w0", "relay")
    rnd = BspRound(round=0, numel=N)
    rnd.add("relay", 0, None, 0, (0, 0))  # a relay whose children all left
    rnd.add("w0", 0, _g(1), 1, (7, 7))
    assert rnd.complete(m)
    agg = rnd.close()
    np.testing.assert_array_equal(agg.grad, _g(1))
    assert agg.contributors == 1 and (agg.clock_min, agg.clock_max) == (7, 7)


def test_a_round_with_no_gradient_closes_to_zeros():
    rnd = BspRound(round=2, numel=N)
    rnd.add("relay", 2, None, 0, (0, 0))
    agg = rnd.close()
    assert agg.grad.shape == (N,) and not agg.grad.any() and agg.contributors == 0


def _refused(rnd: BspRound, member: str, base: int, exc: type, match: str) -> None:
    before = (dict(rnd.pushed), rnd.close().grad.copy())
    with pytest.raises(exc, match=match):
        rnd.check(member, base)
    with pytest.raises(exc, match=match):
        rnd.add(member, base, np.full(N, 1e6, np.float32), 5, (0, 100))
    after = rnd.close()
    assert rnd.pushed == before[0]
    np.testing.assert_array_equal(after.grad, before[1])
    assert after.clock_max == 0


def test_check_refuses_an_older_base_as_stale():
    rnd = BspRound(round=3, numel=N)
    rnd.add("w0", 3, _g(0), 1, (0, 0))
    _refused(rnd, "w1", 2, Stale, "pull and recompute")


def test_check_refuses_a_newer_base_as_not_ready():
    rnd = BspRound(round=3, numel=N)
    rnd.add("w0", 3, _g(0), 1, (0, 0))
    _refused(rnd, "w1", 4, NotReady, "retry")


def test_check_refuses_a_second_push_by_the_same_member():
    rnd = BspRound(round=3, numel=N)
    rnd.add("w0", 3, _g(0), 1, (0, 0))
    _refused(rnd, "w0", 3, BadInput, "already pushed")


def test_a_batch_never_sums_more_contributors_than_a_relay_can_forward():
    """A count past 2^32-1 once made a zone's forward raise inside its task and wedged the round."""
    from ps.core.consistency import MAX_CONTRIBUTORS

    rnd = BspRound(round=0, numel=N)
    rnd.add("z0", 0, _g(0), MAX_CONTRIBUTORS - 1, (0, 0))
    with pytest.raises(BadInput, match="contributors"):
        rnd.check("z1", 0, contributors=2)
    with pytest.raises(BadInput, match="contributors"):
        rnd.add("z1", 0, _g(1), 2, (0, 0))
    assert rnd.pushed == {"z0": MAX_CONTRIBUTORS - 1}
    np.testing.assert_array_equal(rnd.close().grad, _g(0))
    w = Window(numel=N)
    with pytest.raises(BadInput, match="contributors"):
        w.add("z0", 0, _g(0), MAX_CONTRIBUTORS + 1, (0, 0), 0, now=0.0)
    assert not w.pushed


def test_all_finite_catches_what_a_finite_looking_sum_could_hide():
    from ps.core.tensors import all_finite

    x = np.ones(1000, np.float32)
    assert all_finite(x)
    x[7] = np.nan
    assert not all_finite(x)
    x[7] = np.inf
    assert not all_finite(x)
    big = np.full(1000, 3e38, np.float32)  # every value finite, their float64 sum too
    assert all_finite(big)
    with np.errstate(over="ignore"):
        assert not all_finite(big + big)  # float32 overflow of a relay's or the root's sum


# ============================================================================ Window


def test_a_window_sums_an_async_senders_pipelined_pushes_but_refuses_a_second_ssp_push():
    w = Window(numel=3, repeats=True)  # async
    w.add("w0", 4, np.ones(3, np.float32), 1, (7, 7), 12, now=0.0)
    w.add("w0", 5, np.full(3, 2.0, np.float32), 2, (8, 9), 12, now=0.001)
    agg = w.close(default_base=9)
    assert agg.contributors == 3 and agg.round == 4 and (agg.clock_min, agg.clock_max) == (7, 9)
    assert np.array_equal(agg.grad, np.full(3, 3.0, np.float32))
    w = Window(numel=3)  # ssp: one push per sender, so clock floors arrive in order
    w.add("w0", 4, np.ones(3, np.float32), 1, (7, 7), 12, now=0.0)
    with pytest.raises(BadInput, match="twice"):
        w.add("w0", 5, np.ones(3, np.float32), 1, (8, 8), 12, now=0.001)
    assert w.pushed == {"w0": 1}


def test_a_batchs_first_gradient_is_adopted_only_when_given_away():
    """``owned=True`` (a push's own decode buffer): the round sums into it, no copy; otherwise
    the caller's array is never written."""
    for make, extra, closing in ((lambda: BspRound(0, 3), (), ()), (lambda: Window(3), (0, 0.0), (0,))):
        mine, theirs = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
        batch = make()
        batch.add("a", 0, mine, 1, (0, 0), *extra)
        batch.add("b", 0, theirs, 1, (0, 0), *extra)
        assert mine.tolist() == [1.0] * 3 and not np.shares_memory(batch.close(*closing).grad, mine)
        given = np.ones(3, np.float32)
        batch = make()
        batch.add("a", 0, given, 1, (0, 0), *extra, owned=True)
        batch.add("b", 0, theirs, 1, (0, 0), *extra)
        assert np.shares_memory(batch.close(*closing).grad, given) and given.tolist() == [3.0] * 3
        read_only = np.ones(3, np.float32)
        read_only.flags.writeable = False  # a zero-copy view of received bytes: copied after all
        batch = make()
        batch.add("a", 0, read_only, 1, (0, 0), *extra, owned=True)
        batch.add("b", 0, theirs, 1, (0, 0), *extra)
        assert batch.close(*closing).grad.tolist() == [3.0] * 3 and read_only.tolist() == [1.0] * 3
