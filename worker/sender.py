"""The background sender of ssp/async workers: pushes in flight, gradients summed meanwhile.

>>> from ps.core.config import JobConfig
>>> from ps.core.view import KeySpec, Layout
>>> client = ParameterClient(address, job="async-lm", worker_id="w0")
>>> client.create_job(JobConfig(name="async-lm", mode="async"), Layout([KeySpec("w", (3,))]),
...                   np.zeros(3, np.float32))
True
>>> client.register(); _ = client.pull()
>>> sender = Sender(client, in_flight=4)
>>> for clock in range(3):                  # returns at once
...     sender.submit(np.ones(3, np.float32), clock, client.view.version, client.view.epoch)
>>> sender.drain(timeout_s=30)              # before leaving: True once all are acknowledged
True
>>> sender.close(); client.close()

A push is acknowledged only once the root applied it, which across an ocean takes a while; the
training loop must not wait for that in ssp/async. Up to ``in_flight`` pushes are out at once
(async: each gradient goes up as it comes; ssp keeps one, so its clock floors arrive in
order). Gradients that arrive while all are out are summed locally and go up together as one
push (contributors = how many), so the bytes sent per step fall as the link gets slower
instead of a queue growing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import numpy as np
import torch

from ps.core.errors import Stale
from ps.core.types import NO_STEP, StepInfo, furthest
from worker.client import ParameterClient
from worker.sharded import ShardedClient

__all__ = ["Sender"]

log = logging.getLogger("hps.worker")

# What a push of no contributors carries (only skipped steps were summed): no gradient.
_NOTHING = np.zeros(0, np.float32)


class Sender:
    """Pushes what ``submit`` hands it from ``in_flight`` background threads (see the module).

    ``record`` keeps ``applied``: (lowest clock, highest clock, version) per push, for tests.
    ``bytes_up``, ``pushes`` and ``peak_in_flight`` count what it sent. A push refused as
    Stale is logged and counted in ``client.lost_steps``; any other hps error is raised by
    the next ``submit`` or ``drain``, and so is any other exception a push raised (the
    gradient it carried is not applied). Raises ValueError when ``in_flight`` < 1.
    """

    def __init__(self, client: ParameterClient | ShardedClient, record: bool = False, in_flight: int = 1) -> None:
        if in_flight < 1:
            raise ValueError(f"a sender needs at least one push in flight, got {in_flight}")
        self.client = client
        self.applied: list[tuple[int, int, int]] = []  # (clock_lo, clock_hi, version), if record
        self.newest: tuple[int, int] = (0, 0)  # (view epoch, version) of the newest acknowledged push
        self.bytes_up = 0
        self.pushes = 0
        self._record = record
        self._cv = threading.Condition()
        self._sum: np.ndarray | torch.Tensor | None = None
        self._n = 0
        self._clocks = (0, 0)
        self._base = (0, 0)  # (view epoch, oldest base version) of the summed gradients
        self._report = (0.0, 0, 0.0)  # telemetry of the summed steps (loss sum, count, seconds)
        self._step = NO_STEP  # the summed steps' step information, merged
        self._busy = 0  # pushes in flight
        self.peak_in_flight = 0
        self._pipelined = in_flight > 1
        self._moving = False  # moving back to the first tier: no push starts until it is done
        self._error: BaseException | None = None
        # Leased-data progress of pushes not applied (refused, failed, or void after a root
        # restart): it goes with the next one, or the shard it ends stays leased for good.
        self._orphaned: tuple[tuple[int, int, int], ...] = ()
        self._stop = False
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"hps-sender-{client.worker_id}-{i}")
                         for i in range(in_flight)]
        for t in self._threads:
            t.start()

    def submit(self, grad: np.ndarray | torch.Tensor | None, clock: int, base_version: int, view_epoch: int,
               report: tuple[float, int, float] = (0.0, 0, 0.0), step: StepInfo = NO_STEP) -> None:
        """Queue a gradient; raises the error a previous push ended with (e.g. the job ended).
        ``grad`` None: a step with nothing to push (an AMP overflow in ssp) that still moves this
        worker's clock floor: it goes up as a push of no contributors, or with the next gradient."""
        with self._cv:
            if self._orphaned:  # (only the progress: the step's absent keys stay its own)
                step = replace(step, progress=furthest(self._orphaned, step.progress))
                self._orphaned = ()
            if self._error is not None:
                err, self._error = self._error, None
                self._orphaned = step.progress  # this step is not pushed either
                raise err
            if self._sum is None or view_epoch != self._base[0]:
                if self._sum is not None:  # the root restarted: gradients on the old lineage are void
                    self.client.lost_steps += self._n
                    step = replace(step, progress=furthest(self._step.progress, step.progress))
                if grad is None:
                    self._sum, self._n = _NOTHING, 0
                else:
                    self._sum, self._n = grad.clone() if isinstance(grad, torch.Tensor) else grad.copy(), 1
                self._clocks, self._base = (clock, clock), (view_epoch, base_version)
                self._report, self._step = report, step
            else:
                if grad is not None and not self._n:  # only skipped steps so far
                    self._sum = grad.clone() if isinstance(grad, torch.Tensor) else grad.copy()
                elif grad is not None:
                    self._sum += grad
                self._n += grad is not None
                self._clocks = (self._clocks[0], clock)
                self._base = (view_epoch, min(self._base[1], base_version))
                (loss, n, secs), (loss2, n2, secs2) = self._report, report
                self._report = (loss + loss2, n + n2, secs + secs2)
                self._step = self._step.merge(step)
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (self._sum is None or self._moving):
                    self._cv.wait()
                if self._stop and (self._sum is None or self._moving):
                    return
                if self._pipelined and self._home_due():
                    # Back to the first tier between two pushes (as a non-pipelined push moves
                    # itself): none in flight -- those out finish where they went, and what
                    # is submitted meanwhile is summed here.
                    self._moving = True
                    self._cv.wait_for(lambda: self._busy == 0)
                    grad = None
                else:
                    grad, n, clocks, (epoch, base) = self._sum, self._n, self._clocks, self._base
                    report, step = self._report, self._step
                    self._sum = None
                    self._busy += 1
                    self.peak_in_flight = max(self.peak_in_flight, self._busy)
            if grad is None:
                self._move_home()
                continue
            try:
                version, nbytes = self.client.push(grad, clocks[0], clock_max=clocks[1], base_version=base,
                                                   view_epoch=epoch, contributors=n, report=report,
                                                   pipelined=self._pipelined, step=step)
                with self._cv:
                    self.bytes_up += nbytes
                    self.pushes += 1
                    if (epoch, version) > self.newest or epoch != self.newest[0]:
                        self.newest = (epoch, version)
                    if self._record:
                        self.applied.append((clocks[0], clocks[1], version))
            except Stale as exc:
                log.warning("%s: %d gradient(s) not applied: %s", self.client.worker_id, n, exc)
                with self._cv:
                    self.client.lost_steps += n
                    self._orphaned += step.progress
            except BaseException as exc:  # an hps error, or any other (out of memory while encoding)
                # Kept for the next submit or drain: a sending thread that ended without a word
                # lost its gradient, and drain() then reported the run's last pushes applied.
                with self._cv:
                    self._error = exc
                    self._orphaned += step.progress
                if not isinstance(exc, Exception):  # (KeyboardInterrupt, SystemExit): this thread ends
                    raise
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _home_due(self) -> bool:
        return isinstance(self.client, ParameterClient) and self.client._go_home.is_set()

    def _move_home(self) -> None:
        assert isinstance(self.client, ParameterClient)
        try:
            self.client._move_home()
        except Exception as exc:  # (never the sending thread's end) the next push registers again
            log.warning("%s: moving back to the first tier failed: %s", self.client.worker_id, exc)
        finally:
            with self._cv:
                self._moving = False
                self._cv.notify_all()

    def raise_kept(self) -> None:
        """Raise the error a push ended with, if one did and nothing raised it since (as the
        next ``submit`` would): for a caller waiting on what that push would have brought."""
        with self._cv:
            if self._error is not None:
                err, self._error = self._error, None
                raise err

    def drain(self, timeout_s: float, raise_kept: bool = True) -> bool:
        """Wait until everything submitted is acknowledged (or failed); False on timeout. Raises
        the error a push ended with that no ``submit`` raised since: the last pushes of a run
        failing must not read as applied (``HpsOptimizer.sync`` returned as if they were).
        ``raise_kept=False``: keep it for the next ``submit`` (a checkpoint's quiescing)."""
        with self._cv:
            done = self._cv.wait_for(lambda: self._sum is None and self._busy == 0, timeout_s)
            if raise_kept and self._error is not None:
                err, self._error = self._error, None
                raise err
            return done

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain for up to ``timeout_s`` seconds, then stop the sending threads (a push that
        failed meanwhile is logged: closing goes on)."""
        try:
            self.drain(timeout_s)
        except Exception as exc:  # (kept from a push, of any kind): closing goes on
            log.warning("%s: a push failed before the sender closed: %s", self.client.worker_id, exc)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)
