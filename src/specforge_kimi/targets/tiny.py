"""Tiny Kimi-K2.5 checkpoints: K2.5's exact config nesting and tensor names, random weights.

Scope: a local directory that SGLang 0.5.14 loads as ``KimiK25ForConditionalGeneration`` and
transformers/SpecForge read through :mod:`specforge_kimi.targets.checkpoint`: ``model_type: kimi_k25``, a
DeepSeek-V3 ``text_config`` (layer 0 dense, MoE after it with sigmoid ``noaux_tc`` routing, an
``e_score_correction_bias`` and one shared expert; MLA with K2.5's head dims), a ``vision_config``
carrying both the tower's plain names and the projector's ``vt_*`` names, K2.5's special ids,
bf16 safetensors shards with a ``model.safetensors.index.json``. Defaults keep attention heads,
experts and intermediate sizes divisible by 8 so the same checkpoint runs at TP=8.
Routed experts are bf16 by default; ``int4_experts`` (``tiny --int4-experts``) writes them as K2.5
ships them: compressed-tensors ``pack-quantized`` int4 symmetric group 32 (``weight_packed``,
``weight_scale``, ``weight_shape``), made by the library's own compressor
(:mod:`specforge_kimi.targets.int4`), with K2.5's ``quantization_config`` under ``text_config``.
``device`` generates and quantizes the random weights there (a GPU writes a K2.5-width slice in
seconds; the bytes are the same function of the seed on any device of one kind).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from specforge_kimi.errors import KimiInputError

K25_BOS, K25_EOS, K25_PAD, K25_MEDIA_PLACEHOLDER = 163584, 163585, 163839, 163605
K25_VOCAB = 163840


@dataclass(frozen=True)
class TinySpec:
    """Knobs of a tiny K2.5; everything not named here is K2.5's own value."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    experts: int = 8
    experts_per_token: int = 2
    moe_intermediate: int = 256
    dense_intermediate: int = 1024
    q_lora_rank: int = 1536
    vocab: int = K25_VOCAB
    max_position_embeddings: int = 262144
    vision_hidden: int = 128
    vision_heads: int = 8
    vision_layers: int = 1
    seed: int = 0
    int4_experts: bool = False

    def validate(self) -> None:
        if self.layers < 2:
            raise KimiInputError("--layers must be >= 2 (layer 0 is dense, the rest MoE)")
        if self.vocab <= K25_PAD:
            raise KimiInputError(
                f"--vocab {self.vocab} cannot hold K2.5's special ids (up to {K25_PAD}); use >= {K25_PAD + 1}"
            )
        for name in ("hidden", "heads", "experts", "moe_intermediate", "dense_intermediate", "q_lora_rank"):
            if getattr(self, name) <= 0:
                raise KimiInputError(f"--{name.replace('_', '-')} must be positive")
        if not 0 < self.experts_per_token <= self.experts:
            raise KimiInputError("experts_per_token must be in 1..experts")
        if self.int4_experts:
            from specforge_kimi.targets.int4 import GROUP_SIZE

            for name in ("hidden", "moe_intermediate"):
                if getattr(self, name) % GROUP_SIZE:
                    raise KimiInputError(
                        f"--int4-experts needs --{name.replace('_', '-')} divisible by {GROUP_SIZE} "
                        f"(K2.5's group size), not {getattr(self, name)}"
                    )


def text_config(spec: TinySpec) -> dict:
    """K2.5's ``text_config`` with the tiny sizes substituted (and K2.5's quantization block with
    ``int4_experts``)."""
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": K25_BOS,
        "eos_token_id": K25_EOS,
        "pad_token_id": K25_PAD,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.dense_intermediate,
        "kv_lora_rank": 512,
        "max_position_embeddings": spec.max_position_embeddings,
        "moe_intermediate_size": spec.moe_intermediate,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": spec.experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": spec.heads,
        "num_experts_per_tok": spec.experts_per_token,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.heads,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": spec.q_lora_rank,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": spec.vocab,
    }
    if spec.int4_experts:
        from specforge_kimi.targets.int4 import quantization_block

        text["quantization_config"] = quantization_block()
    return text


def vision_config(spec: TinySpec) -> dict:
    """Vision tower (plain names, read by SGLang's MoonViT) + projector (``vt_*`` names)."""
    intermediate = spec.vision_hidden * 4
    return {
        "patch_size": 14,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "merge_kernel_size": [2, 2],
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "hidden_size": spec.vision_hidden,
        "num_attention_heads": spec.vision_heads,
        "num_hidden_layers": spec.vision_layers,
        "intermediate_size": intermediate,
        "vt_hidden_size": spec.vision_hidden,
        "vt_num_attention_heads": spec.vision_heads,
        "vt_num_hidden_layers": spec.vision_layers,
        "vt_intermediate_size": intermediate,
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": spec.vision_hidden,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": spec.hidden,
    }


def config(spec: TinySpec) -> dict:
    """The whole ``config.json``."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": K25_BOS,
        "eos_token_id": K25_EOS,
        "pad_token_id": K25_PAD,
        "ignore_index": -100,
        "media_placeholder_token_id": K25_MEDIA_PLACEHOLDER,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "text_config": text_config(spec),
        "vision_config": vision_config(spec),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "specforge_kimi_tiny": asdict(spec),
    }


def text_tensor_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """K2.5 text tensor names -> shapes for this spec (per-expert names; every projection as its bf16
    ``.weight``, i.e. before INT4 packing: :func:`disk_tensor_shapes` has what is written)."""
    h, heads = spec.hidden, spec.heads
    qk_head = 128 + 64
    p = "language_model.model."
    shapes: dict[str, tuple[int, ...]] = {
        p + "embed_tokens.weight": (spec.vocab, h),
        p + "norm.weight": (h,),
        "language_model.lm_head.weight": (spec.vocab, h),
    }
    for i in range(spec.layers):
        lp = f"{p}layers.{i}."
        shapes.update(
            {
                lp + "input_layernorm.weight": (h,),
                lp + "post_attention_layernorm.weight": (h,),
                lp + "self_attn.q_a_proj.weight": (spec.q_lora_rank, h),
                lp + "self_attn.q_a_layernorm.weight": (spec.q_lora_rank,),
                lp + "self_attn.q_b_proj.weight": (heads * qk_head, spec.q_lora_rank),
                lp + "self_attn.kv_a_proj_with_mqa.weight": (512 + 64, h),
                lp + "self_attn.kv_a_layernorm.weight": (512,),
                lp + "self_attn.kv_b_proj.weight": (heads * (128 + 128), 512),
                lp + "self_attn.o_proj.weight": (h, heads * 128),
            }
        )
        if i == 0:
            inter = spec.dense_intermediate
            shapes.update(
                {
                    lp + "mlp.gate_proj.weight": (inter, h),
                    lp + "mlp.up_proj.weight": (inter, h),
                    lp + "mlp.down_proj.weight": (h, inter),
                }
            )
            continue
        inter = spec.moe_intermediate
        shapes.update(
            {lp + "mlp.gate.weight": (spec.experts, h), lp + "mlp.gate.e_score_correction_bias": (spec.experts,)}
        )
        for e in range(spec.experts):
            ep = f"{lp}mlp.experts.{e}."
            shapes.update(
                {
                    ep + "gate_proj.weight": (inter, h),
                    ep + "up_proj.weight": (inter, h),
                    ep + "down_proj.weight": (h, inter),
                }
            )
        sp = lp + "mlp.shared_experts."
        shapes.update(
            {
                sp + "gate_proj.weight": (inter, h),
                sp + "up_proj.weight": (inter, h),
                sp + "down_proj.weight": (h, inter),
            }
        )
    return shapes


def disk_tensor_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """Every tensor written for ``spec`` -> its shape: text then vision, routed experts as
    ``weight_packed`` / ``weight_scale`` / ``weight_shape`` with ``int4_experts``."""
    from specforge_kimi.targets.int4 import EXPERT_MODULE, packed_shapes

    out: dict[str, tuple[int, ...]] = {}
    for name, shape in {**text_tensor_shapes(spec), **vision_tensor_shapes(spec)}.items():
        module = name.removesuffix(".weight")
        if spec.int4_experts and name.endswith(".weight") and EXPERT_MODULE.match(module):
            out.update({f"{module}.{p}": s for p, s in packed_shapes(*shape).items()})
        else:
            out[name] = shape
    return out


def vision_tensor_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """K2.5 ``vision_tower.*`` / ``mm_projector.*`` names (on-disk ``wqkv``/``wo``/``proj.N``)."""
    v, inter = spec.vision_hidden, spec.vision_hidden * 4
    vc = vision_config(spec)
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (v, 3, 14, 14),
        "vision_tower.patch_embed.proj.bias": (v,),
        "vision_tower.patch_embed.pos_emb.weight": (vc["init_pos_emb_height"], vc["init_pos_emb_width"], v),
        "vision_tower.encoder.final_layernorm.weight": (v,),
        "vision_tower.encoder.final_layernorm.bias": (v,),
        "mm_projector.pre_norm.weight": (v,),
        "mm_projector.pre_norm.bias": (v,),
        "mm_projector.proj.0.weight": (4 * v, 4 * v),
        "mm_projector.proj.0.bias": (4 * v,),
        "mm_projector.proj.2.weight": (spec.hidden, 4 * v),
        "mm_projector.proj.2.bias": (spec.hidden,),
    }
    for i in range(spec.vision_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        shapes.update(
            {
                b + "norm0.weight": (v,),
                b + "norm0.bias": (v,),
                b + "norm1.weight": (v,),
                b + "norm1.bias": (v,),
                b + "wqkv.weight": (3 * v, v),
                b + "wqkv.bias": (3 * v,),
                b + "wo.weight": (v, v),
                b + "wo.bias": (v,),
                b + "mlp.fc0.weight": (inter, v),
                b + "mlp.fc0.bias": (inter,),
                b + "mlp.fc1.weight": (v, inter),
                b + "mlp.fc1.bias": (v,),
            }
        )
    return shapes


def _init(name: str, shape: tuple[int, ...], gen, device: str = "cpu"):
    import torch

    if name.endswith(("layernorm.weight", "norm.weight", "norm0.weight", "norm1.weight", "pre_norm.weight")):
        return torch.ones(shape, device=device)
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, device=device)
    return torch.randn(shape, generator=gen, device=device) * 0.02


def write_tiny(
    out_dir: str | os.PathLike,
    spec: TinySpec = TinySpec(),
    *,
    shard_mb: int = 400,
    state: dict | None = None,
    tokenizer: bool = True,
    device: str = "cpu",
) -> Path:
    """Write a tiny K2.5 checkpoint to ``out_dir`` (created; must be empty or absent).

    ``state`` may carry trained text weights (transformers names without the
    ``language_model.`` prefix, fused experts) to write instead of random ones; with
    ``spec.int4_experts`` they are quantized as they are written (post-training quantization).
    ``tokenizer`` saves the stand-in tokenizer (:mod:`tokenizer`) beside the weights, as a real
    checkpoint carries its own: SpecForge's producer and SGLang load it from the target path.
    Written into a temporary sibling and renamed, so a failure leaves no half checkpoint.
    """
    import shutil

    import torch
    from safetensors.torch import save_file

    spec.validate()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise KimiInputError(f"{out} exists and is not empty")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from specforge_kimi.targets.int4 import EXPERT_MODULE, quantize

        gen = torch.Generator(device=device).manual_seed(spec.seed)
        shapes = {**text_tensor_shapes(spec), **vision_tensor_shapes(spec)}
        disk = _from_hf_state(state, spec) if state is not None else {}
        total = 0
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, shard_idx, files = 0, 0, []

        def flush():
            nonlocal shard, shard_bytes, shard_idx
            if shard:
                fname = f"model-{shard_idx:05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                files.append(fname)
                for k in shard:
                    weight_map[k] = fname
                shard, shard_bytes, shard_idx = {}, 0, shard_idx + 1

        for name, shape in shapes.items():
            t = disk[name].to(device) if name in disk else _init(name, shape, gen, device)
            if tuple(t.shape) != shape:
                raise KimiInputError(f"trained tensor {name} has shape {list(t.shape)}, spec needs {list(shape)}")
            t = t.to(torch.bfloat16)
            module = name.removesuffix(".weight")
            if spec.int4_experts and name.endswith(".weight") and EXPERT_MODULE.match(module):
                tensors = {f"{module}.{k}": v for k, v in quantize(t).items()}
            else:
                tensors = {name: t}
            for k, v in tensors.items():
                v = v.contiguous().cpu()
                shard[k] = v
                nbytes = v.numel() * v.element_size()
                shard_bytes += nbytes
                total += nbytes
            if shard_bytes >= shard_mb * 2**20:
                flush()
        flush()
        # Rename shards to the "-of-N" convention once N is known.
        n = len(files)
        final_map = {}
        for i, fname in enumerate(files):
            new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (tmp / fname).rename(tmp / new)
            final_map.update({k: new for k, v in weight_map.items() if v == fname})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": final_map}, indent=1)
        )
        (tmp / "config.json").write_text(json.dumps(config(spec), indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": K25_BOS, "eos_token_id": [K25_EOS, 163586], "do_sample": False}, indent=2)
        )
        if tokenizer:
            from specforge_kimi.data.tokenizer import build_standin_tokenizer

            build_standin_tokenizer(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _from_hf_state(state: dict, spec: TinySpec) -> dict:
    """transformers DeepseekV3 state dict -> K2.5 on-disk names (experts split per expert)."""
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if "experts" in parts and parts[-1] in ("gate_up_proj", "down_proj") and parts[-2] == "experts":
            layer_prefix = "language_model." + ".".join(parts[:-1])
            for e in range(v.shape[0]):
                if parts[-1] == "gate_up_proj":
                    g, u = v[e].chunk(2, dim=0)
                    out[f"{layer_prefix}.{e}.gate_proj.weight"] = g
                    out[f"{layer_prefix}.{e}.up_proj.weight"] = u
                else:
                    out[f"{layer_prefix}.{e}.down_proj.weight"] = v[e]
        else:
            out["language_model." + k] = v
    return out
