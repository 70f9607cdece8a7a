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


def test_head_tail_keeps_a_long_logs_start_and_end(tmp_path):
    """gpu_common.sh's head_tail: a server log's start-up (its head) and its end both come back from the box."""
    big = tmp_path / "server.log"
    big.write_bytes(b"START up\n" + b"x" * 100_000 + b"\nEND ready\n")
    small = tmp_path / "small.log"
    small.write_bytes(b"whole\n" * 10)
    script = (
        f'. scripts/gpu_common.sh && head_tail "{big}" "{tmp_path}/b.out" && head_tail "{small}" "{tmp_path}/s.out"'
    )
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cut = (tmp_path / "b.out").read_bytes()
    assert cut.startswith(b"START up\n") and cut.endswith(b"\nEND ready\n")
    size = big.stat().st_size
    assert f"\n[... {size - 60000} bytes left out ...]\n".encode() in cut and len(cut) < 60_100
    assert (tmp_path / "s.out").read_bytes() == small.read_bytes()
