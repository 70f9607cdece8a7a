"""The ``allocator-retries`` seam: each optimizer step's caching-allocator retries in SpecForge's step metrics.

Scope: SpecForge 0.2.0's ``TrainerCore.train_step`` (``specforge.training.controller``) in a trainer rank on CUDA.
A co-located trainer shares its GPU with the capture server; when the room left to it is smaller than what PyTorch's
caching allocator reserves to run the step, the allocator cannot grow, frees its cached blocks and tries again
(``torch.cuda.memory_stats()["num_alloc_retries"]``): a device synchronisation and a release of cached memory each
time, and the step slows without an error or a message. ``recipe validate``'s memory plan counts what the step
allocates, not that working set, so only the run can show it.

After each ``train_step`` that stepped the optimizer, :func:`install_allocator_retries`' wrapper adds to the step's
``result.metrics`` (which SpecForge prints on its ``step N: {...}`` lines, under ``train/``):

- ``perf/cuda_alloc_retries``: the retries since the previous optimizer step (the first counts from the process's
  start);
- ``perf/cuda_reserved_gib``: what the allocator holds after the step.

``specforge-kimi run-report`` reads them back (``perf.median``) and names the retries. The counters are host-side
allocator state: reading them does not synchronise the device. On a CPU-only process, or before CUDA is initialised,
nothing is added. :func:`uninstall_allocator_retries` puts SpecForge's method back (tests).
"""

from __future__ import annotations

import functools

GIB = 2**30
RETRIES_KEY = "perf/cuda_alloc_retries"
RESERVED_KEY = "perf/cuda_reserved_gib"
_LAST = "_specforge_kimi_alloc_retries"  # on the TrainerCore: the counter at its last optimizer step
_WRAPPED_FLAG = "__specforge_kimi_wrapped__"
#: SpecForge's ``TrainerCore.train_step`` while the seam is installed
_ORIGINAL: list = []


def step_metrics(core, torch_cuda) -> dict[str, float]:
    """The two metrics for an optimizer step of ``core`` (``torch_cuda``: ``torch.cuda``, or a stand-in in tests);
    empty without an initialised CUDA."""
    if not (torch_cuda.is_available() and torch_cuda.is_initialized()):
        return {}
    retries = int(torch_cuda.memory_stats().get("num_alloc_retries", 0))
    last = getattr(core, _LAST, 0)
    setattr(core, _LAST, retries)
    return {RETRIES_KEY: float(retries - last), RESERVED_KEY: torch_cuda.memory_reserved() / GIB}


def install_allocator_retries() -> None:
    """Wrap ``TrainerCore.train_step`` once (idempotent)."""
    from specforge.training.controller import TrainerCore

    original = TrainerCore.train_step
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def train_step(self, batch, ctx=None):
        import torch

        result = original(self, batch, ctx)
        if result.optimizer_stepped:
            result.metrics.update(step_metrics(self, torch.cuda))
        return result

    setattr(train_step, _WRAPPED_FLAG, True)
    _ORIGINAL[:] = [original]
    TrainerCore.train_step = train_step


def uninstall_allocator_retries() -> None:
    """Put SpecForge's ``train_step`` back."""
    from specforge.training.controller import TrainerCore

    if _ORIGINAL:
        TrainerCore.train_step = _ORIGINAL.pop()
