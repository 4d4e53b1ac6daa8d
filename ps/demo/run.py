"""``hps demo``: a local cluster, 4 workers training a byte-level transformer, live progress,
a summary table and a loss plot; every process stopped by PID, also on Ctrl-C.

    hps demo --steps 150
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ps.demo.budget import StepBudget
from ps.demo.report import plot_loss
from ps.tools.format import human_bytes, summary_table
from ps.tools.launch import Cluster, load_topology
from ps.tools.status import fetch_status

__all__ = ["main", "read_events"]


def read_events(proc: subprocess.Popen, q: queue.Queue) -> None:
    """Queue each JSON line a worker process prints, then {"event": "exit"} when it ends."""
    for line in proc.stdout:
        try:
            q.put(json.loads(line))
        except json.JSONDecodeError:
            pass
    q.put({"event": "exit", "pid": proc.pid})


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=5)


def _declare(args, root: str, admin_token: str) -> str:
    """Declare the demo's job with the admin token; the job's token, for its workers."""
    from ps.demo.train import demo_job
    from ps.tools import jobctl

    job = demo_job("demo", args.mode, args.staleness, args.codec, args.topk, args.delta_codec, args.damping,
                   getattr(args, "inner_steps", 10))
    _, token = jobctl.create(root, job, admin_token)
    if not token:
        raise RuntimeError("the root handed out no token for the demo's job (it existed already?)")
    return token


def _keep_token(directory: Path, token: str) -> Path:
    """The job's token in a 0600 file beside the CA, for another worker to join with (HPS_TOKEN)."""
    path = directory / "demo.token"
    from ps.server.auth import write_secret

    write_secret(path, token + "\n")
    return path


def _without_admin(env) -> dict[str, str]:
    """The environment minus the admin's credentials: workers hold their job's token only."""
    return {k: v for k, v in env.items() if k not in ("HPS_ADMIN_TOKEN", "HPS_ADMIN_TOKEN_FILE")}


def main(args) -> int:
    if getattr(args, "damping", False) and args.mode == "bsp":
        print("hps demo: --damping applies to --mode ssp or async (bsp has no stale updates)", file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"hps demo: starting the local topology (logs in {logs})", flush=True)
    cluster = Cluster.start(load_topology(args.topology), logs, secure=not args.insecure)
    workers: list[subprocess.Popen] = []
    worker_env: dict[str, str] = {}
    try:
        if cluster.secrets is not None:
            # Secure by default: mutual TLS with a throw-away CA and tokens. This process is the
            # admin (it declares the job and reads every tier's status); the workers get a
            # client certificate and the job's token only.
            client = cluster.secrets.client_env()
            os.environ.update(client)
            worker_env = {k: v for k, v in client.items() if k.startswith("HPS_TLS_")}
            root_tier = next(t for t in cluster.tiers.values() if t.role == "global")
            worker_env["HPS_TOKEN"] = _declare(args, root_tier.address, cluster.secrets.admin_token())
            kept = _keep_token(cluster.secrets.directory, worker_env["HPS_TOKEN"])
            print(f"hps demo: mutual TLS and tokens (throw-away CA, admin token and the job's token "
                  f"{kept.name} in {cluster.secrets.directory})", flush=True)
        else:
            print("hps demo: INSECURE: plaintext, no client certificates, no tokens (--insecure)", flush=True)
        zones = [t for t in cluster.tiers.values() if t.role == "zone"] or list(cluster.tiers.values())[:1]
        root = next(t for t in cluster.tiers.values() if t.role == "global")
        for t in cluster.tiers.values():
            print(f"  {t.role:9s} {t.name:6s} {t.address}", flush=True)
        for t in cluster.links.values():  # emulated WAN links in front of a parent
            print(f"  link      {t.name:6s} {t.address} -> {t.parent}", flush=True)
        q: queue.Queue = queue.Queue()
        placement = {}
        # One pool of workers x steps steps: every mode trains on the same samples, and in
        # ssp/async the fast workers take the steps a slow one does not get to.
        total = args.workers * args.steps
        budget = StepBudget.create(str(out / "steps.budget"), total)
        for i in range(args.workers):
            zone = zones[i % len(zones)]
            wid = f"w{i}"
            placement[wid] = zone.name
            err = open(logs / f"{wid}.log", "wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "ps.demo.train", "--address", zone.address, "--worker-id", wid,
                 "--seed", str(i), "--steps", str(total), "--budget", budget.path,
                 "--budget-total", str(total), "--budget-parties", str(args.workers), "--batch", str(args.batch),
                 # Below the servers' priority: on one small machine four busy workers would
                 # starve the tiers, which in a deployment run on hosts of their own.
                 "--nice", "10", *(["--damping"] if args.damping else []),
                 "--mode", args.mode, "--staleness", str(args.staleness),
                 "--inner-steps", str(getattr(args, "inner_steps", 10)),
                 "--codec", args.codec, "--topk", str(args.topk), "--delta-codec", args.delta_codec,
                 "--slow", str(args.slow if i == args.workers - 1 else 1.0)],
                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                env={**_without_admin(os.environ), **worker_env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
            workers.append(proc)
            threading.Thread(target=read_events, args=(proc, q), daemon=True).start()
        mode = _mode_label(args) + (" damped" if args.damping else "")
        codec = (f"top-{args.topk:g} + error feedback (DGC: sgd, momentum corrected at the workers)"
                 if args.codec == "topk" else f"{args.codec} (adam)")
        if args.mode == "outer":
            codec = f"{args.codec} (adamw, inside each region; int8 pseudo-gradients and outer deltas across)"
        print(f"hps demo: {args.workers} workers, {mode}, {codec} pushes, training for {total} steps "
              f"({args.steps} per worker on average; {', '.join(f'{w}@{z}' for w, z in placement.items())})",
              flush=True)
        return _follow(args, out, cluster, root, workers, placement, q)
    except KeyboardInterrupt:
        print("\nhps demo: interrupted; stopping every process", flush=True)
        return 130
    finally:
        _stop(workers)
        cluster.stop()


def _follow(args, out, cluster, root, workers, placement, q) -> int:
    series: dict[str, list[tuple[int, float]]] = {w: [] for w in placement}
    step_s: dict[str, list[float]] = {w: [] for w in placement}
    ups: dict[str, list[int]] = {w: [] for w in placement}
    last: dict[str, dict] = {}
    done: dict[str, dict] = {}
    exited = 0
    t0 = time.monotonic()
    shown = -1
    taken = 0  # steps done by all workers together
    started: list[float] = []
    while exited < len(workers):
        ev = q.get(timeout=900)
        kind = ev.get("event")
        if kind == "exit":
            exited += 1
        elif kind == "step":
            series[ev["worker"]].append((ev["step"], ev["loss"]))
            step_s[ev["worker"]].append(ev["step_s"])
            ups[ev["worker"]].append(ev["bytes_up"])
            last[ev["worker"]] = ev
            taken += 1
            step = taken // len(placement) - 1  # in steps per worker
            if step >= 0 and (step // 10 > shown // 10 or step == args.steps - 1) and step != shown:
                shown = step
                recent = [pts[-1][1] for pts in series.values() if pts]
                loss = sum(recent) / len(recent)
                up = sum(e["bytes_up"] for e in last.values())
                down = sum(e["bytes_down"] for e in last.values())
                print(f"step {step + 1:4d}/{args.steps}  loss {loss:6.3f}  version {ev['version']:5d}  "
                      f"bytes/step up {human_bytes(up)} down {human_bytes(down)}  "
                      f"{(time.monotonic() - t0) / (step + 1):.2f} s/step", flush=True)
        elif kind == "start":
            started.append(ev["t"])
        elif kind == "done":
            done[ev["worker"]] = ev
    wall = time.monotonic() - t0
    # Ask every tier directly (once workers leave, relays leave their parents too), after the
    # relays have caught up with the root's last version.
    depth = {"global": 0, "regional": 1, "zone": 2}
    for _ in range(100):
        admin = cluster.secrets.admin_token() if cluster.secrets is not None else None
        tiers = [(depth[t.role], t.address, fetch_status(t.address, token=admin)) for t in cluster.tiers.values()]
        if all(len(g) <= 1 for g in _view_groups(tiers, {}, {}).values()):
            break
        time.sleep(0.05)
    # Training time: from all workers up (they start together) to the last one synced; the
    # same start-up (imports, job creation, first snapshot) is in ``wall`` for every mode.
    train = max(d["t"] for d in done.values()) - max(started) if done and started else float("nan")
    return _report(args, out, series, step_s, ups, done, placement, tiers, wall, train)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _report(args, out, series, step_s, ups, done, placement, tiers, wall, train) -> int:
    rows = []
    for w, zone in placement.items():
        pts = series[w]
        tail = [loss for _, loss in pts[-10:]]
        d = done.get(w, {})
        rows.append(dict(worker=w, zone=zone, steps=len(pts),
                         train_loss=sum(tail) / len(tail) if tail else float("nan"),
                         val_loss=d.get("val_loss") or float("nan"), version=d.get("version", 0),
                         lost_steps=d.get("lost_steps", 0),
                         # the first steps include start-up (imports, job creation, snapshot)
                         median_step_s=_median(step_s[w][3:] or step_s[w]),
                         # the second half of the run: past top-k's density warm-up
                         late_push_bytes_per_step=(sum(ups[w][len(ups[w]) // 2:]) /
                                                   max(1, len(ups[w]) - len(ups[w]) // 2))))
    print("\n" + summary_table(rows, ["worker", "zone", "steps", "train_loss", "val_loss", "version",
                                      "lost_steps", "median_step_s"]))
    trows = []
    for depth, _addr, st in tiers:
        for j in st.jobs:
            steps = max(1, j.version)
            s = j.stats
            trows.append(dict(tier=("  " * depth) + st.name, role=("global", "regional", "zone")[depth],
                              version=j.version, push_in_bytes=s.bytes_pushed_in,
                              push_up_bytes=s.bytes_pushed_up, pull_in_bytes=s.bytes_pulled_in,
                              pull_out_bytes=s.bytes_pulled_out,
                              push_in_per_step=human_bytes(s.bytes_pushed_in / steps),
                              push_up_per_step=human_bytes(s.bytes_pushed_up / steps),
                              pull_in_per_step=human_bytes(s.bytes_pulled_in / steps),
                              pull_out_per_step=human_bytes(s.bytes_pulled_out / steps),
                              checksum=f"{j.checksum:#018x}",
                              # ssp/async: root version minus the pushed gradients' base version
                              staleness_mean=s.staleness_sum / s.staleness_count if s.staleness_count else 0.0,
                              staleness_max=s.staleness_max))
    print("\n" + summary_table(trows, ["tier", "version", "push_in_per_step", "push_up_per_step",
                                       "pull_in_per_step", "pull_out_per_step", "checksum"]))
    # Every tier holds its source's view (the root's; in outer jobs its region's inner one, and
    # each region's outer view the root's); a worker that ended on that view's version holds it
    # too (in ssp/async workers stop at different versions: those are checked by the tests).
    groups = _view_groups(tiers, done, placement)
    agree = bool(groups) and all(len(g) == 1 for g in groups.values()) and len(done) == len(placement)
    per_worker = " ".join(f"{r['worker']}:{r['steps']}" for r in rows)
    what = ("each region's replicas agree with its regional master and the regions' outer views with the root"
            if args.mode == "outer" else "replicas agree with the root")
    print(f"\n{what} bit for bit: {'yes' if agree else 'NO'}; "
          f"{sum(r['steps'] for r in rows)} steps ({per_worker}) in {train:.1f}s of training, "
          f"{wall:.1f}s with start-up")
    mode = _mode_label(args)
    png = plot_loss(series, str(out / "loss.png"), f"hps demo: {len(placement)} workers, {mode}")
    (out / "summary.json").write_text(json.dumps(dict(workers=rows, tiers=trows, wall_s=wall, train_s=train,
                                                      replicas_agree=agree), indent=2))
    print(f"plot: {png}\nsummary: {out / 'summary.json'}")
    return 0 if agree and len(done) == len(placement) else 1


def _mode_label(args) -> str:
    if args.mode == "ssp":
        return f"ssp({args.staleness})"
    if args.mode == "outer":
        return f"outer (H={getattr(args, 'inner_steps', 10)}: bsp inside each region, outer steps at the root)"
    return args.mode


def _view_groups(tiers, done: dict, placement: dict) -> dict[str, set]:
    """The (version, checksum) pairs that must agree, by what they must agree with: the root's
    view (every tier, and the workers that ended on its version); in an outer job each region's
    inner view (its zones, its workers) and the outer view (the root, each region's)."""
    groups: dict[str, set] = {}
    region_of = {addr: addr for depth, addr, _ in tiers if depth == 1}
    zone_of: dict[str, str] = {}
    for depth, addr, st in tiers:
        if depth == 2:
            region_of[addr] = st.parent if st.parent in region_of else ""
            zone_of[st.name] = addr
    for depth, addr, st in tiers:
        for j in st.jobs:
            if j.mode == "outer" and depth > 0:
                group = f"region {region_of.get(addr, '')}"
                if j.inner_loop:
                    groups.setdefault("outer", set()).add((j.stats.outer_version, j.stats.outer_checksum))
            else:
                group = "root"
            groups.setdefault(group, set()).add((j.version, j.checksum))
    for w, d in done.items():
        group = f"region {region_of.get(zone_of.get(placement.get(w, ''), ''), '')}"
        if group not in groups:
            group = "root"
        held = groups.get(group, set())
        if len(held) == 1 and d.get("version") == next(iter(held))[0]:
            held.add((d["version"], d["checksum"]))
    if "outer" in groups:
        groups["outer"] |= groups.pop("root", set())
    return groups
