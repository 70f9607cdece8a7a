"""bench/overlap_rates.py on the CPU: the serial sum and overlap_vs_serial arithmetic, the JSON's shape from
``--dry-run``, each option's overlap section, and the co-located measurement's subprocess calls with fake
``launch`` / ``run-report`` results (a failed launch is a row with its reason, not a crash)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overlap_rates", REPO / "bench" / "overlap_rates.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_writes_one_json_with_a_row_per_option(bench, tmp_path, capsys):
    out = tmp_path / "o.json"
    assert bench.main(["--dry-run", "--out", str(out), "--split", "40,60", "--concurrency", "3"]) == 0
    doc = json.loads(out.read_text())
    assert doc["dry_run"] is True and doc["command"][1].endswith("overlap_rates.py") and "--dry-run" in doc["command"]
    assert doc["prefill_alone"]["source"] and doc["trainer_alone"]["source"] and "host" in doc["environment"]
    assert doc["serial_tokens_per_s"] == pytest.approx(10000.0)
    rows = {r["option"]: r for r in doc["rows"]}
    assert list(rows) == list(bench.OPTIONS)
    assert rows["baseline"]["overlap_vs_serial"] == pytest.approx(1.0)
    assert rows["mps"]["overlap_vs_serial"] == pytest.approx(1.15)
    assert rows["mps+split"]["overlap"] == {"mps": True, "server_sm_percent": 40, "trainer_sm_percent": 60}
    assert rows["batching"]["overlap"] == {"producer_concurrency": 3}
    assert rows["mps+batching"]["overlap_vs_serial"] is None and rows["mps+batching"]["error"] == "launch failed"
    assert doc["ceiling_tokens_per_s"] == pytest.approx(12500.0) and doc["ceiling_vs_serial"] == pytest.approx(1.25)
    assert rows["baseline"]["hidden_fraction"] == pytest.approx(0.0)
    assert rows["mps"]["hidden_fraction"] == pytest.approx((1e-4 - 1 / 11500) / 2e-5)
    assert rows["mps+batching"]["hidden_fraction"] is None
    printed = capsys.readouterr().out
    assert "overlap_vs_serial 1.150, hidden_fraction 0.65" in printed and "ceiling 1.250" in printed


def test_bad_options_are_refused(bench):
    for argv in (["--options", "mps,turbo"], ["--split", "0,50"], ["--split", "50"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            bench.parse(["--out", "x", *argv])


def test_colocated_runs_the_recipe_with_the_option_and_reads_run_report(bench, tmp_path, monkeypatch):
    raw = yaml.safe_load((REPO / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    calls = []

    stale = tmp_path / "run-mps-split" / "from-an-earlier-call"
    stale.mkdir(parents=True)

    def fake_run(argv, log, env=None, timeout=None):  # the process boundary: launch and run-report
        calls.append(argv)
        if "launch" in argv:  # what a run leaves: checkpoints and export (heavy), logs and ledger (kept)
            assert not stale.exists()  # an earlier call's run of this option is gone before the launch
            run = tmp_path / "run-mps-split"
            for d in ("slice-step7", "slice-step5", "export-sglang", "logs", "consumer-state", "slice-steps"):
                (run / d).mkdir(parents=True)
                (run / d / "f").write_text("x")
        if "run-report" in argv:
            assert (tmp_path / "run-mps-split" / "slice-step7").is_dir()  # the report reads the checkpoints
            out = Path(argv[argv.index("--out") + 1])
            out.parent.mkdir(parents=True)
            out.write_text(json.dumps({"perf": {"end_to_end_tokens_per_s": 11000.0}, "gpu_memory": {"x": 1}}))
        return 0

    monkeypatch.setattr(bench, "_run", fake_run)
    s = bench.parse(["--out", "x", "--workdir", str(tmp_path), "--steps", "7", "--split", "30,70"])
    res = bench.measure_colocated(raw, "mps+split", s)
    assert res["tokens_per_s"] == 11000.0 and res["source"].endswith("run_report.json")
    launched = yaml.safe_load(Path(calls[0][calls[0].index("launch") + 1]).read_text())
    assert launched["overlap"] == {"mps": True, "server_sm_percent": 30, "trainer_sm_percent": 70}
    assert launched["trainer"]["max_steps"] == 7 and launched["output_dir"] == str(tmp_path / "run-mps-split")
    assert "--no-export" in calls[0] and calls[1][calls[1].index("run-report") + 1] == str(tmp_path / "run-mps-split")
    assert res["removed"] == ["export-sglang", "slice-step5", "slice-step7"]
    left = sorted(p.name for p in (tmp_path / "run-mps-split").iterdir())
    assert left == ["consumer-state", "logs", "run-report", "slice-steps"]


def test_a_failed_launch_is_a_row_with_its_reason(bench, tmp_path, monkeypatch):
    raw = yaml.safe_load((REPO / "recipes" / "kimi-k25-slice-h200.yaml").read_text())

    def refused(argv, log, env=None, timeout=None):
        log.write_text("overlap.mps: nvidia-cuda-mps-control -d did not start (exit code 1: refused)\n")
        (tmp_path / "run-mps" / "slice-step3").mkdir(parents=True)  # a failure after a save leaves one too
        return 1

    monkeypatch.setattr(bench, "_run", refused)
    res = bench.measure_colocated(raw, "mps", bench.parse(["--out", "x", "--workdir", str(tmp_path)]))
    assert res["rc"] == 1 and "did not start" in res["log_tail"][-1] and "tokens_per_s" not in res
    assert res["removed"] == ["slice-step3"] and not (tmp_path / "run-mps" / "slice-step3").exists()
    r = bench.row("mps", {"mps": True}, res, 10000.0)
    assert r["overlap_vs_serial"] is None and r["error"] == "launch failed"


def test_a_later_call_takes_the_stage_rates_and_rows_of_an_earlier_one_like_for_like(bench, tmp_path, capsys):
    """--stages-from: the second call measures only its options, keeps the first call's stage rates and other rows,
    replaces a row it measures again, names its source; an earlier file that differs in recipe, settings or dry run,
    or whose stage rates failed, or that is not this bench's, is refused in one line and nothing is written."""
    recipe = tmp_path / "slice.yaml"
    recipe.write_text((REPO / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    common = ["--dry-run", "--recipe", str(recipe), "--split", "40,60", "--workdir", str(tmp_path / "w")]
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    assert bench.main([*common, "--options", "baseline,mps", "--out", str(first)]) == 0
    d1 = json.loads(first.read_text())
    d1["prefill_alone"]["tokens_per_s"] = 48000.0  # as if measured: the later call must carry it, not re-measure
    d1["serial_tokens_per_s"] = bench.serial_rate(48000.0, d1["trainer_alone"]["tokens_per_s"])
    first.write_text(json.dumps(d1))
    args = [*common, "--options", "mps+split,mps", "--stages-from", str(first), "--out", str(second)]
    assert bench.main(args) == 0
    d2 = json.loads(second.read_text())
    assert [r["option"] for r in d2["rows"]] == ["baseline", "mps", "mps+split"]
    assert d2["rows"][0] == d1["rows"][0]  # baseline: the first call's row, as it was
    assert d2["prefill_alone"] == d1["prefill_alone"] and d2["trainer_alone"] == d1["trainer_alone"]
    mps = next(r for r in d2["rows"] if r["option"] == "mps")
    assert mps["overlap_vs_serial"] == pytest.approx(11500.0 / d2["serial_tokens_per_s"])  # measured again
    assert d2["stages_from"]["path"] == str(first.resolve()) and len(d2["stages_from"]["sha256"]) == 64
    capsys.readouterr()

    def refused(extra: list[str], expected: str, source: Path = first) -> None:
        out = tmp_path / "refused.json"
        argv = [*common, "--options", "batching", "--stages-from", str(source), "--out", str(out), *extra]
        assert bench.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"overlap_rates: --stages-from {source}") and expected in err and "\n" not in err, err
        assert not out.exists()

    real = ["--recipe", str(recipe), "--split", "40,60", "--stages-from", str(first), "--out", str(tmp_path / "x.json")]
    refused(["--steps", "90"], "its settings")
    refused(["--concurrency", "3"], "its settings")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**d1, "prefill_alone": {"error": "bench/online_pipeline.py failed", "rc": 1}}))
    refused([], "a stage rate there failed", bad)
    bad.write_text(json.dumps({"bench": "trainer_memory"}))
    refused([], "not an overlap_rates JSON", bad)
    assert bench.main(real) == 2
    assert "its dry_run True is not this call's False" in capsys.readouterr().err  # canned rates stand for no GPU's
    recipe.write_text(recipe.read_text() + "\n# edited\n")
    refused([], "its recipe_sha256")
    assert bench.main(real) == 2
    assert "its recipe_sha256" in capsys.readouterr().err  # checked before anything runs, a real call too


def test_no_options_measures_the_stages_alone_for_later_calls(bench, tmp_path, monkeypatch, capsys):
    """``--options ''`` without ``--stages-from``: the two stage rates and no launch (the call that also makes the
    slice and its data); a later call takes them and measures its options."""
    launched = []
    monkeypatch.setattr(bench, "measure_prefill", lambda recipe, s: {"tokens_per_s": 50000.0, "source": "p.json"})
    monkeypatch.setattr(bench, "measure_trainer", lambda recipe, s: {"tokens_per_s": 12500.0, "source": "t.json"})
    monkeypatch.setattr(
        bench, "measure_colocated", lambda raw, o, s, n=None: launched.append(o) or {"tokens_per_s": 11000.0}
    )
    monkeypatch.setattr("specforge_kimi.provenance.devices", lambda: ["GPU-X"])
    common = ["--recipe", "recipes/kimi-k25-slice-h200.yaml", "--workdir", str(tmp_path / "w")]
    first, second = tmp_path / "stages.json", tmp_path / "rows.json"
    assert bench.main([*common, "--options", "", "--out", str(first)]) == 0
    d1 = json.loads(first.read_text())
    assert launched == [] and d1["rows"] == [] and d1["complete"] is True and d1["winner_run"] is None
    assert d1["serial_tokens_per_s"] == pytest.approx(10000.0) and d1["devices"] == ["GPU-X"]
    assert bench.main([*common, "--options", "baseline,mps", "--stages-from", str(first), "--out", str(second)]) == 0
    d2 = json.loads(second.read_text())
    assert launched == ["baseline", "mps"] and d2["prefill_alone"] == d1["prefill_alone"]
    assert [r["overlap_vs_serial"] for r in d2["rows"]] == [pytest.approx(1.1), pytest.approx(1.1)]
    capsys.readouterr()


def _row(option: str, rate: float | None, duplicates: int = 0) -> dict:
    led = {"present": True, "acked": 60, "acked_unique": 60 - duplicates, "duplicates": duplicates,
           "acked_not_committed": 0, "global_step": 60}  # fmt: skip
    return {"option": option, "overlap": {}, "colocated_tokens_per_s": rate, "ledger": led}


def test_the_winner_beats_the_baseline_by_the_margin_and_lost_nothing(bench):
    base = _row("baseline", 10000.0)
    best, why = bench.pick_winner([base, _row("mps", 10200.0), _row("mps+server-low", 11000.0)], 0.03)
    assert best["option"] == "mps+server-low" and why.startswith("1.100x")
    best, why = bench.pick_winner([base, _row("mps", 10200.0)], 0.03)  # 1.02x: within run-to-run spread
    assert best is None and "1.03x the baseline's 10000 tok/s" in why
    best, why = bench.pick_winner([base, _row("mps", 12000.0, duplicates=1), _row("batching", 10400.0)], 0.03)
    assert best["option"] == "batching"  # the faster row trained a sample twice
    best, why = bench.pick_winner([base, _row("mps", 12000.0, duplicates=1)], 0.03)
    assert best is None and "(mps: samples lost or no ledger)" in why
    assert bench.pick_winner([_row("mps", 12000.0)], 0.03) == (None, "no measured baseline row to beat")
    assert bench.pick_winner([_row("baseline", None), _row("mps", 12000.0)], 0.03)[0] is None
    assert not bench.nothing_lost({"ledger": {"present": False}}) and not bench.nothing_lost({})
    assert bench.nothing_lost(_row("mps", 1.0), 60) and not bench.nothing_lost(_row("mps", 1.0), 200)


def test_winner_steps_runs_the_best_row_long_and_records_it(bench, tmp_path, capsys):
    out = tmp_path / "w.json"
    argv = ["--dry-run", "--out", str(out), "--options", "baseline,mps,mps+split", "--winner-steps", "200"]
    assert bench.main([*argv, "--workdir", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    w = doc["winner_run"]
    assert w["option"] == "mps+split" and w["steps"] == 200 and w["nothing_lost"] is True  # canned 12000 > 11500
    assert w["ledger"]["global_step"] == 200 and w["overlap_vs_serial"] == pytest.approx(1.2)
    assert "winner run (200 steps): mps+split" in capsys.readouterr().out
    # a later call that runs only the winner, from the earlier call's rows
    later = tmp_path / "later.json"
    assert bench.main(["--dry-run", "--out", str(later), "--options", "", "--winner-steps", "200",
                       "--stages-from", str(out), "--workdir", str(tmp_path)]) == 0  # fmt: skip
    d2 = json.loads(later.read_text())
    assert [r["option"] for r in d2["rows"]] == ["baseline", "mps", "mps+split"]
    assert d2["winner_run"]["option"] == "mps+split"
    # no row beats the baseline: nothing runs, the reason is recorded
    none = tmp_path / "none.json"
    assert bench.main(["--dry-run", "--out", str(none), "--options", "baseline", "--winner-steps", "200",
                       "--workdir", str(tmp_path)]) == 0  # fmt: skip
    assert json.loads(none.read_text())["winner_run"] == {"option": None, "steps": 200,
                                                           "why": "no option reached 1.03x the baseline's 10000 tok/s"}  # fmt: skip
    assert json.loads(none.read_text())["rows"][0]["option"] == "baseline"
    for bad in (["--winner-steps", "-1"], ["--winner-margin", "1.5"]):
        with pytest.raises(SystemExit):
            bench.parse(["--out", "x", *bad])


def test_a_long_run_of_an_option_is_a_run_of_its_own(bench, tmp_path, monkeypatch):
    raw = yaml.safe_load((REPO / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    launched = []

    def fake_run(argv, log, env=None, timeout=None):
        if "launch" in argv:
            launched.append(yaml.safe_load(Path(argv[argv.index("launch") + 1]).read_text()))
        if "run-report" in argv:
            out = Path(argv[argv.index("--out") + 1])
            out.parent.mkdir(parents=True, exist_ok=True)
            led = {"present": True, "acked": 200, "acked_unique": 200, "duplicates": 0, "acked_not_committed": 0,
                   "global_step": 200, "trained_tokens": 9, "committed": 200}  # fmt: skip
            perf = {"end_to_end_tokens_per_s": 1.0, "trainer_only_tokens_per_s": 2.0}
            out.write_text(json.dumps({"perf": perf, "ledger": led}))
        return 0

    monkeypatch.setattr(bench, "_run", fake_run)
    s = bench.parse(["--out", "x", "--workdir", str(tmp_path), "--steps", "60"])
    res = bench.measure_colocated(raw, "mps+server-low", s, 200)
    assert launched[0]["trainer"]["max_steps"] == 200 and launched[0]["output_dir"].endswith("run-mps-server-low-200")
    assert launched[0]["overlap"] == {"mps": True, "below_normal_priority": "server"}
    assert res["ledger"]["global_step"] == 200 and "committed" not in res["ledger"]
    assert res["trainer_only_tokens_per_s"] == 2.0 and bench.nothing_lost(res, 200)


def test_prefill_alone_runs_the_recipes_capture_calls(bench, tmp_path, monkeypatch):
    """The capture server alone gets the recipe's target, TP, transport, aux ids and compact passthrough."""
    from specforge_kimi.plan.run_plan import compile_plan

    recipe = compile_plan(REPO / "recipes" / "kimi-k25-slice-h200.yaml").recipe
    calls = []

    def fake_run(argv, log, env=None, timeout=None):
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        shape = {"capture_tokens_per_s": 40000.0, "plain_tokens_per_s": 50000.0}
        out.write_text(json.dumps({"runs": [{"shapes": [shape]}]}))
        return 0

    monkeypatch.setattr(bench, "_run", fake_run)
    res = bench.measure_prefill(recipe, bench.parse(["--out", "x", "--workdir", str(tmp_path)]))
    argv = calls[0]
    assert res["tokens_per_s"] == 40000.0 and res["plain_tokens_per_s"] == 50000.0
    assert argv[argv.index("--target") + 1] == "runs/k25-slice" and argv[argv.index("--tp") + 1] == "1"
    assert argv[argv.index("--transport") + 1] == "cuda_ipc" and argv[argv.index("--aux-ids") + 1] == "1,2,3"
    assert "--compact-passthrough" in argv and argv[argv.index("--shapes") + 1] == "4x4096"
    # the co-located server's static pool: the H100 slice's weights need more than online_pipeline's default 0.5
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.36"
    h100 = compile_plan(REPO / "recipes" / "kimi-k25-slice-h100.yaml").recipe
    bench.measure_prefill(h100, bench.parse(["--out", "x", "--workdir", str(tmp_path)]))
    assert calls[1][calls[1].index("--mem-fraction-static") + 1] == "0.54"


def test_trainer_alone_removes_its_standin_target(bench, tmp_path, monkeypatch):
    """The trainer bench's stand-in target (embedding and LM head) is removed once its result is read, so the
    co-located launches after it find the disk as before it; its result and logs stay."""
    from specforge_kimi.plan.run_plan import compile_plan

    recipe = compile_plan(REPO / "recipes" / "kimi-k25-slice-h200.yaml").recipe
    calls = []

    def fake_run(argv, log, env=None, timeout=None):
        calls.append(argv)
        work = Path(argv[argv.index("--workdir") + 1])
        (work / "target-5l-7168h-163840v").mkdir(parents=True)
        (work / "target-5l-7168h-163840v" / "model.safetensors").write_bytes(b"x" * 64)
        (work / "render-flex_attention").mkdir()
        (work / "target-notes").mkdir()  # not a stand-in's name: kept
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(json.dumps({"rows": [{"tokens_per_s": 12000.0, "length": 4096}]}))
        return 0

    monkeypatch.setattr(bench, "_run", fake_run)
    res = bench.measure_trainer(recipe, bench.parse(["--out", "x", "--workdir", str(tmp_path)]))
    assert res["tokens_per_s"] == 12000.0 and res["standin_removed"] == ["target-5l-7168h-163840v"]
    left = sorted(p.name for p in (tmp_path / "trainer").iterdir())
    assert left == ["render-flex_attention", "target-notes"] and (tmp_path / "trainer_alone.json").is_file()


def test_a_call_cut_short_keeps_what_it_measured(bench, tmp_path, monkeypatch):
    """The JSON is written after the stages and after each option (``complete`` false until the end), so a call
    killed during its second launch still returns the stage rates and the first option's row."""
    monkeypatch.setattr(bench, "measure_prefill", lambda recipe, s: {"tokens_per_s": 50000.0, "source": "p"})
    monkeypatch.setattr(bench, "measure_trainer", lambda recipe, s: {"tokens_per_s": 12500.0, "source": "t"})

    def colocated(raw, option, s, steps=None):
        if option == "mps":
            raise KeyboardInterrupt  # the device call's limit, mid-launch
        return {"tokens_per_s": 10000.0, "source": "r", "ledger": bench.dry_ledger(s.steps)}

    monkeypatch.setattr(bench, "measure_colocated", colocated)
    out = tmp_path / "cut.json"
    argv = ["--out", str(out), "--options", "baseline,mps", "--workdir", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["serial_tokens_per_s"] == pytest.approx(10000.0)
    assert [r["option"] for r in doc["rows"]] == ["baseline"] and doc["rows"][0]["overlap_vs_serial"] == 1.0
    monkeypatch.setattr(bench, "measure_colocated", lambda raw, o, s, steps=None: colocated(raw, "baseline", s))
    assert bench.main(argv) == 0 and json.loads(out.read_text())["complete"] is True


def test_a_launch_past_its_timeout_is_stopped_and_a_row_with_its_reason(bench, tmp_path, monkeypatch):
    raw = yaml.safe_load((REPO / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    calls = []

    def hung(argv, log, env=None, timeout=None):
        calls.append((argv, timeout))
        return bench.TIMED_OUT if "launch" in argv else 0

    monkeypatch.setattr(bench, "_run", hung)
    s = bench.parse(["--out", "x", "--workdir", str(tmp_path), "--launch-timeout", "300"])
    res = bench.measure_colocated(raw, "mps", s)
    assert calls[0][1] == 300 and "launch" in calls[0][0]
    stop = calls[1][0]
    assert stop[stop.index("stop") + 1] == calls[0][0][calls[0][0].index("launch") + 1]  # the same recipe's run
    assert res["rc"] == bench.TIMED_OUT and res["error"] == "launch ran past --launch-timeout 300 s"
    monkeypatch.undo()  # the real process boundary: a child past its timeout is killed
    assert bench._run([sys.executable, "-c", "import time; time.sleep(5)"], tmp_path / "l.log", timeout=0.2) == 124
    assert bench._run([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "l.log") == 3
