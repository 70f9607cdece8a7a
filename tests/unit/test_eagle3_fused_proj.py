"""The eagle3-fused-proj seam (``drafts.eagle3_fused_proj``) and its recipe field ``trainer.step_eagle3_fused_proj``.

SpecForge's own eagle3 step on the CPU (fp32, a tiny Llama draft, TTT length 3) with and without the seam: the same
loss and gradients, both sibling groups wrapped and fused at every TTT position; beside eagle3-fused-wgrad (each
group's weight gradient summed in its GEMM) and inside compile-elementwise's compiled regions. On a toy group: a
sibling called on another input, or on its input after an in-place change, runs its own linear; each part is handed
out once; outside an eagle3 forward the siblings are plain linears. Our MLA draft fuses its own siblings alike.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
from eagle3_cpu import llama_step, mla_step

from specforge_kimi.drafts import eagle3_fused_proj as fp
from specforge_kimi.drafts import eagle3_fused_wgrad as fw
from specforge_kimi.training import step_knobs

GROUPS = ["midlayer.self_attn.q_proj+k_proj+v_proj", "midlayer.mlp.gate_proj+up_proj"]
SIBLINGS = [
    "midlayer.self_attn.q_proj",
    "midlayer.self_attn.k_proj",
    "midlayer.self_attn.v_proj",
    "midlayer.mlp.gate_proj",
    "midlayer.mlp.up_proj",
]


@pytest.fixture
def seam(monkeypatch):
    """Installs nothing itself; puts SpecForge's forward and the linears' own back after the test, and counts the
    groups' fused GEMMs of each eagle3 forward (``steps``: one ``_Step`` each)."""
    monkeypatch.delenv(fp.FUSED_PROJ_ENV, raising=False)
    monkeypatch.delenv(fw.FUSED_WGRAD_ENV, raising=False)
    steps: list = []

    class Recorded(fp._Step):
        def __init__(self):
            super().__init__()
            steps.append(self)

    monkeypatch.setattr(fp, "_Step", Recorded)
    yield steps
    fp.uninstall_eagle3_fused_proj()
    fw.uninstall_eagle3_fused_wgrad()


def _same(grads: dict, plain: dict, rtol: float = 1e-5) -> None:
    assert grads.keys() == plain.keys() and {f"{n}.weight" for n in SIBLINGS} <= grads.keys()
    for name, g in plain.items():  # the same products, summed in another order by the wider GEMMs: fp32 rounding
        assert torch.allclose(grads[name], g, rtol=rtol, atol=1e-6 * g.abs().max().item()), name
        assert g.abs().max() > 0, name


def test_specforge_eagle3_step_same_loss_and_gradients(cpu_shims, seam):
    """sdpa: flex attention has no backward on the CPU; every backend calls the projections and views their outputs
    alike."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    plain_draft, plain_loss, plain = llama_step()
    assert fp.wrapped_groups(plain_draft) == [] and seam == []
    assert fp.install_eagle3_fused_proj(force=True) and fp.installed(OnlineEagle3Model)
    draft, loss, grads = llama_step()
    assert fp.wrapped_groups(draft) == GROUPS
    assert [s.fused_calls for s in seam] == [2 * 3]  # both groups at each of the three TTT positions
    assert not seam[0].pending and seam[0].own_calls == 0  # every sibling took its part
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    _same(grads, plain)


def test_beside_fused_weight_gradients(cpu_shims, seam, monkeypatch):
    """With eagle3-fused-wgrad too: the siblings are this seam's, each group's weight gradient is summed in its GEMM
    over the TTT positions (one hand-on per group and step), every other linear is that seam's as before."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    _, plain_loss, plain = llama_step()
    fw.install_eagle3_fused_wgrad(force=True)
    fp.install_eagle3_fused_proj(force=True)
    fn = fw._impl()["function"]
    original, handed = fn.backward, []

    def counting(ctx, grad_out):
        out = original(ctx, grad_out)
        handed.append((ctx.acc.name, out[1] is not None))
        return out

    monkeypatch.setattr(fn, "backward", staticmethod(counting))
    draft, loss, grads = llama_step()
    assert fp.wrapped_groups(draft) == GROUPS
    assert fw.installed(OnlineEagle3Model) and fp.installed(OnlineEagle3Model)  # fused-proj's forward wraps the other
    outer = OnlineEagle3Model.forward
    assert fw.install_eagle3_fused_wgrad(force=True) and OnlineEagle3Model.forward is outer  # installed: not again
    others = ["midlayer.self_attn.o_proj", "midlayer.mlp.down_proj", "lm_head"]
    assert fw.wrapped_names(draft) == others
    assert Counter(handed) == {**{(n, True): 1 for n in GROUPS + others}, **{(n, False): 2 for n in GROUPS + others}}
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    _same(grads, plain)


def test_with_the_compiled_layer_regions(cpu_shims, seam):
    """Beside compile-elementwise (its after-attention region calls the MLP's siblings: each a graph break) the
    step's loss and gradients are the compiled step's, and the MLP's group still fuses."""
    from specforge_kimi.drafts import compile_elementwise as ce

    try:
        ce.install_compile_elementwise(backend="aot_eager", force=True)
        _, compiled_loss, compiled = llama_step()
        fp.install_eagle3_fused_proj(force=True)
        draft, loss, grads = llama_step()
    finally:
        ce.uninstall_compile_elementwise()
        torch._dynamo.reset()
    assert fp.wrapped_groups(draft) == GROUPS
    assert [s.fused_calls for s in seam] == [2 * 3]
    assert loss.item() == pytest.approx(compiled_loss.item(), rel=1e-6)
    _same(grads, compiled)


def test_the_mla_draft_fuses_its_down_projections_and_mlp(cpu_shims, seam):
    """Our MLA EAGLE-3 draft (``drafts.mla_eagle3``): its attention's q/kv down-projections and its MLP's gate/up."""

    _, plain_loss, plain = mla_step()
    fp.install_eagle3_fused_proj(force=True)
    draft, loss, grads = mla_step()
    assert fp.wrapped_groups(draft) == [
        "midlayer.self_attn.q_a_proj+kv_a_proj_with_mqa",
        "midlayer.mlp.gate_proj+up_proj",
    ]
    assert [s.fused_calls for s in seam] == [2 * 3] and not seam[0].pending and seam[0].own_calls == 0
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6) and grads.keys() == plain.keys()
    for name, g in plain.items():
        assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item()), name


class _Attn(nn.Module):
    def __init__(self, width: int = 12):
        super().__init__()
        self.q_proj = nn.Linear(width, 8, bias=False)
        self.k_proj = nn.Linear(width, 4, bias=False)
        self.v_proj = nn.Linear(width, 4, bias=False)


def _toy():
    torch.manual_seed(3)
    draft = nn.Module()
    draft.midlayer = nn.Module()
    draft.midlayer.self_attn = _Attn()
    assert fp.wrap_draft_siblings(draft) == ["midlayer.self_attn.q_proj+k_proj+v_proj"]
    assert fp.wrap_draft_siblings(draft) == []  # idempotent
    return draft.midlayer.self_attn


def _plain(attn: _Attn, x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.nn.functional.linear(x, getattr(attn, name).weight)


def test_each_part_once_and_only_for_its_own_input(seam):
    attn = _toy()
    x, other = torch.randn(5, 12), torch.randn(5, 12)
    with fp.fusing() as step:
        q = attn.q_proj(x)
        assert step.fused_calls == 1 and set(step.pending[next(iter(step.pending))][2]) == {1, 2}
        k = attn.k_proj(other)  # another input: its own linear, the group's parts still waiting
        assert torch.allclose(k, _plain(attn, other, "k_proj")) and (step.fused_calls, step.own_calls) == (1, 1)
        k = attn.k_proj(x)
        v = attn.v_proj(x)
        assert not step.pending
        v_again = attn.v_proj(x)  # the part was handed out: a new group GEMM, the other parts left waiting
        assert step.fused_calls == 2
    for out, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj"), (v_again, "v_proj")):
        assert torch.allclose(out, _plain(attn, x, name), atol=1e-6), name


def test_the_key_and_value_parts_do_not_keep_the_group_output(seam):
    """The attention keeps its key and value across the TTT positions: they are copies, so the group output (the
    query's columns) is freed with the query."""
    attn = _toy()
    x = torch.randn(5, 12)
    with fp.fusing():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert not q.is_contiguous()  # the query is a view of the group output
    storage = q.untyped_storage().data_ptr()
    assert k.is_contiguous() and v.is_contiguous()
    assert storage not in (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())


def test_an_input_changed_in_place_is_not_served(seam):
    attn = _toy()
    x = torch.randn(5, 12)
    with fp.fusing() as step:
        attn.q_proj(x)
        x.mul_(2)
        k = attn.k_proj(x)
        assert step.fused_calls == 2
    assert torch.allclose(k, _plain(attn, x, "k_proj"), atol=1e-6)


def test_the_concatenated_weight_follows_an_in_place_update(seam):
    attn = _toy()
    x = torch.randn(5, 12)
    with fp.fusing():
        attn.q_proj(x)
        with torch.no_grad():
            attn.v_proj.weight.add_(1.0)
        torch.set_grad_enabled(True)
        v = attn.v_proj(x.clone())  # a new GEMM: the weight changed since the concatenation was made
    assert torch.allclose(v, _plain(attn, x, "v_proj"), atol=1e-5)


def test_outside_the_eagle3_forward_the_siblings_are_plain(seam):
    attn = _toy()
    x = torch.randn(5, 12)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(attn, name)(x), _plain(attn, x, name))
    with fp.fusing() as step, torch.no_grad():
        attn.q_proj(x)
    assert step.fused_calls == 0
    fp.uninstall_eagle3_fused_proj()
    assert "forward" not in attn.q_proj.__dict__ and fp.wrapped_groups(attn) == []


def test_a_fused_gradient_reaches_each_weight(seam):
    """Autograd through the split and the concatenation: each sibling weight gets its own rows' gradient, an unused
    part's gradient is zero."""
    attn = _toy()
    x = torch.randn(5, 12, requires_grad=True)
    with fp.fusing():
        loss = attn.q_proj(x).square().sum() + attn.k_proj(x).sum()  # v never asked for
    loss.backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _plain(attn, ref_x, "q_proj").square().sum() + _plain(attn, ref_x, "k_proj").sum()
    wq, wk = (getattr(attn, n).weight for n in ("q_proj", "k_proj"))
    gq, gk, gx = torch.autograd.grad(ref, (wq, wk, ref_x))
    assert torch.allclose(wq.grad, gq, atol=1e-5) and torch.allclose(wk.grad, gk, atol=1e-5)
    assert torch.allclose(x.grad, gx, atol=1e-5)
    assert attn.v_proj.weight.grad is not None and not attn.v_proj.weight.grad.any()


def test_the_recipe_field_reaches_the_specforge_processes_of_an_eagle3_recipe_only():
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.run_plan import compile_plan, load_recipe

    raw = load_recipe("recipes/kimi-k25-8xb200-lowered.yaml").model_dump()
    assert dict(compile_plan(raw).process_env)[step_knobs.FUSED_PROJ_ENV] == "0"
    raw["trainer"]["step_eagle3_fused_proj"] = True
    assert dict(compile_plan(raw).process_env)[step_knobs.FUSED_PROJ_ENV] == "1"
    block = load_recipe("recipes/kimi-k25-8xb200-lowered-dflash.yaml").model_dump(exclude_unset=True)
    assert step_knobs.FUSED_PROJ_ENV not in dict(compile_plan(block).process_env)
    block["trainer"]["step_eagle3_fused_proj"] = True
    with pytest.raises(KimiInputError, match="step_eagle3_fused_proj"):
        compile_plan(block)
