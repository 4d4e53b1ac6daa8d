"""What keeps a ``hps launch`` cluster serving: restart a tier that died, with backoff.

>>> import tempfile
>>> logdir = tempfile.mkdtemp()
>>> topology = {"root": {"name": "root", "zones": [{"name": "eu-a"}]}}
>>> with Cluster.start(topology, logdir=logdir) as cluster:
...     sup = Supervisor(cluster, RestartPolicy(first_s=0.1))
...     cluster.stop_tier("eu-a", signal.SIGKILL)           # a tier dies
...     while sup.poll() != {"root": "up", "eu-a": "up"}:   # noticed, restarted on its port
...         time.sleep(0.1)
...     read_state(logdir)["tiers"]["eu-a"]["restarts"]      # what `hps status --launch-dir` shows
1

A tier whose process exits while the cluster runs is logged (name, role, exit status or signal,
log file) and started again on the same port after a delay that doubles from
``RestartPolicy.first_s`` up to ``max_s``. One that died ``max_restarts`` times within
``window_s`` is given up on: it is reported (state ``failed``) and the rest keeps serving.
The root is restarted with the same ``--checkpoint-dir``, so it restores its jobs.

Every change is written to ``<logdir>/launch.json`` (replaced atomically), which
``hps status --launch-dir`` reads. Emulated WAN links are watched but not restarted (a new
relay would bind another port than the one its child dials): a dead link is ``failed``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass

from ps.tools.launch import Cluster, TierProcess
from ps.tools.status import STATE_FILE, read_state

__all__ = ["RestartPolicy", "Supervisor", "read_state", "describe_exit"]

log = logging.getLogger("hps.launch")


@dataclass(frozen=True)
class RestartPolicy:
    """Restart after ``first_s``, doubling per recent restart up to ``max_s``; give up on a tier
    restarted ``max_restarts`` times within ``window_s`` (0 restarts: report deaths only).
    A restarted process that prints no ready line within ``ready_timeout_s`` counts as a death."""

    first_s: float = 1.0
    max_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0
    ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not (0 < self.first_s <= self.max_s):
            raise ValueError(f"restart backoff must satisfy 0 < first ({self.first_s}s) <= max ({self.max_s}s)")
        if self.max_restarts < 0 or self.window_s <= 0 or self.ready_timeout_s <= 0:
            raise ValueError(f"max_restarts ({self.max_restarts}) must be >= 0, window "
                             f"({self.window_s}s) and ready timeout ({self.ready_timeout_s}s) positive")

    def delay(self, recent: int) -> float:
        return min(self.max_s, self.first_s * 2 ** recent)


def describe_exit(returncode: int | None) -> str:
    """'exit status 1', 'killed by signal 9 (SIGKILL)' or 'running'."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


@dataclass
class _Watch:
    state: str = "up"                  # up | restarting | starting | failed
    restarts: list[float] | None = None  # monotonic times of restarts within the window
    total: int = 0                     # restarts since launch
    due: float = 0.0                   # restarting: when; starting: ready deadline
    last_exit: str = ""
    last_exit_at: float = 0.0          # wall clock


class Supervisor:
    """Watches a started ``Cluster``; call ``poll()`` every fraction of a second."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy | None = None) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.started_at = time.time()
        self.watch = {n: _Watch(restarts=[]) for n in [*cluster.tiers, *cluster.links]}
        self.stopping = False
        self._write()

    @property
    def failed(self) -> list[str]:
        return [n for n, w in self.watch.items() if w.state == "failed"]

    def poll(self) -> dict[str, str]:
        """Notice deaths, start due restarts, check restarted tiers for readiness; returns each
        tier's (and link's) state."""
        now = time.monotonic()
        changed = False
        for name, w in self.watch.items():
            t = self._process(name)
            if w.state in ("up", "starting") and t.proc.poll() is not None:
                self._died(name, t, describe_exit(t.proc.returncode), now)
                changed = True
            elif w.state == "starting" and self.cluster.ready(name):
                w.state = "up"
                log.warning("tier %s (%s) serves again on %s (pid %d, restart %d)", name, t.role,
                            t.address, t.proc.pid, w.total,
                            extra={"event": "launch.tier_restarted", "tier_name": name})
                changed = True
            elif w.state == "starting" and now > w.due:
                Cluster._kill(t, signal.SIGKILL, 5.0)
                self._died(name, t, f"no ready line within {self.policy.ready_timeout_s:.0f}s", now)
                changed = True
            elif w.state == "restarting" and now >= w.due:
                self.cluster.respawn(name)
                w.state, w.due = "starting", now + self.policy.ready_timeout_s
                changed = True
        if changed:
            self._write()
        return {n: w.state for n, w in self.watch.items()}

    def _process(self, name: str) -> TierProcess:
        return self.cluster.tiers.get(name) or self.cluster.links[name]

    def _died(self, name: str, t: TierProcess, how: str, now: float) -> None:
        w = self.watch[name]
        w.last_exit, w.last_exit_at = how, time.time()
        w.restarts = [r for r in w.restarts or [] if now - r < self.policy.window_s]
        if t.role == "link" or len(w.restarts) >= self.policy.max_restarts:
            w.state = "failed"
            why = ("links are not restarted" if t.role == "link" else
                   f"{len(w.restarts)} restart(s) within {self.policy.window_s:.0f}s, the most allowed")
            log.error("tier %s (%s, pid %d) %s; giving up on it (%s); the rest keeps serving. Log: %s",
                      name, t.role, t.proc.pid, how, why, t.log,
                      extra={"event": "launch.tier_failed", "tier_name": name})
            return
        delay = self.policy.delay(len(w.restarts))
        w.restarts.append(now + delay)
        w.total += 1
        w.state, w.due = "restarting", now + delay
        log.warning("tier %s (%s, pid %d) %s; restarting it on %s in %.1fs (restart %d of %d within "
                    "%.0fs). Log: %s", name, t.role, t.proc.pid, how, t.address, delay, len(w.restarts),
                    self.policy.max_restarts, self.policy.window_s, t.log,
                    extra={"event": "launch.tier_died", "tier_name": name})

    def close(self) -> None:
        """The cluster was stopped on purpose: record it."""
        self.stopping = True
        self._write()

    def state(self) -> dict:
        p = self.policy
        tiers = {}
        for name, w in self.watch.items():
            t = self._process(name)
            tiers[name] = {"role": t.role, "address": t.address, "parent": t.parent, "pid": t.proc.pid,
                           "state": w.state,
                           "restarts": w.total, "last_exit": w.last_exit, "last_exit_at": w.last_exit_at,
                           "log": str(t.log)}
        return {"pid": os.getpid(), "started_at": self.started_at, "updated_at": time.time(),
                "stopped": self.stopping,
                "policy": {"first_s": p.first_s, "max_s": p.max_s, "max_restarts": p.max_restarts,
                           "window_s": p.window_s},
                "tiers": tiers}

    def _write(self) -> None:
        path = self.cluster.logdir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=1))
        os.replace(tmp, path)  # readers see the old or the new file, never half of one

