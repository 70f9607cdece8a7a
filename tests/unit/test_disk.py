"""``plan.disk``: the checkpoints and export a run leaves in its output_dir, counted as SpecForge's trainer saves them,
and ``trainer.max_checkpoints`` rendered into SpecForge's config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specforge_kimi.plan import disk, run_plan
from specforge_kimi.plan.trainer_terms import draft_params

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-k25-tp1-h200.yaml"


def _trainer(recipe, **update):
    return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update=update)})


@pytest.mark.parametrize(
    ("max_steps", "save_interval", "expected"),
    [(3000, 1000, 3), (200, 1000, 1), (2500, 1000, 3), (300, 0, 1), (1, 1, 1), (7, 2, 4)],
)
def test_saves_every_interval_and_the_final_step(max_steps, save_interval, expected):
    """A save at every multiple of save_interval (``TrainerController.fit``) and one at the end unless the last step
    was one of them (``Trainer.fit``); save_interval 0: only the final one."""
    at = {s for s in range(1, max_steps + 1) if save_interval and s % save_interval == 0} | {max_steps}
    assert disk.saves(max_steps, save_interval) == len(at) == expected


def test_estimate_for_a_shipped_recipe():
    """The K2.5-width slice: 14 bytes per draft parameter per checkpoint, 2 for the export; the saves of max_steps
    3000 / save_interval 1000 all kept, or the newest max_checkpoints of them."""
    recipe = run_plan.load_recipe(REPO / "recipes" / "kimi-k25-slice-h200.yaml")
    n = draft_params(recipe.trainer.draft)
    assert disk.checkpoint_bytes(recipe) == 14 * n and disk.export_bytes(recipe) == 2 * n
    three = _trainer(recipe, max_steps=3000, save_interval=1000)
    assert disk.kept_checkpoints(three) == 3 and disk.run_disk_bytes(three) == 3 * 14 * n + 2 * n
    # the newest N, plus the one being written before the oldest is rotated out
    assert disk.kept_checkpoints(_trainer(three, max_checkpoints=1)) == 2
    assert disk.run_disk_bytes(_trainer(three, max_checkpoints=1)) == 2 * 14 * n + 2 * n
    assert disk.kept_checkpoints(_trainer(three, max_checkpoints=2)) == 3
    assert disk.kept_checkpoints(_trainer(three, max_checkpoints=5)) == 3  # fewer saves than it would keep
    assert disk.kept_checkpoints(_trainer(recipe, max_steps=200, save_interval=1000)) == 1
    assert disk.estimate(three).startswith("3 checkpoint(s) x ")


def test_shortfall_names_the_estimate_and_the_free_space():
    recipe = run_plan.load_recipe(RECIPE)
    need = disk.run_disk_bytes(recipe)
    assert disk.shortfall(recipe, need) is None
    short = disk.shortfall(recipe, need - 1)
    assert short and disk.estimate(recipe) in short and "free" in short and "\n" not in short


def test_free_bytes_of_a_directory_not_made_yet(tmp_path):
    assert disk.free_bytes(tmp_path / "not" / "yet") == disk.free_bytes(tmp_path) > 0


def test_max_checkpoints_rendered_into_specforge_config(tmp_path):
    """trainer.max_checkpoints reaches SpecForge's training.max_checkpoints (and its schema takes it); absent or 0
    it is left out, so configs of recipes without it render as before."""
    from specforge.config import Config

    raw = yaml.safe_load(RECIPE.read_text())
    assert "max_checkpoints" not in run_plan.compile_plan(raw, rendered_dir=tmp_path).specforge_config["training"]
    raw["trainer"]["max_checkpoints"] = 3
    cfg = dict(run_plan.compile_plan(raw, rendered_dir=tmp_path).rendered()["specforge_config"])
    assert cfg["training"]["max_checkpoints"] == 3
    assert Config.model_validate(cfg).training.max_checkpoints == 3


def test_offline_twin_passes_max_checkpoints(monkeypatch):
    """The offline twin trains with the recipe's trainer.max_checkpoints, as its online run does."""
    from specforge_kimi.run import offline_twin
    from specforge_kimi.training import offline

    seen = {}

    def fake_train(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(offline, "train_offline", fake_train)
    recipe = _trainer(run_plan.load_recipe(RECIPE), max_checkpoints=2)
    with pytest.raises(RuntimeError, match="stop here"):
        offline_twin._train_and_export(recipe, "features", "out", "draft.json", 10)
    assert seen["extra_overrides"]["training.max_checkpoints"] == 2 and seen["save_interval"] == 1000
