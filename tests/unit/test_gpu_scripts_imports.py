"""The GPU scripts run only on a GPU box, where a stale import costs a device call: every
``from specforge_kimi... import ...`` / ``import specforge_kimi...`` they carry must import here, and
``gpu_common.sh``'s ``recipe_fields`` must read every shipped tiny recipe (EAGLE-3 and block drafts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
IMPORT = re.compile(
    r"\b(from specforge_kimi[\w.]* import [\w, ]+?(?: as \w+)?|import specforge_kimi[\w.]*)(?=[;\"'\n]|$)"
)


def _statements() -> list[tuple[str, str]]:
    found = set()
    for script in SCRIPTS:
        for match in IMPORT.finditer(script.read_text()):
            found.add((script.name, match.group(1).strip().rstrip(",")))
    return sorted(found)


def test_the_scripts_import_something():
    assert len(_statements()) >= 5


@pytest.mark.parametrize(("script", "statement"), _statements())
def test_every_import_in_a_gpu_script_resolves(script, statement):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"{script}: {statement}: {proc.stderr.strip().splitlines()[-1:]}"


@pytest.mark.parametrize("recipe", ["tiny-k25-tp1-h200.yaml", "tiny-k25-tp1-h200-dflash.yaml"])
def test_recipe_fields_reads_the_tiny_recipes(recipe):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", "-c", f'. scripts/gpu_common.sh && recipe_fields "recipes/{recipe}"'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, output_dir, per_node, *_ = proc.stdout.split()
    assert output_dir.startswith("runs/") and per_node == "1" and name.startswith("tiny-k25-tp1")
