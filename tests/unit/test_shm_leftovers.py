"""``run.shm_leftovers``: what dead processes of a run left in ``/dev/shm`` goes; nothing in use, nothing of
another name or owner, nothing older than the run. The leak itself reproduced with SGLang's own writer."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_kimi.run.shm_leftovers import held, matching, remove_leftovers


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _proc(root: Path, pid: int, *, state: str = "S", fds: dict[str, str] | None = None, maps: str = "") -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_text(f"{pid} (python3 x) {state} 1 1 1\n")
    for fd, target in (fds or {}).items():
        os.symlink(target, d / "fd" / fd)
    (d / "maps").write_text(maps)


def test_dead_processes_leftovers_go_and_nothing_else(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    proc.mkdir()
    live, zombie, dead, threads = 4101, 4102, 4103, 4104
    _proc(proc, live)
    _proc(proc, zombie, state="Z")
    _proc(proc, threads, state="Z")  # its main thread exited, two others run on
    for tid in ("4104", "4105", "4106")[1:]:
        (proc / str(threads) / "task" / tid).mkdir(parents=True)
    gone = [
        "sglang_loads_0bb92f9efecd_9ba6789d.shm",
        f"sem.loky-{dead}-oh4t8h3g",
        f"cuda.shm.0.{dead:x}.1",
        f"torch_{dead}_1702042115_0",
        f"torch_{zombie}_4033725202_0",  # a zombie holds nothing
    ]
    kept = [
        f"torch_{live}_1_0",  # its creator runs
        f"sem.loky-{threads}-abc",  # its creator's threads run
        f"cuda.shm.0.{live:x}.1",
        "sglang_loads_heldopen_01234567.shm",  # held open by a live process
        "sglang_loads_heldmapped_89abcdef.shm",  # mapped by a live process
        "sfk-ipc-0ad28fb3abed42e1.slots",  # not one of these names (the pool's own cleanup handles it)
        "sglang_loads_x.shm",  # not SGLang's form
        "notes.txt",
    ]
    for name in gone + kept:
        (shm / name).write_bytes(b"x")
    mapped = os.stat(shm / "sglang_loads_heldmapped_89abcdef.shm")
    _proc(
        proc,
        4200,
        fds={"7": str(shm / "sglang_loads_heldopen_01234567.shm")},
        # by inode, whatever path the process sees it under (another mount of the tmpfs)
        maps=(
            "7f00-7f01 r-xp 00000000 00:00 0 [vdso]\n"
            f"7f01-7f02 rw-s 00000000 {os.major(mapped.st_dev):02x}:{os.minor(mapped.st_dev):02x} {mapped.st_ino} "
            "/elsewhere/sglang_loads_heldmapped_89abcdef.shm\n"
        ),
    )
    old = shm / f"torch_{dead}_9_9"  # older than the run
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.symlink(shm / "notes.txt", shm / f"torch_{dead}_5_5")  # a link is never followed nor removed
    (shm / f"torch_{dead}_6_6").mkdir()  # nor a directory
    stats = [os.stat(shm / n) for n in ("sglang_loads_heldopen_01234567.shm", "sglang_loads_heldmapped_89abcdef.shm")]
    assert held(proc) >= {(st.st_dev, st.st_ino) for st in stats}

    removed = remove_leftovers(time.time() - 60, shm, proc)

    assert sorted(removed) == sorted(gone)
    left = set(os.listdir(shm))
    assert left == set(kept) | {old.name, f"torch_{dead}_5_5", f"torch_{dead}_6_6"}
    assert remove_leftovers(time.time() - 60, shm, proc) == []  # idempotent
    # what the drills require gone: every such name since the run, held or not
    assert sorted(matching(time.time() - 60, shm)) == sorted(
        n for n in kept if n.startswith(("torch", "cuda", "sem", "sglang_loads_h"))
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root to make")
def test_another_users_leftovers_are_never_removed(tmp_path):
    """A file of another user with a leftover's name, its creator gone, held by no one: kept -- root could
    unlink it (the sticky bit of /dev/shm does not stop root), and it is not this user's run's to remove."""
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    proc.mkdir()
    dead = _dead_pid()
    theirs, ours = f"torch_{dead}_1_1", f"torch_{dead}_2_2"
    for name in (theirs, ours):
        (shm / name).write_bytes(b"x")
    os.chown(shm / theirs, 65534, 65534)
    assert remove_leftovers(time.time() - 60, shm, proc) == [ours]
    assert sorted(os.listdir(shm)) == [theirs]
    assert theirs not in matching(time.time() - 60, shm)


@pytest.mark.parametrize("owner", ["ours", "theirs"])
def test_a_leftover_replaced_after_the_listing_is_kept(tmp_path, monkeypatch, owner):
    """The name is looked at again just before the unlink: a file put at it after the listing (a new one of a live
    process of ours: another inode), or the file given to another user meanwhile, is not the garbage that was
    found, and stays."""
    from specforge_kimi.run import shm_leftovers

    if owner == "theirs" and os.geteuid() != 0:
        pytest.skip("a file of another user needs root to make")
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    proc.mkdir()
    name = f"torch_{_dead_pid()}_1_1"
    (shm / name).write_bytes(b"x")
    real_held = shm_leftovers.held

    def held_then_replace(proc_dir):  # runs after the listing, before the unlink
        if owner == "theirs":  # the same file, given to another user
            (shm / name).write_bytes(b"new")
            os.chown(shm / name, 65534, 65534)
        else:  # a new file of ours, made while the old one still exists: another inode
            (shm / "new").write_bytes(b"new")
            os.replace(shm / "new", shm / name)
        return real_held(proc_dir)

    monkeypatch.setattr(shm_leftovers, "held", held_then_replace)
    assert remove_leftovers(time.time() - 60, shm, proc) == []
    assert (shm / name).read_bytes() == b"new"


def test_a_missing_shm_directory_is_nothing_to_do(tmp_path):
    assert remove_leftovers(0.0, tmp_path / "absent", tmp_path) == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_sglang_load_snapshot_left_by_a_killed_scheduler_is_removed(tmp_path):
    """The leak as SGLang 0.5.14 makes it: its load-snapshot writer (created by every scheduler) never unlinks its
    file; a SIGKILLed process leaves it in /dev/shm. Held while the process lives, removed once it is gone."""
    pytest.importorskip("sglang")
    since = time.time() - 1
    code = (
        "import sys, time, uuid\n"
        "from sglang.srt.managers.load_snapshot import ShmLoadSnapshotWriter, shm_path_for\n"
        "w = ShmLoadSnapshotWriter(shm_path_for(uuid.uuid4().hex[:12]), 1, 0)\n"
        "print(w.path, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the writer did not start"
        path = Path(proc.stdout.readline().strip())
        assert path.parent == Path("/dev/shm") and path.is_file(), path
        assert path.name not in remove_leftovers(since)  # in use: kept
        assert path.is_file()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert path.is_file()  # what the killed scheduler left
    assert path.name in remove_leftovers(since)
    assert not path.exists()


def test_run_attempts_removes_what_an_attempt_left(tmp_path, monkeypatch):
    """``resume.run_attempts`` cleans ``/dev/shm`` around each attempt of the run (the launch and the drills)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm")
    from specforge_kimi.run import resume

    leftover = Path("/dev/shm") / f"torch_{_dead_pid()}_{os.getpid()}_0"
    said = []

    def run(_plan):
        leftover.write_bytes(b"x")  # what a scheduler killed at the end of the attempt leaves
        return 0

    record = {"attempts": [{"started_utc": resume._utc()}]}
    monkeypatch.setattr(resume, "begin_attempt", lambda *a, **k: "plan")
    monkeypatch.setattr(resume, "read_record", lambda out: resume.RunRecord.model_validate(_record(record)))
    monkeypatch.setattr("specforge_kimi.plan.transport_plan.remove_stale_pools", lambda r: [])

    class _Recipe:
        output_dir = str(tmp_path)

    try:
        assert resume.run_attempts(_Recipe(), "plan", run, resume=False, say=said.append) == 0
        assert not leftover.exists()
        assert any(leftover.name in line for line in said), said
    finally:
        leftover.unlink(missing_ok=True)


def _record(partial: dict) -> dict:
    attempt = {
        "attempt": 1,
        "config": "c",
        "control_dir": "d",
        "supervisor_dir": "s",
        "logs_dir": "l",
        **partial["attempts"][0],
    }
    return json.loads(json.dumps({"run_id": "r", "consumer_quantum": 1, "attempts": [attempt]}))


def test_a_creator_there_but_unreadable_counts_as_running(tmp_path):
    """A process directory whose ``stat`` cannot be read is not taken for a dead creator (its files stay)."""
    from specforge_kimi.run.shm_leftovers import _running

    (tmp_path / "77").mkdir()  # there, no readable stat
    assert _running(77, tmp_path)
    assert not _running(78, tmp_path)  # gone
