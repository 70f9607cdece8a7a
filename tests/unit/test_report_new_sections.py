"""bench/report.py's sections for the draft-family comparison (``bench/draft_comparison.py``) and the co-located
stages' three rates (``bench/overlap_rates.py``): their files are recognised by content, tabulated with their
numbers (never "unrecognised"), and a dry run's canned rows say so."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _comparison() -> dict:
    return {
        "bench": "draft_comparison",
        "command": ["python", "bench/draft_comparison.py"],
        "eagle3": {"algorithm": "EAGLE3", "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
                   "acceptance_length": 3.1, "speedup": 1.9},
        "block": {"algorithm": "DFLASH", "config": {"steps": 1, "topk": 1, "draft_tokens": 8},
                  "acceptance_length": 4.34, "speedup": 2.6},
        "block_vs_eagle3_acceptance_length": 1.4,
        "block_vs_eagle3_interval": {"low": 1.21, "high": 1.58, "level": 0.95, "unit": "prompts",
                                     "n": {"eagle3": 48, "block": 48}},
        "goal": {"block_vs_eagle3_at_least": 1.3, "met": True, "by_interval": "undecided: the interval holds the goal"},
        "training": {"block_vs_eagle3_trained_tokens": 1.0},
    }  # fmt: skip


def test_both_sections_tabulate_their_files(tmp_path):
    report = _module("bench_report_sections", REPO / "bench" / "report.py")
    rates = _module("bench_overlap_rates_sections", REPO / "bench" / "overlap_rates.py")
    results = tmp_path / "results"
    results.mkdir()
    (results / "draft_comparison_tiny_tp1_h100.json").write_text(json.dumps(_comparison()))
    older = {k: v for k, v in _comparison().items() if k != "block_vs_eagle3_interval"}  # before the interval
    older["goal"] = {"block_vs_eagle3_at_least": 1.3, "met": True}
    (results / "draft_comparison_older.json").write_text(json.dumps(older))
    out = results / "overlap_rates_dry.json"
    assert rates.main(["--dry-run", "--recipe", str(REPO / "recipes/kimi-k25-slice-h200.yaml"), "--out", str(out)]) == 0
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert "## Unrecognised results files" not in md
    row = next(line for line in md.splitlines() if line.startswith("| draft_comparison_tiny_tp1_h100.json"))
    assert row == (
        "| draft_comparison_tiny_tp1_h100.json | EAGLE3 3/1/4 | 3.100 | DFLASH block 8 | 4.340 | **1.400** "
        "| 1.21-1.58 (95%, 48 prompts) | 1.3x: met; by the interval undecided: the interval holds the goal | 1.90 / 2.60 "
        "| 1.000 |"
    )
    row = next(line for line in md.splitlines() if line.startswith("| draft_comparison_older.json"))
    assert row.endswith("| **1.400** | - | 1.3x: met | 1.90 / 2.60 | 1.000 |")
    doc = json.loads(out.read_text())
    rows = [line for line in md.splitlines() if line.startswith("| overlap_rates_dry.json (dry run: canned)")]
    assert len(rows) == len(doc["rows"]) >= 2
    for line, r in zip(rows, doc["rows"], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == r["option"]
        ratio = r["overlap_vs_serial"]
        assert cells[-3] == (f"**{ratio:.3f}**" if ratio else r["error"])
        hidden = r["hidden_fraction"]
        assert cells[-2] == (f"{hidden:+.2f}" if hidden is not None else "-") and cells[-1] == "1.250"


def test_the_merged_backward_probe_is_tabulated_with_its_verdicts(tmp_path):
    """bench/cudnn_merged_backward.py's JSON: one row per case (a wrong one in bold) and one per timed length."""
    report = _module("bench_report_probe", REPO / "bench" / "report.py")
    results = tmp_path / "results"
    results.mkdir()
    case = {"dq_max_abs": 0.01, "dk_max_abs": 0.02, "dv_max_abs": 0.03, "ref_max_abs": 4.0}
    doc = {
        "bench": "cudnn_merged_backward",
        "command": ["python", "bench/cudnn_merged_backward.py"],
        "environment": {"device": "GPU X", "cudnn": 91900},
        "cases": [{**case, "case": "cudnn_merged", "right": True}, {**case, "case": "cudnn_bhsd", "right": False}],
        "timing": [
            {"length": 4096, "flash_fwd_ms": 0.9, "cudnn_fwd_ms": 0.5, "flash_bwd_ms": 2.4, "cudnn_bwd_ms": 1.4}
        ],
    }
    (results / "cudnn_merged_backward_x.json").write_text(json.dumps(doc))
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert "## Unrecognised results files" not in md
    rows = [line for line in md.splitlines() if line.startswith("| cudnn_merged_backward_x.json")]
    assert rows[0].endswith("| cudnn_merged | right | 0.010 / 0.020 / 0.030 | 4.00 |")
    assert "| cudnn_bhsd | **wrong** |" in rows[1]
    assert "fwd flash 0.90 / cuDNN 0.50 ms; bwd flash 2.40 / cuDNN 1.40 ms" in rows[2] and len(rows) == 3
