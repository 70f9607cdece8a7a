"""``specforge_kimi.procfs.stat_fields``: the one ``/proc/<pid>/stat`` parser (run guard, services, the pool)."""

from __future__ import annotations

import os
import subprocess
import sys

from specforge_kimi.procfs import stat_fields
from specforge_kimi.transport.pool import process_start


def test_own_process_fields():
    fields = stat_fields(os.getpid())
    assert fields[0] in "RS"
    assert int(fields[1]) == os.getppid()
    assert int(fields[2]) == os.getpgrp()
    assert fields[19] == process_start(os.getpid())


def test_command_name_with_spaces_and_parentheses(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (a) b (c d) S 7 42 42 0 -1 " + " ".join(["0"] * 13) + " 123456 0\n")
    fields = stat_fields(42, tmp_path)
    assert fields[:3] == ["S", "7", "42"]
    assert fields[19] == "123456"


def test_missing_or_unreadable_process_reads_as_no_fields(tmp_path):
    assert stat_fields(42, tmp_path) == []
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("garbage without the name's parenthesis")
    assert stat_fields(43, tmp_path) == []
    assert process_start(2**22 + 12345) is None  # above Linux's pid_max: never a process


def test_group_of_a_child_session():
    from specforge_kimi.run.services import group_pids

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert group_pids(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert group_pids(child.pid) == []
