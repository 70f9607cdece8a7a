"""Exported drafts: the keys SGLang's LlamaForCausalLMEagle3 loader reads, K2.5 eagle_config, provenance."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specforge_kimi.drafts.export import check_sglang_export, finalize_sglang_export
from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import AuxLayers

H, DRAFT_VOCAB, VOCAB = 64, 16, 163840


def _state(hidden=H, draft_vocab=DRAFT_VOCAB, vocab=VOCAB):
    ids = torch.arange(0, draft_vocab * 3, 3)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {
        "fc.weight": torch.randn(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": torch.randn(hidden, 2 * hidden),
        "midlayer.mlp.down_proj.weight": torch.randn(hidden, 4 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(draft_vocab, hidden),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }


def _export(tmp_path, state=None, cfg_edit=None, hidden=H):
    d = tmp_path / "export"
    d.mkdir()
    save_file(state if state is not None else _state(), str(d / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    }
    if cfg_edit:
        cfg_edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_finalize_writes_sglang_ids_and_provenance(tiny_dir, tmp_path):
    d = _export(tmp_path)
    aux = AuxLayers.from_specforge([1, 2, 3], 6)
    prov = finalize_sglang_export(d, target_dir=tiny_dir, aux=aux, command=["specforge-kimi", "test"])
    cfg = json.loads((d / "config.json").read_text())
    # SGLang convention, unshifted positions: SGLang uses them as given -> same captured residuals
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert AuxLayers.from_sglang(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], 6) == aux
    on_disk = json.loads((d / "provenance.json").read_text())
    assert on_disk == json.loads(json.dumps(prov))
    for key in ("command", "versions", "specforge_kimi_git_commit", "config_sha256", "weights_sha256", "aux_layers"):
        assert key in on_disk
    assert on_disk["versions"]["specforge"] == "0.2.0"
    assert on_disk["aux_layers"]["vllm_ids"] == [2, 3, 4]
    summary = check_sglang_export(d, target_dir=tiny_dir)
    assert summary["captured_positions"] == [2, 3, 4]


@pytest.mark.parametrize(
    "case,msg",
    [
        ("prefix", "trainer prefixes"),
        ("no_d2t", "missing keys \\['d2t'\\]"),
        ("no_midlayer", "no midlayer"),
        ("arch", "is not \\['LlamaForCausalLMEagle3'\\]"),
        ("no_eagle_config", "fall back to its default layers"),
        ("hidden_vs_target", "does not match the target's 64"),
        ("aux_out_of_range", "has residual positions 1..5"),
        ("d2t_t2d_disagree", "disagree"),
        ("head_shape", "lm_head.weight"),
        ("vocab_vs_target", "the target's is 163840"),
        ("yarn_rope", "YaRN rope scaling"),
    ],
)
def test_bad_exports(tiny_dir, tmp_path, case, msg):
    state = _state()
    edit = None
    hidden = H
    if case == "prefix":
        state = {("draft_model." + k if k.startswith("midlayer") else k): v for k, v in state.items()}
    elif case == "no_d2t":
        state.pop("d2t")
    elif case == "no_midlayer":
        state = {k: v for k, v in state.items() if not k.startswith("midlayer")}
    elif case == "arch":
        edit = lambda c: c.update(architectures=["LlamaForCausalLM"])  # noqa: E731
    elif case == "no_eagle_config":
        edit = lambda c: c.pop("eagle_config")  # noqa: E731
    elif case == "hidden_vs_target":
        hidden = 32
        state = _state(hidden=32)
    elif case == "aux_out_of_range":
        edit = lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 3, 6]})  # noqa: E731
    elif case == "d2t_t2d_disagree":
        state["d2t"] = state["d2t"] + 1
    elif case == "head_shape":
        state["lm_head.weight"] = torch.randn(DRAFT_VOCAB + 1, H)
    elif case == "vocab_vs_target":
        state = _state(vocab=1000)
    elif case == "yarn_rope":

        def edit(c):
            c.update(rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096})

    d = _export(tmp_path, state, edit, hidden)
    with pytest.raises(KimiInputError, match=msg):
        check_sglang_export(d, target_dir=tiny_dir)


def _fake_specforge_export(state, *, crash=False):
    """Stands in for SpecForge's ``export --to sglang`` (the weights and config it writes); with ``crash``
    it dies half-way through the weights."""

    def export_sglang(checkpoint, draft_config_path, output_dir, vocab_mapping_path):
        d = Path(output_dir)
        save_file(state, str(d / "model.safetensors"))
        if crash:
            with open(d / "model.safetensors", "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise OSError("disk full")
        cfg = json.loads(Path(draft_config_path).read_text())
        (d / "config.json").write_text(json.dumps(cfg))
        return output_dir

    return export_sglang


def test_export_run_draft_replaces_the_export_whole(tiny_dir, tmp_path, monkeypatch):
    """Issue 43: a crash in the middle of a Llama-style export leaves the old export whole; a finished one
    replaces it whole (never new weights beside an old config.json)."""
    from specforge_kimi.drafts import export as export_module

    draft_cfg = tmp_path / "draft.json"
    draft_cfg.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "hidden_size": H,
                "vocab_size": VOCAB,
                "draft_vocab_size": DRAFT_VOCAB,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
            }
        )
    )
    aux = AuxLayers.from_specforge([1, 2, 3], 6)
    out = tmp_path / "export-sglang"

    def export(state, **kw):
        monkeypatch.setattr(export_module, "export_sglang", _fake_specforge_export(state, **kw))
        return export_module.export_run_draft(
            "ckpt", draft_cfg, out, vocab_mapping_path="vm.pt", target_dir=tiny_dir, aux=aux
        )

    export(_state())
    (out / "old-only.txt").write_text("from the previous export")
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(OSError, match="disk full"):
        export(_state(), crash=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.json", "export-sglang"]
    new_state = _state()
    export(new_state)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "provenance.json"]
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], new_state["fc.weight"])
    assert check_sglang_export(out, target_dir=tiny_dir)["captured_positions"] == [2, 3, 4]
