"""Tiny K2.5 checkpoints carry K2.5's config nesting, special ids and tensor names."""

import json

from safetensors import safe_open

from specforge_kimi.targets.checkpoint import weight_index
from specforge_kimi.targets.tiny import TinySpec, config, text_tensor_shapes


def test_config_nesting(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25"
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (163584, 163585, 163839)
    assert cfg["media_placeholder_token_id"] == 163605
    t = cfg["text_config"]
    assert t["model_type"] == "deepseek_v3" and t["vocab_size"] == 163840
    assert (t["kv_lora_rank"], t["qk_rope_head_dim"], t["qk_nope_head_dim"], t["v_head_dim"]) == (512, 64, 128, 128)
    assert (t["first_k_dense_replace"], t["n_shared_experts"]) == (1, 1)
    assert (t["scoring_func"], t["topk_method"]) == ("sigmoid", "noaux_tc")
    assert t["rope_scaling"]["type"] == "yarn" and t["rope_scaling"]["factor"] == 64.0
    v = cfg["vision_config"]
    for plain, vt in [
        ("hidden_size", "vt_hidden_size"),
        ("num_attention_heads", "vt_num_attention_heads"),
        ("num_hidden_layers", "vt_num_hidden_layers"),
        ("intermediate_size", "vt_intermediate_size"),
    ]:
        assert v[plain] == v[vt]
    assert v["text_hidden_size"] == t["hidden_size"]


def test_tensor_names_are_k25(tiny_dir):
    names = set(weight_index(tiny_dir))
    must = [
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.norm.weight",
        "language_model.model.layers.0.self_attn.q_a_proj.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.1.mlp.experts.7.down_proj.weight",
        "language_model.model.layers.1.mlp.gate.e_score_correction_bias",
        "language_model.model.layers.5.mlp.shared_experts.up_proj.weight",
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "mm_projector.proj.0.weight",
    ]
    for n in must:
        assert n in names, n
    assert not any(n.startswith("language_model.model.layers.0.mlp.experts") for n in names)  # layer 0 dense
    assert not any(".gate_up_proj" in n for n in names)  # per-expert names, as K2.5 ships
    with safe_open(str(next(tiny_dir.glob("*.safetensors"))), framework="pt") as f:
        assert str(f.get_slice("language_model.lm_head.weight").get_dtype()) in ("BF16", "bfloat16")


def test_defaults_divide_by_8():
    spec = TinySpec()
    t = config(spec)["text_config"]
    for key in ("num_attention_heads", "n_routed_experts", "moe_intermediate_size", "intermediate_size"):
        assert t[key] % 8 == 0, key
    assert config(spec)["vision_config"]["num_attention_heads"] % 8 == 0
    shapes = text_tensor_shapes(spec)
    assert shapes["language_model.model.layers.0.self_attn.q_b_proj.weight"][0] == 8 * 192
