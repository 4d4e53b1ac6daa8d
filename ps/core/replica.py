"""A replica follows its parent: apply what a pull brought to a view, verified (pure).

>>> import numpy as np
>>> from ps.core.codecs import get_codec
>>> from ps.core.tensors import split
>>> from ps.core.view import KeySpec, checksum
>>> layout = Layout([KeySpec("w", (3,))]); view = View(layout); one = np.ones(3, np.float32)
>>> snapshot = [(VersionMeta(3, checksum(one)), split(layout, one, get_codec("fp32")))]
>>> pulled = apply_pull(view, layout, PullMeta(7, 0, 3, snapshot=True, server_epoch=7), snapshot)
>>> deltas = [(VersionMeta(4, checksum(2 * one)), split(layout, one, get_codec("fp32")))]  # d_4
>>> pulled = apply_pull(view, layout, PullMeta(7, 3, 4, snapshot=False, server_epoch=7), deltas)
>>> view.version, view.values
(4, array([2., 2., 2.], dtype=float32))
>>> [d.version for d in pulled.entries]   # the deltas applied, as the log keeps them
[4]
>>> pulled.new_lineage                    # the root restarted: residuals on the old view are void
False

Relays and workers hold replicas the same way: every version's checksum is verified before the
view changes (invariant 1), a delta applies only onto its exact base (invariant 5), and a
snapshot replaces the view whole. A refused version changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps.core.deltas import DeltaEntry
from ps.core.tensors import Assembler, Chunk, assemble, payload_bytes
from ps.core.types import PullMeta, VersionMeta
from ps.core.view import Layout, View

__all__ = ["Pulled", "apply_pull"]


@dataclass(frozen=True)
class Pulled:
    nbytes: int                       # payload bytes received
    snapshot: bool                    # the view was replaced whole
    new_lineage: bool                 # ... by a snapshot of another root epoch than it held
    entries: tuple[DeltaEntry, ...]   # the deltas applied, in order (none for a snapshot)


def apply_pull(view: View, layout: Layout, meta: PullMeta,
               versions: list[tuple[VersionMeta, list[Chunk]]],
               applied: list[DeltaEntry] | None = None) -> Pulled:
    """Bring ``view`` to what the pull brought; ``Stale`` when a version does not apply to its
    base or fails its checksum, ``BadInput`` when its chunks do not assemble: that version
    changed nothing, but the ones before it in the reply hold (each delta is applied in place;
    ``applied`` is given each one as it is, so a relay's log keeps them and matches its view)."""
    if meta.snapshot:
        vm, chunks = versions[0]
        values = assemble(layout, chunks, what="snapshot", check_finite=False, require_all=True)
        previous = view.epoch
        view.load_snapshot(meta.view_epoch, vm.version, values, vm.checksum, vm.clock_min)
        return Pulled(payload_bytes(chunks), True, bool(previous) and previous != meta.view_epoch, ())
    entries, nbytes = [], 0
    for vm, chunks in versions:
        # Added to the view straight from the chunks: no delta vector laid out first (a 400 MB
        # copy per version at every relay and worker on the way down).
        a = Assembler(layout, what=f"delta {vm.version}", check_finite=False, lazy=True)
        for c in chunks:
            a.add(c)
        view.apply_delta(meta.view_epoch, vm.version, a.finish_pieces(), vm.checksum, vm.clock_min)
        entries.append(DeltaEntry(vm.version, vm.checksum, tuple(chunks), vm.clock_min, vm.contributors))
        if applied is not None:
            applied.append(entries[-1])
        nbytes += payload_bytes(chunks)
    return Pulled(nbytes, False, False, tuple(entries))
