"""The trainer step's knobs that SpecForge 0.2.0 has no setting for, as environment variables of its processes.

Scope: the names and values only. Each variable is read by one of our SpecForge patches
(``patches/specforge/0.2.0``) inside SpecForge's own code, or, ``SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE``, by our
``compile-elementwise`` registration seam (no patch); without the patch the variable does nothing and
SpecForge behaves as shipped, so a launch that asks for a non-default value checks the patch first
(``setup.setup_patches.specforge_patch_gaps``, ``run.launch.trainer_step_preflight``). The recipe fields
(``trainer.step_empty_cache``, ``trainer.fused_adamw``, ``trainer.step_fewer_host_syncs``,
``trainer.step_chunked_head_loss``, ``trainer.step_compile_elementwise``, ``trainer.cuda_alloc_conf``) say why each exists; ``bench/trainer_memory.py --variants`` measures them side by side (bench/REPORT.md,
"One trainer rank at a recipe's sizes").
"""

from __future__ import annotations

import re

import specforge_kimi.environment as _env

#: SpecForge patch eagle3-keep-allocator-cache: "0" keeps the caching allocator's blocks across steps (SpecForge's
#: eagle3 forward calls ``torch.cuda.empty_cache()`` every step, so every step cudaMallocs its activations again)
EMPTY_CACHE_ENV = _env.EAGLE3_EMPTY_CACHE.name
EMPTY_CACHE_PATCH = "eagle3-keep-allocator-cache"
#: SpecForge patch bf16-optimizer-fused-adamw: "1" builds ``BF16Optimizer``'s AdamW with ``fused=True`` (one kernel
#: over the fp32 masters)
FUSED_ADAMW_ENV = _env.ADAMW_FUSED.name
FUSED_ADAMW_PATCH = "bf16-optimizer-fused-adamw"
#: SpecForge patch eagle3-fewer-host-syncs: "1" builds the eagle3 step's loss denominators and draft-vocabulary
#: columns on the device and reads the step's metrics back in one copy (SpecForge: 7 + 1 + 7 host waits per step at
#: TTT length 7; same values)
FEWER_SYNCS_ENV = _env.EAGLE3_FEWER_SYNCS.name
FEWER_SYNCS_PATCH = "eagle3-fewer-host-syncs"
#: SpecForge patch eagle3-chunked-head-loss: N > 0 runs the eagle3 draft head and its loss N positions at a time,
#: each chunk recomputed in the backward, so the step's whole [S, draft vocab] logits are never kept; "0": as shipped
CHUNKED_LOSS_ENV = _env.EAGLE3_CHUNKED_LOSS.name
CHUNKED_LOSS_PATCH = "eagle3-chunked-head-loss"
#: the compile-elementwise seam (``drafts.compile_elementwise``, no patch): "1" compiles the regions around the eagle3
#: Llama draft layer's attention (norms, MLP, residual adds) and the step's acceptance metric, "0": SpecForge's layer
#: and metric as shipped
COMPILE_ELEMENTWISE_ENV = _env.EAGLE3_COMPILE_ELEMENTWISE.name
#: the eagle3-block-mask seam (``drafts.eagle3_block_mask``, no patch): "1" builds the eagle3 flex attention's block
#: mask per block in closed form, "0": PyTorch's create_block_mask over every entry, as shipped
BLOCK_MASK_ENV = _env.EAGLE3_BLOCK_MASK.name
#: the flex-autotune seam (``drafts.flex_autotune``, no patch): "1" compiles SpecForge's flex attention with
#: max-autotune-no-cudagraphs, "0": its default compile, as shipped
FLEX_AUTOTUNE_ENV = _env.FLEX_AUTOTUNE.name
#: the optimizer-fused-clip seam (``drafts.optimizer_fused_clip``, no patch): "1" folds the BF16 optimizer's clip into
#: fused AdamW's grad_scale, its norm one multi-tensor pass, its masters cast back in one copy; "0": as shipped
FUSED_CLIP_ENV = _env.OPTIMIZER_FUSED_CLIP.name
#: the eagle3-fused-wgrad seam (``drafts.eagle3_fused_wgrad``, no patch): "1" sums each eagle3 draft weight's gradient
#: over the TTT positions inside its weight-gradient GEMM; "0": autograd's adds, as shipped
FUSED_WGRAD_ENV = _env.EAGLE3_FUSED_WGRAD.name
#: the eagle3-fused-proj seam (``drafts.eagle3_fused_proj``, no patch): "1" runs the eagle3 Llama draft layer's q/k/v
#: and gate/up projections as one GEMM per group; "0": one GEMM per projection, as shipped
FUSED_PROJ_ENV = _env.EAGLE3_FUSED_PROJ.name
#: the fa-kernel seam (``drafts.eagle3_fa_kernel``, no patch): "1" runs SpecForge's ``fa`` EAGLE-3 attention on
#: PyTorch's own attention kernels; set from the recipe's ``trainer.attention_backend: fa``, not a knob of its own
FA_KERNEL_ENV = _env.EAGLE3_FA_KERNEL.name
#: PyTorch's own; read once, when the process first touches CUDA
ALLOC_CONF_ENV = _env.PYTORCH_CUDA_ALLOC_CONF.name

#: every variable :func:`step_env` may set, in its order
STEP_ENV_NAMES = (
    EMPTY_CACHE_ENV,
    FUSED_ADAMW_ENV,
    FEWER_SYNCS_ENV,
    CHUNKED_LOSS_ENV,
    COMPILE_ELEMENTWISE_ENV,
    BLOCK_MASK_ENV,
    FLEX_AUTOTUNE_ENV,
    FUSED_WGRAD_ENV,
    FUSED_PROJ_ENV,
    FA_KERNEL_ENV,
    FUSED_CLIP_ENV,
    ALLOC_CONF_ENV,
)

_ALLOC_CONF = re.compile(r"[a-z0-9_]+:[A-Za-z0-9_.]+(,[a-z0-9_]+:[A-Za-z0-9_.]+)*")


def check_alloc_conf(value: str) -> str:
    """``value`` if it has PyTorch's ``key:value[,key:value]`` form, else ``ValueError`` naming it (PyTorch
    itself would only fail inside each trainer rank, at its first CUDA allocation)."""
    if not _ALLOC_CONF.fullmatch(value):
        raise ValueError(
            f"{value!r} is not PyTorch's allocator setting form key:value[,key:value] (e.g. expandable_segments:True)"
        )
    return value


def step_env(
    *,
    empty_cache: bool | None,
    fused_adamw: bool,
    alloc_conf: str | None,
    fewer_syncs: bool | None = False,
    chunked_loss: int | None = 0,
    compile_elementwise: bool | None = False,
    block_mask: bool | None = False,
    flex_autotune: bool | None = False,
    fused_wgrad: bool | None = False,
    fused_proj: bool | None = False,
    fa_kernel: bool | None = False,
    fused_clip: bool = False,
) -> dict[str, str]:
    """The variables for SpecForge's trainer processes: every patch switch always spelled out (so an
    inherited shell variable never decides), the allocator setting only when given. ``chunked_loss``: tokens per
    chunk, 0 off. ``empty_cache``, ``fewer_syncs``, ``chunked_loss``, ``compile_elementwise``, ``block_mask``, ``flex_autotune``, ``fused_wgrad``, ``fused_proj`` and ``fa_kernel`` None: the eagle3 step's switches left out
    (a block draft's step reads none of them); ``fused_clip`` is every family's (the optimizer)."""
    env = {FUSED_ADAMW_ENV: "1" if fused_adamw else "0"}
    if empty_cache is not None:
        env[EMPTY_CACHE_ENV] = "1" if empty_cache else "0"
    if fewer_syncs is not None:
        env[FEWER_SYNCS_ENV] = "1" if fewer_syncs else "0"
    if chunked_loss is not None:
        env[CHUNKED_LOSS_ENV] = str(int(chunked_loss))
    if compile_elementwise is not None:
        env[COMPILE_ELEMENTWISE_ENV] = "1" if compile_elementwise else "0"
    if block_mask is not None:
        env[BLOCK_MASK_ENV] = "1" if block_mask else "0"
    if flex_autotune is not None:
        env[FLEX_AUTOTUNE_ENV] = "1" if flex_autotune else "0"
    if fused_wgrad is not None:
        env[FUSED_WGRAD_ENV] = "1" if fused_wgrad else "0"
    if fused_proj is not None:
        env[FUSED_PROJ_ENV] = "1" if fused_proj else "0"
    if fa_kernel is not None:
        env[FA_KERNEL_ENV] = "1" if fa_kernel else "0"
    env[FUSED_CLIP_ENV] = "1" if fused_clip else "0"
    if alloc_conf:
        env[ALLOC_CONF_ENV] = check_alloc_conf(alloc_conf)
    return env


def trainer_env(trainer) -> dict[str, str]:
    """:func:`step_env` of a recipe's ``trainer`` section (``plan.recipes.TrainerSection``: its
    ``step_empty_cache``, ``fused_adamw``, ``cuda_alloc_conf``, ``step_fewer_host_syncs`` and
    ``step_chunked_head_loss``, ``step_compile_elementwise``, ``step_eagle3_block_mask``, ``step_flex_autotune``,
    ``step_eagle3_fused_wgrad``, ``step_eagle3_fused_proj``, ``step_optimizer_fused_clip``; the fa-kernel seam when ``attention_backend`` is
    ``fa``). A block draft (``trainer.family`` dflash or dspark) gets no eagle3 step switches:
    patches eagle3-keep-allocator-cache, eagle3-fewer-host-syncs and eagle3-chunked-head-loss change SpecForge's
    eagle3 step only, so the launch needs none of them; the compile-elementwise seam changes the eagle3 Llama draft's
    layer only, the eagle3-fused-wgrad and eagle3-fused-proj seams the eagle3 step's linears. The optimizer-fused-clip seam changes SpecForge's optimizer, which every family's trainer runs."""
    eagle3 = getattr(trainer, "family", "eagle3") == "eagle3"
    return step_env(
        empty_cache=trainer.step_empty_cache if eagle3 else None,
        fused_adamw=trainer.fused_adamw,
        alloc_conf=trainer.cuda_alloc_conf,
        fewer_syncs=trainer.step_fewer_host_syncs if eagle3 else None,
        chunked_loss=(trainer.step_chunked_head_loss or 0) if eagle3 else None,
        compile_elementwise=trainer.step_compile_elementwise if eagle3 else None,
        block_mask=trainer.step_eagle3_block_mask if eagle3 else None,
        flex_autotune=trainer.step_flex_autotune if eagle3 else None,
        fused_wgrad=trainer.step_eagle3_fused_wgrad if eagle3 else None,
        fused_proj=trainer.step_eagle3_fused_proj if eagle3 else None,
        fa_kernel=(trainer.attention_backend == "fa") if eagle3 else None,
        fused_clip=trainer.step_optimizer_fused_clip,
    )


def patches_needed(env: dict[str, str]) -> list[str]:
    """Our SpecForge patches (by name) an environment's values need to take effect (SpecForge's defaults need none)."""
    need = []
    if env.get(EMPTY_CACHE_ENV) == "0":
        need.append(EMPTY_CACHE_PATCH)
    if env.get(FUSED_ADAMW_ENV) == "1":
        need.append(FUSED_ADAMW_PATCH)
    if env.get(FEWER_SYNCS_ENV) == "1":
        need.append(FEWER_SYNCS_PATCH)
    if env.get(CHUNKED_LOSS_ENV, "0") not in ("", "0"):
        need.append(CHUNKED_LOSS_PATCH)
    return need
