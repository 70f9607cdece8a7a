"""``specforge-kimi stop RECIPE``: stop everything of a run on this node, without resuming it, and remove what its
processes left.

Scope: one node. A ``kill -9`` of a launch leaves torchrun's trainer ranks running (sessions of their own): they go
on training from the samples already delivered and writing checkpoints, holding their GPU memory, until something
stops them (one H200, 2026-12-04: from step 57 to 113). ``launch --resume --stop-stale`` stops them and resumes;
this stops them and resumes nothing:

1. a live launcher of the run (the holder of ``<output_dir>/launch.lock``) gets SIGTERM -- SpecForge's supervisor
   stops its services and roles as on Ctrl-C -- and SIGKILL if it has not let go of the lock after the grace;
2. every process left that carries the run's mark (:mod:`run_guard`) gets SIGTERM, then SIGKILL;
3. the cuda_ipc pools of dead capture servers and what the run's processes left in ``/dev/shm``
   (:mod:`shm_leftovers`) are removed, as ``launch`` does around each attempt.

The lock is held while it works, so no launch of the run starts meanwhile. The run's directory, checkpoints and
ledger are untouched: ``launch --resume`` continues the run later.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from specforge_kimi.errors import KimiInputError
from specforge_kimi.online import run_guard


def _take_lock(out: Path, *, grace_s: float, say) -> int | None:
    """Hold the run's lock, stopping its launcher first if one holds it; the launcher's pid, if there was one."""
    try:
        run_guard.acquire_lock(out)
        return None
    except KimiInputError:
        pass
    text = (out / run_guard.LOCK_FILE).read_text(errors="replace").strip()
    if not text.isdigit():
        raise KimiInputError(f"{out / run_guard.LOCK_FILE} is held by a process that wrote no pid; stop it first")
    pid = int(text)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        say(f"stopping the launcher (pid {pid}, {sig.name})")
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                run_guard.acquire_lock(out)
                return pid
            except KimiInputError:
                time.sleep(0.2)
    raise KimiInputError(f"the launcher (pid {pid}) still holds {out / run_guard.LOCK_FILE} after SIGKILL")


def stop_run(recipe, *, grace_s: float = 3 * run_guard.STOP_GRACE_S, say=print) -> dict:
    """Steps 1-3 of the module's docstring for ``recipe``'s output directory; returns what was done."""
    from specforge_kimi.online.resume import read_record, run_started
    from specforge_kimi.online.shm_leftovers import remove_leftovers
    from specforge_kimi.online.transport_plan import remove_stale_pools

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
    finally:
        run_guard.release_lock(out)
    done = {"launcher": launcher, "stopped": stopped, "pools_removed": pools, "shm_removed": shm}
    say(
        f"stopped {out}: launcher {'pid ' + str(launcher) if launcher else 'not running'}, {len(stopped)} processes, "
        f"{len(pools)} stale pools and {len(shm)} /dev/shm files removed; `launch --resume` continues the run"
    )
    return done


def add_parser(sub) -> None:
    p = sub.add_parser(
        "stop",
        help="stop every process of a run on this node (its launcher, trainer ranks a kill -9 left behind) and "
        "remove what they left; the run stays resumable",
    )
    p.add_argument("recipe", help="the run's recipe (its output_dir names the run)")
    p.set_defaults(func=run)


def run(args) -> int:
    from specforge_kimi.online.recipes import load_recipe

    stop_run(load_recipe(args.recipe))
    return 0
