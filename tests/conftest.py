"""Fixtures: real tiers on 127.0.0.1:0 (in-process, one event loop in a thread) and processes
a test starts, each stopped by its PID; at the end of the session, any child process a test
left behind is reaped by PID too (and named, so the test that leaked it can be fixed)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import LoopThread, Tree


@pytest.fixture
def tree():
    lt = LoopThread()
    t = Tree(lt)
    try:
        yield t
    finally:
        t.close()
        lt.close()


@pytest.fixture
def reap():
    """Register Popen objects; every one is stopped by PID after the test."""
    procs: list[subprocess.Popen] = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # multiprocessing's resource tracker is its own business: it exits with its parent.
        if int(fields[1]) == pid and fields[0] != "Z" and "resource_tracker" not in cmd:
            out.append((int(stat.parent.name), cmd.strip()))
    return out


@pytest.fixture(scope="session", autouse=True)
def reap_strays():
    """After the whole session: no child process outlives the tests (SIGTERM, then SIGKILL)."""
    yield
    strays = _children(os.getpid())
    for pid, cmd in strays:
        print(f"\nreaping stray child process {pid}: {cmd[:200]}")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while strays and _children(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, _ in _children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pytest_sessionfinish(session, exitstatus):
    """Clients some tests leave open keep heart-beating from daemon threads until the interpreter
    exits, at tiers that are gone: their warnings would follow the summary by the dozen."""
    import logging

    logging.getLogger("hps.worker").setLevel(logging.ERROR)
