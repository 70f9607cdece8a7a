"""The eagle3-fused-wgrad seam (``drafts.eagle3_fused_wgrad``) and its recipe field ``trainer.step_eagle3_fused_wgrad``.

SpecForge's own eagle3 step on the CPU (fp32, a tiny Llama draft, TTT length 3) with and without the seam: the same
loss and gradients, every linear of the draft layer and the head wrapped, and each wrapped weight's backwards handing
autograd one gradient per step (the others none). On toy chains: bf16 sums at least as close to an fp64 reference as
autograd's; a use that ran no backward raises at the end of the pass instead of losing its weight's sum; outside an
eagle3 forward (or without gradients) a wrapped linear is ``F.linear``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.nn as nn
from eagle3_cpu import llama_step, mla_step

from specforge_kimi.drafts import eagle3_fused_wgrad as fw
from specforge_kimi.training import step_knobs

LINEARS = [
    "midlayer.self_attn.q_proj",
    "midlayer.self_attn.k_proj",
    "midlayer.self_attn.v_proj",
    "midlayer.self_attn.o_proj",
    "midlayer.mlp.gate_proj",
    "midlayer.mlp.up_proj",
    "midlayer.mlp.down_proj",
    "lm_head",
]


@pytest.fixture
def seam(monkeypatch):
    """Installs nothing itself; puts SpecForge's forward and the linears' own back after the test."""
    monkeypatch.delenv(fw.FUSED_WGRAD_ENV, raising=False)
    yield
    fw.uninstall_eagle3_fused_wgrad()


def _handed(monkeypatch) -> list:
    """(weight name, whether a gradient was handed to autograd) for every backward of the seam's function."""
    fn = fw._impl()["function"]
    original, calls = fn.backward, []

    def counting(ctx, grad_out):
        out = original(ctx, grad_out)
        calls.append((ctx.acc.name, out[1] is not None))
        return out

    monkeypatch.setattr(fn, "backward", staticmethod(counting))
    return calls


def test_specforge_eagle3_step_same_loss_and_gradients(cpu_shims, seam, monkeypatch):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    plain_draft, plain_loss, plain = llama_step()
    assert fw.wrapped_names(plain_draft) == []
    assert fw.install_eagle3_fused_wgrad(force=True) and fw.installed(OnlineEagle3Model)
    handed = _handed(monkeypatch)
    draft, loss, grads = llama_step()
    assert fw.wrapped_names(draft) == LINEARS
    # three TTT positions: three backwards per weight, one of them hands the sum on
    assert Counter(handed) == {**{(n, True): 1 for n in LINEARS}, **{(n, False): 2 for n in LINEARS}}
    assert loss == plain_loss
    assert grads.keys() == plain.keys() and {f"{n}.weight" for n in LINEARS} <= grads.keys()
    for name, g in plain.items():  # same products, same order of sums: fp32 rounding at most
        assert torch.allclose(grads[name], g, rtol=1e-6, atol=1e-7 * g.abs().max().item()), name
        assert g.abs().max() > 0, name


def test_the_mla_draft_same_loss_and_gradients(cpu_shims, seam):
    """Our MLA EAGLE-3 draft (``drafts.mla_eagle3``) through the same step: its layer's linears and head wrapped."""

    _, plain_loss, plain = mla_step()
    fw.install_eagle3_fused_wgrad(force=True)
    draft, loss, grads = mla_step()
    names = fw.wrapped_names(draft)
    assert "lm_head" in names and len(names) >= 5 and all(n.startswith("midlayer.") for n in names[:-1])
    assert loss == plain_loss and grads.keys() == plain.keys()
    for name, g in plain.items():
        assert torch.allclose(grads[name], g, rtol=1e-6, atol=1e-7 * g.abs().max().item()), name


def test_with_the_compiled_layer_regions(cpu_shims, seam):
    """Beside the compile-elementwise seam (its regions call the MLP's linears: the wrapped forward runs outside
    the compiled graph) the step's loss and gradients are the compiled step's."""
    from specforge_kimi.drafts import compile_elementwise as ce

    try:
        ce.install_compile_elementwise(backend="aot_eager", force=True)
        _, compiled_loss, compiled = llama_step()
        fw.install_eagle3_fused_wgrad(force=True)
        draft, loss, grads = llama_step()
    finally:
        ce.uninstall_compile_elementwise()
        torch._dynamo.reset()
    assert fw.wrapped_names(draft) == LINEARS
    assert loss == pytest.approx(compiled_loss.item(), rel=1e-6)
    for name, g in compiled.items():
        assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item()), name


def test_handing_the_sum_from_every_use_would_count_it_again(cpu_shims, seam, monkeypatch):
    """The check above can fail: a seam that hands its running sum on from each backward changes the gradients."""
    fw.install_eagle3_fused_wgrad(force=True)
    _, _, good = llama_step()
    fn = fw._impl()["function"]
    original = fn.backward

    def every_use(ctx, grad_out):
        acc = ctx.acc
        gx, gw, _ = original(ctx, grad_out)
        if gw is None:
            gw = acc.buf.clone()
        return gx, gw, None

    monkeypatch.setattr(fn, "backward", staticmethod(every_use))
    _, _, bad = llama_step()
    assert not torch.allclose(bad["lm_head.weight"], good["lm_head.weight"], rtol=1e-3)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free linear holding ``weight``, wrapped by the seam as a draft's ``midlayer``."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.clone())
    draft = nn.Module()
    draft.midlayer = lin
    assert fw.wrap_draft_linears(draft) == ["midlayer"]
    return lin


def _chain_grad(lin: nn.Linear, x: torch.Tensor, uses: int, *, sum_in_gemm: bool) -> torch.Tensor:
    """The weight's gradient of ``uses`` applications of ``lin``, each feeding the next and the loss."""
    lin.weight.grad = None
    h, loss = x, 0
    with fw.summing() if sum_in_gemm else contextlib.nullcontext():
        for _ in range(uses):
            h = torch.tanh(lin(h))
            loss = loss + h.float().square().sum()
    loss.backward()
    return lin.weight.grad


def test_bf16_sum_rounded_once(seam):
    """bf16, seven uses: autograd rounds each product and then each partial sum; the seam's GEMM adds each product
    into the sum before rounding. Measured against fp64 the seam's error is no larger."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 48, generator=g) / 48**0.5
    x = torch.randn(96, 48, generator=g)
    ref = _chain_grad(_linear(w.double()), x.double(), 7, sum_in_gemm=False)
    lin = _linear(w.bfloat16())
    default = _chain_grad(lin, x.bfloat16(), 7, sum_in_gemm=False)
    seam_grad = _chain_grad(lin, x.bfloat16(), 7, sum_in_gemm=True)
    assert default.dtype == seam_grad.dtype == torch.bfloat16 and not torch.equal(default, seam_grad)
    err = lambda t: ((t.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(seam_grad) <= err(default) * 1.05 and err(seam_grad) < 2e-2


class _Toy(nn.Module):
    """A draft's two parts, each used ``uses`` times: the layer feeding itself, the head on each output."""

    def __init__(self):
        super().__init__()
        self.midlayer = nn.Linear(16, 16, bias=False)
        self.lm_head = nn.Linear(16, 8, bias=False)

    def forward(self, x, uses: int, sum_in_gemm: bool):
        loss = 0
        with fw.summing() if sum_in_gemm else contextlib.nullcontext():
            for _ in range(uses):
                x = torch.tanh(self.midlayer(x))
                loss = loss + self.lm_head(x).square().sum()
        return loss


def _fsdp_rank(rank: int, port: int, strategy: str) -> None:
    """One of two gloo ranks: SpecForge's FSDP settings (``use_orig_params``, the given sharding) over a toy draft,
    each rank its own batch, without and with the seam; the sharded gradients after the reduce-scatter agree."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        grads = []
        for sum_in_gemm in (False, True):
            torch.manual_seed(0)
            toy = _Toy()
            if sum_in_gemm:
                fw.wrap_draft_linears(toy)
            model = FSDP(
                toy,
                use_orig_params=True,
                sharding_strategy=getattr(ShardingStrategy, strategy),
                device_id=torch.device("cpu"),
            )
            x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1 + rank))
            model(x, 4, sum_in_gemm).backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        plain, fused = grads
        assert plain and plain.keys() == fused.keys()
        for name, g in plain.items():
            assert torch.allclose(fused[name], g, rtol=1e-6, atol=1e-7), (strategy, rank, name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_behind_fsdp_flat_parameters_on_two_ranks(seam, strategy):
    """The gradient FSDP reduces and shards is the same sum: the seam hands it through ``use_orig_params`` views of
    the flat parameter (FULL_SHARD also frees and gathers the weights between the forward and the backward)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(port, strategy), nprocs=2)


def test_outside_the_eagle3_forward_a_wrapped_linear_is_plain(seam):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(16, 16, generator=g), torch.randn(8, 16, generator=g)
    lin = _linear(w)
    plain = _chain_grad(lin, x, 3, sum_in_gemm=False)
    fused = _chain_grad(lin, x, 3, sum_in_gemm=True)
    assert torch.allclose(plain, fused, rtol=1e-6, atol=1e-7)
    with fw.summing(), torch.no_grad():  # no gradients: nothing summed, plain values
        assert torch.equal(lin(x), x @ w.t())


def test_a_use_without_backward_raises_naming_the_weight(seam):
    g = torch.Generator().manual_seed(3)
    lin = _linear(torch.randn(16, 16, generator=g))
    x = torch.randn(4, 16, generator=g)
    with fw.summing():
        kept = lin(x)
        dropped = lin(x)  # never reaches the loss: its backward never runs
        del dropped
    with pytest.raises(RuntimeError, match=r"eagle3-fused-wgrad: 1 of 2 uses of midlayer ran no backward"):
        kept.sum().backward()


def test_a_second_pass_over_the_graph_is_autograds_own_sum(seam):
    """``retain_graph``: the second backward's uses hand their own products (autograd sums them), so the weight's
    gradient is twice the first pass's and nothing raises."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(16, 16, generator=g), torch.randn(6, 16, generator=g)
    once = _chain_grad(_linear(w), x, 3, sum_in_gemm=False).clone()
    lin = _linear(w)
    with fw.summing():
        h, loss = x, 0
        for _ in range(3):
            h = torch.tanh(lin(h))
            loss = loss + h.square().sum()
    loss.backward(retain_graph=True)
    assert torch.allclose(lin.weight.grad, once, rtol=1e-6, atol=1e-7)
    loss.backward()
    assert torch.allclose(lin.weight.grad, 2 * once, rtol=1e-6, atol=1e-7)


def test_under_cpu_autocast_a_wrapped_linear_is_plain(seam):
    g = torch.Generator().manual_seed(5)
    lin = _linear(torch.randn(16, 16, generator=g))
    x = torch.randn(4, 16, generator=g)
    with fw.summing(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
    assert out.dtype == torch.bfloat16 and out.grad_fn.name() != "AccumulatingLinearBackward"
    out.float().sum().backward()
    assert lin.weight.grad is not None


def test_not_requested_nothing_replaced(seam):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    before = OnlineEagle3Model.forward
    assert not fw.install_eagle3_fused_wgrad()
    assert OnlineEagle3Model.forward is before and not fw.installed(OnlineEagle3Model)
    assert fw.install_eagle3_fused_wgrad(force=True) and OnlineEagle3Model.forward is not before
    assert fw.install_eagle3_fused_wgrad(force=True)  # idempotent
    lin = _linear(torch.randn(4, 4))
    assert "forward" in lin.__dict__
    fw.uninstall_eagle3_fused_wgrad()
    assert OnlineEagle3Model.forward is before and "forward" not in lin.__dict__


def test_the_recipe_switch_reaches_the_trainer_and_is_checked():
    """trainer.step_eagle3_fused_wgrad reaches an eagle3 recipe's processes as the seam's variable (a registration
    seam: no SpecForge patch asked for); refused beside the chunked head loss and in a block-draft recipe."""
    import yaml

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.run_plan import compile_plan

    raw = yaml.safe_load(open("recipes/kimi-k25-8xb200-lowered.yaml"))
    raw["trainer"]["step_eagle3_fused_wgrad"] = False
    assert dict(compile_plan(raw).process_env)[step_knobs.FUSED_WGRAD_ENV] == "0"
    raw["trainer"]["step_eagle3_fused_wgrad"] = True
    env = dict(compile_plan(raw).process_env)
    assert env[step_knobs.FUSED_WGRAD_ENV] == "1"
    assert step_knobs.patches_needed(env) == step_knobs.patches_needed({**env, step_knobs.FUSED_WGRAD_ENV: "0"})
    raw["trainer"]["step_chunked_head_loss"] = 1024
    with pytest.raises(KimiInputError, match="step_eagle3_fused_wgrad and trainer.step_chunked_head_loss exclude"):
        compile_plan(raw)
    block = yaml.safe_load(open("recipes/kimi-k25-8xb200-lowered-dflash.yaml"))
    assert step_knobs.FUSED_WGRAD_ENV not in dict(compile_plan(block).process_env)
    block["trainer"]["step_eagle3_fused_wgrad"] = True
    with pytest.raises(KimiInputError, match="trainer.step_eagle3_fused_wgrad"):
        compile_plan(block)
