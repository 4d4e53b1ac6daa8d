"""The loss-anomaly check of the alert rules, run where the losses arrive (pure, time injected).

    >>> w = LossWatch(report_s=60.0)
    >>> reports = [(0.9, 100), (0.95, 100), (1.0, 100), (1.05, 90), (1.12, 80), (1.2, 70)]
    >>> [w.add(loss * steps, steps, now=minute * 60.0) for minute, (loss, steps) in enumerate(reports)]
    [None, None, None, None, None, None]
    >>> w.add(1.3, 1, now=360.0)   # the 6th report closes: 3 rises, +20%, 240 steps after 300
    (1.2, 1.0)

The root hears every worker's loss with its pushes (``PushHeader.loss_sum``). The same sums
feed ``hps_worker_loss`` and the ``HpsTrainingLossRising`` rule (deploy/prometheus): one
report per ``report_s`` (the rule group's 1-minute evaluation), and an anomaly when the mean
loss rose at each of the last three reports, by more than 15% in all, while the steps per
report fell below those of the three before. ``add`` returns (loss now, loss three reports ago)
the first time a report closes so, and None otherwise, so the tier logs one line
(``training.loss_rising``) a log pipeline can alert on without Prometheus.
"""

from __future__ import annotations

from collections import deque

__all__ = ["LossWatch", "RISE"]

RISE = 1.15  # the rule's "by more than 15%"


class LossWatch:
    """One job's reports: mean loss and steps per ``report_s`` seconds."""

    def __init__(self, report_s: float = 60.0) -> None:
        self.report_s = report_s
        self._start: float | None = None
        self._loss = 0.0
        self._count = 0
        self._reports: deque[tuple[float, int]] = deque(maxlen=7)  # (mean loss, steps)
        self._firing = False

    def add(self, loss_sum: float, loss_count: int, now: float) -> tuple[float, float] | None:
        """Count one push's losses (throughput: steps per report, as the rule's rate of step
        counts); (loss, loss three reports ago) when a report closes with the anomaly and it was
        not already reported, else None."""
        if self._start is None:
            self._start = now
        out = None
        while now - self._start >= self.report_s:  # close the reports that ended before now
            if self._count:
                self._reports.append((self._loss / self._count, self._count))
            self._loss, self._count = 0.0, 0
            self._start += self.report_s
            out = self._check() or out
        self._loss += loss_sum
        self._count += loss_count
        return out

    def _check(self) -> tuple[float, float] | None:
        r = list(self._reports)
        if len(r) < 4:
            return None
        l3, l2, l1, l0 = (x[0] for x in r[-4:])  # l0: the newest report
        rising = l0 > RISE * l3 and l0 > l1 > l2 > l3
        slower = len(r) >= 6 and sum(x[1] for x in r[-3:]) < sum(x[1] for x in r[-6:-3])
        anomaly = rising and slower
        fire = anomaly and not self._firing
        self._firing = anomaly
        return (round(l0, 6), round(l3, 6)) if fire else None
