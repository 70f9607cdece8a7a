"""Sizing model: a full 61-layer Kimi-K2.5 online run projected from the committed real-width measurements.

Reads what one H200 measured on K2.5-width slices (INT4 experts, 384 per MoE layer, two depths:
``bench/results/online_pipeline_k25_slice*_h200.json``), the slice's co-located online run
(``bench/results/online_run_k25_slice_h200.json``: trainer-only and end-to-end tok/s, GPU memory per role) and
the trainer bench at the B200 recipe's sizes (``bench/results/trainer_memory_k25_b200_h200.json``), and projects
for each shipped K2.5 recipe (8xB200 lowered, 8xB300, 2x8 B300):

- node prefill tok/s: per-token prefill time at two depths -> a fixed part and a per-MoE-layer part (the dense
  layer, embedding and head in the fixed part), extrapolated to 61 layers; TP scaling and GPU speed are
  ASSUMPTIONS (below, stated in the output), not measured here;
- the capture tax per token (capture minus plain, measured per transport at the slice's depth; on the node's one
  capture writer, not divided by TP) and feature GB/s per node against what the transport carried;
- trainer tok/s per GPU (measured on the H200, times the GPU-speed assumption);
- co-located end-to-end tok/s per GPU: server and trainer share each GPU, so per trained token a GPU spends
  1/prefill + 1/trainer seconds (both compute-bound), times the sharing efficiency the slice run measured
  (its end-to-end rate over that formula on its own stage rates); plus the capture tax;
- memory per GPU (``recipes.memory_plan``, and the slice's measured peak over plan);
- wall time and GPU-hours per 1B trained tokens, beside TorchSpec's published K2.5 run (6B tokens in 1,500 H200
  GPU-hours, 16 inference + 16 trainer GPUs: 1.1k tok/s per GPU).

    python bench/sizing.py                      # writes bench/results/sizing_k25.json and docs/sizing.md's table

Rerun after a new measurement: the table between the markers in docs/sizing.md is rewritten from the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "sizing.md"
BEGIN, END = "<!-- sizing:begin (bench/sizing.py writes this) -->", "<!-- sizing:end -->"
FEATURE_BYTES_PER_TOKEN = (3 + 1) * 7168 * 2  # 3 aux + last hidden, bf16
K25_LAYERS = 61
RECIPES = ("kimi-k25-8xb200-lowered.yaml", "kimi-k25-8xb300.yaml", "kimi-k25-2x8xb300.yaml")
#: TorchSpec's K2.5 EAGLE-3 run: 6B tokens, 1,500 H200 GPU-hours, 16 inference + 16 training GPUs.
TORCHSPEC = {"tokens": 6e9, "gpu_hours": 1500, "gpus": 32}

#: Not measured here (one H200 is lent); each number is an assumption with its reason, in the output.
ASSUMPTIONS = {
    "gpu_speed_vs_h200": {
        "H200": 1.0,
        "B200": 2.0,
        "B300": 2.0,
        "why": "bf16 dense tensor throughput, spec sheets: H200 0.99, B200 and B300 2.25 PFLOPS (B300 adds FP4, "
        "not bf16); discounted to 2.0 for prefill and training kernels that reach less of the peak",
    },
    "tp_efficiency": {
        "1": 1.0,
        "8": 0.7,
        "16": 0.5,
        "why": "per-GPU prefill at TP=N = N x efficiency x one GPU's rate: TP=8 pays two NVLink all-reduces per "
        "layer and 8x smaller GEMMs per GPU (0.7 assumed); TP=16 spans two nodes' network (0.5 assumed)",
    },
    "readers_scale": {
        "value": True,
        "why": "every trainer rank reads its own samples from the transport: the node's reader rate is the "
        "measured one-reader rate x ranks (Mooncake over loopback is per-client memcpy bound)",
    },
}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} not found (run the measurement first; docs/sizing.md says which)") from None


def _shape_row(pipeline: dict, tokens_per_prompt: int, transport: str | None = None) -> dict:
    """A bench file's row for a prompt length (TP=1; of ``transport``, or the first run that has it)."""
    for run in pipeline["runs"]:
        if run.get("tp", 1) != 1 or transport not in (None, run.get("transport", "mooncake")):
            continue
        for row in run["shapes"]:
            if row["tokens_per_prompt"] == tokens_per_prompt:
                return row
    raise SystemExit(f"error: no TP=1 {transport} row for {tokens_per_prompt}-token prompts in the pipeline result")


def depth_fit(points: list[tuple[int, float]]) -> dict:
    """Per-token prefill seconds at two depths (layers, plain tok/s) -> fixed + per-MoE-layer seconds
    (layer 0 is K2.5's dense layer: in the fixed part with the embedding and head), and K2.5's 61 layers."""
    (l1, r1), (l2, r2) = sorted(points)
    if l1 == l2:
        raise SystemExit("error: the two depth measurements have the same number of layers")
    t1, t2 = 1 / r1, 1 / r2
    per_layer = (t2 - t1) / (l2 - l1)
    fixed = t1 - per_layer * (l1 - 1)
    return {
        "points": [{"layers": l1, "plain_tokens_per_s": r1}, {"layers": l2, "plain_tokens_per_s": r2}],
        "fixed_s_per_token": fixed,
        "per_moe_layer_s_per_token": per_layer,
        "k25_s_per_token_one_h200": fixed + per_layer * (K25_LAYERS - 1),
    }


def project(
    *,
    fit: dict,
    capture: dict[str, dict],
    trainer_tok_s_h200: float,
    sharing: float,
    plans: dict[str, dict],
    recipes: dict[str, dict],
) -> dict:
    """The projection per recipe. ``capture``: per transport, ``tax_s_per_token`` and ``read_gb_per_s`` (one
    reader); ``sharing``: measured end-to-end over the serial-sharing formula (the slice run)."""
    out = {}
    speed = ASSUMPTIONS["gpu_speed_vs_h200"]
    for name, r in recipes.items():
        gpus_per_node, nnodes, kind = r["per_node"], r["nnodes"], r["kind"]
        tp = gpus_per_node * nnodes
        s = speed[kind]
        eff = ASSUMPTIONS["tp_efficiency"][str(tp)]
        prefill_per_gpu = eff * s / fit["k25_s_per_token_one_h200"]  # tokens/s one GPU's share contributes
        trainer_per_gpu = s * trainer_tok_s_h200
        serial = 1 / (1 / prefill_per_gpu + 1 / trainer_per_gpu)
        per_transport = {}
        for transport, c in capture.items():
            # the node's one capture writer adds tax_s per token of the node's tokens (host/transport bound)
            node_tok_s = gpus_per_node * serial * sharing
            node_with_tax = 1 / (1 / node_tok_s + c["tax_s_per_token"])
            e2e = node_with_tax / gpus_per_node
            feature_gb_s = node_with_tax * FEATURE_BYTES_PER_TOKEN / 1e9
            readers_gb_s = c["read_gb_per_s"] * gpus_per_node
            wall_h = 1e9 / (e2e * gpus_per_node * nnodes) / 3600
            per_transport[transport] = {
                "end_to_end_tokens_per_s_per_gpu": e2e,
                "node_tokens_per_s": node_with_tax,
                "feature_gb_per_s_per_node": feature_gb_s,
                "transport_readers_gb_per_s_per_node": readers_gb_s,
                "transport_bound": feature_gb_s > readers_gb_s,
                "wall_hours_per_1b_tokens": wall_h,
                "gpu_hours_per_1b_tokens": wall_h * gpus_per_node * nnodes,
            }
        out[name] = {
            "gpus": f"{nnodes}x{gpus_per_node} {kind}",
            "tp": tp,
            "prefill_tokens_per_s_per_gpu": prefill_per_gpu,
            "node_prefill_tokens_per_s": prefill_per_gpu * gpus_per_node,
            "trainer_tokens_per_s_per_gpu": trainer_per_gpu,
            "slowest_stage": "prefill" if prefill_per_gpu < trainer_per_gpu else "trainer",
            "transports": per_transport,
            "memory_per_gpu_gib": plans[name],
        }
    return out


def _recipe_inputs() -> tuple[dict, dict]:
    sys.path.insert(0, str(REPO / "src"))
    from specforge_kimi.online.recipes import load_recipe, memory_plan

    recipes, plans = {}, {}
    for f in RECIPES:
        r = load_recipe(REPO / "recipes" / f)
        recipes[r.name] = {"per_node": r.gpus.per_node, "nnodes": r.gpus.nnodes, "kind": r.gpus.kind}
        p = memory_plan(r)
        plans[r.name] = {
            "gpu": r.gpus.memory_gib,
            "server_pool": p["server_pool_gib"],
            "trainer_plan": p["trainer_peak_gib"],
            "trainer_room": p["trainer_room_gib"],
        }
    return recipes, plans


def build(args) -> dict:
    pipeline = _load(Path(args.pipeline))
    depths = [_load(Path(d)) for d in args.depth]
    run = _load(Path(args.online_run))
    trainer = _load(Path(args.trainer))
    length = args.tokens_per_prompt
    fit = depth_fit([(d["config"]["layers"], _shape_row(d, length)["plain_tokens_per_s"]) for d in depths])
    capture = {}
    for transport in sorted({r.get("transport", "mooncake") for r in pipeline["runs"]}):
        row = _shape_row(pipeline, length, transport)
        capture[transport] = {
            "capture_over_plain_at_slice": row["capture_over_plain"],
            "tax_s_per_token": 1 / row["capture_tokens_per_s"] - 1 / row["plain_tokens_per_s"],
            "read_gb_per_s": row["read_gb_per_s"],
            "capture_write_gb_per_s": row.get("capture_write_gb_per_s"),
        }
    perf = run["perf"]
    trainer_h200 = perf["trainer_only_tokens_per_s"]
    slice_layers = pipeline["config"]["layers"]
    (slice_depth,) = [d for d in depths if d["config"]["layers"] == slice_layers] or [pipeline]
    slice_prefill = _shape_row(slice_depth, length)["plain_tokens_per_s"]
    slice_serial = 1 / (1 / slice_prefill + 1 / trainer_h200)
    sharing = perf["end_to_end_tokens_per_s"] / slice_serial
    bench_rows = [r for r in trainer["rows"] if r["backend"] == "flex_attention"]
    recipes, plans = _recipe_inputs()
    slice_mem = run.get("gpu_memory", {}).get("peak_mib_per_role", {})
    result = {
        "command": ["python", "bench/sizing.py", *sys.argv[1:]],
        "inputs": {
            "pipeline": args.pipeline,
            "depth": " + ".join(args.depth),
            "online_run": args.online_run,
            "trainer": args.trainer,
        },
        "assumptions": ASSUMPTIONS,
        "tokens_per_prompt": length,
        "depth_fit": fit,
        "capture": capture,
        "slice_run": {
            "trainer_only_tokens_per_s": trainer_h200,
            "end_to_end_tokens_per_s": perf["end_to_end_tokens_per_s"],
            "slice_prefill_tokens_per_s": slice_prefill,
            "sharing_efficiency": sharing,
            "end_to_end_over_slowest_stage": perf["end_to_end_tokens_per_s"] / min(slice_prefill, trainer_h200),
            "peak_gpu_mib_per_role": slice_mem,
        },
        "trainer_bench_h200": {
            str(r["length"]): {"tokens_per_s": r["tokens_per_s"], "peak_reserved_gib": r["peak_reserved_gib"]}
            for r in bench_rows
        },
        "recipes": project(
            fit=fit, capture=capture, trainer_tok_s_h200=trainer_h200, sharing=sharing, plans=plans, recipes=recipes
        ),
        "torchspec": {**TORCHSPEC, "tokens_per_s_per_gpu": TORCHSPEC["tokens"] / (TORCHSPEC["gpu_hours"] * 3600)},
    }
    return result


def table(res: dict) -> str:
    ts = res["torchspec"]["tokens_per_s_per_gpu"]
    lines = [
        "| recipe | GPUs | TP | prefill tok/s per GPU | trainer tok/s per GPU | slowest | transport | "
        "end-to-end tok/s per GPU | vs TorchSpec 1.1k | features GB/s per node (transport carries) | "
        "GPU-hours per 1B tokens | memory per GPU: server pool + trainer plan of GPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in res["recipes"].items():
        m = r["memory_per_gpu_gib"]
        for t, p in r["transports"].items():
            lines.append(
                f"| {name} | {r['gpus']} | {r['tp']} | {r['prefill_tokens_per_s_per_gpu']:,.0f} | "
                f"{r['trainer_tokens_per_s_per_gpu']:,.0f} | {r['slowest_stage']} | {t} | "
                f"{p['end_to_end_tokens_per_s_per_gpu']:,.0f} | {p['end_to_end_tokens_per_s_per_gpu'] / ts:.2f}x | "
                f"{p['feature_gb_per_s_per_node']:.2f} ({p['transport_readers_gb_per_s_per_node']:.1f}) | "
                f"{p['gpu_hours_per_1b_tokens']:,.0f} | {m['server_pool']:.0f} + {m['trainer_plan']:.0f} of {m['gpu']:.0f} |"
            )
    f = res["depth_fit"]
    s = res["slice_run"]
    lines += [
        "",
        f"Measured on one H200 (inputs: {', '.join(f'`{v}`' for v in res['inputs'].values())}): plain prefill of "
        f"{res['tokens_per_prompt']}-token prompts "
        + ", ".join(f"{p['plain_tokens_per_s']:,.0f} tok/s at {p['layers']} layers" for p in f["points"])
        + f" -> {f['fixed_s_per_token'] * 1e6:.2f} us per token fixed + {f['per_moe_layer_s_per_token'] * 1e6:.2f} us "
        f"per MoE layer, {1 / f['k25_s_per_token_one_h200']:,.0f} tok/s for 61 layers on one H200; capture tax "
        + ", ".join(f"{t} {c['tax_s_per_token'] * 1e6:.1f} us/token" for t, c in res["capture"].items())
        + f"; the slice's co-located run: trainer-only {s['trainer_only_tokens_per_s']:,.0f} tok/s, end-to-end "
        f"{s['end_to_end_tokens_per_s']:,.0f} tok/s ({s['end_to_end_over_slowest_stage']:.2f} of its slowest stage, "
        f"sharing efficiency {s['sharing_efficiency']:.2f}). TorchSpec: {ts:,.0f} tok/s per GPU.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pipeline",
        default=str(RESULTS / "online_pipeline_k25_slice_h200.json"),
        help="bench/online_pipeline.py on the 5-layer slice (capture tax and reader rate per transport)",
    )
    p.add_argument(
        "--depth",
        nargs=2,
        default=[
            str(RESULTS / "prefill_depth_k25_slice5_h200.json"),
            str(RESULTS / "prefill_depth_k25_slice3_h200.json"),
        ],
        help="bench/prefill_depth.py at two depths of the slice, the same server flags (the per-layer fit)",
    )
    p.add_argument(
        "--online-run",
        default=str(RESULTS / "online_run_k25_slice_h200.json"),
        help="run-report of the slice recipe's co-located run",
    )
    p.add_argument(
        "--trainer",
        default=str(RESULTS / "trainer_memory_k25_b200_h200.json"),
        help="bench/trainer_memory.py at the B200 recipe's sizes",
    )
    p.add_argument("--tokens-per-prompt", type=int, default=4096, help="prompt length whose rows feed the model")
    p.add_argument("--out", default=str(RESULTS / "sizing_k25.json"))
    p.add_argument("--doc", default=str(DOC), help="markdown file whose table between the markers is rewritten")
    args = p.parse_args(argv)
    res = build(args)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    doc = Path(args.doc)
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {doc} has no sizing markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + BEGIN + "\n" + table(res) + "\n" + END + tail)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
