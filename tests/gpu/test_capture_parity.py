"""SGLang 0.5.14 spec-capture (aux + last hidden written into Mooncake) == our reference hooks.

What runs: a tiny K2.5 checkpoint (or, with ``SPECFORGE_KIMI_PARITY_TARGET=k25-int4``, one at K2.5's
width with K2.5's INT4 routed experts, the reference computing on the same weights dequantized by
compressed-tensors), a Mooncake master on loopback, a text-only capture server
(:mod:`specforge_kimi.capture_server`, SGLang patched with SpecForge's spec-capture patch) at
TP=1 / TP=2 / TP=8 with FlashInfer all-reduce fusion off / on, and at TP=8 with expert parallelism (EP=8)
and with attention data parallelism (8 groups), each for both capture methods (``tests/capture_parity_cases.py``):
``eagle3`` (SpecForge ids, aux layers plus the last hidden state) and ``dflash`` (a block draft's DFlash ids, 5 on
the tiny target: positions = ids + 1, ``hidden_states`` [T, 5*H], no last hidden state). Capture requests go
through SpecForge's own producer transport (``SGLangServerCaptureAdapter.produce_refs`` with the method's server
layout), tensors come back through SpecForge's ``MooncakeFeatureStore.get``; the reference is
:func:`specforge_kimi.targets.capture.capture_aux` on an fp32 transformers forward of the same weights.

Tolerances, chosen knowingly:
- The tiny target routes every token to all of its experts (``experts_per_token == experts``).
  With top-2 of 8, bf16 vs fp32 flips near-tied expert choices for a few tokens: measured on CPU
  (transformers bf16 vs fp32 forward, this spec with top-2), per-token cosine fell to 0.85 at
  1024 tokens while the relative error stayed ~6%; with all experts it stayed >= 0.996. Routing
  flips are a property of bf16 vs fp32, not of capture, and would force a loose per-token bound.
- Per token: cosine >= 0.99 for every aux slot and the last hidden state (eagle3; dflash captures none).
- Per prompt: relative Frobenius error <= 0.02 + 0.04 * T / 1024 (a transformers bf16 forward on
  CPU, used as a proxy before the GPU run, gave 0.6-0.9% at 16-64 tokens and up to 3.6% at 1024;
  SGLang on H200 measured 0.64-0.84% at every length, see archive/gpu-runs/RUNS.md).
- Layer identity, strict: each captured slot must be >= 5x closer (relative Frobenius) to HF
  ``hidden_states[p]`` than to ``hidden_states[p-1]`` and ``[p+1]``; adjacent residuals of this
  model differ by >= 50%. This is what catches wrong layers and per-rank partial sums.
- TP=2 vs TP=1 captures directly: the same per-token cosine and length bound.

Writes ``capture_parity_summary.json`` and trimmed server logs into ``$SPECFORGE_KIMI_GPU_OUT``
(default: a temporary directory). Run on the GPU box: ``pytest tests/gpu/test_capture_parity.py
--run-gpu -x -q`` with the pinned stack on PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from capture_parity_cases import (
    CASES,
    COS_MIN,
    MARGIN_MIN,
    MAX_BATCH_TOKENS,
    capture_ids,
    captures_last,
    case_name,
    compare_runs,
    compare_to_reference,
    failures,
    reference_positions,
)
from capture_parity_cases import METHODS as CAPTURE_METHODS

from specforge_kimi.procfs import stat_fields

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
#: ``SPECFORGE_KIMI_PARITY_TARGET`` picks the target: ``tiny`` (hidden 512, bf16 experts) or ``k25-int4``:
#: K2.5's width (hidden 7168, 64 MLA heads, moe_intermediate 2048, dense 18432) with its INT4 routed experts
#: (compressed-tensors pack-quantized, group 32: SGLang serves them through its compressed-tensors WNA16 Marlin
#: MoE) -- 5 layers, 8 experts each, every token to all 8 (the routing-flip argument below), so what differs
#: from the reference is the capture and SGLang's INT4 kernels, not which experts a bf16 rounding picked.
TARGETS = {
    "tiny": dict(
        layers=8,
        hidden=512,
        heads=8,
        experts=8,
        experts_per_token=8,
        moe_intermediate=256,
        dense_intermediate=1024,
        q_lora_rank=1536,
        seed=0,
    ),
    "k25-int4": dict(
        layers=5,
        hidden=7168,
        heads=64,
        experts=8,
        experts_per_token=8,
        moe_intermediate=2048,
        dense_intermediate=18432,
        q_lora_rank=1536,
        seed=0,
        int4_experts=True,
    ),
}
TARGET = os.environ.get("SPECFORGE_KIMI_PARITY_TARGET", "tiny")
SPEC = TARGETS[TARGET]
#: 40 prompts, 16..1024 tokens; each capture request carries <= MAX_BATCH_TOKENS tokens.
LENGTHS = (
    16,
    17,
    23,
    31,
    32,
    48,
    64,
    65,
    100,
    127,
    128,
    129,
    200,
    255,
    256,
    257,
    300,
    384,
    450,
    500,
    511,
    512,
    513,
    600,
    640,
    700,
    767,
    768,
    800,
    850,
    900,
    950,
    1000,
    1001,
    1023,
    1024,
    37,
    333,
    777,
    999,
)
START_TIMEOUT_S = float(os.environ.get("SPECFORGE_KIMI_SERVER_START_TIMEOUT", "240"))
#: Optional wall-clock deadline (epoch seconds) for the whole module, so that a stalled server
#: leaves time to write the summary before an outer limit kills the run.
DEADLINE = float(os.environ.get("SPECFORGE_KIMI_GPU_DEADLINE", "0")) or None

#: Server-log lines that say whether FlashInfer all-reduce fusion really ran.
LOG_EVIDENCE = {
    "multimodal_forced_off": "set enable_multimodal=False",
    "fusion_auto_enabled": "Auto-enabling FlashInfer AllReduce Fusion",
    "fusion_forcibly_disabled": "FlashInfer allreduce fusion is forcibly disabled",
    "fusion_workspace_initialized": "FlashInfer AllReduce Fusion enabled and workspace initialized",
    "fusion_api_unavailable": "allreduce_fusion API is not available",
    "no_cuda_tile": "No module named 'cuda.tile'",
    "fusion_workspace_failed": "Failed to initialize FlashInfer workspace",
    "fusion_preflight_failed": "cuMemCreate probe failed",
    "fusion_disabled_globally": "FlashInfer allreduce fusion disabled globally",
    "fusion_comm_unavailable": "FlashInfer comm not available",
    "spec_capture_sink_connected": "spec-capture mooncake sink connected",
    "int4_marlin_moe": "CompressedTensorsWNA16MarlinMoEMethod",
}
FUSION_FALLBACK_KEYS = (
    "fusion_api_unavailable",
    "no_cuda_tile",
    "fusion_workspace_failed",
    "fusion_preflight_failed",
    "fusion_disabled_globally",
    "fusion_comm_unavailable",
)


# --------------------------------------------------------------------------------------------
# output: one JSON summary, rewritten after every step
# --------------------------------------------------------------------------------------------
_SUMMARY: dict = {}
_CAPTURES: dict[str, dict[int, tuple]] = {}


@pytest.fixture(scope="module")
def out_dir() -> Path:
    out = os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tempfile.mkdtemp(prefix="capture-parity-")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_summary(out: Path) -> None:
    (out / "capture_parity_summary.json").write_text(json.dumps(_SUMMARY, indent=1, default=str))


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in (
        "torch",
        "transformers",
        "sglang",
        "sglang-kernel",
        "specforge",
        "flashinfer-python",
        "mooncake-transfer-engine-cuda13",
        "mooncake-transfer-engine-non-cuda",
        "cuda-tile",
    ):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    spec = importlib.util.find_spec("sglang.srt.spec_capture_sink")
    out["spec_capture_sink_sha256"] = (
        hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest() if spec and spec.origin else None
    )
    return out


# --------------------------------------------------------------------------------------------
# fixtures: checkpoint, prompts, reference
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_k25(tmp_path_factory) -> Path:
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    # K2.5's width is generated (and quantized) on the GPU: seconds instead of minutes of CPU randn
    device = "cuda" if SPEC.get("int4_experts") and _gpu_count() else "cpu"
    return write_tiny(tmp_path_factory.mktemp("parity") / f"{TARGET}-k25", TinySpec(**SPEC), device=device)


def method_layers(method: str):
    """``(ids, AuxLayers)`` the server gets for ``method`` on this target (``capture_parity_cases.capture_ids``)."""
    return capture_ids(method, TARGET, SPEC["layers"])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    # ordinary token ids, below K2.5's specials (163584+)
    return [torch.randint(0, 163584, (n,), generator=gen).tolist() for n in LENGTHS]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module")
def reference(tiny_k25, prompts, out_dir):
    """fp32 transformers forward, our hooks for every capture method (each checked against ``output_hidden_states``):
    per prompt the last hidden state [T,H] and the HF ``hidden_states`` at every position the checks of every method
    need (CPU fp32)."""
    from contextlib import ExitStack

    import torch

    from specforge_kimi.targets.capture import capture_aux, text_decoder
    from specforge_kimi.targets.checkpoint import load_text_model

    auxes = [method_layers(m)[1] for m in CAPTURE_METHODS]
    layers = SPEC["layers"]
    needed = reference_positions(auxes, layers)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = _device()
    model = load_text_model(tiny_k25).to(device=dev, dtype=torch.float32)
    # plain fp32 everywhere: no grouped_mm / sdpa kernel choices in the reference
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    decoder = text_decoder(model)
    refs = []
    t0 = time.time()
    with torch.no_grad(), ExitStack() as stack:
        caps = [(aux, stack.enter_context(capture_aux(model, aux))) for aux in auxes]
        for ids in prompts:
            out = decoder(input_ids=torch.tensor([ids], device=dev), use_cache=False, output_hidden_states=True)
            hs = out.hidden_states
            assert len(hs) == layers + 1
            for aux, cap in caps:
                for chunk, p in zip(cap["aux"].chunk(len(aux.positions), dim=-1), aux.positions, strict=True):
                    assert torch.equal(chunk, hs[p]), "reference hooks disagree with output_hidden_states"
                assert torch.equal(cap["last"], hs[-1])
            refs.append({"last": hs[-1][0].cpu(), "hs": {q: hs[q][0].cpu() for q in needed}})
    del model, decoder
    if dev == "cuda":
        torch.cuda.empty_cache()
    _SUMMARY.setdefault("reference", {}).update(
        {
            "impl": "transformers DeepseekV3Model fp32 (no TF32, eager attention and experts) + "
            "specforge_kimi.targets.capture hooks",
            "device": dev,
            "seconds": round(time.time() - t0, 2),
        }
    )
    return refs


# --------------------------------------------------------------------------------------------
# processes: Mooncake master and the capture server, each in its own session
# --------------------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    """``services.free_ports``: distinct, and low enough for SGLang's gRPC port (server port + 10000)."""
    from specforge_kimi.run.services import free_ports

    return free_ports(n)


def _group_processes(pgid: int) -> list[dict]:
    """Processes of one process group, read from /proc (no ps needed)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        fields = stat_fields(int(d.name))
        if len(fields) < 3 or fields[2] != str(pgid):
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append({"pid": int(d.name), "state": fields[0], "cmd": cmd[:300]})
    return sorted(out, key=lambda p: p["pid"])


def mooncake_master(workdir: Path, ports):
    """``services.mooncake_master`` on ``ports``, sized for the parity prompts; its log in ``workdir``."""
    from specforge_kimi.run.services import mooncake_master

    return mooncake_master(workdir / "mooncake_master.log", segment_bytes=4 << 30, buffer_bytes=512 << 20, ports=ports)


class ServerStartError(RuntimeError):
    def __init__(self, message: str, diagnosis: dict):
        super().__init__(message)
        self.diagnosis = diagnosis


def server_command(
    ckpt: Path, *, tp: int, fusion: bool, port: int, aux_ids, ep: int = 1, dp: int = 1, method: str = "eagle3"
) -> list[str]:
    from specforge_kimi.servers.capture_server import capture_server_argv

    return capture_server_argv(
        ckpt,
        tp=tp,
        port=port,
        aux_specforge_ids=aux_ids,
        fusion=fusion,
        attention_backend="triton",
        mem_fraction_static=0.4,
        context_length=MAX_BATCH_TOKENS + 7,
        ep_size=ep,
        dp_attention_size=dp,
        method=method,
    )


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


COMPILERS = ("nvcc", "cicc", "ptxas", "ninja", "cudafe++", "fatbinary", "nvlink", "c++", "g++", "gcc")


def _compiling(procs: list[dict]) -> list[str]:
    names = [Path(p["cmd"].split(" ")[0]).name for p in procs if p["cmd"]]
    return sorted({n for n in names if n in COMPILERS})


@contextmanager
def capture_server(
    argv: list[str], env: dict, log_path: Path, port: int, timeout_s: float, hard_limit_s: float | None = None
):
    """Start, wait for /health, yield. Past ``timeout_s`` it keeps waiting up to ``hard_limit_s``
    only while a compiler (a JIT build) runs in the server's process group. On a stall it dumps
    every Python stack into the log (PYTHONFAULTHANDLER + SIGABRT) and raises
    :class:`ServerStartError` with the process samples it took every 30 s."""
    from specforge_kimi.run.services import stop_group

    log = open(log_path, "wb")
    env = {**env, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    hard_limit_s = max(timeout_s, hard_limit_s or timeout_s)
    t0 = time.time()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO))
    samples, next_sample = [], 30.0
    try:
        while not _health(port):
            elapsed = time.time() - t0
            if proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with {proc.returncode} before /health",
                    {"exit_code": proc.returncode, "after_s": round(elapsed, 1), "samples": samples},
                )
            if elapsed >= next_sample:
                procs = _group_processes(proc.pid)
                samples.append({"t_s": round(elapsed), "processes": len(procs), "compilers": _compiling(procs)})
                next_sample += 30.0
            over = elapsed > timeout_s and not (elapsed < hard_limit_s and _compiling(_group_processes(proc.pid)))
            if over:
                procs = _group_processes(proc.pid)
                for p in procs:  # PYTHONFAULTHANDLER=1: SIGABRT prints all thread stacks
                    if "python" in p["cmd"] or "sglang" in p["cmd"]:
                        try:
                            os.kill(p["pid"], signal.SIGABRT)
                        except ProcessLookupError:
                            pass
                        time.sleep(1.0)  # one dump at a time: they share the log
                time.sleep(3)
                raise ServerStartError(
                    f"server not healthy after {elapsed:.0f} s",
                    {"stalled_after_s": round(elapsed, 1), "processes": procs, "samples": samples},
                )
            time.sleep(1.0)
        startup_s = time.time() - t0
        yield startup_s
    finally:
        stop_group(proc)
        log.close()


def _log_evidence(text: str) -> dict:
    out = {}
    for key, needle in LOG_EVIDENCE.items():
        lines = [ln.strip()[:400] for ln in text.splitlines() if needle in ln]
        out[key] = {"count": len(lines), "first": lines[0] if lines else None}
    return out


def _trim_log(src: Path, dst: Path, head: int = 150, tail: int = 500) -> None:
    lines = src.read_text(errors="replace").splitlines()
    if len(lines) > head + tail:
        lines = lines[:head] + [f"... [{len(lines) - head - tail} lines trimmed] ..."] + lines[-tail:]
    dst.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------
# the SpecForge producer path: produce_refs -> MooncakeFeatureStore.get
# --------------------------------------------------------------------------------------------
def _batches(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy groups of prompt indices with <= MAX_BATCH_TOKENS tokens each, in order."""
    groups, cur, cur_tokens = [], [], 0
    for i, ids in enumerate(prompts):
        if cur and cur_tokens + len(ids) > MAX_BATCH_TOKENS:
            groups.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += len(ids)
    if cur:
        groups.append(cur)
    return groups


def capture_via_specforge(url: str, mc, prompts, aux_ids, *, run_id: str, method: str = "eagle3") -> tuple[dict, dict]:
    """Send every prompt through SpecForge's server-capture adapter with the ``method`` strategy's layout (eagle3 or
    dflash) and read the features back with SpecForge's Mooncake store. Returns ``{index: (aux [T,N*H], last [T,H]
    or None)}`` (bf16; dflash captures no last hidden state)."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure
    from specforge.runtime.contracts import PromptTask, SampleRef

    from specforge_kimi.run.offline_twin import capture_tools

    adapter, capture_cfg, store, layout = capture_tools(
        url,
        mc,
        aux_ids=aux_ids,
        hidden=SPEC["hidden"],
        vocab=163840,
        run_id=run_id,
        method=method,
        timeout_s=300.0,
    )
    out: dict[int, tuple] = {}
    stats = {
        "requests": [],
        "layout": {"aux": layout.aux_feature, "last": layout.last_hidden_feature},
        "capture_method": method,
    }
    for group in _batches(prompts):
        tasks = [
            PromptTask(
                task_id=f"p{i:03d}",
                run_id=run_id,
                source_id="capture-parity",
                payload={"input_ids": prompts[i], "loss_mask": [1] * len(prompts[i])},
                max_length=MAX_BATCH_TOKENS,
                metadata={"num_tokens": len(prompts[i])},
            )
            for i in group
        ]
        t0 = time.time()
        results = adapter.produce_refs(tasks, capture=capture_cfg)
        stats["requests"].append(
            {
                "prompts": len(group),
                "tokens": sum(len(prompts[i]) for i in group),
                "seconds": round(time.time() - t0, 3),
            }
        )
        for i, res in zip(group, results, strict=False):
            if isinstance(res, ServerCaptureFailure):
                raise AssertionError(f"prompt {i} ({len(prompts[i])} tokens): {res.reason}")
            assert isinstance(res, SampleRef)
            tensors, handle = store.get(res)
            assert tensors["input_ids"][0].tolist() == prompts[i], f"prompt {i}: stored input_ids differ"
            aux = tensors[layout.aux_feature][0]
            last = tensors[layout.last_hidden_feature][0] if layout.last_hidden_feature else None
            assert str(aux.dtype) == "torch.bfloat16" and (last is None or last.dtype == aux.dtype)
            out[i] = (aux, last)
            store.release(handle)
    return out, stats


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------
def _buckets(rows: list[dict], cols) -> list[dict]:
    """Worst values per length bucket: cosine min, rel err max, margin min."""
    edges = [(16, 63), (64, 255), (256, 511), (512, 1024)]
    out = []
    for lo, hi in edges:
        sel = [r for r in rows if lo <= r["tokens"] <= hi]
        if not sel:
            continue
        b = {"tokens": f"{lo}-{hi}", "prompts": len(sel)}
        for label, get in cols:
            vals = [get(r) for r in sel]
            b[label] = {
                "cos_min": min(v["cos_min"] for v in vals),
                "cos_mean": sum(v["cos_mean"] for v in vals) / len(vals),
                "rel_max": max(v["rel"] for v in vals),
                "rel_mean": sum(v["rel"] for v in vals) / len(vals),
            }
            if "margin" in vals[0]:
                b[label]["margin_min"] = min(v["margin"] for v in vals)
        out.append(b)
    return out


def _worst(rows: list[dict]) -> dict:
    """Headline numbers over all prompts: cosine min, rel err max (and as a fraction of the
    length bound), layer-identity margin min, per captured tensor."""
    out = {}
    labels = ["aux"] if not isinstance(rows[0]["aux"], list) else [f"aux_slot{k}" for k in range(len(rows[0]["aux"]))]
    for label in labels + (["last"] if rows[0].get("last") is not None else []):
        get = (
            (lambda r, lb=label: r["aux"][int(lb[8:])]) if label.startswith("aux_slot") else (lambda r, lb=label: r[lb])
        )
        vals = [(r, get(r)) for r in rows]
        w = {
            "cos_min": min(v["cos_min"] for _, v in vals),
            "cos_mean": sum(v["cos_mean"] for _, v in vals) / len(vals),
            "rel_max": max(v["rel"] for _, v in vals),
            "rel_over_bound_max": max(v["rel"] / r["rel_bound"] for r, v in vals),
        }
        if "margin" in vals[0][1]:
            w["margin_min"] = min(v["margin"] for _, v in vals)
        if "hf_index" in vals[0][1]:
            w["hf_index"] = vals[0][1]["hf_index"]
        out[label] = w
    return out


# --------------------------------------------------------------------------------------------
# the test
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,tp,fusion,ep,dp", CASES, ids=[case_name(*c) for c in CASES])
def test_capture_parity(method, tp, fusion, ep, dp, tiny_k25, prompts, reference, out_dir, tmp_path):
    from specforge_kimi.servers.capture_server import capture_server_env

    name = case_name(method, tp, fusion, ep, dp)
    aux_ids, aux = method_layers(method)
    _SUMMARY.setdefault("test", "tests/gpu/test_capture_parity.py")
    _SUMMARY.setdefault("date_utc", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    _SUMMARY.setdefault("versions", _versions())
    _SUMMARY.setdefault("gpus", _gpu_names())
    _SUMMARY.setdefault("target", TARGET)
    _SUMMARY.setdefault("tiny_spec", SPEC)
    _SUMMARY.setdefault("aux_specforge_ids", list(method_layers("eagle3")[0]))
    _SUMMARY.setdefault("aux_hf_positions", list(method_layers("eagle3")[1].positions))
    _SUMMARY.setdefault("dflash_ids", list(method_layers("dflash")[0]))
    _SUMMARY.setdefault("dflash_hf_positions", list(method_layers("dflash")[1].positions))
    _SUMMARY.setdefault("prompt_lengths", [len(p) for p in prompts])
    _SUMMARY.setdefault(
        "tolerances",
        {
            "per_token_cos_min": COS_MIN,
            "rel_frobenius_bound": "0.02 + 0.04*T/1024",
            "layer_identity_margin_min": MARGIN_MIN,
            "max_tokens_per_request": MAX_BATCH_TOKENS,
        },
    )
    runs = _SUMMARY.setdefault("runs", {})
    if fusion and tp == 1:
        runs[name] = {"status": "skipped", "reason": "all-reduce fusion needs TP > 1"}
        _write_summary(out_dir)
        pytest.skip("all-reduce fusion needs TP > 1 (there is no all-reduce at TP=1)")
    if _gpu_count() < tp:
        runs[name] = {"status": "skipped", "reason": f"{_gpu_count()} GPU(s) < tp={tp}"}
        _write_summary(out_dir)
        pytest.skip(f"needs {tp} GPUs")

    timeout_s = hard_limit_s = START_TIMEOUT_S
    if DEADLINE is not None:
        hard_limit_s = DEADLINE - time.time() - 45
        timeout_s = min(timeout_s, hard_limit_s)
        if timeout_s < 60:
            runs[name] = {"status": "skipped", "reason": f"only {timeout_s:.0f} s left before the deadline"}
            _write_summary(out_dir)
            pytest.skip("not enough time left before SPECFORGE_KIMI_GPU_DEADLINE")
    run = runs[name] = {
        "status": "starting",
        "capture": {
            "method": method,
            "ids": list(aux_ids),
            "hf_positions": list(aux.positions),
            "last_hidden": captures_last(method),
        },
        "start_timeout_s": round(timeout_s),
        "start_hard_limit_if_compiling_s": round(hard_limit_s),
    }
    port, *mc_ports = _free_ports(4)  # drawn together, so the master cannot get the server's port
    server_log = tmp_path / f"server_{name}.log"
    try:
        with mooncake_master(tmp_path, mc_ports) as mc:
            argv = server_command(
                tiny_k25, tp=tp, fusion=fusion, port=port, aux_ids=aux_ids, ep=ep, dp=dp, method=method
            )
            extra_env = capture_server_env(mc, cuda_visible_devices=list(range(tp)))
            run.update({"server_argv": argv[1:], "server_env": extra_env})
            env = {
                **os.environ,
                **extra_env,
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
            }
            with capture_server(argv, env, server_log, port, timeout_s, hard_limit_s) as startup_s:
                run["startup_s"] = round(startup_s, 1)
                t0 = time.time()
                captures, stats = capture_via_specforge(
                    f"http://127.0.0.1:{port}", mc, prompts, aux_ids, run_id=name, method=method
                )
                run["capture_s"] = round(time.time() - t0, 2)
                run["requests"] = stats
    except ServerStartError as exc:
        run.update({"status": "server_start_failed", "error": str(exc), "diagnosis": exc.diagnosis})
        raise
    except BaseException as exc:
        run.update({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        if server_log.exists():
            text = server_log.read_text(errors="replace")
            run["log_evidence"] = _log_evidence(text)
            run["log_lines"] = len(text.splitlines())
            _trim_log(server_log, out_dir / f"server_{name}.log")
        _write_summary(out_dir)

    ev = run["log_evidence"]
    run["fusion_active"] = bool(ev["fusion_workspace_initialized"]["count"]) and not any(
        ev[k]["count"] for k in FUSION_FALLBACK_KEYS
    )
    rows = compare_to_reference(captures, reference, aux, hidden=SPEC["hidden"], num_layers=SPEC["layers"])
    if captures_last(method) != (rows[0]["last"] is not None):
        raise AssertionError(f"{method}: the last hidden state was expected {captures_last(method)}, got the other")
    run["per_prompt"] = rows
    run["by_length"] = _buckets(
        rows,
        [(f"aux_slot{k}_hf{p}", (lambda r, k=k: r["aux"][k])) for k, p in enumerate(aux.positions)]
        + ([("last", lambda r: r["last"])] if captures_last(method) else []),
    )
    run["worst"] = _worst(rows)
    problems = failures(rows, with_identity=True)
    _CAPTURES[name] = captures
    base = case_name(method, 1, False)
    if tp > 1 and base in _CAPTURES:
        cross = compare_runs(captures, _CAPTURES[base], [len(p) for p in prompts])
        run["vs_tp1"] = {
            "worst": _worst(cross),
            "per_prompt": cross,
            "by_length": _buckets(
                cross,
                [("aux", lambda r: r["aux"])] + ([("last", lambda r: r["last"])] if captures_last(method) else []),
            ),
        }
        problems += [f"vs {base}: {f}" for f in failures(cross, with_identity=False)]
    run["failures"] = problems
    fusion_problem = None
    if fusion and not run["fusion_active"]:
        fusion_problem = "fusion requested but the server log shows it did not run: " + json.dumps(
            {k: v["first"] for k, v in ev.items() if v["count"] and k.startswith("fusion")}
        )
    if (
        not fusion
        and tp > 1
        and (not ev["fusion_forcibly_disabled"]["count"] or ev["fusion_workspace_initialized"]["count"])
    ):
        fusion_problem = "fusion should be off but the log does not show it forcibly disabled"
    run["status"] = "passed" if not problems and not fusion_problem else "failed"
    _write_summary(out_dir)
    assert ev["multimodal_forced_off"]["count"], "the capture server did not force enable_multimodal=False"
    if SPEC.get("int4_experts"):
        assert ev["int4_marlin_moe"]["count"], "the server did not take the compressed-tensors WNA16 Marlin MoE path"
    assert not fusion_problem, fusion_problem
    assert not problems, f"{len(problems)} parity failures, first: {problems[:5]}"


def _gpu_names() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
