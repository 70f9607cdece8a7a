"""Export a SpecForge EAGLE-3 checkpoint for SGLang or vLLM, per draft architecture.

Scope: SpecForge 0.2.0 ``eagle3`` checkpoints of two drafts -- the Llama-style
``LlamaForCausalLMEagle3`` and our MLA draft (:mod:`.mla_eagle3`, ``Eagle3DeepseekV2ForCausalLM``)
-- written as one ``model.safetensors`` + ``config.json`` + ``provenance.json`` in the layout
each engine's loader reads. A block draft (``DFlashDraftModel``) exports through :mod:`.block_export`, for
SGLang only (:data:`ARCH_ENGINES`); :func:`export_draft` refuses it with one line. The frozen embedding is never exported: both engines share the
target's. Aux layer ids are converted once, through :class:`specforge_kimi.targets.layer_ids.AuxLayers`:
the draft config carries SpecForge ids (SGLang's convention: +1 shift when the first id is 1);
every export writes the captured *positions*, which SGLang then uses unshifted and vLLM uses as
is (it never shifts).

What each loader reads (source read, not run here; the GPU test loads the SGLang exports):

SGLang 0.5.14
    ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``): ``midlayer.*``, ``fc``, ``norm``,
    ``lm_head``, ``d2t`` (int64 offsets -> ``hot_token_id``), ``t2d`` skipped; aux ids from
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` -- as SpecForge's own export writes it.
    ``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``, ``load_weights``): a name
    ``layers.0.X`` becomes ``midlayer.X``, everything but ``lm_head.*`` gets ``model.``;
    ``q_a_proj`` + ``kv_a_proj_with_mqa`` are concatenated (q rows first) into
    ``fused_qkv_a_proj_with_mqa``, ``gate_proj``/``up_proj`` into ``gate_up_proj``; ``d2t`` ->
    ``hot_token_id``; ``t2d`` skipped; unknown names are skipped with only a warning (hence the
    key checks here). Config: ``model_type: kimi_k2`` (SGLang's DeepseekV3Config alias "for
    kimi_k25_eagle3", ``utils/hf_transformers/common.py``), ``architectures:
    [Eagle3DeepseekV2ForCausalLM]`` (also what makes ``model_config.py`` pick MLA), aux count
    and ids from ``eagle_config.eagle_aux_hidden_state_layer_ids``.

vLLM (vllm-project/vllm, read at the commits named)
    ``model_executor/models/registry.py``: ``LlamaForCausalLMEagle3`` -> ``llama_eagle3.
    Eagle3LlamaForCausalLM``; ``Eagle3DeepseekV2ForCausalLM`` (and ``...V3...``) ->
    ``deepseek_eagle3.Eagle3DeepseekV2ForCausalLM``.
    ``llama_eagle3.py`` @00bd1493: ``midlayer.`` -> ``layers.0.``, q/k/v and gate/up stacked,
    ``fc`` input ``3 * target_hidden_size``, ``eagle_config.use_aux_hidden_state``;
    ``d2t`` -> ``draft_id_to_target_id``, ``t2d`` skipped.
    ``deepseek_eagle3.py`` @03590193: an MLA EAGLE-3 draft exists. ``midlayer.`` ->
    ``layers.0.``, ``q_a_proj``/``kv_a_proj_with_mqa`` stacked into ``fused_qkv_a_proj``,
    gate/up stacked, ``fc`` over ``num_aux_hidden_states`` (else
    ``len(eagle_config.eagle_aux_hidden_state_layer_ids)``, else 3) x ``target_hidden_size``,
    ``fc_norm`` and ``norm_output`` as in SGLang, plus a vLLM-only ``norm_before_residual``
    (written ``false``: SGLang has no such variant); rope forced to ``deepseek_yarn`` when the
    config has ``rope_scaling``; everything but ``lm_head`` prefixed ``model.``, ``d2t`` ->
    ``draft_id_to_target_id``, ``t2d`` skipped, ``embed_tokens`` skipped when absent.
    ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` @0cfdd2e1
    (``get_eagle3_aux_layers_from_config``): aux ids from the draft config's TOP-LEVEL
    ``eagle_aux_hidden_state_layer_ids``; without them vLLM falls back to the target's default
    layers with only a warning. vLLM's model_type for the MLA draft: ``deepseek_v3`` (known to
    transformers; we did not find ``kimi_k2`` registered in vLLM).

Refused rather than exported: a Llama-style draft with YaRN rope (SpecForge trains cos/sin
unscaled, the engines apply mscale; docs/decisions/009-drafts-and-export.md) or with a
``norm_output`` key (SpecForge's Llama draft reads it as "norm before lm_head", default true;
SGLang's as "hand the normed state to the next step", default false -- only an absent key means the same to both).

Both MLA exports write the decoder layer as ``layers.0.*`` (both loaders accept it directly);
the Llama exports keep SpecForge's ``midlayer.*``. Not verified on a real vLLM: the vLLM
exports are checked against the names above only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from specforge_kimi.durable import recover_dir, refuse_link, staged_dir
from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import AuxLayers

ENGINES = ("sglang", "vllm")
LLAMA_ARCH = "LlamaForCausalLMEagle3"
MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"
#: the block draft, exported by :mod:`.block_export` (which imports this module, not the other way)
DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "DSparkDraftModel"
#: the EAGLE-3 drafts this module exports itself
EAGLE3_ARCHS = (LLAMA_ARCH, MLA_ARCH)
ARCHS = (*EAGLE3_ARCHS, DFLASH_ARCH)
#: the engines each architecture exports for: the block draft (:mod:`.block_export`) for SGLang's DFLASH only
ARCH_ENGINES = {LLAMA_ARCH: ENGINES, MLA_ARCH: ENGINES, DFLASH_ARCH: ("sglang",)}
#: model_type each engine resolves the MLA draft config with.
MLA_MODEL_TYPE = {"sglang": "kimi_k2", "vllm": "deepseek_v3"}
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "provenance.json"


def _engine(engine: str) -> str:
    if engine not in ENGINES:
        raise KimiInputError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    return engine


def _arch(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in EAGLE3_ARCHS:
        raise KimiInputError(f"draft architectures {archs} is not one of {list(EAGLE3_ARCHS)}")
    return archs[0]


# ---- names ------------------------------------------------------------------------------------
def serving_state(state: Mapping[str, Any], arch: str, engine: str) -> dict[str, Any]:
    """Trainer (SpecForge) draft state -> the names ``engine`` loads for ``arch``.

    Drops the embedding (the engines share the target's), keeps ``d2t`` int64 / ``t2d`` bool,
    renames ``midlayer.`` -> ``layers.0.`` for the MLA draft.
    """
    import torch

    _engine(engine)
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        if "embed" in name.lower():
            continue
        if name.startswith(("draft_model.", "module.", "_orig_mod.")):
            raise KimiInputError(f"trainer prefix in draft state key {name!r}: the engines would skip it")
        if arch == MLA_ARCH and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        out[name] = tensor.contiguous()
    for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        if key not in out:
            raise KimiInputError(f"draft state has no {key!r} (vocab mapping)")
        if out[key].dtype != dtype:
            raise KimiInputError(f"{key} is {out[key].dtype}, the engines expect {dtype}")
    return out


def trainer_state(state: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """Inverse of :func:`serving_state` (either engine): exported names -> SpecForge names."""
    out = {}
    for name, tensor in state.items():
        if arch == MLA_ARCH and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        out[name] = tensor
    return out


# ---- config -----------------------------------------------------------------------------------
def _legacy_rope(cfg: dict[str, Any]) -> None:
    """Carry both rope spellings: transformers 5 ``rope_parameters`` and legacy
    ``rope_scaling`` + top-level ``rope_theta`` (older readers; vLLM's MLA draft reads
    ``rope_scaling``)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params:
        if "rope_theta" in params:
            cfg["rope_theta"] = params["rope_theta"]
        kind = params.get("rope_type", params.get("type"))
        if kind not in (None, "default") and not scaling:
            cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.get("rope_theta", 10000.0)}


def _rope_type(cfg: Mapping[str, Any]) -> str | None:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return rope.get("rope_type") or rope.get("type")


def serving_config(draft_config: Mapping[str, Any], engine: str, aux: AuxLayers) -> dict[str, Any]:
    """The ``config.json`` ``engine`` reads, from the training draft config + captured positions."""
    _engine(engine)
    cfg = json.loads(json.dumps(dict(draft_config)))  # deep copy, JSON types only
    arch = _arch(cfg)
    if arch == LLAMA_ARCH and _rope_type(cfg) == "yarn":
        # docs/decisions/009-drafts-and-export.md: SpecForge trains a Llama draft's YaRN with cos/sin scale 1.0,
        # SGLang serves it with mscale; vLLM's Llama rope applies YaRN's mscale as well. Plain rope_theta only.
        raise KimiInputError(
            "the Llama-style draft carries YaRN rope scaling, which SpecForge trains and the "
            "engines serve differently; train it with plain rope_theta"
        )
    if arch == LLAMA_ARCH and "norm_output" in cfg:
        # Same key, two meanings: SpecForge's Llama draft (default True) applies the final norm
        # before lm_head; SGLang's (default False) always does and uses the flag to hand the
        # NORMED state to the next step. Only the absent key means the same thing to both.
        raise KimiInputError(
            "the Llama-style draft config sets norm_output, which SpecForge 0.2.0 and SGLang read "
            "differently (logits norm vs next-step state); remove the key"
        )
    n_aux = len((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [None] * 3)
    if len(aux.positions) != n_aux:
        raise KimiInputError(f"the draft's fc takes {n_aux} aux states, {len(aux.positions)} aux layers given")
    ids = aux.to_engine(engine)
    cfg["architectures"] = [arch]
    cfg["tie_word_embeddings"] = False
    cfg["num_hidden_layers"] = 1
    cfg.setdefault("draft_vocab_size", cfg.get("vocab_size"))
    cfg["eagle_config"] = {
        **(cfg.get("eagle_config") or {}),
        "eagle_aux_hidden_state_layer_ids": ids,
        "use_aux_hidden_state": True,
    }
    if engine == "vllm":
        # eagle3_utils.get_eagle3_aux_layers_from_config reads the top-level key only.
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    if arch == MLA_ARCH:
        cfg["model_type"] = MLA_MODEL_TYPE[engine]
        if engine == "vllm":
            cfg["norm_before_residual"] = False
        for key in ("fc_norm", "norm_output"):
            cfg[key] = bool(cfg.get(key, False))
    _legacy_rope(cfg)
    return cfg


# ---- checks -----------------------------------------------------------------------------------
def expected_keys(config: Mapping[str, Any], engine: str) -> set[str]:
    """Every key the export must hold (and nothing else) for ``config``'s architecture."""
    arch = _arch(config)
    _engine(engine)
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    keys = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    if arch == LLAMA_ARCH:
        layer = "midlayer."
        keys |= {layer + f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")}
    else:
        layer = "layers.0."
        keys |= {
            layer + f"self_attn.{p}.weight"
            for p in (
                "q_a_proj",
                "q_a_layernorm",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_a_layernorm",
                "kv_b_proj",
                "o_proj",
            )
        }
    keys |= {layer + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    keys |= {layer + f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    if config.get("fc_norm") or config.get("use_aux_norm"):
        keys |= {f"fc_norm.{i}.weight" for i in range(n_aux)}
    return keys


def check_export(export_dir: str | os.PathLike, engine: str) -> dict[str, Any]:
    """Raise :class:`KimiInputError` naming the first problem in an export; return a summary."""
    import torch
    from safetensors.torch import load_file

    d = Path(export_dir)
    cfg = json.loads((d / "config.json").read_text())
    arch = _arch(cfg)
    state = load_file(str(d / WEIGHTS_FILE))
    want = expected_keys(cfg, engine)
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise KimiInputError(
            f"{d}: keys differ from what {engine} loads for {arch}: missing {missing[:6]}, "
            f"unexpected {extra[:6]} (unexpected keys are skipped silently)"
        )
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if engine == "vllm" and cfg.get("eagle_aux_hidden_state_layer_ids") != ids:
        raise KimiInputError(f"{d}: vLLM reads top-level eagle_aux_hidden_state_layer_ids; it must equal {ids}")
    hidden = cfg["hidden_size"]
    target_hidden = cfg.get("target_hidden_size") or hidden
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if tuple(state["fc.weight"].shape) != (hidden, len(ids) * target_hidden):
        raise KimiInputError(f"{d}: fc.weight {list(state['fc.weight'].shape)} does not take {len(ids)} aux states")
    if tuple(state["lm_head.weight"].shape) != (draft_vocab, hidden):
        raise KimiInputError(f"{d}: lm_head.weight is not [draft_vocab_size={draft_vocab}, {hidden}]")
    d2t, t2d = state["d2t"], state["t2d"]
    if (
        d2t.dtype != torch.int64
        or t2d.dtype != torch.bool
        or d2t.numel() != draft_vocab
        or t2d.numel() != cfg["vocab_size"]
        or int(t2d.sum()) != draft_vocab
    ):
        raise KimiInputError(
            f"{d}: d2t/t2d are not int64[{draft_vocab}] / bool[{cfg['vocab_size']}] with {draft_vocab} set"
        )
    if not torch.equal(torch.nonzero(t2d).flatten(), torch.arange(draft_vocab) + d2t):
        raise KimiInputError(f"{d}: d2t and t2d disagree")
    if arch == MLA_ARCH:
        if cfg.get("model_type") != MLA_MODEL_TYPE[engine]:
            raise KimiInputError(
                f"{d}: model_type {cfg.get('model_type')!r}, {engine} needs {MLA_MODEL_TYPE[engine]!r}"
            )
        a = "layers.0.self_attn."
        q_a, kv_a = state[a + "q_a_proj.weight"], state[a + "kv_a_proj_with_mqa.weight"]
        if q_a.shape[1] != 2 * hidden or kv_a.shape[1] != 2 * hidden:
            raise KimiInputError(f"{d}: the MLA down-projections must take 2*hidden={2 * hidden} inputs")
        if kv_a.shape[0] != cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] or q_a.shape[0] != cfg["q_lora_rank"]:
            raise KimiInputError(f"{d}: MLA down-projection widths do not match q_lora/kv_lora/rope dims")
    elif _rope_type(cfg) == "yarn":
        raise KimiInputError(f"{d}: a Llama-style draft with YaRN rope (trained and served differently)")
    return {
        "engine": engine,
        "architecture": arch,
        "keys": len(state),
        "eagle_aux_hidden_state_layer_ids": ids,
        "draft_vocab_size": draft_vocab,
        "hidden_size": hidden,
    }


# ---- the export -------------------------------------------------------------------------------
def staged_export(output_dir: str | os.PathLike) -> AbstractContextManager[Path]:
    """The export directory written whole: yields a staging sibling, swapped in by one rename when the
    block ends (:func:`specforge_kimi.durable.staged_dir`), so a crash at any point leaves the old export
    whole or the new one whole, never new weights beside an old ``config.json``. An existing
    ``output_dir`` is replaced only when empty or a previous export (it holds ``provenance.json``);
    anything else, and a link, is refused with one line before anything is written."""
    check_export_dir(output_dir)
    return staged_dir(output_dir)


def check_export_dir(output_dir: str | os.PathLike) -> None:
    """Refuse (one line) an export directory :func:`staged_export` would not replace; call it before the
    slow part. An export a crash left half-swapped is put back first."""
    out = Path(output_dir)
    refuse_link(out, "export directory")
    recover_dir(out)
    if out.is_dir() and any(out.iterdir()) and not (out / PROVENANCE_FILE).is_file():
        raise KimiInputError(
            f"export directory {out} exists and is not a previous export (no {PROVENANCE_FILE}); "
            "refusing to replace it: remove it or pick another directory"
        )


def export_draft(
    checkpoint: str | os.PathLike,
    draft_config_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    engine: str,
    num_layers: int,
    vocab_mapping_path: str | None = None,
    target_dir: str | None = None,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Export a SpecForge eagle3 checkpoint (``training_state.pt``, a step dir or an output dir)
    for ``engine``; returns the provenance written beside it.

    The weights go through SpecForge's own ``materialize_draft`` (its architecture check and
    missing/unexpected-key validation), so the MLA draft needs :func:`specforge_kimi.register`
    first. ``num_layers`` is the target's depth (for the aux-id conversion); with
    ``target_dir`` the target's hidden/vocab are checked against the draft too.
    """
    from safetensors.torch import save_file
    from specforge.export.checkpoint_io import materialize_draft, resolve_training_state

    from specforge_kimi.provenance import canonical_hash, file_hash, patch_hashes, provenance

    _engine(engine)
    draft_config = json.loads(Path(draft_config_path).read_text())
    if (draft_config.get("architectures") or [None])[0] in (DFLASH_ARCH, DSPARK_ARCH):
        _refuse_block(engine)
    check_export_dir(output_dir)
    arch = _arch(draft_config)
    specforge_ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not specforge_ids:
        raise KimiInputError(
            f"{draft_config_path}: no eagle_config.eagle_aux_hidden_state_layer_ids; the export "
            "must name the layers the draft was trained on"
        )
    aux = AuxLayers.from_specforge(specforge_ids, num_layers)
    target_info = None
    if target_dir is not None:
        from specforge_kimi.targets.checkpoint import inspect_target

        info = inspect_target(target_dir)
        if (
            info.num_layers != num_layers
            or info.hidden_size != (draft_config.get("target_hidden_size") or draft_config["hidden_size"])
            or info.vocab_size != draft_config["vocab_size"]
        ):
            raise KimiInputError(
                f"target {target_dir} (layers {info.num_layers}, hidden {info.hidden_size}, vocab "
                f"{info.vocab_size}) does not match the draft config / num_layers={num_layers}"
            )
        target_info = {
            "path": str(Path(target_dir).resolve()),
            "num_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
        }
    state = resolve_training_state(str(checkpoint))
    if state.get("strategy") != "eagle3":
        raise KimiInputError(f"{checkpoint}: strategy {state.get('strategy')!r}, expected an eagle3 checkpoint")
    model = materialize_draft(state, str(draft_config_path), vocab_mapping_path=vocab_mapping_path)
    weights = serving_state(model.state_dict(), arch, engine)
    cfg = serving_config(draft_config, engine, aux)

    with staged_export(output_dir) as out:
        save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        summary = check_export(out, engine)
        prov = provenance(
            command=command,
            config=cfg,
            extra={
                "engine": engine,
                "architecture": arch,
                "checkpoint": str(Path(checkpoint).resolve()),
                "training_draft_config_sha256": canonical_hash(draft_config),
                "vocab_mapping_sha256": file_hash(vocab_mapping_path) if vocab_mapping_path else None,
                "aux_layers": {
                    "specforge_ids": list(specforge_ids),
                    "captured_positions": list(aux.positions),
                    "engine_ids": aux.to_engine(engine),
                    "num_layers": num_layers,
                },
                "target": target_info,
                "patches_sha256": patch_hashes(),
                "weights_sha256": {WEIGHTS_FILE: file_hash(out / WEIGHTS_FILE)},
                "check": summary,
            },
        )
        (out / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    return prov


def _refuse_block(engine: str) -> None:
    """A block draft is not exported here: one line naming where it is (and that vLLM has no DFlash export)."""
    if engine not in ARCH_ENGINES[DFLASH_ARCH]:
        raise KimiInputError(f"block drafts export for {list(ARCH_ENGINES[DFLASH_ARCH])} only, not {engine!r}")
    raise KimiInputError(
        "a block draft exports through specforge-kimi export (drafts.export.export_run_draft -> drafts.block_export)"
    )


def load_exported_draft(export_dir: str | os.PathLike, *, dtype: Any = None, embedding: Any = None):
    """Rebuild the training-side draft module from an export (our class / SpecForge's Llama
    draft), strict on keys except the embedding, which comes from ``embedding`` if given
    (the engines take it from the target)."""
    import torch
    from safetensors.torch import load_file

    d = Path(export_dir)
    cfg = json.loads((d / "config.json").read_text())
    arch = _arch(cfg)
    state = trainer_state(load_file(str(d / WEIGHTS_FILE)), arch)
    if arch == MLA_ARCH:
        from specforge_kimi.drafts.mla_eagle3 import (
            Eagle3DeepseekV2ForCausalLM,
            KimiMLAEagle3Config,
        )

        cfg.pop("norm_before_residual", None)  # always false in our exports
        model = Eagle3DeepseekV2ForCausalLM(KimiMLAEagle3Config.from_dict(cfg))
    else:
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from transformers import LlamaConfig

        model = LlamaForCausalLMEagle3(LlamaConfig.from_dict(cfg), attention_backend="sdpa")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "embed" not in k]:
        raise KimiInputError(f"{d}: reload mismatch: missing {missing}, unexpected {unexpected}")
    if embedding is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embedding)
    return model.to(dtype) if dtype is not None else model


__all__ = [
    "ARCHS",
    "ARCH_ENGINES",
    "EAGLE3_ARCHS",
    "ENGINES",
    "LLAMA_ARCH",
    "MLA_ARCH",
    "MLA_MODEL_TYPE",
    "check_export",
    "expected_keys",
    "export_draft",
    "load_exported_draft",
    "serving_config",
    "serving_state",
    "trainer_state",
]
