"""bench/cudnn_merged_backward.py on the CPU: its fp32 reference is the true gradient of a merged partial
attention, and without CUDA the script refuses in one line (the kernels run on a GPU only)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("cudnn_merged_backward", ROOT / "bench/cudnn_merged_backward.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _dense_merged(q, k, v, kd, vd, scale):
    """Causal attention over k/v plus one diagonal key per row (kd/vd), dense, fp64."""
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    sd = (q * kd).sum(-1, keepdim=True) * scale
    p = torch.softmax(torch.cat((scores, sd), dim=-1), dim=-1)
    return p[..., :s] @ v + p[..., s:] * vd


@pytest.mark.parametrize("seed", [0, 1])
def test_the_reference_is_the_merged_attentions_gradient_of_the_block(seed):
    bench = _bench()
    g = torch.Generator().manual_seed(seed)
    b, h, s, d = 2, 3, 17, 8
    scale = 1 / math.sqrt(d)
    q, k, v, kd, vd, w = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(6))
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = _dense_merged(q, k, v, kd, vd, scale)
    dq, dk, dv = torch.autograd.grad((out * w).sum(), (q, k, v))
    with torch.no_grad():  # the block's own output and log-sum-exp, merged with the diagonal key
        scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -1e30)
        lse0 = torch.logsumexp(scores, -1)
        o0 = torch.softmax(scores, -1) @ v
        sd = (q * kd).sum(-1) * scale
        o, lse = bench.merge(o0, lse0, vd, sd)
        rq, rk, rv = bench.reference_backward(q, k, v, o, lse, w, scale)
        # the diagonal key's share of dq, which the block's backward does not hold
        wd = torch.exp(sd - lse).unsqueeze(-1)
        dq_diag = wd * ((w * vd).sum(-1, keepdim=True) - (w * o).sum(-1, keepdim=True)) * kd * scale
    torch.testing.assert_close(rk.double(), dk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rv.double(), dv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rq.double() + dq_diag, dq, rtol=1e-5, atol=1e-5)
    # the unmerged pair is not the same backward: the reference depends on what it is handed
    uq, _, _ = bench.reference_backward(q, k, v, o0, lse0, w, scale)
    assert (uq.double() - rq.double()).abs().max() > 1e-3


def test_without_cuda_it_refuses_in_one_line(tmp_path, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA"):
        bench.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_the_grouped_reference_sums_each_key_value_heads_query_heads():
    """With fewer key/value heads than query heads the reference is causal attention's own gradient (autograd, fp64)
    with each key/value head shared by its query heads."""
    bench = _bench()
    g = torch.Generator().manual_seed(3)
    b, h, h_kv, s, d = 1, 6, 2, 9, 4
    scale = 1 / math.sqrt(d)
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    scores = ((q @ kr.transpose(-1, -2)) * scale).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -1e30)
    out = torch.softmax(scores, -1) @ vr
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    with torch.no_grad():
        lse = torch.logsumexp(scores, -1)
        got = bench._grouped_reference(q, k, v, out, lse, w, scale)
    for a, r in zip(got, grads, strict=True):
        assert a.shape == r.shape
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5)
