"""``specforge-kimi launch`` past its plan: ``run.launch.run`` hands each attempt's co-located plan to the module's
own runner (``run.launch.run_plan``) with the node's GPUs, then exports. The services are faked; what is checked is
the wiring a real launch goes through on a GPU box (``--plan`` stops before it)."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _args(resume: bool) -> argparse.Namespace:
    return argparse.Namespace(
        recipe=str(REPO / "recipes" / "tiny-k25-tp1-h200.yaml"),
        stop_stale=False,
        resume=resume,
        plan=False,
        node_rank=0,
        local_host="127.0.0.1",
        no_progress=True,
        no_bench=True,
        no_export=False,
    )


def test_launch_runs_each_attempt_through_the_modules_runner(monkeypatch, tmp_path):
    from specforge_kimi.plan import inputs
    from specforge_kimi.plan.run_plan import RunPlan
    from specforge_kimi.run import gpu_memory, launch, resume

    monkeypatch.chdir(tmp_path)  # the recipe's relative output_dir lands here
    monkeypatch.setattr(inputs, "require_inputs", lambda recipe: None)
    monkeypatch.setattr(RunPlan, "write", lambda self: None)
    monkeypatch.setattr(gpu_memory, "GpuSampler", lambda path: nullcontext())
    attempts, ran = [], []

    def fake_attempts(recipe, plan, run, **kwargs):
        attempts.append(plan)
        return run(plan)

    def fake_runner(plan, *, mps_dirs=None, gpus=None, **kwargs):
        ran.append((plan, mps_dirs, gpus))
        return 0

    monkeypatch.setattr(resume, "run_attempts", fake_attempts)
    monkeypatch.setattr(launch, "run_plan", fake_runner)
    exported = []
    monkeypatch.setattr(launch, "export_latest", lambda compiled: exported.append(1) or tmp_path / "export-sglang")
    assert launch.run(_args(resume=False)) == 0
    assert len(attempts) == 1 and len(ran) == 1 and exported == [1]
    plan, mps_dirs, gpus = ran[0]
    assert plan is attempts[0] and mps_dirs is None and gpus == "0"
    measured_only = _args(resume=False)
    measured_only.no_export = True  # a run measured, not served: trained, no export, no bench
    assert launch.run(measured_only) == 0
    assert len(ran) == 2 and exported == [1]


def _faked_launch(monkeypatch, tmp_path, free: int):
    """``launch.run`` with its services faked and ``free`` bytes on the output_dir's disk; what it did: the attempts
    it ran and the plans it wrote."""
    import shutil

    from specforge_kimi.plan import inputs
    from specforge_kimi.plan.run_plan import RunPlan
    from specforge_kimi.run import gpu_memory, launch, resume

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(inputs, "require_inputs", lambda recipe: None)
    did = {"written": 0, "attempts": 0}
    monkeypatch.setattr(RunPlan, "write", lambda self: did.__setitem__("written", did["written"] + 1))
    monkeypatch.setattr(gpu_memory, "GpuSampler", lambda path: nullcontext())

    def fake_attempts(recipe, plan, run, **kwargs):
        did["attempts"] += 1
        return 0

    monkeypatch.setattr(resume, "run_attempts", fake_attempts)
    monkeypatch.setattr(launch, "export_latest", lambda compiled: tmp_path / "export-sglang")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**15, 10**15 - free, free))
    return did


def test_launch_refuses_a_fresh_run_the_disk_cannot_hold(monkeypatch, tmp_path):
    """Free disk below the run's checkpoints + export: a fresh launch refuses in one line naming the estimate, the
    free space and the fixes, before anything is written or started; with room it starts."""
    import pytest

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan import disk
    from specforge_kimi.plan.run_plan import load_recipe
    from specforge_kimi.run import launch

    need = disk.run_disk_bytes(load_recipe(REPO / "recipes" / "tiny-k25-tp1-h200.yaml"))
    did = _faked_launch(monkeypatch, tmp_path, free=need - 1)
    with pytest.raises(KimiInputError) as err:
        launch.run(_args(resume=False))
    line = str(err.value)
    assert "\n" not in line and "checkpoint(s) x " in line and "+ export" in line and " free" in line
    assert "trainer.save_interval" in line and "trainer.max_checkpoints" in line
    assert did == {"written": 0, "attempts": 0}
    did = _faked_launch(monkeypatch, tmp_path, free=need)
    assert launch.run(_args(resume=False)) == 0 and did == {"written": 1, "attempts": 1}


def test_launch_resume_only_warns_about_the_disk(monkeypatch, tmp_path, capsys):
    """On --resume the checkpoints written so far are already on the disk: one warning line, and the run goes on."""
    from specforge_kimi.run import launch

    did = _faked_launch(monkeypatch, tmp_path, free=1)
    assert launch.run(_args(resume=True)) == 0 and did == {"written": 1, "attempts": 1}
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "trainer.max_checkpoints" in warned[0]
