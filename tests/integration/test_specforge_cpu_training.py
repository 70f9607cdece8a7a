"""SpecForge 0.2.0's own offline EAGLE-3 trainer, in-process on the CPU, on a tiny fixture.

The fixture is what the trainer reads and nothing more: a DeepSeek-V3-shaped ``config.json``
(hidden 64, vocab 1000, 4 layers), a ``model.safetensors.index.json`` + one shard holding only
``model.embed_tokens.weight`` and ``lm_head.weight``, 16 offline feature ``.ckpt`` files (64
tokens each), a one-layer ``LlamaForCausalLMEagle3`` draft config (draft vocab 256) and a vocab
mapping built with SpecForge's own builder. The token streams follow a fixed permutation of 64
ids and the final hidden state points at the next token's ``lm_head`` row, so the teacher is
peaked and the draft has something to learn in 30 steps.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytestmark = pytest.mark.slow

HIDDEN = 64
VOCAB = 1000
DRAFT_VOCAB = 256
SEQ_LEN = 64
NUM_FILES = 16
USED_TOKENS = 64
MAX_STEPS = 30
TTT_LENGTH = 3
EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def build_fixture(root: str, *, seed: int = 0) -> dict:
    from specforge_kimi.training.offline import build_specforge_vocab_mapping

    g = torch.Generator().manual_seed(seed)
    target_dir = os.path.join(root, "target")
    os.makedirs(target_dir)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "vocab_size": VOCAB,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(target_dir, "config.json"), "w") as f:
        json.dump(config, f)
    embed = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    head = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    shard = "model-00001-of-00001.safetensors"
    save_file({EMBED_KEY: embed, HEAD_KEY: head}, os.path.join(target_dir, shard))
    with open(os.path.join(target_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {EMBED_KEY: shard, HEAD_KEY: shard}}, f)

    features_dir = os.path.join(root, "features")
    os.makedirs(features_dir)
    successor = torch.randperm(USED_TOKENS, generator=g)
    unit_head = head.float() / head.float().norm(dim=-1, keepdim=True)
    for index in range(NUM_FILES):
        ids = torch.empty(SEQ_LEN, dtype=torch.long)
        ids[0] = torch.randint(0, USED_TOKENS, (1,), generator=g)
        for t in range(1, SEQ_LEN):
            ids[t] = successor[ids[t - 1]]
        next_ids = torch.cat([ids[1:], successor[ids[-1:]]])
        # final (post-norm) hidden state at t predicts token t+1
        last = 1.5 * unit_head[next_ids] + 0.05 * torch.randn(SEQ_LEN, HIDDEN, generator=g)
        low = embed.float()[ids] + 0.1 * torch.randn(SEQ_LEN, HIDDEN, generator=g)
        mid = torch.randn(SEQ_LEN, HIDDEN, generator=g)
        aux = torch.cat([low, mid, last], dim=-1)
        loss_mask = torch.ones(SEQ_LEN, dtype=torch.long)
        loss_mask[:4] = 0  # a "prompt"
        torch.save(
            {
                "input_ids": ids,
                "loss_mask": loss_mask,
                "hidden_state": last.to(torch.bfloat16).unsqueeze(0),
                "aux_hidden_state": aux.to(torch.bfloat16).unsqueeze(0),
            },
            os.path.join(features_dir, f"data_{index:03d}.ckpt"),
        )

    draft_config_path = os.path.join(root, "draft_config.json")
    with open(draft_config_path, "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": HIDDEN // 4,
                "intermediate_size": 128,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 2048,
                "rope_theta": 10000.0,
                "vocab_size": VOCAB,
                "draft_vocab_size": DRAFT_VOCAB,
                "pad_token_id": 0,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
            },
            f,
        )
    vocab_mapping_path = build_specforge_vocab_mapping(
        features_dir,
        os.path.join(root, "vocab_mapping.pt"),
        draft_vocab_size=DRAFT_VOCAB,
        target_vocab_size=VOCAB,
        max_length=SEQ_LEN,
    )
    return {
        "target_dir": target_dir,
        "hidden_states_path": features_dir,
        "draft_config_path": draft_config_path,
        "vocab_mapping_path": vocab_mapping_path,
    }


def test_specforge_offline_eagle3_training_on_cpu(tmp_path):
    from specforge.config import load_config

    from specforge_kimi.drafts.export import export_sglang
    from specforge_kimi.training.offline import train_offline

    fixture = build_fixture(str(tmp_path / "fixture"))
    dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FSDP_SHARDING")
    env_before = {key: os.environ.get(key) for key in dist_env}
    started = time.perf_counter()
    result = train_offline(
        **fixture,
        output_dir=str(tmp_path / "run"),
        max_steps=MAX_STEPS,
        ttt_length=TTT_LENGTH,
        learning_rate=1e-3,
        max_length=SEQ_LEN,
        seed=0,
        embedding_key=EMBED_KEY,
        lm_head_key=HEAD_KEY,
    )
    train_s = time.perf_counter() - started

    assert result["final_step"] == MAX_STEPS
    losses = result["losses"]
    assert result["steps"] == list(range(1, MAX_STEPS + 1))
    assert len(losses) == MAX_STEPS
    assert all(isinstance(x, float) and x == x for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, f"loss did not go down: first5={first:.4f} last5={last:.4f}"
    assert len(result["acc_per_position"]) == MAX_STEPS
    assert all(len(row) == TTT_LENGTH for row in result["acc_per_position"])
    assert all(len(row) == TTT_LENGTH for row in result["ploss_per_position"])
    assert result["cpu_shims"] == (not torch.cuda.is_available())

    # the run config is a valid ``specforge train -c`` file
    cfg = load_config(result["config_path"])
    assert cfg.mode == "offline" and cfg.training.strategy == "eagle3"
    assert cfg.deployment.mode == "local_colocated"
    if not torch.cuda.is_available():
        assert cfg.training.fsdp_sharding == "NO_SHARD"
    # the distributed env SpecForge's CLI path sets is restored, its process group torn down
    assert {key: os.environ.get(key) for key in dist_env} == env_before
    assert not torch.distributed.is_initialized()

    checkpoint_dir = result["checkpoint_dir"]
    assert os.path.basename(checkpoint_dir) == f"specforge-kimi-offline-step{MAX_STEPS}"
    assert os.path.isfile(os.path.join(checkpoint_dir, "training_state.pt"))
    assert os.path.isfile(os.path.join(checkpoint_dir, "training_state_rank0.pt"))

    export_dir = export_sglang(
        checkpoint_dir,
        fixture["draft_config_path"],
        str(tmp_path / "export"),
        fixture["vocab_mapping_path"],
    )
    with open(os.path.join(export_dir, "config.json")) as f:
        exported_config = json.load(f)
    assert exported_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert exported_config["draft_vocab_size"] == DRAFT_VOCAB
    shards = [name for name in os.listdir(export_dir) if name.endswith(".safetensors")]
    assert shards
    keys, tensors = set(), {}
    for shard in shards:
        with safe_open(os.path.join(export_dir, shard), framework="pt") as f:
            for key in f.keys():
                keys.add(key)
                tensors[key] = f.get_tensor(key)
    for required in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
        assert required in keys
    assert any(key.startswith("midlayer.") for key in keys)
    assert not any("embed" in key for key in keys)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    mapping = torch.load(fixture["vocab_mapping_path"])
    assert torch.equal(tensors["d2t"], mapping["d2t"])
    assert torch.equal(tensors["t2d"], mapping["t2d"])
    print(
        f"\ntrain_offline {train_s:.1f}s (SpecForge fit {result['wall_time_s']:.1f}s); "
        f"loss first5={first:.3f} last5={last:.3f}; "
        f"acc last step {result['acc_per_position'][-1]}"
    )
