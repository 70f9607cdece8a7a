"""SpecForge 0.2.0's own ``eagle3`` trainer trains the MLA draft, in-process on the CPU.

Same path as ``test_specforge_cpu_training.py`` (``offline_train.train_offline``: ``specforge
train -c`` in-process, ``training.strategy: eagle3``, sdpa, DDP/gloo with ``NO_SHARD``), with a
draft config naming ``Eagle3DeepseekV2ForCausalLM``; only :func:`specforge_kimi.register`
makes SpecForge accept it. The fixture is a DeepSeek-V3-shaped target stub (embedding + head
only, which is all offline training reads) and 12 feature files whose final hidden state points
at the next token's head row, so the loss has something to fall to. The checkpoint SpecForge
writes is then exported for both engines and by SpecForge's own ``export --to sglang``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.slow

HIDDEN, VOCAB, DRAFT_VOCAB, SEQ_LEN, NUM_FILES, USED, TARGET_LAYERS = 64, 1000, 128, 48, 12, 48, 6
EMBED_KEY, HEAD_KEY = "model.embed_tokens.weight", "lm_head.weight"
MAX_STEPS, TTT = 24, 3


def build_fixture(root: str) -> dict:
    from specforge_kimi.drafts.mla_eagle3 import _base_config, write_config
    from specforge_kimi.training.offline import build_specforge_vocab_mapping

    g = torch.Generator().manual_seed(0)
    target = os.path.join(root, "target")
    os.makedirs(target)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "hidden_size": HIDDEN,
                "vocab_size": VOCAB,
                "num_hidden_layers": TARGET_LAYERS,
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
            },
            f,
        )
    embed = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    head = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    shard = "model-00001-of-00001.safetensors"
    save_file({EMBED_KEY: embed, HEAD_KEY: head}, os.path.join(target, shard))
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {EMBED_KEY: shard, HEAD_KEY: shard}}, f)

    features = os.path.join(root, "features")
    os.makedirs(features)
    successor = torch.randperm(USED, generator=g)
    unit_head = head.float() / head.float().norm(dim=-1, keepdim=True)
    for index in range(NUM_FILES):
        ids = torch.empty(SEQ_LEN, dtype=torch.long)
        ids[0] = torch.randint(0, USED, (1,), generator=g)
        for t in range(1, SEQ_LEN):
            ids[t] = successor[ids[t - 1]]
        next_ids = torch.cat([ids[1:], successor[ids[-1:]]])
        last = 1.5 * unit_head[next_ids] + 0.05 * torch.randn(SEQ_LEN, HIDDEN, generator=g)
        low = embed.float()[ids] + 0.1 * torch.randn(SEQ_LEN, HIDDEN, generator=g)
        aux = torch.cat([low, torch.randn(SEQ_LEN, HIDDEN, generator=g), last], dim=-1)
        mask = torch.ones(SEQ_LEN, dtype=torch.long)
        mask[:4] = 0
        # fp32 features: offline_train's CPU runs train in fp32 (features carry the dtype)
        torch.save(
            {
                "input_ids": ids,
                "loss_mask": mask,
                "hidden_state": last.to(torch.bfloat16).unsqueeze(0),
                "aux_hidden_state": aux.to(torch.bfloat16).unsqueeze(0),
            },
            os.path.join(features, f"data_{index:03d}.ckpt"),
        )

    draft = _base_config(
        hidden=HIDDEN,
        heads=4,
        intermediate=128,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        aux_ids=[1, 2, 3],
        rope_scaling={
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_theta=50000.0,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        fc_norm=True,
        norm_output=True,
    )
    draft_path = write_config(draft, os.path.join(root, "draft_config.json"))
    vm = build_specforge_vocab_mapping(
        features,
        os.path.join(root, "vocab_mapping.pt"),
        draft_vocab_size=DRAFT_VOCAB,
        target_vocab_size=VOCAB,
        max_length=SEQ_LEN,
    )
    return {
        "target_dir": target,
        "hidden_states_path": features,
        "draft_config_path": draft_path,
        "vocab_mapping_path": vm,
    }


def test_specforge_trains_and_exports_the_mla_draft(tmp_path):
    from specforge_kimi import register
    from specforge_kimi.drafts import export_engines as ex
    from specforge_kimi.drafts.export import export_sglang
    from specforge_kimi.training.offline import train_offline

    register()
    fixture = build_fixture(str(tmp_path / "fixture"))
    result = train_offline(
        **fixture,
        output_dir=str(tmp_path / "run"),
        max_steps=MAX_STEPS,
        ttt_length=TTT,
        learning_rate=2e-3,
        max_length=SEQ_LEN,
        seed=0,
        embedding_key=EMBED_KEY,
        lm_head_key=HEAD_KEY,
    )
    losses = result["losses"]
    assert result["final_step"] == MAX_STEPS and len(losses) == MAX_STEPS
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, f"loss did not go down: {first:.4f} -> {last:.4f}"
    assert all(len(row) == TTT for row in result["acc_per_position"])

    # SpecForge checkpointed our architecture's weights (no embedding: frozen target copy)
    state = torch.load(os.path.join(result["checkpoint_dir"], "training_state.pt"), weights_only=False)
    keys = set(state["draft_state_dict"])
    assert "midlayer.self_attn.kv_a_proj_with_mqa.weight" in keys and "fc_norm.2.weight" in keys
    assert not any("embed" in k for k in keys)

    for engine in ("sglang", "vllm"):
        out = tmp_path / f"export-{engine}"
        prov = ex.export_draft(
            result["checkpoint_dir"],
            fixture["draft_config_path"],
            out,
            engine=engine,
            num_layers=TARGET_LAYERS,
            vocab_mapping_path=fixture["vocab_mapping_path"],
        )
        assert prov["aux_layers"]["engine_ids"] == [2, 3, 4]
        model = ex.load_exported_draft(out)
        assert model.norm_output and model.fc_norm is not None

    # SpecForge's own exporter handles the architecture too (identity names, midlayer.*)
    sf_out = export_sglang(
        result["checkpoint_dir"],
        fixture["draft_config_path"],
        str(tmp_path / "sf-export"),
        fixture["vocab_mapping_path"],
    )
    with open(os.path.join(sf_out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "kimi_k2"

    # a run's export (launch / train-offline) takes the MLA path: SGLang's layers.0.* layout, captured
    # positions as ids; aux ids other than the draft was trained on are refused
    from safetensors import safe_open

    from specforge_kimi.drafts.export import export_run_draft
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.targets.layer_ids import AuxLayers

    # (the fixture's target is an embedding/head stub, which the target check would refuse)
    run_out = export_run_draft(
        result["checkpoint_dir"],
        fixture["draft_config_path"],
        tmp_path / "run-export",
        vocab_mapping_path=fixture["vocab_mapping_path"],
        target_dir=None,
        aux=AuxLayers.from_specforge([1, 2, 3], TARGET_LAYERS),
    )
    with safe_open(str(run_out / ex.WEIGHTS_FILE), framework="pt") as f:
        names = set(f.keys())
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in names and not any(n.startswith("midlayer.") for n in names)
    with open(run_out / "config.json") as f:
        assert json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    with pytest.raises(KimiInputError, match="other layers"):
        export_run_draft(
            result["checkpoint_dir"],
            fixture["draft_config_path"],
            tmp_path / "bad-export",
            vocab_mapping_path=fixture["vocab_mapping_path"],
            target_dir=None,
            aux=AuxLayers.from_specforge([1, 2, 4], TARGET_LAYERS),
        )
