"""The three rates of a co-located recipe in one GPU call, and how far each overlap option gets past taking turns.

For a recipe (default the K2.5 slice) it measures, each with the script that already measures it (as a
subprocess; nothing re-implemented here):

  prefill alone   bench/online_pipeline.py: the capture server alone (no trainer) on the recipe's target, TP and
                  transport, at ``--shape`` (batch x tokens); the rate is its capture tok/s (what the co-located
                  server does), its plain prefill tok/s beside it
  trainer alone   bench/trainer_memory.py on the recipe's own step and batches (its attention backend, its
                  ``max_length``, the batch already on the GPU as both transports hand it over)
  co-located      ``specforge-kimi launch`` of the recipe with each option's ``overlap:`` section (``--no-export``),
                  then ``specforge-kimi run-report``: its ``perf.end_to_end_tokens_per_s`` (trained tok/s); the
                  run's checkpoints and export are removed once the report is read, so the next option's run
                  finds the disk as the first did (logs, ledger and report stay)

and writes ONE JSON: the command, the environment, the two stage rates with their source files, the serial sum
``1 / (1/prefill + 1/trainer)`` (the two stages taking turns) and one row per option (``baseline`` = the recipe's
own ``overlap:``, ``mps``, ``mps+split``, ``mps+trainer-low`` / ``mps+server-low``: that side's MPS clients at
BELOW_NORMAL priority, ``overlap.below_normal_priority``; ``batching``, ``mps+batching``) with its co-located rate
and ``overlap_vs_serial`` = co-located / serial (1.0: they take turns; the issue's goal is >= 1.15). A launch that
fails (an MPS daemon the box refuses included) is a row with its exit code and the launch's last lines, not a crash.
``--dry-run`` writes the same JSON from canned sub-results without a GPU (tests/unit/test_overlap_rates.py).

The options need more than one device call at K2.5's width (each is a whole co-located launch). ``--stages-from
EARLIER.json`` takes the two stage rates, and the rows of options not named in ``--options``, from an earlier call's
JSON and measures only the named options; it is refused in one line, before anything runs, unless the earlier file is
this bench's, of the same recipe (path and sha256), the same settings (steps, shape, trainer steps, split,
concurrency), dry run or not alike, on the same GPUs, with both stage rates measured. The new JSON holds every row and
names the file it took them from (``stages_from``).

The GPU commands (the slice's target and prompts from scripts/gpu_real_width.sh STAGE=target and STAGE=data), one
per device call (at most 10 minutes each): the stages alone take ~3 minutes (a capture server start and its shape,
the trainer bench), and each option a co-located launch of ~3 minutes at 60 steps (the server's start, the
trainer's, the final checkpoint), so the first call measures one option beside the stages and later calls two:

    python bench/overlap_rates.py --recipe recipes/kimi-k25-slice-h200.yaml --steps 60 --split 50,50 \
        --concurrency 2 --launch-timeout 330 --options baseline --out $OUT/overlap_rates_1.json
    python bench/overlap_rates.py ... --options mps,mps+split \
        --stages-from $OUT/overlap_rates_1.json --out $OUT/overlap_rates_2.json
    python bench/overlap_rates.py ... --options mps+server-low,batching \
        --stages-from $OUT/overlap_rates_2.json --out bench/results/overlap_rates_k25_slice_h200.json

(``mps+trainer-low`` and ``mps+batching`` in a later call the same way.) ``--options ''`` without ``--stages-from``
measures the two stages alone and launches nothing (~3 minutes): it fits the call that makes the slice and its data,
so the later calls are all options:

    python bench/overlap_rates.py ... --options '' --out $OUT/overlap_rates_0.json
    python bench/overlap_rates.py ... --options baseline,mps --stages-from $OUT/overlap_rates_0.json ...

``--launch-timeout S`` bounds each co-located launch: one past it is killed, its run stopped (``specforge-kimi
stop``: its ranks, its server, its MPS daemon) and it is a row with its reason, so the next option still runs. The
JSON is written after the stages and after each option (``complete`` false until the call ends), so a device call
cut short keeps what it measured.

``--winner-steps N`` (0: off) then runs the best option for N steps, the issue's ">= 200-step co-located run with the
winning option" (the same launch, checkpoints removed after its report), as ``winner_run`` in the same JSON. The
winner is the row with the highest ``overlap_vs_serial`` whose co-located rate is at least ``1 + --winner-margin``
times the baseline row's (default 0.03: two 60-step windows of one recipe differ by less than that) and whose run
lost nothing (its ledger whole, no duplicates); with no such row, nothing runs and ``winner_run`` says why. With
``--options ''`` and ``--stages-from``, a call runs only the winner:

    python bench/overlap_rates.py ... --options '' --winner-steps 200 \
        --stages-from bench/results/overlap_rates_k25_slice_h200.json --out $OUT/overlap_rates_winner.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from specforge_kimi.plan.overlap import ceiling_rate, hidden_fraction, serial_rate

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("baseline", "mps", "mps+split", "mps+trainer-low", "mps+server-low", "batching", "mps+batching")
LOW_PRIORITY = {"mps+trainer-low": "trainer", "mps+server-low": "server"}  # overlap.below_normal_priority


@dataclass(frozen=True)
class Settings:
    recipe: Path
    options: tuple[str, ...]
    split: tuple[int, int]
    concurrency: int
    steps: int
    shape: str
    trainer_steps: int
    workdir: Path
    out: Path
    dry_run: bool
    stages_from: Path | None = None
    winner_steps: int = 0
    winner_margin: float = 0.03
    launch_timeout: float = 0.0


class StagesRefused(ValueError):
    """``--stages-from`` names a file whose stage rates cannot stand for this call's (one line)."""


def parse(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/kimi-k25-slice-h200.yaml")
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of: {', '.join(OPTIONS)}")
    p.add_argument("--split", default="50,50", help="mps+split: server,trainer CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    p.add_argument("--concurrency", type=int, default=2, help="batching: overlap.producer_concurrency")
    p.add_argument("--steps", type=int, default=60, help="trainer.max_steps of each co-located run")
    p.add_argument("--shape", default="4x4096", help="prefill alone: batch x tokens per prompt")
    p.add_argument("--trainer-steps", type=int, default=8, help="trainer alone: optimizer steps (the first compiles)")
    p.add_argument("--workdir", default="runs/overlap-rates")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="canned sub-results: the arithmetic and JSON, no GPU")
    p.add_argument(
        "--stages-from",
        default=None,
        help="an earlier call's JSON: its stage rates and the rows of options not in --options (like for like)",
    )
    p.add_argument("--winner-steps", type=int, default=0, help="then run the best option this many steps (0: off)")
    p.add_argument("--winner-margin", type=float, default=0.03, help="a winner beats the baseline by this fraction")
    p.add_argument(
        "--launch-timeout",
        type=float,
        default=0.0,
        help="seconds a co-located launch may take before it is killed and its run stopped (0: no limit)",
    )
    a = p.parse_args(argv)
    options = tuple(o for o in a.options.split(",") if o)
    unknown = [o for o in options if o not in OPTIONS]
    split = tuple(int(x) for x in a.split.split(","))
    if unknown or len(split) != 2 or not all(1 <= x <= 100 for x in split) or a.concurrency < 1:
        p.error(f"--options of {', '.join(OPTIONS)}; --split two percentages 1-100; --concurrency >= 1")
    if a.winner_steps < 0 or not 0 <= a.winner_margin < 1 or a.launch_timeout < 0:
        p.error("--winner-steps >= 0 (0: off); --winner-margin a fraction in [0, 1); --launch-timeout >= 0")
    return Settings(
        Path(a.recipe), options, split, a.concurrency, a.steps, a.shape, a.trainer_steps, Path(a.workdir),
        Path(a.out), a.dry_run, a.stages_from and Path(a.stages_from), a.winner_steps, a.winner_margin,
        a.launch_timeout,
    )  # fmt: skip


def settings_of(s: Settings) -> dict:
    """The settings every row and both stage rates depend on: a later call must share them all."""
    return {"steps": s.steps, "shape": s.shape, "trainer_steps": s.trainer_steps, "split": list(s.split),
            "concurrency": s.concurrency}  # fmt: skip


def recipe_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def stages_from(s: Settings, gpus: list[str] | None) -> tuple[dict, dict, list[dict], dict]:
    """The earlier call's stage rates, its rows of options this call does not measure, and where they came from;
    StagesRefused when the file cannot stand for this call (checked before anything runs; ``gpus``: this call's)."""
    path = s.stages_from
    try:
        raw = path.read_bytes()
        doc = json.loads(raw)
    except (OSError, ValueError):
        raw, doc = b"", {}
    if not isinstance(doc, dict) or doc.get("bench") != "overlap_rates":
        raise StagesRefused(f"--stages-from {path}: not an overlap_rates JSON (or unreadable)")
    expected = {
        "recipe": str(s.recipe),
        "recipe_sha256": recipe_sha256(s.recipe),
        "settings": settings_of(s),
        "dry_run": s.dry_run,
        "devices": gpus,
    }
    for key, want in expected.items():
        if doc.get(key) != want:
            raise StagesRefused(f"--stages-from {path}: its {key} {doc.get(key)!r} is not this call's {want!r}")
    prefill, trainer = doc.get("prefill_alone") or {}, doc.get("trainer_alone") or {}
    if not prefill.get("tokens_per_s") or not trainer.get("tokens_per_s"):
        raise StagesRefused(f"--stages-from {path}: a stage rate there failed; measure both again (no --stages-from)")
    kept = [r for r in doc.get("rows", []) if r.get("option") not in s.options]
    source = {"path": str(path.resolve()), "sha256": hashlib.sha256(raw).hexdigest()}
    return prefill, trainer, kept, source


def overlap_of(option: str, s: Settings) -> dict:
    """The ``overlap:`` section a row runs with (``baseline``: the recipe's own, unchanged)."""
    out: dict = {}
    if "mps" in option:
        out["mps"] = True
    if option == "mps+split":
        out.update(server_sm_percent=s.split[0], trainer_sm_percent=s.split[1])
    if option in LOW_PRIORITY:
        out["below_normal_priority"] = LOW_PRIORITY[option]
    if "batching" in option:
        out["producer_concurrency"] = s.concurrency
    return out


def with_hidden(r: dict, prefill: dict, trainer: dict) -> dict:
    """``r`` (a row or the winner's entry) with its ``hidden_fraction`` (None without its rate or a stage's); a row
    kept from an earlier call keeps the one it has."""
    if "hidden_fraction" in r:
        return r
    p, t, rate = prefill.get("tokens_per_s"), trainer.get("tokens_per_s"), r.get("colocated_tokens_per_s")
    return {**r, "hidden_fraction": hidden_fraction(rate, p, t) if p and t and rate else None}


def row(option: str, overlap: dict, colocated: dict, serial: float | None) -> dict:
    """One option's row: its overlap section, its co-located rate and source (or its error), and the ratio."""
    rate = colocated.get("tokens_per_s")
    return {
        "option": option,
        "overlap": overlap,
        "colocated_tokens_per_s": rate,
        "source": colocated.get("source"),
        "overlap_vs_serial": rate / serial if rate and serial else None,
        **{k: colocated[k] for k in ROW_KEYS if k in colocated},
    }


#: what a row keeps of its co-located measurement beside the rate (a failure's reason; the run's memory and ledger)
ROW_KEYS = ("error", "rc", "log_tail", "trainer_only_tokens_per_s", "gpu_memory", "ledger")


def nothing_lost(r: dict, steps: int | None = None) -> bool:
    """The row's run trained every sample it acknowledged once: its ledger present, no duplicate, none acked
    without its committed ref, and (``steps`` given) its durable step that many (``ledger.global_step``)."""
    led = r.get("ledger") or {}
    return bool(
        led.get("present")
        and led.get("duplicates") == 0
        and led.get("acked_not_committed") == 0
        and led.get("acked") == led.get("acked_unique")
        and (steps is None or led.get("global_step") == steps)
    )


def pick_winner(rows: list[dict], margin: float) -> tuple[dict | None, str]:
    """The option row to run long (highest ``overlap_vs_serial`` among those at least ``1 + margin`` times the
    baseline's co-located rate, its run whole) and why; None and the reason when no row qualifies."""
    base = next((r for r in rows if r["option"] == "baseline"), None)
    if not base or not base.get("colocated_tokens_per_s"):
        return None, "no measured baseline row to beat"
    bar = base["colocated_tokens_per_s"] * (1 + margin)
    ok = [r for r in rows if r["option"] != "baseline" and (r.get("colocated_tokens_per_s") or 0) >= bar]
    whole = [r for r in ok if nothing_lost(r)]
    if not whole:
        lost = f" ({', '.join(r['option'] for r in ok)}: samples lost or no ledger)" if ok else ""
        return (
            None,
            f"no option reached {1 + margin:.2f}x the baseline's {base['colocated_tokens_per_s']:.0f} tok/s{lost}",
        )
    best = max(whole, key=lambda r: r["colocated_tokens_per_s"])
    return best, f"{best['colocated_tokens_per_s'] / base['colocated_tokens_per_s']:.3f}x the baseline's rate"


def document(
    s: Settings,
    argv: list[str],
    prefill: dict,
    trainer: dict,
    runs: dict[str, dict],
    kept: list[dict] | None = None,
    source: dict | None = None,
    gpus: list[str] | None = None,
    winner: dict | None = None,
    complete: bool = True,
) -> dict:
    """The JSON: command, environment, each stage rate with its source, the serial sum, one row per option (``kept``:
    rows an earlier call measured, taken with its stage rates through ``--stages-from``, named by ``source``;
    ``gpus``: the GPUs it ran on, None on a dry run; ``winner``: :func:`winner_run`'s entry, with ``--winner-steps``;
    ``complete``: False while the call is still measuring, its JSON written so far)."""
    serial = serial_of(prefill, trainer)
    p, t = prefill.get("tokens_per_s"), trainer.get("tokens_per_s")
    ceiling = ceiling_rate(p, t) if p and t else None
    return {
        "bench": "overlap_rates",
        "complete": complete,
        "command": [sys.executable, *argv],
        "dry_run": s.dry_run,
        "environment": {
            "host": platform.node(),
            "python": platform.python_version(),
            **{k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ},
        },
        "devices": gpus,
        "recipe": str(s.recipe),
        "recipe_sha256": recipe_sha256(s.recipe),
        "settings": settings_of(s),
        "stages_from": source,
        "prefill_alone": prefill,
        "trainer_alone": trainer,
        "serial_tokens_per_s": serial,
        "serial_is": "1 / (1/prefill_alone + 1/trainer_alone): the two stages taking turns on the GPU",
        "ceiling_tokens_per_s": ceiling,
        "ceiling_vs_serial": ceiling / serial if ceiling and serial else None,
        "ceiling_is": "min(prefill_alone, trainer_alone): the smaller stage wholly hidden under the larger",
        "hidden_fraction_is": "per row: (1/prefill + 1/trainer - 1/co-located) / the smaller stage's time per token: "
        "0 taking turns, 1 the smaller stage wholly hidden",
        "rows": [with_hidden(r, prefill, trainer) for r in rows_of(s, runs, serial, kept)],
        "winner_run": with_hidden(winner, prefill, trainer) if winner and winner.get("option") else winner,
    }


def serial_of(prefill: dict, trainer: dict) -> float | None:
    p, t = prefill.get("tokens_per_s"), trainer.get("tokens_per_s")
    return serial_rate(p, t) if p and t else None


def rows_of(s: Settings, runs: dict[str, dict], serial: float | None, kept: list[dict] | None) -> list[dict]:
    """Every option's row, ``kept`` (an earlier call's) and this call's measured so far, in :data:`OPTIONS`' order."""
    rows = [*(kept or []), *(row(o, overlap_of(o, s), runs[o], serial) for o in s.options if o in runs)]
    rows.sort(key=lambda r: OPTIONS.index(r["option"]) if r["option"] in OPTIONS else len(OPTIONS))
    return rows


def winner_run(s: Settings, rows: list[dict], serial: float | None, measure_long) -> dict:
    """``--winner-steps``: the best row (:func:`pick_winner`) run ``s.winner_steps`` steps through ``measure_long``
    (option, steps -> a co-located measurement), as an entry beside the rows; without a winner, why not."""
    best, why = pick_winner(rows, s.winner_margin)
    if best is None:
        return {"option": None, "steps": s.winner_steps, "why": why}
    res = measure_long(best["option"], s.winner_steps)
    return {**row(best["option"], best["overlap"], res, serial), "steps": s.winner_steps, "why": why,
            "nothing_lost": nothing_lost(res, s.winner_steps)}  # fmt: skip


# -- measure: the existing scripts, as subprocesses -------------------------------------------------------------
#: the exit code of a launch killed at ``--launch-timeout`` (as ``timeout(1)``'s)
TIMED_OUT = 124


def _run(argv: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> int:
    """``argv`` in the repository, its output to ``log``; :data:`TIMED_OUT` when it ran past ``timeout`` seconds
    (then it is killed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        try:
            return subprocess.run(
                argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return TIMED_OUT


def _tail(log: Path, n: int = 5) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-n:] if log.is_file() else []


def measure_prefill(recipe, s: Settings) -> dict:
    """The capture server alone (bench/online_pipeline.py) on the recipe's target, TP, transport, aux layers, static
    pool and passthrough form."""
    out, log = s.workdir / "prefill_alone.json", s.workdir / "prefill_alone.log"
    ids = ",".join(str(i) for i in recipe.capture_ids)
    argv = [sys.executable, "bench/online_pipeline.py", "--target", recipe.target.path, "--tp", str(recipe.tp)]
    argv += ["--shapes", s.shape, "--reps", "3", "--transport", recipe.server.transport, "--aux-ids", ids]
    argv += ["--mem-fraction-static", str(recipe.server.mem_fraction_static)]  # the co-located server's pool
    if recipe.server.compact_passthrough:  # the producer's capture calls as the co-located run sends them
        argv.append("--compact-passthrough")
    rc = _run([*argv, "--workdir", str(s.workdir / "prefill"), "--out", str(out)], log)
    shapes = [sh for r in _load(out).get("runs", []) for sh in r.get("shapes") or []]
    if rc or not shapes:
        return {"error": "bench/online_pipeline.py failed", "rc": rc, "log_tail": _tail(log), "source": str(out)}
    sh = shapes[0]
    return {"tokens_per_s": sh["capture_tokens_per_s"], "plain_tokens_per_s": sh["plain_tokens_per_s"],
            "shape": s.shape, "source": str(out)}  # fmt: skip


def measure_trainer(recipe, s: Settings) -> dict:
    """The recipe's trainer step alone (bench/trainer_memory.py) at its max_length, batch on the GPU."""
    out, log = s.workdir / "trainer_alone.json", s.workdir / "trainer_alone.log"
    argv = [sys.executable, "bench/trainer_memory.py", "--recipe", str(s.recipe), "--feed", "device"]
    argv += ["--backends", recipe.trainer.attention_backend, "--lengths", str(recipe.trainer.max_length)]
    argv += ["--steps", str(s.trainer_steps), "--workdir", str(s.workdir / "trainer"), "--out", str(out)]
    rc = _run(argv, log)
    dropped = drop_standin(s.workdir / "trainer")
    rows = [r for r in _load(out).get("rows", []) if r.get("tokens_per_s")]
    if rc or not rows:
        return {"error": "bench/trainer_memory.py failed", "rc": rc, "log_tail": _tail(log), "source": str(out)}
    return {"tokens_per_s": rows[0]["tokens_per_s"], "length": rows[0].get("length"), "source": str(out),
            "standin_removed": dropped}  # fmt: skip


def drop_standin(trainer_dir: Path) -> list[str]:
    """Remove the trainer bench's stand-in targets (``target-<L>l-<H>h-<V>v``: the recipe target's embedding and LM
    head, ~4.4 GiB at K2.5's width) once its result is read: the co-located launches after it check the disk for a
    checkpoint and export beside the slice, and the stand-in would take their room. Returns the removed names."""
    return _remove_folders(trainer_dir, r"target-\d+l-\d+h-\d+v")


def _remove_folders(parent: Path, name_pattern: str) -> list[str]:
    """Remove the folders (not symlinks) directly under ``parent`` whose whole name matches ``name_pattern``;
    their names, sorted. Nothing when ``parent`` is not a folder."""
    removed = []
    if parent.is_dir():
        for p in sorted(parent.iterdir()):
            if re.fullmatch(name_pattern, p.name) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
                removed.append(p.name)
    return removed


def drop_heavy(run_dir: Path) -> list[str]:
    """Remove what a rate run leaves that only fills the disk: its step checkpoints (``<name>-step<N>``, with the
    optimizer state) and its export, tens of GB at K2.5's width, where the box's disk holds the slice and one
    checkpoint; the logs, ledger, rendered configs and run report stay. Returns the removed folders' names."""
    return _remove_folders(run_dir, r".+-step\d+|export-.*")


def measure_colocated(raw: dict, option: str, s: Settings, steps: int | None = None) -> dict:
    """``specforge-kimi launch`` of the recipe with the option's overlap section for ``steps`` (default the
    settings' ``steps``; another count is a run of its own, ``run-<option>-<steps>``), then its run-report; the run's
    checkpoints and export are removed after it (:func:`drop_heavy`), so every option's run finds the disk free."""
    name = option.replace("+", "-") + (f"-{steps}" if steps and steps != s.steps else "")
    run_dir = (s.workdir / f"run-{name}").absolute()
    if run_dir.exists():  # an earlier call's run of this option, in this bench's own workdir
        shutil.rmtree(run_dir)
    variant = {**raw, "output_dir": str(run_dir), "overlap": {**raw.get("overlap", {}), **overlap_of(option, s)}}
    variant["trainer"] = {**raw["trainer"], "max_steps": steps or s.steps}
    path = s.workdir / f"recipe-{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(variant, sort_keys=False))
    log = s.workdir / f"launch-{name}.log"
    launch = [sys.executable, "-m", "specforge_kimi", "launch", str(path), "--no-export", "--no-progress"]
    rc = _run(launch, log, timeout=s.launch_timeout or None)
    if rc == TIMED_OUT:  # a killed launch leaves its trainer ranks, its server and its MPS daemon: stop them all
        _run([sys.executable, "-m", "specforge_kimi", "stop", str(path)], s.workdir / f"stop-{name}.log")
    if rc:
        error = f"launch ran past --launch-timeout {s.launch_timeout:.0f} s" if rc == TIMED_OUT else "launch failed"
        return {"error": error, "rc": rc, "log_tail": _tail(log), "source": str(log),
                "removed": drop_heavy(run_dir)}  # fmt: skip
    report = run_dir / "run-report" / "run_report.json"
    _run([sys.executable, "-m", "specforge_kimi", "run-report", str(run_dir), "--no-plots", "--out", str(report)],
         s.workdir / f"run-report-{name}.log")  # fmt: skip
    doc = _load(report)
    perf, led = doc.get("perf", {}), doc.get("ledger") or {}
    rate = perf.get("end_to_end_tokens_per_s")
    keep = ("present", "acked", "acked_unique", "duplicates", "acked_not_committed", "global_step", "trained_tokens")
    out = {"tokens_per_s": rate, "trainer_only_tokens_per_s": perf.get("trainer_only_tokens_per_s"),
           "source": str(report), "gpu_memory": doc.get("gpu_memory"), "ledger": {k: led.get(k) for k in keep},
           "removed": drop_heavy(run_dir)}  # fmt: skip
    return out if rate else {**out, "error": "run-report has no end_to_end_tokens_per_s"}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def measure(
    s: Settings, stages: tuple[dict, dict] | None = None, progress=None
) -> tuple[dict, dict, dict[str, dict], object]:
    """The two stages alone (or ``stages``, an earlier call's), then one co-located run per option (each stage alone
    before any run: a clean GPU); and how to run one option longer (option, steps -> measurement) for the winner.
    ``progress(prefill, trainer, runs)`` is called after the stages and after each option (a partial JSON: a call cut
    short keeps what it measured)."""
    if s.dry_run:
        prefill, trainer, runs = dry_results(s)
        return (*(stages or (prefill, trainer)), runs, lambda o, n: dry_long(o, n, s))
    from specforge_kimi.plan.run_plan import compile_plan

    recipe = compile_plan(s.recipe).recipe  # the transport resolved as launch resolves it
    raw = yaml.safe_load(s.recipe.read_text())
    prefill, trainer = stages or (measure_prefill(recipe, s), measure_trainer(recipe, s))
    runs: dict[str, dict] = {}
    for o in (None, *s.options):
        if o is not None:
            runs[o] = measure_colocated(raw, o, s)
        if progress is not None:
            progress(prefill, trainer, runs)
    return prefill, trainer, runs, lambda o, n: measure_colocated(raw, o, s, n)


def dry_results(s: Settings) -> tuple[dict, dict, dict[str, dict]]:
    """Canned sub-results (made-up rates, marked as such): the arithmetic and the JSON's shape without a GPU."""
    prefill = {"tokens_per_s": 50000.0, "plain_tokens_per_s": 50500.0, "shape": s.shape, "source": "dry-run"}
    trainer = {"tokens_per_s": 12500.0, "length": 4096, "source": "dry-run"}
    canned = {"baseline": 10000.0, "mps": 11500.0, "mps+split": 12000.0, "mps+trainer-low": 11800.0,
              "mps+server-low": 10800.0, "batching": 10200.0}  # fmt: skip
    runs = {o: {"tokens_per_s": canned.get(o), "source": "dry-run", "ledger": dry_ledger(s.steps)} for o in s.options}
    if "mps+batching" in runs:
        runs["mps+batching"] = {"error": "launch failed", "rc": 1, "log_tail": ["dry-run: a refused MPS daemon"]}
    return prefill, trainer, runs


def dry_ledger(steps: int) -> dict:
    """A canned whole ledger of ``steps`` one-sample steps."""
    return {"present": True, "acked": steps, "acked_unique": steps, "duplicates": 0, "acked_not_committed": 0,
            "global_step": steps, "trained_tokens": steps * 4096}  # fmt: skip


def dry_long(option: str, steps: int, s: Settings) -> dict:
    """The canned long run of ``option``: its canned rate, a whole ledger of ``steps``."""
    _, _, runs = dry_results(s)
    rate = runs.get(option, {}).get("tokens_per_s") or 11000.0
    return {"tokens_per_s": rate, "source": "dry-run", "ledger": dry_ledger(steps)}


def write(doc: dict, out: Path, quiet: bool = False) -> None:
    from specforge_kimi.durable import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(doc, indent=2) + "\n")
    if quiet:
        return
    for r in doc["rows"]:
        ratio = r["overlap_vs_serial"]
        said = f"{ratio:.3f}" if ratio else r.get("error")
        hidden = f", hidden_fraction {r['hidden_fraction']:.2f}" if r.get("hidden_fraction") is not None else ""
        print(f"{r['option']:>14}: co-located {r['colocated_tokens_per_s']} tok/s, overlap_vs_serial {said}{hidden}")
    w = doc.get("winner_run")
    if w:
        said = f"co-located {w.get('colocated_tokens_per_s')} tok/s" if w["option"] else ""
        print(f"winner run ({w['steps']} steps): {w['option']} {said} ({w['why']})")
    ceiling = doc.get("ceiling_vs_serial")
    said = f" (ceiling {ceiling:.3f} of it: the smaller stage wholly hidden)" if ceiling else ""
    print(f"serial sum {doc['serial_tokens_per_s']} tok/s{said}; wrote {out}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = parse(argv)
    from specforge_kimi.provenance import devices

    gpus = None if s.dry_run else devices()  # read once: checked against --stages-from and recorded
    kept, source, stages = None, None, None
    if s.stages_from is not None:
        try:
            prefill, trainer, kept, source = stages_from(s, gpus)
        except StagesRefused as exc:
            print(f"overlap_rates: {exc}", file=sys.stderr)
            return 2
        stages = (prefill, trainer)
    argv = [str(Path(__file__).relative_to(ROOT)), *argv]

    def partial(prefill: dict, trainer: dict, runs: dict[str, dict]) -> None:
        write(document(s, argv, prefill, trainer, runs, kept, source, gpus, complete=False), s.out, quiet=True)

    prefill, trainer, runs, measure_long = measure(s, stages, partial)
    winner = None
    if s.winner_steps:
        partial(prefill, trainer, runs)  # every row, before the long run
        serial = serial_of(prefill, trainer)
        winner = winner_run(s, rows_of(s, runs, serial, kept), serial, measure_long)
    write(document(s, argv, prefill, trainer, runs, kept, source, gpus, winner), s.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
