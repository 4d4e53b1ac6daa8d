"""The converted pytorch/examples scripts train on a local tree with two workers, as a user
runs them: separate processes, the address and the run from the environment (issue 13)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run_workers(script: str, args: list[str], address: str, tmp_path: Path, run: str) -> list[str]:
    procs = []
    for rank in range(2):
        cwd = tmp_path / f"rank{rank}"
        cwd.mkdir()
        env = {**os.environ, "HPS_ADDRESS": address, "HPS_RUN_ID": run, "RANK": str(rank), "WORLD_SIZE": "2",
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "examples" / script), *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=420)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def _matches_root(saved: dict, tree, job: str) -> None:
    _, _, _, values = tree.view("root", job)
    flat = np.concatenate([t.detach().float().reshape(-1).numpy() for t in saved.values()])
    assert np.array_equal(flat, values)  # parameters and buffers, in the job's order


def test_mnist_with_steplr_amp_and_leased_data(tree, tmp_path):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    outs = _run_workers("mnist.py", ["--samples", "384", "--epochs", "2", "--batch-size", "32",
                                     "--test-batch-size", "500", "--log-interval", "2", "--amp",
                                     "--save-model"], zone, tmp_path, "mnist-run")
    for rank, out in enumerate(outs):
        assert f"rank {rank} of 2" in out
        losses = [float(x) for x in re.findall(r"Test set: Average loss: ([0-9.]+)", out)]
        assert len(losses) == 2 and losses[-1] < 2.0, out[-2000:]   # chance is ln 10 = 2.30
    # Both workers trained on leased shards: together every sample of each epoch once.
    trained = [len(re.findall(r"Train Epoch", out)) for out in outs]
    assert all(n > 0 for n in trained), trained
    _matches_root(torch.load(tmp_path / "rank0" / "mnist_cnn.pt"), tree, "mnist")
    assert not (tmp_path / "rank1" / "mnist_cnn.pt").exists()   # rank 0 saves


def test_word_language_model_with_root_clipping_and_annealing(tree, tmp_path):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    outs = _run_workers("word_language_model.py", [
        "--emsize", "32", "--nhid", "32", "--nlayers", "1", "--epochs", "3", "--bptt", "20",
        "--batch_size", "8", "--log-interval", "20", "--lr", "20"], zone, tmp_path, "wlm-run")
    for out in outs:
        valid = [float(x) for x in re.findall(r"valid loss\s+([0-9.]+)", out)]
        assert len(valid) == 3 and valid[-1] < valid[0], out[-2000:]
    # Every worker saw the same validation losses (the same model each epoch), so they agreed
    # on every annealing step, as bsp requires.
    assert re.findall(r"valid loss\s+([0-9.]+)", outs[0]) == re.findall(r"valid loss\s+([0-9.]+)", outs[1])
    valid = [float(x) for x in re.findall(r"valid loss\s+([0-9.]+)", outs[0])]
    if valid == sorted(valid, reverse=True) and len(set(valid)) == len(valid):  # saved after the last epoch
        _matches_root(torch.load(tmp_path / "rank0" / "model.pt"), tree, "wlm")
