"""Unit tests for the pure parameter core: ps.core.view, ps.core.tensors and ps.core.deltas.

    .venv/bin/python -m pytest -q tests/core/test_view_deltas.py

No event loop, no network: layouts, the checksummed view (invariants 1 and 5), splitting a
flat vector into encoded chunks and validating it back, and the bounded delta log.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.deltas import DeltaEntry, DeltaLog
from ps.core.errors import BadInput, Stale
from ps.core.tensors import Assembler, Chunk, assemble, split
from ps.core.view import BLOCK, KeySpec, Layout, View, block_digests, blocks_of, checksum, normalized

__all__: list[str] = []

CODECS = ["fp32", "fp32+zstd"]


def _layout() -> Layout:
    # 12 + 3 + 7 elements: with chunk_elems=5 the first and last keys span several chunks.
    return Layout([KeySpec("w", (4, 3)), KeySpec("b", (3,)), KeySpec("v", (7,))])


def _values(n: int, seed: int = 0) -> np.ndarray:
    """Awkward but finite float32 values: signed zeros, subnormals, huge and tiny numbers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    special = np.array([-0.0, 1e-45, -1e-44, 3.0e38, -3.0e38, 1e-30], dtype=np.float32)
    x[: min(n, special.size)] = special[: min(n, special.size)]
    return x


def _bits(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f4").tobytes()


def _ready_view(layout: Layout, epoch: int = 7, version: int = 3) -> View:
    view = View(layout)
    vals = _values(layout.numel)
    view.load_snapshot(epoch=epoch, version=version, values=vals, crc=checksum(vals))
    return view


def _state(view: View) -> tuple:
    return view.epoch, view.version, view.checksum, _bits(view.values), view.values.dtype, view.digests.tobytes()


# ============================================================================ store: Layout


def test_layout_places_keys_contiguously_in_creation_order():
    layout = _layout()
    assert layout.numel == 12 + 3 + 7
    assert [layout.offset(k) for k in ("w", "b", "v")] == [0, 12, 15]
    assert [s.key for s in layout] == ["w", "b", "v"]


def test_layout_rejects_duplicate_keys():
    with pytest.raises(BadInput, match="'w'"):
        Layout([KeySpec("w", (2,)), KeySpec("b", (1,)), KeySpec("w", (3,))])


@pytest.mark.parametrize("specs", [
    [],
    [KeySpec("", (2,))],
    [KeySpec("w", (2, -1))],
    [KeySpec("w", (2,), dtype="float16")],
], ids=["no-keys", "empty-key", "negative-dim", "bad-dtype"])
def test_layout_rejects_malformed_specs(specs):
    with pytest.raises(BadInput):
        Layout(specs)


def test_layout_check_reports_wrong_shape_with_key_name():
    layout = _layout()
    with pytest.raises(BadInput) as exc:
        layout.check("w", "float32", (3, 4))
    msg = str(exc.value)
    assert "'w'" in msg and "(3, 4)" in msg and "(4, 3)" in msg


def test_layout_check_reports_wrong_dtype_with_key_name():
    layout = _layout()
    with pytest.raises(BadInput) as exc:
        layout.check("b", "float16", (3,))
    msg = str(exc.value)
    assert "'b'" in msg and "float16" in msg


def test_layout_check_reports_unknown_key_by_name():
    with pytest.raises(BadInput, match="'nope'"):
        _layout().check("nope", "float32", (1,))


def test_layout_check_accepts_the_matching_spec():
    layout = _layout()
    assert layout.check("w", "float32", [4, 3]) == KeySpec("w", (4, 3))


# ============================================================================ store: checksum


def test_checksum_changes_with_every_single_bit_flip():
    x = _values(16)
    base = checksum(x)
    raw = np.frombuffer(_bits(x), dtype=np.uint8).copy()
    seen = set()
    for byte in range(raw.size):
        for bit in range(8):
            flipped = raw.copy()
            flipped[byte] ^= np.uint8(1 << bit)
            crc = checksum(flipped.view("<f4"))
            assert crc != base, f"flip of byte {byte} bit {bit} kept the checksum"
            seen.add(crc)
    assert len(seen) == raw.size * 8  # and no two flips collide either


def test_checksum_is_of_the_float32_bytes():
    x = _values(9)
    assert checksum(x) == checksum(x.astype(np.float64))  # held and compared as float32
    assert checksum(x) != checksum(x[::-1].copy())        # order matters


# ============================================================================ store: View


def test_new_view_is_not_ready():
    view = View(_layout())
    assert not view.ready and view.version == 0


def test_load_snapshot_installs_a_copy():
    layout = _layout()
    vals = _values(layout.numel)
    view = View(layout)
    view.load_snapshot(epoch=5, version=9, values=vals, crc=checksum(vals))
    assert view.ready and (view.epoch, view.version) == (5, 9)
    assert view.checksum == checksum(vals) and _bits(view.values) == _bits(vals)
    vals[:] = 0  # the caller's buffer is not the view
    assert view.checksum == checksum(view.values) != checksum(vals)


def test_load_snapshot_verifies_the_checksum_and_changes_nothing():
    view = _ready_view(_layout())
    before = _state(view)
    vals = _values(view.layout.numel, seed=1)
    with pytest.raises(Stale, match="checksum"):
        view.load_snapshot(epoch=8, version=1, values=vals, crc=checksum(vals) ^ 1)
    assert _state(view) == before


def test_load_snapshot_refuses_the_wrong_size():
    view = View(_layout())
    vals = _values(view.layout.numel + 1)
    with pytest.raises(BadInput):
        view.load_snapshot(epoch=8, version=1, values=vals, crc=checksum(vals))
    assert not view.ready


def test_apply_delta_onto_the_exact_base():
    view = _ready_view(_layout(), epoch=7, version=3)
    d = _values(view.layout.numel, seed=2) * np.float32(1e-3)
    want = view.values + d
    view.apply_delta(epoch=7, version=4, delta=d, crc=checksum(want))
    assert (view.epoch, view.version) == (7, 4)
    assert _bits(view.values) == _bits(want) and view.checksum == checksum(want)


@pytest.mark.parametrize("epoch,version", [(8, 4), (6, 4), (7, 3), (7, 5), (7, 2)],
                         ids=["newer-epoch", "older-epoch", "replay", "skip", "behind"])
def test_apply_delta_refuses_a_wrong_base_and_changes_nothing(epoch, version):
    view = _ready_view(_layout(), epoch=7, version=3)
    before = _state(view)
    d = np.ones(view.layout.numel, np.float32)
    with pytest.raises(Stale, match="resync"):
        # The checksum is right for the result: only the base is wrong.
        view.apply_delta(epoch=epoch, version=version, delta=d, crc=checksum(view.values + d))
    assert _state(view) == before


def test_apply_delta_refuses_a_checksum_mismatch_and_changes_nothing():
    view = _ready_view(_layout(), epoch=7, version=3)
    before = _state(view)
    d = np.ones(view.layout.numel, np.float32)
    with pytest.raises(Stale, match="checksum"):
        view.apply_delta(epoch=7, version=4, delta=d, crc=checksum(view.values + d) ^ 0x80)
    assert _state(view) == before
    # The same delta with the right checksum still applies: nothing was half-done.
    view.apply_delta(epoch=7, version=4, delta=d, crc=checksum(view.values + d))
    assert view.version == 4


@pytest.mark.parametrize("codec", CODECS)
def test_replica_following_root_deltas_is_bit_exact(codec):
    """Invariant 1: the root publishes view_v = view_{v-1} + decode(d_v); a replica that
    applies the same encoded deltas holds the same bits and verifies every checksum."""
    layout, c = _layout(), get_codec(codec)
    rng = np.random.default_rng(3)
    params = _values(layout.numel)
    root = View(layout)
    root.load_snapshot(epoch=11, version=0, values=params, crc=checksum(params))
    replica = View(layout)
    replica.load_snapshot(epoch=11, version=0, values=root.values.copy(), crc=root.checksum)
    for v in range(1, 8):
        params = params - np.float32(0.01) * rng.standard_normal(layout.numel).astype(np.float32)
        chunks = split(layout, params - root.values, c, chunk_elems=5)
        d = assemble(layout, chunks, what="delta", require_all=True)
        root.apply_delta(11, v, d, checksum(root.values + d))
        replica.apply_delta(11, v, assemble(layout, chunks, what="delta"), root.checksum)
        assert _bits(replica.values) == _bits(root.values)
    assert replica.version == 7 and replica.checksum == root.checksum


# ============================================================================ tensors


@pytest.mark.parametrize("codec", CODECS)
def test_split_assemble_round_trip_is_bit_exact(codec):
    layout = _layout()
    x = _values(layout.numel, seed=4)
    chunks = split(layout, x, get_codec(codec), chunk_elems=5)
    # w (12) -> 5, 5, 2; b (3) -> 3; v (7) -> 5, 2
    assert [(c.key, c.offset, c.numel) for c in chunks] == [
        ("w", 0, 5), ("w", 5, 5), ("w", 10, 2), ("b", 0, 3), ("v", 0, 5), ("v", 5, 2)]
    assert all(c.codec == codec and c.shape == layout.spec(c.key).shape for c in chunks)
    y = assemble(layout, chunks, what="push", require_all=True)
    assert y.dtype == np.float32 and _bits(y) == _bits(x)


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_survives_chunk_order_and_default_chunk_size(codec):
    layout = _layout()
    x = _values(layout.numel, seed=5)
    chunks = split(layout, x, get_codec(codec), chunk_elems=4)
    assert _bits(assemble(layout, chunks[::-1], what="push", require_all=True)) == _bits(x)
    one_each = split(layout, x, get_codec(codec))
    assert len(one_each) == 3
    assert _bits(assemble(layout, one_each, what="push", require_all=True)) == _bits(x)


@pytest.mark.parametrize("codec", CODECS)
def test_scalar_and_empty_keys_round_trip(codec):
    layout = Layout([KeySpec("scale", ()), KeySpec("none", (0, 3)), KeySpec("v", (4,))])
    x = _values(layout.numel, seed=8)
    chunks = split(layout, x, get_codec(codec), chunk_elems=3)
    assert [(c.key, c.offset, c.numel) for c in chunks] == [("scale", 0, 1), ("v", 0, 3), ("v", 3, 1)]
    assert _bits(assemble(layout, chunks, what="snapshot", require_all=True)) == _bits(x)


def test_keys_not_sent_are_zero():
    layout = _layout()
    x = _values(layout.numel, seed=6)
    only_b = [c for c in split(layout, x, get_codec("fp32"), chunk_elems=5) if c.key == "b"]
    y = assemble(layout, only_b, what="push")
    assert _bits(y[12:15]) == _bits(x[12:15])
    assert not y[:12].any() and not y[15:].any()


def test_require_all_catches_missing_elements():
    layout = _layout()
    chunks = split(layout, _values(layout.numel), get_codec("fp32"), chunk_elems=5)
    missing = [c for c in chunks if not (c.key == "w" and c.offset == 5)]
    assemble(layout, missing, what="push")  # fine for a gradient
    with pytest.raises(BadInput, match="'w' has 7 of its 12"):
        assemble(layout, missing, what="snapshot", require_all=True)
    with pytest.raises(BadInput, match="'b'"):
        assemble(layout, [c for c in chunks if c.key != "b"], what="snapshot", require_all=True)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_assemble_rejects_non_finite_values(codec, bad):
    layout = _layout()
    x = _values(layout.numel)
    x[13] = bad
    chunks = split(layout, x, get_codec(codec), chunk_elems=5)
    with pytest.raises(BadInput, match="non-finite") as exc:
        assemble(layout, chunks, what="push 3 from 'w0'")
    assert "'b'" in str(exc.value) and "push 3 from 'w0'" in str(exc.value)
    # Callers that hold raw parameters may opt out, and then get the bits they sent.
    y = assemble(layout, chunks, what="snapshot", check_finite=False)
    assert _bits(y) == _bits(x)


def _one(layout: Layout, **change) -> list[Chunk]:
    """A valid fp32 chunk set for ``layout`` with the first chunk of key "w" altered."""
    x = _values(layout.numel)
    chunks = split(layout, x, get_codec("fp32"), chunk_elems=5)
    i = next(i for i, c in enumerate(chunks) if c.key == "w" and c.offset == 0)
    c = chunks[i]
    fields = dict(key=c.key, shape=c.shape, dtype=c.dtype, offset=c.offset, numel=c.numel,
                  codec=c.codec, payload=c.payload)
    fields.update(change)
    chunks[i] = Chunk(**fields)
    return chunks


def test_assemble_rejects_overlapping_chunks():
    layout = _layout()
    chunks = split(layout, _values(layout.numel), get_codec("fp32"), chunk_elems=5)
    with pytest.raises(BadInput, match="overlapping"):
        assemble(layout, chunks + [chunks[1]], what="push")  # the same slice twice
    x = _values(5, seed=9)
    shifted = Chunk("w", (4, 3), "float32", 3, 5, "fp32", get_codec("fp32").encode(x))
    with pytest.raises(BadInput, match="overlapping"):
        assemble(layout, chunks + [shifted], what="push")    # [3, 8) against [0, 5) and [5, 10)


@pytest.mark.parametrize("change,match", [
    (dict(offset=10), "outside"),                         # [10, 15) of a 12-element key
    (dict(offset=1 << 40), "outside"),
    (dict(numel=0, payload=b""), "outside"),
    (dict(key="zz"), "'zz'"),
    (dict(shape=(3, 4)), r"\(3, 4\)"),
    (dict(shape=(12,)), r"\(12,\)"),
    (dict(dtype="float16"), "float16"),
    (dict(codec="nope"), "unknown codec"),
], ids=["offset-past-end", "offset-huge", "empty-chunk", "unknown-key", "transposed-shape",
        "flat-shape", "dtype", "codec"])
def test_assemble_rejects_malformed_chunks(change, match):
    with pytest.raises(BadInput, match=match):
        assemble(_layout(), _one(_layout(), **change), what="push")


@pytest.mark.parametrize("codec", CODECS)
def test_assemble_rejects_truncated_payload(codec):
    layout = _layout()
    chunks = split(layout, _values(layout.numel), get_codec(codec), chunk_elems=5)
    for cut in (1, 4, len(chunks[0].payload) // 2):
        c = chunks[0]
        short = Chunk(c.key, c.shape, c.dtype, c.offset, c.numel, c.codec, c.payload[:-cut])
        with pytest.raises(BadInput):
            assemble(layout, [short] + chunks[1:], what="push")


def test_assemble_rejects_payload_that_disagrees_with_numel():
    layout = _layout()
    with pytest.raises(BadInput, match="bytes"):
        assemble(layout, _one(layout, numel=4), what="push")  # 5 elements of payload, says 4


# ============================================================================ deltas


def _entry(v: int) -> DeltaEntry:
    payload = np.full(2, v, np.float32).tobytes()
    return DeltaEntry(version=v, checksum=v * 101, chunks=(
        Chunk("b", (2,), "float32", 0, 2, "fp32", payload),), clock_min=v, contributors=2)


def _log(capacity: int, versions) -> tuple[DeltaLog, dict[int, DeltaEntry]]:
    log, made = DeltaLog(capacity), {}
    for v in versions:
        made[v] = _entry(v)
        log.append(made[v])
    return log, made


def test_since_returns_exact_contiguous_entries():
    log, made = _log(8, range(1, 7))
    got = log.since(2, 6)
    assert [e.version for e in got] == [3, 4, 5, 6]
    assert all(e is made[e.version] for e in got)  # verbatim: what was appended, not a copy
    assert [e.version for e in log.since(0, 6)] == [1, 2, 3, 4, 5, 6]
    assert [e.version for e in log.since(3, 4)] == [4]
    assert log.since(2, 6)[0].nbytes == 8


def test_since_is_empty_when_up_to_date():
    log, _ = _log(4, range(1, 4))
    assert log.since(3, 3) == []
    assert DeltaLog(4).since(0, 0) == []


def test_since_needs_a_snapshot_once_the_base_left_the_log():
    log, _ = _log(4, range(1, 11))  # holds 7..10
    assert len(log) == 4 and log.newest == 10 and log.oldest_base == 6
    assert [e.version for e in log.since(6, 10)] == [7, 8, 9, 10]
    for base in (0, 3, 5):
        assert log.since(base, 10) is None
    assert DeltaLog(4).since(0, 1) is None  # nothing logged yet


def test_since_refuses_what_the_log_does_not_hold():
    log, _ = _log(8, range(1, 5))
    assert log.since(2, 5) is None  # past the newest
    assert log.since(4, 2) is None  # backwards


def test_a_version_gap_clears_older_entries():
    log, made = _log(8, [1, 2, 3])
    gap = _entry(7)   # the lineage jumped (a snapshot at 6): 1..3 no longer lead to 7
    log.append(gap)
    assert len(log) == 1 and log.oldest_base == 6
    assert log.since(3, 7) is None and log.since(2, 3) is None
    assert log.since(6, 7) == [gap]
    log.append(_entry(8))
    assert [e.version for e in log.since(6, 8)] == [7, 8]


def test_delta_log_capacity_must_be_positive():
    with pytest.raises(ValueError):
        DeltaLog(0)


def test_a_tiers_replica_reuses_its_buffers_and_a_refused_delta_still_changes_nothing():
    """View(reuse=True), a relay's replica: versions are computed into two alternating buffers,
    with invariant 5 intact (a delta that fails its checksum leaves the held values, bit for
    bit); a delta given as the chunks it came in is added straight from them, bit for bit."""
    layout = Layout([KeySpec("w", (4,))])
    view = View(layout, reuse=True)
    zero = np.zeros(4, np.float32)
    view.load_snapshot(epoch=7, version=0, values=zero, crc=checksum(zero))
    d = np.arange(4, dtype=np.float32)
    buffers = set()
    for v in range(1, 5):
        view.apply_delta(7, v, d, checksum(v * d))
        assert view.values.tolist() == (v * d).tolist()
        buffers.add(id(view.values))
    assert len(buffers) == 2  # two arrays, alternating
    held = view.values.copy()
    with pytest.raises(Stale):
        view.apply_delta(7, 5, d, crc=12345)
    assert view.values.tobytes() == held.tobytes() and view.version == 4
    view.apply_delta(7, 5, d, checksum(5 * d))
    assert view.values.tolist() == (5 * d).tolist()
    # the chunks of a delta that covers part of the key (the rest is + 0.0: -0.0 turns +0.0)
    view.load_snapshot(epoch=7, version=5, values=np.array([1, -0.0, -0.0, 2], np.float32),
                       crc=checksum(np.array([1, -0.0, -0.0, 2], np.float32)))
    half = Assembler(layout, "delta", check_finite=False, lazy=True)
    half.add(Chunk("w", (4,), "float32", 0, 2, "fp32", np.array([3, 4], np.float32).tobytes()))
    want = np.array([1, -0.0, -0.0, 2], np.float32) + np.array([3, 4, 0, 0], np.float32)
    view.apply_delta(7, 6, half.finish_pieces(), checksum(want))
    assert view.values.tobytes() == want.tobytes() and view.values[2].tobytes() == np.float32(0).tobytes()
    fresh = View(layout)  # a worker's view: a fresh array each version, safe to keep
    fresh.load_snapshot(epoch=7, version=0, values=zero, crc=checksum(zero))
    kept = fresh.values
    fresh.apply_delta(7, 1, d, checksum(d))
    assert fresh.values is not kept and kept.tolist() == [0, 0, 0, 0]


def test_split_without_copy_gives_fp32_views_of_the_vector_and_copies_otherwise():
    """copy=False (a sender that frames the chunks at once): fp32 payloads are views of the
    host vector, numpy or a CPU torch tensor; other codecs, and copy=True, own their bytes."""
    import torch
    layout = Layout([KeySpec("a", (6,)), KeySpec("b", (2, 5))])
    flat = np.arange(layout.numel, dtype=np.float32)
    for src in (flat, torch.from_numpy(flat)):
        views = split(layout, src, get_codec("fp32"), chunk_elems=4, copy=False)
        assert all(isinstance(c.payload, memoryview) and np.shares_memory(np.frombuffer(c.payload, np.float32), flat)
                   for c in views)
        assert assemble(layout, views, "t").tobytes() == flat.tobytes()
        owned = split(layout, src, get_codec("fp32"), chunk_elems=4)
        assert [bytes(c.payload) for c in owned] == [bytes(c.payload) for c in views]
        assert all(isinstance(c.payload, bytes) for c in owned)
    zstd = split(layout, flat, get_codec("fp32+zstd"), copy=False)
    assert all(isinstance(c.payload, bytes) for c in zstd)


def test_a_reply_whose_second_version_fails_keeps_the_first_and_says_which_held():
    """apply_pull applies a reply's deltas in place, one by one: when version 2 fails its
    checksum, version 1 holds, and ``applied`` names it (a relay's log then matches its view;
    it ended one version below it, and every child took a snapshot)."""
    from ps.core.replica import apply_pull
    from ps.core.types import PullMeta, VersionMeta

    layout, codec = _layout(), get_codec("fp32")
    base, d1, d2 = (np.random.default_rng(k).standard_normal(layout.numel).astype(np.float32) for k in range(3))
    v1 = base + d1
    view = View(layout)
    view.load_snapshot(7, 0, base, checksum(base))
    reply = [(VersionMeta(1, checksum(v1)), split(layout, d1, codec)),
             (VersionMeta(2, checksum(v1) ^ 1), split(layout, d2, codec))]  # a wrong checksum
    applied: list = []
    with pytest.raises(Stale):
        apply_pull(view, layout, PullMeta(7, 0, 2, False, 7), reply, applied)
    assert view.version == 1 and _bits(view.values) == _bits(v1)
    assert [e.version for e in applied] == [1]


def test_the_log_holds_at_most_its_bytes_and_always_the_newest():
    """64 dense fp32 deltas of a 100M-parameter model held 25.6 GB at every tier: the log keeps
    what fits its bytes (each entry here is 8), however many its count allows."""
    log = DeltaLog(100, max_bytes=20)
    for v in range(1, 6):
        log.append(_entry(v))
        assert log.nbytes == 8 * len(log) <= 20
    assert len(log) == 2 and log.oldest_base == 3 and log.since(2, 5) is None
    assert [e.version for e in log.since(3, 5)] == [4, 5]
    tiny = DeltaLog(100, max_bytes=1)  # smaller than one entry: the newest stays
    tiny.append(_entry(1))
    assert len(tiny) == 1 and tiny.since(0, 1) is not None
    capped = DeltaLog(2)  # the count's evictions keep the byte count right
    for v in range(1, 5):
        capped.append(_entry(v))
    assert capped.nbytes == 16
    capped.append(_entry(9))  # a gap: a new base
    assert len(capped) == 1 and capped.nbytes == 8


# ============================================================================ block digests


class _CountingHash:
    """xxhash with its block hashes counted (what ps.core.view calls per block)."""

    def __init__(self) -> None:
        import xxhash
        self.real, self.blocks = xxhash, 0

    def xxh3_64_intdigest(self, data) -> int:
        if len(data) == 4 * BLOCK:
            self.blocks += 1
        return self.real.xxh3_64_intdigest(data)


def test_a_pulled_delta_hashes_only_the_blocks_its_chunks_cover(monkeypatch):
    """A replica verifies a version by hashing the blocks the delta's chunks covered; the
    checksum it reaches is the whole vector's, and a wrong one is still refused whole."""
    layout = Layout([KeySpec("a", (2 * BLOCK,)), KeySpec("b", (2 * BLOCK,)), KeySpec("c", (2 * BLOCK,))])
    base = normalized(_values(layout.numel, seed=5))
    view = View(layout, reuse=True)
    view.load_snapshot(epoch=3, version=0, values=base, crc=checksum(base))
    d = np.zeros(layout.numel, np.float32)
    d[2 * BLOCK:4 * BLOCK] = np.float32(0.5)
    chunks = split(layout, d, get_codec("fp32"), only=frozenset({"b"}))
    spy = _CountingHash()
    monkeypatch.setattr("ps.core.view.xxhash", spy)

    def pieces():
        a = Assembler(layout, "delta", check_finite=False, lazy=True)
        for c in chunks:
            a.add(c)
        return a.finish_pieces()

    held = _state(view)
    with pytest.raises(Stale, match="checksum"):
        view.apply_delta(3, 1, pieces(), crc=checksum(base + d) ^ 1)
    assert _state(view) == held
    want = checksum(base + d)
    spy.blocks = 0
    view.apply_delta(3, 1, pieces(), crc=want)
    assert spy.blocks == 2  # "b"'s two blocks, not all six
    assert _bits(view.values) == _bits(base + d)
    monkeypatch.undo()
    assert view.checksum == checksum(view.values) and view.digests.tolist() == block_digests(view.values).tolist()


def test_the_roots_rehash_of_what_it_changed_equals_the_whole_checksum():
    layout = Layout([KeySpec("a", (BLOCK + 3,)), KeySpec("b", (5,)), KeySpec("c", (BLOCK,))])
    v = normalized(_values(layout.numel, seed=2))
    view = View(layout)
    view.load_snapshot(epoch=1, version=0, values=v, crc=checksum(v))
    start, stop = layout.spans(["b"])[0]
    view.values[start:stop] += np.float32(1.0)
    assert blocks_of(layout.spans(["b"]), layout.numel) == [1]
    assert view.rehash(layout.spans(["b"])) == checksum(view.values)
    view.values[0] += np.float32(1.0)
    assert view.rehash() == checksum(view.values)


def test_normalized_turns_negative_zero_into_positive_zero_and_nothing_else():
    x = np.array([-0.0, 0.0, -1.5, 1e-45, -3.0e38], np.float32)
    want = np.array([0.0, 0.0, -1.5, 1e-45, -3.0e38], np.float32)
    assert _bits(normalized(x)) == _bits(want)
