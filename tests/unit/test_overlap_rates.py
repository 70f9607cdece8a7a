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


def test_serial_sum_is_the_stages_taking_turns(bench):
    assert bench.serial_rate(50000.0, 12500.0) == pytest.approx(10000.0)
    assert bench.serial_rate(3.0, 6.0) == pytest.approx(2.0)


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
    assert "overlap_vs_serial 1.150" in capsys.readouterr().out


def test_bad_options_are_refused(bench):
    for argv in (["--options", "mps,turbo"], ["--split", "0,50"], ["--split", "50"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            bench.parse(["--out", "x", *argv])


def test_colocated_runs_the_recipe_with_the_option_and_reads_run_report(bench, tmp_path, monkeypatch):
    raw = yaml.safe_load((REPO / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    calls = []

    stale = tmp_path / "run-mps-split" / "from-an-earlier-call"
    stale.mkdir(parents=True)

    def fake_run(argv, log, env=None):  # the process boundary: launch and run-report
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

    def refused(argv, log, env=None):
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
