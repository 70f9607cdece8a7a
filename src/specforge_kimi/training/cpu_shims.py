"""Make SpecForge 0.2.0's own offline EAGLE-3 trainer run on a machine without a GPU.

:func:`install_cpu_shims` patches the few SpecForge symbols that cannot run without an
accelerator. It is idempotent, does nothing when ``torch.cuda.is_available()`` is True, and
imports SpecForge only when called. Every replaced object is recorded in :data:`ORIGINALS`
(``(module name, dotted attribute) -> original object``) so tests can check what was patched
and :func:`uninstall_cpu_shims` can put it back.

What is patched, and why
========================

1. The EAGLE-3 KL loss (``LogSoftmaxLoss``).
   ``specforge.core.loss.LogSoftmaxLoss`` is an ``autograd.Function`` whose forward and
   backward launch Triton kernels. On a host with no GPU driver the first launch
   (``specforge/core/loss.py:185``, reached from ``_compute_loss_and_acceptance_rate`` at
   ``specforge/algorithms/eagle3/model.py:74``) fails in ``triton/runtime/driver.py:9`` with
   ``RuntimeError: 0 active drivers ([]). There should only be one.`` It is replaced by
   :class:`TorchLogSoftmaxLoss`, a pure-torch ``autograd.Function`` with the same value,
   ``-sum(position_mask * target_p * log_softmax(logits), -1).mean()`` (mean over all B*T
   rows; log-softmax in fp32 as in the kernel, in fp64 for fp64 inputs), and the same
   hand-written gradient as the Triton backward,
   ``d/dlogits = -position_mask * (target_p - softmax(logits) * sum(target_p, -1)) * g / (B*T)``,
   returned in ``logits.dtype``; ``target_p`` and ``position_mask`` get no gradient (the kernel
   returns None for them too). The kernel skips rows whose mask is 0 and weighs the others by
   1, so the two agree whenever ``position_mask`` is 0/1, which is all SpecForge produces
   (``t2d[argmax] * loss_mask``). Because ``eagle3/model.py`` and ``peagle/model.py`` bind the
   class at import (``from specforge.core.loss import LogSoftmaxLoss``), the name is replaced
   in ``specforge.core.loss``, ``specforge.algorithms.eagle3.model`` and
   ``specforge.algorithms.peagle.model``.

2. ``@torch.compile`` helpers on the EAGLE-3 path run eagerly.
   ``specforge.modeling.draft.llama3_eagle`` compiles ``apply_rotary_pos_emb``,
   ``LlamaRotaryEmbedding.forward`` and ``LlamaRMSNorm.forward``;
   ``specforge.algorithms.eagle3.model`` compiles ``_compute_target_p``,
   ``_compute_metric_acc`` and ``_compute_metric_counts``; ``specforge.core.loss`` compiles
   its (unused) reference ``_compute_loss``. Inductor does compile them on a CPU and the losses
   match eager closely, but on the tiny test runs compiling costs more than it saves (warm cache or cold;
   the first optimizer step most of all), new sequence lengths can recompile, and a host without a C++
   toolchain cannot compile at all. Each compiled object is swapped for the plain
   function torch keeps in its ``_torchdynamo_orig_callable`` attribute (module attribute or
   class attribute). ``torch._dynamo``'s global config and any other compiled code in the
   process are left alone.

3. The frozen teacher head's GEMM runs in fp32.
   ``specforge.modeling.target.target_head.TargetHead.forward`` multiplies the final hidden
   state by the whole target LM head ([T, H] x [H, 163,840] for K2.5) in bf16 every step. CPUs
   without native bf16 matrix units run that several times slower than fp32, and it dominates a CPU
   training step. The replacement upcasts the
   input and weight to fp32 for the product and returns the logits in the input's dtype, so
   downstream code (``_compute_target_p`` upcasts to fp32 first anyway) sees the same dtype;
   values differ from the bf16 product only by bf16 rounding.

What is configured instead of patched (see :mod:`specforge_kimi.training.offline`)
================================================================================

- FSDP sharding: ``training.fsdp_sharding: NO_SHARD``. ``specforge.cli._train`` copies it
  into the ``FSDP_SHARDING`` environment variable that
  ``specforge.training.backend.ParallelConfig.from_distributed`` reads, and
  ``FSDPTrainingBackend.prepare_model`` then wraps the model in DDP (gloo, no
  ``device_ids``) instead of FSDP. With the default ``SHARD_GRAD_OP``,
  ``specforge/training/backend.py:281`` ``FSDP(model, ...)`` fails in
  ``torch/distributed/fsdp/_init_utils.py:389`` (``_init_device_handle``): ``RuntimeError:
  FSDP needs a non-CPU accelerator device, but no accelerator device is detected.``
- Process group backend: nothing to do. ``specforge.utils.get_device_type()`` falls back to
  ``"cpu"`` when CUDA is absent (or ``SPECFORGE_DEVICE=cpu``) and
  ``specforge.distributed._DISTRIBUTED_BACKENDS`` maps ``cpu`` to ``gloo``;
  ``_bind_local_device("cpu")`` binds nothing.
- ``get_local_device()`` already returns ``torch.device("cpu")`` on such a host, so the
  draft, the ``OnlineEagle3Model`` wrapper and the frozen ``TargetHead`` land on the CPU.
- ``torch.cuda.empty_cache()`` (``eagle3/model.py:307``) is a no-op while CUDA is not
  initialized; ``torch.cuda.current_device()`` is only reached by the evaluator under NCCL;
  the backend stores only ``torch.get_rng_state()`` for ``device_type == "cpu"``; the
  profiler checks ``torch.cuda.is_available()`` itself. None needs a shim.
- Attention: ``training.attention_backend: sdpa``. The default ``flex_attention`` fails on
  the first backward with ``NotImplementedError: FlexAttention does not support backward on
  CPU`` (``torch/nn/attention/flex_attention.py:1398``); ``fa`` needs flash-attn, or our fa-kernel seam
  (:mod:`specforge_kimi.drafts.eagle3_fa_kernel`: PyTorch's CPU flash kernel).
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any

import torch

__all__ = [
    "ORIGINALS",
    "TorchLogSoftmaxLoss",
    "install_cpu_shims",
    "shims_installed",
    "uninstall_cpu_shims",
]

#: ``(module name, dotted attribute) -> original object`` for everything patched.
ORIGINALS: dict[tuple[str, str], Any] = {}

_LOCK = threading.Lock()
_INSTALLED = False

# Modules that import ``LogSoftmaxLoss`` by name (each keeps its own binding).
_LOSS_MODULES = (
    "specforge.core.loss",
    "specforge.algorithms.eagle3.model",
    "specforge.algorithms.peagle.model",
)
# Modules on the EAGLE-3 training path that define ``@torch.compile`` helpers.
_COMPILED_HELPER_MODULES = (
    "specforge.core.loss",
    "specforge.algorithms.eagle3.model",
    "specforge.modeling.draft.llama3_eagle",
)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 like the Triton kernel, or fp64 when the logits already are (for exact tests)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class TorchLogSoftmaxLoss(torch.autograd.Function):
    """Pure-torch stand-in for ``specforge.core.loss.LogSoftmaxLoss`` (same call signature).

    ``apply(logits[B,T,V], target_p[B,T,V], position_mask[B,T,1] or [B,T])`` returns the scalar
    ``-sum(position_mask * target_p * log_softmax(logits.float()), -1).mean()`` (computed in fp64
    instead of fp32 when the logits are fp64).
    """

    @staticmethod
    def forward(ctx, logits, target, position_mask):  # noqa: D401 - autograd signature
        if position_mask.dim() == logits.dim() - 1:
            position_mask = position_mask.unsqueeze(-1)
        dtype = _compute_dtype(logits)
        mask = position_mask.to(dtype)
        log_probs = torch.log_softmax(logits.detach().to(dtype), dim=-1)
        loss = -(mask * target.to(dtype) * log_probs).sum(-1).mean()
        ctx.save_for_backward(logits.detach(), target, position_mask)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        logits, target, position_mask = ctx.saved_tensors
        rows = logits.numel() // logits.shape[-1]
        dtype = _compute_dtype(logits)
        probs = torch.softmax(logits.to(dtype), dim=-1)
        target_c = target.to(dtype)
        target_sum = target_c.sum(-1, keepdim=True)
        scale = grad_output.to(dtype) / rows
        grad = -position_mask.to(dtype) * (target_c - probs * target_sum) * scale
        return grad.to(logits.dtype), None, None


def _target_head_forward_fp32(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``TargetHead.forward`` with the product in fp32 (shim 3)."""
    weight = self.fc.weight
    return (hidden_states.float() @ weight.float().T).to(hidden_states.dtype)


def shims_installed() -> bool:
    """Whether :func:`install_cpu_shims` has patched SpecForge in this process."""
    return _INSTALLED


def _patch(module, attribute: str, replacement: Any) -> None:
    """Replace ``module.attribute`` (``attribute`` may be ``Class.method``), remembering it."""
    owner = module
    parts = attribute.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    key = (module.__name__, attribute)
    if key not in ORIGINALS:
        ORIGINALS[key] = inspect.getattr_static(owner, parts[-1])
    setattr(owner, parts[-1], replacement)


def _compiled_helpers(module):
    """``(dotted attribute, eager callable)`` for each ``torch.compile``'d object in ``module``."""
    found = []
    for name, value in list(vars(module).items()):
        original = getattr(value, "_torchdynamo_orig_callable", None)
        if original is not None and callable(value):
            found.append((name, original))
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for method_name, method in list(vars(value).items()):
                method_original = getattr(method, "_torchdynamo_orig_callable", None)
                if method_original is not None:
                    found.append((f"{name}.{method_name}", method_original))
    return found


def install_cpu_shims() -> None:
    """Patch SpecForge so its offline EAGLE-3 trainer runs on the CPU (idempotent).

    Does nothing when CUDA is available. See the module docstring for each patch.
    """
    global _INSTALLED
    if torch.cuda.is_available():
        return
    with _LOCK:
        if _INSTALLED:
            return
        # Import every target before patching any: a module imported after
        # ``specforge.core.loss`` is patched would bind (and record) the replacement.
        modules = {name: importlib.import_module(name) for name in (*_LOSS_MODULES, *_COMPILED_HELPER_MODULES)}
        for module_name in _LOSS_MODULES:
            module = modules[module_name]
            if hasattr(module, "LogSoftmaxLoss"):
                _patch(module, "LogSoftmaxLoss", TorchLogSoftmaxLoss)
        for module_name in _COMPILED_HELPER_MODULES:
            module = modules[module_name]
            for attribute, eager in _compiled_helpers(module):
                _patch(module, attribute, eager)
        head_module = importlib.import_module("specforge.modeling.target.target_head")
        _patch(head_module, "TargetHead.forward", _target_head_forward_fp32)
        _INSTALLED = True


def uninstall_cpu_shims() -> None:
    """Restore every object recorded in :data:`ORIGINALS` (for tests)."""
    global _INSTALLED
    with _LOCK:
        for (module_name, attribute), original in list(ORIGINALS.items()):
            module = importlib.import_module(module_name)
            owner = module
            parts = attribute.split(".")
            for part in parts[:-1]:
                owner = getattr(owner, part)
            setattr(owner, parts[-1], original)
        ORIGINALS.clear()
        _INSTALLED = False
