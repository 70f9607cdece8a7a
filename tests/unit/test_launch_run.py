"""``specforge-kimi launch`` past its plan: ``run.launch.run`` hands each attempt's co-located plan to the module's
own runner (``run.launch.run_plan``) with the node's GPUs, then exports. The services are faked; what is checked is
the wiring a real launch goes through on a GPU box (``--plan`` stops before it)."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
    monkeypatch.setattr(launch, "export_latest", lambda compiled: tmp_path / "export-sglang")
    args = argparse.Namespace(
        recipe=str(REPO / "recipes" / "tiny-k25-tp1-h200.yaml"),
        stop_stale=False,
        resume=False,
        plan=False,
        node_rank=0,
        local_host="127.0.0.1",
        no_progress=True,
        no_bench=True,
    )
    assert launch.run(args) == 0
    assert len(attempts) == 1 and len(ran) == 1
    plan, mps_dirs, gpus = ran[0]
    assert plan is attempts[0] and mps_dirs is None and gpus == "0"
