"""The usage examples opening our docstrings run, so they cannot drift from the code (STYLE 17).

Each module of ``DOCTESTED`` is one test: its docstrings' ``>>>`` examples run with doctest,
and a module whose examples vanished fails too. Examples that need a tier (``LIVE``) find the
address of a root on 127.0.0.1:0, started in this process, as ``address``; each such module
uses its own job names. ps.tools.launch starts (and stops) its own processes; ps.server's
modules start (and stop) their own servers on 127.0.0.1:0. The demo runs its examples in its
own tests.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

from tests.helpers import LoopThread, Tree

DOCTESTED = (
    "ps.core",
    "ps.core.codecs",
    "ps.core.codecs._common",
    "ps.core.codecs._host",
    "ps.core.codecs.base",
    "ps.core.codecs.feedback",
    "ps.core.codecs.half",
    "ps.core.codecs.int4",
    "ps.core.codecs.int8",
    "ps.core.codecs.lossless",
    "ps.core.codecs.powersgd",
    "ps.core.codecs.rows",
    "ps.core.codecs.sign",
    "ps.core.codecs.topk",
    "ps.core.config",
    "ps.core.consistency",
    "ps.core.deltas",
    "ps.core.encoder",
    "ps.core.errors",
    "ps.core.exactly_once",
    "ps.core.intake",
    "ps.core.leases",
    "ps.core.losswatch",
    "ps.core.logs",
    "ps.core.optim",
    "ps.core.pieces",
    "ps.core.placement",
    "ps.core.ranks",
    "ps.core.sharding",
    "ps.core.replica",
    "ps.core.tensors",
    "ps.core.types",
    "ps.core.view",
    "ps.net.frames",
    "ps.net.rpc",
    "ps.net.upstream",
    "ps.net.wire",
    "ps.server",
    "ps.server.auth",
    "ps.server.health",
    "ps.server.lifecycle",
    "ps.server.peers",
    "ps.server.service",
    "ps.tiers.checkpoint",
    "ps.tiers.durable",
    "ps.tiers.families",
    "ps.tiers.jobstate",
    "ps.tiers.metrics",
    "ps.tiers.relay",
    "ps.tiers.replication",
    "ps.tiers.root",
    "ps.tiers.standby",
    "ps.tiers.tier",
    "ps.tiers.wal",
    "ps.tiers.walrecord",
    "ps.tools.export",
    "ps.tools.format",
    "ps.tools.jobctl",
    "ps.tools.launch",
    "ps.tools.status",
    "ps.tools.supervise",
    "ps.tools.wanem",
    "worker",
    "worker.client",
    "worker.metrics",
    "worker.optimizer",
    "worker.overlap",
    "worker.sampler",
    "worker.sender",
    "worker.streamed",
)

# Modules whose examples talk to a tier: they get ``address`` (a live root) in their globals.
LIVE = frozenset({"ps.net.rpc", "ps.net.upstream", "ps.tiers.metrics", "ps.tiers.relay", "ps.server.health",
                  "ps.tools.jobctl", "ps.tools.status", "ps.tools.wanem", "worker", "worker.client", "worker.optimizer",
                  "worker.overlap", "worker.sampler", "worker.sender", "worker.streamed"})

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.fixture(scope="module")
def root_address():
    lt = LoopThread()
    tree = Tree(lt)
    try:
        yield tree.add("root", "global")
    finally:
        tree.close()
        lt.close()


@pytest.mark.parametrize("modname", DOCTESTED)
def test_docstring_examples_run(modname, request):
    module = importlib.import_module(modname)
    globs = {"address": request.getfixturevalue("root_address")} if modname in LIVE else {}
    result = doctest.testmod(module, extraglobs=globs, optionflags=FLAGS)  # failures: captured stdout
    assert result.attempted > 0, f"{modname} has no examples left to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {modname} failed (stdout)"
