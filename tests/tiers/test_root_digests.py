"""The root hashes only the blocks a version changed (ps.core.view), and what it publishes is
still the whole view's checksum: with initial values holding -0.0 (which adding +0.0 would
turn into +0.0 behind a stale digest), and with deltas of some keys only (an outer job's
fragments)."""

from __future__ import annotations

import asyncio

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, ServerConfig
from ps.core.tensors import split
from ps.core.types import PushMeta, StepInfo
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



def test_a_version_carries_no_frozen_key_and_hashes_none_of_its_blocks():
    """A frozen key never moves (fixed at creation): its zeros went down in every delta, and
    every tier hashed its blocks, which in a fine-tune are most of the model."""
    layout = Layout([KeySpec("backbone", (3 * BLOCK,), kind="frozen"), KeySpec("head", (5,)),
                     KeySpec("bn.mean", (2,), kind="buffer")])
    values = np.linspace(-1, 1, layout.numel, dtype=np.float32)
    rehashed = []

    async def one_step():
        root = Root(ServerConfig(role="global"))
        await root.start()
        await root.create_job(JobConfig(name="ft"), layout, values)
        await root.register("ft", "w0", "worker", "", last_seq=0, incarnation=7)
        js = root.job("ft")
        rehash = js.view.rehash
        js.view.rehash = lambda spans=None: (rehashed.append(spans), rehash(spans))[1]
        grad = np.ones(layout.numel, np.float32)
        meta = PushMeta("ft", "w0", seq=1, base_version=0, incarnation=7, step=StepInfo(absent=(0,), buffers=1))
        ack = await root.push(meta, split(layout, grad, get_codec("fp32"), only=frozenset({"head", "bn.mean"})),
                              bytes(16))
        await root.stop()
        return ack, js

    ack, js = asyncio.run(one_step())
    assert ack.applied_version == 1
    entry = js.log.since(0, 1)[-1]
    assert {c.key for c in entry.chunks} == {"head", "bn.mean"}
    assert sorted(rehashed[0]) == sorted(layout.spans(["head", "bn.mean"]))
    assert entry.checksum == js.view.checksum == checksum(js.view.values)
    assert np.array_equal(js.view.values[:3 * BLOCK], values[:3 * BLOCK])
    assert np.array_equal(js.view.values[3 * BLOCK:], js.params[3 * BLOCK:])
    assert not np.array_equal(js.view.values[3 * BLOCK:], values[3 * BLOCK:])  # head and buffer moved
