"""Two draft families side by side on one target: an EAGLE-3 draft and a block draft (DFlash or DSpark), each
served by SGLang and measured by ``specforge-kimi bench``, compared from the two acceptance JSONs it wrote and,
when given, the two run reports (``specforge-kimi run-report``) of the co-located runs that trained them.

Like for like first: the pair must share the target (path and ``config.json`` hash), the prompt sets (source,
count, mean prompt tokens per set) and the generation settings (new tokens, thinking, concurrency, warm-up, TP,
CUDA graphs, attention backend); a pair that differs is refused in one line naming what differs. The EAGLE-3 file
must hold an EAGLE3 config and the block file a DFLASH one.

ONE JSON then holds: the command and environment; each side's source files, config and draft; per prompt set and
overall, each side's acceptance length (SGLang's token-weighted ``acceptance_length``, the bench's headline), the
ratio block / EAGLE-3 and its 95% bootstrap interval (``block_vs_eagle3_interval``: over prompts, paired, when both
benches kept per-prompt counters, else over verify steps; ``ratio_interval`` says how each is drawn), each side's
per-position acceptance (the share of verify steps that accepted the j-th drafted token, overall: equal first
positions and a longer tail say the block draft gains only from the positions EAGLE-3 does not propose), each side's
decode tok/s and its speedup over its baseline server (when the bench ran one, or took an earlier bench's: ``bench
--baseline-from``, so both sides can share one; ``baseline_from`` names it); from the run reports, each run's steps,
trained target tokens (SpecForge's ledger), end-to-end trained tok/s and the ratio of trained tokens (a
like-for-like training budget is the same number of target tokens); and ``goal``: the block draft's overall
acceptance length against ``--goal`` x EAGLE-3's (issue 44: 1.3), stated as met or not, and what the interval says
of it (``by_interval``: met, not met, or undecided). The numbers are read, never judged here: timing and acceptance
are results, not pass/fail.

    python bench/draft_comparison.py --eagle3 OUT_E/acceptance_tiny_eagle3_tp1_h100.json \
        --block OUT_D/acceptance_tiny_dflash_tp1_h100.json \
        --eagle3-run OUT_E/online_run_tiny_eagle3_tp1_h100.json --block-run OUT_D/online_run_tiny_dflash_tp1_h100.json \
        --out bench/results/draft_comparison_tiny_tp1_h100.json

(``scripts/gpu_tiny_compare.sh STAGE=bench`` runs it after both benches.)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the bench settings both sides must share (the rest: which draft, its config, where it wrote)
SHARED_SETTINGS = (
    "max_new_tokens",
    "thinking",
    "concurrency",
    "warmup",
    "tp",
    "attention_backend",
    "disable_cuda_graph",
    "num_prompts",
)


#: the ratio's interval: level, resamples and seed (fixed, so the same files give the same interval)
LEVEL, RESAMPLES, SEED = 0.95, 10_000, 0


class ComparisonError(ValueError):
    """A pair that cannot be compared like for like, or a file that is not a bench result (one line)."""


@dataclass(frozen=True)
class Settings:
    eagle3: Path
    block: Path
    eagle3_run: Path | None
    block_run: Path | None
    goal: float
    out: Path


def parse(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eagle3", required=True, help="the EAGLE-3 draft's bench_result.json")
    p.add_argument("--block", required=True, help="the block draft's bench_result.json (DFLASH)")
    p.add_argument("--eagle3-run", default=None, help="run-report JSON of the run that trained the EAGLE-3 draft")
    p.add_argument("--block-run", default=None, help="run-report JSON of the run that trained the block draft")
    p.add_argument("--goal", type=float, default=1.3, help="block AL / EAGLE-3 AL the comparison states (default 1.3)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if (a.eagle3_run is None) != (a.block_run is None):
        p.error("give both --eagle3-run and --block-run, or neither")
    if a.goal <= 0:
        p.error("--goal must be positive")
    return Settings(
        Path(a.eagle3), Path(a.block), a.eagle3_run and Path(a.eagle3_run), a.block_run and Path(a.block_run),
        a.goal, Path(a.out),
    )  # fmt: skip


# -- read ---------------------------------------------------------------------------------------------------------
def load(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ComparisonError(f"{what} {path}: cannot read it ({exc})") from None
    if not isinstance(doc, dict):
        raise ComparisonError(f"{what} {path}: not a JSON object")
    return doc


def spec_run(doc: dict, path: Path, algorithm: str) -> dict:
    """The bench result's first speculative run, which must be ``algorithm`` (EAGLE3 or DFLASH)."""
    if doc.get("benchmark") != "acceptance" or not isinstance(doc.get("speculative"), list) or not doc["speculative"]:
        raise ComparisonError(f"{path}: not a `specforge-kimi bench` result (no speculative runs)")
    run = doc["speculative"][0]
    found = run.get("algorithm", "EAGLE3")
    if found != algorithm:
        raise ComparisonError(f"{path}: its first config is {found}, expected {algorithm}")
    if not isinstance(run.get("overall"), dict) or not isinstance(run.get("sets"), dict):
        raise ComparisonError(f"{path}: its {algorithm} run has no overall/sets counters")
    return run


def like_for_like(e: dict, b: dict) -> None:
    """Raise ComparisonError naming the first thing the two bench results do not share."""
    te, tb = e.get("target") or {}, b.get("target") or {}
    if te.get("config_sha256") != tb.get("config_sha256") or Path(str(te.get("path"))) != Path(str(tb.get("path"))):
        raise ComparisonError(
            f"different targets: {te.get('path')} ({str(te.get('config_sha256'))[:12]}) vs "
            f"{tb.get('path')} ({str(tb.get('config_sha256'))[:12]})"
        )
    pe, pb = e.get("prompt_sets") or {}, b.get("prompt_sets") or {}
    if pe != pb:
        diff = sorted(k for k in set(pe) | set(pb) if pe.get(k) != pb.get(k))
        raise ComparisonError(f"different prompt sets: {', '.join(diff)} differ (source, count or prompt tokens)")
    se, sb = e.get("settings") or {}, b.get("settings") or {}
    for key in SHARED_SETTINGS:
        if se.get(key) != sb.get(key):
            raise ComparisonError(f"different bench settings: {key} {se.get(key)!r} vs {sb.get(key)!r}")


# -- compare ------------------------------------------------------------------------------------------------------
def _side(doc: dict, run: dict, path: Path) -> dict:
    return {
        "file": str(path),
        "algorithm": run.get("algorithm", "EAGLE3"),
        "config": run.get("config"),
        "draft": {k: (doc.get("draft") or {}).get(k) for k in ("path", "architectures")},
        "acceptance_length": run["overall"].get("acceptance_length"),
        "output_tok_per_s": run["overall"].get("output_tok_per_s"),
        "speedup": (run.get("speedup") or {}).get("overall"),
        # share of verify steps that accepted the j-th drafted token: where one family's extra length comes from
        "per_position_at_least": (run["overall"].get("per_position") or {}).get("at_least"),
        "baseline_from": ((doc.get("baseline") or {}).get("reused_from") or {}).get("path"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def per_set(e_run: dict, b_run: dict) -> dict:
    """Per prompt set: both acceptance lengths and speedups, and the block / EAGLE-3 ratio."""
    rows = {}
    for name in e_run["sets"]:
        es, bs = e_run["sets"][name], b_run["sets"].get(name) or {}
        ae, ab = es.get("acceptance_length"), bs.get("acceptance_length")
        rows[name] = {
            "eagle3_acceptance_length": ae,
            "block_acceptance_length": ab,
            "block_vs_eagle3": _ratio(ab, ae),
            "eagle3_speedup": (e_run.get("speedup") or {}).get(name),
            "block_speedup": (b_run.get("speedup") or {}).get(name),
        }
    return rows


def paired_prompts(e_run: dict, b_run: dict) -> dict[str, list[tuple[int, int, int, int]]] | None:
    """Per prompt set, per prompt: (EAGLE-3 completion tokens, its verify steps, block completion tokens, its verify
    steps), paired by prompt id; None when a side has no ``per_request`` counters (a bench before them).
    ComparisonError when both have them and the prompt ids differ or repeat (the benches did not ask the same
    prompts, whatever their sets' names and counts say)."""
    pairs: dict[str, list[tuple[int, int, int, int]]] = {}
    for name, es in e_run["sets"].items():
        er, br = es.get("per_request"), (b_run["sets"].get(name) or {}).get("per_request")
        if not isinstance(er, list) or not isinstance(br, list):
            return None
        e_ids, b_ids = [r.get("id") for r in er], [r.get("id") for r in br]
        if None in e_ids or len(set(e_ids)) != len(e_ids) or sorted(map(str, e_ids)) != sorted(map(str, b_ids)):
            raise ComparisonError(f"different prompts in set {name}: the two benches' prompt ids differ or repeat")
        by_id = {r["id"]: r for r in br}
        pairs[name] = [
            (r["completion_tokens"], r["spec_verify_ct"], by_id[r["id"]]["completion_tokens"],
             by_id[r["id"]]["spec_verify_ct"])
            for r in er
        ]  # fmt: skip
    return pairs or None


def _bootstrap_prompts(pairs: dict[str, list[tuple[int, int, int, int]]], rng) -> tuple:
    """RESAMPLES sums of (EAGLE-3 completion, verify, block completion, verify) with each set's prompts resampled
    within the set (the sets are the design: a resample keeps their sizes), both sides' prompts together."""
    import numpy as np

    total = np.zeros((RESAMPLES, 4))
    for rows in pairs.values():
        a = np.asarray(rows, dtype=float)
        total += rng.multinomial(len(a), np.full(len(a), 1 / len(a)), size=RESAMPLES) @ a
    return total, sum(len(r) for r in pairs.values())


def ratio_interval(e_run: dict, b_run: dict) -> dict | None:
    """A LEVEL interval of block / EAGLE-3 acceptance length by percentile bootstrap. Over prompts, paired (both
    benches' prompts resampled together, within each set), when both carry per-prompt counters. Otherwise over
    verify steps drawn from each side's correct-drafts histogram (acceptance_length_decode): that treats a prompt's
    steps as independent, which narrows it, and the two sides as unpaired, which widens it; likely narrower than an
    interval over prompts. A resample in which a side has no verify step has no ratio: under 99 % of them with one,
    and with either side's verify steps or tokens at 0, there is no interval (None)."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    pairs = paired_prompts(e_run, b_run)
    if pairs is not None:
        s, n_prompts = _bootstrap_prompts(pairs, rng)
        num, den = s[:, 2] * s[:, 1], s[:, 3] * s[:, 0]  # (block tokens / steps) / (EAGLE-3 tokens / steps)
        unit, n = "prompts", {"eagle3": n_prompts, "block": n_prompts}
        method = "paired bootstrap over prompts within each set; acceptance length = completion tokens / verify steps"
    else:
        hists = [r["overall"].get("correct_drafts_histogram") for r in (e_run, b_run)]
        if not all(isinstance(h, list) and sum(h) > 0 for h in hists):
            return None
        means = []
        for h in hists:  # acceptance_length_decode = 1 + accepted drafts per verify step
            p = np.asarray(h, dtype=float)
            counts = rng.multinomial(int(p.sum()), p / p.sum(), size=RESAMPLES)
            means.append(1 + counts @ np.arange(len(p)) / p.sum())
        num, den = means[1], means[0]
        unit, n = "verify steps", {"eagle3": sum(hists[0]), "block": sum(hists[1])}
        method = (
            "verify steps resampled from each side's correct-drafts histogram, acceptance_length_decode; steps "
            "treated as independent (narrows it) and the sides as unpaired (widens it): likely narrower than over "
            "prompts"
        )
    valid = (num > 0) & (den > 0)
    if valid.mean() < 0.99:
        return None
    low, high = np.quantile(num[valid] / den[valid], [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return {
        "low": float(low),
        "high": float(high),
        "level": LEVEL,
        "unit": unit,
        "n": n,
        "resamples": RESAMPLES,
        "resamples_with_a_ratio": int(valid.sum()),
        "seed": SEED,
        "method": method,
    }


def by_interval(interval: dict | None, goal: float) -> str | None:
    """What the interval says of the goal: met (it lies above), not met (below), or undecided (it holds the goal)."""
    if interval is None:
        return None
    if interval["low"] >= goal:
        return "met"
    return "not met" if interval["high"] < goal else "undecided: the interval holds the goal"


def training(report: dict, path: Path) -> dict:
    """What a run report says of the training budget: steps, trained target tokens, rate, duplicates."""
    ledger = report.get("ledger") or {}
    if not isinstance(ledger.get("trained_tokens"), int):
        raise ComparisonError(f"{path}: not a run report with a ledger (no ledger.trained_tokens)")
    perf = report.get("perf") or {}
    return {
        "file": str(path),
        "run_id": report.get("run_id"),
        "transport": report.get("transport"),
        "steps": report.get("last_step"),
        "trained_tokens": ledger["trained_tokens"],
        "duplicates": ledger.get("duplicates"),
        "end_to_end_tokens_per_s": perf.get("end_to_end_tokens_per_s"),
        "loss_last_mean": report.get("loss_last_mean"),
    }


def compare(s: Settings) -> dict:
    e, b = load(s.eagle3, "--eagle3"), load(s.block, "--block")
    e_run, b_run = spec_run(e, s.eagle3, "EAGLE3"), spec_run(b, s.block, "DFLASH")
    like_for_like(e, b)
    eagle3, block = _side(e, e_run, s.eagle3), _side(b, b_run, s.block)
    ratio = _ratio(block["acceptance_length"], eagle3["acceptance_length"])
    interval = ratio_interval(e_run, b_run)
    doc = {
        "target": {k: (e.get("target") or {}).get(k) for k in ("path", "config_sha256")},
        "prompt_sets": e.get("prompt_sets"),
        "settings": {k: (e.get("settings") or {}).get(k) for k in SHARED_SETTINGS},
        "eagle3": eagle3,
        "block": block,
        "block_vs_eagle3_acceptance_length": ratio,
        "block_vs_eagle3_interval": interval,
        "sets": per_set(e_run, b_run),
        "goal": {
            "block_vs_eagle3_at_least": s.goal,
            "met": None if ratio is None else ratio >= s.goal,  # the point estimate
            "by_interval": by_interval(interval, s.goal),
        },
    }
    if s.eagle3_run is not None and s.block_run is not None:
        te = training(load(s.eagle3_run, "--eagle3-run"), s.eagle3_run)
        tb = training(load(s.block_run, "--block-run"), s.block_run)
        doc["training"] = {
            "eagle3": te,
            "block": tb,
            "block_vs_eagle3_trained_tokens": _ratio(tb["trained_tokens"], te["trained_tokens"]),
        }
    return doc


# -- write --------------------------------------------------------------------------------------------------------
def document(argv: list[str], body: dict) -> dict:
    return {
        "bench": "draft_comparison",
        "command": [sys.executable, *argv],
        "environment": {"host": platform.node(), "python": platform.python_version()},
        **body,
    }


def write(doc: dict, out: Path) -> None:
    from specforge_kimi.durable import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(doc, indent=2) + "\n")
    e, b, r, iv = doc["eagle3"], doc["block"], doc["block_vs_eagle3_acceptance_length"], doc["block_vs_eagle3_interval"]
    span = "" if iv is None else f", {iv['level']:.0%} interval {iv['low']:.3f}-{iv['high']:.3f} over {iv['unit']}"
    by = doc["goal"]["by_interval"]
    print(
        f"EAGLE-3 {e['config']}: AL {e['acceptance_length']}; block {b['config']}: AL {b['acceptance_length']}; "
        f"block / EAGLE-3 {r if r is None else round(r, 3)}{span} (goal {doc['goal']['block_vs_eagle3_at_least']}: "
        f"{'met' if doc['goal']['met'] else 'not met'}{'' if by is None else f'; by the interval: {by}'}); wrote {out}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = parse(argv)
    from specforge_kimi.errors import KimiInputError

    try:
        write(document([str(Path(__file__).relative_to(ROOT)), *argv], compare(s)), s.out)
    except (ComparisonError, KimiInputError) as exc:  # a pair not like for like; --out a link or a directory
        print(f"draft_comparison: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
