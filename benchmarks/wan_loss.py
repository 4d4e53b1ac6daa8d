"""Time to a target loss across regions: the flat deployment a user would pick (every worker on
the root, dense fp32, BSP) against the hierarchy (per-region aggregation, compressed, async or
ssp), both across the same emulated WAN, side by side in one run.

    python benchmarks/wan_loss.py --steps 100

The demo model (TinyLM, Adam 3e-3, 20 warm-up steps), 4 workers in two regions of two, each
region 100 ms round trip and 100 Mbit/s each way from the root (ps/tools/wanem.py links):
- flat: deploy/wan-flat.yaml; each region's two workers share their region's link to the root;
- hierarchy: deploy/wan.yaml; workers on their region's zones, the regional master the only
  thing crossing the WAN (flushing every 200 ms); one run per --modes (default bsp and async),
  push/relay/delta codec --codec (topk at --topk density, error feedback at every sender; in
  bsp with DGC's recipe, in async with Adam: see ``tree_job_for``).
Each flat worker runs --steps steps, each hierarchy worker --tree-steps (default twice as many:
they are cheaper, and what counts is the time to the target). Reports for each: wall time, loss curve
(mean over workers, smoothed over 10 steps) against time, time to the target loss (the loss
flat BSP ends at, plus 1%), final validation loss (and the hierarchy's train loss at flat's
step count: equal samples), and bytes crossing the WAN per step (both directions of every
region's link, as counted by the link emulators, per step per worker, in steady state: after
the first 20 steps, top-k's density warm-up; also reported over all steps after start-up, and
start-up itself: job creation and the first snapshots). Goals:
hierarchy >= 5x faster to the target, >= 400x fewer WAN bytes per step than flat dense fp32,
final loss within 1%. Writes benchmarks/results/wan_loss.json and wan_loss.png.

"WAN bytes per step" is the whole job's: every region's link, both directions, divided by the
steps one worker takes (earlier results labelled it "per worker"; it never was).

Outer jobs (issue 17; --outer, one run per variant H/F/codec): each regional master runs its
region's bsp inner loop (AdamW 3e-3, warm-up 20) and syncs a fragment's pseudo-gradient every
H/F inner steps (outer SGD, Nesterov 0.9, lr 0.7); the variant names the codecs across the WAN
(pseudo-gradients up, outer deltas down; inside a region everything is fp32) and whether the
region trains on while a sync is in flight (overlap) and whether the regions wait for each other
at a sync (async: the root applies each region's pseudo-gradient as it arrives; dn: with delayed
Nesterov, the outer momentum moving once per two updates; dyn: dynamic H, H being the fastest
region's and each region's scaled by its inner steps per second against the fastest's).
--slow-region F makes region us's two workers compute F times slower (each step sleeps F - 1
times its forward and backward), in every run, flat included (not the --peer rows). --seconds S
gives every worker a time budget instead (it stops after S seconds of training or --steps,
whichever comes first): with a slower region, the equal-time comparison. --peer adds
torchft's DiLoCo on the same model, data and links (benchmarks/_diloco_peer.py), or says why
it could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from _common import RESULTS, ROOT, loss_curve, met, plot, write

from ps.demo.run import read_events

WORKER = str(ROOT / "benchmarks" / "_wan_worker.py")
GOAL_SPEEDUP, GOAL_BYTES, GOAL_LOSS_PCT = 5.0, 400.0, 1.0
GOAL_OUTER_SPEEDUP, GOAL_OUTER_BYTES = 8.0, 1000.0  # issue 17's goals for outer jobs


STEADY_AFTER = 20  # steps: top-k's density warm-up (25% -> 1%) is over by then


def run(label: str, topo: dict, addresses: list[str] | None, job: dict, steps: int, batch: int, logdir: str,
        slowdown: list[float] | None = None, seconds: float = 0.0) -> dict:
    from ps.tools.launch import Cluster
    from ps.tools.status import fetch_status

    with Cluster.start(topo, logdir) as cluster:
        where = [cluster.address(a) for a in addresses]
        q: queue.Queue = queue.Queue()
        procs = []
        for i, addr in enumerate(where):
            err = open(os.path.join(logdir, f"w{i}.log"), "wb")
            p = subprocess.Popen([sys.executable, WORKER, "--address", addr, "--worker-id", f"w{i}", "--seed", str(i),
                                  "--steps", str(steps), "--batch", str(batch), "--job", json.dumps(job),
                                  "--slowdown", str(slowdown[i] if slowdown else 1.0), "--seconds", str(seconds)],
                                 stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                 # one run: a worker starting late joins a job its peers began
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                      "HPS_RUN_ID": f"wan-loss-{job['name']}"})
            procs.append(p)
            threading.Thread(target=read_events, args=(p, q), daemon=True).start()
        events, exited, started = [], 0, 0
        reached: dict[str, int] = {}  # worker -> steps done, to mark the end of the warm-up
        try:
            while exited < len(procs):
                ev = q.get(timeout=1200)
                if ev["event"] == "exit":
                    exited += 1
                    continue
                events.append(ev)
                if ev["event"] == "start":
                    started += 1
                    if started == len(procs):  # job created, every snapshot pulled: start-up over
                        for t in cluster.links.values():
                            os.kill(t.proc.pid, signal.SIGUSR1)
                elif ev["event"] == "step" and steps > STEADY_AFTER:
                    before = min(reached.values()) if len(reached) == len(procs) else 0
                    reached[ev["worker"]] = ev["step"] + 1
                    if before < STEADY_AFTER <= (min(reached.values()) if len(reached) == len(procs) else 0):
                        for t in cluster.links.values():  # every worker past the warm-up
                            os.kill(t.proc.pid, signal.SIGUSR1)
            tiers = {}
            for name, t in cluster.tiers.items():
                for j in fetch_status(t.address).jobs:
                    tiers[name] = dict(role=t.role, version=j.version, push_in=j.stats.bytes_pushed_in,
                                       push_up=j.stats.bytes_pushed_up, pull_in=j.stats.bytes_pulled_in,
                                       pull_out=j.stats.bytes_pulled_out)
                    if j.inner_loop:  # an outer job's region: its syncs with the root
                        s = j.stats
                        tiers[name].update(outer_syncs=s.outer_syncs, outer_sync_failures=s.outer_sync_failures,
                                           outer_sync_s_mean=s.outer_sync_seconds_sum / max(1, s.outer_syncs),
                                           inner_steps_per_sync=s.inner_steps_per_sync)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    # Stopped: each link has logged what crossed it.
    up = down = up0 = down0 = warm = 0
    for name in cluster.links:
        text = open(os.path.join(logdir, f"link-{name}.log")).read()
        marks = re.findall(r"(\d+) bytes up, (\d+) bytes down so far", text)
        if marks:
            up0, down0 = up0 + int(marks[0][0]), down0 + int(marks[0][1])
        if len(marks) > 1:
            warm += int(marks[1][0]) + int(marks[1][1])
        m = re.search(r"(\d+) bytes up, (\d+) bytes down$", text, re.M)
        if m:
            up, down = up + int(m.group(1)), down + int(m.group(2))
    done = [e for e in events if e["event"] == "done"]
    if len(done) != len(where):
        tail = "".join(open(os.path.join(logdir, f"w{i}.log")).read()[-1500:] for i in range(len(where)))
        raise RuntimeError(f"{label}: {len(done)} of {len(where)} workers finished:\n{tail}")
    t0, curve, smooth = loss_curve(events)
    wall = max(e["t"] for e in done) - t0
    # the steps a worker took, on average (each took ``steps`` unless a time budget stopped it)
    taken = sum(1 for e in events if e["event"] == "step") / len(where)
    return dict(label=label, job=job, wall_s=wall, curve=curve, smoothed=smooth, steps_per_worker=taken,
                final_train_loss=smooth[-1][1], val_loss=sum(e["val_loss"] for e in done) / len(done),
                val_loss_before_sync=sum(e["val_loss_before_sync"] for e in done) / len(done),
                train_eval_before_sync=sum(e["train_eval_before_sync"] for e in done) / len(done),
                root_version=max(e["version"] for e in done),
                wan_bytes=dict(up=up, down=down, start_up=up0 + down0, at_step=dict(
                    {"0": up0 + down0, str(STEADY_AFTER): warm} if warm else {"0": up0 + down0})),
                # per step, both directions: after the first STEADY_AFTER steps (top-k's density
                # warm-up), and over every step after start-up (job creation, first snapshots)
                wan_bytes_per_step=(up + down - warm) / (taken - STEADY_AFTER) if warm else
                (up + down - up0 - down0) / taken,
                wan_bytes_per_step_after_start_up=(up + down - up0 - down0) / taken,
                wan_bytes_per_step_with_start_up=(up + down) / taken, tiers=tiers)


def time_to(smoothed: list, target: float) -> float | None:
    return next((t for t, v in smoothed if v <= target), None)


def _codec_status(job: dict) -> str:
    from ps.core.config import JobConfig

    try:
        from ps.core.config import OptimizerConfig

        JobConfig(**{**job, "optimizer": OptimizerConfig(**job.get("optimizer", {}))})
    except Exception as exc:  # a field or codec this build does not have yet
        return f"not built yet: {exc}"
    return ""


def tree_job_for(mode: str, args) -> dict:
    """The hierarchy's job in ``mode``. With top-k: in bsp, Deep Gradient Compression's recipe
    (as the demo runs top-k, ps/demo/train.py: SGD 0.1 with momentum 0.9 kept and sparsified
    at the workers, density warm-up over 20 steps; Adam under top-1% measured ~30% worse); in
    ssp/async, Adam 3e-3: the DGC recipe diverged there (measured: loss 5.8-7.6 after 40 steps
    with 100 ms of WAN staleness, lr 0.1 and 0.05 alike)."""
    job = dict(name=f"tree-{mode}", mode=mode, staleness=args.staleness if mode == "ssp" else 0,
               push_codec=args.codec, relay_codec=args.codec, delta_codec=args.delta_codec or args.codec)
    if args.codec == "topk":
        job["topk"] = args.topk
        if mode == "bsp":
            job.update(topk_warmup_steps=20, momentum_correction=True,
                       optimizer=dict(kind="sgd", lr=0.1, momentum=0.9, warmup_steps=20))
    job.update(json.loads(args.job_extra))
    return job


REGIONS = ("eu", "us", "ap", "sa")


def outer_job(h: int, f: int, codec: str, down: str, overlap: bool, args, asynchronous: bool = False,
              nesterov_delay: int = 0, dynamic: bool = False) -> dict:
    """An outer job: lossless pushes and deltas inside each region (LAN); across the WAN ``codec``
    pseudo-gradients up and ``down`` outer deltas down, each with error feedback. The regions
    start together (min_workers): a region whose workers start first would otherwise sync
    alone until the other's arrive."""
    return dict(name=f"outer-h{h}-f{f}-{codec}-{down}" + ("-overlap" if overlap else "")
                + ("-async" if asynchronous else "") + (f"-dn{nesterov_delay}" if nesterov_delay else "")
                + ("-dyn" if dynamic else ""), mode="outer",
                push_codec="fp32", relay_codec="fp32", delta_codec="fp32", topk=args.topk, min_workers=4,
                optimizer=dict(kind="adamw", lr=3e-3, warmup_steps=20),
                outer=dict(inner_steps=h, fragments=f, codec=codec, delta_codec=down, overlap=overlap,
                           asynchronous=asynchronous, nesterov_delay=nesterov_delay, dynamic_steps=dynamic))


def compare(flat: dict, tree: dict, target: float, goal_speedup: float = GOAL_SPEEDUP,
            goal_bytes: float = GOAL_BYTES) -> dict:
    tree["time_to_target_s"] = tt = time_to(tree["smoothed"], target)
    ft = flat["time_to_target_s"]
    cmp = dict(speedup_to_target=(ft / tt) if (tt and ft) else None,
               wall_speedup=flat["wall_s"] / tree["wall_s"],
               wan_bytes_reduction=flat["wan_bytes_per_step"] / max(tree["wan_bytes_per_step"], 1),
               final_val_loss_diff_pct=100 * (tree["val_loss"] - flat["val_loss"]) / flat["val_loss"],
               final_train_loss_diff_pct=100 * (tree["final_train_loss"] - flat["final_train_loss"])
               / flat["final_train_loss"])
    cmp["goals"] = dict(speedup_to_target=goal_speedup, wan_bytes_reduction=goal_bytes)
    cmp["meets"] = dict(speedup=bool(cmp["speedup_to_target"]) and cmp["speedup_to_target"] >= goal_speedup,
                        bytes=cmp["wan_bytes_reduction"] >= goal_bytes,
                        loss=cmp["final_val_loss_diff_pct"] <= GOAL_LOSS_PCT)
    sp = cmp["speedup_to_target"]
    print(f"\n{tree['label']}")
    print(f"  time to target: flat {ft or float('nan'):.1f}s, hierarchy "
          f"{tt if tt is not None else float('nan'):.1f}s -> {(f'{sp:.2f}x' if sp else 'not reached')} "
          f"(goal >= {goal_speedup}x: {met(sp or 0, goal_speedup)})")
    print(f"  WAN bytes per step (all workers): flat {flat['wan_bytes_per_step'] / 1e6:.3f} MB, hierarchy "
          f"{tree['wan_bytes_per_step'] / 1e3:.2f} kB -> {cmp['wan_bytes_reduction']:.0f}x fewer "
          f"(goal >= {goal_bytes:.0f}x: {met(cmp['wan_bytes_reduction'], goal_bytes)})")
    print(f"  final val loss: flat {flat['val_loss']:.4f}, hierarchy {tree['val_loss']:.4f} "
          f"({cmp['final_val_loss_diff_pct']:+.2f}%; goal within {GOAL_LOSS_PCT}%: "
          f"{met(-cmp['final_val_loss_diff_pct'], -GOAL_LOSS_PCT)})")
    return cmp


def main() -> int:
    from ps.tools.launch import load_topology

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps per worker, flat")
    p.add_argument("--tree-steps", type=int, default=0,
                   help="steps per worker, hierarchy (default 2x --steps: its steps are cheaper, and it "
                        "trains until the target or this budget)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--modes", default="bsp,async", help="the hierarchy's consistency: one run per mode")
    p.add_argument("--staleness", type=int, default=4, help="s for ssp")
    p.add_argument("--codec", default="topk", help="the hierarchy's push, relay and delta codec")
    p.add_argument("--delta-codec", default="", help="the root's published deltas ('': --codec)")
    # 0.5%: at 1% the steady state measured 66 kB per step (2 regions x (push + delta), ~16 kB
    # each), ~220x fewer than flat; DGC itself goes down to 0.1%.
    p.add_argument("--topk", type=float, default=0.005, help="top-k density of the hierarchy's codec")
    p.add_argument("--job-extra", default="{}", help="more JobConfig fields for the hierarchy, as JSON")
    p.add_argument("--region-flush-ms", type=float, default=0, help="override deploy/wan.yaml's (0: keep)")
    p.add_argument("--latency-ms", type=float, default=100.0, help="each region's link: round trip")
    p.add_argument("--bandwidth-mbit", type=float, default=100.0, help="each region's link: each way")
    p.add_argument("--only-hierarchy", action="store_true", help="skip the flat run (needs --target-loss)")
    p.add_argument("--target-loss", type=float, default=0.0, help="instead of flat BSP's final + 1%%")
    p.add_argument("--outer", default="10/1/int8/int8,50/1/int8/int8,10/4/int8/int8,50/1/topk/int8,"
                   "50/1/sign/sign,10/1/int8/int8/overlap,50/4/int8/int8/overlap",
                   help="outer-job variants H/F/pseudo-gradient codec/outer delta codec[/overlap][/async][/dn][/dyn] "
                   "(dn: delayed Nesterov over the --regions; dyn: dynamic H, each region's by its speed), "
                   "comma-separated ('': none)")
    p.add_argument("--peer", default="10,50", help="torchft DiLoCo runs at these H ('': none)")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="a time budget: every worker stops after this many seconds of training (0: --steps)")
    p.add_argument("--slow-region", type=float, default=1.0,
                   help="region us's workers compute this many times slower (every run, flat included)")
    p.add_argument("--regions", type=int, default=2, choices=(2, 4),
                   help="2: deploy/wan.yaml (2 regions x 2 zones, a worker each); 4: four regions of one zone "
                   "and one worker each (the same 4 workers), region us the slow one")
    p.add_argument("--out")
    p.add_argument("--replot", metavar="RESULT.json", help="only draw a saved result's plots again")
    args = p.parse_args()
    if args.replot:
        return replot(args.replot)

    tree_steps = args.tree_steps or 2 * args.steps
    link = {"latency_ms": args.latency_ms, "bandwidth_mbit": args.bandwidth_mbit}
    flat_topo = load_topology(str(ROOT / "deploy" / "wan-flat.yaml"))
    for ln in flat_topo["links"]:
        ln.update(link)
    tree_topo = load_topology(str(ROOT / "deploy" / "wan.yaml"))
    for reg in tree_topo["regions"]:
        reg.update(link)
        if args.region_flush_ms:
            reg["flush_ms"] = args.region_flush_ms
    flat_job = dict(name="flat", mode="bsp")
    slow = [1.0, 1.0, args.slow_region, args.slow_region]  # workers 2 and 3: region us (flat: us-wan)
    flat_at, tree_at = ["eu-wan", "eu-wan", "us-wan", "us-wan"], ["eu-a", "eu-b", "us-a", "us-b"]
    if args.regions != 2:  # the same 4 workers, one per region, each region one zone
        names = REGIONS[:args.regions]
        eu = tree_topo["regions"][0]
        tree_topo["regions"] = [dict(eu, name=r, zones=[dict(eu["zones"][0], name=f"{r}-a")]) for r in names]
        flat_topo["links"] = [dict(flat_topo["links"][0], name=f"{r}-wan") for r in names]
        flat_at, tree_at = [f"{r}-wan" for r in names], [f"{r}-a" for r in names]
        slow = [args.slow_region if r == "us" else 1.0 for r in names]
    trees: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only_hierarchy:
            flat = dict(label="flat (skipped)", final_train_loss=args.target_loss, smoothed=[], wall_s=float("nan"),
                        val_loss=float("nan"), wan_bytes_per_step=float("nan"))
        else:
            os.makedirs(f"{tmp}/flat")
            flat = run("flat: 4 workers on the root, dense fp32, bsp, adam", flat_topo,
                       flat_at, flat_job, args.steps, args.batch, f"{tmp}/flat", slow, args.seconds)
        print(f"flat      wall {flat['wall_s']:7.1f}s  final loss {flat['final_train_loss']:.4f}  "
              f"val {flat['val_loss']:.4f}  WAN {flat['wan_bytes_per_step'] / 1e6:.3f} MB/step", flush=True)
        for mode in filter(None, args.modes.split(",")):
            job = tree_job_for(mode, args)
            missing = _codec_status(job)
            if missing:
                trees[mode] = dict(status=missing, job=job)
                print(f"hierarchy {mode}: {missing}")
                continue
            os.makedirs(f"{tmp}/tree-{mode}")
            opt = job.get("optimizer", {}).get("kind", "adam")
            label = f"hierarchy: per-region aggregation, {args.codec}, {mode}, {opt}"
            tree = trees[mode] = run(label, tree_topo, tree_at, job, tree_steps,
                                     args.batch, f"{tmp}/tree-{mode}", slow, args.seconds)
            tree["loss_at_flat_steps"] = tree["smoothed"][min(args.steps, tree_steps, len(tree["smoothed"])) - 1][1]
            print(f"hierarchy {mode:5s} wall {tree['wall_s']:7.1f}s  final loss {tree['final_train_loss']:.4f} "
                  f"(at step {min(args.steps, tree_steps)}: {tree['loss_at_flat_steps']:.4f})  "
                  f"val {tree['val_loss']:.4f}  WAN {tree['wan_bytes_per_step'] / 1e6:.4f} MB/step", flush=True)

        for variant in filter(None, args.outer.split(",")):
            h, f, codec, down, *rest = variant.split("/")
            overlap, asynchronous = "overlap" in rest, "async" in rest
            dn = args.regions if "dn" in rest else 0  # delayed Nesterov over the regions
            dyn = "dyn" in rest
            job = outer_job(int(h), int(f), codec, down, overlap, args, asynchronous, dn, dyn)
            os.makedirs(f"{tmp}/{job['name']}")
            label = (f"outer: H={h}, F={f}, {codec} pseudo-gradients, {down} outer deltas, "
                     f"{'overlap' if overlap else 'no overlap'}" + (", asynchronous" if asynchronous else "")
                     + (", delayed Nesterov" if dn else "") + (", dynamic H" if dyn else ""))
            tree = trees[job["name"]] = run(label, tree_topo, tree_at, job, tree_steps,
                                            args.batch, f"{tmp}/{job['name']}", slow, args.seconds)
            tree["loss_at_flat_steps"] = tree["smoothed"][min(args.steps, tree_steps, len(tree["smoothed"])) - 1][1]
            print(f"{job['name']:18s} wall {tree['wall_s']:7.1f}s  final loss {tree['final_train_loss']:.4f}  "
                  f"val {tree['val_loss']:.4f}  WAN {tree['wan_bytes_per_step'] / 1e3:.2f} kB/step", flush=True)
        for h in filter(None, args.peer.split(",")):
            from _diloco_peer import run_diloco

            os.makedirs(f"{tmp}/diloco-{h}")
            peer = run_diloco(int(h), tree_steps, args.batch, args.latency_ms, args.bandwidth_mbit,
                              f"{tmp}/diloco-{h}")
            trees[f"torchft-diloco-h{h}"] = peer
            print(f"torchft DiLoCo H={h}: " + (peer["status"] if peer.get("status") else
                  f"wall {peer['wall_s']:.1f}s  final loss {peer['final_train_loss']:.4f}  val {peer['val_loss']:.4f}  "
                  f"WAN {peer['wan_bytes_per_step'] / 1e3:.2f} kB/step"), flush=True)

    target = args.target_loss or flat["final_train_loss"] * (1 + GOAL_LOSS_PCT / 100)
    flat["time_to_target_s"] = time_to(flat["smoothed"], target)
    print(f"\ntarget loss {target:.4f} (flat BSP's final smoothed train loss + 1%)")
    outer_goals = (GOAL_OUTER_SPEEDUP, GOAL_OUTER_BYTES)
    comparisons = {m: compare(flat, t, target, *(outer_goals if m.startswith(("outer", "torchft"))
                                                 else (GOAL_SPEEDUP, GOAL_BYTES)))
                   for m, t in trees.items() if t.get("smoothed")}
    write("wan_loss", dict(
        settings=dict(steps=args.steps, tree_steps=tree_steps, batch=args.batch, workers=4, regions=args.regions,
                      link=link,
                      link_latency_means="round trip", model="TinyLM 470,528 params (1.88 MB fp32)",
                      flat_job=dict(flat_job, optimizer="adam 3e-3, warm-up 20"),
                      region_flush_ms=args.region_flush_ms or "deploy/wan.yaml (200)",
                      slow_region=dict(region="us", factor=args.slow_region), seconds=args.seconds),
        goals=dict(speedup_to_target=GOAL_SPEEDUP, wan_bytes_reduction=GOAL_BYTES, final_loss_within_pct=GOAL_LOSS_PCT),
        target_loss=target, target_loss_means="flat BSP's final smoothed train loss + 1%",
        flat=flat, hierarchies=trees, comparisons=comparisons), args.out)

    draw_all(dict(flat=flat, hierarchies=trees, target_loss=target, settings=dict(link=link, regions=args.regions)),
             # beside the JSON (both relative to the working directory)
             RESULTS / "wan_loss.png" if not args.out else Path(args.out).with_suffix(".png"))
    return 0


def draw_all(result: dict, png: Path) -> None:
    """Loss against wall time (``png``) and against WAN bytes (``*_bytes.png``) for every row of a
    result. The bytes axis is the row's steady WAN rate times its steps (start-up excluded): the
    links count bytes, not steps, so it is the measured rate spread evenly, not a per-step trace."""
    rows = [r for r in (result["flat"], *result["hierarchies"].values()) if r.get("smoothed")]
    target, link = result["target_loss"], result["settings"]["link"]
    regions = result["settings"].get("regions", 2)
    title = (f"{regions} regions x {4 // regions} workers, {link['latency_ms']:g} ms RTT / "
             f"{link['bandwidth_mbit']:g} Mbit/s to the root")

    def draw(ax, bytes_axis: bool):
        for r in rows:
            xs = ([(i + 1) * r["wan_bytes_per_step"] / 1e6 for i in range(len(r["smoothed"]))] if bytes_axis
                  else [t for t, _ in r["smoothed"]])
            ax.plot(xs, [v for _, v in r["smoothed"]], label=r["label"])
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
        if bytes_axis:
            ax.set_xscale("log")
            ax.set_xlabel("MB across the WAN (steady rate x steps, every link, both directions)")
        else:
            ax.set_xlabel("seconds")
        ax.set_ylabel("train loss (mean of workers, 10-step average)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)

    plot(png, lambda ax: draw(ax, False))
    plot(png.with_name(png.stem + "_bytes.png"), lambda ax: draw(ax, True))


def replot(path: str) -> int:
    """Draw a saved result's plots again (``--replot results/wan_loss.json``)."""
    result = json.loads((ROOT / path).read_text())
    draw_all(result, (ROOT / path).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
