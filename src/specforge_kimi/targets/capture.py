"""Reference aux hidden-state capture in torch: what SGLang 0.5.14's spec-capture returns.

Scope: a transformers-style DeepSeek-V3 module tree (dense layer 0, MoE layers after), whole or
under K2.5's wrapper (``language_model.model.layers``). Forward pre-hooks record the residual
stream *entering* each captured layer -- SGLang's layer communicator captures there, after the
previous layer's all-reduce and residual add -- so MoE layers whose forward returns router
outputs as well as the hidden state need no special unpacking. The "last hidden state" is the
final RMSNorm's output, which is what SGLang hands the LM head and writes as ``hidden_state``.

This is the reference the GPU parity tests compare SGLang's Mooncake captures against, and the
feature source of the CPU demo (SpecForge's offline feature format).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import AuxLayers


def text_decoder(model: nn.Module) -> nn.Module:
    """The module holding ``layers`` and ``norm``: unwraps K2.5's ``language_model`` wrapper.

    Accepts ``KimiK25ForConditionalGeneration``-like trees (``language_model.model``), a
    ``DeepseekV3ForCausalLM`` (``model``) or the decoder itself.
    """
    node = model
    for attr in ("language_model", "model"):
        if hasattr(node, attr) and not hasattr(node, "layers"):
            node = getattr(node, attr)
    if not (hasattr(node, "layers") and hasattr(node, "norm")):
        raise KimiInputError(
            f"{type(model).__name__} has no language_model.model.layers / model.layers tree to capture from"
        )
    return node


@dataclass
class Captured:
    """One forward's captures: ``aux`` [B, T, len(aux)*H] and ``last`` [B, T, H] (post-norm)."""

    aux: torch.Tensor
    last: torch.Tensor


@contextmanager
def capture_aux(model: nn.Module, aux: AuxLayers) -> Iterator[dict]:
    """Install the hooks for one or more forwards; the yielded dict fills with tensors.

    After each forward the dict holds ``"aux"`` (concatenated along the hidden dim in position
    order, like SGLang) and ``"last"``.
    """
    decoder = text_decoder(model)
    layers = decoder.layers
    if len(layers) != aux.num_layers:
        raise KimiInputError(f"aux layers were validated for {aux.num_layers} layers, the model has {len(layers)}")
    slots: dict[int, torch.Tensor] = {}
    out: dict = {}

    def pre_hook(pos: int):
        def fn(_module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if hidden is None:
                raise RuntimeError(f"layer {pos} was called without hidden_states")
            slots[pos] = hidden.detach()

        return fn

    def norm_hook(_module, _args, output):
        out["last"] = output.detach()
        missing = [p for p in aux.positions if p not in slots]
        if missing:
            raise RuntimeError(f"positions {missing} were not captured in this forward")
        out["aux"] = torch.cat([slots[p] for p in aux.positions], dim=-1)
        slots.clear()

    handles = [layers[p].register_forward_pre_hook(pre_hook(p), with_kwargs=True) for p in aux.positions]
    handles.append(decoder.norm.register_forward_hook(norm_hook))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture(model: nn.Module, input_ids: torch.Tensor, aux: AuxLayers) -> Captured:
    """Run the text decoder on ``input_ids`` [B, T] and return the captured aux/last states."""
    decoder = text_decoder(model)
    with capture_aux(model, aux) as out:
        decoder(input_ids=input_ids, use_cache=False)
    return Captured(aux=out["aux"], last=out["last"])
