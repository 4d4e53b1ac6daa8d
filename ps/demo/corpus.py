"""Byte-level text corpus built from the Python standard library's own source.

    >>> data = load_corpus(max_bytes=200_000)
    >>> sampler = BatchSampler(data, context=64, batch_size=16, seed=0)
    >>> x, y = sampler.next_batch()          # (16, 64) LongTensors
    >>> bool((x[:, 1:] == y[:, :-1]).all())
    True

The stdlib ships with every interpreter, so the demo has a realistic
(code-shaped) corpus without downloading anything.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

__all__ = ["load_corpus", "BatchSampler", "fixed_batches", "VAL_FRACTION"]

# Fraction of the corpus (taken from the end) held out for validation.
VAL_FRACTION = 0.05

# Directory names never descended into: installed third-party code is not
# "the stdlib" and differs between machines; test suites and idlelib are large,
# repetitive and sometimes contain deliberately odd bytes.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)


def _stdlib_files(root: Path) -> list[Path]:
    """All *.py files under ``root`` in sorted path order, skipping _SKIP_DIRS."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped dirs.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    # os.walk order depends on the filesystem; sorting makes it deterministic.
    return sorted(found, key=lambda p: p.as_posix())


def load_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Concatenate stdlib *.py sources into a 1-D LongTensor of byte values.

        >>> t = load_corpus(max_bytes=10_000)
        >>> t.dtype, t.numel() <= 10_000, int(t.max()) <= 255
        (torch.int64, True, True)

    Files are joined with b"\\n" in sorted path order and the result is cut at
    ``max_bytes``, so the same interpreter always yields the same tensor.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    if not files:
        raise RuntimeError(f"no *.py files found under stdlib directory {root}")

    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            blob = path.read_bytes()
        except OSError:
            # Unreadable files (permissions, dangling links) are just skipped.
            continue
        chunks.append(blob)
        total += len(blob) + 1  # +1 for the b"\n" separator
        if total >= max_bytes:
            break
    raw = b"\n".join(chunks)[:max_bytes]
    if not raw:
        raise RuntimeError(f"stdlib *.py files under {root} were all unreadable")
    # frombuffer needs a writable buffer to avoid a warning; bytearray copies.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class BatchSampler:
    """Random (x, y) next-byte-prediction windows from a 1-D token tensor.

        >>> s = BatchSampler(torch.arange(1000) % 256, context=8, batch_size=4, seed=1)
        >>> x, y = s.next_batch()
        >>> x.shape, y.shape
        (torch.Size([4, 8]), torch.Size([4, 8]))

    The last VAL_FRACTION of ``data`` is the "val" split, the rest "train".
    Each sampler owns a ``torch.Generator``: different seeds (one per worker)
    see different batches, and the global RNG is never touched.
    """

    def __init__(
        self,
        data: torch.Tensor,
        context: int,
        batch_size: int,
        seed: int,
        split: str = "train",
    ) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
        if context <= 0 or batch_size <= 0:
            raise ValueError(
                f"context and batch_size must be positive, got {context}, {batch_size}"
            )
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        cut = int(len(data) * (1.0 - VAL_FRACTION))
        self.data = (data[:cut] if split == "train" else data[cut:]).long()
        # A window needs context + 1 tokens (x plus the one-step-shifted y).
        if len(self.data) < context + 1:
            raise ValueError(
                f"{split} split has {len(self.data)} tokens, need at least {context + 1}"
            )
        self.context = context
        self.batch_size = batch_size
        self.split = split
        self._gen = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x, y), each (batch_size, context); y is x shifted left by one."""
        n_starts = len(self.data) - self.context
        starts = torch.randint(0, n_starts, (self.batch_size,), generator=self._gen)
        # Gather all windows in one indexing op instead of a Python loop.
        idx = starts[:, None] + torch.arange(self.context + 1)[None, :]
        windows = self.data[idx]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def fixed_batches(
    data: torch.Tensor,
    context: int,
    batch_size: int,
    n: int,
    seed: int,
    split: str = "train",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` reproducible batches from ``split``, e.g. a fixed evaluation set.

        >>> bs = fixed_batches(torch.arange(500) % 256, 16, 2, n=3, seed=0)
        >>> len(bs), bs[0][0].shape
        (3, torch.Size([2, 16]))
    """
    sampler = BatchSampler(data, context, batch_size, seed, split=split)
    return [sampler.next_batch() for _ in range(n)]
