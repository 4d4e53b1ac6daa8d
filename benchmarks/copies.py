"""How many times each process copies a gradient and a delta (issue 18's copy count), counted
rather than read off the code: push and pull a dense fp32 model at the root and through a zone,
and hps's frames over bare gRPC (the ``wire`` row: the transport's own share), each process
running under a small preloaded library that counts, from inside it,

- ``memcpy``: bytes passed to ``memcpy``/``memmove`` in calls of at least ``--min-bytes``:
  numpy's copies and ``tobytes``, Python's ``bytes`` joins and slices, gRPC's copies into and
  out of its buffers;
- ``alloc``: bytes of blocks of at least ``--min-bytes`` allocated (``malloc``, ``calloc``,
  ``realloc``, ``posix_memalign``, ``aligned_alloc``): every new array or buffer. torch writes
  its copies (``torch.cat``, ``clone``, ``to``) with its own kernels, not ``memcpy``: those
  show up here only. numpy's arithmetic into a new array (``a + b``) is a pass, and counts here.

Each is reported per process and per round (one push, then one pull of the version it made),
divided by the model's bytes: 1.0 is one full-vector copy. Not counted: the kernel's copies
(socket reads and writes: the wire), in-place passes (``a += b``, the optimizer, checksums), and
copies a compiler inlined. The issue's goal is at most 6 full-vector copies upward and 5
downward end to end, 11 a round; reading the code, the issue counted 14 and 11.

    python benchmarks/copies.py --params 10000000

``--sites`` also says which source lines copied: every process runs a line tracer
(``benchmarks/copycount/sitecustomize.py``) that credits its thread's counts to the Python line
that ran last, and the row reports each process's 12 lines that copied most over the counted
rounds. Copies inside C land on the line that called into it (a gRPC receive on the line that
awaited the message). Much slower; the counts per process are the same with it.

Needs a C compiler (``cc``) to build ``benchmarks/copycount/copycount.c`` (Linux, glibc).
Writes benchmarks/results/copies.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ROOT, write

SHIM_SRC = ROOT / "benchmarks" / "copycount" / "copycount.c"


def build_shim(out_dir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("copies.py needs a C compiler (cc) to build its counting library")
    lib = out_dir / "copycount.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(SHIM_SRC), "-ldl"], check=True)
    return lib


def read_counts(count_dir: Path, pid: int) -> tuple[int, int, int, int]:
    """(memcpy bytes, memcpy calls, allocated bytes, allocations) of process ``pid`` so far."""
    with open(count_dir / str(pid), "rb") as f:
        return struct.unpack("<4Q", f.read(32))


def _tracing() -> bool:
    return bool(os.environ.get("HPS_COPYCOUNT_SITES"))


def _sites_begin(pids: dict[str, int]) -> None:
    """Clear every process's line tally before the counted rounds (``--sites``)."""
    if _tracing():
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)  # a tier's loop runs the handler at its next wake-up


def _sites_end(pids: dict[str, int], count_dir: Path, nbytes: int, rounds: int, top: int = 12) -> dict:
    """Each process's ``top`` lines by bytes copied, per round, in full vectors (``--sites``)."""
    if not _tracing():
        return {}
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR2)
    time.sleep(2.0)
    out = {}
    for name, pid in pids.items():
        path = count_dir / f"{pid}.sites.json"
        tally = json.loads(path.read_text()) if path.exists() else {}
        ranked = sorted(tally.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]
        out[name] = [dict(line=k, memcpy=m / nbytes / rounds, alloc=a / nbytes / rounds) for k, (m, a) in ranked]
    return out


def _wire_row(params: int, key_elems: int, reps: int, count_dir: Path) -> dict:
    """gRPC alone, as ``dataplane.py``'s ``wire`` row: hps's frames, encoded before counting,
    pushed to a server that only reads them, and the whole model's frames pulled back."""
    import grpc
    from dataplane import _chunks

    from ps.core.types import PushMeta
    from ps.net.rpc import CHANNEL_OPTIONS
    from ps.net.wire import encode_push, pb, stubs

    nbytes = 4 * params
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "dataplane.py"), "--wire-server",
                             "--params", str(params), "--key-elems", str(key_elems)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        frames = encode_push(PushMeta("big", "w0", 1, 0), _chunks(params, key_elems))
        pids = {"client": os.getpid(), "server": proc.pid}
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            rpc = stubs(channel)
            rounds = []
            for i in range(reps + 1):  # the first is a warm-up
                if i == 1:
                    _sites_begin(pids)
                before = {n: read_counts(count_dir, p) for n, p in pids.items()}
                rpc["Push"](iter(frames), timeout=300)
                got = list(rpc["Pull"](pb.PullRequest(job="big"), timeout=300))
                del got
                time.sleep(0.5)
                after = {n: read_counts(count_dir, p) for n, p in pids.items()}
                if i:
                    rounds.append({n: dict(memcpy=(after[n][0] - before[n][0]) / nbytes,
                                           alloc=(after[n][2] - before[n][2]) / nbytes,
                                           memcpy_calls=after[n][1] - before[n][1],
                                           allocs=after[n][3] - before[n][3]) for n in pids})
            sites = _sites_end(pids, count_dir, nbytes, reps)
    finally:
        proc.terminate()
        proc.wait(30)
    return dict(where="wire", rounds=rounds, sites=sites)


def _row(where: str, params: int, key_elems: int, reps: int, count_dir: Path) -> dict:
    """Runs in a process started under the counting library (so this worker is counted too)."""
    if where == "wire":
        return _wire_row(params, key_elems, reps, count_dir)
    from ps.core.config import JobConfig, OptimizerConfig
    from ps.core.view import KeySpec, Layout
    from ps.tools.launch import Cluster
    from worker import ParameterClient

    keys, left, i = [], params, 0
    while left:
        n = min(key_elems, left)
        keys.append(KeySpec(f"k{i}", (n,)))
        left, i = left - n, i + 1
    layout = Layout(keys)
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 1.0, "member_timeout_s": 60.0},
            "root": {"name": "root", **({"zones": [{"name": "z"}]} if where == "zone" else {})}}
    values = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
    grad = np.random.default_rng(1).standard_normal(params, dtype=np.float32) * 1e-3
    job = JobConfig(name="big", optimizer=OptimizerConfig(kind="sgd", lr=0.01), delta_log_length=2)
    nbytes = 4 * params
    # The counting shim's settings, handed to the tiers by name (a launch passes none of its own
    # HPS_* variables on).
    counting = {k: v for k, v in os.environ.items() if k.startswith("HPS_COPYCOUNT_")}
    with tempfile.TemporaryDirectory() as tmp, Cluster.start(topo, tmp, env=counting) as cluster:
        pids = {"worker": os.getpid(), **{n: t.proc.pid for n, t in cluster.tiers.items()}}
        c = ParameterClient(cluster.address("z" if where == "zone" else "root"), "big", "w0",
                            timeout_s=300, round_timeout_s=300)
        try:
            c.create_job(job, layout, values)
            c.register()
            c.pull(min_version=c.start_version)
            version, _ = c.push(grad)  # a warm-up round: first allocations, the first snapshot
            c.pull(min_version=version)
            time.sleep(1.0)  # every tier done with the warm-up version
            _sites_begin(pids)
            rounds = []
            for _ in range(reps):
                before = {n: read_counts(count_dir, p) for n, p in pids.items()}
                w0 = read_counts(count_dir, pids["worker"])
                version, _ = c.push(grad)
                w1 = read_counts(count_dir, pids["worker"])
                c.pull(min_version=version)
                time.sleep(1.0)  # every tier done with this version (a zone follows the root's)
                after = {n: read_counts(count_dir, p) for n, p in pids.items()}
                w2 = read_counts(count_dir, pids["worker"])
                per = {n: dict(memcpy=(after[n][0] - before[n][0]) / nbytes,
                               alloc=(after[n][2] - before[n][2]) / nbytes,
                               memcpy_calls=after[n][1] - before[n][1], allocs=after[n][3] - before[n][3])
                       for n in pids}
                per["worker"].update(push_memcpy=(w1[0] - w0[0]) / nbytes, push_alloc=(w1[2] - w0[2]) / nbytes,
                                     pull_memcpy=(w2[0] - w1[0]) / nbytes, pull_alloc=(w2[2] - w1[2]) / nbytes)
                rounds.append(per)
            sites = _sites_end(pids, count_dir, nbytes, reps)
        finally:
            c.close()
    return dict(where=where, rounds=rounds, sites=sites)


def _median(rounds: list[dict], proc: str, field: str) -> float:
    return float(np.median([r[proc][field] for r in rounds]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=10_000_000, help="float32 values in the model")
    p.add_argument("--key-elems", type=int, default=1_000_000, help="values per key (tensor)")
    p.add_argument("--reps", type=int, default=3, help="counted rounds per row, after one warm-up")
    p.add_argument("--rows", default="wire,root,zone", help="wire (gRPC alone), root, zone")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest call or block counted")
    p.add_argument("--sites", action="store_true", help="also report the source lines that copied (slow)")
    p.add_argument("--out", help="result file (default benchmarks/results/copies.json)")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--count-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        r = _row(args.row, args.params, args.key_elems, args.reps, Path(args.count_dir))
        print("RESULT " + json.dumps(r))
        return 0
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_shim(Path(tmp))
        for where in args.rows.split(","):
            count_dir = Path(tmp) / where
            count_dir.mkdir()
            env = {**os.environ, "LD_PRELOAD": str(lib), "HPS_COPYCOUNT_DIR": str(count_dir),
                   "HPS_COPYCOUNT_MIN": str(args.min_bytes), "PYTHONPATH": str(ROOT)}
            if args.sites:  # its sitecustomize.py: a line tracer in every Python process of the row
                env.update(HPS_COPYCOUNT_SITES="1", PYTHONPATH=f"{SHIM_SRC.parent}{os.pathsep}{ROOT}")
            out = subprocess.run([sys.executable, __file__, "--row", where, "--count-dir", str(count_dir),
                                  "--params", str(args.params), "--key-elems", str(args.key_elems),
                                  "--reps", str(args.reps)], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=1800)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(f"{where}: failed\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(line[len("RESULT "):])
            procs = list(r["rounds"][0])
            summary = {n: {f: _median(r["rounds"], n, f) for f in ("memcpy", "alloc")} for n in procs}
            for f in ("push_memcpy", "push_alloc", "pull_memcpy", "pull_alloc"):
                if "worker" in summary:
                    summary["worker"][f] = _median(r["rounds"], "worker", f)
            total = {f: sum(summary[n][f] for n in procs) for f in ("memcpy", "alloc")}
            rows[where] = dict(per_process=summary, end_to_end=total, rounds=r["rounds"], sites=r.get("sites", {}))
            print(f"\n{where}: full-vector copies per round (one push + one pull), median of {args.reps}")
            print(f"  {'process':10s} {'memcpy':>8s} {'alloc':>8s}")
            for n in procs:
                print(f"  {n:10s} {summary[n]['memcpy']:8.2f} {summary[n]['alloc']:8.2f}")
            if "worker" in summary:
                w = summary["worker"]
                print(f"  (worker: push {w['push_memcpy']:.2f} / {w['push_alloc']:.2f}, "
                      f"pull {w['pull_memcpy']:.2f} / {w['pull_alloc']:.2f})")
            print(f"  {'all':10s} {total['memcpy']:8.2f} {total['alloc']:8.2f}   "
                  "(goal: 11 copies a round, 6 up + 5 down)")
            for n, lines in r.get("sites", {}).items():
                print(f"  {n}: the lines that copied most, per round (memcpy / alloc)")
                for ln in lines:
                    print(f"    {ln['memcpy']:5.2f} / {ln['alloc']:5.2f}  {ln['line']}")
    write("copies", dict(params=args.params, key_elems=args.key_elems, reps=args.reps,
                         min_bytes=args.min_bytes, rows=rows,
                         note="per process and round, bytes / model bytes; see the module docstring "
                              "for what each column counts and misses"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
