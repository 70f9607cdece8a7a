"""Exported drafts: K2.5 eagle_config, provenance, and the checks SGLang's loader needs.

:func:`export_run_draft` and :func:`check_any_export` dispatch by the draft's architecture: EAGLE-3 here and in
:mod:`.export_engines`, block drafts (DFlash) in :mod:`.block_export`.

Scope: Llama-style EAGLE-3 drafts exported by SpecForge's ``export --to sglang``
(``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, int64 ``d2t`` offsets,
bool ``t2d``). SpecForge writes the weights; we write ``eagle_config`` with the aux layer ids in
SGLang's convention (see :mod:`layer_ids`), a ``provenance.json`` beside it, and refuse an
export whose keys, shapes or ids would make SGLang serve a silently useless draft (SGLang skips
unexpected keys and falls back to default aux layers without an error). :func:`export_run_draft`
builds the whole directory in a staging sibling and swaps it in by one rename
(:func:`specforge_kimi.drafts.export_engines.staged_export`): an existing export is replaced whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError
from specforge_kimi.provenance import file_hash, provenance, target_record
from specforge_kimi.targets.layer_ids import AuxLayers

REQUIRED_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
TRAINER_PREFIXES = ("draft_model.", "module.", "_orig_mod.", "_fsdp_wrapped_module.", "model.")
ARCH = "LlamaForCausalLMEagle3"


def export_sglang(checkpoint_dir: str, draft_config_path: str, output_dir: str, vocab_mapping_path: str) -> str:
    """``specforge export --to sglang``: write an SGLang EAGLE-3 draft directory, return it.

    Calls ``specforge.export.to_sglang.export_to_sglang``: ``config.json`` (the draft config,
    ``LlamaForCausalLMEagle3``, legacy ``rope_scaling``/``rope_theta`` mirrored) and
    ``model.safetensors`` with ``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight``, ``d2t`` (int64 offsets) and ``t2d`` (bool), no embedding.
    """
    from specforge.export.to_sglang import export_to_sglang

    return export_to_sglang(
        checkpoint_dir,
        draft_config_path,
        output_dir,
        vocab_mapping_path=vocab_mapping_path,
    )


def _read_state(export_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(export_dir.glob("*.safetensors"))
    if not files:
        raise KimiInputError(f"{export_dir} has no *.safetensors: not an exported draft")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def finalize_sglang_export(
    export_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike,
    aux: AuxLayers,
    command: Sequence[str] | None = None,
    extra: dict | None = None,
) -> dict:
    """Write K2.5's ``eagle_config`` and ``provenance.json`` into a SpecForge export; check it."""
    from specforge_kimi.targets.checkpoint import inspect_target

    d = Path(export_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise KimiInputError(f"{cfg_path} not found: run the SpecForge export first")
    cfg = json.loads(cfg_path.read_text())
    info = inspect_target(target_dir)
    if aux.num_layers != info.num_layers:
        raise KimiInputError(f"aux ids were validated for {aux.num_layers} layers, target has {info.num_layers}")
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux.sglang_ids(), "use_aux_hidden_state": True}
    write_atomic(cfg_path, json.dumps(cfg, indent=2, sort_keys=True))
    check_sglang_export(d, target_dir=target_dir)
    prov = provenance(
        command=command,
        config=cfg,
        extra={
            "target": target_record(target_dir, info),
            "aux_layers": {
                "captured_positions": list(aux.positions),
                "sglang_ids": aux.sglang_ids(),
                "vllm_ids": aux.vllm_ids(),
                "hf_indices": aux.hf_indices(),
            },
            "weights_sha256": {f.name: file_hash(f) for f in sorted(d.glob("*.safetensors"))},
            **(extra or {}),
        },
    )
    write_atomic(d / "provenance.json", json.dumps(prov, indent=2, sort_keys=True))
    return prov


def export_run_draft(
    checkpoint: str | os.PathLike,
    draft_config_path: str | os.PathLike,
    export_dir: str | os.PathLike,
    *,
    vocab_mapping_path: str,
    target_dir: str | os.PathLike | None,
    aux: AuxLayers | None,
    command: Sequence[str] | None = None,
    extra: dict | None = None,
    mask_token_id: int | None = None,
) -> Path:
    """Export a run's SpecForge checkpoint for SGLang, by the draft's architecture.

    Block drafts (``DFlashDraftModel``; ``DSparkDraftModel`` refused): :func:`specforge_kimi.drafts.block_export.
    export_block_draft`, their target layers from the draft config (``aux``, EAGLE-3's, is not read), with
    ``mask_token_id`` the recipe's (checked against the checkpoint's).

    Llama-style: SpecForge's own ``export --to sglang`` then :func:`finalize_sglang_export`. MLA
    (``Eagle3DeepseekV2ForCausalLM``): :func:`specforge_kimi.drafts.export_engines.export_draft`,
    since SGLang's ``kimi_k25_eagle3.py`` loads ``layers.0.*`` where SpecForge's exporter writes
    ``midlayer.*``. Both write captured positions as aux ids and provenance. ``aux`` must be the
    run's aux layers (checked against the draft config's ids). ``target_dir`` checks the draft
    against the target; the Llama path needs it (its ``eagle_config`` is written from it)."""
    from specforge_kimi.drafts.export_engines import MLA_ARCH, check_export_dir, staged_export

    cfg = json.loads(Path(draft_config_path).read_text())
    from specforge_kimi.drafts.block_export import block_arch, export_block_draft

    if block_arch(cfg) is not None:
        if target_dir is None:
            raise KimiInputError("exporting a block draft needs the target directory")
        return export_block_draft(
            checkpoint,
            draft_config_path,
            export_dir,
            target_dir=target_dir,
            mask_token_id=mask_token_id,
            command=command,
            extra=extra,
        )
    check_export_dir(export_dir)
    if aux is None:
        raise KimiInputError("exporting an EAGLE-3 draft needs the run's aux layers")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and AuxLayers.from_specforge(ids, aux.num_layers).positions != aux.positions:
        raise KimiInputError(
            f"{draft_config_path}: aux ids {ids} capture other layers than the run's {list(aux.specforge_ids())}"
        )
    if MLA_ARCH in (cfg.get("architectures") or []):
        from specforge_kimi.drafts.export_engines import export_draft

        export_draft(
            checkpoint,
            draft_config_path,
            export_dir,
            engine="sglang",
            num_layers=aux.num_layers,
            vocab_mapping_path=vocab_mapping_path,
            target_dir=target_dir,
            command=command,
        )
        return Path(export_dir)
    if target_dir is None:
        raise KimiInputError("exporting a Llama-style draft needs the target directory")
    with staged_export(export_dir) as staging:
        export_sglang(str(checkpoint), str(draft_config_path), str(staging), vocab_mapping_path)
        finalize_sglang_export(staging, target_dir=target_dir, aux=aux, command=command, extra=extra)
    return Path(export_dir)


def check_any_export(export_dir: str | os.PathLike, target_dir: str | os.PathLike | None = None) -> dict:
    """The SGLang export check of the draft's architecture (``config.json``'s ``architectures``): Llama-style
    EAGLE-3 (:func:`check_sglang_export`), MLA EAGLE-3 (``export_engines.check_export``) or a block draft
    (``block_export.check_dflash_export``); a summary naming the architecture, or one line on the first problem."""
    from specforge_kimi.drafts.block_export import block_arch, check_dflash_export
    from specforge_kimi.drafts.export_engines import MLA_ARCH, check_export

    cfg_path = Path(export_dir) / "config.json"
    if not cfg_path.is_file():
        raise KimiInputError(f"{cfg_path} not found")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise KimiInputError(f"{cfg_path}: not valid JSON ({exc.msg})") from None
    if block_arch(cfg) is not None:
        return check_dflash_export(export_dir, target_dir)
    if cfg.get("architectures") == [MLA_ARCH]:
        return check_export(export_dir, "sglang")
    return {"architecture": ARCH, **check_sglang_export(export_dir, target_dir=target_dir)}


def check_sglang_export(export_dir: str | os.PathLike, *, target_dir: str | os.PathLike | None = None) -> dict:
    """Raise :class:`KimiInputError` naming the first problem; return a summary when sound."""
    from specforge_kimi.targets.checkpoint import inspect_target

    d = Path(export_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise KimiInputError(f"{cfg_path} not found")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("architectures") != [ARCH]:
        raise KimiInputError(f"{cfg_path}: architectures {cfg.get('architectures')} is not [{ARCH!r}]")
    state = _read_state(d)
    prefixed = sorted(k for k in state if k.startswith(TRAINER_PREFIXES))
    if prefixed:
        raise KimiInputError(f"{d}: keys carry trainer prefixes, SGLang would skip them: {prefixed[:4]}")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise KimiInputError(f"{d}: missing keys {missing} that SGLang's {ARCH} loader reads")
    if not any(k.startswith("midlayer.") for k in state):
        raise KimiInputError(f"{d}: no midlayer.* weights (the draft decoder layer)")
    hidden = cfg.get("hidden_size")
    draft_vocab = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    fc, head, d2t, t2d = state["fc.weight"], state["lm_head.weight"], state["d2t"], state["t2d"]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    if rope_type == "yarn":
        # SpecForge trains a Llama-style draft's YaRN rope with cos/sin scale 1.0; SGLang's Llama
        # draft applies YaRN's mscale (~1.416 for K2.5's factor 64), so served attention would
        # differ from trained attention. Drafts see <= max_length tokens: plain rope is correct.
        raise KimiInputError(
            f"{cfg_path}: the draft carries YaRN rope scaling, which SpecForge training and "
            "SGLang serving apply differently (scale 1.0 vs mscale); drop rope_scaling from "
            "the draft config and train with plain rope_theta"
        )
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise KimiInputError(
            f"{cfg_path}: no eagle_config.eagle_aux_hidden_state_layer_ids; SGLang would "
            "fall back to its default layers, not the ones the draft was trained on"
        )
    if tuple(fc.shape) != (hidden, len(ids) * hidden):
        raise KimiInputError(f"{d}: fc.weight {list(fc.shape)} does not map {len(ids)}x{hidden} aux states to {hidden}")
    if tuple(head.shape) != (draft_vocab, hidden):
        raise KimiInputError(
            f"{d}: lm_head.weight {list(head.shape)} is not [draft_vocab_size={draft_vocab}, {hidden}]"
        )
    if str(d2t.dtype) != "torch.int64" or d2t.numel() != draft_vocab:
        raise KimiInputError(f"{d}: d2t must be int64[{draft_vocab}] offsets, got {d2t.dtype}[{d2t.numel()}]")
    if str(t2d.dtype) != "torch.bool" or int(t2d.sum()) != draft_vocab:
        raise KimiInputError(
            f"{d}: t2d must be bool with {draft_vocab} entries set, got {t2d.dtype} with {int(t2d.sum())}"
        )
    import torch

    targets = torch.arange(draft_vocab) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= t2d.numel() or not bool(t2d[targets].all()):
        raise KimiInputError(f"{d}: d2t and t2d disagree (draft id + d2t offset must land on a t2d entry)")
    summary = {
        "hidden_size": hidden,
        "draft_vocab_size": draft_vocab,
        "target_vocab_size": int(t2d.numel()),
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "keys": len(state),
    }
    if target_dir is not None:
        info = inspect_target(target_dir)
        if hidden != info.hidden_size:
            raise KimiInputError(f"draft hidden_size {hidden} does not match the target's {info.hidden_size}")
        if t2d.numel() != info.vocab_size:
            raise KimiInputError(f"draft t2d covers a vocab of {t2d.numel()}, the target's is {info.vocab_size}")
        aux = AuxLayers.from_sglang(ids, info.num_layers)
        summary["captured_positions"] = list(aux.positions)
    return summary


# ---- the export command -----------------------------------------------------------------------
def add_arguments(p) -> None:
    """``specforge-kimi export``: a recipe's newest checkpoint (as ``launch`` exports at the end), or one named."""
    p.description = (
        "Export a SpecForge checkpoint for SGLang, by the draft's architecture: EAGLE-3 (Llama-style or MLA) with "
        "K2.5 aux ids, or a DFlash block draft for SGLang's DFLASH; provenance.json beside it, checked."
    )
    p.add_argument(
        "--recipe", help="export the recipe's newest checkpoint into OUTPUT_DIR/export-sglang, as launch does"
    )
    p.add_argument("--checkpoint", help="training_state.pt, a {run_id}-step{N} directory or a run output_dir")
    p.add_argument("--draft-config", help="the draft config the run trained (its rendered draft_config.json)")
    p.add_argument("--target", help="target checkpoint directory (its layers, width and vocab are checked)")
    p.add_argument("--out", help="export directory (replaced whole when it holds a previous export)")
    p.add_argument("--vocab-mapping", default=None, help="EAGLE-3: the draft vocab mapping (d2t/t2d) the run used")
    p.add_argument(
        "--mask-token-id", type=int, default=None, help="block drafts: the mask id trained with (checked, not needed)"
    )


def run(args) -> int:
    """The export of one named checkpoint (``--recipe`` is the CLI's: it compiles the plan, a higher layer)."""
    import sys

    given = {"--checkpoint": args.checkpoint, "--draft-config": args.draft_config, "--target": args.target}
    missing = [flag for flag, v in {**given, "--out": args.out}.items() if not v]
    if missing:
        raise KimiInputError(f"pass --recipe, or {', '.join(missing)}")
    from specforge_kimi.targets.checkpoint import inspect_target

    cfg = json.loads(Path(args.draft_config).read_text())
    layers = inspect_target(args.target).num_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from specforge_kimi.drafts.block_export import block_arch

    aux = None if block_arch(cfg) else AuxLayers.from_specforge(ids or [], layers)
    out = export_run_draft(
        args.checkpoint,
        args.draft_config,
        args.out,
        vocab_mapping_path=args.vocab_mapping,
        target_dir=args.target,
        aux=aux,
        command=sys.argv,
        mask_token_id=args.mask_token_id,
    )
    print(f"exported draft: {out}")
    print(json.dumps(check_any_export(out, args.target), indent=2))
    return 0
