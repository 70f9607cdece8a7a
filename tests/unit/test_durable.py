"""``specforge_kimi.durable``: atomic file writes and the crash-safe directory swap's recovery."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from specforge_kimi import durable
from specforge_kimi.errors import KimiInputError


def _record_syscalls(monkeypatch) -> list[tuple[str, str]]:
    """Record every fsync (by the path its fd names), replace and rename, in order, and still do them."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    def rename(src, dst):
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(durable.os, "replace", replace)
    monkeypatch.setattr(durable.os, "rename", rename)
    return events


def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    events = _record_syscalls(monkeypatch)
    durable.write_atomic(target, "new")
    assert target.read_text() == "new"
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"], events
    tmp_name = Path(events[0][1]).name
    assert tmp_name.startswith(".state.json.") and tmp_name.endswith(".tmp")
    assert events[1][1] == str(target) and events[2][1] == str(tmp_path)


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    durable.write_atomic(target, "old")

    def crash(src, dst):
        raise OSError("disk gone")

    with monkeypatch.context() as m:
        m.setattr(durable.os, "replace", crash)
        with pytest.raises(OSError, match="disk gone"):
            durable.write_atomic(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    durable.write_atomic(target, b"new")
    assert target.read_text() == "new"


def test_write_atomic_never_follows_a_link_planted_at_its_temporary_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "state.json"
    (tmp_path / f".state.json.{os.getpid()}.tmp").symlink_to(victim)  # the old, predictable name
    (tmp_path / ".state.json.planted.tmp").symlink_to(victim)
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(durable.secrets, "token_hex", lambda n: next(names))
    durable.write_atomic(target, "new")
    assert target.read_text() == "new" and victim.read_text() == "keep me"
    assert (tmp_path / ".state.json.planted.tmp").is_symlink()


def test_write_atomic_keeps_the_mode(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text("old")
    secret.chmod(0o600)
    durable.write_atomic(secret, "new")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.read_text() == "new"
    durable.write_atomic(tmp_path / "asked.json", "x", mode=0o640)
    assert stat.S_IMODE((tmp_path / "asked.json").stat().st_mode) == 0o640
    umask = os.umask(0o022)
    os.umask(umask)
    durable.write_atomic(tmp_path / "plain.json", "x")
    assert stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == 0o666 & ~umask


def test_write_atomic_refuses_a_link_and_a_directory(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "link.json").symlink_to(victim)
    with pytest.raises(KimiInputError, match=f"symbolic link to {victim}") as err:
        durable.write_atomic(tmp_path / "link.json", "new")
    assert "\n" not in str(err.value)
    assert victim.read_text() == "keep me" and (tmp_path / "link.json").is_symlink()
    (tmp_path / "d").mkdir()
    with pytest.raises(KimiInputError, match="is a directory"):
        durable.write_atomic(tmp_path / "d", "new")


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


def test_replace_dir_fsyncs_the_tree_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    out = tmp_path / "out"
    staging = _tree(tmp_path / ".out.partial-1", "new")
    events = _record_syscalls(monkeypatch)
    durable.replace_dir(staging, out)
    rename = events.index(("rename", str(out)))
    before = {path for kind, path in events[:rename] if kind == "fsync"}
    assert {str(staging / "f"), str(staging), str(tmp_path)} <= before, events
    assert ("fsync", str(tmp_path)) in events[rename + 1 :], events


def test_staged_dir_replaces_whole_or_leaves_the_old_directory_whole(tmp_path):
    out = _tree(tmp_path / "out", "old")
    (out / "extra").write_text("old only")
    with pytest.raises(RuntimeError, match="crash"):
        with durable.staged_dir(out) as staging:
            (staging / "f").write_text("half")
            raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "f").read_text() == "old" and (out / "extra").exists()
    with durable.staged_dir(out) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(f".out.partial-{os.getpid()}-")
        (staging / "f").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["f"] and (out / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_staged_dir_refuses_a_link_before_writing(tmp_path):
    real = _tree(tmp_path / "real", "theirs")
    (tmp_path / "out").symlink_to(real)
    with pytest.raises(KimiInputError, match=f"symbolic link to {real}"):
        with durable.staged_dir(tmp_path / "out"):
            raise AssertionError("not reached")
    assert (tmp_path / "out").is_symlink() and (real / "f").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "real"]
    with pytest.raises(KimiInputError, match="symbolic link"):
        durable.replace_dir(_tree(tmp_path / ".out.partial-1", "new"), tmp_path / "out")
    assert (tmp_path / "out").is_symlink() and (real / "f").read_text() == "theirs"


def test_staged_dir_clears_the_staging_of_dead_writers_only(tmp_path):
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    stale = _tree(tmp_path / f".out.partial-{proc.pid}-abcd", "stale")
    live = _tree(tmp_path / f".out.partial-{os.getppid()}-abcd", "live")
    with durable.staged_dir(tmp_path / "out") as staging:
        (staging / "f").write_text("new")
    assert not stale.exists() and live.exists()
