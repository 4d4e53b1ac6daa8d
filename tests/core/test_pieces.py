"""A push kept as the chunks it came in (ps.core.pieces): what a batch and a relay do with it
must equal, bit for bit, what they did with the push laid out as one vector.

The relay's pass-through (its frames forwarded uncopied) is checked here against the wire's
own framing; that the result trains exactly as one process does is checked live, through
zones of one worker each, by tests/integration/test_bsp_equivalence.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.consistency import BspRound, Window, dense
from ps.core.encoder import Encoder
from ps.core.errors import BadInput
from ps.core.pieces import Pieces
from ps.core.tensors import Assembler, split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.net.frames import decode_frame
from ps.net.wire import chunks_of, encode_push
from ps.tiers.relay import _verbatim

LAYOUT = Layout([KeySpec("emb", (8, 4)), KeySpec("w", (5, 6)), KeySpec("b", (6,))])


def _grad(seed: int, zeros: float = 0.0) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal(LAYOUT.numel).astype(np.float32)
    g[np.random.default_rng(seed + 100).random(LAYOUT.numel) < zeros] = -0.0  # signed zeros
    return g


def _received(chunks, what="push") -> tuple[Pieces, np.ndarray, list[bytes]]:
    """``chunks`` sent as a push and received as a tier receives it: (its pieces, the vector the
    eager assembler made of it, the chunk frames that carried it)."""
    frames = encode_push(PushMeta("j", "w0", 1, 0), chunks)[1:-1]  # between header and end
    lazy, eager = Assembler(LAYOUT, what, lazy=True), Assembler(LAYOUT, what)
    for f in frames:
        h, payload = decode_frame(f)
        for c in chunks_of(h.chunks, payload):
            lazy.add(c)
            eager.add(c)
    return lazy.finish_pieces(), eager.finish(), frames


@pytest.mark.parametrize("codec", ["fp32", "int8", "fp16"])
def test_pieces_lay_out_and_add_exactly_as_the_assembled_vector(codec):
    # a key left out (gaps) and signed zeros: a dense add turns -0.0 + 0.0 into +0.0
    chunks = split(LAYOUT, _grad(1, zeros=0.3), get_codec(codec), chunk_elems=7, only=frozenset({"w", "b"}))
    pieces, vector, _ = _received(chunks)
    assert pieces.dense().tobytes() == vector.tobytes()
    assert pieces.dense(3).tobytes() == np.divide(vector, np.float32(3)).tobytes()
    total = np.full(LAYOUT.numel, -0.0, np.float32)
    total[::3] = _grad(2)[::3]
    want = total + vector
    pieces.add_to(total)
    assert total.tobytes() == want.tobytes()


def test_a_lazy_assembler_checks_what_the_eager_one_checks():
    chunks = split(LAYOUT, _grad(3), get_codec("fp32"), chunk_elems=7)
    a = Assembler(LAYOUT, "push", lazy=True)
    a.add(chunks[0])
    a.add(chunks[0])
    with pytest.raises(BadInput, match="overlapping"):
        a.finish_pieces()
    bad = _grad(3)
    bad[40] = np.nan
    with pytest.raises(BadInput, match="non-finite"):
        Assembler(LAYOUT, "push", lazy=True).add(split(LAYOUT, bad, get_codec("fp32"))[1])


@pytest.mark.parametrize("lazy", [True, False])
def test_chunks_covering_a_key_again_are_refused_before_they_are_decoded(lazy):
    """A sign chunk is a thirty-second of the dense bytes it decodes to: a push of many chunks
    each covering the whole key again decoded every one (a lazy assembler keeps them all), far
    past the memory reserved for the push, and was refused only at its end."""
    layout = Layout([KeySpec("w", (4096,))])
    chunk = split(layout, np.ones(4096, np.float32), get_codec("sign"))[0]
    a = Assembler(layout, "push", lazy=lazy)
    a.add(chunk)
    for _ in range(3):
        with pytest.raises(BadInput, match="overlapping chunks: chunk 1 brings them to 8192 elements"):
            a.add(chunk)
    assert a.chunks == 1  # the refused ones were not taken


@pytest.mark.parametrize("batch,early", [(BspRound, False), (BspRound, True), (Window, False)])
def test_a_batch_of_pieces_sums_bit_for_bit_as_one_of_vectors(batch, early):
    grads = [_grad(s, zeros=0.2) for s in (4, 5, 6)]
    grads[1][LAYOUT.offset("b"):] = 0.0  # the second push leaves key b out: gaps
    only = [None, frozenset({"emb", "w"}), None]
    sums = []
    for lazy in (True, False):
        b = BspRound(round=0, numel=LAYOUT.numel) if batch is BspRound else Window(numel=LAYOUT.numel)
        for i, (g, o) in enumerate(zip(grads, only, strict=True)):
            pieces, vector, _ = _received(split(LAYOUT, g, get_codec("fp32"), chunk_elems=9, only=o))
            args = (f"w{i}", 0, pieces if lazy else vector, 1, (0, 0))
            b.add(*args, owned=True) if batch is BspRound else b.add(*args[:4], (0, 0), 0, 0.0, owned=True)
            if i == 0 and lazy:  # one push: no sum is laid out
                agg = b.close() if batch is BspRound else b.close(0)
                assert agg.grad is pieces
                if early:  # a tier whose round stays open lays the first push out at once
                    b.lay_out()
                    assert dense(b.close().grad).tobytes() == vector.tobytes()
        agg = b.close() if batch is BspRound else b.close(0)
        sums.append(dense(agg.grad))
    assert sums[0].tobytes() == sums[1].tobytes()


def test_a_relay_passes_one_push_of_lossless_chunks_on_as_its_very_frames():
    g = _grad(7)
    g[LAYOUT.offset("emb") + 4: LAYOUT.offset("emb") + 32] = 0.0  # one row of 8: sent as rows
    enc = Encoder("fp32", seed="zone")
    sent = enc.split(LAYOUT, g, 0)
    assert {c.codec for c in sent} == {"rows", "fp32"}
    pieces, _, frames = _received(sent)
    chunks = _verbatim(enc, pieces, frozenset(), LAYOUT)
    assert chunks is not None
    up = encode_push(PushMeta("j", "zone", 1, 0, contributors=1), chunks)[1:-1]
    assert len(up) == len(frames) and all(a is b for a, b in zip(up, frames, strict=True))  # uncopied


def test_a_relay_re_encodes_what_it_cannot_pass_on_unchanged():
    g = _grad(8)
    fp32 = Encoder("fp32", seed="zone")
    pieces, vector, _ = _received(fp32.split(LAYOUT, g, 0))
    assert _verbatim(Encoder("int8", seed="zone"), pieces, frozenset(), LAYOUT) is None  # lossy edge
    assert _verbatim(fp32, vector, frozenset(), LAYOUT) is None  # a sum of several pushes
    int8, _, _ = _received(split(LAYOUT, g, get_codec("int8")))
    assert _verbatim(fp32, int8, frozenset(), LAYOUT) is None  # lossy chunks


def test_a_relay_leaves_out_the_keys_a_push_calls_absent_as_re_encoding_does():
    """A worker sends zeros for the keys it declares absent (frozen, unsynced buffers); the
    relay passes the rest on as they came (the received chunks themselves) and leaves those
    out, which is what re-encoding the push with ``only`` the present keys sends, bit for bit.
    (A frame that carried some of those keys is framed again: here the one frame.)"""
    g = _grad(9)
    g[LAYOUT.offset("w"):LAYOUT.offset("w") + 30] = 0.0  # "w" absent: the worker's zeros
    fp32 = Encoder("fp32", seed="zone")
    pieces, vector, _ = _received(fp32.split(LAYOUT, g, 0))
    absent = frozenset({1})
    chunks = _verbatim(fp32, pieces, absent, LAYOUT)
    assert chunks is not None and chunks and all(c.key != "w" for c in chunks)
    kept = [c for c in pieces.chunks if c.key != "w"]
    assert len(chunks) == len(kept) and all(a is b for a, b in zip(chunks, kept, strict=True))
    only = frozenset({"emb", "b"})
    fallback = fp32.split(LAYOUT, vector, 0, only, copy=False)
    sent, again = Assembler(LAYOUT, "push"), Assembler(LAYOUT, "push")
    for c in chunks:
        sent.add(c)
    for c in fallback:
        again.add(c)
    assert sent.finish().tobytes() == again.finish().tobytes()
