"""One `hps launch` or `hps demo` per log directory: a second one replaced the first one's admin
token and deleted its logs under it (its tiers read the token once, at start, so the first
cluster's clients were locked out)."""

from __future__ import annotations

import pytest

from ps.tiers import checkpoint
from ps.tools.launch import Cluster, default_topology


def test_a_second_cluster_on_a_log_directory_in_use_is_refused_before_touching_it(tmp_path):
    held = checkpoint.hold(tmp_path, "hps launch or hps demo")  # the first launcher
    (tmp_path / "root.log").write_text("the first cluster's log\n")
    try:
        with pytest.raises(OSError, match="in use by another hps launch or hps demo .*--logdir of its own"):
            Cluster.start(default_topology(), tmp_path, secure=True)
        assert (tmp_path / "root.log").read_text() == "the first cluster's log\n"
        assert not (tmp_path / "secrets").exists()
    finally:
        held.close()
