"""The ``compile-elementwise`` seam: the EAGLE-3 Llama draft's step with its elementwise work compiled.

Scope: two places of SpecForge 0.2.0's eagle3 step, both run once per TTT position. (1) ``LlamaDecoderLayer``
(``specforge.modeling.draft.llama3_eagle``), the one layer of the ``LlamaForCausalLMEagle3`` draft, forward and
backward. Around its attention the layer is elementwise work and the MLP's GEMMs: before the attention, two RMSNorms
and the concatenation of their outputs; after it, the residual add, the post-attention RMSNorm, the MLP (SiLU(gate) x
up between its GEMMs) and the second residual add. Run eagerly, each of those is its own kernel (RMSNorm several:
cast, square, mean, rsqrt, scale), forward and backward, each reading and writing the whole [sequence, hidden]
activation. (2) The step's expected-acceptance metric (``specforge.core.lk_loss._acceptance_rate_per_token_from_logits``:
the draft's softmax in fp32, cast to the teacher's dtype, the minimum with the teacher's probabilities and its sum
over the draft vocabulary). Eagerly that is four kernels over the whole [sequence, draft vocab] logits, with an fp32
copy, the softmax and the minimum each written out; compiled it is reductions over the logits that write one value
per position. It runs in the backward too when the recipe trains on SpecForge's LK objective.

With ``SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE=1`` in the process (recipe ``trainer.step_compile_elementwise``,
set by ``training.step_knobs``), :func:`install_compile_elementwise` replaces the layer's ``forward`` by one that runs
the same operations in the same order, the two regions around the attention each under ``torch.compile``: inductor
fuses each region's elementwise operations, in the forward and in the backward AOTAutograd derives, and calls the
same GEMM library for the linear layers. The attention (flex, sdpa, fa or usp, with its KV cache) stays SpecForge's
own, uncompiled by this seam. It also replaces the metric's function in ``specforge.core.lk_loss`` (where
``compute_acceptance_rate`` looks it up at each call) by SpecForge's own function under ``torch.compile``. The
sequence dimension of every compiled function's inputs is marked dynamic, so a new sample length does not compile
again; hidden and vocabulary sizes stay static. The RMSNorms run SpecForge's own ``forward`` body (its
``torch.compile`` wrapper unwrapped, so the norm is traced into the region instead of compiled on its own).

Without the variable (or with ``0``) nothing is replaced: ``LlamaDecoderLayer.forward`` and the metric are
SpecForge's. :func:`uninstall_compile_elementwise` puts both back (tests).
"""

from __future__ import annotations

import os

import specforge_kimi.environment as _env

COMPILE_ENV = _env.EAGLE3_COMPILE_ELEMENTWISE.name
_FLAG = "__specforge_kimi_compile_elementwise__"
#: the original ``LlamaDecoderLayer.forward`` while the seam is installed
_ORIGINAL: list = []
#: the compiled regions (before, after) of the installed seam
_REGIONS: list = []
#: SpecForge's acceptance-metric function while the seam is installed
_ORIGINAL_METRIC: list = []
#: the metric function's name in ``specforge.core.lk_loss``
METRIC_NAME = "_acceptance_rate_per_token_from_logits"


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(COMPILE_ENV, "0") == "1"


def _eager(fn):
    """A ``torch.compile``'d function's plain body (SpecForge compiles ``LlamaRMSNorm.forward``), else ``fn``."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _norm(norm, x):
    return _eager(type(norm).forward)(norm, x)


def _mark_sequence_dynamic(*tensors) -> None:
    import torch

    for t in tensors:
        if t.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)


def before_attention(layer, input_emb, hidden_states):
    """SpecForge's layer up to its attention: both input norms, embedding first in the concatenation."""
    import torch

    hidden_states = _norm(layer.hidden_norm, hidden_states)
    input_emb = _norm(layer.input_layernorm, input_emb)
    return torch.cat((input_emb, hidden_states), dim=-1)


def after_attention(layer, residual, attn_out):
    """SpecForge's layer after its attention: residual add, post-attention norm, MLP, residual add."""
    hidden_states = residual + attn_out
    residual = hidden_states
    hidden_states = _norm(layer.post_attention_layernorm, hidden_states)
    hidden_states = layer.mlp(hidden_states)
    return residual + hidden_states


def _forward(
    self,
    input_emb,
    hidden_states,
    cache_hidden=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    output_attentions=False,
    use_cache=False,
):
    """``LlamaDecoderLayer.forward`` (same signature, same result) with the regions around the attention compiled."""
    before, after = _REGIONS
    _mark_sequence_dynamic(input_emb, hidden_states)
    residual = hidden_states
    attn_in = before(self, input_emb, hidden_states)
    attn_out = self.self_attn(
        cache_hidden=cache_hidden,
        hidden_states=attn_in,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        output_attentions=output_attentions,
        use_cache=use_cache,
    )
    _mark_sequence_dynamic(attn_out)
    return after(self, residual, attn_out)


def _compiled_metric(compiled):
    """SpecForge's per-position acceptance metric (same signature) run by ``compiled``, its sequence dimension
    dynamic."""

    def acceptance_per_token(logits, target_probs):
        _mark_sequence_dynamic(logits, target_probs)
        return compiled(logits, target_probs)

    setattr(acceptance_per_token, _FLAG, True)
    return acceptance_per_token


def metric_installed() -> bool:
    """Whether SpecForge's ``compute_acceptance_rate`` runs the seam's compiled metric."""
    from specforge.core import lk_loss

    return bool(getattr(getattr(lk_loss, METRIC_NAME), _FLAG, False))


def installed(layer_cls) -> bool:
    """Whether ``layer_cls`` (SpecForge's ``LlamaDecoderLayer``) runs the seam's forward."""
    return bool(getattr(layer_cls.forward, _FLAG, False))


def install_compile_elementwise(*, backend="inductor", force: bool = False) -> bool:
    """Install the seam when the process asked for it (:func:`requested`) or ``force``; True when installed.
    ``backend``: ``torch.compile``'s (tests may pass ``aot_eager`` or a counting callable). Idempotent: a second
    call keeps the first call's compiled regions."""
    if not (force or requested()):
        return False
    from specforge.modeling.draft.llama3_eagle import LlamaDecoderLayer

    if installed(LlamaDecoderLayer):
        return True
    import torch
    from specforge.core import lk_loss

    _REGIONS[:] = [torch.compile(fn, backend=backend, dynamic=None) for fn in (before_attention, after_attention)]
    _ORIGINAL[:] = [LlamaDecoderLayer.forward]
    setattr(_forward, _FLAG, True)
    LlamaDecoderLayer.forward = _forward
    metric = getattr(lk_loss, METRIC_NAME)
    _ORIGINAL_METRIC[:] = [metric]
    setattr(lk_loss, METRIC_NAME, _compiled_metric(torch.compile(metric, backend=backend, dynamic=None)))
    return True


def uninstall_compile_elementwise() -> None:
    """SpecForge's ``LlamaDecoderLayer.forward`` back (a no-op when the seam is not installed)."""
    if not _ORIGINAL:
        return
    from specforge.modeling.draft.llama3_eagle import LlamaDecoderLayer

    LlamaDecoderLayer.forward = _ORIGINAL.pop()
    _REGIONS.clear()
    if _ORIGINAL_METRIC:
        from specforge.core import lk_loss

        setattr(lk_loss, METRIC_NAME, _ORIGINAL_METRIC.pop())
