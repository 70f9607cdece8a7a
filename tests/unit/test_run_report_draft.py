"""``run-report``'s ``draft`` section (what a run trained, read from the rendered config and the configs it names)
and the accuracies it averages: paths relative to where ``launch`` ran, missing and malformed files."""

from __future__ import annotations

import json
from pathlib import Path

from specforge_kimi.evaluate.run_report import _acc_keys, draft


def _launched(root: Path, *, draft_cfg: dict | str, target_cfg: dict | str) -> tuple[dict, Path]:
    """A run launched from ``root`` with relative paths, as ``launch`` renders them."""
    run = root / "runs" / "r"
    (run / "rendered").mkdir(parents=True)
    (root / "runs" / "t").mkdir()
    text = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731
    (run / "rendered" / "draft_config.json").write_text(text(draft_cfg))
    (root / "runs" / "t" / "config.json").write_text(text(target_cfg))
    cfg = {
        "output_dir": "runs/r",
        "model": {"draft_model_config": "runs/r/rendered/draft_config.json", "target_model_path": "runs/t"},
        "training": {"strategy": "dflash"},
    }
    return cfg, run


BLOCK = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "block_size": 8,
    "dflash_config": {"target_layer_ids": [0, 1, 2, 3]},
}


def test_relative_paths_resolve_against_the_launch_directory(tmp_path, monkeypatch):
    cfg, run = _launched(tmp_path / "root", draft_cfg=BLOCK, target_cfg={"text_config": {"hidden_size": 64}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({"hidden_size": 999}))  # a stray file where run-report runs
    monkeypatch.chdir(elsewhere)
    got = draft(cfg, run)
    assert got == {
        "strategy": "dflash",
        "architecture": "DFlashDraftModel",
        "draft_hidden_size": 64,
        "draft_num_hidden_layers": 2,
        "draft_block_size": 8,
        "target_layer_ids": [0, 1, 2, 3],
        "target_hidden_size": 64,
    }
    cfg["model"]["target_model_path"] = ""  # no target named: nothing read from the working directory
    cfg["model"]["draft_model_config"] = "gone/draft_config.json"  # read from the run's rendered/ all the same
    got = draft(cfg, run)
    assert got["target_hidden_size"] is None and got["draft_block_size"] == 8


def test_malformed_configs_leave_entries_none(tmp_path):
    bad = {**BLOCK, "architectures": "DFlashDraftModel", "dflash_config": "not a table"}
    cfg, run = _launched(tmp_path, draft_cfg=bad, target_cfg={"text_config": "not a table"})
    cfg["model"]["aux_hidden_state_layer_ids"] = [1, 2]
    got = draft(cfg, run)
    assert got["architecture"] is None and got["target_layer_ids"] == [1, 2] and got["target_hidden_size"] is None
    cfg, run = _launched(tmp_path / "b", draft_cfg="{not json", target_cfg="[1, 2]")
    got = draft({**cfg, "training": None}, run)
    assert got["strategy"] == "eagle3" and got["draft_hidden_size"] is None and got["target_hidden_size"] is None


def test_accuracies_per_position_or_the_single_one():
    assert _acc_keys({"loss": 1.0, "acc": 0.5, "acc_1": 0.4, "acc_0": 0.6}) == ["acc_0", "acc_1"]
    assert _acc_keys({"loss": 1.0, "acc": 0.5}) == ["acc"]
    assert _acc_keys({"loss": 1.0}) == []
