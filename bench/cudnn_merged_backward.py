"""Which of PyTorch's attention backwards give the right gradients of a *partial* attention whose output was merged.

Scope: the backward the ``fa-kernel`` seam needs (src/specforge_kimi/drafts/eagle3_fa_kernel.py). A causal kernel
over the first key block returns its output ``o0`` and log-sum-exp ``lse0``; the seam merges the diagonal keys of
the later blocks into them by log-sum-exp (``o``, ``lse``) and hands the kernel's backward the *merged* pair, which
for the block's own keys is exact: ``P = exp(S - lse)``, ``D = rowsum(dO * o)``, ``dS = P (dO V^T - D)``. On an H100
(torch 2.11) cuDNN's backward got the query/key gradients wrong that way and the flash kernel's right; this script
says which kernel, layout and call order does what, in one JSON, against that formula in fp32
(:func:`reference_backward`).

Cases (each a kernel's backward against :func:`reference_backward` for the same inputs):

  flash_merged          PyTorch's flash backward, merged pair (the seam as shipped)
  cudnn_own             cuDNN's backward with its own forward's pair (no merge: the sanity row)
  cudnn_merged          cuDNN's backward, merged pair, the output in its forward's layout (the seam's call on cuDNN)
  cudnn_merged_bhsd     the same with the merged output and its gradient contiguous in [B, H, S, D]
  cudnn_merged_first    a shape whose first cuDNN backward in the process is a merged one (no graph cached from an
                        unmerged call: PyTorch caches cuDNN's backward graph by q/k/v shapes and strides only)
  flash_after_cudnn     cuDNN's forward, the flash kernel's backward on its merged pair (the forward's speed only)
  cudnn_merged_gqa      cuDNN with 4 query heads per key/value head handed as they are (no repeat; or its refusal)

and, with ``--time``, the forward and backward of each kernel at the K2.5 draft's heads (56 of 128, key/value heads
repeated as the seam does; cuDNN also with 8 key/value heads as they are) for ``--lengths`` (CUDA events, median of
``--iters``), informational.

    python bench/cudnn_merged_backward.py --out bench/results/cudnn_merged_backward_<gpu>.json --time

Needs CUDA (torch's own kernels only: no SpecForge, no bundle); a CPU-only process exits with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path


def reference_backward(q, k, v, o, lse, grad_out, scale: float):
    """fp32 gradients (dq, dk, dv) of causal attention of ``q`` over ``k``/``v`` (all [B, H, S, D]) taken against the
    row output ``o`` [B, H, S, D] and log-sum-exp ``lse`` [B, H, S] (merged or not): the split-softmax backward."""
    import torch

    qf, kf, vf, of, do = (t.float() for t in (q, k, v, o, grad_out))
    s = q.shape[2]
    scores = (qf @ kf.transpose(-1, -2)) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    p = torch.exp(scores - lse.float().reshape(*lse.shape[:3], 1)).masked_fill(~causal, 0.0)
    delta = (do * of).sum(-1, keepdim=True)
    ds = p * (do @ vf.transpose(-1, -2) - delta)
    return (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale, p.transpose(-1, -2) @ do


def merge(o0, lse0, vd, sd):
    """``o0`` [B, H, S, D], ``lse0`` [B, H, S] merged with one extra key per row (score ``sd`` [B, H, S], value
    ``vd`` [B, H, S, D]) by log-sum-exp -> (output in o0's dtype, fp32 log-sum-exp)."""
    import torch

    lse = torch.logaddexp(lse0.float(), sd.float())
    w0, wd = torch.exp(lse0.float() - lse).unsqueeze(-1), torch.exp(sd.float() - lse).unsqueeze(-1)
    return (w0 * o0.float() + wd * vd.float()).to(o0.dtype), lse


def _flash_fwd(q, k, v, scale):
    import torch

    out, lse, cq, ck, mq, mk, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, rng, unused)


def _flash_bwd(go, q, k, v, o, lse, state, scale):
    import torch

    cq, ck, mq, mk, rng, unused = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        go, q, k, v, o, lse.reshape(q.shape[:3]).contiguous(), cq, ck, mq, mk, 0.0, True, rng, unused, scale=scale
    )


def _cudnn_fwd(q, k, v, scale):
    import torch

    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _cudnn_bwd(go, q, k, v, o, lse, state, scale, lse_shape):
    import torch

    cq, ck, mq, mk, seed, offset = state
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        go, q, k, v, o, lse.reshape(lse_shape).contiguous(), seed, offset, None, cq, ck, mq, mk, 0.0, True,
        scale=scale,
    )  # fmt: skip


def _inputs(b, h, s, d, seed, h_kv: int | None = None):
    """q, k, v in the [B, H, S, D] view of [B, S, H, D] memory (the seam's layout; k and v with ``h_kv`` heads when
    given: grouped-query attention), the diagonal key/value, the loss weight (dO) in the same layout."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    heads = (h, h_kv or h, h_kv or h, h, h, h)
    q, k, v, kd, vd, go = (torch.randn(b, s, n, d, **kw).transpose(1, 2) for n in heads)
    return q, k, v, kd, vd, go


def _grouped_reference(q, k, v, o, lse, go, scale):
    """:func:`reference_backward` with k/v heads repeated for their query heads, their gradients summed back."""
    h, h_kv = q.shape[1], k.shape[1]
    if h == h_kv:
        return reference_backward(q, k, v, o, lse, go, scale)
    g = h // h_kv
    dq, dk, dv = reference_backward(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), o, lse, go, scale)
    b, _, s, d = dk.shape
    return dq, dk.reshape(b, h_kv, g, s, d).sum(2), dv.reshape(b, h_kv, g, s, d).sum(2)


def _errors(got, ref) -> dict:
    names = ("dq", "dk", "dv")
    return {f"{n}_max_abs": float((a.float() - r).abs().max()) for n, a, r in zip(names, got, ref, strict=True)} | {
        "ref_max_abs": max(float(r.abs().max()) for r in ref)
    }


def _case(kind: str, *, b, h, s, d, seed, scale, layout: str = "kernel", h_kv: int | None = None) -> dict:
    """One row: ``kind`` is flash | cudnn | cudnn_fwd_flash_bwd; ``layout`` kernel (the merged output in the
    forward's layout) | bhsd (contiguous [B, H, S, D]) | own (no merge); ``h_kv``: key/value heads handed to the
    kernel as they are (grouped-query attention; a kernel that refuses them is a row with its error)."""
    import torch

    q, k, v, kd, vd, go = _inputs(b, h, s, d, seed, h_kv)
    fwd = _flash_fwd if kind == "flash" else _cudnn_fwd
    head = {"kernel": kind, "layout": layout, "shape_bhsd": [b, h, s, d], "kv_heads": h_kv or h}
    try:
        o0, lse0, state = fwd(q, k, v, scale)
    except RuntimeError as exc:  # no engine for these shapes (e.g. grouped key/value heads)
        return {**head, "refused": str(exc).strip().splitlines()[0][:300]}
    lse_shape = tuple(lse0.shape)
    lse0 = lse0.reshape(b, h, s)
    if layout == "own":
        o, lse = o0, lse0
    else:
        sd = (q.float() * kd.float()).sum(-1) * scale
        o, lse = merge(o0, lse0, vd, sd)
        if layout == "bhsd":
            o, go = o.contiguous(), go.contiguous()
        else:
            o = torch.empty_like(o0).copy_(o)  # the forward's strides
    if kind == "cudnn":
        try:
            got = _cudnn_bwd(go, q, k, v, o, lse, state, scale, lse_shape)
        except RuntimeError as exc:
            return {**head, "refused": "backward: " + str(exc).strip().splitlines()[0][:300]}
    else:
        if kind == "cudnn_fwd_flash_bwd":  # the flash backward wants its own (empty) rng state; dropout is 0
            _, _, flash_state = _flash_fwd(q[:, :, :1], k[:, :, :1], v[:, :, :1], scale)
            cq, ck, _, _, rng, unused = flash_state
            state = (cq, ck, s, s, rng, unused)
        got = _flash_bwd(go, q, k, v, o, lse, state, scale)
    ref = _grouped_reference(q, k, v, o, lse, go, scale)
    return {
        **head,
        "o_strides": list(o.stride()),
        "grad_out_strides": list(go.stride()),
        **_errors(got, ref),
    }


def _time(fn, iters: int) -> float:
    import torch

    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[2:])
    return times[len(times) // 2]


def _timing_row(s: int, iters: int, h: int, d: int) -> dict:
    scale = 1 / math.sqrt(d)
    q, k, v, _, _, go = _inputs(1, h, s, d, 0)
    fo, flse, fstate = _flash_fwd(q, k, v, scale)
    co, clse, cstate = _cudnn_fwd(q, k, v, scale)
    lse_shape = tuple(clse.shape)
    return {
        "length": s,
        "heads": h,
        "flash_fwd_ms": _time(lambda: _flash_fwd(q, k, v, scale), iters),
        "flash_bwd_ms": _time(lambda: _flash_bwd(go, q, k, v, fo, flse, fstate, scale), iters),
        "cudnn_fwd_ms": _time(lambda: _cudnn_fwd(q, k, v, scale), iters),
        "cudnn_bwd_ms": _time(lambda: _cudnn_bwd(go, q, k, v, co, clse, cstate, scale, lse_shape), iters),
        **_gqa_times(s, iters, h, d, scale),
    }


def _gqa_times(s: int, iters: int, h: int, d: int, scale: float, h_kv: int = 8) -> dict:
    """cuDNN's forward and backward with ``h_kv`` key/value heads handed as they are (no repeat), or why not."""
    q, k, v, _, _, go = _inputs(1, h, s, d, 0, h_kv)
    try:
        co, clse, cstate = _cudnn_fwd(q, k, v, scale)
        lse_shape = tuple(clse.shape)
        return {
            "kv_heads": h_kv,
            "cudnn_gqa_fwd_ms": _time(lambda: _cudnn_fwd(q, k, v, scale), iters),
            "cudnn_gqa_bwd_ms": _time(lambda: _cudnn_bwd(go, q, k, v, co, clse, cstate, scale, lse_shape), iters),
        }
    except RuntimeError as exc:
        return {"kv_heads": h_kv, "cudnn_gqa_refused": str(exc).strip().splitlines()[0][:300]}


def timing(lengths: list[int], iters: int, h: int = 56, d: int = 128) -> list[dict]:
    """Forward and backward milliseconds of each kernel at batch 1 for each length (median of ``iters``)."""
    return [_timing_row(s, iters, h, d) for s in lengths]


def run(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cudnn_merged_backward: needs CUDA (PyTorch's flash and cuDNN attention kernels)")
    b, h, s, d = 2, 8, 1024, 128
    scale = 1 / math.sqrt(d)
    kw = {"h": h, "d": d, "scale": scale}
    cases = [  # order matters: cuDNN's backward graph is cached by q/k/v shapes and strides
        _case("cudnn", b=b, s=s + 128, seed=1, layout="kernel", **kw) | {"case": "cudnn_merged_first"},
        _case("flash", b=b, s=s, seed=2, layout="kernel", **kw) | {"case": "flash_merged"},
        _case("cudnn", b=b, s=s, seed=3, layout="own", **kw) | {"case": "cudnn_own"},
        _case("cudnn", b=b, s=s, seed=4, layout="kernel", **kw) | {"case": "cudnn_merged"},
        _case("cudnn", b=b, s=s, seed=5, layout="bhsd", **kw) | {"case": "cudnn_merged_bhsd"},
        _case("cudnn_fwd_flash_bwd", b=b, s=s, seed=6, layout="kernel", **kw) | {"case": "flash_after_cudnn"},
        _case("cudnn", b=b, s=s, seed=7, layout="kernel", **{**kw, "h": 4 * h}, h_kv=h) | {"case": "cudnn_merged_gqa"},
    ]
    tol = args.tolerance
    for c in cases:
        c["right"] = (
            None
            if "refused" in c
            else all(c[f"{n}_max_abs"] <= tol * max(1.0, c["ref_max_abs"]) for n in ("dq", "dk", "dv"))
        )
    return {
        "bench": "cudnn_merged_backward",
        "command": [sys.executable, *sys.argv],
        "environment": {
            "host": platform.node(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name(),
        },
        "tolerance": tol,
        "tolerance_is": "a case is right when every gradient's max abs error vs the fp32 formula is within "
        "tolerance x max(1, the largest reference gradient)",
        "cases": cases,
        "timing": timing(args.lengths, args.iters) if args.time else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--time", action="store_true", help="also time each kernel's forward and backward")
    p.add_argument("--lengths", type=lambda x: [int(v) for v in x.split(",")], default=[4096, 16384])
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    for c in res["cases"]:
        verdict = c.get("refused") or ("right" if c["right"] else "WRONG")
        print(c["case"], verdict, {k: round(v, 4) for k, v in c.items() if "max_abs" in k})
    for t in res["timing"] or []:
        print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
