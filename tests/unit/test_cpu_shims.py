"""The CPU shims: the pure-torch EAGLE-3 loss against the reference formula, and patching."""

from __future__ import annotations

import importlib

import pytest
import torch

from specforge_kimi.training import cpu_shims
from specforge_kimi.training.cpu_shims import TorchLogSoftmaxLoss

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="install_cpu_shims is a no-op with CUDA")


def reference_loss(logits, target_p, position_mask):
    """The formula SpecForge's Triton kernel computes (and its own ``_compute_loss``)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    return -torch.sum(position_mask * target_p * log_probs, -1).mean()


def random_inputs(seed: int, *, B=2, T=7, V=33, dtype=torch.float64, mask_dims=3):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
    target_p = torch.softmax(2 * torch.randn(B, T, V, generator=g), dim=-1).to(dtype)
    mask = (torch.rand(B, T, 1, generator=g) > 0.3).long()
    mask[0, 0, 0] = 1
    mask[0, 1, 0] = 0
    if mask_dims == 2:
        mask = mask.squeeze(-1)
    return logits, target_p, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mask_dims", [3, 2])
def test_loss_value_and_gradient_match_reference_float64(seed, mask_dims):
    logits, target_p, mask = random_inputs(seed, mask_dims=mask_dims)
    ref_mask = mask if mask.dim() == 3 else mask.unsqueeze(-1)

    ours_in = logits.clone().requires_grad_(True)
    ours = TorchLogSoftmaxLoss.apply(ours_in, target_p, mask)
    ours.backward()

    ref_in = logits.clone().requires_grad_(True)
    ref = reference_loss(ref_in, target_p, ref_mask.to(torch.float64))
    ref.backward()

    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-12)
    # masked rows get exactly zero gradient, like the Triton backward
    assert torch.all(ours_in.grad[0, 1] == 0)


def test_loss_gradient_with_unnormalized_target_and_upstream_scale():
    # The Triton backward uses sum(target); check that term against autograd of the formula.
    logits, target_p, mask = random_inputs(3)
    target_p = target_p * 1.7
    ours_in = logits.clone().requires_grad_(True)
    (2.5 * TorchLogSoftmaxLoss.apply(ours_in, target_p, mask)).backward()
    ref_in = logits.clone().requires_grad_(True)
    (2.5 * reference_loss(ref_in, target_p, mask.to(torch.float64))).backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-12)


def test_loss_passes_gradcheck():
    logits, target_p, mask = random_inputs(4, B=1, T=3, V=5)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: TorchLogSoftmaxLoss.apply(x, target_p, mask), (logits,))


def test_loss_matches_specforge_reference_and_keeps_bf16_grad_dtype():
    loss_module = importlib.import_module("specforge.core.loss")
    compiled = cpu_shims.ORIGINALS.get(("specforge.core.loss", "_compute_loss"))
    compiled = compiled or loss_module._compute_loss
    specforge_reference = getattr(compiled, "_torchdynamo_orig_callable", compiled)

    logits, target_p, mask = random_inputs(5, dtype=torch.float32)
    logits = logits.to(torch.bfloat16).requires_grad_(True)
    ours = TorchLogSoftmaxLoss.apply(logits, target_p, mask)
    theirs = specforge_reference(logits.detach(), target_p, mask)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ours.backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.isfinite(logits.grad.float()).all()


@pytest.fixture
def shims_state():
    """Leave the process-wide shim state as the test found it."""
    was_installed = cpu_shims.shims_installed()
    yield
    cpu_shims.uninstall_cpu_shims()
    if was_installed:
        cpu_shims.install_cpu_shims()


@needs_no_cuda
def test_install_is_idempotent_and_records_originals(shims_state):
    cpu_shims.uninstall_cpu_shims()
    core_loss = importlib.import_module("specforge.core.loss")
    eagle3_model = importlib.import_module("specforge.algorithms.eagle3.model")
    llama3 = importlib.import_module("specforge.modeling.draft.llama3_eagle")
    triton_loss = core_loss.LogSoftmaxLoss
    compiled_norm = llama3.LlamaRMSNorm.forward
    assert triton_loss is not TorchLogSoftmaxLoss
    assert hasattr(compiled_norm, "_torchdynamo_orig_callable")

    cpu_shims.install_cpu_shims()
    first = dict(cpu_shims.ORIGINALS)
    cpu_shims.install_cpu_shims()
    assert cpu_shims.ORIGINALS == first
    assert cpu_shims.shims_installed()

    for module in (
        "specforge.core.loss",
        "specforge.algorithms.eagle3.model",
        "specforge.algorithms.peagle.model",
    ):
        assert importlib.import_module(module).LogSoftmaxLoss is TorchLogSoftmaxLoss
        assert first[(module, "LogSoftmaxLoss")] is triton_loss
    expected_compiled = {
        ("specforge.modeling.draft.llama3_eagle", "apply_rotary_pos_emb"),
        ("specforge.modeling.draft.llama3_eagle", "LlamaRotaryEmbedding.forward"),
        ("specforge.modeling.draft.llama3_eagle", "LlamaRMSNorm.forward"),
        ("specforge.algorithms.eagle3.model", "_compute_target_p"),
        ("specforge.algorithms.eagle3.model", "_compute_metric_acc"),
        ("specforge.algorithms.eagle3.model", "_compute_metric_counts"),
        ("specforge.core.loss", "_compute_loss"),
    }
    assert expected_compiled <= set(first)
    assert first[("specforge.modeling.draft.llama3_eagle", "LlamaRMSNorm.forward")] is compiled_norm
    assert llama3.LlamaRMSNorm.forward is compiled_norm._torchdynamo_orig_callable
    assert not hasattr(eagle3_model._compute_target_p, "_torchdynamo_orig_callable")

    cpu_shims.uninstall_cpu_shims()
    assert eagle3_model.LogSoftmaxLoss is triton_loss
    assert llama3.LlamaRMSNorm.forward is compiled_norm
    assert not cpu_shims.ORIGINALS


@needs_no_cuda
def test_patched_eagle3_loss_path_runs_on_cpu(shims_state):
    cpu_shims.install_cpu_shims()
    eagle3_model = importlib.import_module("specforge.algorithms.eagle3.model")
    logits, target_p, mask = random_inputs(6, dtype=torch.float32)
    logits.requires_grad_(True)
    acceptance, loss = eagle3_model._compute_loss_and_acceptance_rate(
        logits=logits,
        target_p=target_p,
        target_p_on_draft=target_p,
        position_mask=mask,
        lk_loss_type=None,
        kl_scale=1.0,
        kl_decay=1.0,
    )
    loss.backward()
    torch.testing.assert_close(loss, reference_loss(logits.detach(), target_p, mask))
    assert torch.isfinite(acceptance).all() and logits.grad is not None


def test_install_is_a_no_op_with_cuda(shims_state, monkeypatch):
    cpu_shims.uninstall_cpu_shims()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_shims.install_cpu_shims()
    assert not cpu_shims.shims_installed()
    assert not cpu_shims.ORIGINALS
    core_loss = importlib.import_module("specforge.core.loss")
    assert core_loss.LogSoftmaxLoss is not TorchLogSoftmaxLoss
