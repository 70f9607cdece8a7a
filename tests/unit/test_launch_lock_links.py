"""The launcher's ``launch.lock`` (``run.run_guard.acquire_lock``) never follows a link and is owner-only."""

from __future__ import annotations

import os
import stat

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.run import run_guard


def test_a_launch_lock_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / run_guard.LOCK_FILE).symlink_to(victim)
    with pytest.raises(KimiInputError, match="launch lock .* is a symbolic link") as err:
        run_guard.acquire_lock(out)
    assert "\n" not in str(err.value)
    assert victim.read_text() == "keep me\n"
    assert str(out.resolve()) not in run_guard._HELD


def test_a_new_launch_lock_is_owner_only(tmp_path):
    out = tmp_path / "run"
    try:
        run_guard.acquire_lock(out)
        lock = out / run_guard.LOCK_FILE
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
        assert lock.read_text() == f"{os.getpid()}\n"
    finally:
        run_guard.release_lock(out)
