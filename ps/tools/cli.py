"""The ``hps`` command: serve | launch | status | job | checkpoint | promote | reshard | certs | demo.

    hps certs init certs/                      # a CA and a certificate per tier (and worker)
    hps serve --role zone --listen 0.0.0.0:7001 --parent region-eu:7000 --name eu-a \
              --tls-cert certs/eu-a.crt --tls-key certs/eu-a.key --tls-ca certs/ca.crt   # or --insecure
    hps launch deploy/topology.yaml
    hps status 127.0.0.1:7000
    hps status --launch-dir hps-demo/logs      # what hps launch supervises, then the tree
    hps job create lm --mode ssp --staleness 2 --optimizer adam --lr 3e-3 --address 127.0.0.1:7000
    hps job create lm --mode outer --inner-steps 50 --optimizer adamw --lr 3e-3 --outer-lr 0.7
    hps job create lm --optimizer adamw --lr 3e-4 --opt betas=0.9,0.95 --group '*.bias,*norm*:weight_decay=0' \
              --clip-grad-norm 1.0
    hps checkpoint export hps-demo/logs/checkpoints/lm --out model.pt --optimizer-out opt.pt
    hps demo

Every flag falls back to an ``HPS_*`` environment variable (``--member-timeout-s`` reads
``HPS_MEMBER_TIMEOUT_S``), which is how Kubernetes configures a pod.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
import time

__all__ = ["main"]


class _EnvDefault(argparse.Action):
    """argparse action whose default comes from HPS_<FLAG> when set."""

    def __init__(self, option_strings, dest, default=None, required=False, **kw):
        env = "HPS_" + dest.upper()
        if env in os.environ:
            default, required = os.environ[env], False
        kw["help"] = (kw.get("help") or "") + f" [env {env}]"
        super().__init__(option_strings, dest, default=default, required=required, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _EnvFlag(_EnvDefault):
    """A store_true flag whose default comes from HPS_<FLAG> ("1", "true", ...)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=kw.pop("default", False), **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


def _flag(value) -> bool:
    """A store_true flag or its HPS_* variable ("1", "true", "yes")."""
    return value is True or str(value).lower() in ("1", "true", "yes", "on")


def _tls_flags(s: argparse.ArgumentParser, who: str) -> None:
    s.add_argument("--tls-cert", action=_EnvDefault, default="", help=f"{who}'s certificate (PEM) for mutual TLS")
    s.add_argument("--tls-key", action=_EnvDefault, default="", help=f"{who}'s private key (PEM)")
    s.add_argument("--tls-ca", action=_EnvDefault, default="", help="the cluster's CA certificate (PEM)")


def _client_tls(args) -> None:
    """Clients of a secure cluster (status, job): the library reads HPS_TLS_* (ps.net.tls.TlsFiles.from_env)."""
    for k in ("cert", "key", "ca"):
        if getattr(args, f"tls_{k}", ""):
            os.environ[f"HPS_TLS_{k.upper()}"] = getattr(args, f"tls_{k}")


def _certs(args) -> int:
    from ps.core.errors import BadInput
    from ps.tools.certs import init_certs
    from ps.tools.launch import load_topology

    try:
        topo = load_topology(args.topology)
        workers = [w for w in args.workers.split(",") if w]
        hosts = tuple(h for h in args.hosts.split(",") if h)
        made = init_certs(args.dir, topo, workers=workers, hosts=hosts)
    except (BadInput, ValueError, OSError) as exc:
        print(f"hps certs: {exc}", file=sys.stderr)
        return 2
    print(f"CA {made[next(iter(made))].ca} (its key ca.key signs: keep it off the tiers)")
    for name, f in made.items():
        print(f"  {name}: {f.cert} {f.key}")
    return 0


def _serve(args) -> int:
    from ps.core.config import ServerConfig
    from ps.core.errors import BadInput
    from ps.server import serve

    try:
        cfg = ServerConfig(
            role=args.role, listen=args.listen, parent=args.parent or "", name=args.name or "",
            metrics_port=int(args.metrics_port), health_port=int(args.health_port), heartbeat_s=float(args.heartbeat_s),
            member_timeout_s=float(args.member_timeout_s), checkpoint_dir=args.checkpoint_dir or "",
            checkpoint_every=int(args.checkpoint_every), checkpoint_keep=int(args.checkpoint_keep),
            round_timeout_s=float(args.round_timeout_s),
            flush_ms=float(args.flush_ms), flush_bytes=int(args.flush_bytes), up_codec=args.up_codec or "",
            max_job_params=int(args.max_job_params), push_budget_mb=int(args.push_budget_mb),
            max_jobs=int(args.max_jobs), unjoined_job_ttl_s=float(args.unjoined_job_ttl_s),
            tls_cert=args.tls_cert or "", tls_key=args.tls_key or "", tls_ca=args.tls_ca or "",
            insecure=_flag(args.insecure),
            admin_token_file=args.admin_token_file or "",
            standby_of=args.standby_of or "", standby=args.standby or "", lease_s=float(args.lease_s),
            shard=args.shard or "")
        if cfg.admin_token_file:
            from ps.server.auth import read_token_file

            read_token_file(cfg.admin_token_file, "admin token")  # unreadable: say so before serving
    except (BadInput, ValueError) as exc:
        print(f"hps serve: {exc}", file=sys.stderr)
        return 2
    if not cfg.secure and not cfg.insecure:  # secure by default: plaintext only when asked for
        print("hps serve: give this tier its certificate (--tls-cert, --tls-key, --tls-ca; `hps certs init` "
              "makes them) or run it without TLS with --insecure (debugging only)", file=sys.stderr)
        return 2
    json_logs = args.log_format == "json"
    if json_logs:  # one JSON object per line, the ready line included (as event tier.started)
        from ps.core.logs import process_fields, use_json

        use_json(process_fields(cfg.role, cfg.display_name))
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    try:
        asyncio.run(serve(cfg, ready_stream=None if json_logs else sys.stdout))
    except OSError as exc:  # a port in use, a directory it may not write: a sentence, not a traceback
        print(f"hps serve: {exc}", file=sys.stderr)
        return 1
    return 0


# `hps launch` exit codes (also in its --help and the README).
LAUNCH_EXIT = {0: "stopped by SIGINT/SIGTERM/SIGHUP with every tier serving",
               2: "bad topology or flags",
               3: "a tier could not be started (nothing is left running)",
               4: "a tier could not be kept up (restarts given up on; the rest served until stopped)"}


class _Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP reached ``hps launch``."""


# What stops ``hps launch``: SIGHUP too (its terminal closed). The tiers run in sessions of their
# own, so they never get the terminal's signals: the launcher dying of one orphaned them all.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _raise_stop(*_) -> None:
    for sig in _STOP_SIGNALS:  # a second Ctrl-C must not cut the clean-up this starts short
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop


def _launch(args) -> int:
    from pathlib import Path

    from ps.core.errors import BadInput
    from ps.tools.launch import Cluster, load_topology
    from ps.tools.localsecrets import CLIENT_ENV, write_client_env
    from ps.tools.supervise import RestartPolicy, Supervisor

    try:
        policy = RestartPolicy(first_s=float(args.restart_backoff_s), max_s=float(args.restart_backoff_max_s),
                               max_restarts=int(args.max_restarts), window_s=float(args.restart_window_s),
                               ready_timeout_s=float(args.ready_timeout_s))
        topo = load_topology(args.topology)
    except (BadInput, ValueError) as exc:
        print(f"hps launch: {exc}", file=sys.stderr)
        return 2
    root = topo["root"] if isinstance(topo.get("root"), dict) else {}
    if not root.get("checkpoint_dir"):  # a restarted root restores its jobs from here
        root["checkpoint_dir"] = str(Path(args.logdir) / "checkpoints")
    if args.log_format == "json":  # the launcher's lines, and every tier's (HPS_LOG_FORMAT)
        from ps.core.logs import use_json

        use_json({"process": "launch"})
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _raise_stop)
    try:
        # stops what it started if this raises
        cluster = Cluster.start(topo, args.logdir, env={"HPS_LOG_FORMAT": args.log_format},
                                secure=not args.insecure, timeout_s=policy.ready_timeout_s)
    except _Stop:
        return 0
    except BadInput as exc:
        print(f"hps launch: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"hps launch: a tier could not be started: {exc}", file=sys.stderr)
        return 3
    sup = None
    try:
        sup = Supervisor(cluster, policy)
        for t in cluster.tiers.values():
            print(f"{t.role:9s} {t.name:8s} {t.address:22s} metrics {t.metrics_port}  log {t.log}")
        for t in cluster.links.values():  # emulated WAN links (latency_ms / bandwidth_mbit edges)
            print(f"{'link':9s} {t.name:8s} {t.address:22s} -> {t.parent}  log {t.log}")
        for name, group in cluster.shard_groups.items():  # a sharded root and its relays: what workers are given
            weights = ",".join(f"{w:g}" for w in cluster.shard_weights(name))
            role = cluster.tiers[group[0]].role
            what = (f"root {name} is {len(group)} shards" if role == "global" else
                    f"{role} {name} is {len(group)} relays, one per shard")
            print(f"{what}; its workers: HPS_ADDRESS='{cluster.address(name)}' HPS_SHARD_WEIGHTS={weights}")
        if cluster.secrets is not None:
            env_file = write_client_env(cluster)
            print(f"mutual TLS and tokens (throw-away CA in {cluster.secrets.directory}); clients: "
                  f"`set -a; . {env_file}; set +a` (HPS_TLS_*, HPS_ADMIN_TOKEN_FILE), or "
                  f"`hps status --launch-dir {cluster.logdir}`")
        else:
            # A secure run's file, left in this log directory, pointed `hps status --launch-dir`
            # and a client that sourced it at TLS this plaintext cluster does not speak.
            (cluster.logdir / CLIENT_ENV).unlink(missing_ok=True)
            print("INSECURE: plaintext, no client certificates, no tokens (--insecure)")
        print(f"cluster up; a tier that dies is restarted (at most {policy.max_restarts} times in "
              f"{policy.window_s:.0f}s); state in {cluster.logdir / 'launch.json'}; Ctrl-C stops it", flush=True)
        # From here a signal only asks to stop: raised mid-respawn it would orphan the new
        # process (and blocking signals instead would hand the mask down to it).
        stop: list[int] = []
        for sig in _STOP_SIGNALS:
            signal.signal(sig, lambda signum, _: stop.append(signum))
        while not stop and len(sup.failed) < len(sup.watch):  # all given up on: nothing to serve
            sup.poll()
            time.sleep(0.25)
    except _Stop:
        pass
    finally:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the graceful stop short
        cluster.stop()
        if sup is not None:
            sup.close()
    if sup is not None and sup.failed:
        print(f"hps launch: gave up on {', '.join(sup.failed)} (see {cluster.logdir / 'launch.json'})",
              file=sys.stderr)
        return 4
    return 0


def _status(args) -> int:
    from ps.tools.status import print_launch, print_tree

    if args.launch_dir:  # a secure local cluster: its client credentials, unless given
        from ps.tools.localsecrets import read_client_env

        for k, v in read_client_env(args.launch_dir).items():
            os.environ.setdefault(k, v)
    _client_tls(args)
    rc, address = 0, args.address
    if args.launch_dir:
        rc, root = print_launch(args.launch_dir, sys.stdout)
        address = address or root
    if not address:
        print("hps status: give a tier's HOST:PORT or --launch-dir", file=sys.stderr)
        return 2
    from ps.tools.jobctl import admin_token

    try:  # the admin's token shows every job and the tree; a job's (HPS_TOKEN) that job only
        token = admin_token() or os.environ.get("HPS_TOKEN") or None
    except ValueError as exc:
        print(f"hps status: {exc}", file=sys.stderr)
        return 2
    # A sharded root's shards (";"-separated, as HPS_ADDRESS names them): a tree each.
    trees = [print_tree(a, sys.stdout, token) for a in address.split(";") if a]
    return max(trees, default=0) or rc


_OPTION = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)")  # a comma that starts the next KEY=


def _option_value(key: str, text: str) -> bool | int | float | tuple[float, ...]:
    """An option's value as typed: true/false, an int, a float, or numbers separated by commas."""
    t = text.strip()
    try:
        if t.lower() in ("true", "false"):
            return t.lower() == "true"
        if "," in t:
            return tuple(float(x) for x in t.strip("()").split(","))
        try:
            return int(t)
        except ValueError:
            return float(t)
    except ValueError:
        raise ValueError(f"option {key}={text!r}: a value is a number, true/false, or numbers separated "
                         "by commas (betas=0.9,0.95)") from None


def _options(text: str, what: str) -> tuple[tuple[str, bool | int | float | tuple[float, ...]], ...]:
    """KEY=VALUE[,KEY=VALUE...] (a value may itself hold commas: betas=0.9,0.95)."""
    out = []
    for item in _OPTION.split(text):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{what} {text!r}: expected KEY=VALUE, got {item!r}")
        out.append((key.strip(), _option_value(key.strip(), value)))
    return tuple(out)


def _optimizer_config(args):
    """The job's OptimizerConfig from `hps job create`'s flags."""
    from ps.core.config import OptimizerConfig, ParamGroup

    options: list = []
    for o in args.opt or ():
        options += _options(o, "--opt")
    groups = []
    for g in args.group or ():
        patterns, colon, opts = g.partition(":")
        if not colon or not patterns.strip():
            raise ValueError(f"--group {g!r}: expected PATTERN[,PATTERN]:KEY=VALUE[,KEY=VALUE]")
        groups.append(ParamGroup(tuple(p.strip() for p in patterns.split(",")), _options(opts, "--group")))
    return OptimizerConfig(kind=args.optimizer, lr=float(args.lr), momentum=float(args.momentum),
                           warmup_steps=int(args.warmup_steps), options=tuple(options), groups=tuple(groups),
                           clip_grad_norm=float(args.clip_grad_norm))


def _outer_config(args):
    """--mode outer's settings (None for other modes)."""
    from ps.core.config import OptimizerConfig, OuterConfig

    if args.mode != "outer":
        return None
    momentum = float(args.outer_momentum)
    sgd = args.outer_optimizer.lower() == "sgd"
    return OuterConfig(inner_steps=int(args.inner_steps), fragments=int(args.fragments), codec=args.outer_codec,
                       delta_codec=args.outer_delta_codec, inner_tier=args.inner_tier, overlap=args.overlap,
                       asynchronous=args.asynchronous, nesterov_delay=int(args.nesterov_delay),
                       dynamic_steps=args.dynamic_steps, sync_wait_s=float(args.sync_wait_s),
                       optimizer=OptimizerConfig(kind=args.outer_optimizer, lr=float(args.outer_lr),
                                                 momentum=momentum if sgd else 0.0, nesterov=sgd and momentum > 0))


def _job(args) -> int:
    from ps.core.config import JobConfig
    from ps.core.errors import HpsError
    from ps.tools import jobctl

    _client_tls(args)
    try:
        admin = jobctl.admin_token()
        if args.action == "create":
            cfg = JobConfig(name=args.name, mode=args.mode, staleness=int(args.staleness),
                            damping=args.damping, push_codec=args.push_codec, delta_codec=args.delta_codec,
                            relay_codec=args.relay_codec, topk=float(args.topk),
                            topk_warmup_steps=int(args.topk_warmup_steps),
                            powersgd_rank=int(args.powersgd_rank),
                            momentum_correction=args.momentum_correction,
                            min_workers=int(args.min_workers), buffer_sync_every=int(args.buffer_sync_every),
                            optimizer=_optimizer_config(args), outer=_outer_config(args))
            created, job_token = jobctl.create(args.address, cfg, admin)
            print(f"job {args.name} {'declared' if created else 'already exists with this configuration'}; "
                  "its first worker brings the parameters")
            if job_token and args.token_file:
                from ps.server.auth import write_secret

                write_secret(args.token_file, job_token + "\n")
                print(f"its workers' token is in {args.token_file} (mode 0600; give it as HPS_TOKEN)")
            elif job_token:  # shown this once: the root keeps only its hash
                print(f"its workers' token (shown once; give it as HPS_TOKEN): {job_token}")
        elif args.action == "list":
            print(jobctl.format_jobs(jobctl.list_jobs(args.address, admin)))
        else:
            print(f"job {args.name} ended at version {jobctl.end(args.address, args.name, admin)}")
    except (HpsError, ValueError, OSError) as exc:
        print(f"hps job {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


def _promote(args) -> int:
    """Make a standby root the primary now (a planned switch-over, or a takeover the standby
    would not make by itself: it was not in sync, or the old primary still answers its Status)."""
    from ps.core.errors import HpsError
    from ps.net.messages import status_from_pb
    from ps.net.rpc import Caller
    from ps.net.tls import TlsFiles
    from ps.net.wire import pb
    from ps.tools import jobctl

    _client_tls(args)
    try:
        admin = jobctl.admin_token()
        with Caller(args.address, TlsFiles.from_env(), admin) as rpc:
            before = status_from_pb(rpc.call("Status", pb.StatusRequest(), 10.0))
            if before.role != "global":
                print(f"hps promote: {args.address} is a {before.role} tier; only a standby root can be promoted",
                      file=sys.stderr)
                return 2
            if before.root_state == "primary":
                print(f"{args.address} is the primary already (term {before.term}); nothing to do")
                return 0
            if before.root_state == "standby" and before.parent_reachable and not args.force:
                print(f"hps promote: {args.address} still follows a reachable primary ({before.parent}); "
                      "promoting it deposes that one (its pushes in flight are refused and retried). "
                      "Give --force to do it", file=sys.stderr)
                return 2
            term = rpc.call("Promote", pb.PromoteRequest(force=args.force), 30.0).term
    except (HpsError, ValueError, OSError) as exc:
        print(f"hps promote: {exc}", file=sys.stderr)
        return 2
    print(f"{args.address} is the primary root with term {term}; the old primary, if it comes back, finds "
          "the newer term and rejoins as its standby")
    return 0


def _checkpoint(args) -> int:
    from ps.core.errors import HpsError
    from ps.tools.export import export, export_shards

    try:
        if len(args.path) > 1:  # the shards of a sharded job, in shard order
            if args.no_wal:
                raise ValueError("--no-wal exports one root's checkpoint; a sharded job's shards are "
                                 "restored with their write-ahead logs (at one version)")
            made = export_shards(args.path, args.out, optimizer_out=args.optimizer_out or None, job=args.job or "")
        else:
            made = export(args.path[0], args.out, optimizer_out=args.optimizer_out or None, job=args.job or "",
                          replay=not args.no_wal)
    except (HpsError, ValueError, OSError) as exc:
        print(f"hps checkpoint export: {exc}", file=sys.stderr)
        return 2
    print(f"job {made.job} at version {made.version}"
          f"{' (checkpoint and write-ahead log)' if made.replayed else ' (checkpoint only)'}: {made.keys} keys to "
          f"{args.out}" + (f"; {made.optimizer} state to {args.optimizer_out}" if args.optimizer_out else ""))
    return 0


def _reshard(args) -> int:
    from ps.core.errors import HpsError
    from ps.tools.reshard import reshard_dirs

    try:
        weights = tuple(float(w) for w in args.weights.split(",")) if args.weights else None
        if len(args.targets) == 1:  # (export joins a job's shards through one: not a job to serve)
            raise ValueError("give two or more new shards' checkpoint directories (--to), in shard order: a "
                             "job on one root is not sharded (`hps checkpoint export` takes it off the shards)")
        r = reshard_dirs(args.sources, args.targets, args.job, weights, args.block_elems or None)
    except (HpsError, ValueError, OSError) as exc:
        print(f"hps reshard: {exc}", file=sys.stderr)
        return 2
    from ps.tools.format import human_bytes

    per = ", ".join(human_bytes(b) for b in r.bytes_per_shard)
    print(f"job {r.job} at version {r.version}: {r.shards_before} -> {r.shards_after} shards; {r.moved} of "
          f"{r.blocks} blocks moved ({r.moved / max(r.blocks, 1):.0%}); bytes per shard: {per}; "
          + ("the job's token carried" if r.token_carried else "no job token carried (none, or the old shards "
             "held different ones: its workers get a new one from the new shards)"))
    return 0


def _demo(args) -> int:
    from ps.demo.run import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hps", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run one tier")
    s.add_argument("--role", action=_EnvDefault, required=True, choices=["global", "regional", "zone"])
    s.add_argument("--listen", action=_EnvDefault, default="127.0.0.1:0", help="HOST:PORT to bind")
    s.add_argument("--parent", action=_EnvDefault,
                   help="parent HOST:PORT (relays); several, comma-separated, are alternates tried in order")
    s.add_argument("--name", action=_EnvDefault, help="tier name, e.g. eu-a")
    s.add_argument("--metrics-port", action=_EnvDefault, default="-1", help="/metrics port (-1 off, 0 any)")
    s.add_argument("--health-port", action=_EnvDefault, default="-1",
                   help="a second, plaintext gRPC port on --listen's host serving only grpc.health.v1.Health "
                   "(readiness: service ''; liveness: hps.liveness), for probes that cannot do TLS such as "
                   "kubelet's; no hps method is served there (-1 off, 0 any)")
    s.add_argument("--heartbeat-s", action=_EnvDefault, default="0.5", help="heartbeat interval")
    s.add_argument("--member-timeout-s", action=_EnvDefault, default="3.0", help="drop silent members after")
    s.add_argument("--checkpoint-dir", action=_EnvDefault, help="root: checkpoint directory")
    s.add_argument("--checkpoint-every", action=_EnvDefault, default="50", help="root: versions between checkpoints")
    s.add_argument("--checkpoint-keep", action=_EnvDefault, default="3",
                   help="root: checkpoints kept per job (the newest ones; at least 1)")
    s.add_argument("--standby-of", action=_EnvDefault, default="",
                   help="root: start as the hot standby of the primary root at HOST:PORT (it follows its "
                        "write-ahead log and takes over when the primary is gone for --lease-s)")
    s.add_argument("--standby", action=_EnvDefault, default="",
                   help="root: the HOST:PORT of this primary's standby; versions are acknowledged only once "
                        "it holds them")
    s.add_argument("--shard", action=_EnvDefault, default="",
                   help="root: I/N, this root is shard I of N and serves the blocks of sharded jobs the ring "
                        "places on it (the job's JobConfig.sharding gives the weights; workers list the N "
                        "shards' addresses separated by ';', in shard order)")
    s.add_argument("--lease-s", action=_EnvDefault, default="2.0",
                   help="root: seconds without its peer before a standby takes over or a primary refuses pushes")
    s.add_argument("--round-timeout-s", action=_EnvDefault, default="600", help="longest BSP barrier wait")
    s.add_argument("--flush-ms", action=_EnvDefault, default="5",
                   help="ssp/async: flush the aggregation window after this many ms")
    s.add_argument("--flush-bytes", action=_EnvDefault, default=str(64 * 1024 * 1024),
                   help="ssp/async: ... or once this many payload bytes are waiting")
    s.add_argument("--up-codec", action=_EnvDefault, default="",
                   help="relays: codec of this tier's upward edge, overriding the job's relay codec")
    s.add_argument("--max-job-params", action=_EnvDefault, default=str(1 << 31),
                   help="the largest job this tier holds, in float32 parameters (larger ones are refused)")
    s.add_argument("--push-budget-mb", action=_EnvDefault, default="2048",
                   help="memory for pushes being received at once; past it pushes wait (RESOURCE_EXHAUSTED)")
    s.add_argument("--max-jobs", action=_EnvDefault, default="1000", help="root: jobs held at once")
    s.add_argument("--unjoined-job-ttl-s", action=_EnvDefault, default="86400",
                   help="root: end a job no worker joined within this many seconds (0: never)")
    s.add_argument("--admin-token-file", action=_EnvDefault, default="",
                   help="file holding the admin token; without one the tier accepts every call "
                   "without a token (and says so in its log and `hps status`)")
    s.add_argument("--loop", action=_EnvDefault, default="asyncio", choices=["asyncio", "uvloop"],
                   help="event loop (benchmarks/bsp_step.py --loops compares them)")
    s.add_argument("--log-format", action=_EnvDefault, default="text", choices=["text", "json"],
                   help="json: one JSON object per line (ts, level, logger, message, tier, region/zone, "
                   "name, and event, job, version where known) for a log pipeline")
    _tls_flags(s, "this tier")
    s.add_argument("--insecure", action=_EnvFlag,
                   help="serve plaintext gRPC with no client certificates (debugging only; logged and "
                   "shown by hps status)")
    s.set_defaults(fn=_serve)

    s = sub.add_parser("launch", help="start a local cluster from a topology and keep it serving",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Start one `hps serve` process per tier and supervise them: a tier "
                       "that exits is logged\n(name, role, exit status or signal, log file) and "
                       "restarted on its port with exponential\nbackoff; one restarted --max-restarts "
                       "times within --restart-window-s is given up on and\nreported while the rest "
                       "keeps serving. The root checkpoints to LOGDIR/checkpoints unless the\ntopology "
                       "names its checkpoint_dir, so a restarted root restores its jobs. The state\n"
                       "(each tier's pid, state, restarts, last exit) is in LOGDIR/launch.json: "
                       "`hps status --launch-dir LOGDIR`.",
                       epilog="exit codes:\n" + "\n".join(f"  {k}  {v}" for k, v in LAUNCH_EXIT.items()))
    s.add_argument("topology", nargs="?", help="topology YAML (default: the embedded one)")
    s.add_argument("--logdir", action=_EnvDefault, default="hps-demo/logs",
                   help="tier logs, launch.json and (by default) the root's checkpoints")
    s.add_argument("--max-restarts", action=_EnvDefault, default="5",
                   help="restarts of one tier within --restart-window-s before giving up on it (0: never restart)")
    s.add_argument("--restart-window-s", action=_EnvDefault, default="300", help="see --max-restarts")
    s.add_argument("--restart-backoff-s", action=_EnvDefault, default="1.0",
                   help="delay before the first restart; doubles per recent restart")
    s.add_argument("--restart-backoff-max-s", action=_EnvDefault, default="30", help="longest restart delay")
    s.add_argument("--ready-timeout-s", action=_EnvDefault, default="300",
                   help="how long a tier may take to print its ready line, at start and after a restart (a "
                   "root restores every job's checkpoint and log first)")
    s.add_argument("--log-format", action=_EnvDefault, default="text", choices=["text", "json"],
                   help="json: one JSON object per line (ts, level, logger, message, tier, region/zone, "
                   "name, and event, job, version where known) for a log pipeline; also given to every tier")
    s.add_argument("--insecure", action="store_true",
                   help="plaintext and no tokens (debugging only; every tier says so). By default the "
                   "cluster runs mutual TLS with a throw-away CA and an admin token under LOGDIR/secrets, "
                   "and LOGDIR/client.env holds what a client needs (source it)")
    s.set_defaults(fn=_launch)

    s = sub.add_parser("status", help="show the tree, versions, lag and members")
    s.add_argument("address", nargs="?", help="any tier's HOST:PORT (the root shows the whole tree; "
                   "default with --launch-dir: its root)")
    s.add_argument("--launch-dir", action=_EnvDefault, default="",
                   help="an `hps launch --logdir`: show its supervision state first (launch.json)")
    _tls_flags(s, "the caller")
    s.set_defaults(fn=_status)

    s = sub.add_parser("certs", help="create a CA and per-tier certificates for a topology")
    s.add_argument("action", choices=["init"])
    s.add_argument("dir", help="where ca.crt, ca.key and NAME.crt/NAME.key go (an existing CA is kept)")
    s.add_argument("--topology", help="topology YAML (default: the embedded one)")
    s.add_argument("--workers", default="worker", help="comma-separated worker certificate names")
    s.add_argument("--hosts", default="", help="comma-separated extra DNS names / IPs for the tier certificates")
    s.set_defaults(fn=_certs)

    s = sub.add_parser("job", help="create, list or end jobs (through any tier)",
                       epilog="The admin token comes from HPS_ADMIN_TOKEN or the file HPS_ADMIN_TOKEN_FILE "
                       "names; `create` prints the job's token once (or writes it to --token-file).")
    s.add_argument("action", choices=["create", "list", "end"])
    s.add_argument("name", nargs="?", help="job name (create, end)")
    s.add_argument("--address", action=_EnvDefault, default="127.0.0.1:7000", help="any tier's HOST:PORT")
    s.add_argument("--mode", default="bsp", choices=["bsp", "ssp", "async", "outer"],
                   help="outer: bsp inside each region at its regional master (--optimizer is the inner one), "
                   "outer steps across the WAN every --inner-steps")
    s.add_argument("--staleness", default="0", help="s for --mode ssp")
    s.add_argument("--damping", action="store_true",
                   help="ssp, async and --mode outer --asynchronous: lr / (1 + staleness)")
    s.add_argument("--inner-steps", default="50", help="--mode outer: H, inner steps between a fragment's syncs")
    s.add_argument("--fragments", default="1",
                   help="--mode outer: parameter fragments synced in turn, one every H // F steps")
    s.add_argument("--outer-codec", default="int8", help="--mode outer: the pseudo-gradients' codec (up the WAN)")
    s.add_argument("--outer-delta-codec", default="int8", help="--mode outer: the outer versions' codec (down)")
    s.add_argument("--outer-optimizer", default="sgd", help="--mode outer: the root's outer optimizer class")
    s.add_argument("--outer-lr", default="0.7", help="--mode outer: the outer learning rate")
    s.add_argument("--outer-momentum", default="0.9", help="--mode outer: outer momentum (nesterov when sgd)")
    s.add_argument("--inner-tier", default="regional", choices=["regional", "zone"],
                   help="--mode outer: the tier running each region's inner loop")
    s.add_argument("--overlap", action="store_true",
                   help="--mode outer: a region trains on while a fragment's sync is in flight")
    s.add_argument("--asynchronous", action="store_true",
                   help="--mode outer: regions do not wait for each other; the root applies each region's "
                   "pseudo-gradient as it arrives, at its share of the workers")
    s.add_argument("--nesterov-delay", default="0",
                   help="--mode outer --asynchronous: delayed Nesterov, the outer momentum moves once every this "
                   "many region updates (the number of regions; 0: at every update)")
    s.add_argument("--dynamic-steps", action="store_true",
                   help="--mode outer --asynchronous: each region's inner steps per sync follow its speed "
                   "(--inner-steps is the fastest region's)")
    s.add_argument("--sync-wait-s", default="0",
                   help="--mode outer: seconds a region waits for a sync before it trains on without it (the "
                   "root or the WAN down: the sync is retried and merged when it lands); 0: it waits")
    s.add_argument("--optimizer", default="sgd",
                   help="the root's optimizer: any torch.optim class by name, any case (sgd, adam, adamw, "
                   "rmsprop, adagrad, adadelta, adamax, nadam, radam, asgd, rprop, ...; not lbfgs nor "
                   "sparseadam). Unset options keep torch's defaults")
    s.add_argument("--lr", default="0.01", help="learning rate (every class gets it)")
    s.add_argument("--momentum", default="0.0", help="momentum, for classes that take it (sgd, rmsprop)")
    s.add_argument("--warmup-steps", default="0",
                   help="linear lr warm-up over these steps (for groups whose workers send no lr of their own)")
    s.add_argument("--opt", action="append", metavar="KEY=VALUE",
                   help="a keyword argument of the optimizer's class (repeatable): --opt amsgrad=true "
                   "--opt betas=0.9,0.95 --opt weight_decay=0.05; checked against torch when the job is created")
    s.add_argument("--group", action="append", metavar="PATTERN[,PATTERN]:KEY=VALUE[,KEY=VALUE]",
                   help="a param group (repeatable, in order): the parameters whose names match a pattern "
                   "(fnmatch, first group wins) take these options, e.g. '*.bias,*norm*:weight_decay=0'; "
                   "the rest form group 0")
    s.add_argument("--clip-grad-norm", default="0",
                   help="> 0: the root clips the averaged gradient's global L2 norm to this, as "
                   "torch.nn.utils.clip_grad_norm_ would on one process (workers must not clip too); 0: off")
    s.add_argument("--min-workers", default="0",
                   help="workers the job waits for before its first step (each worker's HpsOptimizer waits "
                   "until that many hold ranks); the world size workers see is at least this")
    s.add_argument("--buffer-sync-every", default="1",
                   help="average module buffers (BatchNorm statistics) across workers every N steps; 0: never "
                   "(each worker keeps its own, as DDP with broadcast_buffers=False)")
    s.add_argument("--push-codec", default="fp32", help="workers' codec: fp32, fp32+zstd, fp16, bf16, "
                   "int8, topk, sign, rows, powersgd (lossy ones run with error feedback)")
    s.add_argument("--relay-codec", default="", help="relays' codec for aggregates (default: the push codec)")
    s.add_argument("--delta-codec", default="fp32", help="the root's codec for published-view deltas")
    s.add_argument("--topk", default="0.01", help="density of the topk codec (fraction of elements)")
    s.add_argument("--topk-warmup-steps", default="0", help="DGC warm-up: density 25%% down to --topk")
    s.add_argument("--powersgd-rank", default="4",
                   help="rank of the powersgd codec's factors (1-64); keys of >= 2 dimensions too small to "
                   "gain 2x travel as fp32")
    s.add_argument("--momentum-correction", action="store_true",
                   help="DGC: workers keep the sgd momentum and sparsify the velocity (topk, sgd momentum)")
    _tls_flags(s, "the caller")
    s.add_argument("--token-file", default="",
                   help="create: write the job's token here (mode 0600) instead of printing it")
    s.set_defaults(fn=_job)

    s = sub.add_parser("promote", help="make a standby root the primary now (admin)",
                       epilog="The admin token comes from HPS_ADMIN_TOKEN or the file HPS_ADMIN_TOKEN_FILE names. "
                       "A standby takes over by itself once its primary has been gone for --lease-s; this is for a "
                       "planned switch-over, or a standby that will not (deploy/OPERATING.md).")
    s.add_argument("address", help="the standby root's HOST:PORT")
    s.add_argument("--force", action="store_true",
                   help="promote even though the standby still reaches its primary (a planned switch-over: the "
                   "old primary refuses pushes from then on and rejoins as the new one's standby), or is not in "
                   "sync with it (only when the primary's volume is lost: it may hold less than was acknowledged)")
    _tls_flags(s, "the caller")
    s.set_defaults(fn=_promote)

    s = sub.add_parser("checkpoint", help="export a job's checkpoint as torch files",
                       description="Write a job's newest root checkpoint as a model state_dict (torch.save; "
                       "every key, from the published view workers load) and, with --optimizer-out, the "
                       "optimizer's state dict in torch's shape (load it into the job's torch.optim class built "
                       "over the model's trained parameters, in the job's param groups). The root's write-ahead "
                       "log is replayed onto the checkpoint in a temporary copy (the root's files are only "
                       "read), so versions acknowledged after the checkpoint are included; --no-wal exports "
                       "the checkpoint alone (versions after it are missing).")
    s.add_argument("action", choices=["export"])
    s.add_argument("path", nargs="+", help="a job's checkpoint directory (CHECKPOINT_DIR/JOB), or the root's "
                   "--checkpoint-dir with --job (or holding one job); a sharded job: every shard's, in shard "
                   "order (each restored with its write-ahead log; all at one version: stopped shards)")
    s.add_argument("--job", default="", help="the job, when PATH is the root's checkpoint directory")
    s.add_argument("--out", required=True, help="the model state_dict file to write")
    s.add_argument("--optimizer-out", default="", help="the optimizer state_dict file to write")
    s.add_argument("--no-wal", action="store_true", help="the checkpoint alone, without replaying the log")
    s.set_defaults(fn=_checkpoint)

    s = sub.add_parser("reshard", help="spread a stopped sharded job over other root shards",
                       description="Restore a sharded job from each old shard's checkpoint directory "
                       "(checkpoint plus write-ahead log, in a temporary copy) and write a checkpoint for each "
                       "new shard: the blocks are placed on the new ring, parameters and optimizer state carried "
                       "bit for bit, and only the blocks the ring moves change owner. Every old shard must have "
                       "stopped at the same version (SIGTERM writes a checkpoint). Start new shard i with "
                       "--shard i/N --checkpoint-dir TARGET_i.")
    s.add_argument("--job", required=True, help="the job to reshard")
    s.add_argument("--from", dest="sources", nargs="+", required=True,
                   help="the old shards' --checkpoint-dir, in shard order")
    s.add_argument("--to", dest="targets", nargs="+", required=True,
                   help="the new shards' --checkpoint-dir (empty for this job), in shard order")
    s.add_argument("--weights", default="", help="comma-separated, one per new shard (default: equal)")
    s.add_argument("--block-elems", type=int, default=0, help="block size in elements (default: the job's)")
    s.set_defaults(fn=_reshard)

    s = sub.add_parser("demo", help="train a small transformer LM on a local cluster")
    s.add_argument("--steps", type=int, default=int(os.environ.get("HPS_DEMO_STEPS", "150")))
    s.add_argument("--workers", type=int, default=4, help="worker processes (spread over the zones)")
    s.add_argument("--batch", type=int, default=16, help="sequences per worker per step")
    s.add_argument("--out", default="hps-demo", help="where the plot, summary and logs go")
    s.add_argument("--topology", help="topology YAML (default: the embedded one)")
    s.add_argument("--mode", default="bsp", choices=["bsp", "ssp", "async", "outer"],
                   help="consistency model (outer: bsp inside each region, outer steps across the WAN)")
    s.add_argument("--staleness", type=int, default=2, help="s for --mode ssp")
    s.add_argument("--inner-steps", type=int, default=10, help="--mode outer: inner steps between syncs")
    s.add_argument("--codec", default="fp32", help="push codec of workers and relays, e.g. topk")
    s.add_argument("--topk", type=float, default=0.01, help="density of --codec topk")
    s.add_argument("--delta-codec", default="fp32",
                   help="the root's codec for published deltas (fp16, int8: lossy, error kept at the root)")
    s.add_argument("--slow", type=float, default=1.0,
                   help="make the last worker this many times slower (e.g. 2), to see the modes differ")
    s.add_argument("--insecure", action="store_true",
                   help="plaintext and no tokens (debugging only); by default the demo's cluster runs "
                   "mutual TLS with a throw-away CA and tokens under OUT/logs/secrets")
    s.add_argument("--damping", action="store_true",
                   help="ssp/async: the root scales each update's lr by 1/(1+staleness)")
    s.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("HPS_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "action", None) in ("create", "end") and not args.name:
        parser.error(f"hps job {args.action} needs a job name")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
