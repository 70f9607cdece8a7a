"""Per-engine exports of the MLA and Llama-style EAGLE-3 drafts: names, ids, configs, provenance.

Each export is run end to end from a SpecForge-shaped ``training_state.pt`` (``strategy:
eagle3``, ``draft_state_dict`` without the embedding -- what SpecForge's checkpoint manager
writes) through SpecForge's own ``materialize_draft``. The engines' loaders are mirrored here
from their source (SGLang 0.5.14 ``kimi_k25_eagle3.py`` / ``llama_eagle3.py``; vLLM
``deepseek_eagle3.py`` / ``llama_eagle3.py``, commits in ``export_engines``' docstring): every
exported key must land on a parameter of the engine's module, and every such parameter except
the shared embedding must be filled.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from specforge_kimi.drafts import export_engines as ex
from specforge_kimi.drafts import mla_eagle3 as m
from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import AuxLayers

NUM_LAYERS = 61
MLA_SMALL = dict(
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
    aux_ids=[1, 29, 57],
    rope_theta=50000.0,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    pad_token_id=0,
)
ROPE = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
LLAMA = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 50000.0,
    "vocab_size": 300,
    "draft_vocab_size": 40,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from specforge_kimi import register

    register()


def _vocab_mapping(path, vocab=300, draft=40):
    g = torch.Generator().manual_seed(0)
    used = torch.randperm(vocab, generator=g)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    torch.save({"d2t": used - torch.arange(draft), "t2d": t2d}, path)
    return str(path)


def _checkpoint(tmp_path, config: dict, *, fc_norm=False):
    """A SpecForge-shaped eagle3 checkpoint with random weights; returns (paths, trained state)."""
    cfg_path = tmp_path / "draft.json"
    cfg_path.write_text(json.dumps(config))
    vm = _vocab_mapping(tmp_path / "vm.pt")
    if config["architectures"] == [m.ARCH]:
        model = m.Eagle3DeepseekV2ForCausalLM(m.KimiMLAEagle3Config.from_dict(config))
    else:
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from transformers import LlamaConfig

        model = LlamaForCausalLMEagle3(LlamaConfig.from_dict(config))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.load_vocab_mapping(vm)
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k}
    step = tmp_path / "run" / "specforge-kimi-offline-step3"
    step.mkdir(parents=True)
    torch.save({"strategy": "eagle3", "global_step": 3, "draft_state_dict": state}, step / "training_state.pt")
    return {"checkpoint": str(step), "draft_config_path": str(cfg_path), "vocab_mapping_path": vm}, state


def _mla_config(**kw):
    return m._base_config(
        **{**MLA_SMALL, **kw.pop("small", {})},
        rope_scaling=ROPE,
        fc_norm=kw.get("fc_norm", False),
        norm_output=kw.get("norm_output", False),
    )


# ---- what each engine's loader does with the names (mirrored from the source) ---------------
def sglang_mla_params(cfg) -> set[str]:
    """Eagle3DeepseekV2ForCausalLM.named_parameters() (kimi_k25_eagle3.py)."""
    a = "model.midlayer.self_attn."
    names = {
        "model.embed_tokens.weight",
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        a + "fused_qkv_a_proj_with_mqa.weight",
        a + "q_a_layernorm.weight",
        a + "q_b_proj.weight",
        a + "kv_a_layernorm.weight",
        a + "kv_b_proj.weight",
        a + "o_proj.weight",
        "model.midlayer.mlp.gate_up_proj.weight",
        "model.midlayer.mlp.down_proj.weight",
    }
    names |= {f"model.midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    if cfg["fc_norm"]:
        names |= {f"model.fc_norm.{i}.weight" for i in range(3)}
    return names


def sglang_mla_load(names) -> set[str]:
    """Eagle3DeepseekV2ForCausalLM.load_weights' renames; returns the parameters written."""
    out, pending = set(), set()
    for name in names:
        if name in ("d2t", "t2d"):
            continue
        mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
        if not mapped.startswith("lm_head."):
            mapped = "model." + mapped
        for w in (".gate_proj", ".up_proj"):
            if w in mapped:
                mapped = mapped.replace(w, ".gate_up_proj")
        if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
            pending.add(mapped)
            if len(pending) == 2:
                out.add(re.sub(r"(q_a_proj|kv_a_proj_with_mqa)", "fused_qkv_a_proj_with_mqa", mapped))
            continue
        out.add(mapped)
    return out


def vllm_mla_load(names) -> set[str]:
    """vLLM Eagle3DeepseekV2ForCausalLM.load_weights + hf_to_vllm_mapper."""
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add("draft_id_to_target_id")
            continue
        if "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for old, new in (
            (".gate_proj", ".gate_up_proj"),
            (".up_proj", ".gate_up_proj"),
            (".q_a_proj", ".fused_qkv_a_proj"),
            (".kv_a_proj_with_mqa", ".fused_qkv_a_proj"),
        ):
            name = name.replace(old, new)
        out.add(name)
    return out


def vllm_mla_params(cfg) -> set[str]:
    a = "model.layers.0.self_attn."
    names = {
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        "draft_id_to_target_id",
        a + "fused_qkv_a_proj.weight",
        a + "q_a_layernorm.weight",
        a + "q_b_proj.weight",
        a + "kv_a_layernorm.weight",
        a + "kv_b_proj.weight",
        a + "o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }
    names |= {f"model.layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    if cfg["fc_norm"]:
        names |= {f"model.fc_norm.{i}.weight" for i in range(3)}
    return names  # embed_tokens skipped by vLLM when absent


def llama_load(names, engine) -> set[str]:
    """SGLang / vLLM Llama EAGLE-3 loaders: midlayer -> layers.0, q/k/v and gate/up stacked."""
    out = set()
    for name in names:
        if "t2d" in name or "d2t" in name:
            continue
        name = name.replace("midlayer.", "layers.0.")
        for old, new in (
            (".q_proj", ".qkv_proj"),
            (".k_proj", ".qkv_proj"),
            (".v_proj", ".qkv_proj"),
            (".gate_proj", ".gate_up_proj"),
            (".up_proj", ".gate_up_proj"),
        ):
            name = name.replace(old, new)
        out.add(name if name.startswith("lm_head") else "model." + name)
    return out


def llama_params() -> set[str]:
    p = "model.layers.0."
    return {
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        p + "self_attn.qkv_proj.weight",
        p + "self_attn.o_proj.weight",
        p + "mlp.gate_up_proj.weight",
        p + "mlp.down_proj.weight",
        p + "input_layernorm.weight",
        p + "hidden_norm.weight",
        p + "post_attention_layernorm.weight",
    }


# ---- tests ----------------------------------------------------------------------------------
def test_layer_id_conversion_table():
    """SpecForge ids in the training config -> the ids each export writes (61-layer target)."""
    table = [  # specforge ids, captured positions, sglang ids, vllm ids
        ([1, 29, 57], [2, 30, 58], [2, 30, 58], [2, 30, 58]),  # SGLang shifts all when the first is 1
        ([2, 30, 58], [2, 30, 58], [2, 30, 58], [2, 30, 58]),  # ... and not otherwise
        ([3, 10, 20], [3, 10, 20], [3, 10, 20], [3, 10, 20]),
        ([1, 2, 3], [2, 3, 4], [2, 3, 4], [2, 3, 4]),
    ]
    cfg = _mla_config()
    for specforge, positions, sglang, vllm in table:
        aux = AuxLayers.from_specforge(specforge, NUM_LAYERS)
        assert list(aux.positions) == positions
        sg = ex.serving_config(cfg, "sglang", aux)
        vl = ex.serving_config(cfg, "vllm", aux)
        assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sglang
        assert "eagle_aux_hidden_state_layer_ids" not in sg
        assert vl["eagle_aux_hidden_state_layer_ids"] == vllm == vl["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        # reading the exported ids back with each engine's rule gives the same positions
        assert AuxLayers.from_sglang(sglang, NUM_LAYERS) == aux == AuxLayers.from_vllm(vllm, NUM_LAYERS)
    # vLLM ids starting at position 1 have no SGLang spelling (SGLang would shift id 1 to 2)
    with pytest.raises(KimiInputError, match="position 1"):
        ex.serving_config(cfg, "sglang", AuxLayers.from_vllm([1, 30, 58], NUM_LAYERS))
    assert ex.serving_config(cfg, "vllm", AuxLayers.from_vllm([1, 30, 58], NUM_LAYERS))[
        "eagle_aux_hidden_state_layer_ids"
    ] == [1, 30, 58]
    with pytest.raises(KimiInputError, match="2 aux layers"):
        ex.serving_config(cfg, "sglang", AuxLayers.from_specforge([2, 30], NUM_LAYERS))


@pytest.mark.parametrize("fc_norm", [False, True])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_mla_export_round_trip(tmp_path, engine, fc_norm):
    cfg = _mla_config(fc_norm=fc_norm, norm_output=fc_norm)
    paths, trained = _checkpoint(tmp_path, cfg)
    out = tmp_path / f"export-{engine}"
    prov = ex.export_draft(**paths, output_dir=out, engine=engine, num_layers=NUM_LAYERS, command=["test"])
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == ex.expected_keys(json.loads((out / "config.json").read_text()), engine)
    assert not any(k.startswith("midlayer.") or "embed" in k for k in exported)
    # the engine's loader fills every parameter but the (target-shared) embedding
    if engine == "sglang":
        assert sglang_mla_load(exported) == sglang_mla_params(cfg) - {"model.embed_tokens.weight"}
    else:
        assert vllm_mla_load(exported) == vllm_mla_params(cfg)
    # names and values round-trip into the training module (weights are exported bf16)
    reloaded = ex.load_exported_draft(out)
    for key, value in trained.items():
        got = reloaded.state_dict()[key]
        assert torch.equal(got, value.to(torch.bfloat16).to(got.dtype) if value.is_floating_point() else value), key
    assert reloaded.norm_output is fc_norm and (reloaded.fc_norm is not None) is fc_norm
    exported_cfg = json.loads((out / "config.json").read_text())
    assert exported_cfg["model_type"] == {"sglang": "kimi_k2", "vllm": "deepseek_v3"}[engine]
    assert exported_cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert exported_cfg["fc_norm"] is fc_norm and exported_cfg["norm_output"] is fc_norm
    # the engines build their config as DeepseekV3Config (SGLang: the kimi_k2 alias class)
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config.from_dict(exported_cfg)
    assert hf.rope_parameters["factor"] == 64.0 and hf.rope_parameters["rope_theta"] == 50000.0
    assert hf.q_lora_rank == 32 and hf.draft_vocab_size == 40 and hf.num_hidden_layers == 1
    assert prov["aux_layers"]["engine_ids"] == [2, 30, 58]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_llama_export_round_trip(tmp_path, engine):
    paths, trained = _checkpoint(tmp_path, dict(LLAMA))
    out = tmp_path / f"export-{engine}"
    ex.export_draft(**paths, output_dir=out, engine=engine, num_layers=NUM_LAYERS)
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    assert llama_load(exported, engine) == llama_params()
    assert any(k.startswith("midlayer.") for k in exported)
    reloaded = ex.load_exported_draft(out)
    for key, value in trained.items():
        got = reloaded.state_dict()[key]
        assert torch.equal(got, value.to(torch.bfloat16).to(got.dtype) if value.is_floating_point() else value), key
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    if engine == "sglang":
        # the repo's existing SGLang check agrees with this export
        from specforge_kimi.drafts.export import check_sglang_export

        assert check_sglang_export(out)["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    else:
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]


def test_llama_yarn_is_refused(tmp_path):
    cfg = {**LLAMA, "rope_scaling": dict(ROPE)}
    with pytest.raises(KimiInputError, match="YaRN"):
        ex.serving_config(cfg, "vllm", AuxLayers.from_specforge([1, 29, 57], NUM_LAYERS))


def test_llama_norm_output_is_refused():
    """SpecForge's Llama draft reads norm_output as "norm before lm_head" (default True), SGLang as
    "hand the normed state to the next step" (default False): only an absent key agrees."""
    for value in (True, False):
        with pytest.raises(KimiInputError, match="norm_output"):
            ex.serving_config(
                {**LLAMA, "norm_output": value}, "sglang", AuxLayers.from_specforge([1, 29, 57], NUM_LAYERS)
            )


def test_provenance(tmp_path):
    paths, _ = _checkpoint(tmp_path, _mla_config())
    prov = ex.export_draft(
        **paths,
        output_dir=tmp_path / "out",
        engine="sglang",
        num_layers=NUM_LAYERS,
        command=["specforge-kimi", "export"],
    )
    on_disk = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert on_disk == prov
    assert prov["command"] == ["specforge-kimi", "export"]
    assert prov["versions"]["specforge"] == "0.2.0" and prov["versions"]["torch"]
    assert "specforge_kimi_git_commit" in prov
    from specforge_kimi.provenance import canonical_hash, file_hash

    assert prov["config_sha256"] == canonical_hash(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert prov["weights_sha256"]["model.safetensors"] == file_hash(tmp_path / "out" / "model.safetensors")
    assert prov["patches_sha256"] and all(len(h) == 64 for h in prov["patches_sha256"].values())
    assert prov["aux_layers"] == {
        "specforge_ids": [1, 29, 57],
        "captured_positions": [2, 30, 58],
        "engine_ids": [2, 30, 58],
        "num_layers": NUM_LAYERS,
    }


def test_check_export_catches_a_stray_key(tmp_path):
    paths, _ = _checkpoint(tmp_path, _mla_config())
    out = tmp_path / "out"
    ex.export_draft(**paths, output_dir=out, engine="sglang", num_layers=NUM_LAYERS)
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state["model.fc.weight"] = state.pop("fc.weight")  # a prefix SGLang would map to model.model.fc
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(KimiInputError, match="unexpected"):
        ex.check_export(out, "sglang")


def test_unknown_engine_and_architecture():
    with pytest.raises(KimiInputError, match="engine"):
        ex.serving_config(_mla_config(), "trtllm", AuxLayers.from_specforge([1, 29, 57], NUM_LAYERS))
    with pytest.raises(KimiInputError, match="architectures"):
        ex.serving_config(
            {**LLAMA, "architectures": ["Foo"]}, "sglang", AuxLayers.from_specforge([1, 29, 57], NUM_LAYERS)
        )


# ---- the export directory is replaced whole ------------------------------------------------------
def _snapshot(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_crash_mid_export_leaves_the_old_export_whole(tmp_path, monkeypatch):
    """Issue 43: the export wrote weights, config.json and provenance in place, so a crash left new weights
    beside an old config. A crash part-way through the weights leaves the old export as it was; a finished
    export replaces it whole (a file only the old one had is gone)."""
    import safetensors.torch

    paths, _ = _checkpoint(tmp_path, _mla_config())
    out = tmp_path / "export"
    ex.export_draft(**paths, output_dir=out, engine="sglang", num_layers=NUM_LAYERS)
    (out / "old-only.txt").write_text("from the previous export")
    old = _snapshot(out)
    real_save = safetensors.torch.save_file

    def half_then_crash(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        ex.export_draft(**paths, output_dir=out, engine="vllm", num_layers=NUM_LAYERS)
    monkeypatch.undo()
    assert _snapshot(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.json", "export", "run", "vm.pt"]
    prov = ex.export_draft(**paths, output_dir=out, engine="vllm", num_layers=NUM_LAYERS)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "provenance.json"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    from specforge_kimi.provenance import file_hash

    assert prov["weights_sha256"]["model.safetensors"] == file_hash(out / "model.safetensors")


def test_export_refuses_a_link_and_a_directory_that_is_not_an_export(tmp_path):
    paths, _ = _checkpoint(tmp_path, _mla_config())
    real = tmp_path / "models"
    real.mkdir()
    (real / "notes.txt").write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(KimiInputError, match=f"export directory {link} is a symbolic link to {real}"):
        ex.export_draft(**paths, output_dir=link, engine="sglang", num_layers=NUM_LAYERS)
    with pytest.raises(KimiInputError, match="is not a previous export \\(no provenance.json\\)"):
        ex.export_draft(**paths, output_dir=real, engine="sglang", num_layers=NUM_LAYERS)
    assert link.is_symlink() and _snapshot(real) == {"notes.txt": b"keep me"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.json", "link", "models", "run", "vm.pt"]
