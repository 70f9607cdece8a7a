"""The run plan: a recipe is compiled once per command, and no code outside ``transport/`` compares a transport's
name (the strategies answer instead)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from specforge_kimi.plan import draft_config, run_plan

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "specforge_kimi"
RECIPE = REPO / "recipes" / "tiny-k25-tp1-h200.yaml"

_NAME = r"""["'](?:cuda_ipc|mooncake)["']"""
#: ``x == "cuda_ipc"``, ``"mooncake" != x``, ``x in ("cuda_ipc", ...)``, ``x not in ["mooncake"]``, ``match x: case
#: "cuda_ipc"``
COMPARISON = re.compile(
    rf"""(?:[=!]=\s*{_NAME}|{_NAME}\s*[=!]=|\bin\s*[(\[{{]\s*{_NAME}|{_NAME}\s+(?:not\s+)?in\b|case\s+{_NAME})"""
)


def comparisons(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "transport":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARISON.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_transport_name_is_compared_outside_transport():
    assert comparisons(SRC) == []


@pytest.mark.parametrize(
    "line",
    [
        'if r.server.transport == "cuda_ipc":',
        "if transport != 'mooncake':",
        'mooncake = "mooncake" == recipe.server.transport',
        'if name in ("cuda_ipc", "mooncake"):',
        'if "cuda_ipc" in result:',
    ],
)
def test_the_comparison_scan_sees_each_form(tmp_path, line):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def f(r, name, result, transport, recipe):\n    {line}\n        pass\n")
    assert len(comparisons(tmp_path)) == 1


@pytest.fixture
def counted(monkeypatch):
    """Counts compiles (``run_plan.compile_plan``), transport choices and recipe schema validations (the recipe's
    draft, checked once per schema validation by ``plan.draft_config.validate_draft``)."""
    counts = {"compile": 0, "schema": 0, "choose": 0}
    compile_plan, choose = run_plan.compile_plan, run_plan.choose_transport
    check = draft_config.validate_draft

    def counting_compile(*a, **k):
        counts["compile"] += 1
        return compile_plan(*a, **k)

    def counting_choose(*a, **k):
        counts["choose"] += 1
        return choose(*a, **k)

    def counting_check(family, draft):
        counts["schema"] += 1
        return check(family, draft)

    monkeypatch.setattr(run_plan, "compile_plan", counting_compile)
    monkeypatch.setattr(run_plan, "choose_transport", counting_choose)
    monkeypatch.setattr(draft_config, "validate_draft", counting_check)
    return counts


def _recipe(tmp_path, transport: str | None) -> str:
    raw = yaml.safe_load(RECIPE.read_text())
    raw["output_dir"] = str(tmp_path / "run")
    if transport is None:
        raw["server"].pop("transport", None)
    else:
        raw["server"]["transport"] = transport
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("transport", [None, "mooncake", "cuda_ipc"])
@pytest.mark.parametrize(
    "command",
    [["recipe", "validate"], ["recipe", "render", "--out", "{out}"], ["launch", "--plan"], ["doctor"]],
    ids=lambda c: " ".join(c[:2]).replace(" {out}", ""),
)
def test_each_command_compiles_the_recipe_once(tmp_path, counted, command, transport):
    from specforge_kimi.cli import main

    path = _recipe(tmp_path, transport)
    argv = [a.replace("{out}", str(tmp_path / "rendered")) for a in command]
    argv = argv[:2] + [path] + argv[2:] if argv[0] == "recipe" else [argv[0], path, *argv[1:]]
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    assert counted == {"compile": 1, "schema": 1, "choose": 1}, argv


# ---- the draft family compiled into the server's argv, SpecForge's config and the sizing ---------------------------
BLOCK_RECIPE = REPO / "recipes" / "tiny-k25-tp1-h200-dflash.yaml"


def _block_raw(family: str = "dflash") -> dict:
    raw = yaml.safe_load(BLOCK_RECIPE.read_text())
    if family == "dspark":
        raw["trainer"]["family"] = "dspark"
        raw["trainer"]["dspark"] = {"ce": 0.2, "l1": 0.8, "confidence": 0.5}
        draft = raw["trainer"]["draft"]
        draft["architectures"] = ["DSparkDraftModel"]
        draft["num_key_value_heads"] = 4  # DSpark is GQA by default (its model refuses equal head counts)
        draft["dflash_config"].update(markov_rank=16, enable_confidence_head=True, confidence_head_with_markov=True)
    return raw


def _resolve_with_specforge(config: dict) -> None:
    """SpecForge's own Config and its planning (validate_resolved_run) accept the rendered config."""
    from specforge.application.composition import resolve_run
    from specforge.config import Config

    resolve_run(Config.model_validate(json_roundtrip(config)))


def json_roundtrip(config):
    import json

    return json.loads(json.dumps(dict(config)))


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_block_family_compiles_into_server_argv_and_specforge_config(tmp_path, family):
    plan = run_plan.compile_plan(_block_raw(family), rendered_dir=tmp_path)
    argv = list(plan.server_argv)
    assert argv[argv.index("--spec-capture-method") + 1] == family
    i = argv.index("--spec-capture-aux-layer-ids")
    assert argv[i + 1 : i + 6] == ["1", "2", "3", "4", "5"] and argv[i + 6].startswith("--")
    cfg = plan.rendered()["specforge_config"]
    assert cfg["training"]["strategy"] == family
    assert cfg["model"]["mask_token_id"] == 163824
    assert "aux_hidden_state_layer_ids" not in cfg["model"] and "vocab_mapping_path" not in cfg["model"]
    assert "ttt_length" not in cfg["training"]
    assert cfg["training"]["num_anchors"] == 512 and cfg["training"]["objective_chunk_blocks"] == 128
    assert cfg["training"]["loss_type"] == "dflash"
    if family == "dspark":
        assert (cfg["training"]["dspark_ce_loss_alpha"], cfg["training"]["dspark_l1_loss_alpha"]) == (0.2, 0.8)
        assert cfg["training"]["dspark_confidence_head_alpha"] == 0.5
    else:
        assert not any(k.startswith("dspark_") for k in cfg["training"])
    plan.write()
    _resolve_with_specforge(cfg)
    report = plan.report()
    assert report["family"] == family and report["capture"]["positions"] == [2, 3, 4, 5, 6]


def test_specforge_refuses_what_block_families_leave_out(tmp_path):
    """The checks above are not vacuous: SpecForge's planning refuses EAGLE-3's aux ids for dflash."""
    plan = run_plan.compile_plan(_block_raw(), rendered_dir=tmp_path)
    cfg = json_roundtrip(plan.rendered()["specforge_config"])
    plan.write()
    cfg["model"]["aux_hidden_state_layer_ids"] = [1, 3, 6]
    with pytest.raises(ValueError, match="gets capture layers from its draft"):
        _resolve_with_specforge(cfg)


def test_eagle3_family_unchanged(tmp_path):
    plan = run_plan.compile_plan(RECIPE, rendered_dir=tmp_path)
    argv = list(plan.server_argv)
    assert argv[argv.index("--spec-capture-method") + 1] == "eagle3"
    cfg = plan.rendered()["specforge_config"]
    assert cfg["training"]["strategy"] == "eagle3" and cfg["training"]["ttt_length"] == 4
    assert cfg["model"]["aux_hidden_state_layer_ids"] == [1, 3, 6] and "mask_token_id" not in cfg["model"]
    assert "num_anchors" not in cfg["training"]
    _resolve_with_specforge(cfg)
