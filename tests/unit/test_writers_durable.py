"""The project's result and state writers go through ``specforge_kimi.durable`` (issue 43): each file replaced
whole, links refused with one line, never written through."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specforge_kimi.errors import KimiInputError

PKG = Path(__file__).resolve().parents[2] / "src" / "specforge_kimi"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp2-h200x2.yaml"

#: modules whose every file write goes through durable (a direct write here is a regression)
DURABLE_ONLY = [
    "plan/run_plan.py",
    "evaluate/run_report.py",
    "evaluate/bench.py",
    "training/offline.py",
    "demo/draft_eval.py",
    "demo/target_text.py",
    "demo/pretrain.py",
    "drafts/export.py",
]


def _direct_writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("write_text", "write_bytes"):
            found.append(f"{path.name}:{node.lineno} {name}")
        elif name == "open":
            modes = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg == "mode"]
            if any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes):
                found.append(f"{path.name}:{node.lineno} open for writing")
    return found


@pytest.mark.parametrize("module", DURABLE_ONLY)
def test_writers_write_through_durable_only(module):
    assert _direct_writes(PKG / module) == []


def test_the_direct_write_check_sees_a_direct_write(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('from pathlib import Path\nPath("x").write_text("y")\nopen("z", "w")\nopen("r")\n')
    assert _direct_writes(sample) == ["sample.py:2 write_text", "sample.py:3 open for writing"]


def test_render_refuses_a_linked_file_and_keeps_its_target(tmp_path):
    from specforge_kimi.plan.run_plan import compile_plan

    victim = tmp_path / "victim.json"
    victim.write_text("keep me")
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    (rendered / "launch.json").symlink_to(victim)
    plan = compile_plan(RECIPE, rendered_dir=rendered)
    with pytest.raises(KimiInputError, match="launch.json is a symbolic link to") as err:
        plan.write()
    assert "\n" not in str(err.value) and victim.read_text() == "keep me"
    (rendered / "launch.json").unlink()
    out = plan.write()
    assert json.loads((rendered / "launch.json").read_text()) == json.loads(json.dumps(out["launch"]))
    assert sorted(p.name for p in rendered.iterdir()) == ["draft_config.json", "launch.json", "specforge_run.yaml"]


def test_offline_run_config_refuses_a_link(tmp_path):
    from specforge_kimi.training import offline

    victim = tmp_path / "victim.yaml"
    victim.write_text("keep: me\n")
    (tmp_path / "run_config.yaml").symlink_to(victim)
    cfg = SimpleNamespace(output_dir=str(tmp_path), model_dump=lambda mode: {"a": 1})
    with pytest.raises(KimiInputError, match="symbolic link"):
        offline._write_run_config(cfg)
    assert victim.read_text() == "keep: me\n"


def test_capture_features_refuses_a_linked_out_before_starting_anything(tmp_path):
    from specforge_kimi.run import offline_twin

    real = tmp_path / "elsewhere"
    real.mkdir()
    (tmp_path / "features").symlink_to(real)
    with pytest.raises(KimiInputError, match=f"--out {tmp_path / 'features'} is a symbolic link to {real}"):
        offline_twin.run_recipe(SimpleNamespace(recipe=None), tmp_path / "features")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "features"] and not any(real.iterdir())
