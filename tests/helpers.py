"""Shared test helpers (imported by tests; fixtures live in conftest.py).

    lt = LoopThread()                    # an asyncio loop in a thread
    tree = Tree(lt)                      # real tiers on 127.0.0.1:0 in this process
    root = tree.add("root", "global")    # its address
    zone = tree.add("z", "zone", parent="root")
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ps.core.config import ServerConfig
from ps.server import create_server, shutdown

__all__ = ["FAST", "LoopThread", "Tree", "ServeProcess", "same_bits", "bsp_rounds", "spawn_worker", "step_worker",
           "json_lines", "small_mlp", "mlp_batches", "mlp_loss", "train_mlp"]

FAST = dict(heartbeat_s=0.1, member_timeout_s=1.0)


class LoopThread:
    """An asyncio loop in a background thread; ``run`` executes a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, timeout: float = 30):
        """Run ``fn()`` on the loop thread (safe access to a tier's state)."""
        async def _c():
            return fn()
        return self.run(_c(), timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class Tree:
    """An in-process tree: root, optional region, zones below it."""

    def __init__(self, lt: LoopThread) -> None:
        self.lt = lt
        self.servers: dict[str, tuple] = {}

    def add(self, name: str, role: str, parent: str = "", **kw) -> str:
        cfg = ServerConfig(role=role, name=name, parent=self.addr(parent) if parent else "",
                           **{**FAST, **kw})
        self.servers[name] = self.lt.run(create_server(cfg))
        return self.addr(name)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.servers[name][1]}"

    def tier(self, name: str):
        return self.servers[name][2]

    def view(self, name: str, job: str):
        """(epoch, version, checksum, values copy) of a tier's view, read on the loop."""
        def get():
            v = self.tier(name).jobs[job].view
            return v.epoch, v.version, v.checksum, v.values.copy()
        return self.lt.call(get)

    def stop(self, name: str) -> None:
        server, _, tier = self.servers.pop(name)
        self.lt.run(shutdown(server, tier, grace=0.5))

    def close(self) -> None:
        for name in reversed(list(self.servers)):
            self.stop(name)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def bsp_rounds(clients, steps: int, grad, report=None) -> None:
    """BSP with ParameterClients: each pushes ``grad(i, step)`` once per round (one thread per
    client: a round waits for all), then pulls the new version. ``report(step)``: telemetry."""
    errors = []

    def run(i, c):
        try:
            for s in range(steps):
                extra = {} if report is None else {"report": report(s)}
                v, _ = c.push(grad(i, s), clock=s, **extra)
                c.pull(min_version=v)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not errors, errors


def spawn_worker(reap, module: str, log: Path, *args: str) -> subprocess.Popen:
    """A worker script (``python -m module args``) in its own process: stdout piped (one JSON
    line per step), stderr to ``log``; ``reap`` (the fixture) stops it by PID after the test."""
    p = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                         stderr=open(log, "wb"), text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reap(p)
    return p


def step_worker(reap, address: str, wid: str, steps: int, sleep: float, log: Path) -> subprocess.Popen:
    """tests/integration/_worker.py: ``steps`` bsp steps at ``address`` as ``wid``, one JSON line
    per step (version, applied, ...), sleeping ``sleep`` seconds between steps."""
    return spawn_worker(reap, "tests.integration._worker", log, "--address", address, "--worker-id", wid,
                        "--steps", str(steps), "--sleep", str(sleep))


def json_lines(proc: subprocess.Popen, n: int, timeout: float, stamped: bool = False) -> list:
    """Up to ``n`` JSON lines from ``proc``'s stdout within ``timeout`` seconds (fewer if it
    ends); ``stamped``: each as (monotonic time it was read, line)."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append((time.monotonic(), json.loads(line)) if stamped else json.loads(line))
    return out


class ServeProcess:
    """One ``hps serve`` process, logging to ``log``, stopped (and killed) by its PID."""

    def __init__(self, log: Path, name: str, args: list[str]) -> None:
        self.name, self.log = name, log
        self.cmd = [sys.executable, "-m", "ps.tools.cli", "serve", *args]
        self.start(self.cmd + ["--listen", "127.0.0.1:0"])

    def start(self, cmd: list[str]) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = self.text()
            if "hps: serving" in text:
                self.address = text.split("hps: serving", 1)[1].split(" on ", 1)[1].split()[0]
                return
            assert self.proc.poll() is None, text
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not start")

    def text(self) -> str:
        """What this incarnation has logged."""
        return self.log.read_bytes()[self.offset:].decode(errors="replace")

    def restart(self, *args: str) -> None:
        self.start(self.cmd + ["--listen", self.address, *args])

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def status(self, timeout: float = 2.0):
        from ps.net.messages import status_from_pb
        from ps.net.rpc import Caller
        from ps.net.wire import pb

        with Caller(self.address) as rpc:
            return status_from_pb(rpc.call("Status", pb.StatusRequest(), timeout))


def small_mlp():
    """The equivalence tests' model: 12 -> 32 -> 3, seeded (torch's seed is global: build
    models before starting threads)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def mlp_batches(steps: int, batch: int):
    """(x, y): ``steps`` batches of ``batch`` samples for ``small_mlp``, seeded."""
    import torch

    g = torch.Generator().manual_seed(1)
    return (torch.randn(steps, batch, 12, generator=g), torch.randint(0, 3, (steps, batch), generator=g))


def mlp_loss(model, x, y):
    import torch

    return torch.nn.functional.cross_entropy(model(x), y)  # a mean, as DDP users write it


def train_mlp(zones: list[str], job, steps: int, workers: int, per_worker: int, data_steps: int = 0,
              **opt_kw) -> dict:
    """``workers`` HpsOptimizer threads on ``small_mlp``, worker i on zone i % len(zones) with
    slice i of every step's batch (``mlp_batches(data_steps or steps, ...)``); every step must
    be applied. ``opt_kw``: more HpsOptimizer options. Returns each worker's final parameters."""
    from worker import HpsOptimizer

    x, y = mlp_batches(data_steps or steps, workers * per_worker)
    results, errors = {}, []
    models = [small_mlp() for _ in range(workers)]  # torch's seed is global: not in the threads

    def run(i: int) -> None:
        try:
            model = models[i]
            with HpsOptimizer(model, zones[i % len(zones)], job, worker_id=f"{job.name}-w{i}", **opt_kw) as opt:
                for s in range(steps):
                    sl = slice(i * per_worker, (i + 1) * per_worker)
                    opt.zero_grad()
                    mlp_loss(model, x[s, sl], y[s, sl]).backward()
                    assert opt.step().applied
                results[i] = [p.detach().clone() for p in model.parameters()]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    assert len(results) == workers
    return results


def wait_for(fn, what: str, timeout: float = 10.0, pause_s: float = 0.05) -> None:
    """Poll ``fn()`` until true, for at most ``timeout`` seconds; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(pause_s)
