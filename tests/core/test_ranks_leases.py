"""The pure books behind issue 13's membership and data: ranks (ps.core.ranks) and leased
data shards (ps.core.leases): expiry, the resume offset, declarations, epochs, restarts."""

from __future__ import annotations

import json

import pytest

from ps.core.errors import BadInput, Conflict, Exhausted, NotReady
from ps.core.leases import DONE, GRANTED, MAX_OPEN_EPOCHS, RENEWED, WAIT, Dataset, LeaseBook
from ps.core.ranks import RankBook

DS = Dataset(length=40, shard_size=16, seed=3, lease_timeout_s=10)  # shards of 16, 16, 8


# -- ranks ---------------------------------------------------------------------------------------

def test_ranks_are_stable_per_worker_id_and_lowest_free_otherwise():
    book = RankBook()
    assert [book.take(w, 1) for w in ("a", "b", "c")] == [0, 1, 2]
    assert book.take("b", 9) == 1                      # a restarted process: same id, same rank
    assert book.take("b", 9, requested=1) == 1         # its own rank, asked for: fine
    assert not book.release("b", 1)                    # an old incarnation cannot free it
    assert book.release("b", 9)
    assert book.take("d", 1) == 1                      # the lowest free rank
    assert book.info("a", min_workers=5).world_size == 5
    assert book.info("a").world_size == book.info("a").joined == 3


def test_a_requested_rank_is_honoured_if_free_and_refused_with_the_holder_named():
    book = RankBook()
    assert book.take("x", 1, requested=4) == 4
    assert book.take("y", 1) == 0
    with pytest.raises(Conflict, match="rank 4 of this job is held by worker 'x'"):
        book.take("z", 1, requested=4)
    with pytest.raises(Conflict, match="holds rank 0"):
        book.take("y", 1, requested=2)
    with pytest.raises(BadInput):
        book.take("z", 1, requested=-1)
    again = RankBook()
    again.load(json.loads(json.dumps(book.state())))
    assert again.info("x") == book.info("x")


# -- leases --------------------------------------------------------------------------------------

def test_shards_are_leased_in_turn_then_wait_then_done():
    book = LeaseBook()
    with pytest.raises(NotReady):
        book.lease("a", 1, 0, now=0)
    assert book.declare(DS) and not book.declare(DS)
    # (a caller lists the shards it holds, as the sampler does)
    g = [book.lease(w, 1, 0, now=0, held=h) for w, h in (("a", ()), ("b", ()), ("a", ((0, 0),)))]
    assert [(x.status, x.shard, x.start, x.end) for x in g] == [(GRANTED, 0, 0, 16), (GRANTED, 1, 0, 16),
                                                                (GRANTED, 2, 0, 8)]
    mine = ((0, 0), (0, 2))
    assert book.lease("c", 1, 0, now=1).status == WAIT      # held by others
    assert book.lease("a", 1, 0, now=1, held=mine).status == WAIT      # b's shard might still come back
    book.progress([(0, 1, 16)], now=2)
    assert book.lease("a", 1, 0, now=2, held=mine).status == DONE      # the rest is its own to finish
    book.progress([(0, 0, 16), (0, 2, 8)], now=3)
    assert 0 in book.finished and 0 not in book.done
    assert book.lease("c", 1, 0, now=4).status == DONE
    assert book.lease("c", 1, 1, now=4).shard == 0          # the next epoch starts afresh
    assert book.current_epoch == 1


def test_an_expired_lease_resumes_from_the_trained_offset_and_progress_renews():
    book = LeaseBook()
    book.declare(DS)
    assert book.lease("a", 1, 0, now=0).shard == 0
    book.progress([(0, 0, 4), (0, 0, 8), (0, 0, 6)], now=8)  # max: a late, smaller offset is no step back
    assert book.done[0][0] == 8
    book.lease("b", 1, 0, now=9)                             # shard 1
    book.lease("b", 1, 0, now=9, held=((0, 1),))             # shard 2
    b = ((0, 1), (0, 2))
    assert book.lease("b", 1, 0, now=17, held=b).status == WAIT      # a's lease runs to 18 (progress at 8)
    g = book.lease("b", 1, 0, now=18.5, held=b)                      # expired: b resumes it at 8
    assert (g.status, g.shard, g.start, g.end) == (GRANTED, 0, 8, 16)
    r = book.lease("a", 1, 0, now=19, want=False, held=((0, 0),))   # a comes back: lost it
    assert r.status == RENEWED and r.lost == ((0, 0),)


def test_a_new_incarnation_gives_its_predecessors_leases_back_at_once():
    book = LeaseBook()
    book.declare(DS)
    book.lease("a", 1, 0, now=0)
    book.progress([(0, 0, 12)], now=1)
    g = book.lease("a", 2, 0, now=2)                         # a restarted (kill -9, same id)
    assert (g.shard, g.start) == (0, 12)
    assert book.release("a", 1) == 0 and book.release("a", 2) == 1   # clean exit of the new one
    assert book.lease("b", 1, 0, now=3).shard == 0


def test_the_dataset_is_declared_once_and_checked():
    book = LeaseBook()
    book.declare(DS)
    with pytest.raises(Conflict, match="40 samples in shards of 16"):
        book.declare(Dataset(length=41, shard_size=16, seed=3, lease_timeout_s=10))
    with pytest.raises(BadInput, match="shard_size"):
        Dataset(length=10, shard_size=0)
    with pytest.raises(BadInput, match="lease_timeout_s"):
        Dataset(length=10, shard_size=2, lease_timeout_s=0)


def test_progress_naming_no_open_shard_is_ignored_and_open_epochs_are_bounded():
    book = LeaseBook()
    assert book.progress([(0, 0, 4)], now=0) == 0            # nothing declared
    book.declare(DS)
    assert book.progress([(0, 7, 4), (-1, 0, 4)], now=0) == 0
    # An epoch no lease opened: ignored (a push naming thousands of them opened one each, a list
    # of offsets per shard, and took the open-epoch slots real epochs need).
    assert book.progress([(0, 2, 99), (12345, 0, 1)], now=0) == 0 and book.done == {}
    book.lease("a", 1, 0, now=0)
    assert book.progress([(0, 2, 99)], now=0) == 1 and book.done[0][2] == 8   # clipped at the shard's end
    for e in range(1, MAX_OPEN_EPOCHS):
        book.lease("a", 1, e, now=0)
    with pytest.raises(Exhausted):
        book.lease("a", 1, MAX_OPEN_EPOCHS + 5, now=0)


def test_state_round_trips_and_held_shards_are_taken_back_after_a_restart():
    book = LeaseBook()
    book.declare(DS)
    book.lease("a", 1, 0, now=0)
    book.lease("b", 1, 0, now=0)
    book.progress([(0, 0, 5), (0, 1, 16)], now=1)
    state = json.loads(json.dumps(book.state()))
    full = LeaseBook()
    full.load(state, now=100)
    assert full.done == book.done and full.holders() == {(0, 0): "a"}   # b's shard is finished
    # A root that saved no leases (only the dataset and the offsets): a comes back holding shard
    # 0 and keeps it, nobody else gets it.
    bare = LeaseBook()
    bare.load({k: v for k, v in state.items() if k != "leases"}, now=100)
    assert bare.lease("a", 1, 0, now=100, want=False, held=((0, 0),)).lost == ()
    assert bare.lease("c", 1, 0, now=100).shard == 2
    assert bare.lease("c", 1, 0, now=100, held=((0, 2),)).status == WAIT


def test_a_retried_lease_gets_the_same_shard_and_an_unlisted_one_is_not_renewed():
    """The answer to a lease was lost (a failed roster write, a broken connection) and the call
    retried: it was handed the next shard, and the first -- renewed with every later call of its
    holder, which never knew of it -- was trained by nobody, and the epoch never ended."""
    book = LeaseBook()
    book.declare(DS)
    assert book.lease("a", 1, 0, now=0).shard == 0            # answer lost
    again = book.lease("a", 1, 0, now=1)                      # retried: a lists nothing yet
    assert (again.status, again.shard, again.start) == (GRANTED, 0, 0)
    assert book.lease("a", 1, 0, now=1, held=((0, 0),)).shard == 1
    # A shard a stops listing (its loop left the epoch) is renewed no more: it expires, and goes
    # to the next worker from its trained offset, however often a renews what it does list.
    book.progress([(0, 1, 4)], now=2)
    for t in (10, 20, 30):
        book.lease("a", 1, 0, now=t, want=False, held=((0, 0),))
    g = book.lease("b", 1, 0, now=34)
    assert (g.status, g.shard, g.start) == (GRANTED, 1, 4)
    assert book.holders() == {(0, 0): "a", (0, 1): "b"}


def test_an_epoch_a_lease_opened_after_the_checkpoint_keeps_its_leases_across_a_restart():
    """The trained offsets come from a checkpoint, the leases from the roster: an epoch opened
    since the checkpoint was not in its offsets, and the restored root dropped its leases (the
    next worker was handed a shard its holder was still training)."""
    book = LeaseBook()
    book.declare(DS)
    checkpointed = json.loads(json.dumps(book.state()))       # no epoch open yet
    book.lease("a", 1, 0, now=0)
    roster = json.loads(json.dumps(book.state()))             # written before the lease is answered
    restored = LeaseBook()
    restored.load({**checkpointed, "leases": roster["leases"], "open": roster["open"]}, now=5)
    assert restored.holders() == {(0, 0): "a"}
    assert restored.lease("b", 1, 0, now=6).shard == 1


def test_a_standby_that_loads_the_offsets_before_the_dataset_still_finishes_shards():
    """A standby attaching mid-epoch loads the checkpoint's trained offsets (its job directory
    was just rewritten: no roster, so no dataset yet), then the roster that declares the
    dataset. The shards each epoch still waited for were counted only with the offsets: none,
    and the first shard finished afterwards raised KeyError in the standby's apply -- every
    time the primary sent that record again, so no round finishing a shard was ever applied
    (review)."""
    book = LeaseBook()
    book.declare(DS)
    book.lease("a", 1, 0, now=0)
    book.progress([(0, 0, 5)], now=1)
    state = json.loads(json.dumps(book.state()))
    standby = LeaseBook()
    standby.load({k: v for k, v in state.items() if k not in ("dataset", "leases", "open")}, now=2)  # the checkpoint
    standby.load({"dataset": state["dataset"], "leases": state["leases"], "open": state["open"]}, now=2)  # roster
    assert standby.progress([(0, 0, DS.shard_len(0))], now=3) == 1   # shard 0 finished
    for s in range(1, DS.shards):
        standby.progress([(0, s, DS.shard_len(s))], now=3)
    assert 0 in standby.finished  # and the epoch ends with its last shard


def test_a_replaced_process_cannot_take_its_successors_leases_back():
    """A partitioned old pod comes back while its replacement runs under the same id: its
    renewal took every lease of the new incarnation back and re-adopted its own, so a third
    worker could be granted the new one's shard while both trained theirs (review). The old
    process is refused with a sentence; the new one keeps what it holds."""
    book = LeaseBook()
    book.declare(DS)
    assert book.lease("a", 1, 0, now=0).shard == 0
    assert book.lease("a", 2, 0, now=1).shard == 0          # a restarted: its predecessor's shard again
    with pytest.raises(Conflict, match="was replaced by a newer"):
        book.lease("a", 1, 0, now=2, held=((0, 0),))
    assert book.holders() == {(0, 0): "a"}
    assert book.lease("a", 2, 0, now=3, want=False, held=((0, 0),)).lost == ()   # still the new one's
    assert book.lease("b", 1, 0, now=3).shard == 1
