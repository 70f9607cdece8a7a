"""bench/sizing.py's arithmetic on stated inputs: the depth fit, the per-recipe projection, the doc table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sizing():
    spec = importlib.util.spec_from_file_location("sizing", REPO / "bench" / "sizing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pipeline(layers: int, plain: float, capture: dict[str, float]) -> dict:
    runs = [
        {
            "tp": 1,
            "transport": t,
            "shapes": [
                {
                    "tokens_per_prompt": 4096,
                    "plain_tokens_per_s": plain,
                    "capture_tokens_per_s": c,
                    "capture_over_plain": c / plain,
                    "read_gb_per_s": {"mooncake": 1.0, "cuda_ipc": 100.0, "none": 0.0}[t],
                }
            ],
        }
        for t, c in capture.items()
    ]
    return {"config": {"layers": layers}, "runs": runs}


def test_depth_fit_splits_fixed_and_per_layer_time(sizing):
    fit = sizing.depth_fit([(5, 20_000.0), (3, 30_000.0)])
    per_layer = (1 / 20_000 - 1 / 30_000) / 2
    assert fit["per_moe_layer_s_per_token"] == pytest.approx(per_layer)
    assert fit["fixed_s_per_token"] == pytest.approx(1 / 30_000 - 2 * per_layer)
    assert fit["k25_s_per_token_one_h200"] == pytest.approx(1 / 30_000 - 2 * per_layer + 60 * per_layer)
    with pytest.raises(SystemExit, match="same number of layers"):
        sizing.depth_fit([(5, 1.0), (5, 2.0)])


def test_projection_end_to_end(sizing, tmp_path):
    files = {
        "pipeline": _pipeline(5, 20_000.0, {"mooncake": 16_000.0, "cuda_ipc": 19_800.0}),
        "deep": _pipeline(5, 20_000.0, {"none": 20_000.0}),
        "shallow": _pipeline(3, 30_000.0, {"none": 30_000.0}),
        "online_run": {
            "perf": {"trainer_only_tokens_per_s": 10_000.0, "end_to_end_tokens_per_s": 5_000.0},
            "gpu_memory": {"peak_mib_per_role": {"trainer": 60_000}},
        },
        "trainer": {
            "rows": [{"backend": "flex_attention", "length": 4096, "tokens_per_s": 9_500.0, "peak_reserved_gib": 62.6}]
        },
    }
    paths = {}
    for k, v in files.items():
        paths[k] = tmp_path / f"{k}.json"
        paths[k].write_text(json.dumps(v))
    doc = tmp_path / "sizing.md"
    doc.write_text(f"intro\n{sizing.BEGIN}\nold\n{sizing.END}\noutro\n")
    out = tmp_path / "sizing.json"
    argv = [
        "--pipeline",
        str(paths["pipeline"]),
        "--depth",
        str(paths["deep"]),
        str(paths["shallow"]),
        "--online-run",
        str(paths["online_run"]),
        "--trainer",
        str(paths["trainer"]),
        "--out",
        str(out),
        "--doc",
        str(doc),
    ]
    assert sizing.main(argv) == 0
    res = json.loads(out.read_text())
    # the slice run: serial formula on its own stage rates, and its measured end-to-end rate
    serial = 1 / (1 / 20_000 + 1 / 10_000)
    assert res["slice_run"]["sharing_efficiency"] == pytest.approx(5_000 / serial)
    assert res["slice_run"]["end_to_end_over_slowest_stage"] == pytest.approx(0.5)
    b200 = res["recipes"]["kimi-k25-8xb200-lowered"]
    k25_s = res["depth_fit"]["k25_s_per_token_one_h200"]
    prefill = 0.7 * 2.0 / k25_s
    assert b200["tp"] == 8 and b200["prefill_tokens_per_s_per_gpu"] == pytest.approx(prefill)
    assert b200["trainer_tokens_per_s_per_gpu"] == pytest.approx(20_000)
    node = 8 / (1 / prefill + 1 / 20_000) * (5_000 / serial)
    tax = 1 / 16_000 - 1 / 20_000
    e2e = 1 / (1 / node + tax) / 8
    moon = b200["transports"]["mooncake"]
    assert moon["end_to_end_tokens_per_s_per_gpu"] == pytest.approx(e2e)
    assert moon["gpu_hours_per_1b_tokens"] == pytest.approx(1e9 / (e2e * 8) / 3600 * 8)
    assert moon["feature_gb_per_s_per_node"] == pytest.approx(e2e * 8 * 57_344 / 1e9)
    assert b200["transports"]["cuda_ipc"]["end_to_end_tokens_per_s_per_gpu"] > e2e  # a smaller tax
    two_node = res["recipes"]["kimi-k25-2x8xb300"]
    assert two_node["tp"] == 16 and two_node["transports"]["mooncake"]["gpu_hours_per_1b_tokens"] > 0
    assert res["torchspec"]["tokens_per_s_per_gpu"] == pytest.approx(6e9 / (1500 * 3600))
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| kimi-k25-8xb200-lowered | 1x8 B200 | 8 |" in text
    assert sizing.main(argv) == 0 and doc.read_text() == text  # rerun: same table, markers kept


def test_missing_measurement_is_one_line(sizing, tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        sizing.main(["--pipeline", str(tmp_path / "nope.json"), "--doc", str(tmp_path / "d.md")])
