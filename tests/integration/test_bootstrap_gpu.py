"""`bash scripts/bootstrap.sh --gpu`: what can be checked without a GPU or a network.

The GPU host's install runs for real except at two process boundaries: pip (the venv's python answers
``-m pip`` by recording the call; the CUDA build itself is installed on GPU hosts only) and the checks
``specforge-kimi setup`` / ``doctor`` make (recorded, not run: here they would patch the shared
environment). SpecForge's source is cloned by git from a local repository standing in for GitHub and
checked out at a commit; the script's own decisions -- which Mooncake build for torch's CUDA, removing a
CPU build first, where the source comes from, the order setup -> doctor and doctor's exit code -- are
what these tests read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bootstrap.sh"

FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_LOG"
case "$1" in
  -m)
    case "$2" in
      pip) if [ "$3" = install ] && [ -n "$FAKE_PIP_FAIL" ]; then
             echo "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"; exit 1
           fi
           if [ "$3" = show ]; then for d in $FAKE_INSTALLED; do [ "$d" = "${@: -1}" ] && exit 0; done; exit 1; fi; exit 0;;
      specforge_kimi) [ "$3" = doctor ] && exit "${FAKE_DOCTOR_RC:-0}"; exit 0;;
    esac;;
  -c) case "$2" in *torch.version.cuda*) echo "${FAKE_TORCH_CUDA%%.*}"; exit 0;; esac  # the query prints the major
      exec "$REAL_PYTHON" "$@";;
esac
exit 0
"""


def _git(*args, cwd):
    return subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def remote(tmp_path):
    """A SpecForge stand-in: two commits; the first is the one to check out."""
    repo = tmp_path / "remote"
    (repo / "specforge").mkdir(parents=True)
    (repo / "patches" / "sglang" / "v0.5.14").mkdir(parents=True)
    (repo / "specforge" / "cli.py").write_text("# pinned\n")
    (repo / "patches" / "sglang" / "v0.5.14" / "spec-capture.patch").write_text("--- a\n+++ b\n")
    _git("init", "-q", cwd=repo)
    _git("add", ".", cwd=repo)
    _git("commit", "-qm", "pinned", cwd=repo)
    pinned = _git("rev-parse", "HEAD", cwd=repo)
    (repo / "specforge" / "cli.py").write_text("# later\n")
    _git("commit", "-qam", "later", cwd=repo)
    return repo, pinned


def _run(tmp_path, *args, cuda="13.0", installed="", doctor_rc=0, repo=None, commit=None, pip_fail=False):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    fake = venv / "bin" / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {
        **os.environ,
        "PYTHON": sys.executable,  # the version check, before the venv exists
        "REAL_PYTHON": sys.executable,
        "FAKE_LOG": str(log),
        "FAKE_TORCH_CUDA": cuda,
        "FAKE_INSTALLED": installed,
        "FAKE_DOCTOR_RC": str(doctor_rc),
        **({"SPECFORGE_REPO": str(repo)} if repo else {}),
        **({"SPECFORGE_COMMIT": commit} if commit else {}),
        **({"FAKE_PIP_FAIL": "1"} if pip_fail else {}),
    }
    res = subprocess.run(
        ["bash", str(SCRIPT), "--gpu", "--venv", str(venv), *args], env=env, capture_output=True, text=True, timeout=120
    )
    return res, log.read_text().splitlines()


def test_fetches_specforge_installs_the_cuda_build_patches_and_ends_with_doctor(tmp_path, remote):
    repo, pinned = remote
    dest = tmp_path / "src" / "SpecForge"
    res, calls = _run(tmp_path, "--specforge-dir", str(dest), repo=repo, commit=pinned[:8])
    assert res.returncode == 0, res.stderr
    assert _git("rev-parse", "HEAD", cwd=dest) == pinned and (dest / "specforge" / "cli.py").read_text() == "# pinned\n"
    assert not (tmp_path / "src" / "SpecForge.partial").exists()
    pip = [c for c in calls if c.startswith("-m pip install")]
    assert pip[-2] == "-m pip install -q -e .[test]" and pip[-1] == "-m pip install -q -e .[test,gpu]"
    steps = [c for c in calls if c.startswith("-m specforge_kimi")]
    assert steps == [
        f"-m specforge_kimi setup --specforge-checkout {dest}",
        "-m specforge_kimi setup --no-sglang",
        "-m specforge_kimi doctor",
    ]
    assert calls[-1] == "-m specforge_kimi doctor" and "ready:" in res.stdout
    assert not any("uninstall" in c for c in calls)  # nothing to remove

    # a second run reuses the clone (the remote is gone now)
    repo.rename(tmp_path / "gone")
    res, calls = _run(tmp_path, "--specforge-dir", str(dest), repo=repo, commit=pinned[:8])
    assert res.returncode == 0, res.stderr
    assert "fetching SpecForge" not in res.stdout


def test_cuda12_replaces_a_cpu_mooncake_build(tmp_path, remote):
    repo, pinned = remote
    res, calls = _run(
        tmp_path,
        "--specforge-dir",
        str(tmp_path / "sf"),
        cuda="12.8",
        installed="mooncake-transfer-engine-non-cuda",
        repo=repo,
        commit=pinned[:8],
    )
    assert res.returncode == 0, res.stderr
    removed = calls.index("-m pip uninstall -y -q mooncake-transfer-engine-non-cuda")
    installed = calls.index("-m pip install -q -e .[test,gpu-cu12]")
    assert removed < installed
    # the removed build shared the package's files: the CUDA build is reinstalled over them
    assert (
        calls[installed + 2] == "-m pip install -q --force-reinstall --no-deps mooncake-transfer-engine==0.3.13.post1"
    )
    assert calls[installed + 1].startswith("-c import sys, tomllib")  # the pin, read from pyproject's extra


def test_given_checkout_is_used_as_is(tmp_path, remote):
    repo, _ = remote
    res, calls = _run(tmp_path, "--specforge-checkout", str(repo), repo=tmp_path / "nowhere")
    assert res.returncode == 0, res.stderr
    assert f"-m specforge_kimi setup --specforge-checkout {repo}" in calls and "fetching" not in res.stdout


def test_no_network_says_how_to_bring_the_source(tmp_path):
    dest = tmp_path / "sf"
    res, calls = _run(tmp_path, "--specforge-dir", str(dest), repo=tmp_path / "unreachable")
    assert res.returncode == 2
    assert "could not clone" in res.stderr and "--specforge-checkout DIR" in res.stderr and "a6b6b023" in res.stderr
    assert not dest.exists() and not (tmp_path / "sf.partial").exists()
    assert not any(c.startswith("-m specforge_kimi") for c in calls)


def test_a_remote_without_the_pinned_commit(tmp_path, remote):
    repo, _ = remote
    res, _ = _run(tmp_path, "--specforge-dir", str(tmp_path / "sf"), repo=repo, commit="deadbeef")
    assert res.returncode == 2 and "has no commit deadbeef" in res.stderr
    assert not (tmp_path / "sf").exists()


def test_cpu_torch_is_refused_with_the_fix(tmp_path, remote):
    repo, pinned = remote
    res, calls = _run(tmp_path, cuda="", repo=repo, commit=pinned[:8])
    assert res.returncode == 2 and "CPU build" in res.stderr and "--torch-index" in res.stderr
    assert not any("specforge_kimi" in c for c in calls)


def test_doctors_verdict_is_the_exit_code(tmp_path, remote):
    repo, pinned = remote
    res, calls = _run(tmp_path, "--specforge-dir", str(tmp_path / "sf"), repo=repo, commit=pinned[:8], doctor_rc=1)
    assert res.returncode == 1 and calls[-1] == "-m specforge_kimi doctor" and "ready:" not in res.stdout


def test_no_install_only_fetches_patches_and_checks(tmp_path, remote):
    repo, pinned = remote
    res, calls = _run(tmp_path, "--no-install", "--specforge-dir", str(tmp_path / "sf"), repo=repo, commit=pinned[:8])
    assert res.returncode == 0, res.stderr
    assert not any(c.startswith("-m pip") for c in calls)
    assert [c for c in calls if c.startswith("-m specforge_kimi")][-1] == "-m specforge_kimi doctor"


def test_a_failed_install_stops_the_gpu_setup(tmp_path, remote):
    repo, pinned = remote
    res, calls = _run(tmp_path, "--specforge-dir", str(tmp_path / "sf"), repo=repo, commit=pinned[:8], pip_fail=True)
    assert res.returncode == 1, res.stdout
    assert "No space left on device" in res.stdout and "bootstrap.sh: pip install failed (exit 1;" in res.stderr
    assert calls == ["-m pip install -q --upgrade pip"]  # nothing after the first failure: no fetch, setup, doctor
    assert not (tmp_path / "sf").exists()


def test_a_failed_install_stops_the_cpu_setup(tmp_path):
    """The README's set-up (CI's): pip's failure ends the script with pip's exit code and one line, the venv
    is not stamped as installed, and nothing goes on to import what was not installed."""
    root = tmp_path / "proj"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "bootstrap.sh").write_text(SCRIPT.read_text())
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (root / ".venv" / "bin").mkdir(parents=True)
    fake = root / ".venv" / "bin" / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {**os.environ, "PYTHON": sys.executable, "REAL_PYTHON": sys.executable, "FAKE_LOG": str(log)}
    res = subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh")],
        env={**env, "FAKE_PIP_FAIL": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "bootstrap.sh: pip install failed (exit 1;" in res.stderr, res.stderr
    assert "a fresh .venv takes about 13 GB" in res.stderr
    assert log.read_text().splitlines() == ["-m pip install -q --upgrade pip"]
    assert not (root / ".venv" / ".specforge-kimi-installed").exists()

    # pip succeeding: the stack is installed and checked, then stamped
    res = subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines()[1:] == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q -e .[test,cpu]",
        '-c import specforge_kimi, specforge, sglang, torch, transformers; print("stack:", "torch", '
        'torch.__version__, "transformers", transformers.__version__)',
    ]
    assert (root / ".venv" / ".specforge-kimi-installed").is_file()


def test_gpu_options_need_gpu():
    res = subprocess.run(["bash", str(SCRIPT), "--no-install"], capture_output=True, text=True)
    assert res.returncode == 2 and "add --gpu" in res.stderr


def test_the_pinned_commit_is_setups():
    from specforge_kimi.setup.setup_patches import SPECFORGE_PIN_COMMIT

    assert f'SF_COMMIT="${{SPECFORGE_COMMIT:-{SPECFORGE_PIN_COMMIT}}}"' in SCRIPT.read_text()
