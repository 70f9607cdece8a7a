"""The disk a run's checkpoints and export take in its ``output_dir``, against the free space there.

A SpecForge step checkpoint (``<run_id>-step<N>``, ``training.checkpoint.CheckpointManager``) holds, per draft
parameter: its bf16 weight in the shared payload (2 bytes), the fp32 master copy (4) and AdamW's two fp32 moments
(8): ``checkpoint_bytes = draft parameters x 14``. The SGLang export is the bf16 weights: ``draft parameters x 2``.
SpecForge's trainer saves every ``trainer.save_interval`` steps and, when the last step is not one of those, once
more at the end (``save_interval`` 0: only that final save); ``trainer.max_checkpoints`` N > 0 keeps the newest N (N + 1 while the next is written).

Scope: an estimate from the draft config (:func:`plan.trainer_terms.draft_params`), sized for a run that reaches
``trainer.max_steps``; the frozen embedding, logs, the consumer ledger and the rendered configs are left out.
Measured checkpoint and export sizes live in ``bench/results``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: bytes per draft parameter in one step checkpoint: bf16 weight 2 + fp32 master 4 + AdamW's two fp32 moments 8
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 8
#: bytes per draft parameter in the SGLang export (bf16 weights)
EXPORT_BYTES_PER_PARAM = 2


def _params(recipe) -> int:
    from specforge_kimi.plan.trainer_terms import draft_params

    return draft_params(recipe.trainer.draft)


def checkpoint_bytes(recipe) -> int:
    """One step checkpoint: draft parameters x 14 (bf16 weights 2 + fp32 masters 4 + AdamW moments 8)."""
    return _params(recipe) * CHECKPOINT_BYTES_PER_PARAM


def export_bytes(recipe) -> int:
    """The SGLang export: draft parameters x 2 (bf16)."""
    return _params(recipe) * EXPORT_BYTES_PER_PARAM


def saves(max_steps: int, save_interval: int) -> int:
    """Checkpoints SpecForge's trainer writes in a run of ``max_steps``: one every ``save_interval`` steps
    (``TrainerController.fit``), plus the final step unless it was one of them (``Trainer.fit``); 0: the final only."""
    if save_interval <= 0:
        return 1
    return max_steps // save_interval + (1 if max_steps % save_interval else 0)


def kept_checkpoints(recipe) -> int:
    """Step checkpoints on disk at once, at most: every save, or with ``trainer.max_checkpoints`` N the newest N
    plus the one being written (``CheckpointManager.save`` writes the new step before it rotates the oldest out)."""
    tr = recipe.trainer
    n = saves(tr.max_steps, tr.save_interval)
    return min(n, tr.max_checkpoints + 1) if tr.max_checkpoints > 0 else n


def run_disk_bytes(recipe) -> int:
    """Kept checkpoints x :func:`checkpoint_bytes` + :func:`export_bytes`."""
    return kept_checkpoints(recipe) * checkpoint_bytes(recipe) + export_bytes(recipe)


def free_bytes(path: str | Path) -> int:
    """Free bytes of the filesystem that holds ``path``, or would: its nearest existing ancestor."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def estimate(recipe) -> str:
    """The estimate in words: ``N checkpoints x size + export = total``."""
    return (
        f"{kept_checkpoints(recipe)} checkpoint(s) x {_gb(checkpoint_bytes(recipe))} + export "
        f"{_gb(export_bytes(recipe))} = {_gb(run_disk_bytes(recipe))}"
    )


def shortfall(recipe, free: int | None = None) -> str | None:
    """Why the run would not fit the free disk of its ``output_dir`` (one line), or None when it fits."""
    free = free_bytes(recipe.output_dir) if free is None else free
    if run_disk_bytes(recipe) <= free:
        return None
    return f"{recipe.output_dir} needs ~{estimate(recipe)} on disk, {_gb(free)} free"


#: what to change when :func:`shortfall` says it does not fit
FIXES = "free disk space there, set a larger trainer.save_interval, or keep fewer with trainer.max_checkpoints N"


def as_dict(recipe) -> dict:
    """The estimate for ``launch --plan`` (no free-space query: the plan may be printed elsewhere)."""
    return {
        "checkpoints_kept": kept_checkpoints(recipe),
        "checkpoint_bytes": checkpoint_bytes(recipe),
        "export_bytes": export_bytes(recipe),
        "total_bytes": run_disk_bytes(recipe),
        "estimate": estimate(recipe),
    }
