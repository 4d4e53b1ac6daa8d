"""Start a whole local cluster from a topology, and stop it by PID.

>>> import tempfile
>>> topology = {"root": {"name": "root", "zones": [{"name": "eu-a"}]}}   # or load_topology(path)
>>> with Cluster.start(topology, logdir=tempfile.mkdtemp()) as cluster:   # stopped on exit
...     print(sorted(cluster.tiers), cluster.address("eu-a"))
['eu-a', 'root'] 127.0.0.1:...

Each tier is one ``hps serve`` process. Tiers bind port 0 unless the topology names a port;
launch reads each tier's ready line (``hps: serving ... on HOST:PORT``) from its log to learn
the port, then starts its children pointed at it. Every process started is stopped by its
PID: SIGTERM (graceful: final checkpoint, leave parent), then SIGKILL after a grace period.

Emulated WAN links (``ps/tools/wanem.py``). A region or zone entry may declare the link to its
parent, and a top-level ``links`` list may put a link in front of any tier for clients:

    regions:
      - {name: eu, latency_ms: 100, bandwidth_mbit: 100, zones: [...]}   # eu <-> root
    links:
      - {name: eu-wan, to: root, latency_ms: 100, bandwidth_mbit: 100}   # workers -> root

A zone may list ``alternates: [region, ...]``: regional masters it moves to, in order, when its
own is gone (``--parent OWN,ALT,...``; issue 15). The root may have a hot standby
(``root: {name: root, checkpoint_dir: A, standby: {name: root-b, checkpoint_dir: B}}``): it starts
with ``--standby-of`` the root, and the tiers below the root list both (``--parent ROOT,STANDBY``).
The root itself starts without ``--standby`` (the standby's port is not known yet; the root learns
its address from the Follow stream); a restarted root gets ``--standby STANDBY``, so it finds a
standby that took over meanwhile and rejoins as its standby.

Root shards (issue 16): ``root: {name: root, shards: 3}`` or ``shards: [{weight: 2}, {weight: 1},
{weight: 1}]`` (each entry may also give ``port``, ``metrics_port``, ``checkpoint_dir``) starts
tiers ``root-0`` .. ``root-2``, each ``hps serve --shard I/N`` with its own checkpoint directory
(the root's ``checkpoint_dir``/shard-I unless it names one). ``cluster.address("root")`` is
every shard's address in shard order, separated by ``;`` (a worker's HPS_ADDRESS), and
``cluster.shard_weights("root")`` the weights (HPS_SHARD_WEIGHTS: what a job created there
without a sharding of its own is placed by). Relays below a sharded root form one tree per
shard: zone ``eu-a`` (below the root or below region ``eu``) starts as ``eu-a-0`` .. ``eu-a-2``,
relay ``eu-a-I`` below shard I (or below ``eu-I``, region ``eu``'s relay for shard I), each
with its own edge link when the entry declares one; ``cluster.address("eu-a")`` is the zone's
relays in shard order, its workers' HPS_ADDRESS. A relay carries only its shard's blocks; the
workers cut pushes and join pulls. A sharded root's ``standby`` entry gives every shard a hot
standby, ``NAME-I`` (``--shard I/N --standby-of`` shard I, its checkpoint directory the
standby's ``checkpoint_dir``/shard-I): the relays below shard I list it second, and the
root's address lists each pair (``A0,B0;A1,B1``). A sharded root with declared links
(``links:``) or zones with ``alternates`` is refused with a sentence.

``latency_ms`` is the round trip the link adds, ``bandwidth_mbit`` each direction's rate
(also ``jitter_ms``, ``loss_pct``). Each declared link is one ``python -m ps.tools.wanem`` process
(a delaying, rate-limiting TCP relay; this machine has no ``tc netem``); the child's
``--parent`` points at it, and ``cluster.address("eu-wan")`` is where a worker connects to
cross that link. Links live in ``cluster.links`` and are stopped after every tier.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO

import yaml

from ps.core.config import MAX_SHARDS
from ps.core.errors import BadInput
from ps.tiers import checkpoint
from ps.tools.localsecrets import LocalSecrets
from ps.tools.wanem import Link

__all__ = ["Cluster", "TierProcess", "load_topology", "default_topology", "MALLOC_ENV", "shard_specs"]

# The address stops at a quote too: with --log-format json the line is a JSON message.
_READY = re.compile(r"hps: serving (\S+) (\S+) on ([^\s\"]+)(?: metrics (\d+))?")
# glibc serves every allocation of >= 32 MiB (the most M_MMAP_THRESHOLD can be raised to) with
# its own mmap and unmaps it on free, so a server that assembles a large model faults every
# page in again on every message: measured 1.7-2.5x slower pushes of a 100 MB model
# (benchmarks/dataplane.py). Without mmap, freed memory stays in the heap for the next message.
# Given to every server process unless the environment already sets them.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(64 << 20)}

# The launcher's own HPS_* variables that its tiers may inherit. Every `hps serve` flag reads
# HPS_<FLAG> as its default, so a shell that had sourced a client's env file (HPS_TLS_*, which
# `hps launch` itself tells users to do) made every tier of `hps launch --insecure` refuse to
# start; the topology's settings are how a launch configures its tiers.
_PASSED_ON = frozenset({"HPS_LOG_FORMAT", "HPS_LOG_LEVEL"})


def _inherited(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith("HPS_") or k in _PASSED_ON}
_LINK_READY = re.compile(r"wanem(?: \S+)?: relaying (\S+) -> ")


def shard_specs(root: dict) -> list[dict]:
    """A sharded root's entries, one per shard (``shards: N`` or a list); [] for one root."""
    shards = root.get("shards")
    if shards is None:
        return []
    if isinstance(shards, bool) or not isinstance(shards, (int, list)):
        raise BadInput(f"root shards is a count or a list of {{weight: W}} entries, got {shards!r}")
    specs = [{} for _ in range(shards)] if isinstance(shards, int) else shards
    if not 2 <= len(specs) <= MAX_SHARDS or not all(isinstance(s, dict) for s in specs):
        raise BadInput(f"root shards: 2 to {MAX_SHARDS} shards, each a mapping, got {shards!r}")
    for s in specs:
        weight = s.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise BadInput(f"root shard weights are positive numbers, got {weight!r}")
    return [dict(s) for s in specs]


def check_ports(topo: dict) -> None:
    """BadInput, before anything starts, when two processes of ``topo`` would take one fixed port
    (a service or metrics port). A sharded root's shards, their standbys and the relays below
    them take their entry's port plus their index, so entries a few ports apart can collide.

    >>> try:
    ...     check_ports({"root": {"port": 7000, "shards": 2, "standby": {"port": 7001}}})
    ... except BadInput as exc:
    ...     print(str(exc)[:72])
    tiers 'root-1' and 'root-standby-0' would both take port 7001 (port): sh
    """
    r = topo.get("root") or {}
    n = len(shard_specs(r))
    entries: list[tuple[str, dict]] = []  # (process name, its settings)

    def each(name: str, spec: dict) -> None:
        entries.extend([(name, spec)] if not n else [(f"{name}-{i}", Cluster._nth(spec, i)) for i in range(n)])
    if n:
        for i, spec in enumerate(shard_specs(r)):
            entries.append((f"{r.get('name', 'root')}-{i}", {**Cluster._nth(r, i), **spec}))
    else:
        entries.append((r.get("name", "root"), r))
    if isinstance(r.get("standby"), dict):
        each(r["standby"].get("name", "root-standby"), r["standby"])
    for z in r.get("zones") or []:
        each(z.get("name", "?"), z)
    for reg in topo.get("regions") or []:
        each(reg.get("name", "?"), reg)
        for z in reg.get("zones") or []:
            each(z.get("name", "?"), z)
    taken: dict[int, str] = {}
    for name, spec in entries:
        for key in ("port", "metrics_port"):
            port = spec.get(key)
            if isinstance(port, int) and not isinstance(port, bool) and port > 0:
                if port in taken:
                    raise BadInput(f"tiers {taken[port]!r} and {name!r} would both take port {port} ({key}): "
                                   "shards, their standbys and the relays below them take their entry's port "
                                   "plus their index; give the topology entries ports further apart")
                taken[port] = name


def default_topology() -> dict:
    """The embedded default (package data, also at deploy/topology.yaml): one root, regions eu
    and us with two zones each."""
    return yaml.safe_load(resources.files("ps.tools").joinpath("topology.yaml").read_text())


def load_topology(path: str | None) -> dict:
    if not path:
        return default_topology()
    try:
        topo = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise BadInput(f"cannot read topology {path}: {exc}") from None
    if not isinstance(topo, dict) or "root" not in topo:
        raise BadInput(f"topology {path} needs a 'root' entry")
    check_shape(topo, path)
    return topo


def check_shape(topo: dict, where: str) -> None:
    """The topology's structure, before anything is started or written: every tier a mapping
    with a name (the root's defaults to ``root``), lists where lists go, integer ports, each
    name once (it names the tier's log, certificate and member id) and not ``ca`` or
    ``client`` (the CA's and the local clients' certificate files). BadInput naming the
    entry; a malformed topology crashed with a traceback (exit 1, not 2) part-way through."""
    names: list[str] = []

    def tier(x, what: str, default: str = "") -> dict:
        if not isinstance(x, dict):
            raise BadInput(f"topology {where}: {what} must be a mapping (name: ..., port: ...), got {x!r}")
        name = x.get("name", default)
        if not isinstance(name, str) or not name:
            raise BadInput(f"topology {where}: {what} needs a name, got {name!r}")
        for key in ("port", "metrics_port"):
            if key in x and (not isinstance(x[key], int) or isinstance(x[key], bool)):
                raise BadInput(f"topology {where}: {what} {name!r} has {key} {x[key]!r}: an integer is needed")
        names.append(name)
        return x

    def listed(x, what: str) -> list:
        if x is None:
            return []
        if not isinstance(x, list):
            raise BadInput(f"topology {where}: {what} must be a list, got {x!r}")
        return x

    if not isinstance(topo.get("settings") or {}, dict):  # (empty, it loads as None)
        raise BadInput(f"topology {where}: settings must be a mapping (flag: value), got {topo['settings']!r}")
    root = tier(topo["root"], "the root", "root")
    for z in listed(root.get("zones"), "the root's zones"):
        if tier(z, "a zone below the root").get("alternates"):  # (they were dropped without a word)
            raise BadInput(f"topology {where}: zone {z['name']!r} is below the root: its parents are the root "
                           "and its standby; alternates name regional masters, for zones of a region")
    for reg in listed(topo.get("regions"), "regions"):
        tier(reg, "a region")
        for z in listed(reg.get("zones"), f"region {reg['name']!r}'s zones"):
            tier(z, f"a zone of region {reg['name']!r}")
    seen: set[str] = set()
    for name in names:
        if name in seen or name in ("ca", "client"):
            why = "names two tiers" if name in seen else "names the CA's or the local clients' certificate files"
            raise BadInput(f"topology {where}: {name!r} {why} (a tier's name is its log, certificate and member "
                           "id): rename one")
        seen.add(name)


@dataclass
class TierProcess:
    name: str
    role: str
    proc: subprocess.Popen
    log: Path
    cmd: list[str] = field(default_factory=list)
    address: str = ""
    metrics_port: int | None = None
    parent: str = ""
    ready_offset: int = 0  # where in the log this process's output starts (restarts append)


@dataclass
class Cluster:
    logdir: Path
    tiers: dict[str, TierProcess] = field(default_factory=dict)
    links: dict[str, TierProcess] = field(default_factory=dict)  # emulated WAN links (role "link")
    env: dict = field(default_factory=dict)
    secrets: LocalSecrets | None = None  # None: plaintext, no tokens (--insecure)
    # a sharded root, and each relay below it, -> its tiers in shard order (one relay per shard)
    shard_groups: dict[str, list[str]] = field(default_factory=dict)
    weights: dict[str, tuple[float, ...]] = field(default_factory=dict)  # the same names -> the root's weights
    standbys: dict[str, str] = field(default_factory=dict)  # a root shard -> its standby's tier
    lock: IO[str] | None = None  # LOGDIR/.lock, held while this cluster runs (checkpoint.hold)
    ready_timeout_s: float = 60.0  # how long a tier may take to print its ready line (a root restores first)

    @classmethod
    def start(cls, topo: dict, logdir: str | Path, extra_root_args: list[str] = (),
              timeout_s: float = 60.0, env: dict | None = None, tune_malloc: bool = True,
              secure: bool = False) -> Cluster:
        """Start every tier (and link) of ``topo``; ``env`` is added to the servers' environment,
        as is ``MALLOC_ENV`` (where not set already) unless ``tune_malloc`` is False. ``secure``:
        mutual TLS and tokens with a throw-away CA under ``logdir/secrets`` (``LocalSecrets``;
        what `hps launch` and `hps demo` do unless told --insecure); else every tier runs
        --insecure, as tests of other things do."""
        c = cls(Path(logdir), env={**(MALLOC_ENV if tune_malloc else {}), **_inherited(os.environ), **(env or {})})
        c.logdir.mkdir(parents=True, exist_ok=True)
        c.ready_timeout_s = timeout_s
        # Before any log, secret or state file in it is touched: a second `hps launch` or
        # `hps demo` on one log directory replaced the first one's admin token and logs under it.
        c.lock = checkpoint.hold(c.logdir, "hps launch or hps demo", "give this one a --logdir of its own")
        if secure:
            c.secrets = LocalSecrets.create(c.logdir / "secrets", topo)
        host = topo.get("host", "127.0.0.1")
        common = []
        for k, v in (topo.get("settings") or {}).items():
            common += [f"--{k.replace('_', '-')}", str(v)]
        try:
            check_ports(topo)
            r = topo["root"]
            if "shards" in r:
                c._spawn_shards(r, host, common + list(extra_root_args), common, topo)
                c.wait_ready(timeout_s)
                return c
            root = c._spawn(r.get("name", "root"), "global", host, r, "", common + list(extra_root_args))
            alt_roots: list[str] = []  # a standby root: every child of the root lists it second
            if isinstance(r.get("standby"), dict):
                sb = r["standby"]
                standby = c._spawn(sb.get("name", "root-standby"), "global", host, sb, "",
                                   common + list(extra_root_args) + ["--standby-of", root.address])
                root.cmd += ["--standby", standby.address]  # for restarts (see the module's docstring)
                alt_roots.append(standby.address)

            def below_root(spec: dict) -> str:
                return ",".join([c._edge(spec, root), *alt_roots])
            # A level at a time: a tier needs only its parent's port, so siblings start together
            # (the demo's tree, 7 tiers, became ready in ~8 s instead of ~15 s on 2 cores).
            level = [c._spawn(z["name"], "zone", host, z, below_root(z), common, wait=False)
                     for z in r.get("zones") or []]  # zones straight below the root (no regional tier)
            regions = [(reg, c._spawn(reg["name"], "regional", host, reg, below_root(reg), common, wait=False))
                       for reg in topo.get("regions") or []]
            c._wait_all([*level, *(rt for _, rt in regions)])
            level, later = [], []  # zones with alternate parents start once every region serves
            for reg, rt in regions:
                for z in reg.get("zones") or []:
                    if z.get("alternates"):
                        later.append((z, rt))
                    else:
                        level.append(c._spawn(z["name"], "zone", host, z, c._edge(z, rt), common, wait=False))
            c._wait_all(level)
            level = []
            for z, rt in later:
                named = z["alternates"]
                alts = [c.tiers[a] for a in named if a in c.tiers and c.tiers[a].role == "regional"]
                if len(alts) != len(named):
                    raise BadInput(f"zone {z['name']!r}: alternates {named} must name regions of the topology")
                level.append(c._spawn(z["name"], "zone", host, z,
                                      ",".join([c._edge(z, rt), *(a.address for a in alts)]), common, wait=False))
            c._wait_all(level)
            for spec in topo.get("links") or []:
                to = spec.get("to", "")
                if to not in c.tiers:
                    raise BadInput(f"link {spec.get('name')!r} goes to {to!r}, which is not a tier of the topology")
                c._link(spec.get("name", ""), spec, c.tiers[to])
            c.wait_ready(timeout_s)
        except BaseException:
            c.stop()
            raise
        return c

    def _spawn_shards(self, r: dict, host: str, args: list[str], common: list[str], topo: dict) -> None:
        """The root as N shards and one relay tree per shard below them (the module's docstring)."""
        name = r.get("name", "root")
        specs = shard_specs(r)
        alternates = [z["name"] for reg in topo.get("regions") or [] for z in reg.get("zones") or []
                      if z.get("alternates")]
        if topo.get("links") or alternates:
            raise BadInput(f"root {name!r} has shards: declared links and zones with alternates in front of "
                           "root shards are not built yet; zones, regions and standbys are (one per shard)")
        sb = r.get("standby") if isinstance(r.get("standby"), dict) else None
        group = []
        for i, spec in enumerate(specs):
            own = {**self._nth(r, i), **spec}
            if r.get("checkpoint_dir") and not spec.get("checkpoint_dir"):
                own["checkpoint_dir"] = str(Path(r["checkpoint_dir"]) / f"shard-{i}")
            own.pop("weight", None)
            shard = f"{name}-{i}"
            which = ["--shard", f"{i}/{len(specs)}"]
            primary = self._spawn(shard, "global", host, own, "", args + which)
            group.append(shard)
            if sb is not None:  # shard I's hot standby, NAME-I: the relays below shard I list it second
                own_sb = self._nth(sb, i)
                if sb.get("checkpoint_dir"):
                    own_sb["checkpoint_dir"] = str(Path(sb["checkpoint_dir"]) / f"shard-{i}")
                standby = self._spawn(f"{sb.get('name', 'root-standby')}-{i}", "global", host, own_sb, "",
                                      args + which + ["--standby-of", primary.address])
                primary.cmd += ["--standby", standby.address]  # for restarts, as for one root
                self.standbys[shard] = standby.name
        self.shard_groups[name] = group
        self.weights[name] = tuple(float(s.get("weight", 1.0)) for s in specs)
        for z in r.get("zones") or []:  # zones straight below the shards
            self._spawn_per_shard(z, "zone", host, common, name)
        for reg in topo.get("regions") or []:
            self._spawn_per_shard(reg, "regional", host, common, name)
            for z in reg.get("zones") or []:
                self._spawn_per_shard(z, "zone", host, common, reg["name"])

    @staticmethod
    def _nth(spec: dict, i: int) -> dict:
        """Shard ``i``'s copy of a tier entry's per-process settings: a fixed port (and metrics
        port) one up per shard; 0 (any) and -1 (none) as given."""
        own = {k: spec[k] for k in ("flush_ms", "flush_bytes", "lease_s", "latency_ms", "bandwidth_mbit",
                                    "jitter_ms", "loss_pct") if k in spec}
        if spec.get("port"):
            own["port"] = int(spec["port"]) + i
        if spec.get("metrics_port") is not None:
            port = int(spec["metrics_port"])
            own["metrics_port"] = port + i if port > 0 else port
        return own

    def _spawn_per_shard(self, spec: dict, role: str, host: str, args: list[str], parent: str) -> None:
        """One relay of ``spec`` per shard, relay I below ``parent``'s relay (or shard) I."""
        names = []
        for i, above in enumerate(self.shard_groups[parent]):
            own = {**self._nth(spec, i), "name": f"{spec['name']}-{i}"}
            parents = [self._edge(own, self.tiers[above])]
            if above in self.standbys:
                parents.append(self.tiers[self.standbys[above]].address)
            self._spawn(own["name"], role, host, own, ",".join(parents), args, wait=False)
            names.append(own["name"])
        self._wait_all([self.tiers[n] for n in names])  # one per shard, started together
        self.shard_groups[spec["name"]] = names
        self.weights[spec["name"]] = self.weights[parent]

    def shard_weights(self, name: str) -> tuple[float, ...]:
        """A sharded root's weights (or those of the root a relay group is below), in shard order
        (HPS_SHARD_WEIGHTS)."""
        return self.weights[name]

    def _edge(self, spec: dict, parent: TierProcess) -> str:
        """The address a child dials for its parent: the parent's, or an emulated link's."""
        link = self._link(f"{spec['name']}-{parent.name}", spec, parent)
        return link.address if link else parent.address

    def _link(self, name: str, spec: dict, to: TierProcess) -> TierProcess | None:
        try:
            link = Link.from_spec(spec)
        except (TypeError, ValueError) as exc:
            raise BadInput(f"topology entry {spec.get('name')!r}: {exc}") from None
        if link is None:
            return None
        if not name or name in self.links or name in self.tiers:
            raise BadInput(f"link name {name!r} is empty or used twice in the topology")
        log = self.logdir / f"link-{name}.log"
        log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "ps.tools.wanem", "--name", name, "--target", to.address,
               "--latency-ms", str(link.latency_ms), "--bandwidth-mbit", str(link.bandwidth_mbit),
               "--jitter-ms", str(link.jitter_ms), "--loss-pct", str(link.loss_pct)]
        t = self._popen(name, "link", cmd, log, to.address)
        self.links[name] = t
        self._wait_line(t, 30.0, pattern=_LINK_READY)
        return t

    def _spawn(self, name: str, role: str, host: str, spec: dict, parent: str, args: list[str],
               wait: bool = True) -> TierProcess:
        """Start one tier; ``wait``: until it serves (else ``_wait_all`` later: its children need its port)."""
        if name in self.tiers:
            raise BadInput(f"topology names tier {name!r} twice")
        self.logdir.joinpath(f"{name}.log").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "ps.tools.cli", "serve", "--role", role, "--name", name,
               "--listen", f"{host}:{spec.get('port', 0)}", "--metrics-port", str(spec.get("metrics_port", -1)),
               *(self.secrets.tier_args(name) if self.secrets else ["--insecure"])]
        if parent:
            cmd += ["--parent", parent]
        # After the topology's settings (``args``): argparse keeps a flag's last value, and the
        # tier's own must win over the settings every tier gets.
        own: list[str] = []
        if spec.get("checkpoint_dir"):
            own += ["--checkpoint-dir", str(spec["checkpoint_dir"])]
        for key in ("flush_ms", "flush_bytes", "lease_s"):  # per tier: a zone flushes sooner than a region
            if key in spec:
                own += [f"--{key.replace('_', '-')}", str(spec[key])]
        # Every tier of a local cluster shares one machine: torch's default of one arithmetic
        # thread per core in each of them oversubscribes it. Measured on the 2-core demo
        # (py-spy, async): the root's Adam step and a region's encode spent most of their time
        # waiting for their own threads. One each, unless the environment says otherwise.
        tier = self._popen(name, role, cmd + list(args) + own, self.logdir / f"{name}.log", parent,
                           extra_env={"OMP_NUM_THREADS": "1"})
        self.tiers[name] = tier
        if wait:
            self._wait_line(tier, self.ready_timeout_s)  # children need the parent's port
        return tier

    def _wait_all(self, tiers: list[TierProcess], timeout_s: float | None = None) -> None:
        """Until every one of ``tiers`` (started together) serves, ``timeout_s`` in all."""
        deadline = time.monotonic() + (self.ready_timeout_s if timeout_s is None else timeout_s)
        for t in tiers:
            self._wait_line(t, max(1.0, deadline - time.monotonic()))

    def _popen(self, name: str, role: str, cmd: list[str], log: Path, parent: str,
               extra_env: dict[str, str] | None = None) -> TierProcess:
        env = {**(extra_env or {}), **(self.env or os.environ), "PYTHONUNBUFFERED": "1"}
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        return TierProcess(name, role, proc, log, cmd=cmd, parent=parent)

    def _wait_line(self, tier: TierProcess, timeout_s: float, offset: int = 0, pattern: re.Pattern = _READY) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self._read_log(tier, offset)
            if self._found_ready(tier, text, pattern):
                return
            if tier.proc.poll() is not None:
                raise RuntimeError(f"tier {tier.name} exited with {tier.proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"tier {tier.name} did not report ready within {timeout_s:.0f}s (log: {tier.log})")

    @staticmethod
    def _read_log(tier: TierProcess, offset: int) -> str:
        with open(tier.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    @staticmethod
    def _found_ready(tier: TierProcess, text: str, pattern: re.Pattern = _READY) -> bool:
        m = pattern.search(text)
        if m and pattern is _LINK_READY:
            tier.address = m.group(1)
        elif m:
            tier.address = m.group(3)
            tier.metrics_port = int(m.group(4)) if m.group(4) else None
        return m is not None

    def wait_ready(self, timeout_s: float) -> None:
        for t in self.tiers.values():
            if not t.address:
                self._wait_line(t, timeout_s)

    def address(self, name: str) -> str:
        """A tier's address, the address of a declared link (where clients cross it), or a
        sharded root's (or a relay's below one): its shards' (relays') addresses in shard order,
        separated by ``;``."""
        if name in self.shard_groups:  # a shard with a standby: the pair, comma-separated
            return ";".join(",".join([self.tiers[s].address] + ([self.tiers[self.standbys[s]].address]
                                                                 if s in self.standbys else []))
                            for s in self.shard_groups[name])
        return (self.tiers.get(name) or self.links[name]).address

    def stop_tier(self, name: str, signum: int = signal.SIGTERM) -> None:
        """Stop one tier by PID, keeping its record so ``restart`` can bring it back."""
        self._kill(self.tiers[name], signum, 5.0)

    def restart(self, name: str, signum: int = signal.SIGKILL) -> TierProcess:
        """Stop one tier (SIGKILL by default, if still running) and start it again on the same port."""
        tier = self.respawn(name, signum)
        self._wait_line(tier, self.ready_timeout_s, tier.ready_offset)
        return tier

    def respawn(self, name: str, signum: int = signal.SIGKILL) -> TierProcess:
        """``restart`` without waiting: the new process is starting; ``ready(name)`` says when it
        serves (the supervisor of ``hps launch`` polls it, so one slow tier blocks no other)."""
        old = self.tiers[name]
        self._kill(old, signum, 5.0)
        cmd = list(old.cmd)
        cmd[cmd.index("--listen") + 1] = old.address  # same port: children reconnect to it
        offset = old.log.stat().st_size
        # Replaced in place: stop() goes leaves first by this order.
        self.tiers[name] = tier = self._popen(name, old.role, cmd, old.log, old.parent,
                                              extra_env={"OMP_NUM_THREADS": "1"})
        tier.address, tier.metrics_port, tier.ready_offset = old.address, old.metrics_port, offset
        return tier

    def ready(self, name: str) -> bool:
        """Whether the tier's current process has printed its ready line (non-blocking)."""
        tier = self.tiers[name]
        return self._found_ready(tier, self._read_log(tier, tier.ready_offset))

    @staticmethod
    def _kill(t: TierProcess, sig: int, grace_s: float) -> None:
        if t.proc.poll() is not None:
            return
        try:
            os.kill(t.proc.pid, sig)
            t.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(t.proc.pid, signal.SIGKILL)
            t.proc.wait(timeout=5)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 5.0) -> None:
        # Leaves first, so relays can still say goodbye to their parents; links last, since
        # those goodbyes cross them.
        for t in reversed(list(self.tiers.values())):
            self._kill(t, signal.SIGTERM, grace_s)
        for t in self.links.values():
            self._kill(t, signal.SIGTERM, grace_s)
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
