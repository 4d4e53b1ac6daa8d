"""``hps status ADDR``: the tree below a tier, with versions, lag, members and bytes.

>>> import sys
>>> print_tree(address, sys.stdout)     # a tier a line, then a paragraph per job; 0: all answered
global root @ 127.0.0.1:... epoch 0x... up ...s, ready...
0
>>> fetch_status(address).role, fetch_ready(address)
('global', 'ready')

Relays register with the address they serve on, so starting at the root walks the whole tree.
A relay its parent dropped after the member timeout (a region killed and not restarted) is
still listed, from the job's lost members: shown DOWN when it does not answer. The exit code
is 1 when a tier is down or unreachable, or a relay is cut off from its parent (its lag is
then unknown, not 0).

``hps status --launch-dir LOGDIR`` first prints what the ``hps launch`` that wrote
``LOGDIR/launch.json`` knows (``ps.tools.supervise``): each tier's process, its state (up,
restarting, starting, failed), its restarts and last exit; then the tree from its root.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps.core.errors import HpsError
from ps.core.types import TierStatus
from ps.net.messages import status_from_pb
from ps.net.rpc import CHANNEL_OPTIONS, Caller
from ps.net.tls import ClientTls, TlsFiles, client_options
from ps.net.wire import pb
from ps.tools.format import human_bytes

__all__ = ["fetch_status", "fetch_ready", "print_tree", "print_launch", "read_state", "walk", "STATE_FILE"]

STATE_FILE = "launch.json"  # written by ps.tools.supervise into hps launch's log directory


def read_state(launch_dir: str | Path) -> dict:
    """The state a running (or finished) ``hps launch`` wrote into its log directory."""
    return json.loads((Path(launch_dir) / STATE_FILE).read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def print_launch(launch_dir: str | Path, out) -> tuple[int, str]:
    """Print the supervision state of ``hps launch``; returns (1 if a tier is not serving or the
    launch is gone, else 0; the root's address, or its shards' joined by ";")."""
    try:
        st = read_state(launch_dir)
    except (OSError, ValueError) as exc:
        print(f"launch {launch_dir}: no state ({exc})", file=out)
        return 1, ""
    alive = not st.get("stopped") and _alive(st["pid"])
    how = ("running" if alive else "stopped" if st.get("stopped")
           else "NOT RUNNING (killed? its tiers may still run unsupervised)")
    p = st["policy"]
    print(f"launch pid {st['pid']} {how}, up {time.time() - st['started_at']:.0f}s; restarts after "
          f"{p['first_s']:g}s doubling to {p['max_s']:g}s, at most {p['max_restarts']} per {p['window_s']:g}s",
          file=out)
    rc, roots = (0 if alive else 1), []
    for name, t in st["tiers"].items():
        last = ""
        if t["last_exit"]:
            last = f"; last exit {t['last_exit']} {time.time() - t['last_exit_at']:.0f}s ago"
        state = t["state"] if t["state"] == "up" else t["state"].upper()
        print(f"  {t['role']:9s} {name:8s} {t['address']:22s} pid {t['pid']:<7d} {state}, "
              f"{t['restarts']} restart(s){last}; log {t['log']}", file=out)
        rc = rc or int(t["state"] != "up")
        if t["role"] == "global":
            roots.append(t["address"])
    return rc, ";".join(_primaries(roots))


def _primaries(roots: list[str]) -> list[str]:
    """Of a launch's global tiers (the root, then its standby, or shards, each perhaps with a
    standby), the ones to walk the tree from: each primary (after a takeover, the standby
    listed second; every shard of a sharded root: each has a tree of its own), else the first.
    Asked with the admin's token, if the environment names one."""
    if len(roots) < 2:
        return roots
    try:
        from ps.tools.jobctl import admin_token
        token = admin_token()
    except (OSError, ValueError):
        token = None
    found = []
    for address in roots:
        try:
            if fetch_status(address, 2.0, token).root_state == "primary":
                found.append(address)
        except Exception:  # (down, refused): another may answer
            continue
    return found or roots[:1]


def fetch_status(address: str, timeout_s: float = 5.0, token: str | None = None) -> TierStatus:
    """A tier's Status; over mutual TLS when ``HPS_TLS_CERT/KEY/CA`` are set (``hps status --tls-*``).
    ``token``: the admin's (every job and the tree) or a job's (that job only)."""
    with Caller(address, TlsFiles.from_env(), token) as rpc:
        return status_from_pb(rpc.call("Status", pb.StatusRequest(), timeout_s))


def fetch_ready(address: str, timeout_s: float = 5.0) -> str:
    """What the tier's readiness probe would see: "ready", "NOT READY" or "ready ?" (no answer)."""
    tls = TlsFiles.from_env()
    if tls is None:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        ch = grpc.secure_channel(address, ClientTls(tls).credentials(), options=CHANNEL_OPTIONS + client_options())
    with ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return "ready ?"
    return "ready" if r.status == health_pb2.HealthCheckResponse.SERVING else "NOT READY"


def walk(address: str, depth: int = 0, seen: set | None = None, token: str | None = None, lost=None):
    """Yield (depth, address, StatusReply or error, lost) for a tier and every relay below it;
    ``lost`` is the MemberInfo of a relay its parent dropped (None for the others)."""
    seen = seen if seen is not None else set()
    if address in seen or depth > 8:
        return
    seen.add(address)
    try:
        st = fetch_status(address, token=token)
    except HpsError as exc:
        yield depth, address, exc, lost
        return
    yield depth, address, st, lost
    # Relays only: a worker's registration names any address it likes, and walking it sent the
    # admin token there (a job token's holder could collect it).
    children = ({m.address for m in st.children} |
                {m.address for j in st.jobs for m in j.members if m.address and m.role != "worker"})
    dropped = {m.address: m for j in st.jobs for m in j.lost
               if m.address and m.role != "worker" and m.address not in children}
    for child in sorted(children | set(dropped)):
        yield from walk(child, depth + 1, seen, token, dropped.get(child))


def print_tree(address: str, out, token: str | None = None) -> int:
    rc = 0
    for depth, addr, st, lost in walk(address, token=token):
        pad = "  " * depth
        if isinstance(st, Exception):
            if lost is not None:  # a relay its parent dropped: a region (or zone) that is down
                # (last_seen_s counts from the drop, a member timeout after it fell silent)
                print(f"{pad}{lost.role} {lost.member} @ {addr}: DOWN, dropped from its parent's jobs "
                      f"{lost.last_seen_s:.0f}s ago; unreachable ({st})", file=out)
            else:
                print(f"{pad}{addr}: unreachable ({st})", file=out)
            rc = 1
            continue
        parent = "" if not st.parent else f" parent {st.parent} ({'up' if st.parent_reachable else 'UNREACHABLE'})"
        if len(st.parents) > 1:
            parent += (f", alternate {st.parents.index(st.parent) + 1} of {len(st.parents)}"
                       if st.parent in st.parents else "") + f", {st.parent_switches} switch(es)"
        cut_off = bool(st.parent) and (not st.parent_reachable or st.parent_cut_off_s > 0)
        if cut_off:
            # (a standby root keeps no parent link's clock: no time to show)
            parent += ", CUT OFF" + ("" if st.root_state else f" for {st.parent_cut_off_s:.1f}s")
            rc = 1
        if lost is not None:
            parent += f"; its parent dropped it {lost.last_seen_s:.0f}s ago"
            rc = 1
        root = f", {st.root_state} (term {st.term})" if st.root_state else ""  # a root of a standby pair
        print(f"{pad}{st.role} {st.name} @ {addr}{root} epoch {st.server_epoch:#x} "
              f"up {st.uptime_s:.0f}s, {fetch_ready(addr)}{parent}"
              f"{', INSECURE (plaintext, no client certificates)' if st.insecure else ''}", file=out)
        if not st.tokens_required:
            print(f"{pad}  OPEN: no admin token set; this tier accepts every call without a token", file=out)
        for j in st.jobs:
            workers = [m for m in j.members if m.role == "worker"]
            s = j.stats
            lag = ("following its primary's log" if st.root_state == "standby" else
                   f"lag unknown (cut off from its parent; last in sync {j.lag_s:.1f}s ago)" if cut_off
                   else f"lag {j.lag_versions} versions / {j.lag_s:.1f}s")
            print(f"{pad}  job {j.name}: version {j.version} (checksum {j.checksum:#018x}) {lag}, "
                  f"round {j.round} ({j.round_pushed}/{len(j.members)} pushed), "
                  f"members {len(j.members)} ({len(workers)} workers)", file=out)
            if s.shard:  # a root shard: its part of the job, and the load it carries
                print(f"{pad}    shard {s.shard}: {s.shard_blocks} blocks, {human_bytes(s.shard_bytes)}; "
                      f"{s.pushes} pushes in, {human_bytes(s.bytes_pushed_in)} received, "
                      f"{human_bytes(s.bytes_pulled_out)} served", file=out)
            if j.inner_loop:  # an outer job whose region's inner loop runs here: its WAN side
                mean = s.outer_sync_seconds_sum / s.outer_syncs if s.outer_syncs else 0.0
                per = human_bytes(s.outer_bytes_up // s.outer_syncs) if s.outer_syncs else "-"
                lost = f"; INNER STEPS LOST {s.inner_steps_lost}" if s.inner_steps_lost else ""
                if s.outer_syncs_postponed:
                    lost += f"; {s.outer_syncs_postponed} syncs not landed in time (trained on without them)"
                if s.outer_syncs_unsettled:
                    lost += f"; {s.outer_syncs_unsettled} syncs given up on unanswered (asked the root about them)"
                print(f"{pad}    outer: version {s.outer_version}, {s.outer_syncs} syncs ({s.outer_sync_failures} "
                      f"failed), {mean:.2f}s each, every {s.inner_steps_per_sync} inner steps; "
                      f"{s.inner_steps_since_sync} since the last; "
                      f"pseudo-gradient norm {s.pseudo_grad_norm:.3g}; WAN up {human_bytes(s.outer_bytes_up)} "
                      f"({per} per sync), down {human_bytes(s.outer_bytes_down)}{lost}", file=out)
            if j.mode not in ("bsp", "outer") or s.staleness_count:
                mean = s.staleness_sum / s.staleness_count if s.staleness_count else 0.0
                print(f"{pad}    {j.mode}: clock floor {j.clock_min}, staleness mean {mean:.2f} max "
                      f"{s.staleness_max} over {s.staleness_count} applied pushes", file=out)
            if s.loss_count:
                print(f"{pad}    workers report: loss {s.loss_sum / s.loss_count:.4f} (mean of {s.loss_count} "
                      f"steps), step {1000 * s.step_seconds_sum / s.loss_count:.0f} ms", file=out)
            waited = s.round_wait_ms_sum / 1000.0
            if waited:
                print(f"{pad}    pushes waited {waited:.1f}s in total at this tier for their "
                      "acknowledgement (barrier / window)", file=out)
            print(f"{pad}    bytes: push in {human_bytes(s.bytes_pushed_in)}, up {human_bytes(s.bytes_pushed_up)}; "
                  f"pull in {human_bytes(s.bytes_pulled_in)}, out {human_bytes(s.bytes_pulled_out)}; "
                  f"snapshots {s.snapshots_served}, deltas {s.deltas_served}", file=out)
            faults = {"members left": s.members_left, "timed out": s.members_expired,
                      "restarted": s.members_replaced, "rounds restarted": s.restarted_rounds,
                      "rounds refused": s.refused_rounds, "retries answered": s.duplicates,
                      "retries resolved": s.resolved, "durable writes failed": s.durable_failures,
                      "checkpoints failed": s.checkpoint_failures, "PUSHES APPLIED TWICE": s.double_applied}
            shown = ", ".join(f"{k} {v}" for k, v in faults.items() if v)
            if shown:
                print(f"{pad}    faults: {shown}", file=out)
            for m in workers:
                print(f"{pad}    worker {m.member}: {m.pushes} pushes, seen {m.last_seen_s:.1f}s ago", file=out)
    return rc
