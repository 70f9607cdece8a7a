"""Issue 4b-d (and issue 8's co-located run) on the GPU box: the co-located online run of a tiny K2.5 recipe, end to end.

Runs ``scripts/gpu_online_run.sh`` (target pretraining on GPU, corpus prepare, ``specforge-kimi
launch`` with Mooncake + TP=2 capture server + producer + 2 trainer ranks on GPUs 0,1, export,
-- or, with ``RECIPE=recipes/tiny-k25-tp1-h200.yaml``, TP=1 and 1 trainer rank on one GPU; with
``RECIPE=recipes/tiny-k25-tp8-h200x8.yaml``, TP=8 and 8 trainer ranks on 8 GPUs (issue 8) --
``eval-draft`` on every checkpoint, ``run-report``) and checks its outputs:
  b. >= 200 optimizer steps, every sample trained once (SpecForge's ledger), checkpoints written,
     SGLang export present; held-out loss falls and simulated acceptance rises checkpoint by
     checkpoint (SpecForge's per-step console loss is a noisy single-batch value);
  c. bytes written under the run directory besides checkpoints/export/rendered configs stay under
     ``METADATA_BOUND`` per trained token (features travel through Mooncake only);
  d. afterwards no compute process holds GPU memory and no sglang/specforge/mooncake process is left;
  e. launch's status line, SpecForge's TensorBoard events (the recipe's default tracking) and
     run-report's plots (loss, acceptance, throughput, GPU memory per role).
Parametrized by the feature transport (issue 25): ``mooncake`` runs the recipe as it is; ``cuda_ipc`` runs it with
``server.transport: cuda_ipc`` (``TRANSPORT`` for the script): no Mooncake master in the plan, every ref a
``cudaipc://`` descriptor, no slot reclaimed by its lease, nothing of the pool left in the run dir or /dev/shm.
Select one with ``-k mooncake`` / ``-k cuda_ipc``; each is one launch (~5 min on one H200 after a prep stage).
Writes everything the script writes to ``$SPECFORGE_KIMI_GPU_OUT`` (or a tmp dir).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from gpu_checks import METADATA_BOUND, gpu_leftovers

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("transport", ["mooncake", "cuda_ipc"])
def test_online_run(tmp_path, transport):
    out = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    # STAGE / PRETRAIN_S / REGENERATE pass through to the script (see its header)
    launch_timeout = os.environ.get("SPECFORGE_KIMI_LAUNCH_TIMEOUT", "480")
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_online_run.sh"), launch_timeout],
        cwd=ROOT,
        env={**os.environ, "OUT": str(out), "TRANSPORT": transport},
        capture_output=True,
        text=True,
        timeout=580,
    )
    (out / "pytest_script.out").write_text(res.stdout + res.stderr)
    assert "launch rc=0" in (out / "launch.out").read_text(), (out / "launch.out").read_text()[-3000:]
    rep = json.loads((out / "online_run.json").read_text())
    led = rep["ledger"]
    # b
    assert led["global_step"] >= 200 and rep["last_step"] == rep["max_steps"]
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0 and led["acked"] == led["acked_unique"]
    assert len(rep["checkpoints"]) >= 2 and rep["export_present"]
    ev = json.loads((out / "eval_draft.json").read_text())["results"]
    losses = [r["heldout_loss"] for r in ev]
    als = [r["mean_acceptance_length"] for r in ev]
    assert all(a > b for a, b in zip(losses, losses[1:], strict=False)), losses
    assert als[-1] >= als[0] + 0.3, als
    # c
    assert rep["metadata_bytes_per_trained_token"] < METADATA_BOUND, rep["disk"]
    # d
    apps, held, gpus = gpu_leftovers((out / "gpu_after.csv").read_text())
    assert gpus, "gpu_after.csv lists no GPU"
    assert not apps, apps
    assert not held, held
    assert not (out / "procs_after.txt").read_text().strip()
    # e: what the user watches (issue 27): launch's status line (launch.out is not a terminal: a line per
    # change, at most one a minute), SpecForge's TensorBoard events from the recipe's default tracking,
    # run-report's plots beside its JSON
    assert re.search(r"^step \d+/\d+ \(\d+%\) \| loss [0-9.]+ \| accept ", (out / "launch.out").read_text(), re.M)
    assert "events.out.tfevents" in (out / "run_tree.txt").read_text()
    for name in ("loss", "acceptance", "throughput", "gpu_memory"):
        assert (out / f"run_{name}.png").is_file(), name
    if transport == "cuda_ipc":
        _check_cuda_ipc(out)


def _check_cuda_ipc(out: Path) -> None:
    from specforge_kimi.plan.run_plan import load_recipe

    recipe = load_recipe(out / "recipe-cuda_ipc.yaml")
    assert recipe.server.transport == "cuda_ipc"
    assert "mooncake.cli" not in (out / "plan.json").read_text()
    run = Path(recipe.output_dir) if Path(recipe.output_dir).is_absolute() else ROOT / recipe.output_dir
    refs = [json.loads(line) for line in (run / "control" / "refs.jsonl").read_text().splitlines()]
    assert refs and all(r["feature_store_uri"].startswith("cudaipc://") and "cuda_ipc" in r["metadata"] for r in refs)
    server = (run / "logs" / "capture-server-node0.log").read_text(errors="replace")  # the whole log
    assert "cuda_ipc pool" in server and "past the" not in server  # the pool was made; no slot hit its lease
    assert not (out / "ipc_after.txt").read_text().strip(), (out / "ipc_after.txt").read_text()
