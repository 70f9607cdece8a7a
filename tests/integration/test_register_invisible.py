"""``specforge_kimi.register()`` changes nothing for the targets SpecForge already supports.

SpecForge's own tests for the seams registration wraps (target weight loading, the draft and template
registries, checkpoints, the ref channel and distributor, the capture adapter, launch plans) run twice in
subprocesses against the installed specforge wheel: plain, and with ``register()`` called before collection
(``tests/specforge_suite_plugin.py``). Every test id (subtests by their parameters) must end the same way in
both runs. The tests come from the pinned SpecForge archive (``specforge_checkout`` fixture); only its
``tests/`` is copied, so the wheel, not the checkout's package, is what they import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

#: SpecForge's CPU tests of what registration wraps (~1.5 min per run on a 2-core box)
SUITE = [
    "tests/test_modeling/test_target",
    "tests/test_modeling/test_draft_registry.py",
    "tests/test_algorithms/test_registry.py",
    "tests/test_data/test_template_registry.py",
    "tests/test_runtime/test_checkpoint_manager.py",
    "tests/test_runtime/test_checkpoint_resume.py",
    "tests/test_runtime/test_compact_teacher_strategy.py",
    "tests/test_runtime/test_disaggregated.py",
    "tests/test_runtime/test_disaggregated_model_loading.py",
    "tests/test_runtime/test_launch_plan.py",
    "tests/test_runtime/test_model_assembly_utils.py",
    "tests/test_runtime/test_recovery.py",
    "tests/test_runtime/test_ref_distributor.py",
    "tests/test_runtime/test_rollout_worker.py",
    "tests/test_runtime/test_server_capture.py",
    "tests/test_runtime/test_streaming_ref_channel.py",
]


def _outcomes(rows: list[dict]) -> dict[str, str]:
    """test id (+ subtest) -> passed / failed / skipped, from the plugin's per-phase reports."""
    out: dict[str, str] = {}
    for r in rows:
        if "id" not in r:
            continue
        key = f"{r['id']} {r['sub']}".strip()
        if r["outcome"] == "failed":
            out[key] = "failed"
        elif r["outcome"] == "skipped" and out.get(key) != "failed":
            out[key] = "skipped"
        else:
            out.setdefault(key, "passed")
    return out


def _run_suite(root: Path, out: Path, *, register: bool) -> tuple[list[dict], str]:
    here = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), str(here.parent / "src"), os.environ.get("PYTHONPATH", "")]),
        "SPECFORGE_KIMI_SUITE_OUT": str(out),
        "SPECFORGE_KIMI_SUITE_REGISTER": "1" if register else "0",
    }
    env.pop("SPECFORGE_PLUGINS", None)  # the plain run must not register through our SpecForge patch load-plugins
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "specforge_suite_plugin", *SUITE],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    return rows, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_register_changes_no_specforge_test_outcome(specforge_checkout, tmp_path):
    root = tmp_path / "suite"
    root.mkdir()
    shutil.copytree(specforge_checkout / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    assert not (root / "specforge").exists()  # tests import the installed wheel, not the checkout's package
    plain_rows, plain_log = _run_suite(root, tmp_path / "plain.jsonl", register=False)
    reg_rows, reg_log = _run_suite(root, tmp_path / "registered.jsonl", register=True)
    assert {"registered": True, "wrapped": True} in reg_rows, reg_log  # register() really ran in that run
    assert not any("registered" in r for r in plain_rows)
    plain, registered = _outcomes(plain_rows), _outcomes(reg_rows)
    assert sum(v == "passed" for v in plain.values()) > 100, plain_log  # the suite ran
    assert any(k.startswith("tests/test_modeling/test_target/") for k in plain), plain_log
    changed = {
        k: (plain.get(k), registered.get(k))
        for k in plain.keys() | registered.keys()
        if plain.get(k) != registered.get(k)
    }
    assert not changed, f"register() changed SpecForge test outcomes (plain, registered): {changed}\n{reg_log}"
