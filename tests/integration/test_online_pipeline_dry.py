"""``bench/online_pipeline.py`` end to end on the CPU, against the reference capture server.

Scope: the script's code paths -- Mooncake master, capture server, SpecForge's capture adapter
and feature store, one batch at a time and ``--in-flight K`` batches from K threads sharing the
adapter -- with ``--engine reference`` (the CPU stand-in for SGLang). The rates it prints are not
measurements of anything; the GPU box runs the same script against SGLang (tests/gpu/RUNS.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _pipeline_module():
    spec = importlib.util.spec_from_file_location("bench_online_pipeline", REPO / "bench" / "online_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """(the script as a module, a tiny target, the JSON path it writes)."""
    from specforge_kimi.cli import main as cli

    target = tmp_path / "tiny"
    assert cli(["tiny", str(target), "--layers", "8", "--hidden", "64"]) == 0
    monkeypatch.setattr(sys, "argv", ["bench/online_pipeline.py"])
    return _pipeline_module(), target, tmp_path / "pipeline.json"


def test_in_flight_rounds_capture_every_batch(tmp_path, monkeypatch, pipeline):
    mod, target, out = pipeline
    calls = []
    real = mod.bench_in_flight

    def spy(*args, **kwargs):
        calls.append(args[4:])  # n, length, reps, k
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "bench_in_flight", spy)
    assert mod.main(["--target", str(target), "--tp", "1", "--engine", "reference", "--shapes", "2x32",
                     "--reps", "1", "--in-flight", "3", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["in_flight"] == 3 and "error" not in res["runs"][0], res["runs"][0]
    shape = res["runs"][0]["shapes"][0]
    assert calls == [(2, 32, 1, 3)]
    f = shape["in_flight"]
    assert f["in_flight"] == 3 and f["tokens_per_round"] == 3 * 2 * 32
    assert len(f["plain_s"]) == len(f["capture_s"]) == 1 and f["capture_s"][0] > 0
    assert f["capture_over_plain"] == f["plain_s"][0] / f["capture_s"][0]
    assert f["samples_captured_per_round"] == [3 * 2]  # every prompt of the K concurrent calls got a ref
    assert shape["feature_bytes_per_token"] > 0


def test_in_flight_must_be_positive(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/online_pipeline.py"])
    mod = _pipeline_module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--target", str(tmp_path), "--in-flight", "0", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2 and "--in-flight must be >= 1" in capsys.readouterr().err


def test_put_clients_run_one_server_each(tmp_path, monkeypatch, pipeline):
    """``--put-clients 1 2``: one server run per value, each started with that many sink put clients."""
    from specforge_kimi import capture_server

    mod, target, out = pipeline
    seen = []
    real = capture_server.capture_server_env

    def spy(*args, **kwargs):
        env = real(*args, **kwargs)
        seen.append(env.get("SGLANG_SPEC_CAPTURE_PUT_CLIENTS"))
        return env

    monkeypatch.setattr(capture_server, "capture_server_env", spy)
    assert mod.main(["--target", str(target), "--tp", "1", "--engine", "reference", "--shapes", "2x32", "--reps", "1",
                     "--put-clients", "1", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["tp"], r["put_clients"], "error" in r) for r in res["runs"]] == [(1, 1, False), (1, 2, False)]
    assert seen == [None, "2"] and res["config"]["put_clients"] == [1, 2]
    with pytest.raises(SystemExit) as exc:
        mod.main(["--target", str(target), "--put-clients", "0", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
