"""bench/draft_comparison.py on the CPU: the EAGLE-3 / block-draft pair compared only like for like (target, prompt
sets, generation settings; each side's algorithm), the ratios per set and overall, the training budget from the run
reports, and a refused pair ending in one line and exit 2."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "draft_comparison.py"


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("bench_draft_comparison", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _bench(algorithm: str, al: dict[str, float], overall: float, speedup: float | None = None) -> dict:
    config = (
        {"steps": 1, "topk": 1, "draft_tokens": 8}
        if algorithm == "DFLASH"
        else {"steps": 3, "topk": 1, "draft_tokens": 4}
    )
    run = {
        "config": config,
        "overall": {"acceptance_length": overall, "output_tok_per_s": 500.0},
        "sets": {k: {"acceptance_length": v} for k, v in al.items()},
    }
    if algorithm == "DFLASH":
        run["algorithm"] = "DFLASH"  # an EAGLE-3 result may omit it (older files)
    if speedup is not None:
        run["speedup"] = {"overall": speedup, **{k: speedup for k in al}}
    return {
        "benchmark": "acceptance",
        "target": {"path": "runs/tiny-k25", "config_sha256": "de7b8bf4"},
        "draft": {"path": f"runs/{algorithm.lower()}/export-sglang", "architectures": [algorithm]},
        "prompt_sets": {"structured": {"source": "corpus seed 20000", "prompts": 8, "prompt_tokens_mean": 58.1}},
        "settings": {"max_new_tokens": 256, "thinking": True, "concurrency": 1, "warmup": 2, "tp": 1,
                     "attention_backend": "triton", "disable_cuda_graph": False, "num_prompts": 8},
        "speculative": [run],
    }  # fmt: skip


def _report(tokens: int) -> dict:
    return {
        "run_id": "r",
        "transport": "cuda_ipc",
        "last_step": 1500,
        "ledger": {"trained_tokens": tokens, "duplicates": 0},
        "perf": {"end_to_end_tokens_per_s": 4000.0},
        "loss_last_mean": 1.5,
    }


def _write(tmp_path: Path, name: str, doc: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _settings(dc, tmp_path, e: dict, b: dict, *, runs=None, goal=1.3):
    ep, bp = _write(tmp_path, "e.json", e), _write(tmp_path, "b.json", b)
    er = br = None
    if runs:
        er, br = _write(tmp_path, "er.json", runs[0]), _write(tmp_path, "br.json", runs[1])
    return dc.Settings(ep, bp, er, br, goal, tmp_path / "out.json")


def test_ratios_per_set_and_overall_and_the_training_budget(dc, tmp_path):
    e = _bench("EAGLE3", {"structured": 3.0}, 3.0, speedup=1.8)
    b = _bench("DFLASH", {"structured": 4.5}, 4.5, speedup=2.4)
    doc = dc.compare(_settings(dc, tmp_path, e, b, runs=(_report(1000), _report(1100))))
    assert doc["block_vs_eagle3_acceptance_length"] == pytest.approx(1.5)
    assert doc["goal"] == {"block_vs_eagle3_at_least": 1.3, "met": True, "by_interval": None}
    assert doc["block_vs_eagle3_interval"] is None  # neither per-prompt counters nor histograms
    assert doc["sets"]["structured"]["block_vs_eagle3"] == pytest.approx(1.5)
    assert (doc["eagle3"]["speedup"], doc["block"]["speedup"]) == (1.8, 2.4)
    assert doc["eagle3"]["algorithm"] == "EAGLE3" and doc["block"]["config"]["draft_tokens"] == 8
    assert doc["training"]["block_vs_eagle3_trained_tokens"] == pytest.approx(1.1)
    assert doc["eagle3"]["per_position_at_least"] is None  # a bench without the histogram
    e["speculative"][0]["overall"]["per_position"] = {"at_least": [0.56, 0.41, 0.32], "conditional": [0.56, 0.74, 0.77]}
    b["speculative"][0]["overall"]["per_position"] = {"at_least": [0.56, 0.38, 0.27, 0.22, 0.19, 0.17, 0.12]}
    doc = dc.compare(_settings(dc, tmp_path, e, b))
    assert doc["eagle3"]["per_position_at_least"] == [0.56, 0.41, 0.32]
    assert doc["block"]["per_position_at_least"] == [0.56, 0.38, 0.27, 0.22, 0.19, 0.17, 0.12]
    below = dc.compare(_settings(dc, tmp_path, e, _bench("DFLASH", {"structured": 3.3}, 3.3), goal=1.3))
    assert below["goal"]["met"] is False and "training" not in below
    assert below["block"]["speedup"] is None  # no baseline server in that bench


@pytest.mark.parametrize(
    ("where", "change", "message"),
    [
        ("target", {"config_sha256": "0000"}, "different targets"),
        ("target", {"path": "runs/other"}, "different targets"),
        ("prompt_sets", {"structured": {"source": "corpus seed 1", "prompts": 8, "prompt_tokens_mean": 58.1}},
         "different prompt sets: structured"),
        ("settings", {"max_new_tokens": 128}, "different bench settings: max_new_tokens"),
        ("settings", {"disable_cuda_graph": True}, "different bench settings: disable_cuda_graph"),
    ],
)  # fmt: skip
def test_a_pair_that_is_not_like_for_like_is_refused(dc, tmp_path, where, change, message):
    e = _bench("EAGLE3", {"structured": 3.0}, 3.0)
    b = _bench("DFLASH", {"structured": 4.5}, 4.5)
    b[where] = {**copy.deepcopy(b[where]), **change}
    with pytest.raises(dc.ComparisonError, match=message):
        dc.compare(_settings(dc, tmp_path, e, b))


def test_each_side_must_be_its_algorithm_and_a_bench_result(dc, tmp_path):
    e = _bench("EAGLE3", {"structured": 3.0}, 3.0)
    with pytest.raises(dc.ComparisonError, match="expected DFLASH"):
        dc.compare(_settings(dc, tmp_path, e, copy.deepcopy(e)))
    with pytest.raises(dc.ComparisonError, match="expected EAGLE3"):
        dc.compare(_settings(dc, tmp_path, _bench("DFLASH", {"s": 4.0}, 4.0), _bench("DFLASH", {"s": 4.0}, 4.0)))
    with pytest.raises(dc.ComparisonError, match="not a `specforge-kimi bench` result"):
        dc.compare(_settings(dc, tmp_path, {"benchmark": "overlap_rates"}, e))
    with pytest.raises(dc.ComparisonError, match="no ledger.trained_tokens"):
        dc.compare(_settings(dc, tmp_path, e, _bench("DFLASH", {"structured": 4.0}, 4.0), runs=({}, _report(1))))


def test_the_command_line_refuses_in_one_line_and_writes_the_json(tmp_path):
    e = _write(tmp_path, "e.json", _bench("EAGLE3", {"structured": 3.0}, 3.0))
    b_doc = _bench("DFLASH", {"structured": 4.2}, 4.2)
    b = _write(tmp_path, "b.json", b_doc)
    out = tmp_path / "cmp.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--eagle3", str(e), "--block", str(b), "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "draft_comparison" and doc["command"][1:3] == ["bench/draft_comparison.py", "--eagle3"]
    assert doc["block_vs_eagle3_acceptance_length"] == pytest.approx(1.4)
    b_doc["settings"]["tp"] = 2
    b.write_text(json.dumps(b_doc))
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--eagle3", str(e), "--block", str(b), "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == ["draft_comparison: different bench settings: tp 1 vs 2"]
    assert not (tmp_path / "x.json").exists()
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--eagle3", str(tmp_path / "missing.json"), "--block", str(b), "--out",
         str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "cannot read it" in res.stderr


def test_an_out_that_is_a_link_is_refused_in_one_line(tmp_path):
    """The JSON goes through the project's atomic writer, which refuses to follow a link at --out."""
    e = _write(tmp_path, "e.json", _bench("EAGLE3", {"structured": 3.0}, 3.0))
    b = _write(tmp_path, "b.json", _bench("DFLASH", {"structured": 4.2}, 4.2))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "cmp.json"
    link.symlink_to(victim)
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--eagle3", str(e), "--block", str(b), "--out", str(link)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert victim.read_text() == "keep me\n"


def _per_request(run: dict, sets: dict[str, list[tuple[str, int, int]]]) -> None:
    """Give a bench run per-prompt counters per set: (id, completion tokens, verify steps)."""
    for name, rows in sets.items():
        run["sets"].setdefault(name, {"acceptance_length": 0.0})
        run["sets"][name]["per_request"] = [{"id": i, "completion_tokens": c, "spec_verify_ct": v} for i, c, v in rows]


def test_the_interval_pairs_prompts_by_id_within_each_set(dc, tmp_path):
    """Every prompt's block length exactly 1.5x its EAGLE-3 length (lengths differing from prompt to prompt, the
    block bench's prompts in another order): paired by id the interval is the point 1.5; paired by position, or each
    side resampled on its own, it would spread. Two sets whose prompts are alike within each: a point too (the sets
    are resampled within themselves, not mixed)."""
    e = _bench("EAGLE3", {"structured": 2.0}, 2.0)
    b = _bench("DFLASH", {"structured": 3.0}, 3.0)
    lengths = [1.2, 2.0, 3.1, 1.6, 2.5, 1.1, 2.8, 1.9]  # EAGLE-3 acceptance length per prompt
    rows_e = [(f"p{i}", int(al * 120), 120) for i, al in enumerate(lengths)]
    rows_b = [(f"p{i}", int(al * 120), 80) for i, al in enumerate(lengths)]  # the same tokens in 2/3 the steps
    _per_request(e["speculative"][0], {"structured": rows_e})
    _per_request(b["speculative"][0], {"structured": rows_b[::-1]})
    doc = dc.compare(_settings(dc, tmp_path, e, b))
    iv = doc["block_vs_eagle3_interval"]
    assert iv["unit"] == "prompts" and iv["n"] == {"eagle3": 8, "block": 8} and iv["level"] == 0.95
    assert (iv["low"], iv["high"]) == (pytest.approx(1.5), pytest.approx(1.5))
    assert iv["resamples_with_a_ratio"] == iv["resamples"] == 10_000
    assert doc["goal"] == {"block_vs_eagle3_at_least": 1.3, "met": True, "by_interval": "met"}
    # two sets, alike within each (A 2.0 -> 2.2, B 3.0 -> 4.5): resampled within each set, the ratio never moves
    _per_request(e["speculative"][0], {"structured": [(f"a{i}", 200, 100) for i in range(8)],
                                       "chat": [(f"a{i}", 300, 100) for i in range(8)]})  # fmt: skip
    _per_request(b["speculative"][0], {"structured": [(f"a{i}", 220, 100) for i in range(8)],
                                       "chat": [(f"a{i}", 450, 100) for i in range(8)]})  # fmt: skip
    iv = dc.compare(_settings(dc, tmp_path, e, b))["block_vs_eagle3_interval"]
    assert (iv["low"], iv["high"]) == (pytest.approx(670 / 500), pytest.approx(670 / 500))


def test_the_interval_over_prompts_decides_the_goal_only_when_it_lies_clear_of_it(dc, tmp_path):
    e = _bench("EAGLE3", {"structured": 2.0}, 2.0)
    b = _bench("DFLASH", {"structured": 3.0}, 3.0)
    _per_request(e["speculative"][0], {"structured": [(f"p{i}", 100, 50) for i in range(8)]})
    _per_request(b["speculative"][0], {"structured": [(f"p{i}", 100, 50 if i % 2 else 25) for i in range(8)]})
    doc = dc.compare(_settings(dc, tmp_path, e, b))  # half the prompts at 1.0x, half at 2.0x
    iv = doc["block_vs_eagle3_interval"]
    assert iv["low"] < 1.3 < iv["high"] and iv["low"] >= 1.0 and iv["high"] <= 2.0
    assert doc["goal"]["by_interval"] == "undecided: the interval holds the goal"
    assert dc.compare(_settings(dc, tmp_path, e, b)) == doc  # a fixed seed: the same files, the same interval
    assert dc.by_interval({"low": 1.0, "high": 1.2}, 1.3) == "not met"
    assert dc.by_interval(None, 1.3) is None


def test_no_interval_without_verify_steps_and_a_refusal_for_other_prompts(dc, tmp_path):
    """A side with no verify step has no ratio, so no interval (not a crash, not 0-0); prompt ids that differ
    between the benches are refused in one line."""
    for side in (0, 1):
        e = _bench("EAGLE3", {"structured": 2.0}, 2.0)
        b = _bench("DFLASH", {"structured": 3.0}, 3.0)
        rows = [[(f"p{i}", 100, 40) for i in range(4)], [(f"p{i}", 100, 30) for i in range(4)]]
        rows[side] = [(f"p{i}", 1, 0) for i in range(4)]
        _per_request(e["speculative"][0], {"structured": rows[0]})
        _per_request(b["speculative"][0], {"structured": rows[1]})
        doc = dc.compare(_settings(dc, tmp_path, e, b))
        assert doc["block_vs_eagle3_interval"] is None and doc["goal"]["by_interval"] is None
    _per_request(e["speculative"][0], {"structured": [(f"q{i}", 100, 40) for i in range(4)]})
    with pytest.raises(dc.ComparisonError, match="different prompts in set structured"):
        dc.compare(_settings(dc, tmp_path, e, b))


def test_the_interval_reads_what_the_bench_writes(dc, tmp_path):
    """Both sides' sets as ``specforge-kimi bench``'s summarize writes them (per_request from meta_info)."""
    from specforge_kimi.evaluate import bench
    from specforge_kimi.evaluate.bench import DFlashConfig, SpecConfig

    def responses(verify_per_prompt):
        return [{"id": f"s{i}", "output_ids": [1], "meta_info": {"completion_tokens": 60, "spec_verify_ct": v,
                 "spec_num_correct_drafts": 60 - 2 * v}}
                for i, v in enumerate(verify_per_prompt)]  # fmt: skip

    e = _bench("EAGLE3", {"structured": 2.0}, 2.0)
    b = _bench("DFLASH", {"structured": 3.0}, 3.0)
    e["speculative"][0]["sets"]["structured"] = bench.summarize(
        responses([30, 20, 25]), wall_s=1, spec=SpecConfig(3, 1, 4)
    )
    b["speculative"][0]["sets"]["structured"] = bench.summarize(responses([20, 10, 15]), wall_s=1, spec=DFlashConfig(8))
    iv = dc.compare(_settings(dc, tmp_path, e, b))["block_vs_eagle3_interval"]
    assert iv["unit"] == "prompts" and iv["n"]["eagle3"] == 3 and iv["low"] <= 75 / 45 <= iv["high"]


def test_without_per_prompt_counters_the_interval_comes_from_the_histograms_and_says_so(dc, tmp_path):
    e = _bench("EAGLE3", {"structured": 2.29}, 2.29)
    b = _bench("DFLASH", {"structured": 2.93}, 2.93)
    e["speculative"][0]["overall"]["correct_drafts_histogram"] = [166, 54, 36, 119]
    b["speculative"][0]["overall"]["correct_drafts_histogram"] = [129, 52, 33, 15, 8, 8, 14, 35]
    doc = dc.compare(_settings(dc, tmp_path, e, b))
    iv = doc["block_vs_eagle3_interval"]
    assert iv["unit"] == "verify steps" and iv["n"] == {"eagle3": 375, "block": 294}
    assert "independent" in iv["method"] and "acceptance_length_decode" in iv["method"]
    decode = (1 + 564 / 294) / (1 + 483 / 375)  # the two histograms' acceptance_length_decode
    assert iv["low"] < decode < iv["high"] and iv["high"] - iv["low"] < 0.5
    assert doc["goal"]["by_interval"] == "undecided: the interval holds the goal"
