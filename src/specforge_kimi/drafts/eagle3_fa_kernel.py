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
[B, S, H, D] -- on PyTorch's kernels: cuDNN's attention (``aten._scaled_dot_product_cudnn_attention`` with its
log-sum-exp, and its backward, which takes the output it differentiates against as an input: the merged one) on
CUDA, PyTorch's flash attention (the FlashAttention-2 kernels) where cuDNN refuses the shapes (once, with a warning),
its CPU flash kernel on the CPU. cuDNN's backward is handed the output, its gradient and the log-sum-exp in the
forward's own strides, always: PyTorch caches cuDNN's backward graph by the query's, key's and value's shapes and
strides only, and a graph built for one output layout reads another wrongly (bench/cudnn_merged_backward.py; the GPU
test tests/gpu/test_fa_kernel_gpu.py). The diagonal terms are merged with batched products over all blocks at once
(one score tensor [B, S, H_kv, groups, blocks - 1]) instead of a loop with an fp32 copy of the query per block; the
backward recomputes those scores. It lifts ``LlamaFlashAttention``'s ``flash_attn`` import check (the seam needs
no ``flash_attn``). Rows past the valid length are zero, as SpecForge's and flex's are; their log-sum-exp is the
merged one like every row's (finite: every row has its causal keys), not a placeholder (SpecForge's 0), so the
kernel's backward never exponentiates against one; their gradient is zeroed before it. A cuDNN backward that raises
falls back to the flash kernel (its forward recomputed for its state) as the forward does.

Without the variable (or with ``0``) nothing is replaced. :func:`uninstall_fa_kernel` puts SpecForge's back (tests).
"""

from __future__ import annotations

import os
import warnings

import specforge_kimi.environment as _env

FA_KERNEL_ENV = _env.EAGLE3_FA_KERNEL.name
_FLAG = "__specforge_kimi_fa_kernel__"
#: SpecForge's (``_FlashCachedMergeFunc``, ``LlamaFlashAttention.__init__``) while the seam is installed
_ORIGINAL: list = []
#: cuDNN's refusals (their messages): after the first one the flash kernel runs
_CUDNN_REFUSED: list = []


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(FA_KERNEL_ENV, "0") == "1"


def _fatal(torch) -> tuple:
    """Errors that are no refusal of cuDNN's: out of memory, a CUDA fault."""
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None)) if t)


def _refused(exc, shape) -> None:
    _CUDNN_REFUSED.append(str(exc))
    warnings.warn(f"fa-kernel: cuDNN attention refused {shape}; PyTorch's flash kernel instead: {exc}", stacklevel=3)


def _attention_forward(q, k, v, scale: float):
    """Causal attention of ``q`` [B, S, H, D] over ``k``/``v`` [B, S, H_kv, D] -> (output [B, S, H, D] in q's dtype,
    log-sum-exp [B, H, S] fp32, the backward's state: the kernel, its output's and log-sum-exp's shapes and strides,
    its other outputs)."""
    import torch

    aten = torch.ops.aten
    b, s, h, _ = q.shape
    if q.device.type != "cuda":  # PyTorch's CPU flash kernel takes the key/value heads as they are
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, scale=scale
        )
        return out.transpose(1, 2), lse.reshape(b, h, s), ("cpu", _layout(out, lse), ())
    qt, kt, vt = (t.transpose(1, 2) for t in (q, *_heads_of(q, k, v)))  # one layout for all three
    if not _CUDNN_REFUSED:
        try:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
                qt, kt, vt, None, True, 0.0, True, False, scale=scale
            )
            state = ("cudnn", _layout(out, lse), (cum_q, cum_k, max_q, max_k, seed, offset))
            return out.transpose(1, 2), lse.reshape(b, h, s), state
        except _fatal(torch):
            raise
        except RuntimeError as exc:  # cuDNN has no engine for these shapes, strides or this build
            _refused(exc, tuple(qt.shape))
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = aten._scaled_dot_product_flash_attention(
        qt, kt, vt, 0.0, True, False, scale=scale
    )
    return (
        out.transpose(1, 2),
        lse.reshape(b, h, s),
        ("flash", _layout(out, lse), (cum_q, cum_k, max_q, max_k, rng, unused)),
    )


def _layout(out, lse) -> tuple:
    """The kernel's output [B, H, S, D] and log-sum-exp: their shapes and strides, which the backward hands back."""
    return tuple(out.shape), tuple(out.stride()), tuple(lse.shape), tuple(lse.stride())


def _as_forward(t, shape, stride):
    """``t`` as the forward's ``shape`` and ``stride``: itself (a view) when it already has them, else a copy."""
    import torch

    view = t.reshape(shape)
    if tuple(view.stride()) == tuple(stride):
        return view
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(view)


def _heads_of(q, k, v):
    """``k``, ``v`` [B, S, H_kv, D] with each key/value head repeated for its query heads (GQA) -> [B, S, H, D]:
    the CUDA kernels take the query's head count."""
    h, h_kv = q.shape[2], k.shape[2]
    return (k, v) if h == h_kv else (k.repeat_interleave(h // h_kv, dim=2), v.repeat_interleave(h // h_kv, dim=2))


def _attention_backward(state, grad_out, q, k, v, out, lse, scale: float):
    """The gradients (q [B, S, H, D], k, v [B, S, H_kv, D]) of :func:`_attention_forward`'s call for ``grad_out``,
    taken against ``out`` [B, S, H, D] and ``lse`` [B, H, S] (the merged output and log-sum-exp).

    The output, its gradient and the log-sum-exp reach the kernel in the forward's own shapes and strides: PyTorch
    caches cuDNN's backward graph by the query's, key's and value's shapes and strides alone, so a later call whose
    output or gradient has other strides than the first call's would run a graph that reads them wrongly (measured:
    wrong gradients, bench/cudnn_merged_backward.py)."""
    import torch

    aten = torch.ops.aten
    kind, (o_shape, o_stride, lse_shape, lse_stride), extra = state
    lse_kernel = _as_forward(lse, lse_shape, lse_stride)
    o = _as_forward(out.transpose(1, 2), o_shape, o_stride)
    go = _as_forward(grad_out.transpose(1, 2), o_shape, o_stride)  # the gradient in the output's layout
    if kind == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o, lse_kernel, 0.0, True, scale=scale
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, *_heads_of(q, k, v)))
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    if kind == "cudnn":
        try:
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                go, qt, kt, vt, o, lse_kernel, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
            )
        except _fatal(torch):
            raise
        except RuntimeError as exc:
            _refused(exc, tuple(qt.shape))
            _, _, state = _attention_forward(q, k, v, scale)  # the flash kernel's own state for its backward
            return _attention_backward(state, grad_out, q, k, v, out, lse, scale)
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            go, qt, kt, vt, o, lse_kernel, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
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
            grad_out = torch.where(
                valid, grad_out.reshape(b, s, h, d), torch.zeros((), dtype=grad_out.dtype, device=q.device)
            )
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
    _CUDNN_REFUSED.clear()
