"""The compile-elementwise seam (``drafts.compile_elementwise``) and its recipe field ``trainer.step_compile_elementwise``.

One seeded SpecForge eagle3 step (CPU path, fp32, a tiny Llama draft) with and without the seam: the loss, every
gradient and the step's expected-acceptance metrics agree within 1e-5 relative, on the KL objective and on
SpecForge's LK objectives (where the metric is part of the loss and its backward runs compiled). Inductor reorders
the fp32 reductions of RMSNorm and the fused backward (one sum where eager makes several), so bit-identity is not
expected; measured here the differences are near 3e-7 relative, a
few fp32 ulps over the step's chains of reductions, and an operation left out or misplaced in a region moves
them to order 1. Without a C++ compiler inductor cannot build CPU kernels; the test then uses ``aot_eager``
(the same AOTAutograd forward/backward split, no fused kernels) and says so in its id.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from eagle3_cpu import LLAMA_H64 as LLAMA
from eagle3_cpu import eagle3_step

from specforge_kimi.drafts import compile_elementwise as ce
from specforge_kimi.training import step_knobs

INDUCTOR = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
BACKEND = "inductor" if INDUCTOR else "aot_eager"


@pytest.fixture
def seam(cpu_shims, monkeypatch):
    """Installs nothing itself; puts SpecForge's layer back after the test."""
    monkeypatch.delenv(ce.COMPILE_ENV, raising=False)
    yield
    ce.uninstall_compile_elementwise()
    torch._dynamo.reset()


def _draft(seed: int = 0):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    return LlamaForCausalLMEagle3(LlamaConfig(**LLAMA), attention_backend="sdpa")


def _step(length: int = 24, draft=None, lk_loss_type=None, metrics=None):
    draft = draft if draft is not None else _draft()
    run = eagle3_step(
        draft, length=length, ttt=3, vocab=LLAMA["vocab_size"], target_hidden=64, lk_loss_type=lk_loss_type
    )
    loss = run()
    if metrics is not None:
        metrics.update(run.metrics)
    return loss, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def _acceptance(metrics: dict) -> list[float]:
    """The step's per-position expected acceptance (SpecForge's ``acceptance_rates``), as floats."""
    return [float(a) for a in metrics["acceptance_rates"]]


def _counting(graphs: list, inner):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return backend


def _inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _aot_eager(gm, example_inputs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.compilers import nop

    return aot_autograd(fw_compiler=nop)(gm, example_inputs)


@pytest.mark.parametrize("backend", [BACKEND])
def test_the_compiled_layer_gives_the_same_step(seam, backend):
    from specforge.modeling.draft.llama3_eagle import LlamaDecoderLayer

    m0: dict = {}
    loss0, grads0 = _step(metrics=m0)
    graphs: list = []
    assert ce.install_compile_elementwise(
        force=True, backend=_counting(graphs, _inductor if backend == "inductor" else _aot_eager)
    )
    assert ce.installed(LlamaDecoderLayer) and ce.metric_installed()
    m1: dict = {}
    loss1, grads1 = _step(metrics=m1)
    assert len(graphs) == 3  # both regions and the metric compiled, each once over the TTT positions
    assert torch.allclose(loss1, loss0, rtol=1e-5, atol=0)
    a0, a1 = _acceptance(m0), _acceptance(m1)
    assert len(a0) == 3 and all(0 < a < 1 for a in a0)
    assert a1 == pytest.approx(a0, rel=1e-5, abs=0)
    assert grads1.keys() == grads0.keys() and "midlayer.mlp.gate_proj.weight" in grads0
    for name, g0 in grads0.items():
        rel = ((grads1[name] - g0).norm() / g0.norm()).item()
        assert rel < 1e-5, f"{name}: {rel:.2e}"


def test_new_sequence_lengths_reuse_the_compiled_regions(seam):
    """The regions' and the metric's sequence dimension is dynamic from the first compile: a new sample length
    compiles nothing."""
    graphs: list = []
    ce.install_compile_elementwise(force=True, backend=_counting(graphs, lambda gm, _: gm.forward))
    draft = _draft()
    for length in (24, 40, 17):
        _step(length, draft)
        assert len(graphs) == 3, f"length {length} compiled again"


@pytest.mark.parametrize("lk_loss_type", ["lambda", "alpha"])
def test_the_compiled_metric_gives_the_same_lk_loss_and_gradients(seam, lk_loss_type):
    """On SpecForge's LK objectives the acceptance metric is part of the loss: the compiled metric's backward gives
    the same loss and gradients as SpecForge's eager one."""
    m0: dict = {}
    loss0, grads0 = _step(lk_loss_type=lk_loss_type, metrics=m0)
    ce.install_compile_elementwise(force=True, backend=_inductor if INDUCTOR else _aot_eager)
    m1: dict = {}
    loss1, grads1 = _step(lk_loss_type=lk_loss_type, metrics=m1)
    assert torch.allclose(loss1, loss0, rtol=1e-5, atol=0)
    assert _acceptance(m1) == pytest.approx(_acceptance(m0), rel=1e-5, abs=0)
    assert grads1.keys() == grads0.keys() and "lm_head.weight" in grads0
    for name, g0 in grads0.items():
        rel = ((grads1[name] - g0).norm() / g0.norm()).item()
        assert rel < 1e-5, f"{name}: {rel:.2e}"


def test_without_the_variable_specforges_layer_is_untouched(seam, monkeypatch):
    from specforge.core import lk_loss
    from specforge.modeling.draft.llama3_eagle import LlamaDecoderLayer

    shipped = LlamaDecoderLayer.forward
    metric = getattr(lk_loss, ce.METRIC_NAME)
    for value in (None, "0", ""):
        if value is not None:
            monkeypatch.setenv(ce.COMPILE_ENV, value)
        assert ce.install_compile_elementwise() is False
        assert LlamaDecoderLayer.forward is shipped and not ce.installed(LlamaDecoderLayer)
        assert getattr(lk_loss, ce.METRIC_NAME) is metric and not ce.metric_installed()
    monkeypatch.setenv(ce.COMPILE_ENV, "1")
    assert ce.install_compile_elementwise(backend=_counting([], lambda gm, _: gm.forward))
    assert LlamaDecoderLayer.forward is not shipped and ce.installed(LlamaDecoderLayer)
    assert getattr(lk_loss, ce.METRIC_NAME) is not metric and ce.metric_installed()
    ce.uninstall_compile_elementwise()
    assert LlamaDecoderLayer.forward is shipped
    assert getattr(lk_loss, ce.METRIC_NAME) is metric


def test_the_recipe_field_reaches_the_trainer_processes_and_the_bench():
    import sys
    from pathlib import Path

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.run_plan import compile_plan, load_recipe

    raw = load_recipe("recipes/kimi-k25-8xb200-lowered.yaml").model_dump()
    raw["trainer"]["step_compile_elementwise"] = False
    off_plan = compile_plan(raw)
    r = off_plan.recipe
    assert dict(off_plan.process_env)[step_knobs.COMPILE_ELEMENTWISE_ENV] == "0"
    raw["trainer"]["step_compile_elementwise"] = True
    on_plan = compile_plan(raw)
    assert dict(on_plan.process_env)[step_knobs.COMPILE_ELEMENTWISE_ENV] == "1"
    on = step_knobs.trainer_env(on_plan.recipe.trainer)
    assert step_knobs.patches_needed(on) == step_knobs.patches_needed(step_knobs.trainer_env(r.trainer))  # no patch
    import yaml

    block = yaml.safe_load(open("recipes/kimi-k25-8xb200-lowered-dflash.yaml"))
    assert step_knobs.COMPILE_ELEMENTWISE_ENV not in dict(compile_plan(block).process_env)
    block["trainer"]["step_compile_elementwise"] = True
    with pytest.raises(KimiInputError, match="step_compile_elementwise"):
        compile_plan(block)
    sys.path.insert(0, str(Path("bench").resolve()))
    try:
        import trainer_memory
    finally:
        sys.path.pop(0)
    env = trainer_memory.variant_env(r, "compiled", {ce.COMPILE_ENV: "0"})
    assert env[ce.COMPILE_ENV] == "1"
    assert trainer_memory.variant_env(r, "recipe", {ce.COMPILE_ENV: "1"})[ce.COMPILE_ENV] == "0"
