"""The ``flex-autotune`` seam: SpecForge's compiled flex attention compiled with inductor's kernel autotuning.

Scope: SpecForge 0.2.0's ``WrappedFlexAttention`` (``specforge.modeling.draft.flex_attention``), the singleton that
compiles ``torch.nn.attention.flex_attention.flex_attention`` once per process for every flex-attention draft
(the EAGLE-3 Llama draft's ``LlamaFlexAttention`` above 128 tokens, P-EAGLE). SpecForge compiles it with inductor's
default mode, which takes flex attention's fixed tile configuration for the GPU and head size; its own source
carries ``mode="max-autotune-no-cudagraphs"`` commented out. At K2.5's draft (56 query heads, 8 KV heads, head
dim 128) the flex backward is the largest attention cost of a long sample's step (bench/REPORT.md's step profiles).

With ``SPECFORGE_KIMI_FLEX_AUTOTUNE=1`` in the process (recipe ``trainer.step_flex_autotune``, set by
``training.step_knobs``), :func:`install_flex_autotune` gives the singleton
``torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")`` before its first use: inductor benchmarks its
flex templates' tile configurations (forward and backward) for the shapes it meets and keeps the fastest. The
mathematics is the same; the tiling changes the order of the fp32 accumulations (losses equal to rounding, compared
on the GPU by ``bench/trainer_memory.py --variants recipe,flex_autotune``: PyTorch's flex attention has no CPU
backward). The first step of each new shape pays the autotuning. Without the variable (or with ``0``) the singleton
is SpecForge's. :func:`uninstall_flex_autotune` puts it back (tests).
"""

from __future__ import annotations

import os

import specforge_kimi.environment as _env

AUTOTUNE_ENV = _env.FLEX_AUTOTUNE.name
MODE = "max-autotune-no-cudagraphs"
#: the singleton's state before the seam: (_is_flex_compiled, _compiled_flex_attention)
_ORIGINAL: list = []


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(AUTOTUNE_ENV, "0") == "1"


def install_flex_autotune(force: bool = False) -> bool:
    """Install the seam when :func:`requested` (or ``force``); True when it is installed after the call."""
    if not (force or requested()):
        return bool(_ORIGINAL)
    if _ORIGINAL:
        return True
    import torch
    from specforge.modeling.draft.flex_attention import WrappedFlexAttention
    from torch.nn.attention.flex_attention import flex_attention

    _ORIGINAL.append((WrappedFlexAttention._is_flex_compiled, vars(WrappedFlexAttention)["_compiled_flex_attention"]))
    compiled = torch.compile(flex_attention, mode=MODE)
    # a class attribute: torch.compile hands back a plain function, which an instance lookup would bind as a method
    # (the singleton itself passed as the query); SpecForge sets it on the instance, where nothing binds
    WrappedFlexAttention._compiled_flex_attention = staticmethod(compiled)
    WrappedFlexAttention._is_flex_compiled = True  # SpecForge's __init__ then keeps ours
    if WrappedFlexAttention._instance is not None:  # a singleton made before the seam: it compiled its own
        WrappedFlexAttention._instance._compiled_flex_attention = compiled
    return True


def installed() -> bool:
    """Whether the seam is installed in this process."""
    return bool(_ORIGINAL)


def uninstall_flex_autotune() -> None:
    """SpecForge's singleton state back (tests)."""
    if not _ORIGINAL:
        return
    from specforge.modeling.draft.flex_attention import WrappedFlexAttention

    flag, original = _ORIGINAL.pop()
    WrappedFlexAttention._is_flex_compiled = flag
    WrappedFlexAttention._compiled_flex_attention = original
    if WrappedFlexAttention._instance is not None:
        vars(WrappedFlexAttention._instance).pop("_compiled_flex_attention", None)
