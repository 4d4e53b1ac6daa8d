"""Chaos: kill -9 each kind of tier again and again during a BSP training run, and check that
no acknowledged version is lost and no gradient is applied twice.

    python benchmarks/chaos.py                       # 3 faults of each kind, 3 fault-free seeds, 800 versions
    python benchmarks/chaos.py --quick               # 1 fault of each kind, fewer versions
    python benchmarks/chaos.py --faults-per-kind 5 --kinds root,worker
    python benchmarks/chaos.py --failover            # a standby root and alternate parents (issue 15)

The cluster is the default topology's shape (root, regions eu and us, two zones each; the root
with a checkpoint directory, so its write-ahead log carries it across kill -9) with four
worker processes, one per zone, training a small MLP on synthetic data in BSP until the job
reaches --versions (benchmarks/_chaos_worker.py: deterministic given the seed; a restarted
worker resumes on the server's parameters). Faults, in turn: a zone, a regional master, the
root, a worker, --faults-per-kind times each; each is SIGKILL by PID and a restart on the same
port (a worker: a new process with the same worker id). Faults are spread over the run; the
next one waits until the previous one has recovered and --gap versions more were made.

Per fault kind:
  * recovery: seconds from the kill until the job's version advances again (a worker is
    acknowledged a version above the highest acknowledged before the kill); until every worker
    the fault cut off (below the killed zone or regional master; all of them for the root; the
    killed worker's new process) is acknowledged such a version ("its workers back": through
    the restarted tier, or with --failover an alternate parent or the standby); and until the
    killed tier is synced and serving (zone/region/root: holds the job at the version the root
    had when killed, with all its children registered again; worker: its new process's first
    acknowledged push);
  * lost steps: distinct (worker, version computed on) gradients that were never applied
    (refused as not applied, or in flight in a killed worker and absent from the root's log),
    and contributions missing from versions made with fewer than four gradients;
  * acknowledged versions lost: after every root restart, how far the restored version is
    below the highest version any worker was acknowledged before the kill; and every
    acknowledgement is checked against the root's write-ahead log (the worker push it names
    must be in the version it names);
  * applied twice: worker pushes that two versions applied (the root's log: every version's
    push keys, archived as the run goes by hard links to every log segment, so checkpoints'
    clean-ups do not hide them; and the root's own counter, hps_double_applied_pushes_total,
    read before every root kill and at the end, plus its log's critical lines), and versions
    written twice to the log.
With --failover (issue 15) the root has a hot standby (root-b) and every zone lists the other
region's master as its alternate parent (eu-a: --parent eu,us). A regional master or the
primary root is then killed and left dead until the job advances again (the zones move to
their alternate, the standby takes over); only then is it started again (the old primary
rejoins as the new one's standby; a restarted regional master serves, its zones stay where they
went). A root fault kills whichever root is the primary at that moment. Both roots' logs are
archived; a version both hold counts once when its contents agree, and twice (a fork) when not.
"synced and serving" is then, for the root, the restarted one in sync as the standby; for a
regional master, the restarted one serving.

The faulted run's final held-out loss is compared with fault-free runs of other seeds (the
claim: within their spread) and with the fault-free run of its own seed.

Exit status 1 if an acknowledged version was lost, a gradient or version applied twice, a
fault did not recover (the job wedged), or the tiers and workers do not all hold the same
version and checksum once training has ended; 0 otherwise. Figures go to
benchmarks/results/chaos.json; logs of every process stay under a temporary directory
(--keep-logs DIR to keep them).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import xxhash
from _common import ROOT, write

from ps.core.errors import HpsError
from ps.core.exactly_once import decode_keys
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status, print_tree

WORKER = ROOT / "benchmarks" / "_chaos_worker.py"
ZONES = ["eu-a", "eu-b", "us-a", "us-b"]          # worker i trains through zone ZONES[i]
REGIONS = ["eu", "us"]
KINDS = ("zone", "region", "root", "worker")
TARGETS = {"zone": ["eu-a", "us-b", "eu-b", "us-a"], "region": ["eu", "us"], "root": ["root"],
           "worker": ["w1", "w2", "w3", "w0"]}
CHILDREN = {"zone": 1, "region": 2, "root": 2}      # members a restarted tier must have back
# Fast failure detection, as the fault tests use: a dead member leaves the round after 2 s.
SETTINGS = {"heartbeat_s": 0.2, "member_timeout_s": 2.0}
CHECKPOINT_EVERY = 25   # root kills land between checkpoints: a restore replays the log
RESTORED = re.compile(r"restored job (\S+): checkpoint version (\d+) \+ (\d+) replayed from the write-ahead "
                      r"log = version (\d+), checksum (0x[0-9a-f]+)")
PROMOTED = re.compile(r"promoted to primary with term (\d+): .*; 1 job\(s\) at versions \{'[^']+': (\d+)\}")
DOUBLE_LINE = "applied already"  # the root's critical line for a double application


def topology(ckpt: Path, failover: bool = False) -> dict:
    root: dict = {"name": "root", "port": 0, "checkpoint_dir": str(ckpt)}
    if failover:
        root["standby"] = {"name": "root-b", "checkpoint_dir": str(ckpt.parent / "ckpt-b")}

    def zone(z: str) -> dict:  # with --failover: the other region's master as the alternate parent
        return {"name": z, "alternates": [r for r in REGIONS if not z.startswith(r)]} if failover else {"name": z}
    return {"host": "127.0.0.1", "settings": SETTINGS, "root": root,
            "regions": [{"name": r, "zones": [zone(z) for z in ZONES if z.startswith(r)]} for r in REGIONS]}


def roots(cluster: Cluster) -> list[str]:
    return [n for n in ("root", "root-b") if n in cluster.tiers]


def primary(cluster: Cluster) -> str:
    """The root that is the primary now (the first that says so; "root" if none answers)."""
    for name in roots(cluster):
        st = _status(cluster.address(name))
        if st is not None and st.root_state == "primary":
            return name
    return "root"


# -- the root's write-ahead log, kept whole --------------------------------------------------
class WalArchive:
    """Hard-links every segment of the root's log as soon as it appears, so the records a
    checkpoint's clean-up deletes stay readable (a link shares the file: appends and recovery's
    cuts show through it)."""

    def __init__(self, ckpt: Path, into: Path, every_s: float = 0.05) -> None:
        self.ckpt, self.into, self.every_s = ckpt, into, every_s
        self.into.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._seen: set[tuple[int, int]] = set()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="wal-archive")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sweep()

    def sweep(self) -> None:
        for seg in self.ckpt.glob("*/wal-*.log"):
            try:
                st = seg.stat()
                if (st.st_dev, st.st_ino) in self._seen:
                    continue
                os.link(seg, self.into / f"{seg.parent.name}.{seg.name}.{st.st_ino}")
                self._seen.add((st.st_dev, st.st_ino))
            except FileNotFoundError:  # dropped between the listing and the link
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sweep()

    def records(self) -> list[dict]:
        """Every valid record of every archived segment (parsed here, not by ps.tiers.wal)."""
        head = struct.Struct("<4sQQQdIQ")
        out = []
        for path in sorted(self.into.iterdir()):
            data, pos = path.read_bytes(), 0
            while pos + head.size + 8 <= len(data):
                magic, version, contributors, _, scale, klen, plen = head.unpack_from(data, pos)
                (crc,) = struct.unpack_from("<Q", data, pos + head.size)
                body = pos + head.size + 8
                if magic != b"HPS2" or body + klen + plen > len(data):
                    break
                h = xxhash.xxh3_64(data[pos:pos + head.size])
                h.update(data[body:body + klen + plen])
                if h.intdigest() != crc:
                    break
                keys = decode_keys(data[body:body + klen])
                out.append(dict(version=version, contributors=contributors, scale=scale, segment=path.name,
                                keys=[(k.member, k.incarnation, k.seq) for k in keys],
                                payload=xxhash.xxh3_64_hexdigest(data[body + klen:body + klen + plen])))
                pos = body + klen + plen
        return out


# -- workers ---------------------------------------------------------------------------------
class Workers:
    """The four worker processes, their JSON events (one shared list), stopped by PID."""

    def __init__(self, cluster: Cluster, logdir: Path, seed: int, versions: int) -> None:
        self.cluster, self.logdir, self.seed, self.versions = cluster, logdir, seed, versions
        self.procs: dict[str, subprocess.Popen] = {}
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def start(self, i: int, wait_go: bool = False) -> subprocess.Popen:
        wid = f"w{i}"
        with open(self.logdir / f"{wid}.log", "ab") as err:
            p = subprocess.Popen(
                [sys.executable, str(WORKER), "--address", self.cluster.address(ZONES[i]), "--worker-id", wid,
                 "--index", str(i), "--seed", str(self.seed), "--versions", str(self.versions)]
                + (["--wait-go"] if wait_go else []),
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE if wait_go else subprocess.DEVNULL,
                text=True, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HPS_RUN_ID": "chaos"},
                # Below the tiers, as in modes.py: on 2 shared cores the workers otherwise starve
                # the seven servers, which in a deployment have hosts of their own.
                preexec_fn=lambda: os.nice(10))
        self.procs[wid] = p
        t = threading.Thread(target=self._read, args=(p,), daemon=True)
        t.start()
        self._readers.append(t)
        return p

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(e)

    def go(self, timeout_s: float = 120.0) -> None:
        """Once every worker started with ``wait_go`` holds the job, let them all train."""
        deadline = time.monotonic() + timeout_s
        while sum(e["event"] == "start" for e in self.snapshot()) < len(self.procs):
            if time.monotonic() > deadline or not all(p.poll() is None for p in self.procs.values()):
                raise RuntimeError(f"the workers did not all start (logs: {self.logdir})")
            time.sleep(0.05)
        for p in self.procs.values():
            p.stdin.write("go\n")
            p.stdin.close()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def kill(self, wid: str) -> None:
        p = self.procs[wid]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.running()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for t in self._readers:
            t.join(timeout=5)


def acked_max(events: list[dict]) -> int:
    return max((e["version"] for e in events if e["event"] == "ack"), default=0)


def _status(address: str):
    try:
        return fetch_status(address, timeout_s=2.0)
    except HpsError:
        return None


def _job(st):
    return st.jobs[0] if st is not None and st.jobs else None


# -- one fault -------------------------------------------------------------------------------
def inject(cluster: Cluster, workers: Workers, kind: str, target: str, timeout_s: float,
           failover: bool = False) -> dict:
    """SIGKILL ``target``, start it again, and time its recovery. ``failover``: a regional master
    or root stays dead until the job advances without it (alternate parents, the standby)."""
    if kind == "root":
        target = primary(cluster)
    late = failover and kind in ("root", "region")  # restarted once the job advanced without it
    root_addr = cluster.address(primary(cluster))
    job_before = _job(_status(root_addr))
    row = dict(kind=kind, target=target, root_version_at_kill=job_before.version if job_before else None,
               root_double_applied_before_kill=job_before.stats.double_applied if job_before else None)
    v_before = acked_max(workers.snapshot())
    t_kill = time.time()
    if kind == "worker":
        old_inc = {e["inc"] for e in workers.snapshot() if e["worker"] == target}
        workers.kill(target)
    else:
        log_offset = cluster.tiers[target].log.stat().st_size
        cluster.stop_tier(target, signal.SIGKILL)
    if kind == "root":
        # The root is dead: every acknowledgement a worker holds came from it (the workers'
        # pipes get a moment to deliver the last lines).
        time.sleep(0.3)
        v_before = max(v_before, acked_max(workers.snapshot()))
    row.update(t_kill=t_kill, acked_max_before_kill=v_before)
    if kind == "worker":
        workers.start(int(target[1:]))
    elif late and kind == "root":  # the standby takes over: what it held when it did
        other = next(n for n in roots(cluster) if n != target)
        offset = cluster.tiers[other].log.stat().st_size
        deadline = time.time() + timeout_s
        m = None
        while m is None and time.time() < deadline:
            m = PROMOTED.search(cluster.tiers[other].log.read_bytes()[offset:].decode(errors="replace"))
            time.sleep(0.05)
        row["promoted"] = other
        row["takeover_s"] = time.time() - t_kill if m else None
        row["restored_version"] = int(m.group(2)) if m else None
        row["acked_versions_lost"] = max(0, v_before - (row["restored_version"] or 0))
    elif not late:
        cluster.restart(target)
        row["ready_s"] = time.time() - t_kill
        if kind == "root":
            text = cluster.tiers["root"].log.read_bytes()[log_offset:].decode(errors="replace")
            m = RESTORED.search(text)
            row["restored_version"] = int(m.group(4)) if m else None
            row["restored_from_checkpoint"] = int(m.group(2)) if m else None
            row["replayed"] = int(m.group(3)) if m else None
            row["acked_versions_lost"] = max(0, v_before - (row["restored_version"] or 0))
    # The job advances again with the first version made wholly after the kill: above the
    # restored version after a root restart; otherwise two above the root's version at the
    # kill (the round open then may still close with pushes already past the killed tier).
    row["advance_to"] = ((row["restored_version"] or 0) + 1 if kind == "root" and not late
                         else (row["root_version_at_kill"] or v_before) + 2)
    # The workers the fault cut off (below the killed tier): when each is acknowledged a version
    # made after the kill again -- through a restarted tier, or an alternate parent.
    below = ([f"w{i}" for i, z in enumerate(ZONES) if z == target or (kind == "region" and z.startswith(target))]
             if kind in ("zone", "region") else [target] if kind == "worker" else [f"w{i}" for i in range(len(ZONES))])
    synced = advanced = back = None
    deadline = time.time() + timeout_s
    while time.time() < deadline and (synced is None or advanced is None or back is None):
        events = workers.snapshot()
        if advanced is None:
            later = [e["t"] for e in events if e["event"] == "ack" and e["version"] >= row["advance_to"]]
            if later:
                advanced = min(later) - t_kill
        if back is None:
            firsts = [min((e["t"] for e in events if e["event"] == "ack" and e["worker"] == w
                           and e["version"] >= row["advance_to"]), default=None) for w in below]
            if all(t is not None for t in firsts):
                back = max(firsts) - t_kill
        if late and "ready_s" not in row:
            if advanced is None:
                time.sleep(0.1)
                continue
            cluster.restart(target)  # the job went on without it: now it comes back
            row["ready_s"] = time.time() - t_kill
        if synced is None:
            if kind == "worker":
                new = [e for e in events if e["worker"] == target and e["event"] == "start" and e["inc"] not in old_inc]
                if new:
                    row.setdefault("ready_s", new[0]["t"] - t_kill)
                    acks = [e["t"] for e in events if e["event"] == "ack" and e["inc"] == new[0]["inc"]]
                    if acks:
                        synced = min(acks) - t_kill
            elif late and kind == "region":  # its zones went to their alternates; it serves again
                synced = row["ready_s"]
            else:
                st = _status(cluster.address(target))
                j = _job(st)
                floor = row["restored_version"] if kind == "root" else (row["root_version_at_kill"] or 0)
                if late:  # the old primary, restarted: the new one's standby, in sync
                    if st is not None and st.root_state == "standby" and j is not None and j.version >= (floor or 0):
                        synced = time.time() - t_kill
                elif j is not None and j.version >= (floor or 0) and len(j.members) >= CHILDREN[kind]:
                    synced = time.time() - t_kill
        if not workers.running():  # the job finished meanwhile
            break
        time.sleep(0.1)
    if late and "ready_s" not in row:  # it never advanced without it: back for the rest of the run
        cluster.restart(target)
        row["ready_s"] = time.time() - t_kill
    row.update(advanced_s=advanced, synced_s=synced, workers_back_s=back, workers_below=below,
               wedged=advanced is None and workers.running())
    return row


# -- one run ---------------------------------------------------------------------------------
def run(seed: int, versions: int, faults: list[tuple[str, str]], gap: int, workdir: Path,
        recover_timeout_s: float, failover: bool = False) -> dict:
    ckpt, logs = workdir / "ckpt", workdir / "logs"
    archives = [WalArchive(ckpt, workdir / "wal-archive")]
    if failover:  # the standby's log too: a version both roots hold must agree
        archives.append(WalArchive(workdir / "ckpt-b", workdir / "wal-archive-b"))
    t0 = time.time()
    cluster = Cluster.start(topology(ckpt, failover), logs,
                            extra_root_args=["--checkpoint-every", str(CHECKPOINT_EVERY)])
    workers = Workers(cluster, logs, seed, versions)
    phases = dict(cluster_up_s=time.time() - t0)
    rows: list[dict] = []
    status_at_end, tree = {}, ""
    try:
        for i in range(4):
            workers.start(i, wait_go=True)
        workers.go()
        phases["training_from_s"] = time.time() - t0
        # Faults spread evenly over the middle of the run; each one also waits for the one
        # before it to have recovered and ``gap`` more versions.
        lo, hi = int(0.06 * versions), int(0.85 * versions)
        triggers = [lo + (hi - lo) * k // max(1, len(faults) - 1) for k in range(len(faults))]
        earliest = 0
        for (kind, target), trigger in zip(faults, triggers):
            while workers.running() and acked_max(workers.snapshot()) < max(trigger, earliest):
                time.sleep(0.05)
            if not workers.running():
                rows.append(dict(kind=kind, target=target, skipped="the job finished first"))
                continue
            try:
                row = inject(cluster, workers, kind, target, recover_timeout_s, failover)
            except (RuntimeError, TimeoutError) as exc:  # the tier did not come back: a finding
                row = dict(kind=kind, target=target, error=str(exc)[-2000:], wedged=True, advanced_s=None,
                           synced_s=None, acked_max_before_kill=acked_max(workers.snapshot()))
                print(f"  {kind} {target}: {exc}", flush=True)
                rows.append(row)
                break
            rows.append(row)
            print(f"  {kind:6s} {target:5s} at version {row['acked_max_before_kill']:4d}: advancing again after "
                  f"{_s(row['advanced_s'])}, its workers back after {_s(row['workers_back_s'])}, synced and "
                  f"serving after {_s(row['synced_s'])}"
                  + (f", restored version {row['restored_version']} (checkpoint {row['restored_from_checkpoint']}"
                     f" + {row['replayed']} replayed)" if kind == "root" and "replayed" in row else "")
                  + (f", {row['promoted']} took over at version {row['restored_version']} after "
                     f"{_s(row['takeover_s'])}" if "promoted" in row else ""), flush=True)
            if row["wedged"]:
                break
            earliest = acked_max(workers.snapshot()) + gap
        wedged = any(r.get("wedged") for r in rows)
        finished = not wedged and workers.wait(recover_timeout_s + 60)
        phases["training_to_s"] = time.time() - t0
        buf = io.StringIO()
        print_tree(cluster.address(primary(cluster)), buf)
        tree = buf.getvalue()
        for name in cluster.tiers:
            st = _status(cluster.address(name))
            j = _job(st)
            status_at_end[name] = None if j is None else dict(
                version=j.version, checksum=j.checksum, epoch=j.view_epoch, stats=dataclasses.asdict(j.stats))
    finally:
        workers.stop()
        cluster.stop()
        for archive in archives:
            archive.stop()
    wall = time.time() - t0
    wal = [rec for archive in archives for rec in archive.records()]
    with open(workdir / "events.jsonl", "w") as f:  # for --keep-logs: what the analysis read
        f.writelines(json.dumps(e) + "\n" for e in workers.events)
    with open(workdir / "wal.jsonl", "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in wal)
    root_log = "".join((logs / f"{name}.log").read_text(errors="replace") for name in ("root", "root-b")
                       if (logs / f"{name}.log").exists())
    return dict(seed=seed, versions=versions, wall_s=wall, phases=phases, finished=finished, wedged=wedged, faults=rows,
                events=workers.events, wal=wal, status_at_end=status_at_end, tree=tree,
                root_double_lines=root_log.count(DOUBLE_LINE))


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f} s"


# -- what a run's records say --------------------------------------------------------------
def analyse(r: dict, workers: int = 4, failover: bool = False) -> dict:
    events, wal, faults = r["events"], r["wal"], [f for f in r["faults"] if "t_kill" in f]
    # The root's log: versions written more than once, and worker pushes in more than one version.
    # With a standby, both roots log every version (and a root that rejoins as a standby logs
    # again what it is sent): a version counts once per distinct contents; two: a fork.
    by_version: dict[int, list[dict]] = defaultdict(list)
    seen: set[tuple] = set()
    for rec in wal:
        content = (rec["version"], rec["contributors"], rec["scale"], tuple(map(tuple, rec["keys"])), rec["payload"])
        if failover and content in seen:
            continue
        seen.add(content)
        by_version[rec["version"]].append(rec)
    versions_twice = sorted(v for v, recs in by_version.items() if len(recs) > 1)
    where: dict[tuple, set[int]] = defaultdict(set)
    for v, recs in by_version.items():
        for rec in recs:
            for k in rec["keys"]:
                where[tuple(k)].add(v)
    pushes_twice = sorted(k for k, vs in where.items() if len(vs) > 1)
    top = max(by_version, default=0)
    gaps = [v for v in range(1, top + 1) if v not in by_version]
    # Contributions missing from versions made with fewer than ``workers`` gradients, each
    # version placed in time by its first acknowledgement.
    made = {}
    for e in events:
        if e["event"] == "ack":
            made[e["version"]] = min(made.get(e["version"], e["t"]), e["t"])
    short = {v: workers - len(recs[-1]["keys"]) for v, recs in by_version.items() if len(recs[-1]["keys"]) < workers}
    missing = sum(short.values())
    # Every acknowledgement: the push it names is in the version it names.
    acks = [e for e in events if e["event"] == "ack"]
    acks_not_in_log = [e for e in acks if e["version"] not in where.get((e["worker"], e["inc"], e["seq"]), set())]
    # Lost steps: gradients sent and never applied, by (worker, version computed on). A push
    # refused as not applied gives its number to the next gradient; one left unanswered was in
    # flight in a process that was killed, lost unless the root's log holds it.
    def after(t: float) -> int | None:    # the fault that ended a process: the first kill after t
        return next((i for i, f in enumerate(faults) if f["t_kill"] >= t), None)

    def before(t: float) -> int | None:   # the fault a refusal came from: the latest kill before t
        return max((i for i, f in enumerate(faults) if f["t_kill"] <= t), default=None)
    lost: dict[tuple, int | None] = {}
    pending: dict[tuple, dict] = {}
    for e in events:
        key = (e["worker"], e["inc"], e["seq"]) if "seq" in e else None
        if e["event"] == "send":
            pending[key] = e
        elif e["event"] == "stale" and key in pending:
            s = pending.pop(key)
            lost.setdefault((s["worker"], s["base"]), before(e["t"]))
        elif e["event"] == "ack":
            pending.pop(key, None)
    for key, s in pending.items():
        if key not in where:
            lost.setdefault((s["worker"], s["base"]), after(s["t"]))
    per_fault_lost: dict[int | None, int] = defaultdict(int)
    for i in lost.values():
        per_fault_lost[i] += 1
    per_fault_missing: dict[int | None, int] = defaultdict(int)
    for v, n in short.items():
        per_fault_missing[before(made[v]) if v in made else None] += n
    for i, f in enumerate(faults):
        f["lost_steps"] = per_fault_lost.get(i, 0)
        f["missing_contributions"] = per_fault_missing.get(i, 0)
    done = [e for e in events if e["event"] == "done"]
    final = max(done, key=lambda e: e["version"]) if done else None
    return dict(
        versions_in_log=len(by_version), log_top=top, log_gaps=gaps[:20], log_gap_count=len(gaps),
        versions_written_twice=versions_twice, pushes_applied_twice=[list(k) for k in pushes_twice],
        missing_contributions=missing, acks=len(acks), acks_not_in_log=len(acks_not_in_log),
        acks_not_in_log_examples=acks_not_in_log[:5], lost_steps=len(lost),
        lost_steps_outside_faults=per_fault_lost.get(None, 0),
        missing_contributions_outside_faults=per_fault_missing.get(None, 0),
        workers_done=len(done), final_version=final["version"] if final else None,
        final_loss=final["loss"] if final else None,
        final_views_agree=len({(e["version"], e["crc"]) for e in done}) == 1 if done else False,
        worker_lost_steps_reported=sum(e["lost_steps"] for e in done))


def summarise(kinds: list[str], faults: list[dict], analysis: dict, root_doubles: int) -> dict:
    out = {}
    for kind in kinds:
        rows = [f for f in faults if f.get("kind") == kind and "t_kill" in f]
        adv = [f["advanced_s"] for f in rows if f["advanced_s"] is not None]
        syn = [f["synced_s"] for f in rows if f["synced_s"] is not None]
        bk = [f["workers_back_s"] for f in rows if f.get("workers_back_s") is not None]
        out[kind] = dict(
            faults=len(rows), skipped=sum(1 for f in faults if f.get("kind") == kind and "skipped" in f),
            wedged=sum(1 for f in faults if f.get("kind") == kind and f.get("wedged")),
            errors=[f["error"] for f in faults if f.get("kind") == kind and "error" in f],
            advanced_s_median=statistics.median(adv) if adv else None, advanced_s_max=max(adv) if adv else None,
            synced_s_median=statistics.median(syn) if syn else None, synced_s_max=max(syn) if syn else None,
            workers_back_s_median=statistics.median(bk) if bk else None, workers_back_s_max=max(bk) if bk else None,
            lost_steps=sum(f.get("lost_steps", 0) for f in rows),
            missing_contributions=sum(f.get("missing_contributions", 0) for f in rows),
            acked_versions_lost=sum(f.get("acked_versions_lost", 0) for f in rows))
    out["all"] = dict(acked_versions_lost=sum(v["acked_versions_lost"] for v in out.values()),
                      acks_not_in_log=analysis["acks_not_in_log"],
                      pushes_applied_twice=len(analysis["pushes_applied_twice"]),
                      versions_written_twice=len(analysis["versions_written_twice"]),
                      root_double_applied_counter=root_doubles)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 fault of each kind, 240 versions, 2 fault-free seeds")
    # Each fault costs ~20-60 versions of recovery (the job goes on without the killed tier's
    # workers once they time out) plus --gap: 12 faults need ~600.
    p.add_argument("--versions", type=int, default=800, help="versions each run trains for (default 800)")
    p.add_argument("--faults-per-kind", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, injected in this order, in turn")
    p.add_argument("--baselines", type=int, default=3, help="fault-free runs with other seeds")
    p.add_argument("--seed", type=int, default=0, help="the faulted run's seed (fault-free: seed+1, ...)")
    p.add_argument("--gap", type=int, default=10, help="versions between one fault's recovery and the next fault")
    p.add_argument("--recover-timeout", type=float, default=90.0, help="seconds before a fault counts as wedged")
    p.add_argument("--keep-logs", help="keep every process's log and the root's checkpoints here")
    p.add_argument("--failover", action="store_true",
                   help="a standby root and alternate parents; killed regional masters and roots come back late")
    p.add_argument("--out", help="result file (default benchmarks/results/chaos.json, chaos_failover.json "
                                 "with --failover)")
    args = p.parse_args(argv)
    if args.quick:
        args.versions, args.faults_per_kind, args.baselines = min(args.versions, 240), 1, min(args.baselines, 2)
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    schedule = [(kind, TARGETS[kind][n % len(TARGETS[kind])]) for n in range(args.faults_per_kind) for kind in kinds]
    base = Path(args.keep_logs) if args.keep_logs else Path(tempfile.mkdtemp(prefix="hps-chaos-"))
    t_start = time.time()
    runs: dict[str, dict] = {}
    try:
        plan = [("faulted", args.seed, schedule), ("fault-free, same seed", args.seed, [])]
        plan += [(f"fault-free, seed {args.seed + k}", args.seed + k, []) for k in range(1, args.baselines + 1)]
        for name, seed, faults in plan:
            print(f"== {name}: seed {seed}, {args.versions} versions, {len(faults)} faults", flush=True)
            workdir = base / name.replace(", ", "-").replace(" ", "-")
            shutil.rmtree(workdir, ignore_errors=True)
            r = run(seed, args.versions, faults, args.gap, workdir, args.recover_timeout, args.failover)
            r["analysis"] = analyse(r, failover=args.failover)
            a = r["analysis"]
            print(f"   {r['wall_s']:.1f} s, final version {a['final_version']}, held-out loss "
                  f"{a['final_loss'] if a['final_loss'] is None else round(a['final_loss'], 4)}, lost steps "
                  f"{a['lost_steps']}, missing contributions {a['missing_contributions']}", flush=True)
            runs[name] = r
            if r["wedged"] or not r["finished"]:
                print(r["tree"])
                if name == "faulted":
                    break
    finally:
        if not args.keep_logs:
            shutil.rmtree(base, ignore_errors=True)
    total = time.time() - t_start

    faulted = runs["faulted"]
    fa = faulted["analysis"]
    root_doubles = sum(f.get("root_double_applied_before_kill") or 0
                       for f in faulted["faults"] if f.get("kind") == "root")
    root_doubles += sum(((faulted["status_at_end"].get(n) or {}).get("stats") or {}).get("double_applied", 0)
                        for n in ("root", "root-b"))
    figures = summarise(kinds, faulted["faults"], fa, root_doubles)
    figures["all"]["root_double_applied_log_lines"] = faulted["root_double_lines"]
    # Quiescent at the end: every tier and every worker holds the same version, bit for bit.
    # (with --failover a restarted regional master whose zones went to their alternates holds none)
    held = {(s["version"], s["checksum"]) if s else None for name, s in faulted["status_at_end"].items()
            if s or not (args.failover and name in REGIONS)}
    held |= {(e["version"], e["crc"]) for e in faulted_events_done(faulted)}
    figures["all"]["views_agree_at_end"] = len(held) == 1 and None not in held
    others = [r["analysis"]["final_loss"] for n, r in runs.items() if n.startswith("fault-free, seed")
              and r["analysis"]["final_loss"] is not None]
    same = runs.get("fault-free, same seed", {}).get("analysis", {}).get("final_loss")
    loss = dict(faulted=fa["final_loss"], fault_free_same_seed=same, fault_free_other_seeds=others,
                other_min=min(others) if others else None, other_median=statistics.median(others) if others else None,
                other_max=max(others) if others else None)
    loss["within_spread"] = (bool(others) and fa["final_loss"] is not None
                             and min(others) <= fa["final_loss"] <= max(others))
    loss["not_above_max"] = bool(others) and fa["final_loss"] is not None and fa["final_loss"] <= max(others)
    loss["vs_same_seed_pct"] = (100 * (fa["final_loss"] - same) / same) if same and fa["final_loss"] else None
    wedged = faulted["wedged"] or not faulted["finished"]
    bad = (figures["all"]["acked_versions_lost"] or figures["all"]["acks_not_in_log"]
           or figures["all"]["pushes_applied_twice"] or figures["all"]["versions_written_twice"]
           or root_doubles or faulted["root_double_lines"] or wedged or not figures["all"]["views_agree_at_end"]
           or fa["workers_done"] < len(ZONES))  # a worker that crashed trains nothing: no clean result

    print(f"\nchaos: {len(schedule)} faults in a {args.versions}-version BSP run (seed {args.seed}); "
          f"{total / 60:.1f} min in all")
    print(f"{'fault':8s} {'n':>2s} {'advancing again':>16s} {'its workers back':>16s} {'synced+serving':>16s} "
          f"{'lost steps':>10s} {'missing':>8s} {'acked lost':>10s}")
    for kind in kinds:
        k = figures[kind]
        print(f"{kind:8s} {k['faults']:2d} {_pair(k['advanced_s_median'], k['advanced_s_max']):>16s} "
              f"{_pair(k['workers_back_s_median'], k['workers_back_s_max']):>16s} "
              f"{_pair(k['synced_s_median'], k['synced_s_max']):>16s} {k['lost_steps']:10d} "
              f"{k['missing_contributions']:8d} {k['acked_versions_lost']:10d}")
    al = figures["all"]
    print(f"(median / max seconds from the kill; missing: gradients absent from versions made with fewer than "
          f"4; outside any fault: {fa['lost_steps_outside_faults']} lost, "
          f"{fa['missing_contributions_outside_faults']} missing)")
    print(f"acknowledgements not in the root's log: {al['acks_not_in_log']} of {fa['acks']}; worker pushes "
          f"applied twice (log): {al['pushes_applied_twice']}; versions written twice: "
          f"{al['versions_written_twice']}; root's double-applied counter: {root_doubles} (log lines: "
          f"{faulted['root_double_lines']}); log gaps: {fa['log_gap_count']}; every tier and worker at the "
          f"same version and checksum at the end: {'yes' if al['views_agree_at_end'] else 'NO'}")
    print(f"final held-out loss: faulted {_f(loss['faulted'])}; fault-free same seed {_f(same)}; other seeds "
          f"min {_f(loss['other_min'])} median {_f(loss['other_median'])} max {_f(loss['other_max'])} "
          f"({len(others)} runs): {_verdict(loss)}")
    print("RESULT: " + ("FAILED (acknowledged version lost, gradient applied twice, views differ, wedged, or a "
                        "worker did not finish: see its log)"
                        if bad else
                        "no acknowledged version lost, nothing applied twice"))

    settings = dict(versions=args.versions, faults_per_kind=args.faults_per_kind, kinds=kinds, gap=args.gap,
                    baselines=args.baselines, seed=args.seed, quick=args.quick,
                    recover_timeout_s=args.recover_timeout, schedule=schedule, tier_settings=SETTINGS,
                    failover=args.failover,
                    checkpoint_every=CHECKPOINT_EVERY,
                    topology="root" + (" + standby root-b, zones with the other region as alternate parent"
                                       if args.failover else "") + ", regions eu/us x zones a/b, 4 workers",
                    model="MLP 32-64-10 on 65536 samples labelled by a random teacher network, batch 32 "
                          "per worker, SGD lr 0.03 momentum 0.9 at the root; loss on 2048 held-out samples")
    for r in runs.values():  # the JSON keeps what was measured, not every event
        r.pop("events", None)
        r.pop("wal", None)
    write("chaos_failover" if args.failover else "chaos",
          dict(settings=settings, total_seconds=round(total, 1), failed=bool(bad), figures=figures,
               final_loss=loss, runs=runs), args.out)
    return 1 if bad else 0


def faulted_events_done(run: dict) -> list[dict]:
    return [e for e in run["events"] if e["event"] == "done"]


def _verdict(loss: dict) -> str:
    if loss["within_spread"]:
        return "within their spread"
    if loss["not_above_max"]:
        return "below their spread (better than every fault-free seed)"
    return "NOT within their spread (worse than every fault-free seed)"


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None else f"{a:.2f} / {b:.2f}"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


if __name__ == "__main__":
    sys.exit(main())
