"""Token and key files (ps.server.auth.write_secret): whole, and the owner's alone, whatever
the path held before. Opening the path itself kept an existing file's mode (a re-used 0644
``--token-file`` then held the job's token for everyone) and wrote through a planted link."""

from __future__ import annotations

import os
import stat

from ps.server.auth import read_token_file, write_secret
from ps.tools.cli import main


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_secret_replaces_a_looser_file_and_a_link_and_is_0600(tmp_path):
    loose = tmp_path / "token"
    loose.write_text("old\n")
    loose.chmod(0o644)
    write_secret(loose, "s3cret\n")
    assert _mode(loose) == 0o600 and read_token_file(str(loose)) == "s3cret"
    target = tmp_path / "elsewhere"
    target.write_text("theirs\n")
    link = tmp_path / "linked"
    link.symlink_to(target)
    write_secret(link, "mine\n")
    assert target.read_text() == "theirs\n"  # not written through
    assert not link.is_symlink() and _mode(link) == 0o600 and link.read_text() == "mine\n"
    write_secret(tmp_path / "ca.pem", b"cert", private=False)
    assert _mode(tmp_path / "ca.pem") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.pem", "elsewhere", "linked", "token"]  # no temp left


def test_hps_job_create_writes_the_job_token_0600_over_a_looser_file(tree, tmp_path, monkeypatch, capsys):
    admin = tmp_path / "admin"
    admin.write_text("admin-token-for-tests-0123456789abcdef\n")
    root = tree.add("root", "global", admin_token_file=str(admin))
    out = tmp_path / "job.token"
    out.write_text("")
    out.chmod(0o644)
    monkeypatch.setenv("HPS_ADMIN_TOKEN_FILE", str(admin))
    assert main(["job", "create", "j", "--address", root, "--token-file", str(out)]) in (0, None)
    assert "mode 0600" in capsys.readouterr().out
    assert _mode(out) == 0o600 and len(read_token_file(str(out))) > 20
