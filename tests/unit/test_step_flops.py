"""``training.step_flops``: hand-counted small configs, and SpecForge's own step counted by FlopCounterMode.

The hand counts are written out term by term (not computed by the module's code); the FlopCounterMode test
runs the pinned SpecForge eagle3 step (``Eagle3TrainStrategy.forward_loss`` -> ``TargetHead`` ->
``OnlineEagle3Model`` with the Llama draft, sdpa path, then ``backward``) and our MLA draft on a tiny
config and compares the counted matmul FLOPs with the model's ``attention="sdpa"`` total.
"""

import pytest
from eagle3_cpu import MLA_H16 as MLA
from eagle3_cpu import eagle3_step, mla_draft

from specforge_kimi.training.step_flops import TERMS, attention_pairs, draft_shape, step_flops

# H 16, 4 heads / 2 KV heads of 8 (heads x dim 32 != H on purpose), MLP 24, draft vocab 12
LLAMA = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 1,
    "vocab_size": 40,
    "draft_vocab_size": 12,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "pad_token_id": 0,
    "hidden_act": "silu",
}


def test_llama_hand_count_L10_T3_useful():
    # L = 10 tokens, T = 3, target vocab 40, target hidden = 16
    fc = 2 * 10 * 48 * 16  # [10, 3*16] x [48, 16] = 15,360
    # q: 32 wide from 2H = 32; k, v: 16 wide each; o: 32 -> 16
    proj = 3 * 2 * 10 * (32 * 32 + 32 * 16 + 32 * 16 + 32 * 16)  # 3 steps x 20 x 2,560 = 153,600
    # useful pairs: step 0: 10*11/2 = 55; step 1: 9*10/2 + 1*9 = 54; step 2: 8*9/2 + 2*8 = 52 -> 161
    core = 2 * 4 * (8 + 8) * 161  # 20,608
    mlp = 3 * 3 * 2 * 10 * 16 * 24  # 69,120
    head = 3 * 2 * 10 * 16 * 12  # 11,520
    teacher = 2 * 10 * 16 * 40  # 12,800
    f = step_flops(LLAMA, length=10, ttt_length=3, target_vocab=40)
    assert f.forward == {
        "fc": 15_360,
        "attn_proj": 153_600,
        "attn_core": 20_608,
        "mlp": 69_120,
        "draft_head": 11_520,
        "target_head": 12_800,
        "loss_softmax": 0,
        "embedding": 0,
    }
    assert (fc, proj, core, mlp, head, teacher) == (15_360, 153_600, 20_608, 69_120, 11_520, 12_800)
    assert f.backward == {
        "fc": 15_360,  # weight grad only
        "attn_proj": 307_200,
        "attn_core": 41_216,
        "mlp": 138_240,
        "draft_head": 23_040,
        "target_head": 0,
        "loss_softmax": 0,
        "embedding": 0,
    }
    total = 2 * 15_360 + 3 * (153_600 + 20_608 + 69_120 + 11_520) + 12_800  # 30,720 + 764,544 + 12,800
    assert f.total == total == 808_064
    assert f.per_token == pytest.approx(80_806.4)
    assert set(f.by_term) == set(TERMS)


def test_attention_pairs_by_mode():
    # sdpa: dense L^2 whatever the step
    assert [attention_pairs(10, k, "sdpa") for k in range(3)] == [100, 100, 100]
    # flex, block 4, L 10: step 0 -> nb 3, 6 causal tiles = 96; step 1 -> nb 3 (9 rows), 6 + 3 = 144;
    # step 2 -> nb 2 (8 rows), 3 + 4 = 7 tiles = 112
    assert [attention_pairs(10, k, "flex", block=4) for k in range(3)] == [96, 144, 112]
    assert attention_pairs(4096, 0, "useful") == 4096 * 4097 // 2
    with pytest.raises(ValueError):
        attention_pairs(10, 0, "dense")


def test_flex_backward_recomputes_scores():
    f = step_flops(LLAMA, length=10, ttt_length=3, target_vocab=40, attention="flex", block=4)
    # pairs 96 + 144 + 112 = 352; fwd 2 * 4 * 16 * 352 = 45,056; bwd 2.5x = 112,640
    assert f.forward["attn_core"] == 45_056 and f.backward["attn_core"] == 112_640


def test_mla_hand_count_L6_T2_sdpa():
    s = draft_shape(MLA)
    assert (s.kind, s.qk_dim, s.v_dim, s.num_aux) == ("mla", 12, 6, 3)
    # per token per step: q_a 32x6 = 192; q_b 6 x 2*12 = 144; kv_a 32 x (4+4) = 256; kv_b 4 x 2*(8+6) = 112;
    # o 2*6 x 16 = 192 -> 896 multiply-adds
    proj = 2 * 2 * 6 * 896  # 2 steps -> 21,504
    core = 2 * 2 * (12 + 6) * (36 + 36)  # dense 6x6 per step -> 5,184
    mlp = 2 * 3 * 2 * 6 * 16 * 24  # 27,648
    head = 2 * 2 * 6 * 16 * 12  # 4,608
    fc = 2 * 6 * 48 * 16  # 9,216
    teacher = 2 * 6 * 16 * 40  # 7,680
    f = step_flops(MLA, length=6, ttt_length=2, target_vocab=40, attention="sdpa")
    assert [f.forward[t] for t in ("fc", "attn_proj", "attn_core", "mlp", "draft_head", "target_head")] == [
        fc,
        proj,
        core,
        mlp,
        head,
        teacher,
    ]
    assert f.total == 2 * fc + 3 * (proj + core + mlp + head) + teacher == 202_944  # 18,432 + 176,832 + 7,680


def test_b200_recipe_numbers():
    from pathlib import Path

    from specforge_kimi.plan.run_plan import load_recipe
    from specforge_kimi.training.step_flops import recipe_step_flops

    r = load_recipe(Path(__file__).resolve().parents[2] / "recipes/kimi-k25-8xb200-lowered.yaml")
    f = recipe_step_flops(r, length=4096)
    # 6 x the decoder-layer + draft-head weights x 7 steps dominates: q 14336x7168, k/v 14336x1024 each,
    # o 7168x7168, MLP 3 x 7168 x 18432, head 7168 x 32000
    per_step_params = 14336 * 7168 + 2 * 14336 * 1024 + 7168 * 7168 + 3 * 7168 * 18432 + 7168 * 32000
    dense = 6 * 7 * per_step_params + 4 * 3 * 7168 * 7168 + 2 * 7168 * 163840
    assert f.per_token - f.by_term["attn_core"] / 4096 == pytest.approx(dense)
    assert f.by_term["target_head"] / 4096 == 2 * 7168 * 163840


def _counted(run) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


@pytest.mark.slow
def test_flop_counter_on_specforge_llama_step_equals_the_model(cpu_shims):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    draft = LlamaForCausalLMEagle3(LlamaConfig(**LLAMA), attention_backend="sdpa")
    counted = _counted(eagle3_step(draft, length=10, ttt=3, vocab=40, target_hidden=16))
    f = step_flops(LLAMA, length=10, ttt_length=3, target_vocab=40, attention="sdpa")
    assert counted == f.total


@pytest.mark.slow
def test_flop_counter_on_mla_step_equals_the_model(cpu_shims):
    draft = mla_draft()
    counted = _counted(eagle3_step(draft, length=6, ttt=2, vocab=40, target_hidden=16))
    f = step_flops(MLA, length=6, ttt_length=2, target_vocab=40, attention="sdpa")
    assert counted == f.total


def _block_recipe(layers: int | None = None):
    """The tiny DFlash recipe (h 512, 8/8 heads of 64, MLP 2048, 1 layer, 5 captured layers, 512 anchors x block 8,
    target vocab 163840, max_length 1024), with ``layers`` draft layers."""
    from pathlib import Path

    from specforge_kimi.plan.run_plan import load_recipe

    r = load_recipe(Path(__file__).resolve().parents[2] / "recipes/tiny-k25-tp1-h200-dflash.yaml")
    if layers is None:
        return r
    draft = r.trainer.draft.model_copy(update={"num_hidden_layers": layers})
    return r.model_copy(update={"trainer": r.trainer.model_copy(update={"draft": draft})})


def test_block_draft_train_flops_hand_count():
    from specforge_kimi.training.step_flops import train_flops_per_token

    # S = 1024: 512 anchors x 8 / 1024 = 4 queries per token; attention 4 x 512 keys x 8 x 64 = 1,048,576 per query
    # a query: q and o 2 x 512 x 512, noise k/v 2 x 512 x 512, MLP 3 x 512 x 2048 = 4,194,304; context k/v 524,288
    layers = 4 * (6 * 4_194_304 + 3 * 1_048_576) + 6 * 524_288  # 116,391,936
    fc = 6 * 5 * 512 * 512  # 7,864,320
    head = 4 * 4 * 163_840 * 512  # frozen head + its input's gradient on 4 queries: 1,342,177,280
    f = train_flops_per_token(_block_recipe())
    assert f == {"fc": fc, "layers": layers, "draft_head": 0.0, "target_head": head, "total": fc + layers + head}
    assert f["total"] == 1_466_433_536
    # 32 tokens: the anchors are capped at the sample, 32 x 8 / 32 = 8 queries per token, 16 keys on average
    short = train_flops_per_token(_block_recipe(), length=32)
    assert short["target_head"] == 8 * 4 * 163_840 * 512
    assert short["layers"] == 8 * (6 * 4_194_304 + 3 * 4 * 16 * 8 * 64) + 6 * 524_288


def test_block_draft_train_flops_layer_term_scales_with_the_draft_layers():
    from specforge_kimi.training.step_flops import train_flops_per_token

    one, two = train_flops_per_token(_block_recipe()), train_flops_per_token(_block_recipe(layers=2))
    assert two["layers"] == 2 * one["layers"]
    assert (two["fc"], two["target_head"], two["draft_head"]) == (one["fc"], one["target_head"], one["draft_head"])
    assert two["total"] == one["total"] + one["layers"]
