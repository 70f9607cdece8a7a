"""The recipe's ``overlap:`` options (CUDA MPS, its SM split, its client priority, producer batching) compiled into
each role's environment and SpecForge's config, their refusals, bench/overlap_rates.py's rows for them, and the
launch's MPS daemon lifecycle with a fake ``nvidia-cuda-mps-control`` on PATH around SpecForge's real supervisor
(``run_commands``)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan import transport_plan
from specforge_kimi.plan.run_plan import compile_plan

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "kimi-k25-slice-h200.yaml"
PIPE, PCT = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIO = "CUDA_MPS_CLIENT_PRIORITY"


def _raw(tmp_path: Path, **overlap) -> dict:
    raw = yaml.safe_load(RECIPE.read_text())
    raw["output_dir"] = str(tmp_path / "run")
    if overlap:
        raw["overlap"] = overlap
    return raw


def test_overlap_off_by_default_adds_nothing(tmp_path):
    plan = compile_plan(_raw(tmp_path), rendered_dir=tmp_path / "r")
    for env in (plan.server_env, plan.process_env):
        assert PIPE not in env and PCT not in env and PRIO not in env
    assert plan.mps_dirs is None and "mps" not in plan.sheet()
    assert "producer_concurrency" not in plan.specforge_config["runtime"]


def test_mps_gives_every_role_the_private_pipe_and_its_sm_share(tmp_path):
    plan = compile_plan(_raw(tmp_path, mps=True, server_sm_percent=40, trainer_sm_percent=60), rendered_dir=tmp_path)
    pipe, log = plan.mps_dirs
    assert Path(pipe) == (tmp_path / "run" / "mps" / "pipe").absolute() and Path(log).name == "log"
    assert plan.server_env[PIPE] == plan.process_env[PIPE] == pipe
    assert (plan.server_env[PCT], plan.process_env[PCT]) == ("40", "60")
    assert plan.sheet()["mps"] == {"pipe_dir": pipe, "log_dir": log}
    only_mps = compile_plan(_raw(tmp_path, mps=True), rendered_dir=tmp_path / "m")
    assert only_mps.server_env[PIPE] == only_mps.process_env[PIPE] and PCT not in only_mps.process_env
    assert PRIO not in only_mps.server_env and PRIO not in only_mps.process_env


@pytest.mark.parametrize(("low", "server", "trainer"), [("trainer", "0", "1"), ("server", "1", "0")])
def test_below_normal_priority_lowers_the_named_side_only(tmp_path, low, server, trainer):
    plan = compile_plan(_raw(tmp_path, mps=True, below_normal_priority=low), rendered_dir=tmp_path)
    # process_env: the producer and every trainer rank (the set trainer_sm_percent reaches)
    assert (plan.server_env[PRIO], plan.process_env[PRIO]) == (server, trainer)
    assert PCT not in plan.server_env and PCT not in plan.process_env  # independent of the SM split


def test_mps_pipe_moves_under_tmp_when_the_run_dir_is_too_long(tmp_path):
    raw = _raw(tmp_path, mps=True)
    raw["output_dir"] = str(tmp_path / ("d" * 90))
    pipe, log = compile_plan(raw, rendered_dir=tmp_path).mps_dirs
    assert pipe.startswith("/tmp/specforge-kimi-mps-") and len(pipe + "/control") <= 100
    assert Path(pipe).parent == Path(log).parent


def test_producer_concurrency_reaches_specforge_and_the_watermarks(tmp_path):
    one = compile_plan(_raw(tmp_path), rendered_dir=tmp_path / "a")
    three = compile_plan(_raw(tmp_path, producer_concurrency=3), rendered_dir=tmp_path / "b")
    assert three.specforge_config["runtime"]["producer_concurrency"] == 3
    assert transport_plan.overshoot_samples(three.recipe) == 3 * transport_plan.PRODUCER_LEASE
    s = transport_plan.sample_bytes(three.recipe)
    high1 = one.specforge_config["runtime"]["resident_high_watermark_bytes"]
    high3 = three.specforge_config["runtime"]["resident_high_watermark_bytes"]
    store1, store3 = transport_plan.store_bytes(one.recipe), transport_plan.store_bytes(three.recipe)
    assert high1 == int(0.8 * store1) - 8 * s and high3 == int(0.8 * store3) - 24 * s


@pytest.mark.parametrize(
    ("overlap", "nnodes", "says"),
    [
        ({"server_sm_percent": 50}, 1, "need overlap.mps: true"),
        ({"trainer_sm_percent": 50}, 1, "need overlap.mps: true"),
        ({"below_normal_priority": "trainer"}, 1, "below_normal_priority needs overlap.mps: true"),
        ({"mps": True, "below_normal_priority": "low"}, 1, "below_normal_priority"),
        ({"mps": True, "server_sm_percent": 0}, 1, "server_sm_percent"),
        ({"mps": True, "trainer_sm_percent": 101}, 1, "trainer_sm_percent"),
        ({"producer_concurrency": 0}, 1, "producer_concurrency"),
        ({"mps": True}, 2, "single-node only"),
        ({"mps": "yes please"}, 1, "overlap.mps"),
    ],
)
def test_overlap_refusals_are_one_line(tmp_path, overlap, nnodes, says):
    raw = _raw(tmp_path, **overlap)
    if nnodes > 1:
        raw["gpus"]["nnodes"] = nnodes
        raw["server"]["host"] = "10.0.0.1"
        raw["trainer"]["consumer_state_dir"] = "/local/state"
        raw["server"]["transport"] = "mooncake"
    with pytest.raises(KimiInputError) as err:
        compile_plan(raw, rendered_dir=tmp_path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_overlap_rates_measures_each_side_at_low_priority(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_overlap_rates", ROOT / "bench" / "overlap_rates.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "o.json"
    assert bench.main(["--dry-run", "--out", str(out), "--options", "mps+trainer-low,mps+server-low"]) == 0
    rows = {r["option"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["mps+trainer-low"]["overlap"] == {"mps": True, "below_normal_priority": "trainer"}
    assert rows["mps+server-low"]["overlap"] == {"mps": True, "below_normal_priority": "server"}
    assert all(r["colocated_tokens_per_s"] and r["overlap_vs_serial"] for r in rows.values())
    for option, row in rows.items():  # each row's overlap section is one the recipe schema accepts
        compile_plan(_raw(tmp_path, **row["overlap"]), rendered_dir=tmp_path / option)


# -- the daemon's lifecycle, a fake nvidia-cuda-mps-control on PATH ------------------------------------------
FAKE = """#!/bin/sh
# fake nvidia-cuda-mps-control: records each call in $EVENTS; -d leaves the control socket's name in the pipe dir
if [ "$1" = "-d" ]; then
  [ -n "$FAKE_MPS_REFUSE" ] && { echo "$FAKE_MPS_REFUSE" >&2; exit 1; }
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY $CUDA_VISIBLE_DEVICES" >> "$EVENTS"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read line
echo "$line $CUDA_MPS_PIPE_DIRECTORY" >> "$EVENTS"
rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-cuda-mps-control"
    tool.write_text(FAKE)
    tool.chmod(0o755)
    events = tmp_path / "events"
    events.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("EVENTS", str(events))
    return events


def _supervised(tmp_path: Path, service_rc: int):
    """A SpecForge ``LaunchPlan`` with one role that records whether the daemon runs (its marker in the pipe
    directory it was given) into the events file, then exits ``service_rc``."""
    from specforge.launch_plan import CommandSpec, LaunchPlan

    script = 'if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then echo role-saw-daemon >> "$EVENTS"; fi; exit ' + str(
        service_rc
    )
    role = CommandSpec("role", ("/bin/sh", "-c", script), {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe")})
    return LaunchPlan(
        kind="managed_supervisor",
        role="both",
        commands=(role,),
        services=(),
        managed_root=str(tmp_path / "supervisor"),
        managed_ports=(),
        shutdown_grace_s=2.0,
    )


@pytest.mark.parametrize("service_rc", [0, 3])
def test_launch_starts_mps_before_the_roles_and_stops_it_after(tmp_path, fake_mps, service_rc):
    from specforge_kimi.run.launch import run_plan

    pipe, log = str(tmp_path / "mps" / "pipe"), str(tmp_path / "mps" / "log")
    rc = run_plan(_supervised(tmp_path, service_rc), mps_dirs=(pipe, log), gpus="0", managed_preflight=lambda _p: None)
    assert rc == service_rc
    assert fake_mps.read_text().splitlines() == [f"start {pipe} {log} 0", "role-saw-daemon", f"quit {pipe}"]
    for d in (pipe, log):
        assert stat.S_IMODE(Path(d).stat().st_mode) == 0o700


def test_launch_stops_mps_when_the_supervisor_raises(tmp_path, fake_mps, monkeypatch):
    import specforge.launch_plan

    from specforge_kimi.run.launch import run_plan

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(specforge.launch_plan, "run_commands", interrupted)
    pipe = str(tmp_path / "mps" / "pipe")
    with pytest.raises(KeyboardInterrupt):
        run_plan(_supervised(tmp_path, 0), mps_dirs=(pipe, str(tmp_path / "mps" / "log")))
    assert fake_mps.read_text().splitlines()[-1] == f"quit {pipe}"


def test_launch_refuses_in_one_line_when_the_daemon_cannot_start(tmp_path, fake_mps, monkeypatch):
    from specforge_kimi.run.launch import run_plan

    monkeypatch.setenv("FAKE_MPS_REFUSE", "An instance of this daemon is already running")
    with pytest.raises(KimiInputError) as err:
        run_plan(_supervised(tmp_path, 0), mps_dirs=(str(tmp_path / "p"), str(tmp_path / "l")))
    msg = str(err.value)
    assert "did not start" in msg and "already running" in msg and "\n" not in msg
    assert fake_mps.read_text() == "" and not (tmp_path / "supervisor").exists()  # no role started


def test_launch_refuses_when_mps_is_not_installed(tmp_path, monkeypatch):
    from specforge_kimi.run.launch import run_plan

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(KimiInputError, match="not on PATH"):
        run_plan(_supervised(tmp_path, 0), mps_dirs=(str(tmp_path / "p"), str(tmp_path / "l")))


def test_mps_dir_not_ours_is_refused(tmp_path):
    from specforge_kimi.run import mps

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(KimiInputError, match="not a directory of ours"):
        mps.private_dir(tmp_path / "link")


def test_a_daemon_left_by_a_killed_launcher_is_stopped_before_the_next_start(tmp_path, fake_mps):
    from specforge_kimi.run import mps

    pipe, log = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    pipe.mkdir(parents=True)
    (pipe / mps.CONTROL_SOCKET).touch()  # the launcher was SIGKILLed: its finally never sent quit
    mps.start(str(pipe), str(log), "0")
    assert fake_mps.read_text().splitlines() == [f"quit {pipe}", f"start {pipe} {log} 0"]


def test_stop_leftover_quits_only_a_serving_daemon(tmp_path, fake_mps):
    from specforge_kimi.run import mps

    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    assert mps.stop_leftover(None) is None and mps.stop_leftover((str(pipe), str(log))) is None
    assert fake_mps.read_text() == ""
    (pipe / mps.CONTROL_SOCKET).touch()
    assert "stopped a CUDA MPS daemon" in mps.stop_leftover((str(pipe), str(log)))
    assert fake_mps.read_text().splitlines() == [f"quit {pipe}"]


def test_stop_quits_the_runs_left_daemon(tmp_path, monkeypatch):
    from specforge_kimi.run import mps, stop

    quit_on = []
    monkeypatch.setattr(mps, "stop_leftover", lambda dirs: quit_on.append(dirs) or "stopped")
    monkeypatch.setattr(stop, "_take_lock", lambda *a, **k: None)
    monkeypatch.setattr(stop.run_guard, "run_processes", lambda out: [])
    plan = compile_plan(_raw(tmp_path, mps=True), rendered_dir=tmp_path / "r")
    Path(plan.recipe.output_dir).mkdir(parents=True, exist_ok=True)
    done = stop.stop_run(plan.recipe, say=lambda _s: None)
    assert quit_on == [plan.mps_dirs] and done["mps"] == "stopped"


def test_a_parent_of_the_mps_directories_owned_by_another_user_is_refused(tmp_path, fake_mps):
    from specforge_kimi.run import mps

    base = tmp_path / "specforge-kimi-mps-0123456789abcdef"  # the /tmp fallback's predictable name, taken first
    base.mkdir()
    os.chown(base, 65534, 65534)
    with pytest.raises(KimiInputError, match="not a directory of ours") as err:
        mps.start(str(base / "pipe"), str(base / "log"))
    assert "\n" not in str(err.value) and fake_mps.read_text() == ""
