"""Unit tests for ps.demo: corpus, model and report helpers.

    .venv/bin/python -m pytest -q tests/demo/test_demo_pieces.py

Kept small (short corpus slices, tiny models, one thread) so the whole file
runs in a few seconds on a 2-core machine.
"""

from __future__ import annotations

import math

import pytest
import torch

from ps.demo.corpus import VAL_FRACTION, BatchSampler, fixed_batches, load_corpus
from ps.demo.model import ModelConfig, TinyLM, build_model
from ps.demo.report import human_bytes, plot_loss, summary_table

__all__: list[str] = []

# Enough text for every sampler test; far smaller than the 4 MB default.
_CORPUS_BYTES = 300_000


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Intra-op threading adds noise and overhead for these tiny tensors and
    # would fight with pytest-xdist workers; restore afterwards.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(max_bytes=_CORPUS_BYTES)


# ---------------------------------------------------------------- corpus


def test_corpus_nonempty_and_byte_valued(corpus):
    assert corpus.dim() == 1
    assert corpus.dtype == torch.long
    # The stdlib is several MB, so the cap must be hit exactly.
    assert corpus.numel() == _CORPUS_BYTES
    assert int(corpus.min()) >= 0 and int(corpus.max()) <= 255
    # Python source is mostly printable ASCII; guards against e.g. reading
    # .pyc files or returning zeros.
    text = bytes(corpus[:5000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_corpus_deterministic(corpus):
    assert torch.equal(load_corpus(max_bytes=_CORPUS_BYTES), corpus)
    # A shorter load is a prefix of a longer one (same file order).
    assert torch.equal(load_corpus(max_bytes=1000), corpus[:1000])


def test_corpus_rejects_bad_max_bytes():
    with pytest.raises(ValueError, match="-5"):
        load_corpus(max_bytes=-5)


def test_corpus_missing_stdlib_raises(monkeypatch, tmp_path):
    import ps.demo.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(RuntimeError, match=str(tmp_path)):
        corpus_mod.load_corpus(1000)


def test_batch_shapes_and_shift(corpus):
    sampler = BatchSampler(corpus, context=32, batch_size=8, seed=0)
    for _ in range(3):
        x, y = sampler.next_batch()
        assert x.shape == (8, 32) and y.shape == (8, 32)
        assert x.dtype == torch.long and y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        # Each row really is a contiguous window of the corpus.
        hay = bytes(corpus.tolist())
        row = bytes(x[0].tolist()) + bytes(y[0, -1:].tolist())
        assert row in hay


def test_same_seed_same_batches_different_seed_different(corpus):
    a = fixed_batches(corpus, context=16, batch_size=4, n=3, seed=7)
    b = fixed_batches(corpus, context=16, batch_size=4, n=3, seed=7)
    c = fixed_batches(corpus, context=16, batch_size=4, n=3, seed=8)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_sampler_does_not_touch_global_rng(corpus):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    BatchSampler(corpus, context=16, batch_size=4, seed=0).next_batch()
    assert torch.equal(torch.rand(3), expected)


def test_train_val_splits_do_not_overlap():
    # Distinct token *positions* are what matter; encode the position in the
    # data itself so overlap of windows is directly observable.
    n = 10_000
    data = torch.arange(n)
    cut = int(n * (1 - VAL_FRACTION))
    train = BatchSampler(data, context=16, batch_size=64, seed=0, split="train")
    val = BatchSampler(data, context=16, batch_size=64, seed=0, split="val")
    seen_train, seen_val = set(), set()
    for _ in range(20):
        x, y = train.next_batch()
        seen_train.update(x.flatten().tolist(), y.flatten().tolist())
        x, y = val.next_batch()
        seen_val.update(x.flatten().tolist(), y.flatten().tolist())
    assert seen_train and seen_val
    assert seen_train.isdisjoint(seen_val)
    assert max(seen_train) < cut <= min(seen_val)


def test_sampler_rejects_bad_args():
    data = torch.arange(100)
    with pytest.raises(ValueError, match="'dev'"):
        BatchSampler(data, 8, 2, 0, split="dev")
    with pytest.raises(ValueError, match="val"):
        BatchSampler(data, context=8, batch_size=2, seed=0, split="val")  # 5 tokens


# ----------------------------------------------------------------- model

_SMALL = ModelConfig(context=32, d_model=64, n_heads=4, n_layers=2, d_ff=256)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_model_deterministic_from_seed():
    a, b, c = build_model(_SMALL, 1), build_model(_SMALL, 1), build_model(_SMALL, 2)
    pa, pb, pc = _params(a), _params(b), _params(c)
    assert all(torch.equal(p, q) for p, q in zip(pa, pb))
    assert not all(torch.equal(p, q) for p, q in zip(pa, pc))


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    build_model(_SMALL, seed=99)
    assert torch.equal(torch.rand(4), expected)


def test_init_scheme():
    model = build_model(ModelConfig(), seed=0)
    for name, p in model.named_parameters():
        if name.endswith(".bias") and "ln" not in name:
            assert torch.count_nonzero(p) == 0, name
    std = model.tok_emb.weight.std().item()
    assert 0.015 < std < 0.025


def test_forward_shapes_and_loss_at_init(corpus):
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    x, y = BatchSampler(corpus, cfg.context, batch_size=8, seed=0).next_batch()
    logits, loss = model(x, y)
    assert logits.shape == (8, cfg.context, cfg.vocab)
    assert loss is not None and loss.dim() == 0
    # Near-uniform predictions at init give cross-entropy ~ ln(256).
    assert abs(loss.item() - math.log(256)) < 0.3
    _, no_loss = model(x)
    assert no_loss is None


def test_model_is_causal():
    model = build_model(_SMALL, seed=0).eval()
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256  # change only the future
    with torch.no_grad():
        l1, _ = model(x)
        l2, _ = model(x2)
    assert torch.allclose(l1[0, :10], l2[0, :10], atol=1e-6)
    assert not torch.allclose(l1[0, 10:], l2[0, 10:])


def test_model_rejects_too_long_sequence():
    model = build_model(_SMALL, seed=0)
    with pytest.raises(ValueError, match="33"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_overfit_one_batch(corpus):
    model = build_model(_SMALL, seed=0)
    x, y = fixed_batches(corpus, _SMALL.context, batch_size=8, n=1, seed=3)[0]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    _, first = model(x, y)
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
    _, last = model(x, y)
    assert last.item() < 0.6 * first.item(), (first.item(), last.item())


def test_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="130"):
        ModelConfig(d_model=130, n_heads=4)


@pytest.mark.parametrize("field", ["vocab", "context", "d_model", "n_layers", "d_ff"])
def test_config_rejects_nonpositive(field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: 0})


def test_config_rejects_bad_dropout():
    with pytest.raises(ValueError, match="1.5"):
        ModelConfig(dropout=1.5)


def test_default_model_size():
    model = TinyLM(ModelConfig())
    assert sum(p.numel() for p in model.parameters()) == 470_528


# ---------------------------------------------------------------- report


def test_summary_table_aligns_columns():
    rows = [
        {"name": "sync", "loss": 1.5, "steps": 1200, "bytes": human_bytes(1_258_291)},
        {"name": "async-long", "loss": 0.25, "steps": 7},
    ]
    out = summary_table(rows, ["name", "loss", "steps", "bytes"])
    lines = out.splitlines()
    assert len(lines) == 4
    header, sep = lines[0], lines[1]
    assert set(sep.replace(" ", "")) == {"-"}
    assert "1,200" in out and "1.2 MiB" in out and "1.5000" in out
    # Every column starts at the same offset in every line: the two-space
    # gutter before each column is blank (rows are right-stripped, so a row
    # with an empty last cell may simply be shorter).
    starts = [i for i, ch in enumerate(sep) if ch == "-" and (i == 0 or sep[i - 1] == " ")]
    assert len(starts) == 4
    for line in lines[2:]:
        for s in starts[1:]:
            if s < len(line):
                assert line[s - 2 : s] == "  ", (line, s)
    assert lines[2].endswith("1.2 MiB") and lines[2].index("1.2 MiB") == starts[3]
    # Numeric columns are right-aligned: numbers end at the same column.
    steps_end = header.index("steps") + len("steps")
    assert lines[2][steps_end - 5 : steps_end] == "1,200"
    assert lines[3][steps_end - 2 : steps_end] == " 7"
    loss_end = header.index("loss") + len("loss")
    assert lines[2][loss_end - 6 : loss_end] == "1.5000"
    assert lines[3][loss_end - 6 : loss_end] == "0.2500"
    # Text columns are left-aligned.
    assert lines[2].startswith("sync ") and lines[3].startswith("async-long")


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1024) == "1.0 KiB"
    assert human_bytes(1_258_291) == "1.2 MiB"
    assert human_bytes(5 * 2**40) == "5.0 TiB"


def test_plot_loss_writes_png(tmp_path):
    path = tmp_path / "loss.png"
    series = {
        "sync": [(i, 5.5 - 0.1 * i) for i in range(20)],
        "async": [(i, 5.5 - 0.08 * i) for i in range(0, 20, 2)],
    }
    out = plot_loss(series, str(path), "demo loss")
    assert out == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


# ------------------------------------------------------------- docstrings


@pytest.mark.parametrize("modname", ["ps.demo.corpus", "ps.demo.model", "ps.tools.format"])
def test_docstring_examples(modname):
    # The usage examples opening each docstring must stay true.
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(modname))
    assert result.attempted > 0
    assert result.failed == 0
