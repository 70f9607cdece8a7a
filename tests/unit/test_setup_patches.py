"""Our SpecForge patches apply to the pinned wheel (CI's check), idempotently, and drift is named."""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import specforge_as_shipped

from specforge_kimi.errors import KimiInputError
from specforge_kimi.setup import setup_patches

WHEEL_PKG = Path(importlib.util.find_spec("specforge").origin).parent


def test_check_against_installed_wheel(capsys):
    # CI runs on a clean install: every SpecForge patch must be applicable (or already applied).
    statuses = setup_patches.plan(None, sglang=False)
    assert statuses, "no SpecForge patches found"
    assert all(s.state in ("applicable", "applied") for s in statuses), [(s.patch.name, s.detail) for s in statuses]
    assert setup_patches.run(argparse.Namespace(specforge_checkout=None, check=True, no_sglang=True)) == 0


@pytest.fixture
def fake_checkout(tmp_path):
    """A copy of the wheel's specforge package laid out like a checkout (not a git repo), as SpecForge ships
    it: our patches are taken back out, last first, where `setup` had applied them to the venv's wheel."""
    root = tmp_path / "SpecForge"
    shutil.copytree(WHEEL_PKG, root / "specforge", ignore=shutil.ignore_patterns("__pycache__"))
    return specforge_as_shipped(root)


def _run(root, check=False):
    return setup_patches.run(argparse.Namespace(specforge_checkout=str(root), check=check, no_sglang=True))


def test_apply_is_idempotent_and_plugins_load(fake_checkout):
    assert _run(fake_checkout, check=True) == 0
    assert "_load_plugins" not in (fake_checkout / "specforge/cli.py").read_text()  # --check wrote nothing
    assert _run(fake_checkout) == 0
    assert "_load_plugins()" in (fake_checkout / "specforge/cli.py").read_text()
    states = [s.state for s in setup_patches.plan(str(fake_checkout), sglang=False)]
    assert len(states) == len(
        list((setup_patches.patches_root() / "specforge" / setup_patches.SPECFORGE_PIN).glob("*.patch"))
    ) and set(states) == {"applied"}
    assert _run(fake_checkout) == 0  # second apply: no-op
    # The patched entry point registers specforge_kimi in a fresh process via SPECFORGE_PLUGINS.
    code = (
        "import specforge.cli as c; c._load_plugins();"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING;"
        "print('kimi_k25' in CONFIG_MAPPING._extra_content)"
    )
    env = {
        **os.environ,
        "SPECFORGE_PLUGINS": "specforge_kimi",
        "PYTHONPATH": os.pathsep.join([str(fake_checkout), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")
    env["SPECFORGE_PLUGINS"] = "json"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "has no register()" in bad.stderr


def test_drift_names_the_file(fake_checkout):
    cli = fake_checkout / "specforge/cli.py"
    cli.write_text(cli.read_text().replace("def main(argv", "def main_renamed(argv"))
    with pytest.raises(KimiInputError, match="0001-load-plugins.patch does not apply to .*specforge/cli.py"):
        _run(fake_checkout, check=True)


def test_changed_context_is_drift_not_fuzz(fake_checkout):
    """A context line of the hunk changed (not a line the patch edits): `patch`'s default fuzz would still
    apply it at a guessed place; setup calls it drift and names the file."""
    cli = fake_checkout / "specforge/cli.py"
    text = cli.read_text()
    assert text.count('    sub = parser.add_subparsers(dest="command", required=True)') == 1
    cli.write_text(
        text.replace(
            '    sub = parser.add_subparsers(dest="command", required=True)',
            '    sub = parser.add_subparsers(dest="command", required=True)  # edited',
        )
    )
    status = setup_patches.classify(
        setup_patches.patches_root() / "specforge" / setup_patches.SPECFORGE_PIN / "0001-load-plugins.patch",
        fake_checkout,
        1,
    )
    assert status.state == "drift" and status.failed == ["specforge/cli.py"], (status.state, status.detail)
    with pytest.raises(KimiInputError, match=r"0001-load-plugins.patch does not apply to \S*/specforge/cli.py"):
        _run(fake_checkout, check=True)


def test_a_changed_eagle3_step_is_drift_for_the_chunked_head_loss(fake_checkout):
    """Patch eagle3-chunked-head-loss edits the eagle3 step's logits line after patches eagle3-keep-allocator-cache
    and eagle3-fewer-host-syncs edited the same file: a changed context line of its hunk is drift, named, while
    those two still apply."""
    from specforge_kimi.training import step_knobs

    model = fake_checkout / "specforge/algorithms/eagle3/model.py"
    text = model.read_text()
    line = "            logits = self.draft_model.compute_logits(hidden_states)\n"
    assert text.count(line) == 1
    model.write_text(text.replace(line, line.replace("hidden_states)", "hidden_states)  # edited")))
    statuses = {setup_patches.patch_name(s.patch): s for s in setup_patches.plan(str(fake_checkout), sglang=False)}
    drift = statuses[step_knobs.CHUNKED_LOSS_PATCH]
    assert drift.state == "drift" and drift.failed == ["specforge/algorithms/eagle3/model.py"], drift.detail
    assert statuses[step_knobs.EMPTY_CACHE_PATCH].state == statuses[step_knobs.FEWER_SYNCS_PATCH].state == "applicable"
    with pytest.raises(KimiInputError, match=r"0006-eagle3-chunked-head-loss.patch does not apply to \S*/model.py"):
        _run(fake_checkout, check=True)


def test_a_checkout_python_does_not_import_gets_a_note(fake_checkout, capsys):
    assert _run(fake_checkout, check=True) == 0
    assert f"not from {fake_checkout}" in capsys.readouterr().out


def test_sglang_needs_checkout():
    with pytest.raises(KimiInputError, match="only in a SpecForge checkout"):
        setup_patches.plan(None, sglang=True)


def test_applies_to_the_pinned_checkout(tmp_path, specforge_checkout):
    """The same patches on a copy of the a6b6b023 checkout's specforge/ (the tree `setup --specforge-checkout`
    patches in place): applicable there, then applied, then a no-op."""
    root = tmp_path / "SpecForge"
    shutil.copytree(specforge_checkout / "specforge", root / "specforge", ignore=shutil.ignore_patterns("__pycache__"))
    specforge_as_shipped(root)  # the user's checkout may already be set up
    assert {s.state for s in setup_patches.plan(str(root), sglang=False)} == {"applicable"}
    assert _run(root) == 0
    assert {s.state for s in setup_patches.plan(str(root), sglang=False)} == {"applied"}
    assert _run(root) == 0


def test_every_patch_file_is_known_by_name():
    """Every file under ``patches/<project>/<pin>`` is ``NNNN-<name>.patch`` with ``<name>`` among
    ``KNOWN_PATCHES`` (in file order, each once), and every name the code asks for resolves to one file."""
    from specforge_kimi.training import step_knobs

    pins = {"specforge": setup_patches.SPECFORGE_PIN, "sglang": setup_patches.SGLANG_PIN}
    for project, pin in pins.items():
        files = sorted((setup_patches.patches_root() / project / pin).glob("*.patch"))
        assert files and all(re.fullmatch(r"\d{4}-[a-z0-9-]+\.patch", f.name) for f in files), files
        assert tuple(setup_patches.patch_name(f) for f in files) == setup_patches.KNOWN_PATCHES[project]
    used = {
        "specforge": [
            setup_patches.COMPACT_SPECFORGE_PATCH,
            step_knobs.EMPTY_CACHE_PATCH,
            step_knobs.FUSED_ADAMW_PATCH,
            step_knobs.FEWER_SYNCS_PATCH,
            step_knobs.CHUNKED_LOSS_PATCH,
        ],
        "sglang": [setup_patches.COMPACT_SGLANG_PATCH, setup_patches.CUDA_IPC_SGLANG_PATCH],
    }
    for project, names in used.items():
        for name in names:
            assert name in setup_patches.KNOWN_PATCHES[project]
            assert setup_patches.patch_name(setup_patches.patch_file(project, name)) == name
    with pytest.raises(LookupError):
        setup_patches.patch_file("sglang", "no-such-patch")
