"""Provenance beside every artifact: the command, the stack's versions, this checkout's commit,
hashes of configs and files, and where the patch set lives.

Bottom layer (stdlib only): exports, benches and reports all write these.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specforge_kimi.errors import KimiInputError

#: specforge-kimi's version (``specforge-kimi --version``; pyproject.toml reads it from here).
VERSION = "0.1.0"


def patches_root() -> Path:
    """``patches/`` of this specforge-kimi checkout (editable install)."""
    root = Path(__file__).resolve().parents[2] / "patches"
    if not root.is_dir():
        raise KimiInputError(f"{root} not found: run setup from a specforge-kimi checkout (pip install -e .)")
    return root


def canonical_hash(obj: Any) -> str:
    """sha256 of a JSON-serializable object in canonical form."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_hash(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str | None]:
    """Installed versions of the stack (without importing the packages)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for pkg in (
        "specforge-kimi",
        "specforge",
        "sglang",
        "torch",
        "transformers",
        "flashinfer-python",
        "mooncake-transfer-engine",
        "mooncake-transfer-engine-cuda13",
        "mooncake-transfer-engine-non-cuda",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def devices() -> list[str] | None:
    """The GPUs as ``nvidia-smi`` names them, with their memory ("NVIDIA H200, 143771 MiB"); None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] or None


def git_commit() -> str | None:
    """Commit of the specforge-kimi checkout this code runs from, if it is one."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) or None


def provenance(*, command: Sequence[str] | None, config: dict, extra: dict | None = None) -> dict:
    return {
        "command": list(command) if command is not None else sys.argv,
        "versions": versions(),
        "specforge_kimi_git_commit": git_commit(),
        "config_sha256": canonical_hash(config),
        **(extra or {}),
    }


def target_record(target_dir: str | os.PathLike, info: Any) -> dict:
    """The target an artifact was made for: its path, the hash of its ``config.json`` and the sizes ``info`` (a
    ``targets.checkpoint`` summary: ``num_layers``, ``hidden_size``, ``vocab_size``) read from it."""
    return {
        "path": str(Path(target_dir).resolve()),
        "config_sha256": canonical_hash(json.loads((Path(target_dir) / "config.json").read_text())),
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
    }


def patch_hashes() -> dict[str, str]:
    """sha256 of every file under this checkout's ``patches/`` (empty outside a checkout)."""
    try:
        root = patches_root()
    except KimiInputError:
        return {}
    return {str(p.relative_to(root)): file_hash(p) for p in sorted(root.rglob("*")) if p.is_file()}
