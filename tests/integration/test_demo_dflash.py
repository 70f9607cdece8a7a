"""``demo --draft dflash`` at reduced size: SpecForge's DFlash trainer on ``hidden_states`` features, the DFlash
export passing its check, decode acceptance recorded before and after, the training loss falling."""

import json

import pytest
import torch
import yaml

from specforge_kimi.demo.pipeline import DemoSettings, run_demo
from specforge_kimi.drafts.block_export import check_dflash_export
from specforge_kimi.errors import KimiInputError
from specforge_kimi.training.offline import build_offline_config


@pytest.mark.slow
def test_demo_dflash_small(tmp_path):
    out = tmp_path / "demo"
    s = DemoSettings(
        out_dir=str(out),
        draft="dflash",
        steps=40,
        pretrain_seconds=600,
        pretrain_steps=10,
        train_conversations=60,
        heldout_conversations=6,
        decode_tokens=12,
        progress=False,
    )
    result = run_demo(s)
    on_disk = json.loads((out / "demo_result.json").read_text())
    assert on_disk["draft_family"] == "dflash" == result["draft_family"]
    sample = torch.load(next((out / "features").glob("*.ckpt")), weights_only=False)
    assert sample["hidden_states"].shape[-1] == 3 * 256 and sample["hidden_states"].dim() == 3
    run_config = yaml.safe_load((out / "train-dflash" / "run_config.yaml").read_text())
    assert run_config["training"]["strategy"] == "dflash"
    summary = check_dflash_export(out / "export-dflash", out / "target")
    assert summary["captured_positions"] == [2, 3, 4] and summary["block_size"] == s.block_size
    assert on_disk["export_check"] == summary
    dec = on_disk["decode_acceptance"]
    for when in ("before", "after"):
        assert dec[when]["rounds"] > 0 and 1.0 <= dec[when]["mean_acceptance_length"] <= s.block_size, dec
    assert dec["before"]["rounds"] >= dec["after"]["rounds"], dec
    train = on_disk["train"]
    assert train["steps"] == 40 and train["loss_last_mean"] < train["loss_first_mean"] - 0.5, train


def test_offline_config_strategy(tmp_path):
    (tmp_path / "f").mkdir()
    torch.save({}, tmp_path / "f" / "a.ckpt")
    kw = dict(
        target_dir=str(tmp_path),
        draft_config_path=str(tmp_path / "d.json"),
        hidden_states_path=str(tmp_path / "f"),
        vocab_mapping_path=None,
        output_dir=str(tmp_path / "o"),
        max_steps=2,
        ttt_length=4,
        learning_rate=1e-3,
        max_length=64,
        seed=0,
        embedding_key="e",
        lm_head_key="h",
    )
    cfg = build_offline_config(**kw, strategy="dflash")
    assert cfg.training.strategy == "dflash" and cfg.model.vocab_mapping_path == ""
    with pytest.raises(ValueError, match="strategy 'domino'"):
        build_offline_config(**kw, strategy="domino")


def test_demo_refuses_unknown_draft(tmp_path):
    with pytest.raises(KimiInputError, match="--draft 'medusa'"):
        DemoSettings(out_dir=str(tmp_path), draft="medusa")
