"""``specforge_kimi.durable``: atomic file writes and the crash-safe directory swap's recovery."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from specforge_kimi import durable
from specforge_kimi.errors import KimiInputError


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    durable.write_atomic(target, "old")
    real_replace = os.replace

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(durable.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        durable.write_atomic(target, "new")
    monkeypatch.setattr(durable.os, "replace", real_replace)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    durable.write_atomic(target, b"new")
    assert target.read_text() == "new"


def _tree(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_recover_dir_puts_the_parked_output_back_or_drops_it(tmp_path):
    out = tmp_path / "out"
    assert durable.recover_dir(out) is None
    _tree(durable.previous_path(out), "old")  # killed between the renames: only the parked old output
    assert "restored" in durable.recover_dir(out)
    assert (out / "f").read_text() == "old" and not durable.previous_path(out).exists()
    _tree(durable.previous_path(out), "older")  # killed after the second rename: both there
    assert "removed" in durable.recover_dir(out)
    assert (out / "f").read_text() == "old" and not durable.previous_path(out).exists()


def test_replace_dir_swaps_in_the_new_tree(tmp_path):
    out = _tree(tmp_path / "out", "old")
    durable.replace_dir(_tree(tmp_path / ".out.partial-1", "new"), out)
    assert (out / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    durable.replace_dir(_tree(tmp_path / ".out.partial-2", "newer"), out)
    assert (out / "f").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_open_lock_refuses_a_link_and_never_truncates_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "x.lock").symlink_to(victim)
    with pytest.raises(KimiInputError, match="symbolic link to .*victim") as err:
        durable.open_lock(tmp_path / "x.lock")
    assert "\n" not in str(err.value) and victim.read_text() == "keep me"
    (tmp_path / "dangling.lock").symlink_to(tmp_path / "nowhere")
    with pytest.raises(KimiInputError, match="symbolic link"):
        durable.open_lock(tmp_path / "dangling.lock")
    assert not (tmp_path / "nowhere").exists()


def test_open_lock_creates_owner_only_and_refuses_what_is_not_a_file(tmp_path):
    fd = durable.open_lock(tmp_path / "a.lock")
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600 and os.get_inheritable(fd) is False
    finally:
        os.close(fd)
    (tmp_path / "d.lock").mkdir()
    os.mkfifo(tmp_path / "f.lock")
    for name in ("d.lock", "f.lock"):
        with pytest.raises(KimiInputError, match=name):
            durable.open_lock(tmp_path / name)
