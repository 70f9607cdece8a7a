"""The MLA EAGLE-3 draft computes what SGLang 0.5.14's ``Eagle3DeepseekV2ForCausalLM`` computes.

The reference below is written from SGLang's source equations, not from our module: it takes
the weights in SGLang's *loaded* form (q_a/kv_a fused into ``fused_qkv_a_proj_with_mqa`` as
``kimi_k25_eagle3.load_weights`` does, gate/up into ``gate_up_proj``), works token-major like a
``ForwardBatch``, builds the rope as ``DeepseekScalingRotaryEmbedding`` does (a cos/sin cache
over ``original_max * factor`` positions, indexed by position; GPT-J pairs via
``rotate_gptj``), the softmax scale as ``compute_mla_mscale_scaling``, and the residual flow of
``Eagle3MLADecoderLayer`` / ``Eagle3MLAModel`` (fused-add RMSNorm). fp32, random weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from specforge_kimi.drafts import mla_eagle3 as m

SMALL = dict(
    hidden=64,
    heads=4,
    intermediate=96,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=300,
    draft_vocab_size=40,
    aux_ids=[1, 3, 5],
    rope_theta=50000.0,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    pad_token_id=0,
)
#: K2.5's rope but a small factor so the reference cache stays small; mscale != mscale_all_dim
#: so the cos/sin scale path is exercised too.
ROPE = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def make_model(*, fc_norm=False, norm_output=False, rope=ROPE, seed=0):
    cfg = m._base_config(**SMALL, rope_scaling=rope, fc_norm=fc_norm, norm_output=norm_output)
    torch.manual_seed(seed)
    model = m.Eagle3DeepseekV2ForCausalLM(m.KimiMLAEagle3Config.from_dict(cfg)).float().eval()
    with torch.no_grad():  # norms away from 1 so a skipped/misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "embed" not in name:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model, cfg


# ---- the reference, from SGLang's equations -------------------------------------------------
def sglang_weights(model) -> dict:
    """What ``Eagle3DeepseekV2ForCausalLM.load_weights`` leaves in the module (fused)."""
    s = {k: v.detach().clone() for k, v in model.state_dict().items()}
    a = "midlayer.self_attn."
    s[a + "fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
        [s.pop(a + "q_a_proj.weight"), s.pop(a + "kv_a_proj_with_mqa.weight")], 0
    )
    p = "midlayer.mlp."
    s[p + "gate_up_proj.weight"] = torch.cat([s.pop(p + "gate_proj.weight"), s.pop(p + "up_proj.weight")], 0)
    return s


def rmsnorm(x, w, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return y if residual is None else (y, residual)


def sglang_cos_sin_cache(cfg) -> tuple[torch.Tensor, float]:
    """DeepseekScalingRotaryEmbedding._compute_cos_sin_cache, and the attention scaling."""
    rope = cfg["rope_scaling"]
    d, base, factor = cfg["qk_rope_head_dim"], cfg["rope_theta"], rope["factor"]
    orig = rope["original_max_position_embeddings"]

    def get_mscale(scale, ms):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    def corr_dim(rot):
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(corr_dim(rope["beta_fast"])), 0), min(math.ceil(corr_dim(rope["beta_slow"])), d - 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    inv_freq_mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - inv_freq_mask) + (1.0 / pos_freqs) * inv_freq_mask
    t = torch.arange(orig * factor, dtype=torch.float32)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    mscale = get_mscale(factor, rope["mscale"]) / get_mscale(factor, rope["mscale_all_dim"])
    cache = torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)
    qk_head = cfg["qk_nope_head_dim"] + d
    scaling = qk_head**-0.5 * get_mscale(factor, rope["mscale_all_dim"]) ** 2
    return cache, scaling


def rotate_gptj_apply(x, cos, sin):
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
    x1, x2 = x[..., ::2], x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def reference_forward(model, cfg, input_ids, aux, positions, *, norm_output=False):
    """One sequence, token-major: ids [T], aux [T, 3H], positions [T] -> (logits, aux_out)."""
    w = sglang_weights(model)
    eps, H = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    nope, rope_d, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    T = input_ids.shape[0]
    # Eagle3MLAModel.forward: embeddings, fc_norm per chunk, fc
    embeds = w["embed_tokens.weight"][input_ids]
    if cfg["fc_norm"]:
        chunks = aux.chunk(3, dim=-1)
        aux = torch.cat([rmsnorm(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)], -1)
    hidden = aux @ w["fc.weight"].T
    # Eagle3MLADecoderLayer.forward
    L = "midlayer."
    residual = hidden
    x = torch.cat(
        [rmsnorm(embeds, w[L + "input_layernorm.weight"], eps), rmsnorm(hidden, w[L + "hidden_norm.weight"], eps)], -1
    )
    A = L + "self_attn."
    qkv_latent = x @ w[A + "fused_qkv_a_proj_with_mqa.weight"].T
    q, latent_cache = qkv_latent.split([ql, kvl + rope_d], dim=-1)
    q = rmsnorm(q, w[A + "q_a_layernorm.weight"], eps) @ w[A + "q_b_proj.weight"].T
    q = q.view(T, H, nope + rope_d)
    q_pe = q[..., nope:]
    kv_a = rmsnorm(latent_cache[:, :kvl], w[A + "kv_a_layernorm.weight"], eps)
    k_pe = latent_cache[:, kvl:].unsqueeze(1)
    cache, scaling = sglang_cos_sin_cache(cfg)
    cos, sin = cache[positions].chunk(2, dim=-1)
    q_pe, k_pe = rotate_gptj_apply(q_pe, cos, sin), rotate_gptj_apply(k_pe, cos, sin)
    q = torch.cat([q[..., :nope], q_pe], -1)
    kv = (kv_a @ w[A + "kv_b_proj.weight"].T).view(T, H, nope + vd)
    k = torch.cat([kv[..., :nope], k_pe.expand(T, H, rope_d)], -1)
    v = kv[..., nope:]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, H * vd) @ w[A + "o_proj.weight"].T
    h, residual = rmsnorm(attn, w[L + "post_attention_layernorm.weight"], eps, residual)
    gate, up = (h @ w[L + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
    h = (torch.nn.functional.silu(gate) * up) @ w[L + "mlp.down_proj.weight"].T
    to_logits, to_aux = rmsnorm(h, w["norm.weight"], eps, residual)
    return to_logits @ w["lm_head.weight"].T, (to_logits if norm_output else to_aux)


# ---- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fc_norm,norm_output", [(False, False), (True, True), (True, False)])
def test_forward_equals_sglang_equations(fc_norm, norm_output):
    model, cfg = make_model(fc_norm=fc_norm, norm_output=norm_output)
    torch.manual_seed(1)
    T = 11
    ids = torch.randint(0, cfg["vocab_size"], (2, T))
    aux = torch.randn(2, T, 3 * cfg["hidden_size"])
    positions = torch.arange(T) + 5  # a non-zero start exercises the cache indexing
    with torch.no_grad():
        logits, state = model(ids, aux, position_ids=positions.unsqueeze(0))
        for b in range(2):
            ref_logits, ref_state = reference_forward(model, cfg, ids[b], aux[b], positions, norm_output=norm_output)
            torch.testing.assert_close(logits[b], ref_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state[b], ref_state, rtol=1e-5, atol=1e-5)
    assert logits.shape == (2, T, cfg["draft_vocab_size"]) and state.shape == (2, T, cfg["hidden_size"])


def test_ttt_step_attends_like_specforge():
    """Step 1 of SpecForge's TTT: query t (rotated at t+1) sees step-0 keys <= t and its own
    step-1 key (rotated at t+1); explicit per-token reference."""
    model, _ = make_model()
    torch.manual_seed(2)
    T = 6
    ids0, ids1 = torch.randint(0, 300, (1, T)), torch.randint(0, 300, (1, T))
    aux = torch.randn(1, T, 3 * 64)
    pos = torch.arange(T).unsqueeze(0)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    attn = model.midlayer.self_attn
    with torch.no_grad():
        h0 = model.project_hidden_states(aux)
        cache = [[], []]
        out0 = model.backbone(model.embed_input_ids(ids0), h0, cache, mask, pos)
        # step 0 with a cache equals the cache-free causal pass
        torch.testing.assert_close(
            out0, model.backbone(model.embed_input_ids(ids0), h0, None, None, pos), rtol=1e-5, atol=1e-5
        )
        out1 = model.backbone(model.embed_input_ids(ids1), out0, cache, mask, pos)

        def qkv(layer_in_emb, layer_in_h, positions):
            L = model.midlayer
            x = torch.cat([L.input_layernorm(layer_in_emb), L.hidden_norm(layer_in_h)], -1)
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, 4, -1)
            lat = attn.kv_a_proj_with_mqa(x)
            kv = attn.kv_b_proj(attn.kv_a_layernorm(lat[..., :16])).view(1, T, 4, -1)
            q_pe = attn.rope.apply(q[..., 16:], positions)
            k_pe = attn.rope.apply(lat[..., 16:].unsqueeze(2), positions).expand(-1, -1, 4, -1)
            return torch.cat([q[..., :16], q_pe], -1), torch.cat([kv[..., :16], k_pe], -1), kv[..., 16:]

        _, k0, v0 = qkv(model.embed_input_ids(ids0), h0, pos)
        q1, k1, v1 = qkv(model.embed_input_ids(ids1), out0, pos + 1)
        rows = []
        for t in range(T):
            keys = torch.cat([k0[0, : t + 1], k1[0, t : t + 1]], 0)  # [t+2, H, d]
            vals = torch.cat([v0[0, : t + 1], v1[0, t : t + 1]], 0)
            p = (torch.einsum("hd,khd->hk", q1[0, t], keys) * attn.scaling).softmax(-1)
            rows.append(torch.einsum("hk,khd->hd", p, vals).reshape(-1))
        a = attn.o_proj(torch.stack(rows)[None])
        residual = a + out0
        ref = model.midlayer.mlp(model.midlayer.post_attention_layernorm(residual)) + residual
        torch.testing.assert_close(out1, ref, rtol=1e-5, atol=1e-5)


def test_k25_rope_scale_and_softmax_scale():
    cfg = m.KimiMLAEagle3Config.from_dict(m.k25_default_config())
    rope = m.rope_settings(cfg)
    # factor 64, mscale = mscale_all_dim = 1: cos/sin unscaled, softmax scale x (1 + 0.1 ln 64)^2
    assert rope.cos_sin_scale == pytest.approx(1.0)
    assert rope.softmax_scale == pytest.approx(192**-0.5 * (1 + 0.1 * math.log(64)) ** 2)
    assert rope.interleaved and rope.rope_dim == 64
    ref_cache, ref_scaling = sglang_cos_sin_cache({**m.k25_default_config(), "fc_norm": False})
    pos = torch.tensor([0, 1, 4095, 4096, 100000, 262143])
    freqs = pos.float()[:, None] * rope.inv_freq()
    torch.testing.assert_close(torch.cat([freqs.cos(), freqs.sin()], -1), ref_cache[pos])
    assert rope.softmax_scale == pytest.approx(ref_scaling)


def test_plain_rope_and_bad_rope():
    model, _ = make_model(rope=None)
    assert model.midlayer.self_attn.scaling == pytest.approx(24**-0.5)
    assert model.midlayer.self_attn.rope.cos_sin_scale == 1.0
    with pytest.raises(Exception, match="rope_type"):
        make_model(rope={"type": "linear", "factor": 2.0})


def test_k25_default_config_shapes():
    cfg = m.k25_default_config(draft_vocab_size=32000)
    assert cfg["architectures"] == [m.ARCH] and cfg["model_type"] == "kimi_k2"
    assert (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["q_lora_rank"],
        cfg["kv_lora_rank"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["vocab_size"],
    ) == (7168, 64, 1536, 512, 128, 64, 128, 163840)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    with torch.device("meta"):  # shapes only, no 1.5 GB of weights
        model = m.Eagle3DeepseekV2ForCausalLM(m.KimiMLAEagle3Config.from_dict(cfg))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["fc.weight"] == (7168, 3 * 7168)
    assert shapes["midlayer.self_attn.q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 2 * 7168)
    assert shapes["midlayer.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    assert shapes["midlayer.self_attn.kv_b_proj.weight"] == (64 * 256, 512)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (7168, 64 * 128)
    assert shapes["midlayer.mlp.gate_proj.weight"] == (18432, 7168)
    assert shapes["lm_head.weight"] == (32000, 7168)
    assert shapes["d2t"] == (32000,) and shapes["t2d"] == (163840,)


def test_tiny_config_matches_tiny_target():
    from specforge_kimi.targets.tiny import TinySpec, text_config

    spec = TinySpec(layers=8, hidden=64, heads=8, q_lora_rank=64, dense_intermediate=128)
    cfg = m.tiny_config(spec, draft_vocab_size=100)
    text = text_config(spec)
    for key in (
        "hidden_size",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "vocab_size",
        "rope_theta",
        "rms_norm_eps",
    ):
        assert cfg[key] == text[key], key
    assert cfg["rope_scaling"] == text["rope_scaling"]
    # SGLang's default [2, L//2, L-3] for L=8, as SpecForge ids (first id 1 -> +1 shift)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["intermediate_size"] == 128 and cfg["draft_vocab_size"] == 100


def test_with_vocab_mapping(tmp_path):
    t2d = torch.zeros(300, dtype=torch.bool)
    used = torch.tensor([0, 5, 7, 299])
    t2d[used] = True
    d2t = used - torch.arange(4)
    torch.save({"d2t": d2t, "t2d": t2d}, tmp_path / "vm.pt")
    cfg = m._base_config(**SMALL, rope_scaling=ROPE, fc_norm=False, norm_output=False)
    assert m.with_vocab_mapping(cfg, tmp_path / "vm.pt")["draft_vocab_size"] == 4
    with pytest.raises(Exception, match="vocab_size"):
        m.with_vocab_mapping({**cfg, "vocab_size": 301}, tmp_path / "vm.pt")


def test_refuses_other_attention_backends():
    cfg = m.KimiMLAEagle3Config.from_dict(m._base_config(**SMALL, rope_scaling=ROPE, fc_norm=False, norm_output=False))
    with pytest.raises(ValueError, match="sdpa"):
        m.Eagle3DeepseekV2ForCausalLM(cfg, attention_backend="flex_attention")


def test_registration_is_explicit_and_idempotent():
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.modeling.draft.registry import DRAFT_REGISTRY

    from specforge_kimi.registration import register_all

    register_all()
    m.register_mla_draft()  # twice is a no-op
    assert DRAFT_REGISTRY[m.ARCH] is m.Eagle3DeepseekV2ForCausalLM
    eagle3 = builtin_algorithm_registry().resolve("eagle3")
    assert {m.ARCH, "LlamaForCausalLMEagle3"} <= set(eagle3.spec.draft.compatible_architectures)
    assert eagle3.spec.draft.default_architecture == "LlamaForCausalLMEagle3"
    dcp = eagle3.providers.model.draft_config
    assert m.ARCH in dcp.compatible_architectures and dcp.architecture == "LlamaForCausalLMEagle3"
