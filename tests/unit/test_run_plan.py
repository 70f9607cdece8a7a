"""The run plan: a recipe is compiled once per command, and no code outside ``transport/`` compares a transport's
name (the strategies answer instead)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from specforge_kimi.plan import recipes, run_plan

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
    whole-model check, through the draft-keys check it calls each time)."""
    counts = {"compile": 0, "schema": 0, "choose": 0}
    compile_plan, choose = run_plan.compile_plan, run_plan.choose_transport
    check = recipes._check_draft_keys

    def counting_compile(*a, **k):
        counts["compile"] += 1
        return compile_plan(*a, **k)

    def counting_choose(*a, **k):
        counts["choose"] += 1
        return choose(*a, **k)

    def counting_check(draft):
        counts["schema"] += 1
        return check(draft)

    monkeypatch.setattr(run_plan, "compile_plan", counting_compile)
    monkeypatch.setattr(run_plan, "choose_transport", counting_choose)
    monkeypatch.setattr(recipes, "_check_draft_keys", counting_check)
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
