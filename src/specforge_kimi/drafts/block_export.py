"""Block drafts (DFlash) exported for SGLang 0.5.14's DFLASH: SpecForge's ``--to hf``, our finalize, our check.

Scope: SpecForge 0.2.0 ``dflash`` checkpoints of ``DFlashDraftModel`` (a Qwen3-style block draft over N target
layers), written as ``config.json`` + ``model.safetensors`` + ``provenance.json`` in the form
``sglang/srt/models/dflash.py`` loads and ``sglang/srt/speculative/dflash_utils.py``
``parse_dflash_draft_config`` reads (docs/decisions/016-block-drafts.md, "3. Export and bench"):

- weights, no embedding and no LM head (the target's serve): ``fc.weight`` [h, N*h] (its shape is the only one
  SGLang checks), ``hidden_norm.weight``, ``norm.weight``, per layer the input/post-attention norms, q/k/v/o
  projections, q/k norms and the gate/up/down MLP. SGLang drops any other name without a word, so the check here
  refuses missing, prefixed and unknown keys.
- config: ``architectures: [DFlashDraftModel]``, ``block_size``, ``num_target_layers`` and
  ``dflash_config.{target_layer_ids, mask_token_id}`` written explicitly (SGLang falls back to a formula for the
  ids and to the tokenizer's ``<|MASK|>`` for the mask id when they are absent).

DFlash ids mean "after layer ``id``" (:meth:`specforge_kimi.targets.layer_ids.AuxLayers.from_dflash`); valid ids
are ``0..L-2``. ``DSparkDraftModel`` trains, but SGLang 0.5.14 has no DSpark path and would drop its Markov and
confidence heads: refused for ``--engine sglang`` until an SGLang patch ``dflash-dspark-heads`` exists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specforge_kimi.drafts.export_engines import DFLASH_ARCH, DSPARK_ARCH
from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import AuxLayers

BLOCK_ARCHS = (DFLASH_ARCH, DSPARK_ARCH)
#: checkpoint strategy each block architecture is trained by (SpecForge's ``training.strategy``)
STRATEGY = {DFLASH_ARCH: "dflash", DSPARK_ARCH: "dspark"}
#: DSpark's heads (``specforge/modeling/draft/dspark.py``), which SGLang 0.5.14's DFlash loader drops silently
DSPARK_HEADS = ("markov_head.", "confidence_head.", "prefix_gru.", "embed_proj.", "logit_head.")
TRAINER_PREFIXES = ("draft_model.", "module.", "_orig_mod.", "_fsdp_wrapped_module.", "model.")
LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
DSPARK_REFUSAL = (
    "a DSpark draft's Markov and confidence heads are dropped by SGLang 0.5.14's DFlash loader "
    "(no DSpark path): --engine sglang is refused until an SGLang patch dflash-dspark-heads exists"
)


def block_arch(config: Mapping[str, Any]) -> str | None:
    """The block architecture ``config`` names, or None for any other draft."""
    archs = config.get("architectures") or []
    return archs[0] if len(archs) == 1 and archs[0] in BLOCK_ARCHS else None


def expected_keys(num_layers: int) -> set[str]:
    """Every key SGLang's ``DFlashDraftModel.load_weights`` fills for ``num_layers`` draft layers."""
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    return keys | {f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}


def export_hf(checkpoint: str, draft_config_path: str, output_dir: str) -> str:
    """SpecForge's ``export --to hf`` (``specforge.export.to_hf.export_to_hf``): its ``materialize_draft``
    (architecture and key validation), ``save_pretrained`` and legacy rope mirroring."""
    from specforge.export.to_hf import export_to_hf

    return export_to_hf(checkpoint, draft_config_path, output_dir)


def _training_state(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's shared payload, memory-mapped when it is one file (only its small fields are read)."""
    import torch

    p = Path(checkpoint)
    f = p if p.is_file() else p / "training_state.pt"
    if f.is_file():
        return torch.load(f, map_location="cpu", weights_only=False, mmap=True)
    from specforge.export.checkpoint_io import resolve_training_state

    try:
        return resolve_training_state(str(checkpoint))
    except (FileNotFoundError, ValueError) as exc:
        raise KimiInputError(f"checkpoint {checkpoint}: {exc}") from None


def _agree(what: str, values: Mapping[str, Any]) -> Any:
    """The one value every named source gives (None when none does); refuse a disagreement."""
    given = {k: v for k, v in values.items() if v is not None}
    if len({json.dumps(v) for v in given.values()}) > 1:
        raise KimiInputError(f"{what} disagrees between {', '.join(f'{k} {v}' for k, v in given.items())}")
    return next(iter(given.values()), None)


def block_contract(
    draft_config: Mapping[str, Any], state: Mapping[str, Any], mask_token_id: int | None = None
) -> dict[str, Any]:
    """The ids, block size and mask id the draft was trained with: the draft config, the checkpoint's resume
    contract (``dflash_*`` fields SpecForge records) and ``mask_token_id`` (the recipe's) must agree."""
    dcfg = draft_config.get("dflash_config") or {}
    ckpt_ids = state.get("dflash_target_layer_ids")
    ids = _agree(
        "target_layer_ids",
        {
            "the draft config": dcfg.get("target_layer_ids"),
            "the checkpoint": list(ckpt_ids) if ckpt_ids is not None else None,
        },
    )
    block = _agree(
        "block_size",
        {"the draft config": draft_config.get("block_size"), "the checkpoint": state.get("dflash_block_size")},
    )
    mask = _agree(
        "mask_token_id",
        {
            "the recipe": mask_token_id,
            "the draft config": dcfg.get("mask_token_id"),
            "the checkpoint": state.get("dflash_mask_token_id"),
        },
    )
    for what, v in (("dflash_config.target_layer_ids", ids), ("block_size", block), ("mask_token_id", mask)):
        if v is None:
            raise KimiInputError(f"no {what} in the draft config or the checkpoint: the export must name it")
    return {"target_layer_ids": [int(i) for i in ids], "block_size": int(block), "mask_token_id": int(mask)}


def finalize_dflash_export(
    export_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike,
    contract: Mapping[str, Any],
    command: Sequence[str] | None = None,
    extra: dict | None = None,
) -> dict:
    """Write the explicit DFlash fields SGLang reads into a SpecForge ``--to hf`` export, check it, write
    ``provenance.json``; return the provenance."""
    from specforge_kimi.durable import write_atomic
    from specforge_kimi.provenance import file_hash, patch_hashes, provenance, target_record
    from specforge_kimi.targets.checkpoint import inspect_target

    d = Path(export_dir)
    cfg = json.loads((d / "config.json").read_text())
    info = inspect_target(target_dir)
    cfg["architectures"] = [DFLASH_ARCH]
    cfg["num_target_layers"] = info.num_layers
    cfg["block_size"] = contract["block_size"]
    cfg["dflash_config"] = {
        **(cfg.get("dflash_config") or {}),
        "target_layer_ids": list(contract["target_layer_ids"]),
        "mask_token_id": contract["mask_token_id"],
    }
    cfg.pop("auto_map", None)  # names SpecForge's dflash.py, which is not shipped beside the weights
    write_atomic(d / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    summary = check_dflash_export(d, target_dir)
    prov = provenance(
        command=command,
        config=cfg,
        extra={
            "engine": "sglang",
            "architecture": DFLASH_ARCH,
            "target": target_record(target_dir, info),
            "target_layers": {
                "dflash_ids": summary["target_layer_ids"],
                "captured_positions": summary["captured_positions"],
            },
            "patches_sha256": patch_hashes(),
            "weights_sha256": {f.name: file_hash(f) for f in sorted(d.glob("*.safetensors"))},
            "check": summary,
            **(extra or {}),
        },
    )
    write_atomic(d / "provenance.json", json.dumps(prov, indent=2, sort_keys=True) + "\n")
    return prov


def export_block_draft(
    checkpoint: str | os.PathLike,
    draft_config_path: str | os.PathLike,
    export_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike,
    engine: str = "sglang",
    mask_token_id: int | None = None,
    command: Sequence[str] | None = None,
    extra: dict | None = None,
) -> Path:
    """Export a SpecForge ``dflash`` checkpoint (``training_state.pt``, a step dir or a run dir) for SGLang's
    DFLASH into ``export_dir``, written whole in a staging sibling and swapped in by one rename."""
    from specforge_kimi.drafts.export_engines import check_export_dir, staged_export

    draft_config = json.loads(Path(draft_config_path).read_text())
    arch = block_arch(draft_config)
    if arch is None:
        raise KimiInputError(
            f"{draft_config_path}: architectures {draft_config.get('architectures')} is no block draft"
        )
    if engine != "sglang":
        raise KimiInputError(f"block drafts export for sglang only (its DFLASH), not {engine!r}")
    if arch == DSPARK_ARCH:
        raise KimiInputError(f"{draft_config_path}: {DSPARK_REFUSAL}")
    check_export_dir(export_dir)
    state = _training_state(checkpoint)
    if state.get("strategy") != STRATEGY[arch]:
        raise KimiInputError(
            f"{checkpoint}: strategy {state.get('strategy')!r}, expected a {STRATEGY[arch]} checkpoint for {arch}"
        )
    contract = block_contract(draft_config, state, mask_token_id)
    del state
    with staged_export(export_dir) as staging:
        export_hf(str(checkpoint), str(draft_config_path), str(staging))
        finalize_dflash_export(
            staging,
            target_dir=target_dir,
            contract=contract,
            command=command,
            extra={"checkpoint": str(Path(checkpoint).resolve()), **(extra or {})},
        )
    return Path(export_dir)


def _read_state(d: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise KimiInputError(f"{d} has no *.safetensors: not an exported draft")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _check_keys(d: Path, state: Mapping[str, Any], num_layers: int) -> None:
    heads = sorted(k for k in state if k.startswith(DSPARK_HEADS))
    if heads:
        raise KimiInputError(f"{d}: {heads[0]}...: {DSPARK_REFUSAL}")
    prefixed = sorted(k for k in state if k.startswith(TRAINER_PREFIXES))
    if prefixed:
        raise KimiInputError(f"{d}: keys carry trainer prefixes, SGLang would skip them: {prefixed[:4]}")
    want = expected_keys(num_layers)
    missing, unknown = sorted(want - set(state)), sorted(set(state) - want)
    if missing:
        raise KimiInputError(f"{d}: missing keys {missing[:6]} that SGLang's {DFLASH_ARCH} loader fills")
    if unknown:
        raise KimiInputError(f"{d}: keys {unknown[:6]} that SGLang's {DFLASH_ARCH} loader drops silently")


def _sglang_reading(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What SGLang 0.5.14 itself parses from the config (``parse_dflash_draft_config``; imports on the CPU)."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    try:
        parsed = parse_dflash_draft_config(draft_hf_config=dict(cfg))
    except ValueError as exc:
        raise KimiInputError(f"SGLang refuses the DFlash config: {' '.join(str(exc).split())}") from None
    return {
        "target_layer_ids": parsed.target_layer_ids,
        "block_size": parsed.block_size,
        "mask_token_id": parsed.mask_token_id,
        "num_target_layers": parsed.num_target_layers,
        "num_hidden_layers": parsed.num_hidden_layers,
    }


def check_dflash_export(
    export_dir: str | os.PathLike, target_dir: str | os.PathLike | None = None, *, engine: str = "sglang"
) -> dict[str, Any]:
    """Raise :class:`KimiInputError` naming the first problem SGLang's DFLASH would hit or hide; return a summary."""
    from specforge_kimi.targets.checkpoint import inspect_target

    d = Path(export_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise KimiInputError(f"{cfg_path} not found")
    cfg = json.loads(cfg_path.read_text())
    arch = block_arch(cfg)
    if arch == DSPARK_ARCH and engine == "sglang":
        raise KimiInputError(f"{cfg_path}: {DSPARK_REFUSAL}")
    if arch != DFLASH_ARCH:
        raise KimiInputError(f"{cfg_path}: architectures {cfg.get('architectures')} is not [{DFLASH_ARCH!r}]")
    n, hidden = cfg.get("num_hidden_layers"), cfg.get("hidden_size")
    if not isinstance(n, int) or n < 1 or not isinstance(hidden, int):
        raise KimiInputError(f"{cfg_path}: num_hidden_layers {n!r} / hidden_size {hidden!r} are not positive integers")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != n:
        raise KimiInputError(f"{cfg_path}: layer_types has {len(layer_types)} entries for {n} layers")
    dcfg = cfg.get("dflash_config") or {}
    ids, mask, block = dcfg.get("target_layer_ids"), dcfg.get("mask_token_id"), cfg.get("block_size")
    for what, v in (("dflash_config.target_layer_ids", ids), ("dflash_config.mask_token_id", mask)):
        if v is None:
            raise KimiInputError(f"{cfg_path}: no {what}; SGLang would fall back to its default, not what was trained")
    if not isinstance(block, int) or block < 2:
        raise KimiInputError(f"{cfg_path}: block_size {block!r} is not an integer >= 2")
    if not ids or list(ids) != sorted(set(ids)):
        raise KimiInputError(f"{cfg_path}: target_layer_ids {ids} must be distinct and ascending")
    state = _read_state(d)
    _check_keys(d, state, n)
    fc = tuple(state["fc.weight"].shape)
    if fc != (hidden, len(ids) * hidden):
        raise KimiInputError(f"{d}: fc.weight {list(fc)} does not map {len(ids)}x{hidden} target states to {hidden}")
    ours = {
        "target_layer_ids": list(ids),
        "block_size": block,
        "mask_token_id": mask,
        "num_target_layers": cfg.get("num_target_layers"),
        "num_hidden_layers": n,
    }
    theirs = _sglang_reading(cfg)
    if theirs != ours:
        raise KimiInputError(f"{cfg_path}: SGLang reads {theirs}, we read {ours}")
    summary = {"architecture": DFLASH_ARCH, "keys": len(state), "hidden_size": hidden, **ours}
    if isinstance(ours["num_target_layers"], int):
        AuxLayers.from_dflash(ids, ours["num_target_layers"])  # ids 0..L-2, one line otherwise
    if target_dir is not None:
        info = inspect_target(target_dir)
        if hidden != info.hidden_size:
            raise KimiInputError(f"draft hidden_size {hidden} does not match the target's {info.hidden_size}")
        if ours["num_target_layers"] != info.num_layers:
            raise KimiInputError(
                f"{cfg_path}: num_target_layers {ours['num_target_layers']}, the target has {info.num_layers} layers"
            )
        if not 0 <= mask < info.vocab_size:
            raise KimiInputError(
                f"{cfg_path}: mask_token_id {mask} is outside the target's vocab 0..{info.vocab_size - 1}"
            )
        summary["captured_positions"] = list(AuxLayers.from_dflash(ids, info.num_layers).positions)
    return summary


__all__ = [
    "BLOCK_ARCHS",
    "DFLASH_ARCH",
    "DSPARK_ARCH",
    "block_arch",
    "block_contract",
    "check_dflash_export",
    "expected_keys",
    "export_block_draft",
    "export_hf",
    "finalize_dflash_export",
]
