"""A DataLoader batch sampler over shards leased from the root: every sample of an epoch is
trained once, even when a worker dies mid-epoch (its shard goes to another worker, from the
samples whose gradients the root applied).

>>> import numpy as np
>>> from ps.core.config import JobConfig
>>> from ps.core.types import StepInfo
>>> from ps.core.view import KeySpec, Layout
>>> client = ParameterClient(address, job="sampled", worker_id="s0")
>>> client.create_job(JobConfig(name="sampled"), Layout([KeySpec("w", (2,))]), np.zeros(2, np.float32))
True
>>> client.register(); client.pull()
8
>>> data = torch.utils.data.TensorDataset(torch.arange(10))
>>> sampler = LeasedSampler(client, len(data), batch_size=4, shard_size=5, seed=0)
>>> sampler.set_epoch(0)
>>> for (x,) in torch.utils.data.DataLoader(data, batch_sampler=sampler):
...     progress = sampler.step_progress()       # (epoch, shard, end offset) of this batch
...     version, _ = client.push(np.zeros(2, np.float32), step=StepInfo(progress=progress))
...     _ = client.pull(min_version=version)      # (a real step pushes its gradient)
...     print(x.tolist(), progress)
[4, 1, 7, 5] ((0, 0, 4),)
[3] ((0, 0, 5),)
[9, 0, 8, 6] ((0, 1, 4),)
[2] ((0, 1, 5),)
>>> client.close()

Batches stay within one shard (the last of a shard may be short). The training loop calls
``step_progress`` once per optimizer step and sends it with the push (``StepInfo.progress``):
the root records it with the version that applies the gradient, so a sample counts as trained
iff its gradient was applied. Batches are consumed in the order they were yielded, DataLoader
prefetching included, so the progress FIFO matches the batch being trained.

When every unfinished shard of the epoch is leased to other workers, the sampler calls
``idle()`` (in bsp: push an empty contribution and pull, so the others' rounds are not held up)
and asks again, at most every half second; the iterator ends when nothing of the epoch is left
for this worker. While it holds leases a background thread renews them every third of the
lease timeout; a worker that dies stops renewing and its shards go back to the pool.

Shard ``s`` of epoch ``e`` is positions ``[s * shard_size, ...)`` of
``torch.randperm(length, generator=seed + e)``, the same on every worker (``shard_indices``);
the permutation of the epoch being iterated is kept (8 bytes per sample).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from ps.core.errors import BadInput, HpsError
from ps.core.leases import DONE, GRANTED, Dataset, Grant
from ps.core.types import furthest
from worker.client import ParameterClient
from worker.sharded import ShardedClient

__all__ = ["LeasedSampler", "shard_indices"]

log = logging.getLogger("hps.worker")

_POLL_S = (0.02, 0.5)  # first and largest pause between lease calls answered "wait"


def shard_indices(dataset: Dataset, epoch: int, shard: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The dataset indices of ``shard`` in ``epoch``, in training order (the same on every worker).

    >>> shard_indices(Dataset(length=10, shard_size=5), epoch=0, shard=1).tolist()
    [9, 0, 8, 6, 2]
    """
    if perm is None:
        perm = epoch_permutation(dataset, epoch)
    first = shard * dataset.shard_size
    return perm[first:first + dataset.shard_len(shard)]


def epoch_permutation(dataset: Dataset, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(dataset.seed + epoch)
    return torch.randperm(dataset.length, generator=g)


class LeasedSampler:
    """Batches of dataset indices from shards the root leases to this worker; pass it to
    ``DataLoader(dataset, batch_sampler=...)``. ``client``: the worker's ``ParameterClient``;
    ``idle``: called while other workers hold every shard left (None: just wait). Call
    ``set_epoch(e)`` before iterating each epoch, as with ``DistributedSampler``."""

    def __init__(self, client: ParameterClient | ShardedClient, dataset_len: int, batch_size: int,
                 shard_size: int = 1024, seed: int = 0, idle: Callable[[], None] | None = None,
                 lease_timeout_s: float = 30.0) -> None:
        if batch_size < 1:
            raise BadInput(f"batch_size must be >= 1, got {batch_size}")
        self.client = client
        self.dataset = Dataset(dataset_len, shard_size, seed, lease_timeout_s)
        self.batch_size = batch_size
        self.idle = idle
        self.epoch = 0
        # (iteration, progress) of each batch yielded and not yet reported
        self._fifo: deque[tuple[int, tuple[tuple[int, int, int], ...]]] = deque()
        self._iterations = 0
        self._leased_by: dict[tuple[int, int], int] = {}  # shard -> the iteration it was last handed to
        self._held: set[tuple[int, int]] = set()   # leased to this worker, not known finished
        self._lost: set[tuple[int, int]] = set()   # handed to another worker: stop yielding from them
        self._lock = threading.Lock()
        self._iterating = 0
        self._renewer: threading.Thread | None = None
        self._perm: tuple[int, torch.Tensor] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """An estimate: the epoch's batches divided among the job's world size."""
        ds = self.dataset
        batches = sum(-(-ds.shard_len(s) // self.batch_size) for s in range(ds.shards))
        info = self.client._rank_info
        world = info.world_size if info is not None and info.world_size else 1
        return -(-batches // world)

    def step_progress(self, batches: int = 1) -> tuple[tuple[int, int, int], ...]:
        """The (epoch, shard, end offset) of the oldest ``batches`` batches yielded and not yet
        reported (the furthest per shard): call once per optimizer step, with the number of
        batches the step trained on, and send it in the push's ``StepInfo.progress``."""
        with self._lock:
            taken = [self._fifo.popleft()[1] for _ in range(min(batches, len(self._fifo)))]
        return furthest(*taken) if len(taken) > 1 else taken[0] if taken else ()

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        with self._lock:
            self._iterating += 1
            self._iterations += 1
            me = self._iterations
        self._start_renewer()
        delay = _POLL_S[0]
        leased: set[tuple[int, int]] = set()  # the shards this iteration was handed
        try:
            while True:
                grant = self._lease(epoch, want=True)
                if grant.status == DONE:
                    return
                if grant.status != GRANTED:  # wait: the shards left are other workers'
                    start = time.monotonic()
                    if self.idle is not None:
                        self.idle()
                    pause = delay - (time.monotonic() - start)
                    if pause > 0:
                        time.sleep(pause)
                    delay = min(delay * 2, _POLL_S[1])
                    continue
                delay = _POLL_S[0]
                order = shard_indices(self.dataset, epoch, grant.shard, self._permutation(epoch))
                key, pos = (epoch, grant.shard), grant.start
                leased.add(key)
                with self._lock:
                    self._leased_by[key] = me
                while pos < grant.end:
                    with self._lock:
                        if key in self._lost:
                            log.warning("%s: shard %d of epoch %d went to another worker (this one's lease "
                                        "expired); leaving it at offset %d", self.client.worker_id, key[1],
                                        epoch, pos)
                            break
                        end = min(pos + self.batch_size, grant.end)
                        self._fifo.append((me, ((epoch, grant.shard, end),)))
                    yield order[pos:end].tolist()
                    pos = end
        except GeneratorExit:
            # The loop left the epoch early (a break, an exception, max_steps): the batches it was
            # handed and did not step on (a DataLoader's prefetch) are not its progress, and its
            # shards are no longer its own -- no longer renewed, they go back to the pool when
            # their leases expire, or to this worker again, from their trained offsets, when it
            # iterates the epoch again. Renewed as held, they stayed leased for good.
            # Only this iteration's entries and shards: a generator is closed when it is
            # collected, maybe after a newer iteration of the loop yielded batches of its own.
            with self._lock:
                self._fifo = deque(e for e in self._fifo if e[0] != me)
                self._held -= {k for k in leased if self._leased_by.get(k) == me}
            raise
        finally:
            with self._lock:
                self._iterating -= 1
                for k in leased:
                    if self._leased_by.get(k) == me:
                        del self._leased_by[k]

    # -- internals -------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(self.dataset, epoch))
        return self._perm[1]

    def _lease(self, epoch: int, want: bool) -> Grant:
        with self._lock:
            held = tuple(sorted(self._held))
        grant = self.client.lease(self.dataset, epoch, want=want, held=held)
        with self._lock:
            for key in grant.lost:
                self._held.discard(key)
                self._lost.add(key)
            if grant.status == GRANTED:
                self._held.add((grant.epoch, grant.shard))
                self._lost.discard((grant.epoch, grant.shard))
        return grant

    def _start_renewer(self) -> None:
        with self._lock:
            if self._renewer is not None and self._renewer.is_alive():
                return
            self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name=f"hps-lease-{self.client.worker_id}")
            self._renewer.start()

    def _renew_loop(self) -> None:
        """Renew this worker's leases while it iterates or holds shards not known finished."""
        period = self.dataset.lease_timeout_s / 3
        while True:
            time.sleep(period)
            with self._lock:
                if (not self._iterating and not self._held) or self.client._closed:
                    self._renewer = None
                    return
            try:
                self._lease(self.epoch, want=False)
            except HpsError as exc:
                log.warning("%s: renewing data-shard leases failed: %s", self.client.worker_id, exc)
