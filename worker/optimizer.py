"""The three-line integration: an optimizer-like object whose ``step()`` trains through hps.

>>> model = torch.nn.Linear(4, 1)
>>> opt = HpsOptimizer(model, address, JobConfig(name="mlp"), worker_id="w0")
>>> for x, y in [(torch.ones(8, 4), torch.zeros(8, 1))] * 3:
...     opt.zero_grad()
...     torch.nn.functional.mse_loss(model(x), y).backward()
...     result = opt.step()   # push gradients, wait for the round, bring parameters back
>>> result.version, result.applied
(3, True)
>>> opt.close()

The model's parameters are overwritten with the published view on construction (every
worker starts from the same values) and after every step. Gradients are gathered on the
model's device into one flat vector; the job's push codec compresses it there (top-k selects,
int8 quantises on the GPU), so only the compressed payload crosses to the host. Sparse
gradients (``nn.Embedding(sparse=True)``) are gathered densely on the device and travel as
rows. Parameters come back as one host-to-device copy per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ps.core.config import JobConfig
from ps.core.errors import Conflict, Stale, TimedOut, UnknownJob
from ps.core.exactly_once import MAX_IN_FLIGHT
from ps.core.view import KeySpec, Layout
from ps.net.tls import TlsFiles
from worker.client import ParameterClient, StepResult
from worker.sender import Sender

__all__ = ["HpsOptimizer"]

log = logging.getLogger("hps.worker")


def _named(params: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]]
           ) -> list[tuple[str, torch.nn.Parameter]]:
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    return list(params)


class HpsOptimizer:
    """Trains ``params`` through the job ``job`` at the tier ``address``, like a torch optimizer.

    >>> model = torch.nn.Linear(4, 1)
    >>> job = JobConfig(name="mlp-ssp", mode="ssp", staleness=1)
    >>> with HpsOptimizer(model, address, job, worker_id="w0") as opt:   # leaves the job on exit
    ...     model(torch.ones(2, 4)).sum().backward()
    ...     _ = opt.step(loss=0.5)       # the loss rides along for the tiers' metrics
    ...     version = opt.sync()         # ssp/async: wait for the last push, load the newest view
    ...     ckpt = opt.state_dict()      # clock and error-feedback residuals, for a checkpoint
    >>> version, ckpt["clock"]
    (1, 1)

    ``params``: a module or ``(name, parameter)`` pairs; parameters that do not require grad
    are left out. ``job``: a ``JobConfig`` creates the job if it does not exist (the first
    worker's values win; a running job with another configuration raises Conflict), a name
    joins one declared with ``hps job create``. On construction the worker registers, and the
    model's parameters are overwritten with the published view. ``timeout_s`` bounds each
    call, ``round_timeout_s`` a wait for a round or a clock floor (seconds). ``record`` keeps
    ``trace``: (clock, version computed on) per step, for tests. ``tls``: the worker's
    certificate files for mutual TLS (None: ``HPS_TLS_*`` if set, else plaintext). ``token``:
    the job's token (default: the environment's HPS_TOKEN; see ``ParameterClient``). Raises
    ValueError when the model's parameters do not match the job's, and the hps errors of
    ``ParameterClient``.
    """

    def __init__(self, params: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
                 address: str, job: JobConfig | str, worker_id: str | None = None,
                 timeout_s: float = 30.0, round_timeout_s: float = 600.0, record: bool = False,
                 tls: TlsFiles | None = None, token: str | None = None) -> None:
        self.params = [(n, p) for n, p in _named(params) if p.requires_grad]
        if not self.params:
            raise ValueError("HpsOptimizer needs at least one parameter that requires grad")
        name = job.name if isinstance(job, JobConfig) else job
        self.client = ParameterClient(address, name, worker_id, timeout_s, round_timeout_s, tls=tls, token=token)
        self.layout = Layout([KeySpec(n, tuple(p.shape)) for n, p in self.params])
        self.clock = 0
        self.last_step_s = 0.0
        self._iteration_start = time.perf_counter()  # step time = from one step() to the next
        # Join a running job without sending the initial values: across a WAN every joining
        # worker would otherwise ship the whole model to the root only to have it ignored.
        # Otherwise a JobConfig creates the job, and a name adopts one declared with `hps job
        # create`; the first worker's values win.
        try:
            self.client.register()
            created = False
        except UnknownJob:
            created = self.client.create_job(job, self.layout, self._flat(lambda p: p.detach()))
            self.client.register()
        problem: Exception | None = None
        if isinstance(job, JobConfig) and self.client.config != job:
            problem = Conflict(f"job {name!r} is running with another configuration "
                               f"({self.client.config}); this worker asked for {job}")
        elif self.client.layout != self.layout:
            problem = ValueError(f"the model's parameters do not match job {name!r}: the job holds "
                                 f"{[(s.key, s.shape) for s in self.client.layout]}")
        if problem is not None:
            self.client.close()  # leave again: a member that never pushes would hold up bsp rounds
            raise problem
        log.info("%s: job %s %s", self.client.worker_id, name, "created" if created else "joined")
        self.client.pull(min_version=self.client.start_version)
        self._load_view()
        self.mode = self.client.config.mode
        self.staleness = self.client.config.staleness
        self.clock = self.client.start_clock
        self.trace: list[tuple[int, int]] = []  # (clock, version computed on), if record
        self._record = record
        # async: several pushes in flight (each acknowledged only once the root applied it);
        # ssp: one, so the clock floors it reports arrive in order.
        self.sender = (Sender(self.client, record, in_flight=MAX_IN_FLIGHT if self.mode == "async" else 1)
                       if self.mode != "bsp" else None)

    @property
    def version(self) -> int:
        """The version of the parameters the model holds now."""
        return self.client.view.version

    def _flat(self, get: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
        return self._flat_device(get).cpu().numpy()

    def _flat_device(self, get: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([get(p).reshape(-1).to(torch.float32) for _, p in self.params])

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g is None:
            return torch.zeros_like(p)
        return g.coalesce().to_dense() if g.is_sparse else g

    def _load_view(self) -> None:
        values = torch.from_numpy(self.client.view.values)
        device = self.params[0][1].device
        if device.type != "cpu":
            values = values.to(device, non_blocking=True)
        off = 0
        with torch.no_grad():
            for _, p in self.params:
                n = p.numel()
                p.copy_(values[off:off + n].view_as(p))
                off += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients, as ``torch.optim.Optimizer.zero_grad`` does."""
        for _, p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self, loss: float | torch.Tensor | None = None) -> StepResult:
        """Push this step's gradients and bring back the parameters to compute the next on.

        bsp: waits for the round and returns version v+1. ssp(s): hands the gradient to the
        background sender, then waits until every live worker's updates from clocks < c - s
        are in the held version. async: takes whatever version the tier holds now.
        ``loss`` (optional) travels with the push, with the time since the previous step, so
        every tier exports the job's training loss and step time (``hps_worker_loss``).
        Raises TimedOut when the round or the clock floor does not come within
        ``round_timeout_s``; ssp/async raise here what a background push ended with (UnknownJob
        once the job ended). A push refused as Stale is logged and counted, not raised.
        """
        t0 = time.perf_counter()
        report = (0.0, 0, 0.0)
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            report = (value, 1, t0 - self._iteration_start)
        self._iteration_start = t0
        grad = self._flat_device(self._grad)  # stays on the device: the codec runs there
        if self._record:
            self.trace.append((self.clock, self.client.view.version))
        if self.sender is not None:
            return self._step_nonblocking(grad, t0, report)
        down0 = self.client.bytes_down
        applied, up = True, 0
        try:
            version, up = self.client.push(grad, clock=self.clock, report=report)
        except Stale as exc:
            # Not applied, and it will not be (its round closed while a tier restarted, or the
            # root restarted): counted in lost_steps. Wait for the version the tier names --
            # computing again on the view held would only be refused again.
            log.warning("%s: step %d not applied: %s", self.client.worker_id, self.clock, exc)
            self.client.lost_steps += 1
            applied, version = False, exc.wait_version or 0
        self.client.pull(min_version=version)
        self._load_view()
        self.clock += 1
        self.last_step_s = time.perf_counter() - t0
        return StepResult(self.client.view.version, applied, up, self.client.bytes_down - down0)

    def _step_nonblocking(self, grad: torch.Tensor, t0: float, report: tuple[float, int, float]) -> StepResult:
        assert self.sender is not None  # ssp and async have one
        sender = self.sender
        down0, up0 = self.client.bytes_down, sender.bytes_up
        view = self.client.view
        sender.submit(grad, self.clock, view.version, view.epoch, report)
        self.clock += 1
        if self.mode == "ssp":
            self.client.pull(min_clock=max(0, self.clock - self.staleness))
        else:
            self.client.pull(wait_s=0.0)
        self._load_view()
        self.last_step_s = time.perf_counter() - t0
        return StepResult(self.client.view.version, True, sender.bytes_up - up0,
                          self.client.bytes_down - down0)

    def sync(self, timeout_s: float = 60.0) -> int:
        """Wait until every pushed gradient is applied, then load the newest parameters
        (the end of training in ssp/async); returns the version now held."""
        if self.sender is not None and not self.sender.drain(timeout_s):
            raise TimedOut(f"pushes still unacknowledged after {timeout_s:.0f}s")
        self.client.pull(wait_s=0.0)
        self._load_view()
        return self.version

    def state_dict(self) -> dict:
        """What a worker checkpoint needs beyond the model: its clock and the push edge's
        error-feedback residuals (gradient mass not yet sent)."""
        self._quiesce()
        enc = self.client.encoder
        return {"clock": self.clock, "residuals": enc.state_dict() if enc is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved: the clock (never moved back) and the residuals."""
        self._quiesce()
        self.clock = max(self.clock, int(state["clock"]))
        self.client.encoder.load_state_dict(state["residuals"])

    def _quiesce(self, timeout_s: float = 60.0) -> None:
        """ssp/async: let the background sender push what it holds, so the residuals are not
        being changed by its encode while they are read or replaced."""
        if self.sender is not None and not self.sender.drain(timeout_s):
            raise TimedOut(f"pushes still unacknowledged after {timeout_s:.0f}s")

    def close(self) -> None:
        """Drain the background sender (ssp/async), stop heart-beating and leave the job."""
        if self.sender is not None:
            self.sender.close(self.client.timeout_s)
        self.client.close()

    def __enter__(self) -> HpsOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
