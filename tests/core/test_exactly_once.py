"""Unit tests for ps.core.exactly_once: sequence books with body digests, the root's record of
applied worker pushes, and the push-key encoding the write-ahead log stores."""

from __future__ import annotations

import pytest

from ps.core.errors import BadInput, Conflict
from ps.core.exactly_once import MAX_IN_FLIGHT, AppliedBook, SeqBook, decode_keys, encode_keys
from ps.core.types import PushKey

A, B = b"a" * 16, b"b" * 16


def test_seqbook_classifies_new_pending_retry_and_duplicate():
    book = SeqBook(incarnation=5)
    assert book.classify(1) == "new"
    book.accept(1, A)
    assert book.classify(1) == "pending"    # in a batch: a retry shares its outcome
    assert book.classify(2) == "new"
    book.settle(1, "ack-1")
    assert book.classify(1) == "duplicate"  # answered from the record, applied once
    assert book.ack_of(1) == "ack-1"
    book.accept(2, B)
    book.settle(2, None)                    # its batch was refused: never applied
    assert book.classify(2) == "retry" and book.classify(3) == "new"


def test_a_retry_is_recognised_only_with_the_same_body():
    """Invariant 4: (sender, seq) alone once let a garbage body ride on a pending push."""
    book = SeqBook()
    book.accept(1, A)
    book.check_body(1, A)
    with pytest.raises(Conflict, match="is in a round with another body"):
        book.check_body(1, B)
    book.settle(1, "ack-1")
    book.check_body(1, A)
    with pytest.raises(Conflict, match="was applied with another body"):
        book.check_body(1, B)
    book.check_body(2, B)  # nothing recorded for 2: nothing to compare


def test_seqbook_refuses_seq_zero_and_seqs_from_the_future_with_a_sentence():
    with pytest.raises(BadInput, match="start at 1"):
        SeqBook().classify(0)
    book = SeqBook()
    ahead = 4 * MAX_IN_FLIGHT  # async senders keep several pushes in flight
    with pytest.raises(BadInput, match="future"):
        book.classify(ahead + 1)
    book.accept(1, A)
    book.accept(2, B)
    with pytest.raises(BadInput) as exc:
        book.classify(ahead + 3)
    assert str(ahead + 3) in str(exc.value) and "2" in str(exc.value)
    assert book.highest == 2  # refusing changed nothing


def test_seqbook_takes_pipelined_pushes_out_of_order_each_once():
    """async: pushes 2 and 3 are in flight together and 3 arrives first. 2 is then "retry"
    (never applied: processed as it comes); once acknowledged, a retry of either is a duplicate."""
    book = SeqBook()
    book.accept(1, A)
    book.settle(1, "ack-1")
    assert book.classify(3) == "new"
    book.accept(3, A)
    assert book.classify(2) == "retry"
    book.accept(2, B)
    book.settle(3, "ack-3")
    book.settle(2, "ack-2")
    assert book.classify(2) == book.classify(3) == "duplicate"
    assert book.classify(4) == "new"


def test_seqbook_keeps_only_the_last_acks():
    book = SeqBook(keep=3)
    for s in range(1, 6):
        assert book.classify(s) == "new"
        book.accept(s, A)
        book.settle(s, f"ack-{s}")
    assert list(book.acks) == [3, 4, 5]
    assert [book.classify(s) for s in (3, 4, 5)] == ["duplicate"] * 3
    # Forgotten: the tier re-runs its checks, and a push whose round closed is resolved by
    # asking the root (ps.tiers.tier) rather than applied again.
    assert book.classify(1) == "retry"


def test_applied_book_answers_by_key_and_body_within_its_horizon():
    book = AppliedBook(horizon=3)
    k = {v: PushKey("w0", 9, v, bytes([v]) * 16) for v in range(1, 6)}
    for v in range(1, 6):
        book.add(v, [k[v], PushKey("w1", 4, v, b"x" * 16)])
    assert book.lookup(k[5]) == 5 and book.lookup(k[3]) == 3
    assert book.lookup(k[2]) is None  # aged out: versions 3..5 are kept
    assert book.lookup(PushKey("w0", 10, 5, k[5].digest)) is None  # another incarnation
    with pytest.raises(Conflict, match="another body"):
        book.lookup(PushKey("w0", 9, 5, b"z" * 16))
    assert len(book) == 6


def test_applied_book_counts_a_push_applied_by_a_second_version():
    book = AppliedBook()
    k = PushKey("w0", 9, 1, A)
    assert book.add(1, [k]) == 0
    assert book.add(2, [PushKey("w1", 9, 1, B)]) == 0
    assert book.add(3, [k, PushKey("w1", 9, 2, B)]) == 1  # the root logs it CRITICAL and counts it


def test_applied_book_survives_a_dump_and_load():
    book = AppliedBook()
    for v in range(1, 80):
        book.add(v, [PushKey(f"w{v % 3}", 7, v, bytes([v % 256]) * 16)])
    again = AppliedBook()
    again.load(book.dump(last=64))
    assert again.lookup(PushKey("w1", 7, 79, bytes([79]) * 16)) == 79
    assert again.lookup(PushKey("w1", 7, 16, bytes([16]) * 16)) == 16   # the 64th newest
    assert again.lookup(PushKey("w0", 7, 15, bytes([15]) * 16)) is None  # older: not carried
    # loaded without its marks (a checkpoint written before them): nothing known as dropped
    assert not again.forgotten(PushKey("w0", 7, 15, bytes([15]) * 16)) and again.dropped_upto == 0

    again = AppliedBook()
    again.load(book.dump(last=64), book.dump_dropped(last=64))
    assert again.lookup(PushKey("w0", 7, 15, bytes([15]) * 16)) is None
    assert again.forgotten(PushKey("w0", 7, 15, bytes([15]) * 16)) and again.dropped_upto == 15
    assert not again.forgotten(PushKey("w0", 7, 80, A))    # never applied: after every number held
    assert not again.forgotten(PushKey("w0", 8, 15, A))    # another incarnation of w0
    assert not again.forgotten(PushKey("w1", 7, 79, A))    # held (its body differs: lookup says so)


def test_a_push_past_the_horizon_is_forgotten_never_taken_for_not_applied():
    """A region's sync asked about after an outage of more than ``horizon`` versions was
    answered "not applied" and sent again: applied twice, and not even counted."""
    book = AppliedBook(horizon=4)
    old = PushKey("eu", 3, 1, A)
    book.add(1, [old])
    for v in range(2, 10):
        book.add(v, [PushKey("us", 5, v, B)])
    assert book.lookup(old) is None and book.forgotten(old) and book.dropped_upto == 5
    assert book.applied_at(old) == 5 and book.applied_at(PushKey("us", 5, 9, B)) == 9  # at or before; exact
    assert book.applied_at(PushKey("eu", 3, 2, A)) is None
    assert not book.forgotten(PushKey("eu", 3, 2, A))          # eu's next number was never applied
    assert book.add(10, [old]) == 1                            # applied again: counted as double
    book.clear()
    assert not book.forgotten(old) and book.dropped_upto == 0


def test_the_dropped_runs_are_bounded_by_sender_count():
    book = AppliedBook(horizon=1, senders=2)
    for v, member in enumerate(("a", "b", "c"), start=1):
        book.add(v, [PushKey(member, 1, 1, A)])
    book.add(4, [PushKey("d", 1, 1, A)])
    # a's run went first (the oldest sender): its key reads as never applied, as before runs
    assert [book.forgotten(PushKey(m, 1, 1, A)) for m in "abc"] == [False, True, True]


def test_a_number_never_applied_below_dropped_ones_is_not_forgotten():
    """A review found the first form (the highest number dropped) answering "applied" for a
    number never applied below one that was: an acknowledgement of a lost gradient."""
    book = AppliedBook(horizon=1)
    order = [5, 1, 2, 4, 7, 8, 6]  # async: out of order; 3 never applied
    for v, seq in enumerate(order, start=1):
        book.add(v, [PushKey("w", 1, seq, A)])
    assert book._dropped[("w", 1)] == [[1, 2], [4, 5], [7, 8]]  # 6 is still held (version 7)
    assert [book.forgotten(PushKey("w", 1, s, A)) for s in range(1, 10)] == [
        True, True, False, True, True, False, True, True, False]
    again = AppliedBook(horizon=1)
    again.load(book.dump(1), book.dump_dropped(1))
    assert again._dropped[("w", 1)] == [[1, 2], [4, 5], [7, 8]] and again.lookup(PushKey("w", 1, 6, A)) == 7
    again.add(9, [PushKey("x", 1, 1, A)])  # 6 drops out too: the runs join
    assert again._dropped[("w", 1)] == [[1, 2], [4, 8]]
    assert not again.forgotten(PushKey("w", 1, 3, A)) and again.dropped_upto == 7
    assert again.add(10, [PushKey("w", 1, 3, A)]) == 0  # applied late, for the first time: no double


def test_dropped_runs_that_are_damaged_are_bad_input():
    book = AppliedBook(horizon=1)
    for v in (1, 2, 3):
        book.add(v, [PushKey("w", 1, v, A)])
    data = book.dump_dropped(0)
    for cut in (1, len(data) - 1):
        with pytest.raises(BadInput, match="cut short"):
            AppliedBook().load(b"", data[:cut])
    backwards = data[:-16] + (9).to_bytes(8, "little") + (2).to_bytes(8, "little")
    with pytest.raises(BadInput, match="not a run"):
        AppliedBook().load(b"", backwards)


def test_push_keys_round_trip_and_damage_is_bad_input():
    keys = (PushKey("w0", 1 << 61, 3, A), PushKey("zone-é", 2, 1 << 40, b""), PushKey("x", 0, 1, B))
    data = encode_keys(keys)
    assert decode_keys(data) == keys
    assert decode_keys(b"") == ()
    for cut in (1, len(data) - 1):
        with pytest.raises(BadInput, match="cut short"):
            decode_keys(data[:cut])


def test_a_member_id_that_is_not_utf8_is_bad_input():
    """Found by the decoder fuzzer: it raised UnicodeDecodeError."""
    bad = encode_keys([PushKey("ab", 1, 1, A)]).replace(b"ab", b"\xff\xfe")
    with pytest.raises(BadInput, match="not UTF-8"):
        decode_keys(bad)


def test_an_applied_record_cut_short_is_bad_input_not_a_shorter_record():
    """Found by the decoder fuzzer: a record cut at a key boundary loaded its first keys only."""
    book = AppliedBook()
    book.add(5, [PushKey("w0", 1, 1, A), PushKey("w1", 1, 1, B)])
    data = book.dump(last=1)
    one_key = len(data) - len(encode_keys([PushKey("w1", 1, 1, B)]))
    with pytest.raises(BadInput, match="cut short"):
        AppliedBook().load(data[:one_key])
