"""The package as a user installs it: a wheel built from the sources alone (no generated code in
the tree it is built from) installs into a fresh virtualenv, and its `hps launch` (with the
embedded default topology) and `hps status` run from outside the source tree."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_installs_and_runs_launch_and_status(tmp_path):
    ctx = tmp_path / "src"
    ctx.mkdir()
    for f in ("pyproject.toml", "setup.py", "MANIFEST.in"):
        shutil.copy(ROOT / f, ctx)
    skip = shutil.ignore_patterns("__pycache__", "hps_pb2*")  # a clean clone has none
    for d in ("ps", "worker", "protos"):
        shutil.copytree(ROOT / d, ctx / d, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        ".", "-w", str(tmp_path / "dist")], cwd=ctx, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("hps-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ps/net/proto/hps_pb2.py", "ps/net/proto/hps_pb2_grpc.py", "ps/tools/topology.yaml",
            "ps/server/lifecycle.py", "worker/__init__.py"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)

    # A fresh venv with the wheel; its dependencies come from this venv's site-packages, added
    # as a plain path (a .pth line), so the editable install of the source tree is not seen.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (venv / "bin" / "hps").write_text(f"#!{py}\nimport sys\nfrom ps.tools.cli import main\nsys.exit(main())\n")
    (venv / "bin" / "hps").chmod(0o755)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(py), "-c", "import ps; print(ps.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where

    launch = subprocess.Popen([str(venv / "bin" / "hps"), "launch", "--logdir", str(work / "logs")], cwd=work,
                              env={**env, "PATH": f"{venv / 'bin'}:{env['PATH']}"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, root = [], None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = launch.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("global"):
                root = line.split()[2]
            if "cluster up" in line:
                break
        assert root and "cluster up" in lines[-1], "".join(lines)
        tiers = ("global root", "regional eu", "regional us", "zone eu-a", "zone eu-b", "zone us-a", "zone us-b")
        deadline = time.monotonic() + 30  # relays announce their children with their heartbeats
        while True:
            # secure by default: --launch-dir brings the client certificate and admin token
            status = subprocess.run([str(venv / "bin" / "hps"), "status", "--launch-dir", str(work / "logs"), root],
                                    cwd=work, env=env, capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stdout + status.stderr
            if all(t in status.stdout for t in tiers) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for tier in tiers:
            assert tier in status.stdout, status.stdout
    finally:
        os.kill(launch.pid, signal.SIGTERM)
        launch.wait(timeout=60)
