"""``hps reshard``: spread a stopped sharded job over another number of root shards (or other
weights), between runs.

    hps reshard --job lm --from /ckpt/shard-0 /ckpt/shard-1 /ckpt/shard-2 \\
                --to /new/shard-0 /new/shard-1 /new/shard-2 /new/shard-3 [--weights 2,1,1,1]

Each source is an old shard's ``--checkpoint-dir`` (in shard order); its job is restored as the
shard would restore it (newest checkpoint plus its write-ahead log, in a temporary copy: the
sources are only read). ``ps.core.sharding.reshard`` re-places the blocks on the new ring
(parameters, the published view and the optimizer state carried bit for bit) and each target
gets a checkpoint at the same version; start shard ``i`` of the new N with ``--shard i/N
--checkpoint-dir TARGET_i``. Only the blocks the ring moves change owner (the report says how
many). The targets must not hold the job already. The job's token hash (``job-tokens.json`` in
each old shard's checkpoint directory; one token acts at every shard) goes to every new shard,
so the job's workers keep their token; where the old shards hold no hash or different ones
(a job from before tokens were shared), none is carried and the report says so.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ps.core.config import ShardingConfig
from ps.core.errors import BadInput
from ps.core.sharding import reshard
from ps.server.auth import TOKENS_FILE, Guard
from ps.tiers import checkpoint
from ps.tools.export import find_job_dir, restored

__all__ = ["reshard_dirs", "Resharded"]


@dataclass(frozen=True)
class Resharded:
    job: str
    version: int
    blocks: int
    moved: int
    shards_before: int
    shards_after: int
    bytes_per_shard: tuple[int, ...]
    token_carried: bool = False   # the job's token hash went to every new shard


def _token_hash(job_dir: Path, job: str) -> str | None:
    """The job's token hash (hex) in the old shard's ``job-tokens.json``, or None."""
    try:
        held = json.loads((job_dir.parent / TOKENS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return held.get(job) if isinstance(held, dict) else None


def _restored(job_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The job of one old shard as a checkpoint's (arrays, meta), write-ahead log replayed."""
    with restored(job_dir) as (root, js):
        return root._ckpt_state(js)


def reshard_dirs(sources: list[str | Path], targets: list[str | Path], job: str,
                 weights: tuple[float, ...] | None = None, block_elems: int | None = None) -> Resharded:
    """Reshard (see the module), holding every source's and target's checkpoint directory the
    way a root holds it (``checkpoint.hold``): refused while a root serves any of them."""
    with contextlib.ExitStack() as held:
        if job and targets:
            dirs = [find_job_dir(s, job).parent for s in sources] + [Path(t) for t in targets]
            for d in {d.resolve(): d for d in dirs}.values():
                held.enter_context(checkpoint.hold(d))
        return _reshard_dirs(sources, targets, job, weights, block_elems)


def _reshard_dirs(sources: list[str | Path], targets: list[str | Path], job: str,
                  weights: tuple[float, ...] | None, block_elems: int | None) -> Resharded:
    if not job:
        raise BadInput("name the job (--job)")
    if not targets:
        raise BadInput("give the new shards' checkpoint directories (--to), in shard order")
    if len({Path(t).resolve() for t in targets}) != len(targets):
        raise BadInput(f"the target directories {[str(t) for t in targets]} name one directory twice: each new "
                       "shard needs its own (one shard's checkpoint overwrote another's)")
    dirs = [find_job_dir(s, job) for s in sources]
    out_dirs = [Path(t) / job for t in targets]
    for d in out_dirs:
        if d.exists() and any(d.iterdir()):
            raise BadInput(f"{d} already holds files of job {job!r}; give empty target directories")
    old = [_restored(d) for d in dirs]
    if weights is None:
        weights = (1.0,) * len(targets)
    if len(weights) != len(targets):
        raise BadInput(f"{len(weights)} weights for {len(targets)} target shards")
    first = old[0][1]["config"].get("sharding") or {}
    sharding = ShardingConfig(weights=weights, block_elems=block_elems or int(first.get("block_elems", 1 << 20)))
    new, moved = reshard(old, sharding)
    hashes = {_token_hash(d, job) for d in dirs}
    held = hashes.pop() if len(hashes) == 1 else None
    # Each target's files are written beside it (a name no root takes for a job) and moved into
    # place only once every target's are: a failure halfway leaves no target half written (and
    # a rerun is not refused for it).
    # The job's token goes first, so no target serves the job without it; on a failure the
    # tokens set and the targets renamed into place are taken out again, and the renames are
    # made durable before this returns.
    staged = [d.with_name(f".{d.name}.resharding") for d in out_dirs]
    placed: list[Path] = []
    before: dict[Path, bytes] = {}  # each target's hash for the job as it was, for a roll-back
    try:
        for d, (arrays, meta) in zip(staged, new, strict=True):
            shutil.rmtree(d, ignore_errors=True)
            checkpoint.save(d, int(meta["version"]), arrays, meta)
        roster = dirs[0] / "roster.json"
        if roster.exists():  # ranks and data-shard leases live at shard 0
            checkpoint.write_atomic(staged[0] / "roster.json", json.dumps(json.loads(roster.read_text())))
        if held:
            for t in targets:
                guard = Guard(None, store=Path(t) / TOKENS_FILE)
                before[Path(t)] = guard.hashes().get(job, b"")
                guard.set_hash(job, bytes.fromhex(held))
        for d, final in zip(staged, out_dirs, strict=True):
            if final.exists():
                final.rmdir()  # empty (checked above)
            d.rename(final)
            placed.append(final)
        for final in placed:
            checkpoint.fsync_dir(final.parent)
    except BaseException:
        for d in staged + placed:
            shutil.rmtree(d, ignore_errors=True)
        for t, h in before.items():  # the tokens set, as they were
            try:
                Guard(None, store=t / TOKENS_FILE).set_hash(job, h)
            except (OSError, ValueError):
                pass  # the failure being raised says more
        raise
    blocks = sum(len(m["keys"]) for _, m in new)
    return Resharded(job, int(new[0][1]["version"]), blocks, moved, len(old), len(new),
                     tuple(4 * a["params"].size for a, _ in new), bool(held))
