"""How much memory does SpecForge's online teacher take per token? (CPU, no GPU). Prints and writes JSON.

Online, SpecForge's ``TargetHead`` turns the captured last hidden state into the target's full
logits ``[1, L, V]`` (bf16), and ``_compute_target_p_padded`` takes them to fp32 and a logsumexp over
the vocabulary (its chunked compact teacher is offline-only). ``recipes.memory_plan`` charges this
at 10 B x L x V (bf16 logits 2 + fp32 copy 4 + logsumexp's exp temporary 4). With K2.5's V = 163,840
that is 6.25 GiB at 4k tokens and 25 GiB at 16k, which decides whether the B300 recipe fits.

Each length runs in a fresh Python process: it allocates the hidden states and the head weight,
reads its resident set size, runs exactly SpecForge's calls (``F.linear`` of the head, then
``specforge.algorithms.eagle3.model._compute_target_p_padded``), and reports the peak resident set
size (``ru_maxrss``) above that baseline. The slope of peak bytes over L x V, fitted across the
lengths, is the per-element cost; the intercept absorbs the imports. CPU kernels, so the number
checks the plan's arithmetic (which tensors exist at once), not a CUDA allocator's rounding.

    python bench/studies/teacher_memory_cpu.py --out bench/results/teacher_memory_cpu.json

Measurements, never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

PLAN_BYTES_PER_ELEMENT = 10  # recipes.memory_plan's teacher-logits term, per (token x vocab entry)

_CHILD = r"""
import json, resource, sys
import torch
import torch.nn.functional as F
from specforge.algorithms.eagle3.model import _compute_target_p_padded

L, V, H, DV, TTT = (int(x) for x in sys.argv[1:6])
torch.manual_seed(0)
torch.set_num_threads(1)
hidden = torch.randn(1, L, H, dtype=torch.bfloat16)
weight = torch.randn(V, H, dtype=torch.bfloat16) * 0.05
t2d = torch.zeros(V, dtype=torch.bool)
t2d[torch.randperm(V)[:DV]] = True
loss_mask = torch.ones(1, L, 1, dtype=torch.long)

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

base = rss_kib()
with torch.no_grad():
    logits = F.linear(hidden, weight)          # TargetHead.forward: the full bf16 logits
    out = _compute_target_p_padded(target=logits, t2d=t2d, loss_mask=loss_mask, length=TTT)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"L": L, "baseline_rss_kib": base, "peak_rss_kib": peak,
                  "peak_above_baseline_bytes": (peak - base) * 1024,
                  "outputs_bytes": sum(t.numel() * t.element_size() for t in out)}))
"""


def run(lengths, vocab, hidden, draft_vocab, ttt) -> dict:
    rows = []
    for n in lengths:
        res = subprocess.run(
            [sys.executable, "-c", _CHILD, str(n), str(vocab), str(hidden), str(draft_vocab), str(ttt)],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["bytes_per_token_vocab"] = row["peak_above_baseline_bytes"] / (n * vocab)
        rows.append(row)
        print(
            f"L={n}: peak above baseline {row['peak_above_baseline_bytes'] / 2**30:.3f} GiB "
            f"= {row['bytes_per_token_vocab']:.2f} B per token x vocab entry",
            flush=True,
        )
    xs = [r["L"] * vocab for r in rows]
    ys = [r["peak_above_baseline_bytes"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sum((x - mx) ** 2 for x in xs)
    return {
        "rows": rows,
        "slope_bytes_per_token_vocab": slope,
        "intercept_bytes": my - slope * mx,
        "plan_bytes_per_token_vocab": PLAN_BYTES_PER_ELEMENT,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048", help="sample lengths L (comma-separated)")
    ap.add_argument("--vocab", type=int, default=163840, help="target vocab V (K2.5: 163840)")
    ap.add_argument(
        "--hidden", type=int, default=64, help="hidden size of the stand-in head (small: only the logits' size matters)"
    )
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import specforge
    import torch

    res = run([int(x) for x in args.lengths.split(",")], args.vocab, args.hidden, args.draft_vocab, args.ttt)
    print(f"slope {res['slope_bytes_per_token_vocab']:.2f} B per token x vocab entry (plan: {PLAN_BYTES_PER_ELEMENT})")
    doc = {
        "benchmark": "online teacher memory per token x vocab entry (CPU)",
        "command": [sys.executable, *sys.argv],
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "specforge": getattr(specforge, "__version__", "?"),
            "machine": platform.machine(),
            "cpus": __import__("os").cpu_count(),
        },
        "config": {
            "lengths": args.lengths,
            "vocab": args.vocab,
            "hidden": args.hidden,
            "draft_vocab": args.draft_vocab,
            "ttt": args.ttt,
        },
        **res,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
