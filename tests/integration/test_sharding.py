"""A job over several root shards (issue 16), with real root processes started and stopped by
PID: bsp over 3 shards of unequal weight equals one process on the whole batch; a kill -9 of
one shard mid-run loses no acknowledged version (it restores from its own WAL and checkpoint,
the others keep theirs, training goes on); resharding 3 -> 4 between runs carries every
parameter and optimizer state bit for bit; misaddressed shards and jobs are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig, ShardingConfig
from ps.core.errors import BadInput, Conflict, PermissionDenied, Unauthenticated, Unavailable, UnknownJob
from ps.core.view import KeySpec, Layout
from ps.tools.status import fetch_status
from tests.helpers import ServeProcess, mlp_batches, mlp_loss, small_mlp, train_mlp
from worker import HpsOptimizer, ParameterClient
from worker.sharded import ShardedClient

LAYOUT = Layout([KeySpec("emb", (64, 8)), KeySpec("fc.weight", (8, 8)), KeySpec("fc.bias", (8,))])
ADAM = OptimizerConfig(kind="adam", lr=0.01)


class Root(ServeProcess):
    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        super().__init__(tmp / f"{name}.log", name, [
            "--role", "global", "--name", name, "--insecure", "--heartbeat-s", "0.2", "--member-timeout-s", "5",
            "--checkpoint-every", "4", *args])


@pytest.fixture
def roots(tmp_path):
    made: list[Root] = []

    def make(name: str, *args: str) -> Root:
        r = Root(tmp_path, name, *args)
        made.append(r)  # from _shards' threads too: list.append is atomic
        return r
    yield make
    with ThreadPoolExecutor(max(len(made), 1)) as pool:  # each stop is a SIGTERM and a final checkpoint
        list(pool.map(lambda r: r.stop(), made))


def _shards(roots, tmp: Path, n: int, tag: str = "s") -> list[Root]:
    """N root shards, started together (each process's start-up is mostly imports)."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: roots(f"{tag}{n}-{i}", "--shard", f"{i}/{n}", "--checkpoint-dir",
                                             str(tmp / f"{tag}{n}-{i}")), range(n)))


def _status(r: Root):
    """``r``'s status once it answers (a channel to the address it had before a kill -9 backs off
    for a moment: gRPC shares the connection in this process)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return r.status()
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _address(rs: list[Root]) -> str:
    return ";".join(r.address for r in rs)


def _grad(step: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal(LAYOUT.numel).astype(np.float32)


def _job(weights: tuple[float, ...] | None, block_elems: int = 64) -> JobConfig:
    sharding = ShardingConfig(weights=weights, block_elems=block_elems) if weights else None
    return JobConfig(name="j", optimizer=ADAM, sharding=sharding)


def _train(c, first: int, count: int, acked: dict[int, np.ndarray]) -> None:
    """``count`` bsp steps from ``first``; the view of every acknowledged version in ``acked``."""
    for s in range(first, first + count):
        v, _ = c.push(_grad(s), clock=s)
        c.pull(min_version=v)
        assert c.view.version == v
        acked[v] = c.view.values.copy()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, np.ndarray]:
    """The same pushes (16 steps) at one unsharded root: the view at every version. Computed
    once for the module: the tests that compare with it push the same gradients."""
    one = Root(tmp_path_factory.mktemp("reference"), "one")
    try:
        c = ParameterClient(one.address, "j", "w0", timeout_s=10, retry_s=30)
        c.create_job(_job(None), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        c.register()
        c.pull()
        out: dict[int, np.ndarray] = {}
        _train(c, 0, 16, out)
        c.close()
    finally:
        one.stop()
    return out


def _equals_local_adam(got: dict, lr: float, steps: int) -> torch.nn.Module:
    """Assert every worker's model in ``got`` (``train_mlp``'s, 16 samples a step) is torch Adam
    on one process over the same ``steps`` whole batches; return that process's model."""
    model, (x, y) = small_mlp(), mlp_batches(steps, 16)
    ref = torch.optim.Adam(model.parameters(), lr=lr)
    for s in range(steps):
        ref.zero_grad()
        mlp_loss(model, x[s], y[s]).backward()
        ref.step()
    for w in got.values():
        for a, b in zip(w, model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
    return model


def test_bsp_over_three_shards_of_unequal_weight_equals_one_process(roots, tmp_path):
    rs = _shards(roots, tmp_path, 3)
    opt = OptimizerConfig(kind="adam", lr=0.01)
    job = JobConfig(name="eq", optimizer=opt, sharding=ShardingConfig(weights=(2.0, 1.0, 1.0), block_elems=64))
    got = train_mlp([_address(rs)], job, steps=8, workers=2, per_worker=8)
    model = _equals_local_adam(got, opt.lr, steps=8)
    # the weights place the bytes: shard 0 (weight 2) holds about half the job, each shard its own
    blocks = [r.status().jobs[0].stats for r in rs]
    assert all(b.shard == f"{i}/3" and b.shard_blocks > 0 for i, b in enumerate(blocks))
    total = sum(b.shard_bytes for b in blocks)
    assert total == 4 * sum(p.numel() for p in model.parameters())
    assert blocks[0].shard_bytes > blocks[1].shard_bytes and blocks[0].shard_bytes > blocks[2].shard_bytes


def test_a_kill_9_of_one_shard_loses_no_acknowledged_version(roots, tmp_path, reference):
    ref = reference
    rs = _shards(roots, tmp_path, 3)
    c = ShardedClient([r.address for r in rs], "j", "w0", timeout_s=10, retry_s=30)
    c.create_job(_job((1.0, 1.0, 1.0)), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    c.register()
    c.pull()
    acked: dict[int, np.ndarray] = {}
    _train(c, 0, 6, acked)  # shard 1 checkpointed at 4; 5 and 6 are in its write-ahead log only
    others = [rs[0].status().jobs[0].checksum, rs[2].status().jobs[0].checksum]
    lineage = c.view.epoch
    rs[1].signal(signal.SIGKILL)
    rs[1].restart("--shard", "1/3", "--checkpoint-dir", str(tmp_path / "s3-1"))
    assert "replayed from the write-ahead log" in rs[1].text()
    st = _status(rs[1]).jobs[0]
    assert st.version == 6  # every acknowledged version restored
    assert c.view.checksum == st.checksum ^ others[0] ^ others[1]  # the joined view's: every shard's
    assert [rs[0].status().jobs[0].checksum, rs[2].status().jobs[0].checksum] == others  # untouched
    _train(c, 6, 10, acked)  # training goes on (the worker re-registers at the restarted shard)
    # The joined view is on a new lineage when any shard's is, not shard 0's alone: an ssp/async
    # sender drops what it summed on the old views instead of pushing it to be refused at shard
    # 1 only, after shards 0 and 2 applied it.
    assert c.view.epoch != lineage
    for v, values in ref.items():
        assert np.array_equal(acked[v], values), v  # bit for bit what one root computes
    c.close()


def test_resharding_3_to_4_between_runs_carries_parameters_and_optimizer_state(roots, tmp_path, reference, capsys,
                                                                               monkeypatch):
    ref = reference
    rs = _shards(roots, tmp_path, 3)
    c = ShardedClient([r.address for r in rs], "j", "w0", timeout_s=10, retry_s=30)
    c.create_job(_job((1.0, 1.0, 1.0), block_elems=8), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    c.register()
    c.pull()
    acked: dict[int, np.ndarray] = {}
    _train(c, 0, 6, acked)
    c.close()
    for r in rs:
        r.stop()  # SIGTERM: each writes a checkpoint at version 6

    def reshard(*targets: str):
        return subprocess.run([sys.executable, "-m", "ps.tools.cli", "reshard", "--job", "j",
                               "--from", *[str(tmp_path / f"s3-{i}") for i in range(3)],
                               "--to", *[str(tmp_path / t) for t in targets]], capture_output=True, text=True,
                              timeout=120)
    # One directory twice (shard 1's checkpoint overwrote shard 0's, and it said it succeeded),
    # or one target (a job no worker can use): refused, nothing written (the command in this
    # process: its refusals come before anything is restored).
    from ps.tools.cli import main
    for targets, why in ((("n4-0", "n4-0", "n4-2", "n4-3"), "twice"), (("n4-0",), "two or more")):
        capsys.readouterr()
        assert main(["reshard", "--job", "j", "--from", *[str(tmp_path / f"s3-{i}") for i in range(3)],
                     "--to", *[str(tmp_path / t) for t in targets]]) == 2
        assert why in capsys.readouterr().err
        assert not any(p.exists() for p in tmp_path.glob("n4-*/j")), "a refused reshard wrote files"
    # A failure halfway through moving the new shards into place (the third rename) takes the
    # ones already moved out again: no target holds part of the job, and a rerun is not refused.
    from pathlib import Path
    rename, calls = Path.rename, []

    def failing_rename(self, target):
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return rename(self, target)
    monkeypatch.setattr(Path, "rename", failing_rename)
    capsys.readouterr()
    assert main(["reshard", "--job", "j", "--from", *[str(tmp_path / f"s3-{i}") for i in range(3)],
                 "--to", *[str(tmp_path / f"n4-{i}") for i in range(4)]]) != 0
    assert "No space" in capsys.readouterr().err
    monkeypatch.setattr(Path, "rename", rename)
    assert len(calls) == 3 and not list(tmp_path.glob("n4-*/j")) and not list(tmp_path.glob("n4-*/.j.*"))
    out = reshard(*[f"n4-{i}" for i in range(4)])
    assert out.returncode == 0, out.stderr
    moved, blocks = (int(w) for w in out.stdout.split("blocks moved")[0].split()[-3::2])
    assert "3 -> 4 shards" in out.stdout and blocks >= 70 and moved <= 1.5 * blocks / 4, out.stdout
    # The stopped shards export as one model and one torch optimizer state: version 6 whole, and
    # torch's Adam from that state takes the step the root took next.
    out = subprocess.run(
        [sys.executable, "-m", "ps.tools.cli", "checkpoint", "export", "--job", "j",
         *[str(tmp_path / f"s3-{i}") for i in range(3)], "--out", str(tmp_path / "m.pt"),
         "--optimizer-out", str(tmp_path / "o.pt")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "at version 6" in out.stdout, out.stderr
    # The shards' job directories, as the help allows, export the same (it looked for s3-0/j/j).
    out = subprocess.run(
        [sys.executable, "-m", "ps.tools.cli", "checkpoint", "export",
         *[str(tmp_path / f"s3-{i}" / "j") for i in range(3)], "--out", str(tmp_path / "m-dirs.pt")],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "at version 6" in out.stdout, out.stderr
    model = torch.load(tmp_path / "m.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.values(), torch.load(tmp_path / "m-dirs.pt").values(),
                                                 strict=True))
    assert list(model) == [s.key for s in LAYOUT]
    assert np.array_equal(np.concatenate([t.numpy().ravel() for t in model.values()]), ref[6])
    params = [torch.nn.Parameter(t.clone()) for t in model.values()]
    adam = torch.optim.Adam(params, lr=ADAM.lr)
    adam.load_state_dict(torch.load(tmp_path / "o.pt"))
    g, off = torch.from_numpy(_grad(6)), 0
    for p in params:
        p.grad = g[off:off + p.numel()].view_as(p).clone()
        off += p.numel()
    adam.step()
    nxt = torch.cat([p.detach().ravel() for p in params]).numpy()
    np.testing.assert_allclose(nxt, ref[7], rtol=1e-6, atol=1e-7)
    new = _shards(roots, tmp_path, 4, tag="n")
    c = ShardedClient([r.address for r in new], "j", "w0", timeout_s=10, retry_s=30)
    c.register()
    assert c.config.sharding is not None and c.config.sharding.shards == 4
    c.pull(min_version=6)
    assert c.view.version == 6 and np.array_equal(c.view.values, ref[6])
    _train(c, 6, 6, acked)  # Adam's moments and step count came along: the same as never stopping
    for v in range(7, 13):
        assert np.array_equal(acked[v], ref[v]), v
    c.close()
    for r in new:
        r.stop()
    # A shard started on another shard's directory does not serve the job: its blocks are not
    # the ones the ring places there (a worker took them for the others', without an error).
    wrong = roots("wrong", "--shard", "0/4", "--checkpoint-dir", str(tmp_path / "n4-1"))
    assert not wrong.status().jobs and "not the blocks the ring places there" in wrong.text()


def test_misaddressed_shards_and_jobs_are_refused_with_a_sentence(roots, tmp_path):
    rs = _shards(roots, tmp_path, 2)
    plain = roots("plain")
    with pytest.raises(BadInput, match="not a shard"):  # a sharded job at an unsharded root
        ShardedClient([plain.address, rs[1].address], "j", timeout_s=10, retry_s=0).create_job(
            _job((1.0, 1.0)), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    with pytest.raises(BadInput, match="shard 1/2.*not the blocks the ring places"):  # out of order
        ShardedClient([rs[1].address, rs[0].address], "j", timeout_s=10, retry_s=0).create_job(
            _job((1.0, 1.0)), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    with pytest.raises(BadInput, match="sharded over 3 roots"):
        ShardedClient([r.address for r in rs], "j", timeout_s=10, retry_s=0).create_job(
            _job((1.0, 1.0, 1.0)), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    with pytest.raises(BadInput, match="serves jobs sharded over 2 roots only"):  # unsharded job at a shard
        c = ParameterClient(rs[0].address, "k", timeout_s=10, retry_s=0)
        c.create_job(_job(None), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    c = ShardedClient([r.address for r in rs], "j", "w0", timeout_s=10, retry_s=0)
    c.create_job(_job((1.0, 1.0)), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    c.register()
    c.close()
    with pytest.raises(Conflict, match="list the shard addresses in shard order"):
        ShardedClient([rs[1].address, rs[0].address], "j", "w1", timeout_s=10, retry_s=0).register()
    model = torch.nn.Linear(2, 2)  # a script given one shard's address for a sharded job
    with pytest.raises(ValueError, match="sharded over 2 root shards.*separated by ';'"):
        HpsOptimizer(model, rs[0].address, "j", worker_id="w2", timeout_s=10)


def test_a_sharded_job_trains_through_a_relay_tree_per_shard(roots, tmp_path):
    """Relays carry a sharded job as one tree per shard: zone A's relays A0 -> shard 0 and A1 ->
    shard 1, zone B's likewise; a worker's address is its zone's relays in shard order. BSP
    through them equals one process (the workers cut and join by shard; each relay sums its
    shard's blocks). With tokens: the admin creates the job through the relays (shard 0 mints
    the job's token, relay A1 hands it on to shard 1) and a worker holding only that token
    trains through zone B; a worker given one relay is refused with a sentence."""
    admin = "admin-token-for-relayed-shards-0123456789"
    (tmp_path / "admin").write_text(admin + "\n")
    guard = ["--admin-token-file", str(tmp_path / "admin")]
    with ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda i: roots(f"r-{i}", "--shard", f"{i}/2", "--checkpoint-dir",
                                           str(tmp_path / f"r-{i}"), *guard), range(2)))
    relays: list[ServeProcess] = []
    try:
        with ThreadPoolExecutor(4) as pool:
            relays = list(pool.map(lambda zi: ServeProcess(
                tmp_path / f"zone-{zi}.log", f"zone-{zi}",
                ["--role", "zone", "--name", f"zone-{zi}", "--insecure", "--heartbeat-s", "0.2", *guard,
                 "--parent", rs[int(zi[1])].address]), ["a0", "a1", "b0", "b1"]))
        zone_a, zone_b = _address(relays[:2]), _address(relays[2:])
        opt = OptimizerConfig(kind="adam", lr=0.01)
        job = JobConfig(name="relayed", optimizer=opt, sharding=ShardingConfig(weights=(2.0, 1.0), block_elems=64))
        model = small_mlp()  # the values the workers start from
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        layout = Layout([KeySpec(n, tuple(p.shape)) for n, p in model.named_parameters()])
        creator = ShardedClient([r.address for r in relays[:2]], "relayed", "creator", timeout_s=10, retry_s=30,
                                token=admin)
        assert creator.create_job(job, layout, values)
        token = creator.clients[0].minted
        assert token
        creator.close()
        os.environ["HPS_TOKEN"] = token  # what a worker's pod is given
        try:
            got = train_mlp([zone_a, zone_b], job, steps=6, workers=2, per_worker=8)
        finally:
            del os.environ["HPS_TOKEN"]
        _equals_local_adam(got, opt.lr, steps=6)
        assert [fetch_status(r.address, token=token).jobs[0].version for r in rs] == [6, 6]
        with pytest.raises(ValueError, match="sharded over 2 root shards.*separated by ';'"):
            HpsOptimizer(small_mlp(), relays[2].address, "relayed", worker_id="w9", timeout_s=10, token=token)
    finally:
        for r in relays:
            r.stop()


def test_one_job_token_acts_at_every_shard(roots, tmp_path):
    """Shard 0 mints the job's token for the admin who creates the job; the other shards take
    that token on, so a second worker with the job token alone works at every shard. A wrong
    token, and a token handed over anywhere but at a root shard, are refused."""
    admin = "admin-token-for-shard-tests-0123456789"
    (tmp_path / "admin").write_text(admin + "\n")
    with ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda i: roots(f"t-{i}", "--shard", f"{i}/2", "--checkpoint-dir", str(tmp_path / f"t-{i}"),
                                           "--admin-token-file", str(tmp_path / "admin")), range(2)))
    job = _job((1.0, 1.0))
    creator = ShardedClient([r.address for r in rs], "j", "w0", timeout_s=10, retry_s=30, token=admin)
    worker = None
    try:
        # Shard 1 fails the first try after shard 0 made the job; the retry hands shard 1 the
        # token shard 0 minted then (it minted one of its own: no token acted at every shard).
        real = creator.clients[1].create_job

        def down_once(*a, **kw):
            creator.clients[1].create_job = real
            raise Unavailable("shard 1 is restarting (test)")
        creator.clients[1].create_job = down_once
        with pytest.raises(Unavailable):
            creator.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        assert creator.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        token = creator.clients[0].minted
        assert token and all(c._rpc.token == token for c in creator.clients)
        creator.register()
        worker = ShardedClient([r.address for r in rs], "j", "w1", timeout_s=10, retry_s=30, token=token)
        worker.register()
        creator.pull()
        worker.pull()
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("v", creator.push(_grad(0), clock=0)))
        t.start()
        v, _ = worker.push(_grad(1), clock=0)
        t.join(30)
        assert v == done["v"][0] == 1
        worker.pull(min_version=1)
        assert worker.view.version == 1
        with pytest.raises((Unauthenticated, PermissionDenied)):
            ShardedClient([r.address for r in rs], "j", "w2", timeout_s=5, retry_s=1,
                          token="not-the-token").register()
    finally:
        creator.close()
        if worker is not None:
            worker.close()
    # Resharded 2 -> 3 between runs, the job keeps its one token at every new shard.
    from ps.tools.reshard import reshard_dirs

    for r in rs:
        r.stop()  # SIGTERM: a checkpoint at version 1 each
    made = reshard_dirs([tmp_path / f"t-{i}" for i in range(2)], [tmp_path / f"u-{i}" for i in range(3)], "j")
    assert made.token_carried and made.version == 1
    with ThreadPoolExecutor(3) as pool:
        new = list(pool.map(lambda i: roots(f"u-{i}", "--shard", f"{i}/3", "--checkpoint-dir", str(tmp_path / f"u-{i}"),
                                            "--admin-token-file", str(tmp_path / "admin")), range(3)))
    again = ShardedClient([r.address for r in new], "j", "w1", timeout_s=10, retry_s=30, token=token)
    try:
        again.register()
        again.pull(min_version=1)
        assert again.view.version == 1
    finally:
        again.close()
    # A token handed over at a plain root, or for an unsharded job, is refused and creates nothing.
    plain = roots("plain", "--admin-token-file", str(tmp_path / "admin"))
    c = ParameterClient(plain.address, "k", "w0", timeout_s=5, retry_s=1, token=admin)
    try:
        with pytest.raises(BadInput, match="handed over in a create only to the root shards"):
            c.create_job(JobConfig(name="k"), LAYOUT, np.zeros(LAYOUT.numel, np.float32), job_token="x" * 40)
        with pytest.raises(UnknownJob):
            c.register()  # nothing was created
    finally:
        c.close()


def test_ssp_and_async_keep_their_bounds_at_every_shard(roots, tmp_path):
    """ssp over 2 shards: a worker 15x slower holds the fast ones back at every shard, by no
    more than the bound (each shard measures the staleness of what it applies, in clocks), and
    they do run ahead of it; async over 2 shards: the slow worker blocks no one."""
    from tests.integration.test_modes import _fast_ones_never_wait, _model, _problem, _run

    s = 2
    rs = _shards(roots, tmp_path, 2, tag="ssp")
    sharding = ShardingConfig(weights=(1.0, 1.0), block_elems=2)
    job = JobConfig(name="ssp", mode="ssp", staleness=s, optimizer=OptimizerConfig(lr=0.05), sharding=sharding)
    models = [_model(0) for _ in range(3)]
    opts = [(HpsOptimizer(m, _address(rs), job, worker_id=f"ssp-w{i}"), m) for i, m in enumerate(models)]
    ts, errors = _run(opts, 18, [0.004, 0.004, 0.06], _problem(1))
    [t.join(120) for t in ts]
    assert not errors, errors
    for o, _ in opts:
        o.close()
    for r in rs:  # within the bound at each shard, and past 0 (bsp would be 0: not bsp in disguise)
        st = r.status().jobs[0].stats
        assert st.clock_staleness_count > 0 and st.over_bound == 0, st
        assert 1 <= st.clock_staleness_max <= s, f"shard {st.shard}: fast workers ran {st.clock_staleness_max} ahead"

    job = JobConfig(name="as", mode="async", optimizer=OptimizerConfig(lr=0.05), sharding=sharding)
    models = [_model(1) for _ in range(3)]
    opts = [(HpsOptimizer(m, _address(rs), job, worker_id=f"as-w{i}"), m) for i, m in enumerate(models)]
    _fast_ones_never_wait(opts, 16)
    for o, _ in opts:
        o.close()


def test_a_shard_with_a_standby_survives_its_primarys_kill_9(roots, tmp_path, reference):
    """Shard 1 of 2 as a hot-standby pair (both ``--shard 1/2``): its primary killed with -9
    mid-run, the standby takes over its blocks, the worker (``SHARD0;ipv4:PRIMARY,STANDBY``)
    goes on, and every acknowledged version equals one unsharded root fed the same pushes."""
    ref = reference
    lease = ("--lease-s", "1.0")
    s0 = roots("h0", "--shard", "0/2", "--checkpoint-dir", str(tmp_path / "h0"), *lease)
    a = roots("h1a", "--shard", "1/2", "--checkpoint-dir", str(tmp_path / "h1a"), *lease)
    b = roots("h1b", "--shard", "1/2", "--checkpoint-dir", str(tmp_path / "h1b"), *lease, "--standby-of", a.address)
    deadline = time.monotonic() + 30
    while "in sync with the primary" not in b.text():
        assert time.monotonic() < deadline, b.text()
        time.sleep(0.05)
    c = ShardedClient([s0.address, f"ipv4:{a.address},{b.address}"], "j", "w0", timeout_s=10, retry_s=30)
    try:
        c.create_job(_job((1.0, 1.0), block_elems=64), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        c.register()
        c.pull()
        acked: dict[int, np.ndarray] = {}
        _train(c, 0, 6, acked)
        a.signal(signal.SIGKILL)
        _train(c, 6, 6, acked)
        st = b.status()
        assert (st.root_state, st.term) == ("primary", 1) and st.jobs[0].version == 12
        for v in range(1, 13):
            assert np.array_equal(acked[v], ref[v]), v
    finally:
        c.close()


def test_an_idle_worker_and_an_ssp_0_worker_step_over_shards(roots, tmp_path):
    """bsp: a worker whose data ran out takes part in the round with nothing (``idle``, as the
    leased sampler calls it at an epoch's end) at every shard -- it raised BadInput from the
    split of its empty vector. ssp(0), the default bound: a step's pull waits for the clock
    floor its own push makes -- its push's shard calls queued behind the pull's in one thread
    pool per worker, so the step stalled until the round timeout."""
    from tests.integration.test_modes import _model

    rs = _shards(roots, tmp_path, 2, tag="idle")
    sharding = ShardingConfig(weights=(1.0, 1.0), block_elems=2)
    job = JobConfig(name="idle", optimizer=OptimizerConfig(lr=0.05), sharding=sharding)
    a, b = _model(0), _model(0)
    oa = HpsOptimizer(a, _address(rs), job, worker_id="idle-a", round_timeout_s=20)
    ob = HpsOptimizer(b, _address(rs), job, worker_id="idle-b", round_timeout_s=20)
    x = torch.randn(4, 6)
    with ThreadPoolExecutor(1) as pool:
        for _ in range(2):
            ob.zero_grad()
            b(x).sum().backward()
            stepped = pool.submit(ob.step)
            oa.idle()
            assert stepped.result(timeout=30).applied
            assert oa.last_result.version == ob.last_result.version
    torch.testing.assert_close(list(a.parameters()), list(b.parameters()), rtol=0, atol=0)
    oa.close(), ob.close()

    job = JobConfig(name="ssp0", mode="ssp", staleness=0, optimizer=OptimizerConfig(lr=0.05), sharding=sharding)
    m = _model(1)
    opt = HpsOptimizer(m, _address(rs), job, worker_id="ssp0-w", round_timeout_s=8)
    for _ in range(6):
        m(x).sum().backward()
        opt.step()  # TimedOut ("the slowest is at ...") when the pull held every shard thread
        opt.zero_grad()
    assert opt.sync(timeout_s=20) >= 6
    opt.close()


def _async_over_two_shards(tree, job: str):
    """An async job over two in-process root shards, and its registered worker; and what
    version each shard holds."""
    addresses = [tree.add(f"{job}{i}", "global", shard=f"{i}/2") for i in range(2)]
    cfg = JobConfig(name=job, mode="async", optimizer=OptimizerConfig(kind="sgd", lr=0.1),
                    sharding=ShardingConfig(weights=(1.0, 1.0), block_elems=64))
    c = ShardedClient(addresses, job, "w0", timeout_s=10, retry_s=30)

    def versions() -> list[int]:
        return [tree.lt.call(lambda i=i: tree.tier(f"{job}{i}").jobs[job].view.version) for i in range(2)]
    try:
        c.create_job(cfg, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        c.register()
        c.pull()
    except BaseException:
        c.close()
        raise
    return c, versions


def test_a_push_one_shard_left_unanswered_is_applied_once_everywhere_when_sent_again(tree):
    """async over 2 shards (in-process roots). Shard 1's answer is lost (Ctrl-C as it came),
    shard 0 answered: the script hears an error and sends the same gradient again. Shard 1
    asked its root and gave the version back; shard 0, which had answered, sent it as a new
    push and it was applied a second time there. Now each shard that answered remembers the
    push as one the script did not hear, and answers the same gradient again with its version."""
    from tests.integration.test_worker_faults import _interrupted_once_placed

    c, versions = _async_over_two_shards(tree, "re")
    try:
        g = _grad(0)  # shard 1's Push interrupted once its root applied it
        _interrupted_once_placed(tree, c.clients[1], None, go=lambda: c.push(g, clock=0),
                                 placed=lambda: versions()[1] == 1)
        assert c.push(g, clock=0)[0] == 1  # sent again: both shards answer with version 1
        assert versions() == [1, 1]  # applied once at each
        assert c.push(_grad(1), clock=1)[0] == 2  # and the next gradient is a push of its own
    finally:
        c.close()


def test_ctrl_c_while_the_shards_push_waits_for_them_and_a_push_sent_again_is_applied_once(tree):
    """Ctrl-C in the script while the shards' pushes run in the pool: the first wait was
    interrupted and the push was given up on while that shard's push ran on and was applied,
    so the same gradient sent again was a new push there (applied twice in async). Now the
    pushes are waited for before Ctrl-C is raised, and every answered one is remembered."""
    import _thread

    c, versions = _async_over_two_shards(tree, "cc")
    try:
        slow = c.clients[1]
        call, once = slow._call, threading.Event()

        def interrupting(name, request, timeout=None):
            if name == "Push" and not once.is_set():
                once.set()
                time.sleep(0.2)  # (the script waits for the shards by now)
                _thread.interrupt_main()  # Ctrl-C while this push is still on its way
                time.sleep(0.5)
            return call(name, request, timeout)
        slow._call = interrupting
        g = _grad(0)
        with pytest.raises(KeyboardInterrupt):
            c.push(g, clock=0)
        slow._call = call
        assert versions() == [1, 1]  # both applied, before push() raised
        assert c.push(g, clock=0)[0] == 1  # sent again: answered with version 1 at both
        assert versions() == [1, 1]
    finally:
        c.close()
