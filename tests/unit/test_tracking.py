"""Recipes' ``tracking:`` is SpecForge's own ``tracking`` section, passed through and checked by SpecForge's schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.run_plan import compile_plan, load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp2-h200x2.yaml"


def _recipe(tmp_path, tracking=None):
    raw = yaml.safe_load(RECIPE.read_text())
    raw["output_dir"] = str(tmp_path / "run")
    if tracking is not None:
        raw["tracking"] = tracking
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    return load_recipe(p)


def test_default_is_tensorboard_under_the_output_dir(tmp_path):
    cfg = compile_plan(_recipe(tmp_path), rendered_dir=tmp_path / "rendered").rendered()["specforge_config"]
    assert cfg["tracking"] == {"report_to": "tensorboard", "wandb_offline": False}
    from specforge.config import Config

    # SpecForge's TensorBoard tracker writes <output_dir>/runs (specforge.tracker.TensorboardTracker)
    assert Config.model_validate(cfg).tracking.report_to == "tensorboard"
    assert not (tmp_path / "rendered").exists()  # write=False


def test_wandb_fields_pass_through(tmp_path):
    tracking = {"report_to": "wandb", "wandb_project": "k25-drafts", "wandb_name": "run-1", "wandb_offline": True}
    recipe = _recipe(tmp_path, tracking)
    out = compile_plan(recipe, rendered_dir=tmp_path / "rendered").write()
    written = yaml.safe_load((tmp_path / "rendered" / "specforge_run.yaml").read_text())
    assert out["specforge_config"]["tracking"] == written["tracking"] == tracking


def test_none_turns_tracking_off(tmp_path):
    cfg = compile_plan(_recipe(tmp_path, {"report_to": "none"}), rendered_dir=tmp_path / "rendered").rendered()[
        "specforge_config"
    ]
    assert cfg["tracking"]["report_to"] == "none"


@pytest.mark.parametrize(
    "tracking, needle",
    [({"report_to": "comet"}, "tracking.report_to"), ({"report_to": "wandb", "project": "x"}, "tracking.project")],
)
def test_bad_tracking_is_one_line(tmp_path, tracking, needle):
    with pytest.raises(KimiInputError, match=needle) as exc:
        _recipe(tmp_path, tracking)
    assert "\n" not in str(exc.value)
