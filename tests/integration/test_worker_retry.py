"""A worker retries a tier's outage for as long as the tier would hold it (its member timeout,
announced at registration), at least RETRY_FLOOR_S, or an explicit retry_s; each retry window
logs one line when it opens and one when it ends."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest

from ps.core.config import JobConfig
from ps.core.errors import Internal, Unavailable
from ps.core.view import KeySpec, Layout
from worker import ParameterClient
from worker.client import RETRY_FLOOR_S


def test_the_retry_window_follows_the_tiers_member_timeout(tree):
    root = tree.add("root", "global", heartbeat_s=0.5, member_timeout_s=RETRY_FLOOR_S + 30)
    c = ParameterClient(root, job="held", worker_id="w0")
    assert c.retry_window_s == RETRY_FLOOR_S  # nothing announced before registering
    c.create_job(JobConfig(name="held"), Layout([KeySpec("w", (2,))]), np.zeros(2, np.float32))
    c.register()
    try:
        assert c.member_timeout_s == RETRY_FLOOR_S + 30 and c.retry_window_s == RETRY_FLOOR_S + 30
        c.retry_s = 2.0  # an explicit window wins
        assert c.retry_window_s == 2.0
    finally:
        c.close()


def test_one_line_opens_a_retry_window_and_one_ends_it(caplog):
    with socket.socket() as s:  # a port nobody serves on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    c = ParameterClient(dead, job="j", worker_id="w9", timeout_s=0.2, retry_s=0.6)
    try:
        with caplog.at_level(logging.WARNING, logger="hps.worker"), pytest.raises(Unavailable):
            c.register()
    finally:
        c.close()
    # this client's lines only: clients other tests left open may still be heart-beating
    lines = [r for r in caplog.records if r.name == "hps.worker" and r.getMessage().startswith("w9")]
    assert [r.event for r in lines] == ["worker.retrying", "worker.gave_up"], [r.getMessage() for r in lines]
    opened = lines[0].getMessage()
    assert f"register at {dead} failed" in opened and "retrying until" in opened and "(1s window: retry_s)" in opened
    assert "giving up" in lines[1].getMessage()


def test_snapshots_that_keep_failing_their_checksum_end_the_pull_with_a_sentence(tree, monkeypatch, caplog):
    """A delta that fails its checksum is followed by a snapshot (a wrong base); a snapshot that
    fails too is corruption or tiers of another release. Three in a row end the pull with a
    sentence, after a pause each, instead of pulling snapshots in a tight loop (a worker of a
    newer release than its tiers did so 28,883 times in a chaos run)."""
    import ps.core.view

    root = tree.add("root", "global")
    layout = Layout([KeySpec("w", (64,))])
    c = ParameterClient(root, job="crc", worker_id="w0", timeout_s=10)
    c.create_job(JobConfig(name="crc"), layout, np.ones(64, np.float32))
    c.register()
    try:
        c.view.epoch = 0  # what a failed delta leaves: ask for a snapshot
        monkeypatch.setattr(ps.core.view, "combine", lambda digests: 1)  # this worker computes another one
        with caplog.at_level(logging.WARNING, logger="hps.worker"), \
                pytest.raises(Internal, match="3 snapshots in a row failed their checksum"):
            c.pull()
        assert sum("fails its checksum" in r.getMessage() for r in caplog.records) == 3
    finally:
        monkeypatch.undo()
        c.close()


def test_a_delta_that_fails_its_checksum_is_followed_by_a_snapshot_even_with_no_time_to_wait(tree):
    """An async step pulls with no wait (wait_s=0). A delta that failed its checksum left the
    view at epoch 0 and the deadline already past, so the pull raised TimedOut into the script
    instead of taking the snapshot its docstring promises; a script that went on pushed with
    view epoch 0, which the root's lineage check skips (review)."""
    import dataclasses

    root = tree.add("root", "global")
    layout = Layout([KeySpec("w", (64,))])
    c = ParameterClient(root, job="bad", worker_id="w0", timeout_s=10)
    d = ParameterClient(root, job="bad", worker_id="w1", timeout_s=10)
    c.create_job(JobConfig(name="bad", mode="async"), layout, np.zeros(64, np.float32))
    try:
        for x in (c, d):
            x.register()
            x.pull()
        d.push(np.ones(64, np.float32))  # version 1, c still at 0

        def corrupt():
            log = tree.tier("root").jobs["bad"].log
            newest = log._entries[-1]
            log._entries[-1] = dataclasses.replace(newest, checksum=newest.checksum ^ 1)
        tree.lt.call(corrupt)
        c.pull(wait_s=0.0)  # the delta fails; the snapshot follows
        assert c.view.ready and c.view.version == 1
        assert c.view.values.tobytes() == tree.view("root", "bad")[3].tobytes()
    finally:
        c.close()
        d.close()
