"""``specforge-kimi stop RECIPE``: stop everything of a run on this node, without resuming it, and remove what its
processes left.

Scope: one node. A ``kill -9`` of a launch leaves torchrun's trainer ranks running (sessions of their own): they go
on training from the samples already delivered and writing checkpoints, holding their GPU memory, until something
stops them (as in the resume drills: archive/gpu-runs/RUNS.md, the cuda_ipc kill-twice drill). ``launch --resume
--stop-stale`` stops them and resumes; this stops them and resumes nothing:

1. a live launcher of the run (the holder of ``<output_dir>/launch.lock`` as ``/proc/locks`` names it, when the
   record of who took the lock names that process -- same pid, start time and command line -- as a launcher)
   gets SIGTERM -- SpecForge's supervisor stops its services and roles as on Ctrl-C -- and SIGKILL if it has not
   let go of the lock after the grace; a holder that is not that launcher (a pid reused, another program holding
   the lock) is refused with one line and nothing is signalled;
2. every process left that carries the run's mark (:mod:`run_guard`) gets SIGTERM, then SIGKILL;
3. the cuda_ipc pools of dead capture servers and what the run's processes left in ``/dev/shm``
   (:mod:`shm_leftovers`) are removed, as ``launch`` does around each attempt.

The lock is held while it works, so no launch of the run starts meanwhile. The run's directory, checkpoints and
ledger are untouched: ``launch --resume`` continues the run later.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specforge_kimi.errors import KimiInputError
from specforge_kimi.run import run_guard


def _take_lock(out: Path, *, grace_s: float, say: Callable[[str], object]) -> int | None:
    """Hold the run's lock, stopping its launcher first if one holds it; the launcher's pid, if there was one.
    The launcher is the lock's holder as the kernel reports it (``run_guard.lock_holder``) and only where the
    holder record says a launcher took it and the process at that pid is that one (its start time and command
    line: ``run_guard.holder_problem``); both checked again before each signal. Anything else is refused with
    one line and nothing is signalled."""
    try:
        run_guard.acquire_lock(out, role="stop")
        return None
    except KimiInputError:
        pass
    pid = run_guard.lock_holder(out)
    lock = out / run_guard.LOCK_FILE
    if pid is None or pid <= 1 or pid in run_guard.ancestors():
        raise KimiInputError(
            f"{lock} is held by a process this one cannot see or must not stop "
            f"(pid {pid}; another pid namespace?): stop the run's launcher where it runs"
        )
    problem = run_guard.holder_problem(out, pid)
    if problem:
        raise KimiInputError(
            f"{lock} is held by pid {pid}, not known to be the run's launcher ({problem}); signalled nothing"
        )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if run_guard.lock_holder(out) != pid or run_guard.holder_problem(out, pid):
            break  # it let go meanwhile (or another process holds it, or has its pid, now)
        say(f"stopping the launcher (pid {pid}, {sig.name})")
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                run_guard.acquire_lock(out, role="stop")
                return pid
            except KimiInputError:
                time.sleep(0.2)
    try:
        run_guard.acquire_lock(out, role="stop")
        return pid
    except KimiInputError:
        raise KimiInputError(
            f"{lock} is still held (pid {run_guard.lock_holder(out)}) after the launcher (pid {pid}) was signalled; "
            "stop it first"
        ) from None


def stop_run(recipe: Any, *, grace_s: float = 3 * run_guard.STOP_GRACE_S, say: Callable[[str], object] = print) -> dict:
    """Steps 1-3 of the module's docstring for ``recipe``'s output directory; returns what was done."""
    from specforge_kimi.plan.roles import mps_dirs
    from specforge_kimi.plan.transport_plan import remove_stale_pools
    from specforge_kimi.run import mps
    from specforge_kimi.run.resume import read_record, run_started
    from specforge_kimi.run.shm_leftovers import remove_leftovers

    out = Path(recipe.output_dir)
    if not out.is_dir():
        raise KimiInputError(f"no run in {out} (the recipe's output_dir): nothing to stop")
    launcher = _take_lock(out, grace_s=grace_s, say=say)
    try:
        left = run_guard.run_processes(out)
        if left:
            say(f"stopping {len(left)} processes of the run: {[pid for pid, _ in left]}")
        stopped = run_guard.stop(left) if left else []
        pools = remove_stale_pools(recipe)
        shm = remove_leftovers(run_started(read_record(out)))
        mps_left = mps.stop_leftover(mps_dirs(recipe))
        if mps_left:
            say(mps_left)
    finally:
        run_guard.release_lock(out)
    done = {"launcher": launcher, "stopped": stopped, "pools_removed": pools, "shm_removed": shm, "mps": mps_left}
    say(
        f"stopped {out}: launcher {'pid ' + str(launcher) if launcher else 'not running'}, {len(stopped)} processes, "
        f"{len(pools)} stale pools and {len(shm)} /dev/shm files removed; `launch --resume` continues the run"
    )
    return done


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``stop`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument("recipe", help="the run's recipe (its output_dir names the run)")


def run(args: Any) -> int:
    from specforge_kimi.plan.run_plan import load_recipe

    stop_run(load_recipe(args.recipe))
    return 0
