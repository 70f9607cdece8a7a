"""``bench/trainer_memory.py`` on the CPU: SpecForge's own consumer step builds and trains at a tiny recipe's sizes.

The GPU run (bench/results/trainer_memory_k25_b200_h200.json) is the measurement; this keeps the script
working against the pinned SpecForge (its model bundle, FSDP backend, optimizer factory and step strategy
are private-ish seams) and checks what it records.
"""

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "trainer_memory.py"
RECIPE = "recipes/tiny-k25-tp1-h200.yaml"


def _cpu_run(
    tmp_path: Path, recipe: str, *, profile_steps: int, backends: str = "sdpa", lengths: str = "32,48", extra=()
) -> dict:
    """The script on the CPU at ``lengths`` (default 32 and 48), two steps each, on ``backends`` (default sdpa), with
    ``extra`` arguments; its JSON document."""
    out = tmp_path / "tm.json"
    res = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--recipe", recipe, "--backends", backends, "--lengths", lengths),
            *("--steps", "2", "--profile-steps", str(profile_steps), "--workdir", str(tmp_path / "work")),
            *("--out", str(out), *extra),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        # SpecForge trains in bf16: on a CPU without bf16 instructions (no AVX-512 BF16 / AMX) a bf16 GEMM runs about
        # a hundredth as fast as fp32 and a block draft's step takes minutes at its recipe's anchors (the block test
        # trains a copy with BLOCK_TEST_ANCHORS), so four steps can need more than 600 s
        timeout=1800,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_cpu_run_records_every_length_with_the_plan(tmp_path):
    doc = _cpu_run(tmp_path, RECIPE, profile_steps=1)
    assert doc["config"]["peak_tflops"] == 989.0 and doc["config"]["profile_steps"] == 1
    assert doc["benchmark"] == "one trainer rank's peak memory and speed at a recipe's sizes vs recipes.memory_plan"
    rows = doc["rows"]
    assert [r["length"] for r in rows] == [32, 48], rows
    from specforge_kimi.plan.run_plan import load_recipe
    from specforge_kimi.plan.trainer_terms import trainer_terms

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
    from specforge_kimi.plan.run_plan import load_recipe
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


BLOCK_RECIPE = "recipes/tiny-k25-tp1-h200-dflash.yaml"


#: anchors a sample in the block test's copy of BLOCK_RECIPE (512 there). On a CPU without bf16 instructions the
#: step's time is nearly all one GEMM, the input gradient of the target's LM head over K2.5's 163,840-token vocabulary
#: (~0.5 s per drafted position measured, bench/step_profile.py's sources), and the positions are anchors x block size
BLOCK_TEST_ANCHORS = 4


def _block_recipe_copy(tmp_path: Path) -> Path:
    """BLOCK_RECIPE with BLOCK_TEST_ANCHORS anchors a sample, written under ``tmp_path`` (its relative paths read
    from the repository, the bench's working directory)."""
    import yaml

    raw = yaml.safe_load((REPO / BLOCK_RECIPE).read_text())
    raw["trainer"]["block"]["num_anchors"] = BLOCK_TEST_ANCHORS
    path = tmp_path / "block-recipe.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.slow
def test_cpu_run_of_a_block_draft_records_every_length_with_the_block_terms(tmp_path):
    """A DFlash recipe: SpecForge's own dflash consumer step (DFlashTrainStrategy) trains batches of its captured
    features; each row names the family and is read against the block trainer terms and the block FLOPs count."""
    block_recipe = _block_recipe_copy(tmp_path)
    doc = _cpu_run(tmp_path, str(block_recipe), profile_steps=0)
    from specforge_kimi.plan.run_plan import load_recipe
    from specforge_kimi.plan.trainer_terms import trainer_terms
    from specforge_kimi.training.step_flops import train_flops_per_token

    recipe = load_recipe(block_recipe)
    assert doc["config"]["family"] == "dflash" and doc["config"]["block"]["num_anchors"] == BLOCK_TEST_ANCHORS
    assert "ttt_length" not in doc["config"]
    rows = doc["rows"]
    assert [r["length"] for r in rows] == [32, 48], rows
    for r in rows:
        assert "error" not in r, r
        assert r["family"] == "dflash" and r["fsdp_sharding"] == "NO_SHARD"
        assert len(r["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in r["losses"])
        assert len(r["step_s"]) == 2 and r["tokens_per_s"] == pytest.approx(r["length"] / r["step_s"][1])
        terms = trainer_terms(recipe, max_length=r["length"], attention_backend="sdpa")
        assert r["plan_bytes"] == terms and terms["objective_logits"] > 0 and terms["teacher_logits"] == 0
        assert r["plan_gib"] == pytest.approx(sum(terms.values()) / 2**30)
        flops = train_flops_per_token(recipe, length=r["length"])
        assert r["flops_per_token"] == r["flops_per_token_executed"] == flops["total"]
        assert r["flops_per_token_by_term"] == {k: flops[k] for k in ("fc", "layers", "draft_head", "target_head")}
        assert r["achieved_tflops"] == pytest.approx(flops["total"] * r["tokens_per_s"] / 1e12)
        assert (r["fewer_host_syncs"], r["chunked_head_loss"], r["compile_elementwise"]) == (False, 0, False)
    assert rows[0]["losses"] != rows[1]["losses"]  # each length its own batches
    assert not list((tmp_path / "work").glob("vocab_mapping-*"))  # a block draft predicts the target's vocabulary


def test_eagle3_only_variants_are_refused_for_a_block_draft_in_one_line(tmp_path):
    res = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--recipe", BLOCK_RECIPE, "--backends", "sdpa"),
            *("--variants", "recipe,fewer_syncs,compiled", "--workdir", str(tmp_path / "w")),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: --variants: fewer_syncs, compiled change SpecForge's eagle3 step only; the recipe's draft is dflash "
        "(its variants: recipe, specforge, keep_cache, keep_cache_fused_adamw, expandable, fused_clip)"
    ]
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_the_fa_backend_trains_specforges_step_through_the_fa_kernel_seam(tmp_path):
    """``--backends sdpa,fa``: the fa row's child gets SPECFORGE_KIMI_EAGLE3_FA_KERNEL=1 from ``variant_env``, its
    ``register()`` installs the seam, and SpecForge builds and trains its ``fa`` backend (``LlamaFlashAttention``)
    without flash_attn; the same seeded data and init as the sdpa row, so the same losses to bf16 rounding; the
    comparisons read the fa row against the sdpa row (``against_backend``)."""
    doc = _cpu_run(tmp_path, RECIPE, profile_steps=0, backends="sdpa,fa", lengths="32", extra=("--variants", "recipe"))
    rows = doc["rows"]
    assert [(r["backend"], r.get("error"), r["fa_kernel"]) for r in rows] == [("sdpa", None, False), ("fa", None, True)]
    key = "SPECFORGE_KIMI_EAGLE3_FA_KERNEL"
    assert [r["step_env"][key] for r in rows] == ["0", "1"]
    assert [r["flops_executed_attention"] for r in rows] == ["sdpa", "fa"]
    sdpa, fa = (r["losses"] for r in rows)
    assert len(fa) == 2 and fa == pytest.approx(sdpa, rel=2e-3), (fa, sdpa)
    across = [c for c in doc["comparisons"] if "against_backend" in c]
    assert [(c["backend"], c["against_backend"], c["variant"]) for c in across] == [("fa", "sdpa", "recipe")]
    assert across[0]["loss_max_abs_diff"] == max(abs(a - b) for a, b in zip(fa, sdpa, strict=True))


@pytest.mark.slow
def test_variants_run_apart_on_the_same_data_and_init(tmp_path):
    """``--variants``: each variant's child gets its step variables (and no inherited allocator setting); with our
    SpecForge patches applied (a patched copy first on the path) the fused variant's optimizer is fused; both train
    the same seeded data from the same init, so their losses agree (fused and foreach AdamW differ by fp32
    rounding); the comparison rows read them against the first variant."""
    import argparse
    import importlib.util
    import os
    import shutil

    from specforge_kimi.setup import setup_patches

    patched = tmp_path / "sf"
    shutil.copytree(
        Path(importlib.util.find_spec("specforge").origin).parent,
        patched / "specforge",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    assert setup_patches.run(argparse.Namespace(specforge_checkout=str(patched), check=False, no_sglang=True)) == 0
    out = tmp_path / "tm.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(patched), os.environ.get("PYTHONPATH", "")) if p),
        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.9",  # never reaches a variant that names none
    }
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
            "3",
            "--variants",
            "specforge,keep_cache_fused_adamw,expandable,fewer_syncs,chunked_loss,fused_clip,fused_wgrad",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    variants = [
        "specforge",
        "keep_cache_fused_adamw",
        "expandable",
        "fewer_syncs",
        "chunked_loss",
        "fused_clip",
        "fused_wgrad",
    ]
    assert [r["variant"] for r in rows] == variants, rows
    cache, fused, syncs, chunked, comp, mask, tune, wgrad, proj, fa, clip, alloc = (
        "SPECFORGE_EAGLE3_EMPTY_CACHE",
        "SPECFORGE_ADAMW_FUSED",
        "SPECFORGE_EAGLE3_FEWER_SYNCS",
        "SPECFORGE_EAGLE3_CHUNKED_LOSS",
        "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE",
        "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK",
        "SPECFORGE_KIMI_FLEX_AUTOTUNE",
        "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD",
        "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ",
        "SPECFORGE_KIMI_EAGLE3_FA_KERNEL",
        "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP",
        "PYTORCH_CUDA_ALLOC_CONF",
    )
    off = {comp: "0", mask: "0", tune: "0", wgrad: "0", proj: "0", fa: "0", clip: "0"}  # our seams: spelled out, off
    assert [r["step_env"] for r in rows] == [
        {cache: "1", fused: "0", syncs: "0", chunked: "0", **off, alloc: None},
        {cache: "0", fused: "1", syncs: "0", chunked: "0", **off, alloc: None},
        {cache: "0", fused: "1", syncs: "0", chunked: "0", **off, alloc: "expandable_segments:True"},
        {cache: "0", fused: "1", syncs: "1", chunked: "0", **off, alloc: None},
        # the tiny recipe's step, chunked
        {cache: "0", fused: "1", syncs: "0", chunked: "1024", **off, alloc: None},
        # the tiny recipe's own step with the optimizer-fused-clip seam
        {cache: "0", fused: "1", syncs: "0", chunked: "0", **off, clip: "1", alloc: None},
        # the tiny recipe's own step with the eagle3-fused-wgrad seam
        {cache: "0", fused: "1", syncs: "0", chunked: "0", **off, wgrad: "1", alloc: None},
    ]
    assert [r["adamw_fused"] for r in rows] == [False, True, True, True, True, True, True]
    assert [r["fewer_host_syncs"] for r in rows] == [False, False, False, True, False, False, False]
    assert [r["chunked_head_loss"] for r in rows] == [0, 0, 0, 0, 1024, 0, 0]  # what the patched step read
    assert [r["compile_elementwise"] for r in rows] == [False] * 7  # the compile-elementwise seam not installed
    assert [(r["eagle3_block_mask"], r["flex_autotune"]) for r in rows] == [(False, False)] * 7  # nor these
    # the optimizer-fused-clip seam installed and taking the (fused) optimizer's step in its variant only
    assert [r["optimizer_fused_clip"] for r in rows] == [False] * 5 + [True, False]
    # the same update to fp32 rounding: the same losses as the same step without it
    assert rows[5]["losses"] == pytest.approx(rows[1]["losses"], rel=1e-5)
    # the eagle3-fused-wgrad seam installed in its variant only, wrapping the draft layer's and head's linears
    # behind SpecForge's own training backend, with the same losses to fp32 rounding
    assert [r["eagle3_fused_wgrad"] for r in rows] == [False] * 6 + [True]
    assert [bool(r["eagle3_fused_wgrad_linears"]) for r in rows] == [False] * 6 + [True]
    assert "lm_head" in rows[6]["eagle3_fused_wgrad_linears"]
    assert rows[6]["losses"] == pytest.approx(rows[1]["losses"], rel=1e-5)
    assert doc["config"]["variants"]["expandable"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    base = rows[0]["losses"]
    assert len(base) == 3 and len(set(base)) == 3  # three different batches
    comps = {c["variant"]: c for c in doc["comparisons"]}
    assert set(comps) == set(variants)
    assert all(c["against"] == "specforge" and c["length"] == 32 for c in comps.values())
    assert comps["specforge"]["loss_max_abs_diff"] == 0.0 and comps["specforge"]["speed_ratio"] == 1.0
    # eagle3-fewer-host-syncs changes where values are built and when they are read, not what they are
    assert rows[3]["losses"] == rows[1]["losses"]
    # eagle3-chunked-head-loss sums the same terms in another order
    assert rows[4]["losses"] == pytest.approx(rows[1]["losses"], rel=1e-5)
    for name in ("keep_cache_fused_adamw", "expandable", "fewer_syncs", "chunked_loss", "fused_clip", "fused_wgrad"):
        r = rows[[x["variant"] for x in rows].index(name)]
        diff = max(abs(a - b) for a, b in zip(r["losses"], base, strict=True))
        assert comps[name]["loss_max_abs_diff"] == diff <= 1e-3 * max(base)
        assert r["losses"][0] == base[0]  # the first step's loss comes before any optimizer step
        assert comps[name]["speed_ratio"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])


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
            "--variants",
            "recipe,fused_wgrad,fused_wgrad+fused_proj",
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
    row, wgrad, proj = doc["rows"]  # rank 0 alone prints the merged row of each variant
    for r in (row, wgrad, proj):
        assert "error" not in r and r["world_size"] == 2
        per_rank = r["per_rank_median_step_s_after_first"]
        assert len(per_rank) == 2 and r["median_step_s_after_first"] == max(per_rank)
        assert r["tokens_per_s"] == pytest.approx(32 * 2 / max(per_rank))
    # the eagle3-fused-wgrad seam behind SpecForge's two-rank backend (gradients reduced across the ranks): the
    # same losses to fp32 rounding, the second step's included (after one update from the reduced gradients)
    assert (row["eagle3_fused_wgrad"], wgrad["eagle3_fused_wgrad"]) == (False, True)
    assert "lm_head" in wgrad["eagle3_fused_wgrad_linears"]
    assert wgrad["losses"] == pytest.approx(row["losses"], rel=1e-5) and row["losses"][0] != row["losses"][1]
    # with eagle3-fused-proj as well: the layer's q/k/v and gate/up one GEMM per group, the other linears summing
    assert (row["eagle3_fused_proj"], wgrad["eagle3_fused_proj"], proj["eagle3_fused_proj"]) == (False, False, True)
    assert proj["eagle3_fused_proj_groups"] == [
        "midlayer.self_attn.q_proj+k_proj+v_proj",
        "midlayer.mlp.gate_proj+up_proj",
    ]
    assert (
        row["eagle3_fused_proj_groups"] == [] and "midlayer.self_attn.q_proj" not in proj["eagle3_fused_wgrad_linears"]
    )
    assert proj["losses"] == pytest.approx(row["losses"], rel=1e-5)


def test_bad_arguments_are_one_line_errors_before_anything_is_written(tmp_path):
    import torch

    cases = [
        (["--backends", "eager"], "is not flex_attention, fa or sdpa"),
        (["--lengths", "64,x"], "not a comma-separated list"),
        (["--lengths", "128,64"], "ascending"),
        (["--steps", "1"], "at least 2"),
        (["--nproc", "0"], "--nproc 0"),
        (["--profile-steps", "-1"], "--profile-steps"),
        (["--variants", "specforge,bogus"], "'bogus' is not one of"),
        (["--variants", "specforge,specforge"], "each variant once"),
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
