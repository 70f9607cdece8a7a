"""The real-width rehearsal on one H200: the co-located online run of ``recipes/kimi-k25-slice-h200.yaml``.

K2.5's width (hidden 7168, 64 MLA heads, moe_intermediate 2048, vocab 163840), its INT4 routed experts
(384 per MoE layer, compressed-tensors pack-quantized group 32, SGLang's WNA16 Marlin MoE), 5 layers; the
B200 recipe's Llama-style draft (963M parameters, TTT 7, draft vocab 32,000, flex_attention, max_length
4096); the capture server and one trainer rank on the same GPU, launched by ``specforge-kimi launch``.

Runs ``scripts/gpu_real_width.sh`` with ``STAGE`` (default ``train``: a target and data stage must have
run on this box before, ``STAGE=all`` does everything) and checks the run:
  - >= 200 optimizer steps, the recipe's max_steps reached, every sample trained once (SpecForge's ledger);
  - the loss falls: SpecForge's console loss, mean of the last window below the first window's (a random
    target: the draft learns the target's next-token distribution on the target's own text);
  - the final checkpoint and the SGLang export written; bytes on disk per trained token stay metadata (features
    travel through the transport only);
  - the server took the compressed-tensors INT4 MoE path; afterwards no process holds GPU memory and no
    sglang/specforge/mooncake process is left.
Everything the script writes lands in ``$SPECFORGE_KIMI_GPU_OUT`` (online_run.json: trainer-only and
end-to-end tok/s, GPU memory per role). Wall time on one H200: train stage ~6-8 min (server start ~2.5 min
without a cold INT4 kernel compile, 300 steps), data stage ~4 min, target stage ~1 min.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from gpu_checks import METADATA_BOUND, gpu_leftovers

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/kimi-k25-slice-h200.yaml"


def test_real_width_online_run(tmp_path):
    out = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    launch_timeout = os.environ.get("SPECFORGE_KIMI_LAUNCH_TIMEOUT", "500")
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_real_width.sh"), launch_timeout],
        cwd=ROOT,
        env={**os.environ, "OUT": str(out), "RECIPE": RECIPE, "STAGE": os.environ.get("STAGE", "train")},
        capture_output=True,
        text=True,
        timeout=int(launch_timeout) + 80,
    )
    (out / "pytest_script.out").write_text(res.stdout + res.stderr)
    assert "launch rc=0" in (out / "launch.out").read_text(), (out / "launch.out").read_text()[-3000:]
    rep = json.loads((out / "online_run.json").read_text())
    led = rep["ledger"]
    assert led["global_step"] >= 200 and rep["last_step"] == rep["max_steps"], (led, rep["last_step"])
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0 and led["acked"] == led["acked_unique"]
    assert rep["loss_last_mean"] < rep["loss_first_mean"], (rep["loss_first_mean"], rep["loss_last_mean"])
    assert rep["checkpoints"] and rep["export_present"]  # the recipe keeps the final checkpoint only (disk)
    assert rep["metadata_bytes_per_trained_token"] < METADATA_BOUND, rep["disk"]
    server_log = (out / "capture-server-node0.log").read_text(errors="replace")
    assert "CompressedTensorsWNA16MarlinMoEMethod" in server_log or "WNA16" in server_log
    apps, held, gpus = gpu_leftovers((out / "gpu_after.csv").read_text())
    assert gpus and not apps and not held, (apps, held)
    assert not (out / "procs_after.txt").read_text().strip()
