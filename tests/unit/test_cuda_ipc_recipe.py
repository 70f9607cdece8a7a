"""``server.transport: cuda_ipc`` in a recipe: refused where it cannot work (one line naming why), the pool and
the producer's byte watermarks sized from the recipe and counted in the memory plan, the environment of each
role, the launch plan without a Mooncake master, and the launch preflight; and Mooncake's segment given the same
byte watermarks (and a segment too small refused)."""

from __future__ import annotations

import copy
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan import transport_plan as tp
from specforge_kimi.plan.memory import memory_plan
from specforge_kimi.plan.recipes import Recipe
from specforge_kimi.plan.run_plan import compile_plan, load_recipe, refusal
from specforge_kimi.transport import registry
from specforge_kimi.transport.cuda_ipc import CUDA_IPC, ipc_dir, peer_access_problem
from specforge_kimi.transport.strategy import GIB

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _raw(name: str = "tiny-k25-tp1-h200.yaml", **server) -> dict:
    raw = copy.deepcopy(yaml.safe_load((RECIPES / name).read_text()))
    raw["server"].update({"transport": "cuda_ipc", **server})
    return raw


def _load(tmp_path, raw) -> Recipe:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(path)


def _plan(tmp_path, raw):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return compile_plan(path)


def render(r, out):
    return compile_plan(r, rendered_dir=out).write()


def _cuda_ipc_refusal(r) -> str | None:
    return refusal(r, CUDA_IPC, tp.sizing(r))[0]


#: what each shipped recipe gets: the single-node co-located ones the GPU pool, the rest Mooncake
SHIPPED = {
    "kimi-k25-8xb200-lowered.yaml": "cuda_ipc",
    "kimi-k25-8xb300.yaml": "cuda_ipc",
    "kimi-k25-slice-h200.yaml": "cuda_ipc",
    "kimi-k25-slice-h100.yaml": "cuda_ipc",
    "tiny-k25-tp1-h200.yaml": "cuda_ipc",
    "tiny-k25-tp1-h200-mla.yaml": "cuda_ipc",
    "tiny-k25-tp1-h200-dflash.yaml": "cuda_ipc",
    "kimi-k25-slice-h200-dflash.yaml": "cuda_ipc",
    "kimi-k25-8xb200-lowered-dflash.yaml": "cuda_ipc",
    "kimi-k25-2x8xb300.yaml": "mooncake",
    "tiny-k25-tp2-h200x2.yaml": "mooncake",
    "tiny-k25-tp2-h200x2-mla.yaml": "mooncake",
    "tiny-k25-tp8-h200x8.yaml": "mooncake",
}


def test_shipped_transports_and_why():
    assert {p.name for p in RECIPES.glob("*.yaml")} == set(SHIPPED)
    for name, want in SHIPPED.items():
        plan = compile_plan(RECIPES / name)
        r, got = plan.recipe, plan.transport.as_dict()
        assert r.server.transport == memory_plan(r)["transport"] == got["transport"] == want, name
        assert got["chosen_by"] == "recipe" and "\n" not in got["why"]
        if want == "cuda_ipc":
            assert f"{tp.pool_bytes(r) / GIB:.2f} GiB pool" in got["why"]
    assert "single-node" in compile_plan(RECIPES / "kimi-k25-2x8xb300.yaml").transport.why


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_auto_picks_cuda_ipc_where_every_check_passes(tmp_path, name):
    """``server.transport`` unset (= auto) gives cuda_ipc exactly where the recipe validates with it, else
    mooncake with cuda_ipc's refusal as the reason."""
    raw = yaml.safe_load((RECIPES / name).read_text())
    raw["server"].pop("transport")
    plan = _plan(tmp_path, raw)
    r, got = plan.recipe, plan.transport.as_dict()
    refused = _cuda_ipc_refusal(r)
    assert got["chosen_by"] == "auto"
    if refused is None:
        assert r.server.transport == "cuda_ipc"
    else:
        assert r.server.transport == "mooncake" and got["why"] == "cuda_ipc would be refused: " + refused
    # the K2.5 single-node recipes and the TP=1 ones would pick the pool by themselves; two nodes would not
    assert (r.server.transport == "cuda_ipc") == (name != "kimi-k25-2x8xb300.yaml")


def test_auto_falls_back_to_mooncake_when_the_pool_does_not_fit(tmp_path):
    raw = yaml.safe_load((RECIPES / "kimi-k25-8xb300.yaml").read_text())
    raw["server"].pop("transport")
    raw["server"]["mem_fraction_static"] = 0.45  # GPU 0 then has no room for the trainer's plan beside a pool
    plan = _plan(tmp_path, raw)
    assert plan.recipe.server.transport == "mooncake"
    assert "left on GPU 0 beside the server, its cuda_ipc pool" in plan.transport.why


def test_mooncake_recipes_carry_no_pool():
    for path in sorted(RECIPES.glob("*.yaml")):
        r = load_recipe(path)
        if r.server.transport != "mooncake":
            continue
        assert "ipc_pool_gib" not in memory_plan(r) and tp.memory_terms(r) == {
            "pool": 0,
            "server_rows": 0,
            "prefetch": 0,
        }
        strategy = registry.get(r.server.transport)
        assert strategy.server_env(r, tp.sizing(r)) == {} and strategy.process_env(r) == {}
        high, low = tp.watermarks(r)  # mooncake: the producer's byte watermarks come from the segment
        assert tp.runtime_config(r) == {"resident_high_watermark_bytes": high, "resident_low_watermark_bytes": low}


def test_mooncake_watermark_keeps_the_segment_from_filling(tmp_path):
    """At K2.5 width SpecForge's ref watermark (256) alone admits 256 x 235 MB = 60 GB of 4k-token samples
    into a 32 GiB segment. Each shipped recipe's rendered config, given to SpecForge's own flow control, pauses
    the producer before its max-length samples fill 0.8 of the segment (hard-pinned objects are never evicted: a full one fails the put), and
    only after one optimizer window is in flight (else the consumer could never step)."""
    from specforge.config import Config
    from specforge.runtime.control_plane.flow_control import FlowControlLimits, ProducerFlowControl

    for path in sorted(RECIPES.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        raw["server"]["transport"] = "mooncake"  # every shipped recipe, on Mooncake
        r = _load(tmp_path, raw)
        rt = Config.model_validate(render(r, tmp_path / path.stem)["specforge_config"]).runtime
        flow = ProducerFlowControl(
            FlowControlLimits(
                high_watermark_refs=rt.in_flight_high_watermark,
                low_watermark_refs=rt.in_flight_low_watermark,
                high_watermark_bytes=rt.resident_high_watermark_bytes,
                low_watermark_bytes=rt.resident_low_watermark_bytes,
            )
        )
        s, refs = tp.sample_bytes(r), 0
        while not flow.should_pause(in_flight_refs=refs, resident_bytes=refs * s):
            refs += tp.PRODUCER_OVERSHOOT_SAMPLES  # a lease the producer takes before it asks again
        assert refs * s <= 0.8 * tp.segment_bytes(r), (path.name, refs)
        assert refs >= tp.optimizer_window(r), (path.name, refs)
    raw = yaml.safe_load((RECIPES / "kimi-k25-slice-h200.yaml").read_text())
    k25 = _load(tmp_path, {**raw, "server": {**raw["server"], "transport": "mooncake"}})
    assert tp.sample_bytes(k25) == 4096 * 57_368 and tp.watermarks(k25)[0] // tp.sample_bytes(k25) == 108


def test_a_mooncake_segment_too_small_is_refused(tmp_path):
    raw = yaml.safe_load((RECIPES / "kimi-k25-slice-h200.yaml").read_text())
    raw["server"]["transport"] = "mooncake"
    raw.setdefault("mooncake", {})["global_segment_gib"] = 2  # < (1 window + 8) x 235 MB / 0.8 = 2.46 GiB
    with pytest.raises(KimiInputError, match="mooncake.global_segment_gib 2 is below the 2.46 GiB") as exc:
        _load(tmp_path, raw)
    assert "\n" not in str(exc.value)
    raw["mooncake"]["global_segment_gib"] = 2.5
    assert _load(tmp_path, raw).mooncake.global_segment_gib == 2.5


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda r: r["gpus"].update(nnodes=2), "single-node"),
        (lambda r: r["server"].update(extra_args=["--enable-dp-attention", "--dp-size", "2"]), "DP attention"),
        (lambda r: r["server"].update(extra_args=["--dp=2"]), "DP attention"),
        (lambda r: r.update(resilience={"server_restarts": 1}), "cannot restart a lost capture server"),
        (lambda r: r.update(resilience={"segment_owner": "keeper"}), "has none"),
        (lambda r: r["server"].update(capture_put_clients=2), "capture_put_clients"),
        (lambda r: r["server"].update(ipc_pool_gib=0.01), "below the"),
        (lambda r: r["server"].update(ipc_lease_s=0), "ipc_lease_s"),
        (lambda r: r["server"].update(transport="nvlink"), "transport"),
    ],
)
def test_refused_with_one_line(tmp_path, mutate, msg):
    raw = _raw()
    mutate(raw)
    if raw["gpus"].get("nnodes", 1) > 1:  # the multi-node rules of the mooncake recipe still apply first
        raw["server"]["host"] = "10.0.0.1"
        raw["trainer"]["consumer_state_dir"] = "/local/state"
    with pytest.raises(KimiInputError, match=msg) as exc:
        _load(tmp_path, raw)
    assert "\n" not in str(exc.value)


def test_pool_watermarks_and_memory_plan(tmp_path):
    r = _load(tmp_path, _raw())
    s = tp.sample_bytes(r)
    assert tp.feature_bytes_per_token(r) == 4 * 512 * 2 + 24 and s == 1024 * (4 * 512 * 2 + 24)
    # one window (1 rank x batch 1) + the producer's 8 in flight, at 0.8
    assert tp.min_store_bytes(r) == int(9 * s / 0.8) + 1
    assert tp.pool_bytes(r) == GIB  # the 1 GiB floor for this tiny recipe
    high, low = tp.watermarks(r)
    assert high == int(0.8 * GIB) - 8 * s and low == int(0.75 * high)
    assert high >= tp.optimizer_window(r) * s  # the consumer's window always fits under the watermark
    plan = memory_plan(r)
    assert plan["transport"] == "cuda_ipc" and plan["ipc_pool_gib"] == 1.0 and plan["fits"]
    base = memory_plan(_load(tmp_path, _raw(transport="mooncake")))
    assert plan["trainer_peak_gib"] == pytest.approx(base["trainer_peak_gib"] + 4 * s / GIB, abs=0.01)
    rows = 2 * 16384 * 4 * 512 * 2  # 2 pending batches of SGLang's 16,384-token max prefill
    assert plan["writer_gpu_trainer_room_gib"] == pytest.approx(base["trainer_room_gib"] - 1 - rows / GIB, abs=0.01)
    # an explicit pool is taken as given; the K2.5 B200 recipe's default: 8 ranks' window + 8 in flight of 4k samples
    assert tp.pool_bytes(_load(tmp_path, _raw(ipc_pool_gib=3))) == 3 * GIB
    k25 = _load(tmp_path, _raw("kimi-k25-8xb200-lowered.yaml"))
    s = tp.sample_bytes(k25)
    assert s == 4096 * 57_368 and tp.optimizer_window(k25) == 8
    # unset: two windows (16) + 8 ranks' prefetch of 4 (32) under the watermark, + the 8 in flight, at 0.8; it fits
    # in what GPU 0 has left beside the trainer's plan, so it is taken, in quarter GiB
    wanted = (16 + 32 + 8) * s / 0.8
    assert tp.pool_bytes(k25) == -(-int(wanted + 1) // (GIB // 4)) * (GIB // 4) < tp.pool_room_bytes(k25)
    assert memory_plan(k25)["fits"] and memory_plan(k25)["ipc_pool_gib"] == tp.pool_bytes(k25) / GIB


def test_the_pool_is_capped_by_the_room_on_gpu0(tmp_path):
    """The B300 recipe (16k-token samples, 940 MB each): the pool it would want (56 samples) does not fit beside the
    trainer's plan, so it gets what GPU 0 has left, which still holds the minimum."""
    r = load_recipe(RECIPES / "kimi-k25-8xb300.yaml")
    assert tp.min_store_bytes(r) <= tp.pool_bytes(r) <= tp.pool_room_bytes(r) < tp.wanted_pool_bytes(r)
    assert tp.pool_room_bytes(r) - tp.pool_bytes(r) < GIB // 4 and memory_plan(r)["fits"]


def test_a_pool_that_does_not_fit_beside_the_trainer_is_refused(tmp_path):
    """At the B300 recipe's old split (0.45 to the server) its pool's minimum and captured rows do not fit on GPU 0
    beside the trainer's plan: named cuda_ipc, refused; Mooncake fits."""
    raw = _raw("kimi-k25-8xb300.yaml", mem_fraction_static=0.45)
    with pytest.raises(KimiInputError, match="left on GPU 0 beside the server, its cuda_ipc pool"):
        _load(tmp_path, raw)
    raw["server"]["transport"] = "mooncake"
    assert memory_plan(_load(tmp_path, raw))["fits"]


def test_rendered_roles_and_specforge_config(tmp_path):
    from specforge_kimi import transport

    raw = _raw()
    raw["output_dir"] = str(tmp_path / "run")
    r = Recipe.model_validate(raw)
    out = render(r, tmp_path / "rendered")  # SpecForge's Config validates the runtime section
    server, env = out["launch"]["server_env"], out["launch"]["env"]
    assert server[transport.SERVER_TRANSPORT_ENV] == "cuda_ipc"
    assert server[transport.POOL_BYTES_ENV] == str(GIB) and float(server[transport.LEASE_ENV]) == 1800
    assert server[transport.POOL_DIR_ENV] == env[transport.READER_DIR_ENV] == str(tmp_path / "run" / "ipc")
    assert env[transport.TRANSPORT_ENV] == "cuda_ipc" and env["CLONE_ON_FETCH"] == "0"
    high, low = tp.watermarks(r)
    assert out["specforge_config"]["runtime"] == {
        "resident_high_watermark_bytes": high,
        "resident_low_watermark_bytes": low,
    }
    from specforge.config import Config
    from specforge.runtime.control_plane.flow_control import FlowControlLimits

    cfg = Config.model_validate(out["specforge_config"])
    assert cfg.runtime.resident_high_watermark_bytes == high
    FlowControlLimits(high_watermark_refs=256, high_watermark_bytes=high, low_watermark_bytes=low)


def test_launch_plan_has_no_mooncake_master(tmp_path):
    from specforge_kimi.run.launch import build_colocated_plan

    raw = _raw("tiny-k25-tp2-h200x2.yaml")
    raw["output_dir"] = str(tmp_path / "run")
    r = Recipe.model_validate(raw)
    plan = build_colocated_plan(compile_plan(r, rendered_dir=tmp_path / "rendered"), python=sys.executable)
    assert [s.command.label for s in plan.services] == ["capture-server"]
    assert plan.managed_ports == (r.server.port,)
    assert plan.services[0].command.env["SGLANG_SPEC_CAPTURE_TRANSPORT"] == "cuda_ipc"
    assert all(c.env["SPECFORGE_KIMI_TRANSPORT"] == "cuda_ipc" for c in plan.commands)
    mooncake = Recipe.model_validate({**raw, "server": {**raw["server"], "transport": "mooncake"}})
    assert [
        s.command.label for s in build_colocated_plan(compile_plan(mooncake, rendered_dir=tmp_path / "r2")).services
    ][0] == ("mooncake")


def test_launch_preflight_wants_spec_capture_cuda_ipc(tmp_path, monkeypatch):
    from specforge_kimi.run import launch
    from specforge_kimi.setup import setup_patches

    raw = _raw()
    raw["output_dir"] = str(tmp_path / "run")
    r = Recipe.model_validate(raw)
    plan = launch.build_colocated_plan(compile_plan(r, rendered_dir=tmp_path / "rendered"), python=sys.executable)
    monkeypatch.setattr(setup_patches, "cuda_ipc_gaps", lambda: ["SGLang patch spec-capture-cuda-ipc is not applied"])
    with pytest.raises(KimiInputError, match="server.transport is cuda_ipc, but SGLang patch spec-capture-cuda-ipc"):
        launch.transport_preflight(plan)
    monkeypatch.setattr(setup_patches, "cuda_ipc_gaps", lambda: [])
    launch.transport_preflight(plan)  # one GPU: no peer-access question


def _fake_python(tmp_path, output: str, rc: int = 0) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\necho '{output}'\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_peer_access_answers(tmp_path):
    assert peer_access_problem("0") is None and peer_access_problem("") is None
    assert peer_access_problem("0,1,2", _fake_python(tmp_path, "|3")) is None
    assert "GPU(s) 2 of" in peer_access_problem("0,1,2", _fake_python(tmp_path, "2|3"))
    assert "2 of the 3 GPUs" in peer_access_problem("0,1,2", _fake_python(tmp_path, "|2"))
    assert "could not check" in peer_access_problem("0,1", _fake_python(tmp_path, "", rc=1))


def test_stale_pools_are_removed_after_a_run(tmp_path):
    """What a SIGKILLed server leaves (pool file, slot table, shared-memory file) goes at the launch's end."""
    import subprocess

    raw = _raw()
    raw["output_dir"] = str(tmp_path / "run")
    r = Recipe.model_validate(raw)
    code = (
        "import os, sys; from specforge_kimi.transport.writer import IpcCaptureWriter; "
        "w = IpcCaptureWriter(pool_bytes=1 << 16, pool_dir=sys.argv[1], device='cpu'); "
        "print(w.info.slots_path, w.info.handle['path'], flush=True); os._exit(0)"  # no cleanup, as after SIGKILL
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ipc_dir(r.output_dir)], capture_output=True, text=True, check=True
    )
    left = out.stdout.split()
    assert all(os.path.exists(p) for p in left) and len(list(Path(ipc_dir(r.output_dir)).glob("*.json"))) == 1
    assert len(tp.remove_stale_pools(r)) == 1
    assert not any(os.path.exists(p) for p in left) and not list(Path(ipc_dir(r.output_dir)).glob("*.json"))


def test_doctor_checks_the_transport_instead_of_mooncake(tmp_path, monkeypatch):
    """doctor with a cuda_ipc recipe: a ``cuda_ipc transport`` check (SGLang patch spec-capture-cuda-ipc, peer
    access) instead of the Mooncake master's; on this CPU box's unpatched sglang it fails naming that patch, with a
    fix."""
    from specforge_kimi.setup import doctor, setup_patches

    raw = _raw()
    raw["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    checks = {c.name: c for c in doctor.run_checks(str(path))}
    assert "mooncake master" not in checks
    ipc = checks["cuda_ipc transport"]
    assert (
        ipc.status == "fail"
        and "SGLang patch spec-capture-cuda-ipc is not applied" in ipc.detail
        and "setup" in ipc.fix
    )
    monkeypatch.setattr(setup_patches, "cuda_ipc_gaps", lambda: [])
    (ok,) = doctor.check_transport(compile_plan(path))
    assert ok.status == "ok" and "pool 1.00 GiB on GPU 0" in ok.detail


def test_trainer_ranks_map_pools_on_their_own_gpu(monkeypatch):
    from specforge_kimi.transport.store import rank_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert str(rank_device()) == "cuda:3"


def test_run_report_names_the_transport(tmp_path):
    """``run-report`` reads the transport from the launch sheet ``launch`` renders; a sheet written before it named
    one is read from the trainer ranks' variable."""
    import json

    from specforge_kimi.evaluate.run_report import transport

    for name, want in (("tiny-k25-tp1-h200.yaml", "cuda_ipc"), ("tiny-k25-tp2-h200x2.yaml", "mooncake")):
        run = tmp_path / name
        render(load_recipe(RECIPES / name), run / "rendered")
        assert transport(run) == want
        sheet = json.loads((run / "rendered" / "launch.json").read_text())
        sheet.pop("transport")
        (run / "rendered" / "launch.json").write_text(json.dumps(sheet))
        assert transport(run) == want
    assert transport(tmp_path / "not-a-run") is None


def test_run_report_names_the_trainer_step(tmp_path):
    """``run-report`` reads the trainer step from the launch sheet: the recipe's fields as rendered, SpecForge's
    own step for a sheet written before the fields existed."""
    import json

    from specforge_kimi.evaluate.run_report import trainer_step

    raw = _raw()
    raw["trainer"].update(step_empty_cache=True, cuda_alloc_conf="expandable_segments:True")
    run = tmp_path / "run"
    render(_load(tmp_path, raw), run / "rendered")
    assert trainer_step(run) == {
        "SPECFORGE_EAGLE3_EMPTY_CACHE": "1",
        "SPECFORGE_ADAMW_FUSED": "1",
        "SPECFORGE_EAGLE3_FEWER_SYNCS": "0",
        "SPECFORGE_EAGLE3_CHUNKED_LOSS": "0",
        "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE": "0",
        "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK": "0",
        "SPECFORGE_KIMI_FLEX_AUTOTUNE": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ": "0",
        "SPECFORGE_KIMI_EAGLE3_FA_KERNEL": "0",
        "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    shipped = tmp_path / "shipped"
    render(load_recipe(RECIPES / "tiny-k25-tp1-h200.yaml"), shipped / "rendered")
    shipped_step = {
        "SPECFORGE_EAGLE3_EMPTY_CACHE": "0",
        "SPECFORGE_ADAMW_FUSED": "1",
        "SPECFORGE_EAGLE3_FEWER_SYNCS": "0",
        "SPECFORGE_EAGLE3_CHUNKED_LOSS": "0",
        "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE": "0",
        "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK": "0",
        "SPECFORGE_KIMI_FLEX_AUTOTUNE": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ": "0",
        "SPECFORGE_KIMI_EAGLE3_FA_KERNEL": "0",
        "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP": "0",
    }
    assert trainer_step(shipped) == shipped_step
    sheet = json.loads((shipped / "rendered" / "launch.json").read_text())
    for key in shipped_step:
        sheet["env"].pop(key)
    (shipped / "rendered" / "launch.json").write_text(json.dumps(sheet))
    assert trainer_step(shipped) == {
        "SPECFORGE_EAGLE3_EMPTY_CACHE": "1",
        "SPECFORGE_ADAMW_FUSED": "0",
        "SPECFORGE_EAGLE3_FEWER_SYNCS": "0",
        "SPECFORGE_EAGLE3_CHUNKED_LOSS": "0",
        "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE": "0",
        "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK": "0",
        "SPECFORGE_KIMI_FLEX_AUTOTUNE": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ": "0",
        "SPECFORGE_KIMI_EAGLE3_FA_KERNEL": "0",
        "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP": "0",
    }
    assert trainer_step(tmp_path / "not-a-run") is None


def test_stale_pools_are_removed_around_each_attempt(tmp_path, monkeypatch):
    """A server SIGKILLed with the launcher (a ``kill -9`` of the whole tree, a reboot) leaves its pool files;
    ``run_attempts`` -- what ``launch`` and the drills both run -- clears them before each attempt (the first, and
    each whole-run restart) and after the last."""
    import subprocess

    from specforge_kimi.run import ledger, resume

    raw = _raw()
    raw["output_dir"] = str(tmp_path / "run")
    r = _load(tmp_path, raw)
    code = (
        "import sys; from specforge_kimi.transport.writer import IpcCaptureWriter; "
        "w = IpcCaptureWriter(pool_bytes=1 << 16, pool_dir=sys.argv[1], device='cpu'); "
        "print(w.info.slots_path, w.info.handle['path'], flush=True); import os; os._exit(0)"
    )

    def kill_a_server() -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code, ipc_dir(r.output_dir)], capture_output=True, text=True, check=True
        )
        return out.stdout.split() + [str(p) for p in Path(ipc_dir(r.output_dir)).glob("*.json")]

    seen = []

    def run(plan) -> int:  # what each attempt finds when its services would start; its own server is then killed
        seen.append([p for p in left if os.path.exists(p)])
        left[:] = kill_a_server()
        return 1

    left = kill_a_server()
    assert all(os.path.exists(p) for p in left) and len(left) == 3
    monkeypatch.setattr(resume, "begin_attempt", lambda *_a, **_k: "plan")
    monkeypatch.setattr(resume, "read_record", lambda _out: None)
    monkeypatch.setattr(ledger, "durable_step", lambda _out: 5)  # past the start: the failed attempt is restarted
    assert resume.run_attempts(r, "plan", run, resume=False, restarts=1) == 1
    assert seen == [[], []] and len(left) == 3 and not any(os.path.exists(p) for p in left)


@pytest.mark.parametrize(
    "family,layers,passthrough,prefetch",
    [("eagle3", 4, 3, 4), ("dflash", 5, 2, 8), ("dspark", 6, 2, 8)],  # dspark: N + its last hidden state
)
def test_feature_sizing_follows_the_draft_family(tmp_path, family, layers, passthrough, prefetch):
    if family == "eagle3":
        raw = _raw()
    else:
        raw = _raw("tiny-k25-tp1-h200-dflash.yaml")
        raw["trainer"]["family"] = family
        if family == "dspark":  # SpecForge's DSpark draft is GQA: fewer kv heads than query heads
            raw["trainer"]["draft"].update(num_key_value_heads=4, architectures=["DSparkDraftModel"])
    r = _load(tmp_path, raw)
    layout = tp.feature_layout(r)
    assert (layout.captured_layers + layout.captures_last_hidden, layout.passthrough_count) == (layers, passthrough)
    per_token = layers * 512 * 2 + passthrough * 8
    assert tp.feature_bytes_per_token(r) == per_token
    s = tp.sample_bytes(r)
    assert s == 1024 * per_token
    # both transports' sizing reads the same layout: the server's captured rows, every rank's prefetch, the pool
    assert tp.server_rows_bytes(r) == 2 * 16384 * layers * 512 * 2
    assert tp.prefetch_bytes(r) == prefetch * s
    assert tp.wanted_pool_bytes(r) == int((2 + prefetch + 8) * s / 0.8) + 1
    sizing = tp.sizing(r)
    assert (sizing.sample_bytes, sizing.prefetch_bytes) == (s, prefetch * s)
    high, _ = tp.watermarks(r)
    assert high == int(0.8 * tp.store_bytes(r)) - 8 * s
    mooncake = _load(tmp_path, {**raw, "server": {**raw["server"], "transport": "mooncake"}})
    assert tp.sizing(mooncake).sample_bytes == s
