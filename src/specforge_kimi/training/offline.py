"""Run SpecForge 0.2.0's own offline EAGLE-3 (or DFlash block-draft) training in this process.

:func:`train_offline` builds a SpecForge run config (the pydantic
``specforge.config.Config``: ``deployment.mode: local_colocated``, offline because
``data.hidden_states_path`` is set, ``training.strategy: eagle3``), writes it as
``<output_dir>/run_config.yaml``, and runs it through the code path of ``specforge train -c``:
``resolve_run`` -> ``build_launch_plan`` (must be an in-process ``worker`` plan with role
``all``) -> ``specforge.cli._config_for_role`` -> ``bind_run`` -> ``specforge.cli._train``,
which bootstraps a one-rank ``env://`` rendezvous on 127.0.0.1, initialises the process group
(gloo on a CPU host, nccl with CUDA), builds the draft / ``OnlineEagle3Model`` / frozen
``TargetHead`` / ``BF16Optimizer`` and calls ``Trainer.fit()``. No torchrun, no subprocess, so
registrations and shims made in this process are active. The distributed environment
variables ``_train`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``FSDP_SHARDING``) are restored afterwards. Without CUDA,
:func:`specforge_kimi.training.cpu_shims.install_cpu_shims` runs first.

Metrics come from SpecForge's TensorBoard tracker (``tracking.report_to: tensorboard``,
``training.log_interval: 1``), which writes ``<output_dir>/runs/events.out.tfevents.*`` with one
scalar per optimizer step: ``train/loss`` (the objective that is back-propagated:
``sum_i 0.8**i * ploss_i`` over TTT positions), ``train/ploss_{i}``, ``train/acc_{i}``,
``train/acc``, ``train/acceptance_rate_{i}``, ``train/lr``, ``train/grad_norm`` and
``train/perf/*``. SpecForge 0.2.0 has no jsonl/local tracker and only prints its console
metrics; the event files are its structured output, read back here with TensorBoard's
``EventAccumulator`` (the ``tensorboard`` package is needed; it ships with this venv).

What SpecForge 0.2.0 reads (verified against the wheel's source)
================================================================

Offline feature files (``data.hidden_states_path``)
    ``runtime/data_plane/offline_reader.list_feature_files`` walks the directory recursively
    (``os.walk``) and takes every file ending in ``.ckpt`` or ``.ckpt.gz``, sorted by absolute
    path; names are otherwise free (one sample per file; a path to a single file also works).
    Nothing is opened at assembly (unless ``SPECFORGE_VALIDATE_OFFLINE_FEATURES=1``).
    ``runtime/data_plane/feature_store.load_feature_file`` reads each with
    ``torch.load(path, weights_only=False, mmap=True)`` (gzip-decompressed first for ``.gz``);
    torch.save pickles only -- not safetensors. Keys (``eagle3/providers.py``,
    ``OfflineStorageContract`` ``specforge_hidden_states_v1``): ``input_ids`` Long[L],
    ``loss_mask`` Long[L] (0/1), ``hidden_state`` [1, L, H] (the target's final, post-norm hidden
    state) and ``aux_hidden_state`` [1, L, 3H] (three captured layers concatenated on the last
    dim, in draft ``fc`` order). ``eagle3/data.normalize_offline_sample`` truncates everything to
    ``data.max_length``, sets the last ``loss_mask`` entry to 0, and squeezes/unsqueezes the
    leading 1 (so [L, H] also loads). Nothing casts dtypes: the hidden states meet the bf16
    draft ``fc`` and bf16 ``TargetHead``, so they must be bf16 (``model.torch_dtype``); fp32
    features fail in the first ``nn.Linear`` with ``RuntimeError: expected m1 and m2 to have
    the same dtype, but got: float != c10::BFloat16``.
    ``input_ids`` must be 1-D (a [1, L] tensor would become [1, 1, L]).

Teacher logits in offline mode
    ``algorithms/model_providers.build_eagle3_model`` builds
    ``modeling/target/target_head.TargetHead.from_pretrained(model.target_model_path,
    lm_head_key=model.lm_head_key)``: ``AutoConfig.from_pretrained(target_model_path)`` (so the
    ``model_type`` must be known to transformers or ``trust_remote_code`` must be set) and
    ``config.hidden_size`` / ``config.vocab_size`` read AT TOP LEVEL (no ``text_config``
    fallback, unlike ``load_target_config`` / ``target_vocab_size`` used elsewhere);
    ``nn.Linear(hidden, vocab)`` filled from the tensor ``lm_head_key`` found through
    EXACTLY ONE ``*.index.json`` in the directory (``weight_map[lm_head_key]`` -> shard;
    ``safe_open`` for ``.safetensors``, else ``torch.load``). No index.json -> FileNotFoundError,
    even for a single ``model.safetensors``. Frozen, bf16, on ``get_local_device()``.
    ``Eagle3TrainStrategy`` then applies ``TargetHead.preprocess`` (shifts ``hidden_state`` and
    ``input_ids`` left by one, pads with 0) and ``logits = TargetHead(hidden_state)``;
    ``OnlineEagle3Model`` turns them into draft-vocab targets through ``t2d``
    (``position_mask = t2d[argmax] * loss_mask``, ``target_p = softmax(logits[..., t2d])``).
    The draft's frozen ``embed_tokens`` are copied by ``Eagle3DraftModel.load_embedding`` from
    ``model.embedding_key`` (via the single ``*.index.json``; without one it falls back to
    ``model.safetensors`` / ``pytorch_model.bin``). ``embedding_key`` and ``lm_head_key``
    default to ``model.embed_tokens.weight`` / ``lm_head.weight``; K2.5 keeps them under
    ``language_model.``.

Vocab mapping (``model.vocab_mapping_path``)
    ``Eagle3DraftModel.load_vocab_mapping`` does ``torch.load(path)`` (default
    ``weights_only=True``) of a dict ``{"d2t": Long[draft_vocab_size], "t2d":
    Bool[target_vocab_size]}``: ``d2t[i] = target_id_i - i`` for the sorted used target ids
    (an offset, not an id), ``t2d[j]`` True iff target id j is in the draft vocab. SpecForge's
    builder is ``specforge.data.preprocessing.process_token_dict_to_mappings(counts,
    draft_vocab_size, target_vocab_size)``, fed for offline runs by
    ``specforge.training.vocab_mapping.count_effective_feature_tokens(hidden_states_path,
    max_length=, target_vocab_size=)`` (loss-masked token counts); it pads the counts with ids
    0, 1, ... until it has ``draft_vocab_size`` entries, keeps the most common, and sorts them.
    :func:`build_specforge_vocab_mapping` does exactly that. Without ``vocab_mapping_path`` a
    local run derives the same mapping itself and caches it under
    ``data.cache_dir/vocab_mapping/``.

Draft config (``model.draft_model_config``)
    A JSON file (or a directory with ``config.json``) with exactly one ``architectures`` entry,
    ``LlamaForCausalLMEagle3`` for ``training.strategy: eagle3``, loaded as a transformers
    ``LlamaConfig``: ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``intermediate_size``, ``hidden_act``, ``rms_norm_eps``,
    ``max_position_embeddings``, ``rope_theta`` / ``rope_scaling`` (or ``rope_parameters``),
    ``vocab_size`` (= target vocab), ``draft_vocab_size`` (defaults to ``vocab_size``),
    ``pad_token_id``, ``num_hidden_layers: 1`` (EAGLE-3 fixes it), optional
    ``target_hidden_size`` (``fc`` is [hidden, 3 * target_hidden_size]) and
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (recorded and exported; offline training
    does not check it against the feature files). ``tie_word_embeddings`` is forced False.

DFlash block drafts (``strategy="dflash"``)
    The same trainer and run path with ``training.strategy: dflash``: feature files hold
    ``input_ids``, ``loss_mask`` and ``hidden_states`` [1, L, N*H] (the N target layers named by
    the draft's ``dflash_config.target_layer_ids``, concatenated in id order;
    ``algorithms/common/dflash_family_data.normalize_offline_sample``, which needs two consecutive
    loss-masked tokens per sample). The draft config names ``DFlashDraftModel`` (a Qwen3-style
    block draft); ``TargetEmbeddingsAndHead`` loads the target's embedding and LM head from
    ``embedding_key`` / ``lm_head_key`` (full vocab: no vocab mapping). The checkpoint records
    ``strategy: "dflash"`` and the ``dflash_*`` resume contract the block export checks.

Checkpoint layout (``training/checkpoint.CheckpointManager``)
    ``<output_dir>/<run_id>-step<N>/training_state.pt`` (rank 0: ``draft_state_dict`` without
    the frozen embedding -- ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
    ``t2d``, ``d2t`` -- plus ``global_step``, ``epoch``, ``strategy: "eagle3"``, the resume
    contract and, for DDP/NO_SHARD, ``replicated_optimizer_state``) and
    ``training_state_rank<r>.pt`` (per-rank RNG, sharded optimizer state). ``<run_id>-latest``
    is a symlink to the newest step; ``training.max_checkpoints`` rotates. ``Trainer.fit`` always
    saves the final step. ``specforge export`` accepts the step directory, its
    ``training_state.pt`` or the output dir (through ``-latest``).
"""

from __future__ import annotations

import copy
import io
import math
import os
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from specforge_kimi.durable import write_atomic

__all__ = [
    "DEFAULT_RUN_ID",
    "OFFLINE_STRATEGIES",
    "build_offline_config",
    "build_specforge_vocab_mapping",
    "read_tensorboard_scalars",
    "train_offline",
]

DEFAULT_RUN_ID = "specforge-kimi-offline"
#: SpecForge strategies :func:`train_offline` runs: EAGLE-3 and the DFlash block draft
OFFLINE_STRATEGIES = ("eagle3", "dflash")

# Environment variables ``specforge.cli._train`` sets or reads; restored after a run.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FSDP_SHARDING")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    keys = dotted.split(".")
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = copy.deepcopy(value)


def _merge(raw: dict[str, Any], overrides: Mapping[str, Any], prefix: str = "") -> None:
    """Apply ``overrides``: ``{"training.warmup_ratio": 0.0}`` or nested ``{"training": {...}}``."""
    for key, value in overrides.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and "." not in key:
            _merge(raw, value, prefix=f"{path}.")
        else:
            _set_dotted(raw, path, value)


def build_offline_config(
    *,
    target_dir: str,
    draft_config_path: str,
    hidden_states_path: str,
    vocab_mapping_path: str,
    output_dir: str,
    max_steps: int,
    ttt_length: int,
    learning_rate: float,
    max_length: int,
    seed: int,
    embedding_key: str,
    lm_head_key: str,
    chat_template: str | None = None,
    save_interval: int | None = None,
    extra_overrides: Mapping[str, Any] | None = None,
    num_samples: int | None = None,
    accumulation_steps: int = 1,
    strategy: str = "eagle3",
):
    """The validated SpecForge ``Config`` :func:`train_offline` runs (nothing is started).

    ``num_epochs`` is sized so ``max_steps`` optimizer steps fit in the data (SpecForge stops
    at whichever of ``max_steps`` / the end of the last epoch comes first); ``num_samples``
    defaults to the number of feature files under ``hidden_states_path``. ``strategy``:
    SpecForge's ``training.strategy``, one of :data:`OFFLINE_STRATEGIES`; a block draft
    (``dflash``) reads ``hidden_states`` features, has no vocab mapping (``vocab_mapping_path``
    is not written) and takes its knobs (``training.num_anchors``, ``model.mask_token_id``)
    from ``extra_overrides``.
    """
    from specforge.config import Config

    if strategy not in OFFLINE_STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(OFFLINE_STRATEGIES)}")
    if num_samples is None:
        from specforge.runtime.data_plane.offline_reader import list_feature_files

        num_samples = len(list_feature_files(hidden_states_path))
    if num_samples < 1:
        raise ValueError(f"no .ckpt / .ckpt.gz feature files under {hidden_states_path!r}")
    batch_size = 1
    steps_per_epoch = (num_samples // batch_size) // accumulation_steps
    if steps_per_epoch < 1:
        raise ValueError(f"{num_samples} feature files give no optimizer step per epoch")

    raw: dict[str, Any] = {
        "run_id": DEFAULT_RUN_ID,
        "output_dir": os.path.abspath(output_dir),
        "model": {
            "target_model_path": os.path.abspath(target_dir),
            "draft_model_config": os.path.abspath(draft_config_path),
            "vocab_mapping_path": os.path.abspath(vocab_mapping_path) if strategy == "eagle3" else "",
            "embedding_key": embedding_key,
            "lm_head_key": lm_head_key,
            "load_target_embedding": True,
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": os.path.abspath(hidden_states_path),
            "max_length": int(max_length),
            "cache_dir": os.path.join(os.path.abspath(output_dir), "cache"),
        },
        "training": {
            "strategy": strategy,
            "role": "all",
            "max_steps": int(max_steps),
            "num_epochs": max(1, math.ceil(int(max_steps) / steps_per_epoch)),
            "batch_size": batch_size,
            "accumulation_steps": accumulation_steps,
            "learning_rate": float(learning_rate),
            "ttt_length": int(ttt_length),
            "attention_backend": "sdpa",
            "seed": int(seed),
            "log_interval": 1,
            "save_interval": int(save_interval or 0),
            "tp_size": 1,
        },
        "tracking": {"report_to": "tensorboard"},
        "deployment": {
            "mode": "local_colocated",
            "trainer": {"nnodes": 1, "nproc_per_node": 1},
        },
    }
    if not _cuda_available():
        # FSDP's flat-parameter path needs an accelerator; NO_SHARD makes SpecForge wrap in DDP.
        raw["training"]["fsdp_sharding"] = "NO_SHARD"
    if chat_template is not None:
        # Offline features are already tokenized; SpecForge only records the template.
        raw["data"]["chat_template"] = chat_template
    if extra_overrides:
        _merge(raw, extra_overrides)
    return Config.model_validate(raw)


def build_specforge_vocab_mapping(
    hidden_states_path: str,
    output_path: str,
    *,
    draft_vocab_size: int,
    target_vocab_size: int,
    max_length: int | None = None,
) -> str:
    """Write ``{"d2t", "t2d"}`` exactly as SpecForge derives it for an offline run.

    Plain SpecForge selection (most frequent loss-masked ids, padded with low ids); for K2.5
    drafts :mod:`specforge_kimi.data.vocab_mapping` also forces the emitted special tokens in.
    """
    import torch
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    counts: Counter = count_effective_feature_tokens(
        hidden_states_path, max_length=max_length, target_vocab_size=target_vocab_size
    )
    d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab_size, target_vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"d2t": d2t, "t2d": t2d}, buffer)
    write_atomic(output_path, buffer.getvalue())
    return output_path


def read_tensorboard_scalars(paths: list[str]) -> dict[str, dict[int, float]]:
    """``tag -> {step: value}`` from TensorBoard event files (later files win on a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(paths, key=os.path.getmtime):
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags().get("scalars", []):
            series = scalars.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                series[int(event.step)] = float(event.value)
    return scalars


def _event_files(directory: str) -> set:
    if not os.path.isdir(directory):
        return set()
    return {os.path.join(directory, name) for name in os.listdir(directory) if name.startswith("events.out.tfevents.")}


def _per_position(scalars: dict[str, dict[int, float]], stem: str, steps: list[int]):
    positions = []
    index = 0
    while f"train/{stem}_{index}" in scalars:
        positions.append(scalars[f"train/{stem}_{index}"])
        index += 1
    if not positions:
        return []
    return [[series.get(step, math.nan) for series in positions] for step in steps]


def _run_specforge_cli_path(cfg, config_path: str) -> int:
    """What ``specforge train -c config_path`` does for an offline local run, in-process."""
    from specforge.application import bind_run, resolve_run
    from specforge.cli import _config_for_role, _train
    from specforge.launch_plan import build_launch_plan

    resolved = resolve_run(cfg)
    plan = build_launch_plan(
        resolved.config,
        algorithm=resolved.algorithm,
        config_path=config_path,
        overrides=[],
        requested_role="auto",
        node_rank=None,
    )
    if plan.kind != "worker" or plan.role != "all":
        raise RuntimeError(
            f"expected an in-process offline worker plan, got kind={plan.kind!r} role={plan.role!r}:\n{plan.render()}"
        )
    for key, value in plan.worker_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return _train(bind_run(_config_for_role(resolved.config, plan.role), resolved.algorithm))


def _ready_this_process() -> bool:
    """Refuse a live process group (SpecForge's trainer makes its own), register the adapter in this process and,
    without CUDA, install the CPU shims; returns whether they were installed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialized; SpecForge's trainer creates and destroys its own"
        )
    import specforge_kimi

    specforge_kimi.register()  # the trainer runs in this process: K2.5 config, keys, drafts
    if _cuda_available():
        return False
    from specforge_kimi.training.cpu_shims import install_cpu_shims

    install_cpu_shims()
    return True


def _write_run_config(cfg) -> tuple[dict, str]:
    """``<output_dir>/run_config.yaml``, the config SpecForge runs; returns its dict and path."""
    import yaml

    os.makedirs(cfg.output_dir, exist_ok=True)
    config_dict = cfg.model_dump(mode="json")
    config_path = os.path.join(cfg.output_dir, "run_config.yaml")
    write_atomic(config_path, yaml.safe_dump(config_dict, sort_keys=False))
    return config_dict, config_path


def _train_as_one_rank(cfg, config_path: str) -> int:
    """SpecForge's training in this process as its only rank (the distributed environment hidden meanwhile, then
    restored); returns the final step."""
    saved_env = {key: os.environ.get(key) for key in _DIST_ENV}
    for key in _DIST_ENV[:5]:
        # A partial set would make specforge.cli refuse to bootstrap its own rendezvous.
        os.environ.pop(key, None)
    try:
        return int(_run_specforge_cli_path(cfg, config_path))
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _series(scalars: dict, tag: str, steps: list[int]) -> list[float]:
    values = scalars.get(tag, {})
    return [values.get(step, math.nan) for step in steps]


def _final_checkpoint(cfg, final_step: int) -> str:
    from specforge.training.checkpoint import CheckpointManager

    checkpoint_dir = CheckpointManager(cfg.output_dir, cfg.run_id).checkpoint_dir(final_step)
    if not os.path.isfile(os.path.join(checkpoint_dir, "training_state.pt")):
        raise RuntimeError(f"SpecForge finished at step {final_step} but {checkpoint_dir} is missing")
    return checkpoint_dir


def train_offline(
    *,
    target_dir: str,
    draft_config_path: str,
    hidden_states_path: str,
    vocab_mapping_path: str,
    output_dir: str,
    max_steps: int,
    ttt_length: int,
    learning_rate: float,
    max_length: int,
    seed: int,
    embedding_key: str,
    lm_head_key: str,
    chat_template: str | None = None,
    save_interval: int | None = None,
    extra_overrides: dict | None = None,
    accumulation_steps: int = 1,
    strategy: str = "eagle3",
) -> dict:
    """Train an EAGLE-3 draft (or, ``strategy="dflash"``, a DFlash block draft) with SpecForge's own offline
    trainer, in this process.

    The config is :func:`build_offline_config` (batch size 1, no accumulation, ``sdpa``,
    ``log_interval: 1``, TensorBoard tracking, ``NO_SHARD`` without CUDA, ``num_epochs`` sized
    for ``max_steps``). ``extra_overrides`` is applied last, as dotted keys
    (``{"training.warmup_ratio": 0.0}``) or nested sections (``{"training": {...}}``), and the
    result is re-validated by SpecForge's schema. ``chat_template`` is only recorded
    (``data.chat_template``): offline features are already tokenized. ``save_interval`` adds
    intermediate checkpoints; the final step is always saved. Any ``RANK`` / ``WORLD_SIZE`` /
    ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment are hidden during the
    run (it is always one rank) and restored afterwards, as is ``FSDP_SHARDING``.

    Returns a dict:

    - ``losses``: ``train/loss`` per optimizer step (list of floats, ``len == final_step``);
    - ``steps``: the optimizer steps they belong to (1..final_step);
    - ``acc``: overall top-1 accuracy per step; ``acc_per_position``, ``ploss_per_position``,
      ``acceptance_rate_per_position``: per step, one float per TTT position;
    - ``lr``, ``grad_norm``: per step;
    - ``final_step``: SpecForge's last ``global_step``;
    - ``checkpoint_dir``: ``<output_dir>/<run_id>-step<final_step>`` (``specforge export`` input);
    - ``output_dir``, ``config_path`` (the YAML written), ``config`` (its dict),
      ``event_files``, ``wall_time_s``, ``cpu_shims`` (whether they were installed).
    """
    shimmed = _ready_this_process()
    cfg = build_offline_config(
        target_dir=target_dir,
        draft_config_path=draft_config_path,
        hidden_states_path=hidden_states_path,
        vocab_mapping_path=vocab_mapping_path,
        output_dir=output_dir,
        max_steps=max_steps,
        ttt_length=ttt_length,
        learning_rate=learning_rate,
        max_length=max_length,
        seed=seed,
        embedding_key=embedding_key,
        lm_head_key=lm_head_key,
        chat_template=chat_template,
        save_interval=save_interval,
        extra_overrides=extra_overrides,
        accumulation_steps=accumulation_steps,
        strategy=strategy,
    )
    output_dir = cfg.output_dir
    config_dict, config_path = _write_run_config(cfg)

    runs_dir = os.path.join(output_dir, "runs")
    events_before = _event_files(runs_dir)
    started = time.perf_counter()
    final_step = _train_as_one_rank(cfg, config_path)
    wall_time_s = time.perf_counter() - started

    event_files = sorted(_event_files(runs_dir) - events_before)
    if not event_files:
        raise RuntimeError(f"SpecForge's TensorBoard tracker wrote no event file under {runs_dir}")
    scalars = read_tensorboard_scalars(event_files)
    loss_series = scalars.get("train/loss", {})
    steps = sorted(loss_series)
    checkpoint_dir = _final_checkpoint(cfg, final_step)

    return {
        "losses": [loss_series[step] for step in steps],
        "steps": steps,
        "acc": _series(scalars, "train/acc", steps),
        "acc_per_position": _per_position(scalars, "acc", steps),
        "ploss_per_position": _per_position(scalars, "ploss", steps),
        "acceptance_rate_per_position": _per_position(scalars, "acceptance_rate", steps),
        "lr": _series(scalars, "train/lr", steps),
        "grad_norm": _series(scalars, "train/grad_norm", steps),
        "final_step": final_step,
        "checkpoint_dir": checkpoint_dir,
        "output_dir": output_dir,
        "config_path": config_path,
        "config": config_dict,
        "event_files": event_files,
        "wall_time_s": wall_time_s,
        "cpu_shims": shimmed,
    }
