"""Does a step-bounded tiny-target pretraining reproduce? Runs ``specforge-kimi tiny --pretrain
SECONDS --pretrain-steps N`` twice per mode on one device and compares the two targets.

Modes: ``deterministic`` (the command as the GPU scripts run it: deterministic algorithms are the
default) and ``nondeterministic`` (``--no-pretrain-deterministic``). For each
mode the JSON records both runs' steps, seconds, first/last loss and held-out numbers
(``pretrain.json``), the first step whose loss differs, and the largest absolute difference over
every weight of the two written checkpoints. A target that does not repeat moves every acceptance
number measured on it between box starts, so this is the property the GPU runs rely on when they
pin ``PRETRAIN_STEPS``. Measurements, never pass/fail.

    python bench/studies/pretrain_repro.py --steps 500 --device cuda --out bench/results/pretrain_repro_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(out: Path, args: argparse.Namespace, deterministic: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "specforge_kimi",
        "tiny",
        str(out),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--pretrain",
        str(args.seconds),
        "--pretrain-steps",
        str(args.steps),
        "--device",
        args.device,
        "--pretrain-batch-size",
        str(args.batch_size),
        "--pretrain-precision",
        args.precision,
        "--pretrain-schedule",
        args.schedule,
        *([] if deterministic else ["--no-pretrain-deterministic"]),
    ]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    pre = json.loads((out / "pretrain.json").read_text())
    return {
        "wall_s": round(time.monotonic() - t0, 1),
        "steps": pre["train"]["steps"],
        "seconds": pre["train"]["seconds"],
        "loss_first": pre["train"]["loss_first"],
        "loss_last": pre["train"]["loss_last"],
        "losses": pre["train"]["losses"],
        "heldout_loss": pre["heldout"]["loss"],
        "heldout_greedy_accuracy": pre["heldout"]["greedy_accuracy"],
    }


def _max_weight_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    diff = 0.0
    for fa in sorted(a.glob("*.safetensors")):
        ta, tb = load_file(fa), load_file(b / fa.name)
        for k, v in ta.items():
            diff = max(diff, (v.float() - tb[k].float()).abs().max().item())
    return diff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seconds", type=float, default=3600.0, help="time cap (large: the step bound decides)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("deterministic", "nondeterministic"),
        default=["deterministic", "nondeterministic"],
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": [sys.executable, *sys.argv],
        "git_commit": git or None,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor(),
        },
        "config": {
            k: getattr(args, k)
            for k in ("steps", "seconds", "layers", "hidden", "device", "batch_size", "precision", "schedule")
        },
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            runs = []
            for i in range(2):
                runs.append(_run(Path(tmp) / f"{mode}-{i}", args, mode == "deterministic"))
            la, lb = runs[0].pop("losses"), runs[1].pop("losses")
            first = next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), None)
            result["modes"][mode] = {
                "runs": runs,
                "first_differing_step": first,
                "losses_identical": la == lb,
                "max_abs_weight_diff": _max_weight_diff(Path(tmp) / f"{mode}-0", Path(tmp) / f"{mode}-1"),
            }
            print(mode, json.dumps(result["modes"][mode]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
