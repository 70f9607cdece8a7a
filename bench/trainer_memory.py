"""Peak memory and speed of draft trainer ranks (EAGLE-3 or a block draft) at a recipe's real sizes, against the
memory plan.

Scope: the consumer side of the online loop only, on one host: one rank (default) or ``--nproc N``
ranks started by torchrun, one per GPU, as a co-located run's trainer ranks. The K2.5 recipes'
fit rests on ``plan.memory.memory_plan``'s trainer terms (``plan.trainer_terms``), which were
derived from SpecForge's code, not measured on a GPU. This script builds exactly what SpecForge's
online consumer builds for a recipe -- ``build_model_bundle`` (the draft from the recipe's draft
config, ``OnlineEagle3Model`` with the recipe's TTT length and attention backend, the frozen
``TargetHead``), ``FSDPTrainingBackend`` with SpecForge's ``BF16Optimizer`` factory, the eagle3
step strategy, ``TrainerCore.train_step`` -- and feeds it batches shaped like a capture
(``hidden_state`` [1, L, 3 x hidden], ``target`` = the last hidden state [1, L, hidden],
``target_repr: hidden_state``), random but fixed, in memory. No server, Mooncake or data.

A block-draft recipe (``trainer.family`` dflash or dspark) gets the same build with its family's algorithm: the
draft (``DFlashDraftModel`` / ``DSparkDraftModel``) inside SpecForge's DFlash-family training model (the target's
frozen embedding and head inside it), ``DFlashTrainStrategy`` / ``DSparkTrainStrategy``, and batches shaped like its
capture: ``hidden_states`` [1, L, N x hidden] (its N ``dflash_config.target_layer_ids``), ``input_ids``,
``loss_mask`` (DSpark also ``target_last_hidden_states`` [1, L, hidden]); no vocab mapping. Its rows are read against
``trainer_terms``' block terms (``plan_bytes``: optimizer, frozen tables, activations, objective logits) and
``step_flops.train_flops_per_token`` (``flops_per_token``; model = executed); the EAGLE-3-only variants
(``fewer_syncs``, ``chunked_loss``, ``compiled``) are refused. Each row and the document's config name the family.

    python bench/trainer_memory.py --recipe recipes/kimi-k25-slice-h200-dflash.yaml --backends flex_attention,sdpa \\
        --lengths 2048,4096 --steps 4 --out bench/results/trainer_memory_k25_slice_dflash_h200.json

The target is a stand-in directory holding only what the consumer reads: the recipe target's
K2.5 ``config.json`` (wrapper and ``text_config``), its embedding and LM-head tensors (random
bf16, under the recipe's keys) and the stand-in tokenizer. The draft config, vocab mapping
(``draft_vocab_size`` ids) and SpecForge run config are rendered from the recipe with
``max_length`` and ``attention_backend`` overridden per row.

Per (backend, length): steps run back to back; the script records memory allocated after the
model is built, the peak allocated and reserved over the steps (``torch.cuda`` counters, reset
per length), per-step time after the first (which compiles), and the losses; with several ranks, the maximum
over ranks and each rank's value (each rank trains its own sample, as data parallelism does). With
one rank SpecForge's FSDP (``SHARD_GRAD_OP``) shards nothing, so the optimizer term is the whole
draft's, as the plan charges it; over N ranks that term shrinks, the activation and teacher terms
do not.
``--memory-cap-gib G`` caps each rank's allocator at G GiB (``torch.cuda.set_per_process_memory_fraction``, before
anything is allocated): the step in the room a co-located server leaves it (a run's trainer peak), beside the
uncapped row of the same step, to tell a slower step from the stages taking turns.

    python bench/trainer_memory.py --recipe recipes/kimi-k25-8xb200-lowered.yaml \\
        --backends flex_attention,sdpa --lengths 2048,4096 --out bench/results/trainer_memory_....json

Speed in FLOPs: ``flops_per_token`` is ``training.step_flops``'s model FLOPs of one step (forward +
backward, the EAGLE-3 mask's useful attention pairs; the teacher's full-vocabulary head counted forward
only), ``flops_per_token_executed`` what the backend executes (flex: whole 128-tiles and its backward's
recomputed scores; sdpa: dense L x L); ``achieved_tflops = flops_per_token x tokens_per_s``, ``mfu`` that
over ``--peak-tflops`` x ranks (default 989, the H200's dense bf16 spec; large bf16 GEMMs reach ~790 on
one, so ~0.8 is the practical ceiling). On CUDA each row also has the allocator's per-step
``num_alloc_retries`` / ``num_device_alloc`` / ``num_device_free`` deltas (``torch.cuda.memory_stats``;
SpecForge's eagle3 forward calls ``torch.cuda.empty_cache()`` every step, which returns the cache and
makes the next step ``cudaMalloc`` it again).

``--profile-steps N`` (default 0): after a length's timed steps, N more under ``torch.profiler`` (CPU and
CUDA activities, input shapes, no stacks); the row's ``profile`` is ``bench/step_profile.py``'s summary
per step -- device time by class (gemm, attention, draft head and loss, target head / teacher, optimizer,
copies, nccl, other), wall, busy (union of kernel intervals) and idle (wall - busy: launch, sync and
allocator gaps), CUDA runtime allocator/sync calls, top 25 kernels, TFLOP/s per class against the FLOP
model's terms -- and the chrome trace is ``WORKDIR/trace-BACKEND-LENGTH-rankR.json.gz``.

    python bench/trainer_memory.py --recipe recipes/kimi-k25-8xb200-lowered.yaml --backends flex_attention \\
        --lengths 4096,16384 --steps 4 --profile-steps 2 --workdir /tmp/tm --out trainer_profile_....json

``--variants`` (default ``recipe``): the trainer-step settings to compare, each in its own process on the
same batches and the same seeded initial weights (``--seed``): ``specforge`` (as shipped: ``empty_cache`` every
step, foreach AdamW), ``keep_cache`` (SpecForge patch eagle3-keep-allocator-cache, ``SPECFORGE_EAGLE3_EMPTY_CACHE=0``),
``keep_cache_fused_adamw`` (+ patch bf16-optimizer-fused-adamw, ``SPECFORGE_ADAMW_FUSED=1``), ``expandable`` (+ ``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``), ``fewer_syncs`` (``keep_cache_fused_adamw`` + patch eagle3-fewer-host-syncs,
``SPECFORGE_EAGLE3_FEWER_SYNCS=1``), ``recipe`` (the recipe's own ``trainer.step_empty_cache`` / ``fused_adamw`` /
``step_fewer_host_syncs`` / ``step_chunked_head_loss`` / ``cuda_alloc_conf``) and ``chunked_loss`` (the recipe's own
with ``trainer.step_chunked_head_loss: 1024``, patch eagle3-chunked-head-loss, ``SPECFORGE_EAGLE3_CHUNKED_LOSS=1024``) and
``compiled`` (the recipe's own with ``trainer.step_compile_elementwise: true``, our seam compile-elementwise,
``SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE=1``; its first step also compiles, the speed is read after it),
``block_mask`` (the recipe's own with ``trainer.step_eagle3_block_mask: true``, our seam eagle3-block-mask,
``SPECFORGE_KIMI_EAGLE3_BLOCK_MASK=1``: flex attention's block mask counted per block), ``flex_autotune`` (the
recipe's own with ``trainer.step_flex_autotune: true``, our seam flex-autotune, ``SPECFORGE_KIMI_FLEX_AUTOTUNE=1``:
its first step also autotunes), ``fused_clip`` (the recipe's own with ``trainer.step_optimizer_fused_clip: true``,
our seam optimizer-fused-clip, ``SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP=1``: the optimizer's clip in fused AdamW's
``grad_scale``; every draft family), ``fused_wgrad`` (the recipe's own with ``trainer.step_eagle3_fused_wgrad:
true``, our seam eagle3-fused-wgrad, ``SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD=1``: each draft weight's gradient summed
over the TTT positions inside its weight-gradient GEMM; rows list the linears it wrapped), ``fused_proj`` (the
recipe's own with ``trainer.step_eagle3_fused_proj: true``, our seam eagle3-fused-proj,
``SPECFORGE_KIMI_EAGLE3_FUSED_PROJ=1``: the draft layer's q/k/v and gate/up projections one GEMM per group; rows list
the groups it fused; not in ``stacked``: ``stacked_untuned+fused_proj`` adds it) and ``stacked`` (the
recipe's own with ``step_fewer_host_syncs``, ``step_compile_elementwise``, ``step_eagle3_block_mask``,
``step_flex_autotune``, ``step_eagle3_fused_wgrad`` and ``step_optimizer_fused_clip`` all on) and
``stacked_untuned`` (``stacked`` without ``step_flex_autotune``: no minutes of tuning in its first step), and any
combination named by its parts joined by ``+`` (``fewer_syncs`` and the recipe-based names above, e.g.
``fewer_syncs+compiled+fused_wgrad+fused_clip``: the recipe's own step with each part's fields); the document's
``comparisons`` give each row's speed ratio and largest loss difference
against the first variant. ``--feed device`` (default) puts each batch on the GPU before its timed step, as the
cuda_ipc handoff delivers features; ``--feed host`` leaves it on the host for the step to copy. On CUDA the
script first times an 8192^3 bf16 GEMM (``measured_gemm_tflops``) and rows add ``mfu_vs_measured_gemm``.

Each backend runs in a fresh Python process (lengths ascending; an out-of-memory length ends
that backend's list and is recorded). On a host without CUDA it runs SpecForge's CPU path (the
package's CPU shims, sdpa only) and records no device memory: that is how the tests exercise it.
Measurements, never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


def write_standin_target(recipe, out: Path) -> Path:
    """The recipe target's config, embedding and LM head (random bf16) and the stand-in tokenizer."""
    import torch
    from safetensors.torch import save_file

    from specforge_kimi.data.tokenizer import build_standin_tokenizer
    from specforge_kimi.targets.tiny import TinySpec, config

    t = recipe.target
    if (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        if set(index["weight_map"]) == {t.embedding_key, t.lm_head_key}:
            return out
    out.mkdir(parents=True, exist_ok=True)
    spec = TinySpec(layers=t.num_layers, hidden=t.hidden_size, heads=t.num_attention_heads, vocab=t.vocab_size)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        key: (torch.randn(t.vocab_size, t.hidden_size, generator=gen) * 0.02).to(torch.bfloat16)
        for key in (t.embedding_key, t.lm_head_key)
    }
    save_file(tensors, str(out / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": sum(x.numel() * 2 for x in tensors.values())},
                "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors},
            }
        )
    )
    build_standin_tokenizer(out)
    (out / "config.json").write_text(json.dumps(config(spec), indent=2))  # last: a complete stand-in has it
    return out


def write_vocab_mapping(recipe, path: Path) -> Path:
    """A draft vocabulary of the recipe's ``draft_vocab_size`` (frequency order is irrelevant to memory)."""
    from specforge_kimi.data.vocab_mapping import build_vocab_mapping, save_vocab_mapping

    if not path.is_file():
        n = recipe.trainer.draft.draft_vocab_size
        save_vocab_mapping(
            build_vocab_mapping(
                {i: 1 for i in range(n)}, draft_vocab_size=n, target_vocab_size=recipe.target.vocab_size
            ),
            path,
        )
    return path


def row_recipe(recipe, *, target: Path, vocab: Path | None, workdir: Path, length: int, backend: str):
    """The recipe the model is built from: its max length and backend, the stand-in paths (validated again; a block
    draft has no vocab mapping)."""
    from specforge_kimi.plan.recipes import Recipe

    # the fields the recipe set (a block-draft recipe refuses EAGLE-3-only fields even at their defaults)
    raw = recipe.model_dump(exclude_unset=True)
    raw["target"]["path"] = str(target)
    if vocab is not None:
        raw.setdefault("data", {})["vocab_mapping_path"] = str(vocab)
    raw["data"]["prompts_path"] = str(workdir / "unused-prompts.jsonl")
    raw["output_dir"] = str(workdir / f"run-{backend}-{length}")
    raw.setdefault("trainer", {})["max_length"] = length
    raw["trainer"]["attention_backend"] = backend
    raw["trainer"]["reserve_gib"] = 0.0
    raw.setdefault("gpus", {})["memory_gib"] = 1e6  # the plan's fit check is not this script's question
    return Recipe.model_validate(raw)


def _batch(length: int, shape: dict, seed: int, device: str | None = None):
    """One capture-shaped batch of the draft family's features (``shape``: ``_build_trainer``'s family, hidden,
    vocab and captured layers), the same for a seed whatever the device; ``device``: built on the host and copied
    there (and synchronized) before the step, as a cuda_ipc consumer's features are already on its GPU.

    EAGLE-3: ``hidden_state`` [1, L, 3 x hidden] and ``target`` (the last hidden state) [1, L, hidden]; a block
    draft: ``hidden_states`` [1, L, N x hidden] (its N captured layers, concatenated), DSpark also
    ``target_last_hidden_states`` [1, L, hidden]."""
    import torch
    from specforge.runtime.contracts import TrainBatch

    family, hidden, vocab = shape["family"], shape["hidden"], shape["vocab"]
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "input_ids": torch.randint(0, vocab, (1, length), generator=g),
        "attention_mask": torch.ones(1, length, dtype=torch.long),
        "loss_mask": torch.ones(1, length, dtype=torch.long),
    }
    if family == "eagle3":
        tensors["hidden_state"] = torch.randn(1, length, 3 * hidden, generator=g).to(torch.bfloat16)
        tensors["target"] = torch.randn(1, length, hidden, generator=g).to(torch.bfloat16)
    else:
        n = shape["captured_layers"]
        tensors["hidden_states"] = torch.randn(1, length, n * hidden, generator=g).to(torch.bfloat16)
        if family == "dspark":
            tensors["target_last_hidden_states"] = torch.randn(1, length, hidden, generator=g).to(torch.bfloat16)
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
        torch.cuda.synchronize()
    metadata = {"target_repr": "hidden_state"} if family == "eagle3" else {}
    return TrainBatch(sample_ids=[f"bench-{seed}"], strategy=family, tensors=tensors, metadata=metadata)


#: ``--variants``: the trainer-step settings each variant runs with (``training.step_knobs``), SpecForge as
#: shipped first; ``recipe`` is the recipe's own ``trainer.step_empty_cache`` / ``fused_adamw`` / ``cuda_alloc_conf``
VARIANTS = {
    "specforge": {"step_empty_cache": True, "fused_adamw": False, "cuda_alloc_conf": None},
    "keep_cache": {"step_empty_cache": False, "fused_adamw": False, "cuda_alloc_conf": None},
    "keep_cache_fused_adamw": {"step_empty_cache": False, "fused_adamw": True, "cuda_alloc_conf": None},
    "expandable": {"step_empty_cache": False, "fused_adamw": True, "cuda_alloc_conf": "expandable_segments:True"},
    "fewer_syncs": {
        "step_empty_cache": False,
        "fused_adamw": True,
        "cuda_alloc_conf": None,
        "step_fewer_host_syncs": True,
    },
}
#: ``--variants`` that are the recipe's own trainer section with these fields changed
RECIPE_VARIANTS = {
    "chunked_loss": {"step_chunked_head_loss": 1024},
    "compiled": {"step_compile_elementwise": True},
    "block_mask": {"step_eagle3_block_mask": True},
    "flex_autotune": {"step_flex_autotune": True},
    "fused_clip": {"step_optimizer_fused_clip": True},
    "fused_wgrad": {"step_eagle3_fused_wgrad": True},
    "fused_proj": {"step_eagle3_fused_proj": True},
    "stacked": {
        "step_fewer_host_syncs": True,
        "step_compile_elementwise": True,
        "step_eagle3_block_mask": True,
        "step_flex_autotune": True,
        "step_eagle3_fused_wgrad": True,
        "step_optimizer_fused_clip": True,
    },
}
RECIPE_VARIANTS["stacked_untuned"] = {k: v for k, v in RECIPE_VARIANTS["stacked"].items() if k != "step_flex_autotune"}
#: the parts of a composed variant (``a+b``) beside :data:`RECIPE_VARIANTS`' names: the fields each sets
COMPOSE_PARTS = {"fewer_syncs": {"step_fewer_host_syncs": True}, **RECIPE_VARIANTS}


def composed_update(name: str) -> dict | None:
    """The trainer fields of a composed variant ``a+b+...`` (two or more distinct :data:`COMPOSE_PARTS` names: the
    recipe's own step with each part's fields), merged in order; None when ``name`` is not one."""
    parts = name.split("+")
    if len(parts) < 2 or len(set(parts)) != len(parts) or any(p not in COMPOSE_PARTS for p in parts):
        return None
    out: dict = {}
    for p in parts:
        out.update(COMPOSE_PARTS[p])
    return out


def recipe_update(name: str) -> dict | None:
    """The trainer fields a recipe-based variant sets on the recipe's step (``recipe``: none, a
    :data:`RECIPE_VARIANTS` name, or a composed one); None when ``name`` is not recipe-based."""
    if name == "recipe":
        return {}
    return RECIPE_VARIANTS.get(name) or composed_update(name)


#: ``--variants`` that change SpecForge's eagle3 step only: refused for a block-draft recipe
EAGLE3_ONLY_VARIANTS = (
    "fewer_syncs",
    "chunked_loss",
    "compiled",
    "block_mask",
    "flex_autotune",
    "fused_wgrad",
    "fused_proj",
    "stacked",
    "stacked_untuned",
)


def variant_trainer(recipe, name: str):
    """The trainer section a recipe-based variant runs (``recipe``, a :data:`RECIPE_VARIANTS` name or a composed
    one), checked by the recipe's own schema: a pair of fields a recipe may not hold is a one-line
    ``KimiInputError`` here too."""
    from pydantic import ValidationError

    from specforge_kimi.errors import KimiInputError, validation_summary

    update = recipe_update(name) or {}
    t = recipe.trainer
    try:
        return type(t).model_validate({**t.model_dump(), **update})
    except ValidationError as exc:
        raise KimiInputError(f"--variants: {name!r}: {validation_summary(exc)}") from None


def variant_env(recipe, name: str, base: dict[str, str], backend: str | None = None) -> dict[str, str]:
    """``base`` (the environment) with the step variables of variant ``name`` (``training.step_knobs.step_env``) on
    attention ``backend`` (None: the recipe's; ``fa`` turns on the fa-kernel seam); an allocator setting the variant
    does not name is removed, so that the shell's never leaks into a variant."""
    from types import SimpleNamespace

    from specforge_kimi.training.step_knobs import ALLOC_CONF_ENV, trainer_env

    backend = recipe.trainer.attention_backend if backend is None else backend
    if recipe_update(name) is not None:
        v = variant_trainer(recipe, name).model_copy(update={"attention_backend": backend})
    else:
        v = SimpleNamespace(
            **{
                "family": recipe.trainer.family,  # a block draft's step gets no eagle3 switches
                "attention_backend": backend,
                "step_fewer_host_syncs": False,
                "step_chunked_head_loss": None,
                "step_compile_elementwise": False,
                "step_eagle3_block_mask": False,
                "step_flex_autotune": False,
                "step_eagle3_fused_wgrad": False,
                "step_eagle3_fused_proj": False,
                "step_optimizer_fused_clip": False,
                **VARIANTS[name],
            }
        )
    env = {k: val for k, val in base.items() if k != ALLOC_CONF_ENV}
    env.update(trainer_env(v))
    return env


def _feed(args, cuda: bool) -> str | None:
    """Where each step's batch is put before the step (``--feed``): ``cuda`` or None (host; the step copies it)."""
    return "cuda" if cuda and args.feed == "device" else None


def measure_gemm_tflops(n: int = 8192, iters: int = 40) -> float | None:
    """This GPU's bf16 rate on a large square GEMM (n^3, after a warm-up), the practical ceiling MFU is also read
    against; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    rate = 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return rate


def compare(rows: list[dict]) -> list[dict]:
    """Per (backend, length): each variant against the first variant measured there (``--variants``' order); then
    per (variant, length) measured on several backends: each backend against the first (``--backends``' order,
    ``against_backend``) -- speed ratio, MFU, peak reserved, and the largest loss difference over the steps (same
    data and init)."""
    ok = [r for r in rows if "length" in r and "error" not in r]
    out = []
    for backend, length in sorted({(r["backend"], r["length"]) for r in ok}):
        group = [r for r in ok if r["backend"] == backend and r["length"] == length]
        out += [_against(r, group[0], backend=backend, against=group[0]["variant"]) for r in group]
    for variant, length in sorted({(r["variant"], r["length"]) for r in ok}):
        group = [r for r in ok if r["variant"] == variant and r["length"] == length]
        out += [_against(r, group[0], backend=r["backend"], against=variant, against_backend=group[0]["backend"])
                for r in group[1:]]  # fmt: skip
    return out


def _against(r: dict, base: dict, *, backend: str, **against) -> dict:
    """Row ``r`` (on ``backend``) against row ``base``: ``against`` names the variant, and the backend if another,
    it is measured against."""
    n = min(len(r["losses"]), len(base["losses"]))
    return {
        "backend": backend,
        "length": r["length"],
        "variant": r["variant"],
        **against,
        "tokens_per_s": r.get("tokens_per_s"),
        "speed_ratio": r["tokens_per_s"] / base["tokens_per_s"]
        if r.get("tokens_per_s") and base.get("tokens_per_s")
        else None,
        "mfu": r.get("mfu"),
        "mfu_vs_measured_gemm": r.get("mfu_vs_measured_gemm"),
        "peak_reserved_gib": r.get("peak_reserved_gib"),
        "loss_max_abs_diff": max(abs(a - b) for a, b in zip(r["losses"][:n], base["losses"][:n], strict=True))
        if n
        else None,
    }


EXECUTED = {"flex_attention": "flex", "fa": "fa", "sdpa": "sdpa"}


def _throughput(row: dict) -> dict:
    """Model FLOP/s (``flops_per_token``, the mask's useful pairs) and MFU against ``peak_tflops`` per rank."""
    if "tokens_per_s" not in row:
        return row
    achieved = row["flops_per_token"] * row["tokens_per_s"] / 1e12
    return {
        **row,
        "achieved_tflops": achieved,
        "achieved_tflops_executed": row["flops_per_token_executed"] * row["tokens_per_s"] / 1e12,
        "mfu": achieved / (row["peak_tflops"] * row.get("world_size", 1)),
        **(
            {"mfu_vs_measured_gemm": achieved / (row["measured_gemm_tflops"] * row.get("world_size", 1))}
            if row.get("measured_gemm_tflops")
            else {}
        ),
    }


def _profile(args, core, *, rank: int, length: int, shape: dict, workdir: Path, cuda: bool, flops) -> dict:
    """``--profile-steps`` more steps under torch.profiler: the summary (bench/step_profile.py) and a gzipped trace;
    the TFLOP/s per class against ``step_flops``' terms for an EAGLE-3 step (``flops``), none for a block step."""
    import step_profile
    import torch

    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
    walls = []
    # built (and, with --feed device, copied) before the profiler starts: the trace holds the steps, not the feed
    batches = [
        _batch(length, shape, seed=1000 * (args.steps + step) + rank, device=_feed(args, cuda))
        for step in range(args.profile_steps)
    ]
    with step_profile.profiling(cuda) as prof:
        for batch in batches:
            t0 = time.perf_counter()
            core.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    trace = workdir / f"trace-{args.backend}-{length}-rank{rank}.json.gz"
    prof.export_chrome_trace(str(trace))
    summary = step_profile.summarize(
        prof,
        steps=args.profile_steps,
        wall_s=walls,
        cuda=cuda,
        target_vocab=shape["vocab"],
        draft_vocab=shape["draft_vocab"],
    )
    summary["class_tflops"] = step_profile.class_tflops(summary, flops) if shape["family"] == "eagle3" else None
    summary["trace"] = str(trace)
    if cuda:
        after = torch.cuda.memory_stats()
        summary["allocator_counters_per_step"] = step_profile.alloc_deltas(before, after, args.profile_steps)
    return summary


def _step_switches(backend, family: str) -> dict:
    """What the variant's step environment turned on in the built step: SPECFORGE_ADAMW_FUSED (patch
    bf16-optimizer-fused-adamw applied or not); for an EAGLE-3 step also SPECFORGE_EAGLE3_FEWER_SYNCS (patch
    eagle3-fewer-host-syncs), SPECFORGE_EAGLE3_CHUNKED_LOSS (patch eagle3-chunked-head-loss: tokens per chunk, 0
    unchunked), SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE (our compile-elementwise seam, installed by register()) and
    SPECFORGE_KIMI_EAGLE3_FA_KERNEL (our fa-kernel seam, with ``--backends fa``);
    a block step reads none of those. SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP (our optimizer-fused-clip seam) for either:
    installed and taking this optimizer's step."""
    from specforge_kimi.drafts import optimizer_fused_clip

    adamw_fused = bool(getattr(getattr(backend.optimizer, "optimizer", None), "defaults", {}).get("fused"))
    fused_clip = optimizer_fused_clip.installed() and optimizer_fused_clip.applies(backend.optimizer)
    if family != "eagle3":
        return {"adamw_fused": adamw_fused, "fewer_syncs": False, "chunked_loss": 0, "compile_elementwise": False,
                "eagle3_block_mask": False, "flex_autotune": False, "eagle3_fused_wgrad": False,
                "eagle3_fused_proj": False, "fa_kernel": False, "optimizer_fused_clip": fused_clip}  # fmt: skip
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.modeling.draft.llama3_eagle import LlamaDecoderLayer

    from specforge_kimi.drafts import (
        eagle3_block_mask,
        eagle3_fa_kernel,
        eagle3_fused_proj,
        eagle3_fused_wgrad,
        flex_autotune,
    )
    from specforge_kimi.drafts.compile_elementwise import installed

    return {
        "adamw_fused": adamw_fused,
        "fewer_syncs": bool(getattr(eagle3_model, "_fewer_host_syncs", lambda: False)()),
        "chunked_loss": int(getattr(eagle3_model, "_chunked_loss_tokens", lambda: 0)()),
        "compile_elementwise": installed(LlamaDecoderLayer),
        "eagle3_block_mask": eagle3_block_mask.installed(),
        "flex_autotune": flex_autotune.installed(),
        "eagle3_fused_wgrad": eagle3_fused_wgrad.installed(eagle3_model.OnlineEagle3Model),
        "eagle3_fused_proj": eagle3_fused_proj.installed(eagle3_model.OnlineEagle3Model),
        "fa_kernel": eagle3_fa_kernel.installed(),
        "optimizer_fused_clip": fused_clip,
    }


def _build_trainer(args, base, workdir: Path, cuda: bool) -> dict:
    """What SpecForge's online consumer builds for the recipe at this backend (``specforge.training.trainer``, as a
    launched consumer of either family): the model bundle, the FSDP backend with SpecForge's optimizer factory, the
    family's step strategy (eagle3; ``DFlashTrainStrategy`` / ``DSparkTrainStrategy`` for a block draft) and
    ``TrainerCore``; with what the variant's step environment turned on, the build time, the memory allocated after
    it and the batch shape (``_batch``)."""
    import step_profile
    import torch
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config import Config
    from specforge.training.assembly import _optimizer_factory, build_model_bundle
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore

    from specforge_kimi.plan.run_plan import compile_plan

    # one model per backend, as one run sees samples of many lengths: max_length shapes no tensor of
    # the model, only the samples; the peak counters are reset per length
    r = row_recipe(
        base,
        target=Path(args.target),
        vocab=Path(args.vocab) if args.vocab else None,
        workdir=workdir,
        length=max(args.lengths),
        backend=args.backend,
    )
    cfg_dict = compile_plan(r, rendered_dir=workdir / f"render-{args.backend}").write()["specforge_config"]
    cfg_dict["training"]["role"] = "consumer"
    # SpecForge's FSDP needs an accelerator; on the CPU its DDP path (NO_SHARD) runs instead
    sharding = cfg_dict["training"].get("fsdp_sharding", "SHARD_GRAD_OP") if cuda else "NO_SHARD"
    os.environ["FSDP_SHARDING"] = sharding
    cfg = Config.model_validate(cfg_dict)
    family = r.trainer.family
    algorithm = builtin_algorithm_registry().resolve(family)
    torch.manual_seed(args.seed)  # the same draft init in every variant
    t0 = time.perf_counter()
    bundle = build_model_bundle(cfg, algorithm=algorithm)
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(), optimizer_factory=_optimizer_factory(cfg))
    wrapped = backend.prepare_model(bundle.model, optimizer_target=bundle.model.draft_model)
    strategy = algorithm.providers.step.build(wrapped, target_head=bundle.target_head, **dict(bundle.strategy_kwargs))
    core = TrainerCore(strategy, backend)
    switches = _step_switches(backend, family)
    if args.profile_steps:  # a block draft (target_head None): the optimizer named, no teacher
        step_profile.annotate(target_head=bundle.target_head, backend=backend)
    build_s = time.perf_counter() - t0
    built = None
    if cuda:
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated() / GIB
    eagle3 = family == "eagle3"
    shape = {
        "family": family,
        "hidden": r.target.hidden_size,
        "vocab": r.target.vocab_size,
        # a block draft has no head of its own: the target's, frozen
        "draft_vocab": r.trainer.draft.draft_vocab_size if eagle3 else r.target.vocab_size,
        "captured_layers": len(r.capture_ids),
    }
    return {
        "core": core,
        "draft": bundle.model.draft_model,
        "sharding": sharding,
        **switches,
        "build_s": build_s,
        "built": built,
        "shape": shape,
    }


def _flops(base, length: int, backend: str) -> tuple:
    """The row's FLOP figures at ``length``: an EAGLE-3 step's ``training.step_flops.step_flops`` (model: the mask's
    useful pairs; executed: what ``backend`` runs), a block step's ``train_flops_per_token`` (one count, model =
    executed); and the EAGLE-3 ``StepFlops`` for the profile's classes (None for a block step)."""
    from specforge_kimi.training.step_flops import TRAIN_TERMS, recipe_step_flops, train_flops_per_token

    if base.trainer.family != "eagle3":
        per_token = train_flops_per_token(base, length=length)
        return None, {
            "flops_per_token": per_token["total"],
            "flops_per_token_executed": per_token["total"],
            "flops_executed_attention": "block (causal, S/2 keys per query on average)",
            "flops_per_token_by_term": {k: per_token[k] for k in TRAIN_TERMS},
        }
    flops = recipe_step_flops(base, length=length)
    executed = recipe_step_flops(base, length=length, attention=EXECUTED[backend])
    return flops, {
        "flops_per_token": flops.per_token,
        "flops_per_token_executed": executed.per_token,
        "flops_executed_attention": executed.attention,
        "flops_per_token_by_term": {k: v / length for k, v in flops.by_term.items()},
    }


def _measure_length(args, trainer: dict, base, length: int, *, rank: int, workdir: Path, cuda: bool) -> dict:
    """One length's row on this rank: the plan's terms and FLOPs, then ``--steps`` timed steps (peaks, allocator
    counters, losses) and the optional profile; an error ends the row, never the process."""
    import step_profile
    import torch

    from specforge_kimi.drafts import eagle3_fused_proj, eagle3_fused_wgrad
    from specforge_kimi.plan.trainer_terms import trainer_terms
    from specforge_kimi.training.step_knobs import STEP_ENV_NAMES

    core, shape = trainer["core"], trainer["shape"]
    terms = trainer_terms(base, max_length=length, attention_backend=args.backend)
    flops, flops_row = _flops(base, length, args.backend)
    row = {
        "variant": args.variant,
        "family": shape["family"],
        "step_env": {k: os.environ.get(k) for k in STEP_ENV_NAMES},
        "feed": _feed(args, cuda) or "host",
        "adamw_fused": trainer["adamw_fused"],
        "fewer_host_syncs": trainer["fewer_syncs"],
        "chunked_head_loss": trainer["chunked_loss"],
        "compile_elementwise": trainer["compile_elementwise"],
        "eagle3_block_mask": trainer["eagle3_block_mask"],
        "flex_autotune": trainer["flex_autotune"],
        "eagle3_fused_wgrad": trainer["eagle3_fused_wgrad"],
        "eagle3_fused_proj": trainer["eagle3_fused_proj"],
        "fa_kernel": trainer["fa_kernel"],
        "optimizer_fused_clip": trainer["optimizer_fused_clip"],
        "backend": args.backend,
        "length": length,
        "fsdp_sharding": trainer["sharding"],
        "build_s": trainer["build_s"],
        "built_allocated_gib": trainer["built"],
        "plan_bytes": terms,
        "plan_gib": sum(terms.values()) / GIB,
        **flops_row,
        "peak_tflops": args.peak_tflops,
        "measured_gemm_tflops": args.gemm_tflops,
    }
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row["start_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        times, losses, counters = [], [], {k: [] for k in step_profile.ALLOC_COUNTERS}
        reserved_after: list[float] = []
        for step in range(args.steps):
            # each rank its own sample, the same in every variant
            batch = _batch(length, shape, seed=1000 * step + rank, device=_feed(args, cuda))
            before = torch.cuda.memory_stats() if cuda else {}
            t0 = time.perf_counter()
            out = core.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(out.loss))
            if cuda:
                reserved_after.append(torch.cuda.memory_reserved() / GIB)
                for k, v in step_profile.alloc_deltas(before, torch.cuda.memory_stats()).items():
                    counters[k].append(int(v))
        row["step_s"] = times
        row["losses"] = losses
        row["eagle3_fused_wgrad_linears"] = eagle3_fused_wgrad.wrapped_names(trainer["draft"])
        row["eagle3_fused_proj_groups"] = eagle3_fused_proj.wrapped_groups(trainer["draft"])
        if len(times) > 1:
            med = sorted(times[1:])[len(times[1:]) // 2]
            row["median_step_s_after_first"] = med
            row["tokens_per_s"] = length / med
        if cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            row["measured_over_plan"] = row["peak_allocated_gib"] / row["plan_gib"]
            row["allocator_counters_per_step"] = counters
            row["reserved_after_step_gib"] = reserved_after
        if args.profile_steps:  # a failed profile costs its summary, never the row's timings
            try:
                row["profile"] = _profile(
                    args, core, rank=rank, length=length, shape=shape, workdir=workdir, cuda=cuda, flops=flops
                )
            except Exception as exc:
                row["profile_error"] = f"{type(exc).__name__}: {exc}"
    except torch.OutOfMemoryError as exc:
        row["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
    except Exception as exc:  # record and stop this backend's list
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def child(args) -> int:
    """One backend, lengths ascending, in this process; prints one JSON line per length."""
    import torch

    from specforge_kimi import register
    from specforge_kimi.plan.run_plan import load_recipe

    cuda = torch.cuda.is_available()
    if not cuda:
        from specforge_kimi.training.cpu_shims import install_cpu_shims

        install_cpu_shims()
    register()
    from specforge.distributed import destroy_distributed, init_distributed

    workdir = Path(args.workdir)
    base = load_recipe(args.recipe)
    if "WORLD_SIZE" not in os.environ:  # started directly, not by torchrun: one rank
        os.environ.update(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(args.port),
            }
        )
    init_distributed(timeout=10)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda and args.memory_cap_gib:  # before anything is allocated: the room a co-located server leaves
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
    try:
        trainer = _build_trainer(args, base, workdir, cuda)
    except Exception as exc:
        print(
            json.dumps({"backend": args.backend, "rank": rank, "error": f"build: {type(exc).__name__}: {exc}"}),
            flush=True,
        )
        destroy_distributed()
        return 0
    try:
        for length in args.lengths:
            row = _measure_length(args, trainer, base, length, rank=rank, workdir=workdir, cuda=cuda)
            row = _throughput(_merge_ranks(row, dist, world))
            if rank == 0:
                print(json.dumps(row), flush=True)
            if "error" in row:
                break
    finally:
        destroy_distributed()
    return 0


def _merge_ranks(row: dict, dist, world: int) -> dict:
    """Every rank's row for one length, merged (a collective: every rank calls it after each length).

    Peaks are the maximum over ranks, with the per-rank values beside them; throughput counts every
    rank's tokens over the slowest rank's median step; ``losses`` are rank 0's; an error on any rank is
    the row's error. With
    several ranks, a rank that fails inside a step's collectives can leave the others waiting there
    until SpecForge's process-group timeout (10 minutes here).
    """
    if world == 1:
        return {**row, "world_size": 1}
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    out = {**rows[0], "world_size": world}
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(rows) if "error" in r]
    if errors:
        return {**out, "error": "; ".join(errors)}
    for key in ("peak_allocated_gib", "peak_reserved_gib", "median_step_s_after_first"):
        if key in out:
            out[f"per_rank_{key}"] = [r[key] for r in rows]
            out[key] = max(r[key] for r in rows)
    if "median_step_s_after_first" in out:
        out["tokens_per_s"] = out["length"] * world / out["median_step_s_after_first"]
    if "peak_allocated_gib" in out:
        out["measured_over_plan"] = out["peak_allocated_gib"] / out["plan_gib"]
    return out


def _free_port() -> int:
    from specforge_kimi.run.services import free_ports

    return free_ports(1)[0]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/kimi-k25-8xb200-lowered.yaml", help="recipe whose trainer is built")
    ap.add_argument(
        "--backends",
        default="flex_attention,sdpa",
        help="comma-separated SpecForge attention backends: flex_attention (needs CUDA), fa (our fa-kernel seam: "
        "PyTorch's attention kernels), sdpa",
    )
    ap.add_argument("--lengths", default="2048,4096", help="comma-separated sample lengths (ascending per backend)")
    ap.add_argument("--sdpa-lengths", default=None, help="lengths for sdpa if different from --lengths")
    ap.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="trainer ranks (torchrun on this host, one per GPU); SpecForge's FSDP shards the optimizer "
        "state over them (SHARD_GRAD_OP) as in a co-located run",
    )
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per length (the first compiles)")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each length's timed steps, this many more under torch.profiler: a summary by class of "
        "work in the row and a gzipped chrome trace in the workdir (bench/step_profile.py)",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="the accelerator's dense bf16 peak for MFU (default: H200 spec 989; large GEMMs measure ~790)",
    )
    ap.add_argument(
        "--variants",
        default="recipe",
        help="comma-separated trainer-step variants, each in its own process per backend, compared with the first: "
        + ", ".join(f"{k} ({v})" for k, v in VARIANTS.items())
        + "; recipe = the recipe's trainer.step_empty_cache / fused_adamw / cuda_alloc_conf; "
        + ", ".join(f"{k} (recipe + {v})" for k, v in RECIPE_VARIANTS.items())
        + "; a+b+... (the recipe with each part's fields, parts of fewer_syncs and the recipe + variants: e.g. "
        "fewer_syncs+compiled+fused_wgrad+fused_clip). The patch switches need our SpecForge patches applied "
        "(specforge-kimi setup)",
    )
    ap.add_argument(
        "--feed",
        choices=("device", "host"),
        default="device",
        help="device (default): each step's batch is on the GPU before the step starts, as a cuda_ipc consumer's "
        "features are; host: the step copies it from pageable host memory",
    )
    ap.add_argument(
        "--memory-cap-gib",
        type=float,
        default=0.0,
        help="cap each rank's PyTorch allocator at this many GiB (torch.cuda.set_per_process_memory_fraction): the "
        "step in the room it has beside a co-located server (a run's trainer peak); 0 (default): the whole GPU",
    )
    ap.add_argument("--seed", type=int, default=0, help="draft init seed (the batches are seeded per step)")
    ap.add_argument("--workdir", default="runs/trainer-memory", help="stand-in target, renders, logs")
    ap.add_argument("--out", default=None, help="JSON result path")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--gemm-tflops", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return ap


@dataclass(frozen=True)
class Settings:
    """The parent's flags, checked: what ``measure`` runs and ``write`` records."""

    recipe_path: str
    backends: tuple[str, ...]
    lengths: str  # comma-separated, as the child takes them
    sdpa_lengths: str | None
    nproc: int
    steps: int
    profile_steps: int
    peak_tflops: float
    variants: tuple[str, ...]
    feed: str
    seed: int
    workdir: Path
    out: Path | None
    memory_cap_gib: float = 0.0


def _check_lengths(flag: str, value: str | None) -> None:
    from specforge_kimi.errors import KimiInputError

    if value is None:
        return
    try:
        lengths = [int(x) for x in value.split(",")]
    except ValueError:
        raise KimiInputError(f"{flag}: {value!r} is not a comma-separated list of token counts") from None
    if not lengths or min(lengths) <= 0 or lengths != sorted(lengths):
        raise KimiInputError(f"{flag}: {value!r} must be positive token counts in ascending order")


def parse(args: argparse.Namespace, family: str = "eagle3") -> Settings:
    """The parent's flags as ``Settings`` for a recipe of draft ``family``; a bad one is a one-line
    ``KimiInputError``."""
    import torch

    from specforge_kimi.errors import KimiInputError

    for flag, value in (("--lengths", args.lengths), ("--sdpa-lengths", args.sdpa_lengths)):
        _check_lengths(flag, value)
    if args.nproc < 1 or (torch.cuda.is_available() and args.nproc > torch.cuda.device_count()):
        raise KimiInputError(f"--nproc {args.nproc}: need 1..{torch.cuda.device_count() or 'N'} ranks (one per GPU)")
    if args.steps < 2:
        raise KimiInputError("--steps must be at least 2 (the first step compiles and is not timed)")
    if args.profile_steps < 0 or args.peak_tflops <= 0:
        raise KimiInputError("--profile-steps must be >= 0 and --peak-tflops > 0")
    if args.memory_cap_gib < 0 or (args.memory_cap_gib and not torch.cuda.is_available()):
        raise KimiInputError("--memory-cap-gib must be >= 0 (0: no cap), and a cap needs CUDA")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in EXECUTED:
            raise KimiInputError(f"--backends: {b!r} is not flex_attention, fa or sdpa")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS and recipe_update(v) is None:
            raise KimiInputError(
                f"--variants: {v!r} is not one of recipe, {', '.join([*VARIANTS, *RECIPE_VARIANTS])}, nor distinct "
                f"parts of {', '.join(COMPOSE_PARTS)} joined by +"
            )
    refused = [v for v in variants if any(p in EAGLE3_ONLY_VARIANTS for p in v.split("+")) and family != "eagle3"]
    if refused:
        raise KimiInputError(
            f"--variants: {', '.join(refused)} change SpecForge's eagle3 step only; "
            f"the recipe's draft is {family} (its variants: recipe, "
            f"{', '.join(v for v in [*VARIANTS, *RECIPE_VARIANTS] if v not in EAGLE3_ONLY_VARIANTS)})"
        )
    if len(set(variants)) != len(variants) or not variants:
        raise KimiInputError(f"--variants: {args.variants!r} must name each variant once")
    if "flex_attention" in backends and not torch.cuda.is_available():
        raise KimiInputError("--backends flex_attention needs CUDA (SpecForge's flex path has no CPU backward)")
    return Settings(
        recipe_path=args.recipe,
        backends=tuple(backends),
        lengths=args.lengths,
        sdpa_lengths=args.sdpa_lengths,
        nproc=args.nproc,
        steps=args.steps,
        profile_steps=args.profile_steps,
        peak_tflops=args.peak_tflops,
        variants=tuple(variants),
        feed=args.feed,
        seed=args.seed,
        workdir=Path(args.workdir),
        out=Path(args.out) if args.out else None,
        memory_cap_gib=args.memory_cap_gib,
    )


def _environment() -> dict:
    import importlib.metadata

    import torch

    try:
        sf_version = importlib.metadata.version("specforge")
    except importlib.metadata.PackageNotFoundError:
        sf_version = "unknown"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "specforge": sf_version,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def _document(s: Settings, recipe, *, gemm_tflops: float | None, setup_s: float) -> dict:
    """The result document before any row: the command, the environment and the run's configuration."""
    from specforge_kimi.training.step_knobs import STEP_ENV_NAMES

    return {
        "benchmark": "one trainer rank's peak memory and speed at a recipe's sizes vs recipes.memory_plan",
        "command": [sys.executable, *sys.argv],
        "environment": _environment(),
        "config": {
            "recipe": s.recipe_path,
            "family": recipe.trainer.family,
            "draft": recipe.trainer.draft.config(),
            **(
                {"ttt_length": recipe.trainer.ttt_length}
                if recipe.trainer.family == "eagle3"
                else {"block": recipe.trainer.block.model_dump(exclude_unset=True)}
            ),
            "target_hidden": recipe.target.hidden_size,
            "target_vocab": recipe.target.vocab_size,
            "steps": s.steps,
            "profile_steps": s.profile_steps,
            "peak_tflops": s.peak_tflops,
            "peak_tflops_source": "--peak-tflops (default: H200 SXM dense bf16 spec, 989 TFLOP/s without sparsity; "
            "large bf16 GEMMs reach ~790 on an H200 per issue 34, so MFU 0.8 is about the ceiling)",
            "measured_gemm_tflops": gemm_tflops,
            "measured_gemm": "bf16 8192x8192 @ 8192x8192, 40 times after 5, in this process before the rows",
            "world_size": s.nproc,
            "standin_setup_s": setup_s,
            "variants": {v: {k: variant_env(recipe, v, {}).get(k) for k in STEP_ENV_NAMES} for v in s.variants},
            "feed": s.feed,
            "seed": s.seed,
            "memory_cap_gib": s.memory_cap_gib or None,
        },
        "rows": [],
        "comparisons": [],
    }


def _child_command(
    s: Settings, *, variant: str, backend: str, gemm_tflops: float | None, target: Path, vocab: Path | None
) -> list[str]:
    lengths = s.sdpa_lengths if (backend == "sdpa" and s.sdpa_lengths) else s.lengths
    launcher = (
        [sys.executable]
        if s.nproc == 1
        else [
            *(sys.executable, "-m", "specforge_kimi.servers.loopback", "torch.distributed.run"),
            *("--standalone", "--local-addr=127.0.0.1", f"--nproc_per_node={s.nproc}"),
        ]
    )
    return [
        *launcher,
        str(Path(__file__).resolve()),
        "--child",
        "--recipe",
        s.recipe_path,
        "--backend",
        backend,
        "--lengths",
        lengths,
        "--steps",
        str(s.steps),
        "--profile-steps",
        str(s.profile_steps),
        "--peak-tflops",
        str(s.peak_tflops),
        *(("--gemm-tflops", str(gemm_tflops)) if gemm_tflops else ()),
        "--variant",
        variant,
        "--feed",
        s.feed,
        "--seed",
        str(s.seed),
        *(("--memory-cap-gib", str(s.memory_cap_gib)) if s.memory_cap_gib else ()),
        "--workdir",
        str(s.workdir),
        "--target",
        str(target),
        *(("--vocab", str(vocab)) if vocab else ()),
        "--port",
        str(_free_port()),
    ]


def _print_row(v: str, b: str, r: dict) -> None:
    if "error" in r:
        print(f"{v} {b} L={r.get('length')}: {r['error']}", flush=True)
        return
    mem = (
        f"peak {r['peak_allocated_gib']:.2f} GiB allocated / {r['peak_reserved_gib']:.2f} reserved, "
        f"plan {r['plan_gib']:.2f} ({r['measured_over_plan']:.2f}x), "
        if "peak_allocated_gib" in r
        else ""
    )
    print(
        f"{v} {b} L={r['length']}: {mem}step {r.get('median_step_s_after_first', float('nan')):.3f} s, "
        f"{r.get('achieved_tflops', float('nan')):.1f} TFLOP/s (MFU {r.get('mfu', float('nan')):.3f}), "
        f"losses {[round(x, 3) for x in r['losses']]}",
        flush=True,
    )
    if "profile" in r:
        p = r["profile"]
        classes = ", ".join(f"{c} {ms:.1f}" for c, ms in p["class_ms_per_step"].items() if ms)
        print(
            f"  profile ms/step: wall {p['wall_ms_per_step']:.1f}, "
            + (f"busy {p['busy_ms_per_step']:.1f}, " if p["busy_ms_per_step"] is not None else "")
            + classes
            + (
                f" (linked time over the device's taken off: {p['overlinked_ms_per_step']:.1f})"
                if p.get("overlinked_ms_per_step")
                else ""
            ),
            flush=True,
        )
    elif "profile_error" in r:
        print(f"  profile failed: {r['profile_error']}", flush=True)


def measure(s: Settings, recipe) -> dict:
    """Every (variant, backend) in its own child process; rows kept as they come (written as they come too)."""
    s.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # named by what shapes them, so a workdir reused with another recipe never reads a stale stand-in
    t = recipe.target
    target = write_standin_target(recipe, s.workdir / f"target-{t.num_layers}l-{t.hidden_size}h-{t.vocab_size}v")
    vocab = (  # a block draft predicts over the target's vocabulary: no mapping
        write_vocab_mapping(
            recipe, s.workdir / f"vocab_mapping-{recipe.trainer.draft.draft_vocab_size}-of-{t.vocab_size}.pt"
        )
        if recipe.trainer.family == "eagle3"
        else None
    )
    setup_s = time.perf_counter() - t0
    gemm_tflops = measure_gemm_tflops()
    doc = _document(s, recipe, gemm_tflops=gemm_tflops, setup_s=setup_s)
    for v, b in ((v, b) for v in s.variants for b in s.backends):
        cmd = _child_command(s, variant=v, backend=b, gemm_tflops=gemm_tflops, target=target, vocab=vocab)
        log = s.workdir / f"child-{v}-{b}.log"
        rows = []
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=fh,
                text=True,
                env=variant_env(recipe, v, dict(os.environ), backend=b),
            )
            for line in proc.stdout:  # each row is kept as it comes (a killed run keeps what it measured)
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    doc["rows"].append(rows[-1])
                    doc["comparisons"] = compare(doc["rows"])
                    write(s, doc)
            rc = proc.wait()
        if rc and not any("error" in r for r in rows):
            rows.append({"variant": v, "backend": b, "error": f"child exited {rc} (see {log})"})
            doc["rows"].append(rows[-1])
        for r in rows:
            _print_row(v, b, r)
    doc["comparisons"] = compare(doc["rows"])
    for c in doc["comparisons"]:
        if c["variant"] != c["against"]:
            print(
                f"{c['backend']} L={c['length']} {c['variant']} / {c['against']}: speed x{c['speed_ratio'] or float('nan'):.3f}, "
                f"largest loss difference {c['loss_max_abs_diff']}",
                flush=True,
            )
    return doc


def write(s: Settings, doc: dict) -> None:
    """The document at ``--out`` (nothing without it)."""
    if s.out:
        s.out.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/step_profile.py
    if args.child:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        return child(args)

    from specforge_kimi.plan.run_plan import load_recipe

    recipe = load_recipe(args.recipe)
    settings = parse(args, recipe.trainer.family)
    for v in settings.variants:  # each recipe-based variant's trainer section through the recipe's schema, first
        if recipe_update(v) is not None:
            variant_trainer(recipe, v)
    write(settings, measure(settings, recipe))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:
        if type(exc).__name__ != "KimiInputError":
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
