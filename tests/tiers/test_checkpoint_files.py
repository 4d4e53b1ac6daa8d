"""A checkpoint's job directory is named durably even when the first save failed after its
rename (``ps.tiers.checkpoint.save_bytes``)."""

from __future__ import annotations

import os
import threading

import pytest

from ps.tiers import checkpoint


def test_a_retried_first_checkpoint_still_fsyncs_the_parent_directory(tmp_path, monkeypatch):
    job = tmp_path / "lm"
    synced, fail_parent = [], [True]
    real = checkpoint.fsync_dir

    def flaky(path):
        if path == tmp_path and fail_parent[0]:
            fail_parent[0] = False
            raise OSError(5, "Input/output error (simulated)")
        synced.append(path)
        real(path)
    monkeypatch.setattr(checkpoint, "fsync_dir", flaky)
    with pytest.raises(OSError):
        checkpoint.save_bytes(job, 0, b"first try")   # renamed into place, parent not fsynced
    assert checkpoint.list_checkpoints(job)
    checkpoint.save_bytes(job, 0, b"second try")      # the retry
    assert tmp_path in synced


def test_a_second_root_on_a_checkpoint_directory_in_use_is_refused_and_may_start_once_it_is_free(tmp_path):
    """Two roots on one directory (one orphaned by a launcher that crashed, a second pod on one
    volume) appended to the same write-ahead logs and overwrote each other's checkpoints.
    `hps reshard` of a directory a root serves is refused the same way."""
    import asyncio
    import errno
    import os

    from ps.core.config import ServerConfig
    from ps.tiers.root import Root
    from ps.tools.reshard import reshard_dirs

    first = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path)))
    with pytest.raises(OSError, match=f"in use by another root \\(pid {os.getpid()}\\)") as refused:
        Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path)))
    assert refused.value.errno == errno.EBUSY
    (tmp_path / "lm").mkdir()
    checkpoint.save(tmp_path / "lm", 0, {}, {"version": 0})
    with pytest.raises(OSError, match="in use by another root"):
        reshard_dirs([tmp_path], [tmp_path.parent / "new0", tmp_path.parent / "new1"], "lm")
    asyncio.run(first.stop())
    second = Root(ServerConfig(role="global", checkpoint_dir=str(tmp_path)))
    asyncio.run(second.stop())


def test_two_writers_of_one_file_never_publish_each_others_half_written_bytes(tmp_path, monkeypatch):
    """A standby's checkpoint thread of version V and its rewrite of V from the primary's state
    wrote one file at once. Both used the same temporary name: the second truncated the first's
    temporary file under it and published its own, and the first's rename then failed (or, a
    moment later, published the other's half-written bytes). Each writer's name is its own now."""
    path = tmp_path / "ckpt-000000000007.npz"
    first_syncing, second_done = threading.Event(), threading.Event()
    fsync = os.fsync
    first = threading.get_ident()

    def held_fsync(fd):
        if threading.get_ident() == first and not first_syncing.is_set():
            first_syncing.set()
            assert second_done.wait(10)  # the second writer runs whole while the first is here
        fsync(fd)
    monkeypatch.setattr(os, "fsync", held_fsync)
    errors = []

    def second():
        assert first_syncing.wait(10)
        try:
            checkpoint.write_atomic(path, b"B" * 1000, tmp=tmp_path / ".ckpt-000000000007.npz.tmp")
        except BaseException as exc:
            errors.append(exc)
        second_done.set()
    t = threading.Thread(target=second)
    t.start()
    checkpoint.write_atomic(path, b"A" * 5000, tmp=tmp_path / ".ckpt-000000000007.npz.tmp")
    t.join(10)
    assert not errors and path.read_bytes() == b"A" * 5000  # both whole; the last rename wins
    assert not list(tmp_path.glob(".*.tmp"))


def test_temporary_files_a_crash_left_are_swept_at_start(tmp_path):
    """Each writer's temporary name is its own, so a crash mid-write leaves one behind for
    good (model-sized for a checkpoint): a root sweeps them at start, under its lock."""
    job = tmp_path / "j"
    job.mkdir()
    left = [tmp_path / ".declared.json.12-34.tmp", job / ".ckpt-000000000004.npz.99-1.tmp"]
    kept = [job / "ckpt-000000000004.npz", job / "wal-000000000005.log", tmp_path / "notes.tmp"]
    for p in left + kept:
        p.write_bytes(b"x")
    assert checkpoint.sweep_temporary(tmp_path) == 2
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)
