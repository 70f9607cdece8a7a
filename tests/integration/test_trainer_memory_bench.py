"""``bench/trainer_memory.py`` on the CPU: SpecForge's own consumer step builds and trains at a tiny recipe's sizes.

The GPU run (bench/results/trainer_memory_k25_b200_h200.json) is the measurement; this keeps the script
working against the pinned SpecForge (its model bundle, FSDP backend, optimizer factory and step strategy
are private-ish seams) and checks what it records.
"""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "trainer_memory.py"
RECIPE = "recipes/tiny-k25-tp1-h200.yaml"


@pytest.mark.slow
def test_cpu_run_records_every_length_with_the_plan(tmp_path):
    out = tmp_path / "tm.json"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--recipe",
            RECIPE,
            "--backends",
            "sdpa",
            "--lengths",
            "32,48",
            "--steps",
            "2",
            "--profile-steps",
            "1",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["peak_tflops"] == 989.0 and doc["config"]["profile_steps"] == 1
    assert doc["benchmark"] == "one trainer rank's peak memory and speed at a recipe's sizes vs recipes.memory_plan"
    rows = doc["rows"]
    assert [r["length"] for r in rows] == [32, 48], rows
    from specforge_kimi.online.recipes import load_recipe, trainer_terms

    for r in rows:
        assert "error" not in r, r
        assert r["fsdp_sharding"] == "NO_SHARD"  # SpecForge's FSDP needs an accelerator; its DDP path runs
        assert len(r["losses"]) == 2 and all(x == x and x > 0 for x in r["losses"])
        assert r["plan_bytes"] == trainer_terms(
            load_recipe(REPO / RECIPE), max_length=r["length"], attention_backend="sdpa"
        )
        _check_flops_and_profile(r, tmp_path / "work")
    # the stand-in target holds only what the consumer reads
    recipe = load_recipe(REPO / RECIPE)
    t = recipe.target
    target = tmp_path / "work" / f"target-{t.num_layers}l-{t.hidden_size}h-{t.vocab_size}v"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {recipe.target.embedding_key, recipe.target.lm_head_key}
    assert json.loads((target / "config.json").read_text())["text_config"]["hidden_size"] == recipe.target.hidden_size


def _check_flops_and_profile(r: dict, workdir: Path) -> None:
    """The row's FLOP figures are the FLOP model's; the profile summary is well-formed and adds up."""
    from specforge_kimi.online.recipes import load_recipe
    from specforge_kimi.training.step_flops import recipe_step_flops

    recipe = load_recipe(REPO / RECIPE)
    model = recipe_step_flops(recipe, length=r["length"])
    assert r["flops_per_token"] == pytest.approx(model.per_token)
    assert r["flops_per_token_executed"] == pytest.approx(
        recipe_step_flops(recipe, length=r["length"], attention="sdpa").per_token
    )
    assert r["achieved_tflops"] == pytest.approx(model.per_token * r["tokens_per_s"] / 1e12)
    assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 989.0)
    p = r["profile"]
    assert p["steps"] == 1 and p["time_source"] == "cpu op self time" and p["wall_ms_per_step"] > 0
    classes = p["class_ms_per_step"]
    assert set(classes) == {
        "gemm",
        "attention",
        "draft_head_loss",
        "target_head_teacher",
        "optimizer",
        "copies",
        "nccl",
        "elementwise_other",
        "unattributed",
    }
    assert all(v >= 0 for v in classes.values())
    assert sum(classes.values()) <= p["total_ms_per_step"] * (1 + 1e-9)
    # the tiny recipe's GEMMs are found and classed by shape: draft GEMMs, the 256-row draft head, the teacher
    assert classes["gemm"] > 0 and classes["draft_head_loss"] > 0 and classes["target_head_teacher"] > 0
    assert classes["optimizer"] > 0
    assert 0 < len(p["top"]) <= 25 and all(t["class"] in classes and t["ms_per_step"] >= 0 for t in p["top"])
    assert set(p["class_tflops"]) == {"gemm", "attention", "draft_head_loss", "target_head_teacher"}
    assert Path(p["trace"]) == workdir / f"trace-sdpa-{r['length']}-rank0.json.gz"
    with gzip.open(p["trace"], "rt") as fh:
        assert "traceEvents" in json.load(fh)


@pytest.mark.slow
def test_two_ranks_under_torchrun_merge_into_one_row_per_length(tmp_path):
    out = tmp_path / "tm.json"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--recipe",
            RECIPE,
            "--backends",
            "sdpa",
            "--lengths",
            "32",
            "--steps",
            "2",
            "--nproc",
            "2",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["world_size"] == 2
    [row] = doc["rows"]  # rank 0 alone prints the merged row
    assert "error" not in row and row["world_size"] == 2
    per_rank = row["per_rank_median_step_s_after_first"]
    assert len(per_rank) == 2 and row["median_step_s_after_first"] == max(per_rank)
    assert row["tokens_per_s"] == pytest.approx(32 * 2 / max(per_rank))


def test_bad_arguments_are_one_line_errors_before_anything_is_written(tmp_path):
    import torch

    cases = [
        (["--backends", "eager"], "is not flex_attention or sdpa"),
        (["--lengths", "64,x"], "not a comma-separated list"),
        (["--lengths", "128,64"], "ascending"),
        (["--steps", "1"], "at least 2"),
        (["--nproc", "0"], "--nproc 0"),
        (["--profile-steps", "-1"], "--profile-steps"),
    ]
    if not torch.cuda.is_available():  # flex_attention has no CPU backward
        cases.append((["--backends", "flex_attention"], "needs CUDA"))
    for extra, msg in cases:
        res = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "--recipe",
                RECIPE,
                "--backends",
                "sdpa",
                *extra,
                "--workdir",
                str(tmp_path / "w"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (tmp_path / "w").exists()  # checked before anything is written
