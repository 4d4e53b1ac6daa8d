"""A checkpoint's job directory is named durably even when the first save failed after its
rename (``ps.tiers.checkpoint.save_bytes``)."""

from __future__ import annotations

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
