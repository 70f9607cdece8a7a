"""CPU cost of a capture request's passthrough lists on the request path, SpecForge's JSON lists
against the compact forms of our SpecForge patch compact-capture-passthrough + SGLang patch spec-capture-compact-passthrough.

On the H200 (``bench/online_pipeline.py --breakdown``, archive/gpu-runs/RUNS.md, 2026-12-01, the prompt-rule target run) the
passthrough lists (input_ids, loss_mask, attention_mask as JSON int lists inside ``spec_capture``)
cost 40-80 ms per 65,536-token batch on the server and 11-23 ms of client encoding, most of what
capture adds to a prefill; the 270 MB feature write itself added 7-15 ms. This script times, on
this machine's CPU, each step such a body goes through, for the producer's body built by SpecForge's
own ``SGLangServerCaptureAdapter._spec_capture_payload`` (patched on a scratch copy; the install is
untouched) with ``SPECFORGE_SPEC_CAPTURE_COMPACT`` off (``lists``) and on (``compact``):

  encode    ``json.dumps`` of the whole body, as ``requests`` sends it (client)
  decode    ``json.loads`` of the bytes (Starlette's ``Request.json``)
  validate  pydantic validation of ``spec_capture`` against the patched field's annotation
  ipc       pickle round trip of the per-request ``spec_capture`` dicts (tokenizer -> scheduler)
  build     the sink's tensors from the items (``reference_server.passthrough_tensor``: the same
            forms and calls as SGLang patch spec-capture-compact-passthrough's ``_passthrough_tensor``)

Medians of ``--reps``; a loss mask with a realistic mix of 0/1 (first third of each prompt 0).
Writes JSON with the command and environment. A CPU estimate of where the request path's time
goes, not a GPU measurement; timings are never pass/fail.

    python bench/studies/passthrough_cpu.py --out bench/results/passthrough_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

SERVER_CAPTURE = "specforge/inference/adapters/server_capture.py"


def _adapter(module):
    """SpecForge's patched adapter with the eagle3 text layout its online producer uses."""
    from specforge.algorithms.eagle3.providers import create_registration

    algorithm = create_registration()
    layout = algorithm.providers.server_streaming_for("text").layout
    schema = module.ServerCaptureSchema(
        aux_feature=layout.aux_feature,
        last_hidden_feature=layout.last_hidden_feature,
        passthrough=layout.passthrough,
        attention_mask_feature=layout.attention_mask_feature,
    )
    store = types.SimpleNamespace(
        store_id="bench", adopt=None, discard_external_attempts=None, track_external_attempt=None
    )  # body building never calls the store
    return module.SGLangServerCaptureAdapter(
        "http://127.0.0.1:1",
        store,
        run_id="bench",
        algorithm=algorithm.name,
        schema=schema,
        timeout_s=60.0,
        target_model_version="bench",
    )


def _body(adapter, prompts, compact: bool) -> dict:
    from specforge.runtime.contracts import PromptTask

    from specforge_kimi.run.offline_twin import producer_body

    tasks = [
        PromptTask(
            task_id=f"t{i}",
            run_id="bench",
            source_id="bench",
            payload={"input_ids": p, "loss_mask": [0] * (len(p) // 3) + [1] * (len(p) - len(p) // 3)},
            max_length=len(p) + 1,
            metadata={"num_tokens": len(p)},
        )
        for i, p in enumerate(prompts)
    ]
    return producer_body(adapter, tasks, compact=compact)


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure(adapter, n: int, length: int, reps: int) -> dict:
    import random

    from pydantic import TypeAdapter

    from specforge_kimi.servers.reference_server import passthrough_tensor

    rng = random.Random(length * 1000 + n)
    prompts = [[rng.randrange(1000, 150000) for _ in range(length)] for _ in range(n)]
    field = TypeAdapter(list[dict | None] | dict | None)  # patched GenerateReqInput.spec_capture
    out: dict = {"batch": n, "tokens_per_prompt": length, "tokens": n * length}
    built = {}
    for form in ("lists", "compact"):
        body = _body(adapter, prompts, compact=form == "compact")
        data = json.dumps(body).encode()
        parsed = json.loads(data)
        specs = parsed["spec_capture"]

        def build(specs=specs, parsed=parsed):
            return [
                [passthrough_tensor(item, ids) for item in spec["passthrough"]]
                for spec, ids in zip(specs, parsed["input_ids"], strict=False)
            ]

        row = {
            "body_bytes": len(data),
            "passthrough_items": sorted(
                {k for s in specs for i in s["passthrough"] for k in i if k in ("data", "source", "fill", "data_b64")}
            ),
            "encode_ms": _median_ms(lambda body=body: json.dumps(body).encode(), reps),
            "decode_ms": _median_ms(lambda data=data: json.loads(data), reps),
            "validate_ms": _median_ms(lambda specs=specs: field.validate_python(specs), reps),
            "ipc_ms": _median_ms(lambda specs=specs: [pickle.loads(pickle.dumps(s)) for s in specs], reps),
            "build_ms": _median_ms(build, reps),
        }
        row["total_ms"] = sum(v for k, v in row.items() if k.endswith("_ms"))
        out[form] = row
        built[form] = build()
    # the two forms must give the sink the same tensors, or the comparison means nothing
    import torch

    out["identical_tensors"] = all(
        torch.equal(a, b)
        for la, lb in zip(built["lists"], built["compact"], strict=False)
        for a, b in zip(la, lb, strict=False)
    )
    out["compact_saves_ms"] = out["lists"]["total_ms"] - out["compact"]["total_ms"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="64x1024,16x4096")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")

    from specforge_kimi.provenance import versions
    from specforge_kimi.setup.setup_patches import load_patched_specforge_module

    with tempfile.TemporaryDirectory(prefix="passthrough-bench-") as tmp:
        adapter = _adapter(load_patched_specforge_module(SERVER_CAPTURE, Path(tmp)))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    out = {
        "benchmark": "capture passthrough request path",
        "command": [sys.executable, *sys.argv],
        "versions": versions(),
        "environment": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor(),
        },
        "config": {"shapes": args.shapes, "reps": args.reps},
        "shapes": [measure(adapter, n, length, args.reps) for n, length in shapes],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    for s in out["shapes"]:
        for form in ("lists", "compact"):
            r = s[form]
            print(
                f"{s['batch']}x{s['tokens_per_prompt']} {form:7s}: {r['body_bytes'] / 1e6:.2f} MB, encode "
                f"{r['encode_ms']:.1f}, decode {r['decode_ms']:.1f}, validate {r['validate_ms']:.1f}, ipc "
                f"{r['ipc_ms']:.1f}, build {r['build_ms']:.1f} = {r['total_ms']:.1f} ms"
            )
        print(f"  compact saves {s['compact_saves_ms']:.1f} ms per batch; identical tensors: {s['identical_tensors']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
