"""A trainable EAGLE-3 draft with DeepSeek MLA attention: what SGLang's MLA draft serves.

Scope: the forward of SGLang 0.5.14's ``Eagle3DeepseekV2ForCausalLM``
(``sglang/srt/models/kimi_k25_eagle3.py``, with ``DeepseekV2AttentionMLA`` / ``DeepseekV2MLP``
from ``deepseek_v2.py``), re-derived from its equations as a plain torch module that
SpecForge 0.2.0's ``eagle3`` strategy trains with its own TTT loop (``OnlineEagle3Model``):

- input: ``fc`` over the concatenated aux states (optional EAGLE-3.1 ``fc_norm``: one RMSNorm
  per aux chunk before ``fc``);
- one decoder layer (``midlayer``): ``x = [input_layernorm(embed), hidden_norm(h)]`` (2×hidden)
  feeds MLA's q/kv down-projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` (SGLang fuses them
  into ``fused_qkv_a_proj_with_mqa``, q rows first); ``q = q_b_proj(q_a_layernorm(.))`` per head
  ``[nope | rope]``; ``kv = kv_b_proj(kv_a_layernorm(latent[:kv_lora]))`` per head
  ``[k_nope | v]``; one shared ``k_pe = latent[kv_lora:]``; rope on ``q_pe``/``k_pe`` only;
  causal softmax with scale ``qk_head_dim**-0.5 * mscale**2``; ``o_proj``; residual = ``h``
  (pre-norm); ``post_attention_layernorm`` with residual add; dense SiLU MLP;
- output: ``norm(mlp + residual)`` gives the logits (``lm_head`` over the draft vocab); the
  state handed to the next draft step is that normed tensor with EAGLE-3.1 ``norm_output``,
  else the pre-norm sum (SGLang's default).

Rope is SGLang's ``DeepseekScalingRotaryEmbedding`` (``rope_type`` forced to
``deepseek_yarn`` whenever the draft config has non-default rope scaling): YaRN frequencies
over ``original_max_position_embeddings``, cos/sin scaled by
``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) * attn_factor``,
interleaved (GPT-J) pairs unless ``rope_interleave`` is false; the softmax scale gets
``yarn_get_mscale(factor, mscale_all_dim) ** 2`` (``compute_mla_mscale_scaling``). For K2.5
(factor 64, mscale = mscale_all_dim = 1) cos/sin are unscaled and the softmax scale is
``192**-0.5 * 1.4159**2``. Training and serving therefore apply the same rope, unlike the
Llama-style draft (docs/decisions/009-drafts-and-export.md), so this draft keeps the target's YaRN settings.

TTT: at step ``i`` SpecForge's sdpa path rotates q/k at ``position + i`` and lets each query
attend to step 0's keys causally plus its own position's keys from steps 1..i (the cache in
``cache_hidden``); this module follows the same recurrence with MLA's per-head k/v.

Limits: ``training.attention_backend: sdpa`` only (flex/fa/usp are refused); no attention or
fc bias; no quantization; ``num_hidden_layers`` must be 1 (SGLang refuses more). Importing this
module imports torch, transformers and specforge; registration happens only in
:func:`register_mla_draft`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from specforge.modeling.draft.base import Eagle3DraftModel
from torch import nn
from transformers import DeepseekV3Config

#: The architecture name SGLang 0.5.14 and vLLM load the MLA draft as.
ARCH = "Eagle3DeepseekV2ForCausalLM"
#: SGLang registers ``kimi_k2`` as an alias of DeepseekV3Config "for kimi_k25_eagle3"
#: (``sglang/srt/utils/hf_transformers/common.py``); transformers itself does not know it.
MODEL_TYPE = "kimi_k2"
_WRAPPED = "__specforge_kimi_mla__"


class KimiMLAEagle3Config(DeepseekV3Config):
    """DeepSeek-V3 config fields + EAGLE-3 keys (``draft_vocab_size``, ``eagle_config``,
    ``target_hidden_size``, ``fc_norm``, ``norm_output``), ``model_type: kimi_k2``."""

    model_type = MODEL_TYPE


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def _k25_rope() -> dict:
    # K2.5 text_config's rope: YaRN factor 64 over 4096 positions, theta 50000.
    return {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    }


def _base_config(
    *,
    hidden: int,
    heads: int,
    intermediate: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    vocab_size: int,
    draft_vocab_size: int,
    aux_ids: Sequence[int],
    rope_scaling: dict | None,
    rope_theta: float,
    max_position_embeddings: int,
    rms_norm_eps: float,
    pad_token_id: int,
    fc_norm: bool,
    norm_output: bool,
) -> dict:
    return {
        "architectures": [ARCH],
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": intermediate,
        "hidden_act": "silu",
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim,
        "v_head_dim": v_head_dim,
        "rope_theta": rope_theta,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "rope_interleave": True,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "pad_token_id": pad_token_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "fc_norm": fc_norm,
        "norm_output": norm_output,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_ids], "use_aux_hidden_state": True},
        "torch_dtype": "bfloat16",
    }


def k25_default_config(
    *,
    draft_vocab_size: int = 32000,
    aux_ids: Sequence[int] = (1, 29, 57),
    fc_norm: bool = False,
    norm_output: bool = False,
) -> dict:
    """The K2.5 MLA draft config (a JSON-ready dict, SpecForge ids in ``eagle_config``).

    Target dims from K2.5's ``text_config``: hidden 7168, 64 heads, q_lora 1536, kv_lora 512,
    qk_nope 128, qk_rope 64, v 128, rms eps 1e-5, vocab 163840, YaRN as the target. The MLP
    is the target's dense layer width (18432). ``draft_vocab_size`` must be the vocab mapping's
    (``d2t`` length); :func:`with_vocab_mapping` sets it from the file. ``aux_ids`` are
    SpecForge ids (K2.5's default [1, 29, 57], which capture positions [2, 30, 58]).
    """
    return _base_config(
        hidden=7168,
        heads=64,
        intermediate=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=163840,
        draft_vocab_size=draft_vocab_size,
        aux_ids=aux_ids,
        rope_scaling=_k25_rope(),
        rope_theta=50000.0,
        max_position_embeddings=262144,
        rms_norm_eps=1e-5,
        pad_token_id=163839,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )


def tiny_config(
    spec: Any = None,
    *,
    draft_vocab_size: int = 256,
    aux_ids: Sequence[int] | None = None,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> dict:
    """The MLA draft for a tiny K2.5 from :mod:`specforge_kimi.targets.tiny` (``TinySpec``).

    Hidden size, heads, q_lora rank, dense MLP width and vocab follow the spec; the other MLA
    dims and the rope are K2.5's, as in the tiny target. ``aux_ids`` default to SGLang's own
    default for the target's depth (:func:`specforge_kimi.targets.layer_ids.default_specforge_ids`).
    """
    from specforge_kimi.targets.layer_ids import AuxLayers, default_specforge_ids
    from specforge_kimi.targets.tiny import TinySpec, text_config

    spec = spec or TinySpec()
    text = text_config(spec)
    aux_ids = list(aux_ids if aux_ids is not None else default_specforge_ids(spec.layers))
    AuxLayers.from_specforge(aux_ids, spec.layers)  # refuse ids this target cannot capture
    return _base_config(
        hidden=spec.hidden,
        heads=spec.heads,
        intermediate=spec.dense_intermediate,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=text["kv_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"],
        qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"],
        vocab_size=spec.vocab,
        draft_vocab_size=draft_vocab_size,
        aux_ids=aux_ids,
        rope_scaling=text["rope_scaling"],
        rope_theta=text["rope_theta"],
        max_position_embeddings=text["max_position_embeddings"],
        rms_norm_eps=text["rms_norm_eps"],
        pad_token_id=text["pad_token_id"],
        fc_norm=fc_norm,
        norm_output=norm_output,
    )


def with_vocab_mapping(config: dict, vocab_mapping_path: str | os.PathLike) -> dict:
    """Copy of ``config`` with ``draft_vocab_size`` = the mapping's ``d2t`` length (checked
    against ``t2d``'s length = the target vocab)."""
    from specforge_kimi.errors import KimiInputError

    mapping = torch.load(str(vocab_mapping_path), map_location="cpu")
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    if t2d.numel() != config["vocab_size"]:
        raise KimiInputError(
            f"{vocab_mapping_path}: t2d covers {t2d.numel()} target ids, the draft config's "
            f"vocab_size is {config['vocab_size']}"
        )
    if int(t2d.sum()) != d2t.numel():
        raise KimiInputError(f"{vocab_mapping_path}: t2d selects {int(t2d.sum())} ids but d2t has {d2t.numel()}")
    return {**config, "draft_vocab_size": int(d2t.numel())}


def write_config(config: dict, path: str | os.PathLike) -> str:
    """Write a draft config JSON (what ``model.draft_model_config`` points at)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return str(path)


# ---------------------------------------------------------------------------------------------
# rope, exactly as SGLang builds it for this class
# ---------------------------------------------------------------------------------------------
def _yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """Everything the rope and softmax scale depend on, resolved from a draft config."""

    theta: float
    scaling: dict | None  # None = plain rope; else deepseek_yarn parameters
    interleaved: bool
    rope_dim: int
    qk_head_dim: int

    @property
    def softmax_scale(self) -> float:
        base = self.qk_head_dim**-0.5
        s = self.scaling
        # DeepseekV2AttentionMLA: only with rope scaling and apply_yarn_scaling (default True);
        # compute_mla_mscale_scaling also honours apply_scale; mscale_all_dim defaults to 0.
        if not s or not s.get("apply_yarn_scaling", True) or not s.get("apply_scale", True):
            return base
        m = _yarn_get_mscale(float(s.get("factor", 1.0)), float(s.get("mscale_all_dim", 0) or 0))
        return base * m * m

    @property
    def cos_sin_scale(self) -> float:
        s = self.scaling
        if not s:
            return 1.0
        factor = float(s.get("factor", 1.0))
        return (
            _yarn_get_mscale(factor, float(s.get("mscale", 1)))
            / _yarn_get_mscale(factor, float(s.get("mscale_all_dim", 0) or 0))
            * float(s.get("attn_factor", 1))
        )

    def inv_freq(self) -> torch.Tensor:
        d = self.rope_dim
        pos_freqs = self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        if not self.scaling:
            return 1.0 / pos_freqs
        s = self.scaling
        factor = float(s.get("factor", 1.0))
        original = float(s["original_max_position_embeddings"])
        beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

        def correction_dim(rotations: float) -> float:
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), d - 1)
        if low == high:
            high += 0.001  # SGLang's guard against a zero-width ramp
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = (1 - ramp) * float(s.get("extrapolation_factor", 1))
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [B, T, heads, rope_dim]`` at ``positions [B, T]`` (fp32 math, x's dtype out)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq().to(x.device)  # [B, T, d/2]
        cos = (freqs.cos() * self.cos_sin_scale)[:, :, None, :]
        sin = (freqs.sin() * self.cos_sin_scale)[:, :, None, :]
        xf = x.float()
        if self.interleaved:  # GPT-J pairs (2i, 2i+1)
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:  # NeoX halves
            x1, x2 = xf.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


def rope_settings(config: Any) -> RopeSettings:
    """Resolve the rope the way ``Eagle3MLADecoderLayer.__init__`` does (transformers 5 puts
    the scaling dict, with ``rope_theta``, in ``rope_parameters``; ``rope_type: default`` means
    none)."""
    from specforge_kimi.errors import KimiInputError

    params = getattr(config, "rope_parameters", None)
    if params:
        theta = float(params.get("rope_theta", 10000))
        scaling = dict(params) if params.get("rope_type", params.get("type")) != "default" else None
    else:
        theta = float(getattr(config, "rope_theta", 10000))
        scaling = dict(getattr(config, "rope_scaling", None) or {}) or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        # SGLang rewrites any rope_type to deepseek_yarn; only YaRN means the same thing in a
        # training config, so anything else would silently train one rope and serve another.
        if kind not in ("yarn", "deepseek_yarn"):
            raise KimiInputError(
                f"MLA draft rope_type {kind!r}: SGLang serves every scaled rope as deepseek_yarn; "
                "use yarn or no rope scaling"
            )
        if "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = config.max_position_embeddings
    return RopeSettings(
        theta=theta,
        scaling=scaling,
        interleaved=bool(getattr(config, "rope_interleave", True)),
        rope_dim=int(config.qk_rope_head_dim),
        qk_head_dim=int(config.qk_nope_head_dim + config.qk_rope_head_dim),
    )


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """SGLang's RMSNorm: fp32 statistics, ``(x * weight)`` cast back to the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * self.weight.float()).to(dtype)


class MLAttention(nn.Module):
    """MLA with a 2×hidden input, parameter names as in SGLang's checkpoint (unfused)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        if not config.q_lora_rank:
            raise ValueError("the Eagle3 MLA draft requires q_lora_rank (SGLang refuses a draft without it)")
        self.q_a_proj = nn.Linear(2 * h, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        self.rope = rope_settings(config)
        self.scaling = self.rope.softmax_scale

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache_hidden: list[list[torch.Tensor]] | None,
    ) -> torch.Tensor:
        bsz, q_len, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(bsz, q_len, self.num_heads, -1)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(x)
        kv_a, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a)).view(bsz, q_len, self.num_heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)

        # SpecForge's TTT: step i rotates at position + i (i = steps already cached).
        offset = len(cache_hidden[0]) if cache_hidden is not None else 0
        positions = position_ids.expand(bsz, q_len) + offset
        q_pe = self.rope.apply(q_pe, positions)
        k_pe = self.rope.apply(k_pe.unsqueeze(2), positions).expand(-1, -1, self.num_heads, -1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)

        if cache_hidden is None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None, scale=self.scaling
            )
        else:
            cache_hidden[0] = cache_hidden[0] + [k]
            cache_hidden[1] = cache_hidden[1] + [v]
            keys, values = cache_hidden
            scores = torch.matmul(q, keys[0].transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                scores = scores + attention_mask
            # later TTT steps: each query sees only its own position's key from that step
            diag = [(q * ki).sum(-1, keepdim=True) * self.scaling for ki in keys[1:]]
            probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs[..., :q_len], values[0])
            for i, vi in enumerate(values[1:]):
                out = out + probs[..., q_len + i, None] * vi
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.v_dim)
        return self.o_proj(out)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLADecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = MLAttention(config)
        self.mlp = DenseMLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self,
        input_emb: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache_hidden: list[list[torch.Tensor]] | None,
    ) -> torch.Tensor:
        """Returns the pre-norm sum ``mlp + attn + hidden_states`` (SGLang's aux by default)."""
        residual = hidden_states
        x = torch.cat([self.input_layernorm(input_emb), self.hidden_norm(hidden_states)], dim=-1)
        attn = self.self_attn(x, position_ids, attention_mask, cache_hidden)
        residual = attn + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


def _aux_count(config: Any) -> int:
    # SGLang's _get_eagle_aux_layer_count: eagle_config ids, else top-level ids, else 3.
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if ids is None:
        ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    return 3 if ids is None else len(ids)


class Eagle3DeepseekV2ForCausalLM(Eagle3DraftModel):
    """The MLA EAGLE-3 draft, training side of SGLang's class of the same name.

    The class name is the engines' architecture name on purpose: transformers'
    ``save_pretrained`` (used by SpecForge's ``export --to sglang``) writes
    ``architectures: [<class name>]``.

    Parameter names equal SGLang's checkpoint names with ``midlayer`` for ``layers.0``:
    ``fc``, ``fc_norm.{i}``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``,
    ``midlayer.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,
    kv_b_proj,o_proj}``, ``midlayer.mlp.{gate,up,down}_proj``, ``norm``, ``lm_head``,
    ``embed_tokens`` (frozen target copy) and the ``t2d``/``d2t`` buffers.
    """

    config_class = KimiMLAEagle3Config

    def __init__(self, config: Any, quant_config: Any = None, attention_backend: str = "sdpa") -> None:
        super().__init__(config)
        if attention_backend not in ("sdpa", None):
            raise ValueError(
                f"the MLA EAGLE-3 draft trains with training.attention_backend: sdpa only, got {attention_backend!r}"
            )
        if quant_config is not None:
            raise ValueError("the MLA EAGLE-3 draft does not support quantization")
        if int(config.num_hidden_layers) != 1:
            raise ValueError("EAGLE-3 drafts have exactly one layer (SGLang refuses num_hidden_layers != 1)")
        if getattr(config, "bias", False) or getattr(config, "attention_bias", False):
            raise ValueError("the MLA EAGLE-3 draft has no biases")
        if getattr(config, "norm_before_residual", False):
            raise ValueError("norm_before_residual is a vLLM-only variant; SGLang's MLA draft has no such flag")
        self.config = config
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.num_aux_hidden_states = _aux_count(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.fc = nn.Linear(self.target_hidden_size * self.num_aux_hidden_states, config.hidden_size, bias=False)
        # EAGLE-3.1 fc_norm (legacy name use_aux_norm), as SGLang reads it
        if getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False):
            self.fc_norm = nn.ModuleList(
                RMSNorm(self.target_hidden_size, config.rms_norm_eps) for _ in range(self.num_aux_hidden_states)
            )
        else:
            self.fc_norm = None
        self.midlayer = MLADecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.lm_head = nn.Linear(config.hidden_size, self.draft_vocab_size, bias=False)
        self.register_buffer("t2d", torch.ones(self.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Our RMSNorm is not transformers', so its init is ours: ones, like SGLang's default.
        if isinstance(module, RMSNorm):
            with torch.no_grad():
                module.weight.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))

    # ---- SpecForge's Eagle3DraftModel contract ----------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def project_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        expected = self.target_hidden_size * self.num_aux_hidden_states
        if hidden_states.size(-1) != expected:
            raise ValueError(f"aux hidden states have width {hidden_states.size(-1)}, fc expects {expected}")
        if self.fc_norm is not None:
            chunks = hidden_states.chunk(self.num_aux_hidden_states, dim=-1)
            hidden_states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=False)], dim=-1)
        return self.fc(hidden_states)

    def backbone(
        self,
        input_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        cache_hidden: Any,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        past_key_values: Any = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """One draft step; returns the state the next step consumes (SGLang's ``aux`` output)."""
        if past_key_values is not None:
            raise ValueError("the MLA EAGLE-3 draft supports the sdpa TTT cache (cache_hidden) only")
        out = self.midlayer(input_embeds, hidden_states, position_ids, attention_mask, cache_hidden)
        return self.norm(out) if self.norm_output else out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # SGLang's logits always come from norm(sum); with norm_output the state already is it.
        return self.lm_head(hidden_states if self.norm_output else self.norm(hidden_states))

    # ---- a single step, for parity checks ---------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-vocab logits and next-step state for one causal pass (SGLang's draft extend)."""
        seq = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        hidden = self.project_hidden_states(aux_hidden_states)
        embeds = self.embed_input_ids(input_ids).to(hidden.dtype)
        state = self.backbone(embeds, hidden, cache_hidden=None, attention_mask=None, position_ids=position_ids)
        return self.compute_logits(state), state


# ---------------------------------------------------------------------------------------------
# explicit registration with SpecForge
# ---------------------------------------------------------------------------------------------
def _extend_eagle3_algorithm() -> None:
    """Let ``training.strategy: eagle3`` accept :data:`ARCH`.

    SpecForge 0.2.0's eagle3 registration lists only ``LlamaForCausalLMEagle3`` in
    ``DraftRequirement.compatible_architectures`` and ``DraftConfigProvider``; the CLI builds
    its registry fresh from ``providers.create_registration``, which looks up
    ``algorithm_spec`` / ``algorithm_providers`` in its module at call time, so wrapping those
    two adds the architecture for every later ``resolve_run``. Defaults stay Llama.
    """
    from specforge.algorithms.eagle3 import providers

    if getattr(providers.algorithm_spec, _WRAPPED, False):
        return
    spec_fn, providers_fn = providers.algorithm_spec, providers.algorithm_providers

    @functools.wraps(spec_fn)
    def algorithm_spec():
        spec = spec_fn()
        draft = dataclasses.replace(
            spec.draft, compatible_architectures=frozenset(spec.draft.compatible_architectures) | {ARCH}
        )
        return dataclasses.replace(spec, draft=draft)

    @functools.wraps(providers_fn)
    def algorithm_providers():
        prov = providers_fn()
        dcp = prov.model.draft_config
        dcp = dataclasses.replace(dcp, compatible_architectures=frozenset(dcp.compatible_architectures) | {ARCH})
        return dataclasses.replace(prov, model=dataclasses.replace(prov.model, draft_config=dcp))

    setattr(algorithm_spec, _WRAPPED, True)
    setattr(algorithm_providers, _WRAPPED, True)
    providers.algorithm_spec = algorithm_spec
    providers.algorithm_providers = algorithm_providers


def _install_draft_type_check() -> None:
    """Check an MLA draft against its own class in ``training.assembly._load_draft``.

    SpecForge checks ``isinstance(draft, resolve_draft(provider.draft_config.architecture))``,
    i.e. against the algorithm's default (Llama) class. For a config naming :data:`ARCH` we run
    the same steps (resolve config, ``provider.build_draft``) and check against our class;
    every other config goes to SpecForge's function untouched.
    """
    from specforge.training import assembly

    original = assembly._load_draft
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _load_draft(cfg, algorithm):
        from specforge.modeling.draft.registry import resolve_draft
        from specforge.training.model_loading import resolve_draft_config

        if algorithm.name != "eagle3":
            return original(cfg, algorithm)
        provider = algorithm.providers.model
        draft_config = resolve_draft_config(cfg, provider=provider.draft_config)
        if list(getattr(draft_config, "architectures", None) or []) != [ARCH]:
            return original(cfg, algorithm)
        draft_model = provider.build_draft(cfg, draft_config)
        if not isinstance(draft_model, resolve_draft(ARCH)):
            raise ValueError(f"draft config names {ARCH} but built {type(draft_model).__name__}")
        return draft_config, draft_model

    setattr(_load_draft, _WRAPPED, True)
    assembly._load_draft = _load_draft


def register_mla_draft() -> None:
    """Register the MLA draft with SpecForge (idempotent): draft registry under :data:`ARCH`,
    the eagle3 algorithm's compatible architectures, the draft-type check, and an identity
    entry in ``specforge.export.to_sglang.WEIGHT_MAPS`` (our names are SGLang's)."""
    from specforge.export import to_sglang
    from specforge.modeling.draft.registry import register_draft

    register_draft(Eagle3DeepseekV2ForCausalLM, name=ARCH)
    _extend_eagle3_algorithm()
    _install_draft_type_check()
    to_sglang.WEIGHT_MAPS.setdefault(Eagle3DeepseekV2ForCausalLM.__name__, {})


__all__ = [
    "ARCH",
    "MODEL_TYPE",
    "Eagle3DeepseekV2ForCausalLM",
    "KimiMLAEagle3Config",
    "RopeSettings",
    "k25_default_config",
    "register_mla_draft",
    "rope_settings",
    "tiny_config",
    "with_vocab_mapping",
    "write_config",
]
