"""Sizing model: a full 61-layer Kimi-K2.5 online run projected from the committed real-width measurements.

Reads only files under ``bench/results`` (``--results``), found by name:

- ``online_pipeline_k25_slice_h200.json``: the 5-layer K2.5-width slice (384 INT4 experts per MoE layer, TP=1):
  capture and plain prefill per transport, the sink's write time, one reader's GB/s;
- ``prefill_depth_k25_slice<L>_h200.json``: plain prefill of the slice at ``L`` layers. Two depths give the
  fixed and per-MoE-layer time directly; with one depth, the fixed part (embedding, head, dense layer 0: no
  experts) comes from the width probes ``capture_overhead_width7168_l<L>_e16_bf16_tp1_h200.json`` (hidden 7168,
  16 bf16 experts, two depths) and the per-MoE-layer time from the 384-expert slice, so the expert count the real
  run pays stays in the MoE term;
- ``online_run_k25_slice_<transport>[_<tag>].json`` (transport ``cuda_ipc`` or ``mooncake``), or
  ``online_run_k25_slice_<tag>.json`` whose run-report names its ``transport`` (``*_eval_draft`` excluded, and any
  report with fewer than ``MIN_RUN_STEPS`` timed steps, and a block draft's run: its report's ``draft.strategy`` is not
  ``eagle3``): run-reports of the slice recipe's co-located runs, every one
  used, per transport. The trainer step a run ran is its report's ``trainer_step_env`` (from the launch sheet); for
  a report without it, a tag holding ``step_recipe`` marks the slice recipe's step of then (``LEGACY_RECIPE_STEP``:
  the allocator's cache kept, fused AdamW, no later switch or seam) and any other run ran SpecForge's own (all
  runs before 2026-12-04; ``step_specforge`` says so explicitly). The memory carried to the recipes is a run of the
  recipe's step, one whose report names its step first;
- ``trainer_step_seams_k25_b200_h200.json`` (optional, preferred: the step's seams stacked, both attention
  backends), ``trainer_step_k25_b200_h200.json`` (optional) and ``trainer_step_lifts_k25_b200_h200.json``
  (``TRAINER_FILES``): one trainer rank alone on the GPU at the recipes' draft, 4k and 16k tokens, the batch already
  on the GPU (``--feed cuda``: both transports hand the step device tensors), one row per step variant
  (``step_env``); a (length, step) row is read from the first file that has it. A recipe's trainer rate is the row
  of its own step; a run's trainer-alone rate, the row of the step that run used. A block-draft recipe (DFlash): its
  rate is its EAGLE-3 twin's x the ratio of training FLOPs per token (``training.step_flops.train_flops_per_token``)
  x ``block_step_vs_flops``;
- ``trainer_memory_k25_slice_dflash_h200.json`` (optional, ``BLOCK_STEP_FILE``): the slice's DFlash twin's step
  alone (bench/trainer_memory.py); with it ``block_step_vs_flops`` is measured (that step against the slice's
  EAGLE-3 step from the trainer bench at the same length x their FLOPs ratio), without it assumed;
- ``prefill_width7168_l6_e16_{bf16,int4}_h200.jsonl``: INT4 vs bf16 experts (the expert-count backtest).

and projects each shipped K2.5 recipe (8xB200 lowered, 8xB300, 2x8 B300; the 8xB200 DFlash twin) per transport that applies to it
(cuda_ipc: one node; Mooncake: all): node prefill tok/s, trainer tok/s per GPU, co-located end-to-end trained tok/s
per GPU, feature GB/s per node against what the transport carried, memory per GPU, wall time and GPU-hours per
1B trained tokens, beside TorchSpec's published K2.5 run (its two figures, the blog's and the model card's, beside
this model's prediction on TorchSpec's own 16 + 16 H200 layout). Every number not measured here is in ``ASSUMPTIONS``
with its source and its pessimistic and optimistic end, and written into the output; ``sensitivity`` projects the
8xB200 recipes (EAGLE-3 and its block-draft twin) and TorchSpec's layout at each end, one assumption at a time. ``backtest`` predicts measured configurations the model was not fed
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
#: EAGLE-3 recipes, then the block-draft (DFlash) twin of the 8xB200 one: its trainer term is scaled from its EAGLE-3
#: twin's measured step (the name without ``-dflash``) by FLOPs x ``block_step_vs_flops``
RECIPES = (
    "kimi-k25-8xb200-lowered.yaml",
    "kimi-k25-8xb300.yaml",
    "kimi-k25-2x8xb300.yaml",
    "kimi-k25-8xb200-lowered-dflash.yaml",
)
SLICE_RECIPE = "kimi-k25-slice-h200.yaml"
TRANSPORTS = ("cuda_ipc", "mooncake")
RUN_NAME = re.compile(r"^online_run_k25_slice_(?:(cuda_ipc|mooncake)(?:_[A-Za-z0-9_.-]+)?|[A-Za-z0-9_.-]+)\.json$")
#: a run-report with fewer timed steps than this (after its warm-up) measured start-up, not a rate: left out
MIN_RUN_STEPS = 5
#: trainer step benches, the preferred first: a row (length, step) is read from the first file that has it
TRAINER_FILES = (
    "trainer_step_seams_k25_b200_h200.json",
    "trainer_step_k25_b200_h200.json",
    "trainer_step_lifts_k25_b200_h200.json",
)
#: the block draft's step measured alone at K2.5's width (the slice's DFlash twin, bench/trainer_memory.py): with it
#: ``block_step_vs_flops`` is measured, not assumed (:func:`block_step_calibration`)
BLOCK_STEP_FILE = "trainer_memory_k25_slice_dflash_h200.json"
SLICE_BLOCK_RECIPE = "kimi-k25-slice-h200-dflash.yaml"
DEPTH_NAME = re.compile(r"^prefill_depth_k25_slice(\d+)_h200\.json$")
PROBE_NAME = re.compile(r"^capture_overhead_width7168_l(\d+)_e16_bf16_tp1_h200\.json$")
#: TorchSpec's K2.5 EAGLE-3 run, two published figures (FACTS.md "Performance anchors" and "After the pin"): the
#: blog's 6B tokens in 1,500 H200 GPU-hours, and the model card's 2 phases x ~14 h x 32 GPUs; both on 16 inference
#: + 16 training H200s. The card gives no token count (``torchspec_card``).
TORCHSPEC = {
    "tokens": 6e9,
    "gpu_hours": 1500,
    "gpus": 32,
    "inference_gpus": 16,
    "trainer_gpus": 16,
    "card": {"phases": 2, "hours_per_phase": 14, "gpus": 32},
}

#: Not measured here (one H200 is lent); each number with its source and the two ends its sensitivity rows set it
#: to (``ends``: one assumption at a time, the pessimistic and the optimistic end), written into the output.
ASSUMPTIONS = {
    "prefill_speed_vs_h200": {
        "H200": 1.0,
        "B200": 1.5,
        "B300": 1.5,
        "why": "vendor spec sheets: HBM 4.8 TB/s (H200) vs 8 TB/s (B200, B300), 132 vs 148 SMs; bf16 dense "
        "0.99 vs 2.25 PFLOPS. The INT4 experts run SGLang's moe_wna16_marlin, whose MMA is the Ampere-class "
        "mma.sync path rather than Blackwell's tcgen05, so the 2.25x peak is not assumed for the MoE; 1.5 sits "
        "between the SM-count ratio (1.12) and the HBM ratio (1.67). Ends: no faster than an H200; the HBM ratio",
        "ends": {"pessimistic": {"B200": 1.0, "B300": 1.0}, "optimistic": {"B200": 1.67, "B300": 1.67}},
    },
    "trainer_speed_vs_h200": {
        "H200": 1.0,
        "B200": 2.0,
        "B300": 2.0,
        "why": "bf16 dense tensor throughput, vendor spec sheets: H200 0.99, B200 and B300 2.25 PFLOPS (B300 adds "
        "FP4, not bf16); the draft's step is cuBLAS bf16 GEMMs and flex attention, discounted to 2.0. Ends: the "
        "prefill's 1.5 (a step partly bound by memory and launches); the bf16 peak ratio 2.25",
        "ends": {"pessimistic": {"B200": 1.5, "B300": 1.5}, "optimistic": {"B200": 2.25, "B300": 2.25}},
    },
    "tp_efficiency": {
        "1": 1.0,
        "8": 0.7,
        "16": 0.5,
        "why": "not measured at K2.5 width (one GPU lent): per-GPU prefill at TP=N = N x efficiency x one GPU's "
        "rate; TP=8 pays two NVLink all-reduces per layer and 8x smaller GEMMs per GPU (0.7 assumed); TP=16 spans "
        "two nodes' network (0.5 assumed). Also TorchSpec's layout (two TP=8 servers). Ends: 0.5 / 0.35; 0.9 / 0.7",
        "ends": {"pessimistic": {"8": 0.5, "16": 0.35}, "optimistic": {"8": 0.9, "16": 0.7}},
    },
    "overlap_carries": {
        "value": True,
        "why": "co-location hides part of the shorter stage's GPU time behind the longer one, or, when negative, "
        "costs more than the two stages' times added (measured on the slice's runs at TP=1, one GPU); the same "
        "fraction is assumed at TP=8/16 and on B200/B300. The rate with the times added (fraction 0) is in the "
        "output beside it. Ends: the lowest single run's fraction for both transports; the highest's",
        "ends": {"pessimistic": {"value": "worst"}, "optimistic": {"value": "best"}},
    },
    "capture_tax_serial": {
        "value": True,
        "why": "the capture writer is one per server (TP rank 0's sink); its extra time per token, measured as "
        "capture minus plain prefill on the slice, is added to the server's time per token, not divided by TP. "
        "Ends: this is the pessimistic reading already; divided by TP (every rank writing its share)",
        "ends": {"pessimistic": {"value": True}, "optimistic": {"value": False}},
    },
    "readers_scale": {
        "value": True,
        "why": "every trainer rank reads its own samples: a node's readers carry the measured one-reader rate x "
        "its ranks (Mooncake over loopback is per-client memcpy bound); RDMA between nodes is not measured. The "
        "projection is capped at what the readers and the writer carry. Ends: one reader's rate per node; as is",
        "ends": {"pessimistic": {"value": False}, "optimistic": {"value": True}},
    },
    "width_probe_fixed_part": {
        "value": "with one slice depth",
        "prefill_scale": 1.0,
        "why": "the probes' fixed part (embedding, head, dense layer 0) stands for the slice's; the probes were "
        "`specforge-kimi tiny` targets whose dense MLP width is not recorded (tiny's default is 1024, the slice's "
        "18432: about 0.8 GFLOP more per token, ~1 us on an H200); if so, the slice's wider dense MLP lands in its "
        "per-MoE-layer time (~0.3 us of ~4 us per layer): conservative, up to ~8% on the 61-layer prefill. Used "
        "only when one slice depth is committed (two depths: both ends leave the projection as is). Ends: as is; "
        "prefill 1/0.92",
        "ends": {"pessimistic": {"prefill_scale": 1.0}, "optimistic": {"prefill_scale": 1 / 0.92}},
    },
    "prompt_length": {
        "value": 4096,
        "prefill_scale_16k": 1.0,
        "why": "prefill per token is measured at 4096-token prompts and used for every recipe; the B300 recipes "
        "train 16,384-token samples, whose attention costs more per token (optimistic for them); the trainer rate "
        "is read at each recipe's max_length. Ends: 16k-token recipes' prefill 0.8x per token; as is (the 8xB200 "
        "recipes train 4096-token samples: unchanged by either end)",
        "ends": {"pessimistic": {"prefill_scale_16k": 0.8}, "optimistic": {"prefill_scale_16k": 1.0}},
    },
    "block_step_vs_flops": {
        "value": 1.0,
        "why": "ESTIMATE, used when no block step was measured (BLOCK_STEP_FILE absent): the block draft's (DFlash) "
        "trainer step time per token "
        "is its EAGLE-3 twin's measured step x the ratio of training FLOPs per token (`block_trainer` in the "
        "output: draft layers x per-layer GEMM and attention FLOPs over anchors x block queries, the fc over the "
        "5 captured layers, the frozen head's forward and input gradient; EAGLE-3: TTT steps x its one layer and "
        "draft head, its 3-layer fc, the target head's forward) x this factor. The optimizer update (2.2x the "
        "parameters, a few ms per step) and launch overheads are not in the FLOPs. Ends: 2x; 0.5x the estimated step",
        "ends": {"pessimistic": {"value": 2.0}, "optimistic": {"value": 0.5}},
    },
    "block_capture_tax_vs_eagle3": {
        "value": "feature bytes ratio",
        "why": "ESTIMATE: the block draft's capture tax per token is EAGLE-3's measured one x its feature bytes "
        "ratio (5 captured layers + 2 int64 vs 3 + the last hidden + EAGLE-3's passthrough: 1.25x); its "
        "features GB/s on the transport and its pool scale the same way (the plan's bytes). Ends: 2x; 1x",
        "ends": {"pessimistic": {"value": 2.0}, "optimistic": {"value": 1.0}},
    },
    "torchspec_card": {
        "tokens": 6e9,
        "hours_per_phase": 14,
        "why": "the model card states 2 phases x ~14 h x 32 H200 GPUs and no token count: the blog's 6B tokens are "
        "assumed for it (tok/s per GPU = 6e9 / GPU-seconds). It moves the compared figure, not the projection. "
        "Ends: ~14 h read as 13 h (a higher TorchSpec figure); 15 h",
        "ends": {"pessimistic": {"hours_per_phase": 13}, "optimistic": {"hours_per_phase": 15}},
    },
}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} not found (run the measurement first; docs/sizing.md says which)") from None
    except ValueError as exc:
        raise SystemExit(f"error: {path} is not JSON ({exc})") from None


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


def colocated(*, prefill: float, trainer: float, overlap: float, tax_s: float, gpus: int) -> float:
    """Trained tok/s of one capture server spread over ``gpus`` co-located GPUs (TP = gpus): the GPUs share the
    server's tokens, the server's one capture writer adds ``tax_s`` per token."""
    return 1 / (_overlap().gpu_s_per_token(prefill, trainer, overlap) / gpus + tax_s)


#: SpecForge 0.2.0's own step, as ``training.step_knobs.step_env`` spells it (what every run before the knobs ran)
SPECFORGE_STEP = {
    "SPECFORGE_EAGLE3_EMPTY_CACHE": "1",
    "SPECFORGE_ADAMW_FUSED": "0",
    "SPECFORGE_EAGLE3_FEWER_SYNCS": "0",
    "SPECFORGE_EAGLE3_CHUNKED_LOSS": "0",
}


#: the slice recipe's step when run-reports did not yet name theirs (a ``step_recipe`` tag): the allocator's cache
#: kept and fused AdamW, every later switch and seam off
LEGACY_RECIPE_STEP = {"SPECFORGE_EAGLE3_EMPTY_CACHE": "0", "SPECFORGE_ADAMW_FUSED": "1"}


def _norm_step(env: dict) -> dict[str, str]:
    """A step's variables without the unset ones and without the SpecForge switches at SpecForge's own value
    (``SPECFORGE_STEP``'s, else "0"): a record written before a switch existed (patch eagle3-fewer-host-syncs',
    eagle3-chunked-head-loss', the compile-elementwise seam's) ran without it, as one that spells it off."""
    return {
        k: v
        for k, v in env.items()
        if v is not None and not (k.startswith("SPECFORGE_") and v == SPECFORGE_STEP.get(k, "0"))
    }


def _recipe_step(r) -> dict[str, str]:
    """The trainer step a recipe ships, as the trainer bench's ``step_env`` records it."""
    from specforge_kimi.training.step_knobs import trainer_env

    return trainer_env(r.trainer)


def _same_step(row_env: dict, step: dict[str, str]) -> bool:
    return _norm_step(row_env) == _norm_step(step)


def _trainer_rate(
    trainer_bench: dict, length: int, step: dict[str, str], backend: str = "flex_attention"
) -> tuple[int, float]:
    """The ``backend`` row (the recipe's ``trainer.attention_backend``) nearest ``length`` of the step ``step`` (its
    ``step_env``), its batch on the GPU (``feed: cuda``), from the first bench file that has that length (rows carry
    ``_pref``: the file's place in ``TRAINER_FILES``); a bench without such a row is one line naming the step."""
    rows = [
        r
        for r in trainer_bench["rows"]
        if r["backend"] == backend
        and "tokens_per_s" in r
        and r.get("feed") == "cuda"
        and _same_step(r.get("step_env", {}), step)
    ]
    if not rows:
        raise SystemExit(f"error: the trainer bench has no {backend} row fed from the GPU of the step {step}")
    row = min(rows, key=lambda r: (abs(r["length"] - length), r["length"], r.get("_pref", 0)))
    return row["length"], row["tokens_per_s"]


def _recipe_rates(r: dict, a: dict, fit: dict, trainer_bench: dict) -> dict:
    """One recipe's prefill and trainer tok/s per GPU under the assumptions ``a``; a block draft's trainer from its
    EAGLE-3 twin's measured step x its FLOPs ratio x ``block_step_vs_flops``."""
    tp = r["per_node"] * r["nnodes"]
    prefill = a["tp_efficiency"][str(tp)] * a["prefill_speed_vs_h200"][r["kind"]] / fit["k25_s_per_token_one_h200"]
    if "per_moe_layer_s_per_token_16_experts" in fit:  # the fixed part from the width probes
        prefill *= a["width_probe_fixed_part"]["prefill_scale"]
    if r["max_length"] > a["prompt_length"]["value"]:
        prefill *= a["prompt_length"]["prefill_scale_16k"]
    length, trainer_h200 = _trainer_rate(trainer_bench, r["max_length"], r["step"], r["backend"])
    trainer = a["trainer_speed_vs_h200"][r["kind"]] * trainer_h200
    tax_scale = 1.0
    if r.get("flops_ratio"):
        trainer /= r["flops_ratio"] * a["block_step_vs_flops"]["value"]
        v = a["block_capture_tax_vs_eagle3"]["value"]
        tax_scale = v if isinstance(v, (int, float)) else r["feature_scale"]
    return {"tp": tp, "prefill": prefill, "trainer": trainer, "length": length, "tax_scale": tax_scale}


def _transport_row(r: dict, rates: dict, c: dict, h: float, a: dict, feature_bytes: float) -> dict:
    """One recipe x transport: the co-located rate, capped at what the readers and the writer carry."""
    tp, nnodes = rates["tp"], r["nnodes"]
    tax = c["tax_s_per_token"] * rates["tax_scale"] / (1 if a["capture_tax_serial"]["value"] else tp)
    stages = {"prefill": rates["prefill"], "trainer": rates["trainer"], "tax_s": tax, "gpus": tp}
    server = colocated(**stages, overlap=h)
    added = colocated(**stages, overlap=0.0)
    readers = c["read_gb_per_s"] * (r["per_node"] if a["readers_scale"]["value"] else 1)
    carried = min(readers * nnodes, c["writer_gb_per_s"]) * 1e9 / feature_bytes
    bound = server > carried
    server, added = min(server, carried), min(added, carried)
    node_gb_s = server / nnodes * feature_bytes / 1e9
    wall_h = 1e9 / server / 3600
    return {
        "end_to_end_tokens_per_s_per_gpu": server / tp,
        "end_to_end_no_overlap_tokens_per_s_per_gpu": added / tp,
        "overlap_hidden_fraction": h,
        "capture_tax_s_per_token": tax,
        "server_tokens_per_s": server,
        "feature_bytes_per_token": feature_bytes,
        "feature_gb_per_s_per_node": node_gb_s,
        "transport_readers_gb_per_s_per_node": readers,
        "writer_gb_per_s": server * feature_bytes / 1e9,
        "transport_writer_gb_per_s": c["writer_gb_per_s"],
        "transport_bound": bound,
        "wall_hours_per_1b_tokens": wall_h,
        "gpu_hours_per_1b_tokens": wall_h * tp,
    }


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
    ``feature_bytes``: the measured EAGLE-3 bytes per token (a block draft's x its ``feature_scale``);
    ``assumptions``: ``ASSUMPTIONS`` unless given (the sensitivity rows)."""
    a = assumptions or ASSUMPTIONS
    out = {}
    for name, r in recipes.items():
        rates = _recipe_rates(r, a, fit, trainer_bench)
        fb = feature_bytes * r.get("feature_scale", 1.0)
        per_transport = {
            t: {**_transport_row(r, rates, capture[t], overlap[t], a, fb), "memory_per_gpu_gib": plans[name][t]}
            for t in r["transports"]
        }
        out[name] = {
            "gpus": f"{r['nnodes']}x{r['per_node']} {r['kind']}",
            "tp": rates["tp"],
            "family": r.get("family", "eagle3"),
            "trainer_estimated": bool(r.get("flops_ratio")),
            "recipe_transport": r["transport"],
            "prefill_tokens_per_s_per_gpu": rates["prefill"],
            "node_prefill_tokens_per_s": rates["prefill"] * r["per_node"],
            "trainer_tokens_per_s_per_gpu": rates["trainer"],
            "trainer_bench_length": rates["length"],
            "slowest_stage": "prefill" if rates["prefill"] < rates["trainer"] else "trainer",
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


def _src_on_path() -> None:
    """This checkout's ``src/`` on ``sys.path``, once (the script runs from a checkout without an install)."""
    src = str(REPO / "src")
    if src not in sys.path:
        sys.path.insert(0, src)


def _overlap():
    """``specforge_kimi.plan.overlap``: the co-located overlap model (one GPU's time per token, the hidden fraction
    a measured run implies)."""
    _src_on_path()
    from specforge_kimi.plan import overlap

    return overlap


def _recipes():
    """``specforge_kimi.plan.run_plan`` (``load_recipe``: a recipe as its compiled plan resolves it) and
    ``plan.memory.memory_plan`` (the split with a transport the recipe may not name)."""
    import types

    _src_on_path()
    from specforge_kimi.plan import memory, run_plan

    return types.SimpleNamespace(load_recipe=run_plan.load_recipe, memory_plan=memory.memory_plan)


def _with_transport(r, transport: str):
    return r.model_copy(update={"server": r.server.model_copy(update={"transport": transport})})


def _recipe_inputs(slice_peaks: dict, slice_transport: str) -> tuple[dict, dict, dict]:
    """Recipes' shapes and transports, and memory per GPU per transport: ``plan.memory.memory_plan`` and the plan
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
    loaded = {f: load_recipe(REPO / "recipes" / f) for f in RECIPES}
    for f, r in loaded.items():
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
            "backend": r.trainer.attention_backend,
            "transports": transports,
            "transport": r.server.transport if explicit else "not set (single node: cuda_ipc-capable)",
            "family": r.trainer.family,
        }
        if r.trainer.family != "eagle3":
            recipes[r.name].update(_block_terms(r, loaded.get(f.replace("-dflash", ""))))
        plans[r.name] = {t: _memory(_with_transport(r, t), overheads) for t in transports}
    return recipes, plans, overheads


def block_step_calibration(path: Path, trainer_bench: dict, twin) -> dict | None:
    """``block_step_vs_flops`` measured: the slice's DFlash twin's step alone (``path``: bench/trainer_memory.py's
    row of the recipe's step, flex_attention, nearest the recipe's length) against its EAGLE-3 twin's step alone (the
    trainer bench at that length, the recipe's step; ``twin``: the loaded ``SLICE_RECIPE``) x their ratio of training
    FLOPs per token; None without the file."""
    if not path.exists():
        return None
    block = _recipes().load_recipe(REPO / "recipes" / SLICE_BLOCK_RECIPE)
    rows = [
        r
        for r in _load(path).get("rows", [])
        if r.get("variant") == "recipe"
        and r.get("backend") == "flex_attention"
        and r.get("tokens_per_s")
        and isinstance(r.get("length"), int)
    ]
    if not rows:
        raise SystemExit(f"error: {path.name} has no flex_attention row of the recipe's step")
    row = min(rows, key=lambda r: (abs(r["length"] - block.trainer.max_length), r["length"]))
    twin_length, twin_rate = _trainer_rate(trainer_bench, row["length"], _recipe_step(twin))
    if twin_length != row["length"]:
        raise SystemExit(
            f"error: {path.name}'s block step is at {row['length']} tokens and the trainer bench has the EAGLE-3 "
            f"step at {twin_length}, not the same length"
        )
    flops_ratio = _block_terms(block, twin)["flops_ratio"]
    return {
        "value": twin_rate / (flops_ratio * row["tokens_per_s"]),
        "file": path.name,
        "recipe": SLICE_BLOCK_RECIPE,
        "length": row["length"],
        "block_tokens_per_s": row["tokens_per_s"],
        "twin_recipe": SLICE_RECIPE,
        "twin_length": twin_length,
        "twin_tokens_per_s": twin_rate,
        "flops_ratio": flops_ratio,
    }


def calibrated(assumptions: dict, block: dict | None) -> dict:
    """``assumptions`` with ``block_step_vs_flops`` taken from :func:`block_step_calibration` (unchanged without
    one): the measured factor, its ends 1.5x and 1/1.5 of it."""
    if block is None:
        return assumptions
    a = json.loads(json.dumps(assumptions))
    v = block["value"]
    a["block_step_vs_flops"] = {
        "value": v,
        "why": f"MEASURED at K2.5's width on one H200 ({block['file']}): the slice's DFlash twin's step alone, "
        f"{block['block_tokens_per_s']:,.0f} tok/s at {block['length']} tokens, against its EAGLE-3 twin's "
        f"{block['twin_tokens_per_s']:,.0f} (the trainer bench, the recipe's step) x their ratio of training FLOPs "
        f"per token {block['flops_ratio']:.3f}: the block step costs {v:.2f}x what its FLOPs predict from EAGLE-3's. "
        "The 8xB200 twin (5 draft layers) takes the 2-layer slice draft's factor. Ends: 1.5x and 1/1.5 of it (a "
        "deeper draft's larger share of layer GEMMs may run nearer EAGLE-3's efficiency, or its attention further)",
        "ends": {"pessimistic": {"value": 1.5 * v}, "optimistic": {"value": v / 1.5}},
        "measured": block,
    }
    return a


def _block_terms(r, twin) -> dict:
    """A block draft's estimated trainer inputs from its EAGLE-3 twin (the same recipe name without ``-dflash``):
    the twin's step (its measured rate is scaled), the FLOPs ratio, the feature bytes ratio of their plans."""
    if twin is None or twin.trainer.family != "eagle3":
        raise SystemExit(f"error: {r.name} has no EAGLE-3 twin in RECIPES to scale its trainer step from")
    from specforge_kimi.plan.transport_plan import feature_bytes_per_token
    from specforge_kimi.training.step_flops import train_flops_per_token

    mine, theirs = train_flops_per_token(r), train_flops_per_token(twin)
    return {
        "twin": twin.name,
        "step": _recipe_step(twin),
        "backend": twin.trainer.attention_backend,
        "flops_ratio": mine["total"] / theirs["total"],
        "feature_scale": feature_bytes_per_token(r) / feature_bytes_per_token(twin),
        "block_trainer": {
            "flops_per_token": mine,
            "twin_flops_per_token": theirs,
            "feature_bytes_per_token_plan": feature_bytes_per_token(r),
            "twin_feature_bytes_per_token_plan": feature_bytes_per_token(twin),
        },
    }


def find_inputs(results: Path) -> dict:
    """The committed measurement files, by the naming rules of the module docstring."""
    names = sorted(p.name for p in results.iterdir())
    return {
        "pipeline": results / "online_pipeline_k25_slice_h200.json",
        "depth": {int(m.group(1)): results / n for n in names if (m := DEPTH_NAME.match(n))},
        "probes": {int(m.group(1)): results / n for n in names if (m := PROBE_NAME.match(n))},
        "runs": [results / n for n in names if RUN_NAME.match(n) and not n.endswith("_eval_draft.json")],
        "trainer": [results / n for n in TRAINER_FILES],
        "int4": results / "prefill_width7168_l6_e16_int4_h200.jsonl",
        "bf16": results / "prefill_width7168_l6_e16_bf16_h200.jsonl",
    }


def trainer_benches(paths: list[Path]) -> tuple[dict, list[str]]:
    """The trainer step benches present, merged (each row tagged ``_pref``, its file's place, and ``_file``); the
    last of ``TRAINER_FILES`` (the one with every length and step) must be there."""
    rows, used = [], []
    for i, p in enumerate(paths):
        if not p.exists() and i < len(paths) - 1:
            continue
        rows += [{**r, "_pref": i, "_file": p.name} for r in _load(p)["rows"]]
        used.append(p.name)
    return {"rows": rows}, used


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
            pred = 1 / (_overlap().gpu_s_per_token(stage["prefill"], stage["trainer"], 0.0) + stage["tax_s"])
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
                pred = 1 / (_overlap().gpu_s_per_token(stage["prefill"], stage["trainer"], h) + stage["tax_s"])
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


def torchspec_predict(*, fit: dict, capture: dict, trainer_bench: dict, assumptions: dict | None = None) -> dict:
    """The model on TorchSpec's published layout: H200s, 16 inference GPUs as two TP=8 servers over Mooncake,
    16 trainer GPUs apart (no co-location, so no overlap): trained tok/s per GPU of all 32."""
    a, ts = assumptions or ASSUMPTIONS, TORCHSPEC
    tp = ts["inference_gpus"] // 2
    prefill = a["tp_efficiency"][str(tp)] * a["prefill_speed_vs_h200"]["H200"] / fit["k25_s_per_token_one_h200"]
    if "per_moe_layer_s_per_token_16_experts" in fit:
        prefill *= a["width_probe_fixed_part"]["prefill_scale"]
    tax = capture["mooncake"]["tax_s_per_token"] / (1 if a["capture_tax_serial"]["value"] else tp)
    server = 1 / (1 / (tp * prefill) + tax)
    length, trainer = _trainer_rate(trainer_bench, 4096, SPECFORGE_STEP)
    servers, trainers = 2 * server, ts["trainer_gpus"] * trainer * a["trainer_speed_vs_h200"]["H200"]
    return {
        "tokens_per_s_per_gpu": min(servers, trainers) / ts["gpus"],
        "servers_tokens_per_s": servers,
        "trainers_tokens_per_s": trainers,
        "trainer_length": length,
    }


def torchspec_figures(assumptions: dict | None = None) -> dict:
    """TorchSpec's two published figures as tok/s per GPU: the blog's (6B tokens / 1,500 GPU-hours) and the model
    card's (2 phases x ~14 h x 32 GPUs, with ``torchspec_card``'s assumed token count)."""
    a, ts = assumptions or ASSUMPTIONS, TORCHSPEC
    card = ts["card"]
    card_hours = card["phases"] * a["torchspec_card"]["hours_per_phase"] * card["gpus"]
    return {
        "blog": {
            "gpu_hours": ts["gpu_hours"],
            "tokens": ts["tokens"],
            "tokens_per_s_per_gpu": ts["tokens"] / (ts["gpu_hours"] * 3600),
        },
        "model_card": {
            "gpu_hours": card_hours,
            "tokens": a["torchspec_card"]["tokens"],
            "tokens_assumed": True,
            "tokens_per_s_per_gpu": a["torchspec_card"]["tokens"] / (card_hours * 3600),
        },
    }


def torchspec_check(*, fit: dict, capture: dict, trainer_bench: dict) -> list[dict]:
    """The model's prediction on TorchSpec's layout beside each published figure (``cross_check``)."""
    pred = torchspec_predict(fit=fit, capture=capture, trainer_bench=trainer_bench)
    e2e = pred["tokens_per_s_per_gpu"]
    src = (
        "this model on 2 TP=8 H200 servers (Mooncake tax, TP=8 efficiency assumed) + 16 H200 trainers alone at "
        f"{pred['trainer_length']} tokens (SpecForge's own step), the slower side; TorchSpec's sample lengths, "
        "draft and TP are not published beside the number"
    )
    figs = torchspec_figures()
    return [
        {
            "what": "TorchSpec's published K2.5 run, tok/s per GPU (blog: 6B tokens, 1,500 H200 GPU-hours)",
            "predicted_from": src,
            "predicted": e2e,
            "measured": figs["blog"]["tokens_per_s_per_gpu"],
            "relative_error": _rel(e2e, figs["blog"]["tokens_per_s_per_gpu"]),
        },
        {
            "what": "TorchSpec's published K2.5 run, tok/s per GPU (model card: 2 phases x ~14 h x 32 H200 GPUs "
            f"= {figs['model_card']['gpu_hours']:,} GPU-hours; 6B tokens assumed)",
            "predicted_from": src,
            "predicted": e2e,
            "measured": figs["model_card"]["tokens_per_s_per_gpu"],
            "relative_error": _rel(e2e, figs["model_card"]["tokens_per_s_per_gpu"]),
        },
    ]


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
    if step is None:  # a run-report from before the field, so from before every switch after fused AdamW's too
        step = LEGACY_RECIPE_STEP if "step_recipe" in name else SPECFORGE_STEP
    step = _norm_step(step)
    name = (
        "recipe" if step == _norm_step(recipe_step) else "specforge" if step == _norm_step(SPECFORGE_STEP) else "other"
    )
    return name, step


def _run_transport(name: str, run: dict) -> str:
    """A run's transport: its file name's (``online_run_k25_slice_<transport>...``), else its report's."""
    m = RUN_NAME.match(name)
    t = (m.group(1) if m else None) or run.get("transport")
    if t not in TRANSPORTS:
        raise SystemExit(f"error: {name} names no transport (cuda_ipc or mooncake), in its name or its report")
    return t


def slice_runs(
    paths: list[Path], *, slice_prefill: float, trainer_bench: dict, capture: dict, recipe_step: dict
) -> dict:
    """Per transport, the slice's co-located run-reports with their stage rates measured alone (``_stage``: the
    slice's prefill, the trainer bench at the run's sample size and step, the transport's tax) and overlap
    fraction; a report with fewer than ``MIN_RUN_STEPS`` timed steps, or of a draft other than EAGLE-3, is left out."""
    runs: dict[str, list[dict]] = {}
    for p in paths:
        run = _load(p)
        if run["perf"].get("steps_used", MIN_RUN_STEPS) < MIN_RUN_STEPS:
            continue
        if (run.get("draft") or {}).get("strategy", "eagle3") != "eagle3":  # a block draft's run: not the EAGLE-3 fit's
            continue
        t = _run_transport(p.name, run)
        step_name, step = run_step(p.name, run, recipe_step)
        length, trainer_alone = _trainer_rate(trainer_bench, round(run["perf"]["tokens_per_step"]), step)
        stage = {"prefill": slice_prefill, "trainer": trainer_alone, "tax_s": capture[t]["tax_s_per_token"]}
        h = _overlap().hidden_fraction(run["perf"]["end_to_end_tokens_per_s"], **stage)
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


def _ends(base: dict):
    """(assumption, end, the change, ``base`` with it) for the central row, each assumption's pessimistic and
    optimistic end one at a time, and all pessimistic ends together."""
    yield "as projected", "central", {}, base
    every = json.loads(json.dumps(base))
    for key, spec in base.items():
        for end in ("pessimistic", "optimistic"):
            a = json.loads(json.dumps(base))
            a[key].update(spec["ends"][end])
            yield key, end, spec["ends"][end], a
        every[key].update(spec["ends"]["pessimistic"])
    yield "all pessimistic ends", "pessimistic", {}, every


def sensitivity(project_with, recipes: dict, overlaps: dict, torchspec_with, base: dict) -> list[dict]:
    """The 8xB200 rows (EAGLE-3 and the block draft) and the TorchSpec prediction under each assumption's ends
    (:func:`_ends`); ``project_with(recipes, overlap, assumptions)``; ``overlaps``: the hidden fraction per
    transport for ``overlap_carries`` True, ``"worst"`` and ``"best"``; ``torchspec_with(assumptions)``; ``base``:
    the assumptions varied (``ASSUMPTIONS``, a measured one in place)."""
    b200 = {k: v for k, v in recipes.items() if "b200" in k}
    out = []
    for key, end, change, a in _ends(base):
        v = a["overlap_carries"]["value"]
        proj = project_with(b200, overlaps[v if isinstance(v, str) else "central"], a)
        out.append(
            {
                "assumption": key,
                "end": end,
                "change": change,
                "end_to_end_tokens_per_s_per_gpu": {
                    name: {t: x["end_to_end_tokens_per_s_per_gpu"] for t, x in r["transports"].items()}
                    for name, r in proj.items()
                },
                "gpu_hours_per_1b_tokens": {
                    name: {t: x["gpu_hours_per_1b_tokens"] for t, x in r["transports"].items()}
                    for name, r in proj.items()
                },
                "torchspec_predicted": torchspec_with(a)["tokens_per_s_per_gpu"],
                "torchspec_figures": {k: f["tokens_per_s_per_gpu"] for k, f in torchspec_figures(a).items()},
            }
        )
    return out


def _overlaps(runs: dict[str, list[dict]], overlap: dict[str, float]) -> dict[str, dict[str, float]]:
    """The fraction per transport as measured (``central``), and the lowest / highest single run's for both."""
    each = [max(-1.0, min(1.0, r["_overlap"])) for rs in runs.values() for r in rs]
    return {
        "central": overlap,
        "worst": {t: min(each) for t in overlap},
        "best": {t: max(each) for t in overlap},
    }


def build(results: Path, length: int, argv: list[str]) -> dict:
    inputs = find_inputs(results)
    pipeline = _load(inputs["pipeline"])
    trainer_bench, trainer_files = trainer_benches(inputs["trainer"])
    if not inputs["runs"]:
        raise SystemExit(f"error: no online_run_k25_slice_*.json in {results}")
    fit, slice_layers, slice_prefill = prefill_fit(inputs, length)
    capture = capture_rates(pipeline, length)
    slice_recipe = _recipes().load_recipe(REPO / "recipes" / SLICE_RECIPE)
    recipe_step = _recipe_step(slice_recipe)
    block_step = block_step_calibration(results / BLOCK_STEP_FILE, trainer_bench, slice_recipe)
    assumed = calibrated(ASSUMPTIONS, block_step)
    runs = slice_runs(
        inputs["runs"],
        slice_prefill=slice_prefill,
        trainer_bench=trainer_bench,
        capture=capture,
        recipe_step=recipe_step,
    )
    summaries = [_run_summary(t, r) for t, rs in runs.items() for r in rs]
    if not summaries:
        raise SystemExit(f"error: no EAGLE-3 slice run of {MIN_RUN_STEPS} or more timed steps in {results}")
    overlap = overlap_per_transport(runs)
    # the memory measured beside the plan: a run of the step the recipes ship, one naming its step (a newer
    # run-report, from its launch sheet) first
    named = {r["_file"] for rs in runs.values() for r in rs if "trainer_step_env" in r}
    primary = min(summaries, key=lambda s: (s["trainer_step"] != "recipe", s["file"] not in named))
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
            assumptions=assumptions or assumed,
        )

    def torchspec_with(assumptions: dict | None = None) -> dict:
        return torchspec_predict(fit=fit, capture=capture, trainer_bench=trainer_bench, assumptions=assumptions)

    probes = " + ".join(p.name for p in inputs["probes"].values())
    return {
        "command": ["python", "bench/sizing.py", *argv],
        "measured_on": "one H200 (K2.5-width slice 2026-12-03/04, width probes 2026-12-02"
        + (", the slice's block step 2026-12-05)" if block_step else ")"),
        "inputs": {
            "pipeline": inputs["pipeline"].name,
            "depth": " + ".join(p.name for p in inputs["depth"].values()),
            "width_probes": probes if "per_moe_layer_s_per_token_16_experts" in fit else "",
            "online_runs": " + ".join(s["file"] for s in summaries),
            "trainer": " + ".join(trainer_files),
            "block_step": block_step["file"] if block_step else "",
        },
        "assumptions": assumed,
        "tokens_per_prompt": length,
        "feature_bytes_per_token": feature_bytes,
        "depth_fit": fit,
        "capture": capture,
        "slice_runs": summaries,
        "slice_run": primary,
        "overlap_hidden_fraction": overlap,
        "memory_from_slice": mem_overheads,
        "backtest": backtest(runs=runs, slice_prefill=slice_prefill, fit=fit, probe_int4=probe_int4),
        "cross_check": torchspec_check(fit=fit, capture=capture, trainer_bench=trainer_bench),
        "block_trainer": {n: r["block_trainer"] for n, r in recipes.items() if "block_trainer" in r},
        "recipes": project_with(recipes, overlap),
        "sensitivity": sensitivity(project_with, recipes, _overlaps(runs, overlap), torchspec_with, assumed),
        "torchspec": {
            **TORCHSPEC,
            "tokens_per_s_per_gpu": TORCHSPEC["tokens"] / (TORCHSPEC["gpu_hours"] * 3600),
            "figures": torchspec_figures(),
            "predicted_on_its_layout": torchspec_with(),
        },
    }


def _headline(res: dict) -> list[str]:
    """The 8xB200 headline: EAGLE-3 and the block draft per transport, TorchSpec's two figures and the model's
    prediction on TorchSpec's layout."""
    ts = res["torchspec"]
    blog, card = ts["figures"]["blog"]["tokens_per_s_per_gpu"], ts["figures"]["model_card"]["tokens_per_s_per_gpu"]
    out = []
    for n, r in res["recipes"].items():
        if "b200" not in n:
            continue
        est = " (trainer scaled from EAGLE-3's: `block_step_vs_flops`)" if r["trainer_estimated"] else ""
        out.append(
            f"**8xB200 {n} ({r['family']}{est}), co-located, projected end-to-end trained tok/s per GPU: "
            + "; ".join(
                f"{t} {p['end_to_end_tokens_per_s_per_gpu']:,.0f} ({p['end_to_end_tokens_per_s_per_gpu'] / blog:.1f}x "
                f"TorchSpec's blog figure; {p['end_to_end_no_overlap_tokens_per_s_per_gpu']:,.0f} with the stages' "
                f"times added; {p['feature_gb_per_s_per_node']:.2f} GB/s of features per node; "
                f"{p['gpu_hours_per_1b_tokens']:,.0f} GPU-h per 1B tokens)"
                for t, p in r["transports"].items()
            )
            + ".**"
        )
        out.append("")
    pred = ts["predicted_on_its_layout"]
    out.append(
        f"TorchSpec's K2.5 run, like for like: this model on TorchSpec's own layout (16 H200 inference GPUs as two "
        f"TP=8 servers over Mooncake + 16 H200 trainers, no co-location) predicts **{pred['tokens_per_s_per_gpu']:,.0f}** "
        f"tok/s per GPU (servers {pred['servers_tokens_per_s']:,.0f}, trainers {pred['trainers_tokens_per_s']:,.0f} "
        f"tok/s: the slower side over 32 GPUs), beside its two published figures: the blog's **{blog:,.0f}** "
        f"({ts['tokens'] / 1e9:.0f}B tokens in {ts['gpu_hours']:,} GPU-hours) and the model card's **{card:,.0f}** "
        f"({ts['card']['phases']} phases x ~{ts['card']['hours_per_phase']} h x {ts['card']['gpus']} GPUs = "
        f"{ts['figures']['model_card']['gpu_hours']:,} GPU-hours; its token count is not published, the blog's "
        f"{ts['figures']['model_card']['tokens'] / 1e9:.0f}B assumed: `torchspec_card`)."
    )
    return out


def _sensitivity_table(res: dict) -> list[str]:
    names = [n for n, r in res["recipes"].items() if "b200" in n]
    cols = [(n, t) for n in names for t in res["recipes"][n]["transports"]]
    lines = [
        "Sensitivity (`sensitivity` in the JSON): one assumption at a time at its pessimistic and optimistic end "
        "(`assumptions[].ends`, each with its reason), 8xB200 end-to-end trained tok/s per GPU and the TorchSpec "
        "prediction; the last row sets every pessimistic end at once.",
        "",
        "| assumption | end | change | "
        + " | ".join(
            f"{n.replace('kimi-k25-8xb200-lowered', 'eagle3').replace('eagle3-dflash', 'dflash')} {t}" for n, t in cols
        )
        + " | TorchSpec layout predicted (blog / card figure) |",
        "| " + " | ".join(["---"] * (len(cols) + 4)) + " |",
    ]
    for s in res["sensitivity"]:
        e = s["end_to_end_tokens_per_s_per_gpu"]
        f = s["torchspec_figures"]
        change = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in s["change"].items())
        lines.append(
            f"| {s['assumption']} | {s['end']} | {change} | "
            + " | ".join(f"{e[n][t]:,.0f}" for n, t in cols)
            + f" | {s['torchspec_predicted']:,.0f} ({f['blog']:,.0f} / {f['model_card']:,.0f}) |"
        )
    return lines


def table(res: dict) -> str:
    ts = res["torchspec"]["tokens_per_s_per_gpu"]
    lines = [
        *_headline(res),
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
            est = " (est.)" if r["trainer_estimated"] else ""
            lines.append(
                f"| {name} | {r['gpus']} | {r['tp']} | {t}{mark} | {r['node_prefill_tokens_per_s']:,.0f} | "
                f"{r['trainer_tokens_per_s_per_gpu']:,.0f}{est} | {r['slowest_stage']} | "
                f"**{p['end_to_end_tokens_per_s_per_gpu']:,.0f}** ({p['end_to_end_no_overlap_tokens_per_s_per_gpu']:,.0f}) | "
                f"{p['end_to_end_tokens_per_s_per_gpu'] / ts:.2f}x | "
                f"{p['feature_gb_per_s_per_node']:.2f} ({p['transport_readers_gb_per_s_per_node']:,.0f}) | "
                f"{p['writer_gb_per_s']:.2f} ({p['transport_writer_gb_per_s']:,.0f}) | "
                f"{m['server_pool']:.0f} + {m['trainer_plan']:.0f} ({m['server_peak_plus_trainer_plan']:.0f}{over}{plan}) "
                f"of {m['gpu']:.0f} | "
                f"{p['wall_hours_per_1b_tokens']:,.1f} | {p['gpu_hours_per_1b_tokens']:,.0f} |"
            )
    measured = res["assumptions"]["block_step_vs_flops"].get("measured")
    how = (
        f"scaled by `block_step_vs_flops` {measured['value']:.2f}, measured on the slice's DFlash twin "
        f"({measured['file']})"
        if measured
        else "an estimate: no block step measured at K2.5's width"
    )
    for n, b in res.get("block_trainer", {}).items():
        mine, theirs = b["flops_per_token"], b["twin_flops_per_token"]
        lines += [
            "",
            f"{n}'s trainer ({how}): training GFLOP per token "
            + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in mine.items())
            + " against its EAGLE-3 twin's "
            + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in theirs.items())
            + f" (ratio {mine['total'] / theirs['total']:.2f}): its step is the twin's measured step x that ratio "
            f"x `block_step_vs_flops`; features {b['feature_bytes_per_token_plan']:,} B per token against "
            f"{b['twin_feature_bytes_per_token_plan']:,} (the plans'), on the transport, in the pool and in the "
            "capture tax (`block_capture_tax_vs_eagle3`).",
        ]
    lines += ["", *_sensitivity_table(res)]
    f = res["depth_fit"]
    lines += [
        "",
        f"TorchSpec's K2.5 run: {ts:,.0f} tok/s per GPU by the blog ({res['torchspec']['tokens'] / 1e9:.0f}B tokens, "
        f"{res['torchspec']['gpu_hours']:,} H200 GPU-hours, {res['torchspec']['gpus']} GPUs), "
        f"{1e9 / ts / 3600:,.0f} GPU-hours per 1B tokens; by the model card "
        f"{res['torchspec']['figures']['model_card']['tokens_per_s_per_gpu']:,.0f} tok/s per GPU (its tokens assumed).",
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
