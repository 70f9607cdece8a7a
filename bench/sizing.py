"""Sizing model: a full 61-layer Kimi-K2.5 online run projected from the committed real-width measurements.

Reads only files under ``bench/results`` (``--results``), found by name:

- ``online_pipeline_k25_slice_h200.json``: the 5-layer K2.5-width slice (384 INT4 experts per MoE layer, TP=1):
  capture and plain prefill per transport, the sink's write time, one reader's GB/s;
- ``prefill_depth_k25_slice<L>_h200.json``: plain prefill of the slice at ``L`` layers. Two depths give the
  fixed and per-MoE-layer time directly; with one depth, the fixed part (embedding, head, dense layer 0: no
  experts) comes from the width probes ``capture_overhead_width7168_l<L>_e16_bf16_tp1_h200.json`` (hidden 7168,
  16 bf16 experts, two depths) and the per-MoE-layer time from the 384-expert slice, so the expert count the real
  run pays stays in the MoE term;
- ``online_run_k25_slice_<transport>[_<tag>].json`` (transport ``cuda_ipc`` or ``mooncake``; ``*_eval_draft``
  excluded): run-reports of the slice recipe's co-located runs, every one used, per transport. The trainer step a
  run ran is its report's ``trainer_step_env`` (from the launch sheet); for a report without it, a tag holding
  ``step_recipe`` marks the recipe's step (``trainer.step_empty_cache`` / ``fused_adamw`` / ``cuda_alloc_conf``
  as the slice recipe ships them) and any other run ran SpecForge's own (all runs before 2026-12-04;
  ``step_specforge`` says so explicitly);
- ``trainer_step_lifts_k25_b200_h200.json``: one trainer rank alone on the GPU at the recipes' draft, 4k and 16k
  tokens, the batch already on the GPU (``--feed cuda``: both transports hand the step device tensors), one row per
  step variant (``step_env``). A recipe's trainer rate is the row of its own step; a run's trainer-alone rate, the
  row of the step that run used;
- ``prefill_width7168_l6_e16_{bf16,int4}_h200.jsonl``: INT4 vs bf16 experts (the expert-count backtest).

and projects each shipped K2.5 recipe (8xB200 lowered, 8xB300, 2x8 B300) per transport that applies to it
(cuda_ipc: one node; Mooncake: all): node prefill tok/s, trainer tok/s per GPU, co-located end-to-end trained tok/s
per GPU, feature GB/s per node against what the transport carried, memory per GPU, wall time and GPU-hours per
1B trained tokens, beside TorchSpec's published K2.5 run. Every number not measured here is in ``ASSUMPTIONS``
with its source, and written into the output. ``backtest`` predicts measured configurations the model was not fed
(the slice run's end-to-end rate without that run; the slice's prefill from the 16-expert probes) and records
predicted, measured and the relative error.

    python bench/sizing.py      # writes bench/results/sizing_k25.json and docs/sizing.md's table

Scope: decode, the producer's CPU time, checkpoint stalls and restarts are left out (docs/sizing.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "sizing.md"
BEGIN, END = "<!-- sizing:begin (bench/sizing.py writes this) -->", "<!-- sizing:end -->"
K25_LAYERS = 61
GIB = 1024**3
RECIPES = ("kimi-k25-8xb200-lowered.yaml", "kimi-k25-8xb300.yaml", "kimi-k25-2x8xb300.yaml")
SLICE_RECIPE = "kimi-k25-slice-h200.yaml"
TRANSPORTS = ("cuda_ipc", "mooncake")
RUN_NAME = re.compile(r"^online_run_k25_slice_(cuda_ipc|mooncake)(_[A-Za-z0-9_.-]+)?\.json$")
DEPTH_NAME = re.compile(r"^prefill_depth_k25_slice(\d+)_h200\.json$")
PROBE_NAME = re.compile(r"^capture_overhead_width7168_l(\d+)_e16_bf16_tp1_h200\.json$")
#: TorchSpec's K2.5 EAGLE-3 run (FACTS.md "Performance anchors"): 6B tokens, 1,500 H200 GPU-hours, 16 inference
#: + 16 training GPUs.
TORCHSPEC = {"tokens": 6e9, "gpu_hours": 1500, "gpus": 32, "inference_gpus": 16, "trainer_gpus": 16}

#: Not measured here (one H200 is lent); each number with its source, written into the output.
ASSUMPTIONS = {
    "prefill_speed_vs_h200": {
        "H200": 1.0,
        "B200": 1.5,
        "B300": 1.5,
        "why": "vendor spec sheets: HBM 4.8 TB/s (H200) vs 8 TB/s (B200, B300), 132 vs 148 SMs; bf16 dense "
        "0.99 vs 2.25 PFLOPS. The INT4 experts run SGLang's moe_wna16_marlin, whose MMA is the Ampere-class "
        "mma.sync path rather than Blackwell's tcgen05, so the 2.25x peak is not assumed for the MoE; 1.5 sits "
        "between the SM-count ratio (1.12) and the HBM ratio (1.67)",
    },
    "trainer_speed_vs_h200": {
        "H200": 1.0,
        "B200": 2.0,
        "B300": 2.0,
        "why": "bf16 dense tensor throughput, vendor spec sheets: H200 0.99, B200 and B300 2.25 PFLOPS (B300 adds "
        "FP4, not bf16); the draft's step is cuBLAS bf16 GEMMs and flex attention, discounted to 2.0",
    },
    "tp_efficiency": {
        "1": 1.0,
        "8": 0.7,
        "16": 0.5,
        "why": "not measured at K2.5 width (one GPU lent): per-GPU prefill at TP=N = N x efficiency x one GPU's "
        "rate; TP=8 pays two NVLink all-reduces per layer and 8x smaller GEMMs per GPU (0.7 assumed); TP=16 spans "
        "two nodes' network (0.5 assumed)",
    },
    "overlap_carries": {
        "value": True,
        "why": "co-location hides part of the shorter stage's GPU time behind the longer one, or, when negative, "
        "costs more than the two stages' times added (measured on the slice's runs at TP=1, one GPU); the same "
        "fraction is assumed at TP=8/16 and on B200/B300. The rate with the times added (fraction 0) is in the "
        "output beside it",
    },
    "capture_tax_serial": {
        "value": True,
        "why": "the capture writer is one per server (TP rank 0's sink); its extra time per token, measured as "
        "capture minus plain prefill on the slice, is added to the server's time per token, not divided by TP",
    },
    "readers_scale": {
        "value": True,
        "why": "every trainer rank reads its own samples: a node's readers carry the measured one-reader rate x "
        "its ranks (Mooncake over loopback is per-client memcpy bound); RDMA between nodes is not measured",
    },
    "width_probe_fixed_part": {
        "value": "with one slice depth",
        "why": "the probes' fixed part (embedding, head, dense layer 0) stands for the slice's; the probes were "
        "`specforge-kimi tiny` targets whose dense MLP width is not recorded (tiny's default is 1024, the slice's "
        "18432: about 0.8 GFLOP more per token, ~1 us on an H200); if so, the slice's wider dense MLP lands in its "
        "per-MoE-layer time (~0.3 us of ~4 us per layer): conservative, up to ~8% on the 61-layer prefill",
    },
    "prompt_length": {
        "value": 4096,
        "why": "prefill per token is measured at 4096-token prompts and used for every recipe; the B300 recipes "
        "train 16,384-token samples, whose attention costs more per token (optimistic for them); the trainer rate "
        "is read at each recipe's max_length",
    },
}


#: The 8xB200 headline with one assumption at a time set to its pessimistic end: (what, ASSUMPTIONS changes,
#: overlap fraction: None for each transport's measured one, "worst" for the lowest single run's).
SENSITIVITY = (
    ("as projected", {}, None),
    ("the worst run's hidden fraction for both transports", {}, "worst"),
    ("prefill no faster than on an H200", {"prefill_speed_vs_h200": {"B200": 1.0, "B300": 1.0}}, None),
    ("TP=8 efficiency 0.5", {"tp_efficiency": {"8": 0.5}}, None),
    ("all three", {"prefill_speed_vs_h200": {"B200": 1.0, "B300": 1.0}, "tp_efficiency": {"8": 0.5}}, "worst"),
)


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} not found (run the measurement first; docs/sizing.md says which)") from None


def _shape_row(pipeline: dict, tokens_per_prompt: int, transport: str | None = None) -> dict:
    """A bench file's TP=1 row for a prompt length, of ``transport`` (or of the first run that has it)."""
    for run in pipeline["runs"]:
        if run.get("tp", 1) != 1 or transport not in (None, run.get("transport", "mooncake")):
            continue
        for row in run["shapes"]:
            if row["tokens_per_prompt"] == tokens_per_prompt:
                return row
    raise SystemExit(f"error: no TP=1 {transport or ''} row for {tokens_per_prompt}-token prompts in a result")


def depth_fit(points: list[tuple[int, float]]) -> dict:
    """Per-token prefill seconds at two depths (layers, plain tok/s) -> fixed + per-MoE-layer seconds
    (layer 0 is K2.5's dense layer: in the fixed part with the embedding and head), and K2.5's 61 layers."""
    (l1, r1), (l2, r2) = sorted(points)[:1] + sorted(points)[-1:]
    if l1 == l2:
        raise SystemExit("error: the two depth measurements have the same number of layers")
    t1, t2 = 1 / r1, 1 / r2
    per_layer = (t2 - t1) / (l2 - l1)
    fixed = t1 - per_layer * (l1 - 1)
    return {
        "method": "two depths of the 384-expert slice",
        "points": [{"layers": l1, "plain_tokens_per_s": r1}, {"layers": l2, "plain_tokens_per_s": r2}],
        "fixed_s_per_token": fixed,
        "per_moe_layer_s_per_token": per_layer,
        "k25_s_per_token_one_h200": fixed + per_layer * (K25_LAYERS - 1),
    }


def probe_fit(probes: list[tuple[int, float]], slice_point: tuple[int, float]) -> dict:
    """One slice depth + two 16-expert width probes: the probes' fixed part (no experts in it), the slice's own
    per-MoE-layer time ``(1/slice rate - fixed) / (slice layers - 1)`` (its 384 experts, not the probes' 16)."""
    probe = depth_fit(probes)
    layers, rate = slice_point
    per_layer = (1 / rate - probe["fixed_s_per_token"]) / (layers - 1)
    return {
        "method": "fixed part from the 16-expert width probes, per-MoE-layer time from the 384-expert slice",
        "points": [{"layers": layers, "plain_tokens_per_s": rate, "experts": 384}]
        + [{**p, "experts": 16} for p in probe["points"]],
        "fixed_s_per_token": probe["fixed_s_per_token"],
        "per_moe_layer_s_per_token": per_layer,
        "per_moe_layer_s_per_token_16_experts": probe["per_moe_layer_s_per_token"],
        "k25_s_per_token_one_h200": probe["fixed_s_per_token"] + per_layer * (K25_LAYERS - 1),
    }


def gpu_s_per_token(prefill: float, trainer: float, overlap: float) -> float:
    """One GPU's seconds per token when it both prefills (at ``prefill`` tok/s alone) and trains (``trainer``
    tok/s alone), ``overlap`` of the shorter stage's time hidden behind the longer one."""
    a, b = 1 / prefill, 1 / trainer
    return a + b - overlap * min(a, b)


def overlap_from_run(*, prefill: float, trainer: float, tax_s: float, end_to_end: float) -> float:
    """The hidden fraction that makes :func:`gpu_s_per_token` + the capture tax equal a measured one-GPU run."""
    a, b = 1 / prefill, 1 / trainer
    return (a + b + tax_s - 1 / end_to_end) / min(a, b)


def colocated(*, prefill: float, trainer: float, overlap: float, tax_s: float, gpus: int) -> float:
    """Trained tok/s of one capture server spread over ``gpus`` co-located GPUs (TP = gpus): the GPUs share the
    server's tokens, the server's one capture writer adds ``tax_s`` per token."""
    return 1 / (gpu_s_per_token(prefill, trainer, overlap) / gpus + tax_s)


#: SpecForge 0.2.0's own step, as ``training.step_knobs.step_env`` spells it (what every run before the knobs ran)
SPECFORGE_STEP = {
    "SPECFORGE_EAGLE3_EMPTY_CACHE": "1",
    "SPECFORGE_ADAMW_FUSED": "0",
    "SPECFORGE_EAGLE3_FEWER_SYNCS": "0",
    "SPECFORGE_EAGLE3_CHUNKED_LOSS": "0",
}


def _norm_step(env: dict) -> dict[str, str]:
    """A step's variables without the unset ones; a record written before patch eagle3-fewer-host-syncs' switch existed ran without
    it (``SPECFORGE_EAGLE3_FEWER_SYNCS=0``)."""
    out = {k: v for k, v in env.items() if v is not None}
    out.setdefault("SPECFORGE_EAGLE3_FEWER_SYNCS", "0")
    out.setdefault("SPECFORGE_EAGLE3_CHUNKED_LOSS", "0")  # likewise before patch eagle3-chunked-head-loss' switch
    return out


def _recipe_step(r) -> dict[str, str]:
    """The trainer step a recipe ships, as the trainer bench's ``step_env`` records it."""
    from specforge_kimi.training.step_knobs import trainer_env

    return trainer_env(r.trainer)


def _same_step(row_env: dict, step: dict[str, str]) -> bool:
    return _norm_step(row_env) == _norm_step(step)


def _trainer_rate(trainer_bench: dict, length: int, step: dict[str, str]) -> tuple[int, float]:
    """The flex_attention row nearest ``length`` of the step ``step`` (its ``step_env``), its batch on the GPU
    (``feed: cuda``); a bench without such a row is one line naming the step."""
    rows = [
        r
        for r in trainer_bench["rows"]
        if r["backend"] == "flex_attention"
        and "tokens_per_s" in r
        and r.get("feed") == "cuda"
        and _same_step(r.get("step_env", {}), step)
    ]
    if not rows:
        raise SystemExit(f"error: the trainer bench has no flex_attention row fed from the GPU of the step {step}")
    row = min(rows, key=lambda r: (abs(r["length"] - length), r["length"]))
    return row["length"], row["tokens_per_s"]


def project(
    *,
    fit: dict,
    capture: dict[str, dict],
    trainer_bench: dict,
    overlap: dict[str, float],
    plans: dict[str, dict],
    recipes: dict[str, dict],
    feature_bytes: float,
    assumptions: dict | None = None,
) -> dict:
    """The projection per recipe and applicable transport. ``capture``: per transport ``tax_s_per_token``,
    ``read_gb_per_s`` (one reader), ``writer_gb_per_s``; ``overlap``: the hidden fraction per transport;
    ``assumptions``: ``ASSUMPTIONS`` unless given (the sensitivity rows)."""
    a = assumptions or ASSUMPTIONS
    out = {}
    for name, r in recipes.items():
        per_node, nnodes, kind = r["per_node"], r["nnodes"], r["kind"]
        tp = per_node * nnodes
        eff = a["tp_efficiency"][str(tp)]
        prefill = eff * a["prefill_speed_vs_h200"][kind] / fit["k25_s_per_token_one_h200"]
        length, trainer_h200 = _trainer_rate(trainer_bench, r["max_length"], r["step"])
        trainer = a["trainer_speed_vs_h200"][kind] * trainer_h200
        per_transport = {}
        for t in r["transports"]:
            c = capture[t]
            server = colocated(
                prefill=prefill, trainer=trainer, overlap=overlap[t], tax_s=c["tax_s_per_token"], gpus=tp
            )
            added = colocated(prefill=prefill, trainer=trainer, overlap=0.0, tax_s=c["tax_s_per_token"], gpus=tp)
            e2e = server / tp
            node_gb_s = server / nnodes * feature_bytes / 1e9
            readers = c["read_gb_per_s"] * per_node
            writer_gb_s = server * feature_bytes / 1e9
            wall_h = 1e9 / server / 3600
            per_transport[t] = {
                "end_to_end_tokens_per_s_per_gpu": e2e,
                "end_to_end_no_overlap_tokens_per_s_per_gpu": added / tp,
                "overlap_hidden_fraction": overlap[t],
                "server_tokens_per_s": server,
                "feature_gb_per_s_per_node": node_gb_s,
                "transport_readers_gb_per_s_per_node": readers,
                "writer_gb_per_s": writer_gb_s,
                "transport_writer_gb_per_s": c["writer_gb_per_s"],
                "transport_bound": node_gb_s > readers or writer_gb_s > c["writer_gb_per_s"],
                "wall_hours_per_1b_tokens": wall_h,
                "gpu_hours_per_1b_tokens": wall_h * tp,
                "memory_per_gpu_gib": plans[name][t],
            }
        out[name] = {
            "gpus": f"{nnodes}x{per_node} {kind}",
            "tp": tp,
            "recipe_transport": r["transport"],
            "prefill_tokens_per_s_per_gpu": prefill,
            "node_prefill_tokens_per_s": prefill * per_node,
            "trainer_tokens_per_s_per_gpu": trainer,
            "trainer_bench_length": length,
            "slowest_stage": "prefill" if prefill < trainer else "trainer",
            "transports": per_transport,
            "memory_per_gpu_gib": plans[name][r["transports"][0]],
        }
    return out


def _memory(r, slice_overheads: dict) -> dict:
    """``memory_plan`` per GPU, and the sum with the server's memory outside its pool as the slice measured it
    (CUDA context, activations: real use). The trainer's peak scaled like the slice's nvidia-smi peak (the
    allocator's cache included, so an upper bound) is kept beside it."""
    p = _recipes().memory_plan(r)
    server_peak = p["server_pool_gib"] + slice_overheads["server_outside_pool_gib"]
    total = server_peak + p["trainer_peak_gib"]
    return {
        "gpu": r.gpus.memory_gib,
        "server_pool": p["server_pool_gib"],
        "trainer_plan": p["trainer_peak_gib"],
        "trainer_room": p["trainer_room_gib"],
        "plan_fits": p["fits"],
        "server_peak_like_slice": server_peak,
        "server_peak_plus_trainer_plan": total,
        "fits_with_server_overhead": total <= r.gpus.memory_gib,
        "trainer_peak_like_slice_upper_bound": p["trainer_peak_gib"] * slice_overheads["trainer_measured_over_plan"],
    }


def _recipes():
    """``specforge_kimi.plan.run_plan`` (``load_recipe``: a recipe as its compiled plan resolves it) and
    ``plan.memory.memory_plan`` (the split with a transport the recipe may not name), with this checkout's ``src/``
    put on ``sys.path`` once (the script runs from a checkout without an install)."""
    import types

    src = str(REPO / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from specforge_kimi.plan import memory, run_plan

    return types.SimpleNamespace(load_recipe=run_plan.load_recipe, memory_plan=memory.memory_plan)


def _with_transport(r, transport: str):
    return r.model_copy(update={"server": r.server.model_copy(update={"transport": transport})})


def _recipe_inputs(slice_peaks: dict, slice_transport: str) -> tuple[dict, dict, dict]:
    """Recipes' shapes and transports, and memory per GPU per transport: ``recipes.memory_plan`` and the plan
    corrected as the slice's run measured it (server: its peak outside the pool; trainer: its peak over plan)."""
    recipes = _recipes()
    load_recipe, memory_plan = recipes.load_recipe, recipes.memory_plan

    sl = _with_transport(load_recipe(REPO / "recipes" / SLICE_RECIPE), slice_transport)
    sp = memory_plan(sl)
    server, trainer = slice_peaks.get("capture-server"), slice_peaks.get("trainer")
    overheads = {
        # a run-report without GPU samples: nothing added (said so by "measured")
        "measured": server is not None and trainer is not None,
        "server_outside_pool_gib": server / 1024 - sp["server_pool_gib"] if server is not None else 0.0,
        "trainer_measured_over_plan": trainer / 1024 / sp["trainer_peak_gib"] if trainer is not None else 1.0,
        "slice_plan": {
            "transport": slice_transport,
            "server_pool": sp["server_pool_gib"],
            "trainer_plan": sp["trainer_peak_gib"],
        },
        "slice_measured_peak_gib": {k: v / 1024 for k, v in slice_peaks.items()},
    }
    recipes, plans = {}, {}
    for f in RECIPES:
        r = load_recipe(REPO / "recipes" / f)
        explicit = "transport" in r.server.model_fields_set
        # cuda_ipc maps one node's pool: single-node only; Mooncake everywhere
        transports = [t for t in TRANSPORTS if t == "mooncake" or r.gpus.nnodes == 1]
        if explicit:
            transports.sort(key=lambda t: t != r.server.transport)
        recipes[r.name] = {
            "per_node": r.gpus.per_node,
            "nnodes": r.gpus.nnodes,
            "kind": r.gpus.kind,
            "max_length": r.trainer.max_length,
            "step": _recipe_step(r),
            "transports": transports,
            "transport": r.server.transport if explicit else "not set (single node: cuda_ipc-capable)",
        }
        plans[r.name] = {t: _memory(_with_transport(r, t), overheads) for t in transports}
    return recipes, plans, overheads


def find_inputs(results: Path) -> dict:
    """The committed measurement files, by the naming rules of the module docstring."""
    names = sorted(p.name for p in results.iterdir())
    runs: dict[str, list[Path]] = {}
    for n in names:
        m = RUN_NAME.match(n)
        if m and not n.endswith("_eval_draft.json"):
            runs.setdefault(m.group(1), []).append(results / n)
    return {
        "pipeline": results / "online_pipeline_k25_slice_h200.json",
        "depth": {int(m.group(1)): results / n for n in names if (m := DEPTH_NAME.match(n))},
        "probes": {int(m.group(1)): results / n for n in names if (m := PROBE_NAME.match(n))},
        "runs": runs,
        "trainer": results / "trainer_step_lifts_k25_b200_h200.json",
        "int4": results / "prefill_width7168_l6_e16_int4_h200.jsonl",
        "bf16": results / "prefill_width7168_l6_e16_bf16_h200.jsonl",
    }


def _jsonl_rate(path: Path, batch: int, length: int) -> float:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rates = [r["prefill_throughput"] for r in rows if r["batch_size"] == batch and r["input_len"] == length]
    if not rates:
        raise SystemExit(f"error: no {batch}x{length} row in {path}")
    return sum(rates) / len(rates)


def prefill_fit(inputs: dict, length: int) -> tuple[dict, int, float]:
    """The depth fit, and the slice's own depth point (layers, plain tok/s)."""
    pipeline_layers = _load(inputs["pipeline"])["config"]["layers"]
    if pipeline_layers not in inputs["depth"]:
        raise SystemExit(f"error: no prefill_depth_k25_slice{pipeline_layers}_h200.json beside the pipeline result")
    points = {k: _shape_row(_load(p), length)["plain_tokens_per_s"] for k, p in inputs["depth"].items()}
    slice_rate = points[pipeline_layers]
    if len(points) >= 2:
        return depth_fit(list(points.items())), pipeline_layers, slice_rate
    if len(inputs["probes"]) < 2:
        raise SystemExit("error: one slice depth and fewer than two width probes: no per-layer fit")
    probes = [(k, _shape_row(_load(p), length)["plain_tokens_per_s"]) for k, p in inputs["probes"].items()]
    return probe_fit(probes, (pipeline_layers, slice_rate)), pipeline_layers, slice_rate


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def backtest(
    *, runs: dict[str, list[dict]], slice_prefill: float, fit: dict, probe_int4: tuple[int, float] | None
) -> list[dict]:
    """Held-out predictions: each slice run's end-to-end rate without that run (no overlap, or the overlap of the
    other transport's runs), and the slice's plain prefill from the 16-expert probes (expert count ignored)."""
    out = []
    for t, rs in runs.items():
        others = [o["_overlap"] for u, us in runs.items() if u != t for o in us]
        for r in rs:
            stage = r["_stage"]
            meas = r["perf"]["end_to_end_tokens_per_s"]
            pred = 1 / (gpu_s_per_token(stage["prefill"], stage["trainer"], 0.0) + stage["tax_s"])
            out.append(
                {
                    "what": f"slice co-located run end-to-end tok/s, {t}",
                    "file": r["_file"],
                    "predicted_from": "the slice's plain prefill (prefill_depth), the trainer alone (the trainer "
                    f"step bench, {stage['step']}'s step, at {stage['length']} tokens), the {t} capture tax "
                    "(online_pipeline); the stages' times added: the run's own end-to-end rate is the only source "
                    "of its overlap fraction",
                    "predicted": pred,
                    "measured": meas,
                    "relative_error": _rel(pred, meas),
                }
            )
            if others:
                h = sum(others) / len(others)
                pred = 1 / (gpu_s_per_token(stage["prefill"], stage["trainer"], h) + stage["tax_s"])
                out.append(
                    {
                        "what": f"slice co-located run end-to-end tok/s, {t}, overlap from the other transport",
                        "file": r["_file"],
                        "predicted_from": f"as above, with the overlap fraction {h:.3f} of the other transport's runs",
                        "predicted": pred,
                        "measured": meas,
                        "relative_error": _rel(pred, meas),
                    }
                )
    if probe_int4 and "per_moe_layer_s_per_token_16_experts" in fit:
        layers, ratio = probe_int4
        pred = 1 / (fit["fixed_s_per_token"] + (layers - 1) * fit["per_moe_layer_s_per_token_16_experts"] / ratio)
        out.append(
            {
                "what": f"slice plain prefill tok/s at {layers} layers (384 INT4 experts)",
                "predicted_from": "the 16-expert bf16 width probes' depth fit, its per-layer time divided by the "
                f"INT4/bf16 prefill ratio {ratio:.3f} (6 layers, 16 experts): expert count ignored",
                "predicted": pred,
                "measured": slice_prefill,
                "relative_error": _rel(pred, slice_prefill),
            }
        )
    return out


def torchspec_check(*, fit: dict, capture: dict, trainer_bench: dict) -> dict:
    """The model on TorchSpec's published layout: H200s, 16 inference GPUs as two TP=8 servers over Mooncake,
    16 trainer GPUs apart (no co-location, so no overlap): trained tok/s per GPU of all 32."""
    ts = TORCHSPEC
    tp = ts["inference_gpus"] // 2
    prefill = ASSUMPTIONS["tp_efficiency"][str(tp)] / fit["k25_s_per_token_one_h200"]
    server = 1 / (1 / (tp * prefill) + capture["mooncake"]["tax_s_per_token"])
    length, trainer = _trainer_rate(trainer_bench, 4096, SPECFORGE_STEP)
    e2e = min(2 * server, ts["trainer_gpus"] * trainer) / ts["gpus"]
    published = ts["tokens"] / (ts["gpu_hours"] * 3600)
    return {
        "what": "TorchSpec's published K2.5 run, tok/s per GPU",
        "predicted_from": "this model on 2 TP=8 H200 servers (Mooncake tax, TP=8 efficiency assumed) + 16 H200 "
        f"trainers alone at {length} tokens (SpecForge's own step), the slower side; TorchSpec's sample lengths, draft and TP are not "
        "published beside the number",
        "predicted": e2e,
        "measured": published,
        "relative_error": _rel(e2e, published),
    }


def capture_rates(pipeline: dict, length: int) -> dict:
    """Per transport: the capture tax per token, one reader's GB/s, the writer's GB/s, bytes per token."""
    capture = {}
    for t in TRANSPORTS:
        row = _shape_row(pipeline, length, t)
        sink = row.get("sink_per_request_mean") or {}
        capture[t] = {
            "capture_over_plain_at_slice": row["capture_over_plain"],
            "tax_s_per_token": 1 / row["capture_tokens_per_s"] - 1 / row["plain_tokens_per_s"],
            "read_gb_per_s": row["read_gb_per_s"],
            # the sink's own bytes / time per request; without it, bytes over the whole capture call (a lower bound)
            "writer_gb_per_s": sink["bytes"] / sink["total_ms"] / 1e6 if sink else row["capture_write_gb_per_s"],
            "feature_bytes_per_token": row["feature_bytes_per_token"],
        }
    return capture


def run_step(name: str, run: dict, recipe_step: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The trainer step a slice run ran: its run-report's ``trainer_step_env`` (the launch sheet's), else its file
    name's tag (module docstring; run-reports written before the field existed do not carry it). Named ``recipe``,
    ``specforge`` or ``other``."""
    step = run.get("trainer_step_env")
    if step is None:  # a run-report from before the field, so from before patch eagle3-fewer-host-syncs' switch too
        step = {**recipe_step, "SPECFORGE_EAGLE3_FEWER_SYNCS": "0"} if "step_recipe" in name else SPECFORGE_STEP
    step = _norm_step(step)
    return ("recipe" if step == _norm_step(recipe_step) else "specforge" if step == SPECFORGE_STEP else "other"), step


def slice_runs(
    paths: dict[str, list[Path]], *, slice_prefill: float, trainer_bench: dict, capture: dict, recipe_step: dict
) -> dict:
    """Per transport, the slice's co-located run-reports with their stage rates measured alone (``_stage``: the
    slice's prefill, the trainer bench at the run's sample size and step, the transport's tax) and overlap
    fraction."""
    runs: dict[str, list[dict]] = {}
    for t, ps in paths.items():
        for p in ps:
            run = _load(p)
            step_name, step = run_step(p.name, run, recipe_step)
            length, trainer_alone = _trainer_rate(trainer_bench, round(run["perf"]["tokens_per_step"]), step)
            stage = {"prefill": slice_prefill, "trainer": trainer_alone, "tax_s": capture[t]["tax_s_per_token"]}
            h = overlap_from_run(**stage, end_to_end=run["perf"]["end_to_end_tokens_per_s"])
            runs.setdefault(t, []).append(
                {**run, "_file": p.name, "_stage": {**stage, "length": length, "step": step_name}, "_overlap": h}
            )
    return runs


def _run_summary(t: str, r: dict) -> dict:
    perf, stage = r["perf"], r["_stage"]
    return {
        "file": r["_file"],
        "transport": t,
        "end_to_end_tokens_per_s": perf["end_to_end_tokens_per_s"],
        "trainer_only_tokens_per_s": perf["trainer_only_tokens_per_s"],
        "trainer_step": stage["step"],
        "trainer_alone_tokens_per_s": stage["trainer"],
        "slice_prefill_tokens_per_s": stage["prefill"],
        "overlap_hidden_fraction": r["_overlap"],
        # against the stage rates the run itself reported (its trainer shared the GPU)
        "end_to_end_over_slowest_stage": perf["end_to_end_tokens_per_s"]
        / min(stage["prefill"], perf["trainer_only_tokens_per_s"]),
        "peak_gpu_mib_per_role": (r.get("gpu_memory") or {}).get("peak_mib_per_role", {}),
    }


def overlap_per_transport(runs: dict[str, list[dict]]) -> dict[str, float]:
    """The mean hidden fraction of each transport's runs, whatever step their trainers ran (the fraction is taken
    as a property of sharing the GPU); a transport without a run borrows all runs' mean;
    clipped to [-1, 1] (co-location costing a whole shorter stage more than the sum .. all of it hidden)."""
    pooled = [r["_overlap"] for rs in runs.values() for r in rs]
    out = {}
    for t in TRANSPORTS:
        hs = [r["_overlap"] for r in runs.get(t, [])] or pooled
        out[t] = min(1.0, max(-1.0, sum(hs) / len(hs)))
    return out


def sensitivity(project_with, recipes: dict, overlap: dict, worst: float) -> list[dict]:
    """The 8xB200 rows under each ``SENSITIVITY`` change; ``project_with(recipes, overlap, assumptions)``;
    ``worst``: the lowest hidden fraction of any single run."""
    out = []
    for what, change, ov in SENSITIVITY:
        a = json.loads(json.dumps(ASSUMPTIONS))
        for key, value in change.items():
            a[key].update(value)
        b200 = {k: v for k, v in recipes.items() if "b200" in k}
        hs = {t: h if ov is None else worst if ov == "worst" else ov for t, h in overlap.items()}
        for name, r in project_with(b200, hs, a).items():
            e2e = {t: x["end_to_end_tokens_per_s_per_gpu"] for t, x in r["transports"].items()}
            out.append({"recipe": name, "what": what, **e2e})
    return out


def build(results: Path, length: int, argv: list[str]) -> dict:
    inputs = find_inputs(results)
    pipeline = _load(inputs["pipeline"])
    trainer_bench = _load(inputs["trainer"])
    if not inputs["runs"]:
        raise SystemExit(f"error: no online_run_k25_slice_<transport>*.json in {results}")
    fit, slice_layers, slice_prefill = prefill_fit(inputs, length)
    capture = capture_rates(pipeline, length)
    load_recipe = _recipes().load_recipe

    recipe_step = _recipe_step(load_recipe(REPO / "recipes" / SLICE_RECIPE))
    runs = slice_runs(
        inputs["runs"],
        slice_prefill=slice_prefill,
        trainer_bench=trainer_bench,
        capture=capture,
        recipe_step=recipe_step,
    )
    summaries = [_run_summary(t, r) for t, rs in runs.items() for r in rs]
    overlap = overlap_per_transport(runs)
    # the memory measured beside the plan: a run of the step the recipes ship, if there is one
    primary = next((s for s in summaries if s["trainer_step"] == "recipe"), summaries[0])
    recipes, plans, mem_overheads = _recipe_inputs(primary["peak_gpu_mib_per_role"], primary["transport"])
    probe_int4 = None
    if inputs["int4"].exists() and inputs["bf16"].exists():
        batch = _shape_row(_load(inputs["depth"][slice_layers]), length)["batch"]
        ratio = _jsonl_rate(inputs["int4"], batch, length) / _jsonl_rate(inputs["bf16"], batch, length)
        probe_int4 = (slice_layers, ratio)
    feature_bytes = capture["mooncake"]["feature_bytes_per_token"]

    def project_with(recipes_: dict, overlap_: dict, assumptions: dict | None = None) -> dict:
        return project(
            fit=fit,
            capture=capture,
            trainer_bench=trainer_bench,
            overlap=overlap_,
            plans=plans,
            recipes=recipes_,
            feature_bytes=feature_bytes,
            assumptions=assumptions,
        )

    probes = " + ".join(p.name for p in inputs["probes"].values())
    return {
        "command": ["python", "bench/sizing.py", *argv],
        "measured_on": "one H200 (K2.5-width slice 2026-12-03, width probes 2026-12-02)",
        "inputs": {
            "pipeline": inputs["pipeline"].name,
            "depth": " + ".join(p.name for p in inputs["depth"].values()),
            "width_probes": probes if "per_moe_layer_s_per_token_16_experts" in fit else "",
            "online_runs": " + ".join(s["file"] for s in summaries),
            "trainer": inputs["trainer"].name,
        },
        "assumptions": ASSUMPTIONS,
        "tokens_per_prompt": length,
        "feature_bytes_per_token": feature_bytes,
        "depth_fit": fit,
        "capture": capture,
        "slice_runs": summaries,
        "slice_run": primary,
        "overlap_hidden_fraction": overlap,
        "memory_from_slice": mem_overheads,
        "backtest": backtest(runs=runs, slice_prefill=slice_prefill, fit=fit, probe_int4=probe_int4),
        "cross_check": [torchspec_check(fit=fit, capture=capture, trainer_bench=trainer_bench)],
        "recipes": project_with(recipes, overlap),
        "sensitivity": sensitivity(
            project_with, recipes, overlap, max(-1.0, min(r["_overlap"] for rs in runs.values() for r in rs))
        ),
        "torchspec": {**TORCHSPEC, "tokens_per_s_per_gpu": TORCHSPEC["tokens"] / (TORCHSPEC["gpu_hours"] * 3600)},
    }


def table(res: dict) -> str:
    ts = res["torchspec"]["tokens_per_s_per_gpu"]
    head = [
        (n, t, p["end_to_end_tokens_per_s_per_gpu"], p["end_to_end_no_overlap_tokens_per_s_per_gpu"])
        for n, r in res["recipes"].items()
        if "b200" in n
        for t, p in r["transports"].items()
    ]
    lines = [
        "**8xB200, co-located, projected end-to-end trained tok/s per GPU: "
        + "; ".join(
            f"{t} {e:,.0f} ({e / ts:.1f}x TorchSpec's {ts:,.0f}; {f:,.0f} with the stages' times added)"
            for _, t, e, f in head
        )
        + ".** Pessimistic ends of the assumptions, one at a time (`sensitivity`): "
        + "; ".join(
            f"{s['what']} " + " / ".join(f"{s[t]:,.0f}" for _, t, _, _ in head)
            for s in res["sensitivity"]
            if s["what"] != "as projected"
        )
        + f" ({' / '.join(t for _, t, _, _ in head)}).",
        "",
        "| recipe | GPUs | TP | transport | node prefill tok/s | trainer tok/s per GPU | slowest | "
        "end-to-end tok/s per GPU (times added) | vs TorchSpec 1.1k | features GB/s per node (readers carry) | "
        "writer GB/s (carries) | GiB per GPU: server pool + trainer plan (sum with the server overhead outside its pool) of GPU | "
        "wall h per 1B tokens | GPU-h per 1B tokens |",
        "| " + " | ".join(["---"] * 14) + " |",
    ]
    for name, r in res["recipes"].items():
        for t, p in r["transports"].items():
            m = p["memory_per_gpu_gib"]
            plan = "" if m["plan_fits"] else ", plan over"
            over = "" if m["fits_with_server_overhead"] else " over"
            mark = " (recipe)" if t == r["recipe_transport"] else ""
            lines.append(
                f"| {name} | {r['gpus']} | {r['tp']} | {t}{mark} | {r['node_prefill_tokens_per_s']:,.0f} | "
                f"{r['trainer_tokens_per_s_per_gpu']:,.0f} | {r['slowest_stage']} | "
                f"**{p['end_to_end_tokens_per_s_per_gpu']:,.0f}** ({p['end_to_end_no_overlap_tokens_per_s_per_gpu']:,.0f}) | "
                f"{p['end_to_end_tokens_per_s_per_gpu'] / ts:.2f}x | "
                f"{p['feature_gb_per_s_per_node']:.2f} ({p['transport_readers_gb_per_s_per_node']:,.0f}) | "
                f"{p['writer_gb_per_s']:.2f} ({p['transport_writer_gb_per_s']:,.0f}) | "
                f"{m['server_pool']:.0f} + {m['trainer_plan']:.0f} ({m['server_peak_plus_trainer_plan']:.0f}{over}{plan}) "
                f"of {m['gpu']:.0f} | "
                f"{p['wall_hours_per_1b_tokens']:,.1f} | {p['gpu_hours_per_1b_tokens']:,.0f} |"
            )
    f = res["depth_fit"]
    lines += [
        "",
        f"TorchSpec's K2.5 run: {ts:,.0f} tok/s per GPU ({res['torchspec']['tokens'] / 1e9:.0f}B tokens, "
        f"{res['torchspec']['gpu_hours']:,} H200 GPU-hours, {res['torchspec']['gpus']} GPUs), "
        f"{1e9 / ts / 3600:,.0f} GPU-hours per 1B tokens.",
        "",
        f"Prefill ({f['method']}; {res['tokens_per_prompt']}-token prompts, one H200): "
        + ", ".join(
            f"{p['plain_tokens_per_s']:,.0f} tok/s at {p['layers']} layers"
            + (f" ({p['experts']} experts)" if "experts" in p else "")
            for p in f["points"]
        )
        + f" -> {f['fixed_s_per_token'] * 1e6:.2f} us per token fixed + {f['per_moe_layer_s_per_token'] * 1e6:.2f} us "
        "per 384-expert MoE layer"
        + (
            f" (16 experts: {f['per_moe_layer_s_per_token_16_experts'] * 1e6:.2f} us)"
            if "per_moe_layer_s_per_token_16_experts" in f
            else ""
        )
        + f"; {1 / f['k25_s_per_token_one_h200']:,.0f} tok/s for 61 layers on one H200 if it held them.",
        "",
        "Capture tax per token (capture minus plain prefill, the slice): "
        + ", ".join(
            f"{t} {c['tax_s_per_token'] * 1e6:.2f} us (capture / plain {c['capture_over_plain_at_slice']:.2f})"
            for t, c in res["capture"].items()
        )
        + ". Co-located runs of the slice: "
        + "; ".join(
            f"`{s['file']}` ({s['trainer_step']}'s step) {s['end_to_end_tokens_per_s']:,.0f} tok/s end to end (prefill alone "
            f"{s['slice_prefill_tokens_per_s']:,.0f}, trainer alone {s['trainer_alone_tokens_per_s']:,.0f}, "
            f"trainer in the run {s['trainer_only_tokens_per_s']:,.0f}): {s['overlap_hidden_fraction']:+.2f} of the "
            "shorter stage hidden"
            for s in res["slice_runs"]
        )
        + ". A negative fraction: the co-located run took longer than the two stages' times added.",
        "",
        "Backtest (held-out predictions, `backtest` in the JSON; the last row is `cross_check`, a published "
        "number with some of its inputs unknown):",
        "",
        "| predicted | from | predicted | measured | error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for b in res["backtest"] + res["cross_check"]:
        lines.append(
            f"| {b['what']} | {b['predicted_from']} | {b['predicted']:,.0f} | {b['measured']:,.0f} | "
            f"{b['relative_error']:+.1%} |"
        )
    return "\n".join(lines)


def write_doc(doc: Path, res: dict) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {doc} has no sizing markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + BEGIN + "\n" + table(res) + "\n" + END + tail)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(RESULTS), help="folder of the committed measurements (names: docstring)")
    p.add_argument("--tokens-per-prompt", type=int, default=4096, help="prompt length whose rows feed the model")
    p.add_argument("--out", default=str(RESULTS / "sizing_k25.json"))
    p.add_argument("--doc", default=str(DOC), help="markdown file whose table between the markers is rewritten")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    res = build(Path(args.results), args.tokens_per_prompt, argv)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    write_doc(Path(args.doc), res)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
