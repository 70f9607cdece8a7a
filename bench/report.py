"""Regenerate ``bench/REPORT.md`` and ``bench/plots/*.png`` from ``bench/results/*.json``.

Usage::

    python bench/report.py                        # bench/results -> bench/REPORT.md, bench/plots/
    python bench/report.py --results DIR --out DIR/REPORT.md --plots DIR/plots

Every number in the report is read from a results file, and each section names its files. The report opens
with a headline table: the current figure per metric and its file, chosen by ``HEADLINE`` below (each metric
names its files in order of preference; the first present one is read, none present says "not measured yet").
The sections after it show the current files; the files ``SUPERSEDED`` names (superseded measurements and
failed experiments, each with its reason) and acceptance runs that failed their threshold go to an appendix at
the end: one line each with its reason, then their tables, so no number leaves the report. When a new
measurement lands, edit those two places. A file is recognised by its content:

- acceptance (``specforge-kimi bench``'s ``bench_result.json``: ``"benchmark": "acceptance"``);
- capture parity (``"test": "tests/gpu/test_capture_parity.py"``; a summary's ``target``, ``tiny`` or
  ``k25-int4`` = K2.5's width with INT4 experts, is shown on its rows);
- data preparation memory (``bench/studies/prepare_memory.py``: ``"benchmark": "prepare peak RSS vs input size"``);
- regenerate against SGLang (``tests/gpu/test_regenerate_sglang.py`` summary: ``regenerate_stdout``);
- the online teacher's memory on the CPU (``bench/studies/teacher_memory_cpu.py``: ``"benchmark": "online teacher
  memory per token x vocab entry (CPU)"``);
- one trainer rank's memory and speed at a recipe's sizes (``bench/trainer_memory.py``: ``"benchmark": "one
  trainer rank's peak memory and speed at a recipe's sizes vs recipes.memory_plan"``);
- the bench's own GPU test (``tests/gpu/test_bench_sglang.py`` summary: ``untrained_draft`` +
  ``server_info_avg_spec_accept_length``);
- online pipeline (``bench/online_pipeline.py``: ``baseline_capture_over_plain`` + ``runs``):
  capture overhead per TP and batch shape; with its ``online_run`` part (from ``specforge-kimi
  run-report``) also pipeline efficiency and per-role GPU memory peaks. Files from its CPU dry run
  (``"engine": "reference"``) are named but not tabulated: they are not measurements. A file whose
  ``config.hidden`` is K2.5's 7168 (the real-width slice) has a section of its own, capture / plain per
  transport (``runs[].transport``: ``mooncake`` or ``cuda_ipc``) and shape;
- plain prefill of a running server (``bench/prefill_depth.py``: ``"benchmark": "plain prefill of a running
  server (bench/prefill_depth.py)"``), per slice depth;
- the K2.5 sizing projection (``bench/sizing.py``'s ``sizing_k25.json``: ``depth_fit`` + ``capture`` +
  ``slice_run`` + ``recipes`` + ``torchspec``);
- tiny target pretraining (``specforge-kimi tiny --pretrain``'s ``pretrain.json``: ``corpus`` +
  ``train`` + ``heldout``), its repeatability (``bench/studies/pretrain_repro.py``: ``modes`` + ``config``) and
  the choice between candidate targets (``specforge-kimi target-text``: ``candidates`` + ``chosen``);
- online run trainer view (``specforge-kimi run-report``: ``ledger`` +
  ``metadata_bytes_per_trained_token``);
- draft evaluation (``specforge-kimi eval-draft``: ``results`` of checkpoints + ``heldout_conversations``);
- simulated acceptance on the CPU (``bench/studies/mla_vs_llama.py``, ``bench/studies/greedy_acceptance_cpu.py``);
- fault drills (``"benchmark": "fault drills"``);
- the capture sink's Mooncake put on the CPU (``bench/studies/mooncake_put_cpu.py``: ``"benchmark": "mooncake
  same-process put"``);
- a Mooncake master restart on the CPU (``bench/studies/mooncake_master_restart_cpu.py``: ``"benchmark":
  "mooncake master restart"``);
- whole-run resume drills and the soak on one H200 (``tests/gpu/test_resume_gpu.py``, ``tests/gpu/test_soak_gpu.py``:
  ``"benchmark": "whole-run resume drills (issue 26)"`` / ``"soak (issue 26)"``);
- where a capture call's time goes: ``bench/online_pipeline.py --breakdown`` shapes and
  ``bench/studies/passthrough_cpu.py`` (``"benchmark": "capture passthrough request path"``);
- draft logits parity (``tests/gpu/test_draft_logits_parity.py``'s summary: per architecture
  ``tolerance`` + ``sequences``);
- offline twin (``scripts/gpu_offline_twin.sh``'s ``offline_twin.json``: ``online`` + ``offline``);
- MLA vs Llama-style through SGLang (``scripts/gpu_mla_vs_llama.sh``'s ``mla_vs_llama_engine.json``:
  ``mla`` + ``llama``);
- two draft families side by side on one target (``bench/draft_comparison.py``: ``"bench": "draft_comparison"``):
  acceptance length of the EAGLE-3 and the block draft, their ratio against the goal, speedups, trained tokens;
- the co-located stages' three rates and each overlap option (``bench/overlap_rates.py``: ``"bench":
  "overlap_rates"``): prefill alone, trainer alone, their serial sum and ``overlap_vs_serial`` per option;
- which attention kernel's backward is right for a merged partial (``bench/cudnn_merged_backward.py``: ``"bench":
  "cudnn_merged_backward"``): each case's gradient errors against the fp32 formula, the kernels' times;
- capture overhead, pipeline efficiency, trainer memory written by anything else:
  ``{"benchmark": "capture_overhead" | "pipeline_efficiency" | "trainer_memory", "command": "...",
  "rows": [{flat key: value}, ...]}``, shown as a table of their rows.

A section with no file says "not measured yet" and what would measure it.

Files matching none of these are listed at the end, not silently dropped. Plots need matplotlib
(a dependency of specforge-kimi); nothing else outside the standard library is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
TRAINER_STEP_BENCH = "one trainer rank's peak memory and speed at a recipe's sizes vs recipes.memory_plan"
PLANNED = {
    "capture_overhead": (
        "Capture overhead",
        "throughput of the same requests with and without `spec_capture` on one server "
        "(`bench/online_pipeline.py`). Issue 4 quotes an earlier ad-hoc measurement "
        "(TP=1 64x1024 tokens 0.55x, 16x4096 0.91x; TP=2 0.79x / 0.92x) that has no results file.",
    ),
    "pipeline_efficiency": (
        "Pipeline efficiency",
        "trained tokens/s of the co-located online loop against its slowest stage "
        "(capture-only, trainer-only): `bench/online_pipeline.py --run-report` on the "
        "`specforge-kimi run-report` of an online run (issue 4b).",
    ),
    "trainer_memory": (
        "Trainer memory",
        "per-role peak GPU memory of an online run (`run-report --gpu-samples`, carried by "
        "`bench/online_pipeline.py --run-report`), against `plan.memory.memory_plan`'s estimate.",
    ),
}


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, list):
        return " / ".join(_fmt(x, 2) for x in v)
    return str(v)


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return out


# --------------------------------------------------------------------------------------------
# what is current: edit HEADLINE and SUPERSEDED when a measurement lands (bench/REPORT.md and docs/decisions/ quote the
# current figure per area, SUPERSEDED the older ones; archive/gpu-runs/RUNS.md has each run)
# --------------------------------------------------------------------------------------------
K25_HIDDEN = 7168


def _spec_run(d: dict, config: dict | None = None) -> dict:
    """The speculative run of ``config`` (the threshold's), else the first."""
    runs = d["speculative"]
    return next((r for r in runs if config and r.get("config") == config), runs[0])


def _read_acceptance(d: dict) -> str:
    th = d["threshold"]
    per = ", ".join(f"{k} {v['acceptance_length']:.3f}" for k, v in _spec_run(d, th.get("config"))["sets"].items())
    verdict = "passed" if th["passed"] else "FAILED"
    return f"**{th['acceptance_length']:.3f}** (threshold {th['min_acceptance_length']} {verdict}; {per})"


def _read_twin(d: dict) -> str:
    on, off = d["online"]["acceptance_length"], d["offline"]["acceptance_length"]
    return f"**{d['offline_vs_online_relative']:+.1%}** (offline twin {off:.3f} vs online draft {on:.3f})"


def _read_speedup(d: dict) -> str:
    run = _spec_run(d, (d.get("threshold") or {}).get("config"))
    spec, base = run["overall"]["output_tok_per_s"], d["baseline"]["overall"]["output_tok_per_s"]
    return f"**{run['speedup']['overall']:.2f}x** ({spec:.1f} vs {base:.1f} output tok/s without speculation)"


def _read_capture(d: dict) -> str:
    runs = [r for r in d["runs"] if r.get("shapes")]
    several_tp = len({r.get("tp") for r in runs}) > 1
    parts = []
    for r in runs:
        label = " ".join(
            x
            for x in (
                f"TP={r.get('tp')}" if several_tp else "",
                r.get("transport", ""),
                f"{r['put_clients']} put clients" if r.get("put_clients", 1) > 1 else "",
            )
            if x
        )
        shapes = ", ".join(
            f"{s['batch']}x{s['tokens_per_prompt']} **{s['capture_over_plain']:.2f}x**" for s in r["shapes"]
        )
        parts.append(f"{label}: {shapes}" if label else shapes)
    return "; ".join(parts)


def _read_e2e_run(d: dict) -> str:
    e, t = d["perf"]["end_to_end_tokens_per_s"], d["perf"]["trainer_only_tokens_per_s"]
    return f"**{e / t:.2f}** ({e:,.0f} trained tok/s end to end vs {t:,.0f} trainer-only)"


TRAINER_ALONE_FILE = "trainer_step_k25_b200_h200.json"
PREFILL_ALONE_FILE = "prefill_depth_k25_slice5_h200.json"


def _read_colocated_over_alone(d: dict, by_name: dict[str, dict]) -> str:
    """The co-located run's end-to-end rate over the trainer measured alone (same step, 4k, the recipe's variant)
    and over the serial sum of the two stages alone (1 / (1/prefill + 1/trainer)): how far the stages overlap."""
    e = d["perf"]["end_to_end_tokens_per_s"]
    rows = by_name[TRAINER_ALONE_FILE]["rows"]
    trainer = next(r["tokens_per_s"] for r in rows if r["variant"] == "recipe" and r["length"] == 4096)
    prefill = by_name[PREFILL_ALONE_FILE]["runs"][0]["shapes"][0]["plain_tokens_per_s"]
    serial = 1 / (1 / prefill + 1 / trainer)
    return (
        f"**{e / trainer:.2f}** of the trainer alone, **{e / serial:.2f}** of the serial sum ({e:,.0f} trained tok/s "
        f"end to end; trainer alone {trainer:,.0f} (`{TRAINER_ALONE_FILE}`), plain prefill alone {prefill:,.0f} "
        f"(`{PREFILL_ALONE_FILE}`), serial {serial:,.0f})"
    )


def _read_e2e_sizing(d: dict) -> str:
    s = d["slice_run"]
    return (
        f"**{s['end_to_end_over_slowest_stage']:.2f}** ({s['end_to_end_tokens_per_s']:,.0f} trained tok/s end to "
        f"end; plain prefill {s['slice_prefill_tokens_per_s']:,.0f}, trainer-only {s['trainer_only_tokens_per_s']:,.0f})"
    )


def _read_disk(d: dict) -> str:
    tokens = (d.get("ledger") or {}).get("trained_tokens")
    return f"**{d['metadata_bytes_per_trained_token']:.1f} B** ({_num(tokens, '{:,}')} trained tokens)"


def _read_trainer_plan(d: dict) -> str:
    rows = [r for r in d["rows"] if "error" not in r]
    ratios = [r["measured_over_plan"] for r in rows]
    slack = [r["peak_reserved_gib"] - r["peak_allocated_gib"] for r in rows]
    lengths: dict[str, list[int]] = {}
    for r in rows:
        lengths.setdefault(r["backend"], []).append(r["length"])
    what = ", ".join(f"{b} {min(v)}-{max(v)}" for b, v in lengths.items())
    return (
        f"**{min(ratios):.2f}-{max(ratios):.2f}x** peak allocated / plan ({len(rows)} lengths: {what} tokens); "
        f"reserved {min(slack):.1f}-{max(slack):.1f} GiB above allocated"
    )


def _read_projection(d: dict, recipe: str = "8xb200") -> str:
    name, r = next((n, r) for n, r in d["recipes"].items() if recipe in n)
    ts = d["torchspec"]["tokens_per_s_per_gpu"]
    per = "; ".join(
        f"{t} **{p['end_to_end_tokens_per_s_per_gpu']:,.0f}** ({p['end_to_end_tokens_per_s_per_gpu'] / ts:.2f}x)"
        for t, p in r["transports"].items()
    )
    return f"{per} tok/s per GPU ({name}, {r['gpus']}, slowest stage {r['slowest_stage']}); TorchSpec {ts:,.0f}"


class Source(NamedTuple):
    """A file a headline row may be read from: ``read(results)``, or with ``needs_index`` ``read(results, by_name)``
    (every results file by name, for a figure that divides by another file's); ``how`` says how the number is read."""

    file: str
    read: Callable[..., str]
    how: str
    needs_index: bool = False


#: The headline table, one row per metric: ``(metric, sources)``, the :class:`Source` files in order of preference.
#: The first source present in the results is read; a row whose files are all absent says "not measured yet". A
#: headline file must not be in SUPERSEDED (a test checks).
HEADLINE: list[tuple[str, list[Source]]] = [
    (
        "acceptance length",
        [
            Source(
                "acceptance_online_draft_echo_tp1_h200.json",
                _read_acceptance,
                "`threshold.acceptance_length`: SGLang's token-weighted AL at EAGLE-3 3/1/4 over the threshold's "
                "sets (64 prompts), greedy; the online-trained draft on the tiny echo-rule target, TP=1, one H200",
            )
        ],
    ),
    (
        "offline twin vs online draft (acceptance length)",
        [
            Source(
                "offline_twin_echo_tp1_h200.json",
                _read_twin,
                "`offline_vs_online_relative`: the same recipe trained by SpecForge's offline trainer on features "
                "the same capture server wrote to disk, against the online draft",
            )
        ],
    ),
    (
        "speedup",
        [
            Source(
                "acceptance_offline_twin_echo_baseline_tp1_h200.json",
                _read_speedup,
                "`speedup.overall` of the speculative run at the threshold's config: output tok/s at 3/1/4 over "
                "the same server without "
                "speculation (concurrency 4, CUDA graphs off on both); the offline twin's draft (the online "
                "draft's bench ran without a baseline)",
            )
        ],
    ),
    (
        "capture / plain prefill",
        [
            Source(
                "online_pipeline_k25_slice_h200.json",
                _read_capture,
                "`runs[].shapes[].capture_over_plain` per transport and batch: the K2.5-width slice (hidden "
                "7168, INT4 experts), TP=1, one H200, compact passthrough",
            ),
            Source(
                "online_pipeline_tp1_h200_compact_headline.json",
                _read_capture,
                "`runs[].shapes[].capture_over_plain`: through SpecForge's producer, compact passthrough, tiny "
                "random-weight target (hidden 512), TP=1, one H200; medians of 5",
            ),
        ],
    ),
    (
        "co-located / the stages alone",
        [
            Source(
                "online_run_k25_slice_shipped_h200.json",
                _read_colocated_over_alone,
                "`perf.end_to_end_tokens_per_s` of the K2.5-width slice's co-located run (cuda_ipc, the recipe as "
                "shipped, one H200) over the trainer measured alone on the same step at 4k and over the serial sum "
                "of that and plain prefill alone: the baselines a user would pick (the row below compares with "
                "rates measured inside the same run)",
                needs_index=True,
            )
        ],
    ),
    (
        "end-to-end / slowest stage",
        [
            Source(
                "sizing_k25.json",
                _read_e2e_sizing,
                "`slice_run.end_to_end_over_slowest_stage`: the K2.5-width slice's co-located run against the "
                "slower of its plain prefill and its trainer-only rate",
            ),
            Source(
                "online_run_k25_slice_cuda_ipc_h200.json",
                _read_e2e_run,
                "`perf.end_to_end_tokens_per_s` / `perf.trainer_only_tokens_per_s` (the run-report's one stage "
                "rate): the K2.5-width slice's co-located run on cuda_ipc, one H200",
            ),
            Source(
                "online_run_echo_tp1_h200.json",
                _read_e2e_run,
                "`perf.end_to_end_tokens_per_s` / `perf.trainer_only_tokens_per_s` (the trainer is the slowest "
                "stage there): co-located online run, tiny echo-rule target, TP=1, one H200",
            ),
        ],
    ),
    (
        "bytes on disk per trained token",
        [
            Source(
                "online_run_k25_slice_cuda_ipc_h200.json",
                _read_disk,
                "`metadata_bytes_per_trained_token`: the run directory besides checkpoints and export over "
                "trained tokens; the K2.5-width slice's 300-step co-located run on cuda_ipc",
            ),
            Source(
                "online_run_echo_tp1_h200.json",
                _read_disk,
                "`metadata_bytes_per_trained_token`: the run directory besides checkpoints and export over "
                "trained tokens (features live in Mooncake); tiny echo-rule target, 3,000 steps",
            ),
        ],
    ),
    (
        "trainer memory vs plan",
        [
            Source(
                "trainer_memory_k25_b200_h200.json",
                _read_trainer_plan,
                "`rows[].measured_over_plan`: one trainer rank's peak `torch.cuda` allocated memory over "
                "`plan.trainer_terms`, SpecForge's own step at the 8xB200 recipe's sizes on one H200",
            )
        ],
    ),
    (
        "projected end-to-end tok/s per GPU, 8xB200 (vs TorchSpec 1.1k)",
        [
            Source(
                "sizing_k25.json",
                _read_projection,
                "`recipes[kimi-k25-8xb200-lowered].transports[].end_to_end_tokens_per_s_per_gpu` over "
                "`torchspec.tokens_per_s_per_gpu`: a projection from the slice's measurements and the stated "
                "`assumptions` (TP efficiency, GPU speed), not a measurement",
            )
        ],
    ),
]

_ECHO_RUN = "online_run_echo_tp1_h200.json on 2026-12-01"
_ECHO_TARGET = "tiny_target_pretrain_echo_h200.json on 2026-12-01"
_ECHO_SELECT = "target_select_echo_h200.json on 2026-12-01"
_ECHO_ONLINE = "acceptance_online_draft_echo_tp1_h200.json on 2026-12-01"
_ECHO_TWIN = "acceptance_offline_twin_echo_tp1_h200.json on 2026-12-01"
_ECHO_PAIR = "offline_twin_echo_tp1_h200.json on 2026-12-01"
_ECHO_EVAL = "eval_offline_twin_echo_tp1_h200.json on 2026-12-01"
#: Files taken out of the main sections into the appendix, each with its one-line reason: a file the archived
#: notes' History names (archive/notes-2026-12-04.md) and no current Measurements paragraph cites (a file both cite stays in the main sections), and
#: failed experiments. A value ``(reason, sections)`` takes the file out of those sections only (the section ids of
#: ``_sections``). An acceptance run below its threshold goes to the appendix without an entry here; an entry adds
#: its context.
#: Named by History but kept in the main sections, because a current Measurements paragraph cites them:
#: online_pipeline_h200x2_{unpatched,patched}.json (the only TP=2 capture-overhead measurement, SpecForge's patch
#: vs our spec-capture-staging-buffer), online_run_h200x2.json (SGLang's memory outside its static pool), and
#: online_run_{4800,taps}_tp1_h200_eval_draft.json (the deep vs SGLang-default taps comparison).
SUPERSEDED: dict[str, str | tuple[str, tuple[str, ...]]] = {
    # the trainer step
    "trainer_step_fa_cudnn_k25_b200_h100.json": "a failed experiment: the fa backend on cuDNN's attention, whose "
    "backward gave wrong query/key gradients with a merged output (its GPU test failed at 4 key blocks), so its fa "
    "rows (x1.022 at 4k, x1.125 at 16k against flex) are an upper bound for a correct cuDNN path, not a result; the "
    "seam runs PyTorch's flash kernel since: trainer_step_fa_flash_k25_b200_h100_16k.json (archive/gpu-runs/RUNS.md "
    "2026-12-07 (second))",
    "trainer_step_fa_gqa_k25_b200_h100.json": "an experiment not kept: the fa-kernel seam handing cuDNN the 8 "
    "key/value heads grouped instead of repeated per query head (right on the GPU test and in "
    "cudnn_merged_backward_gqa_h100.json) measured no gain: fa 16k 1.252 s against 1.250 s with the heads repeated "
    "(trainer_step_fa_cudnn_strides_k25_b200_h100.json), 4k 0.299 against 0.301, the same peaks and losses; the seam "
    "keeps repeating them (archive/gpu-runs/RUNS.md 2026-12-07 (fifth))",
    "trainer_step_fa_gqa_k25_b200_h100_16k_run2.json": "the same experiment's second 16k run (fa 1.255 s, flex "
    "1.337 s): no gain from grouped key/value heads; not kept (archive/gpu-runs/RUNS.md 2026-12-07 (fifth))",
    # the overlap rates
    "overlap_rates_k25_slice_h100_stages.json": "its stage rates are the ones overlap_rates_k25_slice_h100.json "
    "took (--stages-from); its two launches were refused by launch's disk check (the trainer stage's 4.4 GiB "
    "stand-in target left 13.0 GB of the 15.4 a checkpoint and export need: the bench now removes it), rerun there "
    "(archive/gpu-runs/RUNS.md 2026-12-06 (fourth))",
    # acceptance through SGLang
    "acceptance_k25_slice_h200.json": "a loading-and-counting check, not a quality number: the K2.5-width slice "
    "(random weights) with a 20-step draft, served by SGLang's own EAGLE-3 (archive/gpu-runs/RUNS.md 2026-12-03 (evening))",
    "acceptance_k25_slice_dflash_h200.json": "a loading-and-counting check, not a quality number: the K2.5-width "
    "slice (random weights) with its 200-step DFlash draft, served by SGLang's own DFLASH (archive/gpu-runs/RUNS.md "
    "2026-12-05 (evening))",
    "acceptance_online_draft_h200x2.json": f"superseded by {_ECHO_ONLINE}: the TP=2 draft on corpus text (2026-11-30)",
    "acceptance_online_draft_regen_h200x2.json": f"superseded by {_ECHO_ONLINE}: the TP=2 draft on regenerated "
    "data (2026-11-30, late)",
    "acceptance_online_draft_tp1_h200.json": f"superseded by {_ECHO_ONLINE}: the first TP=1 run's draft (180 s target)",
    "acceptance_offline_twin_tp1_h200.json": f"superseded by {_ECHO_TWIN}: the first TP=1 run's twin (180 s target)",
    "acceptance_online_draft_sharp_tp1_h200.json": f"superseded by {_ECHO_ONLINE}: the bf16 target (time-bound, "
    "not rebuildable)",
    "acceptance_offline_twin_sharp_tp1_h200.json": f"superseded by {_ECHO_TWIN}: the bf16 target's twin",
    "acceptance_offline_twin_taps_tp1_h200.json": f"superseded by {_ECHO_TWIN}: the deep-taps run's twin",
    # below the 3.0 threshold (the appendix says so by itself); what each was for
    "acceptance_online_draft_taps_tp1_h200.json": "deep aux taps on the step-bounded target (2026-12-01): no "
    "measurable difference from SGLang's default taps (docs/decisions/001-target-and-adapter.md)",
    "acceptance_online_draft_4800_tp1_h200.json": "4,800 online steps on the step-bounded target (2026-12-01): the "
    "default-taps side of the deep-taps comparison",
    "acceptance_mla_offline_tp1_h200.json": "the MLA draft on the first TP=1 run's features (2026-12-01), 3.2% behind "
    "the Llama-style twin; the comparison stays current (mla_vs_llama_engine_tp1_h200.json)",
    # the same data, two drafts
    "offline_twin_tp1_h200.json": f"superseded by {_ECHO_PAIR}: the first TP=1 twin (+2.1%)",
    "offline_twin_sharp_tp1_h200.json": f"superseded by {_ECHO_PAIR}: the bf16 target's twin (+0.09%)",
    "offline_twin_taps_tp1_h200.json": f"superseded by {_ECHO_PAIR}: the deep-taps twin (-0.6%)",
    # draft evaluation
    "eval_online_vs_offline_tp1_h200.json": f"superseded by {_ECHO_EVAL}: the first TP=1 run's pair",
    "eval_online_vs_offline_sharp_tp1_h200.json": f"superseded by {_ECHO_EVAL}: the bf16 target's pair",
    "eval_online_vs_offline_taps_tp1_h200.json": f"superseded by {_ECHO_EVAL}: the deep-taps pair",
    "online_run_tp1_h200_eval_draft.json": f"superseded by {_ECHO_RUN}: the first TP=1 run (180 s target)",
    "online_run_mix_tp1_h200_eval_draft.json": f"superseded by {_ECHO_RUN}: the prompt-mix run "
    "(non-deterministic 180 s target)",
    "online_run_sharp_tp1_h200_eval_draft.json": f"superseded by {_ECHO_RUN}: the bf16 target",
    "online_run_h200x2_eval_draft.json": "superseded by online_run_regen_h200x2_eval_draft.json on 2026-11-30 "
    "(late): the TP=2 run on corpus text",
    # online runs (trainer view)
    "online_run_tp1_h200.json": f"superseded by {_ECHO_RUN}: the first TP=1 run (180 s target)",
    "online_run_mix_tp1_h200.json": f"superseded by {_ECHO_RUN}: the prompt-mix run (non-deterministic 180 s target)",
    "online_run_sharp_tp1_h200.json": f"superseded by {_ECHO_RUN}: the bf16 target",
    "online_run_4800_tp1_h200.json": f"superseded by {_ECHO_RUN}: 4,800 steps on the step-bounded target",
    "online_run_taps_tp1_h200.json": f"superseded by {_ECHO_RUN}: deep aux taps on the step-bounded target",
    # tiny targets and their selection
    "tiny_target_pretrain_h200x2.json": f"superseded by {_ECHO_TARGET}: the TP=2 corpus-text run's target",
    "tiny_target_pretrain_120s_h200x2.json": f"superseded by {_ECHO_TARGET}: the TP=2 regenerated-data run's target",
    "tiny_target_pretrain_180s_h200.json": f"superseded by {_ECHO_TARGET}: the first TP=1 run's 180 s target",
    "tiny_target_pretrain_180s_h200_mix.json": f"superseded by {_ECHO_TARGET}: the prompt-mix run's target "
    "(non-deterministic)",
    "tiny_target_pretrain_step1200_h200.json": f"superseded by {_ECHO_TARGET}: the step-bounded target",
    "tiny_target_pretrain_step1200_rebuild_h200.json": f"superseded by {_ECHO_TARGET}: the step-bounded target "
    "rebuilt for the deep-taps run",
    "tiny_target_pretrain_rules_h200.json": f"superseded by {_ECHO_TARGET}: the words-rule target (never trained on)",
    "target_select_step1200_h200.json": f"superseded by {_ECHO_SELECT}: the step-bounded target",
    "target_select_step1200_rebuild_h200.json": f"superseded by {_ECHO_SELECT}: the step-bounded target, rebuilt",
    "target_select_rules_h200.json": f"superseded by {_ECHO_SELECT}: the words-rule target",
    # draft families: the same pair, its interval added by bench/draft_comparison.py from the same files
    "draft_comparison_tiny_tp1_h100_compare1000.json": "superseded by "
    "draft_comparison_tiny_tp1_h100_compare1000_interval.json: the same acceptance files compared on the box, "
    "before the comparison had its interval",
    "draft_comparison_tiny_tp1_h100_compare1000_rerun.json": "the second bench of both drafts (no baseline): the "
    "same acceptance to the last digit (archive/gpu-runs/RUNS.md 2026-12-05 (fourth))",
    # capture overhead: the capture/plain rows only; its breakdown stays current
    "online_pipeline_tp1_h200_compact.json": (
        "superseded by online_pipeline_tp1_h200_compact_headline.json on 2026-12-01: its capture / plain rows "
        "are the producer with SpecForge's lists, before compact (its breakdown stays in the main sections)",
        ("capture_overhead",),
    ),
}


def classify(data: Any) -> str:
    """The kind of a results file (see the module docstring), ``unknown`` otherwise."""
    if not isinstance(data, dict):
        return "unknown"
    bench = data.get("benchmark")
    if bench == "acceptance":
        return "acceptance"
    if data.get("bench") in ("draft_comparison", "overlap_rates", "cudnn_merged_backward"):
        return data["bench"]
    if bench in PLANNED:
        return bench
    if bench == "prepare peak RSS vs input size":
        return "prepare_memory"
    if isinstance(bench, str) and bench.startswith("plain prefill of a running server"):
        return "prefill_depth"
    if "baseline_capture_over_plain" in data and isinstance(data.get("runs"), list):
        cfg = data.get("config") or {}
        # the K2.5 slices (runs/k25-slice*: 384 INT4 experts); the 16-expert width probes are capture-overhead files
        k25 = cfg.get("hidden") == K25_HIDDEN and "k25-slice" in str(cfg.get("target"))
        return "online_pipeline_k25" if k25 else "online_pipeline"
    if {"depth_fit", "capture", "slice_run", "recipes", "torchspec"} <= data.keys():
        return "sizing"
    if data.get("test") == "tests/gpu/test_capture_parity.py":
        return "capture_parity"
    if "regenerate_stdout" in data:
        return "regenerate"
    if "untrained_draft" in data and "server_info_avg_spec_accept_length" in data:
        return "bench_test"
    if bench == "fault drills":
        return "fault_drills"
    if bench == "online teacher memory per token x vocab entry (CPU)":
        return "teacher_memory"
    if bench == TRAINER_STEP_BENCH:
        return "trainer_step_memory"
    if bench == "mooncake same-process put":
        return "mooncake_put"
    if bench == "capture passthrough request path":
        return "passthrough_cpu"
    if bench == "mooncake master restart":
        return "mooncake_restart"
    if bench == "whole-run resume drills (issue 26)":
        return "resume_drills"
    if bench == "soak (issue 26)":
        return "soak"
    if isinstance(bench, str) and bench.startswith("MLA vs Llama-style"):
        return "mla_vs_llama"
    if isinstance(bench, str) and bench.startswith("EAGLE-3 draft acceptance on the tiny target's own greedy text"):
        return "greedy_acceptance"
    if {"corpus", "train", "heldout", "spec"} <= data.keys():
        return "tiny_target"
    if isinstance(data.get("modes"), dict) and "pretrain_repro.py" in " ".join(data.get("command") or []):
        return "pretrain_repro"
    if isinstance(data.get("candidates"), list) and "chosen" in data:
        return "target_select"
    if "ledger" in data and "metadata_bytes_per_trained_token" in data:
        return "online_run"
    if isinstance(data.get("results"), list) and "heldout_conversations" in data:
        return "eval_draft"
    if {"online", "offline"} <= data.keys() and str(data.get("command", "")).endswith("gpu_offline_twin.sh"):
        return "offline_twin"
    if {"mla", "llama"} <= data.keys() and str(data.get("command", "")).endswith("gpu_mla_vs_llama.sh"):
        return "mla_vs_llama_engine"
    if data and all(isinstance(v, dict) and {"tolerance", "returncode"} <= v.keys() for v in data.values()):
        return "draft_parity"
    return "unknown"


def load_results(results_dir: Path) -> dict[str, list[tuple[str, dict]]]:
    kinds: dict[str, list[tuple[str, dict]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            kinds.setdefault("unreadable", []).append((path.name, {"error": str(exc)}))
            continue
        kinds.setdefault(classify(data), []).append((path.name, data))
    return kinds


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------
def _describe_target(res: dict) -> str:
    t = res.get("target") or {}
    spec = t.get("tiny_spec")
    if not spec:
        return Path(t.get("path", "?")).name
    pre = t.get("pretrain") or {}
    steps = (pre.get("train") or {}).get("steps")
    return f"tiny {spec['layers']}L/{spec['hidden']}h" + (f", pretrained {steps} steps" if steps else ", random")


def _describe_draft(res: dict) -> str:
    d = res.get("draft") or {}
    name = Path(d.get("path", "?")).name
    arch = (d.get("architectures") or ["?"])[0]
    return f"{name} ({arch}, draft vocab {d.get('draft_vocab_size')})"


def _tabled(
    title: str,
    intro: str | None,
    files: list[tuple[str, dict]],
    missing: str,
    header: list[str],
    rows_of,
    tail: list[str] | None = None,
) -> list[str]:
    """The common section: ``## title``, the intro paragraph, then one table of ``rows_of(name, result)`` over
    all ``files`` (each call returns that file's rows) and ``tail`` lines, or "Not measured yet: ``missing``"."""
    out = [f"## {title}", ""] + ([intro, ""] if intro else [])
    if not files:
        return out + [f"Not measured yet: {missing}", ""]
    rows = [row for n, r in files for row in rows_of(n, r)]
    return out + _table(header, rows) + [""] + (tail or [])


def _acceptance_rows(name: str, res: dict, rows: list, bars: list, curves: list) -> None:
    """One ``bench_result.json``'s table rows, bars (AL per set) and curves (P(j)) per speculative config."""
    for run in res.get("speculative") or []:
        c = run["config"]
        label = f"{Path(name).stem} {c['steps']}/{c['topk']}/{c['draft_tokens']}"
        base = ((res.get("baseline") or {}).get("sets")) or {}
        match = run.get("output_match") or {}
        for set_name, m in run["sets"].items():
            mm = match.get(set_name)
            rows.append(
                [
                    name,
                    _describe_target(res),
                    f"{c['steps']}/{c['topk']}/{c['draft_tokens']}",
                    set_name,
                    m.get("requests"),
                    m.get("acceptance_length"),
                    m.get("acceptance_length_decode"),
                    m.get("accept_rate"),
                    (m.get("per_position") or {}).get("at_least"),
                    _num(m.get("output_tok_per_s"), "{:.1f}"),
                    _num((base.get(set_name) or {}).get("output_tok_per_s"), "{:.1f}"),
                    _num((run.get("speedup") or {}).get(set_name), "{:.2f}x"),
                    f"{mm['identical']}/{mm['identical'] + mm['different']}" if mm else None,
                ]
            )
        bars.append((label, {k: v.get("acceptance_length") for k, v in run["sets"].items()}))
        curves.append((label, (run["overall"].get("per_position") or {}).get("at_least") or []))


def _plot_acceptance(plots: Path, bars: list, curves: list) -> None:
    """plots/acceptance.png: acceptance length per prompt set, and P(position j accepted) per config."""
    plt = _plt()
    sets = sorted({k for _, b in bars for k in b})
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    w = 0.8 / max(1, len(bars))
    for i, (label, b) in enumerate(bars):
        ax[0].bar([x + i * w for x in range(len(sets))], [b.get(k) or 0 for k in sets], w, label=label)
    ax[0].set_xticks([x + w * (len(bars) - 1) / 2 for x in range(len(sets))], sets)
    ax[0].axhline(1, color="grey", lw=0.8)
    ax[0].set(ylabel="acceptance length", title="acceptance length per prompt set")
    ax[0].legend(fontsize=6)
    for label, c in curves:
        ax[1].plot(range(1, len(c) + 1), c, marker="o", label=label)
    ax[1].set(
        xlabel="draft position j",
        ylabel="P(position j accepted)",
        ylim=(0, 1.05),
        title="per-position acceptance (all sets)",
    )
    ax[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(plots / "acceptance.png", dpi=110)
    plt.close(fig)


def section_acceptance(files: list[tuple[str, dict]], plots: Path | None) -> list[str]:
    out = ["## Acceptance length through SGLang EAGLE-3", ""]
    if not files:
        return out + [
            "Not measured yet: run `specforge-kimi bench --target DIR --draft DIR` on a GPU host and copy "
            "its `bench_result.json` here.",
            "",
        ]
    out += [
        "From `specforge-kimi bench` (engine counters in `/generate` `meta_info`; definitions in each file's "
        "`metric_definitions`). AL = sum completion_tokens / sum spec_verify_ct (SGLang's spec_accept_length, "
        "token-weighted); AL decode = tokens per verify step (excludes the prefill token); P(j) = share of "
        "verify steps that accepted draft position j. Greedy.",
        "",
    ]
    rows, bars, curves = [], [], []
    for name, res in files:
        s = res.get("settings") or {}
        _acceptance_rows(name, res, rows, bars, curves)
        th = res.get("threshold")
        if th:
            out.append(
                f"- `{name}`: threshold {th['min_acceptance_length']} on {', '.join(th['sets'])} -> "
                f"{_fmt(th['acceptance_length'])}, **{'passed' if th['passed'] else 'FAILED'}**"
            )
        out.append(
            f"- `{name}`: target {_describe_target(res)}; draft {_describe_draft(res)}; "
            f"max_new_tokens {s.get('max_new_tokens')}, concurrency {s.get('concurrency')}, "
            f"TP {s.get('tp')}, attention {s.get('attention_backend')}, devices "
            f"{((res.get('environment') or {}).get('devices')) or '-'}; {res.get('date_utc')}"
        )
    out += [
        "",
        *_table(
            [
                "file",
                "target",
                "config",
                "set",
                "prompts",
                "AL",
                "AL decode",
                "accept rate",
                "P(j) j=1..",
                "tok/s",
                "tok/s no spec",
                "speedup",
                "same output",
            ],
            rows,
        ),
        "",
    ]
    if plots is None:
        return out
    _plot_acceptance(plots, bars, curves)
    return out + ["![acceptance](plots/acceptance.png)", ""]


def _online_rows(kind: str, name: str, res: dict) -> list[str]:
    """Rows of one ``bench/online_pipeline.py`` file for the section ``kind``."""
    if res.get("engine") == "reference":
        return [f"`{name}` is a CPU dry run of `bench/online_pipeline.py` (stand-in server), not a measurement.", ""]
    cmd = " ".join(res.get("command") or []) or "command not recorded"
    online = res.get("online_run") or {}
    if kind == "capture_overhead":
        rows = []
        base = res.get("baseline_capture_over_plain") or {}
        for run in res.get("runs") or []:
            # --put-clients N (> 1): the sink split its puts over N store clients (SGLang patch spec-capture-parallel-put)
            tpl = (
                f"tp{run.get('tp')}"
                + (f", {run['put_clients']} put clients" if run.get("put_clients", 1) > 1 else "")
                + (f", {run['transport']}" if run.get("transport", "mooncake") != "mooncake" else "")
            )
            if run.get("error"):
                rows.append([tpl, "-", "error: " + run["error"][:80], "-", "-", "-", "-", "-", "-"])
            for sh in run.get("shapes") or []:
                shape = f"{sh.get('batch')}x{sh.get('tokens_per_prompt')}"
                rows.append(
                    [
                        tpl,
                        shape,
                        _num(sh.get("plain_tokens_per_s"), "{:.0f}"),
                        _num(sh.get("capture_tokens_per_s"), "{:.0f}"),
                        _num(sh.get("capture_over_plain"), "{:.2f}x"),
                        _num((base.get(f"tp{run.get('tp')}") or {}).get(shape), "{:.2f}x"),
                        _num(sh.get("feature_bytes_per_token"), "{:.0f}"),
                        _num(sh.get("capture_write_gb_per_s"), "{:.2f}"),
                        _num(sh.get("read_gb_per_s"), "{:.2f}"),
                    ]
                )
                fl = sh.get("in_flight")
                if fl:  # --in-flight K: aggregate rates with K batches in flight (no baseline for this mode)
                    rows.append(
                        [
                            tpl,
                            f"{shape}, {fl.get('in_flight')} in flight",
                            _num(fl.get("plain_tokens_per_s"), "{:.0f}"),
                            _num(fl.get("capture_tokens_per_s"), "{:.0f}"),
                            _num(fl.get("capture_over_plain"), "{:.2f}x"),
                            "-",
                            "-",
                            "-",
                            "-",
                        ]
                    )
        return [
            f"`{name}` (`{cmd}`):",
            "",
            *_table(
                [
                    "TP",
                    "batch x tokens",
                    "plain prefill tok/s",
                    "capture tok/s",
                    "capture / plain",
                    "earlier baseline",
                    "feature B/token",
                    "write GB/s",
                    "read GB/s",
                ],
                rows,
            ),
            "",
        ]
    if not online:
        return [f"`{name}`: no `online_run` part (run it with `--run-report`).", ""]
    if kind == "pipeline_efficiency":
        perf = online.get("perf") or {}
        rows = [
            [k, v]
            for k, v in (
                ("end-to-end trained tok/s", perf.get("end_to_end_tokens_per_s")),
                ("trainer-only tok/s", perf.get("trainer_only_tokens_per_s")),
                ("data-wait fraction of a step", perf.get("data_wait_fraction")),
                ("slowest stage", online.get("slowest_stage")),
                ("end-to-end / slowest stage", online.get("end_to_end_over_slowest_stage")),
                ("metadata bytes per trained token", online.get("metadata_bytes_per_trained_token")),
                ("steps used (after warm-up)", perf.get("steps_used")),
            )
        ]
        return [f"`{name}` (online run `{online.get('source')}`):", "", *_table(["quantity", "value"], rows), ""]
    peaks = (online.get("gpu_memory") or {}).get("peak_mib_per_role") or {}
    if not peaks:
        return [f"`{name}`: no GPU memory samples in its `online_run`.", ""]
    return [
        f"`{name}` (online run `{online.get('source')}`, per-process samples):",
        "",
        *_table(["role", "peak MiB (max over its processes)"], [[k, v] for k, v in peaks.items()]),
        "",
    ]


def section_planned(kind: str, files: list[tuple[str, dict]], online: list[tuple[str, dict]] = ()) -> list[str]:
    title, what = PLANNED[kind]
    out = [f"## {title}", ""]
    if not files and not online:
        return out + [f"Not measured yet: {what}", ""]
    bare = []
    for name, res in online:
        if kind != "capture_overhead" and res.get("engine") != "reference" and not res.get("online_run"):
            bare.append(name)
            continue
        out += _online_rows(kind, name, res)
    if bare:
        out += [", ".join(f"`{n}`" for n in bare) + ": no `online_run` part (run them with `--run-report`).", ""]
    for name, res in files:
        rows = res.get("rows") or []
        keys = list(dict.fromkeys(k for r in rows for k in r))
        out += [
            f"`{name}` ({res.get('command', 'command not recorded')}):",
            "",
            *_table(keys, [[r.get(k) for k in keys] for r in rows]),
            "",
        ]
    return out


def section_capture_parity(files: list[tuple[str, dict]], plots: Path | None) -> list[str]:
    out = ["## Capture parity (SGLang spec-capture vs fp32 transformers reference)", ""]
    if not files:
        return out + ["Not measured yet: `tests/gpu/test_capture_parity.py --run-gpu`.", ""]
    out += [
        "Target `tiny`: the tiny K2.5 (hidden 512, bf16 experts); `k25-int4` "
        "(`SPECFORGE_KIMI_PARITY_TARGET=k25-int4`): K2.5's width with its INT4 routed experts, fewer layers.",
        "",
    ]
    rows, series = [], []
    for name, res in files:
        spec = res.get("tiny_spec") or {}
        target = f"{res.get('target', 'tiny')} {spec.get('layers')}L/{spec.get('hidden')}h"
        for label, run in (res.get("runs") or {}).items():
            w = run.get("worst") or {}
            aux = [v for k, v in w.items() if k.startswith("aux")]
            last = w.get("last") or {}
            cos_aux = min((a["cos_min"] for a in aux), default=None)
            rel_aux = max((a["rel_max"] for a in aux), default=None)
            margin = min(
                [a["margin_min"] for a in aux] + ([last["margin_min"]] if "margin_min" in last else []), default=None
            )
            rows.append(
                [
                    name,
                    target,
                    label,
                    run.get("status"),
                    _num(run.get("startup_s"), "{:.0f}"),
                    _num(cos_aux, "{:.5f}"),
                    _num(last.get("cos_min"), "{:.5f}"),
                    _num(rel_aux, "{:.2%}"),
                    _num(last.get("rel_max"), "{:.2%}"),
                    _num(margin, "{:.0f}x"),
                ]
            )
            if run.get("by_length"):
                series.append(
                    (
                        f"{label} ({Path(name).stem[-12:]})",
                        [b["tokens"] for b in run["by_length"]],
                        [
                            max(v["rel_max"] for k, v in b.items() if isinstance(v, dict) and "rel_max" in v)
                            for b in run["by_length"]
                        ],
                    )
                )
    out += [
        f"Files: {', '.join('`' + n + '`' for n, _ in files)}; GPUs: "
        f"{', '.join(sorted({str(g) for _, r in files for g in (r.get('gpus') or [])})) or '-'}.",
        "",
        *_table(
            [
                "file",
                "target",
                "run",
                "status",
                "startup s",
                "per-token cos min aux",
                "cos min last",
                "rel. Frobenius max aux",
                "rel max last",
                "layer-identity margin min",
            ],
            rows,
        ),
        "",
    ]
    if series and plots is not None:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for label, xs, ys in series:
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(
            xlabel="prompt length bucket",
            ylabel="max relative Frobenius error",
            title="captured features vs fp32 reference, by length",
        )
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(plots / "capture_parity.png", dpi=110)
        plt.close(fig)
        out += ["![capture parity](plots/capture_parity.png)", ""]
    return out


def section_prepare_memory(files: list[tuple[str, dict]], plots: Path | None) -> list[str]:
    out = ["## Data preparation memory (`specforge-kimi prepare`)", ""]
    if not files:
        return out + ["Not measured yet: `python bench/studies/prepare_memory.py`.", ""]
    plt = _plt() if plots is not None else None
    fig, ax = plt.subplots(figsize=(6.5, 3.5)) if plt else (None, None)
    for name, res in files:
        runs = res.get("runs") or []
        out += [
            f"`{name}`: `{res.get('script')}`, {res.get('measured_at')}, "
            f"{(res.get('environment') or {}).get('cpu_count')} CPUs.",
            "",
            *_table(
                ["rows", "input MiB", "shuffle", "peak RSS MiB", "streaming peak MiB", "wall s"],
                [
                    [
                        r["rows_in"],
                        _num(r["input_bytes"] / 2**20, "{:.1f}"),
                        r["shuffle"],
                        _num(r["peak_rss_mib"], "{:.1f}"),
                        _num(r.get("peak_rss_mib_before_vocab_mapping"), "{:.1f}"),
                        _num(r["wall_s"], "{:.1f}"),
                    ]
                    for r in runs
                ],
            ),
            "",
        ]
        for shuffle in (True, False) if ax else ():
            rs = [r for r in runs if r["shuffle"] == shuffle]
            ax.plot(
                [r["rows_in"] for r in rs],
                [r["peak_rss_mib"] for r in rs],
                marker="o",
                label=f"peak RSS, shuffle={shuffle}",
            )
            ax.plot(
                [r["rows_in"] for r in rs],
                [r.get("peak_rss_mib_before_vocab_mapping") for r in rs],
                marker=".",
                ls="--",
                label=f"streaming peak, shuffle={shuffle}",
            )
    if plt is None:
        return out
    ax.set(xscale="log", xlabel="rows", ylabel="MiB", title="prepare peak memory vs input size")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(plots / "prepare_memory.png", dpi=110)
    plt.close(fig)
    return out + ["![prepare memory](plots/prepare_memory.png)", ""]


def section_regenerate(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        pre = r.get("pretrain") or {}
        return [
            [
                n,
                r.get("rows"),
                _num(r.get("wall_s"), "{:.1f}"),
                pre.get("steps"),
                pre.get("loss_first"),
                pre.get("loss_last"),
            ]
        ]

    return _tabled(
        "Regenerate against SGLang",
        None,
        files,
        "`tests/gpu/test_regenerate_sglang.py --run-gpu`.",
        ["file", "rows written", "wall s", "target pretrain steps", "target loss first", "target loss last"],
        rows,
    )


def section_bench_test(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        out = []
        for name, st in (r.get("sets") or {}).items():
            match = (r.get("output_match") or {}).get(name) or {}
            same = f"{match['identical']}/{match['identical'] + match['different']}" if match else "-"
            out.append(
                [
                    n,
                    "untrained" if r.get("untrained_draft") else "given",
                    name,
                    _num(st.get("acceptance_length"), "{:.3f}"),
                    _num(st.get("output_tok_per_s"), "{:.1f}"),
                    _num((r.get("baseline_tok_per_s") or {}).get(name), "{:.1f}"),
                    _num((r.get("speedup") or {}).get(name), "{:.2f}x"),
                    same,
                ]
            )
        return out

    return _tabled(
        "The bench's GPU test",
        "`tests/gpu/test_bench_sglang.py`: `specforge-kimi bench` through SGLang EAGLE-3 at 3/1/4 with the "
        "baseline, on a target pretrained in the test; an untrained draft sits near 1 by design (the test "
        "checks the result's fields and the engine's counters, not a draft).",
        files,
        "`tests/gpu/test_bench_sglang.py --run-gpu`.",
        ["file", "draft", "set", "acceptance length", "tok/s", "baseline tok/s", "speedup", "identical outputs"],
        rows,
    )


def section_teacher_memory(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        return [
            [
                n,
                (r.get("config") or {}).get("vocab"),
                row.get("L"),
                _num(row.get("peak_above_baseline_bytes", 0) / 2**30, "{:.3f}"),
                _num(row.get("bytes_per_token_vocab"), "{:.2f}"),
                _num(r.get("slope_bytes_per_token_vocab"), "{:.2f}"),
                r.get("plan_bytes_per_token_vocab"),
            ]
            for row in r.get("rows") or []
        ]

    return _tabled(
        "Online teacher memory (CPU)",
        "`bench/studies/teacher_memory_cpu.py`: peak resident memory of SpecForge's online teacher (full bf16 "
        "logits, then `_compute_target_p_padded`) above the inputs, per sample length; the slope over L x V "
        "is what `plan.memory.memory_plan` charges per token and vocab entry.",
        files,
        "`python bench/studies/teacher_memory_cpu.py`.",
        ["file", "vocab", "L", "peak above inputs GiB", "B per L x V", "fitted slope B", "plan B"],
        rows,
    )


def section_trainer_step_memory(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        gpu = (r.get("environment") or {}).get("gpu") or "cpu"
        ranks = (r.get("config") or {}).get("world_size")
        cap = (r.get("config") or {}).get("memory_cap_gib")
        return [
            [
                n,
                gpu,
                ranks,
                row.get("backend"),
                row.get("length"),
                row.get("variant", "specforge"),
                feed,
                "error: " + row["error"][:60],
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
            ]
            if "error" in row
            else [
                n,
                gpu,
                ranks,
                row.get("backend"),
                row.get("length"),
                row.get("variant", "specforge"),
                feed,
                _num(row.get("peak_allocated_gib"), "{:.2f}"),
                _num(row.get("peak_reserved_gib"), "{:.2f}"),
                _num(row.get("plan_gib"), "{:.2f}"),
                _num(row.get("measured_over_plan"), "{:.2f}x"),
                _num(row.get("median_step_s_after_first"), "{:.3f}"),
                _num(row.get("tokens_per_s"), "{:.0f}"),
                f"{row['mfu']:.3f} / {row['mfu_vs_measured_gemm']:.3f}" if "mfu_vs_measured_gemm" in row else "-",
            ]
            for row in r.get("rows") or []
            for feed in [row.get("feed", "host") + (f", cap {cap:g} GiB" if cap else "")]
        ]

    return _tabled(
        "One trainer rank at a recipe's sizes",
        "`bench/trainer_memory.py`: SpecForge's own online consumer step (model bundle, FSDP backend, BF16 "
        "optimizer, eagle3 strategy) at a recipe's draft and target sizes, on 1 or N ranks of one host, "
        "capture-shaped batches held in memory; peak `torch.cuda` allocated and reserved memory per sample length against "
        "`plan.trainer_terms` (the memory plan without its reserve), and the step time after the first "
        "(tok/s: all ranks' tokens over the slowest rank's step). Step: the variant's trainer step (`specforge`: "
        "SpecForge's own; `recipe`: what the recipes ship, `trainer.step_empty_cache: false`, `fused_adamw: true`); "
        "feed: where the batch waits (`host`: pageable host memory, copied inside the step; `cuda`: already on the "
        "GPU, as both transports hand it over; `cap G GiB`: the allocator capped at G GiB, `--memory-cap-gib`, the room a co-located server leaves); MFU: useful FLOPs (`training.step_flops`) over 989 TFLOP/s (the "
        "H200's dense bf16 figure) / over the GEMM rate the same box measured.",
        files,
        "`python bench/trainer_memory.py` on a GPU.",
        [
            "file",
            "device",
            "ranks",
            "attention",
            "tokens",
            "step",
            "feed",
            "peak allocated GiB (max over ranks)",
            "peak reserved GiB",
            "plan GiB",
            "allocated / plan",
            "step s",
            "tok/s",
            "MFU (989 / measured GEMM)",
        ],
        rows,
    )


def section_tiny_targets(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        tr, h, sp = r["train"], r["heldout"], r["spec"]
        return [
            [
                n,
                f"{sp.get('layers')}L/{sp.get('hidden')}h",
                r.get("device"),
                tr.get("steps"),
                _num(tr.get("seconds"), "{:.0f}"),
                tr.get("batch_size"),
                tr.get("loss", "corpus"),
                f"{_fmt(tr.get('loss_first'))} -> {_fmt(tr.get('loss_last'))}",
                h.get("loss"),
                h.get("loss_corpus_tokens"),
                h.get("greedy_accuracy"),
            ]
        ]

    return _tabled(
        "Tiny targets",
        "`specforge-kimi tiny --pretrain` on the structured corpus. Held-out numbers are on the answer "
        "tokens of the `structured` prompt set's conversations; greedy accuracy is the full-vocabulary "
        "argmax (what SGLang decodes).",
        files,
        "`specforge-kimi tiny OUT --pretrain SECONDS`.",
        [
            "file",
            "target",
            "device",
            "steps",
            "s",
            "batch",
            "training loss",
            "loss first -> last",
            "held-out loss (full vocab)",
            "held-out loss (corpus tokens)",
            "greedy acc",
        ],
        rows,
    )


def section_target_select(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        out = []
        for c in r["candidates"]:
            pre, g = c.get("pretrain") or {}, c.get("groups") or {}
            out.append(
                [
                    n,
                    pre.get("seed"),
                    pre.get("steps"),
                    pre.get("heldout_greedy_accuracy"),
                    c.get("mean_entropy"),
                    (g.get("corpus") or {}).get("mean_entropy"),
                    (g.get("prompt_mix") or {}).get("mean_entropy"),
                    c.get("mean_top1_probability"),
                    "yes" if c.get("target") == r.get("chosen") else "",
                ]
            )
        return out

    return _tabled(
        "Choosing the tiny target",
        "`specforge-kimi target-text`: entropy of each candidate's next-token distribution along its own "
        "greedy text on selection prompts (no bench prompt); the lowest is kept.",
        files,
        '`TARGET_SEEDS="0 1" STAGE=target bash scripts/gpu_online_run.sh`.',
        ["file", "seed", "steps", "held-out greedy acc", "entropy (all)", "corpus", "prompt mix", "top-1 p", "kept"],
        rows,
    )


def section_pretrain_repro(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        out = []
        for mode, m in r["modes"].items():
            runs = m.get("runs") or []
            out.append(
                [
                    n,
                    r.get("git_commit") or "-",
                    (r.get("environment") or {}).get("device"),
                    mode,
                    " / ".join(str(x.get("steps")) for x in runs),
                    " / ".join(_fmt(x.get("heldout_loss")) for x in runs),
                    " / ".join(_fmt(x.get("heldout_greedy_accuracy")) for x in runs),
                    m.get("first_differing_step"),
                    m.get("max_abs_weight_diff"),
                ]
            )
        return out

    return _tabled(
        "Tiny target repeatability",
        "`bench/studies/pretrain_repro.py`: the same step-bounded pretraining twice per mode on one device.",
        files,
        "`python bench/studies/pretrain_repro.py --steps 300 --device cuda --out ...`.",
        [
            "file",
            "commit",
            "device",
            "mode",
            "steps",
            "held-out loss",
            "held-out greedy acc",
            "first differing step",
            "max weight difference",
        ],
        rows,
        tail=[f"`{n}`: {r['note']}" for n, r in files if r.get("note")] + [""],
    )


def section_online_runs(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        led, perf, acc = r.get("ledger") or {}, r.get("perf") or {}, r.get("acc_last_mean") or {}
        return [
            [
                n,
                r.get("last_step"),
                led.get("acked_unique"),
                led.get("duplicates"),
                led.get("trained_tokens"),
                f"{_fmt(r.get('loss_first_mean'))} -> {_fmt(r.get('loss_last_mean'))}",
                " / ".join(f"{acc[k]:.2f}" for k in sorted(acc)),
                _num(r.get("metadata_bytes_per_trained_token"), "{:.1f}"),
                _num(perf.get("end_to_end_tokens_per_s"), "{:.0f}"),
                _num(perf.get("trainer_only_tokens_per_s"), "{:.0f}"),
            ]
        ]

    return _tabled(
        "Online runs (trainer view)",
        "`specforge-kimi run-report` of a co-located run: SpecForge's ledger, disk bytes besides "
        "checkpoints, median step performance after warm-up.",
        files,
        "`scripts/gpu_online_run.sh` on the GPU box.",
        [
            "file",
            "steps",
            "samples (unique)",
            "duplicates",
            "trained tokens",
            "train loss",
            "train acc per TTT position",
            "metadata B/token",
            "end-to-end tok/s",
            "trainer-only tok/s",
        ],
        rows,
    )


def section_eval_draft(files: list[tuple[str, dict]]) -> list[str]:
    out = [
        "## Draft evaluation (simulated acceptance)",
        "",
        "`specforge-kimi eval-draft`: chain drafting, top-1, greedy verification on held-out captured "
        "features; every-position average and, where recorded, over decode rounds as the engine takes them. "
        "Estimates; the engine's number is in the acceptance section.",
        "",
    ]
    if not files:
        return out + ["Not measured yet.", ""]
    rows = []
    for n, r in files:
        held = r.get("heldout_file") or f"corpus seed {r.get('heldout_seed')}"
        for c in r["results"]:
            rows.append(
                [
                    n,
                    Path(str(c.get("checkpoint"))).name,
                    held,
                    c.get("mean_acceptance_length"),
                    c.get("serving_acceptance_length"),
                    c.get("heldout_loss"),
                    c.get("teacher_entropy"),
                ]
            )
    out += _table(
        [
            "file",
            "checkpoint",
            "held-out set",
            "AL every position",
            "AL decode rounds",
            "held-out loss",
            "teacher entropy",
        ],
        rows,
    ) + [""]
    groups = [
        [
            n,
            Path(str(c.get("checkpoint"))).name,
            g,
            v.get("samples"),
            v.get("serving_acceptance_length"),
            v.get("heldout_loss"),
            v.get("teacher_entropy"),
        ]
        for n, r in files
        for c in r["results"]
        for g, v in (c.get("by_group") or {}).items()
    ]
    if groups:
        out += [
            "Per held-out group (the bench's sets: `corpus` = structured, `prompt_mix/*` = chat, math, code):",
            "",
            *_table(
                ["file", "checkpoint", "group", "samples", "AL decode rounds", "held-out loss", "teacher entropy"],
                groups,
            ),
            "",
        ]
    return out


def section_cpu_simulated(mla: list[tuple[str, dict]], greedy: list[tuple[str, dict]]) -> list[str]:
    out = [
        "## Simulated acceptance on the CPU",
        "",
        "Demo-sized tiny target, fp32, SpecForge's own trainer in process. They rank settings; they are no "
        "engine measurement.",
        "",
    ]
    if not mla and not greedy:
        return out + [
            "Not measured yet: `python bench/studies/greedy_acceptance_cpu.py`, `python bench/studies/mla_vs_llama.py`.",
            "",
        ]
    for n, r in greedy:
        st = r.get("settings", {})
        out += [
            f"`{n}` (`bench/studies/greedy_acceptance_cpu.py`): held-out answers regenerated greedily by the target; "
            f"target pretrained {st.get('pretrain_steps')} steps.",
            "",
        ]
        per_set = any(c.get("per_set") for c in r["configs"])
        out += _table(
            [
                "target loss",
                "draft",
                "draft vocab",
                "draft steps",
                "AL decode rounds",
                "at least 1 / 2 / 3",
                "AL every position",
                "teacher entropy",
                "held-out loss",
                "train acc per TTT position",
            ]
            + (["prompt-mix rows", "decode-round AL per set"] if per_set else []),
            [
                [
                    c["target_loss"],
                    c.get("draft", "llama"),
                    c["draft_vocab_size"],
                    c.get("steps", st.get("steps")),
                    c["decode_round_acceptance_length"],
                    " / ".join(f"{x:.2f}" for x in c["decode_round_at_least"]),
                    c["every_position_acceptance_length"],
                    c["teacher_entropy"],
                    c["heldout_loss"],
                    " / ".join(f"{x:.2f}" for x in c["train_acc_per_position_last"]),
                ]
                + (
                    [
                        c.get("mix", 0),
                        ", ".join(
                            f"{k} {v['decode_round_acceptance_length']:.2f}"
                            for k, v in (c.get("per_set") or {}).items()
                        ),
                    ]
                    if per_set
                    else []
                )
                for c in r["configs"]
            ],
        )
        out.append("")
    for n, r in mla:
        out += [f"`{n}` (`bench/studies/mla_vs_llama.py`): same features, steps and seed for both drafts.", ""]
        out += _table(
            ["draft", "trainable params", "AL before", "AL after", "held-out loss after", "KL after"],
            [
                [
                    d,
                    v["parameters"]["trainable"],
                    v["before"]["mean_acceptance_length"],
                    v["after"]["mean_acceptance_length"],
                    v["after"]["heldout_loss"],
                    v["after"].get("kl"),
                ]
                for d, v in r["drafts"].items()
            ],
        )
        out.append("")
    return out


def _fault_outcomes(r: dict) -> list[dict]:
    """A fault-drill file's outcomes: a list (``fault_drills_h200x2.json``) or by drill name
    (``fault_drills_tp<TP>_h200.json``)."""
    drills = r.get("drills") or []
    return list(drills.values()) if isinstance(drills, dict) else list(drills)


def section_fault_drills(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        return [
            [
                n,
                d.get("drill"),
                f"{d.get('tp')} / {d.get('trainer_ranks')}",
                d.get("rc"),
                _num(d.get("stop_s"), "{:.0f}"),
                d.get("prompts"),
                d.get("acked"),
                d.get("duplicates"),
                d.get("processes_left"),
            ]
            for d in _fault_outcomes(r)
        ]

    return _tabled(
        "Fault drills",
        "`tests/gpu/test_faults_gpu.py`; lost and duplicated samples from SpecForge's ledger.",
        files,
        "`tests/gpu/test_faults_gpu.py --run-gpu`.",
        [
            "file",
            "drill",
            "TP / trainer ranks",
            "rc",
            "s to run end",
            "prompts",
            "acked",
            "duplicates",
            "processes left",
        ],
        rows,
    )


def section_draft_comparison(files: list[tuple[str, dict]]) -> list[str]:
    def cfg(side: dict) -> str:
        c = side.get("config") or {}
        if side.get("algorithm") == "DFLASH":
            return f"DFLASH block {c.get('draft_tokens')}"
        return f"EAGLE3 {c.get('steps')}/{c.get('topk')}/{c.get('draft_tokens')}"

    def rows(n, r):
        e, b, goal = r.get("eagle3") or {}, r.get("block") or {}, r.get("goal") or {}
        tokens = (r.get("training") or {}).get("block_vs_eagle3_trained_tokens")
        met = {True: "met", False: "not met"}.get(goal.get("met"), "-")
        iv = r.get("block_vs_eagle3_interval")
        if iv:
            k = iv.get("n") or {}
            count = k.get("eagle3") if k.get("eagle3") == k.get("block") else f"{k.get('eagle3')} / {k.get('block')}"
            level = f"{iv['level']:.0%}" if isinstance(iv.get("level"), float) else "?"
            span = f"{_fmt(iv['low'], 2)}-{_fmt(iv['high'], 2)} ({level}, {count} {iv['unit']})"
        else:
            span = "-"
        by = goal.get("by_interval")
        return [
            [
                n,
                cfg(e),
                _fmt(e.get("acceptance_length")),
                cfg(b),
                _fmt(b.get("acceptance_length")),
                f"**{_fmt(r.get('block_vs_eagle3_acceptance_length'))}**",
                span,
                f"{goal.get('block_vs_eagle3_at_least')}x: {met}" + (f"; by the interval {by}" if by else ""),
                f"{_fmt(e.get('speedup'), 2)} / {_fmt(b.get('speedup'), 2)}",
                _fmt(tokens),
            ]
        ]

    return _tabled(
        "Draft families side by side",
        "`bench/draft_comparison.py`: an EAGLE-3 draft and a block draft (DFlash) trained co-located on the same "
        "target and data, served by SGLang on the same prompts and settings (checked), SGLang's token-weighted "
        "acceptance length each and block / EAGLE-3 with its bootstrap interval (over prompts, paired, when both "
        "benches kept per-prompt counters; else over verify steps from the histograms, of the decode acceptance "
        "length, likely narrower than over prompts: bench/draft_comparison.py ratio_interval); speedup over each "
        "bench's own baseline server; trained target tokens block / EAGLE-3 from the two run reports.",
        files,
        "`scripts/gpu_tiny_compare.sh` (STAGE=launch, then STAGE=bench) on the tiny target and data of "
        "`scripts/gpu_online_run.sh` STAGE=target and STAGE=data.",
        [
            "file",
            "EAGLE-3",
            "AL",
            "block draft",
            "AL",
            "block / EAGLE-3",
            "interval",
            "goal",
            "speedup E / B",
            "tokens B / E",
        ],
        rows,
    )


def _overlap_model():
    """``specforge_kimi.plan.overlap`` (the co-located overlap model), with this checkout's ``src/`` on ``sys.path``
    (the script runs from a checkout without an install)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from specforge_kimi.plan import overlap

    return overlap


def section_overlap_rates(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        p, t = (r.get("prefill_alone") or {}).get("tokens_per_s"), (r.get("trainer_alone") or {}).get("tokens_per_s")
        name = f"{n} (dry run: canned)" if r.get("dry_run") else n
        return [
            [
                name,
                row.get("option"),
                _num(p, "{:,.0f}"),
                _num(t, "{:,.0f}"),
                _num(r.get("serial_tokens_per_s"), "{:,.0f}"),
                _num(row.get("colocated_tokens_per_s"), "{:,.0f}"),
                _num(row.get("trainer_only_tokens_per_s"), "{:,.0f}"),
                f"**{_fmt(row.get('overlap_vs_serial'))}**" if row.get("overlap_vs_serial") else row.get("error", "-"),
                _num(_hidden(row.get("colocated_tokens_per_s"), p, t), "{:+.2f}"),
                _num(_ceiling(p, t, r.get("serial_tokens_per_s")), "{:.3f}"),
            ]
            for row in r.get("rows") or []
        ]

    def _hidden(rate, p, t):  # the shorter stage's time per token hidden (sizing's overlap_hidden_fraction)
        return _overlap_model().hidden_fraction(rate, p, t) if rate and p and t else None

    def _ceiling(p, t, serial):  # overlap_vs_serial with the shorter stage wholly hidden
        return _overlap_model().ceiling_rate(p, t) / serial if p and t and serial else None

    return _tabled(
        "Co-located stages: the three rates and the overlap options",
        "`bench/overlap_rates.py`: the capture server's prefill alone, the trainer alone on the recipe's batches, "
        "their serial sum 1 / (1/prefill + 1/trainer) (the two taking turns on the GPU), and one co-located run per "
        "`overlap:` option; `overlap_vs_serial` = co-located / serial (1.0: they take turns). \"trainer in the run\" "
        "is the co-located run's own trainer-only rate (its step time without the data wait): against the trainer "
        "alone it shows how much the shared GPU slowed the step itself. \"hidden\" is the shorter stage's time per "
        "token the co-located run hid (0: they take turns, 1: wholly hidden; sizing's overlap_hidden_fraction); "
        "\"ceiling\" the overlap_vs_serial that wholly hiding it would give. A launch that failed shows its error.",
        files,
        "`python bench/overlap_rates.py --recipe recipes/kimi-k25-slice-h200.yaml --out "
        "bench/results/overlap_rates_k25_slice_h200.json` (its docstring has the options).",
        ["file", "option", "prefill alone tok/s", "trainer alone tok/s", "serial tok/s", "co-located tok/s",
         "trainer in the run tok/s", "overlap_vs_serial", "hidden", "ceiling"],
        rows,
    )  # fmt: skip


def section_cudnn_merged_backward(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        env = r.get("environment") or {}
        times = {t.get("length"): t for t in r.get("timing") or []}
        return [
            [
                n,
                env.get("device"),
                env.get("cudnn"),
                c.get("case"),
                f"refused: {c['refused']}" if c.get("refused") else ("right" if c.get("right") else "**wrong**"),
                " / ".join(_num(c.get(f"{g}_max_abs"), "{:.3f}") for g in ("dq", "dk", "dv")),
                _num(c.get("ref_max_abs"), "{:.2f}"),
            ]
            for c in r.get("cases") or []
        ] + [
            [n, env.get("device"), env.get("cudnn"), f"time at {s} tokens, 56 heads", "-",
             f"fwd flash {_num(t.get('flash_fwd_ms'), '{:.2f}')} / cuDNN {_num(t.get('cudnn_fwd_ms'), '{:.2f}')} ms; "
             f"bwd flash {_num(t.get('flash_bwd_ms'), '{:.2f}')} / cuDNN {_num(t.get('cudnn_bwd_ms'), '{:.2f}')} ms",
             "-"]
            for s, t in times.items()
        ]  # fmt: skip

    return _tabled(
        "Attention backward of a merged partial (the fa-kernel seam's kernel)",
        "`bench/cudnn_merged_backward.py`: PyTorch's flash and cuDNN attention backwards handed a causal block's output "
        "merged with one more key per row (and the merged log-sum-exp), against the fp32 split-softmax formula; "
        "cuDNN's backward graph is cached by q/k/v shapes and strides only, so the cases vary the output's layout and "
        "the call order. Errors are max abs of dq / dk / dv; a case is right within the file's tolerance.",
        files,
        "`python bench/cudnn_merged_backward.py --out bench/results/cudnn_merged_backward_<gpu>.json --time`",
        ["file", "device", "cuDNN", "case", "verdict", "dq / dk / dv max abs error", "largest reference gradient"],
        rows,
    )


def section_mooncake_put(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        cfg, gil = r.get("config") or {}, [g.get("main_thread_progress") for g in r.get("gil") or []]
        return [
            [
                n,
                (r.get("environment") or {}).get("cpu_count"),
                _num((cfg.get("batch_bytes") or 0) / 1e6, "{:.0f}"),
                t,
                v.get("median_ms"),
                v.get("GB_per_s"),
                " / ".join(f"{g:.2f}" for g in gil if g is not None),
            ]
            for t, v in (r.get("threads") or {}).items()
        ]

    return _tabled(
        "The capture sink's Mooncake put, segment in the putting process (CPU)",
        "`bench/studies/mooncake_put_cpu.py`: one batch's `batch_put_from` (median over repetitions after the "
        "first) issued from T threads, and how far a Python loop in another thread gets during the put "
        "(1: the GIL is released).",
        files,
        "`python bench/studies/mooncake_put_cpu.py --out bench/results/mooncake_put_cpu.json`.",
        ["file", "CPUs", "batch MB", "threads", "median ms", "GB/s", "other thread's progress"],
        rows,
    )


def section_mooncake_restart(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        m = r.get("summary") or {}
        return [
            [
                n,
                (r.get("environment") or {}).get("mooncake"),
                r.get("down_s"),
                m.get("down_put_s"),
                m.get("master_restart_listen_s"),
                m.get("first_put_after_restart_s"),
                m.get("pre_kill_object_exists_after_restart"),
                m.get("pre_kill_object_get_after_restart_rc"),
            ]
        ]

    return _tabled(
        "Mooncake master restart (CPU)",
        "`bench/studies/mooncake_master_restart_cpu.py`: the master SIGKILLed and started again on its ports; the "
        "clients re-mount by themselves, but the objects put before are gone.",
        files,
        "`python bench/studies/mooncake_master_restart_cpu.py --out bench/results/mooncake_master_restart_cpu.json`.",
        [
            "file",
            "mooncake",
            "down s",
            "put while down s",
            "restart listen s",
            "first put after s",
            "old exists",
            "old get rc",
        ],
        rows,
    )


def section_resume(drills: list[tuple[str, dict]], soaks: list[tuple[str, dict]]) -> list[str]:
    def drill_rows(n, r):
        out = []
        for name, d in (r.get("drills") or {}).items():
            for a in d.get("attempts") or []:
                out.append(
                    [
                        n,
                        name,
                        a.get("attempt"),
                        a.get("resumed_from_step"),
                        a.get("ledger_step_before"),
                        a.get("recaptured_acked"),
                        d.get("lost"),
                        d.get("duplicates"),
                        a.get("time_to_first_resumed_step_s") or d.get("time_to_first_resumed_step_s"),
                        d.get("stop_s"),
                    ]
                )
        return out

    def soak_rows(n, r):
        return [
            [
                n,
                r.get("steps"),
                name,
                _num(v.get("median"), "{:.4g}"),
                _num(v.get("rise"), "{:.4g}"),
                _num(v.get("bound"), "{:.4g}"),
                v.get("flat"),
            ]
            for name, v in sorted((r.get("verdicts") or {}).items())
        ]

    return _tabled(
        "Whole-run resume drills",
        "`tests/gpu/test_resume_gpu.py`: every process group SIGKILLed (or the Mooncake master), then `--resume`; "
        "lost / duplicated from SpecForge's ledger; time from the kill to the resumed attempt's first step.",
        drills,
        "`python3 -m pytest tests/gpu/test_resume_gpu.py --run-gpu` on one H200.",
        [
            "file",
            "drill",
            "attempt",
            "from step",
            "ledger step",
            "captured again",
            "lost",
            "duplicated",
            "kill -> step s",
            "stop s",
        ],
        drill_rows,
    ) + _tabled(
        "Soak",
        "`tests/gpu/test_soak_gpu.py`: each series' rise (median of the last third minus the first, after warm-up) "
        "against its bound (`tests/soak.py`).",
        soaks,
        "`python3 -m pytest tests/gpu/test_soak_gpu.py --run-gpu` on one H200.",
        ["file", "steps", "series", "median", "rise", "bound", "flat"],
        soak_rows,
    )


def section_capture_time(pipelines: list[tuple[str, dict]], cpu: list[tuple[str, dict]]) -> list[str]:
    out = [
        "## Where a capture call's time goes",
        "",
        "`bench/online_pipeline.py --breakdown`: the producer's `/generate` body in variants posted in turn "
        "(median post ms; `plain` no capture, `bookkeeping` capture naming nothing, `features` aux + last hidden, "
        "`full` also the passthrough JSON lists, `compact` those sent compactly by our patches), and the "
        "client's JSON encode of `full`.",
        "",
    ]
    rows = []
    for n, r in pipelines:
        for run in r.get("runs") or []:
            for sh in run.get("shapes") or []:
                b = sh.get("breakdown")
                if not b:
                    continue
                v = b.get("variants") or {}
                rows.append(
                    [
                        n,
                        f"tp{run.get('tp')}, {run.get('put_clients', 1)} put client(s)"
                        + (f", {run['transport']}" if run.get("transport") else ""),
                        f"{sh['batch']}x{sh['tokens_per_prompt']}",
                        *[
                            (v.get(k) or {}).get("post_ms")
                            for k in ("plain", "bookkeeping", "features", "full", "compact")
                        ],
                        (v.get("full") or {}).get("encode_ms"),
                        (v.get("plain") or {}).get("encode_ms"),
                    ]
                )
    if rows:
        out += _table(
            [
                "file",
                "server",
                "batch",
                "plain",
                "bookkeeping",
                "features",
                "full",
                "compact",
                "encode full",
                "encode plain",
            ],
            rows,
        ) + [""]
    else:
        out += ["No breakdown measured yet (`bench/online_pipeline.py ... --breakdown`).", ""]
    out += [
        "`bench/studies/passthrough_cpu.py` (CPU): the passthrough lists' cost per batch on the request path "
        "(encode, decode, pickle to the scheduler, the sink's tensors), SpecForge's JSON lists vs the compact "
        "forms.",
        "",
    ]
    rows = []
    for n, r in cpu:
        for sh in r.get("shapes") or []:
            for form in ("lists", "compact"):
                f = sh.get(form) or {}
                rows.append(
                    [
                        n,
                        (r.get("environment") or {}).get("cpu_count"),
                        f"{sh['batch']}x{sh['tokens_per_prompt']}",
                        form,
                        _num((f.get("body_bytes") or 0) / 1e6, "{:.2f}"),
                        f.get("encode_ms"),
                        f.get("decode_ms"),
                        f.get("ipc_ms"),
                        f.get("build_ms"),
                        f.get("total_ms"),
                        sh.get("identical_tensors"),
                    ]
                )
    if rows:
        out += _table(
            [
                "file",
                "CPUs",
                "batch",
                "form",
                "body MB",
                "encode",
                "decode",
                "ipc",
                "build",
                "total ms",
                "same tensors",
            ],
            rows,
        ) + [""]
    else:
        out += [
            "Not measured yet: `python bench/studies/passthrough_cpu.py --out bench/results/passthrough_cpu.json`.",
            "",
        ]
    return out


def section_draft_parity(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        return [
            [
                n,
                arch,
                res.get("backend"),
                s.get("T"),
                _num(s.get("cos_min"), "{:.5f}"),
                _num(s.get("rel"), "{:.2%}"),
                s.get("top1_agreement"),
                _num(s.get("margin_min"), "{:.1f}"),
                res.get("passed"),
                res.get("returncode"),
            ]
            for arch, res in r.items()
            for s in res.get("sequences") or [{}]
        ]

    return _tabled(
        "Draft logits parity: SGLang vs the training-side forward",
        "`tests/gpu/test_draft_logits_parity.py`: random-weight drafts exported for SGLang and loaded by "
        "its own loader, one extend batch with aux states, against the training-side module (fp32). Margin "
        "= the closest rope/scale mutant's error over SGLang's error (parity needs >= the file's "
        "`margin_min`).",
        files,
        "`tests/gpu/test_draft_logits_parity.py --run-gpu`.",
        [
            "file",
            "draft",
            "backend",
            "tokens",
            "cos min",
            "rel. error",
            "top-1 agreement",
            "mutant margin",
            "passed",
            "rc",
        ],
        rows,
    )


def section_engine_pairs(twins: list[tuple[str, dict]], engines: list[tuple[str, dict]]) -> list[str]:
    out = [
        "## Same data, two drafts, through SGLang (3/1/4)",
        "",
        "`scripts/gpu_offline_twin.sh`: the online-trained draft and its offline twin (SpecForge's offline "
        "trainer, same prompts captured by the same server, same recipe). `scripts/gpu_mla_vs_llama.sh`: the "
        "MLA and the Llama-style draft trained offline on the same features.",
        "",
    ]
    if not twins and not engines:
        return out + ["Not measured yet.", ""]
    rows = []
    for n, r in twins:
        rel = r.get("offline_vs_online_relative")
        rows.append(
            [
                n,
                "online",
                "offline twin",
                (r.get("online") or {}).get("acceptance_length"),
                (r.get("offline") or {}).get("acceptance_length"),
                _num(rel, "{:+.1%}"),
                r.get("within_3_percent"),
            ]
        )
    for n, r in engines:
        a, b = (r.get("llama") or {}).get("acceptance_length"), (r.get("mla") or {}).get("acceptance_length")
        rows.append([n, "Llama-style", "MLA", a, b, _num((b - a) / a if a and b else None, "{:+.1%}"), None])
    notes = [
        f"- `{n}`: the online side is `{r['online_bench_from']}`, an earlier device call's bench; the twin's "
        "target and data were rebuilt for it (archive/gpu-runs/RUNS.md says how closely)"
        for n, r in twins
        if r.get("online_bench_from")
    ]
    return (
        out
        + _table(["file", "A", "B", "AL A", "AL B", "B vs A", "within 3%"], rows)
        + [""]
        + (notes + [""] if notes else [])
    )


def section_k25_pipeline(files: list[tuple[str, dict]]) -> list[str]:
    out = [
        "## Capture overhead at K2.5 width (real-width slice)",
        "",
        "`bench/online_pipeline.py` on a slice of K2.5 (`STAGE=bench bash scripts/gpu_real_width.sh`): K2.5's "
        "width (hidden 7168) and INT4 routed experts, fewer layers; capture / plain prefill per transport "
        "(`runs[].transport`; a run without one used Mooncake) and batch shape, and with the file's `online_run` "
        "part the slice's co-located run.",
        "",
    ]
    if not files:
        return out + [
            "Not measured yet: `STAGE=bench bash scripts/gpu_real_width.sh` after its train stage, committed as "
            "`bench/results/online_pipeline_k25_slice_h200.json`.",
            "",
        ]
    for name, res in files:
        if res.get("engine") == "reference":
            out += [
                f"`{name}` is a CPU dry run of `bench/online_pipeline.py` (stand-in server), not a measurement.",
                "",
            ]
            continue
        cfg = res.get("config") or {}
        rows = []
        for run in res.get("runs") or []:
            transport, tp = run.get("transport", "mooncake"), f"tp{run.get('tp')}"
            if run.get("error"):
                rows.append([transport, tp, "error: " + run["error"][:80], "-", "-", "-", "-", "-", "-"])
            for sh in run.get("shapes") or []:
                rows.append(
                    [
                        transport,
                        tp,
                        f"{sh.get('batch')}x{sh.get('tokens_per_prompt')}",
                        _num(sh.get("plain_tokens_per_s"), "{:.0f}"),
                        _num(sh.get("capture_tokens_per_s"), "{:.0f}"),
                        _num(sh.get("capture_over_plain"), "{:.2f}x"),
                        _num(sh.get("feature_bytes_per_token"), "{:.0f}"),
                        _num(sh.get("capture_write_gb_per_s"), "{:.2f}"),
                        _num(sh.get("read_gb_per_s"), "{:.2f}"),
                    ]
                )
        out += [
            f"`{name}` (`{' '.join(res.get('command') or []) or 'command not recorded'}`): "
            f"{cfg.get('layers')} layers, hidden {cfg.get('hidden')}.",
            "",
            *_table(
                [
                    "transport",
                    "TP",
                    "batch x tokens",
                    "plain prefill tok/s",
                    "capture tok/s",
                    "capture / plain",
                    "feature B/token",
                    "write GB/s",
                    "read GB/s",
                ],
                rows,
            ),
            "",
        ]
        if res.get("online_run"):
            out += _online_rows("pipeline_efficiency", name, res) + _online_rows("trainer_memory", name, res)
    return out


def section_prefill_depth(files: list[tuple[str, dict]]) -> list[str]:
    def rows(n, r):
        cfg = r.get("config") or {}
        return [
            [
                n,
                cfg.get("layers"),
                cfg.get("hidden"),
                f"{cfg.get('experts')} ({cfg.get('experts_per_token')} per token)",
                cfg.get("quantization") or "none",
                run.get("tp"),
                f"{sh.get('batch')}x{sh.get('tokens_per_prompt')}",
                _num(sh.get("plain_tokens_per_s"), "{:.0f}"),
                sh.get("reps"),
            ]
            for run in r.get("runs") or []
            for sh in run.get("shapes") or []
        ]

    return _tabled(
        "Plain prefill by depth (K2.5-width slices)",
        "`bench/prefill_depth.py`: `POST /generate` of batches of random token ids (one new token) against a "
        "running server, the median of the timed calls after one warm-up; two depths of the slice served with "
        "the same flags give `bench/sizing.py` its fixed and per-MoE-layer prefill time (with one depth, the fixed "
        "part comes from the 16-expert width probes: docs/sizing.md).",
        files,
        "`STAGE=depth` and `STAGE=data bash scripts/gpu_real_width.sh` (the 3- and 5-layer slices), committed as "
        "`bench/results/prefill_depth_k25_slice{3,5}_h200.json`.",
        ["file", "layers", "hidden", "routed experts", "quantization", "TP", "batch x tokens", "plain tok/s", "reps"],
        rows,
    )


def _sizing_rows(res: dict, ts) -> list[list]:
    """One table row per (shipped recipe, transport) of a ``bench/sizing.py`` file; ``ts``: TorchSpec's tok/s per GPU."""
    rows = []
    for recipe, r in (res.get("recipes") or {}).items():
        for transport, t in (r.get("transports") or {}).items():
            e2e = t.get("end_to_end_tokens_per_s_per_gpu")
            m = t.get("memory_per_gpu_gib") or r.get("memory_per_gpu_gib") or {}
            rows.append(
                [
                    recipe,
                    r.get("gpus"),
                    r.get("tp"),
                    _num(r.get("prefill_tokens_per_s_per_gpu"), "{:,.0f}"),
                    _num(r.get("trainer_tokens_per_s_per_gpu"), "{:,.0f}"),
                    r.get("slowest_stage"),
                    transport,
                    f"{_num(e2e, '{:,.0f}')} ({_num(t.get('end_to_end_no_overlap_tokens_per_s_per_gpu'), '{:,.0f}')})",
                    _num(e2e / ts if e2e and ts else None, "{:.2f}x"),
                    f"{_num(t.get('feature_gb_per_s_per_node'), '{:.2f}')} "
                    f"({_num(t.get('transport_readers_gb_per_s_per_node'), '{:.1f}')})",
                    t.get("transport_bound"),
                    _num(t.get("gpu_hours_per_1b_tokens"), "{:,.0f}"),
                    f"{_num(m.get('server_pool'), '{:.0f}')} + {_num(m.get('trainer_plan'), '{:.0f}')} "
                    f"of {_num(m.get('gpu'), '{:.0f}')}",
                ]
            )
    return rows


def _sizing_notes(res: dict, ts) -> list[str]:
    """The bullets under a ``bench/sizing.py`` table: depth fit, capture tax, slice run, backtests, TorchSpec, assumptions."""
    fit, sl = res.get("depth_fit") or {}, res.get("slice_run") or {}
    k25 = fit.get("k25_s_per_token_one_h200")
    return [
        "- depth fit: "
        + ", ".join(
            f"{_num(p.get('plain_tokens_per_s'), '{:,.0f}')} tok/s at {p.get('layers')} layers"
            for p in fit.get("points") or []
        )
        + f" -> {_num((fit.get('fixed_s_per_token') or 0) * 1e6, '{:.2f}')} us per token fixed + "
        f"{_num((fit.get('per_moe_layer_s_per_token') or 0) * 1e6, '{:.2f}')} us per MoE layer; "
        f"{_num(1 / k25 if k25 else None, '{:,.0f}')} tok/s for 61 layers on one H200",
        "- capture tax per token: "
        + ", ".join(
            f"{t} {_num((c.get('tax_s_per_token') or 0) * 1e6, '{:.1f}')} us (capture / plain "
            f"{_num(c.get('capture_over_plain_at_slice'), '{:.2f}')} at the slice, one reader "
            f"{_num(c.get('read_gb_per_s'), '{:.2f}')} GB/s)"
            for t, c in (res.get("capture") or {}).items()
        ),
        f"- the slice's co-located run: trainer-only {_num(sl.get('trainer_only_tokens_per_s'), '{:,.0f}')} "
        f"tok/s, end-to-end {_num(sl.get('end_to_end_tokens_per_s'), '{:,.0f}')} tok/s, plain prefill "
        f"{_num(sl.get('slice_prefill_tokens_per_s'), '{:,.0f}')} tok/s; "
        f"{_num(sl.get('end_to_end_over_slowest_stage'), '{:.2f}')} of its slowest stage, "
        f"{_num(sl.get('overlap_hidden_fraction'), '{:.2f}')} of the shorter stage hidden",
        *[
            f"- backtest: {b.get('what')}: predicted {_num(b.get('predicted'), '{:,.0f}')} from "
            f"{b.get('predicted_from')}; measured {_num(b.get('measured'), '{:,.0f}')}; error "
            f"{_num(b.get('relative_error'), '{:+.1%}')}"
            for b in (res.get("backtest") or []) + (res.get("cross_check") or [])
        ],
        f"- TorchSpec: {_num(ts, '{:,.0f}')} tok/s per GPU "
        f"({_num((res.get('torchspec') or {}).get('tokens'), '{:,.0f}')} tokens in "
        f"{_num((res.get('torchspec') or {}).get('gpu_hours'), '{:,}')} GPU-hours)",
        *[
            f"- {'measured' if v.get('measured') else 'assumed'}, {k}: "
            + ", ".join(
                f"{kk} {round(vv, 3) if isinstance(vv, float) else vv}"
                for kk, vv in v.items()
                if kk not in ("why", "ends", "measured")
            )
            + (f" ({v['why']})" if v.get("why") else "")
            for k, v in (res.get("assumptions") or {}).items()
            if isinstance(v, dict)
        ],
        "",
    ]


def section_sizing(files: list[tuple[str, dict]]) -> list[str]:
    out = [
        "## Projected K2.5 run (`bench/sizing.py`)",
        "",
        "A projection, not a measurement: the K2.5-width slice's measurements (plain prefill at two depths, the "
        "capture tax per transport, the slice's co-located run, the trainer bench) carried to 61 layers and to "
        "each shipped K2.5 recipe under the file's stated `assumptions` (model: docs/sizing.md), beside "
        "TorchSpec's published K2.5 run.",
        "",
    ]
    if not files:
        return out + [
            "Not measured yet: the real-width rehearsal (`scripts/gpu_real_width.sh`), its results committed "
            "under bench/results/, then `python bench/sizing.py`.",
            "",
        ]
    for name, res in files:
        ts = (res.get("torchspec") or {}).get("tokens_per_s_per_gpu")
        inputs = [x for v in (res.get("inputs") or {}).values() for x in str(v).split(" + ") if x]
        rows = _sizing_rows(res, ts)
        out += [
            f"`{name}` (inputs: {', '.join(f'`{Path(x).name}`' for x in inputs) or '-'}; "
            f"{res.get('tokens_per_prompt')}-token prompts):",
            "",
            *_table(
                [
                    "recipe",
                    "GPUs",
                    "TP",
                    "prefill tok/s per GPU",
                    "trainer tok/s per GPU",
                    "slowest",
                    "transport",
                    "end-to-end tok/s per GPU (times added)",
                    "vs TorchSpec",
                    "features GB/s per node (transport carries)",
                    "transport bound",
                    "GPU-hours per 1B tokens",
                    "GiB per GPU: server pool + trainer plan of GPU",
                ],
                rows,
            ),
            "",
        ]
        out += _sizing_notes(res, ts)
    return out


def section_headline(by_name: dict[str, dict], headline=None) -> list[str]:
    """The current figure per metric, read from the first present file of each ``HEADLINE`` row."""
    rows = []
    for metric, sources in HEADLINE if headline is None else headline:
        present = next((i for i, c in enumerate(sources) if c.file in by_name), None)
        if present is None:
            names = " or ".join(f"`{c.file}`" for c in sources)
            rows.append([metric, "not measured yet", sources[0].how, names])
            continue
        source = sources[present]
        d = by_name[source.file]
        try:
            figure = source.read(d, by_name) if source.needs_index else source.read(d)
        except Exception as exc:  # a file of an unexpected shape: say so, keep the report
            figure = f"could not be read: {type(exc).__name__}: {exc}"
        preferred = [c.file for c in sources[:present]]
        where = f"`{source.file}`" + (
            f" ({', '.join(f'`{g}`' for g in preferred)} not measured yet)" if preferred else ""
        )
        rows.append([metric, figure, source.how, where])
    return [
        "## Headline: the current figure per metric",
        "",
        "Each row is read from the file named beside it (`HEADLINE` in bench/report.py picks it; where a row "
        "names several files, the first one present is read). The details follow in the sections below.",
        "",
        *_table(["metric", "current figure", "how it is read", "file"], rows),
        "",
    ]


def _sections(plots: Path | None) -> list[tuple[str, tuple[str, ...], Callable[..., list[str]]]]:
    """The report's sections in order: (section id, the kinds whose files it shows, renderer of those lists)."""
    return [
        ("acceptance", ("acceptance",), lambda a: section_acceptance(a, plots)),
        ("draft_comparison", ("draft_comparison",), section_draft_comparison),
        *[
            (k, (k, "online_pipeline"), lambda f, o, k=k: section_planned(k, f, o))
            for k in ("capture_overhead", "pipeline_efficiency", "trainer_memory")
        ],
        ("k25_pipeline", ("online_pipeline_k25",), section_k25_pipeline),
        ("overlap_rates", ("overlap_rates",), section_overlap_rates),
        ("cudnn_merged_backward", ("cudnn_merged_backward",), section_cudnn_merged_backward),
        ("prefill_depth", ("prefill_depth",), section_prefill_depth),
        ("sizing", ("sizing",), section_sizing),
        ("capture_parity", ("capture_parity",), lambda a: section_capture_parity(a, plots)),
        ("prepare_memory", ("prepare_memory",), lambda a: section_prepare_memory(a, plots)),
        ("regenerate", ("regenerate",), section_regenerate),
        ("bench_test", ("bench_test",), section_bench_test),
        ("trainer_step_memory", ("trainer_step_memory",), section_trainer_step_memory),
        ("tiny_target", ("tiny_target",), section_tiny_targets),
        ("pretrain_repro", ("pretrain_repro",), section_pretrain_repro),
        ("target_select", ("target_select",), section_target_select),
        ("online_run", ("online_run",), section_online_runs),
        ("eval_draft", ("eval_draft",), section_eval_draft),
        ("engine_pairs", ("offline_twin", "mla_vs_llama_engine"), section_engine_pairs),
        ("draft_parity", ("draft_parity",), section_draft_parity),
        ("cpu_simulated", ("mla_vs_llama", "greedy_acceptance"), section_cpu_simulated),
        ("fault_drills", ("fault_drills",), section_fault_drills),
        ("mooncake_put", ("mooncake_put",), section_mooncake_put),
        ("mooncake_restart", ("mooncake_restart",), section_mooncake_restart),
        ("resume", ("resume_drills", "soak"), section_resume),
        ("teacher_memory", ("teacher_memory",), section_teacher_memory),
        (
            "capture_time",
            ("online_pipeline", "online_pipeline_k25", "passthrough_cpu"),
            lambda p, k, c: section_capture_time(p + k, c),
        ),
    ]


def withdrawn(name: str, data: dict, section: str, superseded: dict | None = None) -> str | None:
    """Why ``name`` leaves ``section`` for the appendix (its ``SUPERSEDED`` entry, a failed acceptance
    threshold), or None: it is current there."""
    entry = (SUPERSEDED if superseded is None else superseded).get(name)
    if isinstance(entry, tuple):
        entry = entry[0] if section in entry[1] else None
    th = data.get("threshold") if data.get("benchmark") == "acceptance" else None
    failed = (
        f"AL {_fmt(th.get('acceptance_length'))} below its {th.get('min_acceptance_length')} threshold"
        if isinstance(th, dict) and th.get("passed") is False
        else None
    )
    if entry and failed:
        return f"{entry}; {failed}"
    return entry or (f"failed experiment: {failed}" if failed else None)


def build_report(results_dir: Path, out_md: Path, plots: Path, superseded: dict | None = None) -> str:
    """Write ``out_md`` and the plots; return the Markdown. ``superseded`` replaces ``SUPERSEDED`` (tests)."""
    plots.mkdir(parents=True, exist_ok=True)
    kinds = load_results(results_dir)
    try:
        shown = out_md.parent.resolve().relative_to(Path.cwd().resolve()) / results_dir.name
    except ValueError:
        shown = results_dir
    by_name = {n: d for k, v in kinds.items() if k != "unreadable" for n, d in v}
    lines = [
        "# specforge-kimi benchmark report",
        "",
        f"Generated by `python bench/report.py` from `{shown}/*.json` "
        f"({sum(len(v) for v in kinds.values())} files). Do not edit by hand; rerun the command. The headline "
        "gives the current figure per metric; the sections after it show the current files; superseded "
        "results and failed experiments are in the appendix at the end, each with its reason.",
        "",
        *section_headline(by_name),
    ]
    reasons: dict[str, list[str]] = {}
    later: list[str] = []
    appendix = {sid: render for sid, _, render in _sections(None)}
    for sid, ks, render in _sections(plots):
        current, old = [], []
        for k in ks:
            files = kinds.get(k, [])
            why = {n: withdrawn(n, d, sid, superseded) for n, d in files}
            current.append([(n, d) for n, d in files if not why[n]])
            old.append([(n, d) for n, d in files if why[n]])
            for n, r in why.items():
                if r and r not in reasons.setdefault(n, []):
                    reasons[n].append(r)
        section = render(*current)
        if not any(current) and any(old):
            section[2:2] = ["Every file of this section is superseded or failed: see the appendix.", ""]
        lines += section
        if any(old):
            # the appendix's tables, headings one level down (its renderers get no plots folder)
            later += [("### " + x[3:]) if x.startswith("## ") else x for x in appendix[sid](*old)]
    other = kinds.get("unknown", []) + kinds.get("unreadable", [])
    if other:
        lines += ["## Unrecognised results files", "", *[f"- `{n}`" for n, _ in other], ""]
    if reasons:
        lines += [
            "## Appendix: superseded results and failed experiments",
            "",
            "Out of the sections above (`SUPERSEDED` in bench/report.py, and acceptance runs below their "
            "threshold), one line each with its reason; their tables follow, so every number stays here.",
            "",
            *[f"- `{n}`: {'; '.join(r)}" for n, r in sorted(reasons.items())],
            "",
            "Their tables, section by section:",
            "",
            *later,
        ]
    text = "\n".join(lines)
    out_md.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--out", default=str(HERE / "REPORT.md"))
    p.add_argument("--plots", default=str(HERE / "plots"))
    a = p.parse_args(argv)
    results = Path(a.results)
    if not results.is_dir():
        print(f"error: {results} is not a directory", file=sys.stderr)
        return 2
    build_report(results, Path(a.out), Path(a.plots))
    print(f"wrote {a.out} and {a.plots}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
