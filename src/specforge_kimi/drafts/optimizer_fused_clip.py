"""The ``optimizer-fused-clip`` seam: SpecForge's BF16 optimizer step with fewer passes over the gradients.

Scope: SpecForge 0.2.0's ``BF16Optimizer.step`` (``specforge.optimizer``), the optimizer of every draft family's
trainer (EAGLE-3 and the block drafts), with its AdamW fused (our patch bf16-optimizer-fused-adamw,
``trainer.fused_adamw``) and its fp32 masters on the GPU. Besides AdamW's own kernel, SpecForge's step makes these
passes over every trainable parameter: the gradient norm as ``grad.float().square().sum()`` per gradient (an fp32
copy and its square materialised), the fp32 master gradient's cast, its ``mul_`` by the clip coefficient, and the
cast back as ``p.data.copy_(mp.data.to(dtype))`` (a bf16 temporary, then a copy). Their cost in a profile:
bench/REPORT.md's step profiles (the ``optimizer`` class).

With ``SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP=1`` in the process (recipe ``trainer.step_optimizer_fused_clip``, set by
``training.step_knobs``), :func:`install_optimizer_fused_clip` replaces ``BF16Optimizer.step`` with :func:`step`:

- the squared norm from ``torch._foreach_norm`` over the bf16 gradients with fp32 accumulation (one multi-tensor
  pass that reads each gradient once), reduced across ranks by SpecForge's own ``_reduce_grad_norm``;
- each master gradient the fp32 cast of the bf16 one, unscaled; the clip coefficient handed to fused AdamW as its
  ``grad_scale`` (``1 / coefficient``: the kernel divides each gradient by it as it reads it, as it does for
  ``torch.amp.GradScaler``), so no pass multiplies them;
- the masters copied into the bf16 parameters with one cast-on-copy each.

The update is SpecForge's to fp32 rounding: the norm's summation order differs and ``g / (1 / c)`` is ``g x c`` to
an ulp; with no clipping (coefficient 1) the update is the same. ``last_grad_norm``, the scheduler, ``zero_grad``
and the state dict are SpecForge's. An optimizer whose AdamW is not fused, or whose masters are offloaded to the
host, runs SpecForge's own step. Without the variable (or with ``0``) nothing is replaced;
:func:`uninstall_optimizer_fused_clip` puts SpecForge's step back (tests).
"""

from __future__ import annotations

import os

import specforge_kimi.environment as _env

FUSED_CLIP_ENV = _env.OPTIMIZER_FUSED_CLIP.name
#: SpecForge's ``BF16Optimizer.step`` while the seam is installed
_ORIGINAL: list = []


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(FUSED_CLIP_ENV, "0") == "1"


def applies(opt) -> bool:
    """Whether :func:`step` takes ``opt``'s step: its AdamW fused, its masters on the parameters' device."""
    return bool(opt.optimizer.defaults.get("fused")) and not opt.offload_master


def grad_norm_sq(grads):
    """The squared L2 norm of ``grads`` (bf16 or fp32) in fp32, from one multi-tensor pass."""
    import torch

    if not grads:
        return None
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def step(self):
    """``BF16Optimizer.step`` with the clip folded into fused AdamW's ``grad_scale`` (module docstring)."""
    import torch

    if not applies(self):
        return _ORIGINAL[0](self)
    grads = [p.grad.detach() for p in self.model_params if p.grad is not None]
    total_norm_sq = grad_norm_sq(grads)
    if total_norm_sq is None:
        device = self.model_params[0].device if self.model_params else "cpu"
        total_norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    grad_norm, clip_coefficient = self._reduce_grad_norm(total_norm_sq)
    with torch.no_grad():
        for p, mp in zip(self.model_params, self.fp32_params, strict=True):
            mp.grad = None if p.grad is None else p.grad.detach().to(device=mp.device, dtype=torch.float32)
    self.last_grad_norm = grad_norm.detach()
    self.optimizer.grad_scale = clip_coefficient.reciprocal()  # fused AdamW divides each gradient by it
    try:
        self.optimizer.step()
    finally:
        self.optimizer.grad_scale = None
    self.optimizer.zero_grad()
    self.scheduler.step()
    with torch.no_grad():
        for p, mp in zip(self.model_params, self.fp32_params, strict=True):
            p.data.copy_(mp.data)  # cast on copy, no bf16 temporary
            p.grad = None
    return self.last_grad_norm


def install_optimizer_fused_clip(force: bool = False) -> bool:
    """Install the seam when :func:`requested` (or ``force``); True when it is installed after the call."""
    if not (force or requested()):
        return bool(_ORIGINAL)
    if _ORIGINAL:
        return True
    from specforge.optimizer import BF16Optimizer

    _ORIGINAL.append(BF16Optimizer.step)
    BF16Optimizer.step = step
    return True


def installed() -> bool:
    """Whether the seam is installed in this process."""
    return bool(_ORIGINAL)


def uninstall_optimizer_fused_clip() -> None:
    """SpecForge's step back (tests)."""
    if not _ORIGINAL:
        return
    from specforge.optimizer import BF16Optimizer

    BF16Optimizer.step = _ORIGINAL.pop()
