"""The compile-elementwise seam (``drafts.compile_elementwise``) and its recipe field ``trainer.step_compile_elementwise``.

One seeded SpecForge eagle3 step (CPU path, fp32, a tiny Llama draft) with and without the seam: the loss and every
gradient agree within 1e-5 relative. Inductor reorders the fp32 reductions of RMSNorm and the fused backward
(one sum where eager makes several), so bit-identity is not expected; measured here the differences are near 3e-7 relative, a
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


def _step(length: int = 24, draft=None):
    draft = draft if draft is not None else _draft()
    loss = eagle3_step(draft, length=length, ttt=3, vocab=LLAMA["vocab_size"], target_hidden=64)()
    return loss, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


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

    loss0, grads0 = _step()
    graphs: list = []
    assert ce.install_compile_elementwise(
        force=True, backend=_counting(graphs, _inductor if backend == "inductor" else _aot_eager)
    )
    assert ce.installed(LlamaDecoderLayer)
    loss1, grads1 = _step()
    assert len(graphs) == 2  # both regions compiled, and only once over the TTT positions
    assert torch.allclose(loss1, loss0, rtol=1e-5, atol=0)
    assert grads1.keys() == grads0.keys() and "midlayer.mlp.gate_proj.weight" in grads0
    for name, g0 in grads0.items():
        rel = ((grads1[name] - g0).norm() / g0.norm()).item()
        assert rel < 1e-5, f"{name}: {rel:.2e}"


def test_new_sequence_lengths_reuse_the_compiled_regions(seam):
    """The regions' sequence dimension is dynamic from the first compile: a new sample length compiles nothing."""
    graphs: list = []
    ce.install_compile_elementwise(force=True, backend=_counting(graphs, lambda gm, _: gm.forward))
    draft = _draft()
    for length in (24, 40, 17):
        _step(length, draft)
        assert len(graphs) == 2, f"length {length} compiled again"


def test_without_the_variable_specforges_layer_is_untouched(seam, monkeypatch):
    from specforge.modeling.draft.llama3_eagle import LlamaDecoderLayer

    shipped = LlamaDecoderLayer.forward
    for value in (None, "0", ""):
        if value is not None:
            monkeypatch.setenv(ce.COMPILE_ENV, value)
        assert ce.install_compile_elementwise() is False
        assert LlamaDecoderLayer.forward is shipped and not ce.installed(LlamaDecoderLayer)
    monkeypatch.setenv(ce.COMPILE_ENV, "1")
    assert ce.install_compile_elementwise(backend=_counting([], lambda gm, _: gm.forward))
    assert LlamaDecoderLayer.forward is not shipped and ce.installed(LlamaDecoderLayer)
    ce.uninstall_compile_elementwise()
    assert LlamaDecoderLayer.forward is shipped


def test_the_recipe_field_reaches_the_trainer_processes_and_the_bench():
    import sys
    from pathlib import Path

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.run_plan import compile_plan, load_recipe

    r = load_recipe("recipes/kimi-k25-8xb200-lowered.yaml")
    assert r.trainer.step_compile_elementwise is False  # not measured on a GPU yet: off
    assert dict(compile_plan(r).process_env)[step_knobs.COMPILE_ELEMENTWISE_ENV] == "0"
    raw = r.model_dump()
    raw["trainer"]["step_compile_elementwise"] = True
    assert dict(compile_plan(raw).process_env)[step_knobs.COMPILE_ELEMENTWISE_ENV] == "1"
    on = step_knobs.trainer_env(compile_plan(raw).recipe.trainer)
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
