"""The whole online loop on CPU: a recipe's co-located plan with real Mooncake, SpecForge's real
producer and torchrun consumer, and the CPU reference capture server in SGLang's place.

What this proves without a GPU: the rendered SpecForge config, the role commands
(``python -m specforge_kimi train -c ... --role producer|consumer``), the plugin loading, the
producer's capture contract (aux ids echoed by the server == SpecForge's), Mooncake transport in
the sink's key layout, the consumer's training steps and checkpoints, the export, the
metadata-only disk footprint and the teardown; and what a user watches: the live status line
``launch`` shows (:class:`progress.LiveProgress`), ``specforge-kimi watch`` following the run from
another process, the recipe's default tracking (SpecForge's TensorBoard events) and ``run-report``'s
plots. SGLang itself is proven by the GPU tests (``tests/gpu``); here its process is the one
stand-in, at the process boundary.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from online_cpu import cpu_plan

from specforge_kimi.run.progress import consumer_steps

pytestmark = pytest.mark.slow

STEPS = 12


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    from specforge_kimi.run.launch import export_latest, run_plan
    from specforge_kimi.run.progress import LiveProgress

    plan, recipe, rendered, target = cpu_plan(tmp_path_factory.mktemp("online"), steps=STEPS, save_interval=6)
    spawned = []

    def popen(*a, **k):
        p = subprocess.Popen(*a, **k)
        spawned.append(p)
        return p

    # `specforge-kimi watch` from another process, as a user in a second shell; it ends by itself
    watch = subprocess.Popen(
        [sys.executable, "-m", "specforge_kimi", "watch", recipe.output_dir, "--interval", "0.25"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    status = io.StringIO()  # not a terminal: one line per change
    t0 = time.monotonic()
    with LiveProgress(recipe.output_dir, stream=status, interval_s=0.25):  # what `launch` wraps the run in
        rc = run_plan(plan, managed_preflight=lambda _p: None, popen=popen)
    elapsed = time.monotonic() - t0
    try:
        watch_out, watch_err = watch.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        watch.kill()
        watch_out, watch_err = watch.communicate()
    export_dir = export_latest(rendered["run_plan"]) if rc == 0 else None
    return {
        "status": status.getvalue(),
        "watch": (watch.returncode, watch_out, watch_err),
        "rc": rc,
        "recipe": recipe,
        "out": Path(recipe.output_dir),
        "spawned": spawned,
        "export": export_dir,
        "elapsed": elapsed,
        "target": target,
    }


def _log(run, name: str) -> str:
    return (run["out"] / "logs" / name).read_text(errors="replace")


def test_run_succeeds_and_trains_every_step(online_run):
    assert online_run["rc"] == 0, _log(online_run, "consumer-node0.log")[-3000:]
    producer = _log(online_run, "producer.log")
    assert re.search(r"drive_producer returning produced=\d+ prompts_failed=0", producer), producer[-2000:]
    losses = [row["loss"] for row in consumer_steps(_log(online_run, "consumer-node0.log"))]
    assert len(losses) == STEPS and all(x == x and x > 0 for x in losses)


def test_ledger_trained_each_sample_once(online_run):
    from specforge_kimi.evaluate.run_report import report

    rep = report(online_run["out"])
    led = rep["ledger"]
    assert rep["transport"] == "mooncake"  # named by the run's launch sheet
    trained = rep["draft"]  # what was trained, from the rendered config and the configs it names
    assert trained["strategy"] == "eagle3" and trained["draft_block_size"] is None
    assert trained["target_layer_ids"] == online_run["recipe"].capture_ids
    assert trained["draft_hidden_size"] == trained["target_hidden_size"] and trained["draft_num_hidden_layers"] == 1
    assert rep["steps_logged"] == STEPS and led["global_step"] == STEPS
    assert led["acked"] == STEPS and led["duplicates"] == 0 and led["acked_not_committed"] == 0
    assert led["trained_tokens"] > 0 and rep["checkpoints"][-1].endswith(f"step{STEPS}")


def test_checkpoints_and_export(online_run):
    from specforge_kimi.drafts.export import check_sglang_export

    out, name = online_run["out"], online_run["recipe"].name
    assert (out / f"{name}-step6" / "training_state.pt").is_file()
    assert (out / f"{name}-step{STEPS}" / "training_state.pt").is_file()
    summary = check_sglang_export(online_run["export"], target_dir=online_run["target"])
    assert summary["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # positions: SGLang reads them unshifted
    assert json.loads((online_run["export"] / "provenance.json").read_text())["recipe"] == name


def test_only_metadata_touches_disk(online_run):
    """Features travel through Mooncake: what the run writes besides checkpoints and the export
    is refs, the consumer ledger and logs, far below the feature bytes themselves."""
    from specforge_kimi.evaluate.run_report import disk_bytes

    out, name = online_run["out"], online_run["recipe"].name
    refs = [json.loads(line) for line in (out / "control" / "refs.jsonl").read_text().splitlines()]
    captured_tokens = sum(r["num_tokens"] for r in refs)
    feature_bytes = sum(r["estimated_bytes"] for r in refs)
    written = disk_bytes(out, name)["metadata"]
    # refs + ledger + logs: ~5 KB per captured sample of ~100 tokens here; the fp32 features of
    # this tiny target are 1,048 B per token (bf16 K2.5: 57 KB per token)
    assert written / captured_tokens < 200, (written, captured_tokens)
    assert written < feature_bytes / 2, (written, feature_bytes)
    assert not list(out.rglob("*.ckpt"))  # no offline feature files
    assert all(p.parent.name == "export-sglang" for p in out.rglob("*.safetensors"))


def test_no_process_left(online_run):
    time.sleep(0.5)
    assert online_run["spawned"] and not any(_alive(p.pid) for p in online_run["spawned"])


_LINE = re.compile(r"^step (\d+)/12 \((\d+)%\) \| loss [0-9.]+ \| accept( [0-9.]+){4} \| .*in flight \d+")


def test_status_line_while_training(online_run):
    """The status line `launch` shows, read from SpecForge's own files while the run trains."""
    lines = online_run["status"].splitlines()
    assert "\r" not in online_run["status"] and len(lines) == len(set(lines))  # one line per change
    training = [m for m in map(_LINE.match, lines) if m]
    assert training, lines
    assert any(int(m.group(1)) < STEPS and "ETA " in m.string and " tok/s" in m.string for m in training), lines
    assert lines[-1].startswith(f"step {STEPS}/{STEPS} (100%)") and "finished: " in lines[-1], lines[-1]
    assert f"ckpt {STEPS}" in lines[-1]


def test_watch_from_another_process(online_run):
    rc, out, err = online_run["watch"]
    assert rc == 0, err[-2000:]
    lines = out.splitlines()
    assert len(lines) >= 2 and lines[-1].startswith(f"step {STEPS}/{STEPS}") and "finished" in lines[-1], lines


def test_watch_once_reads_the_ledger(online_run):
    from specforge_kimi.evaluate.run_report import report

    res = subprocess.run(
        [sys.executable, "-m", "specforge_kimi", "watch", str(online_run["out"]), "--once", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    snap = json.loads(res.stdout)
    led = report(online_run["out"])["ledger"]
    assert snap["step"] == STEPS and snap["trained"] == led["acked"] == STEPS and snap["finished"]
    assert snap["tokens_per_step"] == led["trained_tokens"] / STEPS and snap["checkpoint"] == STEPS
    refs = (online_run["out"] / "control" / "refs.jsonl").read_text().count("\n")
    assert snap["captured"] == refs and snap["in_flight"] == refs - STEPS
    assert len(snap["acceptance"]) == len(snap["accuracy"]) == 4  # ttt_length of the recipe


def test_tracking_writes_tensorboard_events(online_run):
    """The recipe's default tracking reaches SpecForge's own TensorBoard tracker: the same losses as the log."""
    from specforge_kimi.training.offline import read_tensorboard_scalars

    events = sorted(str(p) for p in (online_run["out"] / "runs").glob("events.out.tfevents.*"))
    assert events
    scalars = read_tensorboard_scalars(events)
    logged = {row["step"]: row["loss"] for row in consumer_steps(_log(online_run, "consumer-node0.log"))}
    assert sorted(scalars["train/loss"]) == list(range(1, STEPS + 1))
    assert all(abs(scalars["train/loss"][k] - v) < 1e-5 * max(1.0, abs(v)) for k, v in logged.items())


def test_run_report_plots(online_run):
    res = subprocess.run(
        [sys.executable, "-m", "specforge_kimi", "run-report", str(online_run["out"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    report_dir = online_run["out"] / "run-report"
    rep = json.loads((report_dir / "run_report.json").read_text())
    for name in ("loss", "acceptance", "throughput"):
        png = report_dir / f"run_{name}.png"
        assert rep["plots"][name] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 5_000, name
    assert "gpu_memory" in rep["plots"]["skipped"]  # no nvidia-smi samples on a CPU run
