"""bench/sizing.py on hand-made inputs: the prefill fits, the co-location arithmetic, the per-recipe projection,
the naming rules that pick up new runs, the backtest's independence from what it is compared with, and the
committed doc table against the committed JSON."""

from __future__ import annotations

import importlib.util
import json
import shutil
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
US = 1e-6
# the trainer bench's step_env per variant (bench/trainer_memory.py writes the allocator setting even when unset)
SPECFORGE = {"SPECFORGE_EAGLE3_EMPTY_CACHE": "1", "SPECFORGE_ADAMW_FUSED": "0", "PYTORCH_CUDA_ALLOC_CONF": None}
RECIPE = {"SPECFORGE_EAGLE3_EMPTY_CACHE": "0", "SPECFORGE_ADAMW_FUSED": "1", "PYTORCH_CUDA_ALLOC_CONF": None}
EXPANDABLE = {**RECIPE, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.fixture(scope="module")
def sizing():
    spec = importlib.util.spec_from_file_location("sizing", REPO / "bench" / "sizing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_depth_fit_splits_fixed_and_per_layer_time(sizing):
    fit = sizing.depth_fit([(5, 20_000.0), (3, 30_000.0)])
    per_layer = (1 / 20_000 - 1 / 30_000) / 2
    assert fit["per_moe_layer_s_per_token"] == pytest.approx(per_layer)
    assert fit["fixed_s_per_token"] == pytest.approx(1 / 30_000 - 2 * per_layer)
    assert fit["k25_s_per_token_one_h200"] == pytest.approx(1 / 30_000 + 58 * per_layer)
    with pytest.raises(SystemExit, match="same number of layers"):
        sizing.depth_fit([(5, 1.0), (5, 2.0)])


def test_probe_fit_keeps_the_slices_expert_count_in_the_moe_term(sizing):
    # probes: 3 us fixed + 4 us per 16-expert layer; the slice: the same fixed part + 4 layers of 5 us
    fit = sizing.probe_fit([(6, 1 / (23 * US)), (12, 1 / (47 * US))], (5, 1 / (23 * US)))
    assert fit["fixed_s_per_token"] == pytest.approx(3 * US)
    assert fit["per_moe_layer_s_per_token_16_experts"] == pytest.approx(4 * US)
    assert fit["per_moe_layer_s_per_token"] == pytest.approx(5 * US)
    assert fit["k25_s_per_token_one_h200"] == pytest.approx(303 * US)


def test_colocation_arithmetic(sizing):
    # 8 GPUs at 1,000 prefill + 4,000 train tok/s each (1,250 us per token per GPU), 10 us tax on the server
    assert sizing.colocated(prefill=1_000, trainer=4_000, overlap=0.0, tax_s=10 * US, gpus=8) == pytest.approx(
        1 / (1250 * US / 8 + 10 * US)
    )


def _pipeline(layers: int, rows: dict[str, tuple[float, float]], length: int = 4096, batch: int = 4) -> dict:
    """``rows``: transport -> (plain, capture) tok/s; one reader 1 GB/s (mooncake) / 100 GB/s (cuda_ipc)."""
    return {
        "baseline_capture_over_plain": {},
        "config": {"layers": layers, "hidden": 7168},
        "runs": [
            {
                "tp": 1,
                "transport": t,
                "shapes": [
                    {
                        "batch": batch,
                        "tokens_per_prompt": length,
                        "plain_tokens_per_s": plain,
                        "capture_tokens_per_s": cap,
                        "capture_over_plain": cap / plain,
                        "read_gb_per_s": {"mooncake": 1.0, "cuda_ipc": 100.0}[t],
                        "feature_bytes_per_token": 50_000.0,
                        "sink_per_request_mean": {"bytes": 4e9, "total_ms": 1000.0},
                    }
                ],
            }
            for t, (plain, cap) in rows.items()
        ],
    }


def _depth(layers: int, plain: float) -> dict:
    return {
        "config": {"layers": layers},
        "runs": [{"tp": 1, "shapes": [{"batch": 4, "tokens_per_prompt": 4096, "plain_tokens_per_s": plain}]}],
    }


def _run(e2e: float) -> dict:
    return {
        "perf": {"end_to_end_tokens_per_s": e2e, "trainer_only_tokens_per_s": 9_000.0, "tokens_per_step": 4090.0},
        "gpu_memory": {"peak_mib_per_role": {"capture-server": 60 * 1024, "trainer": 60 * 1024}},
    }


@pytest.fixture
def results(tmp_path):
    """Hand-made measurements: slice 5 layers at 1/(23 us) plain; probes 3 us fixed + 4 us per layer;
    trainer alone 10,000 tok/s at 4096, 20,000 at 16384 with SpecForge's step, 12,500 / 25,000 with the recipes'
    step; mooncake tax 5 us, cuda_ipc 0."""
    d = tmp_path / "results"
    d.mkdir()
    files = {
        "online_pipeline_k25_slice_h200.json": _pipeline(
            5, {"mooncake": (1 / (23 * US), 1 / (28 * US)), "cuda_ipc": (1 / (23 * US), 1 / (23 * US))}
        ),
        "prefill_depth_k25_slice5_h200.json": _depth(5, 1 / (23 * US)),
        "capture_overhead_width7168_l6_e16_bf16_tp1_h200.json": _pipeline(6, {"mooncake": (1 / (23 * US), 1.0)}),
        "capture_overhead_width7168_l12_e16_bf16_tp1_h200.json": _pipeline(12, {"mooncake": (1 / (47 * US), 1.0)}),
        # 23 us prefill + 100 us training, 0 tax, 11.5 us hidden: half the shorter stage
        "online_run_k25_slice_cuda_ipc_h200.json": _run(1 / (111.5 * US)),
        "online_run_k25_slice_cuda_ipc_h200_eval_draft.json": {"not": "a run"},
        "trainer_step_lifts_k25_b200_h200.json": {
            "rows": [
                {
                    "backend": "flex_attention",
                    "length": 4096,
                    "tokens_per_s": 10_000.0,
                    "step_env": SPECFORGE,
                    "feed": "cuda",
                },
                {
                    "backend": "flex_attention",
                    "length": 16384,
                    "tokens_per_s": 20_000.0,
                    "step_env": SPECFORGE,
                    "feed": "cuda",
                },
                {"backend": "sdpa", "length": 4096, "tokens_per_s": 1.0, "step_env": SPECFORGE, "feed": "cuda"},
                {
                    "backend": "flex_attention",
                    "length": 4096,
                    "tokens_per_s": 12_500.0,
                    "step_env": RECIPE,
                    "feed": "cuda",
                },
                {
                    "backend": "flex_attention",
                    "length": 16384,
                    "tokens_per_s": 25_000.0,
                    "step_env": RECIPE,
                    "feed": "cuda",
                },
                {
                    "backend": "flex_attention",
                    "length": 4096,
                    "tokens_per_s": 1.0,
                    "step_env": EXPANDABLE,
                    "feed": "cuda",
                },
                # the batch copied from host memory inside the step: no run feeds it that way, never used
                {"backend": "flex_attention", "length": 4096, "tokens_per_s": 2.0, "step_env": RECIPE, "feed": "host"},
            ]
        },
    }
    for name, v in files.items():
        (d / name).write_text(json.dumps(v))
    for kind, rate in (("bf16", 40_000.0), ("int4", 50_000.0)):
        row = {"batch_size": 4, "input_len": 4096, "prefill_throughput": rate}
        (d / f"prefill_width7168_l6_e16_{kind}_h200.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row))
    return d


def _main(sizing, results: Path, tmp_path: Path) -> tuple[dict, str]:
    doc = tmp_path / "sizing.md"
    if not doc.exists():
        doc.write_text(f"intro\n{sizing.BEGIN}\nold\n{sizing.END}\noutro\n")
    out = tmp_path / "sizing.json"
    assert sizing.main(["--results", str(results), "--out", str(out), "--doc", str(doc)]) == 0
    return json.loads(out.read_text()), doc.read_text()


def test_projection_from_hand_made_measurements(sizing, results, tmp_path):
    res, text = _main(sizing, results, tmp_path)
    a = sizing.ASSUMPTIONS
    assert res["depth_fit"]["k25_s_per_token_one_h200"] == pytest.approx((3 + 60 * 5) * US)
    assert res["overlap_hidden_fraction"] == {"cuda_ipc": pytest.approx(0.5), "mooncake": pytest.approx(0.5)}
    b200 = res["recipes"]["kimi-k25-8xb200-lowered"]
    assert list(b200["transports"]) == ["cuda_ipc", "mooncake"]
    prefill = a["tp_efficiency"]["8"] * a["prefill_speed_vs_h200"]["B200"] / (303 * US)
    trainer = a["trainer_speed_vs_h200"]["B200"] * 12_500  # the recipe's step, its max_length 4096 row
    assert b200["prefill_tokens_per_s_per_gpu"] == pytest.approx(prefill)
    assert b200["node_prefill_tokens_per_s"] == pytest.approx(8 * prefill)
    assert b200["trainer_tokens_per_s_per_gpu"] == pytest.approx(trainer)
    gpu_s = 1 / prefill + 1 / trainer - 0.5 * min(1 / prefill, 1 / trainer)
    moon = b200["transports"]["mooncake"]
    server = 1 / (gpu_s / 8 + 5 * US)
    assert moon["end_to_end_tokens_per_s_per_gpu"] == pytest.approx(server / 8)
    assert moon["end_to_end_no_overlap_tokens_per_s_per_gpu"] == pytest.approx(
        1 / ((1 / prefill + 1 / trainer) / 8 + 5 * US) / 8
    )
    assert moon["gpu_hours_per_1b_tokens"] == pytest.approx(1e9 / server / 3600 * 8)
    assert moon["feature_gb_per_s_per_node"] == pytest.approx(server * 50_000 / 1e9)
    assert moon["transport_readers_gb_per_s_per_node"] == pytest.approx(8.0)
    assert moon["transport_writer_gb_per_s"] == pytest.approx(4.0)
    assert b200["transports"]["cuda_ipc"]["end_to_end_tokens_per_s_per_gpu"] == pytest.approx(1 / gpu_s)
    sens = {
        (x["assumption"], x["end"]): x["end_to_end_tokens_per_s_per_gpu"]["kimi-k25-8xb200-lowered"]
        for x in res["sensitivity"]
    }
    assert sens["as projected", "central"]["mooncake"] == pytest.approx(moon["end_to_end_tokens_per_s_per_gpu"])
    # the only run hides half: the worst run's fraction is the measured one here
    assert sens["overlap_carries", "pessimistic"]["mooncake"] == pytest.approx(moon["end_to_end_tokens_per_s_per_gpu"])
    slow = a["tp_efficiency"]["8"] / (303 * US)  # prefill speed 1.0
    slow_s = 1 / slow + 1 / trainer - 0.5 * min(1 / slow, 1 / trainer)
    assert sens["prefill_speed_vs_h200", "pessimistic"]["mooncake"] == pytest.approx(1 / (slow_s / 8 + 5 * US) / 8)
    assert a["prefill_speed_vs_h200"]["B200"] != 1.0  # the sensitivity run left the stated assumptions alone
    # B300 trains 16k samples: the 16384 row; two nodes: TP=16, Mooncake only, readers per node, one writer
    b300 = res["recipes"]["kimi-k25-8xb300"]
    assert b300["trainer_tokens_per_s_per_gpu"] == pytest.approx(a["trainer_speed_vs_h200"]["B300"] * 25_000)
    two = res["recipes"]["kimi-k25-2x8xb300"]
    assert two["tp"] == 16 and list(two["transports"]) == ["mooncake"]
    t2 = two["transports"]["mooncake"]
    assert t2["feature_gb_per_s_per_node"] == pytest.approx(t2["writer_gb_per_s"] / 2)
    assert t2["gpu_hours_per_1b_tokens"] == pytest.approx(16 * t2["wall_hours_per_1b_tokens"])
    assert res["torchspec"]["tokens_per_s_per_gpu"] == pytest.approx(6e9 / (1500 * 3600))
    # memory: the server's 60 GiB peak over the slice recipe's pool is added to each recipe's pool
    m = moon["memory_per_gpu_gib"]
    outside = 60 - res["memory_from_slice"]["slice_plan"]["server_pool"]
    assert m["server_peak_like_slice"] == pytest.approx(m["server_pool"] + outside)
    assert m["server_peak_plus_trainer_plan"] == pytest.approx(m["server_pool"] + outside + m["trainer_plan"])
    assert m["fits_with_server_overhead"] == (m["server_pool"] + outside + m["trainer_plan"] <= m["gpu"])
    assert text.startswith("intro\n") and text.endswith("outro\n") and "\nold\n" not in text
    assert (
        sizing.main(
            ["--results", str(results), "--out", str(tmp_path / "again.json"), "--doc", str(tmp_path / "sizing.md")]
        )
        == 0
    )
    assert (tmp_path / "sizing.md").read_text() == text  # rerun: same table, markers kept


def test_backtest_prediction_never_reads_the_measured_value(sizing, results, tmp_path):
    res, _ = _main(sizing, results, tmp_path)
    (run_bt, prefill_bt) = res["backtest"]
    # no overlap: 23 + 100 us per token, 0 tax
    assert run_bt["predicted"] == pytest.approx(1 / (123 * US)) and run_bt["measured"] == pytest.approx(
        1 / (111.5 * US)
    )
    assert run_bt["relative_error"] == pytest.approx(111.5 / 123 - 1)
    # expert count ignored: 3 us + 4 layers x 4 us / (50k/40k INT4 over bf16)
    assert prefill_bt["predicted"] == pytest.approx(1 / ((3 + 4 * 4 / 1.25) * US))
    assert prefill_bt["measured"] == pytest.approx(1 / (23 * US))
    # the run's end-to-end and the slice's prefill changed: measured follows, predicted from them does not
    run = results / "online_run_k25_slice_cuda_ipc_h200.json"
    run.write_text(json.dumps(_run(5_000.0)))
    again, _ = _main(sizing, results, tmp_path)
    assert again["backtest"][0]["measured"] == 5_000.0
    assert again["backtest"][0]["predicted"] == pytest.approx(run_bt["predicted"])
    # the projection does move with the run (its overlap fraction), the backtest's prediction did not
    assert again["overlap_hidden_fraction"]["cuda_ipc"] != pytest.approx(0.5)
    (results / "prefill_depth_k25_slice5_h200.json").write_text(json.dumps(_depth(5, 30_000.0)))
    third, _ = _main(sizing, results, tmp_path)
    assert third["backtest"][1]["measured"] == 30_000.0
    assert third["backtest"][1]["predicted"] == pytest.approx(prefill_bt["predicted"])


def test_new_runs_are_picked_up_by_name(sizing, results, tmp_path):
    # a Mooncake run hiding none of the prefill: 23 + 100 + 5 us
    (results / "online_run_k25_slice_mooncake_h200.json").write_text(json.dumps(_run(1 / (128 * US))))
    shutil.copy(results / "online_run_k25_slice_cuda_ipc_h200.json", results / "online_run_k25_slice_cuda_ipc_b.json")
    res, text = _main(sizing, results, tmp_path)
    assert [s["file"] for s in res["slice_runs"]] == [
        "online_run_k25_slice_cuda_ipc_b.json",
        "online_run_k25_slice_cuda_ipc_h200.json",
        "online_run_k25_slice_mooncake_h200.json",
    ]
    assert res["overlap_hidden_fraction"] == {"cuda_ipc": pytest.approx(0.5), "mooncake": pytest.approx(0.0, abs=1e-9)}
    cross = [b for b in res["backtest"] if "other transport" in b["what"]]
    assert len(cross) == 3
    moon = next(b for b in cross if b["file"] == "online_run_k25_slice_mooncake_h200.json")
    assert moon["predicted"] == pytest.approx(1 / ((123 - 0.5 * 23 + 5) * US))  # cuda_ipc's half hidden
    assert "online_run_k25_slice_mooncake_h200.json" in text


def test_two_slice_depths_replace_the_width_probes(sizing, results, tmp_path):
    (results / "prefill_depth_k25_slice3_h200.json").write_text(json.dumps(_depth(3, 1 / (13 * US))))
    res, _ = _main(sizing, results, tmp_path)
    fit = res["depth_fit"]
    assert fit["method"] == "two depths of the 384-expert slice" and res["inputs"]["width_probes"] == ""
    assert fit["per_moe_layer_s_per_token"] == pytest.approx(5 * US)
    assert fit["fixed_s_per_token"] == pytest.approx(3 * US)
    assert all("16-expert" not in b["predicted_from"] for b in res["backtest"])


def test_missing_measurement_is_one_line(sizing, results, tmp_path):
    (results / "trainer_step_lifts_k25_b200_h200.json").unlink()
    with pytest.raises(SystemExit, match="trainer_step_lifts_k25_b200_h200.json not found"):
        _main(sizing, results, tmp_path)


def test_committed_doc_table_is_the_committed_json(sizing):
    """docs/sizing.md's table is what bench/sizing.py writes from bench/results/sizing_k25.json."""
    res = json.loads((REPO / "bench" / "results" / "sizing_k25.json").read_text())
    doc = (REPO / "docs" / "sizing.md").read_text()
    assert doc.split(sizing.BEGIN, 1)[1].split(sizing.END, 1)[0] == "\n" + sizing.table(res) + "\n"
    b200 = res["recipes"]["kimi-k25-8xb200-lowered"]["transports"]
    for p in b200.values():
        assert f"**{p['end_to_end_tokens_per_s_per_gpu']:,.0f}**" in doc
    assert {b["what"] for b in res["backtest"]} and all("relative_error" in b for b in res["backtest"])


def test_runs_are_paired_with_the_trainer_step_they_ran(sizing, results, tmp_path):
    """A ``step_recipe`` run's trainer-alone rate is the recipe-step row; a run slower than the two stages added
    keeps its negative fraction (the projection then sits below the times-added rate); its memory is the one
    carried to the recipes."""
    # the recipe step alone: 23 + 80 us; the run took 113 us: 10 us more than the sum, -10/23 of the prefill
    run = _run(1 / (113 * US))
    run["gpu_memory"]["peak_mib_per_role"]["trainer"] = 50 * 1024
    (results / "online_run_k25_slice_cuda_ipc_step_recipe_h200.json").write_text(json.dumps(run))
    res, text = _main(sizing, results, tmp_path)
    by_file = {s["file"]: s for s in res["slice_runs"]}
    rec = by_file["online_run_k25_slice_cuda_ipc_step_recipe_h200.json"]
    assert rec["trainer_step"] == "recipe" and rec["trainer_alone_tokens_per_s"] == 12_500.0
    assert rec["overlap_hidden_fraction"] == pytest.approx(-10 / 23)
    old = by_file["online_run_k25_slice_cuda_ipc_h200.json"]
    assert old["trainer_step"] == "specforge" and old["trainer_alone_tokens_per_s"] == 10_000.0
    assert res["overlap_hidden_fraction"]["cuda_ipc"] == pytest.approx((0.5 - 10 / 23) / 2)
    assert res["slice_run"]["file"] == "online_run_k25_slice_cuda_ipc_step_recipe_h200.json"
    assert res["memory_from_slice"]["slice_measured_peak_gib"]["trainer"] == pytest.approx(50.0)
    assert "(recipe's step)" in text and "(specforge's step)" in text
    # the worst run (-10/23) in the pessimistic rows, both transports
    sens = {(x["assumption"], x["end"]): x["end_to_end_tokens_per_s_per_gpu"] for x in res["sensitivity"]}
    b200 = res["recipes"]["kimi-k25-8xb200-lowered"]
    prefill, trainer = b200["prefill_tokens_per_s_per_gpu"], b200["trainer_tokens_per_s_per_gpu"]
    gpu_s = 1 / prefill + 1 / trainer + 10 / 23 * min(1 / prefill, 1 / trainer)
    assert sens["overlap_carries", "pessimistic"]["kimi-k25-8xb200-lowered"]["cuda_ipc"] == pytest.approx(1 / gpu_s)
    best = 1 / prefill + 1 / trainer - 0.5 * min(1 / prefill, 1 / trainer)  # the best run hides half
    assert sens["overlap_carries", "optimistic"]["kimi-k25-8xb200-lowered"]["cuda_ipc"] == pytest.approx(1 / best)
    # all runs slower than the sum: the projection is below the times-added rate, not clipped up to it
    (results / "online_run_k25_slice_cuda_ipc_h200.json").write_text(json.dumps(_run(1 / (140 * US))))
    again, _ = _main(sizing, results, tmp_path)
    p = again["recipes"]["kimi-k25-8xb200-lowered"]["transports"]["cuda_ipc"]
    assert again["overlap_hidden_fraction"]["cuda_ipc"] < 0
    assert p["end_to_end_tokens_per_s_per_gpu"] < p["end_to_end_no_overlap_tokens_per_s_per_gpu"]


def test_a_trainer_bench_without_the_recipes_step_is_one_line(sizing, results, tmp_path):
    path = results / "trainer_step_lifts_k25_b200_h200.json"
    bench = json.loads(path.read_text())
    bench["rows"] = [r for r in bench["rows"] if r["step_env"] != RECIPE]
    path.write_text(json.dumps(bench))
    with pytest.raises(SystemExit, match="no flex_attention row fed from the GPU of the step"):
        _main(sizing, results, tmp_path)


def test_a_run_report_naming_its_step_is_paired_by_it(sizing, results, tmp_path):
    """``trainer_step_env`` in a run-report (from its launch sheet) decides the pairing, not the file name."""
    run = _run(1 / (113 * US))
    run["trainer_step_env"] = {k: v for k, v in RECIPE.items() if v is not None}
    (results / "online_run_k25_slice_cuda_ipc_b_h200.json").write_text(json.dumps(run))
    named = _run(1 / (113 * US))
    named["trainer_step_env"] = {"SPECFORGE_EAGLE3_EMPTY_CACHE": "1", "SPECFORGE_ADAMW_FUSED": "0"}
    (results / "online_run_k25_slice_cuda_ipc_step_recipe_c_h200.json").write_text(json.dumps(named))
    res, _ = _main(sizing, results, tmp_path)
    by_file = {s["file"]: s for s in res["slice_runs"]}
    assert by_file["online_run_k25_slice_cuda_ipc_b_h200.json"]["trainer_step"] == "recipe"
    assert by_file["online_run_k25_slice_cuda_ipc_b_h200.json"]["trainer_alone_tokens_per_s"] == 12_500.0
    assert by_file["online_run_k25_slice_cuda_ipc_step_recipe_c_h200.json"]["trainer_step"] == "specforge"
    assert by_file["online_run_k25_slice_cuda_ipc_step_recipe_c_h200.json"]["trainer_alone_tokens_per_s"] == 10_000.0


def _dflash(sizing, layers: int | None = None, ids: list[int] | None = None):
    """The 8xB200 DFlash recipe as the FLOPs and bytes terms read it, with made-up draft layers / captured ids."""
    r = sizing._recipes().load_recipe(REPO / "recipes" / "kimi-k25-8xb200-lowered-dflash.yaml")
    d = r.trainer.draft.model_copy(update={"num_hidden_layers": layers}) if layers else r.trainer.draft
    trainer = types.SimpleNamespace(family="dflash", draft=d, max_length=r.trainer.max_length, block=r.trainer.block)
    return types.SimpleNamespace(name=r.name, target=r.target, trainer=trainer, capture_ids=ids or r.capture_ids)


def test_block_draft_trainer_term_scales_with_its_flops_and_its_features(sizing):
    """More draft layers -> more FLOPs per token -> a lower estimated trainer rate; more captured target layers ->
    a wider fc and more feature bytes per token -> more GB/s on the transport at the same rate."""
    twin = sizing._recipes().load_recipe(REPO / "recipes" / "kimi-k25-8xb200-lowered.yaml")
    five = sizing._block_terms(_dflash(sizing), twin)
    ten = sizing._block_terms(_dflash(sizing, layers=10), twin)
    f5, f10 = five["block_trainer"]["flops_per_token"], ten["block_trainer"]["flops_per_token"]
    assert f10["layers"] == pytest.approx(2 * f5["layers"]) and f10["target_head"] == f5["target_head"]
    assert ten["flops_ratio"] > five["flops_ratio"] and ten["feature_scale"] == five["feature_scale"]
    fit = {"k25_s_per_token_one_h200": 300 * US}
    bench = {
        "rows": [
            {"backend": "flex_attention", "length": 4096, "tokens_per_s": 10_000.0, "feed": "cuda", "step_env": RECIPE}
        ]
    }
    base = {"per_node": 8, "nnodes": 1, "kind": "B200", "max_length": 4096, "transports": ["mooncake"]}
    a = sizing.ASSUMPTIONS
    r5 = sizing._recipe_rates({**base, **five}, a, fit, bench)
    r10 = sizing._recipe_rates({**base, **ten}, a, fit, bench)
    assert r5["trainer"] == pytest.approx(2.0 * 10_000 / five["flops_ratio"])
    assert r10["trainer"] < r5["trainer"] and r10["prefill"] == r5["prefill"]
    # seven captured layers instead of five: a wider fc, more bytes per token, more GB/s per node
    ids = [1, 10, 20, 30, 40, 50, 58]
    wide = sizing._block_terms(_dflash(sizing, ids=ids), twin)
    assert wide["feature_scale"] > five["feature_scale"]
    assert wide["block_trainer"]["flops_per_token"]["fc"] == pytest.approx(
        7 / 5 * five["block_trainer"]["flops_per_token"]["fc"]
    )
    c = {"tax_s_per_token": 5 * US, "read_gb_per_s": 100.0, "writer_gb_per_s": 100.0}
    rates = {**r5, "tax_scale": 1.0}
    narrow_row = sizing._transport_row(base, rates, c, 0.0, a, 50_000 * five["feature_scale"])
    wide_row = sizing._transport_row(base, rates, c, 0.0, a, 50_000 * wide["feature_scale"])
    assert wide_row["feature_gb_per_s_per_node"] > narrow_row["feature_gb_per_s_per_node"]
    assert wide_row["end_to_end_tokens_per_s_per_gpu"] == pytest.approx(narrow_row["end_to_end_tokens_per_s_per_gpu"])
    # a transport that cannot carry the wider features caps the rate (one reader at 1 GB/s)
    capped = sizing._transport_row(base, rates, {**c, "read_gb_per_s": 0.1}, 0.0, a, 50_000 * wide["feature_scale"])
    assert capped["transport_bound"] and capped["feature_gb_per_s_per_node"] == pytest.approx(0.8)


def test_a_measured_block_step_calibrates_block_step_vs_flops(sizing, results, tmp_path):
    """With the slice's DFlash twin measured alone, ``block_step_vs_flops`` is that step against the slice's EAGLE-3
    twin's x their FLOPs ratio (here the trainer bench's 12,500 tok/s at 4096, the recipe's step), the 8xB200 block
    draft's trainer follows it, and the sensitivity rows vary the measured factor."""
    res0, _ = _main(sizing, results, tmp_path)
    twin = sizing._recipes().load_recipe(REPO / "recipes" / sizing.SLICE_RECIPE)
    block = sizing._recipes().load_recipe(REPO / "recipes" / sizing.SLICE_BLOCK_RECIPE)
    ratio = sizing._block_terms(block, twin)["flops_ratio"]
    rows = [
        {"variant": "recipe", "backend": "sdpa", "length": 4096, "tokens_per_s": 1.0},  # not the recipe's backend
        {"variant": "recipe", "backend": "flex_attention", "length": 2048, "tokens_per_s": 1.0},  # not its length
        {"variant": "recipe", "backend": "flex_attention", "length": 4096, "tokens_per_s": 20_000.0},
    ]
    (results / sizing.BLOCK_STEP_FILE).write_text(json.dumps({"rows": rows}))
    res, text = _main(sizing, results, tmp_path)
    factor = 12_500 / (ratio * 20_000)
    spec = res["assumptions"]["block_step_vs_flops"]
    assert spec["value"] == pytest.approx(factor) and spec["measured"]["twin_tokens_per_s"] == 12_500
    assert spec["ends"]["pessimistic"]["value"] == pytest.approx(1.5 * factor)
    assert res["inputs"]["block_step"] == sizing.BLOCK_STEP_FILE and "MEASURED" in spec["why"]
    name = "kimi-k25-8xb200-lowered-dflash"
    before, after = res0["recipes"][name], res["recipes"][name]
    assert after["trainer_tokens_per_s_per_gpu"] == pytest.approx(
        before["trainer_tokens_per_s_per_gpu"] * res0["assumptions"]["block_step_vs_flops"]["value"] / factor
    )
    assert res["recipes"]["kimi-k25-8xb200-lowered"] == res0["recipes"]["kimi-k25-8xb200-lowered"]  # EAGLE-3 as before
    _check_ends(res, res["assumptions"])
    assert f"measured on the slice's DFlash twin ({sizing.BLOCK_STEP_FILE})" in text
    (results / sizing.BLOCK_STEP_FILE).write_text(json.dumps({"rows": rows[:1]}))
    with pytest.raises(SystemExit, match="no flex_attention row of the recipe's step"):
        _main(sizing, results, tmp_path)
    (results / sizing.BLOCK_STEP_FILE).write_text(json.dumps({"rows": [{**rows[2], "length": 8192}]}))
    with pytest.raises(SystemExit, match="at 8192 tokens and the trainer bench has the EAGLE-3 step at 4096"):
        _main(sizing, results, tmp_path)  # the bench has 4096 and 16384: the nearest is not the same length
    (results / sizing.BLOCK_STEP_FILE).write_text("{not json")
    with pytest.raises(SystemExit, match="is not JSON"):
        _main(sizing, results, tmp_path)


def test_block_draft_projection_beside_eagle3(sizing, results, tmp_path):
    res, text = _main(sizing, results, tmp_path)
    e3, bd = res["recipes"]["kimi-k25-8xb200-lowered"], res["recipes"]["kimi-k25-8xb200-lowered-dflash"]
    ratio = (
        res["block_trainer"]["kimi-k25-8xb200-lowered-dflash"]["flops_per_token"]["total"]
        / (res["block_trainer"]["kimi-k25-8xb200-lowered-dflash"]["twin_flops_per_token"]["total"])
    )
    assert bd["trainer_estimated"] and not e3["trainer_estimated"]
    assert bd["trainer_tokens_per_s_per_gpu"] == pytest.approx(e3["trainer_tokens_per_s_per_gpu"] / ratio)
    moon = bd["transports"]["mooncake"]
    assert moon["feature_bytes_per_token"] == pytest.approx(50_000 * 71_696 / 57_368)
    assert moon["capture_tax_s_per_token"] == pytest.approx(5 * US * 71_696 / 57_368)
    assert moon["feature_gb_per_s_per_node"] == pytest.approx(
        moon["server_tokens_per_s"] * moon["feature_bytes_per_token"] / 1e9
    )
    assert "block_step_vs_flops" in text and "kimi-k25-8xb200-lowered-dflash" in text
    # TorchSpec: the model card's figure beside the blog's, the same prediction against both
    blog, card = res["cross_check"]
    assert card["measured"] == pytest.approx(6e9 / (2 * 14 * 32 * 3600)) and blog["measured"] == pytest.approx(
        6e9 / (1500 * 3600)
    )
    assert card["predicted"] == blog["predicted"] == res["torchspec"]["predicted_on_its_layout"]["tokens_per_s_per_gpu"]


def _check_ends(res: dict, assumptions: dict) -> None:
    rows = {(s["assumption"], s["end"]): s for s in res["sensitivity"]}
    assert {k for k, _ in rows} == {"as projected", "all pessimistic ends", *assumptions}
    central = rows["as projected", "central"]

    def flat(s):
        return [v for r in s["end_to_end_tokens_per_s_per_gpu"].values() for v in r.values()] + [
            s["torchspec_predicted"]
        ]

    for (key, end), s in rows.items():
        if end == "pessimistic":
            assert all(x <= c * (1 + 1e-12) for x, c in zip(flat(s), flat(central), strict=True)), key
        if end == "optimistic":
            assert all(x >= c * (1 - 1e-12) for x, c in zip(flat(s), flat(central), strict=True)), key
    assert min(flat(rows["all pessimistic ends", "pessimistic"])) < min(flat(central))


def test_each_assumptions_pessimistic_end_projects_no_more_than_central(sizing, results, tmp_path):
    """Every assumption has a sensitivity row at each end; a pessimistic end never projects more than the central
    figure (8xB200 EAGLE-3 and DFlash, both transports, and the TorchSpec layout), an optimistic one never less;
    the same on the committed JSON."""
    res, _ = _main(sizing, results, tmp_path)
    _check_ends(res, sizing.ASSUMPTIONS)
    assert all(set(v["ends"]) == {"pessimistic", "optimistic"} for v in sizing.ASSUMPTIONS.values())
    committed = json.loads((REPO / "bench" / "results" / "sizing_k25.json").read_text())
    _check_ends(committed, committed["assumptions"])


def test_short_and_block_draft_runs_are_left_out_and_a_run_named_without_transport_reads_its_report(
    sizing, results, tmp_path
):
    shipped = _run(1 / (111.5 * US))
    shipped["transport"] = "mooncake"
    (results / "online_run_k25_slice_shipped_h200.json").write_text(json.dumps(shipped))
    short = _run(100.0)
    short["perf"]["steps_used"] = 2
    (results / "online_run_k25_slice_short20_cuda_ipc_h200.json").write_text(json.dumps(short))
    block = _run(100.0)  # a DFlash run of the slice: its step is not the EAGLE-3 draft's
    block["draft"] = {"strategy": "dflash"}
    (results / "online_run_k25_slice_dflash_cuda_ipc_h200.json").write_text(json.dumps(block))
    res, _ = _main(sizing, results, tmp_path)
    by_file = {s["file"]: s for s in res["slice_runs"]}
    assert by_file["online_run_k25_slice_shipped_h200.json"]["transport"] == "mooncake"
    assert "online_run_k25_slice_short20_cuda_ipc_h200.json" not in by_file
    assert "online_run_k25_slice_dflash_cuda_ipc_h200.json" not in by_file
    for name in list(by_file):  # only the block draft's run left: no EAGLE-3 run to fit, one line
        if name != "online_run_k25_slice_dflash_cuda_ipc_h200.json":
            (results / name).unlink()
    (results / "online_run_k25_slice_short20_cuda_ipc_h200.json").unlink()
    with pytest.raises(SystemExit, match="no EAGLE-3 slice run"):
        _main(sizing, results, tmp_path)
    (results / "online_run_k25_slice_shipped_h200.json").write_text(json.dumps(shipped))
    del shipped["transport"]
    (results / "online_run_k25_slice_shipped_h200.json").write_text(json.dumps(shipped))
    with pytest.raises(SystemExit, match="names no transport"):
        _main(sizing, results, tmp_path)


def test_the_newer_trainer_bench_is_read_first(sizing, results, tmp_path):
    """``trainer_step_k25_b200_h200.json`` (the rerun) wins over the lifts file for the rows it has."""
    row = {"backend": "flex_attention", "length": 4096, "tokens_per_s": 13_000.0, "step_env": RECIPE, "feed": "cuda"}
    (results / "trainer_step_k25_b200_h200.json").write_text(json.dumps({"rows": [row]}))
    res, _ = _main(sizing, results, tmp_path)
    assert res["recipes"]["kimi-k25-8xb200-lowered"]["trainer_tokens_per_s_per_gpu"] == pytest.approx(2 * 13_000)
    assert res["recipes"]["kimi-k25-8xb300"]["trainer_tokens_per_s_per_gpu"] == pytest.approx(2 * 25_000)
    assert res["inputs"]["trainer"] == "trainer_step_k25_b200_h200.json + trainer_step_lifts_k25_b200_h200.json"


def test_a_recipes_trainer_rate_is_read_from_its_own_attention_backends_rows(sizing):
    """A recipe on ``fa`` is sized from the bench's ``fa`` rows, not flex's; without one it is refused in one line."""
    bench = {
        "rows": [
            {"backend": "flex_attention", "length": 4096, "tokens_per_s": 10_000.0, "feed": "cuda", "step_env": RECIPE},
            {"backend": "fa", "length": 4096, "tokens_per_s": 11_000.0, "feed": "cuda", "step_env": RECIPE},
        ]
    }
    assert sizing._trainer_rate(bench, 4096, RECIPE) == (4096, 10_000.0)
    assert sizing._trainer_rate(bench, 4096, RECIPE, "fa") == (4096, 11_000.0)
    with pytest.raises(SystemExit, match="no sdpa row"):
        sizing._trainer_rate(bench, 4096, RECIPE, "sdpa")


def test_a_step_recipe_run_naming_no_step_ran_the_slice_recipes_step_of_then(sizing):
    """A ``step_recipe``-tagged run-report without ``trainer_step_env`` (written before run-reports named their step)
    is paired with ``LEGACY_RECIPE_STEP``, whatever step the slice recipe ships now; a report naming its step is paired
    by it."""
    name = "online_run_k25_slice_cuda_ipc_step_recipe_h200.json"
    seamed = {**sizing.LEGACY_RECIPE_STEP, "SPECFORGE_EAGLE3_FEWER_SYNCS": "1"}
    assert sizing.run_step(name, {}, seamed) == ("other", sizing._norm_step(sizing.LEGACY_RECIPE_STEP))
    assert sizing.run_step(name, {}, sizing.LEGACY_RECIPE_STEP)[0] == "recipe"
    assert sizing.run_step(name, {"trainer_step_env": seamed}, seamed) == ("recipe", sizing._norm_step(seamed))
    assert sizing.run_step("online_run_k25_slice_cuda_ipc_h200.json", {}, seamed)[0] == "specforge"
