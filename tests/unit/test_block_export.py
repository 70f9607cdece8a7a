"""DFlash block drafts exported for SGLang 0.5.14's DFLASH (docs/decisions/016-block-drafts.md, section 3).

The checkpoint is built with SpecForge's own ``DFlashDraftModel`` at tiny sizes and saved as SpecForge's trainer
saves one (``training/controller.py`` ``save_checkpoint`` through ``CheckpointManager.save``: a
``{run_id}-step{N}/training_state.pt`` whose ``draft_state_dict`` is the strategy's filtered draft state, beside
``strategy`` and the DFlash resume contract). The export runs SpecForge's ``export_to_hf`` in-process; the check
reads what SGLang's ``parse_dflash_draft_config`` reads (imported, on the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_kimi.drafts import block_export as bx
from specforge_kimi.errors import KimiInputError

IDS = [1, 2, 3]  # DFlash ids of the 6-layer test target: positions 2, 3, 4
MASK = 163838
DRAFT = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 50000.0,
    "vocab_size": 163840,
    "layer_types": ["full_attention", "full_attention"],
    "block_size": 8,
    "num_target_layers": 6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "dflash_config": {"target_layer_ids": IDS},
}


def _checkpoint(tmp_path: Path, config: dict | None = None, *, arch_model=None, strategy="dflash") -> dict:
    """A SpecForge-shaped dflash checkpoint (CheckpointManager layout) of a random tiny DFlashDraftModel."""
    from specforge.training.checkpoint import CheckpointManager
    from transformers import Qwen3Config

    config = config or DRAFT
    cfg_path = tmp_path / "draft.json"
    cfg_path.write_text(json.dumps(config))
    if arch_model is None:
        from specforge.modeling.draft.dflash import DFlashDraftModel as arch_model
    model = arch_model(Qwen3Config(**config))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    # DFlashTrainStrategy.checkpoint_state_filter: the wrapper's draft_model.* keys, prefix stripped
    wrapped = {f"draft_model.{k}": v for k, v in model.state_dict().items()}
    state = {k.replace("draft_model.", ""): v for k, v in wrapped.items() if "draft_model." in k}
    shared = {
        "draft_state_dict": state,
        "global_step": 3,
        "strategy": strategy,
        "run_id": "r",
        "world_size": 1,
        "dflash_target_layer_ids": tuple(config["dflash_config"]["target_layer_ids"]),
        "dflash_block_size": config["block_size"],
        "dflash_mask_token_id": MASK,
    }
    step = CheckpointManager(str(tmp_path / "run"), "r").save(shared, 3)
    return {"checkpoint": step, "draft_config_path": str(cfg_path), "state": state}


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash")
    ck = _checkpoint(tmp)
    out = tmp / "export-sglang"
    bx.export_block_draft(ck["checkpoint"], ck["draft_config_path"], out, target_dir=tiny_dir, command=["t"])
    return out, ck


def test_export_passes_the_check_and_sglang_reads_what_we_wrote(exported, tiny_dir):
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    out, ck = exported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "provenance.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"]["target_layer_ids"] == IDS and cfg["dflash_config"]["mask_token_id"] == MASK
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    assert (parsed.target_layer_ids, parsed.block_size, parsed.mask_token_id) == (IDS, 8, MASK)
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == bx.expected_keys(2) and not any("embed" in k or "lm_head" in k for k in state)
    for k, v in ck["state"].items():
        assert torch.equal(state[k], v), k
    summary = bx.check_dflash_export(out, tiny_dir)
    assert summary["captured_positions"] == [2, 3, 4] and summary["target_layer_ids"] == IDS
    prov = json.loads((out / "provenance.json").read_text())
    for key in ("command", "versions", "specforge_kimi_git_commit", "config_sha256", "weights_sha256", "target"):
        assert key in prov, key
    assert prov["target_layers"] == {"dflash_ids": IDS, "captured_positions": [2, 3, 4]}


def _broken(src: Path, dst: Path, *, cfg_edit=None, state_edit=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    if cfg_edit:
        cfg_edit(cfg)
    if state_edit:
        state_edit(state)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(dst / "model.safetensors"))
    return dst


def _dspark_heads(s):
    s["markov_head.weight"] = torch.zeros(4, 64)


@pytest.mark.parametrize(
    "case,cfg_edit,state_edit,msg",
    [
        ("layer key deleted", None, lambda s: s.pop("layers.1.self_attn.k_norm.weight"), "missing keys"),
        ("prefixed key", None, lambda s: s.update({"draft_model.norm.weight": s.pop("norm.weight")}), "trainer prefix"),
        ("fc width", None, lambda s: s.update({"fc.weight": torch.zeros(64, 128)}), "does not map 3x64"),
        ("no mask id", lambda c: c["dflash_config"].pop("mask_token_id"), None, "no dflash_config.mask_token_id"),
        ("id L-1", lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 5]), None, "include 5"),
        ("dspark heads", None, _dspark_heads, "dflash-dspark-heads"),
        ("dspark arch", lambda c: c.update(architectures=["DSparkDraftModel"]), None, "dflash-dspark-heads"),
        ("mask outside vocab", lambda c: c["dflash_config"].update(mask_token_id=163840), None, "outside the target"),
        ("descending ids", lambda c: c["dflash_config"].update(target_layer_ids=[3, 2, 1]), None, "ascending"),
        ("num_target_layers", lambda c: c.update(num_target_layers=7), None, "the target has 6 layers"),
    ],
)
def test_a_broken_export_fails_with_one_line(exported, tiny_dir, tmp_path, case, cfg_edit, state_edit, msg):
    d = _broken(exported[0], tmp_path / "bad", cfg_edit=cfg_edit, state_edit=state_edit)
    with pytest.raises(KimiInputError, match=msg) as err:
        bx.check_dflash_export(d, tiny_dir)
    assert "\n" not in str(err.value)


def test_our_reading_is_compared_with_sglangs(exported, tmp_path, monkeypatch):
    d = _broken(exported[0], tmp_path / "d")
    bx.check_dflash_export(d)
    real = bx._sglang_reading
    monkeypatch.setattr(bx, "_sglang_reading", lambda cfg: {**real(cfg), "block_size": 16})
    with pytest.raises(KimiInputError, match="SGLang reads"):
        bx.check_dflash_export(d)


def test_dspark_checkpoint_is_refused_for_sglang_before_anything_is_written(tiny_dir, tmp_path):
    from specforge.modeling.draft.dspark import DSparkDraftModel

    cfg = {**DRAFT, "architectures": ["DSparkDraftModel"]}
    ck = _checkpoint(tmp_path, cfg, arch_model=DSparkDraftModel, strategy="dspark")
    with pytest.raises(KimiInputError, match="dflash-dspark-heads"):
        bx.export_block_draft(ck["checkpoint"], ck["draft_config_path"], tmp_path / "out", target_dir=tiny_dir)
    assert not (tmp_path / "out").exists()


def test_contract_sources_must_agree():
    state = {"dflash_target_layer_ids": (1, 2, 3), "dflash_block_size": 8, "dflash_mask_token_id": MASK}
    assert bx.block_contract(DRAFT, state) == {"target_layer_ids": IDS, "block_size": 8, "mask_token_id": MASK}
    with pytest.raises(KimiInputError, match="mask_token_id disagrees"):
        bx.block_contract(DRAFT, state, mask_token_id=5)
    with pytest.raises(KimiInputError, match="block_size disagrees"):
        bx.block_contract(DRAFT, {**state, "dflash_block_size": 16})
    with pytest.raises(KimiInputError, match="no mask_token_id"):
        bx.block_contract(DRAFT, {})


def test_run_export_dispatches_block_drafts_by_architecture(exported, tiny_dir, tmp_path, monkeypatch):
    """``export_run_draft`` (launch's export, the export command) sends a DFlash draft config to the block export."""
    from specforge_kimi.drafts import export as export_module
    from specforge_kimi.targets.layer_ids import AuxLayers

    ck = exported[1]
    out = tmp_path / "via-run"
    export_module.export_run_draft(
        ck["checkpoint"],
        ck["draft_config_path"],
        out,
        vocab_mapping_path=None,
        target_dir=tiny_dir,
        aux=AuxLayers.from_specforge([1, 2, 3], 6),
    )
    assert export_module.check_any_export(out, tiny_dir)["architecture"] == "DFlashDraftModel"


def test_engine_export_points_block_drafts_to_the_block_export(exported, tiny_dir, tmp_path):
    from specforge_kimi.drafts import export_engines as ex

    assert ex.ARCH_ENGINES["DFlashDraftModel"] == ("sglang",)
    ck = exported[1]
    with pytest.raises(KimiInputError, match="for \\['sglang'\\] only"):
        ex.export_draft(ck["checkpoint"], ck["draft_config_path"], tmp_path / "v", engine="vllm", num_layers=6)
    with pytest.raises(KimiInputError, match="through specforge-kimi export"):
        ex.export_draft(ck["checkpoint"], ck["draft_config_path"], tmp_path / "s", engine="sglang", num_layers=6)
    assert not (tmp_path / "s").exists()


def test_id_l_minus_1_is_refused_from_num_target_layers_alone(exported, tmp_path):
    """Without the target at hand, the draft's own num_target_layers bounds the ids (SGLang accepts L-1)."""
    d = _broken(exported[0], tmp_path / "d", cfg_edit=lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 5]))
    with pytest.raises(KimiInputError, match="include 5"):
        bx.check_dflash_export(d)
