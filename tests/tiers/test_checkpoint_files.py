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
