"""The EAGLE-3 draft vocabulary mapping (``d2t``/``t2d``) for K2.5, in SpecForge's file format.

SpecForge 0.2.0 reads ``model.vocab_mapping_path`` with ``torch.load(path)`` (weights-only) and
copies two entries into the draft's buffers (``DraftModel.load_vocab_mapping``):

- ``d2t``: int64, shape ``[draft_vocab]``; draft id ``i`` is target id ``i + d2t[i]``, the
  selected target ids in ascending order (an offset table, as SGLang's EAGLE-3 serving wants);
- ``t2d``: bool, shape ``[target_vocab]``; True for the selected target ids.

``nonzero(t2d) == d2t + arange(draft_vocab)`` (SpecForge's ``validate_vocab_mapping_consistency``).
:func:`save_vocab_mapping` writes exactly ``{"d2t", "t2d"}`` with ``torch.save`` (what SpecForge's
own ``generate_vocab_mapping_file`` writes), so SpecForge loads it unchanged, and puts the
provenance in a JSON sidecar next to it (``<name>.json``): target name, vocab size, the
special-token table and the emitted ids that were forced in, counts and coverage.

Selection (:func:`select_draft_tokens`): the special tokens K2.5 emits in assistant turns
(:data:`~specforge_kimi.data.tokenizer.K25_EMITTED_SPECIAL_TOKENS`) always, then the most frequent
loss-masked tokens (ties: lower id first), then, if the data has fewer distinct tokens than the
draft vocab, the lowest unused ids (SpecForge pads the same way). Deterministic for given counts.

:func:`validate_vocab_mapping` catches a mapping made for another target: a ``t2d`` of another
length (another vocab), missing K2.5 emitted specials, or a sidecar naming another target or
special-token table.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specforge_kimi.data.tokenizer import K25_EMITTED_SPECIAL_TOKENS, K25_SPECIAL_TOKENS, K25_VOCAB_SIZE
from specforge_kimi.errors import KimiInputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_DRAFT_VOCAB_SIZE",
    "TARGET_NAME",
    "VocabMapping",
    "build_vocab_mapping",
    "emitted_special_ids",
    "load_vocab_mapping",
    "save_vocab_mapping",
    "select_draft_tokens",
    "sidecar_path",
    "validate_vocab_mapping",
]

DEFAULT_DRAFT_VOCAB_SIZE = 32000
TARGET_NAME = "kimi-k2.5"
_FORMAT = "specforge-kimi/vocab-mapping/v1"


@dataclass(frozen=True)
class VocabMapping:
    """``d2t`` (int64 offsets) and ``t2d`` (bool mask) plus the sidecar metadata."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    meta: dict[str, Any]

    @property
    def draft_ids(self) -> list[int]:
        """Target ids of draft ids 0..N-1 (ascending)."""
        import torch

        return (self.d2t + torch.arange(self.d2t.numel())).tolist()


def emitted_special_ids() -> list[int]:
    """Ids of the special tokens K2.5 generates; always in the draft vocabulary."""
    return sorted(K25_SPECIAL_TOKENS[name] for name in K25_EMITTED_SPECIAL_TOKENS)


def select_draft_tokens(
    counts: Mapping[int, int],
    *,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    target_vocab_size: int = K25_VOCAB_SIZE,
    required_ids: Iterable[int] | None = None,
) -> list[int]:
    """Target ids of the draft vocabulary, ascending (see the module docstring for the order)."""
    required = sorted(set(emitted_special_ids() if required_ids is None else required_ids))
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise KimiInputError(f"draft vocab size {draft_vocab_size} must be in 1..{target_vocab_size}")
    if len(required) > draft_vocab_size:
        raise KimiInputError(
            f"draft vocab size {draft_vocab_size} cannot hold the {len(required)} required special tokens"
        )
    for token_id in list(required) + list(counts):
        if not 0 <= token_id < target_vocab_size:
            raise KimiInputError(f"token id {token_id} is outside the target vocab 0..{target_vocab_size - 1}")
    chosen = set(required)
    by_frequency = sorted(
        (token_id for token_id, count in counts.items() if count > 0),
        key=lambda token_id: (-counts[token_id], token_id),
    )
    for token_id in by_frequency:
        if len(chosen) >= draft_vocab_size:
            break
        chosen.add(token_id)
    filler = 0
    while len(chosen) < draft_vocab_size:
        chosen.add(filler)
        filler += 1
    return sorted(chosen)


def build_vocab_mapping(
    counts: Mapping[int, int],
    *,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    target_vocab_size: int = K25_VOCAB_SIZE,
    required_ids: Iterable[int] | None = None,
    source: Mapping[str, Any] | None = None,
) -> VocabMapping:
    """Build ``d2t``/``t2d`` from loss-masked token counts (``{target_id: count}``)."""
    import torch

    required = sorted(set(emitted_special_ids() if required_ids is None else required_ids))
    selected = select_draft_tokens(
        counts,
        draft_vocab_size=draft_vocab_size,
        target_vocab_size=target_vocab_size,
        required_ids=required,
    )
    ids = torch.tensor(selected, dtype=torch.int64)
    d2t = ids - torch.arange(len(selected), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    total = sum(counts.values())
    covered = sum(counts.get(token_id, 0) for token_id in selected)
    meta = {
        "format": _FORMAT,
        "target": TARGET_NAME,
        "target_vocab_size": target_vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "special_tokens": dict(K25_SPECIAL_TOKENS),
        "required_token_ids": required,
        "counted_tokens": total,
        "distinct_counted_tokens": sum(1 for c in counts.values() if c > 0),
        "covered_tokens": covered,
        "coverage": covered / total if total else 0.0,
        "source": dict(source or {}),
    }
    return VocabMapping(d2t=d2t, t2d=t2d, meta=meta)


def sidecar_path(path: str | Path) -> Path:
    """``vocab_mapping.pt`` -> ``vocab_mapping.json``."""
    return Path(path).with_suffix(".json")


def save_vocab_mapping(mapping: VocabMapping, path: str | Path) -> Path:
    """Write the SpecForge ``.pt`` file and its JSON sidecar, each atomically (temp, fsync, rename)."""
    import torch

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Serialised to memory first: saved to a path, torch names the zip records after the file
    # (here a temporary name with the pid), so the bytes would differ from run to run.
    buffer = io.BytesIO()
    torch.save({"d2t": mapping.d2t.clone(), "t2d": mapping.t2d.clone()}, buffer)
    from specforge_kimi.durable import write_atomic

    write_atomic(target, buffer.getvalue())
    write_atomic(sidecar_path(target), json.dumps(mapping.meta, indent=2, sort_keys=True) + "\n")
    return target


def load_vocab_mapping(path: str | Path, *, validate: bool = True) -> VocabMapping:
    """Load a mapping the way SpecForge does (``torch.load``, weights only) plus its sidecar."""
    import torch

    source = Path(path)
    if not source.is_file():
        raise KimiInputError(f"vocab mapping {source} does not exist")
    try:
        raw = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a bad file
        raise KimiInputError(f"vocab mapping {source} cannot be read by torch.load: {exc}") from exc
    if not isinstance(raw, dict) or "d2t" not in raw or "t2d" not in raw:
        raise KimiInputError(f"vocab mapping {source} must be a dict with 'd2t' and 't2d'")
    meta_file = sidecar_path(source)
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    mapping = VocabMapping(d2t=raw["d2t"], t2d=raw["t2d"], meta=meta)
    if validate:
        validate_vocab_mapping(mapping, source=str(source))
    return mapping


def validate_vocab_mapping(
    mapping: VocabMapping,
    *,
    target_vocab_size: int = K25_VOCAB_SIZE,
    required_ids: Sequence[int] | None = None,
    source: str = "vocab mapping",
) -> None:
    """Raise :class:`KimiInputError` if the mapping is inconsistent or made for another target."""
    import torch

    d2t, t2d = mapping.d2t, mapping.t2d
    if not isinstance(d2t, torch.Tensor) or not isinstance(t2d, torch.Tensor):
        raise KimiInputError(f"{source}: d2t and t2d must be tensors")
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise KimiInputError(f"{source}: d2t and t2d must be 1-D, got {tuple(d2t.shape)} and {tuple(t2d.shape)}")
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise KimiInputError(f"{source}: expected d2t int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if t2d.numel() != target_vocab_size:
        raise KimiInputError(
            f"{source}: t2d covers a vocabulary of {t2d.numel()} ids, but {TARGET_NAME} has "
            f"{target_vocab_size}; this mapping was made for another target model"
        )
    selected = torch.nonzero(t2d, as_tuple=False).flatten()
    expected = d2t + torch.arange(d2t.numel(), dtype=torch.int64)
    if selected.numel() != d2t.numel() or not torch.equal(selected, expected):
        raise KimiInputError(f"{source}: d2t and t2d disagree (nonzero(t2d) must equal d2t + arange(len(d2t)))")
    required = emitted_special_ids() if required_ids is None else list(required_ids)
    missing = [token_id for token_id in required if not bool(t2d[token_id])]
    if missing:
        names = {v: k for k, v in K25_SPECIAL_TOKENS.items()}
        shown = ", ".join(f"{names.get(i, '?')} ({i})" for i in missing)
        raise KimiInputError(
            f"{source}: the draft vocabulary lacks special tokens {TARGET_NAME} emits: {shown}; "
            "the mapping was made for another target or without K2.5's chat specials"
        )
    meta = mapping.meta
    if meta:
        if meta.get("target") != TARGET_NAME:
            raise KimiInputError(f"{source}: sidecar says target {meta.get('target')!r}, not {TARGET_NAME!r}")
        if meta.get("target_vocab_size") != target_vocab_size:
            raise KimiInputError(
                f"{source}: sidecar says target vocab {meta.get('target_vocab_size')}, not {target_vocab_size}"
            )
        specials = meta.get("special_tokens")
        if specials is not None and specials != K25_SPECIAL_TOKENS:
            raise KimiInputError(
                f"{source}: sidecar special-token table differs from K2.5's; the mapping was made "
                "with another tokenizer"
            )
        if meta.get("draft_vocab_size") not in (None, d2t.numel()):
            raise KimiInputError(
                f"{source}: sidecar says draft vocab {meta.get('draft_vocab_size')}, the file has {d2t.numel()}"
            )
