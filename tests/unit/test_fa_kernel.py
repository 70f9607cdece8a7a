"""The fa-kernel seam (``drafts.eagle3_fa_kernel``): SpecForge's ``fa`` EAGLE-3 attention on PyTorch's kernels.

On the CPU the seam's function runs PyTorch's CPU flash kernel (log-sum-exp out), so everything but the CUDA kernel
choice is checked here: the function against dense attention in fp64 over every key block with the EAGLE-3 mask
(causal over the first block, the own-position key of each later block, rows past the valid length zero), values
and the gradients of the query and of every key and value block, with GQA and right padding; and SpecForge's whole
eagle3 step with ``attention_backend: fa`` through the seam against the same step on SpecForge's ``sdpa`` path (its
eager TTT attention): the same loss and gradients, padded or not. The CUDA kernel (PyTorch's flash) is
checked on a GPU (tests/gpu/test_fa_kernel_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from eagle3_cpu import LLAMA_H64 as LLAMA
from eagle3_cpu import dense_eagle3_attention, eagle3_step

from specforge_kimi.drafts import eagle3_fa_kernel as fk
from specforge_kimi.training import step_knobs


@pytest.fixture
def seam(cpu_shims, monkeypatch):
    """Installs nothing itself; puts SpecForge's function back after the test."""
    monkeypatch.delenv(fk.FA_KERNEL_ENV, raising=False)
    yield
    fk.uninstall_fa_kernel()


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_the_function_is_dense_eagle3_attention_with_gqa_and_padding(seam, blocks):
    fn = fk._make_function()
    g = torch.Generator().manual_seed(blocks)
    b, s, h, h_kv, d = 2, 13, 4, 2, 8
    q = torch.randn(b, s, h, d, generator=g, requires_grad=True)
    ck = torch.randn(b, blocks, s, h_kv, d, generator=g, requires_grad=True)
    cv = torch.randn(b, blocks, s, h_kv, d, generator=g, requires_grad=True)
    valid = torch.tensor([s, s - 4])
    scale = 1 / math.sqrt(d)
    w = torch.randn(b, s, h, d, generator=g)
    out = fn.apply(q, ck, cv, valid, scale)
    ref = dense_eagle3_attention(q, ck, cv, valid, scale, torch.float64)
    assert out.shape == (b, s, h, d) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert out[1, s - 4 :].abs().max() == 0  # the padded rows are zero
    grads = torch.autograd.grad((out * w).sum(), (q, ck, cv))
    refs = torch.autograd.grad((ref * w.double()).sum(), (q, ck, cv))
    for got, want in zip(grads, refs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grads[0][1, s - 4 :].abs().max() == 0


def _draft(backend: str, seed: int = 0):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    return LlamaForCausalLMEagle3(LlamaConfig(**LLAMA), attention_backend=backend)


def _step(backend: str, valid_length=None):
    draft = _draft(backend)
    run = eagle3_step(
        draft, length=24, ttt=3, vocab=LLAMA["vocab_size"], target_hidden=64, attention=backend,
        valid_length=valid_length,
    )  # fmt: skip
    loss = run()
    return loss, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("valid_length", [None, 17])
def test_specforges_fa_step_through_the_seam_is_its_sdpa_step(seam, monkeypatch, valid_length):
    want_loss, want = _step("sdpa", valid_length)
    monkeypatch.setenv(fk.FA_KERNEL_ENV, "1")
    assert fk.install_fa_kernel() and fk.installed()
    got_loss, got = _step("fa", valid_length)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys() and any(n.startswith("midlayer.self_attn.q_proj") for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_without_the_variable_nothing_is_replaced_and_uninstall_restores(seam, monkeypatch):
    from specforge.modeling.draft import llama3_eagle

    original = llama3_eagle._FlashCachedMergeFunc
    init = llama3_eagle.LlamaFlashAttention.__init__
    assert fk.install_fa_kernel() is False and not fk.installed()
    monkeypatch.setenv(fk.FA_KERNEL_ENV, "0")
    assert fk.install_fa_kernel() is False and llama3_eagle._FlashCachedMergeFunc is original
    assert fk.install_fa_kernel(force=True) and fk.install_fa_kernel(force=True)  # idempotent
    assert llama3_eagle._FlashCachedMergeFunc is not original
    fk.uninstall_fa_kernel()
    assert llama3_eagle._FlashCachedMergeFunc is original and llama3_eagle.LlamaFlashAttention.__init__ is init
    if llama3_eagle._std_flash_attn_varlen_func is None:  # no flash_attn here: SpecForge's backend refuses again
        with pytest.raises(RuntimeError, match="flash-attn"):
            _draft("fa")


def test_the_recipe_backend_fa_asks_the_trainer_for_the_seam():
    from specforge_kimi.plan.run_plan import load_recipe

    r = load_recipe("recipes/kimi-k25-8xb200-lowered.yaml")
    assert step_knobs.trainer_env(r.trainer).get(fk.FA_KERNEL_ENV) in (None, "0")
    fa = r.trainer.model_copy(update={"attention_backend": "fa"})
    assert step_knobs.trainer_env(fa)[fk.FA_KERNEL_ENV] == "1"


def test_the_backward_hands_the_kernel_its_forwards_strides_whatever_it_is_given():
    """cuDNN's cached backward graph reads the output and its gradient with the strides of the call that built it, so
    the seam hands them over in the forward's strides: the tensor itself when it has them, else a copy that does."""
    from specforge_kimi.drafts import eagle3_fa_kernel as fk

    b, s, h, d = 2, 5, 3, 4
    bshd = torch.randn(b, s, h, d)  # the forward's memory: [B, S, H, D]
    shape, stride = (b, h, s, d), tuple(bshd.transpose(1, 2).stride())
    same = fk._as_forward(bshd.transpose(1, 2), shape, stride)
    assert same.data_ptr() == bshd.data_ptr() and tuple(same.stride()) == stride
    other = bshd.transpose(1, 2).contiguous()  # the same values in [B, H, S, D] memory
    got = fk._as_forward(other, shape, stride)
    assert tuple(got.stride()) == stride and got.data_ptr() != other.data_ptr()
    torch.testing.assert_close(got, other)
    lse = torch.randn(b, h, s)
    got = fk._as_forward(lse, (b, h, s, 1), (h * s, s, 1, 1))
    assert got.shape == (b, h, s, 1) and got.data_ptr() == lse.data_ptr()
