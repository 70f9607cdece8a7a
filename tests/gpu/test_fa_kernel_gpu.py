"""The fa-kernel seam on a GPU: what the CPU cannot show (tests/unit/test_fa_kernel.py has the rest).

On CUDA the seam's function runs cuDNN's attention kernel with its log-sum-exp (PyTorch's flash kernel where cuDNN
refuses), and that kernel's backward with the merged output and log-sum-exp. Here, in bf16 at the K2.5
draft's head shapes (56 query / 8 key-value heads of 128) over 1,024 positions with two samples, one right-padded:
the output and the gradients of the query and of every key and value block against dense attention in fp32 over
every block with the EAGLE-3 mask, and against SpecForge's own flex-attention path with its ``generate_eagle3_mask``
(the recipes' default backend), at 1 and 4 key blocks. The differences are recorded in ``fa_kernel_gpu.json``
under ``$SPECFORGE_KIMI_GPU_OUT`` (or a tmp dir). Expected wall time: well under a minute (flex compiles).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from eagle3_cpu import dense_eagle3_attention

pytestmark = pytest.mark.gpu

B, S, H, H_KV, D = 2, 1024, 56, 8, 128
PAD = 100  # the second sample's padding


@pytest.fixture
def out(tmp_path) -> Path:
    d = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


def _flex(q, ck, cv, valid, scale):
    """SpecForge's flex path for the same attention: its mask, keys of all blocks concatenated (its KV cache)."""
    from specforge.modeling.draft.flex_attention import generate_eagle3_mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, s, h, d = q.shape
    n = ck.shape[1]
    k = ck.permute(0, 3, 1, 2, 4).reshape(b, H_KV, n * s, d)
    v = cv.permute(0, 3, 1, 2, 4).reshape(b, H_KV, n * s, d)
    mask = create_block_mask(
        generate_eagle3_mask(seq_lengths=valid, Q_LEN=s, KV_LEN=n * s, lck=n - 1), B=b, H=1, Q_LEN=s,
        KV_LEN=n * s, device=q.device,
    )  # fmt: skip
    o = torch.compile(flex_attention)(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=True, scale=scale)
    return o.transpose(1, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("blocks", [1, 4])
def test_the_cuda_kernels_give_dense_and_flex_eagle3_attention(out, blocks):
    from specforge_kimi.drafts import eagle3_fa_kernel as fk

    fk.install_fa_kernel(force=True)
    try:
        fn = fk._make_function()
        g = torch.Generator(device="cuda").manual_seed(blocks)
        kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
        q = torch.randn(B, S, H, D, **kw).requires_grad_()
        ck = torch.randn(B, blocks, S, H_KV, D, **kw).requires_grad_()
        cv = torch.randn(B, blocks, S, H_KV, D, **kw).requires_grad_()
        valid = torch.tensor([S, S - PAD], device="cuda")
        scale = 1 / math.sqrt(D)
        w = torch.randn(B, S, H, D, device="cuda", generator=g)
        got = fn.apply(q, ck, cv, valid, scale)
        grads = torch.autograd.grad((got.float() * w).sum(), (q, ck, cv))
        ref = dense_eagle3_attention(q, ck, cv, valid, scale, torch.float32)
        refs = torch.autograd.grad((ref * w).sum(), (q, ck, cv))
        flex = _flex(q, ck, cv, valid, scale)
        flex_grads = torch.autograd.grad((flex.float() * w).sum(), (q, ck, cv))
        path = out / "fa_kernel_gpu.json"
        rec = json.loads(path.read_text()) if path.is_file() else {}
        rec[f"blocks_{blocks}"] = {
            "kernel": "flash (cuDNN refused)" if fk._CUDNN_REFUSED else "cudnn",
            "cudnn_refused": list(fk._CUDNN_REFUSED),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "out_max_abs_vs_dense": float((got.float() - ref).abs().max()),
            "out_max_abs_vs_flex": float((got.float() - flex.float()).abs().max()),
            "grad_max_abs_vs_dense": [
                float((a.float() - b.float()).abs().max()) for a, b in zip(grads, refs, strict=True)
            ],
            "grad_max_abs_vs_flex": [
                float((a.float() - b.float()).abs().max()) for a, b in zip(grads, flex_grads, strict=True)
            ],
        }
        path.write_text(json.dumps(rec, indent=2))
        assert not fk._CUDNN_REFUSED, fk._CUDNN_REFUSED
        assert got[1, S - PAD :].abs().max() == 0
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), flex.float(), rtol=2e-2, atol=2e-2)
        for a, b, c in zip(grads, refs, flex_grads, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
            torch.testing.assert_close(a.float(), c.float(), rtol=5e-2, atol=5e-2)
    finally:
        fk.uninstall_fa_kernel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_backward_is_right_whatever_layout_the_merged_output_comes_in():
    """PyTorch caches cuDNN's backward graph by q/k/v shapes and strides only: the seam's backward, handed the same
    merged output once contiguous in [B, S, H, D] and once in [B, H, S, D] memory (after a call that built the graph
    with the first), gives the flash kernel's gradients both times."""
    from specforge_kimi.drafts import eagle3_fa_kernel as fk

    g = torch.Generator(device="cuda").manual_seed(7)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    q = torch.randn(B, S, H, D, **kw)
    k, v = (torch.randn(B, S, H_KV, D, **kw) for _ in range(2))
    go = torch.randn(B, S, H, D, **kw)
    scale = 1 / math.sqrt(D)
    out0, lse0, state = fk._attention_forward(q, k, v, scale)
    assert state[0] == "cudnn", fk._CUDNN_REFUSED
    extra = torch.randn(B, H, S, device="cuda", generator=g)  # a merge: a larger log-sum-exp, another output
    lse = torch.logaddexp(lse0, extra)
    out = (out0.float() * torch.exp(lse0 - lse).transpose(1, 2).unsqueeze(-1)).to(q.dtype)
    flash = fk._attention_backward(_flash_state(q, k, v, scale), go, q, k, v, out, lse, scale)
    for layout in (out.contiguous(), out.transpose(1, 2).contiguous().transpose(1, 2)):
        got = fk._attention_backward(state, go, q, k, v, layout, lse, scale)
        for a, b in zip(got, flash, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def _flash_state(q, k, v, scale):
    """The flash kernel's backward state for the same call (the seam's fallback path)."""
    from specforge_kimi.drafts import eagle3_fa_kernel as fk

    fk._CUDNN_REFUSED.append("test: the flash kernel's state")
    try:
        return fk._attention_forward(q, k, v, scale)[2]
    finally:
        fk._CUDNN_REFUSED.clear()
