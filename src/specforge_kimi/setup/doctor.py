"""``specforge-kimi doctor [RECIPE]``: is this machine ready to run a K2.5 draft recipe?

Scope: read-only checks, each with a fix. Versions against the pins; our SpecForge and SGLang patches (by name) and
SpecForge's SGLang capture patch (with file hashes); CUDA and NCCL; with a recipe also the
target checkpoint (config vs recipe, tensor names and shapes against the config), its data files
(tokenizer, prompts, vocab mapping, lengths: :mod:`specforge_kimi.plan.inputs`), Mooncake
reachability (or, with ``server.transport: cuda_ipc``, SGLang patch spec-capture-cuda-ipc and peer access to
GPU 0), GPU count/memory against the recipe's budget and the output_dir's free disk against the checkpoints and
export it keeps (:mod:`specforge_kimi.plan.disk`); for a block-draft recipe (``trainer.family`` dflash or
dspark) also its DFlash ids against the checkpoint, the dflash capture method in SGLang's patched capture code and
SGLang's DFLASH algorithm (and no eagle3-only SpecForge patch asked for). Nothing is started or written.
Exit code 0 when every check passes, 1 otherwise (warnings do not fail).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

PINS = {"specforge": "0.2.0", "sglang": "0.5.14", "torch": "2.11.0", "transformers": "5.8.1"}
MOONCAKE_DISTS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda"
#: Mooncake's build for the CUDA major version torch was built for, pinned (pyproject's extras gpu / gpu-cu12)
MOONCAKE_FOR_CUDA = {
    "13": ("mooncake-transfer-engine-cuda13", "0.3.14", "gpu"),
    "12": ("mooncake-transfer-engine", "0.3.13.post1", "gpu-cu12"),
}
#: the package each SpecForge tracker (recipes' tracking.report_to) imports
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def check_versions() -> list[Check]:
    out = []
    for dist, pin in PINS.items():
        v = _version(dist)
        ok = v is not None and v.split("+")[0] == pin
        out.append(
            Check(
                f"version {dist}",
                "ok" if ok else "fail",
                f"{v or 'not installed'} (pin {pin})",
                "" if ok else f"pip install 'specforge==0.2.0' (brings {dist}=={pin}); or bash scripts/bootstrap.sh",
            )
        )
    found = {d: _version(d) for d in MOONCAKE_DISTS}
    out.append(check_mooncake_build({d: v for d, v in found.items() if v}, _torch_cuda()))
    return out


def _torch_cuda() -> str | None:
    """torch's CUDA version when this host has usable GPUs, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda if torch.cuda.is_available() else None


def check_mooncake_build(have: dict[str, str], cuda: str | None) -> Check:
    """The installed Mooncake build(s) against the host: ``have`` maps installed distributions to versions,
    ``cuda`` is torch's CUDA version on a host with GPUs (None without). A CUDA host needs the CUDA build for
    torch's CUDA (the CPU build cannot move GPU tensors); a CPU host the CPU build."""
    fix_gpu = "bash scripts/bootstrap.sh --gpu"
    if not have:
        return Check(
            "mooncake",
            "fail",
            "no mooncake distribution",
            f"{fix_gpu} (GPU hosts) or pip install {MOONCAKE_CPU} (CPU)",
        )
    detail = json.dumps(have)
    if len(have) > 1:
        return Check(
            "mooncake",
            "fail",
            f"{detail}: several Mooncake builds share the `mooncake` package, whichever was installed last wins",
            f"pip uninstall -y {' '.join(sorted(have))}, then {fix_gpu} (GPU hosts) or pip install {MOONCAKE_CPU}",
        )
    (dist,) = have
    if cuda is None:
        if dist == MOONCAKE_CPU:
            return Check("mooncake", "ok", f"{detail} (CPU build, no GPUs here)")
        return Check(
            "mooncake",
            "warn",
            f"{detail}: a CUDA build on a host without usable GPUs",
            f"fine on a node whose GPUs are not visible now; a CPU-only machine needs pip install {MOONCAKE_CPU}",
        )
    major = cuda.split(".")[0]
    want = MOONCAKE_FOR_CUDA.get(major)
    if want is None:
        return Check(
            "mooncake",
            "fail",
            f"{detail}; torch is built for CUDA {cuda}, Mooncake has builds for CUDA 12 and 13 only",
            "install torch 2.11.0 for CUDA 12 or 13",
        )
    name, pin, extra = want
    if dist == name:
        return Check("mooncake", "ok", f"{detail} (CUDA {major} build; torch CUDA {cuda})")
    what = "the CPU build" if dist == MOONCAKE_CPU else f"{dist} (the wrong CUDA build)"
    return Check(
        "mooncake",
        "fail",
        f"{detail}: {what} on a host with GPUs and torch CUDA {cuda}; GPU tensors need {name}",
        f"pip uninstall -y {dist} && pip install '{name}=={pin}' (or pip install -e '.[{extra}]'); or {fix_gpu}",
    )


def check_tracking(recipe) -> list[Check]:
    """The package of the recipe's tracker (``tracking.report_to``), which SpecForge imports in the trainer."""
    import importlib.util

    report_to = recipe.tracking.report_to
    package = TRACKER_PACKAGES.get(report_to)
    if package is None:
        return [Check("tracking", "ok", f"report_to {report_to}")]
    if importlib.util.find_spec(package) is None:
        return [
            Check(
                "tracking",
                "fail",
                f"report_to {report_to}, but {package} is not installed (the trainer would stop at its first step)",
                f"pip install {package}, or set tracking: {{report_to: none}} in the recipe",
            )
        ]
    where = f"{recipe.output_dir}/runs" if report_to == "tensorboard" else report_to
    return [Check("tracking", "ok", f"report_to {report_to} ({where})")]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def eagle3_step_patches() -> frozenset[str]:
    """Our SpecForge patches only SpecForge's eagle3 step reads (:mod:`specforge_kimi.training.step_knobs`): the ones
    an EAGLE-3 recipe's step switches can ask for and a block draft's never do."""
    from specforge_kimi.training.step_knobs import patches_needed, step_env

    every = patches_needed(
        step_env(empty_cache=False, fused_adamw=True, alloc_conf=None, fewer_syncs=True, chunked_loss=1)
    )
    block = patches_needed(
        step_env(empty_cache=None, fused_adamw=True, alloc_conf=None, fewer_syncs=None, chunked_loss=None)
    )
    return frozenset(every) - frozenset(block)


def check_patches(family: str = "eagle3") -> list[Check]:
    """Our patches and SpecForge's SGLang capture patch. ``family``: the recipe's draft family; for a block draft
    an eagle3-only SpecForge patch that is not applied is no warning (its step never reads it)."""
    import importlib.util

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.setup import setup_patches

    out = []
    unused = eagle3_step_patches() if family != "eagle3" else frozenset()
    try:
        for s in setup_patches.plan(None, sglang=False):
            files = ", ".join(f"{f}@{_sha256(s.root / f)}" for f in s.files if (s.root / f).is_file())
            status = {"applied": "ok", "applicable": "warn", "drift": "fail"}[s.state]
            if status == "warn" and setup_patches.patch_name(s.patch) in unused:
                status, files = "ok", f"{files}; not needed: a {family} draft's step does not read it"
            warn = (
                "specforge-kimi setup (or set server.compact_passthrough: false in the recipe)"
                if setup_patches.patch_name(s.patch) == setup_patches.COMPACT_SPECFORGE_PATCH
                else "specforge-kimi setup (or run SpecForge through `specforge-kimi train`)"
            )
            out.append(
                Check(
                    f"specforge patch {setup_patches.patch_name(s.patch)}",
                    status,
                    f"{s.state}; {files}",
                    {"ok": "", "warn": warn, "fail": "reinstall specforge==0.2.0, then specforge-kimi setup"}[status],
                )
            )
    except KimiInputError as exc:
        out.append(Check("specforge patches", "fail", str(exc), "bash scripts/bootstrap.sh"))
    spec = importlib.util.find_spec("sglang.srt.spec_capture_sink") if _version("sglang") else None
    if spec and spec.origin:
        out.append(Check("sglang spec-capture patch", "ok", f"spec_capture_sink.py@{_sha256(Path(spec.origin))}"))
        # ours edit what the one before left: read as a stack (each alone would not reverse once the next is in)
        for s in setup_patches.classify_stack(setup_patches.our_sglang_patches(), setup_patches.sglang_root()):
            state = s.state
            status = {"applied": "ok", "applicable": "warn", "drift": "fail"}[state]
            out.append(
                Check(
                    f"sglang patch {setup_patches.patch_name(s.patch)}",
                    status,
                    state,
                    {
                        "ok": "",
                        "warn": "specforge-kimi setup --specforge-checkout /path/to/SpecForge",
                        "fail": "reinstall sglang==0.5.14, then specforge-kimi setup --specforge-checkout ...",
                    }[status],
                )
            )
    else:
        out.append(
            Check(
                "sglang spec-capture patch",
                "fail",
                "sglang.srt.spec_capture_sink is missing",
                f"specforge-kimi setup --specforge-checkout DIR, DIR a SpecForge checkout: {setup_patches.GET_CHECKOUT}",
            )
        )
    return out


def check_cuda() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [
            Check(
                "cuda",
                "fail",
                "torch.cuda.is_available() is False",
                "run on a GPU host with an NVIDIA driver; CPU machines run only the demo and tests",
            )
        ]
    n = torch.cuda.device_count()
    nccl = ".".join(str(x) for x in torch.cuda.nccl.version()) if hasattr(torch.cuda, "nccl") else "?"
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    return [Check("cuda", "ok", f"{n} GPU(s): {', '.join(names)}; torch CUDA {torch.version.cuda}; NCCL {nccl}")]


def check_target(recipe) -> list[Check]:
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.targets.checkpoint import inspect_target, tensor_shapes, weight_index

    t = recipe.target
    try:
        info = inspect_target(t.path)
    except KimiInputError as exc:
        return [Check("target checkpoint", "fail", str(exc), "point target.path at a local Kimi-K2.5 checkpoint")]
    out = []
    mism = [
        f"{k}: recipe {a}, checkpoint {b}"
        for k, a, b in (
            ("num_layers", t.num_layers, info.num_layers),
            ("hidden_size", t.hidden_size, info.hidden_size),
            ("vocab_size", t.vocab_size, info.vocab_size),
            ("num_attention_heads", t.num_attention_heads, info.text.get("num_attention_heads")),
        )
        if a != b
    ]
    out.append(
        Check(
            "target vs recipe",
            "fail" if mism else "ok",
            "; ".join(mism) or f"{info.layout}, {info.num_layers} layers, hidden {info.hidden_size}",
            "fix the recipe's target section" if mism else "",
        )
    )
    # Attention tensors of every layer against the config (experts may be quantized: names differ).
    tc = info.text
    heads, h = tc["num_attention_heads"], tc["hidden_size"]
    q_head = tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"]
    want = {}
    for i in range(info.num_layers):
        p = f"{info.layers_prefix}{i}.self_attn."
        want[p + "kv_a_proj_with_mqa.weight"] = (tc["kv_lora_rank"] + tc["qk_rope_head_dim"], h)
        want[p + "o_proj.weight"] = (h, heads * tc["v_head_dim"])
        if tc.get("q_lora_rank"):
            want[p + "q_b_proj.weight"] = (heads * q_head, tc["q_lora_rank"])
    index = weight_index(t.path)
    missing = [k for k in want if k not in index]
    if missing:
        out.append(
            Check(
                "target tensors",
                "fail",
                f"{len(missing)} attention tensors missing, e.g. {missing[0]}",
                "re-download the checkpoint (incomplete shards?)",
            )
        )
        return out
    shapes = tensor_shapes(t.path, list(want))
    bad = [f"{k} {list(shapes[k])} != {list(v)}" for k, v in want.items() if tuple(shapes[k]) != v]
    out.append(
        Check(
            "target tensors",
            "fail" if bad else "ok",
            bad[0] if bad else f"{len(want)} attention tensors match the config",
            "the checkpoint does not match its config.json" if bad else "",
        )
    )
    if info.quantization:
        out.append(_check_int4(t.path, info, recipe.tp))
    return out


def _check_int4(path, info, tp: int) -> Check:
    """K2.5's INT4 experts: every packed projection against the config, and the shapes SGLang's Marlin
    MoE kernel takes at the recipe's TP (hidden % 128, moe_intermediate / TP % 64)."""
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.targets.checkpoint import check_int4_shapes

    try:
        n = check_int4_shapes(path, info)
    except KimiInputError as exc:
        return Check("target INT4 experts", "fail", str(exc), "the checkpoint does not match its config.json")
    h, inter = info.text["hidden_size"], info.text["moe_intermediate_size"]
    if h % 128 or inter % tp or (inter // tp) % 64:
        return Check(
            "target INT4 experts",
            "fail",
            f"{n} INT4 projections match the config, but SGLang's Marlin "
            f"MoE needs hidden % 128 == 0 and moe_intermediate / TP % 64 == 0 (hidden {h}, "
            f"moe_intermediate {inter}, TP {tp})",
            "serve it at a TP that divides it so, or with --moe-runner-backend triton in server.extra_args",
        )
    return Check(
        "target INT4 experts",
        "ok",
        f"{info.quantization}: packed, scale and weight_shape match the "
        "config; the first INT4 prefill on a new host compiles SGLang's Marlin MoE kernel (minutes, "
        "silent after 'Warmup'; cached in TVM_FFI_CACHE_DIR)",
    )


def check_inputs(recipe) -> list[Check]:
    """The recipe's data files against the target and each other (:mod:`specforge_kimi.plan.inputs`)."""
    from specforge_kimi.plan import inputs

    problems = inputs.check_inputs(recipe)
    if not problems:
        return [Check("recipe inputs", "ok", "target, tokenizer, prompts, vocab mapping and max_length agree")]
    return [Check("recipe inputs", "fail", line, "fix the file or the recipe field it names") for line in problems]


#: what SpecForge's SGLang spec-capture patch writes into SGLang for a block draft's capture (file under the installed
#: ``sglang/`` -> a line it contains): the ``--spec-capture-method`` flag and its dflash/dspark routing of the capture ids
DFLASH_CAPTURE_MARKS = {
    "srt/server_args.py": "spec_capture_method",
    "srt/model_executor/model_runner.py": "self.dflash_target_layer_ids = server_args.spec_capture_aux_layer_ids",
}
#: what SGLang's ``--speculative-algorithm DFLASH`` is made of (the pinned SGLang ships them)
DFLASH_SERVE_MARKS = {
    "srt/speculative/spec_info.py": "DFLASH = auto()",
    "srt/server_args.py": "speculative_dflash_block_size",
    "srt/models/dflash.py": "class DFlashDraftModel",
}


def _missing_marks(site: Path, marks: dict[str, str]) -> list[str]:
    """The ``marks`` (file under ``site/sglang`` -> text) that the installed files lack, one phrase each."""
    out = []
    for rel, text in marks.items():
        path = site / "sglang" / rel
        if not path.is_file():
            out.append(f"sglang/{rel} is missing")
        elif text not in path.read_text(errors="replace"):
            out.append(f"sglang/{rel} has no {text!r}")
    return out


def check_block_ids(recipe) -> list[Check]:
    """A block draft's DFlash ids (``dflash_config.target_layer_ids``) and ``num_target_layers`` against the
    checkpoint's ``num_hidden_layers`` (ids ``0..L-2``: positions ids + 1); nothing when the target is absent (the
    target checks say so)."""
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.targets.checkpoint import read_config, text_config_dict
    from specforge_kimi.targets.layer_ids import AuxLayers

    try:
        layers = int(text_config_dict(read_config(recipe.target.path))["num_hidden_layers"])
    except (KimiInputError, KeyError, TypeError, ValueError):
        return []
    ids = recipe.capture_ids
    name = "block draft ids"
    try:
        aux = AuxLayers.from_dflash(ids, layers)
    except KimiInputError as exc:
        return [Check(name, "fail", f"{exc} (checkpoint num_hidden_layers)", "fix dflash_config.target_layer_ids")]
    n = recipe.trainer.draft.num_target_layers
    if n != layers:
        return [
            Check(
                name,
                "fail",
                f"the draft's num_target_layers is {n}, the checkpoint has {layers} layers",
                f"set trainer.draft.num_target_layers: {layers} (and target.num_layers)",
            )
        ]
    return [Check(name, "ok", f"DFlash ids {list(ids)} -> captured positions {list(aux.positions)} of {layers} layers")]


def check_block_sglang(family: str, site: Path | None = None) -> list[Check]:
    """For a block draft: the installed SGLang's spec-capture patch carries the dflash capture method
    (:data:`DFLASH_CAPTURE_MARKS`), and SGLang has the DFLASH algorithm (:data:`DFLASH_SERVE_MARKS`); a DSpark draft
    is a warning (SGLang 0.5.14 has no DSpark heads: it trains, its export for SGLang refuses)."""
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.setup import setup_patches

    try:
        site = site or setup_patches.sglang_root()
    except KimiInputError as exc:
        return [Check("sglang dflash capture", "fail", str(exc), "bash scripts/bootstrap.sh")]
    gaps = _missing_marks(site, DFLASH_CAPTURE_MARKS)
    out = [
        Check(
            "sglang dflash capture",
            "fail" if gaps else "ok",
            "; ".join(gaps) + " (SpecForge's spec-capture patch carries --spec-capture-method dflash)"
            if gaps
            else f"--spec-capture-method {family} routes the capture ids to SGLang's dflash capture",
            f"specforge-kimi setup --specforge-checkout DIR, DIR a SpecForge checkout: {setup_patches.GET_CHECKOUT}"
            if gaps
            else "",
        )
    ]
    gaps = _missing_marks(site, DFLASH_SERVE_MARKS)
    if gaps:
        out.append(Check("sglang DFLASH", "fail", "; ".join(gaps), f"pip install 'sglang=={setup_patches.SGLANG_PIN}'"))
    elif family == "dspark":
        out.append(
            Check(
                "sglang DFLASH",
                "warn",
                "SGLang has DFLASH but no DSpark heads: a dspark draft trains, its export for SGLang refuses",
                "train trainer.family dflash for a draft SGLang serves",
            )
        )
    else:
        out.append(Check("sglang DFLASH", "ok", "--speculative-algorithm DFLASH (models/dflash.py)"))
    return out


def check_transport(plan) -> list[Check]:
    """What the plan's transport needs of this host (its strategy's ``doctor_findings``): for Mooncake whether its
    master answers and the listeners it binds to every address, for cuda_ipc its SGLang patch and peer access."""
    from specforge_kimi.plan import transport_plan
    from specforge_kimi.plan.devices import node_gpus
    from specforge_kimi.setup.setup_patches import cuda_ipc_gaps

    recipe, strategy = plan.recipe, plan.strategy
    gaps = cuda_ipc_gaps() if strategy.sglang_patch else []
    found = strategy.doctor_findings(recipe, transport_plan.sizing(recipe), node_gpus(recipe.gpus.per_node), gaps)
    return [Check(f.name, f.status, f.detail, f.fix) for f in found]


def check_gpu_budget(recipe) -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("gpu budget", "fail", "no CUDA devices to check against the recipe", "run on the recipe's GPUs")]
    n = torch.cuda.device_count()
    if n < recipe.gpus.per_node:
        return [
            Check(
                "gpu budget",
                "fail",
                f"{n} GPUs visible, recipe needs {recipe.gpus.per_node} per node",
                "fix CUDA_VISIBLE_DEVICES or the recipe's gpus.per_node",
            )
        ]
    free = [torch.cuda.mem_get_info(i)[0] / 2**30 for i in range(recipe.gpus.per_node)]
    return [budget_check(recipe, free)]


def budget_check(recipe, free_gib: list[float]) -> Check:
    """The recipe's GPU budget against the free memory of each of a node's GPUs. Below ``gpus.memory_gib`` the
    recipe's memory split is planned again at the smallest free memory: if it still fits, a warning that names
    the figure to plan with (the server's pool is a fraction of the card, so it shrinks with it); if not, a
    failure naming what no longer fits."""
    from specforge_kimi.plan.memory import memory_plan

    want, least = recipe.gpus.memory_gib, min(free_gib)
    if least >= want * 0.97:
        return Check("gpu budget", "ok", f"min free {least:.1f} GiB >= recipe {want} GiB")
    low = "; ".join(f"GPU {i}: {f:.1f} GiB free" for i, f in enumerate(free_gib) if f < want * 0.97)
    here = recipe.model_copy(update={"gpus": recipe.gpus.model_copy(update={"memory_gib": round(least, 1)})})
    plan = memory_plan(here)
    split = (
        f"server pool {plan['server_pool_gib']} GiB for {plan['server_weights_gib'] + plan['server_kv_gib']:.1f}, "
        f"trainer ~{plan['trainer_peak_gib']} of {plan['trainer_room_gib']} GiB"
    )
    if plan["fits"]:
        return Check(
            "gpu budget",
            "warn",
            f"{low}, below the recipe's gpus.memory_gib {want}; its memory split still fits at {least:.1f} GiB "
            f"({split})",
            f"set gpus.memory_gib: {least:.1f} so the plan is this card's, or free the GPUs (nvidia-smi)",
        )
    return Check(
        "gpu budget",
        "fail",
        f"{low}, below the recipe's gpus.memory_gib {want}; at {least:.1f} GiB: {plan['why']}",
        "free the GPUs (nvidia-smi), run on cards with gpus.memory_gib free, or fit the recipe to this card "
        "(gpus.memory_gib, then server.mem_fraction_static, server.kv_tokens, trainer.max_length) until recipe "
        "validate passes",
    )


def disk_check(recipe, free: int | None = None) -> Check:
    """The disk the run's kept checkpoints and export take (:mod:`specforge_kimi.plan.disk`) against the free
    space of the filesystem that holds its output_dir (``free`` in bytes, measured there when None)."""
    from specforge_kimi.plan import disk

    free = disk.free_bytes(recipe.output_dir) if free is None else free
    short = disk.shortfall(recipe, free)
    if short is None:
        return Check("disk", "ok", f"{recipe.output_dir}: ~{disk.estimate(recipe)}, {free / 1e9:.1f} GB free")
    return Check("disk", "fail", short, disk.FIXES)


def run_checks(recipe_path: str | None) -> list[Check]:
    plan = bad = None
    if recipe_path:
        from specforge_kimi.errors import KimiInputError
        from specforge_kimi.plan import run_plan

        try:
            plan = run_plan.compile_plan(recipe_path)
        except KimiInputError as exc:
            bad = Check("recipe", "fail", str(exc), "fix the recipe (unknown fields are rejected)")
    family = plan.recipe.trainer.family if plan else "eagle3"
    checks = check_versions() + check_patches(family) + check_cuda()
    if bad:
        return checks + [bad]
    if plan:
        recipe, c = plan.recipe, plan.transport
        checks.append(Check("recipe", "ok", f"{recipe.name}: TP={recipe.tp}, memory split fits"))
        checks.append(Check("transport", "ok", f"{c.name} ({c.chosen_by}): {c.why}"))
        checks += (
            check_target(recipe)
            + check_inputs(recipe)
            + check_transport(plan)
            + check_gpu_budget(recipe)
            + [disk_check(recipe)]
            + check_tracking(recipe)
        )
        if recipe.is_block:
            checks += check_block_ids(recipe) + check_block_sglang(family)
    return checks


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``doctor`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument(
        "recipe",
        nargs="?",
        default=None,
        help="also check this recipe's target checkpoint, Mooncake and per-GPU memory budget",
    )
    p.add_argument("--json", action="store_true", help="the checks as a JSON list")


def run(args) -> int:
    checks = run_checks(args.recipe)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{c.status:4s}] {c.name}: {c.detail}" + (f"\n        fix: {c.fix}" if c.fix else ""))
    return 1 if any(c.status == "fail" for c in checks) else 0
