"""Test-only consumer entry for the whole-run resume drills: ``specforge_kimi train`` whose checkpoint write
of step ``STEP`` holds still for ``SECONDS`` at ``PHASE`` (``RESUME_DRILL_SLOW_SAVE=STEP:PHASE:SECONDS``)
after touching ``RESUME_DRILL_FLAG`` (which then holds ``STEP PHASE PID``) -- so the drill's outside SIGKILL of
every process lands *during* that write. ``+N`` for ``STEP`` holds the N-th checkpoint this process writes,
whatever its step: a resumed attempt's first checkpoint is known only once it has resumed (ranks of the killed
attempt may write checkpoints until the next launch stops them). On CPU a tiny checkpoint is written in milliseconds, too fast to hit from outside; the pause only
widens the window, the kill is the drill's. Phases, in the order a save goes:

- ``rank-file``: the rank file is written to ``training_state_rank<r>.pt.tmp``, not yet renamed;
- ``shared-file``: rank files in place, ``training_state.pt.tmp`` written, not yet renamed;
- ``marker``: SpecForge's save is done (``training_state.pt`` in place, ``-latest`` re-pointed: SpecForge
  itself would resume from it), the checkpoint-save seam's completion marker not yet written.

Without the variable it is plain ``specforge_kimi train``.
"""

import os
import sys
import time
from pathlib import Path


def _hold(step: int, phase: str, seconds: float) -> None:
    flag = Path(os.environ["RESUME_DRILL_FLAG"])
    tmp = flag.with_name(f"{flag.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{step} {phase} {os.getpid()}\n")
    os.replace(tmp, flag)  # whole or absent: the drill kills as soon as it reads it (two ranks may both write)
    time.sleep(seconds)


def main() -> int:
    spec = os.environ.get("RESUME_DRILL_SLOW_SAVE")
    import specforge_kimi

    specforge_kimi.register()
    if spec:
        step_s, phase, seconds_s = spec.split(":")
        nth = int(step_s[1:]) if step_s.startswith("+") else None
        seconds = float(seconds_s)
        from specforge.training.checkpoint import CheckpointManager

        import specforge_kimi.registration as registration

        # "step": the save under way; "hold": the step whose write holds (fixed up front, or by the n-th save)
        current = {"step": None, "saves": 0, "hold": None if nth is not None else int(step_s)}
        save, atomic, mark = (
            CheckpointManager.save,
            CheckpointManager._atomic_save,
            registration._mark_checkpoint_complete,
        )

        def slow_save(self, state, step_, *, rank_state=None):
            current["saves"] += 1
            if nth is not None and current["saves"] == nth:
                current["hold"] = step_
            current["step"] = step_
            try:
                return save(self, state, step_, rank_state=rank_state)
            finally:
                current["step"] = None

        def slow_atomic(obj, path):
            step = current["hold"]
            if step is None or current["step"] != step:
                return atomic(obj, path)
            wanted = "training_state.pt" if phase == "shared-file" else "training_state_rank"
            if phase not in ("rank-file", "shared-file") or not os.path.basename(path).startswith(wanted):
                return atomic(obj, path)
            import torch

            torch.save(obj, path + ".tmp")
            _hold(step, phase, seconds)
            os.replace(path + ".tmp", path)

        def slow_mark(ckpt_dir, **kw):
            step = current["hold"]
            if phase == "marker" and step is not None and kw.get("step") == step:
                _hold(step, phase, seconds)
            return mark(ckpt_dir, **kw)

        CheckpointManager.save = slow_save
        CheckpointManager._atomic_save = staticmethod(slow_atomic)
        registration._mark_checkpoint_complete = slow_mark
    from specforge_kimi.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
