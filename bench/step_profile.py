"""A torch.profiler trace of EAGLE-3 trainer steps, summarised by class of work (``bench/trainer_memory.py --profile-steps``).

Scope: one process's profile of ``N`` ``TrainerCore.train_step`` calls after the timed steps. Classes:
``gemm`` (the draft's other GEMMs: fc, attention projections, MLP), ``attention`` (flex / sdpa / flash / cuDNN sdpa
kernels, inductor template kernels ``triton_tem_*`` -- flex is the only template here --, and ``bmm``
on the sdpa path's ``L x L`` products), ``draft_head_loss`` (GEMMs with a dimension equal to the draft
vocabulary, softmax / log-softmax / cross-entropy kernels including SpecForge's ``LogSoftmaxLoss``
Triton kernels), ``target_head_teacher`` (GEMMs with a dimension equal to the target vocabulary and every
kernel launched inside the teacher: ``TargetHead.forward`` and ``_compute_target_p_padded``, annotated by
:func:`annotate`), ``optimizer`` (anything inside ``backend.step`` -- grad clipping, the BF16 master copy,
AdamW -- and ``multi_tensor`` / ``foreach`` / ``adam`` kernels), ``copies`` (memcpy, memset, copy and
cat kernels), ``nccl``, ``elementwise_other`` and ``unattributed`` (device time of kernels the
profiler linked to no CPU op).

Method: each device kernel is attached by the profiler (correlation id) to the innermost CPU op that
launched it (``FunctionEvent.kernels``); a kernel's class comes from, in order: its name (nccl,
memcpy/memset), the annotated ranges among that op's ancestors (teacher, optimizer), the op itself
when it is a GEMM op (``aten::mm/addmm/bmm/baddbmm``: classed by its recorded input shapes, hence
``record_shapes``), then kernel-name patterns. GEMM time is the kernels' device time. Busy time is the
union of all device-kernel intervals; the idle gap (wall - busy) is launch, synchronisation and allocator
time. A kernel name's linked time is capped at its time on the device timeline (:func:`overlink_scale`: the profiler
can link one kernel to several ops); ``overlinked_ms_per_step`` is what the cap took off. Each top kernel names its
launching ops (``sources``: op, input shapes, and the autograd node whose backward ran it), so an elementwise kernel's time is traced to the tensors and the layer that cost it. On a host without
CUDA the same classes are filled from CPU ops' self times (no busy timeline).
"""

from __future__ import annotations

import contextlib
import functools
import re

CLASSES = (
    "gemm",
    "attention",
    "draft_head_loss",
    "target_head_teacher",
    "optimizer",
    "copies",
    "nccl",
    "elementwise_other",
    "unattributed",
)
TEACHER, OPTIMIZER = "kimi:teacher", "kimi:optimizer"
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
_GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(tn|nt|nn|tt)", re.I)
_ATTENTION = re.compile(r"flex|attention|attn|fmha|flash|sdpa|triton_tem_", re.I)
_LOSS = re.compile(r"softmax|cross_entropy|nll_loss|logsumexp", re.I)
_OPTIMIZER = re.compile(r"multi_tensor|foreach|adam", re.I)
_COPY = re.compile(r"memcpy|memset|copy|cat_|catarray|cat\b", re.I)
#: CUDA runtime calls counted per step: allocator churn and host synchronisation
_RUNTIME = re.compile(r"^cuda(Malloc|Free|MallocAsync|FreeAsync|MemGetInfo|\w*Synchronize)", re.I)
#: torch.cuda.memory_stats() counters recorded as per-step deltas
ALLOC_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _ranged(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        import torch

        with torch.profiler.record_function(name):
            return fn(*a, **kw)

    return wrapper


def annotate(*, target_head, backend) -> None:
    """Name the optimizer step and, for an EAGLE-3 step, the teacher in traces (instance/module wrappers, this
    process only). A block draft's step (``target_head`` None) holds the target's LM head inside its model and
    computes its objective there, so only the optimizer is named; its head and loss kernels fall to the shape
    rules of ``classify``."""
    backend.step = _ranged(OPTIMIZER, backend.step)
    if target_head is None:
        return
    import specforge.algorithms.eagle3.model as eagle3_model

    target_head.forward = _ranged(TEACHER, target_head.forward)
    if not getattr(eagle3_model._compute_target_p_padded, "__wrapped__", None):
        eagle3_model._compute_target_p_padded = _ranged(TEACHER, eagle3_model._compute_target_p_padded)


def _dims(event) -> set:
    return {d for shape in (event.input_shapes or []) if isinstance(shape, list | tuple) for d in shape}


def classify(kernel: str, op, *, target_vocab: int, draft_vocab: int) -> str:
    """Class of one kernel (or, on the CPU, one op) ``kernel`` launched by CPU op ``op`` (None if unlinked)."""
    if "nccl" in kernel.lower():
        return "nccl"
    if re.search(r"memcpy|memset", kernel, re.I):
        return "copies"
    names, e = set(), op
    while e is not None:
        names.add(e.name)
        e = e.cpu_parent
    if TEACHER in names:
        return "target_head_teacher"
    if OPTIMIZER in names or _OPTIMIZER.search(kernel):
        return "optimizer"
    if op is not None and op.name in GEMM_OPS:
        dims = _dims(op)
        if target_vocab in dims:
            return "target_head_teacher"
        if draft_vocab in dims:
            return "draft_head_loss"
        return "attention" if "bmm" in op.name else "gemm"
    if _ATTENTION.search(kernel):
        return "attention"
    if _GEMM_KERNEL.search(kernel):
        return "gemm"
    if _LOSS.search(kernel):
        return "draft_head_loss"
    if _COPY.search(kernel):
        return "copies"
    return "elementwise_other"


_BACKWARD = "autograd::engine::evaluate_function: "
#: launching ops kept per top kernel (the most device time first)
TOP_SOURCES = 3


def source(op) -> tuple[str, str, str]:
    """Where a kernel came from: the launching CPU op's name, its tensor inputs' shapes (``4096x7168,7168``) and the
    autograd node whose backward ran it (``MmBackward0``; "" in the forward or the optimizer). Empty strings for a
    kernel the profiler linked to no op."""
    if op is None:
        return ("", "", "")
    node, e = "", op
    while e is not None:
        if e.name.startswith(_BACKWARD):
            node = e.name[len(_BACKWARD) :]
            break
        e = e.cpu_parent
    shapes = ",".join(
        "x".join(str(d) for d in sh) for sh in (op.input_shapes or []) if isinstance(sh, list | tuple) and sh
    )
    return (op.name, shapes, node)


def _union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlink_scale(links: list, on_device: dict) -> dict[str, float]:
    """Per kernel name, the factor its linked time is scaled by so that it is at most that name's time on the device
    timeline, where each kernel appears once (names absent from it, or not over it, are left out: factor 1).

    The profiler can attach one device kernel to more than one CPU op (seen: fused AdamW's multi-tensor kernel linked
    many times more often than the step launches it, the classes' sum above the wall time). ``links``: (kernel name,
    class, microseconds, source) per link; ``on_device``: kernel name -> microseconds on the device timeline."""
    linked: dict = {}
    for name, _, us, _ in links:
        linked[name] = linked.get(name, 0.0) + us
    return {
        n: on_device[n] / us for n, us in linked.items() if on_device.get(n, 0.0) > 0 and us > on_device[n] * (1 + 1e-9)
    }


def summarize(prof, *, steps: int, wall_s: list, cuda: bool, target_vocab: int, draft_vocab: int, top: int = 25):
    """The profile's summary, per step (milliseconds): classes, wall, busy, idle, runtime calls, top kernels."""
    from torch.autograd import DeviceType

    events = prof.events()
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    by_class = dict.fromkeys(CLASSES, 0.0)
    kernels: dict = {}

    def add(name: str, cls: str, us: float, where: tuple, n: float = 1.0) -> None:
        by_class[cls] += us
        k = kernels.setdefault((name, cls), [0.0, 0, {}])
        k[0] += us
        k[1] += n
        src = k[2].setdefault(where, [0.0, 0])
        src[0] += us
        src[1] += n

    if cuda:
        # record_function ranges (ProfilerStep#N, the kimi: ranges) also appear on the device timeline as
        # user annotations spanning their kernels: they are not kernels, and counting them would inflate both
        # the unattributed time and the busy time
        device = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("ProfilerStep", "kimi:"))
        ]
        on_device: dict = {}  # kernel name -> its device time, each kernel once
        for e in device:
            on_device[e.name] = on_device.get(e.name, 0.0) + e.time_range.elapsed_us()
        device_us = sum(on_device.values())
        links = []
        for op in cpu_events:
            where = source(op) if op.kernels else None  # once per op, not per kernel
            for k in op.kernels:
                cls = classify(k.name, op, target_vocab=target_vocab, draft_vocab=draft_vocab)
                links.append((k.name, cls, k.duration, where))
        scale = overlink_scale(links, on_device)
        linked = 0.0
        for name, cls, us, where in links:
            f = scale.get(name, 1.0)
            add(name, cls, us * f, where, f)
            linked += us * f
        overlinked_us = sum(us for _, _, us, _ in links) - linked
        by_class["unattributed"] += max(device_us - linked, 0.0)
        busy_us = _union_us((e.time_range.start, e.time_range.end) for e in device)
    else:  # the CPU path: ops' self times (annotations excluded), classed the same way
        for op in cpu_events:
            if op.name.startswith("kimi:") or op.name.startswith("ProfilerStep"):
                continue
            cls = classify(op.name, op, target_vocab=target_vocab, draft_vocab=draft_vocab)
            add(op.name, cls, op.self_cpu_time_total, source(op))
        busy_us, overlinked_us = None, 0.0
    total_us = sum(by_class.values())
    runtime: dict = {}
    for e in cpu_events:
        if _RUNTIME.match(e.name):
            r = runtime.setdefault(e.name, {"calls": 0, "ms": 0.0})
            r["calls"] += 1
            r["ms"] += e.time_range.elapsed_us() / 1e3
    wall_ms = 1e3 * sum(wall_s) / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "time_source": "device kernels" if cuda else "cpu op self time",
        "wall_ms_per_step": wall_ms,
        "busy_ms_per_step": None if busy_us is None else busy_us / 1e3 / steps,
        "idle_ms_per_step": None if busy_us is None else wall_ms - busy_us / 1e3 / steps,
        "total_ms_per_step": total_us / 1e3 / steps,
        "overlinked_ms_per_step": overlinked_us / 1e3 / steps,
        "class_ms_per_step": {c: v / 1e3 / steps for c, v in by_class.items()},
        "runtime_calls_per_step": {
            n: {"calls": r["calls"] / steps, "ms": r["ms"] / steps} for n, r in sorted(runtime.items())
        },
        "top": [
            {
                "name": n[:200],
                "class": c,
                "ms_per_step": us / 1e3 / steps,
                "calls_per_step": cnt / steps,
                "sources": _sources(srcs, steps),
            }
            for (n, c), (us, cnt, srcs) in ranked
        ],
    }


def _sources(srcs: dict, steps: int) -> list:
    """A top kernel's launching ops, the most device time first (``TOP_SOURCES`` of them)."""
    ranked = sorted(srcs.items(), key=lambda kv: -kv[1][0])[:TOP_SOURCES]
    return [
        {
            "op": op,
            "input_shapes": shapes,
            "backward_of": node,
            "ms_per_step": us / 1e3 / steps,
            "calls_per_step": cnt / steps,
        }
        for (op, shapes, node), (us, cnt) in ranked
    ]


def alloc_deltas(before: dict, after: dict, steps: int = 1) -> dict:
    """Per-step change of the allocator counters ``ALLOC_COUNTERS`` between two ``torch.cuda.memory_stats()``."""
    return {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in ALLOC_COUNTERS}


def class_tflops(summary: dict, flops) -> dict:
    """Achieved TFLOP/s per class against the FLOP model's terms (``training.step_flops.StepFlops``)."""
    terms = flops.by_term
    model = {
        "gemm": terms["fc"] + terms["attn_proj"] + terms["mlp"],
        "attention": terms["attn_core"],
        "draft_head_loss": terms["draft_head"],
        "target_head_teacher": terms["target_head"],
    }
    out = {}
    for cls, f in model.items():
        ms = summary["class_ms_per_step"][cls]
        out[cls] = {"model_flops": f, "tflops": f / (ms * 1e-3) / 1e12 if ms > 0 else None}
    return out


@contextlib.contextmanager
def profiling(cuda: bool):
    """``torch.profiler.profile`` with CPU (and CUDA) activities and input shapes, no stacks."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        yield prof
