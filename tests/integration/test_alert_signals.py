"""What the alerts read, from real tiers: a worker that finishes (close, or a normal interpreter
exit) leaves and is not "lost"; one that goes silent is lost until it registers again
(issue 19: members lost must distinguish died from done)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (10,))])


def _job(tree, name: str = "z"):
    return tree.lt.call(lambda: tree.tier(name).status().jobs[0])


def _wait(cond, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_finished_worker_leaves_and_a_silent_one_is_lost_until_it_returns(tree):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    done = ParameterClient(zone, "j", "done")
    done.create_job(JobConfig(name="j", optimizer=OptimizerConfig(lr=0.1)), LAYOUT,
                    np.zeros(LAYOUT.numel, np.float32))
    done.register()
    dead = ParameterClient(zone, "j", "dead")
    dead.register()
    assert len(_job(tree).members) == 2

    done.close()
    done.close()  # idempotent (it also runs at exit)
    # The silent one: its heartbeat stops as a killed process's would (no goodbye).
    dead._hb_stop.set()
    assert _wait(lambda: len(_job(tree).members) == 0)
    job = _job(tree)
    assert [m.member for m in job.lost] == ["dead"] and job.lost[0].role == "worker"
    assert job.stats.members_left == 1 and job.stats.members_expired == 1

    back = ParameterClient(zone, "j", "dead")  # restarted under its id: no longer lost
    back.register()
    assert _job(tree).lost == ()
    back.close()
    dead._rpc.close()


def test_a_worker_that_exits_without_close_still_says_goodbye(tree):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    owner = ParameterClient(zone, "j", "owner")
    owner.create_job(JobConfig(name="j", optimizer=OptimizerConfig(lr=0.1)), LAYOUT,
                     np.zeros(LAYOUT.numel, np.float32))
    owner.register()
    script = ("import sys; from worker import ParameterClient; "
              "c = ParameterClient(sys.argv[1], 'j', 'script'); c.register(); c.pull()")
    r = subprocess.run([sys.executable, "-c", script, zone], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    job = _job(tree)
    assert job.stats.members_left == 1 and job.lost == () and len(job.members) == 1
    owner.close()
