"""The ``fa-kernel`` seam: SpecForge's ``fa`` EAGLE-3 attention on PyTorch's own attention kernels.

Scope: ``LlamaFlashAttention`` of SpecForge 0.2.0 (``specforge.modeling.draft.llama3_eagle``; recipe
``trainer.attention_backend: fa``). At TTT position ``i`` a query at position ``q`` attends causally to the first
key block (keys ``<= q``) and to one key of each of the ``i`` later blocks, the key at its own position (the
earlier TTT positions' keys), all within the sample's valid length minus ``i``; rows past it are zero. SpecForge
computes that as one causal flash-attention call over the first block that also returns its log-sum-exp, then
merges the ``i`` diagonal scores into it by log-sum-exp in fp32 (``_FlashCachedMergeFunc``, an autograd function
whose backward calls flash attention's backward with the merged output and log-sum-exp), through the
``flash_attn`` package; without it the backend refuses to build. The flex-attention backend computes the same
values with one flex kernel over all ``i + 1`` blocks (its Triton backward is the step's costliest attention kernel
at long samples: bench/REPORT.md's step profiles).

With ``SPECFORGE_KIMI_EAGLE3_FA_KERNEL=1`` in the process (set by ``training.step_knobs`` when the recipe's
``trainer.attention_backend`` is ``fa``), :func:`install_fa_kernel` replaces ``_FlashCachedMergeFunc`` in that
module (``LlamaFlashAttention.forward`` looks it up at each call) by :class:`TorchFlashCachedMerge`, the same
contract -- (query [B, S, H, D], cache keys and values [B, blocks, S, H_kv, D], valid lengths [B], scale) -> output
[B, S, H, D] -- on PyTorch's kernels: its flash attention (``aten._scaled_dot_product_flash_attention``, the
FlashAttention-2 kernels, with their log-sum-exp, and their backward, which takes the output it differentiates
against as an input: the merged one) on CUDA, its CPU flash kernel on the CPU. cuDNN's attention
(``_scaled_dot_product_cudnn_attention``) is not used: given the merged output and log-sum-exp, its backward returned
wrong query and key gradients once two or more key blocks were merged (value gradients right) on an H100 with
torch 2.11 (tests/gpu/test_fa_kernel_gpu.py; archive/gpu-runs/RUNS.md). The diagonal terms are merged with batched
products over all blocks at once (one score tensor [B, S, H_kv, groups, blocks - 1]) instead of a loop with an fp32 copy of the
query per block; the backward recomputes those scores. It lifts ``LlamaFlashAttention``'s ``flash_attn`` import
check (the seam needs no ``flash_attn``). Rows past the valid length are zero, as SpecForge's and flex's are;
their log-sum-exp is the merged one like every row's (finite: every row has its causal keys), not a placeholder
(SpecForge's 0), so the kernel's backward never exponentiates against one; their gradient is zeroed before it.

Without the variable (or with ``0``) nothing is replaced. :func:`uninstall_fa_kernel` puts SpecForge's back (tests).
"""

from __future__ import annotations

import os

import specforge_kimi.environment as _env

FA_KERNEL_ENV = _env.EAGLE3_FA_KERNEL.name
_FLAG = "__specforge_kimi_fa_kernel__"
#: SpecForge's (``_FlashCachedMergeFunc``, ``LlamaFlashAttention.__init__``) while the seam is installed
_ORIGINAL: list = []


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(FA_KERNEL_ENV, "0") == "1"


def _attention_forward(q, k, v, scale: float):
    """Causal attention of ``q`` [B, S, H, D] over ``k``/``v`` [B, S, H_kv, D] -> (output [B, S, H, D] in q's dtype,
    log-sum-exp [B, H, S] fp32, the backward's state: the kernel, its log-sum-exp's shape, its other outputs)."""
    import torch

    aten = torch.ops.aten
    b, s, h, _ = q.shape
    if q.device.type != "cuda":  # PyTorch's CPU flash kernel takes the key/value heads as they are
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, scale=scale
        )
        return out.transpose(1, 2), lse.reshape(b, h, s), ("cpu", tuple(lse.shape), ())
    qt, kt, vt = (t.transpose(1, 2) for t in (q, *_heads_of(q, k, v)))  # one layout for all three
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = aten._scaled_dot_product_flash_attention(
        qt, kt, vt, 0.0, True, False, scale=scale
    )
    return (
        out.transpose(1, 2),
        lse.reshape(b, h, s),
        ("flash", tuple(lse.shape), (cum_q, cum_k, max_q, max_k, rng, unused)),
    )


def _heads_of(q, k, v):
    """``k``, ``v`` [B, S, H_kv, D] with each key/value head repeated for its query heads (GQA) -> [B, S, H, D]:
    the CUDA kernels take the query's head count."""
    h, h_kv = q.shape[2], k.shape[2]
    return (k, v) if h == h_kv else (k.repeat_interleave(h // h_kv, dim=2), v.repeat_interleave(h // h_kv, dim=2))


def _attention_backward(state, grad_out, q, k, v, out, lse, scale: float):
    """The gradients (q [B, S, H, D], k, v [B, S, H_kv, D]) of :func:`_attention_forward`'s call for ``grad_out``,
    taken against ``out`` [B, S, H, D] and ``lse`` [B, H, S] (the merged output and log-sum-exp)."""
    import torch

    aten = torch.ops.aten
    kind, lse_shape, extra = state
    lse_kernel = lse.reshape(lse_shape).contiguous()
    go, o = grad_out.transpose(1, 2), out.transpose(1, 2)
    if kind == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o, lse_kernel, 0.0, True, scale=scale
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, *_heads_of(q, k, v)))
    cum_q, cum_k, max_q, max_k, rng, unused = extra
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        go, qt, kt, vt, o, lse_kernel, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale
    )
    dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    h, h_kv = q.shape[2], k.shape[2]
    if h_kv != h:  # the repeated heads' gradients summed back onto their key/value head
        b, s, _, d = dk.shape
        dk, dv = (t.reshape(b, s, h_kv, h // h_kv, d).sum(dim=3) for t in (dk, dv))
    return dq, dk, dv


def _valid_rows(valid_lengths, bsz: int, q_len: int, device):
    """[B, S, 1, 1] bool: the rows below each sample's valid length."""
    import torch

    lengths = valid_lengths.to(device=device, dtype=torch.long).clamp(0, q_len)
    return (torch.arange(q_len, device=device).unsqueeze(0) < lengths.unsqueeze(1)).view(bsz, q_len, 1, 1)


def _diagonal_scores(q, cache_k, scale: float):
    """[B, S, H_kv, G, blocks - 1] fp32: each query's score against its own position's key in blocks 1.."""
    import torch

    b, s, h, d = q.shape
    h_kv = cache_k.shape[3]
    qf = q.float().reshape(b, s, h_kv, h // h_kv, d)
    return torch.einsum("bshgd,bnshd->bshgn", qf, cache_k[:, 1:].float()) * scale, qf


def _make_function():
    import torch

    class TorchFlashCachedMerge(torch.autograd.Function):
        """SpecForge's ``_FlashCachedMergeFunc`` contract on PyTorch's attention kernels (module docstring)."""

        @staticmethod
        def forward(ctx, q, cache_k, cache_v, valid_lengths, softmax_scale: float):
            b, s, h, d = q.shape
            blocks, h_kv = cache_k.shape[1], cache_k.shape[3]
            g = h // h_kv
            out0, lse0, state = _attention_forward(q, cache_k[:, 0], cache_v[:, 0], softmax_scale)
            lse0 = lse0.reshape(b, h_kv, g, s).permute(0, 3, 1, 2)  # [B, S, H_kv, G]
            valid = _valid_rows(valid_lengths, b, s, q.device)
            if blocks == 1:
                out, lse = out0, lse0
            else:
                scores, _ = _diagonal_scores(q, cache_k, softmax_scale)
                lse = torch.logsumexp(torch.cat((lse0.unsqueeze(-1), scores), dim=-1), dim=-1)
                w0 = torch.exp(lse0 - lse).unsqueeze(-1)
                wd = torch.exp(scores - lse.unsqueeze(-1))
                merged = w0 * out0.float().reshape(b, s, h_kv, g, d) + torch.einsum(
                    "bshgn,bnshd->bshgd", wd, cache_v[:, 1:].float()
                )
                out = merged.reshape(b, s, h, d).to(q.dtype)
            out = torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))
            ctx.save_for_backward(q, cache_k, cache_v, out, lse, valid)
            ctx.state, ctx.softmax_scale = state, softmax_scale
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, cache_k, cache_v, out, lse, valid = ctx.saved_tensors
            scale = ctx.softmax_scale
            b, s, h, d = q.shape
            blocks, h_kv = cache_k.shape[1], cache_k.shape[3]
            g = h // h_kv
            grad_out = torch.where(  # contiguous, in the output's layout
                valid, grad_out.reshape(b, s, h, d), torch.zeros((), dtype=grad_out.dtype, device=q.device)
            ).contiguous()
            lse_kernel = lse.permute(0, 2, 3, 1).reshape(b, h, s)
            dq, dk0, dv0 = _attention_backward(
                ctx.state, grad_out, q, cache_k[:, 0], cache_v[:, 0], out, lse_kernel, scale
            )
            dk = torch.empty_like(cache_k)
            dv = torch.empty_like(cache_v)
            dk[:, 0] = dk0
            dv[:, 0] = dv0
            if blocks > 1:
                scores, qf = _diagonal_scores(q, cache_k, scale)
                vd = cache_v[:, 1:].float()
                wd = torch.exp(scores - lse.unsqueeze(-1))  # [B, S, H_kv, G, blocks - 1]
                go = grad_out.float().reshape(b, s, h_kv, g, d)
                delta = (go * out.float().reshape(b, s, h_kv, g, d)).sum(-1, keepdim=True)
                ds = wd * (torch.einsum("bshgd,bnshd->bshgn", go, vd) - delta) * scale
                dq = dq.float() + torch.einsum("bshgn,bnshd->bshgd", ds, cache_k[:, 1:].float()).reshape(b, s, h, d)
                dq = dq.to(q.dtype)
                dk[:, 1:] = torch.einsum("bshgn,bshgd->bnshd", ds, qf).to(dk.dtype)
                dv[:, 1:] = torch.einsum("bshgn,bshgd->bnshd", wd, go).to(dv.dtype)
            return dq, dk, dv, None, None

    setattr(TorchFlashCachedMerge, _FLAG, True)
    return TorchFlashCachedMerge


def installed() -> bool:
    """Whether SpecForge's ``LlamaFlashAttention`` runs the seam's function."""
    from specforge.modeling.draft import llama3_eagle

    return bool(getattr(llama3_eagle._FlashCachedMergeFunc, _FLAG, False))


def install_fa_kernel(*, force: bool = False) -> bool:
    """Install the seam when the process asked for it (:func:`requested`) or ``force``; True when installed.
    Idempotent."""
    if not (force or requested()):
        return False
    from specforge.modeling.draft import llama3_eagle

    if installed():
        return True
    cls = llama3_eagle.LlamaFlashAttention
    _ORIGINAL[:] = [llama3_eagle._FlashCachedMergeFunc, cls.__dict__["__init__"]]

    def __init__(self, config):  # SpecForge's, without the flash_attn check: the seam's kernels are PyTorch's
        llama3_eagle.LlamaAttention.__init__(self, config)

    cls.__init__ = __init__
    llama3_eagle._FlashCachedMergeFunc = _make_function()
    return True


def uninstall_fa_kernel() -> None:
    """SpecForge's function and constructor back (a no-op when the seam is not installed)."""
    if not _ORIGINAL:
        return
    from specforge.modeling.draft import llama3_eagle

    func, init = _ORIGINAL
    llama3_eagle._FlashCachedMergeFunc = func
    llama3_eagle.LlamaFlashAttention.__init__ = init
    _ORIGINAL.clear()
