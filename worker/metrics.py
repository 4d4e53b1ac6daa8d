"""Metrics a training script serves about its own job: loss, steps and step time.

>>> from urllib.request import urlopen
>>> from ps.tiers.metrics import serve_metrics
>>> registry = CollectorRegistry()
>>> train = TrainingMetrics("lm", registry)
>>> httpd = serve_metrics(registry, 0)       # GET /metrics (a real script: 9200, host="0.0.0.0")
>>> train.report(loss=2.31, steps=10, seconds=4.2)    # feeds the loss-anomaly alert
>>> page = urlopen(f"http://127.0.0.1:{httpd.server_port}/metrics").read().decode()
>>> [line for line in page.splitlines() if line.startswith("hps_training_loss")]
['hps_training_loss{job="lm"} 2.31']
>>> httpd.shutdown()

The tiers' own metrics are in ps.tiers.metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["TrainingMetrics"]

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TrainingMetrics:
    """What a training script reports about its job: loss, steps and step time.

        registry = CollectorRegistry()
        train = TrainingMetrics("lm", registry)
        serve_metrics(registry, 9200, host="0.0.0.0")    # ps.tiers.metrics
        t0 = time.perf_counter()
        for step, batch in enumerate(batches):
            loss = ...; opt.step()
            if step % 10 == 9:
                train.report(loss=running_mean, steps=10, seconds=time.perf_counter() - t0)
                t0 = time.perf_counter()

    The ``HpsTrainingLossRising`` alert (deploy/prometheus/rules/hps.rules.yml) watches these:
    each evaluation of its group is one report. The worker id is the scrape target (instance),
    never a label. Workers using ``HpsOptimizer`` also report loss and step time with their
    pushes, and every tier exports them as ``hps_worker_loss`` / ``hps_worker_step_seconds``
    (the root: job-wide); this class is for scripts that want their own series too.
    """

    def __init__(self, job: str, registry: CollectorRegistry) -> None:
        self._loss = Gauge("hps_training_loss", "Training loss at the latest report (a running "
                           "mean over the steps since the previous one)", ["job"],
                           registry=registry).labels(job=job)
        self._steps = Counter("hps_training_steps_total", "Training steps (optimizer steps) taken",
                              ["job"], registry=registry).labels(job=job)
        self._step_s = Histogram("hps_training_step_duration_seconds", "Wall time of one training "
                                 "step (compute, push and pull), averaged over each report",
                                 ["job"], registry=registry, buckets=_STEP_BUCKETS).labels(job=job)

    def report(self, loss: float, steps: int = 1, seconds: float | None = None) -> None:
        """Record the loss now, ``steps`` more steps, and the ``seconds`` they took (if known)."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if seconds is not None and (seconds < 0 or (seconds > 0 and steps == 0)):
            raise ValueError(f"seconds must be >= 0 and cover at least one step, got {seconds} "
                             f"for {steps} steps")
        self._loss.set(loss)
        self._steps.inc(steps)
        if seconds is not None and steps:
            for _ in range(steps):  # one observation per step, so _count counts steps
                self._step_s.observe(seconds / steps)
