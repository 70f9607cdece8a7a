"""Plain prefill rate of a running SGLang server, for the per-layer cost fit of ``bench/sizing.py``.

Times ``POST /generate`` of batches of random token ids (``max_new_tokens`` 1: one extend, one decoded token)
against a server already up at ``--url`` -- e.g. the real-width rehearsal's data-stage server, and a server of a
shallower slice started with the same flags -- so the two depths of the fit are measured the same way. One warm-up
call per shape, then ``--reps`` timed calls; medians. A measurement, never pass/fail.

    python bench/prefill_depth.py --url http://127.0.0.1:31998 --target runs/k25-slice --shapes 4x4096,16x1024 \
        --out bench/results/prefill_depth_k25_slice5_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path


def _post(url: str, body: dict, timeout: float = 900.0) -> None:
    req = urllib.request.Request(
        f"{url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def time_shape(url: str, n: int, length: int, reps: int, seed: int = 0) -> dict:
    rng = random.Random(seed + n * 100_003 + length)
    times = []
    for rep in range(reps + 1):
        # fresh ids each call: no radix-cache hit makes a call cheaper than a prefill
        ids = [[rng.randrange(1000, 150_000) for _ in range(length)] for _ in range(n)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        t = time.perf_counter()
        _post(url, body)
        if rep:
            times.append(time.perf_counter() - t)
    s = statistics.median(times)
    return {
        "batch": n,
        "tokens_per_prompt": length,
        "tokens": n * length,
        "reps": reps,
        "seconds": times,
        "plain_tokens_per_s": n * length / s,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="a running server (SGLang /generate)")
    p.add_argument("--target", required=True, help="its checkpoint (layers, hidden, experts are recorded)")
    p.add_argument("--shapes", default="4x4096,16x1024", help="BATCHxTOKENS, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from specforge_kimi.provenance import versions
    from specforge_kimi.targets.checkpoint import read_config, text_config_dict

    cfg = read_config(args.target)  # config only: a depth view's files may hold more layers than it serves
    text = text_config_dict(cfg)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = [time_shape(args.url, n, length, args.reps) for n, length in shapes]
    out = {
        "benchmark": "plain prefill of a running server (bench/prefill_depth.py)",
        "command": [sys.executable, *sys.argv],
        "versions": versions(),
        "platform": platform.platform(),
        "config": {
            "target": args.target,
            "layers": text["num_hidden_layers"],
            "hidden": text["hidden_size"],
            "experts": text.get("n_routed_experts"),
            "experts_per_token": text.get("num_experts_per_tok"),
            "quantization": (text.get("quantization_config") or {}).get("format"),
            "url": args.url,
        },
        "runs": [{"tp": 1, "transport": "none", "shapes": rows}],
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"{r['batch']}x{r['tokens_per_prompt']}: {r['plain_tokens_per_s']:,.0f} tok/s plain prefill")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
