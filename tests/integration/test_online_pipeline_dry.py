"""``bench/online_pipeline.py`` end to end on the CPU, against the reference capture server.

Scope: the script's code paths -- Mooncake master, capture server, SpecForge's capture adapter
and feature store, one batch at a time and ``--in-flight K`` batches from K threads sharing the
adapter -- with ``--engine reference`` (the CPU stand-in for SGLang). The rates it prints are not
measurements of anything; the GPU box runs the same script against SGLang (archive/gpu-runs/RUNS.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVER_CAPTURE = "specforge/inference/adapters/server_capture.py"


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


def _reference_run(mod, target, tmp_path, out, *extra: str) -> int:
    """The script on the CPU stand-in server: TP 1, one 2x32 shape, one rep, ``extra`` flags."""
    base = ["--target", str(target), "--tp", "1", "--engine", "reference", "--shapes", "2x32", "--reps", "1"]
    return mod.main([*base, *extra, "--workdir", str(tmp_path / "work"), "--out", str(out)])


def test_in_flight_rounds_capture_every_batch(tmp_path, monkeypatch, pipeline):
    mod, target, out = pipeline
    calls = []
    real = mod.bench_in_flight

    def spy(*args, **kwargs):
        calls.append(args[4:])  # n, length, reps, k
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "bench_in_flight", spy)
    assert _reference_run(mod, target, tmp_path, out, "--in-flight", "3") == 0
    res = json.loads(out.read_text())
    assert res["config"]["in_flight"] == 3 and "error" not in res["runs"][0], res["runs"][0]
    assert res["config"]["quantization"] == "bf16"  # the tiny target's experts; an INT4 one names its format
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
    from specforge_kimi.servers import capture_server

    mod, target, out = pipeline
    seen = []
    real = capture_server.capture_server_env

    def spy(*args, **kwargs):
        env = real(*args, **kwargs)
        seen.append(env.get("SGLANG_SPEC_CAPTURE_PUT_CLIENTS"))
        return env

    monkeypatch.setattr(capture_server, "capture_server_env", spy)
    assert _reference_run(mod, target, tmp_path, out, "--put-clients", "1", "2") == 0
    res = json.loads(out.read_text())
    assert [(r["tp"], r["put_clients"], "error" in r) for r in res["runs"]] == [(1, 1, False), (1, 2, False)]
    assert seen == [None, "2"] and res["config"]["put_clients"] == [1, 2]
    with pytest.raises(SystemExit) as exc:
        mod.main(["--target", str(target), "--put-clients", "0", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2


def test_breakdown_posts_each_variant_and_removes_what_it_wrote(tmp_path, monkeypatch, pipeline):
    """``--breakdown``: every variant posted per round with the producer's own body builders, the
    passthrough lists only in ``full``, and every key the server wrote discarded after its post."""
    from specforge.inference.adapters.server_capture import SGLangServerCaptureAdapter

    from specforge_kimi.setup.setup_patches import load_patched_specforge_module

    mod, target, out = pipeline
    bodies, discards = [], []
    real_body = mod._variant_body

    def spy_body(adapter, prompts, tag, variant):
        body, written = real_body(adapter, prompts, tag, variant)
        bodies.append((variant, body, written))
        real_discard = adapter.store.discard_external_attempts
        if not getattr(real_discard, "_spy", False):

            def discard(**kw):
                n = real_discard(**kw)
                discards.append(n)
                return n

            discard._spy = True
            monkeypatch.setattr(adapter.store, "discard_external_attempts", discard)
        return body, written

    monkeypatch.setattr(mod, "_variant_body", spy_body)
    args = [
        "--target",
        str(target),
        "--tp",
        "1",
        "--engine",
        "reference",
        "--shapes",
        "2x32",
        "--reps",
        "2",
        "--breakdown",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    # the installed SpecForge is the unpatched wheel: the compact variant is refused, the others run
    assert mod.main(args) == 0
    b = json.loads(out.read_text())["runs"][0]["shapes"][0]["breakdown"]
    assert (
        list(b["errors"]) == ["compact"]
        and "lacks SpecForge patch compact-capture-passthrough" in b["errors"]["compact"]
    )
    assert set(b["variants"]) == set(mod.BREAKDOWN_VARIANTS) - {"compact"} and b["attribution_ms"]
    # with the payload builder as `specforge-kimi setup` patches it, every variant runs
    monkeypatch.setattr(
        SGLangServerCaptureAdapter,
        "_spec_capture_payload",
        load_patched_specforge_module(SERVER_CAPTURE, tmp_path / "sf").SGLangServerCaptureAdapter._spec_capture_payload,
    )
    bodies.clear()
    discards.clear()
    assert mod.main(args) == 0
    res = json.loads(out.read_text())
    b = res["runs"][0]["shapes"][0]["breakdown"]
    assert b["errors"] == {} and set(b["variants"]) == set(mod.BREAKDOWN_VARIANTS)
    assert all(len(b["post_ms"][v]) == 2 for v in mod.BREAKDOWN_VARIANTS)  # warm-up round dropped
    assert "compact_saves_server (full - compact)" in b["attribution_ms"] and "producer_minus_full_ms" in b
    assert [v for v, _, _ in bodies] == list(mod.BREAKDOWN_VARIANTS) * 3
    by = {v: (body, written) for v, body, written in bodies}
    assert "spec_capture" not in by["plain"][0] and by["plain"][1] == []
    assert by["bookkeeping"][1] == [] and all(not p["features"] for p in by["bookkeeping"][0]["spec_capture"])
    feats = by["features"][0]["spec_capture"]
    assert all(p["features"] and p["passthrough"] == [] for p in feats)
    full = by["full"][0]["spec_capture"]
    assert {i["name"] for i in full[0]["passthrough"]} >= {"input_ids"}
    assert full[0]["passthrough"][0]["data"] == by["full"][0]["input_ids"][0]
    compact = by["compact"][0]["spec_capture"]
    assert [i["name"] for i in compact[0]["passthrough"]] == [i["name"] for i in full[0]["passthrough"]]
    assert all("data" not in i for i in compact[0]["passthrough"])
    # one discard per post; the three writing variants each removed one attempt per sample
    k = len(mod.BREAKDOWN_VARIANTS)
    assert len(discards) == k * 3 and all(discards[i::k] == [2] * 3 for i in (2, 3, 4))


def test_both_transports_in_one_run(tmp_path, pipeline):
    """``--transport mooncake,cuda_ipc``: one server per transport (the reference server's cuda_ipc pool is shared
    memory), the same seeded prompts on each; every shape names its transport beside ``capture_over_plain``, the
    comparison sets them side by side, and the reads of the two transports hash equal (the stand-in's features
    are deterministic, so this compares the transports' bytes)."""
    mod, target, out = pipeline
    args = ["--target", str(target), "--tp", "1", "--engine", "reference", "--shapes", "2x32,1x64", "--reps", "1"]
    args += [
        "--transport",
        "mooncake,cuda_ipc",
        "--ipc-pool-gib",
        "0.25",
        "--workdir",
        str(tmp_path / "w"),
        "--out",
        str(out),
    ]
    assert mod.main(args) == 0
    res = json.loads(out.read_text())
    assert [(r["tp"], r["transport"], "error" in r) for r in res["runs"]] == [
        (1, "mooncake", False),
        (1, "cuda_ipc", False),
    ]
    ipc = res["runs"][1]
    assert all(sh["transport"] == "cuda_ipc" and sh["capture_over_plain"] > 0 for sh in ipc["shapes"])
    assert ipc["pool"]["backend"] == "shm" and ipc["pool"]["nbytes"] == 1 << 28
    assert ipc["reader"]["reads"] == 2 * (2 + 1) and ipc["stale_pools_removed"] == []  # a clean stop removed its files
    rows = res["transport_comparison"]
    assert [r["shape"] for r in rows] == ["1x64", "2x32"]
    assert all(r["features_hash_equal"] is True and r["read_rate_cuda_ipc_over_mooncake"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        mod.main([*args[:-1], str(tmp_path / "y.json"), "--transport", "rdma"])


def test_server_and_master_ports_are_drawn_together(tmp_path, monkeypatch, pipeline):
    """A port drawn and released can be drawn again: the kernel handed the capture server's port to the
    Mooncake master's metadata server once (the run's /generate got the master's 404). The stand-in here
    hands out the same free ports on every draw; the run must still put every service on its own port."""
    from specforge_kimi.run import services

    mod, target, out = pipeline
    pool = services.free_ports(8)
    monkeypatch.setattr(services, "free_ports", lambda n: pool[:n])
    assert _reference_run(mod, target, tmp_path, out) == 0
    res = json.loads(out.read_text())
    assert [r.get("error") for r in res["runs"]] == [None]
