"""``specforge-kimi stop``: the launcher stopped through its lock, the run's marked processes stopped (a trainer
rank a ``kill -9`` left behind), what they left in ``/dev/shm`` removed, the run's files kept; one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.run import run_guard
from specforge_kimi.run.stop import stop_run

ROOT = Path(__file__).resolve().parents[2]


def _spawn(code: str, out: Path) -> subprocess.Popen:
    env = {**os.environ, run_guard.RUN_DIR_ENV: str(out.resolve())}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, start_new_session=True, stdout=subprocess.PIPE, text=True
    )


def _recipe(out: Path):
    return types.SimpleNamespace(
        output_dir=str(out),
        server=types.SimpleNamespace(transport="mooncake"),
        overlap=types.SimpleNamespace(mps=False),
    )


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_stop_stops_the_launcher_and_what_a_kill_left_and_cleans_shm(tmp_path):
    from specforge_kimi.run.resume import RECORD_FILE, _utc

    out = tmp_path / "run"
    out.mkdir()
    (out / RECORD_FILE).write_text(
        json.dumps(
            {
                "run_id": "r",
                "consumer_quantum": 1,
                "attempts": [
                    {
                        "attempt": 1,
                        "started_utc": _utc(),
                        "config": "c",
                        "control_dir": "d",
                        "supervisor_dir": "s",
                        "logs_dir": "l",
                    }
                ],
            }
        )
    )
    (out / "r-step20").mkdir()  # a checkpoint: kept
    launcher = _spawn(
        "import time, sys\n"
        "from pathlib import Path\n"
        "from specforge_kimi.run import run_guard\n"
        f"run_guard.acquire_lock(Path({str(out)!r}))\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n",
        out,
    )
    rank = _spawn("import time; print('up', flush=True); time.sleep(600)", out)  # a rank left by a kill -9
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = Path("/dev/shm") / f"torch_{dead.pid}_{os.getpid()}_7"
    try:
        assert launcher.stdout.readline().strip() == "locked" and rank.stdout.readline().strip() == "up"
        leftover.write_bytes(b"x")
        said = []
        done = stop_run(_recipe(out), grace_s=5.0, say=said.append)
        assert done["launcher"] == launcher.pid
        assert launcher.wait(timeout=10) == -signal.SIGTERM and rank.wait(timeout=10) == -signal.SIGTERM
        assert rank.pid in done["stopped"] and leftover.name in done["shm_removed"] and not leftover.exists()
        assert not run_guard.run_processes(out)
        assert (out / "r-step20").is_dir() and (out / RECORD_FILE).is_file()  # still resumable
        run_guard.acquire_lock(out)  # let go of: a launch may start
        run_guard.release_lock(out)
        assert any("stopped" in line and "launch --resume" in line for line in said), said
    finally:
        for p in (launcher, rank):
            if p.poll() is None:
                p.kill()
                p.wait()
        leftover.unlink(missing_ok=True)


def test_stop_with_nothing_running_changes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    done = stop_run(_recipe(out), say=lambda _m: None)
    assert done == {"launcher": None, "stopped": [], "pools_removed": [], "shm_removed": [], "mps": None}
    assert (out / "keep.txt").read_text() == "x"


def test_stop_refuses_a_run_that_does_not_exist(tmp_path, capsys):
    from specforge_kimi.cli import main

    with pytest.raises(KimiInputError, match="nothing to stop"):
        stop_run(_recipe(tmp_path / "absent"), say=lambda _m: None)
    raw = yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp1-h200.yaml").read_text())
    raw["output_dir"] = str(tmp_path / "absent")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["stop", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "nothing to stop" in err[0], err


def test_stop_signals_the_lock_holder_the_kernel_names_not_the_pid_in_the_file(tmp_path):
    """The lock file's text can name an earlier holder or a reused pid: ``stop`` signals the holder that
    ``/proc/locks`` reports, and a bystander whose pid the file names is left alone."""
    out = tmp_path / "run"
    out.mkdir()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    launcher = _spawn(
        "import os, time\n"
        "from pathlib import Path\n"
        "from specforge_kimi.run import run_guard\n"
        f"out = Path({str(out)!r})\n"
        "run_guard.acquire_lock(out)\n"
        f"(out / run_guard.LOCK_FILE).write_text('{bystander.pid}\\n')  # a stale pid in the file\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(600)\n",
        out,
    )
    try:
        assert int(launcher.stdout.readline()) == launcher.pid
        assert run_guard.lock_holder(out) == launcher.pid
        done = stop_run(_recipe(out), grace_s=5.0, say=lambda _m: None)
        assert done["launcher"] == launcher.pid and launcher.wait(timeout=10) == -signal.SIGTERM
        assert bystander.poll() is None  # never signalled
        assert run_guard.lock_holder(out) is None
    finally:
        for p in (launcher, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()


LAUNCHER = (
    "import os, sys, time\n"
    "from pathlib import Path\n"
    "from specforge_kimi.run import run_guard\n"
    "run_guard.acquire_lock(Path(sys.argv[1]), role=sys.argv[2])\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)
FLOCK_ONLY = (  # a program that holds launch.lock without being a launcher (flock(1), an editor's lock, ...)
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1] + '/launch.lock', os.O_RDWR | os.O_CREAT, 0o600)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)


def _edit_record(out: Path, **changes) -> None:
    path = out / run_guard.HOLDER_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("case", ["pid_reused", "other_command_line", "another_stop", "other_program"])
def test_stop_signals_nothing_but_the_launcher_that_took_the_lock(tmp_path, case):
    """The lock's holder is signalled only where the holder record names it -- same pid, same start time, same
    command line -- as a launcher. A process that got the launcher's pid later (the record's start time is
    another), one whose command line differs, a ``stop`` holding the run, or a program that flocked launch.lock
    without a launch: one line, nothing signalled, the holder runs on."""
    out = tmp_path / "run"
    out.mkdir()
    if case == "other_program":  # a launcher took the lock once and is gone; its record stays
        subprocess.run([sys.executable, "-c", LAUNCHER.replace("time.sleep(600)", "pass"), str(out), "launch"])
        holder = subprocess.Popen(
            [sys.executable, "-c", FLOCK_ONLY, str(out)], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
    else:
        role = "stop" if case == "another_stop" else "launch"
        holder = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(out), role], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
    try:
        assert int(holder.stdout.readline()) == holder.pid == run_guard.lock_holder(out)
        if case == "pid_reused":
            start = json.loads((out / run_guard.HOLDER_FILE).read_text())["start"]
            _edit_record(out, start=str(int(start) - 1))  # the launcher that took the lock started earlier
        elif case == "other_command_line":
            _edit_record(out, cmdline=["python", "-m", "specforge_kimi", "launch", "other.yaml"])
        said = []
        with pytest.raises(KimiInputError, match="signalled nothing") as err:
            stop_run(_recipe(out), grace_s=2.0, say=said.append)
        assert "\n" not in str(err.value) and str(holder.pid) in str(err.value)
        with pytest.raises(subprocess.TimeoutExpired):
            holder.wait(timeout=1.0)  # not signalled: still running
        assert run_guard.lock_holder(out) == holder.pid and not any("stopping" in line for line in said)
    finally:
        holder.kill()
        holder.wait()


def test_stop_never_signals_a_launcher_it_runs_under(tmp_path):
    """A ``stop`` started from inside the launch (its own ancestor holds the lock, as the launcher that took it)
    refuses with one line instead of signalling the process it runs under."""
    out = tmp_path / "run"
    out.mkdir()
    code = (
        "import json, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from specforge_kimi.run import run_guard\n"
        "run_guard.acquire_lock(Path(sys.argv[1]))\n"
        "stop = ('import sys, types\\n'\n"
        "        'from specforge_kimi.run.stop import stop_run\\n'\n"
        "        'r = types.SimpleNamespace(output_dir=sys.argv[1], server=types.SimpleNamespace(transport=\"mooncake\"), overlap=types.SimpleNamespace(mps=False))\\n'\n"
        "        'stop_run(r, grace_s=2.0)\\n')\n"
        "r = subprocess.run([sys.executable, '-c', stop, sys.argv[1]], capture_output=True, text=True)\n"
        "print(json.dumps({'rc': r.returncode, 'err': r.stderr.strip().splitlines()[-1:]}), flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = launcher.stdout.readline()
        assert line, f"the launcher died (status {launcher.wait(timeout=10)}): its own stop signalled it"
        child = json.loads(line)
        assert child["rc"] != 0 and "must not stop" in child["err"][0], child
        assert launcher.poll() is None and run_guard.lock_holder(out) == launcher.pid
    finally:
        launcher.kill()
        launcher.wait()
