"""``scripts/keep_gpu_results.sh``: a GPU call's files go into the repository at once -- result JSON into
bench/results/ (never over a different file), text into a dated logs folder, plots kept whole beside them, other binaries left out and named."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "keep_gpu_results.sh"


def _keep(src: Path, root: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(src), name],
        env={"PATH": "/usr/bin:/bin", "KEEP_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_results_logs_and_binaries(tmp_path):
    src, root = tmp_path / "files_at", tmp_path / "repo"
    (src / "rw").mkdir(parents=True)
    root.mkdir()
    (src / "rw" / "online_pipeline_k25_slice_h200.json").write_text(json.dumps({"runs": []}))
    (src / "rw" / "online_run_broken.json").write_text("{not json")  # a cut-off result is a log, not a result
    (src / "rw" / "server.log").write_text("x" * 300_000 + "tail\n")
    (src / "rw" / "weights.safetensors").write_bytes(b"\0" * 64)
    (src / "rw" / "soak_cuda_ipc_tp1_h200.json").write_text(json.dumps({"verdicts": {}}))
    (src / "rw" / "draft_comparison_tiny_tp1_h100.json").write_text(json.dumps({"pairs": []}))
    (src / "rw" / "overlap_rates_k25_slice_h200.json").write_text(json.dumps({"rows": []}))
    (src / "rw" / "soak_cuda_ipc_tp1_h200.png").write_bytes(b"\x89PNG\r\n\x1a\n\0plot")
    (src / "rw" / "huge.png").write_bytes(b"\x89PNG\0" + b"x" * (4 << 20))
    res = _keep(src, root, "2026-12-03-real-width")
    assert res.returncode == 0, res.stderr
    assert json.loads((root / "bench/results/online_pipeline_k25_slice_h200.json").read_text()) == {"runs": []}
    logs = root / "archive/gpu-runs/logs/2026-12-03-real-width/rw"
    assert json.loads((root / "bench/results/soak_cuda_ipc_tp1_h200.json").read_text()) == {"verdicts": {}}
    for name in ("draft_comparison_tiny_tp1_h100.json", "overlap_rates_k25_slice_h200.json"):  # the newer benches
        assert (root / "bench/results" / name).is_file(), name
    assert sorted(p.name for p in logs.iterdir()) == [
        "online_run_broken.json",
        "server.log",
        "soak_cuda_ipc_tp1_h200.png",
    ]
    assert (logs / "soak_cuda_ipc_tp1_h200.png").read_bytes() == b"\x89PNG\r\n\x1a\n\0plot"  # whole, not cut
    assert "rw/huge.png" in res.stdout
    assert (logs / "server.log").stat().st_size == 262_144 and (logs / "server.log").read_text().endswith("tail\n")
    assert "left out (binary): rw/weights.safetensors" in res.stdout

    assert _keep(src, root, "2026-12-03-real-width").returncode == 0  # the same file again: fine
    (src / "rw" / "online_pipeline_k25_slice_h200.json").write_text(json.dumps({"runs": [1]}))
    res = _keep(src, root, "2026-12-03-real-width")
    assert res.returncode == 1 and "exists and differs" in res.stderr
    assert json.loads((root / "bench/results/online_pipeline_k25_slice_h200.json").read_text()) == {"runs": []}


def test_bad_arguments(tmp_path):
    assert "NAME must start with a date" in _keep(tmp_path, tmp_path, "real-width").stderr
    res = _keep(tmp_path / "missing", tmp_path, "2026-12-03-x")
    assert res.returncode == 2 and "is not a folder" in res.stderr
