"""A peer row for benchmarks/wan_loss.py: the same demo model, data, batch and emulated WAN,
trained with torchft 0.2.0's DiLoCo (what a user would pick instead of hps across regions).

    python benchmarks/_diloco_peer.py --inner-steps 50 --steps 200
    # prints run_diloco(...)'s dict as JSON

2 regions x 2 workers, each worker one torchft replica group (benchmarks/_diloco_worker.py,
run by HPS_PEER_PYTHON, default .peervenv/bin/python, which `make peer` builds: torchft lives in
its own venv). Inner
AdamW 3e-3 (20 warm-up steps), outer SGD lr 0.7, momentum 0.9, Nesterov, every H inner steps;
fp32 pseudo-gradients in one bucketized gloo all-reduce. torchft's Lighthouse runs at the
"root" site.

The WAN (default ``--wan via-root``), as wan_loss.py's: each region has one link to the root
site, ``latency_ms`` round trip and ``bandwidth_mbit`` each way, shared by everything the region
sends or receives (ps.tools.wanem's model: its Link, its per-direction serialisation clock,
its pump). A
connection from eu to us crosses eu's link up, then us's link down (store and forward at the
root, 64 KiB chunks): 2x latency round trip, and its bytes are counted on both links, as the
hierarchy's eu -> root -> us path is. A worker's connections to the Lighthouse cross its own
region's link only; connections inside a region cross nothing. All of it is one relay process
(``--relay``, below), since gloo's peers connect to each other directly: the workers swap every
address in another region for the relay's listener on that path (see _diloco_worker.py). The
relay logs each link's byte counters in wanem's words; they are read as wan_loss.py reads its
links' logs. ``--wan direct`` instead puts one such link between the two regions (the
Lighthouse in eu): half the latency between the regions, and each byte counted once.

Measured here (2 cores, 100 ms / 100 Mbit/s, 200 steps, batch 16): each sync after the first
takes ~1.6 s via-root (~0.2 s of it the quorum), ~0.95 s direct; the first 2.3-4.4 s (quorum,
process group rendezvous through the TCPStore across the WAN, gloo's connections). The losses
do not depend on the WAN: the same numbers every run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_diloco_worker.py")
PEER_PYTHON = os.path.join(ROOT, ".peervenv", "bin", "python")  # `make peer` builds it
REGIONS = (("eu", 2), ("us", 2))
WAN_SHAPES = {
    "via-root": ("each region one link to the root site (ps.tools.wanem's model, all in one relay); eu<->us "
                 "connections cross both links (2x the latency round trip; their bytes counted on both, as the "
                 "hierarchy's eu -> root -> us); the Lighthouse at the root, reached over the region's link"),
    "direct": ("one link between the two regions (ps.tools.wanem's model, in one relay), every eu<->us connection "
               "crossing it; the Lighthouse in eu, us reaching it over the link"),
}


# --- the relay: both regions' links, in front of whatever a worker reaches in another region ---

def _relay_main(args) -> int:
    import asyncio
    import random

    sys.path.insert(0, ROOT)
    from ps.tools.wanem import Link, _Direction, _pump

    link = Link(latency_ms=args.latency_ms, bandwidth_mbit=args.bandwidth_mbit)
    rng = random.Random(0)
    # name -> (up, down). via-root: one link per region, "up" towards the root; direct: one
    # link between the regions, "up" from the first region to the second.
    if args.wan == "direct":
        a, b = (r for r, _ in REGIONS)
        links = {f"{a}-{b}": (_Direction(link, rng), _Direction(link, rng))}
    else:
        links = {f"{r}-wan": (_Direction(link, rng), _Direction(link, rng)) for r, _ in REGIONS}
    conns = {r: 0 for r in links}

    def hops(src: str, dst: str) -> list[tuple[str, object]]:
        """The links (name, direction) that src -> dst bytes cross, in order."""
        if args.wan == "direct":
            if src == dst or "root" in (src, dst):
                return []
            name = next(iter(links))
            return [(name, links[name][0 if src == a else 1])]
        out = [(f"{src}-wan", links[f"{src}-wan"][0])] if f"{src}-wan" in links else []
        return out + ([(f"{dst}-wan", links[f"{dst}-wan"][1])] if f"{dst}-wan" in links else [])
    owner: dict[str, str] = {}            # "host:port" -> region ("root": the Lighthouse's site)
    proxies: dict[tuple[str, str, bool], str] = {}
    servers = []
    writers: set = set()
    log = open(args.log, "a", buffering=1)

    class Path:
        """src -> dst: via-root, src's link up, then dst's link down (the root has no link)."""

        def __init__(self, src: str, dst: str) -> None:
            self.names = [n for n, _ in hops(src, dst)]
            self.dirs = [d for _, d in hops(src, dst)]
            self.link = Link(latency_ms=sum(d.link.latency_ms for d in self.dirs),
                             bandwidth_mbit=link.bandwidth_mbit,
                             buffer_bytes=sum(d.link.buffer for d in self.dirs))

        def schedule(self, n: int, now: float, after: float) -> float:
            if not self.dirs:
                return max(now, after)
            for d in self.dirs[:-1]:
                now = d.schedule(n, now, 0.0)  # arrives at the root; forwarded from then
            return self.dirs[-1].schedule(n, now, after)

    def split(addr: str) -> tuple[str, int]:
        host, port = addr.rsplit(":", 1)
        return host.strip("[]"), int(port)

    lock = asyncio.Lock()

    async def proxy_for(src: str, target: str, low: bool) -> str:
        async with lock:
            if (src, target, low) not in proxies:
                proxies[src, target, low] = await new_proxy(src, target, low)
            return proxies[src, target, low]

    async def new_proxy(src: str, target: str, low: bool) -> str:
        dst = owner[target]
        up, down = Path(src, dst), Path(dst, src)
        host, port = split(target)

        async def handle(c_reader, c_writer):
            for name in set(up.names):
                conns[name] += 1
            t_writer = None
            writers.add(c_writer)
            try:
                t_reader, t_writer = await asyncio.open_connection(host, port)
                writers.add(t_writer)
                for w in (c_writer, t_writer):
                    sock = w.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.gather(_pump(c_reader, t_writer, up), _pump(t_reader, c_writer, down),
                                     return_exceptions=True)
            except (ConnectionError, OSError):
                pass
            finally:
                for w in (c_writer, t_writer):
                    if w is not None:
                        w.close()
                        writers.discard(w)

        listen = "127.0.0.0" if low else "127.0.0.1"  # low: see RoutingStore in _diloco_worker.py
        server = await asyncio.start_server(handle, listen, 0)
        servers.append(server)
        addr = f"{listen}:{server.sockets[0].getsockname()[1]}"
        print(f"relay: {src} -> {target} ({dst}) via {addr}", file=log)
        return addr

    async def control(reader, writer):
        try:
            words = (await reader.readline()).decode().split()
            if len(words) == 3 and words[0] == "OWN":
                owner[words[2]] = words[1]
                reply = "OK"
            elif len(words) in (3, 4) and words[0] == "ROUTE":
                src, target, low = words[1], words[2], words[3:] == ["low"]
                if target not in owner:
                    reply = f"ERR {target} was never declared (OWN)"
                elif owner[target] == src:
                    reply = target  # same region: no WAN
                else:
                    reply = await proxy_for(src, target, low)
            else:
                reply = f"ERR bad request {words!r}"
            writer.write(reply.encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    def report(final: bool, t0: float) -> None:
        for r, (up, down) in links.items():
            if final:
                print(f"wanem {r}: stopped after {time.monotonic() - t0:.1f}s; {conns[r]} connections, "
                      f"{up.bytes} bytes up, {down.bytes} bytes down", file=log)
            else:
                print(f"wanem {r}: {up.bytes} bytes up, {down.bytes} bytes down so far", file=log)

    async def serve() -> None:
        t0 = time.monotonic()
        ctl = await asyncio.start_server(control, "127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, lambda: report(False, t0))
        port = ctl.sockets[0].getsockname()[1]
        print(f"relay: control 127.0.0.1:{port} ({link.describe()}, {args.wan}: {', '.join(links)})", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), args.max_s)
        except asyncio.TimeoutError:
            pass
        ctl.close()
        for s in servers:
            s.close()
        for w in list(writers):
            w.transport.abort()
        report(True, t0)

    asyncio.run(serve())
    return 0


# --- the driver ---

def _wait_line(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
            m = re.search(pattern, line)
            if m:
                return m
        elif proc.poll() is not None:
            break
    raise RuntimeError(f"no {pattern!r} from {proc.args[:3]} within {timeout:.0f}s (exit {proc.poll()}): {seen[-500:]}")


def _stop(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _peer_python() -> tuple[str, str, str]:
    """(interpreter, torchft version, "" or why torchft cannot be used from it)."""
    py = os.environ.get("HPS_PEER_PYTHON", PEER_PYTHON)
    if not os.path.exists(py):
        return py, "", f"no interpreter at {py} (HPS_PEER_PYTHON): torchft is not installed here (make peer)"
    try:
        probe = ("import importlib.metadata as m, torch, torchft.local_sgd, torchft.manager, torchft.process_group, "
                 "torchft.coordination; print(m.version('torchft'), torch.__version__)")
        out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return py, "", f"{py} took over 180 s to import torchft"
    if out.returncode != 0:
        err = out.stderr.strip().splitlines()
        return py, "", f"torchft cannot be imported by {py}: {err[-1] if err else out.returncode}"
    version = out.stdout.split()[0]
    return py, version, ""


def _read(proc: subprocess.Popen, q: queue.Queue, worker: str) -> None:
    for line in proc.stdout:
        try:
            q.put(json.loads(line))
        except json.JSONDecodeError:
            pass  # gloo's "[Gloo] Rank ... connected" lines
    q.put({"event": "exit", "worker": worker, "rc": proc.wait()})


def run_diloco(H: int, steps: int, batch: int, latency_ms: float, bandwidth_mbit: float, logdir: str,
               timeout_s: float = 1200.0, wan: str = "via-root") -> dict:
    """Train the demo model with torchft's DiLoCo (sync every ``H`` inner steps) for ``steps``
    steps on 4 workers in 2 regions across the emulated WAN; the same keys as wan_loss.run().

    ``wan``: "via-root" (wan_loss.py's links: each region one link to the root site, where the
    Lighthouse runs; eu <-> us crosses both) or "direct" (one link between the two regions,
    the Lighthouse in the first region)."""
    if wan not in WAN_SHAPES:
        raise ValueError(f"wan must be one of {', '.join(WAN_SHAPES)}, got {wan!r}")
    label = f"torchft DiLoCo H={H}: AdamW inner, Nesterov outer lr 0.7, fp32 bucketized gloo all-reduce"
    base = dict(label=label, H=H, steps=steps, batch=batch,
                link=dict(latency_ms=latency_ms, bandwidth_mbit=bandwidth_mbit), wan=wan,
                wan_emulation=WAN_SHAPES[wan])
    py, version, why = _peer_python()
    base.update(peer_python=py, torchft_version=version)
    if why:
        return dict(base, status=why)
    os.makedirs(logdir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn"}
    relay_log = os.path.join(logdir, "relay.log")
    open(relay_log, "w").close()
    procs: list[subprocess.Popen] = []
    names: list[tuple[str, str]] = []
    workers: list[subprocess.Popen] = []
    q: queue.Queue = queue.Queue()
    events: list[dict] = []
    status = ""
    rcs: dict[str, int] = {}
    trace = open(os.path.join(logdir, "events.jsonl"), "w", buffering=1)
    try:
        relay = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--relay", "--log", relay_log,
                                  "--latency-ms", str(latency_ms), "--bandwidth-mbit", str(bandwidth_mbit),
                                  "--max-s", str(timeout_s + 120), "--wan", wan],
                                 stdout=subprocess.PIPE, stderr=open(os.path.join(logdir, "relay.err"), "wb"),
                                 text=True, env=env, cwd=ROOT)
        procs.append(relay)
        control = _wait_line(relay, r"relay: control (\S+)", 60).group(1)
        lighthouse = subprocess.Popen([py, WORKER, "--lighthouse", "--min-replicas", str(sum(n for _, n in REGIONS)),
                                       "--max-s", str(timeout_s + 120)],
                                      stdout=subprocess.PIPE, stderr=open(os.path.join(logdir, "lighthouse.log"), "wb"),
                                      text=True, env=env, cwd=ROOT)
        procs.append(lighthouse)
        lh = _wait_line(lighthouse, r"lighthouse: serving (\S+)", 120).group(1)
        host, port = control.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:  # where the Lighthouse is
            s.sendall(f"OWN {'root' if wan == 'via-root' else REGIONS[0][0]} {lh}\n".encode())
            s.recv(64)
        for r, n in REGIONS:  # eu_0 eu_1 us_2 us_3: replica ranks (sorted ids) keep regions contiguous
            for _ in range(n):
                names.append((f"{r}_{len(names)}", r))
        for i, (name, region) in enumerate(names):
            err = open(os.path.join(logdir, f"{name}.log"), "wb")
            p = subprocess.Popen([py, WORKER, "--replica-id", name, "--region", region, "--seed", str(i),
                                  "--replicas", str(len(names)), "--steps", str(steps), "--batch", str(batch),
                                  "--sync-every", str(H), "--lighthouse-addr", lh, "--relay", control],
                                 stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
            procs.append(p)
            workers.append(p)
            threading.Thread(target=_read, args=(p, q, name), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        exited, started = 0, 0
        while exited < len(workers):
            left = deadline - time.monotonic()
            if left <= 0:
                status = f"timed out after {timeout_s:.0f}s with {exited} of {len(workers)} workers done"
                break
            try:
                ev = q.get(timeout=min(left, 5))
            except queue.Empty:
                continue
            if ev["event"] == "exit":
                exited += 1
                rcs[ev["worker"]] = ev["rc"]
                continue
            events.append(ev)
            trace.write(json.dumps(ev) + "\n")
            if ev["event"] == "start":
                started += 1
                if started == len(workers):  # every Manager up (heartbeating); no quorum yet
                    relay.send_signal(signal.SIGUSR1)
    except (RuntimeError, OSError) as exc:  # the relay or the Lighthouse did not start
        return dict(base, status=f"could not start: {exc}", logdir=logdir)
    finally:
        _stop(workers)
        _stop([p for p in procs if p not in workers])
        trace.close()
    done = [e for e in events if e["event"] == "done"]
    if len(done) != len(workers):
        tails = []
        for name, _ in names:
            text = open(os.path.join(logdir, f"{name}.log"), errors="replace").read()
            tails.append(f"{name} (exit {rcs.get(name)}): "
                         f"{text.strip().splitlines()[-1] if text.strip() else '(no stderr)'}")
        return dict(base, status=(status or f"{len(done)} of {len(workers)} workers finished") + "; " +
                    " | ".join(tails), logdir=logdir)
    text = open(relay_log).read()
    up = down = up0 = down0 = 0
    per_link = {}
    marks: dict[str, tuple[str, str]] = {}  # each link's first mark: when every worker had started
    for name, u, d in re.findall(r"^wanem (\S+): (\d+) bytes up, (\d+) bytes down so far$", text, re.M):
        marks.setdefault(name, (u, d))
    for u, d in marks.values():
        up0, down0 = up0 + int(u), down0 + int(d)
    for name, c, u, d in re.findall(r"^wanem (\S+): stopped .*?(\d+) connections, (\d+) bytes up, (\d+) bytes down$",
                                    text, re.M):
        up, down = up + int(u), down + int(d)
        per_link[name] = dict(connections=int(c), up=int(u), down=int(d))
    from _common import loss_curve  # here: the relay process (this file, --relay) needs none of it

    t0, curve, smooth = loss_curve(events)
    wall = max(e["t"] for e in done) - t0
    vals = [e["val_loss"] for e in done]
    errored = [e["errored"] for e in done if e.get("errored")]
    if errored:
        status = f"torchft reported errors (a sync was discarded): {errored[0][:300]}"
    elif not per_link:
        status = "the relay logged no byte counters: wan_bytes are missing"
    elif not done[0].get("final_params_synced"):
        status = f"steps ({steps}) is not a multiple of H ({H}): val_loss is on each worker's unsynchronised parameters"
    syncs = [e.get("syncs") or [] for e in done]
    later = [x for w in syncs for x in w[1:]]
    sync_s = dict(  # seconds in the optimizer step that syncs, mean over workers
        first=sum(w[0][0] for w in syncs if w) / max(1, sum(1 for w in syncs if w)),
        first_quorum=sum(w[0][1] for w in syncs if w) / max(1, sum(1 for w in syncs if w)),
        later=sum(x[0] for x in later) / len(later) if later else None,
        later_quorum=sum(x[1] for x in later) / len(later) if later else None)
    return dict(base, wall_s=wall, curve=curve, smoothed=smooth, final_train_loss=smooth[-1][1],
                sync_s=sync_s,
                val_loss=(sum(vals) / len(vals)) if None not in vals else None,
                outer_steps=max(e["outer_steps"] for e in done),
                wan_bytes=dict(up=up, down=down, start_up=up0 + down0, per_link=per_link),
                # per step, both directions of both regions' links, all workers together: after
                # start-up (the Managers' first heartbeats), and with it
                wan_bytes_per_step=(up + down - up0 - down0) / steps,
                wan_bytes_per_step_with_start_up=(up + down) / steps,
                status=status)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inner-steps", type=int, default=50, help="H: inner steps between outer syncs")
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--latency-ms", type=float, default=100.0, help="each region's link: round trip")
    p.add_argument("--bandwidth-mbit", type=float, default=100.0, help="each region's link: each way")
    p.add_argument("--wan", choices=sorted(WAN_SHAPES), default="via-root",
                   help="via-root: wan_loss.py's links (each region to the root); direct: one eu<->us link")
    p.add_argument("--logdir", default="", help="keep the logs here (default: a temporary folder)")
    p.add_argument("--timeout-s", type=float, default=1200.0)
    p.add_argument("--out", default="", help="also write the JSON here")
    # the relay (started by run_diloco)
    p.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-s", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.relay:
        return _relay_main(args)
    if args.logdir:
        result = run_diloco(args.inner_steps, args.steps, args.batch, args.latency_ms, args.bandwidth_mbit,
                            args.logdir, args.timeout_s, args.wan)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_diloco(args.inner_steps, args.steps, args.batch, args.latency_ms, args.bandwidth_mbit,
                                tmp, args.timeout_s, args.wan)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
