"""The in-process loss-anomaly check: the cases of the HpsTrainingLossRising rule, firing and
quiet (the root's log event: tests/tiers/test_root_loss_event.py)."""

from __future__ import annotations

import pytest

from ps.core.losswatch import LossWatch


def _run(reports: list[tuple[float, int]]) -> list:
    """Feed one report per minute; what closing each report returned."""
    w = LossWatch(report_s=60.0)
    out = [w.add(loss * steps, steps, now=m * 60.0) for m, (loss, steps) in enumerate(reports)]
    return out[1:] + [w.add(0.0, 0, now=len(reports) * 60.0)]


RISING_SLOWER = [(0.9, 100), (0.95, 100), (1.0, 100), (1.05, 90), (1.12, 80), (1.2, 70)]


@pytest.mark.parametrize("reports, fires", [
    (RISING_SLOWER, True),
    # quiet: the loss rose 20% but the step rate did not fall (a harder phase of the data)
    ([(0.9, 100), (0.95, 100), (1.0, 100), (1.05, 100), (1.12, 110), (1.2, 120)], False),
    # quiet: three rises, slower, but only 10% in all
    ([(0.9, 100), (0.95, 100), (1.0, 100), (1.03, 90), (1.06, 80), (1.1, 70)], False),
    # quiet: +20% and slower, but not rising at every report (noise)
    ([(0.9, 100), (0.95, 100), (1.0, 100), (1.15, 90), (1.1, 80), (1.2, 70)], False),
    # quiet: falling loss (normal training) with a slowing cluster
    ([(2.0, 100), (1.8, 100), (1.6, 100), (1.5, 90), (1.4, 80), (1.3, 70)], False),
])
def test_the_check_fires_as_the_rule_does(reports, fires):
    out = _run(reports)
    assert (out[-1] is not None) == fires
    assert all(x is None for x in out[:-1])


def test_it_reports_an_anomaly_once_until_it_clears():
    w = LossWatch(report_s=60.0)
    seen = []
    reports = RISING_SLOWER + [(1.3, 60), (1.4, 50), (0.5, 200), (0.5, 200), (0.5, 200)]
    for m, (loss, steps) in enumerate(reports):
        seen.append(w.add(loss * steps, steps, now=m * 60.0))
    assert sum(x is not None for x in seen) == 1
