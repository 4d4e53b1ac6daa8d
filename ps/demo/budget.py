"""The demo's shared pool of steps: every worker claims one before computing it.

    budget = StepBudget("hps-demo/steps", total=600)
    budget.start_together(parties=4)      # all workers up before the first step
    while budget.claim():
        ...one training step...

Every consistency mode then trains on the same number of samples (workers x steps x batch), as
the modes must be compared: in bsp each worker takes its equal share (rounds are in lockstep);
in ssp and async a faster worker takes more of them, which is what not waiting buys. A file
with an exclusive lock, since the workers are separate processes on one machine.
"""

from __future__ import annotations

import fcntl
import os
import time

__all__ = ["StepBudget"]


class StepBudget:
    def __init__(self, path: str, total: int):
        if total < 0:
            raise ValueError(f"a step budget must not be negative, got {total}")
        self.path, self.total = path, total

    @classmethod
    def create(cls, path: str, total: int) -> StepBudget:
        """A fresh pool (and a fresh start line: a previous run's arrivals do not count)."""
        for name in (path, path + ".ready"):
            with open(name, "w") as f:
                f.write("0")
        return cls(path, total)

    def claim(self) -> bool:
        """Take one step from the pool: False once all ``total`` are taken."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes
            raw = os.pread(fd, 32, 0).strip()
            taken = int(raw or b"0")
            if taken >= self.total:
                return False
            data = str(taken + 1).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            return True
        finally:
            os.close(fd)

    def taken(self) -> int:
        with open(self.path) as f:
            return int(f.read().strip() or 0)

    def start_together(self, parties: int, timeout_s: float = 120.0) -> bool:
        """Wait until ``parties`` workers called this (bounded by ``timeout_s``): every mode's
        clock then starts with all workers up, not with the first one's imports done."""
        ready = self.path + ".ready"
        fd = os.open(ready, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            n = int(os.pread(fd, 32, 0).strip() or b"0") + 1
            data = str(n).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(ready) as f:
                if int(f.read().strip() or 0) >= parties:
                    return True
            time.sleep(0.005)
        return False
