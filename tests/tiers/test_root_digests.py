"""The root hashes only the blocks a version changed (ps.core.view), and what it publishes is
still the whole view's checksum: with initial values holding -0.0 (which adding +0.0 would
turn into +0.0 behind a stale digest), and with deltas of some keys only (an outer job's
fragments)."""

from __future__ import annotations

import numpy as np

from ps.core.config import JobConfig, ServerConfig
from ps.core.view import BLOCK, KeySpec, Layout, checksum
from ps.tiers.root import Root


def test_a_fragment_version_publishes_the_whole_views_checksum_though_only_its_blocks_are_hashed():
    layout = Layout([KeySpec("a", (BLOCK,)), KeySpec("b", (2 * BLOCK,)), KeySpec("c", (7,))])
    values = np.linspace(-1.0, 1.0, layout.numel, dtype=np.float32)
    values[BLOCK:] = np.float32(-0.0)  # "b" and "c": negative zeros, untouched by the fragment below
    root = Root(ServerConfig(role="global"))
    js = root._install(JobConfig(name="lm"), layout, values, version=0)
    assert not np.signbit(js.view.values[js.view.values == 0]).any()  # the view holds no -0.0
    assert js.view.checksum == checksum(js.view.values)
    for v, only in enumerate([frozenset({"a"}), frozenset({"c"}), None, frozenset({"b"})], start=1):
        js.params += np.float32(0.25)
        root._publish(js, clock_min=0, contributors=1, only=only)
        assert js.view.version == v
        assert js.log.since(v - 1, v)[-1].checksum == js.view.checksum == checksum(js.view.values), only
