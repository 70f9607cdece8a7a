"""Shared fixtures: tiny K2.5 checkpoints built once per session, GPU test gating."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-gpu", action="store_true", help="run tests marked gpu (needs CUDA + pinned stack)")


def pytest_terminal_summary(terminalreporter):
    """One ``fuzz: <surface> N cases`` line per surface a fuzz test recorded (tests/fuzz_counts.py)."""
    from fuzz_counts import counts

    for surface, n in counts().items():
        terminalreporter.write_line(f"fuzz: {surface} {n} cases")


@pytest.fixture(scope="session", autouse=True)
def _tmpdir_inside_basetemp(tmp_path_factory):
    """``TMPDIR`` (and :mod:`tempfile`'s cached default) inside this session's pytest base directory for
    every test and the processes it starts: what they leave in a temporary directory (torchrun's
    ``torchelastic_*``, SpecForge's own suite's ``mkdtemp`` folders) goes with pytest's rotation of base
    directories instead of piling up in ``/tmp``."""
    import tempfile

    tmp = tmp_path_factory.getbasetemp() / "tmp"
    tmp.mkdir(mode=0o700, exist_ok=True)
    was_env, was_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(tmp), str(tmp)
    yield
    tempfile.tempdir = was_cached
    if was_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = was_env


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="gpu test: run on the GPU box with --run-gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: Small enough for CPU tests, K2.5's nesting/names/MLA dims; heads and experts divide by 8.
TEST_SPEC = dict(
    layers=6,
    hidden=64,
    heads=8,
    experts=8,
    experts_per_token=2,
    moe_intermediate=32,
    dense_intermediate=128,
    q_lora_rank=64,
    vision_hidden=32,
    vision_heads=8,
)


def prepare_corpus(root, conversations: int, *tokenizer_args: str):
    """``conversations`` corpus conversations (seed 0) -> ``root/corpus.jsonl`` -> ``specforge-kimi
    prepare`` into ``root/data`` (draft vocab 256); ``tokenizer_args``: ``--tokenizer DIR`` or
    ``--standin-tokenizer``. Returns ``root/data``."""
    import json
    import subprocess
    import sys

    from specforge_kimi.data import corpus

    with open(root / "corpus.jsonl", "w") as f:
        for row in corpus.conversations(conversations, seed=0):
            f.write(json.dumps(row) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "specforge_kimi",
            "prepare",
            str(root / "corpus.jsonl"),
            "--out",
            str(root / "data"),
            *tokenizer_args,
            "--draft-vocab-size",
            "256",
            "--no-progress",
        ],
        check=True,
        capture_output=True,
    )
    return root / "data"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny") / "k25", TinySpec(**TEST_SPEC))


#: SpecForge at the pinned commit, beside a clone as ``../shared/upstream/`` (CI puts shared/ there).
SPECFORGE_ARCHIVE = Path(__file__).resolve().parents[2] / "shared" / "upstream" / "specforge-a6b6b023.tar.gz"


@pytest.fixture(scope="session")
def specforge_checkout(tmp_path_factory) -> Path:
    """A SpecForge checkout at a6b6b023: ``SPECFORGE_KIMI_SPECFORGE_CHECKOUT`` when set, else
    :data:`SPECFORGE_ARCHIVE` unpacked once per session (``filter="data"``); skipped without either."""
    import tarfile

    if os.environ.get("SPECFORGE_KIMI_SPECFORGE_CHECKOUT"):
        return Path(os.environ["SPECFORGE_KIMI_SPECFORGE_CHECKOUT"])
    if not SPECFORGE_ARCHIVE.is_file():
        pytest.skip(
            f"set SPECFORGE_KIMI_SPECFORGE_CHECKOUT to a SpecForge checkout at a6b6b023 (or put {SPECFORGE_ARCHIVE})"
        )
    root = tmp_path_factory.mktemp("specforge-a6b6b023")
    with tarfile.open(SPECFORGE_ARCHIVE) as tar:
        tar.extractall(root, filter="data")
    return root / "SpecForge"


def specforge_as_shipped(root):
    """``root`` (a copy of SpecForge's package tree, ``root/specforge/...``) with our SpecForge patches taken
    back out, last first, wherever `specforge-kimi setup` had applied them (so tests do not depend on whether
    the venv's wheel or the user's checkout was set up). Returns ``root``."""
    import subprocess

    from specforge_kimi.setup import setup_patches

    for patch in reversed(
        sorted((setup_patches.patches_root() / "specforge" / setup_patches.SPECFORGE_PIN).glob("*.patch"))
    ):
        if setup_patches.classify(patch, root, 1).state == "applied":
            subprocess.run(
                ["patch", "-R", "-p1", "-d", str(root), "--batch", "-i", str(patch)], check=True, capture_output=True
            )
    return root


@pytest.fixture
def cpu_shims():
    """SpecForge's CPU path (``training.cpu_shims``) for one test; skipped with CUDA, where the real kernels run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("runs SpecForge's CPU path")
    from specforge_kimi.training import cpu_shims

    was = cpu_shims.shims_installed()
    cpu_shims.install_cpu_shims()
    yield
    if not was:
        cpu_shims.uninstall_cpu_shims()
