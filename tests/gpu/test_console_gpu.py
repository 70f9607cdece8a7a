"""Issue 27 on a GPU host: what the CPU cannot show of the install check and of launch's GPU-memory samples.

- doctor's Mooncake check on a CUDA host: the build installed (the bundle's
  mooncake-transfer-engine-cuda13) matches torch's CUDA, so it is ``ok``;
- ``GpuSampler`` (what ``launch`` wraps a run in) records a process holding 1 GiB of GPU memory
  through the real ``nvidia-smi``, with its pid and command line, and ``run-report``'s GPU-memory
  plot is drawn from those samples.

Expected wall time: under a minute on one H200. Writes ``console_gpu.json``, ``gpu_mem_samples.csv``
and ``run_gpu_memory.png`` under ``$SPECFORGE_KIMI_GPU_OUT`` (or a tmp dir).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def out(tmp_path) -> Path:
    d = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


def _record(out: Path, key: str, value) -> None:
    path = out / "console_gpu.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2))


def test_mooncake_build_matches_this_hosts_cuda(out):
    import torch

    from specforge_kimi.setup import doctor

    checks = {c.name: c for c in doctor.check_versions()}
    c = checks["mooncake"]
    _record(out, "mooncake_check", {**asdict(c), "torch_cuda": torch.version.cuda})
    assert torch.cuda.is_available()
    assert c.status == "ok", c


def test_gpu_samples_name_the_process_and_plot(out):
    from specforge_kimi.evaluate.run_plots import plot_run
    from specforge_kimi.run.gpu_memory import GpuSampler, read_samples, role_of

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch; x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        csv = out / "gpu_mem_samples.csv"
        csv.unlink(missing_ok=True)
        with GpuSampler(csv, interval_s=0.5) as sampler:
            assert sampler.nvidia_smi, "nvidia-smi is not on PATH"
            time.sleep(3)
    finally:
        holder.kill()
        holder.wait()
    rows = read_samples(csv)
    mine = [r for r in rows if r[1] == str(holder.pid)]
    _record(out, "samples", {"rows": len(rows), "holder_rows": len(mine), "first": rows[:3]})
    assert len(mine) >= 3, rows[:10]
    assert max(r[2] for r in mine) >= 1024  # MiB: the 1 GiB tensor plus the CUDA context
    assert "torch.empty" in mine[0][3] and role_of(mine[0][3]) == "other"
    plots = plot_run([], None, out, title="gpu samples", gpu_samples=csv)
    _record(out, "plots", plots)
    assert plots["gpu_memory"] == str(out / "run_gpu_memory.png") and Path(plots["gpu_memory"]).stat().st_size > 5_000
