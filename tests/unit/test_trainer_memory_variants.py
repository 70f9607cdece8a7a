"""``bench/trainer_memory.py --variants``: composed variants (``a+b+...``) and their refusals.

A composed variant is the recipe's own step with each part's trainer fields; it reaches the child process as the
same step variables a recipe with those fields sets (``training.step_knobs.trainer_env``). Refusals are one line
before anything runs.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from specforge_kimi.plan.run_plan import load_recipe
from specforge_kimi.training import step_knobs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "trainer_memory.py"
EAGLE3 = "recipes/kimi-k25-8xb200-lowered.yaml"
BLOCK = "recipes/kimi-k25-8xb200-lowered-dflash.yaml"


@pytest.fixture(scope="module")
def tm():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import trainer_memory
    finally:
        sys.path.pop(0)
    return trainer_memory


def test_a_composed_variant_merges_its_parts_fields(tm):
    assert tm.composed_update("fewer_syncs+fused_wgrad") == {
        "step_fewer_host_syncs": True,
        "step_eagle3_fused_wgrad": True,
    }
    assert tm.composed_update("compiled+fused_clip+fused_wgrad") == {
        "step_compile_elementwise": True,
        "step_optimizer_fused_clip": True,
        "step_eagle3_fused_wgrad": True,
    }
    for name in ("fused_wgrad", "fused_wgrad+fused_wgrad", "fused_wgrad+nope", "recipe+fused_wgrad", "+fused_clip"):
        assert tm.composed_update(name) is None, name


def test_a_composed_variant_sets_the_step_variables_a_recipe_with_its_fields_sets(tm):
    r = load_recipe(REPO / EAGLE3)
    env = tm.variant_env(r, "fewer_syncs+compiled+fused_wgrad+fused_clip", {step_knobs.ALLOC_CONF_ENV: "x"})
    want = step_knobs.trainer_env(
        r.trainer.model_copy(
            update={
                "step_fewer_host_syncs": True,
                "step_compile_elementwise": True,
                "step_eagle3_fused_wgrad": True,
                "step_optimizer_fused_clip": True,
            }
        )
    )
    assert env == want, env
    assert env[step_knobs.FUSED_WGRAD_ENV] == "1" and env[step_knobs.COMPILE_ELEMENTWISE_ENV] == "1"
    # the fused projections on top of the stack: stacked_untuned's variables and the seam's
    on_top = tm.variant_env(r, "stacked_untuned+fused_proj", {})
    assert on_top == {**tm.variant_env(r, "stacked_untuned", {}), step_knobs.FUSED_PROJ_ENV: "1"}
    # the stacked rows without flex autotune, named by parts, are the same step as stacked_untuned
    assert tm.variant_env(r, "fewer_syncs+compiled+block_mask+fused_wgrad+fused_clip", {}) == tm.variant_env(
        r, "stacked_untuned", {}
    )


def test_the_fa_backend_turns_on_the_fa_kernel_seam_for_every_variant(tm):
    r = load_recipe(REPO / EAGLE3)
    for variant in ("recipe", "stacked_untuned", "fewer_syncs+compiled"):
        assert tm.variant_env(r, variant, {}, backend="fa")[step_knobs.FA_KERNEL_ENV] == "1", variant
        flex = tm.variant_env(r, variant, {}, backend="flex_attention")
        assert flex[step_knobs.FA_KERNEL_ENV] == "0" and flex == tm.variant_env(r, variant, {}), variant
    assert step_knobs.FA_KERNEL_ENV not in tm.variant_env(load_recipe(REPO / BLOCK), "recipe", {}, backend="fa")


def _row(variant, backend, tokens_per_s, losses):
    return {"variant": variant, "backend": backend, "length": 4096, "tokens_per_s": tokens_per_s, "losses": losses}


def test_rows_on_two_backends_are_compared_backend_against_backend(tm):
    rows = [
        _row("recipe", "flex_attention", 100.0, [9.0, 8.0]),
        _row("recipe", "fa", 125.0, [9.0, 8.25]),
        _row("stacked_untuned", "flex_attention", 110.0, [9.0, 8.0]),
        _row("stacked_untuned", "fa", 132.0, [9.5, 8.0]),
        {"variant": "compiled", "backend": "fa", "length": 4096, "error": "oom"},
    ]
    out = tm.compare(rows)
    within = [c for c in out if "against_backend" not in c]
    assert [(c["backend"], c["variant"], c["against"]) for c in within] == [
        ("fa", "recipe", "recipe"),
        ("fa", "stacked_untuned", "recipe"),
        ("flex_attention", "recipe", "recipe"),
        ("flex_attention", "stacked_untuned", "recipe"),
    ]
    across = {c["variant"]: c for c in out if "against_backend" in c}
    assert across.keys() == {"recipe", "stacked_untuned"}
    assert across["recipe"]["backend"] == "fa" and across["recipe"]["against_backend"] == "flex_attention"
    assert across["recipe"]["speed_ratio"] == pytest.approx(1.25) and across["recipe"]["loss_max_abs_diff"] == 0.25
    assert across["stacked_untuned"]["speed_ratio"] == pytest.approx(1.2)
    assert across["stacked_untuned"]["loss_max_abs_diff"] == 0.5


@pytest.mark.parametrize(
    "recipe,variants,line",
    [
        (
            EAGLE3,
            "recipe,fused_wgrad+nope",
            "error: --variants: 'fused_wgrad+nope' is not one of recipe, ",
        ),
        (
            EAGLE3,
            "recipe,chunked_loss+fused_wgrad",
            "error: --variants: 'chunked_loss+fused_wgrad': Value error, trainer.step_eagle3_fused_wgrad and "
            "trainer.step_chunked_head_loss exclude each other",
        ),
        (
            EAGLE3,
            "stacked_untuned+chunked_loss",
            "error: --variants: 'stacked_untuned+chunked_loss': Value error, trainer.step_eagle3_fused_wgrad and "
            "trainer.step_chunked_head_loss exclude each other",
        ),
        (
            BLOCK,
            "recipe,fused_clip+fewer_syncs",
            "error: --variants: fused_clip+fewer_syncs change SpecForge's eagle3 step only; the recipe's draft is "
            "dflash",
        ),
    ],
)
def test_a_bad_composed_variant_is_refused_in_one_line(tmp_path, recipe, variants, line):
    res = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--recipe", recipe, "--backends", "sdpa", "--lengths", "32"),
            *("--variants", variants, "--workdir", str(tmp_path / "w")),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), res.stderr
    assert not (tmp_path / "w").exists()


def test_a_memory_cap_reaches_the_child_and_the_document(tm, monkeypatch):
    """``--memory-cap-gib``: the child gets it (it caps its allocator before building); a negative cap, or one
    without CUDA, is refused in one line; 0 is no cap and no flag."""
    import torch

    from specforge_kimi.errors import KimiInputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = tm._parser().parse_args(["--recipe", EAGLE3, "--lengths", "1536", "--memory-cap-gib", "29.5"])
    s = tm.parse(args)
    assert s.memory_cap_gib == 29.5
    argv = tm._child_command(
        s, variant="recipe", backend="flex_attention", gemm_tflops=None, target=Path("t"), vocab=None
    )
    assert argv[argv.index("--memory-cap-gib") + 1] == "29.5"
    plain = tm.parse(tm._parser().parse_args(["--recipe", EAGLE3, "--lengths", "1536"]))
    argv = tm._child_command(
        plain, variant="recipe", backend="flex_attention", gemm_tflops=None, target=Path("t"), vocab=None
    )
    assert plain.memory_cap_gib == 0 and "--memory-cap-gib" not in argv
    with pytest.raises(KimiInputError, match="--memory-cap-gib must be >= 0"):
        tm.parse(tm._parser().parse_args(["--recipe", EAGLE3, "--memory-cap-gib", "-1"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KimiInputError, match="a cap needs CUDA"):
        tm.parse(tm._parser().parse_args(["--recipe", EAGLE3, "--backends", "sdpa", "--memory-cap-gib", "20"]))
