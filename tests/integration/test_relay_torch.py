"""A relay loads torch only for a job that needs it (a lossy codec, an outer inner loop).

torch costs a process ~2 s to import and ~180 MB of memory (``benchmarks/start.py``: a zone
serves after 0.38 s holding 57 MB, against 2.33 s and 239 MB when it imported torch). A zone
whose jobs are lossless sums, re-encodes and serves with numpy alone; the first lossy job it
attaches loads the lossy codecs (and torch) off its event loop before any push of that job can
need them. Whether a process holds torch is read from the libraries it has mapped
(``/proc/PID/maps``), so the check needs no hook inside the zone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from tests.helpers import ServeProcess, bsp_rounds, same_bits
from worker import ParameterClient

# An embedding-like table (a push touches 2 of its 64 rows: it travels as rows) and a bias.
LAYOUT = Layout([KeySpec("emb", (64, 8)), KeySpec("b", (8,))])
LR = 0.5


def _holds_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _grad(i: int, s: int) -> np.ndarray:
    g = np.zeros(LAYOUT.numel, np.float32)
    rows = g[:512].reshape(64, 8)
    rows[3 + i] = (i + 1) * (s + 1)          # each worker its own row: the zone's sum has two
    rows[40] = 0.25 * (i - s)               # and one row they share
    g[512:] = np.arange(8, dtype=np.float32) * (i + 1)
    return g


def _train(address: str, job: JobConfig, steps: int) -> list[ParameterClient]:
    ws = [ParameterClient(address, job.name, f"w{i}", timeout_s=20) for i in range(2)]
    ws[0].create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    for w in ws:
        w.register()
    for w in ws:
        w.pull(min_version=0)
    bsp_rounds(ws, steps, _grad)
    return ws


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_a_zone_of_lossless_jobs_never_loads_torch_and_a_lossy_job_loads_it(tree, tmp_path):
    root = tree.add("root", "global")
    zone = ServeProcess(tmp_path / "zone.log", "zone", [
        "--role", "zone", "--name", "z", "--parent", root, "--insecure",
        "--heartbeat-s", "0.1", "--member-timeout-s", "2"])
    clients: list[ParameterClient] = []
    try:
        assert not _holds_torch(zone.proc.pid), "a zone that holds no job loaded torch at start"

        # fp32 with rows: two pushes a round, so the zone decodes rows, sums, and re-encodes.
        steps = 3
        job = JobConfig(name="lossless", optimizer=OptimizerConfig(kind="sgd", lr=LR))
        clients += _train(zone.address, job, steps)
        expected = np.zeros(LAYOUT.numel, np.float32)
        for s in range(steps):  # one process's SGD on the average gradient, in float32
            expected -= np.float32(LR) * ((_grad(0, s) + _grad(1, s)) / np.float32(2))
        _, version, checksum, values = tree.view("root", "lossless")
        assert version == steps
        np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-6)
        for w in clients:
            assert (w.view.version, w.view.checksum) == (version, checksum)
            assert same_bits(w.view.values, values)
        assert not _holds_torch(zone.proc.pid), "a zone of a lossless job loaded torch"

        # int8: the zone decodes and re-encodes int8 (with its residual): torch, loaded for it.
        job8 = JobConfig(name="lossy", push_codec="int8", optimizer=OptimizerConfig(kind="sgd", lr=LR))
        clients += _train(zone.address, job8, 2)
        _, version, checksum, values = tree.view("root", "lossy")
        assert version == 2 and np.abs(values).max() > 0
        for w in clients[2:]:
            assert (w.view.version, w.view.checksum) == (version, checksum)
            assert same_bits(w.view.values, values)
        assert _holds_torch(zone.proc.pid), "the zone decoded int8 without torch?"
        assert "Traceback" not in zone.text(), zone.text()
    finally:
        for w in clients:
            w.close()
        zone.stop()
