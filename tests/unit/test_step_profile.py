"""``bench/step_profile.py``'s CUDA summary over a hand-built event tree (the GPU run is the measurement).

The events mimic ``torch.profiler``'s ``FunctionEvent``s (the attributes the summary reads: name,
device type, time range, input shapes, ``cpu_parent``, ``kernels``), so the class rules, the busy-time
union and the unattributed remainder are checked where no GPU is.
"""

import importlib.util
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[2]
Kernel = namedtuple("Kernel", ["name", "device", "duration"])


def _module():
    spec = importlib.util.spec_from_file_location("step_profile", REPO / "bench" / "step_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Range(SimpleNamespace):
    def elapsed_us(self):
        return self.end - self.start


def _op(name, parent=None, shapes=(), kernels=(), start=0.0, end=0.0):
    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CPU,
        cpu_parent=parent,
        input_shapes=[list(s) for s in shapes],
        kernels=[Kernel(n, 0, d) for n, d in kernels],
        time_range=_Range(start=start, end=end),
        self_cpu_time_total=end - start,
    )


def _dev(name, start, end):
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=_Range(start=start, end=end))


def test_cuda_summary_classes_busy_and_runtime_calls():
    sp = _module()
    teacher = _op(sp.TEACHER)
    opt = _op(sp.OPTIMIZER)
    ops = [
        teacher,
        opt,
        # teacher head GEMM (163840 = target vocab) and its softmax, both inside the teacher range
        _op("aten::mm", teacher, [(4096, 7168), (7168, 163840)], [("nvjet_tst_256x128", 100.0)]),
        _op("aten::_softmax", teacher, [(4096, 32000)], [("triton_red_fused__softmax_0", 10.0)]),
        # draft head GEMM by shape, fc-like GEMM, sdpa-path bmm
        _op("aten::mm", None, [(4096, 7168), (7168, 32000)], [("sm90_xmma_gemm_bf16", 30.0)]),
        _op("aten::addmm", None, [(7168,), (4096, 21504), (21504, 7168)], [("nvjet_tst_128x256", 20.0)]),
        _op("aten::bmm", None, [(56, 4096, 128), (56, 128, 4096)], [("sm90_xmma_gemm_bf16", 8.0)]),
        # flex template, loss kernel, optimizer range and foreach kernel, copy, nccl, other
        _op("Torch-Compiled Region", None, [], [("triton_tem_fused_flex_attention_0", 40.0)]),
        _op("LogSoftmaxLoss", None, [], [("log_softmax_forward_kernel", 5.0)]),
        _op("aten::copy_", opt, [], [("elementwise_kernel", 6.0)]),
        _op("aten::_foreach_mul_", None, [], [("multi_tensor_apply_kernel", 4.0)]),
        _op("aten::copy_", None, [], [("Memcpy DtoD (Device -> Device)", 3.0), ("direct_copy_kernel", 2.0)]),
        _op("nccl:all_reduce", None, [], [("ncclDevKernel_AllReduce", 7.0)]),
        _op("aten::mul", None, [], [("vectorized_elementwise_kernel", 1.0)]),
        # CUDA runtime calls (CPU events)
        _op("cudaMalloc", start=0.0, end=50.0),
        _op("cudaFree", start=60.0, end=70.0),
        _op("cudaFree", start=80.0, end=90.0),
        _op("cudaLaunchKernel", start=0.0, end=1.0),
    ]
    linked = 100 + 10 + 30 + 20 + 8 + 40 + 5 + 6 + 4 + 3 + 2 + 7 + 1  # 238 us
    # device intervals: overlapping [0, 200) and [150, 250), plus [300, 338): busy 288 us, durations 338
    device = [_dev("a", 0.0, 200.0), _dev("b", 150.0, 250.0), _dev("c", 300.0, 338.0)]
    # record_function ranges on the device timeline (user annotations): not kernels, counted nowhere
    annotations = [
        SimpleNamespace(**vars(_dev("ProfilerStep#3", 0.0, 400.0)), is_user_annotation=True),
        SimpleNamespace(**vars(_dev("kimi:optimizer", 300.0, 400.0))),
    ]
    prof = SimpleNamespace(events=lambda: ops + device + annotations)
    s = sp.summarize(prof, steps=2, wall_s=[0.001, 0.001], cuda=True, target_vocab=163840, draft_vocab=32000)
    c = {k: round(v * 1e3 * 2, 6) for k, v in s["class_ms_per_step"].items()}  # back to us over 2 steps
    assert c == {
        "gemm": 20.0,
        "attention": 48.0,  # bmm 8 + flex template 40
        "draft_head_loss": 35.0,  # draft-vocab GEMM 30 + loss kernel 5
        "target_head_teacher": 110.0,
        "optimizer": 10.0,  # the copy inside the optimizer range + foreach kernel
        "copies": 5.0,
        "nccl": 7.0,
        "elementwise_other": 1.0,
        "unattributed": 338.0 - linked,
    }
    assert s["total_ms_per_step"] == pytest.approx(338.0 / 1e3 / 2)
    assert s["busy_ms_per_step"] == pytest.approx(288.0 / 1e3 / 2)
    assert s["wall_ms_per_step"] == pytest.approx(1.0)
    assert s["idle_ms_per_step"] == pytest.approx(1.0 - 0.144)
    assert s["runtime_calls_per_step"] == {
        "cudaFree": {"calls": 1.0, "ms": pytest.approx(0.01)},
        "cudaMalloc": {"calls": 0.5, "ms": pytest.approx(0.025)},
    }
    top = s["top"]  # 13 (kernel, class) pairs: the same GEMM kernel under two classes is two rows
    assert top[0] == {
        "name": "nvjet_tst_256x128",
        "class": "target_head_teacher",
        "ms_per_step": 0.05,
        "calls_per_step": 0.5,
        "sources": [
            {
                "op": "aten::mm",
                "input_shapes": "4096x7168,7168x163840",
                "backward_of": "",
                "ms_per_step": 0.05,
                "calls_per_step": 0.5,
            }
        ],
    }
    assert len(top) == 13 and sum(t["ms_per_step"] for t in top) == pytest.approx(linked / 1e3 / 2)


def test_top_kernels_name_the_ops_shapes_and_backward_nodes_that_launched_them():
    """One elementwise kernel launched from three places: its sources rank them by device time, each with the op's
    tensor shapes (scalars left out) and the autograd node whose backward ran it."""
    sp = _module()
    add = "vectorized_elementwise_kernel<CUDAFunctor_add<BFloat16>>"
    cat_bw = _op("autograd::engine::evaluate_function: CatBackward0")
    mm_bw = _op("autograd::engine::evaluate_function: MmBackward0")
    ops = [
        cat_bw,
        mm_bw,
        # inside the backward of a cat (nested under an op of its own), 2 calls of 30 us
        _op("aten::add_", _op("aten::sum_to_size", cat_bw), [(4096, 14336), (4096, 14336), ()], [(add, 30.0)]),
        _op("aten::add_", _op("aten::sum_to_size", cat_bw), [(4096, 14336), (4096, 14336), ()], [(add, 30.0)]),
        _op("aten::add", mm_bw, [(4096, 18432), (4096, 18432)], [(add, 40.0)]),  # 1 call of 40 us
        _op("aten::add", None, [(8, 128), (8, 128)], [(add, 1.0)]),  # a forward add
        _op("aten::add", None, [(4, 4), (4, 4)], [(add, 0.5)]),  # the fourth source: left out
    ]
    prof = SimpleNamespace(events=lambda: ops + [_dev("a", 0.0, 101.5)])
    s = sp.summarize(prof, steps=1, wall_s=[0.001], cuda=True, target_vocab=163840, draft_vocab=32000)
    (row,) = s["top"]
    assert (row["class"], row["calls_per_step"]) == ("elementwise_other", 5.0)
    assert [(x["op"], x["input_shapes"], x["backward_of"], x["calls_per_step"]) for x in row["sources"]] == [
        ("aten::add_", "4096x14336,4096x14336", "CatBackward0", 2.0),
        ("aten::add", "4096x18432,4096x18432", "MmBackward0", 1.0),
        ("aten::add", "8x128,8x128", "", 1.0),
    ]
    assert [x["ms_per_step"] for x in row["sources"]] == pytest.approx([0.06, 0.04, 0.001])
    assert sp.source(None) == ("", "", "")


def test_class_tflops_maps_model_terms_onto_classes():
    sp = _module()
    from specforge_kimi.training.step_flops import step_flops

    draft = {
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_attention_heads": 4,
        "vocab_size": 40,
        "draft_vocab_size": 12,
    }
    f = step_flops(draft, length=10, ttt_length=2, target_vocab=40)
    summary = {"class_ms_per_step": {"gemm": 1.0, "attention": 0.0, "draft_head_loss": 2.0, "target_head_teacher": 4.0}}
    out = sp.class_tflops(summary, f)
    t = f.by_term
    assert out["gemm"]["model_flops"] == t["fc"] + t["attn_proj"] + t["mlp"]
    assert out["gemm"]["tflops"] == pytest.approx(out["gemm"]["model_flops"] / 1e-3 / 1e12)
    assert out["attention"]["tflops"] is None  # no time measured: no rate
    assert out["target_head_teacher"]["model_flops"] == t["target_head"]


def test_annotate_names_the_optimizer_of_a_block_step_without_a_teacher():
    """A block draft's step has no separate teacher head (``target_head`` None): the optimizer is still named in
    the trace, and nothing else is wrapped."""
    import torch

    sp = _module()
    calls = []
    backend = SimpleNamespace(step=lambda: calls.append("step") or torch.ones(4).mul_(2.0))
    sp.annotate(target_head=None, backend=backend)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        backend.step()
    assert calls == ["step"]
    ranges = [e for e in prof.events() if e.name == sp.OPTIMIZER]
    assert len(ranges) == 1
    inside = [e.name for e in prof.events() if e.cpu_parent is ranges[0]]
    assert "aten::mul_" in inside or "aten::ones" in inside


def test_a_kernel_linked_to_several_ops_counts_its_device_time_once():
    """The profiler can attach one device kernel to more than one CPU op; the summary caps each kernel name's linked
    time at its time on the device timeline (each kernel once there), scales its calls alike and says how much it
    took off, so the classes never add up to more than the kernels ran."""
    sp = _module()
    opt = _op(sp.OPTIMIZER)
    adam = "multi_tensor_apply_kernel_FusedAdamMathFunctor"
    ops = [
        opt,
        # one launch on the device, linked to three ops
        *(_op("aten::_fused_adamw_", opt, [], [(adam, 10.0)]) for _ in range(3)),
        # a GEMM linked once, as it ran
        _op("aten::addmm", None, [(7168,), (4096, 21504), (21504, 7168)], [("nvjet_tst_128x256", 20.0)]),
    ]
    device = [_dev(adam, 0.0, 10.0), _dev("nvjet_tst_128x256", 10.0, 30.0)]
    prof = SimpleNamespace(events=lambda: ops + device)
    s = sp.summarize(prof, steps=1, wall_s=[30e-6], cuda=True, target_vocab=163840, draft_vocab=32000)
    c = {k: round(v * 1e3, 6) for k, v in s["class_ms_per_step"].items()}
    assert c["optimizer"] == 10.0 and c["gemm"] == 20.0 and c["unattributed"] == 0.0
    assert s["overlinked_ms_per_step"] == pytest.approx(20.0 / 1e3)
    assert s["total_ms_per_step"] == pytest.approx(s["busy_ms_per_step"]) == pytest.approx(30.0 / 1e3)
    top = {t["name"]: t for t in s["top"]}
    assert top[adam]["calls_per_step"] == pytest.approx(1.0)
    assert sum(src["calls_per_step"] for src in top[adam]["sources"]) == pytest.approx(1.0)
    # a name linked no more than it ran is left as it is
    assert sp.overlink_scale([("k", "gemm", 5.0, None)], {"k": 5.0}) == {}
    assert sp.overlink_scale([("k", "gemm", 5.0, None)], {}) == {}
