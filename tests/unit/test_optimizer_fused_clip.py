"""The optimizer-fused-clip seam on the CPU against SpecForge's own ``BF16Optimizer.step``: two copies of one small
bf16 model get the same gradients for a few steps, one stepped by SpecForge, one by the seam (torch's fused AdamW
runs on the CPU too). Without clipping the parameters are the same bits; with clipping the masters agree to fp32
rounding; an optimizer the seam does not take (AdamW not fused) is stepped by SpecForge's own code; not requested,
nothing is replaced; the recipe knob needs ``fused_adamw`` and reaches every draft family's trainer."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")

from specforge_kimi.drafts import optimizer_fused_clip as seam  # noqa: E402


@pytest.fixture
def uninstalled():
    yield
    seam.uninstall_optimizer_fused_clip()


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 40), torch.nn.LayerNorm(40)
    )
    model.to(torch.bfloat16)
    model[3].weight.requires_grad_(False)  # a frozen parameter: no master, as SpecForge's frozen tables
    return model


def _optimizer(model, *, fused: bool, max_grad_norm: float, monkeypatch):
    """SpecForge's BF16Optimizer; ``fused``: its AdamW built with ``fused=True``, as patch bf16-optimizer-fused-adamw
    builds it (the unpatched package here builds the foreach one)."""
    import specforge.optimizer as sf_opt

    if fused:
        monkeypatch.setattr(sf_opt.torch.optim, "AdamW", functools.partial(torch.optim.AdamW, fused=True))
    opt = sf_opt.BF16Optimizer(model, lr=3e-3, weight_decay=0.01, max_grad_norm=max_grad_norm, total_steps=20)
    monkeypatch.undo()
    return opt


def _run(opt, model, steps: int = 4) -> list[float]:
    """``steps`` optimizer steps on the same seeded batches; the gradient norms."""
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        x = torch.randn(16, 48, generator=gen).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        norms.append(float(opt.step()))
    return norms


def _pair(monkeypatch, *, max_grad_norm: float, fused: bool = True):
    """(SpecForge's run, the seam's run): each a model, its optimizer and its norms."""
    ref_model, seam_model = _model(), _model()
    ref = _optimizer(ref_model, fused=fused, max_grad_norm=max_grad_norm, monkeypatch=monkeypatch)
    ours = _optimizer(seam_model, fused=fused, max_grad_norm=max_grad_norm, monkeypatch=monkeypatch)
    ref_norms = _run(ref, ref_model)
    assert seam.install_optimizer_fused_clip(force=True)
    ours_norms = _run(ours, seam_model)
    return (ref_model, ref, ref_norms), (seam_model, ours, ours_norms)


def test_without_clipping_the_same_parameters(uninstalled, monkeypatch):
    (rm, ro, rn), (sm, so, sn) = _pair(monkeypatch, max_grad_norm=1e6)
    assert seam.applies(so)
    for a, b in zip(rm.parameters(), sm.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ro.fp32_params, so.fp32_params, strict=True):
        assert torch.equal(a, b)
    assert sn == pytest.approx(rn, rel=1e-5)
    assert all(p.grad is None for p in sm.parameters()) and all(mp.grad is None for mp in so.fp32_params)


def test_with_clipping_the_same_update_to_rounding(uninstalled, monkeypatch):
    (rm, ro, rn), (sm, so, sn) = _pair(monkeypatch, max_grad_norm=1e-3)
    assert min(rn) > 1e-2  # every step clipped
    for a, b in zip(ro.fp32_params, so.fp32_params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    moved = max((a - b).abs().max().item() for a, b in zip(ro.fp32_params, _model().parameters(), strict=False))
    assert moved > 1e-3  # the steps changed the masters (the comparison is not of untouched weights)
    assert sn == pytest.approx(rn, rel=1e-5)
    assert so.optimizer.grad_scale is None  # not left for a later step
    assert so.optimizer.state_dict()["state"].keys() == ro.optimizer.state_dict()["state"].keys()


def test_an_optimizer_not_fused_keeps_specforges_step(uninstalled, monkeypatch):
    (rm, _, rn), (sm, so, sn) = _pair(monkeypatch, max_grad_norm=1e-3, fused=False)
    assert not seam.applies(so)
    assert sn == rn
    for a, b in zip(rm.parameters(), sm.parameters(), strict=True):
        assert torch.equal(a, b)


def test_not_requested_nothing_replaced(uninstalled, monkeypatch):
    from specforge.optimizer import BF16Optimizer

    before = BF16Optimizer.step
    monkeypatch.delenv(seam.FUSED_CLIP_ENV, raising=False)
    assert not seam.install_optimizer_fused_clip()
    assert BF16Optimizer.step is before and not seam.installed()
    monkeypatch.setenv(seam.FUSED_CLIP_ENV, "1")
    assert seam.install_optimizer_fused_clip() and BF16Optimizer.step is seam.step
    seam.uninstall_optimizer_fused_clip()
    assert BF16Optimizer.step is before


def test_grad_norm_sq_matches_specforges_sum():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, 7, generator=gen).to(torch.bfloat16) for n in (5, 64, 1)]
    want = torch.stack([g.float().square().sum() for g in grads]).sum()
    torch.testing.assert_close(seam.grad_norm_sq(grads), want, rtol=1e-6, atol=0)
    assert seam.grad_norm_sq([]) is None


@pytest.mark.parametrize(
    "recipe", ["recipes/kimi-k25-8xb200-lowered.yaml", "recipes/kimi-k25-8xb200-lowered-dflash.yaml"]
)
def test_recipe_knob_needs_fused_adamw_and_reaches_every_family(recipe):
    import yaml

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.training import step_knobs

    raw = yaml.safe_load(open(recipe))
    raw["trainer"]["step_optimizer_fused_clip"] = False
    off_plan = compile_plan(raw)
    assert dict(off_plan.process_env)[step_knobs.FUSED_CLIP_ENV] == "0"
    raw["trainer"]["step_optimizer_fused_clip"] = True
    plan = compile_plan(raw)
    assert dict(plan.process_env)[step_knobs.FUSED_CLIP_ENV] == "1"
    on, off = step_knobs.trainer_env(plan.recipe.trainer), step_knobs.trainer_env(off_plan.recipe.trainer)
    assert step_knobs.patches_needed(on) == step_knobs.patches_needed(off)  # a seam: no patch of its own
    raw["trainer"]["fused_adamw"] = False
    with pytest.raises((KimiInputError, ValueError), match="step_optimizer_fused_clip needs trainer.fused_adamw: true"):
        compile_plan(raw)
