"""Unit tests for ps.consistency: membership, BSP rounds and exactly-once bookkeeping.

    cd /work/main && .venv/bin/python -m pytest -q tests/unit/test_consistency.py

Time is injected (``now=``), so expiry is tested without sleeping or an event loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps.consistency import MAX_IN_FLIGHT, BspRound, Membership, SeqBook, Window
from ps.errors import BadInput, NotReady, Stale

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


# ============================================================================ SeqBook


def test_seqbook_classifies_new_seen_and_duplicate():
    book = SeqBook()
    assert book.classify(1) == "new"
    book.accept(1)
    assert book.classify(1) == "seen"       # accepted, not acknowledged yet
    assert book.classify(2) == "new"
    book.record(1, "ack-1")
    assert book.classify(1) == "duplicate"  # answered from the record, applied once
    assert book.acks[1] == "ack-1"
    book.accept(2)
    assert book.classify(2) == "seen" and book.classify(3) == "new"


def test_seqbook_refuses_seq_zero_with_a_sentence():
    with pytest.raises(BadInput, match="start at 1"):
        SeqBook().classify(0)


def test_seqbook_refuses_a_seq_from_the_future_with_a_sentence():
    book = SeqBook()
    ahead = 4 * MAX_IN_FLIGHT  # async senders keep several pushes in flight
    with pytest.raises(BadInput, match="future"):
        book.classify(ahead + 1)
    book.accept(1)
    book.accept(2)
    with pytest.raises(BadInput) as exc:
        book.classify(ahead + 3)
    assert str(ahead + 3) in str(exc.value) and "2" in str(exc.value)
    assert book.highest == 2  # refusing changed nothing


def test_seqbook_takes_pipelined_pushes_out_of_order_each_once():
    """async: pushes 2 and 3 are in flight together and 3 arrives first. 2 is then "seen"
    (never applied: processed as it comes); once acknowledged, a retry of either is a duplicate."""
    book = SeqBook()
    book.accept(1)
    book.record(1, "ack-1")
    assert book.classify(3) == "new"
    book.accept(3)
    assert book.classify(2) == "seen"
    book.accept(2)
    book.record(3, "ack-3")
    book.record(2, "ack-2")
    assert book.classify(2) == book.classify(3) == "duplicate"
    assert book.classify(4) == "new"


def test_seqbook_keeps_only_the_last_acks():
    book = SeqBook(keep=3)
    for s in range(1, 6):
        assert book.classify(s) == "new"
        book.accept(s)
        book.record(s, f"ack-{s}")
    assert list(book.acks) == [3, 4, 5]
    assert [book.classify(s) for s in (3, 4, 5)] == ["duplicate"] * 3
    # Forgotten: no longer answered from the record. The tier then re-runs its checks, and the
    # round check refuses it as stale (an ack is only given once its round has closed).
    assert book.classify(1) == "seen"
    assert book.classify(6) == "new"


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
